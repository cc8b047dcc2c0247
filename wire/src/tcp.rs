//! NVMe/TCP transport PDUs.
//!
//! Every PDU starts with an 8-byte common header ([`CommonHeader`]); then a
//! type-specific header up to HLEN bytes, an optional 4-byte header digest,
//! optional padding up to PDO, data, and an optional 4-byte data digest:
//!
//! ```text
//! | CH (8) | PSH (HLEN-8) | HDGST (0|4) | PAD | DATA | DDGST (0|4) |
//! ```
//!
//! Decoders check the fields that must hold for any valid PDU of that type
//! (HLEN, PLEN against HLEN, PDO). Checks that depend on connection state
//! (digests negotiated, command outstanding) belong to the caller.

use crate::cqe::{Cqe, CQE_LEN};
use crate::le::{put_u16, put_u32, u16_at, u32_at};
use crate::sqe::{Sqe, SQE_LEN};
use crate::WireError;

pub const CH_LEN: usize = 8;
pub const DIGEST_LEN: usize = 4;
pub const IC_PDU_LEN: usize = 128;
pub const CAPSULE_CMD_HLEN: usize = CH_LEN + SQE_LEN;
pub const CAPSULE_RESP_HLEN: usize = CH_LEN + CQE_LEN;
pub const DATA_HLEN: usize = 24;
pub const R2T_HLEN: usize = 24;
pub const TERM_HLEN: usize = 24;
/// A TermReq carries at most this many bytes of the offending PDU header.
pub const TERM_DATA_MAX: usize = 128;

const _: () = assert!(CAPSULE_CMD_HLEN == 72);
const _: () = assert!(CAPSULE_RESP_HLEN == 24);

/// PDU types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PduType {
    IcReq = 0x00,
    IcResp = 0x01,
    H2CTermReq = 0x02,
    C2HTermReq = 0x03,
    CapsuleCmd = 0x04,
    CapsuleResp = 0x05,
    H2CData = 0x06,
    C2HData = 0x07,
    R2T = 0x09,
}

impl PduType {
    pub fn from_u8(v: u8) -> Result<PduType, WireError> {
        Ok(match v {
            0x00 => PduType::IcReq,
            0x01 => PduType::IcResp,
            0x02 => PduType::H2CTermReq,
            0x03 => PduType::C2HTermReq,
            0x04 => PduType::CapsuleCmd,
            0x05 => PduType::CapsuleResp,
            0x06 => PduType::H2CData,
            0x07 => PduType::C2HData,
            0x09 => PduType::R2T,
            other => return Err(WireError::UnknownPduType(other)),
        })
    }

    /// The HLEN every PDU of this type must carry.
    pub fn header_len(self) -> usize {
        match self {
            PduType::IcReq | PduType::IcResp => IC_PDU_LEN,
            PduType::CapsuleCmd => CAPSULE_CMD_HLEN,
            PduType::H2CTermReq
            | PduType::C2HTermReq
            | PduType::CapsuleResp
            | PduType::H2CData
            | PduType::C2HData
            | PduType::R2T => 24,
        }
    }

    /// Whether a header digest follows the header once negotiated.
    pub fn has_header_digest(self) -> bool {
        !matches!(
            self,
            PduType::IcReq | PduType::IcResp | PduType::H2CTermReq | PduType::C2HTermReq
        )
    }
}

/// Common-header flag bits.
pub mod flags {
    pub const HDGSTF: u8 = 0x01;
    pub const DDGSTF: u8 = 0x02;
    pub const LAST_PDU: u8 = 0x04;
    pub const SUCCESS: u8 = 0x08;
}

/// Fatal Error Status values of a TermReq.
pub mod fes {
    pub const INVALID_HEADER_FIELD: u16 = 0x01;
    pub const PDU_SEQUENCE_ERROR: u16 = 0x02;
    pub const HEADER_DIGEST_ERROR: u16 = 0x03;
    pub const DATA_OUT_OF_RANGE: u16 = 0x04;
    pub const R2T_LIMIT_EXCEEDED: u16 = 0x05;
    pub const UNSUPPORTED_PARAMETER: u16 = 0x06;
}

/// The 8-byte header every PDU begins with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommonHeader {
    pub pdu_type: PduType,
    pub flags: u8,
    pub hlen: u8,
    pub pdo: u8,
    pub plen: u32,
}

impl CommonHeader {
    /// Decodes and checks the common header: known type, the type's HLEN,
    /// PLEN covering at least the header, PDO either 0 or within PLEN and
    /// past the header.
    pub fn decode(b: &[u8]) -> Result<CommonHeader, WireError> {
        WireError::check_len("common header", b, CH_LEN)?;
        let pdu_type = PduType::from_u8(b[0])?;
        let ch = CommonHeader {
            pdu_type,
            flags: b[1],
            hlen: b[2],
            pdo: b[3],
            plen: u32_at(b, 4),
        };
        if ch.hlen as usize != pdu_type.header_len() {
            return Err(WireError::bad("common header", "HLEN", ch.hlen));
        }
        if (ch.plen as usize) < ch.hlen as usize {
            return Err(WireError::bad("common header", "PLEN", ch.plen));
        }
        if ch.pdo != 0 && (ch.pdo < ch.hlen || ch.pdo as u32 > ch.plen) {
            return Err(WireError::bad("common header", "PDO", ch.pdo));
        }
        Ok(ch)
    }

    pub fn encode(&self, out: &mut [u8]) {
        out[0] = self.pdu_type as u8;
        out[1] = self.flags;
        out[2] = self.hlen;
        out[3] = self.pdo;
        put_u32(out, 4, self.plen);
    }
}

/// Digest selection negotiated in ICReq/ICResp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Digests {
    pub header: bool,
    pub data: bool,
}

impl Digests {
    fn from_byte(b: u8) -> Digests {
        Digests {
            header: b & 1 != 0,
            data: b & 2 != 0,
        }
    }
    fn to_byte(self) -> u8 {
        self.header as u8 | (self.data as u8) << 1
    }
    /// Bytes the header digest adds after a PDU header.
    pub fn hdgst_len(self) -> usize {
        if self.header {
            DIGEST_LEN
        } else {
            0
        }
    }
    /// Bytes the data digest adds after PDU data.
    pub fn ddgst_len(self) -> usize {
        if self.data {
            DIGEST_LEN
        } else {
            0
        }
    }
}

fn check_fixed(what: &'static str, b: &[u8], t: PduType) -> Result<CommonHeader, WireError> {
    let ch = CommonHeader::decode(b)?;
    if ch.pdu_type != t {
        return Err(WireError::bad(what, "PDU-TYPE", ch.pdu_type as u8));
    }
    WireError::check_len(what, b, ch.hlen as usize)?;
    Ok(ch)
}

/// Initialize Connection Request (host to controller).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcReq {
    pub pfv: u16,
    /// Host PDU data alignment, 0's based dwords.
    pub hpda: u8,
    pub digests: Digests,
    /// Maximum outstanding R2Ts per command, 0's based.
    pub maxr2t: u32,
}

impl IcReq {
    pub fn decode(b: &[u8]) -> Result<IcReq, WireError> {
        let ch = check_fixed("ICReq", b, PduType::IcReq)?;
        if ch.plen as usize != IC_PDU_LEN {
            return Err(WireError::bad("ICReq", "PLEN", ch.plen));
        }
        let hpda = b[10];
        if hpda > 31 {
            return Err(WireError::bad("ICReq", "HPDA", hpda));
        }
        Ok(IcReq {
            pfv: u16_at(b, 8),
            hpda,
            digests: Digests::from_byte(b[11]),
            maxr2t: u32_at(b, 12),
        })
    }

    pub fn encode(&self) -> [u8; IC_PDU_LEN] {
        let mut out = [0u8; IC_PDU_LEN];
        ic_header(&mut out, PduType::IcReq);
        put_u16(&mut out, 8, self.pfv);
        out[10] = self.hpda;
        out[11] = self.digests.to_byte();
        put_u32(&mut out, 12, self.maxr2t);
        out
    }
}

/// Initialize Connection Response (controller to host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcResp {
    pub pfv: u16,
    /// Controller PDU data alignment, 0's based dwords.
    pub cpda: u8,
    pub digests: Digests,
    /// Largest DATAL the host may put in one H2CData PDU.
    pub maxh2cdata: u32,
}

impl IcResp {
    pub fn decode(b: &[u8]) -> Result<IcResp, WireError> {
        let ch = check_fixed("ICResp", b, PduType::IcResp)?;
        if ch.plen as usize != IC_PDU_LEN {
            return Err(WireError::bad("ICResp", "PLEN", ch.plen));
        }
        let cpda = b[10];
        if cpda > 31 {
            return Err(WireError::bad("ICResp", "CPDA", cpda));
        }
        let maxh2cdata = u32_at(b, 12);
        if maxh2cdata < 4096 || !maxh2cdata.is_multiple_of(4) {
            return Err(WireError::bad("ICResp", "MAXH2CDATA", maxh2cdata));
        }
        Ok(IcResp {
            pfv: u16_at(b, 8),
            cpda,
            digests: Digests::from_byte(b[11]),
            maxh2cdata,
        })
    }

    pub fn encode(&self) -> [u8; IC_PDU_LEN] {
        let mut out = [0u8; IC_PDU_LEN];
        ic_header(&mut out, PduType::IcResp);
        put_u16(&mut out, 8, self.pfv);
        out[10] = self.cpda;
        out[11] = self.digests.to_byte();
        put_u32(&mut out, 12, self.maxh2cdata);
        out
    }
}

fn ic_header(out: &mut [u8], t: PduType) {
    CommonHeader {
        pdu_type: t,
        flags: 0,
        hlen: IC_PDU_LEN as u8,
        pdo: 0,
        plen: IC_PDU_LEN as u32,
    }
    .encode(out);
}

/// A termination request in either direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TermReq {
    pub fes: u16,
    /// Fatal Error Information: for an invalid header field, its byte offset.
    pub fei: u32,
}

impl TermReq {
    /// Encodes a TermReq of type `t` (H2C or C2H) into `out`, quoting up to
    /// 128 bytes of the offending header. Returns the PDU length.
    pub fn encode(
        &self,
        t: PduType,
        offending: &[u8],
        out: &mut [u8; TERM_HLEN + TERM_DATA_MAX],
    ) -> usize {
        assert!(matches!(t, PduType::H2CTermReq | PduType::C2HTermReq));
        let quoted = offending.len().min(TERM_DATA_MAX);
        let plen = TERM_HLEN + quoted;
        out[..TERM_HLEN].fill(0);
        CommonHeader {
            pdu_type: t,
            flags: 0,
            hlen: TERM_HLEN as u8,
            pdo: 0,
            plen: plen as u32,
        }
        .encode(out);
        put_u16(out, 8, self.fes);
        put_u32(out, 10, self.fei);
        out[TERM_HLEN..plen].copy_from_slice(&offending[..quoted]);
        plen
    }

    pub fn decode(b: &[u8]) -> Result<TermReq, WireError> {
        let ch = CommonHeader::decode(b)?;
        if !matches!(ch.pdu_type, PduType::H2CTermReq | PduType::C2HTermReq) {
            return Err(WireError::bad("TermReq", "PDU-TYPE", ch.pdu_type as u8));
        }
        WireError::check_len("TermReq", b, TERM_HLEN)?;
        if ch.plen as usize > TERM_HLEN + TERM_DATA_MAX {
            return Err(WireError::bad("TermReq", "PLEN", ch.plen));
        }
        Ok(TermReq {
            fes: u16_at(b, 8),
            fei: u32_at(b, 10),
        })
    }
}

/// Fields of an H2CData or C2HData header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    pub cccid: u16,
    /// Transfer tag (H2CData only; reserved in C2HData).
    pub ttag: u16,
    /// Offset of this PDU's data within the command's data.
    pub datao: u32,
    pub datal: u32,
}

impl DataHeader {
    /// Decodes the type-specific part of a data PDU whose common header has
    /// been checked; also checks that the data starts after the header digest
    /// and that PLEN accounts for exactly DATAL bytes.
    pub fn decode(ch: &CommonHeader, b: &[u8], dg: Digests) -> Result<DataHeader, WireError> {
        if !matches!(ch.pdu_type, PduType::H2CData | PduType::C2HData) {
            return Err(WireError::bad("data PDU", "PDU-TYPE", ch.pdu_type as u8));
        }
        WireError::check_len("data PDU", b, DATA_HLEN)?;
        let h = DataHeader {
            cccid: u16_at(b, 8),
            ttag: u16_at(b, 10),
            datao: u32_at(b, 12),
            datal: u32_at(b, 16),
        };
        let data_start = data_offset(ch, dg);
        if data_start < DATA_HLEN + dg.hdgst_len() {
            // PDO points into the header digest.
            return Err(WireError::bad("data PDU", "PDO", ch.pdo));
        }
        let expect = data_start as u64 + h.datal as u64 + dg.ddgst_len() as u64;
        if h.datal == 0 || expect != ch.plen as u64 {
            return Err(WireError::bad("data PDU", "DATAL", h.datal));
        }
        Ok(h)
    }

    /// Encodes a complete data PDU header (CH, PSH and, if negotiated, the
    /// header digest) for `t` into `out`; returns the bytes written.
    /// Data follows immediately, without padding.
    pub fn encode(
        &self,
        t: PduType,
        extra_flags: u8,
        dg: Digests,
        out: &mut [u8; DATA_HLEN + DIGEST_LEN],
    ) -> usize {
        assert!(matches!(t, PduType::H2CData | PduType::C2HData));
        let hd = dg.hdgst_len();
        let pdo = DATA_HLEN + hd;
        let plen = pdo + self.datal as usize + dg.ddgst_len();
        let mut fl = extra_flags;
        if dg.header {
            fl |= flags::HDGSTF;
        }
        if dg.data {
            fl |= flags::DDGSTF;
        }
        CommonHeader {
            pdu_type: t,
            flags: fl,
            hlen: DATA_HLEN as u8,
            pdo: pdo as u8,
            plen: plen as u32,
        }
        .encode(out);
        put_u16(out, 8, self.cccid);
        put_u16(out, 10, if t == PduType::H2CData { self.ttag } else { 0 });
        put_u32(out, 12, self.datao);
        put_u32(out, 16, self.datal);
        put_u32(out, 20, 0);
        finish_header(out, DATA_HLEN, dg)
    }
}

/// Ready to Transfer: the controller asks for a range of write data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct R2t {
    pub cccid: u16,
    pub ttag: u16,
    pub r2to: u32,
    pub r2tl: u32,
}

impl R2t {
    pub fn decode(b: &[u8]) -> Result<R2t, WireError> {
        let _ = check_fixed("R2T", b, PduType::R2T)?;
        let r = R2t {
            cccid: u16_at(b, 8),
            ttag: u16_at(b, 10),
            r2to: u32_at(b, 12),
            r2tl: u32_at(b, 16),
        };
        if r.r2tl == 0 {
            return Err(WireError::bad("R2T", "R2TL", 0u32));
        }
        Ok(r)
    }

    pub fn encode(&self, dg: Digests, out: &mut [u8; R2T_HLEN + DIGEST_LEN]) -> usize {
        let plen = R2T_HLEN + dg.hdgst_len();
        let fl = if dg.header { flags::HDGSTF } else { 0 };
        CommonHeader {
            pdu_type: PduType::R2T,
            flags: fl,
            hlen: R2T_HLEN as u8,
            pdo: 0,
            plen: plen as u32,
        }
        .encode(out);
        put_u16(out, 8, self.cccid);
        put_u16(out, 10, self.ttag);
        put_u32(out, 12, self.r2to);
        put_u32(out, 16, self.r2tl);
        put_u32(out, 20, 0);
        finish_header(out, R2T_HLEN, dg)
    }
}

/// Encodes a CapsuleResp PDU carrying `cqe`; returns the bytes written.
pub fn encode_capsule_resp(
    cqe: &Cqe,
    dg: Digests,
    out: &mut [u8; CAPSULE_RESP_HLEN + DIGEST_LEN],
) -> usize {
    let plen = CAPSULE_RESP_HLEN + dg.hdgst_len();
    let fl = if dg.header { flags::HDGSTF } else { 0 };
    CommonHeader {
        pdu_type: PduType::CapsuleResp,
        flags: fl,
        hlen: CAPSULE_RESP_HLEN as u8,
        pdo: 0,
        plen: plen as u32,
    }
    .encode(out);
    let mut c = [0u8; CQE_LEN];
    cqe.encode(&mut c);
    out[CH_LEN..CAPSULE_RESP_HLEN].copy_from_slice(&c);
    finish_header(out, CAPSULE_RESP_HLEN, dg)
}

/// Decodes the CQE of a CapsuleResp whose header was read (digest checked by the caller).
pub fn decode_capsule_resp(b: &[u8]) -> Result<Cqe, WireError> {
    let _ = check_fixed("CapsuleResp", b, PduType::CapsuleResp)?;
    Cqe::decode(&b[CH_LEN..CAPSULE_RESP_HLEN])
}

/// Encodes a CapsuleCmd header (CH, SQE, header digest) for a command with
/// `icd_len` bytes of in-capsule data; returns the bytes written. The data
/// (and its digest) follow immediately.
pub fn encode_capsule_cmd(
    sqe: &Sqe,
    icd_len: usize,
    dg: Digests,
    out: &mut [u8; CAPSULE_CMD_HLEN + DIGEST_LEN],
) -> usize {
    let hd = dg.hdgst_len();
    let (pdo, plen) = if icd_len == 0 {
        (0, CAPSULE_CMD_HLEN + hd)
    } else {
        (
            CAPSULE_CMD_HLEN + hd,
            CAPSULE_CMD_HLEN + hd + icd_len + dg.ddgst_len(),
        )
    };
    let mut fl = if dg.header { flags::HDGSTF } else { 0 };
    if dg.data && icd_len > 0 {
        fl |= flags::DDGSTF;
    }
    CommonHeader {
        pdu_type: PduType::CapsuleCmd,
        flags: fl,
        hlen: CAPSULE_CMD_HLEN as u8,
        pdo: pdo as u8,
        plen: plen as u32,
    }
    .encode(out);
    out[CH_LEN..CAPSULE_CMD_HLEN].copy_from_slice(&sqe.0);
    finish_header(out, CAPSULE_CMD_HLEN, dg)
}

/// Where the data of a PDU starts: PDO when set, else right after the header
/// and its digest.
pub fn data_offset(ch: &CommonHeader, dg: Digests) -> usize {
    if ch.pdo != 0 {
        ch.pdo as usize
    } else {
        ch.hlen as usize + dg.hdgst_len()
    }
}

fn finish_header(out: &mut [u8], hlen: usize, dg: Digests) -> usize {
    if dg.header {
        let d = crate::digest::crc32c(&out[..hlen]);
        put_u32(out, hlen, d);
        hlen + DIGEST_LEN
    } else {
        hlen
    }
}

/// Verifies the header digest that follows an `hlen`-byte header in `b`.
pub fn header_digest_ok(b: &[u8], hlen: usize) -> bool {
    b.len() >= hlen + DIGEST_LEN && crate::digest::crc32c(&b[..hlen]) == u32_at(b, hlen)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Status;

    #[test]
    fn icreq_matches_the_linux_host_bytes() {
        let r = IcReq {
            pfv: 0,
            hpda: 0,
            digests: Digests::default(),
            maxr2t: 0,
        };
        let b = r.encode();
        assert_eq!(&b[..8], &[0x00, 0x00, 0x80, 0x00, 0x80, 0x00, 0x00, 0x00]);
        assert!(b[8..].iter().all(|&x| x == 0));
        assert_eq!(IcReq::decode(&b).unwrap(), r);
    }

    #[test]
    fn icresp_round_trip_and_checks() {
        let r = IcResp {
            pfv: 0,
            cpda: 0,
            digests: Digests {
                header: true,
                data: true,
            },
            maxh2cdata: 0x20000,
        };
        let b = r.encode();
        assert_eq!(b[11], 3);
        assert_eq!(IcResp::decode(&b).unwrap(), r);
        let mut bad = b;
        put_u32(&mut bad, 12, 100);
        assert!(IcResp::decode(&bad).is_err());
    }

    #[test]
    fn common_header_rejects_wrong_hlen_and_short_plen() {
        let mut b = [0u8; 8];
        CommonHeader {
            pdu_type: PduType::CapsuleCmd,
            flags: 0,
            hlen: 72,
            pdo: 0,
            plen: 72,
        }
        .encode(&mut b);
        assert!(CommonHeader::decode(&b).is_ok());
        b[2] = 71;
        assert!(matches!(
            CommonHeader::decode(&b),
            Err(WireError::BadField { field: "HLEN", .. })
        ));
        b[2] = 72;
        put_u32(&mut b, 4, 10);
        assert!(matches!(
            CommonHeader::decode(&b),
            Err(WireError::BadField { field: "PLEN", .. })
        ));
        b[0] = 0x08;
        assert_eq!(CommonHeader::decode(&b), Err(WireError::UnknownPduType(8)));
    }

    #[test]
    fn capsule_resp_with_header_digest() {
        let mut cqe = Cqe::new(31, Status::LBA_OUT_OF_RANGE);
        cqe.dw0 = 0xAABBCCDD;
        let mut out = [0u8; 28];
        let dg = Digests {
            header: true,
            data: false,
        };
        let n = encode_capsule_resp(&cqe, dg, &mut out);
        assert_eq!(n, 28);
        assert_eq!(out[1], flags::HDGSTF);
        assert!(header_digest_ok(&out, 24));
        assert_eq!(decode_capsule_resp(&out).unwrap(), cqe);
        out[9] ^= 1;
        assert!(!header_digest_ok(&out, 24));
    }

    #[test]
    fn data_header_round_trip() {
        let dg = Digests {
            header: true,
            data: true,
        };
        let h = DataHeader {
            cccid: 5,
            ttag: 9,
            datao: 4096,
            datal: 8192,
        };
        let mut out = [0u8; 28];
        let n = DataHeader::encode(&h, PduType::H2CData, flags::LAST_PDU, dg, &mut out);
        assert_eq!(n, 28);
        let ch = CommonHeader::decode(&out).unwrap();
        assert_eq!(ch.plen, 28 + 8192 + 4);
        assert_eq!(ch.pdo, 28);
        assert_eq!(ch.flags, flags::LAST_PDU | flags::HDGSTF | flags::DDGSTF);
        assert_eq!(DataHeader::decode(&ch, &out, dg).unwrap(), h);
    }

    #[test]
    fn data_header_rejects_pdo_inside_the_header_digest() {
        let dg = Digests {
            header: true,
            data: false,
        };
        let h = DataHeader {
            cccid: 1,
            ttag: 2,
            datao: 0,
            datal: 512,
        };
        let mut out = [0u8; 28];
        h.encode(PduType::C2HData, 0, dg, &mut out);
        // PDO 24 with PLEN shortened to match: the data would overlap HDGST.
        out[3] = 24;
        put_u32(&mut out, 4, 24 + 512);
        let ch = CommonHeader::decode(&out).unwrap();
        let err = DataHeader::decode(&ch, &out, dg);
        assert!(matches!(err, Err(WireError::BadField { field: "PDO", .. })));
        // Without a header digest the same PDO is where the data starts.
        let plain = DataHeader::decode(&ch, &out, Digests::default());
        assert_eq!(plain, Ok(DataHeader { ttag: 0, ..h }));
    }

    #[test]
    fn data_header_rejects_other_pdu_types() {
        let mut out = [0u8; 28];
        R2t {
            cccid: 1,
            ttag: 2,
            r2to: 0,
            r2tl: 512,
        }
        .encode(Digests::default(), &mut out);
        let ch = CommonHeader::decode(&out).unwrap();
        let err = DataHeader::decode(&ch, &out, Digests::default());
        assert!(matches!(
            err,
            Err(WireError::BadField {
                field: "PDU-TYPE",
                ..
            })
        ));
    }

    #[test]
    fn icresp_rejects_cpda_above_31() {
        let r = IcResp {
            pfv: 0,
            cpda: 31,
            digests: Digests::default(),
            maxh2cdata: 4096,
        };
        let mut b = r.encode();
        assert!(IcResp::decode(&b).is_ok());
        b[10] = 32;
        assert!(matches!(
            IcResp::decode(&b),
            Err(WireError::BadField { field: "CPDA", .. })
        ));
    }

    #[test]
    fn term_req_quotes_the_offending_header() {
        let offending = [0xAAu8; 200];
        let mut out = [0u8; 152];
        let n = TermReq {
            fes: fes::INVALID_HEADER_FIELD,
            fei: 2,
        }
        .encode(PduType::C2HTermReq, &offending, &mut out);
        assert_eq!(n, 152);
        let ch = CommonHeader::decode(&out).unwrap();
        assert_eq!(ch.plen, 152);
        assert_eq!(TermReq::decode(&out).unwrap(), TermReq { fes: 1, fei: 2 });
        assert!(out[24..152].iter().all(|&x| x == 0xAA));
    }
}
