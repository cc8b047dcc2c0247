//! `ThinBackend` (D6, design T2–T4): a namespace served from one tree of a
//! grain pool, so everything that works per namespace (subsystems, exports,
//! ANA, the reactor's queues) works for a thin one unchanged.
//!
//! One pool per device file, shared by every namespace whose spec names it
//! (`thin:PATH,root=N,size=BYTES`): [`open`] finds the pool already open on
//! that file, whatever path named it, or opens it. One thread per pool runs
//! its operations in order: the pool is single-threaded by design (its
//! transaction is one in-memory state), and a reactor never blocks on it.
//!
//! Durability follows NVMe's volatile write cache, which the controller
//! reports, with one addition a thin pool needs: a write, write zeroes or
//! deallocate completes only once a crash of this *process* cannot undo
//! it. Its data bytes are in the device's page cache, which a SIGKILL
//! keeps; its map change is in the pool's memory until a commit. So one
//! that left every tree mapping its grains as the last commit does (an
//! overwrite in place) completes at once, and one that changed a mapping
//! (a new grain, the copy of a grain a snapshot shares, a deallocate)
//! completes after the commit of its batch. Without this, a target killed
//! and restarted under a host that rides the restart out (it reissues only
//! what was in flight) answers the host's next Flush with success while
//! writes it had completed are gone, and the copies of a mirror differ
//! (`tests/thin_restart.rs`). A Flush, or an FUA write, commits the
//! transaction before it completes (one commit for every command of a
//! batch that waits for one), and so does an idle tick every
//! [`THIN_COMMIT_INTERVAL_MS`](crate::limits::THIN_COMMIT_INTERVAL_MS).
//! A pool with no free grain fails the write with ENOSPC, which the queue
//! answers with Capacity Exceeded (T4), and nothing written before changes.
//!
//! A pool offered as a device (`--device ID=thin:PATH`, T1) is opened by
//! [`ThinPool::open_device`] at start and held for the daemon's lifetime,
//! so the namespaces the control plane adds find it here, and its usage
//! and [`ThinPool::release`] need no open. The pool counts which trees
//! namespaces have open, so a tree is never released under one.
//!
//! Snapshots (design T5): a Write, Write Zeroes or deallocate comes with the
//! write epoch of its command ([`Backend::submit_tagged`]), and the pool's
//! thread routes it ([`Pool::route`]) and applies it to every tree named
//! under one hold of the pool's lock, so a snapshot is taken either before
//! or after the whole write; a grain the trees mapped alike is shared after
//! it ([`Pool::write_trees`]). A write refused for its epoch fails with
//! EBADE, Reservation Conflict to the host; the floor it is refused below
//! is in the pool's metadata, so that holds across a restart too.
//! Nothing here keeps a tree's top page between commands, so a rollback
//! ([`ThinPool::rollback`]) is seen by the next command of a namespace
//! serving the live tree.

use super::{Device, Pool, PoolStats, ThinError, GRAIN_INDEX_LIMIT, SECTOR_BYTES};
use crate::backend::{
    AsyncDone, AsyncOp, AsyncResult, Backend, BackendError, DeviceExtent, FileId,
};
use crate::limits::{THIN_COMMIT_INTERVAL_MS, THIN_QUEUE_LEN};
use crate::peerlog::peer_warn;
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Thin namespaces serve whole 4 KiB sectors: the written mask's unit.
pub const THIN_BLOCK_BYTES: u32 = 4096;

/// How much of a device must read as zeroes before a pool is formatted on
/// it: partition tables, filesystem and LVM labels all sit in its first MiB.
const BLANK_CHECK_BYTES: u64 = 1 << 20;

/// A pool's device: a file or block device, through the page cache (a
/// commit's fdatasync makes it durable).
#[derive(Debug)]
pub struct FileDevice {
    file: File,
    size: u64,
}

impl FileDevice {
    pub fn open(path: &str) -> io::Result<FileDevice> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        // A block device's length is its size; seeking to the end reads it
        // for both kinds.
        let size = io::Seek::seek(&mut &file, io::SeekFrom::End(0))?;
        Ok(FileDevice { file, size })
    }
}

impl Device for FileDevice {
    fn size(&self) -> u64 {
        self.size
    }
    fn read_at(&mut self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, off)
    }
    fn write_at(&mut self, buf: &[u8], off: u64) -> io::Result<()> {
        self.file.write_all_at(buf, off)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }
}

/// Formats the file or device at `path` as an empty grain pool. Refuses a
/// device that already holds one, or that a namespace has open.
pub fn format(path: &str, grain_bytes: u64) -> Result<PoolStats, BackendError> {
    let failed = |reason: String| BackendError::Geometry {
        path: path.to_owned(),
        reason,
    };
    let opened = |source| BackendError::Open {
        path: path.to_owned(),
        source,
    };
    let open = pools();
    let id = file_id(path).map_err(opened)?;
    if open.iter().any(|(f, p)| *f == id && p.strong_count() > 0) {
        return Err(failed("a grain pool on it is in use".into()));
    }
    let dev = FileDevice::open(path).map_err(opened)?;
    match Pool::open(dev) {
        Ok(_) => return Err(failed("it already holds a grain pool".into())),
        Err(ThinError::NoSuperblock) => {}
        Err(e) => return Err(failed(e.to_string())),
    }
    let dev = FileDevice::open(path).map_err(opened)?;
    let pool = Pool::format(dev, grain_bytes, None).map_err(|e| failed(e.to_string()))?;
    drop(open);
    Ok(pool.stats())
}

/// Opens tree `root` of the pool on `path` as a namespace of `size` bytes,
/// creating the (empty) tree the first time: the spec names its tree, so a
/// restart finds the same one.
pub fn open(path: &str, root: u64, size: u64) -> Result<ThinBackend, BackendError> {
    let failed = |reason: String| BackendError::Geometry {
        path: path.to_owned(),
        reason,
    };
    if size == 0 || !size.is_multiple_of(u64::from(THIN_BLOCK_BYTES)) {
        return Err(failed(format!(
            "a thin namespace's size is a positive multiple of {THIN_BLOCK_BYTES}"
        )));
    }
    let (pool, _) = ThinPool::open(path, None)?;
    {
        let mut p = pool.lock();
        let limit = GRAIN_INDEX_LIMIT * p.layout().grain_bytes;
        if size > limit {
            return Err(failed(format!(
                "{size} bytes is more than a tree maps ({limit})"
            )));
        }
        if p.ensure_root(root).map_err(|e| failed(e.to_string()))? {
            p.commit().map_err(|e| failed(e.to_string()))?;
        }
        // Under the pool's lock, as release checks it.
        *locked(&pool.open_roots).entry(root).or_default() += 1;
    }
    Ok(ThinBackend {
        pool,
        root,
        size,
        path: path.to_owned(),
    })
}

/// The grain pools open in this process, by device.
fn pools() -> MutexGuard<'static, Vec<(FileId, Weak<ThinPool>)>> {
    static POOLS: Mutex<Vec<(FileId, Weak<ThinPool>)>> = Mutex::new(Vec::new());
    locked(&POOLS)
}

fn file_id(path: &str) -> io::Result<FileId> {
    Ok(FileId::of(&std::fs::metadata(path)?))
}

/// One operation for the pool's thread.
struct Job {
    root: u64,
    /// The command's write epoch (0: untagged).
    tag: u32,
    op: AsyncOp,
    done: AsyncDone,
}

/// An open grain pool and its thread.
pub struct ThinPool {
    pool: Arc<Mutex<Pool<FileDevice>>>,
    /// None once dropped: the thread then commits and ends.
    jobs: Option<SyncSender<Job>>,
    thread: Option<JoinHandle<()>>,
    /// A write or commit failed: the pool's durable state is unknown. Read
    /// without the pool's lock, which its thread holds across device I/O.
    failed: Arc<AtomicBool>,
    /// Namespaces open per tree. Counted up under the pool's lock, where
    /// [`ThinPool::release`] reads it.
    open_roots: Mutex<HashMap<u64, usize>>,
    /// As the pool was first opened, for errors.
    path: String,
    /// The device file's identity: its trees' guard identities are made
    /// of it ([`FileId::tree`]).
    file: FileId,
}

impl std::fmt::Debug for ThinPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThinPool").finish_non_exhaustive()
    }
}

impl ThinPool {
    /// The grain size a blank device is formatted with by default.
    pub const GRAIN_BYTES_DEFAULT: u64 = 64 << 10;

    /// The grain pool offered as the device `path` (`thin:PATH[,grain=…]`),
    /// and whether it was formatted just now: a device without a pool is
    /// formatted with `grain_bytes` (default [`Self::GRAIN_BYTES_DEFAULT`])
    /// only when its first MiB reads as zeroes, since nvpool never formats
    /// over data. A `grain_bytes` an existing pool does not have is refused.
    pub fn open_device(
        path: &str,
        grain_bytes: Option<u64>,
    ) -> Result<(Arc<ThinPool>, bool), BackendError> {
        let grain = grain_bytes.unwrap_or(Self::GRAIN_BYTES_DEFAULT);
        let (pool, formatted) = ThinPool::open(path, Some(grain))?;
        let has = pool.grain_bytes();
        if grain_bytes.is_some_and(|g| g != has) {
            return Err(BackendError::Geometry {
                path: path.to_owned(),
                reason: format!(
                    "grain={}K, but its grain pool was formatted with {}K grains",
                    grain >> 10,
                    has >> 10
                ),
            });
        }
        Ok((pool, formatted))
    }

    /// The pool on `path`, open already or opened now; a device without
    /// one is formatted with `format`'s grain size when blank, else refused.
    fn open(path: &str, format: Option<u64>) -> Result<(Arc<ThinPool>, bool), BackendError> {
        let opened = |source| BackendError::Open {
            path: path.to_owned(),
            source,
        };
        let failed = |reason: String| BackendError::Geometry {
            path: path.to_owned(),
            reason,
        };
        let mut open = pools();
        open.retain(|(_, p)| p.strong_count() > 0);
        let id = file_id(path).map_err(opened)?;
        if let Some(p) = open
            .iter()
            .find(|(f, _)| *f == id)
            .and_then(|(_, p)| p.upgrade())
        {
            return Ok((p, false));
        }
        let dev = FileDevice::open(path).map_err(opened)?;
        let (pool, formatted) = match (Pool::open(dev), format) {
            (Ok(pool), _) => (pool, false),
            (Err(ThinError::NoSuperblock), None) => {
                return Err(failed("not a grain pool (format it first)".into()))
            }
            (Err(ThinError::NoSuperblock), Some(grain)) => {
                let mut dev = FileDevice::open(path).map_err(opened)?;
                if !blank(&mut dev).map_err(opened)? {
                    return Err(failed(
                        "not a grain pool, and not blank (its first MiB holds data): \
                         nvpool will not format over data"
                            .into(),
                    ));
                }
                let pool = Pool::format(dev, grain, None).map_err(|e| failed(e.to_string()))?;
                (pool, true)
            }
            (Err(e), _) => return Err(failed(e.to_string())),
        };
        let pool = Arc::new(Mutex::new(pool));
        let failed = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::sync_channel(THIN_QUEUE_LEN);
        let thread = std::thread::Builder::new()
            .name("thin-pool".into())
            .spawn({
                let (pool, failed) = (pool.clone(), failed.clone());
                move || run(&pool, &rx, &failed)
            })
            .map_err(opened)?;
        let p = Arc::new(ThinPool {
            pool,
            jobs: Some(tx),
            thread: Some(thread),
            failed,
            open_roots: Mutex::new(HashMap::new()),
            path: path.to_owned(),
            file: id,
        });
        open.push((id, Arc::downgrade(&p)));
        Ok((p, formatted))
    }

    fn lock(&self) -> MutexGuard<'_, Pool<FileDevice>> {
        locked(&self.pool)
    }

    pub fn stats(&self) -> PoolStats {
        self.lock().stats()
    }

    pub fn grain_bytes(&self) -> u64 {
        self.lock().layout().grain_bytes
    }

    /// What the device offers: its data grains.
    pub fn capacity_bytes(&self) -> u64 {
        let layout = self.lock().layout();
        layout.data_grains * layout.grain_bytes
    }

    /// Bytes of the grains some tree holds.
    pub fn used_bytes(&self) -> u64 {
        let p = self.lock();
        p.grains_allocated() * p.layout().grain_bytes
    }

    /// Drops the trees `roots` of extents the control plane freed (T1),
    /// and commits, so their grains are free again; answers the trees that
    /// existed. A tree that does not exist is released already. When a
    /// namespace has one of them open, nothing is dropped: the caller
    /// removes the namespace first.
    pub fn release(&self, roots: &[u64]) -> Result<Vec<u64>, BackendError> {
        let failed = |e: ThinError| BackendError::Geometry {
            path: self.path.clone(),
            reason: e.to_string(),
        };
        let mut p = self.lock();
        if let Some(&root) = roots
            .iter()
            .find(|r| locked(&self.open_roots).contains_key(r))
        {
            return Err(BackendError::RootInUse {
                path: self.path.clone(),
                root,
            });
        }
        let existing: BTreeSet<u64> = p.roots().into_iter().collect();
        let mut dropped = Vec::new();
        for &root in roots {
            if existing.contains(&root) && !dropped.contains(&root) {
                let mut r = p.delete_root(root);
                // A delete copies its table path; when the metadata area is
                // full and the reserve spent, the pages freed so far come
                // back at a commit, as on the write path.
                if matches!(r, Err(ThinError::NoSpace)) && p.dirty() {
                    r = p.commit().and_then(|()| p.delete_root(root));
                }
                self.failed.fetch_or(p.failed(), Ordering::Relaxed);
                r.map_err(failed)?;
                dropped.push(root);
            }
        }
        if !dropped.is_empty() {
            let r = p.commit();
            self.failed.fetch_or(p.failed(), Ordering::Relaxed);
            r.map_err(failed)?;
        }
        Ok(dropped)
    }

    /// Creates the snapshot trees `(live, snapshot)` at `epoch` and commits
    /// (`POST /v1/devices/{id}/snapshots`): see [`Pool::begin_snapshots`].
    pub fn snapshot_trees(&self, epoch: u32, trees: &[(u64, u64)]) -> Result<(), ThinError> {
        self.changed(|p| p.begin_snapshots(epoch, trees))
    }

    /// Seals `snapshots` and commits, so the writes they took and the live
    /// trees' new floors are durable (`POST /v1/devices/{id}/seal`): see
    /// [`Pool::seal`].
    pub fn seal(&self, snapshots: &[u64]) -> Result<(), ThinError> {
        self.changed(|p| p.seal(snapshots))
    }

    /// Rolls live trees back to snapshots and commits (`POST
    /// /v1/devices/{id}/rollback`): see [`Pool::rollback`]. A namespace
    /// serving a live tree reads the snapshot's contents from the next
    /// command on: every command looks its tree up in the root table.
    pub fn rollback(&self, trees: &[(u64, u64)]) -> Result<(), ThinError> {
        self.changed(|p| p.rollback(trees))
    }

    /// Runs `change` and commits. As on the write path, what was freed since
    /// the last commit is reusable after the next one: without room, commit
    /// and try once more.
    fn changed(
        &self,
        change: impl Fn(&mut Pool<FileDevice>) -> Result<(), ThinError>,
    ) -> Result<(), ThinError> {
        let mut p = self.lock();
        let mut r = change(&mut p);
        if matches!(r, Err(ThinError::NoSpace)) && p.dirty() {
            r = p.commit().and_then(|()| change(&mut p));
        }
        let r = r.and_then(|()| p.commit());
        self.failed.fetch_or(p.failed(), Ordering::Relaxed);
        r
    }
}

/// Whether the device's first MiB (all of it, when smaller) reads as zeroes.
fn blank(dev: &mut FileDevice) -> io::Result<bool> {
    let mut buf = vec![0u8; BLANK_CHECK_BYTES.min(dev.size()) as usize];
    dev.read_at(&mut buf, 0)?;
    Ok(buf.iter().all(|&b| b == 0))
}

impl Drop for ThinPool {
    fn drop(&mut self) {
        // The thread commits what is left once the queue closes; wait for
        // it, so that opening the device again never races that commit.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The pool's thread: runs operations in arrival order. The flushes, FUA
/// writes and changes of a mapping of a batch share one commit, which they
/// complete after; overwrites in place complete at once and are committed
/// at the latest one tick after the last commit.
fn run(pool: &Mutex<Pool<FileDevice>>, jobs: &Receiver<Job>, failed: &AtomicBool) {
    let tick = Duration::from_millis(THIN_COMMIT_INTERVAL_MS);
    let lock = || locked(pool);
    let mut batch: Vec<Job> = Vec::new();
    let mut waiting: Vec<AsyncDone> = Vec::new();
    let mut committed = Instant::now();
    loop {
        let next = if lock().dirty() {
            jobs.recv_timeout(tick.saturating_sub(committed.elapsed()))
        } else {
            jobs.recv().map_err(|_| RecvTimeoutError::Disconnected)
        };
        match next {
            Ok(j) => batch.push(j),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                if let Err(e) = lock().commit() {
                    tracing::error!("grain pool: the last commit failed: {e}");
                }
                return;
            }
        }
        batch.extend(jobs.try_iter().take(THIN_QUEUE_LEN));
        let mut p = lock();
        for Job {
            root,
            tag,
            op,
            done,
        } in batch.drain(..)
        {
            let commit = matches!(op, AsyncOp::Flush | AsyncOp::Write { fua: true, .. });
            match apply(&mut p, root, tag, op) {
                Ok((_, remapped)) if commit || remapped => waiting.push(done),
                r => done.complete(r.map(|(data, _)| data)),
            }
        }
        if waiting.is_empty() && !(p.dirty() && committed.elapsed() >= tick) {
            failed.fetch_or(p.failed(), Ordering::Relaxed);
            continue;
        }
        let r = p.commit().map_err(io_error);
        failed.fetch_or(p.failed(), Ordering::Relaxed);
        drop(p);
        committed = Instant::now();
        if let Err(e) = &r {
            tracing::error!("grain pool: commit failed: {e}");
        }
        for done in waiting.drain(..) {
            done.complete(match &r {
                Ok(()) => Ok(None),
                Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
            });
        }
    }
}

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `op` on tree `root`; a change goes to every tree its write epoch
/// `tag` routes it to. Answers what a read read, and whether the op changed
/// a mapping the last commit holds ([`remapped`]): then a process crash
/// before the next commit would undo it, so it must not complete before
/// that commit.
fn apply(
    p: &mut Pool<FileDevice>,
    root: u64,
    tag: u32,
    op: AsyncOp,
) -> io::Result<(Option<Vec<u8>>, bool)> {
    let trees = |p: &Pool<FileDevice>| {
        p.route(root, tag).map_err(|e| {
            peer_warn!(tree = root, error = %e, "a write from a fenced writer refused");
            io_error(e)
        })
    };
    match op {
        AsyncOp::Read { off, len } => {
            let mut buf = vec![0u8; len];
            p.read(root, off, &mut buf).map_err(io_error)?;
            Ok((Some(buf), false))
        }
        AsyncOp::Write { off, data, .. } => {
            let trees = trees(p)?;
            write_trees(p, &trees, off, &data)?;
            Ok((None, remapped(p, &trees, &[(off, data.len() as u64)])?))
        }
        AsyncOp::Flush => Ok((None, false)),
        AsyncOp::WriteZeroes { off, len } => {
            let trees = trees(p)?;
            p.deallocate_trees(&trees, off, len).map_err(io_error)?;
            Ok((None, remapped(p, &trees, &[(off, len)])?))
        }
        AsyncOp::Discard { ranges } => {
            let trees = trees(p)?;
            for &(off, len) in &ranges {
                p.deallocate_trees(&trees, off, len).map_err(io_error)?;
            }
            Ok((None, remapped(p, &trees, &ranges)?))
        }
    }
}

/// [`Pool::write_trees`], committing once when the pool is full with
/// changes pending: grains freed since the last commit are reusable after
/// the next one, so the pool is not called full before it.
fn write_trees(p: &mut Pool<FileDevice>, trees: &[u64], off: u64, data: &[u8]) -> io::Result<()> {
    match p.write_trees(trees, off, data) {
        Err(ThinError::NoSpace) if p.dirty() => {
            p.commit().map_err(io_error)?;
            p.write_trees(trees, off, data).map_err(io_error)
        }
        r => r.map_err(io_error),
    }
}

/// Whether some tree of `trees` maps a grain of the byte `ranges`
/// otherwise than the last commit does (another grain, another written
/// mask, or none). When none does, what was just written went in place
/// into grains the committed trees hold with those sectors written, so it
/// is in the device's page cache, where a process crash leaves it: only a
/// power loss can undo it, as NVMe's volatile write cache allows until a
/// Flush. Otherwise the change lives in the pool's memory until a commit.
fn remapped(p: &mut Pool<FileDevice>, trees: &[u64], ranges: &[(u64, u64)]) -> io::Result<bool> {
    let committed_table = p.committed_table;
    for &root in trees {
        let live = p.top(root).map_err(io_error)?;
        // A tree the last commit does not hold maps nothing durable yet.
        let Some(committed) = p.record(committed_table, root).map_err(io_error)? else {
            return Ok(true);
        };
        for &(off, len) in ranges {
            for (gi, ..) in p.spans(off, len).map_err(io_error)? {
                // Pages of the committed trees are never reused before the
                // next commit, so these reads see what it holds.
                let now = p.lookup(live, gi).map_err(io_error)?.entry;
                if now != p.lookup(committed, gi).map_err(io_error)?.entry {
                    return Ok(true);
                }
            }
        }
    }
    Ok(false)
}

/// The errno the queue turns into a status (queue/io.rs): no space is
/// Capacity Exceeded, a fenced write (EBADE, Linux's errno for a
/// reservation conflict) Reservation Conflict.
fn io_error(e: ThinError) -> io::Error {
    match e {
        ThinError::NoSpace => io::Error::from_raw_os_error(libc::ENOSPC),
        ThinError::Fenced { .. } => io::Error::from_raw_os_error(libc::EBADE),
        ThinError::Io(e) => e,
        e => io::Error::other(e),
    }
}

/// One tree of a grain pool served as a namespace.
#[derive(Debug)]
pub struct ThinBackend {
    pool: Arc<ThinPool>,
    root: u64,
    size: u64,
    path: String,
}

impl Drop for ThinBackend {
    fn drop(&mut self) {
        let mut open = locked(&self.pool.open_roots);
        if let Some(n) = open.get_mut(&self.root) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.root);
            }
        }
    }
}

/// What [`ThinBackend::converge`] did, in 4 KiB sectors.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Converged {
    /// Sectors that read as the data already: left alone.
    pub same: u64,
    /// Sectors written.
    pub written: u64,
    /// Sectors deallocated: the data is zeroes.
    pub deallocated: u64,
}

impl std::ops::AddAssign for Converged {
    fn add_assign(&mut self, o: Converged) {
        self.same += o.same;
        self.written += o.written;
        self.deallocated += o.deallocated;
    }
}

/// What [`ThinBackend::converge`] does to a run of sectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Keep,
    Write,
    Deallocate,
}

impl ThinBackend {
    pub fn pool(&self) -> &Arc<ThinPool> {
        &self.pool
    }

    /// Makes this tree start as tree `base` of the same pool, sharing
    /// everything it maps, and commits (a copy job's `base_root`, design
    /// T7): see [`Pool::start_as`].
    pub(crate) fn start_as(&self, base: u64) -> Result<(), ThinError> {
        self.pool.changed(|p| p.start_as(self.root, base))
    }

    /// Makes tree bytes `[off, off + data.len())` (whole 4 KiB sectors)
    /// read as `data`, changing only what differs: the copier's write into
    /// a tree (copier.rs, design T7). Under one hold of the pool's lock it
    /// reads what the tree holds there and, per sector, leaves one that
    /// reads as `data` already alone (a grain shared with another tree
    /// stays shared, a hole stays a hole), deallocates one whose `data` is
    /// all zeroes, and writes the others, a run of neighbours per call.
    /// Nothing is committed here, unlike [`Backend::write_at`]: the
    /// caller's [`Backend::flush`] commits once at the end, which is enough
    /// for a copy, since one that never gets there leaves its destination
    /// stale anyway.
    pub(crate) fn converge(&self, off: u64, data: &[u8]) -> io::Result<Converged> {
        let sector = SECTOR_BYTES as usize;
        let end = off.checked_add(data.len() as u64);
        if !off.is_multiple_of(SECTOR_BYTES)
            || !data.len().is_multiple_of(sector)
            || end.is_none_or(|e| e > self.size)
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} bytes at {off} are not whole 4 KiB sectors of tree {}",
                    data.len(),
                    self.root
                ),
            ));
        }
        let mut p = self.pool.lock();
        let r = self.converge_locked(&mut p, off, data);
        self.pool.failed.fetch_or(p.failed(), Ordering::Relaxed);
        r
    }

    fn converge_locked(
        &self,
        p: &mut Pool<FileDevice>,
        off: u64,
        data: &[u8],
    ) -> io::Result<Converged> {
        let sector = SECTOR_BYTES as usize;
        let mut held = vec![0u8; data.len()];
        p.read(self.root, off, &mut held).map_err(io_error)?;
        let changes: Vec<Change> = data
            .chunks_exact(sector)
            .zip(held.chunks_exact(sector))
            .map(|(want, has)| {
                if want == has {
                    Change::Keep
                } else if want.iter().all(|&b| b == 0) {
                    Change::Deallocate
                } else {
                    Change::Write
                }
            })
            .collect();
        let mut done = Converged::default();
        let mut first = 0;
        while first < changes.len() {
            let change = changes[first];
            let n = changes[first..]
                .iter()
                .take_while(|&&c| c == change)
                .count();
            let (at, len) = (first * sector, n * sector);
            let tree_off = off + at as u64;
            match change {
                Change::Keep => done.same += n as u64,
                Change::Write => {
                    write_trees(p, &[self.root], tree_off, &data[at..at + len])?;
                    done.written += n as u64;
                }
                Change::Deallocate => {
                    let mut r = p.deallocate(self.root, tree_off, len as u64);
                    if matches!(r, Err(ThinError::NoSpace)) && p.dirty() {
                        r = p
                            .commit()
                            .and_then(|()| p.deallocate(self.root, tree_off, len as u64));
                    }
                    r.map_err(io_error)?;
                    done.deallocated += n as u64;
                }
            }
            first += n;
        }
        Ok(done)
    }

    /// Runs `op` on the calling thread (the synchronous calls: no ring, or
    /// off the reactor), and commits before returning when it changed a
    /// mapping (see [`apply`]).
    fn now(&self, op: AsyncOp) -> AsyncResult {
        let mut p = self.pool.lock();
        let r = apply(&mut p, self.root, 0, op).and_then(|(data, remapped)| {
            if remapped {
                p.commit().map_err(io_error)?;
            }
            Ok(data)
        });
        self.pool.failed.fetch_or(p.failed(), Ordering::Relaxed);
        r
    }
}

impl Backend for ThinBackend {
    fn size(&self) -> u64 {
        self.size
    }
    fn block_size(&self) -> u32 {
        THIN_BLOCK_BYTES
    }
    fn describe(&self) -> String {
        format!("thin {} tree {}", self.path, self.root)
    }
    /// The whole tree, named by the pool's file and the tree id: host
    /// writes through any namespace serving this tree meet the copy guards
    /// of jobs copying into it, and no other tree's.
    fn device_extent(&self) -> Option<DeviceExtent> {
        Some(DeviceExtent {
            file: self.pool.file.tree(self.root)?,
            base: 0,
            len: self.size,
        })
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let data = self
            .now(AsyncOp::Read {
                off,
                len: buf.len(),
            })?
            .unwrap_or_default();
        buf.copy_from_slice(&data);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], off: u64, fua: bool) -> io::Result<()> {
        self.now(AsyncOp::Write {
            off,
            data: buf.to_vec(),
            fua,
        })?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        let mut p = self.pool.lock();
        let r = p.commit().map_err(io_error);
        self.pool.failed.fetch_or(p.failed(), Ordering::Relaxed);
        r
    }
    fn write_zeroes(&self, off: u64, len: u64) -> io::Result<()> {
        self.now(AsyncOp::WriteZeroes { off, len }).map(drop)
    }
    fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        self.now(AsyncOp::Discard {
            ranges: vec![(off, len)],
        })
        .map(drop)
    }
    fn failed(&self) -> bool {
        self.pool.failed.load(Ordering::Relaxed)
    }
    fn mark_failed(&self) {
        self.pool.failed.store(true, Ordering::Relaxed);
    }
    fn is_async(&self) -> bool {
        true
    }
    fn submit(&self, op: AsyncOp, done: AsyncDone) {
        self.submit_tagged(op, 0, done);
    }
    fn submit_tagged(&self, op: AsyncOp, epoch: u32, done: AsyncDone) {
        let Some(jobs) = &self.pool.jobs else {
            done.complete(Err(io::Error::other("the grain pool is closing")));
            return;
        };
        let job = Job {
            root: self.root,
            tag: epoch,
            op,
            done,
        };
        match jobs.try_send(job) {
            Ok(()) => {}
            // The host retries (Namespace Not Ready, queue/io.rs): a reactor
            // never waits for room.
            Err(TrySendError::Full(j)) => j
                .done
                .complete(Err(io::Error::from_raw_os_error(libc::EAGAIN))),
            Err(TrySendError::Disconnected(j)) => j
                .done
                .complete(Err(io::Error::other("the grain pool's thread ended"))),
        }
    }
}
