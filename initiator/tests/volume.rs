//! The volume engine against in-process nvpool-targets.
//!
//! Each test exports a volume's extents as namespaces of one per-host
//! subsystem on every target, builds the connection plan by hand and checks
//! through the volume (data reads back) and beside it (every byte sits in
//! the namespace and at the offset the mapping names, on every copy).

mod common;

use common::volumes::{self, host_controllers, host_subsystem, read_check, write, Setup};
use common::*;
use nvpool_initiator::device::block_on;
use nvpool_initiator::volume::ExtentFailure;
use nvpool_initiator::{
    BlockDev, Controller, ControllerIo, Device, Error, IoError, Volume, VolumeOptions,
};
use nvpool_layout::mapping::Geometry;
use nvpool_layout::model::Uuid;
use nvpool_layout::plan::{LayoutBody, PlanExtent};
use nvpool_rt::random::Rng;
use nvpool_target::backend::{FaultConfig, RamBackend};
use nvpool_wire::Status;
use std::collections::BTreeSet;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Waker};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// The smallest extent a plan may have.
const EXTENT: u64 = MIB;
const BLOCK: u64 = 4096;
const K: u64 = 1024;

/// Volumes of 1 MiB extents (the smallest a plan may have).
fn setup(n: usize, layout: LayoutBody, size: u64, ns_spec: &str) -> Setup {
    volumes::setup(n, layout, size, EXTENT, ns_spec)
}

/// Like [`setup`], behind fault-injecting backends.
fn setup_faulty(n: usize, layout: LayoutBody, size: u64) -> Setup {
    volumes::setup_faulty(n, layout, size, EXTENT)
}

fn opts() -> VolumeOptions {
    volumes::volume_opts()
}

/// A block-aligned range of 1..=max_blocks blocks inside `[lo, hi)`.
fn range(rng: &mut Rng, lo: u64, hi: u64, max_blocks: u64) -> (u64, u64) {
    let blocks = (hi - lo) / BLOCK;
    let len = (1 + rng.below(max_blocks)).min(blocks);
    let off = lo + rng.below(blocks - len + 1) * BLOCK;
    (off, len * BLOCK)
}

/// Reads every namespace of every target with a controller of its own.
/// Returns the contents in plan extent order.
fn read_namespaces(s: &Setup) -> Vec<Vec<u8>> {
    let mut out = vec![Vec::new(); s.plan.extents.len()];
    for (t, tgt) in s.all().into_iter().enumerate() {
        let mine: Vec<usize> = (0..s.plan.extents.len())
            .filter(|&i| s.plan.extents[i].addr == tgt.addr)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let ctrl = Controller::connect(params(tgt.addr, &host_subsystem(), HOST_A))
            .unwrap_or_else(|e| panic!("verifier connect to target {t}: {e}"));
        let bs = ctrl
            .namespace(s.plan.extents[mine[0]].nsid)
            .unwrap()
            .block_size;
        let io = ControllerIo::start(ctrl.clone(), 1, bs).unwrap();
        for i in mine {
            let d = Device::on(&io, s.plan.extents[i].nsid).unwrap();
            assert_eq!(d.size(), EXTENT, "namespace of extent {i}");
            let (r, b) = block_on(d.read(0, vec![0; EXTENT as usize]));
            r.unwrap();
            out[i] = b;
        }
        drop(io);
        ctrl.shutdown();
    }
    out
}

/// Every volume byte is at its mapped offset in every copy of its extent.
fn check_placement(s: &Setup, model: &[u8]) {
    let ns = read_namespaces(s);
    let g: Geometry = s.plan.geometry();
    for seg in g.segments(0, g.size_bytes).unwrap() {
        let first = seg.location.first_extent_index(&g);
        let at = seg.location.offset_in_extent as usize;
        let want = &model[seg.volume_offset as usize..][..seg.len as usize];
        for copy in 0..usize::from(g.copies) {
            assert_same(
                &ns[first + copy][at..at + seg.len as usize],
                want,
                &format!(
                    "volume bytes {}+{} in extent {} (copy {copy}) at {at}",
                    seg.volume_offset,
                    seg.len,
                    first + copy
                ),
            );
        }
    }
    // Copies are identical, unmapped tails included.
    let c = usize::from(g.copies);
    for group in 0..ns.len() / c {
        for copy in 1..c {
            assert_same(
                &ns[group * c + copy],
                &ns[group * c],
                &format!("copy {copy} of extent group {group}"),
            );
        }
    }
}

/// Drives one layout through everything a front-end does and checks the
/// result on the namespaces themselves.
fn exercise(n_targets: usize, layout: LayoutBody, size: u64, ns_spec: &str, seed: u64) {
    let s = setup(n_targets, layout, size, ns_spec);
    let v = Volume::open(&s.plan, opts()).expect("volume opens");
    assert_eq!(v.size(), size);
    assert_eq!(BlockDev::block_size(&v), BLOCK as u32);
    let g = s.plan.geometry();
    let want_opt = if g.width > 1 {
        g.stripe_bytes as u32
    } else {
        0
    };
    assert_eq!(v.optimal_io_bytes(), want_opt);

    // One controller per target, shared by every extent there.
    assert_eq!(v.controller_count(), n_targets);
    for (i, t) in s.all().into_iter().enumerate() {
        assert_eq!(
            host_controllers(t),
            1,
            "controllers of the host on target {i}"
        );
    }

    let mut model = vec![0u8; size as usize];
    let mut rng = Rng::new(seed | 1);
    // Random writes, small and large (up to 1.5 MiB: across stripe units,
    // members and extents), each read back at once and at random later.
    for i in 0..80u64 {
        let max_blocks = if i.is_multiple_of(8) { 384 } else { 40 };
        let (off, len) = range(&mut rng, 0, size, max_blocks);
        write(
            &v,
            &mut model,
            off,
            len,
            seed << 16 | i,
            i.is_multiple_of(5),
        );
        read_check(&v, &model, off, len);
        let (off, len) = range(&mut rng, 0, size, 96);
        read_check(&v, &model, off, len);
    }

    // Concurrent callers on disjoint quarters.
    let quarter = size / 4 / BLOCK * BLOCK;
    let parts: Vec<Vec<(u64, Vec<u8>)>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..4u64)
            .map(|q| {
                let v = &v;
                sc.spawn(move || {
                    let mut rng = Rng::new(seed.wrapping_mul(31) + q * 7 + 1);
                    let mut done = Vec::new();
                    for i in 0..25 {
                        let (off, len) = range(&mut rng, q * quarter, (q + 1) * quarter, 64);
                        let data = pattern(seed + q * 1000 + i, len as usize);
                        let (r, _) = block_on(v.write(off, data.clone(), false));
                        r.unwrap();
                        let (r, got) = block_on(v.read(off, vec![0; len as usize]));
                        r.unwrap();
                        assert_same(&got, &data, "concurrent read-back");
                        done.push((off, data));
                    }
                    done
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for part in parts {
        for (off, data) in part {
            model[off as usize..off as usize + data.len()].copy_from_slice(&data);
        }
    }

    // Write Zeroes and discard across extents (RAM namespaces read back
    // zeroes either way).
    let (zo, zl) = (EXTENT - 12 * K, EXTENT + 24 * K);
    block_on(v.write_zeroes(zo, zl, false)).unwrap();
    model[zo as usize..(zo + zl) as usize].fill(0);
    let (d_off, d_len) = (size - 3 * EXTENT / 2, EXTENT);
    block_on(v.discard(d_off, d_len)).unwrap();
    model[d_off as usize..(d_off + d_len) as usize].fill(0);
    block_on(v.flush()).unwrap();
    block_on(v.flush()).unwrap();

    // The whole volume, in 1 MiB reads and in one odd-sized read.
    for off in (0..size).step_by(MIB as usize) {
        read_check(&v, &model, off, MIB.min(size - off));
    }
    read_check(&v, &model, 3 * BLOCK, size - 7 * BLOCK);

    // Bad requests.
    for (off, len, what) in [
        (100, BLOCK, "unaligned offset"),
        (0, 512, "unaligned length"),
        (size - BLOCK, 2 * BLOCK, "past the end"),
        (size, BLOCK, "at the end"),
    ] {
        let (r, back) = block_on(v.read(off, vec![0; len as usize]));
        assert!(matches!(r, Err(IoError::Invalid(_))), "read {what}: {r:?}");
        assert_eq!(back.len(), len as usize);
        let (r, _) = block_on(v.write(off, vec![0; len as usize], false));
        assert!(matches!(r, Err(IoError::Invalid(_))), "write {what}: {r:?}");
        let r = block_on(v.write_zeroes(off, len, false));
        assert!(
            matches!(r, Err(IoError::Invalid(_))),
            "zeroes {what}: {r:?}"
        );
        let r = block_on(v.discard(off, len));
        assert!(
            matches!(r, Err(IoError::Invalid(_))),
            "discard {what}: {r:?}"
        );
    }
    let (r, _) = block_on(v.read(8192, Vec::new()));
    r.unwrap();
    assert!(v.health().is_healthy());

    v.close().expect("close flushes");
    for (i, t) in s.all().into_iter().enumerate() {
        wait_for(
            &format!("target {i} to see the controller go"),
            WAIT,
            || host_controllers(t) == 0,
        );
    }
    check_placement(&s, &model);
}

#[test]
fn concat_maps_every_byte_to_its_extent() {
    // 4 rows, the last one short of 64 KiB.
    exercise(2, LayoutBody::Concat {}, 4 * MIB - 64 * K, "ram:1M", 1);
}

#[test]
fn raid0_stripes_across_members() {
    let layout = LayoutBody::Raid0 {
        stripe_bytes: 16 * K,
        width: 3,
    };
    // 4 rows of 3 extents, the last row short of 5 stripe units.
    exercise(3, layout, 12 * MIB - 80 * K, "ram:1M", 2);
}

#[test]
fn raid1_mirrors_every_write() {
    let layout = LayoutBody::Raid1 { copies: 2 };
    exercise(3, layout, 4 * MIB - 4 * K, "ram:1M", 3);
}

#[test]
fn raid10_stripes_and_mirrors_on_4k_namespaces() {
    let layout = LayoutBody::Raid10 {
        stripe_bytes: 32 * K,
        width: 2,
        copies: 2,
    };
    exercise(4, layout, 8 * MIB - 96 * K, "ram:1M,block_size=4096", 4);
}

#[test]
fn plans_that_do_not_match_the_targets_are_refused() {
    let s = setup(2, LayoutBody::Raid1 { copies: 2 }, 2 * MIB, "ram:2M");
    match Volume::open(&s.plan, opts()) {
        Err(Error::Invalid(m)) => assert!(m.contains("namespace"), "{m}"),
        other => panic!("namespaces of 2 MiB for 1 MiB extents: {other:?}"),
    }
    let mut bad = s.plan.clone();
    bad.extents.pop();
    assert!(matches!(Volume::open(&bad, opts()), Err(Error::Invalid(_))));
    let mut bad = s.plan.clone();
    bad.extents[1].nsid = 9;
    assert!(
        Volume::open(&bad, opts()).is_err(),
        "a namespace that is not there"
    );
    // Nothing stays connected after a refused open.
    for t in s.all() {
        wait_for("refused opens to disconnect", WAIT, || {
            host_controllers(t) == 0
        });
    }
}

/// What one writer of the degraded test saw.
#[derive(Debug, Default)]
struct Seen {
    ops: u64,
    errors: Vec<String>,
    written: Vec<(u64, u64, u64)>,
}

#[test]
fn mirror_keeps_serving_when_a_target_dies() {
    let mut s = setup(2, LayoutBody::Raid1 { copies: 2 }, 4 * MIB, "ram:1M");
    let failures: Arc<Mutex<Vec<ExtentFailure>>> = Arc::default();
    let f2 = failures.clone();
    let o = VolumeOptions {
        on_extent_failed: Some(Arc::new(move |f: &ExtentFailure| {
            f2.lock().unwrap().push(f.clone())
        })),
        ..opts()
    };
    let v = Volume::open(&s.plan, o).unwrap();
    let size = v.size();
    let stop = AtomicBool::new(false);
    let progress = AtomicU64::new(0);
    let dead = s.target(1).addr;
    let seen: Vec<Seen> = std::thread::scope(|sc| {
        let writers: Vec<_> = (0..2u64)
            .map(|w| {
                let (v, stop, progress) = (&v, &stop, &progress);
                sc.spawn(move || {
                    let half = size / 2;
                    let mut rng = Rng::new(w + 11);
                    let mut seen = Seen::default();
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        // Up to 640 KiB: often across the 1 MiB extents.
                        let (off, len) = range(&mut rng, w * half, (w + 1) * half, 160);
                        let seed = w << 32 | i;
                        let data = pattern(seed, len as usize);
                        let (r, _) = block_on(v.write(off, data.clone(), i.is_multiple_of(3)));
                        if let Err(e) = r {
                            seen.errors.push(format!("write {off}+{len}: {e}"));
                            continue;
                        }
                        seen.written.push((off, len, seed));
                        let (r, got) = block_on(v.read(off, vec![0; len as usize]));
                        match r {
                            Err(e) => seen.errors.push(format!("read {off}+{len}: {e}")),
                            Ok(()) if got != data => {
                                seen.errors.push(format!("read {off}+{len}: wrong data"))
                            }
                            Ok(()) => {}
                        }
                        seen.ops += 1;
                        progress.fetch_add(1, Ordering::Relaxed);
                    }
                    seen
                })
            })
            .collect();
        wait_for("writers to get going", WAIT, || {
            progress.load(Ordering::Relaxed) >= 40
        });
        // Kill one target mid-way: its listener and connections go.
        s.stop(1);
        wait_for("the dead target's copies to be marked failed", WAIT, || {
            !v.health().failed_extents.is_empty()
        });
        let after = progress.load(Ordering::Relaxed);
        wait_for("writers to go on without the dead copies", WAIT, || {
            progress.load(Ordering::Relaxed) >= after + 40
        });
        stop.store(true, Ordering::Relaxed);
        writers.into_iter().map(|h| h.join().unwrap()).collect()
    });

    let mut model = vec![0u8; size as usize];
    for w in &seen {
        assert!(
            w.errors.is_empty(),
            "errors reached the caller: {:?}",
            w.errors
        );
        assert!(w.ops > 0);
        for &(off, len, seed) in &w.written {
            model[off as usize..(off + len) as usize].copy_from_slice(&pattern(seed, len as usize));
        }
    }
    // Exactly the copies on the dead target failed; every extent is served.
    let on_dead: BTreeSet<usize> = (0..s.plan.extents.len())
        .filter(|&i| s.plan.extents[i].addr == dead)
        .collect();
    let h = v.health();
    assert_eq!(
        h.failed_extents.iter().copied().collect::<BTreeSet<_>>(),
        on_dead
    );
    assert!(h.is_degraded() && h.lost.is_empty(), "{h:?}");
    let reported: Vec<usize> = failures.lock().unwrap().iter().map(|f| f.index).collect();
    assert_eq!(
        reported.iter().copied().collect::<BTreeSet<_>>(),
        on_dead,
        "one report per failed copy"
    );
    assert_eq!(reported.len(), on_dead.len(), "each reported once");
    assert!(failures
        .lock()
        .unwrap()
        .iter()
        .all(|f| f.addr == dead && !f.member_lost));

    // Everything acknowledged reads back, and sits on the surviving target.
    for off in (0..size).step_by(MIB as usize) {
        read_check(&v, &model, off, MIB);
    }
    v.close().expect("flush of the surviving copies");
    let live = s.target(0);
    let ctrl = Controller::connect(params(live.addr, &host_subsystem(), HOST_A)).unwrap();
    let io = ControllerIo::start(ctrl.clone(), 1, 512).unwrap();
    let g = s.plan.geometry();
    for seg in g.segments(0, size).unwrap() {
        let first = seg.location.first_extent_index(&g);
        for i in first..first + 2 {
            let e = &s.plan.extents[i];
            if e.addr != live.addr {
                continue;
            }
            let d = Device::on(&io, e.nsid).unwrap();
            let at = seg.location.offset_in_extent;
            let (r, got) = block_on(d.read(at, vec![0; seg.len as usize]));
            r.unwrap();
            assert_same(
                &got,
                &model[seg.volume_offset as usize..][..seg.len as usize],
                &format!("surviving copy of bytes {}+{}", seg.volume_offset, seg.len),
            );
        }
    }
}

#[test]
fn an_extent_without_a_live_copy_fails_to_the_caller() {
    let s = setup(2, LayoutBody::Raid1 { copies: 2 }, 2 * MIB, "ram:1M");
    let o = VolumeOptions {
        ctrl_loss_timeout: Some(Duration::from_secs(1)),
        ..opts()
    };
    let v = Volume::open(&s.plan, o).unwrap();
    let mut model = vec![0u8; 2 * MIB as usize];
    write(&v, &mut model, 0, 2 * MIB, 5, false);
    read_check(&v, &model, 0, 2 * MIB);
    let mut s = s;
    for t in 0..s.all().len() {
        s.stop(t);
    }
    let plan = s.plan.clone();
    let started = Instant::now();
    let (r, back) = block_on(v.read(MIB, vec![0; 8192]));
    assert_eq!(r, Err(IoError::ControllerLost), "read with every copy gone");
    assert_eq!(back.len(), 8192);
    let (r, _) = block_on(v.write(0, vec![1; 8192], false));
    assert_eq!(
        r,
        Err(IoError::ControllerLost),
        "write with every copy gone"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "bounded by the controller-loss timeout: {:?}",
        started.elapsed()
    );
    let h = v.health();
    assert_eq!(
        h.failed_extents,
        (0..plan.extents.len()).collect::<Vec<_>>()
    );
    assert_eq!(h.lost, vec![(0, 0), (1, 0)]);
    assert!(!h.is_degraded() && !h.is_healthy());
    // Written, never flushed, and no copy left to flush: not durable.
    assert_eq!(block_on(v.flush()), Err(IoError::ControllerLost));
    drop(v);
}

/// Polls `fut` once, counts the controllers with requests in flight, then
/// finishes it.
fn busy_after_first_poll<F: Future>(v: &Volume, fut: F) -> (usize, F::Output) {
    let mut fut = std::pin::pin!(fut);
    let mut cx = Context::from_waker(Waker::noop());
    assert!(
        fut.as_mut().poll(&mut cx).is_pending(),
        "slow targets answered at once"
    );
    let busy = v.controllers().iter().filter(|c| c.in_flight() > 0).count();
    (busy, block_on(fut))
}

#[test]
fn requests_spanning_members_run_on_all_of_them_at_once() {
    let layout = LayoutBody::Raid0 {
        stripe_bytes: 16 * K,
        width: 3,
    };
    let s = setup_faulty(3, layout, 3 * MIB);
    let v = Volume::open(&s.plan, opts()).unwrap();
    let slow = FaultConfig {
        latency: Duration::from_millis(200),
        ..FaultConfig::default()
    };
    for f in &s.faults {
        f.set(slow.clone());
    }
    // Six stripe units from unit 1: every member, one command each.
    let len = 96 * K as usize;
    let data = pattern(9, len);
    let (busy, (r, _)) = busy_after_first_poll(&v, v.write(16 * K, data.clone(), true));
    r.unwrap();
    assert_eq!(
        busy, 3,
        "a write over three members keeps three targets busy"
    );
    let (busy, (r, got)) = busy_after_first_poll(&v, v.read(16 * K, vec![0; len]));
    r.unwrap();
    assert_eq!(busy, 3, "and so does a read");
    assert_same(&got, &data, "read across members");
    for f in &s.faults {
        f.heal();
    }
    v.close().unwrap();
}

#[test]
fn mirror_reads_around_media_errors_and_drops_copies_that_miss_writes() {
    let s = setup_faulty(2, LayoutBody::Raid1 { copies: 2 }, 2 * MIB);
    let failures: Arc<Mutex<Vec<ExtentFailure>>> = Arc::default();
    let f2 = failures.clone();
    let o = VolumeOptions {
        on_extent_failed: Some(Arc::new(move |f: &ExtentFailure| {
            f2.lock().unwrap().push(f.clone())
        })),
        ..opts()
    };
    let v = Volume::open(&s.plan, o).unwrap();
    let mut model = vec![0u8; 2 * MIB as usize];
    write(&v, &mut model, 0, 2 * MIB, 21, false);

    // Copy 0 of extent 0 cannot read: reads move to copy 1, and copy 0,
    // which holds current data, stays in use.
    s.faults[0].set(FaultConfig {
        fail_reads: true,
        ..FaultConfig::default()
    });
    for i in 0..8 {
        read_check(&v, &model, i * 64 * K, 64 * K);
    }
    assert!(
        s.faults[0].injected.load(Ordering::Relaxed) > 0,
        "copy 0 was tried"
    );
    assert!(v.health().is_healthy(), "{:?}", v.health());
    s.faults[0].heal();

    // Copy 1 of extent 0 fails a write copy 0 takes: it is stale from then
    // on and never read again, even once it could answer.
    s.faults[1].set(FaultConfig {
        fail_writes: true,
        ..FaultConfig::default()
    });
    write(&v, &mut model, 4 * K, 8 * K, 22, false);
    assert_eq!(v.health().failed_extents, vec![1]);
    {
        let f = failures.lock().unwrap();
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!((f[0].index, f[0].row, f[0].copy), (1, 0, 1));
        assert!(!f[0].member_lost);
        assert!(
            matches!(f[0].error, IoError::Status(st) if same_code(st, Status::WRITE_FAULT)),
            "{:?}",
            f[0].error
        );
    }
    s.faults[1].heal();
    for _ in 0..8 {
        read_check(&v, &model, 0, 64 * K);
    }
    // The other extent keeps both copies.
    write(&v, &mut model, MIB, 8 * K, 23, true);
    read_check(&v, &model, 0, 2 * MIB);
    assert_eq!(v.health().failed_extents, vec![1]);
    assert!(v.health().is_degraded());
    v.close().unwrap();
}

#[test]
fn without_copies_errors_reach_the_caller_as_they_are() {
    let layout = LayoutBody::Raid0 {
        stripe_bytes: 16 * K,
        width: 2,
    };
    let s = setup_faulty(2, layout, 2 * MIB);
    let v = Volume::open(&s.plan, opts()).unwrap();
    // Unit 1 is member 1's: plan extent 1.
    s.faults[1].set(FaultConfig {
        fail_reads: true,
        ..FaultConfig::default()
    });
    let (r, back) = block_on(v.read(16 * K, vec![0; 4096]));
    assert!(
        matches!(r, Err(IoError::Status(st)) if same_code(st, Status::UNRECOVERED_READ_ERROR)),
        "{r:?}"
    );
    assert_eq!(back.len(), 4096);
    let (r, _) = block_on(v.read(0, vec![0; 32 * K as usize]));
    assert!(r.is_err(), "a read touching member 1 fails");
    let (r, _) = block_on(v.read(0, vec![0; 16 * K as usize]));
    r.unwrap();
    assert!(v.health().is_healthy(), "a media error is not a lost path");
    s.faults[1].heal();
    let (r, _) = block_on(v.read(16 * K, vec![0; 4096]));
    r.unwrap();
    v.close().unwrap();
}

#[test]
fn volumes_sharing_connections_share_one_controller_per_target() {
    // Two volumes with extents on the same three targets, all in the host's
    // subsystem there; the second volume's namespaces are 100, 101, 102.
    let raid0 = LayoutBody::Raid0 {
        stripe_bytes: 64 * K,
        width: 3,
    };
    let s = setup(3, raid0, 12 * MIB, "ram:1M");
    let mut second = s.plan.clone();
    second.volume = Uuid([8; 16]);
    second.name = "second".into();
    second.layout = LayoutBody::Concat {};
    second.size_bytes = 3 * MIB;
    second.extents = (0..3u32)
        .map(|row| {
            let t = s.target(row as usize);
            let nsid = 100 + row;
            t.target
                .put_namespace_backend(
                    &host_subsystem(),
                    nsid,
                    Arc::new(RamBackend::new(EXTENT, 512)),
                )
                .unwrap();
            PlanExtent {
                target: format!("target-{row}"),
                addr: t.addr,
                rdma_addr: None,
                subsystem_nqn: host_subsystem(),
                nsid,
                device: "ram".into(),
                offset: 0,
                length: EXTENT,
                member: 0,
                row,
                copy: 0,
            }
        })
        .collect();
    second.validate().unwrap();

    let shared = nvpool_initiator::volume::Connections::new();
    let o = VolumeOptions {
        connections: Some(shared.clone()),
        ..opts()
    };
    let a = Volume::open(&s.plan, o.clone()).unwrap();
    let b = Volume::open(&second, o).unwrap();
    assert_eq!(shared.controller_count(), 3);
    for t in s.all() {
        assert_eq!(
            host_controllers(t),
            1,
            "one controller per target for both volumes"
        );
    }
    let mut ma = vec![0u8; a.size() as usize];
    let mut mb = vec![0u8; b.size() as usize];
    write(&a, &mut ma, 60 * K, 2 * MIB, 31, false);
    write(&b, &mut mb, 4 * K, 2 * MIB + 8 * K, 32, false);
    read_check(&a, &ma, 0, a.size());
    read_check(&b, &mb, 0, b.size());
    // Closing one leaves the other connected and working.
    a.close().unwrap();
    read_check(&b, &mb, 0, b.size());
    for t in s.all() {
        assert_eq!(host_controllers(t), 1);
    }
    b.close().unwrap();
    assert_eq!(shared.controller_count(), 0);
    for t in s.all() {
        wait_for("the shared controllers to go", WAIT, || {
            host_controllers(t) == 0
        });
    }
}

#[test]
fn full_queues_keep_track_of_every_request() {
    // Two-deep queues fill up all the time under eight callers: a request
    // whose last command fills the queue must still complete exactly once.
    let layout = LayoutBody::Raid10 {
        stripe_bytes: 16 * K,
        width: 2,
        copies: 2,
    };
    let s = setup(2, layout, 4 * MIB, "ram:1M");
    let o = VolumeOptions {
        queue_depth: 2,
        ..opts()
    };
    let v = Volume::open(&s.plan, o).unwrap();
    let eighth = v.size() / 8;
    // A lost request hangs its caller: fail loudly instead of waiting.
    let (done, watch) = std::sync::mpsc::sync_channel::<()>(1);
    std::thread::spawn(move || {
        if watch.recv_timeout(4 * WAIT).is_err() {
            eprintln!("full_queues_keep_track_of_every_request: requests lost (no progress)");
            std::process::exit(1);
        }
    });
    std::thread::scope(|sc| {
        for t in 0..8u64 {
            let v = &v;
            sc.spawn(move || {
                let mut rng = Rng::new(t + 100);
                for i in 0..150 {
                    let (off, len) = range(&mut rng, t * eighth, (t + 1) * eighth, 12);
                    let data = pattern(t << 20 | i, len as usize);
                    let (r, _) = block_on(v.write(off, data.clone(), false));
                    r.unwrap();
                    let (r, got) = block_on(v.read(off, vec![0; len as usize]));
                    r.unwrap();
                    assert_same(&got, &data, "read-back through full queues");
                }
            });
        }
    });
    done.send(()).unwrap();
    block_on(v.flush()).unwrap();
    assert!(v.health().is_healthy());
}

#[test]
fn copies_known_to_have_failed_are_never_touched() {
    let s = setup(2, LayoutBody::Raid1 { copies: 2 }, 3 * MIB, "ram:1M");
    let stale: Vec<usize> = (0..s.plan.extents.len())
        .filter(|&i| s.plan.extents[i].addr == s.target(1).addr)
        .collect();
    let o = VolumeOptions {
        failed_extents: stale.clone(),
        ..opts()
    };
    let v = Volume::open(&s.plan, o).unwrap();
    assert_eq!(
        v.controller_count(),
        1,
        "the stale copies' target is not connected"
    );
    assert_eq!(s.host_controllers(1), 0);
    assert_eq!(v.health().failed_extents, stale);
    assert!(v.health().is_degraded());
    let mut model = vec![0u8; v.size() as usize];
    write(&v, &mut model, 0, v.size(), 41, false);
    for _ in 0..4 {
        read_check(&v, &model, 0, v.size());
    }
    v.close().unwrap();
    // Nothing reached the stale copies; the others hold everything.
    let ns = read_namespaces(&s);
    for &i in &stale {
        assert!(
            ns[i].iter().all(|&b| b == 0),
            "stale extent {i} was written"
        );
    }
    let g = s.plan.geometry();
    for seg in g.segments(0, g.size_bytes).unwrap() {
        let first = seg.location.first_extent_index(&g);
        let live = if stale.contains(&first) {
            first + 1
        } else {
            first
        };
        let at = seg.location.offset_in_extent as usize;
        assert_same(
            &ns[live][at..at + seg.len as usize],
            &model[seg.volume_offset as usize..][..seg.len as usize],
            "live copy",
        );
    }

    // Failed extents must exist, and leave every extent a copy.
    for bad in [vec![6], vec![0, 1]] {
        let o = VolumeOptions {
            failed_extents: bad.clone(),
            ..opts()
        };
        assert!(
            matches!(Volume::open(&s.plan, o), Err(Error::Invalid(_))),
            "failed extents {bad:?}"
        );
    }
}

/// What the writer of the grow test saw.
#[derive(Debug, Default)]
struct Verified {
    /// Writes that read back right: (offset, len, seed), in order.
    written: Vec<(u64, u64, u64)>,
    errors: Vec<String>,
}

#[test]
fn a_mirror_grows_under_writers_and_serves_the_new_rows_on_every_copy() {
    let layout = LayoutBody::Raid10 {
        stripe_bytes: 16 * K,
        width: 2,
        copies: 2,
    };
    // Two rows of 2 MiB, the second half used: the growth starts inside
    // existing extents and then adds a row.
    let old_size = 3 * MIB;
    let new_size = 6 * MIB;
    let mut s = setup(3, layout, old_size, "ram:1M");
    let v = Volume::open(&s.plan, opts()).unwrap();
    assert_eq!(v.controller_count(), 3);
    let across = old_size - 8 * K;
    let (r, _) = block_on(v.read(across, vec![0; 16 * K as usize]));
    assert!(matches!(r, Err(IoError::Invalid(_))), "{r:?}");

    let grown = s.grow(new_size, 512);
    let stop = AtomicBool::new(false);
    let progress = AtomicU64::new(0);
    let refused = AtomicU64::new(0);
    let (seen, flips) = std::thread::scope(|sc| {
        let _stop = StopOnDrop(&stop);
        let (v, stop, progress, refused) = (&v, &stop, &progress, &refused);
        let writer = sc.spawn(move || {
            let mut rng = Rng::new(77);
            let mut seen = Verified::default();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                // Up to 256 KiB: across stripe units, members and rows.
                let (off, len) = range(&mut rng, 0, old_size, 64);
                let data = pattern(i, len as usize);
                let (r, _) = block_on(v.write(off, data.clone(), i.is_multiple_of(4)));
                if let Err(e) = r {
                    seen.errors.push(format!("write {off}+{len}: {e}"));
                    continue;
                }
                let (r, got) = block_on(v.read(off, vec![0; len as usize]));
                match r {
                    Ok(()) if got == data => seen.written.push((off, len, i)),
                    Ok(()) => seen.errors.push(format!("read {off}+{len}: wrong data")),
                    Err(e) => seen.errors.push(format!("read {off}+{len}: {e}")),
                }
                progress.fetch_add(1, Ordering::Relaxed);
            }
            seen
        });
        // Reads across the old end: refused until the new rows are
        // published, served from then on, never refused again.
        let reader = sc.spawn(move || {
            let mut flips = Vec::new();
            let mut served = false;
            while !stop.load(Ordering::Relaxed) {
                let (r, _) = block_on(v.read(across, vec![0; 16 * K as usize]));
                let now = match r {
                    Ok(()) => true,
                    Err(IoError::Invalid(_)) => {
                        refused.fetch_add(1, Ordering::Relaxed);
                        false
                    }
                    Err(e) => panic!("read across the old end: {e}"),
                };
                if now != served {
                    flips.push(now);
                    served = now;
                }
            }
            flips
        });
        wait_for("the writer to get going", WAIT, || {
            progress.load(Ordering::Relaxed) >= 30
        });
        wait_for("the reader to be refused past the old end", WAIT, || {
            refused.load(Ordering::Relaxed) >= 10
        });
        assert!(v.grow(&grown).expect("the volume grows"));
        let after = progress.load(Ordering::Relaxed);
        wait_for("the writer to go on after the grow", WAIT, || {
            progress.load(Ordering::Relaxed) >= after + 30
        });
        stop.store(true, Ordering::Relaxed);
        (writer.join().unwrap(), reader.join().unwrap())
    });
    assert!(seen.errors.is_empty(), "{:?}", seen.errors);
    // Refused before (at least ten times), then served, never refused again.
    assert_eq!(flips, vec![true], "served from the grow on, and only then");
    assert_eq!(v.size(), new_size);
    assert_eq!(*v.plan(), grown);
    assert_eq!(v.geometry(), grown.geometry());
    assert_eq!(BlockDev::size(&v), new_size);
    // The new extents' namespaces went through the controllers the volume
    // had: one per target still.
    assert_eq!(v.controller_count(), 3);
    for t in s.all() {
        assert_eq!(host_controllers(t), 1);
    }
    assert!(v.health().is_healthy(), "{:?}", v.health());

    let mut model = vec![0u8; new_size as usize];
    for &(off, len, seed) in &seen.written {
        model[off as usize..(off + len) as usize].copy_from_slice(&pattern(seed, len as usize));
    }
    // The new region, in pieces and across the old end.
    write(&v, &mut model, old_size, new_size - old_size, 91, false);
    write(&v, &mut model, across, 40 * K, 92, true);
    write(&v, &mut model, new_size - 20 * K, 20 * K, 93, false);
    read_check(&v, &model, 0, new_size);
    let (r, _) = block_on(v.read(new_size - 4 * K, vec![0; 8 * K as usize]));
    assert!(
        matches!(r, Err(IoError::Invalid(_))),
        "past the new end: {r:?}"
    );
    v.close().unwrap();
    // Every byte on every copy, the new rows included.
    check_placement(&s, &model);
}

#[test]
fn a_grow_onto_a_new_target_connects_it_through_the_shared_connections() {
    // RAID1 over three targets: row 0 sits on targets 0 and 1, row 1 on
    // 1 and 2, row 2 on 2 and 0.
    let mut s = setup(3, LayoutBody::Raid1 { copies: 2 }, MIB, "ram:1M");
    let shared = nvpool_initiator::volume::Connections::new();
    let o = VolumeOptions {
        connections: Some(shared.clone()),
        ..opts()
    };
    let v = Volume::open(&s.plan, o).unwrap();
    assert_eq!((v.controller_count(), shared.controller_count()), (2, 2));
    assert_eq!(s.host_controllers(2), 0);
    let mut model = vec![0u8; 3 * MIB as usize];
    write(&v, &mut model, 0, MIB, 61, false);

    let grown = s.grow(3 * MIB, 512);
    assert!(v.grow(&grown).unwrap());
    assert_eq!((v.controller_count(), shared.controller_count()), (3, 3));
    for t in 0..3 {
        assert_eq!(s.host_controllers(t), 1, "controllers on target {t}");
    }
    write(&v, &mut model, MIB - 4 * K, 2 * MIB + 4 * K, 62, true);
    read_check(&v, &model, 0, 3 * MIB);
    // A volume opened later with the same connections finds them.
    let again = Volume::open(
        &grown,
        VolumeOptions {
            connections: Some(shared.clone()),
            ..opts()
        },
    )
    .unwrap();
    assert_eq!(shared.controller_count(), 3);
    read_check(&again, &model, 0, 3 * MIB);
    again.close().unwrap();
    v.close().unwrap();
    check_placement(&s, &model);
}

#[test]
fn a_grow_that_does_not_fit_the_volume_is_refused_and_changes_nothing() {
    let mut s = setup(2, LayoutBody::Raid1 { copies: 2 }, 2 * MIB, "ram:1M");
    let v = Volume::open(&s.plan, opts()).unwrap();
    let mut model = vec![0u8; 4 * MIB as usize];
    write(&v, &mut model, 0, 2 * MIB, 71, false);
    assert!(!v.grow(&s.plan).unwrap(), "the same size");

    let old = s.plan.clone();
    let grown = s.grow(4 * MIB, 512);
    let refused = |plan: &nvpool_layout::plan::ConnectionPlan, what: &str, says: &str| {
        match v.grow(plan) {
            Err(Error::Invalid(m)) => assert!(m.contains(says), "{what}: {m}"),
            other => panic!("{what}: {other:?}"),
        }
        assert_eq!(v.size(), 2 * MIB, "{what}");
        assert_eq!(*v.plan(), old, "{what}");
        let (r, _) = block_on(v.read(2 * MIB, vec![0; 4096]));
        assert!(matches!(r, Err(IoError::Invalid(_))), "{what}: {r:?}");
        assert_eq!(v.controller_count(), 2, "{what}");
        assert!(v.health().is_healthy(), "{what}");
        read_check(&v, &model, 0, 2 * MIB);
    };

    // An existing extent elsewhere: copy 1 of row 0 swapped with copy 1
    // of the new row 2 (both on target 1), or row 1's copies swapped
    // between the targets.
    let mut moved = grown.clone();
    moved.extents[1].nsid = grown.extents[5].nsid;
    moved.extents[5].nsid = grown.extents[1].nsid;
    refused(&moved, "a changed namespace", "extent 1");
    let mut moved = grown.clone();
    moved.extents[2].addr = grown.extents[3].addr;
    moved.extents[3].addr = grown.extents[2].addr;
    refused(&moved, "an extent on another target", "extent 2");
    // Smaller: one row left.
    let mut smaller = old.clone();
    smaller.size_bytes = MIB;
    smaller.extents.truncate(2);
    refused(&smaller, "a shrink", "never shrinks");
    // Not this volume, or not the same shape.
    let mut other = grown.clone();
    other.volume = Uuid([9; 16]);
    refused(&other, "another volume", "volume");
    let mut other = grown.clone();
    other.block_bytes = 512;
    refused(&other, "another block size", "blocks");
    // Striped over two members: as many extents, in another order.
    let mut other = grown.clone();
    other.layout = LayoutBody::Raid10 {
        stripe_bytes: 64 * K,
        width: 2,
        copies: 2,
    };
    for (i, e) in other.extents.iter_mut().enumerate() {
        (e.row, e.member) = ((i / 4) as u32, (i / 2 % 2) as u32);
    }
    other.validate().unwrap();
    refused(&other, "another layout", "layout");
    let mut other = grown.clone();
    other.extents.pop();
    refused(&other, "a plan that does not validate", "connection plan");
    // A new extent that is not there: nothing connected stays.
    let mut missing = grown.clone();
    missing.extents[5].nsid = 77;
    assert!(
        v.grow(&missing).is_err(),
        "a new namespace that is not there"
    );
    assert_eq!(v.size(), 2 * MIB);
    for t in 0..2 {
        assert_eq!(s.host_controllers(t), 1);
    }

    // The real thing still works, once.
    assert!(v.grow(&grown).unwrap());
    assert!(!v.grow(&grown).unwrap(), "the same size again");
    assert_eq!(v.size(), 4 * MIB);
    write(&v, &mut model, 2 * MIB, 2 * MIB, 72, false);
    read_check(&v, &model, 0, 4 * MIB);
    v.close().unwrap();
    check_placement(&s, &model);
}

#[test]
fn a_grow_within_the_last_row_adds_no_extent() {
    let mut s = setup(1, LayoutBody::Concat {}, 512 * K, "ram:1M");
    let v = Volume::open(&s.plan, opts()).unwrap();
    let mut model = vec![0u8; MIB as usize];
    write(&v, &mut model, 0, 512 * K, 81, false);
    let grown = s.grow(MIB, 512);
    assert_eq!(grown.extents.len(), 1);
    assert!(v.grow(&grown).unwrap());
    assert_eq!(v.size(), MIB);
    assert_eq!(v.controller_count(), 1);
    write(&v, &mut model, 512 * K - 4 * K, 516 * K, 82, true);
    read_check(&v, &model, 0, MIB);
    v.close().unwrap();
    assert_same(&s.read_copy(0, 0, MIB), &model, "the one extent");
}
