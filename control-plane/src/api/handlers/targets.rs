//! Targets: registration, heartbeats, leases, state, reconciliation.

use crate::api::bodies::{target_out, ForceQuery};
use crate::api::errors::ApiError;
use crate::api::extract::{JsonBody, OptionalJsonBody, Segments};
use crate::api::Api;
use crate::auth;
use crate::model::Device;
use crate::program;
use crate::rest::{
    ErrorBody, HeartbeatBody, ReconcileOut, RegisterTargetBody, TargetOut, TargetStateBody,
};
use crate::state::TargetRegistration;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::Json;

#[utoipa::path(post, path = "/v1/targets", tag = "targets", request_body = RegisterTargetBody, responses((status = 200, description = "registered (or re-registered)", body = TargetOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 409, description = "conflicts with the current state", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn register_target(
    State(api): State<Api>,
    who: Option<axum::Extension<auth::Principal>>,
    JsonBody(body): JsonBody<RegisterTargetBody>,
) -> Result<Json<TargetOut>, ApiError> {
    if !auth::permits_registration(who.as_ref().map(|w| &w.0), &body.id) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "this target token is bound to another target than {}",
                body.id
            ),
        ));
    }
    let reg = TargetRegistration {
        id: body.id,
        name: body.name,
        addr: body.addr,
        admin_addr: body.admin_addr,
        rdma_addr: body.rdma_addr,
        admin_tls: body.admin_tls,
        admin_token: body.admin_token,
        labels: body.labels,
        devices: body
            .devices
            .into_iter()
            .map(|d| Device {
                id: d.id,
                backend: d.backend,
                capacity_bytes: d.capacity_bytes,
                labels: d.labels,
            })
            .collect(),
    };
    let out = api
        .run(move |c| {
            let t = c.register_target(&reg)?;
            let view = c.target(&t.id)?;
            Ok(target_out(&view, &c.capacity()?.devices))
        })
        .await?;
    tracing::info!(target_id = %out.id, devices = out.devices.len(), "target registered");
    // A target that restarted or was unreachable may export less or more
    // than the records say: bring it in line.
    program::spawn_reconcile(api.cluster.clone(), out.id.clone());
    Ok(Json(out))
}

/// A target is alive, and reports its grain pools' usage (an empty body,
/// as older targets send, reports nothing). Devices it does not have, or
/// that are no grain pools, are ignored; one named twice is a 400. Then
/// the pools' real use is checked against 80 % and 90 % of their capacity
/// (a warning, an event and the metrics).
#[utoipa::path(put, path = "/v1/targets/{id}/heartbeat", tag = "targets", params(("id" = String, Path, description = "target id")), request_body(content = HeartbeatBody, description = "optional: without a body (and then without a content type), nothing is reported"), responses((status = 200, description = "alive", body = TargetOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not found", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn heartbeat(
    State(api): State<Api>,
    Segments(id): Segments<String>,
    OptionalJsonBody(body): OptionalJsonBody<HeartbeatBody>,
) -> Result<Json<TargetOut>, ApiError> {
    let report = body.unwrap_or_default();
    let out = api
        .run(move |c| {
            c.heartbeat_reporting(&id, &report)?;
            let view = c.target(&id)?;
            let capacity = c.capacity()?;
            c.check_usage(&capacity);
            Ok(target_out(&view, &capacity.devices))
        })
        .await?;
    Ok(Json(out))
}

#[utoipa::path(get, path = "/v1/targets", tag = "targets", responses((status = 200, description = "every target with health and capacity", body = Vec<TargetOut>), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn list_targets(
    State(api): State<Api>,
) -> Result<Json<Vec<TargetOut>>, ApiError> {
    let out = api
        .run(|c| {
            let usage = c.capacity()?.devices;
            Ok(c.targets()?.iter().map(|v| target_out(v, &usage)).collect())
        })
        .await?;
    Ok(Json(out))
}

#[utoipa::path(get, path = "/v1/targets/{id}", tag = "targets", params(("id" = String, Path, description = "target id")), responses((status = 200, description = "the target", body = TargetOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not found", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn get_target(
    State(api): State<Api>,
    Segments(id): Segments<String>,
) -> Result<Json<TargetOut>, ApiError> {
    let out = api
        .run(move |c| {
            let view = c.target(&id)?;
            Ok(target_out(&view, &c.capacity()?.devices))
        })
        .await?;
    Ok(Json(out))
}

/// An owner of served volumes renews its lease: the answer lists the
/// subsystems it may serve, for `valid_ms` counted from when it sent this
/// request (so its expiry is never later than the control plane's idea of
/// it). Another path is promoted only after the lease has run out.
#[utoipa::path(post, path = "/v1/targets/{id}/lease", tag = "targets", params(("id" = String, Path, description = "target id")), responses((status = 200, description = "granted", body = crate::paths::LeaseGrant), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not found", body = ErrorBody), (status = 503, description = "store busy or unavailable, or this control plane is not the leader (not_leader: only the leader grants owner leases); retry, or ask another endpoint", body = ErrorBody)))]
pub(in crate::api) async fn post_lease(
    State(api): State<Api>,
    Segments(id): Segments<String>,
) -> Result<Json<crate::paths::LeaseGrant>, ApiError> {
    let out = api.run(move |c| c.grant_lease(&id)).await?;
    Ok(Json(out))
}

/// Sets a target's state: `draining` moves every extent off it (online,
/// through copy jobs; it serves each until the move is done), `cordoned`
/// only stops new extents, `active` takes new extents again (and stops a
/// drain; moves under way finish).
#[utoipa::path(put, path = "/v1/targets/{id}/state", tag = "targets", params(("id" = String, Path, description = "target id")), request_body = TargetStateBody, responses((status = 200, description = "the target", body = TargetOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not found", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn put_target_state(
    State(api): State<Api>,
    Segments(id): Segments<String>,
    JsonBody(body): JsonBody<TargetStateBody>,
) -> Result<Json<TargetOut>, ApiError> {
    let out = api
        .run(move |c| {
            c.set_target_state(&id, body.state)?;
            let view = c.target(&id)?;
            Ok(target_out(&view, &c.capacity()?.devices))
        })
        .await?;
    tracing::info!(target = %out.id, state = ?out.state, "target state set");
    Ok(Json(out))
}

/// Forgets a target that holds no extents (drain it first). Old extents
/// it may still export keep it until it has been reconciled, unless
/// `force` (a target gone for good).
#[utoipa::path(delete, path = "/v1/targets/{id}", tag = "targets", params(("id" = String, Path, description = "target id"), ForceQuery), responses((status = 204, description = "removed"), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not found", body = ErrorBody), (status = 409, description = "the target holds extents", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn delete_target(
    State(api): State<Api>,
    Segments(id): Segments<String>,
    query: Result<Query<ForceQuery>, QueryRejection>,
) -> Result<StatusCode, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    let t = id.clone();
    api.run(move |c| c.remove_target(&t, q.force)).await?;
    tracing::info!(target = %id, "target removed");
    Ok(StatusCode::NO_CONTENT)
}

/// Makes the target's host subsystems match the attachment records now
/// (the control plane also does this when a target registers, and
/// periodically).
#[utoipa::path(post, path = "/v1/targets/{id}/reconcile", tag = "targets", params(("id" = String, Path, description = "target id")), responses((status = 200, description = "reconciled", body = ReconcileOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not found", body = ErrorBody), (status = 409, description = "the daemon at a target's admin address is another target (wrong_target): nothing was changed there", body = ErrorBody), (status = 422, description = "the target refused a change", body = ErrorBody), (status = 503, description = "the target is unreachable, or the store is busy", body = ErrorBody)))]
pub(in crate::api) async fn reconcile_target(
    State(api): State<Api>,
    Segments(id): Segments<String>,
) -> Result<Json<ReconcileOut>, ApiError> {
    let r = api.program(move |c| program::reconcile(c, &id)).await?;
    Ok(Json(ReconcileOut {
        subsystems_removed: r.subsystems_removed,
        namespaces_removed: r.namespaces_removed,
        namespaces_added: r.namespaces_added,
        copies_removed: r.copies_removed,
        stale_cleared: r.stale_cleared,
    }))
}
