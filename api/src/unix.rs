//! HTTP over the agent's Unix socket with the project's one HTTP client
//! ([`crate::client::Client::agent`]): a connector that opens the socket
//! whatever the URL's host says, and a resolver that resolves nothing.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use ureq::unversioned::resolver::{ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{
    Buffers, ConnectionDetails, Connector, LazyBuffers, NextTimeout, ShutdownHandle, Transport,
};

/// Connects every request to one Unix socket.
#[derive(Debug)]
pub struct UnixConnector {
    pub path: PathBuf,
}

impl Connector<()> for UnixConnector {
    type Out = UnixTransport;

    fn connect(
        &self,
        details: &ConnectionDetails,
        _: Option<()>,
    ) -> Result<Option<UnixTransport>, ureq::Error> {
        let stream = Arc::new(Sock(UnixStream::connect(&self.path)?));
        let shutdown = Arc::downgrade(&stream) as std::sync::Weak<dyn ShutdownHandle>;
        (details.register_shutdown)(shutdown)?;
        let config = details.config;
        Ok(Some(UnixTransport {
            stream,
            buffers: LazyBuffers::new(config.input_buffer_size(), config.output_buffer_size()),
        }))
    }
}

/// Resolves any host to a placeholder: the connector ignores addresses.
#[derive(Debug)]
pub struct NoResolver;

impl Resolver for NoResolver {
    fn resolve(
        &self,
        _: &ureq::http::Uri,
        _: &ureq::config::Config,
        _: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, ureq::Error> {
        let mut addrs = self.empty();
        addrs.push(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
        Ok(addrs)
    }
}

/// One connection to the socket.
#[derive(Debug)]
pub struct UnixTransport {
    stream: Arc<Sock>,
    buffers: LazyBuffers,
}

/// The socket, which ureq may shut down from another thread.
#[derive(Debug)]
struct Sock(UnixStream);

impl ShutdownHandle for Sock {
    fn shutdown(&self) {
        let _ = self.0.shutdown(std::net::Shutdown::Both);
    }
}

fn timed_out(e: std::io::Error, reason: ureq::Timeout) -> ureq::Error {
    match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
            ureq::Error::Timeout(reason)
        }
        _ => e.into(),
    }
}

impl Transport for UnixTransport {
    fn buffers(&mut self) -> &mut dyn Buffers {
        &mut self.buffers
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), ureq::Error> {
        let timeout = timeout.for_write();
        self.stream
            .0
            .set_write_timeout(timeout.not_zero().map(|d| *d))?;
        (&self.stream.0)
            .write_all(&self.buffers.output()[..amount])
            .map_err(|e| timed_out(e, timeout.reason))
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, ureq::Error> {
        let timeout = timeout.for_read();
        self.stream
            .0
            .set_read_timeout(timeout.not_zero().map(|d| *d))?;
        let n = loop {
            match (&self.stream.0).read(self.buffers.input_append_buf()) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => break r.map_err(|e| timed_out(e, timeout.reason))?,
            }
        };
        self.buffers.input_appended(n);
        Ok(n > 0)
    }

    fn is_open(&mut self) -> bool {
        // One request per connection (the agent's calls are rare).
        false
    }
}
