//! Write Zeroes and deallocate on a reactor's io_uring: the bookkeeping of
//! one command's ring operations, apart from the ring itself so it can be
//! tested on its own.
//!
//! A command zeroes one range (Write Zeroes) or up to 256 (a Dataset
//! Management deallocate). Each range is one `IORING_OP_FALLOCATE` in the
//! command's current [`ZeroMode`]; at most [`limits::ZERO_OPS_PER_CMD_MAX`]
//! are in flight, the next ones go as earlier ones complete. The command
//! completes when every operation it submitted has completed, with the
//! first error any of them returned (none are submitted after an error).
//!
//! Filesystems differ in which fallocate modes they have. An operation
//! answered EOPNOTSUPP makes the command start over, once its other
//! operations are back, in the next mode: zero range, then punch hole (a
//! hole reads as zeroes), then writes of a shared buffer of zeroes in
//! chunks of [`limits::ZERO_WRITE_CHUNK_BYTES`]. Starting over is safe
//! because every mode leaves the same bytes: zeroes.
//!
//! ```text
//!  ZeroRange ─EOPNOTSUPP─► PunchHole ─EOPNOTSUPP─► Write (chunks)
//!  (Write Zeroes starts here)  (deallocate starts here)
//! ```

use crate::limits::{ZERO_OPS_PER_CMD_MAX, ZERO_WRITE_CHUNK_BYTES};

/// How a range is zeroed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroMode {
    /// `fallocate(FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE)`.
    ZeroRange,
    /// `fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)`.
    PunchHole,
    /// Writes of zeroes, one chunk per operation.
    Write,
}

impl ZeroMode {
    /// The fallocate mode bits; None for writes.
    pub fn fallocate_mode(self) -> Option<i32> {
        match self {
            ZeroMode::ZeroRange => Some(libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE),
            ZeroMode::PunchHole => Some(libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE),
            ZeroMode::Write => None,
        }
    }

    fn fallback(self) -> Option<ZeroMode> {
        match self {
            ZeroMode::ZeroRange => Some(ZeroMode::PunchHole),
            ZeroMode::PunchHole => Some(ZeroMode::Write),
            ZeroMode::Write => None,
        }
    }
}

/// One ring operation to submit: zero `len` bytes at namespace byte `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZeroOp {
    pub mode: ZeroMode,
    pub off: u64,
    pub len: u64,
}

/// What the command does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZeroStep {
    Submit(ZeroOp),
    /// Operations are in flight; nothing more to submit until one completes.
    Wait,
    /// Every operation is back: the command's result (Err: a negative errno).
    Done(Result<(), i32>),
}

/// The ring operations of one Write Zeroes or deallocate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZeroJob {
    mode: ZeroMode,
    /// The range being submitted, and how many of its bytes were.
    range: usize,
    pos: u64,
    /// Submitted and not completed.
    pending: u32,
    /// The first error (a negative errno), or 0.
    err: i32,
    /// An operation found the mode unsupported: start over in the next one
    /// once the others are back.
    downgrade: bool,
}

impl ZeroJob {
    pub fn new(mode: ZeroMode) -> ZeroJob {
        ZeroJob {
            mode,
            range: 0,
            pos: 0,
            pending: 0,
            err: 0,
            downgrade: false,
        }
    }

    pub fn pending(&self) -> u32 {
        self.pending
    }

    /// The next step. `range(i)` is the command's `i`-th range as
    /// (namespace byte offset, bytes), None past the last; empty ranges are
    /// passed over. Call until it returns `Wait` or `Done`.
    pub fn step(&mut self, range: impl Fn(usize) -> Option<(u64, u64)>) -> ZeroStep {
        if self.pending == 0 && self.err == 0 && self.downgrade {
            match self.mode.fallback() {
                Some(m) => {
                    *self = ZeroJob::new(m);
                }
                None => self.err = -libc::EOPNOTSUPP,
            }
        }
        if self.err == 0 && !self.downgrade && self.pending < ZERO_OPS_PER_CMD_MAX {
            while let Some((off, len)) = range(self.range) {
                if self.pos >= len {
                    self.range += 1;
                    self.pos = 0;
                    continue;
                }
                let n = match self.mode {
                    ZeroMode::Write => (len - self.pos).min(ZERO_WRITE_CHUNK_BYTES as u64),
                    _ => len - self.pos,
                };
                let op = ZeroOp {
                    mode: self.mode,
                    off: off + self.pos,
                    len: n,
                };
                self.pos += n;
                self.pending += 1;
                return ZeroStep::Submit(op);
            }
        }
        match (self.pending, self.err) {
            (0, 0) if !self.downgrade => ZeroStep::Done(Ok(())),
            (0, e) if e != 0 => ZeroStep::Done(Err(e)),
            (0, _) => self.step(range),
            _ => ZeroStep::Wait,
        }
    }

    /// One submitted operation completed with io_uring result `res`; `want`
    /// is the length it asked for (a write that wrote less failed).
    pub fn complete(&mut self, op_mode: ZeroMode, res: i32, want: u64) {
        self.pending = self.pending.saturating_sub(1);
        if self.err != 0 {
            return;
        }
        if res == -libc::EOPNOTSUPP && op_mode == self.mode && self.mode.fallback().is_some() {
            self.downgrade = true;
        } else if res < 0 {
            self.err = res;
        } else if op_mode == ZeroMode::Write && res as u64 != want {
            // O_DIRECT writes to a file or device are whole unless the
            // device failed or the filesystem ran out of room part way.
            self.err = -libc::EIO;
        }
    }

    /// The mode operations are submitted in now.
    pub fn mode(&self) -> ZeroMode {
        self.mode
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(v: &[(u64, u64)]) -> impl Fn(usize) -> Option<(u64, u64)> + '_ {
        move |i| v.get(i).copied()
    }

    /// Submits everything the job offers now.
    fn drain(j: &mut ZeroJob, r: &[(u64, u64)]) -> Vec<ZeroOp> {
        let mut v = Vec::new();
        while let ZeroStep::Submit(op) = j.step(ranges(r)) {
            v.push(op);
        }
        v
    }

    #[test]
    fn one_operation_per_range_and_done_when_all_are_back() {
        let r = [(0, 4096), (8192, 0), (1 << 20, 512)];
        let mut j = ZeroJob::new(ZeroMode::PunchHole);
        let ops = drain(&mut j, &r);
        assert_eq!(
            ops,
            vec![
                ZeroOp {
                    mode: ZeroMode::PunchHole,
                    off: 0,
                    len: 4096
                },
                ZeroOp {
                    mode: ZeroMode::PunchHole,
                    off: 1 << 20,
                    len: 512
                },
            ],
            "the empty range gets no operation"
        );
        j.complete(ZeroMode::PunchHole, 0, 4096);
        assert_eq!(j.step(ranges(&r)), ZeroStep::Wait);
        j.complete(ZeroMode::PunchHole, 0, 512);
        assert_eq!(j.step(ranges(&r)), ZeroStep::Done(Ok(())));
    }

    #[test]
    fn at_most_a_window_in_flight_and_the_first_error_wins() {
        let r: Vec<(u64, u64)> = (0..40).map(|i| (i * 8192, 4096)).collect();
        let mut j = ZeroJob::new(ZeroMode::PunchHole);
        let first = drain(&mut j, &r);
        assert_eq!(first.len(), ZERO_OPS_PER_CMD_MAX as usize);
        // One completes: one more goes.
        j.complete(ZeroMode::PunchHole, 0, 4096);
        assert_eq!(drain(&mut j, &r).len(), 1);
        // An error: nothing more is submitted, the later error is not the
        // one reported, and the command waits for every operation.
        j.complete(ZeroMode::PunchHole, -libc::EIO, 4096);
        j.complete(ZeroMode::PunchHole, -libc::ENOSPC, 4096);
        assert!(drain(&mut j, &r).is_empty());
        while j.pending() > 1 {
            j.complete(ZeroMode::PunchHole, 0, 4096);
            assert_eq!(j.step(ranges(&r)), ZeroStep::Wait);
        }
        j.complete(ZeroMode::PunchHole, 0, 4096);
        assert_eq!(j.step(ranges(&r)), ZeroStep::Done(Err(-libc::EIO)));
    }

    #[test]
    fn an_unsupported_mode_starts_over_in_the_next_one_down_to_writes() {
        let big = 3 * ZERO_WRITE_CHUNK_BYTES as u64 + 4096;
        let r = [(4096, big), (1 << 30, 8192)];
        let mut j = ZeroJob::new(ZeroMode::ZeroRange);
        let ops = drain(&mut j, &r);
        assert_eq!(ops.len(), 2);
        // The first says EOPNOTSUPP; the second (already submitted) worked.
        j.complete(ZeroMode::ZeroRange, -libc::EOPNOTSUPP, big);
        assert_eq!(j.step(ranges(&r)), ZeroStep::Wait, "waits for the other");
        j.complete(ZeroMode::ZeroRange, 0, 8192);
        // Every range again, punching holes.
        let ops = drain(&mut j, &r);
        assert_eq!(
            ops.iter()
                .map(|o| (o.mode, o.off, o.len))
                .collect::<Vec<_>>(),
            vec![
                (ZeroMode::PunchHole, 4096, big),
                (ZeroMode::PunchHole, 1 << 30, 8192)
            ]
        );
        for o in ops {
            j.complete(o.mode, -libc::EOPNOTSUPP, o.len);
        }
        // Then writes, chunked.
        let ops = drain(&mut j, &r);
        let want: Vec<(u64, u64)> = vec![
            (4096, ZERO_WRITE_CHUNK_BYTES as u64),
            (
                4096 + ZERO_WRITE_CHUNK_BYTES as u64,
                ZERO_WRITE_CHUNK_BYTES as u64,
            ),
            (
                4096 + 2 * ZERO_WRITE_CHUNK_BYTES as u64,
                ZERO_WRITE_CHUNK_BYTES as u64,
            ),
            (4096 + 3 * ZERO_WRITE_CHUNK_BYTES as u64, 4096),
            (1 << 30, 8192),
        ];
        assert!(ops.iter().all(|o| o.mode == ZeroMode::Write));
        assert_eq!(ops.iter().map(|o| (o.off, o.len)).collect::<Vec<_>>(), want);
        // A write that wrote less than asked fails the command.
        j.complete(ZeroMode::Write, 4096, ZERO_WRITE_CHUNK_BYTES as u64);
        for o in &ops[1..] {
            j.complete(o.mode, o.len as i32, o.len);
        }
        assert_eq!(j.step(ranges(&r)), ZeroStep::Done(Err(-libc::EIO)));
    }

    #[test]
    fn writes_unsupported_too_is_an_error_and_stale_results_do_not_downgrade_twice() {
        let r = [(0, 4096), (8192, 4096)];
        let mut j = ZeroJob::new(ZeroMode::PunchHole);
        drain(&mut j, &r);
        j.complete(ZeroMode::PunchHole, -libc::EOPNOTSUPP, 4096);
        j.complete(ZeroMode::PunchHole, -libc::EOPNOTSUPP, 4096);
        assert_eq!(j.mode(), ZeroMode::PunchHole);
        let ops = drain(&mut j, &r);
        assert_eq!(j.mode(), ZeroMode::Write, "one step down, not two");
        for o in ops {
            j.complete(o.mode, -libc::EOPNOTSUPP, o.len);
        }
        assert_eq!(j.step(ranges(&r)), ZeroStep::Done(Err(-libc::EOPNOTSUPP)));
        // A command with nothing to zero is done at once.
        let mut j = ZeroJob::new(ZeroMode::ZeroRange);
        assert_eq!(j.step(ranges(&[(0, 0)])), ZeroStep::Done(Ok(())));
    }
}
