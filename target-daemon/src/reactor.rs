//! Reactor threads: each owns a set of connections and one io_uring that
//! carries both their sockets and their backend I/O.
//!
//! A connection is a TCP socket or an RDMA queue pair (rdma.rs); both feed
//! the same [`Queue`].
//!
//! ```text
//!   io_uring_enter (submit + sleep, or spin a few µs first when busy)
//!        │ completions
//!        ├─ multishot recv ──► provided buffer ──► PDU parser ──► Queue::on_pdu
//!        │                     (given back at once; a PDU split across
//!        │                      buffers is staged in the connection's Rx)
//!        ├─ sendmsg done ────► Tx::advance (slots whose data went out freed)
//!        ├─ backend I/O ─────► Queue::on_completion
//!        ├─ eventfd read ────► adopt new connections (async completions too)
//!        └─ RDMA channel poll ► poll the CQ / CM events
//!   then: asynchronous completions, parked retries, tick, buffer grants,
//!   one sendmsg per connection with output (none while one is in flight)
//! ```
//!
//! A TCP connection keeps one multishot receive in the ring. Its
//! completions name a buffer of the reactor's provided-buffer ring
//! ([`RecvBufs`]); complete PDUs are parsed where they lie and the buffer
//! goes back in the same iteration. A receive that ends (no
//! `IORING_CQE_F_MORE`: buffers ran out, or the kernel stopped it) is armed
//! again once the buffers are back; one that ends with 0 or an error closes
//! the connection. A connection whose transmit backlog passes
//! `TX_HIGH_WATER_BYTES` has its receive cancelled until the backlog halves.
//!
//! Responses accumulate in the connection's [`Tx`] during an iteration and
//! leave in one `sendmsg` (up to `IOV_MAX` pieces); while it is in flight its
//! iovecs and every byte they name stay put (D4), and the next send, for the
//! rest of a partial one or for what was queued since, goes after its
//! completion.
//!
//! The loop sleeps in one `io_uring_enter` with a timeout (a tick at most).
//! The acceptor's hand-off and asynchronous backends (volume namespaces)
//! wake it through an eventfd whose read the reactor keeps in the ring.
//! After an iteration with work it may first watch the completion queue for
//! a few microseconds without sleeping (`Target::set_reactor_spin_us`, off
//! by default), backing off while that finds nothing; an idle reactor
//! sleeps.
//!
//! An RDMA connection keeps a one-shot poll in the ring on its completion
//! channel (a CQ with new completions) and on its CM event channel
//! (DISCONNECTED), armed again after each. Its completions are polled with a
//! bounded budget and then the CQ is armed again, so an idle connection
//! costs nothing; a connection that used its whole budget is polled again
//! next iteration without waiting.
//!
//! A closed connection stays in the table, a zombie, until every ring
//! operation of its own (receive, send, polls; cancelled at close) and every
//! backend operation (ring or asynchronous) is back: the memory they point
//! at lives until then.
//!
//! Host writes parked behind a copy job's claim (queue/park.rs) are retried every
//! iteration while any are parked, and the loop then waits at most
//! `PARKED_RETRY_MS` so a released claim is noticed quickly.
//!
//! The reactor owns a pool of large data buffers under a byte budget
//! (bufpool.rs). Each iteration takes back the buffers freed slots left in
//! their queues and hands them to the commands waiting for one, oldest
//! first; while one is free and a command waits, the loop does not sleep.
//!
//! A queue that finds one of its slot-state invariants broken (queue/slots.rs)
//! ends its connection and is never freed: the reactor keeps it, and every
//! buffer it holds, for as long as it runs, rather than let the ring or the
//! socket touch freed memory.

use crate::backend::{AsyncCompletion, CompletionSink};
use crate::bufpool::BufPool;
use crate::limits;
use crate::peerlog::{peer_error, peer_warn};
use crate::queue::{split_user_data, user_data_tag, Exec, Queue, Submit, Tx};
use crate::rdma::{RdmaIncoming, RdmaLink};
use crate::ring::{send_now, Completion, RecvBufs, Ring, SendMsg, Wakeup};
use crate::target::Target;
use io_uring::cqueue;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// New connections waiting for a reactor to adopt them.
const HANDOFF_QUEUE_LEN: usize = 256;

/// Most busy iterations a reactor sleeps without spinning after fruitless
/// spins (see `Reactor::wait`): it tries again at least this often.
const SPIN_BACKOFF_MAX: u32 = 256;

/// The buffer group of the reactor's provided receive buffers.
const RECV_GROUP: u16 = 0;

/// User data of the reactor's own ring operations: bit 63 set, the kind
/// in bits 32..40, the connection in bits 0..32. Backend operations never
/// set bit 63 (their tag, bits 48..64, is at most a zero write's length in
/// 512-byte units).
const OWN: u64 = 1 << 63;
const _: () = assert!(limits::ZERO_WRITE_CHUNK_BYTES / 512 < 1 << 15);
const _: () = assert!(limits::CONNECTIONS_MAX <= u32::MAX as usize);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Recv = 1,
    Send = 2,
    Wake = 3,
    RdmaComp = 4,
    RdmaCm = 5,
    /// A cancellation; its completion says nothing we need.
    Cancel = 6,
}

fn own(op: Op, conn: usize) -> u64 {
    OWN | (op as u64) << 32 | conn as u64
}

fn split_own(ud: u64) -> Option<(Op, usize)> {
    let conn = (ud & 0xffff_ffff) as usize;
    let op = match (ud >> 32) as u8 {
        1 => Op::Recv,
        2 => Op::Send,
        3 => Op::Wake,
        4 => Op::RdmaComp,
        5 => Op::RdmaCm,
        6 => Op::Cancel,
        _ => return None,
    };
    Some((op, conn))
}

/// The ring as the backends may use it: absent when they run inline.
fn backend_ring(ring: &mut Ring, on: bool) -> Option<&mut dyn Submit> {
    on.then_some(ring)
}

/// A connection handed to a reactor.
#[derive(Debug)]
enum Incoming {
    Tcp(std::net::TcpStream),
    Rdma(RdmaIncoming),
}

/// The acceptors' handle on one reactor.
#[derive(Debug, Clone)]
pub struct ReactorHandle {
    tx: SyncSender<Incoming>,
    waker: Arc<Wakeup>,
}

impl ReactorHandle {
    /// Hands a connection over. Err(stream) when the reactor is saturated.
    pub fn adopt(&self, s: std::net::TcpStream) -> Result<(), std::net::TcpStream> {
        match self.tx.try_send(Incoming::Tcp(s)) {
            Ok(()) => {
                self.waker.wake();
                Ok(())
            }
            Err(
                TrySendError::Full(Incoming::Tcp(s)) | TrySendError::Disconnected(Incoming::Tcp(s)),
            ) => Err(s),
            Err(_) => unreachable!("a TCP connection comes back as one"),
        }
    }

    /// Hands an accepted RDMA queue pair over. Err when saturated.
    pub fn adopt_rdma(&self, c: RdmaIncoming) -> Result<(), RdmaIncoming> {
        match self.tx.try_send(Incoming::Rdma(c)) {
            Ok(()) => {
                self.waker.wake();
                Ok(())
            }
            Err(
                TrySendError::Full(Incoming::Rdma(c))
                | TrySendError::Disconnected(Incoming::Rdma(c)),
            ) => Err(c),
            Err(_) => unreachable!("an RDMA connection comes back as one"),
        }
    }

    /// Makes the reactor look at the shutdown flag now.
    pub fn wake(&self) {
        self.waker.wake();
    }
}

/// A PDU that arrived split across received buffers, gathered until whole.
struct Rx {
    buf: Box<[u8]>,
    len: usize,
}

struct TcpLink {
    sock: std::net::TcpStream,
    rx: Rx,
    /// Receiving paused until the transmit backlog drains.
    read_paused: bool,
    /// A multishot receive is in the ring.
    recv_armed: bool,
    /// A send is in the ring: `msg`, and the Tx data it names, are the
    /// kernel's until its completion.
    sending: bool,
    msg: SendMsg,
}

enum Link {
    Tcp(TcpLink),
    Rdma(Box<RdmaLink>),
    /// Closed: the queue pair is gone.
    Gone,
}

struct Conn {
    link: Link,
    tx: Tx,
    q: Queue,
    /// No more reading: the queue ended or the peer closed.
    read_done: bool,
    /// Closed; the entry lives on until in-flight work (backend, ring or
    /// asynchronous, and the connection's own ring operations) completes.
    zombie: bool,
    /// The connection's own operations in the ring (receive, send, polls).
    ops: u32,
    /// RDMA: a poll is armed on the completion channel, the CM channel.
    polls: [bool; 2],
}

impl Conn {
    fn read_paused(&self) -> bool {
        matches!(&self.link, Link::Tcp(t) if t.read_paused)
    }

    /// Something for flush() to do.
    fn has_output(&self) -> bool {
        self.tx.backlog() > 0 || !self.tx.rdma.is_empty()
    }

    /// Nothing in flight points at the connection any more.
    fn idle(&self) -> bool {
        self.q.inflight == 0 && self.ops == 0 && !self.q.poisoned()
    }
}

pub struct Reactor {
    id: usize,
    target: Arc<Target>,
    incoming: Receiver<Incoming>,
    ring: Ring,
    /// Backends use the ring (else they run inline).
    backend_uring: bool,
    /// After `ring`: unmapped once the ring is idle (or never).
    recv: RecvBufs,
    wake: Arc<Wakeup>,
    conns: Vec<Option<Conn>>,
    /// After `conns`: dropped after every connection (an RDMA link holds
    /// registrations of pool buffers).
    bufs: BufPool,
    free: Vec<usize>,
    live: Arc<AtomicUsize>,
    completions: Vec<Completion>,
    /// Where asynchronous backends complete this reactor's operations.
    sink: Arc<CompletionSink>,
    async_completions: Vec<AsyncCompletion>,
    /// Connections that may have parked commands.
    parked: Vec<usize>,
    /// RDMA connections that used their poll budget: polled again at once.
    rdma_again: Vec<usize>,
    /// Connections whose receive ended: armed again once buffers are back.
    rearm: Vec<usize>,
    /// Busy iterations that sleep without spinning first, and what the
    /// next fruitless spin sets that to (see `wait`).
    spin_skip: u32,
    spin_backoff: u32,
    /// Longest spin before a sleep; 0: none.
    spin_us: u64,
}

impl std::fmt::Debug for Reactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reactor")
            .field("id", &self.id)
            .field("conns", &(self.conns.len() - self.free.len()))
            .finish()
    }
}

impl Reactor {
    /// Creates a reactor. Its sockets need io_uring with multishot receive
    /// (Linux 6.0); `use_uring` false runs backends synchronously on the
    /// reactor thread.
    pub fn new(
        id: usize,
        target: Arc<Target>,
        live: Arc<AtomicUsize>,
        use_uring: bool,
    ) -> io::Result<(Reactor, ReactorHandle)> {
        let mut ring = Ring::for_reactor(limits::RING_ENTRIES)?;
        let recv = RecvBufs::new(
            &mut ring,
            limits::RECV_BUF_COUNT,
            limits::RECV_BUF_BYTES,
            RECV_GROUP,
        )?;
        let wake = Arc::new(Wakeup::new()?);
        let (tx, incoming) = mpsc::sync_channel(HANDOFF_QUEUE_LEN);
        let sink_waker = wake.clone();
        let sink = CompletionSink::new(move || sink_waker.wake());
        let bufs = BufPool::new(id, target.reactor_buffer_budget())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        target.register_buffers(bufs.stats());
        let spin_us = target.reactor_spin_us();
        let r = Reactor {
            id,
            target,
            incoming,
            ring,
            backend_uring: use_uring,
            recv,
            wake: wake.clone(),
            conns: Vec::new(),
            bufs,
            free: Vec::new(),
            live,
            completions: Vec::with_capacity(256),
            sink,
            async_completions: Vec::with_capacity(256),
            parked: Vec::new(),
            rdma_again: Vec::new(),
            rearm: Vec::new(),
            spin_skip: 0,
            spin_backoff: 0,
            spin_us,
        };
        Ok((r, ReactorHandle { tx, waker: wake }))
    }

    /// Runs until shutdown has drained every connection.
    pub fn run(mut self) {
        let mut next_tick = 0;
        let mut drain_deadline: Option<u64> = None;
        let mut busy = false;
        self.ring.push_wake_read(&self.wake, own(Op::Wake, 0));
        loop {
            let timeout = if !self.rdma_again.is_empty() || self.bufs.can_grant() {
                0
            } else if !self.parked.is_empty() {
                limits::PARKED_RETRY_MS
            } else {
                limits::TICK_MS
            };
            if let Err(e) = self.wait(timeout, busy) {
                tracing::error!(reactor = self.id, error = %e, "io_uring_enter failed");
            }
            busy = self.reap();
            for i in std::mem::take(&mut self.rdma_again) {
                self.rdma_read(i);
            }
            busy |= self.reap_async();
            self.retry_parked();
            let now = self.target.now_ms();
            if now >= next_tick {
                next_tick = now + limits::TICK_MS;
                self.tick(now);
            }
            self.grant_buffers();
            busy |= self.flush_all();
            // Slots freed by what was just sent: their buffers are taken
            // back now, so the next wait does not sleep while a command
            // could have one.
            self.collect_buffers();
            if self.target.shutting_down() {
                let deadline = *drain_deadline.get_or_insert_with(|| {
                    for c in self.conns.iter_mut().flatten() {
                        c.q.request_close();
                    }
                    now + limits::SHUTDOWN_DRAIN_MS
                });
                // Connections close one by one as they become idle (flush()).
                let open = self.conns.iter().flatten().any(|c| !c.zombie);
                if open && now >= deadline {
                    tracing::warn!(
                        reactor = self.id,
                        "shutdown: drain deadline passed with commands in flight"
                    );
                    for i in 0..self.conns.len() {
                        self.close(i);
                    }
                }
                // Zombies wait for their backend and ring operations.
                let waiting = self
                    .conns
                    .iter()
                    .flatten()
                    .any(|c| c.q.inflight > 0 || c.ops > 0);
                if !open && (!waiting || now >= deadline + 1000) {
                    break;
                }
            }
        }
        self.stop();
    }

    /// Takes everything out of the ring before its memory goes.
    fn stop(&mut self) {
        self.ring.push_cancel_all(own(Op::Cancel, 0));
        let mut out = Vec::new();
        if !self.ring.wait_idle(Duration::from_secs(1), &mut out) {
            tracing::warn!(
                reactor = self.id,
                "io_uring operations still in flight at exit; their buffers are kept"
            );
            self.recv.leak();
        }
    }

    /// Submits new ring work and waits up to `timeout_ms` for completions.
    ///
    /// After a busy iteration it may first watch the completion queue for
    /// `spin_us` (`Target::set_reactor_spin_us`; 0, the default, never),
    /// yielding the CPU between looks so a thread that
    /// shares it (a loopback peer, a backend's worker) still runs. A spin
    /// that finds nothing is CPU thrown away, so spinning backs off: after
    /// a fruitless one the next `spin_backoff` busy iterations sleep at
    /// once, and each fruitless spin doubles that (up to
    /// `SPIN_BACKOFF_MAX`) while each fruitful one halves it. A reactor
    /// spins steadily only where completions come within the spin.
    fn wait(&mut self, timeout_ms: u64, busy: bool) -> io::Result<()> {
        if timeout_ms == 0 {
            return self.ring.submit();
        }
        if busy && self.spin_us > 0 {
            if self.spin_skip > 0 {
                self.spin_skip -= 1;
            } else {
                self.ring.submit()?;
                let end = Instant::now() + Duration::from_micros(self.spin_us);
                loop {
                    if self.ring.has_completions() {
                        self.spin_backoff /= 2;
                        return Ok(());
                    }
                    if Instant::now() >= end {
                        break;
                    }
                    std::thread::yield_now();
                }
                self.spin_backoff = (self.spin_backoff * 2).clamp(1, SPIN_BACKOFF_MAX);
                self.spin_skip = self.spin_backoff;
            }
        }
        self.ring.submit_and_wait(Duration::from_millis(timeout_ms))
    }

    /// Runs every ring completion. True if there was any.
    fn reap(&mut self) -> bool {
        let mut done = std::mem::take(&mut self.completions);
        done.clear();
        self.ring.reap(&mut done);
        let now = self.target.now_ms();
        for &(ud, res, flags) in &done {
            if ud & OWN == 0 {
                let tag = user_data_tag(ud);
                self.complete(ud, now, |q, slot, tx, ex| {
                    q.on_completion(slot, tag, res, tx, ex)
                });
                continue;
            }
            match split_own(ud) {
                Some((Op::Recv, i)) => self.on_recv(i, res, flags, now),
                Some((Op::Send, i)) => self.on_send(i, res),
                Some((Op::Wake, _)) => self.on_wake(res),
                Some((Op::RdmaComp, i)) => self.on_rdma_poll(i, false, res),
                Some((Op::RdmaCm, i)) => self.on_rdma_poll(i, true, res),
                // Cancellations, and what the ring's start-up probe left.
                Some((Op::Cancel, _)) | None => {}
            }
        }
        let any = !done.is_empty();
        self.completions = done;
        self.recv.publish();
        for i in std::mem::take(&mut self.rearm) {
            self.arm_recv(i);
        }
        any
    }

    fn on_wake(&mut self, res: i32) {
        if res < 0 && res != -libc::EINTR && res != -libc::EAGAIN {
            // Never expected of an eventfd; without the read the loop
            // still runs every tick.
            tracing::error!(reactor = self.id, error = %io::Error::from_raw_os_error(-res), "reading the reactor's eventfd failed; wake-ups now wait for the next tick");
        } else {
            self.ring.push_wake_read(&self.wake, own(Op::Wake, 0));
        }
        self.adopt_new();
    }

    fn adopt_new(&mut self) {
        while let Ok(inc) = self.incoming.try_recv() {
            let r = match inc {
                Incoming::Tcp(s) => self.add(s),
                Incoming::Rdma(c) => self.add_rdma(c),
            };
            if let Err(e) = r {
                peer_warn!(reactor = self.id, error = %e, "could not adopt a connection");
                self.live.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    fn slot(&mut self) -> usize {
        self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        })
    }

    fn add_rdma(&mut self, RdmaIncoming(link): RdmaIncoming) -> io::Result<()> {
        let i = self.slot();
        tracing::debug!(reactor = self.id, peer = %link.peer, cm_qid = link.cm_qid, "RDMA connection adopted");
        let q = Queue::new_rdma(
            self.target.clone(),
            link.local,
            link.peer,
            self.target.now_ms(),
            link.cm_qid,
        );
        let has_cm = link.cm_fd().is_some();
        self.conns[i] = Some(Conn {
            link: Link::Rdma(link),
            tx: Tx::default(),
            q,
            read_done: false,
            zombie: false,
            ops: 0,
            polls: [false; 2],
        });
        self.arm_poll(i, false);
        if has_cm {
            self.arm_poll(i, true);
        }
        // Capsules may have arrived before the reactor got the connection.
        self.rdma_read(i);
        Ok(())
    }

    /// Arms a poll on an RDMA connection's completion channel (`cm` false)
    /// or CM event channel.
    fn arm_poll(&mut self, i: usize, cm: bool) {
        let Some(Some(c)) = self.conns.get_mut(i) else {
            return;
        };
        let Link::Rdma(l) = &c.link else {
            return;
        };
        if c.zombie || c.polls[cm as usize] {
            return;
        }
        let (fd, op) = if cm {
            let Some(fd) = l.cm_fd() else {
                return;
            };
            (fd, Op::RdmaCm)
        } else {
            (l.comp_fd(), Op::RdmaComp)
        };
        self.ring.push_poll(fd, own(op, i));
        c.polls[cm as usize] = true;
        c.ops += 1;
    }

    fn on_rdma_poll(&mut self, i: usize, cm: bool, res: i32) {
        let Some(Some(c)) = self.conns.get_mut(i) else {
            return;
        };
        c.polls[cm as usize] = false;
        c.ops = c.ops.saturating_sub(1);
        if c.zombie {
            self.free_if_idle(i);
            return;
        }
        if res < 0 {
            tracing::debug!(peer = %c.q.peer, error = %io::Error::from_raw_os_error(-res), "polling an RDMA channel failed");
            self.close(i);
            return;
        }
        if cm {
            self.rdma_cm(i);
        } else {
            self.rdma_read(i);
        }
        self.arm_poll(i, cm);
    }

    /// The CM event channel of an RDMA connection is readable.
    fn rdma_cm(&mut self, i: usize) {
        let gone = match self.conns.get_mut(i) {
            Some(Some(Conn {
                link: Link::Rdma(l),
                zombie: false,
                ..
            })) => l.cm_events(),
            _ => false,
        };
        if gone {
            self.close(i);
        }
    }

    fn add(&mut self, s: std::net::TcpStream) -> io::Result<()> {
        // Blocking: the ring then waits for the socket (a nonblocking one
        // would have its reads and writes fail with EAGAIN instead).
        s.set_nonblocking(false)?;
        s.set_nodelay(true)?;
        let local = s.local_addr()?;
        let peer = s.peer_addr()?;
        let i = self.slot();
        tracing::debug!(reactor = self.id, %peer, "connection adopted");
        let q = Queue::new(self.target.clone(), local, peer, self.target.now_ms());
        self.conns[i] = Some(Conn {
            link: Link::Tcp(TcpLink {
                sock: s,
                rx: Rx {
                    buf: vec![0u8; limits::RX_BUF_BYTES].into_boxed_slice(),
                    len: 0,
                },
                read_paused: false,
                recv_armed: false,
                sending: false,
                msg: SendMsg::default(),
            }),
            tx: Tx::default(),
            q,
            read_done: false,
            zombie: false,
            ops: 0,
            polls: [false; 2],
        });
        self.arm_recv(i);
        Ok(())
    }

    /// Arms a connection's multishot receive unless it has one or must not
    /// read.
    fn arm_recv(&mut self, i: usize) {
        let Some(Some(c)) = self.conns.get_mut(i) else {
            return;
        };
        let Link::Tcp(t) = &mut c.link else {
            return;
        };
        if c.zombie || c.read_done || t.read_paused || t.recv_armed {
            return;
        }
        self.ring
            .push_recv(t.sock.as_raw_fd(), &self.recv, own(Op::Recv, i));
        t.recv_armed = true;
        c.ops += 1;
    }

    /// A completion of connection `i`'s multishot receive: runs the PDUs in
    /// its buffer and gives the buffer back.
    fn on_recv(&mut self, i: usize, res: i32, flags: u32, now: u64) {
        let more = cqueue::more(flags);
        let bid = cqueue::buffer_select(flags);
        let mut peer_closed = false;
        let mut pause = false;
        if let Some(Some(c)) = self.conns.get_mut(i) {
            if let Link::Tcp(t) = &mut c.link {
                if !more {
                    t.recv_armed = false;
                    c.ops = c.ops.saturating_sub(1);
                }
                let live = !c.zombie && !c.read_done;
                match res {
                    n if n > 0 => {
                        let data = bid.and_then(|b| self.recv.get(b, n as usize));
                        if let (true, Some(data)) = (live, data) {
                            let ring = backend_ring(&mut self.ring, self.backend_uring);
                            let mut ex = Exec::new(ring, &self.sink, &mut self.bufs, i, now);
                            feed(
                                &mut t.rx,
                                data,
                                &mut c.q,
                                &mut c.tx,
                                &mut c.read_done,
                                &mut ex,
                            );
                            if c.tx.backlog() > limits::TX_HIGH_WATER_BYTES && !t.read_paused {
                                t.read_paused = true;
                                pause = t.recv_armed;
                            }
                        }
                        if live && !more {
                            // The kernel ended the receive (its queue was
                            // full): armed again below.
                            self.rearm.push(i);
                        }
                    }
                    0 => peer_closed = live,
                    e if e == -libc::ENOBUFS || e == -libc::EINTR || e == -libc::EAGAIN => {
                        // Buffers ran out: armed again once they are back.
                        if live && !more {
                            self.rearm.push(i);
                        }
                    }
                    e if e == -libc::ECANCELED => {
                        // Paused (armed again when the backlog drains) or
                        // closing.
                    }
                    e => {
                        if live {
                            tracing::debug!(peer = %c.q.peer, error = %io::Error::from_raw_os_error(-e), "socket receive failed");
                            peer_closed = true;
                        }
                    }
                }
                if live {
                    let parked = c.q.has_parked();
                    if parked && !self.parked.contains(&i) {
                        self.parked.push(i);
                    }
                }
            }
        }
        if let Some(b) = bid {
            self.recv.recycle(b);
        }
        if pause {
            self.ring.push_cancel(own(Op::Recv, i), own(Op::Cancel, i));
        }
        if peer_closed {
            if let Some(Some(c)) = self.conns.get_mut(i) {
                c.read_done = true;
                tracing::debug!(peer = %c.q.peer, qid = ?c.q.qid(), "peer closed the connection");
            }
            self.close(i);
        }
        self.free_if_idle(i);
    }

    /// A send of connection `i` completed with `res` bytes (or an error).
    fn on_send(&mut self, i: usize, res: i32) {
        let Some(Some(c)) = self.conns.get_mut(i) else {
            return;
        };
        let Link::Tcp(t) = &mut c.link else {
            return;
        };
        t.sending = false;
        c.ops = c.ops.saturating_sub(1);
        if c.zombie {
            // Closed while the send was in flight: what it pointed at can
            // go now.
            c.tx.abandon();
            c.q.reclaim(&mut c.tx);
            c.q.take_returned(&mut self.bufs);
            self.free_if_idle(i);
            return;
        }
        if res > 0 {
            c.tx.advance(res as usize);
            c.q.reclaim(&mut c.tx);
            return;
        }
        if res == -libc::EINTR || res == -libc::EAGAIN {
            return;
        }
        if res < 0 {
            tracing::debug!(peer = %c.q.peer, error = %io::Error::from_raw_os_error(-res), "socket send failed");
        }
        self.close(i);
    }

    /// Reads what an RDMA connection's completion queue has.
    fn rdma_read(&mut self, i: usize) {
        let now = self.target.now_ms();
        let ring = backend_ring(&mut self.ring, self.backend_uring);
        let Some(Some(c)) = self.conns.get_mut(i) else {
            return;
        };
        if c.zombie || c.read_done {
            return;
        }
        let Link::Rdma(l) = &mut c.link else {
            return;
        };
        let mut ex = Exec::new(ring, &self.sink, &mut self.bufs, i, now);
        if l.poll(&mut c.q, &mut c.tx, &mut ex) && !self.rdma_again.contains(&i) {
            self.rdma_again.push(i);
        }
        c.q.reclaim(&mut c.tx);
        if c.q.terminated() {
            c.read_done = true;
        }
        let peer_closed = l.failed;
        let parked = c.q.has_parked();
        if peer_closed {
            c.read_done = true;
            tracing::debug!(peer = %c.q.peer, qid = ?c.q.qid(), "peer closed the connection");
            self.close(i);
        } else if parked && !self.parked.contains(&i) {
            self.parked.push(i);
        }
    }

    /// Issues parked commands whose copy claims were released.
    fn retry_parked(&mut self) {
        if self.parked.is_empty() {
            return;
        }
        let now = self.target.now_ms();
        let mut k = 0;
        while k < self.parked.len() {
            let i = self.parked[k];
            let ring = backend_ring(&mut self.ring, self.backend_uring);
            let still = match self.conns.get_mut(i) {
                // A closed connection released its parked slots; an index
                // reused by a new connection is retried harmlessly.
                Some(Some(c)) if !c.zombie => {
                    let mut ex = Exec::new(ring, &self.sink, &mut self.bufs, i, now);
                    c.q.retry_parked(&mut c.tx, &mut ex);
                    c.q.has_parked()
                }
                _ => false,
            };
            if still {
                k += 1;
            } else {
                self.parked.swap_remove(k);
            }
        }
    }

    /// Hands one backend completion (`user_data` names the connection and
    /// slot) to its queue, and frees a zombie connection whose last
    /// operation this was.
    fn complete(
        &mut self,
        user_data: u64,
        now_ms: u64,
        f: impl FnOnce(&mut Queue, u16, &mut Tx, &mut Exec<'_>),
    ) {
        let (ci, slot) = split_user_data(user_data);
        let ci = ci as usize;
        let ring = backend_ring(&mut self.ring, self.backend_uring);
        let Some(Some(c)) = self.conns.get_mut(ci) else {
            // A bug (a connection is freed only once nothing of it is in
            // flight); whatever the completion was for is gone already.
            peer_error!(
                reactor = self.id,
                conn = ci,
                slot,
                "a completion for a connection that no longer exists; ignored"
            );
            return;
        };
        let mut ex = Exec::new(ring, &self.sink, &mut self.bufs, ci, now_ms);
        f(&mut c.q, slot, &mut c.tx, &mut ex);
        c.q.take_returned(&mut self.bufs);
        self.free_if_idle(ci);
    }

    /// Takes back the pool buffers freed slots left in their queues.
    fn collect_buffers(&mut self) {
        if self.bufs.lent() == 0 {
            return;
        }
        for c in self.conns.iter_mut().flatten() {
            c.q.take_returned(&mut self.bufs);
        }
    }

    /// Hands free pool buffers to the commands waiting for one, oldest first.
    fn grant_buffers(&mut self) {
        self.collect_buffers();
        let now = self.target.now_ms();
        while let Some((ud, b)) = self.bufs.grant() {
            let (ci, slot) = split_user_data(ud);
            let ci = ci as usize;
            let ring = backend_ring(&mut self.ring, self.backend_uring);
            let back = match self.conns.get_mut(ci) {
                Some(Some(c)) if !c.zombie => {
                    let mut ex = Exec::new(ring, &self.sink, &mut self.bufs, ci, now);
                    let back = c.q.on_buffer(slot, b, &mut c.tx, &mut ex);
                    // Answered at once (an error status): its buffer is free.
                    c.q.take_returned(&mut self.bufs);
                    back
                }
                // Waits of closed connections are forgotten when they close.
                _ => Some(b),
            };
            if let Some(b) = back {
                self.bufs.give_back(b);
            }
        }
    }

    /// Runs every completion asynchronous backends left in the sink.
    /// True if there was any.
    fn reap_async(&mut self) -> bool {
        let mut done = std::mem::take(&mut self.async_completions);
        self.sink.take(&mut done);
        if done.is_empty() {
            self.async_completions = done;
            return false;
        }
        let now = self.target.now_ms();
        for c in done.drain(..) {
            let result = c.result;
            self.complete(c.user_data, now, |q, slot, tx, ex| {
                q.on_async_completion(slot, result, tx, ex)
            });
        }
        self.async_completions = done;
        true
    }

    fn tick(&mut self, now: u64) {
        for i in 0..self.conns.len() {
            let Some(Some(c)) = self.conns.get_mut(i) else {
                continue;
            };
            if c.zombie {
                continue;
            }
            if !c.q.tick(now, &mut c.tx) {
                self.close(i);
            }
        }
    }

    /// Frees the entry of a zombie connection nothing points at any more.
    fn free_if_idle(&mut self, i: usize) {
        if matches!(self.conns.get(i), Some(Some(c)) if c.zombie && c.idle()) {
            self.conns[i] = None;
            self.free.push(i);
        }
    }

    /// Flushes every connection with something to send or decide. True if
    /// a send went into the ring.
    fn flush_all(&mut self) -> bool {
        let mut sent = false;
        for i in 0..self.conns.len() {
            if matches!(&self.conns[i], Some(c) if !c.zombie && (c.has_output() || c.q.wants_close() || c.read_paused()))
            {
                sent |= self.flush(i);
            }
        }
        sent
    }

    /// Sends pending responses (one send in flight per connection); closes
    /// a connection that asked to end once everything is out; resumes
    /// paused reading. True if a send went into the ring.
    fn flush(&mut self, i: usize) -> bool {
        let Some(Some(c)) = self.conns.get_mut(i) else {
            return false;
        };
        if c.zombie {
            return false;
        }
        if let Link::Rdma(l) = &mut c.link {
            let ok = l.post(&mut c.q, &mut c.tx);
            c.q.reclaim(&mut c.tx);
            // Responses are out once posted; a graceful close waits for the
            // slots whose data is still being written.
            let done = c.q.terminated() || (c.q.wants_close() && !c.q.busy());
            if !ok || done {
                self.close(i);
            }
            return false;
        }
        let Link::Tcp(t) = &mut c.link else {
            return false;
        };
        if t.sending {
            // Its completion comes first; the rest goes after it.
            return false;
        }
        if c.tx.backlog() > 0 {
            let n = c.tx.fill_iov(t.msg.iov());
            // SAFETY: the iovecs name bytes of the Tx (which never move) and
            // slot data held by put_slot's contract; `sending` keeps both,
            // and `msg`, untouched until the completion (on_send), and a
            // closing connection waits for it before letting them go.
            unsafe {
                self.ring
                    .push_send(t.sock.as_raw_fd(), &mut t.msg, n, own(Op::Send, i))
            };
            t.sending = true;
            c.ops += 1;
            return true;
        }
        if c.q.terminated() || (c.q.wants_close() && !c.q.busy()) {
            self.close(i);
            return false;
        }
        if t.read_paused && c.tx.backlog() <= limits::TX_HIGH_WATER_BYTES / 2 {
            t.read_paused = false;
            self.arm_recv(i);
        }
        false
    }

    fn close(&mut self, i: usize) {
        let Some(Some(c)) = self.conns.get_mut(i) else {
            return;
        };
        if c.zombie {
            return;
        }
        c.q.detach();
        let mut sending = false;
        match &mut c.link {
            Link::Tcp(t) => {
                let fd = t.sock.as_raw_fd();
                if !t.sending {
                    // Best effort: whatever responses are ready still go out.
                    let mut iov = [libc::iovec {
                        iov_base: std::ptr::null_mut(),
                        iov_len: 0,
                    }; crate::tx::IOV_MAX];
                    while c.tx.backlog() > 0 {
                        let n = c.tx.fill_iov(&mut iov);
                        match send_now(fd, &iov[..n]) {
                            Ok(k) if k > 0 => c.tx.advance(k),
                            _ => break,
                        }
                    }
                }
                // Ends the receive (0) and any send in flight (EPIPE); the
                // cancellations make sure. The socket itself closes when
                // the entry is freed, after their completions.
                let _ = t.sock.shutdown(std::net::Shutdown::Both);
                if t.recv_armed {
                    self.ring.push_cancel(own(Op::Recv, i), own(Op::Cancel, i));
                }
                if t.sending {
                    self.ring.push_cancel(own(Op::Send, i), own(Op::Cancel, i));
                    sending = true;
                }
            }
            Link::Rdma(l) => {
                if !l.failed {
                    let _ = l.post(&mut c.q, &mut c.tx);
                }
                for (armed, op) in c.polls.iter().zip([Op::RdmaComp, Op::RdmaCm]) {
                    if *armed {
                        self.ring.push_cancel(own(op, i), own(Op::Cancel, i));
                    }
                }
                l.disconnect();
                // Dropping the link destroys the queue pair: nothing more
                // is read from or written to the slots' buffers after this.
                c.link = Link::Gone;
                self.rdma_again.retain(|&x| x != i);
            }
            Link::Gone => {}
        }
        c.tx.rdma.clear();
        if !sending {
            // Else on_send lets the data go once the send is back.
            c.tx.abandon();
            c.q.reclaim(&mut c.tx);
        }
        c.q.close();
        c.q.take_returned(&mut self.bufs);
        c.zombie = true;
        self.live.fetch_sub(1, Ordering::AcqRel);
        tracing::debug!(peer = %c.q.peer, qid = ?c.q.qid(), "connection closed");
        if c.q.poisoned() {
            peer_error!(peer = %c.q.peer, qid = ?c.q.qid(), "a connection that broke a slot invariant is kept (never freed) until the reactor stops");
        }
        let conn = i as u32;
        self.bufs.forget(|ud| split_user_data(ud).0 == conn);
        self.free_if_idle(i);
    }
}

/// Runs the PDUs in `data`, bytes just received: first completes a PDU
/// staged in `rx` from earlier buffers, then parses in place, then stages
/// what is left of an incomplete PDU. One parser ([`run_pdus`]) for both.
fn feed(
    rx: &mut Rx,
    mut data: &[u8],
    q: &mut Queue,
    tx: &mut Tx,
    read_done: &mut bool,
    ex: &mut Exec<'_>,
) {
    const CH: usize = nvpool_wire::tcp::CH_LEN;
    if rx.len > 0 {
        // What the staged PDU still needs: its header, then its PLEN.
        loop {
            let need = if rx.len < CH {
                CH
            } else {
                match q.check_header(&rx.buf[..CH]) {
                    // PLEN >= HLEN >= the common header (the decoder checks).
                    Ok(p) => p,
                    Err(f) => {
                        q.fail(f, &rx.buf[..rx.len], tx);
                        *read_done = true;
                        return;
                    }
                }
            };
            if need > rx.buf.len() {
                // check_header bounds PLEN by RX_BUF_BYTES (limits.rs); a
                // bug otherwise, and this connection ends.
                peer_error!(peer = %q.peer, plen = need, "a PDU longer than the staging buffer passed the header check");
                *read_done = true;
                return;
            }
            if rx.len >= need {
                break;
            }
            let take = (need - rx.len).min(data.len());
            rx.buf[rx.len..rx.len + take].copy_from_slice(&data[..take]);
            rx.len += take;
            data = &data[take..];
            if rx.len < need {
                return;
            }
        }
        let staged = rx.len;
        rx.len = 0;
        match run_pdus(&rx.buf[..staged], q, tx, ex) {
            Some(n) if n == staged => {}
            // Exactly one whole PDU was staged: anything else ended the
            // connection.
            _ => {
                *read_done = true;
                return;
            }
        }
    }
    match run_pdus(data, q, tx, ex) {
        Some(n) => {
            let rest = &data[n..];
            if rest.len() > rx.buf.len() {
                // As above: a header check passed a PDU too long to stage.
                *read_done = true;
                return;
            }
            rx.buf[..rest.len()].copy_from_slice(rest);
            rx.len = rest.len();
        }
        None => *read_done = true,
    }
}

/// Runs every complete PDU at the start of `buf`. Returns the bytes they
/// took, or None when the connection must stop reading (a protocol
/// violation, answered, or the queue ended).
fn run_pdus(buf: &[u8], q: &mut Queue, tx: &mut Tx, ex: &mut Exec<'_>) -> Option<usize> {
    const CH: usize = nvpool_wire::tcp::CH_LEN;
    let mut off = 0;
    loop {
        let avail = buf.len() - off;
        if avail < CH {
            return Some(off);
        }
        let plen = match q.check_header(&buf[off..off + CH]) {
            Ok(p) => p,
            Err(f) => {
                q.fail(f, &buf[off..], tx);
                return None;
            }
        };
        if avail < plen {
            return Some(off);
        }
        // PLEN >= HLEN >= the common header (the decoder checks): progress.
        let end = off + plen;
        if q.on_pdu(&buf[off..end], tx, ex).is_err() || q.terminated() {
            return None;
        }
        off = end;
    }
}
