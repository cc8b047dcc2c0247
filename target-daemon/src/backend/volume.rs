//! A namespace whose bytes are a pooled volume, served by the initiator's
//! volume engine ([`Volume`]) inside the target process.
//!
//! ```text
//!  reactor ── submit(AsyncOp, AsyncDone) ──► VolumeBackend
//!                                             │ active? (one atomic load)
//!                                             ├─ no: done(ENOTCONN) at once
//!                                             └─ yes: task on the executor (try_spawn, never waits)
//!                                                   │ Volume::read/write/… ── extents on other targets
//!                                                   ▼
//!  reactor ◄── CompletionSink ◄── done(result) ◄─ task (I/O thread or executor thread)
//! ```
//!
//! The namespace exists with its geometry from the spec
//! (`volume:UUID,size=…,block_size=…`) and holds no connections until
//! [`Backend::activate`] asks the target's [`VolumeSource`] to open the
//! volume. [`Backend::deactivate`] stops taking I/O (new operations fail),
//! waits for the operations in flight, then drops the source's session and
//! closes the volume (flush, disconnect). I/O while inactive fails with an
//! I/O error and does not make the backend [`Backend::failed`]; a mutation
//! the engine fails (no copy in sync took it) does, until the next
//! activation opens the volume afresh. An operation the engine fails
//! after its namespace stopped serving that volume (deactivated while it
//! was in flight, e.g. by a hand-over whose fence then cut the engine off
//! its extents) fails like I/O while inactive: a path error, never a
//! media error, and no device failure.
//!
//! The engine's calls run on one executor per target ([`VolumeContext`],
//! the initiator's [`Executor`]): the reactor polls a task once to issue
//! it, and it finishes on whichever thread wakes it, so no reactor ever
//! waits on the network. Buffers: a write's data is copied out of the
//! command slot once (the engine takes it by value); a read's buffer is
//! allocated per read and copied into the slot on completion.
//!
//! Closing is ordered so the last reference to the volume is never dropped
//! by an I/O task (which may run on one of the engine's own I/O threads,
//! and dropping a volume joins them): a task drops its reference before it
//! leaves the in-flight count, and the closer takes the volume out first
//! and closes it only once that count is zero.

use super::{AsyncDone, AsyncOp, Backend};
use crate::limits;
use crate::peerlog::{peer_warn, Site};
use arc_swap::ArcSwapOption;
use nvpool_initiator::exec::Executor;
use nvpool_initiator::{IoError, Volume};
use nvpool_rt::lock;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Opens pooled volumes for the volume namespaces of a target (the daemon
/// installs one with [`crate::Target::set_volume_source`]).
pub trait VolumeSource: Send + Sync {
    /// Opens volume `volume` (its UUID, lower-case, hyphenated). Blocks
    /// while it connects; called from the thread that activates the
    /// namespace, never from a reactor.
    fn open(&self, volume: &str) -> Result<OpenedVolume, String>;
}

/// A volume a [`VolumeSource`] opened, and what keeps it current.
pub struct OpenedVolume {
    pub volume: Arc<Volume>,
    /// Dropped when the namespace closes the volume, after its last I/O
    /// and before the volume itself: e.g. a thread that follows the
    /// control plane's copy states for this volume (stopped by its drop).
    pub session: Box<dyn Send>,
}

impl std::fmt::Debug for OpenedVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenedVolume")
            .field("volume", &self.volume)
            .finish_non_exhaustive()
    }
}

/// What the volume namespaces of one target share: the source that opens
/// their volumes (installed late: namespaces from the saved state exist
/// before the daemon installs it) and the executor their I/O runs on
/// (started at the first activation).
#[derive(Default)]
pub struct VolumeContext {
    source: Mutex<Option<Arc<dyn VolumeSource>>>,
    exec: Mutex<Option<Arc<Executor>>>,
}

impl std::fmt::Debug for VolumeContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VolumeContext")
            .field("source", &lock(&self.source).is_some())
            .field("exec", &*lock(&self.exec))
            .finish()
    }
}

impl VolumeContext {
    pub fn new() -> Arc<VolumeContext> {
        Arc::default()
    }

    /// Installs (or replaces) the source later activations open volumes
    /// with. Volumes open now stay as they are.
    pub fn set_source(&self, source: Arc<dyn VolumeSource>) {
        *lock(&self.source) = Some(source);
    }

    fn source(&self) -> Option<Arc<dyn VolumeSource>> {
        lock(&self.source).clone()
    }

    fn executor(&self) -> io::Result<Arc<Executor>> {
        let mut e = lock(&self.exec);
        if let Some(x) = &*e {
            return Ok(x.clone());
        }
        let x = Arc::new(Executor::new(
            "nvpool-volume-io",
            limits::VOLUME_EXEC_THREADS,
            limits::VOLUME_IO_INFLIGHT_MAX,
            // A task's last step hands its result to a reactor's sink and
            // never blocks, so the I/O thread that completes it may run it.
            true,
        )?);
        *e = Some(x.clone());
        Ok(x)
    }
}

/// The state I/O tasks share with the namespace.
struct Shared {
    uuid: String,
    /// The open volume; None while inactive.
    volume: ArcSwapOption<Volume>,
    /// Operations that took the volume and have not completed (plus, for
    /// an instant, ones checking whether it is there).
    inflight: AtomicUsize,
    idle: Mutex<()>,
    idle_cv: Condvar,
    /// A mutation failed since the last activation.
    failed: AtomicBool,
    /// Warnings a host can trigger (I/O to an inactive namespace, failing
    /// I/O) share one rate limit per namespace (peerlog.rs), so one failing
    /// volume does not hide another's.
    log: Site,
}

impl Shared {
    /// Waits until no operation is in flight; false if `limit` passed first.
    fn wait_idle(&self, limit: Option<Duration>) -> bool {
        let deadline = limit.map(|l| Instant::now() + l);
        let mut g = lock(&self.idle);
        while self.inflight.load(Ordering::SeqCst) != 0 {
            g = match deadline {
                None => self.idle_cv.wait(g).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return false;
                    }
                    self.idle_cv
                        .wait_timeout(g, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
        true
    }

    /// Logs a warning a host can trigger, rate-limited per namespace.
    fn warn(&self, what: &str, detail: &dyn std::fmt::Display) {
        peer_warn!(site = &self.log; volume = %self.uuid, error = %detail, "{what}");
    }

    /// An engine error: logged (rate-limited), recorded when a mutation
    /// failed, mapped to the errno the reactor turns into a status.
    ///
    /// `volume` is the one the operation ran on. When the namespace no
    /// longer serves it (deactivated, or opened afresh meanwhile) the
    /// error is the path's, not the device's: this path stopped serving
    /// while the operation was in the engine, and what failed it is what
    /// comes with that (its controllers to the extents killed by the
    /// fence, reconnects refused once its host NQN was detached, every
    /// copy of a row failed for it). It is answered like I/O to an
    /// inactive namespace ([`not_active`], a path status the host retries
    /// on another path) and does not make the backend failed.
    fn engine_error(&self, mutates: bool, volume: &Arc<Volume>, e: &IoError) -> io::Error {
        if !self.serves(volume) {
            self.warn("volume I/O failed after its path stopped serving", e);
            return not_active();
        }
        if mutates && !matches!(e, IoError::Invalid(_)) {
            self.failed.store(true, Ordering::Release);
        }
        self.warn("volume I/O failed", e);
        io::Error::from_raw_os_error(nvpool_initiator::frontend::errno(e))
    }

    /// Whether `volume` is the one this namespace serves now. The caller
    /// holds a reference, so its address cannot belong to another volume.
    fn serves(&self, volume: &Arc<Volume>) -> bool {
        self.volume
            .load()
            .as_ref()
            .is_some_and(|v| Arc::ptr_eq(v, volume))
    }
}

/// Counts one operation in flight while alive.
struct Hold(Arc<Shared>);

impl Drop for Hold {
    fn drop(&mut self) {
        if self.0.inflight.fetch_sub(1, Ordering::SeqCst) == 1 {
            // Under the lock, so a closer between its check and its wait
            // cannot miss this.
            let _g = lock(&self.0.idle);
            self.0.idle_cv.notify_all();
        }
    }
}

/// A namespace backed by a pooled volume; see the module docs.
pub struct VolumeBackend {
    uuid: [u8; 16],
    size: u64,
    block_size: u32,
    ctx: Arc<VolumeContext>,
    shared: Arc<Shared>,
    /// Activations and deactivations run one at a time under this lock,
    /// which holds the open volume's session. The data path never takes it.
    session: Mutex<Option<Box<dyn Send>>>,
    /// The target's executor, set by the first activation (before the
    /// volume is published, so an operation that finds a volume finds it).
    exec: OnceLock<Arc<Executor>>,
}

impl std::fmt::Debug for VolumeBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VolumeBackend")
            .field("volume", &self.shared.uuid)
            .field("size", &self.size)
            .field("block_size", &self.block_size)
            .field("active", &self.is_active())
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

impl VolumeBackend {
    /// An inactive namespace for volume `uuid` (lower-case, hyphenated) of
    /// `size` bytes in `block_size` blocks; `ctx` is the target's.
    pub fn new(uuid: String, size: u64, block_size: u32, ctx: Arc<VolumeContext>) -> VolumeBackend {
        let bytes = nvpool_wire::nqn::parse_uuid(&uuid).expect("the spec parser checked the UUID");
        assert!(
            size > 0 && size.is_multiple_of(u64::from(block_size)),
            "the spec parser checked the geometry"
        );
        VolumeBackend {
            uuid: bytes,
            size,
            block_size,
            ctx,
            shared: Arc::new(Shared {
                uuid: nvpool_wire::nqn::format_uuid(&bytes),
                volume: ArcSwapOption::empty(),
                inflight: AtomicUsize::new(0),
                idle: Mutex::new(()),
                idle_cv: Condvar::new(),
                failed: AtomicBool::new(false),
                log: Site::new(),
            }),
            session: Mutex::new(None),
            exec: OnceLock::new(),
        }
    }

    /// The volume is open and I/O reaches it.
    pub fn is_active(&self) -> bool {
        self.shared.volume.load().is_some()
    }

    /// Operations handed to the volume and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.shared.inflight.load(Ordering::SeqCst)
    }

    /// The open volume, counted in flight until the [`Hold`] drops; None
    /// while inactive.
    fn enter(&self) -> Option<(Arc<Volume>, Hold)> {
        // Counted before the load: a closer that took the volume out and
        // then saw zero in flight cannot be passed by this operation
        // (SeqCst on both sides).
        self.shared.inflight.fetch_add(1, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        let hold = Hold(self.shared.clone());
        let volume = self.shared.volume.load_full()?;
        Some((volume, hold))
    }

    /// Runs `op` on this thread (blocking) for the synchronous calls.
    fn blocking(&self, op: AsyncOp) -> io::Result<Option<Vec<u8>>> {
        let Some((volume, hold)) = self.enter() else {
            return Err(not_active());
        };
        let mutates = op.mutates();
        let r = nvpool_initiator::device::block_on(run(&volume, op))
            .map_err(|e| self.shared.engine_error(mutates, &volume, &e));
        drop(volume);
        drop(hold);
        r
    }
}

/// The error of I/O to an inactive namespace: not a device failure, and
/// for the host a path error (`ENOTCONN` is answered with ANA
/// inaccessible), so a command that passed the ANA check just before its
/// path stopped serving is retried on another path instead of failing.
fn not_active() -> io::Error {
    io::Error::from_raw_os_error(libc::ENOTCONN)
}

/// One operation on the engine.
async fn run(volume: &Volume, op: AsyncOp) -> Result<Option<Vec<u8>>, IoError> {
    match op {
        AsyncOp::Read { off, len } => {
            let (r, buf) = volume.read(off, vec![0; len]).await;
            r.map(|()| Some(buf))
        }
        AsyncOp::Write { off, data, fua } => volume.write(off, data, fua).await.0.map(|()| None),
        AsyncOp::Flush => volume.flush().await.map(|()| None),
        AsyncOp::WriteZeroes { off, len } => {
            volume.write_zeroes(off, len, false).await.map(|()| None)
        }
        AsyncOp::Discard { ranges } => {
            for (off, len) in ranges {
                volume.discard(off, len).await?;
            }
            Ok(None)
        }
    }
}

/// Drops the session, then closes the volume (flush, disconnect). Blocks.
fn close(uuid: &str, session: Option<Box<dyn Send>>, volume: Arc<Volume>) {
    drop(session);
    match Arc::try_unwrap(volume) {
        Ok(v) => match v.close() {
            Ok(()) => tracing::info!(volume = uuid, "volume closed"),
            Err(e) => {
                tracing::warn!(volume = uuid, error = %e, "volume closed; its last flush failed")
            }
        },
        // The source kept a reference: it closes when that one goes.
        Err(v) => {
            tracing::warn!(
                volume = uuid,
                "volume still referenced by its source; not flushed here"
            );
            drop(v);
        }
    }
}

/// Closes `volume` on a thread of its own once no operation is in flight
/// (never on the caller, which may be a reactor or an I/O thread).
fn close_later(shared: Arc<Shared>, session: Option<Box<dyn Send>>, volume: Arc<Volume>) {
    // Outside the closure, so a failed spawn does not drop it here.
    let held = Arc::new(Mutex::new(Some((session, volume))));
    let h = held.clone();
    let spawned = std::thread::Builder::new()
        .name("nvpool-volume-close".into())
        .spawn(move || {
            shared.wait_idle(None);
            if let Some((session, volume)) = lock(&h).take() {
                close(&shared.uuid, session, volume);
            }
        });
    if let Err(e) = spawned {
        // Without a thread to close it on, leaking the volume (its
        // connections and threads) is the one safe choice: dropping it
        // here could join the thread we run on.
        tracing::error!(error = %e, "cannot start a thread to close a volume; leaving it open");
        std::mem::forget(lock(&held).take());
    }
}

impl Drop for VolumeBackend {
    fn drop(&mut self) {
        // The namespace went away while active (removed from its
        // subsystem). Whoever dropped it may be a reactor: close elsewhere.
        if let Some(volume) = self.shared.volume.swap(None) {
            let session = lock(&self.session).take();
            close_later(self.shared.clone(), session, volume);
        }
    }
}

impl Backend for VolumeBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn block_size(&self) -> u32 {
        self.block_size
    }

    fn describe(&self) -> String {
        format!("volume {}", self.shared.uuid)
    }

    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let data = self
            .blocking(AsyncOp::Read {
                off,
                len: buf.len(),
            })?
            .expect("a read returns data");
        buf.copy_from_slice(&data);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], off: u64, fua: bool) -> io::Result<()> {
        self.blocking(AsyncOp::Write {
            off,
            data: buf.to_vec(),
            fua,
        })
        .map(drop)
    }

    /// Inactive, there is nothing to flush (deactivation flushed), so the
    /// flush at shutdown succeeds; the host's Flush commands go through
    /// [`Backend::submit`] and fail while inactive like any I/O.
    fn flush(&self) -> io::Result<()> {
        match self.blocking(AsyncOp::Flush) {
            Err(_) if !self.is_active() => Ok(()),
            r => r.map(drop),
        }
    }

    fn write_zeroes(&self, off: u64, len: u64) -> io::Result<()> {
        self.blocking(AsyncOp::WriteZeroes { off, len }).map(drop)
    }

    fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        self.blocking(AsyncOp::Discard {
            ranges: vec![(off, len)],
        })
        .map(drop)
    }

    fn failed(&self) -> bool {
        self.shared.failed.load(Ordering::Acquire)
    }

    fn mark_failed(&self) {
        self.shared.failed.store(true, Ordering::Release);
    }

    fn activate(&self) -> io::Result<()> {
        let mut session = lock(&self.session);
        if self.is_active() {
            return Ok(());
        }
        let uuid = &self.shared.uuid;
        let source = self.ctx.source().ok_or_else(|| {
            io::Error::other(format!(
                "volume {uuid}: no volume source is installed on this target"
            ))
        })?;
        let exec = self.ctx.executor()?;
        let opened = source
            .open(uuid)
            .map_err(|e| io::Error::other(format!("volume {uuid}: {e}")))?;
        let v = &opened.volume;
        let mismatch = if v.plan().volume.0 != self.uuid {
            Some(format!("the source opened volume {}", v.plan().volume))
        } else if v.size() != self.size || v.block_size() != self.block_size {
            Some(format!(
                "it has {} bytes in {}-byte blocks; the namespace has {} bytes in {}-byte blocks",
                v.size(),
                v.block_size(),
                self.size,
                self.block_size
            ))
        } else {
            None
        };
        if let Some(why) = mismatch {
            close(uuid, Some(opened.session), opened.volume);
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("volume {uuid}: {why}"),
            ));
        }
        // The same executor every time: a second set is a no-op.
        let _ = self.exec.set(exec);
        self.shared.failed.store(false, Ordering::Release);
        *session = Some(opened.session);
        self.shared.volume.store(Some(opened.volume));
        tracing::info!(volume = %uuid, size = self.size, block_size = self.block_size, "volume namespace active");
        Ok(())
    }

    fn deactivate(&self) {
        let mut session = lock(&self.session);
        let Some(volume) = self.shared.volume.swap(None) else {
            return;
        };
        std::sync::atomic::fence(Ordering::SeqCst);
        let uuid = &self.shared.uuid;
        let limit = Duration::from_millis(limits::VOLUME_DRAIN_MS);
        if self.shared.wait_idle(Some(limit)) {
            close(uuid, session.take(), volume);
        } else {
            tracing::error!(
                volume = %uuid,
                in_flight = self.in_flight(),
                "deactivate: I/O still in flight after {} ms; the volume closes when it completes",
                limits::VOLUME_DRAIN_MS
            );
            close_later(self.shared.clone(), session.take(), volume);
        }
    }

    fn is_async(&self) -> bool {
        true
    }

    fn submit(&self, op: AsyncOp, done: AsyncDone) {
        let Some((volume, hold)) = self.enter() else {
            self.shared
                .warn("I/O to an inactive volume namespace", &"not active");
            done.complete(Err(not_active()));
            return;
        };
        let exec = self
            .exec
            .get()
            .expect("set before the volume was published");
        let shared = self.shared.clone();
        let mutates = op.mutates();
        let mut job = Some((volume, hold, op, done));
        let started = exec.try_spawn(|| {
            let (volume, hold, op, done) = job.take().expect("built once");
            async move {
                let r = run(&volume, op)
                    .await
                    .map_err(|e| shared.engine_error(mutates, &volume, &e));
                // Before the hold goes: see the module docs.
                drop(volume);
                done.complete(r);
                drop(hold);
            }
        });
        if !started {
            let (volume, hold, _op, done) = job.take().expect("kept when refused");
            drop(volume);
            self.shared.warn(
                "volume I/O refused: the target's volume executor is full",
                &limits::VOLUME_IO_INFLIGHT_MAX,
            );
            // The host retries (Namespace Not Ready, see queue/io.rs).
            done.complete(Err(io::Error::from_raw_os_error(libc::EAGAIN)));
            drop(hold);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CompletionSink;

    const UUID: &str = "0a0b0c0d-0000-4000-8000-00000000000f";

    fn backend(ctx: Arc<VolumeContext>) -> VolumeBackend {
        VolumeBackend::new(UUID.into(), 1 << 20, 4096, ctx)
    }

    #[test]
    fn io_while_inactive_fails_at_once_and_is_no_device_failure() {
        let b = backend(VolumeContext::new());
        assert_eq!(b.describe(), format!("volume {UUID}"));
        assert_eq!((b.size(), b.block_size()), (1 << 20, 4096));
        assert!(b.uring_target().is_none() && b.device_extent().is_none());
        assert!(b.is_async());
        let sink = CompletionSink::new(|| {});
        let ops = [
            AsyncOp::Read { off: 0, len: 4096 },
            AsyncOp::Write {
                off: 4096,
                data: vec![1; 4096],
                fua: true,
            },
            AsyncOp::Flush,
            AsyncOp::WriteZeroes { off: 0, len: 8192 },
            AsyncOp::Discard {
                ranges: vec![(0, 4096)],
            },
        ];
        for (i, op) in ops.into_iter().enumerate() {
            b.submit(op, AsyncDone::new(sink.clone(), i as u64));
        }
        let mut out = Vec::new();
        sink.take(&mut out);
        assert_eq!(out.len(), 5, "every operation completed at once");
        for c in &out {
            let e = c.result.as_ref().expect_err("inactive");
            assert_eq!(e.raw_os_error(), Some(libc::ENOTCONN));
        }
        assert!(!b.failed(), "inactive is not failed");
        assert_eq!(b.in_flight(), 0);
        assert!(!b.is_active());
        // The synchronous calls too; the flush at shutdown has nothing to do.
        assert!(b.read_at(&mut [0; 4096], 0).is_err());
        assert!(b.write_at(&[0; 4096], 0, false).is_err());
        assert!(b.flush().is_ok());
        b.deactivate();
        assert!(!b.failed());
    }

    struct Refuse;

    impl VolumeSource for Refuse {
        fn open(&self, volume: &str) -> Result<OpenedVolume, String> {
            Err(format!("{volume} is not attached here"))
        }
    }

    #[test]
    fn activation_needs_a_source_that_opens_the_volume() {
        let ctx = VolumeContext::new();
        let b = backend(ctx.clone());
        let e = b.activate().expect_err("no source yet");
        assert!(e.to_string().contains("no volume source"), "{e}");
        ctx.set_source(Arc::new(Refuse));
        let e = b.activate().expect_err("the source refuses");
        assert!(e.to_string().contains("is not attached here"), "{e}");
        assert!(!b.is_active());
        assert!(!b.failed());
    }
}
