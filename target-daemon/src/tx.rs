//! A connection's transmit queue: PDU headers and small payloads copied into
//! byte chunks, command data referenced in place in its slot's buffer, all
//! sent with one vectored send (a `sendmsg` on the reactor's ring) at a time.
//!
//! Queued bytes never move: a chunk is filled and never reallocated, so a
//! send in flight may point into it while the queue keeps appending
//! responses behind it. A chunk is reused once every byte in it is sent.
//!
//! A slot whose data is queued stays out of use until that data has been
//! written: [`Tx::advance`] hands its index back in [`Tx::released`].

use crate::limits::TX_CHUNK_BYTES;
use std::collections::VecDeque;
use std::io::IoSlice;

/// iovecs per send (the kernel's UIO_MAXIOV is 1024; responses batch well
/// below that).
pub const IOV_MAX: usize = 64;

#[derive(Debug, Clone, Copy)]
enum Seg {
    /// `len` queued bytes at `addr`, in the oldest chunk that still has some.
    Bytes { addr: usize, len: usize },
    /// `len` bytes of a slot's data buffer at `addr`.
    Slot { addr: usize, len: usize, slot: u16 },
}

/// NVMe/RDMA work a queue asks its transport to post, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaWork {
    /// RDMA READ of a host write's data into slot `slot`'s buffer; the
    /// queue hears back through `Queue::on_rdma_fetched`.
    Fetch {
        slot: u16,
        len: u32,
        raddr: u64,
        rkey: u32,
    },
    /// RDMA WRITE of the first `len` bytes of slot `slot`'s buffer.
    Deliver {
        slot: u16,
        len: u32,
        raddr: u64,
        rkey: u32,
    },
    /// SEND of a response capsule (with Invalidate of `invalidate`); once it
    /// completes, `release` goes to [`Tx::released`].
    Respond {
        cqe: [u8; 16],
        invalidate: Option<u32>,
        release: Option<u16>,
    },
}

/// Byte storage that never moves: `used` bytes filled, `segs` queued
/// segments still pointing into it.
#[derive(Debug)]
struct Chunk {
    buf: Box<[u8]>,
    used: usize,
    segs: usize,
}

#[derive(Debug, Default)]
pub struct Tx {
    /// NVMe/RDMA: work to post (the byte queue stays empty).
    pub rdma: Vec<RdmaWork>,
    /// Oldest first; bytes are appended to the last. Every chunk but the
    /// last has queued segments.
    chunks: VecDeque<Chunk>,
    /// One emptied chunk kept for the next.
    spare: Option<Box<[u8]>>,
    segs: VecDeque<Seg>,
    /// Bytes of the front segment already written.
    front_done: usize,
    backlog: usize,
    /// Slots whose queued data has been written; the queue frees them.
    pub released: Vec<u16>,
}

impl Tx {
    /// Bytes waiting to be written.
    pub fn backlog(&self) -> usize {
        self.backlog
    }

    /// Queues a copy of `b`.
    pub fn put(&mut self, b: &[u8]) {
        if b.is_empty() {
            return;
        }
        let fits = self
            .chunks
            .back()
            .is_some_and(|c| c.buf.len() - c.used >= b.len());
        if !fits {
            self.new_chunk(b.len());
        }
        let Some(c) = self.chunks.back_mut() else {
            unreachable!("new_chunk pushed one");
        };
        let at = c.used;
        c.buf[at..at + b.len()].copy_from_slice(b);
        c.used += b.len();
        let addr = c.buf.as_ptr() as usize + at;
        self.backlog += b.len();
        if let Some(Seg::Bytes { addr: a, len }) = self.segs.back_mut() {
            if *a + *len == addr {
                *len += b.len();
                return;
            }
        }
        if let Some(c) = self.chunks.back_mut() {
            c.segs += 1;
        }
        self.segs.push_back(Seg::Bytes { addr, len: b.len() });
    }

    fn new_chunk(&mut self, need: usize) {
        // A last chunk nothing points into goes back first (only the last
        // chunk may be without segments).
        if self.chunks.back().is_some_and(|c| c.segs == 0) {
            if let Some(c) = self.chunks.pop_back() {
                self.retire(c.buf);
            }
        }
        let buf = match self.spare.take() {
            Some(b) if b.len() >= need => b,
            _ => vec![0u8; need.max(TX_CHUNK_BYTES)].into_boxed_slice(),
        };
        self.chunks.push_back(Chunk {
            buf,
            used: 0,
            segs: 0,
        });
    }

    fn retire(&mut self, buf: Box<[u8]>) {
        if buf.len() == TX_CHUNK_BYTES {
            self.spare = Some(buf);
        }
    }

    /// Queues `data` in place: it must stay valid and unchanged until `slot`
    /// comes back in [`Tx::released`] (or the Tx is dropped unwritten).
    pub fn put_slot(&mut self, data: &[u8], slot: u16) {
        self.backlog += data.len();
        self.segs.push_back(Seg::Slot {
            addr: data.as_ptr() as usize,
            len: data.len(),
            slot,
        });
    }

    /// Describes the pending data as (address, length) pairs, oldest first,
    /// as many as `out` holds. Returns how many were written.
    ///
    /// The memory stays valid and unchanged until [`Tx::advance`] or
    /// [`Tx::abandon`] passes it (bytes never move; slots are held by
    /// put_slot's contract), so a send in flight may point at it.
    pub fn pending(&self, out: &mut [(usize, usize)]) -> usize {
        let mut n = 0;
        for (i, seg) in self.segs.iter().enumerate().take(out.len()) {
            let skip = if i == 0 { self.front_done } else { 0 };
            let (addr, len) = match *seg {
                Seg::Bytes { addr, len } | Seg::Slot { addr, len, .. } => (addr, len),
            };
            out[i] = (addr + skip, len - skip);
            n = i + 1;
        }
        n
    }

    /// Fills `iov` with the pending data (see [`Tx::pending`]).
    pub fn fill_iov(&self, iov: &mut [libc::iovec]) -> usize {
        let mut p = [(0usize, 0usize); IOV_MAX];
        let k = iov.len().min(IOV_MAX);
        let n = self.pending(&mut p[..k]);
        for (v, &(addr, len)) in iov.iter_mut().zip(&p[..n]) {
            v.iov_base = addr as *mut libc::c_void;
            v.iov_len = len;
        }
        n
    }

    /// Writes as much pending data as `w` takes with one vectored write and
    /// marks it written. Ok(0) means `w` accepted nothing (closed).
    pub fn write_to(&mut self, w: &mut impl std::io::Write) -> std::io::Result<usize> {
        let mut p = [(0usize, 0usize); IOV_MAX];
        let n = self.pending(&mut p);
        let mut iov = [IoSlice::new(&[]); IOV_MAX];
        for (v, &(addr, len)) in iov.iter_mut().zip(&p[..n]) {
            // SAFETY: pending() names queued bytes or slot data, valid and
            // unchanged while queued.
            *v = IoSlice::new(unsafe { std::slice::from_raw_parts(addr as *const u8, len) });
        }
        let written = w.write_vectored(&iov[..n])?;
        self.advance(written);
        Ok(written)
    }

    /// Marks `n` more bytes written (at most the backlog).
    pub fn advance(&mut self, n: usize) {
        let mut n = n.min(self.backlog);
        self.backlog -= n;
        while n > 0 {
            let Some(front) = self.segs.front().copied() else {
                break;
            };
            let len = match front {
                Seg::Bytes { len, .. } | Seg::Slot { len, .. } => len,
            };
            let left = len - self.front_done;
            if n < left {
                self.front_done += n;
                return;
            }
            n -= left;
            self.front_done = 0;
            self.segs.pop_front();
            match front {
                Seg::Slot { slot, .. } => self.released.push(slot),
                Seg::Bytes { .. } => self.bytes_sent(),
            }
        }
    }

    /// The oldest byte segment is sent: its chunk may be reused.
    fn bytes_sent(&mut self) {
        let last = self.chunks.len() == 1;
        let Some(c) = self.chunks.front_mut() else {
            return;
        };
        c.segs = c.segs.saturating_sub(1);
        if c.segs > 0 {
            return;
        }
        if last {
            // The last chunk: nothing points into it, start it over.
            c.used = 0;
        } else if let Some(c) = self.chunks.pop_front() {
            self.retire(c.buf);
        }
    }

    /// The connection is closing unwritten (and no send is in flight):
    /// every queued slot is free again.
    pub fn abandon(&mut self) {
        for s in self.segs.drain(..) {
            if let Seg::Slot { slot, .. } = s {
                self.released.push(slot);
            }
        }
        while let Some(c) = self.chunks.pop_front() {
            self.retire(c.buf);
        }
        self.front_done = 0;
        self.backlog = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that takes at most `chunk` bytes per call.
    struct Trickle {
        out: Vec<u8>,
        chunk: usize,
    }

    impl std::io::Write for Trickle {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            let n = b.len().min(self.chunk);
            self.out.extend_from_slice(&b[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn drain(tx: &mut Tx, chunk: usize) -> Vec<u8> {
        let mut w = Trickle {
            out: Vec::new(),
            chunk,
        };
        while tx.backlog() > 0 {
            tx.write_to(&mut w).unwrap();
        }
        w.out
    }

    #[test]
    fn bytes_and_slots_come_out_in_order_whatever_the_write_sizes() {
        let data = [7u8; 1000];
        for chunk in [1, 3, 100, 4096] {
            let mut tx = Tx::default();
            tx.put(b"head");
            tx.put_slot(&data, 9);
            tx.put(b"tail");
            tx.put(b"more");
            assert_eq!(tx.backlog(), 1012);
            let out = drain(&mut tx, chunk);
            assert_eq!(&out[..4], b"head");
            assert!(out[4..1004].iter().all(|&b| b == 7));
            assert_eq!(&out[1004..], b"tailmore");
            assert_eq!(tx.released, vec![9]);
        }
    }

    #[test]
    fn a_slot_is_released_only_after_its_last_byte() {
        let data = [1u8; 10];
        let mut tx = Tx::default();
        tx.put_slot(&data, 3);
        tx.advance(9);
        assert!(tx.released.is_empty());
        tx.advance(1);
        assert_eq!(tx.released, vec![3]);
        tx.put_slot(&data, 4);
        tx.abandon();
        assert_eq!(tx.released, vec![3, 4]);
        assert_eq!(tx.backlog(), 0);
    }

    #[test]
    fn queued_bytes_stay_put_while_more_are_queued() {
        // A send in flight points at queued bytes: later puts (even many
        // chunks' worth) must not move them.
        let mut tx = Tx::default();
        tx.put(b"first");
        let mut p = [(0usize, 0usize); 1];
        assert_eq!(tx.pending(&mut p), 1);
        let (addr, len) = p[0];
        for i in 0..(3 * TX_CHUNK_BYTES / 24) {
            tx.put(&[i as u8; 24]);
        }
        tx.put(&vec![9u8; 2 * TX_CHUNK_BYTES]);
        // SAFETY: pending() named live queued bytes.
        let still = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
        assert_eq!(still, b"first");
        let total = tx.backlog();
        let out = drain(&mut tx, 1000);
        assert_eq!(out.len(), total);
        assert_eq!(&out[..5], b"first");
        assert!(out[out.len() - 2 * TX_CHUNK_BYTES..]
            .iter()
            .all(|&b| b == 9));
        assert!(tx.chunks.len() <= 1, "sent chunks are let go");
        // Reused afterwards.
        tx.put(b"again");
        assert_eq!(drain(&mut tx, 7), b"again");
    }
}
