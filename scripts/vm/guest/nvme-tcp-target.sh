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
# shellcheck source=lib/nvpool-target.sh
. /nvpool/lib/nvpool-target.sh

NVME_ADDR=127.0.0.1
NVME_IO_PORT=4420
NVME_DISC_PORT=8009
NVME_NQN=nqn.2026-11.io.nvpool:test
NVME_NSID=1
NVME_HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555
NVME_BAD_HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:99999999-8888-7777-6666-555555555555

start_target
nvme_tcp_suite
stop_target
