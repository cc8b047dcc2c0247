//! Putting the target together: listeners, the acceptor, reactor threads,
//! the admin API, registration with the control plane, signals and clean
//! shutdown.

use crate::api;
use crate::auth::AdminTokens;
use crate::config::{
    Config, DEFAULT_ADMIN_LISTEN, DEFAULT_DISCOVERY_LISTEN, DEFAULT_LISTEN, DEFAULT_STATE_DIR,
};
use crate::limits;
use crate::peerlog::{peer_info, peer_warn};
use crate::reactor::{Reactor, ReactorHandle};
use crate::register::{self, DeviceOffer, Registrar};
use crate::ring::Ring;
use crate::target::Target;
use anyhow::Context;
use mio::net::TcpListener;
use mio::{Events, Interest, Poll, Token, Waker};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How the data path runs.
#[derive(Debug, Clone)]
pub struct StartOptions {
    /// NVMe/TCP listeners.
    pub listeners: Vec<SocketAddr>,
    /// NVMe/RDMA listeners (RDMA CM).
    pub rdma_listeners: Vec<SocketAddr>,
    /// Reactor threads; 0 = one per core.
    pub reactors: usize,
    /// Drive file backends through io_uring (sockets always use it).
    pub io_uring: bool,
    /// The admin API; None = none.
    pub admin: Option<AdminOptions>,
}

/// Where the admin API listens and the tokens it accepts.
#[derive(Debug, Clone)]
pub struct AdminOptions {
    pub listen: SocketAddr,
    pub tokens: AdminTokens,
    /// https with this certificate; None: plain HTTP.
    pub tls: Option<nvpool_api::tls::ServerTls>,
    /// The devices offered to the control plane (`--device`): the API
    /// releases trees of the grain pools among them.
    pub devices: Vec<DeviceOffer>,
}

enum AcceptorCmd {
    Add(SocketAddr, SyncSender<Result<SocketAddr, String>>),
    Remove(SocketAddr, SyncSender<Result<(), String>>),
}

/// Changes listeners of a running target (used by the admin API).
#[derive(Debug, Clone)]
pub struct ListenerControl {
    tx: SyncSender<AcceptorCmdBox>,
    waker: Arc<Waker>,
    /// The RDMA CM listener, or why RDMA is unavailable here.
    rdma: Result<crate::rdma::RdmaControl, String>,
}

struct AcceptorCmdBox(AcceptorCmd);

impl std::fmt::Debug for AcceptorCmdBox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AcceptorCmd")
    }
}

impl ListenerControl {
    pub fn add(&self, addr: SocketAddr) -> Result<SocketAddr, String> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(AcceptorCmd::Add(addr, tx))?;
        rx.recv_timeout(Duration::from_secs(5))
            .map_err(|_| "acceptor did not answer".to_string())?
    }

    /// Adds a listener of either transport.
    pub fn add_listen(&self, l: crate::config::Listen) -> Result<SocketAddr, String> {
        match l.transport {
            crate::config::Transport::Tcp => self.add(l.addr),
            crate::config::Transport::Rdma => self.rdma()?.add(l.addr),
        }
    }

    /// Removes a listener of either transport.
    pub fn remove_listen(&self, l: crate::config::Listen) -> Result<(), String> {
        match l.transport {
            crate::config::Transport::Tcp => self.remove(l.addr),
            crate::config::Transport::Rdma => self.rdma()?.remove(l.addr),
        }
    }

    fn rdma(&self) -> Result<&crate::rdma::RdmaControl, String> {
        self.rdma
            .as_ref()
            .map_err(|why| format!("RDMA is unavailable: {why}"))
    }

    pub fn remove(&self, addr: SocketAddr) -> Result<(), String> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(AcceptorCmd::Remove(addr, tx))?;
        rx.recv_timeout(Duration::from_secs(5))
            .map_err(|_| "acceptor did not answer".to_string())?
    }

    fn send(&self, c: AcceptorCmd) -> Result<(), String> {
        self.tx
            .try_send(AcceptorCmdBox(c))
            .map_err(|_| "acceptor busy or gone".to_string())?;
        let _ = self.waker.wake();
        Ok(())
    }
}

/// A running target data path.
#[derive(Debug)]
pub struct Running {
    pub target: Arc<Target>,
    reactors: Vec<JoinHandle<()>>,
    handles: Vec<ReactorHandle>,
    acceptor: Option<JoinHandle<()>>,
    rdma_listener: Option<crate::rdma::RdmaListener>,
    control: ListenerControl,
    api: Option<nvpool_api::serve::ServerThread>,
}

impl Running {
    /// Binds the listeners and starts acceptor, reactors and admin API.
    pub fn start(target: Arc<Target>, opts: &StartOptions) -> anyhow::Result<Running> {
        // The reactors' sockets need io_uring whatever the backends do:
        // fail at once, with the reason, where it is missing.
        Ring::new(8).context(
            "io_uring is unavailable (nvpool-target needs it, with multishot receive: \
             Linux 6.0 or later, io_uring not disabled by sysctl or a seccomp filter)",
        )?;
        let use_uring = opts.io_uring;
        let n = if opts.reactors == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            opts.reactors
        };
        let live = Arc::new(AtomicUsize::new(0));
        let mut handles = Vec::new();
        let mut reactors = Vec::new();
        for id in 0..n {
            let (r, h) = Reactor::new(id, target.clone(), live.clone(), use_uring)
                .context("starting a reactor")?;
            handles.push(h);
            reactors.push(
                std::thread::Builder::new()
                    .name(format!("nvpool-reactor-{id}"))
                    .spawn(move || r.run())?,
            );
        }
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), ACCEPT_WAKER)?);
        let (ctl_tx, ctl_rx) = mpsc::sync_channel(16);
        let rdma_listener = crate::rdma::start_listener(
            target.clone(),
            &opts.rdma_listeners,
            handles.clone(),
            live.clone(),
        )?;
        if let Err(why) = &rdma_listener {
            tracing::info!("NVMe/RDMA unavailable on this machine ({why}); serving NVMe/TCP only");
        }
        let control = ListenerControl {
            tx: ctl_tx,
            waker,
            rdma: rdma_listener
                .as_ref()
                .map(|l| l.control.clone())
                .map_err(Clone::clone),
        };
        let rdma_listener = rdma_listener.ok();
        let mut acc = Acceptor {
            poll,
            listeners: HashMap::new(),
            next_token: 1,
            reactors: handles.clone(),
            next_reactor: 0,
            live: live.clone(),
            target: target.clone(),
            ctl: ctl_rx,
            held: None,
        };
        for a in &opts.listeners {
            acc.bind(*a)
                .with_context(|| format!("cannot listen on {a}"))?;
        }
        acc.publish();
        let acceptor = std::thread::Builder::new()
            .name("nvpool-acceptor".into())
            .spawn(move || acc.run())?;
        let api = match &opts.admin {
            Some(a) => Some(
                api::start(
                    a.listen,
                    a.tokens.clone(),
                    target.clone(),
                    control.clone(),
                    a.tls.clone(),
                    a.devices.clone(),
                )
                .with_context(|| format!("cannot start the admin API on {}", a.listen))?,
            ),
            None => None,
        };
        tracing::info!(reactors = n, io_uring = use_uring, listeners = ?target.listeners(), rdma_listeners = ?target.rdma_listeners(), "nvpool-target ready");
        Ok(Running {
            target,
            reactors,
            handles,
            acceptor: Some(acceptor),
            rdma_listener,
            control,
            api,
        })
    }

    /// Addresses actually bound (port 0 resolved).
    pub fn listen_addrs(&self) -> Vec<SocketAddr> {
        self.target.listeners()
    }

    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.api.as_ref().map(|a| a.addr())
    }

    pub fn listener_control(&self) -> &ListenerControl {
        &self.control
    }

    /// Stops accepting, drains in-flight commands, flushes every backend.
    pub fn shutdown(mut self) {
        tracing::info!("shutting down: draining in-flight I/O");
        self.target.begin_shutdown();
        let _ = self.control.waker.wake();
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        if let Some(a) = self.rdma_listener.take() {
            a.join();
        }
        for h in &self.handles {
            h.wake();
        }
        for r in self.reactors.drain(..) {
            let _ = r.join();
        }
        if let Some(api) = self.api.take() {
            api.stop();
        }
        self.target.flush_all();
        tracing::info!("shutdown complete");
    }
}

const ACCEPT_WAKER: Token = Token(0);

struct Acceptor {
    poll: Poll,
    listeners: HashMap<Token, (SocketAddr, TcpListener)>,
    next_token: usize,
    reactors: Vec<ReactorHandle>,
    next_reactor: usize,
    live: Arc<AtomicUsize>,
    target: Arc<Target>,
    ctl: Receiver<AcceptorCmdBox>,
    /// A connection accepted when every reactor's queue was full, handed
    /// over before anything more is accepted.
    held: Option<std::net::TcpStream>,
}

impl Acceptor {
    fn bind(&mut self, addr: SocketAddr) -> std::io::Result<SocketAddr> {
        let mut l = TcpListener::bind(addr)?;
        // mio listens with a backlog of 128. Connections wait there while
        // the reactors' queues are full, so a burst of hosts connecting
        // at once needs room: Linux takes a second listen() as a new
        // backlog (and caps it at net.core.somaxconn).
        let backlog = i32::try_from(limits::LISTEN_BACKLOG).unwrap_or(i32::MAX);
        // SAFETY: listen(2) on a socket this listener owns; no memory is
        // passed.
        if unsafe { libc::listen(std::os::fd::AsRawFd::as_raw_fd(&l), backlog) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let bound = l.local_addr()?;
        if self.listeners.values().any(|(a, _)| *a == bound) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "already listening there",
            ));
        }
        let t = Token(self.next_token);
        self.next_token += 1;
        self.poll
            .registry()
            .register(&mut l, t, Interest::READABLE)?;
        tracing::info!(addr = %bound, "listening for NVMe/TCP");
        self.listeners.insert(t, (bound, l));
        Ok(bound)
    }

    fn publish(&self) {
        let mut v: Vec<SocketAddr> = self.listeners.values().map(|(a, _)| *a).collect();
        v.sort();
        self.target.set_listeners(v);
    }

    fn run(mut self) {
        let mut events = Events::with_capacity(64);
        while !self.target.shutting_down() {
            // While a connection waits for room in a reactor's queue, look
            // again soon; otherwise sleep until a listener or the waker fires.
            let wait = match self.held {
                Some(_) => Duration::from_millis(limits::ACCEPT_RETRY_MS),
                None => Duration::from_millis(500),
            };
            if let Err(e) = self.poll.poll(&mut events, Some(wait)) {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    tracing::error!(error = %e, "acceptor poll failed");
                }
                continue;
            }
            let mut ready = Vec::new();
            for ev in events.iter() {
                if ev.token() == ACCEPT_WAKER {
                    self.commands();
                } else {
                    ready.push(ev.token());
                }
            }
            if let Some(s) = self.held.take() {
                if let Err(back) = self.hand_off(s) {
                    self.held = Some(back);
                    continue;
                }
                // Readiness is edge-triggered: connections that queued up
                // while accepting was paused raised no new event, so every
                // listener is looked at.
                ready = self.listeners.keys().copied().collect();
            }
            for t in ready {
                if !self.accept_from(t) {
                    break;
                }
            }
        }
    }

    /// Accepts from listener `t` until it has nothing more (true), or until
    /// every reactor's hand-off queue is full (false): then the connection
    /// just accepted is held, and the rest stay in the kernel's listen
    /// backlog until there is room. Only the connection limit refuses.
    fn accept_from(&mut self, t: Token) -> bool {
        loop {
            let Some((_, l)) = self.listeners.get(&t) else {
                return true;
            };
            match l.accept() {
                Ok((s, peer)) => {
                    // mio hands out a nonblocking stream; reactors take std ones.
                    let s = std::net::TcpStream::from(std::os::fd::OwnedFd::from(s));
                    let max = self.target.connections_max();
                    if self.live.load(Ordering::Acquire) >= max {
                        peer_warn!(%peer, max, "connection limit reached; refusing connections");
                        continue;
                    }
                    self.live.fetch_add(1, Ordering::AcqRel);
                    if let Err(back) = self.hand_off(s) {
                        peer_info!(%peer, "every reactor's hand-off queue is full; connections wait in the listen backlog");
                        self.held = Some(back);
                        return false;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
                Err(e) => {
                    // EMFILE and the like, when peers open
                    // connections faster than they close.
                    peer_warn!(error = %e, "accept failed");
                    return true;
                }
            }
        }
    }

    /// Gives `s` to the next reactor with room in its queue, round-robin;
    /// `Err(s)` when every queue is full.
    fn hand_off(&mut self, s: std::net::TcpStream) -> Result<(), std::net::TcpStream> {
        let n = self.reactors.len();
        let start = self.next_reactor;
        let mut s = s;
        for k in 0..n {
            match self.reactors[(start + k) % n].adopt(s) {
                Ok(()) => {
                    self.next_reactor = (start + 1) % n;
                    return Ok(());
                }
                Err(back) => s = back,
            }
        }
        Err(s)
    }

    fn commands(&mut self) {
        while let Ok(AcceptorCmdBox(c)) = self.ctl.try_recv() {
            match c {
                AcceptorCmd::Add(a, reply) => {
                    let r = self
                        .bind(a)
                        .map_err(|e| format!("cannot listen on {a}: {e}"));
                    self.publish();
                    let _ = reply.send(r);
                }
                AcceptorCmd::Remove(a, reply) => {
                    let t = self
                        .listeners
                        .iter()
                        .find(|(_, (x, _))| *x == a)
                        .map(|(t, _)| *t);
                    let r = match t.and_then(|t| self.listeners.remove(&t)) {
                        Some((_, mut l)) => {
                            let _ = self.poll.registry().deregister(&mut l);
                            tracing::info!(addr = %a, "listener removed");
                            Ok(())
                        }
                        None => Err(format!("not listening on {a}")),
                    };
                    self.publish();
                    let _ = reply.send(r);
                }
            }
        }
    }
}

/// Command-line options of `nvpool-target`.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "nvpool-target",
    version,
    about = "Export local NVMe drives, files or RAM as NVMe/TCP namespaces",
    long_about = "nvpool-target exports block devices, files (or extents of them) and RAM disks \
as NVMe/TCP namespaces that a stock Linux host can use with `nvme discover` and `nvme connect`.\n\n\
Configure it with a TOML file (--config) and/or change it at run time through the admin API; \
run-time changes are saved under --state-dir and survive restarts.",
    after_help = "Example:\n  nvpool-target --listen 127.0.0.1:4420 --export nqn.2026-11.io.nvpool:disk1=file:/dev/nvme1n1 --allow-any-host\n  nvme discover -t tcp -a 127.0.0.1 -s 8009\n  nvme connect -t tcp -a 127.0.0.1 -s 4420 -n nqn.2026-11.io.nvpool:disk1"
)]
pub struct Cli {
    /// TOML configuration file (listeners, subsystems, namespaces, allowed hosts).
    #[arg(short, long, env = "NVPOOL_TARGET_CONFIG")]
    pub config: Option<PathBuf>,
    /// Directory for the saved running configuration and target identity.
    #[arg(long, env = "NVPOOL_TARGET_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Listen address (repeatable): ADDR:PORT for NVMe/TCP, rdma:ADDR:PORT for NVMe/RDMA (port 4420 by convention). Default 127.0.0.1:4420 and the discovery port 127.0.0.1:8009.
    #[arg(short, long = "listen", value_name = "[rdma:]ADDR:PORT")]
    pub listen: Vec<crate::config::Listen>,
    /// Admin API address (HTTP+JSON), or "off". Default 127.0.0.1:4480; an address other than loopback needs --admin-insecure-http.
    #[arg(long, value_name = "ADDR:PORT|off")]
    pub admin_listen: Option<String>,
    /// File of admin API bearer tokens, one per line; any line is accepted, the first is the one given to the control plane. Read again when it changes. Default: STATE_DIR/admin-token, created with a random token when missing; without a state directory, a random token in memory.
    #[arg(long, env = "NVPOOL_TARGET_ADMIN_TOKEN_FILE", value_name = "PATH")]
    pub admin_token_file: Option<PathBuf>,
    /// Let the admin API listen on an address other than loopback over plain HTTP, where its bearer token crosses the network in clear.
    #[arg(long)]
    pub admin_insecure_http: bool,
    /// Serve the admin API over https with this certificate chain (PEM, leaf first); needs --admin-tls-key.
    #[arg(long, value_name = "FILE", requires = "admin_tls_key")]
    pub admin_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --admin-tls-cert.
    #[arg(long, value_name = "FILE", requires = "admin_tls_cert")]
    pub admin_tls_key: Option<PathBuf>,
    /// Export a namespace: NQN=BACKEND, e.g. nqn.2026-11.io.nvpool:d1=file:/dev/sdb or ...=ram:1G (repeatable; NSIDs count up from 1 per NQN).
    #[arg(short, long = "export", value_name = "NQN=BACKEND")]
    pub export: Vec<String>,
    /// Host NQN allowed to connect to every --export subsystem (repeatable).
    #[arg(long = "allow-host", value_name = "HOSTNQN")]
    pub allow_host: Vec<String>,
    /// Let any host connect to the --export subsystems.
    #[arg(long)]
    pub allow_any_host: bool,
    /// Reactor threads (default: one per core).
    #[arg(long)]
    pub reactors: Option<usize>,
    /// Run backend I/O synchronously instead of through io_uring (sockets still use it).
    #[arg(long)]
    pub no_io_uring: bool,
    /// Microseconds a busy reactor watches its completion queue before it
    /// sleeps (0..=100; 0, the default, never): worth it only where the
    /// reactors have cores to themselves.
    #[arg(long, hide = true, default_value_t = crate::limits::REACTOR_SPIN_US_DEFAULT,
          value_parser = clap::value_parser!(u64).range(0..=crate::limits::REACTOR_SPIN_US_MAX))]
    pub reactor_spin_us: u64,
    /// Register with this control plane and heartbeat to it, e.g. https://10.0.0.5:4430; a comma-separated list names instances of one control plane, tried in turn.
    #[arg(long, env = "NVPOOL_CONTROL_PLANE", value_name = "URL")]
    pub control_plane: Option<String>,
    /// File holding the bearer token for the control plane (whitespace trimmed).
    #[arg(long, env = "NVPOOL_TARGET_TOKEN_FILE", value_name = "PATH")]
    pub control_plane_token_file: Option<PathBuf>,
    /// CA certificates (PEM) to trust for an https --control-plane, instead of the system's.
    #[arg(long, env = "NVPOOL_TARGET_CONTROL_PLANE_CACERT", value_name = "FILE")]
    pub control_plane_cacert: Option<PathBuf>,
    /// Offer a device to the pool: ID=BACKEND, e.g. d0=file:/dev/nvme1n1, or d0=thin:/dev/nvme1n1[,grain=16K|32K|64K] for a grain pool whose extents take space on first write (a blank device is formatted; one holding data is refused) (repeatable). The control plane exports extents of it; it is not exported by itself.
    #[arg(long = "device", value_name = "ID=BACKEND")]
    pub device: Vec<String>,
    /// Label a --device: ID:KEY=VALUE, e.g. d0:class=tlc (repeatable).
    #[arg(long = "device-label", value_name = "ID:KEY=VALUE")]
    pub device_label: Vec<String>,
    /// Label this target: KEY=VALUE, e.g. rack=r1 (repeatable; host=HOSTNAME unless given).
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub label: Vec<String>,
    /// Target ID in the control plane (default: the identity kept in --state-dir, else HOSTNAME-PORT).
    #[arg(long, value_name = "ID")]
    pub target_id: Option<String>,
    /// Human name in the control plane (default: the host name).
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// NVMe/TCP address hosts should connect to (default: the first --listen address).
    #[arg(long, value_name = "ADDR:PORT")]
    pub advertise: Option<SocketAddr>,
    /// NVMe/RDMA address hosts should connect to (default: the first rdma listener; one on every address takes the --advertise IP).
    #[arg(long, value_name = "ADDR:PORT")]
    pub advertise_rdma: Option<SocketAddr>,
    /// Log filter (RUST_LOG syntax), e.g. info or nvpool_target=debug.
    #[arg(long, default_value = "info", env = "NVPOOL_LOG")]
    pub log: String,
}

/// Resolves CLI options, config file and saved state into one configuration.
pub fn resolve_config(cli: &Cli) -> anyhow::Result<(Config, Option<PathBuf>)> {
    let file = match &cli.config {
        Some(p) => Some(Config::from_toml_file(p)?),
        None => None,
    };
    let state_dir = cli
        .state_dir
        .clone()
        .or_else(|| file.as_ref().and_then(|f| f.state_dir.clone()))
        .or_else(|| {
            // Only root gets the system default; others run without persistence unless told.
            // SAFETY: geteuid has no preconditions.
            (unsafe { libc::geteuid() } == 0 && cli.config.is_some())
                .then(|| PathBuf::from(DEFAULT_STATE_DIR))
        });
    let mut cfg = match &state_dir {
        Some(d) => Config::load_state(d)?.unwrap_or_default(),
        None => Config::default(),
    };
    if let Some(f) = &file {
        cfg.merge_from(f);
    }
    cfg.state_dir.clone_from(&state_dir);
    // --export shortcuts.
    let mut per_nqn: HashMap<String, u32> = HashMap::new();
    for e in &cli.export {
        let (nqn, backend) = e
            .split_once('=')
            .with_context(|| format!("--export {e:?}: expected NQN=BACKEND"))?;
        let nsid = per_nqn
            .entry(nqn.to_owned())
            .and_modify(|n| *n += 1)
            .or_insert(1);
        let sub = match cfg.subsystems.iter_mut().position(|s| s.nqn == nqn) {
            Some(i) => &mut cfg.subsystems[i],
            None => {
                cfg.subsystems.push(crate::config::SubsystemConfig {
                    nqn: nqn.to_owned(),
                    allowed_hosts: vec![],
                    allow_any_host: false,
                    host_keys: Default::default(),
                    serial: None,
                    model: None,
                    ana: None,
                    namespaces: vec![],
                });
                cfg.subsystems.last_mut().expect("just pushed")
            }
        };
        sub.allow_any_host |= cli.allow_any_host;
        for h in &cli.allow_host {
            if !sub.allowed_hosts.contains(h) {
                sub.allowed_hosts.push(h.clone());
            }
        }
        sub.namespaces.retain(|n| n.nsid != *nsid);
        sub.namespaces.push(crate::config::NamespaceConfig {
            nsid: *nsid,
            backend: backend.to_owned(),
            uuid: None,
            read_only: false,
        });
    }
    if !cli.listen.is_empty() {
        cfg.listeners = cli
            .listen
            .iter()
            .map(|l| crate::config::ListenerConfig {
                addr: l.addr,
                transport: l.transport,
            })
            .collect();
    } else if cfg.listeners.is_empty() {
        cfg.listeners = [DEFAULT_LISTEN, DEFAULT_DISCOVERY_LISTEN]
            .iter()
            .map(|a| crate::config::ListenerConfig {
                addr: a.parse().expect("valid default"),
                transport: crate::config::Transport::Tcp,
            })
            .collect();
    }
    match cli.admin_listen.as_deref() {
        Some("off") => cfg.admin_listen = None,
        Some(a) => {
            cfg.admin_listen = Some(
                a.parse()
                    .with_context(|| format!("--admin-listen {a:?} is not ADDR:PORT or off"))?,
            )
        }
        None if cfg.admin_listen.is_none() => {
            cfg.admin_listen = Some(DEFAULT_ADMIN_LISTEN.parse().expect("valid default"))
        }
        None => {}
    }
    if cli.reactors.is_some() {
        cfg.reactors = cli.reactors;
    }
    cfg.validate()?;
    if let Some(a) = cfg.admin_listen {
        let tls = cli.admin_tls_cert.is_some();
        check_admin_exposure(a, cli.admin_insecure_http || tls)?;
    }
    Ok((cfg, state_dir))
}

/// Over plain HTTP the admin API's bearer token is readable by anyone on
/// the path: without `--admin-tls-cert` it listens on loopback unless told
/// otherwise (`ok`: TLS, or `--admin-insecure-http`).
fn check_admin_exposure(listen: SocketAddr, ok: bool) -> anyhow::Result<()> {
    if listen.ip().is_loopback() || ok {
        return Ok(());
    }
    anyhow::bail!(
        "the admin API would listen on {listen} over plain HTTP, sending its bearer token in \
         clear; give --admin-tls-cert and --admin-tls-key, listen on loopback, or accept that \
         with --admin-insecure-http"
    )
}

/// The admin API's tokens: `--admin-token-file`, else the state
/// directory's `admin-token` (created when missing), else a random token in
/// memory. Logs where they are, never what they are.
pub fn admin_tokens(cli: &Cli, state_dir: Option<&std::path::Path>) -> anyhow::Result<AdminTokens> {
    let tokens = match (&cli.admin_token_file, state_dir) {
        (Some(f), _) => AdminTokens::from_file(f)?,
        (None, Some(d)) => AdminTokens::in_state_dir(d)?,
        (None, None) => AdminTokens::generated(),
    };
    match tokens.file() {
        Some(f) => tracing::info!(file = %f.display(), "admin API tokens"),
        None => tracing::info!(
            "admin API token generated in memory (no --state-dir or --admin-token-file): \
             only a control plane this target registers with can use the admin API"
        ),
    }
    Ok(tokens)
}

/// The exit status for an error of [`run`]: 2 when a TLS file given on the
/// command line is unusable (a usage error), else 1.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    let tls_file = e.chain().any(|c| {
        c.is::<nvpool_api::tls::TlsError>()
            || matches!(
                c.downcast_ref::<register::RegisterError>(),
                Some(register::RegisterError::Tls(_))
            )
    });
    if tls_file {
        2
    } else {
        1
    }
}

/// The whole daemon: configure, start, wait for SIGTERM/SIGINT, shut down.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    let (cfg, state_dir) = resolve_config(&cli)?;
    let admin_tls = match (&cli.admin_tls_cert, &cli.admin_tls_key) {
        (Some(cert), Some(key)) => Some(nvpool_api::tls::ServerTls::load_for(
            ("--admin-tls-cert", cert),
            ("--admin-tls-key", key),
        )?),
        _ => None,
    };
    // Checked (devices opened, token read) before anything is bound.
    let registration = register::Settings::from_cli(&cli, cfg.admin_listen)?;
    let target = Target::new(state_dir.clone())?;
    // Without a control plane: --target-id, else the persistent identity
    // (the registration's default too); with one, set again below.
    match (&cli.target_id, &state_dir) {
        (Some(id), _) => target.set_target_id(id.clone()),
        (None, Some(_)) => target.set_target_id(target.identity()),
        (None, None) => {}
    }
    target.apply_config(&cfg)?;
    target.set_reactor_spin_us(cli.reactor_spin_us);
    let of = |t: crate::config::Transport| -> Vec<SocketAddr> {
        cfg.listeners
            .iter()
            .filter(|l| l.transport == t)
            .map(|l| l.addr)
            .collect()
    };
    let admin = match cfg.admin_listen {
        Some(listen) => Some(AdminOptions {
            listen,
            tokens: admin_tokens(&cli, state_dir.as_deref())?,
            tls: admin_tls,
            devices: registration
                .as_ref()
                .map(|r| r.devices().to_vec())
                .unwrap_or_default(),
        }),
        None => None,
    };
    let opts = StartOptions {
        listeners: of(crate::config::Transport::Tcp),
        rdma_listeners: of(crate::config::Transport::Rdma),
        reactors: cfg.reactors.unwrap_or(0),
        io_uring: !cli.no_io_uring,
        admin,
    };
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ])?;
    let running = Running::start(target.clone(), &opts)?;
    if let Some(a) = running.admin_addr() {
        tracing::info!(addr = %a, "admin API listening");
    }
    let registrar = match registration {
        Some(settings) => {
            let configured = of(crate::config::Transport::Tcp);
            let started = settings
                .finish(
                    &configured,
                    &running.listen_addrs(),
                    &running.target.rdma_listeners(),
                    running.admin_addr(),
                    state_dir.as_deref(),
                )
                .map_err(anyhow::Error::from)
                .map(|mut rc| {
                    let t = target.clone();
                    rc.rdma_listeners = Some(crate::register::RdmaListeners(Arc::new(move || {
                        t.rdma_listeners()
                    })));
                    // The control plane calls the admin API with it, over
                    // https when the API serves it.
                    rc.admin_tokens = opts.admin.as_ref().map(|a| a.tokens.clone());
                    rc.admin_tls = opts.admin.as_ref().is_some_and(|a| a.tls.is_some());
                    rc
                })
                .and_then(|rc| {
                    // What it registers as is what it answers it is.
                    target.set_target_id(rc.target_id.clone());
                    // Volume namespaces open their engine as this target's
                    // owner host NQN, and owners renew their lease (C19).
                    target.set_volume_source(Arc::new(crate::served::ControlPlaneSource::new(
                        rc.clone(),
                        &target,
                    )));
                    let leases = crate::served::LeaseKeeper::start(rc.clone(), target.clone())?;
                    Ok((Registrar::start(rc)?, leases))
                });
            match started {
                Ok(r) => Some(r),
                Err(e) => {
                    running.shutdown();
                    return Err(e);
                }
            }
        }
        None => None,
    };
    if let Some(sig) = signals.forever().next() {
        tracing::info!(signal = sig, "signal received");
    }
    if let Some((r, leases)) = registrar {
        drop(leases);
        r.stop();
    }
    running.shutdown();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_admin_api_stays_on_loopback_unless_told() {
        let a = |s: &str| -> SocketAddr { s.parse().unwrap() };
        for ok in ["127.0.0.1:4480", "127.0.0.2:1", "[::1]:4480"] {
            assert!(check_admin_exposure(a(ok), false).is_ok(), "{ok}");
        }
        for exposed in [
            "0.0.0.0:4480",
            "10.0.0.5:4480",
            "[::]:4480",
            "[fd00::5]:4480",
        ] {
            let e = check_admin_exposure(a(exposed), false)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("--admin-insecure-http") && e.contains(exposed),
                "{e}"
            );
            assert!(check_admin_exposure(a(exposed), true).is_ok(), "{exposed}");
        }
    }
}
