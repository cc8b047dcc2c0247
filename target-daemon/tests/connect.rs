//! The connect sequence of the Linux host, step by step, against a live
//! target: ICReq, admin Connect, properties, Identify, Number of Queues,
//! an I/O queue on a second connection, and the namespace scan.

mod common;

use common::*;
use nvpool_wire::fabrics::{prop, Cap};
use nvpool_wire::identify::{cns, cntrltype, NsId};
use nvpool_wire::Status;

#[test]
fn linux_host_connect_sequence() {
    let d = Daemon::start(&[subsystem(
        SUBNQN,
        &[HOST_A],
        &[(1, RAM_SPEC), (3, "ram:1M")],
    )]);

    // ICReq / ICResp (checked inside icreq()).
    let mut a = Conn::open(d.addr);
    let ic = a.icreq(NO_DIGESTS);
    assert_eq!(ic.maxh2cdata, nvpool_target::limits::MAXH2CDATA_BYTES);

    // Admin Connect: dynamic controller.
    let c = a.admin_connect(SUBNQN, HOST_A, 5000);
    c.ok();
    let cntlid = c.dw0 as u16;
    assert!((1..=0xFFEF).contains(&cntlid), "CNTLID {cntlid:#x}");

    // Enable, as nvme_enable_ctrl does.
    let cap = Cap::from_u64(a.prop_get(prop::CAP, true));
    let cap_raw = a.prop_get(prop::CAP, true);
    assert_eq!((cap_raw >> 48) & 0xF, 0, "CAP.MPSMIN must be 0");
    assert!(
        cap.to >= 2,
        "CAP.TO {} gives the host no time to wait for RDY",
        cap.to
    );
    assert!(cap.css_nvm, "CAP.CSS must include the NVM command set");
    assert_eq!(
        cap_raw >> 43 & 1,
        0,
        "CAP bit 43 would switch the host to CSI mode"
    );
    assert!(cap.mqes >= 127, "CAP.MQES {}", cap.mqes);
    a.prop_set(prop::CC, 0x0046_0000).ok();
    assert_eq!(a.prop_get(prop::CSTS, false) & 1, 0, "RDY before enable");
    assert_eq!(
        a.prop_get(prop::CAP, true),
        cap_raw,
        "CAP changed after a CC write"
    );
    a.prop_set(prop::CC, 0x0046_0001).ok();
    assert_eq!(
        a.prop_get(prop::CSTS, false) & 0x3,
        1,
        "RDY set synchronously, no CFS"
    );
    assert_eq!(a.prop_get(prop::CC, false), 0x0046_0001);
    let vs = a.prop_get(prop::VS, false);
    assert!(
        vs >= 0x0001_0300,
        "VS {vs:#x}: the host needs 1.3 for the descriptor list"
    );
    // 8-byte access to a 4-byte property is refused.
    a.prop_get_cmd(prop::VS, true)
        .expect_status(Status::INVALID_FIELD);

    // Identify Controller: the fields nvme_check_ctrl_fabric_info checks.
    let id = a.identify_controller();
    assert_eq!(
        id.cntlid, cntlid,
        "Identify CNTLID must equal the Connect DW0"
    );
    assert_eq!(id.mdts, 5, "MDTS 2^5 pages = 128 KiB");
    assert_ne!(id.sgls & 0x3, 0, "SGLS bits 1:0");
    assert_ne!(
        id.sgls & (1 << 20),
        0,
        "SGLS bit 20: in-capsule data offsets"
    );
    assert!(id.ioccsz >= 4, "IOCCSZ {}", id.ioccsz);
    assert_eq!(
        id.ioccsz as usize * 16 - 64,
        nvpool_target::limits::IO_INLINE_DATA_BYTES
    );
    assert!(id.iorcsz >= 1);
    assert_eq!(id.icdoff, 0);
    assert_eq!(id.subnqn, SUBNQN);
    assert_ne!(id.kas, 0, "KAS must be non-zero for an I/O controller");
    assert_eq!(id.cntrltype, cntrltype::IO);
    assert_ne!(id.maxcmd, 0);
    assert_ne!(
        id.cmic & 0x2,
        0,
        "CMIC bit 1: several controllers per subsystem"
    );
    assert_eq!(id.cmic & 0x8, 0, "no ANA");
    assert_eq!(id.vwc & 1, 1, "VWC: the host then sends Flush");
    assert_eq!((id.sqes, id.cqes), (0x66, 0x44));

    // Number of Queues.
    let (nsqa, ncqa) = a.set_queue_count(4);
    assert_eq!((nsqa, ncqa), (4, 4));

    // I/O queue 1 on a second connection.
    let mut q = Conn::open_ic(d.addr, NO_DIGESTS);
    q.io_connect(SUBNQN, HOST_A, cntlid, 1, 127).ok();

    // Namespace scan: active list, descriptors, Identify Namespace.
    assert_eq!(a.active_namespaces(0), vec![1, 3]);
    assert_eq!(a.active_namespaces(1), vec![3]);
    assert_eq!(a.active_namespaces(3), Vec::<u32>::new());
    let ns = a.identify_namespace(1);
    assert_eq!(ns.nsze, RAM_BLOCKS);
    assert_eq!(ns.ncap, RAM_BLOCKS);
    assert_eq!(ns.lbads, 9);
    assert_eq!(a.identify_namespace(3).nsze, (1 << 20) / 512);
    // An inactive NSID: all zeroes, success.
    assert_eq!(a.identify_namespace(2).ncap, 0);
    a.identify(cns::NAMESPACE, 0xFFFF_FFFF)
        .expect_status(Status::INVALID_NS);
    let descs = a.ns_descriptors(1);
    let uuid = descs
        .iter()
        .find_map(|d| match d {
            NsId::Uuid(u) => Some(*u),
            _ => None,
        })
        .expect("a UUID descriptor");
    assert_ne!(uuid, [0u8; 16]);
    let uuid3 = a
        .ns_descriptors(3)
        .into_iter()
        .find(|d| matches!(d, NsId::Uuid(_)));
    assert_ne!(
        uuid3,
        Some(NsId::Uuid(uuid)),
        "namespaces need distinct UUIDs"
    );

    // The I/O queue works.
    let data = pattern(1, 4096);
    q.write(1, 8, &data, 512, false).ok();
    assert_eq!(q.read_ok(1, 8, 8, 512), data);

    // A second controller of the same host sees the same identifiers and
    // gets a different CNTLID.
    let mut a2 = admin_session(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    assert_ne!(a2.cntlid, cntlid);
    assert_eq!(a2.identify_controller().cntlid, a2.cntlid);
    assert_eq!(
        a2.ns_descriptors(1),
        descs,
        "namespace IDs must be stable across controllers"
    );
    assert_eq!(a2.identify_namespace(1), ns);
}

#[test]
fn connect_parameters_are_checked() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let invalid = Status::CONNECT_INVALID_PARAMETERS;

    // Unknown subsystem: invalid parameter at SUBNQN (byte 256 of the data).
    let mut c = Conn::open_ic(d.addr, NO_DIGESTS);
    let r = c.admin_connect("nqn.2026-11.io.nvpool:nope", HOST_A, 0);
    r.expect_status(invalid);
    assert_eq!(r.dw0, 1 << 16 | 256, "IATTR/IPO point at SUBNQN");
    // Admin Connect with a CNTLID other than 0xFFFF.
    c.connect_cmd(0, 31, 0, 0, SUBNQN, HOST_A, 7)
        .expect_status(invalid);
    // Admin SQSIZE 0.
    c.connect_cmd(0, 0, 0, 0, SUBNQN, HOST_A, 0xFFFF)
        .expect_status(invalid);
    // Anything but Connect before Connect.
    c.identify(cns::CONTROLLER, 0)
        .expect_status(Status::COMMAND_SEQUENCE_ERROR);
    // The same connection can still connect properly.
    c.admin_connect(SUBNQN, HOST_A, 0).ok();
    c.enable();
    let cntlid = c.cntlid;
    // A second Connect on a connected queue.
    c.admin_connect(SUBNQN, HOST_A, 0)
        .expect_status(Status::COMMAND_SEQUENCE_ERROR);
    assert_eq!(c.set_queue_count(2), (2, 2));

    let io = |qid: u16, host: &str, cntlid: u16| {
        let mut q = Conn::open_ic(d.addr, NO_DIGESTS);
        let r = q.io_connect(SUBNQN, host, cntlid, qid, 127);
        (q, r)
    };
    // Unknown CNTLID, other host, QID beyond the granted count, SQSIZE too big.
    io(1, HOST_A, cntlid.wrapping_add(100))
        .1
        .expect_status(invalid);
    io(1, HOST_B, cntlid).1.expect_status(invalid);
    let (_, r) = io(3, HOST_A, cntlid);
    r.expect_status(invalid);
    assert_eq!(r.dw0, 42, "IPO points at QID in the SQE");
    let mut q = Conn::open_ic(d.addr, NO_DIGESTS);
    q.io_connect(SUBNQN, HOST_A, cntlid, 1, 4096)
        .expect_status(invalid);
    // The same connection then connects fine; a second connect of QID 1 does not.
    q.io_connect(SUBNQN, HOST_A, cntlid, 1, 63).ok();
    io(1, HOST_A, cntlid).1.expect_status(invalid);
    io(2, HOST_A, cntlid).1.ok();
    q.flush(1).ok();
}

/// `nvme disconnect`: CC.SHN=01b, then CSTS.SHST reaches 10b at once.
#[test]
fn orderly_shutdown_by_the_host() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let (mut a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    q.flush(1).ok();
    a.prop_set(prop::CC, 0x0046_0001 | 1 << 14).ok();
    let csts = a.prop_get(prop::CSTS, false);
    assert_eq!((csts >> 2) & 0x3, 0x2, "SHST complete, CSTS {csts:#x}");
    assert_eq!(csts & 1, 0, "RDY clears on shutdown");
    q.flush(1).expect_status(Status::COMMAND_SEQUENCE_ERROR);
}

/// Enabling with unsupported queue entry sizes or page size is a
/// controller fatal status, as on the Linux target.
#[test]
fn bad_cc_values_set_cfs() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    for cc in [0x0000_0001u64, 0x0046_0081, 0x0046_0801, 0x0046_0011] {
        let mut a = Conn::open_ic(d.addr, NO_DIGESTS);
        a.admin_connect(SUBNQN, HOST_A, 0).ok();
        a.prop_set(prop::CC, cc).ok();
        let csts = a.prop_get(prop::CSTS, false);
        assert_eq!(
            csts & 0x3,
            0x2,
            "CC {cc:#x}: CFS and not RDY, CSTS {csts:#x}"
        );
        a.identify(cns::CONTROLLER, 0)
            .expect_status(Status::COMMAND_SEQUENCE_ERROR);
    }
}
