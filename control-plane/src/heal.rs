//! The heal loop: finds stale copies whose target is back and drives a copy
//! job through its states ([`crate::resync`]) by programming the targets.
//!
//! ```text
//!  every HEAL_INTERVAL_MS
//!   ├─ stale copy, target online, a source in sync ─► create_job (arming)
//!   ├─ arming:    export the source extent to the destination target's
//!   │             copier; arm the copy there (its guard records host writes)
//!   │             ─► mirroring (hosts are told)
//!   ├─ mirroring: every writer confirmed ─► start the copier on the regions
//!   │             ─► copying; no confirmation in MIRROR_CONFIRM_TIMEOUT_MS ─► failed
//!   ├─ copying:   poll the target: progress, done ─► in sync, failed ─► stale
//!   │             (replace, move: done ─► switching, hosts read the new extent)
//!   └─ switching: every writer confirmed ─► the new extent takes the copy's
//!                 place; the old one is let go once its target is reconciled
//! ```
//!
//! Jobs start on stale copies whose target is back (in place), on copies
//! whose target is gone for longer than `replace_after` or drains, and on
//! the moves of a requested rebalance ([`crate::moves`]).
//!
//! **Where the copier runs.** On the destination's target: it reads the
//! source over NVMe/TCP and writes its own device, so the data crosses the
//! network once, GPU hosts spend no CPU on it, volumes nobody attached heal
//! too, and the guard that orders the copier against host writes sits
//! where both kinds of write land. The control plane only moves state.
//!
//! Everything here blocks; the loop runs on a thread of its own. Errors
//! talking to a target end the job (it is retried after
//! `RESYNC_RETRY_MS`); errors of the store are logged and the next round
//! tries again.

use crate::attach::Export;
use crate::limits::{
    COPIES_PER_TARGET_MAX, HEAL_BUSY_INTERVAL_MS, HEAL_INTERVAL_MS, MIRROR_CONFIRM_TIMEOUT_MS,
    REBUILD_RATE_BYTES_PER_SEC, REPLACE_AFTER_MS, RESYNC_RETRY_MS,
};
use crate::model::{Extent, Uuid, Volume};
use crate::plan::RESYNC_REGION_BYTES;
use crate::program::{ensure_exports, ensure_exports_protected, Added, ProgramError, TargetAdmin};
use crate::resync::{copier_export, CopyJob, CopyKind, JobState};
use crate::state::{Cluster, StateError};
use nvpool_api::admin::{CopyRequest, CopySource, CopyState};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How the heal loop behaves.
#[derive(Debug, Clone)]
pub struct HealConfig {
    pub interval: Duration,
    /// Copy rate of each job on its target (0: unthrottled).
    pub rate_bytes_per_sec: u64,
    pub retry_ms: u64,
    pub confirm_timeout_ms: u64,
    /// How long a target may be gone before its copies are replaced.
    pub replace_after_ms: u64,
}

impl Default for HealConfig {
    fn default() -> HealConfig {
        HealConfig {
            interval: Duration::from_millis(HEAL_INTERVAL_MS),
            rate_bytes_per_sec: REBUILD_RATE_BYTES_PER_SEC,
            retry_ms: RESYNC_RETRY_MS,
            confirm_timeout_ms: MIRROR_CONFIRM_TIMEOUT_MS,
            replace_after_ms: REPLACE_AFTER_MS,
        }
    }
}

/// Why one step of a job failed.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Program(#[from] ProgramError),
    #[error("{0}")]
    Other(String),
}

/// The heal loop on a thread of its own, until `stop` is set.
pub fn spawn(
    cluster: Arc<Cluster>,
    cfg: HealConfig,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("nvpool-heal".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                // The leader's work (see `leader`).
                if !cluster.is_leader() {
                    crate::leader::sleep_unless(&stop, cfg.interval);
                    continue;
                }
                let busy = match heal_once(&cluster, &cfg) {
                    Ok(busy) => busy,
                    Err(e) => {
                        tracing::warn!(error = %e, "heal round failed; retrying");
                        false
                    }
                };
                // While jobs run, look again soon: a job's next step (and
                // the copy in sync) waits on this loop, not on the disks.
                let mut left = if busy {
                    cfg.interval
                        .min(Duration::from_millis(HEAL_BUSY_INTERVAL_MS))
                } else {
                    cfg.interval
                };
                // Sleep in small steps so a stop is prompt.
                while !left.is_zero() && !stop.load(Ordering::Relaxed) {
                    let step = left.min(Duration::from_millis(100));
                    std::thread::sleep(step);
                    left -= step;
                }
            }
        })
}

/// The id of a job on its destination target.
pub fn target_copy_id(volume: &Uuid, job: u64) -> String {
    format!("{volume}-{job}")
}

/// One round: start jobs on stale copies, move every job on as far as it
/// goes now (arming, then mirroring, then copying when nobody has to
/// confirm). Returns whether any job is under way.
pub fn heal_once(cluster: &Cluster, cfg: &HealConfig) -> Result<bool, StateError> {
    start_jobs(cluster, cfg)?;
    let s = cluster.snapshot()?;
    let mut busy = false;
    for (uuid, cs) in &s.copy_states {
        let Some(v) = s.volumes.get(uuid) else {
            continue;
        };
        for job in &cs.value.jobs {
            if !cluster.is_leader() {
                return Err(crate::leader::NotLeader.into());
            }
            busy = true;
            let mut job = job.clone();
            // At most one pass per state.
            for _ in 0..3 {
                if let Err(e) = step(cluster, cfg, &v.value, &job) {
                    let why = e.to_string();
                    tracing::warn!(volume = %uuid, job = job.id, extent = job.extent,
                        error = %why, "copy job failed");
                    if let Err(e) = cluster.finish_job(uuid, job.id, Some(&why)) {
                        tracing::warn!(error = %e, "recording a failed copy job failed");
                    }
                    cleanup(cluster, &v.value, &job);
                    if let Some(d) = &job.dest {
                        release_on(cluster, &d.target);
                    }
                    break;
                }
                match cluster.copy_state(uuid)?.job(job.id) {
                    Some(next) if next.state != job.state => job = next.clone(),
                    _ => break,
                }
            }
        }
    }
    Ok(busy)
}

fn start_jobs(cluster: &Cluster, cfg: &HealConfig) -> Result<(), StateError> {
    // Moves off gone and draining targets first: a stale copy on a
    // draining target is rebuilt elsewhere rather than in place.
    let mut candidates = cluster.move_candidates(cfg.replace_after_ms, cfg.retry_ms)?;
    candidates.extend(cluster.resync_candidates(cfg.retry_ms)?);
    for r in cluster.rebalance_requests()? {
        let pool = r.pool.as_deref();
        let (moves, settled) = cluster.rebalance_candidates(pool)?;
        if settled && cluster.moves_running(pool)? == 0 {
            cluster.end_rebalance(pool)?;
            tracing::info!(pool = pool.unwrap_or("(unpooled)"), "rebalance done");
        }
        candidates.extend(moves);
    }
    if candidates.is_empty() {
        return Ok(());
    }
    let s = cluster.snapshot()?;
    let mut per_target: BTreeMap<String, usize> = BTreeMap::new();
    for (uuid, cs) in &s.copy_states {
        if let Some(v) = s.volumes.get(uuid) {
            for j in &cs.value.jobs {
                if let Some(e) = j.dest_extent(&v.value) {
                    *per_target.entry(e.target.clone()).or_default() += 1;
                }
            }
        }
    }
    // Copies a job started on this round: a later candidate for the same
    // copy (a stale copy on a draining target is both) is the fallback
    // when the first found no room, never a second job.
    let mut started: std::collections::BTreeSet<(Uuid, u32)> = Default::default();
    for c in candidates {
        let Some(v) = s.volumes.get(&c.volume) else {
            continue;
        };
        if started.contains(&(c.volume, c.extent)) {
            continue;
        }
        // Where the copy lands, when known before placing it.
        let dest = match (&c.kind, &c.to) {
            (CopyKind::ResyncFull | CopyKind::ResyncPartial, _) => {
                Some(v.value.extents[c.extent as usize].target.clone())
            }
            (_, Some(to)) => Some(to.target.clone()),
            (_, None) => None,
        };
        if let Some(d) = &dest {
            if per_target.get(d).copied().unwrap_or(0) >= COPIES_PER_TARGET_MAX {
                continue;
            }
        }
        if !c.kind.moves() {
            let dest = &v.value.extents[c.extent as usize].target;
            // A target that still heartbeats recently but does not answer
            // is not back yet: no job (it would only fail).
            let reachable = s.targets.get(dest).is_some_and(|t| {
                TargetAdmin::new(cluster, &t.value)
                    .and_then(|a| a.copies())
                    .is_ok()
            });
            if !reachable {
                tracing::debug!(target = %dest, "stale copy's target does not answer yet");
                continue;
            }
        }
        let job = match cluster.create_job(&c) {
            Ok(Some(job)) => job,
            Ok(None) => continue,
            // No room elsewhere (yet): the copy stays where it is.
            Err(StateError::Placement(e)) => {
                tracing::warn!(volume = %c.volume, extent = c.extent, kind = c.kind.as_str(),
                    error = %e, "no place for the copy's new extent");
                continue;
            }
            // Nor for its snapshots' trees.
            Err(
                e @ StateError::Unprocessable {
                    kind: "no_space", ..
                },
            ) => {
                tracing::warn!(volume = %c.volume, extent = c.extent, kind = c.kind.as_str(),
                    error = %e, "no place for the copy's snapshot trees");
                continue;
            }
            Err(e) => return Err(e),
        };
        started.insert((c.volume, c.extent));
        if let Some(e) = job.dest_extent(&v.value) {
            *per_target.entry(e.target.clone()).or_default() += 1;
        }
        tracing::info!(volume = %c.volume, job = job.id, extent = c.extent,
            source = c.source, kind = job.kind.as_str(), snapshots = job.family.len(),
            to = ?job.dest.as_ref().map(|d| d.device_ref().to_string()), "copy job created");
    }
    Ok(())
}

fn step(cluster: &Cluster, cfg: &HealConfig, v: &Volume, job: &CopyJob) -> Result<(), StepError> {
    let now = cluster.now();
    let id = target_copy_id(&v.uuid, job.id);
    let dest = job
        .dest_extent(v)
        .ok_or_else(|| StepError::Other("the job names no extent".into()))?;
    let dest_target = cluster.target(&dest.target)?.target;
    if let Some(host) = &job.failed_by {
        if job.state != JobState::Switching {
            return Err(StepError::Other(format!(
                "{host} could not write the new extent"
            )));
        }
    }
    match job.state {
        JobState::Arming => {
            // A thin copy's snapshot trees first, one at a time (T7).
            if !copy_family(cluster, cfg, v, job, &dest_target)? {
                return Ok(());
            }
            // Hosts write a new extent too: export it to each of them,
            // write-protected for a read-only volume as attach does.
            if let Some(d) = &job.dest {
                let admin = TargetAdmin::new(cluster, &dest_target)?;
                let read_only = cluster.is_read_only(&v.uuid)?;
                for (host, &nsid) in &job.nsids {
                    let x = crate::attach::export_of(host, d, nsid);
                    let keys = cluster.host_keys(host)?;
                    let mut added = Added::default();
                    let protected = BTreeSet::from([nsid]);
                    ensure_exports_protected(
                        &admin,
                        &dest_target,
                        host,
                        keys.as_ref(),
                        &[x],
                        read_only.then_some(&protected),
                        &mut added,
                    )?;
                }
            }
            let src = &v.extents[job.source as usize];
            let src_target = cluster.target(&src.target)?.target;
            let x = copier_export(v, job)
                .ok_or_else(|| StepError::Other("the job names no extent".into()))?;
            // The live tree starts as its newest snapshot's new tree, so the
            // two share what they shared at the source.
            let base_root = crate::families::live_base_root(job);
            let body = copy_request(cluster, cfg, &src_target, &x, &dest_target, dest, base_root)?;
            let admin = TargetAdmin::new(cluster, &dest_target)?;
            // Earlier jobs of this volume the target still holds (their
            // cleanup did not reach it) would refuse the range: they are
            // over, so remove them, and this job's family copies with them
            // (all copied).
            let job_family_ids: Vec<String> = crate::families::target_copy_ids(&v.uuid, job)
                .into_iter()
                .skip(1)
                .collect();
            let mine = format!("{}-", v.uuid);
            let live: Vec<String> = cluster
                .copy_state(&v.uuid)?
                .jobs
                .iter()
                .flat_map(|j| crate::families::target_copy_ids(&v.uuid, j))
                .filter(|c| !job_family_ids.contains(c))
                .collect();
            for old in admin.copies()? {
                if old.id.starts_with(&mine) && !live.contains(&old.id) {
                    admin.delete_copy(&old.id)?;
                }
            }
            admin.arm_copy(&id, &body)?;
            cluster.job_mirroring(&v.uuid, job.id)?;
            tracing::info!(volume = %v.uuid, job = job.id, "copy armed; hosts mirror to it");
        }
        JobState::Mirroring => {
            if let Some(started) = cluster.job_copying(&v.uuid, job.id)? {
                TargetAdmin::new(cluster, &dest_target)?
                    .start_copy(&id, started.regions.as_deref())?;
                tracing::info!(volume = %v.uuid, job = job.id, kind = started.kind.as_str(),
                    bytes = started.bytes_total, "copy started");
            } else if now.saturating_sub(job.state_ms) > cfg.confirm_timeout_ms {
                let s = cluster.snapshot()?;
                let missing: Vec<String> = s
                    .writers_of(&v.uuid)
                    .into_iter()
                    .filter(|h| !job.confirmed.contains(h))
                    .collect();
                return Err(StepError::Other(format!(
                    "hosts did not confirm mirroring within {} s: {}",
                    cfg.confirm_timeout_ms / 1000,
                    missing.join(", ")
                )));
            }
        }
        JobState::Copying => {
            let st = TargetAdmin::new(cluster, &dest_target)?
                .copy_status(&id)?
                .ok_or_else(|| {
                    StepError::Other("the target forgot the copy (it restarted)".into())
                })?;
            match st.state {
                CopyState::Done if job.moves() => {
                    cluster.job_switching(&v.uuid, job.id)?;
                    tracing::info!(volume = %v.uuid, job = job.id, extent = job.extent,
                        bytes = st.bytes_copied, "new extent filled; hosts switch to it");
                }
                CopyState::Done => {
                    cluster.finish_job(&v.uuid, job.id, None)?;
                    tracing::info!(volume = %v.uuid, job = job.id, extent = job.extent,
                        bytes = st.bytes_copied, "copy in sync");
                    cleanup(cluster, v, job);
                }
                CopyState::Failed | CopyState::Cancelled => {
                    return Err(StepError::Other(st.error.unwrap_or_else(|| {
                        format!("the copier stopped ({})", st.state.name())
                    })))
                }
                _ => cluster.job_progress(&v.uuid, job.id, st.bytes_copied)?,
            }
        }
        JobState::Switching => {
            // No timeout: a host may read the new extent already, so the job
            // can only end by the swap. A host that never confirms is one
            // to detach (forced, if it is gone).
            if cluster.job_confirmed(&v.uuid, job.id)? {
                cluster.finish_job(&v.uuid, job.id, None)?;
                let old = &v.extents[job.extent as usize];
                tracing::info!(volume = %v.uuid, job = job.id, extent = job.extent,
                    from = %old.device_ref(), to = %dest.device_ref(), kind = job.kind.as_str(),
                    snapshots = job.family.len(), "copy moved");
                cleanup(cluster, v, job);
                // Let the old extent go (it is free once unexported).
                release_on(cluster, &old.target);
            } else if now.saturating_sub(job.state_ms) > cfg.confirm_timeout_ms {
                tracing::warn!(volume = %v.uuid, job = job.id,
                    "hosts have not confirmed reading the new extent; the old one stays");
            }
        }
    }
    Ok(())
}

/// The copy request that fills `dest` (on `dest_target`) from `x`, a
/// source extent or tree exported to the destination's copier on
/// `src_target`, after making that export. The copier authenticates with
/// keys the control plane draws for it: the source target requires them,
/// and the copier gets them with the copy, over its target's admin API
/// only.
fn copy_request(
    cluster: &Cluster,
    cfg: &HealConfig,
    src_target: &crate::model::Target,
    x: &Export,
    dest_target: &crate::model::Target,
    dest: &Extent,
    base_root: Option<u64>,
) -> Result<CopyRequest, StepError> {
    let copier_keys = crate::hostkeys::internal_keys(cluster, &x.host_nqn, false)?;
    let mut added = Added::default();
    ensure_exports(
        &TargetAdmin::new(cluster, src_target)?,
        src_target,
        &x.host_nqn,
        Some(&copier_keys),
        std::slice::from_ref(x),
        &mut added,
    )?;
    let device = dest_target.device(&dest.device).ok_or_else(|| {
        StepError::Other(format!("device {} is no longer registered", dest.device))
    })?;
    Ok(CopyRequest {
        dest: nvpool_api::admin::extent_spec(&device.backend, dest.offset, dest.length),
        source: CopySource {
            addr: src_target.addr.to_string(),
            subsystem_nqn: x.subsystem_nqn.clone(),
            nsid: x.nsid,
            host_nqn: x.host_nqn.clone(),
            dhchap: Some(crate::program::dhchap_keys(&copier_keys)),
        },
        region_bytes: RESYNC_REGION_BYTES,
        rate_bytes_per_sec: cfg.rate_bytes_per_sec,
        base_root,
    })
}

/// Arming a job whose copy moves with its snapshots (design T7): copies
/// the family's members in turn, each by a target copy job of its own into
/// its new tree, starting as the previous member's new tree. No host is
/// involved (snapshot trees take no writes), so each is started whole at
/// once. Progress is the job's `family_done`: a restarted control plane
/// finds the member's copy on the target and goes on; a target that
/// forgot it refuses the re-armed copy (its tree holds data), the job
/// fails and its retry starts from the first member with new trees.
/// Returns whether every member is copied.
fn copy_family(
    cluster: &Cluster,
    cfg: &HealConfig,
    v: &Volume,
    job: &CopyJob,
    dest_target: &crate::model::Target,
) -> Result<bool, StepError> {
    let index = job.family_done as usize;
    let (Some(d), Some(m)) = (&job.dest, job.family.get(index)) else {
        return Ok(true);
    };
    let id = crate::families::family_copy_id(&v.uuid, job.id, index);
    let admin = TargetAdmin::new(cluster, dest_target)?;
    let Some(st) = admin.copy_status(&id)? else {
        let src_target = cluster.target(&m.source.target)?.target;
        let x = crate::families::member_export(m, &d.target);
        let base_root = crate::families::member_base_root(job, index);
        let body = copy_request(
            cluster,
            cfg,
            &src_target,
            &x,
            dest_target,
            &m.tree,
            base_root,
        )?;
        admin.arm_copy(&id, &body)?;
        admin.start_copy(&id, None)?;
        tracing::info!(volume = %v.uuid, job = job.id, member = index, snapshot = %m.snapshot,
            to = %m.tree.device_ref(), root = crate::snapshots::root_of(&m.tree),
            "snapshot tree copy started");
        return Ok(false);
    };
    match st.state {
        CopyState::Armed => admin.start_copy(&id, None)?,
        CopyState::Running => {}
        CopyState::Done => {
            cluster.family_member_done(&v.uuid, job.id, job.family_done)?;
            tracing::info!(volume = %v.uuid, job = job.id, member = index, snapshot = %m.snapshot,
                bytes = st.bytes_copied, "snapshot tree copied");
            remove_member_copy(cluster, v, job, index);
        }
        CopyState::Failed | CopyState::Cancelled => {
            return Err(StepError::Other(format!(
                "copying the tree of snapshot {}: {}",
                m.snapshot,
                st.error
                    .unwrap_or_else(|| format!("the copier stopped ({})", st.state.name()))
            )))
        }
    }
    Ok(false)
}

/// Removes family member `index`'s copy from the destination and its
/// source's copier export (best effort, as [`cleanup`]).
fn remove_member_copy(cluster: &Cluster, v: &Volume, job: &CopyJob, index: usize) {
    let (Some(d), Some(m)) = (&job.dest, job.family.get(index)) else {
        return;
    };
    let id = crate::families::family_copy_id(&v.uuid, job.id, index);
    if let Ok(t) = cluster.target(&d.target) {
        let r = TargetAdmin::new(cluster, &t.target).and_then(|a| a.delete_copy(&id));
        if let Err(e) = r {
            tracing::debug!(error = %e, "removing a snapshot tree's copy on its target failed");
        }
    }
    let x = crate::families::member_export(m, &d.target);
    if let Ok(t) = cluster.target(&m.source.target) {
        let r = TargetAdmin::new(cluster, &t.target)
            .and_then(|a| a.delete_namespace(&x.subsystem_nqn, x.nsid));
        if let Err(e) = r {
            tracing::debug!(error = %e, "removing a snapshot tree's copier export failed");
        }
    }
}

/// Reconciles `target` if it answers, so extents it no longer needs to
/// export are freed now rather than at the next periodic reconciliation.
fn release_on(cluster: &Cluster, target: &str) {
    let online = cluster
        .target(target)
        .is_ok_and(|t| t.health == crate::model::Health::Online);
    if online {
        if let Err(e) = crate::program::reconcile(cluster, target) {
            tracing::debug!(target, error = %e, "reconciling after a copy job failed");
        }
    }
}

/// Disarms the copy on the destination and removes the source's copier
/// export (best effort: reconciliation removes a leftover export, and a
/// leftover guard only records writes until the target restarts).
fn cleanup(cluster: &Cluster, v: &Volume, job: &CopyJob) {
    // Family members still copying when the job ended.
    for i in job.family_done as usize..job.family.len() {
        remove_member_copy(cluster, v, job, i);
    }
    let id = target_copy_id(&v.uuid, job.id);
    let Some(dest) = job.dest_extent(v) else {
        return;
    };
    if let Ok(t) = cluster.target(&dest.target) {
        let r = TargetAdmin::new(cluster, &t.target).and_then(|a| a.delete_copy(&id));
        if let Err(e) = r {
            tracing::debug!(error = %e, "removing the copy on its target failed");
        }
    }
    let src = &v.extents[job.source as usize];
    if let (Ok(t), Some(x)) = (cluster.target(&src.target), copier_export(v, job)) {
        let r = TargetAdmin::new(cluster, &t.target)
            .and_then(|a| a.delete_namespace(&x.subsystem_nqn, x.nsid));
        if let Err(e) = r {
            tracing::debug!(error = %e, "removing the copier export failed");
        }
    }
}
