//! A connection's transmit queue: PDU headers and small payloads copied into
//! one byte buffer, command data referenced in place in its slot's buffer,
//! all written with one `writev` per flush.
//!
//! A slot whose data is queued stays out of use until that data has been
//! written: [`Tx::advance`] hands its index back in [`Tx::released`].

use std::collections::VecDeque;
use std::io::IoSlice;

/// iovecs per writev (the kernel's UIO_MAXIOV is 1024; responses batch well
/// below that).
pub const IOV_MAX: usize = 64;

#[derive(Debug, Clone, Copy)]
enum Seg {
    /// `len` bytes of the byte buffer from `start`.
    Bytes { start: usize, len: usize },
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

#[derive(Debug, Default)]
pub struct Tx {
    /// NVMe/RDMA: work to post (the byte queue stays empty).
    pub rdma: Vec<RdmaWork>,
    bytes: Vec<u8>,
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
        let start = self.bytes.len();
        self.bytes.extend_from_slice(b);
        self.backlog += b.len();
        if let Some(Seg::Bytes { start: s, len }) = self.segs.back_mut() {
            if *s + *len == start {
                *len += b.len();
                return;
            }
        }
        self.segs.push_back(Seg::Bytes {
            start,
            len: b.len(),
        });
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

    /// Writes as much pending data as `w` takes with one vectored write and
    /// marks it written. Ok(0) means `w` accepted nothing (closed).
    pub fn write_to(&mut self, w: &mut impl std::io::Write) -> std::io::Result<usize> {
        let mut iov = [IoSlice::new(&[]); IOV_MAX];
        let mut n = 0;
        for (i, seg) in self.segs.iter().enumerate().take(IOV_MAX) {
            let skip = if i == 0 { self.front_done } else { 0 };
            let s: &[u8] = match *seg {
                Seg::Bytes { start, len } => &self.bytes[start + skip..start + len],
                // SAFETY: put_slot's contract keeps the slot buffer alive and
                // unchanged while its segment is queued; addr..addr+len lies
                // inside it.
                Seg::Slot { addr, len, .. } => unsafe {
                    std::slice::from_raw_parts((addr + skip) as *const u8, len - skip)
                },
            };
            iov[i] = IoSlice::new(s);
            n = i + 1;
        }
        let written = w.write_vectored(&iov[..n])?;
        self.advance(written);
        Ok(written)
    }

    /// Marks `n` more bytes written.
    pub fn advance(&mut self, mut n: usize) {
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
            if let Seg::Slot { slot, .. } = front {
                self.released.push(slot);
            }
        }
        if self.segs.is_empty() {
            self.bytes.clear();
        }
    }

    /// The connection is closing unwritten: every queued slot is free again.
    pub fn abandon(&mut self) {
        for s in self.segs.drain(..) {
            if let Seg::Slot { slot, .. } = s {
                self.released.push(slot);
            }
        }
        self.bytes.clear();
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
}
