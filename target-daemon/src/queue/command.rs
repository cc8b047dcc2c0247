//! A command from capsule to response, whichever transport brought it:
//! admission (SGL, range, size), data, execution (Connect, admin, I/O) and
//! the answer.

use super::*;

impl Queue {
    /// A command capsule, whichever transport brought it.
    pub(super) fn accept_command(
        &mut self,
        sqe: Sqe,
        icd: Option<(&[u8], bool)>,
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) -> Result<(), Fatal> {
        if self.phase != Phase::Open {
            return Ok(());
        }
        self.sq_head = (self.sq_head + 1) % self.entries.max(1);
        if let Some(c) = &self.ctrl {
            c.touch(ex.now_ms);
        }
        if self.qid == Some(0) && sqe.opcode() == aop::ASYNC_EVENT_REQUEST && self.auth_ok() {
            self.on_aer(&sqe, tx);
            return Ok(());
        }
        let Some(si) = self.free.pop() else {
            return Err(fatal(
                fes::PDU_SEQUENCE_ERROR,
                0,
                "more commands outstanding than the queue holds",
            ));
        };
        let si = si as usize;
        if !self.expect_state(si, SlotState::Free, "a slot on the free list is in use") {
            return Ok(());
        }
        {
            let s = &mut self.slots[si];
            s.sqe = sqe;
            s.state = SlotState::Admitted;
            s.len = 0;
            s.got = 0;
            s.err = None;
            s.kind = IoKind::Other;
            s.ns = None;
            s.done = 0;
            s.off = 0;
            s.span = 0;
            s.fua = false;
            s.keyed = None;
            s.zero = None;
        }
        if let Err(st) = self.admit(si, icd) {
            self.finish(si, Reply::status(st), tx, ex.now_ms);
            return Ok(());
        }
        if self.slots[si].len > limits::SLOT_BUF_BYTES_MAX {
            // In-capsule data always fits the slot's own buffer (limits.rs),
            // so what waits here has not moved a byte yet.
            debug_assert!(icd.is_none());
            match ex.bufs.lend() {
                Some(b) => self.slots[si].take_pool(b),
                None => {
                    self.slots[si].state = SlotState::AwaitBuf;
                    ex.bufs.wait(user_data(ex.conn, si as u16));
                    return Ok(());
                }
            }
        }
        self.proceed(si, icd, tx, ex);
        Ok(())
    }

    /// The reactor's pool has a buffer for slot `slot`, which waited for
    /// one. Gives it back when the slot no longer waits (its connection
    /// closed).
    pub fn on_buffer(
        &mut self,
        slot: u16,
        b: PoolBuf,
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) -> Option<PoolBuf> {
        let si = slot as usize;
        if self.is_closed()
            || self.poisoned()
            || self
                .slots
                .get(si)
                .is_none_or(|s| s.state != SlotState::AwaitBuf)
        {
            return Some(b);
        }
        let s = &mut self.slots[si];
        s.take_pool(b);
        s.state = SlotState::Admitted;
        self.proceed(si, None, tx, ex);
        None
    }

    /// Starts an admitted command whose buffer is ready: copies its
    /// in-capsule data, or asks for its data (R2T, RDMA READ), or runs it.
    pub(super) fn proceed(
        &mut self,
        si: usize,
        icd: Option<(&[u8], bool)>,
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) {
        let slot = &mut self.slots[si];
        let sqe = slot.sqe;
        let sgl = sqe.sgl();
        match (sqe.direction(), icd, slot.keyed) {
            (Direction::HostToController, Some((data, digest_ok)), _) => {
                slot.buf.as_mut_slice(data.len()).copy_from_slice(data);
                slot.got = data.len();
                if !digest_ok {
                    peer_warn!(peer = %self.peer, qid = ?self.qid, cid = sqe.cid(), "data digest mismatch in a command capsule");
                    self.finish(
                        si,
                        Reply::status(Status::TRANSIENT_TRANSPORT_ERROR),
                        tx,
                        ex.now_ms,
                    );
                    return;
                }
                self.execute(si, tx, ex);
            }
            (Direction::HostToController, None, Some(k)) if slot.len > 0 => {
                slot.state = SlotState::AwaitData;
                tx.rdma.push(RdmaWork::Fetch {
                    slot: si as u16,
                    len: slot.len as u32,
                    raddr: k.addr,
                    rkey: k.key,
                });
            }
            (Direction::HostToController, None, None)
                if slot.len > 0 && sgl.id == sgl_id::TRANSPORT =>
            {
                slot.state = SlotState::AwaitData;
                let mut out = [0u8; wtcp::R2T_HLEN + wtcp::DIGEST_LEN];
                let n = R2t {
                    cccid: sqe.cid(),
                    ttag: si as u16,
                    r2to: 0,
                    r2tl: slot.len as u32,
                }
                .encode(self.dg(), &mut out);
                tx.put(&out[..n]);
            }
            _ => self.execute(si, tx, ex),
        }
    }

    /// Checks a new command's SGL and, for I/O, its range and size; sizes the
    /// slot's buffer. In-capsule data has not been copied yet.
    pub(super) fn admit(&mut self, si: usize, icd: Option<(&[u8], bool)>) -> Result<(), Status> {
        let sqe = self.slots[si].sqe;
        if sqe.psdt() != 1 || sqe.fuse() != 0 {
            return Err(Status::INVALID_FIELD);
        }
        let sgl = sqe.sgl();
        let len = self.sgl_len(&sqe);
        let dir = sqe.direction();
        match self.transport {
            Transport::Tcp => {
                if len > 0 && sgl.id != sgl_id::IN_CAPSULE && sgl.id != sgl_id::TRANSPORT {
                    return Err(Status::SGL_TYPE_INVALID);
                }
            }
            Transport::Rdma => match KeyedSgl::of(&sqe) {
                Some(_) if !wrdma::keyed_subtype_ok(sgl.id) => return Err(Status::INVALID_FIELD),
                Some(k) => self.slots[si].keyed = Some(k),
                None if sgl.id == sgl_id::IN_CAPSULE => {
                    if self.inline_max() == 0 && len > 0 {
                        // No in-capsule data on the admin queue.
                        return Err(Status::SGL_OFFSET_INVALID);
                    }
                }
                None => return Err(Status::SGL_TYPE_INVALID),
            },
        }
        match icd {
            Some((data, _)) => {
                if sgl.id != sgl_id::IN_CAPSULE || dir != Direction::HostToController {
                    return Err(Status::INVALID_FIELD);
                }
                if sgl.addr != 0 || data.len() > self.inline_max() {
                    return Err(Status::SGL_OFFSET_INVALID);
                }
                if data.len() != len {
                    return Err(Status::SGL_DATA_INVALID);
                }
            }
            None if sgl.id == sgl_id::IN_CAPSULE && len > 0 => {
                return Err(Status::SGL_DATA_INVALID)
            }
            None => {}
        }
        if len > 0 && self.slots[si].keyed.is_some() && dir == Direction::None {
            return Err(Status::INVALID_FIELD);
        }
        if self.qid.is_some() && is_auth_cmd(&sqe) {
            // In-band authentication, on any queue, before anything else.
            let c = AuthCmd::from_sqe(&sqe);
            if !c.valid() || c.len as usize != len {
                return Err(Status::INVALID_FIELD);
            }
            self.slots[si].len = len;
        } else if self.qid.is_some() && !self.auth_ok() {
            return Err(Status::AUTH_REQUIRED);
        } else if self.qid.is_some_and(|q| q > 0) {
            self.plan_io(si)?;
        } else if len > limits::CMD_BUF_BYTES_MAX {
            return Err(Status::INVALID_FIELD);
        } else {
            self.slots[si].len = len;
        }
        let slot = &mut self.slots[si];
        if slot.len <= limits::SLOT_BUF_BYTES_MAX {
            slot.ensure_buf(slot.len.max(nvpool_wire::identify::IDENTIFY_LEN));
        }
        Ok(())
    }

    /// The data length descriptor 1 names: 24 bits in a keyed descriptor.
    pub(super) fn sgl_len(&self, sqe: &Sqe) -> usize {
        match (self.transport, KeyedSgl::of(sqe)) {
            (Transport::Rdma, Some(k)) => k.len as usize,
            _ => sqe.sgl().len as usize,
        }
    }

    pub(super) fn plan_io(&mut self, si: usize) -> Result<(), Status> {
        let sgl_len = self.sgl_len(&self.slots[si].sqe);
        let ctrl = self.ctrl.as_ref().expect("I/O queue has a controller");
        if !ctrl.is_ready() {
            return Err(Status::COMMAND_SEQUENCE_ERROR);
        }
        let slot = &mut self.slots[si];
        let sqe = slot.sqe;
        let kind = match sqe.opcode() {
            nvm::READ => IoKind::Read,
            nvm::WRITE => IoKind::Write,
            nvm::FLUSH => IoKind::Flush,
            nvm::WRITE_ZEROES => IoKind::WriteZeroes,
            nvm::DATASET_MANAGEMENT => IoKind::Dsm,
            nvm::FABRICS if sqe.fctype() == fctype::CONNECT => {
                return Err(Status::COMMAND_SEQUENCE_ERROR)
            }
            _ => return Err(Status::INVALID_OPCODE),
        };
        let subsys = ctrl.subsystem();
        let ns = subsys
            .namespaces
            .get(&sqe.nsid())
            .ok_or(Status::INVALID_NS)?
            .clone();
        if ns.read_only && kind != IoKind::Read && kind != IoKind::Flush {
            return Err(Status::NS_WRITE_PROTECTED);
        }
        match kind {
            IoKind::Read | IoKind::Write | IoKind::WriteZeroes => {
                let nlb = sqe.nlb() as u64 + 1;
                let slba = sqe.slba();
                if slba.checked_add(nlb).is_none_or(|end| end > ns.blocks) {
                    return Err(Status::LBA_OUT_OF_RANGE);
                }
                let bytes = (nlb << ns.block_shift) as usize;
                slot.off = slba << ns.block_shift;
                if kind == IoKind::WriteZeroes {
                    slot.span = bytes as u64;
                } else {
                    if bytes > limits::MDTS_BYTES {
                        return Err(Status::INVALID_FIELD);
                    }
                    if sgl_len != bytes {
                        return Err(Status::SGL_DATA_INVALID);
                    }
                    slot.len = bytes;
                    slot.fua = sqe.fua();
                }
            }
            IoKind::Dsm => {
                let ranges = (sqe.cdw(10) & 0xFF) as usize + 1;
                if sgl_len < ranges * 16 || sgl_len > 4096 {
                    return Err(Status::SGL_DATA_INVALID);
                }
                slot.len = sgl_len;
            }
            IoKind::Flush | IoKind::Other => {}
        }
        slot.kind = kind;
        slot.ns = Some(ns);
        Ok(())
    }

    /// Runs a command whose data (if any) has arrived.
    pub(super) fn execute(&mut self, si: usize, tx: &mut Tx, ex: &mut Exec<'_>) {
        if self.qid.is_some() && is_auth_cmd(&self.slots[si].sqe) {
            let reply = self.authenticate(si);
            self.finish(si, reply, tx, ex.now_ms);
            return;
        }
        match self.qid {
            None => {
                let reply = self.connect(si, ex.now_ms);
                // (A refused host was logged with its NQN already.)
                if !reply.status.is_success() && reply.status != Status::CONNECT_INVALID_HOST {
                    peer_warn!(peer = %self.peer, status = %reply.status, dw0 = reply.dw0, "Connect refused");
                }
                self.finish(si, reply, tx, ex.now_ms);
            }
            Some(0) => {
                let ctrl = self.ctrl.clone().expect("admin queue has a controller");
                let slot = &mut self.slots[si];
                let sqe = slot.sqe;
                let cap = slot.buf.capacity();
                let cx = AdminCtx {
                    target: &self.target,
                    ctrl: &ctrl,
                    local: self.local,
                    now_ms: ex.now_ms,
                };
                let mut reply = if sqe.opcode() == aop::FABRICS && sqe.fctype() == fctype::CONNECT {
                    Reply::status(Status::COMMAND_SEQUENCE_ERROR)
                } else {
                    admin::execute(&cx, &sqe, slot.buf.as_mut_slice(cap), &mut self.scratch)
                };
                reply.data_len = reply.data_len.min(slot.len);
                self.finish(si, reply, tx, ex.now_ms);
            }
            Some(_) => self.start_io(si, tx, ex),
        }
    }

    /// Sends a command's data (if any) and completion, and frees its slot.
    pub(super) fn finish(&mut self, si: usize, reply: Reply, tx: &mut Tx, _now_ms: u64) {
        if !matches!(
            self.slots.get(si).map(|s| s.state),
            Some(
                SlotState::Admitted | SlotState::AwaitData | SlotState::Parked | SlotState::Backend
            )
        ) {
            self.violation(si, "answering a command whose slot holds none");
            return;
        }
        if self.is_closed() {
            self.release(si);
            return;
        }
        if self.transport == Transport::Rdma {
            self.finish_rdma(si, reply, tx);
            return;
        }
        let slot = &self.slots[si];
        let cid = slot.sqe.cid();
        let mut resp_needed = true;
        let mut sending = false;
        if reply.status.is_success() && reply.data_len > 0 {
            // With SQ flow control off the last data PDU may carry the
            // completion itself (SUCCESS flag), saving one PDU per read.
            let mut extra = flags::LAST_PDU;
            if self.sqflow_off {
                extra |= flags::SUCCESS;
                resp_needed = false;
            }
            put_c2h_data(
                tx,
                self.dg(),
                cid,
                slot.buf.as_slice(reply.data_len),
                si as u16,
                extra,
            );
            sending = true;
        }
        if resp_needed {
            self.put_resp(
                tx,
                Cqe {
                    dw0: reply.dw0,
                    dw1: reply.dw1,
                    sqhd: self.sq_head,
                    sqid: self.qid.unwrap_or(0),
                    cid,
                    status: reply.status,
                },
            );
        }
        if !reply.status.is_success() {
            self.record_error(si, reply.status);
        }
        if sending {
            // Freed once the transmit queue has written its data.
            self.slots[si].state = SlotState::Sending;
            self.slots[si].ns = None;
        } else {
            self.release(si);
        }
    }

    pub(super) fn put_resp(&self, tx: &mut Tx, cqe: Cqe) {
        if self.transport == Transport::Rdma {
            tx.rdma.push(RdmaWork::Respond {
                cqe: cqe_bytes(&cqe),
                invalidate: None,
                release: None,
            });
            return;
        }
        let mut out = [0u8; wtcp::CAPSULE_RESP_HLEN + wtcp::DIGEST_LEN];
        let n = wtcp::encode_capsule_resp(&cqe, self.dg(), &mut out);
        tx.put(&out[..n]);
    }

    pub(super) fn record_error(&self, si: usize, st: Status) {
        if let Some(c) = &self.ctrl {
            let s = &self.slots[si];
            let io_queue = self.qid.is_some_and(|q| q > 0);
            let lba = match s.sqe.opcode() {
                nvm::READ | nvm::WRITE | nvm::WRITE_ZEROES if io_queue => s.sqe.slba(),
                _ => 0,
            };
            c.record_error(ErrorEntry {
                error_count: 0,
                sqid: self.qid.unwrap_or(0),
                cid: s.sqe.cid(),
                status: st.to_wire(),
                lba,
                nsid: s.sqe.nsid(),
            });
        }
    }

    pub(super) fn on_aer(&mut self, sqe: &Sqe, tx: &mut Tx) {
        if self.aers.len() >= limits::AER_MAX {
            self.put_resp(
                tx,
                Cqe {
                    sqhd: self.sq_head,
                    ..Cqe::new(sqe.cid(), Status::AER_LIMIT_EXCEEDED)
                },
            );
            return;
        }
        self.aers.push(sqe.cid());
    }
}
