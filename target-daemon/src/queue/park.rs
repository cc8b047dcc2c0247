//! Starting I/O: the ANA and failed-backend refusals, and parking a
//! mutation behind a copier's claim until the claim is released.

use super::*;

impl Queue {
    pub(super) fn start_io(&mut self, si: usize, tx: &mut Tx, ex: &mut Exec<'_>) {
        if self.refuse_ana(si, tx, ex) {
            return;
        }
        if self.refuse_failed(si, tx, ex) {
            return;
        }
        if !self.copy_guards_admit(si) {
            self.slots[si].state = SlotState::Parked;
            self.parked.push(si as u16);
            return;
        }
        self.issue(si, tx, ex);
    }

    /// Answers an I/O command with the ANA status of its path when the
    /// subsystem's ANA group does not serve I/O here now (inaccessible, an
    /// expired lease, persistent loss, change), before the backend is
    /// touched. Never with DNR: the host retries it on another path. True
    /// if it did.
    pub(super) fn refuse_ana(&mut self, si: usize, tx: &mut Tx, ex: &mut Exec<'_>) -> bool {
        match self.path_status(ex.now_ms) {
            Some(st) => {
                self.finish(si, Reply::status(st), tx, ex.now_ms);
                true
            }
            None => false,
        }
    }

    /// Answers a command for a failed backend with an error. True if it did.
    pub(super) fn refuse_failed(&mut self, si: usize, tx: &mut Tx, ex: &mut Exec<'_>) -> bool {
        let slot = &self.slots[si];
        let failed = slot.ns.as_ref().is_some_and(|n| n.backend.failed());
        if !failed || slot.kind == IoKind::Other {
            return false;
        }
        let st = if slot.kind == IoKind::Read {
            Status::UNRECOVERED_READ_ERROR
        } else {
            Status::WRITE_FAULT
        };
        self.finish(si, Reply::status(st), tx, ex.now_ms);
        true
    }

    /// Records a mutation in every armed copy guard over its device bytes.
    /// False: a copier claims some of them now; park and retry.
    pub(super) fn copy_guards_admit(&self, si: usize) -> bool {
        let guards = &self.target.copies().guards;
        if guards.idle() {
            return true;
        }
        let slot = &self.slots[si];
        let Some(ns) = slot.ns.as_ref() else {
            return true;
        };
        let Some(at) = ns.device else {
            return true;
        };
        match slot.kind {
            IoKind::Write => guards.host_write(&at, [(slot.off, slot.len as u64)]),
            IoKind::WriteZeroes => guards.host_write(&at, [(slot.off, slot.span)]),
            IoKind::Dsm => match dsm_ranges(&slot.sqe, slot.buf.as_slice(slot.len), ns) {
                Ok(Some(ranges)) => guards.host_write(&at, ranges),
                // Nothing to deallocate, or a bad range answered without
                // touching the device.
                Ok(None) | Err(_) => true,
            },
            IoKind::Other | IoKind::Read | IoKind::Flush => true,
        }
    }

    /// Commands parked behind a copier's claim.
    pub fn has_parked(&self) -> bool {
        !self.parked.is_empty()
    }

    /// Issues every parked command whose bytes no copier claims any more
    /// (called by the reactor each loop iteration while some are parked).
    pub fn retry_parked(&mut self, tx: &mut Tx, ex: &mut Exec<'_>) {
        let mut i = 0;
        while i < self.parked.len() && !self.poisoned() {
            let si = self.parked[i] as usize;
            if !self.expect_state(
                si,
                SlotState::Parked,
                "a parked command's slot is not parked",
            ) {
                return;
            }
            if !self.copy_guards_admit(si) {
                i += 1;
                continue;
            }
            self.parked.remove(i);
            if !self.refuse_failed(si, tx, ex) {
                self.issue(si, tx, ex);
            }
        }
    }
}
