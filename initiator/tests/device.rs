//! The async Device API against an in-process nvpool-target.

mod common;

use common::{open_device, pattern, subsystem, Tgt};
use nvpool_initiator::device::block_on;
use nvpool_initiator::{Device, IoError};
use std::sync::Arc;

const NQN: &str = "nqn.2026-11.io.nvpool:device-test";

fn start(backend: &str) -> Tgt {
    Tgt::start(&[subsystem(NQN, &[], &[(1, backend)])])
}

fn open(r: &Tgt, queues: u16) -> Device {
    open_device(r, NQN, queues, 16)
}

#[test]
fn reads_writes_and_large_requests_split_at_the_max_transfer() {
    let r = start("ram:64M");
    let d = open(&r, 2);
    assert_eq!(d.size(), 64 << 20);
    // 1 MiB spans eight 128 KiB commands on this target.
    for (off, len, seed) in [
        (0u64, 4096usize, 1u8),
        (1 << 20, 1 << 20, 2),
        ((64 << 20) - 8192, 8192, 3),
    ] {
        let data = pattern(u64::from(seed), len);
        let (w, _) = block_on(d.write(off, data.clone(), false));
        w.unwrap();
        let (rr, back) = block_on(d.read(off, vec![0; len]));
        rr.unwrap();
        assert!(back == data, "data at {off} differs");
    }
    block_on(d.flush()).unwrap();
    drop(d);
    r.stop();
}

#[test]
fn zeroes_discard_and_bad_ranges() {
    let r = start("ram:16M");
    let d = open(&r, 1);
    let (w, _) = block_on(d.write(0, vec![0xAB; 65536], true));
    w.unwrap();
    block_on(d.write_zeroes(0, 16384, false)).unwrap();
    block_on(d.discard(16384, 16384)).unwrap();
    let (rr, back) = block_on(d.read(0, vec![1; 65536]));
    rr.unwrap();
    assert!(back[..32768].iter().all(|&b| b == 0));
    assert!(back[32768..].iter().all(|&b| b == 0xAB));
    let (e, _) = block_on(d.read(100, vec![0; 512]));
    assert!(matches!(e, Err(IoError::Invalid(_))));
    let (e, _) = block_on(d.read(16 << 20, vec![0; 512]));
    assert!(matches!(e, Err(IoError::Invalid(_))));
    drop(d);
    r.stop();
}

#[test]
fn many_concurrent_callers() {
    let r = start("ram:32M");
    let d = Arc::new(open(&r, 2));
    let threads: Vec<_> = (0..8u8)
        .map(|t| {
            let d = d.clone();
            std::thread::spawn(move || {
                for i in 0..200u64 {
                    let off = ((t as u64) << 22) + i * 8192;
                    let data = pattern(u64::from(t ^ i as u8), 8192);
                    let (w, _) = block_on(d.write(off, data.clone(), false));
                    w.unwrap();
                    let (rr, back) = block_on(d.read(off, vec![0; 8192]));
                    rr.unwrap();
                    assert!(back == data);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    drop(d);
    r.stop();
}

#[test]
fn a_shared_write_buffer_serves_several_requests_and_is_released_by_each() {
    let r = start("ram:16M");
    let d = open(&r, 2);
    // One buffer, written to two places at once and split at the maximum
    // transfer (1 MiB is eight commands here), as a mirror's copies do.
    let data = Arc::new(pattern(9, 1 << 20));
    let small = Arc::new(pattern(4, 4096));
    let all = [
        d.write_shared(0, data.clone(), false),
        d.write_shared(4 << 20, data.clone(), true),
        d.write_shared(8 << 20, small.clone(), false),
    ];
    for w in all.into_iter().map(block_on) {
        w.unwrap();
    }
    // Every request gave its reference back when it completed.
    assert_eq!(Arc::strong_count(&data), 1);
    assert_eq!(Arc::strong_count(&small), 1);
    for (off, want) in [(0u64, &data), (4 << 20, &data), (8 << 20, &small)] {
        let (rr, back) = block_on(d.read(off, vec![0; want.len()]));
        rr.unwrap();
        assert!(back == **want, "data at {off} differs");
    }
    let e = block_on(d.write_shared(100, small.clone(), false));
    assert!(matches!(e, Err(IoError::Invalid(_))));
    drop(d);
    r.stop();
}

#[test]
fn callers_on_many_threads_submit_on_the_socket_themselves_and_all_complete() {
    // More submitting threads than queues, so some find every queue held
    // and hand their request to a queue's thread instead; reads and writes
    // interleave on both paths and every byte must come back right.
    let r = start("ram:32M");
    let d = Arc::new(open(&r, 2));
    let threads: Vec<_> = (0..6u8)
        .map(|t| {
            let d = d.clone();
            std::thread::spawn(move || {
                for i in 0..300u64 {
                    let off = ((t as u64) << 22) + (i % 64) * 4096;
                    let data = pattern(u64::from(t.wrapping_add(i as u8)), 4096);
                    let (w, _) = block_on(d.write(off, data.clone(), i % 7 == 0));
                    w.unwrap();
                    let (rr, back) = block_on(d.read(off, vec![0; 4096]));
                    rr.unwrap();
                    assert!(back == data, "thread {t} op {i}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    block_on(d.flush()).unwrap();
    assert_eq!(d.io().in_flight(), 0);
    drop(d);
    r.stop();
}
