//! NVMe in-band authentication (DH-HMAC-CHAP) on the wire: a host with
//! keys must authenticate each queue before anything else runs on it; a
//! wrong secret, hostile messages and out-of-order steps get AUTH_Failure1
//! and leave the queue unusable; a host without keys works as before; the
//! admin API takes keys and never shows them.

mod common;

use common::*;
use nvpool_target::config::{DhchapKeys, SecretText};
use nvpool_wire::auth::{self, AuthCmd, Message};
use nvpool_wire::dhchap::{HashId, HostAuth, HostOffer, HostStep, Keys, Secret, RANDOM_BYTES};
use nvpool_wire::fabrics::{fctype, prop};
use nvpool_wire::identify::cns;
use nvpool_wire::Status;
use std::collections::BTreeMap;

/// Connect response DW0 bit 17 (ATR).
const ATR: u32 = 1 << 17;

fn host_secret() -> Secret {
    Secret::new(&[0x61; 32], Some(HashId::Sha256)).unwrap()
}

fn ctrl_secret() -> Secret {
    Secret::new(&[0x62; 48], Some(HashId::Sha384)).unwrap()
}

fn key_config(ctrl: bool, dhgroup: &str) -> DhchapKeys {
    DhchapKeys {
        dhchap_key: SecretText::new(host_secret().to_dhhc()),
        dhchap_ctrl_key: ctrl.then(|| SecretText::new(ctrl_secret().to_dhhc())),
        dhchap_hash: None,
        dhchap_dhgroup: Some(dhgroup.into()),
        key_id: None,
    }
}

/// HOST_A needs keys (bidirectional when `ctrl`), HOST_B does not.
fn daemon(ctrl: bool, dhgroup: &str) -> Daemon {
    let mut s = subsystem(SUBNQN, &[HOST_A, HOST_B], &[(1, RAM_SPEC)]);
    s.host_keys = BTreeMap::from([(HOST_A.to_owned(), key_config(ctrl, dhgroup))]);
    Daemon::start(&[s])
}

fn send_cmd(q: &mut Conn, msg: &[u8]) -> Completion {
    let sqe = AuthCmd::new(msg.len() as u32).to_sqe(0, fctype::AUTH_SEND);
    q.exec_write(sqe, msg.to_vec(), true)
}

/// An Authentication Receive as the Linux host sends it (AL 4096).
fn receive(q: &mut Conn) -> Vec<u8> {
    let c = q.exec(AuthCmd::new(4096).to_sqe(0, fctype::AUTH_RECEIVE));
    c.ok();
    assert_eq!(c.data.len(), 4096, "exactly AL bytes come back");
    c.data
}

fn random() -> [u8; RANDOM_BYTES] {
    nvpool_rt::random::bytes()
}

/// Runs the exchange as a host holding `keys`; Ok when the host is
/// satisfied, else the host's error.
fn authenticate(q: &mut Conn, keys: &Keys, hostnqn: &str) -> Result<(), String> {
    let mut h = HostAuth::new(keys, HostOffer::default(), hostnqn, SUBNQN, 1);
    send_cmd(q, &h.negotiate()).ok();
    loop {
        let msg = receive(q);
        match h.on_receive(&msg, &random()) {
            HostStep::Send(m) => {
                send_cmd(q, &m).ok();
            }
            HostStep::SendAndDone(m) => {
                send_cmd(q, &m).ok();
                return Ok(());
            }
            HostStep::Done => return Ok(()),
            HostStep::Fail(m, e) => {
                if let Some(m) = m {
                    send_cmd(q, &m).ok();
                }
                return Err(e.to_string());
            }
        }
    }
}

/// The queue refuses ordinary commands with Authentication Required.
#[track_caller]
fn refused(q: &mut Conn, admin: bool) {
    let c = if admin {
        q.prop_get_cmd(prop::CAP, true)
    } else {
        q.exec(read_cmd(1, 0, 1, 512))
    };
    c.expect_status(Status::AUTH_REQUIRED);
}

fn keys(ctrl: bool) -> Keys {
    Keys {
        host: host_secret(),
        ctrl: ctrl.then(ctrl_secret),
    }
}

#[test]
fn every_queue_of_a_host_with_keys_authenticates_before_anything_runs() {
    for (ctrl, group) in [(false, "null"), (true, "ffdhe2048")] {
        let d = daemon(ctrl, group);
        let mut a = Conn::open_ic(d.addr, NO_DIGESTS);
        let c = a.admin_connect(SUBNQN, HOST_A, 5000);
        c.ok();
        assert_eq!(c.dw0 & ATR, ATR, "ATR set on the admin Connect");
        refused(&mut a, true);
        a.identify(cns::CONTROLLER, 0)
            .expect_status(Status::AUTH_REQUIRED);
        authenticate(&mut a, &keys(ctrl), HOST_A).unwrap();
        a.enable();
        a.identify(cns::CONTROLLER, 0).ok();

        let mut q = Conn::open_ic(d.addr, NO_DIGESTS);
        let c = q.io_connect(SUBNQN, HOST_A, a.cntlid, 1, 31);
        c.ok();
        assert_eq!(c.dw0 & ATR, ATR, "ATR set on the I/O Connect");
        refused(&mut q, false);
        authenticate(&mut q, &keys(ctrl), HOST_A).unwrap();
        let data = pattern(7, 4096);
        q.exec_write(write_cmd(1, 8, 8, false), data.clone(), false)
            .ok();
        assert_eq!(q.exec(read_cmd(1, 8, 8, 512)).ok().data, data);

        // A host without keys connects as before.
        let mut b = Conn::open_ic(d.addr, NO_DIGESTS);
        let c = b.admin_connect(SUBNQN, HOST_B, 5000);
        assert_eq!(c.ok().dw0 & ATR, 0);
        b.enable();
        b.identify(cns::CONTROLLER, 0).ok();
        d.shutdown();
    }
}

#[test]
fn a_wrong_secret_gets_failure1_and_the_queue_stays_unusable() {
    let d = daemon(false, "ffdhe2048");
    let mut a = Conn::open_ic(d.addr, NO_DIGESTS);
    a.admin_connect(SUBNQN, HOST_A, 5000).ok();
    let wrong = Keys {
        host: Secret::new(&[0x60; 32], Some(HashId::Sha256)).unwrap(),
        ctrl: None,
    };
    let e = authenticate(&mut a, &wrong, HOST_A).unwrap_err();
    assert!(e.contains("refused"), "{e}");
    refused(&mut a, true);
    // Another host's keys do not fit either (the NQN is in the transform).
    let mut b = Conn::open_ic(d.addr, NO_DIGESTS);
    b.admin_connect(SUBNQN, HOST_A, 5000).ok();
    assert!(authenticate(&mut b, &keys(false), HOST_B).is_err());
    refused(&mut b, true);
    d.shutdown();
}

#[test]
fn a_controller_with_the_wrong_controller_secret_is_refused_by_the_host() {
    let d = daemon(true, "null");
    let mut a = Conn::open_ic(d.addr, NO_DIGESTS);
    a.admin_connect(SUBNQN, HOST_A, 5000).ok();
    let other_ctrl = Keys {
        host: host_secret(),
        ctrl: Some(Secret::new(&[0x63; 48], Some(HashId::Sha384)).unwrap()),
    };
    let e = authenticate(&mut a, &other_ctrl, HOST_A).unwrap_err();
    assert!(e.contains("controller failed"), "{e}");
    // The host's Failure2 leaves the queue unauthenticated.
    refused(&mut a, true);
    d.shutdown();
}

/// Reads the AUTH_Failure1 explanation the next Receive returns.
#[track_caller]
fn failure1(q: &mut Conn) -> u8 {
    let msg = receive(q);
    match Message::decode(&msg) {
        Ok(Message::Failure {
            from_controller: true,
            explanation,
            ..
        }) => explanation,
        other => panic!("expected AUTH_Failure1, got {other:?}"),
    }
}

#[test]
fn hostile_auth_messages_get_the_protocol_failure_and_never_authenticate() {
    let d = daemon(true, "ffdhe2048");
    let mut a = Conn::open_ic(d.addr, NO_DIGESTS);
    a.admin_connect(SUBNQN, HOST_A, 5000).ok();

    // Bad SECP, SPSP, zero or oversize lengths, a length the SGL disagrees with.
    let mut sqe = AuthCmd::new(72).to_sqe(0, fctype::AUTH_SEND);
    sqe.0[43] = 0xEA;
    a.exec_write(sqe, vec![0; 72], true)
        .expect_status(Status::INVALID_FIELD);
    let mut sqe = AuthCmd::new(4096).to_sqe(0, fctype::AUTH_RECEIVE);
    sqe.0[41] = 2;
    a.exec(sqe).expect_status(Status::INVALID_FIELD);
    a.exec(AuthCmd::new(0).to_sqe(0, fctype::AUTH_RECEIVE))
        .expect_status(Status::INVALID_FIELD);
    let sqe = AuthCmd::new(8192).to_sqe(0, fctype::AUTH_SEND);
    a.exec_write(sqe, vec![0; 8192], true)
        .expect_status(Status::INVALID_FIELD);
    let sqe = AuthCmd::new(100).to_sqe(0, fctype::AUTH_SEND);
    a.exec_write(sqe, vec![0; 72], true)
        .expect_status(Status::INVALID_FIELD);
    refused(&mut a, true);

    // Out of order: a Receive first, a Reply before any Challenge.
    assert_eq!(failure1(&mut a), auth::failure::INCORRECT_PROTOCOL_MESSAGE);
    let reply = Message::Reply(auth::Reply {
        t_id: 1,
        cvalid: false,
        seqnum: 0,
        r1: &[0; 32],
        c2: &[0; 32],
        dhv: &[],
    })
    .encode();
    send_cmd(&mut a, &reply).ok();
    assert_eq!(failure1(&mut a), auth::failure::INCORRECT_PROTOCOL_MESSAGE);

    // Garbage, unknown ids, and a Reply whose DHVLEN is huge.
    send_cmd(&mut a, &[0xFF; 64]).ok();
    assert_eq!(failure1(&mut a), auth::failure::INCORRECT_PAYLOAD);
    send_cmd(&mut a, &[0x01, 0x77, 0, 0, 1, 0, 0, 0]).ok();
    assert_eq!(failure1(&mut a), auth::failure::INCORRECT_PAYLOAD);
    let k = keys(true);
    let mut h = HostAuth::new(&k, HostOffer::default(), HOST_A, SUBNQN, 9);
    send_cmd(&mut a, &h.negotiate()).ok();
    let challenge = receive(&mut a);
    let HostStep::Send(mut good) = h.on_receive(&challenge, &random()) else {
        panic!("no Reply")
    };
    let mut huge = good.clone();
    huge[10..12].copy_from_slice(&0xFFFFu16.to_le_bytes());
    send_cmd(&mut a, &huge).ok();
    assert_eq!(failure1(&mut a), auth::failure::INCORRECT_PAYLOAD);

    // A correct Reply under the wrong T_ID, after a fresh Negotiate.
    let mut h = HostAuth::new(&k, HostOffer::default(), HOST_A, SUBNQN, 10);
    send_cmd(&mut a, &h.negotiate()).ok();
    let challenge = receive(&mut a);
    let HostStep::Send(reply) = h.on_receive(&challenge, &random()) else {
        panic!("no Reply")
    };
    good.copy_from_slice(&reply);
    good[4] = 11;
    send_cmd(&mut a, &good).ok();
    assert_eq!(failure1(&mut a), auth::failure::INCORRECT_PROTOCOL_MESSAGE);
    refused(&mut a, true);

    // Seeded random messages: none of them authenticates the queue.
    let mut rng = nvpool_rt::random::Rng::new(0x9E37_79B9_7F4A_7C15);
    for i in 0..200 {
        let mut m = vec![0; 8 + (i * 37) % 600];
        rng.fill(&mut m);
        // Half of them look like DH-HMAC-CHAP messages.
        if i % 2 == 0 {
            m[0] = 1;
            m[1] = (i % 5) as u8;
        }
        send_cmd(&mut a, &m).ok();
        let _ = receive(&mut a);
        if i % 50 == 0 {
            refused(&mut a, true);
        }
    }
    refused(&mut a, true);

    // And the queue can still authenticate properly afterwards.
    authenticate(&mut a, &keys(true), HOST_A).unwrap();
    a.enable();
    a.identify(cns::CONTROLLER, 0).ok();
    d.shutdown();
}

#[test]
fn the_admin_api_takes_keys_and_never_returns_them() {
    let d = daemon(false, "null");
    let secret = host_secret().to_dhhc();
    let ctrl = ctrl_secret().to_dhhc();
    let body = format!(
        r#"{{"dhchap_key": "{secret}", "dhchap_ctrl_key": "{ctrl}", "dhchap_dhgroup": "ffdhe3072", "dhchap_hash": "sha512"}}"#
    );
    let r = http(
        d.api,
        "PUT",
        &format!("/v1/subsystems/{SUBNQN}/hosts/{HOST_B}"),
        Some(&body),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    for r in [
        r,
        http(d.api, "GET", &format!("/v1/subsystems/{SUBNQN}"), None),
        http(d.api, "GET", "/v1/target", None),
    ] {
        assert!(!r.body.contains("DHHC-1"), "a secret came back: {}", r.body);
    }
    let v = http(d.api, "GET", &format!("/v1/subsystems/{SUBNQN}"), None).json();
    let b = &v["host_auth"][HOST_B];
    assert_eq!(b["configured"], true, "{v}");
    assert_eq!(b["bidirectional"], true, "{v}");
    assert_eq!(b["dhgroup"], "ffdhe3072", "{v}");

    // HOST_B must authenticate now, with those keys.
    let mut q = Conn::open_ic(d.addr, NO_DIGESTS);
    assert_eq!(q.admin_connect(SUBNQN, HOST_B, 5000).ok().dw0 & ATR, ATR);
    authenticate(&mut q, &keys(true), HOST_B).unwrap();

    // A malformed secret is refused without being echoed.
    let bad = r#"{"dhchap_key": "DHHC-1:01:c2VjcmV0LXRleHQ=:"}"#;
    let r = http(
        d.api,
        "PUT",
        &format!("/v1/subsystems/{SUBNQN}/hosts/{HOST_B}"),
        Some(bad),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(!r.body.contains("c2VjcmV0"), "{}", r.body);

    // DELETE drops the keys with the host; a plain PUT allows it without.
    let path = format!("/v1/subsystems/{SUBNQN}/hosts/{HOST_B}");
    assert_eq!(http(d.api, "DELETE", &path, None).status, 204);
    assert_eq!(http(d.api, "PUT", &path, None).status, 200);
    let mut q = Conn::open_ic(d.addr, NO_DIGESTS);
    assert_eq!(q.admin_connect(SUBNQN, HOST_B, 5000).ok().dw0 & ATR, 0);
    d.shutdown();
}
