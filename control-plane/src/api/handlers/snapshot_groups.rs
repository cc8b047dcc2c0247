//! Group snapshots: several volumes at one cut (design/thin-snapshots.md
//! T5).

use crate::api::errors::ApiError;
use crate::api::extract::JsonBody;
use crate::api::handlers::snapshots::snapshot_out;
use crate::api::Api;
use crate::rest::{ErrorBody, SnapshotGroupBody, SnapshotOut};
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;

/// Takes one snapshot named `name` of every listed thin volume, all at one
/// cut: the engines writing any of them are held at a barrier (no new
/// write admitted, at most 5 s) until every one has moved to its volume's
/// next epoch, so a write to one volume issued after a write to another
/// completed is in the group only if that one is. The same name and
/// volumes again answer the existing snapshots (200). Any failure gives
/// every snapshot of the group up.
#[utoipa::path(post, path = "/v1/snapshot-groups", tag = "snapshots", request_body = SnapshotGroupBody, responses((status = 201, description = "taken and sealed, one per volume in the body's order", body = Vec<SnapshotOut>), (status = 200, description = "this group exists", body = Vec<SnapshotOut>), (status = 400, description = "invalid input (the name, no volume, a volume twice)", body = ErrorBody), (status = 404, description = "no such volume", body = ErrorBody), (status = 409, description = "a volume has a snapshot of that name outside this group (snapshot_exists), copies of a volume are under way (copy_in_progress), a copy of one missed writes (volume_degraded), or a limit was reached", body = ErrorBody), (status = 422, description = "a volume is thick (thick_volume), or a device has no room for another tree (no_space)", body = ErrorBody), (status = 503, description = "given up (snapshot_failed: a target refused or was unreachable, or engines did not reach the barrier in time), or the store is busy; retry", body = ErrorBody)))]
pub(in crate::api) async fn post_snapshot_group(
    State(api): State<Api>,
    JsonBody(body): JsonBody<SnapshotGroupBody>,
) -> Result<(StatusCode, Json<Vec<SnapshotOut>>), ApiError> {
    let (records, created) = api
        .program(move |c| crate::snapshot_groups::take_group(c, &body.name, &body.volumes))
        .await?;
    let code = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((code, Json(records.into_iter().map(snapshot_out).collect())))
}
