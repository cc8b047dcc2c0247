//! The agent's metrics listener: https with `--metrics-tls-cert`, verified
//! against its CA; plain HTTP beyond loopback only when asked for; unusable
//! certificate files a usage error (exit 2, one line) before anything runs.

use nvpool_api::tls::client_tls;
use nvpool_testkit::{certs, free_port};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn agent_command(run_dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_nvpool-agent"));
    c.env("NVPOOL_RUN_DIR", run_dir).env("NVPOOL_LOG", "warn");
    c
}

/// Kills the agent when the test ends, however it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        // SAFETY: signalling our own child by its pid.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let _ = self.0.wait();
    }
}

fn https_agent(ca: Option<&Path>) -> ureq::Agent {
    ureq::Agent::config_builder()
        .tls_config(client_tls(ca).unwrap())
        .timeout_global(Some(Duration::from_secs(5)))
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into()
}

#[test]
fn metrics_are_served_over_https_to_clients_that_trust_the_ca() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mine = certs::make(dir.path(), "mine");
    let other = certs::make(dir.path(), "other");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let run = Running(
        agent_command(&dir.path().join("run"))
            .args(["--metrics-listen", &listen])
            .arg("--metrics-tls-cert")
            .arg(&mine.cert)
            .arg("--metrics-tls-key")
            .arg(&mine.key)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let url = format!("https://127.0.0.1:{port}/metrics");
    let deadline = Instant::now() + Duration::from_secs(20);
    let body = loop {
        match https_agent(Some(&mine.ca)).get(&url).call() {
            Ok(mut r) => {
                assert_eq!(r.status().as_u16(), 200);
                break r.body_mut().read_to_string().unwrap();
            }
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("the agent's https metrics never answered: {e}"),
        }
    };
    assert!(body.contains("# TYPE"), "{body}");
    // Another CA's client refuses it; plain HTTP gets no answer.
    let e = https_agent(Some(&other.ca)).get(&url).call().unwrap_err();
    assert!(e.to_string().to_lowercase().contains("certificate"), "{e}");
    let plain = https_agent(None)
        .get(&format!("http://127.0.0.1:{port}/metrics"))
        .call();
    assert!(
        plain.is_err() || plain.is_ok_and(|r| r.status().as_u16() != 200),
        "plain HTTP was answered"
    );
    drop(run);
}

#[test]
fn plain_metrics_beyond_loopback_and_bad_certificates_are_usage_errors() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let run_dir = dir.path().join("run");
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "hello\n").unwrap();
    let cases: [(Vec<&str>, &str); 3] = [
        (
            vec!["--metrics-listen", "0.0.0.0:0"],
            "--metrics-insecure-http",
        ),
        (
            vec![
                "--metrics-listen",
                "127.0.0.1:0",
                "--metrics-tls-cert",
                junk.to_str().unwrap(),
                "--metrics-tls-key",
                junk.to_str().unwrap(),
            ],
            "--metrics-tls-cert",
        ),
        (
            vec![
                "--metrics-listen",
                "127.0.0.1:0",
                "--metrics-tls-cert",
                "/nonexistent/cert.pem",
                "--metrics-tls-key",
                "/nonexistent/key.pem",
            ],
            "cannot read it",
        ),
    ];
    for (args, says) in cases {
        let out = agent_command(&run_dir).args(&args).output().unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {e}");
        assert!(e.contains(says), "{args:?}: {e}");
        assert_eq!(e.trim_end().lines().count(), 1, "{e}");
        // Nothing was started.
        assert!(!run_dir.exists(), "{args:?}");
    }
}
