//! The grain pool's bytes on the device (T2): where each area sits and the
//! superblock that names a committed transaction.
//!
//! ```text
//! page 0, 1      superblocks; generation G lives in page G % 2
//! sm slot 0, 1   space map (u16 per data grain, then per metadata page);
//!                generation G's counts live in slot G % 2
//! metadata       4 KiB pages of the trees and of the root table, never
//!                written while a committed transaction can still reach them
//! data           grains, aligned to the grain size
//! ```
//!
//! The superblock names the root table's top page: the table is a radix tree
//! of metadata pages like the trees (mod.rs), so the number of roots is not
//! bounded by the superblock.
//!
//! Versions: 4 adds, in the same root table, a live tree's *sealed floor*
//! (T5): the entry at key 2^32 + id holds tree `id`'s highest sealed epoch
//! (a u32 above 0, no reference to anything); ids use keys below 2^32, so
//! the two never meet, and the floors are shadowed and committed with the
//! pages like every table entry. Version 3 is the same bytes without floor
//! keys: it is read (every floor 0), and its next commit writes version 4,
//! which code before version 4 does not read.
//!
//! Everything is little-endian. Only the superblock carries a checksum: the
//! pages and the space map slot it names were flushed before it was written,
//! so a superblock that checks out names bytes that are all on the device.

pub const PAGE_BYTES: u64 = 4096;
/// The unit of the written mask: one bit per 4 KiB of a grain.
pub const SECTOR_BYTES: u64 = 4096;
pub const ENTRIES_PER_PAGE: usize = 512;
/// 16 bits of written mask cap a grain at 16 sectors.
pub const GRAIN_BYTES_ALLOWED: [u64; 3] = [16 << 10, 32 << 10, 64 << 10];
/// Grain pools are format version 4 (T2, with T5's floors); version 1 is
/// fixed extents. Version 2 kept at most 250 roots in the superblock;
/// nothing ever used it, so a version-2 pool is not read (no compatibility
/// kept on purpose). Version 3 has no floors and is read as version 4.
pub const VERSION: u32 = 4;
/// The versions [`Superblock::decode`] reads.
const VERSIONS_READ: [u32; 2] = [3, VERSION];
const MAGIC: u64 = u64::from_le_bytes(*b"NVPTHIN\0");
const COUNTS_PER_SM_PAGE: u64 = PAGE_BYTES / 2;

/// Where the areas sit, fixed at format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub grain_bytes: u64,
    pub data_grains: u64,
    pub meta_pages: u64,
    /// First page of space map slot 0; slot 1 follows it.
    pub sm_start: u64,
    pub sm_pages: u64,
    /// Device page number of the first metadata page (never 0, so a page
    /// number of 0 in a tree means "no page").
    pub meta_start: u64,
    pub data_start: u64,
}

impl Layout {
    /// The largest pool that fits `size` bytes. Without `meta_pages`, one
    /// metadata page per 64 grains: a full tree's leaves and the copies
    /// snapshots cause, at 0.1 % of a 64 KiB-grain device; plus 32, so even
    /// a small pool holds a tree's and the root table's paths twice (the
    /// committed ones and their copies) and the delete reserve.
    pub fn compute(size: u64, grain_bytes: u64, meta_pages: Option<u64>) -> Option<Layout> {
        if !GRAIN_BYTES_ALLOWED.contains(&grain_bytes) {
            return None;
        }
        let mut data_grains = size / grain_bytes;
        while data_grains > 0 {
            let meta = meta_pages.unwrap_or(data_grains / 64 + 32);
            let sm_pages = (data_grains + meta).div_ceil(COUNTS_PER_SM_PAGE);
            let meta_start = 2 + 2 * sm_pages;
            let data_start = ((meta_start + meta) * PAGE_BYTES).next_multiple_of(grain_bytes);
            let end = data_start + data_grains * grain_bytes;
            if end <= size {
                return Some(Layout {
                    grain_bytes,
                    data_grains,
                    meta_pages: meta,
                    sm_start: 2,
                    sm_pages,
                    meta_start,
                    data_start,
                });
            }
            let short = (end - size).div_ceil(grain_bytes);
            data_grains = data_grains.saturating_sub(short.max(1));
        }
        None
    }

    pub fn sectors_per_grain(&self) -> u64 {
        self.grain_bytes / SECTOR_BYTES
    }

    /// Number of space map counts: data grains first, then metadata pages.
    pub fn counts(&self) -> usize {
        (self.data_grains + self.meta_pages) as usize
    }

    pub fn sm_page_of(count: usize) -> usize {
        count / COUNTS_PER_SM_PAGE as usize
    }

    /// Byte offset of space map page `j` in `slot`.
    pub fn sm_offset(&self, slot: u64, j: u64) -> u64 {
        (self.sm_start + slot * self.sm_pages + j) * PAGE_BYTES
    }

    fn end(&self) -> u64 {
        self.data_start + self.data_grains * self.grain_bytes
    }

    /// Whether device page `p` is in the metadata area.
    pub fn is_meta(&self, p: u64) -> bool {
        p >= self.meta_start && p - self.meta_start < self.meta_pages
    }
}

/// One committed transaction: its generation, the layout, and its roots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// [`VERSION`] when written; as read when decoded.
    pub version: u32,
    pub generation: u64,
    pub layout: Layout,
    pub next_root: u64,
    /// Top page of the root table (0: no roots).
    pub root_table: u64,
}

fn put(page: &mut [u8], at: usize, v: u64) {
    page[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn get(page: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(page[at..at + 8].try_into().expect("8 bytes"))
}

impl Superblock {
    pub fn encode(&self) -> Vec<u8> {
        let mut p = vec![0u8; PAGE_BYTES as usize];
        let l = &self.layout;
        put(&mut p, 0, MAGIC);
        p[8..12].copy_from_slice(&self.version.to_le_bytes());
        put(&mut p, 16, self.generation);
        put(&mut p, 24, l.grain_bytes);
        put(&mut p, 32, l.data_grains);
        put(&mut p, 40, l.meta_pages);
        put(&mut p, 48, l.sm_start);
        put(&mut p, 56, l.sm_pages);
        put(&mut p, 64, l.meta_start);
        put(&mut p, 72, l.data_start);
        put(&mut p, 80, self.next_root);
        put(&mut p, 88, self.root_table);
        let crc = nvpool_wire::digest::crc32c(&p);
        p[12..16].copy_from_slice(&crc.to_le_bytes());
        p
    }

    /// `None` for anything but an intact version-3 or -4 superblock that fits a
    /// device of `size` bytes: a torn or never-written one loses to the other.
    pub fn decode(page: &[u8], size: u64) -> Option<Superblock> {
        if page.len() != PAGE_BYTES as usize || get(page, 0) != MAGIC {
            return None;
        }
        let mut p = page.to_vec();
        let crc = u32::from_le_bytes(p[12..16].try_into().expect("4 bytes"));
        p[12..16].fill(0);
        let version = u32::from_le_bytes(p[8..12].try_into().expect("4 bytes"));
        if nvpool_wire::digest::crc32c(&p) != crc || !VERSIONS_READ.contains(&version) {
            return None;
        }
        let layout = Layout {
            grain_bytes: get(&p, 24),
            data_grains: get(&p, 32),
            meta_pages: get(&p, 40),
            sm_start: get(&p, 48),
            sm_pages: get(&p, 56),
            meta_start: get(&p, 64),
            data_start: get(&p, 72),
        };
        let root_table = get(&p, 88);
        if layout.end() > size
            || !GRAIN_BYTES_ALLOWED.contains(&layout.grain_bytes)
            || (root_table != 0 && !layout.is_meta(root_table))
        {
            return None;
        }
        Some(Superblock {
            version,
            generation: get(&p, 16),
            layout,
            next_root: get(&p, 80),
            root_table,
        })
    }
}
