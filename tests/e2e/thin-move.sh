#!/usr/bin/env bash
# End to end on this host, as root: thin copies heal and move with their
# snapshots (design/thin-snapshots.md T7) with real processes: a control
# plane and three targets on grain pools, a thin RAID1 volume (two copies,
# one row) served by the agent through FUSE + loop.
#
# A few MiB are written in a few places (most of the volume stays a hole),
# snapshot @s1, part of it overwritten, snapshot @s2, more overwritten; a
# sparse model file takes the same writes, and each state's checksum is the
# model's.
#  (a) In-place resync: a target holding a copy is SIGKILLed, more is
#      written (the host gives that copy up), the target restarted: the copy
#      is rebuilt in place without a command, the copies agree (`nvpool
#      volume verify`), the volume reads the model, and the restarted pool
#      holds about what was written (holes stayed holes).
#  (b) Drain with snapshots: `nvpool target drain` of a target holding a
#      copy moves the copy with its snapshot trees to the third target. The
#      drained pool is empty again, the volume still reads the model, clones
#      of @s1 and @s2 (placed where their trees now are) read exactly those
#      states, and the destination pool holds less than the three trees
#      would unshared.
#
# Usage: tests/e2e/thin-move.sh [BIN_DIR]   (default target/release)
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=$(cd "${1:-target/release}" && pwd)
CP_PORT=${CP_PORT:-14630} TARGET_PORT_BASE=${TARGET_PORT_BASE:-14620}
ADMIN_PORT_BASE=${ADMIN_PORT_BASE:-14680}
# One row: the volume is one extent, so its two copies are on two of the
# three targets and the third is where a drain goes. Small, to be read
# whole quickly.
EXTENT_BYTES=$((64 << 20))
VOLUME_MIB=64
source tests/e2e/lib.sh

need_host jq curl sha256sum

trap cleanup EXIT
MIB=$((1 << 20))
# Heartbeats carry a pool's used bytes every 5 s (target-daemon
# HEARTBEAT_INTERVAL_MS); a figure read this long after an event was
# measured after it.
REPORT_S=7
MODEL=$E2E_DIR/model.img

quiet() { "$@" >/dev/null; }
attach() { nvpool volume attach "$1" --frontend fuse --host-nqn "$HOSTNQN"; }

# put DEV MIB COUNT [MIB COUNT...]: COUNT MiB of fresh random data at MIB,
# through the volume (direct, synced) and into the model.
put() {
    local dev=$1 f=$E2E_DIR/put.bin
    shift
    while (($# >= 2)); do
        head -c $(($2 * MIB)) /dev/urandom >"$f" &&
            dd if="$f" of="$MODEL" bs=1M seek="$1" conv=notrunc status=none &&
            dd if="$f" of="$dev" bs=1M seek="$1" oflag=direct conv=notrunc,fsync status=none ||
            return 1
        shift 2
    done
}
model_sum() { sha256sum "$MODEL" | cut -c1-64; }
# reads DEV SUM: the whole device, read past the page cache, has checksum SUM.
reads() {
    local got
    got=$(dd if="$1" bs=4M iflag=direct status=none | sha256sum | cut -c1-64)
    [[ $got == "$2" ]] || {
        echo "$1: checksum $got, expected $2" >&2
        return 1
    }
}

# target_of NAME K: the target of extent K of volume NAME.
target_of() { nvpool volume info "$1" -o json | jq -r ".extents[$2].target"; }
# none_on NAME TARGET: volume NAME has no extent on TARGET.
none_on() {
    nvpool volume info "$1" -o json | jq -e --arg t "$2" 'all(.extents[]; .target != $t)' >/dev/null
}
some_on() { ! none_on "$@"; }
# moved_off NAME TARGET: in sync, and nothing of NAME left on TARGET.
moved_off() { in_sync "$1" && none_on "$1" "$2"; }
# copies_agree NAME: `nvpool volume verify` compared both copies, found
# them equal (a stale copy would be left out, not compared).
copies_agree() {
    nvpool volume verify "$1" -o json |
        jq -e '.copies_compared == 2 and .groups_skipped == 0 and (.differences | length) == 0' >/dev/null
}
has_stale() { nvpool volume info "$1" -o json | jq -e '(.failed_extents | length) > 0' >/dev/null; }
# history_done NAME KIND_PREFIX: a copy job of that kind finished on NAME.
history_done() {
    nvpool volume history "$1" -o json |
        jq -e --arg k "$2" 'any(.[]; (.kind | startswith($k)) and .result == "done")' >/dev/null
}
# used_on TARGET: the bytes its grain pool reported taken.
used_on() { nvpool target info "$1" -o json | jq '[.devices[].used_bytes] | add'; }
used_below() { [[ $(used_on "$1") -lt $2 ]]; }
# last_copies NAME: NAME's last three copy jobs, to stderr (a failure's why).
last_copies() {
    nvpool volume history "$1" -o json |
        jq -c '.[0:3][] | {id, kind, to, result, bytes_copied, error}' >&2
}
# settle SINCE: until REPORT_S seconds have passed since SINCE ($SECONDS).
settle() { while ((SECONDS - $1 < REPORT_S)); do sleep 0.5; done; }

log "starting a control plane and 3 targets on grain pools in $E2E_DIR"
start_control_plane || { bad "control plane starts"; summary; exit 1; }
for i in 0 1 2; do start_thin_target "$i"; done
check "3 targets register and are online" wait_targets 3
check "a ${VOLUME_MIB} MiB thin RAID1 volume" quiet \
    nvpool volume create data --size "${VOLUME_MIB}M" --layout raid1 --copies 2
check "it is thin, one row of two copies" \
    test "$(nvpool volume info data -o json | jq -r '"\(.provisioning) \(.extents | length)"')" = "thin 2"
truncate -s "${VOLUME_MIB}M" "$MODEL"

dev=$(attach data)
check "attach gives a block device (got '$dev')" test -b "$dev"
# State s1: 6 MiB in three places; s2: 1 MiB of it overwritten; live: 1
# MiB more overwritten and 1 MiB new. 9 MiB taken per copy, shared (the
# writes are whole 64 KiB grains).
check "write 3 x 2 MiB" put "$dev" 0 2 20 2 40 2
sum_s1=$(model_sum)
check "the volume reads what was written" reads "$dev" "$sum_s1"
check "snapshot data@s1" quiet nvpool snapshot create data@s1
check "overwrite 1 MiB" put "$dev" 20 1
sum_s2=$(model_sum)
check "snapshot data@s2" quiet nvpool snapshot create data@s2
check "overwrite 1 MiB more and write 1 MiB new" put "$dev" 40 1 30 1
check "the volume reads its live state" reads "$dev" "$(model_sum)"

# (a) In-place resync of a copy whose target was SIGKILLed.
victim=$(target_of data 1)
vi=${victim#t}
log "resync: SIGKILL $victim (holds copy 1)"
kill -9 "${TARGET_PIDS[vi]}"
wait "${TARGET_PIDS[vi]}" 2>/dev/null
check "resync: 1 MiB written with $victim dead" put "$dev" 10 1
sum_live=$(model_sum)
check "resync: the host gave $victim's copy up" wait_for 30 has_stale data
start_thin_target "$vi"
check "resync: $victim is back" wait_targets 3
if wait_for 60 in_sync data; then
    ok "resync: the copy is rebuilt in place (online, nothing stale, no copy job)"
else
    bad "resync: the copy is rebuilt in place (online, nothing stale, no copy job)"
    nvpool volume info data -o json | jq -c '{status, failed_extents, copy_jobs}' >&2
    last_copies data
fi
synced=$SECONDS
check "resync: the history has a resync done" history_done data resync
check "resync: both copies compared equal (nvpool volume verify)" copies_agree data
check "resync: the volume reads its live state" reads "$dev" "$sum_live"
# 10 MiB taken per copy (the 9 above and the 1 written meanwhile); a resync
# that filled holes would take the whole 64.
settle "$synced"
used=$(used_on "$victim")
check "resync: $victim's pool holds what was written, holes left (10 MiB <= $((used / MIB)) MiB < 20)" \
    test "$used" -ge $((10 * MIB)) -a "$used" -lt $((20 * MIB))

# (b) Drain a target holding a copy: the copy moves with @s1 and @s2.
drainee=$(target_of data 0)
dest=
for t in t0 t1 t2; do none_on data "$t" && dest=$t; done
log "drain: $drainee, its copy to ${dest:-?}"
check "drain: nvpool target drain $drainee" quiet nvpool target drain "$drainee"
if wait_for 60 moved_off data "$drainee"; then
    ok "drain: the copy left $drainee (online, nothing stale, no copy job)"
else
    bad "drain: the copy left $drainee (online, nothing stale, no copy job)"
    nvpool volume info data -o json | jq -c '{status, failed_extents, copy_jobs, extents}' >&2
    last_copies data
fi
drained=$SECONDS
check "drain: the history has a move done" history_done data move
check "drain: the copy is on ${dest:-the third target} now" some_on data "$dest"
check "drain: both copies compared equal (nvpool volume verify)" copies_agree data
check "drain: the volume still reads its live state" reads "$dev" "$sum_live"
if wait_for 30 used_below "$drainee" "$MIB"; then
    ok "drain: $drainee's pool is empty again (snapshot trees too)"
else
    bad "drain: $drainee's pool is empty again (snapshot trees too): $(($(used_on "$drainee") / MIB)) MiB used"
fi
for s in s1 s2; do
    sum=sum_$s
    check "drain: a clone of data@$s" quiet nvpool volume create "c-$s" --from-snapshot "data@$s"
    check "drain: c-$s is placed off $drainee (the snapshot's trees moved)" none_on "c-$s" "$drainee"
    cdev=$(attach "c-$s")
    check "drain: attach c-$s (got '$cdev')" test -b "$cdev"
    check "drain: c-$s reads data@$s exactly" reads "$cdev" "${!sum}"
    check "drain: detach c-$s" quiet nvpool volume detach "c-$s" --host-nqn "$HOSTNQN"
done
# Unshared, the three trees would take 6 + 6 + 8 MiB; shared, 10.
settle "$drained"
used=$(used_on "$dest")
if [[ $used -ge $((10 * MIB)) && $used -lt $((20 * MIB)) ]]; then
    ok "drain: $dest's pool holds the family shared (10 MiB <= $((used / MIB)) MiB < 20)"
else
    bad "drain: $dest's pool holds the family shared (10 MiB <= $((used / MIB)) MiB < 20)"
    last_copies data
fi
check "detach" quiet nvpool volume detach data --host-nqn "$HOSTNQN"

summary
