//! NVMe/RDMA: the RDMA CM listener and the per-connection link a reactor
//! drives (D17).
//!
//! ```text
//!   listener thread: CONNECT_REQUEST ─► private data checked (reject with
//!     the spec's status) ─► QP, CQ, receive buffers posted ─► id moved to
//!     its own event channel ─► accept ─► handed to a reactor
//!   reactor: CQ event ─► poll (bounded) ─► RECV: Queue::on_rdma_capsule
//!                                        ─► READ done: Queue::on_rdma_fetched
//!                                        ─► SEND done: slot released
//!            Tx::rdma ─► READ / WRITE / SEND posted in one call ─► arm CQ
//!            CM channel: DISCONNECTED ─► connection closed
//! ```
//!
//! Receive buffers live in one region registered at accept; a slot's own
//! data buffer is registered the first time the transport uses it and again
//! only when it grows, and a reactor pool buffer (bufpool.rs) the first time
//! this link uses it, so the steady state registers nothing.

use crate::limits;
use crate::peerlog::{peer_info, peer_warn};
use crate::queue::{Queue, Tx};
use crate::reactor::ReactorHandle;
use crate::target::Target;
use crate::tx::RdmaWork;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use nvpool_rdma::{event, CmEvent, CmId, Endpoint, EventChannel, Mr, QpSize, SendKind, SendWr, Wc};
use nvpool_wire::rdma::{reject, CmAccept, CmRequest};
use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Work request ids: the kind in the top two bits, an index below.
const WR_RECV: u64 = 1 << 62;
const WR_FETCH: u64 = 2 << 62;
const WR_SEND: u64 = 3 << 62;
const WR_KIND: u64 = 3 << 62;
/// A SEND whose completion frees no slot.
const NO_SLOT: u64 = 0xFFFF;

/// Completions taken per poll call, and per wakeup before the connection
/// yields to the others on its reactor.
const POLL_BATCH: usize = 32;
pub const POLL_BUDGET: usize = 4 * POLL_BATCH;
/// Bytes a response SEND copies inline (a CQE is 16).
const INLINE_BYTES: u32 = 64;
/// Pending connect requests the CM queues for a listener.
const LISTEN_BACKLOG: i32 = 128;

/// One NVMe/RDMA queue pair as a reactor holds it. Field order is drop
/// order: memory regions go before the endpoint (their protection domain),
/// and the receive buffers after their region.
pub struct RdmaLink {
    slot_mrs: Vec<Option<Mr>>,
    /// Registrations of the reactor's pool buffers this link used, by id.
    pool_mrs: Vec<Option<Mr>>,
    recv_mr: Mr,
    recv_buf: Box<[u8]>,
    ep: Endpoint,
    capsule_len: usize,
    /// RDMA READs the host accepts outstanding (the initiator depth we
    /// accepted with).
    read_depth: u32,
    reads: u32,
    /// Fetches waiting for a READ credit.
    waiting: VecDeque<RdmaWork>,
    wcs: Vec<Wc>,
    posts: Vec<SendWr>,
    cqes: Vec<[u8; 16]>,
    /// A completion failed or a post was refused: the queue pair is dead.
    pub failed: bool,
    pub local: SocketAddr,
    pub peer: SocketAddr,
    pub cm_qid: u16,
}

impl std::fmt::Debug for RdmaLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaLink")
            .field("peer", &self.peer)
            .field("cm_qid", &self.cm_qid)
            .finish()
    }
}

impl RdmaLink {
    /// Builds the queue pair for a checked connect request and posts its
    /// receive buffers (before accept: the host sends right after).
    fn new(id: CmId, req: &CmRequest, host_ird: u8) -> io::Result<RdmaLink> {
        let entries = req.hsqsize as u32 + 1;
        let capsule_len = 64
            + if req.qid == 0 {
                0
            } else {
                limits::IO_INLINE_DATA_BYTES
            };
        let local = id
            .local_addr()
            .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
        let peer = id
            .peer_addr()
            .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
        let ep = Endpoint::new(
            id,
            QpSize {
                // Per command at most two at once (READ then SEND, or
                // WRITE and SEND), plus the AER responses.
                send_wr: entries * 2 + limits::AER_MAX as u32 + 1,
                recv_wr: entries,
                inline: INLINE_BYTES,
            },
        )?;
        let mut recv_buf = vec![0u8; capsule_len * entries as usize].into_boxed_slice();
        // SAFETY: recv_buf is dropped after recv_mr (field order) and never
        // reallocated.
        let recv_mr = unsafe { ep.register(recv_buf.as_mut_ptr(), recv_buf.len())? };
        let read_depth = u32::from(host_ird).min(ep.max_init_rd_atom).max(1);
        let link = RdmaLink {
            slot_mrs: Vec::new(),
            pool_mrs: Vec::new(),
            recv_mr,
            recv_buf,
            ep,
            capsule_len,
            read_depth,
            reads: 0,
            waiting: VecDeque::new(),
            wcs: vec![Wc::default(); POLL_BATCH],
            posts: Vec::with_capacity(64),
            cqes: Vec::with_capacity(64),
            failed: false,
            local,
            peer,
            cm_qid: req.qid,
        };
        for i in 0..entries as usize {
            link.repost(i)?;
        }
        Ok(link)
    }

    fn repost(&self, i: usize) -> io::Result<()> {
        let addr = self.recv_mr.addr + (i * self.capsule_len) as u64;
        self.ep.post_recv(
            WR_RECV | i as u64,
            addr,
            self.capsule_len as u32,
            self.recv_mr.lkey,
        )
    }

    /// The completion channel's descriptor.
    pub fn comp_fd(&self) -> i32 {
        self.ep.comp_fd()
    }

    /// The connection's CM event channel descriptor.
    pub fn cm_fd(&self) -> Option<i32> {
        self.ep.events().map(|c| c.fd())
    }

    /// Drains the connection's CM events. True: the peer disconnected.
    pub fn cm_events(&mut self) -> bool {
        let Some(ch) = self.ep.events() else {
            return false;
        };
        let mut gone = false;
        while let Ok(Some(ev)) = ch.next() {
            match ev.kind {
                event::ESTABLISHED => {}
                event::DISCONNECTED | event::TIMEWAIT_EXIT | event::DEVICE_REMOVAL => gone = true,
                _ => tracing::debug!(peer = %self.peer, event = %ev.name(), "RDMA CM event"),
            }
        }
        gone
    }

    /// Runs up to [`POLL_BUDGET`] completions through the queue. Returns
    /// true when the budget ran out with more possibly waiting.
    pub fn poll(&mut self, q: &mut Queue, tx: &mut Tx, ex: &mut crate::queue::Exec<'_>) -> bool {
        self.ep.take_comp_events();
        let mut done = 0;
        let mut rearmed = false;
        loop {
            let n = match self.ep.poll(&mut self.wcs) {
                Ok(n) => n,
                Err(_) => {
                    self.failed = true;
                    return false;
                }
            };
            for k in 0..n {
                let wc = self.wcs[k];
                self.on_wc(wc, q, tx, ex);
            }
            done += n;
            if n == POLL_BATCH {
                if done >= POLL_BUDGET {
                    return true;
                }
                continue;
            }
            if rearmed {
                return false;
            }
            // Arm, then look once more: a completion that arrived before
            // arming raises no event.
            if self.ep.arm().is_err() {
                self.failed = true;
                return false;
            }
            rearmed = true;
        }
    }

    fn on_wc(&mut self, wc: Wc, q: &mut Queue, tx: &mut Tx, ex: &mut crate::queue::Exec<'_>) {
        let kind = wc.wr_id & WR_KIND;
        let index = wc.wr_id & !WR_KIND;
        if !wc.ok() {
            if !wc.flushed() && !self.failed {
                tracing::debug!(peer = %self.peer, status = wc.status, "RDMA work completion failed; closing the queue pair");
            }
            self.failed = true;
            return;
        }
        match kind {
            WR_RECV => {
                let i = index as usize;
                let start = i * self.capsule_len;
                let len = (wc.byte_len as usize).min(self.capsule_len);
                let cap = &self.recv_buf[start..start + len];
                if q.on_rdma_capsule(cap, tx, ex).is_err() {
                    self.failed = true;
                    return;
                }
                if self.repost(i).is_err() {
                    self.failed = true;
                }
            }
            WR_FETCH => {
                self.reads -= 1;
                q.on_rdma_fetched(index as u16, tx, ex);
            }
            WR_SEND if index != NO_SLOT => tx.released.push(index as u16),
            _ => {}
        }
    }

    /// Posts what the queue asked for, in one call. False: the queue pair
    /// failed.
    pub fn post(&mut self, q: &mut Queue, tx: &mut Tx) -> bool {
        if self.failed {
            tx.rdma.clear();
            return false;
        }
        self.posts.clear();
        self.cqes.clear();
        // Fetches that waited for a READ credit go first.
        while self.reads < self.read_depth {
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            if self.stage(w, q).is_err() {
                self.failed = true;
            }
        }
        for k in 0..tx.rdma.len() {
            let w = tx.rdma[k];
            if matches!(w, RdmaWork::Fetch { .. }) && self.reads >= self.read_depth {
                self.waiting.push_back(w);
                continue;
            }
            if self.stage(w, q).is_err() {
                self.failed = true;
            }
        }
        tx.rdma.clear();
        // The CQE vector is complete: point the inline SENDs at it.
        for w in self.posts.iter_mut().filter(|w| w.inline) {
            w.addr = self.cqes[w.addr as usize].as_ptr() as u64;
        }
        if !self.failed && self.ep.post_send(&self.posts).is_err() {
            self.failed = true;
        }
        !self.failed
    }

    fn stage(&mut self, w: RdmaWork, q: &mut Queue) -> io::Result<()> {
        let wr = match w {
            RdmaWork::Fetch {
                slot,
                len,
                raddr,
                rkey,
            } => {
                let (addr, lkey) = self.slot_mr(q, slot)?;
                self.reads += 1;
                SendWr {
                    wr_id: WR_FETCH | slot as u64,
                    kind: SendKind::Read,
                    addr,
                    len,
                    lkey,
                    remote_addr: raddr,
                    rkey,
                    signaled: true,
                    inline: false,
                }
            }
            RdmaWork::Deliver {
                slot,
                len,
                raddr,
                rkey,
            } => {
                let (addr, lkey) = self.slot_mr(q, slot)?;
                // Unsignaled: the response SEND after it completes later.
                SendWr {
                    wr_id: 0,
                    kind: SendKind::Write,
                    addr,
                    len,
                    lkey,
                    remote_addr: raddr,
                    rkey,
                    signaled: false,
                    inline: false,
                }
            }
            RdmaWork::Respond {
                cqe,
                invalidate,
                release,
            } => {
                // Inline: the bytes are copied when posted; until then the
                // CQE waits in `cqes` (its index in `addr` until then).
                self.cqes.push(cqe);
                self.posts.push(SendWr {
                    wr_id: WR_SEND | release.map_or(NO_SLOT, u64::from),
                    kind: match invalidate {
                        Some(k) => SendKind::SendInvalidate(k),
                        None => SendKind::Send,
                    },
                    addr: (self.cqes.len() - 1) as u64,
                    len: cqe.len() as u32,
                    lkey: 0,
                    remote_addr: 0,
                    rkey: 0,
                    signaled: true,
                    inline: true,
                });
                return Ok(());
            }
        };
        self.posts.push(wr);
        Ok(())
    }

    /// The registration of the buffer slot `slot` uses now: its own
    /// buffer's, made (again) when that is new or has grown, or the pool
    /// buffer's it borrowed, made the first time this link uses that one.
    fn slot_mr(&mut self, q: &mut Queue, slot: u16) -> io::Result<(u64, u32)> {
        let b = q.slot_buffer(slot);
        let (mrs, i) = match b.pool_id {
            Some(id) => (&mut self.pool_mrs, id as usize),
            None => (&mut self.slot_mrs, slot as usize),
        };
        if mrs.len() <= i {
            mrs.resize_with(i + 1, || None);
        }
        match &mrs[i] {
            Some(mr) if mr.addr == b.ptr as u64 && mr.len == b.cap => Ok((mr.addr, mr.lkey)),
            _ => {
                // SAFETY: a slot's own buffer lives in the queue, which
                // outlives this link, and a grown one gets a new region
                // before it is used (the old one is dropped here); a pool
                // buffer lives as long as the reactor, which drops its
                // connections (this link) first.
                let mr = unsafe { self.ep.register(b.ptr, b.cap)? };
                let r = (mr.addr, mr.lkey);
                mrs[i] = Some(mr);
                Ok(r)
            }
        }
    }

    /// Starts an orderly disconnect (the host sees DISCONNECTED).
    pub fn disconnect(&self) {
        self.ep.id().disconnect();
    }
}

/// A connection the listener accepted, for a reactor to adopt.
#[derive(Debug)]
pub struct RdmaIncoming(pub Box<RdmaLink>);

enum Cmd {
    Add(SocketAddr, SyncSender<Result<SocketAddr, String>>),
    Remove(SocketAddr, SyncSender<Result<(), String>>),
}

/// Adds and removes NVMe/RDMA listeners of a running target (the admin API).
#[derive(Clone)]
pub struct RdmaControl {
    tx: SyncSender<Cmd>,
    waker: Arc<Waker>,
}

impl std::fmt::Debug for RdmaControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RdmaControl")
    }
}

impl RdmaControl {
    pub fn add(&self, addr: SocketAddr) -> Result<SocketAddr, String> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Cmd::Add(addr, tx))?;
        rx.recv_timeout(Duration::from_secs(5))
            .map_err(|_| "RDMA listener did not answer".to_string())?
    }

    pub fn remove(&self, addr: SocketAddr) -> Result<(), String> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(Cmd::Remove(addr, tx))?;
        rx.recv_timeout(Duration::from_secs(5))
            .map_err(|_| "RDMA listener did not answer".to_string())?
    }

    fn send(&self, c: Cmd) -> Result<(), String> {
        self.tx
            .try_send(c)
            .map_err(|_| "RDMA listener busy or gone".to_string())?;
        let _ = self.waker.wake();
        Ok(())
    }
}

/// The running RDMA CM listener thread.
#[derive(Debug)]
pub struct RdmaListener {
    pub control: RdmaControl,
    thread: JoinHandle<()>,
}

impl RdmaListener {
    /// Waits for the thread (it ends when the target shuts down).
    pub fn join(self) {
        let _ = self.control.waker.wake();
        let _ = self.thread.join();
    }
}

/// Starts the RDMA CM listener thread, bound to `addrs`. With RDMA
/// unavailable here: an error naming why if `addrs` asks for listeners,
/// else `None` (and the reason, for the start-up log).
pub fn start_listener(
    target: Arc<Target>,
    addrs: &[SocketAddr],
    reactors: Vec<ReactorHandle>,
    live: Arc<AtomicUsize>,
) -> anyhow::Result<Result<RdmaListener, String>> {
    if let Err(why) = nvpool_rdma::available() {
        if let Some(a) = addrs.first() {
            anyhow::bail!("cannot listen on rdma:{a}: RDMA is unavailable: {why}");
        }
        return Ok(Err(why));
    }
    let poll = Poll::new()?;
    let waker = Arc::new(Waker::new(poll.registry(), WAKE)?);
    let ch = EventChannel::new()?;
    poll.registry()
        .register(&mut SourceFd(&ch.fd()), CM, Interest::READABLE)?;
    let (tx, cmds) = mpsc::sync_channel(16);
    let mut l = Listener {
        target,
        ids: Vec::new(),
        ch,
        poll,
        cmds,
        reactors,
        next: 0,
        live,
    };
    for &a in addrs {
        l.bind(a)
            .map_err(|e| anyhow::anyhow!("cannot listen on rdma:{a}: {e}"))?;
    }
    l.publish();
    let thread = std::thread::Builder::new()
        .name("nvpool-rdma-cm".into())
        .spawn(move || l.run())?;
    Ok(Ok(RdmaListener {
        control: RdmaControl { tx, waker },
        thread,
    }))
}

const WAKE: Token = Token(0);
const CM: Token = Token(1);

struct Listener {
    target: Arc<Target>,
    /// The listening ids and their bound addresses; before their channel,
    /// so they are destroyed first.
    ids: Vec<(SocketAddr, CmId)>,
    ch: EventChannel,
    poll: Poll,
    cmds: Receiver<Cmd>,
    reactors: Vec<ReactorHandle>,
    next: usize,
    live: Arc<AtomicUsize>,
}

impl Listener {
    fn bind(&mut self, a: SocketAddr) -> io::Result<SocketAddr> {
        let id = CmId::new(&self.ch)?;
        id.bind(a)?;
        id.listen(LISTEN_BACKLOG)?;
        let b = id.local_addr().unwrap_or(a);
        if self.ids.iter().any(|(x, _)| *x == b) {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                "already listening there",
            ));
        }
        tracing::info!(addr = %b, "listening for NVMe/RDMA");
        self.ids.push((b, id));
        Ok(b)
    }

    fn publish(&self) {
        let mut v: Vec<SocketAddr> = self.ids.iter().map(|(a, _)| *a).collect();
        v.sort();
        self.target.set_rdma_listeners(v);
    }

    fn run(mut self) {
        let mut events = Events::with_capacity(8);
        while !self.target.shutting_down() {
            if let Err(e) = self
                .poll
                .poll(&mut events, Some(Duration::from_millis(500)))
            {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(error = %e, "RDMA listener poll failed");
                }
                continue;
            }
            self.commands();
            loop {
                match self.ch.next() {
                    Ok(Some(ev)) => self.on_event(ev),
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "RDMA CM event channel failed");
                        break;
                    }
                }
            }
        }
    }

    fn commands(&mut self) {
        while let Ok(c) = self.cmds.try_recv() {
            match c {
                Cmd::Add(a, reply) => {
                    let r = self
                        .bind(a)
                        .map_err(|e| format!("cannot listen on rdma:{a}: {e}"));
                    self.publish();
                    let _ = reply.send(r);
                }
                Cmd::Remove(a, reply) => {
                    let r = match self.ids.iter().position(|(x, _)| *x == a) {
                        Some(i) => {
                            // Destroying the id stops listening; accepted
                            // connections have ids of their own.
                            self.ids.remove(i);
                            tracing::info!(addr = %a, "RDMA listener removed");
                            Ok(())
                        }
                        None => Err(format!("not listening on rdma:{a}")),
                    };
                    self.publish();
                    let _ = reply.send(r);
                }
            }
        }
    }

    fn on_event(&mut self, mut ev: CmEvent) {
        if ev.kind != event::CONNECT_REQUEST {
            tracing::debug!(event = %ev.name(), "RDMA CM event on a listener");
            return;
        }
        let Some(id) = ev.take_request_id() else {
            return;
        };
        let refuse = |id: &CmId, sts: u16, why: &str| {
            peer_info!(peer = ?id.peer_addr(), sts, why, "NVMe/RDMA connect request rejected");
            let _ = id.reject(&nvpool_wire::rdma::encode_reject(sts));
        };
        let req = match CmRequest::decode(&ev.private) {
            Ok(r) => r,
            Err(sts) => return refuse(&id, sts, "bad private data"),
        };
        let entries = req.hsqsize as u32 + 1;
        let (max_entries, bad_qid) = if req.qid == 0 {
            (limits::ADMIN_QUEUE_ENTRIES_MAX as u32, false)
        } else {
            (
                limits::IO_QUEUE_ENTRIES_MAX as u32,
                req.qid > limits::IO_QUEUES_PER_CTRL_MAX,
            )
        };
        if bad_qid {
            return refuse(&id, reject::INVALID_QID, "QID out of range");
        }
        if req.hsqsize == 0 || entries > max_entries {
            return refuse(&id, reject::INVALID_HSQSIZE, "queue size out of range");
        }
        if (req.hrqsize as u32) < entries {
            return refuse(
                &id,
                reject::INVALID_HRQSIZE,
                "fewer response buffers than commands",
            );
        }
        if ev.initiator_depth == 0 {
            // Host writes need RDMA READs from its memory.
            return refuse(&id, reject::INVALID_IRD, "host accepts no RDMA READ");
        }
        if self.live.load(Ordering::Acquire) >= self.target.connections_max() {
            return refuse(&id, reject::NO_RESOURCES, "connection limit reached");
        }
        // Build and accept; a failure after the id is consumed destroys it,
        // which the CM answers with a reject.
        let link = RdmaLink::new(id, &req, ev.initiator_depth).and_then(|mut l| {
            l.ep.own_events()?;
            let crq = CmAccept {
                recfmt: 0,
                crqsize: entries as u16,
            };
            l.ep.accept(&crq.encode(), l.read_depth.min(255) as u8)?;
            Ok(l)
        });
        let link = match link {
            Ok(l) => Box::new(l),
            Err(e) => {
                peer_warn!(error = %e, "cannot set up an NVMe/RDMA queue pair");
                return;
            }
        };
        self.live.fetch_add(1, Ordering::AcqRel);
        let mut c = RdmaIncoming(link);
        let start = self.next;
        self.next = (start + 1) % self.reactors.len().max(1);
        for k in 0..self.reactors.len() {
            let r = &self.reactors[(start + k) % self.reactors.len()];
            match r.adopt_rdma(c) {
                Ok(()) => return,
                Err(back) => c = back,
            }
        }
        self.live.fetch_sub(1, Ordering::AcqRel);
        peer_warn!(peer = %c.0.peer, "all reactors saturated; RDMA connection dropped");
        c.0.disconnect();
    }
}
