//! Seed inputs for the fuzz targets: valid encodings built with this crate's
//! encoders, and malformed variants of them (truncated, wrong HLEN, bad
//! PLEN, unknown type, bad NIDL, unterminated NQN, ...).
//!
//! `examples/gen_corpus.rs` writes them to `fuzz/corpus/<target>/<name>`;
//! `tests/fuzz_corpus.rs` checks the checked-in files still match, and
//! `tests/roundtrip.rs` mutates them.

use nvpool_wire::auth::{Challenge, Message, Negotiate, Reply as AuthReply, Success1};
use nvpool_wire::fabrics::{fctype, prop, ConnectCmd, ConnectData, PropertyCmd, CONNECT_DATA_LEN};
use nvpool_wire::identify::{
    cntrltype, encode_active_ns_list, encode_ns_descriptors, oncs, IdentifyController,
    IdentifyNamespace, NsId, IDENTIFY_LEN,
};
use nvpool_wire::le::{put_u16, put_u32};
use nvpool_wire::log::{
    adrfam, encode_discovery_log, lid, subtype, trtype, AnaGroup, AnaLog, AnaState, DiscoveryEntry,
    ErrorEntry, GetLogPage, DISC_ENTRY_LEN, ERROR_ENTRY_LEN,
};
use nvpool_wire::sqe::{admin, nvm, sgl_id};
use nvpool_wire::tcp::{
    encode_capsule_cmd, encode_capsule_resp, fes, flags, DataHeader, Digests, IcReq, IcResp,
    PduType, R2t, TermReq, CAPSULE_CMD_HLEN, DIGEST_LEN, TERM_DATA_MAX, TERM_HLEN,
};
use nvpool_wire::{Cqe, Sgl, Sqe, Status, DISCOVERY_NQN};

/// One seed file.
#[derive(Debug, Clone)]
pub struct Seed {
    pub target: &'static str,
    pub name: &'static str,
    pub bytes: Vec<u8>,
}

struct Seeds {
    target: &'static str,
    all: Vec<Seed>,
}

impl Seeds {
    fn add(&mut self, name: &'static str, bytes: impl Into<Vec<u8>>) {
        self.all.push(Seed {
            target: self.target,
            name,
            bytes: bytes.into(),
        });
    }
}

/// Adds the seeds of one target.
type MakeSeeds = fn(&mut Seeds);

/// Every seed, grouped by target in the order of `nvpool_wire::fuzz::TARGETS`.
pub fn all() -> Vec<Seed> {
    let makers: [(&'static str, MakeSeeds); 25] = [
        ("common_header", common_header),
        ("ic_req", ic_req),
        ("ic_resp", ic_resp),
        ("term_req", term_req),
        ("data_header", data_header),
        ("r2t", r2t),
        ("capsule_resp", capsule_resp),
        ("cqe", cqe),
        ("sqe", sqe),
        ("connect_cmd", connect_cmd),
        ("connect_data", connect_data),
        ("property_cmd", property_cmd),
        ("get_log_page", get_log_page),
        ("identify_controller", identify_controller),
        ("identify_namespace", identify_namespace),
        ("active_ns_list", active_ns_list),
        ("ns_descriptors", ns_descriptors),
        ("discovery_entry", discovery_entry),
        ("discovery_header", discovery_header),
        ("error_entry", error_entry),
        ("status", status),
        ("ana_log", ana_log),
        ("rdma_cm_request", rdma_cm_request),
        ("auth_message", auth_message),
        ("dhchap_controller", dhchap_controller),
    ];
    let mut s = Seeds {
        target: "",
        all: Vec::new(),
    };
    for (target, make) in makers {
        s.target = target;
        make(&mut s);
    }
    s.all
}

const BOTH: Digests = Digests {
    header: true,
    data: true,
};
const HEADER_ONLY: Digests = Digests {
    header: true,
    data: false,
};
const NONE: Digests = Digests {
    header: false,
    data: false,
};

/// Bytes 0..8 of a common header.
fn ch(pdu_type: u8, fl: u8, hlen: u8, pdo: u8, plen: u32) -> Vec<u8> {
    let mut b = vec![pdu_type, fl, hlen, pdo, 0, 0, 0, 0];
    put_u32(&mut b, 4, plen);
    b
}

fn set_plen(b: &mut [u8], plen: u32) {
    put_u32(b, 4, plen);
}

fn common_header(s: &mut Seeds) {
    s.add(
        "icreq",
        &IcReq {
            pfv: 0,
            hpda: 0,
            digests: NONE,
            maxr2t: 0,
        }
        .encode()[..8],
    );
    let mut cmd = [0u8; CAPSULE_CMD_HLEN + DIGEST_LEN];
    encode_capsule_cmd(&Sqe::new(nvm::WRITE, 1), 4096, BOTH, &mut cmd);
    s.add("capsule-cmd-icd-digests", &cmd[..8]);
    s.add("c2h-data-last", &c2h_data(flags::LAST_PDU, NONE, 512)[..8]);
    s.add("r2t-hdgst", &r2t_pdu(HEADER_ONLY)[..8]);
    s.add("unknown-type-08", ch(0x08, 0, 24, 0, 24));
    s.add("capsule-cmd-hlen-71", ch(0x04, 0, 71, 0, 72));
    s.add("r2t-plen-below-hlen", ch(0x09, 0, 24, 0, 10));
    s.add("capsule-cmd-pdo-inside-header", ch(0x04, 0, 72, 8, 4168));
    s.add("h2c-data-pdo-past-plen", ch(0x06, 0, 24, 40, 30));
    s.add("truncated-5", &ch(0x00, 0, 128, 0, 128)[..5]);
}

fn ic_req(s: &mut Seeds) {
    let linux = IcReq {
        pfv: 0,
        hpda: 0,
        digests: NONE,
        maxr2t: 0,
    }
    .encode();
    s.add("linux-no-digest", linux);
    s.add(
        "digests-maxr2t-hpda31",
        IcReq {
            pfv: 0,
            hpda: 31,
            digests: BOTH,
            maxr2t: 3,
        }
        .encode(),
    );
    let mut b = linux;
    b[11] = 0xFF;
    s.add("dgst-reserved-bits", b);
    let mut b = linux;
    b[10] = 32;
    s.add("hpda-32", b);
    let mut b = linux.to_vec();
    set_plen(&mut b, 129);
    b.push(0);
    s.add("plen-129", b);
    let mut b = linux;
    b[2] = 24;
    s.add("hlen-24", b);
    s.add("icresp-type", icresp_linux());
    s.add("truncated-127", &linux[..127]);
}

fn icresp_linux() -> [u8; 128] {
    IcResp {
        pfv: 0,
        cpda: 0,
        digests: BOTH,
        maxh2cdata: 0x40_0000,
    }
    .encode()
}

fn ic_resp(s: &mut Seeds) {
    let linux = icresp_linux();
    s.add("linux-target", linux);
    s.add(
        "minimum-cpda31",
        IcResp {
            pfv: 0,
            cpda: 31,
            digests: NONE,
            maxh2cdata: 4096,
        }
        .encode(),
    );
    let mut b = linux;
    put_u32(&mut b, 12, 100);
    s.add("maxh2cdata-100", b);
    put_u32(&mut b, 12, 4098);
    s.add("maxh2cdata-unaligned", b);
    let mut b = linux;
    b[10] = 32;
    s.add("cpda-32", b);
    let mut b = linux;
    set_plen(&mut b, 24);
    s.add("plen-24", b);
    s.add("truncated-64", &linux[..64]);
}

fn term_pdu(t: PduType, offending: &[u8]) -> Vec<u8> {
    let mut out = [0u8; TERM_HLEN + TERM_DATA_MAX];
    let req = TermReq {
        fes: fes::INVALID_HEADER_FIELD,
        fei: 2,
    };
    let n = req.encode(t, offending, &mut out);
    out[..n].to_vec()
}

fn term_req(s: &mut Seeds) {
    let full = term_pdu(PduType::C2HTermReq, &[0xAA; 200]);
    s.add("c2h-quotes-128", full.clone());
    s.add("h2c-no-quote", term_pdu(PduType::H2CTermReq, &[]));
    s.add(
        "c2h-quotes-hlen",
        term_pdu(PduType::C2HTermReq, &r2t_pdu(NONE)),
    );
    let mut b = full.clone();
    set_plen(&mut b, 153);
    b.push(0xAA);
    s.add("plen-153", b);
    s.add("plen-beyond-input", &full[..40]);
    s.add("capsule-resp-type", capsule_resp_pdu(NONE, Status::SUCCESS));
    s.add("truncated-20", &full[..20]);
}

fn c2h_data(extra: u8, dg: Digests, datal: u32) -> Vec<u8> {
    let h = DataHeader {
        cccid: 3,
        ttag: 0,
        datao: 0,
        datal,
    };
    let mut out = [0u8; 28];
    let n = h.encode(PduType::C2HData, extra, dg, &mut out);
    out[..n].to_vec()
}

fn data_header(s: &mut Seeds) {
    let h2c = DataHeader {
        cccid: 5,
        ttag: 9,
        datao: 4096,
        datal: 8192,
    };
    let mut out = [0u8; 28];
    h2c.encode(PduType::H2CData, flags::LAST_PDU, BOTH, &mut out);
    s.add("h2c-digests-last", out);
    let mut b = c2h_data(flags::LAST_PDU | flags::SUCCESS, NONE, 16);
    b.extend_from_slice(&[0x5A; 16]);
    s.add("c2h-success-with-data", b);
    // Eight bytes of padding between header and data.
    let mut b = c2h_data(0, NONE, 512);
    b[3] = 32;
    set_plen(&mut b, 32 + 512);
    s.add("c2h-padded-pdo-32", b);
    s.add("c2h-datal-max", c2h_data(0, NONE, u32::MAX - 24));
    let mut b = c2h_data(0, NONE, 512);
    put_u32(&mut b, 16, 0);
    set_plen(&mut b, 24);
    s.add("datal-0", b);
    let mut b = c2h_data(0, NONE, 512);
    set_plen(&mut b, 24 + 513);
    s.add("plen-mismatch", b);
    // PDO 24 under a negotiated header digest would overlap HDGST.
    let mut b = c2h_data(0, HEADER_ONLY, 512);
    b[3] = 24;
    set_plen(&mut b, 24 + 512);
    s.add("pdo-inside-hdgst", b);
    // An R2T whose R2TL (at the DATAL offset) matches its PLEN: a data PDU
    // in every field but the type.
    let mut r2t = [0u8; 28];
    R2t {
        cccid: 7,
        ttag: 1,
        r2to: 0,
        r2tl: 4,
    }
    .encode(HEADER_ONLY, &mut r2t);
    s.add("r2t-type-datal-fits-plen", r2t);
    s.add("truncated-20", &out[..20]);
}

fn r2t_pdu(dg: Digests) -> Vec<u8> {
    let mut out = [0u8; 28];
    let n = R2t {
        cccid: 7,
        ttag: 1,
        r2to: 0,
        r2tl: 65536,
    }
    .encode(dg, &mut out);
    out[..n].to_vec()
}

fn r2t(s: &mut Seeds) {
    s.add("hdgst", r2t_pdu(HEADER_ONLY));
    s.add("plain", r2t_pdu(NONE));
    let mut b = r2t_pdu(NONE);
    put_u32(&mut b, 16, 0);
    s.add("r2tl-0", b);
    let mut b = r2t_pdu(HEADER_ONLY);
    b[2] = 28;
    s.add("hlen-28", b);
    s.add("c2h-data-type", c2h_data(0, NONE, 512));
    s.add("truncated-23", &r2t_pdu(NONE)[..23]);
}

fn capsule_resp_pdu(dg: Digests, st: Status) -> Vec<u8> {
    let mut c = Cqe::new(31, st);
    c.dw0 = 0xAABB_CCDD;
    c.sqhd = 4;
    let mut out = [0u8; 28];
    let n = encode_capsule_resp(&c, dg, &mut out);
    out[..n].to_vec()
}

fn capsule_resp(s: &mut Seeds) {
    s.add(
        "success-hdgst",
        capsule_resp_pdu(HEADER_ONLY, Status::SUCCESS),
    );
    s.add(
        "lba-out-of-range",
        capsule_resp_pdu(NONE, Status::LBA_OUT_OF_RANGE),
    );
    let mut b = capsule_resp_pdu(NONE, Status::INVALID_FIELD);
    b[8 + 14] |= 1;
    s.add("phase-bit-set", b);
    s.add("r2t-type", r2t_pdu(NONE));
    let mut b = capsule_resp_pdu(NONE, Status::SUCCESS);
    b[2] = 72;
    s.add("hlen-72", b);
    s.add(
        "truncated-23",
        &capsule_resp_pdu(NONE, Status::SUCCESS)[..23],
    );
}

fn cqe_bytes(c: &Cqe) -> [u8; 16] {
    let mut out = [0u8; 16];
    c.encode(&mut out);
    out
}

fn cqe(s: &mut Seeds) {
    s.add("success", cqe_bytes(&Cqe::new(1, Status::SUCCESS)));
    let mut c = Cqe::new(0, Status::CONNECT_INVALID_PARAMETERS);
    c.dw0 = 1 << 16 | 256; // IATTR 1: in the Connect data; IPO 256: SUBNQN
    s.add("connect-invalid-parameters", cqe_bytes(&c));
    s.add("all-ones", [0xFF; 16]);
    s.add(
        "truncated-15",
        &cqe_bytes(&Cqe::new(1, Status::SUCCESS))[..15],
    );
}

fn read_sqe() -> Sqe {
    let mut s = Sqe::new(nvm::READ, 0x1234);
    s.set_nsid(1);
    s.set_slba(0x10_0000);
    s.set_nlb(7);
    s.set_sgl(Sgl {
        addr: 0,
        len: 8 * 512,
        id: sgl_id::TRANSPORT,
    });
    s
}

fn sqe(s: &mut Seeds) {
    s.add("read", read_sqe().0);
    let mut w = Sqe::new(nvm::WRITE, 2);
    w.set_nsid(1);
    w.set_cdw(12, 1 << 30); // FUA, one block
    w.set_sgl(Sgl {
        addr: 0,
        len: 512,
        id: sgl_id::IN_CAPSULE,
    });
    s.add("write-in-capsule-fua", w.0);
    let connect = ConnectCmd {
        recfmt: 0,
        qid: 0,
        sqsize: 31,
        cattr: 0,
        kato_ms: 5000,
    };
    s.add("connect", connect.to_sqe(0).0);
    s.add("all-ones", [0xFF; 64]);
    let mut b = read_sqe().0.to_vec();
    b.extend_from_slice(&[0xEE; 8]);
    s.add("trailing-bytes", b);
    s.add("truncated-63", &read_sqe().0[..63]);
}

fn connect_cmd(s: &mut Seeds) {
    let admin_q = ConnectCmd {
        recfmt: 0,
        qid: 0,
        sqsize: 31,
        cattr: 0,
        kato_ms: 5000,
    };
    s.add("admin-queue", admin_q.to_sqe(0).0);
    let io_q = ConnectCmd {
        recfmt: 0,
        qid: 3,
        sqsize: 127,
        cattr: 0x4,
        kato_ms: 0,
    };
    s.add("io-queue-no-sq-flow-control", io_q.to_sqe(0x1F).0);
    s.add("all-ones", [0xFF; 64]);
    s.add("truncated-63", &admin_q.to_sqe(0).0[..63]);
}

const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f8e4a42-5c1b-4d2e-9a3b-6c7d8e9f0a1b";
const SUBNQN: &str = "nqn.2026-11.io.nvpool:vol-a";

fn connect_data_bytes(cntlid: u16, subnqn: &str, hostnqn: &str) -> [u8; CONNECT_DATA_LEN] {
    ConnectData {
        hostid: [0x42; 16],
        cntlid,
        subnqn,
        hostnqn,
    }
    .encode()
}

fn connect_data(s: &mut Seeds) {
    let good = connect_data_bytes(0xFFFF, SUBNQN, HOSTNQN);
    s.add("admin", good);
    s.add(
        "discovery",
        connect_data_bytes(0xFFFF, DISCOVERY_NQN, HOSTNQN),
    );
    let long = "n".repeat(223);
    s.add("nqns-223-bytes", connect_data_bytes(7, &long, &long));
    let mut b = good;
    b[256..256 + 224].fill(b'n');
    s.add("subnqn-224-bytes", b);
    let mut b = good;
    b[256..512].fill(b'a');
    s.add("subnqn-unterminated", b);
    let mut b = good;
    b[512..768].fill(0);
    s.add("hostnqn-empty", b);
    let mut b = good;
    b[256..258].copy_from_slice(&[0xFF, 0xFE]);
    s.add("subnqn-bad-utf8", b);
    s.add("truncated-1023", &good[..1023]);
}

fn property_cmd(s: &mut Seeds) {
    let cap = PropertyCmd {
        size8: true,
        offset: prop::CAP,
        value: 0,
    };
    s.add("get-cap-8-bytes", cap.to_sqe(1, fctype::PROPERTY_GET).0);
    let cc = PropertyCmd {
        size8: false,
        offset: prop::CC,
        value: 0x0046_0001,
    };
    s.add("set-cc-enable", cc.to_sqe(2, fctype::PROPERTY_SET).0);
    let csts = PropertyCmd {
        size8: false,
        offset: prop::CSTS,
        value: 0,
    };
    s.add("get-csts", csts.to_sqe(3, fctype::PROPERTY_GET).0);
    s.add("all-ones", [0xFF; 64]);
    s.add("truncated-40", &cap.to_sqe(1, fctype::PROPERTY_GET).0[..40]);
}

fn get_log_page(s: &mut Seeds) {
    let header = GetLogPage {
        lid: lid::DISCOVERY,
        rae: true,
        len: 1024,
        offset: 0,
    };
    s.add("discovery-header", header.to_sqe(1, 0).0);
    let entries = GetLogPage {
        lid: lid::DISCOVERY,
        rae: false,
        len: 4096,
        offset: 1024,
    };
    s.add("discovery-entries", entries.to_sqe(2, 0).0);
    let errors = GetLogPage {
        lid: lid::ERROR,
        rae: false,
        len: 64,
        offset: 0,
    };
    s.add("error-log", errors.to_sqe(3, 0xFFFF_FFFF).0);
    let mut b = Sqe::new(admin::GET_LOG_PAGE, 4);
    b.set_cdw(10, 0xFFFF_0000 | u32::from(lid::SMART));
    b.set_cdw(11, 0xFFFF_FFFF);
    b.set_cdw(12, 0xFFFF_FFFF);
    b.set_cdw(13, 0xFFFF_FFFF);
    s.add("numd-and-offset-max", b.0);
    s.add("truncated-63", &header.to_sqe(1, 0).0[..63]);
}

fn controller() -> IdentifyController {
    IdentifyController {
        vid: 0x1B36,
        ssvid: 0x1B36,
        serial: "nvp-0001".into(),
        model: "nvpool".into(),
        firmware: "0.1.0".into(),
        cmic: 0x2,
        mdts: 5,
        cntlid: 1,
        ver: 0x0001_0300,
        oaes: 1 << 8,
        ctratt: 0,
        cntrltype: cntrltype::IO,
        acl: 3,
        aerl: 3,
        lpa: 0x4,
        elpe: 63,
        kas: 10,
        sqes: 0x66,
        cqes: 0x44,
        maxcmd: 128,
        nn: 1024,
        oncs: oncs::DSM | oncs::WRITE_ZEROES,
        vwc: 1,
        sgls: 0x0010_0001,
        subnqn: SUBNQN.into(),
        ioccsz: 1028,
        iorcsz: 1,
        icdoff: 0,
        msdbd: 1,
        anatt: 0,
        anacap: 0,
        anagrpmax: 0,
        nanagrpid: 0,
        mnan: 0,
    }
}

fn identify_bytes(c: &IdentifyController) -> [u8; IDENTIFY_LEN] {
    let mut b = [0u8; IDENTIFY_LEN];
    c.encode(&mut b);
    b
}

fn identify_controller(s: &mut Seeds) {
    let io = identify_bytes(&controller());
    s.add("io-controller", io);
    let disc = IdentifyController {
        cntrltype: cntrltype::DISCOVERY,
        subnqn: DISCOVERY_NQN.into(),
        nn: 0,
        oncs: 0,
        ..controller()
    };
    s.add("discovery-controller", identify_bytes(&disc));
    let ana = IdentifyController {
        cmic: 0x0B,
        oaes: 1 << 8 | 1 << 11,
        anatt: 10,
        anacap: 0x1F,
        anagrpmax: 1,
        nanagrpid: 1,
        mnan: 1024,
        ..controller()
    };
    s.add("io-controller-ana", identify_bytes(&ana));
    s.add("all-zero", [0u8; IDENTIFY_LEN]);
    let mut b = io;
    b[4] = 0xC3; // a lone UTF-8 lead byte in SN
    s.add("serial-bad-utf8", b);
    let mut b = io;
    b[768..1024].fill(b'q');
    s.add("subnqn-unterminated", b);
    s.add("truncated-4095", &io[..4095]);
}

fn namespace_bytes(lbads: u8) -> [u8; IDENTIFY_LEN] {
    namespace_in_group(lbads, 0)
}

fn namespace_in_group(lbads: u8, anagrpid: u32) -> [u8; IDENTIFY_LEN] {
    let n = IdentifyNamespace {
        nsze: 1 << 21,
        ncap: 1 << 21,
        nuse: 1 << 20,
        nsfeat: 0x4,
        nmic: 1,
        dlfeat: 0x9,
        lbads,
        noiob: 0,
        anagrpid,
        nguid: [0x11; 16],
        eui64: [0x22; 8],
    };
    let mut b = [0u8; IDENTIFY_LEN];
    n.encode(&mut b);
    b
}

fn identify_namespace(s: &mut Seeds) {
    s.add("lba-512", namespace_bytes(9));
    s.add("ana-group-1", namespace_in_group(9, 1));
    // FLBAS picks format 3 (4 KiB) out of four.
    let mut b = namespace_bytes(9);
    b[25] = 3;
    b[26] = 3;
    b[128 + 3 * 4 + 2] = 12;
    s.add("flbas-3-lba-4k", b);
    let mut b = namespace_bytes(9);
    b[26] = 0xFF;
    s.add("flbas-15", b);
    s.add("lbads-200", namespace_bytes(200));
    s.add("all-zero", [0u8; IDENTIFY_LEN]);
    s.add("truncated-129", &namespace_bytes(9)[..129]);
}

fn ns_list(ids: &[u32]) -> [u8; IDENTIFY_LEN] {
    let mut b = [0u8; IDENTIFY_LEN];
    encode_active_ns_list(ids.iter().copied(), 0, &mut b);
    b
}

fn active_ns_list(s: &mut Seeds) {
    s.add("four", ns_list(&[1, 2, 5, 9]));
    s.add("empty", ns_list(&[]));
    let full: Vec<u32> = (1..=1024).map(|i| i * 3).collect();
    s.add("full-1024", ns_list(&full));
    let mut b = ns_list(&[1, 2, 5, 9]);
    put_u32(&mut b, 8, 1);
    s.add("unordered", b);
    let mut b = ns_list(&[1, 2, 5, 9]);
    put_u32(&mut b, 8, 2);
    s.add("duplicate", b);
    s.add("truncated-4095", &ns_list(&[1, 2])[..4095]);
}

fn descriptors(ids: &[NsId]) -> [u8; IDENTIFY_LEN] {
    let mut b = [0u8; IDENTIFY_LEN];
    encode_ns_descriptors(ids, &mut b);
    b
}

fn ns_descriptors(s: &mut Seeds) {
    let all_kinds = [
        NsId::Eui64([1; 8]),
        NsId::Nguid([2; 16]),
        NsId::Uuid([3; 16]),
        NsId::Csi(0),
    ];
    s.add("all-kinds", descriptors(&all_kinds));
    s.add("empty", [0u8; IDENTIFY_LEN]);
    // Type 0x7F, NIDL 5, then a UUID: the unknown one is skipped.
    let mut b = [0u8; IDENTIFY_LEN];
    b[..4].copy_from_slice(&[0x7F, 5, 0, 0]);
    b[9..9 + 20].copy_from_slice(&descriptors(&[NsId::Uuid([9; 16])])[..20]);
    s.add("unknown-type-skipped", b);
    let mut b = descriptors(&[NsId::Uuid([3; 16])]);
    b[1] = 15;
    s.add("uuid-nidl-15", b);
    let mut b = descriptors(&[NsId::Csi(0)]);
    b[1] = 2;
    s.add("csi-nidl-2", b);
    // Unknown descriptors up to 8 bytes before the end, then an EUI-64
    // that would need 4 bytes past it; 8 more bytes follow the structure.
    let mut b = vec![0u8; IDENTIFY_LEN + 8];
    let off = IDENTIFY_LEN - 8;
    let mut at = 0;
    while at < off {
        let nidl = (off - at - 4).min(255);
        b[at] = 0xFF;
        b[at + 1] = nidl as u8;
        at += 4 + nidl;
    }
    b[off..off + 4].copy_from_slice(&[1, 8, 0, 0]);
    b[off + 4..].fill(0xEE);
    s.add("eui64-past-the-end", b);
    s.add("truncated-4095", &descriptors(&all_kinds)[..4095]);
}

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
        subnqn: SUBNQN.into(),
        traddr: "192.0.2.10".into(),
        tsas: [0; 3],
    }
}

fn entry_bytes(e: &DiscoveryEntry) -> [u8; DISC_ENTRY_LEN] {
    let mut b = [0u8; DISC_ENTRY_LEN];
    e.encode(&mut b);
    b
}

fn discovery_entry(s: &mut Seeds) {
    s.add("tcp-nvm-ipv4", entry_bytes(&entry()));
    let current = DiscoveryEntry {
        adrfam: adrfam::IPV6,
        subtype: subtype::CURRENT_DISCOVERY,
        trsvcid: "8009".into(),
        subnqn: DISCOVERY_NQN.into(),
        traddr: "2001:db8::10".into(),
        ..entry()
    };
    s.add("current-discovery-ipv6", entry_bytes(&current));
    let mut b = entry_bytes(&entry());
    b[256..512].fill(b's');
    b[512..768].fill(b'a');
    s.add("strings-unterminated", b);
    let mut b = entry_bytes(&entry());
    b[512] = 0xFF;
    s.add("traddr-bad-utf8", b);
    s.add("truncated-1023", &entry_bytes(&entry())[..1023]);
}

fn discovery_header(s: &mut Seeds) {
    let mut log = Vec::new();
    encode_discovery_log(7, &[entry(), entry()], &mut log);
    s.add("two-records", &log[..1024]);
    encode_discovery_log(u64::MAX, &[], &mut log);
    s.add("empty-genctr-max", log.clone());
    s.add("truncated-15", &log[..15]);
}

fn error_entry(s: &mut Seeds) {
    let e = ErrorEntry {
        error_count: 3,
        sqid: 1,
        cid: 0x42,
        status: Status::LBA_OUT_OF_RANGE.to_wire(),
        lba: 1 << 40,
        nsid: 1,
    };
    let mut b = [0u8; ERROR_ENTRY_LEN];
    e.encode(&mut b);
    s.add("lba-out-of-range", b);
    s.add("all-ones", [0xFF; ERROR_ENTRY_LEN]);
    s.add("truncated-63", &b[..63]);
}

fn status(s: &mut Seeds) {
    for (name, st) in [
        ("success", Status::SUCCESS),
        ("lba-out-of-range-dnr", Status::LBA_OUT_OF_RANGE),
        ("connect-invalid-host", Status::CONNECT_INVALID_HOST),
        ("write-fault", Status::WRITE_FAULT),
        ("ana-inaccessible", Status::ANA_INACCESSIBLE),
    ] {
        s.add(name, st.to_wire().to_le_bytes());
    }
    s.add("all-ones", [0xFF, 0xFF]);
    s.add("one-byte", [0x01]);
}

fn ana_log_bytes(log: &AnaLog, rgo: bool) -> Vec<u8> {
    let mut b = Vec::new();
    log.encode(rgo, &mut b);
    b
}

fn ana_log(s: &mut Seeds) {
    let one = AnaLog {
        chgcnt: 3,
        groups: vec![AnaGroup {
            grpid: 1,
            chgcnt: 3,
            state: AnaState::Optimized,
            nsids: vec![1, 2, 7],
        }],
    };
    let two = AnaLog {
        chgcnt: u64::MAX,
        groups: vec![
            AnaGroup {
                grpid: 1,
                chgcnt: 1,
                state: AnaState::Inaccessible,
                nsids: vec![1],
            },
            AnaGroup {
                grpid: 0xFFFF_FFFF,
                chgcnt: 2,
                state: AnaState::Change,
                nsids: vec![2, 0xFFFF_FFFE],
            },
        ],
    };
    // What the target answers to the Linux host's read (NANAGRPID 1 and
    // MNAN 16): the descriptors, zero-filled to the length asked for.
    let mut b = ana_log_bytes(&one, false);
    b.resize(16 + 32 + 16 * 4, 0);
    s.add("one-group-zero-filled", b);
    s.add("two-groups", ana_log_bytes(&two, false));
    s.add("return-groups-only", ana_log_bytes(&two, true));
    s.add("no-groups", ana_log_bytes(&AnaLog::default(), false));
    let good = ana_log_bytes(&two, false);
    let mut b = good.clone();
    put_u32(&mut b, 16, 0);
    s.add("grpid-0", b);
    let mut b = good.clone();
    b[32] = 0x05;
    s.add("state-5", b);
    let mut b = good.clone();
    b[32] |= 0xF0;
    s.add("state-reserved-bits", b);
    let mut b = good.clone();
    put_u32(&mut b, 16 + 32 + 4 + 32, 0);
    s.add("nsid-0", b);
    let mut b = ana_log_bytes(&one, false);
    put_u32(&mut b, 52, 1);
    s.add("nsids-unordered", b);
    let mut b = good.clone();
    put_u32(&mut b, 20, u32::MAX);
    s.add("nnsid-max", b);
    let mut b = good.clone();
    put_u16(&mut b, 8, u16::MAX);
    s.add("numanagd-max", b);
    s.add("truncated-47", &good[..47]);
    s.add("truncated-15", &good[..15]);
}

fn rdma_cm_request(s: &mut Seeds) {
    use nvpool_wire::rdma::CmRequest;
    let admin = CmRequest {
        recfmt: 0,
        qid: 0,
        hrqsize: 32,
        hsqsize: 31,
        cntlid: 0,
    };
    let io = CmRequest {
        qid: 1,
        hrqsize: 128,
        hsqsize: 127,
        cntlid: 1,
        ..admin
    };
    // As the CM delivers them over RoCE: 56 bytes, zero padded.
    let mut padded = io.encode().to_vec();
    padded.resize(56, 0);
    s.add("linux-admin", admin.encode());
    s.add("linux-io-roce-padded", padded);
    let mut bad = admin.encode();
    bad[0] = 1;
    s.add("recfmt-1", bad);
    s.add("short-31", &admin.encode()[..31]);
    // Bytes 0..16 double as a keyed SGL descriptor (0x4F, 4 KiB, a key).
    let mut keyed = [0u8; 32];
    keyed[8..16].copy_from_slice(&[0x00, 0x10, 0x00, 0xef, 0xbe, 0xad, 0xde, 0x4f]);
    s.add("keyed-invalidate", keyed);
}

fn negotiate_bytes() -> Vec<u8> {
    Message::Negotiate(Negotiate {
        t_id: 1,
        sc_c: 0,
        hashes: &[1, 2, 3],
        dhgroups: &[0, 1, 2, 3, 4, 5],
    })
    .encode()
}

fn reply_bytes(dhv: &[u8]) -> Vec<u8> {
    Message::Reply(AuthReply {
        t_id: 1,
        cvalid: true,
        seqnum: 9,
        r1: &[0x11; 32],
        c2: &[0x22; 32],
        dhv,
    })
    .encode()
}

fn auth_message(s: &mut Seeds) {
    s.add("negotiate", negotiate_bytes());
    let mut two = negotiate_bytes();
    two[7] = 2;
    two[8] = 0x02; // a first descriptor of another protocol
    let d = two[8..72].to_vec();
    two[8] = 0x09;
    two.extend_from_slice(&d);
    two[72] = 0x01;
    s.add("negotiate-two-descriptors", two);
    s.add(
        "challenge-ffdhe2048",
        Message::Challenge(Challenge {
            t_id: 1,
            hash_id: 1,
            dhgroup_id: 1,
            seqnum: 77,
            c1: &[0x33; 32],
            dhv: &[0x44; 256],
        })
        .encode(),
    );
    s.add("reply-null", reply_bytes(&[]));
    s.add("reply-ffdhe2048", reply_bytes(&[0x55; 256]));
    let mut huge = reply_bytes(&[]);
    put_u16(&mut huge, 10, 0xFFFF);
    s.add("reply-huge-dhvlen", huge);
    s.add(
        "success1-r2",
        Message::Success1(Success1 {
            t_id: 1,
            hl: 48,
            r2: Some(&[0x66; 48]),
        })
        .encode(),
    );
    s.add("success2", Message::Success2 { t_id: 1 }.encode());
    s.add(
        "failure1",
        Message::Failure {
            from_controller: true,
            t_id: 1,
            reason: 1,
            explanation: 6,
        }
        .encode(),
    );
    s.add("unknown-id", [0x01, 0x07, 0, 0, 1, 0, 32, 0]);
}

/// Sends framed for the dhchap_controller target: a group byte, then
/// (length / 8, message) pairs.
fn framed(group: u8, msgs: &[Vec<u8>]) -> Vec<u8> {
    let mut out = vec![group];
    for m in msgs {
        let mut m = m.clone();
        m.resize(m.len().div_ceil(8) * 8, 0);
        out.push((m.len() / 8) as u8);
        out.extend_from_slice(&m);
    }
    out
}

fn dhchap_controller(s: &mut Seeds) {
    let neg = negotiate_bytes();
    s.add(
        "negotiate-reply-null",
        framed(0, &[neg.clone(), reply_bytes(&[])]),
    );
    s.add(
        "negotiate-reply-ffdhe2048",
        framed(1, &[neg.clone(), reply_bytes(&[0x55; 224])]),
    );
    s.add(
        "out-of-order",
        framed(
            0,
            &[Message::Success2 { t_id: 1 }.encode(), neg.clone(), neg],
        ),
    );
}
