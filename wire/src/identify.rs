//! Identify data structures (4096 bytes each): controller (CNS 01h),
//! namespace (CNS 00h), active namespace list (CNS 02h) and namespace
//! identification descriptors (CNS 03h).

use crate::le::{put_str_padded, put_u16, put_u32, put_u64, str_in, u16_at, u32_at, u64_at};
use crate::WireError;

pub const IDENTIFY_LEN: usize = 4096;

/// CNS values.
pub mod cns {
    pub const NAMESPACE: u8 = 0x00;
    pub const CONTROLLER: u8 = 0x01;
    pub const ACTIVE_NS_LIST: u8 = 0x02;
    pub const NS_DESCRIPTORS: u8 = 0x03;
    pub const NVM_NAMESPACE: u8 = 0x05;
    pub const NVM_CONTROLLER: u8 = 0x06;
}

/// Controller types (CNTRLTYPE).
pub mod cntrltype {
    pub const IO: u8 = 1;
    pub const DISCOVERY: u8 = 2;
}

/// The Identify Controller fields nvpool sets or reads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IdentifyController {
    pub vid: u16,
    pub ssvid: u16,
    pub serial: String,
    pub model: String,
    pub firmware: String,
    /// Multi-path I/O and namespace sharing capabilities.
    pub cmic: u8,
    /// Maximum data transfer size, a power of two in units of the minimum page size (4 KiB).
    pub mdts: u8,
    pub cntlid: u16,
    pub ver: u32,
    pub oaes: u32,
    pub ctratt: u32,
    pub cntrltype: u8,
    pub acl: u8,
    pub aerl: u8,
    pub lpa: u8,
    /// Error log page entries, 0's based.
    pub elpe: u8,
    /// Keep-alive granularity, 100 ms units.
    pub kas: u16,
    /// ANA Transition Time: longest a group stays in the change state, seconds.
    pub anatt: u8,
    /// ANA capabilities: bits 0..4 say which states may be reported
    /// (optimized, non-optimized, inaccessible, persistent loss, change).
    pub anacap: u8,
    /// Highest ANAGRPID this controller uses.
    pub anagrpmax: u32,
    /// Number of ANA group IDs supported.
    pub nanagrpid: u32,
    pub sqes: u8,
    pub cqes: u8,
    pub maxcmd: u16,
    pub nn: u32,
    pub oncs: u16,
    pub vwc: u8,
    pub sgls: u32,
    /// Maximum number of allowed namespaces (1..=NN when CMIC bit 3 is set).
    pub mnan: u32,
    pub subnqn: String,
    /// I/O command capsule size in 16-byte units.
    pub ioccsz: u32,
    /// I/O response capsule size in 16-byte units.
    pub iorcsz: u32,
    pub icdoff: u16,
    pub msdbd: u8,
}

/// CMIC bits.
pub mod cmic {
    /// The NVM subsystem may have more than one port.
    pub const MULTI_PORT: u8 = 1 << 0;
    /// The NVM subsystem may have more than one controller.
    pub const MULTI_CONTROLLER: u8 = 1 << 1;
    /// Asymmetric Namespace Access reporting.
    pub const ANA_REPORTING: u8 = 1 << 3;
}

/// ONCS bits.
pub mod oncs {
    pub const DSM: u16 = 1 << 2;
    pub const WRITE_ZEROES: u16 = 1 << 3;
}

impl IdentifyController {
    pub fn encode(&self, out: &mut [u8; IDENTIFY_LEN]) {
        out.fill(0);
        put_u16(out, 0, self.vid);
        put_u16(out, 2, self.ssvid);
        put_str_padded(&mut out[4..24], &self.serial, b' ');
        put_str_padded(&mut out[24..64], &self.model, b' ');
        put_str_padded(&mut out[64..72], &self.firmware, b' ');
        out[76] = self.cmic;
        out[77] = self.mdts;
        put_u16(out, 78, self.cntlid);
        put_u32(out, 80, self.ver);
        put_u32(out, 92, self.oaes);
        put_u32(out, 96, self.ctratt);
        out[111] = self.cntrltype;
        out[258] = self.acl;
        out[259] = self.aerl;
        out[261] = self.lpa;
        out[262] = self.elpe;
        put_u16(out, 320, self.kas);
        out[342] = self.anatt;
        out[343] = self.anacap;
        put_u32(out, 344, self.anagrpmax);
        put_u32(out, 348, self.nanagrpid);
        out[512] = self.sqes;
        out[513] = self.cqes;
        put_u16(out, 514, self.maxcmd);
        put_u32(out, 516, self.nn);
        put_u16(out, 520, self.oncs);
        out[525] = self.vwc;
        put_u32(out, 536, self.sgls);
        put_u32(out, 540, self.mnan);
        put_str_padded(&mut out[768..1023], &self.subnqn, 0);
        put_u32(out, 1792, self.ioccsz);
        put_u32(out, 1796, self.iorcsz);
        put_u16(out, 1800, self.icdoff);
        out[1803] = self.msdbd;
    }

    pub fn decode(b: &[u8]) -> Result<IdentifyController, WireError> {
        WireError::check_len("Identify Controller", b, IDENTIFY_LEN)?;
        let s = |r: std::ops::Range<usize>, f| {
            str_in(&b[r])
                .map(str::to_owned)
                .ok_or(WireError::BadString {
                    what: "Identify Controller",
                    field: f,
                })
        };
        Ok(IdentifyController {
            vid: u16_at(b, 0),
            ssvid: u16_at(b, 2),
            serial: s(4..24, "SN")?,
            model: s(24..64, "MN")?,
            firmware: s(64..72, "FR")?,
            cmic: b[76],
            mdts: b[77],
            cntlid: u16_at(b, 78),
            ver: u32_at(b, 80),
            oaes: u32_at(b, 92),
            ctratt: u32_at(b, 96),
            cntrltype: b[111],
            acl: b[258],
            aerl: b[259],
            lpa: b[261],
            elpe: b[262],
            kas: u16_at(b, 320),
            anatt: b[342],
            anacap: b[343],
            anagrpmax: u32_at(b, 344),
            nanagrpid: u32_at(b, 348),
            sqes: b[512],
            cqes: b[513],
            maxcmd: u16_at(b, 514),
            nn: u32_at(b, 516),
            oncs: u16_at(b, 520),
            vwc: b[525],
            sgls: u32_at(b, 536),
            mnan: u32_at(b, 540),
            // The last byte of the 256-byte field is the terminating NUL;
            // `encode` writes at most 255 bytes, so read the same window.
            subnqn: s(768..1023, "SUBNQN")?,
            ioccsz: u32_at(b, 1792),
            iorcsz: u32_at(b, 1796),
            icdoff: u16_at(b, 1800),
            msdbd: b[1803],
        })
    }
}

/// The Identify Namespace fields nvpool sets or reads. One LBA format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IdentifyNamespace {
    pub nsze: u64,
    pub ncap: u64,
    pub nuse: u64,
    pub nsfeat: u8,
    pub nmic: u8,
    pub dlfeat: u8,
    /// log2 of the LBA data size.
    pub lbads: u8,
    /// Optimal I/O boundary in LBAs (0: none).
    pub noiob: u16,
    /// ANA group the namespace belongs to (0: none).
    pub anagrpid: u32,
    pub nguid: [u8; 16],
    pub eui64: [u8; 8],
}

impl IdentifyNamespace {
    pub fn encode(&self, out: &mut [u8; IDENTIFY_LEN]) {
        out.fill(0);
        put_u64(out, 0, self.nsze);
        put_u64(out, 8, self.ncap);
        put_u64(out, 16, self.nuse);
        out[24] = self.nsfeat;
        out[25] = 0; // NLBAF: one format
        out[26] = 0; // FLBAS: format 0
        out[30] = self.nmic;
        out[33] = self.dlfeat;
        put_u16(out, 46, self.noiob);
        put_u32(out, 92, self.anagrpid);
        out[104..120].copy_from_slice(&self.nguid);
        out[120..128].copy_from_slice(&self.eui64);
        // LBAF0: MS 0, LBADS, RP 0 (best performance).
        out[130] = self.lbads;
    }

    pub fn decode(b: &[u8]) -> Result<IdentifyNamespace, WireError> {
        WireError::check_len("Identify Namespace", b, IDENTIFY_LEN)?;
        let fmt = (b[26] & 0xF) as usize;
        let lbaf = 128 + fmt * 4;
        let mut nguid = [0u8; 16];
        nguid.copy_from_slice(&b[104..120]);
        let mut eui64 = [0u8; 8];
        eui64.copy_from_slice(&b[120..128]);
        Ok(IdentifyNamespace {
            nsze: u64_at(b, 0),
            ncap: u64_at(b, 8),
            nuse: u64_at(b, 16),
            nsfeat: b[24],
            nmic: b[30],
            dlfeat: b[33],
            lbads: b[lbaf + 2],
            noiob: u16_at(b, 46),
            anagrpid: u32_at(b, 92),
            nguid,
            eui64,
        })
    }

    pub fn block_size(&self) -> u64 {
        1u64.checked_shl(self.lbads as u32).unwrap_or(0)
    }
}

/// Encodes an Active Namespace ID list: the NSIDs above `after`, ascending.
pub fn encode_active_ns_list(
    nsids: impl Iterator<Item = u32>,
    after: u32,
    out: &mut [u8; IDENTIFY_LEN],
) {
    out.fill(0);
    for (i, id) in nsids
        .filter(|&n| n > after)
        .take(IDENTIFY_LEN / 4)
        .enumerate()
    {
        put_u32(out, i * 4, id);
    }
}

/// Decodes an Active Namespace ID list (stops at the first zero).
pub fn decode_active_ns_list(b: &[u8]) -> Result<Vec<u32>, WireError> {
    WireError::check_len("Active NS list", b, IDENTIFY_LEN)?;
    let mut v = Vec::new();
    let mut prev = 0;
    for i in 0..IDENTIFY_LEN / 4 {
        let id = u32_at(b, i * 4);
        if id == 0 {
            break;
        }
        if id <= prev {
            return Err(WireError::bad("Active NS list", "NSID order", id));
        }
        prev = id;
        v.push(id);
    }
    Ok(v)
}

/// A namespace identification descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NsId {
    Eui64([u8; 8]),
    Nguid([u8; 16]),
    Uuid([u8; 16]),
    Csi(u8),
}

impl NsId {
    fn kind_len(&self) -> (u8, &[u8]) {
        match self {
            NsId::Eui64(b) => (1, b),
            NsId::Nguid(b) => (2, b),
            NsId::Uuid(b) => (3, b),
            NsId::Csi(b) => (4, std::slice::from_ref(b)),
        }
    }
}

pub fn encode_ns_descriptors(ids: &[NsId], out: &mut [u8; IDENTIFY_LEN]) {
    out.fill(0);
    let mut off = 0;
    for id in ids {
        let (t, v) = id.kind_len();
        out[off] = t;
        out[off + 1] = v.len() as u8;
        out[off + 4..off + 4 + v.len()].copy_from_slice(v);
        off += 4 + v.len();
    }
}

pub fn decode_ns_descriptors(b: &[u8]) -> Result<Vec<NsId>, WireError> {
    WireError::check_len("NS descriptor list", b, IDENTIFY_LEN)?;
    // A descriptor must end inside the 4096-byte structure, whatever follows it.
    let b = &b[..IDENTIFY_LEN];
    let mut v = Vec::new();
    let mut off = 0;
    while off + 4 <= IDENTIFY_LEN {
        let (t, l) = (b[off], b[off + 1] as usize);
        if t == 0 {
            break;
        }
        let body =
            b.get(off + 4..off + 4 + l)
                .ok_or(WireError::bad("NS descriptor", "NIDL", l as u64))?;
        let want = match t {
            1 => 8,
            2 | 3 => 16,
            4 => 1,
            _ => l,
        };
        if l != want {
            return Err(WireError::bad("NS descriptor", "NIDL", l as u64));
        }
        match t {
            1 => v.push(NsId::Eui64(body.try_into().expect("length checked"))),
            2 => v.push(NsId::Nguid(body.try_into().expect("length checked"))),
            3 => v.push(NsId::Uuid(body.try_into().expect("length checked"))),
            4 => v.push(NsId::Csi(body[0])),
            _ => {} // unknown types are skipped, as the spec allows
        }
        off += 4 + l;
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controller_round_trip_and_offsets() {
        let c = IdentifyController {
            serial: "abc".into(),
            model: "nvpool".into(),
            firmware: "0.1.0".into(),
            cmic: 2,
            mdts: 5,
            cntlid: 7,
            ver: 0x10300,
            cntrltype: 1,
            kas: 10,
            sqes: 0x66,
            cqes: 0x44,
            maxcmd: 128,
            nn: 1024,
            oncs: oncs::DSM | oncs::WRITE_ZEROES,
            vwc: 1,
            sgls: 0x0010_0001,
            subnqn: "nqn.2026-11.io.nvpool:x".into(),
            ioccsz: 1028,
            iorcsz: 1,
            msdbd: 1,
            anatt: 10,
            anacap: 0x1F,
            anagrpmax: 1,
            nanagrpid: 2,
            mnan: 1000,
            ..Default::default()
        };
        let mut b = [0u8; IDENTIFY_LEN];
        c.encode(&mut b);
        assert_eq!(&b[4..8], b"abc ");
        assert_eq!(b[77], 5);
        assert_eq!(u16_at(&b, 78), 7);
        assert_eq!(u16_at(&b, 320), 10);
        assert_eq!((b[342], b[343]), (10, 0x1F));
        assert_eq!((u32_at(&b, 344), u32_at(&b, 348)), (1, 2));
        assert_eq!(u32_at(&b, 536), 0x0010_0001);
        assert_eq!(u32_at(&b, 540), 1000);
        assert_eq!(u32_at(&b, 1792), 1028);
        assert_eq!(IdentifyController::decode(&b).unwrap(), c);
    }

    #[test]
    fn namespace_round_trip() {
        let n = IdentifyNamespace {
            nsze: 1 << 21,
            ncap: 1 << 21,
            nuse: 5,
            nmic: 1,
            lbads: 9,
            anagrpid: 0x0102_0304,
            nguid: [3; 16],
            eui64: [4; 8],
            ..Default::default()
        };
        let mut b = [0u8; IDENTIFY_LEN];
        n.encode(&mut b);
        assert_eq!(b[130], 9);
        assert_eq!(&b[92..96], &[4, 3, 2, 1]);
        assert_eq!(IdentifyNamespace::decode(&b).unwrap(), n);
        assert_eq!(n.block_size(), 512);
    }

    #[test]
    fn ns_list_and_descriptors() {
        let mut b = [0u8; IDENTIFY_LEN];
        encode_active_ns_list([1u32, 2, 5, 9].into_iter(), 2, &mut b);
        assert_eq!(decode_active_ns_list(&b).unwrap(), vec![5, 9]);

        let ids = [
            NsId::Uuid([1; 16]),
            NsId::Nguid([2; 16]),
            NsId::Eui64([3; 8]),
            NsId::Csi(0),
        ];
        encode_ns_descriptors(&ids, &mut b);
        assert_eq!(&b[..4], &[3, 16, 0, 0]);
        assert_eq!(decode_ns_descriptors(&b).unwrap(), ids.to_vec());
        b[1] = 15; // a wrong NIDL for a UUID
        assert!(decode_ns_descriptors(&b).is_err());
    }

    #[test]
    fn ns_descriptor_may_not_run_past_4096_bytes() {
        // Unknown descriptors (type 0xFF, skipped) fill the list up to `off`,
        // where an EUI-64 starts that would need 4 bytes past the end.
        let mut b = vec![0u8; IDENTIFY_LEN + 16];
        let off = IDENTIFY_LEN - 8;
        let mut at = 0;
        while at < off {
            let nidl = (off - at - 4).min(255);
            b[at] = 0xFF;
            b[at + 1] = nidl as u8;
            at += 4 + nidl;
        }
        assert_eq!(at, off);
        b[off..off + 4].copy_from_slice(&[1, 8, 0, 0]);
        b[off + 4..].fill(0xEE);
        let err = decode_ns_descriptors(&b);
        assert!(matches!(
            err,
            Err(WireError::BadField { field: "NIDL", .. })
        ));
        assert!(decode_ns_descriptors(&b[..IDENTIFY_LEN]).is_err());
    }

    #[test]
    fn unterminated_subnqn_decodes_to_what_encode_can_write() {
        let mut b = [0u8; IDENTIFY_LEN];
        IdentifyController {
            subnqn: "n".into(),
            ..Default::default()
        }
        .encode(&mut b);
        b[768..1024].fill(b'q');
        let c = IdentifyController::decode(&b).unwrap();
        assert_eq!(c.subnqn.len(), 255);
        let mut again = [0u8; IDENTIFY_LEN];
        c.encode(&mut again);
        assert_eq!(IdentifyController::decode(&again).unwrap(), c);
    }
}
