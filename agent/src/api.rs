//! The agent's API on its Unix socket: JSON over HTTP/1.1, typed on both
//! sides (the agent serves these, the CLI sends and reads them).
//!
//! | route | what |
//! |---|---|
//! | `GET /v1/volumes` | the volumes this host serves ([`VolumeOut`]) |
//! | `PUT /v1/volumes/{uuid}` | serve a volume attached on the control plane ([`AttachBody`]); 201 started, 200 already served |
//! | `DELETE /v1/volumes/{uuid}?force=true` | stop serving it (flush, tear the device down); 409 while mounted unless forced |
//! | `GET /v1/stats` | counters and per-path state of every volume ([`VolumeStatsOut`], for `nvpool top`) |
//! | `GET /metrics` | the same in Prometheus text format |
//!
//! Errors are `{kind, message}` with a 4xx/5xx status, as the control
//! plane's.

use nvpool_layout::Uuid;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Block-device front-ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Frontend {
    /// The best this host supports: ublk, else kernel nbd, else FUSE + loop.
    Auto,
    /// Linux ublk (6.0+, module ublk_drv): /dev/ublkbN.
    Ublk,
    /// The kernel nbd driver (module nbd), fed by our NBD server: /dev/nbdN.
    Nbd,
    /// A file in a FUSE mount behind a loop device (direct I/O): /dev/loopN.
    Fuse,
    /// Served by targets, connected by this host's kernel NVMe/TCP driver
    /// with native multipath (module nvme-tcp): /dev/nvmeXnY. No nvpool
    /// process stays on the host.
    Nvme,
}

impl Frontend {
    pub fn name(self) -> &'static str {
        match self {
            Frontend::Auto => "auto",
            Frontend::Ublk => "ublk",
            Frontend::Nbd => "kernel nbd",
            Frontend::Fuse => "FUSE + loop",
            Frontend::Nvme => "kernel NVMe/TCP",
        }
    }
}

/// `PUT /v1/volumes/{uuid}`: serve a volume already attached to
/// `host_nqn` on the control plane at `endpoint`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttachBody {
    pub host_nqn: String,
    pub frontend: Frontend,
    /// The control plane's URL.
    pub endpoint: String,
    /// The file holding the token for the control plane's changes (read
    /// each time the agent opens the volume: at attach and at restart).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
}

/// A volume this host serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeOut {
    pub uuid: Uuid,
    pub name: String,
    pub host_nqn: String,
    pub frontend: Frontend,
    /// The block device; `None` while the volume waits to be served again
    /// (after the agent restarted, until its targets or the control plane
    /// answer).
    pub device: Option<PathBuf>,
    pub size_bytes: u64,
    /// `serving`, `degraded` (a copy is stale or being filled), `lost`
    /// (some range has no copy left) or `pending` (waiting to be served
    /// again; `error` says why).
    pub state: String,
    #[serde(default)]
    pub error: Option<String>,
    /// The agent's process.
    pub pid: u32,
}

/// `PUT /v1/volumes/{uuid}`'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attached {
    pub volume: VolumeOut,
    /// False when the volume was already served here.
    pub started: bool,
}

/// Counters of one volume since it was served (monotonic; rates are the
/// reader's differences).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeStatsOut {
    pub uuid: Uuid,
    pub name: String,
    pub device: Option<PathBuf>,
    pub size_bytes: u64,
    pub state: String,
    pub reads: u64,
    pub writes: u64,
    /// Flushes, discards and write-zeroes.
    pub others: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    /// Sum of completion times, nanoseconds.
    pub read_ns: u64,
    pub write_ns: u64,
    pub errors: u64,
    pub in_flight: u64,
    /// Latency histograms: `buckets[i]` counts requests that took less
    /// than 2^i µs (the last bucket: the rest).
    pub read_latency_us_log2: Vec<u64>,
    pub write_latency_us_log2: Vec<u64>,
    pub paths: Vec<PathOut>,
}

impl VolumeStatsOut {
    /// A volume that did nothing yet.
    pub fn new(uuid: Uuid, name: String, state: &str) -> VolumeStatsOut {
        VolumeStatsOut {
            uuid,
            name,
            device: None,
            size_bytes: 0,
            state: state.into(),
            reads: 0,
            writes: 0,
            others: 0,
            read_bytes: 0,
            write_bytes: 0,
            read_ns: 0,
            write_ns: 0,
            errors: 0,
            in_flight: 0,
            read_latency_us_log2: Vec::new(),
            write_latency_us_log2: Vec::new(),
            paths: Vec::new(),
        }
    }
}

/// One controller a volume uses.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathOut {
    pub addr: String,
    pub transport: String,
    /// `live` or `lost` (given up after the controller-loss timeout).
    pub state: String,
    pub in_flight: u64,
    /// Copies of this volume on the path that the volume does not read:
    /// failed or being filled.
    pub stale_copies: u32,
}
