//! Registration with the control plane: an in-process `nvpool-control` API
//! (MemStore, real clock) on a loopback port, and targets that register
//! their devices, heartbeat, survive a refused token or an absent control
//! plane, and re-register when the control plane forgets them; a target
//! daemon whose admin API serves https, which the control plane programs
//! only when it trusts its CA (`--target-cacert`).

mod common;

use common::*;
use nvpool_control::api::{ApiServer, AuthConfig};
use nvpool_control::auth::{Principal, Tokens};
use nvpool_control::store::MemStore;
use nvpool_control::{Cluster, StateConfig, SystemClock};
use nvpool_target::register::{ControlPlaneUrl, DeviceOffer, RegistrationStatus};
use nvpool_target::{Registrar, RegistrationConfig};
use nvpool_testkit::certs;
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// How long a test waits for something the registration thread does.
const PATIENCE: Duration = Duration::from_secs(15);

// ----- an in-process control plane -----

/// The token the tests read the control plane's state with.
const READER: &str = "reader-secret-0123456789";

struct ControlPlane {
    api: ApiServer,
    cluster: Arc<Cluster>,
}

impl ControlPlane {
    /// Serves a fresh cluster on `bind` (port 0 for any).
    fn start_on(bind: SocketAddr, auth: AuthConfig) -> ControlPlane {
        let config = StateConfig {
            extent_bytes: MIB,
            ..StateConfig::default()
        };
        let cluster =
            Cluster::new(Arc::new(MemStore::new()), Arc::new(SystemClock), config).unwrap();
        let cluster = Arc::new(cluster);
        let api = ApiServer::start(cluster.clone(), auth, bind).unwrap();
        ControlPlane { api, cluster }
    }

    fn start(auth: AuthConfig) -> ControlPlane {
        ControlPlane::start_on("127.0.0.1:0".parse().unwrap(), auth)
    }

    /// Serves `store`, calling https admin APIs trusting `target_ca` as
    /// `nvpool-control --target-cacert` does (None: the system bundle).
    fn start_trusting(store: Arc<MemStore>, target_ca: Option<&Path>) -> ControlPlane {
        let cluster = Arc::new(cluster_trusting(store, target_ca));
        let bind = "127.0.0.1:0".parse().unwrap();
        let api = ApiServer::start(cluster.clone(), AuthConfig::default(), bind).unwrap();
        ControlPlane { api, cluster }
    }

    /// Serves https with the certificate `certs` made.
    fn start_https(auth: AuthConfig, c: &certs::Certs) -> ControlPlane {
        let cluster = Cluster::new(
            Arc::new(MemStore::new()),
            Arc::new(SystemClock),
            StateConfig {
                extent_bytes: MIB,
                ..StateConfig::default()
            },
        )
        .unwrap();
        let cluster = Arc::new(cluster);
        let tls = nvpool_control::tls::ServerTls::load(&c.cert, &c.key).unwrap();
        let bind = "127.0.0.1:0".parse().unwrap();
        let api = ApiServer::start_tls(cluster.clone(), auth, bind, Some(tls)).unwrap();
        ControlPlane { api, cluster }
    }

    fn url(&self) -> ControlPlaneUrl {
        ControlPlaneUrl::parse(&format!("http://{}", self.api.addr)).unwrap()
    }

    fn get(&self, path: &str) -> (u16, Value) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .build()
            .into();
        let mut r = agent
            .get(format!("http://{}{path}", self.api.addr))
            .header("Authorization", format!("Bearer {READER}"))
            .call()
            .unwrap();
        let status = r.status().as_u16();
        (status, r.body_mut().read_json().unwrap())
    }

    /// A PUT or DELETE (no token: the tests' control planes without
    /// tokens allow every call): the status and the JSON answer (null
    /// when empty).
    fn send(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .build()
            .into();
        let url = format!("http://{}{path}", self.api.addr);
        let r = match (method, body) {
            ("PUT", Some(b)) => agent.put(url).send_json(b),
            ("PUT", None) => agent.put(url).send_empty(),
            ("DELETE", None) => agent.delete(url).call(),
            other => panic!("the tests do not send {other:?}"),
        };
        let mut r = r.unwrap();
        let status = r.status().as_u16();
        let text = r.body_mut().read_to_string().unwrap();
        let v = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap()
        };
        (status, v)
    }

    fn targets(&self) -> Vec<Value> {
        let (status, v) = self.get("/v1/targets");
        assert_eq!(status, 200, "{v}");
        v.as_array().unwrap().clone()
    }

    fn target(&self, id: &str) -> Option<Value> {
        self.targets().into_iter().find(|t| t["id"] == id)
    }

    fn stop(self) {
        self.api.shutdown();
    }
}

/// A cluster over `store` whose calls to https admin APIs trust
/// `target_ca` (None: the system CA bundle), loaded as `nvpool-control
/// --target-cacert` loads it.
fn cluster_trusting(store: Arc<MemStore>, target_ca: Option<&Path>) -> Cluster {
    let config = StateConfig {
        extent_bytes: MIB,
        ..StateConfig::default()
    };
    let tls = nvpool_control::tls::client_tls_for("--target-cacert", target_ca).unwrap();
    Cluster::new(store, Arc::new(SystemClock), config)
        .unwrap()
        .with_target_tls(tls)
}

// ----- helpers -----

#[track_caller]
fn wait_status(r: &Registrar, what: &str, f: impl Fn(&RegistrationStatus) -> bool) {
    wait_for(what, PATIENCE, || f(&r.status()));
}

/// A registration with quick heartbeats and retries.
fn quick(url: ControlPlaneUrl, id: &str, d: &Daemon) -> RegistrationConfig {
    let mut c = RegistrationConfig::new(url, id.into(), format!("{id}-name"), d.addr, d.api);
    c.admin_tokens = Some(d.tokens.clone());
    c.heartbeat_interval = Duration::from_millis(100);
    c.backoff_min = Duration::from_millis(20);
    c.backoff_max = Duration::from_millis(100);
    c.request_timeout = Duration::from_secs(2);
    c
}

/// A port nothing listens on (bound, then released).
fn closed_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// Log lines of every test in this binary (the registration thread logs
/// from its own thread, so a thread-local subscriber would miss them).
fn logs() -> &'static Mutex<Vec<u8>> {
    static LOGS: OnceLock<Mutex<Vec<u8>>> = OnceLock::new();
    static INIT: OnceLock<()> = OnceLock::new();
    let buf = LOGS.get_or_init(|| Mutex::new(Vec::new()));
    INIT.get_or_init(|| {
        #[derive(Clone)]
        struct Sink;
        impl Write for Sink {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                logs().lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let _ = tracing_subscriber::fmt()
            .with_env_filter("nvpool_target::register=info")
            .with_ansi(false)
            .with_writer(|| Sink)
            .try_init();
    });
    buf
}

fn log_text() -> String {
    String::from_utf8_lossy(&logs().lock().unwrap()).into_owned()
}

/// One NVMe/TCP write and read back through the target.
fn serves_io(d: &Daemon) {
    let (_admin, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let data = pattern(42, 4096);
    q.write(1, 8, &data, 512, false).ok();
    assert_eq!(q.read_ok(1, 8, 8, 512), data);
}

// ----- tests -----

#[test]
fn target_registers_its_devices_labels_and_addresses_then_heartbeats() {
    logs();
    let cp = ControlPlane::start(AuthConfig::default());
    let (_dir0, f0) = scratch_file(8 * MIB);
    let (_dir1, f1) = scratch_file(16 * MIB + 4096);
    let d = Daemon::start(&[]);
    let mut cfg = quick(cp.url(), "t-reg", &d);
    cfg.labels = BTreeMap::from([
        ("rack".to_string(), "r1".to_string()),
        ("host".to_string(), "h1".to_string()),
    ]);
    cfg.devices = vec![
        DeviceOffer::probe("d0", &file_spec(&f0), BTreeMap::new()).unwrap(),
        DeviceOffer::probe(
            "d1",
            &file_spec(&f1),
            BTreeMap::from([("class".to_string(), "tlc".to_string())]),
        )
        .unwrap(),
    ];
    let r = Registrar::start(cfg).unwrap();
    wait_for("the target to be listed", PATIENCE, || {
        cp.target("t-reg").is_some()
    });
    let t = cp.target("t-reg").unwrap();
    assert_eq!(t["name"], "t-reg-name");
    assert_eq!(t["addr"], d.addr.to_string());
    assert_eq!(t["admin_addr"], d.api.to_string());
    assert_eq!(t["labels"], serde_json::json!({"rack": "r1", "host": "h1"}));
    assert_eq!(t["health"], "online");
    let devices = t["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2, "{t}");
    assert_eq!(devices[0]["id"], "d0");
    assert_eq!(devices[0]["backend"], file_spec(&f0));
    assert_eq!(devices[0]["capacity_bytes"], 8 * MIB);
    assert_eq!(devices[0]["labels"], serde_json::json!({}));
    assert_eq!(devices[1]["id"], "d1");
    assert_eq!(devices[1]["capacity_bytes"], 16 * MIB + 4096);
    assert_eq!(devices[1]["labels"], serde_json::json!({"class": "tlc"}));
    assert_eq!(t["capacity"]["total_bytes"], 24 * MIB + 4096);
    // The control plane holds the admin API's token, and shows it nowhere.
    let held = cp.cluster.target_credential("t-reg").unwrap().unwrap();
    assert_eq!(held.expose(), ADMIN_TOKEN);
    assert!(!cp.get("/v1/targets").1.to_string().contains(ADMIN_TOKEN));

    // Heartbeats move last_heartbeat_ms forward.
    let first = t["last_heartbeat_ms"].as_u64().unwrap();
    wait_for("a later heartbeat", PATIENCE, || {
        cp.target("t-reg").unwrap()["last_heartbeat_ms"]
            .as_u64()
            .unwrap()
            > first
    });
    wait_status(&r, "counted heartbeats", |s| s.heartbeats >= 2);
    let s = r.status();
    assert!(
        s.registered && s.registrations == 1 && s.failures == 0,
        "{s:?}"
    );

    // Stopping is prompt: the thread sleeps on a channel, not a timer.
    let t0 = Instant::now();
    r.stop();
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    d.shutdown();
    cp.stop();
}

#[test]
fn a_wrong_token_is_refused_and_logged_once_and_the_target_keeps_serving() {
    logs();
    let cp = ControlPlane::start(AuthConfig::new(
        Tokens::new()
            .with(Principal::Admin, "admin-secret-0123456789")
            .with(Principal::Target, "target-secret-0123456789")
            .with(Principal::Reader, READER),
    ));
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let mut cfg = quick(cp.url(), "t-token", &d);
    cfg.token = Some("not-the-secret".into());
    let r = Registrar::start(cfg).unwrap();
    wait_status(&r, "three refusals", |s| s.failures >= 3);
    let s = r.status();
    assert!(!s.registered, "{s:?}");
    let err = s.last_error.unwrap();
    assert!(
        err.contains("401") && err.contains("unauthorized") && err.contains("not known"),
        "{err}"
    );
    assert!(cp.target("t-token").is_none());
    serves_io(&d);
    r.stop();
    // Logged at error level, once: later refusals fall in the rate limit.
    let text = log_text();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("bearer token is not known"))
        .collect();
    assert_eq!(lines.len(), 1, "{text}");
    assert!(
        lines[0].contains("ERROR") && lines[0].contains("registration failed"),
        "{}",
        lines[0]
    );

    // The right token registers.
    let mut cfg = quick(cp.url(), "t-token", &d);
    cfg.token = Some("target-secret-0123456789".into());
    let r = Registrar::start(cfg).unwrap();
    wait_for("the target to be listed", PATIENCE, || {
        cp.target("t-token").is_some()
    });
    r.stop();
}

/// An https control plane: the registrar trusts the CA of
/// `--control-plane-cacert` and registers; without it (the system bundle
/// does not know a test CA) every attempt fails saying why, and nothing is
/// registered.
#[test]
fn a_registrar_reaches_an_https_control_plane_through_its_cacert_only() {
    logs();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let c = certs::make(dir.path(), "cp");
    let cp = ControlPlane::start_https(AuthConfig::default(), &c);
    let url = ControlPlaneUrl::parse(&format!("https://{}", cp.api.addr)).unwrap();
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);

    let r = Registrar::start(quick(url.clone(), "t-untrusted", &d)).unwrap();
    wait_status(&r, "failed attempts", |s| s.failures >= 2);
    let s = r.status();
    assert!(!s.registered, "{s:?}");
    let err = s.last_error.unwrap();
    assert!(err.contains("cannot reach the control plane"), "{err}");
    assert!(err.to_lowercase().contains("unknownissuer"), "{err}");
    r.stop();

    let mut cfg = quick(url, "t-https", &d);
    cfg.tls = nvpool_control::tls::client_tls_for("--control-plane-cacert", Some(&c.ca)).unwrap();
    let r = Registrar::start(cfg).unwrap();
    wait_status(&r, "a heartbeat", |s| s.registered && s.heartbeats >= 1);
    r.stop();
    assert!(cp.cluster.target_credential("t-https").unwrap().is_some());
    assert!(cp
        .cluster
        .target_credential("t-untrusted")
        .unwrap()
        .is_none());
    d.shutdown();
    cp.stop();
}

/// An unusable `--control-plane-cacert` stops the daemon at start: one
/// line naming the option and the file, exit status 2.
#[test]
fn an_unusable_control_plane_cacert_is_a_usage_error() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let not_pem = dir.path().join("not-a-ca.pem");
    std::fs::write(&not_pem, "hello\n").unwrap();
    for (file, why) in [
        ("/nonexistent/ca.pem", "cannot read it"),
        (not_pem.to_str().unwrap(), "no CERTIFICATE in it"),
    ] {
        let out = daemon_bin()
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .args(["--control-plane", "https://127.0.0.1:1"])
            .args(["--control-plane-cacert", file])
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{e}");
        assert!(
            e.contains(&format!("--control-plane-cacert {file}: {why}")),
            "{e}"
        );
        assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    }
}

/// A rotated admin token (a new first line in the token file) reaches the
/// control plane by a new registration; the old one keeps working on the
/// target until its line goes.
#[test]
fn a_rotated_admin_token_is_registered_again() {
    logs();
    let cp = ControlPlane::start(AuthConfig::default());
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let file = dir.path().join("admin-tokens");
    let (old, new) = ("old-admin-token-0123456789", "new-admin-token-9876543210");
    std::fs::write(&file, format!("{old}\n")).unwrap();
    let tokens = nvpool_target::AdminTokens::from_file(&file).unwrap();
    let d = Daemon::start_with_tokens(nvpool_target::Target::new(None).unwrap(), &[], tokens);
    let r = Registrar::start(quick(cp.url(), "t-rot", &d)).unwrap();
    let held = || {
        cp.cluster
            .target_credential("t-rot")
            .unwrap()
            .map(|s| s.expose().to_owned())
    };
    wait_for("the first registration", PATIENCE, || {
        held().as_deref() == Some(old)
    });
    std::fs::write(&file, format!("{new}\n{old}\n")).unwrap();
    wait_for("the new token registered", PATIENCE, || {
        held().as_deref() == Some(new)
    });
    wait_status(&r, "a second registration", |s| s.registrations >= 2);
    let auth = format!("Bearer {old}");
    assert_eq!(
        http_auth(d.api, Some(&auth), "GET", "/v1/health", None).status,
        200
    );
    r.stop();
    assert!(!log_text().contains(new) && !log_text().contains(old));
}

#[test]
fn the_target_serves_io_while_the_control_plane_is_unreachable() {
    logs();
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let url = ControlPlaneUrl::parse(&format!("http://{}", closed_port())).unwrap();
    let r = Registrar::start(quick(url, "t-down", &d)).unwrap();
    wait_status(&r, "failed attempts", |s| s.failures >= 3);
    let err = r.status().last_error.unwrap();
    assert!(err.contains("cannot reach the control plane"), "{err}");
    serves_io(&d);
    serves_io(&d);
    let t0 = Instant::now();
    r.stop();
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    d.shutdown();
}

#[test]
fn a_control_plane_that_forgot_the_target_gets_a_new_registration() {
    logs();
    let cp = ControlPlane::start(AuthConfig::default());
    let addr = cp.api.addr;
    let d = Daemon::start(&[]);
    let r = Registrar::start(quick(cp.url(), "t-forgot", &d)).unwrap();
    wait_status(&r, "heartbeats", |s| s.heartbeats >= 1);
    // A new control plane on the same address with an empty store: the next
    // heartbeat gets 404 and the target registers again.
    cp.stop();
    let cp = ControlPlane::start_on(addr, AuthConfig::default());
    wait_for("the target to be listed again", PATIENCE, || {
        cp.target("t-forgot").is_some()
    });
    wait_status(&r, "a second registration", |s| {
        s.registrations >= 2 && s.registered
    });
    r.stop();
}

// ----- the daemon binary -----

#[test]
fn bad_registration_options_stop_the_daemon_at_start() {
    let (_dir, f) = scratch_file(4 * MIB);
    let dev = format!("d0={}", file_spec(&f));
    let cp = format!("http://{}", closed_port());
    let e = start_error(&["--control-plane", "ftp://cp:4430", "--device", &dev]);
    assert!(
        e.contains("expected http://HOST:PORT or https://HOST:PORT"),
        "{e}"
    );
    let e = start_error(&["--control-plane", "cp:4430"]);
    assert!(e.contains("expected http://HOST:PORT"), "{e}");
    let e = start_error(&["--control-plane", &cp, "--admin-listen", "off"]);
    assert!(e.contains("needs the admin API"), "{e}");
    let e = start_error(&[
        "--control-plane",
        &cp,
        "--device",
        "d0=file:/nonexistent/x.img",
    ]);
    assert!(
        e.contains("--device d0=file:/nonexistent/x.img: cannot open /nonexistent/x.img"),
        "{e}"
    );
    let e = start_error(&[
        "--control-plane",
        &cp,
        "--device",
        &format!("{dev},offset=4096"),
    ]);
    assert!(e.contains("whole file"), "{e}");
    let e = start_error(&["--control-plane", &cp, "--device", "d/0=ram:1M"]);
    assert!(e.contains("IDs are"), "{e}");
    let e = start_error(&[
        "--control-plane",
        &cp,
        "--device",
        "d0=ram:1M",
        "--device",
        "d0=ram:2M",
    ]);
    assert!(e.contains("given twice"), "{e}");
    let e = start_error(&["--control-plane", &cp, "--label", "rack"]);
    assert!(e.contains("KEY=VALUE"), "{e}");
    let e = start_error(&["--device", &dev]);
    assert!(e.contains("give --control-plane"), "{e}");
    let e = start_error(&[
        "--control-plane",
        &cp,
        "--control-plane-token-file",
        "/nonexistent/token",
    ]);
    assert!(e.contains("cannot read the token"), "{e}");
    // Every error is one line.
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
}

#[test]
fn the_daemon_registers_with_its_state_identity_and_stops_on_sigterm() {
    let cp = ControlPlane::start(AuthConfig::new(
        Tokens::new()
            .with(Principal::Target, "target-token-0123456789")
            .with(Principal::Reader, READER),
    ));
    let (dir, f) = scratch_file(4 * MIB);
    let state = dir.path().join("state");
    let token = dir.path().join("token");
    std::fs::write(&token, "target-token-0123456789\n").unwrap();
    let mut child = daemon_bin()
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args(["--no-io-uring", "--reactors", "1"])
        .arg("--state-dir")
        .arg(&state)
        .args(["--control-plane", &format!("http://{}", cp.api.addr)])
        .arg("--control-plane-token-file")
        .arg(&token)
        .args(["--device", &format!("d0={}", file_spec(&f))])
        .args(["--device", "r0=ram:2M"])
        .args(["--device-label", "r0:class=ram"])
        .args(["--label", "rack=r9", "--name", "bin-node"])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let id = || {
        std::fs::read_to_string(state.join("identity"))
            .ok()
            .map(|s| s.trim().to_owned())
    };
    wait_for("the identity file", PATIENCE, || id().is_some());
    let id = id().unwrap();
    wait_for("the daemon to register", PATIENCE, || {
        cp.target(&id).is_some()
    });
    let t = cp.target(&id).unwrap();
    assert_eq!(t["name"], "bin-node");
    let addr: SocketAddr = t["addr"].as_str().unwrap().parse().unwrap();
    let admin: SocketAddr = t["admin_addr"].as_str().unwrap().parse().unwrap();
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{t}");
    assert!(
        admin.ip().is_loopback() && admin.port() != 0 && admin != addr,
        "{t}"
    );
    assert_eq!(t["labels"]["rack"], "r9");
    assert!(
        t["labels"]["host"].as_str().is_some_and(|h| !h.is_empty()),
        "{t}"
    );
    assert_eq!(t["devices"][0]["capacity_bytes"], 4 * MIB);
    assert_eq!(t["devices"][1]["id"], "r0");
    assert_eq!(t["devices"][1]["capacity_bytes"], 2 * MIB);
    assert_eq!(t["devices"][1]["labels"]["class"], "ram");
    // The admin API answers where the control plane was told it is, to
    // the token the daemon saved in its state directory.
    let token = std::fs::read_to_string(state.join("admin-token")).unwrap();
    let auth = format!("Bearer {}", token.trim());
    let r = http_auth(admin, Some(&auth), "GET", "/v1/target", None);
    assert_eq!(r.status, 200, "{}", r.body);
    // ... which the registration gave the control plane.
    let held = cp.cluster.target_credential(&id).unwrap().unwrap();
    assert_eq!(held.expose(), token.trim());
    // It says it is what it registered as.
    let r = http_auth(admin, Some(&auth), "GET", "/v1/identity", None);
    assert_eq!(r.json()["target_id"], id.as_str(), "{}", r.body);

    // SAFETY: kill has no memory preconditions; the pid is our child's.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let status = wait_exit("the daemon to stop", &mut child, PATIENCE);
    assert!(status.success(), "{status:?}");
}

#[test]
fn the_registrar_fails_over_between_control_plane_instances() {
    logs();
    // Two instances over one store, as instances of one control plane
    // share etcd; a dead endpoint listed first.
    let config = StateConfig {
        extent_bytes: MIB,
        ..StateConfig::default()
    };
    let store = Arc::new(MemStore::new());
    let instance = || {
        let cluster = Cluster::new(store.clone(), Arc::new(SystemClock), config.clone()).unwrap();
        let cluster = Arc::new(cluster);
        let api = ApiServer::start(
            cluster.clone(),
            AuthConfig::default(),
            "127.0.0.1:0".parse().unwrap(),
        )
        .unwrap();
        ControlPlane { api, cluster }
    };
    let (a, b) = (instance(), instance());
    let dead = closed_port();
    let list = format!("http://{dead},http://{},http://{}", a.api.addr, b.api.addr);
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let r = Registrar::start(quick(ControlPlaneUrl::parse(&list).unwrap(), "t-ha", &d)).unwrap();
    wait_status(&r, "registration and heartbeats", |s| {
        s.registered && s.heartbeats >= 2
    });
    assert_eq!(r.status().failures, 0, "{:?}", r.status());
    assert!(b.target("t-ha").is_some(), "B reads what went through A");

    // A stops: heartbeats go on through B, which sees them.
    let seen = |cp: &ControlPlane| cp.target("t-ha").unwrap()["last_heartbeat_ms"].as_u64();
    a.stop();
    let before = (r.status().heartbeats, seen(&b));
    wait_status(&r, "heartbeats through B", |s| s.heartbeats >= before.0 + 3);
    assert!(seen(&b) > before.1, "B got the heartbeats");
    assert!(r.status().registered);

    // None left: the error names every endpoint.
    b.stop();
    wait_status(&r, "failed heartbeats", |s| s.failures >= 1);
    let err = r.status().last_error.unwrap();
    assert!(
        err.contains("cannot reach the control plane at any of"),
        "{err}"
    );
    for url in ControlPlaneUrl::parse(&list).unwrap().urls() {
        assert!(err.contains(&format!("{url}: ")), "{err}");
    }
    r.stop();
    d.shutdown();
}

// ----- an https admin API programmed by the control plane -----

/// A daemon process, killed if a test fails before it stops it.
struct Proc(std::process::Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    /// SIGTERM, and the daemon must exit 0.
    fn stop(mut self) {
        // SAFETY: kill has no memory preconditions; the pid is our child's.
        assert_eq!(unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) }, 0);
        let start = Instant::now();
        let status = loop {
            if let Some(s) = self.0.try_wait().unwrap() {
                break s;
            }
            assert!(start.elapsed() < PATIENCE, "the daemon did not stop");
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "{status:?}");
    }
}

/// `nvpool-target` registered as `id` with `cp`, its admin API serving
/// https with the certificate of `c` (for 127.0.0.1) on a loopback port,
/// offering one 4 MiB file device; its state (and admin token) in
/// `state`.
fn spawn_tls_target(
    cp: &ControlPlane,
    c: &certs::Certs,
    id: &str,
    state: &Path,
    device: &Path,
) -> Proc {
    let child = daemon_bin()
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .args(["--no-io-uring", "--reactors", "1"])
        .arg("--admin-tls-cert")
        .arg(&c.cert)
        .arg("--admin-tls-key")
        .arg(&c.key)
        .arg("--state-dir")
        .arg(state)
        .args(["--control-plane", &format!("http://{}", cp.api.addr)])
        .args(["--target-id", id])
        .args(["--device", &format!("d0={}", file_spec(device))])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    Proc(child)
}

/// A GET of the target's admin API over https trusting `ca`, with the
/// token in its state directory: the status and the JSON answer.
fn admin_get(admin: SocketAddr, ca: &Path, state: &Path, path: &str) -> (u16, Value) {
    let token = std::fs::read_to_string(state.join("admin-token")).unwrap();
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .tls_config(nvpool_control::tls::client_tls(Some(ca)).unwrap())
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into();
    let mut r = agent
        .get(format!("https://{admin}{path}"))
        .header("Authorization", format!("Bearer {}", token.trim()))
        .call()
        .unwrap();
    let status = r.status().as_u16();
    (status, r.body_mut().read_json().unwrap_or(Value::Null))
}

/// The host subsystems (nvpool's prefix) the target exports, by NQN.
fn host_subsystems(admin: SocketAddr, ca: &Path, state: &Path) -> Vec<Value> {
    let (status, v) = admin_get(admin, ca, state, "/v1/subsystems");
    assert_eq!(status, 200, "{v}");
    v.as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            s["nqn"]
                .as_str()
                .is_some_and(|n| n.starts_with("nqn.2026-11.io.nvpool:host:"))
        })
        .cloned()
        .collect()
}

const VOLUME: &str = "0000000a-0000-4000-8000-000000000000";

fn attachment_path() -> String {
    format!(
        "/v1/volumes/{VOLUME}/attachments/{}",
        HOST_A.replace(':', "%3A")
    )
}

/// Waits for `id` to register and creates a 1 MiB volume on it: the
/// target as listed.
fn registered_with_a_volume(cp: &ControlPlane, id: &str) -> Value {
    wait_for("the target to register", PATIENCE, || {
        cp.target(id).is_some()
    });
    // A registration reconciles the target in the background; let that
    // settle so it does not race with the attach (as the control plane's
    // own attach tests do).
    std::thread::sleep(Duration::from_millis(300));
    let (status, v) = cp.send(
        "PUT",
        &format!("/v1/volumes/{VOLUME}"),
        Some(serde_json::json!({"name": "v10", "size_bytes": MIB, "layout": {"type": "concat"}})),
    );
    assert_eq!(status, 201, "{v}");
    cp.target(id).unwrap()
}

/// A target with `--admin-tls-cert` registers saying so, and a control
/// plane trusting its CA programs it over https: the attach exports the
/// volume's namespace to the host there, the detach removes it.
#[test]
fn the_control_plane_programs_an_https_admin_api_it_trusts() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let c = certs::make(dir.path(), "admin");
    let (_dev_dir, device) = scratch_file(4 * MIB);
    let state: PathBuf = dir.path().join("state");
    let cp = ControlPlane::start_trusting(Arc::new(MemStore::new()), Some(&c.ca));
    let target = spawn_tls_target(&cp, &c, "t-tls", &state, &device);
    let t = registered_with_a_volume(&cp, "t-tls");
    assert_eq!(t["admin_tls"], true, "{t}");
    let admin: SocketAddr = t["admin_addr"].as_str().unwrap().parse().unwrap();

    let (status, a) = cp.send("PUT", &attachment_path(), None);
    assert_eq!(status, 201, "{a}");
    assert_eq!(a["state"], "attached");
    let extent = &a["plan"]["extents"][0];
    assert_eq!(extent["target"], "t-tls");
    let nqn = extent["subsystem_nqn"].as_str().unwrap();
    let subs = host_subsystems(admin, &c.ca, &state);
    assert_eq!(subs.len(), 1, "{subs:?}");
    assert_eq!(subs[0]["nqn"], nqn);
    assert_eq!(subs[0]["allowed_hosts"], serde_json::json!([HOST_A]));
    let ns = &subs[0]["namespaces"][0];
    assert_eq!(ns["nsid"], extent["nsid"]);
    assert_eq!(
        ns["backend"],
        format!("{},offset=0,length={MIB}", file_spec(&device))
    );

    let (status, v) = cp.send("DELETE", &attachment_path(), None);
    assert_eq!(status, 204, "{v}");
    assert!(host_subsystems(admin, &c.ca, &state).is_empty());
    target.stop();
    cp.stop();
}

/// A control plane that does not trust the target's CA (another CA, or
/// the system bundle without `--target-cacert`) refuses the attach with
/// an error naming TLS, and leaves nothing behind: no attachment record,
/// no subsystem on the target. The same records then attach through a
/// control plane that trusts the CA.
#[test]
fn a_control_plane_that_does_not_trust_the_admin_api_changes_nothing() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let c = certs::make(dir.path(), "admin");
    let other = certs::make(dir.path(), "other");
    let (_dev_dir, device) = scratch_file(4 * MIB);
    let state: PathBuf = dir.path().join("state");
    let store = Arc::new(MemStore::new());
    let cp = ControlPlane::start_trusting(store.clone(), Some(&other.ca));
    let target = spawn_tls_target(&cp, &c, "t-untrusting", &state, &device);
    let t = registered_with_a_volume(&cp, "t-untrusting");
    let admin: SocketAddr = t["admin_addr"].as_str().unwrap().parse().unwrap();

    let (status, e) = cp.send("PUT", &attachment_path(), None);
    assert_eq!(status, 503, "{e}");
    assert_eq!(e["kind"], "target_unreachable", "{e}");
    let message = e["message"].as_str().unwrap();
    assert!(
        message.contains("TLS with its admin API failed")
            && message.contains("UnknownIssuer")
            && message.contains("--target-cacert")
            && message.contains("127.0.0.1"),
        "{message}"
    );
    let nothing_behind = || {
        let (status, v) = cp.get(&format!("/v1/volumes/{VOLUME}/attachments"));
        assert_eq!((status, &v), (200, &serde_json::json!([])));
        assert!(host_subsystems(admin, &c.ca, &state).is_empty());
    };
    nothing_behind();

    // Without --target-cacert: the system bundle knows no test CA.
    let uuid: nvpool_control::Uuid = VOLUME.parse().unwrap();
    let system = cluster_trusting(store.clone(), None);
    let e = nvpool_control::program::attach(&system, &uuid, HOST_A).unwrap_err();
    assert!(
        matches!(&e, nvpool_control::program::ProgramError::Unreachable { message, .. }
            if message.contains("UnknownIssuer")),
        "{e}"
    );
    nothing_behind();

    // Trusting the target's CA, the same records attach.
    let trusting = cluster_trusting(store, Some(&c.ca));
    let done = nvpool_control::program::attach(&trusting, &uuid, HOST_A).unwrap();
    assert!(done.created);
    assert_eq!(host_subsystems(admin, &c.ca, &state).len(), 1);
    target.stop();
    cp.stop();
}
