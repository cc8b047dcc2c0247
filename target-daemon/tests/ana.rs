//! Asymmetric Namespace Access: several targets present one subsystem, each
//! as one path of a Linux native-multipath namespace (docs/ARCHITECTURE.md
//! D15). Checks what a host sees of one path: the Identify fields, the ANA
//! log page, the ANA change notice, the statuses of I/O in each state, the
//! lease that gates a serving state, backend activation, and the admin API
//! that drives it all.

mod common;

use common::*;
use nvpool_target::backend::{Backend, RamBackend};
use nvpool_target::config::{AnaConfig, AnaState, Config, SubsystemConfig};
use nvpool_target::Target;
use nvpool_wire::identify::NsId;
use nvpool_wire::log::{AnaLog, GetLogPage, AEN_ANA_CHANGED};
use nvpool_wire::sqe::admin;
use nvpool_wire::{Sqe, Status};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The CID of the held Asynchronous Event Request; far above the CIDs the
/// test host hands out.
const AER_CID: u16 = 0xF000;
const FID_ASYNC_EVENT_CONFIG: u8 = 0x0B;
const AEC_NS_ATTR: u32 = 1 << 8;
const AEC_ANA_CHANGE: u32 = 1 << 11;
const LID_ANA: u8 = 0x0C;
const UUID: &str = "5b1e0c2a-4f7d-4c1e-9a3b-2d6f8e0a1b2c";
/// Identify MNAN and NANAGRPID are checked against this; the length the
/// Linux host reads is 16 + 32 × NANAGRPID + 4 × MNAN.
const LINUX_LOG_LEN: u64 = 16 + 32 + 4 * 1024;
/// How long an ANA change notice may take (the reactor tick is 50 ms).
const NOTICE_WITHIN: Duration = Duration::from_secs(2);

fn ana(state: AnaState, cntlid_min: u16, cntlid_max: u16, lease: bool) -> AnaConfig {
    AnaConfig {
        state,
        cntlid_min,
        cntlid_max,
        lease,
    }
}

/// An ANA subsystem (any host) with RAM namespaces `nsids`.
fn ana_subsystem(nqn: &str, a: AnaConfig, nsids: &[u32]) -> SubsystemConfig {
    let ns: Vec<(u32, &str)> = nsids.iter().map(|&n| (n, RAM_SPEC)).collect();
    SubsystemConfig {
        ana: Some(a),
        ..subsystem(nqn, &[], &ns)
    }
}

fn put_ana_state(d: &Daemon, nqn: &str, state: &str) -> HttpResponse {
    http(
        d.api,
        "PUT",
        &format!("/v1/subsystems/{nqn}/ana"),
        Some(&format!(r#"{{"state": "{state}"}}"#)),
    )
}

#[track_caller]
fn set_state(d: &Daemon, nqn: &str, state: &str) {
    let r = put_ana_state(d, nqn, state);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["ana"]["state"], state, "{}", r.body);
}

#[track_caller]
fn assert_json_error(r: &HttpResponse, status: u16) {
    assert_eq!(r.status, status, "{}", r.body);
    assert!(
        r.content_type
            .as_deref()
            .is_some_and(|c| c.starts_with("application/json")),
        "{r:?}"
    );
    let v = r.json();
    assert!(v["kind"].as_str().is_some_and(|k| !k.is_empty()), "{v}");
    assert!(v["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
}

/// Get Log Page 0Ch with RAE, RGO, offset and length as given.
fn ana_log_cmd(rae: bool, rgo: bool, offset: u64, len: u64) -> Sqe {
    let mut s = GetLogPage {
        lid: LID_ANA,
        rae,
        len,
        offset,
    }
    .to_sqe(0, 0xFFFF_FFFF);
    if rgo {
        s.set_cdw(10, s.cdw(10) | 1 << 8);
    }
    s
}

/// Reads the ANA log as the Linux host does (offset 0, RGO 0, the whole
/// length for NANAGRPID 1 and MNAN 1024) and decodes it.
#[track_caller]
fn read_ana_log(a: &mut Conn, rae: bool) -> AnaLog {
    let c = a.exec(ana_log_cmd(rae, false, 0, LINUX_LOG_LEN));
    c.ok();
    assert_eq!(
        c.data.len() as u64,
        LINUX_LOG_LEN,
        "the whole length asked for"
    );
    AnaLog::decode(&c.data).expect("ANA log decodes")
}

#[track_caller]
fn log_state(a: &mut Conn) -> AnaState {
    let log = read_ana_log(a, true);
    assert_eq!(log.groups.len(), 1);
    log.groups[0].state
}

/// An admin queue with ANA change notices enabled.
#[track_caller]
fn notified_controller(d: &Daemon, nqn: &str) -> (Conn, Conn) {
    let (mut a, q) = controller(d.addr, NO_DIGESTS, nqn, HOST_A);
    a.set_features(FID_ASYNC_EVENT_CONFIG, AEC_NS_ATTR | AEC_ANA_CHANGE)
        .ok();
    (a, q)
}

/// Every kind of I/O the target executes, on namespace 1, each expecting
/// `want` (or success when None).
#[track_caller]
fn every_io(q: &mut Conn, want: Option<Status>) {
    let check = |c: Completion, what: &str| match want {
        Some(st) => {
            assert!(c.status.is_path_error(), "{what}: {}", c.status);
            assert!(!c.status.dnr, "{what}: path errors never carry DNR");
            c.expect_status(st);
        }
        None => {
            c.ok();
        }
    };
    let data = pattern(7, 4096);
    check(
        q.write_via(1, 8, &data, 512, false, true),
        "in-capsule write",
    );
    let big = pattern(8, 64 << 10);
    check(q.write_via(1, 64, &big, 512, true, false), "R2T write");
    let r = q.read(1, 8, 8, 512);
    if want.is_none() {
        assert_eq!(r.data, data, "read back");
    }
    check(r, "read");
    check(q.flush(1), "flush");
    check(q.write_zeroes(1, 256, 16), "write zeroes");
    check(q.deallocate(1, &[(512, 8)]), "deallocate");
}

// ------------------------------------------------------------ Identify

#[test]
fn identify_reports_ana_only_for_ana_subsystems() {
    let mut cfg = ana_subsystem(SUBNQN, ana(AnaState::Optimized, 100, 199, false), &[1, 2]);
    cfg.model = Some("nvpool pooled volume".into());
    let d = Daemon::start(&[cfg, subsystem(OTHER_NQN, &[], &[(1, RAM_SPEC)])]);

    let mut a = admin_session(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    assert!((100..=199).contains(&a.cntlid), "CNTLID {}", a.cntlid);
    let c = a.identify_controller();
    assert_eq!(c.cntlid, a.cntlid);
    assert_eq!(c.cmic, 0x0B, "multi-port, multi-controller, ANA reporting");
    assert_eq!(
        c.oaes & (AEC_NS_ATTR | AEC_ANA_CHANGE),
        AEC_NS_ATTR | AEC_ANA_CHANGE
    );
    assert_eq!((c.anatt, c.anacap), (10, 0x1F));
    assert_eq!((c.anagrpmax, c.nanagrpid), (1, 1));
    assert!(1 <= c.mnan && c.mnan <= c.nn, "MNAN {} NN {}", c.mnan, c.nn);
    assert_eq!(c.mnan, c.nn);
    let log_len = 16 + 32 * u64::from(c.nanagrpid) + 4 * u64::from(c.mnan);
    assert_eq!(log_len, LINUX_LOG_LEN);
    assert!(
        c.mdts == 0 || log_len <= 4096u64 << c.mdts,
        "the ANA log must fit MDTS"
    );
    assert_eq!(c.model, "nvpool pooled volume");
    for nsid in [1, 2] {
        let n = a.identify_namespace(nsid);
        assert_eq!(n.nmic & 1, 1, "shared namespace");
        assert_eq!(n.anagrpid, 1);
        assert_eq!(n.nuse, n.nsze);
    }
    // A path that lost the namespace reports nothing in use.
    set_state(&d, SUBNQN, "inaccessible");
    let n = a.identify_namespace(1);
    assert_eq!((n.nuse, n.anagrpid), (0, 1));
    assert_eq!(n.nsze, RAM_BLOCKS);

    // A subsystem without ANA reports what it always did.
    let mut o = admin_session(d.addr, NO_DIGESTS, OTHER_NQN, HOST_A);
    let c = o.identify_controller();
    assert_eq!(c.cmic, 0x02);
    assert_eq!(c.oaes, AEC_NS_ATTR);
    assert_eq!(
        (c.anatt, c.anacap, c.anagrpmax, c.nanagrpid, c.mnan),
        (0, 0, 0, 0, 0)
    );
    assert_eq!(c.model, "nvpool");
    let n = o.identify_namespace(1);
    assert_eq!((n.nmic, n.anagrpid, n.nuse), (1, 0, RAM_BLOCKS));
    o.set_features(FID_ASYNC_EVENT_CONFIG, AEC_ANA_CHANGE)
        .expect_status(Status::INVALID_FIELD);
    o.set_features(FID_ASYNC_EVENT_CONFIG, AEC_NS_ATTR).ok();
    o.exec(ana_log_cmd(true, false, 0, LINUX_LOG_LEN))
        .expect_status(Status::INVALID_LOG_PAGE);
    // Discovery controllers have no ANA log either.
    let mut disc = Conn::open_ic(d.addr, NO_DIGESTS);
    disc.admin_connect(nvpool_wire::DISCOVERY_NQN, HOST_A, 0)
        .ok();
    disc.enable();
    disc.exec(ana_log_cmd(true, false, 0, LINUX_LOG_LEN))
        .expect_status(Status::INVALID_LOG_PAGE);
}

#[test]
fn two_paths_report_identical_namespace_ids_and_disjoint_cntlids() {
    let mut cfg_a = ana_subsystem(SUBNQN, ana(AnaState::Optimized, 1, 3, false), &[1, 2]);
    cfg_a.namespaces[0].uuid = Some(UUID.into());
    let mut cfg_b = cfg_a.clone();
    cfg_b.ana = Some(ana(AnaState::NonOptimized, 1000, 1002, false));
    let da = Daemon::start(&[cfg_a]);
    let db = Daemon::start(&[cfg_b]);

    let mut on_a: Vec<Conn> = (0..3)
        .map(|_| admin_session(da.addr, NO_DIGESTS, SUBNQN, HOST_A))
        .collect();
    let mut on_b: Vec<Conn> = (0..3)
        .map(|_| admin_session(db.addr, NO_DIGESTS, SUBNQN, HOST_A))
        .collect();
    let mut ids_a: Vec<u16> = on_a.iter().map(|c| c.cntlid).collect();
    let mut ids_b: Vec<u16> = on_b.iter().map(|c| c.cntlid).collect();
    ids_a.sort_unstable();
    ids_b.sort_unstable();
    assert_eq!(ids_a, [1, 2, 3]);
    assert_eq!(ids_b, [1000, 1001, 1002]);
    // The range is full: the next controller is refused, the others live on.
    let mut extra = Conn::open_ic(da.addr, NO_DIGESTS);
    extra
        .admin_connect(SUBNQN, HOST_B, 30_000)
        .expect_status(Status::CONNECT_CONTROLLER_BUSY);

    let (a, b) = (&mut on_a[0], &mut on_b[0]);
    let (ca, cb) = (a.identify_controller(), b.identify_controller());
    assert_eq!(
        (&ca.subnqn, &ca.serial, &ca.model, ca.cmic),
        (&cb.subnqn, &cb.serial, &cb.model, cb.cmic),
        "a host groups the two controllers into one subsystem"
    );
    assert_eq!((ca.anagrpmax, ca.mnan), (cb.anagrpmax, cb.mnan));
    let ids = a.ns_descriptors(1);
    assert_eq!(ids, b.ns_descriptors(1), "UUID, NGUID, EUI-64 and CSI");
    assert!(ids.contains(&NsId::Uuid(parse_uuid(UUID))), "{ids:?}");
    assert!(ids.contains(&NsId::Nguid(parse_uuid(UUID))), "{ids:?}");
    let (na, nb) = (a.identify_namespace(1), b.identify_namespace(1));
    assert_eq!(
        (na.nguid, na.eui64, na.nsze, na.lbads),
        (nb.nguid, nb.eui64, nb.nsze, nb.lbads)
    );
    assert_eq!((na.nmic, na.anagrpid), (nb.nmic, nb.anagrpid));
    // Without a UUID given, each target derives its own from its identity.
    assert_ne!(a.ns_descriptors(2), b.ns_descriptors(2));

    // Each path reports its own state.
    assert_eq!(log_state(a), AnaState::Optimized);
    assert_eq!(log_state(b), AnaState::NonOptimized);
    for c in on_a.iter_mut().chain(on_b.iter_mut()) {
        c.keep_alive().ok();
    }
}

// ------------------------------------------------------------ the log page

#[test]
fn ana_log_page_layout_rgo_and_offsets() {
    let d = Daemon::start(&[ana_subsystem(
        SUBNQN,
        ana(AnaState::NonOptimized, 1, 99, false),
        &[5, 1, 2],
    )]);
    let mut a = admin_session(d.addr, NO_DIGESTS, SUBNQN, HOST_A);

    let full = a.exec(ana_log_cmd(true, false, 0, LINUX_LOG_LEN));
    full.ok();
    let full = full.data;
    assert_eq!(full.len() as u64, LINUX_LOG_LEN);
    let log = AnaLog::decode(&full).expect("decodes");
    assert_eq!(log.groups.len(), 1);
    let g = &log.groups[0];
    assert_eq!((g.grpid, g.state), (1, AnaState::NonOptimized));
    assert_eq!(g.nsids, [1, 2, 5], "ascending");
    assert!(g.chgcnt >= 1 && log.chgcnt >= 1);
    // Header, one descriptor, three NSIDs; zeroes up to the length asked for.
    let used = 16 + 32 + 3 * 4;
    assert!(full[used..].iter().all(|&b| b == 0), "zero filled");
    assert_eq!(u16::from_le_bytes([full[8], full[9]]), 1, "NUMANAGD");

    // Return Groups Only: the descriptor without its NSIDs.
    let rgo = a.exec(ana_log_cmd(true, true, 0, 256));
    rgo.ok();
    assert_eq!(rgo.data.len(), 256);
    let log = AnaLog::decode(&rgo.data).expect("decodes");
    assert_eq!(log.groups[0].nsids, Vec::<u32>::new());
    assert_eq!(log.groups[0].state, AnaState::NonOptimized);
    assert_eq!(&rgo.data[20..24], &[0, 0, 0, 0], "NNSID 0");
    assert!(rgo.data[48..].iter().all(|&b| b == 0));

    // Pieces at offsets match the whole.
    for (off, len) in [(16u64, 32u64), (48, 12), (4, 8), (40, 64)] {
        let c = a.exec(ana_log_cmd(true, false, off, len));
        c.ok();
        let want = &full[off as usize..(off + len) as usize];
        assert_eq!(c.data, want, "offset {off} length {len}");
    }
    // At the end of the log: only zeroes.
    let c = a.exec(ana_log_cmd(true, false, used as u64, 16));
    c.ok();
    assert_eq!(c.data, [0u8; 16]);

    // Bad requests are command errors; the connection stays up.
    a.exec(ana_log_cmd(true, false, 2, 16))
        .expect_status(Status::INVALID_FIELD);
    a.exec(ana_log_cmd(true, false, 8192, 16))
        .expect_status(Status::INVALID_FIELD);
    a.exec(ana_log_cmd(true, false, u64::MAX - 3, 16))
        .expect_status(Status::INVALID_FIELD);
    a.exec(ana_log_cmd(true, false, 0, 1 << 20))
        .expect_status(Status::INVALID_FIELD);
    let mut huge = ana_log_cmd(true, false, 0, 4096);
    huge.set_cdw(10, huge.cdw(10) | 0xFFFF << 16);
    huge.set_cdw(11, 0xFFFF);
    a.exec(huge).expect_status(Status::INVALID_FIELD);
    a.keep_alive().ok();

    // A change shows in the log with a higher change count.
    let before = read_ana_log(&mut a, true).chgcnt;
    set_state(&d, SUBNQN, "optimized");
    let log = read_ana_log(&mut a, true);
    assert_eq!(log.groups[0].state, AnaState::Optimized);
    assert!(log.chgcnt > before && log.groups[0].chgcnt == log.chgcnt);
    // Namespaces added later are listed, in order.
    d.target
        .put_namespace_backend(SUBNQN, 3, Arc::new(RamBackend::new(1 << 20, 512)))
        .expect("namespace 3");
    assert_eq!(read_ana_log(&mut a, true).groups[0].nsids, [1, 2, 3, 5]);
}

// ------------------------------------------------------------ notices

#[test]
fn ana_change_notice_once_until_the_log_is_read() {
    let d = Daemon::start(&[ana_subsystem(
        SUBNQN,
        ana(AnaState::Optimized, 1, 99, false),
        &[1],
    )]);
    let (mut a, _q) = notified_controller(&d, SUBNQN);
    assert_eq!(
        a.exec({
            let mut s = Sqe::new(admin::GET_FEATURES, 0);
            s.set_cdw(10, u32::from(FID_ASYNC_EVENT_CONFIG));
            s.set_sgl(NULL_SGL);
            s
        })
        .ok()
        .dw0,
        AEC_NS_ATTR | AEC_ANA_CHANGE
    );
    send_aer(&mut a, AER_CID);
    assert!(
        a.quiet_for(Duration::from_millis(200)),
        "the AER completes only on an event"
    );

    set_state(&d, SUBNQN, "inaccessible");
    assert_eq!(expect_aer(&mut a, AER_CID, NOTICE_WITHIN), AEN_ANA_CHANGED);

    // Another change before the host read the log: no second notice, not
    // even after a read that retains the event (RAE 1).
    send_aer(&mut a, AER_CID);
    set_state(&d, SUBNQN, "change");
    assert!(
        a.quiet_for(Duration::from_millis(300)),
        "one notice per read"
    );
    assert_eq!(log_state(&mut a), AnaState::Change);
    set_state(&d, SUBNQN, "non-optimized");
    assert!(
        a.quiet_for(Duration::from_millis(300)),
        "RAE 1 keeps it masked"
    );

    // Reading it with RAE 0 re-arms the notice.
    let log = read_ana_log(&mut a, false);
    assert_eq!(log.groups[0].state, AnaState::NonOptimized);
    set_state(&d, SUBNQN, "optimized");
    assert_eq!(expect_aer(&mut a, AER_CID, NOTICE_WITHIN), AEN_ANA_CHANGED);
    assert_eq!(
        read_ana_log(&mut a, false).groups[0].state,
        AnaState::Optimized
    );

    // Setting the state it already has is no change.
    send_aer(&mut a, AER_CID);
    set_state(&d, SUBNQN, "optimized");
    assert!(a.quiet_for(Duration::from_millis(300)));

    // A controller that did not enable the notice gets none.
    let (mut other, _q2) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_B);
    other.set_features(FID_ASYNC_EVENT_CONFIG, AEC_NS_ATTR).ok();
    send_aer(&mut other, AER_CID);
    set_state(&d, SUBNQN, "inaccessible");
    assert_eq!(expect_aer(&mut a, AER_CID, NOTICE_WITHIN), AEN_ANA_CHANGED);
    assert!(other.quiet_for(Duration::from_millis(300)));
}

// ------------------------------------------------------------ I/O

#[test]
fn io_status_follows_the_ana_state() {
    let d = Daemon::start(&[ana_subsystem(
        SUBNQN,
        ana(AnaState::Optimized, 1, 99, false),
        &[1],
    )]);
    let (mut a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    every_io(&mut q, None);
    for (state, want) in [
        ("inaccessible", Some(Status::ANA_INACCESSIBLE)),
        ("change", Some(Status::ANA_TRANSITION)),
        ("persistent-loss", Some(Status::ANA_PERSISTENT_LOSS)),
        ("non-optimized", None),
        ("inaccessible", Some(Status::ANA_INACCESSIBLE)),
        ("optimized", None),
    ] {
        set_state(&d, SUBNQN, state);
        every_io(&mut q, want);
        // Admin commands work in every state.
        a.keep_alive().ok();
        assert_eq!(a.identify_controller().cntlid, a.cntlid);
        assert_eq!(log_state(&mut a).name(), state);
    }
    // Data written while serving survived the states in between.
    q.write(1, 0, &pattern(3, 4096), 512, false).ok();
    set_state(&d, SUBNQN, "inaccessible");
    set_state(&d, SUBNQN, "optimized");
    assert_eq!(q.read_ok(1, 0, 8, 512), pattern(3, 4096));
    // Errors against an unknown namespace are still what they were.
    q.read(9, 0, 1, 512).expect_status(Status::INVALID_NS);
}

// ------------------------------------------------------------ lease

/// Reads until the read's status is `want` or `within` ends.
#[track_caller]
fn wait_for_read_status(q: &mut Conn, want: Status, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let c = q.read(1, 0, 1, 512);
        if (c.status.sct, c.status.sc) == (want.sct, want.sc) {
            c.expect_status(want);
            return;
        }
        assert!(
            Instant::now() < deadline,
            "read still answers {} after {within:?}",
            c.status
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_lease_gates_the_serving_state() {
    let d = Daemon::start(&[
        ana_subsystem(SUBNQN, ana(AnaState::Optimized, 1, 99, true), &[1]),
        ana_subsystem(OTHER_NQN, ana(AnaState::Optimized, 100, 199, false), &[1]),
    ]);
    let (mut a, mut q) = notified_controller(&d, SUBNQN);

    // Never renewed: optimized as configured, inaccessible to hosts.
    q.read(1, 0, 1, 512).expect_status(Status::ANA_INACCESSIBLE);
    assert_eq!(
        read_ana_log(&mut a, false).groups[0].state,
        AnaState::Inaccessible
    );
    let v = http(d.api, "GET", &format!("/v1/subsystems/{SUBNQN}"), None).json();
    assert_eq!(v["ana"]["state"], "optimized");
    assert_eq!(v["ana"]["effective_state"], "inaccessible");
    assert_eq!(v["ana"]["lease"], true);
    assert_eq!(v["ana"]["lease_remaining_ms"], 0);

    // A renewal makes it serve, and tells the host.
    send_aer(&mut a, AER_CID);
    let body = format!(
        r#"{{"nqns": ["{SUBNQN}", "{OTHER_NQN}", "nqn.2026-11.io.nvpool:nope"], "valid_ms": 3000}}"#
    );
    let r = http(d.api, "POST", "/v1/leases", Some(&body));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["renewed"], 1, "only lease-gated subsystems count");
    assert_eq!(expect_aer(&mut a, AER_CID, NOTICE_WITHIN), AEN_ANA_CHANGED);
    every_io(&mut q, None);
    assert_eq!(
        read_ana_log(&mut a, false).groups[0].state,
        AnaState::Optimized
    );
    let v = http(d.api, "GET", &format!("/v1/subsystems/{SUBNQN}"), None).json();
    assert_eq!(v["ana"]["effective_state"], "optimized");
    let left = v["ana"]["lease_remaining_ms"]
        .as_u64()
        .expect("remaining ms");
    assert!(left > 0 && left <= 3000, "{left}");

    // Left to expire: inaccessible again, and the host hears of it.
    send_aer(&mut a, AER_CID);
    wait_for_read_status(&mut q, Status::ANA_INACCESSIBLE, Duration::from_secs(15));
    assert_eq!(expect_aer(&mut a, AER_CID, NOTICE_WITHIN), AEN_ANA_CHANGED);
    assert_eq!(
        read_ana_log(&mut a, false).groups[0].state,
        AnaState::Inaccessible
    );
    every_io(&mut q, Some(Status::ANA_INACCESSIBLE));

    // A lease does not make a non-serving state serve.
    set_state(&d, SUBNQN, "change");
    assert_eq!(
        d.target.renew_leases(&[SUBNQN], d.target.now_ms() + 5_000),
        1
    );
    q.read(1, 0, 1, 512).expect_status(Status::ANA_TRANSITION);
    set_state(&d, SUBNQN, "optimized");
    q.read(1, 0, 1, 512).ok();
}

// ------------------------------------------------------------ backends

/// A RAM backend that counts activations and can refuse them.
#[derive(Debug)]
struct Gated {
    inner: RamBackend,
    refuse: AtomicBool,
    active: AtomicBool,
    activations: AtomicU32,
    deactivations: AtomicU32,
}

impl Gated {
    fn new() -> Gated {
        Gated {
            inner: RamBackend::new(1 << 20, 512),
            refuse: AtomicBool::new(false),
            active: AtomicBool::new(false),
            activations: AtomicU32::new(0),
            deactivations: AtomicU32::new(0),
        }
    }
}

impl Backend for Gated {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn block_size(&self) -> u32 {
        self.inner.block_size()
    }
    fn describe(&self) -> String {
        "gated ram".into()
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        assert!(self.active.load(Ordering::SeqCst), "read while inactive");
        self.inner.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64, fua: bool) -> io::Result<()> {
        assert!(self.active.load(Ordering::SeqCst), "write while inactive");
        self.inner.write_at(buf, off, fua)
    }
    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }
    fn write_zeroes(&self, off: u64, len: u64) -> io::Result<()> {
        self.inner.write_zeroes(off, len)
    }
    fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        self.inner.discard(off, len)
    }
    fn failed(&self) -> bool {
        false
    }
    fn mark_failed(&self) {}
    fn activate(&self) -> io::Result<()> {
        if self.refuse.load(Ordering::SeqCst) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                "owner unreachable",
            ));
        }
        self.activations.fetch_add(1, Ordering::SeqCst);
        self.active.store(true, Ordering::SeqCst);
        Ok(())
    }
    fn deactivate(&self) {
        self.deactivations.fetch_add(1, Ordering::SeqCst);
        self.active.store(false, Ordering::SeqCst);
    }
}

#[test]
fn backends_are_activated_before_serving_and_deactivated_after() {
    let d = Daemon::start(&[ana_subsystem(
        SUBNQN,
        ana(AnaState::Inaccessible, 1, 99, false),
        &[],
    )]);
    let g = Arc::new(Gated::new());
    d.target
        .put_namespace_backend(SUBNQN, 1, g.clone())
        .expect("namespace");
    assert_eq!(g.activations.load(Ordering::SeqCst), 0, "not serving yet");
    let (mut a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);

    // Activation fails: 503, nothing changes.
    g.refuse.store(true, Ordering::SeqCst);
    let r = put_ana_state(&d, SUBNQN, "optimized");
    assert_json_error(&r, 503);
    assert_eq!(r.json()["kind"], "unavailable");
    let v = http(d.api, "GET", &format!("/v1/subsystems/{SUBNQN}"), None).json();
    assert_eq!(v["ana"]["state"], "inaccessible");
    assert_eq!(log_state(&mut a), AnaState::Inaccessible);
    q.read(1, 0, 1, 512).expect_status(Status::ANA_INACCESSIBLE);

    g.refuse.store(false, Ordering::SeqCst);
    set_state(&d, SUBNQN, "optimized");
    assert_eq!(g.activations.load(Ordering::SeqCst), 1);
    q.write(1, 0, &pattern(4, 512), 512, false).ok();
    // Another serving state keeps the backend as it is.
    set_state(&d, SUBNQN, "non-optimized");
    assert_eq!(g.activations.load(Ordering::SeqCst), 1);
    assert_eq!(g.deactivations.load(Ordering::SeqCst), 0);
    // A namespace added while serving is active before hosts can use it.
    let g2 = Arc::new(Gated::new());
    d.target
        .put_namespace_backend(SUBNQN, 2, g2.clone())
        .expect("namespace 2");
    assert!(g2.active.load(Ordering::SeqCst));
    q.read_ok(2, 0, 1, 512);

    set_state(&d, SUBNQN, "change");
    assert_eq!(g.deactivations.load(Ordering::SeqCst), 1);
    assert!(!g.active.load(Ordering::SeqCst) && !g2.active.load(Ordering::SeqCst));
    // Refused before the backend is touched (it would assert otherwise).
    every_io(&mut q, Some(Status::ANA_TRANSITION));

    // Removing a serving namespace deactivates it.
    set_state(&d, SUBNQN, "optimized");
    assert!(g2.active.load(Ordering::SeqCst));
    d.target.remove_namespace(SUBNQN, 2).expect("remove");
    assert!(!g2.active.load(Ordering::SeqCst));
    assert_eq!(q.read_ok(1, 0, 1, 512), pattern(4, 512));
}

// ------------------------------------------------------------ config

#[test]
fn ana_state_is_saved_and_ids_survive_a_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let t = Target::new(Some(dir.path().to_owned())).expect("target");
    t.put_subsystem(&ana_subsystem(
        SUBNQN,
        ana(AnaState::Optimized, 10, 20, true),
        &[1],
    ))
    .expect("put");
    t.set_ana_state(SUBNQN, AnaState::PersistentLoss)
        .expect("set state");
    let saved = Config::load_state(dir.path())
        .expect("state loads")
        .expect("state saved");
    let a = saved.subsystems[0].ana.expect("ana saved");
    assert_eq!(a, ana(AnaState::PersistentLoss, 10, 20, true));
    let ns = t.subsystem(SUBNQN).expect("subsystem").namespaces[&1].clone();
    drop(t);

    let t = Target::new(Some(dir.path().to_owned())).expect("restarted");
    t.apply_config(&saved).expect("apply");
    let s = t.subsystem(SUBNQN).expect("subsystem");
    assert_eq!(
        s.ana.as_ref().expect("ana").config.state,
        AnaState::PersistentLoss
    );
    let again = &s.namespaces[&1];
    assert_eq!(
        (again.uuid, again.nguid, again.eui64),
        (ns.uuid, ns.nguid, ns.eui64)
    );

    let err = t.set_ana_state("nqn.2026-11.io.nvpool:absent", AnaState::Optimized);
    assert!(err.is_err());

    // A leased path saved serving restarts inaccessible: it serves again
    // only when its control plane says so.
    t.set_ana_state(SUBNQN, AnaState::Optimized)
        .expect("set state");
    let saved = Config::load_state(dir.path())
        .expect("state loads")
        .expect("state saved");
    drop(t);
    let t = Target::new(Some(dir.path().to_owned())).expect("restarted");
    t.apply_config(&saved).expect("apply");
    let s = t.subsystem(SUBNQN).expect("subsystem");
    assert_eq!(
        s.ana.as_ref().expect("ana").config.state,
        AnaState::Inaccessible
    );
}

#[test]
fn hostile_admin_input_is_a_json_4xx() {
    let d = Daemon::start(&[
        subsystem(OTHER_NQN, &[], &[(1, RAM_SPEC)]),
        ana_subsystem(SUBNQN, ana(AnaState::Optimized, 1, 9, false), &[1]),
    ]);
    let sub = format!("/v1/subsystems/{SUBNQN}");
    let bodies = [
        r#"{"allow_any_host": true, "ana": {"state": "optimized", "cntlid_min": 0, "cntlid_max": 10}}"#,
        r#"{"allow_any_host": true, "ana": {"state": "optimized", "cntlid_min": 20, "cntlid_max": 10}}"#,
        r#"{"allow_any_host": true, "ana": {"state": "optimized", "cntlid_min": 1, "cntlid_max": 65520}}"#,
        r#"{"allow_any_host": true, "ana": {"state": "optimized", "cntlid_min": 1, "cntlid_max": 65536}}"#,
        r#"{"allow_any_host": true, "ana": {"state": "standby", "cntlid_min": 1, "cntlid_max": 10}}"#,
        r#"{"allow_any_host": true, "ana": {"state": 1, "cntlid_min": 1, "cntlid_max": 10}}"#,
        r#"{"allow_any_host": true, "ana": {"state": "optimized", "cntlid_min": 1}}"#,
        r#"{"allow_any_host": true, "ana": {"state": "optimized", "cntlid_min": 1, "cntlid_max": 9, "x": 1}}"#,
        r#"{"allow_any_host": true, "ana": "optimized"}"#,
        r#"{"allow_any_host": true, "model": ""}"#,
        r#"{"allow_any_host": true, "model": "0123456789012345678901234567890123456789x"}"#,
        r#"{"allow_any_host": true, "model": "tab\tin model"}"#,
    ];
    for body in bodies {
        let r = http(d.api, "PUT", &sub, Some(body));
        assert_json_error(&r, 400);
    }
    // The subsystem is untouched.
    let v = http(d.api, "GET", &sub, None).json();
    assert_eq!(v["ana"]["cntlid_max"], 9, "{v}");

    let ana_path = |nqn: &str| format!("/v1/subsystems/{nqn}/ana");
    for (path, body, status) in [
        (ana_path(OTHER_NQN), r#"{"state": "optimized"}"#, 400),
        (
            ana_path("nqn.2026-11.io.nvpool:absent"),
            r#"{"state": "optimized"}"#,
            404,
        ),
        (ana_path(SUBNQN), r#"{"state": "standby"}"#, 400),
        (ana_path(SUBNQN), r#"{"state": ""}"#, 400),
        (ana_path(SUBNQN), r#"{"state": null}"#, 400),
        (
            ana_path(SUBNQN),
            r#"{"state": "optimized", "extra": 1}"#,
            400,
        ),
        (ana_path(SUBNQN), r#"{}"#, 400),
        (ana_path(SUBNQN), r#"{"state": "optim"#, 400),
        (ana_path(SUBNQN), "not json", 400),
        (ana_path(SUBNQN), r#"[1]"#, 400),
    ] {
        let r = http(d.api, "PUT", &path, Some(body));
        assert_eq!(r.status, status, "PUT {path} {body}: {}", r.body);
        assert_json_error(&r, status);
    }
    for body in [
        r#"{"nqns": [], "valid_ms": 0}"#,
        r#"{"nqns": [], "valid_ms": 60001}"#,
        r#"{"nqns": [], "valid_ms": 18446744073709551615}"#,
        r#"{"nqns": [], "valid_ms": 18446744073709551616}"#,
        r#"{"nqns": [], "valid_ms": -1}"#,
        r#"{"nqns": [], "valid_ms": 1.5}"#,
        r#"{"nqns": "x", "valid_ms": 10}"#,
        r#"{"nqns": [1], "valid_ms": 10}"#,
        r#"{"valid_ms": 10}"#,
        r#"{"nqns": [], "valid_ms": 10, "extra": true}"#,
        "{",
        "",
    ] {
        let r = http(d.api, "POST", "/v1/leases", Some(body));
        assert_json_error(&r, 400);
    }
    let r = http(
        d.api,
        "POST",
        "/v1/leases",
        Some(r#"{"nqns": [], "valid_ms": 60000}"#),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["renewed"], 0);
    let r = http(d.api, "GET", "/v1/leases", None);
    assert!((400..500).contains(&r.status), "{}", r.status);

    // The target still serves.
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    q.read_ok(1, 0, 1, 512);
    assert_eq!(
        http(d.api, "GET", &sub, None).json()["ana"]["state"],
        "optimized"
    );
}

/// Helper for UUIDs in tests.
fn parse_uuid(s: &str) -> [u8; 16] {
    nvpool_target::config::parse_uuid(s).expect("uuid")
}
