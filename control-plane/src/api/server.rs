//! The API served on a thread of its own, for embedders and tests.

use super::{router, AuthConfig};
use crate::state::Cluster;
use std::net::SocketAddr;
use std::sync::Arc;

/// The API served on a thread of its own (a current-thread runtime), for
/// embedders and tests that want a control plane in process without
/// running one of their own: [`ApiServer::start`] binds and returns once
/// the port accepts connections; dropping the server (or
/// [`ApiServer::shutdown`]) stops it gracefully and waits for the thread,
/// so the port is free again afterwards. It serves the API only: no
/// reconcile loop, no signal handling (that is the daemon's job).
pub struct ApiServer {
    /// Where it listens: `listen` with the port the system chose for port 0.
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ApiServer {
    /// Serves [`router`]`(cluster, auth)` on `listen` (port 0 for any).
    /// Fails when the address cannot be bound or the thread not started.
    pub fn start(
        cluster: Arc<Cluster>,
        auth: AuthConfig,
        listen: SocketAddr,
    ) -> std::io::Result<ApiServer> {
        ApiServer::start_tls(cluster, auth, listen, None)
    }

    /// [`ApiServer::start`], serving https with `tls` when given.
    pub fn start_tls(
        cluster: Arc<Cluster>,
        auth: AuthConfig,
        listen: SocketAddr,
        tls: Option<crate::tls::ServerTls>,
    ) -> std::io::Result<ApiServer> {
        let listener = std::net::TcpListener::bind(listen)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (listener, tls) = {
            let _guard = rt.enter();
            let listener = tokio::net::TcpListener::from_std(listener)?;
            match tls {
                Some(t) => (None, Some(crate::tls::TlsListener::new(listener, &t)?)),
                None => (Some(listener), None),
            }
        };
        let app = router(cluster.clone(), auth);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("nvpool-api {addr}"))
            .spawn(move || {
                rt.block_on(async move {
                    let stopped = async move {
                        let _ = rx.await;
                        cluster.begin_shutdown();
                    };
                    let served = match (listener, tls) {
                        (_, Some(tls)) => {
                            axum::serve(tls, app).with_graceful_shutdown(stopped).await
                        }
                        (Some(plain), None) => {
                            axum::serve(plain, app)
                                .with_graceful_shutdown(stopped)
                                .await
                        }
                        (None, None) => unreachable!("one of the two listeners"),
                    };
                    if let Err(e) = served {
                        tracing::error!(%addr, "serving the API: {e}");
                    }
                });
            })?;
        Ok(ApiServer {
            addr,
            stop: Some(tx),
            thread: Some(thread),
        })
    }

    /// Stops serving and waits for the server's thread (what drop does).
    pub fn shutdown(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.halt();
    }
}

impl std::fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}
