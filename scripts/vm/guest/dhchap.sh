#!/usr/bin/env bash
# Guest test: NVMe in-band authentication (DH-HMAC-CHAP) against the Linux kernel, both
# ways, over NVMe/TCP on loopback, in one boot.
#
# 1. The kernel's NVMe/TCP host against nvpool-target, whose config holds two hosts' keys:
#    host 1 unidirectional (SHA-256, null group, a secret with SHA-256 key transform),
#    host 2 bidirectional (ffdhe2048, the target's default hash, a host secret without
#    key transform).  Right secret: connects, a pattern written with dd reads back and
#    dmesg says "authenticated"; the secret rotated on the live controller (the target's
#    admin API, then the host's sysfs dhchap_secret): the host re-authenticates its queues
#    and I/O goes on; wrong host secret: refused; a wrong controller secret on
#    the host side: the host refuses the controller; both secrets right: connects, and
#    reads what host 1 wrote.
# 2. nvpool's initiator (`nvpool bench --verify`, secrets from files) against the kernel's
#    nvmet with that host's dhchap_key/dhchap_ctrl_key (hmac(sha256), ffdhe2048, then
#    hmac(sha512), null): right secrets work; a wrong host or controller secret fails.
#
#   scripts/vm/run-guest-test scripts/vm/guest/dhchap.sh \
#       --bin target/release/nvpool-target --bin target/release/nvpool
#
# Without host or target authentication support in the guest it skips, but fails when
# CI=true (pass --env CI=true).
#
# vm-modules: nvme-tcp nvmet nvmet-tcp brd
# vm-modprobe-options: brd rd_nr=1 rd_size=262144
# vm-bins: nvme timeout cmp
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. /nvpool/lib/common.sh
# shellcheck source=lib/nvme-tcp.sh
. /nvpool/lib/nvme-tcp.sh
# shellcheck source=lib/nvpool-target.sh
. /nvpool/lib/nvpool-target.sh

NVME_TRANSPORT=tcp
NVME_ADDR=127.0.0.1
NVME_IO_PORT=4420
NVME_NQN=nqn.2026-11.io.nvpool:dhchap
NVME_NSID=1
HOST1=nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555
HOST2=nqn.2014-08.org.nvmexpress:uuid:22222222-3333-4444-5555-666666666666
HOST3=nqn.2014-08.org.nvmexpress:uuid:33333333-4444-5555-6666-777777777777
NVMET_NQN=nqn.2026-11.io.nvpool:dhchap-nvmet
NVMET_PORT=4421
NVMET_BACKING=/dev/ram0
# A failing connect or bench must give up well within this.
REFUSE_S=120
BENCH_RUNTIME=3s
BENCH_SIZE=64m

# Test secrets: 32 bytes each (SHA-256 of "nvpool-vm-dhchap-<name>"), base64 of key and
# its little-endian CRC-32.  Type 01 (SHA-256 key transform) but for KEY_HOST2 (00).
KEY_HOST='DHHC-1:01:sMlN5PonVmfHa4LwXYGptAOzLwPQR8EzPSE+Qww75OE1PzHG:'
KEY_HOST_WRONG='DHHC-1:01:3MafP8j3qkLBWHKrYyAbA0nkxRZtUqMYaAHRhAKhcCqYS0dS:'
KEY_CTRL='DHHC-1:01:lUCO51mjGVtOkK2fAIlXuA9HS05zAVkBRqZn9YfaRUcm4WXQ:'
KEY_CTRL_WRONG='DHHC-1:01:nq6FQxWijl0fTlwkyPPiQ4nQ/SkqEmPzOfZAmvhSMXx2zjxe:'
KEY_HOST2='DHHC-1:00:f3/AlTdhrPJ99upJEv+RbBTXq3Ur0knNdH73B2xtV5LFrA3P:'
# Host 1's secret after rotation (SHA-256 of "nvpool-vm-dhchap-host-new").
KEY_HOST_NEW='DHHC-1:01:UYI96Y4bZiRNhNbWmkmEZWRXYPhaVQnAQxV0pIJs3+70UNKV:'

nvmet=/sys/kernel/config/nvmet

# unsupported WHY: the guest cannot run this test; a skip, or a failure under CI.
unsupported() {
    [[ ${CI:-} != true ]] || die "cannot run (CI=true): $*"
    printf 'SKIP: %s\n' "$*"
    exit 0
}

for prog in nvpool-target nvpool; do
    command -v "$prog" >/dev/null ||
        die "$prog missing: give run-guest-test --bin target/release/nvpool-target" \
            "--bin target/release/nvpool"
done
[[ $(id -u) -eq 0 ]] || unsupported "not root"
# Not a pipe into grep -q: nvme exits non-zero after --help, and pipefail is on.
connect_help=$(nvme connect --help 2>&1 || true)
[[ $connect_help == *--dhchap-secret* ]] ||
    unsupported "nvme-cli $(nvme version | head -n1) has no --dhchap-secret"
[[ -d /sys/module/nvme_auth ]] || modprobe nvme-auth 2>/dev/null ||
    unsupported "no nvme-auth module (kernel without CONFIG_NVME_HOST_AUTH)"

# Kernel messages since mark_dmesg.
mark_dmesg() {
    dmesg_mark=$(dmesg | wc -l)
}
new_dmesg() {
    dmesg | tail -n "+$((dmesg_mark + 1))"
}

# expect_dmesg WHAT ERE: a kernel line since mark_dmesg matches; print it.
expect_dmesg() {
    local lines
    lines=$(new_dmesg | grep -E "$2" || true)
    [[ -n $lines ]] || die "$1: no kernel message matching '$2' since the connect"
    printf '%s\n' "$lines" | head -n 3 | sed 's/^/  dmesg: /'
}

# connect_as NAME HOSTNQN [nvme connect options...]: lib/nvme-tcp.sh's connect as HOSTNQN.
connect_as() {
    local name=$1
    NVME_HOSTNQN=$2
    shift 2
    mark_dmesg
    connect "$name" "$@"
}

# refused NAME HOSTNQN [nvme connect options...]: nvme connect must fail, leaving no
# controller behind.
refused() {
    local name=$1 host=$2 rc=0
    shift 2
    mark_dmesg
    host_opts "$host"
    timeout "$REFUSE_S" nvme connect -t tcp -a "$NVME_ADDR" -s "$NVME_IO_PORT" -n "$NVME_NQN" \
        "${HOST_OPTS[@]}" "$@" >"/tmp/out.$name" 2>&1 || rc=$?
    if [[ $rc -eq 0 ]]; then
        cat "/tmp/out.$name"
        die "$name: nvme connect succeeded; it must be refused"
    fi
    wait_until "$DEVICE_SETTLE_S" "$name: no controller of $NVME_NQN" nvme_no_ctrl
    printf '  %s: nvme connect exited %d: %s\n' "$name" "$rc" "$(head -n1 "/tmp/out.$name")"
    new_dmesg | grep -iE 'auth|fail' | head -n 3 | sed 's/^/  dmesg: /' || true
}

# write_pattern OFFSET_MIB: 1 MiB of random data at OFFSET_MIB of DEV, read back.
write_pattern() {
    dd if=/dev/urandom of="/tmp/pattern.$1" bs=1M count=1 2>/dev/null
    quiet "dd-write-$1" dd if="/tmp/pattern.$1" of="$DEV" bs=1M seek="$1" count=1 oflag=direct
    check_pattern "$1"
}

check_pattern() {
    quiet "dd-read-$1" dd if="$DEV" of="/tmp/readback.$1" bs=1M skip="$1" count=1 iflag=direct
    cmp -s "/tmp/pattern.$1" "/tmp/readback.$1" ||
        die "the 1 MiB at ${1} MiB of $DEV differs from the pattern written there"
}

# admin_put PATH JSON: PUT on the target's admin API with its token (bash's /dev/tcp: the
# guest has no HTTP client); fails unless the answer is 200.
admin_put() {
    local token status
    token=$(cat "$TARGET_STATE_DIR/admin-token")
    exec 3<>/dev/tcp/127.0.0.1/4480 || die "admin API: cannot connect"
    printf 'PUT %s HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n' "$1" "$token" >&3
    printf 'Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s' \
        "${#2}" "$2" >&3
    read -r _ status _ <&3
    exec 3<&-
    [[ $status == 200 ]] || die "admin API: PUT $1 answered ${status:-nothing}"
}

# reauthenticated: the host logged a new successful exchange on the admin queue.
reauthenticated() {
    new_dmesg | grep -qE 'qid 0: authenticated'
}

start_auth_target() {
    truncate -s 256M "$BACKING"
    mkdir -p "$TARGET_STATE_DIR"
    cat >"$TARGET_CONFIG" <<EOF
state_dir = "$TARGET_STATE_DIR"
admin_listen = "127.0.0.1:4480"

[[listeners]]
addr = "$NVME_ADDR:$NVME_IO_PORT"

[[subsystems]]
nqn = "$NVME_NQN"
allowed_hosts = ["$HOST1", "$HOST2"]

[subsystems.host_keys."$HOST1"]
dhchap_key = "$KEY_HOST"
dhchap_hash = "sha256"
dhchap_dhgroup = "null"

[subsystems.host_keys."$HOST2"]
dhchap_key = "$KEY_HOST2"
dhchap_ctrl_key = "$KEY_CTRL"
dhchap_dhgroup = "ffdhe2048"

[[subsystems.namespaces]]
nsid = $NVME_NSID
backend = "file:$BACKING"
EOF
    chmod 0600 "$TARGET_CONFIG"
    NO_COLOR=1 nvpool-target --config "$TARGET_CONFIG" 2>"$TARGET_LOG" >&2 &
    target_pid=$!
    wait_until "$TARGET_START_S" "nvpool-target on $NVME_ADDR:$NVME_IO_PORT" target_ready
    step_ok target-start
}

# ---- 1. the kernel host against nvpool-target ------------------------------------------

kernel_host_vs_target() {
    start_auth_target

    connect_as host-sha256-null "$HOST1" --dhchap-secret="$KEY_HOST"
    expect_dmesg host-sha256-null 'qid 0: authenticated with hash [^ ]*sha256[^ ]* dhgroup null'
    write_pattern 3
    write_pattern 200
    step_ok kernel-host-auth-sha256-null

    # Rotation on the live controller: the target first (its queues keep running), then
    # the host, which re-authenticates the admin queue and every I/O queue against the
    # target's new key.
    admin_put "/v1/subsystems/$NVME_NQN/hosts/$HOST1" \
        "{\"dhchap_key\": \"$KEY_HOST_NEW\", \"dhchap_hash\": \"sha256\", \"dhchap_dhgroup\": \"null\"}"
    mark_dmesg
    printf '%s\n' "$KEY_HOST_NEW" >"/sys/class/nvme/$CTRL/dhchap_secret"
    wait_until 60 "host re-authenticated with the rotated secret" reauthenticated
    expect_dmesg reauth 'qid 0: authenticated with hash [^ ]*sha256[^ ]* dhgroup null'
    ! new_dmesg | grep -iE 'auth.*(fail|error)' ||
        die "a queue failed to re-authenticate"
    ctrl_live
    check_pattern 3
    write_pattern 100
    disconnect
    step_ok kernel-host-reauth-after-rotation

    # A new connection needs the new secret; the old one is refused.
    refused old-host-secret "$HOST1" --dhchap-secret="$KEY_HOST"
    connect_as host-rotated "$HOST1" --dhchap-secret="$KEY_HOST_NEW"
    check_pattern 100
    disconnect
    step_ok kernel-host-rotated-secret

    refused wrong-host-secret "$HOST1" --dhchap-secret="$KEY_HOST_WRONG"
    step_ok kernel-host-wrong-secret-refused

    # No secret at all while the target holds keys for this host: refused too.
    refused no-host-secret "$HOST1"
    step_ok kernel-host-no-secret-refused

    if ! grep -qE '^name +: dh$' /proc/crypto; then
        unsupported "the guest kernel has no dh kpp algorithm, so no ffdhe groups"
    fi
    refused wrong-ctrl-secret "$HOST2" --dhchap-secret="$KEY_HOST2" \
        --dhchap-ctrl-secret="$KEY_CTRL_WRONG"
    step_ok kernel-host-wrong-ctrl-secret-refused

    connect_as host-bidi-ffdhe2048 "$HOST2" --dhchap-secret="$KEY_HOST2" \
        --dhchap-ctrl-secret="$KEY_CTRL"
    expect_dmesg host-bidi-ffdhe2048 'qid 0: authenticated with hash [^ ]+ dhgroup ffdhe2048'
    expect_dmesg host-bidi-ffdhe2048 'qid 0: controller authenticated'
    grep -q 'ffdhe2048(dh)' /proc/crypto || die "ffdhe2048(dh) not in /proc/crypto after its use"
    # What host 1 wrote is there; then a pattern of this host's own.
    check_pattern 3
    check_pattern 200
    write_pattern 100
    disconnect
    step_ok kernel-host-auth-bidi-ffdhe2048

    stop_target
}

# ---- 2. nvpool's initiator against the kernel's nvmet -----------------------------------

nvmet_state() {
    echo "--- nvmet host $HOST3 ---"
    local a
    for a in dhchap_hash dhchap_dhgroup; do
        printf '%s: %s\n' "$a" "$(cat "$nvmet/hosts/$HOST3/$a" 2>&1)"
    done
}

setup_nvmet() {
    [[ -b $NVMET_BACKING ]] || die "$NVMET_BACKING missing: brd not loaded with rd_nr=1"
    local s=$nvmet/subsystems/$NVMET_NQN h=$nvmet/hosts/$HOST3 p=$nvmet/ports/1
    mkdir "$h"
    [[ -e $h/dhchap_key ]] ||
        unsupported "nvmet has no hosts/*/dhchap_key (kernel without CONFIG_NVME_TARGET_AUTH)"
    DIAG_HOOKS+=(nvmet_state)
    echo "$KEY_HOST" >"$h/dhchap_key"
    echo "$KEY_CTRL" >"$h/dhchap_ctrl_key"
    echo 'hmac(sha256)' >"$h/dhchap_hash"
    echo ffdhe2048 >"$h/dhchap_dhgroup"
    mkdir "$s"
    # With allow_any_host nvmet would skip authentication altogether.
    echo 0 >"$s/attr_allow_any_host"
    ln -s "$h" "$s/allowed_hosts/$HOST3"
    mkdir "$s/namespaces/1"
    echo -n "$NVMET_BACKING" >"$s/namespaces/1/device_path"
    echo 1 >"$s/namespaces/1/enable"
    mkdir "$p"
    echo tcp >"$p/addr_trtype"
    echo ipv4 >"$p/addr_adrfam"
    echo "$NVME_ADDR" >"$p/addr_traddr"
    echo "$NVMET_PORT" >"$p/addr_trsvcid"
    ln -s "$s" "$p/subsystems/$NVMET_NQN"
    wait_until 10 "nvmet-tcp on $NVME_ADDR:$NVMET_PORT" tcp_port_open "$NVME_ADDR" "$NVMET_PORT"
    step_ok nvmet-auth-setup
}

# bench NAME [secret-file options...]: nvpool bench --verify against nvmet as HOST3;
# its exit status is returned, its output is in /tmp/out.bench-NAME.
bench() {
    local name=$1 rc=0
    shift
    mark_dmesg
    timeout "$REFUSE_S" nvpool bench -t tcp -a "$NVME_ADDR" -s "$NVMET_PORT" -n "$NVMET_NQN" \
        -q "$HOST3" --nsid 1 --rw randwrite --bs 4k --iodepth 8 --jobs 1 \
        --runtime "$BENCH_RUNTIME" --size "$BENCH_SIZE" --verify "$@" \
        >"/tmp/out.bench-$name" 2>&1 || rc=$?
    return "$rc"
}

bench_ok() {
    local name=$1
    bench "$@" || {
        tail -n "$OUTPUT_TAIL_LINES" "/tmp/out.bench-$name"
        die "bench $name failed"
    }
    grep -E 'verify|IOPS|iops' "/tmp/out.bench-$name" | head -n 3 | sed 's/^/  /' || true
}

bench_refused() {
    local name=$1 rc=0
    bench "$@" || rc=$?
    if [[ $rc -eq 0 ]]; then
        tail -n "$OUTPUT_TAIL_LINES" "/tmp/out.bench-$name"
        die "bench $name succeeded; it must fail authentication"
    fi
    [[ $rc -ne 124 ]] || die "bench $name hung for ${REFUSE_S}s instead of failing"
    printf '  %s: nvpool bench exited %d: %s\n' "$name" "$rc" \
        "$(grep -iE 'auth|error' "/tmp/out.bench-$name" | head -n1)"
}

initiator_vs_nvmet() {
    setup_nvmet
    local keys=/tmp/keys
    mkdir -p -m 0700 "$keys"
    printf '%s\n' "$KEY_HOST" >"$keys/host"
    printf '%s\n' "$KEY_HOST_WRONG" >"$keys/host-wrong"
    printf '%s\n' "$KEY_CTRL" >"$keys/ctrl"
    printf '%s\n' "$KEY_CTRL_WRONG" >"$keys/ctrl-wrong"
    chmod 0600 "$keys"/*

    bench_ok bidi-sha256-ffdhe2048 --dhchap-secret-file "$keys/host" \
        --dhchap-ctrl-secret-file "$keys/ctrl"
    step_ok initiator-auth-bidi-sha256-ffdhe2048
    bench_refused wrong-host --dhchap-secret-file "$keys/host-wrong"
    step_ok initiator-wrong-secret-refused
    bench_refused wrong-ctrl --dhchap-secret-file "$keys/host" \
        --dhchap-ctrl-secret-file "$keys/ctrl-wrong"
    step_ok initiator-wrong-ctrl-secret-refused
    bench_refused no-secret
    step_ok initiator-no-secret-refused

    # Another hash and the null group: nvmet applies them at the next authentication.
    echo 'hmac(sha512)' >"$nvmet/hosts/$HOST3/dhchap_hash"
    echo null >"$nvmet/hosts/$HOST3/dhchap_dhgroup"
    bench_ok uni-sha512-null --dhchap-secret-file "$keys/host"
    step_ok initiator-auth-sha512-null
}

kernel_host_vs_target
initiator_vs_nvmet
