//! The cluster state and every operation that changes it, as optimistic
//! transactions over a [`Store`].
//!
//! Each mutation is *read → compute → commit*: read one consistent snapshot
//! (`list("/")`), compute the new records (placement runs here, purely),
//! then `txn` with conditions saying "nothing I read has changed"; on a
//! conflict, start again (at most `TXN_ATTEMPTS_MAX` times). Nothing in the
//! store is locked, so this works unchanged over etcd with several
//! control-plane processes. (Within one process, mutations that conflict by
//! design also queue on a mutex; see [`Cluster`].)
//!
//! **Store layout** (values are `model::encode`d):
//!
//! | key | value |
//! |---|---|
//! | `/targets/{id}` | [`Target`] |
//! | `/target-credentials/{id}` | [`TargetCredential`]: the target's admin API token (never in the snapshot) |
//! | `/host-keys/{host_nqn}` | [`HostKeys`]: the host's DH-HMAC-CHAP secrets (never in the snapshot) |
//! | `/target-addresses/{kind}/{addr}` | the ID of the target at that address (keeps addresses unique; kinds `nvme-tcp`, `admin`, `nvme-rdma`) |
//! | `/pools/{name}` | [`Pool`] |
//! | `/volumes/{uuid}` | [`Volume`], with all its extents |
//! | `/volume-names/{name}` | the volume's [`Uuid`] (keeps names unique) |
//! | `/attachments/{uuid}/{host_nqn}` | [`Attachment`]: NSIDs, state |
//! | `/hosts/{host_nqn}` | [`HostRecord`]: guards the host's NSID allocation |
//! | `/stale-exports/{target}` | [`StaleExports`]: see [`crate::attach`] |
//! | `/failed-copies/{uuid}` | [`FailedCopies`]: copies that missed writes |
//! | `/copy-state/{uuid}` | [`CopyState`]: what stale copies missed, copy jobs, history |
//! | `/target-usage/{id}` | [`TargetUsage`]: its grain pools' usage as it last reported it (deleted with the target) |
//! | `/write-epochs/{uuid}`, `/snapshots/{uuid}/{name}`, `/clones/{uuid}` | see [`crate::snapshots`] |
//! | `/meta/alloc-epoch` | u64, see below |
//!
//! **The allocation epoch.** "Nothing I read has changed" cannot be said
//! key by key for a placement: it depends on every volume, and a volume
//! created concurrently is a key the snapshot never saw. So every
//! transaction that changes what is allocated or allocatable — volume
//! create, grow and delete, target registration and removal, pool create
//! and delete — conditions on the epoch's version and rewrites it. Such
//! transactions are therefore serialised, and a placement is only ever
//! committed against the exact state it was computed from: two creates can
//! never hand out the same extent. Heartbeats and cordoning touch only their
//! target's keys, its record and its usage report (they change health,
//! which placement reads, but acting on a slightly stale health is
//! harmless).
//!
//! **Derived, never stored:** capacity and usage (summed from the volumes'
//! extents; a grain pool's use is its target's report), target health
//! (from `last_heartbeat_ms` and the clock), volume status (from the
//! health of its extents' targets).

use crate::attach::{attach_keys as ak, Attachment, FailedCopies, HostRecord, StaleExports};
use crate::clock::Clock;
use crate::leader::Leadership;
use crate::limits::{
    DEVICES_PER_POOL_MAX, EXTENT_BYTES, HEARTBEAT_TIMEOUT_MS, ID_BYTES_MAX, LABEL_BYTES_MAX,
    POOLS_MAX, TARGETS_MAX, TXN_ATTEMPTS_MAX, TXN_BACKOFF_BASE_US, TXN_BACKOFF_MAX_US, VOLUMES_MAX,
};
use crate::model::{
    decode, encode, validate_extent_bytes, validate_id, Device, DeviceRef, Health, ModelError,
    Pool, Target, TargetState, Uuid, Volume, VolumeSpec, VolumeStatus,
};
use crate::placement::{
    failure_domain, Allocator, DeviceInfo, PlacementError, DEFAULT_FAILURE_DOMAIN_LABEL,
};
use crate::rest::{CapacityOut, Provisioning, Secret};
use crate::resync::{copy_state_key, CopyState, COPY_STATE};
use crate::snapshots::{PendingClone, SnapshotRecord, WriteEpoch};
use crate::store::{Condition, Op, Revision, Store, StoreError, TxnOutcome};
use crate::usage::TargetUsage;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

/// Store keys of the cluster state.
pub mod keys {
    use crate::model::Uuid;

    pub const TARGETS: &str = "/targets/";
    pub const TARGET_CREDENTIALS: &str = "/target-credentials/";
    pub const TARGET_ADDRESSES: &str = "/target-addresses/";
    pub const POOLS: &str = "/pools/";
    pub const VOLUMES: &str = "/volumes/";
    pub const VOLUME_NAMES: &str = "/volume-names/";
    pub const ALLOC_EPOCH: &str = "/meta/alloc-epoch";

    pub fn target(id: &str) -> String {
        format!("{TARGETS}{id}")
    }

    pub fn target_credential(id: &str) -> String {
        format!("{TARGET_CREDENTIALS}{id}")
    }

    pub const HOST_KEYS: &str = "/host-keys/";

    pub fn host_keys(host_nqn: &str) -> String {
        format!("{HOST_KEYS}{host_nqn}")
    }

    /// The index key of one of a target's addresses (`kind` is an
    /// [`super::AddressKind`]'s key part).
    pub fn target_address(kind: &str, addr: &std::net::SocketAddr) -> String {
        format!("{TARGET_ADDRESSES}{kind}/{addr}")
    }

    pub fn pool(name: &str) -> String {
        format!("{POOLS}{name}")
    }

    pub fn volume(uuid: &Uuid) -> String {
        format!("{VOLUMES}{uuid}")
    }

    pub fn volume_name(name: &str) -> String {
        format!("{VOLUME_NAMES}{name}")
    }

    /// Present while a forced delete of the volume detaches its hosts:
    /// attaches are refused, so they cannot outrun it.
    pub fn deleting(uuid: &Uuid) -> String {
        format!("/deleting/{uuid}")
    }
}

/// Why a cluster operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Invalid(#[from] ModelError),
    #[error(transparent)]
    Placement(#[from] PlacementError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("target {0} is not registered")]
    TargetNotFound(String),
    #[error("pool {0} does not exist")]
    PoolNotFound(String),
    #[error("volume {0} does not exist")]
    VolumeNotFound(String),
    /// A create reused a UUID with different parameters.
    #[error(
        "volume {uuid} already exists with different parameters ({existing:?}, {})",
        crate::placement::provisioning_name(*provisioning)
    )]
    UuidConflict {
        uuid: Uuid,
        existing: VolumeSpec,
        provisioning: Provisioning,
    },
    #[error("volume name {name} is taken by volume {uuid}")]
    NameTaken { name: String, uuid: Uuid },
    #[error("pool {0} already exists with different devices")]
    PoolConflict(String),
    #[error("device {0} is not registered")]
    UnknownDevice(DeviceRef),
    #[error("device {device} already belongs to pool {pool}")]
    DeviceInPool { device: DeviceRef, pool: String },
    #[error("device {device} is in use: {reason}")]
    DeviceInUse { device: DeviceRef, reason: String },
    #[error("pool {pool} still holds {volumes} volumes")]
    PoolInUse { pool: String, volumes: usize },
    /// Another registered target has this address.
    #[error("{} {addr} is the address of target {target}", .kind.field())]
    AddressTaken {
        kind: AddressKind,
        addr: SocketAddr,
        target: String,
    },
    #[error("target {target} still holds {extents} extents (drain it first: nvpool target drain {target})")]
    TargetInUse { target: String, extents: usize },
    #[error("volume {uuid} is {size_bytes} bytes; volumes only grow (asked for {requested})")]
    Shrink {
        uuid: Uuid,
        size_bytes: u64,
        requested: u64,
    },
    #[error("too many {what}: at most {max}")]
    TooMany { what: &'static str, max: usize },
    #[error("volume {volume} is attached to {}", hosts.join(", "))]
    Attached { volume: Uuid, hosts: Vec<String> },
    #[error("volume {volume} is not attached to {host}")]
    NotAttached { volume: Uuid, host: String },
    #[error("host {0} has no DH-HMAC-CHAP keys")]
    NoHostKeys(String),
    #[error(
        "host {0} has no DH-HMAC-CHAP keys, and this cluster serves only hosts that \
         authenticate: set them first (nvpool host set-keys)"
    )]
    HostKeysRequired(String),
    #[error(
        "volume {0} is being deleted (a forced delete is under way, or was interrupted: \
         finish it with `nvpool volume delete --force`)"
    )]
    Deleting(Uuid),
    /// Marking this copy stale would leave its row without a copy in sync.
    #[error("extent {extent} of volume {volume} is the last copy in sync of its row")]
    LastInSyncCopy { volume: Uuid, extent: u32 },
    #[error("gave up after {attempts} conflicting attempts")]
    Contention { attempts: u32 },
    /// Work only the leader does, asked of a process that is not (or is no
    /// longer) the leader; its writes were refused by the fence.
    #[error(transparent)]
    NotLeader(#[from] crate::leader::NotLeader),
    /// The request conflicts with the state (409 with this kind).
    #[error("{message}")]
    Conflict { kind: &'static str, message: String },
    /// The request cannot be carried out (422 with this kind).
    #[error("{message}")]
    Unprocessable { kind: &'static str, message: String },
    #[error("session {session} of {host} is not the one serving volume {volume}")]
    StaleSession {
        volume: Uuid,
        host: String,
        session: u64,
    },
    #[error("volume {volume} has no snapshot {name}")]
    SnapshotNotFound { volume: Uuid, name: String },
    /// A snapshot was given up: its trees are freed, its record gone.
    #[error("snapshot {name} of volume {volume} was given up: {reason}")]
    SnapshotFailed {
        volume: Uuid,
        name: String,
        reason: String,
    },
    #[error("stored record {key} is corrupt")]
    Corrupt {
        key: String,
        #[source]
        source: ModelError,
    },
    /// The stored state breaks an invariant (overlapping extents…): a bug
    /// or a corrupt store. Mutations stop rather than build on it.
    #[error("stored state is inconsistent: {0}")]
    Inconsistent(String),
}

/// Settings of the cluster state layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateConfig {
    /// Extent size of new volumes (existing volumes keep theirs).
    pub extent_bytes: u64,
    /// A target whose last heartbeat is older is offline.
    pub heartbeat_timeout_ms: u64,
    /// Label whose values are failure domains (see `placement`).
    pub failure_domain_label: String,
    /// Copy rate of each copy job (for estimates; the heal loop enforces
    /// it), bytes per second; 0: unthrottled.
    pub rebuild_rate_bytes_per_sec: u64,
    /// Attach and serve volumes only to hosts that have DH-HMAC-CHAP keys
    /// (`nvpool-control --require-host-keys`): no host reaches a namespace
    /// without a credential. nvpool's own initiators (served volumes'
    /// owners, copiers) are exempt.
    pub require_host_keys: bool,
}

impl Default for StateConfig {
    fn default() -> Self {
        StateConfig {
            extent_bytes: EXTENT_BYTES,
            heartbeat_timeout_ms: HEARTBEAT_TIMEOUT_MS,
            failure_domain_label: DEFAULT_FAILURE_DOMAIN_LABEL.into(),
            rebuild_rate_bytes_per_sec: crate::limits::REBUILD_RATE_BYTES_PER_SEC,
            require_host_keys: false,
        }
    }
}

impl StateConfig {
    pub fn validate(&self) -> Result<(), ModelError> {
        validate_extent_bytes(self.extent_bytes)?;
        if self.heartbeat_timeout_ms == 0 {
            return Err(ModelError::Invalid(
                "heartbeat timeout must be positive".into(),
            ));
        }
        let l = &self.failure_domain_label;
        if l.is_empty() || l.len() > LABEL_BYTES_MAX {
            return Err(ModelError::Invalid(format!(
                "failure-domain label {l:?} must be 1..={LABEL_BYTES_MAX} bytes"
            )));
        }
        Ok(())
    }
}

/// What a target sends to register (and re-register after a restart or a
/// change of address, labels or devices).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetRegistration {
    pub id: String,
    pub name: String,
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub labels: BTreeMap<String, String>,
    pub devices: Vec<Device>,
    /// The NVMe/RDMA listener hosts may use instead of `addr`.
    #[serde(default)]
    pub rdma_addr: Option<SocketAddr>,
    /// The admin API serves https ([`Target::admin_tls`]).
    #[serde(default)]
    pub admin_tls: bool,
    /// The target's admin API token, kept as its [`TargetCredential`];
    /// None keeps the one held (if any).
    #[serde(default, skip_serializing)]
    pub admin_token: Option<Secret>,
}

/// The addresses of a target that no other target may share: two records
/// with one admin address would have the control plane program one daemon
/// as two targets (and reconciling one would undo the other's exports).
/// NVMe/RDMA addresses live in RDMA CM's port space, so a target's
/// `rdma_addr` may equal its own (TCP) `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum AddressKind {
    /// `addr`, the NVMe/TCP listener.
    NvmeTcp,
    /// `admin_addr`, the admin API.
    Admin,
    /// `rdma_addr`, the NVMe/RDMA listener.
    NvmeRdma,
}

impl AddressKind {
    pub const ALL: [AddressKind; 3] = [
        AddressKind::NvmeTcp,
        AddressKind::Admin,
        AddressKind::NvmeRdma,
    ];

    /// The registration field.
    pub fn field(self) -> &'static str {
        match self {
            AddressKind::NvmeTcp => "addr",
            AddressKind::Admin => "admin_addr",
            AddressKind::NvmeRdma => "rdma_addr",
        }
    }

    /// Its part of the index key.
    pub fn key_part(self) -> &'static str {
        match self {
            AddressKind::NvmeTcp => "nvme-tcp",
            AddressKind::Admin => "admin",
            AddressKind::NvmeRdma => "nvme-rdma",
        }
    }

    /// `t`'s address of this kind, if it has one.
    pub fn of(self, t: &Target) -> Option<SocketAddr> {
        match self {
            AddressKind::NvmeTcp => Some(t.addr),
            AddressKind::Admin => Some(t.admin_addr),
            AddressKind::NvmeRdma => t.rdma_addr,
        }
    }

    /// The index keys of every address of `t`.
    fn keys_of(t: &Target) -> Vec<(AddressKind, SocketAddr, String)> {
        AddressKind::ALL
            .into_iter()
            .filter_map(|k| {
                k.of(t)
                    .map(|a| (k, a, keys::target_address(k.key_part(), &a)))
            })
            .collect()
    }
}

/// What the control plane needs to call a target's admin API, stored
/// under its own key (`/target-credentials/{id}`) rather than in the
/// [`Target`] record: written with the registration, deleted with the
/// target, read only by the client of the target's admin API, and never
/// part of an answer or a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetCredential {
    pub target: String,
    pub admin_token: Secret,
}

impl crate::model::Stored for TargetCredential {}

/// A host's DH-HMAC-CHAP settings, which the control plane hands to every
/// target that exports anything to the host (docs/ARCHITECTURE.md C24).
/// Stored under `/host-keys/{host_nqn}`, outside the snapshot; the secrets
/// leave the control plane only towards targets, never in an answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostKeys {
    pub host: String,
    /// Names this version of the keys on the targets (fresh on every
    /// change): a target showing another one holds older keys.
    pub key_id: String,
    /// The host's secret, `DHHC-1:…` (`nvme connect --dhchap-secret`).
    pub dhchap_key: Secret,
    /// The controller's secret, for bidirectional authentication.
    pub dhchap_ctrl_key: Option<Secret>,
    /// `sha256`, `sha384`, `sha512`; `None`: the strongest the host offers.
    pub dhchap_hash: Option<String>,
    /// `null` or `ffdhe2048` … `ffdhe8192`; `None`: `null`.
    pub dhchap_dhgroup: Option<String>,
    pub updated_ms: u64,
}

impl crate::model::Stored for HostKeys {}

/// A stored value and its version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned<T> {
    pub value: T,
    pub version: Revision,
}

/// The whole cluster state as of one store revision.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub revision: Revision,
    pub targets: BTreeMap<String, Versioned<Target>>,
    pub pools: BTreeMap<String, Versioned<Pool>>,
    pub volumes: BTreeMap<Uuid, Versioned<Volume>>,
    pub volume_names: BTreeMap<String, Versioned<Uuid>>,
    /// Address index key → the target at that address.
    pub target_addresses: BTreeMap<String, Versioned<String>>,
    pub alloc_epoch: Option<Versioned<u64>>,
    /// (volume, host NQN) → attachment.
    pub attachments: BTreeMap<(Uuid, String), Versioned<Attachment>>,
    pub hosts: BTreeMap<String, Versioned<HostRecord>>,
    /// target → namespaces it may still export after a forced detach.
    pub stale_exports: BTreeMap<String, Versioned<StaleExports>>,
    /// volume → its copies that missed writes.
    pub failed_copies: BTreeMap<Uuid, Versioned<FailedCopies>>,
    /// volume → resync bookkeeping.
    pub copy_states: BTreeMap<Uuid, Versioned<CopyState>>,
    /// volume → its write epoch (absent: the first).
    pub write_epochs: BTreeMap<Uuid, Versioned<WriteEpoch>>,
    /// (volume, name) → snapshot.
    pub snapshots: BTreeMap<(Uuid, String), Versioned<SnapshotRecord>>,
    /// new volume → a clone whose trees are being created.
    pub pending_clones: BTreeMap<Uuid, Versioned<PendingClone>>,
}

impl Snapshot {
    /// The condition "no allocation changed since this snapshot" and the
    /// op that records a new one.
    fn epoch_guard(&self) -> (Condition, Op) {
        let e = self.alloc_epoch.as_ref();
        let next = e.map_or(1, |e| e.value + 1);
        (
            unchanged(keys::ALLOC_EPOCH, e.map(|e| e.version)),
            Op::Put(keys::ALLOC_EPOCH.into(), encode(&next)),
        )
    }

    /// A volume's kind, from its devices' records ([`Volume::provisioning`]).
    pub fn provisioning_of(&self, v: &Volume) -> Provisioning {
        v.provisioning(|e| {
            let t = self.targets.get(&e.target)?;
            t.value.device(&e.device).map(Device::is_grain_pool)
        })
    }

    /// device → pool, from the pool records.
    pub fn device_pools(&self) -> BTreeMap<DeviceRef, String> {
        let mut out = BTreeMap::new();
        for (name, p) in &self.pools {
            for d in &p.value.devices {
                out.insert(d.clone(), name.clone());
            }
        }
        out
    }
}

/// A target and its health.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetView {
    pub target: Target,
    pub health: Health,
}

/// A volume and its status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeView {
    pub volume: Volume,
    pub status: VolumeStatus,
    /// Extents (indices into `volume.extents`) holding copies that missed
    /// writes: never read until rebuilt.
    pub failed_extents: Vec<u32>,
    /// Copies being brought back in sync.
    pub jobs: Vec<crate::resync::CopyJob>,
    /// Derived from its devices ([`Volume::provisioning`]).
    pub provisioning: Provisioning,
}

/// The result of `create_volume`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Created {
    pub volume: Volume,
    /// False when the volume already existed with these parameters (a
    /// retried create).
    pub created: bool,
}

/// Capacity of a set of devices. `free_bytes = total_bytes - used_bytes`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    pub total_bytes: u64,
    /// Bytes really taken (see [`DeviceCapacity::used_bytes`]).
    pub used_bytes: u64,
    pub free_bytes: u64,
    /// Extents of the configured size that still fit.
    pub free_extents: u64,
    /// Bytes of the extents placed: above `total_bytes` when grain pools
    /// are over-committed.
    pub provisioned_bytes: u64,
}

impl From<&Capacity> for CapacityOut {
    fn from(c: &Capacity) -> CapacityOut {
        CapacityOut {
            total_bytes: c.total_bytes,
            used_bytes: c.used_bytes,
            free_bytes: c.free_bytes,
            free_extents: c.free_extents,
            provisioned_bytes: c.provisioned_bytes,
        }
    }
}

impl Capacity {
    fn add(&mut self, u: &DeviceCapacity) {
        self.total_bytes = self.total_bytes.saturating_add(u.capacity_bytes);
        self.used_bytes = self.used_bytes.saturating_add(u.used_bytes);
        self.free_bytes = self.free_bytes.saturating_add(u.free_bytes);
        self.free_extents += u.free_extents;
        self.provisioned_bytes = self.provisioned_bytes.saturating_add(u.provisioned_bytes);
    }
}

/// The real bytes of one device, for capacity reports. Placement counts
/// in its own space (a grain pool's is virtual: `placement::DeviceUsage`);
/// these are what the device holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceCapacity {
    pub target: String,
    pub device: String,
    pub pool: Option<String>,
    /// A grain pool (`thin:PATH`).
    pub thin: bool,
    pub capacity_bytes: u64,
    /// A plain device's placed extents; a grain pool's allocated grains as
    /// its target last reported them (0 until it does), at most the
    /// capacity.
    pub used_bytes: u64,
    /// `capacity_bytes - used_bytes`.
    pub free_bytes: u64,
    /// Extents of the configured size that still fit: a plain device's
    /// free aligned gaps; a grain pool's free bytes in whole extents (its
    /// placement space is virtual, so only real bytes bound what it takes).
    pub free_extents: u64,
    /// Bytes of the extents placed on it.
    pub provisioned_bytes: u64,
}

/// Capacity of the whole cluster, of each pool and of the unpooled devices,
/// derived from the volumes' extents.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapacityReport {
    pub total: Capacity,
    pub unpooled: Capacity,
    pub pools: BTreeMap<String, Capacity>,
    pub devices: Vec<DeviceCapacity>,
}

/// The cluster: the store, the clock and the settings. Clones share
/// everything; every method may run concurrently with any other, in this
/// process or another one using the same store.
///
/// Mutations guarded by the allocation epoch are serialised by the store
/// anyway, so within one process they also take a mutex first: threads
/// then queue instead of repeatedly invalidating each other's snapshots
/// (with optimistic retries alone, a thread doing slow placements can lose
/// every race to one doing quick deletes). Across processes the
/// compare-and-swap still decides, with a randomised backoff between
/// attempts.
#[derive(Debug, Clone)]
pub struct Cluster {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    config: StateConfig,
    mutations: Arc<Mutex<()>>,
    /// Set when the serving process stops: long polls answer at once.
    closing: Arc<std::sync::atomic::AtomicBool>,
    /// Lease grants to owners of served volumes (in memory).
    leases: Arc<crate::paths::Leases>,
    /// What this process tells operators, and the usage levels it last
    /// warned about (in memory, see [`crate::usage`]).
    events: Arc<crate::usage::Events>,
    usage_levels: Arc<crate::usage::Levels>,
    /// Whether this process leads (see `leader`).
    leadership: Arc<Leadership>,
    /// How long a snapshot waits for engines to confirm its epoch.
    snapshot_wait_ms: Arc<std::sync::atomic::AtomicU64>,
    /// Every write also requires the leader's term (the leader's own work).
    fenced: bool,
    /// Whom a target's https admin API must prove it is
    /// (`nvpool-control --target-cacert`); None: the system CA bundle.
    #[cfg(feature = "client")]
    target_tls: Option<TargetTls>,
}

/// The trust of the control plane's calls to https admin APIs; its
/// `Debug` does not list the certificates.
#[cfg(feature = "client")]
#[derive(Clone)]
struct TargetTls(ureq::tls::TlsConfig);

#[cfg(feature = "client")]
impl std::fmt::Debug for TargetTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TargetTls(..)")
    }
}

/// What one attempt of a transaction decided.
pub(crate) enum Txn<T> {
    /// Nothing (more) to write: the answer.
    Done(T),
    /// Apply `ops` if `conds` hold (nothing read has changed), then answer
    /// `T`; otherwise the attempt starts again.
    Commit(Vec<Condition>, Vec<Op>, T),
}

/// The condition "the record at `key` is as it was read": still at
/// `version`, or still absent (`None`).
pub(crate) fn unchanged(key: &str, version: Option<Revision>) -> Condition {
    match version {
        Some(v) => Condition::VersionIs(key.to_owned(), v),
        None => Condition::Missing(key.to_owned()),
    }
}

fn decode_at<T: crate::model::Stored>(
    what: &'static str,
    key: &str,
    bytes: &[u8],
) -> Result<T, StateError> {
    decode(what, bytes).map_err(|source| StateError::Corrupt {
        key: key.to_owned(),
        source,
    })
}

/// Files the record `kv` holds in `map`, under the index `own` gives it
/// along with the key the record belongs at: a record under another
/// record's key is as corrupt as garbage.
fn file<K: Ord, T: crate::model::Stored>(
    map: &mut BTreeMap<K, Versioned<T>>,
    what: &'static str,
    kv: &crate::store::KeyValue,
    own: impl FnOnce(&T) -> (K, String),
) -> Result<(), StateError> {
    let value = decode_at(what, &kv.key, &kv.value)?;
    let (index, at) = own(&value);
    if at != kv.key {
        return Err(StateError::Corrupt {
            key: kv.key.clone(),
            source: ModelError::Invalid(format!("the key holds the {what} that belongs at {at}")),
        });
    }
    map.insert(
        index,
        Versioned {
            value,
            version: kv.version,
        },
    );
    Ok(())
}

/// Adds to a registration of `target` the conditions and ops that keep
/// addresses unique: refused when another target's record has one of its
/// addresses (records older than the index included), else the index
/// keys of its addresses are written (taken over from a key whose target
/// no longer has that address) and the ones it no longer uses are deleted.
fn index_addresses(
    s: &Snapshot,
    target: &Target,
    conds: &mut Vec<Condition>,
    ops: &mut Vec<Op>,
) -> Result<(), StateError> {
    for kind in AddressKind::ALL {
        let Some(addr) = kind.of(target) else {
            continue;
        };
        if let Some(other) = s
            .targets
            .values()
            .find(|o| o.value.id != target.id && kind.of(&o.value) == Some(addr))
        {
            return Err(StateError::AddressTaken {
                kind,
                addr,
                target: other.value.id.clone(),
            });
        }
    }
    let wanted = AddressKind::keys_of(target);
    for (_, _, key) in &wanted {
        match s.target_addresses.get(key) {
            Some(owner) if owner.value == target.id => {}
            Some(stale) => {
                // Its owner's record is gone or no longer has the address
                // (the records, checked above, are what counts).
                conds.push(Condition::VersionIs(key.clone(), stale.version));
                ops.push(Op::Put(key.clone(), encode(&target.id)));
            }
            None => {
                conds.push(Condition::Missing(key.clone()));
                ops.push(Op::Put(key.clone(), encode(&target.id)));
            }
        }
    }
    for (key, owner) in &s.target_addresses {
        if owner.value == target.id && !wanted.iter().any(|(_, _, k)| k == key) {
            conds.push(Condition::VersionIs(key.clone(), owner.version));
            ops.push(Op::Delete(key.clone()));
        }
    }
    Ok(())
}

impl Cluster {
    pub fn new(
        store: Arc<dyn Store>,
        clock: Arc<dyn Clock>,
        config: StateConfig,
    ) -> Result<Cluster, StateError> {
        config.validate()?;
        let leases = Arc::new(crate::paths::Leases::new(clock.now_ms()));
        Ok(Cluster {
            store,
            clock,
            config,
            mutations: Arc::default(),
            closing: Arc::default(),
            leases,
            events: Arc::default(),
            usage_levels: Arc::default(),
            leadership: Leadership::solo("this process"),
            snapshot_wait_ms: Arc::new(std::sync::atomic::AtomicU64::new(
                crate::limits::SNAPSHOT_CONFIRM_WAIT_MS,
            )),
            fenced: false,
            #[cfg(feature = "client")]
            target_tls: None,
        })
    }

    /// The same cluster, calling https admin APIs trusting `tls` (from
    /// `tls::client_tls_for("--target-cacert", …)`, loaded once at start)
    /// instead of the system CA bundle.
    #[cfg(feature = "client")]
    pub fn with_target_tls(mut self, tls: ureq::tls::TlsConfig) -> Cluster {
        self.target_tls = Some(TargetTls(tls));
        self
    }

    /// What a call to a target's https admin API trusts: the CA given
    /// with [`Cluster::with_target_tls`], else the system bundle.
    #[cfg(feature = "client")]
    pub fn target_tls(&self) -> ureq::tls::TlsConfig {
        match &self.target_tls {
            Some(t) => t.0.clone(),
            None => crate::tls::client_tls_system(),
        }
    }

    /// The same cluster, led as `leadership` says (an elected process).
    pub fn with_leadership(mut self, leadership: Arc<Leadership>) -> Cluster {
        self.leadership = leadership;
        self
    }

    /// The same cluster for the leader's own work: each of its writes also
    /// requires this process's term, and fails with `NotLeader` without one.
    pub fn fenced(&self) -> Cluster {
        Cluster {
            fenced: true,
            ..self.clone()
        }
    }

    pub fn leadership(&self) -> &Arc<Leadership> {
        &self.leadership
    }

    /// True while this process may do the leader's work.
    pub fn is_leader(&self) -> bool {
        self.leadership.is_leader()
    }

    /// The process serving this cluster is stopping: waits such as long
    /// polls end now instead of holding the shutdown up.
    pub fn begin_shutdown(&self) {
        self.closing
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn closing(&self) -> bool {
        self.closing.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// This process begins a term as the leader: owners count as granted
    /// now (another leader may have granted them a lease a moment ago).
    pub fn begin_term(&self) {
        self.leases.restart(self.now());
    }

    pub(crate) fn leases(&self) -> &crate::paths::Leases {
        &self.leases
    }

    /// This process's events (`GET /v1/events`): any subsystem may push.
    pub fn events(&self) -> &crate::usage::Events {
        &self.events
    }

    /// Warns of pools whose real use crossed a threshold since the last
    /// check (see [`crate::usage::Levels::check`]).
    pub fn check_usage(&self, report: &CapacityReport) {
        self.usage_levels.check(report, &self.events, self.now());
    }

    /// How long a snapshot waits for the volume's engines to confirm the
    /// raised epoch before it is given up.
    pub fn snapshot_confirm_wait_ms(&self) -> u64 {
        self.snapshot_wait_ms
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn set_snapshot_confirm_wait_ms(&self, ms: u64) {
        self.snapshot_wait_ms
            .store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    pub fn config(&self) -> &StateConfig {
        &self.config
    }

    /// Deletes `key` if it is there (whatever its version when read),
    /// retrying on contention.
    pub(crate) fn delete_if_present(&self, key: &str) -> Result<(), StateError> {
        self.transact_key(key, |version| {
            Ok(match version {
                None => Txn::Done(()),
                Some(_) => Txn::Commit(
                    vec![unchanged(key, version)],
                    vec![Op::Delete(key.to_owned())],
                    (),
                ),
            })
        })
    }

    /// Copy rate of each copy job, bytes per second (0: unthrottled).
    pub fn rebuild_rate(&self) -> u64 {
        self.config.rebuild_rate_bytes_per_sec
    }

    pub(crate) fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Runs `attempt` until it commits (`Some`), at most
    /// `TXN_ATTEMPTS_MAX` times, backing off between attempts.
    fn retry<T>(
        &self,
        mut attempt: impl FnMut() -> Result<Option<T>, StateError>,
    ) -> Result<T, StateError> {
        // Full jitter: processes racing for the same records stop colliding.
        let mut backoff = nvpool_rt::Backoff::new(
            std::time::Duration::from_micros(TXN_BACKOFF_BASE_US),
            std::time::Duration::from_micros(TXN_BACKOFF_MAX_US),
        );
        for n in 0..TXN_ATTEMPTS_MAX {
            if n > 0 {
                std::thread::sleep(backoff.next_full_jitter());
            }
            if let Some(t) = attempt()? {
                return Ok(t);
            }
        }
        Err(StateError::Contention {
            attempts: TXN_ATTEMPTS_MAX,
        })
    }

    /// Carries out one attempt's decision: `None` when it lost a race.
    fn try_commit<T>(&self, txn: Txn<T>) -> Result<Option<T>, StateError> {
        match txn {
            Txn::Done(t) => Ok(Some(t)),
            Txn::Commit(conds, ops, t) => Ok(self.commit(&conds, &ops)?.then_some(t)),
        }
    }

    /// The one transaction of the cluster state: `attempt` reads a
    /// snapshot and decides; its writes commit only if nothing it read has
    /// changed, else it runs again on a fresh snapshot.
    pub(crate) fn transact<T>(
        &self,
        mut attempt: impl FnMut(&Snapshot) -> Result<Txn<T>, StateError>,
    ) -> Result<T, StateError> {
        self.retry(|| self.try_commit(attempt(&self.snapshot()?)?))
    }

    /// [`Self::transact`] for a change to what is allocated or allocatable:
    /// its writes also need the allocation epoch the snapshot read (and
    /// bump it), and such transactions run one at a time in this process.
    pub(crate) fn transact_allocation<T>(
        &self,
        mut attempt: impl FnMut(&Snapshot) -> Result<Txn<T>, StateError>,
    ) -> Result<T, StateError> {
        // The mutex orders mutations and guards no data: a panic of a
        // previous holder leaves nothing to repair.
        let _turn = self
            .mutations
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.transact(|s| {
            Ok(match attempt(s)? {
                Txn::Commit(mut conds, mut ops, t) => {
                    let (epoch_cond, epoch_op) = s.epoch_guard();
                    conds.push(epoch_cond);
                    ops.push(epoch_op);
                    Txn::Commit(conds, ops, t)
                }
                done => done,
            })
        })
    }

    /// A transaction on the one key `key`, without a snapshot: `attempt`
    /// gets the version read (`None`: absent) and decides.
    pub(crate) fn transact_key<T>(
        &self,
        key: &str,
        mut attempt: impl FnMut(Option<Revision>) -> Result<Txn<T>, StateError>,
    ) -> Result<T, StateError> {
        self.retry(|| {
            let version = self.store.get(key)?.map(|kv| kv.version);
            self.try_commit(attempt(version)?)
        })
    }

    /// Read-modify-write of the one record at `key`, without a snapshot:
    /// `change` sees the record (`None`: absent) and returns what to write
    /// (`None`: nothing) and the answer; the write commits only if the
    /// record is still the one read, else `change` runs again.
    pub(crate) fn update<T: crate::model::Stored, R>(
        &self,
        what: &'static str,
        key: &str,
        mut change: impl FnMut(Option<T>) -> Result<(Option<T>, R), StateError>,
    ) -> Result<R, StateError> {
        self.retry(|| {
            let read = self.read::<T>(what, key)?;
            let version = read.as_ref().map(|r| r.version);
            let (write, answer) = change(read.map(|r| r.value))?;
            let Some(value) = write else {
                return Ok(Some(answer));
            };
            let op = Op::Put(key.to_owned(), encode(&value));
            self.try_commit(Txn::Commit(vec![unchanged(key, version)], vec![op], answer))
        })
    }

    /// The record at `key` and its version, if there is one.
    pub(crate) fn read<T: crate::model::Stored>(
        &self,
        what: &'static str,
        key: &str,
    ) -> Result<Option<Versioned<T>>, StateError> {
        let Some(kv) = self.store.get(key)? else {
            return Ok(None);
        };
        let value = decode_at(what, key, &kv.value)?;
        Ok(Some(Versioned {
            value,
            version: kv.version,
        }))
    }

    /// Every record under `prefix`.
    pub(crate) fn read_all<T: crate::model::Stored>(
        &self,
        what: &'static str,
        prefix: &str,
    ) -> Result<Vec<T>, StateError> {
        let listing = self.store.list(prefix)?;
        listing
            .entries
            .iter()
            .map(|kv| decode_at(what, &kv.key, &kv.value))
            .collect()
    }

    /// Commits, or reports that a condition failed.
    fn commit(&self, conditions: &[Condition], ops: &[Op]) -> Result<bool, StateError> {
        let fence = if self.fenced {
            self.leadership.fence()?
        } else {
            None
        };
        let Some(fence) = fence else {
            return Ok(matches!(
                self.store.txn(conditions, ops)?,
                TxnOutcome::Committed { .. }
            ));
        };
        let mut all = conditions.to_vec();
        all.push(fence.clone());
        match self.store.txn(&all, ops)? {
            TxnOutcome::Committed { .. } => Ok(true),
            TxnOutcome::Conflict(failed) if failed.iter().any(|f| f.index == conditions.len()) => {
                if let Condition::VersionIs(_, term) = fence {
                    self.leadership.lost(term);
                }
                Err(crate::leader::NotLeader.into())
            }
            TxnOutcome::Conflict(_) => Ok(false),
        }
    }

    /// Reads the whole cluster state from one store snapshot.
    pub fn snapshot(&self) -> Result<Snapshot, StateError> {
        let listing = self.store.list("/")?;
        let mut s = Snapshot {
            revision: listing.revision,
            ..Snapshot::default()
        };
        for kv in &listing.entries {
            let k = kv.key.as_str();
            if k.starts_with(keys::TARGETS) {
                file(&mut s.targets, "target", kv, |t| {
                    (t.id.clone(), keys::target(&t.id))
                })?;
            } else if k.starts_with(keys::POOLS) {
                file(&mut s.pools, "pool", kv, |p| {
                    (p.name.clone(), keys::pool(&p.name))
                })?;
            } else if k.starts_with(keys::VOLUMES) {
                file(&mut s.volumes, "volume", kv, |v| {
                    (v.uuid, keys::volume(&v.uuid))
                })?;
            } else if k.starts_with(keys::TARGET_ADDRESSES) {
                file(&mut s.target_addresses, "target address", kv, |_| {
                    (k.to_owned(), k.to_owned())
                })?;
            } else if let Some(name) = k.strip_prefix(keys::VOLUME_NAMES) {
                file(&mut s.volume_names, "volume name", kv, |_| {
                    (name.to_owned(), k.to_owned())
                })?;
            } else if k.starts_with(ak::ATTACHMENTS) {
                file(&mut s.attachments, "attachment", kv, |a| {
                    let at = ak::attachment(&a.volume, &a.host_nqn);
                    ((a.volume, a.host_nqn.clone()), at)
                })?;
            } else if k.starts_with(ak::HOSTS) {
                file(&mut s.hosts, "host", kv, |h| {
                    (h.host_nqn.clone(), ak::host(&h.host_nqn))
                })?;
            } else if k.starts_with(ak::STALE_EXPORTS) {
                file(&mut s.stale_exports, "stale exports", kv, |x| {
                    (x.target.clone(), ak::stale_exports(&x.target))
                })?;
            } else if k.starts_with(ak::FAILED_COPIES) {
                file(&mut s.failed_copies, "failed copies", kv, |f| {
                    (f.volume, ak::failed_copies(&f.volume))
                })?;
            } else if k.starts_with(COPY_STATE) {
                file(&mut s.copy_states, "copy state", kv, |c| {
                    (c.volume, copy_state_key(&c.volume))
                })?;
            } else if k.starts_with(crate::snapshots::WRITE_EPOCHS) {
                file(&mut s.write_epochs, "write epoch", kv, |w| {
                    (w.volume, crate::snapshots::write_epoch_key(&w.volume))
                })?;
            } else if k.starts_with(crate::snapshots::SNAPSHOTS) {
                file(&mut s.snapshots, "snapshot", kv, |r| {
                    let at = crate::snapshots::snapshot_key(&r.volume, &r.name);
                    ((r.volume, r.name.clone()), at)
                })?;
            } else if k.starts_with(crate::snapshots::CLONES) {
                file(&mut s.pending_clones, "pending clone", kv, |c| {
                    (c.spec.uuid, crate::snapshots::clone_key(&c.spec.uuid))
                })?;
            } else if k == keys::ALLOC_EPOCH {
                let value: u64 = decode_at("allocation epoch", k, &kv.value)?;
                s.alloc_epoch = Some(Versioned {
                    value,
                    version: kv.version,
                });
            }
        }
        Ok(s)
    }

    fn health_of(&self, t: &Target, now: u64) -> Health {
        t.health(now, self.config.heartbeat_timeout_ms)
    }

    /// The allocator loaded with every device and every extent of `s`.
    pub fn allocator(&self, s: &Snapshot) -> Result<Allocator, StateError> {
        let now = self.now();
        let pools = s.device_pools();
        let label = &self.config.failure_domain_label;
        let mut a = Allocator::new();
        for t in s.targets.values().map(|v| &v.value) {
            let accepting =
                t.state == TargetState::Active && self.health_of(t, now) == Health::Online;
            for d in &t.devices {
                a.add_device(DeviceInfo {
                    target: t.id.clone(),
                    device: d.id.clone(),
                    capacity_bytes: d.capacity_bytes,
                    grain_pool: d.is_grain_pool(),
                    domain: failure_domain(t, d, label),
                    pool: pools.get(&DeviceRef::new(&t.id, &d.id)).cloned(),
                    accepting,
                })
                .map_err(|e| StateError::Inconsistent(e.to_string()))?;
            }
        }
        for v in s.volumes.values() {
            a.occupy_volume(&v.value)
                .map_err(|e| StateError::Inconsistent(format!("volume {}: {e}", v.value.uuid)))?;
        }
        // New extents of copies under way are taken from the start.
        for (uuid, d) in s.job_dests() {
            a.occupy(d)
                .map_err(|e| StateError::Inconsistent(format!("copy job of volume {uuid}: {e}")))?;
        }
        // Snapshot trees, and a pending clone's, are ranges of their
        // grain pools' virtual space like extents.
        for e in s.snapshot_trees() {
            a.occupy(e).map_err(|err| {
                StateError::Inconsistent(format!("snapshot tree on {}: {err}", e.device_ref()))
            })?;
        }
        // Extents a target may still export after a forced detach stay
        // taken until it is reconciled.
        for e in s.stale_extents() {
            a.occupy(&e).map_err(|err| {
                StateError::Inconsistent(format!("stale export on {}: {err}", e.device_ref()))
            })?;
        }
        Ok(a)
    }

    // ----- targets -----

    /// Registers a target, or updates its address, labels and devices. A
    /// device holding extents cannot disappear or shrink below them.
    pub fn register_target(&self, reg: &TargetRegistration) -> Result<Target, StateError> {
        self.transact_allocation(|s| {
            let now = self.now();
            let existing = s.targets.get(&reg.id);
            let target = Target {
                id: reg.id.clone(),
                name: reg.name.clone(),
                addr: reg.addr,
                admin_addr: reg.admin_addr,
                labels: reg.labels.clone(),
                devices: reg.devices.clone(),
                registered_ms: existing.map_or(now, |e| e.value.registered_ms),
                last_heartbeat_ms: now,
                state: existing.map_or(TargetState::Active, |e| e.value.state),
                rdma_addr: reg.rdma_addr,
                admin_tls: reg.admin_tls,
            };
            target.validate()?;
            if existing.is_none() && s.targets.len() >= TARGETS_MAX {
                return Err(StateError::TooMany {
                    what: "targets",
                    max: TARGETS_MAX,
                });
            }
            for v in s.volumes.values() {
                for e in v.value.extents.iter().filter(|e| e.target == reg.id) {
                    let reason = match target.device(&e.device) {
                        None => "the registration omits it".to_string(),
                        Some(d) if d.placement_bytes() < e.end() => format!(
                            "its new capacity {} is below an extent ending at {}",
                            d.placement_bytes(),
                            e.end()
                        ),
                        // A thin volume's extents are trees of a grain pool:
                        // on a plain device they would be read as ranges.
                        Some(d)
                            if existing
                                .and_then(|x| x.value.device(&e.device))
                                .is_some_and(|old| old.is_grain_pool() != d.is_grain_pool()) =>
                        {
                            "it would change between grain pool and plain device".to_string()
                        }
                        Some(_) => continue,
                    };
                    return Err(StateError::DeviceInUse {
                        device: e.device_ref(),
                        reason: format!("{reason} (volume {} has extents on it)", v.value.uuid),
                    });
                }
            }
            let key = keys::target(&reg.id);
            let mut conds = vec![unchanged(&key, existing.map(|e| e.version))];
            let mut ops = vec![Op::Put(key, encode(&target))];
            index_addresses(s, &target, &mut conds, &mut ops)?;
            if let Some(token) = &reg.admin_token {
                // Registrations and removals of this target are serialised
                // by its key and the allocation epoch: no condition of its own.
                let credential = TargetCredential {
                    target: reg.id.clone(),
                    admin_token: token.clone(),
                };
                ops.push(Op::Put(
                    keys::target_credential(&reg.id),
                    encode(&credential),
                ));
            }
            Ok(Txn::Commit(conds, ops, target))
        })
    }

    /// The admin API token a target registered with, if any.
    pub fn target_credential(&self, id: &str) -> Result<Option<Secret>, StateError> {
        validate_id("target id", id, ID_BYTES_MAX)?;
        let key = keys::target_credential(id);
        let Some(c) = self.read::<TargetCredential>("target credential", &key)? else {
            return Ok(None);
        };
        let c = c.value;
        if c.target != id {
            return Err(StateError::Corrupt {
                key,
                source: ModelError::Invalid(format!(
                    "the key holds the credential of {}",
                    c.target
                )),
            });
        }
        Ok(Some(c.admin_token))
    }

    /// The keys `host` must be served with: its DH-HMAC-CHAP keys, or
    /// none; `HostKeysRequired` when the cluster requires keys
    /// ([`StateConfig::require_host_keys`]) and `host` (not one of nvpool's
    /// own initiators) has none.
    pub fn keys_to_serve(&self, host: &str) -> Result<Option<HostKeys>, StateError> {
        let keys = self.host_keys(host)?;
        let own = crate::auth::is_internal_host(host);
        if keys.is_none() && self.config.require_host_keys && !own {
            return Err(StateError::HostKeysRequired(host.to_owned()));
        }
        Ok(keys)
    }

    /// The DH-HMAC-CHAP keys the cluster holds for `host`, if any.
    pub fn host_keys(&self, host: &str) -> Result<Option<HostKeys>, StateError> {
        crate::attach::validate_host_nqn(host)?;
        let key = keys::host_keys(host);
        let Some(k) = self.read::<HostKeys>("host keys", &key)? else {
            return Ok(None);
        };
        let k = k.value;
        if k.host != host {
            return Err(StateError::Corrupt {
                key,
                source: ModelError::Invalid(format!("the key holds the keys of {}", k.host)),
            });
        }
        Ok(Some(k))
    }

    /// Sets `host`'s DH-HMAC-CHAP keys (replacing any), under a fresh
    /// `key_id`; returns the record written.
    pub fn set_host_keys(&self, mut keys: HostKeys) -> Result<HostKeys, StateError> {
        crate::attach::validate_host_nqn(&keys.host)?;
        let mut id = [0u8; 16];
        nvpool_rt::random::fill(&mut id).map_err(|e| {
            StateError::Store(StoreError::Backend {
                op: "drawing a key id",
                source: e.into(),
            })
        })?;
        keys.key_id = id.iter().map(|b| format!("{b:02x}")).collect();
        keys.updated_ms = self.clock.now_ms();
        // A plain put: the last writer's keys win, as with any secret.
        self.commit(&[], &[Op::Put(keys::host_keys(&keys.host), encode(&keys))])?;
        Ok(keys)
    }

    /// Forgets `host`'s keys; `NoHostKeys` when it had none.
    pub fn remove_host_keys(&self, host: &str) -> Result<(), StateError> {
        crate::attach::validate_host_nqn(host)?;
        let key = keys::host_keys(host);
        self.transact_key(&key, |version| {
            if version.is_none() {
                return Err(StateError::NoHostKeys(host.to_owned()));
            }
            let ops = vec![Op::Delete(key.clone())];
            Ok(Txn::Commit(vec![unchanged(&key, version)], ops, ()))
        })
    }

    /// Records a heartbeat now; returns the updated target.
    pub fn heartbeat(&self, id: &str) -> Result<Target, StateError> {
        self.heartbeat_reporting(id, &crate::rest::HeartbeatBody::default())
    }

    /// [`Self::heartbeat`] with what the target measured of its grain
    /// pools, kept under `/target-usage/{id}` in the same transaction so
    /// every control plane reads it (see [`crate::usage`]). Devices the
    /// target does not have, or that are no grain pools, are ignored.
    pub fn heartbeat_reporting(
        &self,
        id: &str,
        report: &crate::rest::HeartbeatBody,
    ) -> Result<Target, StateError> {
        if report.devices.is_empty() {
            return self.update_target(id, |t, now| {
                t.last_heartbeat_ms = t.last_heartbeat_ms.max(now)
            });
        }
        validate_id("target id", id, ID_BYTES_MAX)?;
        crate::usage::validate_report(report)?;
        let (key, usage_key) = (keys::target(id), crate::usage::key(id));
        self.retry(|| {
            let t = self
                .read::<Target>("target", &key)?
                .ok_or_else(|| StateError::TargetNotFound(id.to_owned()))?;
            let held = self.read::<TargetUsage>("target usage", &usage_key)?;
            let mut target = t.value;
            target.last_heartbeat_ms = target.last_heartbeat_ms.max(self.now());
            let usage = TargetUsage::merged(held.as_ref().map(|h| &h.value), &target, report);
            let mut conds = vec![unchanged(&key, Some(t.version))];
            let mut ops = vec![Op::Put(key.clone(), encode(&target))];
            if held.as_ref().map(|h| &h.value) != Some(&usage) {
                conds.push(unchanged(&usage_key, held.as_ref().map(|h| h.version)));
                ops.push(Op::Put(usage_key.clone(), encode(&usage)));
            }
            self.try_commit(Txn::Commit(conds, ops, target))
        })
    }

    /// Cordons (no new extents) or re-activates a target.
    pub fn set_target_state(&self, id: &str, state: TargetState) -> Result<Target, StateError> {
        self.update_target(id, |t, _| t.state = state)
    }

    fn update_target(
        &self,
        id: &str,
        change: impl Fn(&mut Target, u64),
    ) -> Result<Target, StateError> {
        validate_id("target id", id, ID_BYTES_MAX)?;
        self.update("target", &keys::target(id), |t: Option<Target>| {
            let mut t = t.ok_or_else(|| StateError::TargetNotFound(id.to_owned()))?;
            change(&mut t, self.now());
            Ok((Some(t.clone()), t))
        })
    }

    /// Forgets a target that holds no extents. Old extents it may still
    /// export (a forced detach, a moved copy) keep it until it has been
    /// reconciled — unless `force`: for a target that is gone for good,
    /// whose leftovers nobody can reach any more, they are forgotten with it.
    pub fn remove_target(&self, id: &str, force: bool) -> Result<(), StateError> {
        self.transact_allocation(|s| {
            let t = s
                .targets
                .get(id)
                .ok_or_else(|| StateError::TargetNotFound(id.to_owned()))?;
            let stale = s.stale_exports.get(id);
            let extents = s
                .volumes
                .values()
                .flat_map(|v| &v.value.extents)
                .chain(s.job_dests().map(|(_, d)| d))
                .filter(|e| e.target == id)
                .count()
                + if force {
                    0
                } else {
                    stale.map_or(0, |r| r.value.exports.len())
                };
            if extents > 0 {
                return Err(StateError::TargetInUse {
                    target: id.to_owned(),
                    extents,
                });
            }
            let key = keys::target(id);
            let mut conds = vec![Condition::VersionIs(key.clone(), t.version)];
            let mut ops = vec![
                Op::Delete(key),
                Op::Delete(keys::target_credential(id)),
                Op::Delete(crate::usage::key(id)),
            ];
            for (k, owner) in &s.target_addresses {
                if owner.value == id {
                    conds.push(Condition::VersionIs(k.clone(), owner.version));
                    ops.push(Op::Delete(k.clone()));
                }
            }
            if let Some(r) = stale {
                let skey = ak::stale_exports(id);
                conds.push(Condition::VersionIs(skey.clone(), r.version));
                ops.push(Op::Delete(skey));
            }
            Ok(Txn::Commit(conds, ops, ()))
        })
    }

    pub fn target(&self, id: &str) -> Result<TargetView, StateError> {
        validate_id("target id", id, ID_BYTES_MAX)?;
        let target: Target = self
            .read("target", &keys::target(id))?
            .ok_or_else(|| StateError::TargetNotFound(id.to_owned()))?
            .value;
        let health = self.health_of(&target, self.now());
        Ok(TargetView { target, health })
    }

    pub fn targets(&self) -> Result<Vec<TargetView>, StateError> {
        let now = self.now();
        let targets: Vec<Target> = self.read_all("target", keys::TARGETS)?;
        Ok(targets
            .into_iter()
            .map(|target| {
                let health = self.health_of(&target, now);
                TargetView { target, health }
            })
            .collect())
    }

    // ----- pools -----

    /// Creates a pool of registered devices that belong to no other pool
    /// and hold no extents yet. Creating the same pool again is a no-op;
    /// the same name with other devices is `PoolConflict`.
    pub fn create_pool(&self, name: &str, devices: &[DeviceRef]) -> Result<Pool, StateError> {
        validate_id("pool name", name, ID_BYTES_MAX)?;
        let wanted: BTreeSet<DeviceRef> = devices.iter().cloned().collect();
        if wanted.len() > DEVICES_PER_POOL_MAX {
            return Err(StateError::TooMany {
                what: "devices in a pool",
                max: DEVICES_PER_POOL_MAX,
            });
        }
        self.transact_allocation(|s| {
            if let Some(p) = s.pools.get(name) {
                return if p.value.devices.iter().cloned().collect::<BTreeSet<_>>() == wanted {
                    Ok(Txn::Done(p.value.clone()))
                } else {
                    Err(StateError::PoolConflict(name.to_owned()))
                };
            }
            if s.pools.len() >= POOLS_MAX {
                return Err(StateError::TooMany {
                    what: "pools",
                    max: POOLS_MAX,
                });
            }
            let owners = s.device_pools();
            for d in &wanted {
                let known = s
                    .targets
                    .get(&d.target)
                    .is_some_and(|t| t.value.device(&d.device).is_some());
                if !known {
                    return Err(StateError::UnknownDevice(d.clone()));
                }
                if let Some(pool) = owners.get(d) {
                    return Err(StateError::DeviceInPool {
                        device: d.clone(),
                        pool: pool.clone(),
                    });
                }
            }
            for v in s.volumes.values() {
                if let Some(e) = v
                    .value
                    .extents
                    .iter()
                    .find(|e| wanted.contains(&e.device_ref()))
                {
                    return Err(StateError::DeviceInUse {
                        device: e.device_ref(),
                        reason: format!("volume {} has extents on it", v.value.uuid),
                    });
                }
            }
            let pool = Pool {
                name: name.to_owned(),
                devices: wanted.iter().cloned().collect(),
                created_ms: self.now(),
            };
            let key = keys::pool(name);
            Ok(Txn::Commit(
                vec![Condition::Missing(key.clone())],
                vec![Op::Put(key, encode(&pool))],
                pool,
            ))
        })
    }

    /// Deletes a pool that no volume uses; its devices become unpooled.
    pub fn delete_pool(&self, name: &str) -> Result<(), StateError> {
        validate_id("pool name", name, ID_BYTES_MAX)?;
        self.transact_allocation(|s| {
            let p = s
                .pools
                .get(name)
                .ok_or_else(|| StateError::PoolNotFound(name.to_owned()))?;
            let volumes = s
                .volumes
                .values()
                .filter(|v| v.value.pool.as_deref() == Some(name))
                .count();
            if volumes > 0 {
                return Err(StateError::PoolInUse {
                    pool: name.to_owned(),
                    volumes,
                });
            }
            let key = keys::pool(name);
            Ok(Txn::Commit(
                vec![Condition::VersionIs(key.clone(), p.version)],
                vec![Op::Delete(key)],
                (),
            ))
        })
    }

    pub fn pools(&self) -> Result<Vec<Pool>, StateError> {
        self.read_all("pool", keys::POOLS)
    }

    // ----- volumes -----

    /// Creates a volume, placing its extents. Idempotent by UUID: the same
    /// spec again returns the existing volume (`created: false`); the same
    /// UUID with other parameters is `UuidConflict`. (A volume grown since
    /// its creation no longer matches its original size.)
    pub fn create_volume(&self, spec: &VolumeSpec) -> Result<Created, StateError> {
        self.create_volume_as(spec, None)
    }

    /// [`Self::create_volume`], thin or thick as asked; `None`: thin when
    /// the volume's candidate devices (its pool's, or the unpooled ones)
    /// include a grain pool. A kind no candidate device offers is
    /// `NoDevicesOfKind`; an existing volume of another kind than asked is
    /// `UuidConflict`.
    pub fn create_volume_as(
        &self,
        spec: &VolumeSpec,
        asked: Option<Provisioning>,
    ) -> Result<Created, StateError> {
        let extent_bytes = self.config.extent_bytes;
        spec.validate(extent_bytes)?;
        self.transact_allocation(|s| {
            if let Some(v) = s.volumes.get(&spec.uuid) {
                let existing = v.value.spec();
                let kind = s.provisioning_of(&v.value);
                return if existing == *spec && asked.is_none_or(|a| a == kind) {
                    Ok(Txn::Done(Created {
                        volume: v.value.clone(),
                        created: false,
                    }))
                } else {
                    Err(StateError::UuidConflict {
                        uuid: spec.uuid,
                        existing,
                        provisioning: kind,
                    })
                };
            }
            if let Some(other) = s.volume_names.get(&spec.name) {
                return Err(StateError::NameTaken {
                    name: spec.name.clone(),
                    uuid: other.value,
                });
            }
            if let Some(p) = &spec.pool {
                if !s.pools.contains_key(p) {
                    return Err(StateError::PoolNotFound(p.clone()));
                }
            }
            if s.volumes.len() >= VOLUMES_MAX {
                return Err(StateError::TooMany {
                    what: "volumes",
                    max: VOLUMES_MAX,
                });
            }
            let mut a = self.allocator(s)?;
            let kind = a.provisioning_for(spec.pool.as_deref(), asked)?;
            let extents = a.allocate_as(spec, extent_bytes, kind)?;
            let volume = Volume {
                uuid: spec.uuid,
                name: spec.name.clone(),
                size_bytes: spec.size_bytes,
                layout: spec.layout,
                pool: spec.pool.clone(),
                extent_bytes,
                extents,
                created_ms: self.now(),
            };
            volume.validate()?;
            let key = keys::volume(&spec.uuid);
            let name_key = keys::volume_name(&spec.name);
            let conds = vec![
                Condition::Missing(key.clone()),
                Condition::Missing(name_key.clone()),
            ];
            let ops = vec![
                Op::Put(key, encode(&volume)),
                Op::Put(name_key, encode(&spec.uuid)),
            ];
            Ok(Txn::Commit(
                conds,
                ops,
                Created {
                    volume,
                    created: true,
                },
            ))
        })
    }

    /// Grows a volume to `size_bytes`, adding rows of extents under the same
    /// placement rules. The same size is a no-op; a smaller one is `Shrink`.
    pub fn resize_volume(&self, uuid: &Uuid, size_bytes: u64) -> Result<Volume, StateError> {
        self.transact_allocation(|s| {
            let v = s
                .volumes
                .get(uuid)
                .ok_or_else(|| StateError::VolumeNotFound(uuid.to_string()))?;
            let mut volume = v.value.clone();
            if size_bytes < volume.size_bytes {
                return Err(StateError::Shrink {
                    uuid: *uuid,
                    size_bytes: volume.size_bytes,
                    requested: size_bytes,
                });
            }
            if size_bytes == volume.size_bytes {
                return Ok(Txn::Done(volume));
            }
            let added = self.allocator(s)?.grow(&volume, size_bytes)?;
            volume.size_bytes = size_bytes;
            volume.extents.extend(added);
            volume.validate()?;
            let key = keys::volume(uuid);
            Ok(Txn::Commit(
                vec![Condition::VersionIs(key.clone(), v.version)],
                vec![Op::Put(key, encode(&volume))],
                volume,
            ))
        })
    }

    /// Deletes a volume and frees its extents; returns what was deleted.
    /// Refused while the volume is attached (detach first). Its extents on
    /// grain pools (and its copy jobs' new ones) become stale exports:
    /// taken until their targets have released their trees.
    pub fn delete_volume(&self, uuid: &Uuid) -> Result<Volume, StateError> {
        self.transact_allocation(|s| {
            let v = s
                .volumes
                .get(uuid)
                .ok_or_else(|| StateError::VolumeNotFound(uuid.to_string()))?;
            let hosts: Vec<String> = s
                .attachments_of(uuid)
                .iter()
                .map(|a| a.value.host_nqn.clone())
                .collect();
            if !hosts.is_empty() {
                return Err(StateError::Attached {
                    volume: *uuid,
                    hosts,
                });
            }
            let snapshots = s.snapshots_of(uuid);
            if !snapshots.is_empty() {
                return Err(StateError::Conflict {
                    kind: "volume_has_snapshots",
                    message: format!(
                        "volume {uuid} has {} snapshots ({}): delete them first",
                        snapshots.len(),
                        snapshots
                            .iter()
                            .map(|r| r.value.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
            }
            let key = keys::volume(uuid);
            let name_key = keys::volume_name(&v.value.name);
            let mut conds = vec![Condition::VersionIs(key.clone(), v.version)];
            let mut ops = vec![
                Op::Delete(key),
                Op::Delete(name_key),
                Op::Delete(keys::deleting(uuid)),
                Op::Delete(crate::read_only::read_only_key(uuid)),
            ];
            if let Some(f) = s.failed_copies.get(uuid) {
                let fkey = ak::failed_copies(uuid);
                conds.push(Condition::VersionIs(fkey.clone(), f.version));
                ops.push(Op::Delete(fkey));
            }
            if let Some(c) = s.copy_states.get(uuid) {
                let ckey = crate::resync::copy_state_key(uuid);
                conds.push(Condition::VersionIs(ckey.clone(), c.version));
                ops.push(Op::Delete(ckey));
            }
            if let Some(w) = s.write_epochs.get(uuid) {
                let wkey = crate::snapshots::write_epoch_key(uuid);
                conds.push(Condition::VersionIs(wkey.clone(), w.version));
                ops.push(Op::Delete(wkey));
            }
            // A rollback's mark goes with its volume (absent: a no-op).
            ops.push(Op::Delete(crate::rollback::rollback_key(uuid)));
            let mut trees: BTreeMap<String, Vec<crate::attach::Export>> = BTreeMap::new();
            let dests = s.job_dests().filter(|(u, _)| *u == uuid).map(|(_, d)| d);
            for e in v.value.extents.iter().chain(dests) {
                if let Some(x) = s.freed_tree(e) {
                    trees.entry(e.target.clone()).or_default().push(x);
                }
            }
            for (target, xs) in trees {
                let (c, o) = s.add_stale_exports(&target, xs);
                conds.push(c);
                ops.push(o);
            }
            Ok(Txn::Commit(conds, ops, v.value.clone()))
        })
    }

    /// Marks `uuid` as being deleted: attaches are refused until the
    /// delete removes the mark with the volume, or [`Self::unmark_deleting`].
    pub fn mark_deleting(&self, uuid: &Uuid) -> Result<(), StateError> {
        let key = keys::volume(uuid);
        self.transact_key(&key, |version| {
            if version.is_none() {
                return Err(StateError::VolumeNotFound(uuid.to_string()));
            }
            let ops = vec![Op::Put(keys::deleting(uuid), Vec::new())];
            Ok(Txn::Commit(vec![unchanged(&key, version)], ops, ()))
        })
    }

    /// Takes the mark of [`Self::mark_deleting`] back (a forced delete
    /// that failed).
    pub fn unmark_deleting(&self, uuid: &Uuid) -> Result<(), StateError> {
        self.delete_if_present(&keys::deleting(uuid))
    }

    fn view(
        &self,
        volume: Volume,
        targets: &BTreeMap<String, Target>,
        now: u64,
        attachments: &[&Attachment],
        failed_copies: Option<&FailedCopies>,
        jobs: Vec<crate::resync::CopyJob>,
    ) -> VolumeView {
        let failed: BTreeSet<usize> = attachments
            .iter()
            .flat_map(|a| a.failed_extents.iter())
            .chain(failed_copies.iter().flat_map(|f| f.extents.iter()))
            .map(|&i| i as usize)
            .collect();
        let status = volume.status_with(
            |id| {
                targets
                    .get(id)
                    .map_or(Health::Offline, |t| self.health_of(t, now))
            },
            &failed,
        );
        VolumeView {
            provisioning: volume.provisioning_on(targets),
            volume,
            status,
            failed_extents: failed.into_iter().map(|i| i as u32).collect(),
            jobs,
        }
    }

    fn target_map(&self) -> Result<BTreeMap<String, Target>, StateError> {
        Ok(self
            .targets()?
            .into_iter()
            .map(|v| (v.target.id.clone(), v.target))
            .collect())
    }

    pub fn volume(&self, uuid: &Uuid) -> Result<VolumeView, StateError> {
        let volume: Volume = self
            .read("volume", &keys::volume(uuid))?
            .ok_or_else(|| StateError::VolumeNotFound(uuid.to_string()))?
            .value;
        let attachments: Vec<Attachment> =
            self.read_all("attachment", &ak::volume_attachments(uuid))?;
        let refs: Vec<&Attachment> = attachments.iter().collect();
        let failed = self
            .read::<FailedCopies>("failed copies", &ak::failed_copies(uuid))?
            .map(|f| f.value);
        let jobs = self.copy_state(uuid)?.jobs;
        Ok(self.view(
            volume,
            &self.target_map()?,
            self.now(),
            &refs,
            failed.as_ref(),
            jobs,
        ))
    }

    pub fn volume_by_name(&self, name: &str) -> Result<VolumeView, StateError> {
        validate_id("volume name", name, crate::limits::NAME_BYTES_MAX)?;
        let uuid: Uuid = self
            .read("volume name", &keys::volume_name(name))?
            .ok_or_else(|| StateError::VolumeNotFound(name.to_owned()))?
            .value;
        self.volume(&uuid)
    }

    pub fn volumes(&self) -> Result<Vec<VolumeView>, StateError> {
        let s = self.snapshot()?;
        let now = self.now();
        let targets: BTreeMap<String, Target> = s
            .targets
            .iter()
            .map(|(id, t)| (id.clone(), t.value.clone()))
            .collect();
        Ok(s.volumes
            .values()
            .map(|v| {
                let attachments: Vec<&Attachment> = s
                    .attachments_of(&v.value.uuid)
                    .into_iter()
                    .map(|a| &a.value)
                    .collect();
                let failed = s.failed_copies.get(&v.value.uuid).map(|f| &f.value);
                let jobs = s.copy_state(&v.value.uuid).jobs;
                self.view(v.value.clone(), &targets, now, &attachments, failed, jobs)
            })
            .collect())
    }

    // ----- capacity and consistency -----

    /// Capacity of the cluster, each pool and the unpooled devices, summed
    /// from the volumes' extents and the grain pools' reported usage.
    pub fn capacity(&self) -> Result<CapacityReport, StateError> {
        let s = self.snapshot()?;
        let allocator = self.allocator(&s)?;
        let reported: BTreeMap<String, TargetUsage> = self
            .read_all::<TargetUsage>("target usage", crate::usage::TARGET_USAGE)?
            .into_iter()
            .map(|u| (u.target.clone(), u))
            .collect();
        let extent_bytes = self.config.extent_bytes;
        let devices: Vec<DeviceCapacity> = allocator
            .devices()
            .iter()
            .map(|space| {
                let info = &space.info;
                let device = s
                    .targets
                    .get(&info.target)
                    .and_then(|t| t.value.device(&info.device));
                let thin = device.is_some_and(Device::is_grain_pool);
                let capacity_bytes = device.map_or(info.capacity_bytes, |d| d.capacity_bytes);
                let provisioned_bytes = space.used_bytes();
                let (used_bytes, free_extents) = if thin {
                    let used = reported
                        .get(&info.target)
                        .and_then(|u| u.devices.get(&info.device))
                        .map_or(0, |&u| u.min(capacity_bytes));
                    (used, (capacity_bytes - used) / extent_bytes)
                } else {
                    (provisioned_bytes, space.free_extents(extent_bytes))
                };
                DeviceCapacity {
                    target: info.target.clone(),
                    device: info.device.clone(),
                    pool: info.pool.clone(),
                    thin,
                    capacity_bytes,
                    used_bytes,
                    free_bytes: capacity_bytes.saturating_sub(used_bytes),
                    free_extents,
                    provisioned_bytes,
                }
            })
            .collect();
        let mut report = CapacityReport::default();
        for name in s.pools.keys() {
            report.pools.insert(name.clone(), Capacity::default());
        }
        for u in &devices {
            report.total.add(u);
            match &u.pool {
                Some(p) => report.pools.entry(p.clone()).or_default().add(u),
                None => report.unpooled.add(u),
            }
        }
        report.devices = devices;
        Ok(report)
    }

    /// Checks every invariant of the stored state and lists the violations
    /// (empty: consistent). For tests, crash recovery checks and a future
    /// `fsck` command.
    pub fn check(&self) -> Result<Vec<String>, StateError> {
        let s = self.snapshot()?;
        let mut problems = Vec::new();
        let pools = s.device_pools();
        for (uuid, v) in &s.volumes {
            let v = &v.value;
            if let Err(e) = v.validate() {
                problems.push(e.to_string());
            }
            match s.volume_names.get(&v.name) {
                Some(n) if n.value == *uuid => {}
                _ => problems.push(format!("volume {uuid}: name {} is not indexed", v.name)),
            }
            for e in &v.extents {
                let known = s
                    .targets
                    .get(&e.target)
                    .is_some_and(|t| t.value.device(&e.device).is_some());
                if !known {
                    problems.push(format!(
                        "volume {uuid}: extent on unknown device {}",
                        e.device_ref()
                    ));
                }
                if pools.get(&e.device_ref()) != v.pool.as_ref() {
                    problems.push(format!(
                        "volume {uuid} (pool {:?}): extent on {} outside its pool",
                        v.pool,
                        e.device_ref()
                    ));
                }
            }
            if let Some(p) = &v.pool {
                if !s.pools.contains_key(p) {
                    problems.push(format!("volume {uuid}: pool {p} does not exist"));
                }
            }
        }
        for (name, u) in &s.volume_names {
            match s.volumes.get(&u.value) {
                Some(v) if v.value.name == *name => {}
                _ => problems.push(format!("name {name} points at missing volume {}", u.value)),
            }
        }
        let mut addresses: BTreeMap<(AddressKind, SocketAddr), &str> = BTreeMap::new();
        for t in s.targets.values().map(|v| &v.value) {
            for kind in AddressKind::ALL {
                if let Some(a) = kind.of(t) {
                    if let Some(other) = addresses.insert((kind, a), &t.id) {
                        problems.push(format!(
                            "targets {other} and {} share {} {a}",
                            t.id,
                            kind.field()
                        ));
                    }
                }
            }
        }
        for (key, owner) in &s.target_addresses {
            let used = s.targets.get(&owner.value).is_some_and(|t| {
                AddressKind::keys_of(&t.value)
                    .iter()
                    .any(|(_, _, k)| k == key)
            });
            if !used {
                problems.push(format!(
                    "address index {key} names target {}, which does not use it",
                    owner.value
                ));
            }
        }
        let mut owners: BTreeMap<&DeviceRef, &str> = BTreeMap::new();
        for (name, p) in &s.pools {
            for d in &p.value.devices {
                if let Some(other) = owners.insert(d, name) {
                    problems.push(format!("device {d} is in pools {other} and {name}"));
                }
            }
        }
        let mut nsids: BTreeSet<(String, String, u32)> = BTreeSet::new();
        for ((uuid, host), a) in &s.attachments {
            let Some(v) = s.volumes.get(uuid) else {
                problems.push(format!("attachment of missing volume {uuid} to {host}"));
                continue;
            };
            if a.value.nsids.len() > v.value.extents.len() {
                problems.push(format!(
                    "attachment of {uuid} to {host}: {} NSIDs for {} extents",
                    a.value.nsids.len(),
                    v.value.extents.len()
                ));
            }
            for (t, x) in s.attachment_exports(&v.value, &a.value) {
                if !nsids.insert((host.clone(), t.clone(), x.nsid)) {
                    problems.push(format!("host {host} has NSID {} twice on {t}", x.nsid));
                }
            }
        }
        // Copy records resolve: a job only ever writes a stale copy, and
        // reads one that is in sync.
        for (uuid, cs) in &s.copy_states {
            let Some(v) = s.volumes.get(uuid) else {
                problems.push(format!("copy state of missing volume {uuid}"));
                continue;
            };
            let stale: BTreeSet<u32> = s
                .failed_copies
                .get(uuid)
                .map(|f| f.value.extents.iter().copied().collect())
                .unwrap_or_default();
            for j in &cs.value.jobs {
                if j.dest.is_none() && !stale.contains(&j.extent) {
                    problems.push(format!(
                        "volume {uuid}: job {} fills extent {}, which is not stale",
                        j.id, j.extent
                    ));
                }
                // A new extent is a copy of its slot, on a target holding
                // nothing else of the row.
                if let (Some(d), Some(me)) = (&j.dest, v.value.extents.get(j.extent as usize)) {
                    let clash = v
                        .value
                        .extents
                        .iter()
                        .any(|e| e.row == d.row && e.target == d.target);
                    if (d.row, d.member, d.copy) != (me.row, me.member, me.copy) || clash {
                        problems.push(format!(
                            "volume {uuid}: job {} puts extent {} on {} against the placement rules",
                            j.id,
                            j.extent,
                            d.device_ref()
                        ));
                    }
                }
                if stale.contains(&j.source) || j.source as usize >= v.value.extents.len() {
                    problems.push(format!(
                        "volume {uuid}: job {} reads extent {}, which is not in sync",
                        j.id, j.source
                    ));
                }
            }
        }
        // Overlapping and out-of-bounds extents: loading them all fails.
        if let Err(e) = self.allocator(&s) {
            problems.push(e.to_string());
        }
        Ok(problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::limits::EXTENT_BYTES_MIN;
    use crate::model::Layout;
    use crate::store::MemStore;

    const E: u64 = EXTENT_BYTES_MIN;
    const T0: u64 = 1_000_000;

    struct Fixture {
        cluster: Cluster,
        clock: Arc<ManualClock>,
    }

    fn fixture() -> Fixture {
        let clock = Arc::new(ManualClock::new(T0));
        let config = StateConfig {
            extent_bytes: E,
            ..StateConfig::default()
        };
        let cluster = Cluster::new(Arc::new(MemStore::new()), clock.clone(), config).unwrap();
        Fixture { cluster, clock }
    }

    fn registration(i: usize, rack: &str, devices: usize, extents: u64) -> TargetRegistration {
        TargetRegistration {
            id: format!("t{i}"),
            name: format!("host{i}"),
            addr: format!("10.0.0.{i}:4420").parse().unwrap(),
            admin_addr: format!("10.0.0.{i}:4480").parse().unwrap(),
            labels: [("rack".to_string(), rack.to_string())].into(),
            devices: (0..devices)
                .map(|d| Device {
                    id: format!("d{d}"),
                    backend: format!("file:/dev/nvme{d}n1"),
                    capacity_bytes: extents * E,
                    labels: BTreeMap::new(),
                })
                .collect(),
            rdma_addr: None,
            admin_tls: false,
            admin_token: None,
        }
    }

    fn spec(n: u8, layout: Layout, size_bytes: u64, pool: Option<&str>) -> VolumeSpec {
        VolumeSpec {
            uuid: Uuid([n; 16]),
            name: format!("vol{n}"),
            size_bytes,
            layout,
            pool: pool.map(str::to_owned),
        }
    }

    fn assert_consistent(c: &Cluster) {
        assert_eq!(c.check().unwrap(), Vec::<String>::new());
    }

    #[test]
    fn targets_register_heartbeat_and_expire() {
        let f = fixture();
        let c = &f.cluster;
        let t = c.register_target(&registration(0, "a", 2, 4)).unwrap();
        assert_eq!((t.registered_ms, t.last_heartbeat_ms), (T0, T0));
        assert_eq!(t.state, TargetState::Active);
        f.clock.advance(1000);
        c.set_target_state("t0", TargetState::Cordoned).unwrap();
        let mut reg = registration(0, "b", 3, 4);
        reg.addr = "10.0.1.1:4420".parse().unwrap();
        let t = c.register_target(&reg).unwrap();
        assert_eq!(t.registered_ms, T0, "re-registration keeps the first time");
        assert_eq!(t.state, TargetState::Cordoned, "and the operator's state");
        assert_eq!((t.devices.len(), t.addr), (3, reg.addr));

        f.clock.advance(HEARTBEAT_TIMEOUT_MS);
        assert_eq!(c.target("t0").unwrap().health, Health::Online);
        f.clock.advance(1);
        assert_eq!(c.target("t0").unwrap().health, Health::Offline);
        c.heartbeat("t0").unwrap();
        assert_eq!(c.targets().unwrap()[0].health, Health::Online);
        assert!(matches!(
            c.heartbeat("t9"),
            Err(StateError::TargetNotFound(_))
        ));
        assert!(matches!(c.heartbeat("a/b"), Err(StateError::Invalid(_))));
        let mut bad = registration(1, "a", 1, 4);
        bad.devices.push(bad.devices[0].clone());
        assert!(matches!(
            c.register_target(&bad),
            Err(StateError::Invalid(_))
        ));
    }

    #[test]
    fn a_target_credential_lives_beside_the_record_and_dies_with_it() {
        let f = fixture();
        let c = &f.cluster;
        let secret = |t: &str| Secret::new(t).unwrap();
        let mut r = registration(0, "r0", 1, 4);
        r.admin_token = Some(secret("first-admin-token-0123"));
        assert!(!format!("{r:?}").contains("first-admin-token"));
        c.register_target(&r).unwrap();
        assert_eq!(
            c.target_credential("t0").unwrap(),
            Some(secret("first-admin-token-0123"))
        );
        // Not in the record, its views or the snapshot.
        let raw = c.store().get(&keys::target("t0")).unwrap().unwrap().value;
        assert!(!String::from_utf8_lossy(&raw).contains("first-admin-token"));
        assert!(!format!("{:?}", c.targets().unwrap()).contains("first-admin-token"));
        assert!(!format!("{:?}", c.snapshot().unwrap()).contains("first-admin-token"));
        // A registration without one keeps it; with another, replaces it.
        r.admin_token = None;
        c.register_target(&r).unwrap();
        assert_eq!(
            c.target_credential("t0").unwrap(),
            Some(secret("first-admin-token-0123"))
        );
        r.admin_token = Some(secret("second-admin-token-0123"));
        c.register_target(&r).unwrap();
        assert_eq!(
            c.target_credential("t0").unwrap(),
            Some(secret("second-admin-token-0123"))
        );
        assert_eq!(c.target_credential("t1").unwrap(), None);
        c.remove_target("t0", false).unwrap();
        assert_eq!(c.target_credential("t0").unwrap(), None);
        assert!(c
            .store()
            .get(&keys::target_credential("t0"))
            .unwrap()
            .is_none());
    }

    #[test]
    fn admin_tls_follows_the_latest_registration() {
        let f = fixture();
        let c = &f.cluster;
        let mut reg = registration(0, "r0", 1, 4);
        reg.admin_tls = true;
        assert!(c.register_target(&reg).unwrap().admin_tls);
        assert!(c.target("t0").unwrap().target.admin_tls);
        // The target restarted without its certificate: plain HTTP again.
        reg.admin_tls = false;
        assert!(!c.register_target(&reg).unwrap().admin_tls);
        assert!(!c.target("t0").unwrap().target.admin_tls);
    }

    #[test]
    fn addresses_are_unique_also_against_records_older_than_the_index() {
        let f = fixture();
        let c = &f.cluster;
        c.register_target(&registration(0, "r0", 1, 4)).unwrap();
        // A record written before the index existed: no index keys.
        let mut old = registration(1, "r1", 1, 4);
        old.admin_addr = "10.0.0.9:4480".parse().unwrap();
        let t = Target {
            id: old.id.clone(),
            name: old.name.clone(),
            addr: old.addr,
            admin_addr: old.admin_addr,
            labels: old.labels.clone(),
            devices: old.devices.clone(),
            registered_ms: T0,
            last_heartbeat_ms: T0,
            state: TargetState::Active,
            rdma_addr: None,
            admin_tls: false,
        };
        let done = c
            .store()
            .txn(&[], &[Op::Put(keys::target("t1"), encode(&t))])
            .unwrap();
        assert!(matches!(done, TxnOutcome::Committed { .. }));
        let mut b = registration(2, "r2", 1, 4);
        b.admin_addr = "10.0.0.9:4480".parse().unwrap();
        match c.register_target(&b) {
            Err(StateError::AddressTaken { kind, target, .. }) => {
                assert_eq!((kind, target.as_str()), (AddressKind::Admin, "t1"))
            }
            r => panic!("{r:?}"),
        }
        // The old record registering again gets its keys.
        c.register_target(&old).unwrap();
        let s = c.snapshot().unwrap();
        let key = keys::target_address("admin", &old.admin_addr);
        assert_eq!(s.target_addresses[&key].value, "t1");
        assert!(c.check().unwrap().is_empty(), "{:?}", c.check());
        // A target's TCP and RDMA listeners may share ip:port (separate
        // port spaces), and another target may not take either.
        let mut r0 = registration(0, "r0", 1, 4);
        r0.rdma_addr = Some(r0.addr);
        c.register_target(&r0).unwrap();
        let mut b = registration(2, "r2", 1, 4);
        b.rdma_addr = Some(r0.addr);
        assert!(matches!(
            c.register_target(&b),
            Err(StateError::AddressTaken {
                kind: AddressKind::NvmeRdma,
                ..
            })
        ));
        c.remove_target("t0", false).unwrap();
        c.register_target(&b).unwrap();
        assert!(c.check().unwrap().is_empty(), "{:?}", c.check());
    }

    #[test]
    fn create_is_idempotent_by_uuid() {
        let f = fixture();
        let c = &f.cluster;
        for i in 0..3 {
            c.register_target(&registration(i, &format!("r{i}"), 1, 8))
                .unwrap();
        }
        let s = spec(1, Layout::Raid1 { copies: 2 }, 3 * E, None);
        let first = c.create_volume(&s).unwrap();
        assert!(first.created);
        assert_eq!(first.volume.extents.len(), 6);
        let again = c.create_volume(&s).unwrap();
        assert!(!again.created);
        assert_eq!(again.volume, first.volume, "same request, same result");

        let mut bigger = s.clone();
        bigger.size_bytes += E;
        assert!(matches!(
            c.create_volume(&bigger),
            Err(StateError::UuidConflict { .. })
        ));
        let mut other = spec(2, Layout::Concat, E, None);
        other.name = s.name.clone();
        assert!(matches!(
            c.create_volume(&other),
            Err(StateError::NameTaken { .. })
        ));
        let bad = spec(3, Layout::Raid1 { copies: 4 }, E, None);
        assert!(matches!(c.create_volume(&bad), Err(StateError::Invalid(_))));
        let too_wide = spec(4, Layout::Raid1 { copies: 3 }, E, None);
        c.create_volume(&too_wide).unwrap();
        let layout = Layout::Raid10 {
            stripe_bytes: 4096,
            width: 2,
            copies: 2,
        };
        assert!(matches!(
            c.create_volume(&spec(5, layout, E, None)),
            Err(StateError::Placement(PlacementError::NotEnoughTargets {
                need: 4,
                have: 3,
                ..
            }))
        ));
        assert_eq!(c.volume_by_name("vol1").unwrap().volume.uuid, s.uuid);
        assert_consistent(c);
    }

    #[test]
    fn resize_and_delete() {
        let f = fixture();
        let c = &f.cluster;
        for i in 0..2 {
            c.register_target(&registration(i, "a", 1, 6)).unwrap();
        }
        let s = spec(1, Layout::Raid1 { copies: 2 }, E, None);
        c.create_volume(&s).unwrap();
        let v = c.resize_volume(&s.uuid, 3 * E).unwrap();
        assert_eq!((v.size_bytes, v.extents.len()), (3 * E, 6));
        assert_eq!(c.resize_volume(&s.uuid, 3 * E).unwrap(), v);
        assert!(matches!(
            c.resize_volume(&s.uuid, E),
            Err(StateError::Shrink { .. })
        ));
        assert!(matches!(
            c.resize_volume(&s.uuid, 7 * E),
            Err(StateError::Placement(PlacementError::NoSpace { .. }))
        ));
        assert_eq!(
            c.volume(&s.uuid).unwrap().volume.size_bytes,
            3 * E,
            "failed grow changes nothing"
        );
        let cap = c.capacity().unwrap();
        assert_eq!(cap.total.used_bytes, 6 * E);
        assert_eq!(
            cap.total.free_bytes + cap.total.used_bytes,
            cap.total.total_bytes
        );

        let deleted = c.delete_volume(&s.uuid).unwrap();
        assert_eq!(deleted.uuid, s.uuid);
        assert!(matches!(
            c.delete_volume(&s.uuid),
            Err(StateError::VolumeNotFound(_))
        ));
        assert!(matches!(
            c.volume_by_name("vol1"),
            Err(StateError::VolumeNotFound(_))
        ));
        assert_eq!(c.capacity().unwrap().total.used_bytes, 0);
        // The name and the space are free again.
        let mut again = spec(2, Layout::Raid1 { copies: 2 }, 6 * E, None);
        again.name = s.name.clone();
        c.create_volume(&again).unwrap();
        assert_consistent(c);
    }

    #[test]
    fn pools_partition_devices() {
        let f = fixture();
        let c = &f.cluster;
        for i in 0..4 {
            c.register_target(&registration(i, "a", 2, 4)).unwrap();
        }
        let fast: Vec<DeviceRef> = (0..4)
            .map(|i| DeviceRef::new(&format!("t{i}"), "d1"))
            .collect();
        let pool = c.create_pool("fast", &fast).unwrap();
        assert_eq!(c.create_pool("fast", &fast).unwrap(), pool, "idempotent");
        assert!(matches!(
            c.create_pool("fast", &fast[..2]),
            Err(StateError::PoolConflict(_))
        ));
        assert!(matches!(
            c.create_pool("other", &fast[..1]),
            Err(StateError::DeviceInPool { .. })
        ));
        assert!(matches!(
            c.create_pool("other", &[DeviceRef::new("t0", "d9")]),
            Err(StateError::UnknownDevice(_))
        ));
        assert!(matches!(
            c.create_volume(&spec(1, Layout::Concat, E, Some("nope"))),
            Err(StateError::PoolNotFound(_))
        ));
        let pooled = c
            .create_volume(&spec(1, Layout::Raid1 { copies: 3 }, 4 * E, Some("fast")))
            .unwrap()
            .volume;
        assert!(pooled.extents.iter().all(|e| e.device == "d1"));
        let plain = c
            .create_volume(&spec(2, Layout::Raid1 { copies: 2 }, 2 * E, None))
            .unwrap()
            .volume;
        assert!(plain.extents.iter().all(|e| e.device == "d0"));
        // A device holding extents cannot join a pool.
        assert!(matches!(
            c.create_pool("late", &[DeviceRef::new(&plain.extents[0].target, "d0")]),
            Err(StateError::DeviceInUse { .. })
        ));
        let cap = c.capacity().unwrap();
        assert_eq!(cap.pools["fast"].total_bytes, 16 * E);
        assert_eq!(cap.pools["fast"].used_bytes, 12 * E);
        assert_eq!(cap.unpooled.used_bytes, 4 * E);
        assert_eq!(cap.total.total_bytes, 32 * E);
        assert_eq!(cap.total.free_extents, 16);
        assert!(matches!(
            c.delete_pool("fast"),
            Err(StateError::PoolInUse { volumes: 1, .. })
        ));
        c.delete_volume(&pooled.uuid).unwrap();
        c.delete_pool("fast").unwrap();
        assert!(c.pools().unwrap().is_empty());
        assert_consistent(c);
    }

    #[test]
    fn volume_status_follows_target_health() {
        let f = fixture();
        let c = &f.cluster;
        for i in 0..3 {
            c.register_target(&registration(i, "a", 1, 4)).unwrap();
        }
        let mirror = c
            .create_volume(&spec(1, Layout::Raid1 { copies: 2 }, E, None))
            .unwrap()
            .volume;
        let plain = c
            .create_volume(&spec(2, Layout::Concat, E, None))
            .unwrap()
            .volume;
        assert_eq!(c.volume(&mirror.uuid).unwrap().status, VolumeStatus::Online);
        // Everyone but the first copy's target keeps heartbeating.
        let down = mirror.extents[0].target.clone();
        f.clock.advance(HEARTBEAT_TIMEOUT_MS + 1);
        for i in 0..3 {
            let id = format!("t{i}");
            if id != down {
                c.heartbeat(&id).unwrap();
            }
        }
        assert_eq!(
            c.volume(&mirror.uuid).unwrap().status,
            VolumeStatus::Degraded
        );
        let plain_status = c.volume(&plain.uuid).unwrap().status;
        let expected = if plain.extents[0].target == down {
            VolumeStatus::Offline
        } else {
            VolumeStatus::Online
        };
        assert_eq!(plain_status, expected);
        // New volumes avoid the offline target.
        let v = c
            .create_volume(&spec(3, Layout::Raid1 { copies: 2 }, E, None))
            .unwrap()
            .volume;
        assert!(v.extents.iter().all(|e| e.target != down));
        assert!(matches!(
            c.create_volume(&spec(4, Layout::Raid1 { copies: 3 }, E, None)),
            Err(StateError::Placement(PlacementError::NotEnoughTargets {
                have: 2,
                ..
            }))
        ));
        f.clock.advance(HEARTBEAT_TIMEOUT_MS + 1);
        let statuses: Vec<VolumeStatus> = c.volumes().unwrap().iter().map(|v| v.status).collect();
        assert_eq!(statuses, vec![VolumeStatus::Offline; 3]);
    }

    #[test]
    fn devices_and_targets_in_use_are_protected() {
        let f = fixture();
        let c = &f.cluster;
        for i in 0..2 {
            c.register_target(&registration(i, "a", 1, 4)).unwrap();
        }
        c.register_target(&registration(2, "a", 1, 4)).unwrap();
        c.set_target_state("t2", TargetState::Cordoned).unwrap();
        let v = c
            .create_volume(&spec(1, Layout::Raid1 { copies: 2 }, 2 * E, None))
            .unwrap()
            .volume;
        assert!(v.extents.iter().all(|e| e.target != "t2"), "cordoned");
        // Shrinking below the extents, or dropping the device, is refused.
        assert!(matches!(
            c.register_target(&registration(0, "a", 1, 1)),
            Err(StateError::DeviceInUse { .. })
        ));
        assert!(matches!(
            c.register_target(&registration(0, "a", 0, 4)),
            Err(StateError::DeviceInUse { .. })
        ));
        c.register_target(&registration(0, "a", 2, 8)).unwrap();
        assert!(matches!(
            c.remove_target("t0", false),
            Err(StateError::TargetInUse { extents: 2, .. })
        ));
        c.remove_target("t2", false).unwrap();
        assert!(matches!(
            c.remove_target("t2", false),
            Err(StateError::TargetNotFound(_))
        ));
        assert_consistent(c);
    }

    #[test]
    fn corrupt_or_inconsistent_state_stops_mutations() {
        let f = fixture();
        let c = &f.cluster;
        for i in 0..2 {
            c.register_target(&registration(i, "a", 1, 4)).unwrap();
        }
        let v = c
            .create_volume(&spec(1, Layout::Concat, E, None))
            .unwrap()
            .volume;
        // A second record claiming the same extent, written behind our back.
        let mut twin = v.clone();
        twin.uuid = Uuid([2; 16]);
        twin.name = "twin".into();
        let store = c.store();
        let ops = [
            Op::Put(keys::volume(&twin.uuid), encode(&twin)),
            Op::Put(keys::volume_name("twin"), encode(&twin.uuid)),
        ];
        assert!(matches!(
            store.txn(&[], &ops).unwrap(),
            TxnOutcome::Committed { .. }
        ));
        let problems = c.check().unwrap();
        assert!(
            problems.iter().any(|p| p.contains("overlaps")),
            "{problems:?}"
        );
        assert!(matches!(
            c.create_volume(&spec(3, Layout::Concat, E, None)),
            Err(StateError::Inconsistent(_))
        ));
        let misfiled = [Op::Put(keys::volume(&Uuid([3; 16])), encode(&v))];
        assert!(matches!(
            store.txn(&[], &misfiled).unwrap(),
            TxnOutcome::Committed { .. }
        ));
        assert!(matches!(c.snapshot(), Err(StateError::Corrupt { .. })));
        let undo = [Op::Delete(keys::volume(&Uuid([3; 16])))];
        assert!(matches!(
            store.txn(&[], &undo).unwrap(),
            TxnOutcome::Committed { .. }
        ));
        assert!(c.snapshot().is_ok());
        let garbage = [Op::Put(keys::pool("p"), vec![9, 9])];
        assert!(matches!(
            store.txn(&[], &garbage).unwrap(),
            TxnOutcome::Committed { .. }
        ));
        assert!(matches!(c.snapshot(), Err(StateError::Corrupt { .. })));
    }

    /// Four "processes" (clusters with their own mutex) over one store:
    /// only compare-and-swap keeps them apart.
    #[test]
    fn concurrent_creates_never_share_an_extent() {
        let f = fixture();
        let c = &f.cluster;
        for i in 0..4 {
            c.register_target(&registration(i, &format!("r{}", i % 2), 2, 16))
                .unwrap();
        }
        std::thread::scope(|s| {
            for t in 0..4u8 {
                let c = Cluster::new(c.store.clone(), f.clock.clone(), c.config.clone()).unwrap();
                s.spawn(move || {
                    for n in 0..6u8 {
                        let layout = if n % 2 == 0 {
                            Layout::Raid1 { copies: 2 }
                        } else {
                            Layout::Concat
                        };
                        c.create_volume(&spec(t * 10 + n, layout, 2 * E, None))
                            .unwrap();
                    }
                });
            }
        });
        assert_eq!(c.volumes().unwrap().len(), 24);
        assert_eq!(
            c.capacity().unwrap().total.used_bytes,
            (12 * 4 + 12 * 2) * E
        );
        assert_consistent(c);
    }

    #[test]
    fn watchers_see_every_mutation() {
        let f = fixture();
        let c = &f.cluster;
        let start = c.store().revision().unwrap();
        c.register_target(&registration(0, "a", 1, 4)).unwrap();
        let v = c
            .create_volume(&spec(1, Layout::Concat, E, None))
            .unwrap()
            .volume;
        c.delete_volume(&v.uuid).unwrap();
        let changes = c.store().changes_since(start).unwrap();
        let vol_key = keys::volume(&v.uuid);
        let kinds: Vec<bool> = changes
            .iter()
            .filter(|ch| ch.key == vol_key)
            .map(|ch| ch.value.is_some())
            .collect();
        assert_eq!(kinds, [true, false], "put then delete");
        assert!(changes.iter().any(|ch| ch.key == keys::target("t0")));
    }
}
