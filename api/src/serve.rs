//! The one way an nvpool daemon serves HTTP (feature `server`): the
//! control plane's REST API, the target's admin API and the agent's
//! metrics listener all go through [`serve`], so that TLS, the bound on
//! half-open handshakes and graceful shutdown are the same everywhere.
//!
//! ```text
//!   TcpListener ─┬─────────────────────────────┬─► axum::serve ─► Router
//!                └─ tls: TlsListener (handshake │   (ConnectInfo<Peer>,
//!                   tasks, 10 s, 64 at once) ───┘    graceful shutdown)
//!   ServerThread ── the same on a thread of its own, stopped on drop
//! ```

use crate::tls::{ServerTls, TlsListener};
use axum::extract::connect_info::Connected;
use axum::serve::IncomingStream;
use axum::Router;
use std::future::Future;
use std::net::SocketAddr;
use tokio::net::TcpListener;

/// The peer of a connection, plain or TLS: [`serve`] gives every request
/// `ConnectInfo<Peer>` (axum gives a `SocketAddr` for its own
/// `TcpListener` only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer(pub SocketAddr);

impl Connected<IncomingStream<'_, TcpListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, TcpListener>) -> Peer {
        Peer(*stream.remote_addr())
    }
}

impl Connected<IncomingStream<'_, TlsListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, TlsListener>) -> Peer {
        Peer(*stream.remote_addr())
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets the
/// requests under way finish. With `tls`, each connection is
/// TLS-established first by a [`TlsListener`] (handshakes in tasks of
/// their own, at most [`crate::tls::TLS_HANDSHAKES_MAX`] at once, each
/// dropped after [`crate::tls::TLS_HANDSHAKE_TIMEOUT_MS`]), so a peer
/// that connects and stays silent never holds up anyone else.
pub async fn serve(
    listener: TcpListener,
    tls: Option<&ServerTls>,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = app.into_make_service_with_connect_info::<Peer>();
    match tls {
        Some(tls) => {
            let listener = TlsListener::new(listener, tls)?;
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
        None => {
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
    }
}

/// [`serve`] on a thread of its own (a current-thread runtime), for a
/// server embedded in a process that has no runtime of its own, or a
/// test's: [`ServerThread::start`] returns once the port accepts
/// connections; [`ServerThread::stop`] (or dropping it) stops serving
/// gracefully and waits for the thread, so the port is free afterwards.
#[derive(Debug)]
pub struct ServerThread {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ServerThread {
    /// Binds `listen` (port 0 for any) and serves `app` there, over https
    /// with `tls`, from a thread called `name`. `on_stop` runs once when
    /// the server is told to stop, before the requests under way finish
    /// (the control plane refuses new work from then on). Fails when the
    /// address cannot be bound or the thread not started.
    pub fn start(
        name: &str,
        listen: SocketAddr,
        tls: Option<ServerTls>,
        app: Router,
        on_stop: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<ServerThread> {
        let listener = std::net::TcpListener::bind(listen)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let listener = {
            let _guard = rt.enter();
            TcpListener::from_std(listener)?
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            let _ = stopped.await;
            on_stop();
        };
        let what = name.to_owned();
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                if let Err(e) = rt.block_on(serve(listener, tls.as_ref(), app, shutdown)) {
                    tracing::error!(%addr, error = %e, "{what} stopped");
                }
            })?;
        Ok(ServerThread {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Where it listens: `listen` with the port the system chose for port 0.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving and waits for the thread (what drop does).
    pub fn stop(mut self) {
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

impl Drop for ServerThread {
    fn drop(&mut self) {
        self.halt();
    }
}
