//! Bodies of a target's admin API (`nvpool-target --admin-listen`),
//! declared once: the control plane sends the requests (`program.rs`) and
//! the target reads them (its `api.rs`) and answers with the replies here.
//! Plain data, checked by the target, which keeps [`DhchapKeys`] as they
//! came, in its config and state files too.
//!
//! Keys absent from a body take the target's defaults, so the fields a
//! caller leaves empty are left out of the JSON rather than sent as
//! `null` or `[]`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// One host's DH-HMAC-CHAP keys as a target is given them (`PUT
/// …/hosts/{host}`, a subsystem's `host_keys`, an owner's `owner_keys`, a
/// copy's `source.dhchap`) and keeps them (its config and state files).
/// `key_id` is checked where the keys are parsed (the target's
/// `config::policy`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DhchapKeys {
    /// The host's secret (`nvme connect --dhchap-secret`).
    pub dhchap_key: SecretText,
    /// The controller's secret, for bidirectional authentication
    /// (`--dhchap-ctrl-secret`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_ctrl_key: Option<SecretText>,
    /// `sha256`, `sha384` or `sha512`; default: the strongest the host offers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_hash: Option<String>,
    /// `null` (the default, as nvmet) or `ffdhe2048` … `ffdhe8192`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap_dhgroup: Option<String>,
    /// A label for this version of the keys, not secret: the target shows
    /// it back, so whoever set the keys can tell whether it holds the
    /// current ones without reading secrets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
}

/// A secret's `DHHC-1:XX:…:` text. Parsed only where it is used, so that
/// a parse error never quotes the line holding it; hidden from `Debug`
/// and wiped when dropped.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SecretText(String);

impl SecretText {
    pub fn new(text: String) -> SecretText {
        SecretText(text)
    }

    /// The text itself: only for parsing it or sending it on.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for SecretText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl Drop for SecretText {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.0);
    }
}

/// `PUT /v1/subsystems/{nqn}` as the control plane creates a host's
/// subsystem: who may connect, and with which keys.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubsystemAccess {
    pub allowed_hosts: Vec<String>,
    pub allow_any_host: bool,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub host_keys: BTreeMap<String, DhchapKeys>,
}

/// `PUT /v1/subsystems/{nqn}/ana`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AnaStateBody {
    /// `optimized`, `non-optimized`, `inaccessible`, `persistent-loss` or
    /// `change`.
    pub state: String,
    /// The DH-HMAC-CHAP keys of the target's owner host NQN, for the
    /// volume engine a serving state opens (C19); write-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_keys: Option<DhchapKeys>,
}

/// `PUT /v1/subsystems/{nqn}/namespaces/{nsid}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceBody {
    /// `file:PATH[,offset=…][,length=…][,block_size=…]` or `ram:SIZE`.
    pub backend: String,
    /// The namespace's UUID; the target derives one when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
}

/// `POST /v1/copies/{id}/start`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartCopyBody {
    /// Region indexes to copy; null (or absent) = every region.
    #[serde(default)]
    pub regions: Option<Vec<u32>>,
}

/// Where a copy job reads from: a namespace of another target that exports
/// the healthy copy of the extent to the destination target's copier host
/// NQN.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CopySource {
    /// NVMe/TCP listener, `ADDR:PORT`.
    pub addr: String,
    pub subsystem_nqn: String,
    pub nsid: u32,
    /// The host NQN the copier connects as.
    pub host_nqn: String,
    /// DH-HMAC-CHAP keys the copier authenticates with as `host_nqn` (the
    /// control plane draws them and the source target requires them);
    /// write-only, never shown or logged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dhchap: Option<DhchapKeys>,
}

/// `PUT /v1/copies/{id}`: arms a copy job on the destination's target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CopyRequest {
    /// The destination: a `file:PATH,offset=O,length=L` extent, or a
    /// grain pool's tree `thin:PATH,root=N,size=BYTES` (design
    /// thin-snapshots.md T7). Into a tree the copier writes only the 4 KiB
    /// sectors that differ from what the tree holds, and deallocates those
    /// the source reads as zeroes, so holes stay holes and grains the tree
    /// shares stay shared where the data is the same.
    pub dest: String,
    pub source: CopySource,
    /// Size of the regions `start` selects by index.
    pub region_bytes: u64,
    /// Throttle; 0 = unthrottled.
    #[serde(default)]
    pub rate_bytes_per_sec: u64,
    /// Only with a `thin:` destination: a tree of the same pool the
    /// destination starts as, sharing all of it, before anything is
    /// copied (how a snapshot family is rebuilt on another device: each
    /// tree starts as the one copied before it). Arming refuses
    /// (409) a destination tree that already holds data, since hosts may
    /// have written it; again with the same request once armed it is the
    /// same job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_root: Option<u64>,
}

/// Where a copy job stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CopyState {
    Armed,
    /// Started: copying, or waiting for a copier slot (`bytes_copied` 0).
    Running,
    Done,
    Failed,
    Cancelled,
}

impl CopyState {
    pub fn name(self) -> &'static str {
        match self {
            CopyState::Armed => "armed",
            CopyState::Running => "running",
            CopyState::Done => "done",
            CopyState::Failed => "failed",
            CopyState::Cancelled => "cancelled",
        }
    }
}

/// What `GET /v1/copies/{id}` answers. Before start, `bytes_total` and
/// `regions_total` describe the whole extent; from start on, the selection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyStatus {
    pub id: String,
    pub state: CopyState,
    pub dest: String,
    pub bytes_total: u64,
    /// Bytes of the selection done: read from the source and written to
    /// the destination, except the parts hosts wrote since arming (skipped).
    pub bytes_copied: u64,
    pub regions_total: u64,
    pub regions_done: u64,
    /// Wall-clock milliseconds since the Unix epoch.
    pub armed_ms: u64,
    pub started_ms: Option<u64>,
    pub finished_ms: Option<u64>,
    pub error: Option<String>,
    pub rate_bytes_per_sec: u64,
}

/// What `GET /v1/identity` answers: who the target is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// The target's persistent random identity, a UUID.
    pub identity: String,
    /// The ID the control plane knows the target by; null until it
    /// registers. The control plane checks it before changing anything.
    pub target_id: Option<String>,
}

/// Extents on a grain pool are trees named by where the control plane
/// placed them in the pool's virtual space, in units of the smallest
/// extent: the tree of the extent at `offset` is `offset / THIN_ROOT_UNIT_BYTES`.
pub const THIN_ROOT_UNIT_BYTES: u64 = 1 << 20;

/// Whether a device's backend spec names a grain pool (`thin:PATH[,…]`).
pub fn is_grain_pool(device_backend: &str) -> bool {
    device_backend.starts_with("thin:")
}

/// The backend spec of the namespace that exports the extent
/// `offset..offset + length` of a device: a tree of a grain pool
/// (`thin:PATH,root=R,size=L`), or a byte range of a plain device
/// (`SPEC,offset=O,length=L`). The one place either form is written.
pub fn extent_spec(device_backend: &str, offset: u64, length: u64) -> String {
    match device_backend.strip_prefix("thin:") {
        Some(rest) => {
            let path = rest.split(',').next().unwrap_or(rest);
            let root = offset / THIN_ROOT_UNIT_BYTES;
            format!("thin:{path},root={root},size={length}")
        }
        None => format!("{device_backend},offset={offset},length={length}"),
    }
}

/// `POST /v1/devices/{id}/release`: trees of a grain pool whose extents
/// the control plane freed. Their grains go back to the pool; a tree a
/// namespace still exports is refused (409), an unknown one is already
/// released.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRootsBody {
    pub roots: Vec<u64>,
}

/// `POST /v1/devices/{id}/snapshots`: new trees of a grain pool, each
/// sharing everything with an existing one (design/thin-snapshots.md T5).
///
/// With `epoch` 0 the new trees are complete at once (a clone, or a
/// snapshot of a volume no engine writes). With `epoch` E > 0 each new tree
/// is *sealing*: until `POST …/seal` names it, a write to its live tree
/// tagged 1..=E (in CDW2: `nvpool_wire::sqe::Sqe::write_epoch`) lands in both
/// trees, and one tagged above E in the live tree only. A tree named again
/// while it still seals is accepted (a retry); a new tree id that already
/// exists otherwise is refused (409 `tree_exists`), since writes it should
/// have taken may have gone past it (a restarted target, say). An unknown
/// live tree is 404 `unknown_tree` with `epoch` 0 (a clone's source must
/// exist); with `epoch` > 0 it is created empty first (an extent no
/// namespace has exported yet holds nothing). The new trees are committed before the
/// answer (200 [`SnapshotTreesBody`] echoing the request).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotTreesBody {
    pub epoch: u32,
    pub trees: Vec<SnapshotTree>,
}

/// One new tree: `snapshot` (a root id the control plane chose, never in
/// use) shares everything with `live`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotTree {
    pub live: u64,
    pub snapshot: u64,
}

/// `POST /v1/devices/{id}/seal`: the sealing trees are complete. From now
/// on a write to their live trees tagged at or below their epoch is refused
/// (Reservation Conflict: only a fenced writer can send one). A tree this
/// target does not hold as sealing (a restart lost it) is 409
/// `not_sealing` and the control plane gives the snapshot up; a tree
/// already sealed is accepted (a retry). The pool is committed before the
/// answer (200 [`SealBody`] echoing the request).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SealBody {
    pub snapshots: Vec<u64>,
}

/// `POST /v1/devices/{id}/rollback`: each `live` tree takes the contents
/// of its `snapshot` tree (design/thin-snapshots.md T6): the live tree's
/// own grains are dropped and it shares everything with the snapshot,
/// which is unchanged. The control plane does this only while nothing
/// writes the volume (it is detached). An unknown `snapshot` is 404
/// `unknown_tree`; a live tree with a sealing snapshot is 409 `sealing`
/// (a snapshot of it is being taken); an unknown live tree is created. The
/// pool is committed before the answer (200 [`RollbackBody`] echoing the
/// request); the same request again changes nothing more.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RollbackBody {
    pub trees: Vec<SnapshotTree>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_extent_is_a_tree_of_a_grain_pool_or_a_range_of_a_plain_device() {
        assert_eq!(
            extent_spec("thin:/dev/nvme0n1,grain=64K", 3 << 30, 1 << 30),
            "thin:/dev/nvme0n1,root=3072,size=1073741824"
        );
        assert_eq!(
            extent_spec("file:/d", 4096, 8192),
            "file:/d,offset=4096,length=8192"
        );
        assert!(is_grain_pool("thin:/x") && !is_grain_pool("file:/thin:x"));
    }

    #[test]
    fn bodies_are_the_json_targets_have_always_been_sent() {
        let keys = DhchapKeys {
            dhchap_key: SecretText::new("DHHC-1:00:k:".into()),
            dhchap_ctrl_key: None,
            dhchap_hash: Some("sha256".into()),
            dhchap_dhgroup: None,
            key_id: Some("v1".into()),
        };
        let v = serde_json::to_value(&keys).unwrap();
        assert_eq!(
            v,
            json!({"dhchap_key": "DHHC-1:00:k:", "dhchap_hash": "sha256", "key_id": "v1"})
        );
        assert!(!format!("{keys:?}").contains("DHHC"));
        let access = SubsystemAccess {
            allowed_hosts: vec!["h".into()],
            allow_any_host: false,
            host_keys: BTreeMap::new(),
        };
        assert_eq!(
            serde_json::to_value(&access).unwrap(),
            json!({"allowed_hosts": ["h"], "allow_any_host": false})
        );
        let ana = AnaStateBody {
            state: "optimized".into(),
            owner_keys: None,
        };
        assert_eq!(
            serde_json::to_value(&ana).unwrap(),
            json!({"state": "optimized"})
        );
        let ns = NamespaceBody {
            backend: "ram:1M".into(),
            uuid: None,
            read_only: false,
        };
        assert_eq!(
            serde_json::to_value(&ns).unwrap(),
            json!({"backend": "ram:1M"})
        );
        let start = StartCopyBody { regions: None };
        assert_eq!(
            serde_json::to_value(&start).unwrap(),
            json!({"regions": null})
        );
        let copy = CopyRequest {
            dest: "file:/d,offset=0,length=4096".into(),
            source: CopySource {
                addr: "10.0.0.1:4420".into(),
                subsystem_nqn: "nqn.s".into(),
                nsid: 3,
                host_nqn: "nqn.h".into(),
                dhchap: Some(keys.clone()),
            },
            region_bytes: 1 << 20,
            rate_bytes_per_sec: 0,
            base_root: None,
        };
        assert_eq!(
            serde_json::to_value(&copy).unwrap(),
            json!({
                "dest": "file:/d,offset=0,length=4096",
                "source": {
                    "addr": "10.0.0.1:4420",
                    "subsystem_nqn": "nqn.s",
                    "nsid": 3,
                    "host_nqn": "nqn.h",
                    "dhchap": {
                        "dhchap_key": "DHHC-1:00:k:",
                        "dhchap_hash": "sha256",
                        "key_id": "v1",
                    },
                },
                "region_bytes": 1048576,
                "rate_bytes_per_sec": 0,
            })
        );
    }
}
