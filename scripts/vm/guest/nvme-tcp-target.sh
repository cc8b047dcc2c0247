#!/usr/bin/env bash
# Guest test: our target daemon, nvpool-target, serving one file-backed namespace on
# loopback, driven by the Linux NVMe/TCP host driver through the same suite that
# kernel-nvmet-smoke.sh runs against the kernel's target.
#
#   scripts/vm/run-guest-test scripts/vm/guest/nvme-tcp-target.sh \
#       --bin target/release/nvpool-target
#
# vm-modules: nvme-tcp xfs ext4
# vm-bins: nvme fio mkfs.xfs xfs_repair mkfs.ext4 e2fsck
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. /nvpool/lib/common.sh
# shellcheck source=lib/nvme-tcp.sh
. /nvpool/lib/nvme-tcp.sh

NVME_ADDR=127.0.0.1
NVME_IO_PORT=4420
NVME_DISC_PORT=8009
NVME_NQN=nqn.2026-11.io.nvpool:test
NVME_NSID=1
NVME_HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555
NVME_BAD_HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:99999999-8888-7777-6666-555555555555

TARGET_BIN=${NVPOOL_TARGET_BIN:-nvpool-target}
TARGET_CONFIG=/tmp/nvpool-target.toml
TARGET_LOG=/tmp/nvpool-target.log
TARGET_STATE_DIR=/tmp/nvpool-state
BACKING=/tmp/ns1.img
# Start-up includes the io_uring probe and binding three sockets; generous under TCG.
TARGET_START_S=30
# SIGTERM to exit, with every host already disconnected.
TARGET_STOP_S=15
TARGET_LOG_TAIL_LINES=40
# Warnings and errors shown even when every step passed.
TARGET_LOG_WARN_LINES=10

# The log is a file, but a logger may still colour it.
strip_ansi() {
    # busybox sed knows no \x escapes; bash supplies the ESC byte.
    sed "s/"$'\e'"\\[[0-9;]*m//g"
}

target_log_tail() {
    printf -- '--- nvpool-target log (last %d lines) ---\n' "$TARGET_LOG_TAIL_LINES"
    tail -n "$TARGET_LOG_TAIL_LINES" "$TARGET_LOG" | strip_ansi
}
DIAG_HOOKS+=(target_log_tail)

# The target is gone (or a zombie waiting to be reaped).
target_exited() {
    exited "$target_pid"
}

# Reap the exited target into target_rc (not in a subshell: only the parent can wait).
reap_target() {
    target_rc=0
    wait "$target_pid" || target_rc=$?
}

target_ready() {
    if target_exited; then
        reap_target
        die "nvpool-target exited during start-up with status $target_rc"
    fi
    tcp_port_open "$NVME_ADDR" "$NVME_IO_PORT"
}

start_target() {
    command -v "$TARGET_BIN" >/dev/null ||
        die "$TARGET_BIN not in the guest: pass --bin path/to/nvpool-target"
    truncate -s 1G "$BACKING"
    mkdir -p "$TARGET_STATE_DIR"
    cat >"$TARGET_CONFIG" <<EOF
state_dir = "$TARGET_STATE_DIR"
admin_listen = "127.0.0.1:4480"

[[listeners]]
addr = "$NVME_ADDR:$NVME_IO_PORT"

[[listeners]]
addr = "$NVME_ADDR:$NVME_DISC_PORT"

[[subsystems]]
nqn = "$NVME_NQN"
allowed_hosts = ["$NVME_HOSTNQN"]

[[subsystems.namespaces]]
nsid = $NVME_NSID
backend = "file:$BACKING"
EOF
    NO_COLOR=1 "$TARGET_BIN" --config "$TARGET_CONFIG" 2>"$TARGET_LOG" >&2 &
    target_pid=$!
    wait_until "$TARGET_START_S" "nvpool-target to accept on port $NVME_IO_PORT" target_ready
    step_ok target-start
}

stop_target() {
    if target_exited; then
        reap_target
        die "nvpool-target died during the test with status $target_rc"
    fi
    kill -TERM "$target_pid"
    wait_until "$TARGET_STOP_S" "nvpool-target to exit after SIGTERM" target_exited
    reap_target
    [[ $target_rc -eq 0 ]] || die "nvpool-target exited with status $target_rc after SIGTERM"
    printf '  nvpool-target log: %d lines, %d mention warn or error\n' \
        "$(wc -l <"$TARGET_LOG")" "$(grep -ciE 'warn|error' "$TARGET_LOG" || true)"
    strip_ansi <"$TARGET_LOG" | grep -iE 'warn|error' | head -n "$TARGET_LOG_WARN_LINES" |
        cut -c1-200 | sed 's/^/  | /' || true
    step_ok target-stop
}

start_target
nvme_tcp_suite
stop_target
