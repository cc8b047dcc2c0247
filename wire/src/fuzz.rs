//! Fuzz entry points: one per decoder in this crate.
//!
//! The cargo-fuzz targets in `wire/fuzz` call these, and so do the corpus
//! replay (`tests/fuzz_corpus.rs`) and the property tests
//! (`tests/roundtrip.rs`), so every input a fuzzer ever found keeps being
//! checked by a plain `cargo test` on stable.
//!
//! Each entry point hands arbitrary bytes to one decoder. Decoding may fail,
//! but nothing may panic. When decoding succeeds the value is encoded again
//! and the round-trip property of that type is asserted:
//!
//! ```text
//! bytes ──decode──▶ value ──encode──▶ bytes' ──decode──▶ value' == value
//! ```
//!
//! plus, where the encoder writes every field the decoder reads, that those
//! bytes come back unchanged, and that a decoder reads nothing past its
//! structure (what follows is the next PDU or the rest of a buffer). A
//! failing assertion here is a bug in a decoder or in the encoder it pairs
//! with, never in the input.

use crate::cqe::CQE_LEN;
use crate::fabrics::{fctype, ConnectCmd, ConnectData, PropertyCmd, CONNECT_DATA_LEN};
use crate::identify::{
    decode_active_ns_list, decode_ns_descriptors, encode_active_ns_list, encode_ns_descriptors,
    IdentifyController, IdentifyNamespace, IDENTIFY_LEN,
};
use crate::log::{
    decode_discovery_header, encode_discovery_log, AnaLog, DiscoveryEntry, ErrorEntry, GetLogPage,
    ANA_DESC_LEN, ANA_HEADER_LEN, DISC_ENTRY_LEN, DISC_HEADER_LEN, ERROR_ENTRY_LEN,
};
use crate::sqe::{admin, sgl_id, Direction, Sgl, SQE_LEN};
use crate::tcp::{
    data_offset, decode_capsule_resp, encode_capsule_cmd, encode_capsule_resp, flags,
    header_digest_ok, CommonHeader, DataHeader, Digests, IcReq, IcResp, PduType, R2t, TermReq,
    CAPSULE_CMD_HLEN, CAPSULE_RESP_HLEN, CH_LEN, DATA_HLEN, DIGEST_LEN, IC_PDU_LEN, R2T_HLEN,
    TERM_DATA_MAX, TERM_HLEN,
};
use crate::{Cqe, Sqe, Status, NQN_LEN_MAX};
use std::fmt::Debug;

/// One fuzz target.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    /// Entry point name; also the cargo-fuzz target and corpus directory name.
    pub name: &'static str,
    pub run: fn(&[u8]),
    /// Size of a well-formed input: the bytes the decoder reads (for a
    /// TermReq, the longest PDU). Shorter inputs are truncated ones.
    pub input_len: usize,
}

const fn target(name: &'static str, run: fn(&[u8]), input_len: usize) -> Target {
    Target {
        name,
        run,
        input_len,
    }
}

/// Every entry point of this module, in the order they are defined.
pub const TARGETS: &[Target] = &[
    target("common_header", common_header, CH_LEN),
    target("ic_req", ic_req, IC_PDU_LEN),
    target("ic_resp", ic_resp, IC_PDU_LEN),
    target("term_req", term_req, TERM_HLEN + TERM_DATA_MAX),
    target("data_header", data_header, DATA_HLEN + DIGEST_LEN),
    target("r2t", r2t, R2T_HLEN + DIGEST_LEN),
    target("capsule_resp", capsule_resp, CAPSULE_RESP_HLEN + DIGEST_LEN),
    target("cqe", cqe, CQE_LEN),
    target("sqe", sqe, SQE_LEN),
    target("connect_cmd", connect_cmd, SQE_LEN),
    target("connect_data", connect_data, CONNECT_DATA_LEN),
    target("property_cmd", property_cmd, SQE_LEN),
    target("get_log_page", get_log_page, SQE_LEN),
    target("identify_controller", identify_controller, IDENTIFY_LEN),
    target("identify_namespace", identify_namespace, IDENTIFY_LEN),
    target("active_ns_list", active_ns_list, IDENTIFY_LEN),
    target("ns_descriptors", ns_descriptors, IDENTIFY_LEN),
    target("discovery_entry", discovery_entry, DISC_ENTRY_LEN),
    target("discovery_header", discovery_header, DISC_HEADER_LEN),
    target("error_entry", error_entry, ERROR_ENTRY_LEN),
    target("status", status, 2),
    target("ana_log", ana_log, ANA_LOG_FUZZ_LEN),
    target("rdma_cm_request", rdma_cm_request, RDMA_CM_FUZZ_LEN),
    target("auth_message", auth_message, AUTH_FUZZ_LEN),
    target("dhchap_controller", dhchap_controller, AUTH_FUZZ_LEN),
];

/// Input size the authentication targets are exercised around: a Reply
/// with SHA-256 and an ffdhe2048 value.
const AUTH_FUZZ_LEN: usize = crate::auth::DHCHAP_HLEN + 2 * 32 + 256;

/// Input size the `rdma_cm_request` target is exercised around: the 56
/// bytes of private data the CM delivers over RoCE.
const RDMA_CM_FUZZ_LEN: usize = 56;

/// Input size the `ana_log` target is exercised around: a header and two
/// descriptors listing eight NSIDs between them. The log has no fixed size.
const ANA_LOG_FUZZ_LEN: usize = ANA_HEADER_LEN + 2 * ANA_DESC_LEN + 8 * 4;

/// Every digest selection ICReq/ICResp can negotiate.
const DIGEST_CHOICES: [Digests; 4] = [
    Digests {
        header: false,
        data: false,
    },
    Digests {
        header: true,
        data: false,
    },
    Digests {
        header: false,
        data: true,
    },
    Digests {
        header: true,
        data: true,
    },
];

/// Largest in-capsule data length the capsule encoder is exercised with; the
/// encoder's PLEN arithmetic must stay inside `u32` for any value up to it.
const ICD_FUZZ_MAX_BYTES: u32 = 1 << 24;

/// Asserts that `decode` gives the same result on `data` as on its first
/// `len` bytes: bytes past the structure are none of the decoder's business.
fn assert_reads_only<'d, T: PartialEq + Debug>(
    data: &'d [u8],
    len: usize,
    decode: impl Fn(&'d [u8]) -> T,
) {
    if data.len() > len {
        assert_eq!(
            decode(data),
            decode(&data[..len]),
            "decoded past byte {len}"
        );
    }
}

/// [`CommonHeader::decode`]: a valid header re-encodes to the same 8 bytes.
pub fn common_header(data: &[u8]) {
    assert_reads_only(data, CH_LEN, CommonHeader::decode);
    let Ok(ch) = CommonHeader::decode(data) else {
        return;
    };
    assert_eq!(ch.hlen as usize, ch.pdu_type.header_len());
    assert!(ch.plen >= u32::from(ch.hlen));
    assert!(ch.pdo == 0 || (ch.pdo >= ch.hlen && u32::from(ch.pdo) <= ch.plen));
    let mut out = [0u8; CH_LEN];
    ch.encode(&mut out);
    assert_eq!(&out[..], &data[..CH_LEN]);
    assert_eq!(CommonHeader::decode(&out), Ok(ch));
}

/// [`IcReq::decode`].
pub fn ic_req(data: &[u8]) {
    assert_reads_only(data, IC_PDU_LEN, IcReq::decode);
    let Ok(r) = IcReq::decode(data) else { return };
    assert!(r.hpda <= 31);
    let out = r.encode();
    assert_eq!(IcReq::decode(&out), Ok(r));
    assert_eq!(&out[..CH_LEN], &[0x00, 0, 128, 0, 128, 0, 0, 0]);
    assert_ic_fields_kept(&out, data);
}

/// [`IcResp::decode`].
pub fn ic_resp(data: &[u8]) {
    assert_reads_only(data, IC_PDU_LEN, IcResp::decode);
    let Ok(r) = IcResp::decode(data) else { return };
    assert!(r.cpda <= 31);
    assert!(r.maxh2cdata >= 4096 && r.maxh2cdata % 4 == 0);
    let out = r.encode();
    assert_eq!(IcResp::decode(&out), Ok(r));
    assert_eq!(&out[..CH_LEN], &[0x01, 0, 128, 0, 128, 0, 0, 0]);
    assert_ic_fields_kept(&out, data);
}

/// PFV, the alignment byte and MAXR2T/MAXH2CDATA come back as they were;
/// of the DGST byte only its two flags survive. (FLAGS and PDO of the common
/// header are reserved here: the decoder ignores them, the encoder writes 0.)
fn assert_ic_fields_kept(out: &[u8], data: &[u8]) {
    assert_eq!(&out[8..11], &data[8..11]);
    assert_eq!(out[11], data[11] & 0x3);
    assert_eq!(&out[12..16], &data[12..16]);
}

/// [`TermReq::decode`]: re-encoding with the quoted bytes the input carries
/// gives the same request, type and (when the input is complete) PLEN.
pub fn term_req(data: &[u8]) {
    // The quoted header is the caller's to take; the decoder reads 24 bytes.
    assert_reads_only(data, TERM_HLEN, TermReq::decode);
    let Ok(t) = TermReq::decode(data) else { return };
    let ch = CommonHeader::decode(data).expect("TermReq::decode accepted the common header");
    let plen = ch.plen as usize;
    assert!((TERM_HLEN..=TERM_HLEN + TERM_DATA_MAX).contains(&plen));
    let quoted = &data[TERM_HLEN..plen.min(data.len())];
    let mut out = [0u8; TERM_HLEN + TERM_DATA_MAX];
    let n = t.encode(ch.pdu_type, quoted, &mut out);
    assert_eq!(n, TERM_HLEN + quoted.len());
    if data.len() >= plen {
        assert_eq!(n, plen);
    }
    let out = &out[..n];
    assert_eq!(TermReq::decode(out), Ok(t));
    assert_eq!(
        CommonHeader::decode(out).map(|c| c.pdu_type),
        Ok(ch.pdu_type)
    );
    assert_eq!(&out[8..14], &data[8..14]);
    assert_eq!(&out[TERM_HLEN..], quoted);
}

/// [`DataHeader::decode`] on the header the input's first 8 bytes describe,
/// under every digest selection.
pub fn data_header(data: &[u8]) {
    let Ok(ch) = CommonHeader::decode(data) else {
        return;
    };
    for dg in DIGEST_CHOICES {
        assert_reads_only(data, DATA_HLEN, |b| DataHeader::decode(&ch, b, dg));
        let Ok(h) = DataHeader::decode(&ch, data, dg) else {
            continue;
        };
        assert!(matches!(ch.pdu_type, PduType::H2CData | PduType::C2HData));
        assert_ne!(h.datal, 0);
        // Data never overlaps the header or its digest.
        assert!(data_offset(&ch, dg) >= DATA_HLEN + dg.hdgst_len());

        // The encoder puts data right after the header digest, so its PDU is
        // never longer than the input's, and it keeps LAST_PDU and SUCCESS.
        let kept = ch.flags & (flags::LAST_PDU | flags::SUCCESS);
        let mut out = [0u8; DATA_HLEN + DIGEST_LEN];
        let n = h.encode(ch.pdu_type, kept, dg, &mut out);
        assert_eq!(n, DATA_HLEN + dg.hdgst_len());
        let out = &out[..n];
        let ch2 = CommonHeader::decode(out).expect("encoded data PDU header");
        assert_eq!(ch2.pdu_type, ch.pdu_type);
        assert_eq!(ch2.flags & (flags::LAST_PDU | flags::SUCCESS), kept);
        assert_eq!(ch2.flags & flags::HDGSTF != 0, dg.header);
        assert_eq!(ch2.flags & flags::DDGSTF != 0, dg.data);
        assert!(ch2.plen <= ch.plen);
        assert_eq!(header_digest_ok(out, DATA_HLEN), dg.header);
        // TTAG is reserved in C2HData; the encoder writes 0 there.
        let want = match ch.pdu_type {
            PduType::C2HData => DataHeader { ttag: 0, ..h },
            _ => h,
        };
        assert_eq!(DataHeader::decode(&ch2, out, dg), Ok(want));
    }
}

/// [`R2t::decode`], re-encoded under every digest selection.
pub fn r2t(data: &[u8]) {
    assert_reads_only(data, R2T_HLEN, R2t::decode);
    let Ok(r) = R2t::decode(data) else { return };
    assert_ne!(r.r2tl, 0);
    for dg in DIGEST_CHOICES {
        let mut out = [0u8; R2T_HLEN + DIGEST_LEN];
        let n = r.encode(dg, &mut out);
        assert_eq!(n, R2T_HLEN + dg.hdgst_len());
        let out = &out[..n];
        assert_eq!(R2t::decode(out), Ok(r));
        assert_eq!(CommonHeader::decode(out).map(|c| c.plen as usize), Ok(n));
        assert_eq!(header_digest_ok(out, R2T_HLEN), dg.header);
        assert_eq!(&out[8..20], &data[8..20]);
    }
}

/// [`decode_capsule_resp`], re-encoded under every digest selection.
pub fn capsule_resp(data: &[u8]) {
    assert_reads_only(data, CAPSULE_RESP_HLEN, decode_capsule_resp);
    let Ok(c) = decode_capsule_resp(data) else {
        return;
    };
    assert_cqe_round_trips(&c, &data[CH_LEN..CAPSULE_RESP_HLEN]);
    for dg in DIGEST_CHOICES {
        let mut out = [0u8; CAPSULE_RESP_HLEN + DIGEST_LEN];
        let n = encode_capsule_resp(&c, dg, &mut out);
        assert_eq!(n, CAPSULE_RESP_HLEN + dg.hdgst_len());
        let out = &out[..n];
        assert_eq!(decode_capsule_resp(out), Ok(c));
        assert_eq!(CommonHeader::decode(out).map(|h| h.plen as usize), Ok(n));
        assert_eq!(header_digest_ok(out, CAPSULE_RESP_HLEN), dg.header);
    }
}

/// [`Cqe::decode`].
pub fn cqe(data: &[u8]) {
    assert_reads_only(data, CQE_LEN, Cqe::decode);
    let Ok(c) = Cqe::decode(data) else { return };
    assert_cqe_round_trips(&c, &data[..CQE_LEN]);
}

/// Re-encoding gives back `raw` but for the phase tag (status bit 0), which
/// is not kept: it is always 0 on fabrics.
fn assert_cqe_round_trips(c: &Cqe, raw: &[u8]) {
    let mut out = [0u8; CQE_LEN];
    c.encode(&mut out);
    let mut want = [0u8; CQE_LEN];
    want.copy_from_slice(raw);
    want[14] &= !1;
    assert_eq!(out, want);
    assert_eq!(Cqe::decode(&out), Ok(*c));
}

/// [`Sqe::from_slice`] and every accessor, rebuilt through the setters;
/// also the CapsuleCmd header carrying it.
pub fn sqe(data: &[u8]) {
    assert_reads_only(data, SQE_LEN, Sqe::from_slice);
    let Some(s) = Sqe::from_slice(data) else {
        assert!(data.len() < SQE_LEN);
        return;
    };
    assert_eq!(&s.0[..], &data[..SQE_LEN]);
    assert_eq!(Sqe::from_slice(&s.0), Some(s));

    // Accessors that overlap agree with each other.
    assert_eq!(s.fuse(), s.flags() & 0x3);
    assert_eq!(s.psdt(), s.flags() >> 6);
    assert_eq!(s.fctype(), s.nsid() as u8);
    assert_eq!(s.slba(), u64::from(s.cdw(10)) | u64::from(s.cdw(11)) << 32);
    assert_eq!(s.nlb(), s.cdw(12) as u16);
    assert_eq!(s.fua(), s.cdw(12) & (1 << 30) != 0);
    // Bits 1:0 of the opcode, or of FCTYPE for a fabrics command, give the direction.
    let dir_bits = if s.opcode() == admin::FABRICS {
        s.fctype()
    } else {
        s.opcode()
    } & 0x3;
    let want_dir = [
        Direction::None,
        Direction::HostToController,
        Direction::ControllerToHost,
        Direction::Bidirectional,
    ][usize::from(dir_bits)];
    assert_eq!(s.direction(), want_dir);
    let _ = format!("{s:?}");

    // Rebuilt through the setters: MPTR (16..24) has no accessor and set_sgl
    // clears the reserved SGL bytes 36..39; everything else comes back.
    let mut r = Sqe::new(s.opcode(), s.cid());
    r.0[1] = s.flags();
    r.set_nsid(s.nsid());
    r.set_sgl(s.sgl());
    for n in [2, 3, 10, 11, 12, 13, 14, 15] {
        r.set_cdw(n, s.cdw(n));
    }
    let mut want = s;
    want.0[16..24].fill(0);
    want.0[36..39].fill(0);
    assert_eq!(r, want);
    r.set_fctype(s.fctype());
    r.set_slba(s.slba());
    r.set_nlb(s.nlb());
    assert_eq!(r, want);

    // Carried in a CapsuleCmd, with in-capsule data as long as the SGL says.
    let icd_len = s.sgl().len.min(ICD_FUZZ_MAX_BYTES) as usize;
    for dg in DIGEST_CHOICES {
        let mut out = [0u8; CAPSULE_CMD_HLEN + DIGEST_LEN];
        let n = encode_capsule_cmd(&s, icd_len, dg, &mut out);
        assert_eq!(n, CAPSULE_CMD_HLEN + dg.hdgst_len());
        let ch = CommonHeader::decode(&out[..n]).expect("encoded CapsuleCmd header");
        assert_eq!(ch.pdu_type, PduType::CapsuleCmd);
        let data_len = if icd_len == 0 {
            0
        } else {
            icd_len + dg.ddgst_len()
        };
        assert_eq!(ch.plen as usize, n + data_len);
        assert_eq!(usize::from(ch.pdo), if icd_len == 0 { 0 } else { n });
        assert_eq!(ch.flags & flags::DDGSTF != 0, dg.data && icd_len > 0);
        assert_eq!(header_digest_ok(&out[..n], CAPSULE_CMD_HLEN), dg.header);
        assert_eq!(Sqe::from_slice(&out[CH_LEN..CAPSULE_CMD_HLEN]), Some(s));
    }
}

/// [`ConnectCmd::from_sqe`]: the fields survive `to_sqe`, which builds a
/// proper Connect command around them.
pub fn connect_cmd(data: &[u8]) {
    let Some(s) = Sqe::from_slice(data) else {
        return;
    };
    let c = ConnectCmd::from_sqe(&s);
    let r = c.to_sqe(s.cid());
    assert_eq!(ConnectCmd::from_sqe(&r), c);
    assert_eq!(
        (r.opcode(), r.fctype(), r.cid()),
        (admin::FABRICS, fctype::CONNECT, s.cid())
    );
    let icd = Sgl {
        addr: 0,
        len: CONNECT_DATA_LEN as u32,
        id: sgl_id::IN_CAPSULE,
    };
    assert_eq!(r.sgl(), icd);
    assert_eq!(r.direction(), Direction::HostToController);
    // RECFMT, QID, SQSIZE, CATTR; byte 47 is reserved; KATO.
    assert_eq!(&r.0[40..47], &s.0[40..47]);
    assert_eq!(&r.0[48..52], &s.0[48..52]);
    assert_eq!(c.sq_flow_control_disabled(), s.0[46] & 0x4 != 0);
}

/// [`ConnectData::decode`].
pub fn connect_data(data: &[u8]) {
    assert_reads_only(data, CONNECT_DATA_LEN, ConnectData::decode);
    let Ok(d) = ConnectData::decode(data) else {
        return;
    };
    for nqn in [d.subnqn, d.hostnqn] {
        assert!(!nqn.is_empty() && nqn.len() <= NQN_LEN_MAX && !nqn.contains('\0'));
    }
    let out = d.encode();
    assert_eq!(ConnectData::decode(&out), Ok(d));
    // HOSTID and CNTLID, byte for byte.
    assert_eq!(&out[..18], &data[..18]);
}

/// [`PropertyCmd::from_sqe`], rebuilt as both Property Get and Property Set.
pub fn property_cmd(data: &[u8]) {
    let Some(s) = Sqe::from_slice(data) else {
        return;
    };
    let p = PropertyCmd::from_sqe(&s);
    for fct in [fctype::PROPERTY_GET, fctype::PROPERTY_SET] {
        let r = p.to_sqe(s.cid(), fct);
        assert_eq!(PropertyCmd::from_sqe(&r), p);
        assert_eq!(
            (r.opcode(), r.fctype(), r.cid()),
            (admin::FABRICS, fct, s.cid())
        );
        assert_eq!(r.direction(), Direction::None);
        assert_eq!(r.0[40] & 1, s.0[40] & 1);
        assert_eq!(&r.0[44..56], &s.0[44..56]);
    }
}

/// [`GetLogPage::from_sqe`]: NUMD gives a length of whole dwords, at least
/// one, and the fields survive `to_sqe`.
pub fn get_log_page(data: &[u8]) {
    let Some(s) = Sqe::from_slice(data) else {
        return;
    };
    let g = GetLogPage::from_sqe(&s);
    assert!(g.len >= 4 && g.len.is_multiple_of(4) && g.len <= 4u64 << 32);
    let r = g.to_sqe(s.cid(), s.nsid());
    assert_eq!(GetLogPage::from_sqe(&r), g);
    assert_eq!(
        (r.opcode(), r.cid(), r.nsid()),
        (admin::GET_LOG_PAGE, s.cid(), s.nsid())
    );
    if let Ok(len) = u32::try_from(g.len) {
        assert_eq!(r.sgl().len, len);
    }
    // LPOL and LPOU, byte for byte.
    assert_eq!(&r.0[48..56], &s.0[48..56]);
}

/// [`IdentifyController::decode`]. Strings come back as a prefix of their
/// field, without trailing spaces.
pub fn identify_controller(data: &[u8]) {
    assert_reads_only(data, IDENTIFY_LEN, IdentifyController::decode);
    let Ok(c) = IdentifyController::decode(data) else {
        return;
    };
    for (s, field) in [
        (&c.serial, &data[4..24]),
        (&c.model, &data[24..64]),
        (&c.firmware, &data[64..72]),
        (&c.subnqn, &data[768..1024]),
    ] {
        assert!(field.starts_with(s.as_bytes()) && !s.ends_with(' ') && !s.contains('\0'));
    }
    let mut out = [0u8; IDENTIFY_LEN];
    c.encode(&mut out);
    assert_eq!(IdentifyController::decode(&out).as_ref(), Ok(&c));
}

/// [`IdentifyNamespace::decode`] and [`IdentifyNamespace::block_size`].
pub fn identify_namespace(data: &[u8]) {
    assert_reads_only(data, IDENTIFY_LEN, IdentifyNamespace::decode);
    let Ok(n) = IdentifyNamespace::decode(data) else {
        return;
    };
    let want = if n.lbads < 64 { 1u64 << n.lbads } else { 0 };
    assert_eq!(n.block_size(), want);
    let mut out = [0u8; IDENTIFY_LEN];
    n.encode(&mut out);
    assert_eq!(IdentifyNamespace::decode(&out), Ok(n));
    // NSZE, NCAP, NUSE, NSFEAT; ANAGRPID; NGUID and EUI64, byte for byte.
    assert_eq!(&out[..25], &data[..25]);
    assert_eq!(&out[92..96], &data[92..96]);
    assert_eq!(&out[104..128], &data[104..128]);
}

/// [`decode_active_ns_list`]: NSIDs come out non-zero and strictly
/// increasing, and re-encode to the same list, or to its tail when asked
/// for the NSIDs above one of them.
pub fn active_ns_list(data: &[u8]) {
    assert_reads_only(data, IDENTIFY_LEN, decode_active_ns_list);
    let Ok(v) = decode_active_ns_list(data) else {
        return;
    };
    assert!(v.len() <= IDENTIFY_LEN / 4);
    assert!(!v.contains(&0) && v.windows(2).all(|w| w[0] < w[1]));
    let mut out = [0u8; IDENTIFY_LEN];
    encode_active_ns_list(v.iter().copied(), 0, &mut out);
    assert_eq!(&out[..v.len() * 4], &data[..v.len() * 4]);
    assert_eq!(decode_active_ns_list(&out).as_ref(), Ok(&v));
    if let Some(&after) = v.get(v.len() / 2) {
        encode_active_ns_list(v.iter().copied(), after, &mut out);
        assert_eq!(
            decode_active_ns_list(&out).as_deref(),
            Ok(&v[v.len() / 2 + 1..])
        );
    }
}

/// [`decode_ns_descriptors`]: the known descriptors re-encode (packed, the
/// unknown ones dropped) to the same list.
pub fn ns_descriptors(data: &[u8]) {
    assert_reads_only(data, IDENTIFY_LEN, decode_ns_descriptors);
    let Ok(v) = decode_ns_descriptors(data) else {
        return;
    };
    let mut out = [0u8; IDENTIFY_LEN];
    encode_ns_descriptors(&v, &mut out);
    assert_eq!(decode_ns_descriptors(&out).as_ref(), Ok(&v));
}

/// [`DiscoveryEntry::decode`], alone and inside an encoded discovery log.
pub fn discovery_entry(data: &[u8]) {
    assert_reads_only(data, DISC_ENTRY_LEN, DiscoveryEntry::decode);
    let Ok(e) = DiscoveryEntry::decode(data) else {
        return;
    };
    for (s, field) in [
        (&e.trsvcid, &data[32..64]),
        (&e.subnqn, &data[256..512]),
        (&e.traddr, &data[512..768]),
    ] {
        assert!(field.starts_with(s.as_bytes()) && !s.ends_with(' ') && !s.contains('\0'));
    }
    let mut out = [0u8; DISC_ENTRY_LEN];
    e.encode(&mut out);
    assert_eq!(DiscoveryEntry::decode(&out).as_ref(), Ok(&e));
    assert_eq!(&out[..10], &data[..10]);
    assert_eq!(out[768], data[768]);

    let mut log = Vec::new();
    encode_discovery_log(7, std::slice::from_ref(&e), &mut log);
    assert_eq!(decode_discovery_header(&log), Ok((7, 1)));
    assert_eq!(
        DiscoveryEntry::decode(&log[DISC_HEADER_LEN..]).as_ref(),
        Ok(&e)
    );
}

/// [`decode_discovery_header`]: GENCTR and NUMREC are the first 16 bytes,
/// and an encoded log carries GENCTR through.
pub fn discovery_header(data: &[u8]) {
    assert_reads_only(data, 16, decode_discovery_header);
    let Ok((genctr, numrec)) = decode_discovery_header(data) else {
        return;
    };
    assert_eq!(&data[..8], &genctr.to_le_bytes());
    assert_eq!(&data[8..16], &numrec.to_le_bytes());
    let mut log = Vec::new();
    encode_discovery_log(genctr, &[], &mut log);
    assert_eq!(log.len(), DISC_HEADER_LEN);
    assert_eq!(decode_discovery_header(&log), Ok((genctr, 0)));
}

/// [`ErrorEntry::decode`]. Bytes 14..16 (parameter error location) are
/// not decoded; the encoder always writes "not applicable" there.
pub fn error_entry(data: &[u8]) {
    assert_reads_only(data, ERROR_ENTRY_LEN, ErrorEntry::decode);
    let Ok(e) = ErrorEntry::decode(data) else {
        return;
    };
    let mut out = [0u8; ERROR_ENTRY_LEN];
    e.encode(&mut out);
    assert_eq!(ErrorEntry::decode(&out), Ok(e));
    assert_eq!(&out[..14], &data[..14]);
    assert_eq!(&out[16..28], &data[16..28]);
}

/// [`Status::from_wire`] on the first two bytes, little-endian.
pub fn status(data: &[u8]) {
    let Some(&[lo, hi]) = data.get(..2) else {
        return;
    };
    let raw = u16::from_le_bytes([lo, hi]);
    let s = Status::from_wire(raw);
    assert!(s.sct <= 7 && s.crd <= 3);
    assert_eq!(s.to_wire(), raw & !1);
    assert_eq!(Status::from_wire(s.to_wire()), s);
    assert_eq!(s.is_success(), s.sct == 0 && s.sc == 0);
    assert_eq!(s.is_path_error(), s.sct == 3);
    let r = s.retryable();
    assert!(!r.dnr);
    assert_eq!(Status { dnr: s.dnr, ..r }, s);
    let _ = format!("{s} {s:?}");
}

/// [`AnaLog::decode`]: descriptors come out with non-zero ANAGRPIDs and
/// non-zero ascending NSIDs; the decoder reads only up to the end of the
/// last descriptor; re-encoding gives back the header and every
/// descriptor's ANAGRPID, NNSID, CHGCNT and NSIDs byte for byte; and the
/// Return Groups Only form keeps the groups without their lists.
pub fn ana_log(data: &[u8]) {
    let Ok(log) = AnaLog::decode(data) else {
        return;
    };
    let len = log.encoded_len(false);
    assert!(len <= data.len());
    assert_reads_only(data, len, AnaLog::decode);
    for g in &log.groups {
        assert_ne!(g.grpid, 0);
        assert!(g.nsids.first().is_none_or(|&n| n != 0));
        assert!(g.nsids.windows(2).all(|w| w[0] < w[1]));
    }
    let mut out = Vec::new();
    log.encode(false, &mut out);
    assert_eq!(out.len(), len);
    assert_eq!(AnaLog::decode(&out).as_ref(), Ok(&log));
    assert_eq!(&out[..10], &data[..10]);
    let mut off = ANA_HEADER_LEN;
    for g in &log.groups {
        assert_eq!(&out[off..off + 16], &data[off..off + 16]);
        assert_eq!(out[off + 16], data[off + 16] & 0xF);
        let end = off + ANA_DESC_LEN + g.nsids.len() * 4;
        assert_eq!(
            &out[off + ANA_DESC_LEN..end],
            &data[off + ANA_DESC_LEN..end]
        );
        off = end;
    }

    log.encode(true, &mut out);
    assert_eq!(out.len(), log.encoded_len(true));
    assert_eq!(out.len(), ANA_HEADER_LEN + log.groups.len() * ANA_DESC_LEN);
    let groups_only = AnaLog::decode(&out).expect("an encoded RGO log decodes");
    assert_eq!(groups_only.chgcnt, log.chgcnt);
    assert_eq!(groups_only.groups.len(), log.groups.len());
    for (a, b) in groups_only.groups.iter().zip(&log.groups) {
        assert!(a.nsids.is_empty());
        assert_eq!((a.grpid, a.chgcnt, a.state), (b.grpid, b.chgcnt, b.state));
    }
}

/// [`CmRequest::decode`] (RDMA CM connect private data): accepted only
/// from 32 bytes with RECFMT 0, every other input refused with the status
/// the spec gives; the decoder reads the first 10 bytes only, and
/// re-encoding gives them back. The same bytes as an SQE's descriptor 1
/// exercise [`KeyedSgl`]: a keyed descriptor round-trips through `put`.
pub fn rdma_cm_request(data: &[u8]) {
    use crate::rdma::{reject, CmRequest, KeyedSgl, CM_PRIVATE_LEN};
    match CmRequest::decode(data) {
        Ok(r) => {
            assert!(data.len() >= CM_PRIVATE_LEN);
            assert_eq!(r.recfmt, 0);
            assert_eq!(&r.encode()[..10], &data[..10]);
            assert_eq!(CmRequest::decode(&data[..CM_PRIVATE_LEN]), Ok(r));
        }
        Err(sts) if data.len() < CM_PRIVATE_LEN => {
            assert_eq!(sts, reject::INVALID_PRIVATE_DATA_LENGTH)
        }
        Err(sts) => assert_eq!(sts, reject::INVALID_RECFMT),
    }
    let mut sqe = Sqe::default();
    let n = data.len().min(16);
    sqe.0[24..24 + n].copy_from_slice(&data[..n]);
    if let Some(k) = KeyedSgl::of(&sqe) {
        assert!(k.len <= crate::rdma::KEYED_LEN_MAX);
        let mut again = Sqe::default();
        k.put(&mut again);
        assert_eq!(KeyedSgl::of(&again), Some(k));
    }
}

/// [`crate::auth::Message::decode`]: a decoded message re-encodes to bytes
/// that decode to the same message, reads nothing past its own length, and
/// every length it reports stays inside the limits.
pub fn auth_message(data: &[u8]) {
    use crate::auth::{Message, AUTH_MSG_MAX, DHVLEN_MAX, HL_MAX, ID_LIST_MAX};
    let Ok(m) = Message::decode(data) else { return };
    match m {
        Message::Negotiate(n) => {
            assert!(n.hashes.len() <= ID_LIST_MAX && n.dhgroups.len() <= ID_LIST_MAX)
        }
        Message::Challenge(c) => assert!(c.c1.len() <= HL_MAX && c.dhv.len() <= DHVLEN_MAX),
        Message::Reply(r) => {
            assert!(r.r1.len() <= HL_MAX && r.c2.len() == r.r1.len());
            assert!(r.dhv.len() <= DHVLEN_MAX);
        }
        _ => {}
    }
    assert!(m.len() <= AUTH_MSG_MAX);
    let out = m.encode();
    assert_eq!(out.len(), m.len());
    assert_eq!(Message::decode(&out), Ok(m));
    if !matches!(m, Message::Negotiate(_)) {
        // (A Negotiate may carry several descriptors; only its DH-HMAC-CHAP one is kept.)
        assert_eq!(Message::decode(&data[..m.len()]), Ok(m));
    }
}

/// The controller's DH-HMAC-CHAP state machine fed hostile input: the
/// input is cut into Authentication Send payloads (a length byte, then that
/// many bytes times 8), each followed by a Receive. Nothing panics, every
/// Receive answers with a message that decodes, and no input ever
/// authenticates the queue: that needs an R1 made with the host's secret.
pub fn dhchap_controller(data: &[u8]) {
    use crate::auth::Message;
    use crate::dhchap::{CtrlAuth, CtrlPolicy, DhGroup, HashId, Keys, Secret, RANDOM_BYTES};
    let Ok(host) = Secret::new(&[0x5A; 32], Some(HashId::Sha256)) else {
        unreachable!("a 32-byte key is a valid secret")
    };
    let group = match data.first().map(|b| b % 3) {
        Some(1) => DhGroup::Ffdhe2048,
        _ => DhGroup::Null,
    };
    let policy = CtrlPolicy {
        keys: Keys {
            host,
            ctrl: Secret::new(&[0xA5; 32], None).ok(),
        },
        hash: None,
        dhgroup: group,
    };
    let mut c = CtrlAuth::new(
        std::sync::Arc::new(policy),
        "nqn.fuzz:host",
        "nqn.fuzz:subsys",
    );
    let random = [0x37u8; RANDOM_BYTES];
    let mut rest = data.get(1..).unwrap_or_default();
    while let Some((&n, tail)) = rest.split_first() {
        let n = (n as usize * 8).min(tail.len());
        c.on_send(&tail[..n]);
        rest = &tail[n..];
        assert!(!c.authenticated(), "hostile input authenticated the queue");
        let out = c.on_receive(&random);
        assert!(Message::decode(&out).is_ok());
        assert!(!c.authenticated(), "hostile input authenticated the queue");
    }
}
