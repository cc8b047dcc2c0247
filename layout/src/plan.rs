//! The connection plan: what a host needs to reach an attached volume.
//!
//! Attaching a volume to a host exports each of the volume's extents as one
//! namespace of that host's subsystem on the extent's target, so the plan
//! lists, for every extent in the volume's canonical `(row, member, copy)`
//! order, where to connect and which namespace holds it. The namespace is
//! the extent alone: volume byte `o` of extent `e` is namespace byte
//! `offset_in_extent`, whatever `e.offset` is on the device.
//!
//! This type is shared by the control plane (which returns it from
//! `PUT /v1/volumes/{uuid}/attachments/{host_nqn}`), the CLI (which prints
//! it) and the initiator's volume engine (which connects by it).

use crate::mapping::Geometry;
use crate::model::{Layout, LayoutError, Uuid};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::net::SocketAddr;

/// NQN prefix of the per-host subsystems the control plane creates on
/// targets. Targets leave subsystems outside this prefix alone.
pub const HOST_SUBSYSTEM_PREFIX: &str = "nqn.2026-11.io.nvpool:host:";

/// Granularity of the record of writes a stale copy missed: hosts keep one
/// bit per region of each stale copy, and a partial resync copies the
/// regions whose bit is set. 1 MiB keeps the record of a 1 GiB extent at
/// 128 bytes while copying little more than what changed (writes cluster).
pub const RESYNC_REGION_BYTES: u64 = 1 << 20;

/// A volume layout as JSON: `{"type": "concat"}`, `{"type": "raid0",
/// "stripe_bytes": 65536, "width": 4}`, `{"type": "raid1", "copies": 2}`,
/// `{"type": "raid10", "stripe_bytes": 65536, "width": 2, "copies": 2}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
// Every variant is a struct, even `concat`'s empty one: serde ignores the
// extra fields of a unit variant, so `{"type": "concat", "copies": 2}`
// would pass for a concat.
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum LayoutBody {
    Concat {},
    Raid0 {
        stripe_bytes: u64,
        width: u32,
    },
    Raid1 {
        copies: u8,
    },
    Raid10 {
        stripe_bytes: u64,
        width: u32,
        copies: u8,
    },
}

impl From<LayoutBody> for Layout {
    fn from(l: LayoutBody) -> Layout {
        match l {
            LayoutBody::Concat {} => Layout::Concat,
            LayoutBody::Raid0 {
                stripe_bytes,
                width,
            } => Layout::Raid0 {
                stripe_bytes,
                width,
            },
            LayoutBody::Raid1 { copies } => Layout::Raid1 { copies },
            LayoutBody::Raid10 {
                stripe_bytes,
                width,
                copies,
            } => Layout::Raid10 {
                stripe_bytes,
                width,
                copies,
            },
        }
    }
}

impl From<Layout> for LayoutBody {
    fn from(l: Layout) -> LayoutBody {
        match l {
            Layout::Concat => LayoutBody::Concat {},
            Layout::Raid0 {
                stripe_bytes,
                width,
            } => LayoutBody::Raid0 {
                stripe_bytes,
                width,
            },
            Layout::Raid1 { copies } => LayoutBody::Raid1 { copies },
            Layout::Raid10 {
                stripe_bytes,
                width,
                copies,
            } => LayoutBody::Raid10 {
                stripe_bytes,
                width,
                copies,
            },
        }
    }
}

/// Where one extent of an attached volume is exported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct PlanExtent {
    /// Target id.
    pub target: String,
    /// The target's NVMe/TCP listener.
    #[cfg_attr(feature = "schema", schema(value_type = String, example = "10.0.0.1:4420"))]
    pub addr: SocketAddr,
    /// The target's NVMe/RDMA listener, when it has one: the same
    /// subsystem and namespace are reachable there, and a host that can
    /// use RDMA may connect to it instead of `addr`. Absent in plans of
    /// control planes that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "schema",
        schema(value_type = Option<String>, example = "10.0.0.1:4420")
    )]
    pub rdma_addr: Option<SocketAddr>,
    /// The host's subsystem on that target.
    pub subsystem_nqn: String,
    /// The namespace holding this extent (the whole namespace).
    pub nsid: u32,
    /// The device and byte offset of the extent on it (for operators; the
    /// host addresses the namespace from 0).
    pub device: String,
    pub offset: u64,
    pub length: u64,
    pub member: u32,
    pub row: u32,
    pub copy: u8,
}

/// Everything a host needs to serve an attached volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct ConnectionPlan {
    #[cfg_attr(feature = "schema", schema(value_type = String))]
    pub volume: Uuid,
    pub name: String,
    /// The host NQN the namespaces are visible to; connect with it.
    pub host_nqn: String,
    pub size_bytes: u64,
    /// Logical block size the volume is addressed in.
    pub block_bytes: u32,
    pub extent_bytes: u64,
    pub layout: LayoutBody,
    /// One entry per extent, in the volume's `(row, member, copy)` order.
    pub extents: Vec<PlanExtent>,
}

impl ConnectionPlan {
    pub fn layout(&self) -> Layout {
        self.layout.into()
    }

    pub fn geometry(&self) -> Geometry {
        Geometry::new(self.size_bytes, self.extent_bytes, &self.layout())
    }

    /// The copies of `member`'s `row`-th extent, copy 0 first.
    pub fn copies_of(&self, row: u32, member: u32) -> &[PlanExtent] {
        let g = self.geometry();
        let copies = usize::from(g.copies);
        let start = (row as usize * g.width as usize + member as usize) * copies;
        &self.extents[start..start + copies]
    }

    /// Checks a plan received over the network before a host acts on it:
    /// the layout and size are valid, the extents are exactly the ones the
    /// geometry needs in canonical order, each of the extent size, no two
    /// extents share a namespace, and RDMA addresses can be connected to.
    pub fn validate(&self) -> Result<(), LayoutError> {
        let layout = self.layout();
        crate::model::validate_extent_bytes(self.extent_bytes)?;
        layout.validate(self.extent_bytes)?;
        crate::model::validate_size(self.size_bytes, &layout, self.extent_bytes)?;
        if self.block_bytes == 0
            || !self.block_bytes.is_power_of_two()
            || !self.size_bytes.is_multiple_of(u64::from(self.block_bytes))
        {
            return Err(LayoutError::Invalid(format!(
                "block size {} does not divide the volume size {}",
                self.block_bytes, self.size_bytes
            )));
        }
        let g = self.geometry();
        if self.extents.len() != g.extent_count() {
            return Err(LayoutError::Invalid(format!(
                "plan lists {} extents, the geometry needs {}",
                self.extents.len(),
                g.extent_count()
            )));
        }
        let mut seen = BTreeSet::new();
        let mut i = 0;
        for row in 0..g.rows() {
            for member in 0..g.width {
                for copy in 0..g.copies {
                    let e = &self.extents[i];
                    i += 1;
                    if (e.row, e.member, e.copy) != (row, member, copy) {
                        return Err(LayoutError::Invalid(format!(
                            "plan extent {} is (row {}, member {}, copy {}), expected \
                             ({row}, {member}, {copy})",
                            i - 1,
                            e.row,
                            e.member,
                            e.copy
                        )));
                    }
                    if e.length != self.extent_bytes || e.nsid == 0 || e.nsid == u32::MAX {
                        return Err(LayoutError::Invalid(format!(
                            "plan extent {} has length {} and NSID {}",
                            i - 1,
                            e.length,
                            e.nsid
                        )));
                    }
                    if let Some(a) = e.rdma_addr {
                        crate::model::validate_connect_addr(
                            &format!("plan extent {} rdma_addr", i - 1),
                            a,
                        )?;
                    }
                    if !seen.insert((e.addr, e.subsystem_nqn.as_str(), e.nsid)) {
                        return Err(LayoutError::Invalid(format!(
                            "plan extent {} reuses namespace {} of {} at {}",
                            i - 1,
                            e.nsid,
                            e.subsystem_nqn,
                            e.addr
                        )));
                    }
                }
            }
        }
        Ok(())
    }
}
