//! The REST API over real HTTP: the router served on a loopback port, a
//! MemStore-backed cluster with a manual clock, and a minimal HTTP/1.1
//! client (one request per connection).

mod common;

use common::{read_request, serve, Server, ADMIN, MIB, READER, TARGET};
use nvpool_control::api::AuthConfig;
use nvpool_control::auth::{Principal, Tokens};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;

fn tokens() -> AuthConfig {
    AuthConfig::new(
        Tokens::new()
            .with(Principal::Admin, ADMIN)
            .with(Principal::Target, TARGET)
            .with(Principal::Reader, READER),
    )
}

fn registration(i: usize, rack: &str, devices: usize, extents: u64) -> Value {
    json!({
        "id": format!("t{i}"),
        "name": format!("host{i}"),
        "addr": format!("10.0.0.{i}:4420"),
        "admin_addr": format!("10.0.0.{i}:4480"),
        "labels": {"rack": rack, "host": format!("host{i}")},
        "devices": (0..devices).map(|d| json!({
            "id": format!("d{d}"),
            "backend": format!("file:/dev/nvme{d}n1"),
            "capacity_bytes": extents * MIB,
        })).collect::<Vec<_>>(),
    })
}

/// Four targets in two racks, each with two 8-extent devices.
fn cluster_of_four(s: &Server) {
    for i in 0..4 {
        let r = s.call(
            "POST",
            "/v1/targets",
            Some(TARGET),
            Some(registration(i, &format!("r{}", i % 2), 2, 8)),
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }
}

fn uuid(n: u8) -> String {
    format!("{n:08x}-0000-4000-8000-000000000000")
}

fn volume(name: &str, size_bytes: u64, layout: Value) -> Value {
    json!({"name": name, "size_bytes": size_bytes, "layout": layout})
}

#[test]
fn health_and_unknown_paths() {
    let s = serve(AuthConfig::default());
    let r = s.read("/healthz");
    assert_eq!((r.status, r.json()["status"].clone()), (200, json!("ok")));
    let r = s.read("/v2/nothing");
    s.expect_error(&r, 404, "not_found");
}

#[test]
fn targets_register_list_and_expire() {
    let s = serve(tokens());
    cluster_of_four(&s);
    let list = s.read("/v1/targets").json();
    let list = list.as_array().unwrap();
    assert_eq!(list.len(), 4);
    assert_eq!(list[0]["health"], "online");
    assert_eq!(list[0]["labels"]["rack"], "r0");
    assert_eq!(list[0]["capacity"]["total_bytes"], 16 * MIB);
    assert_eq!(list[0]["capacity"]["free_bytes"], 16 * MIB);
    assert_eq!(list[0]["devices"][1]["capacity_bytes"], 8 * MIB);

    let r = s.admin(
        "PUT",
        &format!("/v1/volumes/{}", uuid(1)),
        Some(volume("m", 2 * MIB, json!({"type": "raid1", "copies": 2}))),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let v = r.json();
    let down = v["extents"][0]["target"].as_str().unwrap().to_owned();
    let t = s.read(&format!("/v1/targets/{down}")).json();
    assert_eq!(t["capacity"]["used_bytes"], 2 * MIB);

    // Everyone but `down` keeps heartbeating past the timeout.
    s.clock
        .advance(nvpool_control::limits::HEARTBEAT_TIMEOUT_MS + 1);
    for i in 0..4 {
        let id = format!("t{i}");
        if id != down {
            let r = s.call(
                "PUT",
                &format!("/v1/targets/{id}/heartbeat"),
                Some(TARGET),
                None,
            );
            assert_eq!(r.status, 200, "{}", r.body);
            assert_eq!(r.json()["health"], "online");
        }
    }
    let t = s.read(&format!("/v1/targets/{down}")).json();
    assert_eq!(t["health"], "offline");
    let v = s.read(&format!("/v1/volumes/{}", uuid(1))).json();
    assert_eq!(v["status"], "degraded");
    let m = s.read("/metrics");
    assert_eq!(m.status, 200);
    assert!(m.headers.contains("text/plain"), "{}", m.headers);
    assert!(
        m.body
            .contains(&format!("nvpool_target_up{{target=\"{down}\"}} 0")),
        "{}",
        m.body
    );
    assert!(
        m.body.contains("nvpool_volumes{status=\"degraded\"} 1"),
        "{}",
        m.body
    );

    let r = s.call("PUT", "/v1/targets/nope/heartbeat", Some(TARGET), None);
    s.expect_error(&r, 404, "not_found");
    let r = s.read("/v1/targets/nope");
    s.expect_error(&r, 404, "not_found");
    let mut bad = registration(9, "r0", 1, 8);
    bad["id"] = json!("a/b");
    let r = s.call("POST", "/v1/targets", Some(TARGET), Some(bad));
    s.expect_error(&r, 400, "invalid");
    let mut bad = registration(9, "r0", 1, 8);
    bad["addr"] = json!("not an address");
    let r = s.call("POST", "/v1/targets", Some(TARGET), Some(bad));
    s.expect_error(&r, 400, "invalid");
}

#[test]
fn targets_register_an_https_admin_api() {
    let s = serve(tokens());
    let mut reg = registration(1, "r0", 1, 8);
    reg["admin_tls"] = json!(true);
    let r = s.call("POST", "/v1/targets", Some(TARGET), Some(reg.clone()));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["admin_tls"], true);
    assert_eq!(s.read("/v1/targets/t1").json()["admin_tls"], true);
    // Not a boolean: 400, and the record is unchanged.
    reg["admin_tls"] = json!("yes");
    let r = s.call("POST", "/v1/targets", Some(TARGET), Some(reg));
    s.expect_error(&r, 400, "invalid");
    assert_eq!(s.read("/v1/targets/t1").json()["admin_tls"], true);
    // Registered again without it: plain HTTP.
    let r = s.call(
        "POST",
        "/v1/targets",
        Some(TARGET),
        Some(registration(1, "r0", 1, 8)),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["admin_tls"], false);
}

#[test]
fn targets_register_an_rdma_listener() {
    let s = serve(tokens());
    let mut reg = registration(1, "r0", 1, 8);
    reg["rdma_addr"] = json!("10.0.0.1:4421");
    let r = s.call("POST", "/v1/targets", Some(TARGET), Some(reg.clone()));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["rdma_addr"], "10.0.0.1:4421");
    let r = s.call(
        "POST",
        "/v1/targets",
        Some(TARGET),
        Some(registration(2, "r1", 1, 8)),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["rdma_addr"], Value::Null, "TCP only");
    let list = s.read("/v1/targets").json();
    let rdma: Vec<&Value> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|t| &t["rdma_addr"])
        .collect();
    assert_eq!(rdma, [&json!("10.0.0.1:4421"), &Value::Null]);
    let t = s.read("/v1/targets/t1").json();
    assert_eq!(t["rdma_addr"], "10.0.0.1:4421");

    // Addresses nobody can connect to, or no address: 400, and the
    // stored registration is unchanged.
    for bad in [
        json!("0.0.0.0:4420"),
        json!("[::]:4420"),
        json!("10.0.0.1:0"),
        json!("10.0.0.1"),
        json!("rdma:10.0.0.1:4420"),
        json!(4420),
    ] {
        let mut b = reg.clone();
        b["rdma_addr"] = bad.clone();
        let r = s.call("POST", "/v1/targets", Some(TARGET), Some(b));
        s.expect_error(&r, 400, "invalid");
        assert!(
            r.json()["message"].as_str().unwrap().contains("rdma_addr"),
            "{bad}: {}",
            r.body
        );
    }
    let t = s.read("/v1/targets/t1").json();
    assert_eq!(t["rdma_addr"], "10.0.0.1:4421");

    // Re-registering without it: the target no longer offers RDMA.
    let r = s.call(
        "POST",
        "/v1/targets",
        Some(TARGET),
        Some(registration(1, "r0", 1, 8)),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["rdma_addr"], Value::Null);
}

/// Requests a [`FakeAdmin`] saw: the request line and the `Authorization`
/// header.
type Seen = std::sync::Arc<std::sync::Mutex<Vec<(String, Option<String>)>>>;

/// A stand-in for a target's admin API on a loopback port: answers every
/// request 200 with `[]` and records its request line and
/// `Authorization` header.
struct FakeAdmin {
    addr: std::net::SocketAddr,
    seen: Seen,
}

impl FakeAdmin {
    fn start() -> FakeAdmin {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let seen = Seen::default();
        let log = seen.clone();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                let r = read_request(&mut s);
                log.lock().unwrap().push((r.line, r.authorization));
                let _ = s.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\
                      Content-Length: 2\r\nConnection: close\r\n\r\n[]",
                );
            }
        });
        FakeAdmin { addr, seen }
    }

    fn seen(&self) -> Vec<(String, Option<String>)> {
        self.seen.lock().unwrap().clone()
    }
}

/// A target's admin token comes with its registration, is kept apart and
/// never shown, and goes as a bearer token with every call the control
/// plane makes to that target (each target its own).
#[test]
fn each_target_gets_its_own_admin_token_and_nobody_sees_it() {
    let s = serve(tokens());
    let fakes: Vec<FakeAdmin> = (0..3).map(|_| FakeAdmin::start()).collect();
    let token = |i: usize| format!("admin-token-of-t{i}-0123456789");
    for (i, f) in fakes.iter().enumerate() {
        let mut reg = registration(i, "r0", 1, 8);
        reg["admin_addr"] = json!(f.addr.to_string());
        if i < 2 {
            reg["admin_token"] = json!(token(i));
        }
        let r = s.call("POST", "/v1/targets", Some(TARGET), Some(reg));
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(!r.body.contains("admin-token-of"), "{}", r.body);
        assert!(r.json().get("admin_token").is_none());
    }
    // A re-registration without the field keeps the token.
    let mut reg = registration(0, "r0", 1, 8);
    reg["admin_addr"] = json!(fakes[0].addr.to_string());
    let r = s.call("POST", "/v1/targets", Some(TARGET), Some(reg.clone()));
    assert_eq!(r.status, 200, "{}", r.body);
    // A token that is no token: 400, and it is not quoted back.
    reg["admin_token"] = json!("short");
    let r = s.call("POST", "/v1/targets", Some(TARGET), Some(reg));
    s.expect_error(&r, 400, "invalid");
    assert!(!r.body.contains("short\""), "{}", r.body);
    for path in ["/v1/targets", "/v1/targets/t0", "/v1/targets/t1"] {
        let r = s.call("GET", path, Some(READER), None);
        assert_eq!(r.status, 200);
        assert!(!r.body.contains("admin-token-of"), "{path}: {}", r.body);
    }
    for i in 0..3 {
        let r = s.admin("POST", &format!("/v1/targets/t{i}/reconcile"), None);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    for (i, f) in fakes.iter().enumerate() {
        let seen = f.seen();
        assert!(seen.len() >= 2, "t{i}: {seen:?}");
        let want = (i < 2).then(|| format!("Bearer {}", token(i)));
        for (request, auth) in &seen {
            assert_eq!(auth, &want, "t{i}: {request}");
        }
    }
    // Gone with the target.
    let r = s.admin("DELETE", "/v1/targets/t1", None);
    assert_eq!(r.status, 204, "{}", r.body);
    assert_eq!(s.cluster.target_credential("t1").unwrap(), None);
    assert!(s.cluster.target_credential("t0").unwrap().is_some());
}

/// No two targets share an address: a new ID with another target's
/// `addr`, `admin_addr` or `rdma_addr` is refused with 409 naming that
/// target; a target re-registering keeps or changes its own, and an
/// address it gave up is free for the next.
#[test]
fn target_addresses_are_unique() {
    let s = serve(tokens());
    let post = |b: Value| s.call("POST", "/v1/targets", Some(TARGET), Some(b));
    let mut t1 = registration(1, "r0", 1, 8);
    t1["rdma_addr"] = json!("10.0.0.1:4420");
    assert_eq!(post(t1.clone()).status, 200);
    for (field, value) in [
        ("addr", "10.0.0.1:4420"),
        ("admin_addr", "10.0.0.1:4480"),
        ("rdma_addr", "10.0.0.1:4420"),
    ] {
        let mut b = registration(2, "r1", 1, 8);
        b[field] = json!(value);
        let r = post(b);
        s.expect_error(&r, 409, "address_taken");
        let j = r.json();
        assert_eq!(j["details"]["target"], "t1", "{j}");
        assert_eq!(j["details"]["field"], field, "{j}");
        assert_eq!(j["details"]["addr"], value, "{j}");
        assert!(j["message"].as_str().unwrap().contains("t1"), "{j}");
        let r = s.call("GET", "/v1/targets/t2", Some(READER), None);
        assert_eq!(r.status, 404, "nothing of t2 was recorded: {}", r.body);
    }
    // The same ID again, same addresses or new ones: fine.
    assert_eq!(post(t1.clone()).status, 200);
    let mut moved = t1.clone();
    moved["admin_addr"] = json!("10.0.0.11:4480");
    assert_eq!(post(moved).status, 200);
    // The old admin address is free now; the new one is not.
    let mut t2 = registration(2, "r1", 1, 8);
    t2["admin_addr"] = json!("10.0.0.1:4480");
    let r = post(t2.clone());
    assert_eq!(r.status, 200, "{}", r.body);
    t2["admin_addr"] = json!("10.0.0.11:4480");
    s.expect_error(&post(t2), 409, "address_taken");
    // A removed target's addresses are free.
    let r = s.admin("DELETE", "/v1/targets/t1", None);
    assert_eq!(r.status, 204, "{}", r.body);
    let mut t3 = registration(3, "r0", 1, 8);
    t3["addr"] = json!("10.0.0.1:4420");
    t3["admin_addr"] = json!("10.0.0.11:4480");
    let r = post(t3);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(s.cluster.check().unwrap().is_empty());
}

/// What `nvpool-target` sends reaches the target record.
#[test]
fn a_target_daemon_registers_its_rdma_listener() {
    use nvpool_target::register::ControlPlaneUrl;
    use nvpool_target::{Registrar, RegistrationConfig};
    let s = serve(tokens());
    let url = ControlPlaneUrl::parse(&format!("http://{}", s.addr)).unwrap();
    let register = |id: &str, ip: &str, rdma: Option<&str>| {
        let mut rc = RegistrationConfig::new(
            url.clone(),
            id.into(),
            id.into(),
            format!("{ip}:4420").parse().unwrap(),
            format!("{ip}:4480").parse().unwrap(),
        );
        rc.token = Some(TARGET.into());
        rc.rdma_addr = rdma.map(|a| a.parse().unwrap());
        let r = Registrar::start(rc).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while r.status().registrations == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "{id} did not register: {:?}",
                r.status()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        r.stop();
        s.read(&format!("/v1/targets/{id}")).json()
    };
    assert_eq!(
        register("t7", "10.0.0.7", Some("10.0.0.7:4421"))["rdma_addr"],
        "10.0.0.7:4421"
    );
    assert_eq!(register("t8", "10.0.0.8", None)["rdma_addr"], Value::Null);
}

/// An RDMA listener added to (or removed from) a running target reaches
/// its record: the registrar reads the listeners before each heartbeat and
/// registers again when the address to advertise changes.
#[test]
fn a_target_registers_again_when_its_rdma_listeners_change() {
    use nvpool_target::register::{ControlPlaneUrl, RdmaListeners};
    use nvpool_target::{Registrar, RegistrationConfig};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    let s = serve(tokens());
    let url = ControlPlaneUrl::parse(&format!("http://{}", s.addr)).unwrap();
    let listeners: Arc<Mutex<Vec<std::net::SocketAddr>>> = Arc::default();
    let mut rc = RegistrationConfig::new(
        url,
        "t9".into(),
        "t9".into(),
        "10.0.0.9:4420".parse().unwrap(),
        "10.0.0.9:4480".parse().unwrap(),
    );
    rc.token = Some(TARGET.into());
    rc.heartbeat_interval = Duration::from_millis(50);
    let l = listeners.clone();
    rc.rdma_listeners = Some(RdmaListeners(Arc::new(move || l.lock().unwrap().clone())));
    let r = Registrar::start(rc).unwrap();
    let rdma_of = || s.read("/v1/targets/t9").json()["rdma_addr"].clone();
    let wait = |what: &str, want: Value| {
        nvpool_testkit::wait_for(what, Duration::from_secs(10), || rdma_of() == want)
    };
    // The record exists (a 404's body has no rdma_addr either).
    nvpool_testkit::wait_for("the first registration", Duration::from_secs(10), || {
        r.status().registrations > 0
    });
    wait("registered without RDMA", Value::Null);
    // One on every address advertises the TCP address's IP.
    *listeners.lock().unwrap() = vec!["0.0.0.0:4421".parse().unwrap()];
    wait("the new RDMA listener advertised", json!("10.0.0.9:4421"));
    listeners.lock().unwrap().clear();
    wait("the removed listener withdrawn", Value::Null);
    // The registrar counts a registration once its answer is read, which
    // can be just after the record changed.
    nvpool_testkit::wait_for("three registrations", Duration::from_secs(10), || {
        r.status().registrations >= 3
    });
    r.stop();
}

#[test]
fn every_layout_and_idempotent_create() {
    let s = serve(tokens());
    cluster_of_four(&s);
    let layouts = [
        json!({"type": "concat"}),
        json!({"type": "raid0", "stripe_bytes": 65536, "width": 4}),
        json!({"type": "raid1", "copies": 3}),
        json!({"type": "raid10", "stripe_bytes": 4096, "width": 2, "copies": 2}),
    ];
    for (i, layout) in layouts.iter().enumerate() {
        let path = format!("/v1/volumes/{}", uuid(i as u8 + 1));
        let body = volume(&format!("vol{i}"), 2 * MIB, layout.clone());
        let first = s.admin("PUT", &path, Some(body.clone()));
        assert_eq!(first.status, 201, "{layout}: {}", first.body);
        let v = first.json();
        assert_eq!(v["layout"], *layout);
        assert_eq!(v["size_bytes"], 2 * MIB);
        assert_eq!(v["status"], "online");
        let again = s.admin("PUT", &path, Some(body));
        assert_eq!(again.status, 200, "a retried create is OK");
        assert_eq!(again.json()["extents"], v["extents"], "and changes nothing");
        let got = s.read(&path).json();
        assert_eq!(got["extents"], v["extents"]);
    }
    let list = s.read("/v1/volumes").json();
    assert_eq!(list.as_array().unwrap().len(), 4);

    // Same UUID, different spec.
    let r = s.admin(
        "PUT",
        &format!("/v1/volumes/{}", uuid(1)),
        Some(volume("vol0", 4 * MIB, json!({"type": "concat"}))),
    );
    s.expect_error(&r, 409, "uuid_conflict");
    assert_eq!(r.json()["details"]["existing"]["size_bytes"], 2 * MIB);
    // Same name, other UUID.
    let r = s.admin(
        "PUT",
        &format!("/v1/volumes/{}", uuid(9)),
        Some(volume("vol0", MIB, json!({"type": "concat"}))),
    );
    s.expect_error(&r, 409, "name_taken");

    let m = s.read("/metrics").body;
    assert!(m.contains("nvpool_volumes{status=\"online\"} 4"), "{m}");
    assert!(
        m.contains(&format!(
            "nvpool_capacity_bytes{{kind=\"total\"}} {}",
            64 * MIB
        )),
        "{m}"
    );
    // concat 2 + raid0 (one row of 4) 4 + raid1×3 6 + raid10 (one row of 2×2) 4.
    assert!(
        m.contains(&format!(
            "nvpool_capacity_bytes{{kind=\"used\"}} {}",
            16 * MIB
        )),
        "{m}"
    );
    assert!(
        m.contains(&format!(
            "nvpool_capacity_bytes{{kind=\"free\"}} {}",
            48 * MIB
        )),
        "{m}"
    );
}

#[test]
fn impossible_placement_is_422_and_creates_nothing() {
    let s = serve(tokens());
    cluster_of_four(&s);
    let wide = volume(
        "wide",
        MIB,
        json!({"type": "raid10", "stripe_bytes": 4096, "width": 4, "copies": 2}),
    );
    let r = s.admin("PUT", &format!("/v1/volumes/{}", uuid(1)), Some(wide));
    s.expect_error(&r, 422, "not_enough_targets");
    assert_eq!(r.json()["details"]["need"], 8);
    let huge = volume("huge", 65 * MIB, json!({"type": "concat"}));
    let r = s.admin("PUT", &format!("/v1/volumes/{}", uuid(2)), Some(huge));
    s.expect_error(&r, 422, "no_space");
    let list = s.read("/v1/volumes").json();
    assert_eq!(list, json!([]), "nothing half-created");
    let r = s.read(&format!("/v1/volumes/{}", uuid(1)));
    s.expect_error(&r, 404, "not_found");
}

#[test]
fn bad_input_is_400_never_500() {
    let s = serve(tokens());
    cluster_of_four(&s);
    let path = format!("/v1/volumes/{}", uuid(1));
    let concat = json!({"type": "concat"});
    let cases: Vec<(&str, Value)> = vec![
        ("zero size", volume("v", 0, concat.clone())),
        ("unaligned size", volume("v", MIB + 1, concat.clone())),
        ("unknown layout", volume("v", MIB, json!({"type": "raid5"}))),
        (
            "layout missing fields",
            volume("v", MIB, json!({"type": "raid0"})),
        ),
        (
            "one copy",
            volume("v", MIB, json!({"type": "raid1", "copies": 1})),
        ),
        (
            "odd stripe",
            volume(
                "v",
                MIB,
                json!({"type": "raid0", "stripe_bytes": 3000, "width": 2}),
            ),
        ),
        ("bad name", volume("a b/c", MIB, concat.clone())),
        ("empty name", volume("", MIB, concat.clone())),
        (
            "negative size",
            json!({"name": "v", "size_bytes": -1, "layout": concat}),
        ),
        (
            "unknown field",
            json!({"name": "v", "size_bytes": MIB, "layout": concat, "colour": "red"}),
        ),
        (
            "fractional size",
            json!({"name": "v", "size_bytes": 1048576.5, "layout": concat}),
        ),
        (
            "concat with a width",
            volume("v", MIB, json!({"type": "concat", "width": 2})),
        ),
        (
            "concat with copies",
            volume("v", MIB, json!({"type": "concat", "copies": 2})),
        ),
        (
            "raid1 with a width",
            volume("v", MIB, json!({"type": "raid1", "copies": 2, "width": 2})),
        ),
        (
            "bad pool name",
            json!({"name": "v", "size_bytes": MIB, "layout": concat, "pool": "a/b"}),
        ),
    ];
    for (what, body) in cases {
        let r = s.admin("PUT", &path, Some(body));
        assert_eq!(r.status, 400, "{what}: {}", r.body);
        assert!(r.json()["kind"].is_string(), "{what}");
    }
    // JSON Schema's integers include 1048576.0.
    let r = s.admin(
        "PUT",
        &format!("/v1/volumes/{}", uuid(9)),
        Some(json!({"name": "w", "size_bytes": 1048576.0, "layout": {"type": "raid1", "copies": 2.0}})),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let r = s.admin("DELETE", &format!("/v1/volumes/{}", uuid(9)), None);
    assert_eq!(r.status, 204, "{}", r.body);
    let r = s.admin(
        "PUT",
        "/v1/volumes/not-a-uuid",
        Some(volume("v", MIB, concat.clone())),
    );
    s.expect_error(&r, 400, "invalid");
    let r = s.read("/v1/volumes/not-a-uuid");
    s.expect_error(&r, 400, "invalid");
    // A segment that is not UTF-8 once percent-decoded: a JSON 400 as well.
    let r = s.read("/v1/volumes/%FF%FE");
    s.expect_error(&r, 400, "invalid");
    let r = s.read("/v1/volumes/x/attachments/%C3%28");
    s.expect_error(&r, 400, "invalid");
    let r = s.raw("PUT", &path, Some(ADMIN), Some("{\"name\": "));
    s.expect_error(&r, 400, "invalid");
    let r = s.raw("POST", "/v1/targets", Some(TARGET), Some("[1, 2"));
    s.expect_error(&r, 400, "invalid");
    // A body without a JSON content type.
    let mut stream = TcpStream::connect(s.addr).unwrap();
    let body = volume("v", MIB, concat).to_string();
    write!(
        stream,
        "PUT {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {ADMIN}\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 415"), "{out}");
    assert!(out.contains("unsupported_media_type"), "{out}");
    assert_eq!(s.read("/v1/volumes").json(), json!([]));
}

#[test]
fn resync_endpoints_refuse_bad_input() {
    let s = serve(tokens());
    cluster_of_four(&s);
    let v = uuid(9);
    let r = s.admin(
        "PUT",
        &format!("/v1/volumes/{v}"),
        Some(volume("m", 4 * MIB, json!({"type": "raid1", "copies": 2}))),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    let host = "nqn.2014-08.org.nvmexpress:uuid:nobody";
    let base = format!("/v1/volumes/{v}/attachments/{host}");
    // Not attached: 404 at once, also for a watching GET.
    let r = s.admin(
        "PUT",
        &format!("{base}/session"),
        Some(json!({"session": 1, "revision": 0})),
    );
    s.expect_error(&r, 404, "not_found");
    let r = s.read(&format!("{base}?after_revision=0"));
    s.expect_error(&r, 404, "not_found");
    let r = s.read(&format!("{base}?after_revision=x"));
    assert_eq!(r.status, 400, "{}", r.body);
    // Malformed bodies and ids.
    let r = s.admin(
        "PUT",
        &format!("{base}/sync/abc"),
        Some(json!({"session": 1, "missed_regions": []})),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let r = s.admin(
        "PUT",
        &format!("{base}/sync/1"),
        Some(json!({"session": "one"})),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let r = s.admin(
        "PUT",
        &format!("{base}/missed"),
        Some(json!({"session": 1, "extents": {"first": [0]}})),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let r = s.admin(
        "PUT",
        &format!("{base}/missed"),
        Some(json!({"session": 1, "extents": {"99": [0]}})),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    // A job that does not exist is over.
    let r = s.admin(
        "PUT",
        &format!("{base}/sync/7"),
        Some(json!({"session": 1, "missed_regions": null})),
    );
    s.expect_error(&r, 404, "not_found");
    // Without the admin token nothing is recorded.
    let r = s.call(
        "PUT",
        &format!("{base}/session"),
        None,
        Some(json!({"session": 1, "revision": 0})),
    );
    assert_eq!(r.status, 401, "{}", r.body);
    // History: empty for a new volume, 404 for none.
    let r = s.read(&format!("/v1/volumes/{v}/history"));
    assert_eq!((r.status, r.json()), (200, json!([])));
    let r = s.read(&format!("/v1/volumes/{}/history", uuid(10)));
    s.expect_error(&r, 404, "not_found");
    let m = s.read("/metrics").body;
    assert!(m.contains("nvpool_copies_running 0"), "{m}");
    assert!(m.contains("nvpool_stale_extents 0"), "{m}");
}

/// Every operation of the OpenAPI document (the routes the server
/// serves, see `openapi_names_every_route`), with every kind of token:
/// none and unknown ones get 401, a known token whose role may not make
/// the call 403, and the roles the document lists get past the check.
/// Generated from the document, so a new route is checked without being
/// named here.
#[test]
fn every_route_checks_the_token_and_its_role() {
    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000001";
    const OTHER: &str = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000002";
    const HOST_TOKEN: &str = "host-secret-0123456789";
    const OTHER_TOKEN: &str = "other-host-secret-0123456789";
    // Target tokens bound to t0 (the id every `{id}` is filled with) and
    // to another target.
    const T0_TOKEN: &str = "bound-t0-secret-0123456789";
    const T9_TOKEN: &str = "bound-t9-secret-0123456789";
    let s = serve(AuthConfig::new(
        Tokens::new()
            .with(Principal::Admin, ADMIN)
            .with(Principal::Target, TARGET)
            .with(Principal::BoundTarget("t0".into()), T0_TOKEN)
            .with(Principal::BoundTarget("t9".into()), T9_TOKEN)
            .with(Principal::Reader, READER)
            .with(Principal::Host(HOST.into()), HOST_TOKEN)
            .with(Principal::Host(OTHER.into()), OTHER_TOKEN),
    ));
    let owner = format!("nqn.2026-11.io.nvpool:owner:{}:t0", uuid(1));
    let doc: Value = serde_json::from_str(&nvpool_control::api::openapi_json()).unwrap();
    let mut checked = 0;
    for (template, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let method = method.to_ascii_uppercase();
            let fill = |host: &str| {
                template
                    .replace("{uuid}", &uuid(1))
                    .replace("{id}", "t0")
                    .replace("{name}", "p")
                    .replace("{index}", "0")
                    .replace("{job}", "1")
                    .replace("{host_nqn}", &host.replace(':', "%3A"))
            };
            let call = |token: Option<&str>, host: &str| {
                let body = (method != "GET" && method != "DELETE").then(|| json!({}));
                s.call(&method, &fill(host), token, body)
            };
            let allowed: Vec<&str> = op["security"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .flat_map(|r| r.as_object().unwrap().keys())
                        .map(String::as_str)
                        .collect()
                })
                .unwrap_or_default();
            let what = format!("{method} {template}");
            if allowed.is_empty() {
                assert!(
                    ["/healthz", "/v1/openapi.json"].contains(&template.as_str()),
                    "{what} is public"
                );
                assert_eq!(call(None, HOST).status, 200, "{what}");
                continue;
            }
            for r in [call(None, HOST), call(Some("not-a-known-token-000"), HOST)] {
                s.expect_error(&r, 401, "unauthorized");
                assert!(r.headers.contains("www-authenticate: Bearer"), "{what}");
            }
            for (scheme, token) in [
                ("admin_token", ADMIN),
                ("reader_token", READER),
                ("target_token", TARGET),
                ("host_token", HOST_TOKEN),
            ] {
                let r = call(Some(token), HOST);
                let passes = allowed.contains(&scheme)
                    && (scheme != "target_token"
                        || method == "GET"
                        || !template.contains("{host_nqn}"));
                if passes {
                    assert!(
                        r.status != 401 && r.status != 403,
                        "{what} with a {scheme}: {} {}",
                        r.status,
                        r.body
                    );
                    assert!(!r.body.contains("no such endpoint"), "{what} is not served");
                } else {
                    s.expect_error(&r, 403, "forbidden");
                }
            }
            if template.contains("{id}") && method != "GET" && allowed.contains(&"target_token") {
                // A bound target token acts for its own target only.
                let r = call(Some(T0_TOKEN), HOST);
                assert!(r.status != 401 && r.status != 403, "{what}: {}", r.body);
                s.expect_error(&call(Some(T9_TOKEN), HOST), 403, "forbidden");
            }
            if template.contains("{host_nqn}") && method != "GET" && allowed.contains(&"host_token")
            {
                // A host acts for itself only.
                s.expect_error(&call(Some(OTHER_TOKEN), HOST), 403, "forbidden");
                // An owner NQN the control plane did not issue (no such
                // volume is served): refused whatever the token, even the
                // admin's or the target's it names (issue 25; an issued
                // owner reporting is tests/own_initiators.rs).
                for token in [ADMIN, TARGET, T0_TOKEN, T9_TOKEN, HOST_TOKEN, READER] {
                    s.expect_error(&call(Some(token), &owner), 403, "forbidden");
                }
            }
            checked += 1;
        }
    }
    assert!(checked >= 30, "only {checked} operations checked");
}

/// A target token bound to one target id (`target TOKEN ID`) registers
/// that target only.
#[test]
fn a_bound_target_token_registers_its_own_target_only() {
    const T1_TOKEN: &str = "bound-t1-secret-0123456789";
    let s = serve(AuthConfig::new(
        Tokens::new()
            .with(Principal::Admin, ADMIN)
            .with(Principal::BoundTarget("t1".into()), T1_TOKEN),
    ));
    let r = s.call(
        "POST",
        "/v1/targets",
        Some(T1_TOKEN),
        Some(registration(0, "r0", 1, 8)),
    );
    s.expect_error(&r, 403, "forbidden");
    assert_eq!(
        s.call("GET", "/v1/targets/t0", Some(ADMIN), None).status,
        404
    );
    let r = s.call(
        "POST",
        "/v1/targets",
        Some(T1_TOKEN),
        Some(registration(1, "r1", 1, 8)),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let r = s.call("PUT", "/v1/targets/t1/heartbeat", Some(T1_TOKEN), None);
    assert_eq!(r.status, 200, "{}", r.body);
}

/// The router's routes, read from its source, are the document's paths:
/// a route added to the router but not to the document would escape
/// `every_route_checks_the_token_and_its_role`.
/// A device's capacity is bounded, and the totals are exact at the bound:
/// a device of 2^64-1 bytes once made `/metrics` wrap.
#[test]
fn capacities_are_bounded_and_totals_do_not_wrap() {
    let s = serve(tokens());
    let mut reg = registration(0, "r0", 1, 1);
    reg["devices"][0]["capacity_bytes"] = json!(u64::MAX);
    let r = s.call("POST", "/v1/targets", Some(TARGET), Some(reg.clone()));
    s.expect_error(&r, 400, "invalid");
    assert!(r.body.contains("at most"), "{}", r.body);
    let max = nvpool_control::limits::DEVICE_BYTES_MAX;
    for i in 0..4 {
        let mut reg = registration(i, "r0", 2, 1);
        for d in 0..2 {
            reg["devices"][d]["capacity_bytes"] = json!(max);
        }
        let r = s.call("POST", "/v1/targets", Some(TARGET), Some(reg));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let m = s.read("/metrics").body;
    let total = format!("nvpool_capacity_bytes{{kind=\"total\"}} {}", 8 * max);
    assert!(m.contains(&total), "{m}");
    let t = s.read("/v1/targets/t3").json();
    assert_eq!(t["devices"][1]["capacity_bytes"], json!(max), "{t}");
}

#[test]
fn openapi_names_every_route() {
    let source = include_str!("../src/api/mod.rs");
    let router = &source[source.find("pub fn router(").unwrap()..];
    let router = &router[..router.find("\n}\n").unwrap()];
    let mut routes: Vec<&str> = router
        .split(".route(")
        .skip(1)
        .map(|r| {
            r.trim_start()
                .trim_start_matches('"')
                .split('"')
                .next()
                .unwrap()
        })
        .collect();
    routes.sort_unstable();
    let doc: Value = serde_json::from_str(&nvpool_control::api::openapi_json()).unwrap();
    let mut paths: Vec<&str> = doc["paths"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    paths.sort_unstable();
    assert!(routes.len() > 20, "{routes:?}");
    assert_eq!(routes, paths);
}

#[test]
fn pools_resize_and_delete() {
    let s = serve(tokens());
    cluster_of_four(&s);
    let fast: Vec<Value> = (0..4)
        .map(|i| json!({"target": format!("t{i}"), "device": "d1"}))
        .collect();
    let r = s.admin("PUT", "/v1/pools/fast", Some(json!({"devices": fast})));
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.json()["capacity"]["total_bytes"], 32 * MIB);
    let r = s.admin("PUT", "/v1/pools/fast", Some(json!({"devices": fast})));
    assert_eq!(r.status, 200, "idempotent");
    let r = s.admin(
        "PUT",
        "/v1/pools/fast",
        Some(json!({"devices": &fast[..2]})),
    );
    s.expect_error(&r, 409, "pool_conflict");
    let r = s.admin(
        "PUT",
        "/v1/pools/other",
        Some(json!({"devices": &fast[..1]})),
    );
    s.expect_error(&r, 409, "device_in_pool");
    let r = s.admin(
        "PUT",
        "/v1/pools/other",
        Some(json!({"devices": [{"target": "t0", "device": "d9"}]})),
    );
    s.expect_error(&r, 422, "unknown_device");
    let r = s.admin("PUT", "/v1/pools/a%2Fb", Some(json!({"devices": []})));
    s.expect_error(&r, 400, "invalid");

    let path = format!("/v1/volumes/{}", uuid(1));
    let mut body = volume("pooled", 2 * MIB, json!({"type": "raid1", "copies": 2}));
    body["pool"] = json!("fast");
    let v = s.admin("PUT", &path, Some(body)).json();
    assert!(
        v["extents"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["device"] == "d1"),
        "{v}"
    );
    let p = s.read("/v1/pools/fast").json();
    assert_eq!(p["capacity"]["used_bytes"], 4 * MIB);
    assert_eq!(s.read("/v1/pools").json().as_array().unwrap().len(), 1);
    let r = s.read("/v1/pools/none");
    s.expect_error(&r, 404, "not_found");
    let mut body = volume("lost", MIB, json!({"type": "concat"}));
    body["pool"] = json!("none");
    let r = s.admin("PUT", &format!("/v1/volumes/{}", uuid(2)), Some(body));
    s.expect_error(&r, 404, "not_found");

    // Grow, then refuse to shrink or overfill.
    let r = s.admin(
        "POST",
        &format!("{path}/resize"),
        Some(json!({"size_bytes": 5 * MIB})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["size_bytes"], 5 * MIB);
    assert_eq!(v["extents"].as_array().unwrap().len(), 10);
    let r = s.admin(
        "POST",
        &format!("{path}/resize"),
        Some(json!({"size_bytes": MIB})),
    );
    s.expect_error(&r, 409, "shrink");
    let r = s.admin(
        "POST",
        &format!("{path}/resize"),
        Some(json!({"size_bytes": 64 * MIB})),
    );
    s.expect_error(&r, 422, "no_space");
    let r = s.admin(
        "POST",
        &format!("{path}/resize"),
        Some(json!({"size_bytes": 5 * MIB + 1})),
    );
    s.expect_error(&r, 400, "invalid");
    let r = s.admin(
        "POST",
        &format!("/v1/volumes/{}/resize", uuid(7)),
        Some(json!({"size_bytes": MIB})),
    );
    s.expect_error(&r, 404, "not_found");

    let r = s.admin("DELETE", "/v1/pools/fast", None);
    s.expect_error(&r, 409, "pool_in_use");
    assert_eq!(s.admin("DELETE", &path, None).status, 204);
    let r = s.admin("DELETE", &path, None);
    s.expect_error(&r, 404, "not_found");
    assert_eq!(s.admin("DELETE", "/v1/pools/fast", None).status, 204);
    let r = s.admin("DELETE", "/v1/pools/fast", None);
    s.expect_error(&r, 404, "not_found");
    assert_eq!(s.read("/v1/pools").json(), json!([]));
    let m = s.read("/metrics").body;
    assert!(m.contains("nvpool_capacity_bytes{kind=\"used\"} 0"), "{m}");
}

/// `docs/openapi.json` is the document the code generates. Regenerate it
/// with `NVPOOL_BLESS=1 cargo test -p nvpool-control --test api openapi_is_current`.
#[test]
fn openapi_is_current() {
    let generated = nvpool_control::api::openapi_json();
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/openapi.json");
    if std::env::var_os("NVPOOL_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "{} is stale (or missing); regenerate it with\n  \
         NVPOOL_BLESS=1 cargo test -p nvpool-control --test api openapi_is_current",
        path.display()
    );
    let s = serve(AuthConfig::default());
    let r = s.read("/v1/openapi.json");
    assert_eq!(r.status, 200);
    assert_eq!(r.body, generated, "the daemon serves the same document");
    let doc = r.json();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    for p in [
        "/v1/volumes/{uuid}",
        "/v1/targets",
        "/v1/pools/{name}",
        "/metrics",
        "/healthz",
    ] {
        assert!(doc["paths"][p].is_object(), "{p} is documented");
    }
}

/// One request with exactly these header lines (besides Host, Connection
/// and Content-Length): status, head and body.
fn send_with(s: &Server, method: &str, path: &str, headers: &[&str], body: &str) -> common::Reply {
    let mut stream = TcpStream::connect(s.addr).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    for h in headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    stream.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").expect("a whole answer");
    common::Reply {
        status: head[9..12].parse().unwrap(),
        headers: head.to_owned(),
        body: body.to_owned(),
    }
}

#[test]
fn request_bodies_are_json_objects_without_duplicate_keys() {
    let s = serve(tokens());
    cluster_of_four(&s);
    let admin = format!("Authorization: Bearer {ADMIN}");
    let json = "Content-Type: application/json";
    // An array where the schema has an object starts nothing.
    let r = send_with(&s, "POST", "/v1/rebalance", &[&admin, json], "[]");
    s.expect_error(&r, 400, "invalid");
    let r = send_with(&s, "POST", "/v1/rebalance", &[&admin, json], "[true]");
    s.expect_error(&r, 400, "invalid");
    assert_eq!(s.read("/v1/rebalance").json()["pending"], json!([]));
    let r = send_with(
        &s,
        "POST",
        "/v1/rebalance",
        &[&admin, json],
        r#"{"dry_run": true, "dry_run": false}"#,
    );
    s.expect_error(&r, 400, "invalid");
    assert!(r.json()["message"]
        .as_str()
        .unwrap()
        .contains("duplicate key"));
    assert_eq!(s.read("/v1/rebalance").json()["pending"], json!([]));
    // The same rules below the top level.
    let path = format!("/v1/volumes/{}", uuid(1));
    for (what, body) in [
        (
            "a key twice",
            r#"{"name": "v", "name": "w", "size_bytes": 1048576, "layout": {"type": "concat"}}"#,
        ),
        (
            "a nested key twice",
            r#"{"name": "v", "size_bytes": 1048576, "layout": {"type": "raid1", "copies": 2, "copies": 3}}"#,
        ),
        (
            "a layout as an array",
            r#"{"name": "v", "size_bytes": 1048576, "layout": ["concat"]}"#,
        ),
        (
            "the body as an array",
            r#"["v", 1048576, {"type": "concat"}]"#,
        ),
    ] {
        let r = send_with(&s, "PUT", &path, &[&admin, json], body);
        assert_eq!(r.status, 400, "{what}: {}", r.body);
        assert_eq!(r.json()["kind"], "invalid", "{what}");
    }
    let r = send_with(
        &s,
        "POST",
        "/v1/pools/p1",
        &[&admin, json],
        r#"{"devices": [["t0", "d0"]]}"#,
    );
    assert_eq!(r.status, 405, "{}", r.body);
    let r = send_with(
        &s,
        "PUT",
        "/v1/pools/p1",
        &[&admin, json],
        r#"{"devices": [["t0", "d0"]]}"#,
    );
    s.expect_error(&r, 400, "invalid");
    assert_eq!(s.read("/v1/volumes").json(), json!([]));
    assert_eq!(s.read("/v1/pools").json(), json!([]));
    // And the body written the documented way still works.
    let r = send_with(
        &s,
        "POST",
        "/v1/rebalance",
        &[&admin, "Content-Type: application/json; charset=utf-8"],
        r#"{"dry_run": true}"#,
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn every_body_needs_a_json_content_type() {
    let s = serve(tokens());
    cluster_of_four(&s);
    let admin = format!("Authorization: Bearer {ADMIN}");
    let exports = format!("/v1/volumes/{}/exports/nqn.2014-08.org.example:h1", uuid(1));
    for ct in [
        None,
        Some("Content-Type: text/plain"),
        Some("Content-Type: application/x-www-form-urlencoded"),
    ] {
        let headers: Vec<&str> = std::iter::once(admin.as_str()).chain(ct).collect();
        for (method, path, body) in [
            ("PUT", exports.as_str(), r#"{"paths": 2}"#),
            ("POST", "/v1/rebalance", r#"{}"#),
            ("PUT", "/v1/pools/p1", r#"{"devices": []}"#),
        ] {
            let r = send_with(&s, method, path, &headers, body);
            s.expect_error(&r, 415, "unsupported_media_type");
        }
    }
    assert_eq!(s.read("/v1/rebalance").json()["pending"], json!([]));
    assert_eq!(s.read("/v1/pools").json(), json!([]));
    // The export's body is optional: none at all needs no content type
    // (the volume is unknown here, so 404 rather than 415).
    let r = send_with(&s, "PUT", &exports, &[&admin], "");
    s.expect_error(&r, 404, "not_found");
    let r = send_with(
        &s,
        "PUT",
        &exports,
        &[&admin, "Content-Type: application/json"],
        "[]",
    );
    s.expect_error(&r, 400, "invalid");
    let r = send_with(
        &s,
        "PUT",
        &exports,
        &[&admin, "Content-Type: application/json"],
        r#"{"paths": 2}"#,
    );
    s.expect_error(&r, 404, "not_found");
}

#[test]
fn the_bearer_scheme_is_case_insensitive() {
    let s = serve(tokens());
    for header in [
        format!("Authorization: Bearer {READER}"),
        format!("Authorization: bearer {READER}"),
        format!("Authorization: BEARER   {READER}"),
        format!("authorization: bEaReR {READER} "),
    ] {
        let r = send_with(&s, "GET", "/v1/volumes", &[&header], "");
        assert_eq!(r.status, 200, "{header}: {}", r.body);
    }
    for header in [
        format!("Authorization: Basic {READER}"),
        format!("Authorization: Bearer{READER}"),
        "Authorization: bearer ".to_owned(),
        format!("Authorization: {READER}"),
    ] {
        let r = send_with(&s, "GET", "/v1/volumes", &[&header], "");
        s.expect_error(&r, 401, "unauthorized");
    }
}

#[test]
fn a_method_a_path_does_not_take_is_a_json_405() {
    let s = serve(tokens());
    for (method, path) in [
        ("DELETE", "/v1/rebalance"),
        ("PATCH", "/v1/volumes"),
        ("POST", "/v1/pools/p1"),
        ("PUT", "/v1/targets"),
    ] {
        let r = s.admin(method, path, None);
        s.expect_error(&r, 405, "method_not_allowed");
        let allow = r
            .headers
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("allow:")
                    .map(str::to_owned)
            })
            .unwrap_or_else(|| panic!("{method} {path}: no Allow header: {}", r.headers));
        assert!(!allow.trim().is_empty(), "{method} {path}");
    }
    // Still behind the token check.
    let r = s.call("DELETE", "/v1/rebalance", None, None);
    s.expect_error(&r, 401, "unauthorized");
    let r = s.admin("GET", "/v2/nothing", None);
    s.expect_error(&r, 404, "not_found");
}
