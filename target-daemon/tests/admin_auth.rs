//! The daemon binary's admin API credentials: a token file (from the
//! command line or the environment, rotated by editing it), the state
//! directory's generated token that survives restarts, tokens kept out of
//! logs and the command line, plain HTTP off loopback only when asked
//! for, and https (`--admin-tls-cert`) anywhere. (Every route refusing a missing or wrong token is in admin_api.rs.)

mod common;

use common::*;
use nvpool_testkit::certs;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;

const PATIENCE: Duration = Duration::from_secs(15);

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
    let status = wait_exit("the daemon to stop", &mut child.0, PATIENCE);
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
    wait_for("the admin API", PATIENCE, || health(admin, None).is_some());
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
    wait_for("the admin API", PATIENCE, || health(admin, None).is_some());
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
    wait_for("the admin API again", PATIENCE, || {
        health(admin, None).is_some()
    });
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
    wait_for("the admin API", PATIENCE, || health(admin, None).is_some());
    assert_eq!(health(admin, Some(old)), Some(200));
    assert_eq!(health(admin, Some(new)), Some(401));
    // Rotation: the new token first, the old one still accepted ...
    std::fs::write(&file, format!("# rotated\n{new}\n{old}\n")).unwrap();
    wait_for("the new token", PATIENCE, || {
        health(admin, Some(new)) == Some(200)
    });
    assert_eq!(health(admin, Some(old)), Some(200));
    // ... then the old one gone.
    std::fs::write(&file, format!("{new}\n")).unwrap();
    wait_for("the old token to stop working", PATIENCE, || {
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

/// `GET /v1/health` over https trusting `ca`: the status, or the error.
fn https_health(admin: SocketAddr, ca: &Path, token: &str) -> Result<u16, String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .tls_config(nvpool_control::tls::client_tls(Some(ca)).unwrap())
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into();
    agent
        .get(format!("https://{admin}/v1/health"))
        .header("Authorization", format!("Bearer {token}"))
        .call()
        .map(|r| r.status().as_u16())
        .map_err(|e| e.to_string())
}

/// With a certificate the admin API serves https and may listen off
/// loopback without `--admin-insecure-http`; a client that does not trust
/// its CA gets no answer, and plain HTTP gets none either.
#[test]
fn tls_serves_the_admin_api_off_loopback() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let c = certs::make(dir.path(), "admin");
    let other = certs::make(dir.path(), "other");
    let port = free_port();
    let state = dir.path().join("state");
    let child = spawn(
        &format!("0.0.0.0:{port}"),
        &[
            "--admin-tls-cert",
            c.cert.to_str().unwrap(),
            "--admin-tls-key",
            c.key.to_str().unwrap(),
            "--state-dir",
            state.to_str().unwrap(),
        ],
        &[],
        &dir.path().join("log"),
    );
    let admin: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    wait_for("the admin API", PATIENCE, || {
        std::net::TcpStream::connect(admin).is_ok()
    });
    let token = std::fs::read_to_string(state.join("admin-token")).unwrap();
    let token = token.trim();
    assert_eq!(https_health(admin, &c.ca, token), Ok(200));
    assert_eq!(
        https_health(admin, &c.ca, "wrong-token-0123456789"),
        Ok(401)
    );
    let e = https_health(admin, &other.ca, token).unwrap_err();
    assert!(e.to_lowercase().contains("unknownissuer"), "{e}");
    // Plain HTTP to a TLS port: the handshake fails, nothing answers.
    let plain = std::panic::catch_unwind(|| http_auth(admin, None, "GET", "/v1/health", None));
    assert!(plain.is_err(), "plain HTTP was answered");
    stop(child);
}

/// A certificate without its key, or a key that is not the certificate's,
/// stops the daemon at start: one line naming the options, exit status 2.
#[test]
fn admin_tls_files_are_checked_at_start() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let a = certs::make(dir.path(), "a");
    let b = certs::make(dir.path(), "b");
    let run = |args: &[&str]| {
        let out = daemon_bin()
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .args(args)
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), e)
    };
    let (code, e) = run(&["--admin-tls-cert", a.cert.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{e}");
    assert!(e.contains("--admin-tls-key"), "{e}");
    let (cert, key) = (a.cert.to_str().unwrap(), b.key.to_str().unwrap());
    let (code, e) = run(&["--admin-tls-cert", cert, "--admin-tls-key", key]);
    assert_eq!(code, Some(2), "{e}");
    assert!(
        e.contains(&format!(
            "--admin-tls-key {key}: does not go with --admin-tls-cert"
        )),
        "{e}"
    );
    assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    assert!(!e.contains("PRIVATE KEY"), "{e}");
}
