//! Volumes: create, read, grow, delete; their copies' history and resync.

use crate::api::bodies::{
    one_with_attachments, volume_out, volume_view_out, with_attachments, ForceQuery,
};
use crate::api::errors::ApiError;
use crate::api::extract::{force_of, parse_uuid, JsonBody, Segments};
use crate::api::Api;
use crate::model::Uuid;
use crate::program::{self, ProgramError};
use crate::rest::{CopyHistoryOut, ErrorBody, Provisioning, ResizeBody, VolumeOut, VolumeSpecBody};
use crate::state::{Cluster, StateError};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::Json;
use std::collections::BTreeSet;

/// Creates a volume (idempotent by UUID, C9). With `source`, a clone of
/// that snapshot: a thin volume whose trees the snapshot trees' targets
/// create before the volume exists (any failure leaves no volume).
#[utoipa::path(put, path = "/v1/volumes/{uuid}", tag = "volumes", params(("uuid" = String, Path, description = "the volume UUID, chosen by the client")), request_body = VolumeSpecBody, responses((status = 201, description = "created", body = VolumeOut), (status = 200, description = "already existed with this spec", body = VolumeOut), (status = 400, description = "invalid input (a clone given a pool or a provisioning; read_only without a source)", body = ErrorBody), (status = 404, description = "not found (a clone's source volume or snapshot)", body = ErrorBody), (status = 409, description = "conflicts with the current state (a clone's snapshot still creating: snapshot_not_ready; a clone under that UUID under way: clone_in_progress; a volume of that UUID with another spec or read_only: uuid_conflict; the daemon at a target's admin address is another target: wrong_target)", body = ErrorBody), (status = 422, description = "cannot be placed or names an unknown device; a clone whose size or layout is not its snapshot's (clone_mismatch); a target refused a clone's trees (target_refused)", body = ErrorBody), (status = 503, description = "store busy or unavailable, or a target of a clone unreachable (nothing was left behind); retry", body = ErrorBody)))]
pub(in crate::api) async fn put_volume(
    State(api): State<Api>,
    Segments(uuid): Segments<String>,
    JsonBody(body): JsonBody<VolumeSpecBody>,
) -> Result<(StatusCode, Json<VolumeOut>), ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let source = body.source;
    if source.is_some() && (body.pool.is_some() || body.provisioning.is_some()) {
        return Err(ApiError::invalid(
            "a clone's trees are on its snapshot's devices: give neither pool nor provisioning",
        ));
    }
    let read_only = body.read_only;
    if read_only && source.is_none() {
        return Err(ApiError::invalid(
            "a read-only volume starts as a snapshot's contents: give its source",
        ));
    }
    let spec = crate::model::VolumeSpec {
        uuid,
        name: body.name,
        size_bytes: body.size_bytes,
        layout: body.layout.into(),
        pool: body.pool,
    };
    let asked = body.provisioning;
    let (created, out) = api
        .program(move |c| {
            // The mark is in place before the volume exists, so no host
            // ever attaches a read-only volume writable.
            c.prepare_read_only(&uuid, read_only)?;
            let (volume, created) = match &source {
                Some(src) => crate::snapshots::make_clone(c, &spec, &src.volume, &src.snapshot)?,
                None => {
                    let r = c.create_volume_as(&spec, asked)?;
                    (r.volume, r.created)
                }
            };
            c.check_read_only(&uuid, read_only)?;
            let view = c.volume(&uuid)?;
            let out = volume_out(volume, view.status, view.failed_extents, view.provisioning);
            Ok((created, one_with_attachments(c, out)?))
        })
        .await?;
    if created {
        tracing::info!(volume = %out.uuid, name = %out.name, size_bytes = out.size_bytes, "volume created");
        Ok((StatusCode::CREATED, Json(out)))
    } else {
        Ok((StatusCode::OK, Json(out)))
    }
}

#[utoipa::path(get, path = "/v1/volumes", tag = "volumes", responses((status = 200, description = "every volume with status and extents", body = Vec<VolumeOut>), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn list_volumes(
    State(api): State<Api>,
) -> Result<Json<Vec<VolumeOut>>, ApiError> {
    let out = api
        .run(|c| {
            let now = c.now();
            let out = c.volumes()?.into_iter().map(|v| volume_view_out(v, now));
            with_attachments(c, out.collect())
        })
        .await?;
    Ok(Json(out))
}

#[utoipa::path(get, path = "/v1/volumes/{uuid}", tag = "volumes", params(("uuid" = String, Path, description = "the volume UUID, chosen by the client")), responses((status = 200, description = "the volume", body = VolumeOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not found", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn get_volume(
    State(api): State<Api>,
    Segments(uuid): Segments<String>,
) -> Result<Json<VolumeOut>, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let out = api
        .run(move |c| one_with_attachments(c, volume_view_out(c.volume(&uuid)?, c.now())))
        .await?;
    Ok(Json(out))
}

#[utoipa::path(post, path = "/v1/volumes/{uuid}/resize", tag = "volumes", params(("uuid" = String, Path, description = "the volume UUID, chosen by the client")), request_body = ResizeBody, responses((status = 200, description = "grown (or already this size)", body = VolumeOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not found", body = ErrorBody), (status = 409, description = "would shrink, or the volume is served to hosts by its targets (unexport first)", body = ErrorBody), (status = 422, description = "cannot be placed or names an unknown device", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn resize_volume(
    State(api): State<Api>,
    Segments(uuid): Segments<String>,
    JsonBody(body): JsonBody<ResizeBody>,
) -> Result<Json<VolumeOut>, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let out = api
        .program(move |c| {
            // The paths of a served volume present a namespace of a fixed
            // size; growing it under them is not built yet.
            if let Some((s, _)) = c.served(&uuid)? {
                if !s.hosts.is_empty() {
                    return Err(StateError::Attached {
                        volume: uuid,
                        hosts: s.hosts,
                    }
                    .into());
                }
            }
            // Hosts that have it attached get the new extents exported
            // too; a target that fails here is caught up by reconciliation.
            c.resize_volume(&uuid, body.size_bytes)?;
            let attached = c.volume_attachments(&uuid)?;
            for a in &attached {
                if let Err(e) = program::attach(c, &uuid, &a.host_nqn) {
                    tracing::warn!(volume = %uuid, host = %a.host_nqn, error = %e,
                        "exporting grown extents failed; reconciliation will retry");
                }
            }
            // Serving processes hear of the bigger plan through their
            // long-poll, once the new extents are exported to them (also
            // on a repeated call: the first may have stopped short of this).
            if !attached.is_empty() {
                c.announce_plan_change(&uuid)?;
            }
            Ok(one_with_attachments(
                c,
                volume_view_out(c.volume(&uuid)?, c.now()),
            )?)
        })
        .await?;
    Ok(Json(out))
}

/// Deletes a volume and frees its extents. An attached volume is refused
/// (409 `attached`) unless `force`, which detaches it from every host
/// first (forcibly: an unreachable target's leftovers keep their extents
/// allocated until it is reconciled). A thin volume's extents stay
/// allocated until their targets have released their trees; they are
/// asked to at once, in the background.
#[utoipa::path(delete, path = "/v1/volumes/{uuid}", tag = "volumes", params(("uuid" = String, Path, description = "the volume UUID, chosen by the client"), ForceQuery), responses((status = 204, description = "deleted, its extents freed"), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not found", body = ErrorBody), (status = 409, description = "attached (use force), or has snapshots (volume_has_snapshots: delete them first)", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn delete_volume(
    State(api): State<Api>,
    Segments(uuid): Segments<String>,
    query: Result<Query<ForceQuery>, QueryRejection>,
) -> Result<StatusCode, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let force = force_of(query)?;
    let thin_targets = api
        .program(move |c| {
            let v = if force {
                // Refused before any host is detached for nothing.
                let snapshots = c.snapshot_records(&uuid)?;
                if !snapshots.is_empty() {
                    return Err(StateError::Conflict {
                        kind: "volume_has_snapshots",
                        message: format!(
                            "volume {uuid} has {} snapshots: delete them first",
                            snapshots.len()
                        ),
                    }
                    .into());
                }
                delete_volume_forced(c, &uuid)?
            } else {
                c.delete_volume(&uuid)?
            };
            let targets = c.targets()?.into_iter();
            let targets = targets.map(|t| (t.target.id.clone(), t.target)).collect();
            Ok(match v.provisioning_on(&targets) {
                Provisioning::Thin => v.extents.into_iter().map(|e| e.target).collect(),
                Provisioning::Thick => BTreeSet::new(),
            })
        })
        .await?;
    tracing::info!(volume = %uuid, force, "volume deleted");
    // Its trees are released now rather than at the next round of
    // reconciliation; their place is free once they are.
    for t in thin_targets {
        program::spawn_reconcile(api.cluster.clone(), t);
    }
    Ok(StatusCode::NO_CONTENT)
}

/// Deletes a volume whoever uses it: marks it deleting (attaches are
/// refused from then on, so none can outrun the delete), unexports it
/// from every host the targets serve it to (which also detaches the
/// owner), detaches every host, then deletes it with the mark. A host
/// that a concurrent detach removed first is not an error, so the answer
/// is never "not found" for a volume that exists. A failure takes the
/// mark back.
fn delete_volume_forced(c: &Cluster, uuid: &Uuid) -> Result<crate::model::Volume, ProgramError> {
    let gone = |r: Result<(), ProgramError>| match r {
        Err(ProgramError::State(StateError::NotAttached { .. })) => Ok(()),
        other => other,
    };
    c.mark_deleting(uuid)?;
    let detached = (|| {
        if let Some((served, _)) = c.served(uuid)? {
            for h in &served.hosts {
                gone(crate::failover::unexport(c, uuid, h).map(drop))?;
            }
        }
        for a in c.volume_attachments(uuid)? {
            gone(program::detach(c, uuid, &a.host_nqn, true))?;
        }
        Ok(c.delete_volume(uuid)?)
    })();
    if detached.is_err() {
        if let Err(e) = c.unmark_deleting(uuid) {
            tracing::warn!(volume = %uuid, "a failed forced delete could not take its mark back: {e}");
        }
    }
    detached
}

/// An operator marks a copy stale (after `nvpool volume verify` found it
/// differing, say): hosts stop reading it at once and the heal loop copies
/// it whole from an in-sync copy. Refused for the last copy in sync of its
/// row; a copy already stale is left as it is.
#[utoipa::path(post, path = "/v1/volumes/{uuid}/extents/{index}/resync", tag = "volumes", params(("uuid" = String, Path, description = "the volume UUID"), ("index" = u32, Path, description = "the copy: an index into the volume's extents")), responses((status = 202, description = "stale; it will be copied whole", body = VolumeOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "no such volume", body = ErrorBody), (status = 409, description = "the last copy in sync of its row", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn post_resync(
    State(api): State<Api>,
    Segments((uuid, index)): Segments<(String, String)>,
) -> Result<(StatusCode, Json<VolumeOut>), ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let index: u32 = index
        .parse()
        .map_err(|_| ApiError::invalid(format!("extent {index:?} is not an index")))?;
    let out = api
        .run(move |c| {
            c.mark_stale(&uuid, index)?;
            one_with_attachments(c, volume_view_out(c.volume(&uuid)?, c.now()))
        })
        .await?;
    tracing::warn!(volume = %uuid, extent = index, "copy marked stale by an operator");
    Ok((StatusCode::ACCEPTED, Json(out)))
}

/// Copies of a volume, running first, then past ones newest first.
#[utoipa::path(get, path = "/v1/volumes/{uuid}/history", tag = "volumes", params(("uuid" = String, Path, description = "the volume UUID")), responses((status = 200, description = "running and past copies", body = Vec<CopyHistoryOut>), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not found", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn get_history(
    State(api): State<Api>,
    Segments(uuid): Segments<String>,
) -> Result<Json<Vec<CopyHistoryOut>>, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let out = api
        .run(move |c| {
            c.volume(&uuid)?;
            let cs = c.copy_state(&uuid)?;
            let mut out: Vec<CopyHistoryOut> = cs
                .jobs
                .iter()
                .map(|j| CopyHistoryOut {
                    id: j.id,
                    extent: j.extent,
                    source: j.source,
                    kind: j.kind.as_str().to_owned(),
                    to: j.dest.as_ref().map(|d| d.device_ref().to_string()),
                    result: "running".into(),
                    bytes_total: j.bytes_total,
                    bytes_copied: j.bytes_copied,
                    started_ms: j.started_ms,
                    copy_started_ms: (j.copy_started_ms > 0).then_some(j.copy_started_ms),
                    finished_ms: None,
                    error: None,
                })
                .collect();
            out.extend(cs.history.iter().rev().map(|r| CopyHistoryOut {
                id: r.id,
                extent: r.extent,
                source: r.source,
                kind: r.kind.as_str().to_owned(),
                to: r.to.clone(),
                result: if r.error.is_some() { "failed" } else { "done" }.into(),
                bytes_total: r.bytes_total,
                bytes_copied: r.bytes_copied,
                started_ms: r.started_ms,
                copy_started_ms: (r.copy_started_ms > 0).then_some(r.copy_started_ms),
                finished_ms: Some(r.finished_ms),
                error: r.error.clone(),
            }));
            Ok(out)
        })
        .await?;
    Ok(Json(out))
}
