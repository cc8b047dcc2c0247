//! The grain pool (docs/design/thin-snapshots.md, T2–T4): thin trees of
//! data grains with a written mask per grain, shared between roots by
//! reference counts, with copy-on-write metadata committed at flush.
//!
//! Synchronous and single-threaded on purpose: it talks to a [`Device`], so
//! the crash simulation runs it on memory, and [`ThinBackend`] runs it on a
//! thread of its own per device (backend.rs).
//!
//! A root is a tree: three levels of 4 KiB pages of 512 little-endian u64
//! entries. Interior entries are page numbers (0: none); a leaf entry is a
//! data-grain number << 16 | written mask (0: unmapped). A root maps grain
//! indices `0..GRAIN_INDEX_LIMIT` straight to data: no chain on any read.
//!
//! The root table is the same kind of radix tree, keyed by root id: four
//! levels of pages (5, 9, 9 and 9 bits of the id, so any id below
//! [`ROOT_ID_LIMIT`] = 2^32) whose leaf entries are *records*: `PRESENT`
//! | the root's top page (0: nothing written yet). The superblock names the
//! table's top page. Its pages are shadowed, counted in the space map and
//! committed exactly like tree pages, so a crash before the superblock write
//! leaves the old table (T3); a page a delete leaves empty is freed, so a
//! pool with no roots holds no table page. Ids may be sparse (the control
//! plane names a tree by its offset in the pool's virtual space): a root
//! costs its path's share of the table, at worst three pages of its own.
//! Each table page has one parent (nothing snapshots the table), and a
//! record holds one reference on its tree's top page.
//!
//! Sharing (T2): every page and grain has a reference count. A page may be
//! changed in place only when this transaction allocated it and one parent
//! holds it; otherwise it is *shadowed*: copied to a new page, and if the old
//! one was shared its children each gain a reference. Data overwrites go in
//! place when the grain is the writer's alone, and were so at the last
//! commit; otherwise the grain is copied (only the sectors the write leaves).
//!
//! Crash safety (T3): a commit writes the transaction's pages and space map
//! slot, flushes, writes the other superblock, flushes. A page or grain is
//! allocatable only when both its current and its committed count are zero,
//! so nothing the last commit reaches is ever overwritten, and what was freed
//! since waits for the next commit. `DELETE_RESERVE` pages are kept for a
//! delete (only it may use them), so a pool whose metadata is full can still
//! delete a root, and after the next commit has that root's pages back.
//!
//! Snapshots (T5): [`Pool::begin_snapshots`] makes trees sharing everything
//! with live ones, and the pool keeps, per live tree, the [`TreeEpochs`] of
//! its snapshots still sealing, so [`Pool::route`] names every tree a tagged
//! write lands in. The snapshots still sealing are in memory only: a
//! restart forgets them, and the control plane gives up a snapshot its
//! target no longer seals. A live tree's *floor* (its highest sealed epoch:
//! writes tagged 1..=floor are refused) is kept in the root table at key
//! [`FLOOR_KEYS`] + id, written by [`Pool::seal`] and committed with the
//! pages like any record, so a reopened pool refuses what it refused before
//! (format.rs, version 4). Deleting a tree drops its floor.
//!
//! Rollback (T6): [`Pool::rollback`] points a live tree's record at a
//! snapshot's top page (one more reference, whatever the size) and drops
//! the live tree's own pages and grains; its floor stays.

mod backend;
pub mod epochs;
mod format;
#[cfg(test)]
mod tests;

pub use backend::{format, open, Converged, FileDevice, ThinBackend, ThinPool, THIN_BLOCK_BYTES};

use std::collections::{BTreeSet, HashMap, HashSet};
use std::io;

use epochs::TreeEpochs;

pub use format::{Layout, GRAIN_BYTES_ALLOWED, SECTOR_BYTES};
use format::{Superblock, ENTRIES_PER_PAGE, PAGE_BYTES};

/// Three levels of 512 entries.
pub const GRAIN_INDEX_LIMIT: u64 = 1 << 27;
const MASK_BITS: u64 = 0xffff;
/// Root ids the four-level root table holds: 2^30 MiB-offsets of a 1 PiB
/// virtual space fit with room to spare.
pub const ROOT_ID_LIMIT: u64 = 1 << 32;
const TABLE_LEVELS: usize = 4;
/// Set in every root record, so a root with nothing written (top page 0) is
/// told apart from no root.
const PRESENT: u64 = 1 << 63;
/// Root-table keys from here hold floors: key `FLOOR_KEYS + id` is tree
/// `id`'s highest sealed epoch (a u32 above 0, referencing nothing). Ids
/// take the table's top slots 0..32, floors 32..64: the top level has room
/// for 512.
const FLOOR_KEYS: u64 = ROOT_ID_LIMIT;
/// Top-level slots of the root table that hold root ids.
const ROOT_TOP_SLOTS: usize = (ROOT_ID_LIMIT >> 27) as usize;
const _: () = assert!(2 * ROOT_TOP_SLOTS <= ENTRIES_PER_PAGE);
/// Free metadata pages only `delete_root` may take: the root's table path
/// and its floor's, which share the top page.
const DELETE_RESERVE: u64 = 2 * TABLE_LEVELS as u64 - 1;

/// The byte device a pool lives on. Writes may sit in a volatile cache until
/// `flush` returns, as on NVMe.
pub trait Device {
    fn size(&self) -> u64;
    fn read_at(&mut self, buf: &mut [u8], off: u64) -> io::Result<()>;
    fn write_at(&mut self, buf: &[u8], off: u64) -> io::Result<()>;
    fn flush(&mut self) -> io::Result<()>;
}

#[derive(Debug, thiserror::Error)]
pub enum ThinError {
    /// No free data grain or metadata page; nothing was changed (T4).
    #[error("no free grain or metadata page")]
    NoSpace,
    #[error("no root {0}")]
    NoRoot(u64),
    #[error("root id {0} is not below 2^32")]
    RootId(u64),
    #[error("tree {0} exists")]
    RootExists(u64),
    /// A snapshot's epoch not above one sealed already on its live tree:
    /// writes it should take may have been refused.
    #[error("epoch {epoch} of tree {live} is not above a sealed snapshot's")]
    EpochSealed { live: u64, epoch: u32 },
    #[error("tree {0} is not a sealing snapshot here")]
    NotSealing(u64),
    /// A rollback of a tree with a snapshot sealing (or of one that is):
    /// a snapshot is being taken.
    #[error("a snapshot of tree {0} is being taken (sealing)")]
    Sealing(u64),
    /// A write tagged at or below a sealed snapshot's epoch: only a fenced
    /// writer sends one.
    #[error("a write to tree {root} tagged {tag} is at or below the sealed epoch {floor}")]
    Fenced { root: u64, tag: u32, floor: u32 },
    /// A tree to start as another's ([`Pool::start_as`]) has data of its
    /// own: hosts may have written it.
    #[error("tree {0} holds data")]
    HoldsData(u64),
    #[error("range not 4 KiB aligned or beyond the tree")]
    Range,
    #[error("device too small or grain size not 16, 32 or 64 KiB")]
    BadFormat,
    #[error("no valid superblock")]
    NoSuperblock,
    /// An earlier I/O error left the in-memory state unknown (style rule 7).
    #[error("pool failed after an I/O error")]
    Failed,
    #[error("inconsistent metadata: {0}")]
    Corrupt(String),
    #[error("device I/O")]
    Io(#[from] io::Error),
}

pub type Result<T> = std::result::Result<T, ThinError>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolStats {
    pub grains_total: u64,
    /// Grains with at least one reference.
    pub grains_allocated: u64,
    /// Grains with more than one reference (snapshots, clones).
    pub grains_shared: u64,
}

type Page = Box<[u64; ENTRIES_PER_PAGE]>;

fn zero_page() -> Page {
    Box::new([0; ENTRIES_PER_PAGE])
}

/// Grain index → (top slot, middle slot, leaf slot).
fn split(gi: u64) -> (usize, usize, usize) {
    (
        (gi >> 18) as usize & 511,
        (gi >> 9) as usize & 511,
        gi as usize & 511,
    )
}

/// Root-table key (a root id, or [`FLOOR_KEYS`] + id) → its slot at each
/// level, top first.
fn table_slots(id: u64) -> [usize; TABLE_LEVELS] {
    [
        (id >> 27) as usize & 511,
        (id >> 18) as usize & 511,
        (id >> 9) as usize & 511,
        id as usize & 511,
    ]
}

/// What a page's non-zero entries reference.
#[derive(Debug, Clone, Copy)]
enum Children {
    /// Pages: a tree's or the root table's interior.
    Pages,
    /// Data grains (with a written mask): a tree's leaf.
    Grains,
    /// Root records: the root table's leaf.
    Roots,
    /// Floors: the root table's leaf under [`FLOOR_KEYS`]; no references.
    Floors,
}

/// Bits of the sectors `first..first + n` of a grain.
fn sector_bits(first: u64, n: u64) -> u64 {
    ((1u64 << n) - 1) << first
}

pub struct Pool<D> {
    dev: D,
    layout: Layout,
    generation: u64,
    next_root: u64,
    /// Top page of the root table, and of the committed one (0: no roots).
    /// Every page of the live table is in `cache` (loaded at open).
    table: u64,
    committed_table: u64,
    /// Reference counts: data grains, then metadata pages.
    counts: Vec<u16>,
    committed: Vec<u16>,
    /// Allocatable (both counts zero) data grains and metadata pages.
    free: [u64; 2],
    /// Data grains with a reference: kept as counts change, so the usage a
    /// heartbeat reports costs no scan of the space map.
    allocated: u64,
    cursor: [u64; 2],
    /// Every page read or written; pages allocated since the commit are in
    /// `dirty` too. Whole-metadata caching is the first cut (T2 remains).
    cache: HashMap<u64, Page>,
    dirty: BTreeSet<u64>,
    /// Per space map page: the generation whose transaction last changed it;
    /// per slot: the generation last written there. A commit writes the pages
    /// its slot has not seen.
    sm_changed: Vec<u64>,
    slot_written: [u64; 2],
    changed: bool,
    failed: bool,
    /// Per live tree with snapshots sealing or sealed (T5).
    epochs: HashMap<u64, TreeEpochs>,
    /// Snapshot trees sealed since the pool was opened: sealing one again is
    /// a retry.
    sealed: HashSet<u64>,
}

impl<D> std::fmt::Debug for Pool<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("layout", &self.layout)
            .field("generation", &self.generation)
            .finish()
    }
}

const GRAINS: usize = 0;
const PAGES: usize = 1;

impl<D: Device> Pool<D> {
    /// Formats `dev` as an empty pool (generation 1, no roots).
    pub fn format(mut dev: D, grain_bytes: u64, meta_pages: Option<u64>) -> Result<Pool<D>> {
        let layout =
            Layout::compute(dev.size(), grain_bytes, meta_pages).ok_or(ThinError::BadFormat)?;
        let zero = vec![0u8; PAGE_BYTES as usize];
        for j in 0..layout.sm_pages {
            dev.write_at(&zero, layout.sm_offset(1, j))?;
        }
        dev.write_at(&zero, 0)?;
        let sb = Superblock {
            version: format::VERSION,
            generation: 1,
            layout,
            next_root: 1,
            root_table: 0,
        };
        dev.write_at(&sb.encode(), PAGE_BYTES)?;
        dev.flush()?;
        Pool::open(dev)
    }

    /// Opens the newer of the two superblocks that check out.
    pub fn open(mut dev: D) -> Result<Pool<D>> {
        let size = dev.size();
        let mut best: Option<Superblock> = None;
        for slot in 0..2 {
            let mut page = vec![0u8; PAGE_BYTES as usize];
            dev.read_at(&mut page, slot * PAGE_BYTES)?;
            if let Some(sb) = Superblock::decode(&page, size) {
                if sb.generation % 2 == slot
                    && best.as_ref().is_none_or(|b| sb.generation > b.generation)
                {
                    best = Some(sb);
                }
            }
        }
        let sb = best.ok_or(ThinError::NoSuperblock)?;
        let layout = sb.layout;
        let mut counts = Vec::with_capacity(layout.counts());
        let mut page = vec![0u8; PAGE_BYTES as usize];
        for j in 0..layout.sm_pages {
            dev.read_at(&mut page, layout.sm_offset(sb.generation % 2, j))?;
            counts.extend(
                page.chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]])),
            );
        }
        counts.truncate(layout.counts());
        let mut pool = Pool {
            dev,
            layout,
            generation: sb.generation,
            next_root: sb.next_root,
            table: sb.root_table,
            committed_table: sb.root_table,
            committed: counts.clone(),
            counts,
            free: [0; 2],
            allocated: 0,
            cursor: [0; 2],
            cache: HashMap::new(),
            dirty: BTreeSet::new(),
            sm_changed: vec![sb.generation + 1; layout.sm_pages as usize],
            slot_written: [0; 2],
            changed: false,
            failed: false,
            epochs: HashMap::new(),
            sealed: HashSet::new(),
        };
        pool.recount_free();
        if sb.root_table != 0 {
            pool.load_table(sb.root_table, 0)?;
        }
        for (id, floor) in pool.floors() {
            let floor = u32::try_from(floor)
                .map_err(|_| ThinError::Corrupt(format!("floor {floor} of tree {id}")))?;
            pool.epochs.insert(id, TreeEpochs::with_floor(floor));
        }
        Ok(pool)
    }

    /// Caches the root table below `p` (at `level`), so `roots` needs no I/O.
    fn load_table(&mut self, p: u64, level: usize) -> Result<()> {
        if !self.layout.is_meta(p) {
            return Err(ThinError::Corrupt(format!(
                "root table page {p} outside the metadata area"
            )));
        }
        self.load(p)?;
        if level + 1 < TABLE_LEVELS {
            let children: Vec<u64> = self.cache[&p].iter().copied().filter(|&e| e != 0).collect();
            for c in children {
                self.load_table(c, level + 1)?;
            }
        }
        Ok(())
    }

    pub fn into_device(self) -> D {
        self.dev
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Every root id, in order: a walk of the whole root table.
    pub fn roots(&self) -> Vec<u64> {
        self.table_entries(0..ROOT_TOP_SLOTS)
            .into_iter()
            .map(|(id, _)| id)
            .collect()
    }

    /// Every stored floor, `(tree id, floor)` in id order.
    fn floors(&self) -> Vec<(u64, u64)> {
        self.table_entries(ROOT_TOP_SLOTS..2 * ROOT_TOP_SLOTS)
            .into_iter()
            .map(|(key, floor)| (key - FLOOR_KEYS, floor))
            .collect()
    }

    /// `(key, entry)` of the root table's leaves under the top slots `top`.
    fn table_entries(&self, top: std::ops::Range<usize>) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        if self.table != 0 {
            self.collect_entries(self.table, 0, 0, &top, &mut out);
        }
        out
    }

    fn collect_entries(
        &self,
        p: u64,
        level: usize,
        prefix: u64,
        top: &std::ops::Range<usize>,
        out: &mut Vec<(u64, u64)>,
    ) {
        let page = self.cache.get(&p).expect("the live root table is cached");
        for (slot, &e) in page.iter().enumerate().filter(|(_, e)| **e != 0) {
            if level == 0 && !top.contains(&slot) {
                continue;
            }
            let key = prefix << 9 | slot as u64;
            if level + 1 == TABLE_LEVELS {
                out.push((key, e));
            } else {
                self.collect_entries(e, level + 1, key, top, out);
            }
        }
    }

    /// Tree `id`'s highest sealed epoch as the root table holds it (0:
    /// none).
    pub fn floor(&mut self, id: u64) -> Result<u32> {
        if id >= ROOT_ID_LIMIT {
            return Ok(0);
        }
        let e = self.table_entry(self.table, FLOOR_KEYS + id)?;
        u32::try_from(e).map_err(|_| ThinError::Corrupt(format!("floor {e} of tree {id}")))
    }

    /// Data grains with at least one reference, without a scan.
    pub fn grains_allocated(&self) -> u64 {
        self.allocated
    }

    pub fn stats(&self) -> PoolStats {
        let grains = &self.counts[..self.layout.data_grains as usize];
        PoolStats {
            grains_total: self.layout.data_grains,
            grains_allocated: self.allocated,
            grains_shared: grains.iter().filter(|&&c| c > 1).count() as u64,
        }
    }

    /// A new empty tree.
    pub fn create_root(&mut self) -> Result<u64> {
        self.usable()?;
        let r = self.add_root(0);
        self.poison(r)
    }

    /// Creates the empty tree `id` (any id below [`ROOT_ID_LIMIT`]) unless it
    /// exists; true when it did. A namespace names its tree in its spec, so a
    /// restart finds it again.
    pub fn ensure_root(&mut self, id: u64) -> Result<bool> {
        self.usable()?;
        if id >= ROOT_ID_LIMIT {
            return Err(ThinError::RootId(id));
        }
        let r = (|| {
            if self.record(self.table, id)?.is_some() {
                return Ok(false);
            }
            let pages = self.table_need(id)?;
            self.room(0, pages)?;
            self.set_record(id, PRESENT)?;
            self.next_root = self.next_root.max(id + 1);
            Ok(true)
        })();
        self.poison(r)
    }

    /// Whether anything changed since the last commit.
    pub fn dirty(&self) -> bool {
        self.changed
    }

    /// True after an I/O error: every further call fails.
    pub fn failed(&self) -> bool {
        self.failed
    }

    /// A new root sharing everything `root` maps, numbered above every
    /// other (see [`Pool::snapshot_as`]).
    pub fn snapshot(&mut self, root: u64) -> Result<u64> {
        let id = self.next_root;
        self.snapshot_as(root, id)?;
        Ok(id)
    }

    /// Creates tree `id` sharing everything `live` maps: one more reference
    /// on its top page, whatever the size. The control plane names snapshot
    /// and clone trees, so an `id` that exists is refused
    /// ([`ThinError::RootExists`]), as is one not below [`ROOT_ID_LIMIT`].
    pub fn snapshot_as(&mut self, live: u64, id: u64) -> Result<()> {
        self.usable()?;
        if id >= ROOT_ID_LIMIT {
            return Err(ThinError::RootId(id));
        }
        let r = (|| {
            let top = self.top(live)?;
            if self.record(self.table, id)?.is_some() {
                return Err(ThinError::RootExists(id));
            }
            let pages = self.table_need(id)?;
            self.room(0, pages)?;
            self.set_record(id, PRESENT | top)?;
            if top != 0 {
                self.inc(self.page_idx(top));
            }
            self.next_root = self.next_root.max(id + 1);
            Ok(())
        })();
        self.poison(r)
    }

    /// Creates each `(live, snapshot)` tree by [`Pool::snapshot_as`] and,
    /// with `epoch` > 0, starts it sealing (T5; `epoch` 0: complete at
    /// once). A snapshot still sealing on the same live tree is accepted
    /// again (a retry). With `epoch` > 0 a live tree the pool does not hold
    /// is created empty first (its extent was never exported); with 0 it is
    /// [`ThinError::NoRoot`]. Everything else is checked before anything
    /// changes, and a failure part way (no room) deletes the trees this
    /// call made.
    pub fn begin_snapshots(&mut self, epoch: u32, trees: &[(u64, u64)]) -> Result<()> {
        self.usable()?;
        let mut staged: HashMap<u64, TreeEpochs> = HashMap::new();
        let mut new: Vec<(u64, u64)> = Vec::new();
        for &(live, snapshot) in trees {
            if snapshot >= ROOT_ID_LIMIT {
                return Err(ThinError::RootId(snapshot));
            }
            if epoch > 0 {
                // A live tree no namespace has exported yet holds nothing:
                // it is created empty, and so is its snapshot. A clone's
                // source (epoch 0) must exist.
                self.ensure_root(live)?;
            }
            self.top(live)?;
            let t = staged
                .entry(live)
                .or_insert_with(|| self.epochs.get(&live).cloned().unwrap_or_default());
            let exists = self.record(self.table, snapshot)?.is_some()
                || new.iter().any(|&(_, s)| s == snapshot);
            if exists && !(epoch > 0 && t.is_sealing(snapshot)) {
                return Err(ThinError::RootExists(snapshot));
            }
            if epoch > 0 && !t.begin(epoch, snapshot) {
                return Err(ThinError::EpochSealed { live, epoch });
            }
            if !exists {
                new.push((live, snapshot));
            }
        }
        for (k, &(live, snapshot)) in new.iter().enumerate() {
            if let Err(e) = self.snapshot_as(live, snapshot) {
                for &(_, made) in new[..k].iter().rev() {
                    // The delete reserve covers these; a failure here
                    // leaves a tree the control plane releases anyway.
                    let _ = self.delete_root(made);
                }
                return Err(e);
            }
        }
        for &(_, snapshot) in &new {
            self.sealed.remove(&snapshot);
        }
        if epoch > 0 {
            self.epochs.extend(staged);
        }
        Ok(())
    }

    /// Seals `snapshots` (T5): from now on a write to their live trees
    /// tagged at or below their epochs is refused. One sealed since the pool
    /// was opened is accepted again (a retry); one that is neither is
    /// [`ThinError::NotSealing`], and then nothing is sealed. A live tree's
    /// floor that rises is written to the root table (part of the next
    /// commit, so a reopened pool still refuses those writes); without room
    /// for its table pages, [`ThinError::NoSpace`] and nothing is sealed.
    pub fn seal(&mut self, snapshots: &[u64]) -> Result<()> {
        self.usable()?;
        if let Some(&s) = snapshots
            .iter()
            .find(|&&s| !self.sealed.contains(&s) && !self.epochs.values().any(|t| t.is_sealing(s)))
        {
            return Err(ThinError::NotSealing(s));
        }
        let mut staged = self.epochs.clone();
        let mut sealed = Vec::new();
        for &s in snapshots {
            for t in staged.values_mut() {
                if t.seal(s) {
                    sealed.push(s);
                }
            }
        }
        let mut raised: Vec<(u64, u32)> = staged
            .iter()
            .filter(|(id, t)| self.epochs.get(id).map_or(0, TreeEpochs::floor) != t.floor())
            .map(|(&id, t)| (id, t.floor()))
            .collect();
        raised.sort_unstable();
        let r = (|| {
            let keys: Vec<u64> = raised.iter().map(|&(id, _)| FLOOR_KEYS + id).collect();
            let pages = self.table_need_keys(&keys)?;
            self.room(0, pages)?;
            for &(id, floor) in &raised {
                self.set_record(FLOOR_KEYS + id, u64::from(floor))?;
                self.changed = true;
            }
            Ok(())
        })();
        self.poison(r)?;
        self.epochs = staged;
        self.sealed.extend(sealed);
        Ok(())
    }

    /// Rollback (T6): each `(live, snapshot)` makes `live` share everything
    /// `snapshot` maps (one more reference on its top page, whatever the
    /// size) and drops what `live` mapped, so the grains only it held are
    /// free after the next commit; `snapshot` is unchanged and `live`'s
    /// floor stays (epochs only grow). A `live` tree the pool does not hold
    /// is created. Pairs apply in order; a `live` already sharing
    /// `snapshot`'s top page is left as it is (a retry changes nothing).
    /// Checked before anything changes: an unknown `snapshot` is
    /// [`ThinError::NoRoot`], a `live` not below [`ROOT_ID_LIMIT`]
    /// [`ThinError::RootId`], a tree of the request that has a snapshot
    /// sealing or is one [`ThinError::Sealing`], and no room for the table
    /// pages [`ThinError::NoSpace`].
    pub fn rollback(&mut self, trees: &[(u64, u64)]) -> Result<()> {
        self.usable()?;
        for &(live, snapshot) in trees {
            if live >= ROOT_ID_LIMIT {
                return Err(ThinError::RootId(live));
            }
            self.top(snapshot)?;
        }
        for &(live, snapshot) in trees {
            for id in [live, snapshot] {
                if self.epochs.get(&id).is_some_and(TreeEpochs::has_sealing)
                    || self.epochs.values().any(|t| t.is_sealing(id))
                {
                    return Err(ThinError::Sealing(id));
                }
            }
        }
        let r = (|| {
            let keys: Vec<u64> = trees.iter().map(|&(live, _)| live).collect();
            let pages = self.table_need_keys(&keys)?;
            self.room(0, pages)?;
            for &(live, snapshot) in trees {
                let top = self.top(snapshot)?;
                let old = self.record(self.table, live)?;
                if old == Some(top) {
                    continue;
                }
                if top != 0 {
                    self.inc(self.page_idx(top));
                }
                self.set_record(live, PRESENT | top)?;
                self.changed = true;
                self.next_root = self.next_root.max(live + 1);
                if let Some(old) = old.filter(|&p| p != 0) {
                    self.drop_page(old, 0)?;
                }
            }
            Ok(())
        })();
        self.poison(r)
    }

    /// Makes tree `root` start as tree `base` (a copy job's destination,
    /// T7): [`Pool::rollback`] of `(root, base)`, so it shares everything
    /// `base` maps whatever the size, only while `root` maps no written
    /// sector (or shares `base`'s top page already: a retry). Otherwise
    /// [`ThinError::HoldsData`] and nothing changes. A `root` the pool does
    /// not hold is created; an unknown `base` is [`ThinError::NoRoot`].
    pub fn start_as(&mut self, root: u64, base: u64) -> Result<()> {
        self.usable()?;
        let want = self.top(base)?;
        match self.record(self.table, root)? {
            Some(top) if top == want => return Ok(()),
            Some(top) if self.maps_data(top)? => return Err(ThinError::HoldsData(root)),
            _ => {}
        }
        self.rollback(&[(root, base)])
    }

    /// Whether the tree whose top page is `top` maps any grain (a leaf
    /// entry is cleared when its written mask empties).
    fn maps_data(&mut self, top: u64) -> Result<bool> {
        for a in 0..ENTRIES_PER_PAGE {
            let mid = self.entry(top, a)?;
            if mid == 0 {
                continue;
            }
            for b in 0..ENTRIES_PER_PAGE {
                let leaf = self.entry(mid, b)?;
                if leaf == 0 {
                    continue;
                }
                self.load(leaf)?;
                if self.cache[&leaf].iter().any(|&e| e != 0) {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// The trees a write to `root` tagged `tag` (CDW2, T5; 0: untagged)
    /// lands in: `root`, then each snapshot of it still sealing at or above
    /// `tag`. [`ThinError::Fenced`] for a tag at or below a sealed epoch.
    pub fn route(&self, root: u64, tag: u32) -> Result<Vec<u64>> {
        let mut trees = vec![root];
        if let Some(t) = self.epochs.get(&root) {
            let also = t.route(tag).map_err(|f| ThinError::Fenced {
                root,
                tag: f.tag,
                floor: f.floor,
            })?;
            trees.extend(also);
        }
        Ok(trees)
    }

    /// Drops `root` and every page and grain only it reached. May use the
    /// delete reserve; fails with [`ThinError::NoSpace`] only when earlier
    /// deletes since the last commit used it up.
    pub fn delete_root(&mut self, root: u64) -> Result<()> {
        self.usable()?;
        let r = (|| {
            let top = self.top(root)?;
            let floor = self.floor(root)? != 0;
            let keys: &[u64] = if floor {
                &[root, FLOOR_KEYS + root]
            } else {
                &[root]
            };
            if self.table_need_keys(keys)? > self.free[PAGES] {
                return Err(ThinError::NoSpace);
            }
            self.clear_record(root)?;
            if floor {
                self.clear_record(FLOOR_KEYS + root)?;
            }
            self.changed = true;
            if top != 0 {
                self.drop_page(top, 0)?;
            }
            // No write goes to a deleted snapshot, and a deleted live tree's
            // boundaries go with it.
            self.epochs.remove(&root);
            for t in self.epochs.values_mut() {
                t.forget(root);
            }
            self.epochs.retain(|_, t| !t.is_empty());
            self.sealed.remove(&root);
            Ok(())
        })();
        self.poison(r)
    }

    pub fn read(&mut self, root: u64, off: u64, buf: &mut [u8]) -> Result<()> {
        self.usable()?;
        let top = self.top(root)?;
        for (gi, first, n, at) in self.spans(off, buf.len() as u64)? {
            let e = self.lookup(top, gi)?.entry;
            let out = &mut buf[at..at + (n * SECTOR_BYTES) as usize];
            for (k, sector) in out.chunks_exact_mut(SECTOR_BYTES as usize).enumerate() {
                let s = first + k as u64;
                if e & (1 << s) != 0 {
                    self.dev.read_at(sector, self.grain_off(e >> 16, s))?;
                } else {
                    sector.fill(0);
                }
            }
        }
        Ok(())
    }

    /// Writes whole 4 KiB sectors. Allocates before it changes anything, so
    /// [`ThinError::NoSpace`] leaves the pool as it was.
    pub fn write(&mut self, root: u64, off: u64, data: &[u8]) -> Result<()> {
        self.write_trees(&[root], off, data)
    }

    /// [`Pool::write`] of the same bytes to each of `roots` (a live tree and
    /// the snapshots a tagged write also lands in, [`Pool::route`]). Where a
    /// later tree mapped a grain exactly as the first did (the same grain,
    /// or none), it held the same bytes, so it takes one more reference on
    /// the first tree's new grain (T5: one new grain, two references); it
    /// writes a grain of its own elsewhere. All or nothing: the room checked
    /// first is each tree's need on the pool as it is, less the grains it
    /// shares (a bound: one tree's write only unshares what the next one
    /// would have copied).
    pub fn write_trees(&mut self, roots: &[u64], off: u64, data: &[u8]) -> Result<()> {
        self.usable()?;
        let spans = self.spans(off, data.len() as u64)?;
        let plan: Vec<_> = spans
            .iter()
            .map(|&(gi, f, n, _)| (gi, sector_bits(f, n)))
            .collect();
        let Some((&first, rest)) = roots.split_first() else {
            return Ok(());
        };
        let before = self.entries(first, &plan)?;
        let (mut grains, mut pages) = self.need(first, &plan, true)?;
        let mut alike = Vec::with_capacity(rest.len());
        for &root in rest {
            let same: Vec<bool> = self
                .entries(root, &plan)?
                .iter()
                .zip(&before)
                .map(|(a, b)| a == b)
                .collect();
            let (g, p) = self.need(root, &plan, true)?;
            // `need` counted a grain for each of these: unmapped, or
            // reached by both trees, so never written in place.
            grains += g.saturating_sub(same.iter().filter(|&&s| s).count() as u64);
            pages += p;
            alike.push(same);
        }
        self.room(grains, pages)?;
        let r = (|| {
            for &(gi, f, n, at) in &spans {
                self.write_grain(first, gi, f, &data[at..at + (n * SECTOR_BYTES) as usize])?;
            }
            for (&root, same) in rest.iter().zip(&alike) {
                for (&(gi, f, n, at), &same) in spans.iter().zip(same) {
                    if same {
                        self.share_grain(first, root, gi)?;
                    } else {
                        let bytes = &data[at..at + (n * SECTOR_BYTES) as usize];
                        self.write_grain(root, gi, f, bytes)?;
                    }
                }
            }
            Ok(())
        })();
        self.poison(r)
    }

    /// `root`'s leaf entries for `plan`'s grain indices.
    fn entries(&mut self, root: u64, plan: &[(u64, u64)]) -> Result<Vec<u64>> {
        let top = self.top(root)?;
        plan.iter()
            .map(|&(gi, _)| Ok(self.lookup(top, gi)?.entry))
            .collect()
    }

    /// Maps `to`'s grain index `gi` to `from`'s grain, one more reference,
    /// dropping `to`'s own.
    fn share_grain(&mut self, from: u64, to: u64, gi: u64) -> Result<()> {
        let top = self.top(from)?;
        let e = self.lookup(top, gi)?.entry;
        let (leaf, slot) = self.path_for_write(to, gi)?;
        let old = self.entry(leaf, slot)?;
        self.inc((e >> 16) as usize);
        if old != 0 {
            self.dec((old >> 16) as usize);
        }
        self.set(leaf, slot, e);
        Ok(())
    }

    /// Deallocate and Write Zeroes (T4): clears written bits; a grain whose
    /// mask empties loses this tree's reference.
    pub fn deallocate(&mut self, root: u64, off: u64, len: u64) -> Result<()> {
        self.deallocate_trees(&[root], off, len)
    }

    /// [`Pool::deallocate`] of each of `roots`, all or nothing as
    /// [`Pool::write_trees`].
    pub fn deallocate_trees(&mut self, roots: &[u64], off: u64, len: u64) -> Result<()> {
        self.usable()?;
        let plan: Vec<_> = self
            .spans(off, len)?
            .iter()
            .map(|&(gi, f, n, _)| (gi, sector_bits(f, n)))
            .collect();
        let mut pages = 0;
        for &root in roots {
            pages += self.need(root, &plan, false)?.1;
        }
        self.room(0, pages)?;
        let r = (|| {
            for &root in roots {
                self.deallocate_plan(root, &plan)?;
            }
            Ok(())
        })();
        self.poison(r)
    }

    /// Clears `plan`'s (grain index, sector bits) in `root`, the room
    /// checked already.
    fn deallocate_plan(&mut self, root: u64, plan: &[(u64, u64)]) -> Result<()> {
        for &(gi, bits) in plan {
            let top = self.top(root)?;
            let e = self.lookup(top, gi)?.entry;
            if e & bits == 0 {
                continue;
            }
            let (leaf, slot) = self.path_for_write(root, gi)?;
            let mask = e & MASK_BITS & !bits;
            if mask == 0 {
                self.dec((e >> 16) as usize);
                self.set(leaf, slot, 0);
            } else {
                self.set(leaf, slot, (e & !MASK_BITS) | mask);
            }
        }
        Ok(())
    }

    /// Makes everything so far durable: pages and space map, a flush, the
    /// other superblock, a flush (T3).
    pub fn commit(&mut self) -> Result<()> {
        self.usable()?;
        let r = self.commit_inner();
        self.poison(r)
    }

    fn commit_inner(&mut self) -> Result<()> {
        if !self.changed {
            return Ok(self.dev.flush()?);
        }
        let gen = self.generation + 1;
        let slot = gen % 2;
        let mut buf = vec![0u8; PAGE_BYTES as usize];
        for &p in &self.dirty {
            for (b, e) in buf.chunks_exact_mut(8).zip(self.cache[&p].iter()) {
                b.copy_from_slice(&e.to_le_bytes());
            }
            self.dev.write_at(&buf, p * PAGE_BYTES)?;
        }
        let per = PAGE_BYTES as usize / 2;
        for j in 0..self.layout.sm_pages as usize {
            if self.sm_changed[j] <= self.slot_written[slot as usize] {
                continue;
            }
            buf.fill(0);
            let counts = &self.counts[j * per..self.counts.len().min((j + 1) * per)];
            for (b, c) in buf.chunks_exact_mut(2).zip(counts) {
                b.copy_from_slice(&c.to_le_bytes());
            }
            self.dev
                .write_at(&buf, self.layout.sm_offset(slot, j as u64))?;
        }
        self.dev.flush()?;
        let sb = Superblock {
            version: format::VERSION,
            generation: gen,
            layout: self.layout,
            next_root: self.next_root,
            root_table: self.table,
        };
        self.dev.write_at(&sb.encode(), slot * PAGE_BYTES)?;
        self.dev.flush()?;
        self.generation = gen;
        self.slot_written[slot as usize] = gen;
        self.committed.clone_from(&self.counts);
        self.committed_table = self.table;
        self.dirty.clear();
        self.changed = false;
        self.recount_free();
        Ok(())
    }

    /// Recounts every reference from the root table down (its own pages
    /// included) and compares with the space map: a leak or a double use is
    /// [`ThinError::Corrupt`]. So is a floor in the table that is not the
    /// live tree's floor in memory, or one of a tree that does not exist.
    pub fn check(&mut self) -> Result<()> {
        let mut want = vec![0u32; self.counts.len()];
        let mut seen = HashSet::new();
        let mut floors: HashMap<u64, u64> = HashMap::new();
        let mut roots: HashSet<u64> = HashSet::new();
        // (page, whether it is a tree page, level in its tree or table, the
        // table key bits above the page)
        let mut stack: Vec<(u64, bool, usize, u64)> = Vec::new();
        if self.table != 0 {
            stack.push((self.table, false, 0, 0));
        }
        while let Some((p, tree, level, prefix)) = stack.pop() {
            if !self.layout.is_meta(p) {
                return Err(ThinError::Corrupt(format!(
                    "page {p} outside the metadata area"
                )));
            }
            want[self.page_idx(p)] += 1;
            if !seen.insert(p) {
                continue;
            }
            self.load(p)?;
            let bad = |e: u64| ThinError::Corrupt(format!("bad entry {e:#x} in page {p}"));
            let page = self.cache[&p].clone();
            for (slot, &e) in page.iter().enumerate().filter(|(_, e)| **e != 0) {
                let key = prefix << 9 | slot as u64;
                match (tree, level) {
                    (false, 0) if slot >= 2 * ROOT_TOP_SLOTS => return Err(bad(e)),
                    (false, l) if l + 1 < TABLE_LEVELS => stack.push((e, false, l + 1, key)),
                    (false, _) if key >= FLOOR_KEYS => {
                        if e > u64::from(u32::MAX) {
                            return Err(bad(e));
                        }
                        floors.insert(key - FLOOR_KEYS, e);
                    }
                    (false, _) if e & PRESENT == 0 => return Err(bad(e)),
                    (false, _) => {
                        roots.insert(key);
                        if e != PRESENT {
                            stack.push((e & !PRESENT, true, 0, 0));
                        }
                    }
                    (true, l) if l < 2 => stack.push((e, true, l + 1, 0)),
                    _ if e & MASK_BITS == 0 || e >> 16 >= self.layout.data_grains => {
                        return Err(bad(e))
                    }
                    _ => want[(e >> 16) as usize] += 1,
                }
            }
        }
        if let Some(id) = floors.keys().find(|id| !roots.contains(id)) {
            return Err(ThinError::Corrupt(format!(
                "a floor of tree {id}, which does not exist"
            )));
        }
        let held = |id: &u64| self.epochs.get(id).map_or(0, |t| u64::from(t.floor()));
        if let Some(id) = floors
            .keys()
            .chain(self.epochs.keys())
            .find(|id| floors.get(id).copied().unwrap_or(0) != held(id))
        {
            return Err(ThinError::Corrupt(format!(
                "tree {id}: floor {} stored, {} in memory",
                floors.get(id).copied().unwrap_or(0),
                held(id)
            )));
        }
        if let Some(i) = (0..want.len()).find(|&i| want[i] != u32::from(self.counts[i])) {
            return Err(ThinError::Corrupt(format!(
                "count {i}: space map {} but {} references",
                self.counts[i], want[i]
            )));
        }
        let kept = (self.free, self.allocated);
        self.recount_free();
        if kept != (self.free, self.allocated) {
            return Err(ThinError::Corrupt(format!(
                "free and allocated counters {kept:?}, recounted {:?}",
                (self.free, self.allocated)
            )));
        }
        Ok(())
    }

    fn usable(&self) -> Result<()> {
        if self.failed {
            return Err(ThinError::Failed);
        }
        Ok(())
    }

    fn poison<T>(&mut self, r: Result<T>) -> Result<T> {
        if matches!(r, Err(ThinError::Io(_))) {
            self.failed = true;
        }
        r
    }

    /// Whether `grains` and `pages` may be allocated now, keeping the delete
    /// reserve.
    fn room(&self, grains: u64, pages: u64) -> Result<()> {
        if grains > self.free[GRAINS] || (pages > 0 && pages + DELETE_RESERVE > self.free[PAGES]) {
            return Err(ThinError::NoSpace);
        }
        Ok(())
    }

    fn top(&mut self, root: u64) -> Result<u64> {
        self.record(self.table, root)?
            .ok_or(ThinError::NoRoot(root))
    }

    /// `id`'s record in the root table whose top page is `table`: its tree's
    /// top page (0: nothing written), or `None` for no such root.
    fn record(&mut self, table: u64, id: u64) -> Result<Option<u64>> {
        if id >= ROOT_ID_LIMIT {
            return Ok(None);
        }
        let e = self.table_entry(table, id)?;
        Ok((e & PRESENT != 0).then_some(e & !PRESENT))
    }

    /// The entry at `key` of the root table whose top page is `table` (0:
    /// none).
    fn table_entry(&mut self, table: u64, key: u64) -> Result<u64> {
        let mut e = table;
        for slot in table_slots(key) {
            e = self.entry(e, slot)?;
        }
        Ok(e)
    }

    /// Pages a change to `id`'s record allocates: every table page on its
    /// path that is missing or not writable.
    fn table_need(&mut self, id: u64) -> Result<u64> {
        self.table_need_keys(&[id])
    }

    /// Pages changes to the entries at `keys` allocate together: each table
    /// page on their paths that is missing or not writable, once however
    /// many paths pass through it.
    fn table_need_keys(&mut self, keys: &[u64]) -> Result<u64> {
        let mut seen: HashSet<(usize, u64)> = HashSet::new();
        let mut pages = 0;
        for &key in keys {
            let mut p = self.table;
            for (level, slot) in table_slots(key).into_iter().enumerate() {
                // The page at `level` is named by the key's bits above it.
                let at = key >> (9 * (TABLE_LEVELS - level));
                if seen.insert((level, at)) && !self.writable(p) {
                    pages += 1;
                }
                p = self.entry(p, slot)?;
            }
        }
        Ok(pages)
    }

    /// Shadows the root table's path to `id`; returns its pages, top first.
    fn table_path_for_write(&mut self, id: u64) -> Result<[u64; TABLE_LEVELS]> {
        let slots = table_slots(id);
        let mut path = [0; TABLE_LEVELS];
        let kind = |level| {
            if level + 1 < TABLE_LEVELS {
                Children::Pages
            } else if id >= FLOOR_KEYS {
                Children::Floors
            } else {
                Children::Roots
            }
        };
        self.table = self.shadow(self.table, kind(0))?;
        path[0] = self.table;
        for level in 1..TABLE_LEVELS {
            let parent = path[level - 1];
            let child = self.entry(parent, slots[level - 1])?;
            path[level] = self.shadow(child, kind(level))?;
            self.set(parent, slots[level - 1], path[level]);
        }
        Ok(path)
    }

    fn set_record(&mut self, id: u64, record: u64) -> Result<()> {
        let path = self.table_path_for_write(id)?;
        self.set(
            path[TABLE_LEVELS - 1],
            table_slots(id)[TABLE_LEVELS - 1],
            record,
        );
        Ok(())
    }

    /// Removes `id`'s record (its tree's reference is the caller's to drop)
    /// and frees the table pages it leaves empty.
    fn clear_record(&mut self, id: u64) -> Result<()> {
        let path = self.table_path_for_write(id)?;
        let slots = table_slots(id);
        self.set(path[TABLE_LEVELS - 1], slots[TABLE_LEVELS - 1], 0);
        for level in (0..TABLE_LEVELS).rev() {
            let p = path[level];
            if self.cache[&p].iter().any(|&e| e != 0) {
                break;
            }
            // Written in this transaction and held once: free at once.
            self.dec(self.page_idx(p));
            self.cache.remove(&p);
            self.dirty.remove(&p);
            if level == 0 {
                self.table = 0;
            } else {
                self.set(path[level - 1], slots[level - 1], 0);
            }
        }
        Ok(())
    }

    /// A new root `next_root` whose record names `top`.
    fn add_root(&mut self, top: u64) -> Result<u64> {
        let id = self.next_root;
        if id >= ROOT_ID_LIMIT {
            return Err(ThinError::RootId(id));
        }
        let pages = self.table_need(id)?;
        self.room(0, pages)?;
        self.set_record(id, PRESENT | top)?;
        self.next_root = id + 1;
        Ok(id)
    }

    /// `(grain index, first sector, sectors, offset in the buffer)` per grain
    /// the byte range touches.
    fn spans(&self, off: u64, len: u64) -> Result<Vec<(u64, u64, u64, usize)>> {
        let spg = self.layout.sectors_per_grain();
        let end = off.checked_add(len).ok_or(ThinError::Range)?;
        if !off.is_multiple_of(SECTOR_BYTES)
            || !len.is_multiple_of(SECTOR_BYTES)
            || end > GRAIN_INDEX_LIMIT * self.layout.grain_bytes
        {
            return Err(ThinError::Range);
        }
        let mut out = Vec::new();
        let (mut s, last) = (off / SECTOR_BYTES, end / SECTOR_BYTES);
        while s < last {
            let n = (spg - s % spg).min(last - s);
            out.push((
                s / spg,
                s % spg,
                n,
                ((s - off / SECTOR_BYTES) * SECTOR_BYTES) as usize,
            ));
            s += n;
        }
        Ok(out)
    }

    fn grain_off(&self, grain: u64, sector: u64) -> u64 {
        self.layout.data_start + grain * self.layout.grain_bytes + sector * SECTOR_BYTES
    }

    fn page_idx(&self, p: u64) -> usize {
        debug_assert!(
            p >= self.layout.meta_start && p < self.layout.meta_start + self.layout.meta_pages
        );
        (self.layout.data_grains + p - self.layout.meta_start) as usize
    }

    fn kind(&self, i: usize) -> usize {
        if (i as u64) < self.layout.data_grains {
            GRAINS
        } else {
            PAGES
        }
    }

    fn touch(&mut self, i: usize) {
        self.sm_changed[Layout::sm_page_of(i)] = self.generation + 1;
        self.changed = true;
    }

    fn inc(&mut self, i: usize) {
        let c = self.counts[i];
        // T2's overflow table past 65,535 references is not built yet.
        assert!(c < u16::MAX, "reference count {i} would overflow");
        if c == 0 && self.committed[i] == 0 {
            self.free[self.kind(i)] -= 1;
        }
        if c == 0 && self.kind(i) == GRAINS {
            self.allocated += 1;
        }
        self.counts[i] = c + 1;
        self.touch(i);
    }

    /// Drops one reference; true when it was the last.
    fn dec(&mut self, i: usize) -> bool {
        let c = self.counts[i];
        assert!(c > 0, "reference count {i} would go below zero");
        self.counts[i] = c - 1;
        if c == 1 && self.committed[i] == 0 {
            self.free[self.kind(i)] += 1;
        }
        if c == 1 && self.kind(i) == GRAINS {
            self.allocated -= 1;
        }
        self.touch(i);
        c == 1
    }

    /// Recounts `free` and `allocated` from the counts.
    fn recount_free(&mut self) {
        self.free = [0; 2];
        self.allocated = 0;
        for i in 0..self.counts.len() {
            if self.counts[i] == 0 && self.committed[i] == 0 {
                self.free[self.kind(i)] += 1;
            }
            if self.counts[i] > 0 && self.kind(i) == GRAINS {
                self.allocated += 1;
            }
        }
    }

    /// Takes a free grain (`GRAINS`) or page (`PAGES`) with one reference.
    /// The caller checked `free` first: running out here is a bug.
    fn alloc(&mut self, kind: usize) -> u64 {
        let (base, n) = match kind {
            GRAINS => (0, self.layout.data_grains),
            _ => (self.layout.data_grains, self.layout.meta_pages),
        };
        for k in 0..n {
            let at = (self.cursor[kind] + k) % n;
            let i = (base + at) as usize;
            if self.counts[i] == 0 && self.committed[i] == 0 {
                self.cursor[kind] = (at + 1) % n;
                self.inc(i);
                return if kind == GRAINS {
                    at
                } else {
                    self.layout.meta_start + at
                };
            }
        }
        panic!("allocation after the free check found nothing");
    }

    fn load(&mut self, p: u64) -> Result<()> {
        if !self.cache.contains_key(&p) {
            let mut buf = vec![0u8; PAGE_BYTES as usize];
            self.dev.read_at(&mut buf, p * PAGE_BYTES)?;
            let mut page = zero_page();
            for (e, b) in page.iter_mut().zip(buf.chunks_exact(8)) {
                *e = u64::from_le_bytes(b.try_into().expect("8 bytes"));
            }
            self.cache.insert(p, page);
        }
        Ok(())
    }

    fn entry(&mut self, p: u64, slot: usize) -> Result<u64> {
        if p == 0 {
            return Ok(0);
        }
        self.load(p)?;
        Ok(self.cache[&p][slot])
    }

    fn set(&mut self, p: u64, slot: usize, v: u64) {
        assert!(
            self.writable(p),
            "page {p} changed in place while shared or committed"
        );
        self.cache.get_mut(&p).expect("dirty page cached")[slot] = v;
    }

    /// This transaction allocated `p` and only one parent holds it.
    fn writable(&self, p: u64) -> bool {
        p != 0 && self.dirty.contains(&p) && self.counts[self.page_idx(p)] == 1
    }

    fn shared(&self, p: u64) -> bool {
        p != 0 && self.counts[self.page_idx(p)] > 1
    }

    /// An overwrite may go in place: `root` holds the grain alone now, and
    /// either the grain is new since the last commit or only `root`'s
    /// committed tree reached it (every page on that path held once: a count
    /// of 1 on the grain alone says nothing when pages above it are shared).
    /// So no committed root can see the bytes change.
    fn in_place(&mut self, root: u64, gi: u64, grain: u64) -> Result<bool> {
        let i = grain as usize;
        if self.counts[i] != 1 || self.committed[i] > 1 {
            return Ok(false);
        }
        if self.committed[i] == 0 {
            return Ok(true);
        }
        let Some(top) = self.record(self.committed_table, root)? else {
            return Ok(false);
        };
        let (a, b, c) = split(gi);
        let mut p = top;
        for slot in [a, b, c] {
            if p == 0 || self.committed[self.page_idx(p)] != 1 {
                return Ok(false);
            }
            p = self.entry(p, slot)?;
        }
        Ok(p >> 16 == grain && p & MASK_BITS != 0)
    }

    fn lookup(&mut self, top: u64, gi: u64) -> Result<Lookup> {
        let (a, b, c) = split(gi);
        let mid = self.entry(top, a)?;
        let leaf = self.entry(mid, b)?;
        let entry = self.entry(leaf, c)?;
        let shared_top = self.shared(top);
        let shared_mid = shared_top || self.shared(mid);
        let shared_leaf = shared_mid || self.shared(leaf);
        Ok(Lookup {
            top,
            mid,
            leaf,
            entry,
            shared: [shared_top, shared_mid, shared_leaf],
        })
    }

    /// Grains and pages a change to `plan` (grain index, sector bits) will
    /// allocate, mirroring `path_for_write` and `write_grain`: a page needs a
    /// copy when missing, not writable, or below a shared page (whose copy
    /// adds a reference to it). A deallocate only touches entries it clears.
    fn need(&mut self, root: u64, plan: &[(u64, u64)], write: bool) -> Result<(u64, u64)> {
        let top = self.top(root)?;
        let (mut grains, mut pages) = (0, 0);
        let mut seen: HashSet<(usize, u64)> = HashSet::new();
        for &(gi, bits) in plan {
            let l = self.lookup(top, gi)?;
            if !write && l.entry & bits == 0 {
                continue;
            }
            let nodes = [
                (0, 0, l.top, false),
                (1, gi >> 18, l.mid, l.shared[0]),
                (2, gi >> 9, l.leaf, l.shared[1]),
            ];
            for (level, key, p, below_shared) in nodes {
                if seen.insert((level, key)) && (below_shared || !self.writable(p)) {
                    pages += 1;
                }
            }
            if seen.insert((3, 0)) && !self.writable(top) {
                // A new top page changes the root's record.
                pages += self.table_need(root)?;
            }
            if write && (l.entry == 0 || l.shared[2] || !self.in_place(root, gi, l.entry >> 16)?) {
                grains += 1;
            }
        }
        Ok((grains, pages))
    }

    /// Makes `p` (0: none yet) writable for this transaction: returns it, or
    /// a new page holding its entries. Copying a shared page gives each
    /// child one more reference; copying a page held once moves them.
    fn shadow(&mut self, p: u64, children: Children) -> Result<u64> {
        if self.writable(p) {
            return Ok(p);
        }
        let page = if p == 0 {
            zero_page()
        } else {
            self.load(p)?;
            let page = self.cache[&p].clone();
            if self.shared(p) {
                for &e in page.iter().filter(|&&e| e != 0) {
                    match children {
                        Children::Pages => self.inc(self.page_idx(e)),
                        Children::Grains => self.inc((e >> 16) as usize),
                        Children::Roots if e != PRESENT => {
                            self.inc(self.page_idx(e & !PRESENT));
                        }
                        Children::Roots | Children::Floors => {}
                    }
                }
            }
            if self.dec(self.page_idx(p)) {
                self.cache.remove(&p);
            }
            page
        };
        let n = self.alloc(PAGES);
        self.cache.insert(n, page);
        self.dirty.insert(n);
        Ok(n)
    }

    /// Shadows the path from `root`'s top to the leaf for `gi`; returns the
    /// (writable) leaf and the entry's slot in it.
    fn path_for_write(&mut self, root: u64, gi: u64) -> Result<(u64, usize)> {
        let (a, b, c) = split(gi);
        let old = self.top(root)?;
        let top = self.shadow(old, Children::Pages)?;
        if top != old {
            self.set_record(root, PRESENT | top)?;
        }
        let mid = self.entry(top, a)?;
        let mid = self.shadow(mid, Children::Pages)?;
        self.set(top, a, mid);
        let leaf = self.entry(mid, b)?;
        let leaf = self.shadow(leaf, Children::Grains)?;
        self.set(mid, b, leaf);
        Ok((leaf, c))
    }

    fn write_grain(&mut self, root: u64, gi: u64, first: u64, data: &[u8]) -> Result<()> {
        let n = data.len() as u64 / SECTOR_BYTES;
        let bits = sector_bits(first, n);
        let (leaf, slot) = self.path_for_write(root, gi)?;
        let e = self.entry(leaf, slot)?;
        let (old, old_mask) = (e >> 16, e & MASK_BITS);
        let grain = if e != 0 && self.in_place(root, gi, old)? {
            old
        } else {
            let grain = self.alloc(GRAINS);
            if e != 0 {
                // Copy only what this write leaves of the old grain's bytes.
                let mut sector = vec![0u8; SECTOR_BYTES as usize];
                for s in (0..16).filter(|s| old_mask & !bits & (1 << s) != 0) {
                    self.dev.read_at(&mut sector, self.grain_off(old, s))?;
                    self.dev.write_at(&sector, self.grain_off(grain, s))?;
                }
                self.dec(old as usize);
            }
            grain
        };
        self.dev.write_at(data, self.grain_off(grain, first))?;
        self.set(leaf, slot, grain << 16 | old_mask | bits);
        Ok(())
    }

    /// Drops one reference to page `p` at `level`; the last one frees it and
    /// drops its children.
    fn drop_page(&mut self, p: u64, level: usize) -> Result<()> {
        if !self.dec(self.page_idx(p)) {
            return Ok(());
        }
        self.load(p)?;
        let page = self.cache.remove(&p).expect("loaded");
        self.dirty.remove(&p);
        for &e in page.iter().filter(|&&e| e != 0) {
            if level == 2 {
                self.dec((e >> 16) as usize);
            } else {
                self.drop_page(e, level + 1)?;
            }
        }
        Ok(())
    }
}

struct Lookup {
    top: u64,
    mid: u64,
    leaf: u64,
    entry: u64,
    /// Whether the top, middle or leaf page, or one above it, is shared.
    shared: [bool; 3],
}
