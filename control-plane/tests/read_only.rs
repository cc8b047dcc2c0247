//! Read-only dataset volumes (design/thin-snapshots.md T8): a read-only
//! clone of a snapshot is attached by many hosts at once, and every
//! namespace exporting it is write-protected. The control plane in process
//! over HTTP, the targets stand-ins that record what they are asked.

mod common;

use common::fake::{thin_cluster, volume_uuid, FakeTarget};
use common::{Server, MIB};
use nvpool_api::names::segment;
use serde_json::{json, Value};
use std::collections::BTreeSet;

const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000001";
const TOKEN_A: &str = "host-a-secret-0123456789";
const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-4000-8000-000000000002";
const TOKEN_B: &str = "host-b-secret-0123456789";

fn cluster() -> (Server, Vec<FakeTarget>) {
    thin_cluster(&[(HOST_A, TOKEN_A), (HOST_B, TOKEN_B)])
}

fn volume(n: u8) -> String {
    format!("/v1/volumes/{}", volume_uuid(n))
}

fn attachment(n: u8, host: &str) -> String {
    format!("{}/attachments/{}", volume(n), segment(host))
}

/// Volume 1 (a thin 3-copy mirror) with snapshot `s1`.
fn source(s: &Server) {
    let body = json!({"name": "vol1", "size_bytes": MIB,
                      "layout": {"type": "raid1", "copies": 3}, "provisioning": "thin"});
    let r = s.admin("PUT", &volume(1), Some(body));
    assert_eq!(r.status, 201, "{}", r.body);
    let r = s.admin(
        "POST",
        &format!("{}/snapshots", volume(1)),
        Some(json!({"name": "s1"})),
    );
    assert_eq!(r.status, 201, "{}", r.body);
}

fn clone_body(n: u8, read_only: bool) -> Value {
    json!({"name": format!("vol{n}"), "size_bytes": MIB,
           "layout": {"type": "raid1", "copies": 3},
           "source": {"volume": volume_uuid(1), "snapshot": "s1"},
           "read_only": read_only})
}

/// A namespace: (target, subsystem NQN as in a path, NSID).
type Ns = (String, String, u32);

/// Every namespace put on any target, and whether write-protected.
fn namespace_puts(fakes: &[FakeTarget]) -> Vec<(Ns, bool)> {
    let mut out = Vec::new();
    for (i, f) in fakes.iter().enumerate() {
        for (m, p, b) in f.seen.lock().unwrap().iter() {
            let Some(rest) = p.strip_prefix("/v1/subsystems/") else {
                continue;
            };
            let Some((nqn, nsid)) = rest.split_once("/namespaces/") else {
                continue;
            };
            if m != "PUT" {
                continue;
            }
            let body: Value = serde_json::from_str(b).unwrap();
            let ro = body.get("read_only").map(|v| v.as_bool().unwrap());
            // Left out when false.
            assert_ne!(ro, Some(false), "{b}");
            let ns = (format!("t{i}"), nqn.to_owned(), nsid.parse().unwrap());
            out.push((ns, ro == Some(true)));
        }
    }
    out
}

/// The namespace of every extent of an attachment.
fn namespaces_of(a: &Value) -> BTreeSet<Ns> {
    a["plan"]["extents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let nqn = segment(e["subsystem_nqn"].as_str().unwrap());
            let t = e["target"].as_str().unwrap().to_owned();
            (t, nqn, e["nsid"].as_u64().unwrap() as u32)
        })
        .collect()
}

#[test]
fn a_read_only_clone_is_exported_write_protected_to_every_host() {
    let (s, fakes) = cluster();
    source(&s);
    let r = s.admin("PUT", &volume(9), Some(clone_body(9, true)));
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["read_only"], true);
    assert_eq!(s.read(&volume(9)).json()["read_only"], true);
    let listed = s.read("/v1/volumes").json();
    let flags: Vec<(String, bool)> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap().to_owned(),
                v["read_only"] == true,
            )
        })
        .collect();
    assert_eq!(
        flags,
        [("vol1".to_owned(), false), ("vol9".to_owned(), true)]
    );
    // The writable source says nothing (left out when false).
    assert!(s.read(&volume(1)).json().get("read_only").is_none());

    // Both hosts attach it at once; each is told it is read-only.
    let mut protected = BTreeSet::new();
    for (host, token) in [(HOST_A, TOKEN_A), (HOST_B, TOKEN_B)] {
        let r = s.call("PUT", &attachment(9, host), Some(token), None);
        assert_eq!(r.status, 201, "{}", r.body);
        let a = r.json();
        assert_eq!(a["read_only"], true, "{a}");
        assert_eq!(a["plan"]["extents"].as_array().unwrap().len(), 3);
        protected.extend(namespaces_of(&a));
        assert_eq!(s.read(&attachment(9, host)).json()["read_only"], true);
    }
    assert_eq!(protected.len(), 6, "3 extents for each of 2 hosts");
    let put = namespace_puts(&fakes);
    assert_eq!(put.len(), 6);
    assert!(
        put.iter().all(|(ns, ro)| *ro && protected.contains(ns)),
        "{put:?}"
    );
    let attached = s.read(&volume(9)).json()["attachments"].clone();
    assert_eq!(attached, json!([HOST_A, HOST_B]));

    // The writable source beside it on host A: its namespaces are not.
    let r = s.call("PUT", &attachment(1, HOST_A), Some(TOKEN_A), None);
    assert_eq!(r.status, 201, "{}", r.body);
    let a = r.json();
    assert!(a.get("read_only").is_none(), "{a}");
    let writable = namespaces_of(&a);
    let put = namespace_puts(&fakes);
    assert_eq!(put.len(), 9);
    let new: BTreeSet<Ns> = put
        .iter()
        .filter(|(ns, ro)| !protected.contains(ns) && !ro)
        .map(|(ns, _)| ns.clone())
        .collect();
    assert_eq!(new, writable, "{put:?}");

    // Reconciliation (the fakes forget everything) puts every namespace
    // back, write-protected exactly where the volume is read-only.
    let before = namespace_puts(&fakes).len();
    for t in ["t0", "t1", "t2"] {
        let r = s.admin("POST", &format!("/v1/targets/{t}/reconcile"), None);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let all = namespace_puts(&fakes);
    assert_eq!(all.len(), before + 9, "{all:?}");
    // (Listed target by target: each target's new puts follow its old.)
    let again: Vec<&(Ns, bool)> = (0..3)
        .flat_map(|i| {
            let t = format!("t{i}");
            let mine: Vec<&(Ns, bool)> = all.iter().filter(|(ns, _)| ns.0 == t).collect();
            mine.into_iter().skip(3)
        })
        .collect();
    assert_eq!(again.len(), 9, "{again:?}");
    for (ns, ro) in again {
        assert_eq!(*ro, protected.contains(ns), "{ns:?}");
        assert!(protected.contains(ns) || writable.contains(ns), "{ns:?}");
    }
}

#[test]
fn read_only_is_fixed_at_create_and_goes_with_the_volume() {
    let (s, _fakes) = cluster();
    source(&s);
    // Nothing could ever fill an empty read-only volume.
    let body = json!({"name": "empty", "size_bytes": MIB,
                      "layout": {"type": "raid1", "copies": 3}, "read_only": true});
    let r = s.admin("PUT", &volume(8), Some(body));
    s.expect_error(&r, 400, "invalid");
    assert_eq!(s.read(&volume(8)).status, 404);

    let r = s.admin("PUT", &volume(9), Some(clone_body(9, true)));
    assert_eq!(r.status, 201, "{}", r.body);
    // The same create again is the same volume; asking it writable is
    // another spec.
    let r = s.admin("PUT", &volume(9), Some(clone_body(9, true)));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["read_only"], true);
    let r = s.admin("PUT", &volume(9), Some(clone_body(9, false)));
    s.expect_error(&r, 409, "uuid_conflict");
    assert_eq!(s.read(&volume(9)).json()["read_only"], true);
    // And a writable clone cannot be made read-only by creating it again.
    let r = s.admin("PUT", &volume(7), Some(clone_body(7, false)));
    assert_eq!(r.status, 201, "{}", r.body);
    let r = s.admin("PUT", &volume(7), Some(clone_body(7, true)));
    s.expect_error(&r, 409, "uuid_conflict");
    assert!(s.read(&volume(7)).json().get("read_only").is_none());

    // Targets would serve it writable: it is attached instead.
    let r = s.admin(
        "PUT",
        &format!("{}/exports/{}", volume(9), segment(HOST_A)),
        None,
    );
    s.expect_error(&r, 409, "volume_read_only");

    // Deleted, its UUID is free for a writable volume.
    let r = s.admin("DELETE", &volume(9), None);
    assert_eq!(r.status, 204, "{}", r.body);
    let r = s.admin("PUT", &volume(9), Some(clone_body(9, false)));
    assert_eq!(r.status, 201, "{}", r.body);
    assert!(r.json().get("read_only").is_none());
    let a = s.call("PUT", &attachment(9, HOST_A), Some(TOKEN_A), None);
    assert_eq!(a.status, 201, "{}", a.body);
    assert!(a.json().get("read_only").is_none());
}
