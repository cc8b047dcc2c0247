//! `--frontend nvme`: the volume is served by targets (an ANA subsystem
//! with a path per target, C19) and this host's own kernel NVMe driver
//! connects to every path, as `nvme connect` does, over NVMe/RDMA when the
//! path's target listens for it and this host has an RDMA device, else
//! over NVMe/TCP: one line of
//! options written to `/dev/nvme-fabrics` per path. With native multipath
//! (`nvme_core.multipath=Y`, the default) the kernel shows one
//! `/dev/nvmeXnY` for all paths and fails over between them by ANA state.
//! No nvpool process stays on the host.

use anyhow::{bail, Context};
use nvpool_api::rest::ServedView;
use nvpool_initiator::hostnqn::{format_uuid, host_id_of, HOSTID_PATH, HOSTNQN_PATH};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const FABRICS: &str = "/dev/nvme-fabrics";
const SUBSYSTEMS: &str = "/sys/class/nvme-subsystem";
const CONTROLLERS: &str = "/sys/class/nvme";
/// How long attach waits for the kernel to show the namespace.
const DEVICE_TIMEOUT: Duration = Duration::from_secs(20);
/// Seconds between reconnect attempts to a path that went away (the
/// kernel's default is 10): a path back from a restart is used sooner.
const RECONNECT_DELAY_S: u32 = 2;

/// Whether this host has an RDMA device (the kernel's nvme-rdma needs one).
fn rdma_here() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}

/// Whether this host can connect NVMe/TCP paths itself.
pub fn available() -> anyhow::Result<()> {
    if !Path::new(FABRICS).exists() {
        bail!("{FABRICS} is missing: load the kernel's NVMe/TCP host (modprobe nvme-tcp)");
    }
    Ok(())
}

/// The commands a host runs to connect to `v` itself; then, when every
/// path's target listens for NVMe/RDMA too, the same over RDMA as a
/// commented alternative.
pub fn commands(v: &ServedView, host: &str) -> Vec<String> {
    let mut out = vec!["modprobe nvme-tcp".to_owned()];
    let rdma = !v.paths.is_empty() && v.paths.iter().all(|p| p.route(true).0 == "rdma");
    let tail = rdma_commands(v, host);
    if let Some(p) = v.paths.first() {
        out.push(format!(
            "nvme discover -t tcp -a {} -s {} --hostnqn {host}",
            p.traddr, p.trsvcid
        ));
    }
    for p in &v.paths {
        out.push(format!(
            "nvme connect -t tcp -a {} -s {} -n {} --hostnqn {host} --ctrl-loss-tmo=-1 \
             --reconnect-delay={RECONNECT_DELAY_S}",
            p.traddr, p.trsvcid, v.subsystem_nqn
        ));
    }
    if rdma {
        out.extend(tail);
    }
    out
}

fn rdma_commands(v: &ServedView, host: &str) -> Vec<String> {
    let mut out = vec![
        "# or over NVMe/RDMA (hosts with an RDMA NIC):".to_owned(),
        "modprobe nvme-rdma".to_owned(),
    ];
    for p in &v.paths {
        let (_, a, port) = p.route(true);
        out.push(format!(
            "nvme connect -t rdma -a {a} -s {port} -n {} --hostnqn {host} --ctrl-loss-tmo=-1 \
             --reconnect-delay={RECONNECT_DELAY_S}",
            v.subsystem_nqn
        ));
    }
    out
}

/// Connects every path of `v` not connected yet and returns the
/// multipath block device. A path that cannot be connected is reported
/// and left out while another one works.
pub fn connect(v: &ServedView, host: &str) -> anyhow::Result<PathBuf> {
    available()?;
    let mut connected = connected_paths(&v.subsystem_nqn);
    let mut errors = Vec::new();
    let rdma = rdma_here();
    for p in &v.paths {
        let (transport, traddr, trsvcid) = p.route(rdma);
        let addr = format!("traddr={traddr},trsvcid={trsvcid}");
        if connected.iter().any(|a| a.contains(&addr)) {
            continue;
        }
        let opts = format!(
            "nqn={},transport={transport},traddr={traddr},trsvcid={trsvcid},hostnqn={host},\
             hostid={},ctrl_loss_tmo=-1,reconnect_delay={RECONNECT_DELAY_S}",
            v.subsystem_nqn,
            host_id(host)
        );
        match fabrics_connect(&opts) {
            Ok(answer) => {
                tracing::info!(target = %p.target, transport, %answer, "path connected");
                connected.push(addr);
            }
            Err(e) => errors.push(format!(
                "{transport} {traddr}:{trsvcid} ({}): {e:#}",
                p.target
            )),
        }
    }
    if connected.is_empty() {
        bail!("no path could be connected: {}", errors.join("; "));
    }
    for e in &errors {
        eprintln!("warning: path {e}");
    }
    let deadline = Instant::now() + DEVICE_TIMEOUT;
    loop {
        if let Some(dev) = device_of(&v.subsystem_nqn) {
            return Ok(dev);
        }
        if Instant::now() >= deadline {
            bail!(
                "connected, but no block device of {} appeared (is nvme_core.multipath off?)",
                v.subsystem_nqn
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The host ID to connect with: the kernel refuses a host NQN whose host
/// ID another NQN already uses, so it must belong to this NQN:
/// /etc/nvme/hostid when the NQN is the one in /etc/nvme/hostnqn (what
/// nvme-cli would send), else [`host_id_of`] the NQN.
fn host_id(host: &str) -> String {
    let own = std::fs::read_to_string(HOSTNQN_PATH).unwrap_or_default();
    if own.trim() == host && !host.contains(":uuid:") {
        if let Ok(id) = std::fs::read_to_string(HOSTID_PATH) {
            return id.trim().to_owned();
        }
    }
    format_uuid(&host_id_of(host))
}

/// Writes one connect line to /dev/nvme-fabrics and returns the kernel's
/// answer (`instance=N,cntlid=M`).
fn fabrics_connect(opts: &str) -> anyhow::Result<String> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(FABRICS)
        .with_context(|| format!("opening {FABRICS}"))?;
    f.write_all(opts.as_bytes())
        .context("the kernel refused the connection (see dmesg)")?;
    let mut answer = String::new();
    f.read_to_string(&mut answer)
        .context("reading the kernel's answer")?;
    Ok(answer.trim().to_owned())
}

/// `transport address` of every controller of subsystem `nqn`, as the
/// kernel shows them (`traddr=…,trsvcid=…`).
fn connected_paths(nqn: &str) -> Vec<String> {
    controllers_of(nqn)
        .iter()
        .filter_map(|c| std::fs::read_to_string(c.join("address")).ok())
        .map(|a| a.trim().to_owned())
        .collect()
}

/// The controller directories of subsystem `nqn`.
fn controllers_of(nqn: &str) -> Vec<PathBuf> {
    let Ok(dir) = std::fs::read_dir(CONTROLLERS) else {
        return Vec::new();
    };
    dir.flatten()
        .map(|e| e.path())
        .filter(|p| std::fs::read_to_string(p.join("subsysnqn")).is_ok_and(|s| s.trim() == nqn))
        .collect()
}

/// The multipath block device of subsystem `nqn`: the `nvmeXnY` entry of
/// its subsystem directory.
pub fn device_of(nqn: &str) -> Option<PathBuf> {
    let dir = std::fs::read_dir(SUBSYSTEMS).ok()?;
    for s in dir.flatten() {
        let p = s.path();
        if std::fs::read_to_string(p.join("subsysnqn")).map_or(true, |n| n.trim() != nqn) {
            continue;
        }
        for e in std::fs::read_dir(&p).ok()?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if is_head_name(&name) {
                return Some(PathBuf::from("/dev").join(name));
            }
        }
    }
    None
}

/// `nvme<digits>n<digits>`: a namespace head (paths are `nvmeXcYnZ`).
fn is_head_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("nvme") else {
        return false;
    };
    let Some((a, b)) = rest.split_once('n') else {
        return false;
    };
    !a.is_empty()
        && !b.is_empty()
        && a.bytes().all(|c| c.is_ascii_digit())
        && b.bytes().all(|c| c.is_ascii_digit())
}

/// Disconnects every controller of subsystem `nqn`; returns how many.
pub fn disconnect(nqn: &str) -> anyhow::Result<usize> {
    let ctrls = controllers_of(nqn);
    for c in &ctrls {
        std::fs::write(c.join("delete_controller"), "1")
            .with_context(|| format!("disconnecting {}", c.display()))?;
    }
    Ok(ctrls.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvpool_api::rest::PathView;

    #[test]
    fn head_names() {
        assert!(is_head_name("nvme0n1"));
        assert!(is_head_name("nvme12n3"));
        assert!(!is_head_name("nvme0c1n1"));
        assert!(!is_head_name("nvme0"));
        assert!(!is_head_name("nvmen1"));
        assert!(!is_head_name("ng0n1"));
    }

    #[test]
    fn host_ids_belong_to_their_nqn() {
        assert_eq!(
            host_id("nqn.2014-08.org.nvmexpress:uuid:6e76706f-6f6c-4e00-8000-766e736d7061"),
            "6e76706f-6f6c-4e00-8000-766e736d7061"
        );
        let a = host_id("nqn.2026-11.example:host-a");
        assert_eq!(a.len(), 36);
        assert_ne!(a, host_id("nqn.2026-11.example:host-b"));
        assert_eq!(a, host_id("nqn.2026-11.example:host-a"));
    }

    #[test]
    fn commands_name_every_path() {
        let v = ServedView {
            volume: nvpool_layout::Uuid::from_bytes([7; 16]),
            subsystem_nqn: "nqn.2026-11.io.nvpool:volume:x".into(),
            hosts: vec!["nqn.h".into()],
            paths: vec![
                PathView {
                    target: "a".into(),
                    traddr: "10.0.0.1".into(),
                    trsvcid: 4420,
                    ana_state: "optimized".into(),
                    rdma_traddr: None,
                    rdma_trsvcid: None,
                },
                PathView {
                    target: "b".into(),
                    traddr: "10.0.0.2".into(),
                    trsvcid: 4420,
                    ana_state: "inaccessible".into(),
                    rdma_traddr: None,
                    rdma_trsvcid: None,
                },
            ],
            owner: Some("a".into()),
            generation: 1,
            serving: true,
        };
        let c = commands(&v, "nqn.h");
        assert_eq!(c.len(), 4);
        assert!(c[1].starts_with("nvme discover -t tcp -a 10.0.0.1 -s 4420"));
        assert!(c[2].contains("-a 10.0.0.1") && c[2].contains("-n nqn.2026-11.io.nvpool:volume:x"));
        assert!(c[3].contains("-a 10.0.0.2") && c[3].contains("--hostnqn nqn.h"));

        // Targets that listen for NVMe/RDMA too: the same over RDMA after.
        let mut r = v.clone();
        for (p, a) in r.paths.iter_mut().zip(["192.0.2.1", "192.0.2.2"]) {
            p.rdma_traddr = Some(a.into());
            p.rdma_trsvcid = Some(4421);
        }
        let c = commands(&r, "nqn.h");
        assert_eq!(c.len(), 8, "{c:#?}");
        assert_eq!(c[4], "# or over NVMe/RDMA (hosts with an RDMA NIC):");
        assert_eq!(c[5], "modprobe nvme-rdma");
        assert!(c[6].starts_with(
            "nvme connect -t rdma -a 192.0.2.1 -s 4421 -n nqn.2026-11.io.nvpool:volume:x"
        ));
        assert!(c[7].contains("-a 192.0.2.2 -s 4421"));
        assert_eq!(r.paths[0].route(false), ("tcp", "10.0.0.1", 4420));
        assert_eq!(r.paths[0].route(true), ("rdma", "192.0.2.1", 4421));
    }
}
