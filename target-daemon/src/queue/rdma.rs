//! NVMe/RDMA framing of the queue: received capsules, RDMA READs of host
//! data, and the RDMA WRITE plus SEND that answer a command.

use super::*;

impl Queue {
    /// NVMe/RDMA: one received command capsule (the SQE, then in-capsule
    /// data if any). Err: the queue pair must be torn down.
    pub fn on_rdma_capsule(
        &mut self,
        cap: &[u8],
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) -> Result<(), Fatal> {
        let r = self.rdma_capsule(cap, tx, ex);
        if let Err(f) = r {
            self.terminate(f, cap, tx);
        }
        r
    }

    pub(super) fn rdma_capsule(
        &mut self,
        cap: &[u8],
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) -> Result<(), Fatal> {
        let Some(sqe) = cap.get(..64).and_then(Sqe::from_slice) else {
            return Err(fatal(
                fes::INVALID_HEADER_FIELD,
                0,
                "capsule shorter than an SQE",
            ));
        };
        let icd = match sqe.sgl() {
            sgl if sgl.id == sgl_id::IN_CAPSULE => {
                // ICDOFF is 0: the offset counts from the end of the SQE.
                let data = &cap[64..];
                let start = (sgl.addr as usize).min(data.len());
                let end = start.saturating_add(sgl.len as usize).min(data.len());
                Some((&data[start..end], true))
            }
            _ => None,
        };
        self.accept_command(sqe, icd, tx, ex)
    }

    /// NVMe/RDMA: the RDMA READ of slot `slot`'s host data completed.
    pub fn on_rdma_fetched(&mut self, slot: u16, tx: &mut Tx, ex: &mut Exec<'_>) {
        let si = slot as usize;
        if self.is_closed() || self.poisoned() {
            return;
        }
        if !self.expect_state(
            si,
            SlotState::AwaitData,
            "RDMA READ done for a slot not waiting for data",
        ) {
            return;
        }
        let s = &mut self.slots[si];
        s.got = s.len;
        self.execute(si, tx, ex);
    }

    /// NVMe/RDMA: an RDMA WRITE of the read data (if any), then the SEND of
    /// the response, which invalidates the host's key when it asked for
    /// that. A slot whose data is written stays in `Sending` until the
    /// SEND completes (RC executes in order, so the WRITE is done then).
    pub(super) fn finish_rdma(&mut self, si: usize, reply: Reply, tx: &mut Tx) {
        let slot = &self.slots[si];
        let keyed = slot.keyed;
        let cqe = Cqe {
            dw0: reply.dw0,
            dw1: reply.dw1,
            sqhd: self.sq_head,
            sqid: self.qid.unwrap_or(0),
            cid: slot.sqe.cid(),
            status: reply.status,
        };
        let mut release = None;
        if reply.status.is_success() && reply.data_len > 0 {
            if let Some(k) = keyed {
                tx.rdma.push(RdmaWork::Deliver {
                    slot: si as u16,
                    len: reply.data_len as u32,
                    raddr: k.addr,
                    rkey: k.key,
                });
                release = Some(si as u16);
            }
        }
        tx.rdma.push(RdmaWork::Respond {
            cqe: cqe_bytes(&cqe),
            invalidate: keyed.filter(|k| k.invalidate && k.len > 0).map(|k| k.key),
            release,
        });
        if !reply.status.is_success() {
            self.record_error(si, reply.status);
        }
        if release.is_some() {
            self.slots[si].state = SlotState::Sending;
            self.slots[si].ns = None;
        } else {
            self.release(si);
        }
    }
}

pub(super) fn cqe_bytes(c: &Cqe) -> [u8; 16] {
    let mut b = [0u8; 16];
    c.encode(&mut b);
    b
}
