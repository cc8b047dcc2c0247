//! Block-device front-ends: present any [`BlockDev`](crate::BlockDev) (a
//! namespace or a pooled volume) to the local host.
//!
//! ```text
//!   ext4 / xfs / apps
//!        │
//!   /dev/loopN ──► FUSE file ──┐          /dev/nbdN (kernel nbd) ─┐
//!                              │          qemu, nbdinfo, fio ─────┤ NBD
//!                         fuse::FuseFs                       nbd::NbdServer
//!                              └────► crate::exec::Executor ◄─────┘
//!                                         │ polls BlockDev futures
//!                                  Arc<dyn BlockDev>
//! ```
//!
//! * [`fuse`]: a FUSE filesystem holding one regular file (the volume),
//!   and [`fuse::FuseLoop`], that file behind a loop device with direct
//!   I/O: a block device on any Linux with FUSE and loop, no extra module.
//! * [`nbd`]: an NBD server (fixed newstyle handshake, structured replies,
//!   pipelined requests) on a Unix socket and/or TCP, and
//!   [`nbd::kernel`], which hands a socket to the kernel's nbd driver.
//!
//! Each front-end reads requests on its own threads and hands every I/O to
//! a small executor, so one slow I/O never stalls the request stream;
//! in-flight requests are bounded at every stage. Unaligned ranges are
//! served by read-modify-write ([`span`]).

pub mod fuse;
mod loopdev;
pub mod nbd;
mod span;
#[cfg(feature = "ublk")]
pub mod ublk;

use crate::error::IoError;
use nvpool_wire::Status;

/// The errno reported to the kernel or an NBD client for a failed I/O.
/// NBD's error values are Linux's errno numbers for the same meanings
/// (EPERM 1, EIO 5, EINVAL 22, ENOSPC 28), so one mapping serves both;
/// the target serving a volume as a namespace maps through it too.
pub fn errno(e: &IoError) -> i32 {
    match e {
        IoError::Invalid(_) => libc::EINVAL,
        IoError::Status(s) if *s == Status::LBA_OUT_OF_RANGE || *s == Status::CAPACITY_EXCEEDED => {
            libc::ENOSPC
        }
        IoError::Status(s) if *s == Status::NS_WRITE_PROTECTED => libc::EPERM,
        IoError::Status(_) | IoError::ControllerLost | IoError::Digest => libc::EIO,
    }
}

/// The size in bytes of block device `name` (`nbd0`, `ublkb1`) as the
/// block layer has it (sysfs counts 512-byte sectors whatever the block
/// size).
pub(crate) fn disk_bytes(name: &str) -> std::io::Result<u64> {
    let s = std::fs::read_to_string(format!("/sys/block/{name}/size"))?;
    let sectors: u64 = s.trim().parse().map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("size {:?}", s.trim()),
        )
    })?;
    sectors
        .checked_mul(512)
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "size overflows"))
}
