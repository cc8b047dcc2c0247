//! The handlers, one module per resource; liveness and the document here.

pub(super) mod attachments;
pub(super) mod exports;
pub(super) mod hosts;
pub(super) mod pools;
pub(super) mod rebalance;
pub(super) mod rollback;
pub(super) mod snapshot_groups;
pub(super) mod snapshots;
pub(super) mod targets;
pub(super) mod volumes;

use crate::api::openapi::openapi_json;
use crate::api::Api;
use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

/// Liveness, and whether this control plane is the leader (the one doing
/// reconciliation, resyncs, moves, failovers and owner leases; every
/// control plane serves the whole API).
#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, description = "the daemon serves requests: `{\"status\": \"ok\", \"leader\": true}`")))]
pub(in crate::api) async fn healthz(State(api): State<Api>) -> Json<Value> {
    Json(json!({"status": "ok", "leader": api.cluster.is_leader()}))
}

#[utoipa::path(get, path = "/v1/openapi.json", tag = "operations", responses((status = 200, description = "this document", body = Object)))]
pub(in crate::api) async fn openapi() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        openapi_json(),
    )
        .into_response()
}
