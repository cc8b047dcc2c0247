//! Splitting a volume byte range into one run per extent.
//!
//! [`Geometry::segments`] cuts a range at stripe-unit (or extent)
//! boundaries. The pieces of one request that land in the same extent
//! follow each other there (stripe units go round-robin over the members,
//! so a member's units inside one request are consecutive in the member),
//! so they merge into one *run*: one command per extent and copy however
//! small the stripe unit. *Chunks* record where each piece of a run sits in
//! the caller's buffer, for gathering write data and scattering read data.
//!
//! ```text
//! request (W = 2):  | a0 | b0 | a1 | b1 | a2 |
//! run of member a:  | a0 | a1 | a2 |          chunks: buf 0, 2, 4 → run 0, 1, 2
//! run of member b:  | b0 | b1 |               chunks: buf 1, 3    → run 0, 1
//! ```

use nvpool_layout::mapping::{Geometry, MapError};

/// Contiguous bytes of one extent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    /// Index in the plan's extents of copy 0 of the extent; its other
    /// copies follow.
    pub first: usize,
    /// Where the run starts in the extent (= in its namespace).
    pub extent_offset: u64,
    pub len: u64,
}

/// One piece of the caller's buffer and its place in a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chunk {
    /// Index in [`Split::runs`].
    pub run: usize,
    pub run_offset: u64,
    pub buf_offset: u64,
    pub len: u64,
}

/// A request cut into runs; chunks in volume order.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Split {
    pub runs: Vec<Run>,
    pub chunks: Vec<Chunk>,
}

/// Cuts `len` bytes at volume `offset` into runs.
pub(crate) fn split(g: &Geometry, offset: u64, len: u64) -> Result<Split, MapError> {
    let mut s = Split::default();
    for seg in g.segments(offset, len)? {
        let first = seg.location.first_extent_index(g);
        let at = seg.location.offset_in_extent;
        let joins = s
            .runs
            .iter()
            .rposition(|r| r.first == first && r.extent_offset + r.len == at);
        let (run, run_offset) = match joins {
            Some(i) => {
                let r = &mut s.runs[i];
                r.len += seg.len;
                (i, r.len - seg.len)
            }
            None => {
                s.runs.push(Run {
                    first,
                    extent_offset: at,
                    len: seg.len,
                });
                (s.runs.len() - 1, 0)
            }
        };
        s.chunks.push(Chunk {
            run,
            run_offset,
            buf_offset: seg.volume_offset - offset,
            len: seg.len,
        });
    }
    Ok(s)
}

impl Split {
    /// Each run's bytes, gathered from `buf` (write data).
    pub fn gather(&self, buf: &[u8]) -> Vec<Vec<u8>> {
        let mut out: Vec<Vec<u8>> = self
            .runs
            .iter()
            .map(|r| Vec::with_capacity(r.len as usize))
            .collect();
        for c in &self.chunks {
            let o = &mut out[c.run];
            // Chunks of a run come in run order: split appends to a run's end.
            debug_assert_eq!(o.len() as u64, c.run_offset);
            o.extend_from_slice(&buf[c.buf_offset as usize..][..c.len as usize]);
        }
        out
    }

    /// Copies the runs' bytes (`runs[i]` holds run `i`) into `buf` (read
    /// data).
    pub fn scatter(&self, runs: &[Vec<u8>], buf: &mut [u8]) {
        for c in &self.chunks {
            let src = &runs[c.run][c.run_offset as usize..][..c.len as usize];
            buf[c.buf_offset as usize..][..c.len as usize].copy_from_slice(src);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvpool_layout::model::Layout;

    const K: u64 = 1024;

    fn geometries() -> Vec<Geometry> {
        let layouts = [
            Layout::Concat,
            Layout::Raid1 { copies: 2 },
            Layout::Raid0 {
                stripe_bytes: 4 * K,
                width: 3,
            },
            Layout::Raid10 {
                stripe_bytes: 8 * K,
                width: 2,
                copies: 3,
            },
        ];
        layouts
            .iter()
            .map(|l| Geometry::new(200 * K, 32 * K, l))
            .collect()
    }

    /// Every byte of the request is in exactly one chunk, in order, and a
    /// chunk's run places it where the mapping says.
    #[test]
    fn chunks_cover_the_request_and_follow_the_mapping() {
        for g in geometries() {
            for (offset, len) in [
                (0, 200 * K),
                (4 * K, 4 * K),
                (3 * K, 50 * K),
                (31 * K, 2 * K),
                (100 * K, 99 * K),
                (17 * K, 0),
            ] {
                let s = split(&g, offset, len).unwrap();
                let mut at = 0;
                for c in &s.chunks {
                    assert_eq!(c.buf_offset, at, "{g:?} {offset}+{len}");
                    let r = s.runs[c.run];
                    assert!(c.run_offset + c.len <= r.len);
                    let l = g.map(offset + at).unwrap();
                    assert_eq!(l.first_extent_index(&g), r.first);
                    assert_eq!(l.offset_in_extent, r.extent_offset + c.run_offset);
                    assert!(r.extent_offset + r.len <= g.extent_bytes);
                    at += c.len;
                }
                assert_eq!(at, len);
                let total: u64 = s.runs.iter().map(|r| r.len).sum();
                assert_eq!(total, len);
            }
        }
    }

    #[test]
    fn one_run_per_member_and_extent() {
        let g = Geometry::new(
            192 * K,
            32 * K,
            &Layout::Raid0 {
                stripe_bytes: 4 * K,
                width: 3,
            },
        );
        // 7 units from unit 1: members 1, 2, 0, 1, 2, 0, 1 of row 0.
        let s = split(&g, 4 * K, 28 * K).unwrap();
        assert_eq!(s.chunks.len(), 7);
        assert_eq!(
            s.runs,
            vec![
                Run {
                    first: 1,
                    extent_offset: 0,
                    len: 12 * K
                },
                Run {
                    first: 2,
                    extent_offset: 0,
                    len: 8 * K
                },
                Run {
                    first: 0,
                    extent_offset: 4 * K,
                    len: 8 * K
                },
            ]
        );
        // Crossing into row 1 (member units 8.. of each member) starts new runs.
        let s = split(&g, 20 * 4 * K, 8 * 4 * K).unwrap();
        let firsts: Vec<usize> = s.runs.iter().map(|r| r.first).collect();
        assert_eq!(firsts, vec![2, 0, 1, 3, 4, 5]);
        // Inside one stripe unit: one run, one chunk.
        let s = split(&g, 4 * K + 512, 2 * K).unwrap();
        assert_eq!((s.runs.len(), s.chunks.len()), (1, 1));
        assert!(split(&g, 190 * K, 4 * K).is_err());
    }

    #[test]
    fn gather_then_scatter_is_the_identity() {
        for g in geometries() {
            let (offset, len) = (5 * K, 150 * K);
            let buf: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let s = split(&g, offset, len).unwrap();
            let runs = s.gather(&buf);
            for (r, b) in s.runs.iter().zip(&runs) {
                assert_eq!(r.len, b.len() as u64);
            }
            let mut back = vec![0; len as usize];
            s.scatter(&runs, &mut back);
            assert!(back == buf, "{g:?}");
        }
    }
}
