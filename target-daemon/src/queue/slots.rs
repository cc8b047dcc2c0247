//! Command slots: one per queue entry, each owning its data buffer, and the
//! checked steps of a slot's life (see the state diagram in mod.rs).

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SlotState {
    Free,
    /// Taken by a command being checked and started (within one call).
    Admitted,
    /// Needs a pool buffer and waits for one (bufpool.rs): nothing of the
    /// transfer has happened yet.
    AwaitBuf,
    AwaitData,
    /// Its data is in, but a copier holds a claim over the bytes it
    /// changes: issued by [`Queue::retry_parked`] once the claim is gone.
    Parked,
    Backend,
    /// Its data is queued for the socket, referenced in place.
    Sending,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum IoKind {
    Other,
    Read,
    Write,
    Flush,
    WriteZeroes,
    Dsm,
}

#[derive(Debug)]
pub(super) struct Slot {
    pub(super) sqe: Sqe,
    /// The data buffer in use: the slot's own, or one lent by the pool.
    pub(super) buf: AlignedBuf,
    /// While `buf` is lent: the slot's own buffer, put aside, and the id
    /// of the lent one (both Some or both None).
    pub(super) own: Option<AlignedBuf>,
    pub(super) lent: Option<u32>,
    pub(super) state: SlotState,
    /// Bytes of data this command moves (either direction).
    pub(super) len: usize,
    /// Host-to-controller bytes received so far.
    pub(super) got: usize,
    /// Set when received data was damaged (data digest).
    pub(super) err: Option<Status>,
    pub(super) kind: IoKind,
    pub(super) ns: Option<Arc<Namespace>>,
    /// Namespace byte offset of Read/Write/Write Zeroes.
    pub(super) off: u64,
    /// Bytes the backend finished (short io_uring transfers resubmit the rest).
    pub(super) done: usize,
    /// Bytes of the range a Write Zeroes command covers.
    pub(super) span: u64,
    pub(super) fua: bool,
    /// NVMe/RDMA: the host memory a keyed SGL names.
    pub(super) keyed: Option<KeyedSgl>,
    /// Write Zeroes or deallocate on the ring: its operations.
    pub(super) zero: Option<ZeroJob>,
}

impl Slot {
    pub(super) fn new() -> Slot {
        Slot {
            sqe: Sqe::default(),
            buf: AlignedBuf::new(4096),
            own: None,
            lent: None,
            state: SlotState::Free,
            len: 0,
            got: 0,
            err: None,
            kind: IoKind::Other,
            ns: None,
            off: 0,
            done: 0,
            span: 0,
            fua: false,
            keyed: None,
            zero: None,
        }
    }

    /// Grows the slot's own buffer (never a lent one) to `n` bytes.
    pub(super) fn ensure_buf(&mut self, n: usize) {
        debug_assert!(n <= limits::SLOT_BUF_BYTES_MAX && self.lent.is_none());
        if self.buf.capacity() < n {
            self.buf = AlignedBuf::new(n.next_power_of_two());
        }
    }

    /// Uses a pool buffer for this command.
    pub(super) fn take_pool(&mut self, b: PoolBuf) {
        debug_assert!(self.lent.is_none());
        self.own = Some(std::mem::replace(&mut self.buf, b.buf));
        self.lent = Some(b.id);
    }

    /// The pool buffer this slot holds, if any; its own buffer is back.
    pub(super) fn give_pool(&mut self) -> Option<PoolBuf> {
        self.lent?;
        // A lent buffer put the own one aside; without it, keep the slot
        // as it is rather than lose its buffer.
        let own = self.own.take()?;
        let id = self.lent.take()?;
        Some(PoolBuf {
            buf: std::mem::replace(&mut self.buf, own),
            id,
        })
    }
}

/// A slot's data buffer as the RDMA transport registers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotBuffer {
    pub ptr: *mut u8,
    pub cap: usize,
    /// A pool buffer's id (its address is stable for the reactor's life),
    /// None for the slot's own buffer.
    pub pool_id: Option<u32>,
}

impl Queue {
    /// A slot's data buffer, for the RDMA transport to register. The
    /// slot's own buffer stays valid until it grows; a pool buffer for the
    /// reactor's life.
    pub fn slot_buffer(&mut self, slot: u16) -> SlotBuffer {
        let s = &mut self.slots[slot as usize];
        let cap = s.buf.capacity();
        SlotBuffer {
            ptr: s.buf.as_mut_slice(cap).as_mut_ptr(),
            cap,
            pool_id: s.lent,
        }
    }

    /// Hands the pool buffers of freed slots back to `pool`.
    pub fn take_returned(&mut self, pool: &mut BufPool) {
        for b in self.returned.drain(..) {
            pool.give_back(b);
        }
    }

    /// Ends the connection for a broken slot-state invariant: a bug, found
    /// before it could corrupt another command. Nothing of the slot is
    /// touched; the queue stops reading and executing, and is never freed
    /// (what the ring may still point at stays valid).
    pub(super) fn violation(&mut self, si: usize, what: &'static str) {
        let state = self.slots.get(si).map(|s| s.state);
        peer_error!(peer = %self.peer, qid = ?self.qid, slot = si, ?state, "{what}: slot-state invariant broken; ending the connection");
        self.phase = match self.phase {
            Phase::Detached { .. } => Phase::Detached { poisoned: true },
            Phase::Closed { .. } => Phase::Closed { poisoned: true },
            _ => Phase::Poisoned {
                since_ms: self.end_since_ms(),
            },
        };
    }

    /// Checks that slot `si` exists and is in `want` before a step that
    /// needs it; a violation otherwise.
    pub(super) fn expect_state(&mut self, si: usize, want: SlotState, what: &'static str) -> bool {
        if self.slots.get(si).is_some_and(|s| s.state == want) {
            return true;
        }
        self.violation(si, what);
        false
    }

    /// Frees slots whose data the transmit queue has written.
    pub fn reclaim(&mut self, tx: &mut Tx) {
        for i in 0..tx.released.len() {
            let si = tx.released[i] as usize;
            if self.poisoned()
                || !self.expect_state(si, SlotState::Sending, "data sent from a slot not sending")
            {
                break;
            }
            self.release(si);
        }
        tx.released.clear();
    }

    pub(super) fn release(&mut self, si: usize) {
        if self.poisoned() {
            return;
        }
        let Some(s) = self
            .slots
            .get_mut(si)
            .filter(|s| s.state != SlotState::Free)
        else {
            // Freed twice: two commands would share the slot.
            self.violation(si, "freeing a free slot");
            return;
        };
        s.state = SlotState::Free;
        s.ns = None;
        s.zero = None;
        if let Some(b) = s.give_pool() {
            self.returned.push(b);
        }
        self.free.push(si as u16);
    }
}
