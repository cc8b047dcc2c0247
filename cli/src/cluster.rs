//! `nvpool target …` and `nvpool pool …`, and what every control-plane
//! command shares: the connection options, the decoding of answers into
//! `nvpool_api::rest`'s bodies, and table helpers.
//!
//! Table output is for people (IEC sizes, one row per object); `-o json`
//! prints the control plane's JSON exactly as it answered, so scripts see
//! every field, including ones this CLI does not know yet.

use crate::client::{segment, Client, ClientError};
use crate::size::format_iec;
use crate::{Format, Usage};
use comfy_table::Table;
use nvpool_api::rest::{
    CapacityOut, DeviceRefBody, HostKeysBody, HostKeysOut, KeyRollout, PoolBody, PoolOut,
    RebalanceBody, RebalanceOut, TargetOut, TargetState, TargetStateBody,
};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Where the control plane is and how to authenticate; from the global
/// `--endpoint`, `--token-file` and `--cacert` options.
#[derive(Debug, Clone)]
pub struct Connection {
    pub endpoint: String,
    pub token_file: Option<PathBuf>,
    pub cacert: Option<PathBuf>,
}

impl Connection {
    /// A client with the token file's token, when there is one: every
    /// call carries it (reads need a reader token at least).
    pub fn client(&self) -> Result<Client, ClientError> {
        let token = match &self.token_file {
            Some(p) => Some(crate::client::read_token(p)?),
            None => None,
        };
        Client::with_cacert(&self.endpoint, token, self.cacert.as_deref())
    }
}

/// `-o table|json` for the control-plane commands.
#[derive(Debug, Clone, clap::Args)]
pub struct OutputArgs {
    /// Output format.
    #[arg(short = 'o', long = "output-format", alias = "output", global = true, value_enum, default_value_t = Format::Table)]
    pub output: Format,
}

/// Decodes a JSON answer into its `nvpool_api::rest` type.
pub fn typed<T: DeserializeOwned>(what: &'static str, v: &Value) -> Result<T, ClientError> {
    serde_json::from_value(v.clone()).map_err(|e| ClientError::Protocol {
        method: "GET",
        path: what.to_owned(),
        reason: e.to_string(),
    })
}

// ----- output helpers -----

pub fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(comfy_table::presets::NOTHING);
    t.set_header(header.iter().copied());
    t
}

pub fn print_json(v: &Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// `k=v,k=v`, or `-`.
pub fn labels(l: &BTreeMap<String, String>) -> String {
    if l.is_empty() {
        return "-".into();
    }
    l.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// Aligned `key: value` lines above a detail table.
pub fn print_fields(fields: &[(&str, String)]) {
    let w = fields.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in fields {
        println!("{:<w$}  {v}", format!("{k}:"), w = w + 1);
    }
}

/// Milliseconds since the Unix epoch as an age: `3s ago`, `2h ago`.
pub fn age(ms: u64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let s = now.saturating_sub(ms) / 1000;
    match s {
        0..=119 => format!("{s}s ago"),
        120..=7199 => format!("{}m ago", s / 60),
        7200..=172_799 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86400),
    }
}

/// A span of seconds for people: `45s`, `12m`, `3h`.
pub fn span(s: u64) -> String {
    match s {
        0..=119 => format!("{s}s"),
        120..=7199 => format!("{}m", s.div_ceil(60)),
        _ => format!("{}h", s.div_ceil(3600)),
    }
}

// ----- nvpool target -----

#[derive(Debug, clap::Args)]
pub struct TargetArgs {
    #[command(flatten)]
    pub out: OutputArgs,
    #[command(subcommand)]
    pub cmd: TargetCmd,
}

#[derive(Debug, clap::Subcommand)]
pub enum TargetCmd {
    /// List registered targets with health and capacity.
    #[command(visible_alias = "list")]
    Ls,
    /// Show one target and its devices.
    Info {
        /// Target ID.
        id: String,
    },
    /// Move every extent off a target, online (it serves each until its
    /// move is done); `target ls` shows it `draining`, then `drained`.
    Drain {
        /// Target ID.
        id: String,
        /// Wait until it holds nothing, with a progress bar on a terminal.
        #[arg(long)]
        wait: bool,
    },
    /// Stop placing new extents on a target (it keeps what it holds).
    Cordon {
        /// Target ID.
        id: String,
    },
    /// Take new extents again (ends a cordon or a drain).
    Activate {
        /// Target ID.
        id: String,
    },
    /// Forget a target that holds nothing (drain it first).
    #[command(visible_alias = "remove")]
    Rm {
        /// Target ID.
        id: String,
        /// The target is gone for good: forget the old extents it may
        /// still export instead of waiting to reconcile it.
        #[arg(long)]
        force: bool,
    },
}

/// `STATE` as `target ls` shows it.
fn state_text(x: &TargetOut) -> String {
    if x.drained {
        "drained".into()
    } else {
        x.state.name().into()
    }
}

/// The NVMe/RDMA listener, or `-`.
fn rdma_text(x: &TargetOut) -> String {
    x.rdma_addr.map_or_else(|| "-".into(), |a| a.to_string())
}

fn set_state(c: &Client, id: &str, state: TargetState) -> anyhow::Result<Value> {
    let path = format!("/v1/targets/{}/state", segment(id));
    let (_, v): (u16, Value) = c.put(&path, &TargetStateBody { state })?;
    Ok(v)
}

/// Waits until target `id` holds nothing, showing the bytes left.
fn wait_drained(c: &Client, id: &str) -> anyhow::Result<()> {
    let path = format!("/v1/targets/{}", segment(id));
    let first: TargetOut = typed("target", &c.get(&path)?)?;
    let total = first.capacity.used_bytes;
    let bar = crate::dataset::bar(
        total,
        &format!("drain {id}"),
        "  {prefix} [{bar:30}] {bytes}/{total_bytes} moved  eta {eta}  {msg}",
    );
    loop {
        let x: TargetOut = typed("target", &c.get(&path)?)?;
        if x.state != TargetState::Draining {
            bar.abandon_with_message(format!("stopped: the target is {}", x.state.name()));
            anyhow::bail!("target {id} is {} now, not draining", x.state.name());
        }
        bar.set_position(total.saturating_sub(x.capacity.used_bytes));
        if x.drained {
            bar.finish_with_message("drained");
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
}

/// `nvpool target ls`: an RDMA column only when some target has an
/// NVMe/RDMA listener.
fn targets_table(targets: &[TargetOut]) -> Table {
    let rdma = targets.iter().any(|x| x.rdma_addr.is_some());
    let mut header = vec!["ID", "NAME", "ADDR"];
    if rdma {
        header.push("RDMA");
    }
    header.extend([
        "HEALTH", "STATE", "DEVICES", "SIZE", "USED", "FREE", "LABELS",
    ]);
    let mut t = table(&header);
    for x in targets {
        let mut row = vec![x.id.clone(), x.name.clone(), x.addr.to_string()];
        if rdma {
            row.push(rdma_text(x));
        }
        row.extend([
            x.health.name().into(),
            state_text(x),
            x.devices.len().to_string(),
            format_iec(x.capacity.total_bytes),
            format_iec(x.capacity.used_bytes),
            format_iec(x.capacity.free_bytes),
            labels(&x.labels),
        ]);
        t.add_row(row);
    }
    t
}

pub fn run_target(conn: &Connection, a: TargetArgs) -> anyhow::Result<()> {
    let c = conn.client()?;
    let fmt = a.out.output;
    match a.cmd {
        TargetCmd::Ls => {
            let v: Value = c.get("/v1/targets")?;
            if fmt == Format::Json {
                return print_json(&v);
            }
            let targets: Vec<TargetOut> = typed("/v1/targets", &v)?;
            println!("{}", targets_table(&targets));
        }
        TargetCmd::Info { id } => {
            let path = format!("/v1/targets/{}", segment(&id));
            let v: Value = c.get(&path)?;
            if fmt == Format::Json {
                return print_json(&v);
            }
            let x: TargetOut = typed("/v1/targets/{id}", &v)?;
            print_fields(&[
                ("ID", x.id.clone()),
                ("Name", x.name.clone()),
                ("Address", x.addr.to_string()),
                ("RDMA address", rdma_text(&x)),
                ("Admin address", x.admin_addr.to_string()),
                (
                    "Admin API",
                    if x.admin_tls { "https" } else { "http" }.into(),
                ),
                ("Health", x.health.name().into()),
                ("State", state_text(&x)),
                ("Labels", labels(&x.labels)),
                ("Last heartbeat", age(x.last_heartbeat_ms)),
                ("Size", format_iec(x.capacity.total_bytes)),
                ("Used", format_iec(x.capacity.used_bytes)),
                ("Free", format_iec(x.capacity.free_bytes)),
            ]);
            println!();
            let mut t = table(&[
                "DEVICE", "BACKEND", "POOL", "SIZE", "USED", "FREE", "LABELS",
            ]);
            for d in &x.devices {
                t.add_row([
                    d.id.clone(),
                    d.backend.clone(),
                    d.pool.clone().unwrap_or_else(|| "-".into()),
                    format_iec(d.capacity_bytes),
                    format_iec(d.used_bytes),
                    format_iec(d.free_bytes),
                    labels(&d.labels),
                ]);
            }
            println!("{t}");
        }
        TargetCmd::Drain { id, wait } => {
            let mc = conn.client()?;
            let v = set_state(&mc, &id, TargetState::Draining)?;
            if fmt == Format::Json && !wait {
                return print_json(&v);
            }
            let x: TargetOut = typed("target", &v)?;
            if fmt == Format::Table {
                println!(
                    "target {id} draining: {} to move to other targets",
                    format_iec(x.capacity.used_bytes)
                );
            }
            if wait {
                wait_drained(&c, &id)?;
                if fmt == Format::Json {
                    return print_json(&c.get::<Value>(&format!("/v1/targets/{}", segment(&id)))?);
                }
                println!("target {id} drained; remove it with `nvpool target rm {id}`");
            }
        }
        TargetCmd::Cordon { ref id } | TargetCmd::Activate { ref id } => {
            let (state, name) = if matches!(a.cmd, TargetCmd::Cordon { .. }) {
                (TargetState::Cordoned, "cordoned")
            } else {
                (TargetState::Active, "active")
            };
            let v = set_state(&conn.client()?, id, state)?;
            if fmt == Format::Json {
                return print_json(&v);
            }
            println!("target {id} {name}");
        }
        TargetCmd::Rm { id, force } => {
            let q = if force { "?force=true" } else { "" };
            conn.client()?
                .delete(&format!("/v1/targets/{}{q}", segment(&id)))?;
            match fmt {
                Format::Json => {
                    return print_json(&serde_json::json!({ "target": id, "removed": true }))
                }
                Format::Table => println!("target {id} removed"),
            }
        }
    }
    Ok(())
}

// ----- nvpool host -----

#[derive(Debug, clap::Args)]
pub struct HostArgs {
    #[command(flatten)]
    pub out: OutputArgs,
    #[command(subcommand)]
    pub cmd: HostCmd,
}

#[derive(Debug, clap::Subcommand)]
pub enum HostCmd {
    /// Give the control plane a host's DH-HMAC-CHAP secrets: every target
    /// that exports to the host then makes it authenticate with them.
    /// The secrets come from files (or the environment), never arguments.
    SetKeys {
        /// The host's NQN.
        host_nqn: String,
        #[command(flatten)]
        secrets: crate::dhchap::DhchapArgs,
        /// Require this hash: sha256, sha384 or sha512 (default: the
        /// strongest the host offers).
        #[arg(long)]
        hash: Option<String>,
        /// Diffie-Hellman group: null (default), ffdhe2048, ffdhe3072,
        /// ffdhe4096, ffdhe6144 or ffdhe8192.
        #[arg(long)]
        dhgroup: Option<String>,
    },
    /// Show a host's DH-HMAC-CHAP settings (never the secrets).
    Keys {
        /// The host's NQN.
        host_nqn: String,
    },
    /// Forget a host's DH-HMAC-CHAP secrets: it connects without
    /// authenticating again (its controllers reconnect).
    ClearKeys {
        /// The host's NQN.
        host_nqn: String,
    },
}

fn print_rollout(host: &str, r: &KeyRollout) {
    if !r.updated.is_empty() {
        println!("  changed on: {}", r.updated.join(", "));
    }
    for p in &r.pending {
        println!(
            "  pending on {} (reconciliation finishes it): {}",
            p.target, p.error
        );
    }
    if r.updated.is_empty() && r.pending.is_empty() {
        println!("  no target exports to {host} yet");
    }
}

pub fn run_host(conn: &Connection, a: HostArgs) -> anyhow::Result<()> {
    let c = conn.client()?;
    let fmt = a.out.output;
    match a.cmd {
        HostCmd::SetKeys {
            host_nqn,
            secrets,
            hash,
            dhgroup,
        } => {
            let (key, ctrl) = secrets.texts().map_err(|e| Usage(format!("{e:#}")))?;
            let body = HostKeysBody {
                dhchap_key: key.to_string(),
                dhchap_ctrl_key: ctrl.map(|c| c.to_string()),
                dhchap_hash: hash,
                dhchap_dhgroup: dhgroup,
            };
            let path = format!("/v1/hosts/{}/dhchap", segment(&host_nqn));
            let (_, out): (u16, HostKeysOut) = c.put(&path, &body)?;
            if fmt == Format::Json {
                return print_json(&serde_json::to_value(&out)?);
            }
            println!(
                "host {host_nqn}: keys {} set ({})",
                out.key_id,
                if out.bidirectional {
                    "bidirectional"
                } else {
                    "the host authenticates"
                }
            );
            print_rollout(&host_nqn, &out.rollout.unwrap_or_default());
        }
        HostCmd::Keys { host_nqn } => {
            let path = format!("/v1/hosts/{}/dhchap", segment(&host_nqn));
            let out: HostKeysOut = typed("host keys", &c.get(&path)?)?;
            if fmt == Format::Json {
                return print_json(&serde_json::to_value(&out)?);
            }
            println!("host {host_nqn}");
            println!("key id:        {}", out.key_id);
            println!("bidirectional: {}", out.bidirectional);
            println!(
                "hash:          {}",
                out.dhchap_hash.as_deref().unwrap_or("any")
            );
            println!("dh group:      {}", out.dhchap_dhgroup);
        }
        HostCmd::ClearKeys { host_nqn } => {
            let path = format!("/v1/hosts/{}/dhchap", segment(&host_nqn));
            let r: KeyRollout = c.delete_json(&path)?;
            if fmt == Format::Json {
                return print_json(&serde_json::to_value(&r)?);
            }
            println!("host {host_nqn}: keys cleared");
            print_rollout(&host_nqn, &r);
        }
    }
    Ok(())
}

// ----- nvpool pool -----

#[derive(Debug, clap::Args)]
pub struct PoolArgs {
    #[command(flatten)]
    pub out: OutputArgs,
    #[command(subcommand)]
    pub cmd: PoolCmd,
}

#[derive(Debug, clap::Subcommand)]
pub enum PoolCmd {
    /// Create a pool from target devices (idempotent with the same devices).
    Create {
        name: String,
        /// TARGET/DEVICE (repeatable, or a comma-separated list).
        #[arg(long = "device", value_name = "TARGET/DEVICE", value_delimiter = ',', required = true, value_parser = parse_device_ref)]
        devices: Vec<DeviceRefBody>,
    },
    /// List pools and their capacity.
    #[command(visible_alias = "list")]
    Ls,
    /// Show one pool and its devices.
    Info { name: String },
    /// Real capacity, use and provisioned bytes of every pool, of the
    /// devices in none and of all: grain pools' extents take space only
    /// when written, so more may be provisioned than there is (over-commit).
    Df,
    /// Delete a pool no volume uses (its devices return to the unpooled space).
    #[command(visible_alias = "rm")]
    Delete { name: String },
    /// Move extents so every device of the pool is about as full as the
    /// others (new ones included), online; without NAME, every pool and the
    /// devices in none.
    Rebalance {
        /// The pool (default: every pool, and the devices in none).
        name: Option<String>,
        /// Only print what would move.
        #[arg(long)]
        dry_run: bool,
        /// Wait until it is done, with a progress bar on a terminal.
        #[arg(long, conflicts_with = "dry_run")]
        wait: bool,
    },
}

fn print_rebalance(r: &RebalanceOut, dry_run: bool) {
    if r.moves.is_empty() {
        println!("balanced: nothing to move");
        return;
    }
    let mut t = table(&["VOLUME", "EXTENT", "FROM", "TO", "SIZE"]);
    for m in &r.moves {
        t.add_row([
            m.volume_name.clone(),
            m.extent.to_string(),
            m.from.clone(),
            m.to.clone(),
            format_iec(m.bytes),
        ]);
    }
    println!("{t}");
    let eta = match r.eta_s {
        Some(s) => format!("about {}", span(s)),
        None => "as fast as the disks go (unthrottled)".into(),
    };
    println!(
        "{} {} move(s), {}; {eta}",
        if dry_run { "would make" } else { "started:" },
        r.moves.len(),
        format_iec(r.bytes_total),
    );
}

/// Waits until no pool has a rebalance pending, showing the bytes left.
fn wait_rebalanced(c: &Client, total: u64) -> anyhow::Result<()> {
    let bar = crate::dataset::bar(
        total,
        "rebalance",
        "  {prefix} [{bar:30}] {bytes}/{total_bytes} moved  eta {eta}  {msg}",
    );
    loop {
        let r: RebalanceOut = typed("rebalance", &c.get("/v1/rebalance")?)?;
        bar.set_position(total.saturating_sub(r.bytes_total));
        bar.set_message(format!("{} running", r.moves_running));
        if r.pending.is_empty() && r.moves_running == 0 {
            bar.finish_with_message("balanced");
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
}

/// One row of `pool df`: a set of devices' bytes, and how far they are
/// promised (`overcommit`: provisioned / real capacity) and used.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
struct DfRow {
    /// The pool; `null` for the devices in none and for the total.
    pool: Option<String>,
    total_bytes: u64,
    used_bytes: u64,
    free_bytes: u64,
    provisioned_bytes: u64,
    /// `null` without capacity.
    overcommit: Option<f64>,
    used_percent: Option<f64>,
}

impl DfRow {
    fn new(pool: Option<String>, c: &CapacityOut) -> DfRow {
        let ratio = |n: u64| (c.total_bytes > 0).then(|| n as f64 / c.total_bytes as f64);
        DfRow {
            pool,
            total_bytes: c.total_bytes,
            used_bytes: c.used_bytes,
            free_bytes: c.free_bytes,
            provisioned_bytes: c.provisioned_bytes,
            overcommit: ratio(c.provisioned_bytes),
            used_percent: ratio(c.used_bytes).map(|r| r * 100.0),
        }
    }

    fn cells(&self, name: &str) -> [String; 7] {
        [
            name.to_owned(),
            format_iec(self.total_bytes),
            format_iec(self.used_bytes),
            format_iec(self.free_bytes),
            format_iec(self.provisioned_bytes),
            self.overcommit.map_or("-".into(), |r| format!("{r:.2}x")),
            self.used_percent.map_or("-".into(), |p| format!("{p:.0}%")),
        ]
    }
}

fn add_capacity(sum: &mut CapacityOut, c: &CapacityOut) {
    sum.total_bytes = sum.total_bytes.saturating_add(c.total_bytes);
    sum.used_bytes = sum.used_bytes.saturating_add(c.used_bytes);
    sum.free_bytes = sum.free_bytes.saturating_add(c.free_bytes);
    sum.free_extents = sum.free_extents.saturating_add(c.free_extents);
    sum.provisioned_bytes = sum.provisioned_bytes.saturating_add(c.provisioned_bytes);
}

/// `pool df`'s rows: each pool (from `GET /v1/pools`), the devices in none
/// (summed from `GET /v1/targets`), and the total.
fn df_rows(pools: &[PoolOut], targets: &[TargetOut]) -> (Vec<DfRow>, DfRow, DfRow) {
    let mut total = CapacityOut::default();
    let rows = pools
        .iter()
        .map(|p| {
            add_capacity(&mut total, &p.capacity);
            DfRow::new(Some(p.name.clone()), &p.capacity)
        })
        .collect();
    let mut unpooled = CapacityOut::default();
    for d in targets
        .iter()
        .flat_map(|t| &t.devices)
        .filter(|d| d.pool.is_none())
    {
        let c = CapacityOut {
            total_bytes: d.capacity_bytes,
            used_bytes: d.used_bytes,
            free_bytes: d.free_bytes,
            free_extents: 0,
            provisioned_bytes: d.provisioned_bytes,
        };
        add_capacity(&mut unpooled, &c);
    }
    add_capacity(&mut total, &unpooled);
    (rows, DfRow::new(None, &unpooled), DfRow::new(None, &total))
}

fn df_table(rows: &[DfRow], unpooled: &DfRow, total: &DfRow) -> Table {
    let mut t = table(&[
        "POOL",
        "SIZE",
        "USED",
        "FREE",
        "PROVISIONED",
        "OVERCOMMIT",
        "USE%",
    ]);
    for r in rows {
        t.add_row(r.cells(r.pool.as_deref().unwrap_or_default()));
    }
    t.add_row(unpooled.cells("(unpooled)"));
    t.add_row(total.cells("(total)"));
    t
}

fn parse_device_ref(s: &str) -> Result<DeviceRefBody, String> {
    match s.trim().split_once('/') {
        Some((t, d)) if !t.is_empty() && !d.is_empty() && !d.contains('/') => Ok(DeviceRefBody {
            target: t.to_owned(),
            device: d.to_owned(),
        }),
        _ => Err(format!("{s:?} is not TARGET/DEVICE")),
    }
}

fn print_pool(v: &Value, fmt: Format) -> anyhow::Result<()> {
    if fmt == Format::Json {
        return print_json(v);
    }
    let p: PoolOut = typed("pool", v)?;
    print_fields(&[
        ("Name", p.name.clone()),
        ("Devices", p.devices.len().to_string()),
        ("Size", format_iec(p.capacity.total_bytes)),
        ("Used", format_iec(p.capacity.used_bytes)),
        ("Free", format_iec(p.capacity.free_bytes)),
    ]);
    println!();
    let mut t = table(&["TARGET", "DEVICE"]);
    for d in &p.devices {
        t.add_row([d.target.clone(), d.device.clone()]);
    }
    println!("{t}");
    Ok(())
}

pub fn run_pool(conn: &Connection, a: PoolArgs) -> anyhow::Result<()> {
    let fmt = a.out.output;
    match a.cmd {
        PoolCmd::Create { name, devices } => {
            if name.is_empty() {
                return Err(Usage("pool create: the name is empty".into()).into());
            }
            let c = conn.client()?;
            let body = PoolBody { devices };
            let (_, v): (u16, Value) = c.put(&format!("/v1/pools/{}", segment(&name)), &body)?;
            print_pool(&v, fmt)
        }
        PoolCmd::Ls => {
            let v: Value = conn.client()?.get("/v1/pools")?;
            if fmt == Format::Json {
                return print_json(&v);
            }
            let pools: Vec<PoolOut> = typed("/v1/pools", &v)?;
            let mut t = table(&["NAME", "DEVICES", "SIZE", "USED", "FREE"]);
            for p in &pools {
                t.add_row([
                    p.name.clone(),
                    p.devices.len().to_string(),
                    format_iec(p.capacity.total_bytes),
                    format_iec(p.capacity.used_bytes),
                    format_iec(p.capacity.free_bytes),
                ]);
            }
            println!("{t}");
            Ok(())
        }
        PoolCmd::Df => {
            let c = conn.client()?;
            let pools: Vec<PoolOut> = typed("/v1/pools", &c.get("/v1/pools")?)?;
            let targets: Vec<TargetOut> = typed("/v1/targets", &c.get("/v1/targets")?)?;
            let (rows, unpooled, total) = df_rows(&pools, &targets);
            if fmt == Format::Json {
                let v = serde_json::json!({ "pools": rows, "unpooled": unpooled, "total": total });
                return print_json(&v);
            }
            println!("{}", df_table(&rows, &unpooled, &total));
            Ok(())
        }
        PoolCmd::Info { name } => {
            let v: Value = conn
                .client()?
                .get(&format!("/v1/pools/{}", segment(&name)))?;
            print_pool(&v, fmt)
        }
        PoolCmd::Rebalance {
            name,
            dry_run,
            wait,
        } => {
            if name.as_deref() == Some("") {
                return Err(Usage("pool rebalance: the name is empty".into()).into());
            }
            let c = conn.client()?;
            let body = RebalanceBody {
                pool: name,
                dry_run,
            };
            let v: Value = c.post("/v1/rebalance", &body)?;
            if fmt == Format::Json && !wait {
                return print_json(&v);
            }
            let r: RebalanceOut = typed("rebalance", &v)?;
            if fmt == Format::Table {
                print_rebalance(&r, dry_run);
            }
            if wait {
                wait_rebalanced(&c, r.bytes_total)?;
                if fmt == Format::Json {
                    return print_json(&c.get::<Value>("/v1/rebalance")?);
                }
                println!("rebalanced");
            }
            Ok(())
        }
        PoolCmd::Delete { name } => {
            conn.client()?
                .delete(&format!("/v1/pools/{}", segment(&name)))?;
            match fmt {
                Format::Json => print_json(&serde_json::json!({ "pool": name, "deleted": true })),
                Format::Table => {
                    println!("pool {name} deleted");
                    Ok(())
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_refs() {
        assert_eq!(
            parse_device_ref("t1/d0").unwrap(),
            DeviceRefBody {
                target: "t1".into(),
                device: "d0".into()
            }
        );
        for bad in ["t1", "/d0", "t1/", "t1/d0/x"] {
            assert!(parse_device_ref(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn target_table_shows_rdma_only_when_some_target_has_it() {
        let target = |id: &str, rdma: Option<&str>| -> TargetOut {
            serde_json::from_value(serde_json::json!({
                "id": id, "name": id, "addr": "10.0.0.1:4420", "admin_addr": "10.0.0.1:4480",
                "rdma_addr": rdma, "admin_tls": false, "labels": {}, "health": "online",
                "state": "active", "drained": false, "registered_ms": 0, "last_heartbeat_ms": 0,
                "capacity": {"total_bytes": 0, "used_bytes": 0, "free_bytes": 0, "free_extents": 0},
                "devices": [],
            }))
            .unwrap()
        };
        let lines = |t: Table| -> Vec<Vec<String>> {
            t.to_string()
                .lines()
                .map(|l| l.split_whitespace().map(str::to_owned).collect())
                .collect()
        };
        let tcp = lines(targets_table(&[target("t0", None)]));
        assert_eq!(tcp[0][..4], ["ID", "NAME", "ADDR", "HEALTH"]);
        let mixed = lines(targets_table(&[
            target("t0", None),
            target("t1", Some("10.0.0.1:4421")),
        ]));
        assert_eq!(mixed[0][..5], ["ID", "NAME", "ADDR", "RDMA", "HEALTH"]);
        assert_eq!(mixed[1][..5], ["t0", "t0", "10.0.0.1:4420", "-", "online"]);
        assert_eq!(
            mixed[2][..5],
            ["t1", "t1", "10.0.0.1:4420", "10.0.0.1:4421", "online"]
        );
    }

    #[test]
    fn df_sums_pools_and_the_unpooled_devices() {
        let device = |id: &str, pool: Option<&str>, cap: u64, used: u64, prov: u64| {
            serde_json::json!({
                "id": id, "backend": "thin:/x", "labels": {}, "pool": pool,
                "capacity_bytes": cap, "used_bytes": used, "free_bytes": cap - used,
                "thin": true, "provisioned_bytes": prov,
            })
        };
        let target: TargetOut = serde_json::from_value(serde_json::json!({
            "id": "t0", "name": "t0", "addr": "10.0.0.1:4420", "admin_addr": "10.0.0.1:4480",
            "rdma_addr": null, "admin_tls": false, "labels": {}, "health": "online",
            "state": "active", "drained": false, "registered_ms": 0, "last_heartbeat_ms": 0,
            "capacity": {"total_bytes": 0, "used_bytes": 0, "free_bytes": 0, "free_extents": 0},
            "devices": [device("d0", Some("fast"), 100, 90, 400), device("d1", None, 100, 10, 50)],
        }))
        .unwrap();
        let pool: PoolOut = serde_json::from_value(serde_json::json!({
            "name": "fast", "devices": [{"target": "t0", "device": "d0"}], "created_ms": 0,
            "capacity": {"total_bytes": 100, "used_bytes": 90, "free_bytes": 10,
                         "free_extents": 0, "provisioned_bytes": 400},
        }))
        .unwrap();
        let (rows, unpooled, total) = df_rows(&[pool], &[target]);
        assert_eq!(rows[0].overcommit, Some(4.0));
        assert_eq!(rows[0].used_percent, Some(90.0));
        assert_eq!(
            (
                unpooled.total_bytes,
                unpooled.used_bytes,
                unpooled.provisioned_bytes
            ),
            (100, 10, 50)
        );
        assert_eq!(
            (
                total.total_bytes,
                total.used_bytes,
                total.free_bytes,
                total.provisioned_bytes
            ),
            (200, 100, 100, 450)
        );
        let text = df_table(&rows, &unpooled, &total).to_string();
        let cells = |name: &str| -> Vec<String> {
            let line = text
                .lines()
                .find(|l| l.trim_start().starts_with(name))
                .unwrap();
            line.split_whitespace().map(str::to_owned).collect()
        };
        assert_eq!(cells("fast")[9..], ["4.00x", "90%"]);
        assert_eq!(cells("(unpooled)")[9..], ["0.50x", "10%"]);
        assert_eq!(cells("(total)")[9..], ["2.25x", "50%"]);
        let empty = df_rows(&[], &[]).2;
        assert_eq!((empty.overcommit, empty.used_percent), (None, None));
    }

    #[test]
    fn label_lists() {
        assert_eq!(labels(&BTreeMap::new()), "-");
        let l = BTreeMap::from([
            ("rack".to_string(), "r1".to_string()),
            ("host".into(), "h1".into()),
        ]);
        assert_eq!(labels(&l), "host=h1,rack=r1");
    }
}
