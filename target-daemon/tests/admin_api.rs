//! The admin HTTP API: JSON in and out, JSON errors with a kind and a
//! message, and changes saved to the state directory so a restarted target
//! has the same subsystems and namespace identities.

mod common;

use common::*;
use nvpool_target::config::Config;
use nvpool_target::Target;
use nvpool_wire::identify::NsId;
use serde_json::Value;

#[track_caller]
fn assert_error(r: &HttpResponse, status: u16, kind: &str) {
    assert_eq!(r.status, status, "{}", r.body);
    assert!(
        r.content_type
            .as_deref()
            .is_some_and(|c| c.starts_with("application/json")),
        "{r:?}"
    );
    let v = r.json();
    assert_eq!(v["kind"], kind, "{v}");
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
}

fn sub_path(nqn: &str) -> String {
    format!("/v1/subsystems/{nqn}")
}

#[test]
fn put_subsystem_and_namespace() {
    let d = Daemon::start(&[]);
    let body = r#"{"allow_any_host": true, "namespaces": [{"nsid": 1, "backend": "ram:16M"}]}"#;
    let r = http(d.api, "PUT", &sub_path(SUBNQN), Some(body));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["nqn"], SUBNQN);
    assert_eq!(v["allow_any_host"], true);
    let ns = &v["namespaces"][0];
    assert_eq!(ns["nsid"], 1);
    assert_eq!(ns["size_bytes"], 16 << 20);
    assert_eq!(ns["block_size"], 512);
    let uuid = ns["uuid"].as_str().expect("uuid").to_owned();

    // The namespace is live: a host can use it and sees that UUID.
    let (mut a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let data = pattern(1, 4096);
    q.write(1, 0, &data, 512, false).ok();
    assert_eq!(q.read_ok(1, 0, 8, 512), data);
    assert!(a.ns_descriptors(1).contains(&NsId::Uuid(parse_uuid(&uuid))));

    // Add a second namespace (4 KiB blocks) on the running subsystem.
    let r = http(
        d.api,
        "PUT",
        &format!("{}/namespaces/2", sub_path(SUBNQN)),
        Some(r#"{"backend": "ram:1M,block_size=4096"}"#),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["namespaces"].as_array().map(Vec::len), Some(2));
    assert_eq!(a.active_namespaces(0), vec![1, 2]);
    assert_eq!(a.identify_namespace(2).lbads, 12);
    // Namespace 1 kept its data and identity.
    assert_eq!(q.read_ok(1, 0, 8, 512), data);

    // GET views.
    let r = http(d.api, "GET", &sub_path(SUBNQN), None);
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["namespaces"][0]["uuid"], uuid.as_str());
    let r = http(d.api, "GET", "/v1/controllers", None);
    assert_eq!(r.status, 200);
    let ctrls = r.json();
    assert!(
        ctrls
            .as_array()
            .expect("list")
            .iter()
            .any(|c| c["cntlid"] == a.cntlid && c["host"] == HOST_A),
        "{ctrls}"
    );
    let r = http(d.api, "GET", "/v1/health", None);
    assert_eq!(
        (r.status, r.json()["status"].clone()),
        (200, Value::from("ok"))
    );

    // Removing namespace 2: gone for the host.
    let r = http(
        d.api,
        "DELETE",
        &format!("{}/namespaces/2", sub_path(SUBNQN)),
        None,
    );
    assert_eq!(r.status, 204, "{}", r.body);
    assert_eq!(a.active_namespaces(0), vec![1]);
}

fn parse_uuid(s: &str) -> [u8; 16] {
    nvpool_target::config::parse_uuid(s).expect("uuid")
}

#[test]
fn errors_are_json() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    // Not JSON; JSON of the wrong shape; unknown fields.
    assert_error(
        &http(d.api, "PUT", &sub_path(OTHER_NQN), Some("{not json")),
        400,
        "invalid",
    );
    assert_error(
        &http(
            d.api,
            "PUT",
            &sub_path(OTHER_NQN),
            Some(r#"{"namespaces": 5}"#),
        ),
        400,
        "invalid",
    );
    assert_error(
        &http(
            d.api,
            "PUT",
            &sub_path(OTHER_NQN),
            Some(r#"{"colour": "red"}"#),
        ),
        400,
        "invalid",
    );
    // A bad NQN.
    assert_error(
        &http(d.api, "PUT", "/v1/subsystems/not-an-nqn", Some("{}")),
        400,
        "invalid",
    );
    // The discovery NQN is reserved.
    assert_error(
        &http(
            d.api,
            "PUT",
            &sub_path(nvpool_wire::DISCOVERY_NQN),
            Some("{}"),
        ),
        400,
        "invalid",
    );
    // Unknown things.
    assert_error(
        &http(d.api, "GET", &sub_path(OTHER_NQN), None),
        404,
        "not_found",
    );
    assert_error(
        &http(d.api, "DELETE", &sub_path(OTHER_NQN), None),
        404,
        "not_found",
    );
    assert_error(
        &http(
            d.api,
            "PUT",
            &format!("{}/namespaces/1", sub_path(OTHER_NQN)),
            Some(r#"{"backend": "ram:1M"}"#),
        ),
        404,
        "not_found",
    );
    assert_error(
        &http(d.api, "GET", "/v1/nothing-here", None),
        404,
        "not_found",
    );
    // Bad namespaces: spec syntax, missing file, bad NSID.
    let ns1 = format!("{}/namespaces/1", sub_path(SUBNQN));
    assert_error(
        &http(d.api, "PUT", &ns1, Some(r#"{"backend": "disk:/dev/null"}"#)),
        400,
        "invalid",
    );
    assert_error(
        &http(d.api, "PUT", &ns1, Some(r#"{"backend": "ram:0"}"#)),
        400,
        "invalid",
    );
    let missing = r#"{"backend": "file:/nonexistent/nvpool-test.img"}"#;
    assert_error(&http(d.api, "PUT", &ns1, Some(missing)), 422, "backend");
    assert_error(
        &http(
            d.api,
            "PUT",
            &format!("{}/namespaces/0", sub_path(SUBNQN)),
            Some(r#"{"backend": "ram:1M"}"#),
        ),
        400,
        "invalid",
    );
    assert_error(
        &http(
            d.api,
            "PUT",
            &format!("{}/namespaces/x", sub_path(SUBNQN)),
            Some(r#"{"backend": "ram:1M"}"#),
        ),
        400,
        "invalid",
    );
    // None of that changed the subsystem.
    let v = http(d.api, "GET", &sub_path(SUBNQN), None).json();
    assert_eq!(v["namespaces"].as_array().map(Vec::len), Some(1));
    assert_eq!(v["namespaces"][0]["backend"], RAM_SPEC);
}

#[test]
fn changes_survive_a_restart_through_the_state_dir() {
    let state = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("state dir");
    let (_data_dir, disk) = scratch_file(4 << 20);
    let d = Daemon::start_with(
        Target::new(Some(state.path().to_owned())).expect("target"),
        &[],
    );
    let body = format!(
        r#"{{"allowed_hosts": ["{HOST_A}"], "namespaces": [{{"nsid": 1, "backend": "ram:8M"}}, {{"nsid": 5, "backend": "file:{}"}}]}}"#,
        disk.display()
    );
    let r = http(d.api, "PUT", &sub_path(SUBNQN), Some(&body));
    assert_eq!(r.status, 200, "{}", r.body);
    let r = http(
        d.api,
        "PUT",
        &sub_path(OTHER_NQN),
        Some(r#"{"allow_any_host": true}"#),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let r = http(
        d.api,
        "PUT",
        &format!("{}/hosts/{HOST_B}", sub_path(SUBNQN)),
        None,
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // Saved before the answer.
    let saved = std::fs::read_to_string(Config::state_path(state.path())).expect("target.json");
    assert!(
        saved.contains(SUBNQN) && saved.contains(OTHER_NQN) && saved.contains(HOST_B),
        "{saved}"
    );

    // What the first run's hosts saw.
    let mut a = admin_session(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let ids1 = a.ns_descriptors(1);
    let ids5 = a.ns_descriptors(5);
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let data = pattern(2, 8192);
    q.write(5, 16, &data, 512, false).ok();
    q.flush(5).ok();
    drop((a, q));
    let before = d.target.running_config();
    d.shutdown();

    // A new target from the same state dir.
    let t = Target::new(Some(state.path().to_owned())).expect("target");
    let cfg = Config::load_state(state.path())
        .expect("load")
        .expect("state exists");
    t.apply_config(&cfg).expect("apply");
    assert_eq!(t.running_config().subsystems, before.subsystems);
    let s = t.subsystem(SUBNQN).expect("subsystem back");
    assert!(s.hosts.contains(HOST_A) && s.hosts.contains(HOST_B) && !s.allow_any_host);
    assert_eq!(s.namespaces.keys().copied().collect::<Vec<_>>(), vec![1, 5]);
    assert!(t.subsystem(OTHER_NQN).is_some_and(|o| o.allow_any_host));

    let d2 = Daemon::start_with(t, &[]);
    let mut a = admin_session(d2.addr, NO_DIGESTS, SUBNQN, HOST_B);
    assert_eq!(
        a.ns_descriptors(1),
        ids1,
        "namespace 1 identity changed across restart"
    );
    assert_eq!(
        a.ns_descriptors(5),
        ids5,
        "namespace 5 identity changed across restart"
    );
    a.set_queue_count(1);
    let mut q = io_session(d2.addr, NO_DIGESTS, SUBNQN, HOST_B, a.cntlid, 1);
    assert_eq!(
        q.read_ok(5, 16, 16, 512),
        data,
        "file namespace data across restart"
    );
}

/// A concrete path for a route's path pattern (`{param}` filled in).
fn concrete(pattern: &str) -> String {
    pattern
        .replace("{nqn}", "nqn.2026-11.io.nvpool:route-check")
        .replace("{nsid}", "7")
        .replace("{host}", HOST_B)
        .replace("{addr}", "127.0.0.1:0")
        .replace("{id}", "route-check")
}

#[track_caller]
fn assert_unauthorized(r: &HttpResponse, what: &str) {
    assert_eq!(r.status, 401, "{what}: {}", r.body);
    assert_eq!(r.www_authenticate.as_deref(), Some("Bearer"), "{what}");
    assert_error(r, 401, "unauthorized");
    assert!(
        !r.body.contains(ADMIN_TOKEN) && !r.body.contains("wrong-token"),
        "{what}: the answer names a token: {}",
        r.body
    );
}

/// Every route the router is built from refuses a request without a
/// token, with a wrong one and with another scheme, and answers with the
/// right one (not 401, and not the 404/405 of a path or method the router
/// does not have: the table and the router agree).
#[test]
fn every_admin_route_needs_the_token() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let routes = nvpool_target::api::routes();
    assert!(routes.len() >= 20, "{routes:?}");
    let body = Some("{}");
    for (method, pattern) in &routes {
        let path = concrete(pattern);
        let m = method.as_str();
        let what = format!("{m} {path}");
        assert_unauthorized(&http_auth(d.api, None, m, &path, body), &what);
        for wrong in [
            "Bearer wrong-token-0123456789".to_owned(),
            format!("Bearer {ADMIN_TOKEN}x"),
            format!("Bearer {}", &ADMIN_TOKEN[..ADMIN_TOKEN.len() - 1]),
            "Bearer ".to_owned(),
            format!("Basic {ADMIN_TOKEN}"),
            ADMIN_TOKEN.to_owned(),
        ] {
            assert_unauthorized(&http_auth(d.api, Some(&wrong), m, &path, body), &what);
        }
        let r = http(d.api, m, &path, body);
        assert_ne!(r.status, 401, "{what}: {}", r.body);
        assert_ne!(r.status, 405, "{what}: the router has no such method");
        assert!(
            !r.body.contains("no such endpoint"),
            "{what}: the router has no such path"
        );
    }
    // Nothing was changed by the refused requests: the subsystem (deleted
    // only by the accepted DELETE of another NQN) is still there.
    assert!(d.target.subsystem(SUBNQN).is_some());
    // Paths outside the table are refused the same way before anything
    // says whether they exist.
    assert_unauthorized(
        &http_auth(d.api, None, "GET", "/v1/no-such-thing", None),
        "unknown path",
    );
    let r = http(d.api, "GET", "/v1/no-such-thing", None);
    assert_error(&r, 404, "not_found");
    // The scheme is case-insensitive.
    let r = http_auth(
        d.api,
        Some(&format!("bearer {ADMIN_TOKEN}")),
        "GET",
        "/v1/health",
        None,
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

/// A refused request changes nothing.
#[test]
fn a_refused_request_changes_nothing() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let r = http_auth(d.api, None, "DELETE", &sub_path(SUBNQN), None);
    assert_unauthorized(&r, "DELETE without a token");
    let r = http_auth(
        d.api,
        Some("Bearer wrong-token-0123456789"),
        "PUT",
        &sub_path(OTHER_NQN),
        Some(r#"{"allow_any_host": true}"#),
    );
    assert_unauthorized(&r, "PUT with a wrong token");
    assert!(d.target.subsystem(SUBNQN).is_some());
    assert!(d.target.subsystem(OTHER_NQN).is_none());
}

/// `GET /v1/identity`: the ID the target registers under (null until it
/// has one) and its persistent identity, the same after a restart.
#[test]
fn the_target_says_who_it_is() {
    let state = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("state dir");
    let d = Daemon::start_with(
        Target::new(Some(state.path().to_owned())).expect("target"),
        &[],
    );
    let v = http(d.api, "GET", "/v1/identity", None).json();
    assert_eq!(v["target_id"], Value::Null, "{v}");
    let identity = v["identity"].as_str().expect("identity").to_owned();
    let saved = std::fs::read_to_string(state.path().join("identity")).expect("identity file");
    assert_eq!(identity, saved.trim());
    d.target.set_target_id("node-7");
    let v = http(d.api, "GET", "/v1/identity", None).json();
    assert_eq!(v["target_id"], "node-7", "{v}");
    d.shutdown();
    let d = Daemon::start_with(
        Target::new(Some(state.path().to_owned())).expect("target"),
        &[],
    );
    let v = http(d.api, "GET", "/v1/identity", None).json();
    assert_eq!(v["identity"], identity.as_str(), "{v}");
}

/// A request with exactly these extra header lines; the status and body.
fn raw_request(
    api: std::net::SocketAddr,
    method: &str,
    path: &str,
    headers: &[&str],
    body: &str,
) -> (u16, String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(api).expect("connect");
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {api}\r\nConnection: close\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\n"
    );
    for h in headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).expect("send");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("answer");
    let (head, body) = out.split_once("\r\n\r\n").expect("a whole answer");
    (
        head[9..12].parse().expect("status"),
        head.to_owned(),
        body.to_owned(),
    )
}

#[test]
fn bodies_follow_the_control_planes_rules() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let json = "Content-Type: application/json";
    let leases = r#"{"nqns": [], "valid_ms": 1000}"#;
    // No JSON content type: 415, whatever the body.
    for headers in [&[][..], &["Content-Type: text/plain"][..]] {
        let (status, _, body) = raw_request(d.api, "POST", "/v1/leases", headers, leases);
        assert_eq!(status, 415, "{body}");
        let v: Value = serde_json::from_str(&body).expect("JSON error");
        assert_eq!(v["kind"], "unsupported_media_type", "{v}");
    }
    let (status, _, body) = raw_request(d.api, "POST", "/v1/leases", &[json], leases);
    assert_eq!(status, 200, "{body}");
    // A key twice, at the top or further down; an array for an object.
    let ns = format!("{}/namespaces/2", sub_path(SUBNQN));
    for (path, body) in [
        (
            "/v1/leases",
            r#"{"nqns": [], "valid_ms": 1000, "valid_ms": 60000}"#,
        ),
        ("/v1/leases", r#"[[], 1000]"#),
    ] {
        let (status, _, answer) = raw_request(d.api, "POST", path, &[json], body);
        assert_eq!(status, 400, "{body}: {answer}");
    }
    for body in [
        r#"{"backend": "ram:1M", "backend": "ram:2M"}"#.to_owned(),
        r#"["ram:1M"]"#.to_owned(),
    ] {
        let (status, _, answer) = raw_request(d.api, "PUT", &ns, &[json], &body);
        assert_eq!(status, 400, "{body}: {answer}");
    }
    let (status, _, answer) = raw_request(
        d.api,
        "PUT",
        &sub_path(OTHER_NQN),
        &[json],
        r#"{"namespaces": [{"nsid": 1, "backend": "ram:1M", "nsid": 2}]}"#,
    );
    assert_eq!(status, 400, "{answer}");
    assert!(d.target.subsystem(OTHER_NQN).is_none());
    assert_eq!(d.target.subsystem(SUBNQN).unwrap().namespaces.len(), 1);
    // A host's keys are optional: no body needs no content type.
    let host = format!("{}/hosts/{HOST_A}", sub_path(SUBNQN));
    let (status, _, answer) = raw_request(d.api, "PUT", &host, &[], "");
    assert_eq!(status, 200, "{answer}");
    let (status, _, answer) = raw_request(d.api, "PUT", &host, &["Content-Type: text/plain"], "{}");
    assert_eq!(status, 415, "{answer}");
}

#[test]
fn a_method_a_path_does_not_take_is_a_json_405() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    for (method, path) in [
        ("POST", "/v1/health"),
        ("DELETE", "/v1/leases"),
        ("PATCH", "/v1/subsystems"),
    ] {
        let r = http(d.api, method, path, None);
        assert_error(&r, 405, "method_not_allowed");
    }
    let (status, head, _) = raw_request(d.api, "DELETE", "/v1/target", &[], "");
    assert_eq!(status, 405);
    assert!(head.to_ascii_lowercase().contains("\r\nallow: "), "{head}");
    // A path segment that is not UTF-8: the JSON 400 too.
    assert_error(
        &http(d.api, "GET", "/v1/subsystems/%FF%FE", None),
        400,
        "invalid",
    );
    assert_error(
        &http(d.api, "DELETE", "/v1/subsystems/%C3%28/namespaces/1", None),
        400,
        "invalid",
    );
    // The token comes first, as for every path.
    let r = http_auth(d.api, None, "POST", "/v1/health", None);
    assert_error(&r, 401, "unauthorized");
    // Any case of the scheme, one space or more.
    for scheme in ["BEARER", "bearer", "Bearer  "] {
        let r = http_auth(
            d.api,
            Some(&format!("{scheme} {ADMIN_TOKEN}")),
            "GET",
            "/v1/health",
            None,
        );
        assert_eq!(r.status, 200, "{scheme}: {}", r.body);
    }
}
