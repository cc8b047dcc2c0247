#!/usr/bin/env bash
# Guest test: a namespace of our target served as /dev/ublkbN by nvpool-initiator's ublk
# front-end (the serve_blockdev example), driven by the kernel: sysfs queue limits, ext4
# (mkfs, small files and a large one with checksums, fstrim, e2fsck, remount, verify),
# fio with verification on the raw device, write-zeroes and discard, SIGTERM (the device
# goes away), and kill -9 under I/O (what the kernel does, and our cleanup of the rest).
# The steps shared with nbd-fs.sh are in lib/frontend.sh.
#
#   cargo build --release -p nvpool-target -p nvpool-initiator --example serve_blockdev
#   scripts/vm/run-guest-test scripts/vm/guest/ublk-fs.sh \
#       --bin target/release/nvpool-target --bin target/release/examples/serve_blockdev
#
# vm-modules: ublk_drv ext4
# vm-bins: fio mkfs.ext4 e2fsck fstrim blkdiscard blockdev
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. /nvpool/lib/common.sh
FRONTEND=ublk
# shellcheck source-path=SCRIPTDIR source=lib/frontend.sh
. /nvpool/lib/frontend.sh

QUEUE_DEPTH=128
# What the front-end advertises (frontend/ublk.rs): 1 MiB transfers, 64 MiB discards,
# io_opt = the block size for a namespace (it has no preferred size).
MAX_HW_KB=1024
DISCARD_MAX_BYTES=$((64 << 20))
# After kill -9 the kernel removes the block device by itself; wait this long for it.
GONE_S=60

ublk_nodes() {
    ls -l /dev/ublk* 2>/dev/null || true
}
DIAG_HOOKS+=(ublk_nodes)

# start_serve: run serve_blockdev, wait for its DEVICE line; sets DEV, NAME, ID.
start_serve() {
    start_serve_blockdev --depth "$QUEUE_DEPTH"
    ID=${NAME#ublkb}
    [[ -b $DEV && $ID =~ ^[0-9]+$ ]] || die "DEVICE line names '$DEV', not a ublk block device"
}

# stop_serve: SIGTERM, exit status 0, STOPPED printed, both ublk nodes gone.
stop_serve() {
    stop_serve_blockdev
    wait_until 10 "$DEV to disappear" test ! -e "/sys/block/$NAME"
    wait_until 10 "ublkc$ID to disappear" test ! -e "/sys/class/ublk-char/ublkc$ID"
}

check_limits() {
    local queues cpus
    expect_common_limits
    expect_sysfs queue/physical_block_size "$BLOCK_BYTES"
    expect_sysfs queue/minimum_io_size "$BLOCK_BYTES"
    expect_sysfs queue/optimal_io_size "$BLOCK_BYTES"
    expect_sysfs queue/max_hw_sectors_kb "$MAX_HW_KB"
    expect_sysfs queue/discard_granularity "$BLOCK_BYTES"
    expect_sysfs queue/discard_max_hw_bytes "$DISCARD_MAX_BYTES"
    expect_sysfs queue/write_zeroes_max_bytes "$DISCARD_MAX_BYTES"
    # One hardware queue per CPU, each QUEUE_DEPTH tags deep.
    queues=$(find "/sys/block/$NAME/mq" -mindepth 1 -maxdepth 1 -type d | wc -l)
    cpus=$(nproc)
    [[ $queues -eq $cpus ]] || die "$queues hardware queues, expected one per CPU ($cpus)"
    expect_sysfs mq/0/nr_tags "$QUEUE_DEPTH"
    printf '  %s: %s bytes, lbs %s, io_opt %s, max %s KiB, discard %s, wzeroes %s, %s queues x %s, nr_requests %s\n' \
        "$DEV" "$SIZE_BYTES" "$(sysfs queue/logical_block_size)" "$(sysfs queue/optimal_io_size)" \
        "$(sysfs queue/max_hw_sectors_kb)" "$(sysfs queue/discard_max_bytes)" \
        "$(sysfs queue/write_zeroes_max_bytes)" "$queues" "$(sysfs mq/0/nr_tags)" \
        "$(sysfs queue/nr_requests)"
}

# kill -9 under I/O: the kernel must fail the I/O and remove the block device by itself;
# serve_blockdev --cleanup (or the next start) deletes the dead control device.
suite_kill9() {
    local gone_s rc=0
    kill_serve_under_io
    wait_until "$GONE_S" "fio to fail after the server died" exited "$fio_pid"
    wait "$fio_pid" || rc=$?
    [[ $rc -ne 0 ]] || die "fio succeeded although its device's server was killed"
    wait_until "$GONE_S" "the kernel to remove $DEV" test ! -e "/sys/block/$NAME"
    gone_s=$(($(date +%s) - killed_at))
    printf '  kill -9: fio exited %s (%s), %s removed by the kernel within %ss\n' "$rc" \
        "$(fio_kill9_error)" "$DEV" "$gone_s"
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
    restart_after_kill9
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
