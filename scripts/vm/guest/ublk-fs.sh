#!/usr/bin/env bash
# Guest test: a namespace of our target served as /dev/ublkbN by nvpool-initiator's ublk
# front-end (the serve_blockdev example), driven by the kernel: sysfs queue limits, ext4
# (mkfs, small files and a large one with checksums, fstrim, e2fsck, remount, verify),
# fio with verification on the raw device, write-zeroes and discard, SIGTERM (the device
# goes away), and kill -9 under I/O (what the kernel does, and our cleanup of the rest).
#
#   cargo build --release -p nvpool-target -p nvpool-initiator --example serve_blockdev
#   scripts/vm/run-guest-test scripts/vm/guest/ublk-fs.sh \
#       --bin target/release/nvpool-target --bin target/release/examples/serve_blockdev
#
# vm-modules: ublk_drv ext4
# vm-bins: fio mkfs.ext4 e2fsck fstrim blkdiscard blockdev
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. /nvpool/lib/common.sh

ADDR=127.0.0.1
PORT=4420
NQN=nqn.2026-11.io.nvpool:ublk-fs
SIZE_BYTES=$((512 << 20))
BLOCK_BYTES=4096
QUEUE_DEPTH=128
# What the front-end advertises (frontend/ublk.rs): 1 MiB transfers, 64 MiB discards,
# io_opt = the block size for a namespace (it has no preferred size).
MAX_HW_KB=1024
DISCARD_MAX_BYTES=$((64 << 20))
SMALL_FILES=300
LARGE_MIB=32
TARGET_LOG=/tmp/nvpool-target.log
SERVE_OUT=/tmp/serve.out
SERVE_LOG=/tmp/serve.log
# Generous under TCG: start-up includes connecting and adding the device.
START_S=90
STOP_S=60
# After kill -9 the kernel removes the block device by itself; wait this long for it.
GONE_S=60
LOG_TAIL_LINES=30

for prog in nvpool-target serve_blockdev; do
    command -v "$prog" >/dev/null ||
        die "$prog missing: give run-guest-test --bin target/release/nvpool-target" \
            "--bin target/release/examples/serve_blockdev"
done

logs_tail() {
    printf -- '--- serve_blockdev stderr (last %d lines) ---\n' "$LOG_TAIL_LINES"
    tail -n "$LOG_TAIL_LINES" "$SERVE_LOG" 2>/dev/null || true
    printf -- '--- nvpool-target log (last %d lines) ---\n' "$LOG_TAIL_LINES"
    tail -n "$LOG_TAIL_LINES" "$TARGET_LOG" 2>/dev/null || true
    ls -l /dev/ublk* 2>/dev/null || true
}
DIAG_HOOKS+=(logs_tail)

# kill -0 succeeds on a zombie, so look at the process state instead.
exited() {
    local state
    state=$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null) || return 0
    [[ $state == Z ]]
}

start_target() {
    NO_COLOR=1 nvpool-target --listen "$ADDR:$PORT" --admin-listen off \
        --state-dir /tmp/nvpool-state --allow-any-host \
        --export "$NQN=ram:$SIZE_BYTES,block_size=$BLOCK_BYTES" 2>"$TARGET_LOG" >&2 &
    target_pid=$!
    wait_until "$START_S" "nvpool-target on $ADDR:$PORT" target_up
    step_ok target-start
}

target_up() {
    exited "$target_pid" && die "nvpool-target exited during start-up"
    tcp_port_open "$ADDR" "$PORT"
}

serve_ready() {
    exited "$serve_pid" && die "serve_blockdev exited before printing DEVICE"
    grep -q '^DEVICE ' "$SERVE_OUT"
}

# start_serve: run serve_blockdev, wait for its DEVICE line; sets DEV, NAME, ID.
start_serve() {
    : >"$SERVE_OUT"
    serve_blockdev --frontend ublk --target "$ADDR:$PORT" --subnqn "$NQN" --nsid 1 \
        --depth "$QUEUE_DEPTH" >"$SERVE_OUT" 2>>"$SERVE_LOG" &
    serve_pid=$!
    wait_until "$START_S" "serve_blockdev to print DEVICE" serve_ready
    DEV=$(sed -n 's/^DEVICE //p' "$SERVE_OUT")
    NAME=${DEV#/dev/}
    ID=${NAME#ublkb}
    [[ -b $DEV && $ID =~ ^[0-9]+$ ]] || die "DEVICE line names '$DEV', not a ublk block device"
}

# stop_serve: SIGTERM, exit status 0, STOPPED printed, both ublk nodes gone.
stop_serve() {
    kill -TERM "$serve_pid"
    wait_until "$STOP_S" "serve_blockdev to exit after SIGTERM" exited "$serve_pid"
    local rc=0
    wait "$serve_pid" || rc=$?
    [[ $rc -eq 0 ]] || die "serve_blockdev exited $rc after SIGTERM"
    grep -qx STOPPED "$SERVE_OUT" || die "serve_blockdev did not print STOPPED"
    wait_until 10 "$DEV to disappear" test ! -e "/sys/block/$NAME"
    wait_until 10 "ublkc$ID to disappear" test ! -e "/sys/class/ublk-char/ublkc$ID"
}

sysfs() {
    cat "/sys/block/$NAME/$1"
}

expect_sysfs() {
    local got
    got=$(sysfs "$1")
    [[ $got == "$2" ]] || die "/sys/block/$NAME/$1 is '$got', expected '$2'"
}

check_limits() {
    local size queues cpus
    size=$(blockdev --getsize64 "$DEV")
    [[ $size -eq $SIZE_BYTES ]] || die "$DEV has $size bytes, expected $SIZE_BYTES"
    expect_sysfs queue/logical_block_size "$BLOCK_BYTES"
    expect_sysfs queue/physical_block_size "$BLOCK_BYTES"
    expect_sysfs queue/minimum_io_size "$BLOCK_BYTES"
    expect_sysfs queue/optimal_io_size "$BLOCK_BYTES"
    expect_sysfs queue/max_hw_sectors_kb "$MAX_HW_KB"
    expect_sysfs queue/discard_granularity "$BLOCK_BYTES"
    expect_sysfs queue/discard_max_hw_bytes "$DISCARD_MAX_BYTES"
    expect_sysfs queue/write_zeroes_max_bytes "$DISCARD_MAX_BYTES"
    expect_sysfs queue/write_cache "write back"
    expect_sysfs queue/fua 1
    # One hardware queue per CPU, each QUEUE_DEPTH tags deep.
    queues=$(find "/sys/block/$NAME/mq" -mindepth 1 -maxdepth 1 -type d | wc -l)
    cpus=$(nproc)
    [[ $queues -eq $cpus ]] || die "$queues hardware queues, expected one per CPU ($cpus)"
    expect_sysfs mq/0/nr_tags "$QUEUE_DEPTH"
    printf '  %s: %s bytes, lbs %s, io_opt %s, max %s KiB, discard %s, wzeroes %s, %s queues x %s, nr_requests %s\n' \
        "$DEV" "$size" "$(sysfs queue/logical_block_size)" "$(sysfs queue/optimal_io_size)" \
        "$(sysfs queue/max_hw_sectors_kb)" "$(sysfs queue/discard_max_bytes)" \
        "$(sysfs queue/write_zeroes_max_bytes)" "$queues" "$(sysfs mq/0/nr_tags)" \
        "$(sysfs queue/nr_requests)"
}

# Small files of 1..16 KiB and one large one, checksums in /tmp/fs.sums.
write_files() {
    local dir=$1 i
    mkdir -p "$dir/small"
    for ((i = 0; i < SMALL_FILES; i++)); do
        head -c $((((i * 7919) % 16 + 1) * 1024)) /dev/urandom >"$dir/small/f$i"
    done
    dd if=/dev/urandom of="$dir/large" bs=1M count="$LARGE_MIB" 2>/dev/null
    (cd "$dir" && find . -type f | sort | xargs sha256sum) >/tmp/fs.sums
    local n
    n=$(wc -l </tmp/fs.sums)
    [[ $n -eq $((SMALL_FILES + 1)) ]] || die "checksummed $n files, expected $((SMALL_FILES + 1))"
}

verify_files() {
    quiet verify-files sh -c "cd '$1' && sha256sum -c /tmp/fs.sums"
}

suite_fs() {
    local mnt=/mnt/ublk trimmed
    quiet mkfs-ext4 mkfs.ext4 -F "$DEV"
    mkdir -p "$mnt"
    mount -t ext4 "$DEV" "$mnt"
    write_files "$mnt"
    sync
    rm -f "$mnt"/small/f1*
    quiet fstrim fstrim -v "$mnt"
    trimmed=$(sed -nE 's/.*\(([0-9]+) bytes\) trimmed.*/\1/p' /tmp/out.fstrim)
    [[ ${trimmed:-0} -gt 0 ]] || die "fstrim trimmed nothing: $(cat /tmp/out.fstrim)"
    # The checksums of the removed files are no longer expected.
    grep -v '/small/f1' /tmp/fs.sums >/tmp/fs.sums.new && mv /tmp/fs.sums.new /tmp/fs.sums
    umount "$mnt"
    quiet e2fsck e2fsck -fn "$DEV"
    mount -t ext4 "$DEV" "$mnt"
    verify_files "$mnt"
    umount "$mnt"
    printf '  ext4: %s files verified after remount, fstrim %s bytes\n' \
        "$(wc -l </tmp/fs.sums)" "$trimmed"
    step_ok ext4
}

zeroes_sum() {
    dd if="$DEV" bs=1M skip="$1" count="$2" iflag=direct 2>/dev/null | sha256sum | cut -d' ' -f1
}

suite_raw() {
    # Raw device last: it overwrites the filesystem.
    fio_verify raw-4k --rw=randwrite --size=32M --numjobs=2 --offset_increment=64M \
        --filename="$DEV"
    fio_verify raw-1m --rw=write --bs=1m --iodepth=8 --size=32M --offset=128M \
        --filename="$DEV"
    fio_verify raw-fua --rw=randwrite --sync=1 --iodepth=8 --size=4M --offset=192M \
        --filename="$DEV"
    step_ok raw-fio
    # Write Zeroes (BLKZEROOUT) over data fio just wrote, then Discard.
    local zero
    zero=$(head -c $((4 << 20)) /dev/zero | sha256sum | cut -d' ' -f1)
    [[ $(zeroes_sum 128 4) != "$zero" ]] || die "fio left zeroes where it wrote data"
    quiet wzeroes blkdiscard -z -o $((128 << 20)) -l $((4 << 20)) "$DEV"
    [[ $(zeroes_sum 128 4) == "$zero" ]] || die "blkdiscard -z left non-zero data"
    quiet discard blkdiscard -o $((132 << 20)) -l $((8 << 20)) "$DEV"
    step_ok write-zeroes-discard
}

# kill -9 under I/O: the kernel must fail the I/O and remove the block device by itself;
# serve_blockdev --cleanup (or the next start) deletes the dead control device.
suite_kill9() {
    local fio_pid t0 gone_s rc=0
    start_serve
    fio --name=kill9 --filename="$DEV" --ioengine=libaio --direct=1 --rw=randwrite \
        --bs=4k --iodepth=32 --size=64M --time_based --runtime=300 >/tmp/out.fio-kill9 2>&1 &
    fio_pid=$!
    sleep 3
    exited "$fio_pid" && die "fio ended before the kill: $(tail -n 5 /tmp/out.fio-kill9)"
    t0=$(date +%s)
    kill -KILL "$serve_pid"
    wait "$serve_pid" 2>/dev/null || true
    wait_until "$GONE_S" "fio to fail after the server died" exited "$fio_pid"
    wait "$fio_pid" || rc=$?
    [[ $rc -ne 0 ]] || die "fio succeeded although its device's server was killed"
    wait_until "$GONE_S" "the kernel to remove $DEV" test ! -e "/sys/block/$NAME"
    gone_s=$(($(date +%s) - t0))
    printf '  kill -9: fio exited %s (%s), %s removed by the kernel within %ss\n' "$rc" \
        "$(grep -m1 -oE 'error=[A-Za-z/ ]+|Input/output error' /tmp/out.fio-kill9 || echo '?')" \
        "$DEV" "$gone_s"
    if [[ -e /sys/class/ublk-char/ublkc$ID ]]; then
        printf '  kill -9: /dev/ublkc%s remains (state DEAD until DEL_DEV)\n' "$ID"
    else
        printf '  kill -9: /dev/ublkc%s is gone too\n' "$ID"
    fi
    quiet cleanup serve_blockdev --cleanup
    printf '  cleanup: %s\n' "$(tr '\n' ' ' </tmp/out.cleanup)"
    grep -qx "DELETED $ID" /tmp/out.cleanup ||
        [[ ! -e /sys/class/ublk-char/ublkc$ID ]] || die "cleanup did not delete ublk device $ID"
    wait_until 10 "ublkc$ID to disappear" test ! -e "/sys/class/ublk-char/ublkc$ID"
    [[ -z $(ls /run/nvpool/ublk 2>/dev/null) ]] || die "records left: $(ls /run/nvpool/ublk)"
    step_ok kill9-cleanup
    # A new server after the crash serves again.
    start_serve
    quiet reread dd if="$DEV" of=/dev/null bs=1M count=8 iflag=direct
    stop_serve
    step_ok restart-after-kill9
}

stop_target() {
    kill -TERM "$target_pid"
    wait_until "$STOP_S" "nvpool-target to exit" exited "$target_pid"
    local rc=0
    wait "$target_pid" || rc=$?
    [[ $rc -eq 0 ]] || die "nvpool-target exited $rc after SIGTERM"
}

start_target
start_serve
step_ok ublk-start
check_limits
step_ok limits
suite_fs
suite_raw
stop_serve
# Many requests in flight per queue: each tag's task awaits its own I/O.
peak=$(sed -nE 's/.*ublk queue done.*peak_in_flight=([0-9]+).*/\1/p' "$SERVE_LOG" | sort -n | tail -n 1)
printf '  queues: %s\n' "$(sed -nE 's/.*ublk queue done (.*)/\1/p' "$SERVE_LOG" | tr '\n' ' ')"
[[ ${peak:-0} -gt 1 ]] || die "at most ${peak:-0} request(s) in flight per queue under fio --iodepth=32"
step_ok sigterm-stop
suite_kill9
stop_target
step_ok target-stop
