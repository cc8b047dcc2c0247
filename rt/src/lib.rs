//! One copy of each run-time mechanism the daemons and the initiator share.
//!
//! - [`wake`]: the eventfd [`Wakeup`] and the poll(2)/epoll waits off the
//!   io_uring ring; the only syscall `unsafe` outside the ring and FFI
//!   modules.
//! - [`backoff`]: the capped exponential [`Backoff`] between attempts.
//! - [`random`]: the kernel's random bytes and the one seeded generator.
//! - `log` (feature `log`): the binaries' log set-up.
//! - [`lock`]: a mutex lock that survives poisoning.
//!
//! Nothing here knows NVMe; every crate that sleeps, retries, locks or
//! draws random bytes uses these instead of its own.

pub mod backoff;
#[cfg(feature = "log")]
pub mod log;
pub mod random;
pub mod wake;

pub use backoff::Backoff;
pub use wake::Wakeup;

use std::sync::{Mutex, MutexGuard};

/// Locks `m` even if a thread panicked while holding it: every critical
/// section in nvpool leaves its data whole (values are replaced, not half
/// written), so a poisoned lock still guards consistent data, and a panic
/// that already crashed one thread need not crash the next.
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
