//! The `nvpool` binary against an in-process control plane: `target`,
//! `pool` and `volume` commands in table and JSON form, and the exit-code
//! contract (0 success, 1 failure, 2 usage error; every error one
//! `nvpool:` line on stderr).
//!
//! The control plane (MemStore, 1 MiB extents, a clock pinned to the
//! start of the test) is served on a loopback port; targets register
//! through the REST API with addresses nobody listens on, which is all
//! placement needs.

use nvpool_control::api::{ApiServer, AuthConfig};
use nvpool_control::auth::{Principal, Tokens};
use nvpool_control::store::MemStore;
use nvpool_control::{Cluster, ManualClock, StateConfig};
use serde_json::{json, Value};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const ADMIN: &str = "admin-secret-0123456789";

/// Instances of one control plane (each its own `Cluster` over the one
/// store, as instances share etcd); `url()` lists them all.
struct ControlPlane {
    addrs: Vec<SocketAddr>,
    token_file: PathBuf,
    apis: Vec<Option<ApiServer>>,
    _dir: tempfile::TempDir,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A control plane whose admin token is ADMIN, with `targets` targets
/// t0…, each on its own rack with two 64 MiB devices d0 and d1.
fn control_plane(targets: usize) -> ControlPlane {
    instances(targets, 1)
}

/// `control_plane(targets)` served by `n` instances on one store.
fn instances(targets: usize, n: usize) -> ControlPlane {
    let config = StateConfig {
        extent_bytes: MIB,
        ..StateConfig::default()
    };
    let clock = Arc::new(ManualClock::new(now_ms()));
    let store = Arc::new(MemStore::new());
    let apis: Vec<ApiServer> = (0..n)
        .map(|_| {
            let cluster = Cluster::new(store.clone(), clock.clone(), config.clone()).unwrap();
            let auth = AuthConfig::new(Tokens::new().with(Principal::Admin, ADMIN));
            ApiServer::start(Arc::new(cluster), auth, "127.0.0.1:0".parse().unwrap()).unwrap()
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{ADMIN}\n")).unwrap();
    let cp = ControlPlane {
        addrs: apis.iter().map(|a| a.addr).collect(),
        token_file,
        apis: apis.into_iter().map(Some).collect(),
        _dir: dir,
    };
    for i in 0..targets {
        cp.register(i);
    }
    cp
}

impl ControlPlane {
    /// Every instance, as `--endpoint` takes them.
    fn url(&self) -> String {
        let urls: Vec<String> = self.addrs.iter().map(|a| format!("http://{a}")).collect();
        urls.join(",")
    }

    /// Stops instance `i` (its port refuses connections from now on).
    fn stop(&mut self, i: usize) {
        self.apis[i].take().expect("running").shutdown();
    }

    fn register(&self, i: usize) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .build()
            .into();
        let body = json!({
            "id": format!("t{i}"),
            "name": format!("node{i}"),
            "addr": format!("127.0.0.1:{}", 44200 + i),
            "admin_addr": format!("127.0.0.1:{}", 44800 + i),
            "labels": {"rack": format!("r{i}")},
            "devices": [
                {"id": "d0", "backend": format!("file:/dev/fake{i}a"), "capacity_bytes": 64 * MIB},
                {"id": "d1", "backend": format!("file:/dev/fake{i}b"), "capacity_bytes": 64 * MIB,
                 "labels": {"class": "tlc"}},
            ],
        });
        let r = agent
            .post(format!("http://{}/v1/targets", self.addrs[0]))
            .header("Authorization", format!("Bearer {ADMIN}"))
            .send_json(&body)
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
    }

    /// `nvpool ARGS` with this control plane and the admin token.
    fn run(&self, args: &[&str]) -> Run {
        run_with(
            args,
            &[
                ("NVPOOL_ENDPOINT", &self.url()),
                ("NVPOOL_TOKEN_FILE", self.token_file.to_str().unwrap()),
            ],
        )
    }

    /// `nvpool ARGS` with this control plane and no token.
    fn run_without_token(&self, args: &[&str]) -> Run {
        run_with(args, &[("NVPOOL_ENDPOINT", &self.url())])
    }

    /// Runs, expects success and JSON on stdout.
    #[track_caller]
    fn json(&self, args: &[&str]) -> Value {
        let mut all = args.to_vec();
        all.extend(["-o", "json"]);
        let r = self.run(&all);
        r.expect_ok();
        serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}: {}", r.stdout))
    }

    /// Runs, expects success and returns the table text.
    #[track_caller]
    fn table(&self, args: &[&str]) -> String {
        let r = self.run(args);
        r.expect_ok();
        r.stdout
    }
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    #[track_caller]
    fn expect_ok(&self) {
        assert_eq!(
            self.code, 0,
            "stderr: {}\nstdout: {}",
            self.stderr, self.stdout
        );
    }

    /// Fails with `code` and one `nvpool:` line on stderr holding `text`.
    #[track_caller]
    fn expect_error(&self, code: i32, text: &str) {
        assert_eq!(
            self.code, code,
            "stderr: {}\nstdout: {}",
            self.stderr, self.stdout
        );
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "one line: {:?}", self.stderr);
        assert!(lines[0].starts_with("nvpool: "), "{:?}", lines[0]);
        assert!(lines[0].contains(text), "{:?} lacks {text:?}", lines[0]);
        assert!(self.stdout.is_empty(), "stdout: {}", self.stdout);
    }
}

fn run_with(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut c = Command::new(env!("CARGO_BIN_EXE_nvpool"));
    for v in ["NVPOOL_ENDPOINT", "NVPOOL_TOKEN_FILE", "NVPOOL_LOG"] {
        c.env_remove(v);
    }
    c.envs(env.iter().copied()).args(args);
    let Output {
        status,
        stdout,
        stderr,
    } = c.output().unwrap();
    Run {
        code: status.code().unwrap_or(-1),
        stdout: String::from_utf8(stdout).unwrap(),
        stderr: String::from_utf8(stderr).unwrap(),
    }
}

/// The table row whose first column is `key`.
#[track_caller]
fn row<'a>(table: &'a str, key: &str) -> Vec<&'a str> {
    let line = table
        .lines()
        .find(|l| l.split_whitespace().next() == Some(key))
        .unwrap_or_else(|| panic!("no row {key} in\n{table}"));
    line.split_whitespace().collect()
}

/// The value of a `Key:  value` line.
#[track_caller]
fn field<'a>(text: &'a str, key: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .unwrap_or_else(|| panic!("no {key}: in\n{text}"))
        .trim()
}

// ----- hosts -----

#[test]
fn host_keys_are_set_from_files_shown_without_secrets_and_cleared() {
    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-000000000001";
    let cp = control_plane(0);
    let dir = tempfile::tempdir().unwrap();
    let secret = nvpool_wire::dhchap::Secret::new(&[7; 32], None)
        .unwrap()
        .to_dhhc();
    let ctrl = nvpool_wire::dhchap::Secret::new(&[8; 48], None)
        .unwrap()
        .to_dhhc();
    let file = dir.path().join("host.key");
    std::fs::write(&file, format!("{secret}\n")).unwrap();
    let ctrl_file = dir.path().join("ctrl.key");
    std::fs::write(&ctrl_file, &ctrl).unwrap();
    let (f, cf) = (file.to_str().unwrap(), ctrl_file.to_str().unwrap());

    let set = cp.run(&[
        "host",
        "set-keys",
        HOST,
        "--dhchap-secret-file",
        f,
        "--dhchap-ctrl-secret-file",
        cf,
        "--dhgroup",
        "ffdhe3072",
        "-o",
        "json",
    ]);
    set.expect_ok();
    assert!(!set.stdout.contains(&secret[10..]) && !set.stdout.contains(&ctrl[10..]));
    let out: Value = serde_json::from_str(&set.stdout).unwrap();
    let key_id = out["key_id"].as_str().unwrap().to_owned();
    assert_eq!(out["bidirectional"], true, "{out}");
    assert_eq!(out["rollout"]["updated"], json!([]), "{out}");

    let shown = cp.table(&["host", "keys", HOST]);
    assert_eq!(field(&shown, "key id"), key_id);
    assert_eq!(field(&shown, "dh group"), "ffdhe3072");
    assert!(!shown.contains(&secret[10..]));

    // Secrets come from files or the environment only, and a bad one is
    // a usage error that does not quote it.
    cp.run(&["host", "set-keys", HOST])
        .expect_error(2, "no host secret");
    let bad = dir.path().join("bad.key");
    std::fs::write(&bad, "DHHC-1:00:c2VjcmV0LXNlY3JldC1zZWNyZXQ=:").unwrap();
    let r = cp.run(&[
        "host",
        "set-keys",
        HOST,
        "--dhchap-secret-file",
        bad.to_str().unwrap(),
    ]);
    r.expect_error(2, "host secret");
    assert!(!r.stderr.contains("c2VjcmV0"), "{}", r.stderr);
    cp.run(&[
        "host",
        "set-keys",
        HOST,
        "--dhchap-secret-file",
        f,
        "--hash",
        "md5",
    ])
    .expect_error(1, "dhchap_hash");
    // The failed attempts changed nothing.
    assert_eq!(cp.json(&["host", "keys", HOST])["key_id"], key_id.as_str());

    cp.table(&["host", "clear-keys", HOST]);
    cp.run(&["host", "keys", HOST])
        .expect_error(1, "no DH-HMAC-CHAP keys");
}

// ----- targets -----

#[test]
fn target_ls_and_info_as_tables_and_json() {
    let cp = control_plane(3);
    let t = cp.table(&["target", "ls"]);
    let header: Vec<&str> = t.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["ID", "NAME", "ADDR", "HEALTH", "STATE", "DEVICES", "SIZE", "USED", "FREE", "LABELS"]
    );
    assert_eq!(
        row(&t, "t1"),
        [
            "t1",
            "node1",
            "127.0.0.1:44201",
            "online",
            "active",
            "2",
            "128.0",
            "MiB",
            "0",
            "B",
            "128.0",
            "MiB",
            "rack=r1"
        ]
    );
    assert_eq!(t.lines().count(), 4, "{t}");

    let j = cp.json(&["target", "ls"]);
    let targets = j.as_array().unwrap();
    assert_eq!(targets.len(), 3);
    assert_eq!(targets[0]["id"], "t0");
    assert_eq!(targets[0]["capacity"]["total_bytes"], 128 * MIB);
    assert_eq!(targets[0]["devices"][1]["labels"]["class"], "tlc");

    let info = cp.table(&["target", "info", "t2"]);
    assert_eq!(field(&info, "Admin address"), "127.0.0.1:44802");
    assert_eq!(field(&info, "Admin API"), "http");
    assert_eq!(field(&info, "Health"), "online");
    assert_eq!(
        row(&info, "d1"),
        [
            "d1",
            "file:/dev/fake2b",
            "-",
            "64.0",
            "MiB",
            "0",
            "B",
            "64.0",
            "MiB",
            "class=tlc"
        ]
    );
    assert_eq!(cp.json(&["target", "info", "t2"])["name"], "node2");
    cp.run(&["target", "info", "t9"]).expect_error(1, "t9");
    // The global options work before the subcommand too.
    let r = run_with(
        &[
            "--endpoint",
            &cp.url(),
            "--token-file",
            cp.token_file.to_str().unwrap(),
            "target",
            "-o",
            "json",
            "ls",
        ],
        &[],
    );
    r.expect_ok();
    assert!(r.stdout.trim_start().starts_with('['), "{}", r.stdout);
}

// ----- pools -----

#[test]
fn pool_create_ls_info_delete() {
    let cp = control_plane(3);
    let p = cp.json(&[
        "pool",
        "create",
        "fast",
        "--device",
        "t0/d1,t1/d1",
        "--device",
        "t2/d1",
    ]);
    assert_eq!(p["name"], "fast");
    assert_eq!(p["devices"].as_array().unwrap().len(), 3);
    assert_eq!(p["devices"][2], json!({"target": "t2", "device": "d1"}));
    assert_eq!(p["capacity"]["total_bytes"], 192 * MIB);
    // Idempotent: the same devices again is fine.
    cp.table(&["pool", "create", "fast", "--device", "t0/d1,t1/d1,t2/d1"]);

    let ls = cp.table(&["pool", "ls"]);
    assert_eq!(
        row(&ls, "fast"),
        ["fast", "3", "192.0", "MiB", "0", "B", "192.0", "MiB"]
    );
    let info = cp.table(&["pool", "info", "fast"]);
    assert_eq!(field(&info, "Devices"), "3");
    assert_eq!(row(&info, "t1"), ["t1", "d1"]);
    assert_eq!(
        cp.json(&["pool", "info", "fast"])["capacity"]["free_bytes"],
        192 * MIB
    );
    // The pool's devices now show it.
    let t = cp.table(&["target", "info", "t0"]);
    assert_eq!(row(&t, "d1")[2], "fast");

    // A volume on the pool keeps the pool from being deleted.
    let v = cp.json(&["volume", "create", "pv", "--size", "2M", "--pool", "fast"]);
    assert!(v["extents"]
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e["device"] == "d1"));
    cp.run(&["pool", "delete", "fast"]).expect_error(1, "fast");
    cp.table(&["volume", "delete", "pv"]);
    let out = cp.table(&["pool", "delete", "fast"]);
    assert_eq!(out.trim(), "pool fast deleted");
    cp.run(&["pool", "info", "fast"]).expect_error(1, "fast");

    // Usage errors.
    cp.run(&["pool", "create", "p2", "--device", "t0"])
        .expect_error(2, "TARGET/DEVICE");
    cp.run(&["pool", "create", "p2"])
        .expect_error(2, "--device");
    cp.run(&["pool", "create", "p2", "--device", "t0/nope"])
        .expect_error(1, "nope");
}

#[test]
fn pool_df_shows_each_pool_the_unpooled_devices_and_the_total() {
    let cp = control_plane(2);
    cp.table(&["pool", "create", "fast", "--device", "t0/d1,t1/d1"]);
    cp.json(&["volume", "create", "pv", "--size", "4M", "--pool", "fast"]);
    cp.json(&["volume", "create", "uv", "--size", "2M"]);

    let df = cp.table(&["pool", "df"]);
    assert_eq!(row(&df, "POOL")[..3], ["POOL", "SIZE", "USED"]);
    // Plain devices: provisioned is what is used; nothing is over-committed.
    assert_eq!(
        row(&df, "fast"),
        ["fast", "128.0", "MiB", "4.0", "MiB", "124.0", "MiB", "4.0", "MiB", "0.03x", "3%"]
    );
    assert_eq!(row(&df, "(unpooled)")[1..5], ["128.0", "MiB", "2.0", "MiB"]);
    assert_eq!(row(&df, "(total)")[1..5], ["256.0", "MiB", "6.0", "MiB"]);

    let j = cp.json(&["pool", "df"]);
    assert_eq!(j["pools"][0]["pool"], "fast");
    assert_eq!(j["pools"][0]["provisioned_bytes"], 4 * MIB);
    assert_eq!(j["unpooled"]["used_bytes"], 2 * MIB);
    assert_eq!(j["total"]["total_bytes"], 256 * MIB);
    assert_eq!(j["total"]["free_bytes"], 250 * MIB);
}

// ----- volumes -----

#[test]
fn volumes_of_every_layout_are_created_listed_grown_and_deleted() {
    let cp = control_plane(4);
    // (name, flags, size, layout type, extents)
    let cases: [(&str, &[&str], u64, &str, usize); 5] = [
        ("vc", &["--layout", "concat"], 3 * MIB, "concat", 3),
        ("v0", &["--layout", "raid0"], 4 * MIB, "raid0", 4),
        (
            "v0w",
            &[
                "--layout",
                "raid0",
                "--stripe-width",
                "4",
                "--stripe-size",
                "128K",
            ],
            8 * MIB,
            "raid0",
            8,
        ),
        (
            "v1",
            &["--layout", "raid1", "--copies", "3"],
            2 * MIB,
            "raid1",
            6,
        ),
        ("v10", &["--layout", "raid10"], 4 * MIB, "raid10", 8),
    ];
    for (name, flags, size, layout, extents) in cases {
        let size_arg = format!("{}M", size / MIB);
        let mut args = vec!["volume", "create", name, "--size", &size_arg];
        args.extend_from_slice(flags);
        let v = cp.json(&args);
        assert_eq!(v["name"], name);
        assert_eq!(v["size_bytes"], size, "{name}");
        assert_eq!(v["layout"]["type"], layout, "{name}");
        assert_eq!(
            v["extents"].as_array().unwrap().len(),
            extents,
            "{name}: {v}"
        );
        assert_eq!(v["status"], "online");
        let uuid = v["uuid"].as_str().unwrap();
        assert_eq!(uuid.len(), 36);
        assert_eq!(&uuid[14..15], "4", "a v4 UUID: {uuid}");
    }
    let v = cp.json(&["volume", "info", "v0w"]);
    assert_eq!(
        v["layout"],
        json!({"type": "raid0", "stripe_bytes": 128 << 10, "width": 4})
    );
    let v = cp.json(&["volume", "info", "v10"]);
    assert_eq!(
        v["layout"],
        json!({"type": "raid10", "stripe_bytes": 64 << 10, "width": 2, "copies": 2})
    );

    // ls.
    let ls = cp.table(&["volume", "ls"]);
    let header: Vec<&str> = ls.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAME",
            "UUID",
            "SIZE",
            "LAYOUT",
            "PROVISIONING",
            "STATUS",
            "POOL",
            "ATTACHED",
            "DEVICE"
        ]
    );
    let r = row(&ls, "v10");
    assert_eq!(
        r[2..],
        ["4.0", "MiB", "raid10", "w=2", "s=64K", "c=2", "thick", "online", "-", "-", "-"]
    );
    assert_eq!(cp.json(&["volume", "ls"]).as_array().unwrap().len(), 5);

    // info by name and by UUID.
    let uuid = v["uuid"].as_str().unwrap().to_owned();
    let by_uuid = cp.json(&["volume", "info", &uuid]);
    assert_eq!(by_uuid["name"], "v10");
    let info = cp.table(&["volume", "info", "v10"]);
    assert_eq!(field(&info, "UUID"), uuid);
    assert_eq!(field(&info, "Layout"), "raid10 w=2 s=64K c=2");
    assert_eq!(field(&info, "Size"), "4.0 MiB (4194304 bytes)");
    let extent_rows = info
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("ROW"))
        .skip(1)
        .count();
    assert_eq!(extent_rows, 8, "{info}");

    // resize.
    let v = cp.json(&["volume", "resize", "vc", "--size", "5M"]);
    assert_eq!(v["size_bytes"], 5 * MIB);
    assert_eq!(v["extents"].as_array().unwrap().len(), 5);
    cp.run(&["volume", "resize", "vc", "--size", "1M"])
        .expect_error(1, "");

    // Creates with a given UUID are idempotent.
    let u = "0b5e1f9a-6c1d-4c55-9d0e-2f8a3b7c1d42";
    let a = cp.json(&["volume", "create", "fixed", "--size", "1M", "--uuid", u]);
    let b = cp.json(&["volume", "create", "fixed", "--size", "1M", "--uuid", u]);
    assert_eq!((a["uuid"].as_str(), b["uuid"].as_str()), (Some(u), Some(u)));
    cp.run(&["volume", "create", "fixed", "--size", "2M", "--uuid", u])
        .expect_error(1, "");

    // delete by name and by UUID.
    let out = cp.table(&["volume", "delete", "vc"]);
    assert!(out.starts_with("volume vc ("), "{out}");
    cp.json(&["volume", "delete", u]);
    cp.run(&["volume", "info", "vc"])
        .expect_error(1, "no volume named \"vc\"");
    cp.run(&["volume", "info", u]).expect_error(1, "");
    assert_eq!(cp.json(&["volume", "ls"]).as_array().unwrap().len(), 4);
}

#[test]
fn volume_sizes_are_iec() {
    let cp = control_plane(2);
    for (arg, bytes) in [
        ("3M", 3 * MIB),
        ("2MiB", 2 * MIB),
        ("1048576", MIB),
        ("4096k", 4 * MIB),
    ] {
        let name = format!("s{bytes}-{}", arg.len());
        let v = cp.json(&["volume", "create", &name, "--size", arg]);
        assert_eq!(v["size_bytes"], bytes, "{arg}");
    }
    let t = cp.table(&["volume", "ls"]);
    assert!(t.contains("3.0 MiB") && t.contains("1.0 MiB"), "{t}");
    // 1T parses (and then does not fit this little cluster).
    cp.run(&["volume", "create", "big", "--size", "1T"])
        .expect_error(1, "");
}

// ----- errors -----

#[test]
fn errors_are_one_line_with_the_documented_exit_codes() {
    let cp = control_plane(2);
    cp.run(&["volume", "create", "x", "--size", "10Q"])
        .expect_error(2, "10Q");
    cp.run(&["volume", "create", "x", "--size", "1G", "--layout", "raid5"])
        .expect_error(2, "raid5");
    cp.run(&["volume", "create", "x", "--size", "1000"])
        .expect_error(2, "4096");
    cp.run(&["volume", "create", "x", "--size", "1M", "--copies", "2"])
        .expect_error(2, "--copies");
    cp.run(&[
        "volume",
        "create",
        "x",
        "--size",
        "1M",
        "--layout",
        "raid0",
        "--stripe-size",
        "3K",
    ])
    .expect_error(2, "stripe");
    cp.run(&["volume", "create", "x", "--size", "1M", "--uuid", "nope"])
        .expect_error(2, "UUID");
    cp.run(&["volume", "create", "--size", "1M"])
        .expect_error(2, "<NAME>");
    cp.run(&["volume", "info", "ghost"])
        .expect_error(1, "no volume named \"ghost\"");
    cp.run(&["volume", "info", "0b5e1f9a-6c1d-4c55-9d0e-2f8a3b7c1d42"])
        .expect_error(1, "");
    cp.run(&[
        "volume",
        "create",
        "x",
        "--size",
        "1M",
        "--layout",
        "raid10",
        "--stripe-width",
        "4",
    ])
    .expect_error(1, "");

    // Unreachable control plane.
    let dead = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    for args in [
        &["target", "ls"][..],
        &["volume", "ls"],
        &["pool", "info", "p"],
    ] {
        run_with(args, &[("NVPOOL_ENDPOINT", &dead)])
            .expect_error(1, &format!("cannot reach the control plane at {dead}"));
    }
    run_with(&["--endpoint", "ftp://cp:4430", "target", "ls"], &[])
        .expect_error(2, "expected http://HOST:PORT or https://HOST:PORT");
    run_with(
        &[
            "--endpoint",
            "https://cp:4430",
            "--cacert",
            "/nonexistent.pem",
            "target",
            "ls",
        ],
        &[],
    )
    .expect_error(2, "--cacert /nonexistent.pem: cannot read it");

    // Mutations need the admin token: none, a wrong one, an unreadable file.
    cp.run_without_token(&["volume", "create", "x", "--size", "1M"])
        .expect_error(1, "--token-file");
    cp.run_without_token(&["pool", "create", "p", "--device", "t0/d0"])
        .expect_error(1, "Bearer");
    let dir = tempfile::tempdir().unwrap();
    let wrong = dir.path().join("wrong");
    std::fs::write(&wrong, "guess").unwrap();
    run_with(
        &["volume", "create", "x", "--size", "1M"],
        &[
            ("NVPOOL_ENDPOINT", &cp.url()),
            ("NVPOOL_TOKEN_FILE", wrong.to_str().unwrap()),
        ],
    )
    .expect_error(1, "not known");
    run_with(
        &[
            "--token-file",
            "/nonexistent/token",
            "volume",
            "delete",
            "x",
        ],
        &[("NVPOOL_ENDPOINT", &cp.url())],
    )
    .expect_error(1, "cannot read the token");
    // Reads need a token too.
    cp.run_without_token(&["volume", "ls"])
        .expect_error(1, "Bearer");
    assert_eq!(cp.json(&["volume", "ls"]), json!([]));
}

// ----- several control-plane instances -----

#[test]
fn the_cli_fails_over_between_control_plane_instances() {
    let dead = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let mut cp = instances(2, 2);
    let token = cp.token_file.to_str().unwrap().to_owned();
    let with = |endpoint: &str, args: &[&str]| {
        run_with(
            args,
            &[("NVPOOL_ENDPOINT", endpoint), ("NVPOOL_TOKEN_FILE", &token)],
        )
    };

    // A dead instance first: the live one answers.
    let live = format!("http://{}", cp.addrs[1]);
    let r = with(&format!("{dead},{live}"), &["target", "ls", "-o", "json"]);
    r.expect_ok();
    let v: Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 2, "{v}");

    // Both live: a change made through the first is seen by the second
    // alone once the first stops.
    cp.run(&["pool", "create", "p", "--device", "t0/d0,t1/d0"])
        .expect_ok();
    cp.stop(0);
    let v = cp.json(&["pool", "info", "p"]);
    assert_eq!(v["name"], "p", "{v}");
    cp.run(&[
        "volume", "create", "v1", "--size", "4M", "--layout", "concat", "--pool", "p",
    ])
    .expect_ok();
    let v = cp.json(&["volume", "info", "v1"]);
    assert_eq!(v["size_bytes"], 4 * MIB, "{v}");

    // None left: one line naming every endpoint.
    cp.stop(1);
    let all = cp.url();
    let r = cp.run(&["target", "ls"]);
    r.expect_error(
        1,
        &format!(
            "cannot reach the control plane at any of {}",
            all.replace(',', ", ")
        ),
    );
    for a in &cp.addrs {
        assert!(r.stderr.contains(&format!("http://{a}: ")), "{}", r.stderr);
    }
}
