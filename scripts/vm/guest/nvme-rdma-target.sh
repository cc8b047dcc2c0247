#!/usr/bin/env bash
# Guest test: nvpool-target serving one file-backed namespace over NVMe/RDMA on soft-RoCE
# (rxe on a dummy link inside the guest), driven by the Linux nvme-rdma host through the
# suite nvme-tcp-target.sh runs over TCP: discovery (trtype rdma), xfs with files
# checksummed across a remount and xfs_repair -n, ext4 and fio crc32c verification at
# iodepth 32, two I/O queues (-i 2), a refused host NQN, keep-alive over an idle spell.
#
#   scripts/vm/run-guest-test scripts/vm/guest/nvme-rdma-target.sh \
#       --bin target/release/nvpool-target
#
# vm-rdma: yes
# vm-modules: xfs ext4
# vm-bins: nvme fio mkfs.xfs xfs_repair mkfs.ext4 e2fsck
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. /nvpool/lib/common.sh
# shellcheck source=lib/rdma.sh
. /nvpool/lib/rdma.sh
# shellcheck source=lib/nvme-tcp.sh
. /nvpool/lib/nvme-tcp.sh
# shellcheck source=lib/nvpool-target.sh
. /nvpool/lib/nvpool-target.sh

rdma_up
step_ok rxe-up

NVME_TRANSPORT=rdma
NVME_ADDR=$RDMA_ADDR
# NVMe/RDMA serves discovery and I/O on one port.
NVME_IO_PORT=4420
NVME_DISC_PORT=4420
NVME_NQN=nqn.2026-11.io.nvpool:test
NVME_NSID=1
NVME_HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555
NVME_BAD_HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:99999999-8888-7777-6666-555555555555

start_target
nvme_tcp_suite
stop_target
