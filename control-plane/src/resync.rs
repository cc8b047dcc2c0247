//! Copies that heal: the record of what each stale copy missed, the copy
//! jobs that bring it back in sync, and what hosts say about both.
//!
//! **One mechanism.** A copy job fills a destination extent from an in-sync
//! copy of the same (row, member) while hosts keep writing the volume.
//! Today the destination is a stale copy itself (resync in place); moving
//! or replacing a copy is the same job with another destination. Its steps,
//! in this order (docs/ARCHITECTURE.md C17 says why the order is safe):
//!
//! ```text
//!  arming ──► mirroring ──────────────────────────► copying ──► done
//!   │ the destination target    │ every attached host     │ the target's
//!   │ records host writes to    │ writes to the copy,     │ copier fills the
//!   │ the extent (its guard);   │ drained its older       │ regions; the copy
//!   │ the source extent is      │ writes and confirmed    │ leaves the failed
//!   │ exported to the target    │ with its missed map     │ set in one txn
//!   └──────────── any failure or timeout: failed, the copy stays stale ──┘
//! ```
//!
//! **What a stale copy missed.** While a copy is stale every host writing
//! the volume records which regions ([`RESYNC_REGION_BYTES`]) it wrote.
//! The control plane merges those maps into [`Missed::regions`]; a map that
//! was lost (a host's serving process died, a forced detach) makes it
//! `None`, and the copy is then copied whole. A host owes its map from the
//! moment the copy failed (or it started serving) until it hands the map
//! over: when it confirms mirroring, or when it stops serving.
//!
//! **Revision.** Hosts learn of jobs by long-polling their attachment on
//! [`CopyState::revision`], bumped whenever a host must act: a job starts
//! mirroring, ends, or fails, or the volume grew.
//!
//! Stored at `/copy-state/{uuid}`, one record per volume, next to the
//! volume's [`FailedCopies`] (the copies never to be read).

use crate::attach::{attach_keys as ak, AttachmentState, Export, FailedCopies};
pub use crate::families::FamilyMember;
use crate::limits::{COPY_HISTORY_MAX, ID_BYTES_MAX};
use crate::model::{encode, DeviceRef, Extent, ModelError, Uuid, Volume};
use crate::plan::{PlanExtent, RESYNC_REGION_BYTES};
use crate::state::{unchanged, Cluster, Snapshot, StateError, Txn};
use crate::store::{Condition, Op};
pub use nvpool_api::names::VERIFIER_NQN_PREFIX;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Store key prefix of the copy-state records.
pub const COPY_STATE: &str = "/copy-state/";

pub fn copy_state_key(volume: &Uuid) -> String {
    format!("{COPY_STATE}{volume}")
}

/// Host NQN under which a target's copier reads source extents.
pub fn copier_nqn(target: &str) -> String {
    format!("nqn.2026-11.io.nvpool:copier:{target}")
}

/// Regions of an extent of `extent_bytes`.
pub fn region_count(extent_bytes: u64) -> u32 {
    extent_bytes.div_ceil(RESYNC_REGION_BYTES) as u32
}

/// What kind of copy a job makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CopyKind {
    /// A stale copy back in place: only the regions it missed.
    ResyncPartial,
    /// A stale copy back in place, every byte (what it missed is unknown).
    ResyncFull,
    /// A copy whose target did not come back in time, rebuilt whole on
    /// another device and swapped in.
    Replace,
    /// A copy moved whole to another device (drain, rebalance) while the
    /// old one stays in service until the swap.
    Move,
}

impl CopyKind {
    /// Whether the copy goes to a new extent.
    pub fn moves(&self) -> bool {
        matches!(self, CopyKind::Replace | CopyKind::Move)
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            CopyKind::ResyncPartial => "resync-partial",
            CopyKind::ResyncFull => "resync-full",
            CopyKind::Replace => "replace",
            CopyKind::Move => "move",
        }
    }
}

/// Where a running job stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Recorded; the destination target is being told to guard the extent
    /// and the source exported to it. Hosts do not know yet.
    Arming,
    /// Hosts are told to write to the copy; waiting for every one of them
    /// to confirm.
    Mirroring,
    /// The destination target's copier is filling the regions.
    Copying,
    /// A new extent (replace, move) holds every byte: hosts read it and
    /// keep writing the old one too; waiting for every host to confirm
    /// before the old one is let go.
    Switching,
}

/// A copy under way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyJob {
    /// Unique within the volume, never reused.
    pub id: u64,
    /// The copy being filled: index into the volume's extents.
    pub extent: u32,
    /// The in-sync copy read from: index into the volume's extents.
    pub source: u32,
    pub kind: CopyKind,
    pub state: JobState,
    /// Regions to copy, fixed when copying starts; `None`: all.
    pub regions: Option<Vec<u32>>,
    /// Hosts that mirror to the copy and drained their older writes.
    pub confirmed: BTreeSet<String>,
    pub started_ms: u64,
    /// When it entered its current state (for timeouts).
    pub state_ms: u64,
    /// The namespace of the source extent in the copier's subsystem on the
    /// source's target.
    pub copier_nsid: u32,
    pub bytes_total: u64,
    /// As last polled from the destination target.
    pub bytes_copied: u64,
    /// Replace and move: the new extent, swapped in for `extent` when the
    /// job completes; `None`: the copy is filled in place.
    pub dest: Option<Extent>,
    /// The NSID of `dest` in each attached host's subsystem on its target.
    pub nsids: BTreeMap<String, u32>,
    /// When the copier started (0: not yet).
    pub copy_started_ms: u64,
    /// A host that could not write the new extent (the job fails).
    pub failed_by: Option<String>,
    /// The copy was reported failed while hosts were switching to `dest`:
    /// it may be `dest` that failed, so it stays stale after the swap.
    pub failed_while_switching: bool,
    /// Replace and move of a thin copy: the snapshot trees that move with
    /// it, oldest first, copied while arming before the live copy
    /// ([`crate::families`]; stored format 5).
    pub family: Vec<FamilyMember>,
    /// Members of `family` copied so far: the next one to copy.
    pub family_done: u32,
}

impl CopyJob {
    /// The extent the copier fills: the new one, or the copy itself.
    pub fn dest_extent<'a>(&'a self, v: &'a Volume) -> Option<&'a Extent> {
        self.dest
            .as_ref()
            .or_else(|| v.extents.get(self.extent as usize))
    }

    /// Whether `dest` is a new extent (replace, move).
    pub fn moves(&self) -> bool {
        self.dest.is_some()
    }

    /// The family member being copied: only while arming.
    pub fn member_in_progress(&self) -> Option<&FamilyMember> {
        if self.state != JobState::Arming {
            return None;
        }
        self.family.get(self.family_done as usize)
    }

    /// The history entry of this job, ended at `now` (`error`: why it failed).
    fn record(&self, now: u64, error: Option<&str>) -> CopyRecord {
        CopyRecord {
            id: self.id,
            extent: self.extent,
            source: self.source,
            kind: self.kind,
            started_ms: self.started_ms,
            copy_started_ms: self.copy_started_ms,
            to: self.dest.as_ref().map(|d| d.device_ref().to_string()),
            finished_ms: now,
            bytes_total: self.bytes_total,
            // A completed copy copied everything it had to.
            bytes_copied: if error.is_none() {
                self.bytes_total
            } else {
                self.bytes_copied
            },
            error: error.map(str::to_owned),
        }
    }
}

/// A finished copy, for `nvpool volume history`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyRecord {
    pub id: u64,
    pub extent: u32,
    pub source: u32,
    pub kind: CopyKind,
    pub started_ms: u64,
    /// When the copier started (0: it never did).
    pub copy_started_ms: u64,
    pub finished_ms: u64,
    pub bytes_total: u64,
    pub bytes_copied: u64,
    /// `None`: it completed; otherwise why it failed.
    pub error: Option<String>,
    /// Replace and move: the device the copy went to (`target/device`).
    pub to: Option<String>,
}

/// What is known of the writes a stale copy missed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Missed {
    pub since_ms: u64,
    /// Regions written since the copy failed, as far as every host has
    /// told; `None` when some host's record was lost: copy it all.
    pub regions: Option<BTreeSet<u32>>,
    /// Hosts whose record of this copy is not merged yet.
    pub owed: BTreeSet<String>,
}

/// Per volume: resync bookkeeping (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyState {
    pub volume: Uuid,
    pub revision: u64,
    /// Host NQN → the session of its serving process.
    pub sessions: BTreeMap<String, u64>,
    /// Stale extent → what it missed.
    pub missed: BTreeMap<u32, Missed>,
    pub jobs: Vec<CopyJob>,
    /// Oldest first, at most `COPY_HISTORY_MAX`.
    pub history: Vec<CopyRecord>,
    pub next_job: u64,
}

/// Format 4's [`CopyJob`] (before families).
#[derive(Deserialize)]
#[cfg_attr(test, derive(Serialize))]
struct CopyJobV4 {
    id: u64,
    extent: u32,
    source: u32,
    kind: CopyKind,
    state: JobState,
    regions: Option<Vec<u32>>,
    confirmed: BTreeSet<String>,
    started_ms: u64,
    state_ms: u64,
    copier_nsid: u32,
    bytes_total: u64,
    bytes_copied: u64,
    dest: Option<Extent>,
    nsids: BTreeMap<String, u32>,
    copy_started_ms: u64,
    failed_by: Option<String>,
    failed_while_switching: bool,
}

impl From<CopyJobV4> for CopyJob {
    fn from(j: CopyJobV4) -> CopyJob {
        CopyJob {
            id: j.id,
            extent: j.extent,
            source: j.source,
            kind: j.kind,
            state: j.state,
            regions: j.regions,
            confirmed: j.confirmed,
            started_ms: j.started_ms,
            state_ms: j.state_ms,
            copier_nsid: j.copier_nsid,
            bytes_total: j.bytes_total,
            bytes_copied: j.bytes_copied,
            dest: j.dest,
            nsids: j.nsids,
            copy_started_ms: j.copy_started_ms,
            failed_by: j.failed_by,
            failed_while_switching: j.failed_while_switching,
            family: Vec::new(),
            family_done: 0,
        }
    }
}

/// Formats 1 to 4's [`CopyState`]: jobs without families.
#[derive(Deserialize)]
#[cfg_attr(test, derive(Serialize))]
struct CopyStateV4 {
    volume: Uuid,
    revision: u64,
    sessions: BTreeMap<String, u64>,
    missed: BTreeMap<u32, Missed>,
    jobs: Vec<CopyJobV4>,
    history: Vec<CopyRecord>,
    next_job: u64,
}

impl crate::model::Stored for CopyState {
    fn decode_older(format: u8, body: &[u8]) -> postcard::Result<(CopyState, &[u8])> {
        let _ = format; // unchanged from format 1 to 4
        let (old, rest) = postcard::take_from_bytes::<CopyStateV4>(body)?;
        let cs = CopyState {
            volume: old.volume,
            revision: old.revision,
            sessions: old.sessions,
            missed: old.missed,
            jobs: old.jobs.into_iter().map(CopyJob::from).collect(),
            history: old.history,
            next_job: old.next_job,
        };
        Ok((cs, rest))
    }
}

impl CopyState {
    pub fn new(volume: Uuid) -> CopyState {
        CopyState {
            volume,
            revision: 0,
            sessions: BTreeMap::new(),
            missed: BTreeMap::new(),
            jobs: Vec::new(),
            history: Vec::new(),
            next_job: 1,
        }
    }

    pub fn job(&self, id: u64) -> Option<&CopyJob> {
        self.jobs.iter().find(|j| j.id == id)
    }

    pub fn job_on(&self, extent: u32) -> Option<&CopyJob> {
        self.jobs.iter().find(|j| j.extent == extent)
    }

    /// Copies hosts must write to: in-place jobs past arming.
    pub fn syncing(&self) -> Vec<SyncingCopy> {
        self.jobs
            .iter()
            .filter(|j| j.state != JobState::Arming && !j.moves())
            .map(|j| SyncingCopy {
                extent: j.extent,
                job: j.id,
            })
            .collect()
    }

    /// `host` owes its record of every stale copy from now on (it serves
    /// the volume), except copies it already mirrors to.
    fn owe_from_now(&mut self, host: &str) {
        let mirrored: BTreeSet<u32> = self
            .jobs
            .iter()
            .filter(|j| !j.moves() && j.confirmed.contains(host))
            .map(|j| j.extent)
            .collect();
        for (e, m) in self.missed.iter_mut() {
            if !mirrored.contains(e) {
                m.owed.insert(host.to_owned());
            }
        }
    }

    /// `host`'s records are lost: what it wrote is unknown.
    fn lose_records_of(&mut self, host: &str) {
        for m in self.missed.values_mut() {
            if m.owed.remove(host) {
                m.regions = None;
            }
        }
    }

    fn merge(&mut self, host: &str, extent: u32, regions: &[u32]) {
        if let Some(m) = self.missed.get_mut(&extent) {
            if m.owed.remove(host) {
                if let Some(r) = &mut m.regions {
                    r.extend(regions.iter().copied());
                }
            }
        }
    }

    /// Whether a job on copy `extent` failed less than `retry_ms` ago.
    pub fn failed_recently(&self, extent: u32, now: u64, retry_ms: u64) -> bool {
        self.history.iter().rev().any(|r| {
            r.extent == extent && r.error.is_some() && now.saturating_sub(r.finished_ms) < retry_ms
        })
    }

    fn push_history(&mut self, r: CopyRecord) {
        self.history.push(r);
        let excess = self.history.len().saturating_sub(COPY_HISTORY_MAX);
        self.history.drain(..excess);
    }
}

// What hosts are told about the copies they write but do not read is
// shared with them (`nvpool-layout`).
pub use nvpool_layout::copies::{HostMove, SyncingCopy};

/// What a host is told about its attachment's copies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostCopies {
    /// Never read (stale, or syncing).
    pub failed_extents: Vec<u32>,
    /// Write to these (a subset of `failed_extents`).
    pub syncing: Vec<SyncingCopy>,
    /// Copies moving to new extents.
    pub moving: Vec<HostMove>,
    pub revision: u64,
}

impl Snapshot {
    pub fn copy_state(&self, volume: &Uuid) -> CopyState {
        self.copy_states
            .get(volume)
            .map(|v| v.value.clone())
            .unwrap_or_else(|| CopyState::new(*volume))
    }

    /// The condition that the copy-state record is as read, and the op
    /// that writes `next`.
    pub(crate) fn copy_state_txn(&self, next: &CopyState) -> (Condition, Op) {
        let key = copy_state_key(&next.volume);
        let version = self.copy_states.get(&next.volume).map(|v| v.version);
        (unchanged(&key, version), Op::Put(key, encode(next)))
    }

    /// Hosts attached to `volume` that may write it (any state but
    /// detaching; verifiers only read).
    pub fn writers_of(&self, volume: &Uuid) -> BTreeSet<String> {
        self.attachments_of(volume)
            .into_iter()
            .filter(|a| a.value.state != AttachmentState::Detaching)
            .filter(|a| !a.value.host_nqn.starts_with(VERIFIER_NQN_PREFIX))
            .map(|a| a.value.host_nqn.clone())
            .collect()
    }

    /// The volume's stale copies.
    pub fn failed_set(&self, volume: &Uuid) -> BTreeSet<u32> {
        self.failed_copies
            .get(volume)
            .map(|f| f.value.extents.iter().copied().collect())
            .unwrap_or_default()
    }

    /// The condition that the volume's failed copies are as read, and the
    /// op that makes them `extents` (deleting the record when empty).
    pub(crate) fn failed_copies_txn(
        &self,
        volume: &Uuid,
        extents: BTreeSet<u32>,
    ) -> (Condition, Op) {
        let key = ak::failed_copies(volume);
        let cond = unchanged(&key, self.failed_copies.get(volume).map(|f| f.version));
        let op = if extents.is_empty() {
            Op::Delete(key)
        } else {
            Op::Put(
                key,
                encode(&FailedCopies {
                    volume: *volume,
                    extents: extents.into_iter().collect(),
                }),
            )
        };
        (cond, op)
    }

    /// The new extents of replace and move jobs under way, and the new
    /// trees of their snapshot families, with their volumes: allocated
    /// like the volumes' own extents (and freed with the volume).
    pub fn job_dests(&self) -> impl Iterator<Item = (&Uuid, &Extent)> + '_ {
        self.copy_states.iter().flat_map(|(u, cs)| {
            cs.value.jobs.iter().flat_map(move |j| {
                j.dest
                    .iter()
                    .chain(j.family.iter().map(|m| &m.tree))
                    .map(move |d| (u, d))
            })
        })
    }

    /// Exports the running jobs need on `target`: each source extent there,
    /// to the copier of the destination's target.
    pub fn copier_exports(&self, target: &str) -> Vec<Export> {
        let mut out = Vec::new();
        for (uuid, cs) in &self.copy_states {
            let Some(v) = self.volumes.get(uuid) else {
                continue;
            };
            for j in &cs.value.jobs {
                if v.value
                    .extents
                    .get(j.source as usize)
                    .map(|e| e.target.as_str())
                    != Some(target)
                {
                    continue;
                }
                if let Some(x) = copier_export(&v.value, j) {
                    out.push(x);
                }
                // The snapshot tree being copied (its source is a tree of
                // the source copy, on the same target).
                if let (Some(m), Some(d)) = (j.member_in_progress(), &j.dest) {
                    out.push(crate::families::member_export(m, &d.target));
                }
            }
        }
        out
    }
}

/// The export through which the destination's target reads `job`'s source.
pub fn copier_export(v: &Volume, job: &CopyJob) -> Option<Export> {
    let src = v.extents.get(job.source as usize)?;
    let dst = job.dest_extent(v)?;
    let host = copier_nqn(&dst.target);
    Some(Export {
        subsystem_nqn: crate::attach::host_subsystem_nqn(&host),
        host_nqn: host,
        nsid: job.copier_nsid,
        device: src.device.clone(),
        offset: src.offset,
        length: src.length,
    })
}

fn check_extent(v: &Volume, extent: u32) -> Result<(), StateError> {
    if extent as usize >= v.extents.len() {
        return Err(ModelError::Invalid(format!(
            "extent {extent} does not exist; the volume has {}",
            v.extents.len()
        ))
        .into());
    }
    Ok(())
}

/// A copy a job could start on now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub volume: Uuid,
    pub extent: u32,
    pub source: u32,
    /// `ResyncFull` for a stale copy in place (partial or full is decided
    /// when the job is created), `Replace` or `Move` for a new extent.
    pub kind: CopyKind,
    /// Replace and move: the device the new extent must go to (a planned
    /// rebalance); `None`: wherever the placement rules say.
    pub to: Option<DeviceRef>,
}

impl Cluster {
    /// Tells the hosts serving `volume` to read their attachment again
    /// (its plan changed: grown). Moves the revision their long-polls
    /// wait on.
    pub fn announce_plan_change(&self, volume: &Uuid) -> Result<(), StateError> {
        self.change_copy_state(volume, |_, cs, _, _| {
            cs.revision += 1;
            Ok(Some(()))
        })
        .map(|_| ())
    }

    /// Runs `change` on the volume's copy-state record until it commits;
    /// `change` may add conditions and ops (other records) of its own and
    /// returns `None` to leave everything as it is.
    pub(crate) fn change_copy_state<T>(
        &self,
        volume: &Uuid,
        change: impl Fn(
            &Snapshot,
            &mut CopyState,
            &mut Vec<Condition>,
            &mut Vec<Op>,
        ) -> Result<Option<T>, StateError>,
    ) -> Result<Option<T>, StateError> {
        self.transact(|s| {
            if !s.volumes.contains_key(volume) {
                return Err(StateError::VolumeNotFound(volume.to_string()));
            }
            let mut cs = s.copy_state(volume);
            let (mut conds, mut ops) = (Vec::new(), Vec::new());
            let Some(t) = change(s, &mut cs, &mut conds, &mut ops)? else {
                return Ok(Txn::Done(None));
            };
            let (c, o) = s.copy_state_txn(&cs);
            conds.push(c);
            ops.push(o);
            Ok(Txn::Commit(conds, ops, Some(t)))
        })
    }

    /// The volume's copy-state record (a fresh one if none is stored).
    pub fn copy_state(&self, volume: &Uuid) -> Result<CopyState, StateError> {
        let read = self.read("copy state", &copy_state_key(volume))?;
        Ok(read.map_or_else(|| CopyState::new(*volume), |r| r.value))
    }

    /// What `host` must know of the volume's copies.
    pub fn host_copies(&self, volume: &Uuid, host: &str) -> Result<HostCopies, StateError> {
        let s = self.snapshot()?;
        let a = s
            .attachments
            .get(&(*volume, host.to_owned()))
            .ok_or_else(|| StateError::NotAttached {
                volume: *volume,
                host: host.to_owned(),
            })?;
        let cs = s.copy_state(volume);
        let failed: BTreeSet<u32> = a
            .value
            .failed_extents
            .iter()
            .chain(
                s.failed_copies
                    .get(volume)
                    .iter()
                    .flat_map(|f| &f.value.extents),
            )
            .copied()
            .collect();
        let mut moving = Vec::new();
        for j in &cs.jobs {
            let (Some(d), Some(&nsid)) = (&j.dest, j.nsids.get(host)) else {
                continue;
            };
            if j.state == JobState::Arming {
                continue;
            }
            let t = s
                .targets
                .get(&d.target)
                .ok_or_else(|| StateError::TargetNotFound(d.target.clone()))?;
            moving.push(HostMove {
                extent: j.extent,
                job: j.id,
                dest: PlanExtent {
                    target: d.target.clone(),
                    addr: t.value.addr,
                    rdma_addr: t.value.rdma_addr,
                    subsystem_nqn: crate::attach::host_subsystem_nqn(host),
                    nsid,
                    device: d.device.clone(),
                    offset: d.offset,
                    length: d.length,
                    member: d.member,
                    row: d.row,
                    copy: d.copy,
                },
                switched: j.state == JobState::Switching,
            });
        }
        Ok(HostCopies {
            failed_extents: failed.into_iter().collect(),
            syncing: cs.syncing(),
            moving,
            revision: cs.revision,
        })
    }

    /// A host's serving process started with session `session`, having
    /// read the copy state at `revision`. A different earlier session of
    /// the same host ended without handing over its records: they are lost.
    /// Jobs the host saw at open (it opened their copies mirroring) count
    /// as confirmed by it.
    pub fn register_session(
        &self,
        volume: &Uuid,
        host: &str,
        session: u64,
        revision: u64,
    ) -> Result<(), StateError> {
        self.change_copy_state(volume, |s, cs, _, _| {
            if !s.attachments.contains_key(&(*volume, host.to_owned())) {
                return Err(StateError::NotAttached {
                    volume: *volume,
                    host: host.to_owned(),
                });
            }
            match cs.sessions.get(host) {
                Some(&old) if old == session => return Ok(None),
                Some(_) => cs.lose_records_of(host),
                None => {}
            }
            cs.sessions.insert(host.to_owned(), session);
            if revision >= cs.revision {
                for j in cs.jobs.iter_mut() {
                    if j.state != JobState::Arming {
                        j.confirmed.insert(host.to_owned());
                    }
                }
            }
            cs.owe_from_now(host);
            Ok(Some(()))
        })
        .map(|_| ())
    }

    /// A host's serving process stops and hands over what each stale copy
    /// missed from it (`extents`: extent → regions; a stale copy absent
    /// from the map missed nothing from this host).
    pub fn hand_over_missed(
        &self,
        volume: &Uuid,
        host: &str,
        session: u64,
        extents: &BTreeMap<u32, Vec<u32>>,
    ) -> Result<(), StateError> {
        self.change_copy_state(volume, |s, cs, _, _| {
            let v = &s.volumes[volume].value;
            for &e in extents.keys() {
                check_extent(v, e)?;
            }
            if cs.sessions.get(host) != Some(&session) {
                // Not the session we know: its records belong to nothing
                // we track (or were already declared lost).
                return Ok(None);
            }
            let stale: Vec<u32> = cs.missed.keys().copied().collect();
            for e in stale {
                let regions = extents.get(&e).map(Vec::as_slice).unwrap_or(&[]);
                cs.merge(host, e, regions);
            }
            cs.sessions.remove(host);
            Ok(Some(()))
        })
        .map(|_| ())
    }

    /// A host mirrors to job `job`'s copy and has drained its older
    /// writes; `missed` is what the copy missed from it (`None`: unknown).
    pub fn confirm_sync(
        &self,
        volume: &Uuid,
        host: &str,
        job: u64,
        session: u64,
        missed: Option<&[u32]>,
    ) -> Result<bool, StateError> {
        self.change_copy_state(volume, |_, cs, _, _| {
            let Some(j) = cs.job(job) else {
                return Ok(Some(false));
            };
            let confirms = matches!(j.state, JobState::Mirroring | JobState::Switching);
            if !confirms || j.confirmed.contains(host) {
                return Ok(Some(j.state != JobState::Arming));
            }
            let (extent, moves) = (j.extent, j.moves());
            if cs.sessions.get(host) != Some(&session) {
                // A session the control plane does not know (started
                // before a lost registration): its record cannot be
                // trusted to cover everything.
                cs.lose_records_of(host);
                cs.sessions.insert(host.to_owned(), session);
            }
            // What a stale copy missed matters to a copy filled in place; a
            // new extent is copied whole.
            match missed {
                _ if moves => {}
                Some(r) => cs.merge(host, extent, r),
                None => {
                    if let Some(m) = cs.missed.get_mut(&extent) {
                        m.owed.remove(host);
                        m.regions = None;
                    }
                }
            }
            if let Some(j) = cs.jobs.iter_mut().find(|j| j.id == job) {
                j.confirmed.insert(host.to_owned());
            }
            Ok(Some(true))
        })
        .map(|r| r.unwrap_or(false))
    }

    /// Stale copies that could start a job now: no job on them, their
    /// target online, an in-sync copy of the same row and member online to
    /// copy from, and no failed attempt on them in the last `retry_ms`.
    pub fn resync_candidates(&self, retry_ms: u64) -> Result<Vec<Candidate>, StateError> {
        let s = self.snapshot()?;
        let now = self.now();
        let online = |t: &str| {
            s.targets.get(t).is_some_and(|t| {
                t.value.health(now, self.config().heartbeat_timeout_ms)
                    == crate::model::Health::Online
            })
        };
        let mut out = Vec::new();
        for (uuid, f) in &s.failed_copies {
            let Some(v) = s.volumes.get(uuid) else {
                continue;
            };
            let v = &v.value;
            let cs = s.copy_state(uuid);
            let failed: BTreeSet<u32> = f.value.extents.iter().copied().collect();
            let copies = u32::from(v.layout.copies());
            for &e in &f.value.extents {
                let Some(ext) = v.extents.get(e as usize) else {
                    continue;
                };
                if cs.job_on(e).is_some() || !online(&ext.target) {
                    continue;
                }
                if cs.failed_recently(e, now, retry_ms) {
                    continue;
                }
                let group = e / copies * copies;
                let source = (group..group + copies).find(|&c| {
                    !failed.contains(&c)
                        && cs.job_on(c).is_none()
                        && v.extents.get(c as usize).is_some_and(|x| online(&x.target))
                });
                if let Some(source) = source {
                    out.push(Candidate {
                        volume: *uuid,
                        extent: e,
                        source,
                        kind: CopyKind::ResyncFull,
                        to: None,
                    });
                }
            }
        }
        Ok(out)
    }

    /// Records a new job (arming). In place: on a stale copy, `None` when
    /// it has a job already or is no longer stale. Replace and move: places
    /// the new extent (on `c.to` when given, else by the placement rules),
    /// which stays allocated from now on, and gives it an NSID for every
    /// attached host; `None` when the copy has a job already. Serialised
    /// with allocations so copier NSIDs, allocated across volumes per
    /// (source target, destination target), never collide.
    pub fn create_job(&self, c: &Candidate) -> Result<Option<CopyJob>, StateError> {
        self.transact_allocation(|s| {
            let Some(v) = s.volumes.get(&c.volume) else {
                return Ok(Txn::Done(None));
            };
            let v = &v.value;
            check_extent(v, c.extent)?;
            check_extent(v, c.source)?;
            let stale = s
                .failed_copies
                .get(&c.volume)
                .is_some_and(|f| f.value.extents.contains(&c.extent));
            let mut cs = s.copy_state(&c.volume);
            let moves = c.kind.moves();
            if cs.job_on(c.extent).is_some() || (!moves && !stale) {
                return Ok(Txn::Done(None));
            }
            // Copying into a tree while a snapshot of it seals is not built
            // (design/thin-snapshots.md T7): the job waits for the snapshot.
            let sealing = s
                .snapshots_of(&c.volume)
                .iter()
                .any(|r| r.value.state == crate::snapshots::SnapshotState::Creating);
            if sealing {
                return Ok(Txn::Done(None));
            }
            let mut conds = Vec::new();
            let mut ops = Vec::new();
            let now = self.now();
            let mut nsids = BTreeMap::new();
            let dest = if moves {
                let d = self.place_new_copy(s, v, &cs, c)?;
                for a in s.attachments_of(&c.volume) {
                    let host = a.value.host_nqn.as_str();
                    let used: BTreeSet<u32> = s
                        .host_exports(host)
                        .remove(&d.target)
                        .unwrap_or_default()
                        .iter()
                        .map(|x| x.nsid)
                        .collect();
                    nsids.insert(host.to_owned(), crate::attach::lowest_free(&used));
                    // The host's record guards its NSIDs (as attach does).
                    let hkey = ak::host(host);
                    match s.hosts.get(host) {
                        Some(h) => {
                            conds.push(Condition::VersionIs(hkey.clone(), h.version));
                            let mut next = h.value.clone();
                            next.changes += 1;
                            ops.push(Op::Put(hkey, encode(&next)));
                        }
                        None => conds.push(Condition::Missing(hkey)),
                    }
                }
                Some(d)
            } else {
                None
            };
            let src_t = v.extents[c.source as usize].target.as_str();
            let dst_t = dest
                .as_ref()
                .unwrap_or(&v.extents[c.extent as usize])
                .target
                .clone();
            // NSIDs of the copier's subsystem on the source target in use.
            let mut used = BTreeSet::new();
            for (uuid, other) in &s.copy_states {
                let Some(ov) = s.volumes.get(uuid) else {
                    continue;
                };
                for j in &other.value.jobs {
                    let os = ov.value.extents.get(j.source as usize);
                    let od = j.dest_extent(&ov.value);
                    if os.is_some_and(|x| x.target == src_t)
                        && od.is_some_and(|x| x.target == dst_t)
                    {
                        used.insert(j.copier_nsid);
                        used.extend(j.family.iter().map(|m| m.copier_nsid));
                    }
                }
            }
            let mut next_nsid = || {
                let n = (1..).find(|n| !used.contains(n)).unwrap_or(1);
                used.insert(n);
                n
            };
            let nsid = next_nsid();
            // A thin copy's snapshot trees move with it (design T7).
            let family = match &dest {
                Some(d) => {
                    let mut a = self.allocator(s)?;
                    a.occupy(d)?;
                    crate::families::plan_family(s, &mut a, v, c.extent, c.source, d, next_nsid)?
                }
                None => Vec::new(),
            };
            let kind = if moves {
                c.kind
            } else {
                let missed = cs.missed.entry(c.extent).or_insert_with(|| Missed {
                    since_ms: now,
                    regions: None,
                    owed: BTreeSet::new(),
                });
                if missed.regions.is_some() {
                    CopyKind::ResyncPartial
                } else {
                    CopyKind::ResyncFull
                }
            };
            let job = CopyJob {
                id: cs.next_job,
                extent: c.extent,
                source: c.source,
                kind,
                state: JobState::Arming,
                regions: None,
                confirmed: BTreeSet::new(),
                started_ms: now,
                state_ms: now,
                copier_nsid: nsid,
                bytes_total: v.extent_bytes,
                bytes_copied: 0,
                copy_started_ms: 0,
                dest,
                nsids,
                failed_by: None,
                failed_while_switching: false,
                family,
                family_done: 0,
            };
            cs.next_job += 1;
            cs.jobs.push(job.clone());
            let (cond, op) = s.copy_state_txn(&cs);
            conds.push(cond);
            ops.push(op);
            Ok(Txn::Commit(conds, ops, Some(job)))
        })
    }

    /// Where a replace or move job's new extent goes: `c.to` when given
    /// (it must obey the placement rules), else where the rules put it.
    fn place_new_copy(
        &self,
        s: &Snapshot,
        v: &Volume,
        cs: &CopyState,
        c: &Candidate,
    ) -> Result<Extent, StateError> {
        let slot = c.extent as usize;
        let me = &v.extents[slot];
        // The row's other extents, and new extents of its jobs under way.
        let row: Vec<Extent> = v
            .extents
            .iter()
            .enumerate()
            .filter(|&(i, e)| i != slot && e.row == me.row)
            .map(|(_, e)| e.clone())
            .chain(
                cs.jobs
                    .iter()
                    .filter_map(|j| j.dest.clone())
                    .filter(|d| d.row == me.row),
            )
            .collect();
        let mut a = self.allocator(s)?;
        let placed = match &c.to {
            None => crate::rebalance::place_copy(&mut a, v, slot, &row),
            Some(to) => crate::rebalance::place_copy_on(&mut a, v, slot, &row, to),
        };
        placed.map_err(StateError::from)
    }

    /// Arming → mirroring: hosts are told (the revision moves).
    pub fn job_mirroring(&self, volume: &Uuid, job: u64) -> Result<bool, StateError> {
        let now = self.now();
        self.change_copy_state(volume, |_, cs, _, _| {
            let Some(j) = cs.jobs.iter_mut().find(|j| j.id == job) else {
                return Ok(None);
            };
            if j.state != JobState::Arming {
                return Ok(None);
            }
            j.state = JobState::Mirroring;
            j.state_ms = now;
            cs.revision += 1;
            Ok(Some(()))
        })
        .map(|r| r.is_some())
    }

    /// Family member `index` of an arming job is copied: the next one (or
    /// the live copy) is. Returns false when the job is gone, past arming,
    /// or past that member already.
    pub fn family_member_done(
        &self,
        volume: &Uuid,
        job: u64,
        index: u32,
    ) -> Result<bool, StateError> {
        self.change_copy_state(volume, |_, cs, _, _| {
            match cs.jobs.iter_mut().find(|j| j.id == job) {
                Some(j) if j.state == JobState::Arming && j.family_done == index => {
                    j.family_done += 1;
                    Ok(Some(()))
                }
                _ => Ok(None),
            }
        })
        .map(|r| r.is_some())
    }

    /// Mirroring → copying, once every host writing the volume confirmed.
    /// Fixes the regions to copy: what the copy missed, or all of it when
    /// that is unknown. Returns the job as started, or `None` if it must
    /// still wait (or is gone).
    pub fn job_copying(&self, volume: &Uuid, job: u64) -> Result<Option<CopyJob>, StateError> {
        let now = self.now();
        self.change_copy_state(volume, |s, cs, _, _| {
            let writers = s.writers_of(volume);
            let v = &s.volumes[volume].value;
            let Some(idx) = cs.jobs.iter().position(|j| j.id == job) else {
                return Ok(None);
            };
            let j = &cs.jobs[idx];
            if j.state != JobState::Mirroring || !writers.iter().all(|h| j.confirmed.contains(h)) {
                return Ok(None);
            }
            let extent = j.extent;
            let regions = match cs.missed.get(&extent) {
                // A new extent is copied whole.
                _ if j.moves() => None,
                // A host still owes its record: what it wrote is unknown.
                Some(m) if m.owed.iter().any(|h| !j.confirmed.contains(h)) => None,
                Some(m) => m.regions.clone(),
                None => None,
            };
            let total_regions = region_count(v.extent_bytes);
            let regions: Option<Vec<u32>> =
                regions.map(|r| r.into_iter().filter(|&i| i < total_regions).collect());
            let j = &mut cs.jobs[idx];
            if !j.moves() {
                j.kind = if regions.is_some() {
                    CopyKind::ResyncPartial
                } else {
                    CopyKind::ResyncFull
                };
            }
            j.copy_started_ms = now;
            j.bytes_total = match &regions {
                None => v.extent_bytes,
                Some(r) => r
                    .iter()
                    .map(|&i| {
                        let start = u64::from(i) * RESYNC_REGION_BYTES;
                        RESYNC_REGION_BYTES.min(v.extent_bytes - start)
                    })
                    .sum(),
            };
            j.regions = regions;
            j.state = JobState::Copying;
            j.state_ms = now;
            Ok(Some(j.clone()))
        })
    }

    /// Records how far a copying job got.
    pub fn job_progress(
        &self,
        volume: &Uuid,
        job: u64,
        bytes_copied: u64,
    ) -> Result<(), StateError> {
        self.change_copy_state(volume, |_, cs, _, _| {
            match cs.jobs.iter_mut().find(|j| j.id == job) {
                Some(j) if j.bytes_copied != bytes_copied => {
                    j.bytes_copied = bytes_copied;
                    Ok(Some(()))
                }
                _ => Ok(None),
            }
        })
        .map(|_| ())
    }

    /// Copying → switching, when the copier filled a new extent: hosts
    /// are told to read it (and keep writing the old one). Returns false
    /// when the job is not copying.
    pub fn job_switching(&self, volume: &Uuid, job: u64) -> Result<bool, StateError> {
        let now = self.now();
        self.change_copy_state(volume, |_, cs, _, _| {
            match cs.jobs.iter_mut().find(|j| j.id == job) {
                Some(j) if j.state == JobState::Copying && j.moves() => {
                    j.state = JobState::Switching;
                    j.state_ms = now;
                    j.bytes_copied = j.bytes_total;
                    j.confirmed.clear();
                    cs.revision += 1;
                    Ok(Some(()))
                }
                _ => Ok(None),
            }
        })
        .map(|r| r.is_some())
    }

    /// Whether every host writing the volume confirmed the job's current
    /// state (mirroring: it writes the copy; switching: it reads the new
    /// extent).
    pub fn job_confirmed(&self, volume: &Uuid, job: u64) -> Result<bool, StateError> {
        let s = self.snapshot()?;
        let cs = s.copy_state(volume);
        Ok(cs
            .job(job)
            .is_some_and(|j| s.writers_of(volume).iter().all(|h| j.confirmed.contains(h))))
    }

    /// A host could not write a moving copy's new extent: the job fails
    /// (the heal loop ends it). Returns false when there is no such job.
    pub fn job_failed_at_host(
        &self,
        volume: &Uuid,
        host: &str,
        job: u64,
    ) -> Result<bool, StateError> {
        self.change_copy_state(volume, |_, cs, _, _| {
            match cs.jobs.iter_mut().find(|j| j.id == job) {
                // Other hosts may read the new extent already: the swap
                // goes on, and the copy is stale after it.
                Some(j) if j.state == JobState::Switching => {
                    j.failed_while_switching = true;
                    j.confirmed.insert(host.to_owned());
                    cs.revision += 1;
                    Ok(Some(true))
                }
                Some(j) if j.failed_by.is_none() => {
                    j.failed_by = Some(host.to_owned());
                    Ok(Some(true))
                }
                Some(_) => Ok(Some(true)),
                None => Ok(None),
            }
        })
        .map(|r| r.unwrap_or(false))
    }

    /// Ends a job, in one transaction.
    ///
    /// Done, in place: the copy is in sync — it leaves the volume's failed
    /// copies and every attachment's failed list, so it is read again.
    /// Done, replace or move: the new extent takes the copy's place in the
    /// volume and each attachment takes its NSID; the old extent stays
    /// allocated, as a stale export of its target, until that target is
    /// reconciled (hosts that have not heard still write it).
    ///
    /// Failed: the copy stays as it was, and what it missed stays recorded
    /// (hosts owe their records again from now on, when they stop mirroring
    /// to it). A new extent stays allocated as a stale export of its target
    /// until that target is reconciled: hosts may still write it, and its
    /// copier may still run.
    pub fn finish_job(
        &self,
        volume: &Uuid,
        job: u64,
        error: Option<&str>,
    ) -> Result<Option<CopyRecord>, StateError> {
        let now = self.now();
        self.transact_allocation(|s| {
            let Some(vv) = s.volumes.get(volume) else {
                return Err(StateError::VolumeNotFound(volume.to_string()));
            };
            let v = &vv.value;
            let mut cs = s.copy_state(volume);
            let Some(idx) = cs.jobs.iter().position(|j| j.id == job) else {
                return Ok(Txn::Done(None));
            };
            let j = cs.jobs.remove(idx);
            let record = j.record(now, error);
            let (mut conds, mut ops) = (Vec::new(), Vec::new());
            // Exports that may outlive the records, by target.
            let mut leftover: BTreeMap<String, Vec<Export>> = BTreeMap::new();
            if error.is_none() {
                // A host that could not write the new extent while others
                // read it leaves it stale, what it missed unknown.
                let in_sync = !j.failed_while_switching;
                let mut failed = s.failed_set(volume);
                let changed = if in_sync {
                    cs.missed.remove(&j.extent);
                    failed.remove(&j.extent)
                } else {
                    cs.missed.insert(
                        j.extent,
                        Missed {
                            since_ms: now,
                            regions: None,
                            owed: BTreeSet::new(),
                        },
                    );
                    failed.insert(j.extent)
                };
                if changed {
                    let (c, o) = s.failed_copies_txn(volume, failed);
                    conds.push(c);
                    ops.push(o);
                }
                let slot = j.extent as usize;
                let old = v.extents[slot].clone();
                for a in s.attachments_of(volume) {
                    let host = a.value.host_nqn.as_str();
                    let key = ak::attachment(volume, host);
                    let mut next = a.value.clone();
                    if in_sync {
                        next.failed_extents.retain(|&e| e != j.extent);
                    }
                    if j.dest.is_some() {
                        let nsid = *j.nsids.get(host).ok_or_else(|| {
                            StateError::Inconsistent(format!(
                                "copy job {} of volume {volume} has no NSID for {host}",
                                j.id
                            ))
                        })?;
                        if let Some(n) = next.nsids.get_mut(slot) {
                            leftover
                                .entry(old.target.clone())
                                .or_default()
                                .push(crate::attach::export_of(host, &old, *n));
                            *n = nsid;
                        }
                    }
                    if next != a.value {
                        conds.push(Condition::VersionIs(key.clone(), a.version));
                        ops.push(Op::Put(key, encode(&next)));
                    }
                }
                if let Some(d) = &j.dest {
                    let mut next = v.clone();
                    next.extents[slot] = Extent {
                        member: old.member,
                        row: old.row,
                        copy: old.copy,
                        ..d.clone()
                    };
                    let vkey = crate::state::keys::volume(volume);
                    conds.push(Condition::VersionIs(vkey.clone(), vv.version));
                    ops.push(Op::Put(vkey, encode(&next)));
                    // Its snapshots' trees are the family's new ones now.
                    crate::families::move_family(
                        s,
                        volume,
                        &j,
                        (&old, &next.extents[slot]),
                        &mut conds,
                        &mut ops,
                        &mut leftover,
                    );
                    // A grain pool keeps the old extent's tree (and its
                    // place) until the target releases it.
                    if let Some(x) = s.freed_tree(&old) {
                        leftover.entry(old.target.clone()).or_default().push(x);
                    }
                    // The copier read the old extent through this.
                    if j.source == j.extent {
                        if let Some(x) = copier_export(v, &j) {
                            leftover.entry(old.target.clone()).or_default().push(x);
                        }
                    }
                }
            } else {
                // Hosts that mirrored stop when they hear of it and record
                // from then on; hosts that had not confirmed still owe.
                let hosts: Vec<String> = cs.sessions.keys().cloned().collect();
                if let Some(m) = cs.missed.get_mut(&j.extent) {
                    m.owed.extend(hosts);
                }
                if let Some(d) = &j.dest {
                    let xs = leftover.entry(d.target.clone()).or_default();
                    for (host, &nsid) in &j.nsids {
                        xs.push(crate::attach::export_of(host, d, nsid));
                    }
                    // Its copier writes it until the target drops the copy.
                    let copier = copier_nqn(&d.target);
                    xs.push(Export {
                        subsystem_nqn: crate::attach::host_subsystem_nqn(&copier),
                        host_nqn: copier,
                        nsid: 0,
                        device: d.device.clone(),
                        offset: d.offset,
                        length: d.length,
                    });
                }
                crate::families::free_family(s, &j, &mut leftover);
            }
            if j.state != JobState::Arming {
                cs.revision += 1;
            }
            cs.push_history(record.clone());
            for (target, xs) in leftover {
                let (c, o) = s.add_stale_exports(&target, xs);
                conds.push(c);
                ops.push(o);
            }
            let (c, o) = s.copy_state_txn(&cs);
            conds.push(c);
            ops.push(o);
            Ok(Txn::Commit(conds, ops, Some(record.clone())))
        })
    }

    /// Marks copy `extent` stale on an operator's word: it leaves service at
    /// once (hosts hear of it and stop reading it) and is copied whole, what
    /// it holds being unknown. Refused when its row has no other copy in
    /// sync; a copy already stale stays as it is.
    pub fn mark_stale(&self, volume: &Uuid, extent: u32) -> Result<(), StateError> {
        let now = self.now();
        self.change_copy_state(volume, |s, cs, conds, ops| {
            let v = &s.volumes[volume].value;
            check_extent(v, extent)?;
            let mut failed = s.failed_set(volume);
            if failed.contains(&extent) {
                return Ok(None);
            }
            let copies = u32::from(v.layout.copies());
            let group = extent / copies * copies;
            let others_in_sync = (group..group + copies)
                .filter(|&c| c != extent && !failed.contains(&c))
                .count();
            if others_in_sync == 0 {
                return Err(StateError::LastInSyncCopy {
                    volume: *volume,
                    extent,
                });
            }
            failed.insert(extent);
            let (c, o) = s.failed_copies_txn(volume, failed);
            conds.push(c);
            ops.push(o);
            cs.missed.insert(
                extent,
                Missed {
                    since_ms: now,
                    regions: None,
                    owed: BTreeSet::new(),
                },
            );
            cs.revision += 1;
            Ok(Some(()))
        })
        .map(|_| ())
    }

    /// Bookkeeping when copies fail: each newly stale copy starts a record
    /// of what it misses, owed by every host writing the volume; a job on a
    /// copy that failed again ends as failed. Called inside the failure
    /// report's transaction.
    pub(crate) fn on_copies_failed(
        s: &Snapshot,
        volume: &Uuid,
        failed: &[u32],
        now: u64,
    ) -> Option<(Condition, Op)> {
        let mut cs = s.copy_state(volume);
        let before = cs.clone();
        let writers = s.writers_of(volume);
        for &e in failed {
            let newly = !s
                .failed_copies
                .get(volume)
                .is_some_and(|f| f.value.extents.contains(&e));
            if let Some(idx) = cs.jobs.iter().position(|j| j.extent == e && !j.moves()) {
                let j = cs.jobs.remove(idx);
                cs.revision += 1;
                cs.push_history(j.record(now, Some("a host lost its path to the copy")));
            }
            // A move goes on: the new extent got every write. Once hosts
            // switch, the failed copy may be the new one: it stays stale.
            for j in cs.jobs.iter_mut() {
                if j.extent == e && j.state == JobState::Switching {
                    j.failed_while_switching = true;
                }
            }
            // A record kept from an earlier failure of this copy goes on
            // (a lost one stays lost).
            let m = cs.missed.entry(e).or_insert_with(|| Missed {
                since_ms: now,
                regions: Some(BTreeSet::new()),
                owed: BTreeSet::new(),
            });
            m.owed.extend(writers.iter().cloned());
            if newly {
                // Other hosts must stop reading it.
                cs.revision += 1;
            }
        }
        (cs != before).then(|| s.copy_state_txn(&cs))
    }

    /// Bookkeeping when a host's attachment goes: records it still owed
    /// are lost (a clean stop hands them over first).
    pub(crate) fn on_detached(s: &Snapshot, volume: &Uuid, host: &str) -> Option<(Condition, Op)> {
        let mut cs = s.copy_state(volume);
        let before = cs.clone();
        cs.lose_records_of(host);
        cs.sessions.remove(host);
        for j in cs.jobs.iter_mut() {
            j.confirmed.remove(host);
            j.nsids.remove(host);
        }
        (cs != before).then(|| s.copy_state_txn(&cs))
    }
}

/// Checks an ID-like path parameter for the copy endpoints.
pub fn validate_job_id(id: &str) -> Result<u64, ModelError> {
    if id.len() > ID_BYTES_MAX {
        return Err(ModelError::Invalid(format!("job id {id:?} is too long")));
    }
    id.parse()
        .map_err(|_| ModelError::Invalid(format!("job id {id:?} is not a number")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::limits::EXTENT_BYTES_MIN;
    use crate::model::{Layout, VolumeSpec};
    use std::sync::Arc;

    /// Four resync regions per extent.
    const E: u64 = 4 * EXTENT_BYTES_MIN;
    const H1: &str = "nqn.2014-08.org.nvmexpress:uuid:host-1";
    const H2: &str = "nqn.2014-08.org.nvmexpress:uuid:host-2";

    /// Two targets, a two-copy raid1 volume of 4 extents' size (8
    /// extents), attached to H1 and H2.
    fn fixture() -> (Cluster, Arc<ManualClock>, Uuid) {
        let (c, clock) = crate::moves::tests::cluster(E);
        for i in 0..2 {
            crate::moves::tests::register(&c, i, 64 * E);
        }
        let uuid = Uuid([7; 16]);
        c.create_volume(&VolumeSpec {
            uuid,
            name: "v".into(),
            size_bytes: 4 * E,
            layout: Layout::Raid1 { copies: 2 },
            pool: None,
        })
        .unwrap();
        for h in [H1, H2] {
            c.begin_attach(&uuid, h).unwrap();
            c.finish_attach(&uuid, h).unwrap();
        }
        (c, clock, uuid)
    }

    fn candidate(c: &Cluster) -> Candidate {
        let all = c.resync_candidates(0).unwrap();
        assert_eq!(all.len(), 1, "{all:?}");
        all[0].clone()
    }

    #[test]
    fn partial_resync_copies_the_union_of_every_hosts_record() {
        let (c, _, v) = fixture();
        c.register_session(&v, H1, 11, 0).unwrap();
        c.register_session(&v, H2, 22, 0).unwrap();
        // H1 finds copy 1 of row 0 (extent 1) failed.
        c.report_failed_extents(&v, H1, &[1]).unwrap();
        let cs = c.copy_state(&v).unwrap();
        assert_eq!(cs.missed[&1].owed, [H1, H2].map(String::from).into());
        assert!(cs.revision > 0, "other hosts are told to stop reading it");
        let job = c.create_job(&candidate(&c)).unwrap().unwrap();
        assert_eq!(
            (job.extent, job.source, job.state),
            (1, 0, JobState::Arming)
        );
        assert!(
            c.resync_candidates(0).unwrap().is_empty(),
            "one job per copy"
        );
        assert!(
            c.host_copies(&v, H1).unwrap().syncing.is_empty(),
            "arming is not visible"
        );
        assert!(c.job_mirroring(&v, job.id).unwrap());
        let seen = c.host_copies(&v, H2).unwrap();
        assert_eq!(
            seen.syncing,
            vec![SyncingCopy {
                extent: 1,
                job: job.id
            }]
        );
        assert_eq!(seen.failed_extents, vec![1], "still never read");
        assert!(c.confirm_sync(&v, H1, job.id, 11, Some(&[0, 2])).unwrap());
        assert!(
            c.job_copying(&v, job.id).unwrap().is_none(),
            "H2 has not confirmed"
        );
        // Regions past the extent's end are ignored.
        assert!(c
            .confirm_sync(&v, H2, job.id, 22, Some(&[2, 3, 9]))
            .unwrap());
        let started = c.job_copying(&v, job.id).unwrap().unwrap();
        assert_eq!(started.kind, CopyKind::ResyncPartial);
        assert_eq!(started.regions, Some(vec![0, 2, 3]));
        assert_eq!(started.bytes_total, 3 * RESYNC_REGION_BYTES);
        c.job_progress(&v, job.id, E / 2).unwrap();
        let rec = c.finish_job(&v, job.id, None).unwrap().unwrap();
        assert_eq!(
            (rec.error, rec.bytes_copied),
            (None, 3 * RESYNC_REGION_BYTES)
        );
        let view = c.volume(&v).unwrap();
        assert!(view.failed_extents.is_empty(), "in sync: read again");
        assert_eq!(view.status, crate::model::VolumeStatus::Online);
        assert!(c.host_copies(&v, H1).unwrap().failed_extents.is_empty());
        let cs = c.copy_state(&v).unwrap();
        assert!(cs.missed.is_empty() && cs.jobs.is_empty());
        assert_eq!(cs.history.len(), 1);
        assert!(c.check().unwrap().is_empty());
    }

    #[test]
    fn a_lost_record_means_a_full_copy() {
        let (c, _, v) = fixture();
        c.register_session(&v, H1, 11, 0).unwrap();
        c.register_session(&v, H2, 22, 0).unwrap();
        c.report_failed_extents(&v, H1, &[1]).unwrap();
        // H2's serving process dies; a new one starts: H2's record is gone.
        c.register_session(&v, H2, 23, 0).unwrap();
        assert_eq!(c.copy_state(&v).unwrap().missed[&1].regions, None);
        let job = c.create_job(&candidate(&c)).unwrap().unwrap();
        assert_eq!(job.kind, CopyKind::ResyncFull);
        c.job_mirroring(&v, job.id).unwrap();
        c.confirm_sync(&v, H1, job.id, 11, Some(&[0])).unwrap();
        c.confirm_sync(&v, H2, job.id, 23, Some(&[])).unwrap();
        let started = c.job_copying(&v, job.id).unwrap().unwrap();
        assert_eq!(
            (started.kind, started.regions),
            (CopyKind::ResyncFull, None)
        );
    }

    #[test]
    fn a_clean_stop_hands_over_and_an_unclean_detach_loses() {
        let (c, _, v) = fixture();
        c.register_session(&v, H1, 11, 0).unwrap();
        c.register_session(&v, H2, 22, 0).unwrap();
        c.report_failed_extents(&v, H1, &[3]).unwrap();
        // H1 stops cleanly and detaches.
        c.hand_over_missed(&v, H1, 11, &[(3, vec![0])].into())
            .unwrap();
        c.begin_detach(&v, H1).unwrap();
        c.finish_detach(&v, H1, &BTreeMap::new()).unwrap();
        let m = &c.copy_state(&v).unwrap().missed[&3];
        assert_eq!(m.regions, Some([0].into()));
        assert_eq!(m.owed, [H2.to_string()].into());
        // H2 is detached without handing over (its process died).
        c.begin_detach(&v, H2).unwrap();
        c.finish_detach(&v, H2, &BTreeMap::new()).unwrap();
        let cs = c.copy_state(&v).unwrap();
        assert_eq!(cs.missed[&3].regions, None, "H2's writes are unknown");
        assert!(cs.sessions.is_empty());
        // Nobody attached: the job goes straight to copying, whole.
        let job = c.create_job(&candidate(&c)).unwrap().unwrap();
        c.job_mirroring(&v, job.id).unwrap();
        let started = c.job_copying(&v, job.id).unwrap().unwrap();
        assert_eq!(started.kind, CopyKind::ResyncFull);
    }

    #[test]
    fn a_failed_job_keeps_the_copy_stale_and_hosts_owe_again() {
        let (c, clock, v) = fixture();
        c.register_session(&v, H1, 11, 0).unwrap();
        c.register_session(&v, H2, 22, 0).unwrap();
        c.report_failed_extents(&v, H2, &[1]).unwrap();
        let job = c.create_job(&candidate(&c)).unwrap().unwrap();
        c.job_mirroring(&v, job.id).unwrap();
        c.confirm_sync(&v, H1, job.id, 11, Some(&[0])).unwrap();
        c.confirm_sync(&v, H2, job.id, 22, Some(&[])).unwrap();
        let rev = c.copy_state(&v).unwrap().revision;
        c.job_copying(&v, job.id).unwrap().unwrap();
        let rec = c
            .finish_job(&v, job.id, Some("source unreachable"))
            .unwrap()
            .unwrap();
        assert_eq!(rec.error.as_deref(), Some("source unreachable"));
        let cs = c.copy_state(&v).unwrap();
        assert!(cs.revision > rev, "hosts hear the job is over");
        assert_eq!(
            cs.missed[&1].regions,
            Some([0].into()),
            "what it missed stays"
        );
        assert_eq!(cs.missed[&1].owed.len(), 2, "hosts record again from now");
        assert_eq!(c.volume(&v).unwrap().failed_extents, vec![1]);
        // Not retried at once; after the retry interval it is.
        assert!(c.resync_candidates(10_000).unwrap().is_empty());
        clock.advance(10_001);
        assert_eq!(c.resync_candidates(10_000).unwrap().len(), 1);
    }

    #[test]
    fn a_copy_failing_again_ends_its_job() {
        let (c, _, v) = fixture();
        c.register_session(&v, H1, 11, 0).unwrap();
        c.report_failed_extents(&v, H1, &[1]).unwrap();
        let job = c.create_job(&candidate(&c)).unwrap().unwrap();
        c.job_mirroring(&v, job.id).unwrap();
        c.report_failed_extents(&v, H1, &[1]).unwrap();
        let cs = c.copy_state(&v).unwrap();
        assert!(cs.jobs.is_empty());
        assert!(cs.history[0].error.is_some());
        // Confirming a job that is over says so.
        assert!(!c.confirm_sync(&v, H1, job.id, 11, Some(&[])).unwrap());
    }

    #[test]
    fn a_host_that_opened_the_copy_mirroring_needs_no_confirmation() {
        let (c, _, v) = fixture();
        c.register_session(&v, H1, 11, 0).unwrap();
        c.report_failed_extents(&v, H1, &[1]).unwrap();
        let job = c.create_job(&candidate(&c)).unwrap().unwrap();
        c.job_mirroring(&v, job.id).unwrap();
        let rev = c.copy_state(&v).unwrap().revision;
        // H2 starts serving after the job was announced: it writes the copy
        // from its first write on.
        c.register_session(&v, H2, 22, rev).unwrap();
        c.confirm_sync(&v, H1, job.id, 11, Some(&[])).unwrap();
        let started = c.job_copying(&v, job.id).unwrap().unwrap();
        assert_eq!(started.kind, CopyKind::ResyncPartial);
    }

    #[test]
    fn an_operator_marks_a_copy_stale_and_it_is_copied_whole() {
        let (c, _, v) = fixture();
        c.register_session(&v, H1, 11, 0).unwrap();
        let rev = c.copy_state(&v).unwrap().revision;
        c.mark_stale(&v, 2).unwrap();
        assert_eq!(c.volume(&v).unwrap().failed_extents, vec![2]);
        assert_eq!(c.host_copies(&v, H1).unwrap().failed_extents, vec![2]);
        assert!(
            c.copy_state(&v).unwrap().revision > rev,
            "hosts stop reading it"
        );
        // Its row's other copy is the last in sync: refused, nothing changes.
        assert!(matches!(
            c.mark_stale(&v, 3),
            Err(StateError::LastInSyncCopy { extent: 3, .. })
        ));
        assert!(c.mark_stale(&v, 9).is_err(), "no such extent");
        c.mark_stale(&v, 2).unwrap();
        assert_eq!(c.volume(&v).unwrap().failed_extents, vec![2]);
        let job = c.create_job(&candidate(&c)).unwrap().unwrap();
        assert_eq!((job.extent, job.source), (2, 3));
        c.job_mirroring(&v, job.id).unwrap();
        c.confirm_sync(&v, H1, job.id, 11, Some(&[])).unwrap();
        c.confirm_sync(&v, H2, job.id, 0, Some(&[])).unwrap();
        let started = c.job_copying(&v, job.id).unwrap().unwrap();
        assert_eq!(
            (started.kind, started.regions),
            (CopyKind::ResyncFull, None)
        );
    }

    #[test]
    fn format_4_copy_states_read_with_no_family() {
        let (c, _, v) = fixture();
        c.report_failed_extents(&v, H1, &[1]).unwrap();
        let job = c.create_job(&candidate(&c)).unwrap().unwrap();
        let now = c.copy_state(&v).unwrap();
        let j = now.jobs[0].clone();
        let old = CopyStateV4 {
            volume: now.volume,
            revision: now.revision,
            sessions: now.sessions.clone(),
            missed: now.missed.clone(),
            jobs: vec![CopyJobV4 {
                id: j.id,
                extent: j.extent,
                source: j.source,
                kind: j.kind,
                state: j.state,
                regions: j.regions.clone(),
                confirmed: j.confirmed.clone(),
                started_ms: j.started_ms,
                state_ms: j.state_ms,
                copier_nsid: j.copier_nsid,
                bytes_total: j.bytes_total,
                bytes_copied: j.bytes_copied,
                dest: j.dest.clone(),
                nsids: j.nsids.clone(),
                copy_started_ms: j.copy_started_ms,
                failed_by: j.failed_by.clone(),
                failed_while_switching: j.failed_while_switching,
            }],
            history: now.history.clone(),
            next_job: now.next_job,
        };
        let mut bytes = vec![4u8];
        bytes.extend(postcard::to_allocvec(&old).unwrap());
        let read: CopyState = crate::model::decode("copy state", &bytes).unwrap();
        assert_eq!(read, now);
        assert!(read.jobs[0].family.is_empty() && job.family.is_empty());
        // The current format round-trips a family.
        let mut with = now.clone();
        with.jobs[0].family.push(FamilyMember {
            snapshot: "s".into(),
            epoch: 2,
            source: c.volume(&v).unwrap().volume.extents[0].clone(),
            tree: c.volume(&v).unwrap().volume.extents[1].clone(),
            copier_nsid: 3,
        });
        with.jobs[0].family_done = 1;
        let bytes = encode(&with);
        assert_eq!(bytes[0], crate::model::FORMAT);
        assert_eq!(
            crate::model::decode::<CopyState>("copy state", &bytes),
            Ok(with)
        );
    }

    #[test]
    fn copy_state_is_deleted_with_its_volume_and_survives_reopen() {
        let (c, _, v) = fixture();
        c.report_failed_extents(&v, H1, &[1]).unwrap();
        assert!(c.snapshot().unwrap().copy_states.contains_key(&v));
        for h in [H1, H2] {
            c.begin_detach(&v, h).unwrap();
            c.finish_detach(&v, h, &BTreeMap::new()).unwrap();
        }
        c.delete_volume(&v).unwrap();
        assert!(!c.snapshot().unwrap().copy_states.contains_key(&v));
    }
}
