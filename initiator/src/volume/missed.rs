//! What a failed extent copy missed: one bit per
//! [`RESYNC_REGION_BYTES`] region of the extent, set for every write,
//! write-zeroes or discard that touched the region while the copy was not
//! written (and for mutations that failed on it).
//!
//! Marking is lock-free (`fetch_or` on the region's word) and allocates
//! nothing, so every mutation to an extent with a failed copy can mark it
//! on the data path. A record is allocated when a copy fails (rare), never
//! per I/O.
//!
//! A region `r` covers extent bytes `[r·R, (r+1)·R) ∩ extent`.

use nvpool_layout::plan::RESYNC_REGION_BYTES;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// What a failed copy missed, as [`crate::volume::Volume::begin_sync`] and
/// [`crate::volume::Volume::missed_regions`] report it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MissedRegions {
    /// Regions of [`RESYNC_REGION_BYTES`] of the extent written while the
    /// copy was not written, ascending.
    pub regions: Vec<u32>,
    /// True when `regions` is every region the copy may lack: this session
    /// saw every write since the copy stopped being written. False for a
    /// copy that was already failed when the volume was opened (writes of
    /// earlier sessions are unknown here) or whose durable state became
    /// unknown (a failed flush): then the whole extent must be copied.
    pub complete: bool,
}

/// How a failing mutation marks the copy it failed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mark {
    /// Nothing: the failure was of a read, or the copy failed as a bystander
    /// (its controller was lost while serving another extent).
    Nothing,
    /// These extent bytes may not hold what the other copies hold.
    Range { offset: u64, len: u64 },
    /// The durable state of the whole copy is unknown (a flush failed:
    /// any write since the previous flush may be lost).
    Unknown,
}

/// The missed-regions record of one copy.
#[derive(Debug)]
pub(crate) struct Missed {
    complete: AtomicBool,
    regions: u32,
    words: Box<[AtomicU64]>,
}

impl Missed {
    /// An empty record for an extent of `extent_bytes`.
    pub fn new(extent_bytes: u64, complete: bool) -> Missed {
        let regions = region_count(extent_bytes);
        Missed {
            complete: AtomicBool::new(complete),
            regions,
            words: (0..regions.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }

    pub fn apply(&self, mark: Mark) {
        match mark {
            Mark::Nothing => {}
            Mark::Range { offset, len } => self.mark(offset, len),
            Mark::Unknown => self.complete.store(false, Ordering::Relaxed),
        }
    }

    /// Sets the regions `[offset, offset + len)` of the extent touches.
    /// Relaxed is enough: a reader that must see the marks (begin_sync)
    /// first waits for the marking mutation to complete, and that wait
    /// orders the marks before the read.
    pub fn mark(&self, offset: u64, len: u64) {
        if len == 0 || self.regions == 0 {
            return;
        }
        let last_region = u64::from(self.regions - 1);
        let first = (offset / RESYNC_REGION_BYTES).min(last_region);
        let last = ((offset + len - 1) / RESYNC_REGION_BYTES).min(last_region);
        let mut r = first;
        while r <= last {
            let word = (r / 64) as usize;
            let lo = r % 64;
            // Bits lo..=hi of this word.
            let hi = (last - word as u64 * 64).min(63);
            let bits = (u64::MAX >> (63 - hi)) & (u64::MAX << lo);
            self.words[word].fetch_or(bits, Ordering::Relaxed);
            r = (word as u64 + 1) * 64;
        }
    }

    pub fn snapshot(&self) -> MissedRegions {
        let mut regions = Vec::new();
        for (w, word) in self.words.iter().enumerate() {
            let mut bits = word.load(Ordering::Relaxed);
            while bits != 0 {
                let b = bits.trailing_zeros();
                regions.push(w as u32 * 64 + b);
                bits &= bits - 1;
            }
        }
        MissedRegions {
            regions,
            complete: self.complete.load(Ordering::Relaxed),
        }
    }
}

/// Regions of an extent of `extent_bytes` (at most 64 GiB / 1 MiB = 65536).
fn region_count(extent_bytes: u64) -> u32 {
    u32::try_from(extent_bytes.div_ceil(RESYNC_REGION_BYTES)).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: u64 = RESYNC_REGION_BYTES;

    #[test]
    fn marks_every_region_a_range_touches_and_no_other() {
        let m = Missed::new(200 * R, true);
        assert_eq!(m.snapshot(), MissedRegions::default().with(true));
        m.mark(0, 1);
        m.mark(2 * R - 512, 1024); // regions 1 and 2
        m.mark(5 * R, R); // exactly region 5
        m.mark(7 * R, 0); // nothing
        m.mark(60 * R, 70 * R); // 60..=129: across two word boundaries
        m.mark(199 * R + 4096, 4096);
        let mut want = vec![0, 1, 2, 5];
        want.extend(60..130);
        want.push(199);
        assert_eq!(m.snapshot().regions, want);
        assert!(m.snapshot().complete);
    }

    #[test]
    fn a_short_extent_and_an_unknown_state() {
        // An extent that is not a multiple of the region size (not one the
        // control plane makes, but the record must not care).
        let m = Missed::new(R + R / 2, false);
        m.mark(R, R / 2);
        assert_eq!(
            m.snapshot(),
            MissedRegions {
                regions: vec![1],
                complete: false
            }
        );
        let m = Missed::new(64 * R, true);
        m.apply(Mark::Range {
            offset: 63 * R,
            len: R,
        });
        m.apply(Mark::Nothing);
        assert_eq!(m.snapshot().regions, vec![63]);
        assert!(m.snapshot().complete);
        m.apply(Mark::Unknown);
        assert!(!m.snapshot().complete);
    }

    impl MissedRegions {
        fn with(mut self, complete: bool) -> MissedRegions {
            self.complete = complete;
            self
        }
    }
}
