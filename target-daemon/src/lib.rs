//! nvpool-target: exports local storage over NVMe/TCP.
//!
//! ```text
//!  acceptor ──► reactor threads (one per core) ──► io_uring ──► files / block devices
//!                 │ queue state machines (queue/)
//!                 │ admin commands (admin.rs)
//!                 ▼
//!               Target: subsystems, namespaces, ACLs, controllers (target.rs)
//!                 ▲
//!  admin API (api.rs, tokio+axum) ── changes ──► saved to STATE_DIR/target.json
//!
//!  register.rs ── POST /v1/targets, heartbeats ──► control plane (optional)
//! ```

pub mod admin;
pub mod api;
pub mod auth;
pub mod backend;
pub mod bufpool;
pub mod config;
pub mod controller;
pub mod copier;
pub mod daemon;
pub mod limits;
pub mod peerlog;
pub mod queue;
pub mod rdma;
pub mod reactor;
pub mod register;
pub mod ring;
pub mod served;
pub mod sync;
pub mod target;
pub mod tx;
pub mod zeroing;

pub use auth::AdminTokens;
pub use daemon::{AdminOptions, Cli, Running, StartOptions};
pub use register::{Registrar, RegistrationConfig};
pub use target::Target;
