//! The block device the front-ends (ublk, NBD, FUSE) serve: one namespace
//! ([`crate::Device`]) or a pooled volume ([`crate::volume::Volume`]).
//!
//! Byte-addressed; offsets and lengths are multiples of `block_size()`.
//! Methods return boxed futures so front-ends can hold an
//! `Arc<dyn BlockDev>`; buffers move in and come back with the result, so
//! nothing is copied on the way.

use crate::error::IoError;
use std::future::Future;
use std::pin::Pin;

/// A future borrowing the device.
pub type IoFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A result with the caller's buffer handed back.
pub type BufResult = (Result<(), IoError>, Vec<u8>);

pub trait BlockDev: Send + Sync + 'static {
    /// Bytes.
    fn size(&self) -> u64;
    /// Logical block size in bytes (a power of two, at least 512).
    fn block_size(&self) -> u32;
    /// Preferred I/O size in bytes (the stripe unit of a striped volume);
    /// 0 when there is no preference.
    fn optimal_io_bytes(&self) -> u32 {
        0
    }
    /// Largest single request worth sending in one piece; front-ends
    /// advertise it (ublk max_sectors, NBD maximum block size).
    fn max_io_bytes(&self) -> u32 {
        1 << 20
    }
    /// Reads `buf.len()` bytes at `offset` into `buf`.
    fn read(&self, offset: u64, buf: Vec<u8>) -> IoFuture<'_, BufResult>;
    /// Writes `buf` at `offset`; with `fua` the data is durable on success.
    fn write(&self, offset: u64, buf: Vec<u8>, fua: bool) -> IoFuture<'_, BufResult>;
    /// Makes every completed write durable.
    fn flush(&self) -> IoFuture<'_, Result<(), IoError>>;
    /// Zeroes a range; `may_unmap` lets the device deallocate it.
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> IoFuture<'_, Result<(), IoError>>;
    /// Discards a range (its contents become unspecified).
    fn discard(&self, offset: u64, len: u64) -> IoFuture<'_, Result<(), IoError>>;
}

impl BlockDev for crate::Device {
    fn size(&self) -> u64 {
        crate::Device::size(self)
    }

    fn block_size(&self) -> u32 {
        crate::Device::block_size(self)
    }

    fn read(&self, offset: u64, buf: Vec<u8>) -> IoFuture<'_, BufResult> {
        Box::pin(crate::Device::read(self, offset, buf))
    }

    fn write(&self, offset: u64, buf: Vec<u8>, fua: bool) -> IoFuture<'_, BufResult> {
        Box::pin(crate::Device::write(self, offset, buf, fua))
    }

    fn flush(&self) -> IoFuture<'_, Result<(), IoError>> {
        Box::pin(crate::Device::flush(self))
    }

    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> IoFuture<'_, Result<(), IoError>> {
        Box::pin(crate::Device::write_zeroes(self, offset, len, may_unmap))
    }

    fn discard(&self, offset: u64, len: u64) -> IoFuture<'_, Result<(), IoError>> {
        Box::pin(crate::Device::discard(self, offset, len))
    }
}
