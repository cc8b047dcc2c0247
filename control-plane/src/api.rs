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
//! | `PUT /v1/targets/{id}/heartbeat` | a target is alive |
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
//! | `PUT …/attachments/{host}/session`, `…/missed`, `…/sync/{job}` | a host's serving process: started, stopping (its missed-regions record), mirroring a copy |
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

use crate::attach::Attachment;
use crate::auth::{self, Access};
use crate::model::{Device, DeviceRef, Health, TargetState, Uuid, VolumeStatus};
use crate::placement::{DeviceUsage, PlacementError};
use crate::plan::ConnectionPlan;
use crate::program::{self, ProgramError};
use crate::rest::{
    AttachmentOut, CapacityOut, CopyHistoryOut, CopyJobOut, DeviceOut, DeviceRefBody, ExportBody,
    ExtentOut, FailedExtentsBody, HostKeysBody, HostKeysOut, KeyRollout, MissedBody, MoveOut,
    PoolBody, PoolOut, RebalanceBody, RebalanceOut, ReconcileOut, RegisterTargetBody, ResizeBody,
    SessionBody, SyncBody, TargetOut, TargetStateBody, VolumeOut, VolumeSpecBody,
};
use crate::state::{Cluster, StateError, TargetRegistration, TargetView, VolumeView};
use crate::store::StoreError;
use axum::extract::rejection::QueryRejection;
use axum::extract::{FromRequest, MatchedPath, Query, RawPathParams, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::RequestPartsExt as _;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use utoipa::{OpenApi, ToSchema};

pub use crate::auth::AuthConfig;

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
        .route("/metrics", get(metrics))
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

// ----- an embedded server -----

/// The API served on a thread of its own (a current-thread runtime), for
/// embedders and tests that want a control plane in process without
/// running one of their own: [`ApiServer::start`] binds and returns once
/// the port accepts connections; dropping the server (or
/// [`ApiServer::shutdown`]) stops it gracefully and waits for the thread,
/// so the port is free again afterwards. It serves the API only: no
/// reconcile loop, no signal handling (that is the daemon's job).
pub struct ApiServer {
    /// Where it listens: `listen` with the port the system chose for port 0.
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ApiServer {
    /// Serves [`router`]`(cluster, auth)` on `listen` (port 0 for any).
    /// Fails when the address cannot be bound or the thread not started.
    pub fn start(
        cluster: Arc<Cluster>,
        auth: AuthConfig,
        listen: SocketAddr,
    ) -> std::io::Result<ApiServer> {
        ApiServer::start_tls(cluster, auth, listen, None)
    }

    /// [`ApiServer::start`], serving https with `tls` when given.
    pub fn start_tls(
        cluster: Arc<Cluster>,
        auth: AuthConfig,
        listen: SocketAddr,
        tls: Option<crate::tls::ServerTls>,
    ) -> std::io::Result<ApiServer> {
        let listener = std::net::TcpListener::bind(listen)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (listener, tls) = {
            let _guard = rt.enter();
            let listener = tokio::net::TcpListener::from_std(listener)?;
            match tls {
                Some(t) => (None, Some(crate::tls::TlsListener::new(listener, &t)?)),
                None => (Some(listener), None),
            }
        };
        let app = router(cluster.clone(), auth);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("nvpool-api {addr}"))
            .spawn(move || {
                rt.block_on(async move {
                    let stopped = async move {
                        let _ = rx.await;
                        cluster.begin_shutdown();
                    };
                    let served = match (listener, tls) {
                        (_, Some(tls)) => {
                            axum::serve(tls, app).with_graceful_shutdown(stopped).await
                        }
                        (Some(plain), None) => {
                            axum::serve(plain, app)
                                .with_graceful_shutdown(stopped)
                                .await
                        }
                        (None, None) => unreachable!("one of the two listeners"),
                    };
                    if let Err(e) = served {
                        tracing::error!(%addr, "serving the API: {e}");
                    }
                });
            })?;
        Ok(ApiServer {
            addr,
            stop: Some(tx),
            thread: Some(thread),
        })
    }

    /// Stops serving and waits for the server's thread (what drop does).
    pub fn shutdown(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.halt();
    }
}

impl std::fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

// ----- errors -----

/// The body of every failed request.
#[derive(Debug, Serialize, ToSchema)]
pub struct ApiError {
    #[serde(skip)]
    #[schema(ignore)]
    status: StatusCode,
    /// Stable, machine-readable: `invalid`, `not_found`, `uuid_conflict`,
    /// `no_space`, `unauthorized`…
    #[schema(value_type = String)]
    kind: &'static str,
    /// For humans.
    message: String,
    /// Kind-specific fields (an object, maybe empty).
    #[schema(value_type = Object)]
    details: Value,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind,
            message: message.into(),
            details: json!({}),
        }
    }

    fn with(mut self, details: Value) -> ApiError {
        self.details = details;
        self
    }

    fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid", message)
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// The one mapping from cluster errors to HTTP: 400 for invalid input,
    /// 404 for unknown objects, 409 for conflicts with the current state,
    /// 422 for requests the cluster cannot satisfy (placement), 503 for a
    /// busy or failed store, 500 for corruption and bugs only.
    pub fn from_state(e: StateError) -> ApiError {
        use StatusCode as S;
        let message = e.to_string();
        let (status, kind, details) = match &e {
            StateError::Invalid(_) => (S::BAD_REQUEST, "invalid", json!({})),
            StateError::Placement(p) => match p {
                PlacementError::Invalid(_) => (S::BAD_REQUEST, "invalid", json!({})),
                PlacementError::NotEnoughTargets { need, have, pool } => (
                    S::UNPROCESSABLE_ENTITY,
                    "not_enough_targets",
                    json!({"need": need, "have": have, "pool": pool}),
                ),
                PlacementError::NoSpace {
                    need,
                    have,
                    extent_bytes,
                    pool,
                } => (
                    S::UNPROCESSABLE_ENTITY,
                    "no_space",
                    json!({"need": need, "have": have, "extent_bytes": extent_bytes, "pool": pool}),
                ),
                // The rest come from loading stored extents: a bug or a
                // corrupt store, never the request.
                _ => (S::INTERNAL_SERVER_ERROR, "inconsistent", json!({})),
            },
            StateError::Store(s) => match s {
                StoreError::Backend { .. } => (S::SERVICE_UNAVAILABLE, "unavailable", json!({})),
                StoreError::Unavailable { store, .. } => (
                    S::SERVICE_UNAVAILABLE,
                    "unavailable",
                    json!({"store": store}),
                ),
                _ => (S::INTERNAL_SERVER_ERROR, "store", json!({})),
            },
            StateError::TargetNotFound(id) => (S::NOT_FOUND, "not_found", json!({"target": id})),
            StateError::PoolNotFound(p) => (S::NOT_FOUND, "not_found", json!({"pool": p})),
            StateError::VolumeNotFound(v) => (S::NOT_FOUND, "not_found", json!({"volume": v})),
            StateError::UuidConflict { uuid, existing } => (
                S::CONFLICT,
                "uuid_conflict",
                json!({"uuid": uuid, "existing": spec_body(existing)}),
            ),
            StateError::NameTaken { name, uuid } => (
                S::CONFLICT,
                "name_taken",
                json!({"name": name, "uuid": uuid}),
            ),
            StateError::PoolConflict(p) => (S::CONFLICT, "pool_conflict", json!({"pool": p})),
            StateError::UnknownDevice(d) => (
                S::UNPROCESSABLE_ENTITY,
                "unknown_device",
                json!({"device": d}),
            ),
            StateError::DeviceInPool { device, pool } => (
                S::CONFLICT,
                "device_in_pool",
                json!({"device": device, "pool": pool}),
            ),
            StateError::DeviceInUse { device, .. } => {
                (S::CONFLICT, "device_in_use", json!({"device": device}))
            }
            StateError::PoolInUse { pool, volumes } => (
                S::CONFLICT,
                "pool_in_use",
                json!({"pool": pool, "volumes": volumes}),
            ),
            StateError::AddressTaken { kind, addr, target } => (
                S::CONFLICT,
                "address_taken",
                json!({"field": kind.field(), "addr": addr.to_string(), "target": target}),
            ),
            StateError::TargetInUse { target, extents } => (
                S::CONFLICT,
                "target_in_use",
                json!({"target": target, "extents": extents}),
            ),
            StateError::Shrink {
                size_bytes,
                requested,
                ..
            } => (
                S::CONFLICT,
                "shrink",
                json!({"size_bytes": size_bytes, "requested": requested}),
            ),
            StateError::TooMany { what, max } => {
                (S::CONFLICT, "limit", json!({"what": what, "max": max}))
            }
            StateError::LastInSyncCopy { volume, extent } => (
                S::CONFLICT,
                "last_in_sync_copy",
                json!({"volume": volume, "extent": extent}),
            ),
            StateError::Attached { volume, hosts } => (
                S::CONFLICT,
                "attached",
                json!({"volume": volume, "hosts": hosts}),
            ),
            StateError::Deleting(volume) => (S::CONFLICT, "deleting", json!({"volume": volume})),
            StateError::NoHostKeys(host) => (S::NOT_FOUND, "not_found", json!({"host_nqn": host})),
            StateError::HostKeysRequired(host) => {
                (S::CONFLICT, "host_keys_required", json!({"host_nqn": host}))
            }
            StateError::NotAttached { volume, host } => (
                S::NOT_FOUND,
                "not_found",
                json!({"volume": volume, "host_nqn": host}),
            ),
            StateError::Contention { attempts } => (
                S::SERVICE_UNAVAILABLE,
                "contention",
                json!({"attempts": attempts}),
            ),
            // Only the leader answers this call: ask another endpoint.
            StateError::NotLeader(_) => (S::SERVICE_UNAVAILABLE, "not_leader", json!({})),
            StateError::Corrupt { .. } | StateError::Inconsistent(_) => {
                (S::INTERNAL_SERVER_ERROR, "inconsistent", json!({}))
            }
        };
        if status.is_server_error() {
            tracing::warn!(error = %e, kind, "request failed");
        }
        ApiError::new(status, kind, message).with(details)
    }
}

impl ApiError {
    /// Target failures: 503 when a target cannot be reached (retry later),
    /// 422 when one refused (the request cannot be satisfied as things are).
    pub fn from_program(e: ProgramError) -> ApiError {
        let message = e.to_string();
        match e {
            ProgramError::State(s) => ApiError::from_state(s),
            ProgramError::Unreachable { target, addr, .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "target_unreachable",
                message,
            )
            .with(json!({"target": target, "admin_addr": addr.to_string()})),
            ProgramError::Refused { target, what, .. } => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "target_refused", message)
                    .with(json!({"target": target, "what": what}))
            }
            // The record and the daemon at its address disagree: nothing
            // was changed; an operator must fix the registration.
            ProgramError::WrongTarget {
                target,
                addr,
                found,
            } => ApiError::new(StatusCode::CONFLICT, "wrong_target", message)
                .with(json!({"target": target, "admin_addr": addr.to_string(), "found": found})),
        }
    }
}

impl From<StateError> for ApiError {
    fn from(e: StateError) -> ApiError {
        ApiError::from_state(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(&self)).into_response();
        match self.status {
            StatusCode::UNAUTHORIZED => {
                r.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            StatusCode::SERVICE_UNAVAILABLE => {
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            _ => {}
        }
        r
    }
}

/// Path parameters whose rejections (a segment that is not UTF-8 once
/// percent-decoded, say) are JSON errors like every other 400.
#[derive(Debug)]
struct Segments<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned + Send> axum::extract::FromRequestParts<S>
    for Segments<T>
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        Ok(Segments(crate::httpd::path(parts, state).await?))
    }
}

impl From<crate::httpd::Rejection> for ApiError {
    fn from(r: crate::httpd::Rejection) -> ApiError {
        ApiError::new(r.status, r.kind, r.message)
    }
}

/// A JSON request body as `T` ([`crate::httpd::json_body`]: 415 without
/// a JSON content type; 400 for anything that does not parse, names a key
/// twice, is an array where the schema has an object, or does not fit
/// the request type).
#[derive(Debug)]
struct JsonBody<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match crate::httpd::json_body(req, state, false).await? {
            Some(v) => Ok(JsonBody(v)),
            None => Err(ApiError::invalid("a JSON body is required")),
        }
    }
}

/// [`JsonBody`] for a body that may be left out: an empty body is
/// `None`; any other is held to the same rules.
#[derive(Debug)]
struct OptionalJsonBody<T>(Option<T>);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for OptionalJsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        Ok(OptionalJsonBody(
            crate::httpd::json_body(req, state, true).await?,
        ))
    }
}

// ----- auth -----

/// Checks the caller's bearer token against the route's entry in
/// [`auth::access`] before any handler runs (a `route_layer`, so it sees
/// the matched route template). 401: no known token; 403: a known token
/// whose role may not make this call.
async fn authorize(State(api): State<Api>, req: Request, next: Next) -> Response {
    let (mut parts, body) = req.into_parts();
    let Some(template) = parts
        .extensions
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_owned())
    else {
        return next.run(Request::from_parts(parts, body)).await;
    };
    let need = auth::access(parts.method.as_str(), &template);
    let tokens = api.auth.current();
    if need == Access::Public {
        return next.run(Request::from_parts(parts, body)).await;
    }
    if tokens.is_empty() {
        // No tokens (loopback only): every role, but still only the
        // owners the control plane issued.
        if let Err(refused) = check_own_initiators(&api, need, &template, &mut parts).await {
            return refused;
        }
        return next.run(Request::from_parts(parts, body)).await;
    }
    let presented = crate::httpd::bearer_of(&parts.headers)
        .ok()
        .flatten()
        .and_then(|t| std::str::from_utf8(t).ok());
    let Some(presented) = presented else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "this call needs an Authorization: Bearer token",
        )
        .into_response();
    };
    let Some(who) = tokens.identify(presented) else {
        note_refused_token(&parts.method, &template);
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "the bearer token is not known",
        )
        .into_response();
    };
    let (host, id) = if matches!(need, Access::Host | Access::Report | Access::Target) {
        match parts.extract::<RawPathParams>().await {
            Ok(params) => {
                let param = |name: &str| {
                    params
                        .iter()
                        .find(|(k, _)| *k == name)
                        .map(|(_, v)| v.to_owned())
                };
                (param("host_nqn"), param("id"))
            }
            Err(e) => return ApiError::invalid(e.body_text()).into_response(),
        }
    } else {
        (None, None)
    };
    if !auth::permits(who, need, host.as_deref(), id.as_deref()) {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "a {} token may not call {} {template}",
                who.role().name(),
                parts.method
            ),
        )
        .into_response();
    }
    if let Err(refused) = check_own_initiators(&api, need, &template, &mut parts).await {
        return refused;
    }
    // The registration checks a bound target token against the body's id.
    parts.extensions.insert(who.clone());
    next.run(Request::from_parts(parts, body)).await
}

/// What no token may do for nvpool's own initiators ([`auth::reserved`]),
/// and a report for an owner NQN the control plane did not issue
/// ([`auth::owner_issued`]): 403 before any handler runs, so nothing is
/// recorded.
async fn check_own_initiators(
    api: &Api,
    need: Access,
    template: &str,
    parts: &mut axum::http::request::Parts,
) -> Result<(), Response> {
    if !template.contains("{host_nqn}") || matches!(need, Access::Public | Access::Read) {
        return Ok(());
    }
    let params = parts
        .extract::<RawPathParams>()
        .await
        .map_err(|e| ApiError::invalid(e.body_text()).into_response())?;
    let param = |name: &str| {
        params
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_owned())
    };
    let Some(host) = param("host_nqn") else {
        return Ok(());
    };
    let forbidden =
        |why: String| ApiError::new(StatusCode::FORBIDDEN, "forbidden", why).into_response();
    if let Some(why) = auth::reserved(need, template, Some(&host)) {
        return Err(forbidden(why));
    }
    if need != Access::Report || !host.starts_with(crate::paths::OWNER_HOST_PREFIX) {
        return Ok(());
    }
    let volume = parse_uuid(&param("uuid").unwrap_or_default()).map_err(|e| e.into_response())?;
    match api
        .run(move |c| auth::owner_issued(c, &volume, &host))
        .await
    {
        Ok(Ok(())) => Ok(()),
        Ok(Err(why)) => Err(forbidden(why)),
        Err(e) => Err(e.into_response()),
    }
}

/// Logs an unknown token at most once per [`REFUSED_TOKEN_LOG_INTERVAL_MS`],
/// with the number of refusals since the last line: a client looping on a
/// wrong token cannot flood the log. The token is never logged.
fn note_refused_token(method: &axum::http::Method, template: &str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST_MS: AtomicU64 = AtomicU64::new(0);
    static REFUSED: AtomicU64 = AtomicU64::new(0);
    let refused = REFUSED.fetch_add(1, Ordering::Relaxed) + 1;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let last = LAST_MS.load(Ordering::Relaxed);
    if now.saturating_sub(last) >= REFUSED_TOKEN_LOG_INTERVAL_MS
        && LAST_MS
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        REFUSED.fetch_sub(refused, Ordering::Relaxed);
        tracing::warn!(%method, route = template, refused, "unknown bearer token refused");
    }
}

/// How often a refused token may be logged.
const REFUSED_TOKEN_LOG_INTERVAL_MS: u64 = 10_000;

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

fn parse_uuid(s: &str) -> Result<Uuid, ApiError> {
    s.parse::<Uuid>()
        .map_err(|e| ApiError::invalid(e.to_string()))
}

// ----- request and response bodies -----

fn target_out(v: &TargetView, usage: &[DeviceUsage]) -> TargetOut {
    let t = &v.target;
    let mut capacity = CapacityOut::default();
    let devices = t
        .devices
        .iter()
        .map(|d| {
            let u = usage.iter().find(|u| u.target == t.id && u.device == d.id);
            let (used, free, free_extents, pool) = u.map_or((0, d.capacity_bytes, 0, None), |u| {
                (u.used_bytes, u.free_bytes, u.free_extents, u.pool.clone())
            });
            capacity.total_bytes = capacity.total_bytes.saturating_add(d.capacity_bytes);
            capacity.used_bytes = capacity.used_bytes.saturating_add(used);
            capacity.free_bytes = capacity.free_bytes.saturating_add(free);
            capacity.free_extents += free_extents;
            DeviceOut {
                id: d.id.clone(),
                backend: d.backend.clone(),
                labels: d.labels.clone(),
                pool,
                capacity_bytes: d.capacity_bytes,
                used_bytes: used,
                free_bytes: free,
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
        drained: t.state == TargetState::Draining && capacity.used_bytes == 0,
        registered_ms: t.registered_ms,
        last_heartbeat_ms: t.last_heartbeat_ms,
        capacity,
        devices,
    }
}

fn spec_body(s: &crate::model::VolumeSpec) -> VolumeSpecBody {
    VolumeSpecBody {
        name: s.name.clone(),
        size_bytes: s.size_bytes,
        layout: s.layout.into(),
        pool: s.pool.clone(),
    }
}

fn job_out(j: &crate::resync::CopyJob, now_ms: u64) -> CopyJobOut {
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
fn with_attachments(c: &Cluster, mut out: Vec<VolumeOut>) -> Result<Vec<VolumeOut>, StateError> {
    let mut by: BTreeMap<Uuid, Vec<String>> = BTreeMap::new();
    for a in c.attachments()? {
        by.entry(a.volume).or_default().push(a.host_nqn);
    }
    for v in &mut out {
        v.attachments = by.remove(&v.uuid).unwrap_or_default();
    }
    Ok(out)
}

fn one_with_attachments(c: &Cluster, out: VolumeOut) -> Result<VolumeOut, StateError> {
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

fn attachment_out(a: Attachment, plan: ConnectionPlan) -> AttachmentOut {
    AttachmentOut {
        volume: a.volume,
        host_nqn: a.host_nqn,
        state: a.state,
        created_ms: a.created_ms,
        failed_extents: a.failed_extents,
        syncing: Vec::new(),
        moving: Vec::new(),
        revision: 0,
        plan,
    }
}

fn attachment_with_plan(c: &Cluster, a: Attachment) -> Result<AttachmentOut, StateError> {
    let v = c.volume(&a.volume)?.volume;
    let plan = c.plan(&v, &a)?;
    let copies = c.host_copies(&a.volume, &a.host_nqn)?;
    let mut out = attachment_out(a, plan);
    out.failed_extents = copies.failed_extents;
    out.syncing = copies.syncing;
    out.moving = copies.moving;
    out.revision = copies.revision;
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

fn volume_out(
    v: crate::model::Volume,
    status: VolumeStatus,
    failed_extents: Vec<u32>,
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
    }
}

fn volume_view_out(v: VolumeView, now: u64) -> VolumeOut {
    let jobs = v.jobs.iter().map(|j| job_out(j, now)).collect();
    let mut out = volume_out(v.volume, v.status, v.failed_extents);
    out.copy_jobs = jobs;
    out
}

// ----- handlers -----

/// Liveness, and whether this control plane is the leader (the one doing
/// reconciliation, resyncs, moves, failovers and owner leases; every
/// control plane serves the whole API).
#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, description = "the daemon serves requests: `{\"status\": \"ok\", \"leader\": true}`")))]
async fn healthz(State(api): State<Api>) -> Json<Value> {
    Json(json!({"status": "ok", "leader": api.cluster.is_leader()}))
}

#[utoipa::path(get, path = "/v1/openapi.json", tag = "operations", responses((status = 200, description = "this document", body = Object)))]
async fn openapi() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        openapi_json(),
    )
        .into_response()
}

#[utoipa::path(post, path = "/v1/targets", tag = "targets", request_body = RegisterTargetBody, responses((status = 200, description = "registered (or re-registered)", body = TargetOut), (status = 400, description = "invalid input", body = ApiError), (status = 409, description = "conflicts with the current state", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn register_target(
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

#[utoipa::path(put, path = "/v1/targets/{id}/heartbeat", tag = "targets", params(("id" = String, Path, description = "target id")), responses((status = 200, description = "alive", body = TargetOut), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not found", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn heartbeat(
    State(api): State<Api>,
    Segments(id): Segments<String>,
) -> Result<Json<TargetOut>, ApiError> {
    let out = api
        .run(move |c| {
            c.heartbeat(&id)?;
            let view = c.target(&id)?;
            Ok(target_out(&view, &c.capacity()?.devices))
        })
        .await?;
    Ok(Json(out))
}

#[utoipa::path(get, path = "/v1/targets", tag = "targets", responses((status = 200, description = "every target with health and capacity", body = Vec<TargetOut>), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn list_targets(State(api): State<Api>) -> Result<Json<Vec<TargetOut>>, ApiError> {
    let out = api
        .run(|c| {
            let usage = c.capacity()?.devices;
            Ok(c.targets()?.iter().map(|v| target_out(v, &usage)).collect())
        })
        .await?;
    Ok(Json(out))
}

#[utoipa::path(get, path = "/v1/targets/{id}", tag = "targets", params(("id" = String, Path, description = "target id")), responses((status = 200, description = "the target", body = TargetOut), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not found", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn get_target(
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

fn pools_out(c: &Cluster) -> Result<Vec<PoolOut>, StateError> {
    let capacity = c.capacity()?;
    Ok(c.pools()?
        .into_iter()
        .map(|p| PoolOut {
            capacity: capacity
                .pools
                .get(&p.name)
                .map(CapacityOut::from)
                .unwrap_or_default(),
            name: p.name,
            devices: p.devices.into_iter().map(DeviceRefBody::from).collect(),
            created_ms: p.created_ms,
        })
        .collect())
}

#[utoipa::path(put, path = "/v1/pools/{name}", tag = "pools", params(("name" = String, Path, description = "pool name")), request_body = PoolBody, responses((status = 201, description = "created", body = PoolOut), (status = 200, description = "already existed with these devices", body = PoolOut), (status = 400, description = "invalid input", body = ApiError), (status = 409, description = "conflicts with the current state", body = ApiError), (status = 422, description = "cannot be placed or names an unknown device", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn put_pool(
    State(api): State<Api>,
    Segments(name): Segments<String>,
    JsonBody(body): JsonBody<PoolBody>,
) -> Result<(StatusCode, Json<PoolOut>), ApiError> {
    let (existed, out) = api
        .run(move |c| {
            // Only for the status code: a racing identical create makes
            // both answers 201, which is harmless.
            let existed = c.pools()?.iter().any(|p| p.name == name);
            let devices: Vec<DeviceRef> = body
                .devices
                .iter()
                .map(|d| DeviceRef::new(&d.target, &d.device))
                .collect();
            c.create_pool(&name, &devices)?;
            let out = pools_out(c)?
                .into_iter()
                .find(|p| p.name == name)
                .ok_or(StateError::PoolNotFound(name))?;
            Ok((existed, out))
        })
        .await?;
    let status = if existed {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    Ok((status, Json(out)))
}

#[utoipa::path(get, path = "/v1/pools", tag = "pools", responses((status = 200, description = "every pool with its capacity", body = Vec<PoolOut>), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn list_pools(State(api): State<Api>) -> Result<Json<Vec<PoolOut>>, ApiError> {
    Ok(Json(api.run(pools_out).await?))
}

#[utoipa::path(get, path = "/v1/pools/{name}", tag = "pools", params(("name" = String, Path, description = "pool name")), responses((status = 200, description = "the pool", body = PoolOut), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not found", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn get_pool(
    State(api): State<Api>,
    Segments(name): Segments<String>,
) -> Result<Json<PoolOut>, ApiError> {
    let out = api
        .run(move |c| {
            crate::model::validate_id("pool name", &name, crate::limits::ID_BYTES_MAX)?;
            pools_out(c)?
                .into_iter()
                .find(|p| p.name == name)
                .ok_or(StateError::PoolNotFound(name))
        })
        .await?;
    Ok(Json(out))
}

#[utoipa::path(delete, path = "/v1/pools/{name}", tag = "pools", params(("name" = String, Path, description = "pool name")), responses((status = 204, description = "deleted"), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not found", body = ApiError), (status = 409, description = "conflicts with the current state", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn delete_pool(
    State(api): State<Api>,
    Segments(name): Segments<String>,
) -> Result<StatusCode, ApiError> {
    api.run(move |c| c.delete_pool(&name)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(put, path = "/v1/volumes/{uuid}", tag = "volumes", params(("uuid" = String, Path, description = "the volume UUID, chosen by the client")), request_body = VolumeSpecBody, responses((status = 201, description = "created", body = VolumeOut), (status = 200, description = "already existed with this spec", body = VolumeOut), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not found", body = ApiError), (status = 409, description = "conflicts with the current state", body = ApiError), (status = 422, description = "cannot be placed or names an unknown device", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn put_volume(
    State(api): State<Api>,
    Segments(uuid): Segments<String>,
    JsonBody(body): JsonBody<VolumeSpecBody>,
) -> Result<(StatusCode, Json<VolumeOut>), ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let spec = crate::model::VolumeSpec {
        uuid,
        name: body.name,
        size_bytes: body.size_bytes,
        layout: body.layout.into(),
        pool: body.pool,
    };
    let (created, out) = api
        .run(move |c| {
            let r = c.create_volume(&spec)?;
            let view = c.volume(&uuid)?;
            Ok((
                r.created,
                one_with_attachments(c, volume_out(r.volume, view.status, view.failed_extents))?,
            ))
        })
        .await?;
    if created {
        tracing::info!(volume = %out.uuid, name = %out.name, size_bytes = out.size_bytes, "volume created");
        Ok((StatusCode::CREATED, Json(out)))
    } else {
        Ok((StatusCode::OK, Json(out)))
    }
}

#[utoipa::path(get, path = "/v1/volumes", tag = "volumes", responses((status = 200, description = "every volume with status and extents", body = Vec<VolumeOut>), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn list_volumes(State(api): State<Api>) -> Result<Json<Vec<VolumeOut>>, ApiError> {
    let out = api
        .run(|c| {
            let now = c.now();
            let out = c.volumes()?.into_iter().map(|v| volume_view_out(v, now));
            with_attachments(c, out.collect())
        })
        .await?;
    Ok(Json(out))
}

#[utoipa::path(get, path = "/v1/volumes/{uuid}", tag = "volumes", params(("uuid" = String, Path, description = "the volume UUID, chosen by the client")), responses((status = 200, description = "the volume", body = VolumeOut), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not found", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn get_volume(
    State(api): State<Api>,
    Segments(uuid): Segments<String>,
) -> Result<Json<VolumeOut>, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let out = api
        .run(move |c| one_with_attachments(c, volume_view_out(c.volume(&uuid)?, c.now())))
        .await?;
    Ok(Json(out))
}

#[utoipa::path(post, path = "/v1/volumes/{uuid}/resize", tag = "volumes", params(("uuid" = String, Path, description = "the volume UUID, chosen by the client")), request_body = ResizeBody, responses((status = 200, description = "grown (or already this size)", body = VolumeOut), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not found", body = ApiError), (status = 409, description = "would shrink, or the volume is served to hosts by its targets (unexport first)", body = ApiError), (status = 422, description = "cannot be placed or names an unknown device", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn resize_volume(
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
/// allocated until it is reconciled).
#[utoipa::path(delete, path = "/v1/volumes/{uuid}", tag = "volumes", params(("uuid" = String, Path, description = "the volume UUID, chosen by the client"), ForceQuery), responses((status = 204, description = "deleted, its extents freed"), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not found", body = ApiError), (status = 409, description = "attached (use force)", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn delete_volume(
    State(api): State<Api>,
    Segments(uuid): Segments<String>,
    query: Result<Query<ForceQuery>, QueryRejection>,
) -> Result<StatusCode, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let force = force_of(query)?;
    api.program(move |c| {
        if force {
            delete_volume_forced(c, &uuid)
        } else {
            Ok(c.delete_volume(&uuid)?)
        }
    })
    .await?;
    tracing::info!(volume = %uuid, force, "volume deleted");
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

fn force_of(q: Result<Query<ForceQuery>, QueryRejection>) -> Result<bool, ApiError> {
    q.map(|Query(q)| q.force)
        .map_err(|e| ApiError::invalid(e.body_text()))
}

fn parse_host(s: &str) -> Result<String, ApiError> {
    crate::attach::validate_host_nqn(s).map_err(|e| ApiError::invalid(e.to_string()))?;
    Ok(s.to_owned())
}

/// Attaches a volume to a host: every target holding its extents exports
/// them, as namespaces of that host's subsystem visible to that host
/// alone; the answer is the connection plan. Idempotent: attaching again
/// returns the same plan (200) and re-exports anything missing. If a
/// target fails, whatever this call set up is taken back.
#[utoipa::path(put, path = "/v1/volumes/{uuid}/attachments/{host_nqn}", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), responses((status = 201, description = "attached", body = AttachmentOut), (status = 200, description = "was attached already", body = AttachmentOut), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "no such volume", body = ApiError), (status = 409, description = "a limit was reached, the daemon at a target's admin address is another target (wrong_target), or the cluster requires DH-HMAC-CHAP keys the host does not have (host_keys_required)", body = ApiError), (status = 422, description = "a target refused; nothing was left behind", body = ApiError), (status = 503, description = "a target is unreachable (nothing was left behind), or the store is busy; retry", body = ApiError)))]
async fn put_attachment(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
) -> Result<(StatusCode, Json<AttachmentOut>), ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    let r = api
        .program(move |c| program::attach(c, &uuid, &host))
        .await?;
    let code = if r.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((code, Json(attachment_out(r.attachment, r.plan))))
}

#[utoipa::path(get, path = "/v1/volumes/{uuid}/attachments/{host_nqn}", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)"), WatchQuery), responses((status = 200, description = "the attachment and its connection plan", body = AttachmentOut), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not attached to that host", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn get_attachment(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
    query: Result<Query<WatchQuery>, QueryRejection>,
) -> Result<Json<AttachmentOut>, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    let Query(q) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    if let Some(after) = q.after_revision {
        // An unknown attachment answers at once.
        let (u, h) = (uuid, host.clone());
        api.run(move |c| c.attachment(&u, &h)).await?;
        // Long poll: one key read per step, not a snapshot.
        let deadline = tokio::time::Instant::now() + WATCH_WAIT;
        loop {
            let rev = api.run(move |c| Ok(c.copy_state(&uuid)?.revision)).await?;
            if rev > after || tokio::time::Instant::now() >= deadline || api.cluster.closing() {
                break;
            }
            tokio::time::sleep(WATCH_STEP).await;
        }
    }
    let out = api
        .run(move |c| attachment_with_plan(c, c.attachment(&uuid, &host)?))
        .await?;
    Ok(Json(out))
}

/// Longest a watching `GET` of an attachment waits: under common proxy and
/// client timeouts (30 s and more).
const WATCH_WAIT: std::time::Duration = std::time::Duration::from_secs(25);
/// How often a watching `GET` looks at the revision: hosts hear of a copy
/// within this, at one key read per step per watcher.
const WATCH_STEP: std::time::Duration = std::time::Duration::from_millis(250);

#[utoipa::path(get, path = "/v1/volumes/{uuid}/attachments", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID")), responses((status = 200, description = "every host the volume is attached to", body = Vec<AttachmentOut>), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "no such volume", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn list_attachments(
    State(api): State<Api>,
    Segments(uuid): Segments<String>,
) -> Result<Json<Vec<AttachmentOut>>, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let out = api
        .run(move |c| {
            c.volume_attachments(&uuid)?
                .into_iter()
                .map(|a| attachment_with_plan(c, a))
                .collect()
        })
        .await?;
    Ok(Json(out))
}

/// Detaches a volume from a host: the targets stop exporting its extents
/// to that host. An unreachable target fails the detach (503; the
/// attachment stays `detaching`, retry) unless `force`.
#[utoipa::path(delete, path = "/v1/volumes/{uuid}/attachments/{host_nqn}", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)"), ForceQuery), responses((status = 204, description = "detached"), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not attached to that host", body = ApiError), (status = 409, description = "the daemon at a target's admin address is another target (wrong_target): nothing was changed there", body = ApiError), (status = 422, description = "a target refused", body = ApiError), (status = 503, description = "a target is unreachable, or the store is busy; retry or force", body = ApiError)))]
async fn delete_attachment(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
    query: Result<Query<ForceQuery>, QueryRejection>,
) -> Result<StatusCode, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    let force = force_of(query)?;
    api.program(move |c| program::detach(c, &uuid, &host, force))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Serves the volume to a stock host: the host's NQN joins the access
/// list of the volume's subsystem, which a few targets present as ANA
/// paths (one optimized, the owner running the volume engine; the others
/// inaccessible until a failover). Connect with `nvme connect` to every
/// path. Idempotent: again, 200 with the same view.
#[utoipa::path(put, path = "/v1/volumes/{uuid}/exports/{host_nqn}", tag = "exports", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), request_body(content = ExportBody, description = "optional: without a body (and then without a content type), the defaults"), responses((status = 201, description = "exported", body = crate::failover::ServedView), (status = 200, description = "was exported to that host already", body = crate::failover::ServedView), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "no such volume", body = ApiError), (status = 409, description = "the cluster requires DH-HMAC-CHAP keys the host does not have (host_keys_required)", body = ApiError), (status = 422, description = "a target refused", body = ApiError), (status = 503, description = "a target is unreachable, or the store is busy; retry", body = ApiError)))]
async fn put_export(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
    OptionalJsonBody(body): OptionalJsonBody<ExportBody>,
) -> Result<(StatusCode, Json<crate::failover::ServedView>), ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    let body = body.unwrap_or_default();
    let paths = body.paths.unwrap_or(crate::paths::PATHS_DEFAULT);
    let (view, created) = api
        .program(move |c| crate::failover::export(c, &uuid, &host, paths))
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
#[utoipa::path(get, path = "/v1/volumes/{uuid}/exports", tag = "exports", params(("uuid" = String, Path, description = "the volume UUID")), responses((status = 200, description = "the served volume", body = crate::failover::ServedView), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "the volume is not served", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn get_exports(
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
#[utoipa::path(delete, path = "/v1/volumes/{uuid}/exports/{host_nqn}", tag = "exports", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), responses((status = 204, description = "no longer exported to that host"), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not exported to that host", body = ApiError), (status = 503, description = "a target is unreachable, or the store is busy; retry", body = ApiError)))]
async fn delete_export(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    api.program(move |c| crate::failover::unexport(c, &uuid, &host))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// An owner of served volumes renews its lease: the answer lists the
/// subsystems it may serve, for `valid_ms` counted from when it sent this
/// request (so its expiry is never later than the control plane's idea of
/// it). Another path is promoted only after the lease has run out.
#[utoipa::path(post, path = "/v1/targets/{id}/lease", tag = "targets", params(("id" = String, Path, description = "target id")), responses((status = 200, description = "granted", body = crate::paths::LeaseGrant), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not found", body = ApiError), (status = 503, description = "store busy or unavailable, or this control plane is not the leader (not_leader: only the leader grants owner leases); retry, or ask another endpoint", body = ApiError)))]
async fn post_lease(
    State(api): State<Api>,
    Segments(id): Segments<String>,
) -> Result<Json<crate::paths::LeaseGrant>, ApiError> {
    let out = api.run(move |c| c.grant_lease(&id)).await?;
    Ok(Json(out))
}

/// A host reports copies it stopped using because I/O to them failed (the
/// volume engine keeps serving from the other copies). The failure is the
/// volume's: it turns degraded and stays so after detach, and every later
/// attach, by any host, carries the list so the stale copies are never read.
/// Failures accumulate until the extent is rebuilt.
#[utoipa::path(put, path = "/v1/volumes/{uuid}/attachments/{host_nqn}/failed-extents", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), request_body = FailedExtentsBody, responses((status = 200, description = "recorded", body = AttachmentOut), (status = 400, description = "invalid input (an extent index out of range)", body = ApiError), (status = 404, description = "not attached to that host", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn put_failed_extents(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
    JsonBody(body): JsonBody<FailedExtentsBody>,
) -> Result<Json<AttachmentOut>, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    let out = api
        .run(move |c| {
            let a = c.report_failed_extents(&uuid, &host, &body.failed_extents)?;
            attachment_with_plan(c, a)
        })
        .await?;
    tracing::warn!(volume = %uuid, host = %out.host_nqn, failed = ?out.failed_extents,
        "host reported failed extents; volume degraded");
    Ok(Json(out))
}

/// A host's serving process starts: its session, and the copy-state
/// revision it opened the volume at. A different earlier session of the
/// same host that never handed over its records loses them (its stale
/// copies are then copied whole).
#[utoipa::path(put, path = "/v1/volumes/{uuid}/attachments/{host_nqn}/session", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), request_body = SessionBody, responses((status = 204, description = "recorded"), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not attached to that host", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn put_session(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
    JsonBody(body): JsonBody<SessionBody>,
) -> Result<StatusCode, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    api.run(move |c| c.register_session(&uuid, &host, body.session, body.revision))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A host's serving process stops and hands over what each stale copy
/// missed from it.
#[utoipa::path(put, path = "/v1/volumes/{uuid}/attachments/{host_nqn}/missed", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), request_body = MissedBody, responses((status = 204, description = "merged"), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "no such volume", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn put_missed(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
    JsonBody(body): JsonBody<MissedBody>,
) -> Result<StatusCode, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    let mut extents = BTreeMap::new();
    for (k, v) in body.extents {
        let e: u32 = k
            .parse()
            .map_err(|_| ApiError::invalid(format!("extent {k:?} is not an index")))?;
        extents.insert(e, v);
    }
    api.run(move |c| c.hand_over_missed(&uuid, &host, body.session, &extents))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A host writes to job `job`'s copy and every write it issued before has
/// completed. The copier starts once every host writing the volume said so.
#[utoipa::path(put, path = "/v1/volumes/{uuid}/attachments/{host_nqn}/sync/{job}", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)"), ("job" = u64, Path, description = "the copy job")), request_body = SyncBody, responses((status = 204, description = "recorded"), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "no such volume, or the job is over", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn put_sync(
    State(api): State<Api>,
    Segments((uuid, host, job)): Segments<(String, String, String)>,
    JsonBody(body): JsonBody<SyncBody>,
) -> Result<StatusCode, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    let job = crate::resync::validate_job_id(&job).map_err(|e| ApiError::invalid(e.to_string()))?;
    let known = api
        .run(move |c| {
            if body.failed {
                return c.job_failed_at_host(&uuid, &host, job);
            }
            c.confirm_sync(
                &uuid,
                &host,
                job,
                body.session,
                body.missed_regions.as_deref(),
            )
        })
        .await?;
    if known {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("copy job {job} of volume {uuid} is over"),
        ))
    }
}

/// An operator marks a copy stale (after `nvpool volume verify` found it
/// differing, say): hosts stop reading it at once and the heal loop copies
/// it whole from an in-sync copy. Refused for the last copy in sync of its
/// row; a copy already stale is left as it is.
#[utoipa::path(post, path = "/v1/volumes/{uuid}/extents/{index}/resync", tag = "volumes", params(("uuid" = String, Path, description = "the volume UUID"), ("index" = u32, Path, description = "the copy: an index into the volume's extents")), responses((status = 202, description = "stale; it will be copied whole", body = VolumeOut), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "no such volume", body = ApiError), (status = 409, description = "the last copy in sync of its row", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn post_resync(
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
#[utoipa::path(get, path = "/v1/volumes/{uuid}/history", tag = "volumes", params(("uuid" = String, Path, description = "the volume UUID")), responses((status = 200, description = "running and past copies", body = Vec<CopyHistoryOut>), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not found", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn get_history(
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

/// Sets a target's state: `draining` moves every extent off it (online,
/// through copy jobs; it serves each until the move is done), `cordoned`
/// only stops new extents, `active` takes new extents again (and stops a
/// drain; moves under way finish).
#[utoipa::path(put, path = "/v1/targets/{id}/state", tag = "targets", params(("id" = String, Path, description = "target id")), request_body = TargetStateBody, responses((status = 200, description = "the target", body = TargetOut), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not found", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn put_target_state(
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

/// Sets a host's DH-HMAC-CHAP keys (replacing any): every target that
/// exports to the host — its attached volumes and the volumes served to
/// it — then makes it authenticate on every queue, with these keys. The
/// change is made on those targets before the answer (`rollout`); a target
/// that could not be changed gets them on its next reconciliation. The
/// secrets are never shown again. A host's controllers keep running;
/// their next connection uses the new keys.
#[utoipa::path(put, path = "/v1/hosts/{host_nqn}/dhchap", tag = "hosts", params(("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), request_body = HostKeysBody, responses((status = 200, description = "set; `rollout` says which targets hold them", body = HostKeysOut), (status = 400, description = "invalid input (the message never quotes a secret)", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn put_host_keys(
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
#[utoipa::path(get, path = "/v1/hosts/{host_nqn}/dhchap", tag = "hosts", params(("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), responses((status = 200, description = "the host's settings", body = HostKeysOut), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "the host has no keys", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn get_host_keys(
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
#[utoipa::path(delete, path = "/v1/hosts/{host_nqn}/dhchap", tag = "hosts", params(("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), responses((status = 200, description = "forgotten; where", body = KeyRollout), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "the host has no keys", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn delete_host_keys(
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

/// Forgets a target that holds no extents (drain it first). Old extents
/// it may still export keep it until it has been reconciled, unless
/// `force` (a target gone for good).
#[utoipa::path(delete, path = "/v1/targets/{id}", tag = "targets", params(("id" = String, Path, description = "target id"), ForceQuery), responses((status = 204, description = "removed"), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not found", body = ApiError), (status = 409, description = "the target holds extents", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn delete_target(
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

fn rebalance_out(
    c: &Cluster,
    scopes: &[Option<String>],
    started: bool,
) -> Result<RebalanceOut, StateError> {
    let mut moves = Vec::new();
    let mut running = 0;
    let mut parallel = std::collections::BTreeSet::new();
    for p in scopes {
        let pool = p.as_deref();
        running += c.moves_running(pool)?;
        for m in c.rebalance_plan(pool)? {
            let name = c
                .volume(&m.volume)
                .map(|v| v.volume.name)
                .unwrap_or_default();
            parallel.insert(m.to.target.clone());
            moves.push(MoveOut {
                volume: m.volume,
                volume_name: name,
                extent: m.extent,
                from: m.from.to_string(),
                to: m.to.to_string(),
                bytes: m.bytes,
            });
        }
    }
    let bytes_total = moves.iter().fold(0u64, |t, m| t.saturating_add(m.bytes));
    let rate = c.rebuild_rate();
    let lanes = (parallel.len() * crate::limits::COPIES_PER_TARGET_MAX).max(1) as u64;
    let eta_s = (rate > 0).then(|| bytes_total.div_ceil(rate.saturating_mul(lanes)));
    Ok(RebalanceOut {
        moves,
        bytes_total,
        eta_s,
        started,
        pending: c
            .rebalance_requests()?
            .into_iter()
            .map(|r| r.pool)
            .collect(),
        moves_running: running,
    })
}

fn rebalance_scopes(c: &Cluster, pool: Option<String>) -> Result<Vec<Option<String>>, StateError> {
    Ok(match pool {
        Some(p) => vec![Some(p)],
        None => c
            .pools()?
            .into_iter()
            .map(|p| Some(p.name))
            .chain([None])
            .collect(),
    })
}

/// Evens out used capacity and extents per device across a pool (or every
/// pool): the plan is recomputed as moves finish, placement rules holding
/// at every step, until nothing is worth moving. `dry_run` only returns
/// the plan.
#[utoipa::path(post, path = "/v1/rebalance", tag = "pools", request_body = RebalanceBody, responses((status = 200, description = "the plan (dry run)", body = RebalanceOut), (status = 202, description = "started", body = RebalanceOut), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "no such pool", body = ApiError), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn post_rebalance(
    State(api): State<Api>,
    JsonBody(body): JsonBody<RebalanceBody>,
) -> Result<(StatusCode, Json<RebalanceOut>), ApiError> {
    let out = api
        .run(move |c| {
            if let Some(p) = &body.pool {
                crate::model::validate_id("pool name", p, crate::limits::ID_BYTES_MAX)?;
                if !c.pools()?.iter().any(|x| &x.name == p) {
                    return Err(StateError::PoolNotFound(p.clone()));
                }
            }
            let scopes = rebalance_scopes(c, body.pool.clone())?;
            if !body.dry_run {
                for p in &scopes {
                    c.request_rebalance(p.as_deref())?;
                }
            }
            rebalance_out(c, &scopes, !body.dry_run)
        })
        .await?;
    let status = if out.started {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(out)))
}

/// Rebalancing under way: the scopes pending, moves running and the plan
/// left.
#[utoipa::path(get, path = "/v1/rebalance", tag = "pools", responses((status = 200, description = "what is left to move", body = RebalanceOut), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn get_rebalance(State(api): State<Api>) -> Result<Json<RebalanceOut>, ApiError> {
    let out = api
        .run(move |c| {
            let scopes = rebalance_scopes(c, None)?;
            rebalance_out(c, &scopes, false)
        })
        .await?;
    Ok(Json(out))
}

/// Makes the target's host subsystems match the attachment records now
/// (the control plane also does this when a target registers, and
/// periodically).
#[utoipa::path(post, path = "/v1/targets/{id}/reconcile", tag = "targets", params(("id" = String, Path, description = "target id")), responses((status = 200, description = "reconciled", body = ReconcileOut), (status = 400, description = "invalid input", body = ApiError), (status = 404, description = "not found", body = ApiError), (status = 409, description = "the daemon at a target's admin address is another target (wrong_target): nothing was changed there", body = ApiError), (status = 422, description = "the target refused a change", body = ApiError), (status = 503, description = "the target is unreachable, or the store is busy", body = ApiError)))]
async fn reconcile_target(
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

// ----- metrics -----

fn status_name(s: VolumeStatus) -> &'static str {
    match s {
        VolumeStatus::Online => "online",
        VolumeStatus::Degraded => "degraded",
        VolumeStatus::Offline => "offline",
    }
}

/// Escapes a Prometheus label value.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn render_metrics(c: &Cluster) -> Result<String, StateError> {
    let volumes = c.volumes()?;
    let targets = c.targets()?;
    let cap = c.capacity()?;
    let mut out = String::new();
    // `write!` to a String cannot fail: the results are ignored.
    let _ = writeln!(out, "# HELP nvpool_volumes Volumes by status.");
    let _ = writeln!(out, "# TYPE nvpool_volumes gauge");
    for s in [
        VolumeStatus::Online,
        VolumeStatus::Degraded,
        VolumeStatus::Offline,
    ] {
        let n = volumes.iter().filter(|v| v.status == s).count();
        let _ = writeln!(out, "nvpool_volumes{{status=\"{}\"}} {n}", status_name(s));
    }
    let _ = writeln!(
        out,
        "# HELP nvpool_capacity_bytes Device bytes in the cluster."
    );
    let _ = writeln!(out, "# TYPE nvpool_capacity_bytes gauge");
    for (kind, v) in [
        ("total", cap.total.total_bytes),
        ("used", cap.total.used_bytes),
        ("free", cap.total.free_bytes),
    ] {
        let _ = writeln!(out, "nvpool_capacity_bytes{{kind=\"{kind}\"}} {v}");
    }
    let _ = writeln!(
        out,
        "# HELP nvpool_target_up Whether a target heartbeats (1) or is offline (0)."
    );
    let _ = writeln!(out, "# TYPE nvpool_target_up gauge");
    for t in &targets {
        let up = u8::from(t.health == Health::Online);
        let _ = writeln!(
            out,
            "nvpool_target_up{{target=\"{}\"}} {up}",
            label(&t.target.id)
        );
    }
    let (mut running, mut copied, mut stale) = (0u64, 0u64, 0u64);
    for v in &volumes {
        running += v.jobs.len() as u64;
        stale += v.failed_extents.len() as u64;
        copied = v
            .jobs
            .iter()
            .fold(copied, |t, j| t.saturating_add(j.bytes_copied));
    }
    // Finished copies, from one read of every copy-state record.
    for cs in c.snapshot()?.copy_states.values() {
        copied = cs
            .value
            .history
            .iter()
            .fold(copied, |t, r| t.saturating_add(r.bytes_copied));
    }
    let _ = writeln!(out, "# HELP nvpool_copies_running Copy jobs under way.");
    let _ = writeln!(out, "# TYPE nvpool_copies_running gauge");
    let _ = writeln!(out, "nvpool_copies_running {running}");
    let _ = writeln!(
        out,
        "# HELP nvpool_stale_extents Extent copies not in sync (never read)."
    );
    let _ = writeln!(out, "# TYPE nvpool_stale_extents gauge");
    let _ = writeln!(out, "nvpool_stale_extents {stale}");
    let _ = writeln!(
        out,
        "# HELP nvpool_copy_bytes Bytes copied by the running and the remembered copy jobs."
    );
    let _ = writeln!(out, "# TYPE nvpool_copy_bytes gauge");
    let _ = writeln!(out, "nvpool_copy_bytes {copied}");
    let _ = writeln!(out, "# HELP nvpool_targets Registered targets.");
    let _ = writeln!(out, "# TYPE nvpool_targets gauge");
    let _ = writeln!(out, "nvpool_targets {}", targets.len());
    Ok(out)
}

#[utoipa::path(get, path = "/metrics", tag = "operations", responses((status = 200, description = "Prometheus text format", body = String, content_type = "text/plain"), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
async fn metrics(State(api): State<Api>) -> Result<Response, ApiError> {
    let text = api.run(render_metrics).await?;
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        text,
    )
        .into_response())
}

// ----- OpenAPI -----

#[derive(OpenApi)]
#[openapi(
    info(
        title = "nvpool control plane",
        description = "Targets, pools and volumes of an nvpool cluster. Errors are \
                       {kind, message, details}; sizes are bytes."
    ),
    paths(
        healthz, metrics, openapi, register_target, heartbeat, list_targets, get_target,
        put_pool, list_pools, get_pool, delete_pool, put_volume, list_volumes, get_volume,
        resize_volume, delete_volume, put_attachment, get_attachment, list_attachments,
        delete_attachment, put_failed_extents, put_session, put_missed, put_sync, get_history, post_resync,
        reconcile_target, put_target_state, delete_target, post_rebalance, get_rebalance,
        put_export, get_exports, delete_export, post_lease, put_host_keys, get_host_keys,
        delete_host_keys
    ),
    modifiers(&BearerSchemes, &Formats)
)]
struct ApiDoc;

/// A documented answer whose body is an [`ApiError`].
fn error_answer(what: &str) -> utoipa::openapi::Response {
    use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
    ResponseBuilder::new()
        .description(what)
        .content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ApiError")))
                .build(),
        )
        .build()
}

/// The operations of a path, with their methods.
fn operations(
    item: &mut utoipa::openapi::PathItem,
) -> [(&'static str, &mut Option<utoipa::openapi::path::Operation>); 4] {
    [
        ("GET", &mut item.get),
        ("PUT", &mut item.put),
        ("POST", &mut item.post),
        ("DELETE", &mut item.delete),
    ]
}

/// The schema of an inline object, if `schema` is one.
fn object(
    schema: Option<&mut utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>>,
) -> Option<&mut utoipa::openapi::schema::Object> {
    use utoipa::openapi::{schema::Schema, RefOr};
    match schema {
        Some(RefOr::T(Schema::Object(o))) => Some(o),
        _ => None,
    }
}

/// The property `field` of the component schema `schema`, when it is an
/// object schema (a string, a number, a map…).
fn body_field<'a>(
    components: &'a mut utoipa::openapi::Components,
    schema: &str,
    field: &str,
) -> Option<&'a mut utoipa::openapi::schema::Object> {
    match body_schema(components, schema, field) {
        Some(utoipa::openapi::schema::Schema::Object(o)) => Some(o),
        _ => None,
    }
}

/// The property `field` of the component schema `schema`, whatever it is.
fn body_schema<'a>(
    components: &'a mut utoipa::openapi::Components,
    schema: &str,
    field: &str,
) -> Option<&'a mut utoipa::openapi::schema::Schema> {
    match object(components.schemas.get_mut(schema))?
        .properties
        .get_mut(field)
    {
        Some(utoipa::openapi::RefOr::T(s)) => Some(s),
        _ => None,
    }
}

/// Declares the bearer-token schemes and writes every operation's
/// security requirements, and its 401 and 403 answers, from
/// [`auth::access`]: the same table the server enforces.
#[derive(Debug)]
struct BearerSchemes;

impl utoipa::Modify for BearerSchemes {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{
            HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
        };
        use utoipa::openapi::Ref;
        let schemes = [
            ("admin_token", "an admin token: every call"),
            ("reader_token", "a reader token: every GET"),
            ("target_token", "a target token: registration, heartbeats, leases, and reports for the owner host NQNs the control plane issued"),
            ("host_token", "a host token, bound to one host NQN: attach, detach and report for that NQN"),
        ];
        let components = doc.components.get_or_insert_with(Default::default);
        for (name, what) in schemes {
            components.add_security_scheme(
                name,
                SecurityScheme::Http(
                    HttpBuilder::new()
                        .scheme(HttpAuthScheme::Bearer)
                        .description(Some(what))
                        .build(),
                ),
            );
        }
        for (name, what) in [
            ("Unauthorized", "no bearer token, or an unknown one"),
            ("Forbidden", "the token's role may not make this call"),
        ] {
            components
                .responses
                .insert(name.into(), error_answer(what).into());
        }
        for (path, item) in doc.paths.paths.iter_mut() {
            for (method, op) in operations(item) {
                let Some(op) = op else { continue };
                let allowed: &[&str] = match auth::access(method, path) {
                    Access::Public => continue,
                    Access::Read => &["admin_token", "reader_token", "target_token", "host_token"],
                    Access::Target => &["admin_token", "target_token"],
                    Access::Host => &["admin_token", "host_token"],
                    Access::Report => &["admin_token", "host_token", "target_token"],
                    Access::Admin => &["admin_token"],
                };
                op.security = Some(
                    allowed
                        .iter()
                        .map(|n| SecurityRequirement::new(*n, Vec::<String>::new()))
                        .collect(),
                );
                let answers = &mut op.responses.responses;
                answers.insert("401".into(), Ref::from_response_name("Unauthorized").into());
                answers.insert("403".into(), Ref::from_response_name("Forbidden").into());
            }
        }
    }
}

/// What the server checks of identifiers, sizes and layouts, stated in
/// the document: patterns of path parameters and body fields, ranges of
/// layout fields, no extra properties in a layout, and the 415 answer of
/// every call with a body.
#[derive(Debug)]
struct Formats;

/// Ids (targets, devices, pools): see `model::validate_id`.
const ID_PATTERN: &str = "^[A-Za-z0-9._:-]+$";
const UUID_PATTERN: &str =
    "^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$";
/// `SocketAddr`'s text: IPv4:port or [IPv6]:port (an IPv6 scope id
/// allowed), the port 0..=65535 in up to 5 digits.
const ADDR_PATTERN: &str =
    "^([0-9]{1,3}([.][0-9]{1,3}){3}|\\[[0-9A-Fa-f:.]+(%[0-9A-Za-z]+)?\\]):[0-9]{1,5}$";
/// The longest such text: `[` IPv6 with an IPv4 tail `%` scope `]:65535`.
const ADDR_BYTES_MAX: usize = 64;
/// `nqn.` then printable ASCII without `/`: see `attach::validate_host_nqn`.
const NQN_PATTERN: &str = "^nqn\\.[!-.0-~]+$";

impl utoipa::Modify for Formats {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use crate::attach::NQN_BYTES_MAX;
        use crate::limits::{
            DEVICE_BYTES_MAX, ID_BYTES_MAX, LABELS_MAX, LABEL_BYTES_MAX, NAME_BYTES_MAX,
        };
        use nvpool_layout::limits::{BLOCK_BYTES, EXTENTS_PER_VOLUME_MAX};
        use nvpool_layout::limits::{COPIES_MAX, COPIES_MIN, STRIPE_BYTES_MIN, STRIPE_WIDTH_MAX};
        use utoipa::openapi::schema::{AdditionalProperties, Object, Schema};
        use utoipa::openapi::{Ref, RefOr};
        fn text(o: &mut Object, pattern: &str, max: usize) {
            o.pattern = Some(pattern.into());
            o.min_length = Some(1);
            o.max_length = Some(max);
        }
        let uuid = |o: &mut Object| {
            text(o, UUID_PATTERN, 36);
            o.format = Some(utoipa::openapi::SchemaFormat::Custom("uuid".into()));
        };
        for item in doc.paths.paths.values_mut() {
            for op in operations(item)
                .into_iter()
                .filter_map(|(_, op)| op.as_mut())
            {
                for p in op.parameters.iter_mut().flatten() {
                    let RefOr::T(p) = p else { continue };
                    let Some(o) = object(p.schema.as_mut()) else {
                        continue;
                    };
                    match p.name.as_str() {
                        "uuid" => uuid(o),
                        "id" | "name" => text(o, ID_PATTERN, ID_BYTES_MAX),
                        "host_nqn" => text(o, NQN_PATTERN, NQN_BYTES_MAX),
                        _ => {}
                    }
                }
                if op.request_body.is_some() {
                    op.responses.responses.insert(
                        "415".into(),
                        Ref::from_response_name("UnsupportedMediaType").into(),
                    );
                }
            }
        }
        // Bodies that may be left out (`OptionalJsonBody`).
        if let Some(op) = doc
            .paths
            .paths
            .get_mut("/v1/volumes/{uuid}/exports/{host_nqn}")
            .and_then(|item| item.put.as_mut())
        {
            if let Some(utoipa::openapi::RefOr::T(b)) = op.request_body.as_mut() {
                b.required = Some(utoipa::openapi::Required::False);
            }
        }
        let components = doc.components.get_or_insert_with(Default::default);
        components.responses.insert(
            "UnsupportedMediaType".into(),
            error_answer("the body is not sent as application/json").into(),
        );
        let fields: [(&str, &str, &str, usize); 8] = [
            ("VolumeSpecBody", "name", ID_PATTERN, NAME_BYTES_MAX),
            ("VolumeSpecBody", "pool", ID_PATTERN, ID_BYTES_MAX),
            ("RegisterTargetBody", "id", ID_PATTERN, ID_BYTES_MAX),
            ("RegisterTargetBody", "name", ID_PATTERN, NAME_BYTES_MAX),
            ("DeviceBody", "id", ID_PATTERN, ID_BYTES_MAX),
            ("DeviceRefBody", "target", ID_PATTERN, ID_BYTES_MAX),
            ("DeviceRefBody", "device", ID_PATTERN, ID_BYTES_MAX),
            ("RebalanceBody", "pool", ID_PATTERN, ID_BYTES_MAX),
        ];
        for (schema, field, pattern, max) in fields {
            if let Some(f) = body_field(components, schema, field) {
                text(f, pattern, max);
            }
        }
        if let Some(f) = body_field(components, "DeviceBody", "capacity_bytes") {
            f.maximum = Some(utoipa::Number::UInt(DEVICE_BYTES_MAX as usize));
        }
        // Labels (`model::validate_labels`): keys may hold `/`, values may
        // be empty.
        for schema in ["RegisterTargetBody", "DeviceBody"] {
            let Some(labels) = body_field(components, schema, "labels") else {
                continue;
            };
            labels.max_properties = Some(LABELS_MAX);
            if let Some(Schema::Object(k)) = labels.property_names.as_deref_mut() {
                text(k, "^[A-Za-z0-9._/-]+$", LABEL_BYTES_MAX);
            }
            if let Some(AdditionalProperties::RefOr(RefOr::T(Schema::Object(v)))) =
                labels.additional_properties.as_deref_mut()
            {
                v.pattern = Some("^[A-Za-z0-9._-]*$".into());
                v.max_length = Some(LABEL_BYTES_MAX);
            }
        }
        // A volume is at most EXTENTS_PER_VOLUME_MAX extents: the bound
        // below is for the default extent size (a daemon with smaller
        // extents answers 400 above its own bound).
        for schema in ["VolumeSpecBody", "ResizeBody"] {
            if let Some(f) = body_field(components, schema, "size_bytes") {
                f.minimum = Some(utoipa::Number::UInt(BLOCK_BYTES as usize));
                f.maximum = Some(utoipa::Number::UInt(
                    (u64::from(EXTENTS_PER_VOLUME_MAX) * crate::limits::EXTENT_BYTES) as usize,
                ));
                f.multiple_of = Some(utoipa::Number::UInt(BLOCK_BYTES as usize));
            }
        }
        if let Some(f) = body_field(components, "DeviceBody", "backend") {
            f.min_length = Some(1);
            f.max_length = Some(crate::limits::BACKEND_SPEC_BYTES_MAX);
        }
        // A target's state (`model::TargetState`), in and out.
        for schema in ["TargetStateBody", "TargetOut"] {
            if let Some(f) = body_field(components, schema, "state") {
                f.enum_values = Some(TargetState::ALL.iter().map(|s| s.name().into()).collect());
            }
        }
        // The target's admin token (`rest::Secret`).
        if let Some(f) = body_field(components, "RegisterTargetBody", "admin_token") {
            f.pattern = Some("^[!-~]+$".into());
            f.min_length = Some(crate::rest::SECRET_BYTES_MIN);
            f.max_length = Some(crate::rest::SECRET_BYTES_MAX);
        }
        // Addresses are IP:port (an IPv6 address in brackets), never a
        // name; that the IP is not a wildcard and the port not 0 (for the
        // addresses hosts are told) the pattern does not say.
        for field in ["addr", "admin_addr", "rdma_addr"] {
            if let Some(f) = body_field(components, "RegisterTargetBody", field) {
                f.pattern = Some(ADDR_PATTERN.into());
                f.min_length = Some(1);
                f.max_length = Some(ADDR_BYTES_MAX);
            }
        }
        let lists: [(&str, &str, usize); 2] = [
            (
                "RegisterTargetBody",
                "devices",
                crate::limits::DEVICES_PER_TARGET_MAX,
            ),
            ("PoolBody", "devices", crate::limits::DEVICES_PER_POOL_MAX),
        ];
        for (schema, field, max) in lists {
            if let Some(Schema::Array(a)) = body_schema(components, schema, field) {
                a.max_items = Some(max);
            }
        }
        if let Some(f) = body_field(components, "ExportBody", "paths") {
            f.minimum = Some(utoipa::Number::UInt(1));
            f.maximum = Some(utoipa::Number::UInt(crate::paths::PATHS_MAX));
        }
        if let Some(extents) = body_field(components, "MissedBody", "extents") {
            if let Some(Schema::Object(k)) = extents.property_names.as_deref_mut() {
                k.pattern = Some("^(0|[1-9][0-9]{0,9})$".into());
            }
        }
        if let Some(RefOr::T(Schema::OneOf(layouts))) = components.schemas.get_mut("LayoutBody") {
            for variant in layouts.items.iter_mut() {
                let RefOr::T(Schema::Object(v)) = variant else {
                    continue;
                };
                v.additional_properties = Some(Box::new(AdditionalProperties::FreeForm(false)));
                let ranges: [(&str, usize, usize); 3] = [
                    ("copies", COPIES_MIN.into(), COPIES_MAX.into()),
                    ("width", 2, STRIPE_WIDTH_MAX as usize),
                    ("stripe_bytes", STRIPE_BYTES_MIN as usize, usize::MAX),
                ];
                for (field, min, max) in ranges {
                    if let Some(f) = object(v.properties.get_mut(field)) {
                        f.minimum = Some(utoipa::Number::UInt(min));
                        f.maximum = (max != usize::MAX).then_some(utoipa::Number::UInt(max));
                    }
                }
            }
        }
    }
}

/// The OpenAPI 3 document of this API, as served at `/v1/openapi.json`
/// and checked in as `docs/openapi.json`: pretty JSON with a final newline.
pub fn openapi_json() -> String {
    let mut doc = ApiDoc::openapi();
    // The crate's version would make the checked-in copy stale on every
    // release; the API carries its version in its paths.
    doc.info.version = "v1".into();
    let mut text = doc
        .to_pretty_json()
        .expect("an OpenAPI document serialises to JSON");
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_statuses() {
        let cases: Vec<(StateError, u16, &str)> = vec![
            (
                StateError::Invalid(crate::model::ModelError::InvalidSize("0".into())),
                400,
                "invalid",
            ),
            (StateError::VolumeNotFound("v".into()), 404, "not_found"),
            (StateError::PoolConflict("p".into()), 409, "pool_conflict"),
            (
                StateError::Placement(PlacementError::NoSpace {
                    need: 2,
                    have: 1,
                    extent_bytes: 1 << 20,
                    pool: None,
                }),
                422,
                "no_space",
            ),
            (StateError::Contention { attempts: 32 }, 503, "contention"),
            (
                StateError::NotLeader(crate::leader::NotLeader),
                503,
                "not_leader",
            ),
            (
                StateError::Store(StoreError::Backend {
                    op: "commit",
                    source: "disk full".into(),
                }),
                503,
                "unavailable",
            ),
            (StateError::Inconsistent("x".into()), 500, "inconsistent"),
        ];
        for (e, status, kind) in cases {
            let a = ApiError::from_state(e);
            assert_eq!((a.status().as_u16(), a.kind()), (status, kind));
        }
        let r = ApiError::from_state(StateError::Contention { attempts: 1 }).into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }
}
