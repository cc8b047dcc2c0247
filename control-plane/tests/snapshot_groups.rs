//! Group snapshots and the write hold (design/thin-snapshots.md T5,
//! "Group snapshots"): the control plane in process over HTTP, fake
//! targets recording what they are asked, and the engines played by REST
//! calls to `PUT …/epoch` as an agent would make them.

mod common;

use common::fake::{thin_cluster, volume_uuid, FakeTarget};
use common::{Server, ADMIN, MIB, READER};
use nvpool_api::rest::{ENGINE_HOLD_MAX_MS, WRITE_HOLD_MAX_MS};
use nvpool_control::limits::SNAPSHOT_ABANDONED_MS;
use nvpool_control::snapshot_groups::SNAPSHOT_GROUP_VOLUMES_MAX;
use nvpool_control::snapshots::Raise;
use nvpool_control::Uuid;
use nvpool_testkit::wait_for;
use serde_json::{json, Value};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-00000000000a";
const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-00000000000b";
const TOKEN_A: &str = "host-a-secret-0123456789";
const TOKEN_B: &str = "host-b-secret-0123456789";
/// How long a test waits for something the control plane does at once.
const PROMPT: Duration = Duration::from_secs(5);

fn cluster() -> (Server, Vec<FakeTarget>) {
    thin_cluster(&[(HOST_A, TOKEN_A), (HOST_B, TOKEN_B)])
}

fn uuid(n: u8) -> String {
    volume_uuid(n)
}

fn parsed(n: u8) -> Uuid {
    uuid(n).parse().unwrap()
}

/// A 3-copy mirror of 1 MiB: one extent per target.
fn create(s: &Server, n: u8, provisioning: &str) {
    let body = json!({"name": format!("vol{n}"), "size_bytes": MIB,
                      "layout": {"type": "raid1", "copies": 3}, "provisioning": provisioning});
    let r = s.admin("PUT", &format!("/v1/volumes/{}", uuid(n)), Some(body));
    assert_eq!(r.status, 201, "{}", r.body);
}

fn group_body(name: &str, volumes: &[u8]) -> Value {
    let volumes: Vec<String> = volumes.iter().map(|&n| uuid(n)).collect();
    json!({"name": name, "volumes": volumes})
}

fn group(s: &Server, name: &str, volumes: &[u8]) -> common::Reply {
    s.admin(
        "POST",
        "/v1/snapshot-groups",
        Some(group_body(name, volumes)),
    )
}

/// The group taken on its own thread (it waits for the engines).
fn group_in_background(s: &Server, name: &str, volumes: &[u8]) -> JoinHandle<common::Reply> {
    let addr = s.addr;
    let body = group_body(name, volumes).to_string();
    std::thread::spawn(move || {
        common::http(
            addr,
            "POST",
            "/v1/snapshot-groups",
            Some(ADMIN),
            Some(&body),
        )
        .unwrap()
    })
}

fn attachment(n: u8, host: &str) -> String {
    format!(
        "/v1/volumes/{}/attachments/{}",
        uuid(n),
        host.replace(':', "%3A")
    )
}

fn token(host: &str) -> &'static str {
    if host == HOST_A {
        TOKEN_A
    } else {
        TOKEN_B
    }
}

/// `host` attaches volume `n` and its engine starts session `session`.
fn attach(s: &Server, n: u8, host: &str, session: u64) {
    let r = s.call("PUT", &attachment(n, host), Some(token(host)), None);
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["write_hold"], false, "{}", r.body);
    let r = s.call(
        "PUT",
        &format!("{}/session", attachment(n, host)),
        Some(token(host)),
        Some(json!({"session": session, "revision": 0})),
    );
    assert_eq!(r.status, 204, "{}", r.body);
}

/// `host`'s engine of `session` on volume `n` confirms `epoch`.
fn confirm(s: &Server, n: u8, host: &str, session: u64, epoch: u64, held: bool) {
    let r = s.call(
        "PUT",
        &format!("{}/epoch", attachment(n, host)),
        Some(token(host)),
        Some(json!({"session": session, "epoch": epoch, "held": held})),
    );
    assert_eq!(r.status, 204, "{}", r.body);
}

fn read_attachment(s: &Server, n: u8, host: &str) -> Value {
    let r = s.read(&attachment(n, host));
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

/// Waits until the attachment shows `epoch` and the hold `held`.
fn wait_barrier(s: &Server, n: u8, host: &str, epoch: u64, held: bool) {
    wait_for(
        &format!("volume {n} at {host}: write epoch {epoch}, hold {held}"),
        PROMPT,
        || {
            let a = read_attachment(s, n, host);
            a["write_epoch"] == epoch && a["write_hold"] == held
        },
    );
}

fn snapshot(s: &Server, n: u8, name: &str) -> common::Reply {
    s.read(&format!("/v1/volumes/{}/snapshots/{name}", uuid(n)))
}

/// Every tree the targets were asked to create (target index, snapshot root).
fn created_trees(fakes: &[FakeTarget]) -> Vec<(usize, u64)> {
    let mut out = Vec::new();
    for (i, f) in fakes.iter().enumerate() {
        for (_, b) in f.posts("/snapshots") {
            for t in b["trees"].as_array().unwrap() {
                out.push((i, t["snapshot"].as_u64().unwrap()));
            }
        }
    }
    out
}

fn calls(fakes: &[FakeTarget]) -> usize {
    fakes.iter().map(|f| f.seen.lock().unwrap().len()).sum()
}

#[test]
fn a_group_holds_every_writer_until_each_confirmed_held() {
    let (s, fakes) = cluster();
    create(&s, 1, "thin");
    create(&s, 2, "thin");
    attach(&s, 1, HOST_A, 7);
    attach(&s, 2, HOST_B, 9);
    let before = read_attachment(&s, 1, HOST_A)["revision"].as_u64().unwrap();
    let taker = group_in_background(&s, "g1", &[1, 2]);

    // The raise holds both writers: their long polls wake with the hold.
    let woke = s.read(&format!(
        "{}?after_revision={before}",
        attachment(1, HOST_A)
    ));
    assert!(
        woke.json()["revision"].as_u64().unwrap() > before,
        "{}",
        woke.body
    );
    wait_barrier(&s, 1, HOST_A, 2, true);
    wait_barrier(&s, 2, HOST_B, 2, true);

    // Confirmations made without the hold do not complete the barrier.
    confirm(&s, 1, HOST_A, 7, 2, false);
    confirm(&s, 2, HOST_B, 9, 2, false);
    std::thread::sleep(Duration::from_millis(400));
    assert!(
        !taker.is_finished(),
        "unheld confirmations completed the barrier"
    );
    assert_eq!(snapshot(&s, 1, "g1").json()["state"], "creating");
    assert_eq!(snapshot(&s, 2, "g1").json()["state"], "creating");
    // One held writer of two is not enough either.
    confirm(&s, 1, HOST_A, 7, 2, true);
    std::thread::sleep(Duration::from_millis(400));
    assert!(
        !taker.is_finished(),
        "one held writer completed the barrier"
    );
    assert_eq!(read_attachment(&s, 2, HOST_B)["write_hold"], true);

    confirm(&s, 2, HOST_B, 9, 2, true);
    let r = taker.join().unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
    let out = r.json();
    let out = out.as_array().unwrap();
    assert_eq!(out.len(), 2);
    for (i, n) in [1u8, 2].into_iter().enumerate() {
        assert_eq!(out[i]["volume"], uuid(n), "in the body's order");
        assert_eq!(out[i]["name"], "g1");
        assert_eq!(out[i]["state"], "ready");
        assert_eq!(out[i]["epoch"], 1);
        assert_eq!(out[i]["group"], json!([uuid(1), uuid(2)]));
        assert_eq!(snapshot(&s, n, "g1").json(), out[i]);
    }
    // The holds are lifted, the epochs stay raised.
    for (n, host) in [(1, HOST_A), (2, HOST_B)] {
        let a = read_attachment(&s, n, host);
        assert_eq!(a["write_hold"], false, "{a}");
        assert_eq!(a["write_epoch"], 2, "{a}");
    }
    // Trees on every target for both volumes, each sealed.
    assert_eq!(created_trees(&fakes).len(), 6);
    for f in &fakes {
        assert_eq!(f.posts("/seal").len(), 2);
    }
}

#[test]
fn a_writer_that_never_confirms_gives_the_group_up_within_the_budget() {
    let (s, fakes) = cluster();
    create(&s, 1, "thin");
    create(&s, 2, "thin");
    attach(&s, 1, HOST_A, 7);
    attach(&s, 2, HOST_B, 9);
    let started = Instant::now();
    let taker = group_in_background(&s, "g1", &[1, 2]);
    wait_barrier(&s, 1, HOST_A, 2, true);
    confirm(&s, 1, HOST_A, 7, 2, true);
    // B saw the raise but never reports held (it confirms unheld).
    confirm(&s, 2, HOST_B, 9, 2, false);
    let r = taker.join().unwrap();
    let took = started.elapsed();
    s.expect_error(&r, 503, "snapshot_failed");
    let e = r.json();
    let m = e["message"].as_str().unwrap();
    assert!(
        m.contains(HOST_B) && !m.contains(HOST_A) && m.contains("held"),
        "{e}"
    );
    assert!(m.contains(&uuid(2)), "names the volume: {e}");
    assert_eq!(e["details"]["volume"], uuid(2), "{e}");
    // The budget (5 s) counts from before the hold was set.
    let budget = Duration::from_millis(WRITE_HOLD_MAX_MS);
    assert!(
        took >= budget && took < budget + Duration::from_secs(3),
        "given up after {took:?}"
    );
    // Every snapshot of the group is gone, its trees released.
    for n in [1, 2] {
        s.expect_error(&snapshot(&s, n, "g1"), 404, "not_found");
    }
    let trees = created_trees(&fakes);
    assert_eq!(trees.len(), 6);
    for (i, root) in trees {
        assert!(fakes[i].released("d1").contains(&root), "t{i} kept {root}");
    }
    // The holds are lifted; the epochs stay raised.
    for (n, host) in [(1, HOST_A), (2, HOST_B)] {
        let a = read_attachment(&s, n, host);
        assert_eq!(a["write_hold"], false, "{a}");
        assert_eq!(a["write_epoch"], 2, "{a}");
    }
    // Taken again, with both engines held in time: ready.
    let taker = group_in_background(&s, "g1", &[1, 2]);
    wait_barrier(&s, 2, HOST_B, 3, true);
    confirm(&s, 1, HOST_A, 7, 3, true);
    confirm(&s, 2, HOST_B, 9, 3, true);
    let r = taker.join().unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()[1]["epoch"], 2);
}

#[test]
fn a_volume_with_two_writers_is_held_for_a_single_snapshot() {
    let (s, _fakes) = cluster();
    create(&s, 1, "thin");
    attach(&s, 1, HOST_A, 7);
    let path = format!("/v1/volumes/{}/snapshots", uuid(1));
    // One writer: today's raise, no hold.
    let addr = s.addr;
    let p = path.clone();
    let taker = std::thread::spawn(move || {
        let body = json!({"name": "one"}).to_string();
        common::http(addr, "POST", &p, Some(ADMIN), Some(&body)).unwrap()
    });
    wait_barrier(&s, 1, HOST_A, 2, false);
    confirm(&s, 1, HOST_A, 7, 2, false);
    let r = taker.join().unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["group"], json!([]));

    // Two writers: the raise holds both, and only held confirmations count.
    attach(&s, 1, HOST_B, 9);
    let p = path.clone();
    let taker = std::thread::spawn(move || {
        let body = json!({"name": "two"}).to_string();
        common::http(addr, "POST", &p, Some(ADMIN), Some(&body)).unwrap()
    });
    wait_barrier(&s, 1, HOST_A, 3, true);
    wait_barrier(&s, 1, HOST_B, 3, true);
    confirm(&s, 1, HOST_A, 7, 3, true);
    confirm(&s, 1, HOST_B, 9, 3, false);
    std::thread::sleep(Duration::from_millis(400));
    assert!(
        !taker.is_finished(),
        "an unheld confirmation completed the barrier"
    );
    confirm(&s, 1, HOST_B, 9, 3, true);
    let r = taker.join().unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["epoch"], 2);
    wait_barrier(&s, 1, HOST_B, 3, false);
}

#[test]
fn a_group_is_taken_once_and_its_name_is_its_own() {
    let (s, fakes) = cluster();
    for n in 1..=3 {
        create(&s, n, "thin");
    }
    // Nobody writes: no hold, ready at once.
    let r = group(&s, "g1", &[2, 1]);
    assert_eq!(r.status, 201, "{}", r.body);
    let first = r.json();
    assert_eq!(first[0]["volume"], uuid(2));
    assert_eq!(first[1]["volume"], uuid(1));
    assert_eq!(first[0]["group"], json!([uuid(2), uuid(1)]));

    // The same group again (in any order): the snapshots as they are, no
    // call to a target.
    let n = calls(&fakes);
    let again = group(&s, "g1", &[2, 1]);
    assert_eq!(again.status, 200, "{}", again.body);
    assert_eq!(again.json(), first);
    let other_order = group(&s, "g1", &[1, 2]);
    assert_eq!(other_order.status, 200, "{}", other_order.body);
    assert_eq!(other_order.json()[0], first[1]);
    assert_eq!(calls(&fakes), n);
    // A single snapshot of that name answers the group's member.
    let one = s.admin(
        "POST",
        &format!("/v1/volumes/{}/snapshots", uuid(1)),
        Some(json!({"name": "g1"})),
    );
    assert_eq!(one.status, 200, "{}", one.body);
    assert_eq!(one.json(), first[1]);

    // The name is taken outside this group: by a wider or narrower group,
    // or by a snapshot of one volume. Nothing is created.
    s.expect_error(&group(&s, "g1", &[1, 2, 3]), 409, "snapshot_exists");
    s.expect_error(&group(&s, "g1", &[1]), 409, "snapshot_exists");
    let r = s.admin(
        "POST",
        &format!("/v1/volumes/{}/snapshots", uuid(3)),
        Some(json!({"name": "solo"})),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let r = group(&s, "solo", &[1, 3]);
    s.expect_error(&r, 409, "snapshot_exists");
    assert!(r.body.contains(&uuid(3)), "{}", r.body);
    s.expect_error(&snapshot(&s, 1, "solo"), 404, "not_found");
    assert_eq!(
        created_trees(&fakes).len(),
        9,
        "the group's six trees and the single snapshot's three"
    );

    // A snapshot of a group is deleted like any other.
    let r = s.admin(
        "DELETE",
        &format!("/v1/volumes/{}/snapshots/g1", uuid(1)),
        None,
    );
    assert_eq!(r.status, 204, "{}", r.body);
}

#[test]
fn bad_groups_are_refused() {
    let (s, fakes) = cluster();
    create(&s, 1, "thin");
    create(&s, 2, "thin");
    create(&s, 3, "thick");
    let post = |body: Value| s.admin("POST", "/v1/snapshot-groups", Some(body));
    s.expect_error(&post(json!({"name": "g", "volumes": []})), 400, "invalid");
    s.expect_error(&group(&s, "g", &[1, 2, 1]), 400, "invalid");
    for bad in ["", "has space", "a/b", &"x".repeat(200)] {
        s.expect_error(&group(&s, bad, &[1, 2]), 400, "invalid");
    }
    s.expect_error(
        &post(json!({"name": "g", "volumes": [uuid(1)], "extra": 1})),
        400,
        "invalid",
    );
    s.expect_error(&post(json!({"name": "g"})), 400, "invalid");
    s.expect_error(
        &post(json!({"name": "g", "volumes": ["not-a-uuid"]})),
        400,
        "invalid",
    );
    let many: Vec<u8> = (1..=u8::try_from(SNAPSHOT_GROUP_VOLUMES_MAX + 1).unwrap()).collect();
    s.expect_error(&group(&s, "g", &many), 409, "limit");
    s.expect_error(&group(&s, "g", &[1, 9]), 404, "not_found");
    s.expect_error(&group(&s, "g", &[1, 3]), 422, "thick_volume");
    let r = s.call(
        "POST",
        "/v1/snapshot-groups",
        Some(READER),
        Some(group_body("g", &[1, 2])),
    );
    s.expect_error(&r, 403, "forbidden");
    // None of these began a snapshot.
    assert!(created_trees(&fakes).is_empty());
    for n in [1, 2] {
        let list = s.read(&format!("/v1/volumes/{}/snapshots", uuid(n)));
        assert_eq!(list.json(), json!([]), "{}", list.body);
    }
}

#[test]
fn a_refused_seal_gives_every_snapshot_of_the_group_up() {
    let (s, fakes) = cluster();
    create(&s, 1, "thin");
    create(&s, 2, "thin");
    fakes[2].refuse("/seal", 409, "not_sealing");
    let r = group(&s, "g1", &[1, 2]);
    s.expect_error(&r, 503, "snapshot_failed");
    assert!(
        r.body.contains("t2") && r.body.contains("not_sealing") && r.body.contains("group"),
        "{}",
        r.body
    );
    for n in [1, 2] {
        s.expect_error(&snapshot(&s, n, "g1"), 404, "not_found");
    }
    let trees = created_trees(&fakes);
    assert_eq!(trees.len(), 6);
    for (i, root) in trees {
        assert!(fakes[i].released("d1").contains(&root), "t{i} kept {root}");
    }
    // Nothing left: both volumes delete.
    for n in [1, 2] {
        let r = s.admin("DELETE", &format!("/v1/volumes/{}", uuid(n)), None);
        assert_eq!(r.status, 204, "{}", r.body);
    }
}

#[test]
fn holds_left_by_a_creator_that_died_are_lifted() {
    let (s, fakes) = cluster();
    create(&s, 1, "thin");
    create(&s, 2, "thin");
    attach(&s, 1, HOST_A, 7);
    attach(&s, 2, HOST_B, 9);
    // A creator began the group and raised with the hold, then died.
    let (one, two) = (parsed(1), parsed(2));
    let begun = s.cluster.begin_group("g1", &[one, two]).unwrap();
    assert!(begun.created);
    let raise = s.cluster.raise_epochs(&[(one, 1), (two, 1)]).unwrap();
    assert_eq!(
        raise,
        Raise::Raised {
            epochs: vec![2, 2],
            held: true
        }
    );
    wait_barrier(&s, 1, HOST_A, 2, true);
    // While it holds, no other raise moves the epoch under it.
    assert_eq!(
        s.cluster.raise_epochs(&[(one, 2)]).unwrap(),
        Raise::Held { volume: one }
    );
    let r = s.admin(
        "POST",
        &format!("/v1/volumes/{}/snapshots", uuid(1)),
        Some(json!({"name": "meanwhile"})),
    );
    s.expect_error(&r, 503, "snapshot_failed");
    assert!(r.body.contains("holds the volume's writers"), "{}", r.body);
    wait_barrier(&s, 1, HOST_A, 2, true);

    // Past the engines' own limit the hold holds nobody: a new engine
    // is not held by it, and the leader lifts it.
    s.clock.advance(ENGINE_HOLD_MAX_MS);
    assert_eq!(read_attachment(&s, 2, HOST_B)["write_hold"], false);
    s.clock.advance(SNAPSHOT_ABANDONED_MS);
    let n =
        nvpool_control::snapshots::give_up_abandoned(&s.cluster, SNAPSHOT_ABANDONED_MS).unwrap();
    assert_eq!(n, 2, "both snapshots of the group");
    for n in [1, 2] {
        s.expect_error(&snapshot(&s, n, "g1"), 404, "not_found");
    }
    for t in begun.records.iter().flat_map(|r| &r.trees) {
        let i: usize = t.tree.target[1..].parse().unwrap();
        assert!(
            fakes[i].released("d1").contains(&(t.tree.offset / MIB)),
            "{:?}",
            t.tree
        );
    }
    // Lifted in the store: a new raise may hold again.
    let w = s.cluster.snapshot().unwrap();
    assert!(w
        .write_epochs
        .values()
        .all(|w| w.value.hold_since_ms.is_none()));
    assert_eq!(
        s.cluster.raise_epochs(&[(one, 2), (two, 2)]).unwrap(),
        Raise::Raised {
            epochs: vec![3, 3],
            held: true
        }
    );
    assert_eq!(
        s.cluster.clear_holds(&[(one, 3), (two, 3)]).unwrap(),
        vec![]
    );
    assert_eq!(s.cluster.clear_holds(&[(one, 3)]).unwrap(), vec![one]);
    wait_barrier(&s, 2, HOST_B, 3, false);
}
