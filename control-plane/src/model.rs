//! The control plane's objects — targets and their devices, pools, volumes
//! and their extents — with their validation and their stored encoding.
//!
//! Stored values are `[FORMAT, postcard bytes…]`. postcard is compact (a
//! volume of 8192 extents fits one etcd value) but not self-describing: a
//! struct cannot gain a field in place. So any change to a stored type bumps
//! [`FORMAT`] and `decode` keeps a path for every older format it still
//! reads. The same types derive JSON-friendly serde (snake_case enums, UUIDs
//! as strings) for the REST API.
//!
//! Every stored type implements [`Stored`] (`encode` and `decode` accept
//! nothing else), whose `decode_older` reads the formats before the current
//! one. Its default says "this layout has not changed since format
//! [`FORMAT_MIN`]"; a type whose layout changed overrides it with the old
//! layout and a conversion:
//!
//! | format | change |
//! |---|---|
//! | 1 | first |
//! | 2 | [`Target`] gains `rdma_addr` (read from format 1 as `None`) |
//! | 3 | [`Target`] gains `admin_tls` (read from formats 1 and 2 as `false`) |
//! | 4 | `WriteEpoch` gains its hold, `Confirmed` `held`, `SnapshotRecord` its `group` (`snapshots`; read from format 3 as none) |
//! | 5 | `CopyJob` gains its snapshot `family` (`resync`, `families`; read from format 4 as none) |
//!
//! Values are always written in the current format, so once a build writes
//! format 5 an older build can no longer read what it wrote: upgrade, do
//! not downgrade.

use crate::limits::{
    BACKEND_SPEC_BYTES_MAX, DEVICES_PER_TARGET_MAX, DEVICE_BYTES_MAX, GRAIN_POOL_VIRTUAL_BYTES,
    ID_BYTES_MAX, LABELS_MAX, LABEL_BYTES_MAX, NAME_BYTES_MAX,
};
use crate::mapping::Geometry;
use nvpool_layout::model::LayoutError;
// A volume's identity and layout, and their checks, are shared with hosts
// (`nvpool-layout`); re-exported so the control plane names them here.
pub use nvpool_layout::model::{
    validate_connect_addr, validate_extent_bytes, validate_size, Layout, Uuid,
};
// The states the REST API reports travel between processes; they live in
// `nvpool-api` and are stored as they are.
use nvpool_api::rest::{DeviceRefBody, ExtentOut, Provisioning};
pub use nvpool_api::rest::{Health, TargetState, VolumeStatus};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::SocketAddr;

/// Format byte in front of every value written (see the table above).
pub const FORMAT: u8 = 5;
/// The oldest format `decode` still reads.
pub const FORMAT_MIN: u8 = 1;

/// Why an object is invalid or does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    #[error("{kind} {value:?} is not a valid identifier (1..={max} bytes of A-Z a-z 0-9 . _ : -)")]
    InvalidId {
        kind: &'static str,
        value: String,
        max: usize,
    },
    #[error("invalid layout: {0}")]
    InvalidLayout(String),
    #[error("invalid size: {0}")]
    InvalidSize(String),
    #[error("{0}")]
    Invalid(String),
    /// A volume's extents do not match its geometry: a corrupt record or a bug.
    #[error("volume {uuid} is inconsistent: {reason}")]
    Inconsistent { uuid: Uuid, reason: String },
    #[error("cannot decode {what}: {message}")]
    Decode { what: &'static str, message: String },
    #[error(
        "{what} is stored in format {found}; this build reads formats {FORMAT_MIN} to {FORMAT}"
    )]
    UnknownFormat { what: &'static str, found: u8 },
}

/// `nvpool-layout`'s checks (layouts, sizes, UUIDs, plans) fail with the
/// variant of the same name and text.
impl From<LayoutError> for ModelError {
    fn from(e: LayoutError) -> ModelError {
        match e {
            LayoutError::InvalidId { kind, value, max } => {
                ModelError::InvalidId { kind, value, max }
            }
            LayoutError::InvalidLayout(m) => ModelError::InvalidLayout(m),
            LayoutError::InvalidSize(m) => ModelError::InvalidSize(m),
            LayoutError::Invalid(m) => ModelError::Invalid(m),
        }
    }
}

/// A type kept in the store, `[format, postcard…]`.
///
/// Implementing it is a promise about formats: the current layout is the
/// one `FORMAT` writes, and `decode_older` reads every format from
/// [`FORMAT_MIN`] up to (not including) [`FORMAT`].
pub trait Stored: Serialize + DeserializeOwned {
    /// Decodes the postcard body of a value written in `format`
    /// (`FORMAT_MIN <= format < FORMAT`), returning the bytes after it.
    /// The default is for layouts unchanged since format 1: the body of
    /// every older format reads as the current layout.
    fn decode_older(format: u8, body: &[u8]) -> postcard::Result<(Self, &[u8])> {
        debug_assert!((FORMAT_MIN..FORMAT).contains(&format));
        postcard::take_from_bytes(body)
    }
}

/// The allocation epoch.
impl Stored for u64 {}
impl Stored for String {}
/// Volume-name index entries.
impl Stored for Uuid {}
impl Stored for Pool {}
impl Stored for Volume {}

impl Stored for Target {
    fn decode_older(format: u8, body: &[u8]) -> postcard::Result<(Target, &[u8])> {
        match format {
            1 => {
                let (old, rest) = postcard::take_from_bytes::<TargetV1>(body)?;
                Ok((old.into(), rest))
            }
            2 => {
                let (old, rest) = postcard::take_from_bytes::<TargetV2>(body)?;
                Ok((old.into(), rest))
            }
            // Unchanged since format 3.
            3 | 4 => postcard::take_from_bytes(body),
            // `decode` passes only formats below FORMAT; a later change to
            // Target adds a frozen `TargetV3` arm above.
            _ => Err(postcard::Error::DeserializeBadEncoding),
        }
    }
}

/// Encodes a value for the store, in the current format.
pub fn encode<T: Stored>(value: &T) -> Vec<u8> {
    let mut out = vec![FORMAT];
    // postcard fails only for types it cannot represent (maps with
    // non-serialisable keys, `deserialize_any`); ours are plain structs.
    out.extend(postcard::to_allocvec(value).expect("model types encode with postcard"));
    out
}

/// Decodes a stored value of any format this build reads; `what` names it
/// in errors ("volume", "target").
pub fn decode<T: Stored>(what: &'static str, bytes: &[u8]) -> Result<T, ModelError> {
    let (&format, body) = bytes.split_first().ok_or_else(|| ModelError::Decode {
        what,
        message: "empty value".into(),
    })?;
    let decoded = match format {
        FORMAT => postcard::take_from_bytes(body),
        f if (FORMAT_MIN..FORMAT).contains(&f) => T::decode_older(f, body),
        found => return Err(ModelError::UnknownFormat { what, found }),
    };
    let (value, rest) = decoded.map_err(|e| ModelError::Decode {
        what,
        message: e.to_string(),
    })?;
    if !rest.is_empty() {
        return Err(ModelError::Decode {
            what,
            message: format!("{} trailing bytes", rest.len()),
        });
    }
    Ok(value)
}

/// Checks an identifier: target, device and pool IDs and volume names
/// appear in store keys, so they are short and free of `/`.
pub fn validate_id(kind: &'static str, value: &str, max: usize) -> Result<(), ModelError> {
    let ok = !value.is_empty()
        && value.len() <= max
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ModelError::InvalidId {
            kind,
            value: value.to_owned(),
            max,
        })
    }
}

/// Labels: at most `LABELS_MAX`; keys 1..=63 bytes of `A-Za-z0-9._-/`
/// (Kubernetes-style `topology.example.com/rack` works), values 0..=63
/// bytes of `A-Za-z0-9._-`.
pub fn validate_labels(labels: &BTreeMap<String, String>) -> Result<(), ModelError> {
    if labels.len() > LABELS_MAX {
        return Err(ModelError::Invalid(format!(
            "{} labels, at most {LABELS_MAX}",
            labels.len()
        )));
    }
    let chars_ok = |s: &str, extra: &[u8]| {
        s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b) || extra.contains(&b))
    };
    for (k, v) in labels {
        if k.is_empty() || k.len() > LABEL_BYTES_MAX || !chars_ok(k, b"/") {
            return Err(ModelError::Invalid(format!(
                "label key {k:?} must be 1..={LABEL_BYTES_MAX} bytes of A-Z a-z 0-9 . _ - /"
            )));
        }
        if v.len() > LABEL_BYTES_MAX || !chars_ok(v, b"") {
            return Err(ModelError::Invalid(format!(
                "label {k}={v:?}: values are 0..={LABEL_BYTES_MAX} bytes of A-Z a-z 0-9 . _ -"
            )));
        }
    }
    Ok(())
}

/// A storage server running `nvpool-target`, as it registered itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Target {
    /// Stable identity chosen by the target (it keeps it in its state
    /// directory); survives address changes.
    pub id: String,
    /// Human name, usually the host name.
    pub name: String,
    /// The NVMe/TCP listener initiators connect to.
    pub addr: SocketAddr,
    /// The target's admin API, which the control plane programs.
    pub admin_addr: SocketAddr,
    /// Failure-domain and other labels: `host`, `rack`, `zone`…
    pub labels: BTreeMap<String, String>,
    pub devices: Vec<Device>,
    pub registered_ms: u64,
    /// Wall-clock time of the last heartbeat (ms since the Unix epoch).
    pub last_heartbeat_ms: u64,
    pub state: TargetState,
    /// The NVMe/RDMA listener hosts may connect to instead of `addr`;
    /// `None`: NVMe/TCP only. Since format 2.
    pub rdma_addr: Option<SocketAddr>,
    /// The admin API serves https (`nvpool-target --admin-tls-cert`): the
    /// control plane calls `https://admin_addr` and verifies the
    /// certificate for that IP. Last, since format 3.
    pub admin_tls: bool,
}

/// [`Target`] as format 1 stored it: no `rdma_addr`. Frozen: never edit.
#[derive(Deserialize)]
struct TargetV1 {
    id: String,
    name: String,
    addr: SocketAddr,
    admin_addr: SocketAddr,
    labels: BTreeMap<String, String>,
    devices: Vec<Device>,
    registered_ms: u64,
    last_heartbeat_ms: u64,
    state: TargetState,
}

impl From<TargetV1> for Target {
    fn from(t: TargetV1) -> Target {
        Target {
            id: t.id,
            name: t.name,
            addr: t.addr,
            admin_addr: t.admin_addr,
            labels: t.labels,
            devices: t.devices,
            registered_ms: t.registered_ms,
            last_heartbeat_ms: t.last_heartbeat_ms,
            state: t.state,
            rdma_addr: None,
            admin_tls: false,
        }
    }
}

/// [`Target`] as format 2 stored it: no `admin_tls`. Frozen: never edit.
#[derive(Deserialize)]
struct TargetV2 {
    id: String,
    name: String,
    addr: SocketAddr,
    admin_addr: SocketAddr,
    labels: BTreeMap<String, String>,
    devices: Vec<Device>,
    registered_ms: u64,
    last_heartbeat_ms: u64,
    state: TargetState,
    rdma_addr: Option<SocketAddr>,
}

/// Format 2 had no https admin APIs: every target was called over plain
/// HTTP.
impl From<TargetV2> for Target {
    fn from(t: TargetV2) -> Target {
        Target {
            id: t.id,
            name: t.name,
            addr: t.addr,
            admin_addr: t.admin_addr,
            labels: t.labels,
            devices: t.devices,
            registered_ms: t.registered_ms,
            last_heartbeat_ms: t.last_heartbeat_ms,
            state: t.state,
            rdma_addr: t.rdma_addr,
            admin_tls: false,
        }
    }
}

impl Target {
    pub fn device(&self, id: &str) -> Option<&Device> {
        self.devices.iter().find(|d| d.id == id)
    }

    /// Online when the last heartbeat is at most `timeout_ms` old. A
    /// heartbeat from the future (clock skew) counts as fresh.
    pub fn health(&self, now_ms: u64, timeout_ms: u64) -> Health {
        if now_ms.saturating_sub(self.last_heartbeat_ms) <= timeout_ms {
            Health::Online
        } else {
            Health::Offline
        }
    }

    pub fn validate(&self) -> Result<(), ModelError> {
        validate_id("target id", &self.id, ID_BYTES_MAX)?;
        validate_id("target name", &self.name, NAME_BYTES_MAX)?;
        validate_labels(&self.labels)?;
        if let Some(a) = self.rdma_addr {
            validate_connect_addr("rdma_addr", a)?;
        }
        if self.devices.len() > DEVICES_PER_TARGET_MAX {
            return Err(ModelError::Invalid(format!(
                "target {}: {} devices, at most {DEVICES_PER_TARGET_MAX}",
                self.id,
                self.devices.len()
            )));
        }
        let mut seen = BTreeSet::new();
        for d in &self.devices {
            d.validate()?;
            if !seen.insert(d.id.as_str()) {
                return Err(ModelError::Invalid(format!(
                    "target {}: device {} is listed twice",
                    self.id, d.id
                )));
            }
        }
        Ok(())
    }
}

/// One device (drive, partition or file) a target offers for extents.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Device {
    /// Unique within its target (`nvme1n1`, a serial number…).
    pub id: String,
    /// How the target opens it: `file:/dev/disk/by-id/nvme-…`. Extents are
    /// exported as `BACKEND,offset=…,length=…`.
    pub backend: String,
    pub capacity_bytes: u64,
    /// Device labels (`class=tlc`…); a failure-domain label here overrides
    /// the target's.
    pub labels: BTreeMap<String, String>,
}

impl Device {
    pub fn validate(&self) -> Result<(), ModelError> {
        validate_id("device id", &self.id, ID_BYTES_MAX)?;
        if self.backend.is_empty() || self.backend.len() > BACKEND_SPEC_BYTES_MAX {
            return Err(ModelError::Invalid(format!(
                "device {}: backend spec must be 1..={BACKEND_SPEC_BYTES_MAX} bytes",
                self.id
            )));
        }
        if self.capacity_bytes > DEVICE_BYTES_MAX {
            return Err(ModelError::Invalid(format!(
                "device {}: capacity {} bytes, at most {DEVICE_BYTES_MAX} (256 TiB)",
                self.id, self.capacity_bytes
            )));
        }
        validate_labels(&self.labels)
    }

    /// Whether it is a grain pool (`thin:`): its extents are trees that
    /// take space when written, and it holds thin volumes only.
    pub fn is_grain_pool(&self) -> bool {
        nvpool_api::admin::is_grain_pool(&self.backend)
    }

    /// The space placement fits extents into: the capacity of a plain
    /// device, a fixed virtual size for a grain pool (over-commit).
    pub fn placement_bytes(&self) -> u64 {
        if self.is_grain_pool() {
            GRAIN_POOL_VIRTUAL_BYTES
        } else {
            self.capacity_bytes
        }
    }
}

/// A device of a target.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DeviceRef {
    pub target: String,
    pub device: String,
}

impl DeviceRef {
    pub fn new(target: &str, device: &str) -> DeviceRef {
        DeviceRef {
            target: target.to_owned(),
            device: device.to_owned(),
        }
    }
}

impl fmt::Display for DeviceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.target, self.device)
    }
}

/// A named set of devices. A device belongs to at most one pool; volumes
/// created without a pool use the devices that belong to none.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pool {
    pub name: String,
    /// Sorted, without duplicates.
    pub devices: Vec<DeviceRef>,
    pub created_ms: u64,
}

/// One fixed-size piece of a device holding part of a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    pub target: String,
    pub device: String,
    /// Byte offset on the device; a multiple of the extent size.
    pub offset: u64,
    /// Always the volume's `extent_bytes`.
    pub length: u64,
    /// Stripe member (0 for concat and raid1).
    pub member: u32,
    /// Position within the member: the member's `row`-th extent.
    pub row: u32,
    /// Which copy (0 for concat and raid0).
    pub copy: u8,
}

impl Extent {
    pub fn device_ref(&self) -> DeviceRef {
        DeviceRef::new(&self.target, &self.device)
    }

    /// `[offset, offset + length)` on the device (saturating: a corrupt
    /// record must not overflow; the allocator refuses it anyway).
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.length)
    }
}

/// What a client asks for when it creates a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeSpec {
    pub uuid: Uuid,
    pub name: String,
    pub size_bytes: u64,
    pub layout: Layout,
    pub pool: Option<String>,
}

impl VolumeSpec {
    pub fn validate(&self, extent_bytes: u64) -> Result<(), ModelError> {
        validate_id("volume name", &self.name, NAME_BYTES_MAX)?;
        if let Some(p) = &self.pool {
            validate_id("pool name", p, ID_BYTES_MAX)?;
        }
        validate_extent_bytes(extent_bytes)?;
        self.layout.validate(extent_bytes)?;
        Ok(validate_size(self.size_bytes, &self.layout, extent_bytes)?)
    }
}

/// A volume: its parameters and every extent, in canonical order.
///
/// Extents are sorted by `(row, member, copy)`: the extent for a given
/// position is at index `(row × width + member) × copies + copy`, and
/// growing a volume only appends rows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    pub uuid: Uuid,
    pub name: String,
    pub size_bytes: u64,
    pub layout: Layout,
    pub pool: Option<String>,
    /// The extent size this volume was created with.
    pub extent_bytes: u64,
    pub extents: Vec<Extent>,
    pub created_ms: u64,
}

impl Volume {
    pub fn geometry(&self) -> Geometry {
        Geometry::new(self.size_bytes, self.extent_bytes, &self.layout)
    }

    /// Extents per member.
    pub fn rows(&self) -> u32 {
        self.geometry().rows()
    }

    /// The copies of `member`'s `row`-th extent (copy 0 first). Panics if
    /// the volume lacks them: call on validated volumes, or use `locate`.
    pub fn copies_of(&self, row: u32, member: u32) -> &[Extent] {
        let copies = usize::from(self.layout.copies());
        let start = (row as usize * self.layout.width() as usize + member as usize) * copies;
        &self.extents[start..start + copies]
    }

    /// Thin when its extents are on grain pools (placement puts a volume
    /// on one kind of device only, so the kind is derived, not stored):
    /// the first extent whose device `grain_pool` knows decides; a volume
    /// with none known is thick.
    pub fn provisioning(&self, grain_pool: impl Fn(&Extent) -> Option<bool>) -> Provisioning {
        match self.extents.iter().find_map(grain_pool) {
            Some(true) => Provisioning::Thin,
            _ => Provisioning::Thick,
        }
    }

    /// [`Self::provisioning`] from the targets' device records.
    pub fn provisioning_on(&self, targets: &BTreeMap<String, Target>) -> Provisioning {
        self.provisioning(|e| {
            targets
                .get(&e.target)
                .and_then(|t| t.device(&e.device))
                .map(Device::is_grain_pool)
        })
    }

    /// The parameters this volume was created from, as a spec, for
    /// idempotency checks.
    pub fn spec(&self) -> VolumeSpec {
        VolumeSpec {
            uuid: self.uuid,
            name: self.name.clone(),
            size_bytes: self.size_bytes,
            layout: self.layout,
            pool: self.pool.clone(),
        }
    }

    /// Whether I/O can be served: online when every extent's target is
    /// online, degraded when some copy is on an offline target but every
    /// (row, member) keeps a live copy, offline otherwise.
    pub fn status(&self, health: impl Fn(&str) -> Health) -> VolumeStatus {
        self.status_with(health, &BTreeSet::new())
    }

    /// `status`, also counting the extents in `failed` (indices into
    /// `extents` that a host reported failed: they missed writes) as dead.
    pub fn status_with(
        &self,
        health: impl Fn(&str) -> Health,
        failed: &BTreeSet<usize>,
    ) -> VolumeStatus {
        let mut degraded = false;
        let copies = usize::from(self.layout.copies());
        for (g, group) in self.extents.chunks(copies).enumerate() {
            let live = group
                .iter()
                .enumerate()
                .filter(|(c, e)| {
                    health(&e.target) == Health::Online && !failed.contains(&(g * copies + c))
                })
                .count();
            if live == 0 {
                return VolumeStatus::Offline;
            }
            degraded |= live < group.len();
        }
        if degraded {
            VolumeStatus::Degraded
        } else {
            VolumeStatus::Online
        }
    }

    /// Checks the volume's parameters and that its extents are exactly the
    /// ones its geometry needs, in canonical order, each of the volume's
    /// extent size and extent-aligned, and the extents of a row on
    /// distinct targets.
    pub fn validate(&self) -> Result<(), ModelError> {
        self.spec().validate(self.extent_bytes)?;
        let inconsistent = |reason: String| ModelError::Inconsistent {
            uuid: self.uuid,
            reason,
        };
        let g = self.geometry();
        let (width, copies) = (self.layout.width(), self.layout.copies());
        let expected = g.rows() as usize * width as usize * usize::from(copies);
        if self.extents.len() != expected {
            return Err(inconsistent(format!(
                "{} extents, its geometry needs {expected}",
                self.extents.len()
            )));
        }
        let mut i = 0;
        for row in 0..g.rows() {
            let mut targets = BTreeSet::new();
            for member in 0..width {
                for copy in 0..copies {
                    let e = &self.extents[i];
                    i += 1;
                    if (e.row, e.member, e.copy) != (row, member, copy) {
                        return Err(inconsistent(format!(
                            "extent {} is (row {}, member {}, copy {}), expected \
                             ({row}, {member}, {copy})",
                            i - 1,
                            e.row,
                            e.member,
                            e.copy
                        )));
                    }
                    if e.length != self.extent_bytes || !e.offset.is_multiple_of(self.extent_bytes)
                    {
                        return Err(inconsistent(format!(
                            "extent {} is [{}, +{}), not an aligned {}-byte extent",
                            i - 1,
                            e.offset,
                            e.length,
                            self.extent_bytes
                        )));
                    }
                    if !targets.insert(e.target.as_str()) {
                        return Err(inconsistent(format!(
                            "row {row} has two extents on target {}",
                            e.target
                        )));
                    }
                }
            }
        }
        Ok(())
    }
}

impl From<DeviceRef> for DeviceRefBody {
    fn from(d: DeviceRef) -> DeviceRefBody {
        DeviceRefBody {
            target: d.target,
            device: d.device,
        }
    }
}

impl From<Extent> for ExtentOut {
    fn from(e: Extent) -> ExtentOut {
        ExtentOut {
            target: e.target,
            device: e.device,
            offset: e.offset,
            length: e.length,
            member: e.member,
            row: e.row,
            copy: e.copy,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_state_names_are_serde_names() {
        for st in TargetState::ALL {
            let json = serde_json::to_value(st).unwrap();
            assert_eq!(json, serde_json::Value::from(st.name()));
        }
    }
    use crate::limits::{EXTENTS_PER_VOLUME_MAX, VOLUME_ENCODED_BYTES_MAX};

    const MIB: u64 = 1 << 20;

    fn uuid(n: u8) -> Uuid {
        Uuid([n; 16])
    }

    #[test]
    fn uuids_are_stored_as_their_16_bytes() {
        let u: Uuid = "01234567-89ab-cdef-0123-456789abcdef".parse().unwrap();
        let stored = encode(&u);
        assert_eq!(stored.len(), 1 + 16, "binary form is the 16 bytes");
        assert_eq!(decode::<Uuid>("uuid", &stored).unwrap(), u);
    }

    #[test]
    fn identifiers_and_labels() {
        assert!(validate_id("t", "node-1.rack_a:x", ID_BYTES_MAX).is_ok());
        for bad in ["", "a/b", "a b", "é"] {
            assert!(validate_id("t", bad, ID_BYTES_MAX).is_err(), "{bad:?}");
        }
        assert!(validate_id("t", &"a".repeat(ID_BYTES_MAX + 1), ID_BYTES_MAX).is_err());
        let mut l = BTreeMap::new();
        l.insert("topology.example.com/rack".to_string(), "r1".to_string());
        l.insert("empty".to_string(), String::new());
        assert!(validate_labels(&l).is_ok());
        l.insert("bad".into(), "a/b".into());
        assert!(validate_labels(&l).is_err());
        let many = (0..=LABELS_MAX)
            .map(|i| (format!("k{i}"), "v".into()))
            .collect();
        assert!(validate_labels(&many).is_err());
    }

    fn mirror(rows: u32) -> Volume {
        let mut extents = Vec::new();
        for row in 0..rows {
            for copy in 0..2u8 {
                extents.push(Extent {
                    target: format!("t{copy}"),
                    device: "d".into(),
                    offset: u64::from(row) * MIB,
                    length: MIB,
                    member: 0,
                    row,
                    copy,
                });
            }
        }
        Volume {
            uuid: uuid(1),
            name: "v".into(),
            size_bytes: u64::from(rows) * MIB,
            layout: Layout::Raid1 { copies: 2 },
            pool: None,
            extent_bytes: MIB,
            extents,
            created_ms: 5,
        }
    }

    #[test]
    fn volume_validation_and_status() {
        let v = mirror(3);
        v.validate().unwrap();
        assert_eq!(v.copies_of(2, 0)[1].target, "t1");

        let mut bad = v.clone();
        bad.extents.pop();
        assert!(matches!(
            bad.validate(),
            Err(ModelError::Inconsistent { .. })
        ));
        let mut bad = v.clone();
        bad.extents.swap(0, 1);
        assert!(bad.validate().is_err());
        let mut bad = v.clone();
        bad.extents[1].target = "t0".into();
        assert!(bad.validate().is_err(), "copies on one target");
        let mut bad = v.clone();
        bad.extents[3].offset += 4096;
        assert!(bad.validate().is_err(), "unaligned");

        let all = |_: &str| Health::Online;
        assert_eq!(v.status(all), VolumeStatus::Online);
        let t1_down = |t: &str| {
            if t == "t1" {
                Health::Offline
            } else {
                Health::Online
            }
        };
        assert_eq!(v.status(t1_down), VolumeStatus::Degraded);
        assert_eq!(v.status(|_| Health::Offline), VolumeStatus::Offline);
        let mut concat = v.clone();
        concat.layout = Layout::Concat;
        concat.extents.retain(|e| e.copy == 0);
        concat.validate().unwrap();
        assert_eq!(
            concat.status(|t| if t == "t0" {
                Health::Offline
            } else {
                Health::Online
            }),
            VolumeStatus::Offline
        );
    }

    #[test]
    fn stored_encoding_is_versioned_and_strict() {
        let v = mirror(2);
        let bytes = encode(&v);
        assert_eq!(bytes[0], FORMAT);
        assert_eq!(decode::<Volume>("volume", &bytes).unwrap(), v);
        let mut future = bytes.clone();
        future[0] = FORMAT + 1;
        assert_eq!(
            decode::<Volume>("volume", &future),
            Err(ModelError::UnknownFormat {
                what: "volume",
                found: FORMAT + 1
            })
        );
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(decode::<Volume>("volume", &trailing).is_err());
        assert!(decode::<Volume>("volume", &bytes[..bytes.len() - 1]).is_err());
        assert!(decode::<Volume>("volume", &[]).is_err());
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["layout"]["raid1"]["copies"], 2);
        assert_eq!(json["uuid"], uuid(1).to_string());
    }

    fn target(rdma_addr: Option<SocketAddr>) -> Target {
        Target {
            id: "t1".into(),
            name: "node-1".into(),
            addr: "10.0.0.1:4420".parse().unwrap(),
            admin_addr: "[fd00::1]:7001".parse().unwrap(),
            labels: [("rack".to_string(), "r1".to_string())].into(),
            devices: vec![Device {
                id: "nvme0".into(),
                backend: "file:/dev/nvme0n1".into(),
                capacity_bytes: 1 << 40,
                labels: BTreeMap::new(),
            }],
            registered_ms: 1_700_000_000_000,
            last_heartbeat_ms: 1_700_000_005_000,
            state: TargetState::Cordoned,
            rdma_addr,
            admin_tls: false,
        }
    }

    /// `target(None)` as a format-1 build stored it (captured from that
    /// build; never regenerate).
    const TARGET_FORMAT_1: &[u8] = &[
        1, 2, 116, 49, 6, 110, 111, 100, 101, 45, 49, 0, 10, 0, 0, 1, 196, 34, 1, 253, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 217, 54, 1, 4, 114, 97, 99, 107, 2, 114, 49, 1, 5, 110,
        118, 109, 101, 48, 17, 102, 105, 108, 101, 58, 47, 100, 101, 118, 47, 110, 118, 109, 101,
        48, 110, 49, 128, 128, 128, 128, 128, 32, 0, 128, 208, 149, 255, 188, 49, 136, 247, 149,
        255, 188, 49, 1,
    ];

    #[test]
    fn format_1_target_records_still_decode() {
        // The format-1 layout, declared independently of `TargetV1`.
        #[derive(Serialize)]
        struct Format1Target {
            id: String,
            name: String,
            addr: SocketAddr,
            admin_addr: SocketAddr,
            labels: BTreeMap<String, String>,
            devices: Vec<Device>,
            registered_ms: u64,
            last_heartbeat_ms: u64,
            state: TargetState,
        }
        let t = target(None);
        let old = Format1Target {
            id: t.id.clone(),
            name: t.name.clone(),
            addr: t.addr,
            admin_addr: t.admin_addr,
            labels: t.labels.clone(),
            devices: t.devices.clone(),
            registered_ms: t.registered_ms,
            last_heartbeat_ms: t.last_heartbeat_ms,
            state: t.state,
        };
        let mut bytes = vec![1];
        bytes.extend(postcard::to_allocvec(&old).unwrap());
        assert_eq!(bytes, TARGET_FORMAT_1, "the fixture is the format-1 layout");
        assert_eq!(decode::<Target>("target", TARGET_FORMAT_1), Ok(t.clone()));

        // Written again, it is the current format, and only that.
        let now = encode(&t);
        assert_eq!(now[0], FORMAT);
        assert_eq!(&now[1..now.len() - 2], &TARGET_FORMAT_1[1..]);
        assert_eq!(
            &now[now.len() - 2..],
            &[0, 0],
            "rdma_addr None and admin_tls false, appended"
        );
        let mut mislabelled = now.clone();
        mislabelled[0] = 1;
        assert!(
            matches!(
                decode::<Target>("target", &mislabelled),
                Err(ModelError::Decode { .. })
            ),
            "a format-3 body is not a format-1 target"
        );
        assert!(decode::<Target>("target", &TARGET_FORMAT_1[..20]).is_err());
    }

    /// `target(Some(10.0.0.1:4421))` as a format-2 build stored it
    /// (captured from that build; never regenerate).
    const TARGET_FORMAT_2: &[u8] = &[
        2, 2, 116, 49, 6, 110, 111, 100, 101, 45, 49, 0, 10, 0, 0, 1, 196, 34, 1, 253, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 217, 54, 1, 4, 114, 97, 99, 107, 2, 114, 49, 1, 5, 110,
        118, 109, 101, 48, 17, 102, 105, 108, 101, 58, 47, 100, 101, 118, 47, 110, 118, 109, 101,
        48, 110, 49, 128, 128, 128, 128, 128, 32, 0, 128, 208, 149, 255, 188, 49, 136, 247, 149,
        255, 188, 49, 1, 1, 0, 10, 0, 0, 1, 197, 34,
    ];

    #[test]
    fn format_2_target_records_still_decode() {
        // The format-2 layout, declared independently of `TargetV2`.
        #[derive(Serialize)]
        struct Format2Target {
            id: String,
            name: String,
            addr: SocketAddr,
            admin_addr: SocketAddr,
            labels: BTreeMap<String, String>,
            devices: Vec<Device>,
            registered_ms: u64,
            last_heartbeat_ms: u64,
            state: TargetState,
            rdma_addr: Option<SocketAddr>,
        }
        let t = target(Some("10.0.0.1:4421".parse().unwrap()));
        let old = Format2Target {
            id: t.id.clone(),
            name: t.name.clone(),
            addr: t.addr,
            admin_addr: t.admin_addr,
            labels: t.labels.clone(),
            devices: t.devices.clone(),
            registered_ms: t.registered_ms,
            last_heartbeat_ms: t.last_heartbeat_ms,
            state: t.state,
            rdma_addr: t.rdma_addr,
        };
        let mut bytes = vec![2];
        bytes.extend(postcard::to_allocvec(&old).unwrap());
        assert_eq!(bytes, TARGET_FORMAT_2, "the fixture is the format-2 layout");
        let read = decode::<Target>("target", TARGET_FORMAT_2).unwrap();
        assert_eq!(read, t);
        assert!(!read.admin_tls, "format 2 knew only plain HTTP");

        // Written again, it is the current format: the same body, admin_tls appended.
        let mut https = t.clone();
        https.admin_tls = true;
        let now = encode(&https);
        assert_eq!(now[0], FORMAT);
        assert_eq!(&now[1..now.len() - 1], &TARGET_FORMAT_2[1..]);
        assert_eq!(now.last(), Some(&1), "admin_tls true, appended");
        let mut mislabelled = now.clone();
        mislabelled[0] = 2;
        assert!(
            matches!(
                decode::<Target>("target", &mislabelled),
                Err(ModelError::Decode { .. })
            ),
            "a format-3 body is not a format-2 target"
        );
        // A format-2 body cut short is an error, not a guess.
        assert!(decode::<Target>("target", &TARGET_FORMAT_2[..TARGET_FORMAT_2.len() - 1]).is_err());
    }

    /// `value`, written now and labelled with each older format, reads
    /// back as itself: for types whose layout has not changed since
    /// format 1 (the default `decode_older`).
    #[track_caller]
    pub(crate) fn reads_every_older_format<T>(value: &T)
    where
        T: Stored + PartialEq + fmt::Debug,
    {
        for format in FORMAT_MIN..FORMAT {
            let mut old = encode(value);
            old[0] = format;
            assert_eq!(
                decode::<T>("value", &old).as_ref(),
                Ok(value),
                "format {format}"
            );
        }
    }

    #[test]
    fn unchanged_types_read_older_formats_as_is() {
        reads_every_older_format(&mirror(2));
        reads_every_older_format(&7u64);
        reads_every_older_format(&"vol7".to_string());
        reads_every_older_format(&uuid(7));
        reads_every_older_format(&Pool {
            name: "fast".into(),
            devices: vec![DeviceRef::new("t1", "nvme0"), DeviceRef::new("t2", "nvme0")],
            created_ms: 9,
        });
        // The stored types of other modules.
        use crate::attach::{
            Attachment, AttachmentState, Export, FailedCopies, HostRecord, StaleExports,
        };
        let host = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000001";
        reads_every_older_format(&Attachment {
            volume: uuid(3),
            host_nqn: host.into(),
            state: AttachmentState::Attached,
            created_ms: 4,
            nsids: vec![1, 2],
            failed_extents: vec![1],
        });
        reads_every_older_format(&FailedCopies {
            volume: uuid(3),
            extents: vec![0, 5],
        });
        reads_every_older_format(&HostRecord {
            host_nqn: host.into(),
            changes: 12,
        });
        reads_every_older_format(&StaleExports {
            target: "t1".into(),
            exports: vec![Export {
                subsystem_nqn: "nqn.2026-11.io.nvpool:host:x".into(),
                host_nqn: host.into(),
                nsid: 3,
                device: "nvme0".into(),
                offset: MIB,
                length: MIB,
            }],
        });
        reads_every_older_format(&crate::moves::RebalanceRequest {
            pool: Some("fast".into()),
            requested_ms: 8,
        });
        reads_every_older_format(&crate::paths::Served {
            volume: uuid(3),
            hosts: vec![host.into()],
            paths: vec!["t1".into(), "t2".into()],
            owner: Some("t2".into()),
            generation: 6,
            serving: true,
        });
        reads_every_older_format(&crate::resync::CopyState {
            volume: uuid(3),
            revision: 2,
            sessions: [(host.to_string(), 77)].into(),
            missed: [(
                1,
                crate::resync::Missed {
                    since_ms: 5,
                    regions: Some([4, 9].into()),
                    owed: BTreeSet::new(),
                },
            )]
            .into(),
            jobs: Vec::new(),
            history: Vec::new(),
            next_job: 3,
        });
        reads_every_older_format(&crate::state::TargetCredential {
            target: "t1".into(),
            admin_token: crate::rest::Secret::new("admin-token-0123456789").unwrap(),
        });
    }

    #[test]
    fn unknown_formats_fail() {
        let stored = [
            encode(&target(None)),
            TARGET_FORMAT_1.to_vec(),
            TARGET_FORMAT_2.to_vec(),
        ];
        for stored in stored {
            for found in [0, FORMAT + 1, u8::MAX] {
                let mut b = stored.clone();
                b[0] = found;
                assert_eq!(
                    decode::<Target>("target", &b),
                    Err(ModelError::UnknownFormat {
                        what: "target",
                        found
                    })
                );
            }
        }
        let e = ModelError::UnknownFormat {
            what: "target",
            found: FORMAT + 1,
        };
        assert_eq!(
            e.to_string(),
            format!(
                "target is stored in format {}; this build reads formats 1 to {FORMAT}",
                FORMAT + 1
            )
        );
    }

    #[test]
    fn targets_round_trip_with_and_without_rdma_and_tls() {
        let rdma = [
            None,
            Some("10.0.0.1:4420".parse().unwrap()),
            Some("[fd00::7]:4421".parse().unwrap()),
        ];
        for (rdma, admin_tls) in rdma.into_iter().flat_map(|r| [(r, false), (r, true)]) {
            let t = Target {
                admin_tls,
                ..target(rdma)
            };
            t.validate().unwrap();
            let bytes = encode(&t);
            assert_eq!(bytes[0], FORMAT);
            assert_eq!(decode::<Target>("target", &bytes), Ok(t.clone()));
            let mut trailing = bytes.clone();
            trailing.push(0);
            assert!(decode::<Target>("target", &trailing).is_err());
            let json = serde_json::to_value(&t).unwrap();
            assert_eq!(
                json["rdma_addr"],
                rdma.map_or(serde_json::Value::Null, |a| a.to_string().into())
            );
            assert_eq!(json["admin_tls"], admin_tls);
        }
    }

    #[test]
    fn rdma_addr_must_be_connectable() {
        for bad in ["0.0.0.0:4420", "[::]:4420", "10.0.0.1:0"] {
            let e = target(Some(bad.parse().unwrap())).validate().unwrap_err();
            assert!(
                matches!(&e, ModelError::Invalid(m) if m.contains("rdma_addr")),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn largest_volume_record_fits_its_bound() {
        let id = "x".repeat(ID_BYTES_MAX);
        let extents = (0..EXTENTS_PER_VOLUME_MAX)
            .map(|i| Extent {
                target: id.clone(),
                device: id.clone(),
                offset: u64::MAX,
                length: u64::MAX,
                member: u32::MAX,
                row: u32::MAX - i,
                copy: u8::MAX,
            })
            .collect();
        let v = Volume {
            uuid: uuid(9),
            name: "n".repeat(NAME_BYTES_MAX),
            size_bytes: u64::MAX,
            layout: Layout::Raid10 {
                stripe_bytes: u64::MAX,
                width: u32::MAX,
                copies: u8::MAX,
            },
            pool: Some(id.clone()),
            extent_bytes: u64::MAX,
            extents,
            created_ms: u64::MAX,
        };
        let len = encode(&v).len();
        assert!(
            len <= VOLUME_ENCODED_BYTES_MAX,
            "{len} > {VOLUME_ENCODED_BYTES_MAX}"
        );
    }
}
