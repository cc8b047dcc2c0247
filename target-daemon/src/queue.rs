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
use crate::zeroing::{ZeroJob, ZeroMode, ZeroOp, ZeroStep};
use io_uring::{opcode, types};
use nvpool_wire::auth::AuthCmd;
use nvpool_wire::dhchap::{CtrlAuth, RANDOM_BYTES};
use nvpool_wire::fabrics::{connect_off, fctype, ConnectCmd, ConnectData, CONNECT_DATA_LEN};
use nvpool_wire::log::ErrorEntry;
use nvpool_wire::rdma::{self as wrdma, KeyedSgl};
use nvpool_wire::sqe::{admin as aop, nvm, sgl_id, Direction};
use nvpool_wire::tcp::{
    self, fes, flags, CommonHeader, DataHeader, Digests, IcReq, IcResp, PduType, R2t, TermReq,
};
use nvpool_wire::{Cqe, Sqe, Status, WireError};
use std::net::SocketAddr;
use std::sync::Arc;

pub use crate::tx::Tx;

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    /// Taken by a command being checked and started (within one call).
    Admitted,
    /// Needs a pool buffer and waits for one (bufpool.rs): nothing of the
    /// transfer has happened yet.
    AwaitBuf,
    AwaitData,
    /// Its data is in, but a copier holds a claim over the bytes it
    /// changes: issued by [`Queue::retry_parked`] once the claim is gone.
    Parked,
    Backend,
    /// Its data is queued for the socket, referenced in place.
    Sending,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IoKind {
    Other,
    Read,
    Write,
    Flush,
    WriteZeroes,
    Dsm,
}

#[derive(Debug)]
struct Slot {
    sqe: Sqe,
    /// The data buffer in use: the slot's own, or one lent by the pool.
    buf: AlignedBuf,
    /// While `buf` is lent: the slot's own buffer, put aside, and the id
    /// of the lent one (both Some or both None).
    own: Option<AlignedBuf>,
    lent: Option<u32>,
    state: SlotState,
    /// Bytes of data this command moves (either direction).
    len: usize,
    /// Host-to-controller bytes received so far.
    got: usize,
    /// Set when received data was damaged (data digest).
    err: Option<Status>,
    kind: IoKind,
    ns: Option<Arc<Namespace>>,
    /// Namespace byte offset of Read/Write/Write Zeroes.
    off: u64,
    /// Bytes the backend finished (short io_uring transfers resubmit the rest).
    done: usize,
    /// Bytes of the range a Write Zeroes command covers.
    span: u64,
    fua: bool,
    /// NVMe/RDMA: the host memory a keyed SGL names.
    keyed: Option<KeyedSgl>,
    /// Write Zeroes or deallocate on the ring: its operations.
    zero: Option<ZeroJob>,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            sqe: Sqe::default(),
            buf: AlignedBuf::new(4096),
            own: None,
            lent: None,
            state: SlotState::Free,
            len: 0,
            got: 0,
            err: None,
            kind: IoKind::Other,
            ns: None,
            off: 0,
            done: 0,
            span: 0,
            fua: false,
            keyed: None,
            zero: None,
        }
    }

    /// Grows the slot's own buffer (never a lent one) to `n` bytes.
    fn ensure_buf(&mut self, n: usize) {
        debug_assert!(n <= limits::SLOT_BUF_BYTES_MAX && self.lent.is_none());
        if self.buf.capacity() < n {
            self.buf = AlignedBuf::new(n.next_power_of_two());
        }
    }

    /// Uses a pool buffer for this command.
    fn take_pool(&mut self, b: PoolBuf) {
        debug_assert!(self.lent.is_none());
        self.own = Some(std::mem::replace(&mut self.buf, b.buf));
        self.lent = Some(b.id);
    }

    /// The pool buffer this slot holds, if any; its own buffer is back.
    fn give_pool(&mut self) -> Option<PoolBuf> {
        self.lent?;
        // A lent buffer put the own one aside; without it, keep the slot
        // as it is rather than lose its buffer.
        let own = self.own.take()?;
        let id = self.lent.take()?;
        Some(PoolBuf {
            buf: std::mem::replace(&mut self.buf, own),
            id,
        })
    }
}

/// A slot's data buffer as the RDMA transport registers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotBuffer {
    pub ptr: *mut u8,
    pub cap: usize,
    /// A pool buffer's id (its address is stable for the reactor's life),
    /// None for the slot's own buffer.
    pub pool_id: Option<u32>,
}

/// Where backend work for a queue goes: the reactor's ring (or none), the
/// sink asynchronous backends complete into, and the id their completions
/// carry back to this queue.
#[derive(Debug)]
pub struct Exec<'a> {
    pub ring: Option<&'a mut Ring>,
    pub sink: &'a Arc<CompletionSink>,
    /// The reactor's pool of large data buffers.
    pub bufs: &'a mut BufPool,
    pub conn: u32,
    pub now_ms: u64,
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

#[derive(Debug)]
pub struct Queue {
    target: Arc<Target>,
    pub local: SocketAddr,
    pub peer: SocketAddr,
    transport: Transport,
    /// NVMe/RDMA: the QID the RDMA CM connect request named (the Connect
    /// command must name the same).
    cm_qid: Option<u16>,
    ic_done: bool,
    draining: bool,
    closed: bool,
    /// The queue's QID was given back to its controller ([`Queue::detach`]).
    detached: bool,
    close_requested: bool,
    /// When close was requested (graceful drains end at a deadline).
    close_since_ms: Option<u64>,
    /// A termination was sent or received: nothing more is read.
    terminated: bool,
    dg: Digests,
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
    /// A slot-state invariant was found broken: the connection ends, and
    /// the reactor keeps it (and every buffer it holds) rather than free
    /// anything the ring might still use.
    poisoned: bool,
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
            ic_done: false,
            draining: false,
            closed: false,
            detached: false,
            close_requested: false,
            close_since_ms: None,
            terminated: false,
            dg: Digests::default(),
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
            poisoned: false,
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
            ic_done: true,
            ..Queue::new(target, local, peer, now_ms)
        }
    }

    pub fn qid(&self) -> Option<u16> {
        self.qid
    }

    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// A slot's data buffer, for the RDMA transport to register. The
    /// slot's own buffer stays valid until it grows; a pool buffer for the
    /// reactor's life.
    pub fn slot_buffer(&mut self, slot: u16) -> SlotBuffer {
        let s = &mut self.slots[slot as usize];
        let cap = s.buf.capacity();
        SlotBuffer {
            ptr: s.buf.as_mut_slice(cap).as_mut_ptr(),
            cap,
            pool_id: s.lent,
        }
    }

    /// Hands the pool buffers of freed slots back to `pool`.
    pub fn take_returned(&mut self, pool: &mut BufPool) {
        for b in self.returned.drain(..) {
            pool.give_back(b);
        }
    }

    /// The queue broke a slot-state invariant (it ended): the reactor must
    /// never free it.
    pub fn poisoned(&self) -> bool {
        self.poisoned
    }

    /// Ends the connection for a broken slot-state invariant: a bug, found
    /// before it could corrupt another command. Nothing of the slot is
    /// touched; the queue stops reading and executing, and is never freed
    /// (what the ring may still point at stays valid).
    fn violation(&mut self, si: usize, what: &'static str) {
        let state = self.slots.get(si).map(|s| s.state);
        peer_error!(peer = %self.peer, qid = ?self.qid, slot = si, ?state, "{what}: slot-state invariant broken; ending the connection");
        self.poisoned = true;
        self.draining = true;
        self.close_requested = true;
        self.terminated = true;
    }

    /// Checks that slot `si` exists and is in `want` before a step that
    /// needs it; a violation otherwise.
    fn expect_state(&mut self, si: usize, want: SlotState, what: &'static str) -> bool {
        if self.slots.get(si).is_some_and(|s| s.state == want) {
            return true;
        }
        self.violation(si, what);
        false
    }

    pub fn controller(&self) -> Option<&Arc<Controller>> {
        self.ctrl.as_ref()
    }

    /// The queue has ended its side (termination sent or received): close
    /// once the transmit buffer is flushed.
    pub fn wants_close(&self) -> bool {
        self.close_requested
    }

    /// The connection was terminated: stop reading, close once flushed.
    pub fn terminated(&self) -> bool {
        self.terminated
    }

    /// Commands accepted and not yet answered.
    pub fn busy(&self) -> bool {
        self.free.len() < self.slots.len() || self.inflight > 0
    }

    /// Stops executing new commands (shutdown): in-flight ones finish, new
    /// ones are left unanswered for the host to retry after it reconnects.
    pub fn begin_drain(&mut self) {
        self.draining = true;
    }

    /// Ends the queue gracefully: no new commands run, commands already
    /// accepted finish and are answered, then the connection closes.
    pub fn request_close(&mut self) {
        self.draining = true;
        self.close_requested = true;
    }

    /// Checks a common header as soon as its 8 bytes are in, before the rest
    /// of the PDU is read. Returns PLEN.
    pub fn check_header(&self, raw: &[u8]) -> Result<usize, Fatal> {
        let ch = CommonHeader::decode(raw)?;
        let hd = if ch.pdu_type.has_header_digest() {
            self.dg.hdgst_len()
        } else {
            0
        };
        // Room for a header digest and alignment padding (at most 128 bytes).
        let overhead = ch.hlen as usize + hd + 128 + self.dg.ddgst_len();
        let max = match (ch.pdu_type, self.ic_done) {
            (PduType::IcReq, false) => tcp::IC_PDU_LEN,
            (_, false) => return Err(fatal(fes::PDU_SEQUENCE_ERROR, 0, "PDU before ICReq")),
            (PduType::IcReq, true) => {
                return Err(fatal(fes::PDU_SEQUENCE_ERROR, 0, "second ICReq"))
            }
            (PduType::CapsuleCmd, true) => overhead + self.inline_max(),
            (PduType::H2CData, true) => overhead + limits::MAXH2CDATA_BYTES as usize,
            (PduType::H2CTermReq, true) => tcp::TERM_HLEN + tcp::TERM_DATA_MAX,
            (_, true) => {
                return Err(fatal(
                    fes::INVALID_HEADER_FIELD,
                    0,
                    "PDU type a host may not send",
                ))
            }
        };
        if ch.plen as usize > max {
            let code = if ch.pdu_type == PduType::H2CData {
                fes::R2T_LIMIT_EXCEEDED
            } else {
                fes::INVALID_HEADER_FIELD
            };
            return Err(fatal(code, 4, "PDU longer than allowed"));
        }
        Ok(ch.plen as usize)
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

    /// Bytes of a received RDMA capsule this queue's receive buffers hold.
    pub fn rdma_capsule_max(&self) -> usize {
        64 + self.inline_max()
    }

    /// Handles one complete PDU (`pdu.len()` == PLEN, header already checked).
    /// Err: the connection must end; the C2HTermReq is already queued.
    pub fn on_pdu(&mut self, pdu: &[u8], tx: &mut Tx, ex: &mut Exec<'_>) -> Result<(), Fatal> {
        let r = self.dispatch(pdu, tx, ex);
        if let Err(f) = r {
            self.terminate(f, pdu, tx);
        }
        r
    }

    /// Ends the connection for a protocol violation found in `pdu` (whose
    /// header is quoted in the C2HTermReq).
    pub fn fail(&mut self, f: Fatal, pdu: &[u8], tx: &mut Tx) {
        self.terminate(f, pdu, tx)
    }

    fn terminate(&mut self, f: Fatal, pdu: &[u8], tx: &mut Tx) {
        peer_warn!(peer = %self.peer, fes = f.fes, fei = f.fei, why = f.why, "protocol violation: terminating the connection");
        if self.transport == Transport::Rdma {
            // No termination PDU on RDMA: the queue pair is disconnected.
            self.draining = true;
            self.close_requested = true;
            self.terminated = true;
            return;
        }
        let hlen = pdu
            .get(2)
            .map_or(8, |&h| h as usize)
            .clamp(8, tcp::TERM_DATA_MAX)
            .min(pdu.len());
        let mut out = [0u8; tcp::TERM_HLEN + tcp::TERM_DATA_MAX];
        let n = TermReq {
            fes: f.fes,
            fei: f.fei,
        }
        .encode(PduType::C2HTermReq, &pdu[..hlen], &mut out);
        tx.put(&out[..n]);
        self.draining = true;
        self.close_requested = true;
        self.terminated = true;
    }

    fn dispatch(&mut self, pdu: &[u8], tx: &mut Tx, ex: &mut Exec<'_>) -> Result<(), Fatal> {
        let ch = CommonHeader::decode(pdu)?;
        match ch.pdu_type {
            PduType::IcReq => return self.on_icreq(pdu, tx),
            PduType::H2CTermReq => {
                let t = TermReq::decode(pdu).ok();
                peer_info!(peer = %self.peer, fes = t.map(|t| t.fes), "host terminated the connection");
                self.draining = true;
                self.close_requested = true;
                self.terminated = true;
                return Ok(());
            }
            _ => {}
        }
        self.check_digest_flags(&ch, pdu)?;
        match ch.pdu_type {
            PduType::CapsuleCmd => self.on_capsule(&ch, pdu, tx, ex),
            PduType::H2CData => self.on_h2c_data(&ch, pdu, tx, ex),
            _ => Err(fatal(fes::INVALID_HEADER_FIELD, 0, "unexpected PDU type")),
        }
    }

    fn check_digest_flags(&self, ch: &CommonHeader, pdu: &[u8]) -> Result<(), Fatal> {
        let hflag = ch.flags & flags::HDGSTF != 0;
        if hflag != self.dg.header {
            return Err(fatal(
                fes::INVALID_HEADER_FIELD,
                1,
                "HDGSTF does not match the negotiated digest",
            ));
        }
        if self.dg.header && !tcp::header_digest_ok(pdu, ch.hlen as usize) {
            return Err(fatal(fes::HEADER_DIGEST_ERROR, 0, "header digest mismatch"));
        }
        let has_data = ch.pdo != 0;
        let dflag = ch.flags & flags::DDGSTF != 0;
        if dflag != (self.dg.data && has_data) {
            return Err(fatal(
                fes::INVALID_HEADER_FIELD,
                1,
                "DDGSTF does not match the negotiated digest",
            ));
        }
        Ok(())
    }

    /// The data bytes of a PDU and whether their digest matched.
    fn pdu_data<'p>(&self, ch: &CommonHeader, pdu: &'p [u8]) -> Result<(&'p [u8], bool), Fatal> {
        let start = tcp::data_offset(ch, self.dg);
        let end = pdu
            .len()
            .checked_sub(self.dg.ddgst_len())
            .filter(|&e| e >= start)
            .ok_or(fatal(
                fes::INVALID_HEADER_FIELD,
                3,
                "PDO past the end of the PDU",
            ))?;
        let data = &pdu[start..end];
        let ok =
            !self.dg.data || nvpool_wire::digest::crc32c(data).to_le_bytes() == pdu[end..end + 4];
        Ok((data, ok))
    }

    fn on_icreq(&mut self, pdu: &[u8], tx: &mut Tx) -> Result<(), Fatal> {
        let req = IcReq::decode(pdu)?;
        if req.pfv != 0 {
            return Err(fatal(
                fes::INVALID_HEADER_FIELD,
                8,
                "unsupported PDU format version",
            ));
        }
        if req.hpda != 0 {
            // We never pad C2H data; a host that needs alignment is refused.
            return Err(fatal(
                fes::UNSUPPORTED_PARAMETER,
                10,
                "host PDU data alignment not supported",
            ));
        }
        self.dg = req.digests;
        self.ic_done = true;
        tx.put(
            &IcResp {
                pfv: 0,
                cpda: 0,
                digests: req.digests,
                maxh2cdata: limits::MAXH2CDATA_BYTES,
            }
            .encode(),
        );
        Ok(())
    }

    fn on_capsule(
        &mut self,
        ch: &CommonHeader,
        pdu: &[u8],
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) -> Result<(), Fatal> {
        let sqe = Sqe::from_slice(&pdu[tcp::CH_LEN..tcp::CAPSULE_CMD_HLEN])
            .expect("header length checked");
        let icd = if ch.pdo == 0 {
            if pdu.len() != tcp::CAPSULE_CMD_HLEN + self.dg.hdgst_len() {
                return Err(fatal(
                    fes::INVALID_HEADER_FIELD,
                    4,
                    "PLEN does not match a capsule without data",
                ));
            }
            None
        } else {
            Some(self.pdu_data(ch, pdu)?)
        };
        self.accept_command(sqe, icd, tx, ex)
    }

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

    fn rdma_capsule(&mut self, cap: &[u8], tx: &mut Tx, ex: &mut Exec<'_>) -> Result<(), Fatal> {
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
        if self.closed || self.poisoned {
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

    /// A command capsule, whichever transport brought it.
    fn accept_command(
        &mut self,
        sqe: Sqe,
        icd: Option<(&[u8], bool)>,
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) -> Result<(), Fatal> {
        if self.draining || self.poisoned {
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
        if self.closed
            || self.poisoned
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
    fn proceed(&mut self, si: usize, icd: Option<(&[u8], bool)>, tx: &mut Tx, ex: &mut Exec<'_>) {
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
                let mut out = [0u8; tcp::R2T_HLEN + tcp::DIGEST_LEN];
                let n = R2t {
                    cccid: sqe.cid(),
                    ttag: si as u16,
                    r2to: 0,
                    r2tl: slot.len as u32,
                }
                .encode(self.dg, &mut out);
                tx.put(&out[..n]);
            }
            _ => self.execute(si, tx, ex),
        }
    }

    /// Checks a new command's SGL and, for I/O, its range and size; sizes the
    /// slot's buffer. In-capsule data has not been copied yet.
    fn admit(&mut self, si: usize, icd: Option<(&[u8], bool)>) -> Result<(), Status> {
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
    fn sgl_len(&self, sqe: &Sqe) -> usize {
        match (self.transport, KeyedSgl::of(sqe)) {
            (Transport::Rdma, Some(k)) => k.len as usize,
            _ => sqe.sgl().len as usize,
        }
    }

    fn plan_io(&mut self, si: usize) -> Result<(), Status> {
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

    fn on_h2c_data(
        &mut self,
        ch: &CommonHeader,
        pdu: &[u8],
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) -> Result<(), Fatal> {
        let h = DataHeader::decode(ch, pdu, self.dg)?;
        if h.datal > limits::MAXH2CDATA_BYTES {
            return Err(fatal(
                fes::R2T_LIMIT_EXCEEDED,
                16,
                "H2CData longer than MAXH2CDATA",
            ));
        }
        let si = h.ttag as usize;
        let slot = self
            .slots
            .get(si)
            .filter(|s| s.state == SlotState::AwaitData)
            .ok_or(fatal(
                fes::INVALID_HEADER_FIELD,
                10,
                "H2CData for an unknown transfer tag",
            ))?;
        if slot.sqe.cid() != h.cccid {
            return Err(fatal(
                fes::INVALID_HEADER_FIELD,
                8,
                "H2CData CCCID does not match its transfer tag",
            ));
        }
        if h.datao as usize != slot.got || slot.got + h.datal as usize > slot.len {
            return Err(fatal(
                fes::DATA_OUT_OF_RANGE,
                12,
                "H2CData outside the requested range",
            ));
        }
        let (data, digest_ok) = self.pdu_data(ch, pdu)?;
        let slot = &mut self.slots[si];
        let got = slot.got;
        slot.buf.as_mut_slice(got + data.len())[got..].copy_from_slice(data);
        slot.got += data.len();
        if !digest_ok {
            slot.err = Some(Status::TRANSIENT_TRANSPORT_ERROR);
            peer_warn!(peer = %self.peer, qid = ?self.qid, cid = h.cccid, "data digest mismatch in H2CData");
        }
        if slot.got == slot.len {
            match slot.err {
                Some(st) => self.finish(si, Reply::status(st), tx, ex.now_ms),
                None => self.execute(si, tx, ex),
            }
        }
        Ok(())
    }

    /// Runs a command whose data (if any) has arrived.
    fn execute(&mut self, si: usize, tx: &mut Tx, ex: &mut Exec<'_>) {
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

    /// Commands other than authentication may run: the host needs no
    /// authentication here, or this queue passed it.
    fn auth_ok(&self) -> bool {
        self.auth.as_ref().is_none_or(CtrlAuth::authenticated)
    }

    /// Starts DH-HMAC-CHAP on a queue just connected when its host has
    /// keys; returns the AUTHREQ bits of the Connect response (ATR).
    fn require_auth(&mut self, subsys: &Subsystem, hostnqn: &str) -> u32 {
        match subsys.host_keys.get(hostnqn) {
            Some(a) => {
                self.auth = Some(CtrlAuth::new(a.policy.clone(), hostnqn, &subsys.nqn));
                AUTHREQ_ATR
            }
            None => 0,
        }
    }

    /// Runs an Authentication Send or Receive (admitted: SECP, SPSP and
    /// length checked). A message the exchange rejects still completes
    /// the Send; the next Receive carries AUTH_Failure1.
    fn authenticate(&mut self, si: usize) -> Reply {
        let Some(auth) = self.auth.as_mut() else {
            return Reply::status(Status::COMMAND_SEQUENCE_ERROR);
        };
        let was = auth.authenticated();
        let slot = &mut self.slots[si];
        let reply = if slot.sqe.fctype() == fctype::AUTH_SEND {
            // A new exchange (a re-authentication of a live queue) checks
            // the host's keys as the subsystem holds them now, so that
            // rotated keys take effect without a reconnect.
            if let Some(ctrl) = &self.ctrl {
                if let Some(a) = ctrl.subsystem().host_keys.get(&ctrl.hostnqn) {
                    auth.renew_policy(a.policy.clone());
                }
            }
            auth.on_send(slot.buf.as_slice(slot.len));
            Reply::ok()
        } else {
            let mut random = zeroize::Zeroizing::new([0u8; RANDOM_BYTES]);
            if getrandom::getrandom(&mut random[..]).is_err() {
                peer_error!(peer = %self.peer, "no random bytes for authentication");
                return Reply::status(Status::INTERNAL_ERROR);
            }
            let msg = auth.on_receive(&random);
            // Exactly AL bytes: the message, then zeros (the Linux host
            // always asks for 4096).
            let al = slot.len;
            let out = slot.buf.as_mut_slice(al);
            out.fill(0);
            let n = msg.len().min(al);
            out[..n].copy_from_slice(&msg[..n]);
            Reply::data(al)
        };
        let (now, failed) = (auth.authenticated(), auth.failed());
        let ctrl = self.ctrl.as_ref().map(|c| (c.cntlid, c.hostnqn.as_str()));
        if now && !was {
            peer_info!(peer = %self.peer, ctrl = ?ctrl, qid = ?self.qid, "queue authenticated (DH-HMAC-CHAP)");
        } else if failed && slot.sqe.fctype() == fctype::AUTH_RECEIVE {
            peer_warn!(peer = %self.peer, ctrl = ?ctrl, qid = ?self.qid, "DH-HMAC-CHAP authentication failed");
        }
        reply
    }

    fn start_io(&mut self, si: usize, tx: &mut Tx, ex: &mut Exec<'_>) {
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
    fn refuse_ana(&mut self, si: usize, tx: &mut Tx, ex: &mut Exec<'_>) -> bool {
        match self.path_status(ex.now_ms) {
            Some(st) => {
                self.finish(si, Reply::status(st), tx, ex.now_ms);
                true
            }
            None => false,
        }
    }

    /// Answers a command for a failed backend with an error. True if it did.
    fn refuse_failed(&mut self, si: usize, tx: &mut Tx, ex: &mut Exec<'_>) -> bool {
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
    fn copy_guards_admit(&self, si: usize) -> bool {
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
        while i < self.parked.len() && !self.poisoned {
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

    /// Sends an admitted I/O command to its backend.
    fn issue(&mut self, si: usize, tx: &mut Tx, ex: &mut Exec<'_>) {
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
    fn issue_async(&mut self, si: usize, ns: &Namespace, tx: &mut Tx, ex: &mut Exec<'_>) {
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
        slot.state = SlotState::Backend;
        self.inflight += 1;
        // May complete at once, on this thread: the completion then waits
        // in the sink like any other until the reactor takes it.
        ns.backend.submit(
            op,
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
        if self.closed {
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
    fn path_status(&self, now_ms: u64) -> Option<Status> {
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
    fn backend_completion(&mut self, si: usize, what: &'static str) -> bool {
        if self.poisoned {
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
        if self.closed {
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
    fn on_zero_completion(
        &mut self,
        si: usize,
        tag: u16,
        res: i32,
        tx: &mut Tx,
        ex: &mut Exec<'_>,
    ) {
        let closed = self.closed;
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
    fn finish_zero(&mut self, si: usize, r: Result<(), i32>, tx: &mut Tx, now_ms: u64) {
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

    /// Sends a command's data (if any) and completion, and frees its slot.
    fn finish(&mut self, si: usize, reply: Reply, tx: &mut Tx, _now_ms: u64) {
        if !matches!(
            self.slots.get(si).map(|s| s.state),
            Some(
                SlotState::Admitted | SlotState::AwaitData | SlotState::Parked | SlotState::Backend
            )
        ) {
            self.violation(si, "answering a command whose slot holds none");
            return;
        }
        if self.closed {
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
                self.dg,
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

    /// NVMe/RDMA: an RDMA WRITE of the read data (if any), then the SEND of
    /// the response, which invalidates the host's key when it asked for
    /// that. A slot whose data is written stays in `Sending` until the
    /// SEND completes (RC executes in order, so the WRITE is done then).
    fn finish_rdma(&mut self, si: usize, reply: Reply, tx: &mut Tx) {
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

    /// Frees slots whose data the transmit queue has written.
    pub fn reclaim(&mut self, tx: &mut Tx) {
        for i in 0..tx.released.len() {
            let si = tx.released[i] as usize;
            if self.poisoned
                || !self.expect_state(si, SlotState::Sending, "data sent from a slot not sending")
            {
                break;
            }
            self.release(si);
        }
        tx.released.clear();
    }

    fn release(&mut self, si: usize) {
        if self.poisoned {
            return;
        }
        let Some(s) = self
            .slots
            .get_mut(si)
            .filter(|s| s.state != SlotState::Free)
        else {
            // Freed twice: two commands would share the slot.
            self.violation(si, "freeing a free slot");
            return;
        };
        s.state = SlotState::Free;
        s.ns = None;
        s.zero = None;
        if let Some(b) = s.give_pool() {
            self.returned.push(b);
        }
        self.free.push(si as u16);
    }

    fn put_resp(&self, tx: &mut Tx, cqe: Cqe) {
        if self.transport == Transport::Rdma {
            tx.rdma.push(RdmaWork::Respond {
                cqe: cqe_bytes(&cqe),
                invalidate: None,
                release: None,
            });
            return;
        }
        let mut out = [0u8; tcp::CAPSULE_RESP_HLEN + tcp::DIGEST_LEN];
        let n = tcp::encode_capsule_resp(&cqe, self.dg, &mut out);
        tx.put(&out[..n]);
    }

    fn record_error(&self, si: usize, st: Status) {
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

    fn on_aer(&mut self, sqe: &Sqe, tx: &mut Tx) {
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

    // ----- Connect -----

    fn connect(&mut self, si: usize, now_ms: u64) -> Reply {
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

    fn bind(&mut self, ctrl: Arc<Controller>, qid: u16, entries: u16, sqflow_off: bool) {
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

    // ----- timers -----

    /// Periodic work. Returns false when the connection must close now;
    /// a controller that went away makes the queue drain first.
    pub fn tick(&mut self, now_ms: u64, tx: &mut Tx) -> bool {
        if self.close_requested {
            let since = *self.close_since_ms.get_or_insert(now_ms);
            return now_ms.saturating_sub(since) < limits::SHUTDOWN_DRAIN_MS;
        }
        let Some(ctrl) = self.ctrl.clone() else {
            // No Connect yet (nor, on TCP, maybe an ICReq): the handshake
            // deadline frees the connection's place.
            if now_ms >= self.handshake_deadline_ms {
                peer_info!(peer = %self.peer, transport = ?self.transport, ic_done = self.ic_done,
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
        if self.detached {
            return;
        }
        self.detached = true;
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
        if self.closed {
            return;
        }
        self.closed = true;
        self.detach();
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

/// Connect response DW0 bit 17, ATR: the queue must authenticate.
pub const AUTHREQ_ATR: u32 = 1 << 17;

/// Authentication Send or Receive.
fn is_auth_cmd(sqe: &Sqe) -> bool {
    sqe.opcode() == aop::FABRICS && matches!(sqe.fctype(), fctype::AUTH_SEND | fctype::AUTH_RECEIVE)
}

fn cqe_bytes(c: &Cqe) -> [u8; 16] {
    let mut b = [0u8; 16];
    c.encode(&mut b);
    b
}

fn submit(ring: &mut Ring, slot: &mut Slot, t: crate::backend::UringTarget, ud: u64) {
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
fn pump_zero(
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

fn submit_zero(ring: &mut Ring, t: crate::backend::UringTarget, op: ZeroOp, ud: u64) {
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

/// The deallocate attribute of a Dataset Management command.
const DSM_AD: u32 = 1 << 2;
/// Bytes of a DSM range list (256 ranges of 16 bytes): the slot's own
/// buffer holds it.
const DSM_LIST_BYTES_MAX: usize = 256 * 16;
const _: () = assert!(DSM_LIST_BYTES_MAX <= limits::SLOT_BUF_BYTES_MAX);

/// Checks every range of a Dataset Management command. Ok(false): nothing
/// to do (no deallocate attribute).
fn dsm_check(sqe: &Sqe, data: &[u8], ns: &Namespace) -> Result<bool, Status> {
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
fn dsm_descriptor(r: &[u8]) -> (u64, u64) {
    (
        nvpool_wire::le::u64_at(r, 8),
        u64::from(nvpool_wire::le::u32_at(r, 4)),
    )
}

/// Range `i` of a checked ([`dsm_check`]) DSM command as namespace bytes
/// (offset, length; length 0 for an empty range), None past the last.
fn dsm_range(sqe: &Sqe, data: &[u8], ns: &Namespace, i: usize) -> Option<(u64, u64)> {
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
fn dsm_ranges(sqe: &Sqe, data: &[u8], ns: &Namespace) -> Result<Option<Vec<(u64, u64)>>, Status> {
    if !dsm_check(sqe, data, ns)? {
        return Ok(None);
    }
    let v = (0..)
        .map_while(|i| dsm_range(sqe, data, ns, i))
        .filter(|&(_, len)| len > 0)
        .collect();
    Ok(Some(v))
}

fn put_c2h_data(tx: &mut Tx, dg: Digests, cid: u16, data: &[u8], slot: u16, extra: u8) {
    let mut hdr = [0u8; tcp::DATA_HLEN + tcp::DIGEST_LEN];
    let n = DataHeader {
        cccid: cid,
        ttag: 0,
        datao: 0,
        datal: data.len() as u32,
    }
    .encode(PduType::C2HData, extra, dg, &mut hdr);
    tx.put(&hdr[..n]);
    tx.put_slot(data, slot);
    if dg.data {
        tx.put(&nvpool_wire::digest::crc32c(data).to_le_bytes());
    }
}

/// The one place a backend error becomes an NVMe status.
fn io_error_status(kind: IoKind, e: &std::io::Error) -> Status {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => Status::CAPACITY_EXCEEDED,
        Some(libc::EROFS) => Status::NS_WRITE_PROTECTED,
        // An asynchronous backend with no room for another operation now
        // (never the result of a file operation): the host retries.
        Some(libc::EAGAIN) => Status::NS_NOT_READY,
        // A volume namespace that stopped serving between the ANA check and
        // its backend (the path lost ownership): a path error, no DNR.
        Some(libc::ENOTCONN) => Status::ANA_INACCESSIBLE,
        _ if kind == IoKind::Read => Status::UNRECOVERED_READ_ERROR,
        _ => Status::WRITE_FAULT,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{NamespaceConfig, SubsystemConfig};
    use crate::copier::{CopyRequest, CopySource};
    use nvpool_wire::fabrics::{cc, ConnectCmd, ConnectData};
    use nvpool_wire::Sgl;
    use std::path::PathBuf;

    const NQN: &str = "nqn.2026-11.io.nvpool:queue-test";
    const HOST: &str = "nqn.2026-11.io.nvpool:queue-test-host";
    /// The namespace is device bytes [NS_BASE, NS_BASE + NS_LEN) of the file.
    const NS_BASE: u64 = 64 << 10;
    const NS_LEN: u64 = 512 << 10;

    /// An I/O queue (run without io_uring, so backend I/O is inline) of a
    /// target exporting a file extent, with a copy job armed over the same
    /// extent.
    struct Rig {
        _dir: tempfile::TempDir,
        path: PathBuf,
        target: Arc<Target>,
        q: Queue,
        tx: Tx,
        bufs: BufPool,
        next_cid: u16,
    }

    impl Rig {
        fn new() -> Rig {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("d.img");
            std::fs::write(&path, vec![0x11u8; 1 << 20]).unwrap();
            let extent = format!("file:{},offset={NS_BASE},length={NS_LEN}", path.display());
            let target = target_with(NQN, &extent);
            target
                .copies()
                .arm(
                    "job",
                    CopyRequest {
                        dest: extent,
                        source: CopySource {
                            addr: "127.0.0.1:9".into(),
                            subsystem_nqn: "nqn.2026-11.io.nvpool:src".into(),
                            nsid: 1,
                            host_nqn: "nqn.2026-11.io.nvpool:copier:t".into(),
                            dhchap: None,
                        },
                        region_bytes: 1 << 20,
                        rate_bytes_per_sec: 0,
                    },
                )
                .unwrap();
            let ctrl = target
                .create_controller(
                    target.subsystem(NQN).unwrap(),
                    HOST,
                    [7; 16],
                    0,
                    false,
                    Transport::Tcp,
                )
                .unwrap();
            ctrl.write_cc(cc::LINUX_ENABLE, 0);
            let addr = "127.0.0.1:4420".parse().unwrap();
            let mut r = Rig {
                _dir: dir,
                path,
                q: Queue::new(target.clone(), addr, addr, 0),
                target,
                tx: Tx::default(),
                bufs: BufPool::new(0, limits::REACTOR_BUF_BUDGET_BYTES).unwrap(),
                next_cid: 1,
            };
            r.feed(
                &IcReq {
                    pfv: 0,
                    hpda: 0,
                    digests: Digests::default(),
                    maxr2t: 0,
                }
                .encode(),
            );
            let data = ConnectData {
                hostid: [7; 16],
                cntlid: ctrl.cntlid,
                subnqn: NQN,
                hostnqn: HOST,
            }
            .encode();
            let sqe = ConnectCmd {
                recfmt: 0,
                qid: 1,
                sqsize: 31,
                cattr: 0,
                kato_ms: 0,
            }
            .to_sqe(0);
            r.feed(&capsule(&sqe, &data));
            let out = r.responses();
            assert_eq!(out.len(), 1, "one Connect response");
            assert!(out[0].status.is_success(), "{}", out[0].status);
            r
        }

        fn feed(&mut self, pdu: &[u8]) {
            let mut ex = exec(&mut self.bufs);
            self.q.on_pdu(pdu, &mut self.tx, &mut ex).unwrap();
        }

        fn retry(&mut self) {
            let mut ex = exec(&mut self.bufs);
            self.q.retry_parked(&mut self.tx, &mut ex);
        }

        /// CapsuleResps the queue produced since the last call (the ICResp
        /// is skipped).
        fn responses(&mut self) -> Vec<Cqe> {
            let mut raw = Vec::new();
            while self.tx.backlog() > 0 {
                self.tx.write_to(&mut raw).unwrap();
            }
            self.q.reclaim(&mut self.tx);
            let mut out = Vec::new();
            let mut at = 0;
            while at < raw.len() {
                let ch = CommonHeader::decode(&raw[at..]).unwrap();
                let end = at + ch.plen as usize;
                if ch.pdu_type == PduType::CapsuleResp {
                    out.push(tcp::decode_capsule_resp(&raw[at..end]).unwrap());
                }
                at = end;
            }
            out
        }

        /// A 4 KiB in-capsule Write at namespace byte `off`.
        fn write(&mut self, off: u64, fill: u8) -> u16 {
            let cid = self.next_cid;
            self.next_cid += 1;
            let mut sqe = Sqe::new(nvm::WRITE, cid);
            sqe.set_nsid(1);
            sqe.set_slba(off / 512);
            sqe.set_nlb(7);
            sqe.set_sgl(Sgl {
                addr: 0,
                len: 4096,
                id: sgl_id::IN_CAPSULE,
            });
            self.feed(&capsule(&sqe, &[fill; 4096]));
            cid
        }

        /// Device bytes [off, off + len) of the file.
        fn file(&self, off: u64, len: usize) -> Vec<u8> {
            let all = std::fs::read(&self.path).unwrap();
            all[off as usize..off as usize + len].to_vec()
        }

        /// What the reactor does each iteration: takes freed buffers back
        /// and hands one to the oldest waiting command. The slot it went to.
        fn r2t_free_grant(&mut self) -> Option<u16> {
            self.q.take_returned(&mut self.bufs);
            let (ud, b) = self.bufs.grant()?;
            let slot = split_user_data(ud).1;
            let mut ex = exec(&mut self.bufs);
            assert!(self.q.on_buffer(slot, b, &mut self.tx, &mut ex).is_none());
            Some(slot)
        }

        fn guard(&self) -> Arc<crate::copier::ActiveCopy> {
            self.target.copies().guards.snapshot()[0].clone()
        }
    }

    /// Where the rigs' asynchronous backends complete (the tests take
    /// their completions from it themselves).
    /// A target with subsystem `nqn` open to any host, namespace 1 on
    /// `backend`.
    pub(super) fn target_with(nqn: &str, backend: &str) -> Arc<Target> {
        let target = Target::new(None).unwrap();
        target
            .put_subsystem(&SubsystemConfig {
                nqn: nqn.into(),
                allowed_hosts: Vec::new(),
                allow_any_host: true,
                host_keys: Default::default(),
                serial: None,
                model: None,
                ana: None,
                namespaces: vec![NamespaceConfig {
                    nsid: 1,
                    backend: backend.into(),
                    uuid: None,
                    read_only: false,
                }],
            })
            .unwrap();
        target
    }

    pub(super) static SINK: std::sync::LazyLock<Arc<CompletionSink>> =
        std::sync::LazyLock::new(|| CompletionSink::new(|| {}));

    /// What the rigs hand their queue: no ring, the shared sink, `bufs`.
    pub(super) fn exec(bufs: &mut BufPool) -> Exec<'_> {
        Exec {
            ring: None,
            sink: &SINK,
            bufs,
            conn: 0,
            now_ms: 0,
        }
    }

    /// An asynchronous backend that keeps every operation until the test
    /// completes it.
    #[derive(Debug, Default)]
    struct HeldOps(std::sync::Mutex<Vec<(AsyncOp, AsyncDone)>>);

    impl crate::backend::Backend for HeldOps {
        fn size(&self) -> u64 {
            1 << 20
        }
        fn block_size(&self) -> u32 {
            512
        }
        fn describe(&self) -> String {
            "held".into()
        }
        fn read_at(&self, _: &mut [u8], _: u64) -> std::io::Result<()> {
            unreachable!("an asynchronous backend is never run inline")
        }
        fn write_at(&self, _: &[u8], _: u64, _: bool) -> std::io::Result<()> {
            unreachable!("an asynchronous backend is never run inline")
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn write_zeroes(&self, _: u64, _: u64) -> std::io::Result<()> {
            unreachable!("an asynchronous backend is never run inline")
        }
        fn discard(&self, _: u64, _: u64) -> std::io::Result<()> {
            unreachable!("an asynchronous backend is never run inline")
        }
        fn failed(&self) -> bool {
            false
        }
        fn mark_failed(&self) {}
        fn is_async(&self) -> bool {
            true
        }
        fn submit(&self, op: AsyncOp, done: AsyncDone) {
            self.0.lock().unwrap().push((op, done));
        }
    }

    impl HeldOps {
        fn take(&self) -> Vec<(AsyncOp, AsyncDone)> {
            std::mem::take(&mut *self.0.lock().unwrap())
        }
    }

    /// A rig whose namespace 2 is a [`HeldOps`] backend.
    fn async_rig() -> (Rig, Arc<HeldOps>) {
        let r = Rig::new();
        let held = Arc::new(HeldOps::default());
        r.target
            .put_namespace_backend(NQN, 2, held.clone())
            .unwrap();
        (r, held)
    }

    /// Hands the sink's completions (for connection 0) to the rig's queue.
    fn deliver(r: &mut Rig) -> usize {
        let mut out = Vec::new();
        SINK.take(&mut out);
        let n = out.len();
        let mut ex = exec(&mut r.bufs);
        for c in out {
            let (conn, slot) = split_user_data(c.user_data);
            assert_eq!(conn, 0);
            r.q.on_async_completion(slot, c.result, &mut r.tx, &mut ex);
        }
        n
    }

    /// A 4 KiB Read of namespace 2 at byte `off`.
    fn read_ns2(r: &mut Rig, off: u64) -> u16 {
        let cid = r.next_cid;
        r.next_cid += 1;
        let mut sqe = Sqe::new(nvm::READ, cid);
        sqe.set_nsid(2);
        sqe.set_slba(off / 512);
        sqe.set_nlb(7);
        sqe.set_sgl(Sgl {
            addr: 0,
            len: 4096,
            id: sgl_id::TRANSPORT,
        });
        r.feed(&capsule(&sqe, &[]));
        cid
    }

    fn capsule(sqe: &Sqe, icd: &[u8]) -> Vec<u8> {
        let mut hdr = [0u8; tcp::CAPSULE_CMD_HLEN + tcp::DIGEST_LEN];
        let n = tcp::encode_capsule_cmd(sqe, icd.len(), Digests::default(), &mut hdr);
        let mut v = hdr[..n].to_vec();
        v.extend_from_slice(icd);
        v
    }

    // The tests of asynchronous backends share SINK: they run one at a time.
    static ASYNC_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn an_async_backend_owns_the_slot_until_its_completion() {
        let _one = ASYNC_TESTS.lock().unwrap_or_else(|p| p.into_inner());
        let (mut r, held) = async_rig();
        // A write: its data is copied out; no answer until completion.
        let mut sqe = Sqe::new(nvm::WRITE, 100);
        sqe.set_nsid(2);
        sqe.set_slba(8);
        sqe.set_nlb(7);
        sqe.set_sgl(Sgl {
            addr: 0,
            len: 4096,
            id: sgl_id::IN_CAPSULE,
        });
        r.feed(&capsule(&sqe, &[0x5A; 4096]));
        read_ns2(&mut r, 8192);
        assert!(r.responses().is_empty());
        assert_eq!(r.q.inflight, 2);
        let ops = held.take();
        assert_eq!(ops.len(), 2);
        let mut it = ops.into_iter();
        let (w, wdone) = it.next().unwrap();
        let (rop, rdone) = it.next().unwrap();
        match w {
            AsyncOp::Write { off, data, fua } => {
                assert_eq!((off, fua), (4096, false));
                assert_eq!(data, vec![0x5A; 4096]);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            rop,
            AsyncOp::Read {
                off: 8192,
                len: 4096
            }
        ));
        // Completed from another thread, delivered on "the reactor".
        std::thread::spawn(move || {
            wdone.complete(Ok(None));
            rdone.complete(Ok(Some(vec![0xC3; 4096])));
        })
        .join()
        .unwrap();
        assert_eq!(deliver(&mut r), 2);
        assert_eq!(r.q.inflight, 0);
        let mut raw = Vec::new();
        while r.tx.backlog() > 0 {
            r.tx.write_to(&mut raw).unwrap();
        }
        r.q.reclaim(&mut r.tx);
        assert!(
            raw.windows(4096).any(|w| w == [0xC3; 4096]),
            "the read's data is sent"
        );
        assert!(!r.q.busy());
    }

    #[test]
    fn async_errors_become_statuses_and_a_dropped_op_fails() {
        let _one = ASYNC_TESTS.lock().unwrap_or_else(|p| p.into_inner());
        let (mut r, held) = async_rig();
        let a = read_ns2(&mut r, 0);
        let b = read_ns2(&mut r, 4096);
        let mut ops = held.take().into_iter();
        let (_, adone) = ops.next().unwrap();
        adone.complete(Err(std::io::Error::from_raw_os_error(libc::EAGAIN)));
        // The backend loses the other operation: it fails, never hangs.
        drop(ops);
        assert_eq!(deliver(&mut r), 2);
        let mut out = r.responses();
        out.sort_by_key(|c| c.cid);
        assert_eq!(out.len(), 2);
        assert_eq!((out[0].cid, out[0].status), (a, Status::NS_NOT_READY));
        assert_eq!(
            (out[1].cid, out[1].status),
            (b, Status::UNRECOVERED_READ_ERROR)
        );
        assert!(!r.q.busy());
    }

    #[test]
    fn a_closed_queue_keeps_async_slots_until_they_complete() {
        let _one = ASYNC_TESTS.lock().unwrap_or_else(|p| p.into_inner());
        let (mut r, held) = async_rig();
        read_ns2(&mut r, 0);
        r.q.close();
        assert!(r.q.busy(), "the slot is the backend's until it completes");
        assert_eq!(r.q.inflight, 1);
        let (_, done) = held.take().pop().unwrap();
        done.complete(Ok(Some(vec![1; 4096])));
        assert_eq!(deliver(&mut r), 1);
        assert!(!r.q.busy());
        assert!(r.responses().is_empty(), "nothing answered after close");
    }

    #[test]
    fn a_write_under_a_claim_is_issued_only_after_release() {
        let mut r = Rig::new();
        let g = r.guard();
        // The copier claims the first 128 KiB of the extent (device offsets).
        let parts = g.guard.claim(NS_BASE, 128 << 10);
        assert_eq!(parts, vec![(NS_BASE, 128 << 10)], "nothing written yet");
        // A host writes 4 KiB at namespace offset 8 KiB: marked, parked.
        let cid = r.write(8192, 0xAB);
        assert!(r.responses().is_empty(), "a parked write is not answered");
        assert!(r.q.has_parked());
        assert!(r.q.busy(), "a parked command keeps the queue busy");
        assert_eq!(r.file(NS_BASE + 8192, 4096), vec![0x11; 4096]);
        assert_eq!(g.guard.written_units(), 8);
        // Retrying while the claim is held changes nothing.
        r.retry();
        assert!(r.responses().is_empty());
        assert_eq!(r.file(NS_BASE + 8192, 4096), vec![0x11; 4096]);
        // A write outside the claim (but inside the guard) goes at once and
        // is recorded too.
        let other = r.write(256 << 10, 0xCD);
        let out = r.responses();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].cid, other);
        assert_eq!(r.file(NS_BASE + (256 << 10), 4096), vec![0xCD; 4096]);
        assert_eq!(g.guard.written_units(), 16);
        // The copier writes its (older) bytes over its claim, then releases.
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&r.path)
            .unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &[0x22; 128 << 10], NS_BASE).unwrap();
        g.guard.release();
        r.retry();
        let out = r.responses();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].cid, cid);
        assert!(out[0].status.is_success());
        assert!(!r.q.has_parked());
        // The host's write landed after the copier's.
        assert_eq!(r.file(NS_BASE + 8192, 4096), vec![0xAB; 4096]);
        assert_eq!(r.file(NS_BASE, 8192), vec![0x22; 8192]);
        // A later claim leaves out what hosts wrote.
        let parts = g.guard.claim(NS_BASE, 128 << 10);
        assert_eq!(
            parts,
            vec![(NS_BASE, 8192), (NS_BASE + 12288, (128 << 10) - 12288)]
        );
        g.guard.release();
    }

    #[test]
    fn zeroes_and_deallocate_are_guarded_too() {
        let mut r = Rig::new();
        let g = r.guard();
        g.guard.claim(NS_BASE, 128 << 10);
        let mut wz = Sqe::new(nvm::WRITE_ZEROES, 1);
        wz.set_nsid(1);
        wz.set_slba(0);
        wz.set_nlb(7);
        r.feed(&capsule(&wz, &[]));
        let mut dsm = Sqe::new(nvm::DATASET_MANAGEMENT, 2);
        dsm.set_nsid(1);
        dsm.set_cdw(10, 0);
        dsm.set_cdw(11, 1 << 2);
        dsm.set_sgl(Sgl {
            addr: 0,
            len: 16,
            id: sgl_id::IN_CAPSULE,
        });
        let mut range = [0u8; 16];
        range[4..8].copy_from_slice(&8u32.to_le_bytes());
        range[8..16].copy_from_slice(&64u64.to_le_bytes());
        r.feed(&capsule(&dsm, &range));
        assert!(r.responses().is_empty(), "both parked");
        assert_eq!(g.guard.written_units(), 16);
        assert_eq!(r.file(NS_BASE, 4096), vec![0x11; 4096]);
        g.guard.release();
        r.retry();
        let mut cids: Vec<u16> = r.responses().iter().map(|c| c.cid).collect();
        cids.sort_unstable();
        assert_eq!(cids, vec![1, 2]);
        assert_eq!(r.file(NS_BASE, 4096), vec![0; 4096]);
        assert_eq!(r.file(NS_BASE + 64 * 512, 4096), vec![0; 4096]);
    }

    #[test]
    fn closing_a_queue_frees_its_parked_commands() {
        let mut r = Rig::new();
        let g = r.guard();
        g.guard.claim(NS_BASE, 128 << 10);
        r.write(0, 0xAB);
        r.write(4096, 0xAC);
        assert!(r.q.busy());
        r.q.close();
        assert!(!r.q.has_parked());
        assert!(!r.q.busy(), "every slot is free again");
        g.guard.release();
        r.retry();
        assert!(r.responses().is_empty(), "nothing answered after close");
        assert_eq!(r.file(NS_BASE, 8192), vec![0x11; 8192], "nothing issued");
    }

    #[test]
    fn a_disarmed_guard_lets_parked_writes_go() {
        let mut r = Rig::new();
        let g = r.guard();
        g.guard.claim(NS_BASE, 128 << 10);
        let cid = r.write(0, 0xAB);
        assert!(r.responses().is_empty());
        // DELETE of the job while the claim is still held (a copier that
        // died mid-chunk would release through its drop guard; here the
        // registry simply no longer has the guard).
        r.target.copies().delete("job").unwrap();
        r.retry();
        let out = r.responses();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].cid, cid);
        assert_eq!(r.file(NS_BASE, 4096), vec![0xAB; 4096]);
    }

    /// Every PDU the queue produced since the last call, whole.
    fn pdus(r: &mut Rig) -> Vec<Vec<u8>> {
        let mut raw = Vec::new();
        while r.tx.backlog() > 0 {
            r.tx.write_to(&mut raw).unwrap();
        }
        r.q.reclaim(&mut r.tx);
        let mut out = Vec::new();
        let mut at = 0;
        while at < raw.len() {
            let ch = CommonHeader::decode(&raw[at..]).unwrap();
            out.push(raw[at..at + ch.plen as usize].to_vec());
            at += ch.plen as usize;
        }
        out
    }

    fn r2ts(p: &[Vec<u8>]) -> Vec<R2t> {
        p.iter()
            .filter(|b| CommonHeader::decode(b).unwrap().pdu_type == PduType::R2T)
            .map(|b| R2t::decode(b).unwrap())
            .collect()
    }

    fn h2c(cid: u16, ttag: u16, data: &[u8]) -> Vec<u8> {
        let mut hdr = [0u8; tcp::DATA_HLEN + tcp::DIGEST_LEN];
        let n = DataHeader {
            cccid: cid,
            ttag,
            datao: 0,
            datal: data.len() as u32,
        }
        .encode(
            PduType::H2CData,
            flags::LAST_PDU,
            Digests::default(),
            &mut hdr,
        );
        [&hdr[..n], data].concat()
    }

    /// A 128 KiB Write at namespace byte `off` whose data comes by R2T.
    fn big_write(r: &mut Rig, off: u64) -> u16 {
        let cid = r.next_cid;
        r.next_cid += 1;
        let mut sqe = Sqe::new(nvm::WRITE, cid);
        sqe.set_nsid(1);
        sqe.set_slba(off / 512);
        sqe.set_nlb(255);
        sqe.set_sgl(Sgl {
            addr: 0,
            len: 128 << 10,
            id: sgl_id::TRANSPORT,
        });
        r.feed(&capsule(&sqe, &[]));
        cid
    }

    #[test]
    fn a_large_write_waits_for_a_buffer_and_gets_its_r2t_when_one_comes_back() {
        let mut r = Rig::new();
        r.target.copies().delete("job").unwrap();
        r.bufs = BufPool::new(0, limits::POOL_BUF_BYTES).unwrap();
        let a = big_write(&mut r, 0);
        let b = big_write(&mut r, 128 << 10);
        // Small commands never wait: a 4 KiB write goes through meanwhile.
        let small = r.write(256 << 10, 0x33);
        let p = pdus(&mut r);
        let t = r2ts(&p);
        assert_eq!(t.len(), 1, "only the first has a buffer");
        assert_eq!(t[0].cccid, a);
        let f = r.bufs.stats().figures();
        assert_eq!((f.lent_bytes, f.waiting), (limits::POOL_BUF_BYTES, 1));
        assert_eq!(
            p.iter()
                .filter(|b| b[0] == PduType::CapsuleResp as u8)
                .count(),
            1,
            "the small write"
        );
        let _ = small;
        // The first's data arrives; it runs and answers; its buffer is back.
        r.feed(&h2c(a, t[0].ttag, &[0xA1; 128 << 10]));
        let p = pdus(&mut r);
        assert_eq!(p.len(), 1, "its response only");
        assert!(
            r.r2t_free_grant().is_some(),
            "the waiting write gets the buffer"
        );
        let t = r2ts(&pdus(&mut r));
        assert_eq!(t.len(), 1);
        assert_eq!((t[0].cccid, t[0].r2tl), (b, 128 << 10));
        r.feed(&h2c(b, t[0].ttag, &[0xB2; 128 << 10]));
        assert_eq!(pdus(&mut r).len(), 1);
        r.q.take_returned(&mut r.bufs);
        let f = r.bufs.stats().figures();
        assert_eq!((f.lent_bytes, f.waiting, f.waits_total), (0, 0, 1));
        assert_eq!(r.file(NS_BASE, 128 << 10), vec![0xA1; 128 << 10]);
        assert_eq!(
            r.file(NS_BASE + (128 << 10), 128 << 10),
            vec![0xB2; 128 << 10]
        );
        assert_eq!(r.file(NS_BASE + (256 << 10), 4096), vec![0x33; 4096]);
        assert!(!r.q.busy());
    }

    #[test]
    fn a_closing_queue_gives_its_buffers_back_and_a_late_grant_is_refused() {
        let mut r = Rig::new();
        r.target.copies().delete("job").unwrap();
        r.bufs = BufPool::new(0, limits::POOL_BUF_BYTES).unwrap();
        big_write(&mut r, 0);
        big_write(&mut r, 128 << 10);
        assert_eq!(r.bufs.lent(), 1);
        r.q.close();
        assert!(!r.q.busy(), "waiting for data or a buffer holds nothing");
        r.q.take_returned(&mut r.bufs);
        assert_eq!(r.bufs.lent(), 0);
        // The reactor would have forgotten the wait; a grant that races the
        // close comes back untouched.
        let (ud, b) = r.bufs.grant().unwrap();
        let mut ex = exec(&mut r.bufs);
        let back = r.q.on_buffer(split_user_data(ud).1, b, &mut r.tx, &mut ex);
        assert!(back.is_some());
        r.bufs.give_back(back.unwrap());
        assert!(!r.q.poisoned());
    }

    #[test]
    fn broken_slot_steps_end_the_connection_instead_of_panicking() {
        // A ring completion for a slot that is not in the backend.
        let mut r = Rig::new();
        let mut ex = exec(&mut r.bufs);
        r.q.on_completion(5, 0, 4096, &mut r.tx, &mut ex);
        assert!(r.q.poisoned() && r.q.terminated() && r.q.wants_close());
        // Nothing runs any more on it.
        let before = r.tx.backlog();
        let mut sqe = Sqe::new(nvm::FLUSH, 9);
        sqe.set_nsid(1);
        r.feed(&capsule(&sqe, &[]));
        assert_eq!(r.tx.backlog(), before, "a poisoned queue answers nothing");

        // Data "sent" from a slot that was not sending: freeing it would
        // put it on the free list twice.
        let mut r = Rig::new();
        r.tx.released.push(3);
        r.q.reclaim(&mut r.tx);
        assert!(r.q.poisoned());
        assert!(r.tx.released.is_empty());

        // An asynchronous completion nobody waits for.
        let mut r = Rig::new();
        let mut ex = exec(&mut r.bufs);
        r.q.on_async_completion(1, Ok(None), &mut r.tx, &mut ex);
        assert!(r.q.poisoned());
        assert_eq!(r.q.inflight, 0);
    }

    /// Zero writes (where no fallocate mode zeroes) go through a real ring
    /// in chunks, each tagged with its length, a window at a time, until
    /// the range is done.
    #[test]
    fn zero_writes_cover_a_large_range_through_the_ring() {
        const CHUNK: u64 = limits::ZERO_WRITE_CHUNK_BYTES as u64;
        // More chunks than the window: the job refills it as writes finish.
        const SPAN: u64 = (limits::ZERO_OPS_PER_CMD_MAX as u64 + 4) * CHUNK + 4096;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("z.img");
        std::fs::write(&path, vec![0x11u8; (SPAN + 8192) as usize]).unwrap();
        let target = target_with(NQN, &format!("file:{}", path.display()));
        let ns = target.subsystem(NQN).unwrap().namespaces[&1].clone();
        let t = ns.backend.uring_target().expect("a file has a ring target");
        let mut ring = Ring::new(64).expect("io_uring");
        let mut slot = Slot::new();
        slot.kind = IoKind::WriteZeroes;
        slot.off = 4096;
        slot.span = SPAN;
        slot.state = SlotState::Backend;
        slot.zero = Some(ZeroJob::new(ZeroMode::Write));
        let ud = user_data(7, 3);
        let (mut inflight, mut done) = pump_zero(&mut slot, &ns, &mut ring, t, ud);
        assert_eq!(inflight, limits::ZERO_OPS_PER_CMD_MAX);
        let mut out = Vec::new();
        let mut max_inflight = inflight;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while done.is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "zero writes did not complete"
            );
            ring.submit().unwrap();
            out.clear();
            ring.reap(&mut out);
            for &(u, res, _) in &out {
                assert_eq!(split_user_data(u), (7, 3));
                inflight -= 1;
                let job = slot.zero.as_mut().unwrap();
                job.complete(job.mode(), res, u64::from(user_data_tag(u)) << 9);
                let (n, d) = pump_zero(&mut slot, &ns, &mut ring, t, ud);
                inflight += n;
                max_inflight = max_inflight.max(inflight);
                done = done.or(d);
            }
            if out.is_empty() {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        assert_eq!(done, Some(Ok(())));
        assert_eq!(inflight, 0);
        assert_eq!(
            max_inflight,
            limits::ZERO_OPS_PER_CMD_MAX,
            "never more than the window"
        );
        let all = std::fs::read(&path).unwrap();
        assert!(all[..4096].iter().all(|&b| b == 0x11), "before the range");
        assert!(
            all[4096..(4096 + SPAN) as usize].iter().all(|&b| b == 0),
            "the range is zero"
        );
        assert!(
            all[(4096 + SPAN) as usize..].iter().all(|&b| b == 0x11),
            "after it"
        );
    }
}

/// The NVMe/RDMA side of the queue core, driven without RDMA hardware: the
/// tests play the transport (they "perform" the RDMA READs the queue asks
/// for by filling the slot's buffer) and check the work it asks to post.
#[cfg(test)]
mod rdma_tests {
    use super::*;
    use nvpool_wire::fabrics::{cc, ConnectCmd, ConnectData};
    use nvpool_wire::Sgl;

    const NQN: &str = "nqn.2026-11.io.nvpool:rdma-queue-test";
    const HOST: &str = "nqn.2026-11.io.nvpool:rdma-queue-test-host";
    const KEY: u32 = 0x1234_5678;
    const RADDR: u64 = 0x7f00_1000;

    fn target() -> Arc<Target> {
        super::tests::target_with(NQN, "ram:1M")
    }

    struct Rig {
        target: Arc<Target>,
        q: Queue,
        tx: Tx,
        bufs: BufPool,
    }

    impl Rig {
        fn queue(target: &Arc<Target>, cm_qid: u16) -> Rig {
            let addr = "192.0.2.10:4420".parse().unwrap();
            Rig {
                target: target.clone(),
                q: Queue::new_rdma(target.clone(), addr, addr, 0, cm_qid),
                tx: Tx::default(),
                bufs: BufPool::new(0, limits::REACTOR_BUF_BUDGET_BYTES).unwrap(),
            }
        }

        fn send(&mut self, cap: &[u8]) -> Result<(), Fatal> {
            let mut ex = super::tests::exec(&mut self.bufs);
            self.q.on_rdma_capsule(cap, &mut self.tx, &mut ex)
        }

        /// Plays the RDMA READ the queue asked for: `data` lands in the slot.
        fn fetched(&mut self, slot: u16, data: &[u8]) {
            let b = self.q.slot_buffer(slot);
            let (ptr, cap) = (b.ptr, b.cap);
            assert!(cap >= data.len());
            // SAFETY: the slot's buffer holds `cap` bytes and nothing else
            // refers to it while the test writes (as an RDMA READ would).
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, data.len()) };
            let mut ex = super::tests::exec(&mut self.bufs);
            self.q.on_rdma_fetched(slot, &mut self.tx, &mut ex);
        }

        fn work(&mut self) -> Vec<RdmaWork> {
            assert_eq!(self.tx.backlog(), 0, "no TCP bytes on an RDMA queue");
            std::mem::take(&mut self.tx.rdma)
        }

        /// The one response queued, decoded.
        fn response(&mut self) -> (Cqe, Option<u32>) {
            let w = self.work();
            assert_eq!(w.len(), 1, "one response: {w:?}");
            match w[0] {
                RdmaWork::Respond {
                    cqe, invalidate, ..
                } => (Cqe::decode(&cqe).unwrap(), invalidate),
                other => panic!("expected a response, got {other:?}"),
            }
        }

        /// An enabled controller over RDMA and this I/O queue connected to
        /// it with in-capsule Connect data, as the Linux host sends it.
        fn io() -> Rig {
            let target = target();
            let ctrl = target
                .create_controller(
                    target.subsystem(NQN).unwrap(),
                    HOST,
                    [7; 16],
                    0,
                    false,
                    Transport::Rdma,
                )
                .unwrap();
            ctrl.write_cc(cc::LINUX_ENABLE, 0);
            let mut r = Rig::queue(&target, 1);
            let data = connect_data(ctrl.cntlid);
            let mut sqe = connect_sqe(1);
            sqe.set_sgl(Sgl {
                addr: 0,
                len: data.len() as u32,
                id: sgl_id::IN_CAPSULE,
            });
            r.send(&[&sqe.0[..], &data].concat()).unwrap();
            let (cqe, inval) = r.response();
            assert!(cqe.status.is_success(), "{}", cqe.status);
            assert_eq!(inval, None);
            r
        }
    }

    fn connect_data(cntlid: u16) -> Vec<u8> {
        ConnectData {
            hostid: [7; 16],
            cntlid,
            subnqn: NQN,
            hostnqn: HOST,
        }
        .encode()
        .to_vec()
    }

    fn connect_sqe(qid: u16) -> Sqe {
        ConnectCmd {
            recfmt: 0,
            qid,
            sqsize: 31,
            cattr: 0,
            kato_ms: 0,
        }
        .to_sqe(3)
    }

    fn keyed(sqe: &mut Sqe, len: u32, invalidate: bool) {
        KeyedSgl {
            addr: RADDR,
            len,
            key: KEY,
            invalidate,
        }
        .put(sqe);
    }

    fn rw(opcode: u8, cid: u16, slba: u64, blocks: u16) -> Sqe {
        let mut s = Sqe::new(opcode, cid);
        s.set_nsid(1);
        s.set_slba(slba);
        s.set_nlb(blocks - 1);
        s
    }

    #[test]
    fn admin_connect_reads_its_data_then_answers_with_invalidate() {
        let target = target();
        let mut r = Rig::queue(&target, 0);
        let data = connect_data(0xFFFF);
        let mut sqe = connect_sqe(0);
        keyed(&mut sqe, data.len() as u32, true);
        r.send(&sqe.0).unwrap();
        let w = r.work();
        let [RdmaWork::Fetch {
            slot,
            len,
            raddr,
            rkey,
        }] = w[..]
        else {
            panic!("expected one RDMA READ, got {w:?}");
        };
        assert_eq!((len, raddr, rkey), (data.len() as u32, RADDR, KEY));
        r.fetched(slot, &data);
        let (cqe, inval) = r.response();
        assert!(cqe.status.is_success(), "{}", cqe.status);
        assert_eq!(inval, Some(KEY), "0x4F asks for the key to be invalidated");
        let ctrl = r.target.controller(cqe.dw0 as u16).expect("controller");
        assert_eq!(ctrl.transport, Transport::Rdma);
    }

    #[test]
    fn writes_are_fetched_and_reads_written_before_the_response() {
        let mut r = Rig::io();
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let mut w = rw(nvm::WRITE, 10, 8, 8);
        keyed(&mut w, 4096, false);
        r.send(&w.0).unwrap();
        let work = r.work();
        let [RdmaWork::Fetch {
            slot, len: 4096, ..
        }] = work[..]
        else {
            panic!("expected one 4 KiB READ, got {work:?}");
        };
        r.fetched(slot, &data);
        let (cqe, inval) = r.response();
        assert!(cqe.status.is_success(), "{}", cqe.status);
        assert_eq!((cqe.cid, inval), (10, None), "0x40: nothing to invalidate");

        let mut rd = rw(nvm::READ, 11, 8, 8);
        keyed(&mut rd, 4096, true);
        r.send(&rd.0).unwrap();
        let work = r.work();
        let [RdmaWork::Deliver {
            slot,
            len: 4096,
            raddr: RADDR,
            rkey: KEY,
        }, RdmaWork::Respond {
            cqe,
            invalidate: Some(KEY),
            release: Some(released),
        }] = work[..]
        else {
            panic!("expected an RDMA WRITE then the response, got {work:?}");
        };
        assert_eq!(slot, released, "the slot is held until the SEND completes");
        assert!(Cqe::decode(&cqe).unwrap().status.is_success());
        let ptr = r.q.slot_buffer(slot).ptr;
        // SAFETY: the slot is in Sending state; its buffer holds the read.
        let got = unsafe { std::slice::from_raw_parts(ptr, 4096) };
        assert_eq!(got, &data[..], "the WRITE sends what was written");
        assert!(r.q.busy());
        r.tx.released.push(slot);
        r.q.reclaim(&mut r.tx);
        assert!(!r.q.busy(), "the SEND completion frees the slot");
    }

    #[test]
    fn bad_descriptors_get_their_status_and_the_queue_lives_on() {
        let mut r = Rig::io();
        type Case = (&'static str, Box<dyn Fn(&mut Sqe)>, Status);
        let cases: [Case; 5] = [
            (
                "TCP's transport SGL",
                Box::new(|s: &mut Sqe| {
                    s.set_sgl(Sgl {
                        addr: 0,
                        len: 4096,
                        id: sgl_id::TRANSPORT,
                    })
                }),
                Status::SGL_TYPE_INVALID,
            ),
            (
                "keyed subtype 1h",
                Box::new(|s: &mut Sqe| {
                    keyed(s, 4096, false);
                    s.0[39] = 0x41;
                }),
                Status::INVALID_FIELD,
            ),
            (
                "length other than NLB",
                Box::new(|s: &mut Sqe| keyed(s, 2048, false)),
                Status::SGL_DATA_INVALID,
            ),
            (
                "in-capsule length beyond the capsule",
                Box::new(|s: &mut Sqe| {
                    s.set_sgl(Sgl {
                        addr: 0,
                        len: 4096,
                        id: sgl_id::IN_CAPSULE,
                    })
                }),
                Status::SGL_DATA_INVALID,
            ),
            (
                "past the end of the namespace",
                Box::new(|s: &mut Sqe| {
                    s.set_slba(2047);
                    keyed(s, 4096, false);
                }),
                Status::LBA_OUT_OF_RANGE,
            ),
        ];
        for (i, (what, f, want)) in cases.iter().enumerate() {
            let mut w = rw(nvm::WRITE, 20 + i as u16, 0, 8);
            f(&mut w);
            r.send(&w.0).unwrap();
            let (cqe, _) = r.response();
            assert_eq!(cqe.status, *want, "{what}");
            assert!(cqe.status.dnr, "{what}: not retryable");
        }
        let mut big = rw(nvm::READ, 30, 0, (limits::MDTS_BYTES / 512 + 8) as u16);
        keyed(&mut big, (limits::MDTS_BYTES + 4096) as u32, false);
        r.send(&big.0).unwrap();
        assert_eq!(r.response().0.status, Status::INVALID_FIELD, "above MDTS");
        assert!(!r.q.terminated() && !r.q.busy());
    }

    #[test]
    fn in_capsule_data_is_refused_on_the_admin_queue() {
        let target = target();
        let mut r = Rig::queue(&target, 0);
        let data = connect_data(0xFFFF);
        let mut sqe = connect_sqe(0);
        sqe.set_sgl(Sgl {
            addr: 0,
            len: data.len() as u32,
            id: sgl_id::IN_CAPSULE,
        });
        r.send(&[&sqe.0[..], &data].concat()).unwrap();
        let (cqe, _) = r.response();
        assert_eq!(cqe.status, Status::SGL_OFFSET_INVALID);
        assert!(r.target.controllers().is_empty());
    }

    #[test]
    fn a_connect_for_another_qid_or_transport_is_refused() {
        let target = target();
        let ctrl = target
            .create_controller(
                target.subsystem(NQN).unwrap(),
                HOST,
                [7; 16],
                0,
                false,
                Transport::Tcp,
            )
            .unwrap();
        ctrl.write_cc(cc::LINUX_ENABLE, 0);
        let data = connect_data(ctrl.cntlid);
        for (cm_qid, qid, what) in [
            (2, 1, "CM QID 2, Connect QID 1"),
            (1, 1, "a TCP controller"),
        ] {
            let mut r = Rig::queue(&target, cm_qid);
            let mut sqe = connect_sqe(qid);
            sqe.set_sgl(Sgl {
                addr: 0,
                len: data.len() as u32,
                id: sgl_id::IN_CAPSULE,
            });
            r.send(&[&sqe.0[..], &data].concat()).unwrap();
            let (cqe, _) = r.response();
            assert_eq!(cqe.status, Status::CONNECT_INVALID_PARAMETERS, "{what}");
        }
    }

    #[test]
    fn a_runt_capsule_ends_the_queue_pair() {
        let target = target();
        let mut r = Rig::queue(&target, 0);
        assert!(r.send(&[0u8; 40]).is_err());
        assert!(r.q.terminated());
        assert!(r.work().is_empty(), "no termination PDU on RDMA");
    }
}
