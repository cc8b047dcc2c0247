//! Registering with the control plane: the target offers its devices to the
//! pool and then proves it is alive.
//!
//! ```text
//!   start ── Settings::from_cli: URL, token, devices opened and measured ── error → exit 1
//!     │
//!   Running::start (listeners and admin API bound)
//!     │
//!   Registrar thread ─┬─ POST /v1/targets ── fails → log (rate-limited), back off, retry
//!                     └─ every HEARTBEAT_INTERVAL: PUT /v1/targets/{id}/heartbeat
//!                            404 → the control plane forgot us: register again
//! ```
//!
//! `--control-plane` may list several instances of the control plane;
//! every call (these, the owner-lease renewal, the copy following of
//! served volumes) goes through [`Endpoints::send`], which tries the next
//! on no connection, a timeout or a 503. Registration and lease renewal
//! converge, so they count as idempotent.
//!
//! The data path never waits on any of this (ARCHITECTURE D7, STYLE 4): a
//! control plane that is down, slow or refusing our token only produces
//! log lines; the target keeps serving the namespaces it has.
//!
//! A device is a whole file or block device; the control plane carves it
//! into extents and later exports each as a namespace with the backend
//! `BACKEND,offset=N,length=M`, which is why a device's own backend spec
//! may not carry an offset or a length. A grain pool (`thin:PATH`, design
//! thin-snapshots T1) is one too, whose extents are trees
//! (`thin:PATH,root=R,size=L`): the daemon holds it open for its lifetime,
//! and every heartbeat reports how much of it the trees take.

use crate::auth::AdminTokens;
use crate::backend::thin::ThinPool;
use crate::backend::{BackendError, BackendSpec};
use crate::daemon::Cli;
use crate::limits::{
    CONTROL_PLANE_FAILURE_LOG_INTERVAL_MS, CONTROL_PLANE_REQUEST_TIMEOUT_MS, HEARTBEAT_INTERVAL_MS,
    REGISTER_BACKOFF_MAX_MS, REGISTER_BACKOFF_MIN_MS,
};
use nvpool_api::client::{read_token_for, ClientError};
use nvpool_api::http::{Call, NoAnswer};
use nvpool_api::rest::{
    parse_endpoints, DeviceBody, DeviceUsageBody, HeartbeatBody, RegisterTargetBody, Secret,
};
use serde::Serialize;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use ureq::http::Method;

/// Identifier rules of the control plane (target and device IDs): short,
/// no `/`, so they fit in store keys and URL paths.
const ID_BYTES_MAX: usize = 64;
/// Label keys and values, as the control plane checks them.
const LABEL_BYTES_MAX: usize = 63;

/// Why registration could not be set up, or one request failed.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// A start-time option is unusable.
    #[error("{0}")]
    Usage(String),
    /// `--control-plane-cacert` (or the system bundle) is unusable.
    #[error(transparent)]
    Tls(#[from] nvpool_api::tls::TlsError),
    /// `--control-plane-token-file` is unusable, or a call could not be
    /// made at all.
    #[error(transparent)]
    Client(ClientError),
    #[error("--device {id}={backend}")]
    DeviceOpen {
        id: String,
        backend: String,
        #[source]
        source: BackendError,
    },
    #[error("cannot read the target identity from {path}")]
    Identity {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The request got no HTTP answer from any endpoint (refused, timed
    /// out, reset).
    #[error("cannot reach the control plane at {url}")]
    Unreachable {
        url: String,
        #[source]
        source: NoAnswer,
    },
    /// The control plane answered with an error status.
    #[error("the control plane refused {op} ({status} {kind}): {message}")]
    Refused {
        op: &'static str,
        status: u16,
        kind: String,
        message: String,
    },
}

impl RegisterError {
    /// The client's error, for the request `op`.
    fn of(op: &'static str, e: ClientError) -> RegisterError {
        match e {
            ClientError::Unreachable { url, source, .. } => {
                RegisterError::Unreachable { url, source }
            }
            ClientError::Api {
                status,
                kind,
                message,
                ..
            } => RegisterError::Refused {
                op,
                status,
                kind,
                message,
            },
            e => RegisterError::Client(e),
        }
    }

    /// The HTTP status of a refused request.
    pub fn status(&self) -> Option<u16> {
        match self {
            RegisterError::Refused { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// The control plane's base URLs, instances of one control plane in the
/// order given: each `http[s]://HOST[:PORT][/PREFIX]`, without a trailing
/// slash (https trusts `--control-plane-cacert`). Checked as
/// every client of the control plane checks them ([`parse_endpoints`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlPlaneUrl(Vec<String>);

impl ControlPlaneUrl {
    /// One URL or a comma-separated list.
    pub fn parse(list: &str) -> Result<ControlPlaneUrl, RegisterError> {
        parse_endpoints(list)
            .map(ControlPlaneUrl)
            .map_err(|reason| RegisterError::Usage(format!("--control-plane {list:?}: {reason}")))
    }

    pub fn urls(&self) -> &[String] {
        &self.0
    }

    /// Whether every URL names this machine, for the loopback warning.
    fn all_loopback(&self) -> bool {
        self.0.iter().all(|url| {
            let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
            let authority = rest.split('/').next().unwrap_or_default();
            let host = match authority.strip_prefix('[') {
                Some(v6) => v6.split(']').next().unwrap_or_default(),
                None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
            };
            is_loopback_host(host)
        })
    }
}

impl std::fmt::Display for ControlPlaneUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.join(","))
    }
}

/// A device offered to the pool, measured; the control plane's `POST
/// /v1/targets` body lists it as a [`DeviceBody`].
#[derive(Debug, Clone, Serialize)]
pub struct DeviceOffer {
    pub id: String,
    /// `file:PATH`, `ram:SIZE` (optionally with `block_size=`), or
    /// `thin:PATH[,grain=…]`.
    pub backend: String,
    pub capacity_bytes: u64,
    pub labels: BTreeMap<String, String>,
    /// A grain pool's, open for as long as the offer is held.
    #[serde(skip)]
    pool: Option<Arc<ThinPool>>,
}

impl DeviceOffer {
    /// Checks `id` and `backend`, opens the backend once to prove it can be
    /// served and measures it: a file's or block device's size (whole
    /// blocks), a RAM disk's, or a grain pool's data grains. A grain pool
    /// stays open; a blank device named as one is formatted first.
    pub fn probe(
        id: &str,
        backend: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<DeviceOffer, RegisterError> {
        check_id("--device", id)?;
        let usage =
            |reason: String| RegisterError::Usage(format!("--device {id}={backend}: {reason}"));
        let spec = BackendSpec::parse(backend).map_err(|e| usage(e.to_string()))?;
        if let BackendSpec::File { offset, length, .. } = &spec {
            if *offset != 0 || length.is_some() {
                return Err(usage(
                    "a device is a whole file or block device; the control plane carves \
                     extents of it, so leave out offset= and length="
                        .into(),
                ));
            }
        }
        if let BackendSpec::Volume { .. } | BackendSpec::Thin { .. } = &spec {
            return Err(usage(
                "a device is a whole file or block device or a grain pool (thin:PATH); a \
                 volume or a thin tree is served as a namespace, not offered"
                    .into(),
            ));
        }
        let open_failed = |source| RegisterError::DeviceOpen {
            id: id.to_owned(),
            backend: backend.to_owned(),
            source,
        };
        let mut pool = None;
        let capacity_bytes = match &spec {
            // Opening a RAM disk would allocate and zero all of it.
            BackendSpec::Ram { size, block_size } => {
                let bs = u64::from(block_size.unwrap_or(512));
                size / bs * bs
            }
            BackendSpec::GrainPool { path, grain_bytes } => {
                let (p, formatted) =
                    ThinPool::open_device(path, *grain_bytes).map_err(open_failed)?;
                if formatted {
                    tracing::info!(
                        device = id,
                        path,
                        grain_bytes = p.grain_bytes(),
                        capacity_bytes = p.capacity_bytes(),
                        "the device was blank: formatted it as a grain pool"
                    );
                }
                let bytes = p.capacity_bytes();
                pool = Some(p);
                bytes
            }
            BackendSpec::File { .. } | BackendSpec::Volume { .. } | BackendSpec::Thin { .. } => {
                spec.open().map_err(open_failed)?.size()
            }
        };
        Ok(DeviceOffer {
            id: id.to_owned(),
            backend: backend.to_owned(),
            capacity_bytes,
            labels,
            pool,
        })
    }

    /// Its grain pool, when it is one.
    pub fn pool(&self) -> Option<&Arc<ThinPool>> {
        self.pool.as_ref()
    }
}

/// Everything the registration thread sends and how often. Its `Debug`
/// shows no token.
#[derive(Clone)]
pub struct RegistrationConfig {
    pub control_plane: ControlPlaneUrl,
    /// Bearer token for registration and heartbeats.
    pub token: Option<String>,
    /// The admin API's tokens: the current one goes with every
    /// registration (the control plane presents it back on its calls), and
    /// a change of it (rotation) registers again, read before every
    /// heartbeat. None: the registration carries none.
    pub admin_tokens: Option<AdminTokens>,
    pub target_id: String,
    pub name: String,
    /// The NVMe/TCP address hosts connect to.
    pub addr: SocketAddr,
    /// The admin API the control plane programs.
    pub admin_addr: SocketAddr,
    /// The admin API serves https (`--admin-tls-cert`): the registration
    /// says so, and the control plane calls `https://admin_addr`.
    pub admin_tls: bool,
    /// The NVMe/RDMA address hosts may connect to instead of `addr`;
    /// `None`: this target serves NVMe/TCP only.
    pub rdma_addr: Option<SocketAddr>,
    /// Where the current NVMe/RDMA listeners are read before every
    /// heartbeat (the daemon's, which the admin API can change): when the
    /// address to advertise changes, the target registers again with it.
    /// None: `rdma_addr` stays as it is.
    pub rdma_listeners: Option<RdmaListeners>,
    /// `--advertise-rdma`, which wins over the listeners while there is one.
    pub advertise_rdma: Option<SocketAddr>,
    pub labels: BTreeMap<String, String>,
    pub devices: Vec<DeviceOffer>,
    /// Between heartbeats (tests shorten it).
    pub heartbeat_interval: Duration,
    /// First retry delay after a failed registration; doubles per failure.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// One HTTP request, connect to last byte.
    pub request_timeout: Duration,
    /// Whom an https control plane must prove it is: the CA certificates
    /// of `--control-plane-cacert`, else the system bundle.
    pub tls: ureq::tls::TlsConfig,
}

impl RegistrationConfig {
    /// A configuration with the production intervals.
    pub fn new(
        control_plane: ControlPlaneUrl,
        target_id: String,
        name: String,
        addr: SocketAddr,
        admin_addr: SocketAddr,
    ) -> RegistrationConfig {
        RegistrationConfig {
            control_plane,
            token: None,
            admin_tokens: None,
            target_id,
            name,
            addr,
            admin_addr,
            admin_tls: false,
            rdma_addr: None,
            rdma_listeners: None,
            advertise_rdma: None,
            labels: BTreeMap::new(),
            devices: Vec::new(),
            heartbeat_interval: Duration::from_millis(HEARTBEAT_INTERVAL_MS),
            backoff_min: Duration::from_millis(REGISTER_BACKOFF_MIN_MS),
            backoff_max: Duration::from_millis(REGISTER_BACKOFF_MAX_MS),
            request_timeout: Duration::from_millis(CONTROL_PLANE_REQUEST_TIMEOUT_MS),
            tls: nvpool_api::tls::client_tls_system(),
        }
    }

    /// The `PUT /v1/targets/{id}/heartbeat` body: every grain pool's
    /// usage, measured now.
    pub fn heartbeat_body(&self) -> HeartbeatBody {
        HeartbeatBody {
            devices: self
                .devices
                .iter()
                .filter_map(|d| {
                    d.pool().map(|p| DeviceUsageBody {
                        id: d.id.clone(),
                        used_bytes: p.used_bytes(),
                    })
                })
                .collect(),
        }
    }

    /// The `POST /v1/targets` body, advertising `rdma_addr` for NVMe/RDMA
    /// and giving `admin_token`.
    fn register_body(
        &self,
        rdma_addr: Option<SocketAddr>,
        admin_token: Option<Secret>,
    ) -> RegisterTargetBody {
        RegisterTargetBody {
            id: self.target_id.clone(),
            name: self.name.clone(),
            addr: self.addr,
            admin_addr: self.admin_addr,
            labels: self.labels.clone(),
            devices: self
                .devices
                .iter()
                .map(|d| DeviceBody {
                    id: d.id.clone(),
                    backend: d.backend.clone(),
                    capacity_bytes: d.capacity_bytes,
                    labels: d.labels.clone(),
                })
                .collect(),
            rdma_addr,
            admin_tls: self.admin_tls,
            admin_token,
        }
    }
}

impl std::fmt::Debug for RegistrationConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistrationConfig")
            .field("control_plane", &self.control_plane)
            .field("token", &self.token.as_ref().map(|_| ".."))
            .field("admin_tokens", &self.admin_tokens)
            .field("target_id", &self.target_id)
            .field("name", &self.name)
            .field("addr", &self.addr)
            .field("admin_addr", &self.admin_addr)
            .field("admin_tls", &self.admin_tls)
            .field("rdma_addr", &self.rdma_addr)
            .field("rdma_listeners", &self.rdma_listeners)
            .field("advertise_rdma", &self.advertise_rdma)
            .field("labels", &self.labels)
            .field("devices", &self.devices)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("backoff_min", &self.backoff_min)
            .field("backoff_max", &self.backoff_max)
            .field("request_timeout", &self.request_timeout)
            .field("tls", &self.tls)
            .finish()
    }
}

/// Registration options from the command line, checked before anything is
/// bound; the addresses are filled in by [`Settings::finish`] once the
/// listeners are up (port 0 resolves then). Its `Debug` shows no token.
#[derive(Clone)]
pub struct Settings {
    control_plane: ControlPlaneUrl,
    token: Option<String>,
    target_id: Option<String>,
    name: Option<String>,
    advertise: Option<SocketAddr>,
    advertise_rdma: Option<SocketAddr>,
    labels: BTreeMap<String, String>,
    devices: Vec<DeviceOffer>,
    tls: ureq::tls::TlsConfig,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("control_plane", &self.control_plane)
            .field("token", &self.token.as_ref().map(|_| ".."))
            .field("target_id", &self.target_id)
            .field("name", &self.name)
            .field("advertise", &self.advertise)
            .field("advertise_rdma", &self.advertise_rdma)
            .field("labels", &self.labels)
            .field("devices", &self.devices)
            .finish()
    }
}

impl Settings {
    /// The devices offered, grain pools open.
    pub fn devices(&self) -> &[DeviceOffer] {
        &self.devices
    }

    /// None without `--control-plane`. Opens every `--device` (a device that
    /// cannot be served is a start error, not a surprise at attach time).
    pub fn from_cli(
        cli: &Cli,
        admin_listen: Option<SocketAddr>,
    ) -> Result<Option<Settings>, RegisterError> {
        let Some(url) = cli.control_plane.as_deref() else {
            if let Some(d) = cli.device.first() {
                return Err(RegisterError::Usage(format!(
                    "--device {d}: devices are offered to a control plane; give --control-plane URL"
                )));
            }
            if let Some(d) = cli.device_label.first() {
                return Err(RegisterError::Usage(format!(
                    "--device-label {d}: needs --control-plane URL and --device"
                )));
            }
            return Ok(None);
        };
        let control_plane = ControlPlaneUrl::parse(url)?;
        if admin_listen.is_none() {
            return Err(RegisterError::Usage(
                "--control-plane needs the admin API (the control plane programs the target \
                 through it); drop --admin-listen off"
                    .into(),
            ));
        }
        let token = match &cli.control_plane_token_file {
            Some(p) => Some(
                read_token_for("--control-plane-token-file", p).map_err(RegisterError::Client)?,
            ),
            None => None,
        };
        let tls = nvpool_api::tls::client_tls_for(
            "--control-plane-cacert",
            cli.control_plane_cacert.as_deref(),
        )?;
        if let Some(id) = &cli.target_id {
            check_id("--target-id", id)?;
        }
        if let Some(n) = &cli.name {
            check_name(n)?;
        }
        let mut labels = BTreeMap::new();
        for l in &cli.label {
            let (k, v) = parse_label("--label", l)?;
            labels.insert(k, v);
        }
        let mut device_labels: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
        for dl in &cli.device_label {
            let (id, kv) = dl.split_once(':').ok_or_else(|| {
                RegisterError::Usage(format!("--device-label {dl:?}: expected ID:KEY=VALUE"))
            })?;
            if !cli
                .device
                .iter()
                .any(|d| d.split_once('=').is_some_and(|(i, _)| i == id))
            {
                return Err(RegisterError::Usage(format!(
                    "--device-label {dl}: there is no --device {id}"
                )));
            }
            let (k, v) = parse_label("--device-label", kv)?;
            device_labels.entry(id.to_owned()).or_default().insert(k, v);
        }
        let mut devices: Vec<DeviceOffer> = Vec::new();
        for d in &cli.device {
            let (id, backend) = d.split_once('=').ok_or_else(|| {
                RegisterError::Usage(format!("--device {d:?}: expected ID=BACKEND"))
            })?;
            if devices.iter().any(|o| o.id == id) {
                return Err(RegisterError::Usage(format!(
                    "--device {id} is given twice"
                )));
            }
            let labels = device_labels.remove(id).unwrap_or_default();
            devices.push(DeviceOffer::probe(id, backend, labels)?);
        }
        Ok(Some(Settings {
            control_plane,
            token,
            target_id: cli.target_id.clone(),
            name: cli.name.clone(),
            advertise: cli.advertise,
            advertise_rdma: cli.advertise_rdma,
            labels,
            devices,
            tls,
        }))
    }

    /// The full registration once the daemon runs. `configured` are the
    /// NVMe/TCP listen addresses as given (the first is advertised unless
    /// `--advertise` says otherwise), `bound` the ones actually bound, and
    /// `rdma_bound` the bound NVMe/RDMA listeners (the first is advertised
    /// unless `--advertise-rdma` says otherwise).
    pub fn finish(
        self,
        configured: &[SocketAddr],
        bound: &[SocketAddr],
        rdma_bound: &[SocketAddr],
        admin: Option<SocketAddr>,
        state_dir: Option<&Path>,
    ) -> Result<RegistrationConfig, RegisterError> {
        let usage = |m: String| RegisterError::Usage(m);
        let addr = match self.advertise {
            Some(a) => a,
            None => {
                let first = *configured
                    .first()
                    .ok_or_else(|| usage("no NVMe/TCP listener to advertise".into()))?;
                resolve_port(first, configured, bound)
            }
        };
        if addr.ip().is_unspecified() || addr.port() == 0 {
            return Err(usage(format!(
                "cannot advertise {addr} to hosts; give --advertise ADDR:PORT"
            )));
        }
        let rdma_addr = rdma_advertised(self.advertise_rdma, rdma_bound, addr)?;
        let mut admin_addr =
            admin.ok_or_else(|| usage("--control-plane needs the admin API".into()))?;
        if admin_addr.ip().is_unspecified() {
            // Listening everywhere: the control plane reaches it where hosts
            // reach the data path.
            admin_addr.set_ip(addr.ip());
        }
        let host = hostname();
        if admin_addr.ip().is_loopback() && !self.control_plane.all_loopback() {
            tracing::warn!(admin = %admin_addr, control_plane = %self.control_plane,
                "the admin API listens on loopback only; a remote control plane cannot program this target (use --admin-listen ADDR:PORT with --admin-tls-cert and --admin-tls-key)");
        }
        let target_id = match self.target_id {
            Some(id) => id,
            None => default_target_id(state_dir, &host, addr.port())?,
        };
        let mut labels = self.labels;
        labels
            .entry("host".into())
            .or_insert_with(|| label_safe(&host));
        let mut cfg = RegistrationConfig::new(
            self.control_plane,
            target_id,
            self.name.unwrap_or_else(|| host.clone()),
            addr,
            admin_addr,
        );
        cfg.token = self.token;
        cfg.rdma_addr = rdma_addr;
        cfg.advertise_rdma = self.advertise_rdma;
        cfg.labels = labels;
        cfg.devices = self.devices;
        cfg.tls = self.tls;
        Ok(cfg)
    }
}

/// Reads a target's bound NVMe/RDMA listeners.
#[derive(Clone)]
pub struct RdmaListeners(pub Arc<dyn Fn() -> Vec<SocketAddr> + Send + Sync>);

impl std::fmt::Debug for RdmaListeners {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RdmaListeners")
    }
}

/// The NVMe/RDMA address to advertise: `--advertise-rdma`, else the first
/// bound RDMA listener, where one listening on every address takes the IP
/// hosts reach the NVMe/TCP listener at (`tcp`). None without RDMA.
fn rdma_advertised(
    given: Option<SocketAddr>,
    rdma_bound: &[SocketAddr],
    tcp: SocketAddr,
) -> Result<Option<SocketAddr>, RegisterError> {
    let addr = match (given, rdma_bound.first()) {
        (Some(a), Some(_)) => a,
        (Some(a), None) => {
            return Err(RegisterError::Usage(format!(
                "--advertise-rdma {a}: this target has no NVMe/RDMA listener \
                 (--listen rdma:ADDR:PORT)"
            )));
        }
        (None, Some(&b)) => {
            let mut a = b;
            if a.ip().is_unspecified() {
                a.set_ip(tcp.ip());
            }
            a
        }
        (None, None) => return Ok(None),
    };
    if addr.ip().is_unspecified() || addr.port() == 0 {
        return Err(RegisterError::Usage(format!(
            "cannot advertise NVMe/RDMA at {addr} to hosts; give --advertise-rdma ADDR:PORT"
        )));
    }
    Ok(Some(addr))
}

/// A configured `ADDR:0` means "any port": find the port it was bound on.
fn resolve_port(first: SocketAddr, configured: &[SocketAddr], bound: &[SocketAddr]) -> SocketAddr {
    if first.port() != 0 {
        return first;
    }
    bound
        .iter()
        .find(|b| b.ip() == first.ip() && !configured.contains(b))
        .copied()
        .unwrap_or(first)
}

fn check_id(flag: &str, id: &str) -> Result<(), RegisterError> {
    let ok = !id.is_empty()
        && id.len() <= ID_BYTES_MAX
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(RegisterError::Usage(format!(
            "{flag} {id:?}: IDs are 1..={ID_BYTES_MAX} bytes of A-Z a-z 0-9 . _ : -"
        )))
    }
}

fn check_name(name: &str) -> Result<(), RegisterError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(RegisterError::Usage(format!(
            "--name {name:?}: names are 1..=128 bytes of A-Z a-z 0-9 . _ : -"
        )))
    }
}

fn parse_label(flag: &str, s: &str) -> Result<(String, String), RegisterError> {
    let bad = |why: &str| RegisterError::Usage(format!("{flag} {s:?}: {why}"));
    let (k, v) = s.split_once('=').ok_or_else(|| bad("expected KEY=VALUE"))?;
    let chars_ok = |t: &str, extra: &[u8]| {
        t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b) || extra.contains(&b))
    };
    if k.is_empty() || k.len() > LABEL_BYTES_MAX || !chars_ok(k, b"/") {
        return Err(bad(&format!(
            "keys are 1..={LABEL_BYTES_MAX} bytes of A-Z a-z 0-9 . _ - /"
        )));
    }
    if v.len() > LABEL_BYTES_MAX || !chars_ok(v, b"") {
        return Err(bad(&format!(
            "values are 0..={LABEL_BYTES_MAX} bytes of A-Z a-z 0-9 . _ -"
        )));
    }
    Ok((k.to_owned(), v.to_owned()))
}

/// This machine's host name ("localhost" when the kernel does not say).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// `s` with every character a label value or ID may not hold replaced by
/// `-`, cut to a label's length.
fn label_safe(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(LABEL_BYTES_MAX)
        .collect()
}

fn is_loopback_host(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The target ID when none is given: the persistent target identity (a
/// UUID in `STATE_DIR/identity`, the same one namespace UUIDs derive from),
/// so the ID survives restarts and address changes; without a state
/// directory, `HOSTNAME-PORT`.
pub fn default_target_id(
    state_dir: Option<&Path>,
    host: &str,
    port: u16,
) -> Result<String, RegisterError> {
    match state_dir {
        Some(dir) => {
            let path = dir.join("identity");
            let text =
                std::fs::read_to_string(&path).map_err(|source| RegisterError::Identity {
                    path: path.clone(),
                    source,
                })?;
            let id = text.trim().to_owned();
            check_id("target identity", &id)?;
            Ok(id)
        }
        None => {
            let mut id = label_safe(host);
            id.truncate(ID_BYTES_MAX - 6);
            Ok(format!("{id}-{port}"))
        }
    }
}

// ----- the client -----

/// The control plane's instances, called with this target's token.
#[derive(Debug)]
pub(crate) struct Client {
    api: nvpool_api::client::Client,
    cfg: RegistrationConfig,
}

impl Client {
    pub(crate) fn new(cfg: RegistrationConfig) -> Client {
        let api = nvpool_api::client::Client::with_timeout(
            cfg.control_plane.urls().to_vec(),
            cfg.token.clone(),
            cfg.tls.clone(),
            cfg.request_timeout,
            "the control plane",
        );
        Client { api, cfg }
    }

    /// Registers, advertising `rdma_addr` for NVMe/RDMA and giving
    /// `admin_token`.
    fn register(
        &self,
        rdma_addr: Option<SocketAddr>,
        admin_token: Option<Secret>,
    ) -> Result<(), RegisterError> {
        let body = self.cfg.register_body(rdma_addr, admin_token);
        // Registering twice registers once: safe on another instance.
        self.call(Method::POST, "/v1/targets", Some(&body), "registration")
    }

    pub(crate) fn target_id(&self) -> &str {
        &self.cfg.target_id
    }

    /// A converging call (registration, heartbeat), its answer drained.
    fn call<B: serde::Serialize>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        op: &'static str,
    ) -> Result<(), RegisterError> {
        let mut resp = self
            .api
            .request(Call::Idempotent, method, path, body, None)
            .map_err(|e| RegisterError::of(op, e))?;
        // Drain the body so the connection can be reused.
        let _ = resp.body_mut().read_to_vec();
        Ok(())
    }

    /// Any call, answered with its status and body (error statuses too);
    /// `Err` when no answer came. For callers that read bodies themselves
    /// (the volume engine's copy following, the owner lease). `call` says
    /// whether it may be replayed on another instance.
    pub(crate) fn call_raw(
        &self,
        call: Call,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
        timeout: Option<Duration>,
    ) -> Result<(u16, Vec<u8>), String> {
        let method = Method::from_bytes(method.as_bytes()).map_err(|e| e.to_string())?;
        self.api.raw(call, method, path, body, timeout)
    }

    fn heartbeat(&self) -> Result<(), RegisterError> {
        let path = format!("/v1/targets/{}/heartbeat", self.cfg.target_id);
        let body = self.cfg.heartbeat_body();
        self.call(Method::PUT, &path, Some(&body), "the heartbeat")
    }
}

// ----- the thread -----

/// What the registration thread has achieved so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegistrationStatus {
    /// The control plane knows this target (last registration or
    /// heartbeat succeeded).
    pub registered: bool,
    pub registrations: u64,
    pub heartbeats: u64,
    /// Failed requests since start.
    pub failures: u64,
    /// The latest failure, as logged.
    pub last_error: Option<String>,
}

/// Logs failures at most once per interval, with the count of the ones in
/// between (STYLE 11: a peer must not be able to flood the log).
#[derive(Debug)]
struct FailureLog {
    interval: Duration,
    last: Option<Instant>,
    suppressed: u64,
    in_a_row: u64,
}

impl FailureLog {
    fn failure(&mut self, what: &str, e: &RegisterError, text: &str) {
        self.in_a_row += 1;
        if self.last.is_some_and(|t| t.elapsed() < self.interval) {
            self.suppressed += 1;
            return;
        }
        self.last = Some(Instant::now());
        let suppressed = std::mem::take(&mut self.suppressed);
        // A refused token or an invalid registration needs an operator; an
        // unreachable or busy control plane fixes itself.
        match e.status() {
            Some(s) if (400..500).contains(&s) && ![404, 408, 429].contains(&s) => {
                tracing::error!(
                    error = text,
                    suppressed,
                    "control plane {what} failed; retrying"
                )
            }
            _ => tracing::warn!(
                error = text,
                suppressed,
                "control plane {what} failed; retrying"
            ),
        }
    }

    fn success(&mut self) {
        if self.in_a_row > 0 {
            tracing::info!(
                failed_attempts = self.in_a_row,
                "control plane reachable again"
            );
        }
        self.in_a_row = 0;
        self.last = None;
        self.suppressed = 0;
    }
}

/// The error with its causes, one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// The background thread that registers the target and sends heartbeats.
/// Stopping it (or dropping it) waits for a request in flight, at most
/// one request timeout.
#[derive(Debug)]
pub struct Registrar {
    stop: Option<SyncSender<()>>,
    thread: Option<JoinHandle<()>>,
    status: Arc<Mutex<RegistrationStatus>>,
}

impl Registrar {
    pub fn start(cfg: RegistrationConfig) -> std::io::Result<Registrar> {
        let (tx, rx) = mpsc::sync_channel::<()>(1);
        let status = Arc::new(Mutex::new(RegistrationStatus::default()));
        let shared = status.clone();
        tracing::info!(control_plane = %cfg.control_plane, target_id = %cfg.target_id,
            addr = %cfg.addr, rdma = ?cfg.rdma_addr, admin = %cfg.admin_addr, devices = cfg.devices.len(),
            "registering with the control plane");
        let thread = std::thread::Builder::new()
            .name("nvpool-register".into())
            .spawn(move || run(Client::new(cfg), &rx, &shared))?;
        Ok(Registrar {
            stop: Some(tx),
            thread: Some(thread),
            status,
        })
    }

    pub fn status(&self) -> RegistrationStatus {
        self.status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        // Dropping the sender wakes the thread from its wait.
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Registrar {
    fn drop(&mut self) {
        self.halt();
    }
}

fn update(status: &Mutex<RegistrationStatus>, f: impl FnOnce(&mut RegistrationStatus)) {
    f(&mut status.lock().unwrap_or_else(|p| p.into_inner()));
}

fn run(client: Client, stop: &mpsc::Receiver<()>, status: &Mutex<RegistrationStatus>) {
    let cfg = &client.cfg;
    let mut log = FailureLog {
        interval: Duration::from_millis(CONTROL_PLANE_FAILURE_LOG_INTERVAL_MS),
        last: None,
        suppressed: 0,
        in_a_row: 0,
    };
    // Waits drawn from [ceiling/2, ceiling], so a fleet restarted together
    // does not hammer a recovering control plane in lockstep.
    let mut backoff = nvpool_rt::Backoff::new(cfg.backoff_min, cfg.backoff_max);
    let mut registered = false;
    let mut rdma_addr = cfg.rdma_addr;
    let mut admin_token = cfg.admin_tokens.as_ref().map(AdminTokens::current);
    loop {
        if let Some(tokens) = &cfg.admin_tokens {
            // A rotated token (the token file's first line changed): the
            // control plane must call with the new one.
            let now = tokens.current();
            if admin_token.as_ref() != Some(&now) {
                tracing::info!(target_id = %cfg.target_id, "the admin API token changed; registering again");
                admin_token = Some(now);
                registered = false;
            }
        }
        if let Some(RdmaListeners(read)) = &cfg.rdma_listeners {
            // An RDMA listener added or removed at run time (admin API):
            // register again so hosts learn the new address.
            let now = rdma_advertised(cfg.advertise_rdma, &read(), cfg.addr)
                .ok()
                .flatten();
            if now != rdma_addr {
                tracing::info!(target_id = %cfg.target_id, rdma = ?now, "the NVMe/RDMA address changed; registering again");
                rdma_addr = now;
                registered = false;
            }
        }
        let result = if registered {
            client.heartbeat()
        } else {
            client.register(rdma_addr, admin_token.clone())
        };
        let wait = match result {
            Ok(()) => {
                if !registered {
                    tracing::info!(target_id = %cfg.target_id, "registered with the control plane");
                }
                update(status, |s| {
                    s.registered = true;
                    if registered {
                        s.heartbeats += 1;
                    } else {
                        s.registrations += 1;
                    }
                });
                registered = true;
                backoff.reset();
                log.success();
                cfg.heartbeat_interval
            }
            Err(e) if registered && e.status() == Some(404) => {
                // The control plane lost or removed our record.
                tracing::info!(target_id = %cfg.target_id, "the control plane does not know this target; registering again");
                registered = false;
                update(status, |s| s.registered = false);
                Duration::ZERO
            }
            Err(e) => {
                let text = chain(&e);
                log.failure(
                    if registered {
                        "heartbeat"
                    } else {
                        "registration"
                    },
                    &e,
                    &text,
                );
                update(status, |s| {
                    s.failures += 1;
                    s.registered = false;
                    s.last_error = Some(text);
                });
                if registered {
                    // Keep heartbeating at the usual pace: the control plane
                    // still has the registration.
                    cfg.heartbeat_interval
                } else {
                    backoff.next()
                }
            }
        };
        match stop.recv_timeout(wait) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let u = ControlPlaneUrl::parse("http://127.0.0.1:4430/").unwrap();
        assert_eq!(u.urls(), ["http://127.0.0.1:4430"]);
        assert!(u.all_loopback());
        let u = ControlPlaneUrl::parse("http://[::1]:4430,HTTP://localhost/api").unwrap();
        assert_eq!(u.urls(), ["http://[::1]:4430", "http://localhost/api"]);
        assert_eq!(u.to_string(), "http://[::1]:4430,http://localhost/api");
        assert!(u.all_loopback());
        let u = ControlPlaneUrl::parse("http://127.0.0.1:1,http://cp:4430").unwrap();
        assert!(!u.all_loopback());
        for bad in ["cp:4430", "ftp://cp", "http://", "http:///x", "http://a@b"] {
            assert!(ControlPlaneUrl::parse(bad).is_err(), "{bad}");
        }
        let e = ControlPlaneUrl::parse("ftp://cp").unwrap_err().to_string();
        assert!(e.starts_with("--control-plane \"ftp://cp\""), "{e}");
        assert!(ControlPlaneUrl::parse("https://cp:4430").is_ok());
    }

    #[test]
    fn labels_and_ids() {
        assert_eq!(
            parse_label("--label", "rack=r1").unwrap(),
            ("rack".into(), "r1".into())
        );
        assert!(parse_label("--label", "topology.x/rack=r-1").is_ok());
        assert!(parse_label("--label", "rack").is_err());
        assert!(parse_label("--label", "=x").is_err());
        assert!(parse_label("--label", "rack=a b").is_err());
        assert!(check_id("--device", "nvme0n1").is_ok());
        assert!(check_id("--device", "a/b").is_err());
        assert!(check_id("--device", "").is_err());
        assert_eq!(label_safe("h1.example com"), "h1.example-com");
        assert_eq!(default_target_id(None, "h1", 4420).unwrap(), "h1-4420");
    }

    #[test]
    fn devices_are_whole_and_measured() {
        let o = DeviceOffer::probe("r0", "ram:8M", BTreeMap::new()).unwrap();
        assert_eq!(o.capacity_bytes, 8 << 20);
        let e = DeviceOffer::probe("f0", "file:/x,offset=4096", BTreeMap::new()).unwrap_err();
        assert!(e.to_string().contains("whole file"), "{e}");
        let e =
            DeviceOffer::probe("f0", "file:/nonexistent/nvpool.img", BTreeMap::new()).unwrap_err();
        assert!(matches!(e, RegisterError::DeviceOpen { .. }), "{e}");
        assert!(DeviceOffer::probe("f0", "disk:/x", BTreeMap::new()).is_err());
    }

    #[test]
    fn port_zero_resolves_to_the_bound_port() {
        let c: Vec<SocketAddr> = vec![
            "127.0.0.1:0".parse().unwrap(),
            "127.0.0.1:8009".parse().unwrap(),
        ];
        let b: Vec<SocketAddr> = vec![
            "127.0.0.1:8009".parse().unwrap(),
            "127.0.0.1:40000".parse().unwrap(),
        ];
        assert_eq!(resolve_port(c[0], &c, &b), b[1]);
        assert_eq!(resolve_port(c[1], &c, &b), c[1]);
    }

    #[test]
    fn rdma_address_advertised() {
        let tcp: SocketAddr = "10.0.0.5:4420".parse().unwrap();
        let a = |s: &str| -> SocketAddr { s.parse().unwrap() };
        assert_eq!(rdma_advertised(None, &[], tcp).unwrap(), None);
        assert_eq!(
            rdma_advertised(None, &[a("192.168.7.5:4421"), a("0.0.0.0:4422")], tcp).unwrap(),
            Some(a("192.168.7.5:4421")),
            "the first listener, as bound"
        );
        assert_eq!(
            rdma_advertised(None, &[a("0.0.0.0:4421")], tcp).unwrap(),
            Some(a("10.0.0.5:4421")),
            "a wildcard listener takes the advertised TCP address's IP"
        );
        assert_eq!(
            rdma_advertised(None, &[a("[::]:4421")], tcp).unwrap(),
            Some(a("10.0.0.5:4421"))
        );
        assert_eq!(
            rdma_advertised(Some(a("172.16.0.5:4420")), &[a("0.0.0.0:4421")], tcp).unwrap(),
            Some(a("172.16.0.5:4420")),
            "--advertise-rdma wins"
        );
        for (given, bound) in [
            (Some(a("172.16.0.5:4420")), vec![]),
            (Some(a("0.0.0.0:4420")), vec![a("0.0.0.0:4421")]),
            (Some(a("172.16.0.5:0")), vec![a("0.0.0.0:4421")]),
        ] {
            let e = rdma_advertised(given, &bound, tcp).unwrap_err();
            assert!(
                matches!(&e, RegisterError::Usage(m) if m.contains("RDMA")),
                "{given:?} {bound:?}: {e}"
            );
        }
    }

    #[test]
    fn register_body_carries_rdma_and_admin_tls_only_when_present() {
        let body = |rdma_addr, admin_tls| {
            serde_json::to_value(RegisterTargetBody {
                id: "t".into(),
                name: "t".into(),
                addr: "10.0.0.5:4420".parse().unwrap(),
                admin_addr: "10.0.0.5:4480".parse().unwrap(),
                rdma_addr,
                admin_tls,
                labels: BTreeMap::new(),
                devices: Vec::new(),
                admin_token: None,
            })
            .unwrap()
        };
        assert!(body(None, false).get("rdma_addr").is_none());
        assert!(body(None, false).get("admin_token").is_none());
        assert_eq!(
            body(Some("10.0.0.5:4421".parse().unwrap()), false)["rdma_addr"],
            "10.0.0.5:4421"
        );
        // Plain HTTP says nothing (an older control plane refuses unknown
        // fields); https says so.
        assert!(body(None, false).get("admin_tls").is_none());
        assert_eq!(body(None, true)["admin_tls"], true);
        let url = ControlPlaneUrl::parse("http://127.0.0.1:4430").unwrap();
        let a: SocketAddr = "10.0.0.5:4420".parse().unwrap();
        let mut cfg = RegistrationConfig::new(url, "t".into(), "t".into(), a, a);
        assert!(!cfg.register_body(None, None).admin_tls);
        cfg.admin_tls = true;
        assert!(cfg.register_body(None, None).admin_tls);
    }

    #[test]
    fn the_registration_carries_the_admin_token_and_debug_shows_no_token() {
        let url = ControlPlaneUrl::parse("http://127.0.0.1:4430").unwrap();
        let a: SocketAddr = "10.0.0.5:4420".parse().unwrap();
        let mut cfg = RegistrationConfig::new(url, "t".into(), "t".into(), a, a);
        cfg.token = Some("control-plane-secret".into());
        let admin = Secret::new("the-admin-token-0123456789").unwrap();
        cfg.admin_tokens = Some(AdminTokens::fixed(vec![admin.clone()]));
        let dbg = format!("{cfg:?} {:?}", Client::new(cfg.clone()));
        assert!(!dbg.contains("control-plane-secret"), "{dbg}");
        assert!(!dbg.contains("the-admin-token"), "{dbg}");
        let body = serde_json::to_value(cfg.register_body(None, Some(admin))).unwrap();
        assert_eq!(body["admin_token"], "the-admin-token-0123456789");
    }
}
