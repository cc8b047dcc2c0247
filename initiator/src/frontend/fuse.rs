//! The FUSE front-end: a filesystem holding exactly one regular file whose
//! bytes are the volume, and [`FuseLoop`], that file behind a loop device.
//!
//! ```text
//!  /dev/loopN (direct I/O, logical block = volume block)
//!      │ read_iter / write_iter / fallocate / fsync on the file
//!  MOUNTPOINT/volume  (FUSE, FOPEN_DIRECT_IO: no page cache)
//!      │ /dev/fuse, one cloned fd per session thread
//!  FuseFs ── exec::Executor ── Arc<dyn BlockDev>
//! ```
//!
//! Session threads only parse requests and hand them (with their `Reply`
//! objects) to the executor; replies are sent from whichever thread
//! completes the I/O. Mapping:
//!
//! | FUSE | BlockDev |
//! |---|---|
//! | READ / WRITE (any range) | read / write, read-modify-write at unaligned edges; FUA when the file was opened `O_SYNC`/`O_DSYNC` |
//! | FSYNC, FLUSH | flush |
//! | FALLOCATE `ZERO_RANGE` | write_zeroes, no unmap |
//! | FALLOCATE `PUNCH_HOLE\|KEEP_SIZE` | write_zeroes, unmap allowed |
//! | FALLOCATE 0 / `KEEP_SIZE` | nothing (every byte is allocated) |
//!
//! Punching a hole must leave zeroes (a file's holes read as zeroes), and
//! the loop driver sends both discards and unmapping Write Zeroes as
//! `PUNCH_HOLE`, so a punch becomes Write Zeroes with deallocation allowed,
//! never a bare discard whose contents would be unspecified.
//!
//! # When the device grows
//!
//! The file's size is the device's whenever the kernel asks (GETATTR,
//! LOOKUP), but the kernel caches it for a minute (`FUSE_ATTR_TTL`), and the
//! loop device keeps the size it computed when it was bound.
//! [`FuseLoop::resize`] (after the device grew: a volume grown online)
//! tells the kernel to drop the file's cached attributes
//! (`FUSE_NOTIFY_INVAL_INODE` for the attributes only), stats the file so
//! the kernel asks again and takes the new size, then has the loop device
//! re-read its file's size (`LOOP_SET_CAPACITY`), all while mounted. The
//! stat matters: the loop driver reads the size the kernel holds for the
//! file, and FUSE direct I/O stops reads at it too.
//!
//! # When the serving process dies
//!
//! The kernel aborts the FUSE connection when the last `/dev/fuse`
//! descriptor closes: every pending and later request on the file fails
//! (ENOTCONN), which the loop device reports as I/O errors to its users.
//! Nothing hangs. The loop device was bound with autoclear and was held
//! open only by this process, so it unbinds by itself once nobody else has
//! it open (a filesystem mounted on it holds it until it is unmounted;
//! `losetup -d` also works). The dead FUSE mount stays until `umount
//! MOUNTPOINT` (or `umount -l`), which succeeds once the loop device has
//! let go of the file.

use super::loopdev;
use super::span::Span;
use crate::blockdev::BlockDev;
use crate::exec::Executor;
use crate::limits::{
    FUSE_ATTR_TTL, FUSE_BACKGROUND_MAX, FUSE_IN_FLIGHT_MAX, FUSE_UNMOUNT_RETRY_MS,
    FUSE_WRITE_BYTES_MAX,
};
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    KernelConfig, LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, SessionACL, WriteFlags,
};
use std::ffi::{CString, OsStr};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

pub use super::loopdev::{attach_loop, attach_loop_with, LoopDevice, LoopError, LoopOptions};

const ROOT: INodeNo = INodeNo(1);
const FILE: INodeNo = INodeNo(2);

/// How to mount.
#[derive(Debug, Clone)]
pub struct FuseOptions {
    /// Name of the one file in the filesystem.
    pub file_name: String,
    /// Let users other than the mounting one in (`allow_other`).
    pub allow_other: bool,
    pub read_only: bool,
    /// Open the file with FOPEN_DIRECT_IO (no page cache in the FUSE
    /// layer; a loop device or `O_DIRECT` user brings its own).
    pub direct_io: bool,
    /// Threads reading /dev/fuse (each with its own cloned descriptor).
    pub session_threads: usize,
    /// Threads polling BlockDev futures.
    pub io_threads: usize,
}

impl Default for FuseOptions {
    fn default() -> FuseOptions {
        FuseOptions {
            file_name: "volume".into(),
            allow_other: false,
            read_only: false,
            direct_io: true,
            session_threads: 2,
            io_threads: 2,
        }
    }
}

/// Why mounting, attaching or tearing down failed.
#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    #[error("invalid file name {0:?}")]
    BadName(String),
    #[error("cannot start the I/O executor")]
    Executor(#[source] io::Error),
    #[error("cannot mount FUSE at {path}")]
    Mount {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot unmount {path}")]
    Unmount {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is busy (files open on it, or its loop device attached)")]
    Busy { path: PathBuf },
    #[error("loop device")]
    Loop(#[from] LoopError),
    #[error("cannot refresh the size of {path}")]
    Refresh {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the FUSE device is closed")]
    Closed,
}

/// The filesystem served to the kernel.
struct FuseFs {
    /// Declared (so dropped) before `span`: dropping it waits for every
    /// task while `span` still holds the device, so the last reference never
    /// goes away on a device I/O thread that polled a task (joining itself).
    exec: Executor,
    span: Arc<Span>,
    name: Vec<u8>,
    read_only: bool,
    direct_io: bool,
    uid: u32,
    gid: u32,
    mtime: SystemTime,
}

impl std::fmt::Debug for FuseFs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FuseFs").field("span", &self.span).finish()
    }
}

fn err(e: i32) -> Errno {
    Errno::from_i32(e)
}

impl FuseFs {
    fn attr(&self, ino: INodeNo) -> FileAttr {
        let bs = self.span.block_size() as u32;
        let file = ino == FILE;
        let size = if file { self.span.size() } else { 0 };
        let preferred = match self.span.dev().optimal_io_bytes() {
            0 => 4096,
            n => n,
        }
        .max(bs);
        FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: self.mtime,
            mtime: self.mtime,
            ctime: self.mtime,
            crtime: self.mtime,
            kind: if file {
                FileType::RegularFile
            } else {
                FileType::Directory
            },
            perm: match (file, self.read_only) {
                (true, false) => 0o600,
                (true, true) => 0o400,
                (false, _) => 0o755,
            },
            nlink: if file { 1 } else { 2 },
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: preferred,
            flags: 0,
        }
    }

    /// The byte range of a request clipped to the file, or None past EOF.
    fn clip(&self, offset: u64, len: u64) -> Option<u64> {
        let size = self.span.size();
        (offset < size).then(|| len.min(size - offset))
    }
}

impl Filesystem for FuseFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        if let Err(max) = config.set_max_write(FUSE_WRITE_BYTES_MAX) {
            let _ = config.set_max_write(max);
        }
        if let Err(max) = config.set_max_readahead(FUSE_WRITE_BYTES_MAX) {
            let _ = config.set_max_readahead(max);
        }
        let _ = config.set_max_background(FUSE_BACKGROUND_MAX);
        let _ = config.set_congestion_threshold(FUSE_BACKGROUND_MAX / 4 * 3);
        // Async direct I/O lets the loop device keep many requests in
        // flight instead of one per worker.
        let _ = config.add_capabilities(InitFlags::FUSE_ASYNC_DIO);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if parent == ROOT && name.as_bytes() == self.name.as_slice() {
            reply.entry(&FUSE_ATTR_TTL, &self.attr(FILE), Generation(0));
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match ino {
            ROOT | FILE => reply.attr(&FUSE_ATTR_TTL, &self.attr(ino)),
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        if ino != FILE && ino != ROOT {
            return reply.error(Errno::ENOENT);
        }
        // The volume cannot be resized (or truncated) through its file.
        if size.is_some_and(|s| ino != FILE || s != self.span.size()) {
            return reply.error(err(libc::EPERM));
        }
        reply.attr(&FUSE_ATTR_TTL, &self.attr(ino));
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino == ROOT {
            return reply.error(err(libc::EISDIR));
        }
        if ino != FILE {
            return reply.error(Errno::ENOENT);
        }
        if self.read_only && flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
            return reply.error(err(libc::EROFS));
        }
        let f = if self.direct_io {
            FopenFlags::FOPEN_DIRECT_IO
        } else {
            FopenFlags::empty()
        };
        reply.opened(FileHandle(0), f);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if ino != FILE {
            return reply.error(err(libc::EISDIR));
        }
        let Some(len) = self.clip(offset, size as u64) else {
            return reply.data(&[]);
        };
        let span = self.span.clone();
        self.exec.spawn(async move {
            let (r, buf, at) = span.read(offset, len as usize).await;
            match r {
                Ok(()) => reply.data(&buf[at]),
                Err(e) => reply.error(err(super::errno(&e))),
            }
            span.pool.put(buf);
        });
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if ino != FILE {
            return reply.error(err(libc::EISDIR));
        }
        if self.read_only {
            return reply.error(err(libc::EROFS));
        }
        if data.is_empty() {
            return reply.written(0);
        }
        let Some(len) = self.clip(offset, data.len() as u64) else {
            return reply.error(err(libc::ENOSPC));
        };
        let len = len as usize;
        // O_SYNC includes the O_DSYNC bit on Linux.
        let fua = flags.0 & libc::O_DSYNC != 0;
        let mut buf = self.span.pool.get(len);
        buf.copy_from_slice(&data[..len]);
        let span = self.span.clone();
        self.exec.spawn(async move {
            let (r, buf) = span.write(offset, buf, fua).await;
            span.pool.put(buf);
            match r {
                Ok(()) => reply.written(len as u32),
                Err(e) => reply.error(err(super::errno(&e))),
            }
        });
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        if ino != FILE || self.read_only {
            return reply.ok();
        }
        self.fsync(_req, ino, _fh, false, reply);
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        if ino != FILE {
            return reply.ok();
        }
        let span = self.span.clone();
        self.exec.spawn(async move {
            match span.dev().flush().await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(err(super::errno(&e))),
            }
        });
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        const KEEP: i32 = libc::FALLOC_FL_KEEP_SIZE;
        const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE;
        const ZERO: i32 = libc::FALLOC_FL_ZERO_RANGE;
        if ino != FILE {
            return reply.error(err(libc::EISDIR));
        }
        if self.read_only {
            return reply.error(err(libc::EROFS));
        }
        let Some(end) = offset.checked_add(length) else {
            return reply.error(err(libc::EFBIG));
        };
        let size = self.span.size();
        let unmap = match mode {
            // Preallocation: every byte already exists, but the file
            // cannot grow.
            0 if end > size => return reply.error(err(libc::EFBIG)),
            0 | KEEP => return reply.ok(),
            m if m == PUNCH | KEEP => true,
            m if m == ZERO || m == ZERO | KEEP => {
                if m == ZERO && end > size {
                    return reply.error(err(libc::EFBIG));
                }
                false
            }
            _ => return reply.error(err(libc::EOPNOTSUPP)),
        };
        // Past EOF there is nothing to zero.
        let Some(len) = self.clip(offset, length) else {
            return reply.ok();
        };
        let span = self.span.clone();
        self.exec.spawn(async move {
            match span.zero(offset, len, unmap).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(err(super::errno(&e))),
            }
        });
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != ROOT {
            return reply.error(err(libc::ENOTDIR));
        }
        let entries: [(INodeNo, FileType, &OsStr); 3] = [
            (ROOT, FileType::Directory, OsStr::new(".")),
            (ROOT, FileType::Directory, OsStr::new("..")),
            (FILE, FileType::RegularFile, OsStr::from_bytes(&self.name)),
        ];
        for (i, (ino, kind, name)) in entries.iter().enumerate().skip(offset as usize) {
            if reply.add(*ino, i as u64 + 1, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let bs = self.span.block_size();
        reply.statfs(self.span.size() / bs, 0, 0, 2, 0, bs as u32, 255, bs as u32);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        reply.ok();
    }
}

/// A mounted FUSE filesystem serving one device as one file.
#[derive(Debug)]
pub struct FuseMount {
    session: Option<fuser::BackgroundSession>,
    mountpoint: PathBuf,
    file: PathBuf,
}

/// Mounts a filesystem at `mountpoint` (created if missing) whose one
/// file, `opts.file_name`, is `dev`.
pub fn mount(
    dev: Arc<dyn BlockDev>,
    mountpoint: &Path,
    opts: &FuseOptions,
) -> Result<FuseMount, FuseError> {
    let name = opts.file_name.as_bytes();
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0)
    {
        return Err(FuseError::BadName(opts.file_name.clone()));
    }
    let merr = |source| FuseError::Mount {
        path: mountpoint.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(mountpoint).map_err(merr)?;
    let exec = Executor::new(
        "nvpool-fuse-io",
        opts.io_threads.max(1),
        FUSE_IN_FLIGHT_MAX,
        true,
    )
    .map_err(FuseError::Executor)?;
    let fs = FuseFs {
        exec,
        span: Arc::new(Span::new(dev)),
        name: name.to_vec(),
        read_only: opts.read_only,
        direct_io: opts.direct_io,
        // SAFETY: geteuid/getegid take no arguments and cannot fail.
        uid: unsafe { libc::geteuid() },
        // SAFETY: as above.
        gid: unsafe { libc::getegid() },
        mtime: SystemTime::now(),
    };
    let mut cfg = fuser::Config::default();
    cfg.mount_options = vec![
        MountOption::FSName("nvpool".into()),
        MountOption::Subtype("nvpool".into()),
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoExec,
        MountOption::NoAtime,
        if opts.read_only {
            MountOption::RO
        } else {
            MountOption::RW
        },
    ];
    cfg.acl = if opts.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    cfg.n_threads = Some(opts.session_threads.max(1));
    cfg.clone_fd = true;
    let session = fuser::Session::new(fs, mountpoint, &cfg).map_err(merr)?;
    let mountpoint = mountpoint
        .canonicalize()
        .unwrap_or_else(|_| mountpoint.to_path_buf());
    let session = session.spawn().map_err(merr)?;
    Ok(FuseMount {
        session: Some(session),
        file: mountpoint.join(&opts.file_name),
        mountpoint,
    })
}

fn umount2(path: &Path, flags: libc::c_int) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), flags) } < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

impl FuseMount {
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Blocking; call it from a control thread, never from one serving
    /// FUSE requests (the kernel asks this filesystem for the file's
    /// attributes meanwhile).
    ///
    /// Makes the kernel take the file's size afresh (after the device
    /// grew): drops its cached attributes of the file (attributes only: the
    /// file has no page cache with FOPEN_DIRECT_IO) and stats it, which
    /// has the kernel ask for them. Returns the size it now has.
    pub fn refresh_size(&self) -> Result<u64, FuseError> {
        let session = self.session.as_ref().ok_or(FuseError::Closed)?;
        let err = |source| FuseError::Refresh {
            path: self.file.clone(),
            source,
        };
        // An offset below zero invalidates the attributes and no data.
        session.notifier().inval_inode(FILE, -1, 0).map_err(err)?;
        Ok(std::fs::metadata(&self.file).map_err(err)?.len())
    }

    /// The volume's file.
    pub fn file_path(&self) -> &Path {
        &self.file
    }

    /// Unmounts and waits for the session threads and every in-flight I/O.
    /// Fails with [`FuseError::Busy`] (and stays mounted, so it can be
    /// retried) while the file is open, e.g. by a loop device. Once it
    /// succeeded, further calls and drop do nothing.
    pub fn unmount(&mut self) -> Result<(), FuseError> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        match umount2(&self.mountpoint, 0) {
            // EINVAL: not mounted any more (someone ran umount).
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                self.session = Some(session);
                return Err(FuseError::Busy {
                    path: self.mountpoint.clone(),
                });
            }
            Err(source) => {
                self.session = Some(session);
                return Err(FuseError::Unmount {
                    path: self.mountpoint.clone(),
                    source,
                });
            }
        }
        // The connection is gone, so the session threads see ENODEV and end
        // (fuser's own unmount would now fail: it is already unmounted).
        session.join().map_err(|source| FuseError::Unmount {
            path: self.mountpoint.clone(),
            source,
        })
    }
}

impl FuseMount {
    /// The kernel's id of this FUSE connection, the directory name under
    /// `/sys/fs/fuse/connections` (the minor number of the mount's device).
    pub fn connection_id(&self) -> io::Result<u32> {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(&self.mountpoint)?.dev();
        Ok(libc::minor(dev))
    }
}

/// Where the kernel's FUSE control filesystem lives.
const FUSECTL: &str = "/sys/fs/fuse/connections";

/// Aborts a FUSE connection: every pending and later request on it fails
/// (ENOTCONN), so nothing waits on a server that stopped answering (a hung
/// process, a test past its deadline). Mounts the FUSE control filesystem
/// first if it is not mounted. The mount itself stays until unmounted.
pub fn abort_connection(id: u32) -> io::Result<()> {
    let dir = Path::new(FUSECTL);
    let empty = std::fs::read_dir(dir)?.next().is_none();
    if empty {
        let c = |s: &str| CString::new(s).expect("no NUL");
        let (src, target, fstype) = (c("fusectl"), c(FUSECTL), c("fusectl"));
        // SAFETY: valid NUL-terminated strings; no mount data.
        let r = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            // Mounted meanwhile by someone else: fine.
            if e.raw_os_error() != Some(libc::EBUSY) {
                return Err(e);
            }
        }
    }
    std::fs::write(dir.join(id.to_string()).join("abort"), b"1")
}

impl Drop for FuseMount {
    /// Unmounts; if the file is still open, detaches the mount lazily (it
    /// keeps being served until the last user closes it).
    fn drop(&mut self) {
        match self.unmount() {
            Ok(()) => {}
            Err(FuseError::Busy { .. }) => {
                if let Err(e) = umount2(&self.mountpoint, libc::MNT_DETACH) {
                    tracing::warn!(mountpoint = %self.mountpoint.display(), error = %e,
                        "lazy unmount failed");
                }
                // The session thread ends when the connection does.
                self.session = None;
            }
            Err(e) => tracing::warn!(mountpoint = %self.mountpoint.display(), error = %e,
                "unmount failed"),
        }
    }
}

/// A volume as a block device: the FUSE file behind a loop device.
///
/// Teardown order is loop first, then FUSE: [`FuseLoop::close`] refuses
/// while the loop device is mounted or held exclusively, so a mounted
/// filesystem never loses its device underneath it.
#[derive(Debug)]
pub struct FuseLoop {
    // Field order is drop order: the loop device before the mount.
    dev: Option<LoopDevice>,
    mount: Option<FuseMount>,
}

impl FuseLoop {
    /// Mounts the FUSE file at `mountpoint` and binds a loop device to it
    /// (direct I/O, logical block size = the device's block size).
    pub fn attach(
        dev: Arc<dyn BlockDev>,
        mountpoint: &Path,
        opts: &FuseOptions,
    ) -> Result<FuseLoop, FuseError> {
        let bs = dev.block_size();
        let m = mount(dev, mountpoint, opts)?;
        let mut lo = LoopOptions::new(bs);
        lo.read_only = opts.read_only;
        // Only with FOPEN_DIRECT_IO is the FUSE file free of a page cache
        // that the loop device's direct I/O would have to bypass.
        lo.direct_io = true;
        let l = loopdev::attach_loop_with(m.file_path(), &lo)?;
        Ok(FuseLoop {
            dev: Some(l),
            mount: Some(m),
        })
    }

    /// The block device, `/dev/loopN`.
    ///
    /// # Panics
    /// After a successful [`FuseLoop::close`].
    pub fn device_path(&self) -> &Path {
        self.loop_device().path()
    }

    /// # Panics
    /// After a successful [`FuseLoop::close`].
    pub fn loop_device(&self) -> &LoopDevice {
        self.dev.as_ref().expect("FuseLoop used after close")
    }

    /// # Panics
    /// After a successful [`FuseLoop::close`].
    pub fn mount(&self) -> &FuseMount {
        self.mount.as_ref().expect("FuseLoop used after close")
    }

    /// Blocking; call it from a control thread (see
    /// [`FuseMount::refresh_size`]).
    ///
    /// Shows the device's size now on the loop device, online, after the
    /// device grew (a volume grown with [`crate::Volume::grow`]): the
    /// kernel takes the FUSE file's new size, then the loop device follows
    /// it (`LOOP_SET_CAPACITY`), which udev and a mounted filesystem's
    /// resize tools see. Returns the loop device's size read back
    /// (`BLKGETSIZE64`).
    pub fn resize(&self) -> Result<u64, FuseError> {
        let (Some(dev), Some(m)) = (&self.dev, &self.mount) else {
            return Err(FuseError::Closed);
        };
        let file = m.refresh_size()?;
        let bytes = dev.set_capacity()?;
        tracing::info!(device = %dev.path().display(), file_bytes = file, bytes,
            "loop device resized");
        Ok(bytes)
    }

    /// Detaches the loop device, then unmounts FUSE and waits for every
    /// in-flight I/O. Fails with [`LoopError::Busy`] if the loop device
    /// is still mounted; nothing is torn down then and close can be
    /// retried. Once it succeeded, further calls and drop do nothing.
    pub fn close(&mut self) -> Result<(), FuseError> {
        if let Some(d) = self.dev.take() {
            if d.is_busy() {
                let path = d.path().to_path_buf();
                self.dev = Some(d);
                return Err(LoopError::Busy { path }.into());
            }
            d.detach()?;
        }
        let Some(m) = self.mount.as_mut() else {
            return Ok(());
        };
        // The kernel drops the file's last reference just after the loop
        // device unbinds; give it a moment before calling the mount busy.
        let deadline = std::time::Instant::now() + Duration::from_millis(FUSE_UNMOUNT_RETRY_MS);
        loop {
            match m.unmount() {
                Err(FuseError::Busy { .. }) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Ok(()) => {
                    self.mount = None;
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for FuseLoop {
    /// Tears down in order; if the loop device is still mounted it is left
    /// to unbind by itself when unmounted (autoclear) and the FUSE mount is
    /// detached lazily, still serving until then.
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::warn!(error = %e, "FuseLoop teardown incomplete");
        }
    }
}
