//! The target's configuration as the data path sees it: subsystems, their
//! namespaces and host ACLs, live controllers, and listeners.
//!
//! Readers (every Connect, every I/O's namespace lookup through its
//! controller) take lock-free snapshots: subsystems are immutable values
//! behind `ArcSwap`, replaced whole on change. Writers (the admin API, start
//! up) serialise on one mutex, persist the new configuration, then publish
//! it and tell affected controllers (namespace-change events, or removal
//! when their host lost access).

use crate::backend::{Backend, BackendSpec, DeviceExtent};
use crate::config::{self, Config, ConfigError, NamespaceConfig, SubsystemConfig};
use crate::controller::Controller;
use crate::copier::Copies;
use crate::limits;
use arc_swap::ArcSwap;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
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
    pub allow_any_host: bool,
    pub hosts: BTreeSet<String>,
    pub namespaces: BTreeMap<u32, Arc<Namespace>>,
}

impl Subsystem {
    pub fn host_allowed(&self, hostnqn: &str) -> bool {
        self.allow_any_host || self.hosts.contains(hostnqn)
    }

    /// The subsystem a discovery controller belongs to.
    pub fn discovery() -> Subsystem {
        Subsystem {
            nqn: nvpool_wire::DISCOVERY_NQN.into(),
            serial: "discovery".into(),
            allow_any_host: true,
            hosts: BTreeSet::new(),
            namespaces: BTreeMap::new(),
        }
    }

    fn to_config(&self) -> SubsystemConfig {
        SubsystemConfig {
            nqn: self.nqn.clone(),
            allowed_hosts: self.hosts.iter().cloned().collect(),
            allow_any_host: self.allow_any_host,
            serial: Some(self.serial.clone()),
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
    state_dir: Option<PathBuf>,
    subsystems: ArcSwap<BTreeMap<String, Arc<Subsystem>>>,
    write_lock: Mutex<()>,
    controllers: Mutex<Controllers>,
    listeners: Mutex<Vec<SocketAddr>>,
    genctr: AtomicU64,
    shutting_down: AtomicBool,
    epoch: Instant,
    /// Settings (admin_listen, reactors) carried through to target.json.
    base: Mutex<Config>,
    /// Copy jobs and the guards every host write consults.
    copies: Arc<Copies>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks is a bug that already
    // crashed a thread; the data is still consistent (writes are whole).
    m.lock().unwrap_or_else(|p| p.into_inner())
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
            state_dir,
            subsystems: ArcSwap::from_pointee(BTreeMap::new()),
            write_lock: Mutex::new(()),
            controllers: Mutex::new(Controllers {
                by_id: HashMap::new(),
                next_id: 1,
            }),
            listeners: Mutex::new(Vec::new()),
            genctr: AtomicU64::new(1),
            shutting_down: AtomicBool::new(false),
            epoch: Instant::now(),
            base: Mutex::new(Config::default()),
            copies: Arc::new(Copies::default()),
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
            self.put_subsystem(s)?;
        }
        Ok(())
    }

    /// Milliseconds since the target started (the data path's clock).
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
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

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Release);
        self.copies.cancel_all();
    }

    /// Copy jobs of which this target is the destination.
    pub fn copies(&self) -> &Arc<Copies> {
        &self.copies
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
        let serial = cfg
            .serial
            .clone()
            .unwrap_or_else(|| serial_for(&self.identity, &cfg.nqn));
        let s = Subsystem {
            nqn: cfg.nqn.clone(),
            serial,
            allow_any_host: cfg.allow_any_host,
            hosts: cfg.allowed_hosts.iter().cloned().collect(),
            namespaces,
        };
        self.publish(s, old.cloned())
    }

    pub fn remove_subsystem(&self, nqn: &str) -> Result<(), TargetError> {
        let _w = lock(&self.write_lock);
        let mut map = (*self.subsystems.load_full()).clone();
        if map.remove(nqn).is_none() {
            return Err(TargetError::NotFound(format!("subsystem {nqn}")));
        }
        self.commit(map)?;
        for c in self.controllers_of(nqn) {
            c.kill("subsystem removed");
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
        config::validate_nqn(hostnqn)?;
        self.edit(nqn, |s| {
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
            s.hosts
                .remove(hostnqn)
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
        let backend = spec.open()?;
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
        let uuid = uuid.unwrap_or_else(|| derive_uuid(&self.identity, nqn, nsid));
        let mut eui64 = [0u8; 8];
        eui64.copy_from_slice(
            &derive_uuid(&self.identity, "eui64", nsid ^ fnv(nqn.as_bytes()) as u32)[..8],
        );
        eui64[0] = 0x02; // locally administered
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
    fn publish(&self, s: Subsystem, old: Option<Arc<Subsystem>>) -> Result<(), TargetError> {
        let mut map = (*self.subsystems.load_full()).clone();
        let s = Arc::new(s);
        map.insert(s.nqn.clone(), s.clone());
        self.commit(map)?;
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
            c.set_subsystem(s.clone());
            if !changed.is_empty() {
                c.notify_ns_changed(&changed);
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
    ) -> Option<Arc<Controller>> {
        let mut cs = lock(&self.controllers);
        cs.by_id.retain(|_, c| !c.is_dead());
        if cs.by_id.len() >= limits::CONTROLLERS_MAX {
            return None;
        }
        // CNTLIDs 1..=0xFFEF; skip ones in use.
        let id = loop {
            let id = cs.next_id;
            cs.next_id = if id >= 0xFFEF { 1 } else { id + 1 };
            if !cs.by_id.contains_key(&id) {
                break id;
            }
        };
        let c = Arc::new(Controller::new(
            id,
            subsys,
            hostnqn.to_owned(),
            hostid,
            kato_ms,
            discovery,
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
    let mut b = [0u8; 16];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    assert_eq!(n, 16, "getrandom failed");
    b
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

fn serial_for(identity: &[u8; 16], nqn: &str) -> String {
    let u = derive_uuid(identity, nqn, 0);
    u[..10].iter().map(|b| format!("{b:02x}")).collect()
}
