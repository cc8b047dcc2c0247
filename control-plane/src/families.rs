//! Snapshot families that move with their copy (design thin-snapshots.md
//! T7, control-plane side).
//!
//! A thin copy's snapshots are trees on the copy's grain pool
//! ([`crate::snapshots::SnapshotTree`]: `live` the copy's extent, `tree`
//! the snapshot's). A job that moves the copy (replace, move: drain,
//! rebalance) moves them too, as its *family*:
//!
//! ```text
//!  create_job   one member per ready snapshot with a tree of the copy,
//!               oldest first: the source copy's tree of that snapshot,
//!               and a new tree on the destination device (allocated like
//!               a snapshot's, from now on)
//!  arming       member i is copied by a target copy job of its own
//!               ({volume}-{job}-f{i}) into its new tree, which starts as
//!               member i-1's new tree (`base_root`), so only what differs
//!               is written and the sharing survives; then the live copy
//!               is armed with base_root = the newest member's tree
//!  finish_job   done: every snapshot record names the new trees and the
//!               new extent; the old trees are freed with the old extent.
//!               failed: the new trees are freed.
//! ```
//!
//! Freed trees become stale exports of their targets (C13), released by
//! reconciliation (`POST /v1/devices/{id}/release`) before their place is
//! reused. Snapshot trees take no writes, so members are copied whole with
//! no host involved; only the live copy is mirrored.
//!
//! While any copy job of a volume runs its snapshots are neither created
//! nor deleted (409 `copy_in_progress`), so the family recorded at
//! creation stays the volume's.

use crate::attach::Export;
use crate::model::{Extent, Uuid, Volume};
use crate::placement::Allocator;
use crate::resync::CopyJob;
use crate::snapshots::SnapshotState;
use crate::state::{Snapshot, StateError};
use crate::store::{Condition, Op};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A snapshot tree that moves with a copy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FamilyMember {
    /// The snapshot's name (of the job's volume).
    pub snapshot: String,
    /// Its epoch (members are ordered by it, oldest first).
    pub epoch: u32,
    /// The snapshot's tree of the job's source copy: what the copier reads.
    pub source: Extent,
    /// The snapshot's new tree on the destination device.
    pub tree: Extent,
    /// The namespace of `source` in the copier's subsystem on the source's
    /// target (while this member is copied).
    pub copier_nsid: u32,
}

/// The id of family member `index`'s copy job on the destination target.
pub fn family_copy_id(volume: &Uuid, job: u64, index: usize) -> String {
    format!("{volume}-{job}-f{index}")
}

/// Every id `job` may use on its destination target: the live copy's, then
/// its family members'.
pub fn target_copy_ids(volume: &Uuid, job: &CopyJob) -> Vec<String> {
    let mut out = vec![format!("{volume}-{}", job.id)];
    out.extend((0..job.family.len()).map(|i| family_copy_id(volume, job.id, i)));
    out
}

fn same_place(a: &Extent, b: &Extent) -> bool {
    (a.target.as_str(), a.device.as_str(), a.offset)
        == (b.target.as_str(), b.device.as_str(), b.offset)
}

/// The export through which the destination's copier reads family member
/// `m` of a job whose destination is on target `dest_target`.
pub fn member_export(m: &FamilyMember, dest_target: &str) -> Export {
    let host = crate::resync::copier_nqn(dest_target);
    Export {
        subsystem_nqn: crate::attach::host_subsystem_nqn(&host),
        host_nqn: host,
        nsid: m.copier_nsid,
        device: m.source.device.clone(),
        offset: m.source.offset,
        length: m.source.length,
    }
}

/// The family of a job moving copy `extent` of `v` (read from copy
/// `source`) to `dest`: one member per ready snapshot with a tree of the
/// copy, oldest first, each with a new tree on `dest`'s device allocated
/// in `a` and a copier NSID from `next_nsid`. Empty when the copy is not on
/// a grain pool or has no snapshot. A creating snapshot is refused by the
/// caller before (the job waits for it).
pub(crate) fn plan_family(
    s: &Snapshot,
    a: &mut Allocator,
    v: &Volume,
    extent: u32,
    source: u32,
    dest: &Extent,
    mut next_nsid: impl FnMut() -> u32,
) -> Result<Vec<FamilyMember>, StateError> {
    let (Some(copy), Some(src)) = (
        v.extents.get(extent as usize),
        v.extents.get(source as usize),
    ) else {
        return Ok(Vec::new());
    };
    let mut snaps: Vec<_> = s
        .snapshots_of(&v.uuid)
        .into_iter()
        .map(|r| &r.value)
        .filter(|r| r.state == SnapshotState::Ready)
        .filter(|r| r.trees.iter().any(|t| same_place(&t.live, copy)))
        .collect();
    snaps.sort_by_key(|r| (r.epoch, r.created_ms));
    let mut out = Vec::with_capacity(snaps.len());
    for r in snaps {
        let from = r
            .trees
            .iter()
            .find(|t| same_place(&t.live, src))
            .ok_or_else(|| {
                StateError::Inconsistent(format!(
                    "snapshot {} of volume {} has no tree of copy {source}",
                    r.name, v.uuid
                ))
            })?;
        let dref = dest.device_ref();
        let offset = a
            .device(&dref)
            .filter(|d| d.info.grain_pool)
            .and_then(|d| d.first_fit(dest.length))
            .ok_or_else(|| StateError::Unprocessable {
                kind: "no_space",
                message: format!(
                    "device {dref} has no room for the tree of snapshot {} (or is no grain pool)",
                    r.name
                ),
            })?;
        let tree = Extent {
            offset,
            ..dest.clone()
        };
        a.occupy(&tree)?;
        out.push(FamilyMember {
            snapshot: r.name.clone(),
            epoch: r.epoch,
            source: from.tree.clone(),
            tree,
            copier_nsid: next_nsid(),
        });
    }
    Ok(out)
}

/// The root `job`'s live copy starts as: the newest member's new tree.
pub fn live_base_root(job: &CopyJob) -> Option<u64> {
    job.family
        .last()
        .map(|m| crate::snapshots::root_of(&m.tree))
}

/// The root member `index` of `job`'s family starts as: the previous
/// member's new tree (none for the first).
pub fn member_base_root(job: &CopyJob, index: usize) -> Option<u64> {
    index
        .checked_sub(1)
        .and_then(|p| job.family.get(p))
        .map(|m| crate::snapshots::root_of(&m.tree))
}

/// Done, in `finish_job`'s transaction: every snapshot record of `volume`
/// with a tree of `old` (the copy's extent) names `new` (the extent that
/// took its place) and its member's
/// new tree instead; the old trees are freed (into `leftover`, by target).
/// A member whose snapshot is gone has its new tree freed.
pub(crate) fn move_family(
    s: &Snapshot,
    volume: &Uuid,
    job: &CopyJob,
    (old, new): (&Extent, &Extent),
    conds: &mut Vec<Condition>,
    ops: &mut Vec<Op>,
    leftover: &mut BTreeMap<String, Vec<Export>>,
) {
    if job.family.is_empty() {
        return;
    }
    let mut used = vec![false; job.family.len()];
    for r in s.snapshots_of(volume) {
        let mut next = r.value.clone();
        for t in next.trees.iter_mut().filter(|t| same_place(&t.live, old)) {
            let Some(i) = job.family.iter().position(|m| m.snapshot == next.name) else {
                continue;
            };
            used[i] = true;
            if let Some(x) = s.freed_tree(&t.tree) {
                leftover.entry(t.tree.target.clone()).or_default().push(x);
            }
            t.live = new.clone();
            t.tree = Extent {
                member: new.member,
                row: new.row,
                copy: new.copy,
                ..job.family[i].tree.clone()
            };
        }
        if next != r.value {
            let key = crate::snapshots::snapshot_key(volume, &next.name);
            conds.push(Condition::VersionIs(key.clone(), r.version));
            ops.push(Op::Put(key, crate::model::encode(&next)));
        }
    }
    for (m, _) in job.family.iter().zip(used).filter(|(_, u)| !u) {
        free_tree(s, &m.tree, leftover);
    }
}

/// Failed or cancelled: the family's new trees are freed (into
/// `leftover`, by target).
pub(crate) fn free_family(
    s: &Snapshot,
    job: &CopyJob,
    leftover: &mut BTreeMap<String, Vec<Export>>,
) {
    for m in &job.family {
        free_tree(s, &m.tree, leftover);
    }
}

fn free_tree(s: &Snapshot, tree: &Extent, leftover: &mut BTreeMap<String, Vec<Export>>) {
    if let Some(x) = s.freed_tree(tree) {
        leftover.entry(tree.target.clone()).or_default().push(x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::limits::EXTENT_BYTES_MIN;
    use crate::model::{Layout, TargetState, VolumeSpec};
    use crate::resync::{CopyKind, JobState};
    use crate::snapshots::{root_of, SnapshotRecord};
    use crate::state::Cluster;
    use std::collections::BTreeSet;
    use std::sync::Arc;

    const E: u64 = EXTENT_BYTES_MIN;
    const H1: &str = "nqn.2014-08.org.nvmexpress:uuid:host-1";

    /// Registers target `t{i}` with one grain pool `d0`.
    fn register_thin(c: &Cluster, i: u32) {
        let backend = format!("thin:/dev/nvme{i}n1");
        crate::moves::tests::register_device(c, i, &backend, 64 * E, None);
    }

    /// A thin raid1 volume of one row on t0 and t1 (t2 joins after),
    /// attached to H1, with ready snapshots `s1` then `s2`.
    fn fixture() -> (Cluster, Arc<ManualClock>, Uuid) {
        let (c, clock) = crate::moves::tests::cluster(E);
        register_thin(&c, 0);
        register_thin(&c, 1);
        let uuid = Uuid([5; 16]);
        c.create_volume(&VolumeSpec {
            uuid,
            name: "v".into(),
            size_bytes: E,
            layout: Layout::Raid1 { copies: 2 },
            pool: None,
        })
        .unwrap();
        register_thin(&c, 2);
        c.begin_attach(&uuid, H1).unwrap();
        c.finish_attach(&uuid, H1).unwrap();
        c.register_session(&uuid, H1, 1, 0).unwrap();
        for name in ["s1", "s2"] {
            c.begin_snapshot(&uuid, name).unwrap();
            clock.advance(1);
            c.finish_snapshots(&[(uuid, name.to_owned())]).unwrap();
        }
        (c, clock, uuid)
    }

    /// The move job draining t0 creates.
    fn drain_t0(c: &Cluster) -> CopyJob {
        c.set_target_state("t0", TargetState::Draining).unwrap();
        let cands = c.move_candidates(600_000, 0).unwrap();
        assert_eq!(cands.len(), 1, "{cands:?}");
        assert_eq!(cands[0].kind, CopyKind::Move);
        c.create_job(&cands[0]).unwrap().unwrap()
    }

    fn record(c: &Cluster, v: &Uuid, name: &str) -> SnapshotRecord {
        c.snapshot_record(v, name).unwrap()
    }

    fn stale_places(c: &Cluster, target: &str) -> BTreeSet<(String, u64)> {
        c.stale_exports(target)
            .unwrap()
            .map(|(r, _)| r.exports)
            .unwrap_or_default()
            .into_iter()
            .map(|x| (x.device, x.offset))
            .collect()
    }

    #[test]
    fn a_moving_thin_copy_takes_its_snapshots_oldest_first() {
        let (c, _, v) = fixture();
        let vol = c.volume(&v).unwrap().volume;
        let job = drain_t0(&c);
        let copy = vol.extents[job.extent as usize].clone();
        assert_eq!(copy.target, "t0");
        let dest = job.dest.clone().unwrap();
        assert_eq!(dest.target, "t2");
        let names: Vec<&str> = job.family.iter().map(|m| m.snapshot.as_str()).collect();
        assert_eq!(names, ["s1", "s2"], "oldest first");
        let mut places = BTreeSet::from([dest.offset]);
        for m in &job.family {
            assert_eq!(m.tree.device_ref(), dest.device_ref(), "on the destination");
            assert!(places.insert(m.tree.offset), "a tree of its own");
            let r = record(&c, &v, &m.snapshot);
            let src = &vol.extents[job.source as usize];
            let t = r.trees.iter().find(|t| same_place(&t.live, src)).unwrap();
            assert_eq!(m.source, t.tree, "read from the source copy's tree");
        }
        // Copier NSIDs on the source's target: the live copy's and one per
        // member, all different.
        let nsids: BTreeSet<u32> = job
            .family
            .iter()
            .map(|m| m.copier_nsid)
            .chain([job.copier_nsid])
            .collect();
        assert_eq!(nsids.len(), 3);
        // Each tree starts as the one copied before it; the live copy as
        // the newest.
        assert_eq!(member_base_root(&job, 0), None);
        assert_eq!(
            member_base_root(&job, 1),
            Some(root_of(&job.family[0].tree))
        );
        assert_eq!(live_base_root(&job), Some(root_of(&job.family[1].tree)));
        // The new trees are allocated from now on.
        assert!(c.check().unwrap().is_empty(), "{:?}", c.check().unwrap());
        let s = c.snapshot().unwrap();
        let held: Vec<&Extent> = s.job_dests().map(|(_, e)| e).collect();
        assert_eq!(held.len(), 3, "the new extent and two trees");
        // The member being copied is exported to the destination's copier.
        let xs = s.copier_exports("t0");
        assert!(xs.iter().any(
            |x| x.nsid == job.family[0].copier_nsid && x.offset == job.family[0].source.offset
        ));
        assert!(!xs.iter().any(|x| x.nsid == job.family[1].copier_nsid));
    }

    #[test]
    fn when_the_move_completes_the_snapshots_name_the_new_trees() {
        let (c, _, v) = fixture();
        let job = drain_t0(&c);
        let old = c.volume(&v).unwrap().volume.extents[job.extent as usize].clone();
        let old_trees: Vec<Extent> = ["s1", "s2"]
            .iter()
            .map(|n| {
                let r = record(&c, &v, n);
                r.trees
                    .into_iter()
                    .find(|t| same_place(&t.live, &old))
                    .unwrap()
                    .tree
            })
            .collect();
        assert!(!c.family_member_done(&v, job.id, 1).unwrap(), "in order");
        assert!(c.family_member_done(&v, job.id, 0).unwrap());
        assert!(!c.family_member_done(&v, job.id, 0).unwrap(), "once");
        assert!(c.family_member_done(&v, job.id, 1).unwrap());
        let cs = c.copy_state(&v).unwrap();
        assert_eq!(cs.job(job.id).unwrap().family_done, 2);
        assert!(c.job_mirroring(&v, job.id).unwrap());
        assert!(!c.family_member_done(&v, job.id, 2).unwrap(), "past arming");
        assert!(c.confirm_sync(&v, H1, job.id, 1, None).unwrap());
        c.job_copying(&v, job.id).unwrap().unwrap();
        assert!(c.job_switching(&v, job.id).unwrap());
        assert!(c.confirm_sync(&v, H1, job.id, 1, None).unwrap());
        c.finish_job(&v, job.id, None).unwrap().unwrap();
        let moved = c.volume(&v).unwrap().volume.extents[job.extent as usize].clone();
        assert_eq!(moved.target, "t2");
        for (m, old_tree) in job.family.iter().zip(&old_trees) {
            let r = record(&c, &v, &m.snapshot);
            assert!(
                !r.trees.iter().any(|t| same_place(&t.live, &old)),
                "no tree names the old extent"
            );
            let t = r
                .trees
                .iter()
                .find(|t| same_place(&t.live, &moved))
                .unwrap();
            assert_eq!(t.live, moved);
            assert!(same_place(&t.tree, &m.tree), "{:?}", t.tree);
            assert_eq!((t.tree.row, t.tree.copy), (moved.row, moved.copy));
            assert_eq!(r.trees.len(), 2, "the other copy's tree stays");
            assert_ne!(old_tree.offset, old.offset);
        }
        // The old trees go with the old extent: stale exports of t0 until
        // it releases them.
        let stale = stale_places(&c, "t0");
        for t in old_trees.iter().chain([&old]) {
            assert!(
                stale.contains(&(t.device.clone(), t.offset)),
                "{t:?}: {stale:?}"
            );
        }
        let roots = c.snapshot().unwrap().trees_to_release("t0");
        let want: BTreeSet<u64> = old_trees.iter().chain([&old]).map(root_of).collect();
        assert_eq!(roots["d0"].iter().copied().collect::<BTreeSet<u64>>(), want);
        assert!(stale_places(&c, "t2").is_empty(), "the new trees are kept");
        assert!(c.check().unwrap().is_empty(), "{:?}", c.check().unwrap());
    }

    #[test]
    fn a_failed_move_frees_the_new_trees() {
        let (c, _, v) = fixture();
        let job = drain_t0(&c);
        let rec = c
            .finish_job(&v, job.id, Some("the copier stopped"))
            .unwrap()
            .unwrap();
        assert!(rec.error.is_some());
        let stale = stale_places(&c, "t2");
        for m in &job.family {
            assert!(
                stale.contains(&(m.tree.device.clone(), m.tree.offset)),
                "{stale:?}"
            );
        }
        // The snapshots keep their trees where they were.
        let old = c.volume(&v).unwrap().volume.extents[job.extent as usize].clone();
        assert_eq!(old.target, "t0");
        for n in ["s1", "s2"] {
            assert!(record(&c, &v, n)
                .trees
                .iter()
                .any(|t| same_place(&t.live, &old)));
        }
        assert!(stale_places(&c, "t0").is_empty(), "nothing of t0 is freed");
        assert!(c.check().unwrap().is_empty(), "{:?}", c.check().unwrap());
    }

    #[test]
    fn a_snapshot_is_not_deleted_while_a_copy_of_its_volume_runs() {
        let (c, _, v) = fixture();
        let job = drain_t0(&c);
        match c.drop_snapshot(&v, "s1", false) {
            Err(StateError::Conflict { kind, message }) => {
                assert_eq!(kind, "copy_in_progress");
                assert!(
                    message.contains(&format!("copy job {}", job.id)),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(record(&c, &v, "s1").state, SnapshotState::Ready);
        c.finish_job(&v, job.id, Some("cancelled")).unwrap();
        c.drop_snapshot(&v, "s1", false).unwrap();
    }

    #[test]
    fn a_copy_without_snapshots_moves_alone() {
        let (c, _, v) = fixture();
        for n in ["s1", "s2"] {
            c.drop_snapshot(&v, n, false).unwrap();
        }
        let job = drain_t0(&c);
        assert!(job.family.is_empty());
        assert_eq!(live_base_root(&job), None);
        assert_eq!(target_copy_ids(&v, &job), vec![format!("{v}-{}", job.id)]);
        assert_eq!(job.state, JobState::Arming);
    }
}
