//! What a host is told about the copies of its volume that it writes but
//! does not (yet) read: the control plane's copy jobs as a host sees them,
//! in `GET …/attachments/{host}` (the jobs themselves are the control
//! plane's `resync` module).

use crate::plan::PlanExtent;
use serde::{Deserialize, Serialize};

/// A copy hosts write to but never read, and the job filling it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct SyncingCopy {
    pub extent: u32,
    pub job: u64,
}

/// A copy moving to a new extent, as a host sees it: write the new extent
/// too (never read it) until `switched`; then read the new one and keep
/// writing the old one until the job is gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct HostMove {
    /// The copy that moves: index into the volume's extents.
    pub extent: u32,
    pub job: u64,
    /// Where the new extent is exported to this host.
    pub dest: PlanExtent,
    pub switched: bool,
}
