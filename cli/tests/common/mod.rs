//! Shared by the CLI's integration tests: a control plane in process and
//! real in-process targets with file devices on the build disk, registered
//! with it as the daemons would register themselves.

// Each test file uses its own part of this module.
#![allow(dead_code)]

use nvpool_cli::client::Client;
use nvpool_control::api::{ApiServer, AuthConfig};
use nvpool_control::auth::{Principal, Tokens};
use nvpool_control::rest::Secret;
use nvpool_control::store::MemStore;
use nvpool_control::{Cluster, ManualClock};
use nvpool_initiator::follow::{new_session, AttachmentView, Watcher};
use nvpool_initiator::volume::{Volume, VolumeOptions};
use nvpool_target::{AdminTokens, StartOptions, Target};
use nvpool_testkit::target::{Serving, LOOPBACK};
use nvpool_testkit::{control, target};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

pub const MIB: u64 = 1 << 20;
pub const ADMIN: &str = "admin-secret-0123456789";
pub const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:12345678-aaaa-4bbb-8ccc-1234567890ab";
/// Size of each target's file device.
pub const DEVICE_BYTES: u64 = 64 * MIB;

/// A control plane on a loopback port (MemStore, a clock pinned to now, so
/// targets registered once stay online), with 1 MiB extents.
pub fn control_plane() -> ApiServer {
    control_plane_with(MIB).0
}

/// `control_plane` with another extent size, and its cluster.
pub fn control_plane_with(extent_bytes: u64) -> (ApiServer, Arc<Cluster>) {
    let (server, cluster, _) = control_plane_clocked(extent_bytes);
    (server, cluster)
}

/// `control_plane_with`, and the clock the control plane reads (it moves
/// only when the test advances it).
pub fn control_plane_clocked(extent_bytes: u64) -> (ApiServer, Arc<Cluster>, Arc<ManualClock>) {
    let auth = AuthConfig::new(Tokens::new().with(Principal::Admin, ADMIN));
    control::control_plane(
        Arc::new(MemStore::new()),
        control::now_ms(),
        extent_bytes,
        auth,
    )
}

/// A real target on loopback with one file device `d0` of
/// `DEVICE_BYTES`, registered with the control plane.
pub struct Tgt {
    serving: Option<Serving>,
    pub target: Arc<Target>,
    pub id: String,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub dir: tempfile::TempDir,
}

pub fn target(cp: &ApiServer, id: &str) -> Tgt {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    std::fs::File::create(dir.path().join("d0.img"))
        .and_then(|f| f.set_len(DEVICE_BYTES))
        .unwrap();
    let mut t = Tgt {
        serving: None,
        target: Target::new(None).unwrap(),
        id: id.to_owned(),
        addr: LOOPBACK,
        admin: LOOPBACK,
        dir,
    };
    t.start(cp);
    t
}

impl Tgt {
    /// Its admin API's token (each target its own), given in its
    /// registration.
    pub fn admin_token(&self) -> String {
        format!("cli-test-{}-admin-token", self.id)
    }

    pub fn device_path(&self) -> PathBuf {
        self.dir.path().join("d0.img")
    }

    /// Stops the target (its connections drop; its exports are forgotten,
    /// as a target without a state directory forgets them).
    pub fn stop(&mut self) {
        self.serving = None;
    }

    /// Starts it again on the same ports with the same device, and
    /// registers it (the control plane then restores its exports).
    pub fn restart(&mut self, cp: &ApiServer) {
        self.stop();
        self.target = Target::new(None).unwrap();
        self.start(cp);
    }

    fn start(&mut self, cp: &ApiServer) {
        // What it registers as, and answers it is (GET /v1/identity).
        self.target.set_target_id(self.id.clone());
        let tokens = AdminTokens::fixed(vec![Secret::new(self.admin_token()).unwrap()]);
        let opts = StartOptions {
            listeners: vec![self.addr],
            reactors: 1,
            io_uring: false,
            admin: Some(target::admin(self.admin, tokens)),
            ..target::loopback()
        };
        let serving = target::start(&self.target, &opts);
        self.addr = serving.addr;
        self.admin = serving.admin_addr();
        self.serving = Some(serving);
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .build()
            .into();
        let body = control::registration(
            &self.id,
            &self.id,
            self.addr,
            self.admin,
            &self.admin_token(),
            &self.device_path(),
            DEVICE_BYTES,
        );
        let r = agent
            .post(format!("http://{}/v1/targets", cp.addr))
            .header("Authorization", format!("Bearer {ADMIN}"))
            .send_json(&body)
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
    }
}

/// A volume attached to `HOST` and served as the agent does:
/// the engine opened from the attachment (stale, syncing and moving copies
/// as listed) and the copy watcher running until `stop` is set.
pub struct Served {
    pub volume: Arc<Volume>,
    pub watching: std::thread::JoinHandle<()>,
}

pub fn serve(client: &Client, uuid: &str, stop: &Arc<AtomicBool>) -> Served {
    let base = format!(
        "/v1/volumes/{uuid}/attachments/{}",
        nvpool_cli::client::segment(HOST)
    );
    let (status, _): (u16, serde_json::Value) = client
        .put_empty(&base)
        .unwrap_or_else(|e| panic!("attaching {uuid}: {e}"));
    assert_eq!(status, 201);
    let view: AttachmentView = client.get(&base).unwrap();
    let opts = VolumeOptions {
        failed_extents: view.copies.stale_at_open(),
        syncing_extents: view.copies.syncing_at_open(),
        moving: view.copies.moving_at_open(),
        ctrl_loss_timeout: Some(Duration::from_millis(800)),
        reconnect_delay: Duration::from_millis(100),
        connect_timeout: Duration::from_millis(500),
        ..VolumeOptions::default()
    };
    let volume = Arc::new(Volume::open(&view.plan, opts).unwrap());
    let watcher = Watcher::new(
        nvpool_agent::client::Follower(client.clone()),
        &uuid.parse().unwrap(),
        HOST,
        volume.clone(),
        new_session(),
        stop.clone(),
    );
    watcher.register(view.copies.revision);
    let first = view.copies.clone();
    let watching = std::thread::spawn(move || watcher.run(first));
    Served { volume, watching }
}

/// `len` bytes of a file at `offset` (a target's device, read directly).
pub fn file_range(path: &std::path::Path, offset: u64, len: u64) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len as usize];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut buf, offset)
        .unwrap();
    buf
}

/// The heal loop on `cluster`, quick (100 ms rounds, unthrottled, retries
/// at once), replacing copies of targets gone for `replace_after_ms`; it
/// runs until the returned flag is set.
pub fn healer(
    cluster: &Arc<Cluster>,
    replace_after_ms: u64,
) -> (Arc<AtomicBool>, std::thread::JoinHandle<()>) {
    use nvpool_control::heal::{self, HealConfig};
    let stop = Arc::new(AtomicBool::new(false));
    let handle = heal::spawn(
        cluster.clone(),
        HealConfig {
            interval: Duration::from_millis(100),
            rate_bytes_per_sec: 0,
            retry_ms: 0,
            confirm_timeout_ms: 30_000,
            replace_after_ms,
        },
        stop.clone(),
    )
    .unwrap();
    (stop, handle)
}
