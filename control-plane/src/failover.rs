//! Programming the paths of served volumes and moving ownership between
//! them (C19): export and unexport for a host, take-over (planned or
//! after a failure, with fencing), reconciliation of a target's volume
//! subsystems, and the loop that watches owners.
//!
//! ```text
//! take_over(new)   old owner answers?  ── PUT …/ana inaccessible (waits for its I/O)
//!                  record owner = new, generation + 1 (the old one gets no lease)
//!                  at once:
//!                  ├ fence: unplanned, wait until the old owner's lease has
//!                  │  run out; detach the old owner's host NQN: its
//!                  │  controllers on every backing target are gone before
//!                  │  this returns; copies on targets that did not answer
//!                  │  are marked stale
//!                  └ attach the new owner's host NQN (its own subsystems;
//!                     judged once the fence is done)
//!                  PUT …/ana optimized (the target opens the volume engine,
//!                     seeing the stale marks), record serving
//! ```
//!
//! Everything here blocks (HTTP calls with timeouts): callers run it on
//! the blocking pool.

use crate::model::{Health, TargetState, Uuid, Volume};
use crate::paths::{cntlid_range, owner_host_nqn, volume_subsystem_nqn, Served};
use crate::program::{self, ProgramError, TargetAdmin};
use crate::state::{Cluster, HostKeys, StateError};
use std::time::Duration;

/// How often the owners of served volumes are checked: a dead owner's
/// lease runs out between two checks, so this much is added to every
/// failover at worst (a check reads the cached state only).
pub const WATCH_INTERVAL_MS: u64 = 200;

pub use nvpool_api::rest::{PathView, ServedView};

/// The view of `served`.
pub fn view(cluster: &Cluster, served: &Served) -> Result<ServedView, StateError> {
    let mut paths = Vec::new();
    for t in &served.paths {
        let tv = cluster.target(t)?;
        let optimized = served.serving && served.owner.as_deref() == Some(t.as_str());
        paths.push(PathView {
            target: t.clone(),
            traddr: tv.target.addr.ip().to_string(),
            trsvcid: tv.target.addr.port(),
            rdma_traddr: tv.target.rdma_addr.map(|a| a.ip().to_string()),
            rdma_trsvcid: tv.target.rdma_addr.map(|a| a.port()),
            ana_state: if optimized {
                "optimized"
            } else {
                "inaccessible"
            }
            .into(),
        });
    }
    Ok(ServedView {
        volume: served.volume,
        subsystem_nqn: volume_subsystem_nqn(&served.volume),
        hosts: served.hosts.clone(),
        paths,
        owner: served.owner.clone(),
        generation: served.generation,
        serving: served.serving,
    })
}

/// The namespace backend every path of `v` opens.
fn backend_spec(v: &Volume) -> String {
    format!(
        "volume:{},size={},block_size={}",
        v.uuid,
        v.size_bytes,
        crate::attach::VOLUME_BLOCK_BYTES
    )
}

/// The subsystem configuration path `index` of `served` should have,
/// with `state` as its configured ANA state; `keys` are the DH-HMAC-CHAP
/// keys of those of its hosts that have some.
fn subsystem_config(
    served: &Served,
    v: &Volume,
    index: usize,
    state: &str,
    keys: &[HostKeys],
) -> serde_json::Value {
    let (lo, hi) = cntlid_range(index);
    let id = v.uuid.to_string();
    let host_keys: serde_json::Map<String, serde_json::Value> = keys
        .iter()
        .map(|k| (k.host.clone(), crate::program::target_keys(k)))
        .collect();
    serde_json::json!({
        "allowed_hosts": served.hosts,
        "allow_any_host": false,
        "host_keys": host_keys,
        // The same on every path: the host groups paths by NQN and
        // compares serial and model.
        "serial": id.replace('-', "").chars().take(20).collect::<String>(),
        "model": "nvpool volume",
        "ana": {"state": state, "cntlid_min": lo, "cntlid_max": hi, "lease": true},
        "namespaces": [{"nsid": 1, "backend": backend_spec(v), "uuid": id}],
    })
}

fn volume_of(cluster: &Cluster, uuid: &Uuid) -> Result<Volume, StateError> {
    Ok(cluster.volume(uuid)?.volume)
}

/// Makes path `target` of `served` present the volume's subsystem, in
/// `serve`'s state (optimized: the target opens the engine first).
fn ensure_path(
    cluster: &Cluster,
    served: &Served,
    v: &Volume,
    target: &str,
    serve: bool,
) -> Result<(), ProgramError> {
    let path = prepare_path(cluster, served, v, target)?;
    set_path_state(cluster, served, target, path, serve)
}

/// A path whose subsystem is configured, before its ANA state is set.
struct PreparedPath {
    admin: TargetAdmin,
    nqn: String,
    /// Its configured ANA state; `None` when it had no subsystem.
    state: Option<String>,
    /// The label of the owner keys it holds.
    owner_key_id: Option<String>,
}

/// The first half of [`ensure_path`]: path `target`'s subsystem configured
/// as `served` and `v` say (hosts, keys, range, namespace), its ANA state
/// left as it is.
fn prepare_path(
    cluster: &Cluster,
    served: &Served,
    v: &Volume,
    target: &str,
) -> Result<PreparedPath, ProgramError> {
    let index = served
        .path_index(target)
        .ok_or_else(|| StateError::TargetNotFound(target.to_owned()))?;
    let t = cluster.target(target)?.target;
    let admin = TargetAdmin::new(cluster, &t)?;
    let nqn = volume_subsystem_nqn(&served.volume);
    let have = admin.subsystem_value(&nqn)?;
    let state = have
        .as_ref()
        .and_then(|h| h.pointer("/ana/state"))
        .and_then(|s| s.as_str())
        .map(str::to_owned);
    let mut keys = Vec::new();
    for h in &served.hosts {
        keys.extend(cluster.host_keys(h)?);
    }
    let current = state.as_deref().unwrap_or("inaccessible");
    let want = subsystem_config(served, v, index, current, &keys);
    if !matches_config(have.as_ref(), &want) {
        admin.put_subsystem_value(&nqn, &want)?;
    }
    let owner_key_id = have
        .as_ref()
        .and_then(|h| h.get("owner_key_id"))
        .and_then(|k| k.as_str())
        .map(str::to_owned);
    Ok(PreparedPath {
        admin,
        nqn,
        state,
        owner_key_id,
    })
}

/// The second half of [`ensure_path`]: the prepared path's ANA state.
fn set_path_state(
    cluster: &Cluster,
    served: &Served,
    target: &str,
    path: PreparedPath,
    serve: bool,
) -> Result<(), ProgramError> {
    let PreparedPath {
        admin,
        nqn,
        state: current,
        owner_key_id,
    } = path;
    let state = if serve { "optimized" } else { "inaccessible" };
    // The owner's engine authenticates to the extents with its owner host
    // NQN's keys: handed over with the serving state, and again when the
    // target holds others (shown by label only).
    let owner_keys = match serve {
        true => cluster.host_keys(&owner_host_nqn(&served.volume, target))?,
        false => None,
    };
    let keys_differ = owner_keys
        .as_ref()
        .is_some_and(|k| owner_key_id.as_deref() != Some(k.key_id.as_str()));
    if current.as_deref() != Some(state) || keys_differ {
        admin.set_ana_owning(&nqn, state, owner_keys.as_ref())?;
    }
    if serve {
        // Serving starts with the owner's first lease renewal: wait for it
        // so that "serving" means hosts are answered.
        let deadline =
            std::time::Instant::now() + Duration::from_millis(4 * crate::paths::LEASE_RENEW_MS);
        loop {
            let effective = admin
                .subsystem_value(&nqn)?
                .and_then(|v| v.pointer("/ana/effective_state").cloned());
            if effective.as_ref().and_then(|e| e.as_str()) == Some("optimized") {
                break;
            }
            if std::time::Instant::now() >= deadline {
                tracing::warn!(volume = %served.volume, target, ?effective,
                    "the owner has not renewed its lease yet");
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    Ok(())
}

/// Whether the subsystem `have` already is what `want` says (hosts, ANA
/// range, namespace backend and id): re-putting is harmless, but checking
/// first keeps reconciliation quiet.
fn matches_config(have: Option<&serde_json::Value>, want: &serde_json::Value) -> bool {
    let Some(h) = have else {
        return false;
    };
    let mut hosts: Vec<&str> = h
        .get("allowed_hosts")
        .and_then(|a| a.as_array())
        .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
    hosts.sort_unstable();
    let want_hosts: Vec<&str> = want["allowed_hosts"]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
    let ns = h
        .get("namespaces")
        .and_then(|n| n.as_array())
        .and_then(|n| n.first());
    // The same keys: each host has keys exactly when it should, with the
    // label of the ones it should have.
    let keys_match = want_hosts.iter().all(|host| {
        crate::program::held_key_id(h.get("host_auth"), host)
            == crate::program::held_key_id(want.get("host_keys"), host)
    }) && h
        .get("host_auth")
        .and_then(|a| a.as_object())
        .is_none_or(|a| a.keys().all(|k| want_hosts.contains(&k.as_str())));
    hosts == want_hosts
        && keys_match
        && h.pointer("/ana/cntlid_min") == want.pointer("/ana/cntlid_min")
        && h.pointer("/ana/cntlid_max") == want.pointer("/ana/cntlid_max")
        && ns.and_then(|n| n.get("backend")) == want.pointer("/namespaces/0/backend")
}

/// Exports `volume` to `host`: records it, programs every path (a path
/// that cannot be reached is left to reconciliation), and makes sure an
/// owner serves.
pub fn export(
    cluster: &Cluster,
    volume: &Uuid,
    host: &str,
    paths: usize,
) -> Result<(ServedView, bool), ProgramError> {
    cluster.keys_to_serve(host)?;
    let before = cluster.served(volume)?;
    let created = before
        .as_ref()
        .is_none_or(|(s, _)| !s.hosts.iter().any(|h| h == host));
    let served = cluster.add_served_host(volume, host, paths)?;
    let v = volume_of(cluster, volume)?;
    for t in &served.paths {
        let serve = served.serving && served.owner.as_deref() == Some(t.as_str());
        if let Err(e) = ensure_path(cluster, &served, &v, t, serve) {
            tracing::warn!(%volume, target = %t, error = %e, "export: a path is not programmed yet");
        }
    }
    let served = match (&served.owner, served.serving) {
        (Some(_), true) => served,
        _ => {
            let new = pick_owner(cluster, &served, None).ok_or_else(|| {
                StateError::Invalid(crate::model::ModelError::Invalid(
                    "no path of the volume is online".into(),
                ))
            })?;
            take_over(cluster, volume, &new)?
        }
    };
    Ok((view(cluster, &served)?, created))
}

/// Stops exporting `volume` to `host`; the last host gone, the volume's
/// subsystem is removed from every path and its owner detached.
pub fn unexport(cluster: &Cluster, volume: &Uuid, host: &str) -> Result<(), ProgramError> {
    let Some(served) = cluster.remove_served_host(volume, host)? else {
        return Err(StateError::NotAttached {
            volume: *volume,
            host: host.to_owned(),
        }
        .into());
    };
    let nqn = volume_subsystem_nqn(volume);
    if !served.hosts.is_empty() {
        for t in &served.paths {
            let tv = cluster.target(t)?;
            let r = TargetAdmin::new(cluster, &tv.target).and_then(|a| a.disallow_host(&nqn, host));
            if let Err(e) = r {
                tracing::warn!(%volume, target = %t, error = %e,
                    "unexport: left to reconciliation");
            }
        }
        return Ok(());
    }
    if let Some(owner) = &served.owner {
        if let Ok(tv) = cluster.target(owner) {
            let _ =
                TargetAdmin::new(cluster, &tv.target).and_then(|a| a.set_ana(&nqn, "inaccessible"));
        }
        let h = owner_host_nqn(volume, owner);
        match program::detach_reporting(cluster, volume, &h, true) {
            Ok(_) | Err(ProgramError::State(StateError::NotAttached { .. })) => {}
            Err(e) => return Err(e),
        }
        crate::hostkeys::forget_internal(cluster, &h)?;
    }
    for t in &served.paths {
        if let Ok(tv) = cluster.target(t) {
            let r = TargetAdmin::new(cluster, &tv.target).and_then(|a| a.delete_subsystem(&nqn));
            if let Err(e) = r {
                tracing::warn!(%volume, target = %t, error = %e,
                    "unexport: left to reconciliation");
            }
        }
    }
    cluster.delete_served(volume)?;
    tracing::info!(%volume, "volume no longer served");
    Ok(())
}

/// A path to own `served`: online, active (a cordoned or draining target
/// hands its volumes over before maintenance), not `avoid`; the current
/// owner if it qualifies, else the first in path order.
fn pick_owner(cluster: &Cluster, served: &Served, avoid: Option<&str>) -> Option<String> {
    let ok = |t: &str| {
        Some(t) != avoid
            && cluster.target(t).is_ok_and(|tv| {
                tv.health == Health::Online && tv.target.state == TargetState::Active
            })
    };
    served
        .owner
        .iter()
        .chain(served.paths.iter())
        .find(|t| ok(t))
        .cloned()
}

/// Makes `new` the owner of `volume`, fencing the old owner before the
/// new one serves (module docs). Returns the record as it ends.
pub fn take_over(cluster: &Cluster, volume: &Uuid, new: &str) -> Result<Served, ProgramError> {
    let (served, _) = cluster
        .served(volume)?
        .ok_or_else(|| StateError::VolumeNotFound(volume.to_string()))?;
    let nqn = volume_subsystem_nqn(volume);
    let mut served = served;
    let changed = served.owner.as_deref() != Some(new);
    // The owner to fence, and whether it handed over (planned).
    let mut fence_old = None;
    if changed {
        let old = served.owner.clone();
        // Taking over from an owner means judging its lease, which only
        // the leader can (it alone grants them, C21): elsewhere, 503
        // not_leader, and the client asks another control plane.
        if old.is_some() && !cluster.is_leader() {
            return Err(StateError::NotLeader(crate::leader::NotLeader).into());
        }
        // Planned when the old owner answers: it stops taking I/O and
        // waits for what it has in flight before answering. One whose lease
        // ran out serves nothing and did not even renew: not asked (a
        // frozen process would hold the call for its whole timeout).
        let planned = match &old {
            None => true,
            Some(o) if cluster.lease_expired(o) => false,
            Some(o) => cluster
                .target(o)
                .map_err(ProgramError::from)
                .and_then(|tv| TargetAdmin::new(cluster, &tv.target))
                .and_then(|a| a.set_ana(&nqn, "inaccessible"))
                .inspect_err(|e| {
                    tracing::warn!(%volume, old = %o, error = %e,
                        "the owner does not answer: taking over after its lease");
                })
                .is_ok(),
        };
        // The decision (a dead owner's: its lease ran out), timed by the
        // VM test's failover breakdown.
        tracing::info!(%volume, old = ?old, new, planned, "taking the served volume over");
        let generation = served.generation;
        served = cluster
            .update_served(volume, generation, |s| {
                s.owner = Some(new.to_owned());
                s.generation += 1;
                s.serving = false;
            })?
            .ok_or_else(|| {
                StateError::Invalid(crate::model::ModelError::Invalid(
                    "the owner changed meanwhile; retry".into(),
                ))
            })?;
        tracing::info!(%volume, old = ?old, new, planned, generation = served.generation,
            "served volume has a new owner");
        fence_old = old.map(|o| (o, planned));
    }
    let h = owner_host_nqn(volume, new);
    // Keys only the new owner gets (over its admin API): a new owner gets
    // new ones, so what an earlier term of the same target held is void.
    crate::hostkeys::internal_keys(cluster, &h, changed)?;
    // The old owner is fenced while the new one is let in to the extents
    // and its path made ready: the new owner's subsystems on the backing
    // targets are its own, and nothing reaches them before its engine
    // opens, after all three (the engine must find the copies the fence
    // marked stale).
    let v = volume_of(cluster, volume)?;
    let path = std::thread::scope(|scope| {
        let fencing = fence_old.as_ref().map(|(o, planned)| {
            scope.spawn(move || {
                if !planned {
                    // Its lease (counted from its own request) ends before ours.
                    while !cluster.lease_expired(o) {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
                let unreached = fence(cluster, volume, o)?;
                tracing::info!(%volume, old = %o, ?unreached, "the old owner is fenced");
                Ok(())
            })
        });
        let preparing = scope.spawn(|| {
            let path = prepare_path(cluster, &served, &v, new)?;
            path.admin.confirm_identity()?;
            Ok::<_, ProgramError>(path)
        });
        let settle = || match fencing {
            Some(f) => f.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
            None => Ok(()),
        };
        program::attach_settling(cluster, volume, &h, settle)?;
        preparing
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })?;
    tracing::info!(%volume, owner = new, "the new owner is attached to the extents");
    set_path_state(cluster, &served, new, path, true)?;
    tracing::info!(%volume, owner = new, "the owner serves the volume");
    let generation = served.generation;
    Ok(cluster
        .update_served(volume, generation, |s| s.serving = true)?
        .unwrap_or(served))
}

/// Takes the old owner's access to the volume's extents away (returns the
/// targets that did not answer): its host
/// NQN is detached, which removes its subsystem (and kills its
/// controllers) on every backing target. Copies on targets that did not
/// answer may still take a late write from it, so they are marked stale
/// (unless one is the last copy in sync of its row: then nothing could
/// be read instead anyway, and it stays as it is).
fn fence(cluster: &Cluster, volume: &Uuid, old: &str) -> Result<Vec<String>, ProgramError> {
    let h = owner_host_nqn(volume, old);
    let unreached = match program::detach_reporting(cluster, volume, &h, true) {
        Ok(t) => t,
        Err(ProgramError::State(StateError::NotAttached { .. })) => Vec::new(),
        Err(e) => return Err(e),
    };
    crate::hostkeys::forget_internal(cluster, &h)?;
    if unreached.is_empty() {
        return Ok(unreached);
    }
    let v = volume_of(cluster, volume)?;
    for (i, e) in v.extents.iter().enumerate() {
        if unreached.contains(&e.target) {
            match cluster.mark_stale(volume, i as u32) {
                Ok(()) => {
                    tracing::warn!(%volume, extent = i, target = %e.target,
                        "copy marked stale: its target could not be fenced");
                }
                Err(StateError::LastInSyncCopy { .. }) => {
                    tracing::warn!(%volume, extent = i, target = %e.target,
                        "last copy in sync of its row could not be fenced; left as is");
                }
                Err(err) => return Err(err.into()),
            }
        }
    }
    Ok(unreached)
}

/// One round of the owner watch: a volume whose owner is cordoned or
/// draining, gone from its paths or past its lease gets a new owner; one whose owner was
/// not made to serve (an earlier step failed) is retried.
pub fn watch_once(cluster: &Cluster) -> Result<(), StateError> {
    for served in cluster.served_all()? {
        if served.hosts.is_empty() {
            continue;
        }
        let volume = served.volume;
        let Some(owner) = served.owner.clone() else {
            if let Some(new) = pick_owner(cluster, &served, None) {
                if let Err(e) = take_over(cluster, &volume, &new) {
                    tracing::warn!(%volume, error = %e, "choosing an owner failed; will retry");
                }
            }
            continue;
        };
        let state = cluster.target(&owner).ok();
        let leaving = state
            .as_ref()
            .is_none_or(|tv| tv.target.state != TargetState::Active);
        let dead = cluster.lease_expired(&owner)
            && state
                .as_ref()
                .is_none_or(|tv| tv.health == Health::Offline || served.serving);
        let replace = leaving || dead || served.path_index(&owner).is_none();
        let next = if replace {
            pick_owner(cluster, &served, Some(&owner))
        } else if !served.serving {
            Some(owner.clone())
        } else {
            None
        };
        if let Some(new) = next {
            if let Err(e) = take_over(cluster, &volume, &new) {
                tracing::warn!(%volume, owner = %owner, new = %new, error = %e,
                    "moving the served volume failed; will retry");
            }
        }
    }
    Ok(())
}

/// Makes `target`'s volume subsystems what the served records say, and
/// removes the ones no record names (reconciliation, C14).
pub fn reconcile_target(cluster: &Cluster, target: &str) -> Result<usize, ProgramError> {
    let t = cluster.target(target)?.target;
    let admin = TargetAdmin::new(cluster, &t)?;
    let mut changed = 0;
    let all = cluster.served_all()?;
    for nqn in admin.subsystem_nqns()? {
        let Some(v) = crate::paths::volume_of_subsystem(&nqn) else {
            continue;
        };
        let wanted = all
            .iter()
            .any(|s| s.volume == v && s.path_index(target).is_some());
        if !wanted {
            admin.delete_subsystem(&nqn)?;
            changed += 1;
        }
    }
    for served in all.iter().filter(|s| s.path_index(target).is_some()) {
        if served.hosts.is_empty() {
            continue;
        }
        let v = match volume_of(cluster, &served.volume) {
            Ok(v) => v,
            Err(StateError::VolumeNotFound(_)) => continue,
            Err(e) => return Err(e.into()),
        };
        let serve = served.serving && served.owner.as_deref() == Some(target);
        ensure_path(cluster, served, &v, target, serve)?;
    }
    Ok(changed)
}

/// Runs [`watch_once`] every [`WATCH_INTERVAL_MS`] until the process ends.
pub async fn watch_loop(cluster: std::sync::Arc<Cluster>) {
    let mut tick = tokio::time::interval(Duration::from_millis(WATCH_INTERVAL_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let c = cluster.clone();
        let _ = tokio::task::spawn_blocking(move || {
            // The leader's work (see `leader`).
            if !c.is_leader() {
                return;
            }
            if let Err(e) = watch_once(&c) {
                tracing::warn!(error = %e, "watching served volumes failed");
            }
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Layout, VolumeSpec};
    use crate::moves::tests::{cluster, register, register_rdma};

    /// A follower does not take a volume over from an owner: it cannot know
    /// the owner's lease (the leader granted it). Nothing changes.
    #[test]
    fn only_the_leader_takes_over_from_an_owner() {
        let e = crate::limits::EXTENT_BYTES_MIN;
        let (c, _) = cluster(e);
        register(&c, 0, 4 * e);
        register(&c, 1, 4 * e);
        let uuid = Uuid([6; 16]);
        c.create_volume(&VolumeSpec {
            uuid,
            name: "v".into(),
            size_bytes: e,
            layout: Layout::Concat,
            pool: None,
        })
        .unwrap();
        let served = c
            .add_served_host(&uuid, "nqn.2014-08.org.nvmexpress:uuid:host-1", 2)
            .unwrap();
        let owned = c
            .update_served(&uuid, served.generation, |s| {
                s.owner = Some("t0".into());
                s.generation += 1;
            })
            .unwrap()
            .unwrap();
        let follower = c
            .clone()
            .with_leadership(crate::leader::Leadership::elected("follower"));
        let r = take_over(&follower, &uuid, "t1");
        assert!(
            matches!(r, Err(ProgramError::State(StateError::NotLeader(_)))),
            "{r:?}"
        );
        let (now, _) = c.served(&uuid).unwrap().unwrap();
        assert_eq!(now, owned, "a refused take-over changes nothing");
    }

    #[test]
    fn paths_show_the_rdma_listener_of_targets_that_have_one() {
        let e = crate::limits::EXTENT_BYTES_MIN;
        let (c, _) = cluster(e);
        register(&c, 0, 4 * e);
        register_rdma(&c, 1, 4 * e, Some("10.1.0.1:4421".parse().unwrap()));
        let uuid = Uuid([5; 16]);
        c.create_volume(&VolumeSpec {
            uuid,
            name: "v".into(),
            size_bytes: e,
            layout: Layout::Concat,
            pool: None,
        })
        .unwrap();
        let host = "nqn.2014-08.org.nvmexpress:uuid:host-1";
        let served = c.add_served_host(&uuid, host, 2).unwrap();
        let v = view(&c, &served).unwrap();
        assert_eq!(v.paths.len(), 2);
        let json = serde_json::to_value(&v).unwrap();
        for p in json["paths"].as_array().unwrap() {
            if p["target"] == "t1" {
                assert_eq!(
                    (&p["rdma_traddr"], &p["rdma_trsvcid"]),
                    (&"10.1.0.1".into(), &4421.into())
                );
                assert_eq!(
                    (&p["traddr"], &p["trsvcid"]),
                    (&"127.0.0.1".into(), &4421.into())
                );
            } else {
                assert!(
                    p.get("rdma_traddr").is_none() && p.get("rdma_trsvcid").is_none(),
                    "{p}"
                );
            }
        }
    }
}
