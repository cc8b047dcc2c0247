//! The API served on a thread of its own, for embedders and tests.

use super::{router, AuthConfig};
use crate::state::Cluster;
use nvpool_api::serve::ServerThread;
use std::net::SocketAddr;
use std::sync::Arc;

/// The API served on a thread of its own (a current-thread runtime), for
/// embedders and tests that want a control plane in process without
/// running one of their own: [`ApiServer::start`] binds and returns once
/// the port accepts connections; dropping the server (or
/// [`ApiServer::shutdown`]) stops it gracefully and waits for the thread,
/// so the port is free again afterwards. It serves the API only: no
/// reconcile loop, no signal handling (that is the daemon's job).
#[derive(Debug)]
pub struct ApiServer {
    /// Where it listens: `listen` with the port the system chose for port 0.
    pub addr: SocketAddr,
    server: ServerThread,
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
        let app = router(cluster.clone(), auth);
        let server = ServerThread::start("nvpool-api", listen, tls, app, move || {
            cluster.begin_shutdown()
        })?;
        Ok(ApiServer {
            addr: server.addr(),
            server,
        })
    }

    /// Stops serving and waits for the server's thread (what drop does).
    pub fn shutdown(self) {
        self.server.stop();
    }
}
