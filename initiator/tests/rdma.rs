//! NVMe/RDMA pieces that need no RDMA hardware: choosing the transport and
//! failing clearly where RDMA is missing. The data path runs against the
//! kernel's nvmet-rdma in the VM (scripts/vm/guest/initiator-vs-kernel-rdma.sh).

use nvpool_initiator::{ConnectParams, Controller, Error, Transport};
use std::time::Duration;

#[test]
fn tcp_stays_the_default_transport() {
    let p = ConnectParams::new("127.0.0.1:4420".parse().unwrap(), "nqn.2026-11.io.nvpool:x");
    assert_eq!(p.transport, Transport::Tcp);
    assert_eq!(Transport::Tcp.discovery_port(), 8009);
    assert_eq!(Transport::Rdma.discovery_port(), 4420);
}

/// Without RDMA here the error says why (`nvpool_rdma::available`), is not
/// worth reconnecting for, and nothing panics. With RDMA, loopback has no
/// RDMA device: a connect error.
#[test]
fn rdma_where_there_is_none_is_a_clear_error() {
    let mut p = ConnectParams::new("127.0.0.1:4420".parse().unwrap(), "nqn.2026-11.io.nvpool:x");
    p.transport = Transport::Rdma;
    p.connect_timeout = Duration::from_secs(2);
    p.ctrl_loss_timeout = Duration::ZERO;
    let e = Controller::connect(p).expect_err("no RDMA target on loopback");
    match nvpool_rdma::available() {
        Err(why) => {
            assert!(
                matches!(&e, Error::RdmaUnavailable(w) if *w == why),
                "{e:?}"
            );
            assert!(!e.is_transport(), "{e:?}");
            assert!(e.to_string().starts_with("RDMA unavailable: "), "{e}");
        }
        Ok(()) => assert!(e.is_transport(), "{e:?}"),
    }
}
