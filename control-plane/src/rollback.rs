//! Rolling a detached thin volume back to one of its snapshots
//! (design/thin-snapshots.md T6): every extent copy's live tree takes the
//! contents of the snapshot's tree on the same device, one admin call per
//! device, whatever the size.
//!
//! ```text
//!  begin_rollback   one transaction: volume, snapshot ready, no host, not
//!                   served, no copy job, extents = the snapshot's live
//!                   ones; writes /rollbacks/{uuid}
//!  targets          POST /v1/devices/{id}/rollback per device (idempotent)
//!  finish_rollback  one transaction: the volume record unchanged since the
//!                   check (an attach rewrites it), then the mark goes
//! ```
//!
//! | key | value |
//! |---|---|
//! | `/rollbacks/{uuid}` | [`RollbackMark`]: a rollback of the volume began and has not finished |
//!
//! The mark stays when a target fails (or the volume changed meanwhile):
//! some copies may hold the snapshot and others the newer data, so the
//! volume must not be written until a rollback finishes. The admin
//! finishes it by repeating the rollback (to the same snapshot, or, once
//! this one failed, to another): the target calls are idempotent.

use crate::model::{encode, validate_id, Uuid, Volume};
use crate::snapshots::{snapshot_key, SnapshotRecord, SnapshotState};
use crate::state::{unchanged, Cluster, Snapshot, StateError, Txn};
use crate::store::{Condition, Op, Revision};
use serde::{Deserialize, Serialize};

pub const ROLLBACKS: &str = "/rollbacks/";

pub fn rollback_key(volume: &Uuid) -> String {
    format!("{ROLLBACKS}{volume}")
}

/// A rollback of a volume that began and has not finished.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollbackMark {
    pub volume: Uuid,
    /// The snapshot it rolls back to.
    pub snapshot: String,
    /// Counts the rollbacks begun on this mark: a rollback finishes only
    /// the mark it wrote.
    pub attempt: u64,
    /// It ended without finishing (a target failed, or the volume changed
    /// meanwhile): another snapshot may be rolled back to.
    pub failed: bool,
    pub started_ms: u64,
}

impl crate::model::Stored for RollbackMark {}

/// What [`Cluster::begin_rollback`] checked and marked.
#[derive(Debug, Clone)]
pub struct BegunRollback {
    pub snapshot: SnapshotRecord,
    /// The mark's attempt.
    pub attempt: u64,
    /// The volume record's version at the check: any change to it (an
    /// attach rewrites it) before the finish fails the rollback.
    pub volume_version: Revision,
    /// The store's revision at the check: a snapshot of the volume
    /// written after it was taken during the rollback.
    pub revision: Revision,
}

/// `volume_attached` naming the hosts, if any has the volume attached.
fn attached(s: &Snapshot, volume: &Uuid) -> Result<(), StateError> {
    let hosts: Vec<String> = s
        .attachments_of(volume)
        .iter()
        .map(|a| a.value.host_nqn.clone())
        .collect();
    if hosts.is_empty() {
        return Ok(());
    }
    Err(conflict(
        "volume_attached",
        format!(
            "volume {volume} is attached to {}: detach it first",
            hosts.join(", ")
        ),
    ))
}

fn conflict(kind: &'static str, message: String) -> StateError {
    StateError::Conflict { kind, message }
}

impl Cluster {
    /// The volume's unfinished rollback, if any.
    pub fn rollback_mark(&self, volume: &Uuid) -> Result<Option<RollbackMark>, StateError> {
        Ok(self
            .read::<RollbackMark>("rollback", &rollback_key(volume))?
            .map(|m| m.value))
    }

    /// Checks that `volume` may be rolled back to its snapshot `name`
    /// and marks it (one transaction): the snapshot is ready, no host
    /// has the volume attached or served, no copy of it is under way,
    /// and its extents are those the snapshot was taken of. A rollback
    /// to another snapshot that has neither finished nor failed is
    /// `rollback_in_progress`.
    pub fn begin_rollback(&self, volume: &Uuid, name: &str) -> Result<BegunRollback, StateError> {
        validate_id("snapshot name", name, crate::limits::NAME_BYTES_MAX)?;
        let mark_key = rollback_key(volume);
        self.transact(|s| {
            let v = s
                .volumes
                .get(volume)
                .ok_or_else(|| StateError::VolumeNotFound(volume.to_string()))?;
            let snap = crate::snapshots::snapshot_in(s, volume, name)?;
            if snap.value.state != SnapshotState::Ready {
                return Err(conflict(
                    "snapshot_creating",
                    format!("snapshot {name} of volume {volume} is being created"),
                ));
            }
            if let Some(other) = s
                .snapshots_of(volume)
                .into_iter()
                .find(|r| r.value.state == SnapshotState::Creating)
            {
                return Err(conflict(
                    "snapshot_creating",
                    format!(
                        "snapshot {} of volume {volume} is being created",
                        other.value.name
                    ),
                ));
            }
            attached(s, volume)?;
            let served = self.served(volume)?;
            if let Some((rec, _)) = served.as_ref().filter(|(r, _)| !r.hosts.is_empty()) {
                return Err(conflict(
                    "volume_attached",
                    format!(
                        "volume {volume} is served to {}: detach them first",
                        rec.hosts.join(", ")
                    ),
                ));
            }
            if !s.copy_state(volume).jobs.is_empty() {
                return Err(conflict(
                    "copy_in_progress",
                    format!(
                        "volume {volume} has copies under way (resync or move); \
                         roll it back once they are over"
                    ),
                ));
            }
            let live = snap.value.trees.iter().map(|t| &t.live);
            if !v.value.extents.iter().eq(live) {
                return Err(conflict(
                    "layout_changed",
                    format!(
                        "volume {volume} was resized or its copies moved since snapshot \
                         {name}: its extents are not the ones the snapshot holds"
                    ),
                ));
            }
            let read = self.read::<RollbackMark>("rollback", &mark_key)?;
            if let Some(m) = read.as_ref().map(|m| &m.value) {
                if m.snapshot != name && !m.failed {
                    return Err(conflict(
                        "rollback_in_progress",
                        format!(
                            "a rollback of volume {volume} to snapshot {} is under way (or \
                             was interrupted: repeat it)",
                            m.snapshot
                        ),
                    ));
                }
            }
            let mark = RollbackMark {
                volume: *volume,
                snapshot: name.to_owned(),
                attempt: read.as_ref().map_or(1, |m| m.value.attempt + 1),
                failed: false,
                started_ms: self.now(),
            };
            let served_key = crate::paths::served_key(volume);
            let cs = s.copy_states.get(volume).map(|c| c.version);
            let conds = vec![
                Condition::VersionIs(crate::state::keys::volume(volume), v.version),
                Condition::VersionIs(snapshot_key(volume, name), snap.version),
                unchanged(&served_key, served.as_ref().map(|(_, version)| *version)),
                unchanged(&crate::resync::copy_state_key(volume), cs),
                unchanged(&mark_key, read.as_ref().map(|m| m.version)),
            ];
            let begun = BegunRollback {
                snapshot: snap.value.clone(),
                attempt: mark.attempt,
                volume_version: v.version,
                revision: s.revision,
            };
            Ok(Txn::Commit(
                conds,
                vec![Op::Put(mark_key.clone(), encode(&mark))],
                begun,
            ))
        })
    }

    /// Every target rolled back: the mark goes, if the volume record is as
    /// the check left it and no snapshot of it was taken meanwhile. A
    /// volume attached meanwhile is `volume_attached`, one otherwise
    /// changed (resized, moved; or attached and detached again)
    /// `layout_changed`, a snapshot taken meanwhile `snapshot_creating`;
    /// each keeps its mark, as failed.
    pub fn finish_rollback(
        &self,
        volume: &Uuid,
        begun: &BegunRollback,
    ) -> Result<Volume, StateError> {
        let mark_key = rollback_key(volume);
        let r = self.transact(|s| {
            let v = s
                .volumes
                .get(volume)
                .ok_or_else(|| StateError::VolumeNotFound(volume.to_string()))?;
            let Some(read) = self.read::<RollbackMark>("rollback", &mark_key)? else {
                // Another rollback of the same snapshot finished it.
                return Ok(Txn::Done(Ok(v.value.clone())));
            };
            let cond = Condition::VersionIs(mark_key.clone(), read.version);
            let taken = s
                .snapshots_of(volume)
                .into_iter()
                .find(|r| r.version > begun.revision && r.value.name != begun.snapshot.name);
            let changed = if v.version != begun.volume_version {
                Some(attached(s, volume).err().unwrap_or_else(|| {
                    conflict(
                        "layout_changed",
                        format!(
                            "volume {volume} was attached, resized or moved while it was rolled \
                             back: its copies may differ; roll it back again"
                        ),
                    )
                }))
            } else {
                taken.map(|r| {
                    conflict(
                        "snapshot_creating",
                        format!(
                            "snapshot {} of volume {volume} was taken while the volume was \
                             rolled back: delete it, then roll the volume back again",
                            r.value.name
                        ),
                    )
                })
            };
            if let Some(e) = changed {
                let mut m = read.value;
                m.failed = true;
                return Ok(Txn::Commit(
                    vec![cond],
                    vec![Op::Put(mark_key.clone(), encode(&m))],
                    Err(e),
                ));
            }
            if read.value.attempt != begun.attempt {
                // A rollback to the same snapshot began after this one:
                // it finishes the mark.
                return Ok(Txn::Done(Ok(v.value.clone())));
            }
            Ok(Txn::Commit(
                vec![cond],
                vec![Op::Delete(mark_key.clone())],
                Ok(v.value.clone()),
            ))
        })?;
        r
    }

    /// A rollback that began as `attempt` ended without finishing: its
    /// mark stays, as failed.
    pub fn fail_rollback(&self, volume: &Uuid, attempt: u64) -> Result<(), StateError> {
        self.update(
            "rollback",
            &rollback_key(volume),
            |m: Option<RollbackMark>| {
                Ok(match m {
                    Some(mut m) if m.attempt == attempt && !m.failed => {
                        m.failed = true;
                        (Some(m), ())
                    }
                    _ => (None, ()),
                })
            },
        )
    }
}

#[cfg(feature = "server")]
pub use protocol::*;

/// The calls to the targets.
#[cfg(feature = "server")]
mod protocol {
    use super::*;
    use crate::program::{ProgramError, TargetAdmin};
    use crate::snapshots::{by_device, SnapshotTree};
    use nvpool_api::admin::RollbackBody;

    /// Rolls `volume` back to its snapshot `name` (T6): checked and
    /// marked, every device holding a copy told to give its live trees
    /// the snapshot trees' contents, then unmarked. While marked, the
    /// volume must not be attached. A target that fails (answered with
    /// its error: unreachable is 503) leaves the mark: some copies may be
    /// rolled back and others not. The admin finishes it by repeating the
    /// rollback, which calls every target again (each call is idempotent);
    /// a volume attached or changed, or snapshotted, during the calls is
    /// refused at the finish (409, [`Cluster::finish_rollback`]) and stays
    /// marked: detach it (delete that snapshot) and repeat.
    pub fn rollback(cluster: &Cluster, volume: &Uuid, name: &str) -> Result<Volume, ProgramError> {
        let begun = cluster.begin_rollback(volume, name)?;
        let trees = &begun.snapshot.trees;
        let called = call_targets(cluster, trees);
        if let Err(e) = called {
            tracing::warn!(%volume, snapshot = name, error = %e,
                "rollback failed; the volume stays marked until a rollback finishes");
            if let Err(e) = cluster.fail_rollback(volume, begun.attempt) {
                tracing::warn!(%volume, error = %e, "marking the rollback failed did not work");
            }
            return Err(e);
        }
        let v = cluster.finish_rollback(volume, &begun)?;
        tracing::info!(%volume, snapshot = name, epoch = begun.snapshot.epoch,
            trees = trees.len(), "volume rolled back");
        Ok(v)
    }

    fn call_targets(cluster: &Cluster, trees: &[SnapshotTree]) -> Result<(), ProgramError> {
        for (target, devices) in by_device(trees) {
            let t = cluster.target(&target)?.target;
            let admin = TargetAdmin::new(cluster, &t)?;
            for (device, trees) in devices {
                admin.rollback(&device, &RollbackBody { trees })?;
            }
        }
        Ok(())
    }
}
