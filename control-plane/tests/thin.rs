//! Thin volumes (issue 27, T1): placement on grain pools, the thin extent
//! spec, and freed trees released before their place is reused. The
//! control plane in process over HTTP; the targets are stand-ins for the
//! admin API that record what they are asked and can be made unreachable.

mod common;

use common::fake::FakeTarget;
use common::{serve, Server, ADMIN, MIB, READER, TARGET};
use nvpool_control::api::AuthConfig;
use nvpool_control::auth::{Principal, Tokens};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;

const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000001";

fn server() -> Server {
    serve(AuthConfig::new(
        Tokens::new()
            .with(Principal::Admin, ADMIN)
            .with(Principal::Target, TARGET)
            .with(Principal::Reader, READER),
    ))
}

/// Registers `t{i}` at `fake`'s admin address with a plain device `d0`
/// and, if `thin`, a grain pool `d1`, each of `mib` MiB.
fn register(s: &Server, i: usize, fake: &FakeTarget, thin: bool, mib: u64) {
    let mut devices = vec![
        json!({"id": "d0", "backend": format!("file:/dev/nvme{i}n1"),
                                  "capacity_bytes": mib * MIB}),
    ];
    if thin {
        devices.push(
            json!({"id": "d1", "backend": format!("thin:/dev/nvme{i}n2"),
                            "capacity_bytes": mib * MIB}),
        );
    }
    let reg = json!({
        "id": format!("t{i}"),
        "name": format!("host{i}"),
        "addr": format!("10.0.0.{i}:4420"),
        "admin_addr": fake.addr.to_string(),
        "labels": {},
        "devices": devices,
    });
    let r = s.call("POST", "/v1/targets", Some(TARGET), Some(reg));
    assert_eq!(r.status, 200, "{}", r.body);
}

/// Three targets, each with a plain device and a grain pool of 8 MiB.
fn cluster(thin: bool) -> (Server, Vec<FakeTarget>) {
    let s = server();
    let fakes: Vec<FakeTarget> = (0..3)
        .map(|i| FakeTarget::start(&format!("t{i}")))
        .collect();
    for (i, f) in fakes.iter().enumerate() {
        register(&s, i, f, thin, 8);
    }
    (s, fakes)
}

fn uuid(n: u8) -> String {
    format!("{n:08x}-0000-4000-8000-000000000000")
}

fn create(s: &Server, n: u8, size: u64, provisioning: Option<&str>) -> common::Reply {
    let mut body = json!({"name": format!("vol{n}"), "size_bytes": size,
                          "layout": {"type": "raid1", "copies": 3}});
    if let Some(p) = provisioning {
        body["provisioning"] = json!(p);
    }
    s.admin("PUT", &format!("/v1/volumes/{}", uuid(n)), Some(body))
}

fn devices_of(v: &Value) -> BTreeSet<String> {
    v["extents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["device"].as_str().unwrap().to_owned())
        .collect()
}

/// (target, device, offset) of every extent.
fn places(v: &Value) -> BTreeSet<(String, String, u64)> {
    v["extents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["target"].as_str().unwrap().to_owned(),
                e["device"].as_str().unwrap().to_owned(),
                e["offset"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn reconcile(s: &Server, target: &str) -> common::Reply {
    s.admin("POST", &format!("/v1/targets/{target}/reconcile"), None)
}

#[test]
fn thin_volumes_go_to_grain_pools_and_thick_ones_to_plain_devices() {
    let (s, _fakes) = cluster(true);
    // A grain pool is a candidate: thin by default.
    let r = create(&s, 1, 2 * MIB, None);
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["provisioning"], "thin");
    assert_eq!(devices_of(&r.json()), BTreeSet::from(["d1".to_owned()]));
    let r = create(&s, 2, 2 * MIB, Some("thick"));
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["provisioning"], "thick");
    assert_eq!(devices_of(&r.json()), BTreeSet::from(["d0".to_owned()]));
    let r = create(&s, 3, 2 * MIB, Some("thin"));
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(devices_of(&r.json()), BTreeSet::from(["d1".to_owned()]));
    // Read back and listed with their kind.
    assert_eq!(
        s.read(&format!("/v1/volumes/{}", uuid(2))).json()["provisioning"],
        "thick"
    );
    let kinds: Vec<Value> = s
        .read("/v1/volumes")
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["provisioning"].clone())
        .collect();
    assert_eq!(kinds, [json!("thin"), json!("thick"), json!("thin")]);
    // The same create again is the same volume; another kind is a conflict.
    assert_eq!(create(&s, 2, 2 * MIB, Some("thick")).status, 200);
    assert_eq!(create(&s, 2, 2 * MIB, None).status, 200);
    let r = create(&s, 2, 2 * MIB, Some("thin"));
    s.expect_error(&r, 409, "uuid_conflict");
    assert_eq!(r.json()["details"]["existing"]["provisioning"], "thick");
    // Growing keeps the kind.
    for (n, device) in [(1, "d1"), (2, "d0")] {
        let r = s.admin(
            "POST",
            &format!("/v1/volumes/{}/resize", uuid(n)),
            Some(json!({"size_bytes": 4 * MIB})),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(devices_of(&r.json()), BTreeSet::from([device.to_owned()]));
    }
}

#[test]
fn without_grain_pools_volumes_are_thick_and_thin_is_refused() {
    let (s, _fakes) = cluster(false);
    let r = create(&s, 1, 2 * MIB, Some("thin"));
    s.expect_error(&r, 422, "no_devices_of_kind");
    assert_eq!(r.json()["details"]["provisioning"], "thin");
    assert_eq!(s.read("/v1/volumes").json(), json!([]), "nothing created");
    let r = create(&s, 1, 2 * MIB, None);
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["provisioning"], "thick");
}

#[test]
fn grain_pools_take_volumes_larger_than_they_are() {
    let (s, _fakes) = cluster(true);
    // Three copies of 64 MiB on pools of 8 MiB each.
    let r = create(&s, 1, 64 * MIB, Some("thin"));
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["extents"].as_array().unwrap().len(), 3 * 64);
    let r = create(&s, 2, 64 * MIB, Some("thick"));
    s.expect_error(&r, 422, "no_space");
}

#[test]
fn thin_extents_are_exported_as_trees() {
    let (s, fakes) = cluster(true);
    let v = create(&s, 1, 2 * MIB, Some("thin")).json();
    let r = s.admin(
        "PUT",
        &format!(
            "/v1/volumes/{}/attachments/{}",
            uuid(1),
            HOST.replace(':', "%3A")
        ),
        None,
    );
    assert_eq!(r.status, 201, "{}", r.body);
    for (i, f) in fakes.iter().enumerate() {
        let mut want: Vec<String> = v["extents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["target"] == format!("t{i}"))
            .map(|e| {
                let root = e["offset"].as_u64().unwrap() / MIB;
                format!("thin:/dev/nvme{i}n2,root={root},size={MIB}")
            })
            .collect();
        let mut got = f.namespace_backends();
        want.sort();
        got.sort();
        assert_eq!(got, want, "t{i}");
    }
}

#[test]
fn a_deleted_thin_volume_keeps_its_place_until_its_trees_are_released() {
    let (s, fakes) = cluster(true);
    let v1 = create(&s, 1, 3 * MIB, Some("thin")).json();
    let taken = places(&v1);
    let roots = |t: &str| -> BTreeSet<u64> {
        taken
            .iter()
            .filter(|(target, _, _)| target == t)
            .map(|(_, _, offset)| offset / MIB)
            .collect()
    };
    // t0 is unreachable when the volume goes.
    fakes[0].down.store(true, Ordering::SeqCst);
    let r = s.admin("DELETE", &format!("/v1/volumes/{}", uuid(1)), None);
    assert_eq!(r.status, 204, "{}", r.body);
    // The delete has the reachable targets release at once, not at the
    // next round of reconciliation.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while fakes[1].released("d1") != roots("t1") {
        assert!(std::time::Instant::now() < deadline, "t1 released nothing");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for (i, f) in fakes.iter().enumerate().skip(1) {
        let r = reconcile(&s, &format!("t{i}"));
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(f.released("d1"), roots(&format!("t{i}")), "t{i}");
    }
    assert_ne!(reconcile(&s, "t0").status, 200);
    // t0's trees are not released: their place is not given again.
    let v2 = create(&s, 2, 3 * MIB, Some("thin")).json();
    let on_t0 = |v: &Value| -> BTreeSet<u64> {
        places(v)
            .into_iter()
            .filter(|(t, _, _)| t == "t0")
            .map(|(_, _, o)| o)
            .collect()
    };
    let freed_on_t0: BTreeSet<u64> = roots("t0").iter().map(|r| r * MIB).collect();
    assert!(
        on_t0(&v2).is_disjoint(&freed_on_t0),
        "{:?} reuses {freed_on_t0:?}",
        on_t0(&v2)
    );
    // Once t0 is back, reconciliation releases them, and their place is
    // free again.
    fakes[0].down.store(false, Ordering::SeqCst);
    let r = reconcile(&s, "t0");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(fakes[0].released("d1"), roots("t0"));
    let v3 = create(&s, 3, 3 * MIB, Some("thin")).json();
    assert_eq!(
        on_t0(&v3),
        freed_on_t0,
        "first fit takes the released place"
    );
}

#[test]
fn a_deleted_thick_volume_releases_nothing() {
    let (s, fakes) = cluster(true);
    let v = create(&s, 1, 2 * MIB, Some("thick")).json();
    let r = s.admin("DELETE", &format!("/v1/volumes/{}", uuid(1)), None);
    assert_eq!(r.status, 204, "{}", r.body);
    for (i, f) in fakes.iter().enumerate() {
        assert_eq!(reconcile(&s, &format!("t{i}")).status, 200);
        assert!(f.released("d0").is_empty() && f.released("d1").is_empty());
    }
    // Its place is free at once.
    let again = create(&s, 2, 2 * MIB, Some("thick")).json();
    assert_eq!(places(&again), places(&v));
}
