//! TLS for nvpool's REST APIs, rustls with the ring provider (the one
//! etcd-client's gRPC already brings): the client trust every ureq agent
//! of a REST client gets ([`client_tls`], feature `client`), and the
//! serving side ([`ServerTls`], [`TlsListener`], feature `server`),
//! shared by `nvpool-control` and the target's admin API.
//!
//! ```text
//!   --tls-cert/--tls-key ─► ServerTls::load ─► TlsListener::bind
//!                                                 ├─ accept task: TCP accept
//!                                                 │    └─ one task per handshake
//!                                                 │       (≤ TLS_HANDSHAKES_MAX, each ≤ TLS_HANDSHAKE_TIMEOUT_MS)
//!                                                 └─ bounded channel ─► axum::serve
//!   --cacert FILE ─► client_tls ─► ureq agent (server name verified, no opt-out)
//! ```
//!
//! A server without a certificate serves plain HTTP only on loopback, or
//! when its insecure flag says so ([`check_plain_http`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The CA bundle an https client trusts without `--cacert` (Debian's).
pub const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Why TLS material cannot be used. Names the file, never its content.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{flag} {path}: cannot read it")]
    Read {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{flag} {path}: {reason}")]
    Invalid {
        flag: &'static str,
        path: PathBuf,
        reason: String,
    },
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        flag,
        path: path.to_owned(),
        source,
    })
}

fn invalid(flag: &'static str, path: &Path, reason: impl Into<String>) -> TlsError {
    TlsError::Invalid {
        flag,
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// The ring provider, for every rustls config here.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The TLS settings of a REST client's ureq agent: trust the CA
/// certificates in `cacert` (PEM), else the system bundle when there is
/// one, else nothing (every https call then fails, saying the issuer is
/// unknown). Server names are always verified.
#[cfg(feature = "client")]
pub fn client_tls(cacert: Option<&Path>) -> Result<ureq::tls::TlsConfig, TlsError> {
    client_tls_for("--cacert", cacert)
}

/// [`client_tls`] for a program whose option is not `--cacert`
/// (`nvpool-target --control-plane-cacert`): `flag` names it in errors.
#[cfg(feature = "client")]
pub fn client_tls_for(
    flag: &'static str,
    cacert: Option<&Path>,
) -> Result<ureq::tls::TlsConfig, TlsError> {
    match cacert {
        Some(path) => {
            let roots = pem_certs(flag, path)?;
            if roots.is_empty() {
                return Err(invalid(flag, path, "no CERTIFICATE in it"));
            }
            Ok(client_config(roots))
        }
        None => Ok(client_tls_system()),
    }
}

/// [`client_tls`] without a file: the system bundle's CAs; a bundle that
/// is missing or not PEM means none.
#[cfg(feature = "client")]
pub fn client_tls_system() -> ureq::tls::TlsConfig {
    let path = Path::new(SYSTEM_CA_BUNDLE);
    client_config(pem_certs("system CA bundle", path).unwrap_or_default())
}

#[cfg(feature = "client")]
fn pem_certs(
    flag: &'static str,
    path: &Path,
) -> Result<Vec<ureq::tls::Certificate<'static>>, TlsError> {
    use ureq::tls::{parse_pem, PemItem};
    let pem = read(flag, path)?;
    let mut roots = Vec::new();
    for item in parse_pem(&pem) {
        match item {
            Ok(PemItem::Certificate(c)) => roots.push(c),
            Ok(_) => {}
            Err(e) => return Err(invalid(flag, path, format!("not PEM: {e}"))),
        }
    }
    Ok(roots)
}

#[cfg(feature = "client")]
fn client_config(roots: Vec<ureq::tls::Certificate<'static>>) -> ureq::tls::TlsConfig {
    use ureq::tls::{RootCerts, TlsConfig, TlsProvider};
    TlsConfig::builder()
        .provider(TlsProvider::Rustls)
        .unversioned_rustls_crypto_provider(provider())
        .root_certs(RootCerts::new_with_certs(&roots))
        .build()
}

/// Refuses plain HTTP off loopback unless the operator asked for it
/// (`insecure_flag`, named in the one-line error).
pub fn check_plain_http(
    listen: SocketAddr,
    insecure: bool,
    insecure_flag: &str,
) -> Result<(), String> {
    if listen.ip().is_loopback() || insecure {
        return Ok(());
    }
    Err(format!(
        "refusing plain HTTP on {listen}: bearer tokens would cross the network in clear; \
         give --tls-cert and --tls-key, listen on a loopback address, or pass {insecure_flag}"
    ))
}

#[cfg(feature = "server")]
pub use server::{ServerTls, TlsListener, TLS_HANDSHAKES_MAX, TLS_HANDSHAKE_TIMEOUT_MS};

#[cfg(feature = "server")]
mod server {
    use super::{invalid, provider, read, TlsError};
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use std::net::SocketAddr;
    use std::path::Path;
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::net::{TcpListener, TcpStream};
    use tokio_rustls::server::TlsStream;
    use tokio_rustls::TlsAcceptor;

    /// Handshakes under way at once: a peer that opens connections and
    /// never finishes one holds at most this many tasks and sockets.
    pub const TLS_HANDSHAKES_MAX: usize = 64;
    /// One handshake, first byte to last: a LAN peer needs milliseconds; a
    /// stalled one is dropped well before it could pile up.
    pub const TLS_HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
    /// Finished handshakes waiting for the server to take them.
    const TLS_READY_MAX: usize = TLS_HANDSHAKES_MAX;

    /// A certificate chain and its key, loaded and checked at start.
    #[derive(Clone)]
    pub struct ServerTls {
        config: Arc<rustls::ServerConfig>,
    }

    impl std::fmt::Debug for ServerTls {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("ServerTls(..)")
        }
    }

    impl ServerTls {
        /// `cert`: the server's certificate chain (PEM, leaf first);
        /// `key`: its private key (PEM: PKCS#8, PKCS#1 or SEC1).
        pub fn load(cert: &Path, key: &Path) -> Result<ServerTls, TlsError> {
            ServerTls::load_for(("--tls-cert", cert), ("--tls-key", key))
        }

        /// [`ServerTls::load`] for a program whose options have other
        /// names (`nvpool-target --admin-tls-cert`): each path comes with
        /// the option errors name.
        pub fn load_for(
            (cert_flag, cert): (&'static str, &Path),
            (key_flag, key): (&'static str, &Path),
        ) -> Result<ServerTls, TlsError> {
            let pem = read(cert_flag, cert)?;
            let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<_, _>>()
                .map_err(|e| invalid(cert_flag, cert, format!("not PEM: {e}")))?;
            if chain.is_empty() {
                return Err(invalid(cert_flag, cert, "no CERTIFICATE in it"));
            }
            let pem = read(key_flag, key)?;
            // The error of a key file never quotes it.
            let private = PrivateKeyDer::from_pem_slice(&pem)
                .map_err(|_| invalid(key_flag, key, "no private key (PEM) in it"))?;
            let config = rustls::ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .map_err(|e| invalid(cert_flag, cert, e.to_string()))?
                .with_no_client_auth()
                .with_single_cert(chain, private)
                .map_err(|e| {
                    invalid(key_flag, key, format!("does not go with {cert_flag}: {e}"))
                })?;
            Ok(ServerTls {
                config: Arc::new(config),
            })
        }
    }

    /// A TCP listener whose connections come out TLS-established, for
    /// `axum::serve`. Handshakes run in their own tasks, so a slow or
    /// silent peer never holds up the accept loop. Create it inside a
    /// tokio runtime (it spawns the accept task there).
    #[derive(Debug)]
    pub struct TlsListener {
        ready: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
        local: SocketAddr,
        accept: tokio::task::JoinHandle<()>,
    }

    impl Drop for TlsListener {
        fn drop(&mut self) {
            self.accept.abort();
        }
    }

    impl TlsListener {
        pub fn new(listener: TcpListener, tls: &ServerTls) -> std::io::Result<TlsListener> {
            let local = listener.local_addr()?;
            let (tx, ready) = tokio::sync::mpsc::channel(TLS_READY_MAX);
            let acceptor = TlsAcceptor::from(tls.config.clone());
            let slots = Arc::new(tokio::sync::Semaphore::new(TLS_HANDSHAKES_MAX));
            let accept = tokio::spawn(async move {
                loop {
                    let Ok(slot) = slots.clone().acquire_owned().await else {
                        return;
                    };
                    let (tcp, peer) = match listener.accept().await {
                        Ok(x) => x,
                        Err(e) => {
                            // Out of descriptors and the like: wait, as
                            // axum's own listener does.
                            tracing::warn!(error = %e, "accepting a connection");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            continue;
                        }
                    };
                    let acceptor = acceptor.clone();
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        let limit = Duration::from_millis(TLS_HANDSHAKE_TIMEOUT_MS);
                        let done = tokio::time::timeout(limit, acceptor.accept(tcp)).await;
                        drop(slot);
                        match done {
                            Ok(Ok(stream)) => {
                                let _ = tx.send((stream, peer)).await;
                            }
                            // A peer's failed handshake is its problem:
                            // debug only, so no peer can flood the log.
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed")
                            }
                            Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                        }
                    });
                }
            });
            Ok(TlsListener {
                ready,
                local,
                accept,
            })
        }
    }

    impl axum::serve::Listener for TlsListener {
        type Io = TlsStream<TcpStream>;
        type Addr = SocketAddr;

        async fn accept(&mut self) -> (Self::Io, Self::Addr) {
            match self.ready.recv().await {
                Some(x) => x,
                // The accept task ended (only when the listener is
                // dropped): nothing more will come.
                None => std::future::pending().await,
            }
        }

        fn local_addr(&self) -> std::io::Result<SocketAddr> {
            Ok(self.local)
        }
    }
}
