//! Waiting for the mutations issued before a copy changed state, without
//! waiting for the ones issued after (SRCU's two counters).
//!
//! Every mutation holds a [`Hold`] while it is outstanding: it reads the
//! epoch and counts itself on the epoch's side (`epoch & 1`) of two
//! counters, and uncounts itself when it completes. [`Drain::wait`] flips
//! the epoch and waits for the side it flipped away from to reach zero,
//! then flips again and waits for the other side. New holds count on the
//! side not being waited for, so the wait ends under any load: only holds
//! that read the old epoch just before a flip can still join the side being
//! waited for, at most one per caller in the middle of [`Drain::enter`].
//!
//! **What the wait guarantees.** The caller (begin_sync) stores a copy's new
//! state, then waits. Every mutation loads the copies' states *after* its
//! hold is counted. All of these are `SeqCst`, so they sit in one total
//! order S. Let mutation M have seen the old state: its state load comes
//! before the state store in S, and its increment (sequenced before its
//! load) before that. Both counter checks of the wait come after the state
//! store, so after M's increment, whichever side M counted on: a `SeqCst`
//! load later in S than M's increment reads a value at or after it in the
//! counter's modification order. Each decrement follows its own increment
//! in that order, so a read of zero means M's decrement came before it, and
//! the read synchronises with it: M's completion (and everything M wrote
//! before, such as its missed-region marks) happens before the wait
//! returns. A mutation that is not waited for therefore counted itself
//! after a check, hence after the state store, and its state load (later
//! still) sees the new state. Neither flip is needed for this argument;
//! they are what keeps the wait from starving under constant load.
//!
//! The volume's write epoch is the same case: `Volume::set_write_epoch`
//! stores the new epoch, then waits; every mutation loads the epoch after
//! its hold is counted, so one that was not waited for carries the new one.

use crate::limits::{DRAIN_NAP_MAX, DRAIN_NAP_MIN};
use nvpool_rt::lock;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A counter on a cache line of its own: the two sides are written by
/// every mutation, and not by the same ones at the same time.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Side(AtomicUsize);

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Drain {
    epoch: AtomicUsize,
    active: [Side; 2],
    /// One wait at a time: a second waiter flipping the epoch back would
    /// send new mutations to the side the first one waits for.
    waiting: Mutex<()>,
}

/// A mutation counted as outstanding; uncounted on drop.
#[derive(Debug)]
pub(crate) struct Hold<'a> {
    drain: &'a Drain,
    side: usize,
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        self.drain.active[self.side].0.fetch_sub(1, SeqCst);
    }
}

impl Drain {
    /// Counts a mutation as outstanding until the hold drops. Load the
    /// copies' states after this, never before.
    pub fn enter(&self) -> Hold<'_> {
        let side = self.epoch.load(SeqCst) & 1;
        self.active[side].0.fetch_add(1, SeqCst);
        Hold { drain: self, side }
    }

    /// Blocks until every hold counted before this call was dropped (see
    /// the module docs for the exact guarantee). False when `timeout`
    /// passed first. Never call it while holding a [`Hold`]: it would wait
    /// for itself.
    pub fn wait(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let _one = lock(&self.waiting);
        for _ in 0..2 {
            let old = self.epoch.fetch_add(1, SeqCst) & 1;
            let mut nap = nvpool_rt::Backoff::new(DRAIN_NAP_MIN, DRAIN_NAP_MAX);
            while self.active[old].0.load(SeqCst) != 0 {
                let now = Instant::now();
                if now >= deadline {
                    return false;
                }
                std::thread::sleep(nap.step().min(deadline - now));
            }
        }
        true
    }

    /// Holds outstanding now (both sides).
    #[cfg(test)]
    fn outstanding(&self) -> usize {
        self.active[0].0.load(SeqCst) + self.active[1].0.load(SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::mpsc;

    /// Long enough never to be reached by a correct drain on a loaded CI
    /// machine; the failure it stands for is a wait that never ends.
    const NEVER: Duration = Duration::from_secs(20);

    #[test]
    fn waits_for_holds_taken_before_and_only_for_them() {
        let d = Drain::default();
        assert!(d.wait(NEVER), "nothing outstanding");
        let released = AtomicBool::new(false);
        std::thread::scope(|s| {
            let (tx, rx) = mpsc::sync_channel(1);
            let (go, stop) = mpsc::sync_channel::<()>(1);
            let (d, released) = (&d, &released);
            s.spawn(move || {
                let h = d.enter();
                tx.send(()).unwrap();
                stop.recv().unwrap();
                released.store(true, SeqCst);
                drop(h);
            });
            rx.recv().unwrap();
            // Released only once the waiter is (very likely) waiting; the
            // assertion holds whatever the interleaving.
            s.spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                go.send(()).unwrap();
            });
            assert!(d.wait(NEVER));
            assert!(released.load(SeqCst), "the wait ended before the hold");
        });
        assert_eq!(d.outstanding(), 0);
    }

    #[test]
    fn constant_load_never_starves_a_wait() {
        // One caller always has a hold outstanding (it takes the next one
        // before dropping the last), so a single counter would never read
        // zero; the wait must still end.
        let d = Drain::default();
        let stop = AtomicBool::new(false);
        let ended = std::thread::scope(|s| {
            let (d, stop) = (&d, &stop);
            let (tx, rx) = mpsc::sync_channel(1);
            s.spawn(move || {
                let mut held = d.enter();
                tx.send(()).unwrap();
                while !stop.load(SeqCst) {
                    let next = d.enter();
                    held = next;
                    std::thread::yield_now();
                }
                drop(held);
            });
            rx.recv().unwrap();
            let ended = (0..20).all(|_| d.wait(NEVER));
            // The loader stops before anything is asserted, or a failure
            // would leave the scope waiting for it forever.
            stop.store(true, SeqCst);
            ended
        });
        assert!(ended, "a wait starved under constant load");
        assert_eq!(d.outstanding(), 0);
    }

    #[test]
    fn a_hold_that_never_ends_times_the_wait_out() {
        let d = Drain::default();
        let h = d.enter();
        assert!(!d.wait(Duration::from_millis(30)));
        drop(h);
        assert!(d.wait(NEVER));
    }
}
