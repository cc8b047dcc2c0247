//! Everything that crosses an nvpool process boundary, in one crate every
//! side builds against: the control plane, the target daemon, the agent
//! and the `nvpool` CLI.
//!
//! ```text
//!   rest ── request and response bodies, Secret, endpoint lists (always)
//!   size ── parse_size, the one reading of byte counts (always)
//!   names ── the NQNs one process makes up and another recognises (always)
//!   tls ── rustls with the ring provider: client trust ("client"),
//!          certificate and listener of a server ("server")
//!   http ── the blocking client: endpoint failover over ureq ("client")
//!   httpd ── what every axum server does alike: bearer tokens, strict
//!            JSON bodies, path segments ("server")
//! ```
//!
//! Without features the crate is plain data (serde, no sockets): clients
//! take `client`, which brings ureq but neither axum nor tokio; only the
//! daemons take `server`. `schema` adds the OpenAPI schemas the control
//! plane's document is generated from.

#[cfg(feature = "client")]
pub mod http;
#[cfg(feature = "server")]
pub mod httpd;
pub mod names;
pub mod rest;
pub mod size;
#[cfg(any(feature = "client", feature = "server"))]
pub mod tls;
