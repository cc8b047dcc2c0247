//! Volumes served by targets (C19) against real targets in process: the
//! export gives two paths with one owner, the owner runs the volume engine
//! and serves a host, and ownership moves — planned (drain) and after the
//! owner is cut off — with the old owner fenced: it cannot complete a
//! write afterwards and the data read back is the new owner's.

mod common;

use common::nodes::*;
use common::MIB;
use nvpool_control::attach::host_subsystem_nqn;
use nvpool_control::failover;
use nvpool_control::paths::{owner_host_nqn, volume_subsystem_nqn};
use nvpool_control::Uuid;
use nvpool_initiator::exec::block_on;
use nvpool_initiator::{Controller, Device, IoError};
use nvpool_target::register::{ControlPlaneUrl, RegistrationConfig};
use nvpool_target::served::{ControlPlaneSource, LeaseKeeper};
use nvpool_testkit::{pattern, wait_for};
use nvpool_wire::Status;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

/// The cluster with every target able to own served volumes: a volume
/// source and a lease keeper talking to the test's control plane.
struct Served {
    c: Cluster,
    keepers: Vec<Option<LeaseKeeper>>,
}

fn registration(c: &Cluster, n: &Node) -> RegistrationConfig {
    let url = ControlPlaneUrl::parse(&format!("http://{}", c.server.addr)).unwrap();
    let mut rc = RegistrationConfig::new(url, n.id.clone(), n.id.clone(), n.addr, n.admin);
    rc.token = Some(common::ADMIN.into());
    rc
}

fn served_cluster() -> Served {
    let c = cluster(4);
    let mut keepers = Vec::new();
    for n in &c.nodes {
        let rc = registration(&c, n);
        n.target
            .set_volume_source(Arc::new(ControlPlaneSource::new(rc.clone(), &n.target)));
        keepers.push(Some(LeaseKeeper::start(rc, n.target.clone()).unwrap()));
    }
    Served { c, keepers }
}

fn export(c: &Cluster, vol: &str, host: &str) -> common::Reply {
    c.server.admin(
        "PUT",
        &format!("/v1/volumes/{vol}/exports/{}", enc(host)),
        Some(json!({"paths": 2})),
    )
}

fn view(c: &Cluster, vol: &str) -> Value {
    let r = c.server.read(&format!("/v1/volumes/{vol}/exports"));
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

/// `GET /v1/volumes/{vol}`.
fn volume_info(c: &Cluster, vol: &str) -> Value {
    c.server.read(&format!("/v1/volumes/{vol}")).json()
}

fn connect(n: &Node, vol: &str) -> (Arc<Controller>, Device) {
    let uuid: Uuid = vol.parse().unwrap();
    let ctrl = Controller::connect(params(n.addr, &volume_subsystem_nqn(&uuid), HOST_A)).unwrap();
    let dev = Device::open(ctrl.clone(), 1, 1).unwrap();
    (ctrl, dev)
}

fn write(dev: &Device, off: u64, data: &[u8]) -> Result<(), IoError> {
    block_on(dev.write(off, data.to_vec(), false)).0
}

fn read(dev: &Device, off: u64, len: usize) -> Result<Vec<u8>, IoError> {
    let (r, buf) = block_on(dev.read(off, vec![0; len]));
    r.map(|()| buf)
}

fn is_path_error(r: &Result<(), IoError>) -> bool {
    matches!(r, Err(IoError::Status(s)) if s.is_path_error())
}

/// A RAID10 volume over the four targets, exported to HOST_A; returns
/// (volume, owner, other path).
fn served_volume(s: &Served) -> (String, String, String) {
    let vol = create(
        &s.c.server,
        1,
        2 * MIB,
        json!({"type": "raid10", "width": 2, "stripe_bytes": 65536, "copies": 2}),
    );
    let r = export(&s.c, &vol, HOST_A);
    assert_eq!(r.status, 201, "{}", r.body);
    let v = r.json();
    assert_eq!(v["paths"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v["serving"], true, "{v}");
    let (owner, other) = owner_and_other(&v);
    // Exporting again is idempotent.
    let again = export(&s.c, &vol, HOST_A);
    assert_eq!(again.status, 200, "{}", again.body);
    (vol, owner, other)
}

#[test]
fn the_owner_serves_and_the_other_path_refuses_with_a_path_error() {
    let s = served_cluster();
    let (vol, owner, other) = served_volume(&s);
    let (_c1, dev) = connect(node_of(&s.c, &owner), &vol);
    assert_eq!(dev.size(), 2 * MIB);
    let data = pattern(1, 128 << 10);
    // Across the stripe and row boundaries.
    for off in [0, MIB - (64 << 10), 2 * MIB - (128 << 10)] {
        write(&dev, off, &data).unwrap();
        assert_eq!(read(&dev, off, data.len()).unwrap(), data);
    }
    // The other path has the namespace (same size) but serves nothing.
    let (_c2, dev2) = connect(node_of(&s.c, &other), &vol);
    assert_eq!(dev2.size(), 2 * MIB);
    let r = write(&dev2, 0, &data);
    assert!(
        matches!(r, Err(IoError::Status(st)) if st == Status::ANA_INACCESSIBLE),
        "{r:?}"
    );
    // Unexport: the subsystem goes from both paths and the owner lets go.
    let r = s.c.server.admin(
        "DELETE",
        &format!("/v1/volumes/{vol}/exports/{}", enc(HOST_A)),
        None,
    );
    assert_eq!(r.status, 204, "{}", r.body);
    let uuid: Uuid = vol.parse().unwrap();
    for n in &s.c.nodes {
        assert!(n.target.subsystem(&volume_subsystem_nqn(&uuid)).is_none());
        assert!(n
            .target
            .subsystem(&host_subsystem_nqn(&owner_host_nqn(&uuid, &owner)))
            .is_none());
    }
    let r = s.c.server.read(&format!("/v1/volumes/{vol}/exports"));
    assert_eq!(r.status, 404, "{}", r.body);
}

#[test]
fn a_drained_owner_hands_over_without_losing_a_write() {
    hand_over_when_the_owner_is("draining");
}

/// Before maintenance (an upgrade): cordoning the owner moves its volumes.
#[test]
fn a_cordoned_owner_hands_over_without_losing_a_write() {
    hand_over_when_the_owner_is("cordoned");
}

fn hand_over_when_the_owner_is(state: &str) {
    let s = served_cluster();
    let (vol, owner, other) = served_volume(&s);
    let (_c1, dev) = connect(node_of(&s.c, &owner), &vol);
    let data = pattern(2, 64 << 10);
    write(&dev, 4096, &data).unwrap();
    let r = s.c.server.admin(
        "PUT",
        &format!("/v1/targets/{owner}/state"),
        Some(json!({ "state": state })),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    failover::watch_once(&s.c.server.cluster).unwrap();
    let v = view(&s.c, &vol);
    assert_eq!(v["owner"], other.as_str(), "{v}");
    assert_eq!(v["serving"], true, "{v}");
    // Planned: every copy was fenced cleanly, none is stale.
    let info = volume_info(&s.c, &vol);
    assert_eq!(info["failed_extents"], json!([]), "{info}");
    // The old owner answers with a path error; the new one has the data.
    assert!(is_path_error(&write(&dev, 0, &data)));
    let (_c2, dev2) = connect(node_of(&s.c, &other), &vol);
    wait_for("the new owner's lease", Duration::from_secs(10), || {
        read(&dev2, 4096, data.len()).is_ok()
    });
    assert_eq!(read(&dev2, 4096, data.len()).unwrap(), data);
}

#[test]
fn a_cut_off_owner_is_fenced_and_its_writes_fail() {
    let mut s = served_cluster();
    let (vol, owner, other) = served_volume(&s);
    let uuid: Uuid = vol.parse().unwrap();
    let oi = s.c.nodes.iter().position(|n| n.id == owner).unwrap();
    let (_c1, dev) = connect(&s.c.nodes[oi], &vol);
    let first = pattern(3, 64 << 10);
    write(&dev, 0, &first).unwrap();

    // Cut the owner off the control plane: no more lease renewals, and its
    // admin API is unreachable (registered at a port nothing listens on).
    s.keepers[oi] = None;
    let mut reg = s.c.nodes[oi].registration(&format!("r{oi}"));
    reg["admin_addr"] = json!("127.0.0.1:9");
    assert_eq!(
        s.c.server.admin("POST", "/v1/targets", Some(reg)).status,
        200
    );
    // Its own lease runs out: it stops serving by itself.
    wait_for(
        "the owner's lease to run out",
        Duration::from_secs(15),
        || is_path_error(&write(&dev, 0, &first)),
    );

    // The control plane sees the lease gone and moves the volume.
    s.c.server.clock.advance(10_000);
    failover::watch_once(&s.c.server.cluster).unwrap();
    let v = view(&s.c, &vol);
    assert_eq!(v["owner"], other.as_str(), "{v}");
    assert_eq!(v["serving"], true, "{v}");
    // The copies on the owner could not be fenced: stale, never read.
    let info = volume_info(&s.c, &vol);
    let extents = info["extents"].as_array().unwrap();
    let on_owner: Vec<u64> = (0..extents.len() as u64)
        .filter(|&i| extents[i as usize]["target"] == owner.as_str())
        .collect();
    assert!(!on_owner.is_empty());
    assert_eq!(info["failed_extents"], json!(on_owner), "{info}");
    // Every other backing target fenced it: its subsystem there is gone, so
    // nothing it still sends can land.
    let fenced = host_subsystem_nqn(&owner_host_nqn(&uuid, &owner));
    for n in s.c.nodes.iter().filter(|n| n.id != owner) {
        assert!(
            n.target.subsystem(&fenced).is_none(),
            "{} still exports to the old owner",
            n.id
        );
    }

    // The old owner comes back with its old beliefs: it still cannot write.
    assert!(is_path_error(&write(&dev, 0, &pattern(4, 64 << 10))));
    // The new owner serves what was written, and takes new writes.
    let (_c2, dev2) = connect(node_of(&s.c, &other), &vol);
    wait_for("the new owner's lease", Duration::from_secs(10), || {
        read(&dev2, 0, 4096).is_ok()
    });
    assert_eq!(read(&dev2, 0, first.len()).unwrap(), first);
    let second = pattern(5, 64 << 10);
    write(&dev2, 0, &second).unwrap();
    assert!(is_path_error(&write(&dev, 0, &first)));
    assert_eq!(read(&dev2, 0, second.len()).unwrap(), second);
}

#[test]
fn a_served_volume_is_deleted_only_by_force_which_unexports_it() {
    let s = served_cluster();
    let (vol, _, _) = served_volume(&s);
    let srv = &s.c.server;
    let r = srv.admin("DELETE", &format!("/v1/volumes/{vol}"), None);
    assert_eq!(r.status, 409, "{}", r.body);
    let r = srv.admin(
        "POST",
        &format!("/v1/volumes/{vol}/resize"),
        Some(json!({"size_bytes": 4 * MIB})),
    );
    assert_eq!(r.status, 409, "growing a served volume: {}", r.body);
    let r = srv.admin("DELETE", &format!("/v1/volumes/{vol}?force=true"), None);
    assert_eq!(r.status, 204, "{}", r.body);
    let uuid: Uuid = vol.parse().unwrap();
    assert!(srv.cluster.served(&uuid).unwrap().is_none());
    for n in &s.c.nodes {
        assert!(n.target.subsystem(&volume_subsystem_nqn(&uuid)).is_none());
    }
}

#[test]
fn bad_export_requests_get_a_4xx() {
    let s = served_cluster();
    let vol = create(
        &s.c.server,
        2,
        2 * MIB,
        json!({"type": "raid1", "copies": 2}),
    );
    let srv = &s.c.server;
    let check = |r: common::Reply, status: u16, kind: &str| {
        assert_eq!(r.status, status, "{}", r.body);
        srv.expect_error(&r, status, kind);
    };
    let path = |h: &str| format!("/v1/volumes/{vol}/exports/{}", enc(h));
    check(
        srv.admin("PUT", &path(HOST_A), Some(json!({"paths": 0}))),
        400,
        "invalid",
    );
    check(
        srv.admin("PUT", &path(HOST_A), Some(json!({"paths": 99}))),
        400,
        "invalid",
    );
    check(
        srv.admin("PUT", &path(HOST_A), Some(json!({"bogus": 1}))),
        400,
        "invalid",
    );
    check(srv.admin("PUT", &path("not-an-nqn"), None), 400, "invalid");
    let id: Uuid = vol.parse().unwrap();
    check(
        srv.admin("PUT", &path(&owner_host_nqn(&id, "t0")), None),
        400,
        "invalid",
    );
    let missing = uuid(9);
    check(
        srv.admin(
            "PUT",
            &format!("/v1/volumes/{missing}/exports/{}", enc(HOST_A)),
            None,
        ),
        404,
        "not_found",
    );
    check(srv.admin("DELETE", &path(HOST_B), None), 404, "not_found");
    // Nothing was recorded by the refused calls.
    assert_eq!(srv.read(&format!("/v1/volumes/{vol}/exports")).status, 404);
    // Without the admin token: 401.
    let r = srv.raw("PUT", &path(HOST_A), None, None);
    assert_eq!(r.status, 401, "{}", r.body);
}

#[test]
fn a_served_volume_makes_a_host_with_keys_authenticate_on_every_path() {
    use nvpool_wire::dhchap::{Keys, Secret};
    let s = served_cluster();
    let keys = Keys {
        host: Secret::new(&[0x42; 32], None).unwrap(),
        ctrl: Some(Secret::new(&[0x24; 48], None).unwrap()),
    };
    let r = s.c.server.admin(
        "PUT",
        &format!("/v1/hosts/{}/dhchap", enc(HOST_A)),
        Some(json!({
            "dhchap_key": keys.host.to_dhhc(),
            "dhchap_ctrl_key": keys.ctrl.as_ref().unwrap().to_dhhc(),
        })),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let key_id = r.json()["key_id"].as_str().unwrap().to_owned();
    let (vol, owner, other) = served_volume(&s);
    let uuid: Uuid = vol.parse().unwrap();
    let nqn = volume_subsystem_nqn(&uuid);
    for t in [&owner, &other] {
        let sub = node_of(&s.c, t).target.subsystem(&nqn).unwrap();
        let held = sub.host_keys.get(HOST_A).map(|a| a.config.key_id.clone());
        assert_eq!(held, Some(Some(key_id.clone())), "{t}");
    }
    let n = node_of(&s.c, &owner);
    let plain = params(n.addr, &nqn, HOST_A);
    assert!(
        Controller::connect(plain.clone()).is_err(),
        "a host without its keys connected"
    );
    let mut with = plain;
    with.dhchap = Some(Arc::new(keys));
    let ctrl = Controller::connect(with).unwrap();
    let dev = Device::open(ctrl, 1, 1).unwrap();
    let data = pattern(7, 64 << 10);
    write(&dev, 0, &data).unwrap();
    assert_eq!(read(&dev, 0, data.len()).unwrap(), data);
    // Reconciling the path again changes nothing: the keys match.
    let r =
        s.c.server
            .admin("POST", &format!("/v1/targets/{owner}/reconcile"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    write(&dev, 4096, &data[..4096]).unwrap();
}
