//! Data that moves: which copies get a new extent, and why. Every move is
//! the one copy job of [`crate::resync`] with a new destination extent
//! (kinds `replace` and `move`); this module only decides which to start.
//!
//! - **Replacement.** A copy whose target has not heartbeated for
//!   `replace_after_ms` (default 10 min, the grace period for a target to
//!   come back and be resynced in place) — or was removed — gets a new
//!   extent on another device, filled from a copy in sync of the same row
//!   and member. Stale or not: a volume nobody writes never marks a copy
//!   stale, yet loses redundancy all the same.
//! - **Drain.** Every extent of a `draining` target moves off it, read from
//!   the copy itself while it is in sync (so unmirrored volumes drain too),
//!   else from another copy. The target keeps serving until each swap.
//! - **Rebalance.** A request per pool (`/rebalance/…`) stays until a plan
//!   computed afresh from the current state ([`crate::rebalance`]) finds
//!   nothing worth moving and no move it started is still running.
//!
//! The heal loop starts what this returns, at most `COPIES_PER_TARGET_MAX`
//! jobs per destination target at a time; placement rules hold for each
//! new extent when it is placed, so they hold at every step.

use crate::model::{Extent, Health, TargetState, Uuid, Volume};
use crate::rebalance::{plan_rebalance, Move};
use crate::resync::{Candidate, CopyKind, CopyState};
use crate::state::{unchanged, Cluster, Snapshot, StateError, Txn};
use crate::store::Op;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// Store key prefix of rebalance requests.
pub const REBALANCE: &str = "/rebalance/";

/// Most moves one plan lists.
pub const PLANNED_MOVES_MAX: usize = 10_000;

/// The key of a rebalance request for `pool` (`None`: unpooled devices).
pub fn rebalance_key(pool: Option<&str>) -> String {
    match pool {
        Some(p) => format!("{REBALANCE}pool/{p}"),
        None => format!("{REBALANCE}unpooled"),
    }
}

/// A pool an operator asked to even out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebalanceRequest {
    pub pool: Option<String>,
    pub requested_ms: u64,
}

impl crate::model::Stored for RebalanceRequest {}

impl Snapshot {
    /// Whether copy `c` of `v` is in sync and its target online.
    fn readable(
        &self,
        v: &Volume,
        failed: &BTreeSet<u32>,
        c: u32,
        online: &dyn Fn(&str) -> bool,
    ) -> bool {
        !failed.contains(&c) && v.extents.get(c as usize).is_some_and(|x| online(&x.target))
    }

    /// A copy to read `slot` from: the slot itself when `self_ok` and it is
    /// readable, else another copy of its row and member in sync.
    fn source_for(
        &self,
        v: &Volume,
        cs: &CopyState,
        failed: &BTreeSet<u32>,
        slot: u32,
        self_ok: bool,
        online: &dyn Fn(&str) -> bool,
    ) -> Option<u32> {
        if self_ok && self.readable(v, failed, slot, online) {
            return Some(slot);
        }
        let copies = u32::from(v.layout.copies());
        let group = slot / copies * copies;
        (group..group + copies).find(|&c| {
            c != slot
                && self.readable(v, failed, c, online)
                // A copy being filled in place is not in sync.
                && cs.job_on(c).is_none_or(|j| j.dest.is_some())
        })
    }
}

impl Cluster {
    fn online_fn<'a>(&'a self, s: &'a Snapshot) -> impl Fn(&str) -> bool + 'a {
        let now = self.now();
        let timeout = self.config().heartbeat_timeout_ms;
        move |t: &str| {
            s.targets
                .get(t)
                .is_some_and(|t| t.value.health(now, timeout) == Health::Online)
        }
    }

    /// Copies to replace (their target is gone for longer than
    /// `replace_after_ms`) or move (their target drains), with no job on
    /// them and no failed attempt in the last `retry_ms`.
    pub fn move_candidates(
        &self,
        replace_after_ms: u64,
        retry_ms: u64,
    ) -> Result<Vec<Candidate>, StateError> {
        let s = self.snapshot()?;
        let now = self.now();
        let online = self.online_fn(&s);
        let mut out = Vec::new();
        for (uuid, v) in &s.volumes {
            let v = &v.value;
            let cs = s.copy_state(uuid);
            let failed = s.failed_set(uuid);
            for (i, e) in v.extents.iter().enumerate() {
                let slot = i as u32;
                if cs.job_on(slot).is_some() {
                    continue;
                }
                let t = s.targets.get(&e.target).map(|t| &t.value);
                let gone =
                    t.is_none_or(|t| now.saturating_sub(t.last_heartbeat_ms) > replace_after_ms);
                let draining = t.is_some_and(|t| t.state == TargetState::Draining);
                if !gone && !draining {
                    continue;
                }
                if cs.failed_recently(slot, now, retry_ms) {
                    continue;
                }
                let Some(source) = s.source_for(v, &cs, &failed, slot, !gone, &online) else {
                    continue;
                };
                out.push(Candidate {
                    volume: *uuid,
                    extent: slot,
                    source,
                    kind: if gone {
                        CopyKind::Replace
                    } else {
                        CopyKind::Move
                    },
                    to: None,
                });
            }
        }
        Ok(out)
    }

    /// Asks for `pool` (`None`: the unpooled devices) to be evened out.
    pub fn request_rebalance(&self, pool: Option<&str>) -> Result<(), StateError> {
        if let Some(p) = pool {
            crate::model::validate_id("pool name", p, crate::limits::ID_BYTES_MAX)?;
            if !self.snapshot()?.pools.contains_key(p) {
                return Err(StateError::PoolNotFound(p.to_owned()));
            }
        }
        let key = rebalance_key(pool);
        let rec = RebalanceRequest {
            pool: pool.map(str::to_owned),
            requested_ms: self.now(),
        };
        self.transact_key(&key, |version| {
            let ops = vec![Op::Put(key.clone(), crate::model::encode(&rec))];
            Ok(Txn::Commit(vec![unchanged(&key, version)], ops, ()))
        })
    }

    /// Pending rebalance requests.
    pub fn rebalance_requests(&self) -> Result<Vec<RebalanceRequest>, StateError> {
        self.read_all("rebalance request", REBALANCE)
    }

    /// Forgets the request for `pool` (it is done).
    pub fn end_rebalance(&self, pool: Option<&str>) -> Result<(), StateError> {
        self.delete_if_present(&rebalance_key(pool))
    }

    /// The moves that would even out `pool` now, in order, given the jobs
    /// under way (their copies stay put, their new extents count as
    /// placed).
    pub fn rebalance_plan(&self, pool: Option<&str>) -> Result<Vec<Move>, StateError> {
        let s = self.snapshot()?;
        let a = self.allocator(&s)?;
        let volumes: Vec<&Volume> = s.volumes.values().map(|v| &v.value).collect();
        // New extents only: a job's snapshot trees follow their copy.
        let in_flight: Vec<(Uuid, Extent)> = s
            .copy_states
            .iter()
            .flat_map(|(u, cs)| {
                cs.value
                    .jobs
                    .iter()
                    .filter_map(move |j| j.dest.clone().map(|d| (*u, d)))
            })
            .collect();
        let busy: BTreeSet<(Uuid, u32)> = s
            .copy_states
            .iter()
            .flat_map(|(u, cs)| cs.value.jobs.iter().map(move |j| (*u, j.extent)))
            .collect();
        Ok(plan_rebalance(
            &a,
            &volumes,
            &in_flight,
            &busy,
            pool,
            PLANNED_MOVES_MAX,
        ))
    }

    /// The first moves of the plan for `pool` as job candidates, and
    /// whether the plan is empty. A move whose copy cannot be read now is
    /// left for a later round.
    pub fn rebalance_candidates(
        &self,
        pool: Option<&str>,
    ) -> Result<(Vec<Candidate>, bool), StateError> {
        let plan = self.rebalance_plan(pool)?;
        let s = self.snapshot()?;
        let online = self.online_fn(&s);
        let mut out = Vec::new();
        for m in &plan {
            let Some(v) = s.volumes.get(&m.volume) else {
                continue;
            };
            let cs = s.copy_state(&m.volume);
            let failed = s.failed_set(&m.volume);
            let Some(source) = s.source_for(&v.value, &cs, &failed, m.extent, true, &online) else {
                continue;
            };
            out.push(Candidate {
                volume: m.volume,
                extent: m.extent,
                source,
                kind: CopyKind::Move,
                to: Some(m.to.clone()),
            });
        }
        Ok((out, plan.is_empty()))
    }

    /// Move jobs under way on devices of `pool`.
    pub fn moves_running(&self, pool: Option<&str>) -> Result<usize, StateError> {
        let s = self.snapshot()?;
        let pools = s.device_pools();
        Ok(s.copy_states
            .values()
            .flat_map(|cs| &cs.value.jobs)
            .filter(|j| j.kind == CopyKind::Move)
            .filter_map(|j| j.dest.as_ref())
            .filter(|d| pools.get(&d.device_ref()).map(String::as_str) == pool)
            .count())
    }

    /// Extents a target holds: the volumes' own and new extents of jobs
    /// under way.
    pub fn extents_on(&self, target: &str) -> Result<usize, StateError> {
        let s = self.snapshot()?;
        Ok(s.volumes
            .values()
            .flat_map(|v| &v.value.extents)
            .chain(s.job_dests().map(|(_, d)| d))
            .filter(|e| e.target == target)
            .count())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::limits::EXTENT_BYTES_MIN;
    use crate::model::{Device, Layout, VolumeSpec};
    use crate::state::{StateConfig, TargetRegistration};
    use crate::store::MemStore;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    const E: u64 = EXTENT_BYTES_MIN;
    const H1: &str = "nqn.2014-08.org.nvmexpress:uuid:host-1";

    /// A cluster on a memory store with `extent_bytes` extents and a
    /// manual clock.
    pub(crate) fn cluster(extent_bytes: u64) -> (Cluster, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let config = StateConfig {
            extent_bytes,
            ..StateConfig::default()
        };
        let c = Cluster::new(Arc::new(MemStore::new()), clock.clone(), config).unwrap();
        (c, clock)
    }

    /// Registers target `t{i}` with one device `d0` of `capacity_bytes`.
    pub(crate) fn register(c: &Cluster, i: u32, capacity_bytes: u64) {
        register_rdma(c, i, capacity_bytes, None);
    }

    /// `register`, with an NVMe/RDMA listener.
    pub(crate) fn register_rdma(
        c: &Cluster,
        i: u32,
        capacity_bytes: u64,
        rdma_addr: Option<std::net::SocketAddr>,
    ) {
        register_device(c, i, "file:/dev/null", capacity_bytes, rdma_addr);
    }

    /// Registers target `t{i}` with one device `d0` on `backend`.
    pub(crate) fn register_device(
        c: &Cluster,
        i: u32,
        backend: &str,
        capacity_bytes: u64,
        rdma_addr: Option<std::net::SocketAddr>,
    ) {
        c.register_target(&TargetRegistration {
            id: format!("t{i}"),
            name: format!("t{i}"),
            addr: format!("127.0.0.1:{}", 4420 + i).parse().unwrap(),
            admin_addr: format!("127.0.0.1:{}", 4480 + i).parse().unwrap(),
            labels: BTreeMap::new(),
            devices: vec![Device {
                id: "d0".into(),
                backend: backend.into(),
                capacity_bytes,
                labels: BTreeMap::new(),
            }],
            rdma_addr,
            admin_tls: false,
            admin_token: None,
        })
        .unwrap();
    }

    /// Three targets, a raid1 volume of two rows (4 extents) on t0 and t1,
    /// attached to H1.
    fn fixture() -> (Cluster, Arc<ManualClock>, Uuid) {
        let (c, clock) = cluster(E);
        register(&c, 0, 8 * E);
        register(&c, 1, 8 * E);
        let uuid = Uuid([9; 16]);
        c.create_volume(&VolumeSpec {
            uuid,
            name: "v".into(),
            size_bytes: 2 * E,
            layout: Layout::Raid1 { copies: 2 },
            pool: None,
        })
        .unwrap();
        register(&c, 2, 8 * E);
        c.begin_attach(&uuid, H1).unwrap();
        c.finish_attach(&uuid, H1).unwrap();
        (c, clock, uuid)
    }

    fn slots_on(c: &Cluster, v: &Uuid, target: &str) -> Vec<u32> {
        let vol = c.volume(v).unwrap().volume;
        (0..vol.extents.len() as u32)
            .filter(|&i| vol.extents[i as usize].target == target)
            .collect()
    }

    /// Runs a created job through every state, H1 confirming each.
    fn run_job(c: &Cluster, v: &Uuid, job: u64) {
        assert!(c.job_mirroring(v, job).unwrap());
        let seen = c.host_copies(v, H1).unwrap();
        let m = seen
            .moving
            .iter()
            .find(|m| m.job == job)
            .expect("H1 told of the move");
        assert!(!m.switched);
        assert!(
            c.job_copying(v, job).unwrap().is_none(),
            "H1 has not confirmed"
        );
        assert!(c.confirm_sync(v, H1, job, 1, None).unwrap());
        let started = c.job_copying(v, job).unwrap().unwrap();
        assert_eq!(started.regions, None, "a new extent is copied whole");
        assert!(c.job_switching(v, job).unwrap());
        let seen = c.host_copies(v, H1).unwrap();
        assert!(seen.moving.iter().any(|m| m.job == job && m.switched));
        assert!(!c.job_confirmed(v, job).unwrap(), "switching waits for H1");
        assert!(c.confirm_sync(v, H1, job, 1, None).unwrap());
        assert!(c.job_confirmed(v, job).unwrap());
        let rec = c.finish_job(v, job, None).unwrap().unwrap();
        assert_eq!(rec.error, None);
        assert!(c.check().unwrap().is_empty(), "{:?}", c.check().unwrap());
    }

    #[test]
    fn a_draining_target_empties_copy_by_copy_and_can_then_be_removed() {
        let (c, _, v) = fixture();
        c.register_session(&v, H1, 1, 0).unwrap();
        assert!(c.move_candidates(600_000, 0).unwrap().is_empty());
        c.set_target_state("t0", TargetState::Draining).unwrap();
        let on_t0 = slots_on(&c, &v, "t0");
        assert_eq!(on_t0.len(), 2, "one copy of each row");
        let before = c.attachment(&v, H1).unwrap();
        for _ in 0..on_t0.len() {
            let cands = c.move_candidates(600_000, 0).unwrap();
            let cand = cands[0].clone();
            assert_eq!(cand.kind, CopyKind::Move);
            assert_eq!(cand.source, cand.extent, "read from the copy itself");
            let job = c.create_job(&cand).unwrap().unwrap();
            let dest = job.dest.clone().unwrap();
            assert_eq!(dest.target, "t2", "the only target outside the row");
            assert!(c.create_job(&cand).unwrap().is_none(), "one job per copy");
            assert!(
                c.remove_target("t2", false).is_err(),
                "t2 holds the new extent"
            );
            assert!(c.check().unwrap().is_empty());
            run_job(&c, &v, job.id);
            let vol = c.volume(&v).unwrap().volume;
            let moved = &vol.extents[cand.extent as usize];
            assert_eq!((moved.target.as_str(), moved.offset), ("t2", dest.offset));
            let a = c.attachment(&v, H1).unwrap();
            assert_eq!(a.nsids[cand.extent as usize], job.nsids[H1]);
            let plan = c.plan(&vol, &a).unwrap();
            let p = &plan.extents[cand.extent as usize];
            assert_eq!((p.target.as_str(), p.nsid), ("t2", job.nsids[H1]));
            assert_eq!(a.nsids.len(), before.nsids.len());
            let hist = c.copy_state(&v).unwrap().history;
            assert_eq!(hist.last().unwrap().kind, CopyKind::Move);
            assert_eq!(hist.last().unwrap().to.as_deref(), Some("t2/d0"));
        }
        assert!(slots_on(&c, &v, "t0").is_empty());
        // The old extents wait for t0's reconciliation before they are free.
        let err = c.remove_target("t0", false).unwrap_err();
        assert!(matches!(err, StateError::TargetInUse { .. }), "{err}");
        let (_, version) = c.stale_exports("t0").unwrap().unwrap();
        c.clear_stale_exports("t0", version).unwrap();
        c.remove_target("t0", false).unwrap();
        assert!(c.check().unwrap().is_empty());
    }

    #[test]
    fn a_move_tells_hosts_the_destinations_rdma_listener() {
        let (c, _, v) = fixture();
        let rdma: std::net::SocketAddr = "10.9.0.2:4421".parse().unwrap();
        register_rdma(&c, 2, 8 * E, Some(rdma));
        c.register_session(&v, H1, 1, 0).unwrap();
        c.set_target_state("t0", TargetState::Draining).unwrap();
        let cand = c.move_candidates(600_000, 0).unwrap()[0].clone();
        let job = c.create_job(&cand).unwrap().unwrap();
        assert!(c.job_mirroring(&v, job.id).unwrap());
        let seen = c.host_copies(&v, H1).unwrap();
        let m = seen.moving.iter().find(|m| m.job == job.id).unwrap();
        assert_eq!(
            (m.dest.target.as_str(), m.dest.rdma_addr),
            ("t2", Some(rdma))
        );
        assert_eq!(m.dest.addr, "127.0.0.1:4422".parse().unwrap(), "TCP stays");
    }

    #[test]
    fn copies_of_a_target_gone_past_the_grace_period_are_replaced() {
        let (c, clock, v) = fixture();
        c.register_session(&v, H1, 1, 0).unwrap();
        let on_t1 = slots_on(&c, &v, "t1");
        c.report_failed_extents(&v, H1, &on_t1[..1]).unwrap();
        // Heartbeats keep t0 and t2 alive; t1 is silent.
        clock.advance(30_000);
        c.heartbeat("t0").unwrap();
        c.heartbeat("t2").unwrap();
        assert!(
            c.move_candidates(60_000, 0).unwrap().is_empty(),
            "within the grace period the copy waits to be resynced in place"
        );
        clock.advance(60_000);
        c.heartbeat("t0").unwrap();
        c.heartbeat("t2").unwrap();
        let cands = c.move_candidates(60_000, 0).unwrap();
        assert_eq!(cands.len(), 2, "the stale copy and the one nobody wrote");
        for cand in cands {
            assert_eq!(cand.kind, CopyKind::Replace);
            assert_ne!(cand.source, cand.extent, "read from the copy in sync");
            let job = c.create_job(&cand).unwrap().unwrap();
            run_job(&c, &v, job.id);
        }
        assert!(slots_on(&c, &v, "t1").is_empty());
        let view = c.volume(&v).unwrap();
        assert!(view.failed_extents.is_empty(), "the new copy is in sync");
        assert!(c.host_copies(&v, H1).unwrap().failed_extents.is_empty());
    }

    #[test]
    fn a_failed_move_keeps_its_new_extent_taken_until_the_target_is_reconciled() {
        let (c, _, v) = fixture();
        c.register_session(&v, H1, 1, 0).unwrap();
        c.set_target_state("t0", TargetState::Draining).unwrap();
        let cand = c.move_candidates(600_000, 0).unwrap()[0].clone();
        let job = c.create_job(&cand).unwrap().unwrap();
        assert!(c.job_mirroring(&v, job.id).unwrap());
        assert!(c.confirm_sync(&v, H1, job.id, 1, None).unwrap());
        assert!(c.job_failed_at_host(&v, H1, job.id).unwrap());
        assert_eq!(
            c.copy_state(&v)
                .unwrap()
                .job(job.id)
                .unwrap()
                .failed_by
                .as_deref(),
            Some(H1)
        );
        c.finish_job(&v, job.id, Some("H1 could not write it"))
            .unwrap();
        let vol = c.volume(&v).unwrap().volume;
        assert_eq!(
            vol.extents[cand.extent as usize].target, "t0",
            "nothing moved"
        );
        let dest = job.dest.unwrap();
        let s = c.snapshot().unwrap();
        assert!(
            s.stale_extents()
                .iter()
                .any(|e| e.target == "t2" && e.offset == dest.offset),
            "the new extent stays taken"
        );
        assert!(c.check().unwrap().is_empty());
        assert!(
            c.move_candidates(600_000, 60_000)
                .unwrap()
                .iter()
                .all(|x| x.extent != cand.extent),
            "a failed copy waits before it is tried again"
        );
    }

    #[test]
    fn a_host_losing_the_new_extent_while_switching_leaves_the_copy_stale() {
        let (c, _, v) = fixture();
        c.register_session(&v, H1, 1, 0).unwrap();
        c.set_target_state("t0", TargetState::Draining).unwrap();
        let cand = c.move_candidates(600_000, 0).unwrap()[0].clone();
        let job = c.create_job(&cand).unwrap().unwrap();
        assert!(c.job_mirroring(&v, job.id).unwrap());
        assert!(c.confirm_sync(&v, H1, job.id, 1, None).unwrap());
        c.job_copying(&v, job.id).unwrap().unwrap();
        assert!(c.job_switching(&v, job.id).unwrap());
        assert!(c.job_failed_at_host(&v, H1, job.id).unwrap());
        assert!(c.job_confirmed(&v, job.id).unwrap(), "the swap goes on");
        c.finish_job(&v, job.id, None).unwrap();
        let view = c.volume(&v).unwrap();
        assert_eq!(
            view.failed_extents,
            vec![cand.extent],
            "never read until resynced"
        );
        assert_eq!(view.volume.extents[cand.extent as usize].target, "t2");
        assert_eq!(c.copy_state(&v).unwrap().missed[&cand.extent].regions, None);
    }

    #[test]
    fn a_rebalance_fills_a_new_target_and_ends_when_even() {
        let (c, _, v) = fixture();
        // t2 joined after the volume: it holds nothing.
        let plan = c.rebalance_plan(None).unwrap();
        assert!(!plan.is_empty());
        assert!(plan.iter().all(|m| m.to.target == "t2"), "{plan:?}");
        c.request_rebalance(None).unwrap();
        assert_eq!(c.rebalance_requests().unwrap().len(), 1);
        assert!(matches!(
            c.request_rebalance(Some("nope")),
            Err(StateError::PoolNotFound(_))
        ));
        loop {
            let (cands, settled) = c.rebalance_candidates(None).unwrap();
            if settled {
                break;
            }
            let job = c.create_job(&cands[0]).unwrap().unwrap();
            assert_eq!(c.moves_running(None).unwrap(), 1);
            run_job(&c, &v, job.id);
        }
        let counts: Vec<usize> = ["t0", "t1", "t2"]
            .iter()
            .map(|t| slots_on(&c, &v, t).len())
            .collect();
        assert!(counts.iter().all(|&n| n >= 1), "{counts:?}");
        assert!(counts.iter().max().unwrap() - counts.iter().min().unwrap() <= 1);
        assert!(c.rebalance_plan(None).unwrap().is_empty());
    }
}
