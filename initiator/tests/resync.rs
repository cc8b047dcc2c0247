//! Online resync, host side: copy states (Ok, Syncing, Failed), the
//! missed-regions record, begin_sync's drain, and reconnecting a copy
//! whose target came back — against in-process targets, checked through
//! the volume and on the copies' namespaces themselves.
//!
//! The volumes are RAID1 with 4 MiB extents (four 1 MiB regions each):
//! plan extent 0 (copy 0) on target 0, extent 1 (copy 1) on target 1.

mod common;

use common::volumes::*;
use common::volumes::{read_check, write};
use common::*;
use nvpool_initiator::device::block_on;
use nvpool_initiator::volume::Connections;
use nvpool_initiator::{CopyState, Error, IoError, MissedRegions, Volume, VolumeOptions};
use nvpool_layout::plan::{LayoutBody, RESYNC_REGION_BYTES};
use nvpool_target::backend::FaultConfig;
use nvpool_wire::Status;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

const EXTENT: u64 = 4 * MIB;
const REGION: u64 = RESYNC_REGION_BYTES;
const K: u64 = 1024;
const _: () = assert!(EXTENT == 4 * REGION);

fn raid1() -> LayoutBody {
    LayoutBody::Raid1 { copies: 2 }
}

fn missed(regions: &[u32], complete: bool) -> MissedRegions {
    MissedRegions {
        regions: regions.to_vec(),
        complete,
    }
}

fn failed_at_open(failed: &[usize]) -> VolumeOptions {
    VolumeOptions {
        failed_extents: failed.to_vec(),
        ..volume_opts()
    }
}

#[test]
fn a_copy_failed_at_open_records_each_region_written_since() {
    // Two rows: extents 0 (target 0) and 1 (target 1) hold volume bytes
    // [0, 4 MiB), extents 2 and 3 the next 4 MiB.
    let s = setup(2, raid1(), 2 * EXTENT, EXTENT, "ram:4M");
    let v = Volume::open(&s.plan, failed_at_open(&[1])).unwrap();
    assert_eq!(v.copy_state(0), CopyState::Ok);
    assert_eq!(v.copy_state(1), CopyState::Failed);
    // Earlier sessions' writes are unknown: never complete.
    assert_eq!(v.missed_regions(1), Some(missed(&[], false)));
    assert_eq!(v.missed_regions(0), None, "only failed copies have one");

    let mut model = vec![0u8; v.size() as usize];
    write(&v, &mut model, 4 * K, 4 * K, 1, false); // region 0
    write(&v, &mut model, 2 * REGION - 4 * K, 8 * K, 2, false); // regions 1 and 2

    // Row 1 (other extents) and flushes mark nothing on extent 1.
    write(&v, &mut model, EXTENT + 3 * REGION, 4 * K, 3, false);
    block_on(v.write_zeroes(EXTENT, 64 * K, false)).unwrap();
    block_on(v.discard(EXTENT + REGION, REGION)).unwrap();
    block_on(v.flush()).unwrap();
    assert_eq!(v.missed_regions(1), Some(missed(&[0, 1, 2], false)));
    // Zeroes and discards count like writes.
    block_on(v.discard(3 * REGION + 8 * K, 4 * K)).unwrap();
    assert_eq!(v.missed_regions(1), Some(missed(&[0, 1, 2, 3], false)));
    block_on(v.write_zeroes(0, 4 * K, true)).unwrap();
    model[..4 * K as usize].fill(0);
    assert_eq!(v.missed_regions(1), Some(missed(&[0, 1, 2, 3], false)));

    let h = v.health();
    assert_eq!(h.failed_extents, vec![1]);
    assert!(h.syncing_extents.is_empty());
    assert!(h.is_degraded(), "{h:?}");
    read_check(&v, &model, 0, v.size());
    v.close().unwrap();
    assert!(
        s.read_copy(1, 0, EXTENT).iter().all(|&b| b == 0),
        "nothing reached the failed copy"
    );
}

#[test]
fn a_copy_that_fails_in_this_session_has_a_complete_record() {
    let s = setup_faulty(2, raid1(), EXTENT, EXTENT);
    let (o, reports) = reporting(volume_opts());
    let v = Volume::open(&s.plan, o).unwrap();
    let mut model = vec![0u8; v.size() as usize];
    write(&v, &mut model, 0, EXTENT, 1, false);
    assert_eq!(v.missed_regions(1), None);

    // Copy 1 refuses a write copy 0 takes: it fails, and the write's
    // region is the first it missed.
    s.faults[1].set(FaultConfig {
        fail_writes: true,
        ..FaultConfig::default()
    });
    write(&v, &mut model, REGION + 8 * K, 4 * K, 2, false);
    assert_eq!(v.copy_state(1), CopyState::Failed);
    assert_eq!(v.missed_regions(1), Some(missed(&[1], true)));
    s.faults[1].heal();
    write(&v, &mut model, 3 * REGION, 4 * K, 3, false);
    block_on(v.write_zeroes(0, 4 * K, false)).unwrap();
    model[..4 * K as usize].fill(0);
    assert_eq!(v.missed_regions(1), Some(missed(&[0, 1, 3], true)));

    let r = reports.lock().unwrap().clone();
    assert_eq!(r.len(), 1, "reported once: {r:?}");
    assert_eq!((r[0].index, r[0].copy, r[0].member_lost), (1, 1, false));
    assert!(
        matches!(r[0].error, IoError::Status(st) if same_code(st, Status::WRITE_FAULT)),
        "{:?}",
        r[0].error
    );
    read_check(&v, &model, 0, v.size());
    v.close().unwrap();
}

#[test]
fn a_syncing_copy_is_written_and_never_read_until_finish_sync() {
    let s = setup(2, raid1(), EXTENT, EXTENT, "ram:4M");
    let v = Volume::open(&s.plan, failed_at_open(&[1])).unwrap();
    let size = v.size();
    let mut model = vec![0u8; size as usize];
    // Copy 0 only: copy 1 keeps zeroes, unlike copy 0, everywhere.
    write(&v, &mut model, 0, size, 1, false);

    // A writer rewrites region 0 in 64 KiB slots, across begin_sync.
    const SLOT: u64 = 64 * K;
    let slots = REGION / SLOT;
    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let (record, last_seeds) = std::thread::scope(|sc| {
        let _stop = StopOnDrop(&stop);
        let (v, stop, done) = (&v, &stop, &done);
        let writer = sc.spawn(move || {
            let mut last = vec![0u64; slots as usize];
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let slot = i % slots;
                let seed = 1000 + i;
                let data = pattern(seed, SLOT as usize);
                let (r, _) = block_on(v.write(slot * SLOT, data, false));
                r.unwrap_or_else(|e| panic!("write {i} across begin_sync: {e}"));
                last[slot as usize] = seed;
                done.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            last
        });
        wait_for("the writer to get going", WAIT, || {
            done.load(Ordering::Relaxed) >= slots
        });
        let record = v.begin_sync(1);
        // The writer is sequential: every write it starts after this
        // count went out after begin_sync returned, hence to copy 1.
        let after = done.load(Ordering::Relaxed);
        assert_eq!(v.copy_state(1), CopyState::Syncing);
        // Never read while syncing: regions 2 and 3 differ between the
        // copies, and every read returns copy 0's bytes.
        for _ in 0..40 {
            read_check(v, &model, 2 * REGION, 2 * REGION);
        }
        wait_for("every slot to be rewritten after begin_sync", WAIT, || {
            done.load(Ordering::Relaxed) >= after + 2 * slots
        });
        stop.store(true, Ordering::Relaxed);
        (record, writer.join().unwrap())
    });
    // Written while failed in this session (all of it), but the copy was
    // failed at open: incomplete.
    assert_eq!(record.unwrap(), missed(&[0, 1, 2, 3], false));
    for (slot, &seed) in last_seeds.iter().enumerate() {
        if seed != 0 {
            let at = slot * SLOT as usize;
            model[at..at + SLOT as usize].copy_from_slice(&pattern(seed, SLOT as usize));
        }
    }
    let h = v.health();
    assert_eq!(
        (h.failed_extents.len(), h.syncing_extents.clone()),
        (0, vec![1])
    );
    assert!(h.is_degraded() && !h.is_healthy(), "{h:?}");
    assert_eq!(v.missed_regions(1), None, "a syncing copy has no record");
    read_check(&v, &model, 0, size);

    // The writes after the switch reached copy 1, nothing else did.
    let copy1 = s.read_copy(1, 0, EXTENT);
    assert_same(
        &copy1[..REGION as usize],
        &model[..REGION as usize],
        "region 0 of copy 1",
    );
    assert!(
        copy1[REGION as usize..].iter().all(|&b| b == 0),
        "regions 1-3 of copy 1 were written"
    );

    // In sync now (as far as the volume knows): reads use copy 1 too, and
    // since no copy job filled it, some see its zeroes.
    v.finish_sync(1);
    assert_eq!(v.copy_state(1), CopyState::Ok);
    assert!(v.health().is_healthy());
    let at = 2 * REGION;
    let want = &model[at as usize..(at + 64 * K) as usize];
    let (from0, from1) = reads_seeing(&v, at, want, &vec![0; 64 * K as usize], 10);
    assert!(from0 > 0 && from1 > 0, "copy 0: {from0}, copy 1: {from1}");
    v.close().unwrap();
}

#[test]
fn begin_sync_waits_for_the_writes_issued_before_it_and_only_those() {
    let s = setup_faulty(2, raid1(), EXTENT, EXTENT);
    let v = Volume::open(&s.plan, failed_at_open(&[1])).unwrap();
    let mut model = vec![0u8; v.size() as usize];
    write(&v, &mut model, 0, v.size(), 1, false);

    // A slow write (copy 0 takes half a second) is in flight when
    // begin_sync switches copy 1 to Syncing.
    s.faults[0].set(FaultConfig {
        latency: Duration::from_millis(500),
        ..FaultConfig::default()
    });
    let slow = pattern(2, 64 * K as usize);
    let record = std::thread::scope(|sc| {
        let (v, slow) = (&v, &slow);
        let w = sc.spawn(move || block_on(v.write(2 * REGION, slow.clone(), false)).0);
        wait_for("the slow write to be in flight", WAIT, || {
            v.controllers().iter().any(|c| c.in_flight() > 0)
        });
        let record = v.begin_sync(1).unwrap();
        // Drained: the write completed on copy 0 before begin_sync
        // returned (its commands are no longer counted in flight).
        let busy: Vec<usize> = v.controllers().iter().map(|c| c.in_flight()).collect();
        assert!(busy.iter().all(|&n| n == 0), "in flight: {busy:?}");
        w.join().unwrap().expect("the slow write");
        record
    });
    model[2 * REGION as usize..][..slow.len()].copy_from_slice(&slow);
    // Issued while copy 1 was failed: recorded there, not sent there.
    assert_eq!(record, missed(&[0, 1, 2, 3], false));
    assert!(
        s.read_copy(1, 2 * REGION, 64 * K).iter().all(|&b| b == 0),
        "a write issued before the switch reached the syncing copy"
    );

    // Under constant load (two writers, one slow copy) a second
    // begin_sync (idempotent) still ends: it never waits for writes
    // issued after it started.
    s.faults[0].set(FaultConfig {
        latency: Duration::from_millis(50),
        ..FaultConfig::default()
    });
    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let again = std::thread::scope(|sc| {
        let _stop = StopOnDrop(&stop);
        for w in 0..2u64 {
            let (v, stop, done) = (&v, &stop, &done);
            sc.spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let off = 3 * REGION + w * 128 * K + (i % 16) * 4 * K;
                    let (r, _) = block_on(v.write(off, pattern(w << 32 | i, 4096), false));
                    r.unwrap();
                    done.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            });
        }
        wait_for("the writers to get going", WAIT, || {
            done.load(Ordering::Relaxed) >= 4
        });
        let again = v.begin_sync(1);
        stop.store(true, Ordering::Relaxed);
        again
    });
    assert_eq!(again.unwrap(), record, "the same record again");
    s.faults[0].heal();

    // After the switch, writes land on copy 1.
    let data = write(&v, &mut model, REGION, 8 * K, 3, false);
    assert_same(
        &s.read_copy(1, REGION, 8 * K),
        &data,
        "a write after begin_sync on copy 1",
    );
    v.close().unwrap();
}

#[test]
fn a_syncing_copy_that_fails_is_failed_again_and_reported() {
    let s = setup_faulty(2, raid1(), EXTENT, EXTENT);
    let (o, reports) = reporting(failed_at_open(&[1]));
    let v = Volume::open(&s.plan, o).unwrap();
    let mut model = vec![0u8; v.size() as usize];
    write(&v, &mut model, 0, REGION, 1, false);
    assert_eq!(v.begin_sync(1).unwrap(), missed(&[0], false));

    // Copy 1 refuses a write copy 0 takes.
    s.faults[1].set(FaultConfig {
        fail_writes: true,
        ..FaultConfig::default()
    });
    write(&v, &mut model, 2 * REGION, 8 * K, 2, false);
    assert_eq!(v.copy_state(1), CopyState::Failed);
    // A fresh record, complete, holding the write that failed.
    assert_eq!(v.missed_regions(1), Some(missed(&[2], true)));
    {
        let r = reports.lock().unwrap();
        assert_eq!(r.len(), 1, "{r:?}");
        assert_eq!((r[0].index, r[0].member_lost), (1, false));
        assert!(
            matches!(r[0].error, IoError::Status(st) if same_code(st, Status::WRITE_FAULT)),
            "{:?}",
            r[0].error
        );
    }
    // The volume keeps serving.
    write(&v, &mut model, 0, 4 * K, 3, false);
    read_check(&v, &model, 0, v.size());
    assert_eq!(v.missed_regions(1), Some(missed(&[0, 2], true)));

    // Healed, it syncs again (its controller is live: no new connection).
    s.faults[1].heal();
    let controllers = v.controller_count();
    assert_eq!(v.begin_sync(1).unwrap(), missed(&[0, 2], true));
    assert_eq!(v.controller_count(), controllers);

    // A write only the syncing copy takes does not succeed (copy 0 is
    // the only copy in sync), and copy 1, now unlike copy 0 there, fails.
    s.faults[0].set(FaultConfig {
        fail_writes: true,
        ..FaultConfig::default()
    });
    let (r, _) = block_on(v.write(3 * REGION, pattern(4, 4096), false));
    assert!(
        matches!(r, Err(IoError::Status(st)) if same_code(st, Status::WRITE_FAULT)),
        "{r:?}"
    );
    assert_eq!(
        v.copy_state(0),
        CopyState::Ok,
        "a media error fails no copy"
    );
    assert_eq!(v.copy_state(1), CopyState::Failed);
    assert_eq!(v.missed_regions(1), Some(missed(&[3], true)));
    assert_eq!(reports.lock().unwrap().len(), 2);
    s.faults[0].heal();
    write(&v, &mut model, 3 * REGION, 4 * K, 5, false);
    read_check(&v, &model, 0, v.size());
    v.close().unwrap();
}

#[test]
fn abort_sync_records_missed_regions_afresh_without_a_report() {
    let s = setup(2, raid1(), EXTENT, EXTENT, "ram:4M");
    let (o, reports) = reporting(failed_at_open(&[1]));
    let v = Volume::open(&s.plan, o).unwrap();
    let mut model = vec![0u8; v.size() as usize];
    write(&v, &mut model, 0, 4 * K, 1, false);
    assert_eq!(v.begin_sync(1).unwrap(), missed(&[0], false));
    let data = write(&v, &mut model, REGION, 4 * K, 2, false);
    assert_same(
        &s.read_copy(1, REGION, 4 * K),
        &data,
        "written while syncing",
    );

    v.abort_sync(1);
    assert_eq!(v.copy_state(1), CopyState::Failed);
    // This session sees every later write: complete from now on.
    assert_eq!(v.missed_regions(1), Some(missed(&[], true)));
    write(&v, &mut model, 3 * REGION, 4 * K, 3, false);
    assert_eq!(v.missed_regions(1), Some(missed(&[3], true)));
    assert!(
        s.read_copy(1, 3 * REGION, 4 * K).iter().all(|&b| b == 0),
        "written after the abort"
    );
    // Neither call changes a failed copy.
    v.abort_sync(1);
    v.finish_sync(1);
    assert_eq!(v.copy_state(1), CopyState::Failed);
    assert_eq!(v.missed_regions(1), Some(missed(&[3], true)));
    assert!(
        reports.lock().unwrap().is_empty(),
        "an abort is not a failure"
    );

    assert_eq!(v.begin_sync(1).unwrap(), missed(&[3], true));
    v.finish_sync(1);
    assert!(v.health().is_healthy());
    read_check(&v, &model, 0, REGION);
    v.close().unwrap();
}

#[test]
fn copies_opened_syncing_are_written_and_never_read() {
    let mut s = setup(2, raid1(), EXTENT, EXTENT, "ram:4M");
    // Copy 1 differs from copy 0 (zeroes) in region 1.
    let other = pattern(9, 64 * K as usize);
    s.write_copy(1, REGION, &other);
    let o = VolumeOptions {
        syncing_extents: vec![1],
        ..volume_opts()
    };
    let v = Volume::open(&s.plan, o.clone()).unwrap();
    assert_eq!(v.copy_state(1), CopyState::Syncing);
    assert_eq!(s.host_controllers(1), 1, "a syncing copy is connected");
    assert_eq!(v.health().syncing_extents, vec![1]);
    assert_eq!(v.missed_regions(1), None);
    let zeroes = vec![0u8; other.len()];
    assert_eq!(reads_seeing(&v, REGION, &zeroes, &other, 20), (20, 0));
    let mut model = vec![0u8; v.size() as usize];
    let data = write(&v, &mut model, 2 * REGION, 8 * K, 2, false);
    assert_same(&s.read_copy(1, 2 * REGION, 8 * K), &data, "copy 1");
    // Syncing since open: this session wrote it everything.
    assert_eq!(v.begin_sync(1).unwrap(), missed(&[], true));
    v.finish_sync(1);
    let (from0, from1) = reads_seeing(&v, REGION, &zeroes, &other, 10);
    assert!(from0 > 0 && from1 > 0, "copy 0: {from0}, copy 1: {from1}");
    v.close().unwrap();

    // Lists that leave a row without a copy in sync, name a copy twice or
    // name no extent of the plan are refused.
    for (failed, syncing) in [
        (vec![], vec![0, 1]),
        (vec![0], vec![1]),
        (vec![1], vec![1]),
        (vec![], vec![2]),
    ] {
        let o = VolumeOptions {
            failed_extents: failed.clone(),
            syncing_extents: syncing.clone(),
            ..volume_opts()
        };
        assert!(
            matches!(Volume::open(&s.plan, o), Err(Error::Invalid(_))),
            "failed {failed:?}, syncing {syncing:?}"
        );
    }
    // A syncing copy must be reachable; a failed one need not be.
    s.stop(1);
    assert!(Volume::open(&s.plan, o).is_err());
    let v = Volume::open(&s.plan, failed_at_open(&[1])).unwrap();
    v.close().unwrap();
}

#[test]
fn a_dead_targets_copy_is_reconnected_and_resynced_after_a_restart() {
    let mut s = setup(2, raid1(), EXTENT, EXTENT, "ram:4M");
    let shared = Connections::new();
    let (o, reports) = reporting(VolumeOptions {
        connections: Some(shared.clone()),
        ..volume_opts()
    });
    let v = Volume::open(&s.plan, o).unwrap();
    assert_eq!(shared.controller_count(), 2);
    let mut model = vec![0u8; v.size() as usize];
    write(&v, &mut model, 0, EXTENT, 1, false);

    // Target 1 dies: writes go on, and the first to find its controller
    // lost (after the 2 s controller-loss timeout) fails copy 1.
    s.stop(1);
    let mut i = 0;
    while v.copy_state(1) != CopyState::Failed {
        assert!(i < 20, "copy 1 never failed");
        write(&v, &mut model, REGION + i * 4 * K, 4 * K, 10 + i, false);
        i += 1;
    }
    {
        let r = reports.lock().unwrap();
        assert_eq!(r.len(), 1, "{r:?}");
        assert_eq!((r[0].index, &r[0].error), (1, &IoError::ControllerLost));
    }
    assert_eq!(v.missed_regions(1), Some(missed(&[1], true)));
    assert_eq!(
        shared.controller_count(),
        1,
        "a lost controller is not shared"
    );
    write(&v, &mut model, 3 * REGION, 4 * K, 2, false);
    // While the target is down, begin_sync fails and the copy stays failed.
    assert!(v.begin_sync(1).is_err());
    assert_eq!(v.copy_state(1), CopyState::Failed);

    // Back on the same address (with empty RAM namespaces): begin_sync
    // connects a new controller and shares it.
    s.restart(1);
    assert_eq!(v.begin_sync(1).unwrap(), missed(&[1, 3], true));
    assert_eq!(v.copy_state(1), CopyState::Syncing);
    assert_eq!(s.host_controllers(1), 1);
    assert_eq!(shared.controller_count(), 2);

    // The copy job's part, by hand: the restarted target lost everything,
    // so the whole extent comes from copy 0 (no volume writes meanwhile).
    let all = s.read_copy(0, 0, EXTENT);
    s.write_copy(1, 0, &all);
    // Writes reach both copies; then reads may use copy 1.
    write(&v, &mut model, 2 * REGION, 8 * K, 3, false);
    v.finish_sync(1);
    assert!(v.health().is_healthy(), "{:?}", v.health());
    for _ in 0..4 {
        read_check(&v, &model, 0, EXTENT);
    }
    v.close().unwrap();
    assert_eq!(shared.controller_count(), 0);
    assert_same(&s.read_copy(0, 0, EXTENT), &model, "copy 0");
    assert_same(&s.read_copy(1, 0, EXTENT), &model, "copy 1");
}

#[test]
fn a_copy_in_sync_that_is_stale_elsewhere_stops_being_read() {
    let s = setup(2, raid1(), EXTENT, EXTENT, "ram:4M");
    let (o, reports) = reporting(volume_opts());
    let v = Volume::open(&s.plan, o).unwrap();
    let mut model = vec![0u8; v.size() as usize];
    write(&v, &mut model, 0, EXTENT, 1, false);
    // Copy 0 is stale in region 2 (another host wrote while it was down
    // for that host, say).
    let stale = pattern(8, 64 * K as usize);
    s.write_copy(0, 2 * REGION, &stale);

    // The control plane says so: failed, not reported, never read.
    // (abort_sync is for copies being synced: a copy in use keeps it.)
    v.abort_sync(0);
    assert_eq!(v.copy_state(0), CopyState::Ok);
    v.mark_failed(0);
    assert_eq!(v.copy_state(0), CopyState::Failed);
    assert!(reports.lock().unwrap().is_empty());
    for _ in 0..20 {
        read_check(&v, &model, 2 * REGION, 64 * K);
    }
    assert_eq!(v.missed_regions(0), Some(missed(&[], true)));
    write(&v, &mut model, REGION, 4 * K, 2, false);
    assert_eq!(v.missed_regions(0), Some(missed(&[1], true)));

    // Its job mirrors to it: this session's record, still never read.
    assert_eq!(v.begin_sync(0).unwrap(), missed(&[1], true));
    for _ in 0..20 {
        read_check(&v, &model, 2 * REGION, 64 * K);
    }
    // The last copy in sync cannot be demoted, and only extents of the
    // plan are synced.
    assert!(matches!(v.begin_sync(1), Err(Error::Invalid(_))));
    assert_eq!(v.copy_state(1), CopyState::Ok);
    assert!(matches!(v.begin_sync(2), Err(Error::Invalid(_))));

    // begin_sync on a copy in use demotes it (this host wrote everything
    // to it: an empty, complete record) and reads leave it.
    v.finish_sync(0);
    assert_eq!(v.copy_state(0), CopyState::Ok);
    assert_eq!(v.begin_sync(0).unwrap(), missed(&[], true));
    assert_eq!(v.copy_state(0), CopyState::Syncing);
    for _ in 0..20 {
        read_check(&v, &model, 2 * REGION, 64 * K);
    }
    // Indices outside the plan change nothing.
    v.finish_sync(7);
    v.abort_sync(7);
    v.mark_failed(7);
    assert_eq!(v.missed_regions(7), None);
    assert_eq!(v.health().syncing_extents, vec![0]);
    // A syncing copy can be marked failed too.
    v.mark_failed(0);
    assert_eq!(v.copy_state(0), CopyState::Failed);
    assert_eq!(v.missed_regions(0), Some(missed(&[], true)));
    assert!(reports.lock().unwrap().is_empty());
    read_check(&v, &model, 0, EXTENT);
    v.close().unwrap();
}
