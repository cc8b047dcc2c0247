//! Errors a caller must see as errors, without losing the queue: command
//! statuses from the controller, and requests the queue refuses to send.

mod common;

use common::*;
use nvpool_initiator::{Controller, Error, IoError, Op};
use nvpool_wire::Status;

#[track_caller]
fn expect_status(r: Result<(), IoError>, want: Status, what: &str) {
    match r {
        Err(IoError::Status(s)) if same_code(s, want) => {}
        other => panic!("{what}: expected {want}, got {other:?}"),
    }
}

#[test]
fn lba_out_of_range_is_a_status_and_the_queue_keeps_working() {
    let t = Tgt::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let c = Controller::connect(params(t.addr, SUBNQN, HOST_A)).expect("connect");
    let mut q = c.io_queue(1).expect("queue");
    q.set_block_size(512);
    let lor = Status::LBA_OUT_OF_RANGE;

    // Reads and writes that cross or start past the end, small and large.
    let cases = [
        (Op::Read, RAM_BLOCKS - 1, 2),
        (Op::Read, RAM_BLOCKS, 1),
        (Op::Read, RAM_BLOCKS - 8, 256),
        (Op::Write, RAM_BLOCKS - 1, 2),
        (Op::Write, RAM_BLOCKS - 8, 256),
        (Op::Read, u64::MAX - 1, 1),
    ];
    for (i, &(op, lba, blocks)) in cases.iter().enumerate() {
        let c = exec1(
            &mut q,
            req(op, lba, blocks, vec![0x5A; blocks as usize * 512], i as u64),
        );
        assert_eq!(c.token, i as u64);
        assert_eq!(c.buf.len(), blocks as usize * 512, "buffer comes back");
        expect_status(c.result, lor, &format!("{op:?} {blocks} at {lba}"));
    }
    for (op, lba) in [
        (Op::WriteZeroes { deallocate: false }, RAM_BLOCKS - 4),
        (Op::Deallocate, RAM_BLOCKS - 4),
    ] {
        let c = exec1(&mut q, req(op, lba, 8, Vec::new(), 0));
        expect_status(c.result, lor, &format!("{op:?}"));
    }

    // Errors mixed into a full batch fail only themselves.
    let depth = q.depth();
    let batch = (0..depth)
        .map(|i| {
            let lba = if i % 3 == 0 { RAM_BLOCKS } else { i as u64 * 8 };
            req(Op::Write, lba, 8, pattern(i as u64, 4096), i as u64)
        })
        .collect();
    for c in exec(&mut q, batch) {
        if c.token % 3 == 0 {
            expect_status(c.result, lor, "past the end in a batch");
        } else {
            c.result.expect("in range in a batch");
        }
    }
    // The last valid block still works, and data is intact.
    write(&mut q, RAM_BLOCKS - 1, &pattern(9, 512), 512).expect("last block");
    assert_same(
        &read(&mut q, RAM_BLOCKS - 1, 512, 512).expect("read last"),
        &pattern(9, 512),
        "last block",
    );
    assert_same(
        &read(&mut q, 8, 4096, 512).expect("read"),
        &pattern(1, 4096),
        "batch slot 1",
    );
}

#[test]
fn invalid_namespace_is_a_status() {
    let t = Tgt::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let c = Controller::connect(params(t.addr, SUBNQN, HOST_A)).expect("connect");
    let mut q = c.io_queue(1).expect("queue");
    let mut r = req(Op::Read, 0, 1, vec![0; 512], 0);
    r.nsid = 2;
    expect_status(exec1(&mut q, r).result, Status::INVALID_NS, "nsid 2");
    assert!(read(&mut q, 0, 512, 512).is_ok(), "queue still works");
}

#[test]
fn oversized_and_malformed_requests_are_refused_before_sending() {
    let t = Tgt::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let c = Controller::connect(params(t.addr, SUBNQN, HOST_A)).expect("connect");
    let mut q = c.io_queue(1).expect("queue");
    q.set_block_size(512);
    let max = q.max_transfer();
    assert_eq!(max, 128 << 10);

    let bad = [
        // One block more than MDTS.
        req(Op::Write, 0, (max / 512 + 1) as u32, vec![1; max + 512], 1),
        req(Op::Read, 0, (max / 512 + 1) as u32, vec![0; max + 512], 2),
        // Zero blocks.
        req(Op::Read, 0, 0, vec![0; 512], 3),
        // A buffer shorter than the transfer.
        req(Op::Write, 0, 8, vec![1; 1024], 4),
        // Write Zeroes of zero blocks.
        req(Op::WriteZeroes { deallocate: false }, 0, 0, Vec::new(), 5),
    ];
    for r in bad {
        let token = r.token;
        let (back, e) = q.submit(r).expect_err("refused");
        assert_eq!(back.token, token, "the request comes back");
        assert!(matches!(e, Error::Invalid(_)), "{token}: {e:?}");
        assert_eq!(q.outstanding(), 0, "{token}: nothing queued");
    }
    // Nothing was sent: the next command is the first the target sees, and
    // exactly MDTS still works.
    let data = pattern(3, max);
    write(&mut q, 0, &data, 512).expect("MDTS write");
    assert_same(
        &read(&mut q, 0, max, 512).expect("MDTS read"),
        &data,
        "MDTS",
    );
    let errors = t
        .target
        .controller(c.identify.cntlid)
        .expect("controller")
        .error_entries();
    assert!(
        errors.is_empty(),
        "the target saw no bad command: {errors:?}"
    );
}

/// `Request::buf` may be longer than the transfer (submit only refuses a
/// shorter one), but the queue then infers the block size from the buffer
/// length instead of using the namespace block size it was told, and sends
/// a command whose data length disagrees with its block count.
#[test]
fn read_into_a_larger_buffer_uses_the_namespace_block_size() {
    let t = Tgt::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let c = Controller::connect(params(t.addr, SUBNQN, HOST_A)).expect("connect");
    let mut q = c.io_queue(1).expect("queue");
    q.set_block_size(512);
    write(&mut q, 0, &pattern(5, 4096), 512).expect("write");
    // One 512-byte block into a reused 4 KiB buffer.
    let c1 = exec1(&mut q, req(Op::Read, 0, 1, vec![0; 4096], 0));
    c1.result.expect("1-block read into a 4 KiB buffer");
    assert_same(&c1.buf[..512], &pattern(5, 4096)[..512], "block 0");
    // And a 1-block write from a 4 KiB buffer writes one block only.
    exec1(&mut q, req(Op::Write, 1, 1, vec![0xEE; 4096], 0))
        .result
        .expect("1-block write from a 4 KiB buffer");
    let got = read(&mut q, 0, 4096, 512).expect("read");
    assert!(got[512..1024].iter().all(|&b| b == 0xEE), "block 1 written");
    assert_same(
        &got[1024..],
        &pattern(5, 4096)[1024..],
        "blocks 2.. untouched",
    );
}
