//! Unit tests per operation, and T3's seeded crash simulation.

use super::*;
use std::collections::{BTreeMap, BTreeSet};

/// A device in memory with a volatile write cache: writes since the last
/// flush may be lost or torn by `crash`, and `ops_left` makes the device die
/// (every call fails) after that many more calls.
#[derive(Debug, Default)]
struct MemDisk {
    durable: Vec<u8>,
    view: Vec<u8>,
    pending: Vec<(u64, Vec<u8>)>,
    ops_left: Option<u64>,
}

impl MemDisk {
    fn new(size: u64) -> MemDisk {
        MemDisk {
            durable: vec![0; size as usize],
            view: vec![0; size as usize],
            ..MemDisk::default()
        }
    }

    fn alive(&mut self) -> io::Result<()> {
        match &mut self.ops_left {
            Some(0) => Err(io::Error::other("device lost power")),
            Some(n) => {
                *n -= 1;
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Power loss: each unflushed write lands or not, in issue order, and one
    /// that lands may land only up to a 512-byte boundary.
    fn crash(&mut self, rng: &mut Rng) {
        let torn = if self.pending.is_empty() {
            usize::MAX
        } else {
            rng.below(self.pending.len() as u64 * 2) as usize
        };
        for (i, (off, data)) in std::mem::take(&mut self.pending).into_iter().enumerate() {
            if rng.below(3) == 0 {
                continue;
            }
            let len = if i == torn {
                512 * rng.below(data.len() as u64 / 512) as usize
            } else {
                data.len()
            };
            self.durable[off as usize..off as usize + len].copy_from_slice(&data[..len]);
        }
        self.view.clone_from(&self.durable);
        self.ops_left = None;
    }
}

impl Device for MemDisk {
    fn size(&self) -> u64 {
        self.view.len() as u64
    }

    fn read_at(&mut self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.alive()?;
        buf.copy_from_slice(&self.view[off as usize..off as usize + buf.len()]);
        Ok(())
    }

    fn write_at(&mut self, buf: &[u8], off: u64) -> io::Result<()> {
        self.alive()?;
        self.view[off as usize..off as usize + buf.len()].copy_from_slice(buf);
        self.pending.push((off, buf.to_vec()));
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.alive()?;
        for (off, data) in self.pending.drain(..) {
            self.durable[off as usize..off as usize + data.len()].copy_from_slice(&data);
        }
        Ok(())
    }
}

/// splitmix64: a seed reproduces a run exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

const S: usize = SECTOR_BYTES as usize;

/// A sector whose every 512-byte chunk says `tag` (0: zeroes), so a torn
/// sector is still recognisable chunk by chunk.
fn sector(tag: u64) -> Vec<u8> {
    (0..S / 8).flat_map(|_| tag.to_le_bytes()).collect()
}

/// The tag of each 512-byte chunk, or `None` for bytes no write produced.
fn chunk_tags(sector: &[u8]) -> Vec<Option<u64>> {
    sector
        .chunks_exact(512)
        .map(|c| {
            let tag = u64::from_le_bytes(c[..8].try_into().expect("8 bytes"));
            c.chunks_exact(8)
                .all(|w| w == tag.to_le_bytes())
                .then_some(tag)
        })
        .collect()
}

fn pool(grain_kib: u64, grains: u64, meta_pages: u64) -> Pool<MemDisk> {
    let grain = grain_kib << 10;
    let sm = (grains + meta_pages).div_ceil(2048);
    let size = ((2 + 2 * sm + meta_pages) * 4096).next_multiple_of(grain) + grains * grain;
    let p = Pool::format(MemDisk::new(size), grain, Some(meta_pages)).expect("format");
    assert_eq!(p.layout().data_grains, grains);
    p
}

fn read_sectors(p: &mut Pool<MemDisk>, root: u64, first: u64, n: usize) -> Vec<u8> {
    let mut buf = vec![0xAA; n * S];
    p.read(root, first * SECTOR_BYTES, &mut buf).expect("read");
    buf
}

fn tags(p: &mut Pool<MemDisk>, root: u64, first: u64, n: usize) -> Vec<u64> {
    read_sectors(p, root, first, n)
        .chunks_exact(S)
        .map(|s| chunk_tags(s)[0].expect("whole sector"))
        .collect()
}

fn write_tags(p: &mut Pool<MemDisk>, root: u64, first: u64, tags: &[u64]) -> Result<()> {
    let data: Vec<u8> = tags.iter().flat_map(|&t| sector(t)).collect();
    p.write(root, first * SECTOR_BYTES, &data)
}

#[test]
fn superblock_round_trip_and_checksum() {
    let layout = Layout::compute(64 << 20, 64 << 10, None).expect("fits");
    assert_eq!(layout.data_start % layout.grain_bytes, 0);
    let sb = Superblock {
        version: format::VERSION,
        generation: 7,
        layout,
        next_root: 3,
        root_table: layout.meta_start + 3,
    };
    let mut page = sb.encode();
    assert_eq!(Superblock::decode(&page, 64 << 20), Some(sb.clone()));
    page[300] ^= 1;
    assert_eq!(Superblock::decode(&page, 64 << 20), None);
    for (version, read) in [(2, false), (3, true), (4, true), (5, false)] {
        let page = Superblock {
            version,
            ..sb.clone()
        }
        .encode();
        let got = Superblock::decode(&page, 64 << 20).map(|b| b.version);
        assert_eq!(got, read.then_some(version), "version {version}");
    }
    assert!(Layout::compute(64 << 20, 8 << 10, None).is_none());
    assert!(Layout::compute(16 << 10, 64 << 10, None).is_none());
}

#[test]
fn unwritten_reads_zero_and_writes_read_back() {
    let mut p = pool(64, 16, 32);
    let r = p.create_root().expect("root");
    assert_eq!(read_sectors(&mut p, r, 0, 40), vec![0; 40 * S]);
    // Crosses a grain boundary and lands at the far end of the tree.
    write_tags(&mut p, r, 14, &[1, 2, 3, 4]).expect("write");
    write_tags(&mut p, r, GRAIN_INDEX_LIMIT * 16 - 1, &[9]).expect("last sector");
    assert_eq!(tags(&mut p, r, 13, 6), [0, 1, 2, 3, 4, 0]);
    assert_eq!(tags(&mut p, r, GRAIN_INDEX_LIMIT * 16 - 2, 2), [0, 9]);
    assert_eq!(
        p.stats(),
        PoolStats {
            grains_total: 16,
            grains_allocated: 3,
            grains_shared: 0
        }
    );
    assert!(matches!(p.write(r, 100, &[0; 4096]), Err(ThinError::Range)));
    assert!(matches!(
        p.write(r, GRAIN_INDEX_LIMIT << 16, &[0; 4096]),
        Err(ThinError::Range)
    ));
    assert!(matches!(
        p.read(99, 0, &mut [0; 4096]),
        Err(ThinError::NoRoot(99))
    ));
    p.check().expect("consistent");
}

#[test]
fn overwrite_goes_in_place_when_owned_alone() {
    let mut p = pool(32, 8, 32);
    let r = p.create_root().expect("root");
    write_tags(&mut p, r, 0, &[1]).expect("write");
    p.commit().expect("commit");
    write_tags(&mut p, r, 1, &[2]).expect("write");
    write_tags(&mut p, r, 0, &[3]).expect("write");
    assert_eq!(p.stats().grains_allocated, 1);
    assert_eq!(tags(&mut p, r, 0, 2), [3, 2]);
    p.check().expect("consistent");
}

#[test]
fn snapshot_shares_then_copies_only_what_the_write_leaves() {
    let mut p = pool(64, 8, 32);
    let r = p.create_root().expect("root");
    write_tags(&mut p, r, 0, &[1, 2, 3]).expect("write");
    let s = p.snapshot(r).expect("snapshot");
    assert_eq!(
        p.stats().grains_shared,
        0,
        "pages are shared, the grain once through them"
    );
    write_tags(&mut p, r, 1, &[20]).expect("write");
    assert_eq!(tags(&mut p, r, 0, 4), [1, 20, 3, 0]);
    assert_eq!(tags(&mut p, s, 0, 4), [1, 2, 3, 0]);
    assert_eq!(p.stats().grains_allocated, 2);
    p.check().expect("consistent");
    let s2 = p.snapshot(s).expect("snapshot of a snapshot");
    p.delete_root(s).expect("delete");
    assert_eq!(tags(&mut p, s2, 0, 3), [1, 2, 3]);
    p.delete_root(r).expect("delete");
    assert_eq!(p.stats().grains_allocated, 1);
    p.delete_root(s2).expect("delete");
    assert_eq!(p.stats().grains_allocated, 0);
    assert!(p.roots().is_empty());
    p.check().expect("consistent");
}

#[test]
fn deallocate_clears_bits_and_frees_empty_grains() {
    let mut p = pool(16, 8, 32);
    let r = p.create_root().expect("root");
    write_tags(&mut p, r, 0, &[1, 2, 3, 4, 5, 6]).expect("write");
    assert_eq!(p.stats().grains_allocated, 2);
    p.deallocate(r, SECTOR_BYTES, 4 * SECTOR_BYTES)
        .expect("deallocate");
    assert_eq!(tags(&mut p, r, 0, 6), [1, 0, 0, 0, 0, 6]);
    assert_eq!(p.stats().grains_allocated, 2);
    p.deallocate(r, 0, 4 * SECTOR_BYTES).expect("deallocate");
    assert_eq!(p.stats().grains_allocated, 1);
    p.check().expect("consistent");
}

#[test]
fn no_space_changes_nothing_and_freed_grains_wait_for_commit() {
    let mut p = pool(16, 4, 32);
    let r = p.create_root().expect("root");
    write_tags(&mut p, r, 0, &[1; 16]).expect("fill");
    let before = p.stats();
    assert!(matches!(
        write_tags(&mut p, r, 12, &[2; 8]),
        Err(ThinError::NoSpace)
    ));
    assert_eq!(p.stats(), before);
    assert_eq!(tags(&mut p, r, 12, 4), [1; 4]);
    p.commit().expect("commit");
    p.deallocate(r, 0, 8 * SECTOR_BYTES)
        .expect("free two grains");
    assert!(
        matches!(write_tags(&mut p, r, 16, &[3]), Err(ThinError::NoSpace)),
        "freed but not committed"
    );
    p.commit().expect("commit");
    write_tags(&mut p, r, 16, &[3, 3, 3, 3, 3]).expect("reuses the freed grains");
    p.check().expect("consistent");
}

#[test]
fn reopen_sees_the_newest_commit_only() {
    let mut p = pool(64, 8, 32);
    let r = p.create_root().expect("root");
    write_tags(&mut p, r, 0, &[1]).expect("write");
    p.commit().expect("commit");
    let s = p.snapshot(r).expect("snapshot");
    write_tags(&mut p, r, 0, &[2]).expect("write");
    p.commit().expect("commit");
    p.delete_root(s).expect("uncommitted delete");
    let mut disk = p.into_device();
    disk.crash(&mut Rng(0));
    let mut p = Pool::open(disk).expect("open");
    assert_eq!(p.roots(), [r, s]);
    assert_eq!(tags(&mut p, r, 0, 1), [2]);
    assert_eq!(tags(&mut p, s, 0, 1), [1]);
    p.check().expect("consistent");
}

#[test]
fn io_error_fails_the_pool() {
    let mut p = pool(64, 8, 32);
    let r = p.create_root().expect("root");
    p.dev.ops_left = Some(0);
    assert!(matches!(
        write_tags(&mut p, r, 0, &[1, 2]),
        Err(ThinError::Io(_))
    ));
    p.dev.ops_left = None;
    assert!(matches!(
        write_tags(&mut p, r, 0, &[1]),
        Err(ThinError::Failed)
    ));
    assert!(matches!(p.commit(), Err(ThinError::Failed)));
}

#[test]
fn any_root_id_below_2_pow_32() {
    let mut p = pool(16, 8, 64);
    let last = ROOT_ID_LIMIT - 1;
    let ids = [0, 511, 512, 1 << 27, last];
    for id in ids {
        assert!(p.ensure_root(id).expect("ensure"), "root {id} is new");
    }
    assert!(!p.ensure_root(512).expect("ensure"), "root 512 exists");
    assert!(matches!(
        p.ensure_root(ROOT_ID_LIMIT),
        Err(ThinError::RootId(ROOT_ID_LIMIT))
    ));
    // Slot for slot, the same table path as root 512.
    assert!(matches!(
        p.read(1 << 36 | 512, 0, &mut [0; 4096]),
        Err(ThinError::NoRoot(_))
    ));
    assert!(
        matches!(p.create_root(), Err(ThinError::RootId(ROOT_ID_LIMIT))),
        "ids are handed out above the largest, which was the last"
    );
    write_tags(&mut p, last, 0, &[7]).expect("write");
    write_tags(&mut p, 0, 0, &[8]).expect("write");
    p.commit().expect("commit");
    let mut p = Pool::open(p.into_device()).expect("open");
    assert_eq!(p.roots(), ids);
    assert_eq!(tags(&mut p, last, 0, 1), [7]);
    assert_eq!(tags(&mut p, 0, 0, 1), [8]);
    assert_eq!(tags(&mut p, 512, 0, 1), [0]);
    p.check().expect("consistent");
}

#[test]
fn two_thousand_roots_come_back_and_deleting_them_frees_everything() {
    const N: u64 = 2000;
    // Sparse, as offsets in a pool's virtual space are: a table leaf each.
    let ids: Vec<u64> = (0..N).map(|k| k * 1021 + 7).collect();
    let mut p = pool(16, N, 8256);
    let (start, free) = (p.stats(), p.free);
    for (k, &id) in ids.iter().enumerate() {
        assert!(p.ensure_root(id).expect("room for the root"));
        // Grain 7k: a tree page path of its own per root.
        write_tags(&mut p, id, k as u64 * 28, &[id + 1]).expect("write");
        if k % 250 == 249 {
            p.commit().expect("commit");
        }
    }
    p.commit().expect("commit");
    assert_eq!(p.stats().grains_allocated, N);
    let mut p = Pool::open(p.into_device()).expect("open");
    assert_eq!(p.roots(), ids);
    for (k, &id) in ids.iter().enumerate() {
        assert_eq!(tags(&mut p, id, k as u64 * 28, 1), [id + 1], "root {id}");
    }
    p.check().expect("consistent");
    for &id in &ids {
        p.delete_root(id).expect("delete");
    }
    assert!(p.roots().is_empty());
    p.commit().expect("commit");
    assert_eq!(p.stats(), start);
    assert_eq!(p.free, free, "every grain and page is free again");
    assert_eq!(p.table, 0, "an empty root table holds no page");
    p.check().expect("consistent");
}

#[test]
fn a_full_metadata_area_still_deletes_a_root() {
    let mut p = pool(16, 64, 24);
    // Roots far apart (a table path each) with a write each, until the
    // metadata area is full.
    let mut ids = Vec::new();
    loop {
        let id = (ids.len() as u64 + 1) << 20;
        match p.ensure_root(id) {
            Ok(true) => ids.push(id),
            Err(ThinError::NoSpace) => break,
            r => panic!("ensure_root: {r:?}"),
        }
        match write_tags(&mut p, id, 0, &[id]) {
            Ok(()) => p.commit().expect("commit"),
            Err(ThinError::NoSpace) => break,
            Err(e) => panic!("write: {e}"),
        }
    }
    p.commit().expect("commit");
    assert!(ids.len() >= 2, "{ids:?}");
    assert!(matches!(p.ensure_root(1 << 31), Err(ThinError::NoSpace)));
    p.delete_root(ids[0]).expect("the reserve covers a delete");
    p.commit().expect("commit");
    assert!(
        p.ensure_root(1 << 31)
            .expect("the deleted root's pages are free"),
        "new root"
    );
    assert_eq!(tags(&mut p, ids[1], 0, 1), [ids[1]]);
    p.check().expect("consistent");
}

#[test]
fn snapshot_as_names_its_tree_and_refuses_one_that_exists() {
    let mut p = pool(64, 16, 64);
    let (live, snap) = (3, 1 << 20);
    assert!(p.ensure_root(live).expect("live"));
    write_tags(&mut p, live, 0, &[1, 2]).expect("write");
    p.snapshot_as(live, snap).expect("snapshot");
    assert!(matches!(
        p.snapshot_as(live, snap),
        Err(ThinError::RootExists(id)) if id == snap
    ));
    assert!(matches!(
        p.snapshot_as(live, live),
        Err(ThinError::RootExists(3))
    ));
    assert!(matches!(p.snapshot_as(4, 5), Err(ThinError::NoRoot(4))));
    assert!(matches!(
        p.snapshot_as(live, ROOT_ID_LIMIT),
        Err(ThinError::RootId(ROOT_ID_LIMIT))
    ));
    write_tags(&mut p, live, 1, &[20]).expect("write");
    assert_eq!(tags(&mut p, live, 0, 2), [1, 20]);
    assert_eq!(tags(&mut p, snap, 0, 2), [1, 2]);
    p.commit().expect("commit");
    let mut p = Pool::open(p.into_device()).expect("open");
    assert_eq!(p.roots(), [live, snap]);
    assert_eq!(tags(&mut p, snap, 0, 2), [1, 2]);
    assert_eq!(
        p.create_root().expect("root"),
        snap + 1,
        "ids are handed out above it"
    );
    p.check().expect("consistent");
}

/// A write to `root` tagged `tag`, where the pool routes it.
fn write_tagged(p: &mut Pool<MemDisk>, root: u64, tag: u32, first: u64, t: &[u64]) -> Result<()> {
    let trees = p.route(root, tag)?;
    let data: Vec<u8> = t.iter().flat_map(|&t| sector(t)).collect();
    p.write_trees(&trees, first * SECTOR_BYTES, &data)
}

fn deallocate_tagged(p: &mut Pool<MemDisk>, root: u64, tag: u32, first: u64, n: u64) -> Result<()> {
    let trees = p.route(root, tag)?;
    p.deallocate_trees(&trees, first * SECTOR_BYTES, n * SECTOR_BYTES)
}

#[test]
fn a_write_tagged_up_to_the_cut_lands_in_the_sealing_snapshot_and_is_refused_once_sealed() {
    let mut p = pool(64, 32, 64);
    let live = 5;
    assert!(p.ensure_root(live).expect("live"));
    write_tags(&mut p, live, 0, &[1, 1, 1, 1]).expect("write");
    p.begin_snapshots(3, &[(live, 100)]).expect("begin");
    p.begin_snapshots(3, &[(live, 100)])
        .expect("a retry while it seals");
    write_tagged(&mut p, live, 3, 0, &[2]).expect("tagged at the cut");
    write_tagged(&mut p, live, 4, 1, &[3]).expect("tagged after the cut");
    deallocate_tagged(&mut p, live, 2, 2, 1).expect("deallocate before the cut");
    deallocate_tagged(&mut p, live, 0, 3, 1).expect("untagged deallocate");
    assert_eq!(tags(&mut p, live, 0, 4), [2, 3, 0, 0]);
    assert_eq!(tags(&mut p, 100, 0, 4), [2, 1, 0, 1]);
    p.check().expect("consistent");

    assert!(matches!(
        p.seal(&[100, 101]),
        Err(ThinError::NotSealing(101))
    ));
    assert_eq!(
        p.route(live, 3).expect("route"),
        [live, 100],
        "nothing sealed"
    );
    p.seal(&[100]).expect("seal");
    p.seal(&[100]).expect("a retry");
    assert!(matches!(
        write_tagged(&mut p, live, 3, 0, &[9]),
        Err(ThinError::Fenced {
            root: 5,
            tag: 3,
            floor: 3
        })
    ));
    write_tagged(&mut p, live, 0, 0, &[7]).expect("untagged is never refused");
    write_tagged(&mut p, live, 4, 1, &[8]).expect("after the cut");
    assert_eq!(tags(&mut p, live, 0, 2), [7, 8]);
    assert_eq!(
        tags(&mut p, 100, 0, 2),
        [2, 1],
        "sealed: live writes stay out"
    );

    // Refused requests change nothing.
    assert!(matches!(
        p.begin_snapshots(3, &[(live, 200)]),
        Err(ThinError::EpochSealed { live: 5, epoch: 3 })
    ));
    assert!(matches!(
        p.begin_snapshots(5, &[(live, 200), (live, 100)]),
        Err(ThinError::RootExists(100))
    ));
    assert!(matches!(
        p.begin_snapshots(0, &[(99, 200)]),
        Err(ThinError::NoRoot(99))
    ));
    assert_eq!(p.roots(), [live, 100]);
    assert_eq!(p.route(live, 5).expect("route"), [live]);
    // A live tree no namespace exported yet (epoch > 0): created empty,
    // and its snapshot with it.
    p.begin_snapshots(5, &[(99, 200)])
        .expect("a snapshot of a tree never exported");
    assert_eq!(p.roots(), [live, 99, 100, 200]);
    assert_eq!(p.route(99, 5).expect("route"), [99, 200]);

    // Epoch 0 (a clone): complete at once, so never a retry.
    p.begin_snapshots(0, &[(100, 300)]).expect("clone");
    assert_eq!(tags(&mut p, 300, 0, 4), [2, 1, 0, 1]);
    assert!(matches!(
        p.begin_snapshots(0, &[(100, 300)]),
        Err(ThinError::RootExists(300))
    ));
    assert!(matches!(p.seal(&[300]), Err(ThinError::NotSealing(300))));

    // Deleting a sealing snapshot stops its writes; deleting the live
    // tree forgets its sealed epoch.
    p.begin_snapshots(6, &[(live, 400)]).expect("begin");
    assert_eq!(p.route(live, 6).expect("route"), [live, 400]);
    p.delete_root(400).expect("delete");
    assert_eq!(p.route(live, 6).expect("route"), [live]);
    assert!(matches!(p.seal(&[400]), Err(ThinError::NotSealing(400))));
    p.delete_root(live).expect("delete");
    assert!(p.ensure_root(live).expect("the extent placed again"));
    assert_eq!(p.route(live, 3).expect("route"), [live]);
    p.check().expect("consistent");

    // A restart forgets what seals: the control plane gives it up.
    p.begin_snapshots(7, &[(live, 500)]).expect("begin");
    p.commit().expect("commit");
    let mut p = Pool::open(p.into_device()).expect("open");
    assert!(matches!(p.seal(&[500]), Err(ThinError::NotSealing(500))));
    assert!(matches!(
        p.begin_snapshots(7, &[(live, 500)]),
        Err(ThinError::RootExists(500))
    ));
    p.check().expect("consistent");
}

#[test]
fn a_dual_write_shares_the_new_grain_where_the_trees_were_alike() {
    let mut p = pool(16, 4, 32);
    let live = p.create_root().expect("root");
    write_tags(&mut p, live, 0, &[1; 8]).expect("two grains");
    p.commit().expect("commit");
    p.begin_snapshots(2, &[(live, 9)]).expect("begin");
    write_tagged(&mut p, live, 2, 1, &[5]).expect("one new grain for both");
    write_tagged(&mut p, live, 2, 12, &[6]).expect("unmapped in both");
    assert_eq!(tags(&mut p, live, 0, 2), [1, 5]);
    assert_eq!(tags(&mut p, 9, 0, 2), [1, 5]);
    assert_eq!(tags(&mut p, 9, 12, 1), [6]);
    let stats = p.stats();
    assert_eq!(
        (stats.grains_allocated, stats.grains_shared),
        (3, 3),
        "the old grain 0 is free: neither tree maps it"
    );
    p.check().expect("consistent");
}

#[test]
fn a_dual_write_without_room_for_every_tree_changes_none() {
    let mut p = pool(16, 4, 32);
    let live = p.create_root().expect("root");
    write_tags(&mut p, live, 0, &[1; 4]).expect("a grain");
    p.commit().expect("commit");
    p.begin_snapshots(2, &[(live, 9)]).expect("begin");
    // The trees part at grain 0, and the pool fills up.
    write_tags(&mut p, live, 0, &[2]).expect("the live tree's own copy");
    write_tags(&mut p, live, 4, &[3; 8]).expect("two more grains");
    let before = p.stats();
    // The live tree would write in place; the snapshot needs a grain.
    assert!(matches!(
        write_tagged(&mut p, live, 2, 1, &[5]),
        Err(ThinError::NoSpace)
    ));
    assert_eq!(p.stats(), before);
    assert_eq!(tags(&mut p, live, 0, 2), [2, 1]);
    assert_eq!(tags(&mut p, 9, 0, 2), [1, 1]);
    write_tagged(&mut p, live, 3, 1, &[6]).expect("after the cut: the live tree only");
    assert_eq!(tags(&mut p, live, 0, 2), [2, 6]);
    assert_eq!(tags(&mut p, 9, 0, 2), [1, 1]);
    p.check().expect("consistent");
}

#[test]
fn a_rollback_shares_the_snapshot_and_frees_what_only_the_live_tree_held() {
    // 16 KiB grains: four sectors each.
    let mut p = pool(16, 64, 64);
    let (live, snap) = (3, 100);
    assert!(p.ensure_root(live).expect("live"));
    // Three leaves' worth of the tree, so the snapshot is not one page.
    write_tags(&mut p, live, 0, &[1, 2, 3, 4, 5, 6, 7, 8]).expect("write");
    write_tags(&mut p, live, 512 * 4, &[9]).expect("a second leaf");
    write_tags(&mut p, live, 262_144 * 4, &[10]).expect("a second middle page");
    p.snapshot_as(live, snap).expect("snapshot");
    p.commit().expect("commit");
    let (free, stats) = (p.free, p.stats());
    // The trees share the top page; each grain is held once, below it.
    assert_eq!((stats.grains_allocated, stats.grains_shared), (4, 0));

    // The live tree moves on: a copy of grain 0, a grain of its own, and
    // a deallocate of the snapshot's second leaf.
    write_tags(&mut p, live, 1, &[20]).expect("write");
    write_tags(&mut p, live, 40, &[21, 22]).expect("write");
    p.deallocate(live, 512 * 4 * SECTOR_BYTES, SECTOR_BYTES)
        .expect("deallocate");
    p.commit().expect("commit");
    assert_eq!(p.stats().grains_allocated, 6);
    let pages_before = p.free[PAGES];

    p.rollback(&[(live, snap)]).expect("rollback");
    // Whatever the size: no grain, and at most the live tree's table path.
    assert!(
        pages_before - p.free[PAGES] <= TABLE_LEVELS as u64,
        "{pages_before} -> {}",
        p.free[PAGES]
    );
    for (first, n) in [(0, 8), (40, 2), (512 * 4, 1), (262_144 * 4, 1)] {
        assert_eq!(
            tags(&mut p, live, first, n),
            tags(&mut p, snap, first, n),
            "sectors {first}+{n}"
        );
    }
    assert_eq!(tags(&mut p, live, 0, 2), [1, 2]);
    assert_eq!(
        tags(&mut p, live, 40, 2),
        [0, 0],
        "the live tree's own: gone"
    );
    assert_eq!(tags(&mut p, live, 512 * 4, 1), [9]);
    p.commit().expect("commit");
    assert_eq!(p.stats(), stats, "the live tree's own grains are free");
    assert_eq!(p.free, free, "and so are its pages");
    p.check().expect("consistent");

    // The same request again changes nothing.
    p.rollback(&[(live, snap)]).expect("a retry");
    assert!(!p.dirty(), "nothing to commit");

    // Writes after it go to the live tree only.
    write_tags(&mut p, live, 1, &[30]).expect("write");
    write_tags(&mut p, live, 512 * 4, &[31]).expect("write");
    assert_eq!(tags(&mut p, live, 0, 2), [1, 30]);
    assert_eq!(
        tags(&mut p, snap, 0, 2),
        [1, 2],
        "the snapshot is unchanged"
    );
    assert_eq!(tags(&mut p, snap, 512 * 4, 1), [9]);
    p.check().expect("consistent");
    // Rolled back again, before any commit.
    p.rollback(&[(live, snap)]).expect("rollback");
    assert_eq!(tags(&mut p, live, 0, 2), [1, 2]);
    assert_eq!(tags(&mut p, live, 512 * 4, 1), [9]);
    p.commit().expect("commit");
    assert_eq!(p.stats(), stats);
    assert_eq!(p.free, free);

    // An unknown live tree is created; an unknown snapshot refuses the
    // whole request, a tree id past 2^32 too.
    write_tags(&mut p, live, 1, &[40]).expect("write");
    let roots = p.roots();
    assert!(matches!(
        p.rollback(&[(live, snap), (7, 999)]),
        Err(ThinError::NoRoot(999))
    ));
    assert!(matches!(
        p.rollback(&[(live, snap), (ROOT_ID_LIMIT, snap)]),
        Err(ThinError::RootId(ROOT_ID_LIMIT))
    ));
    assert_eq!(p.roots(), roots);
    assert_eq!(tags(&mut p, live, 0, 2), [1, 40], "nothing rolled back");
    p.rollback(&[(live, snap), (42, snap)]).expect("rollback");
    assert_eq!(p.roots(), [live, 42, snap]);
    assert_eq!(tags(&mut p, 42, 0, 2), [1, 2]);
    assert_eq!(tags(&mut p, live, 0, 2), [1, 2]);

    // The floor stays; a snapshot sealing refuses a rollback.
    p.begin_snapshots(3, &[(live, 200)]).expect("begin");
    assert!(matches!(
        p.rollback(&[(live, snap)]),
        Err(ThinError::Sealing(3))
    ));
    assert!(matches!(
        p.rollback(&[(42, 200)]),
        Err(ThinError::Sealing(200))
    ));
    p.seal(&[200]).expect("seal");
    p.rollback(&[(live, snap)]).expect("rollback");
    assert!(matches!(
        p.route(live, 3),
        Err(ThinError::Fenced { floor: 3, .. })
    ));
    p.commit().expect("commit");

    let mut p = Pool::open(p.into_device()).expect("open");
    assert_eq!(tags(&mut p, live, 0, 8), [1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(tags(&mut p, 42, 262_144 * 4, 1), [10]);
    assert_eq!(p.floor(live).expect("floor"), 3);
    p.check().expect("consistent");
}

#[test]
fn the_sealed_floor_is_committed_with_the_pages_and_survives_a_reopen() {
    let mut p = pool(64, 16, 64);
    let live = 5;
    assert!(p.ensure_root(live).expect("live"));
    write_tags(&mut p, live, 0, &[1]).expect("write");
    p.begin_snapshots(3, &[(live, 100)]).expect("begin");
    p.commit().expect("commit");
    p.seal(&[100]).expect("seal");
    assert!(p.dirty(), "the floor is part of the next commit");
    assert_eq!(p.floor(live).expect("floor"), 3);
    p.check().expect("consistent");
    // Lost before its commit: the floor with it.
    let mut p = Pool::open(p.into_device()).expect("open");
    assert_eq!(p.floor(live).expect("floor"), 0);
    assert_eq!(p.route(live, 3).expect("route"), [live]);

    p.begin_snapshots(3, &[(live, 101)]).expect("begin");
    p.seal(&[101]).expect("seal");
    p.commit().expect("commit");
    let mut p = Pool::open(p.into_device()).expect("open");
    assert_eq!(p.floor(live).expect("floor"), 3);
    for tag in 1..=3 {
        assert!(matches!(
            p.route(live, tag),
            Err(ThinError::Fenced {
                root: 5,
                floor: 3,
                ..
            })
        ));
    }
    assert_eq!(p.route(live, 4).expect("route"), [live]);
    assert_eq!(p.route(live, 0).expect("untagged"), [live]);
    assert!(matches!(
        p.begin_snapshots(3, &[(live, 102)]),
        Err(ThinError::EpochSealed { live: 5, epoch: 3 })
    ));
    assert!(matches!(p.seal(&[101]), Err(ThinError::NotSealing(101))));
    p.check().expect("consistent");

    // Raised again, with other live trees sealed beside it.
    p.begin_snapshots(8, &[(live, 102), (6, 103), (1 << 30, 104)])
        .expect("begin");
    p.seal(&[102, 103, 104]).expect("seal");
    p.commit().expect("commit");
    let mut p = Pool::open(p.into_device()).expect("open");
    assert_eq!(p.floor(live).expect("floor"), 8);
    assert_eq!(p.floor(1 << 30).expect("floor"), 8);
    assert_eq!(p.roots(), [live, 6, 100, 101, 102, 103, 104, 1 << 30]);
    p.check().expect("consistent");

    // Deleting a live tree forgets its floor; with every tree gone the
    // table holds no page.
    p.delete_root(live).expect("delete");
    assert!(p.ensure_root(live).expect("placed again"));
    assert_eq!(p.floor(live).expect("floor"), 0);
    assert_eq!(p.route(live, 1).expect("route"), [live]);
    for id in p.roots() {
        p.delete_root(id).expect("delete");
    }
    p.commit().expect("commit");
    assert_eq!(p.table, 0);
    p.check().expect("consistent");
    let p = Pool::open(p.into_device()).expect("open");
    assert!(p.epochs.is_empty());
}

/// Rewrites every superblock on `disk` that checks out as `version`.
fn set_version(disk: &mut MemDisk, version: u32) {
    for slot in 0..2 {
        let mut page = vec![0; PAGE_BYTES as usize];
        disk.read_at(&mut page, slot * PAGE_BYTES).expect("read");
        if let Some(sb) = Superblock::decode(&page, disk.size()) {
            let page = Superblock { version, ..sb }.encode();
            disk.write_at(&page, slot * PAGE_BYTES).expect("write");
        }
    }
    disk.flush().expect("flush");
}

fn versions(disk: &mut MemDisk) -> Vec<u32> {
    (0..2)
        .filter_map(|slot| {
            let mut page = vec![0; PAGE_BYTES as usize];
            disk.read_at(&mut page, slot * PAGE_BYTES).expect("read");
            Superblock::decode(&page, disk.size()).map(|sb| sb.version)
        })
        .collect()
}

#[test]
fn a_version_3_pool_opens_with_no_floors_and_commits_as_version_4() {
    let mut p = pool(64, 16, 64);
    let live = p.create_root().expect("root");
    write_tags(&mut p, live, 0, &[1, 2]).expect("write");
    p.snapshot_as(live, 9).expect("snapshot");
    p.commit().expect("commit");
    let mut disk = p.into_device();
    // Version 3 is these bytes, without floor keys, under another number.
    set_version(&mut disk, 3);
    assert_eq!(versions(&mut disk), [3, 3]);
    let mut p = Pool::open(disk).expect("a version-3 pool opens");
    assert_eq!(p.roots(), [live, 9]);
    assert_eq!(tags(&mut p, 9, 0, 2), [1, 2]);
    assert_eq!(p.floor(live).expect("floor"), 0);
    assert_eq!(p.route(live, 1).expect("route"), [live]);
    p.check().expect("consistent");
    p.begin_snapshots(2, &[(live, 10)]).expect("begin");
    p.seal(&[10]).expect("seal");
    p.commit().expect("commit");
    let mut disk = p.into_device();
    let mut got = versions(&mut disk);
    got.sort_unstable();
    assert_eq!(got, [3, 4], "the new commit is version 4");
    let mut p = Pool::open(disk).expect("open");
    assert_eq!(p.floor(live).expect("floor"), 2);
    p.check().expect("consistent");

    let mut disk = p.into_device();
    set_version(&mut disk, 2);
    assert!(matches!(Pool::open(disk), Err(ThinError::NoSuperblock)));
}

// ---- T3's crash simulation ----

/// Seeds run by default; `THIN_SIM_SEEDS=n` runs more, `THIN_SIM_SEED=s` one.
const SIM_SEEDS: u64 = 300;
const SIM_OPS: u64 = 400;
const SIM_ROOTS_MAX: usize = 16;
/// Grain indices the simulation writes around: the first leaf, both sides of
/// a leaf and of a middle page, and the last grain of the tree.
const SIM_GRAINS: [u64; 9] = [
    0,
    1,
    2,
    511,
    512,
    513,
    262_143,
    262_144,
    GRAIN_INDEX_LIMIT - 2,
];

/// The tag of each 512-byte chunk of a sector (all 0: zeroes).
type Sec = [u64; 8];

fn sec_bytes(sec: &Sec) -> Vec<u8> {
    sec.iter()
        .flat_map(|&t| (0..64).flat_map(move |_| t.to_le_bytes()))
        .collect()
}

#[derive(Debug, Default)]
struct SimStats {
    crashes: u64,
    commits_landed_in_crash: u64,
    no_space: u64,
    shared_seen: u64,
    roots_created: u64,
    roots_deleted: u64,
    floors_raised: u64,
    rollbacks: u64,
}

/// What the pool must hold: per root, every sector ever touched.
type Model = BTreeMap<u64, BTreeMap<u64, Sec>>;

struct Sim {
    rng: Rng,
    seed: u64,
    pool: Option<Pool<MemDisk>>,
    spg: u64,
    cur: Model,
    committed: Model,
    /// Values written to (root, sector) since the last commit: after a crash
    /// each chunk holds the committed value or one of these.
    since: BTreeMap<(u64, u64), Vec<Sec>>,
    tag: u64,
    generation: u64,
    /// Each live tree's sealed floor (T5), now and at the last commit.
    floors: BTreeMap<u64, u32>,
    committed_floors: BTreeMap<u64, u32>,
}

impl Sim {
    fn p(&mut self) -> &mut Pool<MemDisk> {
        self.pool.as_mut().expect("pool open")
    }

    fn pick_root(&mut self) -> Option<u64> {
        let roots: Vec<u64> = self.cur.keys().copied().collect();
        (!roots.is_empty()).then(|| roots[self.rng.below(roots.len() as u64) as usize])
    }

    /// A root id as the control plane names trees (sparse, below 2^30), or
    /// one near a live root's (sharing its table pages, or taken already).
    fn pick_id(&mut self) -> u64 {
        match (self.rng.below(3), self.pick_root()) {
            (0, Some(r)) => r ^ self.rng.below(1024),
            _ => self.rng.below(1 << 30),
        }
    }

    /// Up to three new roots, by `create_root` or, mostly, `ensure_root`.
    fn add_roots(&mut self, stats: &mut SimStats) -> Result<()> {
        for _ in 0..1 + self.rng.below(3) {
            let id = if self.rng.below(3) == 0 {
                self.p().create_root()?
            } else {
                let id = self.pick_id();
                if !self.p().ensure_root(id)? {
                    assert!(self.cur.contains_key(&id), "seed {}: {id}", self.seed);
                    continue;
                }
                id
            };
            self.cur.insert(id, BTreeMap::new());
            stats.roots_created += 1;
        }
        Ok(())
    }

    fn delete_roots(&mut self, stats: &mut SimStats) -> Result<()> {
        for _ in 0..1 + self.rng.below(2) {
            let Some(r) = self.pick_root() else {
                break;
            };
            self.p().delete_root(r)?;
            self.cur.remove(&r);
            self.floors.remove(&r);
            stats.roots_deleted += 1;
        }
        Ok(())
    }

    /// A range of up to two grains' sectors near one of `SIM_GRAINS`.
    fn pick_range(&mut self) -> (u64, u64) {
        let gi = SIM_GRAINS[self.rng.below(SIM_GRAINS.len() as u64) as usize];
        let first = gi * self.spg + self.rng.below(self.spg);
        let n = 1 + self.rng.below(2 * self.spg);
        (first, n.min(GRAIN_INDEX_LIMIT * self.spg - first))
    }

    fn step(&mut self, stats: &mut SimStats) {
        if self.p().dev.ops_left.is_none() && self.rng.below(40) == 0 {
            let n = self.rng.below(16);
            self.p().dev.ops_left = Some(n);
        }
        let root = self.pick_root();
        let choice = self.rng.below(100);
        let (result, commit) = match (choice, root) {
            (0..=39, Some(r)) => (self.write(r), false),
            (40..=49, Some(r)) => (self.deallocate(r), false),
            (50..=59, _) => {
                let r = self.p().commit();
                if r.is_ok() {
                    self.committed = self.cur.clone();
                    self.committed_floors = self.floors.clone();
                    self.since.clear();
                    self.generation = self.p().generation();
                }
                (r, true)
            }
            (60..=63, Some(r)) if self.cur.len() < SIM_ROOTS_MAX => {
                let id = if self.rng.below(2) == 0 {
                    let id = self.pick_id();
                    match self.p().snapshot_as(r, id) {
                        Err(ThinError::RootExists(_)) => {
                            assert!(self.cur.contains_key(&id), "seed {}: {id}", self.seed);
                            Ok(None)
                        }
                        other => other.map(|()| Some(id)),
                    }
                } else {
                    self.p().snapshot(r).map(Some)
                };
                let r = id.map(|id| {
                    if let Some(id) = id {
                        let copy = self.cur[&r].clone();
                        self.cur.insert(id, copy);
                    }
                });
                (r, false)
            }
            (60..=71, _) if self.cur.len() < SIM_ROOTS_MAX => (self.add_roots(stats), false),
            (72..=77, Some(_)) => (self.delete_roots(stats), false),
            (78..=89, Some(r)) => (self.read_back(r), false),
            (90..=93, _) => {
                self.p().dev.ops_left = Some(0);
                (Err(ThinError::Io(io::Error::other("crash now"))), false)
            }
            (94..=95, Some(r)) if self.cur.len() < SIM_ROOTS_MAX => (self.seal(r, stats), false),
            (96..=97, Some(r)) => (self.rollback(r, stats), false),
            _ => (self.p().check(), false),
        };
        if self.p().stats().grains_shared > 0 {
            stats.shared_seen += 1;
        }
        if std::env::var("THIN_SIM_TRACE").is_ok() {
            eprintln!(
                "choice {choice} root {root:?} commit {commit} -> {result:?} roots {:?} gen {}",
                self.cur.keys().collect::<Vec<_>>(),
                self.generation
            );
        }
        match result {
            Ok(()) => {}
            Err(ThinError::NoSpace) => stats.no_space += 1,
            Err(ThinError::Io(_)) => self.recover(commit, stats),
            Err(e) => panic!("seed {}: unexpected {e}", self.seed),
        }
    }

    /// A snapshot of `root` taken and sealed at an epoch above its floor:
    /// the floor rises. A snapshot left sealing (no room to seal) is
    /// deleted, or, without room for that either, stays (a rollback of its
    /// tree is then refused).
    fn seal(&mut self, root: u64, stats: &mut SimStats) -> Result<()> {
        let epoch = self.floors.get(&root).copied().unwrap_or(0) + 1 + self.rng.below(3) as u32;
        let id = self.pick_id();
        match self.p().begin_snapshots(epoch, &[(root, id)]) {
            Err(ThinError::RootExists(_)) => {
                assert!(self.cur.contains_key(&id), "seed {}: {id}", self.seed);
                return Ok(());
            }
            r => r?,
        }
        let copy = self.cur[&root].clone();
        self.cur.insert(id, copy);
        match self.p().seal(&[id]) {
            Err(ThinError::NoSpace) => {
                match self.p().delete_root(id) {
                    Ok(()) => {
                        self.cur.remove(&id);
                    }
                    Err(ThinError::NoSpace) => {}
                    Err(e) => return Err(e),
                }
                Err(ThinError::NoSpace)
            }
            r => {
                r?;
                self.floors.insert(root, epoch);
                stats.floors_raised += 1;
                Ok(())
            }
        }
    }

    /// `live` (an existing tree, or sometimes a new id) takes the contents
    /// of another tree.
    fn rollback(&mut self, root: u64, stats: &mut SimStats) -> Result<()> {
        let Some(snapshot) = self.pick_root() else {
            return Ok(());
        };
        let live = if self.rng.below(4) == 0 && self.cur.len() < SIM_ROOTS_MAX {
            self.pick_id()
        } else {
            root
        };
        match self.p().rollback(&[(live, snapshot)]) {
            Err(ThinError::Sealing(_)) => return Ok(()),
            r => r?,
        }
        let mut now: BTreeMap<u64, Sec> = self
            .cur
            .get(&live)
            .map(|m| m.keys().map(|&s| (s, [0; 8])).collect())
            .unwrap_or_default();
        now.extend(self.cur[&snapshot].iter().map(|(&s, &v)| (s, v)));
        self.cur.insert(live, now);
        stats.rollbacks += 1;
        Ok(())
    }

    /// `root`, and sometimes another (a write a sealing snapshot takes too).
    fn pick_trees(&mut self, root: u64) -> Vec<u64> {
        match (self.rng.below(4), self.pick_root()) {
            (0, Some(other)) if other != root => vec![root, other],
            _ => vec![root],
        }
    }

    fn write(&mut self, root: u64) -> Result<()> {
        let trees = self.pick_trees(root);
        let (first, n) = self.pick_range();
        let secs: Vec<Sec> = (0..n)
            .map(|_| {
                self.tag += 1;
                [self.tag; 8]
            })
            .collect();
        let data: Vec<u8> = secs.iter().flat_map(sec_bytes).collect();
        let r = self.p().write_trees(&trees, first * SECTOR_BYTES, &data);
        if std::env::var("THIN_SIM_TRACE").is_ok() {
            eprintln!(
                "write roots {trees:?} sectors {first}+{n} tags {:?}",
                secs.iter().map(|s| s[0]).collect::<Vec<_>>()
            );
        }
        if !matches!(r, Err(ThinError::NoSpace)) {
            for root in trees {
                for (k, &sec) in secs.iter().enumerate() {
                    let s = first + k as u64;
                    self.since.entry((root, s)).or_default().push(sec);
                    self.cur.get_mut(&root).expect("root").insert(s, sec);
                }
            }
        }
        r
    }

    fn deallocate(&mut self, root: u64) -> Result<()> {
        let trees = self.pick_trees(root);
        let (first, n) = self.pick_range();
        let r = self
            .p()
            .deallocate_trees(&trees, first * SECTOR_BYTES, n * SECTOR_BYTES);
        if !matches!(r, Err(ThinError::NoSpace)) {
            for root in trees {
                for s in first..first + n {
                    self.since.entry((root, s)).or_default().push([0; 8]);
                    self.cur.get_mut(&root).expect("root").insert(s, [0; 8]);
                }
            }
        }
        r
    }

    /// Reads a range (tracked or not) and compares it with the model exactly.
    fn read_back(&mut self, root: u64) -> Result<()> {
        let (first, n) = self.pick_range();
        let mut buf = vec![0xAA; (n * SECTOR_BYTES) as usize];
        self.p().read(root, first * SECTOR_BYTES, &mut buf)?;
        for (k, got) in buf.chunks_exact(S).enumerate() {
            let s = first + k as u64;
            let want = self.cur[&root].get(&s).copied().unwrap_or_default();
            assert!(
                got == sec_bytes(&want),
                "seed {}: root {root} sector {s} reads {:?}, want {want:?}",
                self.seed,
                chunk_tags(got)
            );
        }
        Ok(())
    }

    /// Power loss, then open and check every root against what was flushed.
    fn recover(&mut self, commit_in_flight: bool, stats: &mut SimStats) {
        stats.crashes += 1;
        let seed = self.seed;
        let mut disk = self.pool.take().expect("pool open").into_device();
        disk.crash(&mut self.rng);
        let mut p =
            Pool::open(disk).unwrap_or_else(|e| panic!("seed {seed}: open after crash: {e}"));
        let landed = commit_in_flight && p.generation() == self.generation + 1;
        assert!(
            landed || p.generation() == self.generation,
            "seed {seed}: generation {}",
            p.generation()
        );
        stats.commits_landed_in_crash += u64::from(landed);
        let base = if landed {
            self.cur.clone()
        } else {
            self.committed.clone()
        };
        assert_eq!(
            p.roots(),
            base.keys().copied().collect::<Vec<_>>(),
            "seed {seed}: roots after crash"
        );
        let mut now = Model::new();
        for (&root, sectors) in &base {
            let mut tracked: BTreeSet<u64> = sectors.keys().copied().collect();
            if !landed {
                tracked.extend(
                    self.since
                        .range((root, 0)..(root + 1, 0))
                        .map(|(&(_, s), _)| s),
                );
            }
            // Sectors nobody wrote must read zeroes.
            let spg = self.spg;
            tracked.extend(SIM_GRAINS.iter().map(|gi| gi * spg + spg - 1));
            let mut got_root = BTreeMap::new();
            for s in tracked {
                let mut buf = vec![0xAA; S];
                p.read(root, s * SECTOR_BYTES, &mut buf)
                    .unwrap_or_else(|e| panic!("seed {seed}: read: {e}"));
                let mut ok = vec![sectors.get(&s).copied().unwrap_or_default()];
                if !landed {
                    ok.extend(self.since.get(&(root, s)).into_iter().flatten());
                }
                let mut got = [0; 8];
                for (i, tag) in chunk_tags(&buf).into_iter().enumerate() {
                    assert!(
                        tag.is_some_and(|t| ok.iter().any(|sec| sec[i] == t)),
                        "seed {seed}: root {root} sector {s} chunk {i} reads {tag:?}, flushed or later writes were {ok:?}"
                    );
                    got[i] = tag.expect("checked");
                }
                got_root.insert(s, got);
            }
            now.insert(root, got_root);
        }
        p.check()
            .unwrap_or_else(|e| panic!("seed {seed}: after crash: {e}"));
        let mut floors = if landed {
            self.floors.clone()
        } else {
            self.committed_floors.clone()
        };
        floors.retain(|root, _| base.contains_key(root));
        for &root in base.keys() {
            assert_eq!(
                p.floor(root).expect("floor"),
                floors.get(&root).copied().unwrap_or(0),
                "seed {seed}: root {root}'s floor after crash"
            );
        }
        self.committed_floors.clone_from(&floors);
        self.floors = floors;
        self.generation = p.generation();
        self.cur = now.clone();
        self.committed = now;
        self.since.clear();
        self.pool = Some(p);
    }
}

fn simulate(seed: u64, stats: &mut SimStats) {
    let mut rng = Rng(seed);
    let grain_kib = [16, 32, 64][rng.below(3) as usize];
    let grains = 16 + rng.below(48);
    let meta_pages = 20 + rng.below(100);
    let mut sim = Sim {
        pool: Some(pool(grain_kib, grains, meta_pages)),
        rng,
        seed,
        spg: grain_kib / 4,
        cur: Model::new(),
        committed: Model::new(),
        since: BTreeMap::new(),
        tag: 0,
        generation: 1,
        floors: BTreeMap::new(),
        committed_floors: BTreeMap::new(),
    };
    for _ in 0..SIM_OPS {
        sim.step(stats);
    }
    sim.p().dev.ops_left = Some(0);
    sim.recover(false, stats);
}

/// Prints the seed when a simulation panics, so `THIN_SIM_SEED` reruns it.
struct SeedReport(u64);

impl Drop for SeedReport {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "grain pool crash simulation failed at seed {0}: rerun with THIN_SIM_SEED={0}",
                self.0
            );
        }
    }
}

#[test]
fn crash_simulation() {
    let env = |name| {
        std::env::var(name)
            .ok()
            .map(|v: String| v.parse::<u64>().expect("a number"))
    };
    let seeds = match env("THIN_SIM_SEED") {
        Some(s) => s..s + 1,
        None => 0..env("THIN_SIM_SEEDS").unwrap_or(SIM_SEEDS),
    };
    let all = seeds.end - seeds.start > 1;
    let mut stats = SimStats::default();
    for seed in seeds {
        let _report = SeedReport(seed);
        simulate(seed, &mut stats);
    }
    eprintln!("grain pool crash simulation: {stats:?}");
    if all {
        assert!(
            stats.crashes > 0 && stats.commits_landed_in_crash > 0,
            "{stats:?}"
        );
        assert!(stats.no_space > 0 && stats.shared_seen > 0, "{stats:?}");
        assert!(
            stats.roots_created > 1000 && stats.roots_deleted > 1000,
            "{stats:?}"
        );
        assert!(
            stats.floors_raised > 100 && stats.rollbacks > 100,
            "{stats:?}"
        );
    }
}
