//! The host's part of resync, in the volume's serving process: it tells the
//! control plane which session serves the volume, follows the volume's copy
//! changes by long-polling its attachment, brings the volume engine's copies
//! along (mirror to a copy being filled, read from it once it is in sync,
//! stop when a job fails), confirms mirroring, and hands over what stale
//! copies missed when it stops.
//!
//! ```text
//!  open ── PUT …/session {session, revision}
//!  loop ── GET …/attachments/{host}?after_revision=R   (≤ 25 s each)
//!    ├─ syncing copy, engine Failed  ─► begin_sync (connect, mirror, drain)
//!    │                                  ─► PUT …/sync/{job} {missed regions}
//!    ├─ copy no longer stale         ─► finish_sync (reads may use it)
//!    ├─ stale, engine mirroring      ─► abort_sync (the job failed)
//!    └─ stale, engine Ok             ─► mark_failed (another host found it stale)
//!  stop ── PUT …/missed {extent: regions}
//! ```
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
//! The data path never waits on any of this: the engine applies a change
//! between requests, and a control plane that cannot be reached only
//! delays healing.

use crate::client::{segment, Client};
use nvpool_control::resync::{HostMove, SyncingCopy};
use nvpool_initiator::volume::{CopyState, MovingCopy, Volume};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Wait after a failed call to the control plane before the next one.
const RETRY: Duration = Duration::from_secs(1);

/// The copy fields of `GET …/attachments/{host}`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CopyView {
    #[serde(default)]
    pub failed_extents: Vec<u32>,
    #[serde(default)]
    pub syncing: Vec<SyncingCopy>,
    #[serde(default)]
    pub moving: Vec<HostMove>,
    #[serde(default)]
    pub revision: u64,
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

/// A random session id for this serving process.
pub fn new_session() -> u64 {
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_err()
    {
        // Unique enough without randomness: pid and time.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        return t ^ u64::from(std::process::id()).rotate_left(32);
    }
    u64::from_le_bytes(b)
}

/// Follows the copies of one attached volume.
#[derive(Debug)]
pub struct Watcher {
    client: Client,
    base: String,
    session: u64,
    volume: Arc<Volume>,
    stop: Arc<AtomicBool>,
}

impl Watcher {
    /// Registers the session (retrying until the control plane answers or
    /// `stop` is set) and returns the watcher to run on a thread.
    pub fn new(
        client: &Client,
        uuid: &nvpool_control::Uuid,
        host: &str,
        volume: Arc<Volume>,
        session: u64,
        stop: Arc<AtomicBool>,
    ) -> Watcher {
        Watcher {
            client: client.clone(),
            base: format!("/v1/volumes/{uuid}/attachments/{}", segment(host)),
            session,
            volume,
            stop,
        }
    }

    /// Tells the control plane this session serves the volume, as of
    /// `revision`. Retries until it answers or the watcher is stopped.
    pub fn register(&self, revision: u64) {
        let body = serde_json::json!({ "session": self.session, "revision": revision });
        let path = format!("{}/session", self.base);
        while !self.stop.load(Ordering::Relaxed) {
            match self.client.put_no_content(&path, &body) {
                Ok(()) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "registering the serving session failed; retrying");
                    std::thread::sleep(RETRY);
                }
            }
        }
    }

    /// Follows the attachment until stopped, applying every copy change.
    pub fn run(&self, mut view: CopyView) {
        // (job, switched) pairs confirmed; a session that opened with a
        // move counts as having confirmed its state then.
        let mut moves: BTreeSet<(u64, bool)> =
            view.moving.iter().map(|m| (m.job, m.switched)).collect();
        let mut confirmed: BTreeSet<u64> = BTreeSet::new();
        // Copies opened mirroring mirror for the jobs the view named.
        let mut mirroring_for: BTreeMap<u32, u64> =
            view.syncing.iter().map(|s| (s.extent, s.job)).collect();
        loop {
            self.apply_moves(&view, &mut moves);
            self.apply(&view, &mut confirmed, &mut mirroring_for);
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            let path = format!("{}?after_revision={}", self.base, view.revision);
            match self.client.get::<CopyView>(&path) {
                Ok(v) => view = v,
                Err(e) => {
                    if self.stop.load(Ordering::Relaxed) {
                        return;
                    }
                    tracing::warn!(error = %e, "watching the attachment failed; retrying");
                    std::thread::sleep(RETRY);
                }
            }
        }
    }

    fn apply(
        &self,
        view: &CopyView,
        confirmed: &mut BTreeSet<u64>,
        mirroring_for: &mut BTreeMap<u32, u64>,
    ) {
        let failed: BTreeSet<u32> = view.failed_extents.iter().copied().collect();
        let syncing: BTreeMap<u32, u64> = view.syncing.iter().map(|s| (s.extent, s.job)).collect();
        let moving: BTreeSet<u32> = view.moving.iter().map(|m| m.extent).collect();
        for i in 0..self.volume.plan().extents.len() {
            let e = i as u32;
            if moving.contains(&e) {
                // apply_moves owns it until the move is over.
                continue;
            }
            let state = self.volume.copy_state(i);
            match (syncing.get(&e), failed.contains(&e), state) {
                (Some(&job), _, _) => {
                    if confirmed.contains(&job) {
                        continue;
                    }
                    if state == CopyState::Ok {
                        // Another host found it stale before we heard:
                        // stop reading it before mirroring again.
                        self.volume.mark_failed(i);
                    } else if state == CopyState::Syncing && mirroring_for.get(&e) != Some(&job) {
                        // Mirroring for an earlier job we did not see end:
                        // writes issued for it may still be in flight, so
                        // switch again (and drain) for this one.
                        self.volume.abort_sync(i);
                    }
                    match self.volume.begin_sync(i) {
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
                    self.volume.finish_sync(i);
                    tracing::info!(extent = i, "copy in sync; reads use it again");
                }
                (None, true, CopyState::Syncing) => {
                    // The job failed: stop writing, record from now on.
                    self.volume.abort_sync(i);
                    tracing::warn!(extent = i, "copy job over without sync; copy stale again");
                }
                (None, true, CopyState::Ok) => {
                    // Another host found the copy stale: never read it.
                    self.volume.mark_failed(i);
                    tracing::warn!(extent = i, "copy is stale (found by another host)");
                }
                _ => {}
            }
        }
        confirmed.retain(|j| syncing.values().any(|x| x == j));
        mirroring_for.retain(|e, _| self.volume.copy_state(*e as usize) == CopyState::Syncing);
    }

    /// Brings the engine's moving copies along: write the new extent, read
    /// it once switched, let the other one go when the job is over.
    /// `done` holds the (job, switched) states confirmed.
    fn apply_moves(&self, view: &CopyView, done: &mut BTreeSet<(u64, bool)>) {
        let listed: BTreeSet<u32> = view.moving.iter().map(|m| m.extent).collect();
        for i in 0..self.volume.plan().extents.len() {
            if !listed.contains(&(i as u32)) {
                // Over: done (stop writing the old extent) or failed (stop
                // writing the new one). Both are no-ops without a move.
                self.volume.end_move(i);
                self.volume.abort_move(i);
            }
        }
        for m in &view.moving {
            let i = m.extent as usize;
            if done.contains(&(m.job, m.switched)) {
                if !m.switched && self.volume.move_failed(i) {
                    tracing::warn!(extent = i, job = m.job, "the new extent failed here");
                    self.report_move_failed(m.job);
                }
                continue;
            }
            let step = if m.switched {
                if self.volume.extent_location(i) == m.dest {
                    // Switched already (a confirmation to retry).
                    Ok(())
                } else {
                    self.volume.switch_move(i)
                }
            } else {
                self.volume.begin_move(i, &m.dest)
            };
            match step {
                Ok(()) => {
                    if self.confirm(m.job, &[]) {
                        done.insert((m.job, m.switched));
                        tracing::info!(extent = i, job = m.job, switched = m.switched,
                            to = %m.dest.target, "moving copy: confirmed");
                    }
                }
                Err(err) if m.switched || self.volume.move_failed(i) => {
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

    fn report_move_failed(&self, job: u64) -> bool {
        let path = format!("{}/sync/{job}", self.base);
        let body =
            serde_json::json!({ "session": self.session, "missed_regions": null, "failed": true });
        match self.client.put_no_content(&path, &body) {
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
        let body = serde_json::json!({ "session": self.session, "missed_regions": regions });
        match self.client.put_no_content(&path, &body) {
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
        let mut extents: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for i in 0..self.volume.plan().extents.len() {
            if let Some(m) = self.volume.missed_regions(i) {
                extents.insert(i.to_string(), m.regions);
            }
        }
        let body = serde_json::json!({ "session": self.session, "extents": extents });
        let path = format!("{}/missed", self.base);
        for attempt in 0..3 {
            match self.client.put_no_content(&path, &body) {
                Ok(()) => return,
                Err(e) => {
                    tracing::warn!(attempt, error = %e, "handing over missed regions failed");
                    std::thread::sleep(RETRY);
                }
            }
        }
    }
}
