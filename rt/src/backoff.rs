//! Capped exponential backoff: how long to wait before the next attempt.
//!
//! The ceiling starts at `min` and doubles per wait up to `max`; what is
//! waited depends on who else is retrying:
//! - [`Backoff::next`], a random wait in `[ceiling/2, ceiling]`: many
//!   peers retrying against one server (targets registering with a
//!   control plane that restarted) spread out, and the waits still grow.
//! - [`Backoff::next_full_jitter`], in `[0, ceiling]`: peers that collide
//!   on the same record (compare-and-swap retries) spread out the most.
//! - [`Backoff::step`], the ceiling itself: polls of a condition and
//!   retries nobody competes with.

use std::time::Duration;

use crate::random;

#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    ceiling: Duration,
}

impl Backoff {
    /// Waits from `min` doubling up to `max` (`min` ≤ `max`).
    pub const fn new(min: Duration, max: Duration) -> Backoff {
        Backoff {
            min,
            max,
            ceiling: min,
        }
    }

    /// The ceiling, then doubles it (up to `max`).
    pub fn step(&mut self) -> Duration {
        let d = self.ceiling;
        self.ceiling = d.saturating_mul(2).min(self.max);
        d
    }

    /// A random wait in `[ceiling/2, ceiling]`, then doubles the ceiling.
    #[allow(
        clippy::should_implement_trait,
        reason = "endless: an Iterator's Option would only be unwrapped"
    )]
    pub fn next(&mut self) -> Duration {
        let d = self.step();
        d / 2 + upto(d - d / 2)
    }

    /// A random wait in `[0, ceiling]`, then doubles the ceiling.
    pub fn next_full_jitter(&mut self) -> Duration {
        upto(self.step())
    }

    /// Back to `min`, after a success.
    pub fn reset(&mut self) {
        self.ceiling = self.min;
    }
}

/// A random duration in `[0, d]`, to the nanosecond.
fn upto(d: Duration) -> Duration {
    let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX - 1);
    Duration::from_nanos(random::below(nanos + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_millis(10);
    const MAX: Duration = Duration::from_millis(250);

    #[test]
    fn steps_double_up_to_the_cap_and_reset() {
        let mut b = Backoff::new(MIN, MAX);
        let ms: Vec<u128> = (0..7).map(|_| b.step().as_millis()).collect();
        assert_eq!(ms, [10, 20, 40, 80, 160, 250, 250]);
        b.reset();
        assert_eq!(b.step(), MIN);
    }

    #[test]
    fn jittered_waits_stay_within_half_and_all_of_the_ceiling() {
        let mut b = Backoff::new(MIN, MAX);
        let mut ceiling = MIN;
        for _ in 0..200 {
            let w = b.next();
            assert!(
                w >= ceiling / 2 && w <= ceiling,
                "{w:?} outside [{ceiling:?}/2, {ceiling:?}]"
            );
            assert!(w >= MIN / 2 && w <= MAX);
            ceiling = (ceiling * 2).min(MAX);
        }
        b.reset();
        let w = b.next();
        assert!(w >= MIN / 2 && w <= MIN);
    }

    #[test]
    fn full_jitter_stays_under_the_ceiling_and_varies() {
        let mut b = Backoff::new(MIN, MAX);
        let waits: Vec<Duration> = (0..100).map(|_| b.next_full_jitter()).collect();
        assert!(waits[0] <= MIN);
        assert!(waits.iter().all(|&w| w <= MAX));
        assert!(waits.windows(2).any(|w| w[0] != w[1]));
    }

    #[test]
    fn equal_bounds_and_zero_are_fixed_points() {
        let mut b = Backoff::new(MIN, MIN);
        assert_eq!((b.step(), b.step()), (MIN, MIN));
        let mut z = Backoff::new(Duration::ZERO, Duration::ZERO);
        assert_eq!(
            (z.next(), z.next_full_jitter()),
            (Duration::ZERO, Duration::ZERO)
        );
    }
}
