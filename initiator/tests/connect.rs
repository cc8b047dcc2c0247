//! Connecting the initiator to nvpool-target: the controller it reports,
//! namespaces, refusals (unknown subsystem, host not allowed) and
//! keep-alive through idleness.

mod common;

use common::*;
use nvpool_initiator::{Controller, Error};
use nvpool_wire::Status;
use std::time::Duration;

#[test]
fn controller_fields_are_sane() {
    let t = Tgt::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let c = Controller::connect(params(t.addr, SUBNQN, HOST_A)).expect("connect");

    assert_ne!(c.identify.cntlid, 0, "CNTLID from the dynamic range");
    assert!(c.identify.cntlid <= 0xFFEF, "CNTLID {}", c.identify.cntlid);
    assert_eq!(c.identify.subnqn, SUBNQN);
    assert_eq!(c.addr(), t.addr);
    assert_eq!(c.max_transfer(), 128 << 10, "MDTS 128 KiB");
    assert_eq!(c.inline_data_max(), 16 << 10, "16 KiB in-capsule");
    assert_eq!(c.io_queue_count(), 2, "asked for 2 queues, granted 2");
    assert_eq!(c.io_queue_entries(), 33, "depth 32 + 1");

    // The target sees exactly this controller, for this host.
    let live: Vec<_> = t
        .target
        .controllers()
        .into_iter()
        .filter(|x| !x.discovery)
        .collect();
    assert_eq!(live.len(), 1, "one controller on the target");
    assert_eq!(live[0].cntlid, c.identify.cntlid);
    assert_eq!(live[0].hostnqn, HOST_A);
    assert_eq!(live[0].subsys_nqn, SUBNQN);

    let mut q = c.io_queue(1).expect("I/O queue 1");
    assert_eq!(q.qid(), 1);
    assert_eq!(q.depth(), 32);
    assert_eq!(q.outstanding(), 0);
    q.set_block_size(512);
    write(&mut q, 0, &pattern(1, 4096), 512).expect("write");
    assert_same(
        &read(&mut q, 0, 4096, 512).expect("read"),
        &pattern(1, 4096),
        "read back",
    );
}

#[test]
fn io_queue_count_is_clamped_to_the_ask() {
    let t = Tgt::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let mut p = params(t.addr, SUBNQN, HOST_A);
    p.io_queues = 1;
    let c = Controller::connect(p).expect("connect");
    assert_eq!(c.io_queue_count(), 1);
    let q = c.io_queue(1).expect("I/O queue 1");
    drop(q);
    // A queue depth the controller cannot take is clamped to CAP.MQES + 1.
    let mut p = params(t.addr, SUBNQN, HOST_A);
    p.queue_depth = 4000;
    let c = Controller::connect(p).expect("connect");
    let q = c.io_queue(1).expect("deep queue connects after clamping");
    assert_eq!(q.depth(), c.io_queue_entries() as usize - 1);
    assert!(q.depth() <= 255, "clamped to the target's 256 entries");
}

#[test]
fn namespace_info_and_stable_uuid() {
    let (_dir, path) = scratch_file(8 << 20);
    let file = file_spec(&path);
    let t = Tgt::start(&[subsystem(
        SUBNQN,
        &[],
        &[(1, RAM_SPEC), (3, "ram:1M,block_size=4096"), (7, &file)],
    )]);
    let c1 = Controller::connect(params(t.addr, SUBNQN, HOST_A)).expect("connect 1");
    assert_eq!(c1.active_namespaces().expect("active list"), vec![1, 3, 7]);

    let n1 = c1.namespace(1).expect("namespace 1");
    assert_eq!(n1.nsid, 1);
    assert_eq!(n1.blocks, RAM_BLOCKS);
    assert_eq!(n1.block_size, 512);
    assert_eq!(n1.size_bytes(), 16 << 20);
    let u1 = n1.uuid.expect("namespace 1 has a UUID descriptor");
    assert_ne!(u1, [0u8; 16]);
    assert_eq!(n1.nguid, u1, "NGUID = UUID (ARCHITECTURE D8)");

    let n3 = c1.namespace(3).expect("namespace 3");
    assert_eq!(n3.block_size, 4096);
    assert_eq!(n3.blocks, 256);
    let n7 = c1.namespace(7).expect("namespace 7");
    assert_eq!(n7.size_bytes(), 8 << 20);
    let uuids = [u1, n3.uuid.expect("uuid 3"), n7.uuid.expect("uuid 7")];
    assert!(
        uuids[0] != uuids[1] && uuids[1] != uuids[2] && uuids[0] != uuids[2],
        "namespace UUIDs are distinct: {uuids:x?}"
    );
    assert!(c1.namespace(2).is_err(), "an inactive namespace is refused");

    // A second connection (another controller) sees the same identities.
    let c2 = Controller::connect(params(t.addr, SUBNQN, HOST_B)).expect("connect 2");
    assert_ne!(c2.identify.cntlid, c1.identify.cntlid);
    assert_eq!(c2.namespace(1).expect("ns 1").uuid, Some(u1));
    assert_eq!(c2.namespace(7).expect("ns 7").uuid, Some(uuids[2]));
    c1.shutdown();
    drop(c1);
    let c3 = Controller::connect(params(t.addr, SUBNQN, HOST_A)).expect("connect 3");
    assert_eq!(c3.namespace(1).expect("ns 1").uuid, Some(u1));
    assert_eq!(c3.namespace(3).expect("ns 3").uuid, Some(uuids[1]));
}

#[test]
fn unknown_subsystem_is_refused_with_the_connect_status() {
    let t = Tgt::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let err = Controller::connect(params(t.addr, "nqn.2026-11.io.nvpool:nope", HOST_A))
        .expect_err("no such subsystem");
    match err {
        Error::Status { status, .. } => assert!(
            same_code(status, Status::CONNECT_INVALID_PARAMETERS),
            "status {status}"
        ),
        other => panic!("expected Error::Status, got {other:?}"),
    }
}

#[test]
fn host_outside_the_acl_is_refused_with_the_connect_status() {
    let t = Tgt::start(&[subsystem(SUBNQN, &[HOST_A], &[(1, RAM_SPEC)])]);
    let err = Controller::connect(params(t.addr, SUBNQN, HOST_B)).expect_err("not allowed");
    match &err {
        Error::Status { status, what, .. } => {
            assert!(
                same_code(*status, Status::CONNECT_INVALID_HOST),
                "status {status}"
            );
            assert_eq!(*what, "connect");
        }
        other => panic!("expected Error::Status, got {other:?}"),
    }
    assert!(!err.is_transport(), "a refusal is not worth reconnecting");
    // The allowed host gets in.
    Controller::connect(params(t.addr, SUBNQN, HOST_A)).expect("allowed host connects");
}

#[test]
fn nothing_listening_is_a_connect_error() {
    let t = Tgt::start(&[]);
    let addr = t.addr;
    t.stop();
    let err = Controller::connect(params(addr, SUBNQN, HOST_A)).expect_err("nothing there");
    assert!(matches!(err, Error::Connect { .. }), "{err:?}");
    assert!(err.is_transport());
}

#[test]
fn keep_alive_keeps_an_idle_controller() {
    let t = Tgt::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let mut p = params(t.addr, SUBNQN, HOST_A);
    p.kato = Duration::from_secs(1);
    // A reconnect would hide an expiry; make it impossible.
    p.ctrl_loss_timeout = Duration::ZERO;
    let c = Controller::connect(p).expect("connect");
    let cntlid = c.identify.cntlid;
    let mut q = c.io_queue(1).expect("queue");
    q.set_block_size(512);
    write(&mut q, 8, &pattern(8, 512), 512).expect("write before idling");

    std::thread::sleep(Duration::from_secs(3));

    let live: Vec<u16> = t.target.controllers().iter().map(|x| x.cntlid).collect();
    assert!(
        live.contains(&cntlid),
        "controller {cntlid} expired after 3 s idle with KATO 1 s (live: {live:?})"
    );
    assert_eq!(t.target.controllers().len(), 1, "no reconnect happened");
    // The I/O queue of the same controller still works.
    assert_same(
        &read(&mut q, 8, 512, 512).expect("read after idling"),
        &pattern(8, 512),
        "read after idling",
    );
    assert_eq!(
        c.namespace(1).expect("admin after idling").blocks,
        RAM_BLOCKS
    );
}

#[test]
fn io_queue_ids_outside_the_grant_are_refused() {
    let t = Tgt::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let c = Controller::connect(params(t.addr, SUBNQN, HOST_A)).expect("connect");
    assert_eq!(c.io_queue_count(), 2);
    for qid in [0u16, 3, 65535] {
        match c.io_queue(qid) {
            Err(Error::Status { what, .. }) => assert_eq!(what, "connect", "qid {qid}"),
            Err(e) => panic!("qid {qid}: expected a connect status, got {e:?}"),
            Ok(_) => panic!("qid {qid} was accepted"),
        }
    }
    let _q1 = c.io_queue(1).expect("queue 1");
    assert!(c.io_queue(1).is_err(), "queue 1 twice");
    let mut q2 = c.io_queue(2).expect("queue 2 after the refusals");
    q2.set_block_size(512);
    write(&mut q2, 0, &pattern(2, 512), 512).expect("write on queue 2");
}
