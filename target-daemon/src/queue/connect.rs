//! Fabrics Connect: creating a controller (admin queue) or joining one
//! (I/O queue), and sizing the queue's slots.

use super::*;

impl Queue {
    pub(super) fn connect(&mut self, si: usize, now_ms: u64) -> Reply {
        let slot = &self.slots[si];
        let sqe = slot.sqe;
        if sqe.opcode() != aop::FABRICS || sqe.fctype() != fctype::CONNECT {
            return Reply::status(Status::COMMAND_SEQUENCE_ERROR);
        }
        let invalid = |iattr_data: bool, off: u32| Reply {
            dw0: (iattr_data as u32) << 16 | off,
            ..Reply::status(Status::CONNECT_INVALID_PARAMETERS)
        };
        if slot.len != CONNECT_DATA_LEN {
            return Reply::status(Status::SGL_DATA_INVALID);
        }
        let cmd = ConnectCmd::from_sqe(&sqe);
        if cmd.recfmt != 0 {
            return Reply::status(Status::CONNECT_INCOMPATIBLE_FORMAT);
        }
        let data = match ConnectData::decode(slot.buf.as_slice(CONNECT_DATA_LEN)) {
            Ok(d) => d,
            Err(
                WireError::BadField {
                    field: "HOSTNQN", ..
                }
                | WireError::BadString {
                    field: "HOSTNQN", ..
                },
            ) => return invalid(true, connect_off::HOSTNQN),
            Err(_) => return invalid(true, connect_off::SUBNQN),
        };
        let entries = cmd.sqsize as u32 + 1;
        if self.cm_qid.is_some_and(|q| q != cmd.qid) {
            // The queue pair was set up for another queue.
            return invalid(false, 42);
        }
        if cmd.qid == 0 {
            if cmd.sqsize == 0 || entries > limits::ADMIN_QUEUE_ENTRIES_MAX as u32 {
                return invalid(false, 44);
            }
            if data.cntlid != 0xFFFF {
                return invalid(true, connect_off::CNTLID);
            }
            if cmd.kato_ms > limits::KATO_MAX_MS {
                return invalid(false, 48);
            }
            let discovery = data.subnqn == nvpool_wire::DISCOVERY_NQN;
            let subsys = if discovery {
                Arc::new(Subsystem::discovery())
            } else {
                match self.target.subsystem(data.subnqn) {
                    Some(s) => s,
                    None => return invalid(true, connect_off::SUBNQN),
                }
            };
            if !subsys.host_allowed(data.hostnqn) {
                peer_warn!(peer = %self.peer, host = data.hostnqn, subsys = data.subnqn, "connect refused: host not allowed");
                return Reply::status(Status::CONNECT_INVALID_HOST);
            }
            let Some(ctrl) = self.target.create_controller(
                subsys,
                data.hostnqn,
                data.hostid,
                cmd.kato_ms,
                discovery,
                self.transport,
            ) else {
                return Reply::status(Status::CONNECT_CONTROLLER_BUSY);
            };
            ctrl.attach_queue(0);
            peer_info!(peer = %self.peer, cntlid = ctrl.cntlid, subsys = data.subnqn, host = data.hostnqn, kato_ms = cmd.kato_ms, "controller created");
            let cntlid = ctrl.cntlid;
            let subsys = Arc::clone(&ctrl.subsystem());
            let hostnqn = data.hostnqn.to_owned();
            self.bind(ctrl, 0, entries as u16, cmd.sq_flow_control_disabled());
            let authreq = self.require_auth(&subsys, &hostnqn);
            return Reply::dw0(cntlid as u32 | authreq);
        }
        // I/O queue.
        let Some(ctrl) = self.target.controller(data.cntlid) else {
            return invalid(true, connect_off::CNTLID);
        };
        if ctrl.subsys_nqn != data.subnqn {
            return invalid(true, connect_off::SUBNQN);
        }
        if ctrl.hostnqn != data.hostnqn {
            return invalid(true, connect_off::HOSTNQN);
        }
        if ctrl.transport != self.transport {
            return invalid(true, connect_off::CNTLID);
        }
        let max_qid = match ctrl.io_queues_granted() {
            0 => limits::IO_QUEUES_PER_CTRL_MAX,
            g => g,
        };
        if ctrl.discovery || cmd.qid > max_qid {
            return invalid(false, 42);
        }
        if cmd.sqsize == 0 || entries > limits::IO_QUEUE_ENTRIES_MAX as u32 {
            return invalid(false, 44);
        }
        if !ctrl.is_ready() {
            return Reply::status(Status::COMMAND_SEQUENCE_ERROR);
        }
        if !ctrl.attach_queue(cmd.qid) {
            return invalid(false, 42);
        }
        ctrl.touch(now_ms);
        tracing::debug!(peer = %self.peer, cntlid = ctrl.cntlid, qid = cmd.qid, entries, "I/O queue connected");
        let subsys = Arc::clone(&ctrl.subsystem());
        let hostnqn = data.hostnqn.to_owned();
        self.bind(
            ctrl,
            cmd.qid,
            entries as u16,
            cmd.sq_flow_control_disabled(),
        );
        Reply::dw0(self.require_auth(&subsys, &hostnqn))
    }

    pub(super) fn bind(&mut self, ctrl: Arc<Controller>, qid: u16, entries: u16, sqflow_off: bool) {
        self.ctrl = Some(ctrl);
        self.qid = Some(qid);
        self.entries = entries;
        self.sqflow_off = sqflow_off;
        // Slot 0 is the Connect command itself, released by finish().
        self.slots.resize_with(entries as usize, Slot::new);
        self.free = (1..entries).rev().collect();
        // Parking and returning buffers never allocate on the data path.
        self.parked = Vec::with_capacity(entries as usize);
        self.returned = Vec::with_capacity(entries as usize);
    }
}
