//! Snapshots and clones of thin volumes (issue 27, T5/T6): the control
//! plane in process over HTTP, the targets stand-ins for the admin API
//! that record what they are asked and can be told to refuse.

mod common;

use common::fake::{thin_cluster, volume_uuid, FakeTarget};
use common::{Server, ADMIN, MIB, READER};
use nvpool_control::limits::SNAPSHOT_ABANDONED_MS;
use nvpool_control::Uuid;
use serde_json::{json, Value};
use std::collections::BTreeSet;

const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000001";
const HOST_TOKEN: &str = "host-secret-0123456789";

fn cluster() -> (Server, Vec<FakeTarget>) {
    thin_cluster(&[(HOST, HOST_TOKEN)])
}

fn uuid(n: u8) -> String {
    volume_uuid(n)
}

/// A 3-copy mirror of `size` bytes: one extent per target.
fn create(s: &Server, n: u8, size: u64, provisioning: &str) -> Value {
    let body = json!({"name": format!("vol{n}"), "size_bytes": size,
                      "layout": {"type": "raid1", "copies": 3}, "provisioning": provisioning});
    let r = s.admin("PUT", &format!("/v1/volumes/{}", uuid(n)), Some(body));
    assert_eq!(r.status, 201, "{}", r.body);
    r.json()
}

fn snap(s: &Server, n: u8, name: &str) -> common::Reply {
    let path = format!("/v1/volumes/{}/snapshots", uuid(n));
    s.admin("POST", &path, Some(json!({"name": name})))
}

fn attachment(n: u8) -> String {
    format!(
        "/v1/volumes/{}/attachments/{}",
        uuid(n),
        HOST.replace(':', "%3A")
    )
}

/// (target, root) of every extent of a volume.
fn roots(v: &Value) -> BTreeSet<(String, u64)> {
    v["extents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            assert_eq!(e["device"], "d1", "{e}");
            let t = e["target"].as_str().unwrap().to_owned();
            (t, e["offset"].as_u64().unwrap() / MIB)
        })
        .collect()
}

/// What each target was asked to create: (target, epoch, live, snapshot).
fn created_trees(fakes: &[FakeTarget]) -> Vec<(String, u64, u64, u64)> {
    let mut out = Vec::new();
    for (i, f) in fakes.iter().enumerate() {
        for (path, b) in f.posts("/snapshots") {
            assert_eq!(path, "/v1/devices/d1/snapshots");
            for t in b["trees"].as_array().unwrap() {
                out.push((
                    format!("t{i}"),
                    b["epoch"].as_u64().unwrap(),
                    t["live"].as_u64().unwrap(),
                    t["snapshot"].as_u64().unwrap(),
                ));
            }
        }
    }
    out
}

#[test]
fn a_detached_volume_is_snapshotted_at_once() {
    let (s, fakes) = cluster();
    let v = create(&s, 1, MIB, "thin");
    let r = snap(&s, 1, "s1");
    assert_eq!(r.status, 201, "{}", r.body);
    let out = r.json();
    assert_eq!(out["name"], "s1");
    assert_eq!(out["epoch"], 1, "the first write epoch");
    assert_eq!(out["state"], "ready");
    assert_eq!(out["size_bytes"], MIB);
    assert_eq!(out["volume"], uuid(1));

    // One new tree per extent copy, on its device, at the cut's epoch;
    // then sealed, on every target.
    let trees = created_trees(&fakes);
    assert_eq!(trees.len(), 3);
    let live = roots(&v);
    let mut snapshot_roots = BTreeSet::new();
    for (t, epoch, l, sr) in &trees {
        assert_eq!(*epoch, 1);
        assert!(live.contains(&(t.clone(), *l)), "{t}: live {l}");
        assert_ne!(l, sr, "a new root");
        snapshot_roots.insert((t.clone(), *sr));
    }
    for (i, f) in fakes.iter().enumerate() {
        let seen = f.seen.lock().unwrap().clone();
        let at = |suffix: &str| {
            seen.iter()
                .position(|(m, p, _)| m == "POST" && p.ends_with(suffix))
                .unwrap_or_else(|| panic!("t{i} was not asked {suffix}"))
        };
        assert!(at("/snapshots") < at("/seal"), "trees before the seal");
        let seals = f.posts("/v1/devices/d1/seal");
        assert_eq!(seals.len(), 1);
        let sr = snapshot_roots
            .iter()
            .find(|(t, _)| *t == format!("t{i}"))
            .unwrap()
            .1;
        assert_eq!(seals[0].1, json!({"snapshots": [sr]}));
    }

    // The same name again: the snapshot as it is, no call to a target.
    let calls = fakes
        .iter()
        .map(|f| f.seen.lock().unwrap().len())
        .sum::<usize>();
    let again = snap(&s, 1, "s1");
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.json(), out);
    assert_eq!(
        fakes
            .iter()
            .map(|f| f.seen.lock().unwrap().len())
            .sum::<usize>(),
        calls
    );

    // The epoch rose: the next snapshot's cut is 2.
    let r = snap(&s, 1, "s2");
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["epoch"], 2);

    // Snapshot trees are allocated: a new volume never gets their roots.
    let taken: BTreeSet<(String, u64)> = created_trees(&fakes)
        .into_iter()
        .map(|(t, _, _, sr)| (t, sr))
        .collect();
    let v2 = create(&s, 2, 4 * MIB, "thin");
    assert!(roots(&v2).is_disjoint(&taken), "{v2}");
    assert!(roots(&v2).is_disjoint(&live));
}

#[test]
fn refused_snapshots() {
    let (s, _fakes) = cluster();
    create(&s, 1, MIB, "thin");
    create(&s, 2, MIB, "thick");
    s.expect_error(&snap(&s, 2, "s1"), 422, "thick_volume");
    for bad in ["", "has space", "a/b", &"x".repeat(200)] {
        s.expect_error(&snap(&s, 1, bad), 400, "invalid");
    }
    s.expect_error(&snap(&s, 9, "s1"), 404, "not_found");
    let path = format!("/v1/volumes/{}/snapshots/none", uuid(1));
    s.expect_error(&s.read(&path), 404, "not_found");
    s.expect_error(&s.admin("DELETE", &path, None), 404, "not_found");
    // A reader may read, not take one.
    let r = s.call(
        "POST",
        &format!("/v1/volumes/{}/snapshots", uuid(1)),
        Some(READER),
        Some(json!({"name": "s1"})),
    );
    s.expect_error(&r, 403, "forbidden");
}

#[test]
fn an_attached_volume_waits_for_its_engines_to_confirm_the_epoch() {
    let (s, _fakes) = cluster();
    create(&s, 1, MIB, "thin");
    let r = s.call("PUT", &attachment(1), Some(HOST_TOKEN), None);
    assert_eq!(r.status, 201, "{}", r.body);
    let a = r.json();
    assert_eq!(a["write_epoch"], 1);
    let session = json!({"session": 7, "revision": 0});
    let r = s.call(
        "PUT",
        &format!("{}/session", attachment(1)),
        Some(HOST_TOKEN),
        Some(session),
    );
    assert_eq!(r.status, 204, "{}", r.body);
    let before = s.read(&attachment(1)).json()["revision"].as_u64().unwrap();

    let addr = s.addr;
    let taker = std::thread::spawn(move || {
        let path = format!("/v1/volumes/{}/snapshots", uuid(1));
        let body = json!({"name": "s1"}).to_string();
        common::http(addr, "POST", &path, Some(ADMIN), Some(&body)).unwrap()
    });
    // The attachment's long poll wakes with the raised epoch.
    let woke = s.read(&format!("{}?after_revision={before}", attachment(1)));
    let woke = woke.json();
    assert!(woke["revision"].as_u64().unwrap() > before, "{woke}");
    assert_eq!(woke["write_epoch"], 2);

    let epoch = format!("{}/epoch", attachment(1));
    // Another session of the host: not the engine serving the volume.
    let r = s.call(
        "PUT",
        &epoch,
        Some(HOST_TOKEN),
        Some(json!({"session": 8, "epoch": 2})),
    );
    s.expect_error(&r, 409, "stale_session");
    // An epoch the volume never had.
    let r = s.call(
        "PUT",
        &epoch,
        Some(HOST_TOKEN),
        Some(json!({"session": 7, "epoch": 3})),
    );
    s.expect_error(&r, 400, "invalid");
    // A reader cannot confirm.
    let r = s.call(
        "PUT",
        &epoch,
        Some(READER),
        Some(json!({"session": 7, "epoch": 2})),
    );
    s.expect_error(&r, 403, "forbidden");
    assert!(!taker.is_finished(), "the snapshot waits for the engine");
    let r = s.call(
        "PUT",
        &epoch,
        Some(HOST_TOKEN),
        Some(json!({"session": 7, "epoch": 2})),
    );
    assert_eq!(r.status, 204, "{}", r.body);
    let r = taker.join().unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["epoch"], 1);
    assert_eq!(r.json()["state"], "ready");
}

#[test]
fn engines_that_do_not_confirm_give_the_snapshot_up() {
    let (s, fakes) = cluster();
    create(&s, 1, MIB, "thin");
    s.cluster.set_snapshot_confirm_wait_ms(300);
    let r = s.call("PUT", &attachment(1), Some(HOST_TOKEN), None);
    assert_eq!(r.status, 201, "{}", r.body);
    let r = snap(&s, 1, "s1");
    s.expect_error(&r, 503, "snapshot_failed");
    let e = r.json();
    assert!(
        e["message"].as_str().unwrap().contains(HOST)
            && e["message"]
                .as_str()
                .unwrap()
                .contains("did not confirm write epoch 2"),
        "{e}"
    );
    assert_eq!(e["details"]["snapshot"], "s1");
    let path = format!("/v1/volumes/{}/snapshots/s1", uuid(1));
    s.expect_error(&s.read(&path), 404, "not_found");
    // Its trees were released; the epoch stays raised.
    for (t, _, _, sr) in created_trees(&fakes) {
        let i: usize = t[1..].parse().unwrap();
        assert!(fakes[i].released("d1").contains(&sr), "{t} kept {sr}");
    }
    assert_eq!(s.read(&attachment(1)).json()["write_epoch"], 2);
}

#[test]
fn a_refused_seal_gives_the_snapshot_up() {
    let (s, fakes) = cluster();
    create(&s, 1, MIB, "thin");
    fakes[1].refuse("/seal", 409, "not_sealing");
    let r = snap(&s, 1, "s1");
    s.expect_error(&r, 503, "snapshot_failed");
    assert!(
        r.body.contains("t1") && r.body.contains("not_sealing"),
        "{}",
        r.body
    );
    s.expect_error(
        &s.read(&format!("/v1/volumes/{}/snapshots/s1", uuid(1))),
        404,
        "not_found",
    );
    let trees = created_trees(&fakes);
    assert_eq!(trees.len(), 3);
    for (t, _, _, sr) in trees {
        let i: usize = t[1..].parse().unwrap();
        assert!(fakes[i].released("d1").contains(&sr), "{t} kept {sr}");
    }
    // Nothing left: the volume deletes.
    let r = s.admin("DELETE", &format!("/v1/volumes/{}", uuid(1)), None);
    assert_eq!(r.status, 204, "{}", r.body);
}

#[test]
fn snapshots_are_listed_read_and_deleted() {
    let (s, fakes) = cluster();
    create(&s, 1, MIB, "thin");
    assert_eq!(snap(&s, 1, "s2").status, 201);
    assert_eq!(snap(&s, 1, "s1").status, 201);
    let list = s.read(&format!("/v1/volumes/{}/snapshots", uuid(1))).json();
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["s1", "s2"]);
    let m = s.read("/metrics").body;
    assert!(m.contains("nvpool_snapshots{state=\"ready\"} 2"), "{m}");
    assert!(m.contains("nvpool_snapshots{state=\"creating\"} 0"), "{m}");
    let one = s.read(&format!("/v1/volumes/{}/snapshots/s2", uuid(1)));
    assert_eq!(one.status, 200, "{}", one.body);
    assert_eq!(one.json()["epoch"], 1);

    let r = s.admin("DELETE", &format!("/v1/volumes/{}", uuid(1)), None);
    s.expect_error(&r, 409, "volume_has_snapshots");
    let r = s.admin(
        "DELETE",
        &format!("/v1/volumes/{}?force=true", uuid(1)),
        None,
    );
    s.expect_error(&r, 409, "volume_has_snapshots");

    let s1_roots: Vec<(String, u64)> = created_trees(&fakes)
        .into_iter()
        .filter(|(_, epoch, _, _)| *epoch == 2)
        .map(|(t, _, _, sr)| (t, sr))
        .collect();
    assert_eq!(s1_roots.len(), 3);
    let path = format!("/v1/volumes/{}/snapshots/s1", uuid(1));
    let r = s.admin("DELETE", &path, None);
    assert_eq!(r.status, 204, "{}", r.body);
    for (t, sr) in &s1_roots {
        let i: usize = t[1..].parse().unwrap();
        assert!(fakes[i].released("d1").contains(sr), "{t} kept {sr}");
    }
    s.expect_error(&s.read(&path), 404, "not_found");
    s.expect_error(&s.admin("DELETE", &path, None), 404, "not_found");
    let r = s.admin(
        "DELETE",
        &format!("/v1/volumes/{}/snapshots/s2", uuid(1)),
        None,
    );
    assert_eq!(r.status, 204, "{}", r.body);
    let r = s.admin("DELETE", &format!("/v1/volumes/{}", uuid(1)), None);
    assert_eq!(r.status, 204, "{}", r.body);
}

fn clone_body(n: u8, size: u64, snapshot: &str) -> Value {
    json!({"name": format!("vol{n}"), "size_bytes": size,
           "layout": {"type": "raid1", "copies": 3},
           "source": {"volume": uuid(1), "snapshot": snapshot}})
}

#[test]
fn clones_start_as_their_snapshot() {
    let (s, fakes) = cluster();
    let v = create(&s, 1, MIB, "thin");
    assert_eq!(snap(&s, 1, "s1").status, 201);
    let snapshot_roots: BTreeSet<(String, u64)> = created_trees(&fakes)
        .into_iter()
        .map(|(t, _, _, sr)| (t, sr))
        .collect();

    let path = format!("/v1/volumes/{}", uuid(9));
    let r = s.admin("PUT", &path, Some(clone_body(9, MIB, "s1")));
    assert_eq!(r.status, 201, "{}", r.body);
    let clone = r.json();
    assert_eq!(clone["provisioning"], "thin");
    let clone_roots = roots(&clone);
    assert_eq!(clone_roots.len(), 3);
    assert!(clone_roots.is_disjoint(&snapshot_roots) && clone_roots.is_disjoint(&roots(&v)));
    // Each target made the clone's tree from the snapshot's, complete at
    // once (epoch 0), and sealed nothing more.
    let made: BTreeSet<(String, u64, u64)> = created_trees(&fakes)
        .into_iter()
        .filter(|(_, epoch, _, _)| *epoch == 0)
        .map(|(t, _, live, new)| {
            assert!(snapshot_roots.contains(&(t.clone(), live)), "{t}: {live}");
            (t, live, new)
        })
        .collect();
    let made_roots: BTreeSet<(String, u64)> =
        made.iter().map(|(t, _, n)| (t.clone(), *n)).collect();
    assert_eq!(made_roots, clone_roots);
    assert_eq!(
        fakes.iter().map(|f| f.posts("/seal").len()).sum::<usize>(),
        3
    );

    // Idempotent: the same clone again, with no call to a target.
    let again = s.admin("PUT", &path, Some(clone_body(9, MIB, "s1")));
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(roots(&again.json()), clone_roots);
    assert_eq!(created_trees(&fakes).len(), 6);

    // Size and layout must be the snapshot's; no pool, no provisioning.
    let r = s.admin(
        "PUT",
        &format!("/v1/volumes/{}", uuid(10)),
        Some(clone_body(10, 2 * MIB, "s1")),
    );
    s.expect_error(&r, 422, "clone_mismatch");
    let mut with_pool = clone_body(10, MIB, "s1");
    with_pool["provisioning"] = json!("thin");
    let r = s.admin("PUT", &format!("/v1/volumes/{}", uuid(10)), Some(with_pool));
    s.expect_error(&r, 400, "invalid");
    let r = s.admin(
        "PUT",
        &format!("/v1/volumes/{}", uuid(10)),
        Some(clone_body(10, MIB, "none")),
    );
    s.expect_error(&r, 404, "not_found");

    // A snapshot still being created cannot be cloned.
    let one: Uuid = uuid(1).parse().unwrap();
    s.cluster.begin_snapshot(&one, "creating").unwrap();
    let r = s.admin(
        "PUT",
        &format!("/v1/volumes/{}", uuid(10)),
        Some(clone_body(10, MIB, "creating")),
    );
    s.expect_error(&r, 409, "snapshot_not_ready");

    // A target that cannot make the tree: no volume, the trees freed.
    fakes[2].refuse("/snapshots", 404, "unknown_tree");
    let r = s.admin(
        "PUT",
        &format!("/v1/volumes/{}", uuid(10)),
        Some(clone_body(10, MIB, "s1")),
    );
    s.expect_error(&r, 422, "target_refused");
    s.expect_error(
        &s.read(&format!("/v1/volumes/{}", uuid(10))),
        404,
        "not_found",
    );
    let attempted: Vec<(String, u64)> = created_trees(&fakes)
        .into_iter()
        .filter(|(t, epoch, _, new)| *epoch == 0 && !clone_roots.contains(&(t.clone(), *new)))
        .map(|(t, _, _, new)| (t, new))
        .collect();
    assert_eq!(attempted.len(), 3, "t0 and t1 made theirs, t2 refused");
    for (t, new) in attempted {
        let i: usize = t[1..].parse().unwrap();
        assert!(fakes[i].released("d1").contains(&new), "{t} kept {new}");
    }

    // The snapshot may go; the clone is an ordinary thin volume.
    let r = s.admin(
        "DELETE",
        &format!("/v1/volumes/{}/snapshots/s1", uuid(1)),
        None,
    );
    assert_eq!(r.status, 204, "{}", r.body);
    assert_eq!(s.read(&path).status, 200);
    let r = s.admin("DELETE", &path, None);
    assert_eq!(r.status, 204, "{}", r.body);
}

#[test]
fn a_restart_gives_up_snapshots_left_creating() {
    let (s, fakes) = cluster();
    create(&s, 1, MIB, "thin");
    let one: Uuid = uuid(1).parse().unwrap();
    let old = s.cluster.begin_snapshot(&one, "old").unwrap().record;
    s.clock.advance(SNAPSHOT_ABANDONED_MS + 1);
    s.cluster.begin_snapshot(&one, "young").unwrap();
    let n =
        nvpool_control::snapshots::give_up_abandoned(&s.cluster, SNAPSHOT_ABANDONED_MS).unwrap();
    assert_eq!(n, 1);
    let path = format!("/v1/volumes/{}/snapshots/old", uuid(1));
    s.expect_error(&s.read(&path), 404, "not_found");
    let young = s.read(&format!("/v1/volumes/{}/snapshots/young", uuid(1)));
    assert_eq!(young.json()["state"], "creating");
    for t in &old.trees {
        let i: usize = t.tree.target[1..].parse().unwrap();
        assert!(
            fakes[i].released("d1").contains(&(t.tree.offset / MIB)),
            "{:?}",
            t.tree
        );
    }
    // Creations overlap: one whose epoch another raised first is given
    // up at its raise (a compare-and-set), never cut at a stale epoch.
    assert_eq!(young.json()["epoch"], 1);
    assert_eq!(snap(&s, 1, "later").json()["epoch"], 1);
    assert_eq!(s.cluster.raise_epoch(&one, 1).unwrap(), None);
    assert_eq!(s.cluster.raise_epoch(&one, 2).unwrap(), Some(3));
    // A snapshot being created is not deleted from under its creator.
    let r = s.admin(
        "DELETE",
        &format!("/v1/volumes/{}/snapshots/young", uuid(1)),
        None,
    );
    s.expect_error(&r, 409, "snapshot_creating");
}

#[test]
fn copies_and_snapshot_creations_wait_for_each_other() {
    use nvpool_control::resync::{Candidate, CopyKind};
    let (s, _fakes) = cluster();
    create(&s, 1, MIB, "thin");
    let one: Uuid = uuid(1).parse().unwrap();
    // Begun before the copy is marked stale (a degraded volume is not
    // snapshotted at all: volume_degraded).
    s.cluster.begin_snapshot(&one, "sealing").unwrap();
    let r = s.admin(
        "POST",
        &format!("/v1/volumes/{}/extents/0/resync", uuid(1)),
        None,
    );
    assert!(r.status < 300, "{} {}", r.status, r.body);
    let resync = Candidate {
        volume: one,
        extent: 0,
        source: 1,
        kind: CopyKind::ResyncFull,
        to: None,
    };
    // A snapshot being created: no copy job starts.
    assert_eq!(s.cluster.create_job(&resync).unwrap(), None);
    s.cluster.drop_snapshot(&one, "sealing", true).unwrap();
    // A copy job under way: no snapshot is taken.
    assert!(s.cluster.create_job(&resync).unwrap().is_some());
    s.expect_error(&snap(&s, 1, "s1"), 409, "copy_in_progress");
}

#[test]
fn a_degraded_volume_is_not_snapshotted() {
    let (s, _fakes) = cluster();
    create(&s, 1, MIB, "thin");
    let one: Uuid = uuid(1).parse().unwrap();
    // A copy missed writes (a host reported it): its tree would be in the
    // snapshot as it is.
    let r = s.admin(
        "POST",
        &format!("/v1/volumes/{}/extents/0/resync", uuid(1)),
        None,
    );
    assert!(r.status < 300, "{} {}", r.status, r.body);
    s.expect_error(&snap(&s, 1, "s1"), 409, "volume_degraded");
    assert!(s.cluster.snapshot_records(&one).unwrap().is_empty());
}
