//! Data integrity through the whole path: in-capsule and R2T writes, reads,
//! flush, Write Zeroes, deallocate and FUA, on RAM and file namespaces
//! (the file backend through io_uring), with and without digests, and with
//! many commands in flight on several queues at once.

mod common;

use common::*;
use nvpool_wire::tcp::Digests;
use std::path::Path;
use std::time::Duration;

/// Write/read-verify at every transfer shape the host uses, then the
/// other I/O commands. Block addresses are spread so runs do not overlap.
fn exercise(q: &mut Conn, nsid: u32, bs: usize, blocks: u64) {
    // 512 B (only on 512-byte namespaces), 4 KiB and 16 KiB in-capsule,
    // 64 KiB and 128 KiB (MDTS) through R2T in several H2CData PDUs.
    let mut lba = 0u64;
    for (i, len) in [512usize, 4096, 16 << 10, 64 << 10, 128 << 10]
        .into_iter()
        .enumerate()
    {
        if len < bs {
            continue;
        }
        let data = pattern(0x100 + i as u64, len);
        let n = (len / bs) as u32;
        q.write(nsid, lba, &data, bs, false).ok();
        assert_eq!(
            q.read_ok(nsid, lba, n, bs),
            data,
            "{len}-byte write at LBA {lba}"
        );
        lba += n as u64 + 3;
    }
    // Small writes through R2T too, and H2CData of one block each.
    let saved = q.h2c_chunk;
    q.h2c_chunk = bs;
    let data = pattern(7, 8 * bs);
    q.write_via(nsid, lba, &data, bs, false, false).ok();
    assert_eq!(q.read_ok(nsid, lba, 8, bs), data);
    q.h2c_chunk = saved;
    lba += 11;

    // Overwrite a middle part: neighbours stay.
    let base = pattern(8, 16 * bs);
    q.write(nsid, lba, &base, bs, false).ok();
    let mid = pattern(9, 4 * bs);
    q.write(nsid, lba + 6, &mid, bs, false).ok();
    let mut want = base.clone();
    want[6 * bs..10 * bs].copy_from_slice(&mid);
    assert_eq!(q.read_ok(nsid, lba, 16, bs), want);
    lba += 17;

    q.flush(nsid).ok();

    // Write Zeroes in the middle of written data.
    let data = pattern(10, 16 * bs);
    q.write(nsid, lba, &data, bs, false).ok();
    q.write_zeroes(nsid, lba + 4, 8).ok();
    let got = q.read_ok(nsid, lba, 16, bs);
    assert_eq!(got[..4 * bs], data[..4 * bs]);
    assert!(
        got[4 * bs..12 * bs].iter().all(|&b| b == 0),
        "Write Zeroes left data"
    );
    assert_eq!(got[12 * bs..], data[12 * bs..]);
    lba += 17;

    // Deallocate two ranges with the 4096-byte range list.
    let data = pattern(11, 32 * bs);
    q.write(nsid, lba, &data, bs, false).ok();
    q.deallocate(nsid, &[(lba + 2, 4), (lba + 20, 8)]).ok();
    let got = q.read_ok(nsid, lba, 32, bs);
    for (i, chunk) in got.chunks(bs).enumerate() {
        let gone = (2..6).contains(&i) || (20..28).contains(&i);
        if gone {
            assert!(chunk.iter().all(|&b| b == 0), "block {i} not deallocated");
        } else {
            assert_eq!(chunk, &data[i * bs..(i + 1) * bs], "block {i} changed");
        }
    }
    lba += 33;

    // FUA write.
    let data = pattern(12, 8 * bs);
    q.write(nsid, lba, &data, bs, true).ok();
    assert_eq!(q.read_ok(nsid, lba, 8, bs), data);

    // The last blocks of the namespace.
    let data = pattern(13, 4 * bs);
    q.write(nsid, blocks - 4, &data, bs, false).ok();
    assert_eq!(q.read_ok(nsid, blocks - 4, 4, bs), data);
}

fn run_ram(dg: Digests) {
    let d = Daemon::start(&[subsystem(
        SUBNQN,
        &[],
        &[(1, RAM_SPEC), (2, "ram:4M,block_size=4096")],
    )]);
    let (_a, mut q) = controller(d.addr, dg, SUBNQN, HOST_A);
    exercise(&mut q, 1, 512, RAM_BLOCKS);
    exercise(&mut q, 2, 4096, (4 << 20) / 4096);
}

/// The same I/O with reactors that spin on their completion queues before
/// sleeping (the spin, its back-off and the sleep after it all run).
#[test]
fn ram_namespaces_with_spinning_reactors() {
    let target = nvpool_target::Target::new(None).expect("target");
    target.set_reactor_spin_us(20);
    let d = Daemon::start_with(
        target,
        &[subsystem(
            SUBNQN,
            &[],
            &[(1, RAM_SPEC), (2, "ram:4M,block_size=4096")],
        )],
    );
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    exercise(&mut q, 1, 512, RAM_BLOCKS);
    exercise(&mut q, 2, 4096, (4 << 20) / 4096);
    // Idle for a while (the reactor sleeps), then busy again.
    std::thread::sleep(std::time::Duration::from_millis(120));
    exercise(&mut q, 1, 512, RAM_BLOCKS);
}

/// File namespaces: 512-byte and 4 KiB blocks, and an extent of a file.
/// After a flush the bytes are in the file where the namespace maps them.
fn run_file(dg: Digests) {
    const SIZE: u64 = 8 << 20;
    let (_dir, path) = scratch_file(SIZE);
    let p = path.display();
    let spec1 = format!("file:{p},length=4M");
    let spec2 = format!("file:{p},offset=4M,block_size=4096");
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, &spec1), (2, &spec2)])]);
    let (_a, mut q) = controller(d.addr, dg, SUBNQN, HOST_A);
    exercise(&mut q, 1, 512, (4 << 20) / 512);
    exercise(&mut q, 2, 4096, (4 << 20) / 4096);

    let a = pattern(20, 64 << 10);
    q.write(1, 100, &a, 512, false).ok();
    let b = pattern(21, 128 << 10);
    q.write(2, 10, &b, 4096, false).ok();
    q.flush(1).ok();
    q.flush(2).ok();
    assert_file_bytes(&path, 100 * 512, &a);
    assert_file_bytes(&path, (4 << 20) + 10 * 4096, &b);
}

#[track_caller]
fn assert_file_bytes(path: &Path, off: u64, want: &[u8]) {
    let all = std::fs::read(path).expect("read backing file");
    assert_eq!(
        &all[off as usize..off as usize + want.len()],
        want,
        "file bytes at {off}"
    );
}

#[test]
fn ram_namespaces() {
    run_ram(NO_DIGESTS);
}

#[test]
fn ram_namespaces_with_digests() {
    run_ram(ALL_DIGESTS);
}

#[test]
fn ram_namespaces_with_header_digest_only() {
    run_ram(Digests {
        header: true,
        data: false,
    });
}

#[test]
fn file_namespaces() {
    run_file(NO_DIGESTS);
}

#[test]
fn file_namespaces_with_digests() {
    run_file(ALL_DIGESTS);
}

#[test]
fn io_uring_is_available_for_file_backends() {
    // The file tests above go through io_uring only if the kernel lets us
    // have a ring; say so loudly instead of silently testing the fallback.
    if let Err(e) = nvpool_target::ring::Ring::new(8) {
        panic!("io_uring unavailable ({e}): file tests ran the synchronous fallback");
    }
}

/// SQ flow control disabled (CATTR bit 2): a successful read ends with a
/// C2HData carrying SUCCESS and no CapsuleResp; errors still get one.
#[test]
fn reads_complete_with_success_flag_without_sq_flow_control() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let mut a = admin_session(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    a.set_queue_count(1);
    let mut q = Conn::open_ic(d.addr, NO_DIGESTS);
    q.connect_cmd(1, 63, 0x04, 0, SUBNQN, HOST_A, a.cntlid).ok();
    let data = pattern(3, 8192);
    q.write(1, 0, &data, 512, false).ok();
    let c = q.read(1, 0, 16, 512);
    c.ok();
    assert!(c.by_success_flag, "read should end with SUCCESS in C2HData");
    assert_eq!(c.data, data);
    // No stray CapsuleResp for the read: the next PDU answers the flush.
    let f = q.flush(1);
    f.ok();
    assert!(!f.by_success_flag);
    let bad = q.read(1, RAM_BLOCKS, 1, 512);
    bad.expect_status(nvpool_wire::Status::LBA_OUT_OF_RANGE);
    assert!(!bad.by_success_flag);
}

/// A deep pipeline on one queue: `depth` commands sent back to back before
/// any completion is read, mixing in-capsule and R2T writes, then reads.
fn pipeline(q: &mut Conn, nsid: u32, base_lba: u64, depth: usize, seed: u64) {
    let mut expect = std::collections::HashMap::new();
    let mut lba = base_lba;
    let mut regions = Vec::new();
    for i in 0..depth {
        // Alternate 4 KiB in-capsule and 32 KiB via R2T.
        let len = if i % 2 == 0 { 4096 } else { 32 << 10 };
        let data = pattern(seed * 1000 + i as u64, len);
        let blocks = (len / 512) as u32;
        let cid = q.submit_write(
            write_cmd(nsid, lba, blocks, false),
            data.clone(),
            len <= 4096,
        );
        expect.insert(cid, ());
        regions.push((lba, blocks, data));
        lba += blocks as u64;
    }
    for _ in 0..depth {
        let c = q.next_completion();
        c.ok();
        assert!(
            expect.remove(&c.cid).is_some(),
            "unexpected or duplicate CID {}",
            c.cid
        );
    }
    let mut reads = std::collections::HashMap::new();
    for (lba, blocks, data) in &regions {
        let cid = q.submit(read_cmd(nsid, *lba, *blocks, 512));
        reads.insert(cid, data);
    }
    for _ in 0..depth {
        let c = q.next_completion();
        c.ok();
        let want = reads
            .remove(&c.cid)
            .unwrap_or_else(|| panic!("unexpected CID {}", c.cid));
        assert_eq!(&c.data, want, "pipelined read {}", c.cid);
    }
}

#[test]
fn parallel_queues_with_deep_pipelines() {
    let (_dir, path) = scratch_file(16 << 20);
    let spec = file_spec(&path);
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC), (2, &spec)])]);
    let mut a = admin_session(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    assert_eq!(a.set_queue_count(4), (4, 4));
    let cntlid = a.cntlid;
    let addr = d.addr;
    let workers: Vec<_> = (1..=4u16)
        .map(|qid| {
            std::thread::spawn(move || {
                let dg = if qid % 2 == 0 {
                    ALL_DIGESTS
                } else {
                    NO_DIGESTS
                };
                let mut q = io_session(addr, dg, SUBNQN, HOST_A, cntlid, qid);
                for round in 0..3u64 {
                    // Each queue owns a 1 MiB region per namespace.
                    let base = qid as u64 * 2048;
                    pipeline(&mut q, 1, base, 32, qid as u64 * 10 + round);
                    pipeline(&mut q, 2, base, 32, qid as u64 * 10 + round + 100);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("queue worker");
    }
    // The admin queue stayed responsive the whole time.
    a.keep_alive().ok();
}

/// Whole-MDTS transfers back to back: every write one 128 KiB H2CData PDU
/// (the receive buffer holds two), and 8 MiB of reads requested at once
/// (more than the transmit high-water mark, so the target pauses reading).
#[test]
fn large_transfers_pipelined() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    for dg in [NO_DIGESTS, ALL_DIGESTS] {
        let (_a, mut q) = controller(d.addr, dg, SUBNQN, HOST_A);
        q.h2c_chunk = usize::MAX;
        let mdts = 128 << 10;
        let mut want = std::collections::HashMap::new();
        let mut cids = Vec::new();
        for i in 0..64u64 {
            let data = pattern(500 + i, mdts);
            let cmd = write_cmd(1, i * 256, 256, false);
            let cid = q.submit_write(cmd, data.clone(), false);
            want.insert(i * 256, data);
            cids.push(cid);
        }
        for _ in 0..64 {
            let c = q.next_completion();
            c.ok();
            assert!(cids.contains(&c.cid));
        }
        let mut reads = std::collections::HashMap::new();
        for i in 0..64u64 {
            let cid = q.submit(read_cmd(1, i * 256, 256, 512));
            reads.insert(cid, i * 256);
        }
        for _ in 0..64 {
            let c = q.next_completion();
            c.ok();
            let lba = reads.remove(&c.cid).expect("a read in flight");
            assert!(c.data == want[&lba], "128 KiB read at LBA {lba}");
        }
    }
}

/// TCP is a byte stream: PDUs split into odd pieces, and many PDUs in one
/// segment, must both work.
#[test]
fn pdus_split_into_pieces_and_coalesced() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let mut a = admin_session(d.addr, ALL_DIGESTS, SUBNQN, HOST_A);
    a.set_queue_count(1);
    let cntlid = a.cntlid;

    // ICReq and Connect dribbled in 7-byte pieces.
    let mut q = Conn::open(d.addr);
    let mut bytes = nvpool_wire::tcp::IcReq {
        pfv: 0,
        hpda: 0,
        digests: ALL_DIGESTS,
        maxr2t: 0,
    }
    .encode()
    .to_vec();
    let connect = nvpool_wire::fabrics::ConnectCmd {
        recfmt: 0,
        qid: 1,
        sqsize: 63,
        cattr: 0,
        kato_ms: 0,
    }
    .to_sqe(7);
    let cdata = nvpool_wire::fabrics::ConnectData {
        hostid: host_id(HOST_A),
        cntlid,
        subnqn: SUBNQN,
        hostnqn: HOST_A,
    }
    .encode();
    bytes.extend(capsule_pdu(&connect, &cdata, ALL_DIGESTS));
    for piece in bytes.chunks(7) {
        q.send_raw(piece);
        std::thread::sleep(Duration::from_micros(200));
    }
    let mut icresp = [0u8; 128];
    std::io::Read::read_exact(&mut q.sock, &mut icresp).expect("ICResp");
    q.dg = ALL_DIGESTS;
    q.maxh2cdata = nvpool_target::limits::MAXH2CDATA_BYTES;
    q.wait(7).ok();

    // Twenty writes in one send, then a 64 KiB write whose H2CData PDUs
    // arrive split mid-header and mid-digest.
    let mut batch = Vec::new();
    let mut want = Vec::new();
    for i in 0..20u16 {
        let data = pattern(900 + i as u64, 1024);
        let mut w = write_cmd(1, i as u64 * 2, 2, false);
        w.set_sgl(nvpool_wire::Sgl {
            addr: 0,
            len: 1024,
            id: nvpool_wire::sqe::sgl_id::IN_CAPSULE,
        });
        w.set_cid(1000 + i);
        batch.extend(capsule_pdu(&w, &data, ALL_DIGESTS));
        want.extend(data);
    }
    q.send_raw(&batch);
    let mut done: Vec<u16> = (0..20).map(|_| q.next_completion().ok().cid).collect();
    done.sort_unstable();
    assert_eq!(done, (1000..1020).collect::<Vec<_>>());
    assert_eq!(q.read_ok(1, 0, 40, 512), want);

    let big = pattern(950, 64 << 10);
    let mut w = write_cmd(1, 1000, 128, false);
    w.set_sgl(nvpool_wire::Sgl {
        addr: 0,
        len: big.len() as u32,
        id: nvpool_wire::sqe::sgl_id::TRANSPORT,
    });
    w.set_cid(2000);
    q.send_raw(&capsule_pdu(&w, &[], ALL_DIGESTS));
    let r = q.recv_pdu().expect("R2T").r2t();
    let mut stream = Vec::new();
    for (i, part) in big.chunks(16 << 10).enumerate() {
        let last = i == 3;
        stream.extend(h2c_pdu(
            2000,
            r.ttag,
            (i * (16 << 10)) as u32,
            part,
            last,
            ALL_DIGESTS,
        ));
    }
    for piece in stream.chunks(9973) {
        q.send_raw(piece);
        std::thread::sleep(Duration::from_micros(500));
    }
    q.wait(2000).ok();
    assert_eq!(q.read_ok(1, 1000, 128, 512), big);
}
