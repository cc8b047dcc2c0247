//! A bounded pool of I/O buffers, reused by exact length.
//!
//! Block I/O hands buffers around as `Vec<u8>` whose length is the transfer,
//! so a buffer can only be reused as is for a request of the same length:
//! growing a shorter one writes zeroes over the new part, which on a busy
//! front-end costs as much as a copy of the data. The pool therefore keeps
//! buffers per length (a workload's requests come in a few sizes: the
//! readahead window, the stripe unit, the files' sizes rounded to blocks) and
//! allocates a zeroed one only when no buffer of that length is free.

use crate::limits::{BUF_POOL_BUF_BYTES_MAX, BUF_POOL_BYTES_MAX, BUF_POOL_PER_LENGTH_MAX};
use nvpool_rt::lock;
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

#[derive(Debug, Default)]
struct Free {
    by_len: HashMap<usize, Vec<Vec<u8>>>,
    bytes: usize,
}

#[derive(Debug, Default)]
pub(crate) struct BufPool {
    free: Mutex<Free>,
}

impl BufPool {
    fn lock(&self) -> MutexGuard<'_, Free> {
        lock(&self.free)
    }

    /// A buffer of `len` bytes; its contents are unspecified (stale data of
    /// an earlier request, or zeroes), so callers overwrite it fully.
    pub(crate) fn get(&self, len: usize) -> Vec<u8> {
        let reused = {
            let mut g = self.lock();
            let b = g.by_len.get_mut(&len).and_then(|v| v.pop());
            if b.is_some() {
                g.bytes -= len;
            }
            b
        };
        reused.unwrap_or_else(|| vec![0; len])
    }

    /// Takes a buffer back for reuse (or frees it when the pool is full).
    pub(crate) fn put(&self, b: Vec<u8>) {
        let len = b.len();
        if len == 0 || len > BUF_POOL_BUF_BYTES_MAX {
            return;
        }
        let mut g = self.lock();
        if g.bytes + len > BUF_POOL_BYTES_MAX {
            return;
        }
        let class = g.by_len.entry(len).or_default();
        if class.len() < BUF_POOL_PER_LENGTH_MAX {
            class.push(b);
            g.bytes += len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_by_exact_length_and_stays_bounded() {
        let p = BufPool::default();
        let mut a = p.get(8192);
        assert_eq!(a.len(), 8192);
        a[0] = 7;
        let at = a.as_ptr();
        p.put(a);
        // Another length gets a fresh buffer; the same length the old one.
        assert_eq!(p.get(4096).len(), 4096);
        let b = p.get(8192);
        assert_eq!((b.as_ptr(), b[0]), (at, 7));
        // Too large, or beyond the byte budget: freed.
        p.put(vec![0; BUF_POOL_BUF_BYTES_MAX + 1]);
        assert_eq!(p.lock().bytes, 0);
        for _ in 0..(BUF_POOL_BYTES_MAX / BUF_POOL_BUF_BYTES_MAX + 4) {
            p.put(vec![0; BUF_POOL_BUF_BYTES_MAX]);
        }
        assert!(p.lock().bytes <= BUF_POOL_BYTES_MAX);
        let p = BufPool::default();
        for _ in 0..BUF_POOL_PER_LENGTH_MAX + 10 {
            p.put(vec![0; 512]);
        }
        assert_eq!(p.lock().by_len[&512].len(), BUF_POOL_PER_LENGTH_MAX);
    }
}
