//! Volumes served to stock hosts through targets (ANA paths).

use crate::api::errors::ApiError;
use crate::api::extract::{parse_host, parse_uuid, OptionalJsonBody, Segments};
use crate::api::Api;
use crate::rest::{ErrorBody, ExportBody};
use crate::state::StateError;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;

/// Serves the volume to a stock host: the host's NQN joins the access
/// list of the volume's subsystem, which a few targets present as ANA
/// paths (one optimized, the owner running the volume engine; the others
/// inaccessible until a failover). Connect with `nvme connect` to every
/// path. Idempotent: again, 200 with the same view.
#[utoipa::path(put, path = "/v1/volumes/{uuid}/exports/{host_nqn}", tag = "exports", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), request_body(content = ExportBody, description = "optional: without a body (and then without a content type), the defaults"), responses((status = 201, description = "exported", body = crate::failover::ServedView), (status = 200, description = "was exported to that host already", body = crate::failover::ServedView), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "no such volume", body = ErrorBody), (status = 409, description = "the cluster requires DH-HMAC-CHAP keys the host does not have (host_keys_required), or the volume is read-only (volume_read_only: attach it instead)", body = ErrorBody), (status = 422, description = "a target refused", body = ErrorBody), (status = 503, description = "a target is unreachable, or the store is busy; retry", body = ErrorBody)))]
pub(in crate::api) async fn put_export(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
    OptionalJsonBody(body): OptionalJsonBody<ExportBody>,
) -> Result<(StatusCode, Json<crate::failover::ServedView>), ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    let body = body.unwrap_or_default();
    let paths = body.paths.unwrap_or(crate::paths::PATHS_DEFAULT);
    let (view, created) = api
        .program(move |c| {
            // Its paths would present a writable namespace: a read-only
            // volume is attached, by any number of hosts.
            if c.is_read_only(&uuid)? {
                return Err(StateError::Conflict {
                    kind: "volume_read_only",
                    message: format!(
                        "volume {uuid} is read-only: attach it (any number of hosts may)"
                    ),
                }
                .into());
            }
            crate::failover::export(c, &uuid, &host, paths)
        })
        .await?;
    let code = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((code, Json(view)))
}

/// How the volume is served by targets: hosts, paths with their listener
/// addresses and ANA state, owner.
#[utoipa::path(get, path = "/v1/volumes/{uuid}/exports", tag = "exports", params(("uuid" = String, Path, description = "the volume UUID")), responses((status = 200, description = "the served volume", body = crate::failover::ServedView), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "the volume is not served", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn get_exports(
    State(api): State<Api>,
    Segments(uuid): Segments<String>,
) -> Result<Json<crate::failover::ServedView>, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let out = api
        .run(move |c| {
            let (s, _) = c
                .served(&uuid)?
                .ok_or_else(|| StateError::VolumeNotFound(format!("{uuid} (served)")))?;
            crate::failover::view(c, &s)
        })
        .await?;
    Ok(Json(out))
}

/// Stops serving the volume to the host (its NQN leaves the access list;
/// the host sees its paths go). The last host gone, the volume's
/// subsystem is removed from every target and the owner stops.
#[utoipa::path(delete, path = "/v1/volumes/{uuid}/exports/{host_nqn}", tag = "exports", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), responses((status = 204, description = "no longer exported to that host"), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not exported to that host", body = ErrorBody), (status = 503, description = "a target is unreachable, or the store is busy; retry", body = ErrorBody)))]
pub(in crate::api) async fn delete_export(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    api.program(move |c| crate::failover::unexport(c, &uuid, &host))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}
