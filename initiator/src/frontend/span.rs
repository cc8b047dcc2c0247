//! Byte-range I/O over a [`BlockDev`]: what front-ends use when a request
//! may not be block aligned (FUSE may send any range; an NBD client that
//! did not negotiate block sizes may too).
//!
//! Aligned requests go straight to the device in the caller's buffer.
//! Unaligned writes read the partial edge blocks, merge and write whole
//! blocks (read-modify-write); the edge blocks are locked for the duration,
//! so two unaligned writes that share a block never lose each other's
//! bytes. Aligned writes take no lock: an aligned write racing an
//! unaligned one over the same block is a race in the caller, as on any
//! block device.

use crate::blockdev::BlockDev;
use crate::bufpool::BufPool;
use crate::error::IoError;
use nvpool_rt::lock;
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};

/// Blocks held by unaligned writes, and the futures waiting for them.
#[derive(Debug, Default)]
struct Locks {
    held: Vec<u64>,
    waiters: VecDeque<Waker>,
}

/// The device plus what byte-range I/O needs around it.
pub(crate) struct Span {
    dev: Arc<dyn BlockDev>,
    bs: u64,
    locks: Mutex<Locks>,
    pub(crate) pool: BufPool,
}

impl std::fmt::Debug for Span {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Span")
            .field("block_size", &self.bs)
            .field("size", &self.size())
            .finish()
    }
}

/// Releases locked blocks on drop.
struct Held<'a> {
    span: &'a Span,
    blocks: [Option<u64>; 2],
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let waiters = {
            let mut g = self.span.lock();
            g.held.retain(|b| !self.blocks.contains(&Some(*b)));
            std::mem::take(&mut g.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }
}

impl Span {
    pub(crate) fn new(dev: Arc<dyn BlockDev>) -> Span {
        let bs = dev.block_size() as u64;
        assert!(
            bs.is_power_of_two() && bs >= 512,
            "BlockDev block size must be a power of two ≥ 512"
        );
        Span {
            dev,
            bs,
            locks: Mutex::new(Locks::default()),
            pool: BufPool::default(),
        }
    }

    pub(crate) fn dev(&self) -> &Arc<dyn BlockDev> {
        &self.dev
    }

    pub(crate) fn block_size(&self) -> u64 {
        self.bs
    }

    /// The device's size now: it may grow while served (a volume grown
    /// online), and front-ends check ranges against it.
    pub(crate) fn size(&self) -> u64 {
        self.dev.size()
    }

    pub(crate) fn is_aligned(&self, offset: u64, len: u64) -> bool {
        offset.is_multiple_of(self.bs) && len.is_multiple_of(self.bs)
    }

    fn lock(&self) -> MutexGuard<'_, Locks> {
        lock(&self.locks)
    }

    async fn hold(&self, a: Option<u64>, b: Option<u64>) -> Held<'_> {
        let blocks = [a, b.filter(|b| Some(*b) != a)];
        std::future::poll_fn(|cx| {
            let mut g = self.lock();
            if blocks.iter().flatten().any(|b| g.held.contains(b)) {
                if !g.waiters.iter().any(|w| w.will_wake(cx.waker())) {
                    g.waiters.push_back(cx.waker().clone());
                }
                return Poll::Pending;
            }
            g.held.extend(blocks.iter().flatten());
            Poll::Ready(())
        })
        .await;
        Held { span: self, blocks }
    }

    /// Reads `len` bytes at `offset` (any alignment; the caller checked the
    /// range is inside the device). Returns the buffer and where the
    /// requested bytes sit in it.
    pub(crate) async fn read(
        &self,
        offset: u64,
        len: usize,
    ) -> (Result<(), IoError>, Vec<u8>, Range<usize>) {
        let start = offset - offset % self.bs;
        let end = (offset + len as u64).next_multiple_of(self.bs);
        let buf = self.pool.get((end - start) as usize);
        let (r, buf) = self.dev.read(start, buf).await;
        let at = (offset - start) as usize;
        (r, buf, at..at + len)
    }

    /// Writes `data` at `offset` (any alignment; the caller checked the
    /// range). The buffer comes back for reuse.
    pub(crate) async fn write(
        &self,
        offset: u64,
        data: Vec<u8>,
        fua: bool,
    ) -> (Result<(), IoError>, Vec<u8>) {
        let len = data.len() as u64;
        if len == 0 {
            return (Ok(()), data);
        }
        if self.is_aligned(offset, len) {
            return self.dev.write(offset, data, fua).await;
        }
        let r = self.merge_write(offset, Payload::Data(&data), fua).await;
        (r, data)
    }

    /// Zeroes `len` bytes at `offset` (any alignment); whole blocks go to
    /// the device as Write Zeroes (deallocating them if `may_unmap`), the
    /// partial edges by read-modify-write.
    pub(crate) async fn zero(&self, offset: u64, len: u64, may_unmap: bool) -> Result<(), IoError> {
        if len == 0 {
            return Ok(());
        }
        let end = offset + len;
        let mid_start = offset.next_multiple_of(self.bs);
        let mid_end = end - end % self.bs;
        if mid_start >= mid_end {
            // Inside one block, or two partial blocks with nothing between.
            return self.merge_write(offset, Payload::Zeroes(len), false).await;
        }
        if offset < mid_start {
            self.merge_write(offset, Payload::Zeroes(mid_start - offset), false)
                .await?;
        }
        self.dev
            .write_zeroes(mid_start, mid_end - mid_start, may_unmap)
            .await?;
        if mid_end < end {
            self.merge_write(mid_end, Payload::Zeroes(end - mid_end), false)
                .await?;
        }
        Ok(())
    }

    /// Discards the whole blocks inside `[offset, offset+len)`; partial
    /// edge blocks are left alone (a discard is advisory).
    pub(crate) async fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        let start = offset.next_multiple_of(self.bs);
        let end = (offset + len) - (offset + len) % self.bs;
        if start >= end {
            return Ok(());
        }
        self.dev.discard(start, end - start).await
    }

    /// Read-modify-write of `[offset, offset + payload len)`, which is not
    /// block aligned at one end or both.
    async fn merge_write(&self, offset: u64, p: Payload<'_>, fua: bool) -> Result<(), IoError> {
        let len = p.len();
        let bs = self.bs;
        let start = offset - offset % bs;
        let end = (offset + len).next_multiple_of(bs);
        let head = (!offset.is_multiple_of(bs)).then_some(start / bs);
        let tail = (!(offset + len).is_multiple_of(bs)).then_some(end / bs - 1);
        let _held = self.hold(head, tail).await;
        let mut buf = self.pool.get((end - start) as usize);
        let mut result = Ok(());
        // Fetch the edge blocks the payload covers only in part.
        for blk in [head, tail.filter(|t| Some(*t) != head)]
            .into_iter()
            .flatten()
        {
            let at = (blk * bs - start) as usize;
            let edge = self.pool.get(bs as usize);
            let (r, edge) = self.dev.read(blk * bs, edge).await;
            if r.is_ok() {
                buf[at..at + bs as usize].copy_from_slice(&edge);
            }
            self.pool.put(edge);
            if let Err(e) = r {
                result = Err(e);
                break;
            }
        }
        if result.is_ok() {
            let at = (offset - start) as usize;
            match p {
                Payload::Data(d) => buf[at..at + d.len()].copy_from_slice(d),
                Payload::Zeroes(n) => buf[at..at + n as usize].fill(0),
            }
            let (r, b) = self.dev.write(start, buf, fua).await;
            result = r;
            buf = b;
        }
        self.pool.put(buf);
        result
    }
}

enum Payload<'a> {
    Data(&'a [u8]),
    Zeroes(u64),
}

impl Payload<'_> {
    fn len(&self) -> u64 {
        match self {
            Payload::Data(d) => d.len() as u64,
            Payload::Zeroes(n) => *n,
        }
    }
}
