//! A block device or regular file, or an extent of one.

use super::{Backend, BackendError, DeviceExtent, FileId, UringTarget};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::sync::atomic::{AtomicBool, Ordering};

/// Extents must start on this boundary so O_DIRECT I/O stays aligned.
pub const EXTENT_ALIGN_BYTES: u64 = 4096;

#[derive(Debug)]
pub struct FileBackend {
    file: File,
    path: String,
    base: u64,
    len: u64,
    block_size: u32,
    direct: bool,
    is_block_device: bool,
    file_id: FileId,
    failed: AtomicBool,
}

const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKSSZGET: libc::c_ulong = 0x1268;

impl FileBackend {
    /// Opens `path` (O_DIRECT when supported) and exposes `[offset, offset+length)`
    /// of it; without a length, everything from `offset` to the end.
    pub fn open(
        path: &str,
        offset: u64,
        length: Option<u64>,
        block_size: Option<u32>,
    ) -> Result<FileBackend, BackendError> {
        let geo = |reason: String| BackendError::Geometry {
            path: path.to_owned(),
            reason,
        };
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true).write(true);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(path)
        };
        let (file, direct) = match open(true) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::warn!(path, "O_DIRECT not supported here; using the page cache (slower, flush still honoured)");
                (
                    open(false).map_err(|source| BackendError::Open {
                        path: path.to_owned(),
                        source,
                    })?,
                    false,
                )
            }
            Err(source) => {
                return Err(BackendError::Open {
                    path: path.to_owned(),
                    source,
                })
            }
        };
        let meta = file.metadata().map_err(|source| BackendError::Open {
            path: path.to_owned(),
            source,
        })?;
        let is_block_device = meta.file_type().is_block_device();
        let (total, dev_block) = if is_block_device {
            let mut size: u64 = 0;
            let mut ssz: libc::c_int = 0;
            // SAFETY: both ioctls write one integer of the given type through the pointer.
            let ok = unsafe {
                libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) == 0
                    && libc::ioctl(file.as_raw_fd(), BLKSSZGET, &mut ssz as *mut libc::c_int) == 0
            };
            if !ok {
                return Err(geo(format!(
                    "cannot read device geometry: {}",
                    io::Error::last_os_error()
                )));
            }
            (size, ssz as u32)
        } else if meta.is_file() {
            (meta.len(), 512)
        } else {
            return Err(geo("not a regular file or block device".into()));
        };
        let block_size = block_size.unwrap_or(dev_block.max(512));
        if block_size < dev_block {
            return Err(geo(format!(
                "block size {block_size} is below the device's {dev_block}"
            )));
        }
        if !offset.is_multiple_of(EXTENT_ALIGN_BYTES) {
            return Err(geo(format!(
                "extent offset {offset} is not a multiple of {EXTENT_ALIGN_BYTES}"
            )));
        }
        if offset >= total {
            return Err(geo(format!(
                "extent offset {offset} is beyond the end ({total} bytes)"
            )));
        }
        let avail = total - offset;
        let len = match length {
            Some(l) if l > avail => {
                return Err(geo(format!(
                    "extent [{offset}, +{l}) runs past the end ({total} bytes)"
                )))
            }
            Some(l) => l,
            None => avail,
        };
        let len = len / block_size as u64 * block_size as u64;
        if len == 0 {
            return Err(geo("extent is smaller than one block".into()));
        }
        Ok(FileBackend {
            file,
            path: path.to_owned(),
            base: offset,
            len,
            block_size,
            direct,
            is_block_device,
            file_id: FileId::of(&meta),
            failed: AtomicBool::new(false),
        })
    }

    fn check(&self, off: u64, len: u64) {
        assert!(
            off.checked_add(len).is_some_and(|end| end <= self.len),
            "range [{off}, +{len}) outside {}",
            self.len
        );
    }

    fn fallocate(&self, mode: libc::c_int, off: u64, len: u64) -> io::Result<()> {
        self.check(off, len);
        // SAFETY: fallocate takes a valid fd and plain integers.
        let r = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                mode,
                (self.base + off) as libc::off_t,
                len as libc::off_t,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    fn failed_error() -> io::Error {
        io::Error::other("backend failed earlier; refusing further I/O")
    }
}

impl Backend for FileBackend {
    fn size(&self) -> u64 {
        self.len
    }
    fn block_size(&self) -> u32 {
        self.block_size
    }
    fn describe(&self) -> String {
        format!(
            "{} {} [{}, +{}){}",
            if self.is_block_device {
                "device"
            } else {
                "file"
            },
            self.path,
            self.base,
            self.len,
            if self.direct { "" } else { " buffered" }
        )
    }
    fn uring_target(&self) -> Option<UringTarget> {
        Some(UringTarget {
            fd: self.file.as_raw_fd(),
            base: self.base,
        })
    }
    fn device_extent(&self) -> Option<DeviceExtent> {
        Some(DeviceExtent {
            file: self.file_id,
            base: self.base,
            len: self.len,
        })
    }

    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.check(off, buf.len() as u64);
        if self.failed() {
            return Err(Self::failed_error());
        }
        self.file.read_exact_at(buf, self.base + off)
    }

    fn write_at(&self, buf: &[u8], off: u64, fua: bool) -> io::Result<()> {
        self.check(off, buf.len() as u64);
        if self.failed() {
            return Err(Self::failed_error());
        }
        let r = self.file.write_all_at(buf, self.base + off).and_then(|()| {
            if fua {
                self.file.sync_data()
            } else {
                Ok(())
            }
        });
        if r.is_err() {
            self.mark_failed();
        }
        r
    }

    fn flush(&self) -> io::Result<()> {
        if self.failed() {
            return Err(Self::failed_error());
        }
        let r = self.file.sync_data();
        if r.is_err() {
            self.mark_failed();
        }
        r
    }

    fn write_zeroes(&self, off: u64, len: u64) -> io::Result<()> {
        if self.failed() {
            return Err(Self::failed_error());
        }
        match self.fallocate(
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
            off,
            len,
        ) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                // Punching a hole also reads back as zeroes on filesystems that
                // lack ZERO_RANGE; fall back to writing zeroes where neither works.
                self.fallocate(
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    off,
                    len,
                )
                .or_else(|_| self.write_zero_buffers(off, len))
            }
            r => r,
        }
    }

    fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        if self.failed() {
            return Err(Self::failed_error());
        }
        match self.fallocate(
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off,
            len,
        ) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                self.write_zero_buffers(off, len)
            }
            r => r,
        }
    }

    fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }
    fn mark_failed(&self) {
        if !self.failed.swap(true, Ordering::AcqRel) {
            tracing::error!(path = %self.path, "write or flush failed: backend marked failed, further I/O is refused");
        }
    }
}

impl FileBackend {
    fn write_zero_buffers(&self, off: u64, len: u64) -> io::Result<()> {
        const CHUNK: u64 = 1 << 20;
        let zeros = super::AlignedBuf::new(CHUNK as usize);
        let mut done = 0;
        while done < len {
            let n = (len - done).min(CHUNK);
            self.file
                .write_all_at(zeros.as_slice(n as usize), self.base + off + done)?;
            done += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extent_reads_and_writes_stay_inside() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("disk");
        std::fs::write(&p, vec![0xEEu8; 64 << 10]).unwrap();
        let b = FileBackend::open(p.to_str().unwrap(), 8192, Some(16384), None).unwrap();
        assert_eq!(b.size(), 16384);
        let mut buf = crate::backend::AlignedBuf::new(4096);
        buf.as_mut_slice(4096).fill(7);
        b.write_at(buf.as_slice(4096), 4096, true).unwrap();
        let all = std::fs::read(&p).unwrap();
        assert!(all[..8192 + 4096].iter().all(|&x| x == 0xEE));
        assert!(all[8192 + 4096..8192 + 8192].iter().all(|&x| x == 7));
        assert!(all[8192 + 8192..].iter().all(|&x| x == 0xEE));
        b.write_zeroes(4096, 4096).unwrap();
        b.read_at(buf.as_mut_slice(4096), 4096).unwrap();
        assert!(buf.as_slice(4096).iter().all(|&x| x == 0));
    }

    #[test]
    fn bad_extents_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("disk");
        std::fs::write(&p, vec![0u8; 8192]).unwrap();
        let p = p.to_str().unwrap();
        assert!(FileBackend::open(p, 100, None, None).is_err());
        assert!(FileBackend::open(p, 4096, Some(8192), None).is_err());
        assert!(FileBackend::open(p, 8192, None, None).is_err());
        assert!(FileBackend::open("/nonexistent/x", 0, None, None).is_err());
    }
}
