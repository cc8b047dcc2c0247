//! nvpool control plane, as a library: the metadata store, the cluster
//! model, extent placement, and the transactional operations that tie them
//! together; with the `server` feature (default) also the REST API and the
//! `nvpool-control` daemon.
//!
//! ```text
//!   daemon ── command line, store (redb, etcd), migrate, signals
//!     └── api ── REST under /v1 (axum), OpenAPI (utoipa), /metrics
//!          │      └── nvpool-api: rest (bodies), httpd (bearer tokens, JSON
//!          │          bodies), http (client failover), tls
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
//! What crosses a process (the REST bodies, TLS, the HTTP client and the
//! servers' shared scaffolding) lives in `nvpool-api`, which the CLI, the
//! agent and the target depend on instead of this crate; `rest`, `http`,
//! `httpd` and `tls` are re-exported here under their old paths.
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
pub mod families;
#[cfg(feature = "server")]
pub mod heal;
#[cfg(feature = "server")]
pub mod hostkeys;
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
pub mod read_only;
pub mod rebalance;
pub mod resync;
pub mod rollback;
pub mod snapshot_groups;
pub mod snapshots;
pub mod state;
pub mod store;
pub mod usage;

// The types and mechanisms shared with other processes live in
// `nvpool-api`; re-exported under their old paths.
#[cfg(feature = "client")]
pub use nvpool_api::http;
#[cfg(feature = "http-server")]
pub use nvpool_api::httpd;
pub use nvpool_api::rest;
#[cfg(feature = "client")]
pub use nvpool_api::tls;

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
