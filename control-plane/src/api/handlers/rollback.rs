//! Rolling a volume back to one of its snapshots (design/thin-snapshots.md
//! T6).

use crate::api::bodies::{one_with_attachments, volume_view_out};
use crate::api::errors::ApiError;
use crate::api::extract::{parse_uuid, Segments};
use crate::api::Api;
use crate::rest::{ErrorBody, VolumeOut};
use axum::extract::State;
use axum::Json;

/// Rolls a detached thin volume back to a ready snapshot: every extent
/// copy's live tree takes the contents of the snapshot's tree on the same
/// device, sharing every grain with it (whatever the size, one admin call
/// per target). The snapshot stays; so do the others, older and newer. The
/// same call again leaves the volume as it is. Until the rollback is over
/// the volume cannot be attached (409 `rollback_in_progress`); a target
/// that refused or could not be reached leaves it so, since its copies
/// may differ, until the rollback is repeated and succeeds.
#[utoipa::path(post, path = "/v1/volumes/{uuid}/snapshots/{name}/rollback", tag = "snapshots", params(("uuid" = String, Path, description = "the volume UUID"), ("name" = String, Path, description = "the snapshot's name")), responses((status = 200, description = "rolled back", body = VolumeOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "no such volume or snapshot", body = ErrorBody), (status = 409, description = "the volume is attached or served (volume_attached), a snapshot of it is being created (snapshot_creating), another rollback is under way (rollback_in_progress), copies are under way (copy_in_progress), or the volume was resized or its copies moved since the snapshot (layout_changed)", body = ErrorBody), (status = 422, description = "a target refused (target_refused); the volume stays unattachable until a repeat succeeds", body = ErrorBody), (status = 503, description = "a target was unreachable (the volume stays unattachable until a repeat succeeds), or the store is busy; retry", body = ErrorBody)))]
pub(in crate::api) async fn post_rollback(
    State(api): State<Api>,
    Segments((uuid, name)): Segments<(String, String)>,
) -> Result<Json<VolumeOut>, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let out = api
        .program(move |c| {
            crate::rollback::rollback(c, &uuid, &name)?;
            Ok(one_with_attachments(
                c,
                volume_view_out(c.volume(&uuid)?, c.now()),
            )?)
        })
        .await?;
    Ok(Json(out))
}
