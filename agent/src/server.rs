//! The agent process: serves every volume attached to this host over one
//! set of controllers, answers the CLI on a Unix socket, and serves again
//! after a restart what was served before.

use crate::api::{AttachBody, Attached, VolumeOut, VolumeStatsOut};
use crate::serve::{self, Served};
use crate::state::{self, Wanted};
use anyhow::Context;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use nvpool_api::rest::ErrorBody;
use nvpool_initiator::volume::Connections;
use nvpool_layout::Uuid;
use nvpool_rt::lock;
use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often volumes waiting to be served again are retried.
const RESTORE_RETRY: Duration = Duration::from_secs(2);

/// `nvpool-agent` (also `nvpool agent`).
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Where the socket, records and FUSE mountpoints live (default
    /// /run/nvpool for root).
    #[arg(long, env = "NVPOOL_RUN_DIR", value_name = "DIR")]
    pub run_dir: Option<std::path::PathBuf>,
    /// Also serve `/metrics` (Prometheus) and `/v1/stats` on this address,
    /// e.g. 127.0.0.1:9464: over https with `--metrics-tls-cert`, else
    /// plain HTTP, on loopback only unless `--metrics-insecure-http`.
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Certificate chain (PEM) the metrics listener serves https with.
    #[arg(long, value_name = "FILE", requires = "metrics_tls_key")]
    pub metrics_tls_cert: Option<std::path::PathBuf>,
    /// Its private key (PEM).
    #[arg(long, value_name = "FILE", requires = "metrics_tls_cert")]
    pub metrics_tls_key: Option<std::path::PathBuf>,
    /// Serve the metrics over plain HTTP on an address other than loopback.
    #[arg(long)]
    pub metrics_insecure_http: bool,
    /// This host's DH-HMAC-CHAP secrets, for targets that make the host
    /// authenticate (`nvpool host set-keys` gave them to the control
    /// plane). Read again for every volume served, so a rotated file is
    /// used from the next attach on.
    #[command(flatten)]
    pub dhchap: crate::dhchap::DhchapArgs,
    /// CA certificates (PEM) every volume's https control plane is
    /// trusted by, instead of the system's: `nvpool-agent --cacert`, or
    /// the CLI's global `--cacert` for `nvpool agent`.
    #[arg(skip)]
    pub cacert: Option<std::path::PathBuf>,
}

enum Slot {
    Serving(Box<Served>),
    /// To serve again (after a restart) once its control plane and
    /// targets answer; the last error says why not yet.
    Pending {
        wanted: Wanted,
        error: String,
    },
}

/// The agent's state, shared by the API handlers and the restore thread.
struct Agent {
    connections: Arc<Connections>,
    dhchap: crate::dhchap::DhchapArgs,
    /// Whom every volume's control plane must prove it is (`--cacert`).
    tls: ureq::tls::TlsConfig,
    volumes: Mutex<BTreeMap<Uuid, Slot>>,
    /// Attach, detach and restore run one at a time.
    ops: Mutex<()>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").finish_non_exhaustive()
    }
}

impl Agent {
    fn wanted(&self) -> Vec<Wanted> {
        lock(&self.volumes)
            .values()
            .map(|s| match s {
                Slot::Serving(v) => v.wanted.clone(),
                Slot::Pending { wanted, .. } => wanted.clone(),
            })
            .collect()
    }

    fn save(&self) {
        if let Err(e) = state::save_wanted(&self.wanted()) {
            tracing::error!(error = %format!("{e:#}"), "saving the list of served volumes failed");
        }
    }

    fn out(&self) -> Vec<VolumeOut> {
        lock(&self.volumes)
            .values()
            .map(|s| match s {
                Slot::Serving(v) => v.out(),
                Slot::Pending { wanted, error } => pending_out(wanted, error),
            })
            .collect()
    }

    fn stats(&self) -> Vec<VolumeStatsOut> {
        lock(&self.volumes)
            .values()
            .map(|s| match s {
                Slot::Serving(v) => v.stats_out(),
                Slot::Pending { wanted, .. } => {
                    VolumeStatsOut::new(wanted.uuid, wanted.name.clone(), "pending")
                }
            })
            .collect()
    }

    /// Serves `w` (blocking: connects, presents). The caller holds `ops`.
    fn open(&self, w: &Wanted) -> anyhow::Result<VolumeOut> {
        let keys = self
            .dhchap
            .keys()
            .context("this host's DH-HMAC-CHAP keys")?;
        let served = serve::open(w, &self.connections, &self.tls, keys)?;
        let out = served.out();
        lock(&self.volumes).insert(w.uuid, Slot::Serving(Box::new(served)));
        self.save();
        Ok(out)
    }

    /// Tries every volume waiting to be served again.
    fn restore_pending(&self) {
        let _ops = lock(&self.ops);
        let pending: Vec<Wanted> = lock(&self.volumes)
            .values()
            .filter_map(|s| match s {
                Slot::Pending { wanted, .. } => Some(wanted.clone()),
                Slot::Serving(_) => None,
            })
            .collect();
        for w in pending {
            match self.open(&w) {
                Ok(v) => tracing::info!(volume = %v.name, device = ?v.device, "served again"),
                Err(e) if serve::not_attached(&e) => {
                    tracing::warn!(volume = %w.uuid, error = %format!("{e:#}"),
                        "the volume is no longer attached to this host; not serving it again");
                    lock(&self.volumes).remove(&w.uuid);
                    self.save();
                }
                Err(e) => {
                    let error = format!("{e:#}");
                    tracing::warn!(volume = %w.uuid, %error, "cannot serve the volume yet; retrying");
                    if let Some(Slot::Pending { error: old, .. }) =
                        lock(&self.volumes).get_mut(&w.uuid)
                    {
                        *old = error;
                    }
                }
            }
        }
    }

    fn has_pending(&self) -> bool {
        lock(&self.volumes)
            .values()
            .any(|s| matches!(s, Slot::Pending { .. }))
    }
}

fn pending_out(w: &Wanted, error: &str) -> VolumeOut {
    VolumeOut {
        uuid: w.uuid,
        name: w.name.clone(),
        host_nqn: w.spec.host_nqn.clone(),
        frontend: w.spec.frontend,
        device: None,
        size_bytes: 0,
        state: "pending".into(),
        error: Some(error.to_owned()),
        pid: std::process::id(),
    }
}

/// An API error: a status and `nvpool-api`'s [`ErrorBody`] (`{kind,
/// message}`, no details).
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    body: ErrorBody,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            body: ErrorBody::new(kind, message),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body)).into_response()
    }
}

fn parse_uuid(s: &str) -> Result<Uuid, ApiError> {
    s.parse().map_err(|_| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid",
            format!("{s:?} is not a volume UUID"),
        )
    })
}

/// Runs blocking work off the runtime's thread.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            format!("the request's worker failed: {e}"),
        )
    })?
}

async fn list(State(a): State<Arc<Agent>>) -> Json<Vec<VolumeOut>> {
    Json(a.out())
}

async fn stats(State(a): State<Arc<Agent>>) -> Json<Vec<VolumeStatsOut>> {
    Json(a.stats())
}

async fn metrics(State(a): State<Arc<Agent>>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        crate::metrics::prometheus(&a.stats()),
    )
}

async fn attach(
    State(a): State<Arc<Agent>>,
    Path(uuid): Path<String>,
    req: axum::extract::Request,
) -> Result<Response, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    // The control plane's rules for a body (JSON content type, no key
    // twice, objects where the type has a struct).
    let mut spec: AttachBody = nvpool_api::httpd::json_body(req, &(), false)
        .await
        .map_err(|r| ApiError::new(r.status, r.kind, r.message))?
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid",
                "a JSON body is required",
            )
        })?;
    let r = blocking(move || {
        let _ops = lock(&a.ops);
        match lock(&a.volumes).get(&uuid) {
            Some(Slot::Serving(v)) => {
                return Ok((
                    StatusCode::OK,
                    Attached {
                        volume: v.out(),
                        started: false,
                    },
                ))
            }
            Some(Slot::Pending { .. }) | None => {}
        }
        spec.frontend = serve::frontend_choice(spec.frontend)
            .map_err(|e| ApiError::new(StatusCode::CONFLICT, "unavailable", format!("{e:#}")))?;
        let w = Wanted {
            uuid,
            name: String::new(),
            spec,
            index: None,
        };
        let volume = a.open(&w).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                "failed",
                format!("serving the volume failed: {e:#}"),
            )
        })?;
        Ok((
            StatusCode::CREATED,
            Attached {
                volume,
                started: true,
            },
        ))
    })
    .await?;
    Ok((r.0, Json(r.1)).into_response())
}

#[derive(Debug, serde::Deserialize)]
struct DetachQuery {
    #[serde(default)]
    force: bool,
}

async fn detach(
    State(a): State<Arc<Agent>>,
    Path(uuid): Path<String>,
    Query(q): Query<DetachQuery>,
) -> Result<Json<VolumeOut>, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    blocking(move || {
        let _ops = lock(&a.ops);
        let slot = lock(&a.volumes).remove(&uuid);
        let out = match slot {
            None => {
                return Err(ApiError::new(
                    StatusCode::NOT_FOUND,
                    "not_found",
                    format!("volume {uuid} is not served on this host"),
                ))
            }
            Some(Slot::Pending { wanted, error }) => pending_out(&wanted, &error),
            Some(Slot::Serving(v)) => {
                let out = v.out();
                if let Some(at) = serve::mounted_at(&v.record.device).filter(|_| !q.force) {
                    let device = v.record.device.display().to_string();
                    lock(&a.volumes).insert(uuid, Slot::Serving(v));
                    return Err(ApiError::new(
                        StatusCode::CONFLICT,
                        "busy",
                        format!(
                            "{device} is mounted at {at}; unmount it first (or detach --force)"
                        ),
                    ));
                }
                if let Err(e) = v.close() {
                    a.save();
                    return Err(ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "failed",
                        format!("{e:#}"),
                    ));
                }
                out
            }
        };
        a.save();
        Ok(Json(out))
    })
    .await
}

/// Answers 404 with the JSON error for anything else.
async fn unknown() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
}

/// Answers 405 with the JSON error for a method a path does not take.
async fn method_not_allowed(method: axum::http::Method) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("this path does not take {method}"),
    )
}

fn router(a: Arc<Agent>) -> Router {
    Router::new()
        .route("/v1/volumes", get(list))
        .route(
            "/v1/volumes/{uuid}",
            axum::routing::put(attach).delete(detach),
        )
        .route("/v1/stats", get(stats))
        .route("/metrics", get(metrics))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(unknown)
        .with_state(a)
}

fn metrics_router(a: Arc<Agent>) -> Router {
    Router::new()
        .route("/v1/stats", get(stats))
        .route("/metrics", get(metrics))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(unknown)
        .with_state(a)
}

/// A bad combination of options: `nvpool-agent` exits 2 on it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

/// The metrics listener's TLS, loaded, and the check that plain HTTP is
/// served beyond loopback only when asked for. Done before anything starts.
fn metrics_tls(args: &Args) -> anyhow::Result<Option<nvpool_api::tls::ServerTls>> {
    let tls = match (&args.metrics_tls_cert, &args.metrics_tls_key) {
        (Some(cert), Some(key)) => Some(nvpool_api::tls::ServerTls::load_for(
            ("--metrics-tls-cert", cert),
            ("--metrics-tls-key", key),
        )?),
        _ => None,
    };
    if let Some(addr) = args.metrics_listen {
        if tls.is_none() && !addr.ip().is_loopback() && !args.metrics_insecure_http {
            return Err(Usage(format!(
                "--metrics-listen {addr} would serve plain HTTP beyond loopback; give \
                 --metrics-tls-cert and --metrics-tls-key, listen on loopback, or accept that \
                 with --metrics-insecure-http"
            ))
            .into());
        }
    }
    Ok(tls)
}

/// Holds the run directory's lock: one agent per run directory.
fn take_lock(dir: &std::path::Path) -> anyhow::Result<std::fs::File> {
    let path = dir.join("agent.lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: flock on an open descriptor.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        anyhow::bail!(
            "another nvpool agent serves {} (its lock {} is held)",
            dir.display(),
            path.display()
        );
    }
    Ok(f)
}

/// The agent, until SIGTERM or SIGINT: then every volume is flushed and
/// its device torn down, and the list of volumes is kept for the next
/// start.
pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(d) = &args.run_dir {
        // Read through the environment by everything that finds the run
        // directory; set before any thread starts.
        std::env::set_var("NVPOOL_RUN_DIR", d);
    }
    // A CA file that cannot be used is a usage error, before anything runs.
    let tls = nvpool_api::tls::client_tls(args.cacert.as_deref())
        .map_err(crate::client::ClientError::Tls)?;
    let metrics_tls = metrics_tls(&args)?;
    let run = state::run_dir();
    std::fs::create_dir_all(run.join("volumes"))
        .with_context(|| format!("creating {}", run.display()))?;
    let _lock = take_lock(&run)?;
    let pid_file = run.join("agent.pid");
    std::fs::write(&pid_file, format!("{}\n", std::process::id()))
        .with_context(|| format!("writing {}", pid_file.display()))?;

    // What a killed predecessor left: devices on dead servers.
    for r in state::records() {
        tracing::info!(volume = %r.uuid, device = %r.device.display(), pid = r.pid,
            "clearing what the previous agent left");
        serve::cleanup_leftovers(&r);
    }
    // Unusable key files stop the agent here rather than at an attach.
    args.dhchap
        .keys()
        .context("this host's DH-HMAC-CHAP keys")?;
    let agent = Arc::new(Agent {
        connections: Connections::new(),
        dhchap: args.dhchap.clone(),
        tls,
        volumes: Mutex::new(BTreeMap::new()),
        ops: Mutex::new(()),
    });
    {
        let mut v = lock(&agent.volumes);
        for w in state::load_wanted()? {
            v.insert(
                w.uuid,
                Slot::Pending {
                    wanted: w,
                    error: "starting".into(),
                },
            );
        }
    }
    let restorer = {
        let a = agent.clone();
        std::thread::Builder::new()
            .name("nvpool-restore".into())
            .spawn(move || loop {
                if a.has_pending() {
                    a.restore_pending();
                }
                std::thread::sleep(RESTORE_RETRY);
            })
            .context("starting the restore thread")?
    };
    drop(restorer);

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let sock = state::socket_path();
    let _ = std::fs::remove_file(&sock);
    let listener = {
        let _g = rt.enter();
        tokio::net::UnixListener::bind(&sock)
            .with_context(|| format!("listening on {}", sock.display()))?
    };
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("restricting {}", sock.display()))?;
    let metrics_listener = match args.metrics_listen {
        Some(addr) => Some(
            rt.block_on(tokio::net::TcpListener::bind(addr))
                .with_context(|| format!("listening on {addr}"))?,
        ),
        None => None,
    };
    tracing::info!(socket = %sock.display(), pid = std::process::id(), "agent ready");

    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ])
    .context("signal handlers")?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let sig = signals.forever().next();
        tracing::info!(?sig, "stopping");
        let _ = stop_tx.send(());
    });
    let app = router(agent.clone());
    let metrics_app = metrics_router(agent.clone());
    rt.block_on(async move {
        if let Some(l) = metrics_listener {
            tokio::spawn(async move {
                // Serves until the runtime ends, like the agent.
                let stop = std::future::pending();
                let served = nvpool_api::serve::serve(l, metrics_tls.as_ref(), metrics_app, stop);
                if let Err(e) = served.await {
                    tracing::error!(error = %e, "the metrics listener failed");
                }
            });
        }
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stop_rx.await;
            })
            .await
    })
    .context("serving the API")?;
    let _ = std::fs::remove_file(&sock);
    shutdown(&agent);
    let _ = std::fs::remove_file(&pid_file);
    Ok(())
}

/// Stops every volume, keeping the list for the next start.
fn shutdown(a: &Agent) {
    let _ops = lock(&a.ops);
    let volumes = std::mem::take(&mut *lock(&a.volumes));
    for (uuid, slot) in volumes {
        if let Slot::Serving(v) = slot {
            if let Err(e) = v.close() {
                tracing::error!(volume = %uuid, error = %format!("{e:#}"), "stopping the volume failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// The API router on a loopback port of its own runtime's thread.
    fn serve_api() -> std::net::SocketAddr {
        let agent = Arc::new(Agent {
            connections: Connections::new(),
            dhchap: crate::dhchap::DhchapArgs::default(),
            tls: ureq::tls::TlsConfig::default(),
            volumes: Mutex::new(BTreeMap::new()),
            ops: Mutex::new(()),
        });
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let l = tokio::net::TcpListener::from_std(l).unwrap();
                let _ = axum::serve(l, router(agent)).await;
            });
        });
        addr
    }

    fn request(addr: std::net::SocketAddr, head: &str, body: &str) -> (u16, serde_json::Value) {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        write!(
            s,
            "{head}\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        let (h, b) = out.split_once("\r\n\r\n").unwrap();
        (h[9..12].parse().unwrap(), serde_json::from_str(b).unwrap())
    }

    #[test]
    fn wrong_methods_and_bodies_get_json_errors() {
        let addr = serve_api();
        let uuid = "00000001-0000-4000-8000-000000000000";
        let (status, v) = request(addr, "POST /v1/stats HTTP/1.1", "");
        assert_eq!((status, &v["kind"]), (405, &"method_not_allowed".into()));
        let (status, v) = request(addr, "GET /v1/nothing HTTP/1.1", "");
        assert_eq!((status, &v["kind"]), (404, &"not_found".into()));
        let body = r#"{"host_nqn": "nqn.2014-08.org.example:h", "frontend": "nbd", "endpoint": "http://127.0.0.1:1"}"#;
        let put = format!("PUT /v1/volumes/{uuid} HTTP/1.1");
        let (status, v) = request(addr, &put, body);
        assert_eq!(
            (status, &v["kind"]),
            (415, &"unsupported_media_type".into())
        );
        let json = format!("{put}\r\nContent-Type: application/json");
        let dup = r#"{"host_nqn": "a", "host_nqn": "b", "frontend": "nbd", "endpoint": "x"}"#;
        let (status, v) = request(addr, &json, dup);
        assert_eq!((status, &v["kind"]), (400, &"invalid".into()), "{v}");
        let (status, v) = request(addr, &json, r#"["a", "nbd", "x"]"#);
        assert_eq!((status, &v["kind"]), (400, &"invalid".into()), "{v}");
    }
}
