//! Snapshots of thin volumes (design/thin-snapshots.md T5): take, list,
//! read, delete. Clones are made by `PUT /v1/volumes/{uuid}` with a source.

use crate::api::errors::ApiError;
use crate::api::extract::{parse_uuid, JsonBody, Segments};
use crate::api::Api;
use crate::rest::{ErrorBody, SnapshotBody, SnapshotOut};
use crate::snapshots::{self, SnapshotRecord};
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;

pub(in crate::api) fn snapshot_out(r: SnapshotRecord) -> SnapshotOut {
    SnapshotOut {
        volume: r.volume,
        name: r.name,
        epoch: r.epoch,
        state: r.state,
        created_ms: r.created_ms,
        size_bytes: r.size_bytes,
        group: r.group,
    }
}

/// Takes a crash-consistent snapshot of a thin volume: every extent
/// copy's target creates a tree sharing everything with the live one,
/// the volume's write epoch rises, and once every engine writing the
/// volume confirmed it (at most 30 s) the trees are sealed. The same
/// name again answers the existing snapshot (200). Any failure gives the
/// snapshot up: its trees are freed and no record stays.
#[utoipa::path(post, path = "/v1/volumes/{uuid}/snapshots", tag = "snapshots", params(("uuid" = String, Path, description = "the volume UUID")), request_body = SnapshotBody, responses((status = 201, description = "taken and sealed", body = SnapshotOut), (status = 200, description = "a snapshot of that name exists", body = SnapshotOut), (status = 400, description = "invalid input (the name)", body = ErrorBody), (status = 404, description = "no such volume", body = ErrorBody), (status = 409, description = "copies of the volume are under way (copy_in_progress), a copy missed writes and is not back in sync (volume_degraded), or a limit was reached", body = ErrorBody), (status = 422, description = "the volume is thick (thick_volume), or a device has no room for another tree (no_space)", body = ErrorBody), (status = 503, description = "given up (snapshot_failed: a target refused or was unreachable, or engines did not confirm the new write epoch in time), or the store is busy; retry", body = ErrorBody)))]
pub(in crate::api) async fn post_snapshot(
    State(api): State<Api>,
    Segments(uuid): Segments<String>,
    JsonBody(body): JsonBody<SnapshotBody>,
) -> Result<(StatusCode, Json<SnapshotOut>), ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let (r, created) = api
        .program(move |c| snapshots::take_snapshot(c, &uuid, &body.name))
        .await?;
    let code = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((code, Json(snapshot_out(r))))
}

#[utoipa::path(get, path = "/v1/volumes/{uuid}/snapshots", tag = "snapshots", params(("uuid" = String, Path, description = "the volume UUID")), responses((status = 200, description = "the volume's snapshots, by name", body = Vec<SnapshotOut>), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "no such volume", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn list_snapshots(
    State(api): State<Api>,
    Segments(uuid): Segments<String>,
) -> Result<Json<Vec<SnapshotOut>>, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let out = api.run(move |c| c.snapshot_records(&uuid)).await?;
    Ok(Json(out.into_iter().map(snapshot_out).collect()))
}

#[utoipa::path(get, path = "/v1/volumes/{uuid}/snapshots/{name}", tag = "snapshots", params(("uuid" = String, Path, description = "the volume UUID"), ("name" = String, Path, description = "the snapshot's name")), responses((status = 200, description = "the snapshot", body = SnapshotOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "no such volume or snapshot", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn get_snapshot(
    State(api): State<Api>,
    Segments((uuid, name)): Segments<(String, String)>,
) -> Result<Json<SnapshotOut>, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let r = api.run(move |c| c.snapshot_record(&uuid, &name)).await?;
    Ok(Json(snapshot_out(r)))
}

/// Deletes a snapshot: its trees are freed and their targets asked to
/// release them (their place is taken until they have). Clones made from
/// it keep their own references on the targets.
#[utoipa::path(delete, path = "/v1/volumes/{uuid}/snapshots/{name}", tag = "snapshots", params(("uuid" = String, Path, description = "the volume UUID"), ("name" = String, Path, description = "the snapshot's name")), responses((status = 204, description = "deleted"), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "no such volume or snapshot", body = ErrorBody), (status = 409, description = "the snapshot is being created (snapshot_creating)", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn delete_snapshot(
    State(api): State<Api>,
    Segments((uuid, name)): Segments<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    api.program(move |c| {
        c.snapshot_record(&uuid, &name)?;
        snapshots::delete_snapshot(c, &uuid, &name)
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}
