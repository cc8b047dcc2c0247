//! The sync guard: what keeps a copy job from overwriting newer host data.
//!
//! A copy job fills a destination extent from a healthy copy while hosts keep
//! writing the volume. The destination target owns one [`SyncGuard`] per armed
//! job, covering the job's device byte range. It is pure bookkeeping (no I/O):
//!
//! ```text
//!  host write/zeroes/discard ──► host_write(off, len) ──► marks units, Go | Wait (park)
//!  copier: read source chunk ──► claim(chunk) ──► unwritten runs ──► pwrite ──► release()
//!                                                                       └──► retry parked
//! ```
//!
//! # Why the result is the source's latest data
//!
//! Take any unit U of the destination and split on whether a host mutated it
//! after the guard was armed.
//!
//! *A host wrote U after arming.* That write was marked when it reached the
//! target, before it was issued to the device. If it was marked before the
//! copier's claim of U, the claim leaves U out, so the copier never writes U
//! again. If it arrived while U was claimed, it was told to wait, and it
//! reaches the device only after the copier's write completed and released
//! the claim. Either way the copier's (possibly older) bytes never land on top
//! of a host write; hosts order their own writes to one block, so U ends as
//! the last host write, which is also what the source holds.
//!
//! *No host wrote U after arming.* The control plane starts the copier only
//! after every host switched the copy to `Syncing` (so every later mutation of
//! U is also sent to the destination, where it would have been marked) and
//! drained what it issued before the switch. So when the copier reads the
//! source, no mutation of U is in flight anywhere: the value it reads is U's
//! latest, and it writes exactly that.
//!
//! The ordering therefore rests on three things outside this module, each a
//! caller's duty: the guard is armed before any host starts mirroring, hosts
//! drain before confirming, and the copier releases a claim only after its
//! device write completed.
//!
//! A unit is the namespace's logical block: host mutations are whole units,
//! so a unit the copier skips is one a host overwrote entirely. A caller that
//! passed a range not aligned to units would get the partially touched units
//! marked (and skipped by the copier) although part of them is stale, so the
//! unit must never be larger than the logical block of any namespace mapping
//! the range.

use nvpool_rt::lock;
use std::sync::{Mutex, MutexGuard};

/// Units one guard may track: a 64 GiB extent (the control plane's
/// `EXTENT_BYTES_MAX`) at 512-byte blocks, i.e. a 16 MiB bitmap. The bitmap is
/// allocated once when the job is armed; this bounds that allocation.
pub const SYNC_GUARD_UNITS_MAX: u64 = (64 << 30) / 512;

const WORD_BITS: u64 = u64::BITS as u64;

/// What a host mutation may do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Issue it to the device.
    Go,
    /// It overlaps the copier's current claim: hold it and ask again after
    /// [`SyncGuard::release`].
    Wait,
}

/// Why a guard geometry is refused (see [`check_geometry`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    #[error("unit of {unit_bytes} bytes is not a power of two")]
    UnitNotPowerOfTwo { unit_bytes: u64 },
    #[error("range {base}+{len} is not aligned to the {unit_bytes}-byte unit")]
    Unaligned {
        base: u64,
        len: u64,
        unit_bytes: u64,
    },
    #[error("range {base}+{len} is empty or ends past the 64-bit byte space")]
    BadRange { base: u64, len: u64 },
    #[error("{units} units exceed the limit of {SYNC_GUARD_UNITS_MAX}")]
    TooManyUnits { units: u64 },
}

/// Checks what [`SyncGuard::new`] asserts, so a caller holding untrusted
/// numbers (a REST body) can refuse them with an error instead of a panic.
pub fn check_geometry(base: u64, len: u64, unit_bytes: u64) -> Result<(), GeometryError> {
    if !unit_bytes.is_power_of_two() {
        return Err(GeometryError::UnitNotPowerOfTwo { unit_bytes });
    }
    if len == 0 || base.checked_add(len).is_none() {
        return Err(GeometryError::BadRange { base, len });
    }
    if !base.is_multiple_of(unit_bytes) || !len.is_multiple_of(unit_bytes) {
        return Err(GeometryError::Unaligned {
            base,
            len,
            unit_bytes,
        });
    }
    let units = len / unit_bytes;
    if units > SYNC_GUARD_UNITS_MAX {
        return Err(GeometryError::TooManyUnits { units });
    }
    Ok(())
}

/// Records which units of a device byte range hosts mutated since the guard
/// was created, and holds the copier's one claim. Shared by every reactor
/// (host writes) and the copier thread.
#[derive(Debug)]
pub struct SyncGuard {
    base: u64,
    len: u64,
    unit_shift: u32,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// One bit per unit, set once a host mutation touched it.
    written: Vec<u64>,
    /// Set bits in `written`.
    written_units: u64,
    /// The copier's claim as units [lo, hi), if any.
    claim: Option<(u64, u64)>,
}

impl SyncGuard {
    /// Guards device bytes [base, base+len) in units of `unit_bytes` (a power
    /// of two dividing `base` and `len`). Panics on a geometry that
    /// [`check_geometry`] refuses.
    pub fn new(base: u64, len: u64, unit_bytes: u64) -> SyncGuard {
        if let Err(e) = check_geometry(base, len, unit_bytes) {
            panic!("SyncGuard::new({base}, {len}, {unit_bytes}): {e}");
        }
        let units = len / unit_bytes;
        let words = units.div_ceil(WORD_BITS) as usize;
        SyncGuard {
            base,
            len,
            unit_shift: unit_bytes.trailing_zeros(),
            state: Mutex::new(State {
                written: vec![0; words],
                written_units: 0,
                claim: None,
            }),
        }
    }

    /// The guarded device range as (base, len).
    pub fn range(&self) -> (u64, u64) {
        (self.base, self.len)
    }

    /// A host mutation of device bytes [off, off+len): marks the units it
    /// touches as host-written (parts outside the range are ignored). Returns
    /// [`Admit::Wait`] when it overlaps the copier's current claim: the caller
    /// must hold the I/O and call again later (after a release) until
    /// [`Admit::Go`], and only then issue it.
    pub fn host_write(&self, off: u64, len: u64) -> Admit {
        let Some((lo, hi)) = self.touched_units(off, len) else {
            return Admit::Go;
        };
        let mut st = self.lock();
        let newly = set_bits(&mut st.written, lo, hi);
        st.written_units += newly;
        match st.claim {
            Some((c_lo, c_hi)) if lo < c_hi && c_lo < hi => Admit::Wait,
            _ => Admit::Go,
        }
    }

    /// The copier claims device bytes [off, off+len) (unit aligned, inside
    /// the range, non-empty; one claim at a time) and gets the sub-ranges no
    /// host has written since [`SyncGuard::new`]: device offsets, ascending,
    /// maximal runs. Host mutations overlapping the claim wait until
    /// [`SyncGuard::release`].
    pub fn claim(&self, off: u64, len: u64) -> Vec<(u64, u64)> {
        let unit_mask = (1u64 << self.unit_shift) - 1;
        assert!(
            len > 0 && off & unit_mask == 0 && len & unit_mask == 0,
            "claim {off}+{len} is empty or not aligned to {} bytes",
            unit_mask + 1
        );
        assert!(
            off >= self.base && len <= self.len && off - self.base <= self.len - len,
            "claim {off}+{len} is outside the guarded range {}+{}",
            self.base,
            self.len
        );
        let lo = (off - self.base) >> self.unit_shift;
        let hi = lo + (len >> self.unit_shift);
        let mut st = self.lock();
        assert!(
            st.claim.is_none(),
            "claim {off}+{len} while {:?} is still claimed",
            st.claim
        );
        st.claim = Some((lo, hi));
        let mut runs = Vec::new();
        let mut at = lo;
        while at < hi {
            let start = next_bit(&st.written, at, hi, false);
            if start == hi {
                break;
            }
            let end = next_bit(&st.written, start, hi, true);
            runs.push((
                self.base + (start << self.unit_shift),
                (end - start) << self.unit_shift,
            ));
            at = end;
        }
        runs
    }

    /// Ends the current claim (after the copier's device write completed).
    /// Panics if nothing is claimed.
    pub fn release(&self) {
        let mut st = self.lock();
        assert!(st.claim.is_some(), "release without a claim");
        st.claim = None;
    }

    /// Units hosts have written since [`SyncGuard::new`].
    pub fn written_units(&self) -> u64 {
        self.lock().written_units
    }

    /// The units [lo, hi) that device bytes [off, off+len) touch inside the
    /// range, or None if they touch none.
    fn touched_units(&self, off: u64, len: u64) -> Option<(u64, u64)> {
        let end = off.saturating_add(len).min(self.base + self.len);
        let start = off.max(self.base);
        if start >= end {
            return None;
        }
        let unit = 1u64 << self.unit_shift;
        let lo = (start - self.base) >> self.unit_shift;
        let hi = (end - self.base).div_ceil(unit);
        Some((lo, hi))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every assert runs before the state is changed, so a poisoned lock
        // still guards a consistent bitmap.
        lock(&self.state)
    }
}

/// The bits of word `w` that lie in [lo, hi).
fn word_mask(w: u64, lo: u64, hi: u64) -> u64 {
    let first = lo.max(w * WORD_BITS) - w * WORD_BITS;
    let last = hi.min((w + 1) * WORD_BITS) - w * WORD_BITS;
    let upper = if last == WORD_BITS {
        u64::MAX
    } else {
        (1u64 << last) - 1
    };
    upper & !((1u64 << first) - 1)
}

/// Sets bits [lo, hi) (lo < hi); returns how many were clear before.
fn set_bits(words: &mut [u64], lo: u64, hi: u64) -> u64 {
    let mut newly = 0;
    for w in lo / WORD_BITS..=(hi - 1) / WORD_BITS {
        let mask = word_mask(w, lo, hi);
        let word = &mut words[w as usize];
        newly += u64::from((mask & !*word).count_ones());
        *word |= mask;
    }
    newly
}

/// The first index in [from, end) whose bit equals `set`, or `end`.
fn next_bit(words: &[u64], from: u64, end: u64, set: bool) -> u64 {
    let mut at = from;
    while at < end {
        let w = at / WORD_BITS;
        let word = if set {
            words[w as usize]
        } else {
            !words[w as usize]
        };
        let hits = word & word_mask(w, at, end);
        if hits != 0 {
            return w * WORD_BITS + u64::from(hits.trailing_zeros());
        }
        at = (w + 1) * WORD_BITS;
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KIB: u64 = 1024;

    #[test]
    fn guard_is_send_and_sync() {
        fn shared<T: Send + Sync>() {}
        shared::<SyncGuard>();
    }

    #[test]
    fn a_new_guard_reports_its_range_and_copies_everything() {
        let g = SyncGuard::new(8 * KIB, 64 * KIB, 512);
        assert_eq!(g.range(), (8 * KIB, 64 * KIB));
        assert_eq!(g.written_units(), 0);
        assert_eq!(g.claim(8 * KIB, 64 * KIB), vec![(8 * KIB, 64 * KIB)]);
    }

    #[test]
    fn geometry_is_checked() {
        assert_eq!(check_geometry(0, 4096, 512), Ok(()));
        assert_eq!(
            check_geometry(0, 4096, 768),
            Err(GeometryError::UnitNotPowerOfTwo { unit_bytes: 768 })
        );
        assert_eq!(
            check_geometry(0, 0, 512),
            Err(GeometryError::BadRange { base: 0, len: 0 })
        );
        assert_eq!(
            check_geometry(u64::MAX - 511, 1024, 512),
            Err(GeometryError::BadRange {
                base: u64::MAX - 511,
                len: 1024
            })
        );
        assert_eq!(
            check_geometry(256, 4096, 512),
            Err(GeometryError::Unaligned {
                base: 256,
                len: 4096,
                unit_bytes: 512
            })
        );
        assert_eq!(
            check_geometry(0, 4096 + 512, 4096),
            Err(GeometryError::Unaligned {
                base: 0,
                len: 4096 + 512,
                unit_bytes: 4096
            })
        );
        let too_many = (SYNC_GUARD_UNITS_MAX + 1) * 512;
        assert_eq!(
            check_geometry(0, too_many, 512),
            Err(GeometryError::TooManyUnits {
                units: SYNC_GUARD_UNITS_MAX + 1
            })
        );
        assert_eq!(check_geometry(0, SYNC_GUARD_UNITS_MAX * 512, 512), Ok(()));
    }

    #[test]
    #[should_panic(expected = "not aligned")]
    fn new_refuses_a_misaligned_range() {
        SyncGuard::new(512, 4096, 4096);
    }

    #[test]
    fn host_writes_mark_the_units_they_touch_once() {
        let g = SyncGuard::new(0, 64 * KIB, 4 * KIB);
        assert_eq!(g.host_write(4 * KIB, 8 * KIB), Admit::Go);
        assert_eq!(g.written_units(), 2);
        // Rewriting marked units counts nothing new.
        assert_eq!(g.host_write(4 * KIB, 4 * KIB), Admit::Go);
        assert_eq!(g.written_units(), 2);
        // A write touching part of a unit marks the whole unit.
        assert_eq!(g.host_write(20 * KIB + 512, 512), Admit::Go);
        assert_eq!(g.written_units(), 3);
        assert_eq!(
            g.claim(0, 64 * KIB),
            vec![(0, 4 * KIB), (12 * KIB, 8 * KIB), (24 * KIB, 40 * KIB)]
        );
    }

    #[test]
    fn parts_outside_the_range_are_ignored() {
        let g = SyncGuard::new(16 * KIB, 16 * KIB, 4 * KIB);
        // Entirely before, entirely after, zero length, near the end of u64.
        assert_eq!(g.host_write(0, 16 * KIB), Admit::Go);
        assert_eq!(g.host_write(32 * KIB, 4 * KIB), Admit::Go);
        assert_eq!(g.host_write(20 * KIB, 0), Admit::Go);
        assert_eq!(g.host_write(u64::MAX - 10, 100), Admit::Go);
        assert_eq!(g.written_units(), 0);
        // Straddling both edges: only the inside is marked.
        assert_eq!(g.host_write(12 * KIB, 8 * KIB), Admit::Go);
        assert_eq!(g.host_write(28 * KIB, 8 * KIB), Admit::Go);
        assert_eq!(g.written_units(), 2);
        assert_eq!(g.claim(16 * KIB, 16 * KIB), vec![(20 * KIB, 8 * KIB)]);
    }

    #[test]
    fn a_claim_returns_only_unwritten_runs_within_it() {
        let g = SyncGuard::new(1 << 20, 1 << 20, 512);
        // Units 0, 5..7 and 200 written.
        g.host_write(1 << 20, 512);
        g.host_write((1 << 20) + 5 * 512, 2 * 512);
        g.host_write((1 << 20) + 200 * 512, 512);
        assert_eq!(g.written_units(), 4);
        // Claim units 0..16: runs 1..5 and 7..16.
        assert_eq!(
            g.claim(1 << 20, 16 * 512),
            vec![((1 << 20) + 512, 4 * 512), ((1 << 20) + 7 * 512, 9 * 512)]
        );
        g.release();
        // A claim inside one written run gets nothing.
        assert_eq!(g.claim((1 << 20) + 5 * 512, 2 * 512), vec![]);
        g.release();
        // A claim not touching any written unit gets itself.
        assert_eq!(
            g.claim((1 << 20) + 64 * 512, 64 * 512),
            vec![((1 << 20) + 64 * 512, 64 * 512)]
        );
        g.release();
    }

    #[test]
    fn an_overlapping_host_write_waits_while_claimed_and_goes_after_release() {
        let g = SyncGuard::new(0, 128 * KIB, 4 * KIB);
        assert_eq!(g.claim(32 * KIB, 32 * KIB), vec![(32 * KIB, 32 * KIB)]);
        // Overlapping the claim, at either edge: wait (and marked already).
        assert_eq!(g.host_write(28 * KIB, 8 * KIB), Admit::Wait);
        assert_eq!(g.host_write(60 * KIB, 4 * KIB), Admit::Wait);
        assert_eq!(g.written_units(), 3);
        // Next to the claim: go.
        assert_eq!(g.host_write(24 * KIB, 8 * KIB), Admit::Go);
        assert_eq!(g.host_write(64 * KIB, 4 * KIB), Admit::Go);
        g.release();
        assert_eq!(g.host_write(28 * KIB, 8 * KIB), Admit::Go);
        assert_eq!(g.host_write(60 * KIB, 4 * KIB), Admit::Go);
        // The parked writes were marked: the next claim skips them.
        assert_eq!(
            g.claim(32 * KIB, 32 * KIB),
            vec![(36 * KIB, 24 * KIB)],
            "units written while claimed are excluded from later claims"
        );
        g.release();
    }

    #[test]
    fn a_write_marked_before_the_claim_is_excluded_from_it() {
        let g = SyncGuard::new(0, 1 << 20, 4 * KIB);
        assert_eq!(g.host_write(128 * KIB + 4 * KIB, 4 * KIB), Admit::Go);
        assert_eq!(
            g.claim(128 * KIB, 128 * KIB),
            vec![(128 * KIB, 4 * KIB), (136 * KIB, 120 * KIB)]
        );
        g.release();
    }

    #[test]
    #[should_panic(expected = "still claimed")]
    fn only_one_claim_at_a_time() {
        let g = SyncGuard::new(0, 64 * KIB, 4 * KIB);
        g.claim(0, 4 * KIB);
        g.claim(8 * KIB, 4 * KIB);
    }

    #[test]
    #[should_panic(expected = "release without a claim")]
    fn release_needs_a_claim() {
        SyncGuard::new(0, 64 * KIB, 4 * KIB).release();
    }

    #[test]
    #[should_panic(expected = "outside the guarded range")]
    fn a_claim_must_lie_inside_the_range() {
        SyncGuard::new(64 * KIB, 64 * KIB, 4 * KIB).claim(124 * KIB, 8 * KIB);
    }

    #[test]
    #[should_panic(expected = "not aligned")]
    fn a_claim_must_be_unit_aligned() {
        SyncGuard::new(0, 64 * KIB, 4 * KIB).claim(512, 4 * KIB);
    }

    #[test]
    fn a_one_gib_extent_at_512_bytes_marks_and_claims_across_words() {
        let base = 3u64 << 30;
        let g = SyncGuard::new(base, 1 << 30, 512);
        assert_eq!(g.lock().written.len() * 8, 256 * KIB as usize);
        // A write across a word boundary near the end (units 2^21-70..2^21-3).
        let end = base + (1 << 30);
        assert_eq!(g.host_write(end - 70 * 512, 67 * 512), Admit::Go);
        assert_eq!(g.written_units(), 67);
        assert_eq!(
            g.claim(end - 128 * 512, 128 * 512),
            vec![(end - 128 * 512, 58 * 512), (end - 3 * 512, 3 * 512)]
        );
        g.release();
    }

    /// The bitmap against a plain `Vec<bool>` model, over random operations.
    fn check_against_model(ops: &[(bool, u64, u64)]) {
        const UNITS: u64 = 300;
        const UNIT: u64 = 512;
        let base = 7 * UNIT;
        let g = SyncGuard::new(base, UNITS * UNIT, UNIT);
        let mut model = vec![false; UNITS as usize];
        for &(is_claim, a, b) in ops {
            if is_claim {
                let lo = a % UNITS;
                let hi = lo + 1 + b % (UNITS - lo);
                let got = g.claim(base + lo * UNIT, (hi - lo) * UNIT);
                let mut want: Vec<(u64, u64)> = Vec::new();
                for u in lo..hi {
                    if model[u as usize] {
                        continue;
                    }
                    let off = base + u * UNIT;
                    match want.last_mut() {
                        Some((o, l)) if *o + *l == off => *l += UNIT,
                        _ => want.push((off, UNIT)),
                    }
                }
                assert_eq!(got, want);
                g.release();
            } else {
                // Byte ranges that may start before and end after the range.
                let off = a % ((UNITS + 20) * UNIT);
                let len = b % (40 * UNIT);
                assert_eq!(g.host_write(off, len), Admit::Go);
                let lo = off.max(base);
                let hi = (off + len).min(base + UNITS * UNIT);
                if lo < hi {
                    for u in (lo - base) / UNIT..(hi - base).div_ceil(UNIT) {
                        model[u as usize] = true;
                    }
                }
            }
            let marked = model.iter().filter(|&&m| m).count() as u64;
            assert_eq!(g.written_units(), marked);
        }
    }

    proptest! {
        #[test]
        fn bitmap_matches_a_simple_model(
            ops in proptest::collection::vec((any::<bool>(), any::<u64>(), any::<u64>()), 1..80)
        ) {
            check_against_model(&ops);
        }
    }
}
