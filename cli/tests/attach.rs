//! `nvpool volume attach` and `detach` end to end: the binary against an
//! in-process control plane that programs two real in-process targets
//! (file devices on the build disk) through their admin APIs.

mod common;

use common::{control_plane, target, ADMIN, HOST, MIB};
use nvpool_control::api::ApiServer;
use nvpool_control::plan::HOST_SUBSYSTEM_PREFIX;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;

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
