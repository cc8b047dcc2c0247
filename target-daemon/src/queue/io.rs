//! Backend I/O of a command: the ring, an asynchronous backend or inline,
//! their completions, and the one mapping of backend errors to statuses.

use super::*;

impl Queue {
    /// Sends an admitted I/O command to its backend.
    pub(super) fn issue(&mut self, si: usize, tx: &mut Tx, ex: &mut Exec<'_>) {
        let slot = &mut self.slots[si];
        let ns = slot.ns.clone().expect("planned I/O has a namespace");
        let backend = &ns.backend;
        if backend.is_async() {
            self.issue_async(si, &ns, tx, ex);
            return;
        }
        let uring = backend.uring_target();
        if let (Some(ring), Some(t)) = (ex.ring.as_deref_mut(), uring) {
            match slot.kind {
                IoKind::Read | IoKind::Write | IoKind::Flush => {
                    slot.state = SlotState::Backend;
                    self.inflight += 1;
                    submit(ring, slot, t, user_data(ex.conn, si as u16));
                    return;
                }
                IoKind::WriteZeroes | IoKind::Dsm => {
                    let mode = if slot.kind == IoKind::WriteZeroes {
                        ZeroMode::ZeroRange
                    } else {
                        match dsm_check(&slot.sqe, slot.buf.as_slice(slot.len), &ns) {
                            Ok(true) => ZeroMode::PunchHole,
                            Ok(false) => {
                                self.finish(si, Reply::ok(), tx, ex.now_ms);
                                return;
                            }
                            Err(st) => {
                                self.finish(si, Reply::status(st), tx, ex.now_ms);
                                return;
                            }
                        }
                    };
                    slot.state = SlotState::Backend;
                    slot.zero = Some(ZeroJob::new(mode));
                    let (n, done) = pump_zero(slot, &ns, ring, t, user_data(ex.conn, si as u16));
                    self.inflight += n;
                    if let Some(r) = done {
                        self.finish_zero(si, r, tx, ex.now_ms);
                    }
                    return;
                }
                IoKind::Other => {}
            }
        }
        let len = slot.len;
        let r = match slot.kind {
            IoKind::Read => backend.read_at(slot.buf.as_mut_slice(len), slot.off),
            IoKind::Write => backend.write_at(slot.buf.as_slice(len), slot.off, slot.fua),
            IoKind::Flush => backend.flush(),
            IoKind::WriteZeroes => backend.write_zeroes(slot.off, slot.span),
            IoKind::Dsm => match dsm_ranges(&slot.sqe, slot.buf.as_slice(len), &ns) {
                Ok(Some(ranges)) => ranges
                    .iter()
                    .try_for_each(|&(off, n)| backend.discard(off, n)),
                Ok(None) => Ok(()),
                Err(st) => {
                    self.finish(si, Reply::status(st), tx, ex.now_ms);
                    return;
                }
            },
            IoKind::Other => Ok(()),
        };
        let reply = match r {
            Ok(()) if slot.kind == IoKind::Read => Reply::data(len),
            Ok(()) => Reply::ok(),
            Err(e) => Reply::status(io_error_status(slot.kind, &e)),
        };
        self.finish(si, reply, tx, ex.now_ms);
    }

    /// Hands an admitted I/O command to a backend that completes it on
    /// threads of its own. Like a ring operation, the slot stays in
    /// `Backend` state (owning its buffer) until the completion is back
    /// ([`Queue::on_async_completion`]); the operation owns its data, so a
    /// write's bytes are copied out of the slot here (the one copy).
    pub(super) fn issue_async(
        &mut self,
        si: usize,
        ns: &Namespace,
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) {
        let slot = &mut self.slots[si];
        let op = match slot.kind {
            IoKind::Read => AsyncOp::Read {
                off: slot.off,
                len: slot.len,
            },
            IoKind::Write => AsyncOp::Write {
                off: slot.off,
                data: slot.buf.as_slice(slot.len).to_vec(),
                fua: slot.fua,
            },
            IoKind::Flush => AsyncOp::Flush,
            IoKind::WriteZeroes => AsyncOp::WriteZeroes {
                off: slot.off,
                len: slot.span,
            },
            IoKind::Dsm => match dsm_ranges(&slot.sqe, slot.buf.as_slice(slot.len), ns) {
                Ok(Some(ranges)) => AsyncOp::Discard { ranges },
                Ok(None) => {
                    self.finish(si, Reply::ok(), tx, ex.now_ms);
                    return;
                }
                Err(st) => {
                    self.finish(si, Reply::status(st), tx, ex.now_ms);
                    return;
                }
            },
            IoKind::Other => {
                self.finish(si, Reply::ok(), tx, ex.now_ms);
                return;
            }
        };
        // The write epoch of the commands a snapshot's cut is made of (T5).
        let epoch = match slot.kind {
            IoKind::Write | IoKind::WriteZeroes | IoKind::Dsm => slot.sqe.write_epoch(),
            _ => 0,
        };
        slot.state = SlotState::Backend;
        self.inflight += 1;
        // May complete at once, on this thread: the completion then waits
        // in the sink like any other until the reactor takes it.
        ns.backend.submit_tagged(
            op,
            epoch,
            AsyncDone::new(ex.sink.clone(), user_data(ex.conn, si as u16)),
        );
    }

    /// An asynchronous backend operation finished. Read data is copied into
    /// the slot's buffer, from where the response sends it in place.
    pub fn on_async_completion(
        &mut self,
        slot_id: u16,
        result: AsyncResult,
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) {
        let si = slot_id as usize;
        if !self.backend_completion(si, "an asynchronous completion") {
            return;
        }
        if self.is_closed() {
            self.release(si);
            return;
        }
        let slot = &mut self.slots[si];
        let reply = match result {
            Ok(Some(data)) if slot.kind == IoKind::Read && data.len() == slot.len => {
                slot.buf.as_mut_slice(slot.len).copy_from_slice(&data);
                Reply::data(slot.len)
            }
            Ok(data) if slot.kind == IoKind::Read => {
                // A backend bug; the command fails, nothing else does.
                peer_error!(
                    nsid = slot.sqe.nsid(),
                    len = slot.len,
                    got = data.map(|d| d.len()),
                    "an asynchronous read completed without all its data"
                );
                Reply::status(Status::UNRECOVERED_READ_ERROR)
            }
            Ok(_) => Reply::ok(),
            // The backend logs its own errors (rate-limited: a host can
            // cause them) and decides whether they make it failed. A path
            // that stopped serving while the command was in its backend
            // (set inaccessible, its lease ran out) answers with its ANA
            // status instead: whatever failed the command (a fence taking
            // the volume engine's extents away) came with that, and the
            // host retries the command on another path. A media error
            // here would fail it for good.
            Err(e) => {
                let kind = slot.kind;
                Reply::status(
                    self.path_status(ex.now_ms)
                        .unwrap_or_else(|| io_error_status(kind, &e)),
                )
            }
        };
        self.finish(si, reply, tx, ex.now_ms);
    }

    /// The ANA status I/O on this queue's path gets at `now_ms` when its
    /// group does not serve I/O here (the check [`Queue::refuse_ana`]
    /// makes); None while it serves, or without ANA.
    pub(super) fn path_status(&self, now_ms: u64) -> Option<Status> {
        self.ctrl
            .as_ref()?
            .subsystem()
            .ana
            .as_ref()?
            .effective(now_ms)
            .io_status()
    }

    /// Accounts one completed backend operation of slot `si`, which must
    /// be in the backend. False: nothing more to do with it (the queue is
    /// poisoned, or just found broken).
    pub(super) fn backend_completion(&mut self, si: usize, what: &'static str) -> bool {
        if self.poisoned() {
            self.inflight = self.inflight.saturating_sub(1);
            return false;
        }
        if self.inflight == 0 {
            self.violation(si, what);
            return false;
        }
        self.inflight -= 1;
        self.expect_state(si, SlotState::Backend, what)
    }

    /// A ring operation of slot `slot_id` finished with io_uring result
    /// `res`; `tag` is its user data's tag ([`user_data_tag`]).
    pub fn on_completion(
        &mut self,
        slot_id: u16,
        tag: u16,
        res: i32,
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) {
        let si = slot_id as usize;
        if !self.backend_completion(si, "a ring completion") {
            return;
        }
        if self.slots[si].zero.is_some() {
            self.on_zero_completion(si, tag, res, tx, ex);
            return;
        }
        if self.is_closed() {
            self.release(si);
            return;
        }
        let slot = &mut self.slots[si];
        let Some(ns) = slot.ns.clone() else {
            self.violation(si, "a command in the backend has no namespace");
            return;
        };
        if res < 0 {
            if slot.kind != IoKind::Read {
                ns.backend.mark_failed();
            }
            let e = std::io::Error::from_raw_os_error(-res);
            peer_warn!(nsid = ns.nsid, op = ?slot.kind, error = %e, "backend I/O failed");
            let st = io_error_status(slot.kind, &e);
            self.finish(si, Reply::status(st), tx, ex.now_ms);
            return;
        }
        if matches!(slot.kind, IoKind::Read | IoKind::Write) {
            slot.done += res as usize;
            if slot.done < slot.len {
                if res == 0 {
                    self.finish(
                        si,
                        Reply::status(Status::UNRECOVERED_READ_ERROR),
                        tx,
                        ex.now_ms,
                    );
                    return;
                }
                // Short transfer: ask for the rest.
                if let (Some(ring), Some(t)) = (ex.ring.as_deref_mut(), ns.backend.uring_target()) {
                    self.inflight += 1;
                    submit(ring, slot, t, user_data(ex.conn, slot_id));
                    return;
                }
            }
        }
        let reply = if slot.kind == IoKind::Read {
            Reply::data(slot.len)
        } else {
            Reply::ok()
        };
        self.finish(si, reply, tx, ex.now_ms);
    }

    /// One ring operation of a Write Zeroes or deallocate finished: the
    /// next ones go, and the command completes once all are back.
    pub(super) fn on_zero_completion(
        &mut self,
        si: usize,
        tag: u16,
        res: i32,
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) {
        let closed = self.is_closed();
        if self.slots.get(si).is_none_or(|s| s.zero.is_none()) {
            self.violation(si, "a zeroing completion for a slot without a zeroing job");
            return;
        }
        let slot = &mut self.slots[si];
        let Some(job) = slot.zero.as_mut() else {
            return;
        };
        job.complete(job.mode(), res, u64::from(tag) << 9);
        if closed {
            // Nothing more is submitted; the slot is free once all are back.
            if job.pending() == 0 {
                self.release(si);
            }
            return;
        }
        let done = match (ex.ring.as_deref_mut(), slot.ns.clone()) {
            (Some(ring), Some(ns)) => match ns.backend.uring_target() {
                Some(t) => {
                    let (n, done) = pump_zero(slot, &ns, ring, t, user_data(ex.conn, si as u16));
                    self.inflight += n;
                    done
                }
                None => Some(Err(-libc::EIO)),
            },
            _ => {
                self.violation(si, "a ring completion without a ring or a namespace");
                return;
            }
        };
        if let Some(r) = done {
            self.finish_zero(si, r, tx, ex.now_ms);
        }
    }

    /// A Write Zeroes or deallocate whose ring operations are all back.
    pub(super) fn finish_zero(&mut self, si: usize, r: Result<(), i32>, tx: &mut Tx, now_ms: u64) {
        let slot = &self.slots[si];
        let reply = match r {
            Ok(()) => Reply::ok(),
            Err(errno) => {
                let e = std::io::Error::from_raw_os_error(-errno);
                let wrote = slot.zero.is_some_and(|j| j.mode() == ZeroMode::Write);
                if let Some(ns) = &slot.ns {
                    // Failed writes leave the bytes unknown (D6); a failed
                    // fallocate changed nothing the host can rely on, as
                    // when it runs inline.
                    if wrote {
                        ns.backend.mark_failed();
                    }
                    peer_warn!(nsid = ns.nsid, op = ?slot.kind, error = %e, "backend I/O failed");
                }
                Reply::status(io_error_status(slot.kind, &e))
            }
        };
        self.finish(si, reply, tx, now_ms);
    }
}

/// The deallocate attribute of a Dataset Management command.
pub(super) const DSM_AD: u32 = 1 << 2;

/// Bytes of a DSM range list (256 ranges of 16 bytes): the slot's own
/// buffer holds it.
pub(super) const DSM_LIST_BYTES_MAX: usize = 256 * 16;

const _: () = assert!(DSM_LIST_BYTES_MAX <= limits::SLOT_BUF_BYTES_MAX);

/// Checks every range of a Dataset Management command. Ok(false): nothing
/// to do (no deallocate attribute).
pub(super) fn dsm_check(sqe: &Sqe, data: &[u8], ns: &Namespace) -> Result<bool, Status> {
    if sqe.cdw(11) & DSM_AD == 0 {
        return Ok(false);
    }
    let n = (sqe.cdw(10) & 0xFF) as usize + 1;
    for r in data.chunks_exact(16).take(n) {
        let (slba, nlb) = dsm_descriptor(r);
        if slba.checked_add(nlb).is_none_or(|e| e > ns.blocks) {
            return Err(Status::LBA_OUT_OF_RANGE);
        }
    }
    Ok(true)
}

/// (SLBA, NLB) of one 16-byte DSM range descriptor.
pub(super) fn dsm_descriptor(r: &[u8]) -> (u64, u64) {
    (
        nvpool_wire::le::u64_at(r, 8),
        u64::from(nvpool_wire::le::u32_at(r, 4)),
    )
}

/// Range `i` of a checked ([`dsm_check`]) DSM command as namespace bytes
/// (offset, length; length 0 for an empty range), None past the last.
pub(super) fn dsm_range(sqe: &Sqe, data: &[u8], ns: &Namespace, i: usize) -> Option<(u64, u64)> {
    let n = (sqe.cdw(10) & 0xFF) as usize + 1;
    if i >= n {
        return None;
    }
    let r = data.get(i * 16..(i + 1) * 16)?;
    let (slba, nlb) = dsm_descriptor(r);
    Some((slba << ns.block_shift, nlb << ns.block_shift))
}

/// Parses the ranges of a Dataset Management command. Ok(None): nothing to
/// do (no deallocate attribute).
pub(super) fn dsm_ranges(
    sqe: &Sqe,
    data: &[u8],
    ns: &Namespace,
) -> Result<Option<Vec<(u64, u64)>>, Status> {
    if !dsm_check(sqe, data, ns)? {
        return Ok(None);
    }
    let v = (0..)
        .map_while(|i| dsm_range(sqe, data, ns, i))
        .filter(|&(_, len)| len > 0)
        .collect();
    Ok(Some(v))
}

/// The one place a backend error becomes an NVMe status.
pub(super) fn io_error_status(kind: IoKind, e: &std::io::Error) -> Status {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => Status::CAPACITY_EXCEEDED,
        Some(libc::EROFS) => Status::NS_WRITE_PROTECTED,
        // An asynchronous backend with no room for another operation now
        // (never the result of a file operation): the host retries.
        Some(libc::EAGAIN) => Status::NS_NOT_READY,
        // A write tagged at or below a sealed snapshot's epoch (a grain
        // pool's, thin/backend.rs): only a fenced writer sends one. EBADE is
        // what Linux maps a reservation conflict to, and no file operation
        // returns it.
        Some(libc::EBADE) => Status::RESERVATION_CONFLICT,
        // A volume namespace that stopped serving between the ANA check and
        // its backend (the path lost ownership): a path error, no DNR.
        Some(libc::ENOTCONN) => Status::ANA_INACCESSIBLE,
        _ if kind == IoKind::Read => Status::UNRECOVERED_READ_ERROR,
        _ => Status::WRITE_FAULT,
    }
}
