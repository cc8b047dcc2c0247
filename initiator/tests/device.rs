//! The async Device API against an in-process nvpool-target.

mod common;

use common::{open_device, subsystem, Tgt};
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

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
        .collect()
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
        let data = pattern(len, seed);
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
                    let data = pattern(8192, t ^ i as u8);
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
