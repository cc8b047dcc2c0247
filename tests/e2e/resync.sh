#!/usr/bin/env bash
# End to end on this host, as root: stale copies heal themselves online.
# A control plane and four nvpool-target daemons on loopback; RAID1 and
# RAID10 volumes attached through FUSE + loop with fio writing and verifying
# (crc32c) throughout:
#  (a) one target is killed with SIGKILL and restarted after the host gave
#      its copies up: every stale copy is resynchronised, partially (only the
#      regions written meanwhile), without anyone typing a command; the
#      volume is online again, fio saw no error, `nvpool volume verify`
#      finds the copies equal, and after detach every row's copies are
#      byte-identical on the targets' backing files;
#  (c) the control plane, then the copier's target, killed with SIGKILL in
#      the middle of a throttled copy: the copy completes anyway (resumed, or
#      failed and redone), fio saw no error, copies agree;
#  (e) a rolling restart of every target in turn, each from a fresh copy of
#      the binary (an upgrade), waiting for the volume to be in sync before
#      the next: zero I/O errors, zero verify failures, copies identical;
#  (b) a target killed for good: past the grace period (--replace-after)
#      its copies are rebuilt on the other targets and swapped in, and the
#      dead target is removed (--force);
#  (c) a fifth target joins: `nvpool pool rebalance` moves data onto it
#      while fio writes;
#  (d) `nvpool target drain` empties a target while fio writes; `target
#      ls` shows it drained and `target rm` removes it.
#
# Usage: tests/e2e/resync.sh [BIN_DIR]   (default target/release)
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=$(cd "${1:-target/release}" && pwd)
CP_PORT=14530 TARGET_PORT_BASE=14520 ADMIN_PORT_BASE=14580
EXTENT_BYTES=$((64 << 20))
source tests/e2e/lib.sh

need_host jq curl fio cmp

trap 'stop_fio; cleanup' EXIT
FIO_PID=
FIO_NAME=

# fio_loop NAME DEV: rounds of 16 KiB random writes over the first 24 MiB,
# each verified (crc32c) before the next, until $E2E_DIR/stop-NAME exists.
# A failed round leaves $E2E_DIR/fio-NAME.failed.
fio_loop() {
    local name=$1 dev=$2 round=0
    while [[ ! -f $E2E_DIR/stop-$name ]]; do
        round=$((round + 1))
        if ! fio --name="$name" --filename="$dev" --direct=1 --ioengine=libaio \
            --iodepth=8 --rw=randwrite --bs=16k --size=24M --verify=crc32c \
            --verify_fatal=1 --do_verify=1 --verify_state_save=0 \
            --randseed=$round --output="$E2E_DIR/fio-$name.out"; then
            cp "$E2E_DIR/fio-$name.out" "$E2E_DIR/fio-$name.failed"
            return 1
        fi
        grep -q "err= 0" "$E2E_DIR/fio-$name.out" || {
            cp "$E2E_DIR/fio-$name.out" "$E2E_DIR/fio-$name.failed"
            return 1
        }
        echo "$round" >"$E2E_DIR/fio-$name.rounds"
    done
}

start_fio() {
    rm -f "$E2E_DIR/stop-$1" "$E2E_DIR/fio-$1.failed" "$E2E_DIR/fio-$1.rounds"
    fio_loop "$1" "$2" &
    FIO_PID=$!
    FIO_NAME=$1
}

stop_fio() {
    [[ -n $FIO_PID ]] || return 0
    touch "$E2E_DIR/stop-$FIO_NAME"
    wait "$FIO_PID" 2>/dev/null
    local rc=$?
    FIO_PID=
    return $rc
}

# rounds NAME: fio rounds completed so far.
rounds() {
    cat "$E2E_DIR/fio-$1.rounds" 2>/dev/null || echo 0
}

# rounds_past N K: the roll loop has done at least K rounds since N.
rounds_past() {
    [[ $(rounds roll) -ge $(($1 + $2)) ]]
}

CP_ARGS=()

# has_stale NAME: some copy is stale (the host gave it up).
has_stale() {
    nvpool volume info "$1" -o json | jq -e '(.failed_extents | length) > 0' >/dev/null
}

# copies_identical NAME: every row's copies hold the same bytes on the
# targets' backing files (read directly, the volume detached).
copies_identical() {
    local name=$1 json rows ok=0
    json=$(nvpool volume info "$name" -o json)
    local n copies
    n=$(jq '.extents | length' <<<"$json")
    copies=$(jq '.layout.copies' <<<"$json")
    local i
    for ((i = 0; i < n; i += copies)); do
        local a b
        a=$(jq -r ".extents[$i] | \"\(.target) \(.offset) \(.length)\"" <<<"$json")
        b=$(jq -r ".extents[$((i + 1))] | \"\(.target) \(.offset) \(.length)\"" <<<"$json")
        read -r ta oa la <<<"$a"
        read -r tb ob lb <<<"$b"
        if ! cmp -s <(dd if="$E2E_DIR/$ta/d0.img" bs=1M skip=$((oa >> 20)) count=$((la >> 20)) status=none) \
            <(dd if="$E2E_DIR/$tb/d0.img" bs=1M skip=$((ob >> 20)) count=$((lb >> 20)) status=none); then
            echo "$name: extents $i ($ta@$oa) and $((i + 1)) ($tb@$ob) differ" >&2
            ok=1
        fi
    done
    return $ok
}

log "starting a control plane and 4 targets in $E2E_DIR"
start_control_plane || {
    bad "control plane starts"
    summary
    exit 1
}
for i in 0 1 2 3; do start_target "$i" 2G; done
check "4 targets register and are online" wait_targets 4

# (a) kill -9 a target, keep writing, restart it: partial resync.
scenario_a() {
    local name=$1
    shift
    if ! nvpool volume create "$name" --size 256M "$@" >/dev/null; then
        bad "$name: create"
        return
    fi
    local dev
    dev=$(nvpool volume attach "$name" --frontend fuse --host-nqn "$HOSTNQN")
    [[ -b $dev ]] || {
        bad "$name: attach (got '$dev')"
        return
    }
    start_fio "$name" "$dev"
    sleep 2
    local victim vi
    victim=$(nvpool volume info "$name" -o json | jq -r '.extents[1].target')
    vi=${victim#t}
    kill -9 "${TARGET_PIDS[vi]}"
    log "$name: killed $victim"
    check "$name: the host gives the dead copies up (volume degraded)" \
        wait_for 30 has_stale "$name"
    sleep 2
    start_target "$vi" 2G
    log "$name: restarted $victim"
    check "$name: back in sync without a command (online, nothing stale)" \
        wait_for 120 in_sync "$name"
    nvpool volume history "$name" || true
    local h
    h=$(nvpool volume history "$name" -o json)
    check "$name: every copy resynced partially and completed" \
        jq -e 'length > 0 and all(.kind == "resync-partial" and .result == "done")' <<<"$h"
    local copied total
    copied=$(jq '[.[].bytes_copied] | add' <<<"$h")
    total=$(nvpool volume info "$name" -o json | jq '[.extents[] | .length] | add / 2')
    log "$name: resync copied $copied bytes of $total"
    check "$name: copied far less than the copies hold ($copied < $total / 4)" \
        test "$copied" -lt $((total / 4))
    sleep 2
    if stop_fio; then
        ok "$name: fio verify=crc32c saw no error ($(cat "$E2E_DIR/fio-$name.rounds" 2>/dev/null) rounds)"
    else
        bad "$name: fio failed"
        cat "$E2E_DIR/fio-$name.failed" 2>/dev/null
    fi
    check "$name: nvpool volume verify finds the copies equal (online)" \
        nvpool volume verify "$name"
    check "$name: detach" nvpool volume detach "$name" --host-nqn "$HOSTNQN"
    check "$name: every row's copies are byte-identical on the targets" copies_identical "$name"
}

scenario_a r1 --layout raid1 --copies 2
scenario_a r10 --layout raid10 --stripe-width 2 --copies 2

# copying NAME: a copy job of NAME is copying.
copying() {
    nvpool volume info "$1" -o json | jq -e 'any(.copy_jobs[]; .state == "copying")' >/dev/null
}

restart_control_plane() {
    kill "-$1" "$CP_PID"
    wait "$CP_PID" 2>/dev/null
    start_control_plane
}

# (c) crashes mid-copy: the control plane, then the copier's target, are
# killed with SIGKILL while a (throttled) resync copies; each time the copy
# completes anyway (resumed, or failed and redone) and the copies agree.
log "crashes in the middle of a copy"
CP_ARGS=(--rebuild-rate 2M)
restart_control_plane TERM || bad "control plane restarts with --rebuild-rate 2M"
if dev=$(nvpool volume attach r1 --frontend fuse --host-nqn "$HOSTNQN") && [[ -b $dev ]]; then
    start_fio crash "$dev"
    victim=$(nvpool volume info r1 -o json | jq -r '.extents[1].target')
    vi=${victim#t}
    kill -9 "${TARGET_PIDS[vi]}"
    check "crash: copies on $victim given up" wait_for 30 has_stale r1
    sleep 2
    start_target "$vi" 2G
    check "crash: a copy job is copying" wait_for 60 copying r1
    restart_control_plane KILL || bad "crash: control plane restarts after SIGKILL"
    log "crash: control plane killed with SIGKILL mid-copy and restarted"
    check "crash: the copy goes on and completes after the control plane's restart" \
        wait_for 120 in_sync r1
    # Again, and this time the copier's own process dies.
    kill -9 "${TARGET_PIDS[vi]}"
    check "crash: copies on $victim given up again" wait_for 30 has_stale r1
    sleep 2
    start_target "$vi" 2G
    check "crash: a copy job is copying again" wait_for 60 copying r1
    kill -9 "${TARGET_PIDS[vi]}"
    log "crash: $victim (the copier) killed with SIGKILL mid-copy"
    sleep 2
    start_target "$vi" 2G
    check "crash: the failed copy is redone and completes" wait_for 180 in_sync r1
    nvpool volume history r1 || true
    if stop_fio; then
        ok "crash: fio verify=crc32c saw no error ($(rounds crash) rounds)"
    else
        bad "crash: fio failed"
        cat "$E2E_DIR/fio-crash.failed" 2>/dev/null
    fi
    check "crash: nvpool volume verify finds the copies equal" nvpool volume verify r1
    check "crash: detach" nvpool volume detach r1 --host-nqn "$HOSTNQN"
    check "crash: copies byte-identical" copies_identical r1
else
    bad "crash: attach"
fi
CP_ARGS=()
restart_control_plane TERM || bad "control plane restarts"

# (e) rolling upgrade: each target restarted from a fresh copy of the binary
# while fio verifies; the next only once the volume is in sync again.
log "rolling restart of every target under fio"
if dev=$(nvpool volume attach r10 --frontend fuse --host-nqn "$HOSTNQN") && [[ -b $dev ]]; then
    start_fio roll "$dev"
    for i in 0 1 2 3; do
        gen=$E2E_DIR/bin-gen$i
        mkdir -p "$gen"
        cp "$BIN/nvpool-target" "$gen/"
        kill -TERM "${TARGET_PIDS[i]}"
        wait "${TARGET_PIDS[i]}" 2>/dev/null
        TARGET_BIN=$gen/nvpool-target start_target "$i" 2G
        check "roll: t$i answers again" wait_for 30 target_admin "$i" /v1/health -o /dev/null
        # Let I/O flow through the new process before judging.
        check "roll: fio goes on through t$i's new process" wait_for 60 rounds_past "$(rounds roll)" 2
        check "roll: t$i restarted from $gen and in sync" wait_for 120 in_sync r10
    done
    if stop_fio; then
        ok "roll: fio verify=crc32c saw no error ($(cat "$E2E_DIR/fio-roll.rounds" 2>/dev/null) rounds)"
    else
        bad "roll: fio failed"
        cat "$E2E_DIR/fio-roll.failed" 2>/dev/null
    fi
    check "roll: detach" nvpool volume detach r10 --host-nqn "$HOSTNQN"
    check "roll: copies byte-identical after the upgrade" copies_identical r10
else
    bad "roll: attach"
fi

# extents_on NAME TARGET: how many extents of NAME TARGET holds.
extents_on() {
    nvpool volume info "$1" -o json | jq --arg t "$2" '[.extents[] | select(.target == $t)] | length'
}

# none_on NAME TARGET: TARGET holds no extent of NAME.
none_on() {
    [[ $(extents_on "$1" "$2") -eq 0 ]]
}

# healed_off NAME TARGET: in sync, and nothing of NAME left on TARGET.
healed_off() {
    in_sync "$1" && none_on "$1" "$2"
}

# history_has NAME KIND: a copy of KIND completed on NAME.
history_has() {
    nvpool volume history "$1" -o json |
        jq -e --arg k "$2" 'any(.[]; .kind == $k and .result == "done" and .bytes_copied > 0)' >/dev/null
}

# online TARGET: TARGET is registered and online.
online() {
    nvpool target ls -o json | jq -e --arg t "$1" 'any(.[]; .id == $t and .health == "online")' >/dev/null
}

# nothing_to_move: a rebalance plan would move nothing.
nothing_to_move() {
    nvpool pool rebalance --dry-run -o json | jq -e '.moves | length == 0' >/dev/null
}

# listed_drained TARGET: `target ls` shows TARGET drained.
listed_drained() {
    nvpool target ls | grep -E "[│| ]$1 .*drained" >/dev/null
}

# rm_refused TARGET: `target rm` refuses TARGET (it holds data).
rm_refused() {
    ! nvpool target rm "$1" 2>/dev/null
}

# used_on TARGET: bytes allocated on TARGET.
used_on() {
    nvpool target info "$1" -o json | jq '.capacity.used_bytes'
}

# fio_ok NAME LABEL: stop the fio loop and judge it.
fio_ok() {
    if stop_fio; then
        ok "$2: fio verify=crc32c saw no error ($(rounds "$1") rounds)"
    else
        bad "$2: fio failed"
        cat "$E2E_DIR/fio-$1.failed" 2>/dev/null
    fi
}

# (b) a target gone for good: replaced after the grace period.
log "replacement of a target that does not come back"
CP_ARGS=(--replace-after 20s)
restart_control_plane TERM || bad "control plane restarts with --replace-after 20s"
dev=
if dev=$(nvpool volume attach r1 --frontend fuse --host-nqn "$HOSTNQN") && [[ -b $dev ]]; then
    start_fio replace "$dev"
    sleep 2
    victim=$(nvpool volume info r1 -o json | jq -r '.extents[1].target')
    vi=${victim#t}
    kill -9 "${TARGET_PIDS[vi]}"
    wait "${TARGET_PIDS[vi]}" 2>/dev/null
    log "replace: killed $victim for good"
    check "replace: the host gives the dead copies up" wait_for 30 has_stale r1
    check "replace: past the grace period the copies are rebuilt elsewhere" \
        wait_for 180 healed_off r1 "$victim"
    nvpool volume history r1 | head -6 || true
    check "replace: the history says replace, done" history_has r1 replace
    fio_ok replace replace
    check "replace: nvpool volume verify finds the copies equal" nvpool volume verify r1
else
    bad "replace: attach"
    dev=
fi

# (c) a fifth target joins: r10 (four targets per row) gets its copies on
# the dead target rebuilt there, and a rebalance moves data onto it while
# fio writes.
log "a fifth target and a rebalance"
start_target 4 2G
check "rebalance: t4 registers" wait_for 30 online t4
check "rebalance: r10's copies on the dead target are rebuilt on t4" \
    wait_for 180 healed_off r10 "$victim"
check "the dead $victim is removed (--force: it cannot be reconciled)" \
    nvpool target rm "$victim" --force
if [[ -b $dev ]]; then
    start_fio rebalance "$dev"
    nvpool pool rebalance --dry-run || true
    before=$(used_on t4)
    check "rebalance: nvpool pool rebalance --wait completes" nvpool pool rebalance --wait
    after=$(used_on t4)
    check "rebalance: data moved onto t4 ($before -> $after bytes)" test "$after" -gt "$before"
    check "rebalance: a new plan moves nothing" nothing_to_move
    nvpool target ls || true
    fio_ok rebalance rebalance
fi

# (d) drain a target while fio writes, then remove it (r10 spans every
# live target, four per row, so it goes first).
log "drain and remove a target"
check "drain: r10 deleted to make room" nvpool volume delete r10
drainee=$(nvpool volume info r1 -o json | jq -r '.extents[0].target')
if [[ -b $dev ]]; then
    start_fio drain "$dev"
    check "drain: nvpool target drain $drainee --wait" nvpool target drain "$drainee" --wait
    nvpool target ls || true
    check "drain: target ls shows $drainee drained" listed_drained "$drainee"
    check "drain: r1 holds nothing on $drainee" none_on r1 "$drainee"
    check "drain: the history says move, done" history_has r1 move
    fio_ok drain drain
    check "drain: nvpool volume verify finds the copies equal" nvpool volume verify r1
    check "drain: detach" nvpool volume detach r1 --host-nqn "$HOSTNQN"
    check "drain: copies byte-identical after replace, rebalance and drain" copies_identical r1
    check "drain: $drainee is removed" wait_for 30 nvpool target rm "$drainee"
    check "drain: a target holding data cannot be removed" \
        rm_refused "$(nvpool volume info r1 -o json | jq -r '.extents[0].target')"
else
    bad "drain: no attached device"
fi
CP_ARGS=()

summary
