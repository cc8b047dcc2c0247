# shellcheck shell=bash
# A cluster on the guest's loopback for VM tests of pooled volumes (sourced after
# common.sh): one nvpool-control and TARGETS nvpool-target daemons, each offering one
# sparse file device d0 in rack rI, a pool over them, and helpers to read the control
# plane's view. The sourcing script sets WORK, CP_PORT, TARGETS, TARGET_PORT_BASE,
# ADMIN_PORT_BASE, DEVICE_SIZE, POOL, START_S, STOP_S, LOG_TAIL_LINES and HOSTNQN, and
# CP_ARGS (extra nvpool-control flags, may be empty) and ROW_TARGETS (extents per
# row of the volumes it creates); CLUSTER_RDMA_ADDR (optional) makes every target also
# listen for NVMe/RDMA on that address (lib/rdma.sh), on its TCP port number.
# CP_LOG and TARGET_LOG (optional, default warn) are the daemons' --log filters.
# The daemons' command lines and the target_health view are local-cluster.sh's, the
# one bring-up shared with scripts/demo and tests/e2e (scripts/vm/lib.sh ships it).

# shellcheck source=../../../lib/local-cluster.sh
source "$(dirname "${BASH_SOURCE[0]}")/local-cluster.sh"

export NVPOOL_ENDPOINT=http://127.0.0.1:$CP_PORT
export NVPOOL_RUN_DIR=$WORK/run
# attach and detach read this host's NQN from here (the guest has no /etc/nvme/hostnqn).
export NVPOOL_HOSTNQN_FILE=$WORK/hostnqn
for prog in nvpool nvpool-control nvpool-target; do
    command -v "$prog" >/dev/null ||
        die "$prog missing: give run-guest-test --bin target/release/nvpool" \
            "--bin target/release/nvpool-control --bin target/release/nvpool-target"
done

declare -a TARGET_PIDS=()
cp_pid=

cluster_state() {
    printf -- '--- nvpool target ls ---\n'
    nvpool target ls 2>&1 || true
    printf -- '--- nvpool volume ls ---\n'
    nvpool volume ls 2>&1 || true
    local f
    for f in "$WORK"/cp.log "$WORK"/t*.log "$NVPOOL_RUN_DIR"/volumes/*.log; do
        [[ -s $f ]] || continue
        printf -- '--- %s (last %d lines) ---\n' "$f" "$LOG_TAIL_LINES"
        tail -n "$LOG_TAIL_LINES" "$f"
    done
}
DIAG_HOOKS+=(cluster_state)

# stop_daemon PID WHAT: SIGTERM, and it must exit 0.
stop_daemon() {
    local rc=0
    kill -TERM "$1"
    wait_until "$STOP_S" "$2 to exit" exited "$1"
    wait "$1" || rc=$?
    [[ $rc -eq 0 ]] || die "$2 exited $rc after SIGTERM"
}

cp_up() {
    exited "$cp_pid" && die "nvpool-control exited during start-up"
    tcp_port_open 127.0.0.1 "$CP_PORT"
}

start_control_plane() {
    mkdir -p "$WORK/cp"
    control_plane_argv "$CP_PORT" "${CP_LOG:-warn}" --state-dir "$WORK/cp" "${CP_ARGS[@]}"
    "${CLUSTER_ARGV[@]}" >"$WORK/cp.log" 2>&1 &
    cp_pid=$!
    wait_until "$START_S" "nvpool-control on port $CP_PORT" cp_up
}

# start_target I: target tI in rack rI, offering one file device d0 to the pool. Its
# state directory keeps its identity, so a restart is the same target coming back.
start_target() {
    local i=$1
    mkdir -p "$WORK/t$i"
    [[ -f $WORK/t$i.img ]] || truncate -s "$DEVICE_SIZE" "$WORK/t$i.img"
    local rdma=()
    [[ -z ${CLUSTER_RDMA_ADDR:-} ]] ||
        rdma=(--listen "rdma:$CLUSTER_RDMA_ADDR:$((TARGET_PORT_BASE + i))")
    target_argv "t$i" "$((TARGET_PORT_BASE + i))" "$((ADMIN_PORT_BASE + i))" "$WORK/t$i" \
        "d0=file:$WORK/t$i.img" "${rdma[@]}" --label "rack=r$i" --reactors 1 \
        --log "${TARGET_LOG:-warn}"
    "${CLUSTER_ARGV[@]}" >>"$WORK/t$i.log" 2>&1 &
    TARGET_PIDS[i]=$!
}

all_targets_online() {
    [[ $(online_targets) -eq $TARGETS ]]
}

# target_is ID HEALTH: the control plane's view of a target (online, offline).
target_is() {
    [[ $(target_health | awk -v t="$1" '$1 == t { print $2 }') == "$2" ]]
}

cluster_up() {
    local i devices=()
    mkdir -p "$WORK"
    echo "$HOSTNQN" >"$NVPOOL_HOSTNQN_FILE"
    start_control_plane
    for ((i = 0; i < TARGETS; i++)); do
        start_target "$i"
        devices+=("t$i/d0")
    done
    wait_until "$START_S" "$TARGETS targets online" all_targets_online
    step_ok cluster-start
    quiet pool-create nvpool pool create "$POOL" --device "$(IFS=,; echo "${devices[*]}")"
    step_ok pool-create
}

# volume_field NAME FIELD: one "Field: value" line of `nvpool volume info`.
volume_field() {
    nvpool volume info "$1" | sed -n "s/^$2: *//p"
}

# extent_targets NAME: the target of each extent, in the volume's extent order (the
# rows of the extent table are the only lines starting with a number).
extent_targets() {
    nvpool volume info "$1" | awk '$1 ~ /^[0-9]+$/ { print $4 }'
}

# The DEVICE column of `nvpool volume ls` (the last: LAYOUT and SIZE contain spaces).
listed_device() {
    nvpool volume ls | awk -v n="$1" '$1 == n { print $NF }'
}

# create_volume NAME: a volume of VOLUME_SIZE and LAYOUT (LAYOUT_TEXT in `volume info`) on
# the pool, its extents on ROW_TARGETS targets at least (a row's extents on distinct ones).
create_volume() {
    local name=$1 targets distinct
    quiet "create-$name" nvpool volume create "$name" --size "$VOLUME_SIZE" "${LAYOUT[@]}" \
        --pool "$POOL"
    [[ $(volume_field "$name" Layout) == "$LAYOUT_TEXT" ]] ||
        die "$name: layout '$(volume_field "$name" Layout)', expected '$LAYOUT_TEXT'"
    [[ $(volume_field "$name" Status) == online ]] ||
        die "$name: status '$(volume_field "$name" Status)' right after create"
    targets=$(extent_targets "$name" | tr '\n' ' ')
    distinct=$(extent_targets "$name" | sort -u | wc -l)
    [[ $distinct -ge $ROW_TARGETS ]] ||
        die "$name: extents on '$targets', expected $ROW_TARGETS targets at least"
    printf '  %s: %s, %s, extents on %s\n' "$name" "$LAYOUT_TEXT" \
        "$(volume_field "$name" Size)" "$targets"
}

