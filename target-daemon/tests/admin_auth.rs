//! The daemon binary's admin API credentials: a token file (from the
//! command line or the environment, rotated by editing it), the state
//! directory's generated token that survives restarts, tokens kept out of
//! logs and the command line, and plain HTTP off loopback only when asked
//! for. (Every route refusing a missing or wrong token is in admin_api.rs.)

mod common;

use common::*;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const PATIENCE: Duration = Duration::from_secs(15);

#[track_caller]
fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < PATIENCE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A loopback port nothing listens on (for the daemon to take).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The status of `GET /v1/health` with `token` (None: no header), or None
/// while nothing answers.
fn health(admin: SocketAddr, token: Option<&str>) -> Option<u16> {
    std::net::TcpStream::connect(admin).ok()?;
    let auth = token.map(|t| format!("Bearer {t}"));
    Some(http_auth(admin, auth.as_deref(), "GET", "/v1/health", None).status)
}

/// A daemon process, killed if a test fails before it stops it.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    fn id(&self) -> u32 {
        self.0.id()
    }
}

/// The daemon on a free I/O port and the admin API on `admin`, logging at
/// info level to `log`.
fn spawn(admin: &str, extra: &[&str], envs: &[(&str, &Path)], log: &Path) -> Proc {
    let mut c = daemon_bin();
    c.args(["--listen", "127.0.0.1:0", "--admin-listen", admin])
        .args(["--no-io-uring", "--reactors", "1"])
        .args(extra)
        .env("NVPOOL_LOG", "info")
        .stderr(Stdio::from(std::fs::File::create(log).unwrap()));
    for (k, v) in envs {
        c.env(k, v);
    }
    Proc(c.spawn().unwrap())
}

/// SIGTERM, and the daemon must exit 0.
fn stop(mut child: Proc) {
    // SAFETY: kill has no memory preconditions; the pid is our child's.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < PATIENCE, "the daemon did not stop");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
}

#[test]
fn plain_http_off_loopback_must_be_asked_for() {
    let e = start_error(&["--admin-listen", "0.0.0.0:0"]);
    assert!(e.contains("--admin-insecure-http"), "{e}");
    assert!(e.contains("0.0.0.0:0"), "{e}");
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");

    // Asked for: it listens everywhere, and still wants its token.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let port = free_port();
    let state = dir.path().join("state");
    let child = spawn(
        &format!("0.0.0.0:{port}"),
        &[
            "--admin-insecure-http",
            "--state-dir",
            state.to_str().unwrap(),
        ],
        &[],
        &dir.path().join("log"),
    );
    let admin: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_for("the admin API", || health(admin, None).is_some());
    assert_eq!(health(admin, None), Some(401));
    let token = std::fs::read_to_string(state.join("admin-token")).unwrap();
    assert_eq!(health(admin, Some(token.trim())), Some(200));
    stop(child);
}

#[test]
fn the_state_dir_keeps_a_private_token_across_restarts() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let state = dir.path().join("state");
    let token_file = state.join("admin-token");
    let log = dir.path().join("log");
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let state_arg = state.to_str().unwrap();
    let child = spawn(&admin.to_string(), &["--state-dir", state_arg], &[], &log);
    wait_for("the admin API", || health(admin, None).is_some());
    let token = std::fs::read_to_string(&token_file).unwrap();
    let token = token.trim().to_owned();
    assert_eq!(token.len(), 64, "256 bits in hex");
    let mode = std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert_eq!(health(admin, None), Some(401));
    assert_eq!(health(admin, Some("wrong-token-0123456789")), Some(401));
    assert_eq!(health(admin, Some(&token)), Some(200));
    // Not on the command line (ps).
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", child.id())).unwrap();
    assert!(!String::from_utf8_lossy(&cmdline).contains(&token));
    stop(child);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains(&token_file.display().to_string()), "{text}");
    assert!(!text.contains(&token), "the token was logged: {text}");
    assert!(text.contains("admin API request refused"), "{text}");

    // The next start reuses it.
    let child = spawn(&admin.to_string(), &["--state-dir", state_arg], &[], &log);
    wait_for("the admin API again", || health(admin, None).is_some());
    assert_eq!(health(admin, Some(&token)), Some(200));
    assert_eq!(std::fs::read_to_string(&token_file).unwrap().trim(), token);
    stop(child);
    assert!(!std::fs::read_to_string(&log).unwrap().contains(&token));
}

#[test]
fn a_token_file_from_the_environment_rotates_without_a_restart() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let file = dir.path().join("admin-tokens");
    let (old, new) = ("old-admin-token-0123456789", "new-admin-token-9876543210");
    std::fs::write(&file, format!("{old}\n")).unwrap();
    let log = dir.path().join("log");
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let child = spawn(
        &admin.to_string(),
        &[],
        &[("NVPOOL_TARGET_ADMIN_TOKEN_FILE", &file)],
        &log,
    );
    wait_for("the admin API", || health(admin, None).is_some());
    assert_eq!(health(admin, Some(old)), Some(200));
    assert_eq!(health(admin, Some(new)), Some(401));
    // Rotation: the new token first, the old one still accepted ...
    std::fs::write(&file, format!("# rotated\n{new}\n{old}\n")).unwrap();
    wait_for("the new token", || health(admin, Some(new)) == Some(200));
    assert_eq!(health(admin, Some(old)), Some(200));
    // ... then the old one gone.
    std::fs::write(&file, format!("{new}\n")).unwrap();
    wait_for("the old token to stop working", || {
        health(admin, Some(old)) == Some(401)
    });
    assert_eq!(health(admin, Some(new)), Some(200));
    // A broken edit keeps the tokens there were.
    std::fs::write(&file, "short\n").unwrap();
    std::thread::sleep(Duration::from_millis(1_200));
    assert_eq!(health(admin, Some(new)), Some(200));
    stop(child);
    let text = std::fs::read_to_string(&log).unwrap();
    for t in [old, new, "short"] {
        assert!(!text.contains(t), "a token was logged: {text}");
    }
}

#[test]
fn an_unusable_token_file_stops_the_daemon_at_start() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let file = dir.path().join("admin-tokens");
    let f = file.to_str().unwrap();
    let e = start_error(&["--admin-token-file", f]);
    assert!(e.contains(f) && e.contains("cannot read"), "{e}");
    std::fs::write(&file, "good-token-0123456789\nnot a token at all\n").unwrap();
    let e = start_error(&["--admin-token-file", f]);
    assert!(e.contains(f) && e.contains("line 2"), "{e}");
    assert!(
        !e.contains("not a token at all") && !e.contains("good-token"),
        "{e}"
    );
    std::fs::write(&file, "# nothing\n").unwrap();
    let e = start_error(&["--admin-token-file", f]);
    assert!(e.contains("no token"), "{e}");
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
}
