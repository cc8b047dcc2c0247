//! Rolling a detached thin volume back to a snapshot (T6): the control
//! plane in process over HTTP, the targets stand-ins for the admin API
//! that record what they are asked and can be taken down.

mod common;

use common::fake::{thin_cluster, volume_uuid, FakeTarget};
use common::{Server, MIB, READER};
use nvpool_control::Uuid;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;

const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000001";
const HOST_TOKEN: &str = "host-secret-0123456789";

fn cluster() -> (Server, Vec<FakeTarget>) {
    thin_cluster(&[(HOST, HOST_TOKEN)])
}

fn uuid(n: u8) -> String {
    volume_uuid(n)
}

fn id(n: u8) -> Uuid {
    uuid(n).parse().unwrap()
}

/// A thin 3-copy mirror of 1 MiB: one extent per target.
fn create(s: &Server, n: u8) -> Value {
    let body = json!({"name": format!("vol{n}"), "size_bytes": MIB,
                      "layout": {"type": "raid1", "copies": 3}, "provisioning": "thin"});
    let r = s.admin("PUT", &format!("/v1/volumes/{}", uuid(n)), Some(body));
    assert_eq!(r.status, 201, "{}", r.body);
    r.json()
}

fn snap(s: &Server, n: u8, name: &str) {
    let path = format!("/v1/volumes/{}/snapshots", uuid(n));
    let r = s.admin("POST", &path, Some(json!({"name": name})));
    assert_eq!(r.status, 201, "{}", r.body);
}

fn rollback(s: &Server, n: u8, name: &str) -> common::Reply {
    let path = format!("/v1/volumes/{}/snapshots/{name}/rollback", uuid(n));
    s.admin("POST", &path, None)
}

fn attachment(n: u8) -> String {
    format!(
        "/v1/volumes/{}/attachments/{}",
        uuid(n),
        HOST.replace(':', "%3A")
    )
}

/// (live, snapshot) root pairs each target was asked to create, by target.
fn snapshot_pairs(fakes: &[FakeTarget]) -> Vec<BTreeSet<(u64, u64)>> {
    pairs(fakes, "/v1/devices/d1/snapshots")
}

/// (live, snapshot) root pairs each target was asked to roll back, by
/// target.
fn rollback_pairs(fakes: &[FakeTarget]) -> Vec<BTreeSet<(u64, u64)>> {
    pairs(fakes, "/v1/devices/d1/rollback")
}

fn pairs(fakes: &[FakeTarget], path: &str) -> Vec<BTreeSet<(u64, u64)>> {
    fakes
        .iter()
        .map(|f| {
            f.posts(path)
                .iter()
                .flat_map(|(_, b)| b["trees"].as_array().unwrap().clone())
                .map(|t| (t["live"].as_u64().unwrap(), t["snapshot"].as_u64().unwrap()))
                .collect()
        })
        .collect()
}

fn rollback_calls(fakes: &[FakeTarget]) -> usize {
    fakes.iter().map(|f| f.posts("/rollback").len()).sum()
}

#[test]
fn every_copy_takes_its_snapshot_tree_back() {
    let (s, fakes) = cluster();
    let v = create(&s, 1);
    snap(&s, 1, "s1");
    snap(&s, 1, "s2");
    let before = snapshot_pairs(&fakes);
    let r = rollback(&s, 1, "s1");
    assert_eq!(r.status, 200, "{}", r.body);
    let out = r.json();
    assert_eq!(out["uuid"], uuid(1));
    assert_eq!(out["extents"], v["extents"], "the same extents");

    // Each target: one call on the copy's device, pairing the live root
    // with the root of s1's tree there (s1's trees were created first).
    let s1 = s.cluster.snapshot_record(&id(1), "s1").unwrap();
    for (i, f) in fakes.iter().enumerate() {
        let calls = f.posts("/rollback");
        assert_eq!(calls.len(), 1, "t{i}: {calls:?}");
        assert_eq!(calls[0].0, "/v1/devices/d1/rollback");
        let t = s1
            .trees
            .iter()
            .find(|t| t.tree.target == format!("t{i}"))
            .unwrap();
        let want = (t.live.offset / MIB, t.tree.offset / MIB);
        assert_eq!(
            calls[0].1["trees"],
            json!([{"live": want.0, "snapshot": want.1}])
        );
        assert!(before[i].contains(&want), "t{i}: {want:?} is not s1's pair");
    }
    assert_eq!(s.cluster.rollback_mark(&id(1)).unwrap(), None);

    // Both snapshots stay; the same call again asks the same of each.
    let list = s.read(&format!("/v1/volumes/{}/snapshots", uuid(1))).json();
    assert_eq!(list.as_array().unwrap().len(), 2, "{list}");
    let first = rollback_pairs(&fakes);
    let r = rollback(&s, 1, "s1");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(rollback_calls(&fakes), 6);
    assert_eq!(rollback_pairs(&fakes), first);

    // To the newer one: its own trees.
    let r = rollback(&s, 1, "s2");
    assert_eq!(r.status, 200, "{}", r.body);
    let s2 = s.cluster.snapshot_record(&id(1), "s2").unwrap();
    for t in &s2.trees {
        let i: usize = t.tree.target[1..].parse().unwrap();
        let last = fakes[i].posts("/rollback").pop().unwrap();
        assert_eq!(
            last.1["trees"],
            json!([{"live": t.live.offset / MIB, "snapshot": t.tree.offset / MIB}])
        );
    }
}

#[test]
fn refused_rollbacks_call_no_target() {
    use nvpool_control::resync::{Candidate, CopyKind};
    let (s, fakes) = cluster();
    create(&s, 1);
    snap(&s, 1, "s1");
    s.expect_error(&rollback(&s, 9, "s1"), 404, "not_found");
    s.expect_error(&rollback(&s, 1, "none"), 404, "not_found");
    s.expect_error(&rollback(&s, 1, "has%20space"), 400, "invalid");
    let r = s.call(
        "POST",
        &format!("/v1/volumes/{}/snapshots/s1/rollback", uuid(1)),
        Some(READER),
        None,
    );
    s.expect_error(&r, 403, "forbidden");

    // A snapshot being created: that one or another.
    s.cluster.begin_snapshot(&id(1), "sealing").unwrap();
    s.expect_error(&rollback(&s, 1, "sealing"), 409, "snapshot_creating");
    s.expect_error(&rollback(&s, 1, "s1"), 409, "snapshot_creating");
    s.cluster.drop_snapshot(&id(1), "sealing", true).unwrap();

    // Attached: the host is named.
    let r = s.call("PUT", &attachment(1), Some(HOST_TOKEN), None);
    assert_eq!(r.status, 201, "{}", r.body);
    let r = rollback(&s, 1, "s1");
    s.expect_error(&r, 409, "volume_attached");
    assert!(r.body.contains(HOST), "{}", r.body);
    let r = s.admin("DELETE", &attachment(1), None);
    assert!(r.status < 300, "{} {}", r.status, r.body);

    // Served to a host (no attachment of its own yet): named too.
    s.cluster.add_served_host(&id(1), HOST, 1).unwrap();
    let r = rollback(&s, 1, "s1");
    s.expect_error(&r, 409, "volume_attached");
    assert!(
        r.body.contains("served") && r.body.contains(HOST),
        "{}",
        r.body
    );
    s.cluster.remove_served_host(&id(1), HOST).unwrap();

    // A copy under way.
    let r = s.admin(
        "POST",
        &format!("/v1/volumes/{}/extents/0/resync", uuid(1)),
        None,
    );
    assert!(r.status < 300, "{} {}", r.status, r.body);
    let resync = Candidate {
        volume: id(1),
        extent: 0,
        source: 1,
        kind: CopyKind::ResyncFull,
        to: None,
    };
    let job = s.cluster.create_job(&resync).unwrap().unwrap();
    s.expect_error(&rollback(&s, 1, "s1"), 409, "copy_in_progress");
    s.cluster
        .finish_job(&id(1), job.id, Some("stopped"))
        .unwrap();

    // Resized since: the snapshot's trees are not the volume's copies.
    let r = s.admin(
        "POST",
        &format!("/v1/volumes/{}/resize", uuid(1)),
        Some(json!({"size_bytes": 2 * MIB})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    s.expect_error(&rollback(&s, 1, "s1"), 409, "layout_changed");

    assert_eq!(rollback_calls(&fakes), 0);
    assert_eq!(s.cluster.rollback_mark(&id(1)).unwrap(), None);
}

#[test]
fn a_failed_rollback_stays_marked_until_repeated() {
    let (s, fakes) = cluster();
    create(&s, 1);
    snap(&s, 1, "s1");
    snap(&s, 1, "s2");
    fakes[1].down.store(true, Ordering::SeqCst);
    let r = rollback(&s, 1, "s1");
    s.expect_error(&r, 503, "target_unreachable");
    assert!(r.body.contains("t1"), "{}", r.body);
    let mark = s.cluster.rollback_mark(&id(1)).unwrap().unwrap();
    assert_eq!(mark.snapshot, "s1");
    assert!(mark.failed);
    assert!(fakes[1].posts("/rollback").is_empty());

    // The target is back: the same rollback again finishes it, calling
    // every target (the calls are idempotent).
    fakes[1].down.store(false, Ordering::SeqCst);
    let r = rollback(&s, 1, "s1");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(s.cluster.rollback_mark(&id(1)).unwrap(), None);
    assert_eq!(fakes[1].posts("/rollback").len(), 1);
    let s1 = s.cluster.snapshot_record(&id(1), "s1").unwrap();
    let want: Vec<BTreeSet<(u64, u64)>> = (0..3)
        .map(|i| {
            s1.trees
                .iter()
                .filter(|t| t.tree.target == format!("t{i}"))
                .map(|t| (t.live.offset / MIB, t.tree.offset / MIB))
                .collect()
        })
        .collect();
    assert_eq!(rollback_pairs(&fakes), want);

    // A failed one may also be finished by rolling back to another.
    fakes[2].refuse("/rollback", 409, "sealing");
    let r = rollback(&s, 1, "s1");
    s.expect_error(&r, 422, "target_refused");
    assert!(s.cluster.rollback_mark(&id(1)).unwrap().unwrap().failed);
    // (The refusal stays: the fake cannot be told otherwise, so the
    // finish by another snapshot is shown with the mark only.)
    s.expect_error(&rollback(&s, 1, "s2"), 422, "target_refused");
    let mark = s.cluster.rollback_mark(&id(1)).unwrap().unwrap();
    assert_eq!(mark.snapshot, "s2");
}

#[test]
fn an_unfinished_rollback_keeps_others_away() {
    let (s, fakes) = cluster();
    create(&s, 1);
    snap(&s, 1, "s1");
    snap(&s, 1, "s2");
    // One under way (begun, targets not called yet).
    let begun = s.cluster.begin_rollback(&id(1), "s1").unwrap();
    s.expect_error(&rollback(&s, 1, "s2"), 409, "rollback_in_progress");
    // The same snapshot: the same calls, and this one finishes the mark.
    let r = rollback(&s, 1, "s1");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(s.cluster.rollback_mark(&id(1)).unwrap(), None);
    // The first one's finish finds nothing left to do.
    s.cluster.finish_rollback(&id(1), &begun).unwrap();
    assert_eq!(rollback_calls(&fakes), 3);
}

#[test]
fn no_attach_while_a_rollback_is_under_way_or_failed() {
    let (s, fakes) = cluster();
    create(&s, 1);
    snap(&s, 1, "s1");
    // Under way (begun, targets not called yet): an attach is refused.
    let begun = s.cluster.begin_rollback(&id(1), "s1").unwrap();
    let r = s.call("PUT", &attachment(1), Some(HOST_TOKEN), None);
    s.expect_error(&r, 409, "rollback_in_progress");
    s.cluster.finish_rollback(&id(1), &begun).unwrap();
    assert_eq!(s.cluster.rollback_mark(&id(1)).unwrap(), None);
    let r = s.call("PUT", &attachment(1), Some(HOST_TOKEN), None);
    assert_eq!(r.status, 201, "{}", r.body);
    let r = s.admin("DELETE", &attachment(1), None);
    assert!(r.status < 300, "{} {}", r.status, r.body);

    // Failed part way (a target down): copies may differ, so attaches are
    // refused until a repeat succeeds.
    fakes[0].down.store(true, Ordering::SeqCst);
    s.expect_error(&rollback(&s, 1, "s1"), 503, "target_unreachable");
    let r = s.call("PUT", &attachment(1), Some(HOST_TOKEN), None);
    s.expect_error(&r, 409, "rollback_in_progress");
    fakes[0].down.store(false, Ordering::SeqCst);
    let r = rollback(&s, 1, "s1");
    assert_eq!(r.status, 200, "{}", r.body);
    let r = s.call("PUT", &attachment(1), Some(HOST_TOKEN), None);
    assert_eq!(r.status, 201, "{}", r.body);

    // A volume deleted with a failed rollback takes its mark along.
    let r = s.admin("DELETE", &attachment(1), None);
    assert!(r.status < 300, "{} {}", r.status, r.body);
    fakes[0].down.store(true, Ordering::SeqCst);
    s.expect_error(&rollback(&s, 1, "s1"), 503, "target_unreachable");
    fakes[0].down.store(false, Ordering::SeqCst);
    let r = s.admin(
        "DELETE",
        &format!("/v1/volumes/{}/snapshots/s1", uuid(1)),
        None,
    );
    assert!(r.status < 300, "{} {}", r.status, r.body);
    let r = s.admin("DELETE", &format!("/v1/volumes/{}", uuid(1)), None);
    assert!(r.status < 300, "{} {}", r.status, r.body);
    assert_eq!(s.cluster.rollback_mark(&id(1)).unwrap(), None);
}

#[test]
fn a_snapshot_taken_during_the_calls_fails_the_rollback() {
    let (s, _fakes) = cluster();
    create(&s, 1);
    snap(&s, 1, "s1");
    let begun = s.cluster.begin_rollback(&id(1), "s1").unwrap();
    snap(&s, 1, "mixed");
    let e = s.cluster.finish_rollback(&id(1), &begun).unwrap_err();
    assert!(e.to_string().contains("mixed"), "{e}");
    assert!(s.cluster.rollback_mark(&id(1)).unwrap().unwrap().failed);
    let r = s.admin(
        "DELETE",
        &format!("/v1/volumes/{}/snapshots/mixed", uuid(1)),
        None,
    );
    assert_eq!(r.status, 204, "{}", r.body);
    let r = rollback(&s, 1, "s1");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(s.cluster.rollback_mark(&id(1)).unwrap(), None);
}
