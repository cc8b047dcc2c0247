//! Thin namespaces (design/thin-snapshots.md T2–T4) through the real
//! protocol: a tree of a grain pool takes space only where written, keeps
//! what was flushed across a restart, and a full pool fails the write with
//! Capacity Exceeded while everything written before stays intact.

mod common;

use common::*;
use nvpool_target::backend::thin;
use nvpool_wire::Status;

const GRAIN: u64 = 64 << 10;
/// Blocks of 4 KiB per grain.
const GRAIN_BLOCKS: u64 = GRAIN / 4096;

fn thin_spec(path: &std::path::Path, root: u64, size: u64) -> String {
    format!("thin:{},root={root},size={size}", path.display())
}

#[test]
fn a_thin_namespace_takes_space_where_written_and_keeps_it_across_a_restart() {
    let (_dir, path) = scratch_file(64 << 20);
    let p = path.to_str().unwrap();
    let empty = thin::format(p, GRAIN).unwrap();
    assert_eq!(empty.grains_allocated, 0);
    // 1 GiB served from a 64 MiB file: thin.
    let spec = thin_spec(&path, 1, 1 << 30);
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, &spec)])]);
    let (mut a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let id = a.identify_namespace(1);
    assert_eq!(id.nsze, (1 << 30) / 4096);
    let far = (900 << 20) / 4096;
    let (x, y) = (pattern(1, 32 << 10), pattern(2, 8 << 10));
    q.write(1, 0, &x, 4096, false).ok();
    q.write(1, far, &y, 4096, true).ok();
    q.flush(1).ok();
    assert_eq!(q.read_ok(1, 0, 8, 4096), x);
    assert_eq!(q.read_ok(1, far, 2, 4096), y);
    assert!(
        q.read_ok(1, 4096, 16, 4096).iter().all(|&b| b == 0),
        "never written reads as zeroes"
    );
    drop((a, q));
    d.shutdown();

    // The pool was closed with the daemon: this opens it from the device.
    let b = thin::open(p, 1, 1 << 30).unwrap();
    assert_eq!(
        b.pool().stats().grains_allocated,
        2,
        "two grains written, two allocated"
    );
    drop(b);
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, &spec)])]);
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    assert_eq!(q.read_ok(1, 0, 8, 4096), x);
    assert_eq!(q.read_ok(1, far, 2, 4096), y);
}

#[test]
fn two_trees_of_one_pool_are_separate_namespaces() {
    let (_dir, path) = scratch_file(16 << 20);
    thin::format(path.to_str().unwrap(), GRAIN).unwrap();
    let (one, two) = (
        thin_spec(&path, 1, 256 << 20),
        thin_spec(&path, 2, 256 << 20),
    );
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, &one), (2, &two)])]);
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let (x, y) = (pattern(3, 16 << 10), pattern(4, 16 << 10));
    q.write(1, 10, &x, 4096, false).ok();
    q.write(2, 10, &y, 4096, false).ok();
    assert_eq!(q.read_ok(1, 10, 4, 4096), x);
    assert_eq!(q.read_ok(2, 10, 4, 4096), y);
    q.deallocate(1, &[(10, 4)]).ok();
    assert!(q.read_ok(1, 10, 4, 4096).iter().all(|&b| b == 0));
    assert_eq!(
        q.read_ok(2, 10, 4, 4096),
        y,
        "the other tree keeps its data"
    );
}

#[test]
fn a_full_pool_fails_the_write_with_capacity_exceeded_and_changes_nothing() {
    let (_dir, path) = scratch_file(4 << 20);
    let total = thin::format(path.to_str().unwrap(), GRAIN)
        .unwrap()
        .grains_total;
    let spec = thin_spec(&path, 1, 64 << 20);
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, &spec)])]);
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    // One grain per write, until the pool has none left.
    let mut written = Vec::new();
    let full = loop {
        let g = written.len() as u64;
        assert!(g <= total, "more grains written than the pool holds");
        let data = pattern(100 + g, GRAIN as usize);
        let c = q.write(1, g * GRAIN_BLOCKS, &data, 4096, false);
        if !c.status.is_success() {
            break c;
        }
        written.push(data);
    };
    full.expect_status(Status::CAPACITY_EXCEEDED);
    assert_eq!(written.len() as u64, total, "every grain was used before");
    let last = written.len() as u64;
    // An overwrite of a grain this tree owns needs no new one.
    let again = pattern(7, GRAIN as usize);
    q.write(1, 0, &again, 4096, true).ok();
    written[0] = again;
    q.flush(1).ok();
    for (g, data) in written.iter().enumerate() {
        assert_eq!(
            &q.read_ok(1, g as u64 * GRAIN_BLOCKS, GRAIN_BLOCKS as u32, 4096),
            data,
            "grain {g} after the failed write"
        );
    }
    // Space given back by deallocate and Write Zeroes is used again, at once
    // (the pool commits the frees before it calls itself full).
    q.deallocate(1, &[(GRAIN_BLOCKS, GRAIN_BLOCKS as u32)]).ok();
    q.write_zeroes(1, 2 * GRAIN_BLOCKS, GRAIN_BLOCKS as u32)
        .ok();
    let (p1, p2) = (pattern(8, GRAIN as usize), pattern(9, GRAIN as usize));
    q.write(1, last * GRAIN_BLOCKS, &p1, 4096, false).ok();
    q.write(1, (last + 1) * GRAIN_BLOCKS, &p2, 4096, false).ok();
    q.flush(1).ok();
    assert_eq!(
        q.read_ok(1, last * GRAIN_BLOCKS, GRAIN_BLOCKS as u32, 4096),
        p1
    );
    assert_eq!(
        q.read_ok(1, (last + 1) * GRAIN_BLOCKS, GRAIN_BLOCKS as u32, 4096),
        p2
    );
    assert!(q
        .read_ok(1, GRAIN_BLOCKS, 2 * GRAIN_BLOCKS as u32, 4096)
        .iter()
        .all(|&b| b == 0));
    assert_eq!(&q.read_ok(1, 0, GRAIN_BLOCKS as u32, 4096), &written[0]);
}

#[test]
fn a_device_is_formatted_once_and_an_unformatted_one_is_refused() {
    let (_dir, path) = scratch_file(8 << 20);
    let p = path.to_str().unwrap();
    let err = thin::open(p, 1, 1 << 20).unwrap_err().to_string();
    assert!(err.contains("not a grain pool"), "{err}");
    thin::format(p, GRAIN).unwrap();
    let err = thin::format(p, GRAIN).unwrap_err().to_string();
    assert!(err.contains("already holds a grain pool"), "{err}");
    let b = thin::open(p, 1, 1 << 20).unwrap();
    let err = thin::format(p, GRAIN).unwrap_err().to_string();
    assert!(err.contains("in use"), "{err}");
    let other = thin::open(p, 2, 1 << 20).unwrap();
    assert!(
        std::sync::Arc::ptr_eq(b.pool(), other.pool()),
        "one pool per device"
    );
    let err = thin::open(p, 3, 1 << 50).unwrap_err().to_string();
    assert!(err.contains("more than a tree maps"), "{err}");
}
