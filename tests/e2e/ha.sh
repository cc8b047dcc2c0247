#!/usr/bin/env bash
# End to end on this host, as root: three etcd members, three control planes
# sharing them, two targets, and a RAID1 volume attached through FUSE + loop
# under fio with verify=crc32c, in a loop, while
#   1. a target is killed and restarted, and while its copy is being
#      resynced (throttled) etcd loses its quorum for 10 s: the API answers
#      503 with a clear message, the volume keeps serving I/O; etcd back:
#      the API answers again and one control plane leads, with no restart,
#      and the resync resumes and completes;
#   2. the leading control plane is SIGKILLed: another leads within seconds
#      (the CLI and the targets are given all three and fail over).
# Every fio pass verifies with no error; the volume then detaches and deletes.
#
# Usage: tests/e2e/ha.sh [BIN_DIR]   (default target/release)
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=$(cd "${1:-target/release}" && pwd)
source tests/e2e/lib.sh
CP0=$NVPOOL_ENDPOINT
# The CLI and the targets know all three control planes and fail over.
export NVPOOL_ENDPOINT=$CP0,http://127.0.0.1:$((CP_PORT + 1)),http://127.0.0.1:$((CP_PORT + 2))

need_host jq curl fio etcd

ETCD_CLIENT_BASE=14450
ETCD_PEER_BASE=14460
declare -a ETCD_PIDS=()
ETCD_CLUSTER=m0=http://127.0.0.1:$ETCD_PEER_BASE
ETCD_CLUSTER+=,m1=http://127.0.0.1:$((ETCD_PEER_BASE + 1))
ETCD_CLUSTER+=,m2=http://127.0.0.1:$((ETCD_PEER_BASE + 2))

# start_etcd I NEW|EXISTING: member mI on its client and peer ports.
start_etcd() {
    local i=$1 state=$2
    local c=$((ETCD_CLIENT_BASE + i)) p=$((ETCD_PEER_BASE + i))
    etcd --name "m$i" --data-dir "$E2E_DIR/etcd$i" \
        --listen-client-urls "http://127.0.0.1:$c" --advertise-client-urls "http://127.0.0.1:$c" \
        --listen-peer-urls "http://127.0.0.1:$p" --initial-advertise-peer-urls "http://127.0.0.1:$p" \
        --initial-cluster "$ETCD_CLUSTER" --initial-cluster-state "$state" \
        --initial-cluster-token nvpool-e2e-ha >>"$E2E_DIR/etcd$i.log" 2>&1 &
    ETCD_PIDS[i]=$!
}
etcd_healthy() { curl -sf "http://127.0.0.1:$((ETCD_CLIENT_BASE + $1))/health" | grep -q '"true"'; }

# leader: the index of the control plane whose /healthz says it leads.
leader() {
    local n
    for n in 0 1 2; do
        curl -sf "http://127.0.0.1:$((CP_PORT + n))/healthz" 2>/dev/null |
            jq -e .leader >/dev/null 2>&1 && { echo "$n"; return 0; }
    done
    return 1
}
one_leader() { [[ $(for n in 0 1 2; do curl -sf "http://127.0.0.1:$((CP_PORT + n))/healthz" 2>/dev/null | jq -r .leader; done | grep -c true) -eq 1 ]]; }

ha_cleanup() {
    touch "$E2E_DIR/fio.stop"
    [[ -n ${FIO_LOOP:-} ]] && wait "$FIO_LOOP" 2>/dev/null
    # The control planes need etcd to detach what is left: etcd stops last,
    # and stop_all's wait must not wait for it.
    local etcd_pids=("${ETCD_PIDS[@]}")
    disown "${etcd_pids[@]}" 2>/dev/null
    cleanup
    kill "${etcd_pids[@]}" 2>/dev/null
}
trap ha_cleanup EXIT

log "starting 3 etcd members, 3 control planes and 2 targets in $E2E_DIR"
for i in 0 1 2; do start_etcd "$i" new; done
check "etcd members are healthy" wait_for 30 etcd_healthy 0
CP_STORE=etcd://127.0.0.1:$ETCD_CLIENT_BASE,127.0.0.1:$((ETCD_CLIENT_BASE + 1)),127.0.0.1:$((ETCD_CLIENT_BASE + 2))/nvpool-e2e
CP_LOG=info
# Throttled, so that the resync below is still copying when etcd loses
# its quorum.
CP_ARGS=(--rebuild-rate 8M)
for n in 0 1 2; do
    start_control_plane "$n" || { bad "control plane $n starts"; summary; exit 1; }
done
for i in 0 1; do start_target "$i" 4G; done
check "2 targets register and are online" wait_targets 2
check "one control plane leads" wait_for 30 one_leader

log "RAID1 under fio with verify, in a loop"
if ! nvpool volume create ha --size 512M --layout raid1 --copies 2 >/dev/null; then
    bad "create"
    summary
    exit 1
fi
dev=$(nvpool volume attach ha --frontend fuse --host-nqn "$HOSTNQN")
check "attached as a block device ($dev)" test -b "$dev"
(
    pass_n=0
    while [[ ! -f $E2E_DIR/fio.stop ]]; do
        if ! fio --name=ha --filename="$dev" --direct=1 --ioengine=libaio --iodepth=8 \
            --rw=randwrite --bs=16k --size=64M --verify=crc32c --verify_fatal=1 \
            --do_verify=1 --verify_state_save=0 --output="$E2E_DIR/fio.out" >/dev/null; then
            echo "failed after $pass_n passes" >"$E2E_DIR/fio.status"
            exit 1
        fi
        pass_n=$((pass_n + 1))
        echo "$pass_n passes" >"$E2E_DIR/fio.status"
    done
) &
FIO_LOOP=$!
sleep 3

# has_stale NAME: the host gave some copy up. copying NAME: a copy job is
# copying.
has_stale() { nvpool volume info "$1" -o json | jq -e '(.failed_extents | length) > 0' >/dev/null; }
copying() { nvpool volume info "$1" -o json | jq -e 'any(.copy_jobs[]; .state == "copying")' >/dev/null; }

log "target t1 SIGKILLed and restarted: its copy is resynced"
kill -9 "${TARGET_PIDS[1]}"
check "the host gives up the copies on t1" wait_for 30 has_stale ha
sleep 2
start_target 1 4G
check "a resync is copying" wait_for 60 copying ha

log "etcd loses its quorum (members 1 and 2 SIGKILLed) in the middle of the resync"
kill -9 "${ETCD_PIDS[1]}" "${ETCD_PIDS[2]}"
code=$(curl -s -o "$E2E_DIR/quorum.json" -w '%{http_code}' "$CP0/v1/volumes")
check "without quorum the API answers 503 (got $code)" test "$code" = 503
check "... with a JSON error naming etcd" \
    bash -c "jq -e '.kind == \"unavailable\" and (.message | test(\"etcd\"))' '$E2E_DIR/quorum.json'"
check "... and the CLI says so and fails" \
    bash -c "! '$BIN/nvpool' volume ls 2>'$E2E_DIR/cli.err' && grep -qi unavailable '$E2E_DIR/cli.err'"
sleep 10
check "fio keeps running while etcd has no quorum" kill -0 "$FIO_LOOP"

log "etcd members back"
start_etcd 1 existing
start_etcd 2 existing
etcd_back() { etcd_healthy 1 && etcd_healthy 2; }
check "etcd is healthy again" wait_for 60 etcd_back
check "the API answers again without a restart" wait_for 60 nvpool volume info ha
check "one control plane leads again" wait_for 30 one_leader
check "the resync resumes and completes: every copy in sync" wait_for 180 in_sync ha

old=$(leader)
log "SIGKILL the leading control plane (cp$old)"
kill -9 "${CP_PIDS[old]}"
new_leader() {
    local n
    n=$(leader) && [[ $n != "$old" ]]
}
check "another control plane leads within seconds" wait_for 30 new_leader
start_control_plane "$old" || bad "cp$old restarts"
check "one leader after the restart" wait_for 30 one_leader
sleep 3

touch "$E2E_DIR/fio.stop"
if wait "$FIO_LOOP"; then
    ok "every fio pass verified with no error ($(cat "$E2E_DIR/fio.status"))"
else
    bad "fio: $(cat "$E2E_DIR/fio.status" 2>/dev/null)"
    cat "$E2E_DIR/fio.out"
fi
check "the volume is online with every copy in sync" in_sync ha
check "detach" nvpool volume detach ha --host-nqn "$HOSTNQN"
check "delete" nvpool volume delete ha

summary
