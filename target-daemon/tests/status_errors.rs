//! Command errors that are NVMe statuses: the command fails with the
//! status the spec names, and the connection keeps working afterwards.

mod common;

use common::*;
use nvpool_wire::fabrics::prop;
use nvpool_wire::sqe::admin;
use nvpool_wire::{Sgl, Sqe, Status};

fn daemon() -> Daemon {
    Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])])
}

/// The queue still does real I/O.
#[track_caller]
fn still_works(q: &mut Conn, seed: u64) {
    let data = pattern(seed, 4096);
    q.write(1, 64, &data, 512, false).ok();
    assert_eq!(q.read_ok(1, 64, 8, 512), data);
}

#[test]
fn lba_out_of_range() {
    let d = daemon();
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let lor = Status::LBA_OUT_OF_RANGE;
    // Read and write running one block past the end.
    q.read(1, RAM_BLOCKS - 1, 2, 512).expect_status(lor);
    still_works(&mut q, 1);
    q.write(1, RAM_BLOCKS - 1, &[0u8; 1024], 512, false)
        .expect_status(lor);
    // Past the end through R2T: refused before any data moves.
    q.write_via(1, RAM_BLOCKS, &[0u8; 32 << 10], 512, false, false)
        .expect_status(lor);
    // SLBA + NLB wrapping past 2^64.
    q.read(1, u64::MAX, 2, 512).expect_status(lor);
    q.write_zeroes(1, RAM_BLOCKS - 4, 8).expect_status(lor);
    q.deallocate(1, &[(RAM_BLOCKS - 1, 2)]).expect_status(lor);
    // The last block itself is fine.
    q.read_ok(1, RAM_BLOCKS - 1, 1, 512);
    still_works(&mut q, 2);
}

#[test]
fn transfer_larger_than_mdts() {
    let d = daemon();
    let (mut a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let mdts = 4096usize << a.identify_controller().mdts;
    let blocks = (mdts / 512) as u32 + 1;
    q.read(1, 0, blocks, 512)
        .expect_status(Status::INVALID_FIELD);
    still_works(&mut q, 3);
    // A write above MDTS announced for R2T: no R2T, an error.
    q.write_via(1, 0, &vec![7u8; mdts + 512], 512, false, false)
        .expect_status(Status::INVALID_FIELD);
    still_works(&mut q, 4);
    // Exactly MDTS is fine.
    assert_eq!(q.read_ok(1, 0, blocks - 1, 512).len(), mdts);
}

#[test]
fn sgl_length_must_match_the_blocks() {
    let d = daemon();
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let mut r = read_cmd(1, 0, 8, 512);
    r.set_sgl(Sgl {
        addr: 0,
        len: 2048,
        id: nvpool_wire::sqe::sgl_id::TRANSPORT,
    });
    q.exec(r).expect_status(Status::SGL_DATA_INVALID);
    // In-capsule data on a read-direction command.
    let mut r = read_cmd(1, 0, 1, 512);
    r.set_sgl(Sgl {
        addr: 0,
        len: 512,
        id: nvpool_wire::sqe::sgl_id::IN_CAPSULE,
    });
    let cid = 77;
    r.set_cid(cid);
    let dg = q.dg;
    q.send_raw(&capsule_pdu(&r, &[0u8; 512], dg));
    q.wait(cid).expect_status(Status::INVALID_FIELD);
    still_works(&mut q, 5);
}

#[test]
fn unknown_namespace() {
    let d = daemon();
    let (mut a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let ins = Status::INVALID_NS;
    q.read(2, 0, 1, 512).expect_status(ins);
    q.write(0, 0, &[1u8; 512], 512, false).expect_status(ins);
    q.flush(5).expect_status(ins);
    q.write_zeroes(9, 0, 1).expect_status(ins);
    a.identify(nvpool_wire::identify::cns::NS_DESCRIPTORS, 2)
        .expect_status(ins);
    still_works(&mut q, 6);
}

#[test]
fn unknown_opcodes() {
    let d = daemon();
    let (mut a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    for op in [0x7Eu8, 0x05, 0x80, 0xC1] {
        let mut s = Sqe::new(op, 0);
        s.set_nsid(1);
        s.set_sgl(NULL_SGL);
        q.exec(s).expect_status(Status::INVALID_OPCODE);
    }
    for op in [0x55u8, 0x7E, 0x10] {
        let mut s = Sqe::new(op, 0);
        s.set_sgl(NULL_SGL);
        a.exec(s).expect_status(Status::INVALID_OPCODE);
    }
    // A fabrics command type nobody implements.
    let mut s = Sqe::new(admin::FABRICS, 0);
    s.set_fctype(0x7C);
    s.set_sgl(NULL_SGL);
    a.exec(s).expect_status(Status::INVALID_OPCODE);
    // Not SGLs (PSDT 0): invalid field.
    let mut s = flush_cmd(1);
    s.0[1] = 0;
    q.exec(s).expect_status(Status::INVALID_FIELD);
    still_works(&mut q, 7);
    a.keep_alive().ok();
}

#[test]
fn commands_before_enable_are_sequence_errors() {
    let d = daemon();
    let cse = Status::COMMAND_SEQUENCE_ERROR;
    let mut a = Conn::open_ic(d.addr, NO_DIGESTS);
    a.admin_connect(SUBNQN, HOST_A, 0).ok();
    // Admin commands and I/O queue Connect need CC.EN=1 and CSTS.RDY.
    a.identify(nvpool_wire::identify::cns::CONTROLLER, 0)
        .expect_status(cse);
    a.keep_alive().expect_status(cse);
    let mut q = Conn::open_ic(d.addr, NO_DIGESTS);
    q.io_connect(SUBNQN, HOST_A, a.cntlid, 1, 127)
        .expect_status(cse);

    a.enable();
    a.set_queue_count(1);
    q.io_connect(SUBNQN, HOST_A, a.cntlid, 1, 127).ok();
    still_works(&mut q, 8);

    // Disable again (CC.EN=0): I/O is a sequence error until re-enabled.
    a.prop_set(prop::CC, 0x0046_0000).ok();
    assert_eq!(a.prop_get(prop::CSTS, false) & 1, 0);
    q.read(1, 0, 1, 512).expect_status(cse);
    q.write(1, 0, &[1u8; 512], 512, false).expect_status(cse);
    a.enable();
    still_works(&mut q, 9);
}

#[test]
fn data_digest_mismatch_in_capsule() {
    let d = daemon();
    let (_a, mut q) = controller(d.addr, ALL_DIGESTS, SUBNQN, HOST_A);
    let good = pattern(10, 4096);
    q.write(1, 0, &good, 512, false).ok();

    let bad = pattern(11, 4096);
    let mut w = write_cmd(1, 0, 8, false);
    w.set_sgl(Sgl {
        addr: 0,
        len: 4096,
        id: nvpool_wire::sqe::sgl_id::IN_CAPSULE,
    });
    w.set_cid(500);
    let mut pdu = capsule_pdu(&w, &bad, ALL_DIGESTS);
    let n = pdu.len();
    pdu[n - 1] ^= 0x5A; // damage the DDGST
    q.send_raw(&pdu);
    let c = q.wait(500);
    assert_eq!(
        (c.status.sct, c.status.sc),
        (0, 0x22),
        "transient transport error, got {}",
        c.status
    );
    assert_eq!(
        q.read_ok(1, 0, 8, 512),
        good,
        "damaged data must not be written"
    );
    still_works(&mut q, 12);
}

#[test]
fn data_digest_mismatch_in_h2c_data() {
    let d = daemon();
    let (_a, mut q) = controller(d.addr, ALL_DIGESTS, SUBNQN, HOST_A);
    let good = pattern(13, 64 << 10);
    q.write(1, 0, &good, 512, false).ok();

    let bad = pattern(14, 64 << 10);
    let mut w = write_cmd(1, 0, 128, false);
    w.set_sgl(Sgl {
        addr: 0,
        len: bad.len() as u32,
        id: nvpool_wire::sqe::sgl_id::TRANSPORT,
    });
    w.set_cid(600);
    q.send_raw(&capsule_pdu(&w, &[], ALL_DIGESTS));
    let p = q.recv_pdu().expect("R2T");
    let r = p.r2t();
    assert_eq!((r.cccid, r.r2to, r.r2tl), (600, 0, bad.len() as u32));
    // Two H2CData PDUs; the second has a damaged data digest.
    let half = bad.len() / 2;
    q.send_raw(&h2c_pdu(600, r.ttag, 0, &bad[..half], false, ALL_DIGESTS));
    let mut second = h2c_pdu(600, r.ttag, half as u32, &bad[half..], true, ALL_DIGESTS);
    let n = second.len();
    second[n - 2] ^= 0x01;
    q.send_raw(&second);
    let c = q.wait(600);
    assert_eq!(
        (c.status.sct, c.status.sc),
        (0, 0x22),
        "transient transport error, got {}",
        c.status
    );
    assert_eq!(
        q.read_ok(1, 0, 128, 512),
        good,
        "damaged data must not be written"
    );
    still_works(&mut q, 15);
}

#[test]
fn keep_alive_on_a_controller_without_kato() {
    let d = daemon();
    let mut a = Conn::open_ic(d.addr, NO_DIGESTS);
    a.admin_connect(SUBNQN, HOST_A, 0).ok();
    a.enable();
    a.keep_alive().expect_status(Status::KATO_INVALID);
    a.identify_controller();
}

#[test]
fn unknown_log_page_and_feature() {
    let d = daemon();
    let mut a = admin_session(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let c = a.get_log_page(0x70, 0, 0, 1024);
    assert!(
        !c.status.is_success(),
        "the discovery log is not on an I/O controller"
    );
    assert!(c.status.dnr);
    a.get_log_page(0x02, 0xFFFF_FFFF, 0, 512).ok();
    a.get_log_page(0x02, 0xFFFF_FFFF, 2, 64)
        .expect_status(Status::INVALID_FIELD);
    a.set_features(0x7E, 0).expect_status(Status::INVALID_FIELD);
    a.identify(0x55, 0).expect_status(Status::INVALID_FIELD);
    a.keep_alive().ok();
}

/// Failed commands are logged in the Error Information log (01h) with the
/// CID, queue, status, namespace and the LBA the command named.
#[test]
fn error_log_records_failed_commands() {
    let d = daemon();
    let (mut a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    // A successful command first, so the slot the failing one reuses has history.
    q.read_ok(1, 100, 1, 512);
    let bad_lba = RAM_BLOCKS + 5;
    let failed = q.read(1, bad_lba, 1, 512);
    failed.expect_status(Status::LBA_OUT_OF_RANGE);
    let log = a.get_log_page(0x01, 0, 0, 64);
    log.ok();
    let e = nvpool_wire::log::ErrorEntry::decode(&log.data).expect("error entry");
    assert!(e.error_count >= 1);
    assert_eq!(e.sqid, 1);
    assert_eq!(e.cid, failed.cid);
    assert_eq!(e.status & !1, Status::LBA_OUT_OF_RANGE.to_wire());
    assert_eq!(e.nsid, 1);
    assert_eq!(
        e.lba, bad_lba,
        "error log LBA is the failing command's SLBA"
    );
}

/// A read-only namespace: reads and flushes work, writes of any kind fail
/// with Namespace Is Write Protected, and Identify says so.
#[test]
fn read_only_namespace() {
    let d = daemon();
    let mut cfg = subsystem(SUBNQN, &[], &[(1, RAM_SPEC), (2, "ram:1M")]);
    cfg.namespaces[1].read_only = true;
    d.target.put_subsystem(&cfg).expect("read-only namespace");
    let (mut a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let id = a.identify(nvpool_wire::identify::cns::NAMESPACE, 2);
    id.ok();
    assert_eq!(id.data[99] & 1, 1, "NSATTR write protected");
    let wp = Status::NS_WRITE_PROTECTED;
    q.write(2, 0, &[1u8; 512], 512, false).expect_status(wp);
    q.write_via(2, 0, &[1u8; 32768], 512, false, false)
        .expect_status(wp);
    q.write_zeroes(2, 0, 1).expect_status(wp);
    q.deallocate(2, &[(0, 1)]).expect_status(wp);
    assert!(q.read_ok(2, 0, 1, 512).iter().all(|&b| b == 0));
    q.flush(2).ok();
    still_works(&mut q, 16);
}
