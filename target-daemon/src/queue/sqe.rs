//! Backend operations of a command on a file, as values ([`FileOp`]): a
//! read, write or fsync, and the windows of fallocate or zero writes of a
//! Write Zeroes or deallocate. The queue decides them; whatever it was
//! given to [`Submit`] them to carries them out: the reactor's ring turns
//! each into an io_uring SQE, a simulation performs it on a model.

use super::*;
use crate::backend::UringTarget;

/// One operation on a file: offset, what, and the user data its
/// completion carries back ([`Queue::on_completion`]).
#[derive(Debug, Clone, Copy)]
pub struct FileOp {
    pub fd: std::os::fd::RawFd,
    /// Byte offset in the file.
    pub off: u64,
    pub kind: FileOpKind,
    /// [`user_data`], its tag included ([`user_data_tag`]).
    pub ud: u64,
}

#[derive(Debug, Clone, Copy)]
pub enum FileOpKind {
    /// Reads `len` bytes into `buf`.
    Read { buf: *mut u8, len: u32 },
    /// Writes `len` bytes from `buf` (a zero write: from the shared
    /// buffer of zeroes); `fua`: they are durable on completion.
    Write { buf: *const u8, len: u32, fua: bool },
    /// fdatasync.
    Fsync,
    /// fallocate with `mode` over `len` bytes.
    Fallocate { mode: i32, len: u64 },
}

/// Where a queue's file operations go.
pub trait Submit: std::fmt::Debug {
    /// Starts `op`; its completion comes back through the queue's
    /// [`Queue::on_completion`] with `op.ud`.
    ///
    /// # Safety
    /// A buffer `op` points at stays valid, unmoved and untouched until
    /// that completion is handed back.
    unsafe fn submit(&mut self, op: FileOp);
}

impl Submit for Ring {
    unsafe fn submit(&mut self, op: FileOp) {
        let fd = types::Fd(op.fd);
        let e = match op.kind {
            FileOpKind::Read { buf, len } => opcode::Read::new(fd, buf, len).offset(op.off).build(),
            FileOpKind::Write { buf, len, fua } => opcode::Write::new(fd, buf, len)
                .offset(op.off)
                .rw_flags(if fua { libc::RWF_DSYNC } else { 0 })
                .build(),
            FileOpKind::Fsync => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            FileOpKind::Fallocate { mode, len } => opcode::Fallocate::new(fd, len)
                .offset(op.off)
                .mode(mode)
                .build(),
        };
        // SAFETY: the caller keeps the buffer valid.
        unsafe { self.push(e.user_data(op.ud)) };
    }
}

pub(super) fn submit(ring: &mut dyn Submit, slot: &mut Slot, t: UringTarget, ud: u64) {
    let (fd, fua, len) = (t.fd, slot.fua, (slot.len - slot.done) as u32);
    // SAFETY: done <= len <= buffer capacity, so the pointer stays inside the buffer.
    let buf = unsafe { slot.buf.as_mut_ptr().add(slot.done) };
    let kind = match slot.kind {
        IoKind::Read => FileOpKind::Read { buf, len },
        IoKind::Write => FileOpKind::Write { buf, len, fua },
        IoKind::Flush => FileOpKind::Fsync,
        other => unreachable!("{other:?} is not submitted to io_uring"),
    };
    let off = t.base + slot.off + slot.done as u64;
    // SAFETY: the buffer belongs to the slot, which stays in Backend state
    // (never reused, never dropped: the connection outlives its in-flight
    // operations) until this operation's completion is handed back.
    unsafe { ring.submit(FileOp { fd, off, kind, ud }) };
}

/// Submits the ring operations a Write Zeroes or deallocate can have in
/// flight now (its window). Returns how many it submitted, and the
/// command's result once every operation is back.
pub(super) fn pump_zero(
    slot: &mut Slot,
    ns: &Namespace,
    ring: &mut dyn Submit,
    t: UringTarget,
    ud: u64,
) -> (u32, Option<Result<(), i32>>) {
    let (kind, sqe, off, span) = (slot.kind, slot.sqe, slot.off, slot.span);
    let list = slot.buf.as_slice(slot.len);
    let range = |i: usize| match kind {
        IoKind::WriteZeroes => (i == 0).then_some((off, span)),
        _ => dsm_range(&sqe, list, ns, i),
    };
    let Some(job) = slot.zero.as_mut() else {
        // Not a zeroing command after all: fail it rather than the daemon.
        return (0, Some(Err(-libc::EINVAL)));
    };
    let mut n = 0;
    loop {
        match job.step(range) {
            ZeroStep::Submit(op) => {
                let (kind, tag) = match op.mode.fallocate_mode() {
                    Some(mode) => (FileOpKind::Fallocate { mode, len: op.len }, 0),
                    None => {
                        // Chunks are at most ZERO_WRITE_CHUNK_BYTES (the
                        // buffer's size, a u32 and 2^16 512-byte units at
                        // most: limits.rs) and whole blocks.
                        let len = op.len.min(limits::ZERO_WRITE_CHUNK_BYTES as u64) as u32;
                        let (buf, fua) = (crate::ring::zero_chunk(), false);
                        (FileOpKind::Write { buf, len, fua }, (len >> 9) as u16)
                    }
                };
                let (fd, off, ud) = (t.fd, t.base + op.off, ud | u64::from(tag) << 48);
                // SAFETY: a fallocate points at no memory; a zero write
                // reads the shared buffer of zeroes, which is never
                // written and never freed.
                unsafe { ring.submit(FileOp { fd, off, kind, ud }) };
                n += 1;
            }
            ZeroStep::Wait => return (n, None),
            ZeroStep::Done(r) => return (n, Some(r)),
        }
    }
}
