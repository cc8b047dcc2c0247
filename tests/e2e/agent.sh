#!/usr/bin/env bash
# End to end on this host, as root: the per-host agent. Four targets and a
# control plane on loopback; two volumes attached through FUSE + loop are
# served by one agent over one set of controllers; a mounted XFS volume
# grows online (xfs_growfs while mounted; ext4's online resize2fs needs
# CAP_SYS_RESOURCE, which this kind of sandbox may not grant); /metrics and `nvpool top` count
# its I/O; with the control plane stopped, I/O goes on and a restarted agent
# waits for it, then serves the volumes again; after SIGKILL of the agent
# a new one clears the dead devices and serves the same volumes again with
# their data; SIGTERM keeps the list for the next start.
#
# Usage: tests/e2e/agent.sh [BIN_DIR]   (default target/release)
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=$(cd "${1:-target/release}" && pwd)
CP_PORT=14530
TARGET_PORT_BASE=14520
ADMIN_PORT_BASE=14580
source tests/e2e/lib.sh

need_host jq curl ss mkfs.xfs xfs_growfs xfs_repair sha256sum

trap cleanup EXIT
SOCK=$NVPOOL_RUN_DIR/agent.sock
agent_pid() { cat "$NVPOOL_RUN_DIR/agent.pid" 2>/dev/null; }
agent_get() { curl -sf --unix-socket "$SOCK" "http://agent$1"; }
# agent_tcp PID: its TCP connections to the targets' NVMe ports.
agent_tcp() {
    ss -tnpH state established 2>/dev/null | grep "pid=$1," |
        awk -v lo="$TARGET_PORT_BASE" '{ n = split($4, a, ":"); p = a[n] + 0 }
            p >= lo && p < lo + 4 { c++ } END { print c + 0 }'
}
size_of() { blockdev --getsize64 "$1" 2>/dev/null || echo 0; }
# has_size DEV BYTES (for wait_for, which runs its command again each time)
has_size() { [[ $(size_of "$1") -eq $2 ]]; }
state_of() { agent_get /v1/volumes | jq -r ".[] | select(.name == \"$1\") | .state"; }
is_state() { [[ $(state_of "$1") == "$2" ]]; }
device_of() { agent_get /v1/volumes | jq -r ".[] | select(.name == \"$1\") | .device"; }

log "starting a control plane and 4 targets in $E2E_DIR"
start_control_plane || { bad "control plane starts"; summary; exit 1; }
for i in 0 1 2 3; do start_target "$i" 8G; done
check "4 targets register and are online" wait_targets 4

MNT=$E2E_DIR/mnt
mkdir -p "$MNT"
nvpool volume create a --size 1G --layout raid10 --stripe-width 2 --copies 2 >/dev/null ||
    bad "create a"
nvpool volume create b --size 1G --layout raid10 --stripe-width 2 --copies 2 >/dev/null ||
    bad "create b"

# One agent, started by the first attach; one set of controllers.
dev_a=$(nvpool volume attach a --frontend fuse --host-nqn "$HOSTNQN")
check "attach a gives a block device ($dev_a)" test -b "$dev_a"
pid=$(agent_pid)
check "attach started the agent" test -n "$pid"
check "the agent's socket is root's only" test "$(stat -c %a "$SOCK")" = 600
conns_one=$(agent_tcp "$pid")
dev_b=$(nvpool volume attach b --frontend fuse --host-nqn "$HOSTNQN")
check "attach b gives another block device ($dev_b)" test -b "$dev_b" -a "$dev_b" != "$dev_a"
check "one agent serves both (pid $pid)" test "$(agent_pid)" = "$pid"
conns_two=$(agent_tcp "$pid")
check "both volumes share the controllers ($conns_one connections, then $conns_two)" \
    test "$conns_one" -gt 0 -a "$conns_two" -eq "$conns_one"
check "attach again answers with the same device" \
    test "$(nvpool volume attach a --frontend fuse --host-nqn "$HOSTNQN")" = "$dev_a"
check "volume ls shows both devices" \
    bash -c "$BIN/nvpool volume ls | grep -q '$dev_a' && $BIN/nvpool volume ls | grep -q '$dev_b'"

# Online growth of a mounted file system.
check "a: mkfs.xfs" mkfs.xfs -q -f "$dev_a"
check "a: mount" mount "$dev_a" "$MNT"
check "a: write 200 small files" nvpool dataset make "$MNT/ds" --files 200 --seed 5
dd if=/dev/urandom of="$MNT/big" bs=1M count=64 status=none
sum=$(sha256sum <"$MNT/big")
sync
check "a: resize to 2 GiB" nvpool volume resize a --size 2G
check "a: the block device grows online to 2 GiB" \
    wait_for 30 has_size "$dev_a" $((2 << 30))
check "a: xfs_growfs while mounted" xfs_growfs "$MNT"
fs_kib=$(df -k --output=size "$MNT" | tail -1 | tr -d ' ')
check "a: the file system is bigger ($fs_kib KiB)" test "$fs_kib" -gt $((1500 * 1024))
check "a: write 1100 MiB, past the old end" \
    dd if=/dev/zero of="$MNT/fill" bs=1M count=1100 conv=fsync status=none
rm -f "$MNT/fill"
check "a: the small files verify" nvpool dataset epoch "$MNT/ds"
check "a: the big file verifies" test "$(sha256sum <"$MNT/big")" = "$sum"

# Metrics.
check "/metrics counts a's reads and writes" bash -c \
    "curl -sf --unix-socket '$SOCK' http://agent/metrics |
     grep -E '^nvpool_volume_ops_total\{volume=\"a\".*op=\"write\"\} [1-9]'"
check "/metrics has latency histograms and path states" bash -c \
    "curl -sf --unix-socket '$SOCK' http://agent/metrics | grep -q nvpool_volume_latency_seconds_bucket &&
     curl -sf --unix-socket '$SOCK' http://agent/metrics | grep -qE '^nvpool_path_up\{.*\} 1'"
check "nvpool top prints both volumes" bash -c \
    "$BIN/nvpool top -n 2 -i 0.3 | grep -c '$dev_a\\|$dev_b' | grep -qx 4"

# The control plane down: I/O goes on; a restarted agent waits for it.
kill "$CP_PID"
wait "$CP_PID" 2>/dev/null
check "a: I/O with the control plane down" \
    dd if=/dev/urandom of="$MNT/cpdown" bs=1M count=32 conv=fsync status=none
sum_down=$(sha256sum <"$MNT/cpdown")
check "a: unmount" umount "$MNT"
kill "$pid"
check "SIGTERM stops the agent" wait_for 60 bash -c "! kill -0 $pid 2>/dev/null"
check "a clean stop removes the devices" test ! -e "$NVPOOL_RUN_DIR/volumes/$(
    nvpool volume info a -o json 2>/dev/null | jq -r .uuid).json"
check "a clean stop keeps the list of volumes to serve" \
    test "$(jq length "$NVPOOL_RUN_DIR/state/attached.json")" -eq 2
"$BIN/nvpool" --log info agent >>"$NVPOOL_RUN_DIR/agent.log" 2>&1 &
check "a restarted agent answers" wait_for 20 test -S "$SOCK"
check "without the control plane the volumes wait (pending)" \
    wait_for 10 is_state a pending
start_control_plane || bad "control plane starts again"
check "once the control plane answers, a is served again" \
    wait_for 60 is_state a serving
check "and b" wait_for 60 is_state b serving
dev_a=$(device_of a)
check "a: xfs_repair -n is clean after the restart" xfs_repair -n "$dev_a"
check "a: mount again" mount "$dev_a" "$MNT"
check "a: data written with the control plane down verifies" \
    test "$(sha256sum <"$MNT/cpdown")" = "$sum_down"
check "a: the grown file system kept its size" \
    test "$(df -k --output=size "$MNT" | tail -1 | tr -d ' ')" -eq "$fs_kib"

# SIGKILL: a new agent clears the dead devices and serves the same volumes.
sync
pid=$(agent_pid)
old_b=$(device_of b)
kill -9 "$pid"
umount -l "$MNT" 2>/dev/null
check "after SIGKILL the records stay for the successor" \
    test -n "$(ls "$NVPOOL_RUN_DIR"/volumes/*.json 2>/dev/null)"
"$BIN/nvpool" --log info agent >>"$NVPOOL_RUN_DIR/agent.log" 2>&1 &
check "the successor serves a again" wait_for 60 is_state a serving
check "and b" wait_for 60 is_state b serving
check "the dead FUSE mounts are replaced, not piled up" \
    test "$(grep -c " $NVPOOL_RUN_DIR/fuse/" /proc/mounts)" -eq 2
dev_a=$(device_of a)
check "a: mount after SIGKILL (log replayed)" mount "$dev_a" "$MNT"
check "a: the big file verifies" test "$(sha256sum <"$MNT/big")" = "$sum"
check "a: unmount" umount "$MNT"
check "a: xfs_repair -n is clean" xfs_repair -n "$dev_a"
log "b was $old_b, is $(device_of b)"

check "detach a" nvpool volume detach a --host-nqn "$HOSTNQN"
check "detach b" nvpool volume detach b --host-nqn "$HOSTNQN"
check "nothing is served any more" test "$(agent_get /v1/volumes | jq length)" -eq 0
check "the list of volumes to serve is empty" \
    test "$(jq length "$NVPOOL_RUN_DIR/state/attached.json")" -eq 0

summary
