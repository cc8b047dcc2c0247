# shellcheck shell=bash
# Guest-side helpers for VM test scripts (sourced from /nvpool/lib/common.sh).
#
# Output contract: one line "STEP <name> ok (<seconds>s)" per passed step; on failure one
# "FAIL: <why>" line followed by diagnostics (hooks, then the dmesg tail), exit 1.
# The serial console is slow (~240 KB/s): commands run through `quiet` keep their output
# in /tmp/out.<name> and show it only when they fail.

set -Eeuo pipefail

# Functions run on failure to dump extra state (e.g. a daemon's log).
DIAG_HOOKS=()
DMESG_TAIL_LINES=40
OUTPUT_TAIL_LINES=30
step_t0=$(date +%s)
# Kernel messages up to here are boot noise; failures show only what came after.
dmesg_start=$(dmesg | wc -l)
# Kernel messages since this test started (a boot may run several scenarios).
dmesg_since_start() {
    dmesg | tail -n "+$((dmesg_start + 1))"
}

step_ok() {
    local now
    now=$(date +%s)
    printf 'STEP %s ok (%ss)\n' "$1" "$((now - step_t0))"
    step_t0=$now
}

die() {
    trap - ERR
    printf 'FAIL: %s\n' "$*"
    local hook
    for hook in "${DIAG_HOOKS[@]}"; do
        "$hook" || true
    done
    printf -- '--- dmesg since the test started (last %d lines) ---\n' "$DMESG_TAIL_LINES"
    dmesg | tail -n "+$((dmesg_start + 1))" | tail -n "$DMESG_TAIL_LINES" || true
    exit 1
}

on_err() {
    local rc=$1 line=$2 cmd=$3
    die "command failed (rc=$rc) at line $line: $cmd"
}
trap 'on_err $? "${BASH_SOURCE[0]##*/}:$LINENO" "$BASH_COMMAND"' ERR

# quiet NAME CMD...: run CMD with its output kept in /tmp/out.NAME; on failure show the
# tail of that output and die.
quiet() {
    local name=$1 rc=0
    shift
    "$@" >"/tmp/out.$name" 2>&1 || rc=$?
    if [[ $rc -ne 0 ]]; then
        printf -- '--- output of %s (last %d lines) ---\n' "$*" "$OUTPUT_TAIL_LINES"
        tail -n "$OUTPUT_TAIL_LINES" "/tmp/out.$name"
        die "$name: '$*' exited $rc"
    fi
}

# wait_until SECONDS WHAT CMD...: poll CMD every 0.2 s until it succeeds.
wait_until() {
    local secs=$1 what=$2 i
    shift 2
    for ((i = 0; i < secs * 5; i++)); do
        "$@" && return 0
        sleep 0.2
    done
    die "timed out after ${secs}s waiting for $what"
}

# tcp_port_open HOST PORT: true once something accepts connections there.
# exited PID: the process is gone or a zombie (kill -0 succeeds on a zombie, so look at
# the process state instead).
exited() {
    local state
    state=$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null) || return 0
    [[ $state == Z ]]
}

tcp_port_open() {
    (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

# write_random_files DIR COUNT MIB: COUNT files of MIB MiB each, checksums in DIR.sums.
write_random_files() {
    local dir=$1 count=$2 mib=$3 i
    for ((i = 0; i < count; i++)); do
        dd if=/dev/urandom of="$dir/file$i" bs=1M count="$mib" 2>/dev/null
    done
    (cd "$dir" && sha256sum file*) >"/tmp/sums.${dir//\//_}"
}

verify_random_files() {
    local dir=$1
    quiet verify-files sh -c "cd '$dir' && sha256sum -c '/tmp/sums.${dir//\//_}'"
}

# fio_verify NAME FIO-ARGS...: a write+verify fio job; prints fio's bandwidth lines.
fio_verify() {
    local name=$1
    shift
    quiet "fio-$name" fio --name="$name" --ioengine=libaio --direct=1 --bs=4k \
        --iodepth=32 --verify=crc32c --verify_fatal=1 --do_verify=1 "$@"
    printf '  fio %s:%s\n' "$name" "$(sed -nE 's/^ +(READ|WRITE): bw=([^ ]+) .*/ \1 \2/p' \
        "/tmp/out.fio-$name" | tr -d '\n')"
}
