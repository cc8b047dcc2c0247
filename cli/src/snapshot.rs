//! `nvpool snapshot …`: take (of one volume, or of several at one cut),
//! list, show, delete and roll back to crash-consistent snapshots of thin
//! volumes (design/thin-snapshots.md T5, T6), named `VOLUME@SNAPSHOT` like
//! `rbd` and `zfs` name theirs. A snapshot is read by cloning it:
//! `nvpool volume create NAME --from-snapshot VOLUME@SNAPSHOT`.

use crate::client::{segment, Client};
use crate::cluster::{age, print_fields, print_json, table, typed, Connection, OutputArgs};
use crate::size::format_iec;
use crate::volume::{print_volume, resolve};
use crate::{Format, Usage};
use nvpool_api::rest::{SnapshotBody, SnapshotGroupBody, SnapshotOut, VolumeOut};
use nvpool_layout::Uuid;
use serde_json::Value;
use std::collections::BTreeMap;

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
    ///
    /// Several VOLUME@SNAPSHOT with one snapshot name take a group: one
    /// snapshot of each volume, all at one cut (a write to one issued
    /// after a write to another completed is in the group only if that
    /// one is), e.g. a training job's data and its checkpoints.
    Create {
        /// VOLUME@SNAPSHOT, one or more (the volumes by name or UUID).
        #[arg(value_parser = parse_snapshot_name, required = true, num_args = 1..)]
        snapshots: Vec<SnapshotName>,
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
    /// Roll a detached volume back to a snapshot: it takes the snapshot's
    /// contents, whatever the size, at once. The snapshot stays, and so do
    /// the others, older and newer. Refused while the volume is attached
    /// or served, being copied, or resized since the snapshot. If a target
    /// fails, the volume cannot be attached until the same command is
    /// repeated and succeeds.
    Rollback {
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

/// The one snapshot name several `VOLUME@SNAPSHOT` share (a group), with
/// no volume named twice.
pub fn group_name(names: &[SnapshotName]) -> Result<&str, Usage> {
    let Some(first) = names.first() else {
        return Err(Usage("expected VOLUME@SNAPSHOT".into()));
    };
    if let Some(other) = names.iter().find(|n| n.snapshot != first.snapshot) {
        return Err(Usage(format!(
            "a group snapshot has one name: {}@{} and {}@{} differ",
            first.volume, first.snapshot, other.volume, other.snapshot
        )));
    }
    for (i, n) in names.iter().enumerate() {
        if names[..i].iter().any(|m| m.volume == n.volume) {
            return Err(Usage(format!("volume {} is given twice", n.volume)));
        }
    }
    Ok(&first.snapshot)
}

/// Volume UUID → name, from one listing (`None`: not listed, or the
/// listing failed: the UUID stands for it).
fn volume_names(c: &Client) -> BTreeMap<Uuid, String> {
    let all: Option<Vec<VolumeOut>> = c
        .get::<Value>("/v1/volumes")
        .ok()
        .and_then(|v| typed("/v1/volumes", &v).ok());
    all.into_iter()
        .flatten()
        .map(|v| (v.uuid, v.name))
        .collect()
}

/// The GROUP of a snapshot: its volumes by name where known, `-` for a
/// snapshot of one volume.
fn group_text(s: &SnapshotOut, names: &BTreeMap<Uuid, String>) -> String {
    if s.group.is_empty() {
        return "-".into();
    }
    let named: Vec<String> = s
        .group
        .iter()
        .map(|u| names.get(u).cloned().unwrap_or_else(|| u.to_string()))
        .collect();
    named.join(",")
}

fn print_snapshot(c: &Client, v: &Value, volume_name: &str, fmt: Format) -> anyhow::Result<()> {
    if fmt == Format::Json {
        return print_json(v);
    }
    let s: SnapshotOut = typed("snapshot", v)?;
    let names = match s.group.is_empty() {
        true => BTreeMap::new(),
        false => volume_names(c),
    };
    print_fields(&[
        ("Snapshot", format!("{volume_name}@{}", s.name)),
        ("Volume", s.volume.to_string()),
        ("State", state_name(&s).into()),
        ("Epoch", s.epoch.to_string()),
        ("Size", format_iec(s.size_bytes)),
        ("Group", group_text(&s, &names)),
        ("Created", age(s.created_ms)),
    ]);
    Ok(())
}

/// A table of snapshots, each with its volume's name.
fn print_snapshots(rows: &[(String, SnapshotOut)], names: &BTreeMap<Uuid, String>) {
    let mut t = table(&["SNAPSHOT", "STATE", "EPOCH", "SIZE", "GROUP", "CREATED"]);
    for (volume, s) in rows {
        t.add_row([
            format!("{volume}@{}", s.name),
            state_name(s).into(),
            s.epoch.to_string(),
            format_iec(s.size_bytes),
            group_text(s, names),
            age(s.created_ms),
        ]);
    }
    println!("{t}");
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
        SnapshotCmd::Create { snapshots } => {
            let name = group_name(&snapshots)?.to_owned();
            if let [snapshot] = &snapshots[..] {
                let (uuid, v) = resolve(&c, &snapshot.volume)?;
                let body = SnapshotBody { name };
                let s: Value = c.post(&snapshots_path(&uuid), &body)?;
                let volume = v["name"].as_str().unwrap_or(&snapshot.volume);
                return print_snapshot(&c, &s, volume, fmt);
            }
            let mut volumes = Vec::with_capacity(snapshots.len());
            for s in &snapshots {
                volumes.push(resolve(&c, &s.volume)?.0);
            }
            let body = SnapshotGroupBody { name, volumes };
            let out: Value = c.post("/v1/snapshot-groups", &body)?;
            if fmt == Format::Json {
                return print_json(&out);
            }
            let out: Vec<SnapshotOut> = typed("snapshot group", &out)?;
            let names = volume_names(&c);
            let rows: Vec<(String, SnapshotOut)> = out
                .into_iter()
                .map(|s| {
                    let volume = names
                        .get(&s.volume)
                        .cloned()
                        .unwrap_or_else(|| s.volume.to_string());
                    (volume, s)
                })
                .collect();
            print_snapshots(&rows, &names);
            Ok(())
        }
        SnapshotCmd::Info { snapshot } => {
            let (uuid, v) = resolve(&c, &snapshot.volume)?;
            let s: Value = c.get(&snapshot_path(&uuid, &snapshot.snapshot))?;
            print_snapshot(&c, &s, v["name"].as_str().unwrap_or(&snapshot.volume), fmt)
        }
        SnapshotCmd::Rollback { snapshot } => {
            let (uuid, _) = resolve(&c, &snapshot.volume)?;
            let path = format!("{}/rollback", snapshot_path(&uuid, &snapshot.snapshot));
            let v: Value = c.post(&path, &serde_json::Map::new())?;
            print_volume(&v, fmt)
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
            let mut names: BTreeMap<Uuid, String> = volumes.iter().cloned().collect();
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
            // Group members of other volumes: named from one listing.
            let grouped = rows.iter().flat_map(|(_, s)| &s.group);
            if grouped.clone().any(|u| !names.contains_key(u)) {
                names.extend(volume_names(&c));
            }
            print_snapshots(&rows, &names);
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

    fn parse(args: &[&str]) -> Result<SnapshotCmd, clap::Error> {
        use clap::Parser;
        let argv = ["nvpool", "snapshot"].iter().chain(args);
        match crate::Cli::try_parse_from(argv)?.cmd {
            crate::Command::Snapshot(a) => Ok(a.cmd),
            _ => panic!("{args:?} is no snapshot command"),
        }
    }

    fn names(list: &[&str]) -> Vec<SnapshotName> {
        list.iter()
            .map(|n| parse_snapshot_name(n).unwrap())
            .collect()
    }

    #[test]
    fn several_volumes_at_one_name_are_a_group() {
        let Ok(SnapshotCmd::Create { snapshots }) =
            parse(&["create", "data@e3", "ckpt@e3", "-o", "json"])
        else {
            panic!("two snapshots are one create");
        };
        assert_eq!(snapshots, names(&["data@e3", "ckpt@e3"]));
        assert_eq!(group_name(&snapshots).unwrap(), "e3");
        assert_eq!(group_name(&names(&["data@e3"])).unwrap(), "e3");
        assert!(parse(&["create"]).is_err(), "no snapshot");
        assert!(parse(&["create", "data@e3", "ckpt"]).is_err(), "no @");
        let e = group_name(&names(&["data@e3", "ckpt@e4"])).unwrap_err();
        assert_eq!(
            e.0,
            "a group snapshot has one name: data@e3 and ckpt@e4 differ"
        );
        let e = group_name(&names(&["data@e3", "ckpt@e3", "data@e3"])).unwrap_err();
        assert_eq!(e.0, "volume data is given twice");
        assert!(group_name(&[]).is_err());
    }

    #[test]
    fn a_rollback_names_one_snapshot() {
        let Ok(SnapshotCmd::Rollback { snapshot }) = parse(&["rollback", "data@e3"]) else {
            panic!("rollback VOLUME@SNAPSHOT");
        };
        assert_eq!(snapshot, names(&["data@e3"])[0]);
        for bad in [
            &["rollback"][..],
            &["rollback", "data"],
            &["rollback", "a@b", "c@b"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_group_is_shown_by_volume_name_where_known() {
        let a: Uuid = "6d1c7f3e-2a4b-4c8d-9e0f-1a2b3c4d5e6f".parse().unwrap();
        let b: Uuid = "7d1c7f3e-2a4b-4c8d-9e0f-1a2b3c4d5e6f".parse().unwrap();
        let s = |group: Vec<Uuid>| SnapshotOut {
            volume: a,
            name: "e3".into(),
            epoch: 3,
            state: nvpool_api::rest::SnapshotState::Ready,
            created_ms: 0,
            size_bytes: 1,
            group,
        };
        let names: BTreeMap<Uuid, String> = [(a, "data".to_owned())].into();
        assert_eq!(group_text(&s(vec![]), &names), "-");
        assert_eq!(group_text(&s(vec![a, b]), &names), format!("data,{b}"));
    }
}
