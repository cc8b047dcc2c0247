//! Copy jobs into grain-pool trees (design thin-snapshots.md T7, first
//! step): a thin source tree on one in-process target copied into a tree of
//! another pool on a second one, through the admin API (`/v1/copies`), as
//! `tests/copy.rs` does for `file:` extents.
//!
//! What a tree adds: holes stay holes (the copier writes only sectors that
//! differ and deallocates those the source reads as zeroes), host writes
//! through the destination's namespace are recorded and parked by the
//! tree's guard, a stale tree is resynced in place, and a tree started as
//! another (`base_root`) keeps sharing every grain whose data is the same.
//! Sharing is read from the pool's counts (`PoolStats`): each tree here
//! fits in one leaf page, so once a tree that shares a page writes, every
//! grain it did not change is counted shared.

mod common;

use common::*;
use nvpool_target::backend::thin::{self, ThinBackend};
use nvpool_target::backend::Backend;
use nvpool_target::copier::CopyState;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const MIB: u64 = 1 << 20;
const GRAIN: u64 = 64 << 10;
const SECTOR: u64 = 4096;
/// Each copied tree: 256 grains, one leaf page of the tree.
const TREE: u64 = 16 * MIB;
const POOL_BYTES: u64 = 64 * MIB;
const REGION: u64 = MIB;

const SRC_HOSTS: &str = "nqn.2026-11.io.nvpool:thincopy-src-hosts";
const SRC_COPIER: &str = "nqn.2026-11.io.nvpool:thincopy-src-copier";
const DST_HOSTS: &str = "nqn.2026-11.io.nvpool:thincopy-dst";
const COPIER: &str = "nqn.2026-11.io.nvpool:copier:thincopy";
const SRC_NSID: u32 = 3;
/// Source trees of the source pool, destination trees of the other.
const SRC_A: u64 = 1;
const SRC_B: u64 = 2;
const DST_X: u64 = 7;
const DST_Y: u64 = 8;

const WAIT: Duration = Duration::from_secs(60);

fn tree_spec(path: &Path, root: u64) -> String {
    format!("thin:{},root={root},size={TREE}", path.display())
}

/// A formatted grain pool in a scratch file.
fn pool() -> (tempfile::TempDir, PathBuf) {
    let (dir, path) = scratch_file(POOL_BYTES);
    thin::format(path.to_str().unwrap(), GRAIN).unwrap();
    (dir, path)
}

/// Tree `root` of the pool on `path`, opened in this process: the same pool
/// the targets serve (one per device and process).
fn tree(path: &Path, root: u64) -> ThinBackend {
    thin::open(path.to_str().unwrap(), root, TREE).unwrap()
}

fn read_tree(t: &ThinBackend) -> Vec<u8> {
    let mut buf = vec![0u8; TREE as usize];
    t.read_at(&mut buf, 0).unwrap();
    buf
}

/// Compares without printing megabytes: the first differing byte.
#[track_caller]
fn assert_same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i} (sector {}): got {:#04x}, want {:#04x}",
            i as u64 / SECTOR,
            got[i],
            want[i]
        );
    }
}

/// Grains of a tree image holding a non-zero byte.
fn grains_with_data(image: &[u8]) -> u64 {
    image
        .chunks(GRAIN as usize)
        .filter(|g| g.iter().any(|&b| b != 0))
        .count() as u64
}

/// A source target serving the source pool's trees A (to hosts as NSID 1
/// and to the copier as `SRC_NSID`) and B (to the copier as `SRC_NSID + 1`),
/// and a destination target serving tree X of the other pool to HOST_A as
/// NSID 1.
struct Pair {
    src: Daemon,
    dst: Daemon,
    src_path: PathBuf,
    dst_path: PathBuf,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

fn pair() -> Pair {
    let (sd, src_path) = pool();
    let (dd, dst_path) = pool();
    let (a, b) = (tree_spec(&src_path, SRC_A), tree_spec(&src_path, SRC_B));
    let src = Daemon::start(&[
        subsystem(SRC_HOSTS, &[], &[(1, &a)]),
        subsystem(SRC_COPIER, &[COPIER], &[(SRC_NSID, &a), (SRC_NSID + 1, &b)]),
    ]);
    let x = tree_spec(&dst_path, DST_X);
    let dst = Daemon::start(&[subsystem(DST_HOSTS, &[HOST_A], &[(1, &x)])]);
    Pair {
        src,
        dst,
        src_path,
        dst_path,
        _dirs: (sd, dd),
    }
}

impl Pair {
    /// The request copying source NSID `nsid` into destination tree `root`.
    fn body(&self, root: u64, nsid: u32, rate: u64, base_root: Option<u64>) -> Value {
        let mut b = json!({
            "dest": tree_spec(&self.dst_path, root),
            "source": {
                "addr": self.src.addr.to_string(),
                "subsystem_nqn": SRC_COPIER,
                "nsid": nsid,
                "host_nqn": COPIER,
            },
            "region_bytes": REGION,
            "rate_bytes_per_sec": rate,
        });
        if let Some(base) = base_root {
            b["base_root"] = json!(base);
        }
        b
    }

    fn put(&self, id: &str, body: &Value) -> HttpResponse {
        let text = body.to_string();
        http(
            self.dst.api,
            "PUT",
            &format!("/v1/copies/{id}"),
            Some(&text),
        )
    }

    #[track_caller]
    fn arm(&self, id: &str, body: &Value) {
        let r = self.put(id, body);
        assert_eq!(r.status, 200, "arm {id}: {}", r.body);
    }

    #[track_caller]
    fn start(&self, id: &str) {
        let r = http(
            self.dst.api,
            "POST",
            &format!("/v1/copies/{id}/start"),
            Some(r#"{"regions": null}"#),
        );
        assert_eq!(r.status, 200, "start {id}: {}", r.body);
    }

    /// Waits for the job to leave `running` and checks it is done.
    #[track_caller]
    fn wait_done(&self, id: &str) {
        let copies = self.dst.target.copies();
        wait_for(&format!("copy {id} to finish"), WAIT, || {
            copies
                .status(id)
                .is_some_and(|s| s.state != CopyState::Running)
        });
        let s = copies.status(id).unwrap();
        assert_eq!(s.state, CopyState::Done, "{s:?}");
        assert_eq!(s.bytes_copied, TREE);
    }

    #[track_caller]
    fn copy(&self, id: &str, body: &Value) {
        self.arm(id, body);
        self.start(id);
        self.wait_done(id);
    }

    #[track_caller]
    fn delete(&self, id: &str) {
        let r = http(self.dst.api, "DELETE", &format!("/v1/copies/{id}"), None);
        assert_eq!(r.status, 204, "delete {id}: {}", r.body);
    }
}

/// Writes `data` at `off` and commits (the synchronous call commits).
fn put_data(t: &ThinBackend, off: u64, data: &[u8]) {
    t.write_at(data, off, false).unwrap();
}

/// Source tree A: data in a few places, large holes between, and one grain
/// written with zeroes (allocated on the source, a hole once copied).
/// Returns the grains the source pool allocated for it.
fn fill_source(a: &ThinBackend) -> u64 {
    put_data(a, 0, &pattern(1, 256 << 10));
    // Not grain-aligned: five sectors across a grain boundary.
    put_data(
        a,
        5 * MIB + GRAIN - 2 * SECTOR,
        &pattern(2, 5 * SECTOR as usize),
    );
    let mut mixed = pattern(3, MIB as usize);
    // Zero sectors inside the data: not written on the destination.
    mixed[64 << 10..(64 << 10) + 8 * SECTOR as usize].fill(0);
    put_data(a, 12 * MIB, &mixed);
    put_data(a, 9 * MIB, &vec![0u8; GRAIN as usize]);
    a.pool().stats().grains_allocated
}

#[test]
fn a_copy_into_a_fresh_tree_reads_back_equal_and_leaves_holes_unallocated() {
    let p = pair();
    let a = tree(&p.src_path, SRC_A);
    let src_grains = fill_source(&a);
    let want = read_tree(&a);
    // 4 + 2 + 16 grains of data, and the grain of zeroes.
    assert_eq!(src_grains, 23);
    assert_eq!(grains_with_data(&want), 22);
    let x = tree(&p.dst_path, DST_X);
    assert_eq!(x.pool().stats().grains_allocated, 0);
    p.copy("fresh", &p.body(DST_X, SRC_NSID, 0, None));
    assert_same(&read_tree(&x), &want, "destination tree");
    let stats = x.pool().stats();
    assert_eq!(
        stats.grains_allocated,
        grains_with_data(&want),
        "only grains with data are allocated: {stats:?}"
    );
    // Hosts read it through the destination's namespace too.
    let (_a, mut q) = controller(p.dst.addr, NO_DIGESTS, DST_HOSTS, HOST_A);
    let at = 12 * MIB / SECTOR;
    assert_same(
        &q.read_ok(1, at, 32, SECTOR as usize),
        &want[(12 * MIB) as usize..(12 * MIB + 32 * SECTOR) as usize],
        "read through the namespace",
    );
    // The job's final flush committed: the pool opened again from its
    // device holds the copy.
    p.delete("fresh");
    drop((_a, q, x));
    let Pair { dst, dst_path, .. } = p;
    dst.shutdown();
    let again = tree(&dst_path, DST_X);
    assert_same(&read_tree(&again), &want, "destination tree reopened");
}

/// Mirrors host mutations of tree A (source, NSID 1) to tree X (destination,
/// NSID 1) while the copy runs, most of them just ahead of the copier, as a
/// host does for a copy in `Syncing` state. Returns the mutations made.
fn mirror_writes(p: &Pair, id: &str, stop: &AtomicBool, seed: u64) -> u64 {
    let (_sa, mut s) = controller(p.src.addr, NO_DIGESTS, SRC_HOSTS, HOST_A);
    let (_da, mut d) = controller(p.dst.addr, NO_DIGESTS, DST_HOSTS, HOST_A);
    let copies = p.dst.target.copies();
    let sectors = TREE / SECTOR;
    let mut rng = nvpool_rt::random::Rng::new(seed);
    let mut count = 0;
    while !stop.load(Ordering::Acquire) {
        let r = rng.next_u64();
        let pos = copies.status(id).map_or(0, |s| s.bytes_copied) / SECTOR;
        let lba = if !r.is_multiple_of(4) {
            (pos + (r >> 8) % 160).min(sectors - 2)
        } else {
            (r >> 8) % (sectors - 1)
        };
        match (r >> 40) % 8 {
            0 => {
                s.write_zeroes(1, lba, 2).ok();
                d.write_zeroes(1, lba, 2).ok();
            }
            1 => {
                s.deallocate(1, &[(lba, 2)]).ok();
                d.deallocate(1, &[(lba, 2)]).ok();
            }
            _ => {
                let data = pattern(rng.next_u64(), 2 * SECTOR as usize);
                s.write(1, lba, &data, SECTOR as usize, false).ok();
                d.write(1, lba, &data, SECTOR as usize, false).ok();
            }
        }
        count += 1;
    }
    count
}

#[test]
fn host_writes_through_the_destination_during_a_copy_are_kept() {
    let p = pair();
    let a = tree(&p.src_path, SRC_A);
    fill_source(&a);
    // Data everywhere, so a copier overwriting a host's write shows.
    for m in 0..TREE / MIB {
        if m % 3 == 1 {
            put_data(&a, m * MIB, &pattern(40 + m, MIB as usize));
        }
    }
    let x = tree(&p.dst_path, DST_X);
    // About 2.7 s at 6 MiB/s: room for many host writes.
    p.arm("busy", &p.body(DST_X, SRC_NSID, 6 * MIB, None));
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    println!("writer seed {seed}");
    let stop = AtomicBool::new(false);
    let writes = std::thread::scope(|sc| {
        let h = sc.spawn(|| mirror_writes(&p, "busy", &stop, seed));
        // The host mirrors; now the copier may start.
        std::thread::sleep(Duration::from_millis(50));
        p.start("busy");
        p.wait_done("busy");
        std::thread::sleep(Duration::from_millis(50));
        stop.store(true, Ordering::Release);
        h.join().expect("writer")
    });
    let marked = p.dst.target.copies().host_written_units("busy").unwrap();
    println!("{writes} mirrored mutations, {marked} guard units marked");
    assert!(writes > 100, "the host barely wrote ({writes})");
    assert!(
        marked > 0,
        "host writes were not recorded in the tree's guard"
    );
    assert_same(
        &read_tree(&x),
        &read_tree(&a),
        "destination after the host's writes",
    );
}

#[test]
fn a_stale_tree_is_resynced_in_place_and_gives_back_what_became_zeroes() {
    let p = pair();
    let a = tree(&p.src_path, SRC_A);
    let x = tree(&p.dst_path, DST_X);
    // The stale copy: what A held before, in 1 MiB pieces.
    let old: Vec<Vec<u8>> = (0..TREE / MIB)
        .map(|m| pattern(100 + m, MIB as usize))
        .collect();
    for (m, data) in old.iter().enumerate() {
        put_data(&a, m as u64 * MIB, data);
        put_data(&x, m as u64 * MIB, data);
    }
    // Since then A changed: a few sectors rewritten in MiB 2 and 9, MiB 5
    // deallocated, MiB 11 written with zeroes.
    put_data(&a, 2 * MIB + 3 * SECTOR, &pattern(200, SECTOR as usize));
    put_data(&a, 9 * MIB + GRAIN, &pattern(201, 3 * SECTOR as usize));
    a.discard(5 * MIB, MIB).unwrap();
    put_data(&a, 11 * MIB, &vec![0u8; MIB as usize]);
    let want = read_tree(&a);
    // A snapshot of the stale tree shows what the copier touched: each
    // grain it leaves alone stays shared with the snapshot.
    let before = x.pool().stats();
    assert_eq!(before.grains_allocated, TREE / GRAIN);
    x.pool().snapshot_trees(0, &[(DST_X, 70)]).unwrap();
    p.copy("resync", &p.body(DST_X, SRC_NSID, 0, None));
    assert_same(&read_tree(&x), &want, "resynced tree");
    let after = x.pool().stats();
    // Two grains rewritten (new grains, the snapshot keeps the old), 32
    // deallocated (the snapshot keeps them): every other grain shared.
    let (rewritten, zeroed) = (2, 2 * MIB / GRAIN);
    assert_eq!(
        after.grains_allocated,
        TREE / GRAIN + rewritten,
        "{after:?}"
    );
    assert_eq!(
        after.grains_shared,
        TREE / GRAIN - rewritten - zeroed,
        "{after:?}"
    );
    // Without the snapshot, the zeroed grains are free.
    x.pool().release(&[70]).unwrap();
    let freed = x.pool().stats();
    assert_eq!(freed.grains_allocated, TREE / GRAIN - zeroed, "{freed:?}");
    assert_eq!(freed.grains_shared, 0);
}

#[test]
fn a_tree_started_from_base_root_shares_every_unchanged_grain() {
    let p = pair();
    let a = tree(&p.src_path, SRC_A);
    let b = tree(&p.src_path, SRC_B);
    fill_source(&a);
    // B: A with four grains changed (one sector each).
    let changed = [0u64, 2 * GRAIN, 12 * MIB, 12 * MIB + 7 * GRAIN];
    let mut image = read_tree(&a);
    put_data(&b, 0, &image);
    for (i, &at) in changed.iter().enumerate() {
        let data = pattern(300 + i as u64, SECTOR as usize);
        put_data(&b, at + SECTOR, &data);
        image[(at + SECTOR) as usize..(at + 2 * SECTOR) as usize].copy_from_slice(&data);
    }
    assert_same(&read_tree(&b), &image, "source tree B");
    let x = tree(&p.dst_path, DST_X);
    p.copy("x", &p.body(DST_X, SRC_NSID, 0, None));
    let in_x = x.pool().stats().grains_allocated;
    assert_eq!(in_x, grains_with_data(&read_tree(&a)));
    // Y starts as X and is filled from B.
    p.copy("y", &p.body(DST_Y, SRC_NSID + 1, 0, Some(DST_X)));
    let y = tree(&p.dst_path, DST_Y);
    assert_same(&read_tree(&y), &image, "Y");
    assert_same(&read_tree(&x), &read_tree(&a), "X unchanged");
    let k = changed.len() as u64;
    let stats = y.pool().stats();
    assert_eq!(stats.grains_allocated, in_x + k, "{stats:?}");
    assert_eq!(stats.grains_shared, in_x - k, "{stats:?}");

    // Arming again with the same request is the same job.
    p.arm("y", &p.body(DST_Y, SRC_NSID + 1, 0, Some(DST_X)));
    p.delete("x");
    p.delete("y");
    // A tree holding data does not start as another: 409, and unchanged.
    let r = p.put("again", &p.body(DST_X, SRC_NSID + 1, 0, Some(DST_Y)));
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(r.json()["message"].as_str().unwrap().contains("holds data"));
    assert_same(&read_tree(&x), &read_tree(&a), "X after the refusal");
    // An unknown base tree, and a base_root with a file: destination.
    let r = p.put("nobase", &p.body(9, SRC_NSID, 0, Some(99)));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.json()["message"]
        .as_str()
        .unwrap()
        .contains("base_root 99"));
    let mut file = p.body(9, SRC_NSID, 0, Some(DST_X));
    file["dest"] = json!(format!("{},offset=0,length={TREE}", file_spec(&p.dst_path)));
    let r = p.put("file", &file);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.json()["message"].as_str().unwrap().contains("base_root"));
}
