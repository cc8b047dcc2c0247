//! Volumes served by targets: the records behind attaching a volume to a
//! stock host (`nvme connect`), with no nvpool software on it.
//!
//! A volume served this way is one NVMe subsystem
//! (`nqn.2026-11.io.nvpool:volume:{uuid}`, namespace 1) presented by a few
//! targets, its *paths*. One path, the *owner*, runs the volume engine and
//! reports ANA optimized; the others report inaccessible and hold nothing
//! open. The owner reaches the volume's extents as an ordinary attached
//! host whose NQN names it and the volume ([`owner_host_nqn`]), so taking
//! that attachment away (detach) is what fences an old owner (C19).
//!
//! ```text
//!  /served/{uuid}  hosts (the subsystem's ACL), paths (target ids; path i
//!                  gets CNTLIDs cntlid_range(i)), owner, generation
//! ```
//!
//! The owner serves only under a lease it renews with the control plane
//! ([`Cluster::grant_lease`]); a lease counts from when the target asked,
//! so the target's idea of its expiry is never later than the control
//! plane's. The control plane promotes another path only after the old
//! owner's last grant is older than [`LEASE_MS`] + [`LEASE_MARGIN_MS`].
//! Programming targets and failing over is `failover.rs` (server only).

use crate::attach::validate_host_nqn;
use crate::model::{encode, ModelError, TargetState, Uuid};
use crate::state::{unchanged, Cluster, StateError, Txn};
use crate::store::Op;
pub use nvpool_api::names::{
    owner_host_nqn, parse_owner_host, volume_of_subsystem, volume_subsystem_nqn, OWNER_HOST_PREFIX,
    PATHS_MAX, VOLUME_SUBSYSTEM_PREFIX,
};
pub use nvpool_api::rest::{LeaseGrant, LEASE_RENEW_MS};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;

/// Store key prefix of served-volume records.
pub const SERVED: &str = "/served/";
/// Paths per served volume unless asked otherwise.
pub const PATHS_DEFAULT: usize = 2;
/// CNTLIDs per path: path i uses `[i * CNTLID_RANGE + 1, (i + 1) * CNTLID_RANGE - 1]`.
pub const CNTLID_RANGE: u16 = 0x1000;
/// How long a lease lets an owner serve, counted by the target from when
/// it asked for it.
pub const LEASE_MS: u64 = 4_000;
/// Slack on top of a lease before another path is promoted (clock rates
/// of two machines over a few seconds differ by far less).
pub const LEASE_MARGIN_MS: u64 = 1_000;
const _: () = assert!(LEASE_RENEW_MS * 4 <= LEASE_MS);
const _: () = assert!((PATHS_MAX as u32 + 1) * CNTLID_RANGE as u32 <= 0xFFEF + 1);

pub fn served_key(volume: &Uuid) -> String {
    format!("{SERVED}{volume}")
}

/// The CNTLIDs path `index` hands out (disjoint across paths, as the
/// host requires of one subsystem).
pub fn cntlid_range(index: usize) -> (u16, u16) {
    let i = index as u16;
    (i * CNTLID_RANGE + 1, (i + 1) * CNTLID_RANGE - 1)
}

/// A volume served by targets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Served {
    pub volume: Uuid,
    /// Host NQNs allowed to connect (the subsystem's ACL on every path).
    pub hosts: Vec<String>,
    /// Target ids; a path's index chooses its CNTLID range.
    pub paths: Vec<String>,
    /// The path running the engine; `None` until one was chosen.
    pub owner: Option<String>,
    /// Bumped at every change of owner.
    pub generation: u64,
    /// The owner was connected and told to serve (reset at every change).
    pub serving: bool,
}

impl crate::model::Stored for Served {}

impl Served {
    pub fn path_index(&self, target: &str) -> Option<usize> {
        self.paths.iter().position(|p| p == target)
    }
}

/// When each target was last granted a lease (cluster clock), in memory:
/// after a restart of the control plane, or when it becomes the leader,
/// every owner counts as granted at that moment.
#[derive(Debug)]
pub struct Leases {
    started_ms: std::sync::atomic::AtomicU64,
    granted: Mutex<HashMap<String, u64>>,
}

impl Leases {
    pub fn new(now_ms: u64) -> Leases {
        Leases {
            started_ms: now_ms.into(),
            granted: Mutex::default(),
        }
    }

    /// A new term of leadership began: grants made by another leader are
    /// unknown here, so every owner counts as granted now, as after a
    /// restart.
    pub fn restart(&self, now_ms: u64) {
        self.started_ms
            .fetch_max(now_ms, std::sync::atomic::Ordering::Relaxed);
    }

    fn record(&self, target: &str, now_ms: u64) {
        let mut g = self.granted.lock().unwrap_or_else(|p| p.into_inner());
        g.insert(target.to_owned(), now_ms);
    }

    /// Latest time `target` may still hold a lease.
    pub fn held_until(&self, target: &str) -> u64 {
        let g = self.granted.lock().unwrap_or_else(|p| p.into_inner());
        let started = self.started_ms.load(std::sync::atomic::Ordering::Relaxed);
        let last = g.get(target).copied().unwrap_or(0).max(started);
        last + LEASE_MS + LEASE_MARGIN_MS
    }
}

impl Cluster {
    /// Every served volume.
    pub fn served_all(&self) -> Result<Vec<Served>, StateError> {
        self.read_all("served volume", SERVED)
    }

    /// The served record of `volume` and its version.
    pub fn served(&self, volume: &Uuid) -> Result<Option<(Served, u64)>, StateError> {
        let read = self.read("served volume", &served_key(volume))?;
        Ok(read.map(|r| (r.value, r.version)))
    }

    /// Adds `host` to the hosts of `volume`'s served subsystem, creating
    /// the record with `paths` targets (different failure domains first)
    /// when there is none. Returns the record.
    pub fn add_served_host(
        &self,
        volume: &Uuid,
        host: &str,
        paths: usize,
    ) -> Result<Served, StateError> {
        validate_host_nqn(host)?;
        if crate::auth::is_internal_host(host) {
            return Err(
                ModelError::Invalid(format!("{host} is reserved for nvpool targets")).into(),
            );
        }
        if !(1..=PATHS_MAX).contains(&paths) {
            return Err(ModelError::Invalid(format!(
                "paths must be between 1 and {PATHS_MAX}, not {paths}"
            ))
            .into());
        }
        let key = served_key(volume);
        self.transact(|s| {
            let v = s
                .volumes
                .get(volume)
                .ok_or_else(|| StateError::VolumeNotFound(volume.to_string()))?;
            let existing = self.served(volume)?;
            let cond = unchanged(&key, existing.as_ref().map(|(_, version)| *version));
            let mut rec = match existing {
                Some((r, _)) => r,
                None => {
                    let chosen = self.choose_paths(s, &v.value, paths);
                    if chosen.is_empty() {
                        return Err(StateError::Invalid(ModelError::Invalid(
                            "no online active target can serve the volume".into(),
                        )));
                    }
                    Served {
                        volume: *volume,
                        hosts: Vec::new(),
                        paths: chosen,
                        owner: None,
                        generation: 0,
                        serving: false,
                    }
                }
            };
            if rec.hosts.iter().any(|h| h == host) {
                return Ok(Txn::Done(rec));
            }
            rec.hosts.push(host.to_owned());
            rec.hosts.sort();
            if rec.hosts.len() > crate::limits::HOSTS_PER_SERVED_VOLUME_MAX {
                return Err(StateError::TooMany {
                    what: "hosts of a served volume",
                    max: crate::limits::HOSTS_PER_SERVED_VOLUME_MAX,
                });
            }
            let ops = vec![Op::Put(key.clone(), encode(&rec))];
            Ok(Txn::Commit(vec![cond], ops, rec))
        })
    }

    /// Takes `host` off the served volume's hosts; returns the record as
    /// it is now (`None`: the volume is not served).
    pub fn remove_served_host(
        &self,
        volume: &Uuid,
        host: &str,
    ) -> Result<Option<Served>, StateError> {
        self.update(
            "served volume",
            &served_key(volume),
            |rec: Option<Served>| {
                let Some(mut rec) = rec else {
                    return Ok((None, None));
                };
                if !rec.hosts.iter().any(|h| h == host) {
                    return Ok((None, Some(rec)));
                }
                rec.hosts.retain(|h| h != host);
                Ok((Some(rec.clone()), Some(rec)))
            },
        )
    }

    /// Changes a served volume's record with `f` if it is still at
    /// `generation`; returns the new record, or `None` if the generation
    /// moved on (someone else changed the owner).
    pub fn update_served(
        &self,
        volume: &Uuid,
        generation: u64,
        f: impl Fn(&mut Served),
    ) -> Result<Option<Served>, StateError> {
        self.update(
            "served volume",
            &served_key(volume),
            |rec: Option<Served>| match rec {
                Some(mut rec) if rec.generation == generation => {
                    f(&mut rec);
                    Ok((Some(rec.clone()), Some(rec)))
                }
                _ => Ok((None, None)),
            },
        )
    }

    /// Forgets a served volume whose last host is gone.
    pub fn delete_served(&self, volume: &Uuid) -> Result<(), StateError> {
        self.delete_if_present(&served_key(volume))
    }

    /// Records a lease request of `target` and answers the subsystems it
    /// owns. A target that owns nothing is not recorded (it holds no lease
    /// that could matter).
    pub fn grant_lease(&self, target: &str) -> Result<LeaseGrant, StateError> {
        // Only the leader grants, and judges, owner leases: its failover
        // decisions must know every grant.
        if !self.is_leader() {
            return Err(crate::leader::NotLeader.into());
        }
        self.target(target)?;
        let nqns: Vec<String> = self
            .served_all()?
            .into_iter()
            .filter(|s| s.owner.as_deref() == Some(target))
            .map(|s| volume_subsystem_nqn(&s.volume))
            .collect();
        if !nqns.is_empty() {
            self.leases().record(target, self.now());
        }
        Ok(LeaseGrant {
            valid_ms: LEASE_MS,
            nqns,
        })
    }

    /// True once `target` can no longer hold a lease for anything.
    pub fn lease_expired(&self, target: &str) -> bool {
        self.now() > self.leases().held_until(target)
    }

    /// Up to `n` targets to serve `v`: online and active, a failure domain
    /// not yet used first, then those serving fewest paths, then by id.
    fn choose_paths(
        &self,
        s: &crate::state::Snapshot,
        v: &crate::model::Volume,
        n: usize,
    ) -> Vec<String> {
        let now = self.now();
        let load: BTreeMap<String, usize> = self
            .served_all()
            .unwrap_or_default()
            .iter()
            .flat_map(|r| r.paths.clone())
            .fold(BTreeMap::new(), |mut m, t| {
                *m.entry(t).or_insert(0) += 1;
                m
            });
        let holds: BTreeSet<&str> = v.extents.iter().map(|e| e.target.as_str()).collect();
        let label = &self.config().failure_domain_label;
        let mut candidates: Vec<(&crate::model::Target, String)> = s
            .targets
            .values()
            .map(|t| &t.value)
            .filter(|t| t.state == TargetState::Active)
            .filter(|t| {
                t.health(now, self.config().heartbeat_timeout_ms) == crate::model::Health::Online
            })
            .map(|t| (t, crate::placement::target_domain(t, label)))
            .collect();
        candidates.sort_by(|(a, _), (b, _)| {
            let key = |t: &crate::model::Target| {
                (
                    load.get(&t.id).copied().unwrap_or(0),
                    !holds.contains(t.id.as_str()),
                    t.id.clone(),
                )
            };
            key(a).cmp(&key(b))
        });
        let mut out: Vec<String> = Vec::new();
        let mut domains = BTreeSet::new();
        for (t, d) in &candidates {
            if out.len() < n && domains.insert(d.clone()) {
                out.push(t.id.clone());
            }
        }
        for (t, _) in &candidates {
            if out.len() < n && !out.contains(&t.id) {
                out.push(t.id.clone());
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let v: Uuid = "0f8fad5b-d9cb-469f-a165-70867728950e".parse().unwrap();
        let h = owner_host_nqn(&v, "t-1");
        assert_eq!(parse_owner_host(&h), Some((v, "t-1".to_owned())));
        assert!(validate_host_nqn(&h).is_ok());
        assert_eq!(parse_owner_host("nqn.2026-11.io.nvpool:owner:x"), None);
        assert_eq!(volume_of_subsystem(&volume_subsystem_nqn(&v)), Some(v));
    }

    #[test]
    fn cntlid_ranges_are_disjoint_and_valid() {
        for i in 0..PATHS_MAX {
            let (lo, hi) = cntlid_range(i);
            assert!(lo >= 1 && lo < hi && hi <= 0xFFEF, "{i}: {lo}..{hi}");
            if i > 0 {
                assert!(cntlid_range(i - 1).1 < lo);
            }
        }
    }
}
