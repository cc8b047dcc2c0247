#!/usr/bin/env bash
# Guest test: the NVMe/TCP suite against the Linux kernel's own target (nvmet-tcp,
# configured through configfs), backed by a 1 GiB RAM disk (brd).  Not a tmpfs file:
# nvmet's file backend turns Write Zeroes into fallocate(ZERO_RANGE), which tmpfs
# refuses, and the host then logs an I/O error per ext4 lazy-init write.  It checks the VM
# harness and the suite itself; later it serves as the reference target for our
# userspace initiator.
#
# vm-modules: nvme-tcp nvmet-tcp xfs ext4 brd
# vm-modprobe-options: brd rd_nr=1 rd_size=1048576
# vm-bins: nvme fio mkfs.xfs xfs_repair mkfs.ext4 e2fsck
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. /nvpool/lib/common.sh
# shellcheck source=lib/nvme-tcp.sh
. /nvpool/lib/nvme-tcp.sh

NVME_ADDR=127.0.0.1
NVME_IO_PORT=4420
NVME_DISC_PORT=8009
NVME_NQN=nqn.2026-11.io.nvpool:kernel-nvmet
NVME_NSID=1
NVME_HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555
NVME_BAD_HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:99999999-8888-7777-6666-555555555555
BACKING=/dev/ram0

nvmet=/sys/kernel/config/nvmet

# set_port ID PORT: a TCP port on loopback that exposes our subsystem.  nvmet's
# discovery log on a port lists only the subsystems linked to that port.
set_port() {
    local p=$nvmet/ports/$1
    mkdir "$p"
    echo tcp >"$p/addr_trtype"
    echo ipv4 >"$p/addr_adrfam"
    echo "$NVME_ADDR" >"$p/addr_traddr"
    echo "$2" >"$p/addr_trsvcid"
    ln -s "$nvmet/subsystems/$NVME_NQN" "$p/subsystems/$NVME_NQN"
}

setup_nvmet() {
    [[ -b $BACKING ]] || die "$BACKING missing: brd not loaded with rd_nr=1"
    local s=$nvmet/subsystems/$NVME_NQN
    mkdir "$s"
    echo 0 >"$s/attr_allow_any_host"
    mkdir "$nvmet/hosts/$NVME_HOSTNQN"
    ln -s "$nvmet/hosts/$NVME_HOSTNQN" "$s/allowed_hosts/$NVME_HOSTNQN"
    mkdir "$s/namespaces/$NVME_NSID"
    echo -n "$BACKING" >"$s/namespaces/$NVME_NSID/device_path"
    echo 1 >"$s/namespaces/$NVME_NSID/enable"
    set_port 1 "$NVME_IO_PORT"
    set_port 2 "$NVME_DISC_PORT"
    step_ok nvmet-setup
}

setup_nvmet
nvme_tcp_suite
