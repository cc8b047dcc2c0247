//! Host access control: only allowed host NQNs connect, and changing the
//! list at run time (admin API or Target methods) takes effect at once,
//! disconnecting controllers of hosts that lost access.

mod common;

use common::*;
use nvpool_wire::Status;
use std::time::Duration;

/// Admin Connect as `host`; returns the completion.
fn try_connect(d: &Daemon, host: &str) -> (Conn, Completion) {
    let mut c = Conn::open_ic(d.addr, NO_DIGESTS);
    let r = c.admin_connect(SUBNQN, host, 0);
    (c, r)
}

#[track_caller]
fn refused(d: &Daemon, host: &str) {
    let (_c, r) = try_connect(d, host);
    r.expect_status(Status::CONNECT_INVALID_HOST);
    assert_eq!((r.status.sct, r.status.sc), (1, 0x84));
}

#[test]
fn only_allowed_hosts_connect() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[HOST_A], &[(1, RAM_SPEC)])]);
    refused(&d, HOST_B);
    let (a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    q.flush(1).ok();
    // An I/O queue Connect naming A's controller but B's NQN is refused too.
    let mut bq = Conn::open_ic(d.addr, NO_DIGESTS);
    let cntlid = a.cntlid;
    bq.io_connect(SUBNQN, HOST_B, cntlid, 2, 127)
        .expect_status(Status::CONNECT_INVALID_PARAMETERS);
}

#[test]
fn hosts_changed_through_the_admin_api() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[HOST_A], &[(1, RAM_SPEC)])]);
    refused(&d, HOST_B);
    let (mut a_admin, mut a_io) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);

    // Allow B.
    let r = http(
        d.api,
        "PUT",
        &format!("/v1/subsystems/{SUBNQN}/hosts/{HOST_B}"),
        None,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let hosts = r.json()["allowed_hosts"].clone();
    assert!(
        hosts.as_array().expect("hosts").iter().any(|h| h == HOST_B),
        "{hosts}"
    );
    let (mut b_admin, mut b_io) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_B);
    let data = pattern(1, 4096);
    b_io.write(1, 0, &data, 512, false).ok();

    // Revoke A: its live controller goes away, both connections close.
    let r = http(
        d.api,
        "DELETE",
        &format!("/v1/subsystems/{SUBNQN}/hosts/{HOST_A}"),
        None,
    );
    assert_eq!(r.status, 204, "{}", r.body);
    a_admin.expect_closed(Duration::from_secs(3));
    a_io.expect_closed(Duration::from_secs(3));
    refused(&d, HOST_A);
    // Revoking a host that is not on the list is a 404.
    let r = http(
        d.api,
        "DELETE",
        &format!("/v1/subsystems/{SUBNQN}/hosts/{HOST_A}"),
        None,
    );
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(r.json()["kind"], "not_found");

    // B is untouched.
    assert_eq!(b_io.read_ok(1, 0, 8, 512), data);
    b_admin.keep_alive().ok();

    // A back again.
    let r = http(
        d.api,
        "PUT",
        &format!("/v1/subsystems/{SUBNQN}/hosts/{HOST_A}"),
        None,
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    assert_eq!(q.read_ok(1, 0, 8, 512), data);
}

#[test]
fn hosts_changed_through_target_methods() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[HOST_A], &[(1, RAM_SPEC)])]);
    refused(&d, HOST_B);
    d.target.allow_host(SUBNQN, HOST_B).expect("allow B");
    let (_b, mut bq) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_B);
    bq.flush(1).ok();
    d.target.disallow_host(SUBNQN, HOST_B).expect("disallow B");
    bq.expect_closed(Duration::from_secs(3));
    refused(&d, HOST_B);

    // Opening the subsystem to any host, then closing it again.
    let mut cfg = subsystem(SUBNQN, &[HOST_A], &[(1, RAM_SPEC)]);
    cfg.allow_any_host = true;
    d.target.put_subsystem(&cfg).expect("allow any");
    let (mut b2, _) = try_connect(&d, HOST_B);
    b2.enable();
    cfg.allow_any_host = false;
    d.target.put_subsystem(&cfg).expect("A only");
    b2.expect_closed(Duration::from_secs(3));
    // A kept its access throughout.
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    q.flush(1).ok();
}

#[test]
fn removing_the_subsystem_disconnects_its_hosts() {
    let d = Daemon::start(&[
        subsystem(SUBNQN, &[], &[(1, RAM_SPEC)]),
        subsystem(OTHER_NQN, &[], &[(1, RAM_SPEC)]),
    ]);
    let (mut a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let (_oa, mut oq) = controller(d.addr, NO_DIGESTS, OTHER_NQN, HOST_A);
    let r = http(d.api, "DELETE", &format!("/v1/subsystems/{SUBNQN}"), None);
    assert_eq!(r.status, 204, "{}", r.body);
    a.expect_closed(Duration::from_secs(3));
    q.expect_closed(Duration::from_secs(3));
    oq.flush(1).ok();
    let mut c = Conn::open_ic(d.addr, NO_DIGESTS);
    c.admin_connect(SUBNQN, HOST_A, 0)
        .expect_status(Status::CONNECT_INVALID_PARAMETERS);
}
