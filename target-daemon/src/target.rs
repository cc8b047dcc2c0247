//! The target's configuration as the data path sees it: subsystems, their
//! namespaces and host ACLs, live controllers, and listeners.
//!
//! Readers (every Connect, every I/O's namespace lookup through its
//! controller) take lock-free snapshots: subsystems are immutable values
//! behind `ArcSwap`, replaced whole on change. Writers (the admin API, start
//! up) serialise on one mutex, persist the new configuration, then publish
//! it and tell affected controllers (namespace-change events, or removal
//! when their host lost access).
//!
//! ANA (D15): a subsystem with an `ana` setting reports one ANA group whose
//! configured state lives in the snapshot (and in target.json); its change
//! counter and lease live in an [`AnaRuntime`] kept per NQN, shared by
//! every snapshot. Namespace backends are activated before their
//! subsystem starts serving I/O here and deactivated after it stopped.

use crate::backend::{Backend, BackendSpec, DeviceExtent, VolumeContext, VolumeSource};
use crate::bufpool::{BudgetTooSmall, BufFigures, BufStats};
use crate::config::{
    self, AnaConfig, AnaState, Config, ConfigError, DhchapKeys, NamespaceConfig, SubsystemConfig,
};
use crate::controller::Controller;
use crate::copier::Copies;
use crate::limits;
use arc_swap::ArcSwap;
use nvpool_rt::lock;
use nvpool_wire::dhchap::CtrlPolicy;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

/// One exported namespace.
#[derive(Debug)]
pub struct Namespace {
    pub nsid: u32,
    pub backend: Arc<dyn Backend>,
    /// The spec it was opened from (persisted); empty for backends handed in by code.
    pub spec: String,
    pub uuid: [u8; 16],
    pub nguid: [u8; 16],
    pub eui64: [u8; 8],
    /// log2 of the logical block size.
    pub block_shift: u8,
    pub blocks: u64,
    pub read_only: bool,
    /// The file range the backend's bytes are in (None for RAM), found once
    /// when it was opened: host writes are matched against armed copy
    /// guards by it.
    pub device: Option<DeviceExtent>,
}

/// One NVM subsystem: an NQN, its namespaces and who may connect.
#[derive(Debug, Clone)]
pub struct Subsystem {
    pub nqn: String,
    pub serial: String,
    /// Identify MN; None: "nvpool".
    pub model: Option<String>,
    pub allow_any_host: bool,
    pub hosts: BTreeSet<String>,
    /// DH-HMAC-CHAP settings of the hosts that must authenticate.
    pub host_keys: BTreeMap<String, HostAuth>,
    pub namespaces: BTreeMap<u32, Arc<Namespace>>,
    /// Set when the subsystem reports Asymmetric Namespace Access.
    pub ana: Option<SubsystemAna>,
}

/// One host's DH-HMAC-CHAP settings: as configured (what is saved) and
/// as the queues use them.
#[derive(Debug, Clone)]
pub struct HostAuth {
    pub config: DhchapKeys,
    pub policy: Arc<CtrlPolicy>,
}

impl HostAuth {
    pub fn new(config: &DhchapKeys) -> Result<HostAuth, ConfigError> {
        Ok(HostAuth {
            policy: Arc::new(config::policy(config)?),
            config: config.clone(),
        })
    }
}

/// The ANA group of one subsystem on this target (there is one, ANAGRPID
/// [`limits::ANA_GROUP_ID`], holding every namespace).
#[derive(Debug, Clone)]
pub struct SubsystemAna {
    /// As configured: the state, CNTLID range and whether a lease gates it.
    pub config: AnaConfig,
    /// Change counter and lease, shared by every snapshot of this NQN.
    pub runtime: Arc<AnaRuntime>,
}

impl SubsystemAna {
    /// The state hosts see at `now_ms`: the configured one, except that a
    /// serving state gated by an expired lease reads as inaccessible.
    pub fn effective(&self, now_ms: u64) -> AnaState {
        let s = self.config.state;
        if self.config.lease && s.is_serving() && now_ms >= self.runtime.lease_until_ms() {
            AnaState::Inaccessible
        } else {
            s
        }
    }

    /// Remaining lease time at `now_ms`; None when no lease gates the state.
    pub fn lease_remaining_ms(&self, now_ms: u64) -> Option<u64> {
        self.config
            .lease
            .then(|| self.runtime.lease_until_ms().saturating_sub(now_ms))
    }
}

/// ANA state of one subsystem NQN that outlives its snapshots.
#[derive(Debug)]
pub struct AnaRuntime {
    /// Until when (in [`Target::now_ms`] units) a lease-gated serving
    /// state holds; 0 (expired) until the first renewal.
    lease_until_ms: AtomicU64,
    /// Where the next CNTLID search of this subsystem's range starts.
    next_cntlid: AtomicU16,
    /// The effective state hosts were last told about, and the change count.
    seen: Mutex<AnaSeen>,
}

#[derive(Debug)]
struct AnaSeen {
    /// None before the first observation.
    state: Option<AnaState>,
    chgcnt: u64,
}

impl AnaRuntime {
    fn new() -> AnaRuntime {
        AnaRuntime {
            lease_until_ms: AtomicU64::new(0),
            next_cntlid: AtomicU16::new(0),
            seen: Mutex::new(AnaSeen {
                state: None,
                chgcnt: 0,
            }),
        }
    }

    pub fn lease_until_ms(&self) -> u64 {
        self.lease_until_ms.load(Ordering::Acquire)
    }

    /// Records `now` as the effective state; bumps the change count when it
    /// differs from the last one recorded. Returns the change count and
    /// whether the state changed (the first observation is not a change).
    fn observe(&self, now: AnaState) -> (u64, bool) {
        let mut seen = lock(&self.seen);
        let changed = seen.state.is_some_and(|s| s != now);
        if seen.state != Some(now) {
            seen.state = Some(now);
            seen.chgcnt += 1;
        }
        (seen.chgcnt, changed)
    }
}

impl Subsystem {
    pub fn host_allowed(&self, hostnqn: &str) -> bool {
        self.allow_any_host || self.hosts.contains(hostnqn)
    }

    /// True when namespaces serve I/O here as configured: always without
    /// ANA, else in the optimized and non-optimized states (a lease gates
    /// I/O, not backend activation).
    pub fn serving(&self) -> bool {
        self.ana
            .as_ref()
            .is_none_or(|a| a.config.state.is_serving())
    }

    /// The subsystem a discovery controller belongs to.
    pub fn discovery() -> Subsystem {
        Subsystem {
            nqn: nvpool_wire::DISCOVERY_NQN.into(),
            serial: "discovery".into(),
            model: None,
            allow_any_host: true,
            hosts: BTreeSet::new(),
            host_keys: BTreeMap::new(),
            namespaces: BTreeMap::new(),
            ana: None,
        }
    }

    fn to_config(&self) -> SubsystemConfig {
        SubsystemConfig {
            nqn: self.nqn.clone(),
            allowed_hosts: self.hosts.iter().cloned().collect(),
            allow_any_host: self.allow_any_host,
            host_keys: self
                .host_keys
                .iter()
                .map(|(h, a)| (h.clone(), a.config.clone()))
                .collect(),
            serial: Some(self.serial.clone()),
            model: self.model.clone(),
            ana: self.ana.as_ref().map(|a| a.config),
            namespaces: self
                .namespaces
                .values()
                .filter(|n| !n.spec.is_empty())
                .map(|n| NamespaceConfig {
                    nsid: n.nsid,
                    backend: n.spec.clone(),
                    uuid: Some(config::format_uuid(&n.uuid)),
                    read_only: n.read_only,
                })
                .collect(),
        }
    }
}

/// Why a change to the target was refused.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0} not found")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("limit reached: {0}")]
    Limit(String),
    /// A backend could not be activated: the change may succeed later.
    #[error("{0}")]
    Unavailable(String),
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    #[error(transparent)]
    Config(#[from] ConfigError),
}

#[derive(Debug, Default)]
struct Controllers {
    by_id: HashMap<u16, Arc<Controller>>,
    next_id: u16,
}

/// Shared state of one target daemon.
#[derive(Debug)]
pub struct Target {
    identity: [u8; 16],
    /// The ID the control plane knows this target by (`GET /v1/identity`);
    /// None until the daemon sets it.
    target_id: Mutex<Option<String>>,
    state_dir: Option<PathBuf>,
    subsystems: ArcSwap<BTreeMap<String, Arc<Subsystem>>>,
    write_lock: Mutex<()>,
    controllers: Mutex<Controllers>,
    listeners: Mutex<Vec<SocketAddr>>,
    rdma_listeners: Mutex<Vec<SocketAddr>>,
    genctr: AtomicU64,
    shutting_down: AtomicBool,
    epoch: Instant,
    /// Settings (admin_listen, reactors) carried through to target.json.
    base: Mutex<Config>,
    /// Copy jobs and the guards every host write consults.
    copies: Arc<Copies>,
    /// What volume namespaces share: the source that opens their volumes
    /// and the executor their I/O runs on.
    volumes: Arc<VolumeContext>,
    /// ANA change counters and leases by subsystem NQN.
    ana: Mutex<HashMap<String, Arc<AnaRuntime>>>,
    /// The DH-HMAC-CHAP keys of this target's owner host NQN, by served
    /// volume subsystem NQN (C19): the control plane hands them over with
    /// the serving state, and the volume engine opened for that subsystem
    /// authenticates to the volume's extents with them. In memory only: a
    /// restarted target serves again only once the control plane set the
    /// state again, and gives them again then. Never shown.
    owner_keys: Mutex<HashMap<String, HostAuth>>,
    /// The buffer budget of reactors started from now on (bytes).
    reactor_buf_budget: AtomicUsize,
    reactor_spin_us: AtomicU64,
    /// The handshake deadline of connections adopted from now on (ms).
    handshake_timeout_ms: AtomicU64,
    /// Connections alive at once, at most (`limits::CONNECTIONS_MAX`).
    connections_max: AtomicUsize,
    /// Every running reactor's buffer figures (a reactor that stopped
    /// leaves a dead entry, passed over and pruned).
    buffers: Mutex<Vec<Weak<BufStats>>>,
}

impl Target {
    /// A target with no subsystems. `state_dir` None: nothing is persisted
    /// (tests), and the identity is random.
    pub fn new(state_dir: Option<PathBuf>) -> Result<Arc<Target>, TargetError> {
        let identity = match &state_dir {
            Some(d) => load_or_create_identity(d)?,
            None => random_bytes(),
        };
        Ok(Arc::new(Target {
            identity,
            target_id: Mutex::new(None),
            state_dir,
            subsystems: ArcSwap::from_pointee(BTreeMap::new()),
            write_lock: Mutex::new(()),
            controllers: Mutex::new(Controllers {
                by_id: HashMap::new(),
                next_id: 1,
            }),
            listeners: Mutex::new(Vec::new()),
            rdma_listeners: Mutex::new(Vec::new()),
            genctr: AtomicU64::new(1),
            shutting_down: AtomicBool::new(false),
            epoch: Instant::now(),
            base: Mutex::new(Config::default()),
            copies: Arc::new(Copies::default()),
            volumes: VolumeContext::new(),
            ana: Mutex::new(HashMap::new()),
            owner_keys: Mutex::new(HashMap::new()),
            reactor_buf_budget: AtomicUsize::new(limits::REACTOR_BUF_BUDGET_BYTES),
            reactor_spin_us: AtomicU64::new(limits::REACTOR_SPIN_US_DEFAULT),
            handshake_timeout_ms: AtomicU64::new(limits::HANDSHAKE_TIMEOUT_MS),
            connections_max: AtomicUsize::new(limits::CONNECTIONS_MAX),
            buffers: Mutex::new(Vec::new()),
        }))
    }

    /// Applies a whole configuration at start (subsystems and namespaces);
    /// listeners are bound by the daemon.
    pub fn apply_config(&self, cfg: &Config) -> Result<(), TargetError> {
        cfg.validate()?;
        {
            let mut base = lock(&self.base);
            base.admin_listen = cfg.admin_listen;
            base.reactors = cfg.reactors;
            base.state_dir.clone_from(&cfg.state_dir);
            base.listeners.clone_from(&cfg.listeners);
        }
        for s in &cfg.subsystems {
            // A leased path serves only once its owner's control plane says
            // so again (it reconciles a target that registers): start it
            // inaccessible instead of opening its volumes without a lease.
            let mut s = s.clone();
            if let Some(a) = s.ana.as_mut().filter(|a| a.lease && a.state.is_serving()) {
                a.state = AnaState::Inaccessible;
            }
            let s = &s;
            match self.put_subsystem(s) {
                // A path that cannot serve now (its backends do not
                // activate: the pool is unreachable) still starts, as an
                // inaccessible one, so the daemon comes up and whoever
                // owns the state can set it again later.
                Err(TargetError::Unavailable(why))
                    if s.ana.is_some_and(|a| a.state.is_serving()) =>
                {
                    tracing::error!(nqn = %s.nqn, %why, "cannot serve: starting this path as inaccessible");
                    let mut fallback = s.clone();
                    if let Some(a) = &mut fallback.ana {
                        a.state = AnaState::Inaccessible;
                    }
                    self.put_subsystem(&fallback)?;
                }
                // Without ANA there is no state to fall back to: the daemon
                // starts without this subsystem rather than not at all.
                Err(TargetError::Unavailable(why)) => {
                    tracing::error!(nqn = %s.nqn, %why, "cannot serve: subsystem left out");
                }
                r => r?,
            }
        }
        Ok(())
    }

    /// The persistent random identity (`STATE_DIR/identity`; random per
    /// run without a state directory), as a UUID.
    pub fn identity(&self) -> String {
        config::format_uuid(&self.identity)
    }

    /// Sets the ID the control plane knows this target by: what it
    /// registers as, which the control plane checks before it changes
    /// anything here (`GET /v1/identity`).
    pub fn set_target_id(&self, id: impl Into<String>) {
        *lock(&self.target_id) = Some(id.into());
    }

    pub fn target_id(&self) -> Option<String> {
        lock(&self.target_id).clone()
    }

    /// Milliseconds since the target started (the data path's clock).
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Sets the buffer budget of each reactor started afterwards (D18);
    /// `limits::REACTOR_BUF_BUDGET_BYTES` unless changed. Smaller budgets
    /// (tests) make commands wait for buffers sooner; one pool buffer is the
    /// least that works.
    pub fn set_reactor_buffer_budget(&self, bytes: usize) -> Result<(), BudgetTooSmall> {
        if bytes < limits::POOL_BUF_BYTES {
            return Err(BudgetTooSmall(bytes));
        }
        self.reactor_buf_budget.store(bytes, Ordering::Relaxed);
        Ok(())
    }

    pub fn reactor_buffer_budget(&self) -> usize {
        self.reactor_buf_budget.load(Ordering::Relaxed)
    }

    /// Sets how long a busy reactor started afterwards spins on its
    /// completion queue before it sleeps (D2), at most
    /// `limits::REACTOR_SPIN_US_MAX` (longer is cut to that).
    pub fn set_reactor_spin_us(&self, us: u64) {
        self.reactor_spin_us
            .store(us.min(limits::REACTOR_SPIN_US_MAX), Ordering::Relaxed);
    }

    pub fn reactor_spin_us(&self) -> u64 {
        self.reactor_spin_us.load(Ordering::Relaxed)
    }

    /// Sets the handshake deadline of connections from now on
    /// (`limits::HANDSHAKE_TIMEOUT_MS` unless changed; tests shorten it).
    pub fn set_handshake_timeout_ms(&self, ms: u64) {
        self.handshake_timeout_ms
            .store(ms.max(1), Ordering::Relaxed);
    }

    pub fn handshake_timeout_ms(&self) -> u64 {
        self.handshake_timeout_ms.load(Ordering::Relaxed)
    }

    /// Lowers the number of connections alive at once
    /// (`limits::CONNECTIONS_MAX` unless changed; never above it).
    pub fn set_connections_max(&self, n: usize) {
        self.connections_max
            .store(n.clamp(1, limits::CONNECTIONS_MAX), Ordering::Relaxed);
    }

    pub fn connections_max(&self) -> usize {
        self.connections_max.load(Ordering::Relaxed)
    }

    /// A reactor publishes its buffer figures.
    pub fn register_buffers(&self, stats: &Arc<BufStats>) {
        let mut v = lock(&self.buffers);
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(stats));
    }

    /// The buffer figures of every running reactor, by reactor id.
    pub fn buffer_figures(&self) -> Vec<BufFigures> {
        let mut v: Vec<BufFigures> = lock(&self.buffers)
            .iter()
            .filter_map(Weak::upgrade)
            .map(|s| s.figures())
            .collect();
        v.sort_by_key(|f| f.reactor);
        v
    }

    pub fn subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        self.subsystems.load().get(nqn).cloned()
    }

    pub fn subsystems(&self) -> Arc<BTreeMap<String, Arc<Subsystem>>> {
        self.subsystems.load_full()
    }

    pub fn discovery_genctr(&self) -> u64 {
        self.genctr.load(Ordering::Acquire)
    }

    pub fn set_listeners(&self, addrs: Vec<SocketAddr>) {
        *lock(&self.listeners) = addrs;
        self.discovery_changed();
    }

    pub fn listeners(&self) -> Vec<SocketAddr> {
        lock(&self.listeners).clone()
    }

    /// The NVMe/RDMA listeners (set by the RDMA CM listener thread).
    pub fn set_rdma_listeners(&self, addrs: Vec<SocketAddr>) {
        *lock(&self.rdma_listeners) = addrs;
        self.discovery_changed();
    }

    pub fn rdma_listeners(&self) -> Vec<SocketAddr> {
        lock(&self.rdma_listeners).clone()
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Release);
        self.copies.cancel_all();
    }

    /// Copy jobs of which this target is the destination.
    pub fn copies(&self) -> &Arc<Copies> {
        &self.copies
    }

    /// Installs what opens the pooled volumes of `volume:` namespaces when
    /// they are activated (the daemon's link to the control plane; tests
    /// install their own). Namespaces already active keep their volumes.
    pub fn set_volume_source(&self, source: Arc<dyn VolumeSource>) {
        self.volumes.set_source(source);
    }

    /// The volume namespaces' shared context (to build a
    /// [`crate::backend::VolumeBackend`] by hand).
    pub fn volumes(&self) -> &Arc<VolumeContext> {
        &self.volumes
    }

    pub fn shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }

    /// The running configuration, as saved in target.json.
    pub fn running_config(&self) -> Config {
        let mut c = lock(&self.base).clone();
        c.subsystems = self
            .subsystems
            .load()
            .values()
            .map(|s| s.to_config())
            .collect();
        c
    }

    // ----- changes -----

    /// Creates a subsystem or replaces its settings, hosts and namespaces.
    pub fn put_subsystem(&self, cfg: &SubsystemConfig) -> Result<(), TargetError> {
        let _w = lock(&self.write_lock);
        let wrap = Config {
            subsystems: vec![cfg.clone()],
            ..Default::default()
        };
        wrap.validate()?;
        let current = self.subsystems.load_full();
        if !current.contains_key(&cfg.nqn) && current.len() >= limits::SUBSYSTEMS_MAX {
            return Err(TargetError::Limit(format!(
                "at most {} subsystems",
                limits::SUBSYSTEMS_MAX
            )));
        }
        if cfg.allowed_hosts.len() > limits::HOSTS_PER_SUBSYS_MAX {
            return Err(TargetError::Limit(format!(
                "at most {} hosts per subsystem",
                limits::HOSTS_PER_SUBSYS_MAX
            )));
        }
        if cfg.host_keys.len() > limits::HOSTS_PER_SUBSYS_MAX {
            return Err(TargetError::Limit(format!(
                "at most {} hosts with keys per subsystem",
                limits::HOSTS_PER_SUBSYS_MAX
            )));
        }
        let host_keys = cfg
            .host_keys
            .iter()
            .map(|(h, k)| Ok((h.clone(), HostAuth::new(k)?)))
            .collect::<Result<BTreeMap<_, _>, ConfigError>>()?;
        let old = current.get(&cfg.nqn);
        let mut namespaces = BTreeMap::new();
        for nc in &cfg.namespaces {
            // Reuse an open namespace when nothing about it changed.
            let reuse = old.and_then(|o| o.namespaces.get(&nc.nsid)).filter(|n| {
                n.spec == nc.backend
                    && n.read_only == nc.read_only
                    && nc
                        .uuid
                        .as_deref()
                        .is_none_or(|u| config::parse_uuid(u) == Some(n.uuid))
            });
            let ns = match reuse {
                Some(n) => n.clone(),
                None => Arc::new(self.open_namespace(&cfg.nqn, nc)?),
            };
            namespaces.insert(nc.nsid, ns);
        }
        // Namespaces handed in by code (no spec) are not in any config; keep
        // them unless the config names their NSID.
        if let Some(o) = old {
            for (id, n) in &o.namespaces {
                if n.spec.is_empty() && !namespaces.contains_key(id) {
                    namespaces.insert(*id, n.clone());
                }
            }
        }
        // Every path of an ANA subsystem must report the same serial
        // number: without one configured, derive it from the NQN alone.
        let serial = cfg.serial.clone().unwrap_or_else(|| match cfg.ana {
            Some(_) => serial_for(&[0; 16], &cfg.nqn),
            None => serial_for(&self.identity, &cfg.nqn),
        });
        let s = Subsystem {
            nqn: cfg.nqn.clone(),
            serial,
            model: cfg.model.clone(),
            allow_any_host: cfg.allow_any_host,
            hosts: cfg.allowed_hosts.iter().cloned().collect(),
            host_keys,
            namespaces,
            ana: cfg.ana.map(|config| SubsystemAna {
                config,
                runtime: self.ana_runtime(&cfg.nqn),
            }),
        };
        self.publish(s, old.cloned())
    }

    /// The ANA runtime of `nqn`, created on first use.
    fn ana_runtime(&self, nqn: &str) -> Arc<AnaRuntime> {
        lock(&self.ana)
            .entry(nqn.to_owned())
            .or_insert_with(|| Arc::new(AnaRuntime::new()))
            .clone()
    }

    /// Sets the ANA state of a subsystem's group on this target and saves
    /// it. Before a serving state is published every namespace's backend
    /// is activated (if one fails, nothing changes and the error says
    /// why); after a non-serving state is published every backend is
    /// deactivated, which may wait for in-flight I/O. Controllers that
    /// enabled ANA change notices get one.
    pub fn set_ana_state(&self, nqn: &str, state: AnaState) -> Result<(), TargetError> {
        self.edit(nqn, |s| {
            let a = s.ana.as_mut().ok_or_else(|| {
                TargetError::Invalid(format!("subsystem {nqn} has no ANA configuration"))
            })?;
            a.config.state = state;
            Ok(())
        })
    }

    /// [`Target::set_ana_state`], for a served volume's subsystem whose
    /// volume this target owns: `owner_keys` are the DH-HMAC-CHAP keys of
    /// its owner host NQN, kept before a serving state activates the
    /// volume engine (which authenticates to the extents with them). A
    /// non-serving state forgets them.
    pub fn set_ana_state_owning(
        &self,
        nqn: &str,
        state: AnaState,
        owner_keys: Option<&DhchapKeys>,
    ) -> Result<(), TargetError> {
        let keys = owner_keys.map(HostAuth::new).transpose()?;
        if self.subsystem(nqn).is_none() {
            return Err(TargetError::NotFound(format!("subsystem {nqn}")));
        }
        if let Some(k) = keys {
            lock(&self.owner_keys).insert(nqn.to_owned(), k);
        }
        self.set_ana_state(nqn, state)?;
        if !state.is_serving() {
            lock(&self.owner_keys).remove(nqn);
        }
        Ok(())
    }

    /// The keys of this target's owner host NQN for the served volume
    /// subsystem `nqn`, if the control plane gave some.
    pub fn owner_keys(&self, nqn: &str) -> Option<HostAuth> {
        lock(&self.owner_keys).get(nqn).cloned()
    }

    /// Extends the leases of the named subsystems to `valid_until_ms`
    /// ([`Target::now_ms`] units; a lease never moves backwards). Names
    /// that are unknown, or whose subsystem has no lease-gated ANA state,
    /// are ignored. A lease that was expired and is valid again changes
    /// the effective state: hosts get an ANA change notice. Returns how
    /// many leases were renewed.
    pub fn renew_leases(&self, nqns: &[impl AsRef<str>], valid_until_ms: u64) -> usize {
        let subsystems = self.subsystems.load();
        let mut renewed = 0;
        for nqn in nqns {
            let Some(s) = subsystems.get(nqn.as_ref()) else {
                continue;
            };
            let Some(a) = s.ana.as_ref().filter(|a| a.config.lease) else {
                continue;
            };
            a.runtime
                .lease_until_ms
                .fetch_max(valid_until_ms, Ordering::AcqRel);
            renewed += 1;
            self.check_ana(s);
        }
        renewed
    }

    /// Re-evaluates the effective ANA state of `s` now: when it changed
    /// since hosts were last told (a state was published, a lease expired
    /// or was renewed), bumps the change count and sends the ANA change
    /// notice to every controller of the subsystem. Returns the effective
    /// state and change count (None without ANA). Cheap when nothing
    /// changed; the reactors call it on every tick of an admin queue.
    pub fn check_ana(&self, s: &Subsystem) -> Option<(AnaState, u64)> {
        let a = s.ana.as_ref()?;
        let state = a.effective(self.now_ms());
        let (chgcnt, changed) = a.runtime.observe(state);
        if changed {
            tracing::info!(nqn = %s.nqn, state = %state, chgcnt, "ANA state changed");
            for c in self.controllers_of(&s.nqn) {
                c.notify_ana_changed();
            }
        }
        Some((state, chgcnt))
    }

    /// Removes a subsystem and ends its controllers. Returns only once
    /// every connection of those controllers is closed and every command
    /// they issued has completed, so nothing they sent can reach a backend
    /// afterwards: taking a host's subsystem away fences it (C19). If that
    /// takes longer than [`limits::FENCE_WAIT_MS`] the subsystem is gone
    /// but the call fails, and the caller must not count on the fence.
    pub fn remove_subsystem(&self, nqn: &str) -> Result<(), TargetError> {
        let killed: Vec<Weak<Controller>> = {
            let _w = lock(&self.write_lock);
            let mut map = (*self.subsystems.load_full()).clone();
            let Some(old) = map.remove(nqn) else {
                return Err(TargetError::NotFound(format!("subsystem {nqn}")));
            };
            self.commit(map)?;
            lock(&self.ana).remove(nqn);
            lock(&self.owner_keys).remove(nqn);
            let killed = self
                .controllers_of(nqn)
                .iter()
                .map(|c| {
                    c.kill("subsystem removed");
                    Arc::downgrade(c)
                })
                .collect();
            if old.serving() {
                for n in old.namespaces.values() {
                    n.backend.deactivate();
                }
            }
            killed
        };
        // Each queue of a dead controller closes at its reactor's next tick
        // and lets go of the controller once its last command completed.
        let deadline = Instant::now() + std::time::Duration::from_millis(limits::FENCE_WAIT_MS);
        while killed.iter().any(|w| w.strong_count() > 0) {
            if Instant::now() >= deadline {
                tracing::warn!(
                    nqn,
                    "subsystem removed, but its connections did not close in time"
                );
                return Err(TargetError::Conflict(format!(
                    "subsystem {nqn} was removed, but connections of it still had commands \
                     in flight after {} ms",
                    limits::FENCE_WAIT_MS
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        Ok(())
    }

    /// Adds or replaces one namespace of an existing subsystem.
    pub fn put_namespace(&self, nqn: &str, nc: &NamespaceConfig) -> Result<(), TargetError> {
        let mut s = self.subsystem_config(nqn)?;
        s.namespaces.retain(|n| n.nsid != nc.nsid);
        s.namespaces.push(nc.clone());
        if s.namespaces.len() > limits::NAMESPACES_PER_SUBSYS_MAX as usize {
            return Err(TargetError::Limit("too many namespaces".into()));
        }
        self.put_subsystem(&s)
    }

    /// Adds a namespace backed by an already-open backend (tests, benchmarks:
    /// fault-injecting backends). Not persisted.
    pub fn put_namespace_backend(
        &self,
        nqn: &str,
        nsid: u32,
        backend: Arc<dyn Backend>,
    ) -> Result<(), TargetError> {
        config::validate_nsid(nsid)?;
        let ns = Arc::new(self.make_namespace(nqn, nsid, backend, String::new(), None, false)?);
        self.edit(nqn, |s| {
            s.namespaces.insert(nsid, ns);
            Ok(())
        })
    }

    pub fn remove_namespace(&self, nqn: &str, nsid: u32) -> Result<(), TargetError> {
        self.edit(nqn, |s| {
            s.namespaces
                .remove(&nsid)
                .map(|_| ())
                .ok_or_else(|| TargetError::NotFound(format!("namespace {nsid} of {nqn}")))
        })
    }

    pub fn allow_host(&self, nqn: &str, hostnqn: &str) -> Result<(), TargetError> {
        self.allow_host_with_keys(nqn, hostnqn, None)
    }

    /// Allows a host and, when `keys` is given, sets its DH-HMAC-CHAP
    /// settings (new queues authenticate with them; queues already
    /// authenticated stay so). Without `keys` the host keeps any it has.
    pub fn allow_host_with_keys(
        &self,
        nqn: &str,
        hostnqn: &str,
        keys: Option<&DhchapKeys>,
    ) -> Result<(), TargetError> {
        config::validate_nqn(hostnqn)?;
        let auth = keys.map(HostAuth::new).transpose()?;
        self.edit(nqn, |s| {
            if let Some(a) = auth {
                s.host_keys.insert(hostnqn.to_owned(), a);
            }
            if s.hosts.len() >= limits::HOSTS_PER_SUBSYS_MAX && !s.hosts.contains(hostnqn) {
                return Err(TargetError::Limit(format!(
                    "at most {} hosts per subsystem",
                    limits::HOSTS_PER_SUBSYS_MAX
                )));
            }
            s.hosts.insert(hostnqn.to_owned());
            Ok(())
        })
    }

    pub fn disallow_host(&self, nqn: &str, hostnqn: &str) -> Result<(), TargetError> {
        self.edit(nqn, |s| {
            let had_keys = s.host_keys.remove(hostnqn).is_some();
            (s.hosts.remove(hostnqn) || had_keys)
                .then_some(())
                .ok_or_else(|| TargetError::NotFound(format!("host {hostnqn} on {nqn}")))
        })
    }

    /// Applies `f` to a copy of the subsystem and publishes the result.
    fn edit(
        &self,
        nqn: &str,
        f: impl FnOnce(&mut Subsystem) -> Result<(), TargetError>,
    ) -> Result<(), TargetError> {
        let _w = lock(&self.write_lock);
        let old = self
            .subsystem(nqn)
            .ok_or_else(|| TargetError::NotFound(format!("subsystem {nqn}")))?;
        let mut s = (*old).clone();
        f(&mut s)?;
        self.publish(s, Some(old))
    }

    fn subsystem_config(&self, nqn: &str) -> Result<SubsystemConfig, TargetError> {
        self.subsystem(nqn)
            .map(|s| s.to_config())
            .ok_or_else(|| TargetError::NotFound(format!("subsystem {nqn}")))
    }

    fn open_namespace(&self, nqn: &str, nc: &NamespaceConfig) -> Result<Namespace, TargetError> {
        let spec = BackendSpec::parse(&nc.backend)?;
        let backend = spec.open_in(&self.volumes)?;
        let uuid = nc
            .uuid
            .as_deref()
            .map(|u| {
                config::parse_uuid(u).ok_or_else(|| TargetError::Invalid(format!("bad uuid {u:?}")))
            })
            .transpose()?;
        self.make_namespace(
            nqn,
            nc.nsid,
            backend,
            nc.backend.clone(),
            uuid,
            nc.read_only,
        )
    }

    fn make_namespace(
        &self,
        nqn: &str,
        nsid: u32,
        backend: Arc<dyn Backend>,
        spec: String,
        uuid: Option<[u8; 16]>,
        read_only: bool,
    ) -> Result<Namespace, TargetError> {
        let bs = backend.block_size();
        if !(bs == 512 || bs == 4096) {
            return Err(TargetError::Invalid(format!(
                "block size {bs} unsupported (512 or 4096)"
            )));
        }
        let derived = derive_uuid(&self.identity, nqn, nsid);
        let (uuid, eui64) = match uuid {
            // A UUID given by the admin: NGUID and EUI-64 follow from it
            // alone, so every target given it reports the same identifiers.
            Some(u) if u != derived => (u, eui64_from_uuid(&u)),
            // Derived here (now, or saved in target.json by an earlier
            // run): the EUI-64 derived from the identity, as always.
            _ => {
                let mut eui64 = [0u8; 8];
                eui64.copy_from_slice(
                    &derive_uuid(&self.identity, "eui64", nsid ^ fnv(nqn.as_bytes()) as u32)[..8],
                );
                eui64[0] = 0x02; // locally administered
                (derived, eui64)
            }
        };
        tracing::info!(nqn, nsid, backend = %backend.describe(), uuid = %config::format_uuid(&uuid), "namespace ready");
        Ok(Namespace {
            nsid,
            blocks: backend.size() / bs as u64,
            device: backend.device_extent(),
            backend,
            spec,
            uuid,
            nguid: uuid,
            eui64,
            block_shift: bs.trailing_zeros() as u8,
            read_only,
        })
    }

    /// Installs `s`, persists, and tells the controllers of that subsystem.
    ///
    /// Backends follow whether the subsystem serves I/O here
    /// ([`Subsystem::serving`]): a namespace that starts serving is
    /// activated before `s` is visible (a failure leaves everything as it
    /// was), one that stops serving (removed, replaced, or its ANA state
    /// turned non-serving) is deactivated after `s` is visible, outside
    /// every lock the data path takes.
    fn publish(&self, s: Subsystem, old: Option<Arc<Subsystem>>) -> Result<(), TargetError> {
        let was_serving = |n: &Arc<Namespace>| {
            old.as_ref().is_some_and(|o| {
                o.serving() && o.namespaces.get(&n.nsid).is_some_and(|x| Arc::ptr_eq(x, n))
            })
        };
        let mut activated: Vec<Arc<Namespace>> = Vec::new();
        if s.serving() {
            for n in s.namespaces.values().filter(|n| !was_serving(n)) {
                if let Err(e) = n.backend.activate() {
                    for a in &activated {
                        a.backend.deactivate();
                    }
                    return Err(TargetError::Unavailable(format!(
                        "{}: namespace {} ({}) could not be activated: {e}",
                        s.nqn,
                        n.nsid,
                        n.backend.describe()
                    )));
                }
                activated.push(n.clone());
            }
        }
        let mut map = (*self.subsystems.load_full()).clone();
        let s = Arc::new(s);
        map.insert(s.nqn.clone(), s.clone());
        if let Err(e) = self.commit(map) {
            for a in &activated {
                a.backend.deactivate();
            }
            return Err(e);
        }
        let ana_toggled = old
            .as_ref()
            .is_some_and(|o| o.ana.is_some() != s.ana.is_some());
        let changed: Vec<u32> = match &old {
            None => Vec::new(),
            Some(o) => {
                let ids: BTreeSet<u32> = o
                    .namespaces
                    .keys()
                    .chain(s.namespaces.keys())
                    .copied()
                    .collect();
                ids.into_iter()
                    .filter(|id| match (o.namespaces.get(id), s.namespaces.get(id)) {
                        (Some(a), Some(b)) => !Arc::ptr_eq(a, b),
                        _ => true,
                    })
                    .collect()
            }
        };
        for c in self.controllers_of(&s.nqn) {
            if !s.host_allowed(&c.hostnqn) {
                c.kill("host no longer allowed");
                continue;
            }
            if ana_toggled {
                // CMIC and the CNTLID range changed under the host: it must
                // reconnect and identify again.
                c.kill("ANA reporting turned on or off");
                continue;
            }
            c.set_subsystem(s.clone());
            if !changed.is_empty() {
                c.notify_ns_changed(&changed);
            }
        }
        // Hosts learn of a new ANA state before backends wind down.
        self.check_ana(&s);
        if let Some(o) = old.as_ref().filter(|o| o.serving()) {
            for n in o.namespaces.values() {
                let still =
                    s.serving() && s.namespaces.get(&n.nsid).is_some_and(|x| Arc::ptr_eq(x, n));
                if !still {
                    n.backend.deactivate();
                }
            }
        }
        Ok(())
    }

    fn commit(&self, map: BTreeMap<String, Arc<Subsystem>>) -> Result<(), TargetError> {
        let mut cfg = lock(&self.base).clone();
        cfg.subsystems = map.values().map(|s| s.to_config()).collect();
        if let Some(dir) = &self.state_dir {
            cfg.save_state(dir)?;
        }
        self.subsystems.store(Arc::new(map));
        self.discovery_changed();
        Ok(())
    }

    /// Bumps the discovery log generation and tells discovery controllers.
    fn discovery_changed(&self) {
        self.genctr.fetch_add(1, Ordering::AcqRel);
        for c in lock(&self.controllers)
            .by_id
            .values()
            .filter(|c| c.discovery)
        {
            c.notify_discovery_changed();
        }
    }

    // ----- controllers -----

    /// Registers a new controller; None when every CNTLID is taken.
    pub fn create_controller(
        self: &Arc<Self>,
        subsys: Arc<Subsystem>,
        hostnqn: &str,
        hostid: [u8; 16],
        kato_ms: u32,
        discovery: bool,
        transport: crate::config::Transport,
    ) -> Option<Arc<Controller>> {
        let mut cs = lock(&self.controllers);
        cs.by_id.retain(|_, c| !c.is_dead());
        if cs.by_id.len() >= limits::CONTROLLERS_MAX {
            return None;
        }
        let id = match subsys.ana.as_ref().filter(|_| !discovery) {
            // The subsystem's own range, so that the other targets
            // presenting it (other ranges) never hand out the same CNTLID.
            Some(a) => {
                let (lo, hi) = (a.config.cntlid_min, a.config.cntlid_max);
                let cursor = &a.runtime.next_cntlid;
                let start = cursor.load(Ordering::Relaxed).clamp(lo, hi);
                let id = (0..=u32::from(hi - lo))
                    .map(|i| lo + ((u32::from(start - lo) + i) % (u32::from(hi - lo) + 1)) as u16)
                    .find(|id| !cs.by_id.contains_key(id))?;
                cursor.store(if id >= hi { lo } else { id + 1 }, Ordering::Relaxed);
                id
            }
            // CNTLIDs 1..=0xFFEF; skip ones in use (CONTROLLERS_MAX leaves
            // free ones).
            None => loop {
                let id = cs.next_id;
                cs.next_id = if id >= config::CNTLID_MAX { 1 } else { id + 1 };
                if !cs.by_id.contains_key(&id) {
                    break id;
                }
            },
        };
        let c = Arc::new(Controller::new(
            id,
            subsys,
            hostnqn.to_owned(),
            hostid,
            kato_ms,
            discovery,
            transport,
            Arc::downgrade(self),
            self.now_ms(),
        ));
        cs.by_id.insert(id, c.clone());
        Some(c)
    }

    pub fn controller(&self, cntlid: u16) -> Option<Arc<Controller>> {
        lock(&self.controllers)
            .by_id
            .get(&cntlid)
            .filter(|c| !c.is_dead())
            .cloned()
    }

    pub fn controllers(&self) -> Vec<Arc<Controller>> {
        let mut v: Vec<_> = lock(&self.controllers)
            .by_id
            .values()
            .filter(|c| !c.is_dead())
            .cloned()
            .collect();
        v.sort_by_key(|c| c.cntlid);
        v
    }

    fn controllers_of(&self, nqn: &str) -> Vec<Arc<Controller>> {
        lock(&self.controllers)
            .by_id
            .values()
            .filter(|c| !c.discovery && c.subsys_nqn == nqn)
            .cloned()
            .collect()
    }

    pub fn forget_controller(&self, cntlid: u16) {
        lock(&self.controllers).by_id.remove(&cntlid);
    }

    /// Flushes every namespace (clean shutdown).
    pub fn flush_all(&self) {
        for s in self.subsystems.load().values() {
            for n in s.namespaces.values() {
                if let Err(e) = n.backend.flush() {
                    tracing::error!(nqn = %s.nqn, nsid = n.nsid, error = %e, "flush at shutdown failed");
                }
            }
        }
    }
}

/// Weak handle used by controllers to reach the target without a cycle.
pub type TargetRef = Weak<Target>;

fn load_or_create_identity(dir: &std::path::Path) -> Result<[u8; 16], TargetError> {
    let path = dir.join("identity");
    if let Ok(text) = std::fs::read_to_string(&path) {
        return config::parse_uuid(text.trim())
            .ok_or_else(|| TargetError::Invalid(format!("{} is corrupt", path.display())));
    }
    std::fs::create_dir_all(dir).map_err(|source| ConfigError::Write {
        path: dir.into(),
        source,
    })?;
    let id = random_bytes();
    let tmp = dir.join("identity.tmp");
    std::fs::write(&tmp, config::format_uuid(&id))
        .and_then(|()| std::fs::File::open(&tmp)?.sync_all())
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|source| ConfigError::Write {
            path: path.clone(),
            source,
        })?;
    Ok(id)
}

/// 16 random bytes from the kernel.
pub fn random_bytes() -> [u8; 16] {
    nvpool_rt::random::bytes()
}

fn fnv(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// A stable, version-4-shaped UUID from the target identity, NQN and NSID.
pub fn derive_uuid(identity: &[u8; 16], nqn: &str, nsid: u32) -> [u8; 16] {
    let mut seed = Vec::with_capacity(16 + nqn.len() + 4);
    seed.extend_from_slice(identity);
    seed.extend_from_slice(nqn.as_bytes());
    seed.extend_from_slice(&nsid.to_le_bytes());
    let a = fnv(&seed);
    seed.push(0x5A);
    let b = fnv(&seed) ^ nvpool_wire::digest::crc32c(&seed) as u64;
    let mut u = [0u8; 16];
    u[..8].copy_from_slice(&a.to_le_bytes());
    u[8..].copy_from_slice(&b.to_le_bytes());
    u[6] = (u[6] & 0x0F) | 0x40;
    u[8] = (u[8] & 0x3F) | 0x80;
    u
}

/// The EUI-64 of a namespace whose UUID the admin gave: a function of the
/// UUID alone, locally administered like the derived ones.
fn eui64_from_uuid(uuid: &[u8; 16]) -> [u8; 8] {
    let mut seed = b"nvpool-eui64:".to_vec();
    seed.extend_from_slice(uuid);
    let mut e = fnv(&seed).to_le_bytes();
    e[0] = 0x02;
    e
}

fn serial_for(identity: &[u8; 16], nqn: &str) -> String {
    let u = derive_uuid(identity, nqn, 0);
    u[..10].iter().map(|b| format!("{b:02x}")).collect()
}
