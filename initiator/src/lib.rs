//! A userspace NVMe-oF host over TCP or RDMA (one protocol core, the
//! transport underneath: `link.rs`).
//!
//! ```text
//!  Controller ── admin queue (Connect, enable, Identify, features, keep-alive thread)
//!      │
//!      ├── IoQueue 1 ── its own TCP connection or RDMA queue pair, owned by one thread
//!      ├── IoQueue 2
//!      └── …            submit(Request) … poll(&mut completions)
//! ```
//!
//! An [`IoQueue`] is owned by one thread and needs no lock: `submit` queues
//! commands (TCP: in-capsule data for small writes, R2T/H2CData for larger
//! ones; RDMA: the slot's registered buffer, which the controller reads or
//! writes), `poll` sends what is queued, reads what the controller sent and
//! returns completions. Up to the queue depth of commands may be
//! outstanding; command slots and their identifiers are reused, so the
//! steady state allocates nothing (request buffers are the caller's and
//! come back in completions).
//!
//! When a connection breaks, the queue reconnects (through the controller,
//! which re-establishes the admin queue once for all its queues) with a
//! delay between attempts, and reissues every command that had not
//! completed. After the controller-loss timeout it gives up and fails them.

pub mod admin;
pub mod blockdev;
mod bufpool;
pub mod conn;
pub mod device;
pub mod discover;
pub mod error;
pub mod exec;
pub mod follow;
pub mod frontend;
pub mod hostnqn;
pub mod limits;
mod link;
pub mod queue;
mod rdma;
pub mod volume;

pub use admin::{ConnectParams, Controller, NamespaceInfo, Transport};
pub use blockdev::{BlockDev, BufResult, IoFuture};
pub use device::{ControllerIo, Device};
pub use error::{Error, IoError};
pub use queue::{Completion, IoQueue, Op, Request};
pub use volume::{CopyState, MissedRegions, MovingCopy, Volume, VolumeHealth, VolumeOptions};
