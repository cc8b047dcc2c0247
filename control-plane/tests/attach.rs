//! Attach and detach against real targets: one control plane (in process,
//! over HTTP), four `nvpool-target` daemons on loopback with file-backed
//! devices, and the userspace NVMe/TCP host to check what hosts can see.

mod common;

use common::nodes::*;
use common::{MIB, READER};
use nvpool_initiator::exec::block_on;
use nvpool_initiator::{Controller, Device};
use serde_json::{json, Value};

#[test]
fn attach_exports_every_extent_to_that_host_alone() {
    let c = cluster(4);
    let s = &c.server;
    let vol = create(
        s,
        1,
        4 * MIB,
        json!({"type": "raid10", "stripe_bytes": 65536, "width": 2, "copies": 2}),
    );
    let r = attach(s, &vol, HOST_A);
    assert_eq!(r.status, 201, "{}", r.body);
    let a = r.json();
    assert_eq!(a["state"], "attached");
    assert_eq!(a["host_nqn"], HOST_A);
    let plan = &a["plan"];
    assert_eq!(plan["size_bytes"], 4 * MIB);
    assert_eq!(plan["layout"]["type"], "raid10");
    let extents = plan["extents"].as_array().unwrap();
    // 4 MiB over 2 members of 1 MiB extents = 2 rows × 2 members × 2 copies.
    assert_eq!(extents.len(), 8);
    let subsystem = extents[0]["subsystem_nqn"].as_str().unwrap().to_owned();
    assert!(subsystem.starts_with("nqn.2026-11.io.nvpool:host:"));

    // Every target holds the host's subsystem with exactly its extents,
    // visible to host A alone, backed by the right bytes of the device.
    for node in &c.nodes {
        let mine: Vec<&Value> = extents.iter().filter(|e| e["target"] == node.id).collect();
        let subs = node.host_subsystems();
        if mine.is_empty() {
            assert!(subs.is_empty(), "{}: {subs:?}", node.id);
            continue;
        }
        assert_eq!(subs.len(), 1, "{}: {subs:?}", node.id);
        let (nqn, hosts, nsids) = &subs[0];
        assert_eq!(nqn, &subsystem);
        assert_eq!(hosts, &[HOST_A.to_owned()]);
        let mut want: Vec<u32> = mine
            .iter()
            .map(|e| e["nsid"].as_u64().unwrap() as u32)
            .collect();
        want.sort_unstable();
        assert_eq!(nsids, &want, "{}", node.id);
        assert_eq!(mine[0]["addr"], node.addr.to_string());
        let sub = node.target.subsystem(nqn).unwrap();
        for e in &mine {
            let ns = &sub.namespaces[&(e["nsid"].as_u64().unwrap() as u32)];
            assert_eq!(
                ns.spec,
                format!(
                    "file:{},offset={},length={}",
                    node.device.display(),
                    e["offset"],
                    e["length"]
                )
            );
        }
    }

    // The host it was attached to connects and its writes land in the
    // extent's bytes of the device; another host is refused.
    let e0 = &extents[0];
    let node = node_of(&c, e0["target"].as_str().unwrap());
    let nsid = e0["nsid"].as_u64().unwrap() as u32;
    let ctrl = Controller::connect(params(node.addr, &subsystem, HOST_A)).unwrap();
    let info = ctrl.namespace(nsid).unwrap();
    assert_eq!(info.size_bytes(), MIB);
    let dev = Device::open(ctrl.clone(), nsid, 1).unwrap();
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 3) as u8).collect();
    let (r, _) = block_on(dev.write(4096, data.clone(), true));
    r.unwrap();
    let on_disk = read_file_at(&node.device, e0["offset"].as_u64().unwrap() + 4096, 8192);
    assert_eq!(on_disk, data);
    drop(dev);
    ctrl.shutdown();
    assert!(
        Controller::connect(params(node.addr, &subsystem, HOST_B)).is_err(),
        "host B must be refused"
    );

    // Attaching again is idempotent: the same plan, 200.
    let again = attach(s, &vol, HOST_A);
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.json()["plan"], a["plan"]);
    let listed = s.read(&format!("/v1/volumes/{vol}")).json();
    assert_eq!(listed["attachments"], json!([HOST_A]));
}

#[test]
fn a_second_volume_shares_the_host_subsystem_and_appears_to_a_connected_host() {
    let c = cluster(3);
    let s = &c.server;
    let v1 = create(s, 1, 2 * MIB, json!({"type": "raid1", "copies": 3}));
    let p1 = attach(s, &v1, HOST_A).json()["plan"].clone();
    let e = &p1["extents"][0];
    let node = node_of(&c, e["target"].as_str().unwrap());
    let subsystem = e["subsystem_nqn"].as_str().unwrap().to_owned();
    let ctrl = Controller::connect(params(node.addr, &subsystem, HOST_A)).unwrap();

    let v2 = create(s, 2, 2 * MIB, json!({"type": "raid1", "copies": 3}));
    let p2 = attach(s, &v2, HOST_A).json()["plan"].clone();
    // Same subsystem on each target (connections grow with targets, not
    // volumes), fresh NSIDs.
    let nsids = |p: &Value, target: &str| -> Vec<u64> {
        p["extents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["target"] == target)
            .map(|e| e["nsid"].as_u64().unwrap())
            .collect()
    };
    for n in &c.nodes {
        let (a, b) = (nsids(&p1, &n.id), nsids(&p2, &n.id));
        assert_eq!(a.len(), 2);
        assert_eq!(b.len(), 2);
        assert!(a.iter().all(|x| !b.contains(x)), "{a:?} vs {b:?}");
        assert_eq!(n.host_subsystems().len(), 1);
        assert_eq!(n.host_subsystems()[0].2.len(), 4);
    }
    for e in p2["extents"].as_array().unwrap() {
        assert_eq!(e["subsystem_nqn"], subsystem.as_str());
    }
    // The already-connected controller sees the new namespace.
    let new_nsid = nsids(&p2, &node.id)[0] as u32;
    assert_eq!(ctrl.namespace(new_nsid).unwrap().size_bytes(), MIB);
    ctrl.shutdown();

    // Detaching one volume keeps the subsystem for the other.
    let r = detach(s, &v1, HOST_A, false);
    assert_eq!(r.status, 204, "{}", r.body);
    for n in &c.nodes {
        let subs = n.host_subsystems();
        assert_eq!(subs.len(), 1);
        let left: Vec<u64> = subs[0].2.iter().map(|&x| u64::from(x)).collect();
        assert_eq!(left, nsids(&p2, &n.id));
    }
    // Detaching the last removes it.
    assert_eq!(detach(s, &v2, HOST_A, false).status, 204);
    for n in &c.nodes {
        assert!(n.host_subsystems().is_empty(), "{}", n.id);
    }
    let r = detach(s, &v2, HOST_A, false);
    s.expect_error(&r, 404, "not_found");
}

#[test]
fn attached_volumes_are_not_deleted_without_force() {
    let c = cluster(2);
    let s = &c.server;
    let vol = create(
        s,
        1,
        2 * MIB,
        json!({"type": "raid0", "stripe_bytes": 65536, "width": 2}),
    );
    assert_eq!(attach(s, &vol, HOST_A).status, 201);
    assert_eq!(attach(s, &vol, HOST_B).status, 201);
    let r = s.admin("DELETE", &format!("/v1/volumes/{vol}"), None);
    s.expect_error(&r, 409, "attached");
    assert_eq!(r.json()["details"]["hosts"].as_array().unwrap().len(), 2);
    let r = s.admin("DELETE", &format!("/v1/volumes/{vol}?force=maybe"), None);
    s.expect_error(&r, 400, "invalid");
    let r = s.admin("DELETE", &format!("/v1/volumes/{vol}?force=true"), None);
    assert_eq!(r.status, 204, "{}", r.body);
    for n in &c.nodes {
        assert!(n.host_subsystems().is_empty(), "{}", n.id);
    }
    let cap = s.read("/v1/targets").json();
    for t in cap.as_array().unwrap() {
        assert_eq!(t["capacity"]["used_bytes"], 0, "{t}");
    }
}

/// A forced delete while other clients attach and detach the volume: it
/// deletes (204), never answering 404 for a volume that exists because a
/// host it meant to detach was detached by someone else first.
#[test]
fn a_forced_delete_racing_attach_and_detach_deletes() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let c = cluster(2);
    let s = &c.server;
    for n in 1..=3u8 {
        let vol = create(s, n, 2 * MIB, json!({"type": "raid1", "copies": 2}));
        let stop = AtomicBool::new(false);
        std::thread::scope(|scope| {
            for host in [HOST_A, HOST_B] {
                let (vol, stop) = (&vol, &stop);
                scope.spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let _ = attach(s, vol, host);
                        let _ = detach(s, vol, host, false);
                    }
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
            let r = s.admin("DELETE", &format!("/v1/volumes/{vol}?force=true"), None);
            stop.store(true, Ordering::Relaxed);
            assert_eq!(r.status, 204, "round {n}: {}", r.body);
        });
        s.expect_error(&s.read(&format!("/v1/volumes/{vol}")), 404, "not_found");
    }
}

#[test]
fn a_refusing_target_rolls_the_whole_attach_back() {
    let mut c = cluster(3);
    let vol = create(
        &c.server,
        1,
        3 * MIB,
        json!({"type": "raid0", "stripe_bytes": 65536, "width": 3}),
    );
    // One target's admin API goes away (the daemon stops).
    c.nodes[2].stop();
    let r = attach(&c.server, &vol, HOST_A);
    c.server.expect_error(&r, 503, "target_unreachable");
    assert_eq!(r.json()["details"]["target"], "t2");
    // Nothing is left on the targets that accepted, nor in the records.
    for n in &c.nodes[..2] {
        assert!(n.host_subsystems().is_empty(), "{}", n.id);
    }
    let r = c.server.read(&format!("/v1/volumes/{vol}/attachments"));
    assert_eq!(r.json(), json!([]));
    assert_eq!(c.server.cluster.check().unwrap(), Vec::<String>::new());
    // With the target back, the same attach succeeds.
    c.nodes[2].restart();
    let r = attach(&c.server, &vol, HOST_A);
    assert_eq!(r.status, 201, "{}", r.body);
}

#[test]
fn forced_detach_keeps_extents_until_the_target_is_reconciled() {
    let mut c = cluster(2);
    let vol = create(&c.server, 1, MIB, json!({"type": "raid1", "copies": 2}));
    assert_eq!(attach(&c.server, &vol, HOST_A).status, 201);
    c.nodes[1].stop();
    // Without force, an unreachable target fails the detach and the
    // attachment stays (detaching).
    let r = detach(&c.server, &vol, HOST_A, false);
    c.server.expect_error(&r, 503, "target_unreachable");
    let r = c
        .server
        .read(&format!("/v1/volumes/{vol}/attachments/{}", enc(HOST_A)));
    assert_eq!(r.json()["state"], "detaching");
    // Forced: gone from the records, and the volume can be deleted...
    assert_eq!(detach(&c.server, &vol, HOST_A, true).status, 204);
    assert!(c.nodes[0].host_subsystems().is_empty());
    let r = c
        .server
        .admin("DELETE", &format!("/v1/volumes/{vol}"), None);
    assert_eq!(r.status, 204, "{}", r.body);
    // ...but the extent t1 may still export stays allocated.
    let used = |c: &Cluster, id: &str| -> u64 {
        let t = c.server.read(&format!("/v1/targets/{id}")).json();
        t["capacity"]["used_bytes"].as_u64().unwrap()
    };
    assert_eq!(used(&c, "t0"), 0);
    assert_eq!(used(&c, "t1"), MIB);
    // The target comes back with its saved state (still exporting), and
    // reconciliation removes the export and frees the extent.
    c.nodes[1].restart();
    assert_eq!(c.nodes[1].host_subsystems().len(), 1);
    let r = c.server.admin("POST", "/v1/targets/t1/reconcile", None);
    assert_eq!(r.status, 200, "{}", r.body);
    let out = r.json();
    assert_eq!(out["subsystems_removed"], 1);
    assert_eq!(out["stale_cleared"], true);
    assert!(c.nodes[1].host_subsystems().is_empty());
    assert_eq!(used(&c, "t1"), 0);
}

#[test]
fn reconcile_restores_lost_exports_and_drops_unknown_ones() {
    let mut c = cluster(2);
    let vol = create(&c.server, 1, MIB, json!({"type": "raid1", "copies": 2}));
    let plan = attach(&c.server, &vol, HOST_A).json()["plan"].clone();
    let subsystem = plan["extents"][0]["subsystem_nqn"]
        .as_str()
        .unwrap()
        .to_owned();
    // The target loses its state (a rebuilt node)...
    c.nodes[0].stop();
    std::fs::remove_dir_all(&c.nodes[0].state_dir).unwrap();
    std::fs::create_dir_all(&c.nodes[0].state_dir).unwrap();
    c.nodes[0].restart();
    assert!(c.nodes[0].host_subsystems().is_empty());
    // ...and another one gained an export nobody recorded.
    let stray = "nqn.2026-11.io.nvpool:host:00000000000000000000000000000000";
    let node1 = &c.nodes[1];
    node1
        .target
        .put_subsystem(&nvpool_target::config::SubsystemConfig {
            nqn: stray.into(),
            allowed_hosts: vec![HOST_B.into()],
            allow_any_host: false,
            host_keys: Default::default(),
            serial: None,
            model: None,
            ana: None,
            namespaces: vec![],
        })
        .unwrap();
    for (i, n) in c.nodes.iter().enumerate() {
        let r = c
            .server
            .admin("POST", &format!("/v1/targets/{}/reconcile", n.id), None);
        assert_eq!(r.status, 200, "{i}: {}", r.body);
    }
    for n in &c.nodes {
        let subs = n.host_subsystems();
        assert_eq!(subs.len(), 1, "{}: {subs:?}", n.id);
        assert_eq!(subs[0].0, subsystem);
        assert_eq!(subs[0].1, [HOST_A.to_owned()]);
    }
}

#[test]
fn a_target_going_offline_degrades_its_volumes() {
    let c = cluster(2);
    let s = &c.server;
    let vol = create(s, 1, MIB, json!({"type": "raid1", "copies": 2}));
    let status = || s.read(&format!("/v1/volumes/{vol}")).json()["status"].clone();
    assert_eq!(status(), "online");
    // t0 keeps heartbeating, t1 falls silent past the timeout.
    s.clock.advance(10_000);
    assert_eq!(s.admin("PUT", "/v1/targets/t0/heartbeat", None).status, 200);
    s.clock.advance(10_000);
    assert_eq!(status(), "degraded");
    let metrics = s.read("/metrics").body;
    assert!(
        metrics.contains("nvpool_target_up{target=\"t1\"} 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("nvpool_volumes{status=\"degraded\"} 1"),
        "{metrics}"
    );
    // Both silent: offline.
    s.clock.advance(20_000);
    assert_eq!(status(), "offline");
}

#[test]
fn bad_attach_requests_get_4xx() {
    let c = cluster(2);
    let s = &c.server;
    let vol = create(s, 1, MIB, json!({"type": "raid1", "copies": 2}));
    let r = attach(s, &vol, "not-an-nqn");
    s.expect_error(&r, 400, "invalid");
    let r = attach(s, &uuid(9), HOST_A);
    s.expect_error(&r, 404, "not_found");
    let r = s.call(
        "PUT",
        &format!("/v1/volumes/{vol}/attachments/{}", enc(HOST_A)),
        None,
        None,
    );
    s.expect_error(&r, 401, "unauthorized");
    let r = s.read(&format!("/v1/volumes/{vol}/attachments/{}", enc(HOST_A)));
    s.expect_error(&r, 404, "not_found");
    for n in &c.nodes {
        assert!(n.host_subsystems().is_empty());
    }
}

#[test]
fn failed_extents_reported_by_a_host_degrade_the_volume_and_stick() {
    let c = cluster(2);
    let s = &c.server;
    let vol = create(s, 1, 2 * MIB, json!({"type": "raid1", "copies": 2}));
    assert_eq!(attach(s, &vol, HOST_A).status, 201);
    let path = format!(
        "/v1/volumes/{vol}/attachments/{}/failed-extents",
        enc(HOST_A)
    );
    let r = s.admin("PUT", &path, Some(json!({"failed_extents": [9]})));
    s.expect_error(&r, 400, "invalid");
    let r = s.admin("PUT", &path, Some(json!({"failed_extents": [1]})));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["failed_extents"], json!([1]));
    let status = || s.read(&format!("/v1/volumes/{vol}")).json()["status"].clone();
    assert_eq!(status(), "degraded");
    // Both copies of row 0 failed: offline.
    let r = s.admin("PUT", &path, Some(json!({"failed_extents": [0]})));
    assert_eq!(r.json()["failed_extents"], json!([0, 1]));
    assert_eq!(status(), "offline");
    // A later attach (a restarted host) is told which copies are stale.
    let r = attach(s, &vol, HOST_A);
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["failed_extents"], json!([0, 1]));
}

#[test]
fn failed_copies_outlive_detach_and_reach_every_later_attach() {
    let c = cluster(2);
    let s = &c.server;
    let vol = create(s, 1, 2 * MIB, json!({"type": "raid1", "copies": 2}));
    let status = || s.read(&format!("/v1/volumes/{vol}")).json()["status"].clone();
    assert_eq!(attach(s, &vol, HOST_A).status, 201);
    let path = format!(
        "/v1/volumes/{vol}/attachments/{}/failed-extents",
        enc(HOST_A)
    );
    let r = s.admin("PUT", &path, Some(json!({"failed_extents": [1]})));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(detach(s, &vol, HOST_A, false).status, 204);
    // The copy missed writes whoever attaches next: still degraded with
    // nobody attached, and both hosts are told not to read it.
    assert_eq!(status(), "degraded");
    let r = s.read(&format!("/v1/volumes/{vol}"));
    assert_eq!(r.json()["failed_extents"], json!([1]));
    let listed = s.read("/v1/volumes").json();
    let me = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["uuid"] == json!(vol))
        .unwrap()
        .clone();
    assert_eq!(me["status"], "degraded");
    let r = attach(s, &vol, HOST_B);
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["failed_extents"], json!([1]));
    let r = attach(s, &vol, HOST_A);
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["failed_extents"], json!([1]));
    // Another host's report adds to the same record.
    let path_b = format!(
        "/v1/volumes/{vol}/attachments/{}/failed-extents",
        enc(HOST_B)
    );
    let r = s.admin("PUT", &path_b, Some(json!({"failed_extents": [0]})));
    assert_eq!(r.json()["failed_extents"], json!([0, 1]));
    assert_eq!(detach(s, &vol, HOST_A, false).status, 204);
    assert_eq!(detach(s, &vol, HOST_B, false).status, 204);
    assert_eq!(status(), "offline");
    // Deleting the volume takes its record along.
    let r = s.admin("DELETE", &format!("/v1/volumes/{vol}"), None);
    assert_eq!(r.status, 204, "{}", r.body);
    assert!(s.cluster.snapshot().unwrap().failed_copies.is_empty());
}

/// Rewrites target `id`'s record in the store so that it points at
/// `daemon`'s admin API and holds `daemon`'s token, as an old record can
/// when a target re-registered under another ID from the same address
/// (which registration no longer accepts, so the store is written directly).
fn point_record_at(c: &Cluster, id: &str, daemon: &Node) {
    use nvpool_control::model::encode;
    use nvpool_control::rest::Secret;
    use nvpool_control::state::{keys, TargetCredential};
    use nvpool_control::store::{Condition, Op, TxnOutcome};
    let store = c.server.cluster.store();
    let key = keys::target(id);
    let kv = store.get(&key).unwrap().unwrap();
    let mut t = c.server.cluster.target(id).unwrap().target;
    t.admin_addr = daemon.admin;
    let credential = TargetCredential {
        target: id.to_owned(),
        admin_token: Secret::new(daemon.admin_token.clone()).unwrap(),
    };
    let ops = [
        Op::Put(key.clone(), encode(&t)),
        Op::Put(keys::target_credential(id), encode(&credential)),
    ];
    let done = store
        .txn(&[Condition::VersionIs(key, kv.version)], &ops)
        .unwrap();
    assert!(matches!(done, TxnOutcome::Committed { .. }), "{done:?}");
}

/// A target's record whose admin address another live target's daemon
/// holds (with that daemon's token) must not make the control plane change
/// anything on that daemon: reconciliation and detach ask the daemon who
/// it is first, remove nothing, and fail with 409 wrong_target.
#[test]
fn a_record_pointing_at_another_daemon_removes_nothing_there() {
    let c = cluster(2);
    let s = &c.server;
    // One single-extent volume on each target, both attached to host A.
    let v1 = create(s, 1, MIB, json!({"type": "concat"}));
    let v2 = create(s, 2, MIB, json!({"type": "concat"}));
    for v in [&v1, &v2] {
        let r = attach(s, v, HOST_A);
        assert_eq!(r.status, 201, "{}", r.body);
    }
    let target_of = |v: &str| {
        s.call("GET", &format!("/v1/volumes/{v}"), Some(READER), None)
            .json()["extents"][0]["target"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let (t1, t2) = (target_of(&v1), target_of(&v2));
    assert_ne!(t1, t2, "placement spreads the two volumes");
    let (live, other) = (node_of(&c, &t1), node_of(&c, &t2));
    let live_before = live.host_subsystems();
    let other_before = other.host_subsystems();
    assert!(!live_before.is_empty() && !other_before.is_empty());

    point_record_at(&c, &t2, live);

    // Reconciling the misdirected record would remove v1's namespace from
    // the live daemon (the record wants only v2's there).
    let r = s.admin("POST", &format!("/v1/targets/{t2}/reconcile"), None);
    s.expect_error(&r, 409, "wrong_target");
    let d = &r.json()["details"];
    assert_eq!(d["target"], t2.as_str(), "{d}");
    assert_eq!(d["found"], t1.as_str(), "{d}");
    assert_eq!(d["admin_addr"], live.admin.to_string(), "{d}");
    assert!(r.json()["message"]
        .as_str()
        .unwrap()
        .contains("nothing was changed"));
    // Detaching v2 would remove its NSID from the live daemon, where it may
    // name one of v1's namespaces.
    let r = detach(s, &v2, HOST_A, false);
    s.expect_error(&r, 409, "wrong_target");
    // The periodic reconciliation too.
    assert!(matches!(
        nvpool_control::program::reconcile(&s.cluster, &t2),
        Err(nvpool_control::program::ProgramError::WrongTarget { .. })
    ));
    assert_eq!(
        live.host_subsystems(),
        live_before,
        "the live daemon was changed"
    );
    assert_eq!(other.host_subsystems(), other_before);
    // v1 still reads through the live daemon; the live target's own record
    // still works.
    let r = s.admin("POST", &format!("/v1/targets/{t1}/reconcile"), None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(live.host_subsystems(), live_before);
}

/// The reported bug: a second registration (another ID) with a live
/// target's admin address was accepted, and the next reconciliation of
/// that record removed the live target's host subsystems, which the new
/// record did not want. Now the registration is refused (409, naming the
/// live target) in its own transaction, and nothing changes on the target.
#[test]
fn a_second_record_with_a_live_targets_admin_address_is_refused() {
    let c = cluster(2);
    let s = &c.server;
    let vol = create(s, 1, MIB, json!({"type": "raid1", "copies": 2}));
    let r = attach(s, &vol, HOST_A);
    assert_eq!(r.status, 201, "{}", r.body);
    let live = &c.nodes[0];
    let before = live.host_subsystems();
    assert!(!before.is_empty());
    let mut second = live.registration("r9");
    second["id"] = json!("t9");
    second["name"] = json!("t9");
    second["addr"] = json!("127.0.0.1:9");
    second["devices"] = json!([]);
    let r = s.admin("POST", "/v1/targets", Some(second));
    s.expect_error(&r, 409, "address_taken");
    let j = r.json();
    assert_eq!(j["details"]["target"], live.id.as_str(), "{j}");
    assert_eq!(j["details"]["field"], "admin_addr", "{j}");
    let r = s.call("GET", "/v1/targets/t9", Some(READER), None);
    assert_eq!(r.status, 404, "{}", r.body);
    // What reconciliation there is leaves the live target as it was.
    for n in &c.nodes {
        let r = s.admin("POST", &format!("/v1/targets/{}/reconcile", n.id), None);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let r = s.admin("POST", "/v1/targets/t9/reconcile", None);
    s.expect_error(&r, 404, "not_found");
    assert_eq!(live.host_subsystems(), before);
    assert!(s.cluster.check().unwrap().is_empty());
}
