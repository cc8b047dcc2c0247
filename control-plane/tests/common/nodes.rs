//! Real targets for the control plane's integration tests: `nvpool-target`
//! daemons in process on loopback, each with one file device, registered
//! with a control plane served by [`super::serve`], and helpers to create,
//! attach and detach volumes and to reach them as a host.

use super::{serve, Server, ADMIN, MIB, READER};
use nvpool_control::api::AuthConfig;
use nvpool_control::auth::{Principal, Tokens};
use nvpool_control::rest::Secret;
use nvpool_initiator::ConnectParams;
use nvpool_target::daemon::StartOptions;
use nvpool_target::target::Target;
use nvpool_target::AdminTokens;
use nvpool_testkit::target::{self as testkit, Serving};
use serde_json::{json, Value};
use std::io::{Read, Seek, SeekFrom};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000001";
pub const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-4000-8000-000000000002";
/// Device size: 16 extents of 1 MiB.
pub const DEVICE_BYTES: u64 = 16 * MIB;

/// One target daemon with one file device.
pub struct Node {
    pub id: String,
    pub running: Serving,
    pub target: Arc<Target>,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    /// Its admin API's token (each node its own), given in its
    /// registration.
    pub admin_token: String,
    pub device: PathBuf,
    pub state_dir: PathBuf,
    _dir: tempfile::TempDir,
}

fn start_running(
    target: &Arc<Target>,
    listen: SocketAddr,
    admin: SocketAddr,
    admin_token: &str,
) -> Serving {
    let tokens = AdminTokens::fixed(vec![Secret::new(admin_token).unwrap()]);
    let opts = StartOptions {
        listeners: vec![listen],
        reactors: 1,
        io_uring: false,
        admin: Some(testkit::admin(admin, tokens)),
        ..testkit::loopback()
    };
    testkit::start(target, &opts)
}

impl Node {
    pub fn start(i: usize) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let device = dir.path().join("d0.img");
        std::fs::File::create(&device)
            .unwrap()
            .set_len(DEVICE_BYTES)
            .unwrap();
        let state_dir = dir.path().join("state");
        std::fs::create_dir_all(&state_dir).unwrap();
        let target = Target::new(Some(state_dir.clone())).unwrap();
        // What it registers as, and answers it is (GET /v1/identity).
        target.set_target_id(format!("t{i}"));
        let admin_token = format!("node-t{i}-admin-token-0123456789");
        let running = start_running(&target, testkit::LOOPBACK, testkit::LOOPBACK, &admin_token);
        let (addr, admin) = (running.addr, running.admin_addr());
        Node {
            id: format!("t{i}"),
            running,
            target,
            addr,
            admin,
            admin_token,
            device,
            state_dir,
            _dir: dir,
        }
    }

    pub fn registration(&self, rack: &str) -> Value {
        nvpool_testkit::control::registration(
            &self.id,
            rack,
            self.addr,
            self.admin,
            &self.admin_token,
            &self.device,
            DEVICE_BYTES,
        )
    }

    pub fn stop(&mut self) {
        self.running.stop();
    }

    /// Starts again on the same ports from the saved state (what a restart
    /// of the daemon does).
    pub fn restart(&mut self) {
        self.stop();
        self.target = Target::new(Some(self.state_dir.clone())).unwrap();
        self.target.set_target_id(self.id.clone());
        if let Some(cfg) = nvpool_target::config::Config::load_state(&self.state_dir).unwrap() {
            self.target.apply_config(&cfg).unwrap();
        }
        self.running = start_running(&self.target, self.addr, self.admin, &self.admin_token);
    }

    /// Subsystems under the nvpool host prefix: NQN → (allowed hosts, NSIDs).
    pub fn host_subsystems(&self) -> Vec<(String, Vec<String>, Vec<u32>)> {
        self.target
            .subsystems()
            .values()
            .filter(|s| s.nqn.starts_with("nqn.2026-11.io.nvpool:host:"))
            .map(|s| {
                (
                    s.nqn.clone(),
                    s.hosts.iter().cloned().collect(),
                    s.namespaces.keys().copied().collect(),
                )
            })
            .collect()
    }
}

pub struct Cluster {
    pub server: Server,
    pub nodes: Vec<Node>,
}

pub fn cluster(n: usize) -> Cluster {
    cluster_with_tokens(n, Tokens::new())
}

/// [`cluster`], the control plane also knowing `more` tokens.
pub fn cluster_with_tokens(n: usize, more: Tokens) -> Cluster {
    let server = serve(AuthConfig::new(
        more.with(Principal::Admin, ADMIN)
            .with(Principal::Reader, READER),
    ));
    let nodes: Vec<Node> = (0..n).map(Node::start).collect();
    for (i, node) in nodes.iter().enumerate() {
        let r = server.admin(
            "POST",
            "/v1/targets",
            Some(node.registration(&format!("r{i}"))),
        );
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // Registration reconciles in the background; let that settle so it
    // does not race with the test's own checks.
    std::thread::sleep(Duration::from_millis(200));
    Cluster { server, nodes }
}

pub fn uuid(n: u8) -> String {
    format!("{n:08x}-0000-4000-8000-000000000000")
}

pub fn create(s: &Server, n: u8, size: u64, layout: Value) -> String {
    let id = uuid(n);
    let r = s.admin(
        "PUT",
        &format!("/v1/volumes/{id}"),
        Some(json!({"name": format!("vol{n}"), "size_bytes": size, "layout": layout})),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    id
}

pub fn enc(host: &str) -> String {
    host.replace(':', "%3A")
}

pub fn attach(s: &Server, vol: &str, host: &str) -> super::Reply {
    s.admin(
        "PUT",
        &format!("/v1/volumes/{vol}/attachments/{}", enc(host)),
        None,
    )
}

pub fn detach(s: &Server, vol: &str, host: &str, force: bool) -> super::Reply {
    let q = if force { "?force=true" } else { "" };
    s.admin(
        "DELETE",
        &format!("/v1/volumes/{vol}/attachments/{}{q}", enc(host)),
        None,
    )
}

pub fn node_of<'a>(c: &'a Cluster, target: &str) -> &'a Node {
    c.nodes.iter().find(|n| n.id == target).unwrap()
}

pub fn params(addr: SocketAddr, subnqn: &str, host: &str) -> ConnectParams {
    let mut p = ConnectParams::new(addr, subnqn);
    p.hostnqn = host.to_owned();
    p.io_queues = 1;
    p.queue_depth = 16;
    p.ctrl_loss_timeout = Duration::from_secs(2);
    p.connect_timeout = Duration::from_secs(5);
    p
}

pub fn read_file_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut f = std::fs::File::open(path).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    let mut buf = vec![0; len];
    f.read_exact(&mut buf).unwrap();
    buf
}

/// The owner of a served volume and one of its other paths, from the
/// served view an export answers with.
pub fn owner_and_other(served: &Value) -> (String, String) {
    let owner = served["owner"].as_str().expect("an owner").to_owned();
    let other = served["paths"]
        .as_array()
        .expect("paths")
        .iter()
        .map(|p| p["target"].as_str().expect("a path's target").to_owned())
        .find(|t| *t != owner)
        .expect("a path besides the owner");
    (owner, other)
}
