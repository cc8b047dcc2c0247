//! Loop devices through the kernel's ioctls (no `losetup` needed).
//!
//! [`attach_loop`] asks `/dev/loop-control` for a free device and binds it
//! to a file in one `LOOP_CONFIGURE` call: direct I/O (no second page
//! cache), the logical block size of the volume, and autoclear. The
//! returned [`LoopDevice`] keeps the device open; with autoclear the kernel
//! unbinds it when the last opener closes it, so if the process dies the
//! loop device frees itself as soon as nobody (a mounted filesystem, an
//! application) holds it. [`LoopDevice::detach`] refuses while the device
//! is claimed exclusively (mounted) and otherwise unbinds it and waits for
//! the kernel to finish. [`LoopDevice::set_capacity`] makes a bound
//! device follow its file when the file grew (`LOOP_SET_CAPACITY`).

use crate::limits::{LOOP_CONFIGURE_ATTEMPTS_MAX, LOOP_DETACH_WAIT_MS};
use std::ffi::CString;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_GET_STATUS64: libc::c_ulong = 0x4C05;
const LOOP_SET_CAPACITY: libc::c_ulong = 0x4C07;
const LOOP_SET_DIRECT_IO: libc::c_ulong = 0x4C08;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
/// `BLKGETSIZE64` of `<linux/fs.h>`: `_IOR(0x12, 114, size_t)`.
const BLKGETSIZE64: libc::c_ulong =
    (2 << 30) | ((std::mem::size_of::<usize>() as libc::c_ulong) << 16) | (0x12 << 8) | 114;
const _: () = assert!(std::mem::size_of::<usize>() != 8 || BLKGETSIZE64 == 0x8008_1272);

const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;

/// `struct loop_info64` of `<linux/loop.h>`.
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// `struct loop_config` of `<linux/loop.h>`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

const _: () = assert!(std::mem::size_of::<LoopInfo64>() == 232);
const _: () = assert!(std::mem::size_of::<LoopConfig>() == 304);

impl LoopInfo64 {
    fn zeroed() -> LoopInfo64 {
        LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: 0,
            lo_file_name: [0; 64],
            lo_crypt_name: [0; 64],
            lo_encrypt_key: [0; 32],
            lo_init: [0; 2],
        }
    }
}

/// Why a loop device operation failed.
#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    #[error("{op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is in use (mounted or held open exclusively); unmount it first")]
    Busy { path: PathBuf },
    #[error("no free loop device after {attempts} attempts")]
    NoFreeDevice { attempts: u32 },
    #[error("{path} did not unbind within {waited:?}")]
    DetachTimeout { path: PathBuf, waited: Duration },
}

/// How to bind the loop device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopOptions {
    /// Logical block size of the loop device (the volume's block size).
    pub block_size: u32,
    /// Direct I/O to the backing file (no page cache in between).
    pub direct_io: bool,
    pub read_only: bool,
}

impl LoopOptions {
    pub fn new(block_size: u32) -> LoopOptions {
        LoopOptions {
            block_size,
            direct_io: true,
            read_only: false,
        }
    }
}

/// A bound loop device, kept open by this handle.
#[derive(Debug)]
pub struct LoopDevice {
    path: PathBuf,
    index: u32,
    fd: Option<OwnedFd>,
    direct_io: bool,
    block_size: u32,
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> LoopError + 'a {
    move |source| LoopError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// `ioctl(fd, req, arg)`, errno as an `io::Error`.
fn ioctl(fd: &OwnedFd, req: libc::c_ulong, arg: libc::c_ulong) -> io::Result<libc::c_int> {
    // SAFETY: every request used here takes an integer argument or a
    // pointer to a struct that lives for the duration of the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, arg) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn status(fd: &OwnedFd) -> io::Result<LoopInfo64> {
    let mut info = LoopInfo64::zeroed();
    ioctl(
        fd,
        LOOP_GET_STATUS64,
        &mut info as *mut LoopInfo64 as libc::c_ulong,
    )?;
    Ok(info)
}

/// Binds a free loop device to `file` with direct I/O and the given
/// logical block size.
pub fn attach_loop(file: &Path, block_size: u32) -> Result<LoopDevice, LoopError> {
    attach_loop_with(file, &LoopOptions::new(block_size))
}

/// [`attach_loop`] with every option.
pub fn attach_loop_with(file: &Path, opts: &LoopOptions) -> Result<LoopDevice, LoopError> {
    let mut oo = OpenOptions::new();
    oo.read(true).write(!opts.read_only);
    let backing: OwnedFd = if opts.direct_io {
        // Open O_DIRECT as losetup does; fall back if the file refuses it
        // (the kernel then decides whether direct I/O is possible).
        match oo.clone().custom_flags(libc::O_DIRECT).open(file) {
            Ok(f) => f.into(),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                oo.open(file).map_err(io_err("cannot open", file))?.into()
            }
            Err(e) => return Err(io_err("cannot open", file)(e)),
        }
    } else {
        oo.open(file).map_err(io_err("cannot open", file))?.into()
    };
    let ctl_path = Path::new("/dev/loop-control");
    let ctl: OwnedFd = OpenOptions::new()
        .read(true)
        .write(true)
        .open(ctl_path)
        .map_err(io_err("cannot open", ctl_path))?
        .into();
    let mut flags = LO_FLAGS_AUTOCLEAR;
    if opts.direct_io {
        flags |= LO_FLAGS_DIRECT_IO;
    }
    if opts.read_only {
        flags |= LO_FLAGS_READ_ONLY;
    }
    for _ in 0..LOOP_CONFIGURE_ATTEMPTS_MAX {
        let index =
            ioctl(&ctl, LOOP_CTL_GET_FREE, 0).map_err(io_err("LOOP_CTL_GET_FREE", ctl_path))?;
        let path = PathBuf::from(format!("/dev/loop{index}"));
        let dev: OwnedFd = match OpenOptions::new()
            .read(true)
            .write(!opts.read_only)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(f) => f.into(),
            // udev may not have created the node yet.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(io_err("cannot open", &path)(e)),
        };
        let mut info = LoopInfo64::zeroed();
        info.lo_flags = flags;
        let name = file.as_os_str().as_bytes();
        let n = name.len().min(info.lo_file_name.len() - 1);
        info.lo_file_name[..n].copy_from_slice(&name[..n]);
        let cfg = LoopConfig {
            fd: backing.as_raw_fd() as u32,
            block_size: opts.block_size,
            info,
            reserved: [0; 8],
        };
        match ioctl(
            &dev,
            LOOP_CONFIGURE,
            &cfg as *const LoopConfig as libc::c_ulong,
        ) {
            Ok(_) => {}
            // Someone else bound it first.
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => continue,
            Err(e) => return Err(io_err("LOOP_CONFIGURE", &path)(e)),
        }
        let mut direct_io = status(&dev)
            .map(|i| i.lo_flags & LO_FLAGS_DIRECT_IO != 0)
            .unwrap_or(false);
        if opts.direct_io && !direct_io {
            direct_io = ioctl(&dev, LOOP_SET_DIRECT_IO, 1).is_ok();
            if !direct_io {
                tracing::warn!(device = %path.display(), file = %file.display(),
                    "loop device could not enable direct I/O; using the page cache");
            }
        }
        return Ok(LoopDevice {
            path,
            index: index as u32,
            fd: Some(dev),
            direct_io,
            block_size: opts.block_size,
        });
    }
    Err(LoopError::NoFreeDevice {
        attempts: LOOP_CONFIGURE_ATTEMPTS_MAX,
    })
}

impl LoopDevice {
    /// `/dev/loopN`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn index(&self) -> u32 {
        self.index
    }

    /// Whether the kernel runs the device with direct I/O.
    pub fn direct_io(&self) -> bool {
        self.direct_io
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// True while the device is claimed exclusively (a mounted
    /// filesystem, `mkfs`, another `O_EXCL` opener).
    pub fn is_busy(&self) -> bool {
        let Ok(c) = CString::new(self.path.as_os_str().as_bytes()) else {
            return false;
        };
        // SAFETY: a valid NUL-terminated path; the descriptor is closed below.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_EXCL | libc::O_CLOEXEC) };
        if fd < 0 {
            return io::Error::last_os_error().raw_os_error() == Some(libc::EBUSY);
        }
        // SAFETY: closing the descriptor opened just above.
        unsafe { libc::close(fd) };
        false
    }

    /// The device's size in bytes (`BLKGETSIZE64`).
    pub fn size(&self) -> Result<u64, LoopError> {
        let fd = self.fd()?;
        let mut bytes: u64 = 0;
        ioctl(fd, BLKGETSIZE64, &mut bytes as *mut u64 as libc::c_ulong)
            .map_err(io_err("BLKGETSIZE64", &self.path))?;
        Ok(bytes)
    }

    /// Makes the device as large as its backing file is now
    /// (`LOOP_SET_CAPACITY`: the kernel reads the file's size, sets the
    /// capacity and tells udev) and returns its size in bytes, read back.
    /// Works while the device is mounted; the file must have grown in the
    /// kernel's eyes (its inode's size), not only in its filesystem's.
    pub fn set_capacity(&self) -> Result<u64, LoopError> {
        ioctl(self.fd()?, LOOP_SET_CAPACITY, 0).map_err(io_err("LOOP_SET_CAPACITY", &self.path))?;
        self.size()
    }

    /// The open device; only a handle in teardown has none.
    fn fd(&self) -> Result<&OwnedFd, LoopError> {
        self.fd.as_ref().ok_or_else(|| LoopError::Io {
            op: "using",
            path: self.path.clone(),
            source: io::Error::from_raw_os_error(libc::ENXIO),
        })
    }

    fn bound(&self) -> bool {
        Path::new(&format!("/sys/block/loop{}/loop/backing_file", self.index)).exists()
    }

    /// Unbinds the device and waits until the kernel has let go of the
    /// backing file. Refuses while the device is claimed (mounted).
    pub fn detach(mut self) -> Result<(), LoopError> {
        if self.is_busy() {
            return Err(LoopError::Busy {
                path: self.path.clone(),
            });
        }
        self.release()
    }

    fn release(&mut self) -> Result<(), LoopError> {
        let Some(fd) = self.fd.take() else {
            return Ok(());
        };
        // With other openers the kernel only marks the device autoclear;
        // it unbinds at the last close, which may be ours just below.
        match ioctl(&fd, LOOP_CLR_FD, 0) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {}
            Err(e) => return Err(io_err("LOOP_CLR_FD", &self.path)(e)),
        }
        drop(fd);
        let deadline = Instant::now() + Duration::from_millis(LOOP_DETACH_WAIT_MS);
        while self.bound() {
            if Instant::now() > deadline {
                return Err(LoopError::DetachTimeout {
                    path: self.path.clone(),
                    waited: Duration::from_millis(LOOP_DETACH_WAIT_MS),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }
}

impl Drop for LoopDevice {
    /// Unbinds the device (if it is still claimed, autoclear unbinds it
    /// when the claimer lets go).
    fn drop(&mut self) {
        if self.fd.is_none() {
            return;
        }
        if self.is_busy() {
            tracing::warn!(device = %self.path.display(),
                "loop device still in use; it unbinds when released");
            self.fd = None;
            return;
        }
        if let Err(e) = self.release() {
            tracing::warn!(device = %self.path.display(), error = %e, "loop detach failed");
        }
    }
}
