//! Group snapshots: one snapshot of each of several volumes, all at one
//! cut (design/thin-snapshots.md T5, "Group snapshots"), for a job whose
//! volumes depend on each other (a training job's data and its
//! checkpoints).
//!
//! Each volume's snapshot is an ordinary [`SnapshotRecord`] whose `group`
//! lists every volume of the group; the records are begun in one
//! transaction (all or none), then driven like a single snapshot
//! (`snapshots::take`): trees at every target, every volume's epoch raised
//! in one transaction with a hold on their writers, every writer's held
//! confirmation within `WRITE_HOLD_MAX_MS`, the holds lifted, every tree
//! sealed, all ready in one transaction. Any failure gives every snapshot
//! of the group up.

use crate::model::{validate_id, ModelError, Uuid};
use crate::snapshots::{volume_in, SnapshotRecord};
use crate::state::{Cluster, StateError, Txn};
use std::collections::BTreeSet;

/// Volumes in one group. Every one's engines stand at one barrier that
/// must complete within the 5 s hold budget, and the group's records are
/// begun, raised and finished in one store transaction each (two
/// conditions and two ops per volume against etcd's 128).
pub const SNAPSHOT_GROUP_VOLUMES_MAX: usize = 32;
const _: () = assert!(2 * SNAPSHOT_GROUP_VOLUMES_MAX + 2 <= crate::limits::TXN_OPS_MAX);
const _: () = assert!(2 * SNAPSHOT_GROUP_VOLUMES_MAX + 2 <= crate::limits::TXN_CONDITIONS_MAX);

/// What [`Cluster::begin_group`] found or made.
#[derive(Debug, Clone)]
pub struct BegunGroup {
    /// One per volume, in the order asked.
    pub records: Vec<SnapshotRecord>,
    /// False: the group existed already.
    pub created: bool,
}

/// Checks a group's name and volumes.
pub fn validate_group(name: &str, volumes: &[Uuid]) -> Result<(), StateError> {
    validate_id("snapshot name", name, crate::limits::NAME_BYTES_MAX)?;
    if volumes.is_empty() {
        return Err(
            ModelError::Invalid("a snapshot group needs at least one volume".into()).into(),
        );
    }
    if volumes.len() > SNAPSHOT_GROUP_VOLUMES_MAX {
        return Err(StateError::TooMany {
            what: "volumes in a snapshot group",
            max: SNAPSHOT_GROUP_VOLUMES_MAX,
        });
    }
    let mut seen = BTreeSet::new();
    for v in volumes {
        if !seen.insert(v) {
            return Err(ModelError::Invalid(format!(
                "volume {v} is listed twice in snapshot group {name}"
            ))
            .into());
        }
    }
    Ok(())
}

/// Whether `r` belongs to the group of `volumes` (in any order).
fn in_group(r: &SnapshotRecord, volumes: &BTreeSet<&Uuid>) -> bool {
    r.group.len() == volumes.len() && r.group.iter().all(|v| volumes.contains(v))
}

impl Cluster {
    /// Records snapshot `name` of every one of `volumes` as `creating`,
    /// each at its volume's write epoch, in one transaction. The group
    /// already there (every volume has snapshot `name` of this group) is
    /// returned as it is; a volume with a snapshot `name` outside it is
    /// `snapshot_exists`.
    pub fn begin_group(&self, name: &str, volumes: &[Uuid]) -> Result<BegunGroup, StateError> {
        validate_group(name, volumes)?;
        let wanted: BTreeSet<&Uuid> = volumes.iter().collect();
        self.transact_allocation(|s| {
            let mut existing = Vec::new();
            for v in volumes {
                volume_in(s, v)?;
                let Some(r) = s.snapshots.get(&(*v, name.to_owned())) else {
                    continue;
                };
                if !in_group(&r.value, &wanted) {
                    return Err(crate::snapshots::conflict(
                        "snapshot_exists",
                        format!(
                            "volume {v} has a snapshot {name} outside this group; name the \
                             group otherwise"
                        ),
                    ));
                }
                existing.push(r.value.clone());
            }
            if existing.len() == volumes.len() {
                return Ok(Txn::Done(BegunGroup {
                    records: existing,
                    created: false,
                }));
            }
            if !existing.is_empty() {
                // A group is begun and given up whole: part of one is a
                // bug or a store edited by hand.
                return Err(StateError::Inconsistent(format!(
                    "snapshot group {name} exists for {} of its {} volumes",
                    existing.len(),
                    volumes.len()
                )));
            }
            let mut a = self.allocator(s)?;
            let (mut conds, mut ops, mut records) = (Vec::new(), Vec::new(), Vec::new());
            for v in volumes {
                let (r, c, op) = self.new_snapshot(s, &mut a, v, name, volumes.to_vec())?;
                conds.extend(c);
                ops.push(op);
                records.push(r);
            }
            Ok(Txn::Commit(
                conds,
                ops,
                BegunGroup {
                    records,
                    created: true,
                },
            ))
        })
    }
}

#[cfg(feature = "server")]
pub use protocol::*;

#[cfg(feature = "server")]
mod protocol {
    use crate::model::Uuid;
    use crate::program::ProgramError;
    use crate::snapshots::SnapshotRecord;
    use crate::state::Cluster;

    /// Takes snapshot `name` of every one of `volumes` at one cut; `false`
    /// when the group existed already. A failure gives every snapshot of
    /// the group up and is `SnapshotFailed`, naming the volume it failed at.
    pub fn take_group(
        cluster: &Cluster,
        name: &str,
        volumes: &[Uuid],
    ) -> Result<(Vec<SnapshotRecord>, bool), ProgramError> {
        let since = std::time::Instant::now();
        let begun = cluster.begin_group(name, volumes)?;
        if !begun.created {
            return Ok((begun.records, false));
        }
        let done = crate::snapshots::take(cluster, &begun.records, since)?;
        Ok((done, true))
    }
}
