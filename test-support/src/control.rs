//! A control plane inside the test process, and the registration a target
//! daemon sends it (`POST /v1/targets`) as tests build it.

use nvpool_control::api::{ApiServer, AuthConfig};
use nvpool_control::store::Store;
use nvpool_control::{Cluster, ManualClock, StateConfig};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

/// The control plane's REST API on a loopback port over `store`, with
/// extents of `extent_bytes` and a clock that starts at `now_ms` and moves
/// only when the test advances it.
pub fn control_plane(
    store: Arc<dyn Store>,
    now_ms: u64,
    extent_bytes: u64,
    auth: AuthConfig,
) -> (ApiServer, Arc<Cluster>, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(now_ms));
    let config = StateConfig {
        extent_bytes,
        ..StateConfig::default()
    };
    let cluster = Arc::new(Cluster::new(store, clock.clone(), config).expect("cluster"));
    let server = ApiServer::start(cluster.clone(), auth, super::target::LOOPBACK)
        .expect("the control plane's API starts");
    (server, cluster, clock)
}

/// The milliseconds since the epoch now: a manual clock started here keeps
/// targets registered once online.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after the epoch")
        .as_millis() as u64
}

/// The registration of target `id` (also its name) in `rack`, listening on
/// `addr`, its admin API on `admin` with `admin_token`, and one file device
/// `d0` at `device` of `capacity_bytes`.
pub fn registration(
    id: &str,
    rack: &str,
    addr: SocketAddr,
    admin: SocketAddr,
    admin_token: &str,
    device: &Path,
    capacity_bytes: u64,
) -> Value {
    json!({
        "id": id,
        "name": id,
        "addr": addr.to_string(),
        "admin_addr": admin.to_string(),
        "admin_token": admin_token,
        "labels": {"rack": rack},
        "devices": [{
            "id": "d0",
            "backend": format!("file:{}", device.display()),
            "capacity_bytes": capacity_bytes,
        }],
    })
}
