//! The host's part of resync and moves (ARCHITECTURE C17, C18), in any
//! process that serves a volume with the engine (`nvpool volume serve`,
//! the target's volume namespaces): it tells the control plane which
//! session serves the volume, follows the volume's copy changes by
//! long-polling its attachment, brings the volume engine's copies along
//! (mirror to a copy being filled, read from it once it is in sync, stop
//! when a job fails), confirms mirroring, reports copies that fail at I/O
//! time, and hands over what stale copies missed when it stops.
//!
//! ```text
//!  open ── PUT …/session {session, revision}
//!  loop ── GET …/attachments/{host}?after_revision=R   (≤ 25 s each)
//!    ├─ syncing copy, engine Failed  ─► begin_sync (connect, mirror, drain)
//!    │                                  ─► PUT …/sync/{job} {missed regions}
//!    ├─ copy no longer stale         ─► finish_sync (reads may use it)
//!    ├─ stale, engine mirroring      ─► abort_sync (the job failed)
//!    ├─ stale, engine Ok             ─► mark_failed (another host found it stale)
//!    ├─ write_epoch above confirmed  ─► set_write_epoch (tag new writes, drain)
//!    │                                  ─► PUT …/epoch {session, epoch}
//!    ├─ … and write_hold             ─► hold_writes (admit none, tag, drain)
//!    │                                  ─► PUT …/epoch {session, epoch, held: true}
//!    └─ write_hold cleared           ─► release_writes (admit them again)
//!  stop ── PUT …/missed {extent: regions}
//! ```
//!
//! A group snapshot's barrier (`write_hold`) keeps the engine's new writes
//! waiting until the control plane has every engine's held confirmation
//! and clears it; the long-poll goes on meanwhile, since the release
//! arrives on it. A control plane that cannot be reached while the engine
//! is held leaves the release to the engine, which ends a hold on its own
//! after `ENGINE_HOLD_MAX_MS` ([`VolumeOptions::write_hold_max`](crate::volume::VolumeOptions::write_hold_max)).
//!
//! The write epoch (snapshots, design/thin-snapshots.md T5) is confirmed
//! at open too (when above 0), so the control plane counts a freshly
//! opened engine; an unconfirmed one is retried every [`FOLLOW_RETRY`]
//! rather than after the next long-poll, since a snapshot waits for it.
//!
//! A copy moving to a new extent (replace, move) is listed in `moving`:
//!
//! ```text
//!  moving, not switched ─► begin_move (connect the new extent, write it
//!                          too, drain) ─► PUT …/sync/{job}
//!  moving, switched     ─► switch_move (read the new extent, keep writing
//!                          the old one) ─► PUT …/sync/{job}
//!  no longer moving     ─► end_move / abort_move (stop writing the other)
//!  the new extent failed here ─► PUT …/sync/{job} {failed: true}
//! ```
//!
//! A copy the engine gives up during I/O goes to a reporter thread
//! ([`spawn_failure_reporter`]): `PUT …/failed-extents`, retried until the
//! control plane answers.
//!
//! A grown volume (`nvpool volume resize`) moves the revision too: the
//! watcher hands the bigger plan to the engine ([`Volume::grow`]) and then
//! to the serving process's hook ([`Watcher::on_grown`]), which grows the
//! block device.
//!
//! The data path never waits on any of this: the engine applies a change
//! between requests, and a control plane that cannot be reached only
//! delays healing. How the control plane is called is the caller's
//! ([`ControlPlane`]: the CLI's client, the target's), so this crate
//! carries no HTTP client.

use crate::error::Error;
use crate::limits::{
    FOLLOW_FAILURES_QUEUED_MAX, FOLLOW_GET_TIMEOUT, FOLLOW_HAND_OVER_TRIES_MAX, FOLLOW_REPORT_IDLE,
    FOLLOW_REPORT_RETRY, FOLLOW_RETRY,
};
use crate::volume::{CopyState, ExtentFailedFn, ExtentFailure, MissedRegions, MovingCopy, Volume};
use nvpool_api::names::segment;
use nvpool_api::rest::{
    AttachmentOut, EpochBody, ErrorBody, FailedExtentsBody, MissedBody, SessionBody, SyncBody,
};
use nvpool_layout::copies::{HostMove, SyncingCopy};
use nvpool_layout::plan::{ConnectionPlan, PlanExtent};
use nvpool_layout::Uuid;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How the follower calls the control plane's REST API: blocking, from
/// the follower's own threads. `path` is relative to the control plane's
/// base URL (`/v1/volumes/{uuid}/attachments/{host}…`, every segment
/// escaped with [`segment`]); calls that change something (every PUT)
/// carry the admin token when one is configured.
///
/// `Ok` is any HTTP answer, error statuses included: its status and body.
/// `Err` is no answer at all (refused, timed out, reset), in words for
/// the log.
pub trait ControlPlane: Send + Sync + 'static {
    /// `GET path`, giving up after `timeout` for the whole answer
    /// ([`FOLLOW_GET_TIMEOUT`], which covers a long-poll).
    fn get(&self, path: &str, timeout: Duration) -> Result<(u16, Vec<u8>), String>;

    /// `PUT path` with a JSON body.
    fn put_json(&self, path: &str, body: &serde_json::Value) -> Result<(u16, Vec<u8>), String>;
}

impl<T: ControlPlane + ?Sized> ControlPlane for Arc<T> {
    fn get(&self, path: &str, timeout: Duration) -> Result<(u16, Vec<u8>), String> {
        (**self).get(path, timeout)
    }

    fn put_json(&self, path: &str, body: &serde_json::Value) -> Result<(u16, Vec<u8>), String> {
        (**self).put_json(path, body)
    }
}

/// Why one call to the control plane did not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// No HTTP answer (the [`ControlPlane`]'s words).
    #[error("{0}")]
    Unreachable(String),
    /// The control plane answered with an error (`{kind, message}`).
    #[error("the control plane answered HTTP {status} ({kind}): {message}")]
    Refused {
        status: u16,
        kind: String,
        message: String,
    },
    /// An answer that is not what the API documents.
    #[error("unexpected answer to GET {path}: {reason}")]
    Protocol { path: String, reason: String },
}

impl CallError {
    /// The HTTP status of an error answer.
    pub fn status(&self) -> Option<u16> {
        match self {
            CallError::Refused { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The error an answer with status `status` stands for, if any.
    fn check(status: u16, body: &[u8]) -> Result<(), CallError> {
        if (200..300).contains(&status) {
            return Ok(());
        }
        let b: ErrorBody = serde_json::from_slice(body).unwrap_or_default();
        Err(CallError::Refused {
            status,
            kind: if b.kind.is_empty() {
                "http".into()
            } else {
                b.kind
            },
            message: b.message,
        })
    }
}

fn put(cp: &impl ControlPlane, path: &str, body: &impl Serialize) -> Result<(), CallError> {
    // A REST body is plain data: nothing in it can fail to serialize.
    let body = serde_json::to_value(body).expect("a REST body serializes");
    let (status, answer) = cp.put_json(path, &body).map_err(CallError::Unreachable)?;
    CallError::check(status, &answer)
}

fn get<T: DeserializeOwned>(cp: &impl ControlPlane, path: &str) -> Result<T, CallError> {
    let (status, body) = cp
        .get(path, FOLLOW_GET_TIMEOUT)
        .map_err(CallError::Unreachable)?;
    CallError::check(status, &body)?;
    serde_json::from_slice(&body).map_err(|e| CallError::Protocol {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

/// The path of `host_nqn`'s attachment of `volume`:
/// `/v1/volumes/{uuid}/attachments/{host}`.
pub fn attachment_path(volume: &Uuid, host_nqn: &str) -> String {
    format!("/v1/volumes/{volume}/attachments/{}", segment(host_nqn))
}

/// The copy fields of `GET …/attachments/{host}` ([`AttachmentOut`]'s),
/// as the follower tracks them.
#[derive(Debug, Clone, Default)]
pub struct CopyView {
    pub failed_extents: Vec<u32>,
    pub syncing: Vec<SyncingCopy>,
    pub moving: Vec<HostMove>,
    pub revision: u64,
    /// The epoch the engine tags its writes with (0: untagged).
    pub write_epoch: u32,
    /// A barrier is on: the engine admits no new write until it is
    /// cleared ([`AttachmentOut::write_hold`]).
    pub write_hold: bool,
}

impl CopyView {
    /// Copies the engine must not read or write at open: stale and not
    /// being filled.
    pub fn stale_at_open(&self) -> Vec<usize> {
        let syncing: BTreeSet<u32> = self.syncing.iter().map(|s| s.extent).collect();
        self.failed_extents
            .iter()
            .filter(|e| !syncing.contains(e))
            .map(|&e| e as usize)
            .collect()
    }

    /// Copies the engine opens syncing (written, never read).
    pub fn syncing_at_open(&self) -> Vec<usize> {
        self.syncing.iter().map(|s| s.extent as usize).collect()
    }

    /// Copies the engine opens moving (writing the new extent too, or
    /// reading it once switched).
    pub fn moving_at_open(&self) -> Vec<MovingCopy> {
        self.moving
            .iter()
            .map(|m| MovingCopy {
                extent: m.extent as usize,
                dest: m.dest.clone(),
                switched: m.switched,
            })
            .collect()
    }
}

/// What a serving process reads from `GET …/attachments/{host}` (an
/// [`AttachmentOut`]), at open and at every change: the connection plan
/// (bigger after a resize) and the copies.
#[derive(Debug, Clone, Deserialize)]
#[serde(from = "AttachmentOut")]
pub struct AttachmentView {
    pub plan: ConnectionPlan,
    pub copies: CopyView,
    /// The volume is read-only ([`AttachmentOut::read_only`]): its
    /// targets refuse writes, so it is presented read-only.
    pub read_only: bool,
}

impl From<AttachmentOut> for AttachmentView {
    fn from(a: AttachmentOut) -> AttachmentView {
        let copies = CopyView {
            failed_extents: a.failed_extents,
            syncing: a.syncing,
            moving: a.moving,
            revision: a.revision,
            write_epoch: a.write_epoch,
            write_hold: a.write_hold,
        };
        AttachmentView {
            plan: a.plan,
            copies,
            read_only: a.read_only,
        }
    }
}

/// `GET …/attachments/{host}`: what a serving process opens `volume`
/// from. Validate the plan before using it.
pub fn read_attachment(
    cp: &impl ControlPlane,
    volume: &Uuid,
    host_nqn: &str,
) -> Result<AttachmentView, CallError> {
    get(cp, &attachment_path(volume, host_nqn))
}

/// A random session id for one serving process (or one volume served).
/// From the kernel's random bytes, or unique enough without them (the
/// clock and the pid).
pub fn new_session() -> u64 {
    nvpool_rt::random::Rng::from_os().next_u64()
}

/// Starts the thread that reports copies the engine gives up to the
/// control plane (`PUT …/failed-extents`), retrying until it answers.
/// Returns the callback to put in
/// [`VolumeOptions::on_extent_failed`](crate::volume::VolumeOptions::on_extent_failed)
/// (it logs and queues, never blocks) and the thread, which ends once
/// every clone of the callback is gone (the volume closed) and nothing is
/// pending.
pub fn spawn_failure_reporter<C: ControlPlane>(
    cp: C,
    volume: &Uuid,
    host_nqn: &str,
) -> std::io::Result<(ExtentFailedFn, JoinHandle<()>)> {
    spawn_reporter(cp, volume, host_nqn, None)
}

/// [`spawn_failure_reporter`] for an engine that serves only for a term,
/// a target's as a served volume's owner (C19): once `ended` is set (the
/// namespace closed the volume, its term is over) the thread ends and
/// drops what it has not sent yet. Those failures are of the fenced
/// term (its extents taken away), and the owner NQN is the same in the
/// target's next term: sent later, they would be taken as the new
/// engine's and mark copies failed that it reaches fine.
pub fn spawn_failure_reporter_until<C: ControlPlane>(
    cp: C,
    volume: &Uuid,
    host_nqn: &str,
    ended: Arc<AtomicBool>,
) -> std::io::Result<(ExtentFailedFn, JoinHandle<()>)> {
    spawn_reporter(cp, volume, host_nqn, Some(ended))
}

fn spawn_reporter<C: ControlPlane>(
    cp: C,
    volume: &Uuid,
    host_nqn: &str,
    ended: Option<Arc<AtomicBool>>,
) -> std::io::Result<(ExtentFailedFn, JoinHandle<()>)> {
    let (tx, rx) = std::sync::mpsc::sync_channel::<usize>(FOLLOW_FAILURES_QUEUED_MAX);
    let path = format!("{}/failed-extents", attachment_path(volume, host_nqn));
    let span = tracing::info_span!("follow", volume = %volume);
    let thread = std::thread::Builder::new()
        .name("nvpool-report".into())
        .spawn(move || {
            let _s = span.entered();
            report_failures(&cp, &path, &rx, ended.as_deref())
        })?;
    let volume = *volume;
    let on_failed: ExtentFailedFn = Arc::new(move |f: &ExtentFailure| {
        tracing::warn!(%volume, extent = f.index, target = %f.target, error = %f.error,
            lost = f.member_lost, "extent copy failed; serving from the others");
        let _ = tx.try_send(f.index);
    });
    Ok((on_failed, thread))
}

/// Sends failed extents to the control plane, retrying until it answers
/// (or, with `ended`, until that is set: what is pending then is dropped).
fn report_failures(
    cp: &impl ControlPlane,
    path: &str,
    rx: &Receiver<usize>,
    ended: Option<&AtomicBool>,
) {
    let over = || ended.is_some_and(|e| e.load(Ordering::Acquire));
    let mut pending: Vec<u32> = Vec::new();
    loop {
        if over() {
            if !pending.is_empty() {
                tracing::info!(extents = ?pending,
                    "the engine's term ended: its failed extents are not reported");
            }
            return;
        }
        let wait = if pending.is_empty() {
            FOLLOW_REPORT_IDLE
        } else {
            FOLLOW_REPORT_RETRY
        };
        match rx.recv_timeout(wait) {
            Ok(i) => pending.push(i as u32),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) if pending.is_empty() => return,
            Err(RecvTimeoutError::Disconnected) => {}
        }
        while let Ok(i) = rx.try_recv() {
            pending.push(i as u32);
        }
        if pending.is_empty() || over() {
            continue;
        }
        pending.sort_unstable();
        pending.dedup();
        let body = FailedExtentsBody {
            failed_extents: pending.clone(),
        };
        match put(cp, path, &body) {
            Ok(()) => {
                tracing::info!(extents = ?pending, "failed extents reported to the control plane");
                pending.clear();
            }
            Err(e) => {
                tracing::warn!(error = %e, "reporting failed extents failed; retrying");
                std::thread::sleep(FOLLOW_REPORT_RETRY);
            }
        }
    }
}

/// The engine calls the watcher makes: [`Volume`]'s, or a unit test's
/// scripted engine.
trait Engine: Send + Sync {
    fn extents(&self) -> usize;
    fn copy_state(&self, index: usize) -> CopyState;
    fn begin_sync(&self, index: usize) -> Result<MissedRegions, Error>;
    fn finish_sync(&self, index: usize);
    fn abort_sync(&self, index: usize);
    fn mark_failed(&self, index: usize);
    fn missed_regions(&self, index: usize) -> Option<MissedRegions>;
    fn begin_move(&self, index: usize, dest: &PlanExtent) -> Result<(), Error>;
    fn switch_move(&self, index: usize) -> Result<(), Error>;
    fn end_move(&self, index: usize);
    fn abort_move(&self, index: usize);
    fn move_failed(&self, index: usize) -> bool;
    fn extent_location(&self, index: usize) -> PlanExtent;
    fn size(&self) -> u64;
    fn grow(&self, plan: &ConnectionPlan) -> Result<bool, Error>;
    fn set_write_epoch(&self, epoch: u32) -> Result<(), Error>;
    fn hold_writes(&self, epoch: u32) -> Result<bool, Error>;
    fn release_writes(&self);
}

impl Engine for Volume {
    fn extents(&self) -> usize {
        self.plan().extents.len()
    }
    fn copy_state(&self, index: usize) -> CopyState {
        Volume::copy_state(self, index)
    }
    fn begin_sync(&self, index: usize) -> Result<MissedRegions, Error> {
        Volume::begin_sync(self, index)
    }
    fn finish_sync(&self, index: usize) {
        Volume::finish_sync(self, index)
    }
    fn abort_sync(&self, index: usize) {
        Volume::abort_sync(self, index)
    }
    fn mark_failed(&self, index: usize) {
        Volume::mark_failed(self, index)
    }
    fn missed_regions(&self, index: usize) -> Option<MissedRegions> {
        Volume::missed_regions(self, index)
    }
    fn begin_move(&self, index: usize, dest: &PlanExtent) -> Result<(), Error> {
        Volume::begin_move(self, index, dest)
    }
    fn switch_move(&self, index: usize) -> Result<(), Error> {
        Volume::switch_move(self, index)
    }
    fn end_move(&self, index: usize) {
        Volume::end_move(self, index)
    }
    fn abort_move(&self, index: usize) {
        Volume::abort_move(self, index)
    }
    fn move_failed(&self, index: usize) -> bool {
        Volume::move_failed(self, index)
    }
    fn extent_location(&self, index: usize) -> PlanExtent {
        Volume::extent_location(self, index)
    }
    fn size(&self) -> u64 {
        Volume::size(self)
    }
    fn grow(&self, plan: &ConnectionPlan) -> Result<bool, Error> {
        Volume::grow(self, plan)
    }
    fn set_write_epoch(&self, epoch: u32) -> Result<(), Error> {
        Volume::set_write_epoch(self, epoch)
    }
    fn hold_writes(&self, epoch: u32) -> Result<bool, Error> {
        Volume::hold_writes(self, epoch)
    }
    fn release_writes(&self) {
        Volume::release_writes(self)
    }
}

/// What the serving process does once the engine grew: the new size in
/// bytes. Called on the watcher's thread.
pub type GrownFn = Box<dyn Fn(u64) + Send + Sync>;

/// Follows the copies of one served volume.
pub struct Watcher<C> {
    cp: C,
    volume_id: Uuid,
    /// The attachment's path.
    base: String,
    session: u64,
    engine: Arc<dyn Engine>,
    stop: Arc<AtomicBool>,
    on_grown: Option<GrownFn>,
}

impl<C> fmt::Debug for Watcher<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watcher")
            .field("base", &self.base)
            .field("session", &self.session)
            .field("stop", &self.stop)
            .finish_non_exhaustive()
    }
}

impl<C: ControlPlane> Watcher<C> {
    /// The watcher of `host_nqn`'s attachment of `volume`, served by
    /// `engine` in session `session` ([`new_session`]). Setting `stop`
    /// ends [`Watcher::register`] and [`Watcher::run`] (within one
    /// long-poll).
    pub fn new(
        cp: C,
        volume: &Uuid,
        host_nqn: &str,
        engine: Arc<Volume>,
        session: u64,
        stop: Arc<AtomicBool>,
    ) -> Watcher<C> {
        Watcher::with_engine(cp, volume, host_nqn, engine, session, stop)
    }

    fn with_engine(
        cp: C,
        volume: &Uuid,
        host_nqn: &str,
        engine: Arc<dyn Engine>,
        session: u64,
        stop: Arc<AtomicBool>,
    ) -> Watcher<C> {
        Watcher {
            cp,
            volume_id: *volume,
            base: attachment_path(volume, host_nqn),
            session,
            engine,
            stop,
            on_grown: None,
        }
    }

    /// Calls `f` with the new size each time the engine grew.
    pub fn on_grown(mut self, f: GrownFn) -> Watcher<C> {
        self.on_grown = Some(f);
        self
    }

    /// The session this process serves the volume in.
    pub fn session(&self) -> u64 {
        self.session
    }

    /// Tells the control plane this session serves the volume, as of
    /// `revision`. Retries until it answers or the watcher is stopped.
    pub fn register(&self, revision: u64) {
        let _s = tracing::info_span!("follow", volume = %self.volume_id).entered();
        let body = SessionBody {
            session: self.session,
            revision,
        };
        let path = format!("{}/session", self.base);
        while !self.stop.load(Ordering::Relaxed) {
            match put(&self.cp, &path, &body) {
                Ok(()) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "registering the serving session failed; retrying");
                    std::thread::sleep(FOLLOW_RETRY);
                }
            }
        }
    }

    /// [`Watcher::run`] on a thread of its own, from `view` (the copies
    /// the engine was opened with).
    pub fn spawn(self: &Arc<Self>, view: CopyView) -> std::io::Result<JoinHandle<()>> {
        let w = self.clone();
        std::thread::Builder::new()
            .name("nvpool-watch".into())
            .spawn(move || w.run(view))
    }

    /// Follows the attachment until stopped, applying every copy change.
    /// `view` is what the engine was opened with.
    pub fn run(&self, mut view: CopyView) {
        let _s = tracing::info_span!("follow", volume = %self.volume_id).entered();
        // (job, switched) pairs confirmed; a session that opened with a
        // move counts as having confirmed its state then.
        let mut moves: BTreeSet<(u64, bool)> =
            view.moving.iter().map(|m| (m.job, m.switched)).collect();
        let mut confirmed: BTreeSet<u64> = BTreeSet::new();
        // Copies opened mirroring mirror for the jobs the view named.
        let mut mirroring_for: BTreeMap<u32, u64> =
            view.syncing.iter().map(|s| (s.extent, s.job)).collect();
        // The highest write epoch the control plane took from this session.
        let mut epoch_confirmed = 0;
        // The engine was told to hold writes (and not to release them yet).
        // A volume opened held counts as told.
        let mut holding = view.write_hold && view.write_epoch > 0;
        loop {
            self.apply_moves(&view, &mut moves);
            self.apply(&view, &mut confirmed, &mut mirroring_for);
            let epoch_done = self.apply_epoch(&view, &mut epoch_confirmed, &mut holding);
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            if !epoch_done {
                // A snapshot waits for it: again soon, not after a
                // long-poll.
                std::thread::sleep(FOLLOW_RETRY);
                continue;
            }
            match self.watch(view.revision) {
                Ok(v) => {
                    if !self.grow(&v.plan) {
                        // Asked again at once (same revision) after a pause.
                        std::thread::sleep(FOLLOW_RETRY);
                        continue;
                    }
                    view = v.copies;
                }
                Err(e) => {
                    if self.stop.load(Ordering::Relaxed) {
                        return;
                    }
                    tracing::warn!(error = %e, "watching the attachment failed; retrying");
                    std::thread::sleep(FOLLOW_RETRY);
                }
            }
        }
    }

    /// Takes a bigger plan into the engine, then tells the serving
    /// process. False: it could not (a new target unreachable, say); the
    /// caller asks again.
    fn grow(&self, plan: &ConnectionPlan) -> bool {
        if plan.size_bytes <= self.engine.size() {
            return true;
        }
        match self.engine.grow(plan) {
            Ok(grown) => {
                if grown {
                    tracing::info!(bytes = plan.size_bytes, "volume grown");
                    if let Some(f) = &self.on_grown {
                        f(plan.size_bytes);
                    }
                }
                true
            }
            Err(e) => {
                tracing::warn!(bytes = plan.size_bytes, error = %e,
                    "cannot take the grown volume yet; retrying");
                false
            }
        }
    }

    /// The attachment's copies (and plan) once their revision is past
    /// `revision` (or as they are, after the control plane's long-poll
    /// wait).
    fn watch(&self, revision: u64) -> Result<AttachmentView, CallError> {
        get(
            &self.cp,
            &format!("{}?after_revision={revision}", self.base),
        )
    }

    fn apply(
        &self,
        view: &CopyView,
        confirmed: &mut BTreeSet<u64>,
        mirroring_for: &mut BTreeMap<u32, u64>,
    ) {
        let engine = &*self.engine;
        let failed: BTreeSet<u32> = view.failed_extents.iter().copied().collect();
        let syncing: BTreeMap<u32, u64> = view.syncing.iter().map(|s| (s.extent, s.job)).collect();
        let moving: BTreeSet<u32> = view.moving.iter().map(|m| m.extent).collect();
        for i in 0..engine.extents() {
            let e = i as u32;
            if moving.contains(&e) {
                // apply_moves owns it until the move is over.
                continue;
            }
            let state = engine.copy_state(i);
            match (syncing.get(&e), failed.contains(&e), state) {
                (Some(&job), _, _) => {
                    if confirmed.contains(&job) {
                        continue;
                    }
                    if state == CopyState::Ok {
                        // Another host found it stale before we heard:
                        // stop reading it before mirroring again.
                        engine.mark_failed(i);
                    } else if state == CopyState::Syncing && mirroring_for.get(&e) != Some(&job) {
                        // Mirroring for an earlier job we did not see end:
                        // writes issued for it may still be in flight, so
                        // switch again (and drain) for this one.
                        engine.abort_sync(i);
                    }
                    match engine.begin_sync(i) {
                        Ok(missed) => {
                            mirroring_for.insert(e, job);
                            if self.confirm(job, &missed.regions) {
                                confirmed.insert(job);
                                tracing::info!(
                                    extent = i,
                                    job,
                                    missed = missed.regions.len(),
                                    "mirroring to the copy being filled"
                                );
                            }
                        }
                        Err(err) => {
                            tracing::warn!(extent = i, job, error = %err,
                                "cannot mirror to the copy yet; the job waits");
                        }
                    }
                }
                (None, false, CopyState::Syncing) => {
                    engine.finish_sync(i);
                    tracing::info!(extent = i, "copy in sync; reads use it again");
                }
                (None, true, CopyState::Syncing) => {
                    // The job failed: stop writing, record from now on.
                    engine.abort_sync(i);
                    tracing::warn!(extent = i, "copy job over without sync; copy stale again");
                }
                (None, true, CopyState::Ok) => {
                    // Another host found the copy stale: never read it.
                    engine.mark_failed(i);
                    tracing::warn!(extent = i, "copy is stale (found by another host)");
                }
                _ => {}
            }
        }
        confirmed.retain(|j| syncing.values().any(|x| x == j));
        mirroring_for.retain(|e, _| engine.copy_state(*e as usize) == CopyState::Syncing);
    }

    /// Brings the engine's moving copies along: write the new extent, read
    /// it once switched, let the other one go when the job is over.
    /// `done` holds the (job, switched) states confirmed.
    fn apply_moves(&self, view: &CopyView, done: &mut BTreeSet<(u64, bool)>) {
        let engine = &*self.engine;
        let listed: BTreeSet<u32> = view.moving.iter().map(|m| m.extent).collect();
        for i in 0..engine.extents() {
            if !listed.contains(&(i as u32)) {
                // Over: done (stop writing the old extent) or failed (stop
                // writing the new one). Both are no-ops without a move.
                engine.end_move(i);
                engine.abort_move(i);
            }
        }
        for m in &view.moving {
            let i = m.extent as usize;
            if done.contains(&(m.job, m.switched)) {
                if !m.switched && engine.move_failed(i) {
                    tracing::warn!(extent = i, job = m.job, "the new extent failed here");
                    self.report_move_failed(m.job);
                }
                continue;
            }
            let step = if m.switched {
                if engine.extent_location(i) == m.dest {
                    // Switched already (a confirmation to retry).
                    Ok(())
                } else {
                    engine.switch_move(i)
                }
            } else {
                engine.begin_move(i, &m.dest)
            };
            match step {
                Ok(()) => {
                    if self.confirm(m.job, &[]) {
                        done.insert((m.job, m.switched));
                        tracing::info!(extent = i, job = m.job, switched = m.switched,
                            to = %m.dest.target, "moving copy: confirmed");
                    }
                }
                Err(err) if m.switched || engine.move_failed(i) => {
                    // The new extent missed writes from this host.
                    tracing::warn!(extent = i, job = m.job, error = %err,
                        "the new extent failed here; telling the control plane");
                    if self.report_move_failed(m.job) {
                        done.insert((m.job, m.switched));
                    }
                }
                Err(err) => {
                    tracing::warn!(extent = i, job = m.job, error = %err,
                        "cannot write the new extent yet; the job waits");
                }
            }
        }
        done.retain(|(j, _)| view.moving.iter().any(|m| m.job == *j));
    }

    /// Moves the engine to the view's write epoch, then confirms it
    /// (`PUT …/epoch`) once every write the engine tagged lower has
    /// completed; at open too, so the control plane counts a freshly
    /// opened engine. With `write_hold` the engine holds new writes
    /// first and confirms `held: true`; once a view clears the hold it
    /// admits them again. `confirmed` is the highest epoch taken (or
    /// answered 404: the attachment is gone, nothing to confirm to);
    /// `holding`, whether the engine was told to hold and not yet to
    /// release. False: to be retried (the engine's drain timed out, or the
    /// control plane did not take it).
    fn apply_epoch(&self, view: &CopyView, confirmed: &mut u32, holding: &mut bool) -> bool {
        if *holding && !view.write_hold {
            // Before any new epoch: the writes held are admitted (and
            // drained by the raise below, if there is one).
            self.engine.release_writes();
            *holding = false;
        }
        let epoch = view.write_epoch;
        if epoch == 0 || epoch <= *confirmed {
            return true;
        }
        let switched = if view.write_hold {
            // Held from the call on, whatever it answers.
            *holding = true;
            self.engine.hold_writes(epoch).inspect(|&held| {
                if !held {
                    // The hold at this epoch ended on its own: that
                    // barrier is over.
                    *holding = false;
                }
            })
        } else {
            self.engine.set_write_epoch(epoch).map(|()| false)
        };
        let held = match switched {
            Ok(held) => held,
            Err(err) => {
                tracing::warn!(epoch, error = %err,
                    "cannot move to the new write epoch yet; retrying");
                return false;
            }
        };
        let body = EpochBody {
            session: self.session,
            epoch,
            held,
        };
        match put(&self.cp, &format!("{}/epoch", self.base), &body) {
            Ok(()) => {
                tracing::info!(epoch, held, "write epoch confirmed");
                *confirmed = epoch;
                true
            }
            Err(e) if e.status() == Some(404) => {
                tracing::info!(epoch, "the attachment is gone; write epoch not confirmed");
                *confirmed = epoch;
                true
            }
            Err(e) => {
                tracing::warn!(epoch, error = %e, "confirming the write epoch failed; retrying");
                false
            }
        }
    }

    fn report_move_failed(&self, job: u64) -> bool {
        let path = format!("{}/sync/{job}", self.base);
        let body = SyncBody {
            session: self.session,
            missed_regions: None,
            failed: true,
        };
        match put(&self.cp, &path, &body) {
            Ok(()) => true,
            Err(e) if e.status() == Some(404) => true,
            Err(e) => {
                tracing::warn!(job, error = %e, "reporting the failed new extent failed; retrying");
                false
            }
        }
    }

    fn confirm(&self, job: u64, regions: &[u32]) -> bool {
        let path = format!("{}/sync/{job}", self.base);
        let body = SyncBody {
            session: self.session,
            missed_regions: Some(regions.to_vec()),
            failed: false,
        };
        match put(&self.cp, &path, &body) {
            Ok(()) => true,
            Err(e) if e.status() == Some(404) => {
                // The job is over; the next view says how.
                true
            }
            Err(e) => {
                tracing::warn!(job, error = %e, "confirming mirroring failed; retrying");
                false
            }
        }
    }

    /// Hands over what each stale copy missed from this session (call once
    /// the volume takes no more writes). Tries a few times: a record that
    /// does not arrive is treated as lost (a full copy later), never as
    /// empty.
    pub fn hand_over(&self) {
        let _s = tracing::info_span!("follow", volume = %self.volume_id).entered();
        let mut extents: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for i in 0..self.engine.extents() {
            if let Some(m) = self.engine.missed_regions(i) {
                extents.insert(i.to_string(), m.regions);
            }
        }
        let body = MissedBody {
            session: self.session,
            extents,
        };
        let path = format!("{}/missed", self.base);
        for attempt in 0..FOLLOW_HAND_OVER_TRIES_MAX {
            match put(&self.cp, &path, &body) {
                Ok(()) => return,
                Err(e) => {
                    tracing::warn!(attempt, error = %e, "handing over missed regions failed");
                    std::thread::sleep(FOLLOW_RETRY);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};
    use std::collections::{HashMap, VecDeque};
    use std::sync::Mutex;

    const UUID: &str = "0b5e1f9a-6c1d-4c55-9d0e-2f8a3b7c1d42";
    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:1";
    const BASE: &str =
        "/v1/volumes/0b5e1f9a-6c1d-4c55-9d0e-2f8a3b7c1d42/attachments/nqn.2014-08.org.nvmexpress%3Auuid%3A1";
    const SESSION: u64 = 77;

    type Answer = Result<(u16, Vec<u8>), String>;

    /// A control plane in memory: GETs answer from a script (once it is
    /// spent, the watcher is stopped), PUTs answer 204 unless a path has
    /// answers queued; every call is recorded.
    #[derive(Default)]
    struct FakeCp {
        gets: Mutex<VecDeque<Answer>>,
        puts: Mutex<HashMap<String, VecDeque<Answer>>>,
        calls: Mutex<Vec<(String, String, Value)>>,
        stop: Arc<AtomicBool>,
    }

    impl FakeCp {
        /// GETs answer with `views`, each made a whole attachment.
        fn new(views: &[Value]) -> Arc<FakeCp> {
            let cp = FakeCp::default();
            for v in views {
                cp.gets
                    .lock()
                    .unwrap()
                    .push_back(Ok((200, attachment(v).to_string().into_bytes())));
            }
            Arc::new(cp)
        }

        fn answer_put(&self, path: &str, a: Answer) {
            let mut puts = self.puts.lock().unwrap();
            puts.entry(path.to_owned()).or_default().push_back(a);
        }

        fn calls(&self) -> Vec<(String, String, Value)> {
            self.calls.lock().unwrap().clone()
        }

        fn puts_to(&self, suffix: &str) -> Vec<Value> {
            let path = format!("{BASE}{suffix}");
            self.calls()
                .into_iter()
                .filter(|(m, p, _)| m == "PUT" && *p == path)
                .map(|(_, _, b)| b)
                .collect()
        }
    }

    impl ControlPlane for FakeCp {
        fn get(&self, path: &str, timeout: Duration) -> Answer {
            assert_eq!(timeout, FOLLOW_GET_TIMEOUT);
            let call = ("GET".to_owned(), path.to_owned(), Value::Null);
            self.calls.lock().unwrap().push(call);
            self.gets.lock().unwrap().pop_front().unwrap_or_else(|| {
                self.stop.store(true, Ordering::Relaxed);
                Err("script over".into())
            })
        }

        fn put_json(&self, path: &str, body: &Value) -> Answer {
            let call = ("PUT".to_owned(), path.to_owned(), body.clone());
            self.calls.lock().unwrap().push(call);
            let mut puts = self.puts.lock().unwrap();
            let queued = puts.get_mut(path).and_then(VecDeque::pop_front);
            queued.unwrap_or(Ok((204, Vec::new())))
        }
    }

    /// An engine in memory with the state changes of [`Volume`]'s copy
    /// calls; the calls that change something are recorded.
    #[derive(Debug)]
    struct FakeEngine(Mutex<EngineState>);

    #[derive(Debug)]
    struct EngineState {
        states: Vec<CopyState>,
        missed: Vec<Vec<u32>>,
        location: Vec<PlanExtent>,
        incoming: Vec<Option<PlanExtent>>,
        leaving: Vec<bool>,
        move_failed: Vec<bool>,
        /// begin_move's destination strays.
        dest_fails: bool,
        size: u64,
        /// grow fails this many times before it takes the plan.
        grow_fails: u32,
        /// The write epoch, and how many times set_write_epoch fails (its
        /// drain timed out) before it takes one.
        epoch: u32,
        epoch_fails: u32,
        /// Writes held (hold_writes called, release_writes not yet), and
        /// the epoch whose hold is over already (it ended on its own).
        held: bool,
        hold_over: u32,
        calls: Vec<String>,
    }

    fn place(target: &str, copy: u8) -> PlanExtent {
        PlanExtent {
            target: target.into(),
            addr: "127.0.0.1:4420".parse().unwrap(),
            rdma_addr: None,
            subsystem_nqn: format!("nqn.2026-11.io.nvpool:{target}"),
            nsid: 1,
            device: "d0".into(),
            offset: 0,
            length: 1 << 20,
            member: 0,
            row: 0,
            copy,
        }
    }

    impl FakeEngine {
        fn new(states: &[CopyState]) -> Arc<FakeEngine> {
            let n = states.len();
            Arc::new(FakeEngine(Mutex::new(EngineState {
                states: states.to_vec(),
                missed: vec![Vec::new(); n],
                location: (0..n).map(|i| place("t0", i as u8)).collect(),
                incoming: vec![None; n],
                leaving: vec![false; n],
                move_failed: vec![false; n],
                dest_fails: false,
                size: 1 << 20,
                grow_fails: 0,
                epoch: 0,
                epoch_fails: 0,
                held: false,
                hold_over: 0,
                calls: Vec::new(),
            })))
        }

        fn with<T>(&self, f: impl FnOnce(&mut EngineState) -> T) -> T {
            f(&mut self.0.lock().unwrap())
        }

        fn calls(&self) -> Vec<String> {
            self.with(|s| s.calls.clone())
        }
    }

    impl Engine for FakeEngine {
        fn extents(&self) -> usize {
            self.with(|s| s.states.len())
        }
        fn copy_state(&self, index: usize) -> CopyState {
            self.with(|s| s.states[index])
        }
        fn begin_sync(&self, index: usize) -> Result<MissedRegions, Error> {
            self.with(|s| {
                s.calls.push(format!("begin_sync {index}"));
                let regions = match s.states[index] {
                    CopyState::Ok => Vec::new(),
                    _ => s.missed[index].clone(),
                };
                s.states[index] = CopyState::Syncing;
                Ok(MissedRegions {
                    regions,
                    complete: true,
                })
            })
        }
        fn finish_sync(&self, index: usize) {
            self.with(|s| {
                s.calls.push(format!("finish_sync {index}"));
                if s.states[index] == CopyState::Syncing {
                    s.states[index] = CopyState::Ok;
                    s.missed[index].clear();
                }
            })
        }
        fn abort_sync(&self, index: usize) {
            self.with(|s| {
                s.calls.push(format!("abort_sync {index}"));
                if s.states[index] == CopyState::Syncing {
                    s.states[index] = CopyState::Failed;
                    s.missed[index].clear();
                }
            })
        }
        fn mark_failed(&self, index: usize) {
            self.with(|s| {
                s.calls.push(format!("mark_failed {index}"));
                if s.states[index] != CopyState::Failed {
                    s.states[index] = CopyState::Failed;
                    s.missed[index].clear();
                }
            })
        }
        fn missed_regions(&self, index: usize) -> Option<MissedRegions> {
            self.with(|s| {
                (s.states[index] == CopyState::Failed).then(|| MissedRegions {
                    regions: s.missed[index].clone(),
                    complete: true,
                })
            })
        }
        fn begin_move(&self, index: usize, dest: &PlanExtent) -> Result<(), Error> {
            self.with(|s| {
                s.calls
                    .push(format!("begin_move {index} to {}", dest.target));
                if s.dest_fails {
                    s.move_failed[index] = true;
                    return Err(Error::Invalid("the destination failed".into()));
                }
                s.incoming[index] = Some(dest.clone());
                Ok(())
            })
        }
        fn switch_move(&self, index: usize) -> Result<(), Error> {
            self.with(|s| {
                s.calls.push(format!("switch_move {index}"));
                let dest = s.incoming[index]
                    .take()
                    .ok_or_else(|| Error::Invalid("not moving".into()))?;
                s.location[index] = dest;
                s.leaving[index] = s.states[index] != CopyState::Failed;
                s.states[index] = CopyState::Ok;
                Ok(())
            })
        }
        fn end_move(&self, index: usize) {
            self.with(|s| {
                if std::mem::take(&mut s.leaving[index]) {
                    s.calls.push(format!("end_move {index}"));
                }
            })
        }
        fn abort_move(&self, index: usize) {
            self.with(|s| {
                s.move_failed[index] = false;
                if s.incoming[index].take().is_some() {
                    s.calls.push(format!("abort_move {index}"));
                }
            })
        }
        fn move_failed(&self, index: usize) -> bool {
            self.with(|s| s.move_failed[index])
        }
        fn extent_location(&self, index: usize) -> PlanExtent {
            self.with(|s| s.location[index].clone())
        }
        fn size(&self) -> u64 {
            self.with(|s| s.size)
        }
        fn grow(&self, plan: &ConnectionPlan) -> Result<bool, Error> {
            self.with(|s| {
                s.calls.push(format!("grow {}", plan.size_bytes));
                if s.grow_fails > 0 {
                    s.grow_fails -= 1;
                    return Err(Error::Invalid("a new target is down".into()));
                }
                let grown = plan.size_bytes > s.size;
                s.size = plan.size_bytes;
                Ok(grown)
            })
        }
        fn set_write_epoch(&self, epoch: u32) -> Result<(), Error> {
            self.with(|s| {
                s.calls.push(format!("set_write_epoch {epoch}"));
                if s.epoch_fails > 0 {
                    s.epoch_fails -= 1;
                    return Err(Error::Invalid("older writes still in flight".into()));
                }
                s.epoch = s.epoch.max(epoch);
                Ok(())
            })
        }
        fn hold_writes(&self, epoch: u32) -> Result<bool, Error> {
            self.with(|s| {
                s.calls.push(format!("hold_writes {epoch}"));
                s.epoch = s.epoch.max(epoch);
                s.held = epoch != s.hold_over;
                if s.epoch_fails > 0 {
                    s.epoch_fails -= 1;
                    return Err(Error::Invalid("older writes still in flight".into()));
                }
                Ok(s.held)
            })
        }
        fn release_writes(&self) {
            self.with(|s| {
                s.calls.push("release_writes".into());
                s.held = false;
            })
        }
    }

    fn watcher(cp: &Arc<FakeCp>, engine: &Arc<FakeEngine>) -> Watcher<Arc<FakeCp>> {
        Watcher::with_engine(
            cp.clone(),
            &UUID.parse().unwrap(),
            HOST,
            engine.clone(),
            SESSION,
            cp.stop.clone(),
        )
    }

    /// An attachment as the control plane sends it: `fields` over one of
    /// a 1 MiB volume with every copy in sync.
    fn attachment(fields: &Value) -> Value {
        let mut a = json!({"volume": UUID, "host_nqn": HOST, "state": "attached",
                           "created_ms": 0, "failed_extents": [], "plan": plan_of(1 << 20)});
        let a_fields = a.as_object_mut().unwrap();
        a_fields.extend(fields.as_object().unwrap().clone());
        a
    }

    fn view(v: Value) -> CopyView {
        serde_json::from_value::<AttachmentView>(attachment(&v))
            .unwrap()
            .copies
    }

    fn gets(cp: &FakeCp) -> Vec<String> {
        cp.calls()
            .into_iter()
            .filter(|(m, _, _)| m == "GET")
            .map(|(_, p, _)| p)
            .collect()
    }

    #[test]
    fn paths_escape_the_host_nqn() {
        assert_eq!(
            segment("nqn.2014-08.org.nvmexpress:uuid:ab"),
            "nqn.2014-08.org.nvmexpress%3Auuid%3Aab"
        );
        assert_eq!(segment("a b/c"), "a%20b%2Fc");
        assert_eq!(attachment_path(&UUID.parse().unwrap(), HOST), BASE);
    }

    #[test]
    fn the_view_at_open_says_which_copies_start_stale_syncing_or_moving() {
        let v = view(json!({
            "failed_extents": [1, 3],
            "syncing": [{"extent": 3, "job": 7}],
            "moving": [{"extent": 0, "job": 9, "dest": place("t2", 0), "switched": true}],
            "revision": 4,
        }));
        assert_eq!(v.stale_at_open(), [1]);
        assert_eq!(v.syncing_at_open(), [3]);
        assert_eq!(
            v.moving_at_open(),
            [MovingCopy {
                extent: 0,
                dest: place("t2", 0),
                switched: true
            }]
        );
        let plan = json!({
            "volume": UUID, "name": "v", "host_nqn": HOST, "size_bytes": 1 << 20,
            "block_bytes": 4096, "extent_bytes": 1 << 20,
            "layout": {"type": "raid1", "copies": 2},
            "extents": [place("t0", 0), place("t1", 1)],
        });
        let a = json!({ "plan": plan, "revision": 4, "failed_extents": [1], "status": "ok" });
        let cp = FakeCp::new(&[a]);
        let a = read_attachment(&cp, &UUID.parse().unwrap(), HOST).unwrap();
        assert_eq!(gets(&cp), [BASE]);
        assert_eq!(a.plan.extents.len(), 2);
        assert_eq!(a.copies.stale_at_open(), [1]);
        assert_eq!(a.copies.revision, 4);

        let cp = FakeCp::new(&[]);
        let gone = json!({"kind": "not_found", "message": "not attached"});
        cp.gets
            .lock()
            .unwrap()
            .push_back(Ok((404, gone.to_string().into_bytes())));
        let e = read_attachment(&cp, &UUID.parse().unwrap(), HOST).unwrap_err();
        assert_eq!(e.status(), Some(404));
        assert_eq!(
            e.to_string(),
            "the control plane answered HTTP 404 (not_found): not attached"
        );
    }

    #[test]
    fn a_copy_being_filled_is_mirrored_confirmed_then_read() {
        let cp = FakeCp::new(&[
            json!({"failed_extents": [1], "syncing": [{"extent": 1, "job": 7}], "revision": 2}),
            json!({"failed_extents": [], "syncing": [], "revision": 3}),
        ]);
        let engine = FakeEngine::new(&[CopyState::Ok, CopyState::Failed]);
        engine.with(|s| s.missed[1] = vec![3, 5]);
        let w = watcher(&cp, &engine);
        w.run(view(json!({"failed_extents": [1], "revision": 1})));

        assert_eq!(engine.calls(), ["begin_sync 1", "finish_sync 1"]);
        assert_eq!(
            cp.puts_to("/sync/7"),
            [json!({"session": SESSION, "missed_regions": [3, 5]})]
        );
        assert_eq!(
            gets(&cp),
            [1, 2, 3].map(|r| format!("{BASE}?after_revision={r}"))
        );
        assert_eq!(engine.copy_state(1), CopyState::Ok);
    }

    fn plan_of(size: u64) -> Value {
        json!({
            "volume": UUID, "name": "v", "host_nqn": HOST, "size_bytes": size,
            "block_bytes": 4096, "extent_bytes": 1 << 20,
            "layout": {"type": "concat"},
            "extents": (0..size >> 20).map(|r| {
                let mut e = place("t0", 0);
                e.row = r as u32;
                e
            }).collect::<Vec<_>>(),
        })
    }

    #[test]
    fn a_grown_plan_grows_the_engine_then_the_device_once() {
        let cp = FakeCp::new(&[
            // Unchanged size: nothing to do.
            json!({"plan": plan_of(1 << 20), "revision": 2}),
            // Grown: the engine refuses once (a target down), then takes it.
            json!({"plan": plan_of(3 << 20), "revision": 3}),
            json!({"plan": plan_of(3 << 20), "revision": 3}),
            json!({"plan": plan_of(3 << 20), "revision": 4}),
        ]);
        let engine = FakeEngine::new(&[CopyState::Ok]);
        engine.with(|s| s.grow_fails = 1);
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let seen = sizes.clone();
        let w = watcher(&cp, &engine).on_grown(Box::new(move |b| seen.lock().unwrap().push(b)));
        w.run(view(json!({"revision": 1})));

        assert_eq!(engine.calls(), ["grow 3145728", "grow 3145728"]);
        assert_eq!(*sizes.lock().unwrap(), [3 << 20], "the device grows once");
        assert_eq!(engine.size(), 3 << 20);
        // The refused growth was asked again at the same revision.
        assert_eq!(
            gets(&cp),
            [1, 2, 2, 3, 4].map(|r| format!("{BASE}?after_revision={r}"))
        );
    }

    #[test]
    fn a_confirmation_is_retried_until_the_control_plane_takes_it() {
        let job_view = json!({"failed_extents": [1], "syncing": [{"extent": 1, "job": 7}],
                              "revision": 2});
        let cp = FakeCp::new(&[job_view.clone(), job_view.clone(), job_view]);
        let refused = json!({"kind": "unavailable", "message": "store busy"});
        cp.answer_put(&format!("{BASE}/sync/7"), Err("connection refused".into()));
        cp.answer_put(
            &format!("{BASE}/sync/7"),
            Ok((503, refused.to_string().into_bytes())),
        );
        let engine = FakeEngine::new(&[CopyState::Ok, CopyState::Failed]);
        watcher(&cp, &engine).run(view(json!({"failed_extents": [1], "revision": 1})));

        // Unreachable, refused, taken; then the job is left alone.
        assert_eq!(cp.puts_to("/sync/7").len(), 3);
        assert_eq!(
            engine.calls(),
            ["begin_sync 1", "begin_sync 1", "begin_sync 1"]
        );
    }

    #[test]
    fn a_job_that_ends_unsynced_or_a_copy_stale_elsewhere_stops_its_use() {
        let cp = FakeCp::new(&[
            json!({"failed_extents": [1, 2], "syncing": [], "revision": 2}),
            // A job over that this host never heard of (404): done.
            json!({"failed_extents": [1, 2], "syncing": [{"extent": 1, "job": 8}],
                   "revision": 3}),
        ]);
        cp.answer_put(&format!("{BASE}/sync/8"), Ok((404, b"{}".to_vec())));
        let engine = FakeEngine::new(&[
            CopyState::Ok,
            CopyState::Syncing,
            CopyState::Ok,
            CopyState::Ok,
        ]);
        // Opened mirroring to copy 1 for job 7: confirmed again (drained).
        let opened = json!({"failed_extents": [1], "syncing": [{"extent": 1, "job": 7}],
                            "revision": 1});
        watcher(&cp, &engine).run(view(opened));

        assert_eq!(
            engine.calls(),
            [
                "begin_sync 1",
                // Job 7 ended without sync; another host found 2 stale.
                "abort_sync 1",
                "mark_failed 2",
                // Job 8 mirrors to 1 again.
                "begin_sync 1",
            ]
        );
        assert_eq!(cp.puts_to("/sync/7").len(), 1);
        assert_eq!(cp.puts_to("/sync/8").len(), 1);
        assert_eq!(engine.copy_state(2), CopyState::Failed);
    }

    #[test]
    fn a_moving_copy_is_written_then_read_then_let_go() {
        let dest = place("t2", 1);
        let mv =
            |switched: bool| json!({"extent": 1, "job": 9, "dest": dest, "switched": switched});
        let cp = FakeCp::new(&[
            json!({"moving": [mv(false)], "revision": 2}),
            json!({"moving": [mv(true)], "revision": 3}),
            json!({"moving": [], "revision": 4}),
        ]);
        let engine = FakeEngine::new(&[CopyState::Ok, CopyState::Ok]);
        watcher(&cp, &engine).run(view(json!({"revision": 1})));

        assert_eq!(
            engine.calls(),
            ["begin_move 1 to t2", "switch_move 1", "end_move 1"]
        );
        let confirm = json!({"session": SESSION, "missed_regions": []});
        assert_eq!(cp.puts_to("/sync/9"), [confirm.clone(), confirm]);
        assert_eq!(engine.extent_location(1), place("t2", 1));
    }

    #[test]
    fn a_new_extent_that_fails_here_fails_the_move() {
        let mv = json!({"extent": 0, "job": 9, "dest": place("t2", 0), "switched": false});
        let cp = FakeCp::new(&[json!({"moving": [mv], "revision": 2})]);
        let engine = FakeEngine::new(&[CopyState::Ok, CopyState::Ok]);
        engine.with(|s| s.dest_fails = true);
        watcher(&cp, &engine).run(view(json!({"revision": 1})));

        assert_eq!(engine.calls(), ["begin_move 0 to t2"]);
        assert_eq!(
            cp.puts_to("/sync/9"),
            [json!({"session": SESSION, "missed_regions": null, "failed": true})]
        );
    }

    #[test]
    fn the_session_is_registered_and_missed_regions_handed_over_at_stop() {
        let cp = FakeCp::new(&[]);
        let engine = FakeEngine::new(&[CopyState::Ok, CopyState::Failed, CopyState::Failed]);
        engine.with(|s| {
            s.missed[1] = vec![2, 4];
        });
        let w = watcher(&cp, &engine);
        w.register(5);
        w.hand_over();

        assert_eq!(
            cp.puts_to("/session"),
            [json!({"session": SESSION, "revision": 5})]
        );
        // Every stale copy is listed, the ones that missed nothing too.
        assert_eq!(
            cp.puts_to("/missed"),
            [json!({"session": SESSION, "extents": {"1": [2, 4], "2": []}})]
        );
    }

    #[test]
    fn a_rising_write_epoch_switches_the_engine_then_is_confirmed() {
        let cp = FakeCp::new(&[
            // A copy change at the same epoch: nothing to confirm again.
            json!({"write_epoch": 2, "revision": 2}),
            json!({"write_epoch": 3, "revision": 3}),
        ]);
        let refused = json!({"kind": "unavailable", "message": "store busy"});
        cp.answer_put(
            &format!("{BASE}/epoch"),
            Ok((503, refused.to_string().into_bytes())),
        );
        let engine = FakeEngine::new(&[CopyState::Ok]);
        watcher(&cp, &engine).run(view(json!({"write_epoch": 2, "revision": 1})));

        // Confirmed at open (refused once, so asked again), then after the
        // engine moved to epoch 3.
        assert_eq!(
            engine.calls(),
            [
                "set_write_epoch 2",
                "set_write_epoch 2",
                "set_write_epoch 3"
            ]
        );
        assert_eq!(engine.with(|s| s.epoch), 3);
        let confirm = |e: u32| json!({"session": SESSION, "epoch": e});
        assert_eq!(cp.puts_to("/epoch"), [confirm(2), confirm(2), confirm(3)]);
        // The refused confirmation was retried without a long-poll.
        assert_eq!(
            gets(&cp),
            [1, 2, 3].map(|r| format!("{BASE}?after_revision={r}"))
        );
    }

    #[test]
    fn a_write_epoch_is_confirmed_only_once_the_engine_switched() {
        let cp = FakeCp::new(&[json!({"write_epoch": 5, "revision": 2})]);
        // The attachment went away meanwhile: 404 ends the retries.
        cp.answer_put(&format!("{BASE}/epoch"), Ok((404, b"{}".to_vec())));
        let engine = FakeEngine::new(&[CopyState::Ok]);
        engine.with(|s| s.epoch_fails = 1);
        // Opened untagged: nothing to confirm at open.
        watcher(&cp, &engine).run(view(json!({"revision": 1})));

        assert_eq!(engine.calls(), ["set_write_epoch 5", "set_write_epoch 5"]);
        // No confirmation while older writes were in flight; one 404.
        assert_eq!(
            cp.puts_to("/epoch"),
            [json!({"session": SESSION, "epoch": 5})]
        );
    }

    /// The epoch confirmations sent, as (epoch, held), each of this
    /// session (`held` may be left out of the body when false).
    fn confirmations(cp: &FakeCp) -> Vec<(u32, bool)> {
        cp.puts_to("/epoch")
            .into_iter()
            .map(|b| {
                let b: EpochBody = serde_json::from_value(b).unwrap();
                assert_eq!(b.session, SESSION);
                (b.epoch, b.held)
            })
            .collect()
    }

    #[test]
    fn a_write_hold_holds_confirms_held_keeps_polling_and_releases_when_cleared() {
        let cp = FakeCp::new(&[
            json!({"write_epoch": 3, "write_hold": true, "revision": 2}),
            // Still held (another change): neither held again nor released.
            json!({"write_epoch": 3, "write_hold": true, "revision": 3}),
            json!({"write_epoch": 3, "write_hold": false, "revision": 4}),
            // A plain raise afterwards: today's switch.
            json!({"write_epoch": 4, "revision": 5}),
        ]);
        let engine = FakeEngine::new(&[CopyState::Ok]);
        watcher(&cp, &engine).run(view(json!({"write_epoch": 2, "revision": 1})));

        assert_eq!(
            engine.calls(),
            [
                "set_write_epoch 2",
                "hold_writes 3",
                "release_writes",
                "set_write_epoch 4"
            ]
        );
        assert!(!engine.with(|s| s.held));
        assert_eq!(confirmations(&cp), [(2, false), (3, true), (4, false)]);
        // The long-poll went on while held: the release came on it.
        assert_eq!(
            gets(&cp),
            [1, 2, 3, 4, 5].map(|r| format!("{BASE}?after_revision={r}"))
        );
    }

    #[test]
    fn a_hold_is_retried_until_drained_and_one_over_already_is_confirmed_unheld() {
        // Opened held (the barrier was on at open); its drain times out
        // once. Then a second barrier whose hold had ended on its own by
        // the time the engine got to it.
        let cp = FakeCp::new(&[
            json!({"write_epoch": 5, "write_hold": false, "revision": 2}),
            json!({"write_epoch": 6, "write_hold": true, "revision": 3}),
            json!({"write_epoch": 6, "write_hold": false, "revision": 4}),
        ]);
        let engine = FakeEngine::new(&[CopyState::Ok]);
        engine.with(|s| {
            s.epoch_fails = 1;
            s.hold_over = 6;
        });
        let open = view(json!({"write_epoch": 5, "write_hold": true, "revision": 1}));
        assert!(open.write_hold);
        watcher(&cp, &engine).run(open);

        assert_eq!(
            engine.calls(),
            [
                "hold_writes 5",
                "hold_writes 5",
                "release_writes",
                "hold_writes 6"
            ]
        );
        assert_eq!(confirmations(&cp), [(5, true), (6, false)]);
        assert!(!engine.with(|s| s.held));
    }

    #[test]
    fn copies_failed_at_io_time_are_reported() {
        let cp = FakeCp::new(&[]);
        let (on_failed, reporter) =
            spawn_failure_reporter(cp.clone(), &UUID.parse().unwrap(), HOST).unwrap();
        for index in [3, 1, 3] {
            on_failed(&ExtentFailure {
                index,
                row: 0,
                member: 0,
                copy: 1,
                target: "t1".into(),
                addr: "127.0.0.1:4420".parse().unwrap(),
                subsystem_nqn: "nqn.2026-11.io.nvpool:t1".into(),
                nsid: 1,
                error: crate::error::IoError::ControllerLost,
                member_lost: false,
            });
        }
        // The reporter ends once the callback is gone and all is sent.
        drop(on_failed);
        reporter.join().unwrap();

        let reported: BTreeSet<u64> = cp
            .puts_to("/failed-extents")
            .iter()
            .flat_map(|b| b["failed_extents"].as_array().unwrap().clone())
            .map(|e| e.as_u64().unwrap())
            .collect();
        assert_eq!(reported, BTreeSet::from([1, 3]));
    }
}
