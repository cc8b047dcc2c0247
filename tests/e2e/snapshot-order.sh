#!/usr/bin/env bash
# End to end on this host, as root: the ordering checker of design T5 (a
# write issued after another write completed is never in a snapshot
# without its predecessor), in randomized rounds against real targets,
# with target SIGKILLs.
#
# A control plane and four targets on grain pools; a thin RAID10 volume
# (2 stripe members of 4 KiB units × 2 copies, 1 MiB extents: 16 extents
# over the 4 targets) attached through the agent (FUSE + loop). Two
# writers, A and B, each write records one after another (each issued
# only after the previous one completed: direct, dsync). Record i of
# writer W is `rec W i DEP`, where DEP is the highest record of the other
# writer that had completed when it was issued (-1: none); it goes to slot
# i mod SLOTS of W's ring, every slot 31 blocks from the next, so
# consecutive records land on different stripe members, rows and targets.
#
# Each round waits a random short time and takes a snapshot (sometimes two
# back to back). Some rounds SIGKILL one target, or two that hold no
# (row, member) together, a random moment into a snapshot's creation, and
# restart them (as lib.sh starts them) within two seconds, before the
# host's controller-loss timeout: the host reconnects and reissues what
# was in flight, so the volume needs no resync, and `nvpool volume verify`
# must then find every row's copies equal. A snapshot given up (503
# snapshot_failed: a target died mid-creation) must leave nothing; those
# are counted. Copies the host gave up anyway cannot heal on grain pools
# yet (a resync copies the live tree only: design T7), so the volume is
# then replaced by a new one rather than snapshotted degraded.
#
# Every ready snapshot is read through a clone (in batches of BATCH, each
# clone and snapshot deleted once read so the pools do not fill) and must
# hold exactly each writer's ring after its records 0..k-1 for some k
# (nothing missing before the newest record seen, no stale record in a
# slot, every record at its place), with k at least the records completed
# before the snapshot was asked for and at most one more (the one in
# flight) than those completed when it was answered, and no record whose
# DEP is beyond the other writer's k.
#
# The randomness is seeded and the seed printed: SEED=N replays the same
# waits, kills and victims (not the same interleavings: those are real).
#
# Usage: tests/e2e/snapshot-order.sh [BIN_DIR]   (default target/release)
# Environment: SEED, ORDER_ROUNDS (200), ORDER_LAYOUT (raid10 | raid1),
# ORDER_KILL_PCT (6: the rounds that kill), ORDER_VERBOSE=1 (each snapshot's k).
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=$(cd "${1:-target/release}" && pwd)
CP_PORT=${CP_PORT:-14730} TARGET_PORT_BASE=${TARGET_PORT_BASE:-14720}
ADMIN_PORT_BASE=${ADMIN_PORT_BASE:-14780}
# Small extents: the ring of records spans many of them.
EXTENT_BYTES=$((1 << 20))
source tests/e2e/lib.sh

need_host jq dd grep awk

ROUNDS=${ORDER_ROUNDS:-200}
LAYOUT=${ORDER_LAYOUT:-raid10}
SEED=${SEED:-$(($(date +%s%N) % 1000000))}
RANDOM=$SEED
TARGETS=4
# Records kept per writer: a snapshot shows each writer's last SLOTS.
SLOTS=64
# Blocks between a writer's slots (odd: consecutive slots alternate
# stripe members) and where each writer's ring starts, in 4 KiB blocks.
SLOT_STRIDE_BLOCKS=31
BASE_A_BLOCKS=0
BASE_B_BLOCKS=16
# The volume: the rings end below 2048 blocks.
VOLUME_MIB=8
# Ready snapshots waiting for their check before a batch is read.
BATCH=10
# Chance (in %) that a round kills targets, and that a kill takes two.
KILL_PCT=${ORDER_KILL_PCT:-6}
PAIR_PCT=40
# Chance (in %) that a round takes two snapshots back to back.
DOUBLE_PCT=20

STOP=$E2E_DIR/writers.stop
declare -a WRITERS=()
declare -a PENDING=()
rounds_done=0 ready=0 given_up=0 refused=0 kills=0 checked=0 records=0
replaced=0 written=0 violations=0 diverged=0
DEV=
declare -a LAYOUT_ARGS=()

stop_writers() {
    [[ ${#WRITERS[@]} -gt 0 ]] || return 0
    touch "$STOP"
    wait "${WRITERS[@]}" 2>/dev/null
    WRITERS=()
}
trap 'stop_writers; cleanup' EXIT

quiet() { "$@" >/dev/null 2>&1; }

# done_count W: how many records writer W has completed. Its file is
# rewritten in one write, so a line read whole (with its newline) is a
# value it held.
done_count() {
    local d
    until read -r d 2>/dev/null <"$E2E_DIR/done.$1"; do :; done
    echo "$d"
}

# writer W OTHER BASE DEV: W's records, one after another, into its ring
# at block BASE of DEV until $STOP exists; $E2E_DIR/done.W holds how many
# completed. A failed write (a target dying under it) is written again.
writer() {
    local w=$1 other=$2 base=$3 dev=$4 i=0 dep=-1 d
    while [[ ! -e $STOP ]]; do
        read -r d 2>/dev/null <"$E2E_DIR/done.$other" && dep=$((d - 1))
        printf 'rec %s %d %d\n' "$w" "$i" "$dep" |
            dd of="$dev" bs=4096 seek=$((base + (i % SLOTS) * SLOT_STRIDE_BLOCKS)) count=1 \
                conv=sync,notrunc oflag=direct,dsync status=none 2>>"$E2E_DIR/writer.err" ||
            { sleep 0.1; continue; }
        i=$((i + 1))
        printf '%d\n' "$i" >"$E2E_DIR/done.$w"
    done
}

# snap NAME: takes data@NAME; NAME.bounds holds each writer's completed
# records before the request and after the answer, NAME.out the answer.
snap() {
    local a0 b0
    a0=$(done_count A)
    b0=$(done_count B)
    nvpool snapshot create "data@$1" >"$E2E_DIR/$1.out" 2>&1 || return 1
    echo "$a0 $(done_count A) $b0 $(done_count B)" >"$E2E_DIR/$1.bounds"
}

# outcome NAME STATUS: counts snapshot NAME as ready (queued for its
# check), given up or refused; anything else fails the test.
outcome() {
    local name=$1 rc=$2
    if [[ $rc -eq 0 ]]; then
        ready=$((ready + 1))
        PENDING+=("$name")
    elif grep -qE "was given up|snapshot_failed" "$E2E_DIR/$name.out"; then
        given_up=$((given_up + 1))
        if nvpool snapshot info "data@$name" >/dev/null 2>&1; then
            bad "snapshot $name was given up but is still there"
        fi
    elif grep -q "copy_in_progress" "$E2E_DIR/$name.out"; then
        refused=$((refused + 1))
    else
        bad "snapshot $name: $(cat "$E2E_DIR/$name.out")"
    fi
}

# ring_check LO_A HI_A LO_B HI_B < `grep -abo` matches: the records of a
# snapshot image, as "BYTE:rec W I DEP" lines. Prints "K_A K_B RECORDS"
# when the image is each writer's ring after a prefix of its records
# within its bounds, and no record depends on one of the other writer
# beyond its prefix; else says what is wrong and fails.
ring_check() {
    awk -F'[: ]' -v n="$SLOTS" -v stride="$SLOT_STRIDE_BLOCKS" \
        -v base_A="$BASE_A_BLOCKS" -v base_B="$BASE_B_BLOCKS" \
        -v lo_A="$1" -v hi_A="$2" -v lo_B="$3" -v hi_B="$4" '
        function fail(msg) { print "  " msg; bad = 1 }
        {
            w = $3; i = $4 + 0; dep = $5 + 0
            want = ((w == "A" ? base_A : base_B) + (i % n) * stride) * 4096
            if ($1 + 0 != want) fail(sprintf("record %s %d at byte %d, not %d", w, i, $1, want))
            if ((w, i % n) in at) fail(sprintf("slot %d of %s holds two records", i % n, w))
            at[w, i % n] = i
            dep_of[w, i] = dep
            if (!(w in top) || i > top[w]) top[w] = i
            found++
        }
        END {
            split("A B", ws, " ")
            for (x = 1; x <= 2; x++) {
                w = ws[x]
                k[w] = (w in top) ? top[w] + 1 : 0
                for (s = 0; s < n; s++) {
                    want = s < k[w] ? k[w] - 1 - (k[w] - 1 - s) % n : -1
                    got = ((w, s) in at) ? at[w, s] : -1
                    if (got != want)
                        fail(sprintf("%s: newest record %d, but slot %d holds %s (want %s)",
                            w, k[w] - 1, s, got < 0 ? "nothing" : got, want < 0 ? "nothing" : want))
                }
            }
            if (k["A"] < lo_A || k["A"] > hi_A + 1)
                fail(sprintf("A: records 0..%d, outside its bounds (%d done before, %d after)",
                    k["A"] - 1, lo_A, hi_A))
            if (k["B"] < lo_B || k["B"] > hi_B + 1)
                fail(sprintf("B: records 0..%d, outside its bounds (%d done before, %d after)",
                    k["B"] - 1, lo_B, hi_B))
            for (key in dep_of) {
                split(key, p, SUBSEP)
                o = p[1] == "A" ? "B" : "A"
                if (dep_of[key] >= k[o])
                    fail(sprintf("%s %d depends on %s %d, but %s holds only 0..%d",
                        p[1], p[2], o, dep_of[key], o, k[o] - 1))
            }
            if (bad) exit 1
            print k["A"], k["B"], found
        }'
}

# check_snapshot NAME: clones data@NAME, reads the clone, checks it, then
# deletes the clone and the snapshot.
check_snapshot() {
    local name=$1 lo_a hi_a lo_b hi_b dev out rc
    read -r lo_a hi_a lo_b hi_b <"$E2E_DIR/$name.bounds"
    if ! quiet nvpool volume create "c-$name" --from "data@$name"; then
        bad "clone of snapshot $name"
        return
    fi
    dev=$(nvpool volume attach "c-$name" --frontend fuse --host-nqn "$HOSTNQN")
    if [[ -b $dev ]]; then
        out=$(dd if="$dev" bs=1M count="$VOLUME_MIB" iflag=direct status=none |
            grep -aboE 'rec [AB] [0-9]+ -?[0-9]+' |
            ring_check "$lo_a" "$hi_a" "$lo_b" "$hi_b")
        rc=$?
        quiet nvpool volume detach "c-$name" --host-nqn "$HOSTNQN"
    else
        out="attach gave '$dev'" rc=1
    fi
    quiet nvpool volume delete "c-$name" || bad "delete clone c-$name"
    quiet nvpool snapshot rm "data@$name" || bad "delete snapshot $name"
    checked=$((checked + 1))
    if [[ $rc -ne 0 ]]; then
        violations=$((violations + 1))
        bad "snapshot $name is not a prefix of each writer's records:"
        printf '%s\n' "$out"
        return
    fi
    local ka kb n
    read -r ka kb n <<<"$out"
    records=$((records + n))
    [[ -n ${ORDER_VERBOSE:-} ]] && log "snapshot $name: A 0..$((ka - 1)), B 0..$((kb - 1))"
}

check_pending() {
    local name
    for name in "${PENDING[@]}"; do check_snapshot "$name"; done
    PENDING=()
}

# pick_victims: VICTIMS, one target or (PAIR_PCT of the time) two that
# hold no copy of the same (row, member), as their indices. The draws are
# made here, not in a subshell (which would reseed RANDOM).
declare -a VICTIMS=()
pick_victims() {
    local one=$((RANDOM % TARGETS)) pair=$((RANDOM % 100)) draw=$RANDOM pairs
    VICTIMS=("$one")
    [[ $pair -lt $PAIR_PCT ]] || return 0
    # The pairs of targets no (row, member) has both its copies on.
    mapfile -t pairs < <(nvpool volume info data -o json | jq -r --argjson n "$TARGETS" '
        [.extents | group_by([.row, .member])[] | [.[].target] | sort] as $rows
        | range($n) as $a | range($a + 1; $n) as $b | ["t\($a)", "t\($b)"]
        | select(. as $p | $rows | index([$p]) | not)
        | "\($a) \($b)"')
    [[ ${#pairs[@]} -gt 0 ]] && read -ra VICTIMS <<<"${pairs[draw % ${#pairs[@]}]}"
}

# progressed N: both writers completed records since the counts in N
# ("A B"): the volume takes writes again.
progressed() {
    local a b
    read -r a b <<<"$1"
    [[ $(done_count A) -gt $((a + 2)) && $(done_count B) -gt $((b + 2)) ]]
}

# volume_up: creates, attaches and starts writing the volume `data`
# (its rings blank, the writers' counts from 0); DEV is its device.
volume_up() {
    quiet nvpool volume create data --size "${VOLUME_MIB}M" "${LAYOUT_ARGS[@]}" ||
        { bad "create a thin $LAYOUT volume of $VOLUME_MIB MiB"; return 1; }
    DEV=$(nvpool volume attach data --frontend fuse --host-nqn "$HOSTNQN")
    [[ -b $DEV ]] || { bad "attach gives a block device (got '$DEV')"; return 1; }
    rm -f "$STOP"
    printf '0\n' >"$E2E_DIR/done.A"
    printf '0\n' >"$E2E_DIR/done.B"
    writer A B "$BASE_A_BLOCKS" "$DEV" &
    WRITERS+=($!)
    writer B A "$BASE_B_BLOCKS" "$DEV" &
    WRITERS+=($!)
    wait_for 20 progressed "0 0" || { bad "the writers are writing"; return 1; }
}

# volume_down: stops the writers, checks that the volume holds each
# writer's last record, then detaches and deletes it (its snapshots
# checked and deleted before).
volume_down() {
    stop_writers
    local a b
    a=$(done_count A) b=$(done_count B)
    written=$((written + a + b))
    dd if="$DEV" bs=1M count="$VOLUME_MIB" iflag=direct status=none |
        grep -aboE 'rec [AB] [0-9]+ -?[0-9]+' | ring_check "$a" $((a - 1)) "$b" $((b - 1)) >/dev/null ||
        bad "the volume holds exactly records A 0..$((a - 1)) and B 0..$((b - 1))"
    quiet nvpool volume detach data --host-nqn "$HOSTNQN" || bad "detach data"
    quiet nvpool volume delete data || bad "delete data"
}

# copies_agree: `nvpool volume verify` finds every row's copies equal
# (regions a write was in flight on are read again); else fails, showing
# where they differ.
copies_agree() {
    local report
    report=$(nvpool volume verify data -o json 2>&1) && return 0
    bad "the copies of data differ after a kill: $report"
    return 1
}

# kill_round R: SIGKILLs targets while snapshot kR is being created and
# restarts them within a few seconds, so that the host reconnects before
# it gives their copies up (C19's 5 s controller-loss timeout). Copies
# given up anyway cannot heal on grain pools yet (a resync copies the
# live tree only: T7), so the volume is then replaced by a new one.
kill_round() {
    local r=$1 pid rc i
    pick_victims
    local v=("${VICTIMS[@]}") delay_ms=$((RANDOM % 150)) down_ms=$((100 + RANDOM % 1900))
    snap "k$r" &
    pid=$!
    sleep "$(printf '0.%03d' "$delay_ms")"
    for i in "${v[@]}"; do
        kill -9 "${TARGET_PIDS[i]}"
        wait "${TARGET_PIDS[i]}" 2>/dev/null
    done
    kills=$((kills + ${#v[@]}))
    sleep "$((down_ms / 1000)).$(printf '%03d' $((down_ms % 1000)))"
    for i in "${v[@]}"; do start_thin_target "$i"; done
    wait "$pid"
    rc=$?
    outcome "k$r" "$rc"
    local counts
    counts="$(done_count A) $(done_count B)"
    wait_targets "$TARGETS" || bad "round $r: the targets are back"
    wait_for 30 progressed "$counts" || bad "round $r: the writers go on"
    local how=healed
    if in_sync data; then
        # The host kept both copies: they must hold the same bytes (the
        # writes in flight at the kill were reissued to the target).
        copies_agree || { how="healed, but the copies differ" diverged=$((diverged + 1)); }
    else
        how="copies given up, volume replaced"
        replaced=$((replaced + 1))
        check_pending
        volume_down
        volume_up
    fi
    log "round $r: SIGKILLed ${v[*]/#/t} ${delay_ms} ms into snapshot k$r, back after ${down_ms} ms:" \
        "snapshot $([[ $rc -eq 0 ]] && echo ready || echo "not taken"), $how"
}

log "seed $SEED (SEED=$SEED to replay), $ROUNDS rounds, $LAYOUT"
log "starting a control plane and $TARGETS targets on grain pools in $E2E_DIR"
start_control_plane || { bad "control plane starts"; summary; exit 1; }
for ((i = 0; i < TARGETS; i++)); do start_thin_target "$i"; done
check "$TARGETS targets register and are online" wait_targets "$TARGETS"
case $LAYOUT in
raid10) LAYOUT_ARGS=(--layout raid10 --stripe-width 2 --stripe-size 4K --copies 2) ;;
raid1) LAYOUT_ARGS=(--layout raid1 --copies 2) ;;
*) bad "ORDER_LAYOUT=$LAYOUT: raid10 or raid1" ;;
esac
[[ $fail -eq 0 ]] && volume_up && ok "a thin $LAYOUT volume of $VOLUME_MIB MiB, attached, two writers"
[[ $fail -eq 0 ]] || { summary; exit 1; }

start=$SECONDS
for ((r = 1; r <= ROUNDS; r++)); do
    sleep "0.$(printf '%03d' $((20 + RANDOM % 180)))"
    if [[ $((RANDOM % 100)) -lt $KILL_PCT ]]; then
        # The cluster is whole here: check what is queued before the kill.
        check_pending
        kill_round "$r"
    else
        snap "s$r"
        outcome "s$r" $?
        if [[ $((RANDOM % 100)) -lt $DOUBLE_PCT ]]; then
            snap "d$r"
            outcome "d$r" $?
        fi
    fi
    rounds_done=$r
    [[ ${#PENDING[@]} -ge $BATCH ]] && check_pending
    if [[ $((r % 25)) -eq 0 ]]; then
        log "round $r: $ready ready ($checked checked), $given_up given up, $refused refused," \
            "$kills targets killed"
    fi
done
check_pending
elapsed=$((SECONDS - start))
volume_down
check "every ready snapshot was checked ($checked of $ready)" test "$checked" -eq "$ready"
check "most rounds took a snapshot ($ready ready)" test "$ready" -gt $((ROUNDS / 2))
check "nothing is left: no volume" test "$(nvpool volume ls -o json | jq length)" -eq 0

log "summary: seed $SEED, $rounds_done rounds of $LAYOUT in ${elapsed} s: $ready snapshots" \
    "ready, $checked checked ($records records in them, $violations not a prefix), $given_up" \
    "given up, $refused refused (copies under way); $kills targets SIGKILLed, copies differing" \
    "after $diverged kills, volume replaced $replaced times; $written records written"
summary
