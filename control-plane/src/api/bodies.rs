//! The response bodies, built from the cluster's records.

use crate::attach::Attachment;
use crate::model::{TargetState, Uuid, VolumeStatus};
use crate::plan::ConnectionPlan;
use crate::rest::{
    AttachmentOut, CapacityOut, CopyJobOut, DeviceOut, ExtentOut, TargetOut, VolumeOut,
    VolumeSpecBody,
};
use crate::state::{Cluster, DeviceCapacity, StateError, TargetView, VolumeView};
use serde::Deserialize;
use std::collections::BTreeMap;

pub(super) fn target_out(v: &TargetView, usage: &[DeviceCapacity]) -> TargetOut {
    let t = &v.target;
    let mut capacity = CapacityOut::default();
    let devices = t
        .devices
        .iter()
        .map(|d| {
            let u = usage.iter().find(|u| u.target == t.id && u.device == d.id);
            let (used, free, free_extents, provisioned, pool) =
                u.map_or((0, d.capacity_bytes, 0, 0, None), |u| {
                    let (free, pool) = (u.free_bytes, u.pool.clone());
                    (
                        u.used_bytes,
                        free,
                        u.free_extents,
                        u.provisioned_bytes,
                        pool,
                    )
                });
            capacity.total_bytes = capacity.total_bytes.saturating_add(d.capacity_bytes);
            capacity.used_bytes = capacity.used_bytes.saturating_add(used);
            capacity.free_bytes = capacity.free_bytes.saturating_add(free);
            capacity.free_extents += free_extents;
            capacity.provisioned_bytes = capacity.provisioned_bytes.saturating_add(provisioned);
            DeviceOut {
                id: d.id.clone(),
                backend: d.backend.clone(),
                labels: d.labels.clone(),
                pool,
                capacity_bytes: d.capacity_bytes,
                used_bytes: used,
                free_bytes: free,
                thin: d.is_grain_pool(),
                provisioned_bytes: provisioned,
            }
        })
        .collect();
    TargetOut {
        id: t.id.clone(),
        name: t.name.clone(),
        addr: t.addr,
        admin_addr: t.admin_addr,
        rdma_addr: t.rdma_addr,
        admin_tls: t.admin_tls,
        labels: t.labels.clone(),
        health: v.health,
        state: t.state,
        // Holding no extent: a grain pool's reported use says nothing of that.
        drained: t.state == TargetState::Draining && capacity.provisioned_bytes == 0,
        registered_ms: t.registered_ms,
        last_heartbeat_ms: t.last_heartbeat_ms,
        capacity,
        devices,
    }
}

pub(super) fn spec_body(
    s: &crate::model::VolumeSpec,
    provisioning: crate::rest::Provisioning,
) -> VolumeSpecBody {
    VolumeSpecBody {
        name: s.name.clone(),
        size_bytes: s.size_bytes,
        layout: s.layout.into(),
        pool: s.pool.clone(),
        provisioning: Some(provisioning),
        source: None,
        read_only: false,
    }
}

pub(super) fn job_out(j: &crate::resync::CopyJob, now_ms: u64) -> CopyJobOut {
    use crate::resync::JobState;
    let copying = j.state == JobState::Copying;
    let elapsed_ms = now_ms.saturating_sub(j.copy_started_ms).max(1);
    let rate = if copying {
        j.bytes_copied.saturating_mul(1000) / elapsed_ms
    } else {
        0
    };
    CopyJobOut {
        id: j.id,
        extent: j.extent,
        source: j.source,
        kind: j.kind.as_str().to_owned(),
        state: match j.state {
            JobState::Arming => "arming",
            JobState::Mirroring => "mirroring",
            JobState::Copying => "copying",
            JobState::Switching => "switching",
        }
        .to_owned(),
        to: j.dest.as_ref().map(|d| d.device_ref().to_string()),
        bytes_total: j.bytes_total,
        bytes_copied: j.bytes_copied,
        started_ms: j.started_ms,
        rate_bytes_per_sec: rate,
        eta_s: (rate > 0).then(|| j.bytes_total.saturating_sub(j.bytes_copied) / rate),
    }
}

/// Fills in each volume's attachments.
pub(super) fn with_attachments(
    c: &Cluster,
    mut out: Vec<VolumeOut>,
) -> Result<Vec<VolumeOut>, StateError> {
    let mut by: BTreeMap<Uuid, Vec<String>> = BTreeMap::new();
    for a in c.attachments()? {
        by.entry(a.volume).or_default().push(a.host_nqn);
    }
    let read_only = c.read_only_volumes()?;
    for v in &mut out {
        v.attachments = by.remove(&v.uuid).unwrap_or_default();
        v.read_only = read_only.contains(&v.uuid);
    }
    Ok(out)
}

pub(super) fn one_with_attachments(c: &Cluster, out: VolumeOut) -> Result<VolumeOut, StateError> {
    Ok(with_attachments(c, vec![out])?
        .pop()
        .expect("one volume in, one out"))
}

/// `DELETE` options.
#[derive(Debug, Clone, Copy, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ForceQuery {
    /// Go ahead although the object is in use (attached), or a target
    /// cannot be reached (its leftovers are cleaned up when it returns).
    #[serde(default)]
    pub force: bool,
}

pub(super) fn attachment_out(a: Attachment, plan: ConnectionPlan) -> AttachmentOut {
    AttachmentOut {
        volume: a.volume,
        host_nqn: a.host_nqn,
        state: a.state,
        created_ms: a.created_ms,
        failed_extents: a.failed_extents,
        syncing: Vec::new(),
        moving: Vec::new(),
        revision: 0,
        write_epoch: 0,
        write_hold: false,
        read_only: false,
        plan,
    }
}

pub(super) fn attachment_with_plan(
    c: &Cluster,
    a: Attachment,
) -> Result<AttachmentOut, StateError> {
    let v = c.volume(&a.volume)?.volume;
    let plan = c.plan(&v, &a)?;
    let copies = c.host_copies(&a.volume, &a.host_nqn)?;
    let mut out = attachment_out(a, plan);
    out.failed_extents = copies.failed_extents;
    out.syncing = copies.syncing;
    out.moving = copies.moving;
    out.revision = copies.revision;
    (out.write_epoch, out.write_hold) = c.write_barrier(&out.volume)?;
    out.read_only = c.is_read_only(&out.volume)?;
    Ok(out)
}

/// `GET …/attachments/{host}` options.
#[derive(Debug, Clone, Copy, Default, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct WatchQuery {
    /// Answer only once the copy-state revision is past this (or after
    /// about 25 s, with the attachment as it is).
    pub after_revision: Option<u64>,
}

pub(super) fn volume_out(
    v: crate::model::Volume,
    status: VolumeStatus,
    failed_extents: Vec<u32>,
    provisioning: crate::rest::Provisioning,
) -> VolumeOut {
    VolumeOut {
        uuid: v.uuid,
        name: v.name,
        size_bytes: v.size_bytes,
        layout: v.layout.into(),
        pool: v.pool,
        status,
        extent_bytes: v.extent_bytes,
        created_ms: v.created_ms,
        extents: v.extents.into_iter().map(ExtentOut::from).collect(),
        attachments: Vec::new(),
        failed_extents,
        copy_jobs: Vec::new(),
        provisioning,
        read_only: false,
    }
}

pub(super) fn volume_view_out(v: VolumeView, now: u64) -> VolumeOut {
    let jobs = v.jobs.iter().map(|j| job_out(j, now)).collect();
    let mut out = volume_out(v.volume, v.status, v.failed_extents, v.provisioning);
    out.copy_jobs = jobs;
    out
}
