//! What the control plane and hosts must agree on about a volume, and
//! nothing else: its identity and layout, where each of its bytes lives,
//! the connection plan a host serves it by, and what a host is told about
//! copies being brought in sync or moved. Plain data, arithmetic and
//! checks: no store, no I/O, no server (utoipa schemas behind the `schema`
//! feature, which only the control plane's server turns on).
//!
//! ```text
//!   model ── Uuid, Layout, their checks (limits)
//!     └── mapping ── volume offset → (member, row, offset in extent)
//!          └── plan ── ConnectionPlan: one PlanExtent per extent, validated
//!               └── copies ── SyncingCopy, HostMove: the copies a host
//!                             writes but does not (yet) read
//! ```
//!
//! The control plane (`nvpool-control`) re-exports every item from the
//! paths it had there, so its users see one type whichever crate they name.

pub mod copies;
pub mod limits;
pub mod mapping;
pub mod model;
pub mod plan;

pub use copies::{HostMove, SyncingCopy};
pub use mapping::{Geometry, Location, MapError, Segment, Segments};
pub use model::{Layout, LayoutError, Uuid};
pub use plan::{ConnectionPlan, LayoutBody, PlanExtent};
