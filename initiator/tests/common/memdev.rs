//! A block device in memory that counts what reaches it, for the
//! front-end tests (FUSE, NBD).

use nvpool_initiator::{BlockDev, BufResult, IoError, IoFuture};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

#[derive(Debug)]
pub struct MemDev {
    data: Mutex<Vec<u8>>,
    bs: u32,
    optimal_io: u32,
    /// Reads at this offset complete after this many milliseconds.
    slow_read: Option<(u64, u64)>,
    pub flushes: AtomicU64,
    pub discards: AtomicU64,
    pub zeroes_unmap: AtomicU64,
    pub zeroes_keep: AtomicU64,
    pub fua_writes: AtomicU64,
    /// Requests refused as unaligned (a front-end should never send one).
    pub unaligned: AtomicU64,
}

impl MemDev {
    pub fn new(size: usize, bs: u32) -> Arc<MemDev> {
        MemDev::build(size, bs, 0, None)
    }

    pub fn build(
        size: usize,
        bs: u32,
        optimal_io: u32,
        slow_read: Option<(u64, u64)>,
    ) -> Arc<MemDev> {
        Arc::new(MemDev {
            data: Mutex::new(vec![0; size]),
            bs,
            optimal_io,
            slow_read,
            flushes: AtomicU64::new(0),
            discards: AtomicU64::new(0),
            zeroes_unmap: AtomicU64::new(0),
            zeroes_keep: AtomicU64::new(0),
            fua_writes: AtomicU64::new(0),
            unaligned: AtomicU64::new(0),
        })
    }

    fn check(&self, off: u64, len: u64) -> Result<std::ops::Range<usize>, IoError> {
        let bs = self.bs as u64;
        if !off.is_multiple_of(bs) || !len.is_multiple_of(bs) {
            self.unaligned.fetch_add(1, Ordering::Relaxed);
            return Err(IoError::Invalid("unaligned"));
        }
        if off + len > self.size() {
            return Err(IoError::Invalid("past the end"));
        }
        Ok(off as usize..(off + len) as usize)
    }

    /// Grows the device to `size` bytes (zeroes), as a volume grows online.
    pub fn grow(&self, size: usize) {
        let mut d = self.data.lock().unwrap();
        assert!(size >= d.len(), "a device only grows");
        d.resize(size, 0);
    }

    pub fn bytes(&self, off: usize, len: usize) -> Vec<u8> {
        self.data.lock().unwrap()[off..off + len].to_vec()
    }
}

/// Completes after `ms` without blocking the polling thread.
async fn delay(ms: u64) {
    let fired = Arc::new(AtomicBool::new(false));
    let mut started = false;
    std::future::poll_fn(|cx| {
        if fired.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        if !started {
            started = true;
            let (f, w) = (fired.clone(), cx.waker().clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(ms));
                f.store(true, Ordering::Release);
                w.wake();
            });
        }
        Poll::Pending
    })
    .await
}

impl BlockDev for MemDev {
    fn size(&self) -> u64 {
        self.data.lock().unwrap().len() as u64
    }
    fn block_size(&self) -> u32 {
        self.bs
    }
    fn optimal_io_bytes(&self) -> u32 {
        self.optimal_io
    }
    fn read(&self, offset: u64, mut buf: Vec<u8>) -> IoFuture<'_, BufResult> {
        Box::pin(async move {
            if let Some((at, ms)) = self.slow_read {
                if offset == at {
                    delay(ms).await;
                }
            }
            match self.check(offset, buf.len() as u64) {
                Ok(r) => {
                    buf.copy_from_slice(&self.data.lock().unwrap()[r]);
                    (Ok(()), buf)
                }
                Err(e) => (Err(e), buf),
            }
        })
    }
    fn write(&self, offset: u64, buf: Vec<u8>, fua: bool) -> IoFuture<'_, BufResult> {
        Box::pin(async move {
            if fua {
                self.fua_writes.fetch_add(1, Ordering::Relaxed);
            }
            match self.check(offset, buf.len() as u64) {
                Ok(r) => {
                    self.data.lock().unwrap()[r].copy_from_slice(&buf);
                    (Ok(()), buf)
                }
                Err(e) => (Err(e), buf),
            }
        })
    }
    fn flush(&self) -> IoFuture<'_, Result<(), IoError>> {
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Box::pin(async { Ok(()) })
    }
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        unmap: bool,
    ) -> IoFuture<'_, Result<(), IoError>> {
        Box::pin(async move {
            let r = self.check(offset, len)?;
            self.data.lock().unwrap()[r].fill(0);
            if unmap {
                self.zeroes_unmap.fetch_add(1, Ordering::Relaxed);
            } else {
                self.zeroes_keep.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        })
    }
    fn discard(&self, offset: u64, len: u64) -> IoFuture<'_, Result<(), IoError>> {
        Box::pin(async move {
            self.check(offset, len)?;
            self.discards.fetch_add(1, Ordering::Relaxed);
            Ok(())
        })
    }
}
