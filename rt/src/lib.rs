//! One copy of each run-time mechanism the daemons and the initiator share.
//!
//! - [`wake`]: the eventfd [`Wakeup`] and the poll(2)/epoll waits off the
//!   io_uring ring; the only syscall `unsafe` outside the ring and FFI
//!   modules.
//! - [`backoff`]: the capped exponential [`Backoff`] between attempts.
//! - [`random`]: the kernel's random bytes and the one seeded generator.
//! - `log` (feature `log`): the binaries' log set-up.
//!
//! Nothing here knows NVMe; every crate that sleeps, retries or draws
//! random bytes uses these instead of its own.

pub mod backoff;
#[cfg(feature = "log")]
pub mod log;
pub mod random;
pub mod wake;

pub use backoff::Backoff;
pub use wake::Wakeup;
