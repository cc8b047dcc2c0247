//! The control plane's REST API: JSON over HTTP under `/v1`, built on
//! [`Cluster`]. Handlers are thin: decode and validate the request, run the
//! cluster operation on the blocking pool (every store call may fsync),
//! and shape the answer.
//!
//! | method and path | does |
//! |---|---|
//! | `GET /healthz` | liveness |
//! | `GET /metrics` | Prometheus text: volumes, capacity, target health |
//! | `GET /v1/openapi.json` | this API as OpenAPI 3 (also `docs/openapi.json`) |
//! | `POST /v1/targets` | a target registers (or re-registers) itself |
//! | `PUT /v1/targets/{id}/heartbeat` | a target is alive (body: its grain pools' usage) |
//! | `GET /v1/events` | this control plane's events (pools crossing 80 %, 90 % of real capacity) |
//! | `GET /v1/targets`, `GET /v1/targets/{id}` | health and capacity |
//! | `PUT /v1/pools/{name}` | create a pool (idempotent; body: devices) |
//! | `GET /v1/pools`, `GET /v1/pools/{name}` | pools and their capacity |
//! | `DELETE /v1/pools/{name}` | delete an unused pool |
//! | `PUT /v1/volumes/{uuid}` | idempotent create: 201, or 200 when the same spec exists |
//! | `GET /v1/volumes`, `GET /v1/volumes/{uuid}` | volumes with status and extents |
//! | `POST /v1/volumes/{uuid}/resize` | grow (body: size_bytes) |
//! | `DELETE /v1/volumes/{uuid}` | delete |
//! | `GET /v1/volumes/{uuid}/history` | copies of the volume: running and past |
//! | `POST /v1/volumes/{uuid}/extents/{index}/resync` | mark a copy stale: it is copied whole |
//! | `PUT/GET/DELETE /v1/volumes/{uuid}/attachments/{host}` | attach (plan), read (`?after_revision=N` long-polls), detach |
//! | `PUT …/attachments/{host}/session`, `…/missed`, `…/sync/{job}`, `…/epoch` | a host's serving process: started, stopping (its missed-regions record), mirroring a copy, tagging writes with a new epoch |
//! | `POST/GET /v1/volumes/{uuid}/snapshots`, `GET/DELETE …/snapshots/{name}` | snapshots of thin volumes (a clone: `PUT /v1/volumes/{uuid}` with a source) |
//! | `POST /v1/volumes/{uuid}/snapshots/{name}/rollback` | a detached volume takes its snapshot's contents back |
//! | `POST /v1/snapshot-groups` | snapshots of several volumes at one cut |
//! | `PUT/DELETE /v1/volumes/{uuid}/exports/{host}`, `GET /v1/volumes/{uuid}/exports` | serve the volume to a stock host through targets (ANA paths) |
//! | `POST /v1/targets/{id}/lease` | an owner of served volumes renews its lease |
//!
//! Every error is `{"kind", "message", "details"}` with a 4xx status for
//! anything the request got wrong (see [`ApiError::from_state`], the one
//! place where cluster errors become HTTP statuses), 503 when the store is
//! busy or unavailable, and 500 only for a corrupt store or a bug. Sizes
//! are bytes (u64) everywhere.
//!
//! Every call but `/healthz` and `/v1/openapi.json` needs `Authorization:
//! Bearer TOKEN`, whose role (admin, reader, target or host) the
//! [`crate::auth`] table checks before the handler runs; the document's
//! security requirements are written from the same table. A daemon
//! without tokens (loopback only) allows every call.
//!
//! ```text
//!   mod ── router: routes, JSON 404/405, Api (the cluster on the blocking pool)
//!    ├── guard ── bearer token and role of every call (a route layer)
//!    ├── extract ── path segments, JSON bodies, query options → ApiError
//!    ├── handlers/{targets,pools,volumes,snapshots,rollback,snapshot_groups,attachments,exports,hosts,rebalance}
//!    │     └── bodies ── response bodies from the cluster's records
//!    ├── errors ── ApiError: cluster and target errors → status, kind
//!    ├── metrics ── GET /metrics, GET /v1/events
//!    ├── openapi ── the document, from the handlers and the auth table
//!    └── server ── ApiServer: the API on a thread of its own
//! ```

mod bodies;
mod errors;
mod extract;
mod guard;
mod handlers;
mod metrics;
mod openapi;
mod server;

pub use crate::auth::AuthConfig;
pub use bodies::{ForceQuery, WatchQuery};
pub use errors::ApiError;
pub use openapi::openapi_json;
pub use server::ApiServer;

use crate::program::ProgramError;
use crate::state::{Cluster, StateError};
use axum::http::StatusCode;
use axum::routing::{get, post, put};
use axum::Router;
use guard::authorize;
use handlers::attachments::{
    delete_attachment, get_attachment, list_attachments, put_attachment, put_epoch,
    put_failed_extents, put_missed, put_session, put_sync,
};
use handlers::exports::{delete_export, get_exports, put_export};
use handlers::hosts::{delete_host_keys, get_host_keys, put_host_keys};
use handlers::pools::{delete_pool, get_pool, list_pools, put_pool};
use handlers::rebalance::{get_rebalance, post_rebalance};
use handlers::rollback::post_rollback;
use handlers::snapshot_groups::post_snapshot_group;
use handlers::snapshots::{delete_snapshot, get_snapshot, list_snapshots, post_snapshot};
use handlers::targets::{
    delete_target, get_target, heartbeat, list_targets, post_lease, put_target_state,
    reconcile_target, register_target,
};
use handlers::volumes::{
    delete_volume, get_history, get_volume, list_volumes, post_resync, put_volume, resize_volume,
};
use handlers::{healthz, openapi};
use std::sync::Arc;

#[derive(Debug, Clone)]
struct Api {
    cluster: Arc<Cluster>,
    auth: AuthConfig,
}

/// The API's routes over `cluster`.
pub fn router(cluster: Arc<Cluster>, auth: AuthConfig) -> Router {
    let api = Api { cluster, auth };
    Router::new()
        .route("/healthz", get(healthz))
        .route("/v1/openapi.json", get(openapi))
        .route("/metrics", get(metrics::metrics))
        .route("/v1/events", get(metrics::events))
        .route("/v1/targets", post(register_target).get(list_targets))
        .route("/v1/targets/{id}", get(get_target).delete(delete_target))
        .route("/v1/targets/{id}/state", put(put_target_state))
        .route("/v1/rebalance", post(post_rebalance).get(get_rebalance))
        .route("/v1/targets/{id}/heartbeat", put(heartbeat))
        .route("/v1/targets/{id}/lease", post(post_lease))
        .route("/v1/volumes/{uuid}/exports", get(get_exports))
        .route(
            "/v1/volumes/{uuid}/exports/{host_nqn}",
            put(put_export).delete(delete_export),
        )
        .route("/v1/pools", get(list_pools))
        .route(
            "/v1/pools/{name}",
            put(put_pool).get(get_pool).delete(delete_pool),
        )
        .route("/v1/volumes", get(list_volumes))
        .route(
            "/v1/volumes/{uuid}",
            put(put_volume).get(get_volume).delete(delete_volume),
        )
        .route("/v1/volumes/{uuid}/resize", post(resize_volume))
        .route("/v1/volumes/{uuid}/attachments", get(list_attachments))
        .route(
            "/v1/volumes/{uuid}/attachments/{host_nqn}",
            put(put_attachment)
                .get(get_attachment)
                .delete(delete_attachment),
        )
        .route(
            "/v1/volumes/{uuid}/attachments/{host_nqn}/failed-extents",
            put(put_failed_extents),
        )
        .route(
            "/v1/volumes/{uuid}/attachments/{host_nqn}/session",
            put(put_session),
        )
        .route(
            "/v1/volumes/{uuid}/attachments/{host_nqn}/missed",
            put(put_missed),
        )
        .route(
            "/v1/volumes/{uuid}/attachments/{host_nqn}/sync/{job}",
            put(put_sync),
        )
        .route(
            "/v1/volumes/{uuid}/attachments/{host_nqn}/epoch",
            put(put_epoch),
        )
        .route(
            "/v1/volumes/{uuid}/snapshots",
            post(post_snapshot).get(list_snapshots),
        )
        .route(
            "/v1/volumes/{uuid}/snapshots/{name}",
            get(get_snapshot).delete(delete_snapshot),
        )
        .route(
            "/v1/volumes/{uuid}/snapshots/{name}/rollback",
            post(post_rollback),
        )
        .route("/v1/snapshot-groups", post(post_snapshot_group))
        .route("/v1/volumes/{uuid}/history", get(get_history))
        .route(
            "/v1/volumes/{uuid}/extents/{index}/resync",
            post(post_resync),
        )
        .route("/v1/targets/{id}/reconcile", post(reconcile_target))
        .route(
            "/v1/hosts/{host_nqn}/dhchap",
            put(put_host_keys)
                .get(get_host_keys)
                .delete(delete_host_keys),
        )
        // Before the route layer, which would make each route's fallback
        // its own: a method the path does not take is a JSON 405 (with
        // axum's Allow header) once the token was checked.
        .method_not_allowed_fallback(method_not_allowed)
        .route_layer(axum::middleware::from_fn_with_state(api.clone(), authorize))
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
        })
        .with_state(api)
}

/// The answer to a method a route does not take.
async fn method_not_allowed(method: axum::http::Method) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("this path does not take {method}"),
    )
}

impl Api {
    /// Runs an operation that programs targets on the blocking pool.
    async fn program<T: Send + 'static>(
        &self,
        op: impl FnOnce(&Cluster) -> Result<T, ProgramError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let cluster = self.cluster.clone();
        match tokio::task::spawn_blocking(move || op(&cluster)).await {
            Ok(r) => r.map_err(ApiError::from_program),
            Err(e) => {
                tracing::error!(error = %e, "target operation panicked");
                Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "the operation failed unexpectedly",
                ))
            }
        }
    }

    /// Runs a cluster operation on the blocking pool.
    async fn run<T: Send + 'static>(
        &self,
        op: impl FnOnce(&Cluster) -> Result<T, StateError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let cluster = self.cluster.clone();
        match tokio::task::spawn_blocking(move || op(&cluster)).await {
            Ok(r) => r.map_err(ApiError::from_state),
            Err(e) => {
                tracing::error!(error = %e, "cluster operation panicked");
                Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "the operation failed unexpectedly",
                ))
            }
        }
    }
}
