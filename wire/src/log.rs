//! Log pages: discovery (70h), SMART / health (02h), error (01h) and
//! changed namespace list (04h).

use crate::le::{put_str_padded, put_u16, put_u32, put_u64, str_in, u16_at, u32_at, u64_at};
use crate::WireError;

/// Log page identifiers.
pub mod lid {
    pub const ERROR: u8 = 0x01;
    pub const SMART: u8 = 0x02;
    pub const FW_SLOT: u8 = 0x03;
    pub const CHANGED_NS: u8 = 0x04;
    pub const COMMANDS_EFFECTS: u8 = 0x05;
    pub const DISCOVERY: u8 = 0x70;
}

/// Get Log Page fields from CDW10..13.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetLogPage {
    pub lid: u8,
    /// Retain Asynchronous Event.
    pub rae: bool,
    /// Bytes requested.
    pub len: u64,
    /// Byte offset into the log.
    pub offset: u64,
}

impl GetLogPage {
    pub fn from_sqe(s: &crate::Sqe) -> GetLogPage {
        let cdw10 = s.cdw(10);
        let numd = ((s.cdw(11) as u64 & 0xFFFF) << 16 | (cdw10 >> 16) as u64) + 1;
        GetLogPage {
            lid: cdw10 as u8,
            rae: cdw10 & (1 << 15) != 0,
            len: numd * 4,
            offset: s.cdw(12) as u64 | (s.cdw(13) as u64) << 32,
        }
    }

    pub fn to_sqe(&self, cid: u16, nsid: u32) -> crate::Sqe {
        let mut s = crate::Sqe::new(crate::sqe::admin::GET_LOG_PAGE, cid);
        s.set_nsid(nsid);
        let numd = self.len / 4 - 1;
        s.set_cdw(
            10,
            self.lid as u32 | (self.rae as u32) << 15 | ((numd as u32) & 0xFFFF) << 16,
        );
        s.set_cdw(11, (numd >> 16) as u32 & 0xFFFF);
        s.set_cdw(12, self.offset as u32);
        s.set_cdw(13, (self.offset >> 32) as u32);
        s.set_sgl(crate::Sgl {
            addr: 0,
            len: self.len as u32,
            id: crate::sqe::sgl_id::TRANSPORT,
        });
        s
    }
}

pub const DISC_HEADER_LEN: usize = 1024;
pub const DISC_ENTRY_LEN: usize = 1024;

/// Transport types.
pub mod trtype {
    pub const RDMA: u8 = 1;
    pub const TCP: u8 = 3;
}
/// Address families.
pub mod adrfam {
    pub const IPV4: u8 = 1;
    pub const IPV6: u8 = 2;
}
/// Discovery entry subsystem types.
pub mod subtype {
    pub const REFERRAL: u8 = 1;
    pub const NVM: u8 = 2;
    pub const CURRENT_DISCOVERY: u8 = 3;
}

/// One discovery log entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryEntry {
    pub trtype: u8,
    pub adrfam: u8,
    pub subtype: u8,
    pub treq: u8,
    pub portid: u16,
    pub cntlid: u16,
    pub asqsz: u16,
    pub trsvcid: String,
    pub subnqn: String,
    pub traddr: String,
    /// TCP security type (TSAS byte 0).
    pub sectype: u8,
}

impl DiscoveryEntry {
    pub fn encode(&self, out: &mut [u8]) {
        let out = &mut out[..DISC_ENTRY_LEN];
        out.fill(0);
        out[0] = self.trtype;
        out[1] = self.adrfam;
        out[2] = self.subtype;
        out[3] = self.treq;
        put_u16(out, 4, self.portid);
        put_u16(out, 6, self.cntlid);
        put_u16(out, 8, self.asqsz);
        put_str_padded(&mut out[32..64], &self.trsvcid, b' ');
        put_str_padded(&mut out[256..511], &self.subnqn, 0);
        put_str_padded(&mut out[512..767], &self.traddr, 0);
        out[768] = self.sectype;
    }

    pub fn decode(b: &[u8]) -> Result<DiscoveryEntry, WireError> {
        WireError::check_len("discovery entry", b, DISC_ENTRY_LEN)?;
        let s = |r: std::ops::Range<usize>, f| {
            str_in(&b[r])
                .map(str::to_owned)
                .ok_or(WireError::BadString {
                    what: "discovery entry",
                    field: f,
                })
        };
        Ok(DiscoveryEntry {
            trtype: b[0],
            adrfam: b[1],
            subtype: b[2],
            treq: b[3],
            portid: u16_at(b, 4),
            cntlid: u16_at(b, 6),
            asqsz: u16_at(b, 8),
            trsvcid: s(32..64, "TRSVCID")?,
            // The last byte of each 256-byte field is left for the NUL that
            // `encode` always writes; read the same 255-byte window.
            subnqn: s(256..511, "SUBNQN")?,
            traddr: s(512..767, "TRADDR")?,
            sectype: b[768],
        })
    }
}

/// Builds the whole discovery log (header + entries) into `out`.
pub fn encode_discovery_log(genctr: u64, entries: &[DiscoveryEntry], out: &mut Vec<u8>) {
    out.clear();
    out.resize(DISC_HEADER_LEN + entries.len() * DISC_ENTRY_LEN, 0);
    put_u64(out, 0, genctr);
    put_u64(out, 8, entries.len() as u64);
    put_u16(out, 16, 0);
    for (i, e) in entries.iter().enumerate() {
        let off = DISC_HEADER_LEN + i * DISC_ENTRY_LEN;
        e.encode(&mut out[off..off + DISC_ENTRY_LEN]);
    }
}

/// Header of the discovery log: (GENCTR, NUMREC).
pub fn decode_discovery_header(b: &[u8]) -> Result<(u64, u64), WireError> {
    WireError::check_len("discovery log header", b, 16)?;
    Ok((u64_at(b, 0), u64_at(b, 8)))
}

pub const SMART_LEN: usize = 512;

/// The SMART / Health log fields a fabrics target can report honestly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SmartLog {
    pub critical_warning: u8,
    /// Kelvin.
    pub temperature: u16,
    pub available_spare: u8,
    pub spare_threshold: u8,
    /// Thousands of 512-byte units.
    pub data_units_read: u64,
    pub data_units_written: u64,
    pub host_read_commands: u64,
    pub host_write_commands: u64,
    pub power_on_hours: u64,
    pub media_errors: u64,
}

impl SmartLog {
    pub fn encode(&self, out: &mut [u8]) {
        let out = &mut out[..SMART_LEN];
        out.fill(0);
        out[0] = self.critical_warning;
        put_u16(out, 1, self.temperature);
        out[3] = self.available_spare;
        out[4] = self.spare_threshold;
        put_u64(out, 32, self.data_units_read);
        put_u64(out, 48, self.data_units_written);
        put_u64(out, 64, self.host_read_commands);
        put_u64(out, 80, self.host_write_commands);
        put_u64(out, 128, self.power_on_hours);
        put_u64(out, 160, self.media_errors);
    }
}

pub const ERROR_ENTRY_LEN: usize = 64;

/// One Error Information log entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ErrorEntry {
    pub error_count: u64,
    pub sqid: u16,
    pub cid: u16,
    /// Status field as on the wire (phase bit included).
    pub status: u16,
    pub lba: u64,
    pub nsid: u32,
}

impl ErrorEntry {
    pub fn encode(&self, out: &mut [u8]) {
        let out = &mut out[..ERROR_ENTRY_LEN];
        out.fill(0);
        put_u64(out, 0, self.error_count);
        put_u16(out, 8, self.sqid);
        put_u16(out, 10, self.cid);
        put_u16(out, 12, self.status);
        put_u16(out, 14, 0xFFFF); // parameter error location: not applicable
        put_u64(out, 16, self.lba);
        put_u32(out, 24, self.nsid);
    }

    pub fn decode(b: &[u8]) -> Result<ErrorEntry, WireError> {
        WireError::check_len("error log entry", b, ERROR_ENTRY_LEN)?;
        Ok(ErrorEntry {
            error_count: u64_at(b, 0),
            sqid: u16_at(b, 8),
            cid: u16_at(b, 10),
            status: u16_at(b, 12),
            lba: u64_at(b, 16),
            nsid: u32_at(b, 24),
        })
    }
}

pub const CHANGED_NS_LEN: usize = 4096;
/// More than this many changed namespaces are reported as 0xFFFFFFFF.
pub const CHANGED_NS_MAX: usize = 1024;

/// Encodes a Changed Namespace List.
pub fn encode_changed_ns(nsids: &[u32], out: &mut [u8]) {
    let out = &mut out[..CHANGED_NS_LEN];
    out.fill(0);
    if nsids.len() > CHANGED_NS_MAX {
        put_u32(out, 0, 0xFFFF_FFFF);
        return;
    }
    for (i, id) in nsids.iter().enumerate() {
        put_u32(out, i * 4, *id);
    }
}

/// Async event completion DW0 for a Namespace Attribute Changed notice.
pub const AEN_NS_CHANGED: u32 = 0x0004_0002;
/// Async event completion DW0 for a Discovery Log Page Change notice.
pub const AEN_DISCOVERY_CHANGED: u32 = 0x0070_F002;

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> DiscoveryEntry {
        DiscoveryEntry {
            trtype: trtype::TCP,
            adrfam: adrfam::IPV4,
            subtype: subtype::NVM,
            treq: 0x2,
            portid: 1,
            cntlid: 0xFFFF,
            asqsz: 32,
            trsvcid: "4420".into(),
            subnqn: "nqn.2026-11.io.nvpool:a".into(),
            traddr: "127.0.0.1".into(),
            sectype: 0,
        }
    }

    #[test]
    fn discovery_log_layout() {
        let mut v = Vec::new();
        encode_discovery_log(7, &[entry(), entry()], &mut v);
        assert_eq!(v.len(), 3072);
        assert_eq!(decode_discovery_header(&v).unwrap(), (7, 2));
        assert_eq!(&v[1024 + 32..1024 + 36], b"4420");
        assert_eq!(DiscoveryEntry::decode(&v[2048..]).unwrap(), entry());
    }

    #[test]
    fn unterminated_strings_decode_to_what_encode_can_write() {
        let mut b = [0u8; DISC_ENTRY_LEN];
        entry().encode(&mut b);
        b[256..512].fill(b's');
        b[512..768].fill(b'a');
        let e = DiscoveryEntry::decode(&b).unwrap();
        assert_eq!((e.subnqn.len(), e.traddr.len()), (255, 255));
        let mut again = [0u8; DISC_ENTRY_LEN];
        e.encode(&mut again);
        assert_eq!(DiscoveryEntry::decode(&again).unwrap(), e);
    }

    #[test]
    fn get_log_page_round_trip() {
        let g = GetLogPage {
            lid: lid::DISCOVERY,
            rae: true,
            len: 1 << 20,
            offset: 1024,
        };
        assert_eq!(GetLogPage::from_sqe(&g.to_sqe(1, 0)), g);
    }

    #[test]
    fn changed_ns_overflow() {
        let mut b = vec![0u8; CHANGED_NS_LEN];
        encode_changed_ns(&[3, 4], &mut b);
        assert_eq!(u32_at(&b, 0), 3);
        assert_eq!(u32_at(&b, 4), 4);
        assert_eq!(u32_at(&b, 8), 0);
        encode_changed_ns(&vec![1; 2000], &mut b);
        assert_eq!(u32_at(&b, 0), 0xFFFF_FFFF);
    }
}
