#!/usr/bin/env bash
# Guest test: pooled volumes as kernel block devices, the way a user gets them. One
# nvpool-control and four nvpool-target daemons (file devices, one rack each) on the
# guest's loopback; a pool over their devices and two RAID10 volumes placed on it by the
# control plane; each volume attached with `nvpool volume attach`, one through ublk
# (/dev/ublkbN), one through the kernel nbd driver (/dev/nbdN). Per front-end:
#   round trip  ext4 with a small-file dataset and a large file (checksums), detach
#               refused while mounted, detach (the device goes), attach again, e2fsck,
#               every checksum and the dataset verified, `volume ls` shows the device
#   degraded    fio with verification on the raw device while one target is killed
#               with SIGKILL: no I/O error, the volume reported degraded; the target
#               restarts and its stale copies resync partially while the volume stays
#               attached (no command); a clean detach, and a new attach reads back
#               (fio verify) all that was written, from the healed copies too; for
#               nbd, the agent killed with SIGKILL and detach releasing its device at once
#   growth      (nbd) the other volume deleted, the volume grown by half while ext4 is
#               mounted on it: the device grows live, resize2fs online, e2fsck clean
# The serve_blockdev tests (ublk-fs.sh, nbd-fs.sh) cover one namespace per front-end;
# this one covers the control plane, placement and the volume engine behind them.
#
# With --env POOLED_TRANSPORT=rdma the targets also listen for NVMe/RDMA on soft-RoCE
# (rxe on a dummy link) and register that address; the volume engine then reaches every
# extent over RDMA (checked: the serving process holds RDMA queue pairs, no TCP
# connection to a target port). That run covers the ublk volume only.
#
#   cargo build --release -p nvpool-target -p nvpool-control -p nvpool-cli
#   scripts/vm/run-guest-test scripts/vm/guest/pooled-fs.sh --bin target/release/nvpool \
#       --bin target/release/nvpool-control --bin target/release/nvpool-target
#
# vm-rdma: yes
# vm-modules: ublk_drv nbd ext4
# vm-bins: fio mkfs.ext4 e2fsck resize2fs fallocate blockdev jq ss
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. /nvpool/lib/common.sh
# shellcheck source=lib/rdma.sh
. /nvpool/lib/rdma.sh

POOLED_TRANSPORT=${POOLED_TRANSPORT:-tcp}
if [[ $POOLED_TRANSPORT == rdma ]]; then
    rdma_up
    # cluster.sh: every target also listens for NVMe/RDMA there.
    CLUSTER_RDMA_ADDR=$RDMA_ADDR
    step_ok rxe-up
fi

WORK=/tmp/pooled
CP_PORT=4430
TARGETS=4
TARGET_PORT_BASE=4420
ADMIN_PORT_BASE=4440
# Sparse files on the guest's tmpfs: only written data takes RAM. Two volumes of four
# 1 GiB extents each fill the four devices.
DEVICE_SIZE=2G
POOL=pool0
VOLUME_SIZE=2G
VOLUME_BYTES=$((2 << 30))
LAYOUT=(--layout raid10 --stripe-width 2 --copies 2)
LAYOUT_TEXT="raid10 w=2 s=64K c=2"
BLOCK_BYTES=4096
SMALL_FILES=300
LARGE_MIB=24
# The degraded run: fio writes FIO_MIB and reads it back; the target dies once
# KILL_AFTER_MIB have reached the device, well inside the write phase.
FIO_MIB=64
KILL_AFTER_MIB=8
# Generous under TCG.
START_S=90
STOP_S=60
DEGRADED_S=60
# Resync of the copies the victim held, under TCG.
HEAL_S=180
FIO_S=300
LOG_TAIL_LINES=20

HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:6e76706f-6f6c-4e00-8000-706f6f6c6673

ROW_TARGETS=4
CP_ARGS=()
# shellcheck source-path=SCRIPTDIR source=lib/cluster.sh
. /nvpool/lib/cluster.sh

# ----- attach / detach -----

# attach NAME FRONTEND: `nvpool volume attach`; sets DEV, DEV_NAME and UBLK_ID, checks
# what the kernel shows.
attach() {
    local name=$1 fe=$2 size lbs
    nvpool volume attach "$name" --frontend "$fe" >"/tmp/out.attach" 2>"/tmp/err.attach" ||
        die "attach $name --frontend $fe: $(tail -n 5 /tmp/err.attach)"
    DEV=$(tail -n 1 /tmp/out.attach)
    DEV_NAME=${DEV#/dev/}
    case $fe in
        ublk) [[ $DEV_NAME =~ ^ublkb[0-9]+$ ]] ;;
        nbd) [[ $DEV_NAME =~ ^nbd[0-9]+$ ]] ;;
    esac || die "attach $name --frontend $fe printed '$DEV'"
    UBLK_ID=${DEV_NAME#ublkb}
    [[ -b $DEV ]] || die "$DEV is not a block device"
    # The kernel takes the nbd size from the netlink connect; give it a moment.
    wait_until 10 "$DEV to get its size" nbd_sized "$fe"
    size=$(blockdev --getsize64 "$DEV")
    lbs=$(blockdev --getss "$DEV")
    [[ $size -eq $VOLUME_BYTES ]] || die "$DEV has $size bytes, expected $VOLUME_BYTES"
    [[ $lbs -eq $BLOCK_BYTES ]] || die "$DEV has $lbs-byte blocks, expected $BLOCK_BYTES"
    [[ $(volume_field "$name" 'Attached to') == "$HOSTNQN" ]] ||
        die "$name: attached to '$(volume_field "$name" 'Attached to')', expected $HOSTNQN"
    UUID=$(volume_field "$name" UUID)
    [[ -f $NVPOOL_RUN_DIR/volumes/$UUID.json ]] || die "attach left no record for $name"
}

nbd_sized() {
    [[ $1 != nbd ]] || [[ -e /sys/block/$DEV_NAME/pid && $(cat "/sys/block/$DEV_NAME/size") -gt 0 ]]
}

# device_gone FRONTEND: the kernel device of the last attach is no more. A ublk device
# goes with its control node; an nbd device loses its configuration (pid) and, with
# destroy-on-disconnect, may go altogether.
device_gone() {
    case $1 in
        ublk) [[ ! -e /sys/block/$DEV_NAME && ! -e /sys/class/ublk-char/ublkc$UBLK_ID ]] ;;
        nbd) [[ ! -e /sys/block/$DEV_NAME/pid ]] ;;
    esac
}

# detach NAME FRONTEND: `nvpool volume detach`, then nothing may be left.
detach() {
    local name=$1 fe=$2
    quiet "detach-$name" nvpool volume detach "$name"
    wait_until 10 "$DEV to go after detach" device_gone "$fe"
    [[ ! -e $NVPOOL_RUN_DIR/volumes/$UUID.json ]] || die "detach left the record of $name"
    [[ $(listed_device "$name") == - ]] || die "volume ls still shows $(listed_device "$name")"
    [[ $(volume_field "$name" 'Attached to') == - ]] ||
        die "$name still attached to '$(volume_field "$name" 'Attached to')'"
}

# ----- round trip -----

# Checksums of every file under the mountpoint, relative to it.
checksum_tree() {
    (cd "$1" && find . -type f | sort | xargs sha256sum)
}

# round_trip NAME FRONTEND: ext4 with data, detach, attach again, everything verified.
round_trip() {
    local name=$1 fe=$2 mnt=/mnt/$1 sums=$WORK/$1.sums first
    attach "$name" "$fe"
    first=$DEV
    step_ok "$fe-attach"
    quiet "mkfs-$name" mkfs.ext4 -F "$DEV"
    mkdir -p "$mnt"
    mount -t ext4 "$DEV" "$mnt"
    # 1..16 KiB files, each with a header and content that `dataset epoch` verifies.
    quiet "dataset-$name" nvpool dataset make "$mnt/ds" --files "$SMALL_FILES" \
        --min-size 1K --max-size 16K --seed 11
    dd if=/dev/urandom of="$mnt/large" bs=1M count="$LARGE_MIB" conv=fsync 2>/dev/null
    checksum_tree "$mnt" >"$sums"
    [[ $(wc -l <"$sums") -eq $((SMALL_FILES + 1)) ]] ||
        die "checksummed $(wc -l <"$sums") files, expected $((SMALL_FILES + 1))"
    # Detaching a mounted device would pull it from under the filesystem.
    if nvpool volume detach "$name" >/tmp/out.detach-mounted 2>&1; then
        die "detach of $name succeeded while $DEV was mounted"
    fi
    grep -q 'is mounted' /tmp/out.detach-mounted ||
        die "detach refused for another reason: $(cat /tmp/out.detach-mounted)"
    [[ -b $DEV && $(listed_device "$name") == "$DEV" ]] || die "a refused detach took $DEV"
    umount "$mnt"
    detach "$name" "$fe"
    step_ok "$fe-write-detach"

    attach "$name" "$fe"
    quiet "e2fsck-$name" e2fsck -fn "$DEV"
    mount -t ext4 "$DEV" "$mnt"
    quiet "verify-$name" sh -c "cd '$mnt' && sha256sum -c '$sums'"
    quiet "epoch-$name" nvpool dataset epoch "$mnt/ds"
    grep -q "^$SMALL_FILES files .* read and verified" "/tmp/out.epoch-$name" ||
        die "dataset epoch: $(cat "/tmp/out.epoch-$name")"
    [[ $(listed_device "$name") == "$DEV" ]] ||
        die "volume ls shows '$(listed_device "$name")' for $name, expected $DEV"
    umount "$mnt"
    printf '  %s: %s, then %s after detach + attach: e2fsck clean, %s files verified\n' \
        "$name" "$first" "$DEV" "$(wc -l <"$sums")"
    detach "$name" "$fe"
    step_ok "$fe-reattach-verify"
}

# ----- degraded -----

written_mib() {
    # Field 7 of the stat file: sectors written.
    echo $(($(awk '{ print $7 }' "/sys/block/$DEV_NAME/stat") / 2048))
}

fio_progressed() {
    exited "$fio_pid" && die "fio ended before the kill: $(tail -n 5 "$fio_out")"
    [[ $(written_mib) -ge $KILL_AFTER_MIB ]]
}

volume_is() {
    [[ $(volume_field "$1" Status) == "$2" ]]
}

# in_sync NAME: online, no copy stale, no copy job running.
in_sync() {
    nvpool volume info "$1" -o json |
        jq -e '.status == "online" and (.failed_extents | length) == 0 and (.copy_jobs | length) == 0' \
            >/dev/null
}

# degraded NAME FRONTEND COPY: fio write + verify through the device while the target
# of extent COPY (1-based, in extent order) dies; then the target comes back and the
# volume is detached cleanly.
degraded() {
    local name=$1 fe=$2 victim vi rc=0 at_kill killed_at fio_s failed history copied
    attach "$name" "$fe"
    victim=$(extent_targets "$name" | sed -n "$3p")
    vi=${victim#t}
    [[ -n $victim && -n ${TARGET_PIDS[vi]:-} ]] || die "no target for extent $3 of $name"
    fio_out=$WORK/fio-$name.out
    fio --name="deg-$name" --filename="$DEV" --ioengine=libaio --direct=1 --rw=randwrite \
        --bs=16k --iodepth=16 --size="${FIO_MIB}M" --verify=crc32c --verify_fatal=1 \
        --do_verify=1 --verify_state_save=0 >"$fio_out" 2>&1 &
    fio_pid=$!
    wait_until "$FIO_S" "fio to write ${KILL_AFTER_MIB} MiB to $DEV" fio_progressed
    at_kill=$(written_mib)
    killed_at=$(date +%s)
    kill -KILL "${TARGET_PIDS[vi]}"
    wait "${TARGET_PIDS[vi]}" 2>/dev/null || true
    wait_until "$FIO_S" "fio to finish with $victim dead" exited "$fio_pid"
    wait "$fio_pid" || rc=$?
    fio_s=$(($(date +%s) - killed_at))
    if [[ $rc -ne 0 ]] || ! grep -q 'err= 0' "$fio_out"; then
        tail -n "$LOG_TAIL_LINES" "$fio_out"
        die "fio exited $rc through $DEV after $victim was killed"
    fi
    # The host reports the copy it gave up; the control plane also sees the missed
    # heartbeats.
    wait_until "$DEGRADED_S" "$name to be reported degraded" volume_is "$name" degraded
    # The agent's log names every copy the volume engine gave up: only the victim's.
    failed=$(grep "volume=$UUID" "$NVPOOL_RUN_DIR/agent.log" |
        sed -nE 's/.*extent copy failed; serving from the others.* target=([^ ]+).*/\1/p' |
        sort -u | tr '\n' ' ')
    [[ $failed == "$victim " ]] || die "copies given up on '$failed', expected $victim only"
    printf '  %s: %s killed after %s MiB written; fio wrote and verified %s MiB with no' \
        "$name" "$victim" "$at_kill" "$FIO_MIB"
    printf ' error, done %ss after the kill; its copy given up, volume degraded\n' "$fio_s"
    step_ok "$fe-degraded"

    # The target comes back (once its missed heartbeats made it offline, so that its
    # return is seen). The copy it holds missed writes: the control plane resyncs it
    # while the volume stays attached, copying only the regions written meanwhile,
    # and the host reads it again once it is in sync.
    wait_until "$DEGRADED_S" "$victim to be reported offline" target_is "$victim" offline
    start_target "$vi"
    wait_until "$START_S" "$victim to come back online" target_is "$victim" online
    wait_until "$HEAL_S" "$name to heal (online, nothing stale)" in_sync "$name"
    history=$(nvpool volume history "$name" -o json)
    jq -e 'length > 0 and all(.kind == "resync-partial" and .result == "done")' \
        <<<"$history" >/dev/null || die "$name: unexpected copy history: $history"
    copied=$(jq '[.[].bytes_copied] | add' <<<"$history")
    printf '  %s: %s back; its copies resynced partially (%s bytes) with the volume attached\n' \
        "$name" "$victim" "$copied"
    step_ok "$fe-healed"
    detach "$name" "$fe"
    step_ok "$fe-target-back-detach"

    # Attached again: every copy is read, the healed one too; fio reads back and
    # verifies everything it wrote.
    attach "$name" "$fe"
    quiet "verify-only-$name" fio --name="deg-$name" --filename="$DEV" --ioengine=libaio \
        --direct=1 --rw=randread --bs=16k --iodepth=16 --size="${FIO_MIB}M" \
        --verify=crc32c --verify_fatal=1 --verify_only --verify_state_save=0
    printf '  %s: attached again, fio verified all %s MiB from the healed copies\n' \
        "$name" "$FIO_MIB"
    step_ok "$fe-verified-after-heal"
    if [[ $fe == nbd ]]; then
        kill9_detach "$name"
    else
        detach "$name" "$fe"
    fi
}

# kill9_detach NAME: the agent serving the volume dies with SIGKILL; `nvpool volume
# detach` starts a new one, which disconnects the nbd device the dead one left at once
# (the kernel alone would wait for its dead-connection timeout, 30 s), and nothing is
# left.
kill9_detach() {
    local name=$1 pid t0
    pid=$(sed -nE 's/.*"pid": *([0-9]+).*/\1/p' "$NVPOOL_RUN_DIR/volumes/$UUID.json")
    [[ -n $pid ]] || die "no agent pid in the record of $name"
    kill -KILL "$pid"
    wait_until 10 "the agent serving $name to die" exited "$pid"
    t0=$(date +%s)
    detach "$name" nbd
    printf '  %s: agent killed; detach released %s in %ss\n' "$name" "$DEV" \
        "$(($(date +%s) - t0))"
    step_ok nbd-kill9-detach
}

# ----- online growth -----

dev_bytes_are() {
    [[ $(blockdev --getsize64 "$DEV") -eq $1 ]]
}

# grow_online NAME: ext4 mounted on the volume's nbd device; the volume grows by half
# (`nvpool volume resize`), the agent shows the new size on the live device
# (NBD_CMD_RECONFIGURE), resize2fs grows the mounted file system, a file larger than
# the old volume is allocated, and e2fsck finds it all consistent.
grow_online() {
    local name=$1 mnt=/mnt/$1 want=$((VOLUME_BYTES * 3 / 2)) sum kib
    attach "$name" nbd
    quiet "mkfs-grow-$name" mkfs.ext4 -F "$DEV"
    mount -t ext4 "$DEV" "$mnt"
    dd if=/dev/urandom of="$mnt/before" bs=1M count=16 conv=fsync 2>/dev/null
    sum=$(sha256sum <"$mnt/before")
    quiet "resize-$name" nvpool volume resize "$name" --size "$((want >> 20))M"
    wait_until 60 "$DEV to grow to $want bytes while mounted" dev_bytes_are "$want"
    quiet "resize2fs-$name" resize2fs "$DEV"
    kib=$(df -k "$mnt" | awk 'END { print $2 }')
    [[ $kib -gt $((VOLUME_BYTES >> 10)) ]] || die "ext4 on $DEV has $kib KiB after resize2fs"
    fallocate -l "$((VOLUME_BYTES + (256 << 20)))" "$mnt/past-the-old-end" ||
        die "cannot allocate more than the old volume on the grown file system"
    [[ $(sha256sum <"$mnt/before") == "$sum" ]] || die "data written before the growth changed"
    umount "$mnt"
    quiet "e2fsck-grown-$name" e2fsck -fn "$DEV"
    printf '  %s: grown online to %s MiB on %s, ext4 grown mounted (%s KiB), e2fsck clean\n' \
        "$name" "$((want >> 20))" "$DEV" "$kib"
    detach "$name" nbd
    step_ok nbd-grow-online
}

stop_cluster() {
    local i
    # The agent (started by the first attach, not our child) stops on SIGTERM.
    local agent
    agent=$(cat "$NVPOOL_RUN_DIR/agent.pid" 2>/dev/null || true)
    if [[ -n $agent ]]; then
        kill -TERM "$agent"
        wait_until "$STOP_S" "the nvpool agent to exit" exited "$agent"
    fi
    for ((i = 0; i < TARGETS; i++)); do
        stop_daemon "${TARGET_PIDS[i]}" "nvpool-target t$i"
    done
    stop_daemon "$cp_pid" nvpool-control
    step_ok cluster-stop
}

# rdma_in_use: the serving process reaches its extents over NVMe/RDMA only: there are
# host-side RDMA queue pairs (the targets' are made by their nvpool-rdma-cm threads; the
# host's by connect threads that have ended, so they show no command) and no TCP
# connection from the serving process to a target.
rdma_in_use() {
    local qps tcp
    qps=$(rdma resource show qp 2>/dev/null | grep 'type RC' | grep -vc 'comm nvpool-rdma-cm' || true)
    # Target ports are TARGET_PORT_BASE.. (4420..4423); 4430 is the control plane.
    tcp=$(ss -tnp 2>/dev/null | grep '"nvpool",' | awk '$5 ~ /:442[0-9]$/' | wc -l)
    [[ $qps -ge 2 ]] || die "the serving process holds $qps RDMA queue pairs: $(rdma resource show qp 2>&1 | head -n 20)"
    [[ $tcp -eq 0 ]] || die "the serving process has $tcp TCP connections to targets: $(ss -tnp | grep nvpool)"
    printf '  volume served over NVMe/RDMA: %s host queue pairs, no TCP connection to a target\n' "$qps"
}

cluster_up
if [[ $POOLED_TRANSPORT == rdma ]]; then
    create_volume r10-ublk
    step_ok volume-create
    attach r10-ublk ublk
    rdma_in_use
    detach r10-ublk ublk
    step_ok rdma-paths
    round_trip r10-ublk ublk
    degraded r10-ublk ublk 4
    stop_cluster
    exit 0
fi
create_volume r10-ublk
create_volume r10-nbd
step_ok volume-create
round_trip r10-ublk ublk
degraded r10-ublk ublk 4
round_trip r10-nbd nbd
degraded r10-nbd nbd 1
# Room for growth: the other volume's extents go back to the pool.
quiet delete-r10-ublk nvpool volume delete r10-ublk
grow_online r10-nbd
# Every detach removed its record (the agent's log stays).
! compgen -G "$NVPOOL_RUN_DIR/volumes/*.json" >/dev/null ||
    die "records left: $(ls "$NVPOOL_RUN_DIR"/volumes/*.json)"
stop_cluster
