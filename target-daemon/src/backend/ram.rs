//! A namespace held in memory: for tests and benchmarks, gone on restart.

use super::Backend;
use std::cell::UnsafeCell;
use std::io;

/// RAM storage. Like a disk, it gives no ordering between concurrent
/// overlapping writes: the host owns that (the NVMe spec leaves it undefined
/// too), so the bytes are shared without a lock.
pub struct RamBackend {
    data: Box<[UnsafeCell<u8>]>,
    block_size: u32,
}

// SAFETY: concurrent access is to raw bytes with no invariants beyond their
// values; overlapping concurrent I/O has undefined *content* per the NVMe
// spec, never undefined memory (we copy with ptr::copy, not references that
// alias mutably).
unsafe impl Sync for RamBackend {}

impl std::fmt::Debug for RamBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RamBackend({} bytes)", self.data.len())
    }
}

impl RamBackend {
    pub fn new(size: u64, block_size: u32) -> RamBackend {
        let data: Vec<UnsafeCell<u8>> = (0..size).map(|_| UnsafeCell::new(0)).collect();
        RamBackend {
            data: data.into_boxed_slice(),
            block_size,
        }
    }

    fn ptr(&self, off: u64, len: usize) -> *mut u8 {
        assert!(
            off.checked_add(len as u64)
                .is_some_and(|e| e <= self.data.len() as u64),
            "range outside RAM namespace"
        );
        UnsafeCell::raw_get(self.data[off as usize..].as_ptr())
    }
}

impl Backend for RamBackend {
    fn size(&self) -> u64 {
        self.data.len() as u64
    }
    fn block_size(&self) -> u32 {
        self.block_size
    }
    fn describe(&self) -> String {
        format!("ram {} bytes", self.data.len())
    }
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let p = self.ptr(off, buf.len());
        // SAFETY: p is valid for buf.len() bytes (checked in ptr()); buf is a
        // distinct allocation.
        unsafe { std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), buf.len()) };
        Ok(())
    }
    fn write_at(&self, buf: &[u8], off: u64, _fua: bool) -> io::Result<()> {
        let p = self.ptr(off, buf.len());
        // SAFETY: as in read_at.
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), p, buf.len()) };
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn write_zeroes(&self, off: u64, len: u64) -> io::Result<()> {
        let p = self.ptr(off, len as usize);
        // SAFETY: p is valid for len bytes.
        unsafe { std::ptr::write_bytes(p, 0, len as usize) };
        Ok(())
    }
    fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        self.write_zeroes(off, len)
    }
    fn failed(&self) -> bool {
        false
    }
    fn mark_failed(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let r = RamBackend::new(8192, 512);
        r.write_at(&[1, 2, 3], 4000, false).unwrap();
        let mut b = [0u8; 5];
        r.read_at(&mut b, 3999).unwrap();
        assert_eq!(b, [0, 1, 2, 3, 0]);
        r.discard(4000, 2).unwrap();
        r.read_at(&mut b, 3999).unwrap();
        assert_eq!(b, [0, 0, 0, 3, 0]);
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn out_of_range_is_a_bug() {
        let r = RamBackend::new(512, 512);
        let mut b = [0u8; 2];
        let _ = r.read_at(&mut b, 511);
    }
}
