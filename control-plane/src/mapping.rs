//! Where each byte of a volume lives. The mapping itself (pure
//! arithmetic, shared with the initiator) is `nvpool-layout`'s
//! [`mapping`](nvpool_layout::mapping), re-exported here; this module adds
//! the lookup of a stored [`Volume`]'s extents.

pub use nvpool_layout::mapping::*;

use crate::model::{Extent, Volume};

impl Volume {
    /// Maps one volume byte to its location and the copies of its extent.
    pub fn locate(&self, offset: u64) -> Result<(Location, &[Extent]), MapError> {
        let g = self.geometry();
        let loc = g.map(offset)?;
        let first = loc.first_extent_index(&g);
        let copies = self
            .extents
            .get(first..first + usize::from(g.copies))
            .ok_or(MapError::MissingExtent {
                row: loc.row,
                member: loc.member,
            })?;
        Ok((loc, copies))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Layout;

    const K: u64 = 1024;

    #[test]
    fn volumes_locate_the_copies_of_an_offset() {
        let layout = Layout::Raid10 {
            stripe_bytes: 4 * K,
            width: 2,
            copies: 2,
        };
        let g = Geometry::new(64 * K, 16 * K, &layout);
        let mut extents = Vec::new();
        for row in 0..g.rows() {
            for member in 0..2 {
                for copy in 0..2 {
                    extents.push(Extent {
                        target: format!("t{}", member * 2 + u32::from(copy)),
                        device: "d".into(),
                        offset: u64::from(row) * 16 * K,
                        length: 16 * K,
                        member,
                        row,
                        copy,
                    });
                }
            }
        }
        let mut v = Volume {
            uuid: crate::model::Uuid([7; 16]),
            name: "v".into(),
            size_bytes: 64 * K,
            layout,
            pool: None,
            extent_bytes: 16 * K,
            extents,
            created_ms: 0,
        };
        let (l, copies) = v.locate(9 * 4 * K + 100).unwrap();
        assert_eq!((l.member, l.row, l.offset_in_extent), (1, 1, 100));
        assert_eq!(copies.len(), 2);
        assert!(copies.iter().all(|e| (e.row, e.member) == (1, 1)));
        assert_eq!(
            (copies[0].target.as_str(), copies[1].target.as_str()),
            ("t2", "t3")
        );
        assert!(matches!(v.locate(64 * K), Err(MapError::OutOfRange { .. })));
        v.extents.truncate(6);
        assert_eq!(
            v.locate(9 * 4 * K),
            Err(MapError::MissingExtent { row: 1, member: 1 })
        );
    }
}
