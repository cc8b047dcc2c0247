//! io_uring submissions of a command: read, write, fsync and the windows
//! of fallocate or zero writes of a Write Zeroes or deallocate.

use super::*;

pub(super) fn submit(ring: &mut Ring, slot: &mut Slot, t: crate::backend::UringTarget, ud: u64) {
    let fd = types::Fd(t.fd);
    let rest = (slot.len - slot.done) as u32;
    let off = t.base + slot.off + slot.done as u64;
    // SAFETY: done <= len <= buffer capacity, so the pointer stays inside the buffer.
    let ptr = unsafe { slot.buf.as_mut_ptr().add(slot.done) };
    let e = match slot.kind {
        IoKind::Read => opcode::Read::new(fd, ptr, rest).offset(off).build(),
        IoKind::Write => {
            let fl = if slot.fua { libc::RWF_DSYNC } else { 0 };
            opcode::Write::new(fd, ptr, rest)
                .offset(off)
                .rw_flags(fl)
                .build()
        }
        IoKind::Flush => opcode::Fsync::new(fd)
            .flags(types::FsyncFlags::DATASYNC)
            .build(),
        other => unreachable!("{other:?} is not submitted to io_uring"),
    };
    // SAFETY: the buffer belongs to the slot, which stays in Backend state
    // (never reused, never dropped: the connection outlives its in-flight
    // operations) until this operation's completion is handed back.
    unsafe { ring.push(e.user_data(ud)) };
}

/// Submits the ring operations a Write Zeroes or deallocate can have in
/// flight now (its window). Returns how many it submitted, and the
/// command's result once every operation is back.
pub(super) fn pump_zero(
    slot: &mut Slot,
    ns: &Namespace,
    ring: &mut Ring,
    t: crate::backend::UringTarget,
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
                submit_zero(ring, t, op, ud);
                n += 1;
            }
            ZeroStep::Wait => return (n, None),
            ZeroStep::Done(r) => return (n, Some(r)),
        }
    }
}

pub(super) fn submit_zero(ring: &mut Ring, t: crate::backend::UringTarget, op: ZeroOp, ud: u64) {
    let fd = types::Fd(t.fd);
    let off = t.base + op.off;
    let (e, tag) = match op.mode.fallocate_mode() {
        Some(mode) => (
            opcode::Fallocate::new(fd, op.len)
                .offset(off)
                .mode(mode)
                .build(),
            0,
        ),
        None => {
            // Chunks are at most ZERO_WRITE_CHUNK_BYTES (the buffer's size,
            // a u32 and 2^16 512-byte units at most: limits.rs) and whole
            // blocks.
            let len = op.len.min(limits::ZERO_WRITE_CHUNK_BYTES as u64);
            let e = opcode::Write::new(fd, crate::ring::zero_chunk(), len as u32)
                .offset(off)
                .build();
            (e, (len >> 9) as u16)
        }
    };
    // SAFETY: a fallocate points at no memory; a zero write reads the
    // shared buffer of zeroes, which is never written and never freed.
    unsafe { ring.push(e.user_data(ud | u64::from(tag) << 48)) };
}
