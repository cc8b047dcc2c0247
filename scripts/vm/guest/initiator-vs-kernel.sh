#!/usr/bin/env bash
# Guest test: our userspace initiator against the Linux kernel's own target (nvmet,
# configured through configfs, backed by a 512 MiB brd RAM disk), over NVMe/TCP on
# loopback, or with --env NVME_TRANSPORT=rdma over NVMe/RDMA (nvmet-rdma on soft-RoCE,
# rxe on a dummy link inside the guest).
#
# Runs nvpool-initiator's `interop` example (connect, Identify, write/read patterns of
# 512 B..1 MiB at the first/middle/last LBAs, full-depth queues, Flush, Write Zeroes,
# Deallocate, reads past the end, an idle spell past the KATO) and, on TCP, again with
# digests on; checks the marker blocks it leaves on /dev/ram0 directly; on RDMA lists
# the discovery log with `nvpool discover -t rdma`; loads the target with `nvpool bench
# --verify`.  Then, under running I/O, it takes the subsystem off the port for 2 s (the
# initiator must reconnect, reissue and lose nothing) and finally for good (it must fail
# the I/O with "controller lost" in bounded time).  dmesg must show one kernel
# controller per connect, plus one for the reconnect: no silent reconnects.
# Both programs come from the command line:
#
#   scripts/vm/run-guest-test scripts/vm/guest/initiator-vs-kernel.sh \
#       --bin target/release/examples/interop --bin target/release/nvpool \
#       [--env NVME_TRANSPORT=rdma]
#
# vm-rdma: yes
# vm-modules: nvmet nvmet-tcp brd
# vm-modprobe-options: brd rd_nr=1 rd_size=524288
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. /nvpool/lib/common.sh
# shellcheck source-path=SCRIPTDIR source=lib/rdma.sh
. /nvpool/lib/rdma.sh

NVME_TRANSPORT=${NVME_TRANSPORT:-tcp}
if [[ $NVME_TRANSPORT == rdma ]]; then
    NVME_ADDR=$RDMA_ADDR
else
    NVME_ADDR=127.0.0.1
fi
NVME_IO_PORT=4420
NVME_NQN=nqn.2026-11.io.nvpool:kernel-nvmet-interop
NVME_NSID=1
NVME_HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555
BACKING=/dev/ram0
# Upper bound for one interop run (its own watchdog exits 1 after this long).
INTEROP_TIMEOUT_S=400
# After the subsystem leaves the port, the initiator must give up within its
# controller-loss timeout (5 s) plus slack; the guest waits this long.
LOSS_EXIT_S=60
# The transient outage, well inside the initiator's 5 s controller-loss timeout.
BLIP_OUTAGE_S=2
# Idle time of the first run: more than twice the 5 s KATO.
IDLE_S=12
BENCH_RUNTIME=5s
BENCH_SIZE=256m

nvmet=/sys/kernel/config/nvmet
port=$nvmet/ports/1

for prog in interop nvpool; do
    command -v "$prog" >/dev/null ||
        die "$prog missing: give run-guest-test --bin target/release/examples/interop" \
            "--bin target/release/nvpool"
done

link_subsystem() {
    ln -s "$nvmet/subsystems/$NVME_NQN" "$port/subsystems/$NVME_NQN"
}

# Unlinking the subsystem from its only port deletes its controllers there (their
# queue pairs disconnect) and disables the port (new connections are rejected).
unlink_subsystem() {
    rm "$port/subsystems/$NVME_NQN"
}

# expect_ctrls N: the kernel target created N controllers for our subsystem so far and
# never let a keep-alive timer expire.
expect_ctrls() {
    local n ka
    dmesg_since_start >/tmp/dmesg.now
    n=$(grep -c "nvmet: creating nvm controller [0-9]* for subsystem $NVME_NQN " \
        /tmp/dmesg.now || true)
    ka=$(grep -c 'keep-alive timer .* expired' /tmp/dmesg.now || true)
    [[ $ka -eq 0 ]] || die "the kernel target saw $ka keep-alive timeouts"
    [[ $n -eq $1 ]] ||
        die "the kernel target created $n controllers so far, expected $1 (a silent reconnect?)"
}

# port_listening: the kernel target accepts connections on the port (RDMA: dmesg
# says nvmet-rdma enabled it; there is no socket to probe).
port_listening() {
    if [[ $NVME_TRANSPORT == rdma ]]; then
        dmesg_since_start | grep -q "nvmet_rdma: enabling port 1 ($NVME_ADDR:$NVME_IO_PORT)"
    else
        tcp_port_open "$NVME_ADDR" "$NVME_IO_PORT"
    fi
}

setup_nvmet() {
    [[ -b $BACKING ]] || die "$BACKING missing: brd not loaded with rd_nr=1"
    if [[ $NVME_TRANSPORT == rdma ]]; then
        rdma_up
        modprobe nvmet_rdma
    fi
    local s=$nvmet/subsystems/$NVME_NQN
    mkdir "$s"
    echo 0 >"$s/attr_allow_any_host"
    mkdir "$nvmet/hosts/$NVME_HOSTNQN"
    ln -s "$nvmet/hosts/$NVME_HOSTNQN" "$s/allowed_hosts/$NVME_HOSTNQN"
    mkdir "$s/namespaces/$NVME_NSID"
    echo -n "$BACKING" >"$s/namespaces/$NVME_NSID/device_path"
    echo 1 >"$s/namespaces/$NVME_NSID/enable"
    mkdir "$port"
    echo "$NVME_TRANSPORT" >"$port/addr_trtype"
    echo ipv4 >"$port/addr_adrfam"
    echo "$NVME_ADDR" >"$port/addr_traddr"
    echo "$NVME_IO_PORT" >"$port/addr_trsvcid"
    link_subsystem
    wait_until 10 "nvmet-$NVME_TRANSPORT listening on $NVME_ADDR:$NVME_IO_PORT" port_listening
    step_ok "nvmet-$NVME_TRANSPORT-setup"
}

nvmet_state() {
    echo "--- nvmet configfs ---"
    ls -l "$port/subsystems" 2>&1 || true
    ls "$nvmet/subsystems/$NVME_NQN/allowed_hosts" 2>&1 || true
    [[ $NVME_TRANSPORT != rdma ]] || rdma link show 2>&1 || true
}
DIAG_HOOKS+=(nvmet_state)

interop_cmd=(interop --transport "$NVME_TRANSPORT" --addr "$NVME_ADDR:$NVME_IO_PORT" --nqn "$NVME_NQN"
    --hostnqn "$NVME_HOSTNQN" --nsid "$NVME_NSID" --timeout "$INTEROP_TIMEOUT_S")

# show_output FILE: the program's own STEP/FAIL lines, indented.
show_output() {
    sed 's/^/  /' "$1"
}

# check_marks FILE: every "MARK OFFSET TEXT" line names a block the initiator wrote
# through the kernel target; read it from the backing device itself.
check_marks() {
    local file=$1 off text got n=0
    sync
    # nvmet writes bios to brd directly; drop any stale page cache of /dev/ram0.
    echo 3 >/proc/sys/vm/drop_caches
    grep '^MARK ' "$file" >/tmp/marks || die "no MARK lines in $file"
    while read -r _ off text; do
        dd if="$BACKING" of=/tmp/mark.bin bs=512 skip=$((off / 512)) count=1 2>/dev/null
        got=$(head -c "${#text}" /tmp/mark.bin)
        [[ $got == "$text" ]] ||
            die "backing device at byte $off holds '$got', the initiator wrote '$text' there"
        n=$((n + 1))
    done </tmp/marks
    printf '  %d marker blocks found on %s\n' "$n" "$BACKING"
}

# run_interop NAME CTRLS [interop options...]: one full run, its steps shown as they
# are; CTRLS is the kernel's controller count expected afterwards.
run_interop() {
    local name=$1 ctrls=$2 rc=0
    shift 2
    "${interop_cmd[@]}" "$@" >"/tmp/interop.$name" 2>&1 || rc=$?
    show_output "/tmp/interop.$name"
    [[ $rc -eq 0 ]] || die "interop $name exited $rc"
    grep -q '^STEP shutdown ok' "/tmp/interop.$name" || die "interop $name: no shutdown step"
    grep -q "^STEP connect ok .* transport $NVME_TRANSPORT " "/tmp/interop.$name" ||
        die "interop $name did not run over $NVME_TRANSPORT"
    check_marks "/tmp/interop.$name"
    expect_ctrls "$ctrls"
    step_ok "interop-$name"
}

# discover: the kernel's discovery controller over RDMA lists our subsystem on this port.
discover() {
    quiet discover nvpool discover -t rdma -a "$RDMA_ADDR" -q "$NVME_HOSTNQN"
    show_output /tmp/out.discover
    grep -Eq "nvme subsystem +$NVME_NQN +rdma +$RDMA_ADDR +$NVME_IO_PORT" /tmp/out.discover ||
        die "discovery log over RDMA lacks $NVME_NQN at rdma $RDMA_ADDR:$NVME_IO_PORT"
    quiet discover-json nvpool discover -t rdma -a "$RDMA_ADDR" -s "$NVME_IO_PORT" \
        -q "$NVME_HOSTNQN" -o json
    grep -q '"trtype": "rdma"' /tmp/out.discover-json || die "JSON discovery log lacks trtype rdma"
    step_ok discover-rdma
}

# bench NAME RW CTRLS: nvpool bench --verify at QD16 on two queues.
bench() {
    local name=$1 rw=$2 ctrls=$3
    quiet "bench-$name" nvpool bench -t "$NVME_TRANSPORT" -a "$NVME_ADDR" -s "$NVME_IO_PORT" \
        -n "$NVME_NQN" -q "$NVME_HOSTNQN" --nsid "$NVME_NSID" --rw "$rw" --bs 4k \
        --iodepth 16 --jobs 2 --runtime "$BENCH_RUNTIME" --size "$BENCH_SIZE" --verify
    show_output "/tmp/out.bench-$name"
    expect_ctrls "$ctrls"
    step_ok "bench-$name"
}

interop_pid=
# The loss run's output, whatever state it is in.
loss_state() {
    [[ -n $interop_pid ]] || return 0
    echo "--- interop --expect-loss output ---"
    show_output /tmp/interop.loss
}
DIAG_HOOKS+=(loss_state)

interop_running() {
    [[ -e /proc/$interop_pid ]] && ! grep -q '^State:.*Z' "/proc/$interop_pid/status" 2>/dev/null
}

# interop_says LINE: the loss run printed LINE, or exited.
interop_says() {
    grep -qx "$1" /tmp/interop.loss || ! interop_running
}

interop_exited() {
    ! interop_running
}

# run_loss CTRLS: the kernel target leaves under running I/O, first for BLIP_OUTAGE_S,
# then for good.
run_loss() {
    local ctrls=$1 rc=0 t0
    "${interop_cmd[@]}" --expect-blip --expect-loss >/tmp/interop.loss 2>&1 &
    interop_pid=$!
    wait_until "$INTEROP_TIMEOUT_S" "READY-FOR-BLIP from interop" interop_says READY-FOR-BLIP
    interop_running || die "interop exited before READY-FOR-BLIP"
    # Let it run I/O for a moment first.
    sleep 1
    unlink_subsystem
    sleep "$BLIP_OUTAGE_S"
    link_subsystem
    wait_until "$INTEROP_TIMEOUT_S" "READY-FOR-REMOVAL from interop" interop_says READY-FOR-REMOVAL
    interop_running || die "interop exited before READY-FOR-REMOVAL"
    sleep 1
    unlink_subsystem
    t0=$(date +%s)
    wait_until "$LOSS_EXIT_S" "interop to give up after the removal" interop_exited
    wait "$interop_pid" || rc=$?
    show_output /tmp/interop.loss
    interop_pid=
    [[ $rc -eq 0 ]] || die "interop --expect-loss exited $rc"
    grep -q '^STEP loss ok' /tmp/interop.loss || die "interop --expect-loss: no loss step"
    grep -q '^STEP blip ok' /tmp/interop.loss || die "interop --expect-blip: no blip step"
    printf '  interop exited %ss after the removal\n' "$(($(date +%s) - t0))"
    expect_ctrls "$ctrls"
    step_ok interop-blip-loss
}

setup_nvmet
run_interop plain 1 --idle "$IDLE_S"
if [[ $NVME_TRANSPORT == rdma ]]; then
    # No digests on NVMe/RDMA; its discovery shares the I/O port.
    discover
    ctrls=1
else
    run_interop digests 2 --digests
    ctrls=2
fi
bench randwrite randwrite $((ctrls + 1))
bench randread randread $((ctrls + 2))
# One controller at the start, one more for the reconnect after the blip.
run_loss $((ctrls + 4))
