//! The generic core of the seeded deterministic simulations (VOPR style) in
//! the nvpool crates' tests: an event queue, the draws a model makes, the
//! network delay with its rare long stalls, a `Stats` shape summed over
//! seeds, and the seed loop with its environment-variable replay.
//!
//! A simulation owns its model, its generator and its events; this module
//! owns nothing random itself, so a seed's run depends only on the order of
//! the simulation's own calls: moving a simulation onto it changes no run.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::fmt::Debug;

/// The draws a model makes from its seeded generator. Only
/// [`Draw::below`] is the generator's own; the others are built on it, one
/// `below` each, so two simulations with different generators share them
/// without either's sequence changing.
pub trait Draw {
    /// A number in `0..n` (`n` > 0).
    fn below(&mut self, n: u64) -> u64;

    /// A number in `[lo, hi]`.
    fn range(&mut self, (lo, hi): (u64, u64)) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True once in `n` draws on average.
    fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }
}

impl Draw for nvpool_rt::random::Rng {
    fn below(&mut self, n: u64) -> u64 {
        nvpool_rt::random::Rng::below(self, n)
    }
}

/// Events due at a tick, popped earliest first; events due at the same
/// tick come out in the order they were scheduled, so a run never depends
/// on how the heap breaks ties.
#[derive(Debug)]
pub struct EventQueue<E> {
    now: u64,
    next_seq: u64,
    heap: BinaryHeap<Queued<E>>,
}

#[derive(Debug)]
struct Queued<E> {
    at: u64,
    seq: u64,
    ev: E,
}

impl<E> PartialEq for Queued<E> {
    fn eq(&self, o: &Queued<E>) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl<E> Eq for Queued<E> {}
impl<E> PartialOrd for Queued<E> {
    fn partial_cmp(&self, o: &Queued<E>) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl<E> Ord for Queued<E> {
    /// Reversed: `BinaryHeap` pops the earliest event, ties in schedule order.
    fn cmp(&self, o: &Queued<E>) -> Ordering {
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        EventQueue {
            now: 0,
            next_seq: 0,
            heap: BinaryHeap::new(),
        }
    }
}

impl<E> EventQueue<E> {
    /// The tick of the event popped last (0 before the first).
    pub fn now(&self) -> u64 {
        self.now
    }

    /// Schedules `ev` at tick `at` (a tick already past is popped next, at
    /// its own tick: the clock does not go back).
    pub fn at(&mut self, at: u64, ev: E) {
        self.next_seq += 1;
        self.heap.push(Queued {
            at,
            seq: self.next_seq,
            ev,
        });
    }

    /// Schedules `ev` `ticks` after now.
    pub fn after(&mut self, ticks: u64, ev: E) {
        self.at(self.now + ticks, ev);
    }

    /// The earliest event, the clock moved to its tick; None once the run
    /// has nothing left to do.
    pub fn pop(&mut self) -> Option<E> {
        let q = self.heap.pop()?;
        self.now = q.at;
        Some(q.ev)
    }
}

/// A message's network delay: uniform in `ticks`, and one message in
/// `long_one_in` stalls up to `long_factor_max` times longer, so that
/// independent messages reorder freely and now and then one arrives after
/// everything sent well after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetDelay {
    pub ticks: (u64, u64),
    pub long_one_in: u64,
    pub long_factor_max: u64,
}

impl NetDelay {
    /// Delays of 1–10 ticks, one in 16 stalled up to 20 times longer: a
    /// stall then outlasts a protocol round of a few messages.
    pub const STANDARD: NetDelay = NetDelay {
        ticks: (1, 10),
        long_one_in: 16,
        long_factor_max: 20,
    };

    /// Draws one delay, counting it in `long_delays` if it is a stall (a
    /// simulation shows its runs had some).
    pub fn draw(&self, rng: &mut impl Draw, long_delays: &mut u64) -> u64 {
        let d = rng.range(self.ticks);
        if rng.one_in(self.long_one_in) {
            *long_delays += 1;
            d * rng.range((2, self.long_factor_max))
        } else {
            d
        }
    }
}

/// Declares a simulation's `Stats`: what a run exercised, as counters
/// summed over seeds to show the faults and paths happen, plus a `digest`
/// of the run's end state (XORed when summed) that shows a seed replays
/// identically. `Debug` prints the fields in declaration order, `digest`
/// last.
///
/// ```
/// nvpool_testkit::sim_stats! {
///     /// What a run exercised.
///     struct Stats {
///         events,
///         /// Writes every copy answered.
///         writes_acked,
///     }
/// }
/// let mut total = Stats::default();
/// total += &Stats { events: 3, writes_acked: 1, digest: 5 };
/// total += &Stats { events: 2, writes_acked: 0, digest: 1 };
/// assert_eq!((total.events, total.writes_acked, total.digest), (5, 1, 4));
/// ```
#[macro_export]
macro_rules! sim_stats {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $( $(#[$field_meta:meta])* $field:ident ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Default, Clone, PartialEq, Eq)]
        $vis struct $name {
            $( $(#[$field_meta])* $field: u64, )*
            /// Digest of the end state (determinism check).
            digest: u64,
        }

        impl ::std::ops::AddAssign<&$name> for $name {
            fn add_assign(&mut self, o: &$name) {
                $( self.$field += o.$field; )*
                self.digest ^= o.digest;
            }
        }
    };
}

/// A simulation's seeds as its test runs them, and the environment
/// variables that replay one (`{prefix}_SEED`, traced), pick a protocol
/// (`{prefix}_PROTOCOL`) or set how many seeds to soak (`{prefix}_SEEDS`).
/// Every message naming a seed names it as `{prefix}_SEED=n`, ready to
/// paste.
#[derive(Debug, Clone, Copy)]
pub struct Seeds {
    pub prefix: &'static str,
}

impl Seeds {
    /// The protocol `{prefix}_PROTOCOL` names (`parse` fails the test on a
    /// name it does not know), else `default`.
    #[track_caller]
    pub fn protocol<P>(&self, parse: impl FnOnce(&str) -> P, default: P) -> P {
        std::env::var(format!("{}_PROTOCOL", self.prefix)).map_or(default, |p| parse(&p))
    }

    /// How many seeds to run: `{prefix}_SEEDS`, else `default`.
    #[track_caller]
    pub fn count(&self, default: u64) -> u64 {
        let var = format!("{}_SEEDS", self.prefix);
        std::env::var(&var).map_or(default, |n| {
            n.parse()
                .unwrap_or_else(|_| panic!("{var}={n}: not a number"))
        })
    }

    /// If `{prefix}_SEED` is set, runs that seed of `proto` traced, fails
    /// the test if it fails, and returns true: the test should stop there.
    #[track_caller]
    pub fn replay<P: Debug + Copy, S: Debug>(
        &self,
        proto: P,
        run: impl FnOnce(u64, P, bool) -> Result<S, String>,
    ) -> bool {
        let var = format!("{}_SEED", self.prefix);
        let Ok(seed) = std::env::var(&var) else {
            return false;
        };
        let seed: u64 = seed
            .parse()
            .unwrap_or_else(|_| panic!("{var}={seed}: not a number"));
        match run(seed, proto, true) {
            Ok(stats) => eprintln!("SEED={seed} {proto:?} passed: {stats:?}"),
            Err(e) => panic!("SEED={seed} {proto:?} failed: {e}"),
        }
        true
    }

    /// Runs seeds `0..seeds`, fails the test naming every failing seed, and
    /// returns the stats summed (also printed).
    #[track_caller]
    pub fn pass_all<S: Debug + Default + for<'a> std::ops::AddAssign<&'a S>>(
        &self,
        seeds: u64,
        mut run: impl FnMut(u64) -> Result<S, String>,
    ) -> S {
        let prefix = self.prefix;
        let mut total = S::default();
        let mut failures = Vec::new();
        for seed in 0..seeds {
            match run(seed) {
                Ok(stats) => total += &stats,
                Err(e) => {
                    eprintln!("{prefix}_SEED={seed} failed: {e}");
                    failures.push(seed);
                }
            }
        }
        assert!(
            failures.is_empty(),
            "{} seeds failed (first {prefix}_SEED={}); rerun one with {prefix}_SEED",
            failures.len(),
            failures[0]
        );
        eprintln!("{seeds} seeds passed: {total:?}");
        total
    }

    /// Fails the test unless some seed in `0..seeds` fails (a broken
    /// protocol must be caught); prints the first, with how to replay it.
    #[track_caller]
    pub fn assert_caught<P: Debug, S>(
        &self,
        proto: P,
        name: &str,
        seeds: u64,
        mut run: impl FnMut(u64) -> Result<S, String>,
    ) {
        let prefix = self.prefix;
        match (0..seeds).find_map(|seed| run(seed).err().map(|e| (seed, e))) {
            Some((seed, why)) => {
                eprintln!("{proto:?} caught: {prefix}_SEED={seed} {prefix}_PROTOCOL={name}: {why}")
            }
            None => panic!("{proto:?} passed all {seeds} seeds: the simulation has no teeth"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_pop_in_time_order_and_ties_in_schedule_order() {
        let mut q = EventQueue::default();
        q.at(5, "b");
        q.at(3, "a");
        q.at(5, "c");
        q.after(5, "d");
        let mut order = Vec::new();
        while let Some(ev) = q.pop() {
            order.push((q.now(), ev));
            if ev == "a" {
                q.after(2, "e");
            }
        }
        assert_eq!(order, [(3, "a"), (5, "b"), (5, "c"), (5, "d"), (5, "e")]);
    }

    /// A generator replaying fixed numbers, to see what each draw consumes.
    struct Fixed(Vec<u64>);

    impl Draw for Fixed {
        fn below(&mut self, n: u64) -> u64 {
            self.0.remove(0) % n
        }
    }

    #[test]
    fn a_stall_multiplies_the_delay_and_is_counted() {
        let mut long = 0;
        // range (1, 10): 1 + 4; one_in(16): 0 → a stall; range (2, 20): 2 + 1.
        let d = NetDelay::STANDARD.draw(&mut Fixed(vec![4, 16, 1]), &mut long);
        assert_eq!((d, long), (15, 1));
        let d = NetDelay::STANDARD.draw(&mut Fixed(vec![9, 3]), &mut long);
        assert_eq!((d, long), (10, 1));
    }
}
