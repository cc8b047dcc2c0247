# shellcheck shell=bash
# Soft-RoCE inside the guest (sourced after common.sh by "# vm-rdma: yes" tests).
#
# rxe cannot carry RDMA over lo (127.0.0.1 resolves to a netdev without an RDMA device),
# so the address lives on a dummy link that only this guest has; rxe loops packets to
# its own MAC back internally, so both ends of a connection can sit in this one guest.

# The guest's RDMA address (TEST-NET-1: never routed anywhere).
RDMA_ADDR=${RDMA_ADDR:-192.0.2.10}
RDMA_DEV=rxe0
RDMA_NETDEV=rxedummy0

# Bring up $RDMA_DEV on a dummy link holding $RDMA_ADDR and wait until its port is ACTIVE.
rdma_up() {
    modprobe -a dummy rdma_rxe ib_uverbs rdma_ucm
    /usr/sbin/ip link add "$RDMA_NETDEV" type dummy
    /usr/sbin/ip addr add "$RDMA_ADDR/24" dev "$RDMA_NETDEV"
    # MTU 4200: RoCE MTU 4096 (rxe subtracts its headers from the link MTU).
    /usr/sbin/ip link set "$RDMA_NETDEV" mtu 4200 up
    rdma link add "$RDMA_DEV" type rxe netdev "$RDMA_NETDEV"
    local i
    for ((i = 0; i < 50; i++)); do
        if rdma link show | grep -q "$RDMA_DEV.*ACTIVE"; then
            [[ -e /dev/infiniband/rdma_cm ]] || die "no /dev/infiniband/rdma_cm"
            return 0
        fi
        sleep 0.2
    done
    rdma link show || true
    die "$RDMA_DEV did not become ACTIVE"
}
