//! A backend that injects faults into another, for tests.
//!
//! Two ways to run. Made with [`FaultBackend::new`], it has no io_uring
//! target: the reactor runs its I/O inline, and every fault (latency, EIO,
//! torn writes, at an offset) is injected in the calls. Made with
//! [`FaultBackend::over_ring`] around a backend that has one, its I/O goes
//! through the reactor's ring like the inner backend's, and the kernel
//! itself fails it: while writes are to fail, ring operations are aimed at
//! a read-only descriptor of the same file (writes, fallocates and flushes
//! fail with EBADF, reads work), while reads are to fail at a write-only
//! one, and while both are, at an `O_PATH` one. Only those two faults exist
//! on the ring, for every offset; latency, torn writes and `only_at` apply
//! to the inline calls alone.

use super::{Backend, UringTarget};
use nvpool_rt::lock;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What to inject. Changed at run time through [`FaultBackend::set`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FaultConfig {
    /// Added to every operation.
    pub latency: Duration,
    /// Fail reads with EIO.
    pub fail_reads: bool,
    /// Fail writes (and flushes) with EIO.
    pub fail_writes: bool,
    /// Tear writes: only the first half of the blocks reach the inner
    /// backend, then the write fails with EIO.
    pub torn_writes: bool,
    /// Fail only operations whose byte range touches this offset.
    pub only_at: Option<u64>,
}

#[derive(Debug)]
pub struct FaultBackend {
    inner: Arc<dyn Backend>,
    cfg: Mutex<FaultConfig>,
    any: AtomicBool,
    failed: AtomicBool,
    /// Operations that had a fault injected.
    pub injected: AtomicU64,
    latency_us: AtomicU32,
    /// With [`FaultBackend::over_ring`]: the descriptors faulty ring
    /// operations are aimed at.
    ring: Option<RingFaults>,
}

/// Other opens of the inner backend's file, each refusing some operations.
#[derive(Debug)]
struct RingFaults {
    /// Refuses writes, fallocates and flushes.
    read_only: File,
    /// Refuses reads.
    write_only: File,
    /// Refuses everything.
    path_only: File,
}

impl RingFaults {
    fn open(fd: i32) -> io::Result<RingFaults> {
        let path = format!("/proc/self/fd/{fd}");
        let open = |read: bool, write: bool, flags: i32| {
            let mut o = std::fs::OpenOptions::new();
            o.read(read).write(write).custom_flags(flags);
            // The same caching as the inner file where the filesystem
            // allows O_DIRECT (reads through it then behave alike).
            o.clone()
                .custom_flags(flags | libc::O_DIRECT)
                .open(&path)
                .or_else(|_| o.open(&path))
        };
        Ok(RingFaults {
            read_only: open(true, false, 0)?,
            write_only: open(false, true, 0)?,
            path_only: open(true, false, libc::O_PATH)?,
        })
    }
}

impl FaultBackend {
    pub fn new(inner: Arc<dyn Backend>) -> FaultBackend {
        FaultBackend {
            inner,
            cfg: Mutex::new(FaultConfig::default()),
            any: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            injected: AtomicU64::new(0),
            latency_us: AtomicU32::new(0),
            ring: None,
        }
    }

    /// Wraps a backend that has an io_uring target so its I/O still goes
    /// through the ring, where faults come from the kernel (module docs).
    pub fn over_ring(inner: Arc<dyn Backend>) -> io::Result<FaultBackend> {
        let t = inner.uring_target().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "the inner backend has no io_uring target",
            )
        })?;
        let ring = RingFaults::open(t.fd)?;
        Ok(FaultBackend {
            ring: Some(ring),
            ..FaultBackend::new(inner)
        })
    }

    pub fn set(&self, cfg: FaultConfig) {
        self.latency_us.store(
            cfg.latency.as_micros().min(u32::MAX as u128) as u32,
            Ordering::Relaxed,
        );
        self.any.store(
            cfg.fail_reads || cfg.fail_writes || cfg.torn_writes,
            Ordering::Release,
        );
        *lock(&self.cfg) = cfg;
    }

    /// Clears injected faults and the sticky failed state.
    pub fn heal(&self) {
        self.set(FaultConfig::default());
        self.failed.store(false, Ordering::Release);
    }

    fn delay(&self) {
        let us = self.latency_us.load(Ordering::Relaxed);
        if us > 0 {
            std::thread::sleep(Duration::from_micros(us as u64));
        }
    }

    fn hits(&self, off: u64, len: u64) -> Option<FaultConfig> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        let cfg = lock(&self.cfg).clone();
        match cfg.only_at {
            Some(at) if !(off..off + len.max(1)).contains(&at) => None,
            _ => Some(cfg),
        }
    }

    fn eio(&self) -> io::Error {
        self.injected.fetch_add(1, Ordering::Relaxed);
        io::Error::from_raw_os_error(libc::EIO)
    }
}

impl Backend for FaultBackend {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }
    fn describe(&self) -> String {
        format!("fault-injecting {}", self.inner.describe())
    }
    fn device_extent(&self) -> Option<super::DeviceExtent> {
        // Its writes land in the inner backend's bytes.
        self.inner.device_extent()
    }
    fn uring_target(&self) -> Option<UringTarget> {
        let faults = self.ring.as_ref()?;
        let t = self.inner.uring_target()?;
        let (reads, writes) = match self.hits(0, u64::MAX) {
            Some(c) => (c.fail_reads, c.fail_writes || c.torn_writes),
            None => (false, false),
        };
        let writes = writes || self.failed();
        let fd = match (reads, writes) {
            (false, false) => return Some(t),
            (false, true) => faults.read_only.as_raw_fd(),
            (true, false) => faults.write_only.as_raw_fd(),
            (true, true) => faults.path_only.as_raw_fd(),
        };
        Some(UringTarget { fd, base: t.base })
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.delay();
        if self
            .hits(off, buf.len() as u64)
            .is_some_and(|c| c.fail_reads)
        {
            return Err(self.eio());
        }
        self.inner.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64, fua: bool) -> io::Result<()> {
        self.delay();
        if self.failed() {
            return Err(self.eio());
        }
        if let Some(c) = self.hits(off, buf.len() as u64) {
            if c.torn_writes {
                let bs = self.block_size() as usize;
                let half = (buf.len() / bs / 2) * bs;
                if half > 0 {
                    self.inner.write_at(&buf[..half], off, fua)?;
                }
                self.mark_failed();
                return Err(self.eio());
            }
            if c.fail_writes {
                self.mark_failed();
                return Err(self.eio());
            }
        }
        self.inner.write_at(buf, off, fua)
    }
    fn flush(&self) -> io::Result<()> {
        self.delay();
        if self.failed()
            || self
                .hits(0, u64::MAX)
                .is_some_and(|c| c.fail_writes && c.only_at.is_none())
        {
            self.mark_failed();
            return Err(self.eio());
        }
        self.inner.flush()
    }
    fn write_zeroes(&self, off: u64, len: u64) -> io::Result<()> {
        self.delay();
        if self.failed() || self.hits(off, len).is_some_and(|c| c.fail_writes) {
            return Err(self.eio());
        }
        self.inner.write_zeroes(off, len)
    }
    fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        self.delay();
        if self.failed() || self.hits(off, len).is_some_and(|c| c.fail_writes) {
            return Err(self.eio());
        }
        self.inner.discard(off, len)
    }
    fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }
    fn mark_failed(&self) {
        self.failed.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::RamBackend;

    #[test]
    fn torn_write_lands_half_and_sticks() {
        let f = FaultBackend::new(Arc::new(RamBackend::new(8192, 512)));
        f.set(FaultConfig {
            torn_writes: true,
            ..Default::default()
        });
        assert!(f.write_at(&[9u8; 2048], 0, false).is_err());
        f.set(FaultConfig::default());
        let mut b = [0u8; 2048];
        f.read_at(&mut b, 0).unwrap();
        assert!(b[..1024].iter().all(|&x| x == 9));
        assert!(b[1024..].iter().all(|&x| x == 0));
        assert!(
            f.write_at(&[1u8; 512], 4096, false).is_err(),
            "failed state is sticky"
        );
        f.heal();
        f.write_at(&[1u8; 512], 4096, false).unwrap();
    }

    #[test]
    fn faults_only_at_an_offset() {
        let f = FaultBackend::new(Arc::new(RamBackend::new(8192, 512)));
        f.set(FaultConfig {
            fail_reads: true,
            only_at: Some(4096),
            ..Default::default()
        });
        let mut b = [0u8; 512];
        f.read_at(&mut b, 0).unwrap();
        assert!(f.read_at(&mut b, 4096).is_err());
        assert_eq!(f.injected.load(Ordering::Relaxed), 1);
    }
}
