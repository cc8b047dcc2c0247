//! The 16-byte completion queue entry.

use crate::le::{put_u16, put_u32, u16_at, u32_at};
use crate::{Status, WireError};

pub const CQE_LEN: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cqe {
    /// Command-specific result (dword 0).
    pub dw0: u32,
    /// Dword 1 (the upper half of an 8-byte Property Get).
    pub dw1: u32,
    pub sqhd: u16,
    pub sqid: u16,
    pub cid: u16,
    pub status: Status,
}

impl Cqe {
    pub fn new(cid: u16, status: Status) -> Cqe {
        Cqe {
            dw0: 0,
            dw1: 0,
            sqhd: 0,
            sqid: 0,
            cid,
            status,
        }
    }

    pub fn encode(&self, out: &mut [u8; CQE_LEN]) {
        put_u32(out, 0, self.dw0);
        put_u32(out, 4, self.dw1);
        put_u16(out, 8, self.sqhd);
        put_u16(out, 10, self.sqid);
        put_u16(out, 12, self.cid);
        put_u16(out, 14, self.status.to_wire());
    }

    pub fn decode(b: &[u8]) -> Result<Cqe, WireError> {
        WireError::check_len("CQE", b, CQE_LEN)?;
        Ok(Cqe {
            dw0: u32_at(b, 0),
            dw1: u32_at(b, 4),
            sqhd: u16_at(b, 8),
            sqid: u16_at(b, 10),
            cid: u16_at(b, 12),
            status: Status::from_wire(u16_at(b, 14)),
        })
    }
}
