//! Property tests: every encodable type survives encode → decode unchanged,
//! and no decoder panics on arbitrary bytes or on mutated seeds.
//!
//! Case counts are kept moderate so `cargo test -p nvpool-wire` stays quick;
//! the cargo-fuzz targets in `wire/fuzz` are where long runs belong.

use nvpool_wire::fabrics::{fctype, ConnectCmd, ConnectData, PropertyCmd, CONNECT_DATA_LEN};
use nvpool_wire::fuzz::{Target, TARGETS};
use nvpool_wire::identify::{
    decode_active_ns_list, decode_ns_descriptors, encode_active_ns_list, encode_ns_descriptors,
    IdentifyController, IdentifyNamespace, NsId, IDENTIFY_LEN,
};
use nvpool_wire::log::{
    decode_discovery_header, encode_discovery_log, AnaGroup, AnaLog, AnaState, DiscoveryEntry,
    ErrorEntry, GetLogPage, ANA_DESC_LEN, ANA_HEADER_LEN, DISC_ENTRY_LEN, DISC_HEADER_LEN,
    ERROR_ENTRY_LEN,
};
use nvpool_wire::sqe::{admin, sgl_id, Direction};
use nvpool_wire::tcp::{
    data_offset, decode_capsule_resp, encode_capsule_cmd, encode_capsule_resp, flags,
    header_digest_ok, CommonHeader, DataHeader, Digests, IcReq, IcResp, PduType, R2t, TermReq,
    CAPSULE_CMD_HLEN, CAPSULE_RESP_HLEN, CH_LEN, DATA_HLEN, DIGEST_LEN, R2T_HLEN, TERM_DATA_MAX,
    TERM_HLEN,
};
use nvpool_wire::{Cqe, Sgl, Sqe, Status, NQN_LEN_MAX};
use proptest::collection::{btree_set, vec};
use proptest::prelude::*;
use proptest::sample::{select, Index};
use proptest::test_runner::{Config, TestRunner};

// Only the seeds' bytes are used here, not their file names.
#[allow(dead_code)]
#[path = "support/seeds.rs"]
mod seeds;

/// Cases per round-trip property.
const ROUND_TRIP_CASES: u32 = 512;
/// Cases per "never panics" property, per target.
const NEVER_PANIC_CASES: u32 = 2048;
/// At most this many bytes of a seed are overwritten in one mutated input.
const MUTATIONS_MAX: usize = 8;

// ---------------------------------------------------------------- strategies

fn digests() -> impl Strategy<Value = Digests> {
    (any::<bool>(), any::<bool>()).prop_map(|(header, data)| Digests { header, data })
}

fn pdu_type() -> impl Strategy<Value = PduType> {
    select(vec![
        PduType::IcReq,
        PduType::IcResp,
        PduType::H2CTermReq,
        PduType::C2HTermReq,
        PduType::CapsuleCmd,
        PduType::CapsuleResp,
        PduType::H2CData,
        PduType::C2HData,
        PduType::R2T,
    ])
}

/// Any header `CommonHeader::decode` accepts: the type's HLEN, PLEN at
/// least HLEN, PDO 0 or between HLEN and PLEN.
fn common_header_value() -> impl Strategy<Value = CommonHeader> {
    (pdu_type(), any::<u8>(), any::<u32>(), any::<Option<u8>>()).prop_map(
        |(pdu_type, fl, extra, pdo)| {
            let hlen = pdu_type.header_len() as u8;
            let plen = u32::from(hlen) + extra % (u32::MAX - u32::from(hlen));
            let pdo = match pdo {
                None => 0,
                Some(x) => {
                    let top = plen.min(255) as u8;
                    hlen + x % (top - hlen + 1)
                }
            };
            CommonHeader {
                pdu_type,
                flags: fl,
                hlen,
                pdo,
                plen,
            }
        },
    )
}

fn status_value() -> impl Strategy<Value = Status> {
    (0u8..8, any::<u8>(), 0u8..4, any::<bool>(), any::<bool>()).prop_map(
        |(sct, sc, crd, more, dnr)| Status {
            sct,
            sc,
            crd,
            more,
            dnr,
        },
    )
}

fn cqe_value() -> impl Strategy<Value = Cqe> {
    (
        any::<u32>(),
        any::<u32>(),
        any::<u16>(),
        any::<u16>(),
        any::<u16>(),
        status_value(),
    )
        .prop_map(|(dw0, dw1, sqhd, sqid, cid, status)| Cqe {
            dw0,
            dw1,
            sqhd,
            sqid,
            cid,
            status,
        })
}

/// A valid NQN: 1..=223 bytes of ASCII without NUL.
fn nqn() -> impl Strategy<Value = String> {
    proptest::string::string_regex("[\\x01-\\x7F]{1,223}").expect("NQN regex")
}

/// An Identify / discovery string: ASCII without NUL and without trailing
/// spaces (the decoders trim those), at most `max` bytes.
fn field_string(max: usize) -> impl Strategy<Value = String> {
    proptest::string::string_regex(&format!("[\\x01-\\x7F]{{0,{max}}}"))
        .expect("field regex")
        .prop_map(|s| s.trim_end_matches(' ').to_owned())
}

fn identify_controller_value() -> impl Strategy<Value = IdentifyController> {
    let ids = (
        any::<u16>(),
        any::<u16>(),
        field_string(20),
        field_string(40),
        field_string(8),
    );
    let caps = (
        any::<u8>(),
        any::<u8>(),
        any::<u16>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        any::<u8>(),
        any::<u8>(),
        any::<u8>(),
        any::<u8>(),
        any::<u8>(),
        any::<u16>(),
    );
    let nvm = (
        any::<u8>(),
        any::<u8>(),
        any::<u16>(),
        any::<u32>(),
        any::<u16>(),
        any::<u8>(),
    );
    let fabrics = (
        any::<u32>(),
        field_string(255),
        any::<u32>(),
        any::<u32>(),
        any::<u16>(),
        any::<u8>(),
    );
    let ana = (
        any::<u8>(),
        any::<u8>(),
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
    );
    (ids, caps, nvm, fabrics, ana).prop_map(
        |(
            (vid, ssvid, serial, model, firmware),
            (cmic, mdts, cntlid, ver, oaes, ctratt, cntrltype, acl, aerl, lpa, elpe, kas),
            (sqes, cqes, maxcmd, nn, oncs, vwc),
            (sgls, subnqn, ioccsz, iorcsz, icdoff, msdbd),
            (anatt, anacap, anagrpmax, nanagrpid, mnan),
        )| IdentifyController {
            vid,
            ssvid,
            serial,
            model,
            firmware,
            cmic,
            mdts,
            cntlid,
            ver,
            oaes,
            ctratt,
            cntrltype,
            acl,
            aerl,
            lpa,
            elpe,
            kas,
            sqes,
            cqes,
            maxcmd,
            nn,
            oncs,
            vwc,
            sgls,
            subnqn,
            ioccsz,
            iorcsz,
            icdoff,
            msdbd,
            anatt,
            anacap,
            anagrpmax,
            nanagrpid,
            mnan,
        },
    )
}

fn identify_namespace_value() -> impl Strategy<Value = IdentifyNamespace> {
    (
        (any::<u64>(), any::<u64>(), any::<u64>()),
        (
            any::<u8>(),
            any::<u8>(),
            any::<u8>(),
            any::<u8>(),
            any::<u16>(),
        ),
        (any::<[u8; 16]>(), any::<[u8; 8]>(), any::<u32>()),
    )
        .prop_map(
            |(
                (nsze, ncap, nuse),
                (nsfeat, nmic, dlfeat, lbads, noiob),
                (nguid, eui64, anagrpid),
            )| {
                IdentifyNamespace {
                    nsze,
                    ncap,
                    nuse,
                    nsfeat,
                    nmic,
                    dlfeat,
                    lbads,
                    noiob,
                    anagrpid,
                    nguid,
                    eui64,
                }
            },
        )
}

fn ns_id() -> impl Strategy<Value = NsId> {
    prop_oneof![
        any::<[u8; 8]>().prop_map(NsId::Eui64),
        any::<[u8; 16]>().prop_map(NsId::Nguid),
        any::<[u8; 16]>().prop_map(NsId::Uuid),
        any::<u8>().prop_map(NsId::Csi),
    ]
}

fn discovery_entry_value() -> impl Strategy<Value = DiscoveryEntry> {
    (
        (any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>()),
        (any::<u16>(), any::<u16>(), any::<u16>()),
        (field_string(32), field_string(255), field_string(255)),
        any::<[u8; 3]>(),
    )
        .prop_map(
            |(
                (trtype, adrfam, subtype, treq),
                (portid, cntlid, asqsz),
                (trsvcid, subnqn, traddr),
                tsas,
            )| DiscoveryEntry {
                trtype,
                adrfam,
                subtype,
                treq,
                portid,
                cntlid,
                asqsz,
                trsvcid,
                subnqn,
                traddr,
                tsas,
            },
        )
}

fn error_entry_value() -> impl Strategy<Value = ErrorEntry> {
    (
        any::<u64>(),
        any::<u16>(),
        any::<u16>(),
        any::<u16>(),
        any::<u64>(),
        any::<u32>(),
    )
        .prop_map(|(error_count, sqid, cid, status, lba, nsid)| ErrorEntry {
            error_count,
            sqid,
            cid,
            status,
            lba,
            nsid,
        })
}

fn ana_group() -> impl Strategy<Value = AnaGroup> {
    (
        1u32..,
        any::<u64>(),
        select(AnaState::ALL.to_vec()),
        btree_set(1u32.., 0..=64),
    )
        .prop_map(|(grpid, chgcnt, state, nsids)| AnaGroup {
            grpid,
            chgcnt,
            state,
            nsids: nsids.into_iter().collect(),
        })
}

fn ana_log_value() -> impl Strategy<Value = AnaLog> {
    (any::<u64>(), vec(ana_group(), 0..=8)).prop_map(|(chgcnt, groups)| AnaLog { chgcnt, groups })
}

// ----------------------------------------------------------- round trips

proptest! {
    #![proptest_config(ProptestConfig::with_cases(ROUND_TRIP_CASES))]

    #[test]
    fn common_header_round_trips(ch in common_header_value()) {
        let mut b = [0u8; CH_LEN];
        ch.encode(&mut b);
        prop_assert_eq!(CommonHeader::decode(&b), Ok(ch));
    }

    #[test]
    fn ic_req_round_trips(
        pfv: u16, hpda in 0u8..=31, digests in digests(), maxr2t: u32,
    ) {
        let r = IcReq { pfv, hpda, digests, maxr2t };
        let b = r.encode();
        prop_assert_eq!(&b[..CH_LEN], &[0x00, 0, 128, 0, 128, 0, 0, 0]);
        prop_assert_eq!(IcReq::decode(&b), Ok(r));
    }

    #[test]
    fn ic_resp_round_trips(
        pfv: u16, cpda in 0u8..=31, digests in digests(), dwords in 1024u32..=u32::MAX / 4,
    ) {
        let r = IcResp { pfv, cpda, digests, maxh2cdata: dwords * 4 };
        let b = r.encode();
        prop_assert_eq!(&b[..CH_LEN], &[0x01, 0, 128, 0, 128, 0, 0, 0]);
        prop_assert_eq!(IcResp::decode(&b), Ok(r));
    }

    #[test]
    fn term_req_round_trips(
        fes: u16, fei: u32, h2c: bool, offending in vec(any::<u8>(), 0..=TERM_DATA_MAX + 64),
    ) {
        let t = if h2c { PduType::H2CTermReq } else { PduType::C2HTermReq };
        let req = TermReq { fes, fei };
        let mut out = [0u8; TERM_HLEN + TERM_DATA_MAX];
        let n = req.encode(t, &offending, &mut out);
        let quoted = offending.len().min(TERM_DATA_MAX);
        prop_assert_eq!(n, TERM_HLEN + quoted);
        let ch = CommonHeader::decode(&out).unwrap();
        prop_assert_eq!((ch.pdu_type, ch.plen as usize), (t, n));
        prop_assert_eq!(TermReq::decode(&out[..n]), Ok(req));
        prop_assert_eq!(&out[TERM_HLEN..n], &offending[..quoted]);
    }

    #[test]
    fn data_header_round_trips(
        cccid: u16, ttag: u16, datao: u32, datal in 1u32..=u32::MAX - 32,
        c2h: bool, last: bool, success: bool, dg in digests(),
    ) {
        let t = if c2h { PduType::C2HData } else { PduType::H2CData };
        let extra = if last { flags::LAST_PDU } else { 0 } | if success { flags::SUCCESS } else { 0 };
        let h = DataHeader { cccid, ttag, datao, datal };
        let mut out = [0u8; DATA_HLEN + DIGEST_LEN];
        let n = h.encode(t, extra, dg, &mut out);
        prop_assert_eq!(n, DATA_HLEN + dg.hdgst_len());
        let ch = CommonHeader::decode(&out[..n]).unwrap();
        prop_assert_eq!(ch.pdu_type, t);
        prop_assert_eq!(usize::from(ch.pdo), n);
        prop_assert_eq!(data_offset(&ch, dg), n);
        prop_assert_eq!(ch.plen as u64, (n + dg.ddgst_len()) as u64 + u64::from(datal));
        prop_assert_eq!(ch.flags & (flags::LAST_PDU | flags::SUCCESS), extra);
        prop_assert_eq!(ch.flags & flags::HDGSTF != 0, dg.header);
        prop_assert_eq!(ch.flags & flags::DDGSTF != 0, dg.data);
        prop_assert_eq!(header_digest_ok(&out[..n], DATA_HLEN), dg.header);
        let want = if c2h { DataHeader { ttag: 0, ..h } } else { h };
        prop_assert_eq!(DataHeader::decode(&ch, &out[..n], dg), Ok(want));
    }

    #[test]
    fn r2t_round_trips(
        cccid: u16, ttag: u16, r2to: u32, r2tl in 1u32.., dg in digests(),
    ) {
        let r = R2t { cccid, ttag, r2to, r2tl };
        let mut out = [0u8; R2T_HLEN + DIGEST_LEN];
        let n = r.encode(dg, &mut out);
        prop_assert_eq!(n, R2T_HLEN + dg.hdgst_len());
        prop_assert_eq!(CommonHeader::decode(&out).map(|c| c.plen as usize), Ok(n));
        prop_assert_eq!(header_digest_ok(&out[..n], R2T_HLEN), dg.header);
        prop_assert_eq!(R2t::decode(&out[..n]), Ok(r));
    }

    #[test]
    fn cqe_and_capsule_resp_round_trip(c in cqe_value(), dg in digests()) {
        let mut raw = [0u8; 16];
        c.encode(&mut raw);
        prop_assert_eq!(raw[14] & 1, 0, "phase tag is 0 on fabrics");
        prop_assert_eq!(Cqe::decode(&raw), Ok(c));

        let mut out = [0u8; CAPSULE_RESP_HLEN + DIGEST_LEN];
        let n = encode_capsule_resp(&c, dg, &mut out);
        prop_assert_eq!(n, CAPSULE_RESP_HLEN + dg.hdgst_len());
        prop_assert_eq!(&out[CH_LEN..CAPSULE_RESP_HLEN], &raw[..]);
        prop_assert_eq!(header_digest_ok(&out[..n], CAPSULE_RESP_HLEN), dg.header);
        prop_assert_eq!(decode_capsule_resp(&out[..n]), Ok(c));
    }

    #[test]
    fn sqe_fields_round_trip(
        opcode: u8, fl: u8, cid: u16, nsid: u32,
        addr: u64, len: u32, id: u8, cdws: [u32; 8],
    ) {
        let mut s = Sqe::new(opcode, cid);
        s.0[1] = fl;
        s.set_nsid(nsid);
        s.set_sgl(Sgl { addr, len, id });
        let ns = [2, 3, 10, 11, 12, 13, 14, 15];
        for (n, v) in ns.into_iter().zip(cdws) {
            s.set_cdw(n, v);
        }
        prop_assert_eq!((s.opcode(), s.flags(), s.cid(), s.nsid()), (opcode, fl, cid, nsid));
        prop_assert_eq!((s.fuse(), s.psdt(), s.fctype()), (fl & 3, fl >> 6, nsid as u8));
        prop_assert_eq!(s.sgl(), Sgl { addr, len, id });
        for (n, v) in ns.into_iter().zip(cdws) {
            prop_assert_eq!(s.cdw(n), v);
        }
        prop_assert_eq!(s.slba(), u64::from(cdws[2]) | u64::from(cdws[3]) << 32);
        prop_assert_eq!(s.nlb(), cdws[4] as u16);
        prop_assert_eq!(s.fua(), cdws[4] & 1 << 30 != 0);
        prop_assert_eq!(Sqe::from_slice(&s.0), Some(s));
    }

    #[test]
    fn sqe_io_fields_round_trip(opcode: u8, slba: u64, nlb: u16, fct: u8) {
        let mut s = Sqe::new(opcode, 1);
        s.set_slba(slba);
        s.set_nlb(nlb);
        prop_assert_eq!((s.slba(), s.nlb()), (slba, nlb));
        s.set_fctype(fct);
        prop_assert_eq!(s.fctype(), fct);
        let bits = if opcode == admin::FABRICS { fct } else { opcode } & 3;
        let want = [
            Direction::None,
            Direction::HostToController,
            Direction::ControllerToHost,
            Direction::Bidirectional,
        ][usize::from(bits)];
        prop_assert_eq!(s.direction(), want);
    }

    #[test]
    fn capsule_cmd_carries_the_sqe(
        opcode: u8, cid: u16, nsid: u32, icd_len in 0usize..=1 << 20, dg in digests(),
    ) {
        let mut s = Sqe::new(opcode, cid);
        s.set_nsid(nsid);
        let mut out = [0u8; CAPSULE_CMD_HLEN + DIGEST_LEN];
        let n = encode_capsule_cmd(&s, icd_len, dg, &mut out);
        prop_assert_eq!(n, CAPSULE_CMD_HLEN + dg.hdgst_len());
        let ch = CommonHeader::decode(&out[..n]).unwrap();
        prop_assert_eq!(ch.pdu_type, PduType::CapsuleCmd);
        if icd_len == 0 {
            prop_assert_eq!((ch.pdo, ch.plen as usize), (0, n));
        } else {
            prop_assert_eq!(usize::from(ch.pdo), n);
            prop_assert_eq!(ch.plen as usize, n + icd_len + dg.ddgst_len());
        }
        prop_assert_eq!(ch.flags & flags::DDGSTF != 0, dg.data && icd_len > 0);
        prop_assert_eq!(header_digest_ok(&out[..n], CAPSULE_CMD_HLEN), dg.header);
        prop_assert_eq!(Sqe::from_slice(&out[CH_LEN..]), Some(s));
    }

    #[test]
    fn connect_cmd_round_trips(
        recfmt: u16, qid: u16, sqsize: u16, cattr: u8, kato_ms: u32, cid: u16,
    ) {
        let c = ConnectCmd { recfmt, qid, sqsize, cattr, kato_ms };
        let s = c.to_sqe(cid);
        prop_assert_eq!((s.opcode(), s.fctype(), s.cid()), (admin::FABRICS, fctype::CONNECT, cid));
        prop_assert_eq!(
            s.sgl(),
            Sgl { addr: 0, len: CONNECT_DATA_LEN as u32, id: sgl_id::IN_CAPSULE }
        );
        prop_assert_eq!(ConnectCmd::from_sqe(&s), c);
        prop_assert_eq!(c.sq_flow_control_disabled(), cattr & 4 != 0);
    }

    #[test]
    fn connect_data_round_trips(
        hostid: [u8; 16], cntlid: u16, subnqn in nqn(), hostnqn in nqn(),
    ) {
        prop_assert!(subnqn.len() <= NQN_LEN_MAX && hostnqn.len() <= NQN_LEN_MAX);
        let d = ConnectData { hostid, cntlid, subnqn: &subnqn, hostnqn: &hostnqn };
        let b = d.encode();
        prop_assert_eq!(b[256 + subnqn.len()], 0, "SUBNQN is NUL-terminated");
        prop_assert_eq!(b[512 + hostnqn.len()], 0, "HOSTNQN is NUL-terminated");
        prop_assert_eq!(ConnectData::decode(&b), Ok(d));
    }

    #[test]
    fn property_cmd_round_trips(
        size8: bool, offset: u32, value: u64, cid: u16, set: bool,
    ) {
        let fct = if set { fctype::PROPERTY_SET } else { fctype::PROPERTY_GET };
        let p = PropertyCmd { size8, offset, value };
        let s = p.to_sqe(cid, fct);
        prop_assert_eq!((s.opcode(), s.fctype(), s.cid()), (admin::FABRICS, fct, cid));
        prop_assert_eq!(s.direction(), Direction::None);
        prop_assert_eq!(PropertyCmd::from_sqe(&s), p);
    }

    #[test]
    fn get_log_page_round_trips(
        lid: u8, rae: bool, numd in 0u64..=u64::from(u32::MAX), offset: u64, cid: u16, nsid: u32,
    ) {
        let g = GetLogPage { lid, rae, len: (numd + 1) * 4, offset };
        let s = g.to_sqe(cid, nsid);
        prop_assert_eq!((s.opcode(), s.cid(), s.nsid()), (admin::GET_LOG_PAGE, cid, nsid));
        prop_assert_eq!(GetLogPage::from_sqe(&s), g);
    }

    #[test]
    fn identify_controller_round_trips(c in identify_controller_value()) {
        let mut b = [0u8; IDENTIFY_LEN];
        c.encode(&mut b);
        prop_assert_eq!(b[1023], 0, "SUBNQN is NUL-terminated");
        prop_assert_eq!(IdentifyController::decode(&b), Ok(c));
    }

    #[test]
    fn identify_namespace_round_trips(n in identify_namespace_value()) {
        let mut b = [0u8; IDENTIFY_LEN];
        n.encode(&mut b);
        prop_assert_eq!(IdentifyNamespace::decode(&b), Ok(n));
        let want = if n.lbads < 64 { 1u64 << n.lbads } else { 0 };
        prop_assert_eq!(n.block_size(), want);
    }

    #[test]
    fn active_ns_list_round_trips(
        ids in btree_set(1u32.., 0..=IDENTIFY_LEN / 4), after: Index,
    ) {
        let ids: Vec<u32> = ids.into_iter().collect();
        let mut b = [0u8; IDENTIFY_LEN];
        encode_active_ns_list(ids.iter().copied(), 0, &mut b);
        prop_assert_eq!(decode_active_ns_list(&b), Ok(ids.clone()));
        // Asking for the NSIDs above one of them returns the rest.
        if !ids.is_empty() {
            let i = after.index(ids.len());
            encode_active_ns_list(ids.iter().copied(), ids[i], &mut b);
            prop_assert_eq!(decode_active_ns_list(&b), Ok(ids[i + 1..].to_vec()));
        }
    }

    #[test]
    fn active_ns_list_keeps_the_first_1024(ids in btree_set(1u32.., 1025..=1100)) {
        let ids: Vec<u32> = ids.into_iter().collect();
        let mut b = [0u8; IDENTIFY_LEN];
        encode_active_ns_list(ids.iter().copied(), 0, &mut b);
        prop_assert_eq!(decode_active_ns_list(&b), Ok(ids[..IDENTIFY_LEN / 4].to_vec()));
    }

    #[test]
    fn ns_descriptors_round_trip(ids in vec(ns_id(), 0..=64)) {
        let mut b = [0u8; IDENTIFY_LEN];
        encode_ns_descriptors(&ids, &mut b);
        prop_assert_eq!(decode_ns_descriptors(&b), Ok(ids));
    }

    #[test]
    fn discovery_log_round_trips(
        genctr: u64, entries in vec(discovery_entry_value(), 0..=3),
    ) {
        let mut log = Vec::new();
        encode_discovery_log(genctr, &entries, &mut log);
        prop_assert_eq!(log.len(), DISC_HEADER_LEN + entries.len() * DISC_ENTRY_LEN);
        prop_assert_eq!(decode_discovery_header(&log), Ok((genctr, entries.len() as u64)));
        for (i, e) in entries.iter().enumerate() {
            let off = DISC_HEADER_LEN + i * DISC_ENTRY_LEN;
            prop_assert_eq!(&DiscoveryEntry::decode(&log[off..off + DISC_ENTRY_LEN])?, e);
        }
    }

    #[test]
    fn error_entry_round_trips(e in error_entry_value()) {
        let mut b = [0u8; ERROR_ENTRY_LEN];
        e.encode(&mut b);
        prop_assert_eq!(&b[14..16], &[0xFF, 0xFF], "parameter error location: not applicable");
        prop_assert_eq!(ErrorEntry::decode(&b), Ok(e));
    }

    #[test]
    fn ana_log_round_trips(log in ana_log_value(), pad in 0usize..=64) {
        let mut b = Vec::new();
        log.encode(false, &mut b);
        let nsids: usize = log.groups.iter().map(|g| g.nsids.len()).sum();
        prop_assert_eq!(b.len(), ANA_HEADER_LEN + log.groups.len() * ANA_DESC_LEN + nsids * 4);
        // A host reads a fixed length; the zero fill after the log is ignored.
        b.resize(b.len() + pad, 0);
        prop_assert_eq!(AnaLog::decode(&b), Ok(log.clone()));
        // Return Groups Only: the same groups, no NSID lists.
        log.encode(true, &mut b);
        prop_assert_eq!(b.len(), ANA_HEADER_LEN + log.groups.len() * ANA_DESC_LEN);
        let want = AnaLog {
            chgcnt: log.chgcnt,
            groups: log
                .groups
                .iter()
                .map(|g| AnaGroup { nsids: Vec::new(), ..g.clone() })
                .collect(),
        };
        prop_assert_eq!(AnaLog::decode(&b), Ok(want));
    }

    #[test]
    fn status_round_trips(s in status_value(), raw: u16) {
        prop_assert_eq!(s.to_wire() & 1, 0, "phase tag is 0 on fabrics");
        prop_assert_eq!(Status::from_wire(s.to_wire()), s);
        prop_assert_eq!(Status::from_wire(raw).to_wire(), raw & !1);
    }
}

// ------------------------------------------------------ never panics

/// Bytes for `t`: arbitrary ones around its input size, or one of its seeds
/// with a few bytes overwritten and perhaps cut short.
fn inputs_for(t: &Target) -> BoxedStrategy<Vec<u8>> {
    let seeds: Vec<Vec<u8>> = seeds::all()
        .into_iter()
        .filter(|s| s.target == t.name)
        .map(|s| s.bytes)
        .collect();
    assert!(!seeds.is_empty(), "no seeds for target {}", t.name);
    let len = t.input_len;
    let mutated = (
        select(seeds),
        vec((any::<Index>(), any::<u8>()), 1..=MUTATIONS_MAX),
        any::<Option<Index>>(),
    )
        .prop_map(|(mut b, edits, cut)| {
            if !b.is_empty() {
                for (at, v) in edits {
                    let i = at.index(b.len());
                    b[i] = v;
                }
            }
            if let Some(cut) = cut {
                b.truncate(cut.index(b.len() + 1));
            }
            b
        });
    prop_oneof![
        1 => vec(any::<u8>(), 0..=len + 8),
        1 => vec(any::<u8>(), len..=len + 8),
        4 => mutated,
    ]
    .boxed()
}

fn never_panics(name: &str) {
    let t = TARGETS
        .iter()
        .find(|t| t.name == name)
        .expect("a fuzz target of that name");
    let config = Config {
        cases: NEVER_PANIC_CASES,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let result = runner.run(&inputs_for(t), |bytes| {
        (t.run)(&bytes);
        Ok(())
    });
    if let Err(e) = result {
        panic!("fuzz target {name}: {e}");
    }
}

macro_rules! never_panic_tests {
    ($($name:ident),* $(,)?) => {
        mod never_panics {
            $(
                #[test]
                fn $name() {
                    super::never_panics(stringify!($name));
                }
            )*
        }
        const COVERED: &[&str] = &[$(stringify!($name)),*];
    };
}

never_panic_tests!(
    common_header,
    ic_req,
    ic_resp,
    term_req,
    data_header,
    r2t,
    capsule_resp,
    cqe,
    sqe,
    connect_cmd,
    connect_data,
    property_cmd,
    get_log_page,
    identify_controller,
    identify_namespace,
    active_ns_list,
    ns_descriptors,
    discovery_entry,
    discovery_header,
    error_entry,
    status,
    ana_log,
    rdma_cm_request,
    auth_message,
    dhchap_controller,
);

#[test]
fn every_target_has_a_never_panics_test() {
    let names: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
    assert_eq!(names, COVERED);
}
