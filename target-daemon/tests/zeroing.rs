//! Write Zeroes and deallocate on file namespaces, which the reactor runs
//! on its io_uring (fallocate, falling back to punch hole, then to writes
//! of zeroes): the bytes read back as zeroes, large ranges and many-range
//! deallocates included, neighbours keep their data, and a failing
//! operation still completes its command with an error status.

mod common;

use common::*;
use nvpool_target::backend::{Backend, FaultBackend, FaultConfig, FileBackend};
use nvpool_wire::Status;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Writes a pattern block at each LBA of `lbas` (one block each).
fn mark(q: &mut Conn, nsid: u32, bs: usize, lbas: &[u64]) {
    for &lba in lbas {
        q.write(nsid, lba, &pattern(lba, bs), bs, false).ok();
    }
}

/// The blocks at `lbas` read as zeroes.
#[track_caller]
fn assert_zero(q: &mut Conn, nsid: u32, bs: usize, lbas: &[u64]) {
    for &lba in lbas {
        let got = q.read_ok(nsid, lba, 1, bs);
        assert!(
            got.iter().all(|&b| b == 0),
            "LBA {lba} of namespace {nsid} is not zero"
        );
    }
}

/// The blocks at `lbas` still hold what [`mark`] wrote.
#[track_caller]
fn assert_marked(q: &mut Conn, nsid: u32, bs: usize, lbas: &[u64]) {
    for &lba in lbas {
        assert_eq!(
            q.read_ok(nsid, lba, 1, bs),
            pattern(lba, bs),
            "LBA {lba} of namespace {nsid} changed"
        );
    }
}

/// Largest Write Zeroes: NLB is 16 bits.
const WZ_BLOCKS_MAX: u32 = 1 << 16;

fn exercise(q: &mut Conn, nsid: u32, bs: usize, blocks: u64) {
    // The largest Write Zeroes there is (32 MiB or 256 MiB of blocks),
    // marked at its ends, its middle and just outside.
    let (start, n) = (8u64, u64::from(WZ_BLOCKS_MAX));
    assert!(start + n + 1 < blocks);
    let inside = [start, start + 1, start + n / 2, start + n - 1];
    let outside = [start - 1, start + n];
    mark(q, nsid, bs, &inside);
    mark(q, nsid, bs, &outside);
    q.write_zeroes(nsid, start, WZ_BLOCKS_MAX).ok();
    assert_zero(q, nsid, bs, &inside);
    assert_marked(q, nsid, bs, &outside);

    // A small one inside written data.
    let base = start + n + 16;
    let data = pattern(99, 16 * bs);
    q.write(nsid, base, &data, bs, false).ok();
    q.write_zeroes(nsid, base + 3, 5).ok();
    let got = q.read_ok(nsid, base, 16, bs);
    assert_eq!(got[..3 * bs], data[..3 * bs]);
    assert!(got[3 * bs..8 * bs].iter().all(|&b| b == 0));
    assert_eq!(got[8 * bs..], data[8 * bs..]);

    // A deallocate of more ranges than the target keeps in flight for one
    // command (ZERO_OPS_PER_CMD_MAX), one of them large, one empty.
    let base = base + 32;
    let mut ranges: Vec<(u64, u32)> = (0..40).map(|i| (base + i * 10, 3)).collect();
    ranges.push((base + 400, 0));
    let big = (base + 500, 100_000u32);
    assert!(big.0 + u64::from(big.1) < blocks);
    ranges.push(big);
    let mut gone = Vec::new();
    let mut kept = Vec::new();
    for &(lba, nlb) in &ranges {
        if nlb == 0 {
            kept.push(lba);
            continue;
        }
        gone.extend([lba, lba + u64::from(nlb) - 1]);
        kept.push(lba + u64::from(nlb));
    }
    gone.push(big.0 + u64::from(big.1) / 2);
    mark(q, nsid, bs, &gone);
    mark(q, nsid, bs, &kept);
    q.deallocate(nsid, &ranges).ok();
    assert_zero(q, nsid, bs, &gone);
    assert_marked(q, nsid, bs, &kept);
}

fn two_namespaces(path: &Path, len: u64) -> Daemon {
    let p = path.display();
    let spec1 = format!("file:{p},length={len}");
    let spec2 = format!("file:{p},offset={len},block_size=4096");
    Daemon::start(&[subsystem(SUBNQN, &[], &[(1, &spec1), (2, &spec2)])])
}

#[test]
fn zeroes_and_deallocate_on_a_file_read_back_as_zeroes() {
    // Sparse: only what the test writes (and Write Zeroes allocates) uses disk.
    const LEN: u64 = 1 << 30;
    let (_dir, path) = scratch_file(2 * LEN);
    let d = two_namespaces(&path, LEN);
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    exercise(&mut q, 1, 512, LEN / 512);
    exercise(&mut q, 2, 4096, LEN / 4096);
    // The zeroes are in the file, where the namespaces map them.
    q.flush(1).ok();
    q.flush(2).ok();
    let f = std::fs::File::open(&path).unwrap();
    let mut b = vec![0xFFu8; 4096];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, LEN + 8 * 4096).unwrap();
    assert!(b.iter().all(|&x| x == 0));
}

/// tmpfs has no FALLOC_FL_ZERO_RANGE: Write Zeroes falls back to punching
/// a hole, through the ring all the same.
#[test]
fn zeroes_where_the_filesystem_lacks_zero_range() {
    let dir = tempfile::tempdir_in("/dev/shm").expect("a tmpfs at /dev/shm");
    let path = dir.path().join("disk.img");
    const LEN: u64 = 64 << 20;
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(LEN))
        .unwrap();
    let spec = format!("file:{}", path.display());
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, &spec)])]);
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let lbas = [0u64, 1000, 65535];
    mark(&mut q, 1, 512, &lbas);
    mark(&mut q, 1, 512, &[65536]);
    q.write_zeroes(1, 0, WZ_BLOCKS_MAX).ok();
    assert_zero(&mut q, 1, 512, &lbas);
    assert_marked(&mut q, 1, 512, &[65536]);
    mark(&mut q, 1, 512, &lbas);
    q.deallocate(1, &[(0, 1), (1000, 1), (65535, 1)]).ok();
    assert_zero(&mut q, 1, 512, &lbas);
    assert_marked(&mut q, 1, 512, &[65536]);
}

/// Faults on the ring come from the kernel (FaultBackend::over_ring):
/// every operation of a zeroing command fails, the command still
/// completes, with an error status, and the queue keeps working.
#[test]
fn a_failing_zeroing_command_completes_with_an_error() {
    let (_dir, path) = scratch_file(64 << 20);
    let d = Daemon::start(&[subsystem(SUBNQN, &[HOST_A], &[(1, RAM_SPEC)])]);
    let file: Arc<dyn Backend> =
        Arc::new(FileBackend::open(path.to_str().unwrap(), 0, None, None).unwrap());
    let f = Arc::new(FaultBackend::over_ring(file).unwrap());
    d.target
        .put_namespace_backend(SUBNQN, 2, f.clone())
        .expect("fault namespace");
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let lbas = [10u64, 20, 5000];
    mark(&mut q, 2, 512, &lbas);
    f.set(FaultConfig {
        fail_writes: true,
        ..Default::default()
    });
    q.write_zeroes(2, 0, 8192)
        .expect_status(Status::WRITE_FAULT);
    let ranges: Vec<(u64, u32)> = (0..30).map(|i| (i * 100, 50)).collect();
    q.deallocate(2, &ranges).expect_status(Status::WRITE_FAULT);
    assert_eq!(
        f.injected.load(Ordering::Relaxed),
        0,
        "the kernel failed them, on the ring, not the inline calls"
    );
    // Reads still work, and nothing was zeroed.
    assert_marked(&mut q, 2, 512, &lbas);
    // A failed fallocate does not make the backend failed (as inline).
    assert!(!f.failed());
    f.heal();
    q.write_zeroes(2, 0, 1000).ok();
    assert_zero(&mut q, 2, 512, &lbas[..2]);
    assert_marked(&mut q, 2, 512, &lbas[2..]);
    // Namespace 1 was never affected.
    q.write_zeroes(1, 0, 8).ok();
}
