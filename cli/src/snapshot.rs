//! `nvpool snapshot …`: take, list, show and delete crash-consistent
//! snapshots of thin volumes (design/thin-snapshots.md T5), named
//! `VOLUME@SNAPSHOT` like `rbd` and `zfs` name theirs. A snapshot is read
//! by cloning it: `nvpool volume create NAME --from VOLUME@SNAPSHOT`.

use crate::client::{segment, Client};
use crate::cluster::{age, print_fields, print_json, table, typed, Connection, OutputArgs};
use crate::size::format_iec;
use crate::volume::resolve;
use crate::Format;
use nvpool_api::rest::{SnapshotBody, SnapshotOut, VolumeOut};
use nvpool_layout::Uuid;
use serde_json::Value;

/// `VOLUME@SNAPSHOT`, split (volume and snapshot names cannot hold `@`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotName {
    pub volume: String,
    pub snapshot: String,
}

/// Parses `VOLUME@SNAPSHOT` (for clap: a bad one is a usage error).
pub fn parse_snapshot_name(s: &str) -> Result<SnapshotName, String> {
    match s.split_once('@') {
        Some((v, n)) if !v.is_empty() && !n.is_empty() && !n.contains('@') => Ok(SnapshotName {
            volume: v.to_owned(),
            snapshot: n.to_owned(),
        }),
        _ => Err(format!("expected VOLUME@SNAPSHOT, got {s:?}")),
    }
}

#[derive(Debug, clap::Args)]
pub struct SnapshotArgs {
    #[command(flatten)]
    pub out: OutputArgs,
    #[command(subcommand)]
    pub cmd: SnapshotCmd,
}

#[derive(Debug, clap::Subcommand)]
pub enum SnapshotCmd {
    /// Take a snapshot of a thin volume: crash-consistent across every
    /// extent and copy, whatever the size, without pausing its writers.
    /// Taking it again under the same name shows the existing one.
    Create {
        /// VOLUME@SNAPSHOT (the volume by name or UUID).
        #[arg(value_parser = parse_snapshot_name)]
        snapshot: SnapshotName,
    },
    /// List a volume's snapshots (every volume's without one).
    #[command(visible_alias = "list")]
    Ls {
        /// Volume name or UUID.
        volume: Option<String>,
    },
    /// Show a snapshot.
    Info {
        /// VOLUME@SNAPSHOT.
        #[arg(value_parser = parse_snapshot_name)]
        snapshot: SnapshotName,
    },
    /// Delete a snapshot; its space comes back as its targets release it.
    /// Clones made from it keep their data.
    #[command(visible_alias = "delete")]
    Rm {
        /// VOLUME@SNAPSHOT.
        #[arg(value_parser = parse_snapshot_name)]
        snapshot: SnapshotName,
    },
}

fn snapshots_path(volume: &Uuid) -> String {
    format!("/v1/volumes/{volume}/snapshots")
}

fn snapshot_path(volume: &Uuid, name: &str) -> String {
    format!("{}/{}", snapshots_path(volume), segment(name))
}

/// The snapshot `name` names, with its volume's UUID.
pub fn get(c: &Client, name: &SnapshotName) -> anyhow::Result<(Uuid, Value)> {
    let (uuid, _) = resolve(c, &name.volume)?;
    let v: Value = c.get(&snapshot_path(&uuid, &name.snapshot))?;
    Ok((uuid, v))
}

fn print_snapshot(v: &Value, volume_name: &str, fmt: Format) -> anyhow::Result<()> {
    if fmt == Format::Json {
        return print_json(v);
    }
    let s: SnapshotOut = typed("snapshot", v)?;
    print_fields(&[
        ("Snapshot", format!("{volume_name}@{}", s.name)),
        ("Volume", s.volume.to_string()),
        ("State", state_name(&s).into()),
        ("Epoch", s.epoch.to_string()),
        ("Size", format_iec(s.size_bytes)),
        ("Created", age(s.created_ms)),
    ]);
    Ok(())
}

fn state_name(s: &SnapshotOut) -> &'static str {
    match s.state {
        nvpool_api::rest::SnapshotState::Creating => "creating",
        nvpool_api::rest::SnapshotState::Ready => "ready",
    }
}

pub fn run(conn: &Connection, a: SnapshotArgs) -> anyhow::Result<()> {
    let fmt = a.out.output;
    let c = conn.client()?;
    match a.cmd {
        SnapshotCmd::Create { snapshot } => {
            let (uuid, v) = resolve(&c, &snapshot.volume)?;
            let body = SnapshotBody {
                name: snapshot.snapshot,
            };
            let s: Value = c.post(&snapshots_path(&uuid), &body)?;
            print_snapshot(&s, v["name"].as_str().unwrap_or(&snapshot.volume), fmt)
        }
        SnapshotCmd::Info { snapshot } => {
            let (uuid, v) = resolve(&c, &snapshot.volume)?;
            let s: Value = c.get(&snapshot_path(&uuid, &snapshot.snapshot))?;
            print_snapshot(&s, v["name"].as_str().unwrap_or(&snapshot.volume), fmt)
        }
        SnapshotCmd::Rm { snapshot } => {
            let (uuid, v) = resolve(&c, &snapshot.volume)?;
            c.delete(&snapshot_path(&uuid, &snapshot.snapshot))?;
            let name = format!(
                "{}@{}",
                v["name"].as_str().unwrap_or(&snapshot.volume),
                snapshot.snapshot
            );
            match fmt {
                Format::Json => print_json(&serde_json::json!({
                    "volume": uuid, "snapshot": snapshot.snapshot, "deleted": true,
                })),
                Format::Table => {
                    println!("snapshot {name} deleted");
                    Ok(())
                }
            }
        }
        SnapshotCmd::Ls { volume } => {
            let volumes: Vec<(Uuid, String)> = match volume {
                Some(v) => {
                    let (uuid, v) = resolve(&c, &v)?;
                    let out: VolumeOut = typed("volume", &v)?;
                    vec![(uuid, out.name)]
                }
                None => {
                    let all: Value = c.get("/v1/volumes")?;
                    let all: Vec<VolumeOut> = typed("/v1/volumes", &all)?;
                    all.into_iter().map(|v| (v.uuid, v.name)).collect()
                }
            };
            let mut rows = Vec::new();
            for (uuid, name) in volumes {
                let list: Value = c.get(&snapshots_path(&uuid))?;
                let list: Vec<SnapshotOut> = typed("snapshots", &list)?;
                rows.extend(list.into_iter().map(|s| (name.clone(), s)));
            }
            if fmt == Format::Json {
                let all: Vec<&SnapshotOut> = rows.iter().map(|(_, s)| s).collect();
                return print_json(&serde_json::to_value(all)?);
            }
            let mut t = table(&["SNAPSHOT", "STATE", "EPOCH", "SIZE", "CREATED"]);
            for (volume, s) in &rows {
                t.add_row([
                    format!("{volume}@{}", s.name),
                    state_name(s).into(),
                    s.epoch.to_string(),
                    format_iec(s.size_bytes),
                    age(s.created_ms),
                ]);
            }
            println!("{t}");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_is_named_volume_at_name() {
        assert_eq!(
            parse_snapshot_name("data@epoch-3"),
            Ok(SnapshotName {
                volume: "data".into(),
                snapshot: "epoch-3".into()
            })
        );
        for bad in ["data", "@s", "data@", "a@b@c", ""] {
            assert!(parse_snapshot_name(bad).is_err(), "{bad}");
        }
    }
}
