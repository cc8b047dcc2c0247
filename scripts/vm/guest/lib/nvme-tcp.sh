# shellcheck shell=bash
# shellcheck disable=SC2034 # DEV and CTRL are for the calling script
# NVMe/TCP initiator checks run by the Linux host driver against any target listening
# on loopback: the kernel's nvmet (kernel-nvmet-smoke.sh) or ours (nvme-tcp-target.sh).
# Running one suite against both tells a bug in our target from a bug in the test.
#
# Over RDMA too (nvme-rdma-target.sh): NVME_TRANSPORT=rdma connects with -t rdma, checks
# the discovery log says trtype rdma, and skips the data digests NVMe/RDMA does not have.
#
# Needs common.sh and these variables:
#   NVME_ADDR NVME_IO_PORT NVME_DISC_PORT  where the target listens
#   NVME_NQN NVME_NSID                     the subsystem and the namespace to use (>=1 GiB)
#   NVME_HOSTNQN NVME_BAD_HOSTNQN          an allowed host NQN and a refused one

NVME_TRANSPORT=${NVME_TRANSPORT:-tcp}

# Idle time for the keep-alive check: seven times the kernel's default 5 s KATO.
KEEPALIVE_IDLE_S=35
# How long the kernel may take to create or remove a controller's block device.
DEVICE_SETTLE_S=20

# host_opts NQN: set HOST_OPTS to --hostnqn NQN and a --hostid.  The kernel refuses a host NQN that comes
# with the hostid of another known host, and without --hostid nvme-cli 2.4 lets it pick
# its default host's.  A uuid-style NQN gives its uuid; any other gets a fixed one.
host_opts() {
    local uuid=${1##*:uuid:}
    [[ $uuid =~ ^[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}$ ]] ||
        uuid=00000000-0000-4000-8000-$(printf '%s' "$1" | md5sum | cut -c1-12)
    HOST_OPTS=(--hostnqn="$1" --hostid="$uuid")
}

# Names (nvmeN) of the controllers connected to subsystem $1.
nvme_ctrls() {
    local c
    for c in /sys/class/nvme/nvme*; do
        [[ -r $c/subsysnqn && $(<"$c/subsysnqn") == "$1" ]] && printf '%s\n' "${c##*/}"
    done
    return 0
}

nvme_ctrl_count() {
    nvme_ctrls "$1" | grep -c . || true
}

# /dev path of namespace $2 of subsystem $1, or nothing.  Uses sysfs only: with native
# multipath the disk is named after the subsystem instance, not the controller.
nvme_ns_dev() {
    local b name
    for b in /sys/block/nvme*; do
        name=${b##*/}
        # Skip per-path hidden disks (nvmeXcYnZ) and partitions.
        [[ $name =~ ^nvme[0-9]+n[0-9]+$ ]] || continue
        [[ -r $b/device/subsysnqn && $(<"$b/device/subsysnqn") == "$1" ]] || continue
        [[ -r $b/nsid && $(<"$b/nsid") -eq $2 ]] || continue
        [[ -b /dev/$name ]] && printf '/dev/%s\n' "$name" && return 0
    done
    return 0
}

nvme_has_dev() {
    [[ -n $(nvme_ns_dev "$NVME_NQN" "$NVME_NSID") ]]
}

nvme_no_ctrl() {
    [[ $(nvme_ctrl_count "$NVME_NQN") -eq 0 ]]
}

# connect NAME [nvme connect options...]: connect to NVME_NQN, wait for the namespace's
# block device, set DEV and CTRL.
connect() {
    local name=$1
    shift
    nvme_no_ctrl || die "$name: a controller for $NVME_NQN is already connected"
    host_opts "$NVME_HOSTNQN"
    quiet "connect-$name" nvme connect -t "$NVME_TRANSPORT" -a "$NVME_ADDR" -s "$NVME_IO_PORT" \
        -n "$NVME_NQN" "${HOST_OPTS[@]}" "$@"
    wait_until "$DEVICE_SETTLE_S" "namespace $NVME_NSID block device" nvme_has_dev
    DEV=$(nvme_ns_dev "$NVME_NQN" "$NVME_NSID")
    [[ $(nvme_ctrl_count "$NVME_NQN") -eq 1 ]] ||
        die "$name: expected one controller, got: $(nvme_ctrls "$NVME_NQN" | tr '\n' ' ')"
    CTRL=$(nvme_ctrls "$NVME_NQN")
    ctrl_live
}

ctrl_state() {
    cat "/sys/class/nvme/$CTRL/state" 2>/dev/null || echo gone
}

ctrl_live() {
    local state
    state=$(ctrl_state)
    [[ $state == live ]] || die "controller $CTRL is '$state', expected 'live'"
}

disconnect() {
    quiet disconnect nvme disconnect -n "$NVME_NQN"
    wait_until "$DEVICE_SETTLE_S" "controllers of $NVME_NQN to go away" nvme_no_ctrl
}

suite_discover() {
    host_opts "$NVME_HOSTNQN"
    quiet discover nvme discover -t "$NVME_TRANSPORT" -a "$NVME_ADDR" -s "$NVME_DISC_PORT" \
        "${HOST_OPTS[@]}"
    grep -Eq "^subnqn: +$NVME_NQN\$" /tmp/out.discover || {
        cat /tmp/out.discover
        die "discovery log on port $NVME_DISC_PORT does not list $NVME_NQN"
    }
    grep -Eq "^trtype: +$NVME_TRANSPORT\$" /tmp/out.discover || {
        cat /tmp/out.discover
        die "discovery log entries are not of transport $NVME_TRANSPORT"
    }
    nvme_no_ctrl || die "discovery left a controller behind"
    step_ok discover
}

suite_xfs() {
    connect xfs
    step_ok connect-default
    quiet mkfs-xfs mkfs.xfs -f "$DEV"
    mkdir -p /mnt/xfs
    mount -t xfs "$DEV" /mnt/xfs
    write_random_files /mnt/xfs 3 2
    umount /mnt/xfs
    quiet xfs-repair xfs_repair -n "$DEV"
    mount -t xfs "$DEV" /mnt/xfs
    verify_random_files /mnt/xfs
    umount /mnt/xfs
    step_ok xfs
    disconnect
    step_ok disconnect
}

suite_ext4_digests() {
    if [[ $NVME_TRANSPORT == tcp ]]; then
        connect digests -g -G
        step_ok connect-digests
    else
        connect ext4
    fi
    quiet mkfs-ext4 mkfs.ext4 -F "$DEV"
    mkdir -p /mnt/ext4
    mount -t ext4 "$DEV" /mnt/ext4
    write_random_files /mnt/ext4 3 2
    fio_verify ext4-file --rw=randwrite --size=64M --filename=/mnt/ext4/fio.dat
    verify_random_files /mnt/ext4
    umount /mnt/ext4
    quiet e2fsck e2fsck -fn "$DEV"
    step_ok ext4
    # Raw device last: it overwrites the filesystem just checked.
    fio_verify "raw-$NVME_TRANSPORT" --rw=randwrite --size=16M --filename="$DEV"
    step_ok "raw-fio-$NVME_TRANSPORT"
    disconnect
}

suite_multiqueue() {
    connect multiqueue -i 2
    local queues
    queues=$(cat "/sys/class/nvme/$CTRL/queue_count")
    # queue_count counts the admin queue too.
    [[ $queues -eq 3 ]] || die "queue_count is $queues with -i 2, expected 3 (admin + 2 I/O)"
    # Two jobs on disjoint ranges, so both I/O queues carry traffic.
    fio_verify raw-2q --rw=randwrite --size=16M --numjobs=2 --offset_increment=16M \
        --filename="$DEV"
    step_ok multiqueue
    disconnect
}

suite_denied_host() {
    local rc=0
    host_opts "$NVME_BAD_HOSTNQN"
    nvme connect -t "$NVME_TRANSPORT" -a "$NVME_ADDR" -s "$NVME_IO_PORT" -n "$NVME_NQN" \
        "${HOST_OPTS[@]}" >/tmp/out.denied 2>&1 || rc=$?
    if [[ $rc -eq 0 ]]; then
        cat /tmp/out.denied
        die "connect with host NQN $NVME_BAD_HOSTNQN succeeded; it must be refused"
    fi
    nvme_no_ctrl || die "refused connect left controller(s): $(nvme_ctrls "$NVME_NQN")"
    step_ok denied-host
}

suite_keepalive() {
    connect keepalive
    sleep "$KEEPALIVE_IDLE_S"
    # Check the state before reading: on a dead association the read would block until
    # the host gives up reconnecting (ctrl_loss_tmo, 600 s).
    ctrl_live
    quiet keepalive-read dd if="$DEV" of=/dev/null bs=1M count=4 iflag=direct
    ctrl_live
    step_ok "keepalive-${KEEPALIVE_IDLE_S}s"
    disconnect
}

# Everything, in order.
nvme_tcp_suite() {
    suite_discover
    suite_xfs
    suite_ext4_digests
    suite_multiqueue
    suite_denied_host
    suite_keepalive
}
