//! `nvpool-agent`: one process per host that serves every volume attached
//! to it (ARCHITECTURE I8).
//!
//! ```text
//! nvpool volume attach ─ PUT attachment (control plane) ─ PUT /v1/volumes/UUID (agent socket)
//!                                                           │
//!  nvpool-agent ── Connections: one controller per target, shared by every volume
//!    ├─ volume A: engine ─ watcher (copies, growth) ─ ublk | nbd | FUSE+loop
//!    ├─ volume B: …
//!    ├─ RUN_DIR/agent.sock (0600): attach, detach, list, stats, /metrics
//!    └─ STATE_DIR/attached.json: served again after a restart
//! ```
//!
//! The data path never waits on the control plane: it is called to open a
//! volume and from the watcher and reporter threads only.

pub mod api;
pub mod client;
pub mod dhchap;
pub mod metrics;
pub mod serve;
pub mod server;
pub mod state;

pub use server::{run, Args};
