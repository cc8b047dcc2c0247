//! The volume engine's write epoch (design/thin-snapshots.md T5) on the
//! wire: every write, write-zeroes and discard carries it in CDW2 on every
//! copy, and raising it waits for the mutations admitted before, and only
//! for them. A group snapshot's write hold: while held, no new write goes
//! out (reads and flushes do), writes issued before complete and are
//! drained, and once released (or expired) the held ones go out tagged
//! with the new epoch. A RAID1 volume over two in-process targets, each
//! behind a [`Tap`] that reads the commands going by and can hold writes
//! back.

mod common;

use common::tap::{Seen, Tap};
use common::volumes::*;
use common::*;
use nvpool_initiator::device::block_on;
use nvpool_initiator::{Volume, VolumeOptions};
use nvpool_layout::plan::{ConnectionPlan, LayoutBody};
use nvpool_wire::sqe::nvm;
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

const EXTENT: u64 = 4 * MIB;
const K: u64 = 1024;

/// Two targets, one copy each, and a tap in front of each; the plan
/// reaches the targets through the taps.
fn tapped() -> (Setup, Vec<Tap>, ConnectionPlan) {
    let s = setup(2, LayoutBody::Raid1 { copies: 2 }, EXTENT, EXTENT, "ram:4M");
    let taps: Vec<Tap> = (0..2).map(|t| Tap::start(s.target(t).addr)).collect();
    let mut plan = s.plan.clone();
    for e in &mut plan.extents {
        let t = (0..2).find(|&t| s.target(t).addr == e.addr).unwrap();
        e.addr = taps[t].addr;
    }
    (s, taps, plan)
}

fn open(plan: &ConnectionPlan, write_epoch: u32) -> Volume {
    let opts = VolumeOptions {
        write_epoch,
        ..volume_opts()
    };
    Volume::open(plan, opts).expect("open the volume")
}

/// Releases what a tap holds when dropped.
struct Release<'a>(&'a Tap);

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

fn mutations(tap: &Tap) -> Vec<Seen> {
    tap.seen().into_iter().filter(Seen::is_mutation).collect()
}

#[test]
fn every_mutation_carries_the_write_epoch_on_every_copy_and_nothing_else_does() {
    let (_s, taps, plan) = tapped();
    let v = open(&plan, 3);
    assert_eq!(v.write_epoch(), 3);
    let (r, _) = block_on(v.write(0, pattern(1, 8 * K as usize), false));
    r.unwrap();
    block_on(v.write_zeroes(64 * K, 4 * K, false)).unwrap();
    block_on(v.discard(128 * K, 4 * K)).unwrap();
    let (r, _) = block_on(v.read(0, vec![0; 8 * K as usize]));
    r.unwrap();
    block_on(v.flush()).unwrap();

    for tap in &taps {
        let seen = tap.seen();
        let opcodes: Vec<u8> = mutations(tap).iter().map(|c| c.opcode).collect();
        assert_eq!(
            opcodes,
            [nvm::WRITE, nvm::WRITE_ZEROES, nvm::DATASET_MANAGEMENT],
            "each copy took each mutation once: {seen:?}"
        );
        for c in &seen {
            let want = if c.is_mutation() { 3 } else { 0 };
            assert_eq!(c.write_epoch, want, "{c:?}");
        }
        assert!(
            seen.iter().any(|c| c.opcode == nvm::FLUSH),
            "the flush went by untagged: {seen:?}"
        );
    }
    // One read, on one copy.
    let reads = taps
        .iter()
        .flat_map(|t| t.seen())
        .filter(|c| c.opcode == nvm::READ)
        .count();
    assert_eq!(reads, 1);

    // An engine opened without an epoch sends untagged writes.
    let plain = open(&plan, 0);
    let before = mutations(&taps[0]).len();
    let (r, _) = block_on(plain.write(0, pattern(2, 4096), false));
    r.unwrap();
    let after = mutations(&taps[0]);
    assert_eq!(after.len(), before + 1);
    assert_eq!(after[before].write_epoch, 0);
}

#[test]
fn raising_the_write_epoch_waits_for_older_writes_and_only_for_them() {
    let (_s, taps, plan) = tapped();
    let v = open(&plan, 3);
    // Copy 1 does not get writes tagged below 4 until released.
    taps[1].hold_below(4);
    std::thread::scope(|sc| {
        // A failing assertion must not leave the old write held forever.
        let _release = Release(&taps[1]);
        let old = sc.spawn(|| block_on(v.write(0, pattern(1, 4096), false)).0);
        wait_for("the old write to be held", WAIT, || taps[1].held() == 1);

        let (tx, rx) = mpsc::sync_channel(1);
        let v = &v;
        sc.spawn(move || tx.send(v.set_write_epoch(4)).unwrap());
        wait_for("the new epoch to be stored", WAIT, || v.write_epoch() == 4);
        // A write admitted now is tagged 4, is not held and is not waited
        // for: it completes while the switch still waits.
        let (r, _) = block_on(v.write(64 * K, pattern(2, 4096), false));
        r.unwrap();
        assert!(
            matches!(
                rx.recv_timeout(Duration::from_millis(300)),
                Err(mpsc::RecvTimeoutError::Timeout)
            ),
            "the switch returned while a write tagged 3 was in flight"
        );

        taps[1].release();
        rx.recv_timeout(WAIT)
            .expect("the switch ends once the old write completed")
            .expect("the switch succeeds");
        // When it returned, nothing tagged below 4 was unanswered.
        for tap in &taps {
            let old: Vec<Seen> = tap
                .unanswered()
                .into_iter()
                .filter(|c| c.is_mutation() && c.write_epoch < 4)
                .collect();
            assert!(old.is_empty(), "still in flight: {old:?}");
        }
        old.join().unwrap().expect("the old write succeeds");
    });

    let (r, _) = block_on(v.write(128 * K, pattern(3, 4096), false));
    r.unwrap();
    for tap in &taps {
        let tags: Vec<u32> = mutations(tap).iter().map(|c| c.write_epoch).collect();
        assert_eq!(tags.iter().filter(|&&e| e == 3).count(), 1, "{tags:?}");
        assert_eq!(tags.iter().filter(|&&e| e == 4).count(), 2, "{tags:?}");
    }

    // Lower or equal: nothing to do, and the epoch never goes down.
    v.set_write_epoch(2).unwrap();
    v.set_write_epoch(4).unwrap();
    assert_eq!(v.write_epoch(), 4);
}

/// Counts its wake-ups.
#[derive(Default)]
struct Woken(AtomicUsize);

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// Polls `f` once, as an async front-end would: never blocks.
fn poll_once<F: Future>(f: std::pin::Pin<&mut F>, woken: &Arc<Woken>) -> Poll<F::Output> {
    let waker = Waker::from(woken.clone());
    f.poll(&mut Context::from_waker(&waker))
}

/// Mutations tagged `epoch` the tap saw.
fn tagged(tap: &Tap, epoch: u32) -> usize {
    mutations(tap)
        .iter()
        .filter(|c| c.write_epoch == epoch)
        .count()
}

/// Long enough for a write that was wrongly admitted to reach a tap on
/// loopback, many times over.
const QUIET: Duration = Duration::from_millis(300);

#[test]
fn a_held_volume_sends_no_new_write_until_released_then_tags_it_with_the_new_epoch() {
    let (_s, taps, plan) = tapped();
    let v = open(&plan, 3);
    // Copy 1 does not get writes tagged below 4 until released: an old
    // write in flight when the hold begins.
    taps[1].hold_below(4);
    std::thread::scope(|sc| {
        let _release = Release(&taps[1]);
        let old = sc.spawn(|| block_on(v.write(0, pattern(1, 4096), false)).0);
        wait_for("the old write to be held", WAIT, || taps[1].held() == 1);

        let (tx, rx) = mpsc::sync_channel(1);
        let v = &v;
        sc.spawn(move || tx.send(v.hold_writes(4)).unwrap());
        wait_for("the hold and the new epoch", WAIT, || {
            v.writes_held() && v.write_epoch() == 4
        });

        // A write submitted now waits without blocking its submitter.
        let woken = Arc::new(Woken::default());
        let mut new = pin!(v.write(64 * K, pattern(2, 4096), false));
        assert!(poll_once(new.as_mut(), &woken).is_pending());
        let mut zeroes = pin!(v.write_zeroes(128 * K, 4096, false));
        assert!(poll_once(zeroes.as_mut(), &woken).is_pending());
        // Reads and flushes go on.
        let (r, back) = block_on(v.read(0, vec![0; 4096]));
        r.expect("a read while held");
        assert_eq!(back.len(), 4096);
        block_on(v.flush()).expect("a flush while held");
        std::thread::sleep(QUIET);
        for tap in &taps {
            assert_eq!(tagged(tap, 4), 0, "sent while held: {:?}", mutations(tap));
        }
        assert!(
            matches!(
                rx.recv_timeout(Duration::ZERO),
                Err(mpsc::RecvTimeoutError::Timeout)
            ),
            "the hold returned while a write tagged 3 was in flight"
        );

        // The old write completes, the hold's drain ends; still held.
        taps[1].release();
        let held = rx.recv_timeout(WAIT).expect("the drain ends");
        assert!(held.expect("the hold succeeds"), "held once drained");
        old.join().unwrap().expect("the old write succeeds");
        for tap in &taps {
            let old: Vec<Seen> = tap
                .unanswered()
                .into_iter()
                .filter(|c| c.is_mutation() && c.write_epoch < 4)
                .collect();
            assert!(old.is_empty(), "still in flight: {old:?}");
        }
        std::thread::sleep(QUIET);
        assert!(poll_once(new.as_mut(), &woken).is_pending());
        for tap in &taps {
            assert_eq!(tagged(tap, 4), 0, "sent while held: {:?}", mutations(tap));
        }
        assert_eq!(woken.0.load(Ordering::SeqCst), 0);

        v.release_writes();
        assert!(!v.writes_held());
        assert!(
            woken.0.load(Ordering::SeqCst) > 0,
            "the waiting writes were woken"
        );
        let (r, _) = block_on(new);
        r.expect("the held write succeeds once released");
        block_on(zeroes).expect("the held write-zeroes succeeds once released");
    });
    for tap in &taps {
        let tags: Vec<(u8, u32)> = mutations(tap)
            .iter()
            .map(|c| (c.opcode, c.write_epoch))
            .collect();
        assert_eq!(tags.len(), 3, "{tags:?}");
        assert_eq!(tags[0], (nvm::WRITE, 3));
        let mut after = tags[1..].to_vec();
        after.sort_unstable();
        assert_eq!(after, [(nvm::WRITE, 4), (nvm::WRITE_ZEROES, 4)]);
    }
    let (r, back) = block_on(v.read(64 * K, vec![0; 4096]));
    r.unwrap();
    assert_eq!(back, pattern(2, 4096), "the held write's data");
    // Released: writes go straight out again.
    let (r, _) = block_on(v.write(0, pattern(3, 4096), false));
    r.unwrap();
    assert_eq!(tagged(&taps[0], 4), 3);
}

#[test]
fn a_hold_nobody_releases_ends_on_its_own_and_a_volume_can_open_held() {
    let (_s, taps, plan) = tapped();
    let max = Duration::from_millis(400);
    let v = Volume::open(
        &plan,
        VolumeOptions {
            write_epoch: 5,
            write_hold: true,
            write_hold_max: max,
            ..volume_opts()
        },
    )
    .expect("open the volume held");
    let start = Instant::now();
    assert!(v.writes_held(), "opened held");
    std::thread::scope(|sc| {
        let w = sc.spawn(|| {
            let r = block_on(v.write(0, pattern(1, 4096), false)).0;
            (r, start.elapsed())
        });
        // Retried at the same epoch: still the hold from open.
        assert!(v.hold_writes(5).unwrap());
        let (r, took) = w.join().unwrap();
        r.expect("the held write succeeds once the hold expired");
        assert!(
            took >= max,
            "admitted after {took:?}, before the hold's end"
        );
    });
    assert!(!v.writes_held());
    for tap in &taps {
        let tags: Vec<u32> = mutations(tap).iter().map(|c| c.write_epoch).collect();
        assert_eq!(tags, [5]);
    }
    // That barrier is over: holding at its epoch again does not hold.
    assert!(!v.hold_writes(5).unwrap());
    assert!(!v.writes_held());
    // A new one holds (and expires) the same way.
    assert!(v.hold_writes(6).unwrap());
    let start = Instant::now();
    let (r, _) = block_on(v.write(4096, pattern(2, 4096), false));
    r.unwrap();
    assert!(start.elapsed() >= max - Duration::from_millis(50));
    assert_eq!(tagged(&taps[0], 6), 1);
}

#[test]
fn a_write_held_through_a_grow_lands_in_the_grown_volume() {
    let (mut s, taps, plan) = tapped();
    let v = open(&plan, 1);
    assert!(v.hold_writes(2).unwrap());
    // Past the old end: it waits like any write, and is checked against
    // the table it finds once admitted, the grown one.
    {
        let woken = Arc::new(Woken::default());
        let mut past = pin!(v.write(EXTENT, pattern(1, 4096), false));
        assert!(poll_once(past.as_mut(), &woken).is_pending());
        let mut grown = s.grow(2 * EXTENT, 512);
        for e in &mut grown.extents {
            let t = (0..2).find(|&t| s.target(t).addr == e.addr).unwrap();
            e.addr = taps[t].addr;
        }
        assert!(v.grow(&grown).expect("a grow while held"));
        assert!(v.writes_held(), "a grow leaves the hold on");
        assert!(poll_once(past.as_mut(), &woken).is_pending());
        v.release_writes();
        let (r, _) = block_on(past);
        r.expect("the held write lands past the old end");
        let (r, back) = block_on(v.read(EXTENT, vec![0; 4096]));
        r.unwrap();
        assert_eq!(back, pattern(1, 4096));
        for tap in &taps {
            let tags: Vec<u32> = mutations(tap).iter().map(|c| c.write_epoch).collect();
            assert_eq!(tags, [2]);
        }
    }
    drop(v);
    // Dropping a held volume ends its hold (no thread waits for it).
    let v = open(&plan, 3);
    assert!(v.hold_writes(4).unwrap());
    drop(v);
}
