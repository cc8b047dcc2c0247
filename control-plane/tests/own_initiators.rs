//! nvpool's own initiators — a served volume's owner and a target's
//! copier — against real targets in process (issue 25, bug E): no token
//! attaches, detaches or reports for an owner NQN the control plane did
//! not issue, and nothing is recorded when one tries; knowing an owner's
//! NQN (anyone with a token can read it) gives no data, because the
//! extents' targets make it authenticate with keys only the owner target
//! got, over its admin API.

mod common;

use common::nodes::*;
use common::{ADMIN, MIB, READER, TARGET};
use nvpool_control::attach::host_subsystem_nqn;
use nvpool_control::auth::{Principal, Tokens};
use nvpool_control::failover;
use nvpool_control::paths::{owner_host_nqn, volume_subsystem_nqn};
use nvpool_control::Uuid;
use nvpool_initiator::exec::block_on;
use nvpool_initiator::{Controller, Device};
use nvpool_target::register::{ControlPlaneUrl, RegistrationConfig};
use nvpool_target::served::{ControlPlaneSource, LeaseKeeper};
use serde_json::{json, Value};
use std::sync::Arc;

const HOST_TOKEN: &str = "host-b-secret-0123456789";

fn bound_token(target: &str) -> String {
    format!("bound-{target}-secret-0123456789")
}

/// Four targets, each owning served volumes with its own bound target
/// token (as `target TOKEN ID` lines give them); the control plane also
/// knows the shared target token and a host token for HOST_B.
struct Served {
    c: Cluster,
    _keepers: Vec<LeaseKeeper>,
}

fn served_cluster() -> Served {
    let mut tokens = Tokens::new()
        .with(Principal::Target, TARGET)
        .with(Principal::Host(HOST_B.into()), HOST_TOKEN);
    for i in 0..4 {
        let id = format!("t{i}");
        tokens = tokens.with(Principal::BoundTarget(id.clone()), &bound_token(&id));
    }
    let c = cluster_with_tokens(4, tokens);
    let mut keepers = Vec::new();
    for n in &c.nodes {
        let url = ControlPlaneUrl::parse(&format!("http://{}", c.server.addr)).unwrap();
        let mut rc = RegistrationConfig::new(url, n.id.clone(), n.id.clone(), n.addr, n.admin);
        rc.token = Some(bound_token(&n.id));
        n.target
            .set_volume_source(Arc::new(ControlPlaneSource::new(rc.clone(), &n.target)));
        keepers.push(LeaseKeeper::start(rc, n.target.clone()).unwrap());
    }
    Served {
        c,
        _keepers: keepers,
    }
}

/// A RAID1 volume over two targets, exported to HOST_A (so served, with
/// an owner); returns (volume, owner, the other path).
fn served_volume(c: &Cluster, n: u8) -> (String, String, String) {
    let vol = create(&c.server, n, 2 * MIB, json!({"type": "raid1", "copies": 2}));
    let r = c.server.admin(
        "PUT",
        &format!("/v1/volumes/{vol}/exports/{}", enc(HOST_A)),
        Some(json!({"paths": 2})),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let v = r.json();
    assert_eq!(v["serving"], true, "{v}");
    let (owner, other) = owner_and_other(&v);
    (vol, owner, other)
}

/// Every call a token could make for `host` under volume `vol`'s
/// attachments, but a read: attach, detach and the four reports.
fn writes(vol: &str, host: &str) -> Vec<(&'static str, String, Option<Value>)> {
    let at = format!("/v1/volumes/{vol}/attachments/{}", enc(host));
    vec![
        ("PUT", at.clone(), None),
        ("DELETE", format!("{at}?force=true"), None),
        (
            "PUT",
            format!("{at}/failed-extents"),
            Some(json!({"failed_extents": [0]})),
        ),
        (
            "PUT",
            format!("{at}/session"),
            Some(json!({"session": 7, "revision": 1})),
        ),
        (
            "PUT",
            format!("{at}/missed"),
            Some(json!({"session": 7, "extents": {"0": [1]}})),
        ),
        (
            "PUT",
            format!("{at}/sync/1"),
            Some(json!({"session": 7, "failed": true})),
        ),
    ]
}

fn attachments(c: &Cluster, vol: &str) -> Vec<String> {
    let r = c.server.read(&format!("/v1/volumes/{vol}/attachments"));
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["host_nqn"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn a_made_up_owner_nqn_is_refused_with_every_token_and_nothing_is_recorded() {
    let s = served_cluster();
    let c = &s.c;
    let (vol, owner, other) = served_volume(c, 1);
    let id: Uuid = vol.parse().unwrap();
    let unserved = create(&c.server, 2, 2 * MIB, json!({"type": "raid1", "copies": 2}));
    let unserved_id: Uuid = unserved.parse().unwrap();
    let missing = uuid(77);
    let missing_id: Uuid = missing.parse().unwrap();
    let issued = owner_host_nqn(&id, &owner);
    let before = c.server.read(&format!("/v1/volumes/{vol}/exports")).json();
    assert_eq!(attachments(c, &vol), vec![issued.clone()]);

    // (path volume, owner NQN, the target it names): a volume that does
    // not exist; a real volume that is not served; a served volume and a
    // path that is not its owner; the issued NQN under another volume.
    let made_up = [
        (
            missing.clone(),
            owner_host_nqn(&missing_id, "t0"),
            "t0".to_owned(),
        ),
        (
            unserved.clone(),
            owner_host_nqn(&unserved_id, "t0"),
            "t0".to_owned(),
        ),
        (vol.clone(), owner_host_nqn(&id, &other), other.clone()),
        (unserved.clone(), issued.clone(), owner.clone()),
    ];
    for (path_vol, nqn, named) in &made_up {
        let tokens = [
            ADMIN.to_owned(),
            READER.to_owned(),
            TARGET.to_owned(),
            bound_token(named),
            bound_token(&owner),
            HOST_TOKEN.to_owned(),
        ];
        for (method, path, body) in writes(path_vol, nqn) {
            for token in &tokens {
                let r = c.server.call(method, &path, Some(token), body.clone());
                c.server.expect_error(&r, 403, "forbidden");
            }
        }
    }
    // The issued owner NQN itself: no token attaches or detaches it (the
    // control plane does, at a failover), and only the owner's token (or
    // the shared one, or the admin's) reports for it.
    for (method, path, body) in writes(&vol, &issued).into_iter().take(2) {
        for token in [ADMIN, TARGET, &bound_token(&owner)] {
            let r = c.server.call(method, &path, Some(token), body.clone());
            c.server.expect_error(&r, 403, "forbidden");
        }
    }
    let report = format!(
        "/v1/volumes/{vol}/attachments/{}/failed-extents",
        enc(&issued)
    );
    let nothing_failed = Some(json!({"failed_extents": []}));
    for token in [READER, HOST_TOKEN, &bound_token(&other)] {
        let r = c
            .server
            .call("PUT", &report, Some(token), nothing_failed.clone());
        c.server.expect_error(&r, 403, "forbidden");
    }
    let r = c.server.call(
        "PUT",
        &report,
        Some(&bound_token(&owner)),
        nothing_failed.clone(),
    );
    assert_eq!(r.status, 200, "the owner's own report: {}", r.body);
    // Nor may an admin set or clear an owner's keys: the control plane
    // draws them.
    for method in ["PUT", "DELETE"] {
        let body = (method == "PUT").then(|| {
            json!({"dhchap_key": nvpool_wire::dhchap::Secret::new(&[7; 32], None).unwrap().to_dhhc()})
        });
        let r = c.server.call(
            method,
            &format!("/v1/hosts/{}/dhchap", enc(&issued)),
            Some(ADMIN),
            body,
        );
        c.server.expect_error(&r, 403, "forbidden");
    }

    // Nothing was recorded: no attachment, copy or served record, no
    // subsystem on any target, and the owner is as it was.
    assert_eq!(attachments(c, &vol), vec![issued.clone()]);
    assert_eq!(attachments(c, &unserved), Vec::<String>::new());
    let r = c.server.read(&format!("/v1/volumes/{missing}"));
    assert_eq!(r.status, 404, "{}", r.body);
    let r = c.server.read(&format!("/v1/volumes/{unserved}/exports"));
    assert_eq!(r.status, 404, "{}", r.body);
    for v in [&vol, &unserved] {
        let info = c.server.read(&format!("/v1/volumes/{v}")).json();
        assert_eq!(info["failed_extents"], json!([]), "{info}");
    }
    let after = c.server.read(&format!("/v1/volumes/{vol}/exports")).json();
    assert_eq!(after, before);
    for (_, nqn, _) in &made_up[..3] {
        let sub = host_subsystem_nqn(nqn);
        for n in &c.nodes {
            assert!(
                n.target.subsystem(&sub).is_none(),
                "{} exports to {nqn}",
                n.id
            );
        }
    }
}

#[test]
fn an_owner_nqn_reaches_no_extent_without_the_keys_its_target_was_given() {
    let s = served_cluster();
    let c = &s.c;
    let (vol, owner, other) = served_volume(c, 3);
    let id: Uuid = vol.parse().unwrap();
    let issued = owner_host_nqn(&id, &owner);
    let served_nqn = volume_subsystem_nqn(&id);

    // What a stolen target token reads: the owner's plan (where its
    // extents are, as which subsystem) and its keys' label, never a key.
    let plan = c.server.call(
        "GET",
        &format!("/v1/volumes/{vol}/attachments/{}", enc(&issued)),
        Some(TARGET),
        None,
    );
    assert_eq!(plan.status, 200, "{}", plan.body);
    let keys = c.server.call(
        "GET",
        &format!("/v1/hosts/{}/dhchap", enc(&issued)),
        Some(TARGET),
        None,
    );
    assert_eq!(keys.status, 200, "{}", keys.body);
    let key_id = keys.json()["key_id"].as_str().unwrap().to_owned();
    assert_eq!(keys.json()["bidirectional"], true, "{}", keys.body);
    for body in [&plan.body, &keys.body] {
        assert!(!body.contains("DHHC-1"), "a secret in an answer: {body}");
    }

    // The owner target holds the keys (given with the serving state over
    // its admin API); the other path holds none.
    let held = node_of(c, &owner).target.owner_keys(&served_nqn).unwrap();
    assert_eq!(held.config.key_id.as_deref(), Some(key_id.as_str()));
    assert!(node_of(c, &other).target.owner_keys(&served_nqn).is_none());
    // Its admin API shows their label only.
    let n = node_of(c, &owner);
    let shown = common::http(
        n.admin,
        "GET",
        &format!("/v1/subsystems/{}", enc(&served_nqn)),
        Some(&n.admin_token),
        None,
    )
    .unwrap();
    assert_eq!(shown.status, 200, "{}", shown.body);
    assert_eq!(
        shown.json()["owner_key_id"],
        key_id.as_str(),
        "{}",
        shown.body
    );
    assert!(!shown.body.contains("DHHC-1"), "{}", shown.body);

    // A plain NVMe/TCP connect as the owner NQN, to every target that
    // exports the volume's extents to it, is refused; with the owner's
    // keys it gets in.
    let sub = host_subsystem_nqn(&issued);
    let exporting: Vec<&Node> = c
        .nodes
        .iter()
        .filter(|n| n.target.subsystem(&sub).is_some())
        .collect();
    let info = c.server.read(&format!("/v1/volumes/{vol}")).json();
    let mut extent_targets: Vec<&str> = info["extents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["target"].as_str().unwrap())
        .collect();
    extent_targets.sort_unstable();
    extent_targets.dedup();
    assert_eq!(exporting.len(), extent_targets.len(), "{info}");
    for n in &exporting {
        let held_here = n.target.subsystem(&sub).unwrap();
        let k = held_here.host_keys.get(&issued).expect("the owner's keys");
        assert_eq!(k.config.key_id.as_deref(), Some(key_id.as_str()));
        let plain = params(n.addr, &sub, &issued);
        assert!(
            Controller::connect(plain.clone()).is_err(),
            "{}: the owner NQN connected without keys",
            n.id
        );
        let mut with = plain;
        with.dhchap = Some(Arc::new(held.policy.keys.clone()));
        Controller::connect(with).unwrap();
    }

    // The owner's engine, holding the keys, serves I/O.
    let ctrl = Controller::connect(params(node_of(c, &owner).addr, &served_nqn, HOST_A)).unwrap();
    let dev = Device::open(ctrl, 1, 1).unwrap();
    let data: Vec<u8> = (0..65536u32).map(|i| (i * 7) as u8).collect();
    block_on(dev.write(4096, data.clone(), false)).0.unwrap();
    let (r, back) = block_on(dev.read(4096, vec![0; data.len()]));
    r.unwrap();
    assert_eq!(back, data);

    // A new owner gets new keys; the old owner's are forgotten with it.
    let r = c.server.admin(
        "PUT",
        &format!("/v1/targets/{owner}/state"),
        Some(json!({ "state": "cordoned" })),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    failover::watch_once(&c.server.cluster).unwrap();
    let now = c.server.read(&format!("/v1/volumes/{vol}/exports")).json();
    assert_eq!(now["owner"], other.as_str(), "{now}");
    assert!(c.server.cluster.host_keys(&issued).unwrap().is_none());
    let new_issued = owner_host_nqn(&id, &other);
    let new_keys = c.server.cluster.host_keys(&new_issued).unwrap().unwrap();
    assert_ne!(new_keys.key_id, key_id);
    let held = node_of(c, &other).target.owner_keys(&served_nqn).unwrap();
    assert_eq!(held.config.key_id, Some(new_keys.key_id.clone()));
    assert!(node_of(c, &owner).target.owner_keys(&served_nqn).is_none());
    let new_sub = host_subsystem_nqn(&new_issued);
    for n in c
        .nodes
        .iter()
        .filter(|n| n.target.subsystem(&new_sub).is_some())
    {
        assert!(
            Controller::connect(params(n.addr, &new_sub, &new_issued)).is_err(),
            "{}: the new owner NQN connected without keys",
            n.id
        );
    }
}

/// A copy job's copier reads the source extent as
/// `nqn.2026-11.io.nvpool:copier:{dest}`, which anyone who reads the
/// cluster's state can learn: the source target makes it authenticate
/// with keys the control plane drew and gave the destination target with
/// the copy, over its admin API only. The copy still completes.
#[test]
fn a_copier_nqn_reaches_no_source_without_its_keys() {
    let c = cluster(2);
    let vol = create(&c.server, 4, MIB, json!({"type": "raid1", "copies": 2}));
    let info = c.server.read(&format!("/v1/volumes/{vol}")).json();
    let (src, dest) = (
        info["extents"][0]["target"].as_str().unwrap().to_owned(),
        info["extents"][1]["target"].as_str().unwrap().to_owned(),
    );
    assert_ne!(src, dest);
    // Something to copy: bytes on the source copy's device range.
    let e0 = &info["extents"][0];
    let src_node = node_of(&c, &src);
    let data: Vec<u8> = (0..MIB as u32).map(|i| (i % 251) as u8).collect();
    {
        use std::io::{Seek, SeekFrom, Write};
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&src_node.device)
            .unwrap();
        f.seek(SeekFrom::Start(e0["offset"].as_u64().unwrap()))
            .unwrap();
        f.write_all(&data).unwrap();
    }
    let r = c
        .server
        .admin("POST", &format!("/v1/volumes/{vol}/extents/1/resync"), None);
    assert_eq!(r.status, 202, "{}", r.body);

    let copier = nvpool_control::resync::copier_nqn(&dest);
    let sub = host_subsystem_nqn(&copier);
    let cfg = nvpool_control::heal::HealConfig::default();
    let mut refused_plain = false;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        nvpool_control::heal::heal_once(&c.server.cluster, &cfg).unwrap();
        if let Some(s) = src_node.target.subsystem(&sub) {
            // The source exports to the copier only with its keys, and a
            // plain connect as the copier is refused.
            let keys = c.server.cluster.host_keys(&copier).unwrap().unwrap();
            let held = s.host_keys.get(&copier).expect("the copier's keys");
            assert_eq!(held.config.key_id, Some(keys.key_id.clone()));
            assert!(keys.dhchap_ctrl_key.is_some(), "bidirectional");
            if !refused_plain {
                assert!(
                    Controller::connect(params(src_node.addr, &sub, &copier)).is_err(),
                    "the copier NQN connected without keys"
                );
                refused_plain = true;
            }
        }
        let info = c.server.read(&format!("/v1/volumes/{vol}")).json();
        if info["failed_extents"] == json!([]) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the copy did not complete: {info}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(refused_plain, "the copier's export was never seen");
    let e1 = &info["extents"][1];
    let copied = read_file_at(
        &node_of(&c, &dest).device,
        e1["offset"].as_u64().unwrap(),
        MIB as usize,
    );
    assert!(copied == data, "the copy differs from its source");
    // No API answer holds a copier's key.
    let r = c.server.read(&format!("/v1/hosts/{}/dhchap", enc(&copier)));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(!r.body.contains("DHHC-1"), "{}", r.body);
}
