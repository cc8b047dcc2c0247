//! Hosts' DH-HMAC-CHAP keys held by the control plane (C24), against real
//! targets in process: set once, every target exporting to the host makes
//! it authenticate with them; a rotation reaches the targets at once, a
//! target that missed it is brought back by reconciliation, and clearing
//! the keys lets the host in without. Secrets never come back in answers.

mod common;

use common::nodes::*;
use common::MIB;
use nvpool_control::rest::AttachmentOut;
use nvpool_initiator::exec::block_on;
use nvpool_initiator::{Volume, VolumeOptions};
use nvpool_wire::dhchap::{Keys, Secret};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

fn secret(seed: u8) -> Secret {
    let key: Vec<u8> = (0..32).map(|i| seed.wrapping_mul(37) ^ i).collect();
    Secret::new(&key, None).unwrap()
}

fn keys_path(host: &str) -> String {
    format!("/v1/hosts/{}/dhchap", enc(host))
}

fn set_keys(c: &Cluster, host: &str, body: Value) -> common::Reply {
    c.server.admin("PUT", &keys_path(host), Some(body))
}

/// Opens the attached volume as the agent does, offering `keys`.
fn open(a: &AttachmentOut, keys: Option<&Keys>) -> Result<Volume, nvpool_initiator::Error> {
    let opts = VolumeOptions {
        ctrl_loss_timeout: Some(Duration::from_millis(500)),
        connect_timeout: Duration::from_secs(5),
        dhchap: keys.map(|k| Arc::new(k.clone())),
        ..VolumeOptions::default()
    };
    Volume::open(&a.plan, opts)
}

/// The `key_id` target `n` shows for `host` on `nqn`, if it holds keys.
fn held_key_id(n: &Node, nqn: &str, host: &str) -> Option<Option<String>> {
    let s = n.target.subsystem(nqn)?;
    s.host_keys.get(host).map(|a| a.config.key_id.clone())
}

#[test]
fn targets_exporting_to_a_host_make_it_authenticate_with_the_keys_the_control_plane_holds() {
    let c = cluster(2);
    let vol = create(&c.server, 1, 2 * MIB, json!({"type": "raid1", "copies": 2}));
    let k1 = Keys {
        host: secret(1),
        ctrl: None,
    };
    let r = set_keys(&c, HOST_A, json!({"dhchap_key": k1.host.to_dhhc()}));
    assert_eq!(r.status, 200, "{}", r.body);
    let out = r.json();
    assert!(!r.body.contains(&k1.host.to_dhhc()), "{}", r.body);
    let first_id = out["key_id"].as_str().unwrap().to_owned();
    assert_eq!(out["bidirectional"], false);
    // Nothing exports to the host yet.
    assert_eq!(out["rollout"]["updated"], json!([]), "{out}");

    // Attached afterwards: both targets require the keys.
    let r = attach(&c.server, &vol, HOST_A);
    assert_eq!(r.status, 201, "{}", r.body);
    let a: AttachmentOut = serde_json::from_value(r.json()).unwrap();
    let nqn = a.plan.extents[0].subsystem_nqn.clone();
    for n in &c.nodes {
        assert_eq!(
            held_key_id(n, &nqn, HOST_A),
            Some(Some(first_id.clone())),
            "{}",
            n.id
        );
    }
    assert!(open(&a, None).is_err(), "a host without keys got in");
    let wrong = Keys {
        host: secret(9),
        ctrl: None,
    };
    assert!(open(&a, Some(&wrong)).is_err(), "a wrong secret got in");
    let v = open(&a, Some(&k1)).unwrap();
    let data = vec![0x5a; 4096];
    let (r, _) = block_on(v.write(8192, data.clone(), false));
    r.unwrap();
    drop(v);

    // Rotation, bidirectional now: every target changes before the answer.
    let k2 = Keys {
        host: secret(2),
        ctrl: Some(secret(3)),
    };
    let set = set_keys(
        &c,
        HOST_A,
        json!({
            "dhchap_key": k2.host.to_dhhc(),
            "dhchap_ctrl_key": k2.ctrl.as_ref().unwrap().to_dhhc(),
            "dhchap_hash": "sha512",
            "dhchap_dhgroup": "ffdhe2048",
        }),
    );
    assert_eq!(set.status, 200, "{}", set.body);
    let out = set.json();
    let second_id = out["key_id"].as_str().unwrap().to_owned();
    assert_ne!(second_id, first_id);
    let mut updated: Vec<String> =
        serde_json::from_value(out["rollout"]["updated"].clone()).unwrap();
    updated.sort();
    let mut all: Vec<String> = c.nodes.iter().map(|n| n.id.clone()).collect();
    all.sort();
    assert_eq!(updated, all, "{out}");
    assert_eq!(out["rollout"]["pending"], json!([]), "{out}");
    assert!(open(&a, Some(&k1)).is_err(), "the old secret still works");
    let v = open(&a, Some(&k2)).unwrap();
    let (r, back) = block_on(v.read(8192, vec![0; 4096]));
    r.unwrap();
    assert_eq!(back, data);
    drop(v);
    // The answer and the view never hold a secret.
    let g = c.server.read(&keys_path(HOST_A));
    assert_eq!(g.status, 200, "{}", g.body);
    for s in [&k2.host, k2.ctrl.as_ref().unwrap()] {
        assert!(!g.body.contains(&s.to_dhhc()) && !set.body.contains(&s.to_dhhc()));
    }
    assert_eq!(g.json()["key_id"], second_id.as_str());
    assert_eq!(g.json()["bidirectional"], true);
    assert_eq!(g.json()["dhchap_dhgroup"], "ffdhe2048");

    // A target that holds other keys (changed behind the control plane's
    // back, or missed a rollout) gets the cluster's again on reconcile.
    let n0 = &c.nodes[0];
    let other = nvpool_target::config::DhchapKeys {
        dhchap_key: nvpool_target::config::SecretText::new(secret(7).to_dhhc()),
        dhchap_ctrl_key: None,
        dhchap_hash: None,
        dhchap_dhgroup: None,
        key_id: Some("stale".into()),
    };
    n0.target
        .allow_host_with_keys(&nqn, HOST_A, Some(&other))
        .unwrap();
    let r = c
        .server
        .admin("POST", &format!("/v1/targets/{}/reconcile", n0.id), None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(held_key_id(n0, &nqn, HOST_A), Some(Some(second_id)));

    // Cleared: the targets let the host in without authenticating.
    let r = c.server.admin("DELETE", &keys_path(HOST_A), None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["pending"], json!([]), "{}", r.body);
    for n in &c.nodes {
        assert_eq!(held_key_id(n, &nqn, HOST_A), None, "{}", n.id);
        let s = n.target.subsystem(&nqn).unwrap();
        assert!(s.hosts.contains(HOST_A), "{}: the host lost access", n.id);
    }
    open(&a, None).unwrap();
    let r = c.server.read(&keys_path(HOST_A));
    c.server.expect_error(&r, 404, "not_found");
    let r = c.server.admin("DELETE", &keys_path(HOST_A), None);
    c.server.expect_error(&r, 404, "not_found");
}

#[test]
fn bad_host_key_requests_get_a_4xx_that_never_quotes_a_secret() {
    let c = cluster(1);
    let good = secret(1).to_dhhc();
    // A well-formed string whose CRC is wrong.
    let mut broken = good.clone();
    broken.replace_range(12..14, "AA");
    let cases = [
        json!({"dhchap_key": broken}),
        json!({"dhchap_key": "not-a-dhchap-secret-at-all"}),
        json!({"dhchap_key": good, "dhchap_ctrl_key": good}),
        json!({"dhchap_key": good, "dhchap_hash": "md5"}),
        json!({"dhchap_key": good, "dhchap_dhgroup": "ffdhe1024"}),
        json!({"dhchap_key": good, "extra": 1}),
        json!({}),
    ];
    for body in cases {
        let r = set_keys(&c, HOST_A, body.clone());
        c.server.expect_error(&r, 400, "invalid");
        assert!(
            !r.body.contains(&good[10..40]) && !r.body.contains(&broken[10..40]),
            "{body}: {}",
            r.body
        );
    }
    let r = set_keys(&c, "not-an-nqn", json!({"dhchap_key": good}));
    c.server.expect_error(&r, 400, "invalid");
    // Setting keys is an admin's; reading them a reader's.
    let r = c.server.call(
        "PUT",
        &keys_path(HOST_A),
        Some(common::READER),
        Some(json!({"dhchap_key": good})),
    );
    c.server.expect_error(&r, 403, "forbidden");
    let r = c.server.read(&keys_path(HOST_A));
    c.server.expect_error(&r, 404, "not_found");
    // Nothing was stored by any of it.
    assert_eq!(c.server.read(&keys_path(HOST_A)).status, 404);
}

/// `--require-host-keys`: a host without keys is neither attached nor
/// served (409 host_keys_required, nothing recorded); with keys it is.
#[test]
fn a_cluster_requiring_host_keys_serves_no_host_without_them() {
    use nvpool_control::api::{ApiServer, AuthConfig};
    use nvpool_control::auth::{Principal, Tokens};
    use nvpool_control::store::MemStore;
    use nvpool_control::{Cluster, ManualClock, StateConfig};
    let config = StateConfig {
        extent_bytes: MIB,
        require_host_keys: true,
        ..StateConfig::default()
    };
    let clock = Arc::new(ManualClock::new(common::T0));
    let cluster = Arc::new(Cluster::new(Arc::new(MemStore::new()), clock, config).unwrap());
    let api = ApiServer::start(
        cluster.clone(),
        AuthConfig::new(Tokens::new().with(Principal::Admin, common::ADMIN)),
        "127.0.0.1:0".parse().unwrap(),
    )
    .unwrap();
    let call = |method: &str, path: &str, body: Option<Value>| {
        let text = body.map(|b| b.to_string());
        common::http(api.addr, method, path, Some(common::ADMIN), text.as_deref()).unwrap()
    };
    let vol = uuid(1);
    for (method, path) in [
        (
            "PUT",
            format!("/v1/volumes/{vol}/attachments/{}", enc(HOST_A)),
        ),
        ("PUT", format!("/v1/volumes/{vol}/exports/{}", enc(HOST_A))),
    ] {
        let r = call(method, &path, None);
        assert_eq!(r.status, 409, "{path}: {}", r.body);
        let j = r.json();
        assert_eq!(j["kind"], "host_keys_required", "{j}");
        assert!(
            j["message"]
                .as_str()
                .unwrap()
                .contains("nvpool host set-keys"),
            "{j}"
        );
    }
    // nvpool's own initiators (a served volume's owner) are exempt.
    let owner = nvpool_control::paths::owner_host_nqn(&vol.parse().unwrap(), "t0");
    assert!(cluster.keys_to_serve(&owner).unwrap().is_none());
    // Nothing was recorded for the host.
    let r = call(
        "GET",
        &format!("/v1/volumes/{vol}/attachments/{}", enc(HOST_A)),
        None,
    );
    assert_eq!(r.status, 404, "{}", r.body);
    // Given keys, the host passes the check (and meets the next one: the
    // volume does not exist).
    let r = call(
        "PUT",
        &keys_path(HOST_A),
        Some(json!({"dhchap_key": secret(4).to_dhhc()})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let r = call(
        "PUT",
        &format!("/v1/volumes/{vol}/attachments/{}", enc(HOST_A)),
        None,
    );
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(r.json()["kind"], "not_found");
}
