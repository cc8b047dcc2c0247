//! The local admin API: JSON over HTTP, for the control plane and for admins.
//!
//! Every request, to any path, needs `Authorization: Bearer TOKEN` with a
//! token of the target's [`AdminTokens`] (auth.rs); without one it is
//! answered 401 with `WWW-Authenticate: Bearer`, before anything else is
//! looked at, and logged (rate-limited per peer address).
//!
//! | method and path | does |
//! |---|---|
//! | `GET /v1/health` | liveness |
//! | `GET /v1/identity` | who this is: `{"target_id": ID or null, "identity": UUID}`; the control plane checks `target_id` before it changes anything here |
//! | `GET /v1/target` | listeners, subsystems, controllers |
//! | `GET /v1/subsystems` | every subsystem with namespaces and hosts |
//! | `PUT /v1/subsystems/{nqn}` | create or replace (body: allowed_hosts, allow_any_host, host_keys, serial, model, ana, namespaces) |
//! | `PUT /v1/subsystems/{nqn}/ana` | set the ANA state here (body: `{"state": "optimized"}`, and for a served volume's owner `owner_keys`: the DH-HMAC-CHAP keys its volume engine authenticates with, write-only, shown as `owner_key_id`; 503 when a backend cannot be activated) |
//! | `POST /v1/leases` | renew ANA leases (body: `{"nqns": [...], "valid_ms": N}`, N ≤ 60000) |
//! | `DELETE /v1/subsystems/{nqn}` | remove (its controllers are disconnected) |
//! | `PUT /v1/subsystems/{nqn}/namespaces/{nsid}` | add or replace a namespace (body: backend, uuid, read_only) |
//! | `DELETE /v1/subsystems/{nqn}/namespaces/{nsid}` | remove a namespace (hosts get a namespace-changed event) |
//! | `PUT /v1/subsystems/{nqn}/hosts/{hostnqn}` | allow a host; an optional body sets its DH-HMAC-CHAP keys (`dhchap_key`, `dhchap_ctrl_key`, `dhchap_hash`, `dhchap_dhgroup`, and `key_id`, a label shown back) |
//! | `DELETE /v1/subsystems/{nqn}/hosts/{hostnqn}` | revoke a host and drop its keys (its controllers are disconnected) |
//! | `GET /v1/listeners`, `PUT/DELETE /v1/listeners/{addr}` | listeners (`rdma:ADDR:PORT` for NVMe/RDMA) |
//! | `GET /v1/controllers` | live controllers |
//! | `PUT /v1/copies/{id}` | arm a copy job (body: dest, source, region_bytes, rate_bytes_per_sec); same body again: its status; another body: 409 |
//! | `POST /v1/copies/{id}/start` | start an armed job (body: regions, null = all) |
//! | `GET /v1/copies/{id}`, `GET /v1/copies` | copy job status |
//! | `DELETE /v1/copies/{id}` | cancel if running, disarm the guard, forget |
//! | `POST /v1/devices/{id}/release` | drop trees of a grain pool device (body and answer: `{"roots": [...]}`, the answer listing those that existed); 409 `in_use` when a namespace has one open (nothing dropped), 409 `not_grain_pool`, 404 for an unknown device; a released snapshot tree stops sealing, a released live tree's epochs are forgotten |
//! | `POST /v1/devices/{id}/snapshots` | new trees sharing everything with live ones, sealing at `epoch` > 0 (body and answer `{"epoch": E, "trees": [{"live": L, "snapshot": S}]}`, committed before the answer); a still-sealing tree again is a retry; 409 `tree_exists`, 404 `unknown_tree` (live, with epoch 0; with E > 0 a live tree never exported is created empty), 409 `epoch_sealed` (E not above a sealed epoch of L), 400 `invalid` (S ≥ 2^32), 507 `no_space`; nothing is created on any error |
//! | `POST /v1/devices/{id}/seal` | seal snapshot trees (body and answer `{"snapshots": [...]}`, committed before the answer): writes to their live trees tagged at or below their epoch answer Reservation Conflict; one sealed earlier since the target started is a retry; 409 `not_sealing` (nothing sealed), 507 `no_space` (no metadata page for the floor); the live trees' floors are kept in the pool across a restart, the sealing state is not |
//! | `POST /v1/devices/{id}/rollback` | live trees take their snapshots' contents (body and answer `{"trees": [{"live": L, "snapshot": S}]}`, committed before the answer): L shares everything with S, its own grains are freed, S is unchanged and L's floor kept; an unknown L is created; the same request again changes nothing; 404 `unknown_tree` (S), 409 `sealing` (L has a snapshot sealing, or L or S is one), 400 `invalid` (L ≥ 2^32), 507 `no_space`; nothing changes on any error |
//!
//! The router is built from one table ([`routes`] lists it), so a test can
//! drive every route there is.
//!
//! DH-HMAC-CHAP secrets are write-only: views say `"configured": true`
//! and whether a controller key is set, never the secret.
//!
//! The device routes answer 409 `not_grain_pool` for a plain device and 404
//! `not_found` for an unknown one.
//!
//! Errors are `{"kind": …, "message": …}` with a 4xx status. Every change is
//! saved to the state directory before it is answered, except copy jobs,
//! which live in memory only (copier.rs).

use crate::auth::AdminTokens;
use crate::backend::thin::{ThinError, ThinPool};
use crate::backend::BackendError;
use crate::config::{AnaConfig, AnaState, NamespaceConfig, SubsystemConfig};
use crate::copier::CopyError;
use crate::daemon::ListenerControl;
use crate::peerlog::{peer_warn, PeerSites};
use crate::register::DeviceOffer;
use crate::target::{Target, TargetError};
use axum::extract::{ConnectInfo, FromRequestParts, Request, State};
use axum::handler::Handler;
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{on, MethodFilter, MethodRouter};
use axum::{Json, Router};
use nvpool_api::admin::{
    AnaStateBody, CopyRequest, CopyStatus, DhchapKeys, Identity, NamespaceBody, ReleaseRootsBody,
    RollbackBody, SealBody, SnapshotTreesBody, StartCopyBody,
};
use nvpool_api::serve::{Peer, ServerThread};
use nvpool_api::tls::ServerTls;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

#[derive(Debug, Clone)]
struct Api {
    target: Arc<Target>,
    listeners: ListenerControl,
    devices: Arc<[DeviceOffer]>,
}

/// Serves the admin API on `addr` (port 0 for any) from a thread of its
/// own, over https with `tls` when given (`--admin-tls-cert`,
/// `--admin-tls-key`).
pub fn start(
    addr: SocketAddr,
    tokens: AdminTokens,
    target: Arc<Target>,
    listeners: ListenerControl,
    tls: Option<ServerTls>,
    devices: Vec<DeviceOffer>,
) -> std::io::Result<ServerThread> {
    let api = Api {
        target,
        listeners,
        devices: devices.into(),
    };
    let app = router(api, tokens);
    ServerThread::start("nvpool-admin-api", addr, tls, app, || {})
}

/// One route of the admin API: a method, a path and its handler.
struct Route {
    method: Method,
    path: &'static str,
    handler: MethodRouter<Api>,
}

fn route<H, T>(method: Method, path: &'static str, handler: H) -> Route
where
    H: Handler<T, Api>,
    T: 'static,
{
    let filter = MethodFilter::try_from(method.clone()).expect("a method the router takes");
    Route {
        method,
        path,
        handler: on(filter, handler),
    }
}

/// Every route of the admin API. The router is built from this table and
/// nothing else, so [`routes`] (what tests drive) is every route there is.
fn table() -> Vec<Route> {
    use Method as M;
    vec![
        route(M::GET, "/v1/health", health),
        route(M::GET, "/v1/identity", identity),
        route(M::GET, "/v1/target", target_info),
        route(M::GET, "/v1/subsystems", list_subsystems),
        route(M::PUT, "/v1/subsystems/{nqn}", put_subsystem),
        route(M::GET, "/v1/subsystems/{nqn}", get_subsystem),
        route(M::DELETE, "/v1/subsystems/{nqn}", delete_subsystem),
        route(
            M::PUT,
            "/v1/subsystems/{nqn}/namespaces/{nsid}",
            put_namespace,
        ),
        route(
            M::DELETE,
            "/v1/subsystems/{nqn}/namespaces/{nsid}",
            delete_namespace,
        ),
        route(M::PUT, "/v1/subsystems/{nqn}/hosts/{host}", put_host),
        route(M::DELETE, "/v1/subsystems/{nqn}/hosts/{host}", delete_host),
        route(M::PUT, "/v1/subsystems/{nqn}/ana", put_ana),
        route(M::POST, "/v1/leases", post_leases),
        route(M::GET, "/v1/listeners", list_listeners),
        route(M::PUT, "/v1/listeners/{addr}", put_listener),
        route(M::DELETE, "/v1/listeners/{addr}", delete_listener),
        route(M::GET, "/v1/controllers", list_controllers),
        route(M::GET, "/v1/copies", list_copies),
        route(M::PUT, "/v1/copies/{id}", put_copy),
        route(M::GET, "/v1/copies/{id}", get_copy),
        route(M::DELETE, "/v1/copies/{id}", delete_copy),
        route(M::POST, "/v1/copies/{id}/start", start_copy),
        route(M::POST, "/v1/devices/{id}/release", release_roots),
        route(M::POST, "/v1/devices/{id}/snapshots", snapshot_trees),
        route(M::POST, "/v1/devices/{id}/seal", seal_snapshots),
        route(M::POST, "/v1/devices/{id}/rollback", rollback_trees),
    ]
}

/// (method, path) of every admin route, as the router is built from them;
/// path parameters are in braces (`/v1/copies/{id}`).
pub fn routes() -> Vec<(Method, &'static str)> {
    table().into_iter().map(|r| (r.method, r.path)).collect()
}

fn router(api: Api, tokens: AdminTokens) -> Router {
    let mut r = Router::new();
    for Route { path, handler, .. } in table() {
        // Several methods of one path merge into one route.
        r = r.route(path, handler);
    }
    r.method_not_allowed_fallback(|method: Method| async move {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!("this path does not take {method}"),
        )
    })
    .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint") })
    // Outermost, so it runs first for every route and the fallback:
    // nothing is parsed or looked up for a request without a token.
    .layer(axum::middleware::from_fn_with_state(tokens, require_token))
    .with_state(api)
}

/// Refused admin requests, rate-limited per peer address.
static REFUSED_LOG: PeerSites = PeerSites::new();

/// Lets a request through only with a valid bearer token.
async fn require_token(State(tokens): State<AdminTokens>, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| nvpool_api::httpd::bearer(v.as_bytes()));
    // The token file may be read again: a short blocking read, bounded by
    // ADMIN_TOKEN_RECHECK_MS, on the admin API's own thread.
    let ok = matches!(presented, Some(Some(p)) if tokens.check(p));
    if ok {
        return next.run(req).await;
    }
    let peer = req.extensions().get::<ConnectInfo<Peer>>().map(|c| c.0 .0);
    let why = match presented {
        None => "no Authorization header",
        Some(None) => "not a bearer token",
        Some(Some(_)) => "wrong token",
    };
    let path: String = req.uri().path().chars().take(128).collect();
    let method = req.method().clone();
    match peer {
        Some(p) => {
            peer_warn!(site = REFUSED_LOG.site(p.ip()); peer = %p, %method, path, why, "admin API request refused")
        }
        None => peer_warn!(%method, path, why, "admin API request refused"),
    }
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "the admin API needs Authorization: Bearer with a token of this target",
    )
    .into_response()
}

async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

async fn identity(State(api): State<Api>) -> Json<Identity> {
    Json(Identity {
        target_id: api.target.target_id(),
        identity: api.target.identity(),
    })
}

/// The error body of every failed request.
#[derive(Debug, Serialize)]
pub struct ApiError {
    #[serde(skip)]
    code: StatusCode,
    kind: &'static str,
    message: String,
}

impl ApiError {
    fn new(code: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            kind,
            message: message.into(),
        }
    }
    fn bad_request(m: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid", m)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.code, Json(&self)).into_response();
        if self.code == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

impl From<TargetError> for ApiError {
    fn from(e: TargetError) -> ApiError {
        let (code, kind) = match &e {
            TargetError::Invalid(_) | TargetError::Config(_) => {
                (StatusCode::BAD_REQUEST, "invalid")
            }
            TargetError::Backend(_) => (StatusCode::UNPROCESSABLE_ENTITY, "backend"),
            TargetError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            TargetError::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
            TargetError::Limit(_) => (StatusCode::CONFLICT, "limit"),
            TargetError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
        };
        ApiError::new(code, kind, format!("{e:#}"))
    }
}

impl From<CopyError> for ApiError {
    fn from(e: CopyError) -> ApiError {
        let (code, kind) = match &e {
            CopyError::Invalid(_) => (StatusCode::BAD_REQUEST, "invalid"),
            CopyError::Backend(_) => (StatusCode::UNPROCESSABLE_ENTITY, "backend"),
            CopyError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            CopyError::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
            CopyError::Limit(_) => (StatusCode::CONFLICT, "limit"),
        };
        ApiError::new(code, kind, format!("{e:#}"))
    }
}

impl From<BackendError> for ApiError {
    fn from(e: BackendError) -> ApiError {
        let (code, kind) = match &e {
            BackendError::RootInUse { .. } => (StatusCode::CONFLICT, "in_use"),
            _ => (StatusCode::UNPROCESSABLE_ENTITY, "backend"),
        };
        ApiError::new(code, kind, e.to_string())
    }
}

impl From<ThinError> for ApiError {
    fn from(e: ThinError) -> ApiError {
        let (code, kind) = match &e {
            ThinError::NoRoot(_) => (StatusCode::NOT_FOUND, "unknown_tree"),
            ThinError::RootExists(_) => (StatusCode::CONFLICT, "tree_exists"),
            ThinError::EpochSealed { .. } => (StatusCode::CONFLICT, "epoch_sealed"),
            ThinError::NotSealing(_) => (StatusCode::CONFLICT, "not_sealing"),
            ThinError::Sealing(_) => (StatusCode::CONFLICT, "sealing"),
            ThinError::RootId(_) => (StatusCode::BAD_REQUEST, "invalid"),
            ThinError::NoSpace => (StatusCode::INSUFFICIENT_STORAGE, "no_space"),
            _ => (StatusCode::UNPROCESSABLE_ENTITY, "backend"),
        };
        ApiError::new(code, kind, e.to_string())
    }
}

impl From<nvpool_api::httpd::Rejection> for ApiError {
    fn from(r: nvpool_api::httpd::Rejection) -> ApiError {
        ApiError::new(r.status, r.kind, r.message)
    }
}

/// Path parameters as axum's `Path`, whose rejections (a segment that is
/// not UTF-8 once percent-decoded) are the JSON error like every other 400.
struct Path<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;
    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        Ok(Path(nvpool_api::httpd::path(parts, state).await?))
    }
}

/// A JSON request body as `T`, by the control plane's rules
/// (`nvpool_api::httpd::json_body`): 415 without a JSON content
/// type, 400 for a body that does not parse, names a key twice, is an
/// array where an object belongs, or does not fit `T`.
struct JsonBody<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;
    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        match nvpool_api::httpd::json_body(req, state, false).await? {
            Some(v) => Ok(JsonBody(v)),
            None => Err(ApiError::bad_request("a JSON body is required")),
        }
    }
}

/// A JSON body that may be absent (an empty body gives None); a body
/// given is held to [`JsonBody`]'s rules.
struct OptionalJsonBody<T>(Option<T>);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequest<S>
    for OptionalJsonBody<T>
{
    type Rejection = ApiError;
    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        Ok(OptionalJsonBody(
            nvpool_api::httpd::json_body(req, state, true).await?,
        ))
    }
}

/// A host's DH-HMAC-CHAP settings as the API shows them: never the secrets.
#[derive(Debug, Serialize)]
struct HostAuthView {
    configured: bool,
    bidirectional: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    hash: Option<String>,
    dhgroup: String,
    /// The label given with the keys, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    key_id: Option<String>,
}

#[derive(Debug, Serialize)]
struct NamespaceView {
    nsid: u32,
    backend: String,
    description: String,
    uuid: String,
    size_bytes: u64,
    block_size: u32,
    read_only: bool,
    failed: bool,
}

#[derive(Debug, Serialize)]
struct SubsystemView {
    nqn: String,
    serial: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<String>,
    allow_any_host: bool,
    allowed_hosts: Vec<String>,
    /// Hosts that must authenticate, by NQN.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    host_auth: BTreeMap<String, HostAuthView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ana: Option<AnaView>,
    /// The label of the owner keys this target holds for the subsystem's
    /// volume (never the keys).
    #[serde(skip_serializing_if = "Option::is_none")]
    owner_key_id: Option<String>,
    namespaces: Vec<NamespaceView>,
}

/// The ANA settings as configured, and what hosts see now.
#[derive(Debug, Serialize)]
struct AnaView {
    #[serde(flatten)]
    config: AnaConfig,
    /// The state hosts see: the configured one, or inaccessible while a
    /// lease-gated serving state has no valid lease.
    effective_state: String,
    change_count: u64,
    /// Lease time left (null without a lease).
    lease_remaining_ms: Option<u64>,
}

fn view(t: &Target, s: &crate::target::Subsystem) -> SubsystemView {
    let now = t.now_ms();
    SubsystemView {
        nqn: s.nqn.clone(),
        serial: s.serial.clone(),
        model: s.model.clone(),
        ana: s.ana.as_ref().map(|a| {
            let (state, chgcnt) = t.check_ana(s).unwrap_or((a.effective(now), 0));
            AnaView {
                config: a.config,
                effective_state: state.name().to_owned(),
                change_count: chgcnt,
                lease_remaining_ms: a.lease_remaining_ms(now),
            }
        }),
        allow_any_host: s.allow_any_host,
        allowed_hosts: s.hosts.iter().cloned().collect(),
        owner_key_id: t.owner_keys(&s.nqn).and_then(|k| k.config.key_id),
        host_auth: s
            .host_keys
            .iter()
            .map(|(h, a)| {
                (
                    h.clone(),
                    HostAuthView {
                        configured: true,
                        bidirectional: a.policy.keys.ctrl.is_some(),
                        hash: a.policy.hash.map(|h| h.name().to_owned()),
                        dhgroup: a.policy.dhgroup.name().to_owned(),
                        key_id: a.config.key_id.clone(),
                    },
                )
            })
            .collect(),
        namespaces: s
            .namespaces
            .values()
            .map(|n| NamespaceView {
                nsid: n.nsid,
                backend: n.spec.clone(),
                description: n.backend.describe(),
                uuid: crate::config::format_uuid(&n.uuid),
                size_bytes: n.backend.size(),
                block_size: 1 << n.block_shift,
                read_only: n.read_only,
                failed: n.backend.failed(),
            })
            .collect(),
    }
}

#[derive(Debug, Serialize)]
struct ControllerView {
    cntlid: u16,
    subsystem: String,
    host: String,
    discovery: bool,
    kato_ms: u32,
    queues: Vec<u16>,
}

fn controllers(t: &Target) -> Vec<ControllerView> {
    t.controllers()
        .iter()
        .map(|c| ControllerView {
            cntlid: c.cntlid,
            subsystem: c.subsys_nqn.clone(),
            host: c.hostnqn.clone(),
            discovery: c.discovery,
            kato_ms: c.kato_ms(),
            queues: c.connected_queues(),
        })
        .collect()
}

async fn target_info(State(api): State<Api>) -> impl IntoResponse {
    Json(serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "listeners": api.target.listeners(),
        "rdma_listeners": api.target.rdma_listeners(),
        "subsystems": api.target.subsystems().values().map(|s| view(&api.target, s)).collect::<Vec<_>>(),
        "controllers": controllers(&api.target),
        "reactor_buffers": api.target.buffer_figures(),
    }))
}

async fn list_subsystems(State(api): State<Api>) -> impl IntoResponse {
    Json(
        api.target
            .subsystems()
            .values()
            .map(|s| view(&api.target, s))
            .collect::<Vec<_>>(),
    )
}

async fn get_subsystem(
    State(api): State<Api>,
    Path(nqn): Path<String>,
) -> Result<Json<SubsystemView>, ApiError> {
    api.target
        .subsystem(&nqn)
        .map(|s| Json(view(&api.target, &s)))
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("subsystem {nqn} not found"),
            )
        })
}

/// Body of `PUT /v1/subsystems/{nqn}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SubsystemBody {
    #[serde(default)]
    allowed_hosts: Vec<String>,
    #[serde(default)]
    allow_any_host: bool,
    #[serde(default)]
    host_keys: BTreeMap<String, DhchapKeys>,
    serial: Option<String>,
    model: Option<String>,
    ana: Option<AnaConfig>,
    #[serde(default)]
    namespaces: Vec<NamespaceConfig>,
}

/// Runs a blocking target change off the async runtime (it opens files and fsyncs).
async fn blocking<T: Send + 'static, E: Into<ApiError> + Send + 'static>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?
        .map_err(Into::into)
}

async fn put_subsystem(
    State(api): State<Api>,
    Path(nqn): Path<String>,
    JsonBody(b): JsonBody<SubsystemBody>,
) -> Result<Json<SubsystemView>, ApiError> {
    let cfg = SubsystemConfig {
        nqn: nqn.clone(),
        allowed_hosts: b.allowed_hosts,
        allow_any_host: b.allow_any_host,
        host_keys: b.host_keys,
        serial: b.serial,
        model: b.model,
        ana: b.ana,
        namespaces: b.namespaces,
    };
    let t = api.target.clone();
    blocking(move || t.put_subsystem(&cfg)).await?;
    get_subsystem(State(api), Path(nqn)).await
}

async fn delete_subsystem(
    State(api): State<Api>,
    Path(nqn): Path<String>,
) -> Result<StatusCode, ApiError> {
    let t = api.target.clone();
    blocking(move || t.remove_subsystem(&nqn)).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn put_namespace(
    State(api): State<Api>,
    Path((nqn, nsid)): Path<(String, String)>,
    JsonBody(b): JsonBody<NamespaceBody>,
) -> Result<Json<SubsystemView>, ApiError> {
    let nsid: u32 = nsid
        .parse()
        .map_err(|_| ApiError::bad_request(format!("namespace id {nsid:?} is not a number")))?;
    let nc = NamespaceConfig {
        nsid,
        backend: b.backend,
        uuid: b.uuid,
        read_only: b.read_only,
    };
    let t = api.target.clone();
    let n = nqn.clone();
    blocking(move || t.put_namespace(&n, &nc)).await?;
    get_subsystem(State(api), Path(nqn)).await
}

async fn delete_namespace(
    State(api): State<Api>,
    Path((nqn, nsid)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let nsid: u32 = nsid
        .parse()
        .map_err(|_| ApiError::bad_request(format!("namespace id {nsid:?} is not a number")))?;
    let t = api.target.clone();
    blocking(move || t.remove_namespace(&nqn, nsid)).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn put_host(
    State(api): State<Api>,
    Path((nqn, host)): Path<(String, String)>,
    OptionalJsonBody(keys): OptionalJsonBody<DhchapKeys>,
) -> Result<Json<SubsystemView>, ApiError> {
    let t = api.target.clone();
    let n = nqn.clone();
    blocking(move || t.allow_host_with_keys(&n, &host, keys.as_ref())).await?;
    get_subsystem(State(api), Path(nqn)).await
}

async fn delete_host(
    State(api): State<Api>,
    Path((nqn, host)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let t = api.target.clone();
    blocking(move || t.disallow_host(&nqn, &host)).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn put_ana(
    State(api): State<Api>,
    Path(nqn): Path<String>,
    JsonBody(b): JsonBody<AnaStateBody>,
) -> Result<Json<SubsystemView>, ApiError> {
    let state = AnaState::from_name(&b.state).ok_or_else(|| {
        ApiError::bad_request(format!(
            "unknown ANA state {:?} (optimized, non-optimized, inaccessible, persistent-loss, change)",
            b.state
        ))
    })?;
    let t = api.target.clone();
    let n = nqn.clone();
    // Activating or deactivating backends may take a while: off the runtime.
    blocking(move || t.set_ana_state_owning(&n, state, b.owner_keys.as_ref())).await?;
    get_subsystem(State(api), Path(nqn)).await
}

/// Body of `POST /v1/leases`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LeaseBody {
    nqns: Vec<String>,
    valid_ms: u64,
}

async fn post_leases(
    State(api): State<Api>,
    JsonBody(b): JsonBody<LeaseBody>,
) -> Result<Json<serde_json::Value>, ApiError> {
    use crate::limits::{LEASE_RENEW_NQNS_MAX, LEASE_VALID_MAX_MS};
    if b.valid_ms == 0 || b.valid_ms > LEASE_VALID_MAX_MS {
        return Err(ApiError::bad_request(format!(
            "valid_ms must be 1..={LEASE_VALID_MAX_MS}"
        )));
    }
    if b.nqns.len() > LEASE_RENEW_NQNS_MAX {
        return Err(ApiError::bad_request(format!(
            "at most {LEASE_RENEW_NQNS_MAX} NQNs per renewal"
        )));
    }
    let until = api.target.now_ms().saturating_add(b.valid_ms);
    let renewed = api.target.renew_leases(&b.nqns, until);
    Ok(Json(serde_json::json!({
        "renewed": renewed,
        "valid_ms": b.valid_ms,
    })))
}

/// Every listener: `ADDR:PORT` for NVMe/TCP, `rdma:ADDR:PORT` for NVMe/RDMA.
fn all_listeners(t: &Target) -> Vec<String> {
    let tcp = t.listeners().into_iter().map(|a| a.to_string());
    tcp.chain(t.rdma_listeners().into_iter().map(|a| format!("rdma:{a}")))
        .collect()
}

async fn list_listeners(State(api): State<Api>) -> impl IntoResponse {
    Json(all_listeners(&api.target))
}

fn parse_listen(a: &str) -> Result<crate::config::Listen, ApiError> {
    a.parse()
        .map_err(|_| ApiError::bad_request(format!("{a:?} is not [rdma:]ADDR:PORT")))
}

async fn put_listener(
    State(api): State<Api>,
    Path(addr): Path<String>,
) -> Result<Json<Vec<String>>, ApiError> {
    let a = parse_listen(&addr)?;
    let c = api.listeners.clone();
    tokio::task::spawn_blocking(move || c.add_listen(a))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?
        .map_err(|m| ApiError::new(StatusCode::CONFLICT, "listen", m))?;
    Ok(Json(all_listeners(&api.target)))
}

async fn delete_listener(
    State(api): State<Api>,
    Path(addr): Path<String>,
) -> Result<StatusCode, ApiError> {
    let a = parse_listen(&addr)?;
    let c = api.listeners.clone();
    tokio::task::spawn_blocking(move || c.remove_listen(a))
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?
        .map_err(|m| ApiError::new(StatusCode::NOT_FOUND, "not_found", m))?;
    Ok(StatusCode::NO_CONTENT)
}

async fn list_controllers(State(api): State<Api>) -> impl IntoResponse {
    Json(controllers(&api.target))
}

// ----- copy jobs -----

async fn put_copy(
    State(api): State<Api>,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<CopyRequest>,
) -> Result<Json<CopyStatus>, ApiError> {
    let t = api.target.clone();
    // Opens the destination file: off the runtime.
    Ok(Json(blocking(move || t.copies().arm(&id, b)).await?))
}

async fn start_copy(
    State(api): State<Api>,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<StartCopyBody>,
) -> Result<Json<CopyStatus>, ApiError> {
    Ok(Json(api.target.copies().start(&id, b.regions)?))
}

async fn get_copy(
    State(api): State<Api>,
    Path(id): Path<String>,
) -> Result<Json<CopyStatus>, ApiError> {
    api.target
        .copies()
        .status(&id)
        .map(Json)
        .ok_or_else(|| CopyError::NotFound(id).into())
}

async fn list_copies(State(api): State<Api>) -> impl IntoResponse {
    Json(api.target.copies().list())
}

async fn delete_copy(
    State(api): State<Api>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let t = api.target.clone();
    // Waits for the copier's current chunk write to end.
    blocking(move || t.copies().delete(&id)).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ----- devices -----

/// The grain pool offered as device `id`.
fn grain_pool(api: &Api, id: &str) -> Result<Arc<ThinPool>, ApiError> {
    let device = api.devices.iter().find(|d| d.id == id).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("device {id} not found"),
        )
    })?;
    device.pool().cloned().ok_or_else(|| {
        ApiError::new(
            StatusCode::CONFLICT,
            "not_grain_pool",
            format!(
                "device {id} ({}) is not a grain pool: its extents are byte ranges, with no trees",
                device.backend
            ),
        )
    })
}

/// Drops trees of a grain pool whose extents the control plane freed; see
/// [`ThinPool::release`].
async fn release_roots(
    State(api): State<Api>,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<ReleaseRootsBody>,
) -> Result<Json<ReleaseRootsBody>, ApiError> {
    let pool = grain_pool(&api, &id)?;
    // Frees grains and commits: device I/O, off the runtime.
    let roots = blocking(move || pool.release(&b.roots)).await?;
    Ok(Json(ReleaseRootsBody { roots }))
}

/// Takes snapshot (or clone) trees of a grain pool
/// ([`SnapshotTreesBody`] is the spec); see [`ThinPool::snapshot_trees`].
async fn snapshot_trees(
    State(api): State<Api>,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<SnapshotTreesBody>,
) -> Result<Json<SnapshotTreesBody>, ApiError> {
    let pool = grain_pool(&api, &id)?;
    let trees: Vec<(u64, u64)> = b.trees.iter().map(|t| (t.live, t.snapshot)).collect();
    let epoch = b.epoch;
    // Commits: device I/O, off the runtime.
    blocking(move || pool.snapshot_trees(epoch, &trees)).await?;
    Ok(Json(b))
}

/// Seals snapshot trees ([`SealBody`] is the spec); see [`ThinPool::seal`].
async fn seal_snapshots(
    State(api): State<Api>,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<SealBody>,
) -> Result<Json<SealBody>, ApiError> {
    let pool = grain_pool(&api, &id)?;
    let snapshots = b.snapshots.clone();
    blocking(move || pool.seal(&snapshots)).await?;
    Ok(Json(b))
}

/// Rolls live trees back to snapshots ([`RollbackBody`] is the spec); see
/// [`ThinPool::rollback`].
async fn rollback_trees(
    State(api): State<Api>,
    Path(id): Path<String>,
    JsonBody(b): JsonBody<RollbackBody>,
) -> Result<Json<RollbackBody>, ApiError> {
    let pool = grain_pool(&api, &id)?;
    let trees: Vec<(u64, u64)> = b.trees.iter().map(|t| (t.live, t.snapshot)).collect();
    // Frees grains and commits: device I/O, off the runtime.
    blocking(move || pool.rollback(&trees)).await?;
    Ok(Json(b))
}
