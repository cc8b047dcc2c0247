//! Fabrics commands (opcode 0x7F): Connect, Property Get/Set, and the
//! controller properties (CAP, VS, CC, CSTS) they address.

use crate::le::{put_u16, put_u32, put_u64, u16_at, u32_at, u64_at};
use crate::sqe::{admin, sgl_id, Sgl, Sqe};
use crate::{WireError, NQN_LEN_MAX};

/// Fabrics command types (SQE byte 4).
pub mod fctype {
    pub const PROPERTY_SET: u8 = 0x00;
    pub const CONNECT: u8 = 0x01;
    pub const PROPERTY_GET: u8 = 0x04;
    pub const AUTH_SEND: u8 = 0x05;
    pub const AUTH_RECEIVE: u8 = 0x06;
    pub const DISCONNECT: u8 = 0x08;
}

pub const CONNECT_DATA_LEN: usize = 1024;

/// The SQE fields of a Connect command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectCmd {
    pub recfmt: u16,
    pub qid: u16,
    /// Submission queue size, 0's based.
    pub sqsize: u16,
    pub cattr: u8,
    /// Keep-alive timeout in milliseconds.
    pub kato_ms: u32,
}

impl ConnectCmd {
    pub fn from_sqe(s: &Sqe) -> ConnectCmd {
        ConnectCmd {
            recfmt: u16_at(&s.0, 40),
            qid: u16_at(&s.0, 42),
            sqsize: u16_at(&s.0, 44),
            cattr: s.0[46],
            kato_ms: u32_at(&s.0, 48),
        }
    }

    /// Builds the Connect SQE (in-capsule 1024-byte data).
    pub fn to_sqe(&self, cid: u16) -> Sqe {
        let mut s = Sqe::new(admin::FABRICS, cid);
        s.set_fctype(fctype::CONNECT);
        s.set_sgl(Sgl {
            addr: 0,
            len: CONNECT_DATA_LEN as u32,
            id: sgl_id::IN_CAPSULE,
        });
        put_u16(&mut s.0, 40, self.recfmt);
        put_u16(&mut s.0, 42, self.qid);
        put_u16(&mut s.0, 44, self.sqsize);
        s.0[46] = self.cattr;
        put_u32(&mut s.0, 48, self.kato_ms);
        s
    }

    /// CATTR bit 2: the host asks for SQ flow control to be disabled.
    pub fn sq_flow_control_disabled(&self) -> bool {
        self.cattr & 0x4 != 0
    }
}

/// Connect command data, borrowing its NQNs from the received buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectData<'a> {
    pub hostid: [u8; 16],
    pub cntlid: u16,
    pub subnqn: &'a str,
    pub hostnqn: &'a str,
}

/// Byte offsets inside Connect data, also reported in "invalid parameter" errors.
pub mod connect_off {
    pub const CNTLID: u32 = 16;
    pub const SUBNQN: u32 = 256;
    pub const HOSTNQN: u32 = 512;
}

impl<'a> ConnectData<'a> {
    pub fn decode(b: &'a [u8]) -> Result<ConnectData<'a>, WireError> {
        WireError::check_len("Connect data", b, CONNECT_DATA_LEN)?;
        let mut hostid = [0u8; 16];
        hostid.copy_from_slice(&b[0..16]);
        Ok(ConnectData {
            hostid,
            cntlid: u16_at(b, 16),
            subnqn: nqn_field(&b[256..512], "SUBNQN")?,
            hostnqn: nqn_field(&b[512..768], "HOSTNQN")?,
        })
    }

    pub fn encode(&self) -> [u8; CONNECT_DATA_LEN] {
        let mut out = [0u8; CONNECT_DATA_LEN];
        out[0..16].copy_from_slice(&self.hostid);
        put_u16(&mut out, 16, self.cntlid);
        crate::le::put_str_padded(&mut out[256..256 + NQN_LEN_MAX], self.subnqn, 0);
        crate::le::put_str_padded(&mut out[512..512 + NQN_LEN_MAX], self.hostnqn, 0);
        out
    }
}

fn nqn_field<'a>(f: &'a [u8], field: &'static str) -> Result<&'a str, WireError> {
    let end = f
        .iter()
        .position(|&c| c == 0)
        .ok_or(WireError::bad("Connect data", field, 0u8))?;
    if end == 0 || end > NQN_LEN_MAX {
        return Err(WireError::bad("Connect data", field, end as u64));
    }
    std::str::from_utf8(&f[..end]).map_err(|_| WireError::BadString {
        what: "Connect data",
        field,
    })
}

/// Property offsets.
pub mod prop {
    pub const CAP: u32 = 0x00;
    pub const VS: u32 = 0x08;
    pub const CC: u32 = 0x14;
    pub const CSTS: u32 = 0x1C;
    pub const NSSR: u32 = 0x20;
}

/// Property Get or Set as carried in the SQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PropertyCmd {
    /// ATTRIB bit 0: an 8-byte property.
    pub size8: bool,
    pub offset: u32,
    /// The value to write (Property Set only).
    pub value: u64,
}

impl PropertyCmd {
    pub fn from_sqe(s: &Sqe) -> PropertyCmd {
        PropertyCmd {
            size8: s.0[40] & 1 != 0,
            offset: u32_at(&s.0, 44),
            value: u64_at(&s.0, 48),
        }
    }

    pub fn to_sqe(&self, cid: u16, fct: u8) -> Sqe {
        let mut s = Sqe::new(admin::FABRICS, cid);
        s.set_fctype(fct);
        s.set_sgl(Sgl {
            addr: 0,
            len: 0,
            id: sgl_id::TRANSPORT,
        });
        s.0[40] = self.size8 as u8;
        put_u32(&mut s.0, 44, self.offset);
        put_u64(&mut s.0, 48, self.value);
        s
    }
}

/// Controller Capabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cap {
    /// Maximum queue entries supported, 0's based.
    pub mqes: u16,
    /// Worst-case time to ready, in 500 ms units.
    pub to: u8,
    /// NVM command set supported (CSS bit 0).
    pub css_nvm: bool,
}

impl Cap {
    pub fn to_u64(self) -> u64 {
        self.mqes as u64 | 1 << 16 /* CQR: contiguous queues required */ | (self.to as u64) << 24 | (self.css_nvm as u64) << 37
    }
    pub fn from_u64(v: u64) -> Cap {
        Cap {
            mqes: v as u16,
            to: (v >> 24) as u8,
            css_nvm: v >> 37 & 1 == 1,
        }
    }
}

/// Controller Configuration register bits.
pub mod cc {
    pub const EN: u32 = 1;
    pub const SHN_SHIFT: u32 = 14;
    pub const SHN_MASK: u32 = 0x3 << SHN_SHIFT;
    pub const CSS_SHIFT: u32 = 4;
    pub const CSS_MASK: u32 = 0x7 << CSS_SHIFT;
    pub const MPS_SHIFT: u32 = 7;
    pub const MPS_MASK: u32 = 0xF << MPS_SHIFT;
    pub const AMS_SHIFT: u32 = 11;
    pub const AMS_MASK: u32 = 0x7 << AMS_SHIFT;
    pub const IOSQES_SHIFT: u32 = 16;
    pub const IOCQES_SHIFT: u32 = 20;
    /// The value the Linux host writes: IOSQES 6, IOCQES 4, MPS 0, CSS NVM, EN 1.
    pub const LINUX_ENABLE: u32 = 0x0046_0001;
}

/// Controller Status register bits.
pub mod csts {
    pub const RDY: u32 = 1;
    pub const CFS: u32 = 1 << 1;
    pub const SHST_SHIFT: u32 = 2;
    pub const SHST_COMPLETE: u32 = 0x2 << SHST_SHIFT;
    pub const SHST_MASK: u32 = 0x3 << SHST_SHIFT;
}

/// VS value for NVMe 1.3: the host then uses the Identify CNS 03h descriptor
/// list, Active NS list and NGUID, but not CNS 08h (2.0+).
pub const VS_1_3: u32 = 0x0001_0300;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_round_trip() {
        let c = ConnectCmd {
            recfmt: 0,
            qid: 3,
            sqsize: 127,
            cattr: 4,
            kato_ms: 5000,
        };
        let s = c.to_sqe(9);
        assert_eq!(s.0[0], 0x7F);
        assert_eq!(s.0[4], 0x01);
        assert_eq!(s.sgl().len, 1024);
        assert_eq!(ConnectCmd::from_sqe(&s), c);
        assert!(c.sq_flow_control_disabled());

        let d = ConnectData {
            hostid: [7; 16],
            cntlid: 0xFFFF,
            subnqn: "nqn.2026-11.io.nvpool:a",
            hostnqn: "nqn.h",
        };
        let b = d.encode();
        assert_eq!(&b[256..259], b"nqn");
        assert_eq!(ConnectData::decode(&b).unwrap(), d);
    }

    #[test]
    fn connect_data_rejects_unterminated_or_empty_nqn() {
        let mut b = [0u8; 1024];
        assert!(ConnectData::decode(&b).is_err(), "empty NQN");
        b[256..512].fill(b'a');
        b[512] = b'h';
        assert!(ConnectData::decode(&b).is_err(), "no NUL inside SUBNQN");
        assert!(ConnectData::decode(&b[..100]).is_err());
    }

    #[test]
    fn cap_encoding() {
        let c = Cap {
            mqes: 255,
            to: 15,
            css_nvm: true,
        };
        let v = c.to_u64();
        assert_eq!(v & 0xFFFF, 255);
        assert_eq!((v >> 24) & 0xFF, 15);
        assert_eq!((v >> 48) & 0xF, 0, "MPSMIN must be 0");
        assert_eq!(Cap::from_u64(v), c);
    }
}
