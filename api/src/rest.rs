//! The REST API's request and response bodies, as plain data: the server
//! (`api`, feature `server`) answers with them and its clients
//! (the CLI, the agent, the target's registration) send and read the same
//! structs, so no side re-declares a body or picks fields out of a
//! `serde_json::Value`. OpenAPI schemas are derived only with `server`.
//!
//! Also the one check of a control-plane base URL ([`parse_base_url`])
//! that every client applies to its `--endpoint` / `--control-plane`, and
//! of a list of them ([`parse_endpoints`]: instances of one control plane
//! that a client fails over between).

use nvpool_layout::{ConnectionPlan, LayoutBody, Uuid};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;

/// Checks and normalises a control-plane base URL,
/// `http[s]://HOST[:PORT][/PREFIX]`, to that form (scheme in lower case)
/// without a trailing slash. The error is the reason, for the caller to
/// put after the option it came from.
pub fn parse_base_url(url: &str) -> Result<String, &'static str> {
    let t = url.trim();
    let (scheme, rest) = match t.split_once("://") {
        Some((s, rest)) if s.eq_ignore_ascii_case("http") => ("http", rest),
        Some((s, rest)) if s.eq_ignore_ascii_case("https") => ("https", rest),
        _ => return Err("expected http://HOST:PORT or https://HOST:PORT"),
    };
    let authority = rest.split('/').next().unwrap_or_default();
    if authority.is_empty() || authority.contains(['@', '?', '#', ' ']) {
        return Err("expected http://HOST:PORT or https://HOST:PORT");
    }
    Ok(format!("{scheme}://{}", rest.trim_end_matches('/')))
}

/// Most control-plane endpoints one client takes: a few instances serve
/// one cluster; a longer list is a mistake, and every dead entry costs a
/// connect timeout before the next is tried.
pub const ENDPOINTS_MAX: usize = 16;

/// Checks a comma-separated list of control-plane base URLs (each as
/// [`parse_base_url`] checks it), in the order given: instances of one
/// control plane, every one serving the whole API. No entry may be empty
/// or repeated. The error is the reason, naming the entry.
pub fn parse_endpoints(list: &str) -> Result<Vec<String>, String> {
    let mut out: Vec<String> = Vec::new();
    for item in list.split(',') {
        if item.trim().is_empty() {
            return Err("an empty entry in the list (URLs are separated by single commas)".into());
        }
        let url = parse_base_url(item).map_err(|reason| format!("{:?}: {reason}", item.trim()))?;
        if out.contains(&url) {
            return Err(format!("{url} is given twice"));
        }
        out.push(url);
    }
    if out.len() > ENDPOINTS_MAX {
        return Err(format!("at most {ENDPOINTS_MAX} endpoints"));
    }
    Ok(out)
}

/// Shortest bearer token accepted: 16 characters is what a guessable
/// password would fall short of; generated tokens are 64 hex digits
/// (256 bits).
pub const SECRET_BYTES_MIN: usize = 16;
/// Longest bearer token accepted (it travels in one HTTP header).
pub const SECRET_BYTES_MAX: usize = 256;

/// A bearer token (a target's admin token, a control-plane token). Its
/// `Debug` shows no byte of it and it has no `Display`, so it cannot reach
/// a log line or an error message by accident; [`Secret::expose`] is the
/// one way to the text, for an `Authorization` header. Equality runs in
/// time that depends on the lengths only ([`Secret::matches`]).
///
/// A token is `SECRET_BYTES_MIN..=SECRET_BYTES_MAX` visible ASCII
/// characters (no spaces), so it fits a header and a line of a file as is.
#[derive(Clone, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Secret(String);

/// Why a string is not a usable token. Never quotes the string.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "a token is {SECRET_BYTES_MIN}..={SECRET_BYTES_MAX} visible ASCII characters, without spaces"
)]
pub struct SecretError;

impl Secret {
    /// Checks `text` (see the type's docs).
    pub fn new(text: impl Into<String>) -> Result<Secret, SecretError> {
        let text = text.into();
        let ok = (SECRET_BYTES_MIN..=SECRET_BYTES_MAX).contains(&text.len())
            && text.bytes().all(|b| b.is_ascii_graphic());
        if ok {
            Ok(Secret(text))
        } else {
            Err(SecretError)
        }
    }

    /// The token itself: only for putting it in a request or a file.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token, in time that depends on the
    /// lengths alone (never on where the bytes first differ).
    pub fn matches(&self, presented: &[u8]) -> bool {
        let mine = self.0.as_bytes();
        let mut diff = u8::from(mine.len() != presented.len());
        for (i, &b) in presented.iter().enumerate() {
            diff |= mine.get(i).copied().unwrap_or(0) ^ b;
        }
        std::hint::black_box(diff) == 0
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Secret) -> bool {
        self.matches(other.0.as_bytes())
    }
}

impl Eq for Secret {}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl TryFrom<String> for Secret {
    type Error = SecretError;
    fn try_from(s: String) -> Result<Secret, SecretError> {
        Secret::new(s)
    }
}

impl From<Secret> for String {
    fn from(s: Secret) -> String {
        s.0
    }
}

/// Whether placement may put new extents on a target. Set by an operator;
/// distinct from health, which is derived from heartbeats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TargetState {
    /// Takes new extents.
    Active,
    /// Keeps serving its extents but takes no new ones (before maintenance
    /// or decommissioning).
    Cordoned,
    /// Takes no new extents, and every extent it holds moves to other
    /// targets (it serves each until its move is done); empty, it is
    /// "drained" and can be removed. Last, so stored states decode.
    Draining,
}

impl TargetState {
    /// Every state, in declaration order (the API document lists them).
    pub const ALL: [TargetState; 3] = [
        TargetState::Active,
        TargetState::Cordoned,
        TargetState::Draining,
    ];

    /// The state as JSON writes it.
    pub fn name(self) -> &'static str {
        match self {
            TargetState::Active => "active",
            TargetState::Cordoned => "cordoned",
            TargetState::Draining => "draining",
        }
    }
}

/// A target's liveness as judged from its last heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    Online,
    Offline,
}

impl Health {
    /// The health as JSON writes it.
    pub fn name(self) -> &'static str {
        match self {
            Health::Online => "online",
            Health::Offline => "offline",
        }
    }
}

/// Whether a volume can serve I/O, from the health of its extents' targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VolumeStatus {
    Online,
    Degraded,
    Offline,
}

impl VolumeStatus {
    /// The status as JSON writes it.
    pub fn name(self) -> &'static str {
        match self {
            VolumeStatus::Online => "online",
            VolumeStatus::Degraded => "degraded",
            VolumeStatus::Offline => "offline",
        }
    }
}

/// Where an attachment stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttachmentState {
    /// Recorded; targets are being programmed (or a crash interrupted it).
    Attaching,
    /// Every target exports the namespaces to the host.
    Attached,
    /// Targets are being told to remove the namespaces.
    Detaching,
}

impl AttachmentState {
    /// The state as JSON writes it.
    pub fn name(self) -> &'static str {
        match self {
            AttachmentState::Attaching => "attaching",
            AttachmentState::Attached => "attached",
            AttachmentState::Detaching => "detaching",
        }
    }
}

/// A device as a target registers it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct DeviceBody {
    pub id: String,
    /// How the target opens it, e.g. `file:/dev/disk/by-id/nvme-…`.
    pub backend: String,
    pub capacity_bytes: u64,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// `POST /v1/targets`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RegisterTargetBody {
    pub id: String,
    pub name: String,
    /// NVMe/TCP listener, `host:port`.
    #[cfg_attr(feature = "schema", schema(value_type = String, example = "10.0.0.1:4420"))]
    pub addr: SocketAddr,
    /// The target's admin API, `host:port`.
    #[cfg_attr(feature = "schema", schema(value_type = String, example = "10.0.0.1:4480"))]
    pub admin_addr: SocketAddr,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    pub devices: Vec<DeviceBody>,
    /// NVMe/RDMA listener, `host:port`, when the target has one: hosts
    /// that can use RDMA connect there instead of `addr`. A specific IP
    /// and a port other than 0.
    // Left out when absent, so a TCP-only target still registers with a
    // control plane that predates the field (it refuses unknown fields).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schema(value_type = Option<String>, example = "10.0.0.1:4420"))]
    pub rdma_addr: Option<SocketAddr>,
    /// The admin API serves https: the control plane calls
    /// `https://admin_addr` and verifies the certificate against the CA of
    /// `nvpool-control --target-cacert` (else the system CA bundle), for
    /// the IP address of `admin_addr`, which the certificate must name.
    /// Default false: plain HTTP.
    // Left out when false, like `rdma_addr`: a target with a plain-HTTP
    // admin API still registers with an older control plane, and one
    // with https is refused there (unknown field) rather than called in
    // clear.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub admin_tls: bool,
    /// The bearer token of the target's admin API: the control plane sends
    /// it on every call it makes there. Write-only: kept apart from the
    /// target's record and returned by no call. Absent: the token held
    /// from an earlier registration stays.
    // Left out when absent, like `rdma_addr`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schema(value_type = Option<String>, write_only))]
    pub admin_token: Option<Secret>,
}

/// A device with its usage.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct DeviceOut {
    pub id: String,
    pub backend: String,
    pub labels: BTreeMap<String, String>,
    pub pool: Option<String>,
    pub capacity_bytes: u64,
    /// Bytes really taken: a plain device's placed extents, a grain pool's
    /// allocated grains as its target last reported them.
    pub used_bytes: u64,
    pub free_bytes: u64,
    /// A grain pool (`thin:PATH`): thin extents are trees in it.
    #[serde(default)]
    pub thin: bool,
    /// Bytes of the extents placed on it, thin or thick.
    #[serde(default)]
    pub provisioned_bytes: u64,
}

/// Bytes of a set of devices; `free_bytes = total_bytes - used_bytes`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct CapacityOut {
    pub total_bytes: u64,
    /// Bytes really taken (see [`DeviceOut::used_bytes`]).
    pub used_bytes: u64,
    pub free_bytes: u64,
    /// Whole extents of the configured size that still fit.
    pub free_extents: u64,
    /// Bytes of every extent placed, thin or thick: more than
    /// `total_bytes` when grain pools are over-committed.
    #[serde(default)]
    pub provisioned_bytes: u64,
}

/// `PUT /v1/targets/{id}/heartbeat`: what a target reports besides being
/// alive. An empty body (older targets) reports nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct HeartbeatBody {
    /// The grain pools' usage; plain devices are left out.
    #[serde(default)]
    pub devices: Vec<DeviceUsageBody>,
}

/// One grain pool's usage as its target measured it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct DeviceUsageBody {
    pub id: String,
    /// Allocated data grains × grain size.
    pub used_bytes: u64,
}

/// `GET /v1/events`: something the control plane wants an operator to
/// see, such as a pool crossing 80 % or 90 % of its real capacity. Each
/// control plane keeps its own last few, newest last.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct EventOut {
    /// Milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// For machines: `capacity_warning` (80 %), `capacity_critical` (90 %).
    pub kind: String,
    /// For people.
    pub message: String,
}

/// How a volume takes space (design/thin-snapshots.md T1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Provisioning {
    /// Extents are trees in grain pools: space is taken on first write.
    Thin,
    /// Extents are byte ranges of plain devices, taken whole at create.
    #[default]
    Thick,
}

/// A target as listed.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct TargetOut {
    pub id: String,
    pub name: String,
    #[cfg_attr(feature = "schema", schema(value_type = String))]
    pub addr: SocketAddr,
    #[cfg_attr(feature = "schema", schema(value_type = String))]
    pub admin_addr: SocketAddr,
    /// NVMe/RDMA listener; `null`: NVMe/TCP only.
    #[cfg_attr(feature = "schema", schema(value_type = Option<String>))]
    pub rdma_addr: Option<SocketAddr>,
    /// The control plane calls the admin API over https.
    pub admin_tls: bool,
    pub labels: BTreeMap<String, String>,
    /// `online` or `offline`, from the age of the last heartbeat.
    #[cfg_attr(feature = "schema", schema(value_type = String))]
    pub health: Health,
    /// `active` (takes new extents), `cordoned` (takes none) or `draining`
    /// (takes none, and its extents move to other targets).
    #[cfg_attr(feature = "schema", schema(value_type = String))]
    pub state: TargetState,
    /// Draining and holding nothing any more: it can be removed.
    pub drained: bool,
    pub registered_ms: u64,
    pub last_heartbeat_ms: u64,
    pub capacity: CapacityOut,
    pub devices: Vec<DeviceOut>,
}

/// A device of a target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct DeviceRefBody {
    pub target: String,
    pub device: String,
}

/// One extent of a volume: `length` bytes at `offset` of a target's device,
/// holding copy `copy` of stripe member `member`'s `row`-th extent.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct ExtentOut {
    pub target: String,
    pub device: String,
    pub offset: u64,
    pub length: u64,
    pub member: u32,
    pub row: u32,
    pub copy: u8,
}

/// `PUT /v1/pools/{name}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PoolBody {
    pub devices: Vec<DeviceRefBody>,
}

/// A pool as listed.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct PoolOut {
    pub name: String,
    pub devices: Vec<DeviceRefBody>,
    pub created_ms: u64,
    pub capacity: CapacityOut,
}

/// `PUT /v1/volumes/{uuid}`: what to create. The UUID is the path's.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct VolumeSpecBody {
    pub name: String,
    /// A positive multiple of 4096.
    pub size_bytes: u64,
    pub layout: LayoutBody,
    /// Place on this pool's devices; without it, on unpooled devices.
    #[serde(default)]
    pub pool: Option<String>,
    /// Absent: thin when the candidate devices include grain pools, else
    /// thick.
    #[serde(default)]
    pub provisioning: Option<Provisioning>,
    /// A clone: the new volume starts as this snapshot's contents, sharing
    /// its grains until written (design/thin-snapshots.md T6). Its size
    /// and layout must be the snapshot's; `pool` and `provisioning` must be
    /// absent (its trees are on the snapshot's devices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<SnapshotRef>,
    /// A dataset volume (design/thin-snapshots.md T8): any number of
    /// hosts may attach it at once, its namespaces are exported
    /// write-protected and no host can write it. Only with `source` (a
    /// read-only clone of a snapshot: nothing could ever fill an empty
    /// one). Fixed at create. Left out when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
}

/// A snapshot, named by its volume and its name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SnapshotRef {
    #[cfg_attr(feature = "schema", schema(value_type = String))]
    pub volume: Uuid,
    pub snapshot: String,
}

/// `POST /v1/volumes/{uuid}/snapshots`: take a crash-consistent snapshot
/// (design/thin-snapshots.md T5). Names follow the rules of volume names
/// and are unique per volume; taking one again under the same name is
/// answered with the existing snapshot (200) instead of 201.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SnapshotBody {
    pub name: String,
}

/// Where a snapshot stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SnapshotState {
    /// Targets hold its trees; engines are moving to the next epoch.
    Creating,
    /// Sealed: complete, and kept until deleted.
    Ready,
}

/// A snapshot of a volume: every extent copy's tree as it stood at the cut.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct SnapshotOut {
    #[cfg_attr(feature = "schema", schema(value_type = String))]
    pub volume: Uuid,
    pub name: String,
    /// The cut: the snapshot holds every write its volume's engines tagged
    /// at or below this epoch, and none tagged above it.
    pub epoch: u32,
    pub state: SnapshotState,
    pub created_ms: u64,
    /// The volume's size when taken.
    pub size_bytes: u64,
    /// A group snapshot: every volume of the group (this one among them),
    /// each with a snapshot of this name at one cut ([`SnapshotGroupBody`]).
    /// Empty for a snapshot of one volume.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schema(value_type = Vec<String>))]
    pub group: Vec<Uuid>,
}

/// `POST /v1/snapshot-groups`: one snapshot named `name` of every volume
/// in `volumes`, all at one cut (design/thin-snapshots.md T5, group
/// snapshots): a write to any of them issued after a write to any other
/// completed is in the group only if that one is. For a training job's
/// data and its checkpoint volume together. Taken again with the same
/// name and volumes it answers the existing snapshots (200); a volume
/// that has a snapshot of that name outside the group is 409
/// `snapshot_exists`. Any failure gives every snapshot of the group up.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SnapshotGroupBody {
    pub name: String,
    /// At least one; no volume twice.
    #[cfg_attr(feature = "schema", schema(value_type = Vec<String>))]
    pub volumes: Vec<Uuid>,
}

/// How long the control plane holds writers at a group snapshot's barrier
/// ([`AttachmentOut::write_hold`]): past it, it clears the hold and gives
/// the group up. Counted from before it sets the hold.
pub const WRITE_HOLD_MAX_MS: u64 = 5_000;

/// How long an engine stays held on its own: past it (counted from when
/// it saw the hold, so always after the control plane's deadline), it
/// admits writes again, tagged with the new epoch. Any snapshot whose
/// barrier it was part of has been given up by then.
pub const ENGINE_HOLD_MAX_MS: u64 = 15_000;

/// `POST /v1/volumes/{uuid}/resize`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ResizeBody {
    /// The new size: at least the current one (volumes only grow).
    pub size_bytes: u64,
}

/// A volume as listed, with its status and every extent.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct VolumeOut {
    #[cfg_attr(feature = "schema", schema(value_type = String, example = "0b5e1f9a-6c1d-4c55-9d0e-2f8a3b7c1d42"))]
    pub uuid: Uuid,
    pub name: String,
    pub size_bytes: u64,
    pub layout: LayoutBody,
    pub pool: Option<String>,
    /// `online`, `degraded` (a copy is on an offline target) or `offline`.
    #[cfg_attr(feature = "schema", schema(value_type = String))]
    pub status: VolumeStatus,
    pub extent_bytes: u64,
    pub created_ms: u64,
    pub extents: Vec<ExtentOut>,
    /// Host NQNs the volume is attached to.
    pub attachments: Vec<String>,
    /// Extents (indices into `extents`) whose copies missed writes, as hosts
    /// reported them: never read again until rebuilt; the volume is degraded
    /// (or offline when a row has no good copy left).
    #[serde(default)]
    pub failed_extents: Vec<u32>,
    /// Copies being brought back in sync (each also in `failed_extents`
    /// until it is).
    #[serde(default)]
    pub copy_jobs: Vec<CopyJobOut>,
    #[serde(default)]
    pub provisioning: Provisioning,
    /// A dataset volume ([`VolumeSpecBody::read_only`]): exported
    /// write-protected to every host. Left out when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
}

/// A running copy job.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct CopyJobOut {
    pub id: u64,
    /// The copy being filled (index into the volume's extents).
    pub extent: u32,
    /// The in-sync copy read from.
    pub source: u32,
    /// `resync-partial` (only the regions the copy missed), `resync-full`,
    /// `replace` (a new extent for a copy whose target is gone) or `move`.
    pub kind: String,
    /// `arming`, `mirroring` (waiting for every host to write to the copy),
    /// `copying` or `switching` (hosts read the new extent).
    pub state: String,
    /// Replace and move: the device of the new extent (`target/device`).
    pub to: Option<String>,
    pub bytes_total: u64,
    pub bytes_copied: u64,
    pub started_ms: u64,
    /// Measured since copying began; 0 before.
    pub rate_bytes_per_sec: u64,
    /// Seconds left at that rate, when there is one.
    pub eta_s: Option<u64>,
}

/// One copy of a volume, running or past (`nvpool volume history`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct CopyHistoryOut {
    pub id: u64,
    pub extent: u32,
    pub source: u32,
    /// `resync-partial`, `resync-full`, `replace` or `move`.
    pub kind: String,
    /// Replace and move: the device of the new extent (`target/device`).
    pub to: Option<String>,
    /// `running`, `done` or `failed`.
    pub result: String,
    pub bytes_total: u64,
    pub bytes_copied: u64,
    pub started_ms: u64,
    /// When the copier started copying (after hosts confirmed mirroring).
    pub copy_started_ms: Option<u64>,
    pub finished_ms: Option<u64>,
    pub error: Option<String>,
}

/// An attachment of a volume to a host, with the connection plan.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct AttachmentOut {
    #[cfg_attr(feature = "schema", schema(value_type = String))]
    pub volume: Uuid,
    pub host_nqn: String,
    /// `attaching`, `attached` or `detaching` (the last two only while a
    /// detach is in progress or after one failed).
    #[cfg_attr(feature = "schema", schema(value_type = String))]
    pub state: AttachmentState,
    pub created_ms: u64,
    /// Extents (indices into `plan.extents`) the host reported failed: they
    /// missed writes, so hosts must neither read nor write them until they
    /// are rebuilt.
    pub failed_extents: Vec<u32>,
    /// Copies (a subset of `failed_extents`) being brought back in sync:
    /// hosts write to them, never read them, and confirm with `PUT
    /// …/sync/{job}` once they do.
    #[serde(default)]
    pub syncing: Vec<nvpool_layout::SyncingCopy>,
    /// Copies moving to new extents (replace, move): hosts write the new
    /// extent too and confirm with `PUT …/sync/{job}`; once `switched` they
    /// read it instead of the old one (and confirm again), still writing
    /// both until the job is gone.
    #[serde(default)]
    pub moving: Vec<nvpool_layout::HostMove>,
    /// Moves whenever hosts must act on the copies; long-poll with
    /// `?after_revision=`.
    #[serde(default)]
    pub revision: u64,
    /// The epoch the host's engine tags its writes with (CDW2 of Write,
    /// Write Zeroes and Dataset Management). When it rises, the engine tags
    /// new writes with it, waits for the writes it issued before, and
    /// confirms with `PUT …/epoch` ([`EpochBody`]). 0: the control plane
    /// predates epochs; the engine sends untagged writes.
    #[serde(default)]
    pub write_epoch: u32,
    /// A barrier across several writers (a group snapshot, or a volume
    /// with more than one engine writing it): while true, the engine
    /// admits no new write (reads go on, and so do writes already issued),
    /// moves to `write_epoch` like any raise, and confirms with `held:
    /// true` ([`EpochBody`]) once every write it tagged lower completed. It
    /// admits writes again, tagged `write_epoch`, once the hold is false
    /// (the control plane clears it when every writer confirmed, or at
    /// [`WRITE_HOLD_MAX_MS`]), or on its own after [`ENGINE_HOLD_MAX_MS`].
    /// No write tagged with the new epoch is issued until every writer
    /// stopped issuing older ones, so no write of the new epoch completes
    /// before a write of an old one is issued, across every volume of the
    /// cut.
    #[serde(default)]
    pub write_hold: bool,
    /// The volume is read-only ([`VolumeSpecBody::read_only`]): its
    /// namespaces are write-protected (writes answer Namespace Is Write
    /// Protected) and the host presents a read-only device. The engine
    /// follows the attachment as for any volume; having no writes, it
    /// confirms a new epoch at once. Left out when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    pub plan: ConnectionPlan,
}

/// `PUT /v1/volumes/{uuid}/attachments/{host_nqn}/epoch`: the engine of
/// `session` tags every new write with `epoch`, and every write it tagged
/// lower has completed.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EpochBody {
    pub session: u64,
    pub epoch: u32,
    /// The engine is held ([`AttachmentOut::write_hold`]): it admits no
    /// new write until the hold is cleared. A barrier counts only held
    /// confirmations. Left out when false, so a control plane that
    /// predates the barrier takes the body.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub held: bool,
}

/// `PUT /v1/volumes/{uuid}/attachments/{host_nqn}/failed-extents`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct FailedExtentsBody {
    /// Indices into the plan's extents of copies that failed.
    pub failed_extents: Vec<u32>,
}

/// `PUT …/attachments/{host}/session`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SessionBody {
    /// Random per serving process.
    pub session: u64,
    /// The copy-state revision of the attachment it opened the volume from.
    pub revision: u64,
}

/// `PUT …/attachments/{host}/missed`: what each stale copy missed from
/// this host's serving process, handed over as it stops.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct MissedBody {
    pub session: u64,
    /// Extent index (as a string) → regions of `RESYNC_REGION_BYTES` written
    /// while that copy was stale. Stale copies absent missed nothing.
    pub extents: BTreeMap<String, Vec<u32>>,
}

/// `PUT …/attachments/{host}/sync/{job}`: the host writes to the job's
/// copy and every write it issued before has completed.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SyncBody {
    pub session: u64,
    /// Regions the copy missed from this host; `null` when unknown.
    pub missed_regions: Option<Vec<u32>>,
    /// The host could not write a moving copy's new extent: the job fails.
    // Left out when false: hosts have always sent it only then.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failed: bool,
}

/// What a reconciliation changed on a target.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct ReconcileOut {
    pub subsystems_removed: usize,
    pub namespaces_removed: usize,
    pub namespaces_added: usize,
    /// Copies the target ran for copy jobs that are over.
    pub copies_removed: usize,
    /// Stale exports (of a forced detach, or old extents of moved copies)
    /// were confirmed gone and their extents freed.
    pub stale_cleared: bool,
}

/// Body of `PUT /v1/volumes/{uuid}/exports/{host_nqn}`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ExportBody {
    /// Targets presenting the volume (ANA paths) when it is first
    /// exported: 1 to 8, default 2 (different failure domains first).
    #[serde(default)]
    pub paths: Option<usize>,
}

/// Body of `PUT /v1/hosts/{host_nqn}/dhchap`: the host's DH-HMAC-CHAP
/// settings. The secrets are `DHHC-1:XX:…:` strings (`nvme gen-dhchap-key`);
/// they are never shown again.
// The secrets' pattern is `nvpool_wire::dhchap::Secret`'s parser: base64
// (canonical) of a 32-, 48- or 64-byte key and its CRC-32, which JSON
// Schema cannot check (a wrong CRC is a 400).
#[derive(Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct HostKeysBody {
    /// The host's secret (what `nvme connect --dhchap-secret` is given).
    #[cfg_attr(
        feature = "schema",
        schema(
            pattern = r"^DHHC-1:0[0-3]:([A-Za-z0-9+/]{48}|[A-Za-z0-9+/]{69}[AQgw]==|[A-Za-z0-9+/]{90}[AEIMQUYcgkosw048]=):$"
        )
    )]
    pub dhchap_key: String,
    /// The controller's secret, for bidirectional authentication
    /// (`--dhchap-ctrl-secret`); must differ from the host's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "schema",
        schema(
            pattern = r"^DHHC-1:0[0-3]:([A-Za-z0-9+/]{48}|[A-Za-z0-9+/]{69}[AQgw]==|[A-Za-z0-9+/]{90}[AEIMQUYcgkosw048]=):$"
        )
    )]
    pub dhchap_ctrl_key: Option<String>,
    /// `sha256`, `sha384` or `sha512`; default: the strongest the host offers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schema(pattern = "^sha(256|384|512)$"))]
    pub dhchap_hash: Option<String>,
    /// `null` (default) or `ffdhe2048`, `ffdhe3072`, `ffdhe4096`,
    /// `ffdhe6144`, `ffdhe8192`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "schema",
        schema(pattern = "^(null|ffdhe(2048|3072|4096|6144|8192))$")
    )]
    pub dhchap_dhgroup: Option<String>,
}

impl std::fmt::Debug for HostKeysBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostKeysBody")
            .field("bidirectional", &self.dhchap_ctrl_key.is_some())
            .field("dhchap_hash", &self.dhchap_hash)
            .field("dhchap_dhgroup", &self.dhchap_dhgroup)
            .finish_non_exhaustive()
    }
}

/// A host's DH-HMAC-CHAP settings as the control plane holds them: never
/// the secrets.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct HostKeysOut {
    pub host_nqn: String,
    /// Names this version of the keys; targets show it beside the host.
    pub key_id: String,
    /// A controller key is set: the host authenticates the target too.
    pub bidirectional: bool,
    /// The hash required, if one is.
    pub dhchap_hash: Option<String>,
    pub dhchap_dhgroup: String,
    pub updated_ms: u64,
    /// After a change: how the targets that export to the host took it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<KeyRollout>,
}

/// Where a change of a host's keys has been made.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct KeyRollout {
    /// Targets that export to the host and now hold its new keys.
    pub updated: Vec<String>,
    /// Targets that could not be changed now, with why; reconciliation
    /// changes them when they answer (until then they hold the old keys).
    pub pending: Vec<PendingTarget>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct PendingTarget {
    pub target: String,
    pub error: String,
}

/// `PUT /v1/targets/{id}/state`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TargetStateBody {
    /// `active`, `cordoned` or `draining`.
    #[cfg_attr(feature = "schema", schema(value_type = String))]
    pub state: TargetState,
}

/// `POST /v1/rebalance`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RebalanceBody {
    /// The pool to even out; absent: every pool and the unpooled devices.
    #[serde(default)]
    pub pool: Option<String>,
    /// Only say what would move.
    #[serde(default)]
    pub dry_run: bool,
}

/// One planned move.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct MoveOut {
    #[cfg_attr(feature = "schema", schema(value_type = String))]
    pub volume: Uuid,
    pub volume_name: String,
    /// The copy: an index into the volume's extents.
    pub extent: u32,
    /// `target/device`.
    pub from: String,
    pub to: String,
    pub bytes: u64,
}

/// A rebalance plan (and whether it was started).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct RebalanceOut {
    pub moves: Vec<MoveOut>,
    pub bytes_total: u64,
    /// At the rebuild rate, `COPIES_PER_TARGET_MAX` copies per destination
    /// target at a time; `None` when copies are unthrottled.
    pub eta_s: Option<u64>,
    pub started: bool,
    /// Scopes still being evened out (pool names; `null` for the unpooled
    /// devices).
    pub pending: Vec<Option<String>>,
    /// Move jobs under way.
    pub moves_running: usize,
}

/// The body of every failed request.
// Every nvpool server answers errors with it (the control plane, a
// target's admin API, the agent) and every client decodes it; only the
// control plane fills `details`. Its schema keeps the name `ApiError`
// that the OpenAPI document has always used.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "schema", schema(as = ApiError))]
pub struct ErrorBody {
    /// Stable, machine-readable: `invalid`, `not_found`, `uuid_conflict`,
    /// `no_space`, `unauthorized`…
    #[serde(default)]
    #[cfg_attr(feature = "schema", schema(required = true))]
    pub kind: String,
    /// For humans.
    #[serde(default)]
    #[cfg_attr(feature = "schema", schema(required = true))]
    pub message: String,
    /// Kind-specific fields (an object, maybe empty).
    #[serde(default, skip_serializing_if = "serde_json::Value::is_null")]
    #[cfg_attr(feature = "schema", schema(value_type = Object, required = true))]
    pub details: serde_json::Value,
}

impl ErrorBody {
    /// `kind` and `message`, without details (`null`, left out of the JSON).
    pub fn new(kind: impl Into<String>, message: impl Into<String>) -> ErrorBody {
        ErrorBody {
            kind: kind.into(),
            message: message.into(),
            details: serde_json::Value::Null,
        }
    }
}

/// How often an owner renews its lease.
pub const LEASE_RENEW_MS: u64 = 500;

/// What a lease request gets: the subsystems the target may serve, for
/// `valid_ms` from when it sent the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct LeaseGrant {
    pub valid_ms: u64,
    pub nqns: Vec<String>,
}

/// One path of a served volume as a host sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct PathView {
    pub target: String,
    /// NVMe/TCP listener: `traddr` and `trsvcid` of `nvme connect`.
    pub traddr: String,
    pub trsvcid: u16,
    /// The target's NVMe/RDMA listener, when it has one (`nvme connect
    /// -t rdma -a RDMA_TRADDR -s RDMA_TRSVCID`, same subsystem); absent
    /// for NVMe/TCP-only targets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rdma_traddr: Option<String>,
    /// Its port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rdma_trsvcid: Option<u16>,
    /// `optimized` on the serving owner, `inaccessible` elsewhere.
    pub ana_state: String,
}

impl PathView {
    /// (transport, traddr, trsvcid) to connect this path with: NVMe/RDMA
    /// when the target offers it and `rdma_here`, else NVMe/TCP.
    pub fn route(&self, rdma_here: bool) -> (&'static str, &str, u16) {
        match (&self.rdma_traddr, self.rdma_trsvcid) {
            (Some(a), Some(p)) if rdma_here => ("rdma", a, p),
            _ => ("tcp", &self.traddr, self.trsvcid),
        }
    }
}

/// A served volume: what a host needs to connect to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct ServedView {
    #[cfg_attr(feature = "schema", schema(value_type = String))]
    pub volume: Uuid,
    pub subsystem_nqn: String,
    pub hosts: Vec<String>,
    pub paths: Vec<PathView>,
    pub owner: Option<String>,
    pub generation: u64,
    pub serving: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_carry_details_only_when_there_are_some() {
        let plain = ErrorBody::new("not_found", "no such volume");
        let j = serde_json::to_string(&plain).unwrap();
        assert_eq!(j, r#"{"kind":"not_found","message":"no such volume"}"#);
        let mut rich = plain.clone();
        rich.details = serde_json::json!({});
        let j = serde_json::to_string(&rich).unwrap();
        assert_eq!(
            j,
            r#"{"kind":"not_found","message":"no such volume","details":{}}"#
        );
        // A client reads whatever part of it came.
        let partial: ErrorBody = serde_json::from_str(r#"{"message": "m"}"#).unwrap();
        assert_eq!(partial, ErrorBody::new("", "m"));
    }

    /// The schema is the one docs/openapi.json has always had as `ApiError`.
    #[cfg(feature = "schema")]
    #[test]
    fn error_body_schema_is_the_documented_api_error() {
        use utoipa::{PartialSchema, ToSchema};
        assert_eq!(ErrorBody::name(), "ApiError");
        let doc: serde_json::Value =
            serde_json::from_str(include_str!("../../docs/openapi.json")).unwrap();
        let ours = serde_json::to_value(ErrorBody::schema()).unwrap();
        assert_eq!(ours, doc["components"]["schemas"]["ApiError"]);
    }

    #[test]
    fn secrets_hide_themselves_and_compare_whole() {
        let s = Secret::new("0123456789abcdef-token").unwrap();
        assert_eq!(format!("{s:?}"), "Secret(..)");
        assert!(s.matches(b"0123456789abcdef-token"));
        for other in [
            &b"0123456789abcdef-tokeN"[..],
            b"0123456789abcdef-toke",
            b"0123456789abcdef-token!",
            b"",
        ] {
            assert!(!s.matches(other), "{other:?}");
        }
        assert_eq!(s, Secret::new("0123456789abcdef-token").unwrap());
        assert_ne!(s, Secret::new("0123456789abcdef-other").unwrap());
        for bad in [
            "short",
            "has a space in it!!",
            "tab\there-0123456789",
            "\u{e9}0123456789abcdef",
        ] {
            let e = Secret::new(bad).unwrap_err().to_string();
            assert!(!e.contains(bad), "{e}");
        }
        assert!(Secret::new("x".repeat(SECRET_BYTES_MAX)).is_ok());
        assert!(Secret::new("x".repeat(SECRET_BYTES_MAX + 1)).is_err());
        // JSON carries it as a plain string, checked on the way in.
        let j = serde_json::to_string(&s).unwrap();
        assert_eq!(j, "\"0123456789abcdef-token\"");
        assert_eq!(serde_json::from_str::<Secret>(&j).unwrap(), s);
        assert!(serde_json::from_str::<Secret>("\"short\"").is_err());
    }

    #[test]
    fn base_urls() {
        assert_eq!(parse_base_url("http://cp:4430/").unwrap(), "http://cp:4430");
        assert_eq!(parse_base_url(" HTTP://cp ").unwrap(), "http://cp");
        assert_eq!(parse_base_url("http://cp/api/").unwrap(), "http://cp/api");
        assert_eq!(parse_base_url("HTTPS://cp:1/").unwrap(), "https://cp:1");
        for bad in [
            "cp:4430",
            "http://",
            "https://",
            "http://u@cp",
            "ftp://x",
            "httpsé://x",
        ] {
            assert!(parse_base_url(bad).is_err(), "{bad}");
        }
        // A multi-byte character where the scheme ends is no panic.
        assert_eq!(parse_base_url("http://é").unwrap(), "http://é");
    }

    #[test]
    fn endpoint_lists() {
        assert_eq!(parse_endpoints("http://a:1/").unwrap(), ["http://a:1"]);
        assert_eq!(
            parse_endpoints(" http://a:1 , HTTP://b:2/api/").unwrap(),
            ["http://a:1", "http://b:2/api"]
        );
        let e = parse_endpoints("http://a:1,ftp://b").unwrap_err();
        assert!(e.contains("\"ftp://b\"") && e.contains("expected"), "{e}");
        assert!(parse_endpoints("http://a:1,http://a:1/")
            .unwrap_err()
            .contains("twice"));
        for bad in ["", ",", "http://a:1,", "http://a:1,,http://b:2"] {
            assert!(
                parse_endpoints(bad).unwrap_err().contains("empty"),
                "{bad:?}"
            );
        }
        let many: Vec<String> = (0..=ENDPOINTS_MAX)
            .map(|i| format!("http://h{i}"))
            .collect();
        assert!(parse_endpoints(&many.join(",")).is_err());
        assert!(parse_endpoints(&many[..ENDPOINTS_MAX].join(",")).is_ok());
    }
}
