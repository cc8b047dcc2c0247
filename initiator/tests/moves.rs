//! Moving a copy slot to another extent, host side: the incoming copy
//! (begin_move), the switch, the leaving copy (end_move), a destination
//! that fails, and volumes opened with moves under way — against
//! in-process targets, checked on the namespaces themselves.
//!
//! The volumes are RAID1 with 4 MiB extents (four 1 MiB regions each):
//! plan extent 0 (copy 0) on target 0, extent 1 (copy 1) on target 1, and
//! the destinations are namespaces added to target 2.

mod common;

use common::volumes::*;
use common::volumes::{read_check, write};
use common::*;
use nvpool_initiator::device::block_on;
use nvpool_initiator::{CopyState, Error, IoError, MovingCopy, Volume, VolumeOptions};
use nvpool_layout::plan::{LayoutBody, RESYNC_REGION_BYTES};
use nvpool_target::backend::FaultConfig;
use nvpool_wire::Status;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

const EXTENT: u64 = 4 * MIB;
const REGION: u64 = RESYNC_REGION_BYTES;
const K: u64 = 1024;
const _: () = assert!(EXTENT == 4 * REGION);

fn raid1() -> LayoutBody {
    LayoutBody::Raid1 { copies: 2 }
}

fn with(failed: &[usize], moving: Vec<MovingCopy>) -> VolumeOptions {
    VolumeOptions {
        failed_extents: failed.to_vec(),
        moving,
        ..volume_opts()
    }
}

fn fail_writes() -> FaultConfig {
    FaultConfig {
        fail_writes: true,
        ..FaultConfig::default()
    }
}

fn zeroes(len: u64) -> Vec<u8> {
    vec![0; len as usize]
}

#[track_caller]
fn invalid<T: std::fmt::Debug>(r: Result<T, Error>, what: &str) {
    assert!(matches!(r, Err(Error::Invalid(_))), "{what}: {r:?}");
}

/// Slots of [`SLOT`] bytes at the start of the volume, rewritten by
/// [`WRITERS`] threads, each owning the slots `w, w + WRITERS, …`, so the
/// last operation on each slot is well defined.
const SLOT: u64 = 16 * K;
const SLOTS: u64 = 48;
const WRITERS: u64 = 3;

/// What a writer did last to a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Last {
    Untouched,
    Wrote(u64),
    Zeroed,
}

/// Runs the writers until `stop`; every fourth operation of the last
/// writer is a write-zeroes, the first writer's writes are FUA. Counts
/// operations in `done`; returns each slot's last operation.
fn writers(v: &Volume, stop: &AtomicBool, done: &AtomicU64) -> Vec<Last> {
    std::thread::scope(|sc| {
        let threads: Vec<_> = (0..WRITERS)
            .map(|w| {
                sc.spawn(move || {
                    let mut last = Vec::new();
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let slot = w + WRITERS * (i % (SLOTS / WRITERS));
                        let off = slot * SLOT;
                        if w == WRITERS - 1 && i % 4 == 3 {
                            block_on(v.write_zeroes(off, SLOT, false))
                                .unwrap_or_else(|e| panic!("zeroes {i} of writer {w}: {e}"));
                            last.push((slot, Last::Zeroed));
                        } else {
                            let seed = w << 32 | i;
                            let data = pattern(seed, SLOT as usize);
                            let (r, _) = block_on(v.write(off, data, w == 0));
                            r.unwrap_or_else(|e| panic!("write {i} of writer {w}: {e}"));
                            last.push((slot, Last::Wrote(seed)));
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                        i += 1;
                    }
                    last
                })
            })
            .collect();
        let mut last = vec![Last::Untouched; SLOTS as usize];
        for t in threads {
            for (slot, op) in t.join().unwrap() {
                last[slot as usize] = op;
            }
        }
        last
    })
}

/// `model` after the writers' last operations.
fn apply(model: &mut [u8], last: &[Last]) {
    for (slot, op) in last.iter().enumerate() {
        let at = &mut model[slot * SLOT as usize..][..SLOT as usize];
        match *op {
            Last::Untouched => {}
            Last::Wrote(seed) => at.copy_from_slice(&pattern(seed, SLOT as usize)),
            Last::Zeroed => at.fill(0),
        }
    }
}

#[test]
fn a_copy_in_sync_moves_to_another_target_under_writers() {
    let mut s = setup(3, raid1(), EXTENT, EXTENT, "ram:4M");
    let (o, reports) = reporting(volume_opts());
    let v = Volume::open(&s.plan, o).unwrap();
    let size = v.size();
    let mut model = vec![0u8; size as usize];
    write(&v, &mut model, 0, size, 1, false);
    let (dest, _) = s.spare(0, 2);
    assert_eq!(v.extent_location(0), s.plan.extents[0]);

    // Refused: not moving, outside the plan, another slot's row, member
    // or copy, where the copy is already.
    invalid(v.switch_move(0), "switch without a move");
    invalid(v.begin_move(2, &dest), "extent 2");
    let mut wrong = dest.clone();
    wrong.copy = 1;
    invalid(v.begin_move(0, &wrong), "copy 1's place for copy 0");
    invalid(v.begin_move(0, &s.plan.extents[0]), "where it is");
    assert!(v.health().moving_extents.is_empty());

    v.begin_move(0, &dest).unwrap();
    let h = v.health();
    assert_eq!(h.moving_extents, vec![0]);
    assert!(h.is_healthy(), "a move degrades nothing: {h:?}");
    assert!(!v.move_failed(0));
    // The copy job's part, by hand, with no write in flight.
    s.write_extent(&dest, 0, &s.read_copy(0, 0, EXTENT));
    // Never read before the switch: the destination differs from both
    // copies at the end of region 3, and every read returns theirs.
    let at = EXTENT - 64 * K;
    let odd = pattern(99, 64 * K as usize);
    s.write_extent(&dest, at, &odd);
    let want = model[at as usize..].to_vec();
    assert_eq!(reads_seeing(&v, at, &want, &odd, 20), (20, 0));
    s.write_extent(&dest, at, &want);

    // Writers all along the switch, and some more after it.
    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let last = std::thread::scope(|sc| {
        let _stop = StopOnDrop(&stop);
        let (v, stop, done) = (&v, &stop, &done);
        let w = sc.spawn(move || writers(v, stop, done));
        wait_for("the writers to get going", WAIT, || {
            done.load(Ordering::Relaxed) >= SLOTS
        });
        v.switch_move(0).unwrap();
        let after = done.load(Ordering::Relaxed);
        wait_for("the writers to go on after the switch", WAIT, || {
            done.load(Ordering::Relaxed) >= after + 2 * SLOTS
        });
        stop.store(true, Ordering::Relaxed);
        w.join().unwrap()
    });
    apply(&mut model, &last);
    write(&v, &mut model, 2 * REGION, 8 * K, 2, false);
    block_on(v.write_zeroes(3 * REGION, 16 * K, true)).unwrap();
    model[3 * REGION as usize..][..16 * K as usize].fill(0);

    assert_eq!(v.extent_location(0), dest);
    assert_eq!(*v.plan(), s.plan, "the plan the volume opened with");
    assert_eq!(v.copy_state(0), CopyState::Ok);
    let h = v.health();
    assert!(h.is_healthy() && h.moving_extents.is_empty(), "{h:?}");
    read_check(&v, &model, 0, size);
    // The old copy is leaving: still written, byte for byte the same.
    block_on(v.flush()).unwrap();
    assert_same(&s.read_extent(&dest, 0, EXTENT), &model, "destination");
    assert_same(&s.read_copy(0, 0, EXTENT), &model, "old copy (leaving)");
    assert_same(&s.read_copy(1, 0, EXTENT), &model, "copy 1");

    // Ended: the old extent is written no more.
    v.end_move(0);
    v.end_move(0);
    let data = write(&v, &mut model, REGION, 8 * K, 3, false);
    assert_same(&s.read_extent(&dest, REGION, 8 * K), &data, "destination");
    assert_ne!(
        s.read_copy(0, REGION, 8 * K),
        data,
        "old copy written after end_move"
    );
    read_check(&v, &model, 0, size);
    assert!(reports.lock().unwrap().is_empty());
    v.close().unwrap();
}

#[test]
fn begin_move_again_drains_or_replaces_the_incoming_copy() {
    let mut s = setup(3, raid1(), EXTENT, EXTENT, "ram:4M");
    let v = Volume::open(&s.plan, volume_opts()).unwrap();
    let mut model = vec![0u8; v.size() as usize];
    let (a, _) = s.spare(1, 2);
    let (b, _) = s.spare(1, 2);
    v.begin_move(1, &a).unwrap();
    let controllers = v.controller_count();
    assert_eq!(controllers, 3, "target 2's controller joined");
    // The same destination: drained again, nothing new connected.
    v.begin_move(1, &a).unwrap();
    assert_eq!(v.controller_count(), controllers);
    let one = write(&v, &mut model, 0, 8 * K, 1, false);
    assert_same(&s.read_extent(&a, 0, 8 * K), &one, "first destination");

    // Another destination replaces it.
    v.begin_move(1, &b).unwrap();
    assert_eq!(v.controller_count(), controllers);
    assert_eq!(v.health().moving_extents, vec![1]);
    let two = write(&v, &mut model, REGION, 8 * K, 2, false);
    assert_same(
        &s.read_extent(&b, REGION, 8 * K),
        &two,
        "second destination",
    );
    assert_same(
        &s.read_extent(&a, REGION, 8 * K),
        &zeroes(8 * K),
        "the replaced destination",
    );
    // (The second one missed the first write: a copy job would fill it.)
    s.write_extent(&b, 0, &one);
    v.switch_move(1).unwrap();
    assert_eq!(v.extent_location(1), b);
    // Switched, nothing is incoming: a second switch is refused.
    invalid(v.switch_move(1), "a second switch");
    v.close().unwrap();
}

#[test]
fn a_dead_copy_is_replaced_on_another_target() {
    let mut s = setup(3, raid1(), EXTENT, EXTENT, "ram:4M");
    // Copy 1's target is gone for good.
    s.stop(1);
    let (o, reports) = reporting(with(&[1], Vec::new()));
    let v = Volume::open(&s.plan, o).unwrap();
    let mut model = vec![0u8; v.size() as usize];
    write(&v, &mut model, 0, EXTENT, 1, false);
    let (dest, _) = s.spare(1, 2);

    v.begin_move(1, &dest).unwrap();
    assert_eq!(v.copy_state(1), CopyState::Failed);
    assert_eq!(v.health().moving_extents, vec![1]);
    let data = write(&v, &mut model, REGION, 8 * K, 2, false);
    assert_same(&s.read_extent(&dest, REGION, 8 * K), &data, "incoming copy");
    // The copy job's part: all of copy 0 (no write in flight).
    s.write_extent(&dest, 0, &s.read_copy(0, 0, EXTENT));

    v.switch_move(1).unwrap();
    assert_eq!(v.copy_state(1), CopyState::Ok);
    assert_eq!(v.missed_regions(1), None, "the dead copy's record is gone");
    assert_eq!(v.extent_location(1), dest);
    let h = v.health();
    assert!(h.is_healthy() && h.moving_extents.is_empty(), "{h:?}");
    v.end_move(1); // nothing is leaving: no-op
    let data = write(&v, &mut model, 3 * REGION, 8 * K, 3, false);
    assert_same(&s.read_extent(&dest, 3 * REGION, 8 * K), &data, "new copy");

    // Reads use the new copy: copy 0 differs from it in region 2 now
    // (behind the volume's back), and reads see both.
    let at = 2 * REGION;
    let odd = pattern(98, 64 * K as usize);
    s.write_copy(0, at, &odd);
    let want = model[at as usize..][..odd.len()].to_vec();
    let (from_new, from_0) = reads_seeing(&v, at, &want, &odd, 20);
    assert!(
        from_new > 0 && from_0 > 0,
        "new copy {from_new}, copy 0 {from_0}"
    );
    s.write_copy(0, at, &want);
    read_check(&v, &model, 0, EXTENT);
    assert!(reports.lock().unwrap().is_empty());

    // Its failures name where it is now, and begin_sync reconnects it
    // there (target 1, the plan's place, is still down).
    s.stop(2);
    let mut i = 0;
    while v.copy_state(1) != CopyState::Failed {
        assert!(i < 20, "the new copy never failed");
        write(&v, &mut model, i * 4 * K, 4 * K, 10 + i, false);
        i += 1;
    }
    {
        let r = reports.lock().unwrap();
        assert_eq!(r.len(), 1, "{r:?}");
        let f = &r[0];
        assert_eq!((f.index, &f.error), (1, &IoError::ControllerLost));
        assert_eq!(
            (&f.target, f.addr, &f.subsystem_nqn, f.nsid),
            (&dest.target, dest.addr, &dest.subsystem_nqn, dest.nsid)
        );
    }
    s.restart(2);
    let record = v.begin_sync(1).unwrap();
    assert_eq!(record.regions, vec![0]);
    assert_eq!(v.copy_state(1), CopyState::Syncing);
    s.write_extent(&dest, 0, &s.read_copy(0, 0, EXTENT));
    v.finish_sync(1);
    assert!(v.health().is_healthy());
    read_check(&v, &model, 0, EXTENT);
    v.close().unwrap();
    assert_same(&s.read_extent(&dest, 0, EXTENT), &model, "new copy");
}

#[test]
fn a_destination_that_fails_is_dropped_without_a_report() {
    let mut s = setup_faulty(3, raid1(), EXTENT, EXTENT);
    let (o, reports) = reporting(volume_opts());
    let v = Volume::open(&s.plan, o).unwrap();
    let mut model = vec![0u8; v.size() as usize];
    write(&v, &mut model, 0, EXTENT, 1, false);
    let (dest, fault) = s.spare(0, 2);

    // It refuses a write the copies in sync take.
    v.begin_move(0, &dest).unwrap();
    fault.set(fail_writes());
    write(&v, &mut model, REGION, 8 * K, 2, false);
    assert!(v.move_failed(0));
    assert!(v.health().moving_extents.is_empty());
    assert_eq!(
        (v.copy_state(0), v.copy_state(1)),
        (CopyState::Ok, CopyState::Ok)
    );
    invalid(v.switch_move(0), "switch to a failed destination");
    // Dropped: not written any more.
    fault.heal();
    write(&v, &mut model, 3 * REGION, 8 * K, 3, false);
    assert_same(
        &s.read_extent(&dest, 3 * REGION, 8 * K),
        &zeroes(8 * K),
        "a dropped destination",
    );
    read_check(&v, &model, 0, EXTENT);

    // Again: a fresh incoming copy.
    v.begin_move(0, &dest).unwrap();
    assert!(!v.move_failed(0));
    assert_eq!(v.health().moving_extents, vec![0]);
    let data = write(&v, &mut model, 2 * REGION, 8 * K, 4, false);
    assert_same(&s.read_extent(&dest, 2 * REGION, 8 * K), &data, "incoming");

    // It takes a write no copy in sync took: it differs from them now.
    s.faults[0].set(fail_writes());
    s.faults[1].set(fail_writes());
    let (r, _) = block_on(v.write(2 * REGION, pattern(5, 4096), false));
    assert!(
        matches!(r, Err(IoError::Status(st)) if same_code(st, Status::WRITE_FAULT)),
        "{r:?}"
    );
    s.faults[0].heal();
    s.faults[1].heal();
    assert!(v.move_failed(0));
    assert!(v.health().moving_extents.is_empty());
    invalid(v.switch_move(0), "switch to a destination that strayed");
    // abort_move forgets it.
    v.abort_move(0);
    assert!(!v.move_failed(0));

    // Aborted: not written any more, no switch.
    v.begin_move(0, &dest).unwrap();
    v.abort_move(0);
    v.abort_move(0);
    assert!(v.health().moving_extents.is_empty());
    write(&v, &mut model, 4 * K, 4 * K, 6, false);
    assert_same(
        &s.read_extent(&dest, 4 * K, 4 * K),
        &zeroes(4 * K),
        "an aborted destination",
    );
    invalid(v.switch_move(0), "switch after abort");

    // Its target goes away: writes wait for its controller-loss timeout,
    // then go on without it.
    v.begin_move(0, &dest).unwrap();
    s.stop(2);
    write(&v, &mut model, 8 * K, 4 * K, 7, false);
    assert!(v.move_failed(0));
    assert_eq!(
        (v.copy_state(0), v.copy_state(1)),
        (CopyState::Ok, CopyState::Ok)
    );
    assert!(
        v.begin_move(0, &dest).is_err(),
        "begin_move to a dead target"
    );
    read_check(&v, &model, 0, EXTENT);
    assert!(
        reports.lock().unwrap().is_empty(),
        "a destination's failure is the move's, not the volume's"
    );
    v.close().unwrap();
}

#[test]
fn errors_on_a_leaving_copy_are_silent() {
    let mut s = setup_faulty(3, raid1(), EXTENT, EXTENT);
    let (o, reports) = reporting(volume_opts());
    let v = Volume::open(&s.plan, o).unwrap();
    let mut model = vec![0u8; v.size() as usize];
    write(&v, &mut model, 0, EXTENT, 1, false);
    let (dest, _) = s.spare(0, 2);
    v.begin_move(0, &dest).unwrap();
    s.write_extent(&dest, 0, &s.read_copy(0, 0, EXTENT));
    v.switch_move(0).unwrap();

    // The old copy (leaving) refuses every write and flush.
    s.faults[0].set(fail_writes());
    let data = write(&v, &mut model, REGION, 64 * K, 2, true);
    block_on(v.write_zeroes(2 * REGION, 8 * K, false)).unwrap();
    model[2 * REGION as usize..][..8 * K as usize].fill(0);
    block_on(v.discard(3 * REGION, 8 * K)).unwrap();
    block_on(v.flush()).unwrap();
    assert_eq!(
        (v.copy_state(0), v.copy_state(1)),
        (CopyState::Ok, CopyState::Ok)
    );
    assert!(v.health().is_healthy());
    assert!(reports.lock().unwrap().is_empty());
    assert_same(&s.read_extent(&dest, REGION, 64 * K), &data, "new copy");
    assert!(
        s.faults[0].injected.load(Ordering::Relaxed) > 0,
        "the old copy was written"
    );
    s.faults[0].heal();
    v.end_move(0);
    read_check(&v, &model, 0, 3 * REGION);
    v.close().unwrap();
    // The discarded range reads as whatever the targets say; the rest
    // of both copies in sync agree.
    assert_same(
        &s.read_extent(&dest, 0, 3 * REGION),
        &s.read_copy(1, 0, 3 * REGION),
        "the copies in sync",
    );
}

#[test]
fn volumes_open_with_moves_under_way() {
    let mut s = setup(3, raid1(), EXTENT, EXTENT, "ram:4M");
    let (dest, _) = s.spare(0, 2);
    let moving = |switched| {
        vec![MovingCopy {
            extent: 0,
            dest: dest.clone(),
            switched,
        }]
    };
    // The destination differs from the plan's copies (zeroes) in region 1.
    let odd = pattern(97, 64 * K as usize);
    s.write_extent(&dest, REGION, &odd);
    let blank = zeroes(64 * K);

    // Not switched: incoming, written, never read.
    let v = Volume::open(&s.plan, with(&[], moving(false))).unwrap();
    assert_eq!(v.health().moving_extents, vec![0]);
    assert_eq!(v.extent_location(0), s.plan.extents[0]);
    assert_eq!(reads_seeing(&v, REGION, &blank, &odd, 20), (20, 0));
    let mut model = vec![0u8; v.size() as usize];
    let data = write(&v, &mut model, 2 * REGION, 8 * K, 1, false);
    assert_same(&s.read_extent(&dest, 2 * REGION, 8 * K), &data, "incoming");
    // Nothing was issued before the open: it may switch at once.
    v.switch_move(0).unwrap();
    assert_eq!(v.extent_location(0), dest);
    v.close().unwrap();

    // Switched, copy 1 failed: the destination is the only copy read, the
    // plan's extent 0 is leaving (written).
    let v = Volume::open(&s.plan, with(&[1], moving(true))).unwrap();
    assert_eq!(v.copy_state(0), CopyState::Ok);
    assert_eq!(v.extent_location(0), dest);
    assert!(v.health().moving_extents.is_empty());
    assert_eq!(reads_seeing(&v, REGION, &blank, &odd, 10), (0, 10));
    let data = write(&v, &mut model, 3 * REGION, 8 * K, 2, false);
    assert_same(&s.read_extent(&dest, 3 * REGION, 8 * K), &data, "new copy");
    assert_same(&s.read_copy(0, 3 * REGION, 8 * K), &data, "leaving copy");
    assert_same(
        &s.read_copy(1, 3 * REGION, 8 * K),
        &zeroes(8 * K),
        "failed copy",
    );
    v.close().unwrap();

    // Switched, and extent 0 listed failed: that is the old copy, which
    // is not written; the slot is in sync, so its row has a copy in sync
    // even with copy 1 failed too.
    let v = Volume::open(&s.plan, with(&[0, 1], moving(true))).unwrap();
    assert_eq!(v.copy_state(0), CopyState::Ok);
    assert_eq!(v.health().failed_extents, vec![1]);
    let data = write(&v, &mut model, 3 * REGION + 64 * K, 8 * K, 3, false);
    assert_same(
        &s.read_extent(&dest, 3 * REGION + 64 * K, 8 * K),
        &data,
        "new copy",
    );
    assert_same(
        &s.read_copy(0, 3 * REGION + 64 * K, 8 * K),
        &zeroes(8 * K),
        "a failed old copy",
    );
    v.close().unwrap();

    // Refused: an extent outside the plan, a destination of another copy,
    // an extent twice, a row left without a copy in sync.
    let mut other = moving(false);
    other[0].extent = 2;
    invalid(Volume::open(&s.plan, with(&[], other)), "extent 2");
    let mut other = moving(false);
    other[0].dest.copy = 1;
    invalid(Volume::open(&s.plan, with(&[], other)), "copy 1's place");
    let mut twice = moving(false);
    twice.extend(moving(true));
    invalid(Volume::open(&s.plan, with(&[], twice)), "twice");
    invalid(
        Volume::open(&s.plan, with(&[0, 1], moving(false))),
        "no copy in sync",
    );

    // A leaving copy that cannot be reached is done without.
    s.stop(0);
    let v = Volume::open(&s.plan, with(&[], moving(true))).unwrap();
    let data = write(&v, &mut model, 8 * K, 4 * K, 4, false);
    assert_same(&s.read_extent(&dest, 8 * K, 4 * K), &data, "new copy");
    assert!(v.health().is_healthy());
    v.close().unwrap();
    // An incoming copy must be reachable, like a syncing one.
    s.stop(2);
    assert!(Volume::open(&s.plan, with(&[0], moving(false))).is_err());
}

#[test]
fn writes_racing_switches_reach_both_places() {
    let mut s = setup(3, raid1(), EXTENT, EXTENT, "ram:4M");
    let v = Volume::open(&s.plan, volume_opts()).unwrap();
    let size = v.size();
    let mut model = vec![0u8; size as usize];
    write(&v, &mut model, 0, size, 1, false);
    let (dest, _) = s.spare(0, 2);
    let old = s.plan.extents[0].clone();
    v.begin_move(0, &dest).unwrap();
    s.write_extent(&dest, 0, &s.read_copy(0, 0, EXTENT));
    v.switch_move(0).unwrap();

    // The copy goes back and forth between the two places while writers
    // hammer the first slots: the place it leaves is leaving (written) and
    // the place it goes to was leaving before (written), so no copy job
    // is needed, and every write must reach both however it interleaves
    // with the switches.
    const SWITCHES: usize = 30;
    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let last = std::thread::scope(|sc| {
        let _stop = StopOnDrop(&stop);
        let (v, stop, done) = (&v, &stop, &done);
        let w = sc.spawn(move || writers(v, stop, done));
        wait_for("the writers to get going", WAIT, || {
            done.load(Ordering::Relaxed) >= SLOTS
        });
        for k in 0..SWITCHES {
            let to = if k % 2 == 0 { &old } else { &dest };
            v.begin_move(0, to).unwrap();
            let before = done.load(Ordering::Relaxed);
            v.switch_move(0).unwrap();
            assert_eq!(&v.extent_location(0), to);
            wait_for("writes across the switch", WAIT, || {
                done.load(Ordering::Relaxed) >= before + WRITERS
            });
        }
        stop.store(true, Ordering::Relaxed);
        w.join().unwrap()
    });
    apply(&mut model, &last);
    v.end_move(0);
    assert_eq!(
        v.extent_location(0),
        dest,
        "an even number of switches back"
    );
    let span = SLOTS * SLOT;
    read_check(&v, &model, 0, span);
    v.close().unwrap();
    let want = &model[..span as usize];
    assert_same(&s.read_extent(&dest, 0, span), want, "destination");
    assert_same(&s.read_extent(&old, 0, span), want, "old place");
    assert_same(&s.read_copy(1, 0, span), want, "copy 1");
}
