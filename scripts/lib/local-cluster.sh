# shellcheck shell=bash
# One bring-up of a local nvpool cluster on 127.0.0.1: the daemons' command lines
# and the checks that they are up. Sourced by tests/e2e/lib.sh, scripts/demo and
# the VM guests' lib/cluster.sh (scripts/vm/lib.sh ships it to /nvpool/lib/). Each
# caller keeps its own layout (directories, ports, target names, labels, logs) and
# its own way of running a process (in the background, or in a session of its own),
# and passes them in.
#
# It needs nothing a VM guest lacks (bash and awk: no curl, no jq). The binaries are
# $NVPOOL_BIN_DIR/NAME when NVPOOL_BIN_DIR is set, else NAME on PATH; `nvpool` is the
# caller's (a function or on PATH), and NVPOOL_ENDPOINT names control plane 0.

# The command line of the last *_argv call, for the caller to run as it likes:
# "${CLUSTER_ARGV[@]}" >>LOG 2>&1 & (so that $! is the daemon itself).
declare -a CLUSTER_ARGV=()

# nvpool_bin NAME: the path of binary NAME.
nvpool_bin() {
    printf '%s\n' "${NVPOOL_BIN_DIR:+$NVPOOL_BIN_DIR/}$1"
}

# control_plane_argv PORT LOG_FILTER [ARGS...]: nvpool-control serving its REST API on
# 127.0.0.1:PORT, logging at LOG_FILTER; ARGS name its store and anything else.
control_plane_argv() {
    local port=$1 filter=$2
    shift 2
    CLUSTER_ARGV=("$(nvpool_bin nvpool-control)" --listen "127.0.0.1:$port" --log "$filter" "$@")
}

# target_argv ID PORT ADMIN_PORT STATE_DIR DEVICE [ARGS...]: nvpool-target ID (also its
# name) with NVMe/TCP on 127.0.0.1:PORT and its admin API on 127.0.0.1:ADMIN_PORT, its
# state (identity, exports, admin token) in STATE_DIR, offering DEVICE (NAME=SPEC) to
# the control plane at NVPOOL_ENDPOINT; ARGS (labels, more listeners, --log...) follow.
# The binary is TARGET_BIN when that is set (an older build, for upgrades).
target_argv() {
    local id=$1 port=$2 admin_port=$3 state=$4 device=$5
    shift 5
    CLUSTER_ARGV=("${TARGET_BIN:-$(nvpool_bin nvpool-target)}" --state-dir "$state"
        --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$admin_port"
        --control-plane "$NVPOOL_ENDPOINT" --target-id "$id" --name "$id"
        --device "$device" "$@")
}

# wait_for SECONDS CMD...: true once CMD succeeds (tried 5 times a second), false
# when it still fails after SECONDS.
wait_for() {
    local secs=$1 i
    shift
    for ((i = 0; i < secs * 5; i++)); do
        "$@" && return 0
        sleep 0.2
    done
    return 1
}

# control_plane_healthy PORT: GET /healthz on 127.0.0.1:PORT answers 200.
control_plane_healthy() {
    (
        exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
        printf 'GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' >&3
        IFS=' ' read -r -t 5 _ status _ <&3 && [[ $status == 200 ]]
    ) 2>/dev/null
}

# target_health: "ID HEALTH" per registered target, from `nvpool target ls` (the
# HEALTH column found by its header: an RDMA column appears when a target has an
# RDMA address); nothing while the control plane does not answer.
target_health() {
    { nvpool target ls 2>/dev/null || true; } | awk 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == "HEALTH") h = i; next }
        h { print $1, $h }'
}

# online_targets: how many targets the control plane sees online.
online_targets() {
    target_health | awk '$2 == "online"' | wc -l
}

# targets_online N: N targets at least are online.
targets_online() {
    [[ $(online_targets) -ge $1 ]]
}
