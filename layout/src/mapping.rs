//! Where each byte of a volume lives: the address mapping shared by the
//! control plane (which allocates the extents) and the initiator (which
//! sends each I/O to the right extents). Pure arithmetic, no allocation.
//!
//! A volume of layout `L` has `W` stripe members (`L.width()`, 1 for concat
//! and raid1) and `C` copies of each member (`L.copies()`, 1 for concat and
//! raid0). Each member is a sequence of `rows` extents of `E` bytes
//! (`E` = the volume's `extent_bytes`), where
//!
//! ```text
//! rows = ceil(size / (E × W))
//! ```
//!
//! so the volume holds `rows × W × C` extents, stored in the order
//! `(row, member, copy)`: growing a volume appends rows and never moves a
//! byte already mapped.
//!
//! **Volume offset → member offset.** With stripe unit `S` (the layout's
//! `stripe_bytes`; for `W = 1` take `S = E`, which makes the mapping the
//! identity):
//!
//! ```text
//! unit          = offset / S
//! member        = unit mod W
//! member_offset = (unit / W) × S + offset mod S
//! ```
//!
//! That is classic RAID-0: stripe units go round-robin over the members.
//! For W = 3:
//!
//! ```text
//! volume:  | u0 | u1 | u2 | u3 | u4 | u5 | u6 | …
//! member 0:  u0             u3             u6
//! member 1:       u1             u4
//! member 2:            u2             u5
//! ```
//!
//! **Member offset → extent.** `row = member_offset / E`, `offset_in_extent
//! = member_offset mod E`, and the bytes are at `extent.offset +
//! offset_in_extent` on the device of every copy of `(row, member)`. `S`
//! divides `E` (both are powers of two and `S ≤ E`), so a stripe unit never
//! straddles two extents: an I/O is split at stripe-unit boundaries (for
//! `W > 1`) or extent boundaries (for `W = 1`) and each piece goes to one
//! extent ([`Geometry::segments`]). Reads may use any live copy; writes go
//! to every copy.

use crate::model::Layout;

/// Why an offset cannot be mapped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    #[error("bytes {offset}..{end} are outside the volume (size {size})")]
    OutOfRange { offset: u64, end: u64, size: u64 },
    /// The volume record lacks the extent (it fails the control plane's
    /// `Volume::validate`).
    #[error("the volume has no extent for row {row} of member {member}")]
    MissingExtent { row: u32, member: u32 },
}

/// The numbers the mapping needs, taken from a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub size_bytes: u64,
    pub extent_bytes: u64,
    /// Stripe members (W).
    pub width: u32,
    /// Copies of each member (C).
    pub copies: u8,
    /// Stripe unit (S); the extent size when `width == 1`.
    pub stripe_bytes: u64,
}

/// Where one volume byte lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub member: u32,
    /// Which extent of the member.
    pub row: u32,
    pub offset_in_extent: u64,
    /// Bytes from here that stay in the same extent and follow each other
    /// there (to the end of the stripe unit, the extent or the volume).
    pub contiguous_bytes: u64,
}

impl Location {
    /// Index in a volume's extents (the control plane's `Volume::extents`,
    /// a plan's `extents`) of copy 0 of this location's extent; the
    /// other copies follow it.
    pub fn first_extent_index(&self, g: &Geometry) -> usize {
        (self.row as usize * g.width as usize + self.member as usize) * usize::from(g.copies)
    }
}

/// One piece of an I/O, inside one extent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub volume_offset: u64,
    pub len: u64,
    pub location: Location,
}

impl Geometry {
    /// The geometry of a volume of `size_bytes` with this layout. Does not
    /// validate: see [`Layout::validate`] and
    /// [`crate::model::validate_size`].
    pub fn new(size_bytes: u64, extent_bytes: u64, layout: &Layout) -> Geometry {
        Geometry {
            size_bytes,
            extent_bytes,
            width: layout.width(),
            copies: layout.copies(),
            stripe_bytes: layout.stripe_bytes().unwrap_or(extent_bytes),
        }
    }

    /// Extents per member: `ceil(size / (E × W))`.
    pub fn rows(&self) -> u32 {
        let rows = self
            .size_bytes
            .div_ceil(self.extent_bytes * u64::from(self.width));
        u32::try_from(rows).expect("validated sizes have at most EXTENTS_PER_VOLUME_MAX rows")
    }

    /// Extents of the whole volume: `rows × W × C`.
    pub fn extent_count(&self) -> usize {
        self.rows() as usize * self.width as usize * usize::from(self.copies)
    }

    /// Raw device bytes the volume occupies.
    pub fn raw_bytes(&self) -> u64 {
        self.extent_count() as u64 * self.extent_bytes
    }

    /// Maps one volume byte.
    pub fn map(&self, offset: u64) -> Result<Location, MapError> {
        if offset >= self.size_bytes {
            return Err(MapError::OutOfRange {
                offset,
                end: offset.saturating_add(1),
                size: self.size_bytes,
            });
        }
        let s = self.stripe_bytes;
        let w = u64::from(self.width);
        let unit = offset / s;
        let in_unit = offset % s;
        let member_offset = (unit / w) * s + in_unit;
        Ok(Location {
            member: (unit % w) as u32,
            row: (member_offset / self.extent_bytes) as u32,
            offset_in_extent: member_offset % self.extent_bytes,
            contiguous_bytes: (s - in_unit).min(self.size_bytes - offset),
        })
    }

    /// Splits `len` bytes from `offset` into pieces that each lie in one
    /// extent, in volume order.
    pub fn segments(&self, offset: u64, len: u64) -> Result<Segments, MapError> {
        let end = offset.checked_add(len).filter(|&e| e <= self.size_bytes);
        match end {
            Some(end) => Ok(Segments {
                geometry: *self,
                next: offset,
                end,
            }),
            None => Err(MapError::OutOfRange {
                offset,
                end: offset.saturating_add(len),
                size: self.size_bytes,
            }),
        }
    }
}

/// Iterator over the [`Segment`]s of a range; see [`Geometry::segments`].
#[derive(Debug, Clone)]
pub struct Segments {
    geometry: Geometry,
    next: u64,
    end: u64,
}

impl Iterator for Segments {
    type Item = Segment;

    fn next(&mut self) -> Option<Segment> {
        if self.next >= self.end {
            return None;
        }
        let location = self
            .geometry
            .map(self.next)
            .expect("segments stay inside the volume");
        let len = location.contiguous_bytes.min(self.end - self.next);
        let segment = Segment {
            volume_offset: self.next,
            len,
            location,
        };
        self.next += len;
        Some(segment)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    const K: u64 = 1024;

    fn g(size: u64, extent: u64, layout: Layout) -> Geometry {
        Geometry::new(size, extent, &layout)
    }

    fn loc(member: u32, row: u32, off: u64, contiguous: u64) -> Location {
        Location {
            member,
            row,
            offset_in_extent: off,
            contiguous_bytes: contiguous,
        }
    }

    #[test]
    fn concat_is_the_identity_cut_into_extents() {
        let g = g(2500 * K, 1024 * K, Layout::Concat);
        assert_eq!(g.rows(), 3);
        assert_eq!(g.extent_count(), 3);
        assert_eq!(g.map(0).unwrap(), loc(0, 0, 0, 1024 * K));
        assert_eq!(g.map(1024 * K - 1).unwrap(), loc(0, 0, 1024 * K - 1, 1));
        assert_eq!(g.map(1024 * K).unwrap(), loc(0, 1, 0, 1024 * K));
        assert_eq!(g.map(2048 * K + 4 * K).unwrap(), loc(0, 2, 4 * K, 448 * K));
        assert!(g.map(2500 * K).is_err());
    }

    #[test]
    fn raid1_maps_like_concat_with_copies() {
        let g = g(1024 * K, 512 * K, Layout::Raid1 { copies: 3 });
        assert_eq!((g.rows(), g.extent_count()), (2, 6));
        let l = g.map(600 * K).unwrap();
        assert_eq!(l, loc(0, 1, 88 * K, 424 * K));
        assert_eq!(l.first_extent_index(&g), 3);
        assert_eq!(g.raw_bytes(), 3 * 1024 * K);
    }

    #[test]
    fn raid0_round_robins_stripe_units() {
        // W = 3, S = 64 KiB, E = 256 KiB: 4 units per extent per member.
        let layout = Layout::Raid0 {
            stripe_bytes: 64 * K,
            width: 3,
        };
        let g = g(1536 * K, 256 * K, layout);
        assert_eq!(g.rows(), 2);
        assert_eq!(g.map(0).unwrap(), loc(0, 0, 0, 64 * K));
        assert_eq!(g.map(64 * K + 5).unwrap(), loc(1, 0, 5, 64 * K - 5));
        assert_eq!(g.map(128 * K).unwrap(), loc(2, 0, 0, 64 * K));
        assert_eq!(g.map(192 * K).unwrap(), loc(0, 0, 64 * K, 64 * K));
        // Unit 12 is member 0's fifth unit: the first of its second extent.
        assert_eq!(g.map(12 * 64 * K).unwrap(), loc(0, 1, 0, 64 * K));
        assert_eq!(g.map(13 * 64 * K + 1).unwrap(), loc(1, 1, 1, 64 * K - 1));
        let l = g.map(13 * 64 * K).unwrap();
        assert_eq!(l.first_extent_index(&g), 4);
    }

    #[test]
    fn raid10_is_raid0_with_copies() {
        let layout = Layout::Raid10 {
            stripe_bytes: 4 * K,
            width: 2,
            copies: 2,
        };
        let g = g(64 * K, 16 * K, layout);
        assert_eq!((g.rows(), g.extent_count()), (2, 8));
        let l = g.map(9 * 4 * K).unwrap();
        assert_eq!(l, loc(1, 1, 0, 4 * K));
        assert_eq!(l.first_extent_index(&g), 6);
    }

    #[test]
    fn partial_last_row_and_short_tail() {
        // 5 units of 4 KiB over 2 members: member 1 has one unit less.
        let layout = Layout::Raid0 {
            stripe_bytes: 4 * K,
            width: 2,
        };
        let g = g(18 * K, 1024 * K, layout);
        assert_eq!(g.rows(), 1);
        assert_eq!(g.map(16 * K).unwrap(), loc(0, 0, 8 * K, 2 * K));
        assert!(g.map(18 * K).is_err());
    }

    /// Every block of small volumes of every layout lands on a distinct
    /// (member, row, offset), inside its extent, within the rows allocated.
    #[test]
    fn mapping_is_injective_and_in_bounds() {
        let layouts = [
            Layout::Concat,
            Layout::Raid1 { copies: 2 },
            Layout::Raid0 {
                stripe_bytes: 4 * K,
                width: 2,
            },
            Layout::Raid0 {
                stripe_bytes: 8 * K,
                width: 3,
            },
            Layout::Raid10 {
                stripe_bytes: 16 * K,
                width: 4,
                copies: 3,
            },
            Layout::Raid0 {
                stripe_bytes: 32 * K,
                width: 5,
            },
        ];
        for layout in layouts {
            for blocks in [1u64, 2, 3, 7, 8, 9, 31, 64, 65, 100] {
                let size = blocks * 4 * K;
                let g = g(size, 32 * K, layout);
                let mut seen = BTreeSet::new();
                for b in 0..blocks {
                    let l = g.map(b * 4 * K).unwrap();
                    assert!(l.member < g.width);
                    assert!(l.row < g.rows(), "{layout} {size}: {l:?}");
                    assert!(l.offset_in_extent + 4 * K <= g.extent_bytes);
                    assert!(l.contiguous_bytes >= 4 * K);
                    assert!(seen.insert((l.member, l.row, l.offset_in_extent)));
                }
            }
        }
    }

    #[test]
    fn segments_cover_a_range_exactly() {
        let layout = Layout::Raid0 {
            stripe_bytes: 8 * K,
            width: 3,
        };
        let g = g(1024 * K, 64 * K, layout);
        for (offset, len) in [
            (0, 1024 * K),
            (5 * K, 3 * K),
            (7 * K, 20 * K),
            (1000 * K, 24 * K),
        ] {
            let segs: Vec<Segment> = g.segments(offset, len).unwrap().collect();
            let mut at = offset;
            for s in &segs {
                assert_eq!(s.volume_offset, at);
                assert_eq!(g.map(at).unwrap(), s.location);
                assert!(s.len <= s.location.contiguous_bytes && s.len > 0);
                assert!(s.location.offset_in_extent + s.len <= g.extent_bytes);
                at += s.len;
            }
            assert_eq!(at, offset + len);
        }
        assert_eq!(g.segments(7 * K, 20 * K).unwrap().count(), 4);
        assert_eq!(g.segments(5, 0).unwrap().count(), 0);
        assert!(g.segments(1020 * K, 8 * K).is_err());
        assert!(g.segments(u64::MAX, 2).is_err());
    }
}
