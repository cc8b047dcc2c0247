//! Hosts' DH-HMAC-CHAP keys.

use crate::api::errors::ApiError;
use crate::api::extract::{parse_host, JsonBody, Segments};
use crate::api::Api;
use crate::rest::{ErrorBody, HostKeysBody, HostKeysOut, KeyRollout};
use crate::state::StateError;
use axum::extract::State;
use axum::Json;

/// Sets a host's DH-HMAC-CHAP keys (replacing any): every target that
/// exports to the host — its attached volumes and the volumes served to
/// it — then makes it authenticate on every queue, with these keys. The
/// change is made on those targets before the answer (`rollout`); a target
/// that could not be changed gets them on its next reconciliation. The
/// secrets are never shown again. A host's controllers keep running;
/// their next connection uses the new keys.
#[utoipa::path(put, path = "/v1/hosts/{host_nqn}/dhchap", tag = "hosts", params(("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), request_body = HostKeysBody, responses((status = 200, description = "set; `rollout` says which targets hold them", body = HostKeysOut), (status = 400, description = "invalid input (the message never quotes a secret)", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn put_host_keys(
    State(api): State<Api>,
    Segments(host): Segments<String>,
    JsonBody(body): JsonBody<HostKeysBody>,
) -> Result<Json<HostKeysOut>, ApiError> {
    let host = parse_host(&host)?;
    let keys =
        crate::hostkeys::check(&host, &body).map_err(|e| ApiError::invalid(e.to_string()))?;
    let out = api
        .run(move |c| {
            let k = c.set_host_keys(keys)?;
            let rollout = crate::hostkeys::roll_out(c, &k.host, Some(&k))?;
            Ok(crate::hostkeys::out(&k, Some(rollout)))
        })
        .await?;
    let pending = out.rollout.as_ref().map_or(0, |r| r.pending.len());
    tracing::info!(host = %out.host_nqn, key_id = %out.key_id, pending, "host DH-HMAC-CHAP keys set");
    Ok(Json(out))
}

/// A host's DH-HMAC-CHAP settings, without the secrets.
#[utoipa::path(get, path = "/v1/hosts/{host_nqn}/dhchap", tag = "hosts", params(("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), responses((status = 200, description = "the host's settings", body = HostKeysOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "the host has no keys", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn get_host_keys(
    State(api): State<Api>,
    Segments(host): Segments<String>,
) -> Result<Json<HostKeysOut>, ApiError> {
    let host = parse_host(&host)?;
    let out = api
        .run(move |c| {
            let k = c.host_keys(&host)?.ok_or(StateError::NoHostKeys(host))?;
            Ok(crate::hostkeys::out(&k, None))
        })
        .await?;
    Ok(Json(out))
}

/// Forgets a host's DH-HMAC-CHAP keys: the targets that export to it let
/// it in without authentication again (each drops the host and admits it
/// again, so its controllers reconnect). The answer lists targets that
/// could not be changed now; reconciliation changes them later.
#[utoipa::path(delete, path = "/v1/hosts/{host_nqn}/dhchap", tag = "hosts", params(("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), responses((status = 200, description = "forgotten; where", body = KeyRollout), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "the host has no keys", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn delete_host_keys(
    State(api): State<Api>,
    Segments(host): Segments<String>,
) -> Result<Json<KeyRollout>, ApiError> {
    let host = parse_host(&host)?;
    let h = host.clone();
    let rollout = api
        .run(move |c| {
            c.remove_host_keys(&h)?;
            crate::hostkeys::roll_out(c, &h, None)
        })
        .await?;
    tracing::info!(host = %host, pending = rollout.pending.len(), "host DH-HMAC-CHAP keys removed");
    Ok(Json(rollout))
}
