//! Wire formats of NVMe, NVMe over Fabrics and the NVMe/TCP transport.
//!
//! This crate owns the byte layout of everything nvpool puts on a wire or
//! hands to a peer: NVMe/TCP PDUs, the 64-byte submission queue entry, the
//! 16-byte completion queue entry, Fabrics Connect data and properties,
//! Identify data structures and log pages (the discovery log included).
//!
//! It is pure: bytes in, typed values out, and back. No sockets, no async,
//! no allocation in any decode path. Every multi-byte field is explicitly
//! little-endian (see [`le`]); fixed layouts are tied to their sizes with
//! compile-time assertions.
//!
//! Decoders take untrusted input and return [`WireError`] on anything
//! malformed; they never panic on any input. The `fuzz` module has one
//! entry point per decoder; `wire/fuzz` runs them under cargo-fuzz, and
//! `cargo test` replays the checked-in corpus (`wire/fuzz/corpus`) on stable.

pub mod auth;
pub mod cqe;
pub mod dhchap;
pub mod digest;
pub mod error;
pub mod fabrics;
mod ffdhe;
#[doc(hidden)]
pub mod fuzz;
pub mod identify;
pub mod le;
pub mod log;
pub mod nqn;
pub mod rdma;
pub mod sqe;
pub mod status;
pub mod tcp;

pub use cqe::Cqe;
pub use error::WireError;
pub use sqe::{Sgl, Sqe};
pub use status::Status;

/// The well-known NQN of an NVMe-oF discovery subsystem.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// Longest NQN the spec allows (223 bytes of UTF-8, plus a NUL in a 256-byte field).
pub const NQN_LEN_MAX: usize = 223;
