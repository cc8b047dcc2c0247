#!/usr/bin/env bash
# End to end on this host, as root: four nvpool-target daemons and a control
# plane on loopback; for RAID10, concat and RAID0 volumes: attach through
# FUSE + loop, mkfs.ext4, mount, write 1000 small files and one 1 GiB file,
# unmount, detach, attach again, verify every byte, e2fsck -fn. Then RAID1
# under fio with verify=crc32c while one target is killed with SIGKILL: no
# I/O error, verification passes, the volume is reported degraded.
#
# Usage: tests/e2e/attach-fuse.sh [BIN_DIR]   (default target/release)
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=$(cd "${1:-target/release}" && pwd)
source tests/e2e/lib.sh

need_host jq curl fio mkfs.ext4 e2fsck sha256sum

trap cleanup EXIT
BIG_MIB=${E2E_BIG_MIB:-1024}
SMALL_FILES=${E2E_SMALL_FILES:-1000}

log "starting a control plane and 4 targets in $E2E_DIR"
start_control_plane || { bad "control plane starts"; summary; exit 1; }
for i in 0 1 2 3; do start_target "$i" 8G; done
check "4 targets register and are online" wait_targets 4

# round_trip NAME LAYOUT-ARGS...
round_trip() {
    local name=$1
    shift
    local mnt=$E2E_DIR/mnt-$name
    mkdir -p "$mnt"
    if ! nvpool volume create "$name" --size 2G "$@" >/dev/null; then
        bad "$name: create"
        return
    fi
    local dev
    dev=$(nvpool volume attach "$name" --frontend fuse --host-nqn "$HOSTNQN")
    if [[ ! -b $dev ]]; then
        bad "$name: attach gives a block device (got '$dev')"
        return
    fi
    ok "$name: attached as $dev"
    check "$name: device is 2 GiB" test "$(blockdev --getsize64 "$dev")" -eq $((2 << 30))
    check "$name: mkfs.ext4" mkfs.ext4 -q -F "$dev"
    check "$name: mount" mount "$dev" "$mnt"
    check "$name: write $SMALL_FILES small files" \
        nvpool dataset make "$mnt/ds" --files "$SMALL_FILES" --seed 11
    check "$name: write a $BIG_MIB MiB file" \
        dd if=/dev/urandom of="$mnt/big" bs=1M count="$BIG_MIB" status=none conv=fsync
    local sum
    sum=$(sha256sum <"$mnt/big")
    check "$name: unmount" umount "$mnt"
    check "$name: detach" nvpool volume detach "$name" --host-nqn "$HOSTNQN"
    check "$name: the device is gone after detach" test ! -e "$NVPOOL_RUN_DIR/volumes/$(
        nvpool volume info "$name" -o json | jq -r .uuid).json"
    dev=$(nvpool volume attach "$name" --frontend fuse --host-nqn "$HOSTNQN")
    check "$name: attach again" test -b "$dev"
    check "$name: e2fsck -fn is clean" e2fsck -fn "$dev"
    check "$name: mount again" mount "$dev" "$mnt"
    check "$name: every small file verifies" nvpool dataset epoch "$mnt/ds"
    check "$name: the big file verifies" test "$(sha256sum <"$mnt/big")" = "$sum"
    check "$name: volume ls shows the device" \
        bash -c "'$BIN/nvpool' volume ls | grep -q '$dev'"
    umount "$mnt"
    check "$name: detach" nvpool volume detach "$name" --host-nqn "$HOSTNQN"
    check "$name: delete" nvpool volume delete "$name"
}

round_trip r10 --layout raid10 --stripe-width 2 --copies 2
round_trip cat --layout concat
round_trip r0 --layout raid0 --stripe-width 4

# Degraded: fio writes and verifies through RAID1 while a target dies.
log "RAID1 under fio; SIGKILL one target mid-run"
if nvpool volume create deg --size 1G --layout raid1 --copies 2 >/dev/null; then
    dev=$(nvpool volume attach deg --frontend fuse --host-nqn "$HOSTNQN")
    victim=$(nvpool volume info deg -o json | jq -r '.extents[1].target')
    vi=${victim#t}
    fio --name=deg --filename="$dev" --direct=1 --ioengine=libaio --iodepth=16 \
        --rw=randwrite --bs=16k --size=256M --verify=crc32c --verify_fatal=1 \
        --do_verify=1 --verify_state_save=0 --output="$E2E_DIR/fio.out" &
    fio_pid=$!
    sleep 3
    kill -9 "${TARGET_PIDS[vi]}"
    log "killed $victim (pid ${TARGET_PIDS[vi]})"
    if wait "$fio_pid"; then
        ok "deg: fio with verify=crc32c completes with no error while $victim is dead"
    else
        bad "deg: fio failed"
        cat "$E2E_DIR/fio.out"
    fi
    check "deg: fio reports no errors" grep -q "err= 0" "$E2E_DIR/fio.out"
    st=""
    for _ in $(seq 100); do
        st=$(nvpool volume info deg -o json | jq -r .status)
        [[ $st == degraded ]] && break
        sleep 0.2
    done
    check "deg: volume reported degraded (got $st)" test "$st" = degraded
    check "deg: detach with a target down (forced)" \
        nvpool volume detach deg --host-nqn "$HOSTNQN" --force
else
    bad "deg: create"
fi

summary
