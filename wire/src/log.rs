//! Log pages: discovery (70h), SMART / health (02h), error (01h),
//! changed namespace list (04h) and Asymmetric Namespace Access (0Ch).

use crate::le::{put_str_padded, put_u16, put_u32, put_u64, str_in, u16_at, u32_at, u64_at};
use crate::WireError;

/// Log page identifiers.
pub mod lid {
    pub const ERROR: u8 = 0x01;
    pub const SMART: u8 = 0x02;
    pub const FW_SLOT: u8 = 0x03;
    pub const CHANGED_NS: u8 = 0x04;
    pub const COMMANDS_EFFECTS: u8 = 0x05;
    pub const ANA: u8 = 0x0C;
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

    /// The Log Specific Field, CDW10 bits 14:8 (not kept in [`GetLogPage`]:
    /// only the ANA log has one, [`ANA_LSP_RGO`]).
    pub fn lsp(s: &crate::Sqe) -> u8 {
        (s.cdw(10) >> 8) as u8 & 0x7F
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
    /// The first TSAS bytes: on TCP the security type (byte 0); on RDMA
    /// QP type, provider type and connection management ([`crate::rdma::tsas`]).
    pub tsas: [u8; 3],
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
        out[768..771].copy_from_slice(&self.tsas);
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
            tsas: [b[768], b[769], b[770]],
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
/// Async event completion DW0 for an Asymmetric Namespace Access Change
/// notice: type 2h (notice), information 03h, log page 0Ch.
pub const AEN_ANA_CHANGED: u32 = 0x000C_0302;

/// Async Event Configuration (feature 0Bh, CDW11) bits; the same bit
/// positions advertise support in Identify Controller OAES.
pub mod aec {
    /// Namespace Attribute notices.
    pub const NS_ATTR: u32 = 1 << 8;
    /// Asymmetric Namespace Access Change notices.
    pub const ANA_CHANGE: u32 = 1 << 11;
    /// Discovery Log Page Change notices (discovery controllers).
    pub const DISCOVERY: u32 = 1 << 31;
}

// ------------------------------------------------------------ ANA log (0Ch)

/// Header of the ANA log: CHGCNT u64, NUMANAGD u16, 6 reserved bytes.
pub const ANA_HEADER_LEN: usize = 16;
/// Fixed part of one ANA group descriptor: ANAGRPID u32, NNSID u32,
/// CHGCNT u64, state (bits 3:0 of byte 16), 15 reserved bytes; NNSID
/// NSIDs (u32, ascending) follow it.
pub const ANA_DESC_LEN: usize = 32;
/// CDW10 bit 8 of Get Log Page 0Ch (LSP bit 0), Return Groups Only: the
/// descriptors come without NSID lists (NNSID 0).
pub const ANA_LSP_RGO: u8 = 1;

/// Bytes of an ANA log with `groups` descriptors listing `nsids` NSIDs in
/// all. The largest log a controller can return is
/// `ana_log_len(NANAGRPID, MNAN)`: what a host reads.
pub const fn ana_log_len(groups: u64, nsids: u64) -> u64 {
    ANA_HEADER_LEN as u64 + groups * ANA_DESC_LEN as u64 + nsids * 4
}

/// The ANA state of a group as one controller reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum AnaState {
    /// Preferred path.
    Optimized = 0x1,
    /// Usable; a host prefers an optimized path when it has one.
    NonOptimized = 0x2,
    /// I/O fails with [`crate::Status::ANA_INACCESSIBLE`].
    Inaccessible = 0x3,
    /// I/O fails with [`crate::Status::ANA_PERSISTENT_LOSS`].
    PersistentLoss = 0x4,
    /// In transition (at most ANATT seconds); I/O fails with
    /// [`crate::Status::ANA_TRANSITION`].
    Change = 0xF,
}

impl AnaState {
    pub const ALL: [AnaState; 5] = [
        AnaState::Optimized,
        AnaState::NonOptimized,
        AnaState::Inaccessible,
        AnaState::PersistentLoss,
        AnaState::Change,
    ];

    /// The state a descriptor's byte 16 (bits 3:0) encodes, if any.
    pub const fn from_u8(v: u8) -> Option<AnaState> {
        match v {
            0x1 => Some(AnaState::Optimized),
            0x2 => Some(AnaState::NonOptimized),
            0x3 => Some(AnaState::Inaccessible),
            0x4 => Some(AnaState::PersistentLoss),
            0xF => Some(AnaState::Change),
            _ => None,
        }
    }

    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// Optimized or non-optimized: I/O is executed.
    pub const fn is_serving(self) -> bool {
        matches!(self, AnaState::Optimized | AnaState::NonOptimized)
    }

    /// The status an I/O command gets in this state; None when it is served.
    pub const fn io_status(self) -> Option<crate::Status> {
        match self {
            AnaState::Optimized | AnaState::NonOptimized => None,
            AnaState::Inaccessible => Some(crate::Status::ANA_INACCESSIBLE),
            AnaState::PersistentLoss => Some(crate::Status::ANA_PERSISTENT_LOSS),
            AnaState::Change => Some(crate::Status::ANA_TRANSITION),
        }
    }

    /// The name Linux nvmet and nvme-cli use: `optimized`, `non-optimized`,
    /// `inaccessible`, `persistent-loss`, `change`.
    pub const fn name(self) -> &'static str {
        match self {
            AnaState::Optimized => "optimized",
            AnaState::NonOptimized => "non-optimized",
            AnaState::Inaccessible => "inaccessible",
            AnaState::PersistentLoss => "persistent-loss",
            AnaState::Change => "change",
        }
    }

    /// The state [`AnaState::name`] names.
    pub fn from_name(s: &str) -> Option<AnaState> {
        AnaState::ALL.into_iter().find(|a| a.name() == s)
    }
}

impl std::fmt::Display for AnaState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One ANA group descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnaGroup {
    /// ANAGRPID, never 0.
    pub grpid: u32,
    pub chgcnt: u64,
    pub state: AnaState,
    /// NSIDs of the group, ascending; empty in a Return Groups Only log.
    pub nsids: Vec<u32>,
}

/// An Asymmetric Namespace Access log page.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AnaLog {
    pub chgcnt: u64,
    pub groups: Vec<AnaGroup>,
}

impl AnaLog {
    /// Bytes [`AnaLog::encode`] writes.
    pub fn encoded_len(&self, rgo: bool) -> usize {
        let nsids: usize = if rgo {
            0
        } else {
            self.groups.iter().map(|g| g.nsids.len()).sum()
        };
        ANA_HEADER_LEN + self.groups.len() * ANA_DESC_LEN + nsids * 4
    }

    /// Encodes into `out` (cleared first). With `rgo` (Return Groups Only)
    /// every descriptor has NNSID 0 and no NSID list.
    ///
    /// At most 65535 groups fit NUMANAGD, and NSIDs must be non-zero and
    /// ascending: a log breaking either is a bug of the caller.
    pub fn encode(&self, rgo: bool, out: &mut Vec<u8>) {
        let numanagd =
            u16::try_from(self.groups.len()).expect("an ANA log holds at most 65535 groups");
        out.clear();
        out.resize(self.encoded_len(rgo), 0);
        put_u64(out, 0, self.chgcnt);
        put_u16(out, 8, numanagd);
        let mut off = ANA_HEADER_LEN;
        for g in &self.groups {
            assert!(g.grpid != 0, "ANAGRPID 0 is reserved");
            assert!(
                g.nsids.first().is_none_or(|&n| n != 0) && g.nsids.windows(2).all(|w| w[0] < w[1]),
                "NSIDs of ANA group {} are not ascending",
                g.grpid
            );
            let listed = if rgo { &[][..] } else { &g.nsids[..] };
            put_u32(out, off, g.grpid);
            put_u32(out, off + 4, listed.len() as u32);
            put_u64(out, off + 8, g.chgcnt);
            out[off + 16] = g.state.as_u8();
            off += ANA_DESC_LEN;
            for &id in listed {
                put_u32(out, off, id);
                off += 4;
            }
        }
        debug_assert_eq!(off, out.len());
    }

    /// Decodes a log page of at least the header's length; bytes after the
    /// last descriptor (the zero fill up to the length read) are ignored.
    /// Every descriptor must lie inside `b`, have a non-zero ANAGRPID, a
    /// known state and non-zero, ascending NSIDs. Bits 7:4 of the state
    /// byte and the reserved bytes are not checked.
    pub fn decode(b: &[u8]) -> Result<AnaLog, WireError> {
        const WHAT: &str = "ANA log";
        WireError::check_len(WHAT, b, ANA_HEADER_LEN)?;
        let numanagd = u16_at(b, 8) as usize;
        let mut groups = Vec::with_capacity(numanagd.min(b.len() / ANA_DESC_LEN));
        let mut off = ANA_HEADER_LEN;
        for _ in 0..numanagd {
            let need = off + ANA_DESC_LEN;
            WireError::check_len(WHAT, b, need)?;
            let grpid = u32_at(b, off);
            if grpid == 0 {
                return Err(WireError::bad(WHAT, "ANAGRPID", grpid));
            }
            let nnsid = u32_at(b, off + 4) as usize;
            let state = AnaState::from_u8(b[off + 16] & 0xF).ok_or(WireError::bad(
                WHAT,
                "ANA state",
                b[off + 16],
            ))?;
            // The list must fit what was read before anything is allocated
            // for it; saturating, so a huge NNSID cannot wrap.
            let end = nnsid.saturating_mul(4).saturating_add(need);
            WireError::check_len(WHAT, b, end)?;
            let mut nsids = Vec::with_capacity(nnsid);
            let mut prev = 0;
            for i in 0..nnsid {
                let id = u32_at(b, need + i * 4);
                if id <= prev {
                    return Err(WireError::bad(WHAT, "NSID order", id));
                }
                prev = id;
                nsids.push(id);
            }
            groups.push(AnaGroup {
                grpid,
                chgcnt: u64_at(b, off + 8),
                state,
                nsids,
            });
            off = end;
        }
        Ok(AnaLog {
            chgcnt: u64_at(b, 0),
            groups,
        })
    }
}

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
            tsas: [0; 3],
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
        let mut s = GetLogPage { lid: lid::ANA, ..g }.to_sqe(2, u32::MAX);
        assert_eq!(GetLogPage::lsp(&s), 0);
        s.set_cdw(10, s.cdw(10) | 1 << 8);
        assert_eq!(GetLogPage::lsp(&s) & ANA_LSP_RGO, ANA_LSP_RGO);
        assert_eq!(GetLogPage::from_sqe(&s).rae, g.rae, "LSP leaves RAE alone");
    }

    fn ana_log() -> AnaLog {
        AnaLog {
            chgcnt: 9,
            groups: vec![
                AnaGroup {
                    grpid: 1,
                    chgcnt: 7,
                    state: AnaState::Optimized,
                    nsids: vec![1, 2, 5],
                },
                AnaGroup {
                    grpid: 3,
                    chgcnt: 8,
                    state: AnaState::Change,
                    nsids: vec![],
                },
            ],
        }
    }

    #[test]
    fn ana_log_layout_and_round_trip() {
        let log = ana_log();
        let mut b = Vec::new();
        log.encode(false, &mut b);
        assert_eq!(b.len(), 16 + 32 + 12 + 32);
        assert_eq!(u64_at(&b, 0), 9);
        assert_eq!(u16_at(&b, 8), 2);
        assert_eq!((u32_at(&b, 16), u32_at(&b, 20)), (1, 3));
        assert_eq!(u64_at(&b, 24), 7);
        assert_eq!(b[32], 0x01);
        assert_eq!(u32_at(&b, 48), 1);
        assert_eq!(u32_at(&b, 56), 5);
        assert_eq!(b[60 + 16], 0x0F);
        assert_eq!(AnaLog::decode(&b).unwrap(), log);
        // The zero fill a host reads past the last descriptor is ignored.
        b.resize(4096, 0);
        assert_eq!(AnaLog::decode(&b).unwrap(), log);
    }

    #[test]
    fn ana_log_return_groups_only() {
        let mut b = Vec::new();
        ana_log().encode(true, &mut b);
        assert_eq!(b.len(), 16 + 2 * 32);
        let back = AnaLog::decode(&b).unwrap();
        assert!(back.groups.iter().all(|g| g.nsids.is_empty()));
        assert_eq!(back.groups[0].state, AnaState::Optimized);
    }

    #[test]
    fn ana_log_decoder_refuses_bad_logs() {
        let mut good = Vec::new();
        ana_log().encode(false, &mut good);
        for cut in 0..good.len() {
            assert!(AnaLog::decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut b = good.clone();
        put_u32(&mut b, 16, 0);
        assert!(AnaLog::decode(&b).is_err(), "ANAGRPID 0");
        let mut b = good.clone();
        b[32] = 0x05;
        assert!(AnaLog::decode(&b).is_err(), "state 5");
        let mut b = good.clone();
        put_u32(&mut b, 52, 1);
        assert!(AnaLog::decode(&b).is_err(), "NSIDs not ascending");
        let mut b = good.clone();
        put_u32(&mut b, 20, u32::MAX);
        assert!(AnaLog::decode(&b).is_err(), "NNSID past the end");
        let mut b = good;
        put_u16(&mut b, 8, u16::MAX);
        assert!(AnaLog::decode(&b).is_err(), "NUMANAGD past the end");
    }

    #[test]
    fn ana_states() {
        for s in AnaState::ALL {
            assert_eq!(AnaState::from_u8(s.as_u8()), Some(s));
            assert_eq!(AnaState::from_name(s.name()), Some(s));
            assert_eq!(s.is_serving(), s.io_status().is_none());
        }
        assert_eq!(AnaState::from_u8(0), None);
        assert_eq!(
            AnaState::Inaccessible.io_status(),
            Some(crate::Status::ANA_INACCESSIBLE)
        );
        assert_eq!(ana_log_len(1, 1024), 4144);
        assert_eq!(AEN_ANA_CHANGED & 0x7, 2, "a notice");
        assert_eq!((AEN_ANA_CHANGED >> 8) & 0xFF, 3);
        assert_eq!((AEN_ANA_CHANGED >> 16) & 0xFF, u32::from(lid::ANA));
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
