//! The 64-byte submission queue entry, read and written in place.
//!
//! [`Sqe`] wraps the raw bytes: accessors decode a field on demand, so a
//! command taken off the wire is never copied into an intermediate struct.

use crate::le::{put_u16, put_u32, put_u64, u16_at, u32_at, u64_at};

pub const SQE_LEN: usize = 64;

/// Opcodes of the admin command set that nvpool speaks.
pub mod admin {
    pub const GET_LOG_PAGE: u8 = 0x02;
    pub const IDENTIFY: u8 = 0x06;
    pub const ABORT: u8 = 0x08;
    pub const SET_FEATURES: u8 = 0x09;
    pub const GET_FEATURES: u8 = 0x0A;
    pub const ASYNC_EVENT_REQUEST: u8 = 0x0C;
    pub const KEEP_ALIVE: u8 = 0x18;
    pub const FABRICS: u8 = 0x7F;
}

/// Opcodes of the NVM command set.
pub mod nvm {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
    pub const READ: u8 = 0x02;
    pub const WRITE_ZEROES: u8 = 0x08;
    pub const DATASET_MANAGEMENT: u8 = 0x09;
    pub const FABRICS: u8 = 0x7F;
}

/// SGL descriptor identifiers used on NVMe/TCP.
pub mod sgl_id {
    /// Data block, offset subtype: in-capsule data.
    pub const IN_CAPSULE: u8 = 0x01;
    /// Transport SGL data block: data moves in R2T/H2CData or C2HData PDUs.
    pub const TRANSPORT: u8 = 0x5A;
}

/// The PSDT value fabrics requires in byte 1 (SGLs for data transfer).
pub const FLAGS_PSDT_SGL: u8 = 0x40;

/// SGL descriptor 1 of a command (DPTR, bytes 24..40).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sgl {
    pub addr: u64,
    pub len: u32,
    pub id: u8,
}

/// A submission queue entry.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Sqe(pub [u8; SQE_LEN]);

const _: () = assert!(std::mem::size_of::<Sqe>() == SQE_LEN);

impl Default for Sqe {
    fn default() -> Self {
        Sqe([0; SQE_LEN])
    }
}

impl std::fmt::Debug for Sqe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sqe")
            .field("opc", &format_args!("{:#04x}", self.opcode()))
            .field("cid", &self.cid())
            .field("nsid", &self.nsid())
            .field("sgl", &self.sgl())
            .finish()
    }
}

impl Sqe {
    /// Builds an SQE from exactly 64 bytes.
    pub fn from_slice(b: &[u8]) -> Option<Sqe> {
        let a: [u8; SQE_LEN] = b.get(..SQE_LEN)?.try_into().ok()?;
        Some(Sqe(a))
    }

    /// A zeroed command with opcode, CID and the fabrics PSDT flag set.
    pub fn new(opcode: u8, cid: u16) -> Sqe {
        let mut s = Sqe::default();
        s.0[0] = opcode;
        s.0[1] = FLAGS_PSDT_SGL;
        s.set_cid(cid);
        s
    }

    pub fn opcode(&self) -> u8 {
        self.0[0]
    }
    pub fn flags(&self) -> u8 {
        self.0[1]
    }
    /// Fused-operation bits (1:0).
    pub fn fuse(&self) -> u8 {
        self.0[1] & 0x3
    }
    /// PRP-or-SGL selector (bits 7:6).
    pub fn psdt(&self) -> u8 {
        self.0[1] >> 6
    }
    pub fn cid(&self) -> u16 {
        u16_at(&self.0, 2)
    }
    pub fn set_cid(&mut self, cid: u16) {
        put_u16(&mut self.0, 2, cid)
    }
    pub fn nsid(&self) -> u32 {
        u32_at(&self.0, 4)
    }
    pub fn set_nsid(&mut self, nsid: u32) {
        put_u32(&mut self.0, 4, nsid)
    }
    /// Fabrics command type (byte 4), meaningful when opcode is 0x7F.
    pub fn fctype(&self) -> u8 {
        self.0[4]
    }
    pub fn set_fctype(&mut self, t: u8) {
        self.0[4] = t
    }

    pub fn sgl(&self) -> Sgl {
        Sgl {
            addr: u64_at(&self.0, 24),
            len: u32_at(&self.0, 32),
            id: self.0[39],
        }
    }
    pub fn set_sgl(&mut self, sgl: Sgl) {
        put_u64(&mut self.0, 24, sgl.addr);
        put_u32(&mut self.0, 32, sgl.len);
        self.0[36..39].fill(0);
        self.0[39] = sgl.id;
    }

    /// Command dword `n` (2, 3 or 10..=15).
    pub fn cdw(&self, n: usize) -> u32 {
        u32_at(&self.0, Self::cdw_off(n))
    }
    pub fn set_cdw(&mut self, n: usize, v: u32) {
        put_u32(&mut self.0, Self::cdw_off(n), v)
    }
    fn cdw_off(n: usize) -> usize {
        assert!(matches!(n, 2 | 3 | 10..=15), "no command dword {n}");
        n * 4
    }

    /// Starting LBA of Read, Write and Write Zeroes (CDW10-11).
    pub fn slba(&self) -> u64 {
        u64_at(&self.0, 40)
    }
    pub fn set_slba(&mut self, lba: u64) {
        put_u64(&mut self.0, 40, lba)
    }
    /// Number of logical blocks, 0's based (CDW12 bits 15:0).
    pub fn nlb(&self) -> u16 {
        u16_at(&self.0, 48)
    }
    pub fn set_nlb(&mut self, nlb0: u16) {
        put_u16(&mut self.0, 48, nlb0)
    }
    /// Force Unit Access (CDW12 bit 30).
    pub fn fua(&self) -> bool {
        self.cdw(12) & (1 << 30) != 0
    }
    /// The write epoch nvpool's engines tag Write, Write Zeroes and Dataset
    /// Management commands to extent namespaces with (CDW2, reserved for
    /// these commands without end-to-end protection; design/thin-snapshots.md
    /// T5). 0, what any other host sends, is untagged.
    pub fn write_epoch(&self) -> u32 {
        self.cdw(2)
    }
    pub fn set_write_epoch(&mut self, epoch: u32) {
        self.set_cdw(2, epoch)
    }
}

/// Direction of data a command moves, per the opcode and fabrics type rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    None,
    HostToController,
    ControllerToHost,
    Bidirectional,
}

impl Sqe {
    /// The data direction the opcode (or FCTYPE for fabrics commands) implies.
    pub fn direction(&self) -> Direction {
        let bits = if self.opcode() == admin::FABRICS {
            self.fctype()
        } else {
            self.opcode()
        } & 0x3;
        match bits {
            0 => Direction::None,
            1 => Direction::HostToController,
            2 => Direction::ControllerToHost,
            _ => Direction::Bidirectional,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_land_where_the_spec_says() {
        let mut s = Sqe::new(nvm::READ, 0xBEEF);
        s.set_nsid(7);
        s.set_slba(0x0102_0304_0506_0708);
        s.set_nlb(31);
        s.set_sgl(Sgl {
            addr: 0,
            len: 32 * 512,
            id: sgl_id::TRANSPORT,
        });
        assert_eq!(s.0[0], 0x02);
        assert_eq!(s.0[1], 0x40);
        assert_eq!(&s.0[2..4], &[0xEF, 0xBE]);
        assert_eq!(&s.0[4..8], &[7, 0, 0, 0]);
        assert_eq!(s.0[39], 0x5A);
        assert_eq!(&s.0[40..48], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(s.nlb(), 31);
        assert_eq!(s.sgl().len, 16384);
        assert_eq!(s.direction(), Direction::ControllerToHost);
    }

    #[test]
    fn fabrics_direction_comes_from_fctype() {
        let mut s = Sqe::new(admin::FABRICS, 1);
        s.set_fctype(0x01); // Connect
        assert_eq!(s.direction(), Direction::HostToController);
        s.set_fctype(0x04); // Property Get
        assert_eq!(s.direction(), Direction::None);
    }
}
