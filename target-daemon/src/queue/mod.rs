//! One NVMe queue: the protocol state machine of one TCP connection or one
//! RDMA queue pair.
//!
//! The NVMe logic (slots, admission, execution, completion, Connect, AER,
//! keep-alive) is one core for both transports. What differs is only how a
//! command arrives, how its host data is fetched and how data and response
//! go back: on TCP a PDU stream (ICReq, CapsuleCmd, R2T/H2CData, C2HData,
//! CapsuleResp, C2HTermReq); on RDMA one receive per capsule
//! (`on_rdma_capsule`), an RDMA READ per host write (`RdmaWork::Fetch`,
//! then `on_rdma_fetched`), an RDMA WRITE of read data and a SEND of the
//! response (`RdmaWork::Deliver`, `RdmaWork::Respond`), which the reactor
//! posts from [`Tx::rdma`].
//!
//! On TCP the reactor feeds complete PDUs in (`on_pdu`), hands backend completions
//! back (`on_completion`), and ticks the queue for keep-alive and async
//! events. Everything the queue answers goes into its [`Tx`] buffer, which
//! the reactor writes to the socket once per loop iteration (batching every
//! response produced in that iteration into one send).
//!
//! ```text
//!   ICReq ─► ICResp ─► CapsuleCmd(Connect) ─► admin queue (QID 0) or I/O queue
//!   CapsuleCmd ─► slot ─┬─ in-capsule data ─────────────► execute ─► [C2HData] CapsuleResp
//!                       └─ R2T ─► H2CData… (all data) ─► execute
//!   execute (I/O) ─► io_uring (file), a backend's own threads (volume) or
//!                    inline (RAM) ─► completion ─► response
//!   execute (Write, Write Zeroes, deallocate) while a copy is armed:
//!     copy guards ─┬─ go ─► backend as above
//!                  └─ wait (a copier claims those bytes) ─► parked ─► retry_parked() ─► …
//! ```
//!
//! A mutation whose device bytes an armed copy job guards is recorded in
//! the guard before it is issued (copier.rs explains why); when the copier
//! holds a claim over those bytes the command is parked in its slot, with
//! its data, and the reactor retries it until the claim is released.
//!
//! Each command occupies a slot from submission to response. Slots are
//! allocated at Connect (one per queue entry) and keep their own buffers
//! (up to `SLOT_BUF_BYTES_MAX`); a larger transfer borrows a buffer from
//! the reactor's pool (bufpool.rs, D18) and waits in its slot, R2T or
//! execution delayed, while the pool's budget is spent. The steady-state
//! data path allocates nothing. A slot's TTAG is its index.
//!
//! A slot's life, checked at every step in release builds too (a step from
//! the wrong state is a bug: the connection ends with a logged error and
//! keeps what it holds, instead of corrupting another command):
//!
//! ```text
//!   Free ─► Admitted ─┬─────────────► [AwaitBuf ─►] [AwaitData ─►] ─┬─► Backend ─┬─► Sending ─► Free
//!                     │                                             └─► Parked ──┘   (data out)
//!                     └─ (answered at once: status, admin, Connect) ────────────────► Free
//! ```
//!
//! Write Zeroes and deallocate on a file go to the ring as fallocate
//! operations, one per range, a bounded window at a time (zeroing.rs).

use crate::admin::{self, AdminCtx, Reply};
use crate::backend::{AlignedBuf, AsyncDone, AsyncOp, AsyncResult, CompletionSink};
use crate::bufpool::{BufPool, PoolBuf};
use crate::config::Transport;
use crate::controller::Controller;
use crate::limits;
use crate::peerlog::{peer_error, peer_info, peer_warn};
use crate::ring::Ring;
use crate::target::{Namespace, Subsystem, Target};
use crate::tx::RdmaWork;
use crate::zeroing::{ZeroJob, ZeroMode, ZeroStep};
use io_uring::{opcode, types};
use nvpool_wire::auth::AuthCmd;
use nvpool_wire::dhchap::{CtrlAuth, RANDOM_BYTES};
use nvpool_wire::fabrics::{connect_off, fctype, ConnectCmd, ConnectData, CONNECT_DATA_LEN};
use nvpool_wire::log::ErrorEntry;
use nvpool_wire::rdma::{self as wrdma, KeyedSgl};
use nvpool_wire::sqe::{admin as aop, nvm, sgl_id, Direction};
use nvpool_wire::tcp::{
    self as wtcp, fes, flags, CommonHeader, DataHeader, Digests, IcReq, IcResp, PduType, R2t,
    TermReq,
};
use nvpool_wire::{Cqe, Sqe, Status, WireError};
use std::net::SocketAddr;
use std::sync::Arc;

pub use crate::tx::Tx;

mod auth;
mod command;
mod connect;
mod io;
mod park;
mod rdma;
#[cfg(test)]
mod rdma_tests;
mod slots;
mod sqe;
mod tcp;
#[cfg(test)]
mod tests;

use auth::is_auth_cmd;
use io::{dsm_range, dsm_ranges};
use rdma::cqe_bytes;
use slots::{IoKind, Slot, SlotState};
use sqe::{pump_zero, submit};
use tcp::put_c2h_data;

pub use auth::AUTHREQ_ATR;
pub use slots::SlotBuffer;
pub use sqe::{FileOp, FileOpKind, Submit};

/// A protocol violation: the connection ends with a C2HTermReq.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fatal {
    pub fes: u16,
    /// For an invalid header field: its byte offset in the PDU header.
    pub fei: u32,
    pub why: &'static str,
}

fn fatal(fes: u16, fei: u32, why: &'static str) -> Fatal {
    Fatal { fes, fei, why }
}

impl From<WireError> for Fatal {
    fn from(e: WireError) -> Fatal {
        let fei = match e {
            WireError::BadField { field: "HLEN", .. } => 2,
            WireError::BadField { field: "PDO", .. } => 3,
            WireError::BadField { field: "PLEN", .. } => 4,
            WireError::BadField { field: "HPDA", .. } => 10,
            WireError::BadField { field: "DATAL", .. } => 16,
            _ => 0,
        };
        fatal(fes::INVALID_HEADER_FIELD, fei, "malformed PDU header")
    }
}

/// Where backend work for a queue goes: file operations to the reactor's
/// ring (or none: they run inline) or a simulation's, the sink
/// asynchronous backends complete into, and the id their completions
/// carry back to this queue.
#[derive(Debug)]
pub struct Exec<'a> {
    pub ring: Option<&'a mut dyn Submit>,
    pub sink: &'a Arc<CompletionSink>,
    /// The reactor's pool of large data buffers.
    pub bufs: &'a mut BufPool,
    pub conn: u32,
    pub now_ms: u64,
}

impl<'a> Exec<'a> {
    pub fn new(
        ring: Option<&'a mut dyn Submit>,
        sink: &'a Arc<CompletionSink>,
        bufs: &'a mut BufPool,
        conn: usize,
        now_ms: u64,
    ) -> Exec<'a> {
        Exec {
            ring,
            sink,
            bufs,
            conn: conn as u32,
            now_ms,
        }
    }
}

/// Packs a connection index and slot into io_uring user data (bits 0..48;
/// the top 16 are a per-operation tag, see [`user_data_tag`]).
pub fn user_data(conn: u32, slot: u16) -> u64 {
    (conn as u64) << 16 | slot as u64
}

/// Unpacks [`user_data`] (ignoring the tag).
pub fn split_user_data(ud: u64) -> (u32, u16) {
    ((ud >> 16) as u32, ud as u16)
}

/// The tag of a ring operation's user data: a zero write's length in
/// 512-byte units (0 for every other operation).
pub fn user_data_tag(ud: u64) -> u16 {
    (ud >> 48) as u16
}

/// Where a queue is in its life. It only moves down this list, but for a
/// broken slot invariant, which ends any phase in `Poisoned` (or marks a
/// detached or closed queue poisoned).
///
/// ```text
///   Open ─► [Closing] ─► [Terminated | Poisoned] ─► Detached ─► Closed
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Reading and running commands (a TCP queue after its ICReq too).
    Open,
    /// Ending gracefully: nothing new runs; it closes once accepted
    /// commands are answered, or `SHUTDOWN_DRAIN_MS` after the tick that
    /// first saw it (`since_ms`).
    Closing { since_ms: Option<u64> },
    /// A termination was sent or received: nothing more is read; it closes
    /// once its answers are out.
    Terminated { since_ms: Option<u64> },
    /// A slot-state invariant broke: it ends as `Terminated`, and the
    /// reactor keeps it (and every buffer it holds) rather than free
    /// anything the ring might still use.
    Poisoned { since_ms: Option<u64> },
    /// Its QID is given back to its controller ([`Queue::detach`]); the
    /// connection is closing.
    Detached { poisoned: bool },
    /// The connection is gone: backend completions only free their slots.
    Closed { poisoned: bool },
}

#[derive(Debug)]
pub struct Queue {
    target: Arc<Target>,
    pub local: SocketAddr,
    pub peer: SocketAddr,
    transport: Transport,
    /// NVMe/RDMA: the QID the RDMA CM connect request named (the Connect
    /// command must name the same).
    cm_qid: Option<u16>,
    phase: Phase,
    /// The digests the ICReq negotiated; None until it came (TCP). An
    /// RDMA queue has no ICReq and no digests.
    ic: Option<Digests>,
    qid: Option<u16>,
    ctrl: Option<Arc<Controller>>,
    entries: u16,
    sq_head: u16,
    sqflow_off: bool,
    slots: Vec<Slot>,
    free: Vec<u16>,
    aers: Vec<u16>,
    /// The connection closes at this time unless a Connect succeeded by
    /// then (`limits::HANDSHAKE_TIMEOUT_MS` after it was adopted).
    handshake_deadline_ms: u64,
    scratch: Vec<u8>,
    /// Slots in `Parked` state, oldest first.
    parked: Vec<u16>,
    /// Pool buffers of freed slots, for the reactor to take back
    /// ([`Queue::take_returned`]).
    returned: Vec<PoolBuf>,
    /// Backend operations submitted to the ring or to an asynchronous
    /// backend and not yet completed.
    pub inflight: u32,
    /// DH-HMAC-CHAP of this queue, when its host has keys: until it
    /// authenticates, only Authentication Send/Receive run here.
    auth: Option<CtrlAuth>,
}

impl Queue {
    pub fn new(target: Arc<Target>, local: SocketAddr, peer: SocketAddr, now_ms: u64) -> Queue {
        let handshake_deadline_ms = now_ms.saturating_add(target.handshake_timeout_ms());
        Queue {
            target,
            local,
            peer,
            transport: Transport::Tcp,
            cm_qid: None,
            phase: Phase::Open,
            ic: None,
            qid: None,
            ctrl: None,
            entries: 1,
            sq_head: 0,
            sqflow_off: false,
            slots: vec![Slot::new()],
            free: vec![0],
            aers: Vec::new(),
            handshake_deadline_ms,
            scratch: Vec::new(),
            parked: Vec::new(),
            returned: Vec::new(),
            inflight: 0,
            auth: None,
        }
    }

    /// A queue on an RDMA queue pair whose connect request named `cm_qid`.
    pub fn new_rdma(
        target: Arc<Target>,
        local: SocketAddr,
        peer: SocketAddr,
        now_ms: u64,
        cm_qid: u16,
    ) -> Queue {
        Queue {
            transport: Transport::Rdma,
            cm_qid: Some(cm_qid),
            // No ICReq exchange on RDMA.
            ic: Some(Digests::default()),
            ..Queue::new(target, local, peer, now_ms)
        }
    }

    pub fn qid(&self) -> Option<u16> {
        self.qid
    }

    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// The queue broke a slot-state invariant (it ended): the reactor must
    /// never free it.
    pub fn poisoned(&self) -> bool {
        matches!(
            self.phase,
            Phase::Poisoned { .. }
                | Phase::Detached { poisoned: true }
                | Phase::Closed { poisoned: true }
        )
    }

    /// Where the queue is in its life.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The connection is gone ([`Queue::close`]).
    fn is_closed(&self) -> bool {
        matches!(self.phase, Phase::Closed { .. })
    }

    /// The digests in use (none before the ICReq).
    fn dg(&self) -> Digests {
        self.ic.unwrap_or_default()
    }

    /// When an ending queue's tick first saw it end (its drain deadline
    /// counts from there).
    fn end_since_ms(&self) -> Option<u64> {
        match self.phase {
            Phase::Closing { since_ms }
            | Phase::Terminated { since_ms }
            | Phase::Poisoned { since_ms } => since_ms,
            _ => None,
        }
    }

    /// A termination was sent or received: nothing more is read, and the
    /// connection closes once its answers are out.
    fn end(&mut self) {
        if matches!(self.phase, Phase::Open | Phase::Closing { .. }) {
            self.phase = Phase::Terminated {
                since_ms: self.end_since_ms(),
            };
        }
    }

    pub fn controller(&self) -> Option<&Arc<Controller>> {
        self.ctrl.as_ref()
    }

    /// The queue has ended its side (termination sent or received): close
    /// once the transmit buffer is flushed.
    pub fn wants_close(&self) -> bool {
        self.phase != Phase::Open
    }

    /// The connection was terminated: stop reading, close once flushed.
    pub fn terminated(&self) -> bool {
        !matches!(self.phase, Phase::Open | Phase::Closing { .. })
    }

    /// Commands accepted and not yet answered.
    pub fn busy(&self) -> bool {
        self.free.len() < self.slots.len() || self.inflight > 0
    }

    /// Ends the queue gracefully: no new commands run, commands already
    /// accepted finish and are answered, then the connection closes.
    pub fn request_close(&mut self) {
        if self.phase == Phase::Open {
            self.phase = Phase::Closing { since_ms: None };
        }
    }

    fn inline_max(&self) -> usize {
        if self.transport == Transport::Rdma {
            // Capsules on the admin queue are 64 bytes; an I/O queue's
            // receive buffers hold IOCCSZ (the I/O Connect may come in them).
            return match self.cm_qid {
                Some(q) if q > 0 => limits::IO_INLINE_DATA_BYTES,
                _ => 0,
            };
        }
        match self.qid {
            Some(q) if q > 0 => limits::IO_INLINE_DATA_BYTES,
            _ => limits::ADMIN_INLINE_DATA_BYTES,
        }
    }

    /// Periodic work. Returns false when the connection must close now;
    /// a controller that went away makes the queue drain first.
    pub fn tick(&mut self, now_ms: u64, tx: &mut Tx) -> bool {
        match &mut self.phase {
            Phase::Open => {}
            Phase::Closing { since_ms }
            | Phase::Terminated { since_ms }
            | Phase::Poisoned { since_ms } => {
                let since = *since_ms.get_or_insert(now_ms);
                return now_ms.saturating_sub(since) < limits::SHUTDOWN_DRAIN_MS;
            }
            Phase::Detached { .. } | Phase::Closed { .. } => return false,
        }
        let Some(ctrl) = self.ctrl.clone() else {
            // No Connect yet (nor, on TCP, maybe an ICReq): the handshake
            // deadline frees the connection's place.
            if now_ms >= self.handshake_deadline_ms {
                peer_info!(peer = %self.peer, transport = ?self.transport, ic_done = self.ic.is_some(),
                    "no Connect before the handshake deadline; closing the connection");
                return false;
            }
            return true;
        };
        if !self.auth_ok() && now_ms >= self.handshake_deadline_ms {
            peer_warn!(peer = %self.peer, cntlid = ctrl.cntlid, qid = ?self.qid, "queue not authenticated in time: closing it");
            return false;
        }
        if ctrl.is_dead() {
            self.request_close();
            return true;
        }
        if self.qid == Some(0) {
            if ctrl.expired(now_ms) {
                peer_warn!(cntlid = ctrl.cntlid, host = %ctrl.hostnqn, kato_ms = ctrl.kato_ms(), "keep-alive timeout");
                ctrl.kill("keep-alive timeout");
                self.request_close();
                return true;
            }
            // Notices a lease that ran out (and tells the hosts).
            self.target.check_ana(&ctrl.subsystem());
            while !self.aers.is_empty() {
                let Some(ev) = ctrl.take_event() else { break };
                let cid = self.aers.remove(0);
                self.put_resp(
                    tx,
                    Cqe {
                        dw0: ev,
                        sqhd: self.sq_head,
                        ..Cqe::new(cid, Status::SUCCESS)
                    },
                );
            }
        }
        true
    }

    /// Gives the queue's QID back to its controller (the admin queue ends
    /// the controller), once. The reactor calls it before it closes the
    /// socket, so a host that sees the close and connects the same QID
    /// again (from any reactor) finds it free.
    pub fn detach(&mut self) {
        if matches!(self.phase, Phase::Detached { .. } | Phase::Closed { .. }) {
            return;
        }
        self.phase = Phase::Detached {
            poisoned: self.poisoned(),
        };
        if let (Some(c), Some(q)) = (&self.ctrl, self.qid) {
            c.detach_queue(q);
            if q == 0 {
                c.kill("admin queue closed");
            }
        }
    }

    /// The connection is gone: detach from the controller. Closing the admin
    /// queue ends the controller, as it does for the Linux target.
    pub fn close(&mut self) {
        if self.is_closed() {
            return;
        }
        self.detach();
        self.phase = Phase::Closed {
            poisoned: self.poisoned(),
        };
        // Slots waiting for a buffer or data, or parked (nothing of theirs
        // is in the ring) are free now; those in the backend are released
        // by their completions. (The reactor forgets the buffer waits.)
        self.parked.clear();
        for i in 0..self.slots.len() {
            if matches!(
                self.slots[i].state,
                SlotState::AwaitBuf | SlotState::AwaitData | SlotState::Parked
            ) {
                self.release(i);
            }
        }
    }
}
