//! The REST API over TLS: an in-process control plane serving https with
//! a throwaway CA, clients that trust it or not, plain HTTP against the
//! TLS port, the daemon refusing plain HTTP off loopback, and an unusable
//! `--target-cacert` stopping it at start.

use nvpool_control::api::{ApiServer, AuthConfig};
use nvpool_control::store::MemStore;
use nvpool_control::tls::{client_tls, ServerTls, TlsError};
use nvpool_control::{Cluster, StateConfig, SystemClock};
use nvpool_testkit::certs;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

fn server(certs: &certs::Certs) -> ApiServer {
    let cluster = Cluster::new(
        Arc::new(MemStore::new()),
        Arc::new(SystemClock),
        StateConfig::default(),
    )
    .unwrap();
    let tls = ServerTls::load(&certs.cert, &certs.key).unwrap();
    ApiServer::start_tls(
        Arc::new(cluster),
        AuthConfig::default(),
        "127.0.0.1:0".parse().unwrap(),
        Some(tls),
    )
    .unwrap()
}

fn agent(cacert: Option<&Path>) -> ureq::Agent {
    ureq::Agent::config_builder()
        .tls_config(client_tls(cacert).unwrap())
        .timeout_global(Some(Duration::from_secs(10)))
        .http_status_as_error(false)
        .proxy(None)
        .build()
        .into()
}

#[test]
fn https_round_trips_with_the_right_ca_only() {
    let dir = tempfile::tempdir().unwrap();
    let mine = certs::make(dir.path(), "mine");
    let other = certs::make(dir.path(), "other");
    let s = server(&mine);
    let port = s.addr.port();

    // The right CA, by IP and by name: the API answers.
    for host in ["127.0.0.1", "localhost"] {
        let mut r = agent(Some(&mine.ca))
            .get(format!("https://{host}:{port}/v1/targets"))
            .call()
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert_eq!(r.body_mut().read_to_string().unwrap().trim(), "[]");
    }

    // Another CA, or none: the handshake fails, saying why.
    for ca in [Some(other.ca.as_path()), None] {
        let e = agent(ca)
            .get(format!("https://127.0.0.1:{port}/healthz"))
            .call()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("certificate") && e.contains("UnknownIssuer"),
            "{e}"
        );
    }

    // Plain HTTP to the TLS port gets no HTTP answer.
    let r = agent(None)
        .get(format!("http://127.0.0.1:{port}/healthz"))
        .call();
    assert!(r.is_err(), "{r:?}");
    s.shutdown();
}

/// A handshake that fails (an instance whose certificate this client does
/// not trust) means the request never left: even a call that must not be
/// sent twice goes on to the next endpoint.
#[test]
fn a_call_made_once_fails_over_past_an_untrusted_instance() {
    use nvpool_control::http::{Call, Endpoints};
    let dir = tempfile::tempdir().unwrap();
    let mine = certs::make(dir.path(), "mine");
    let other = certs::make(dir.path(), "other");
    let untrusted = server(&other);
    let trusted = server(&mine);
    let bases = vec![
        format!("https://127.0.0.1:{}", untrusted.addr.port()),
        format!("https://127.0.0.1:{}", trusted.addr.port()),
    ];
    let client = agent(Some(&mine.ca));
    let endpoints = Endpoints::new(bases.clone());
    let mut tried = Vec::new();
    let r = endpoints
        .send(Call::Once, |base| {
            tried.push(base.to_owned());
            client.get(format!("{base}/v1/targets")).call()
        })
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(tried, bases);
}

#[test]
fn unusable_tls_files_are_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let a = certs::make(dir.path(), "a");
    let b = certs::make(dir.path(), "b");
    let missing = dir.path().join("nope.pem");
    let e = ServerTls::load(&missing, &a.key).unwrap_err();
    assert!(matches!(e, TlsError::Read { .. }) && e.to_string().starts_with("--tls-cert "));
    // A key that is not the certificate's.
    let e = ServerTls::load(&a.cert, &b.key).unwrap_err().to_string();
    assert!(
        e.starts_with("--tls-key ") && e.contains("does not go with"),
        "{e}"
    );
    // A certificate file given as the key: no key in it, and no key text
    // in the message.
    let e = ServerTls::load(&a.cert, &a.cert).unwrap_err().to_string();
    assert!(e.contains("no private key") && !e.contains("BEGIN"), "{e}");
    let e = client_tls(Some(&a.key)).unwrap_err().to_string();
    assert!(
        e.starts_with("--cacert ") && e.contains("no CERTIFICATE"),
        "{e}"
    );
}

#[test]
fn the_daemon_refuses_plain_http_off_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, "admin admin-secret-0123456789\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nvpool-control"))
        .args([
            "--listen",
            "0.0.0.0:0",
            "--store",
            "memory:",
            "--tokens-file",
        ])
        .arg(&tokens)
        .env_remove("NVPOOL_LOG")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains("refusing plain HTTP on 0.0.0.0:0") && last.contains("--insecure-http"),
        "{stderr}"
    );
    // A bad flag combination is clap's usage error.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nvpool-control"))
        .args(["--tls-cert", "x.pem", "--store", "memory:"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

/// An unusable `--target-cacert` stops the daemon before it serves: one
/// line naming the option and the file, exit status 2.
#[test]
fn an_unusable_target_cacert_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let not_pem = dir.path().join("not-a-ca.pem");
    std::fs::write(&not_pem, "hello\n").unwrap();
    for (file, why) in [
        ("/nonexistent/ca.pem", "cannot read it"),
        (not_pem.to_str().unwrap(), "no CERTIFICATE in it"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_nvpool-control"))
            .args(["--listen", "127.0.0.1:0", "--store", "memory:"])
            .args(["--target-cacert", file])
            .env("NVPOOL_LOG", "error")
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{e}");
        assert!(e.contains(&format!("--target-cacert {file}: {why}")), "{e}");
        assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    }
}
