//! DH-HMAC-CHAP between the initiator and nvpool-target, in process: every
//! hash with the null and ffdhe2048 groups, uni- and bidirectional, on the
//! admin queue and each I/O queue; a wrong host secret is refused by the
//! target, a controller holding the wrong controller secret is refused by
//! the initiator, and a host without keys cannot use a queue that asks
//! for authentication.

mod common;

use common::*;
use nvpool_initiator::{Controller, Error};
use nvpool_target::config::{DhchapKeys, SecretText};
use nvpool_wire::dhchap::{AuthError, DhGroup, HashId, Keys, Secret};
use std::collections::BTreeMap;
use std::sync::Arc;

fn host_secret() -> Secret {
    Secret::new(&[0x71; 32], Some(HashId::Sha256)).unwrap()
}

fn ctrl_secret() -> Secret {
    Secret::new(&[0x72; 64], Some(HashId::Sha512)).unwrap()
}

/// A target where HOST_A must authenticate with `hash` and `group`.
fn target(ctrl: Option<&Secret>, hash: HashId, group: DhGroup) -> Tgt {
    let mut s = subsystem(SUBNQN, &[HOST_A], &[(1, RAM_SPEC)]);
    s.host_keys = BTreeMap::from([(
        HOST_A.to_owned(),
        DhchapKeys {
            dhchap_key: SecretText::new(host_secret().to_dhhc()),
            dhchap_ctrl_key: ctrl.map(|c| SecretText::new(c.to_dhhc())),
            dhchap_hash: Some(hash.name().into()),
            dhchap_dhgroup: Some(group.name().into()),
            key_id: None,
        },
    )]);
    Tgt::start(&[s])
}

fn keys(host: Secret, ctrl: Option<Secret>) -> Option<Arc<Keys>> {
    Some(Arc::new(Keys { host, ctrl }))
}

#[test]
fn every_hash_with_null_and_ffdhe2048_uni_and_bidirectional() {
    for hash in HashId::ALL {
        for group in [DhGroup::Null, DhGroup::Ffdhe2048] {
            for bidi in [false, true] {
                let ctrl = bidi.then(ctrl_secret);
                let t = target(ctrl.as_ref(), hash, group);
                let mut p = params(t.addr, SUBNQN, HOST_A);
                p.dhchap = keys(host_secret(), ctrl);
                let what = format!("{hash:?} {group:?} bidirectional {bidi}");
                let c = Controller::connect(p).unwrap_or_else(|e| panic!("{what}: {e}"));
                let mut q = c.io_queue(1).unwrap_or_else(|e| panic!("{what}: {e}"));
                q.set_block_size(512);
                write(&mut q, 0, &pattern(3, 4096), 512).expect("write");
                assert_same(
                    &read(&mut q, 0, 4096, 512).expect("read"),
                    &pattern(3, 4096),
                    &what,
                );
            }
        }
    }
}

#[test]
fn a_wrong_host_secret_is_refused() {
    let t = target(None, HashId::Sha256, DhGroup::Ffdhe2048);
    let mut p = params(t.addr, SUBNQN, HOST_A);
    p.dhchap = keys(
        Secret::new(&[0x70; 32], Some(HashId::Sha256)).unwrap(),
        None,
    );
    match Controller::connect(p) {
        Err(Error::Auth {
            qid: 0,
            source: AuthError::Refused(_),
            ..
        }) => {}
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_controller_with_the_wrong_controller_secret_is_refused() {
    let wrong = Secret::new(&[0x73; 64], Some(HashId::Sha512)).unwrap();
    let t = target(Some(&wrong), HashId::Sha384, DhGroup::Null);
    let mut p = params(t.addr, SUBNQN, HOST_A);
    p.dhchap = keys(host_secret(), Some(ctrl_secret()));
    match Controller::connect(p) {
        Err(Error::Auth {
            source: AuthError::ControllerResponse,
            ..
        }) => {}
        other => panic!("expected the controller to be refused, got {other:?}"),
    }
}

#[test]
fn a_host_without_keys_cannot_use_a_queue_that_asks_for_them() {
    let t = target(None, HashId::Sha256, DhGroup::Null);
    match Controller::connect(params(t.addr, SUBNQN, HOST_A)) {
        Err(Error::Auth {
            source: AuthError::NoKey,
            ..
        }) => {}
        other => panic!("expected no-key, got {other:?}"),
    }
    // Keys the target never asks for are simply not used.
    let t = Tgt::start(&[subsystem(SUBNQN, &[HOST_A], &[(1, RAM_SPEC)])]);
    let mut p = params(t.addr, SUBNQN, HOST_A);
    p.dhchap = keys(host_secret(), Some(ctrl_secret()));
    Controller::connect(p).expect("connect without authentication");
}
