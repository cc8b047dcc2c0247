//! The `nvpool` binary against an in-process nvpool-target on loopback:
//! discovery and bench output, and the exit-code contract (0 success,
//! 1 failure, 2 usage error; every error is one `nvpool:` line on stderr).

use nvpool_target::Target;
use nvpool_testkit::target::{loopback, start, subsystem, Serving};
use serde_json::Value;
use std::io::Read;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SUBNQN: &str = "nqn.2026-11.io.nvpool:cli-disk";
const HIDDEN_NQN: &str = "nqn.2026-11.io.nvpool:cli-hidden";
const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-2222-4000-8000-00000000000a";
const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-2222-4000-8000-00000000000b";
/// Longest one run of the binary may take before the test kills it.
const RUN_LIMIT: Duration = Duration::from_secs(30);

/// An in-process target on 127.0.0.1, port 0: SUBNQN (a 16 MiB RAM disk,
/// any host) and HIDDEN_NQN (host B only).
struct Tgt {
    _serving: Serving,
    addr: SocketAddr,
}

impl Tgt {
    fn start() -> Tgt {
        let target: Arc<Target> = Target::new(None).expect("target");
        target
            .put_subsystem(&subsystem(SUBNQN, &[], &[(1, "ram:16M")]))
            .expect("subsystem");
        target
            .put_subsystem(&subsystem(HIDDEN_NQN, &[HOST_B], &[(1, "ram:1M")]))
            .expect("subsystem");
        Tgt::serve(&target)
    }

    /// Starts `target` on loopback.
    fn serve(target: &Arc<Target>) -> Tgt {
        let serving = start(target, &loopback());
        Tgt {
            addr: serving.addr,
            _serving: serving,
        }
    }

    fn port(&self) -> String {
        self.addr.port().to_string()
    }
}

/// What one run of the binary did.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    #[track_caller]
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{}", self.stdout))
    }

    /// Exit code `code` and exactly one stderr line starting `nvpool:`.
    #[track_caller]
    fn expect_one_line_error(&self, code: i32) -> &str {
        assert_eq!(self.code, code, "exit code; {self:#?}");
        let lines: Vec<&str> = self.stderr.lines().collect();
        assert_eq!(lines.len(), 1, "one stderr line; {self:#?}");
        assert!(lines[0].starts_with("nvpool: "), "{self:#?}");
        assert!(self.stdout.is_empty(), "nothing on stdout; {self:#?}");
        lines[0]
    }
}

/// Runs `nvpool ARGS` with a clean log setting, killing it after RUN_LIMIT.
#[track_caller]
fn nvpool(args: &[&str]) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_nvpool"))
        .args(args)
        .env_remove("NVPOOL_LOG")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn nvpool");
    // Drain both pipes on threads so a chatty child never blocks.
    let mut so = child.stdout.take().expect("stdout");
    let mut se = child.stderr.take().expect("stderr");
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + RUN_LIMIT;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("nvpool {args:?} still running after {RUN_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Run {
        code: status.code().expect("exited, not killed by a signal"),
        stdout: out_t.join().expect("stdout reader"),
        stderr: err_t.join().expect("stderr reader"),
    }
}

/// A loopback port nothing listens on (a target was there a moment ago).
fn dead_port() -> String {
    let t = Tgt::start();
    let p = t.port();
    drop(t);
    p
}

// ----- discover -----

#[test]
fn discover_table_lists_the_subsystem() {
    let t = Tgt::start();
    let r = nvpool(&["discover", "-a", "127.0.0.1", "-s", &t.port(), "-q", HOST_A]);
    assert_eq!(r.code, 0, "{r:#?}");
    assert!(r.stdout.contains(SUBNQN), "{}", r.stdout);
    assert!(
        !r.stdout.contains(HIDDEN_NQN),
        "host A may not see it: {}",
        r.stdout
    );
    assert!(
        r.stdout.contains(nvpool_wire::DISCOVERY_NQN),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains(&t.port()), "{}", r.stdout);
    assert!(r.stderr.is_empty(), "{}", r.stderr);
    // Without -q the host identity comes from /etc/nvme or is generated;
    // the open subsystem is listed either way.
    let r = nvpool(&["discover", "-a", "127.0.0.1", "-s", &t.port()]);
    assert_eq!(r.code, 0, "{r:#?}");
    assert!(r.stdout.contains(SUBNQN), "{}", r.stdout);
}

/// A reader that goes away before the output is printed (`nvpool … | head`)
/// ends the command quietly, by SIGPIPE as any Unix tool, never with a
/// panic message on stderr.
#[test]
fn a_reader_that_went_away_ends_the_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let t = Tgt::start();
    let mut child = Command::new(env!("CARGO_BIN_EXE_nvpool"))
        .args(["discover", "-a", "127.0.0.1", "-s", &t.port(), "-q", HOST_A])
        .env_remove("NVPOOL_LOG")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn nvpool");
    // Closed before the command prints anything.
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?} {stderr}",
        out.status
    );
}

#[test]
fn discover_json_has_records_with_subnqn() {
    let t = Tgt::start();
    let r = nvpool(&[
        "discover",
        "--traddr",
        "127.0.0.1",
        "--trsvcid",
        &t.port(),
        "--hostnqn",
        HOST_B,
        "-o",
        "json",
    ]);
    assert_eq!(r.code, 0, "{r:#?}");
    let v = r.json();
    let records = v["records"].as_array().expect("records[]");
    let nqns: Vec<&str> = records
        .iter()
        .map(|x| x["subnqn"].as_str().expect("subnqn is a string"))
        .collect();
    assert!(nqns.contains(&SUBNQN), "{nqns:?}");
    assert!(nqns.contains(&HIDDEN_NQN), "host B sees it: {nqns:?}");
    for rec in records {
        assert_eq!(rec["trtype"], "tcp");
        assert_eq!(rec["traddr"], "127.0.0.1");
        assert_eq!(rec["trsvcid"], t.port().as_str());
    }
}

#[test]
fn discover_of_nothing_listening_fails_in_one_line() {
    let port = dead_port();
    let r = nvpool(&["discover", "-a", "127.0.0.1", "-s", &port, "-q", HOST_A]);
    let line = r.expect_one_line_error(1);
    assert!(line.contains(&port), "{line}");
}

// ----- bench -----

/// Runs a bench as host A against SUBNQN with JSON output and checks the
/// universal invariants; returns the report.
#[track_caller]
fn bench(t: &Tgt, extra: &[&str]) -> Value {
    let port = t.port();
    let mut args = vec![
        "bench",
        "-a",
        "127.0.0.1",
        "-s",
        &port,
        "-n",
        SUBNQN,
        "-q",
        HOST_A,
        "-o",
        "json",
    ];
    args.extend_from_slice(extra);
    let r = nvpool(&args);
    assert_eq!(r.code, 0, "{r:#?}");
    let v = r.json();
    let ops = v["ops"].as_u64().expect("ops");
    assert!(ops > 0, "{v:#}");
    assert_eq!(v["errors"], 0, "{v:#}");
    assert_eq!(v["verify"]["failed"], 0, "{v:#}");
    let p50 = v["lat_us"]["p50"].as_f64().expect("p50");
    let p99 = v["lat_us"]["p99"].as_f64().expect("p99");
    let max = v["lat_us"]["max"].as_f64().expect("max");
    assert!(p50 > 0.0, "{v:#}");
    assert!(p99 >= p50, "{v:#}");
    assert!(max >= p99, "{v:#}");
    assert!(v["iops"].as_f64().expect("iops") > 0.0);
    assert_eq!(v["nqn"], SUBNQN);
    v
}

#[test]
fn bench_randwrite_verify_json() {
    let t = Tgt::start();
    let v = bench(&t, &["--rw", "randwrite", "--verify", "--runtime", "1s"]);
    assert_eq!(v["rw"], "randwrite");
    assert_eq!(v["bs"], 4096);
    assert_eq!(v["iodepth"], 1);
    assert_eq!(v["jobs"], 1);
    assert!(
        v["verify"]["checked"].as_u64().expect("checked") > 0,
        "{v:#}"
    );
    let secs = v["runtime_s"].as_f64().expect("runtime");
    assert!((0.9..5.0).contains(&secs), "runtime {secs}");
    let bw = v["bw_bytes_per_sec"].as_f64().expect("bw");
    let iops = v["iops"].as_f64().expect("iops");
    assert!((bw - iops * 4096.0).abs() < 1.0, "{v:#}");
}

#[test]
fn bench_randrw_two_jobs_depth_eight_with_digests() {
    let t = Tgt::start();
    let v = bench(
        &t,
        &[
            "--rw",
            "randrw",
            "--jobs",
            "2",
            "--iodepth",
            "8",
            "--verify",
            "-g",
            "-G",
            "--runtime",
            "1s",
        ],
    );
    assert_eq!(v["jobs"], 2);
    assert_eq!(v["iodepth"], 8);
    assert_eq!(v["rw"], "randrw");
}

#[test]
fn bench_sequential_read_128k() {
    let t = Tgt::start();
    let v = bench(
        &t,
        &[
            "--rw",
            "read",
            "--bs",
            "128k",
            "--iodepth",
            "4",
            "--runtime",
            "500ms",
        ],
    );
    assert_eq!(v["bs"], 128 << 10);
    let bw = v["bw_bytes_per_sec"].as_f64().expect("bw");
    assert!(bw > 0.0);
}

#[test]
fn bench_table_output() {
    let t = Tgt::start();
    let port = t.port();
    let r = nvpool(&[
        "bench",
        "-a",
        "127.0.0.1",
        "-s",
        &port,
        "-n",
        SUBNQN,
        "-q",
        HOST_A,
        "--rw",
        "write",
        "--verify",
        "--runtime",
        "300ms",
    ]);
    assert_eq!(r.code, 0, "{r:#?}");
    assert!(r.stdout.contains("IOPS"), "{}", r.stdout);
    assert!(r.stdout.contains("verify:"), "{}", r.stdout);
    assert!(r.stdout.contains(" 0 failed"), "{}", r.stdout);
}

/// With `--verify`, two writes to the same block may be in flight at once
/// (random offsets over a small `--size`). NVMe does not order outstanding
/// commands, so either may land last; the verifier must accept both
/// instead of reporting "stale data".
#[test]
fn bench_verify_with_overlapping_writes_on_a_file() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let img = dir.path().join("disk.img");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(16 << 20))
        .expect("image");
    let target = Target::new(None).expect("target");
    let spec = format!("file:{}", img.display());
    target
        .put_subsystem(&subsystem(SUBNQN, &[], &[(1, spec.as_str())]))
        .expect("subsystem");
    let t = Tgt::serve(&target);
    bench(
        &t,
        &[
            "--rw",
            "randwrite",
            "--verify",
            "--iodepth",
            "32",
            "--size",
            "64k",
            "--runtime",
            "1s",
        ],
    );
}

// ----- exit codes and one-line errors -----

#[test]
fn usage_errors_exit_2_with_one_line() {
    let cases: &[&[&str]] = &[
        &["bench", "--bogus"],
        &["--bogus"],
        &["frobnicate"],
        &[
            "bench",
            "-a",
            "127.0.0.1",
            "-n",
            SUBNQN,
            "--rw",
            "read",
            "--bs",
            "4q",
        ],
        &[
            "bench",
            "-a",
            "127.0.0.1",
            "-n",
            SUBNQN,
            "--rw",
            "read",
            "--iodepth",
            "0",
        ],
        &["bench", "-a", "127.0.0.1", "--rw", "read"],
        &["bench", "-a", "127.0.0.1", "-n", SUBNQN, "--rw", "sideways"],
        &[
            "bench",
            "-a",
            "127.0.0.1",
            "-n",
            SUBNQN,
            "--rw",
            "read",
            "--runtime",
            "3h",
        ],
        &[
            "bench",
            "-a",
            "127.0.0.1",
            "-n",
            SUBNQN,
            "--rw",
            "read",
            "-s",
            "70000",
        ],
        &["discover"],
        &["discover", "-a", "127.0.0.1", "-o", "xml"],
        &["discover", "-t", "fc", "-a", "127.0.0.1"],
        &[
            "bench",
            "-t",
            "ib",
            "-a",
            "127.0.0.1",
            "-n",
            SUBNQN,
            "--rw",
            "read",
        ],
        &[
            "bench",
            "-t",
            "rdma",
            "-a",
            "127.0.0.1",
            "-n",
            SUBNQN,
            "--rw",
            "read",
            "-G",
        ],
    ];
    for args in cases {
        let r = nvpool(args);
        let line = r.expect_one_line_error(2);
        assert!(line.len() > "nvpool: ".len() + 5, "{args:?}: {line}");
        assert!(!line.contains("error:"), "no doubled prefix: {line}");
    }
}

#[test]
fn usage_error_names_what_is_wrong() {
    let r = nvpool(&[
        "bench",
        "-a",
        "127.0.0.1",
        "-n",
        SUBNQN,
        "--rw",
        "read",
        "--bs",
        "4q",
    ]);
    assert!(r.expect_one_line_error(2).contains("4q"), "{r:#?}");
    let r = nvpool(&[
        "bench",
        "-a",
        "127.0.0.1",
        "-n",
        SUBNQN,
        "--rw",
        "read",
        "--iodepth",
        "0",
    ]);
    assert!(r.expect_one_line_error(2).contains("iodepth"), "{r:#?}");
    let r = nvpool(&["bench", "--bogus"]);
    assert!(r.expect_one_line_error(2).contains("--bogus"), "{r:#?}");
}

/// clap reports missing arguments over two lines ("the following required
/// arguments were not provided:" then the list); keeping only the first
/// loses the one thing the user needs to know.
#[test]
fn missing_argument_error_names_the_argument() {
    let r = nvpool(&["bench", "-a", "127.0.0.1", "--rw", "read"]);
    let line = r.expect_one_line_error(2);
    assert!(line.contains("--nqn"), "{line}");
}

/// Without RDMA on this machine, `-t rdma` fails in one line saying why
/// (what `nvpool_rdma::available` says), never with a panic. With RDMA, a
/// loopback address has no RDMA device: still one line, exit 1.
#[test]
fn rdma_where_there_is_none_fails_in_one_line() {
    let why = nvpool_rdma::available().err();
    for args in [
        &["discover", "-t", "rdma", "-a", "127.0.0.1"][..],
        &[
            "bench",
            "-t",
            "rdma",
            "-a",
            "127.0.0.1",
            "-n",
            SUBNQN,
            "--rw",
            "read",
            "--runtime",
            "200ms",
        ][..],
    ] {
        let r = nvpool(args);
        let line = r.expect_one_line_error(1);
        if let Some(why) = &why {
            assert!(line.contains("RDMA unavailable"), "{args:?}: {line}");
            assert!(line.contains(why.as_str()), "{args:?}: {line}");
        }
    }
}

#[test]
fn runtime_errors_exit_1_with_one_line() {
    let t = Tgt::start();
    let port = t.port();
    // Nothing listening.
    let dead = dead_port();
    let r = nvpool(&[
        "bench",
        "-a",
        "127.0.0.1",
        "-s",
        &dead,
        "-n",
        SUBNQN,
        "-q",
        HOST_A,
        "--rw",
        "read",
        "--runtime",
        "200ms",
    ]);
    let line = r.expect_one_line_error(1);
    assert!(line.contains(&dead), "{line}");
    // Unknown subsystem.
    let r = nvpool(&[
        "bench",
        "-a",
        "127.0.0.1",
        "-s",
        &port,
        "-n",
        "nqn.2026-11.io.nvpool:no-such",
        "-q",
        HOST_A,
        "--rw",
        "read",
        "--runtime",
        "200ms",
    ]);
    let line = r.expect_one_line_error(1);
    assert!(line.contains("no-such"), "{line}");
    // A subsystem this host may not use.
    let r = nvpool(&[
        "bench",
        "-a",
        "127.0.0.1",
        "-s",
        &port,
        "-n",
        HIDDEN_NQN,
        "-q",
        HOST_A,
        "--rw",
        "read",
        "--runtime",
        "200ms",
    ]);
    r.expect_one_line_error(1);
    // A namespace that does not exist.
    let r = nvpool(&[
        "bench",
        "-a",
        "127.0.0.1",
        "-s",
        &port,
        "-n",
        SUBNQN,
        "-q",
        HOST_A,
        "--nsid",
        "9",
        "--rw",
        "read",
        "--runtime",
        "200ms",
    ]);
    r.expect_one_line_error(1);
    // A block size beyond the controller's MDTS, and one not a multiple of 512.
    for bs in ["1m", "1000"] {
        let r = nvpool(&[
            "bench",
            "-a",
            "127.0.0.1",
            "-s",
            &port,
            "-n",
            SUBNQN,
            "-q",
            HOST_A,
            "--rw",
            "read",
            "--bs",
            bs,
            "--runtime",
            "200ms",
        ]);
        r.expect_one_line_error(1);
    }
    // A host name that does not resolve.
    let r = nvpool(&["discover", "-a", "no-such-host.invalid", "-q", HOST_A]);
    r.expect_one_line_error(1);
}

#[test]
fn help_and_version_exit_0() {
    for args in [
        &["--help"][..],
        &["bench", "--help"],
        &["discover", "--help"],
        &["help", "bench"],
        &["-h"],
        &["--version"],
    ] {
        let r = nvpool(args);
        assert_eq!(r.code, 0, "{args:?}: {r:#?}");
        assert!(!r.stdout.is_empty(), "{args:?} prints to stdout");
    }
    let r = nvpool(&["bench", "--help"]);
    for flag in [
        "--traddr",
        "--nqn",
        "--rw",
        "--bs",
        "--iodepth",
        "--verify",
        "--runtime",
    ] {
        assert!(r.stdout.contains(flag), "bench --help lists {flag}");
    }
}
