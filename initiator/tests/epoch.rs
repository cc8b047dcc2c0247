//! The volume engine's write epoch (design/thin-snapshots.md T5) on the
//! wire: every write, write-zeroes and discard carries it in CDW2 on every
//! copy, and raising it waits for the mutations admitted before, and only
//! for them. A RAID1 volume over two in-process targets, each behind a
//! [`Tap`] that reads the commands going by and can hold writes back.

mod common;

use common::tap::{Seen, Tap};
use common::volumes::*;
use common::*;
use nvpool_initiator::device::block_on;
use nvpool_initiator::{Volume, VolumeOptions};
use nvpool_layout::plan::{ConnectionPlan, LayoutBody};
use nvpool_wire::sqe::nvm;
use std::sync::mpsc;
use std::time::Duration;

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
