# shellcheck shell=bash
# Shared steps of the block-device front-end tests (ublk-fs.sh, nbd-fs.sh): a RAM
# namespace of our target served as a kernel block device by the serve_blockdev example.
# Source after common.sh, with FRONTEND set to serve_blockdev's --frontend value (ublk,
# nbd). Each test keeps its own start_serve/stop_serve (built on start_serve_blockdev and
# stop_serve_blockdev), check_limits and suite_kill9 (built on kill_serve_under_io and
# restart_after_kill9); the rest is here.

: "${FRONTEND:?set FRONTEND before sourcing frontend.sh}"

ADDR=127.0.0.1
PORT=4420
NQN=nqn.2026-11.io.nvpool:$FRONTEND-fs
SIZE_BYTES=$((512 << 20))
BLOCK_BYTES=4096
SMALL_FILES=300
LARGE_MIB=32
TARGET_LOG=/tmp/nvpool-target.log
SERVE_OUT=/tmp/serve.out
SERVE_LOG=/tmp/serve.log
# Generous under TCG: start-up includes connecting and adding the device.
START_S=90
STOP_S=60
LOG_TAIL_LINES=30

for prog in nvpool-target serve_blockdev; do
    command -v "$prog" >/dev/null ||
        die "$prog missing: give run-guest-test --bin target/release/nvpool-target" \
            "--bin target/release/examples/serve_blockdev"
done

frontend_logs_tail() {
    printf -- '--- serve_blockdev stderr (last %d lines) ---\n' "$LOG_TAIL_LINES"
    tail -n "$LOG_TAIL_LINES" "$SERVE_LOG" 2>/dev/null || true
    printf -- '--- nvpool-target log (last %d lines) ---\n' "$LOG_TAIL_LINES"
    tail -n "$LOG_TAIL_LINES" "$TARGET_LOG" 2>/dev/null || true
}
DIAG_HOOKS+=(frontend_logs_tail)

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

stop_target() {
    kill -TERM "$target_pid"
    wait_until "$STOP_S" "nvpool-target to exit" exited "$target_pid"
    local rc=0
    wait "$target_pid" || rc=$?
    [[ $rc -eq 0 ]] || die "nvpool-target exited $rc after SIGTERM"
}

serve_ready() {
    exited "$serve_pid" && die "serve_blockdev exited before printing DEVICE"
    grep -q '^DEVICE ' "$SERVE_OUT"
}

# start_serve_blockdev [ARGS...]: run serve_blockdev --frontend FRONTEND with ARGS added,
# wait for its DEVICE line; sets serve_pid, DEV and NAME.
start_serve_blockdev() {
    : >"$SERVE_OUT"
    serve_blockdev --frontend "$FRONTEND" --target "$ADDR:$PORT" --subnqn "$NQN" --nsid 1 \
        "$@" >"$SERVE_OUT" 2>>"$SERVE_LOG" &
    serve_pid=$!
    wait_until "$START_S" "serve_blockdev to print DEVICE" serve_ready
    DEV=$(sed -n 's/^DEVICE //p' "$SERVE_OUT")
    NAME=${DEV#/dev/}
}

# stop_serve_blockdev: SIGTERM, exit status 0, STOPPED printed.
stop_serve_blockdev() {
    kill -TERM "$serve_pid"
    wait_until "$STOP_S" "serve_blockdev to exit after SIGTERM" exited "$serve_pid"
    local rc=0
    wait "$serve_pid" || rc=$?
    [[ $rc -eq 0 ]] || die "serve_blockdev exited $rc after SIGTERM"
    grep -qx STOPPED "$SERVE_OUT" || die "serve_blockdev did not print STOPPED"
}

sysfs() {
    cat "/sys/block/$NAME/$1"
}

expect_sysfs() {
    local got
    got=$(sysfs "$1")
    [[ $got == "$2" ]] || die "/sys/block/$NAME/$1 is '$got', expected '$2'"
}

# expect_common_limits: the size, block size and cache flags every front-end must show.
expect_common_limits() {
    local size
    size=$(blockdev --getsize64 "$DEV")
    [[ $size -eq $SIZE_BYTES ]] || die "$DEV has $size bytes, expected $SIZE_BYTES"
    expect_sysfs queue/logical_block_size "$BLOCK_BYTES"
    expect_sysfs queue/write_cache "write back"
    expect_sysfs queue/fua 1
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

# suite_fs: ext4 mkfs, files with checksums, fstrim, e2fsck, remount, verify.
suite_fs() {
    local mnt=/mnt/$FRONTEND trimmed
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

# suite_raw: fio with verification on the raw device, then write-zeroes and discard.
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

# kill_serve_under_io: start a server, put fio (random writes, QD32, output in
# /tmp/out.fio-kill9) on its device and kill -9 the server 3 s in; sets fio_pid and
# killed_at (epoch seconds of the kill). What must happen next is the caller's.
kill_serve_under_io() {
    start_serve
    fio --name=kill9 --filename="$DEV" --ioengine=libaio --direct=1 --rw=randwrite \
        --bs=4k --iodepth=32 --size=64M --time_based --runtime=300 >/tmp/out.fio-kill9 2>&1 &
    fio_pid=$!
    sleep 3
    exited "$fio_pid" && die "fio ended before the kill: $(tail -n 5 /tmp/out.fio-kill9)"
    # shellcheck disable=SC2034 # read by the caller
    killed_at=$(date +%s)
    kill -KILL "$serve_pid"
    wait "$serve_pid" 2>/dev/null || true
}

# fio_kill9_error: the first I/O error fio reported in the kill -9 run.
fio_kill9_error() {
    grep -m1 -oE 'error=[A-Za-z/ ]+|Input/output error' /tmp/out.fio-kill9 || echo '?'
}

# restart_after_kill9: a new server after the crash serves again.
restart_after_kill9() {
    start_serve
    quiet reread dd if="$DEV" of=/dev/null bs=1M count=8 iflag=direct
    stop_serve
    step_ok restart-after-kill9
}
