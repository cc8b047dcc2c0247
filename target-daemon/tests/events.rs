//! Asynchronous events: a held Asynchronous Event Request completes when
//! the namespaces of the subsystem change (I/O controllers) or when the
//! discovery log changes (discovery controllers), as Identify OAES says.

mod common;

use common::*;
use nvpool_wire::log::{AEN_DISCOVERY_CHANGED, AEN_NS_CHANGED};
use nvpool_wire::{Status, DISCOVERY_NQN};
use std::time::Duration;

const AER_CID: u16 = 31;
const FID_ASYNC_EVENT_CONFIG: u8 = 0x0B;

#[test]
fn namespace_changes_complete_the_aer() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let mut a = admin_session(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let oaes = a.identify_controller().oaes;
    assert_ne!(
        oaes & 1 << 8,
        0,
        "OAES advertises namespace attribute notices"
    );
    a.set_features(FID_ASYNC_EVENT_CONFIG, 1 << 8).ok();
    send_aer(&mut a, AER_CID);
    assert!(
        a.quiet_for(Duration::from_millis(200)),
        "the AER completes only on an event"
    );

    let r = http(
        d.api,
        "PUT",
        &format!("/v1/subsystems/{SUBNQN}/namespaces/2"),
        Some(r#"{"backend": "ram:1M"}"#),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        expect_aer(&mut a, AER_CID, Duration::from_secs(2)),
        AEN_NS_CHANGED
    );
    // Changed Namespace List, read and cleared (RAE 0).
    let mut s = nvpool_wire::log::GetLogPage {
        lid: 0x04,
        rae: false,
        len: 4096,
        offset: 0,
    }
    .to_sqe(0, 0xFFFF_FFFF);
    s.set_cid(0);
    let log = a.exec(s);
    log.ok();
    assert_eq!(&log.data[..8], &[2, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(a.active_namespaces(0), vec![1, 2]);

    // The next change completes the next AER.
    send_aer(&mut a, AER_CID);
    d.target.remove_namespace(SUBNQN, 2).expect("remove");
    assert_eq!(
        expect_aer(&mut a, AER_CID, Duration::from_secs(2)),
        AEN_NS_CHANGED
    );
    assert_eq!(a.active_namespaces(0), vec![1]);
}

#[test]
fn aer_limit() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let mut a = admin_session(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let aerl = a.identify_controller().aerl as usize;
    for _ in 0..=aerl {
        send_aer(&mut a, AER_CID);
    }
    assert!(a.quiet_for(Duration::from_millis(100)));
    send_aer(&mut a, AER_CID);
    let q = a.recv_pdu().expect("answer to the extra AER").cqe();
    assert_eq!(
        (q.status.sct, q.status.sc),
        (
            Status::AER_LIMIT_EXCEEDED.sct,
            Status::AER_LIMIT_EXCEEDED.sc
        )
    );
    a.keep_alive().ok();
}

#[test]
fn discovery_log_changes_complete_the_aer() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[HOST_A], &[(1, RAM_SPEC)])]);
    let mut c = Conn::open_ic(d.addr, NO_DIGESTS);
    c.admin_connect(DISCOVERY_NQN, HOST_A, 0).ok();
    c.enable();
    let oaes = c.identify_controller().oaes;
    assert_ne!(
        oaes & 1 << 31,
        0,
        "OAES advertises discovery log change notices"
    );
    c.set_features(FID_ASYNC_EVENT_CONFIG, 1 << 31).ok();
    send_aer(&mut c, AER_CID);
    d.target
        .put_subsystem(&subsystem(OTHER_NQN, &[HOST_A], &[(1, RAM_SPEC)]))
        .expect("new subsystem");
    assert_eq!(
        expect_aer(&mut c, AER_CID, Duration::from_secs(2)),
        AEN_DISCOVERY_CHANGED
    );
}
