//! Data through the initiator: every transfer shape (in-capsule writes up to
//! 16 KiB, R2T writes above, reads split into C2HData PDUs), with no digests,
//! header digests and header+data digests, on RAM and file (O_DIRECT +
//! io_uring) namespaces; full queues, parallel queues, Flush, Write Zeroes,
//! Deallocate and FUA.

mod common;

use common::*;
use nvpool_initiator::{Controller, IoQueue, NamespaceInfo, Op};
use nvpool_wire::tcp::Digests;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Sizes covering in-capsule (≤ 16 KiB) and R2T (> 16 KiB, up to MDTS).
const SIZES: [usize; 5] = [512, 4096, 16 << 10, 64 << 10, 128 << 10];

#[derive(Clone, Copy, Debug)]
enum Backend {
    Ram,
    File,
}

/// A target with one namespace of 32 MiB on `backend`, a controller with
/// `digests`, and its namespace 1.
struct Setup {
    _dir: Option<tempfile::TempDir>,
    t: Tgt,
    c: Arc<Controller>,
    ns: NamespaceInfo,
}

fn setup(backend: Backend, digests: Digests) -> Setup {
    let (dir, spec) = match backend {
        Backend::Ram => (None, "ram:32M".to_owned()),
        Backend::File => {
            let (d, p) = scratch_file(32 << 20);
            (Some(d), file_spec(&p))
        }
    };
    let t = Tgt::start(&[subsystem(SUBNQN, &[], &[(1, &spec)])]);
    let mut p = params(t.addr, SUBNQN, HOST_A);
    p.digests = digests;
    let c = Controller::connect(p).expect("connect");
    let ns = c.namespace(1).expect("namespace 1");
    assert_eq!(ns.block_size, 512);
    assert_eq!(ns.size_bytes(), 32 << 20);
    Setup {
        _dir: dir,
        t,
        c,
        ns,
    }
}

fn queue(s: &Setup, qid: u16) -> IoQueue {
    let mut q = s.c.io_queue(qid).expect("I/O queue");
    q.set_block_size(s.ns.block_size);
    q
}

/// Each size written at a few places (block 0, an odd block, the very end
/// of the namespace) and read back; then overwritten and read again.
fn sizes_round_trip(s: &Setup) {
    let mut q = queue(s, 1);
    let bs = s.ns.block_size;
    let mut seed = 1;
    for &len in &SIZES {
        let blocks = (len / bs as usize) as u64;
        for lba in [0, 13, s.ns.blocks - blocks] {
            for round in 0..2 {
                seed += 1;
                let data = pattern(seed, len);
                write(&mut q, lba, &data, bs)
                    .unwrap_or_else(|e| panic!("write {len} B at {lba} round {round}: {e}"));
                let got = read(&mut q, lba, len, bs)
                    .unwrap_or_else(|e| panic!("read {len} B at {lba} round {round}: {e}"));
                assert_same(&got, &data, &format!("{len} B at LBA {lba} round {round}"));
            }
        }
    }
}

/// Fills the queue with writes of mixed sizes, then with reads of them.
fn full_queue(s: &Setup) {
    let mut q = queue(s, 2);
    let bs = s.ns.block_size as usize;
    let depth = q.depth();
    assert_eq!(depth, 32);
    // Slot i owns 128 KiB starting at 4 MiB + i × 128 KiB.
    let base = (4 << 20) / bs as u64;
    let region = (128 << 10) / bs as u64;
    let len_of = |i: usize| SIZES[i % SIZES.len()];
    let writes = (0..depth)
        .map(|i| {
            let len = len_of(i);
            req(
                Op::Write,
                base + i as u64 * region,
                (len / bs) as u32,
                pattern(1000 + i as u64, len),
                i as u64,
            )
        })
        .collect();
    for c in exec(&mut q, writes) {
        c.result
            .unwrap_or_else(|e| panic!("write {} failed: {e}", c.token));
    }
    let reads = (0..depth)
        .map(|i| {
            let len = len_of(i);
            req(
                Op::Read,
                base + i as u64 * region,
                (len / bs) as u32,
                vec![0u8; len],
                i as u64,
            )
        })
        .collect();
    for c in exec(&mut q, reads) {
        let i = c.token as usize;
        c.result.unwrap_or_else(|e| panic!("read {i} failed: {e}"));
        assert_same(
            &c.buf,
            &pattern(1000 + i as u64, len_of(i)),
            &format!("slot {i}"),
        );
    }
    // One more than the depth does not fit.
    let mut extra = Vec::new();
    for i in 0..depth {
        q.submit(req(Op::Read, base, 1, vec![0u8; bs], i as u64))
            .map_err(|(_, e)| e)
            .expect("fits");
    }
    let (back, e) = q
        .submit(req(Op::Read, base, 1, vec![0u8; bs], 99))
        .expect_err("queue full");
    assert_eq!(back.token, 99, "the refused request comes back");
    assert!(e.to_string().contains("full"), "{e}");
    let deadline = Instant::now() + WAIT;
    while extra.len() < depth {
        assert!(Instant::now() < deadline, "reads outstanding");
        q.poll(&mut extra, Duration::from_millis(200))
            .expect("poll");
    }
    assert!(extra.iter().all(|c| c.result.is_ok()));
}

fn data_suite(backend: Backend, digests: Digests) {
    let s = setup(backend, digests);
    sizes_round_trip(&s);
    full_queue(&s);
    drop(s.t);
}

#[test]
fn ram_no_digests() {
    data_suite(Backend::Ram, Digests::default());
}

#[test]
fn ram_header_digest() {
    data_suite(
        Backend::Ram,
        Digests {
            header: true,
            data: false,
        },
    );
}

#[test]
fn ram_header_and_data_digests() {
    data_suite(
        Backend::Ram,
        Digests {
            header: true,
            data: true,
        },
    );
}

#[test]
fn file_no_digests() {
    data_suite(Backend::File, Digests::default());
}

#[test]
fn file_header_digest() {
    data_suite(
        Backend::File,
        Digests {
            header: true,
            data: false,
        },
    );
}

#[test]
fn file_header_and_data_digests() {
    data_suite(
        Backend::File,
        Digests {
            header: true,
            data: true,
        },
    );
}

/// Every granted queue driven by its own thread at full depth, on its own
/// region, with verified reads; digests on so both directions are checked.
#[test]
fn parallel_queues_on_file() {
    let s = setup(
        Backend::File,
        Digests {
            header: true,
            data: true,
        },
    );
    let n = s.c.io_queue_count();
    assert_eq!(n, 2);
    let bs = s.ns.block_size;
    let region_bytes = (s.ns.size_bytes() / n as u64) as usize;
    std::thread::scope(|sc| {
        for qid in 1..=n {
            let mut q = queue(&s, qid);
            sc.spawn(move || {
                let first = (qid as u64 - 1) * (region_bytes / bs as usize) as u64;
                let depth = q.depth();
                for round in 0..3u64 {
                    let len_of = |i: usize| SIZES[(i + round as usize) % SIZES.len()];
                    // Slot i of this queue owns 128 KiB of the region.
                    let lba_of = |i: usize| first + (i * (128 << 10) / bs as usize) as u64;
                    let seed_of = |i: usize| (qid as u64) << 32 | round << 16 | i as u64;
                    let writes = (0..depth)
                        .map(|i| {
                            let len = len_of(i);
                            req(
                                Op::Write,
                                lba_of(i),
                                len as u32 / bs,
                                pattern(seed_of(i), len),
                                i as u64,
                            )
                        })
                        .collect();
                    for c in exec(&mut q, writes) {
                        c.result.expect("parallel write");
                    }
                    let reads = (0..depth)
                        .map(|i| {
                            let len = len_of(i);
                            req(Op::Read, lba_of(i), len as u32 / bs, vec![0; len], i as u64)
                        })
                        .collect();
                    for c in exec(&mut q, reads) {
                        let i = c.token as usize;
                        c.result.expect("parallel read");
                        assert_same(
                            &c.buf,
                            &pattern(seed_of(i), len_of(i)),
                            &format!("queue {qid} round {round} slot {i}"),
                        );
                    }
                }
            });
        }
    });
}

fn flush_zeroes_deallocate_fua(backend: Backend) {
    let s = setup(backend, Digests::default());
    assert!(
        s.ns.zeroes_on_deallocate,
        "deallocated blocks read as zeroes (DLFEAT)"
    );
    let mut q = queue(&s, 1);
    let bs = s.ns.block_size;
    let len = 64 << 10;
    let blocks = (len / bs as usize) as u32;
    let half = len / 2;

    // Flush, alone and after writes.
    let c = exec1(&mut q, req(Op::Flush, 0, 0, Vec::new(), 7));
    assert_eq!(c.token, 7);
    c.result.expect("flush");

    // FUA write, read back.
    let data = pattern(77, len);
    let mut r = req(Op::Write, 0, blocks, data.clone(), 0);
    r.fua = true;
    exec1(&mut q, r).result.expect("FUA write");
    assert_same(&read(&mut q, 0, len, bs).expect("read"), &data, "FUA data");
    exec1(&mut q, req(Op::Flush, 0, 0, Vec::new(), 0))
        .result
        .expect("flush after writes");

    // Write Zeroes (both flavours) and Deallocate over the first half of a
    // written range: the first half reads zero, the second keeps its data.
    let ops = [
        Op::WriteZeroes { deallocate: false },
        Op::WriteZeroes { deallocate: true },
        Op::Deallocate,
    ];
    for (k, op) in ops.into_iter().enumerate() {
        let lba = 1024 + k as u64 * 256;
        let data = pattern(100 + k as u64, len);
        write(&mut q, lba, &data, bs).expect("write before zeroing");
        let c = exec1(&mut q, req(op, lba, blocks / 2, Vec::new(), 0));
        c.result.unwrap_or_else(|e| panic!("{op:?}: {e}"));
        let got = read(&mut q, lba, len, bs).expect("read after zeroing");
        assert!(
            got[..half].iter().all(|&b| b == 0),
            "{op:?}: first half reads zeroes"
        );
        assert_same(
            &got[half..],
            &data[half..],
            &format!("{op:?}: untouched half"),
        );
    }
    // Write Zeroes of the largest count the command encodes (65536 blocks
    // = 32 MiB), i.e. the whole namespace here.
    let c = exec1(
        &mut q,
        req(
            Op::WriteZeroes { deallocate: true },
            0,
            s.ns.blocks as u32,
            Vec::new(),
            0,
        ),
    );
    c.result.expect("write zeroes of the whole namespace");
    let got = read(&mut q, 0, len, bs).expect("read");
    assert!(got.iter().all(|&b| b == 0), "whole namespace zeroed");
    // Beyond 65536 blocks is refused before sending.
    let (_, e) = q
        .submit(req(
            Op::WriteZeroes { deallocate: false },
            0,
            65537,
            Vec::new(),
            0,
        ))
        .expect_err("too many blocks");
    assert!(e.to_string().contains("65536"), "{e}");
    assert_eq!(q.outstanding(), 0);
}

#[test]
fn flush_zeroes_deallocate_fua_ram() {
    flush_zeroes_deallocate_fua(Backend::Ram);
}

#[test]
fn flush_zeroes_deallocate_fua_file() {
    flush_zeroes_deallocate_fua(Backend::File);
}

/// A 4096-byte-block namespace: block counts are in 4 KiB units.
#[test]
fn four_k_block_namespace() {
    let t = Tgt::start(&[subsystem(SUBNQN, &[], &[(1, "ram:8M,block_size=4096")])]);
    let c = Controller::connect(params(t.addr, SUBNQN, HOST_A)).expect("connect");
    let ns = c.namespace(1).expect("ns");
    assert_eq!(ns.block_size, 4096);
    assert_eq!(ns.blocks, 2048);
    let mut q = c.io_queue(1).expect("queue");
    q.set_block_size(4096);
    for len in [4096usize, 16 << 10, 128 << 10] {
        let data = pattern(len as u64, len);
        write(&mut q, 5, &data, 4096).expect("write");
        assert_same(
            &read(&mut q, 5, len, 4096).expect("read"),
            &data,
            "4K blocks",
        );
    }
    let c2 = exec1(&mut q, req(Op::Deallocate, 5, 1, Vec::new(), 0));
    c2.result.expect("deallocate");
    let got = read(&mut q, 5, 8192, 4096).expect("read");
    assert!(got[..4096].iter().all(|&b| b == 0));
    assert_same(
        &got[4096..],
        &pattern(128 << 10, 128 << 10)[4096..8192],
        "block 6",
    );
}

/// A TCP relay to `to` that passes the controller's bytes on in small
/// pieces with pauses, so PDUs arrive split at arbitrary points: large read
/// payloads then reach the host after their header (placed straight into
/// the request buffer) and every split of headers and data is exercised.
fn trickling_relay(to: std::net::SocketAddr) -> std::net::SocketAddr {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind relay");
    let addr = l.local_addr().expect("relay address");
    std::thread::spawn(move || {
        for host in l.incoming() {
            let Ok(host) = host else { return };
            let Ok(ctrl) = std::net::TcpStream::connect(to) else {
                return;
            };
            let _ = host.set_nodelay(true);
            let _ = ctrl.set_nodelay(true);
            let (mut h_in, mut c_out) = (host.try_clone().unwrap(), ctrl.try_clone().unwrap());
            std::thread::spawn(move || std::io::copy(&mut h_in, &mut c_out));
            let (mut c_in, mut h_out) = (ctrl, host);
            std::thread::spawn(move || {
                let mut buf = [0u8; 65536];
                let mut n_piece = 0usize;
                loop {
                    let n = match c_in.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    // Pieces of 1..=7001 bytes, varying.
                    let mut at = 0;
                    while at < n {
                        n_piece += 1;
                        let len = (1 + n_piece * 1237 % 7001).min(n - at);
                        if h_out.write_all(&buf[at..at + len]).is_err() {
                            return;
                        }
                        at += len;
                        if n_piece.is_multiple_of(4) {
                            std::thread::sleep(Duration::from_micros(200));
                        }
                    }
                }
            });
        }
    });
    addr
}

/// Reads whose payload arrives in pieces after its header: placed directly
/// into the buffer, byte for byte the data written, with and without header
/// digests, many reads in flight at once.
#[test]
fn split_read_payloads_are_placed_directly_and_intact() {
    for digests in [
        Digests::default(),
        Digests {
            header: true,
            data: false,
        },
    ] {
        let t = Tgt::start(&[subsystem(SUBNQN, &[], &[(1, "ram:8M")])]);
        let mut p = params(trickling_relay(t.addr), SUBNQN, HOST_A);
        p.digests = digests;
        let c = Controller::connect(p).expect("connect through the relay");
        let mut q = c.io_queue(1).expect("I/O queue");
        q.set_block_size(512);
        let data = pattern(7, 4 << 20);
        for (i, chunk) in data.chunks(128 << 10).enumerate() {
            write(&mut q, (i * 256) as u64, chunk, 512).expect("write");
        }
        // Sizes from below the direct threshold up to the largest transfer
        // (128 KiB), all in flight together.
        let sizes = [4096usize, 16 << 10, 60 << 10, 100 << 10, 128 << 10];
        let mut reqs = Vec::new();
        let mut at = 0usize;
        for &len in sizes.iter().cycle().take(24) {
            let lba = (at % ((4 << 20) - len)) / 512;
            reqs.push((lba, len));
            at += len + 4096;
        }
        let done = exec(
            &mut q,
            reqs.iter()
                .enumerate()
                .map(|(i, &(lba, len))| {
                    req(
                        Op::Read,
                        lba as u64,
                        (len / 512) as u32,
                        vec![0; len],
                        i as u64,
                    )
                })
                .collect(),
        );
        for c in done {
            c.result.expect("read");
            let (lba, len) = reqs[c.token as usize];
            assert_same(&c.buf, &data[lba * 512..lba * 512 + len], "split read");
        }
        assert!(
            q.direct_bytes() > 0,
            "no payload was placed directly ({digests:?})"
        );
    }
}
