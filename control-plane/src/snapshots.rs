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

use crate::model::{encode, validate_id, Extent, ModelError, Uuid, Volume, VolumeSpec};
use crate::state::{unchanged, Cluster, Snapshot, StateError, Txn, Versioned};
use crate::store::{Condition, Op};
pub use nvpool_api::rest::SnapshotState;
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
}

impl crate::model::Stored for WriteEpoch {}

impl WriteEpoch {
    /// The stored record, or the first epoch with nothing confirmed (no
    /// record: no snapshot was ever taken).
    fn read(read: Option<&Versioned<WriteEpoch>>, volume: &Uuid) -> WriteEpoch {
        read.map_or_else(
            || WriteEpoch {
                volume: *volume,
                epoch: FIRST_WRITE_EPOCH,
                confirmed: BTreeMap::new(),
            },
            |r| r.value.clone(),
        )
    }
}

/// An engine's confirmation: it tags new writes with `epoch`, and every
/// write it tagged lower has completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Confirmed {
    pub session: u64,
    pub epoch: u32,
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
}

impl crate::model::Stored for SnapshotRecord {}

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
    /// confirms with any).
    pub fn epoch_pending(&self, volume: &Uuid, epoch: u32) -> Vec<String> {
        let sessions = self.copy_state(volume).sessions;
        let confirmed = self.write_epochs.get(volume).map(|w| &w.value.confirmed);
        self.writers_of(volume)
            .into_iter()
            .filter(|h| {
                let c = confirmed.and_then(|c| c.get(h));
                !c.is_some_and(|c| {
                    c.epoch >= epoch && sessions.get(h).is_none_or(|&s| s == c.session)
                })
            })
            .collect()
    }
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

fn conflict(kind: &'static str, message: String) -> StateError {
    StateError::Conflict { kind, message }
}

/// The volume's record and its version, or `VolumeNotFound`.
fn volume_in<'a>(s: &'a Snapshot, uuid: &Uuid) -> Result<&'a Versioned<Volume>, StateError> {
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

    /// `host`'s engine of `session` tags new writes with `epoch` and its
    /// older writes completed. A session other than the one the host
    /// registered is `StaleSession` (that engine no longer serves).
    pub fn confirm_epoch(
        &self,
        volume: &Uuid,
        host: &str,
        session: u64,
        epoch: u32,
    ) -> Result<(), StateError> {
        self.transact(|s| {
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
            let c = w
                .confirmed
                .entry(host.to_owned())
                .or_insert(Confirmed { session, epoch: 0 });
            if c.session == session && c.epoch >= epoch {
                return Ok(Txn::Done(()));
            }
            if c.session != session {
                c.epoch = 0;
            }
            *c = Confirmed {
                session,
                epoch: c.epoch.max(epoch),
            };
            let key = write_epoch_key(volume);
            Ok(Txn::Commit(
                vec![unchanged(&key, read.map(|r| r.version))],
                vec![Op::Put(key, encode(&w))],
                (),
            ))
        })
    }

    /// Raises the volume's write epoch from `cut` to `cut + 1` and wakes
    /// its attachments' long polls; returns the new epoch. `None` when
    /// the epoch is no longer `cut` (another snapshot raised it
    /// meanwhile): writes tagged above `cut` may have landed before this
    /// snapshot's trees existed, so its cut is not one and it must be
    /// given up (a compare-and-set; design/thin-snapshots.md T5).
    /// Confirmations of hosts no longer attached go.
    pub fn raise_epoch(&self, volume: &Uuid, cut: u32) -> Result<Option<u32>, StateError> {
        let r = self.change_copy_state(volume, |s, cs, conds, ops| {
            let read = s.write_epochs.get(volume);
            let mut w = WriteEpoch::read(read, volume);
            if w.epoch != cut {
                return Ok(Some(None));
            }
            w.epoch = cut.saturating_add(1);
            w.confirmed
                .retain(|h, _| s.attachments.contains_key(&(*volume, h.clone())));
            cs.revision += 1;
            let key = write_epoch_key(volume);
            conds.push(unchanged(&key, read.map(|r| r.version)));
            ops.push(Op::Put(key, encode(&w)));
            Ok(Some(Some(w.epoch)))
        })?;
        Ok(r.flatten())
    }

    /// Writers of the volume that have not confirmed `epoch` yet.
    pub fn epoch_pending(&self, volume: &Uuid, epoch: u32) -> Result<Vec<String>, StateError> {
        Ok(self.snapshot()?.epoch_pending(volume, epoch))
    }

    /// Records snapshot `name` of `volume` as `creating` at the volume's
    /// write epoch, with one new tree per extent copy; a snapshot of that
    /// name already there is returned as it is.
    pub fn begin_snapshot(&self, volume: &Uuid, name: &str) -> Result<Begun, StateError> {
        validate_id("snapshot name", name, crate::limits::NAME_BYTES_MAX)?;
        self.transact_allocation(|s| {
            let v = volume_in(s, volume)?;
            if let Some(r) = s.snapshots.get(&(*volume, name.to_owned())) {
                return Ok(Txn::Done(Begun {
                    record: r.value.clone(),
                    created: false,
                }));
            }
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
            let mut a = self.allocator(s)?;
            let trees = allocate_trees(&mut a, &v.value.extents)?;
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
            };
            let key = snapshot_key(volume, name);
            let vkey = crate::state::keys::volume(volume);
            Ok(Txn::Commit(
                vec![
                    Condition::Missing(key.clone()),
                    Condition::VersionIs(vkey, v.version),
                ],
                vec![Op::Put(key, encode(&record))],
                Begun {
                    record,
                    created: true,
                },
            ))
        })
    }

    /// Marks a creating snapshot ready.
    pub fn finish_snapshot(&self, volume: &Uuid, name: &str) -> Result<SnapshotRecord, StateError> {
        self.update("snapshot", &snapshot_key(volume, name), |r| {
            let mut r: SnapshotRecord = r.ok_or_else(|| StateError::SnapshotNotFound {
                volume: *volume,
                name: name.to_owned(),
            })?;
            if r.state == SnapshotState::Ready {
                return Ok((None, r));
            }
            r.state = SnapshotState::Ready;
            Ok((Some(r.clone()), r))
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
            let r = s
                .snapshots
                .get(&(*volume, name.to_owned()))
                .ok_or_else(|| StateError::SnapshotNotFound {
                    volume: *volume,
                    name: name.to_owned(),
                })?;
            if r.value.state == SnapshotState::Creating && !creating {
                return Err(conflict(
                    "snapshot_creating",
                    format!("snapshot {name} of volume {volume} is being created"),
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
            let snap = s
                .snapshots
                .get(&(*source, name.to_owned()))
                .ok_or_else(|| StateError::SnapshotNotFound {
                    volume: *source,
                    name: name.to_owned(),
                })?;
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
    use std::time::{Duration, Instant};

    const CONFIRM_STEP: Duration = Duration::from_millis(50);

    /// By target, then device: the trees to create.
    fn by_device(trees: &[SnapshotTree]) -> BTreeMap<String, BTreeMap<String, Vec<AdminTree>>> {
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

    /// Has every target create `trees` (`epoch` 0: complete at once).
    fn create_trees(
        cluster: &Cluster,
        trees: &[SnapshotTree],
        epoch: u32,
    ) -> Result<(), ProgramError> {
        for (target, devices) in by_device(trees) {
            let t = cluster.target(&target)?.target;
            let admin = TargetAdmin::new(cluster, &t)?;
            for (device, trees) in devices {
                admin.snapshot_trees(&device, &SnapshotTreesBody { epoch, trees })?;
            }
        }
        Ok(())
    }

    /// The steps of T5 after the record: trees, epoch, confirmations, seal.
    fn drive(cluster: &Cluster, r: &SnapshotRecord) -> Result<SnapshotRecord, ProgramError> {
        create_trees(cluster, &r.trees, r.epoch)?;
        let Some(next) = cluster.raise_epoch(&r.volume, r.epoch)? else {
            return Err(StateError::SnapshotFailed {
                volume: r.volume,
                name: r.name.clone(),
                reason: format!(
                    "another snapshot raised the volume's write epoch past {} meanwhile; \
                     take it again",
                    r.epoch
                ),
            }
            .into());
        };
        let wait = Duration::from_millis(cluster.snapshot_confirm_wait_ms());
        let deadline = Instant::now() + wait;
        loop {
            let pending = cluster.epoch_pending(&r.volume, next)?;
            if pending.is_empty() {
                break;
            }
            if Instant::now() >= deadline || cluster.closing() {
                return Err(StateError::SnapshotFailed {
                    volume: r.volume,
                    name: r.name.clone(),
                    reason: format!(
                        "{} did not confirm write epoch {next} within {} ms",
                        pending.join(", "),
                        wait.as_millis()
                    ),
                }
                .into());
            }
            std::thread::sleep(CONFIRM_STEP);
        }
        for (target, devices) in by_device(&r.trees) {
            let t = cluster.target(&target)?.target;
            let admin = TargetAdmin::new(cluster, &t)?;
            for (device, trees) in devices {
                let snapshots = trees.iter().map(|t| t.snapshot).collect();
                admin.seal(&device, &SealBody { snapshots })?;
            }
        }
        Ok(cluster.finish_snapshot(&r.volume, &r.name)?)
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
        let begun = cluster.begin_snapshot(volume, name)?;
        if !begun.created {
            return Ok((begun.record, false));
        }
        match drive(cluster, &begun.record) {
            Ok(r) => {
                tracing::info!(%volume, snapshot = name, epoch = r.epoch, trees = r.trees.len(),
                    "snapshot created");
                Ok((r, true))
            }
            Err(e) => {
                let reason = match e {
                    ProgramError::State(StateError::SnapshotFailed { reason, .. }) => reason,
                    other => other.to_string(),
                };
                tracing::warn!(%volume, snapshot = name, reason = %reason, "snapshot given up");
                give_up(cluster, volume, name);
                Err(StateError::SnapshotFailed {
                    volume: *volume,
                    name: name.to_owned(),
                    reason,
                }
                .into())
            }
        }
    }

    /// Gives a creating snapshot up: record gone, trees freed and released.
    fn give_up(cluster: &Cluster, volume: &Uuid, name: &str) {
        match cluster.drop_snapshot(volume, name, true) {
            Ok(r) => release(cluster, &r.trees),
            Err(e) => tracing::warn!(%volume, snapshot = name, error = %e,
                "giving the snapshot up failed; the leader retries"),
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
        let made = create_trees(cluster, &pending.trees, 0)
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
    pub fn give_up_abandoned(cluster: &Cluster, age_ms: u64) -> Result<usize, StateError> {
        let Abandoned { snapshots, clones } = cluster.abandoned(age_ms)?;
        let n = snapshots.len() + clones.len();
        for (volume, name) in snapshots {
            tracing::warn!(%volume, snapshot = %name, "snapshot abandoned while creating; given up");
            give_up(cluster, &volume, &name);
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
