//! Attachments: which host may reach which volume, and the namespaces that
//! export the volume's extents to it.
//!
//! **One subsystem per host on each target.** Host `H` reaches every
//! volume attached to it on target `T` through one subsystem,
//! [`host_subsystem_nqn`]`(H)`, whose ACL lists `H` alone. Each extent of an
//! attached volume on `T` is one namespace of that subsystem. So a host
//! needs one NVMe/TCP association per target it uses, however many volumes
//! it attaches; attaching another volume adds namespaces, which the target
//! announces through the Changed Namespace List log and an async event.
//!
//! **NSIDs** are allocated per (host, target): the lowest NSIDs no other
//! extent of that host uses on that target. Every attach and detach of a
//! host rewrites its [`HostRecord`], and commits only if that record is
//! unchanged since it was read, so concurrent attaches of one host never
//! hand out the same NSID. An attach also rewrites its volume's record
//! (unchanged), so a delete racing with it sees the attachment or fails
//! its condition and looks again.
//!
//! **States.** An attachment is recorded as `attaching` before any target
//! is programmed, becomes `attached` when every target has the namespaces,
//! and `detaching` before they are removed. A crash in between leaves a
//! record that says what may be exported: a retried attach finishes it, a
//! detach removes it, and a target that re-registers is reconciled against
//! the records (namespaces nobody should see are removed).
//!
//! **Stale exports.** A forced detach cannot wait for an unreachable
//! target. The namespaces it could not remove are recorded under
//! `/stale-exports/{target}`, and their extents stay allocated, even after
//! their volume is deleted, until the target has been reconciled: a freed
//! extent is never handed to a new volume while an old host may still
//! reach it.

use crate::limits::{ID_BYTES_MAX, NAMESPACES_PER_HOST_TARGET_MAX};
use crate::model::{encode, DeviceRef, Extent, ModelError, Target, Uuid, Volume};
use crate::plan::{ConnectionPlan, PlanExtent, HOST_SUBSYSTEM_PREFIX};
use crate::state::{keys, unchanged, Cluster, Snapshot, StateError, Txn, Versioned};
use crate::store::{Condition, Op};
pub use nvpool_api::rest::AttachmentState;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};

/// Longest NQN the NVMe specification allows, in bytes.
pub const NQN_BYTES_MAX: usize = 223;

/// Logical block size of exported extents and volumes.
pub const VOLUME_BLOCK_BYTES: u32 = 4096;

/// A volume attached to a host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    pub volume: Uuid,
    pub host_nqn: String,
    pub state: AttachmentState,
    pub created_ms: u64,
    /// The NSID of each extent, in the volume's extent order. Shorter than
    /// the extent list after a grow until the new extents are exported.
    pub nsids: Vec<u32>,
    /// Extents (indices into the volume's extents) the host reported failed:
    /// copies that missed writes. They are never read again (the host is
    /// told on every attach) until rebuilt; the volume is degraded.
    pub failed_extents: Vec<u32>,
}

impl crate::model::Stored for Attachment {}

/// The copies of a volume that missed writes, whichever host found them: a
/// property of the volume, not of one attachment, so it outlives detach and
/// every later attach (by any host) is told never to read them. Kept until
/// the copies are rebuilt (not built yet) or the volume is deleted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedCopies {
    pub volume: Uuid,
    /// Indices into the volume's extents, sorted, no duplicates.
    pub extents: Vec<u32>,
}

impl crate::model::Stored for FailedCopies {}

/// Per-host record; its version guards NSID allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostRecord {
    pub host_nqn: String,
    /// Bumped by every attach and detach of the host.
    pub changes: u64,
}

impl crate::model::Stored for HostRecord {}

/// One namespace a target exports (or should, or may still).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Export {
    pub subsystem_nqn: String,
    pub host_nqn: String,
    pub nsid: u32,
    pub device: String,
    pub offset: u64,
    pub length: u64,
}

impl Export {
    /// The backend spec the target opens: the device's range of the
    /// extent, or the extent's tree of a grain pool.
    pub fn backend_spec(&self, target: &Target) -> Option<String> {
        let d = target.device(&self.device)?;
        Some(nvpool_api::admin::extent_spec(
            &d.backend,
            self.offset,
            self.length,
        ))
    }
}

/// Namespaces an unreachable target may still export after a forced
/// detach; their extents stay allocated until it is reconciled. Also
/// the extents of grain pools that were freed (a volume deleted, a copy
/// moved away): entries with an empty subsystem (no namespace: see
/// [`Snapshot::freed_tree`]), and namespace entries
/// whose extent no volume holds any more. Reconciliation has the target
/// release those trees before it forgets the record, so a new extent at
/// the same place never reads the old one's data.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StaleExports {
    pub target: String,
    pub exports: Vec<Export>,
}

impl crate::model::Stored for StaleExports {}

/// The subsystem through which `host_nqn` reaches its volumes on every
/// target: a prefix and the first 128 bits of SHA-256 of the host NQN, so
/// two hosts never share one (and a host cannot pick an NQN that lands in
/// another's subsystem).
pub fn host_subsystem_nqn(host_nqn: &str) -> String {
    let digest = Sha256::digest(host_nqn.as_bytes());
    let mut out = String::with_capacity(HOST_SUBSYSTEM_PREFIX.len() + 32);
    out.push_str(HOST_SUBSYSTEM_PREFIX);
    for b in &digest[..16] {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// A host NQN: `nqn.` then printable ASCII without spaces or `/`, at most
/// 223 bytes (it appears in store keys and URL paths).
pub fn validate_host_nqn(nqn: &str) -> Result<(), ModelError> {
    let ok = nqn.starts_with("nqn.")
        && nqn.len() > 4
        && nqn.len() <= NQN_BYTES_MAX
        && nqn.bytes().all(|b| b.is_ascii_graphic() && b != b'/');
    if ok {
        Ok(())
    } else {
        Err(ModelError::InvalidId {
            kind: "host NQN",
            value: nqn.to_owned(),
            max: NQN_BYTES_MAX,
        })
    }
}

/// The store keys of this module.
pub mod attach_keys {
    use crate::model::Uuid;

    pub const ATTACHMENTS: &str = "/attachments/";
    pub const HOSTS: &str = "/hosts/";
    pub const STALE_EXPORTS: &str = "/stale-exports/";
    pub const FAILED_COPIES: &str = "/failed-copies/";

    pub fn attachment(volume: &Uuid, host: &str) -> String {
        format!("{ATTACHMENTS}{volume}/{host}")
    }

    pub fn volume_attachments(volume: &Uuid) -> String {
        format!("{ATTACHMENTS}{volume}/")
    }

    pub fn host(host: &str) -> String {
        format!("{HOSTS}{host}")
    }

    pub fn stale_exports(target: &str) -> String {
        format!("{STALE_EXPORTS}{target}")
    }

    pub fn failed_copies(volume: &Uuid) -> String {
        format!("{FAILED_COPIES}{volume}")
    }
}

use attach_keys as ak;

/// What `begin_attach` decided.
#[derive(Debug, Clone)]
pub struct AttachStart {
    pub attachment: Attachment,
    pub volume: Volume,
    /// False when the attachment existed already (a retry, or new extents
    /// after a grow).
    pub created: bool,
}

/// Every namespace that should exist on one target, by subsystem.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DesiredExports {
    /// subsystem NQN → (host NQN, NSID → export).
    pub subsystems: BTreeMap<String, (String, BTreeMap<u32, Export>)>,
    /// (subsystem NQN, NSID) of the namespaces to write-protect: the
    /// extents of read-only volumes ([`crate::read_only`]).
    pub write_protected: BTreeSet<(String, u32)>,
}

impl Snapshot {
    /// Every extent of `host`'s attachments, as exports, keyed by target.
    pub(crate) fn host_exports(&self, host: &str) -> BTreeMap<String, Vec<Export>> {
        let mut out: BTreeMap<String, Vec<Export>> = BTreeMap::new();
        for ((uuid, h), a) in &self.attachments {
            if h != host {
                continue;
            }
            if let Some(v) = self.volumes.get(uuid) {
                for (target, x) in self.attachment_exports(&v.value, &a.value) {
                    out.entry(target).or_default().push(x);
                }
            }
        }
        out
    }

    /// The namespaces of one attachment, with their targets: each extent
    /// of the volume, and the new extent of every replace or move job
    /// under way that has an NSID for the host.
    pub(crate) fn attachment_exports(&self, v: &Volume, a: &Attachment) -> Vec<(String, Export)> {
        let host = a.host_nqn.as_str();
        let mut out: Vec<(String, Export)> = v
            .extents
            .iter()
            .zip(&a.nsids)
            .map(|(e, &nsid)| (e.target.clone(), export_of(host, e, nsid)))
            .collect();
        if let Some(cs) = self.copy_states.get(&v.uuid) {
            for j in &cs.value.jobs {
                if let (Some(d), Some(&nsid)) = (&j.dest, j.nsids.get(host)) {
                    out.push((d.target.clone(), export_of(host, d, nsid)));
                }
            }
        }
        out
    }

    /// The condition and op that add `exports` to `target`'s stale
    /// exports (their extents stay allocated until it is reconciled).
    pub(crate) fn add_stale_exports(&self, target: &str, exports: Vec<Export>) -> (Condition, Op) {
        let skey = ak::stale_exports(target);
        let read = self.stale_exports.get(target);
        let cond = unchanged(&skey, read.map(|r| r.version));
        let mut rec = read.map_or_else(
            || StaleExports {
                target: target.to_owned(),
                exports: Vec::new(),
            },
            |r| r.value.clone(),
        );
        rec.exports.extend(exports);
        rec.exports.sort();
        rec.exports.dedup();
        (cond, Op::Put(skey, encode(&rec)))
    }

    /// The entry that keeps `e`'s tree until its target releases it, if
    /// `e` is on a grain pool (a freed extent of a plain device needs
    /// nothing: a new volume's host reads only what it wrote).
    pub(crate) fn freed_tree(&self, e: &Extent) -> Option<Export> {
        let t = &self.targets.get(&e.target)?.value;
        t.device(&e.device)?.is_grain_pool().then(|| Export {
            subsystem_nqn: String::new(),
            host_nqn: String::new(),
            nsid: 0,
            device: e.device.clone(),
            offset: e.offset,
            length: e.length,
        })
    }

    /// The trees `target` must release before its stale exports are
    /// forgotten: by device, the roots of every stale entry on a grain
    /// pool whose extent no volume or copy job holds.
    pub(crate) fn trees_to_release(&self, target: &str) -> BTreeMap<String, Vec<u64>> {
        let mut out: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        let Some(t) = self.targets.get(target) else {
            return out;
        };
        for e in self.stale_extents().iter().filter(|e| e.target == target) {
            if t.value
                .device(&e.device)
                .is_some_and(crate::model::Device::is_grain_pool)
            {
                let roots = out.entry(e.device.clone()).or_default();
                roots.push(e.offset / nvpool_api::admin::THIN_ROOT_UNIT_BYTES);
            }
        }
        out
    }

    /// The attachments of one volume.
    pub fn attachments_of(&self, volume: &Uuid) -> Vec<&Versioned<Attachment>> {
        self.attachments
            .range((*volume, String::new())..)
            .take_while(|((u, _), _)| u == volume)
            .map(|(_, a)| a)
            .collect()
    }

    /// Extents kept allocated for stale exports (those not already part of
    /// a volume), deduplicated.
    pub(crate) fn stale_extents(&self) -> Vec<Extent> {
        let live: BTreeSet<(&str, &str, u64)> = self
            .volumes
            .values()
            .flat_map(|v| &v.value.extents)
            .chain(self.job_dests().map(|(_, d)| d))
            .chain(self.snapshot_trees())
            .map(|e| (e.target.as_str(), e.device.as_str(), e.offset))
            .collect();
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        for s in self.stale_exports.values() {
            for x in &s.value.exports {
                let k = (s.value.target.as_str(), x.device.as_str(), x.offset);
                if live.contains(&k) || !seen.insert(k) {
                    continue;
                }
                out.push(Extent {
                    target: s.value.target.clone(),
                    device: x.device.clone(),
                    offset: x.offset,
                    length: x.length,
                    member: 0,
                    row: 0,
                    copy: 0,
                });
            }
        }
        out
    }
}

pub(crate) fn export_of(host: &str, e: &Extent, nsid: u32) -> Export {
    Export {
        subsystem_nqn: host_subsystem_nqn(host),
        host_nqn: host.to_owned(),
        nsid,
        device: e.device.clone(),
        offset: e.offset,
        length: e.length,
    }
}

/// Lowest NSID from 1 not in `used`.
pub(crate) fn lowest_free(used: &BTreeSet<u32>) -> u32 {
    let mut n = 1;
    for &u in used {
        if u == n {
            n += 1;
        } else if u > n {
            break;
        }
    }
    n
}

impl Cluster {
    fn attachment_key_checks(volume: &Uuid, host: &str) -> Result<String, StateError> {
        validate_host_nqn(host)?;
        Ok(ak::attachment(volume, host))
    }

    /// Records (or extends) the attachment of `volume` to `host`: assigns
    /// an NSID to every extent that lacks one and marks the attachment
    /// `attaching` unless it is already `attached`. Targets are programmed
    /// after this returns; see `finish_attach` and `abort_attach`.
    pub fn begin_attach(&self, volume: &Uuid, host: &str) -> Result<AttachStart, StateError> {
        let key = Self::attachment_key_checks(volume, host)?;
        self.transact(|s| {
            let v = s
                .volumes
                .get(volume)
                .ok_or_else(|| StateError::VolumeNotFound(volume.to_string()))?;
            let deleting = keys::deleting(volume);
            if self.store().get(&deleting)?.is_some() {
                return Err(StateError::Deleting(*volume));
            }
            // A rollback in progress, or one that failed part way: its
            // copies may differ until a repeat finishes it.
            let rolling = crate::rollback::rollback_key(volume);
            if self.store().get(&rolling)?.is_some() {
                return Err(StateError::Conflict {
                    kind: "rollback_in_progress",
                    message: format!(
                        "volume {volume} is being rolled back (or a rollback failed part                          way: repeat it); attach once it is over"
                    ),
                });
            }
            let existing = s.attachments.get(&(*volume, host.to_owned()));
            let mut a = existing.map_or_else(
                || Attachment {
                    volume: *volume,
                    host_nqn: host.to_owned(),
                    state: AttachmentState::Attaching,
                    created_ms: self.now(),
                    nsids: Vec::new(),
                    failed_extents: Vec::new(),
                },
                |e| e.value.clone(),
            );
            if a.state == AttachmentState::Detaching {
                a.state = AttachmentState::Attaching;
            }
            // Copies another attachment (or an earlier one) found stale.
            if let Some(f) = s.failed_copies.get(volume) {
                let all: BTreeSet<u32> = a
                    .failed_extents
                    .iter()
                    .chain(&f.value.extents)
                    .copied()
                    .collect();
                a.failed_extents = all.into_iter().collect();
            }
            // NSIDs this host already uses, per target.
            let mut used: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
            for (t, exports) in s.host_exports(host) {
                used.entry(t)
                    .or_default()
                    .extend(exports.iter().map(|x| x.nsid));
            }
            for e in &v.value.extents[a.nsids.len().min(v.value.extents.len())..] {
                let set = used.entry(e.target.clone()).or_default();
                if set.len() >= NAMESPACES_PER_HOST_TARGET_MAX {
                    return Err(StateError::TooMany {
                        what: "namespaces of one host on one target",
                        max: NAMESPACES_PER_HOST_TARGET_MAX,
                    });
                }
                let n = lowest_free(set);
                set.insert(n);
                a.nsids.push(n);
            }
            // New extents of replace and move jobs under way: this host
            // writes them too.
            let mut cs = s.copy_state(volume);
            let cs_before = cs.clone();
            for j in cs.jobs.iter_mut() {
                if let (Some(d), false) = (&j.dest, j.nsids.contains_key(host)) {
                    let set = used.entry(d.target.clone()).or_default();
                    let n = lowest_free(set);
                    set.insert(n);
                    j.nsids.insert(host.to_owned(), n);
                }
            }
            let host_key = ak::host(host);
            let host_rec = s.hosts.get(host);
            let next = HostRecord {
                host_nqn: host.to_owned(),
                changes: host_rec.map_or(1, |h| h.value.changes + 1),
            };
            let vkey = keys::volume(volume);
            let mut conds = vec![
                Condition::VersionIs(vkey.clone(), v.version),
                Condition::Missing(deleting),
                Condition::Missing(rolling),
                unchanged(&key, existing.map(|e| e.version)),
                unchanged(&host_key, host_rec.map(|h| h.version)),
            ];
            let mut ops = vec![
                Op::Put(vkey, encode(&v.value)),
                Op::Put(key.clone(), encode(&a)),
                Op::Put(host_key, encode(&next)),
            ];
            if cs != cs_before {
                let (c, o) = s.copy_state_txn(&cs);
                conds.push(c);
                ops.push(o);
            }
            Ok(Txn::Commit(
                conds,
                ops,
                AttachStart {
                    attachment: a,
                    volume: v.value.clone(),
                    created: existing.is_none(),
                },
            ))
        })
    }

    /// Marks an attachment `attached` once every target exports it.
    pub fn finish_attach(&self, volume: &Uuid, host: &str) -> Result<Attachment, StateError> {
        self.update_attachment(volume, host, |a| a.state = AttachmentState::Attached)
    }

    /// Records the extents `host` found failed (copies that missed writes).
    /// Failures only accumulate: an extent once failed stays failed for
    /// this attachment until it is rebuilt, so a host that restarts never
    /// reads a stale copy. Returns the attachment.
    pub fn report_failed_extents(
        &self,
        volume: &Uuid,
        host: &str,
        failed: &[u32],
    ) -> Result<Attachment, StateError> {
        let s = self.snapshot()?;
        let count = s
            .volumes
            .get(volume)
            .ok_or_else(|| StateError::VolumeNotFound(volume.to_string()))?
            .value
            .extents
            .len();
        if let Some(&bad) = failed.iter().find(|&&i| i as usize >= count) {
            return Err(ModelError::Invalid(format!(
                "extent {bad} does not exist; the volume has {count}"
            ))
            .into());
        }
        let key = Self::attachment_key_checks(volume, host)?;
        self.transact(|s| {
            let a = s
                .attachments
                .get(&(*volume, host.to_owned()))
                .ok_or_else(|| StateError::NotAttached {
                    volume: *volume,
                    host: host.to_owned(),
                })?;
            let union = |known: &[u32]| -> Vec<u32> {
                let all: BTreeSet<u32> = known.iter().chain(failed).copied().collect();
                all.into_iter().collect()
            };
            let mut next = a.value.clone();
            next.failed_extents = union(&next.failed_extents);
            let fkey = ak::failed_copies(volume);
            let f = s.failed_copies.get(volume);
            let fcond = unchanged(&fkey, f.map(|f| f.version));
            let known = f.map_or(&[][..], |f| f.value.extents.as_slice());
            let record = FailedCopies {
                volume: *volume,
                extents: union(known),
            };
            let mut conds = vec![Condition::VersionIs(key.clone(), a.version), fcond];
            let mut ops = vec![
                Op::Put(key.clone(), encode(&next)),
                Op::Put(fkey, encode(&record)),
            ];
            if let Some((c, o)) = Cluster::on_copies_failed(s, volume, failed, self.now()) {
                conds.push(c);
                ops.push(o);
            }
            Ok(Txn::Commit(conds, ops, next))
        })
    }

    /// Undoes `begin_attach` after a target refused: forgets a new
    /// attachment; an older one keeps its state and its NSIDs (the
    /// namespaces not yet exported are exported by the next attach).
    pub fn abort_attach(&self, volume: &Uuid, host: &str, created: bool) -> Result<(), StateError> {
        if !created {
            return Ok(());
        }
        let key = Self::attachment_key_checks(volume, host)?;
        self.delete_if_present(&key)
    }

    /// Marks an attachment `detaching` and returns it with its volume and
    /// the exports to remove, by target.
    pub fn begin_detach(
        &self,
        volume: &Uuid,
        host: &str,
    ) -> Result<(Attachment, BTreeMap<String, Vec<Export>>), StateError> {
        let a = self.update_attachment(volume, host, |a| a.state = AttachmentState::Detaching)?;
        let s = self.snapshot()?;
        let v = s
            .volumes
            .get(volume)
            .ok_or_else(|| StateError::VolumeNotFound(volume.to_string()))?;
        let mut by_target: BTreeMap<String, Vec<Export>> = BTreeMap::new();
        for (t, x) in s.attachment_exports(&v.value, &a) {
            by_target.entry(t).or_default().push(x);
        }
        Ok((a, by_target))
    }

    /// Forgets a detached attachment. `stale` lists namespaces that could
    /// not be removed (a forced detach): they are kept allocated until
    /// their target is reconciled.
    pub fn finish_detach(
        &self,
        volume: &Uuid,
        host: &str,
        stale: &BTreeMap<String, Vec<Export>>,
    ) -> Result<(), StateError> {
        let key = Self::attachment_key_checks(volume, host)?;
        self.transact_allocation(|s| {
            let Some(a) = s.attachments.get(&(*volume, host.to_owned())) else {
                return Ok(Txn::Done(()));
            };
            let host_key = ak::host(host);
            let mut conds = vec![Condition::VersionIs(key.clone(), a.version)];
            let mut ops = vec![Op::Delete(key.clone())];
            if let Some(h) = s.hosts.get(host) {
                conds.push(Condition::VersionIs(host_key.clone(), h.version));
                let next = HostRecord {
                    host_nqn: host.to_owned(),
                    changes: h.value.changes + 1,
                };
                ops.push(Op::Put(host_key, encode(&next)));
            }
            if let Some((c, o)) = Cluster::on_detached(s, volume, host) {
                conds.push(c);
                ops.push(o);
            }
            for (target, exports) in stale.iter().filter(|(_, x)| !x.is_empty()) {
                let (c, o) = s.add_stale_exports(target, exports.clone());
                conds.push(c);
                ops.push(o);
            }
            Ok(Txn::Commit(conds, ops, ()))
        })
    }

    /// The namespaces `target` should export now: every extent on it of
    /// every `attaching` or `attached` attachment.
    pub fn desired_exports(&self, target: &str) -> Result<DesiredExports, StateError> {
        let s = self.snapshot()?;
        let read_only = self.read_only_volumes()?;
        let mut out = DesiredExports::default();
        for ((uuid, host), a) in &s.attachments {
            if a.value.state == AttachmentState::Detaching {
                continue;
            }
            let Some(v) = s.volumes.get(uuid) else {
                continue;
            };
            for (t, x) in s.attachment_exports(&v.value, &a.value) {
                if t != target {
                    continue;
                }
                let nsid = x.nsid;
                if read_only.contains(uuid) {
                    out.write_protected.insert((x.subsystem_nqn.clone(), nsid));
                }
                out.subsystems
                    .entry(x.subsystem_nqn.clone())
                    .or_insert_with(|| (host.clone(), BTreeMap::new()))
                    .1
                    .insert(nsid, x);
            }
        }
        // Running copy jobs read their sources through these.
        for x in s.copier_exports(target) {
            out.subsystems
                .entry(x.subsystem_nqn.clone())
                .or_insert_with(|| (x.host_nqn.clone(), BTreeMap::new()))
                .1
                .insert(x.nsid, x);
        }
        Ok(out)
    }

    /// Stale exports recorded for `target`, with the record's version.
    pub fn stale_exports(&self, target: &str) -> Result<Option<(StaleExports, u64)>, StateError> {
        crate::model::validate_id("target id", target, ID_BYTES_MAX)?;
        let read = self.read("stale exports", &ak::stale_exports(target))?;
        Ok(read.map(|r| (r.value, r.version)))
    }

    /// Forgets the stale exports of a reconciled target (if the record is
    /// still the version that was reconciled), freeing their extents.
    pub fn clear_stale_exports(&self, target: &str, version: u64) -> Result<(), StateError> {
        let key = ak::stale_exports(target);
        self.transact_allocation(|s| match s.stale_exports.get(target) {
            Some(r) if r.version == version => Ok(Txn::Commit(
                vec![Condition::VersionIs(key.clone(), version)],
                vec![Op::Delete(key.clone())],
                (),
            )),
            _ => Ok(Txn::Done(())),
        })
    }

    /// Every attachment.
    pub fn attachments(&self) -> Result<Vec<Attachment>, StateError> {
        let s = self.snapshot()?;
        Ok(s.attachments.into_values().map(|a| a.value).collect())
    }

    /// The attachments of one volume.
    pub fn volume_attachments(&self, volume: &Uuid) -> Result<Vec<Attachment>, StateError> {
        let s = self.snapshot()?;
        if !s.volumes.contains_key(volume) {
            return Err(StateError::VolumeNotFound(volume.to_string()));
        }
        Ok(s.attachments_of(volume)
            .into_iter()
            .map(|a| a.value.clone())
            .collect())
    }

    /// One attachment.
    pub fn attachment(&self, volume: &Uuid, host: &str) -> Result<Attachment, StateError> {
        let s = self.snapshot()?;
        s.attachments
            .get(&(*volume, host.to_owned()))
            .map(|a| a.value.clone())
            .ok_or_else(|| StateError::NotAttached {
                volume: *volume,
                host: host.to_owned(),
            })
    }

    /// The connection plan of an attachment: where each extent is exported.
    pub fn plan(&self, volume: &Volume, a: &Attachment) -> Result<ConnectionPlan, StateError> {
        let s = self.snapshot()?;
        let mut extents = Vec::with_capacity(volume.extents.len());
        for (e, &nsid) in volume.extents.iter().zip(&a.nsids) {
            let t = s
                .targets
                .get(&e.target)
                .ok_or_else(|| StateError::TargetNotFound(e.target.clone()))?;
            extents.push(PlanExtent {
                target: e.target.clone(),
                addr: t.value.addr,
                rdma_addr: t.value.rdma_addr,
                subsystem_nqn: host_subsystem_nqn(&a.host_nqn),
                nsid,
                device: e.device.clone(),
                offset: e.offset,
                length: e.length,
                member: e.member,
                row: e.row,
                copy: e.copy,
            });
        }
        if extents.len() != volume.extents.len() {
            return Err(StateError::Inconsistent(format!(
                "attachment of volume {} to {} lists {} NSIDs for {} extents",
                volume.uuid,
                a.host_nqn,
                a.nsids.len(),
                volume.extents.len()
            )));
        }
        Ok(ConnectionPlan {
            volume: volume.uuid,
            name: volume.name.clone(),
            host_nqn: a.host_nqn.clone(),
            size_bytes: volume.size_bytes,
            block_bytes: VOLUME_BLOCK_BYTES,
            extent_bytes: volume.extent_bytes,
            layout: volume.layout.into(),
            extents,
        })
    }

    fn update_attachment(
        &self,
        volume: &Uuid,
        host: &str,
        change: impl Fn(&mut Attachment),
    ) -> Result<Attachment, StateError> {
        let key = Self::attachment_key_checks(volume, host)?;
        self.update("attachment", &key, |a: Option<Attachment>| {
            let mut a = a.ok_or_else(|| StateError::NotAttached {
                volume: *volume,
                host: host.to_owned(),
            })?;
            change(&mut a);
            Ok((Some(a.clone()), a))
        })
    }
}

/// Device references of a list of exports (for messages).
pub fn export_devices(target: &str, exports: &[Export]) -> Vec<DeviceRef> {
    exports
        .iter()
        .map(|x| DeviceRef::new(target, &x.device))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_subsystems_are_distinct_and_valid_nqns() {
        let a = host_subsystem_nqn("nqn.2014-08.org.nvmexpress:uuid:1");
        let b = host_subsystem_nqn("nqn.2014-08.org.nvmexpress:uuid:2");
        assert_ne!(a, b);
        assert!(a.starts_with(HOST_SUBSYSTEM_PREFIX));
        assert_eq!(a.len(), HOST_SUBSYSTEM_PREFIX.len() + 32);
        assert_eq!(a, host_subsystem_nqn("nqn.2014-08.org.nvmexpress:uuid:1"));
    }

    #[test]
    fn plans_carry_each_targets_rdma_listener() {
        use crate::model::{Layout, VolumeSpec};
        use crate::moves::tests::{cluster, register, register_rdma};
        let e = crate::limits::EXTENT_BYTES_MIN;
        let (c, _) = cluster(e);
        let rdma: std::net::SocketAddr = "[fd00::1]:4420".parse().unwrap();
        register(&c, 0, 4 * e);
        register_rdma(&c, 1, 4 * e, Some(rdma));
        let uuid = Uuid([7; 16]);
        c.create_volume(&VolumeSpec {
            uuid,
            name: "v".into(),
            size_bytes: e,
            layout: Layout::Raid1 { copies: 2 },
            pool: None,
        })
        .unwrap();
        let host = "nqn.2014-08.org.nvmexpress:uuid:host-1";
        let start = c.begin_attach(&uuid, host).unwrap();
        let plan = c.plan(&start.volume, &start.attachment).unwrap();
        plan.validate().unwrap();
        let by_target = |t: &str| plan.extents.iter().find(|x| x.target == t).unwrap();
        assert_eq!(by_target("t0").rdma_addr, None);
        assert_eq!(by_target("t1").rdma_addr, Some(rdma));
        assert_eq!(by_target("t1").addr, "127.0.0.1:4421".parse().unwrap());

        // JSON: the field only when there is one; plans without it (from
        // older control planes) still parse.
        let json = serde_json::to_value(&plan).unwrap();
        for x in json["extents"].as_array().unwrap() {
            match x["target"].as_str().unwrap() {
                "t0" => assert!(x.get("rdma_addr").is_none(), "{x}"),
                _ => assert_eq!(x["rdma_addr"], "[fd00::1]:4420"),
            }
        }
        let back: ConnectionPlan = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back, plan);
        let mut old = json.clone();
        for x in old["extents"].as_array_mut().unwrap() {
            x.as_object_mut().unwrap().remove("rdma_addr");
        }
        let old: ConnectionPlan = serde_json::from_value(old).unwrap();
        assert!(old.extents.iter().all(|x| x.rdma_addr.is_none()));
        old.validate().unwrap();

        // A plan naming a wildcard RDMA address is refused by hosts.
        let mut bad = plan.clone();
        bad.extents[0].rdma_addr = Some("0.0.0.0:4420".parse().unwrap());
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.contains("rdma_addr"), "{err}");
    }

    #[test]
    fn host_nqns_are_checked() {
        assert!(validate_host_nqn("nqn.2014-08.org.nvmexpress:uuid:x").is_ok());
        for bad in [
            "",
            "nqn.",
            "host1",
            "nqn.a/b",
            "nqn.a b",
            &"nqn.x".repeat(60),
        ] {
            assert!(validate_host_nqn(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn lowest_free_fills_gaps() {
        let set = |v: &[u32]| v.iter().copied().collect::<BTreeSet<u32>>();
        assert_eq!(lowest_free(&set(&[])), 1);
        assert_eq!(lowest_free(&set(&[1, 2, 3])), 4);
        assert_eq!(lowest_free(&set(&[1, 3])), 2);
        assert_eq!(lowest_free(&set(&[2, 3])), 1);
    }
}
