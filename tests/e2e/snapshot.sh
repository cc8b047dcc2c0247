#!/usr/bin/env bash
# End to end on this host, as root: snapshots and clones of a thin RAID1
# volume with real processes (a control plane and two targets on grain
# pools, the agent serving the volume through FUSE + loop).
#
# The ordering check: a writer writes record i to block i, each write
# issued only after the previous one completed (direct, dsync). Snapshots
# are taken while it runs. Each snapshot, read through a clone, must hold
# records 0..k-1 and nothing after (a write is never in a snapshot without
# the writes that completed before it was issued), with k at least the
# records completed before the snapshot was asked for and at most one more
# than those completed when it was answered. One target is SIGKILLed
# mid-run: a snapshot then either fails and leaves nothing, or holds the
# same property; after the copy heals, snapshots work again.
#
# Then: a clone is writable and independent of its snapshot and of other
# clones, a snapshot deleted under a clone leaves the clone intact, and
# once everything is deleted the pools are empty again.
#
# Usage: tests/e2e/snapshot.sh [BIN_DIR]   (default target/release)
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=$(cd "${1:-target/release}" && pwd)
source tests/e2e/lib.sh

need_host jq curl cmp

trap 'stop_writer; cleanup' EXIT
MIB=$((1 << 20))
ROUNDS=${SNAPSHOT_ROUNDS:-12}
DONE=$E2E_DIR/writer.done
STOP=$E2E_DIR/writer.stop
WRITER=

quiet() { "$@" >/dev/null; }
used_below() { [[ $(nvpool pool df -o json | jq -r .total.used_bytes) -lt $1 ]]; }

# writer DEV: record i (`rec i`, padded to 4 KiB) to block i, one after
# another, until $STOP exists; $DONE holds how many completed.
writer() {
    local dev=$1 i=0
    echo 0 >"$DONE"
    while [[ ! -e $STOP ]]; do
        printf 'rec %d' "$i" |
            dd of="$dev" bs=4096 seek="$i" count=1 conv=sync,notrunc oflag=direct,dsync \
                status=none 2>>"$E2E_DIR/writer.err" || { sleep 0.2; continue; }
        i=$((i + 1))
        # Renamed into place: a reader never sees it empty.
        echo "$i" >"$DONE.new" && mv "$DONE.new" "$DONE"
    done
}
stop_writer() {
    [[ -n $WRITER ]] || return 0
    touch "$STOP"
    wait "$WRITER" 2>/dev/null
    WRITER=
}

# records DEV BLOCKS: k when the first BLOCKS blocks hold records 0..k-1
# in order and nothing after; fails on a gap or a stray record.
records() {
    dd if="$1" bs=4096 count="$2" iflag=direct status=none | tr '\0' '\n' | grep -a '^rec ' |
        awk '$2 + 0 != NR - 1 { bad = 1; exit } { n = NR } END { if (bad) exit 1; print n + 0 }'
}

# snap NAME: takes data@NAME while the writer runs; records the writer's
# count before and after in $E2E_DIR/NAME.bounds. Fails when the snapshot
# failed.
snap() {
    local lo hi
    lo=$(cat "$DONE")
    nvpool snapshot create "data@$1" >"$E2E_DIR/$1.out" 2>&1 || return 1
    hi=$(cat "$DONE")
    echo "$lo $hi" >"$E2E_DIR/$1.bounds"
}

# check_snapshot NAME: clones data@NAME, reads it and checks the prefix
# and its bounds, then deletes the clone.
check_snapshot() {
    local name=$1 lo hi k dev
    read -r lo hi <"$E2E_DIR/$name.bounds"
    quiet nvpool volume create "c-$name" --from "data@$name" || return 1
    dev=$(nvpool volume attach "c-$name" --frontend fuse --host-nqn "$HOSTNQN") || return 1
    k=$(records "$dev" $((hi + 64)))
    local r=$?
    nvpool volume detach "c-$name" --host-nqn "$HOSTNQN" >/dev/null
    quiet nvpool volume delete "c-$name"
    log "snapshot $name: records 0..$((k - 1)) (writer had $lo done before, $hi after)"
    [[ $r -eq 0 && $k -ge $lo && $k -le $((hi + 1)) ]]
}

log "starting a control plane and 2 targets on grain pools in $E2E_DIR"
start_control_plane || { bad "control plane starts"; summary; exit 1; }
for i in 0 1; do start_thin_target "$i"; done
check "2 targets register and are online" wait_targets 2
check "a 2 GiB thin RAID1 volume" quiet \
    nvpool volume create data --size 2G --layout raid1 --copies 2
check "a snapshot of a detached volume" quiet nvpool snapshot create data@empty
check "is listed ready" \
    test "$(nvpool snapshot ls data -o json | jq -r '.[] | select(.name == "empty") | .state')" = ready
check "taking it again answers the same snapshot" quiet nvpool snapshot create data@empty
check "a bad snapshot name is a usage error" bash -c "'$BIN/nvpool' snapshot create data 2>/dev/null; [[ \$? -eq 2 ]]"

dev=$(nvpool volume attach data --frontend fuse --host-nqn "$HOSTNQN")
check "attach gives a block device (got '$dev')" test -b "$dev"
rm -f "$STOP"
writer "$dev" &
WRITER=$!
check "the writer is writing" wait_for 20 bash -c "[[ \$(cat '$DONE') -gt 20 ]]"

taken=()
for r in $(seq 1 "$ROUNDS"); do
    sleep "0.$((RANDOM % 8 + 2))"
    if [[ $r -eq $((ROUNDS / 2)) ]]; then
        log "SIGKILL target t1 while the writer runs"
        kill -9 "${TARGET_PIDS[1]}"
        wait "${TARGET_PIDS[1]}" 2>/dev/null
        if snap "down$r"; then
            taken+=("down$r")
            ok "a snapshot with a copy's target dead succeeded (checked below)"
        else
            check "a snapshot with a copy's target dead fails, saying why" \
                grep -qiE "target|copy|unreachable|failed" "$E2E_DIR/down$r.out"
            check "and leaves nothing behind" \
                test "$(nvpool snapshot ls data -o json | jq "[.[] | select(.name == \"down$r\")] | length")" -eq 0
        fi
        start_thin_target 1
        check "the target is back" wait_targets 2
        check "the copy heals" wait_for 120 in_sync data
        continue
    fi
    if snap "r$r"; then
        taken+=("r$r")
        ok "snapshot r$r taken while writing"
    else
        bad "snapshot r$r taken while writing: $(cat "$E2E_DIR/r$r.out")"
    fi
done
stop_writer
written=$(cat "$DONE")
check "the volume holds every record written ($written)" \
    test "$(records "$dev" $((written + 64)))" = "$written"
check "detach" nvpool volume detach data --host-nqn "$HOSTNQN"

for name in "${taken[@]}"; do
    check "snapshot $name holds a prefix of the records, within its bounds" check_snapshot "$name"
done

log "clones are independent"
dev=
check "clone c1 of data@r1" quiet nvpool volume create c1 --from data@r1
c1=$(nvpool volume attach c1 --frontend fuse --host-nqn "$HOSTNQN")
check "attach c1" test -b "$c1"
before=$(records "$c1" $((written + 64)))
check "write to c1" bash -c "printf 'rec 999999' | dd of='$c1' bs=4096 count=1 conv=sync,notrunc oflag=direct,dsync status=none"
check "c1 reads its own write" bash -c "dd if='$c1' bs=4096 count=1 iflag=direct status=none | grep -aq 'rec 999999'"
check "delete the snapshot c1 came from" quiet nvpool snapshot rm data@r1
check "it is gone" bash -c "! '$BIN/nvpool' snapshot info data@r1 >/dev/null 2>&1"
check "c1 still holds the snapshot's other records ($before)" \
    bash -c "dd if='$c1' bs=4096 skip=1 count=1 iflag=direct status=none | tr '\\0' '\\n' | grep -axq 'rec 1'"
check "detach c1" nvpool volume detach c1 --host-nqn "$HOSTNQN"
check "a volume with snapshots is not deleted" bash -c "! '$BIN/nvpool' volume delete data 2>/dev/null"

log "a read-only dataset volume from a snapshot"
ro_snap=$(nvpool snapshot ls data -o json | jq -r '[.[] | select(.name != "empty" and .state == "ready")][0].name')
check "read-only without a source is a usage error" \
    bash -c "'$BIN/nvpool' volume create ro0 --size 1G --read-only 2>/dev/null; [[ \$? -eq 2 ]]"
check "read-only clone ds of data@$ro_snap" quiet nvpool volume create ds --from-snapshot "data@$ro_snap" --read-only
check "it says so" bash -c "[[ \$('$BIN/nvpool' volume info ds -o json | jq -r .read_only) == true ]]"
ds=$(nvpool volume attach ds --frontend fuse --host-nqn "$HOSTNQN")
check "attach ds gives a block device (got '$ds')" test -b "$ds"
check "the host sees it read-only" bash -c "[[ \$(blockdev --getro '$ds') == 1 ]]"
check "a write to it fails" bash -c "! printf x | dd of='$ds' bs=4096 count=1 conv=sync,notrunc oflag=direct status=none 2>/dev/null"
check "it reads the snapshot's records" \
    bash -c "dd if='$ds' bs=4096 skip=1 count=1 iflag=direct status=none | tr '\\0' '\\n' | grep -axq 'rec 1'"
check "detach ds" nvpool volume detach ds --host-nqn "$HOSTNQN"
check "delete ds" quiet nvpool volume delete ds

log "deleting everything"
for s in $(nvpool snapshot ls data -o json | jq -r '.[].name'); do
    check "delete data@$s" quiet nvpool snapshot rm "data@$s"
done
check "delete c1" quiet nvpool volume delete c1
check "delete data" quiet nvpool volume delete data
check "every tree is released: the pools are empty again" wait_for 30 used_below $MIB

summary
