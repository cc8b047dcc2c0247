#!/usr/bin/env bash
# Guest benchmark: what one I/O costs nvpool-target over NVMe/TCP and over NVMe/RDMA,
# side by side in one boot.  One nvpool-target serves a RAM namespace on both transports
# (TCP on 127.0.0.1:4420, RDMA on the rxe address); the kernel host connects over each
# in turn and fio runs the same jobs.  Per job and transport it prints the I/Os done
# (from the block device's stat), the target's CPU time (utime + stime from
# /proc/PID/stat) and its system calls (strace -c on the target for the job), each per
# I/O.  TCG makes the absolute figures meaningless; the RDMA/TCP ratios are the point.
#
# Run through scripts/bench-transport (scripts/bench transport).
#
# vm-rdma: yes
# vm-modules: nvme-tcp
# vm-bins: nvme fio strace
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. /nvpool/lib/common.sh
# shellcheck source=lib/rdma.sh
. /nvpool/lib/rdma.sh
# shellcheck source=lib/nvme-tcp.sh
. /nvpool/lib/nvme-tcp.sh

RUNTIME=${BENCH_RUNTIME:-15}
NQN=nqn.2026-11.io.nvpool:bench
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555
TARGET_LOG=/tmp/nvpool-target.log
CLK_TCK=$(getconf CLK_TCK 2>/dev/null || echo 100)

target_log_tail() {
    tail -n 30 "$TARGET_LOG"
}
DIAG_HOOKS+=(target_log_tail)

rdma_up
cat >/tmp/target.toml <<EOF2
admin_listen = "127.0.0.1:4480"
[[listeners]]
addr = "127.0.0.1:4420"
[[listeners]]
addr = "$RDMA_ADDR:4420"
transport = "rdma"
[[subsystems]]
nqn = "$NQN"
allow_any_host = true
[[subsystems.namespaces]]
nsid = 1
backend = "ram:1G"
EOF2
NO_COLOR=1 nvpool-target --config /tmp/target.toml --reactors 1 2>"$TARGET_LOG" &
target_pid=$!
wait_until 30 "nvpool-target to listen" grep -q "listening for NVMe/RDMA" "$TARGET_LOG"
step_ok target-start

# Target CPU ticks so far.
target_ticks() {
    awk '{print $14 + $15}' "/proc/$target_pid/stat"
}

# Completed reads + writes of block device $1.
dev_ios() {
    awk '{print $1 + $5}' "/sys/block/${1#/dev/}/stat"
}

NVME_NQN=$NQN
NVME_NSID=1
NVME_HOSTNQN=$HOSTNQN
# One line per (transport, job): "RESULT transport job ios cpu_us_per_io syscalls_per_io".
measure() {
    local transport=$1 job=$2
    shift 2
    local before_ios before_ticks ios ticks sys
    before_ios=$(dev_ios "$DEV")
    before_ticks=$(target_ticks)
    fio --name="$job" --filename="$DEV" --ioengine=libaio --direct=1 --bs=4k --iodepth=32 \
        --time_based --runtime="$RUNTIME" --size=1G "$@" >"/tmp/fio-$transport-$job" 2>&1 ||
        die "fio $job over $transport failed: $(tail -n 5 "/tmp/fio-$transport-$job")"
    ios=$(($(dev_ios "$DEV") - before_ios))
    ticks=$(($(target_ticks) - before_ticks))
    # The system calls of a shorter run of the same job, under strace (slow under
    # strace, so counted separately and divided by that run's own I/Os).
    before_ios=$(dev_ios "$DEV")
    strace -c -f -q -p "$target_pid" -o "/tmp/strace-$transport-$job" &
    local st=$!
    sleep 1
    fio --name="$job-strace" --filename="$DEV" --ioengine=libaio --direct=1 --bs=4k \
        --iodepth=32 --time_based --runtime=5 --size=1G "$@" >/dev/null 2>&1 || true
    kill -INT "$st"
    wait "$st" || true
    local sios=$(($(dev_ios "$DEV") - before_ios))
    sys=$(awk '$NF == "total" {print $(NF-2)}' "/tmp/strace-$transport-$job")
    [[ $ios -gt 0 && $sios -gt 0 ]] || die "no I/O counted for $job over $transport"
    printf 'RESULT %s %s %d %s %s\n' "$transport" "$job" "$ios" \
        "$(awk -v t="$ticks" -v n="$ios" -v h="$CLK_TCK" 'BEGIN {printf "%.1f", t * 1e6 / h / n}')" \
        "$(awk -v s="${sys:-0}" -v n="$sios" 'BEGIN {printf "%.2f", s / n}')"
}

for transport in tcp rdma; do
    NVME_TRANSPORT=$transport
    if [[ $transport == tcp ]]; then NVME_ADDR=127.0.0.1; else NVME_ADDR=$RDMA_ADDR; fi
    NVME_IO_PORT=4420
    connect "bench-$transport" -i 1
    # Fill once so reads return data.
    quiet "fill-$transport" fio --name=fill --filename="$DEV" --ioengine=libaio --direct=1 \
        --bs=128k --iodepth=8 --rw=write --size=256M
    measure "$transport" randread --rw=randread --size=256M
    measure "$transport" randwrite --rw=randwrite --size=256M
    disconnect
    step_ok "bench-$transport"
done
kill -TERM "$target_pid"
wait "$target_pid" || true
