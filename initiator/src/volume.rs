//! The volume engine: a pooled volume, described by a control-plane
//! [`ConnectionPlan`], served as one [`BlockDev`].
//!
//! ```text
//!  read/write(offset, buf)
//!     │  Geometry::segments → one run per extent (runs.rs)
//!     ▼
//!  run ─┬─ read: one copy in sync (Ok), the least loaded; another on a path failure
//!       └─ write/zeroes/discard/flush: every Ok and Syncing copy, joined
//!     │
//!     ▼  Device (namespace handle, swappable) per extent copy
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
//! **Copies: Ok, Syncing, Failed.** Each extent copy is in one of three
//! states ([`CopyState`], an atomic read once per copy and run):
//!
//! | state | read | written | missed regions recorded |
//! |---|---|---|---|
//! | `Ok` | yes | yes | no |
//! | `Syncing` | never | yes | no |
//! | `Failed` | never | never | yes |
//!
//! Reads go to one `Ok` copy, the one whose controller has the fewest
//! requests in flight (ties rotate). Writes, write-zeroes, discards and
//! flushes go to every `Ok` and `Syncing` copy (FUA on each) and complete
//! when all have answered; they succeed when at least one `Ok` copy took
//! them. A `Syncing` copy taking a write does not count: it is being filled
//! by a copy job and is read by no one, so a write only it holds would be
//! acknowledged yet lost if that job failed. For the same reason a
//! `Syncing` copy stays in sync only while it takes exactly what the `Ok`
//! copies take: when it misses a write an `Ok` copy took, or takes one no
//! `Ok` copy took, it fails. A copy fails (→ `Failed`) when
//!
//! - an I/O to it fails on the path ([`IoError::ControllerLost`], a data
//!   digest failure, an NVMe path or transient transport status): its
//!   controller did not come back within the controller-loss timeout; when
//!   the controller itself is lost, every extent behind it is marked at
//!   once;
//! - a write (or zeroes, discard, flush) fails on it while another copy
//!   took it: it is stale now and must never be read again.
//!
//! A failed read moves to another `Ok` copy (media errors too, without
//! marking the copy). Only when no `Ok` copy of an extent is left does an
//! error reach the caller. Errors of the request itself (a status such as
//! LBA Out of Range that every copy would return) reach the caller as they
//! are. Every failure is logged, counted in [`Volume::health`] and passed
//! to [`VolumeOptions::on_extent_failed`], so the attach command can tell
//! the control plane. The control plane passes the copies it knows to be
//! stale back in at open ([`VolumeOptions::failed_extents`]: `Failed`, not
//! even connected) and the ones being re-synced
//! ([`VolumeOptions::syncing_extents`]: `Syncing`, connected).
//!
//! **Missed regions.** A `Failed` copy has a bitmap of the regions
//! ([`RESYNC_REGION_BYTES`](nvpool_layout::plan::RESYNC_REGION_BYTES),
//! 1 MiB) of its extent (missed.rs). Every write, write-zeroes and discard
//! to the extent marks its range on each `Failed` copy when it is issued,
//! and a mutation that fails on a copy marks its range there too (a failed
//! flush makes the record incomplete: any write since the last flush may
//! be lost). The record is complete for copies this session saw fail, and
//! not for copies already failed at open.
//!
//! **Resync** (the control plane's copy job, docs/ARCHITECTURE.md):
//!
//! ```text
//!   Ok ──fails, mark_failed──► Failed ──begin_sync──► Syncing ──finish_sync──► Ok
//!                               ▲                         │
//!                               └─fails, abort_sync,──────┘
//!                                 mark_failed
//! ```
//!
//! Every way into `Failed` starts a fresh record, complete from then on
//! (holding the failing mutation's range when one failed it); only a
//! failure is reported, not the control plane's own decisions
//! (`abort_sync`, `mark_failed`).
//!
//! [`Volume::begin_sync`] connects the copy again if its controller is gone
//! (a new one, or a live one the volume or its [`Connections`] already
//! has), checks its namespace, switches it to `Syncing`, then *drains*:
//! it waits until every mutation issued before the switch has completed,
//! so the copy job can read its source knowing no older write to it is
//! still on the way. Each mutation holds a count in one of two
//! epoch-indexed counters while it is outstanding and reads the copies'
//! states only after taking it; the drain flips the epoch and waits for
//! the old side, twice, so it never waits for mutations issued after the
//! switch, however many (drain.rs has the ordering argument). The data path
//! takes no lock for this: an atomic increment and decrement per request.
//!
//! **Write epoch** (snapshots, design/thin-snapshots.md T5): every write,
//! write-zeroes and discard command the volume sends carries its write
//! epoch in CDW2 ([`Device::tagged`]), the same on every copy; reads and
//! flushes are untagged (0). [`Volume::set_write_epoch`] raises it and
//! drains with the same two counters, so once it returns no command tagged
//! lower is in flight: a target can cut a snapshot between the writes
//! tagged up to E and the ones after.
//!
//! **Write hold** (a group snapshot's barrier, gate.rs):
//! [`Volume::hold_writes`] raises the epoch like `set_write_epoch` and,
//! from the moment it is called, admits no new write, write-zeroes or
//! discard: each waits as a pending future (the thread that submitted it
//! goes on), holding no drain count, so the drains of the hold itself, of
//! `begin_sync` and of moves never wait for it. Writes already issued go
//! on and are drained; reads and flushes are never held.
//! [`Volume::release_writes`] lets the waiting ones go, tagged with the new
//! epoch; a hold nobody releases ends on its own after
//! [`VolumeOptions::write_hold_max`]. A held write loads the table only
//! once admitted, so one that waited through a grow works on the new one.
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
//! **Moves** (moves.rs): a copy slot moves to another extent (replacing a
//! dead copy, or rebalancing) through two extra copies no one reads: an
//! *incoming* one ([`Volume::begin_move`]: written like a `Syncing` copy,
//! dropped without a report when it strays) until [`Volume::switch_move`]
//! makes it the slot's copy, and then the old copy as a *leaving* one
//! (written, results ignored) until [`Volume::end_move`]. A group without
//! moves costs a mutation one atomic load.
//!
//! **Growing** ([`Volume::grow`]): the control plane grows a volume by
//! appending rows, leaving every existing extent where it is. What a
//! request works on (the plan, its mapping, and per extent and group the
//! copy state, handle, missed regions, moves and dirty flag) is one table
//! behind one atomic pointer; a request loads it once, its only cost, and
//! keeps it to its end. A grow connects the new extents, builds a table
//! that shares every existing extent's and group's objects and adds the
//! new ones, and stores it: requests issued afterwards see the new size,
//! requests in flight finish on the old table, whose extents are the same
//! objects, so no state change is lost between the two.
//!
//! **Flush** goes to the namespaces written since the previous flush
//! (every copy, every queue), which is every namespace whose data a flush
//! could concern, without flushing thousands of idle extents.

mod drain;
mod gate;
mod missed;
mod moves;
mod runs;

pub use missed::MissedRegions;
pub use moves::MovingCopy;

use crate::admin::{ConnectParams, Controller, NamespaceInfo};
use crate::blockdev::{BlockDev, BufResult, IoFuture};
use crate::bufpool::BufPool;
use crate::device::{block_on, join_all, ControllerIo, Device};
use crate::error::{Error, IoError};
use crate::limits::{
    CONNECT_TIMEOUT, COPIES_MAX, CTRL_LOSS_TIMEOUT, FLUSH_EXTENTS_IN_FLIGHT_MAX,
    IO_QUEUES_PER_CTRL_DEFAULT, IO_QUEUE_DEPTH_DEFAULT, KEEP_ALIVE_TIMEOUT,
    MIRRORED_CTRL_LOSS_TIMEOUT, RECONNECT_DELAY, SYNC_DRAIN_TIMEOUT,
};
use arc_swap::{ArcSwap, ArcSwapOption};
use drain::{Drain, Hold};
use gate::{Held, WriteGate};
use missed::{Mark, Missed};
use moves::{GroupMoves, Shadows};
use nvpool_api::rest::ENGINE_HOLD_MAX_MS;
use nvpool_layout::mapping::Geometry;
use nvpool_layout::plan::{ConnectionPlan, PlanExtent};
use nvpool_rt::lock;
use nvpool_wire::tcp::Digests;
use nvpool_wire::Status;
use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

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
    /// Never call [`Volume::begin_sync`] from it (it waits for that I/O).
    pub on_extent_failed: Option<ExtentFailedFn>,
    /// Controllers shared with the other volumes opened with the same
    /// [`Connections`]; `None`: this volume's own.
    pub connections: Option<Arc<Connections>>,
    /// Plan extent indices of copies known to have failed (the control
    /// plane's record of earlier sessions): they start [`CopyState::Failed`]
    /// (never read or written, missed regions recorded with
    /// [`MissedRegions::complete`] false) and are not connected, so their
    /// targets need not be reachable. They count in [`Volume::health`] but
    /// are not reported again. Every row and member must keep a copy that
    /// is neither failed nor syncing.
    pub failed_extents: Vec<usize>,
    /// Plan extent indices of copies being re-synced (a copy job is filling
    /// them): they start [`CopyState::Syncing`] (written, never read) and
    /// are connected like copies in sync; an open that cannot reach one
    /// fails. Disjoint from `failed_extents`.
    pub syncing_extents: Vec<usize>,
    /// Copies being moved to another extent (the control plane's record),
    /// at most one per plan extent. Not switched: the destination is the
    /// slot's incoming copy (written, never read; connected like a copy in
    /// sync, so an open that cannot reach it fails), the slot's own copy is
    /// as the lists above say. Switched: the destination is the slot's
    /// copy, [`CopyState::Ok`] even when the slot is in `failed_extents`
    /// (that entry is about the old copy), and the plan's extent, unless
    /// failed, its leaving copy (written only; opened if it can be, else
    /// done without).
    pub moving: Vec<MovingCopy>,
    /// Reach a target over NVMe/RDMA when the plan gives it an RDMA
    /// address and this host can do RDMA; false: NVMe/TCP always.
    pub prefer_rdma: bool,
    /// The host's DH-HMAC-CHAP keys, for targets that require the host to
    /// authenticate (the control plane holds the same keys for this host
    /// NQN); `None`: connect without.
    pub dhchap: Option<Arc<nvpool_wire::dhchap::Keys>>,
    /// The write epoch the volume starts with (the attachment's
    /// `write_epoch`): every write, write-zeroes and discard carries it in
    /// CDW2 until [`Volume::set_write_epoch`] raises it. 0: untagged.
    pub write_epoch: u32,
    /// The volume opens held at `write_epoch` (the attachment's
    /// `write_hold`: a group snapshot's barrier is on), as if
    /// [`Volume::hold_writes`] had been called: no write is admitted until
    /// [`Volume::release_writes`] or `write_hold_max`. Ignored at epoch 0.
    pub write_hold: bool,
    /// How long a write hold lasts when nobody releases it
    /// ([`ENGINE_HOLD_MAX_MS`]: past the control plane's own deadline, so
    /// its barrier has been given up by then). Shorter only in tests.
    pub write_hold_max: Duration,
}

impl Default for VolumeOptions {
    fn default() -> VolumeOptions {
        VolumeOptions {
            queues_per_controller: IO_QUEUES_PER_CTRL_DEFAULT,
            queue_depth: IO_QUEUE_DEPTH_DEFAULT,
            keep_alive: KEEP_ALIVE_TIMEOUT,
            ctrl_loss_timeout: None,
            reconnect_delay: RECONNECT_DELAY,
            connect_timeout: CONNECT_TIMEOUT,
            digests: Digests::default(),
            host_id: None,
            on_extent_failed: None,
            connections: None,
            failed_extents: Vec::new(),
            syncing_extents: Vec::new(),
            moving: Vec::new(),
            prefer_rdma: true,
            dhchap: None,
            write_epoch: 0,
            write_hold: false,
            write_hold_max: Duration::from_millis(ENGINE_HOLD_MAX_MS),
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
            .field("syncing_extents", &self.syncing_extents)
            .field("moving", &self.moving)
            .field("dhchap", &self.dhchap.is_some())
            .field("write_epoch", &self.write_epoch)
            .field("write_hold", &self.write_hold)
            .field("write_hold_max", &self.write_hold_max)
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
    /// The target id, address, subsystem and namespace of the copy: its
    /// plan extent's, or its move's destination once switched.
    pub target: String,
    pub addr: SocketAddr,
    pub subsystem_nqn: String,
    pub nsid: u32,
    /// What failed on it.
    pub error: IoError,
    /// No copy in sync of this row and member is left: I/O there fails.
    pub member_lost: bool,
}

/// What [`Volume::health`] reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeHealth {
    /// Plan extent indices of the copies in [`CopyState::Failed`], ascending.
    pub failed_extents: Vec<usize>,
    /// Plan extent indices of the copies in [`CopyState::Syncing`]
    /// (written, not read yet), ascending.
    pub syncing_extents: Vec<usize>,
    /// `(row, member)` with no copy in sync left: I/O there fails.
    pub lost: Vec<(u32, u32)>,
    /// Plan extent indices of the copies with an incoming copy (a move
    /// before its switch), ascending. A move does not make a volume
    /// degraded: its copies are all there.
    pub moving_extents: Vec<usize>,
}

impl VolumeHealth {
    /// Every copy is in sync and in use.
    pub fn is_healthy(&self) -> bool {
        self.failed_extents.is_empty() && self.syncing_extents.is_empty()
    }

    /// Some copies failed or are being re-synced, yet every byte is still
    /// served.
    pub fn is_degraded(&self) -> bool {
        !self.is_healthy() && self.lost.is_empty()
    }
}

/// Where an extent copy stands; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyState {
    /// In sync: read and written.
    Ok,
    /// Being filled by a copy job: written, never read.
    Syncing,
    /// Stale: neither read nor written; the regions it misses are recorded.
    Failed,
}

impl CopyState {
    fn from_u8(v: u8) -> CopyState {
        match v {
            0 => CopyState::Ok,
            1 => CopyState::Syncing,
            _ => CopyState::Failed,
        }
    }
}

/// Controllers shared by the volumes one process serves. A host has one
/// subsystem per target holding all its volumes' extents, so volumes opened
/// with the same `Connections` share one controller (and one set of I/O
/// queues) per target address, subsystem and host NQN: connections grow
/// with targets, not with volumes. A shared controller keeps the
/// parameters of the volume that connected it, and disconnects when the
/// last volume using it closes. A lost controller is not shared again: the
/// next volume (or [`Volume::begin_sync`]) to need its target connects a
/// new one, which takes its place here.
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

    /// Controllers connected now (and not lost).
    pub fn controller_count(&self) -> usize {
        lock(&self.live)
            .iter()
            .filter_map(|(_, w)| w.upgrade())
            .filter(|io| !io.is_lost())
            .count()
    }

    fn get(&self, key: &ControllerKey) -> Option<Arc<ControllerIo>> {
        lock(&self.live)
            .iter()
            .find(|(k, _)| k == key)
            .and_then(|(_, w)| w.upgrade())
            .filter(|io| !io.is_lost())
    }

    fn add(&self, key: ControllerKey, io: &Arc<ControllerIo>) {
        let mut live = lock(&self.live);
        live.retain(|(k, w)| w.strong_count() > 0 && *k != key);
        live.push((key, Arc::downgrade(io)));
    }
}

/// One extent copy slot: its state, namespace handle, missed regions and
/// where it is.
///
/// Invariants: a copy that is not `Failed` has a device, and a device,
/// once set, is only ever replaced (never removed); a `Failed` copy has a
/// missed-regions record. The record is stored before the state that needs
/// it, and the device before `Syncing` or `Ok`: a mutation that loads the
/// state (`SeqCst`) then the device or record sees the ones stored with it.
#[derive(Debug)]
struct CopyIo {
    /// A [`CopyState`] as u8.
    state: AtomicU8,
    /// Swapped by begin_sync when the copy's controller was lost (or it was
    /// never connected), and by switch_move. Loads are lock-free.
    dev: ArcSwapOption<Device>,
    missed: ArcSwapOption<Missed>,
    /// Held (briefly) to change `state` together with `missed` or `dev`:
    /// by the data path when the copy fails, and by the resync and move
    /// calls.
    edit: Mutex<()>,
    /// The plan extent, or the destination a move switched the slot to:
    /// what reconnects and reports name.
    location: ArcSwap<PlanExtent>,
    /// The slot's incoming copy strayed and was dropped (moves.rs).
    move_failed: AtomicBool,
}

/// What a run does to every copy it writes; `epoch` is the volume's write
/// epoch the mutation was admitted with (flushes are untagged).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mutation {
    Write { fua: bool, epoch: u32 },
    Zeroes { unmap: bool, epoch: u32 },
    Discard { epoch: u32 },
    Flush,
}

impl CopyIo {
    fn new(
        state: CopyState,
        dev: Option<Device>,
        missed: Option<Missed>,
        location: PlanExtent,
    ) -> CopyIo {
        CopyIo {
            state: AtomicU8::new(state as u8),
            dev: ArcSwapOption::new(dev.map(Arc::new)),
            missed: ArcSwapOption::new(missed.map(Arc::new)),
            edit: Mutex::new(()),
            location: ArcSwap::from_pointee(location),
            move_failed: AtomicBool::new(false),
        }
    }

    fn state(&self) -> CopyState {
        CopyState::from_u8(self.state.load(Ordering::SeqCst))
    }

    fn set_state(&self, s: CopyState) {
        self.state.store(s as u8, Ordering::SeqCst);
    }

    /// The namespace handle of a copy that is not `Failed` (or was not when
    /// the caller looked: handles are never removed).
    fn device(&self) -> Arc<Device> {
        self.dev
            .load_full()
            .expect("a copy that was not failed has a namespace handle")
    }

    /// Marks a mutation's range on a `Failed` copy's record.
    fn note_missed(&self, offset: u64, len: u64) {
        if let Some(r) = &*self.missed.load() {
            r.mark(offset, len);
        }
    }

    /// Makes the copy `Failed` with a fresh, complete record holding
    /// `mark` if its state is one of `from`; a copy failed already gets
    /// `mark` added to its record. With `dev`, only while that is still
    /// the copy's handle: a handle a move switched away from is the old
    /// copy's, leaving, whose failures are not the slot's. True when this
    /// call failed it.
    fn fail(
        &self,
        from: &[CopyState],
        extent_bytes: u64,
        mark: Mark,
        dev: Option<&Arc<Device>>,
    ) -> bool {
        let _e = lock(&self.edit);
        if let Some(d) = dev {
            if !self.dev.load().as_ref().is_some_and(|x| Arc::ptr_eq(x, d)) {
                return false;
            }
        }
        let state = self.state();
        if state == CopyState::Failed {
            if let Some(r) = &*self.missed.load() {
                r.apply(mark);
            }
            return false;
        }
        if !from.contains(&state) {
            return false;
        }
        let r = Missed::new(extent_bytes, true);
        r.apply(mark);
        self.missed.store(Some(Arc::new(r)));
        self.set_state(CopyState::Failed);
        true
    }
}

/// What one mutation of a group writes; see [`Volume::run_copies`].
struct RunCopies {
    /// Bitmasks of the group's copies by state.
    in_sync: u32,
    syncing: u32,
    failed: u32,
    /// The handle of each copy in use, loaded after its state.
    devs: [Option<Arc<Device>>; COPIES_MAX],
    /// The group's incoming and leaving copies, if any.
    shadows: Option<Arc<Shadows>>,
}

/// Whether a copy that must take exactly what the copies in sync take (a
/// `Syncing` or incoming copy) strayed, answering `r` to a mutation `m`
/// the copies in sync took (`acked`) or refused (`err`): the error to fail
/// it with, or `None` when it is still in step.
fn strayed(
    r: Result<(), IoError>,
    acked: bool,
    m: Mutation,
    err: &Option<IoError>,
) -> Option<IoError> {
    match r {
        Ok(()) if acked || m == Mutation::Flush => None,
        // Only it took the change: it now differs from every copy in
        // sync, and the copy job would not overwrite the range (the
        // target saw a host write there).
        Ok(()) => Some(err.clone().unwrap_or(IoError::ControllerLost)),
        // Refused like the copies in sync refused it: unchanged.
        Err(e) if !acked && blame(&e) == Blame::Request => None,
        Err(e) => Some(e),
    }
}

/// What one copy's request of a mutation carries.
enum Data {
    None,
    /// The caller's buffer (the only copy written).
    Owned(Vec<u8>),
    /// One buffer for every copy written.
    Shared(Arc<Vec<u8>>),
}

async fn mutate(dev: &Device, m: Mutation, offset: u64, len: u64, data: Data) -> BufResult {
    match (m, data) {
        (Mutation::Write { fua, epoch }, Data::Shared(s)) => (
            dev.tagged(epoch).write_shared(offset, s, fua).await,
            Vec::new(),
        ),
        (Mutation::Write { fua, epoch }, Data::Owned(b)) => {
            dev.tagged(epoch).write(offset, b, fua).await
        }
        (Mutation::Write { .. }, Data::None) => (
            Err(IoError::Invalid("a write without its data")),
            Vec::new(),
        ),
        (Mutation::Zeroes { unmap, epoch }, _) => (
            dev.tagged(epoch).write_zeroes(offset, len, unmap).await,
            Vec::new(),
        ),
        (Mutation::Discard { epoch }, _) => {
            (dev.tagged(epoch).discard(offset, len).await, Vec::new())
        }
        (Mutation::Flush, _) => (dev.flush().await, Vec::new()),
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

/// What a request works on: the plan, its mapping and the per-extent
/// objects. Replaced whole when the volume grows ([`Volume::grow`]); a
/// request loads it once and keeps that one to its end. The tables share
/// the objects of the extents they have in common (`Arc`s), so a request
/// on an older table and one on the newer see the same copy states,
/// handles, missed regions, moves and dirty flags.
#[derive(Debug)]
struct Table {
    plan: Arc<ConnectionPlan>,
    geometry: Geometry,
    /// One per plan extent, in plan order.
    extents: Vec<Arc<CopyIo>>,
    /// One per (row, member), in plan order.
    groups: Vec<Arc<Group>>,
}

/// One extent group (row, member) besides its copies.
#[derive(Debug, Default)]
struct Group {
    /// The incoming and leaving copies of its slots.
    moves: GroupMoves,
    /// Written since the last flush.
    dirty: AtomicBool,
}

/// A pooled volume attached to this host; see the module docs.
pub struct Volume {
    /// See [`Table`]; one load per request.
    table: ArcSwap<Table>,
    copies: usize,
    /// The controllers the volume connected or shares, in order of first
    /// use (reconnected ones last). A lost one stays until no namespace
    /// handle uses it, so its worker threads are never joined from a data
    /// path thread that happened to drop the last handle.
    ios: Mutex<Vec<Arc<ControllerIo>>>,
    /// Rotates read ties between copies.
    rr: AtomicUsize,
    on_failed: Option<ExtentFailedFn>,
    /// Buffers of the runs of reads that span extents.
    bufs: BufPool,
    /// Mutations outstanding (admitted, not held), for begin_sync's,
    /// begin_move's, set_write_epoch's and hold_writes' drains.
    drain: Drain,
    /// What every mutation admitted now is tagged with; loaded after the
    /// mutation's drain hold (see [`Volume::set_write_epoch`]).
    write_epoch: AtomicU32,
    /// No mutation tagged below it is in flight: the highest epoch whose
    /// drain completed (or the one the volume opened with).
    drained_epoch: AtomicU32,
    /// Holds mutations back while a barrier is on ([`Volume::hold_writes`]).
    gate: Arc<WriteGate>,
    /// begin_sync, begin_move and switch_move calls run one at a time.
    syncing: Mutex<()>,
    /// Grows run one at a time (each replaces the table it loaded).
    growing: Mutex<()>,
    /// Connect parameters of every controller (address and subsystem set
    /// per controller) and how namespaces are connected and checked: for
    /// reconnecting copies and growing.
    params: ConnectParams,
    connect: ConnectSpec,
    connections: Option<Arc<Connections>>,
}

impl fmt::Debug for Volume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Volume")
            .field("name", &self.table.load().plan.name)
            .field("geometry", &self.geometry())
            .field("controllers", &self.controller_count())
            .field("health", &self.health())
            .finish_non_exhaustive()
    }
}

impl Volume {
    /// Validates `plan`, connects one controller per distinct target
    /// address and subsystem (in parallel), checks every namespace against
    /// the plan and starts the I/O queues. Copies failed, syncing or moving
    /// start as `opts` says.
    pub fn open(plan: &ConnectionPlan, opts: VolumeOptions) -> Result<Volume, Error> {
        plan.validate()
            .map_err(|e| Error::Invalid(format!("connection plan of {}: {e}", plan.name)))?;
        let geometry = plan.geometry();
        let copies = usize::from(geometry.copies);
        // Pieces of requests start and end on multiples of the block size
        // or of the stripe unit, whichever is smaller.
        let align = u64::from(plan.block_bytes).min(geometry.stripe_bytes);

        let n = plan.extents.len();
        let mut states = vec![CopyState::Ok; n];
        for (list, state, what) in [
            (&opts.failed_extents, CopyState::Failed, "failed"),
            (&opts.syncing_extents, CopyState::Syncing, "syncing"),
        ] {
            for &i in list {
                if i >= n {
                    return Err(Error::Invalid(format!(
                        "{what} extent {i}: the plan of {} has {n} extents",
                        plan.name
                    )));
                }
                if ![CopyState::Ok, state].contains(&states[i]) {
                    return Err(Error::Invalid(format!(
                        "{}: extent {i} is listed as both failed and syncing",
                        plan.name
                    )));
                }
                states[i] = state;
            }
        }
        // At most one move per slot, to the slot's row, member and copy.
        let mut moving: Vec<Option<&MovingCopy>> = vec![None; n];
        for m in &opts.moving {
            let i = m.extent;
            if i >= n {
                return Err(Error::Invalid(format!(
                    "moving extent {i}: the plan of {} has {n} extents",
                    plan.name
                )));
            }
            moves::check_dest(&plan.name, i, &plan.extents[i], &m.dest)?;
            if moving[i].replace(m).is_some() {
                return Err(Error::Invalid(format!(
                    "{}: extent {i} is listed as moving twice",
                    plan.name
                )));
            }
            if m.switched {
                // The failed or syncing entry is about the old copy.
                states[i] = CopyState::Ok;
            }
        }
        if let Some(g) = (0..n / copies).find(|g| {
            states[g * copies..][..copies]
                .iter()
                .all(|&s| s != CopyState::Ok)
        }) {
            let e = &plan.extents[g * copies];
            return Err(Error::Invalid(format!(
                "{}: row {} of member {} has no copy in sync: every copy is known to have \
                 failed or is syncing",
                plan.name, e.row, e.member
            )));
        }
        // Where each slot's copy is: a switched move's destination, else
        // its plan extent.
        let locations: Vec<&PlanExtent> = (0..n)
            .map(|i| match moving[i] {
                Some(m) if m.switched => &m.dest,
                _ => &plan.extents[i],
            })
            .collect();

        // The namespaces to open: each slot's copy unless known to have
        // failed, and the incoming copies of moves not switched yet
        // (`true`). Leaving copies are opened later, if they can be.
        let mut wanted: Vec<(usize, &PlanExtent, bool)> = Vec::new();
        for i in 0..n {
            if states[i] != CopyState::Failed {
                wanted.push((i, locations[i], false));
            }
            if let Some(m) = moving[i].filter(|m| !m.switched) {
                wanted.push((i, &m.dest, true));
            }
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
        let base = ConnectParams {
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            transport: crate::admin::Transport::Tcp,
            subnqn: String::new(),
            hostnqn: plan.host_nqn.clone(),
            hostid,
            digests: opts.digests,
            kato: opts.keep_alive,
            io_queues: opts.queues_per_controller.max(1),
            queue_depth: opts.queue_depth,
            ctrl_loss_timeout: loss,
            reconnect_delay: opts.reconnect_delay,
            connect_timeout: opts.connect_timeout,
            dhchap: opts.dhchap.clone(),
        };
        let shared = opts.connections.as_deref();
        let one_open = shared.map(|c| lock(&c.opening));
        let places: Vec<(usize, &PlanExtent)> = wanted.iter().map(|&(i, e, _)| (i, e)).collect();
        let connect = ConnectSpec {
            extent_bytes: plan.extent_bytes,
            align,
            queues: opts.queues_per_controller,
            prefer_rdma: opts.prefer_rdma,
        };
        let connected = connect.all(&places, |at, nqn| {
            let key = (at.0, nqn.to_owned(), plan.host_nqn.clone());
            match shared.and_then(|c| c.get(&key)) {
                Some(io) => Reach::Shared(io),
                None => Reach::Connect(controller_params(&base, at, nqn)),
            }
        })?;
        let mut ios = Vec::with_capacity(connected.len());
        let mut slots: Vec<Option<Device>> = (0..n).map(|_| None).collect();
        let mut incoming: Vec<(usize, Device)> = Vec::new();
        for c in connected {
            for (w, dev) in c.devices {
                match wanted[w] {
                    (i, _, false) => slots[i] = Some(dev),
                    (i, _, true) => incoming.push((i, dev)),
                }
            }
            if let Some(s) = shared {
                s.add((c.at, c.subnqn, plan.host_nqn.clone()), &c.io);
            }
            ios.push(c.io);
        }
        drop(one_open);
        let extents = slots
            .into_iter()
            .zip(states)
            .zip(&locations)
            .map(|((dev, state), &at)| {
                let failed = state == CopyState::Failed;
                assert_eq!(dev.is_some(), !failed, "every copy in use was opened");
                // Writes of earlier sessions are unknown: not complete.
                let missed = failed.then(|| Missed::new(plan.extent_bytes, false));
                Arc::new(CopyIo::new(state, dev, missed, at.clone()))
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
            failed = ?opts.failed_extents,
            syncing = ?opts.syncing_extents,
            moving = ?opts.moving.iter().map(|m| m.extent).collect::<Vec<_>>(),
            write_epoch = opts.write_epoch,
            write_hold = opts.write_hold,
            "volume open"
        );
        let gate = WriteGate::new(plan.name.clone(), opts.write_hold_max);
        if opts.write_hold && opts.write_epoch > 0 {
            gate.hold(opts.write_epoch)?;
        }
        let volume = Volume {
            table: ArcSwap::from_pointee(Table {
                plan: Arc::new(plan.clone()),
                geometry,
                extents,
                groups: (0..groups).map(|_| Arc::default()).collect(),
            }),
            copies,
            ios: Mutex::new(ios),
            rr: AtomicUsize::new(0),
            bufs: BufPool::default(),
            on_failed: opts.on_extent_failed,
            drain: Drain::default(),
            write_epoch: AtomicU32::new(opts.write_epoch),
            drained_epoch: AtomicU32::new(opts.write_epoch),
            gate,
            syncing: Mutex::new(()),
            growing: Mutex::new(()),
            params: base,
            connect,
            connections: opts.connections,
        };
        for (i, dev) in incoming {
            let dest = &moving[i].expect("an incoming copy is a move's").dest;
            volume.open_incoming(i, dest, dev);
        }
        // Leaving copies are a courtesy to hosts that have not switched:
        // without one the volume is whole, so one that cannot be reached
        // is done without (and its controller not tried again).
        let failed = |i: &usize| opts.failed_extents.contains(i);
        let mut unreachable: Vec<(SocketAddr, &str)> = Vec::new();
        for m in opts
            .moving
            .iter()
            .filter(|m| m.switched && !failed(&m.extent))
        {
            let old = &plan.extents[m.extent];
            let key = (route(old, opts.prefer_rdma).0, old.subsystem_nqn.as_str());
            let r = if unreachable.contains(&key) {
                Err(Error::Invalid(
                    "its controller could not be connected".into(),
                ))
            } else {
                volume.connect_copy(m.extent, old)
            };
            match r {
                Ok(dev) => volume.open_leaving(m.extent, dev),
                Err(e) => {
                    if matches!(e, Error::Connect { .. } | Error::Timeout { .. }) {
                        unreachable.push(key);
                    }
                    tracing::warn!(
                        volume = %plan.name,
                        extent = m.extent,
                        target = %old.target,
                        addr = %old.addr,
                        nsid = old.nsid,
                        error = %e,
                        "the leaving copy of a switched move cannot be opened; doing without"
                    );
                }
            }
        }
        Ok(volume)
    }

    /// The plan the volume was opened with, or the last one it grew to
    /// ([`Volume::grow`]). Moves do not change it: where each copy is now
    /// is [`Volume::extent_location`].
    pub fn plan(&self) -> Arc<ConnectionPlan> {
        self.table.load().plan.clone()
    }

    pub fn geometry(&self) -> Geometry {
        self.table.load().geometry
    }

    /// Bytes, as of the last [`Volume::grow`].
    pub fn size(&self) -> u64 {
        self.table.load().geometry.size_bytes
    }

    pub fn block_size(&self) -> u32 {
        self.table.load().plan.block_bytes
    }

    /// The current table, for control calls (an `Arc`: they may block).
    fn table(&self) -> Arc<Table> {
        self.table.load_full()
    }

    /// Controllers the volume holds: one per distinct target address and
    /// subsystem it uses, plus lost ones until no copy uses them.
    pub fn controller_count(&self) -> usize {
        lock(&self.ios).len()
    }

    /// The I/O queue pools the volume holds, one per controller, in order
    /// of first use in the plan, controllers connected by
    /// [`Volume::begin_sync`] last (for statistics:
    /// [`ControllerIo::in_flight`]).
    pub fn controllers(&self) -> Vec<Arc<ControllerIo>> {
        lock(&self.ios).clone()
    }

    /// The state of plan extent `index` (one copy).
    ///
    /// # Panics
    /// If `index` is not an extent of the plan.
    pub fn copy_state(&self, index: usize) -> CopyState {
        self.table.load().extents[index].state()
    }

    /// The copies failed, syncing or moving, and the extents left without
    /// a copy in sync.
    pub fn health(&self) -> VolumeHealth {
        let t = self.table();
        let in_state = |s: CopyState| -> Vec<usize> {
            (0..t.extents.len())
                .filter(|&i| t.extents[i].state() == s)
                .collect()
        };
        let lost = (0..t.groups.len())
            .filter(|&g| self.group_lost(&t, g))
            .map(|g| {
                let e = &t.plan.extents[g * self.copies];
                (e.row, e.member)
            })
            .collect();
        VolumeHealth {
            failed_extents: in_state(CopyState::Failed),
            syncing_extents: in_state(CopyState::Syncing),
            lost,
            moving_extents: self.moving_extents(&t),
        }
    }

    /// No copy of extent group `group` is in sync.
    fn group_lost(&self, t: &Table, group: usize) -> bool {
        (0..self.copies).all(|c| t.extents[group * self.copies + c].state() != CopyState::Ok)
    }

    /// The missed-regions record of copy `index` when it is
    /// [`CopyState::Failed`]; `None` otherwise (or for an index outside
    /// the plan).
    pub fn missed_regions(&self, index: usize) -> Option<MissedRegions> {
        let t = self.table();
        let x = t.extents.get(index)?;
        let _e = lock(&x.edit);
        if x.state() != CopyState::Failed {
            return None;
        }
        let record = x.missed.load();
        (*record).as_deref().map(Missed::snapshot)
    }

    /// Blocking; call it from a control thread, never from an I/O callback
    /// ([`VolumeOptions::on_extent_failed`]) or an async task.
    ///
    /// `Failed` → `Syncing`: connects the copy's controller again if the
    /// volume has no live one for its target and subsystem (a new
    /// controller, or a live one shared through [`Connections`], where a
    /// new one is registered too), checks the namespace as open does,
    /// switches the copy to `Syncing` (written, never read), then waits up
    /// to [`SYNC_DRAIN_TIMEOUT`] until every write, write-zeroes, discard
    /// and flush issued before the switch has completed. Returns the
    /// regions written while the copy was `Failed` in this session and
    /// whether that record is complete (see [`MissedRegions`]).
    ///
    /// On a `Syncing` copy it drains again and returns the same record (a
    /// retry after a timeout is safe). On an `Ok` copy (another host saw it
    /// fail, this one did not) it stops reading it, drains and returns an
    /// empty complete record: this host wrote everything to it; refused
    /// when it is the group's last copy in sync. A copy that fails again
    /// before the drain ends is `Failed` again (reported as usual) and the
    /// call fails.
    pub fn begin_sync(&self, index: usize) -> Result<MissedRegions, Error> {
        let t = self.table();
        let Some(x) = t.extents.get(index) else {
            return Err(self.not_in_plan(&t, index));
        };
        let _one = lock(&self.syncing);
        self.release_lost_controllers();
        let record = loop {
            match x.state() {
                CopyState::Syncing => break x.missed.load_full(),
                CopyState::Failed => {
                    let dev = self.connect_copy(index, &x.location.load_full())?;
                    let _e = lock(&x.edit);
                    // Only begin_sync and switch_move leave Failed, one
                    // call at a time (both hold `syncing`).
                    assert_eq!(x.state(), CopyState::Failed, "a failed copy stays failed");
                    // The handle before the state: whoever sees Syncing
                    // finds it.
                    x.dev.store(Some(Arc::new(dev)));
                    x.set_state(CopyState::Syncing);
                    break x.missed.load_full();
                }
                CopyState::Ok => {
                    let group = index - index % self.copies;
                    let others = (group..group + self.copies)
                        .filter(|&j| j != index && t.extents[j].state() == CopyState::Ok)
                        .count();
                    if others == 0 {
                        let e = x.location.load();
                        return Err(Error::Invalid(format!(
                            "{}: extent {index} is the last copy in sync of row {} member {}",
                            t.plan.name, e.row, e.member
                        )));
                    }
                    let _e = lock(&x.edit);
                    if x.state() == CopyState::Ok {
                        x.set_state(CopyState::Syncing);
                        x.missed.store(None);
                        break None;
                    }
                    // It failed meanwhile: start over from Failed.
                }
            }
        };
        tracing::info!(volume = %t.plan.name, extent = index, "extent copy syncing; draining");
        if !self.drain.wait(SYNC_DRAIN_TIMEOUT) {
            return Err(Error::Timeout {
                addr: format!("volume {} extent {index}", t.plan.name),
                what: "the writes issued before the copy started syncing",
            });
        }
        if x.state() == CopyState::Failed {
            return Err(Error::Invalid(format!(
                "{}: extent {index} failed again while its sync began",
                t.plan.name
            )));
        }
        Ok(record.map_or(
            MissedRegions {
                regions: Vec::new(),
                complete: true,
            },
            |r| r.snapshot(),
        ))
    }

    /// `Syncing` → `Ok`: reads may use the copy. No-op in any other state.
    pub fn finish_sync(&self, index: usize) {
        let t = self.table();
        let Some(x) = t.extents.get(index) else {
            return;
        };
        let _e = lock(&x.edit);
        if x.state() == CopyState::Syncing {
            x.set_state(CopyState::Ok);
            x.missed.store(None);
            tracing::info!(volume = %t.plan.name, extent = index, "extent copy in sync");
        }
    }

    /// `Syncing` → `Failed` without reporting it (the control plane
    /// cancelled the copy job, or it ended without bringing the copy in
    /// sync): not written from now on, and its missed regions are recorded
    /// from now, in a fresh record that is complete (this session sees
    /// every later write). No-op in any other state.
    pub fn abort_sync(&self, index: usize) {
        let t = self.table();
        if let Some(x) = t.extents.get(index) {
            if x.fail(
                &[CopyState::Syncing],
                t.plan.extent_bytes,
                Mark::Nothing,
                None,
            ) {
                tracing::info!(
                    volume = %t.plan.name,
                    extent = index,
                    "extent copy sync aborted"
                );
            }
        }
    }

    /// The write epoch mutations admitted now are tagged with.
    pub fn write_epoch(&self) -> u32 {
        self.write_epoch.load(Ordering::SeqCst)
    }

    /// Blocking; call it from a control thread, never from an I/O callback
    /// or an async task.
    ///
    /// Raises the volume's write epoch to `epoch` (design/thin-snapshots.md
    /// T5): every write, write-zeroes and discard admitted from now on is
    /// tagged with it (or a later one), then the call waits up to
    /// [`SYNC_DRAIN_TIMEOUT`] until every mutation admitted before has
    /// completed, with begin_sync's drain. Once it returns `Ok`, no
    /// mutation tagged below `epoch` is in flight and none is sent again.
    /// An epoch at or below one already drained is a no-op; one that is
    /// tagged with already but whose drain timed out drains again (a
    /// retry is safe). The epoch never goes down.
    ///
    /// **Why no mutation is admitted with an older epoch once the drain
    /// began.** A mutation takes its drain hold, then loads the epoch
    /// (both `SeqCst`); this call stores the epoch, then waits. This is
    /// drain.rs's argument with the epoch in place of a copy's state: a
    /// mutation that loaded the old epoch did so before the store in the
    /// single `SeqCst` order, and counted itself before that, so every
    /// counter check of the wait (all after the store) sees it and waits
    /// for it to complete; a mutation the wait does not wait for counted
    /// itself after a check, hence after the store, and its epoch load,
    /// later still, sees the new epoch. Loading the epoch before taking
    /// the hold would break this: the load could see the old epoch and the
    /// hold be counted after the wait's last check.
    pub fn set_write_epoch(&self, epoch: u32) -> Result<(), Error> {
        if epoch <= self.drained_epoch.load(Ordering::SeqCst) {
            return Ok(());
        }
        let before = self.write_epoch.fetch_max(epoch, Ordering::SeqCst);
        let name = self.table.load().plan.name.clone();
        tracing::info!(volume = %name, from = before, to = epoch,
            "write epoch raised; draining older writes");
        if !self.drain.wait(SYNC_DRAIN_TIMEOUT) {
            return Err(Error::Timeout {
                addr: format!("volume {name}"),
                what: "the writes issued before the write epoch rose",
            });
        }
        self.drained_epoch.fetch_max(epoch, Ordering::SeqCst);
        Ok(())
    }

    /// Blocking, like [`Volume::set_write_epoch`]; call it from a control
    /// thread.
    ///
    /// Holds writes at a barrier (design/thin-snapshots.md T5, group
    /// snapshots): from the moment it is called no new write, write-zeroes
    /// or discard is admitted (each waits, as a pending future, without
    /// blocking the thread that submitted it), while writes already
    /// issued go on; reads and flushes are never held. The epoch rises to
    /// `epoch` and the call waits, with `set_write_epoch`'s drain, until
    /// every mutation admitted before has completed. `Ok(true)`: held, and
    /// nothing tagged below `epoch` is in flight. `Ok(false)`: drained the
    /// same, but not held, because a hold at `epoch` already ended (it was
    /// released, or it expired on its own while this call drained): that
    /// barrier is over. An error leaves the hold on (the drain timed out:
    /// call again) or never set it (the volume is closing).
    ///
    /// Until [`Volume::release_writes`], no mutation tagged `epoch` (or
    /// higher) is sent. A hold not released within
    /// [`VolumeOptions::write_hold_max`] ends on its own, with a warning.
    /// Called again while held at `epoch` it drains again (a retry is
    /// safe); at a higher epoch it moves there, its time limit counted
    /// again.
    pub fn hold_writes(&self, epoch: u32) -> Result<bool, Error> {
        let name = self.table.load().plan.name.clone();
        // The held flag first, then the epoch: see `admit`.
        if self.gate.hold(epoch)? == Held::Over {
            self.set_write_epoch(epoch)?;
            return Ok(false);
        }
        let before = self.write_epoch.fetch_max(epoch, Ordering::SeqCst);
        tracing::info!(volume = %name, from = before, to = epoch,
            "writes held at a barrier; draining older writes");
        if !self.drain.wait(SYNC_DRAIN_TIMEOUT) {
            return Err(Error::Timeout {
                addr: format!("volume {name}"),
                what: "the writes issued before the writes were held",
            });
        }
        self.drained_epoch.fetch_max(epoch, Ordering::SeqCst);
        Ok(self.gate.holds_at(epoch))
    }

    /// Ends a hold ([`Volume::hold_writes`]): the waiting mutations are
    /// admitted, tagged with the volume's epoch. No-op when none is on.
    pub fn release_writes(&self) {
        if self.gate.release() {
            tracing::info!(volume = %self.table.load().plan.name,
                epoch = self.write_epoch(), "write hold released");
        }
    }

    /// True while writes are held.
    pub fn writes_held(&self) -> bool {
        self.gate.is_held()
    }

    /// `Ok` or `Syncing` → `Failed` without reporting it: the control plane
    /// says the copy is stale (another host saw it fail). Neither read nor
    /// written from now on; its missed regions are recorded from now, in a
    /// fresh, complete record. No-op on a failed copy or an index outside
    /// the plan.
    pub fn mark_failed(&self, index: usize) {
        let t = self.table();
        if let Some(x) = t.extents.get(index) {
            let from = [CopyState::Ok, CopyState::Syncing];
            if x.fail(&from, t.plan.extent_bytes, Mark::Nothing, None) {
                tracing::warn!(
                    volume = %t.plan.name,
                    extent = index,
                    "extent copy marked failed (stale, says the control plane)"
                );
            }
        }
    }

    /// Blocking; call it from a control thread, never from an I/O callback
    /// or an async task.
    ///
    /// Takes a bigger plan of the same volume (`nvpool volume resize`: rows
    /// appended, nothing else changed). The new extents are connected as
    /// [`Volume::open`] connects extents (controllers the volume or its
    /// [`Connections`] have are used, others connected, every namespace
    /// checked with Identify, I/O queues started), then the new rows are
    /// published at once: a request issued before fails past the old end
    /// as it always did, one issued after is served up to the new one, and
    /// requests in flight finish on what they started with. Existing
    /// extents keep their copy states, missed regions and moves (the grown
    /// volume shares them); new extents start in sync.
    ///
    /// Returns false when `plan` has the volume's size: nothing to do.
    /// Refused ([`Error::Invalid`]) for another volume or host, another
    /// block size, extent size or layout, a smaller size, or an existing
    /// extent at another address, subsystem or namespace than the volume
    /// has it (its plan's place, or where a move switched it to). Nothing
    /// changes when it is refused or a new extent cannot be connected or
    /// checked; a later call may succeed.
    pub fn grow(&self, plan: &ConnectionPlan) -> Result<bool, Error> {
        plan.validate()
            .map_err(|e| Error::Invalid(format!("connection plan of {}: {e}", plan.name)))?;
        let _one = lock(&self.growing);
        let old = self.table();
        check_growth(&old, plan)?;
        if plan.size_bytes == old.geometry.size_bytes {
            return Ok(false);
        }
        // Rows are appended: the new extents follow the old ones.
        let added: Vec<(usize, &PlanExtent)> = plan
            .extents
            .iter()
            .enumerate()
            .skip(old.extents.len())
            .collect();
        let mut devices: Vec<Option<Device>> = added.iter().map(|_| None).collect();
        if !added.is_empty() {
            let _one_open = self.connections.as_deref().map(|c| lock(&c.opening));
            for r in self.connect.all(&added, |at, nqn| self.reach(at, nqn))? {
                self.adopt(&r.io, r.at, &r.subnqn);
                for (w, dev) in r.devices {
                    devices[w] = Some(dev);
                }
            }
        }
        let mut extents = old.extents.clone();
        for (&(_, e), dev) in added.iter().zip(devices) {
            assert!(dev.is_some(), "ConnectSpec::all opens every namespace");
            extents.push(Arc::new(CopyIo::new(CopyState::Ok, dev, None, e.clone())));
        }
        let mut groups = old.groups.clone();
        groups.resize_with(extents.len() / self.copies, Arc::default);
        self.table.store(Arc::new(Table {
            plan: Arc::new(plan.clone()),
            geometry: plan.geometry(),
            extents,
            groups,
        }));
        tracing::info!(
            volume = %plan.name,
            from = old.geometry.size_bytes,
            to = plan.size_bytes,
            extents_added = added.len(),
            controllers = self.controller_count(),
            "volume grown"
        );
        Ok(true)
    }

    /// A namespace handle on `e`, a place of copy `index` (where it is, or
    /// where it moves), on a live controller: the volume's own, else a
    /// shared one, else a new one.
    fn connect_copy(&self, index: usize, e: &PlanExtent) -> Result<Device, Error> {
        let _one_open = self.connections.as_deref().map(|c| lock(&c.opening));
        let at = route(e, self.connect.prefer_rdma);
        let reach = self.reach(at, &e.subsystem_nqn);
        let mut c = self.connect.one(reach, &[(index, e)])?;
        self.adopt(&c.io, at.0, &e.subsystem_nqn);
        c.devices
            .pop()
            .ok_or_else(|| Error::Invalid(format!("extent {index}: no namespace was opened")))
    }

    /// How to reach the controller of `nqn` at `at` (routed, see
    /// [`route`]): a live one of the volume's, else a live one of its
    /// [`Connections`], else a new one. The caller holds the
    /// `Connections`' `opening` lock until it has [`Volume::adopt`]ed it.
    fn reach(&self, at: (SocketAddr, bool), nqn: &str) -> Reach {
        let mine = lock(&self.ios)
            .iter()
            .find(|io| {
                let c = io.controller();
                c.addr() == at.0 && c.params.subnqn == nqn && !io.is_lost()
            })
            .cloned();
        let key = (at.0, nqn.to_owned(), self.params.hostnqn.clone());
        let shared = self.connections.as_deref();
        match mine.or_else(|| shared.and_then(|c| c.get(&key))) {
            Some(io) => Reach::Shared(io),
            None => Reach::Connect(controller_params(&self.params, at, nqn)),
        }
    }

    /// Counts `io`, reached at `at` for `nqn`, among the volume's
    /// controllers and its [`Connections`]' (once each).
    fn adopt(&self, io: &Arc<ControllerIo>, at: SocketAddr, nqn: &str) {
        {
            let mut ios = lock(&self.ios);
            if !ios.iter().any(|x| Arc::ptr_eq(x, io)) {
                ios.push(io.clone());
            }
        }
        if let Some(s) = &self.connections {
            s.add((at, nqn.to_owned(), self.params.hostnqn.clone()), io);
        }
    }

    /// Lets go of lost controllers no namespace handle uses any more (their
    /// worker threads are joined here, on the calling thread).
    fn release_lost_controllers(&self) {
        let gone: Vec<Arc<ControllerIo>> = {
            let mut ios = lock(&self.ios);
            let (gone, keep) = ios
                .drain(..)
                .partition(|io| io.is_lost() && Arc::strong_count(io) == 1);
            *ios = keep;
            gone
        };
        drop(gone);
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

    fn check(t: &Table, offset: u64, len: u64) -> Result<(), IoError> {
        let bs = u64::from(t.plan.block_bytes);
        if !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) {
            return Err(IoError::Invalid(
                "offset and length must be multiples of the block size",
            ));
        }
        if offset
            .checked_add(len)
            .is_none_or(|e| e > t.geometry.size_bytes)
        {
            return Err(IoError::Invalid("range past the end of the volume"));
        }
        Ok(())
    }

    fn split(t: &Table, offset: u64, len: u64) -> Result<runs::Split, IoError> {
        Volume::check(t, offset, len)?;
        runs::split(&t.geometry, offset, len)
            .map_err(|_| IoError::Invalid("range past the end of the volume"))
    }

    /// Reads `buf.len()` bytes at `offset`; the buffer comes back filled.
    pub async fn read(&self, offset: u64, mut buf: Vec<u8>) -> BufResult {
        // The one load of the table: this request works on it to its end.
        let t = self.table.load();
        let split = match Volume::split(&t, offset, buf.len() as u64) {
            Ok(s) => s,
            Err(e) => return (Err(e), buf),
        };
        match split.runs.as_slice() {
            [] => (Ok(()), buf),
            // One extent: the caller's buffer goes through.
            [r] => self.read_run(&t, r.first, r.extent_offset, buf).await,
            runs => {
                let all = runs.iter().map(|r| {
                    let b = self.bufs.get(r.len as usize);
                    self.read_run(&t, r.first, r.extent_offset, b)
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

    /// Writes `buf` at `offset` to every copy in sync or syncing; with
    /// `fua` it is durable on every copy on success.
    pub async fn write(&self, offset: u64, buf: Vec<u8>, fua: bool) -> BufResult {
        let (_hold, epoch) = self.admit().await;
        let t = self.table.load();
        let split = match Volume::split(&t, offset, buf.len() as u64) {
            Ok(s) => s,
            Err(e) => return (Err(e), buf),
        };
        let m = Mutation::Write { fua, epoch };
        match split.runs.as_slice() {
            [] => (Ok(()), buf),
            [r] => {
                self.mutate_run(&t, r.first, r.extent_offset, r.len, m, buf)
                    .await
            }
            runs => {
                let pieces = split.gather(&buf);
                let all = runs
                    .iter()
                    .zip(pieces)
                    .map(|(r, b)| self.mutate_run(&t, r.first, r.extent_offset, r.len, m, b));
                let r = first_error(join_all(all).await);
                (r, buf)
            }
        }
    }

    /// Zeroes a range on every copy in sync or syncing; `may_unmap` lets
    /// the targets deallocate it.
    pub async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> Result<(), IoError> {
        self.mutate(offset, len, |epoch| Mutation::Zeroes {
            unmap: may_unmap,
            epoch,
        })
        .await
    }

    /// Discards a range on every copy in sync or syncing.
    pub async fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.mutate(offset, len, |epoch| Mutation::Discard { epoch })
            .await
    }

    /// Admits a mutation: waits while writes are held, then returns its
    /// drain hold (outstanding until it completes or is dropped, for
    /// begin_sync, moves and the epoch's drains) and the epoch to tag it
    /// with, loaded after the hold, never before (see set_write_epoch).
    ///
    /// **Why nothing goes out tagged with a held epoch.** `hold_writes`
    /// stores the held flag, then the epoch; a mutation loads the epoch,
    /// then the flag (all `SeqCst`). A mutation that loaded the new epoch
    /// did so after its store, so after the flag's, and its flag load,
    /// later still, sees the hold unless a release cleared it since. One
    /// that sees no hold therefore carries an epoch from before the hold
    /// (and counted itself before, so the hold's drain waits for it), or
    /// comes after the release. A held one gives its drain count back
    /// before it waits, so no drain ever waits for a held write.
    async fn admit(&self) -> (Hold<'_>, u32) {
        loop {
            let hold = self.drain.enter();
            let epoch = self.write_epoch.load(Ordering::SeqCst);
            if !self.gate.is_held() {
                return (hold, epoch);
            }
            drop(hold);
            self.gate.released().await;
        }
    }

    /// Applies the mutation `tagged` makes of the volume's write epoch.
    async fn mutate(
        &self,
        offset: u64,
        len: u64,
        tagged: impl FnOnce(u32) -> Mutation,
    ) -> Result<(), IoError> {
        let (_hold, epoch) = self.admit().await;
        let m = tagged(epoch);
        let t = self.table.load();
        let split = Volume::split(&t, offset, len)?;
        let all = split
            .runs
            .iter()
            .map(|r| self.mutate_run(&t, r.first, r.extent_offset, r.len, m, Vec::new()));
        first_error(join_all(all).await)
    }

    /// Makes every completed write durable: flushes each namespace written
    /// since the last flush, on every copy in sync or syncing.
    pub async fn flush(&self) -> Result<(), IoError> {
        let _hold = self.drain.enter();
        let t = self.table.load();
        let groups: Vec<usize> = (0..t.groups.len())
            .filter(|&g| {
                let dirty = &t.groups[g].dirty;
                dirty.load(Ordering::SeqCst) && dirty.swap(false, Ordering::SeqCst)
            })
            .collect();
        let mut first = Ok(());
        for batch in groups.chunks(FLUSH_EXTENTS_IN_FLIGHT_MAX) {
            let all = batch
                .iter()
                .map(|&g| self.mutate_run(&t, g * self.copies, 0, 0, Mutation::Flush, Vec::new()));
            for (&g, (r, _)) in batch.iter().zip(join_all(all).await) {
                if let Err(e) = r {
                    // Still not durable: the next flush tries again.
                    t.groups[g].dirty.store(true, Ordering::SeqCst);
                    if first.is_ok() {
                        first = Err(e);
                    }
                }
            }
        }
        first
    }

    /// Reads one run from one copy in sync, moving to another when the
    /// chosen one fails.
    async fn read_run(&self, t: &Table, first: usize, offset: u64, mut buf: Vec<u8>) -> BufResult {
        let len = buf.len();
        let mut tried = 0u32;
        let mut last = None;
        loop {
            let Some(c) = self.pick_read_copy(t, first, tried) else {
                return (Err(last.unwrap_or(IoError::ControllerLost)), buf);
            };
            tried |= 1 << c;
            let dev = t.extents[first + c].device();
            let (r, b) = dev.read(offset, buf).await;
            // A lost controller cannot hand back the buffer it held.
            buf = if b.len() == len { b } else { vec![0; len] };
            match r {
                Ok(()) => return (Ok(()), buf),
                Err(e) => match blame(&e) {
                    Blame::Path => {
                        self.fail_extent(first + c, &dev, &e, Mark::Nothing);
                        last = Some(e);
                    }
                    Blame::Media => last = Some(e),
                    Blame::Request => return (Err(e), buf),
                },
            }
        }
    }

    /// The copy in sync not in `tried` whose controller has the fewest
    /// requests in flight; ties rotate. Never a `Syncing` copy.
    fn pick_read_copy(&self, t: &Table, first: usize, tried: u32) -> Option<usize> {
        let usable =
            |c: usize| tried & (1 << c) == 0 && t.extents[first + c].state() == CopyState::Ok;
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
            let load = match &*t.extents[first + c].dev.load() {
                Some(d) => d.io().in_flight(),
                None => usize::MAX,
            };
            if best.is_none_or(|(_, l)| load < l) {
                best = Some((c, load));
            }
        }
        best.map(|(c, _)| c)
    }

    /// Who a mutation of the group starting at plan extent `first` writes:
    /// the copies by state with their handles, and the group's shadow
    /// copies, loaded in the order moves.rs argues for (shadows, states and
    /// handles, shadows again unless there were none; again from the top
    /// when a move changed them meanwhile).
    fn run_copies(&self, t: &Table, first: usize) -> RunCopies {
        let moves = &t.groups[first / self.copies].moves;
        let mut shadows = moves.shadow.load_full();
        loop {
            let mut r = RunCopies {
                in_sync: 0,
                syncing: 0,
                failed: 0,
                devs: Default::default(),
                shadows: None,
            };
            for c in 0..self.copies {
                let x = &t.extents[first + c];
                // The state before the handle: see CopyIo.
                match x.state() {
                    CopyState::Ok => r.in_sync |= 1 << c,
                    CopyState::Syncing => r.syncing |= 1 << c,
                    CopyState::Failed => {
                        r.failed |= 1 << c;
                        continue;
                    }
                }
                r.devs[c] = Some(x.device());
            }
            let Some(seen) = &shadows else {
                return r;
            };
            let now = moves.shadow.load_full();
            if now.as_ref().is_some_and(|n| Arc::ptr_eq(n, seen)) {
                r.shadows = now;
                return r;
            }
            shadows = now;
        }
    }

    /// Applies `m` to every `Ok` and `Syncing` copy of one run, and to the
    /// group's incoming and leaving copies, and marks it on the `Failed`
    /// ones; succeeds when at least one `Ok` copy took it. Copies that
    /// missed it are marked failed, incoming copies that did dropped. The
    /// caller holds a drain hold: the states are read after it was counted
    /// (drain.rs).
    async fn mutate_run(
        &self,
        t: &Table,
        first: usize,
        offset: u64,
        len: u64,
        m: Mutation,
        buf: Vec<u8>,
    ) -> BufResult {
        let RunCopies {
            in_sync,
            syncing,
            failed,
            devs,
            shadows,
        } = self.run_copies(t, first);
        if m != Mutation::Flush {
            for c in (0..self.copies).filter(|&c| failed & (1 << c) != 0) {
                t.extents[first + c].note_missed(offset, len);
            }
        }
        if in_sync == 0 {
            // Nothing could make it succeed; a Syncing copy taking it alone
            // would hold bytes no copy in sync has.
            return (Err(IoError::ControllerLost), buf);
        }
        let extra: &[moves::Extra] = shadows.as_deref().map_or(&[], |s| &s.list);
        let targets = in_sync | syncing;
        let own = targets.count_ones() as usize;
        let n = own + extra.len();
        let is_write = matches!(m, Mutation::Write { .. });
        let copies = || (0..self.copies).filter(move |&c| targets & (1 << c) != 0);
        // Borrowed: the run's view holds one reference to each handle.
        let handles = copies()
            .map(|c| &**devs[c].as_ref().expect("a copy in use has a handle"))
            .chain(extra.iter().map(|x| &*x.dev));
        // A write to one copy travels in the caller's buffer; a write to
        // several shares it, each request holding a reference.
        let (shared, mut data) = if is_write && n > 1 {
            (Some(Arc::new(buf)), None)
        } else {
            (None, Some(buf))
        };
        let all = handles.map(|dev| {
            let b = match &shared {
                Some(s) => Data::Shared(s.clone()),
                None if is_write => Data::Owned(data.take().unwrap_or_default()),
                None => Data::None,
            };
            mutate(dev, m, offset, len, b)
        });
        let results = join_all(all).await;
        // Only a copy in sync taking it counts: a Syncing copy is read by
        // no one until its copy job ends, and that job may fail (and the
        // same for incoming copies; leaving ones are not this host's).
        let acked = copies()
            .zip(&results)
            .any(|(c, (r, _))| in_sync & (1 << c) != 0 && r.is_ok());
        // The caller learns about the request rather than the path, and
        // only from copies in sync.
        let mut err: Option<IoError> = None;
        for (c, (r, _)) in copies().zip(&results) {
            if let (true, Err(e)) = (in_sync & (1 << c) != 0, r) {
                if err
                    .as_ref()
                    .is_none_or(|p| blame(p) == Blame::Path && blame(e) != Blame::Path)
                {
                    err = Some(e.clone());
                }
            }
        }
        let mark = match m {
            // Any write since the last flush may be lost on that copy.
            Mutation::Flush => Mark::Unknown,
            _ => Mark::Range { offset, len },
        };
        // The caller's buffer: shared by the copies, or back from the one
        // request that carried it.
        let mut back: Option<Vec<u8>> = data;
        let mut results = results.into_iter();
        for (c, (r, b)) in copies().zip(results.by_ref()) {
            if is_write && shared.is_none() {
                back = Some(b);
            }
            let index = first + c;
            let dev = devs[c].as_ref().expect("a copy in use has a handle");
            if in_sync & (1 << c) != 0 {
                if let Err(e) = r {
                    if acked || blame(&e) == Blame::Path {
                        // Stale (another copy took it) or unreachable.
                        self.fail_extent(index, dev, &e, mark);
                    }
                }
                continue;
            }
            if let Some(e) = strayed(r, acked, m, &err) {
                self.fail_extent(index, dev, &e, mark);
            }
        }
        for (x, (r, b)) in extra.iter().zip(results) {
            if is_write && shared.is_none() {
                back = Some(b);
            }
            // Leaving copies: whatever they answered.
            let Some(incoming) = &x.incoming else {
                continue;
            };
            if let Some(e) = strayed(r, acked, m, &err) {
                self.incoming_strayed(first + x.copy, incoming, &e, mark);
            }
        }
        if m != Mutation::Flush {
            t.groups[first / self.copies]
                .dirty
                .store(true, Ordering::SeqCst);
        }
        let r = if acked {
            Ok(())
        } else {
            Err(err.unwrap_or(IoError::ControllerLost))
        };
        // Every request is done, so the shared buffer is the caller's again.
        let back = match shared {
            Some(s) => Arc::try_unwrap(s).unwrap_or_else(|s| s.to_vec()),
            None => back.unwrap_or_default(),
        };
        (r, back)
    }

    /// Stops using extent copy `index` (→ `Failed`, `mark` recorded as
    /// missed) after `dev` failed, if `dev` is still its handle (a move
    /// may have switched it away). When its controller is lost, every
    /// extent behind that controller goes too.
    fn fail_extent(&self, index: usize, dev: &Arc<Device>, error: &IoError, mark: Mark) {
        // The newest table: it has the extents of every older one, and
        // those of a grow behind a lost controller too.
        let t = self.table();
        let x = &t.extents[index];
        let in_use = [CopyState::Ok, CopyState::Syncing];
        if x.fail(&in_use, t.plan.extent_bytes, mark, Some(dev)) {
            self.report(&t, index, error);
        }
        let io = dev.io();
        if *error == IoError::ControllerLost && io.is_lost() {
            for (j, y) in t.extents.iter().enumerate() {
                let Some(d) = y.dev.load_full() else {
                    continue;
                };
                if Arc::ptr_eq(d.io(), io)
                    && y.fail(&in_use, t.plan.extent_bytes, Mark::Nothing, Some(&d))
                {
                    self.report(&t, j, error);
                }
            }
        }
    }

    fn report(&self, t: &Table, index: usize, error: &IoError) {
        let e = t.extents[index].location.load_full();
        let member_lost = self.group_lost(t, index / self.copies);
        tracing::error!(
            volume = %t.plan.name,
            extent = index,
            row = e.row,
            member = e.member,
            copy = e.copy,
            target = %e.target,
            addr = %e.addr,
            nsid = e.nsid,
            error = %error,
            member_lost,
            "extent copy failed; not used again until it is re-synced"
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

/// Refuses `new` as a grown plan of the volume `t` serves (see
/// [`Volume::grow`]); a plan of the same size passes when nothing but
/// unchecked details (target ids, device names, RDMA addresses) changed.
fn check_growth(t: &Table, new: &ConnectionPlan) -> Result<(), Error> {
    let old = &t.plan;
    let refuse = |why: String| {
        Err(Error::Invalid(format!(
            "{}: cannot grow to this plan: {why}",
            old.name
        )))
    };
    if (new.volume, &new.name) != (old.volume, &old.name) {
        return refuse(format!(
            "it is volume {} ({}), this is {} ({})",
            new.name, new.volume, old.name, old.volume
        ));
    }
    if new.host_nqn != old.host_nqn {
        return refuse(format!(
            "it is for host {}, the volume is served to {}",
            new.host_nqn, old.host_nqn
        ));
    }
    if new.block_bytes != old.block_bytes {
        return refuse(format!(
            "its blocks are {} bytes, the volume's {}",
            new.block_bytes, old.block_bytes
        ));
    }
    if new.extent_bytes != old.extent_bytes {
        return refuse(format!(
            "its extents are {} bytes, the volume's {}",
            new.extent_bytes, old.extent_bytes
        ));
    }
    if new.layout != old.layout {
        return refuse(format!(
            "its layout is {}, the volume's {} (growing only adds rows)",
            new.layout(),
            old.layout()
        ));
    }
    if new.size_bytes < old.size_bytes {
        return refuse(format!(
            "it has {} bytes, the volume {}: a volume never shrinks",
            new.size_bytes, old.size_bytes
        ));
    }
    // Same layout, no smaller: the plan (validated) has every old extent.
    for (i, (x, e)) in t.extents.iter().zip(&new.extents).enumerate() {
        let here = x.location.load();
        if !moves::same_place(e, &old.extents[i]) && !moves::same_place(e, &here) {
            return refuse(format!(
                "it has extent {i} at {} {} namespace {}, the volume has it at {} {} \
                 namespace {}",
                e.addr, e.subsystem_nqn, e.nsid, here.addr, here.subsystem_nqn, here.nsid
            ));
        }
    }
    Ok(())
}

/// `base` for the controller serving `subnqn` at `addr` (over RDMA when
/// `rdma`, see [`route`]).
fn controller_params(
    base: &ConnectParams,
    (addr, rdma): (SocketAddr, bool),
    subnqn: &str,
) -> ConnectParams {
    ConnectParams {
        addr,
        transport: if rdma {
            crate::admin::Transport::Rdma
        } else {
            crate::admin::Transport::Tcp
        },
        subnqn: subnqn.to_owned(),
        ..base.clone()
    }
}

/// Where to reach an extent's controller, and whether over RDMA: the
/// target's NVMe/RDMA address when the plan has one, RDMA is preferred and
/// this host can do RDMA; else its NVMe/TCP address.
fn route(e: &PlanExtent, prefer_rdma: bool) -> (SocketAddr, bool) {
    static RDMA_HERE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    match e.rdma_addr {
        Some(a) if prefer_rdma && *RDMA_HERE.get_or_init(|| nvpool_rdma::available().is_ok()) => {
            (a, true)
        }
        _ => (e.addr, false),
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
    /// In the order asked for.
    devices: Vec<Device>,
}

/// How a volume reaches one controller.
enum Reach {
    Connect(ConnectParams),
    /// Already connected for another volume.
    Shared(Arc<ControllerIo>),
}

/// The namespaces a controller reached by [`ConnectSpec::all`] opened.
struct Reached {
    /// The routed target address and subsystem it was reached at (with
    /// the host NQN, its key in [`Connections`]).
    at: SocketAddr,
    subnqn: String,
    io: Arc<ControllerIo>,
    /// Each with its index in what was asked for.
    devices: Vec<(usize, Device)>,
}

/// How a volume's namespaces are connected and checked; the same for open,
/// grow and copies connected again.
#[derive(Debug, Clone, Copy)]
struct ConnectSpec {
    /// Each namespace holds one extent of this size.
    extent_bytes: u64,
    /// Namespace block sizes must divide it.
    align: u64,
    /// I/O queues of each controller connected here.
    queues: u16,
    prefer_rdma: bool,
}

impl ConnectSpec {
    /// Opens the namespaces `places` (plan extent index, where): grouped by
    /// controller (routed target address, subsystem; see [`route`]) in
    /// order of first use, each controller reached as `reach` says, all of
    /// them in parallel, one thread each, and every namespace checked (see
    /// [`ConnectSpec::one`]). Fails when any controller or namespace does;
    /// whatever was connected is then dropped again (new controllers
    /// disconnect).
    fn all(
        &self,
        places: &[(usize, &PlanExtent)],
        mut reach: impl FnMut((SocketAddr, bool), &str) -> Reach,
    ) -> Result<Vec<Reached>, Error> {
        let mut keys: Vec<((SocketAddr, bool), &str)> = Vec::new();
        let mut served: Vec<Vec<usize>> = Vec::new();
        let mut index: HashMap<(SocketAddr, &str), usize> = HashMap::new();
        for (w, &(_, e)) in places.iter().enumerate() {
            let at = route(e, self.prefer_rdma);
            let nqn = e.subsystem_nqn.as_str();
            let ci = *index.entry((at.0, nqn)).or_insert_with(|| {
                keys.push((at, nqn));
                served.push(Vec::new());
                keys.len() - 1
            });
            served[ci].push(w);
        }
        let reaches: Vec<Reach> = keys.iter().map(|&(at, nqn)| reach(at, nqn)).collect();
        let spec = *self;
        let connected: Vec<Result<Connected, Error>> = std::thread::scope(|s| {
            let threads: Vec<_> = reaches
                .into_iter()
                .zip(&served)
                .map(|(r, mine)| {
                    let mine: Vec<(usize, &PlanExtent)> = mine.iter().map(|&w| places[w]).collect();
                    s.spawn(move || spec.one(r, &mine))
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
        connected
            .into_iter()
            .zip(keys.iter().zip(served))
            .map(|(c, (&(at, nqn), mine))| {
                let c = c?;
                Ok(Reached {
                    at: at.0,
                    subnqn: nqn.to_owned(),
                    io: c.io,
                    devices: mine.into_iter().zip(c.devices).collect(),
                })
            })
            .collect()
    }

    /// Connects one controller (or takes the shared one) and opens the
    /// extents `mine` (copy slot, where) on it, each a namespace of
    /// `extent_bytes` whose block size divides `align`.
    fn one(&self, reach: Reach, mine: &[(usize, &PlanExtent)]) -> Result<Connected, Error> {
        let (extent_bytes, align, queues) = (self.extent_bytes, self.align, self.queues);
        let (ctrl, shared) = match reach {
            Reach::Connect(params) if params.transport == crate::admin::Transport::Rdma => {
                // The target offers RDMA, but this host may not reach it that
                // way (another fabric, no route): NVMe/TCP still works.
                let tcp = mine.first().map(|(_, e)| e.addr);
                match (Controller::connect(params.clone()), tcp) {
                    (Ok(c), _) => (c, None),
                    (Err(e), Some(tcp)) => {
                        tracing::warn!(addr = %params.addr, subsystem = %params.subnqn, error = %e,
                        "cannot reach the target over NVMe/RDMA; using NVMe/TCP");
                        let p = ConnectParams {
                            addr: tcp,
                            transport: crate::admin::Transport::Tcp,
                            ..params
                        };
                        (Controller::connect(p)?, None)
                    }
                    (Err(e), None) => return Err(e),
                }
            }
            Reach::Connect(params) => (Controller::connect(params)?, None),
            Reach::Shared(io) => (io.controller().clone(), Some(io)),
        };
        let (addr, nqn) = (ctrl.addr(), ctrl.params.subnqn.clone());
        let mut infos: Vec<NamespaceInfo> = Vec::with_capacity(mine.len());
        for &(i, e) in mine {
            let info = ctrl.namespace(e.nsid)?;
            let bs = u64::from(info.block_size);
            if info.size_bytes() != extent_bytes || !align.is_multiple_of(bs) {
                return Err(Error::Invalid(format!(
                    "{addr} {nqn}: namespace {} (extent {i}) has {} bytes in {bs}-byte blocks; \
                 the plan needs {} bytes in blocks dividing {align}",
                    e.nsid,
                    info.size_bytes(),
                    extent_bytes
                )));
            }
            if let Some(first) = infos.first() {
                if first.block_size != info.block_size {
                    return Err(Error::Invalid(format!(
                        "{addr} {nqn}: namespaces {} and {} differ in block size ({} and {}); \
                     the I/O queues of one controller count one size",
                        first.nsid, info.nsid, first.block_size, info.block_size
                    )));
                }
            }
            infos.push(info);
        }
        let io = match shared {
            Some(io) => io,
            None => {
                let bs = infos.first().map_or(512, |info| info.block_size);
                ControllerIo::start(ctrl, queues, bs)?
            }
        };
        let devices = infos
            .into_iter()
            .map(|info| io.device(info))
            .collect::<Result<_, _>>()?;
        Ok(Connected { io, devices })
    }
}

impl Drop for Volume {
    fn drop(&mut self) {
        // Ends a hold (and its watchdog thread) with the volume; no
        // mutation can be waiting, as each borrows the volume.
        self.gate.close();
    }
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
        let g = Volume::geometry(self);
        if g.width > 1 {
            u32::try_from(g.stripe_bytes).unwrap_or(0)
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
