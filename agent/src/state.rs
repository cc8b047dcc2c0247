//! What the agent keeps on disk.
//!
//! ```text
//! RUN_DIR (/run/nvpool)                  gone at reboot
//!   agent.sock   the API (0600)          agent.log   the agent's log
//!   agent.pid    agent.lock (one agent per run directory)
//!   volumes/UUID.json  what was built for a volume (device, mount, ublk id,
//!                      the agent's pid): a successor clears it after a crash
//!   fuse/UUID/   FUSE mountpoints        ublk/       libublk's runtime files
//! STATE_DIR (/var/lib/nvpool/agent)      survives reboots
//!   attached.json  the volumes to serve: what a restarted agent serves again
//! ```

use crate::api::{AttachBody, Frontend};
use anyhow::Context;
use nvpool_layout::Uuid;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Where the socket, logs, records and mountpoints live:
/// `NVPOOL_RUN_DIR`, else /run/nvpool for root, else a per-user directory.
pub fn run_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("NVPOOL_RUN_DIR") {
        return PathBuf::from(d);
    }
    if is_root() {
        return PathBuf::from("/run/nvpool");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => PathBuf::from(d).join("nvpool"),
        None => std::env::temp_dir().join(format!("nvpool-{}", uid())),
    }
}

/// Where the list of volumes to serve survives a reboot:
/// `NVPOOL_STATE_DIR`, else `RUN_DIR/state` when `NVPOOL_RUN_DIR` is set
/// (tests, several agents on one machine), else /var/lib/nvpool/agent for
/// root, else `RUN_DIR/state`.
pub fn state_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("NVPOOL_STATE_DIR") {
        return PathBuf::from(d);
    }
    if std::env::var_os("NVPOOL_RUN_DIR").is_none() && is_root() {
        return PathBuf::from("/var/lib/nvpool/agent");
    }
    run_dir().join("state")
}

fn uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

fn is_root() -> bool {
    uid() == 0
}

/// The agent's socket.
pub fn socket_path() -> PathBuf {
    run_dir().join("agent.sock")
}

/// The agent's log when the CLI starts it.
pub fn log_path() -> PathBuf {
    run_dir().join("agent.log")
}

/// What the agent built for a volume: enough to tear it down after a crash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub uuid: Uuid,
    pub name: String,
    pub host_nqn: String,
    /// The agent serving it.
    pub pid: u32,
    pub frontend: Frontend,
    /// The block device.
    pub device: PathBuf,
    /// FUSE: the mountpoint holding the volume file.
    pub mountpoint: Option<PathBuf>,
    /// ublk: the device id.
    pub ublk_id: Option<u32>,
    /// nbd: the thread that configured the device, as the kernel shows it
    /// (`/sys/block/nbdN/pid`): a successor disconnects the device only if
    /// it is still that one's.
    #[serde(default)]
    pub nbd_pid: Option<u32>,
    pub started_ms: u64,
}

fn record_path(uuid: &Uuid) -> PathBuf {
    run_dir().join("volumes").join(format!("{uuid}.json"))
}

/// Every record left in the run directory.
pub fn records() -> Vec<Record> {
    let Ok(dir) = std::fs::read_dir(run_dir().join("volumes")) else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok())
        .collect()
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a
/// crash leaves the old file or the new one.
fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

pub fn write_record(r: &Record) -> anyhow::Result<()> {
    write_atomic(&record_path(&r.uuid), &serde_json::to_vec_pretty(r)?)
}

pub fn remove_record(uuid: &Uuid) {
    let _ = std::fs::remove_file(record_path(uuid));
}

/// A volume to serve, as asked; kept across restarts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wanted {
    pub uuid: Uuid,
    pub name: String,
    /// The front-end is the one chosen when it was first served, never
    /// `auto`: a restart presents it the same way.
    pub spec: AttachBody,
    /// The ublk id or nbd index it had, asked for again on restart so
    /// the device keeps its name where the kernel lets it.
    #[serde(default)]
    pub index: Option<u32>,
}

fn wanted_path() -> PathBuf {
    state_dir().join("attached.json")
}

/// The volumes to serve (empty when there is no file yet).
pub fn load_wanted() -> anyhow::Result<Vec<Wanted>> {
    let path = wanted_path();
    match std::fs::read(&path) {
        Ok(b) => serde_json::from_slice(&b).with_context(|| format!("reading {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

pub fn save_wanted(w: &[Wanted]) -> anyhow::Result<()> {
    write_atomic(&wanted_path(), &serde_json::to_vec_pretty(w)?)
}

/// Whether process `pid` exists.
pub fn alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks for existence.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Milliseconds since the epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
