//! Copy jobs: the destination side of an extent resync. A stale copy of an
//! extent on this target is refilled, in place, from a healthy copy on
//! another target while hosts keep writing the volume.
//!
//! ```text
//!  control plane            this target                                  source target
//!  PUT  /v1/copies/{id} ──► arm: open dest, SyncGuard in the registry
//!  (hosts switch to Syncing, drain, confirm)
//!  POST …/{id}/start    ──► copier thread:  read chunk ◄───── NVMe/TCP ───── source extent
//!                                           claim ─► write unclaimed parts ─► release
//!  GET  /v1/copies/{id} ◄── progress, done / failed
//!  DELETE /v1/copies/{id} ► stop, disarm
//! ```
//!
//! Why the destination ends equal to the source, block by block:
//!
//! - Arming puts a [`SyncGuard`] over the destination's device range into
//!   the target's [`GuardRegistry`] before the control plane tells any host.
//!   From then on every host Write, Write Zeroes and deallocate that reaches
//!   those device bytes — through any namespace of any subsystem, since the
//!   match is by file identity and device offset, not by namespace — marks
//!   its units in the guard before it is issued to the backend (`queue/park.rs`).
//! - The copier starts only after every host switched to writing the copy
//!   and drained what it issued before: from then on, a block a host has not
//!   marked has no write in flight anywhere, so whatever the copier reads of
//!   it from the source is its latest value, however early it read it.
//! - The source is read without any lock held. Only then does the copier
//!   claim the chunk; the claim returns the parts no host marked since
//!   arming, the copier writes just those and releases. A marked block is
//!   never written by the copier after its mark: either the mark came first
//!   (the claim leaves it out) or the host write arrived during the claim,
//!   and then it is parked by the reactor and issued only after the release,
//!   so it lands after the copier's older bytes. Hosts order their own
//!   writes to a block, so the block ends at its last host write, which the
//!   source has too.
//! - The claim is held across the copier's whole local write (a synchronous
//!   pwrite), so "after the release" means after those bytes are in the
//!   file. Cancelling takes the same per-job gate, so once DELETE returns no
//!   copier write can follow.
//!
//! A destination is a `file:` extent or a grain pool's tree (`thin:`,
//! design thin-snapshots.md T7). A tree's guard is keyed by the tree, not
//! a device range ([`FileId::Tree`]), since its bytes move between grains;
//! into it the copier writes, still inside the claim, only the 4 KiB
//! sectors that differ from what the tree reads there, and deallocates
//! those the source reads as zeroes ([`ThinBackend::converge`]), so holes
//! stay holes, an in-place resync rewrites only what changed, and a tree
//! that started as another (`base_root`, [`ThinBackend::start_as`]) keeps
//! sharing every grain whose data is the same. Those changes are not
//! committed one by one: the final flush commits them.
//!
//! A job is done once every selected region is copied and the destination
//! flushed. Jobs live in memory only: a restarted target forgets them and
//! the control plane, getting 404, fails the job. The guard stays armed
//! after done or failed until DELETE, so host writes keep being recorded
//! until the control plane has taken the result.

use crate::backend::thin::{self, Converged, ThinBackend, ThinError};
use crate::backend::{AlignedBuf, Backend, BackendError, BackendSpec, DeviceExtent, FileId};
use crate::limits;
use crate::sync::{Admit, SyncGuard};
use arc_swap::ArcSwap;
pub use nvpool_api::admin::{CopyRequest, CopySource, CopyState, CopyStatus};
use nvpool_initiator::{ConnectParams, Controller, IoQueue, Op, Request};
use nvpool_rt::lock;
use nvpool_wire::tcp::Digests;
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

// ----- the registry host writes consult -----

/// One armed copy's guard and the device range it covers.
pub struct ActiveCopy {
    pub id: String,
    pub file: FileId,
    /// Device bytes `[base, base + len)` of `file`.
    pub base: u64,
    pub len: u64,
    pub guard: SyncGuard,
}

impl std::fmt::Debug for ActiveCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActiveCopy")
            .field("id", &self.id)
            .field("file", &self.file)
            .field("base", &self.base)
            .field("len", &self.len)
            .finish()
    }
}

impl ActiveCopy {
    fn overlaps(&self, file: FileId, start: u64, end: u64) -> bool {
        self.file == file && start < self.base + self.len && self.base < end
    }
}

/// The armed copy guards. Every host mutation looks here before it is
/// issued; with nothing armed that costs one atomic load.
#[derive(Debug, Default)]
pub struct GuardRegistry {
    /// Entries in `list` (0: skip the list).
    armed: AtomicUsize,
    list: ArcSwap<Vec<Arc<ActiveCopy>>>,
}

impl GuardRegistry {
    /// True when no copy is armed.
    pub fn idle(&self) -> bool {
        self.armed.load(Ordering::Acquire) == 0
    }

    /// Records a host mutation of `ranges` (namespace byte offset, length)
    /// of a namespace at `at` in every guard covering those bytes. False when
    /// a copier holds a claim overlapping them: the caller must not issue
    /// the mutation yet and calls again later (marks are idempotent).
    pub fn host_write(
        &self,
        at: &DeviceExtent,
        ranges: impl IntoIterator<Item = (u64, u64)>,
    ) -> bool {
        if self.idle() {
            return true;
        }
        let list = self.list.load();
        let mut go = true;
        for (off, len) in ranges {
            let start = at.base + off;
            let end = start + len;
            for c in list.iter().filter(|c| c.overlaps(at.file, start, end)) {
                if matches!(c.guard.host_write(start, len), Admit::Wait) {
                    go = false;
                }
            }
        }
        go
    }

    /// The armed guards (a snapshot).
    pub fn snapshot(&self) -> Arc<Vec<Arc<ActiveCopy>>> {
        self.list.load_full()
    }

    // Writers are serialised by the job table's mutex.
    fn insert(&self, c: Arc<ActiveCopy>) {
        let mut v = (*self.list.load_full()).clone();
        v.push(c);
        let n = v.len();
        self.list.store(Arc::new(v));
        self.armed.store(n, Ordering::Release);
    }

    fn remove(&self, c: &Arc<ActiveCopy>) {
        let mut v = (*self.list.load_full()).clone();
        v.retain(|x| !Arc::ptr_eq(x, c));
        let n = v.len();
        self.list.store(Arc::new(v));
        self.armed.store(n, Ordering::Release);
    }
}

/// Why a copy request was refused.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    #[error("{0}")]
    Invalid(String),
    #[error("copy {0} not found")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("limit reached: {0}")]
    Limit(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

// ----- jobs -----

#[derive(Debug)]
struct Progress {
    state: CopyState,
    /// Sorted, distinct region indexes (set at start).
    regions: Vec<u32>,
    bytes_total: u64,
    regions_total: u64,
    started_ms: Option<u64>,
    finished_ms: Option<u64>,
    error: Option<String>,
}

struct Job {
    id: String,
    req: CopyRequest,
    source: SocketAddr,
    dest: Arc<dyn Backend>,
    /// `dest` when it is a grain pool's tree.
    thin: Option<Arc<ThinBackend>>,
    active: Arc<ActiveCopy>,
    armed_ms: u64,
    bytes_copied: AtomicU64,
    regions_done: AtomicU64,
    cancel: AtomicBool,
    /// Held by the copier from claim to release (its local write); whoever
    /// sets `cancel` and then takes it knows no copier write follows.
    gate: Mutex<()>,
    progress: Mutex<Progress>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("id", &self.id)
            .field("dest", &self.req.dest)
            .finish()
    }
}

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Job {
    fn region_count(&self) -> u64 {
        self.dest.size().div_ceil(self.req.region_bytes)
    }

    /// Extent bytes `[start, end)` of region `r`.
    fn region(&self, r: u32) -> (u64, u64) {
        let start = r as u64 * self.req.region_bytes;
        (start, (start + self.req.region_bytes).min(self.dest.size()))
    }

    fn status(&self) -> CopyStatus {
        let p = lock(&self.progress);
        CopyStatus {
            id: self.id.clone(),
            state: p.state,
            dest: self.req.dest.clone(),
            bytes_total: p.bytes_total,
            bytes_copied: self.bytes_copied.load(Ordering::Acquire),
            regions_total: p.regions_total,
            regions_done: self.regions_done.load(Ordering::Acquire),
            armed_ms: self.armed_ms,
            started_ms: p.started_ms,
            finished_ms: p.finished_ms,
            error: p.error.clone(),
            rate_bytes_per_sec: self.req.rate_bytes_per_sec,
        }
    }

    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Acquire)
    }

    /// Stops the job: once this returns, the copier writes nothing more.
    fn stop(&self) {
        self.cancel.store(true, Ordering::Release);
        drop(lock(&self.gate));
    }

    fn finish(&self, outcome: Result<(), Stop>) {
        let mut p = lock(&self.progress);
        if p.state != CopyState::Running {
            return;
        }
        p.finished_ms = Some(wall_ms());
        match outcome {
            Ok(()) => {
                p.state = CopyState::Done;
                tracing::info!(copy = %self.id, bytes = p.bytes_total, "copy done");
            }
            Err(Stop::Cancelled) => {
                p.state = CopyState::Cancelled;
                tracing::info!(copy = %self.id, "copy cancelled");
            }
            Err(Stop::Failed(m)) => {
                tracing::warn!(copy = %self.id, error = %m, "copy failed");
                p.state = CopyState::Failed;
                p.error = Some(m);
            }
        }
    }
}

#[derive(Debug, Default)]
struct Table {
    jobs: BTreeMap<String, Arc<Job>>,
    /// Copier threads alive.
    running: usize,
    /// Started jobs waiting for a copier slot, oldest first.
    waiting: VecDeque<Arc<Job>>,
}

/// The target's copy jobs and the guards host writes consult.
#[derive(Debug, Default)]
pub struct Copies {
    pub guards: GuardRegistry,
    table: Mutex<Table>,
}

fn validate_id(id: &str) -> Result<(), CopyError> {
    let ok = !id.is_empty()
        && id.len() <= limits::COPY_ID_LEN_MAX
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(CopyError::Invalid(format!(
            "copy id {id:?} must be 1 to {} characters of A-Z a-z 0-9 - _ .",
            limits::COPY_ID_LEN_MAX
        )))
    }
}

/// Checks everything about a request that needs no file system; returns
/// the parsed source address.
fn validate_request(req: &CopyRequest) -> Result<SocketAddr, CopyError> {
    let invalid = CopyError::Invalid;
    let spec = BackendSpec::parse(&req.dest).map_err(|e| invalid(format!("dest: {e}")))?;
    match (&spec, req.base_root) {
        (BackendSpec::File { .. }, None) | (BackendSpec::Thin { .. }, None) => {}
        (BackendSpec::File { .. }, Some(_)) => {
            return Err(invalid(
                "base_root is for thin: destinations only (a tree of a grain pool \
                 starts as another tree of it)"
                    .into(),
            ))
        }
        (BackendSpec::Thin { root, .. }, Some(base)) => {
            if base == *root {
                return Err(invalid(format!(
                    "base_root {base} is the destination tree itself"
                )));
            }
            if base >= thin::ROOT_ID_LIMIT {
                return Err(invalid(format!(
                    "base_root {base}: trees are numbered below 2^32"
                )));
            }
        }
        _ => {
            return Err(invalid(format!(
                "dest {:?} is neither a file: extent nor a thin: tree; only those can be \
                 copy destinations (a ram: namespace cannot be named by another spec, so \
                 nothing could share it; a grain pool is a device, one of its trees is \
                 thin:PATH,root=N,size=BYTES)",
                req.dest
            )))
        }
    }
    let addr: SocketAddr = req.source.addr.parse().map_err(|_| {
        invalid(format!(
            "source.addr {:?} is not ADDR:PORT",
            req.source.addr
        ))
    })?;
    crate::config::validate_nqn(&req.source.subsystem_nqn)
        .map_err(|e| invalid(format!("source.subsystem_nqn: {e}")))?;
    crate::config::validate_nqn(&req.source.host_nqn)
        .map_err(|e| invalid(format!("source.host_nqn: {e}")))?;
    if let Some(k) = &req.source.dhchap {
        // The error names the field, never the secret.
        crate::config::policy(k).map_err(|e| invalid(format!("source.dhchap: {e}")))?;
    }
    if req.source.nsid == 0 || req.source.nsid == u32::MAX {
        return Err(invalid(format!(
            "source.nsid {} is not a namespace id",
            req.source.nsid
        )));
    }
    let rb = req.region_bytes;
    if rb == 0 || !rb.is_multiple_of(4096) || rb > limits::COPY_REGION_BYTES_MAX {
        return Err(invalid(format!(
            "region_bytes {rb} must be a multiple of 4096 between 4096 and {}",
            limits::COPY_REGION_BYTES_MAX
        )));
    }
    Ok(addr)
}

impl Copies {
    fn table(&self) -> MutexGuard<'_, Table> {
        lock(&self.table)
    }

    /// Arms a copy job (`PUT /v1/copies/{id}`): opens the destination and
    /// guards its device range. Again with the same request it answers the
    /// job's status; with another, a conflict.
    pub fn arm(&self, id: &str, req: CopyRequest) -> Result<CopyStatus, CopyError> {
        validate_id(id)?;
        if let Some(j) = self.table().jobs.get(id) {
            return same_request(j, &req);
        }
        let source = validate_request(&req)?;
        // Opening may touch a slow disk: not under the table lock.
        let (dest, thin): (Arc<dyn Backend>, _) = match BackendSpec::parse(&req.dest)? {
            BackendSpec::Thin { path, root, size } => {
                let t = Arc::new(thin::open(&path, root, size)?);
                (t.clone(), Some(t))
            }
            spec => (spec.open()?, None),
        };
        let Some(at) = dest.device_extent() else {
            return Err(CopyError::Invalid(format!(
                "dest {:?} has no file behind it",
                req.dest
            )));
        };
        if at.len > limits::COPY_DEST_BYTES_MAX {
            return Err(CopyError::Invalid(format!(
                "dest is {} bytes; a copy job covers at most {}",
                at.len,
                limits::COPY_DEST_BYTES_MAX
            )));
        }
        crate::sync::check_geometry(at.base, at.len, limits::COPY_GUARD_UNIT_BYTES)
            .map_err(|e| CopyError::Invalid(format!("dest cannot be guarded: {e}")))?;
        let mut t = self.table();
        if let Some(j) = t.jobs.get(id) {
            return same_request(j, &req);
        }
        if t.jobs.len() >= limits::COPIES_MAX {
            return Err(CopyError::Limit(format!(
                "at most {} copy jobs at once (delete finished ones)",
                limits::COPIES_MAX
            )));
        }
        let map_bytes = |len: u64| len / limits::COPY_GUARD_UNIT_BYTES / 8;
        let used: u64 = t.jobs.values().map(|j| map_bytes(j.active.len)).sum();
        if used + map_bytes(at.len) > limits::COPY_GUARD_MEMORY_BUDGET_BYTES {
            return Err(CopyError::Limit(format!(
                "the guard maps of the copy jobs would pass {} bytes (delete finished ones)",
                limits::COPY_GUARD_MEMORY_BUDGET_BYTES
            )));
        }
        if let Some(other) = t
            .jobs
            .values()
            .find(|j| j.active.overlaps(at.file, at.base, at.base + at.len))
        {
            return Err(CopyError::Conflict(format!(
                "dest overlaps the destination of copy {}",
                other.id
            )));
        }
        if let (Some(base), Some(t)) = (req.base_root, &thin) {
            // Under the table lock, after every other check: a refused arm
            // leaves the tree as it was, and two arms cannot both start it.
            t.start_as(base)
                .map_err(|e| start_as_error(&req.dest, base, e))?;
        }
        let active = Arc::new(ActiveCopy {
            id: id.to_owned(),
            file: at.file,
            base: at.base,
            len: at.len,
            guard: SyncGuard::new(at.base, at.len, limits::COPY_GUARD_UNIT_BYTES),
        });
        let job = Arc::new(Job {
            id: id.to_owned(),
            source,
            active: active.clone(),
            armed_ms: wall_ms(),
            bytes_copied: AtomicU64::new(0),
            regions_done: AtomicU64::new(0),
            cancel: AtomicBool::new(false),
            gate: Mutex::new(()),
            progress: Mutex::new(Progress {
                state: CopyState::Armed,
                regions: Vec::new(),
                bytes_total: at.len,
                regions_total: at.len.div_ceil(req.region_bytes),
                started_ms: None,
                finished_ms: None,
                error: None,
            }),
            dest,
            thin,
            req,
        });
        self.guards.insert(active);
        t.jobs.insert(id.to_owned(), job.clone());
        tracing::info!(copy = id, dest = %job.req.dest, source = %job.source, "copy armed");
        Ok(job.status())
    }

    /// Starts an armed job (`POST /v1/copies/{id}/start`) on `regions`
    /// (None: all). It runs at once if a copier slot is free, else waits.
    pub fn start(
        self: &Arc<Self>,
        id: &str,
        regions: Option<Vec<u32>>,
    ) -> Result<CopyStatus, CopyError> {
        let job = self
            .table()
            .jobs
            .get(id)
            .cloned()
            .ok_or_else(|| CopyError::NotFound(id.to_owned()))?;
        {
            let mut p = lock(&job.progress);
            if p.state != CopyState::Armed {
                return Err(CopyError::Conflict(format!(
                    "copy {id} is {}: only an armed job can start",
                    p.state.name()
                )));
            }
            let count = job.region_count();
            let mut sel = match regions {
                None => (0..count as u32).collect(),
                Some(v) => v,
            };
            sel.sort_unstable();
            sel.dedup();
            if let Some(bad) = sel.iter().find(|&&r| r as u64 >= count) {
                return Err(CopyError::Invalid(format!(
                    "region {bad} is outside the extent ({count} regions of {} bytes)",
                    job.req.region_bytes
                )));
            }
            p.bytes_total = sel
                .iter()
                .map(|&r| {
                    let (s, e) = job.region(r);
                    e - s
                })
                .sum();
            p.regions_total = sel.len() as u64;
            p.regions = sel;
            p.state = CopyState::Running;
            p.started_ms = Some(wall_ms());
        }
        tracing::info!(copy = id, "copy started");
        let mut t = self.table();
        if t.jobs.get(id).is_some_and(|j| Arc::ptr_eq(j, &job)) {
            t.waiting.push_back(job.clone());
        }
        drop(t);
        self.pump();
        Ok(job.status())
    }

    /// Runs waiting jobs while copier slots are free.
    fn pump(self: &Arc<Self>) {
        let mut t = self.table();
        while t.running < limits::COPIES_RUNNING_MAX {
            let Some(job) = t.waiting.pop_front() else {
                break;
            };
            if job.cancelled() {
                continue;
            }
            t.running += 1;
            let copies = self.clone();
            let j = job.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("copy-{}", job.id))
                .spawn(move || {
                    // A bug in the copier fails its job visibly instead of
                    // leaving it running and its slot taken.
                    let outcome =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| copy(&j)))
                            .unwrap_or_else(|_| {
                                Err(Stop::Failed(
                                    "the copier crashed (a bug; see the log)".into(),
                                ))
                            });
                    j.finish(outcome);
                    copies.table().running -= 1;
                    copies.pump();
                });
            if let Err(e) = spawned {
                t.running -= 1;
                job.finish(Err(Stop::Failed(format!(
                    "cannot start a copier thread: {e}"
                ))));
            }
        }
    }

    pub fn status(&self, id: &str) -> Option<CopyStatus> {
        self.table().jobs.get(id).map(|j| j.status())
    }

    pub fn list(&self) -> Vec<CopyStatus> {
        self.table().jobs.values().map(|j| j.status()).collect()
    }

    /// Units of the job's destination hosts wrote since it was armed.
    pub fn host_written_units(&self, id: &str) -> Option<u64> {
        self.table()
            .jobs
            .get(id)
            .map(|j| j.active.guard.written_units())
    }

    /// Forgets a job (`DELETE /v1/copies/{id}`): stops its copier (no copier
    /// write follows this call) and disarms its guard.
    pub fn delete(&self, id: &str) -> Result<(), CopyError> {
        let job = {
            let mut t = self.table();
            let job = t
                .jobs
                .remove(id)
                .ok_or_else(|| CopyError::NotFound(id.to_owned()))?;
            t.waiting.retain(|j| !Arc::ptr_eq(j, &job));
            job
        };
        job.stop();
        {
            // Serialised with arm through the table lock.
            let _t = self.table();
            self.guards.remove(&job.active);
        }
        job.finish(Err(Stop::Cancelled));
        tracing::info!(copy = id, "copy deleted");
        Ok(())
    }

    /// Shutdown: every copier stops at its next chunk.
    pub fn cancel_all(&self) {
        for j in self.table().jobs.values() {
            j.cancel.store(true, Ordering::Release);
        }
    }
}

/// Why a destination tree could not start as tree `base`.
fn start_as_error(dest: &str, base: u64, e: ThinError) -> CopyError {
    match e {
        ThinError::HoldsData(root) => CopyError::Conflict(format!(
            "dest tree {root} holds data: it can start as base_root {base} only before \
             anything is written to it (release the tree first)"
        )),
        ThinError::NoRoot(_) => CopyError::Invalid(format!(
            "base_root {base}: the destination's pool has no such tree"
        )),
        ThinError::Sealing(tree) => CopyError::Conflict(format!(
            "base_root {base}: a snapshot of tree {tree} is being taken"
        )),
        e => CopyError::Backend(BackendError::Geometry {
            path: dest.to_owned(),
            reason: format!("starting the tree as base_root {base}: {e}"),
        }),
    }
}

fn same_request(j: &Job, req: &CopyRequest) -> Result<CopyStatus, CopyError> {
    if j.req == *req {
        Ok(j.status())
    } else {
        Err(CopyError::Conflict(format!(
            "copy {} exists with another request",
            j.id
        )))
    }
}

// ----- the copier -----

/// Why a copier stopped early.
#[derive(Debug)]
enum Stop {
    Cancelled,
    Failed(String),
}

/// Token bucket on bytes: `rate` bytes per second, at most `burst` saved up.
#[derive(Debug)]
struct TokenBucket {
    rate: u64,
    burst: u64,
    tokens: u64,
    /// Time (ns on the caller's clock) up to which tokens were credited.
    credited_ns: u64,
}

const NS_PER_SEC: u128 = 1_000_000_000;

impl TokenBucket {
    fn new(rate: u64, burst: u64, now_ns: u64) -> TokenBucket {
        TokenBucket {
            rate,
            burst,
            tokens: burst,
            credited_ns: now_ns,
        }
    }

    /// Takes `n` bytes' worth (at most a full bucket). Err: how long until
    /// they are there.
    fn take(&mut self, n: u64, now_ns: u64) -> Result<(), Duration> {
        let n = n.min(self.burst);
        let elapsed = now_ns.saturating_sub(self.credited_ns) as u128;
        let earned = elapsed * self.rate as u128 / NS_PER_SEC;
        if self.tokens as u128 + earned >= self.burst as u128 {
            self.tokens = self.burst;
            self.credited_ns = now_ns;
        } else {
            self.tokens += earned as u64;
            // Keep the fraction of a byte not yet earned for next time.
            self.credited_ns += (earned * NS_PER_SEC / self.rate as u128) as u64;
        }
        if self.tokens >= n {
            self.tokens -= n;
            return Ok(());
        }
        let missing = (n - self.tokens) as u128;
        let wait = (missing * NS_PER_SEC).div_ceil(self.rate as u128);
        Err(Duration::from_nanos(wait.min(u64::MAX as u128) as u64))
    }
}

/// Releases the claim when the local write is over (also on error paths).
struct Claim<'a>(&'a SyncGuard);

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// One chunk: extent bytes `[off, off + len)`, and whether it ends its region.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    off: u64,
    len: u64,
    ends_region: bool,
}

fn chunks(job: &Job, regions: &[u32], chunk: u64) -> VecDeque<Chunk> {
    let mut v = VecDeque::new();
    for &r in regions {
        let (mut off, end) = job.region(r);
        while off < end {
            let len = chunk.min(end - off);
            v.push_back(Chunk {
                off,
                len,
                ends_region: off + len == end,
            });
            off += len;
        }
    }
    v
}

/// A read in flight or done, in chunk order.
#[derive(Debug)]
struct Pending {
    token: u64,
    chunk: Chunk,
    done: Option<(Result<(), nvpool_initiator::IoError>, Vec<u8>)>,
}

fn connect_source(job: &Job) -> Result<(Arc<Controller>, IoQueue, u32), Stop> {
    let s = &job.req.source;
    let mut p = ConnectParams::new(job.source, &s.subsystem_nqn);
    p.hostnqn.clone_from(&s.host_nqn);
    p.hostid = crate::target::derive_uuid(&[0; 16], &s.host_nqn, 0);
    if let Some(k) = &s.dhchap {
        let policy =
            crate::config::policy(k).map_err(|e| Stop::Failed(format!("source.dhchap: {e}")))?;
        p.dhchap = Some(Arc::new(policy.keys));
    }
    // The copy becomes the authoritative data: check it on the wire.
    p.digests = Digests {
        header: true,
        data: true,
    };
    p.io_queues = 1;
    p.queue_depth = limits::COPY_READS_IN_FLIGHT as u16 + 1;
    p.ctrl_loss_timeout = Duration::from_millis(limits::COPY_SOURCE_LOSS_TIMEOUT_MS);
    p.reconnect_delay = Duration::from_millis(limits::COPY_SOURCE_LOSS_TIMEOUT_MS / 10);
    p.connect_timeout = Duration::from_millis(limits::COPY_SOURCE_LOSS_TIMEOUT_MS);
    let fail = |e: nvpool_initiator::Error| {
        Stop::Failed(format!(
            "source {} {} nsid {}: {e}",
            job.source, s.subsystem_nqn, s.nsid
        ))
    };
    let ctrl = Controller::connect(p).map_err(fail)?;
    let info = ctrl.namespace(s.nsid).map_err(fail)?;
    let size = job.dest.size();
    if info.size_bytes() != size {
        return Err(Stop::Failed(format!(
            "source namespace {} is {} bytes, the destination {size}",
            s.nsid,
            info.size_bytes()
        )));
    }
    if !size.is_multiple_of(info.block_size as u64)
        || !job.req.region_bytes.is_multiple_of(info.block_size as u64)
    {
        return Err(Stop::Failed(format!(
            "source block size {} does not divide the extent into whole regions",
            info.block_size
        )));
    }
    let mut q = ctrl.io_queue(1).map_err(fail)?;
    q.set_block_size(info.block_size);
    Ok((ctrl, q, info.block_size))
}

/// Copies the job's regions. Ok: every selected byte is copied and flushed.
fn copy(job: &Job) -> Result<(), Stop> {
    let regions = lock(&job.progress).regions.clone();
    let (_ctrl, mut q, bs) = connect_source(job)?;
    // A tree takes whole 4 KiB sectors; a file extent any source block.
    let unit = match job.thin {
        Some(_) => u64::from(bs).max(u64::from(thin::THIN_BLOCK_BYTES)),
        None => u64::from(bs),
    };
    let chunk_bytes = (limits::COPY_CHUNK_BYTES.min(q.max_transfer()) as u64) / unit * unit;
    if chunk_bytes == 0 {
        return Err(Stop::Failed(format!(
            "source transfers ({} bytes) are smaller than a block",
            q.max_transfer()
        )));
    }
    let mut todo = chunks(job, &regions, chunk_bytes);
    let epoch = Instant::now();
    let now_ns = || epoch.elapsed().as_nanos() as u64;
    let rate = job.req.rate_bytes_per_sec;
    let mut bucket = (rate > 0).then(|| {
        let burst = (rate as u128 * limits::COPY_RATE_BURST_MS as u128 / 1000) as u64;
        TokenBucket::new(rate, burst.max(chunk_bytes), now_ns())
    });
    let mut pending: VecDeque<Pending> = VecDeque::new();
    let mut spare: Vec<Vec<u8>> = Vec::new();
    let mut done = Vec::new();
    let mut out = AlignedBuf::new(chunk_bytes as usize);
    let mut sectors = Converged::default();
    let mut next_token = 0u64;
    let slice = Duration::from_millis(limits::COPY_CANCEL_POLL_MS);
    loop {
        if job.cancelled() {
            return Err(Stop::Cancelled);
        }
        // Issue reads while there is room and the rate allows.
        let mut throttled = None;
        while pending.len() < limits::COPY_READS_IN_FLIGHT {
            let Some(&c) = todo.front() else { break };
            if let Some(b) = bucket.as_mut() {
                if let Err(wait) = b.take(c.len, now_ns()) {
                    throttled = Some(wait);
                    break;
                }
            }
            todo.pop_front();
            let mut buf = spare.pop().unwrap_or_default();
            buf.resize(c.len as usize, 0);
            let req = Request {
                op: Op::Read,
                nsid: job.req.source.nsid,
                lba: c.off / bs as u64,
                blocks: (c.len / bs as u64) as u32,
                fua: false,
                buf,
                shared: None,
                token: next_token,
            };
            if let Err((_, e)) = q.submit(req) {
                return Err(Stop::Failed(format!(
                    "reading the source at {}: {e}",
                    c.off
                )));
            }
            pending.push_back(Pending {
                token: next_token,
                chunk: c,
                done: None,
            });
            next_token += 1;
        }
        if pending.is_empty() {
            match throttled {
                Some(wait) => {
                    std::thread::sleep(wait.min(slice));
                    continue;
                }
                None => break,
            }
        }
        q.poll(&mut done, slice)
            .map_err(|e| Stop::Failed(format!("reading the source: {e}")))?;
        for c in done.drain(..) {
            if let Some(p) = pending.iter_mut().find(|p| p.token == c.token) {
                p.done = Some((c.result, c.buf));
            }
        }
        while pending.front().is_some_and(|p| p.done.is_some()) {
            let Some(Pending {
                chunk,
                done: Some((result, buf)),
                ..
            }) = pending.pop_front()
            else {
                break;
            };
            if let Err(e) = result {
                return Err(Stop::Failed(format!(
                    "reading the source at {}: {e}",
                    chunk.off
                )));
            }
            apply(job, chunk, &buf, &mut out, &mut sectors)?;
            spare.push(buf);
        }
    }
    if job.cancelled() {
        return Err(Stop::Cancelled);
    }
    job.dest
        .flush()
        .map_err(|e| Stop::Failed(format!("flushing the destination: {e}")))?;
    if job.thin.is_some() {
        tracing::info!(
            copy = %job.id,
            same = sectors.same,
            written = sectors.written,
            deallocated = sectors.deallocated,
            "copy into a tree: 4 KiB sectors left, written, deallocated"
        );
    }
    Ok(())
}

/// Writes one chunk read from the source to the parts of the destination no
/// host wrote since arming (into a tree, only the sectors that differ;
/// `sectors` counts what that did).
fn apply(
    job: &Job,
    c: Chunk,
    data: &[u8],
    out: &mut AlignedBuf,
    sectors: &mut Converged,
) -> Result<(), Stop> {
    let a = &job.active;
    if job.thin.is_none() {
        // O_DIRECT wants an aligned buffer; parts start on guard units.
        out.as_mut_slice(data.len()).copy_from_slice(data);
    }
    let _gate = lock(&job.gate);
    if job.cancelled() {
        return Err(Stop::Cancelled);
    }
    let dev_off = a.base + c.off;
    let parts = a.guard.claim(dev_off, c.len);
    let _claim = Claim(&a.guard);
    for (off, len) in parts {
        debug_assert!(off >= dev_off && off + len <= dev_off + c.len);
        let rel = (off - dev_off) as usize;
        let failed = |e: std::io::Error| {
            Stop::Failed(format!(
                "writing the destination at extent offset {}: {e}",
                off - a.base
            ))
        };
        match &job.thin {
            Some(t) => {
                let bytes = &data[rel..rel + len as usize];
                *sectors += t.converge(off - a.base, bytes).map_err(failed)?;
            }
            None => {
                let bytes = &out.as_slice(rel + len as usize)[rel..];
                job.dest
                    .write_at(bytes, off - a.base, false)
                    .map_err(failed)?;
            }
        }
    }
    job.bytes_copied.fetch_add(c.len, Ordering::AcqRel);
    if c.ends_region {
        job.regions_done.fetch_add(1, Ordering::AcqRel);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn bucket_spends_at_the_rate() {
        // 1 MiB/s, a 128 KiB bucket: the first chunk is free, the next one
        // waits 125 ms.
        let mut b = TokenBucket::new(1 << 20, 128 << 10, 0);
        assert!(b.take(128 << 10, 0).is_ok());
        let wait = b.take(128 << 10, 0).unwrap_err();
        assert_eq!(wait, Duration::from_millis(125));
        assert!(b.take(128 << 10, 124 * MS).is_err());
        assert!(b.take(128 << 10, 125 * MS).is_ok());
        // Over 10 simulated seconds of asking every millisecond, what is
        // taken is the rate times the time plus at most one bucket.
        let mut b = TokenBucket::new(3 << 20, 128 << 10, 0);
        let mut taken = 0u64;
        for t in 0..10_000u64 {
            while b.take(4096, t * MS).is_ok() {
                taken += 4096;
            }
        }
        let most = (3u64 << 20) * 10 + (128 << 10);
        assert!(taken <= most, "{taken} > {most}");
        assert!(taken >= (3u64 << 20) * 10 - (128 << 10), "{taken}");
    }

    #[test]
    fn bucket_does_not_save_beyond_its_size() {
        let mut b = TokenBucket::new(1000, 4000, 0);
        assert!(b.take(4000, 0).is_ok());
        // An hour idle still buys one bucket only.
        let hour = 3_600_000 * MS;
        assert!(b.take(4000, hour).is_ok());
        assert!(b.take(1, hour).is_err());
    }

    fn request(dest: &str) -> CopyRequest {
        CopyRequest {
            dest: dest.to_owned(),
            source: CopySource {
                addr: "127.0.0.1:4420".into(),
                subsystem_nqn: "nqn.2026-11.io.nvpool:src".into(),
                nsid: 1,
                host_nqn: "nqn.2026-11.io.nvpool:copier:t1".into(),
                dhchap: None,
            },
            region_bytes: 1 << 20,
            rate_bytes_per_sec: 0,
            base_root: None,
        }
    }

    #[test]
    fn requests_are_checked() {
        assert!(validate_request(&request("file:/x,offset=4096,length=8192")).is_ok());
        let bad = |f: &dyn Fn(&mut CopyRequest)| {
            let mut r = request("file:/x");
            f(&mut r);
            validate_request(&r).unwrap_err().to_string()
        };
        assert!(bad(&|r| r.dest = "ram:16M".into()).contains("ram:"));
        assert!(bad(&|r| r.dest = "disk:/x".into()).contains("dest"));
        // A grain pool's tree, alone or starting as another tree.
        assert!(validate_request(&request("thin:/p,root=3,size=1M")).is_ok());
        let mut based = request("thin:/p,root=3,size=1M");
        based.base_root = Some(2);
        assert!(validate_request(&based).is_ok());
        // The pool itself is a device, not a destination.
        assert!(bad(&|r| r.dest = "thin:/p".into()).contains("thin:PATH,root=N"));
        // base_root only with a tree, never the tree itself.
        assert!(bad(&|r| r.base_root = Some(1)).contains("base_root"));
        let e = bad(&|r| {
            r.dest = "thin:/p,root=3,size=1M".into();
            r.base_root = Some(3);
        });
        assert!(e.contains("itself"), "{e}");
        let e = bad(&|r| {
            r.dest = "thin:/p,root=3,size=1M".into();
            r.base_root = Some(1 << 32);
        });
        assert!(e.contains("2^32"), "{e}");
        assert!(bad(&|r| r.source.addr = "localhost".into()).contains("ADDR:PORT"));
        assert!(bad(&|r| r.source.host_nqn = "host".into()).contains("host_nqn"));
        assert!(bad(&|r| r.source.nsid = 0).contains("nsid"));
        let e = bad(&|r| {
            r.source.dhchap = Some(crate::config::DhchapKeys {
                dhchap_key: crate::config::SecretText::new("DHHC-1:00:not-base64-secret:".into()),
                dhchap_ctrl_key: None,
                dhchap_hash: None,
                dhchap_dhgroup: None,
                key_id: None,
            })
        });
        assert!(
            e.contains("source.dhchap") && !e.contains("not-base64"),
            "{e}"
        );
        assert!(bad(&|r| r.region_bytes = 0).contains("region_bytes"));
        assert!(bad(&|r| r.region_bytes = 1000).contains("region_bytes"));
        assert!(validate_id("0f8e-aa_1.b").is_ok());
        assert!(validate_id("").is_err());
        assert!(validate_id("a/b").is_err());
        assert!(validate_id(&"x".repeat(limits::COPY_ID_LEN_MAX + 1)).is_err());
    }

    #[test]
    fn arming_stops_at_the_guard_memory_budget() {
        // A sparse file holding as many of the largest extents as the
        // budget allows, and one more.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("big.img");
        let max = limits::COPY_DEST_BYTES_MAX;
        let fit =
            limits::COPY_GUARD_MEMORY_BUDGET_BYTES / (max / limits::COPY_GUARD_UNIT_BYTES / 8);
        std::fs::File::create(&p)
            .and_then(|f| f.set_len((fit + 1) * max))
            .unwrap();
        let copies = Copies::default();
        let spec = |i: u64| format!("file:{},offset={},length={max}", p.display(), i * max);
        for i in 0..fit {
            copies.arm(&format!("j{i}"), request(&spec(i))).unwrap();
        }
        let e = copies.arm("one-more", request(&spec(fit))).unwrap_err();
        assert!(matches!(e, CopyError::Limit(_)), "{e}");
        // Too large for one job at all.
        let huge = format!("file:{},offset=0,length={}", p.display(), 2 * max);
        assert!(matches!(
            copies.arm("huge", request(&huge)),
            Err(CopyError::Invalid(_))
        ));
        // Deleting one makes room.
        copies.delete("j0").unwrap();
        copies.arm("one-more", request(&spec(fit))).unwrap();
    }

    /// A tree is guarded as a whole and alone: host writes through its
    /// namespaces are recorded, a neighbouring tree's and a `file:` range
    /// of the pool's own file are not.
    #[test]
    fn a_trees_guard_is_the_tree() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pool.img");
        std::fs::File::create(&p)
            .and_then(|f| f.set_len(16 << 20))
            .unwrap();
        let path = p.to_str().unwrap();
        thin::format(path, 64 << 10).unwrap();
        let tree = |root: u64| format!("thin:{path},root={root},size=4194304");
        let copies = Copies::default();
        let st = copies.arm("t", request(&tree(5))).unwrap();
        assert_eq!(st.bytes_total, 4 << 20);
        let ns = |spec: &str| {
            BackendSpec::parse(spec)
                .unwrap()
                .open()
                .unwrap()
                .device_extent()
                .unwrap()
        };
        let same = ns(&tree(5));
        assert!(copies.guards.host_write(&same, [(8192, 4096)]));
        assert_eq!(copies.host_written_units("t"), Some(8));
        let other = ns(&tree(6));
        assert_ne!(other.file, same.file);
        assert!(copies.guards.host_write(&other, [(0, 1 << 20)]));
        let raw = ns(&format!("file:{path},offset=0,length=4194304"));
        assert!(copies.guards.host_write(&raw, [(0, 1 << 20)]));
        assert_eq!(copies.host_written_units("t"), Some(8));
        // Another job into the same tree overlaps; into another tree not.
        let mut again = request(&tree(5));
        again.rate_bytes_per_sec = 1;
        assert!(matches!(
            copies.arm("t2", again),
            Err(CopyError::Conflict(_))
        ));
        copies.arm("t3", request(&tree(6))).unwrap();
    }

    /// `base_root`: a tree with nothing written starts as the base (and
    /// again, as a retry); one holding data is 409; an unknown base 400.
    #[test]
    fn base_root_starts_an_empty_tree_only() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pool.img");
        std::fs::File::create(&p)
            .and_then(|f| f.set_len(16 << 20))
            .unwrap();
        let path = p.to_str().unwrap();
        thin::format(path, 64 << 10).unwrap();
        let tree = |root: u64| format!("thin:{path},root={root},size=1048576");
        let base = thin::open(path, 1, 1 << 20).unwrap();
        let data = vec![7u8; 8192];
        base.write_at(&data, 65536, false).unwrap();
        let based = |root: u64, b: u64| {
            let mut r = request(&tree(root));
            r.base_root = Some(b);
            r
        };
        let copies = Copies::default();
        copies.arm("x", based(2, 1)).unwrap();
        let x = thin::open(path, 2, 1 << 20).unwrap();
        let mut got = vec![0u8; 8192];
        x.read_at(&mut got, 65536).unwrap();
        assert_eq!(got, data);
        // Shared, not copied: still the one grain.
        assert_eq!(base.pool().stats().grains_allocated, 1);
        // The same request: the same job, nothing done twice.
        assert!(copies.arm("x", based(2, 1)).is_ok());
        // Deleted and armed again while it still shares the base: a retry.
        copies.delete("x").unwrap();
        copies.arm("x", based(2, 1)).unwrap();
        copies.delete("x").unwrap();
        // Once the tree holds data of its own: refused, and unchanged.
        let three = thin::open(path, 3, 1 << 20).unwrap();
        three.write_at(&[1u8; 4096], 0, false).unwrap();
        let e = copies.arm("y", based(3, 1)).unwrap_err();
        assert!(matches!(e, CopyError::Conflict(_)), "{e}");
        let mut first = vec![0u8; 4096];
        three.read_at(&mut first, 0).unwrap();
        assert_eq!(first, vec![1u8; 4096]);
        // Written and deallocated again: nothing written, it may start.
        three.discard(0, 4096).unwrap();
        copies.arm("y", based(3, 1)).unwrap();
        let e = copies.arm("z", based(4, 99)).unwrap_err();
        assert!(matches!(e, CopyError::Invalid(_)), "{e}");
        assert!(e.to_string().contains("base_root 99"), "{e}");
    }

    #[test]
    fn arm_registers_the_guard_and_delete_removes_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.img");
        std::fs::write(&p, vec![0u8; 1 << 20]).unwrap();
        let spec = format!("file:{},offset=65536,length=262144", p.display());
        let copies = Arc::new(Copies::default());
        assert!(copies.guards.idle());
        let st = copies.arm("j1", request(&spec)).unwrap();
        assert_eq!(st.state, CopyState::Armed);
        assert_eq!(st.bytes_total, 262144);
        assert_eq!(st.regions_total, 1);
        assert!(!copies.guards.idle());
        // Same request: the same job; another request: a conflict.
        assert_eq!(copies.arm("j1", request(&spec)).unwrap().id, "j1");
        let mut other = request(&spec);
        other.rate_bytes_per_sec = 5;
        assert!(matches!(
            copies.arm("j1", other),
            Err(CopyError::Conflict(_))
        ));
        // Another job over an overlapping range of the same file, reached
        // through another path: a conflict.
        let alias = format!(
            "file:{}/../{}/d.img,offset=0,length=131072",
            dir.path().display(),
            dir.path().file_name().unwrap().to_str().unwrap()
        );
        assert!(matches!(
            copies.arm("j2", request(&alias)),
            Err(CopyError::Conflict(_))
        ));
        // A host write through a namespace of the same file (a second open),
        // at namespace offset 4096 of a namespace starting at 65536, is
        // recorded in the guard.
        let ns = BackendSpec::parse(&format!("file:{},offset=65536", p.display()))
            .unwrap()
            .open()
            .unwrap();
        let at = ns.device_extent().unwrap();
        assert!(copies.guards.host_write(&at, [(4096, 4096)]));
        assert_eq!(copies.host_written_units("j1"), Some(8));
        // Outside the guarded range: nothing recorded.
        assert!(copies.guards.host_write(&at, [(262144, 4096)]));
        assert_eq!(copies.host_written_units("j1"), Some(8));
        copies.delete("j1").unwrap();
        assert!(copies.guards.idle());
        assert!(matches!(copies.delete("j1"), Err(CopyError::NotFound(_))));
        assert!(matches!(
            copies.start("j1", None),
            Err(CopyError::NotFound(_))
        ));
    }
}
