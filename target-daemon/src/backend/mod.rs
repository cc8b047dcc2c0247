//! Namespace backends: where a namespace's bytes live.
//!
//! One trait, [`Backend`], and five implementations: [`FileBackend`]
//! (a block device or regular file, or an extent of one, opened with
//! O_DIRECT when the filesystem allows it), [`ThinBackend`] (one tree of a
//! grain pool on a device, allocated on first write), [`RamBackend`] (tests
//! and benchmarks), [`FaultBackend`] (wraps another and injects latency,
//! EIO and torn writes for tests) and [`VolumeBackend`] (a pooled volume,
//! run by the initiator's volume engine inside the target).
//!
//! The reactor runs a backend's I/O in one of three ways:
//!
//! - *io_uring*: a backend that returns [`UringTarget`] from
//!   [`Backend::uring_target`] hands the reactor a file descriptor and the
//!   byte offset of the namespace within that file;
//! - *asynchronous*: a backend whose [`Backend::is_async`] is true takes
//!   each operation through [`Backend::submit`] and completes it on threads
//!   of its own, through the reactor's [`CompletionSink`] (async_io.rs);
//! - *synchronous*: otherwise, on the reactor thread. Every backend
//!   implements the synchronous calls, used where io_uring is unavailable,
//!   by backends that have no file descriptor, and off the reactor (the
//!   flush at shutdown).
//!
//! Offsets and lengths given to a backend are namespace-relative and already
//! range-checked by the caller; a backend asserts them, it does not
//! re-validate them.

mod async_io;
mod fault;
mod file;
mod ram;
pub mod thin;
mod volume;

pub use async_io::{AsyncCompletion, AsyncDone, AsyncOp, AsyncResult, CompletionSink};
pub use fault::{FaultBackend, FaultConfig};
pub use file::FileBackend;
pub use ram::RamBackend;
pub use thin::ThinBackend;
pub use volume::{OpenedVolume, VolumeBackend, VolumeContext, VolumeSource};

use nvpool_api::size::parse_size;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

/// What the reactor needs to drive a backend through io_uring.
#[derive(Debug, Clone, Copy)]
pub struct UringTarget {
    pub fd: RawFd,
    /// Byte offset of the namespace inside the file or device.
    pub base: u64,
}

/// Which file or block device a backend's bytes live in: equal for every
/// open of the same file or device, whatever path named it. Block devices
/// compare by device number (two device nodes of one disk are one disk),
/// other files by filesystem and inode.
///
/// A tree of a grain pool is its own space ([`FileId::Tree`]): its bytes
/// move between the pool's grains, so what names them for the copy guards
/// is the tree, never a range of the pool's file. Two trees never share a
/// `FileId`, and no `file:` extent equals one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileId {
    Inode {
        dev: u64,
        ino: u64,
    },
    BlockDevice {
        rdev: u64,
    },
    /// Tree `root` of the grain pool on the file `pool`.
    Tree {
        pool: PoolFile,
        root: u64,
    },
}

/// The file a grain pool lives on, as [`FileId`] names a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolFile {
    Inode { dev: u64, ino: u64 },
    BlockDevice { rdev: u64 },
}

impl FileId {
    pub fn of(meta: &std::fs::Metadata) -> FileId {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        if meta.file_type().is_block_device() {
            FileId::BlockDevice { rdev: meta.rdev() }
        } else {
            FileId::Inode {
                dev: meta.dev(),
                ino: meta.ino(),
            }
        }
    }

    /// Tree `root` of the grain pool on this file; None when `self` is a
    /// tree already (a pool lives on a file).
    pub fn tree(self, root: u64) -> Option<FileId> {
        let pool = match self {
            FileId::Inode { dev, ino } => PoolFile::Inode { dev, ino },
            FileId::BlockDevice { rdev } => PoolFile::BlockDevice { rdev },
            FileId::Tree { .. } => return None,
        };
        Some(FileId::Tree { pool, root })
    }
}

/// Where a namespace's bytes are: namespace byte `o` is byte `base + o` of
/// `file`, for `o < len` (of the tree, for a [`FileId::Tree`], whose `base`
/// is 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceExtent {
    pub file: FileId,
    pub base: u64,
    pub len: u64,
}

/// Storage behind one namespace.
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Capacity in bytes (a multiple of the block size).
    fn size(&self) -> u64;
    /// The logical block size the namespace should advertise.
    fn block_size(&self) -> u32;
    /// A short human description ("file /dev/sdb [0, 1 GiB)").
    fn describe(&self) -> String;

    /// The descriptor the reactor may submit io_uring reads, writes,
    /// fdatasyncs and fallocates (Write Zeroes, deallocate) to. The
    /// synchronous calls then serve only where there is no ring.
    fn uring_target(&self) -> Option<UringTarget> {
        None
    }

    /// The file range this backend's bytes occupy (for a grain pool's
    /// tree, the whole tree: [`FileId::Tree`]); None for storage no other
    /// backend can share (RAM). Host writes are matched against the copy
    /// guards by it (copier.rs).
    fn device_extent(&self) -> Option<DeviceExtent> {
        None
    }

    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()>;
    /// Writes `buf` at `off`; with `fua` the data is durable on return.
    fn write_at(&self, buf: &[u8], off: u64, fua: bool) -> io::Result<()>;
    /// Makes every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// Zeroes a range (reads return zeroes afterwards).
    fn write_zeroes(&self, off: u64, len: u64) -> io::Result<()>;
    /// Deallocates a range; reads of it return zeroes afterwards.
    fn discard(&self, off: u64, len: u64) -> io::Result<()>;

    /// True once a write or flush failed: the backend's durable state is
    /// unknown and every further I/O must fail (no silent fsync retries).
    fn failed(&self) -> bool;
    /// Records that a write or flush issued through io_uring failed.
    fn mark_failed(&self);

    /// Makes the backend ready to serve I/O (a volume namespace opens its
    /// volume). Local backends are always ready.
    fn activate(&self) -> std::io::Result<()> {
        Ok(())
    }

    /// Stops serving I/O: new operations fail, operations in flight finish
    /// first (a volume namespace then closes its volume).
    fn deactivate(&self) {}

    /// True for a backend that completes I/O on threads of its own: the
    /// reactor then hands it every operation through [`Backend::submit`]
    /// and never calls the synchronous methods.
    fn is_async(&self) -> bool {
        false
    }

    /// Starts `op`; `done` is completed exactly once, from any thread (on
    /// this one too, at once, when the backend refuses the operation). Only
    /// called when [`Backend::is_async`] is true. It must not block: the
    /// caller is a reactor thread. The backend's own errors are reported
    /// through the result; whether one makes it [`Backend::failed`] is the
    /// backend's decision (the reactor does not mark it).
    fn submit(&self, op: AsyncOp, done: AsyncDone) {
        drop(op);
        done.complete(Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP)));
    }

    /// [`Backend::submit`] of a Write, Write Zeroes or deallocate with the
    /// write epoch its command carried in CDW2 (0: untagged;
    /// design/thin-snapshots.md T5). Only a grain pool's trees have
    /// snapshots to route it to; the others ignore it. A refused epoch
    /// fails with EBADE, which the queue answers with Reservation Conflict.
    fn submit_tagged(&self, op: AsyncOp, epoch: u32, done: AsyncDone) {
        let _ = epoch;
        self.submit(op, done);
    }
}

/// A parsed backend specification, as written in configs and on the CLI:
///
/// - `file:PATH[,offset=BYTES][,length=BYTES][,block_size=512|4096]`
/// - `ram:SIZE[,block_size=…]` (SIZE like `1G`, `512M`, `4096`)
/// - `thin:PATH,root=N,size=BYTES[,block_size=4096]`: tree N (from 1) of
///   the grain pool formatted on PATH, created empty on first open; thin
///   namespaces have 4096-byte blocks
/// - `thin:PATH[,grain=16K|32K|64K]`: the grain pool itself, offered as a
///   device (`--device ID=thin:PATH`, register.rs), never a namespace
/// - `volume:UUID,size=BYTES,block_size=512|4096`: a pooled volume, served
///   by the volume engine inside the target once activated; size and block
///   size are given so the namespace has its geometry while inactive
/// - `fault:SPEC` wrapping another (faults are set by tests through the API)
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendSpec {
    File {
        path: String,
        offset: u64,
        length: Option<u64>,
        block_size: Option<u32>,
    },
    Ram {
        size: u64,
        block_size: Option<u32>,
    },
    Thin {
        path: String,
        root: u64,
        size: u64,
    },
    /// A grain pool as a device; `grain_bytes` is what a blank device is
    /// formatted with, and what a formatted one must have when given.
    GrainPool {
        path: String,
        grain_bytes: Option<u64>,
    },
    Volume {
        /// Lower-case, hyphenated.
        uuid: String,
        size: u64,
        block_size: u32,
    },
}

/// Why a backend could not be opened or its spec parsed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("invalid backend spec {spec:?}: {reason}")]
    Spec { spec: String, reason: String },
    #[error("cannot open {path}")]
    Open {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("{path}: {reason}")]
    Geometry { path: String, reason: String },
    /// A tree to release is a namespace's (design T1): the control plane
    /// removes the namespace first.
    #[error("{path}: tree {root} is open as a namespace")]
    RootInUse { path: String, root: u64 },
}

/// Largest RAM namespace: RAM is for tests and benchmarks, not for data.
pub const RAM_SIZE_MAX_BYTES: u64 = 64 << 30;

impl BackendSpec {
    pub fn parse(spec: &str) -> Result<BackendSpec, BackendError> {
        let err = |reason: &str| BackendError::Spec {
            spec: spec.to_owned(),
            reason: reason.to_owned(),
        };
        let (kind, rest) = spec.split_once(':').ok_or_else(|| {
            err("expected KIND:ARGS (file:PATH, ram:SIZE, thin:PATH or volume:UUID)")
        })?;
        let mut parts = rest.split(',');
        let first = parts.next().unwrap_or_default();
        if first.is_empty() {
            return Err(err("missing path, size or UUID"));
        }
        let (mut offset, mut length, mut block_size, mut size) = (0u64, None, None, None);
        let (mut root, mut grain) = (None, None);
        for p in parts {
            let (k, v) = p
                .split_once('=')
                .ok_or_else(|| err("options are key=value"))?;
            match k {
                "offset" => offset = parse_size(v).map_err(|e| err(&e))?,
                "length" => length = Some(parse_size(v).map_err(|e| err(&e))?),
                "size" => size = Some(parse_size(v).map_err(|e| err(&e))?),
                "root" => {
                    let r: u64 = v.parse().map_err(|_| err("root must be a number"))?;
                    // Tree 0 is the control plane's extent at offset 0.
                    if r >= thin::ROOT_ID_LIMIT {
                        return Err(err("trees are numbered below 2^32"));
                    }
                    root = Some(r);
                }
                "grain" => {
                    let g = parse_size(v).map_err(|e| err(&e))?;
                    if !thin::GRAIN_BYTES_ALLOWED.contains(&g) {
                        return Err(err("grain must be 16K, 32K or 64K"));
                    }
                    grain = Some(g);
                }
                "block_size" => {
                    let b: u32 = v
                        .parse()
                        .map_err(|_| err("block_size must be 512 or 4096"))?;
                    if b != 512 && b != 4096 {
                        return Err(err("block_size must be 512 or 4096"));
                    }
                    block_size = Some(b);
                }
                _ => return Err(err(&format!("unknown option {k:?}"))),
            }
        }
        if size.is_some() && kind != "volume" && kind != "thin" {
            return Err(err("size= is an option of volume and thin only"));
        }
        if (root.is_some() || grain.is_some()) && kind != "thin" {
            return Err(err("root= and grain= are options of thin only"));
        }
        match kind {
            "file" => Ok(BackendSpec::File {
                path: first.to_owned(),
                offset,
                length,
                block_size,
            }),
            "ram" => {
                if offset != 0 || length.is_some() {
                    return Err(err("ram takes only a size and block_size"));
                }
                let size = parse_size(first).map_err(|e| err(&e))?;
                if size == 0 || size > RAM_SIZE_MAX_BYTES {
                    return Err(err("ram size must be between 1 byte and 64 GiB"));
                }
                Ok(BackendSpec::Ram { size, block_size })
            }
            "volume" => {
                if offset != 0 || length.is_some() {
                    return Err(err("volume takes only a UUID, size and block_size"));
                }
                let uuid = nvpool_wire::nqn::parse_uuid(first).ok_or_else(|| {
                    err("volume needs a UUID (xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")
                })?;
                let (Some(size), Some(block_size)) = (size, block_size) else {
                    return Err(err("volume needs size= and block_size="));
                };
                if size == 0 || !size.is_multiple_of(u64::from(block_size)) {
                    return Err(err("volume size must be a positive multiple of block_size"));
                }
                Ok(BackendSpec::Volume {
                    uuid: nvpool_wire::nqn::format_uuid(&uuid),
                    size,
                    block_size,
                })
            }
            "thin" => {
                if offset != 0 || length.is_some() {
                    return Err(err("thin takes only a path, root, size and block_size"));
                }
                let (root, size) = match (root, size) {
                    (Some(root), Some(size)) => (root, size),
                    (None, None) if block_size.is_none() => {
                        return Ok(BackendSpec::GrainPool {
                            path: first.to_owned(),
                            grain_bytes: grain,
                        })
                    }
                    _ => {
                        return Err(err(
                            "thin needs root= and size= (a tree), or neither (a grain pool)",
                        ))
                    }
                };
                if grain.is_some() {
                    return Err(err(
                        "grain= is fixed when the pool is formatted: give it on the device",
                    ));
                }
                if block_size.is_some_and(|b| b != thin::THIN_BLOCK_BYTES) {
                    return Err(err("thin namespaces have 4096-byte blocks"));
                }
                Ok(BackendSpec::Thin {
                    path: first.to_owned(),
                    root,
                    size,
                })
            }
            _ => Err(err("kind must be file, ram, thin or volume")),
        }
    }

    /// Opens the backend this spec names. A volume namespace needs its
    /// target's [`VolumeContext`]: open it with [`BackendSpec::open_in`].
    pub fn open(&self) -> Result<Arc<dyn Backend>, BackendError> {
        if let BackendSpec::Volume { uuid, .. } = self {
            return Err(BackendError::Spec {
                spec: format!("volume:{uuid}"),
                reason: "a volume namespace is opened by its target".into(),
            });
        }
        self.open_in(&VolumeContext::new())
    }

    /// Opens the backend this spec names; a volume namespace takes its
    /// volume source and executor from `volumes` when it is activated.
    pub fn open_in(&self, volumes: &Arc<VolumeContext>) -> Result<Arc<dyn Backend>, BackendError> {
        Ok(match self {
            BackendSpec::File {
                path,
                offset,
                length,
                block_size,
            } => Arc::new(FileBackend::open(path, *offset, *length, *block_size)?),
            BackendSpec::Ram { size, block_size } => {
                let bs = block_size.unwrap_or(512);
                Arc::new(RamBackend::new(size / bs as u64 * bs as u64, bs))
            }
            BackendSpec::Thin { path, root, size } => Arc::new(thin::open(path, *root, *size)?),
            BackendSpec::GrainPool { path, .. } => {
                return Err(BackendError::Spec {
                    spec: format!("thin:{path}"),
                    reason: "a grain pool is a device (--device ID=thin:PATH); a namespace \
                             serves one tree of it (thin:PATH,root=N,size=BYTES)"
                        .into(),
                })
            }
            BackendSpec::Volume {
                uuid,
                size,
                block_size,
            } => Arc::new(VolumeBackend::new(
                uuid.clone(),
                *size,
                *block_size,
                volumes.clone(),
            )),
        })
    }
}

/// A buffer aligned for O_DIRECT, owned by the caller until its I/O completes.
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    cap: usize,
}

/// O_DIRECT wants buffers aligned to the logical block size; a page covers
/// every device nvpool accepts.
pub const BUF_ALIGN_BYTES: usize = 4096;

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub fn new(cap: usize) -> AlignedBuf {
        let cap = cap.max(BUF_ALIGN_BYTES).next_multiple_of(BUF_ALIGN_BYTES);
        let layout =
            std::alloc::Layout::from_size_align(cap, BUF_ALIGN_BYTES).expect("valid layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, cap }
    }
    pub fn capacity(&self) -> usize {
        self.cap
    }
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    pub fn as_slice(&self, len: usize) -> &[u8] {
        assert!(len <= self.cap);
        // SAFETY: ptr is valid for cap initialised bytes and we hold &self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), len) }
    }
    pub fn as_mut_slice(&mut self, len: usize) -> &mut [u8] {
        assert!(len <= self.cap);
        // SAFETY: ptr is valid for cap initialised bytes and we hold &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout =
            std::alloc::Layout::from_size_align(self.cap, BUF_ALIGN_BYTES).expect("valid layout");
        // SAFETY: allocated in new() with this very layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("2T").unwrap(), 2 << 40);
        assert!(parse_size("1X").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn specs() {
        assert_eq!(
            BackendSpec::parse("file:/dev/sdb,offset=1G,length=2G").unwrap(),
            BackendSpec::File {
                path: "/dev/sdb".into(),
                offset: 1 << 30,
                length: Some(2 << 30),
                block_size: None
            }
        );
        assert_eq!(
            BackendSpec::parse("ram:64M").unwrap(),
            BackendSpec::Ram {
                size: 64 << 20,
                block_size: None
            }
        );
        assert_eq!(
            BackendSpec::parse(
                "volume:0A0B0C0D-0000-4000-8000-00000000000F,size=1G,block_size=4096"
            )
            .unwrap(),
            BackendSpec::Volume {
                uuid: "0a0b0c0d-0000-4000-8000-00000000000f".into(),
                size: 1 << 30,
                block_size: 4096
            }
        );
        assert_eq!(
            BackendSpec::parse("thin:/dev/sdb,root=3,size=1T,block_size=4096").unwrap(),
            BackendSpec::Thin {
                path: "/dev/sdb".into(),
                root: 3,
                size: 1 << 40
            }
        );
        assert_eq!(
            BackendSpec::parse("thin:/dev/sdb,grain=32K").unwrap(),
            BackendSpec::GrainPool {
                path: "/dev/sdb".into(),
                grain_bytes: Some(32 << 10)
            }
        );
        assert_eq!(
            BackendSpec::parse("thin:/dev/sdb").unwrap(),
            BackendSpec::GrainPool {
                path: "/dev/sdb".into(),
                grain_bytes: None
            }
        );
        assert!(
            BackendSpec::parse(
                "volume:0a0b0c0d-0000-4000-8000-00000000000f,size=1G,block_size=4096"
            )
            .unwrap()
            .open()
            .is_err(),
            "a volume namespace is opened by its target"
        );
        let e = BackendSpec::parse("thin:/dev/sdb")
            .unwrap()
            .open()
            .unwrap_err()
            .to_string();
        assert!(e.contains("a grain pool is a device"), "{e}");
        for bad in [
            "",
            "file:",
            "ram:0",
            "ram:1G,size=1G",
            "volume:not-a-uuid,size=1G,block_size=4096",
            "volume:0a0b0c0d-0000-4000-8000-00000000000f,size=1G",
            "volume:0a0b0c0d-0000-4000-8000-00000000000f,block_size=512",
            "volume:0a0b0c0d-0000-4000-8000-00000000000f,size=1000,block_size=512",
            "volume:0a0b0c0d-0000-4000-8000-00000000000f,size=1G,block_size=512,offset=4096",
            "disk:/x",
            "ram:1G,offset=5",
            "file:/x,block_size=1000",
            "file:/x,foo=1",
            "thin:/x,size=1G",
            "thin:/x,root=1",
            "thin:/x,root=4294967296,size=1G",
            "thin:/x,root=1,size=1G,block_size=512",
            "thin:/x,root=1,size=1G,offset=4096",
            "file:/x,root=1",
            "thin:/x,grain=8K",
            "thin:/x,grain=64K,root=1,size=1G",
            "thin:/x,block_size=4096",
            "file:/x,grain=64K",
        ] {
            assert!(BackendSpec::parse(bad).is_err(), "{bad}");
        }
    }
}
