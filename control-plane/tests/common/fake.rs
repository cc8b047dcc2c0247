//! A target's admin API on a loopback port, for tests of what the control
//! plane asks of targets: it says it is `id`, has no subsystem until one
//! is put, accepts every change (echoing the body of a release, a
//! snapshot, a seal or a rollback: all done) unless told to refuse a
//! path, and records each request.
//! While `down`, it closes every connection unanswered.

use super::{read_request, Request};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// What a [`FakeTarget`] was asked: method, path and body.
pub type Seen = Arc<Mutex<Vec<(String, String, String)>>>;

/// Paths (by suffix) the target refuses, with the status and error kind.
type Refusals = Arc<Mutex<Vec<(String, u16, String)>>>;

pub struct FakeTarget {
    pub addr: SocketAddr,
    pub seen: Seen,
    pub down: Arc<AtomicBool>,
    refuse: Refusals,
}

impl FakeTarget {
    pub fn start(id: &str) -> FakeTarget {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let seen = Seen::default();
        let refuse = Refusals::default();
        let down = Arc::new(AtomicBool::new(false));
        let (log, refusals, id) = (seen.clone(), refuse.clone(), id.to_owned());
        let is_down = down.clone();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                if is_down.load(Ordering::SeqCst) {
                    continue;
                }
                let Request {
                    method, path, body, ..
                } = read_request(&mut s);
                let refused = refusals
                    .lock()
                    .unwrap()
                    .iter()
                    .find(|(suffix, _, _)| method != "GET" && path.ends_with(suffix.as_str()))
                    .cloned();
                let (status, answer) = match (method.as_str(), path.as_str(), refused) {
                    (_, _, Some((_, code, kind))) => (
                        format!("{code} Refused"),
                        json!({"kind": kind, "message": format!("refused: {kind}"),
                               "details": {}})
                        .to_string(),
                    ),
                    ("GET", "/v1/identity", _) => (
                        "200 OK".to_owned(),
                        json!({"identity": "00000000-0000-4000-8000-000000000000",
                               "target_id": id})
                        .to_string(),
                    ),
                    ("GET", p, _) if p.starts_with("/v1/subsystems/") => (
                        "404 Not Found".to_owned(),
                        json!({"kind": "not_found", "message": "no such subsystem",
                               "details": {}})
                        .to_string(),
                    ),
                    ("GET", _, _) => ("200 OK".to_owned(), "[]".to_owned()),
                    ("POST", p, _)
                        if p.ends_with("/release")
                            || p.ends_with("/snapshots")
                            || p.ends_with("/seal")
                            || p.ends_with("/rollback") =>
                    {
                        ("200 OK".to_owned(), body.clone())
                    }
                    _ => ("200 OK".to_owned(), "{}".to_owned()),
                };
                log.lock().unwrap().push((method, path, body));
                let _ = s.write_all(
                    format!(
                        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\n\
                         Content-Length: {}\r\nConnection: close\r\n\r\n{answer}",
                        answer.len()
                    )
                    .as_bytes(),
                );
            }
        });
        FakeTarget {
            addr,
            seen,
            down,
            refuse,
        }
    }

    /// From now on, a change to a path ending in `suffix` is answered
    /// `status` with error `kind`.
    pub fn refuse(&self, suffix: &str, status: u16, kind: &str) {
        self.refuse
            .lock()
            .unwrap()
            .push((suffix.to_owned(), status, kind.to_owned()));
    }

    /// The bodies of every POST to a path ending in `suffix`, in order,
    /// with their paths.
    pub fn posts(&self, suffix: &str) -> Vec<(String, Value)> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(m, p, _)| m == "POST" && p.ends_with(suffix))
            .map(|(_, p, b)| (p.clone(), serde_json::from_str(b).unwrap()))
            .collect()
    }

    /// The roots released on `device` (a release is idempotent: asked
    /// twice, they count once).
    pub fn released(&self, device: &str) -> BTreeSet<u64> {
        self.posts(&format!("/v1/devices/{device}/release"))
            .into_iter()
            .flat_map(|(_, v)| {
                v["roots"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|r| r.as_u64().unwrap())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The backends of every namespace put.
    pub fn namespace_backends(&self) -> Vec<String> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(m, p, _)| m == "PUT" && p.contains("/namespaces/"))
            .map(|(_, _, b)| {
                let v: Value = serde_json::from_str(b).unwrap();
                v["backend"].as_str().unwrap().to_owned()
            })
            .collect()
    }
}

/// A control plane with three fake targets `t0`–`t2`, each with a plain
/// device `d0` and a grain pool `d1` of 8 MiB (1 MiB extents), and a host
/// token for each of `hosts` (NQN, token): the cluster of the snapshot,
/// group and rollback tests.
pub fn thin_cluster(hosts: &[(&str, &str)]) -> (super::Server, Vec<FakeTarget>) {
    use super::{serve, ADMIN, MIB, READER, TARGET};
    use nvpool_control::api::AuthConfig;
    use nvpool_control::auth::{Principal, Tokens};
    let tokens = hosts.iter().fold(
        Tokens::new()
            .with(Principal::Admin, ADMIN)
            .with(Principal::Target, TARGET)
            .with(Principal::Reader, READER),
        |t, (host, token)| t.with(Principal::Host((*host).into()), token),
    );
    let s = serve(AuthConfig::new(tokens));
    let fakes: Vec<FakeTarget> = (0..3)
        .map(|i| FakeTarget::start(&format!("t{i}")))
        .collect();
    for (i, f) in fakes.iter().enumerate() {
        let reg = json!({
            "id": format!("t{i}"), "name": format!("host{i}"),
            "addr": format!("10.0.0.{i}:4420"), "admin_addr": f.addr.to_string(),
            "labels": {},
            "devices": [
                {"id": "d0", "backend": format!("file:/dev/nvme{i}n1"), "capacity_bytes": 8 * MIB},
                {"id": "d1", "backend": format!("thin:/dev/nvme{i}n2"), "capacity_bytes": 8 * MIB},
            ],
        });
        let r = s.call("POST", "/v1/targets", Some(TARGET), Some(reg));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    (s, fakes)
}

/// The UUID of test volume `n`.
pub fn volume_uuid(n: u8) -> String {
    format!("{n:08x}-0000-4000-8000-000000000000")
}
