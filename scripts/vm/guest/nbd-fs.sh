#!/usr/bin/env bash
# Guest test: a namespace of our target served as /dev/nbdN: nvpool-initiator's NBD server
# on one end of a socket pair, the kernel's nbd driver on the other (netlink
# NBD_CMD_CONNECT; the serve_blockdev example). Checks sysfs limits, ext4 (mkfs, small
# files and a large one with checksums, fstrim, e2fsck, remount, verify), fio with
# verification on the raw device, write-zeroes and discard, SIGTERM (the device is
# disconnected), and kill -9 under I/O (what the kernel does, and a disconnect that frees
# the device for the next server). The steps shared with ublk-fs.sh are in
# lib/frontend.sh.
#
#   cargo build --release -p nvpool-target -p nvpool-initiator --example serve_blockdev
#   scripts/vm/run-guest-test scripts/vm/guest/nbd-fs.sh \
#       --bin target/release/nvpool-target --bin target/release/examples/serve_blockdev
#
# vm-modules: nbd ext4
# vm-bins: fio mkfs.ext4 e2fsck fstrim blkdiscard blockdev
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. /nvpool/lib/common.sh
FRONTEND=nbd
# shellcheck source-path=SCRIPTDIR source=lib/frontend.sh
. /nvpool/lib/frontend.sh

# How long to watch the device after kill -9 before disconnecting it, and how long fio
# may take to fail after the disconnect.
KILLED_WATCH_S=10
KILLED_IO_S=60

nbd_devices() {
    local b
    for b in /sys/block/nbd*; do
        [[ -e $b/pid ]] && printf '%s: size %s, server pid %s\n' "${b##*/}" "$(<"$b/size")" \
            "$(<"$b/pid")"
    done
    return 0
}
DIAG_HOOKS+=(nbd_devices)

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
    # shellcheck disable=SC2119 # no extra arguments for nbd
    start_serve_blockdev
    [[ -b $DEV && $NAME =~ ^nbd[0-9]+$ ]] || die "DEVICE line names '$DEV', not an nbd device"
    wait_until 10 "$DEV to get its size" connected
}

# stop_serve: SIGTERM, exit status 0, STOPPED printed, the device disconnected.
stop_serve() {
    stop_serve_blockdev
    wait_until 10 "$DEV to be disconnected" disconnected
}

check_limits() {
    expect_common_limits
    [[ $(sysfs queue/discard_max_bytes) -gt 0 ]] || die "$DEV does not take discards"
    [[ $(sysfs queue/write_zeroes_max_bytes) -gt 0 ]] || die "$DEV does not take write zeroes"
    printf '  %s: %s bytes, lbs %s, io_opt %s, max %s KiB, discard %s, wzeroes %s, nr_requests %s\n' \
        "$DEV" "$SIZE_BYTES" "$(sysfs queue/logical_block_size)" "$(sysfs queue/optimal_io_size)" \
        "$(sysfs queue/max_hw_sectors_kb)" "$(sysfs queue/discard_max_bytes)" \
        "$(sysfs queue/write_zeroes_max_bytes)" "$(sysfs queue/nr_requests)"
}

# kill -9 under I/O. The kernel keeps the device and waits for a new socket: requests
# issued after the death fail once the dead-connection timeout (30 s) passes, but those
# already sent on the dead socket wait for a reply that cannot come (no request timeout
# is set: a timeout would also kill a healthy but slow connection). A disconnect (what
# nbd-client -d does: NBD_DISCONNECT + NBD_CLEAR_SOCK) fails them and frees the device.
suite_kill9() {
    local t0 rc=0
    kill_serve_under_io
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
        "$(fio_kill9_error)" "$(($(date +%s) - t0))"
    step_ok kill9-cleanup
    restart_after_kill9
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
