//! `nvpool volume …`: create, list, inspect, grow, delete, attach and
//! detach volumes through the control plane.
//!
//! A volume is named by its name or its UUID everywhere; names resolve
//! through `GET /v1/volumes`. Creates are idempotent on the UUID, which the
//! client chooses (random v4 unless `--uuid` is given), so a create retried
//! with the same `--uuid` returns the volume instead of making a second.

use crate::attach::{self, Frontend};
use crate::client::{segment, Client, ClientError};
use crate::cluster::{age, print_fields, print_json, table, typed, Connection, OutputArgs};
use crate::nvmef;
use crate::size::{format_iec, parse_size};
use crate::snapshot::SnapshotName;
use crate::{Format, Usage};
use anyhow::Context;
use nvpool_api::rest::{
    AttachmentOut, CopyHistoryOut, ExportBody, Provisioning, ResizeBody, ServedView, SnapshotBody,
    SnapshotOut, SnapshotRef, VolumeOut, VolumeSpecBody,
};
use nvpool_layout::limits::{BLOCK_BYTES, EXTENT_BYTES_MAX};
use nvpool_layout::{Layout, LayoutBody, Uuid};
use serde_json::Value;
use std::io::{IsTerminal, Read};
use std::path::Path;

/// Default stripe unit of raid0/raid10: large enough that a 64 KiB-aligned
/// read touches one member, small enough to spread 1 MiB reads widely.
pub const DEFAULT_STRIPE_BYTES: u64 = 64 << 10;
/// Default members of raid0/raid10.
pub const DEFAULT_STRIPE_WIDTH: u32 = 2;
/// Default copies of raid1/raid10: survives one failure.
pub const DEFAULT_COPIES: u8 = 2;

/// Bytes per second while the copier ran, once it is over.
fn copy_rate(h: &CopyHistoryOut) -> Option<u64> {
    let (start, end) = (h.copy_started_ms?, h.finished_ms?);
    let ms = end.saturating_sub(start).max(1);
    Some(h.bytes_copied.saturating_mul(1000) / ms)
}

/// What the tables say about a volume.
trait VolumeText {
    fn status_text(&self) -> String;
    fn extent_state(&self, i: u32) -> String;
}

impl VolumeText for VolumeOut {
    /// `online`, `degraded`, `offline`, or `syncing 42%` while copies are
    /// being filled (the share of all their bytes copied so far).
    fn status_text(&self) -> String {
        if self.copy_jobs.is_empty() {
            return self.status.name().into();
        }
        let total: u64 = self.copy_jobs.iter().map(|j| j.bytes_total).sum();
        let done: u64 = self.copy_jobs.iter().map(|j| j.bytes_copied).sum();
        format!("syncing {}%", percent(done, total))
    }

    /// The STATE of extent `i`: ok, stale, or syncing with progress.
    fn extent_state(&self, i: u32) -> String {
        let own = if self.failed_extents.contains(&i) {
            "stale"
        } else {
            "ok"
        };
        let Some(j) = self.copy_jobs.iter().find(|j| j.extent == i) else {
            return own.into();
        };
        // A copy filled in place is syncing; one moving keeps its own state
        // until the swap.
        let what = match &j.to {
            Some(to) => format!("{own}, {} to {to}", j.kind),
            None => "syncing".into(),
        };
        if j.state != "copying" {
            let detail = if j.to.is_some() {
                j.state.clone()
            } else {
                format!("{}: {}", j.kind, j.state)
            };
            return format!("{what} ({detail})");
        }
        let mut s = format!(
            "{what} {}% ({}, {}/s",
            percent(j.bytes_copied, j.bytes_total),
            j.kind,
            format_iec(j.rate_bytes_per_sec)
        );
        if let Some(eta) = j.eta_s {
            s.push_str(&format!(", ETA {eta}s"));
        }
        s.push(')');
        s
    }
}

fn percent(done: u64, total: u64) -> u64 {
    if total == 0 {
        100
    } else {
        (u128::from(done) * 100 / u128::from(total)) as u64
    }
}

#[derive(Debug, clap::Args)]
pub struct VolumeArgs {
    #[command(flatten)]
    pub out: OutputArgs,
    #[command(subcommand)]
    pub cmd: VolumeCmd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LayoutArg {
    Concat,
    Raid0,
    Raid1,
    Raid10,
}

#[derive(Debug, clap::Args)]
pub struct CreateArgs {
    pub name: String,
    /// Size in IEC units: 10G = 10 GiB, 1T = 1 TiB, 512M, 10GiB, or bytes.
    #[arg(long, value_parser = parse_size, required_unless_present_any = ["from", "from_volume"])]
    pub size: Option<u64>,
    /// A clone of this snapshot (VOLUME@SNAPSHOT): the new volume starts as
    /// its contents, sharing its space until written, with its size and
    /// layout, on its devices; ready at once, whatever the size. `--from`
    /// is the same.
    #[arg(long = "from-snapshot", visible_alias = "from", value_name = "VOLUME@SNAPSHOT",
          value_parser = crate::snapshot::parse_snapshot_name,
          conflicts_with_all = ["size", "layout", "stripe_width", "stripe_size", "copies", "pool", "thin", "thick"])]
    pub from: Option<crate::snapshot::SnapshotName>,
    /// A clone of this thin volume as it is now: takes its snapshot named
    /// clone-NAME (NAME: the new volume's; an existing one of that name is
    /// used as it is) and clones it as --from-snapshot does. The snapshot
    /// stays; deleting it leaves the clone whole.
    #[arg(long, value_name = "VOLUME",
          conflicts_with_all = ["from", "size", "layout", "stripe_width", "stripe_size", "copies", "pool", "thin", "thick"])]
    pub from_volume: Option<String>,
    #[arg(long, value_enum, default_value_t = LayoutArg::Concat)]
    pub layout: LayoutArg,
    /// Stripe members of raid0/raid10 (default 2).
    #[arg(long)]
    pub stripe_width: Option<u32>,
    /// Stripe unit of raid0/raid10, a power of two from 4K (default 64K).
    #[arg(long, value_parser = parse_size)]
    pub stripe_size: Option<u64>,
    /// Copies of raid1/raid10 (default 2).
    #[arg(long)]
    pub copies: Option<u8>,
    /// Place the volume on this pool's devices (default: unpooled devices).
    #[arg(long)]
    pub pool: Option<String>,
    /// Thin: extents are trees in grain pools, space is taken when written
    /// (the default when the devices include grain pools).
    #[arg(long, conflicts_with = "thick")]
    pub thin: bool,
    /// Thick: extents are ranges of plain devices, taken whole at create
    /// (the default when the devices include no grain pool).
    #[arg(long)]
    pub thick: bool,
    /// The volume's UUID (default: a random one); retrying a create with the
    /// same UUID returns the existing volume.
    #[arg(long, value_parser = parse_uuid)]
    pub uuid: Option<Uuid>,
    /// A dataset volume (with --from-snapshot or --from-volume): any
    /// number of hosts may attach it at once, each gets a read-only
    /// device, and no host can write it (its targets refuse writes).
    #[arg(long)]
    pub read_only: bool,
}

#[derive(Debug, clap::Subcommand)]
pub enum VolumeCmd {
    /// Create a volume: its extents are placed across targets at once.
    Create(CreateArgs),
    /// List volumes.
    #[command(visible_alias = "list")]
    Ls,
    /// Show a volume, its extents and the hosts it is attached to.
    Info {
        /// Volume name or UUID.
        volume: String,
    },
    /// The volume's copies, running and past: resyncs of stale copies
    /// (partial or full), with bytes copied and how they ended.
    History {
        /// Volume name or UUID.
        volume: String,
    },
    /// Read every in-sync copy of every extent through the targets and
    /// compare them region by region (online, throttled); lists the
    /// regions whose copies differ and exits 1 when any do.
    Verify {
        /// Volume name or UUID.
        volume: String,
        /// Bytes read per second over all copies, IEC units (0: unthrottled).
        #[arg(long, default_value = "256M", value_parser = parse_size)]
        rate: u64,
    },
    /// Mark a copy stale so that it is copied whole from an in-sync copy
    /// (after `verify` found it differing, say): hosts stop reading it at
    /// once. The last copy in sync of a row is refused.
    Resync {
        /// Volume name or UUID.
        volume: String,
        /// The copy: its index in `nvpool volume info`'s extent table.
        #[arg(long)]
        extent: u32,
        /// Wait until it is back in sync, with a progress bar on a terminal.
        #[arg(long)]
        wait: bool,
    },
    /// Grow a volume (volumes never shrink).
    Resize {
        /// Volume name or UUID.
        volume: String,
        /// The new size, IEC units.
        #[arg(long, value_parser = parse_size)]
        size: u64,
    },
    /// Delete a volume and free its extents.
    #[command(visible_alias = "rm")]
    Delete {
        /// Volume name or UUID.
        volume: String,
        /// Delete even while attached (detaches every host first).
        #[arg(long)]
        force: bool,
    },
    /// Attach a volume to this host as a block device (printed, like
    /// `rbd map`): its targets export the extents to this host, and a
    /// background process serves the volume through a front-end.
    Attach {
        /// Volume name or UUID.
        volume: String,
        /// The host (default: /etc/nvme/hostnqn, else one nvpool keeps in
        /// /var/lib/nvpool/hostnqn).
        #[arg(long)]
        host_nqn: Option<String>,
        /// How to present the block device.
        #[arg(long, value_enum, default_value_t = Frontend::Auto)]
        frontend: Frontend,
        /// Only export the volume to the host and print the connection plan
        /// (for another host, or an initiator of your own).
        #[arg(long)]
        plan_only: bool,
    },
    /// Serve a volume to a stock Linux host through targets: the host's
    /// NQN may then connect with `nvme connect` to every path (printed),
    /// and the kernel's native multipath fails over between them. Nothing
    /// of nvpool runs on that host.
    Export {
        /// Volume name or UUID.
        volume: String,
        /// The host that will connect (its /etc/nvme/hostnqn).
        #[arg(long)]
        host_nqn: String,
        /// Targets presenting the volume when it is first exported (1-8).
        #[arg(long, default_value_t = 2)]
        paths: usize,
    },
    /// Stop serving a volume to a host (it sees its paths go).
    Unexport {
        /// Volume name or UUID.
        volume: String,
        /// The host.
        #[arg(long)]
        host_nqn: String,
    },
    /// Detach a volume from a host.
    Detach {
        /// Volume name or UUID.
        volume: String,
        /// The host (default: this host's /etc/nvme/hostnqn).
        #[arg(long)]
        host_nqn: Option<String>,
        /// Detach although the device is mounted or a target cannot be
        /// reached (it is cleaned up when it returns).
        #[arg(long)]
        force: bool,
    },
}

fn parse_uuid(s: &str) -> Result<Uuid, String> {
    s.parse::<Uuid>()
        .map_err(|_| format!("{s:?} is not a UUID (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"))
}

/// A random version-4 UUID from the kernel's generator.
pub fn random_uuid() -> std::io::Result<Uuid> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    b[6] = (b[6] & 0x0F) | 0x40;
    b[8] = (b[8] & 0x3F) | 0x80;
    Ok(Uuid::from_bytes(b))
}

/// The layout the flags describe; flags that do not apply to the layout
/// are usage errors rather than silently ignored.
pub fn layout_of(a: &CreateArgs) -> Result<LayoutBody, Usage> {
    let striped = matches!(a.layout, LayoutArg::Raid0 | LayoutArg::Raid10);
    let mirrored = matches!(a.layout, LayoutArg::Raid1 | LayoutArg::Raid10);
    let name = format!("{:?}", a.layout).to_ascii_lowercase();
    if !striped && (a.stripe_width.is_some() || a.stripe_size.is_some()) {
        return Err(Usage(format!(
            "--stripe-width and --stripe-size apply to raid0 and raid10, not {name}"
        )));
    }
    if !mirrored && a.copies.is_some() {
        return Err(Usage(format!(
            "--copies applies to raid1 and raid10, not {name}"
        )));
    }
    let width = a.stripe_width.unwrap_or(DEFAULT_STRIPE_WIDTH);
    let stripe_bytes = a.stripe_size.unwrap_or(DEFAULT_STRIPE_BYTES);
    let copies = a.copies.unwrap_or(DEFAULT_COPIES);
    let body = match a.layout {
        LayoutArg::Concat => LayoutBody::Concat {},
        LayoutArg::Raid0 => LayoutBody::Raid0 {
            stripe_bytes,
            width,
        },
        LayoutArg::Raid1 => LayoutBody::Raid1 { copies },
        LayoutArg::Raid10 => LayoutBody::Raid10 {
            stripe_bytes,
            width,
            copies,
        },
    };
    // Everything but "stripe ≤ extent size", which only the control plane
    // knows, is checked here.
    Layout::from(body)
        .validate(EXTENT_BYTES_MAX)
        .map_err(|e| Usage(e.to_string()))?;
    Ok(body)
}

/// The kind `--thin` or `--thick` asks for; neither: the control plane's
/// default.
fn provisioning_of(a: &CreateArgs) -> Option<Provisioning> {
    match (a.thin, a.thick) {
        (true, _) => Some(Provisioning::Thin),
        (_, true) => Some(Provisioning::Thick),
        _ => None,
    }
}

fn provisioning_text(p: Provisioning) -> &'static str {
    match p {
        Provisioning::Thin => "thin",
        Provisioning::Thick => "thick",
    }
}

/// What `volume info` says of who may write the volume.
fn access_text(read_only: bool) -> &'static str {
    if read_only {
        "read-only"
    } else {
        "read-write"
    }
}

/// The PROVISIONING cell of `volume ls`: a read-only volume says so there.
fn provisioning_cell(x: &VolumeOut) -> String {
    let p = provisioning_text(x.provisioning);
    if x.read_only {
        format!("{p} (read-only)")
    } else {
        p.into()
    }
}

/// The snapshot `volume create NAME --from-volume` takes and clones.
pub fn implicit_snapshot(name: &str) -> String {
    format!("clone-{name}")
}

/// A clone takes its size and layout from the snapshot and its volume.
fn clone_body(
    c: &Client,
    name: String,
    from: &crate::snapshot::SnapshotName,
) -> anyhow::Result<VolumeSpecBody> {
    let (volume, snapshot) = crate::snapshot::get(c, from)?;
    let snapshot: SnapshotOut = typed("snapshot", &snapshot)?;
    let source: VolumeOut = typed("volume", &c.get(&format!("/v1/volumes/{volume}"))?)?;
    Ok(VolumeSpecBody {
        name,
        size_bytes: snapshot.size_bytes,
        layout: source.layout,
        pool: None,
        provisioning: None,
        source: Some(SnapshotRef {
            volume,
            snapshot: snapshot.name,
        }),
        read_only: false,
    })
}

fn check_size(size: u64) -> Result<(), Usage> {
    if size == 0 || !size.is_multiple_of(BLOCK_BYTES) {
        return Err(Usage(format!(
            "--size {size}: a volume is a positive multiple of {BLOCK_BYTES} bytes"
        )));
    }
    Ok(())
}

/// `concat`, `raid0 w=2 s=64K`, `raid1 c=2`, `raid10 w=2 s=64K c=2`.
pub fn layout_text(l: &LayoutBody) -> String {
    let s = |b: u64| format_iec(b).replace(".0 ", "").replace("iB", "");
    match *l {
        LayoutBody::Concat {} => "concat".into(),
        LayoutBody::Raid0 {
            stripe_bytes,
            width,
        } => format!("raid0 w={width} s={}", s(stripe_bytes)),
        LayoutBody::Raid1 { copies } => format!("raid1 c={copies}"),
        LayoutBody::Raid10 {
            stripe_bytes,
            width,
            copies,
        } => format!("raid10 w={width} s={} c={copies}", s(stripe_bytes)),
    }
}

/// The volume a name or UUID stands for, as the control plane sent it.
pub(crate) fn resolve(c: &Client, volume: &str) -> anyhow::Result<(Uuid, Value)> {
    if let Ok(uuid) = volume.parse::<Uuid>() {
        let v: Value = c.get(&format!("/v1/volumes/{uuid}"))?;
        return Ok((uuid, v));
    }
    let all: Value = c.get("/v1/volumes")?;
    let found = all
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == volume)
        .cloned();
    let v = found.ok_or_else(|| anyhow::anyhow!("no volume named {volume:?}"))?;
    let out: VolumeOut = typed("/v1/volumes", &v)?;
    Ok((out.uuid, v))
}

pub(crate) fn print_volume(v: &Value, fmt: Format) -> anyhow::Result<()> {
    if fmt == Format::Json {
        return print_json(v);
    }
    let x: VolumeOut = typed("volume", v)?;
    print_fields(&[
        ("Name", x.name.clone()),
        ("UUID", x.uuid.to_string()),
        (
            "Size",
            format!("{} ({} bytes)", format_iec(x.size_bytes), x.size_bytes),
        ),
        ("Layout", layout_text(&x.layout)),
        ("Provisioning", provisioning_text(x.provisioning).into()),
        ("Access", access_text(x.read_only).into()),
        ("Status", x.status_text()),
        ("Pool", x.pool.clone().unwrap_or_else(|| "-".into())),
        ("Extent size", format_iec(x.extent_bytes)),
        ("Created", age(x.created_ms)),
        (
            "Attached to",
            // The owners of a served volume are targets, shown below.
            match x
                .attachments
                .iter()
                .filter(|h| nvpool_api::names::parse_owner_host(h).is_none())
                .cloned()
                .collect::<Vec<_>>()
            {
                h if h.is_empty() => "-".into(),
                h => h.join(", "),
            },
        ),
    ]);
    if let Ok(s) = serde_json::from_value::<ServedView>(v["served"].clone()) {
        let paths: Vec<String> = s
            .paths
            .iter()
            .map(|p| format!("{} {}:{} {}", p.target, p.traddr, p.trsvcid, p.ana_state))
            .collect();
        let hosts: Vec<&str> = v["served"]["hosts"]
            .as_array()
            .map(|a| a.iter().filter_map(|h| h.as_str()).collect())
            .unwrap_or_default();
        print_fields(&[
            ("Served as", s.subsystem_nqn.clone()),
            ("Served to", hosts.join(", ")),
            ("Paths", paths.join("; ")),
        ]);
    }
    println!();
    let mut t = table(&[
        "ROW", "MEMBER", "COPY", "TARGET", "DEVICE", "OFFSET", "LENGTH", "STATE",
    ]);
    for (i, e) in x.extents.iter().enumerate() {
        // A copy that missed writes is never read until it is rebuilt.
        let state = x.extent_state(i as u32);
        t.add_row([
            e.row.to_string(),
            e.member.to_string(),
            e.copy.to_string(),
            e.target.clone(),
            e.device.clone(),
            format_iec(e.offset),
            format_iec(e.length),
            state,
        ]);
    }
    println!("{t}");
    Ok(())
}

/// How often `--wait` looks at a copy being filled.
const WAIT_POLL: std::time::Duration = std::time::Duration::from_millis(500);

/// Waits until copy `extent` of the volume is in sync, showing the copy's
/// progress.
fn wait_in_sync(c: &Client, uuid: &Uuid, extent: u32) -> anyhow::Result<()> {
    let bar = crate::dataset::bar(
        0,
        &format!("extent {extent}"),
        "  {prefix} [{bar:30}] {bytes}/{total_bytes}  {bytes_per_sec}  eta {eta}  {msg}",
    );
    loop {
        let v: VolumeOut = typed("volume", &c.get(&format!("/v1/volumes/{uuid}"))?)?;
        match v.copy_jobs.iter().find(|j| j.extent == extent) {
            Some(j) => {
                bar.set_length(j.bytes_total);
                bar.set_position(j.bytes_copied);
                bar.set_message(format!("{} {}", j.kind, j.state));
            }
            None if !v.failed_extents.contains(&extent) => {
                bar.finish_with_message("in sync");
                return Ok(());
            }
            None => bar.set_message("stale, waiting for a copy job"),
        }
        std::thread::sleep(WAIT_POLL);
    }
}

fn print_plan(a: &AttachmentOut) {
    let p = &a.plan;
    print_fields(&[
        ("Volume", format!("{} ({})", p.name, p.volume)),
        ("Host", a.host_nqn.clone()),
        ("State", a.state.name().into()),
        ("Size", format_iec(p.size_bytes)),
        ("Layout", layout_text(&p.layout)),
        ("Block size", p.block_bytes.to_string()),
    ]);
    println!();
    let mut t = table(&[
        "ROW",
        "MEMBER",
        "COPY",
        "TARGET",
        "ADDR",
        "SUBSYSTEM",
        "NSID",
        "DEVICE",
        "OFFSET",
        "LENGTH",
    ]);
    for e in &p.extents {
        t.add_row([
            e.row.to_string(),
            e.member.to_string(),
            e.copy.to_string(),
            e.target.clone(),
            e.addr.to_string(),
            e.subsystem_nqn.clone(),
            e.nsid.to_string(),
            e.device.clone(),
            format_iec(e.offset),
            format_iec(e.length),
        ]);
    }
    println!("{t}");
}

/// `--host-nqn`, else this host's NQN. Attach and detach must name the same
/// host every time, so a generated NQN will not do.
pub(crate) fn host_nqn(given: Option<String>) -> anyhow::Result<String> {
    if let Some(h) = given {
        if !h.starts_with("nqn.") {
            return Err(Usage(format!("--host-nqn {h:?} is not an NQN (nqn.…)")).into());
        }
        return Ok(h);
    }
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| s.starts_with("nqn."))
    };
    let path = nvpool_initiator::hostnqn::HOSTNQN_PATH;
    if let Some(h) = read(path) {
        return Ok(h);
    }
    // No nvme-cli identity: keep one of our own, the same every time.
    let own_path = std::env::var("NVPOOL_HOSTNQN_FILE").unwrap_or_else(|_| OWN_HOSTNQN_PATH.into());
    if let Some(h) = read(&own_path) {
        return Ok(h);
    }
    let uuid = random_uuid().context("generating a host NQN")?;
    let h = format!("nqn.2014-08.org.nvmexpress:uuid:{uuid}");
    let own = Path::new(&own_path);
    if let Some(dir) = own.parent() {
        std::fs::create_dir_all(dir).ok();
    }
    std::fs::write(own, format!("{h}\n")).map_err(|e| {
        anyhow::anyhow!(
            "this host has no NQN in {path} and {own_path} cannot be written ({e}); \
             give --host-nqn"
        )
    })?;
    Ok(h)
}

/// Where nvpool keeps a host NQN of its own when nvme-cli's is missing
/// (`NVPOOL_HOSTNQN_FILE` overrides it).
pub const OWN_HOSTNQN_PATH: &str = "/var/lib/nvpool/hostnqn";

fn attachment_path(uuid: &Uuid, host: &str) -> String {
    format!("/v1/volumes/{uuid}/attachments/{}", segment(host))
}

fn done(fmt: Format, json: Value, text: String) -> anyhow::Result<()> {
    match fmt {
        Format::Json => print_json(&json),
        Format::Table => {
            println!("{text}");
            Ok(())
        }
    }
}

pub fn run(conn: &Connection, a: VolumeArgs) -> anyhow::Result<()> {
    let fmt = a.out.output;
    match a.cmd {
        VolumeCmd::Create(args) => {
            let c = conn.client()?;
            if args.read_only && args.from.is_none() && args.from_volume.is_none() {
                return Err(Usage(
                    "--read-only: a read-only volume starts as a snapshot's contents: give \
                     --from-snapshot VOLUME@SNAPSHOT or --from-volume VOLUME"
                        .into(),
                )
                .into());
            }
            let uuid = match args.uuid {
                Some(u) => u,
                None => random_uuid()?,
            };
            let implicit = args.from_volume.as_ref().map(|v| SnapshotName {
                volume: v.clone(),
                snapshot: implicit_snapshot(&args.name),
            });
            if let Some(s) = &implicit {
                let (volume, _) = resolve(&c, &s.volume)?;
                let body = SnapshotBody {
                    name: s.snapshot.clone(),
                };
                let _: Value = c.post(&format!("/v1/volumes/{volume}/snapshots"), &body)?;
            }
            let body = match args.from.as_ref().or(implicit.as_ref()) {
                Some(from) => VolumeSpecBody {
                    read_only: args.read_only,
                    ..clone_body(&c, args.name.clone(), from)?
                },
                None => {
                    let size = args.size.unwrap_or_default();
                    check_size(size)?;
                    VolumeSpecBody {
                        name: args.name.clone(),
                        size_bytes: size,
                        provisioning: provisioning_of(&args),
                        layout: layout_of(&args)?,
                        pool: args.pool.clone(),
                        source: None,
                        read_only: false,
                    }
                }
            };
            let (_, v): (u16, Value) = c.put(&format!("/v1/volumes/{uuid}"), &body)?;
            print_volume(&v, fmt)
        }
        VolumeCmd::Ls => {
            let v: Value = conn.client()?.get("/v1/volumes")?;
            if fmt == Format::Json {
                return print_json(&v);
            }
            let volumes: Vec<VolumeOut> = typed("/v1/volumes", &v)?;
            let local = attach::local_volumes();
            let mut t = table(&[
                "NAME",
                "UUID",
                "SIZE",
                "LAYOUT",
                "PROVISIONING",
                "STATUS",
                "POOL",
                "ATTACHED",
                "DEVICE",
            ]);
            for x in &volumes {
                let device = local
                    .iter()
                    .find(|r| r.uuid == x.uuid)
                    .and_then(|r| r.device.as_ref())
                    .map_or_else(|| "-".to_owned(), |d| d.display().to_string());
                t.add_row([
                    x.name.clone(),
                    x.uuid.to_string(),
                    format_iec(x.size_bytes),
                    layout_text(&x.layout),
                    provisioning_cell(x),
                    x.status_text(),
                    x.pool.clone().unwrap_or_else(|| "-".into()),
                    if x.attachments.is_empty() {
                        "-".into()
                    } else {
                        x.attachments.len().to_string()
                    },
                    device,
                ]);
            }
            println!("{t}");
            Ok(())
        }
        VolumeCmd::Info { volume } => {
            let c = conn.client()?;
            let (uuid, mut v) = resolve(&c, &volume)?;
            // Served by its targets to stock hosts (404: it is not).
            if let Ok(served) = c.get::<Value>(&format!("/v1/volumes/{uuid}/exports")) {
                v["served"] = served;
            }
            print_volume(&v, fmt)
        }
        VolumeCmd::Verify { volume, rate } => {
            let c = conn.client()?;
            let (uuid, _) = resolve(&c, &volume)?;
            let opts = crate::verify::VerifyOptions {
                rate_bytes_per_sec: rate,
                ..crate::verify::VerifyOptions::default()
            };
            let report = crate::verify::verify(&c, &uuid, &opts)?;
            if fmt == Format::Json {
                print_json(&serde_json::to_value(&report)?)?;
            } else {
                if !report.differences.is_empty() {
                    let mut t = table(&["ROW", "MEMBER", "EXTENTS", "REGION", "OFFSET", "LENGTH"]);
                    for d in &report.differences {
                        t.add_row([
                            d.row.to_string(),
                            d.member.to_string(),
                            d.extents
                                .iter()
                                .map(u32::to_string)
                                .collect::<Vec<_>>()
                                .join(","),
                            d.region.to_string(),
                            format_iec(d.offset),
                            format_iec(d.length),
                        ]);
                    }
                    println!("{t}");
                }
                println!(
                    "{} copies compared, {} read, {} rows without two copies in sync, {} regions differ",
                    report.copies_compared,
                    format_iec(report.bytes_read),
                    report.groups_skipped,
                    report.differences.len()
                );
            }
            if report.differences.is_empty() {
                Ok(())
            } else {
                anyhow::bail!(
                    "{} regions of {volume} differ between copies",
                    report.differences.len()
                )
            }
        }
        VolumeCmd::Resync {
            volume,
            extent,
            wait,
        } => {
            let c = conn.client()?;
            let (uuid, _) = resolve(&c, &volume)?;
            let v: Value = c.post(
                &format!("/v1/volumes/{uuid}/extents/{extent}/resync"),
                &serde_json::json!({}),
            )?;
            if wait {
                wait_in_sync(&c, &uuid, extent)?;
                let v: Value = c.get(&format!("/v1/volumes/{uuid}"))?;
                return print_volume(&v, fmt);
            }
            print_volume(&v, fmt)
        }
        VolumeCmd::History { volume } => {
            let c = conn.client()?;
            let (uuid, _) = resolve(&c, &volume)?;
            let v: Value = c.get(&format!("/v1/volumes/{uuid}/history"))?;
            if fmt == Format::Json {
                return print_json(&v);
            }
            let rows: Vec<CopyHistoryOut> = typed("history", &v)?;
            let mut t = table(&[
                "ID", "EXTENT", "FROM", "KIND", "TO", "RESULT", "COPIED", "OF", "STARTED", "TOOK",
                "RATE", "ERROR",
            ]);
            for r in &rows {
                let took = r.finished_ms.map_or_else(
                    || "-".to_owned(),
                    |f| format!("{:.1}s", f.saturating_sub(r.started_ms) as f64 / 1000.0),
                );
                t.add_row([
                    r.id.to_string(),
                    r.extent.to_string(),
                    r.source.to_string(),
                    r.kind.clone(),
                    r.to.clone().unwrap_or_else(|| "-".into()),
                    r.result.clone(),
                    format_iec(r.bytes_copied),
                    format_iec(r.bytes_total),
                    age(r.started_ms),
                    took,
                    copy_rate(r).map_or_else(|| "-".into(), |b| format!("{}/s", format_iec(b))),
                    r.error.clone().unwrap_or_else(|| "-".into()),
                ]);
            }
            println!("{t}");
            Ok(())
        }
        VolumeCmd::Resize { volume, size } => {
            check_size(size)?;
            let c = conn.client()?;
            let (uuid, _) = resolve(&c, &volume)?;
            let v: Value = c.post(
                &format!("/v1/volumes/{uuid}/resize"),
                &ResizeBody { size_bytes: size },
            )?;
            print_volume(&v, fmt)
        }
        VolumeCmd::Delete { volume, force } => {
            let c = conn.client()?;
            let (uuid, v) = resolve(&c, &volume)?;
            let q = if force { "?force=true" } else { "" };
            c.delete(&format!("/v1/volumes/{uuid}{q}"))
                .map_err(|e| attached_hint(e, "delete --force"))?;
            let name = v["name"].as_str().unwrap_or(&volume).to_owned();
            done(
                fmt,
                serde_json::json!({ "volume": uuid, "name": name, "deleted": true }),
                format!("volume {name} ({uuid}) deleted"),
            )
        }
        VolumeCmd::Attach {
            volume,
            host_nqn: h,
            frontend,
            plan_only,
        } => {
            let host = host_nqn(h)?;
            // Say at once when the front-end cannot work here, before
            // anything is exported.
            let frontend = if plan_only {
                frontend
            } else {
                attach::frontend_choice(frontend)?
            };
            let c = conn.client()?;
            let (uuid, v) = resolve(&c, &volume)?;
            let progress = std::io::stderr().is_terminal();
            if frontend == Frontend::Nvme && !plan_only {
                return attach_nvme(&c, fmt, &uuid, &v, &volume, &host, progress);
            }
            if progress {
                let n = v["extents"].as_array().map_or(0, Vec::len);
                eprintln!("attaching {volume} to {host}: exporting {n} extents…");
            }
            let (status, out): (u16, Value) = c.put_empty(&attachment_path(&uuid, &host))?;
            let a: AttachmentOut = typed("attachment", &out)?;
            a.plan.validate().map_err(|e| {
                anyhow::anyhow!("the control plane sent an unusable connection plan: {e}")
            })?;
            if plan_only {
                if progress {
                    eprintln!(
                        "{}",
                        if status == 201 {
                            "attached"
                        } else {
                            "already attached"
                        }
                    );
                }
                if fmt == Format::Json {
                    return print_json(&out);
                }
                print_plan(&a);
                return Ok(());
            }
            let token_file = conn.token_file.as_deref();
            let served =
                attach::serve(&conn.endpoint, token_file, &uuid, &host, frontend, progress);
            let served = match served {
                Ok(s) => s,
                Err(e) => {
                    // Take back an attachment this call made: nothing half-done.
                    if status == 201 {
                        let _ = c.delete(&attachment_path(&uuid, &host));
                    }
                    return Err(e);
                }
            };
            let name = v["name"].as_str().unwrap_or(&volume).to_owned();
            let device = served.volume.device.unwrap_or_default();
            done(
                fmt,
                serde_json::json!({
                    "volume": uuid, "name": name, "host_nqn": host,
                    "device": device, "frontend": served.volume.frontend, "pid": served.volume.pid,
                    "already_attached": !served.started,
                }),
                device.display().to_string(),
            )
        }
        VolumeCmd::Export {
            volume,
            host_nqn,
            paths,
        } => {
            if !(1..=nvpool_api::names::PATHS_MAX).contains(&paths) {
                return Err(Usage(format!(
                    "--paths must be between 1 and {}",
                    nvpool_api::names::PATHS_MAX
                ))
                .into());
            }
            let c = conn.client()?;
            let (uuid, v) = resolve(&c, &volume)?;
            let (status, out): (u16, Value) = c.put(
                &export_path(&uuid, &host_nqn),
                &ExportBody { paths: Some(paths) },
            )?;
            let view: ServedView = typed("served volume", &out)?;
            let name = v["name"].as_str().unwrap_or(&volume).to_owned();
            let cmds = nvmef::commands(&view, &host_nqn);
            let mut text = format!(
                "volume {name} {} to {host_nqn} as {} ({} paths; owner {})\n\non the host:\n",
                if status == 201 {
                    "exported"
                } else {
                    "already exported"
                },
                view.subsystem_nqn,
                view.paths.len(),
                view.owner.as_deref().unwrap_or("none yet"),
            );
            for c in &cmds {
                text.push_str(&format!("  {c}\n"));
            }
            text.push_str("then: nvme list-subsys (one path optimized, the others inaccessible)");
            let mut json = out.clone();
            json["commands"] = serde_json::json!(cmds);
            done(fmt, json, text)
        }
        VolumeCmd::Unexport { volume, host_nqn } => {
            let c = conn.client()?;
            let (uuid, v) = resolve(&c, &volume)?;
            c.delete(&export_path(&uuid, &host_nqn))?;
            let name = v["name"].as_str().unwrap_or(&volume).to_owned();
            done(
                fmt,
                serde_json::json!({ "volume": uuid, "name": name, "host_nqn": host_nqn,
                    "unexported": true }),
                format!("volume {name} no longer exported to {host_nqn}"),
            )
        }
        VolumeCmd::Detach {
            volume,
            host_nqn: h,
            force,
        } => {
            let host = host_nqn(h)?;
            let c = conn.client()?;
            let (uuid, v) = resolve(&c, &volume)?;
            if let Some(out) = detach_nvme(&c, &uuid, &v, &volume, &host, force)? {
                return done(fmt, out.0, out.1);
            }
            // The local block device first (flushes); then the targets.
            let local = attach::stop(&uuid, force)?;
            let q = if force { "?force=true" } else { "" };
            match c.delete(&format!("{}{q}", attachment_path(&uuid, &host))) {
                // The attachment was already gone: the local side was
                // all there was to undo.
                Err(e) if local.is_some() && e.status() == Some(404) => {}
                r => r?,
            }
            let name = v["name"].as_str().unwrap_or(&volume).to_owned();
            let device = local
                .as_ref()
                .and_then(|r| r.device.as_ref())
                .map(|d| d.display().to_string());
            done(
                fmt,
                serde_json::json!({ "volume": uuid, "name": name, "host_nqn": host,
                    "detached": true, "device": device }),
                match device {
                    Some(d) => format!("volume {name} detached ({d} removed)"),
                    None => format!("volume {name} detached from {host}"),
                },
            )
        }
    }
}

fn export_path(uuid: &Uuid, host: &str) -> String {
    format!("/v1/volumes/{uuid}/exports/{}", segment(host))
}

/// `attach --frontend nvme`: the targets serve the volume to this host,
/// whose kernel connects every path.
fn attach_nvme(
    c: &Client,
    fmt: Format,
    uuid: &Uuid,
    v: &Value,
    volume: &str,
    host: &str,
    progress: bool,
) -> anyhow::Result<()> {
    if progress {
        eprintln!("serving {volume} to {host} through its targets…");
    }
    let (status, out): (u16, Value) = c.put_empty(&export_path(uuid, host))?;
    let view: ServedView = typed("served volume", &out)?;
    let device = match nvmef::connect(&view, host) {
        Ok(d) => d,
        Err(e) => {
            // Take back an export this call made: nothing half-done.
            if status == 201 {
                let _ = c.delete(&export_path(uuid, host));
            }
            return Err(e);
        }
    };
    let name = v["name"].as_str().unwrap_or(volume).to_owned();
    done(
        fmt,
        serde_json::json!({
            "volume": uuid, "name": name, "host_nqn": host, "device": device,
            "frontend": Frontend::Nvme, "subsystem_nqn": view.subsystem_nqn,
            "paths": out["paths"], "already_attached": status != 201,
        }),
        device.display().to_string(),
    )
}

/// `detach` of a volume this host connected with `--frontend nvme`: its
/// controllers are disconnected, then the export is removed. `None` when
/// this host has no such connection (another front-end, or none).
fn detach_nvme(
    c: &Client,
    uuid: &Uuid,
    v: &Value,
    volume: &str,
    host: &str,
    force: bool,
) -> anyhow::Result<Option<(Value, String)>> {
    let nqn = format!("{}{uuid}", nvpool_api::names::VOLUME_SUBSYSTEM_PREFIX);
    let Some(device) = nvmef::device_of(&nqn) else {
        return Ok(None);
    };
    if let Some(at) = attach::mounted_at(&device) {
        if !force {
            anyhow::bail!(
                "{} is mounted at {at}; unmount it first (or detach --force)",
                device.display()
            );
        }
    }
    let n = nvmef::disconnect(&nqn)?;
    match c.delete(&export_path(uuid, host)) {
        Err(e) if e.status() == Some(404) => {}
        r => r?,
    }
    let name = v["name"].as_str().unwrap_or(volume).to_owned();
    Ok(Some((
        serde_json::json!({ "volume": uuid, "name": name, "host_nqn": host,
            "detached": true, "device": device, "paths_disconnected": n }),
        format!(
            "volume {name} detached ({} removed, {n} paths disconnected)",
            device.display()
        ),
    )))
}

/// Adds what to do when the control plane refuses because the volume is
/// attached.
fn attached_hint(e: ClientError, fix: &str) -> ClientError {
    match e {
        ClientError::Api {
            status,
            kind,
            message,
            details,
            hint,
        } if kind == "attached" && hint.is_empty() => ClientError::Api {
            status,
            hint: format!(" (detach it first, or use volume {fix})"),
            kind,
            message,
            details,
        },
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_states_say_what_a_copy_does() {
        let job = |extent: u32, kind: &str, state: &str, to: Option<&str>| {
            serde_json::json!({"id": 1, "extent": extent, "source": 0, "kind": kind,
                "state": state, "started_ms": 0, "bytes_total": 100, "bytes_copied": 42, "rate_bytes_per_sec": 1 << 20,
                "eta_s": 3, "to": to})
        };
        let v: VolumeOut = serde_json::from_value(serde_json::json!({
            "uuid": "6d1c7f3e-2a4b-4c8d-9e0f-1a2b3c4d5e6f", "name": "v", "size_bytes": 1,
            "layout": {"type": "raid1", "copies": 2}, "status": "degraded",
            "extent_bytes": 1, "created_ms": 0, "extents": [], "attachments": [],
            "failed_extents": [1, 3, 5],
            "copy_jobs": [
                job(1, "resync-partial", "copying", None),
                job(2, "move", "copying", Some("t4/d0")),
                job(3, "replace", "switching", Some("t2/d0")),
                job(5, "resync-full", "mirroring", None),
            ],
        }))
        .unwrap();
        assert_eq!(v.extent_state(0), "ok");
        assert_eq!(
            v.extent_state(1),
            "syncing 42% (resync-partial, 1.0 MiB/s, ETA 3s)"
        );
        assert_eq!(
            v.extent_state(2),
            "ok, move to t4/d0 42% (move, 1.0 MiB/s, ETA 3s)"
        );
        assert_eq!(v.extent_state(3), "stale, replace to t2/d0 (switching)");
        assert_eq!(v.extent_state(4), "ok");
        assert_eq!(v.extent_state(5), "syncing (resync-full: mirroring)");
    }

    fn args(layout: LayoutArg) -> CreateArgs {
        CreateArgs {
            name: "v".into(),
            size: Some(1 << 30),
            from: None,
            from_volume: None,
            layout,
            stripe_width: None,
            stripe_size: None,
            copies: None,
            pool: None,
            thin: false,
            thick: false,
            read_only: false,
            uuid: None,
        }
    }

    #[test]
    fn thin_and_thick_are_asked_for_or_left_to_the_control_plane() {
        use crate::Cli;
        use clap::Parser;
        let create = |flags: &[&str]| {
            let argv = ["nvpool", "volume", "create", "v", "--size", "1G"];
            Cli::try_parse_from(argv.iter().chain(flags))
        };
        for (flags, want) in [
            (&[][..], None),
            (&["--thin"][..], Some(Provisioning::Thin)),
            (&["--thick"][..], Some(Provisioning::Thick)),
        ] {
            let cli = create(flags).unwrap();
            let crate::Command::Volume(VolumeArgs {
                cmd: VolumeCmd::Create(a),
                ..
            }) = cli.cmd
            else {
                panic!("{flags:?} is no volume create");
            };
            assert_eq!(provisioning_of(&a), want, "{flags:?}");
        }
        assert!(create(&["--thin", "--thick"]).is_err());
    }

    #[test]
    fn a_clone_takes_its_size_and_layout_from_the_snapshot() {
        use crate::Cli;
        use clap::Parser;
        let create = |flags: &[&str]| {
            let argv = ["nvpool", "volume", "create", "job-1"];
            Cli::try_parse_from(argv.iter().chain(flags))
        };
        let Ok(Cli {
            cmd:
                crate::Command::Volume(VolumeArgs {
                    cmd: VolumeCmd::Create(a),
                    ..
                }),
            ..
        }) = create(&["--from", "data@epoch-3"])
        else {
            panic!("--from alone is a volume create");
        };
        let from = a.from.unwrap();
        assert_eq!((&*from.volume, &*from.snapshot), ("data", "epoch-3"));
        assert!(create(&[]).is_err(), "neither --size nor --from");
        for extra in [
            &["--size", "1G"][..],
            &["--layout", "raid1"],
            &["--thick"],
            &["--pool", "p"],
        ] {
            let argv: Vec<&str> = ["--from", "data@s"].iter().chain(extra).copied().collect();
            assert!(create(&argv).is_err(), "{extra:?} with --from");
        }
        assert!(create(&["--from", "data"]).is_err(), "no @");
    }

    #[test]
    fn a_clone_names_its_snapshot_or_its_volume() {
        use crate::Cli;
        use clap::Parser;
        let create = |flags: &[&str]| -> Result<CreateArgs, clap::Error> {
            let argv = ["nvpool", "volume", "create", "job-1"];
            match Cli::try_parse_from(argv.iter().chain(flags))?.cmd {
                crate::Command::Volume(VolumeArgs {
                    cmd: VolumeCmd::Create(a),
                    ..
                }) => Ok(a),
                _ => panic!("{flags:?} is no volume create"),
            }
        };
        let a = create(&["--from-snapshot", "data@epoch-3"]).unwrap();
        let from = a.from.unwrap();
        assert_eq!((&*from.volume, &*from.snapshot), ("data", "epoch-3"));
        let a = create(&["--from-volume", "data"]).unwrap();
        assert_eq!(a.from_volume.as_deref(), Some("data"));
        assert_eq!(a.from, None);
        assert_eq!(implicit_snapshot(&a.name), "clone-job-1");
        for bad in [
            &["--from-volume", "data", "--from", "data@s"][..],
            &["--from-volume", "data", "--from-snapshot", "data@s"],
            &["--from-volume", "data", "--size", "1G"],
            &["--from-volume", "data", "--layout", "raid1"],
            &["--from-volume", "data", "--thin"],
            &["--from-volume", "data", "--pool", "p"],
            &["--from-snapshot", "data@s", "--size", "1G"],
            &["--from-volume"],
        ] {
            assert!(create(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn layouts_get_defaults_and_reject_foreign_flags() {
        assert_eq!(
            layout_of(&args(LayoutArg::Concat)).unwrap(),
            LayoutBody::Concat {}
        );
        assert_eq!(
            layout_of(&args(LayoutArg::Raid10)).unwrap(),
            LayoutBody::Raid10 {
                stripe_bytes: 64 << 10,
                width: 2,
                copies: 2
            }
        );
        let mut a = args(LayoutArg::Raid0);
        a.copies = Some(2);
        assert!(layout_of(&a).is_err());
        let mut a = args(LayoutArg::Raid1);
        a.stripe_width = Some(4);
        assert!(layout_of(&a).is_err());
        let mut a = args(LayoutArg::Raid0);
        a.stripe_size = Some(3000);
        assert!(layout_of(&a).is_err());
        let mut a = args(LayoutArg::Raid1);
        a.copies = Some(9);
        assert!(layout_of(&a).is_err());
    }

    #[test]
    fn layout_texts() {
        assert_eq!(
            layout_text(&LayoutBody::Raid10 {
                stripe_bytes: 64 << 10,
                width: 4,
                copies: 2
            }),
            "raid10 w=4 s=64K c=2"
        );
        assert_eq!(layout_text(&LayoutBody::Raid1 { copies: 3 }), "raid1 c=3");
    }

    #[test]
    fn random_uuids_are_v4() {
        let a = random_uuid().unwrap();
        let b = random_uuid().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.as_bytes()[6] >> 4, 4);
        assert_eq!(a.as_bytes()[8] >> 6, 2);
    }
}
