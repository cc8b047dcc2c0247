//! Thin provisioning's accounting (design/thin-snapshots.md T4) over the
//! REST API: a grain pool's real use arrives with its target's heartbeats,
//! and capacity, `/metrics` and `/v1/events` follow it.

mod common;

use common::{serve, Server, ADMIN, MIB, READER, T0, TARGET};
use nvpool_control::api::AuthConfig;
use nvpool_control::auth::{Principal, Tokens};
use nvpool_control::{Cluster, ManualClock, StateConfig};
use serde_json::{json, Value};
use std::sync::Arc;

/// The grain pool's real capacity.
const GRAIN: u64 = 100 * MIB;

fn tokens() -> AuthConfig {
    AuthConfig::new(
        Tokens::new()
            .with(Principal::Admin, ADMIN)
            .with(Principal::Target, TARGET)
            .with(Principal::Reader, READER),
    )
}

/// Target t0 with a grain pool g0 (in pool `thin`) and a plain device d1
/// (in none), a 3 MiB volume on each.
fn cluster(s: &Server) {
    let r = s.call(
        "POST",
        "/v1/targets",
        Some(TARGET),
        Some(json!({
            "id": "t0",
            "name": "host0",
            "addr": "10.0.0.1:4420",
            "admin_addr": "10.0.0.1:4480",
            "devices": [
                {"id": "g0", "backend": "thin:/dev/nvme0n1", "capacity_bytes": GRAIN},
                {"id": "d1", "backend": "file:/dev/nvme1n1", "capacity_bytes": 8 * MIB},
            ],
        })),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let pool = json!({"devices": [{"target": "t0", "device": "g0"}]});
    let r = s.admin("PUT", "/v1/pools/thin", Some(pool));
    assert_eq!(r.status, 201, "{}", r.body);
    for (n, pool) in [(1, Some("thin")), (2, None)] {
        let spec = json!({
            "name": format!("v{n}"),
            "size_bytes": 3 * MIB,
            "layout": {"type": "concat"},
            "pool": pool,
        });
        let uuid = format!("{n:08x}-0000-4000-8000-000000000000");
        let r = s.admin("PUT", &format!("/v1/volumes/{uuid}"), Some(spec));
        assert_eq!(r.status, 201, "{}", r.body);
    }
}

/// A heartbeat reporting `devices` (`[id, used_bytes]`); its answer.
fn heartbeat(s: &Server, devices: &[(&str, u64)]) -> Value {
    let devices: Vec<Value> = devices
        .iter()
        .map(|(id, used)| json!({"id": id, "used_bytes": used}))
        .collect();
    let body = json!({ "devices": devices });
    let r = s.call("PUT", "/v1/targets/t0/heartbeat", Some(TARGET), Some(body));
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

fn kinds(s: &Server) -> Vec<String> {
    let r = s.read("/v1/events");
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_owned())
        .collect()
}

/// `(thin, capacity, used, free, provisioned)` of a `DeviceOut`.
fn numbers(d: &Value) -> (bool, u64, u64, u64, u64) {
    let n = |k: &str| d[k].as_u64().unwrap_or_else(|| panic!("{k} in {d}"));
    let thin = d["thin"].as_bool().unwrap();
    let (cap, used, free) = (n("capacity_bytes"), n("used_bytes"), n("free_bytes"));
    (thin, cap, used, free, n("provisioned_bytes"))
}

#[test]
fn grain_pool_usage_comes_with_heartbeats() {
    let s = serve(tokens());
    cluster(&s);

    // Until its target reports, a grain pool uses nothing; a plain device
    // uses what is placed on it.
    let t = s.read("/v1/targets/t0").json();
    assert_eq!(numbers(&t["devices"][0]), (true, GRAIN, 0, GRAIN, 3 * MIB));
    assert_eq!(
        numbers(&t["devices"][1]),
        (false, 8 * MIB, 3 * MIB, 5 * MIB, 3 * MIB)
    );

    let t = heartbeat(&s, &[("g0", 50 * MIB)]);
    assert_eq!(
        numbers(&t["devices"][0]),
        (true, GRAIN, 50 * MIB, 50 * MIB, 3 * MIB)
    );
    assert_eq!(t["capacity"]["used_bytes"], 53 * MIB);
    assert_eq!(t["capacity"]["free_bytes"], 55 * MIB);
    assert_eq!(t["capacity"]["provisioned_bytes"], 6 * MIB);
    assert!(kinds(&s).is_empty());

    // 85 %: one warning, not repeated while use stays above 80 %.
    heartbeat(&s, &[("g0", 85 * MIB)]);
    let pool = s.read("/v1/pools/thin").json();
    assert_eq!(
        pool["capacity"],
        json!({
            "total_bytes": GRAIN,
            "used_bytes": 85 * MIB,
            "free_bytes": 15 * MIB,
            "free_extents": 15,
            "provisioned_bytes": 3 * MIB,
        })
    );
    assert_eq!(kinds(&s), ["capacity_warning"]);
    heartbeat(&s, &[("g0", 86 * MIB)]);
    assert_eq!(kinds(&s), ["capacity_warning"]);
    heartbeat(&s, &[("g0", 95 * MIB)]);
    heartbeat(&s, &[("g0", 95 * MIB)]);
    assert_eq!(kinds(&s), ["capacity_warning", "capacity_critical"]);
    let e = &s.read("/v1/events").json()[1];
    assert_eq!(e["time_ms"], T0, "{e}");
    assert!(e["message"].as_str().unwrap().contains("pool thin"), "{e}");

    let m = s.read("/metrics").body;
    for (pool, kind, v) in [
        ("thin", "capacity", GRAIN),
        ("thin", "used", 95 * MIB),
        ("thin", "provisioned", 3 * MIB),
        ("(unpooled)", "capacity", 8 * MIB),
        ("(unpooled)", "used", 3 * MIB),
        ("(unpooled)", "provisioned", 3 * MIB),
    ] {
        let line = format!("nvpool_pool_bytes{{pool=\"{pool}\",kind=\"{kind}\"}} {v}\n");
        assert!(m.contains(&line), "{line} in\n{m}");
    }

    // Every control plane on the store reads the report, whichever one
    // the target reached.
    let config = StateConfig {
        extent_bytes: MIB,
        ..StateConfig::default()
    };
    let other = Cluster::new(
        s.cluster.store().clone(),
        Arc::new(ManualClock::new(T0)),
        config,
    )
    .unwrap();
    let cap = other.capacity().unwrap();
    assert_eq!(cap.pools["thin"].used_bytes, 95 * MIB);

    // An empty body (an older target) reports nothing: the last report stays.
    let r = s.call("PUT", "/v1/targets/t0/heartbeat", Some(TARGET), None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["devices"][0]["used_bytes"], 95 * MIB);

    // A malformed report is refused, and records nothing.
    for bad in [
        "not json",
        "[]",
        r#"{"devices": 3}"#,
        r#"{"devices": [{"id": "g0"}]}"#,
        r#"{"devices": [{"id": "g0", "used_bytes": -1}]}"#,
        r#"{"devices": [], "extra": 1}"#,
        r#"{"devices": [{"id": "g0", "used_bytes": 1}, {"id": "g0", "used_bytes": 2}]}"#,
        r#"{"devices": [{"id": "a/b", "used_bytes": 1}]}"#,
        r#"{"devices": [{"id": "g0", "used_bytes": 9223372036854775808}]}"#,
    ] {
        let r = s.raw("PUT", "/v1/targets/t0/heartbeat", Some(TARGET), Some(bad));
        s.expect_error(&r, 400, "invalid");
    }
    let t = s.read("/v1/targets/t0").json();
    assert_eq!(t["devices"][0]["used_bytes"], 95 * MIB);

    // Devices the target does not have, or that are no grain pools, are
    // ignored: a plain device's use is what is placed on it.
    let t = heartbeat(&s, &[("gone", MIB), ("d1", 7 * MIB), ("g0", 10 * MIB)]);
    assert_eq!(numbers(&t["devices"][0]).2, 10 * MIB);
    assert_eq!(numbers(&t["devices"][1]).2, 3 * MIB);

    // Fallen below, the pool warns again when it crosses again.
    assert_eq!(kinds(&s).len(), 2);
    heartbeat(&s, &[("g0", 81 * MIB)]);
    assert_eq!(
        kinds(&s),
        ["capacity_warning", "capacity_critical", "capacity_warning"]
    );

    // The report goes with its target.
    let usage_key = "/target-usage/t0";
    assert!(s.cluster.store().get(usage_key).unwrap().is_some());
    for n in [1, 2] {
        let uuid = format!("{n:08x}-0000-4000-8000-000000000000");
        let r = s.admin("DELETE", &format!("/v1/volumes/{uuid}"), None);
        assert_eq!(r.status, 204, "{}", r.body);
    }
    assert_eq!(s.admin("DELETE", "/v1/pools/thin", None).status, 204);
    // Forced: the deleted volumes' extents stay taken until a reconcile
    // that this test's unreachable target never gets.
    let r = s.admin("DELETE", "/v1/targets/t0?force=true", None);
    assert_eq!(r.status, 204, "{}", r.body);
    assert!(s.cluster.store().get(usage_key).unwrap().is_none());
}
