//! Randomness: the kernel's bytes for what must not be guessed, one small
//! seeded generator for what only has to look random.
//!
//! - [`fill`] and [`bytes`]: getrandom(2), for keys, challenges, tokens
//!   and identities.
//! - [`Rng`]: xorshift64*, for data patterns, offsets and test workloads,
//!   where a seed must reproduce the same stream (a benchmark's verify
//!   pass, a dataset read back in a later run, a failing test's seed).
//! - [`below`]: a per-thread [`Rng`] seeded from the kernel, for jitter.

use std::cell::Cell;
use std::io;

/// Fills `buf` from the kernel's random pool (getrandom(2), blocking only
/// until the pool is first initialised at boot).
#[allow(clippy::disallowed_methods, reason = "the one call")]
pub fn fill(buf: &mut [u8]) -> io::Result<()> {
    getrandom::getrandom(buf).map_err(io::Error::from)
}

/// `N` bytes from [`fill`], for callers that have no error to return:
/// panics when the kernel has none to give, which after boot means a
/// broken system.
pub fn bytes<const N: usize>() -> [u8; N] {
    let mut b = [0; N];
    fill(&mut b).expect("random bytes from the kernel");
    b
}

/// xorshift64* (Vigna): seedable and quick; never for secrets.
///
/// Its streams are part of stored data (a dataset's files and a
/// benchmark's blocks are checked against them when read back by a later
/// run), so neither the algorithm nor the seeding may change.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// The state is `seed` itself, but never zero (where xorshift would
    /// stay): seed 0 starts from a fixed constant.
    pub const fn new(seed: u64) -> Rng {
        Rng(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        })
    }

    /// A generator seeded from the kernel, or from the clock when the
    /// kernel has no random bytes to give (jitter must not fail).
    pub fn from_os() -> Rng {
        let mut b = [0u8; 8];
        let seed = match fill(&mut b) {
            Ok(()) => u64::from_le_bytes(b),
            Err(_) => {
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
                now.map_or(0, |d| d.as_nanos() as u64) ^ u64::from(std::process::id())
            }
        };
        Rng::new(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n` (`n` > 0), by remainder: biased by at most
    /// n / 2^64, which nothing here can see.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Fills `buf` eight bytes a step, little-endian, so that a shorter
    /// buffer gets a prefix of a longer one's bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            chunk.copy_from_slice(&self.next_u64().to_le_bytes()[..chunk.len()]);
        }
    }
}

thread_local! {
    static THREAD: Cell<Option<Rng>> = const { Cell::new(None) };
}

/// A number in `0..n` (`n` > 0) from this thread's [`Rng`], seeded from
/// the kernel on first use: differs between threads and processes, costs
/// no system call after the first.
pub fn below(n: u64) -> u64 {
    THREAD.with(|t| {
        let mut rng = t.take().unwrap_or_else(Rng::from_os);
        let v = rng.below(n);
        t.set(Some(rng));
        v
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_the_same_stream() {
        let (mut a, mut b) = (Rng::new(42), Rng::new(42));
        let xs: Vec<u64> = (0..64).map(|_| a.next_u64()).collect();
        assert!(xs.iter().all(|&x| x == b.next_u64()));
        assert_ne!(xs[0], Rng::new(43).next_u64());
        assert_ne!(Rng::new(0).next_u64(), 0);
        // xorshift64* of state 1: its first outputs, so the stream (part
        // of stored datasets) cannot change unnoticed.
        let mut one = Rng::new(1);
        assert_eq!(one.next_u64(), 0x47E4_CE4B_896C_DD1D);
    }

    #[test]
    fn fill_takes_eight_bytes_a_step_and_a_prefix_for_the_rest() {
        let mut long = [0u8; 24];
        Rng::new(7).fill(&mut long);
        let mut r = Rng::new(7);
        assert_eq!(long[..8], r.next_u64().to_le_bytes());
        let mut short = [0u8; 13];
        Rng::new(7).fill(&mut short);
        assert_eq!(short, long[..13]);
    }

    #[test]
    fn below_stays_below() {
        let mut r = Rng::new(3);
        assert!((0..1000).all(|_| r.below(7) < 7));
        assert!((0..1000).all(|_| below(5) < 5));
        assert_eq!(Rng::new(9).below(1), 0);
    }

    #[test]
    fn the_kernel_fills_buffers() {
        let (a, b) = (bytes::<32>(), bytes::<32>());
        assert_ne!(a, b);
        let mut buf = [0u8; 4096];
        fill(&mut buf).unwrap();
        assert!(buf.iter().any(|&b| b != 0));
    }
}
