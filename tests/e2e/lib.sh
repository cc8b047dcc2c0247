# Shared by the end-to-end tests: a local cluster of real processes on
# 127.0.0.1 (one nvpool-control, N nvpool-target daemons on sparse files)
# driven through the nvpool CLI. Source it; set BIN first (the directory of
# the release binaries). The daemons' command lines and the checks that they
# are up are scripts/lib/local-cluster.sh's, shared with scripts/demo and the
# VM guests.

# shellcheck source=../../scripts/lib/local-cluster.sh
source "$(dirname "${BASH_SOURCE[0]}")/../../scripts/lib/local-cluster.sh"
NVPOOL_BIN_DIR=$BIN

E2E_DIR=${E2E_DIR:-$(mktemp -d /var/tmp/nvpool-e2e.XXXXXX)}
# Ports below the kernel's ephemeral range (32768 and up by default): a
# target started late in a run must not find its port taken as the local
# end of some client connection.
CP_PORT=${CP_PORT:-14430}
TARGET_PORT_BASE=${TARGET_PORT_BASE:-14420}
ADMIN_PORT_BASE=${ADMIN_PORT_BASE:-14480}
export NVPOOL_ENDPOINT=http://127.0.0.1:$CP_PORT
export NVPOOL_RUN_DIR=$E2E_DIR/run
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:6e76706f-6f6c-4e00-8000-653265000001
declare -a TARGET_PIDS=()
CP_PID=

pass=0
fail=0

# skip REASON: this test cannot run here (not root, a tool missing). A skip
# on a developer's machine; a failure under CI=true, where
# scripts/setup-deps test has installed everything it needs.
skip() {
    local name
    name=$(basename "$0" .sh)
    if [[ ${CI:-} == true ]]; then
        echo "FAIL e2e $name: $* (CI=true: scripts/setup-deps test installs what it needs)"
        exit 1
    fi
    echo "SKIP e2e $name: $*"
    exit 0
}
# need_host TOOL...: root, /dev/fuse, the loop module and every TOOL, or
# skip (a failure under CI=true).
need_host() {
    [[ $(id -u) -eq 0 ]] || skip "needs root (FUSE mount, loop devices)"
    [[ -c /dev/fuse ]] || skip "no /dev/fuse"
    [[ -e /dev/loop-control ]] || skip "no /dev/loop-control (loop module)"
    local t
    for t in "$@"; do
        command -v "$t" >/dev/null || skip "$t is not installed (scripts/setup-deps test)"
    done
}
log() { printf '%s %s\n' "$(date +%T)" "$*"; }
ok() { pass=$((pass + 1)); printf 'PASS %s\n' "$*"; }
bad() { fail=$((fail + 1)); printf 'FAIL %s\n' "$*"; }
check() { # check NAME COMMAND...: PASS when the command succeeds
    local name=$1
    shift
    if "$@"; then ok "$name"; else bad "$name"; fi
}

nvpool() { "$BIN/nvpool" "$@"; }

# in_sync NAME: the volume is online, no copy stale, no copy job running.
in_sync() {
    nvpool volume info "$1" -o json |
        jq -e '.status == "online" and (.failed_extents | length) == 0 and (.copy_jobs | length) == 0' \
            >/dev/null
}

# start_control_plane [I]: control plane I (default 0) on port CP_PORT + I,
# on its own state directory, or on the store CP_STORE names when set (which
# several share: etcd://...); the array CP_ARGS, when set, is appended
# (e.g. CP_ARGS=(--rebuild-rate 0)). Control plane 0 is $NVPOOL_ENDPOINT.
declare -a CP_PIDS=()
start_control_plane() {
    local n=${1:-0}
    local dir=$E2E_DIR/cp log=$E2E_DIR/cp.log
    if [[ $n -ne 0 ]]; then
        dir=$E2E_DIR/cp$n log=$E2E_DIR/cp$n.log
    fi
    mkdir -p "$dir"
    local store=(--state-dir "$dir")
    [[ -n ${CP_STORE:-} ]] && store=(--store "$CP_STORE")
    control_plane_argv "$((CP_PORT + n))" "${CP_LOG:-warn}" "${store[@]}" \
        --extent-size "${EXTENT_BYTES:-268435456}" ${CP_ARGS[@]+"${CP_ARGS[@]}"}
    "${CLUSTER_ARGV[@]}" >>"$log" 2>&1 &
    CP_PIDS[n]=$!
    [[ $n -eq 0 ]] && CP_PID=$!
    wait_for 10 control_plane_healthy "$((CP_PORT + n))" && return 0
    cat "$log" >&2
    return 1
}

# start_target I SIZE: target tI with one sparse file device of SIZE (the
# binary is $TARGET_BIN when set, for upgrades; the array TARGET_ARGS, when
# set, is appended to its command line).
start_target() {
    local i=$1 size=$2
    local d=$E2E_DIR/t$i
    mkdir -p "$d/state"
    [[ -f $d/d0.img ]] || truncate -s "$size" "$d/d0.img"
    target_argv "t$i" "$((TARGET_PORT_BASE + i))" "$((ADMIN_PORT_BASE + i))" "$d/state" \
        "d0=file:$d/d0.img" --label "rack=r$i" --reactors 1 --log warn \
        ${TARGET_ARGS[@]+"${TARGET_ARGS[@]}"}
    "${CLUSTER_ARGV[@]}" >>"$d/target.log" 2>&1 &
    TARGET_PIDS[i]=$!
}

# start_thin_target I [SIZE]: target tI offering a blank sparse file of SIZE
# (default 1G) as a grain pool (formatted at its first start; kept across
# restarts).
start_thin_target() {
    local i=$1 d=$E2E_DIR/t$1
    mkdir -p "$d/state"
    [[ -f $d/pool.img ]] || truncate -s "${2:-1G}" "$d/pool.img"
    target_argv "t$i" "$((TARGET_PORT_BASE + i))" "$((ADMIN_PORT_BASE + i))" "$d/state" \
        "d0=thin:$d/pool.img" --label "rack=r$i" --reactors 1 --log warn
    "${CLUSTER_ARGV[@]}" >>"$d/target.log" 2>&1 &
    TARGET_PIDS[i]=$!
}

# target_admin I PATH [CURL_ARGS...]: a request to target tI's admin API with the
# bearer token its state directory holds (admin-token, written by the target at its
# first start). The token reaches curl on stdin, never on a command line.
target_admin() {
    local i=$1 path=$2 token
    shift 2
    token=$(head -n 1 "$E2E_DIR/t$i/state/admin-token" 2>/dev/null) && [[ -n $token ]] || return 1
    printf 'header = "Authorization: Bearer %s"\n' "$token" |
        curl -sf -K - "$@" "http://127.0.0.1:$((ADMIN_PORT_BASE + i))$path"
}

# wait_targets N: until N targets are registered and online.
wait_targets() {
    wait_for 30 targets_online "$1" && return 0
    nvpool target ls >&2 || true
    return 1
}

stop_all() {
    local r
    # Detach whatever is still attached (unmounting first).
    for r in "$NVPOOL_RUN_DIR"/volumes/*.json; do
        [[ -f $r ]] || continue
        local dev uuid
        dev=$(jq -r .device "$r")
        uuid=$(jq -r .uuid "$r")
        grep -q "^$dev " /proc/mounts && umount "$dev" 2>/dev/null
        nvpool volume detach "$uuid" --host-nqn "$HOSTNQN" --force >/dev/null 2>&1 || true
    done
    # The agent last: SIGTERM, it flushes and tears down what is left.
    local p
    p=$(cat "$NVPOOL_RUN_DIR/agent.pid" 2>/dev/null || true)
    if [[ -n $p ]] && kill "$p" 2>/dev/null; then
        wait_for 60 bash -c "! kill -0 $p 2>/dev/null"
    fi
    for p in "${TARGET_PIDS[@]}" $CP_PID "${CP_PIDS[@]}"; do
        [[ -n $p ]] && kill "$p" 2>/dev/null
    done
    wait 2>/dev/null || true
}

cleanup() {
    stop_all
    if [[ $fail -ne 0 || -n ${E2E_KEEP:-} ]]; then
        echo "logs kept in $E2E_DIR" >&2
        tail -n 20 "$E2E_DIR"/cp*.log "$E2E_DIR"/t*/target.log "$NVPOOL_RUN_DIR"/agent.log \
            2>/dev/null >&2 || true
        # The sparse device files are large on disk after the test.
        rm -f "$E2E_DIR"/t*/d0.img "$E2E_DIR"/t*/pool.img
    else
        rm -rf "$E2E_DIR"
    fi
}

summary() {
    echo "e2e: $pass passed, $fail failed"
    [[ $fail -eq 0 ]]
}

# CPU accounting for the benchmarks that bring a cluster up with this file
# (scripts/bench-epoch, scripts/bench-device), in clock ticks: the whole
# machine's busy time (/proc/stat) and that of given processes (utime +
# stime; a process gone counts 0).
busy_ticks() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 + $9 }' /proc/stat; }
proc_ticks() {
    local p sum=0
    for p in "$@"; do
        sum=$((sum + $(awk '{ print $14 + $15 }' "/proc/$p/stat" 2>/dev/null || echo 0)))
    done
    echo "$sum"
}
TICK_US=$((1000000 / $(getconf CLK_TCK)))
# The median of the numbers on stdin (separated by spaces or newlines).
median() { tr ' ' '\n' | grep . | sort -g | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }
