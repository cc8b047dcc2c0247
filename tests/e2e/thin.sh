#!/usr/bin/env bash
# End to end on this host, as root: thin volumes on grain pools with real
# processes. Two nvpool-target daemons offer blank sparse files as grain pools
# (`thin:PATH`, formatted at their first start) to a control plane on loopback.
# A RAID1 volume four times larger than a pool is created thin by default and
# over-commits; written through FUSE + loop, the pools' used bytes (heartbeats,
# `pool df`) rise by what was written and no more; a discard gives the grains
# back; the data survives a restart of both targets; a thick volume has no
# device to go to; deleting the volume releases its trees, and the pools are
# empty again.
#
# Usage: tests/e2e/thin.sh [BIN_DIR]   (default target/release)
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=$(cd "${1:-target/release}" && pwd)
source tests/e2e/lib.sh

need_host jq curl blkdiscard cmp

trap cleanup EXIT
MIB=$((1 << 20))

# quiet CMD...: CMD with its output kept out of the log.
quiet() { "$@" >/dev/null; }
# df FIELD: the cluster total's FIELD from `nvpool pool df`.
df() { nvpool pool df -o json | jq -r ".total.$1"; }
# used_at_least BYTES / used_below BYTES: the pools' reported use.
used_at_least() { [[ $(df used_bytes) -ge $1 ]]; }
used_below() { [[ $(df used_bytes) -lt $1 ]]; }

log "starting a control plane and 2 targets on grain pools in $E2E_DIR"
start_control_plane || { bad "control plane starts"; summary; exit 1; }
for i in 0 1; do start_thin_target "$i"; done
check "2 targets register and are online" wait_targets 2
check "the targets offer grain pools" test "$(nvpool target ls -o json |
    jq '[.[].devices[] | select(.thin)] | length')" -eq 2
real=$(df total_bytes)
check "the pools offer their real capacity (got $real)" \
    test "$real" -gt $((1800 * MIB)) -a "$real" -le $((2048 * MIB))

check "a 4 GiB RAID1 volume over-commits two 1 GiB pools" quiet \
    nvpool volume create data --size 4G --layout raid1 --copies 2
check "it is thin by default" \
    test "$(nvpool volume info data -o json | jq -r .provisioning)" = thin
check "pool df: 8 GiB provisioned, nothing used" \
    test "$(df provisioned_bytes)" -eq $((8 << 30)) -a "$(df used_bytes)" -lt $((4 * MIB))
check "pool df shows the over-commit" bash -c "'$BIN/nvpool' pool df | grep -q ' 4\.[0-9][0-9]x '"
if nvpool volume create thick --size 1G --thick 2>"$E2E_DIR/thick.err"; then
    bad "a thick volume with no plain device is refused"
else
    check "a thick volume with no plain device is refused, saying why" \
        grep -qi "thick" "$E2E_DIR/thick.err"
fi
check "and nothing was created" bash -c "! '$BIN/nvpool' volume info thick >/dev/null 2>&1"

dev=$(nvpool volume attach data --frontend fuse --host-nqn "$HOSTNQN")
check "attach gives a block device (got '$dev')" test -b "$dev"
data=$E2E_DIR/data.bin
head -c $((96 * MIB)) /dev/urandom >"$data"
check "write 96 MiB at 1 GiB" \
    dd if="$data" of="$dev" bs=1M seek=1024 oflag=direct conv=fsync status=none
# read_at MIB COUNT: COUNT MiB of the device from MIB on, past the page cache.
read_at() { dd if="$dev" bs=1M skip="$1" count="$2" iflag=direct status=none; }
check "it reads back" cmp -s "$data" <(read_at 1024 96)
# Each copy holds the 96 MiB: 192 MiB over both pools, reported within a
# heartbeat or two.
check "the pools report what was written (192 MiB over both copies)" \
    wait_for 20 used_at_least $((192 * MIB))
check "and not more than it (no whole-extent allocation)" used_below $((200 * MIB))
check "a discard of 64 MiB of it" blkdiscard -o $((1024 * MIB)) -l $((64 * MIB)) "$dev"
check "gives those grains back" wait_for 20 used_below $((72 * MIB))
check "the discarded range reads zeroes" cmp -s -n $((64 * MIB)) <(read_at 1024 64) /dev/zero
check "the rest is intact" cmp -s <(tail -c $((32 * MIB)) "$data") <(read_at 1088 32)
check "detach" nvpool volume detach data --host-nqn "$HOSTNQN"

log "restarting both targets"
for i in 0 1; do
    kill "${TARGET_PIDS[i]}"
    wait "${TARGET_PIDS[i]}" 2>/dev/null
    start_thin_target "$i"
done
check "both are back online" wait_targets 2
dev=$(nvpool volume attach data --frontend fuse --host-nqn "$HOSTNQN")
check "attach again" test -b "$dev"
check "the undiscarded 32 MiB read back after the restart" \
    cmp -s <(tail -c $((32 * MIB)) "$data") <(read_at 1088 32)
check "the discarded range still reads zeroes" cmp -s -n $((64 * MIB)) <(read_at 1024 64) /dev/zero
check "an unwritten range reads zeroes" cmp -s -n $((16 * MIB)) <(read_at 3000 16) /dev/zero
check "detach" nvpool volume detach data --host-nqn "$HOSTNQN"

check "delete the volume" nvpool volume delete data
check "its trees are released: the pools are empty again" wait_for 30 used_below $MIB
check "and nothing is provisioned" test "$(df provisioned_bytes)" -eq 0

summary
