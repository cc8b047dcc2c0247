#!/usr/bin/env bash
# Guest test: a namespace of our target served as /dev/nbdN: nvpool-initiator's NBD server
# on one end of a socket pair, the kernel's nbd driver on the other (netlink
# NBD_CMD_CONNECT; the serve_blockdev example). Checks sysfs limits, ext4 (mkfs, small
# files and a large one with checksums, fstrim, e2fsck, remount, verify), fio with
# verification on the raw device, write-zeroes and discard, SIGTERM (the device is
# disconnected), and kill -9 under I/O (what the kernel does, and a disconnect that frees
# the device for the next server).
#
#   cargo build --release -p nvpool-target -p nvpool-initiator --example serve_blockdev
#   scripts/vm/run-guest-test scripts/vm/guest/nbd-fs.sh \
#       --bin target/release/nvpool-target --bin target/release/examples/serve_blockdev
#
# vm-modules: nbd ext4
# vm-bins: fio mkfs.ext4 e2fsck fstrim blkdiscard blockdev
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. /nvpool/lib/common.sh

ADDR=127.0.0.1
PORT=4420
NQN=nqn.2026-11.io.nvpool:nbd-fs
SIZE_BYTES=$((512 << 20))
BLOCK_BYTES=4096
SMALL_FILES=300
LARGE_MIB=32
TARGET_LOG=/tmp/nvpool-target.log
SERVE_OUT=/tmp/serve.out
SERVE_LOG=/tmp/serve.log
# Generous under TCG: start-up includes connecting and attaching the device.
START_S=90
STOP_S=60
# How long to watch the device after kill -9 before disconnecting it, and how long fio
# may take to fail after the disconnect.
KILLED_WATCH_S=10
KILLED_IO_S=60
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
    local b
    for b in /sys/block/nbd*; do
        [[ -e $b/pid ]] && printf '%s: size %s, server pid %s\n' "${b##*/}" "$(<"$b/size")" \
            "$(<"$b/pid")"
    done
    return 0
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

# connected: the kernel has a configured, sized device (the pid attribute exists only
# while a configuration is attached).
connected() {
    [[ -e /sys/block/$NAME/pid && $(cat "/sys/block/$NAME/size" 2>/dev/null) -gt 0 ]]
}

disconnected() {
    ! connected
}

# start_serve: run serve_blockdev, wait for its DEVICE line; sets DEV and NAME.
start_serve() {
    : >"$SERVE_OUT"
    serve_blockdev --frontend nbd --target "$ADDR:$PORT" --subnqn "$NQN" --nsid 1 \
        >"$SERVE_OUT" 2>>"$SERVE_LOG" &
    serve_pid=$!
    wait_until "$START_S" "serve_blockdev to print DEVICE" serve_ready
    DEV=$(sed -n 's/^DEVICE //p' "$SERVE_OUT")
    NAME=${DEV#/dev/}
    [[ -b $DEV && $NAME =~ ^nbd[0-9]+$ ]] || die "DEVICE line names '$DEV', not an nbd device"
    wait_until 10 "$DEV to get its size" connected
}

# stop_serve: SIGTERM, exit status 0, STOPPED printed, the device disconnected.
stop_serve() {
    kill -TERM "$serve_pid"
    wait_until "$STOP_S" "serve_blockdev to exit after SIGTERM" exited "$serve_pid"
    local rc=0
    wait "$serve_pid" || rc=$?
    [[ $rc -eq 0 ]] || die "serve_blockdev exited $rc after SIGTERM"
    grep -qx STOPPED "$SERVE_OUT" || die "serve_blockdev did not print STOPPED"
    wait_until 10 "$DEV to be disconnected" disconnected
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
    local size
    size=$(blockdev --getsize64 "$DEV")
    [[ $size -eq $SIZE_BYTES ]] || die "$DEV has $size bytes, expected $SIZE_BYTES"
    expect_sysfs queue/logical_block_size "$BLOCK_BYTES"
    expect_sysfs queue/write_cache "write back"
    expect_sysfs queue/fua 1
    [[ $(sysfs queue/discard_max_bytes) -gt 0 ]] || die "$DEV does not take discards"
    [[ $(sysfs queue/write_zeroes_max_bytes) -gt 0 ]] || die "$DEV does not take write zeroes"
    printf '  %s: %s bytes, lbs %s, io_opt %s, max %s KiB, discard %s, wzeroes %s, nr_requests %s\n' \
        "$DEV" "$size" "$(sysfs queue/logical_block_size)" "$(sysfs queue/optimal_io_size)" \
        "$(sysfs queue/max_hw_sectors_kb)" "$(sysfs queue/discard_max_bytes)" \
        "$(sysfs queue/write_zeroes_max_bytes)" "$(sysfs queue/nr_requests)"
}

# Small files of 1..16 KiB and one large one, checksums in /tmp/fs.sums.
write_files() {
    local dir=$1 i n
    mkdir -p "$dir/small"
    for ((i = 0; i < SMALL_FILES; i++)); do
        head -c $((((i * 7919) % 16 + 1) * 1024)) /dev/urandom >"$dir/small/f$i"
    done
    dd if=/dev/urandom of="$dir/large" bs=1M count="$LARGE_MIB" 2>/dev/null
    (cd "$dir" && find . -type f | sort | xargs sha256sum) >/tmp/fs.sums
    n=$(wc -l </tmp/fs.sums)
    [[ $n -eq $((SMALL_FILES + 1)) ]] || die "checksummed $n files, expected $((SMALL_FILES + 1))"
}

verify_files() {
    quiet verify-files sh -c "cd '$1' && sha256sum -c /tmp/fs.sums"
}

suite_fs() {
    local mnt=/mnt/nbd trimmed
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

# kill -9 under I/O. The kernel keeps the device and waits for a new socket: requests
# issued after the death fail once the dead-connection timeout (30 s) passes, but those
# already sent on the dead socket wait for a reply that cannot come (no request timeout
# is set: a timeout would also kill a healthy but slow connection). A disconnect (what
# nbd-client -d does: NBD_DISCONNECT + NBD_CLEAR_SOCK) fails them and frees the device.
suite_kill9() {
    local fio_pid t0 rc=0
    start_serve
    fio --name=kill9 --filename="$DEV" --ioengine=libaio --direct=1 --rw=randwrite \
        --bs=4k --iodepth=32 --size=64M --time_based --runtime=300 >/tmp/out.fio-kill9 2>&1 &
    fio_pid=$!
    sleep 3
    exited "$fio_pid" && die "fio ended before the kill: $(tail -n 5 /tmp/out.fio-kill9)"
    kill -KILL "$serve_pid"
    wait "$serve_pid" 2>/dev/null || true
    sleep "$KILLED_WATCH_S"
    printf '  kill -9: %ss later fio is %s, %s is %s, %s request(s) in flight\n' \
        "$KILLED_WATCH_S" "$(exited "$fio_pid" && echo finished || echo 'still waiting')" "$DEV" \
        "$(connected && echo "still configured" || echo disconnected)" \
        "$(awk '{ print $1 + $2 }' "/sys/block/$NAME/inflight")"
    t0=$(date +%s)
    quiet disconnect serve_blockdev --nbd-disconnect "$DEV"
    wait_until "$KILLED_IO_S" "fio to fail after the disconnect" exited "$fio_pid"
    wait "$fio_pid" || rc=$?
    [[ $rc -ne 0 ]] || die "fio succeeded although its device's server was killed"
    wait_until 30 "$DEV to be disconnected" disconnected
    printf '  cleanup: %s; fio exited %s (%s) %ss after it\n' \
        "$(grep -v '^[0-9-]*T' /tmp/out.disconnect | tr '\n' ' ')" "$rc" \
        "$(grep -m1 -oE 'error=[A-Za-z/ ]+|Input/output error' /tmp/out.fio-kill9 || echo '?')" \
        "$(($(date +%s) - t0))"
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
step_ok nbd-start
check_limits
step_ok limits
suite_fs
suite_raw
stop_serve
step_ok sigterm-stop
suite_kill9
stop_target
step_ok target-stop
