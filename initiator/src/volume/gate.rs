//! The write hold of a group snapshot's barrier (design/thin-snapshots.md
//! T5, ARCHITECTURE I6): while a volume's writes are held, no new write,
//! write-zeroes or discard is admitted; they wait, as futures, never
//! blocking the thread that submitted them, and go on once the hold is
//! released. Reads and flushes never wait here.
//!
//! ```text
//!  mutation ── drain hold, epoch load ──► held? ──no──► issued, tagged
//!                  ▲                        │yes
//!                  └── woken (release) ◄── drop the drain hold, wait
//!
//!  hold(E) ── held = true ─► watchdog thread: releases at the deadline
//!  release ── held = false, wake every waiter, the watchdog ends
//! ```
//!
//! A hold that nobody releases ends on its own after the volume's
//! `write_hold_max` (the control plane gave its barrier up long before),
//! with one warning. The data path pays one atomic load for this while no
//! hold is on; only a held mutation takes the lock.
//!
//! Why a mutation never goes out tagged with the hold's epoch while held
//! (the ordering with the epoch store is `Volume::hold_writes`'s) is in
//! `Volume::admit`.

use crate::error::Error;
use nvpool_rt::lock;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// See the module docs.
#[derive(Debug)]
pub(crate) struct WriteGate {
    /// The volume's name, for the log.
    name: String,
    /// How long a hold lasts unless released.
    max: Duration,
    /// Mirrors `state.hold.is_some()`: the data path's one load.
    held: AtomicBool,
    state: Mutex<State>,
    /// Told when a hold ends or the gate closes (the watchdog waits on it).
    ended: Condvar,
}

#[derive(Debug, Default)]
struct State {
    hold: Option<Hold>,
    /// The highest epoch a hold ended at (released or expired): a barrier
    /// at it is over, so the volume is not held there again.
    ended_epoch: u32,
    /// Counts holds, so a watchdog knows its own.
    holds: u64,
    /// Futures of held mutations. Bounded by the mutations in flight (the
    /// executor's tasks, the front-ends' queues): each waits here once.
    waiters: Vec<Waker>,
    /// The volume is closing: no more holds.
    closed: bool,
}

#[derive(Debug, Clone, Copy)]
struct Hold {
    epoch: u32,
    /// When it ends on its own.
    deadline: Instant,
    /// Its number in `State::holds`.
    id: u64,
}

/// What [`WriteGate::hold`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Held {
    /// Held from now (or already, at this epoch or a lower one).
    Yes,
    /// Not held: a hold at this epoch already ended (released, or expired
    /// on its own), so its barrier is over.
    Over,
}

impl WriteGate {
    pub(crate) fn new(name: String, max: Duration) -> Arc<WriteGate> {
        Arc::new(WriteGate {
            name,
            max,
            held: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            ended: Condvar::new(),
        })
    }

    /// True while mutations are held. `SeqCst`: see `Volume::admit`.
    pub(crate) fn is_held(&self) -> bool {
        self.held.load(SeqCst)
    }

    /// True while held at `epoch` or a later one.
    pub(crate) fn holds_at(&self, epoch: u32) -> bool {
        lock(&self.state).hold.is_some_and(|h| h.epoch >= epoch)
    }

    /// Holds mutations from now on, at `epoch`: the held flag is stored
    /// (`SeqCst`) before this returns, so before the caller stores the
    /// epoch. A hold already on moves to `epoch` if higher, its deadline
    /// counted again from now (a new barrier); at the same or a lower
    /// epoch it is left as it is (a retry). Errors: the volume is closing,
    /// or no thread could be started to end the hold on time (then
    /// nothing is held).
    pub(crate) fn hold(self: &Arc<Self>, epoch: u32) -> Result<Held, Error> {
        let mut st = lock(&self.state);
        if st.closed {
            return Err(Error::Invalid(format!(
                "{}: the volume is closing; writes are not held",
                self.name
            )));
        }
        let deadline = Instant::now() + self.max;
        if let Some(h) = &mut st.hold {
            if epoch > h.epoch {
                h.epoch = epoch;
                h.deadline = deadline;
            }
            return Ok(Held::Yes);
        }
        if epoch <= st.ended_epoch {
            return Ok(Held::Over);
        }
        let id = st.holds + 1;
        let gate = self.clone();
        // It waits for the lock, so it finds the hold set below.
        std::thread::Builder::new()
            .name("nvpool-hold".into())
            .spawn(move || gate.watch(id))
            .map_err(|e| {
                Error::Invalid(format!(
                    "{}: cannot start the thread that bounds a write hold: {e}",
                    self.name
                ))
            })?;
        st.holds = id;
        st.hold = Some(Hold {
            epoch,
            deadline,
            id,
        });
        self.held.store(true, SeqCst);
        Ok(Held::Yes)
    }

    /// Ends the hold (if any): every waiting mutation goes on, tagged with
    /// the epoch it loads then. Returns whether a hold ended.
    pub(crate) fn release(&self) -> bool {
        let mut st = lock(&self.state);
        self.end(&mut st).is_some()
    }

    /// No more holds; a hold on now ends (called when the volume goes).
    pub(crate) fn close(&self) {
        let mut st = lock(&self.state);
        st.closed = true;
        self.end(&mut st);
    }

    /// Ends the hold in `st`, wakes the waiters, tells the watchdog.
    fn end(&self, st: &mut State) -> Option<Hold> {
        let h = st.hold.take()?;
        st.ended_epoch = st.ended_epoch.max(h.epoch);
        self.held.store(false, SeqCst);
        // Woken under the lock: a waker only schedules its task, and the
        // task takes the lock only after it runs.
        st.waiters.drain(..).for_each(Waker::wake);
        self.ended.notify_all();
        Some(h)
    }

    /// The watchdog of hold `id`: ends it at its deadline unless it ended
    /// before.
    fn watch(&self, id: u64) {
        let mut st = lock(&self.state);
        loop {
            let Some(h) = st.hold.filter(|h| h.id == id) else {
                return;
            };
            let now = Instant::now();
            if now >= h.deadline {
                self.end(&mut st);
                tracing::warn!(volume = %self.name, epoch = h.epoch, after = ?self.max,
                    "write hold not released in time; admitting writes again");
                return;
            }
            st = self
                .ended
                .wait_timeout(st, h.deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Ready once no hold is on (at once if none is).
    pub(crate) fn released(&self) -> Released<'_> {
        Released { gate: self }
    }
}

/// See [`WriteGate::released`].
#[derive(Debug)]
pub(crate) struct Released<'a> {
    gate: &'a WriteGate,
}

impl Future for Released<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if !self.gate.is_held() {
            return Poll::Ready(());
        }
        let mut st = lock(&self.gate.state);
        // Looked at again under the lock, which `end` holds while it
        // clears the flag and wakes: no wake-up is lost in between.
        if st.hold.is_none() {
            return Poll::Ready(());
        }
        if !st.waiters.iter().any(|w| w.will_wake(cx.waker())) {
            st.waiters.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Wake;

    const NEVER: Duration = Duration::from_secs(20);

    struct Count(std::sync::atomic::AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, SeqCst);
        }
    }

    fn poll(f: &mut Released<'_>, w: &Arc<Count>) -> Poll<()> {
        let waker = Waker::from(w.clone());
        Pin::new(f).poll(&mut Context::from_waker(&waker))
    }

    #[test]
    fn a_held_future_waits_until_release_and_is_woken_once() {
        let g = WriteGate::new("v".into(), NEVER);
        let w = Arc::new(Count(Default::default()));
        assert_eq!(poll(&mut g.released(), &w), Poll::Ready(()));
        assert_eq!(g.hold(3).unwrap(), Held::Yes);
        assert!(g.is_held() && g.holds_at(3) && !g.holds_at(4));
        let mut f = g.released();
        assert_eq!(poll(&mut f, &w), Poll::Pending);
        // Polled again (a spurious wake-up): registered once.
        assert_eq!(poll(&mut f, &w), Poll::Pending);
        assert_eq!(g.lock_waiters(), 1);
        assert!(g.release());
        assert_eq!(w.0.load(SeqCst), 1);
        assert_eq!(poll(&mut f, &w), Poll::Ready(()));
        assert!(!g.release(), "nothing left to release");
    }

    #[test]
    fn a_hold_moves_up_never_down_and_not_back_to_an_ended_epoch() {
        let g = WriteGate::new("v".into(), NEVER);
        g.hold(3).unwrap();
        g.hold(5).unwrap();
        g.hold(4).unwrap();
        assert!(g.holds_at(5));
        g.release();
        assert_eq!(g.hold(5).unwrap(), Held::Over);
        assert_eq!(g.hold(2).unwrap(), Held::Over);
        assert!(!g.is_held());
        assert_eq!(g.hold(6).unwrap(), Held::Yes);
        g.close();
        assert!(!g.is_held());
        assert!(g.hold(7).is_err(), "a closing volume is not held");
    }

    #[test]
    fn an_unreleased_hold_ends_on_its_own() {
        let g = WriteGate::new("v".into(), Duration::from_millis(50));
        let w = Arc::new(Count(Default::default()));
        let start = Instant::now();
        g.hold(2).unwrap();
        let mut f = g.released();
        assert_eq!(poll(&mut f, &w), Poll::Pending);
        nvpool_testkit::wait_for("the hold to expire", NEVER, || !g.is_held());
        assert!(start.elapsed() >= Duration::from_millis(50));
        assert_eq!(w.0.load(SeqCst), 1, "the waiter was woken");
        assert_eq!(g.hold(2).unwrap(), Held::Over);
    }

    impl WriteGate {
        fn lock_waiters(&self) -> usize {
            lock(&self.state).waiters.len()
        }
    }
}
