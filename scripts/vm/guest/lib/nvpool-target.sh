# shellcheck shell=bash
# nvpool-target in the guest for the kernel-host suites (lib/nvme-tcp.sh): one file-backed
# namespace in subsystem NVME_NQN for NVME_HOSTNQN, listening on NVME_ADDR over
# NVME_TRANSPORT (tcp: I/O and discovery ports; rdma: one port for both), admin API on
# 127.0.0.1:4480.  start_target / stop_target; the log is in TARGET_LOG.

target_listeners() {
    if [[ $NVME_TRANSPORT == rdma ]]; then
        printf '[[listeners]]\naddr = "%s:%s"\ntransport = "rdma"\n' "$NVME_ADDR" "$NVME_IO_PORT"
    else
        printf '[[listeners]]\naddr = "%s:%s"\n\n[[listeners]]\naddr = "%s:%s"\n' \
            "$NVME_ADDR" "$NVME_IO_PORT" "$NVME_ADDR" "$NVME_DISC_PORT"
    fi
}

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
    if [[ $NVME_TRANSPORT == rdma ]]; then
        # No socket to probe: the RDMA CM listener says when it is up.
        tcp_port_open 127.0.0.1 4480 && grep -q "listening for NVMe/RDMA" "$TARGET_LOG"
    else
        tcp_port_open "$NVME_ADDR" "$NVME_IO_PORT"
    fi
}

start_target() {
    command -v "$TARGET_BIN" >/dev/null ||
        die "$TARGET_BIN not in the guest: pass --bin path/to/nvpool-target"
    truncate -s 1G "$BACKING"
    mkdir -p "$TARGET_STATE_DIR"
    cat >"$TARGET_CONFIG" <<EOF
state_dir = "$TARGET_STATE_DIR"
admin_listen = "127.0.0.1:4480"

$(target_listeners)

[[subsystems]]
nqn = "$NVME_NQN"
allowed_hosts = ["$NVME_HOSTNQN"]

[[subsystems.namespaces]]
nsid = $NVME_NSID
backend = "file:$BACKING"
EOF
    NO_COLOR=1 "$TARGET_BIN" --config "$TARGET_CONFIG" 2>"$TARGET_LOG" >&2 &
    target_pid=$!
    wait_until "$TARGET_START_S" "nvpool-target to accept on $NVME_TRANSPORT port $NVME_IO_PORT" \
        target_ready
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

