//! Waking a sleeping thread, and sleeping on descriptors, off the ring.
//!
//! ```text
//!   any thread ── Wakeup::wake ──► eventfd ◄── read kept in an io_uring ring
//!                                          ◄── poll(2) / epoll of a thread
//! ```
//!
//! [`Wakeup`] is the one eventfd wrapper: a reactor keeps a read of it in
//! its ring, a ublk queue polls it from its ring, the initiator's queue
//! threads and the NBD listeners sleep on it in [`poll`].

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use rustix::event::{eventfd, EventfdFlags};

/// An eventfd: [`Wakeup::wake`] makes it readable until [`Wakeup::drain`].
#[derive(Debug)]
pub struct Wakeup {
    fd: OwnedFd,
}

impl Wakeup {
    /// Reads block until a wake: what a read kept in an io_uring ring
    /// wants (it waits for the counter instead of failing with EAGAIN).
    /// Writes never block (the counter would have to reach 2^64 - 1).
    pub fn new() -> io::Result<Wakeup> {
        Self::with(EventfdFlags::CLOEXEC)
    }

    /// Reads never block: for threads that [`poll`] it and then
    /// [`Wakeup::drain`] it.
    pub fn nonblocking() -> io::Result<Wakeup> {
        Self::with(EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
    }

    fn with(flags: EventfdFlags) -> io::Result<Wakeup> {
        Ok(Wakeup {
            fd: eventfd(0, flags)?,
        })
    }

    /// Makes the eventfd readable (and wakes whoever sleeps on it).
    pub fn wake(&self) {
        // Only fails when the counter would overflow: it is readable then.
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// Resets the counter of a [`Wakeup::nonblocking`] eventfd.
    pub fn drain(&self) {
        let mut v = [0u8; 8];
        // EAGAIN: nothing to drain.
        let _ = rustix::io::read(&self.fd, &mut v);
    }

    /// Whether it was woken since the last drain, without draining.
    pub fn is_woken(&self) -> bool {
        poll_one(self.fd.as_raw_fd(), libc::POLLIN, Some(Duration::ZERO))
            .is_ok_and(|r| r & libc::POLLIN != 0)
    }
}

impl AsFd for Wakeup {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Wakeup {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// A `pollfd` watching `events` (`libc::POLLIN`, `libc::POLLOUT`) on `fd`.
pub fn pollfd(fd: RawFd, events: i16) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

/// poll(2) over `fds` for up to `timeout` (`None`: until an event): how
/// many have events in `revents`; 0 after the timeout or an interrupted
/// wait. A negative fd is skipped, as poll(2) does.
#[allow(clippy::disallowed_methods, reason = "the one poll(2) call")]
pub fn poll(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<usize> {
    let ms = timeout.map_or(-1, |d| {
        // Round up: a wait of 0.4 ms must not become a busy poll.
        let ms = d.as_micros().div_ceil(1000);
        ms.min(i32::MAX as u128) as i32
    });
    // SAFETY: `fds` is a valid, exclusively borrowed array of
    // `fds.len()` pollfds for the duration of the call; poll(2) only
    // writes their `revents`. A closed descriptor yields POLLNVAL.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(e);
    }
    Ok(n as usize)
}

/// Waits up to `timeout` for `events` on `fd`: the events that came, none
/// after a timeout or an interrupted wait.
pub fn poll_one(fd: RawFd, events: i16, timeout: Option<Duration>) -> io::Result<i16> {
    let mut fds = [pollfd(fd, events)];
    poll(&mut fds, timeout)?;
    Ok(fds[0].revents)
}

/// An epoll set that is readable when any of `fds` is: one descriptor to
/// wait on for several (an RDMA link's completion and CM channels).
#[allow(clippy::disallowed_methods, reason = "the one epoll set")]
pub fn epoll_of(fds: &[RawFd]) -> io::Result<OwnedFd> {
    // SAFETY: no pointers; a negative return sets errno.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `ep` is a new descriptor nobody else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(ep) };
    for &fd in fds {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: fd as u64,
        };
        // SAFETY: `ev` is valid for the call; the kernel checks both
        // descriptors (EBADF otherwise).
        if unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wake_makes_it_readable_until_drained() {
        let w = Wakeup::nonblocking().unwrap();
        assert!(!w.is_woken());
        w.wake();
        w.wake();
        let mut fds = [pollfd(w.as_raw_fd(), libc::POLLIN)];
        assert_eq!(poll(&mut fds, Some(Duration::from_secs(1))).unwrap(), 1);
        w.drain();
        assert!(!w.is_woken());
        assert_eq!(poll(&mut fds, Some(Duration::from_millis(1))).unwrap(), 0);
    }

    #[test]
    fn an_epoll_set_is_readable_when_a_member_is() {
        let a = Wakeup::nonblocking().unwrap();
        let b = Wakeup::nonblocking().unwrap();
        let ep = epoll_of(&[a.as_raw_fd(), b.as_raw_fd()]).unwrap();
        let timeout = Some(Duration::from_millis(1));
        assert_eq!(poll_one(ep.as_raw_fd(), libc::POLLIN, timeout).unwrap(), 0);
        b.wake();
        let r = poll_one(ep.as_raw_fd(), libc::POLLIN, timeout).unwrap();
        assert_ne!(r & libc::POLLIN, 0);
    }
}
