//! `nvpool volume attach` and `detach` end to end: the binary against an
//! in-process control plane that programs two real in-process targets
//! (file devices on the build disk) through their admin APIs.

use nvpool_control::api::{ApiServer, AuthConfig};
use nvpool_control::plan::HOST_SUBSYSTEM_PREFIX;
use nvpool_control::store::MemStore;
use nvpool_control::{Cluster, ManualClock, StateConfig};
use nvpool_target::{Running, StartOptions, Target};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const ADMIN: &str = "admin-secret";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:12345678-aaaa-4bbb-8ccc-1234567890ab";

/// A control plane on a loopback port (MemStore, a clock pinned to now).
fn control_plane() -> ApiServer {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let config = StateConfig {
        extent_bytes: MIB,
        ..StateConfig::default()
    };
    let cluster = Cluster::new(
        Arc::new(MemStore::new()),
        Arc::new(ManualClock::new(now)),
        config,
    )
    .unwrap();
    let auth = AuthConfig {
        admin_token: Some(ADMIN.into()),
        target_token: None,
    };
    ApiServer::start(Arc::new(cluster), auth, "127.0.0.1:0".parse().unwrap()).unwrap()
}

/// A real target on loopback with one 64 MiB file device `d0`,
/// registered with the control plane as `id`.
struct Tgt {
    running: Option<Running>,
    target: Arc<Target>,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Tgt {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            r.shutdown();
        }
    }
}

fn target(cp: &ApiServer, id: &str) -> Tgt {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("d0.img");
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(64 * MIB))
        .unwrap();
    let target = Target::new(None).unwrap();
    let running = Running::start(
        target.clone(),
        &StartOptions {
            listeners: vec!["127.0.0.1:0".parse().unwrap()],
            reactors: 1,
            io_uring: false,
            admin_listen: Some("127.0.0.1:0".parse().unwrap()),
        },
    )
    .unwrap();
    let addr = running.listen_addrs()[0];
    let admin = running.admin_addr().unwrap();
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into();
    let body = json!({
        "id": id, "name": id, "addr": addr.to_string(), "admin_addr": admin.to_string(),
        "labels": {"rack": id},
        "devices": [{"id": "d0", "backend": format!("file:{}", path.display()), "capacity_bytes": 64 * MIB}],
    });
    let r = agent
        .post(format!("http://{}/v1/targets", cp.addr))
        .header("Authorization", format!("Bearer {ADMIN}"))
        .send_json(&body)
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    Tgt {
        running: Some(running),
        target,
        addr,
        _dir: dir,
    }
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    #[track_caller]
    fn ok(self) -> String {
        assert_eq!(
            self.code, 0,
            "stderr: {}\nstdout: {}",
            self.stderr, self.stdout
        );
        self.stdout
    }

    #[track_caller]
    fn json(self) -> Value {
        let out = self.ok();
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
    }

    #[track_caller]
    fn error(self, code: i32, text: &str) {
        assert_eq!(
            self.code, code,
            "stderr: {}\nstdout: {}",
            self.stderr, self.stdout
        );
        assert_eq!(self.stderr.lines().count(), 1, "{:?}", self.stderr);
        assert!(self.stderr.starts_with("nvpool: "), "{:?}", self.stderr);
        assert!(
            self.stderr.contains(text),
            "{:?} lacks {text:?}",
            self.stderr
        );
    }
}

fn nvpool(cp: &ApiServer, token: &PathBuf, args: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_nvpool"))
        .env_remove("NVPOOL_LOG")
        .env("NVPOOL_ENDPOINT", format!("http://{}", cp.addr))
        .env("NVPOOL_TOKEN_FILE", token)
        // Keep nvpool's own host NQN and run directory inside the test's.
        .env("NVPOOL_HOSTNQN_FILE", token.with_file_name("hostnqn"))
        .env("NVPOOL_RUN_DIR", token.with_file_name("run"))
        .args(args)
        .output()
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

#[test]
fn attach_prints_the_plan_the_targets_export_it_and_detach_removes_it() {
    let cp = control_plane();
    let t0 = target(&cp, "t0");
    let t1 = target(&cp, "t1");
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, ADMIN).unwrap();
    let run = |args: &[&str]| nvpool(&cp, &token, args);

    let v = run(&[
        "volume", "create", "vol", "--size", "2M", "--layout", "raid1", "-o", "json",
    ])
    .json();
    let uuid = v["uuid"].as_str().unwrap().to_owned();

    // Attach: a plan with one namespace per extent, on the right targets.
    let a = run(&[
        "volume",
        "attach",
        "vol",
        "--plan-only",
        "--host-nqn",
        HOST,
        "-o",
        "json",
    ])
    .json();
    assert_eq!(a["volume"], uuid.as_str());
    assert_eq!(a["host_nqn"], HOST);
    assert_eq!(a["state"], "attached");
    let plan = &a["plan"];
    assert_eq!(plan["size_bytes"], 2 * MIB);
    assert_eq!(plan["host_nqn"], HOST);
    let extents = plan["extents"].as_array().unwrap();
    assert_eq!(extents.len(), 4, "{plan}");
    let subsys = extents[0]["subsystem_nqn"].as_str().unwrap().to_owned();
    assert!(subsys.starts_with(HOST_SUBSYSTEM_PREFIX), "{subsys}");
    for e in extents {
        let t = if e["target"] == "t0" { &t0 } else { &t1 };
        assert_eq!(e["addr"], t.addr.to_string(), "{e}");
        assert_eq!(e["subsystem_nqn"], subsys.as_str());
        assert!(e["nsid"].as_u64().unwrap() >= 1);
    }
    // Each target exports its two extents to that host alone.
    for t in [&t0, &t1] {
        let s = t
            .target
            .subsystem(&subsys)
            .expect("host subsystem exported");
        assert!(s.host_allowed(HOST) && !s.allow_any_host);
        assert_eq!(s.namespaces.len(), 2);
    }

    // Again: the same attachment, printed as a table.
    let table = run(&["volume", "attach", &uuid, "--plan-only", "--host-nqn", HOST]).ok();
    let header: Vec<&str> = table
        .lines()
        .find(|l| l.trim_start().starts_with("ROW"))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "ROW",
            "MEMBER",
            "COPY",
            "TARGET",
            "ADDR",
            "SUBSYSTEM",
            "NSID",
            "DEVICE",
            "OFFSET",
            "LENGTH"
        ]
    );
    assert_eq!(table.matches(subsys.as_str()).count(), 4, "{table}");

    // The volume lists its host.
    let ls = run(&["volume", "ls"]).ok();
    let row: Vec<&str> = ls.lines().nth(1).unwrap().split_whitespace().collect();
    // ATTACHED counts hosts; DEVICE is "-" (this host serves no device).
    assert_eq!(row[row.len() - 2..], ["1", "-"], "{ls}");
    let info = run(&["volume", "info", "vol", "-o", "json"]).json();
    assert_eq!(info["attachments"], json!([HOST]));

    // An attached volume is not deleted without --force.
    run(&["volume", "delete", "vol"]).error(1, "--force");

    // Detach: the targets stop exporting.
    let out = run(&["volume", "detach", "vol", "--host-nqn", HOST]).ok();
    assert_eq!(out.trim(), format!("volume vol detached from {HOST}"));
    for t in [&t0, &t1] {
        assert!(t
            .target
            .subsystem(&subsys)
            .is_none_or(|s| s.namespaces.is_empty()));
    }
    run(&["volume", "detach", "vol", "--host-nqn", HOST]).error(1, "");

    // Attached again, then deleted with --force.
    run(&[
        "volume",
        "attach",
        "vol",
        "--plan-only",
        "--host-nqn",
        HOST,
        "-o",
        "json",
    ])
    .json();
    run(&["volume", "delete", "vol", "--force"]).ok();
    run(&["volume", "info", "vol"]).error(1, "no volume named");
    for t in [&t0, &t1] {
        assert!(t
            .target
            .subsystem(&subsys)
            .is_none_or(|s| s.namespaces.is_empty()));
    }

    // Usage: a host NQN must be an NQN.
    run(&["volume", "attach", &uuid, "--host-nqn", "host1"]).error(2, "not an NQN");
}

#[test]
fn the_default_host_nqn_is_this_hosts() {
    let cp = control_plane();
    let _t0 = target(&cp, "t0");
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, ADMIN).unwrap();
    let run = |args: &[&str]| nvpool(&cp, &token, args);
    run(&["volume", "create", "solo", "--size", "1M", "-o", "json"]).json();
    let a = run(&["volume", "attach", "solo", "--plan-only", "-o", "json"]).json();
    let host = a["host_nqn"].as_str().unwrap().to_owned();
    match std::fs::read_to_string(nvpool_initiator::hostnqn::HOSTNQN_PATH) {
        // nvme-cli's identity when the host has one...
        Ok(nqn) if nqn.trim().starts_with("nqn.") => assert_eq!(host, nqn.trim()),
        // ...else one nvpool keeps (here under the test's directory), the
        // same on every call so attach and detach agree.
        _ => {
            let kept = std::fs::read_to_string(dir.path().join("hostnqn")).unwrap();
            assert_eq!(host, kept.trim());
            assert!(
                host.starts_with("nqn.2014-08.org.nvmexpress:uuid:"),
                "{host}"
            );
        }
    }
    run(&["volume", "detach", "solo"]).ok();
}
