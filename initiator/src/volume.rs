//! The volume engine: a pooled volume, described by a control-plane
//! [`ConnectionPlan`], served as one [`BlockDev`].
//!
//! ```text
//!  read/write(offset, buf)
//!     │  Geometry::segments → one run per extent (runs.rs)
//!     ▼
//!  run ─┬─ read: one healthy copy, the least loaded; another on a path failure
//!       └─ write/zeroes/discard/flush: every healthy copy, joined
//!     │
//!     ▼  Device (namespace handle) per extent copy
//!  ControllerIo per (target address, subsystem) ── I/O queues ── TCP
//! ```
//!
//! **Connections.** A host has one subsystem per target, holding every
//! extent of its volumes there as a namespace, so the volume connects one
//! controller per distinct `(addr, subsystem_nqn)` of the plan and one
//! [`ControllerIo`] (its I/O queues and worker threads) serves all the
//! namespaces behind it. Connections grow with targets, not with extents;
//! volumes opened with one [`Connections`] share their controllers too, so
//! they do not grow with volumes either. Controllers connect in parallel,
//! one thread each, and every namespace is checked against the plan
//! (Identify: size = extent size, block size dividing the volume's block
//! and stripe unit).
//!
//! **I/O.** A request is checked (block-aligned, inside the volume), cut
//! into one run per extent, and the runs run concurrently. A request that
//! maps to one extent travels in the caller's buffer; otherwise each run
//! gets a buffer of its own (write data gathered into it, read data
//! scattered out of it). Mirrored writes send the caller's buffer to one
//! copy and a clone to each other: a request owns its buffer until it
//! completes, so copies cannot share one.
//!
//! **Copies and failures.** Each extent copy has a sticky `failed` flag.
//! Reads go to one healthy copy, the one whose controller has the fewest
//! requests in flight (ties rotate). Writes, write-zeroes, discards and
//! flushes go to every healthy copy (FUA on each) and complete when all
//! have answered. A copy is marked failed when
//!
//! - an I/O to it fails on the path ([`IoError::ControllerLost`], a data
//!   digest failure, an NVMe path or transient transport status): its
//!   controller did not come back within the controller-loss timeout; when
//!   the controller itself is lost, every extent behind it is marked at
//!   once;
//! - a write (or zeroes, discard, flush) fails on it while another copy
//!   took it: it is stale now and must never be read again.
//!
//! A failed read moves to another healthy copy (media errors too, without
//! marking the copy); a write succeeds when at least one copy
//! acknowledged. Only when no healthy copy of an extent is left does an
//! error reach the caller. Errors of the request itself (a status such as
//! LBA Out of Range that every copy would return) reach the caller as they
//! are. Every marking is logged, counted in [`Volume::health`] and passed
//! to [`VolumeOptions::on_extent_failed`], so the attach command can tell
//! the control plane. Flags are per session: a copy marked failed is not
//! used again until the volume is reopened, and the control plane passes
//! the copies it knows to be stale back in
//! ([`VolumeOptions::failed_extents`]): they start out failed and are not
//! even connected, until it has resynchronised them.
//!
//! **How long a dead copy stalls I/O.** An I/O to a target that went away
//! waits while its queues reconnect (every `reconnect_delay`, doubling) for
//! up to the controller-loss timeout, then fails with `ControllerLost`.
//! For mirrored layouts the default is [`MIRRORED_CTRL_LOSS_TIMEOUT`]
//! (5 s): writes wait for every copy, so a short timeout bounds the stall
//! of all writes when one target dies, while still riding out a target
//! restart. Without copies there is nothing to fail over to and waiting
//! longer beats failing I/O, so the default is the Linux host's 60 s
//! ([`CTRL_LOSS_TIMEOUT`]). The stall is about the timeout plus one connect
//! attempt (`connect_timeout`); a target that vanishes without closing its
//! connections is noticed by its controller's keep-alive first (admin
//! command timeout, 30 s), then the same timeout applies.
//!
//! **Flush** goes to the namespaces written since the previous flush
//! (every copy, every queue), which is every namespace whose data a flush
//! could concern, without flushing thousands of idle extents.

mod runs;

use crate::admin::{ConnectParams, Controller, NamespaceInfo};
use crate::blockdev::{BlockDev, BufResult, IoFuture};
use crate::bufpool::BufPool;
use crate::device::{block_on, join_all, ControllerIo, Device};
use crate::error::{Error, IoError};
use nvpool_control::mapping::Geometry;
use nvpool_control::plan::ConnectionPlan;
use nvpool_wire::tcp::Digests;
use nvpool_wire::Status;
use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

/// Controller-loss timeout of volumes with copies: how long writes wait for
/// a dead copy before continuing without it. Long enough for a target
/// restart (a few reconnect attempts), short enough that a dead target
/// stalls writes for seconds, not a minute.
pub const MIRRORED_CTRL_LOSS_TIMEOUT: Duration = Duration::from_secs(5);
/// Controller-loss timeout of volumes without copies (the Linux host's
/// default): nothing to fail over to, so wait for the target to return.
pub const CTRL_LOSS_TIMEOUT: Duration = Duration::from_secs(60);
/// I/O queues (and worker threads) per controller by default: two keep a
/// queue busy while the other's thread handles completions.
pub const QUEUES_PER_CONTROLLER: u16 = 2;
/// Commands outstanding per I/O queue by default (the Linux host's 128).
pub const QUEUE_DEPTH: u16 = 128;
/// Keep-alive timeout by default (the Linux host's 5 s).
pub const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// First reconnect delay by default; it doubles after each failure. Half a
/// second gives a mirrored volume's 5 s about four attempts.
pub const RECONNECT_DELAY: Duration = Duration::from_millis(500);
/// TCP connect and ICResp timeout by default; it adds to the time a dead
/// copy stalls I/O, so it is shorter than a lone controller's 10 s.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Extents (with all their copies) one flush works on at once: bounds the
/// commands a flush puts in flight and the cost of joining them (every
/// wake-up polls each pending piece).
const FLUSH_EXTENTS_AT_ONCE: usize = 64;
/// Most copies of a member a plan may have; `tried` sets are bitmasks.
const COPIES_MAX: usize = 8;
const _: () = assert!(nvpool_control::limits::COPIES_MAX as usize <= COPIES_MAX);

/// Called once for every extent copy the volume stops using.
pub type ExtentFailedFn = Arc<dyn Fn(&ExtentFailure) + Send + Sync>;

/// How to connect a volume.
#[derive(Clone)]
pub struct VolumeOptions {
    /// I/O queues per controller (at most what the controller grants).
    pub queues_per_controller: u16,
    /// Commands outstanding per I/O queue.
    pub queue_depth: u16,
    /// Keep-alive timeout of each controller.
    pub keep_alive: Duration,
    /// Give up reconnecting a controller (and fail its I/O) after this
    /// long. `None`: [`MIRRORED_CTRL_LOSS_TIMEOUT`] for layouts with
    /// copies, [`CTRL_LOSS_TIMEOUT`] otherwise.
    pub ctrl_loss_timeout: Option<Duration>,
    /// Wait before the second reconnect attempt; doubles after each failure.
    pub reconnect_delay: Duration,
    /// TCP connect and ICResp timeout.
    pub connect_timeout: Duration,
    pub digests: Digests,
    /// Host ID for Connect. `None`: the UUID of the plan's host NQN when it
    /// has one, else this machine's (`/etc/nvme/hostid`).
    pub host_id: Option<[u8; 16]>,
    /// Told about every extent copy marked failed, on the thread that saw
    /// the failure (inside an I/O): keep it short, e.g. send on a channel.
    pub on_extent_failed: Option<ExtentFailedFn>,
    /// Controllers shared with the other volumes opened with the same
    /// [`Connections`]; `None`: this volume's own.
    pub connections: Option<Arc<Connections>>,
    /// Plan extent indices of copies known to have failed (the control
    /// plane's record of earlier sessions): they may be stale, so they are
    /// never read or written, and their targets need not be reachable. They
    /// count in [`Volume::health`] but are not reported again. Every row
    /// and member must keep at least one other copy.
    pub failed_extents: Vec<usize>,
}

impl Default for VolumeOptions {
    fn default() -> VolumeOptions {
        VolumeOptions {
            queues_per_controller: QUEUES_PER_CONTROLLER,
            queue_depth: QUEUE_DEPTH,
            keep_alive: KEEP_ALIVE_TIMEOUT,
            ctrl_loss_timeout: None,
            reconnect_delay: RECONNECT_DELAY,
            connect_timeout: CONNECT_TIMEOUT,
            digests: Digests::default(),
            host_id: None,
            on_extent_failed: None,
            connections: None,
            failed_extents: Vec::new(),
        }
    }
}

impl fmt::Debug for VolumeOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VolumeOptions")
            .field("queues_per_controller", &self.queues_per_controller)
            .field("queue_depth", &self.queue_depth)
            .field("keep_alive", &self.keep_alive)
            .field("ctrl_loss_timeout", &self.ctrl_loss_timeout)
            .field("reconnect_delay", &self.reconnect_delay)
            .field("connect_timeout", &self.connect_timeout)
            .field("digests", &self.digests)
            .field("host_id", &self.host_id)
            .field("on_extent_failed", &self.on_extent_failed.is_some())
            .field("connections", &self.connections)
            .field("failed_extents", &self.failed_extents)
            .finish()
    }
}

/// An extent copy the volume stopped using.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtentFailure {
    /// Index in the plan's extents.
    pub index: usize,
    pub row: u32,
    pub member: u32,
    pub copy: u8,
    /// The plan's target id, address, subsystem and namespace of the copy.
    pub target: String,
    pub addr: SocketAddr,
    pub subsystem_nqn: String,
    pub nsid: u32,
    /// What failed on it.
    pub error: IoError,
    /// No healthy copy of this row and member is left: I/O there fails.
    pub member_lost: bool,
}

/// What [`Volume::health`] reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeHealth {
    /// Plan extent indices of the copies marked failed, ascending.
    pub failed_extents: Vec<usize>,
    /// `(row, member)` with no healthy copy left: I/O there fails.
    pub lost: Vec<(u32, u32)>,
}

impl VolumeHealth {
    /// Every copy is in use.
    pub fn is_healthy(&self) -> bool {
        self.failed_extents.is_empty()
    }

    /// Some copies failed, yet every byte is still served.
    pub fn is_degraded(&self) -> bool {
        !self.failed_extents.is_empty() && self.lost.is_empty()
    }
}

/// Controllers shared by the volumes one process serves. A host has one
/// subsystem per target holding all its volumes' extents, so volumes opened
/// with the same `Connections` share one controller (and one set of I/O
/// queues) per target address, subsystem and host NQN: connections grow
/// with targets, not with volumes. A shared controller keeps the
/// parameters of the volume that connected it, and disconnects when the
/// last volume using it closes.
#[derive(Debug, Default)]
pub struct Connections {
    live: Mutex<Vec<(ControllerKey, Weak<ControllerIo>)>>,
    /// Opens run one at a time, so two never connect the same controller.
    opening: Mutex<()>,
}

/// Target address, subsystem NQN, host NQN.
type ControllerKey = (SocketAddr, String, String);

impl Connections {
    pub fn new() -> Arc<Connections> {
        Arc::default()
    }

    /// Controllers connected now.
    pub fn controller_count(&self) -> usize {
        lock(&self.live)
            .iter()
            .filter(|(_, w)| w.strong_count() > 0)
            .count()
    }

    fn get(&self, key: &ControllerKey) -> Option<Arc<ControllerIo>> {
        lock(&self.live)
            .iter()
            .find(|(k, _)| k == key)
            .and_then(|(_, w)| w.upgrade())
    }

    fn add(&self, key: ControllerKey, io: &Arc<ControllerIo>) {
        let mut live = lock(&self.live);
        live.retain(|(k, w)| w.strong_count() > 0 && *k != key);
        live.push((key, Arc::downgrade(io)));
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One extent copy: its namespace handle and health.
#[derive(Debug)]
struct ExtentIo {
    /// None for copies known to have failed at open (never connected).
    dev: Option<Device>,
    /// Sticky: set once, the copy is not used again this session.
    failed: AtomicBool,
}

/// What a run does to every healthy copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mutation {
    Write { fua: bool },
    Zeroes { unmap: bool },
    Discard,
    Flush,
}

impl ExtentIo {
    fn dev(&self) -> &Device {
        self.dev
            .as_ref()
            .expect("a copy in use has a namespace handle")
    }

    async fn mutate(&self, m: Mutation, offset: u64, len: u64, buf: Vec<u8>) -> BufResult {
        match m {
            Mutation::Write { fua } => self.dev().write(offset, buf, fua).await,
            Mutation::Zeroes { unmap } => (self.dev().write_zeroes(offset, len, unmap).await, buf),
            Mutation::Discard => (self.dev().discard(offset, len).await, buf),
            Mutation::Flush => (self.dev().flush().await, buf),
        }
    }
}

/// How an error from one copy is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blame {
    /// The path to the copy failed: stop using the copy.
    Path,
    /// The copy's medium failed here: read another copy.
    Media,
    /// The request: every copy would say the same.
    Request,
}

fn blame(e: &IoError) -> Blame {
    match e {
        IoError::ControllerLost | IoError::Digest => Blame::Path,
        IoError::Invalid(_) => Blame::Request,
        IoError::Status(s) if s.sct == 3 => Blame::Path,
        IoError::Status(s)
            if (s.sct, s.sc)
                == (
                    Status::TRANSIENT_TRANSPORT_ERROR.sct,
                    Status::TRANSIENT_TRANSPORT_ERROR.sc,
                ) =>
        {
            Blame::Path
        }
        IoError::Status(s) if s.sct == 2 => Blame::Media,
        IoError::Status(_) => Blame::Request,
    }
}

/// A pooled volume attached to this host; see the module docs.
pub struct Volume {
    plan: ConnectionPlan,
    geometry: Geometry,
    copies: usize,
    /// One per distinct (address, subsystem) of the plan.
    ios: Vec<Arc<ControllerIo>>,
    /// One per plan extent, in plan order.
    extents: Vec<ExtentIo>,
    /// Per (row, member): written since the last flush.
    dirty: Vec<AtomicBool>,
    /// Rotates read ties between copies.
    rr: AtomicUsize,
    on_failed: Option<ExtentFailedFn>,
    /// Buffers of the runs of reads that span extents.
    bufs: BufPool,
}

impl fmt::Debug for Volume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Volume")
            .field("name", &self.plan.name)
            .field("geometry", &self.geometry)
            .field("controllers", &self.ios.len())
            .field("health", &self.health())
            .finish_non_exhaustive()
    }
}

impl Volume {
    /// Validates `plan`, connects one controller per distinct target
    /// address and subsystem (in parallel), checks every namespace against
    /// the plan and starts the I/O queues.
    pub fn open(plan: &ConnectionPlan, opts: VolumeOptions) -> Result<Volume, Error> {
        plan.validate()
            .map_err(|e| Error::Invalid(format!("connection plan of {}: {e}", plan.name)))?;
        let geometry = plan.geometry();
        let copies = usize::from(geometry.copies);
        // Pieces of requests start and end on multiples of the block size
        // or of the stripe unit, whichever is smaller.
        let align = u64::from(plan.block_bytes).min(geometry.stripe_bytes);

        let n = plan.extents.len();
        let mut known_failed = vec![false; n];
        for &i in &opts.failed_extents {
            if i >= n {
                return Err(Error::Invalid(format!(
                    "failed extent {i}: the plan of {} has {n} extents",
                    plan.name
                )));
            }
            known_failed[i] = true;
        }
        if let Some(g) =
            (0..n / copies).find(|g| known_failed[g * copies..][..copies].iter().all(|&f| f))
        {
            let e = &plan.extents[g * copies];
            return Err(Error::Invalid(format!(
                "{}: row {} of member {} has no usable copy: every copy is known to have failed",
                plan.name, e.row, e.member
            )));
        }

        // Controllers in order of first use; each with the plan extents it
        // serves. Known-failed copies are not connected.
        let mut keys: Vec<(SocketAddr, &str)> = Vec::new();
        let mut index: HashMap<(SocketAddr, &str), usize> = HashMap::new();
        let mut served: Vec<Vec<usize>> = Vec::new();
        for (i, e) in plan.extents.iter().enumerate() {
            if known_failed[i] {
                continue;
            }
            let key = (e.addr, e.subsystem_nqn.as_str());
            let ci = *index.entry(key).or_insert_with(|| {
                keys.push(key);
                served.push(Vec::new());
                keys.len() - 1
            });
            served[ci].push(i);
        }

        let hostid = opts
            .host_id
            .or_else(|| {
                plan.host_nqn
                    .rsplit_once(":uuid:")
                    .and_then(|(_, u)| crate::hostnqn::parse_uuid(u))
            })
            .unwrap_or_else(|| crate::hostnqn::host_identity().1);
        let loss = opts.ctrl_loss_timeout.unwrap_or(if copies > 1 {
            MIRRORED_CTRL_LOSS_TIMEOUT
        } else {
            CTRL_LOSS_TIMEOUT
        });
        let params = |addr: SocketAddr, nqn: &str| {
            let mut p = ConnectParams::new(addr, nqn);
            p.hostnqn = plan.host_nqn.clone();
            p.hostid = hostid;
            p.digests = opts.digests;
            p.kato = opts.keep_alive;
            p.io_queues = opts.queues_per_controller.max(1);
            p.queue_depth = opts.queue_depth;
            p.ctrl_loss_timeout = loss;
            p.reconnect_delay = opts.reconnect_delay;
            p.connect_timeout = opts.connect_timeout;
            p
        };

        let shared = opts.connections.as_deref();
        let _one_open = shared.map(|c| lock(&c.opening));
        let key = |addr: SocketAddr, nqn: &str| (addr, nqn.to_owned(), plan.host_nqn.clone());
        let connected: Vec<Result<Connected, Error>> = std::thread::scope(|s| {
            let threads: Vec<_> = keys
                .iter()
                .zip(&served)
                .map(|(&(addr, nqn), mine)| {
                    let reach = match shared.and_then(|c| c.get(&key(addr, nqn))) {
                        Some(io) => Reach::Shared(io),
                        None => Reach::Connect(params(addr, nqn)),
                    };
                    let queues = opts.queues_per_controller;
                    s.spawn(move || connect_one(plan, reach, mine, align, queues))
                })
                .collect();
            threads
                .into_iter()
                .map(|t| {
                    t.join()
                        .unwrap_or_else(|_| Err(Error::Invalid("a connect thread panicked".into())))
                })
                .collect()
        });

        let mut ios = Vec::with_capacity(keys.len());
        let mut slots: Vec<Option<Device>> = (0..plan.extents.len()).map(|_| None).collect();
        for c in connected {
            let c = c?;
            for (i, dev) in c.devices {
                slots[i] = Some(dev);
            }
            ios.push(c.io);
        }
        if let Some(c) = shared {
            for (io, &(addr, nqn)) in ios.iter().zip(&keys) {
                c.add(key(addr, nqn), io);
            }
        }
        let extents = slots
            .into_iter()
            .zip(known_failed)
            .map(|(dev, failed)| {
                assert_eq!(dev.is_some(), !failed, "every copy in use was opened");
                ExtentIo {
                    dev,
                    failed: AtomicBool::new(failed),
                }
            })
            .collect();
        let groups = plan.extents.len() / copies;
        tracing::info!(
            volume = %plan.name,
            layout = %plan.layout(),
            size = plan.size_bytes,
            extents = plan.extents.len(),
            controllers = ios.len(),
            ctrl_loss_timeout = ?loss,
            "volume open"
        );
        Ok(Volume {
            plan: plan.clone(),
            geometry,
            copies,
            ios,
            extents,
            dirty: (0..groups).map(|_| AtomicBool::new(false)).collect(),
            rr: AtomicUsize::new(0),
            bufs: BufPool::default(),
            on_failed: opts.on_extent_failed,
        })
    }

    pub fn plan(&self) -> &ConnectionPlan {
        &self.plan
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    pub fn size(&self) -> u64 {
        self.plan.size_bytes
    }

    pub fn block_size(&self) -> u32 {
        self.plan.block_bytes
    }

    /// Controllers (one per distinct target address and subsystem).
    pub fn controller_count(&self) -> usize {
        self.ios.len()
    }

    /// The I/O queue pools, one per controller, in order of first use in
    /// the plan (for statistics: [`ControllerIo::in_flight`]).
    pub fn controllers(&self) -> &[Arc<ControllerIo>] {
        &self.ios
    }

    /// Whether plan extent `index` (one copy) was marked failed.
    pub fn extent_failed(&self, index: usize) -> bool {
        self.extents[index].failed.load(Ordering::SeqCst)
    }

    /// The copies marked failed and the extents left without a healthy copy.
    pub fn health(&self) -> VolumeHealth {
        let failed_extents: Vec<usize> = (0..self.extents.len())
            .filter(|&i| self.extent_failed(i))
            .collect();
        let lost = (0..self.dirty.len())
            .filter(|&g| self.group_lost(g))
            .map(|g| {
                let e = &self.plan.extents[g * self.copies];
                (e.row, e.member)
            })
            .collect();
        VolumeHealth {
            failed_extents,
            lost,
        }
    }

    fn group_lost(&self, group: usize) -> bool {
        (0..self.copies).all(|c| self.extent_failed(group * self.copies + c))
    }

    /// Flushes, then disconnects: the I/O threads stop, the I/O queues
    /// close and each controller is shut down (CC.SHN) — unless another
    /// volume still shares it through [`Connections`]. The flush's result
    /// is returned; the volume is closed either way. Blocks: call it from a
    /// thread, not from an async task. Dropping a volume disconnects the
    /// same way without the flush.
    pub fn close(self) -> Result<(), IoError> {
        let r = block_on(self.flush());
        // The last handle on a controller's I/O pool joins its workers, and
        // the last reference to the controller shuts it down.
        drop(self);
        r
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), IoError> {
        let bs = u64::from(self.plan.block_bytes);
        if !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) {
            return Err(IoError::Invalid(
                "offset and length must be multiples of the block size",
            ));
        }
        if offset
            .checked_add(len)
            .is_none_or(|e| e > self.plan.size_bytes)
        {
            return Err(IoError::Invalid("range past the end of the volume"));
        }
        Ok(())
    }

    fn split(&self, offset: u64, len: u64) -> Result<runs::Split, IoError> {
        self.check(offset, len)?;
        runs::split(&self.geometry, offset, len)
            .map_err(|_| IoError::Invalid("range past the end of the volume"))
    }

    /// Reads `buf.len()` bytes at `offset`; the buffer comes back filled.
    pub async fn read(&self, offset: u64, mut buf: Vec<u8>) -> BufResult {
        let split = match self.split(offset, buf.len() as u64) {
            Ok(s) => s,
            Err(e) => return (Err(e), buf),
        };
        match split.runs.as_slice() {
            [] => (Ok(()), buf),
            // One extent: the caller's buffer goes through.
            [r] => self.read_run(r.first, r.extent_offset, buf).await,
            runs => {
                let all = runs.iter().map(|r| {
                    let b = self.bufs.get(r.len as usize);
                    self.read_run(r.first, r.extent_offset, b)
                });
                let mut bufs = Vec::with_capacity(runs.len());
                let mut first_err = None;
                for (r, b) in join_all(all).await {
                    if let Err(e) = r {
                        first_err.get_or_insert(e);
                    }
                    bufs.push(b);
                }
                if first_err.is_none() {
                    split.scatter(&bufs, &mut buf);
                }
                for b in bufs {
                    self.bufs.put(b);
                }
                (first_err.map_or(Ok(()), Err), buf)
            }
        }
    }

    /// Writes `buf` at `offset` to every healthy copy; with `fua` it is
    /// durable on every copy on success.
    pub async fn write(&self, offset: u64, buf: Vec<u8>, fua: bool) -> BufResult {
        let split = match self.split(offset, buf.len() as u64) {
            Ok(s) => s,
            Err(e) => return (Err(e), buf),
        };
        let m = Mutation::Write { fua };
        match split.runs.as_slice() {
            [] => (Ok(()), buf),
            [r] => {
                self.mutate_run(r.first, r.extent_offset, r.len, m, buf)
                    .await
            }
            runs => {
                let pieces = split.gather(&buf);
                let all = runs
                    .iter()
                    .zip(pieces)
                    .map(|(r, b)| self.mutate_run(r.first, r.extent_offset, r.len, m, b));
                let r = first_error(join_all(all).await);
                (r, buf)
            }
        }
    }

    /// Zeroes a range on every healthy copy; `may_unmap` lets the targets
    /// deallocate it.
    pub async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> Result<(), IoError> {
        self.mutate(offset, len, Mutation::Zeroes { unmap: may_unmap })
            .await
    }

    /// Discards a range on every healthy copy.
    pub async fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.mutate(offset, len, Mutation::Discard).await
    }

    async fn mutate(&self, offset: u64, len: u64, m: Mutation) -> Result<(), IoError> {
        let split = self.split(offset, len)?;
        let all = split
            .runs
            .iter()
            .map(|r| self.mutate_run(r.first, r.extent_offset, r.len, m, Vec::new()));
        first_error(join_all(all).await)
    }

    /// Makes every completed write durable: flushes each namespace written
    /// since the last flush, on every healthy copy.
    pub async fn flush(&self) -> Result<(), IoError> {
        let groups: Vec<usize> = (0..self.dirty.len())
            .filter(|&g| {
                self.dirty[g].load(Ordering::SeqCst) && self.dirty[g].swap(false, Ordering::SeqCst)
            })
            .collect();
        let mut first = Ok(());
        for batch in groups.chunks(FLUSH_EXTENTS_AT_ONCE) {
            let all = batch
                .iter()
                .map(|&g| self.mutate_run(g * self.copies, 0, 0, Mutation::Flush, Vec::new()));
            for (&g, (r, _)) in batch.iter().zip(join_all(all).await) {
                if let Err(e) = r {
                    // Still not durable: the next flush tries again.
                    self.dirty[g].store(true, Ordering::SeqCst);
                    if first.is_ok() {
                        first = Err(e);
                    }
                }
            }
        }
        first
    }

    /// Reads one run from one healthy copy, moving to another when the
    /// chosen one fails.
    async fn read_run(&self, first: usize, offset: u64, mut buf: Vec<u8>) -> BufResult {
        let len = buf.len();
        let mut tried = 0u32;
        let mut last = None;
        loop {
            let Some(c) = self.pick_read_copy(first, tried) else {
                return (Err(last.unwrap_or(IoError::ControllerLost)), buf);
            };
            tried |= 1 << c;
            let (r, b) = self.extents[first + c].dev().read(offset, buf).await;
            // A lost controller cannot hand back the buffer it held.
            buf = if b.len() == len { b } else { vec![0; len] };
            match r {
                Ok(()) => return (Ok(()), buf),
                Err(e) => match blame(&e) {
                    Blame::Path => {
                        self.fail_extent(first + c, &e);
                        last = Some(e);
                    }
                    Blame::Media => last = Some(e),
                    Blame::Request => return (Err(e), buf),
                },
            }
        }
    }

    /// The healthy copy not in `tried` whose controller has the fewest
    /// requests in flight; ties rotate.
    fn pick_read_copy(&self, first: usize, tried: u32) -> Option<usize> {
        let usable = |c: usize| tried & (1 << c) == 0 && !self.extent_failed(first + c);
        if self.copies == 1 {
            return usable(0).then_some(0);
        }
        let start = self.rr.fetch_add(1, Ordering::Relaxed);
        let mut best: Option<(usize, usize)> = None;
        for k in 0..self.copies {
            let c = (start + k) % self.copies;
            if !usable(c) {
                continue;
            }
            let load = self.extents[first + c].dev().io().in_flight();
            if best.is_none_or(|(_, l)| load < l) {
                best = Some((c, load));
            }
        }
        best.map(|(c, _)| c)
    }

    /// Applies `m` to every healthy copy of one run; succeeds when at least
    /// one copy did. Copies that missed it are marked failed.
    async fn mutate_run(
        &self,
        first: usize,
        offset: u64,
        len: u64,
        m: Mutation,
        buf: Vec<u8>,
    ) -> BufResult {
        let healthy: u32 = (0..self.copies)
            .filter(|&c| !self.extent_failed(first + c))
            .fold(0, |s, c| s | 1 << c);
        let n = healthy.count_ones() as usize;
        if n == 0 {
            return (Err(IoError::ControllerLost), buf);
        }
        let is_write = matches!(m, Mutation::Write { .. });
        // The caller's buffer to the last healthy copy, clones to the others.
        let mut data = Some(buf);
        let all = (0..self.copies)
            .filter(|&c| healthy & (1 << c) != 0)
            .enumerate()
            .map(|(k, c)| {
                let b = match &mut data {
                    Some(d) if is_write && k + 1 < n => d.clone(),
                    d if is_write => d.take().expect("the caller's buffer is there"),
                    _ => Vec::new(),
                };
                self.extents[first + c].mutate(m, offset, len, b)
            });
        let results = join_all(all).await;
        let acked = results.iter().any(|(r, _)| r.is_ok());
        let mut err: Option<IoError> = None;
        // Writes hand back the buffer of the first copy that took the data
        // (all hold the same bytes), else the last one's (the caller's).
        let mut back: Option<Vec<u8>> = data;
        let mut back_acked = false;
        let copies = (0..self.copies).filter(|&c| healthy & (1 << c) != 0);
        for (c, (r, b)) in copies.zip(results) {
            if is_write && !back_acked {
                back_acked = r.is_ok();
                back = Some(b);
            }
            match r {
                Ok(()) => {}
                Err(e) => {
                    let path = blame(&e) == Blame::Path;
                    if acked || path {
                        // Stale (another copy took it) or unreachable.
                        self.fail_extent(first + c, &e);
                    }
                    // The caller learns about the request rather than the path.
                    if err
                        .as_ref()
                        .is_none_or(|p| blame(p) == Blame::Path && !path)
                    {
                        err = Some(e);
                    }
                }
            }
        }
        if m != Mutation::Flush {
            self.dirty[first / self.copies].store(true, Ordering::SeqCst);
        }
        let r = match (acked, err) {
            (true, _) | (false, None) => Ok(()),
            (false, Some(e)) => Err(e),
        };
        (r, back.unwrap_or_default())
    }

    /// Stops using extent copy `index` for the rest of the session. When its
    /// controller is lost, every extent behind that controller goes too.
    fn fail_extent(&self, index: usize, error: &IoError) {
        if !self.extents[index].failed.swap(true, Ordering::SeqCst) {
            self.report(index, error);
        }
        let Some(io) = self.extents[index].dev.as_ref().map(Device::io) else {
            return;
        };
        if *error == IoError::ControllerLost && io.controller().current().is_err() {
            for (j, x) in self.extents.iter().enumerate() {
                let behind = x.dev.as_ref().is_some_and(|d| Arc::ptr_eq(d.io(), io));
                if behind && !x.failed.swap(true, Ordering::SeqCst) {
                    self.report(j, error);
                }
            }
        }
    }

    fn report(&self, index: usize, error: &IoError) {
        let e = &self.plan.extents[index];
        let member_lost = self.group_lost(index / self.copies);
        tracing::error!(
            volume = %self.plan.name,
            extent = index,
            row = e.row,
            member = e.member,
            copy = e.copy,
            target = %e.target,
            addr = %e.addr,
            nsid = e.nsid,
            error = %error,
            member_lost,
            "extent copy failed; not used again this session"
        );
        if let Some(f) = &self.on_failed {
            f(&ExtentFailure {
                index,
                row: e.row,
                member: e.member,
                copy: e.copy,
                target: e.target.clone(),
                addr: e.addr,
                subsystem_nqn: e.subsystem_nqn.clone(),
                nsid: e.nsid,
                error: error.clone(),
                member_lost,
            });
        }
    }
}

/// The first error of joined runs, if any.
fn first_error(results: Vec<BufResult>) -> Result<(), IoError> {
    results
        .into_iter()
        .map(|(r, _)| r)
        .find(Result::is_err)
        .unwrap_or(Ok(()))
}

/// One controller's part of a volume, connected and checked.
struct Connected {
    io: Arc<ControllerIo>,
    devices: Vec<(usize, Device)>,
}

/// How a volume reaches one controller.
enum Reach {
    Connect(ConnectParams),
    /// Already connected for another volume.
    Shared(Arc<ControllerIo>),
}

/// Connects one controller (or takes the shared one) and opens the plan
/// extents `mine` on it.
fn connect_one(
    plan: &ConnectionPlan,
    reach: Reach,
    mine: &[usize],
    align: u64,
    queues: u16,
) -> Result<Connected, Error> {
    let (ctrl, shared) = match reach {
        Reach::Connect(params) => (Controller::connect(params)?, None),
        Reach::Shared(io) => (io.controller().clone(), Some(io)),
    };
    let (addr, nqn) = (ctrl.addr(), ctrl.params.subnqn.clone());
    let mut infos: Vec<(usize, NamespaceInfo)> = Vec::with_capacity(mine.len());
    for &i in mine {
        let e = &plan.extents[i];
        let info = ctrl.namespace(e.nsid)?;
        let bs = u64::from(info.block_size);
        if info.size_bytes() != plan.extent_bytes || !align.is_multiple_of(bs) {
            return Err(Error::Invalid(format!(
                "{addr} {nqn}: namespace {} (extent {i}) has {} bytes in {bs}-byte blocks; \
                 the plan needs {} bytes in blocks dividing {align}",
                e.nsid,
                info.size_bytes(),
                plan.extent_bytes
            )));
        }
        if let Some((_, first)) = infos.first() {
            if first.block_size != info.block_size {
                return Err(Error::Invalid(format!(
                    "{addr} {nqn}: namespaces {} and {} differ in block size ({} and {}); \
                     the I/O queues of one controller count one size",
                    first.nsid, info.nsid, first.block_size, info.block_size
                )));
            }
        }
        infos.push((i, info));
    }
    let io = match shared {
        Some(io) => io,
        None => {
            let bs = infos.first().map_or(512, |(_, info)| info.block_size);
            ControllerIo::start(ctrl, queues, bs)?
        }
    };
    let devices = infos
        .into_iter()
        .map(|(i, info)| io.device(info).map(|d| (i, d)))
        .collect::<Result<_, _>>()?;
    Ok(Connected { io, devices })
}

impl BlockDev for Volume {
    fn size(&self) -> u64 {
        Volume::size(self)
    }

    fn block_size(&self) -> u32 {
        Volume::block_size(self)
    }

    /// The stripe unit of striped layouts.
    fn optimal_io_bytes(&self) -> u32 {
        if self.geometry.width > 1 {
            u32::try_from(self.geometry.stripe_bytes).unwrap_or(0)
        } else {
            0
        }
    }

    fn read(&self, offset: u64, buf: Vec<u8>) -> IoFuture<'_, BufResult> {
        Box::pin(Volume::read(self, offset, buf))
    }

    fn write(&self, offset: u64, buf: Vec<u8>, fua: bool) -> IoFuture<'_, BufResult> {
        Box::pin(Volume::write(self, offset, buf, fua))
    }

    fn flush(&self) -> IoFuture<'_, Result<(), IoError>> {
        Box::pin(Volume::flush(self))
    }

    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> IoFuture<'_, Result<(), IoError>> {
        Box::pin(Volume::write_zeroes(self, offset, len, may_unmap))
    }

    fn discard(&self, offset: u64, len: u64) -> IoFuture<'_, Result<(), IoError>> {
        Box::pin(Volume::discard(self, offset, len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_blamed_on_the_path_the_medium_or_the_request() {
        assert_eq!(blame(&IoError::ControllerLost), Blame::Path);
        assert_eq!(blame(&IoError::Digest), Blame::Path);
        assert_eq!(
            blame(&IoError::Status(Status::TRANSIENT_TRANSPORT_ERROR)),
            Blame::Path
        );
        assert_eq!(
            blame(&IoError::Status(Status::UNRECOVERED_READ_ERROR)),
            Blame::Media
        );
        assert_eq!(blame(&IoError::Status(Status::WRITE_FAULT)), Blame::Media);
        assert_eq!(
            blame(&IoError::Status(Status::LBA_OUT_OF_RANGE)),
            Blame::Request
        );
        assert_eq!(blame(&IoError::Invalid("x")), Blame::Request);
    }

    #[test]
    fn default_options_leave_the_loss_timeout_to_the_layout() {
        let o = VolumeOptions::default();
        assert_eq!(o.ctrl_loss_timeout, None);
        assert_eq!(o.queues_per_controller, 2);
        assert!(format!("{o:?}").contains("on_extent_failed: false"));
    }
}
