//! nvpool control plane, as a library: the metadata store, the cluster
//! model, extent placement, and the transactional operations that tie them
//! together; with the `server` feature (default) also the REST API and the
//! `nvpool-control` daemon.
//!
//! ```text
//!   daemon ── command line, store (redb, etcd), migrate, signals
//!     └── api ── REST under /v1 (axum), OpenAPI (utoipa), /metrics
//!          │      ├── rest ── request and response bodies (no feature)
//!          │      └── httpd ── bearer tokens, JSON bodies: shared with the
//!          │                   target's and the agent's APIs ("http-server")
//!          │           └── http ── client endpoint failover (feature "client")
//!          │
//!   state::Cluster ── register, heartbeat, pools, create/grow/delete volumes
//!      │        │
//!      │   placement::Allocator ── pure: devices + extents in, extents out
//!      │
//!   store::Store ── txn(conditions, ops), list, changes_since
//!      ├── RedbStore (embedded, default; feature "redb")
//!      ├── EtcdStore (etcd v3, shared by control planes; feature "etcd")
//!      └── MemStore  (tests)
//!
//!   nvpool-layout (its own crate, shared with hosts; re-exported here as
//!   model::{Uuid, Layout}, mapping, plan, resync::{SyncingCopy, HostMove})
//!      └── volume offset → (member, row, offset); the connection plan
//! ```
//!
//! Clients of the REST API (the CLI, the agent, the target's registration)
//! depend on this crate with `default-features = false`, which leaves out
//! redb, etcd and the server (axum, tokio, utoipa) and keeps [`rest`]'s bodies.
//! Hosts that only serve volumes (the initiator) need only `nvpool-layout`.

#[cfg(feature = "server")]
pub mod api;
pub mod attach;
pub mod auth;
pub mod clock;
#[cfg(feature = "server")]
pub mod daemon;
#[cfg(feature = "server")]
pub mod failover;
#[cfg(feature = "server")]
pub mod heal;
#[cfg(feature = "server")]
pub mod hostkeys;
#[cfg(feature = "client")]
pub mod http;
#[cfg(feature = "http-server")]
pub mod httpd;
pub mod leader;
pub mod limits;
pub mod mapping;
pub mod model;
pub mod moves;
pub mod paths;
pub mod placement;
pub mod plan;
#[cfg(feature = "server")]
pub mod program;
pub mod rebalance;
pub mod rest;
pub mod resync;
pub mod state;
pub mod store;
#[cfg(feature = "client")]
pub mod tls;

pub use clock::{Clock, ManualClock, SystemClock};
pub use mapping::{Geometry, Location, MapError, Segment};
pub use model::{
    Device, DeviceRef, Extent, Health, Layout, ModelError, Pool, Target, TargetState, Uuid, Volume,
    VolumeSpec, VolumeStatus,
};
pub use placement::{Allocator, PlacementError};
pub use plan::{ConnectionPlan, LayoutBody, PlanExtent};
pub use state::{Cluster, StateConfig, StateError, TargetRegistration};
pub use store::{Store, StoreError};
