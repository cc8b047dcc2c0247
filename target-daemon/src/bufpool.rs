//! A reactor's large data buffers and the byte budget they live under
//! (docs/ARCHITECTURE.md D18).
//!
//! A command slot owns a small buffer of its own, grown to at most
//! [`limits::SLOT_BUF_BYTES_MAX`]: in-capsule data, Identify data, DSM range
//! lists and small I/O use it and never wait. A command that moves more
//! borrows one MDTS-sized buffer from its reactor's [`BufPool`] for as long
//! as it holds the data (from admission to the response's last byte), then
//! gives it back. The pool holds at most its budget in buffers, lent or
//! idle; idle ones stay for the next command, so the steady state allocates
//! nothing, and they are freed with the reactor.
//!
//! When the budget is spent, a command that needs a buffer waits in its
//! slot, in arrival order across the reactor's connections: its R2T (for a
//! write) or its execution (for a read) is delayed; the connection is still
//! read. So every command that holds a buffer finishes without needing
//! another (the data of an R2T already sent is always read, a read's data
//! always leaves), buffers always come back, and no connection can deadlock
//! another or itself.
//!
//! ```text
//!  admitted ─ len ≤ own ───────────────────────────────────► R2T / execute
//!           └ len > own ─ lend() ─ Some ──────────────────► R2T / execute
//!                               └ None ─ wait(slot) ─ … ─ grant() ─┘
//!  slot freed ─► Queue::returned ─► reactor: give_back() ─► next waiter
//! ```
//!
//! Buffers are whole MDTS-sized ones, whatever the transfer: the pool never
//! frees a buffer to make room for another size, so a buffer's address is
//! stable for the reactor's life (an RDMA link registers each pool buffer
//! once, by [`PoolBuf::id`]).

use crate::backend::AlignedBuf;
use crate::limits::POOL_BUF_BYTES;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// One pool buffer, lent to a command slot.
#[derive(Debug)]
pub struct PoolBuf {
    pub buf: AlignedBuf,
    /// Its index in the pool: stable, unique within one reactor.
    pub id: u32,
}

/// A reactor's buffer figures, readable from any thread (the admin API's
/// `GET /v1/target`, tests).
#[derive(Debug, Default)]
pub struct BufStats {
    pub reactor: usize,
    pub budget_bytes: AtomicUsize,
    /// Bytes lent to commands now: 0 when the reactor is idle.
    pub lent_bytes: AtomicUsize,
    /// Bytes the pool has allocated (lent and idle), at most the budget.
    pub allocated_bytes: AtomicUsize,
    /// Commands waiting for a buffer now.
    pub waiting: AtomicUsize,
    /// Commands that had to wait for a buffer, since start.
    pub waits_total: AtomicU64,
}

/// A snapshot of [`BufStats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct BufFigures {
    pub reactor: usize,
    pub budget_bytes: usize,
    pub lent_bytes: usize,
    pub allocated_bytes: usize,
    pub waiting: usize,
    pub waits_total: u64,
}

impl BufStats {
    pub fn figures(&self) -> BufFigures {
        BufFigures {
            reactor: self.reactor,
            budget_bytes: self.budget_bytes.load(Ordering::Relaxed),
            lent_bytes: self.lent_bytes.load(Ordering::Relaxed),
            allocated_bytes: self.allocated_bytes.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            waits_total: self.waits_total.load(Ordering::Relaxed),
        }
    }
}

/// The pool; owned by one reactor thread and handed to its queues through
/// `Exec` (only that thread touches it).
#[derive(Debug)]
pub struct BufPool {
    /// Buffers the budget allows.
    max: u32,
    /// Buffers allocated so far (ids `0..allocated`).
    allocated: u32,
    lent: u32,
    idle: Vec<PoolBuf>,
    /// Slots waiting for a buffer (`queue::user_data`), oldest first. At
    /// most one entry per slot of the reactor's connections: a slot waits
    /// once per command, and a closing connection's entries are dropped.
    waiters: VecDeque<u64>,
    stats: Arc<BufStats>,
}

/// Why a budget was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a reactor buffer budget of {0} bytes holds no {POOL_BUF_BYTES}-byte buffer")]
pub struct BudgetTooSmall(pub usize);

impl BufPool {
    /// A pool of at most `budget_bytes` (whole buffers; at least one).
    pub fn new(reactor: usize, budget_bytes: usize) -> Result<BufPool, BudgetTooSmall> {
        let max = budget_bytes / POOL_BUF_BYTES;
        if max == 0 {
            return Err(BudgetTooSmall(budget_bytes));
        }
        let max = u32::try_from(max).unwrap_or(u32::MAX);
        let stats = Arc::new(BufStats {
            reactor,
            ..BufStats::default()
        });
        stats
            .budget_bytes
            .store(max as usize * POOL_BUF_BYTES, Ordering::Relaxed);
        Ok(BufPool {
            max,
            allocated: 0,
            lent: 0,
            idle: Vec::new(),
            waiters: VecDeque::new(),
            stats,
        })
    }

    pub fn stats(&self) -> &Arc<BufStats> {
        &self.stats
    }

    /// Buffers lent now.
    pub fn lent(&self) -> u32 {
        self.lent
    }

    /// A buffer for a new command, unless the budget is spent or earlier
    /// commands are waiting (they go first).
    pub fn lend(&mut self) -> Option<PoolBuf> {
        if !self.waiters.is_empty() {
            return None;
        }
        self.take()
    }

    fn take(&mut self) -> Option<PoolBuf> {
        let b = match self.idle.pop() {
            Some(b) => b,
            None if self.allocated < self.max => {
                let id = self.allocated;
                self.allocated += 1;
                self.stats
                    .allocated_bytes
                    .store(self.allocated as usize * POOL_BUF_BYTES, Ordering::Relaxed);
                PoolBuf {
                    buf: AlignedBuf::new(POOL_BUF_BYTES),
                    id,
                }
            }
            None => return None,
        };
        self.lent += 1;
        self.publish_lent();
        Some(b)
    }

    /// Queues slot `user_data` for the next buffer that comes back.
    pub fn wait(&mut self, user_data: u64) {
        self.waiters.push_back(user_data);
        self.stats.waits_total.fetch_add(1, Ordering::Relaxed);
        self.stats
            .waiting
            .store(self.waiters.len(), Ordering::Relaxed);
    }

    /// A buffer comes back from a slot.
    pub fn give_back(&mut self, b: PoolBuf) {
        if b.id >= self.allocated || self.lent == 0 {
            // A bug, but not one to stop the reactor for: the buffer is
            // freed instead of kept, and the figures stay as they were.
            tracing::error!(
                id = b.id,
                lent = self.lent,
                "a buffer came back to a pool that did not lend it; freeing it"
            );
            return;
        }
        self.lent -= 1;
        self.idle.push(b);
        self.publish_lent();
    }

    /// The oldest waiter and a buffer for it, when one is free.
    pub fn grant(&mut self) -> Option<(u64, PoolBuf)> {
        let ud = *self.waiters.front()?;
        let b = self.take()?;
        self.waiters.pop_front();
        self.stats
            .waiting
            .store(self.waiters.len(), Ordering::Relaxed);
        Some((ud, b))
    }

    /// Commands wait and a buffer is free for the first of them.
    pub fn can_grant(&self) -> bool {
        !self.waiters.is_empty() && (!self.idle.is_empty() || self.allocated < self.max)
    }

    /// Forgets the waiters whose user data `is_gone` (a closed connection's).
    pub fn forget(&mut self, is_gone: impl Fn(u64) -> bool) {
        self.waiters.retain(|&ud| !is_gone(ud));
        self.stats
            .waiting
            .store(self.waiters.len(), Ordering::Relaxed);
    }

    fn publish_lent(&self) {
        self.stats
            .lent_bytes
            .store(self.lent as usize * POOL_BUF_BYTES, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lends_up_to_the_budget_then_grants_in_order() {
        let mut p = BufPool::new(0, 2 * POOL_BUF_BYTES + 100).unwrap();
        assert_eq!(p.stats().figures().budget_bytes, 2 * POOL_BUF_BYTES);
        let a = p.lend().unwrap();
        let b = p.lend().unwrap();
        assert_ne!(a.id, b.id);
        assert!(p.lend().is_none(), "the budget is spent");
        p.wait(10);
        p.wait(11);
        assert!(!p.can_grant());
        assert!(p.grant().is_none());
        p.give_back(a);
        assert!(p.lend().is_none(), "waiters go before new commands");
        let (ud, a) = p.grant().unwrap();
        assert_eq!(ud, 10);
        p.give_back(b);
        let (ud, b) = p.grant().unwrap();
        assert_eq!(ud, 11);
        let f = p.stats().figures();
        assert_eq!(
            (f.lent_bytes, f.waiting, f.waits_total),
            (2 * POOL_BUF_BYTES, 0, 2)
        );
        p.give_back(a);
        p.give_back(b);
        let f = p.stats().figures();
        assert_eq!(f.lent_bytes, 0, "idle: nothing lent");
        assert_eq!(f.allocated_bytes, 2 * POOL_BUF_BYTES, "kept for reuse");
        // Reused, not allocated again.
        let c = p.lend().unwrap();
        assert!(c.id < 2);
        p.give_back(c);
    }

    #[test]
    fn forgotten_waiters_get_nothing() {
        let mut p = BufPool::new(0, POOL_BUF_BYTES).unwrap();
        let a = p.lend().unwrap();
        p.wait(1 << 16);
        p.wait(2 << 16);
        p.forget(|ud| ud >> 16 == 1);
        p.give_back(a);
        assert_eq!(p.grant().map(|(ud, b)| (ud, b.id)), Some((2 << 16, 0)));
        assert_eq!(p.stats().figures().waiting, 0);
    }

    #[test]
    fn a_budget_below_one_buffer_is_refused() {
        assert_eq!(
            BufPool::new(0, POOL_BUF_BYTES - 1).unwrap_err(),
            BudgetTooSmall(POOL_BUF_BYTES - 1)
        );
    }
}
