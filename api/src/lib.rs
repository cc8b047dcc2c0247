//! Everything that crosses an nvpool process boundary, in one crate every
//! side builds against: the control plane, the target daemon, the agent
//! and the `nvpool` CLI.
//!
//! ```text
//!   rest ── request and response bodies, Secret, endpoint lists,
//!           ErrorBody (always)
//!   admin ── request bodies of a target's admin API (always)
//!   size ── parse_size, the one reading of byte counts (always)
//!   names ── the NQNs one process makes up and another recognises, and
//!            `segment`, a name in a URL path (always)
//!   tls ── rustls with the ring provider: client trust ("client"),
//!          certificate and listener of a server ("server")
//!   client ── the one blocking client: ureq, bearer token, error
//!             decoding, the agent's Unix socket ("client")
//!   http ── endpoint failover, under the client ("client")
//!   httpd ── what every axum server does alike: bearer tokens, strict
//!            JSON bodies, path segments ("server")
//!   serve ── the one way a daemon serves HTTP: TLS, handshake bounds,
//!            graceful shutdown, a server on a thread of its own ("server")
//!   prometheus ── the one writer of the metrics text format ("server")
//! ```
//!
//! Without features the crate is plain data (serde, no sockets): clients
//! take `client`, which brings ureq but neither axum nor tokio; only the
//! daemons take `server`. `schema` adds the OpenAPI schemas the control
//! plane's document is generated from.

pub mod admin;
#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "client")]
pub mod http;
#[cfg(feature = "server")]
pub mod httpd;
pub mod names;
#[cfg(feature = "server")]
pub mod prometheus;
pub mod rest;
#[cfg(feature = "server")]
pub mod serve;
pub mod size;
#[cfg(any(feature = "client", feature = "server"))]
pub mod tls;
#[cfg(feature = "client")]
mod unix;
