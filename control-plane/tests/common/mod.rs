//! Shared by the control plane's integration tests: the router served on a
//! loopback port over a MemStore-backed cluster with a manual clock, and a
//! minimal HTTP/1.1 client (one request per connection); real etcd members
//! ([`etcd`]); a workload that builds cluster state ([`workload`]).

#![allow(dead_code)]

pub mod etcd;
pub mod fake;
pub mod nodes;
pub mod workload;

use nvpool_control::api::{ApiServer, AuthConfig};
use nvpool_control::store::{MemStore, Store};
use nvpool_control::{Cluster, ManualClock};
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

pub const MIB: u64 = 1 << 20;
pub const T0: u64 = 1_000_000;
pub const ADMIN: &str = "admin-secret-0123456789";
pub const TARGET: &str = "target-secret-0123456789";
pub const READER: &str = "reader-secret-0123456789";

pub struct Server {
    pub cluster: Arc<Cluster>,
    pub addr: SocketAddr,
    pub clock: Arc<ManualClock>,
    _api: ApiServer,
}

pub fn serve(auth: AuthConfig) -> Server {
    serve_store(Arc::new(MemStore::new()), auth)
}

/// [`serve`] over another store.
pub fn serve_store(store: Arc<dyn Store>, auth: AuthConfig) -> Server {
    let (api, cluster, clock) = nvpool_testkit::control::control_plane(store, T0, MIB, auth);
    Server {
        cluster,
        addr: api.addr,
        clock,
        _api: api,
    }
}

pub struct Reply {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
}

/// One request on its own connection to `addr`: an error when nothing
/// answers (a refused or reset connection, no answer within 30 s).
pub fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&str>,
) -> std::io::Result<Reply> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    if let Some(t) = token {
        req.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    let body = body.unwrap_or("");
    if !body.is_empty() || method != "GET" {
        req.push_str("Content-Type: application/json\r\n");
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes())?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let Some((head, body)) = out.split_once("\r\n\r\n") else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the connection closed before a full response",
        ));
    };
    let status = head
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP status line: {head:?}")))?;
    assert!(
        !head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "the test client reads Content-Length bodies only"
    );
    Ok(Reply {
        status,
        headers: head.to_owned(),
        body: body.to_owned(),
    })
}

impl Server {
    pub fn raw(&self, method: &str, path: &str, token: Option<&str>, body: Option<&str>) -> Reply {
        http(self.addr, method, path, token, body).unwrap()
    }

    pub fn call(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> Reply {
        let text = body.map(|b| b.to_string());
        self.raw(method, path, token, text.as_deref())
    }

    /// A GET with the reader token.
    pub fn read(&self, path: &str) -> Reply {
        self.call("GET", path, Some(READER), None)
    }

    pub fn admin(&self, method: &str, path: &str, body: Option<Value>) -> Reply {
        self.call(method, path, Some(ADMIN), body)
    }

    /// An error reply: the status, and a JSON body with kind, message and details.
    pub fn expect_error(&self, r: &Reply, status: u16, kind: &str) {
        assert_eq!(r.status, status, "{}", r.body);
        let j = r.json();
        assert_eq!(j["kind"], kind, "{j}");
        assert!(j["message"].as_str().is_some_and(|m| !m.is_empty()), "{j}");
        assert!(j["details"].is_object(), "{j}");
    }
}

/// One HTTP request as a fake target's admin API reads it.
pub struct Request {
    /// `METHOD PATH HTTP/1.1`.
    pub line: String,
    pub method: String,
    pub path: String,
    pub authorization: Option<String>,
    pub body: String,
}

/// Reads one request (head and a Content-Length body) from `s`; what a
/// broken stream left unread is empty.
pub fn read_request(s: &mut TcpStream) -> Request {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && s.read(&mut b).is_ok_and(|n| n == 1) {
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let mut lines = head.split("\r\n");
    let line = lines.next().unwrap_or_default().to_owned();
    let mut words = line.split(' ');
    let method = words.next().unwrap_or_default().to_owned();
    let path = words.next().unwrap_or_default().to_owned();
    let (mut authorization, mut len) = (None, 0usize);
    for (k, v) in lines.filter_map(|l| l.split_once(':')) {
        match k.trim().to_ascii_lowercase().as_str() {
            "authorization" => authorization = Some(v.trim().to_owned()),
            "content-length" => len = v.trim().parse().unwrap_or(0),
            _ => {}
        }
    }
    let mut body = vec![0u8; len];
    let _ = s.read_exact(&mut body);
    let body = String::from_utf8_lossy(&body).into_owned();
    Request {
        line,
        method,
        path,
        authorization,
        body,
    }
}
