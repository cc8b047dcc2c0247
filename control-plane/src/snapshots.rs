//! Snapshots of thin volumes and the write epoch their cut rests on
//! (design/thin-snapshots.md T5), and clones made from them (T6).
//!
//! **The write epoch.** Every volume has one (1 until its first
//! snapshot); the engines writing it tag their writes with it. Raising it
//! bumps the volume's copy-state revision, so every attachment's long
//! poll wakes and its engine moves on, then confirms (`PUT …/epoch`) for
//! its current session. A snapshot is sealed only once every writer of
//! the volume confirmed the raised epoch, so the writes in the snapshot
//! are exactly those tagged at or below its epoch.
//!
//! **Trees.** A snapshot holds, per extent copy of its volume, one tree on
//! the copy's grain pool: a range of the device's virtual space, allocated
//! like an extent (so placement never hands its root to an extent and
//! the pool's provisioned bytes count it). Giving a snapshot up, or
//! deleting it, turns its trees into stale exports (C13), which
//! reconciliation has the targets release before their place is reused.
//!
//! | key | value |
//! |---|---|
//! | `/write-epochs/{uuid}` | [`WriteEpoch`]: the volume's epoch and who confirmed it (absent: epoch 1) |
//! | `/snapshots/{uuid}/{name}` | [`SnapshotRecord`] |
//! | `/clones/{uuid}` | [`PendingClone`]: trees a clone reserved before its volume exists |
//!
//! The epoch is a record of its own rather than a field of the volume's,
//! so the volume's stored layout (C4) is unchanged and the raise does not
//! conflict with attaches, which rewrite the volume record.
//!
//! **The hold.** Per engine, the epoch orders that engine's writes; across
//! engines (a volume written by two, or a group of volumes at one cut,
//! [`crate::snapshot_groups`]) a raise also sets a *hold*: every engine
//! admits no new write until every one has confirmed, held, that its older
//! writes completed; then the hold is cleared. So no write of the new
//! epoch completes before a write of an old one is issued, on any engine
//! of the cut. A raise with one writer or none sets no hold (nothing to
//! order it against, and no stall).

use crate::model::{encode, validate_id, Extent, ModelError, Uuid, Volume, VolumeSpec};
use crate::state::{unchanged, Cluster, Snapshot, StateError, Txn, Versioned};
use crate::store::{Condition, Op};
pub use nvpool_api::rest::SnapshotState;
use nvpool_api::rest::ENGINE_HOLD_MAX_MS;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const WRITE_EPOCHS: &str = "/write-epochs/";
pub const SNAPSHOTS: &str = "/snapshots/";
pub const CLONES: &str = "/clones/";

pub fn write_epoch_key(volume: &Uuid) -> String {
    format!("{WRITE_EPOCHS}{volume}")
}

pub fn snapshot_key(volume: &Uuid, name: &str) -> String {
    format!("{SNAPSHOTS}{volume}/{name}")
}

pub fn volume_snapshots(volume: &Uuid) -> String {
    format!("{SNAPSHOTS}{volume}/")
}

pub fn clone_key(volume: &Uuid) -> String {
    format!("{CLONES}{volume}")
}

/// The epoch a volume's writes are tagged with before any snapshot.
pub const FIRST_WRITE_EPOCH: u32 = 1;

/// A volume's write epoch and what its writers confirmed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteEpoch {
    pub volume: Uuid,
    pub epoch: u32,
    /// Host NQN → the epoch its engine of `session` tags writes with.
    pub confirmed: BTreeMap<String, Confirmed>,
    /// When (ms) the raise to `epoch` set a hold on the volume's writers,
    /// if it did and nobody cleared it yet (stored format 4).
    pub hold_since_ms: Option<u64>,
}

/// Format 3's [`WriteEpoch`] (before holds): read with no hold.
#[derive(Deserialize)]
struct WriteEpochV3 {
    volume: Uuid,
    epoch: u32,
    confirmed: BTreeMap<String, ConfirmedV3>,
}

impl crate::model::Stored for WriteEpoch {
    fn decode_older(format: u8, body: &[u8]) -> postcard::Result<(WriteEpoch, &[u8])> {
        if format == 4 {
            // Unchanged since format 4.
            return postcard::take_from_bytes(body);
        }
        let (old, rest) = postcard::take_from_bytes::<WriteEpochV3>(body)?;
        let confirmed = old
            .confirmed
            .into_iter()
            .map(|(h, c)| {
                let c = Confirmed {
                    session: c.session,
                    epoch: c.epoch,
                    held: false,
                };
                (h, c)
            })
            .collect();
        let w = WriteEpoch {
            volume: old.volume,
            epoch: old.epoch,
            confirmed,
            hold_since_ms: None,
        };
        Ok((w, rest))
    }
}

impl WriteEpoch {
    /// The stored record, or the first epoch with nothing confirmed (no
    /// record: no snapshot was ever taken).
    fn read(read: Option<&Versioned<WriteEpoch>>, volume: &Uuid) -> WriteEpoch {
        read.map_or_else(
            || WriteEpoch {
                volume: *volume,
                epoch: FIRST_WRITE_EPOCH,
                confirmed: BTreeMap::new(),
                hold_since_ms: None,
            },
            |r| r.value.clone(),
        )
    }

    /// Whether the writers are held at `now_ms`: a hold older than
    /// [`ENGINE_HOLD_MAX_MS`] holds nobody (every engine released itself,
    /// and whoever set it gave up long before), so it is as good as
    /// cleared: a leftover of a control plane that died at the barrier.
    pub fn held_at(&self, now_ms: u64) -> bool {
        self.hold_since_ms
            .is_some_and(|t| now_ms.saturating_sub(t) < ENGINE_HOLD_MAX_MS)
    }
}

/// An engine's confirmation: it tags new writes with `epoch`, and every
/// write it tagged lower has completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Confirmed {
    pub session: u64,
    pub epoch: u32,
    /// It admits no new write: it saw the hold (stored format 4).
    pub held: bool,
}

/// Format 3's [`Confirmed`].
#[derive(Deserialize)]
struct ConfirmedV3 {
    session: u64,
    epoch: u32,
}

/// A snapshot of a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub volume: Uuid,
    pub name: String,
    /// The cut: writes tagged at or below it are in the snapshot.
    pub epoch: u32,
    pub state: SnapshotState,
    pub created_ms: u64,
    pub size_bytes: u64,
    /// The volume's layout when taken (a clone must have it).
    pub layout: crate::model::Layout,
    pub extent_bytes: u64,
    /// One per extent copy of the volume, in its extent order.
    pub trees: Vec<SnapshotTree>,
    /// A group snapshot: every volume of the group, this one among them,
    /// in the order the group was asked for; empty for a snapshot of one
    /// volume (stored format 4).
    pub group: Vec<Uuid>,
}

/// Format 3's [`SnapshotRecord`] (before groups): read as no group.
#[derive(Deserialize)]
struct SnapshotRecordV3 {
    volume: Uuid,
    name: String,
    epoch: u32,
    state: SnapshotState,
    created_ms: u64,
    size_bytes: u64,
    layout: crate::model::Layout,
    extent_bytes: u64,
    trees: Vec<SnapshotTree>,
}

impl crate::model::Stored for SnapshotRecord {
    fn decode_older(format: u8, body: &[u8]) -> postcard::Result<(SnapshotRecord, &[u8])> {
        if format == 4 {
            // Unchanged since format 4.
            return postcard::take_from_bytes(body);
        }
        let (r, rest) = postcard::take_from_bytes::<SnapshotRecordV3>(body)?;
        let record = SnapshotRecord {
            volume: r.volume,
            name: r.name,
            epoch: r.epoch,
            state: r.state,
            created_ms: r.created_ms,
            size_bytes: r.size_bytes,
            layout: r.layout,
            extent_bytes: r.extent_bytes,
            trees: r.trees,
            group: Vec::new(),
        };
        Ok((record, rest))
    }
}

/// A live extent and the snapshot's tree of it, on the same device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotTree {
    pub live: Extent,
    pub tree: Extent,
}

/// A clone whose trees the targets are being asked to create: its
/// volume does not exist yet (a thin tree that does not exist would be
/// opened empty).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingClone {
    pub spec: VolumeSpec,
    pub source: Uuid,
    pub snapshot: String,
    pub created_ms: u64,
    /// The new volume's extents, each paired with the snapshot tree it
    /// starts as (`live`: the snapshot's tree, `tree`: the new extent).
    pub trees: Vec<SnapshotTree>,
}

impl crate::model::Stored for PendingClone {}

/// Wakes the creations waiting for their writers' confirmations as soon
/// as this process commits one, instead of at their next look. A hint, never state: a waiter always re-reads
/// the store, and still looks every `CONFIRM_STEP` for what does not
/// wake it (a confirmation committed by another control plane sharing
/// the store, a writer detached).
///
/// One for the process rather than one per [`Cluster`]: clusters of one
/// process share their store, and a wake meant for another cluster (tests
/// run several) only costs a re-read.
#[derive(Debug)]
pub struct EpochSignal {
    /// Confirmations committed so far.
    count: std::sync::Mutex<u64>,
    changed: std::sync::Condvar,
}

/// The process's [`EpochSignal`].
pub static EPOCH_SIGNAL: EpochSignal = EpochSignal {
    count: std::sync::Mutex::new(0),
    changed: std::sync::Condvar::new(),
};

impl EpochSignal {
    /// How many changes were signalled so far: read it before reading
    /// the store, then [`Self::wait`] for a change past it.
    pub fn seen(&self) -> u64 {
        *nvpool_rt::lock(&self.count)
    }

    /// Wakes every waiter.
    pub fn notify(&self) {
        *nvpool_rt::lock(&self.count) += 1;
        self.changed.notify_all();
    }

    /// Sleeps until a change past `seen` is signalled, or `timeout`
    /// passes.
    pub fn wait(&self, seen: u64, timeout: std::time::Duration) {
        let count = nvpool_rt::lock(&self.count);
        // A poisoned wait still woke: the caller re-reads either way.
        let _ = self
            .changed
            .wait_timeout_while(count, timeout, |c| *c == seen);
    }
}

/// The root of a grain pool's tree at extent `e`.
pub fn root_of(e: &Extent) -> u64 {
    e.offset / nvpool_api::admin::THIN_ROOT_UNIT_BYTES
}

impl Snapshot {
    /// The volume's write epoch.
    pub fn write_epoch(&self, volume: &Uuid) -> u32 {
        self.write_epochs
            .get(volume)
            .map_or(FIRST_WRITE_EPOCH, |w| w.value.epoch)
    }

    /// The snapshots of `volume`.
    pub fn snapshots_of(&self, volume: &Uuid) -> Vec<&Versioned<SnapshotRecord>> {
        self.snapshots
            .range((*volume, String::new())..)
            .take_while(|((u, _), _)| u == volume)
            .map(|(_, s)| s)
            .collect()
    }

    /// Every tree held by a snapshot or reserved by a pending clone:
    /// allocated like extents.
    pub fn snapshot_trees(&self) -> impl Iterator<Item = &Extent> + '_ {
        let snaps = self
            .snapshots
            .values()
            .flat_map(|s| s.value.trees.iter().map(|t| &t.tree));
        let clones = self
            .pending_clones
            .values()
            .flat_map(|c| c.value.trees.iter().map(|t| &t.tree));
        snaps.chain(clones)
    }

    /// The conditions and ops that free `trees`: stale exports of their
    /// targets until released (C13).
    fn free_trees(&self, trees: &[SnapshotTree], conds: &mut Vec<Condition>, ops: &mut Vec<Op>) {
        let mut by_target: BTreeMap<String, Vec<crate::attach::Export>> = BTreeMap::new();
        for t in trees {
            if let Some(x) = self.freed_tree(&t.tree) {
                by_target.entry(t.tree.target.clone()).or_default().push(x);
            }
        }
        for (target, xs) in by_target {
            let (c, o) = self.add_stale_exports(&target, xs);
            conds.push(c);
            ops.push(o);
        }
    }

    /// Whether every extent of `v` is on a grain pool.
    fn all_thin(&self, v: &Volume) -> bool {
        v.extents.iter().all(|e| {
            self.targets
                .get(&e.target)
                .and_then(|t| t.value.device(&e.device))
                .is_some_and(crate::model::Device::is_grain_pool)
        })
    }

    /// The writers of `volume` that have not confirmed `epoch` for their
    /// current session (a writer with no session known counts once it
    /// confirms with any); with `held`, only confirmations made held
    /// count (the engine admits no new write).
    pub fn epoch_pending(&self, volume: &Uuid, epoch: u32, held: bool) -> Vec<String> {
        let sessions = self.copy_state(volume).sessions;
        let confirmed = self.write_epochs.get(volume).map(|w| &w.value.confirmed);
        self.writers_of(volume)
            .into_iter()
            .filter(|h| {
                let c = confirmed.and_then(|c| c.get(h));
                !c.is_some_and(|c| {
                    c.epoch >= epoch
                        && (c.held || !held)
                        && sessions.get(h).is_none_or(|&s| s == c.session)
                })
            })
            .collect()
    }
}

/// What [`Cluster::raise_epochs`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Raise {
    /// Every volume's epoch rose: the new epochs, in the order asked, and
    /// whether the raise holds their writers (more than one writer in
    /// all).
    Raised { epochs: Vec<u32>, held: bool },
    /// Nothing changed: this volume's epoch is no longer the cut (another
    /// snapshot raised it meanwhile).
    Moved { volume: Uuid, epoch: u32 },
    /// Nothing changed: another snapshot holds this volume's writers.
    Held { volume: Uuid },
}

/// What [`Cluster::abandoned`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Abandoned {
    /// (volume, name) of snapshots left `creating`.
    pub snapshots: Vec<(Uuid, String)>,
    /// New volumes of clones left pending.
    pub clones: Vec<Uuid>,
}

/// What [`Cluster::begin_snapshot`] found or made.
#[derive(Debug, Clone)]
pub struct Begun {
    pub record: SnapshotRecord,
    /// False: a snapshot of that name existed already.
    pub created: bool,
}

pub(crate) fn conflict(kind: &'static str, message: String) -> StateError {
    StateError::Conflict { kind, message }
}

/// The volume's record and its version, or `VolumeNotFound`.
/// Snapshot `name` of `volume`'s record and its version, or
/// `SnapshotNotFound`.
pub(crate) fn snapshot_in<'a>(
    s: &'a Snapshot,
    volume: &Uuid,
    name: &str,
) -> Result<&'a Versioned<SnapshotRecord>, StateError> {
    s.snapshots
        .get(&(*volume, name.to_owned()))
        .ok_or_else(|| StateError::SnapshotNotFound {
            volume: *volume,
            name: name.to_owned(),
        })
}

pub(crate) fn volume_in<'a>(
    s: &'a Snapshot,
    uuid: &Uuid,
) -> Result<&'a Versioned<Volume>, StateError> {
    s.volumes
        .get(uuid)
        .ok_or_else(|| StateError::VolumeNotFound(uuid.to_string()))
}

/// Allocates, on the device of each of `extents`, a new range of the
/// same length (first fit, as placement does), occupying it in `a`.
fn allocate_trees(
    a: &mut crate::placement::Allocator,
    extents: &[Extent],
) -> Result<Vec<SnapshotTree>, StateError> {
    let mut out = Vec::with_capacity(extents.len());
    for e in extents {
        let r = e.device_ref();
        let offset = a
            .device(&r)
            .and_then(|d| d.first_fit(e.length))
            .ok_or_else(|| StateError::Unprocessable {
                kind: "no_space",
                message: format!("device {r} has no room for another tree"),
            })?;
        let tree = Extent {
            offset,
            ..e.clone()
        };
        a.occupy(&tree)?;
        out.push(SnapshotTree {
            live: e.clone(),
            tree,
        });
    }
    Ok(out)
}

impl Cluster {
    /// The volume's write epoch.
    pub fn write_epoch(&self, volume: &Uuid) -> Result<u32, StateError> {
        Ok(self
            .read::<WriteEpoch>("write epoch", &write_epoch_key(volume))?
            .map_or(FIRST_WRITE_EPOCH, |w| w.value.epoch))
    }

    /// The volume's write epoch and whether its writers are held
    /// ([`nvpool_api::rest::AttachmentOut::write_hold`]).
    pub fn write_barrier(&self, volume: &Uuid) -> Result<(u32, bool), StateError> {
        let w = self.read::<WriteEpoch>("write epoch", &write_epoch_key(volume))?;
        let w = WriteEpoch::read(w.as_ref(), volume);
        Ok((w.epoch, w.held_at(self.now())))
    }

    /// `host`'s engine of `session` tags new writes with `epoch` and its
    /// older writes completed; `held`: it admits no new write (it saw the
    /// hold). A session other than the one the host registered is
    /// `StaleSession` (that engine no longer serves).
    pub fn confirm_epoch(
        &self,
        volume: &Uuid,
        host: &str,
        session: u64,
        epoch: u32,
        held: bool,
    ) -> Result<(), StateError> {
        let done = self.transact(|s| {
            volume_in(s, volume)?;
            if !s.attachments.contains_key(&(*volume, host.to_owned())) {
                return Err(StateError::NotAttached {
                    volume: *volume,
                    host: host.to_owned(),
                });
            }
            let current = s.write_epoch(volume);
            if epoch == 0 || epoch > current {
                return Err(ModelError::Invalid(format!(
                    "epoch {epoch} is not one volume {volume} had (its write epoch is {current})"
                ))
                .into());
            }
            if let Some(&known) = s.copy_state(volume).sessions.get(host) {
                if known != session {
                    return Err(StateError::StaleSession {
                        volume: *volume,
                        host: host.to_owned(),
                        session,
                    });
                }
            }
            let read = s.write_epochs.get(volume);
            let mut w = WriteEpoch::read(read, volume);
            let was = w.confirmed.get(host).copied();
            // The newest word of this session: a lower epoch says nothing
            // new; the same epoch again may say the engine is now held,
            // or released.
            let next = match was {
                Some(c) if c.session == session && c.epoch > epoch => return Ok(Txn::Done(())),
                Some(c) if c.session == session && c.epoch == epoch && c.held == held => {
                    return Ok(Txn::Done(()))
                }
                _ => Confirmed {
                    session,
                    epoch,
                    held,
                },
            };
            w.confirmed.insert(host.to_owned(), next);
            let key = write_epoch_key(volume);
            Ok(Txn::Commit(
                vec![unchanged(&key, read.map(|r| r.version))],
                vec![Op::Put(key, encode(&w))],
                (),
            ))
        });
        if done.is_ok() {
            EPOCH_SIGNAL.notify();
        }
        done
    }

    /// Raises the volume's write epoch from `cut` to `cut + 1` and wakes
    /// its attachments' long polls; returns the new epoch. `None` when
    /// the epoch is no longer `cut` (another snapshot raised it
    /// meanwhile: writes tagged above `cut` may have landed before this
    /// snapshot's trees existed, so its cut is not one and it must be
    /// given up; a compare-and-set, design/thin-snapshots.md T5) or
    /// another snapshot holds the volume's writers. With more than one
    /// writer, the raise holds them ([`Self::raise_epochs`]).
    pub fn raise_epoch(&self, volume: &Uuid, cut: u32) -> Result<Option<u32>, StateError> {
        Ok(match self.raise_epochs(&[(*volume, cut)])? {
            Raise::Raised { epochs, .. } => epochs.first().copied(),
            Raise::Moved { .. } | Raise::Held { .. } => None,
        })
    }

    /// Raises every `(volume, cut)`'s write epoch to `cut + 1`, all in one
    /// transaction or none, and wakes their attachments' long polls. If
    /// they have more than one writer in all, the raise also holds them
    /// (until [`Self::clear_holds`]). Nothing changes if a volume's epoch
    /// is no longer its cut, or another snapshot holds its writers (its
    /// barrier must not be lifted by ours). Confirmations of hosts no
    /// longer attached go.
    pub fn raise_epochs(&self, cuts: &[(Uuid, u32)]) -> Result<Raise, StateError> {
        let distinct: std::collections::BTreeSet<&Uuid> = cuts.iter().map(|(v, _)| v).collect();
        if distinct.len() != cuts.len() {
            return Err(ModelError::Invalid("a volume is raised twice in one cut".into()).into());
        }
        let now = self.now();
        self.transact(|s| {
            let mut writers = 0;
            for (volume, cut) in cuts {
                volume_in(s, volume)?;
                let w = WriteEpoch::read(s.write_epochs.get(volume), volume);
                if w.epoch != *cut {
                    return Ok(Txn::Done(Raise::Moved {
                        volume: *volume,
                        epoch: w.epoch,
                    }));
                }
                if w.held_at(now) {
                    return Ok(Txn::Done(Raise::Held { volume: *volume }));
                }
                writers += s.writers_of(volume).len();
            }
            let held = writers > 1;
            let (mut conds, mut ops, mut epochs) = (Vec::new(), Vec::new(), Vec::new());
            for (volume, cut) in cuts {
                let read = s.write_epochs.get(volume);
                let mut w = WriteEpoch::read(read, volume);
                w.epoch = cut.saturating_add(1);
                w.hold_since_ms = held.then_some(now);
                w.confirmed
                    .retain(|h, _| s.attachments.contains_key(&(*volume, h.clone())));
                let key = write_epoch_key(volume);
                conds.push(unchanged(&key, read.map(|r| r.version)));
                ops.push(Op::Put(key, encode(&w)));
                let mut cs = s.copy_state(volume);
                cs.revision += 1;
                let (c, o) = s.copy_state_txn(&cs);
                conds.push(c);
                ops.push(o);
                epochs.push(w.epoch);
            }
            Ok(Txn::Commit(conds, ops, Raise::Raised { epochs, held }))
        })
    }

    /// Lifts the holds the raises to `(volume, epoch)` set, in one
    /// transaction, waking the volumes' long polls. Returns the volumes
    /// whose hold was already gone (cleared by someone else, or never
    /// set): their writers may have been let go before the barrier was
    /// complete.
    pub fn clear_holds(&self, raised: &[(Uuid, u32)]) -> Result<Vec<Uuid>, StateError> {
        self.transact(|s| {
            let (mut conds, mut ops, mut gone) = (Vec::new(), Vec::new(), Vec::new());
            for (volume, epoch) in raised {
                let read = s.write_epochs.get(volume);
                let mut w = WriteEpoch::read(read, volume);
                if w.epoch != *epoch || w.hold_since_ms.is_none() || !s.volumes.contains_key(volume)
                {
                    gone.push(*volume);
                    continue;
                }
                w.hold_since_ms = None;
                let key = write_epoch_key(volume);
                conds.push(unchanged(&key, read.map(|r| r.version)));
                ops.push(Op::Put(key, encode(&w)));
                let mut cs = s.copy_state(volume);
                cs.revision += 1;
                let (c, o) = s.copy_state_txn(&cs);
                conds.push(c);
                ops.push(o);
            }
            if ops.is_empty() {
                return Ok(Txn::Done(gone));
            }
            Ok(Txn::Commit(conds, ops, gone))
        })
    }

    /// Lifts every hold older than [`ENGINE_HOLD_MAX_MS`]: whoever set it
    /// is gone (it gives up at `WRITE_HOLD_MAX_MS`), and no engine still
    /// honours it. Returns the volumes.
    pub fn clear_stale_holds(&self) -> Result<Vec<Uuid>, StateError> {
        let now = self.now();
        let s = self.snapshot()?;
        let stale: Vec<(Uuid, u32)> = s
            .write_epochs
            .values()
            .filter(|w| w.value.hold_since_ms.is_some() && !w.value.held_at(now))
            .map(|w| (w.value.volume, w.value.epoch))
            .collect();
        if stale.is_empty() {
            return Ok(Vec::new());
        }
        let gone = self.clear_holds(&stale)?;
        Ok(stale
            .into_iter()
            .map(|(v, _)| v)
            .filter(|v| !gone.contains(v))
            .collect())
    }

    /// Writers of the volume that have not confirmed `epoch` yet (held,
    /// if `held`).
    pub fn epoch_pending(
        &self,
        volume: &Uuid,
        epoch: u32,
        held: bool,
    ) -> Result<Vec<String>, StateError> {
        Ok(self.snapshot()?.epoch_pending(volume, epoch, held))
    }

    /// Records snapshot `name` of `volume` as `creating` at the volume's
    /// write epoch, with one new tree per extent copy; a snapshot of that
    /// name already there is returned as it is.
    pub fn begin_snapshot(&self, volume: &Uuid, name: &str) -> Result<Begun, StateError> {
        validate_id("snapshot name", name, crate::limits::NAME_BYTES_MAX)?;
        self.transact_allocation(|s| {
            volume_in(s, volume)?;
            if let Some(r) = s.snapshots.get(&(*volume, name.to_owned())) {
                return Ok(Txn::Done(Begun {
                    record: r.value.clone(),
                    created: false,
                }));
            }
            let mut a = self.allocator(s)?;
            let (record, conds, op) = self.new_snapshot(s, &mut a, volume, name, Vec::new())?;
            Ok(Txn::Commit(
                conds,
                vec![op],
                Begun {
                    record,
                    created: true,
                },
            ))
        })
    }

    /// A new `creating` record of snapshot `name` of `volume` in `s` at
    /// the volume's write epoch, its trees allocated in `a`; the
    /// conditions it needs (no such snapshot, the volume as read) and the
    /// op that stores it. Refused for thick volumes and while copies run.
    pub(crate) fn new_snapshot(
        &self,
        s: &Snapshot,
        a: &mut crate::placement::Allocator,
        volume: &Uuid,
        name: &str,
        group: Vec<Uuid>,
    ) -> Result<(SnapshotRecord, Vec<Condition>, Op), StateError> {
        let v = volume_in(s, volume)?;
        if !s.all_thin(&v.value) {
            return Err(StateError::Unprocessable {
                kind: "thick_volume",
                message: format!(
                    "volume {volume} is thick: only thin volumes (on grain pools) have snapshots"
                ),
            });
        }
        if !s.copy_state(volume).jobs.is_empty() {
            return Err(conflict(
                "copy_in_progress",
                format!(
                    "volume {volume} has copies under way (resync or move); \
                     snapshot it once they are over"
                ),
            ));
        }
        // A copy that missed writes would be in the snapshot as it is,
        // and a clone could read it: a degraded volume is snapshotted once
        // its copies are back in sync.
        let failed = s.failed_copies.get(volume);
        if failed.is_some_and(|f| !f.value.extents.is_empty()) {
            return Err(conflict(
                "volume_degraded",
                format!(
                    "volume {volume} has copies that missed writes; snapshot it once they \
                     are back in sync"
                ),
            ));
        }
        let trees = allocate_trees(a, &v.value.extents)?;
        let record = SnapshotRecord {
            volume: *volume,
            name: name.to_owned(),
            epoch: s.write_epoch(volume),
            state: SnapshotState::Creating,
            created_ms: self.now(),
            size_bytes: v.value.size_bytes,
            layout: v.value.layout,
            extent_bytes: v.value.extent_bytes,
            trees,
            group,
        };
        let key = snapshot_key(volume, name);
        let vkey = crate::state::keys::volume(volume);
        let fkey = crate::attach::attach_keys::failed_copies(volume);
        let conds = vec![
            Condition::Missing(key.clone()),
            Condition::VersionIs(vkey, v.version),
            unchanged(&fkey, failed.map(|f| f.version)),
        ];
        Ok((record.clone(), conds, Op::Put(key, encode(&record))))
    }

    /// Marks creating snapshots ready, all in one transaction.
    pub fn finish_snapshots(
        &self,
        snaps: &[(Uuid, String)],
    ) -> Result<Vec<SnapshotRecord>, StateError> {
        self.transact(|s| {
            let (mut conds, mut ops, mut out) = (Vec::new(), Vec::new(), Vec::new());
            for (volume, name) in snaps {
                let r = snapshot_in(s, volume, name)?;
                let mut record = r.value.clone();
                let failed = s.failed_copies.get(volume);
                if record.state != SnapshotState::Ready
                    && failed.is_some_and(|f| !f.value.extents.is_empty())
                {
                    // A copy failed while the cut was taken: its tree may
                    // lack writes the others hold.
                    return Err(StateError::SnapshotFailed {
                        volume: *volume,
                        name: name.clone(),
                        reason: "a copy of the volume missed writes while the snapshot was \
                                 taken"
                            .into(),
                    });
                }
                if record.state != SnapshotState::Ready {
                    record.state = SnapshotState::Ready;
                    let key = snapshot_key(volume, name);
                    conds.push(Condition::VersionIs(key.clone(), r.version));
                    ops.push(Op::Put(key, encode(&record)));
                }
                out.push(record);
            }
            if ops.is_empty() {
                return Ok(Txn::Done(out));
            }
            Ok(Txn::Commit(conds, ops, out))
        })
    }

    /// Gives creating snapshots up, all in one transaction: their records
    /// go and their trees are freed. Returns the records dropped (one
    /// already gone, or ready, is left as it is).
    pub fn drop_creating(
        &self,
        snaps: &[(Uuid, String)],
    ) -> Result<Vec<SnapshotRecord>, StateError> {
        self.transact_allocation(|s| {
            let (mut conds, mut ops, mut dropped) = (Vec::new(), Vec::new(), Vec::new());
            let mut trees = Vec::new();
            for (volume, name) in snaps {
                let Some(r) = s.snapshots.get(&(*volume, name.clone())) else {
                    continue;
                };
                if r.value.state != SnapshotState::Creating {
                    continue;
                }
                let key = snapshot_key(volume, name);
                conds.push(Condition::VersionIs(key.clone(), r.version));
                ops.push(Op::Delete(key));
                trees.extend(r.value.trees.iter().cloned());
                dropped.push(r.value.clone());
            }
            if ops.is_empty() {
                return Ok(Txn::Done(dropped));
            }
            // One pass over every tree: a target's stale exports are one
            // record, written once.
            s.free_trees(&trees, &mut conds, &mut ops);
            Ok(Txn::Commit(conds, ops, dropped))
        })
    }

    /// Forgets a snapshot and frees its trees (stale exports until their
    /// targets release them); returns it. One still creating is
    /// refused unless `creating` (giving it up).
    pub fn drop_snapshot(
        &self,
        volume: &Uuid,
        name: &str,
        creating: bool,
    ) -> Result<SnapshotRecord, StateError> {
        self.transact_allocation(|s| {
            let r = snapshot_in(s, volume, name)?;
            if r.value.state == SnapshotState::Creating && !creating {
                return Err(conflict(
                    "snapshot_creating",
                    format!("snapshot {name} of volume {volume} is being created"),
                ));
            }
            // A copy job moving the volume's snapshot trees would leave
            // this one's new tree behind (design T7).
            if let (false, Some(j)) = (creating, s.copy_state(volume).jobs.first()) {
                return Err(conflict(
                    "copy_in_progress",
                    format!(
                        "volume {volume} has copy job {} under way ({} of extent {}); delete \
                         snapshot {name} once it is over",
                        j.id,
                        j.kind.as_str(),
                        j.extent
                    ),
                ));
            }
            let key = snapshot_key(volume, name);
            let mut conds = vec![Condition::VersionIs(key.clone(), r.version)];
            let mut ops = vec![Op::Delete(key)];
            s.free_trees(&r.value.trees, &mut conds, &mut ops);
            Ok(Txn::Commit(conds, ops, r.value.clone()))
        })
    }

    pub fn snapshot_record(&self, volume: &Uuid, name: &str) -> Result<SnapshotRecord, StateError> {
        validate_id("snapshot name", name, crate::limits::NAME_BYTES_MAX)?;
        if self
            .read::<Volume>("volume", &crate::state::keys::volume(volume))?
            .is_none()
        {
            return Err(StateError::VolumeNotFound(volume.to_string()));
        }
        self.read("snapshot", &snapshot_key(volume, name))?
            .map(|r| r.value)
            .ok_or_else(|| StateError::SnapshotNotFound {
                volume: *volume,
                name: name.to_owned(),
            })
    }

    /// The snapshots of a volume, by name.
    pub fn snapshot_records(&self, volume: &Uuid) -> Result<Vec<SnapshotRecord>, StateError> {
        if self
            .read::<Volume>("volume", &crate::state::keys::volume(volume))?
            .is_none()
        {
            return Err(StateError::VolumeNotFound(volume.to_string()));
        }
        self.read_all("snapshot", &volume_snapshots(volume))
    }

    /// Snapshots still `creating` and clones still pending that began
    /// more than `age_ms` ago: whoever began them has given up on them
    /// (or died).
    pub fn abandoned(&self, age_ms: u64) -> Result<Abandoned, StateError> {
        let s = self.snapshot()?;
        let old = |t: u64| self.now().saturating_sub(t) > age_ms;
        let snapshots = s
            .snapshots
            .values()
            .filter(|r| r.value.state == SnapshotState::Creating && old(r.value.created_ms))
            .map(|r| (r.value.volume, r.value.name.clone()))
            .collect();
        let clones = s
            .pending_clones
            .iter()
            .filter(|(_, c)| old(c.value.created_ms))
            .map(|(u, _)| *u)
            .collect();
        Ok(Abandoned { snapshots, clones })
    }

    /// Reserves the trees of clone `spec` of snapshot `name` of `source`:
    /// new extents on the snapshot trees' devices, in a pending record.
    /// `None`: the volume exists already with this spec (a retry).
    pub fn begin_clone(
        &self,
        spec: &VolumeSpec,
        source: &Uuid,
        name: &str,
    ) -> Result<Option<PendingClone>, StateError> {
        validate_id("snapshot name", name, crate::limits::NAME_BYTES_MAX)?;
        spec.validate(self.config().extent_bytes)?;
        if spec.pool.is_some() {
            return Err(ModelError::Invalid(
                "a clone's trees are on its snapshot's devices: give no pool".into(),
            )
            .into());
        }
        self.transact_allocation(|s| {
            if let Some(v) = s.volumes.get(&spec.uuid) {
                let existing = v.value.spec();
                return if existing == *spec {
                    Ok(Txn::Done(None))
                } else {
                    Err(StateError::UuidConflict {
                        uuid: spec.uuid,
                        existing,
                        provisioning: s.provisioning_of(&v.value),
                    })
                };
            }
            if let Some(c) = s.pending_clones.get(&spec.uuid) {
                return if c.value.spec == *spec
                    && c.value.source == *source
                    && c.value.snapshot == name
                {
                    Ok(Txn::Done(Some(c.value.clone())))
                } else {
                    Err(conflict(
                        "clone_in_progress",
                        format!("a clone under UUID {} is being created", spec.uuid),
                    ))
                };
            }
            if let Some(other) = s.volume_names.get(&spec.name) {
                return Err(StateError::NameTaken {
                    name: spec.name.clone(),
                    uuid: other.value,
                });
            }
            volume_in(s, source)?;
            let snap = snapshot_in(s, source, name)?;
            let snap = &snap.value;
            if snap.state != SnapshotState::Ready {
                return Err(conflict(
                    "snapshot_not_ready",
                    format!("snapshot {name} of volume {source} is still being created"),
                ));
            }
            if spec.size_bytes != snap.size_bytes || spec.layout != snap.layout {
                return Err(StateError::Unprocessable {
                    kind: "clone_mismatch",
                    message: format!(
                        "a clone of snapshot {name} must have its size ({} bytes) and layout \
                         ({:?})",
                        snap.size_bytes, snap.layout
                    ),
                });
            }
            if snap.extent_bytes != self.config().extent_bytes {
                return Err(StateError::Unprocessable {
                    kind: "clone_mismatch",
                    message: format!(
                        "snapshot {name} has {}-byte extents; this cluster creates {}-byte ones",
                        snap.extent_bytes,
                        self.config().extent_bytes
                    ),
                });
            }
            if s.volumes.len() >= crate::limits::VOLUMES_MAX {
                return Err(StateError::TooMany {
                    what: "volumes",
                    max: crate::limits::VOLUMES_MAX,
                });
            }
            let mut a = self.allocator(s)?;
            let from: Vec<Extent> = snap.trees.iter().map(|t| t.tree.clone()).collect();
            let trees = allocate_trees(&mut a, &from)?;
            let pending = PendingClone {
                spec: spec.clone(),
                source: *source,
                snapshot: name.to_owned(),
                created_ms: self.now(),
                trees,
            };
            let key = clone_key(&spec.uuid);
            Ok(Txn::Commit(
                vec![
                    Condition::Missing(key.clone()),
                    Condition::Missing(crate::state::keys::volume(&spec.uuid)),
                ],
                vec![Op::Put(key, encode(&pending))],
                Some(pending),
            ))
        })
    }

    /// The clone's trees exist on the targets: one transaction creates
    /// its volume (with those trees as extents) and drops the pending
    /// record.
    pub fn finish_clone(&self, uuid: &Uuid) -> Result<Volume, StateError> {
        self.transact_allocation(|s| {
            if let Some(v) = s.volumes.get(uuid) {
                return Ok(Txn::Done(v.value.clone()));
            }
            let c = s
                .pending_clones
                .get(uuid)
                .ok_or_else(|| StateError::VolumeNotFound(uuid.to_string()))?;
            if let Some(other) = s.volume_names.get(&c.value.spec.name) {
                return Err(StateError::NameTaken {
                    name: c.value.spec.name.clone(),
                    uuid: other.value,
                });
            }
            let spec = &c.value.spec;
            let volume = Volume {
                uuid: spec.uuid,
                name: spec.name.clone(),
                size_bytes: spec.size_bytes,
                layout: spec.layout,
                pool: None,
                extent_bytes: self.config().extent_bytes,
                extents: c.value.trees.iter().map(|t| t.tree.clone()).collect(),
                created_ms: self.now(),
            };
            volume.validate()?;
            let key = crate::state::keys::volume(uuid);
            let name_key = crate::state::keys::volume_name(&spec.name);
            let ckey = clone_key(uuid);
            Ok(Txn::Commit(
                vec![
                    Condition::Missing(key.clone()),
                    Condition::Missing(name_key.clone()),
                    Condition::VersionIs(ckey.clone(), c.version),
                ],
                vec![
                    Op::Put(key, encode(&volume)),
                    Op::Put(name_key, encode(uuid)),
                    Op::Delete(ckey),
                ],
                volume,
            ))
        })
    }

    /// Gives a pending clone up: its record goes, its trees are freed.
    /// Returns the targets holding them (to reconcile).
    pub fn drop_clone(&self, uuid: &Uuid) -> Result<Vec<String>, StateError> {
        self.transact_allocation(|s| {
            let Some(c) = s.pending_clones.get(uuid) else {
                return Ok(Txn::Done(Vec::new()));
            };
            let key = clone_key(uuid);
            let mut conds = vec![Condition::VersionIs(key.clone(), c.version)];
            let mut ops = vec![Op::Delete(key)];
            s.free_trees(&c.value.trees, &mut conds, &mut ops);
            let targets = c
                .value
                .trees
                .iter()
                .map(|t| t.tree.target.clone())
                .collect();
            Ok(Txn::Commit(conds, ops, targets))
        })
    }
}

#[cfg(feature = "server")]
pub use protocol::*;

/// Taking a snapshot and making a clone: the calls to the targets.
#[cfg(feature = "server")]
mod protocol {
    use super::*;
    use crate::program::{reconcile, ProgramError, TargetAdmin};
    use nvpool_api::admin::{SealBody, SnapshotTree as AdminTree, SnapshotTreesBody};
    use nvpool_api::rest::WRITE_HOLD_MAX_MS;
    use std::time::{Duration, Instant};

    /// How often a creation re-reads its writers' confirmations when
    /// nothing woke it ([`EPOCH_SIGNAL`] wakes it at once for one this
    /// process commits): a confirmation committed by another control
    /// plane sharing the store, or a writer gone (detached, a new
    /// session), is seen within this.
    const CONFIRM_STEP: Duration = Duration::from_millis(50);

    /// Targets a creation calls at once, one thread each: a volume spans a
    /// handful of targets, a group of volumes seldom more than this; past
    /// it the calls go in rounds, each bounded by the calls' timeout.
    const SNAPSHOT_TARGETS_PARALLEL: usize = 16;

    /// By target, then device: each tree's (live, snapshot) root pair.
    pub(crate) fn by_device(
        trees: &[SnapshotTree],
    ) -> BTreeMap<String, BTreeMap<String, Vec<AdminTree>>> {
        let mut out: BTreeMap<String, BTreeMap<String, Vec<AdminTree>>> = BTreeMap::new();
        for t in trees {
            out.entry(t.tree.target.clone())
                .or_default()
                .entry(t.tree.device.clone())
                .or_default()
                .push(AdminTree {
                    live: root_of(&t.live),
                    snapshot: root_of(&t.tree),
                });
        }
        out
    }

    /// One admin client per target holding any of `trees`, kept for every
    /// call of a creation (each client checks its target's identity once,
    /// before its first change).
    fn admins<'a>(
        cluster: &Cluster,
        trees: impl Iterator<Item = &'a SnapshotTree>,
    ) -> Result<BTreeMap<String, TargetAdmin>, ProgramError> {
        let mut out = BTreeMap::new();
        for t in trees {
            if !out.contains_key(&t.tree.target) {
                let target = cluster.target(&t.tree.target)?.target;
                out.insert(t.tree.target.clone(), TargetAdmin::new(cluster, &target)?);
            }
        }
        Ok(out)
    }

    /// Makes each target's `calls` (in order, on that target) with `call`,
    /// every target at once ([`SNAPSHOT_TARGETS_PARALLEL`] at a time).
    /// All or nothing, as one after another was: the first failure in
    /// target order is the answer, once every call of its round has
    /// returned, and no later round starts; the caller gives the
    /// creation up, which frees and releases what the others made.
    fn on_each_target<B: Sync>(
        admins: &BTreeMap<String, TargetAdmin>,
        calls: &BTreeMap<String, Vec<(String, B)>>,
        call: impl Fn(&TargetAdmin, &str, &B) -> Result<(), ProgramError> + Sync,
    ) -> Result<(), ProgramError> {
        let work: Vec<(&TargetAdmin, &Vec<(String, B)>)> = calls
            .iter()
            .map(|(target, calls)| {
                admins.get(target).map(|a| (a, calls)).ok_or_else(|| {
                    StateError::Inconsistent(format!("no admin client for target {target}"))
                })
            })
            .collect::<Result<_, _>>()?;
        for round in work.chunks(SNAPSHOT_TARGETS_PARALLEL) {
            let results: Vec<Result<(), ProgramError>> = std::thread::scope(|scope| {
                let call = &call;
                let handles: Vec<_> = round
                    .iter()
                    .map(|&(admin, calls)| {
                        scope.spawn(move || {
                            calls
                                .iter()
                                .try_for_each(|(device, body)| call(admin, device, body))
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                    .collect()
            });
            results.into_iter().collect::<Result<(), _>>()?;
        }
        Ok(())
    }

    /// Has every target create the trees of each `(trees, epoch)` (`epoch`
    /// 0: complete at once), all targets at once.
    fn create_trees(
        admins: &BTreeMap<String, TargetAdmin>,
        sets: &[(&[SnapshotTree], u32)],
    ) -> Result<(), ProgramError> {
        let mut calls: BTreeMap<String, Vec<(String, SnapshotTreesBody)>> = BTreeMap::new();
        for &(trees, epoch) in sets {
            for (target, devices) in by_device(trees) {
                let at = calls.entry(target).or_default();
                for (device, trees) in devices {
                    at.push((device, SnapshotTreesBody { epoch, trees }));
                }
            }
        }
        on_each_target(admins, &calls, |admin, device, body| {
            admin.snapshot_trees(device, body)
        })
    }

    /// Has every target seal the snapshot trees of `rs`, all targets at
    /// once.
    fn seal(
        admins: &BTreeMap<String, TargetAdmin>,
        rs: &[SnapshotRecord],
    ) -> Result<(), ProgramError> {
        let mut calls: BTreeMap<String, Vec<(String, SealBody)>> = BTreeMap::new();
        for r in rs {
            for (target, devices) in by_device(&r.trees) {
                let at = calls.entry(target).or_default();
                for (device, trees) in devices {
                    let snapshots = trees.iter().map(|t| t.snapshot).collect();
                    at.push((device, SealBody { snapshots }));
                }
            }
        }
        on_each_target(admins, &calls, |admin, device, body| {
            admin.seal(device, body)
        })
    }

    /// The steps of T5 after the records, for one volume's snapshot or a
    /// group's at one cut: trees, epochs raised (all or none; held if the
    /// cut has more than one writer), confirmations, holds lifted, seal,
    /// ready. A hold this sets is lifted on every path once set.
    fn drive(
        cluster: &Cluster,
        rs: &[SnapshotRecord],
        phases: &mut Phases,
    ) -> Result<Vec<SnapshotRecord>, ProgramError> {
        // Four store transactions, each its own step's compare-and-set:
        // the records (begun before this), the raise, every writer's
        // confirmation, ready. None folds into its neighbour: the raise
        // must follow the trees on the targets (a write tagged above the
        // cut landing before its tree exists would be shared into the
        // snapshot), ready must follow the seal, and the seal the
        // confirmations; lifting a hold (a fifth, with more than one
        // writer) comes before the seal so the writers wait for no
        // target call.
        let admins = admins(cluster, rs.iter().flat_map(|r| r.trees.iter()))?;
        let sets: Vec<(&[SnapshotTree], u32)> =
            rs.iter().map(|r| (r.trees.as_slice(), r.epoch)).collect();
        create_trees(&admins, &sets)?;
        phases.lap(Phase::Trees);
        let cuts: Vec<(Uuid, u32)> = rs.iter().map(|r| (r.volume, r.epoch)).collect();
        // The barrier's budget counts from before any hold is set.
        let start = Instant::now();
        let (epochs, held) = match cluster.raise_epochs(&cuts)? {
            Raise::Raised { epochs, held } => (epochs, held),
            Raise::Moved { volume, epoch } => {
                let cut = cuts.iter().find(|c| c.0 == volume).map_or(epoch, |c| c.1);
                return Err(failed(
                    rs,
                    volume,
                    format!(
                        "another snapshot raised the volume's write epoch past {cut} meanwhile; \
                         take it again"
                    ),
                ));
            }
            Raise::Held { volume } => {
                return Err(failed(
                    rs,
                    volume,
                    "another snapshot holds the volume's writers at its barrier; take it again"
                        .to_owned(),
                ))
            }
        };
        phases.lap(Phase::Raise);
        let raised: Vec<(Uuid, u32)> = cuts.iter().map(|c| c.0).zip(epochs).collect();
        let waited = wait_confirmed(cluster, rs, &raised, held, start);
        phases.lap(Phase::Confirm);
        if held {
            match cluster.clear_holds(&raised) {
                Ok(gone) => {
                    if let (Ok(()), Some(v)) = (&waited, gone.first()) {
                        return Err(failed(
                            rs,
                            *v,
                            "the hold on the volume's writers was lifted before every writer \
                             reached the barrier"
                                .to_owned(),
                        ));
                    }
                }
                Err(e) if waited.is_ok() => return Err(e.into()),
                // The wait's failure is the one to report; the leader
                // lifts a leftover hold once it is stale.
                Err(e) => tracing::warn!(error = %e, "lifting the write holds failed"),
            }
        }
        waited?;
        phases.lap(Phase::Release);
        seal(&admins, rs)?;
        phases.lap(Phase::Seal);
        let done = cluster.finish_snapshots(&keys(rs))?;
        phases.lap(Phase::Ready);
        Ok(done)
    }

    /// The steps of [`drive`], each timed (the log's `phases_ms`).
    #[derive(Debug, Clone, Copy)]
    enum Phase {
        Begin,
        Trees,
        Raise,
        Confirm,
        Release,
        Seal,
        Ready,
    }

    /// Milliseconds each step of a creation took, in order: what a slow
    /// creation spent its time on.
    struct Phases {
        last: Instant,
        laps: Vec<(Phase, Duration)>,
    }

    impl Phases {
        fn new(since: Instant) -> Phases {
            Phases {
                last: since,
                laps: Vec::new(),
            }
        }

        fn lap(&mut self, p: Phase) {
            let now = Instant::now();
            self.laps.push((p, now - self.last));
            self.last = now;
        }
    }

    impl std::fmt::Display for Phases {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            for (i, (p, d)) in self.laps.iter().enumerate() {
                let sep = if i == 0 { "" } else { " " };
                let name = format!("{p:?}").to_lowercase();
                write!(f, "{sep}{name}={:.1}", d.as_secs_f64() * 1e3)?;
            }
            Ok(())
        }
    }

    /// `SnapshotFailed` for the cut of `rs`, at `volume`.
    fn failed(rs: &[SnapshotRecord], volume: Uuid, reason: String) -> ProgramError {
        let name = rs.first().map(|r| r.name.clone()).unwrap_or_default();
        StateError::SnapshotFailed {
            volume,
            name,
            reason,
        }
        .into()
    }

    fn keys(rs: &[SnapshotRecord]) -> Vec<(Uuid, String)> {
        rs.iter().map(|r| (r.volume, r.name.clone())).collect()
    }

    /// Waits until every writer of every volume confirmed its raised
    /// epoch (held, if `held`): within the confirmation wait, and a held
    /// one also within [`WRITE_HOLD_MAX_MS`] of `start`.
    fn wait_confirmed(
        cluster: &Cluster,
        rs: &[SnapshotRecord],
        raised: &[(Uuid, u32)],
        held: bool,
        start: Instant,
    ) -> Result<(), ProgramError> {
        let mut wait_ms = cluster.snapshot_confirm_wait_ms();
        if held {
            wait_ms = wait_ms.min(WRITE_HOLD_MAX_MS);
        }
        let deadline = start + Duration::from_millis(wait_ms);
        loop {
            // Counted before the read: a confirmation committed after it
            // ends the wait below at once.
            let seen = EPOCH_SIGNAL.seen();
            let s = cluster.snapshot()?;
            let pending: Vec<(Uuid, u32, Vec<String>)> = raised
                .iter()
                .map(|&(v, e)| (v, e, s.epoch_pending(&v, e, held)))
                .filter(|p| !p.2.is_empty())
                .collect();
            let Some(&(first, _, _)) = pending.first() else {
                return Ok(());
            };
            if Instant::now() >= deadline || cluster.closing() {
                let group = raised.len() > 1;
                let who: Vec<String> = pending
                    .iter()
                    .map(|(v, e, hosts)| {
                        let mut m = format!("{} did not confirm write epoch {e}", hosts.join(", "));
                        if group {
                            m.push_str(&format!(" of volume {v}"));
                        }
                        if held {
                            m.push_str(" held");
                        }
                        m
                    })
                    .collect();
                return Err(failed(
                    rs,
                    first,
                    format!("{} within {wait_ms} ms", who.join("; ")),
                ));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            EPOCH_SIGNAL.wait(seen, left.min(CONFIRM_STEP));
        }
    }

    /// Has the targets of `trees` release them now (reconciliation would
    /// at its next round).
    fn release(cluster: &Cluster, trees: &[SnapshotTree]) {
        let targets: std::collections::BTreeSet<&str> =
            trees.iter().map(|t| t.tree.target.as_str()).collect();
        for t in targets {
            if let Err(e) = reconcile(cluster, t) {
                tracing::warn!(target = t, error = %e, "releasing freed trees failed; \
                    reconciliation retries");
            }
        }
    }

    /// Takes snapshot `name` of `volume` (T5); `false` when it existed
    /// already. A failure gives it up (its trees freed, its record gone)
    /// and is `SnapshotFailed`, saying why.
    pub fn take_snapshot(
        cluster: &Cluster,
        volume: &Uuid,
        name: &str,
    ) -> Result<(SnapshotRecord, bool), ProgramError> {
        let since = Instant::now();
        let begun = cluster.begin_snapshot(volume, name)?;
        if !begun.created {
            return Ok((begun.record, false));
        }
        let r = take(cluster, &[begun.record], since)?
            .into_iter()
            .next()
            .ok_or_else(|| StateError::Inconsistent(format!("snapshot {name} finished as none")))?;
        Ok((r, true))
    }

    /// Drives the begun snapshots `rs` (one volume's, or a group's at one
    /// cut) to ready; on any failure gives them all up and is
    /// `SnapshotFailed`, naming the volume it failed at and why. `since`:
    /// when the creation began (before its records), for the log.
    pub(crate) fn take(
        cluster: &Cluster,
        rs: &[SnapshotRecord],
        since: Instant,
    ) -> Result<Vec<SnapshotRecord>, ProgramError> {
        let mut phases = Phases::new(since);
        phases.lap(Phase::Begin);
        match drive(cluster, rs, &mut phases) {
            Ok(done) => {
                let total_ms = since.elapsed().as_secs_f64() * 1e3;
                for r in &done {
                    tracing::info!(volume = %r.volume, snapshot = %r.name, epoch = r.epoch,
                        trees = r.trees.len(), group = r.group.len(), total_ms,
                        phases_ms = %phases, "snapshot created");
                }
                Ok(done)
            }
            Err(e) => {
                let (volume, mut reason) = match e {
                    ProgramError::State(StateError::SnapshotFailed { volume, reason, .. }) => {
                        (volume, reason)
                    }
                    other => (
                        rs.first().map_or(Uuid([0; 16]), |r| r.volume),
                        other.to_string(),
                    ),
                };
                if rs.len() > 1 {
                    reason.push_str(&format!(
                        " (every snapshot of the group of {} volumes was given up)",
                        rs.len()
                    ));
                }
                tracing::warn!(%volume, reason = %reason, snapshots = rs.len(),
                    "snapshot given up");
                give_up(cluster, rs);
                Err(failed(rs, volume, reason))
            }
        }
    }

    /// Gives creating snapshots up: records gone, trees freed and
    /// released.
    fn give_up(cluster: &Cluster, rs: &[SnapshotRecord]) {
        match cluster.drop_creating(&keys(rs)) {
            Ok(dropped) => {
                let trees: Vec<SnapshotTree> = dropped.into_iter().flat_map(|r| r.trees).collect();
                release(cluster, &trees);
            }
            Err(e) => tracing::warn!(error = %e, snapshots = rs.len(),
                "giving the snapshots up failed; the leader retries"),
        }
    }

    /// Deletes a ready snapshot: its trees are freed and released.
    pub fn delete_snapshot(
        cluster: &Cluster,
        volume: &Uuid,
        name: &str,
    ) -> Result<(), ProgramError> {
        let r = cluster.drop_snapshot(volume, name, false)?;
        tracing::info!(%volume, snapshot = name, "snapshot deleted");
        release(cluster, &r.trees);
        Ok(())
    }

    /// Creates clone `spec` of snapshot `name` of `source` (T6): trees
    /// reserved, created on the targets, then the volume. `false`: it
    /// existed already. A target failure leaves no volume.
    pub fn make_clone(
        cluster: &Cluster,
        spec: &VolumeSpec,
        source: &Uuid,
        name: &str,
    ) -> Result<(Volume, bool), ProgramError> {
        let Some(pending) = cluster.begin_clone(spec, source, name)? else {
            return Ok((cluster.volume(&spec.uuid)?.volume, false));
        };
        let made = admins(cluster, pending.trees.iter())
            .and_then(|admins| create_trees(&admins, &[(&pending.trees, 0)]))
            .and_then(|()| Ok(cluster.finish_clone(&spec.uuid)?));
        match made {
            Ok(v) => {
                tracing::info!(volume = %v.uuid, name = %v.name, %source, snapshot = name,
                    "clone created");
                Ok((v, true))
            }
            Err(e) => {
                tracing::warn!(volume = %spec.uuid, %source, snapshot = name, error = %e,
                    "clone given up");
                if let Err(e) = cluster.drop_clone(&spec.uuid) {
                    tracing::warn!(volume = %spec.uuid, error = %e,
                        "giving the clone up failed; the leader retries");
                } else {
                    release(cluster, &pending.trees);
                }
                Err(e)
            }
        }
    }

    /// Gives up snapshots and clones whose creator is gone (a restart, a
    /// new leader): the leader's work.
    /// Holds on writers left by a creator that died at its barrier are
    /// lifted too (any hold past `ENGINE_HOLD_MAX_MS`).
    pub fn give_up_abandoned(cluster: &Cluster, age_ms: u64) -> Result<usize, StateError> {
        for volume in cluster.clear_stale_holds()? {
            tracing::warn!(%volume, "write hold left by a snapshot whose creator is gone; lifted");
        }
        let Abandoned { snapshots, clones } = cluster.abandoned(age_ms)?;
        let n = snapshots.len() + clones.len();
        for (volume, name) in snapshots {
            tracing::warn!(%volume, snapshot = %name, "snapshot abandoned while creating; given up");
            if let Err(e) = cluster
                .drop_creating(&[(volume, name.clone())])
                .map(|dropped| {
                    let trees: Vec<SnapshotTree> =
                        dropped.into_iter().flat_map(|r| r.trees).collect();
                    release(cluster, &trees);
                })
            {
                tracing::warn!(%volume, snapshot = %name, error = %e,
                    "giving the snapshot up failed; the leader retries");
            }
        }
        for uuid in clones {
            tracing::warn!(volume = %uuid, "clone abandoned while creating; given up");
            let targets = cluster.drop_clone(&uuid)?;
            for t in targets {
                if let Err(e) = reconcile(cluster, &t) {
                    tracing::warn!(target = %t, error = %e, "releasing freed trees failed");
                }
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{decode, Layout, Stored};

    #[derive(Serialize)]
    struct Format3Confirmed {
        session: u64,
        epoch: u32,
    }

    #[derive(Serialize)]
    struct Format3WriteEpoch {
        volume: Uuid,
        epoch: u32,
        confirmed: BTreeMap<String, Format3Confirmed>,
    }

    #[derive(Serialize)]
    struct Format3Snapshot {
        volume: Uuid,
        name: String,
        epoch: u32,
        state: SnapshotState,
        created_ms: u64,
        size_bytes: u64,
        layout: Layout,
        extent_bytes: u64,
        trees: Vec<SnapshotTree>,
    }

    fn format_3<T: Serialize>(v: &T) -> Vec<u8> {
        let mut out = vec![3];
        out.extend(postcard::to_allocvec(v).unwrap());
        out
    }

    fn round_trip<T: Stored + PartialEq + std::fmt::Debug>(v: &T) {
        assert_eq!(decode::<T>("value", &encode(v)).as_ref(), Ok(v));
    }

    #[test]
    fn format_3_write_epochs_read_with_no_hold() {
        let volume = Uuid([7; 16]);
        let old = Format3WriteEpoch {
            volume,
            epoch: 4,
            confirmed: [(
                "h".to_owned(),
                Format3Confirmed {
                    session: 9,
                    epoch: 4,
                },
            )]
            .into(),
        };
        let read: WriteEpoch = decode("write epoch", &format_3(&old)).unwrap();
        assert_eq!(read.epoch, 4);
        assert_eq!(read.hold_since_ms, None);
        assert_eq!(
            read.confirmed["h"],
            Confirmed {
                session: 9,
                epoch: 4,
                held: false
            }
        );
        let mut held = read.clone();
        held.hold_since_ms = Some(5);
        held.confirmed.get_mut("h").unwrap().held = true;
        round_trip(&held);
        assert!(held.held_at(5 + ENGINE_HOLD_MAX_MS - 1));
        assert!(
            !held.held_at(5 + ENGINE_HOLD_MAX_MS),
            "past the engines' own limit"
        );
    }

    #[test]
    fn format_3_snapshots_read_as_no_group() {
        let old = Format3Snapshot {
            volume: Uuid([7; 16]),
            name: "s1".into(),
            epoch: 2,
            state: SnapshotState::Ready,
            created_ms: 3,
            size_bytes: 1 << 20,
            layout: Layout::Concat,
            extent_bytes: 1 << 20,
            trees: Vec::new(),
        };
        let read: SnapshotRecord = decode("snapshot", &format_3(&old)).unwrap();
        assert_eq!((read.name.as_str(), read.epoch), ("s1", 2));
        assert!(read.group.is_empty());
        let mut grouped = read;
        grouped.group = vec![Uuid([7; 16]), Uuid([8; 16])];
        round_trip(&grouped);
    }
}
