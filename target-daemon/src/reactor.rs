//! Reactor threads: each owns a set of connections, an epoll instance (via
//! mio) for their sockets, and an io_uring for their backend I/O.
//!
//! A connection is a TCP socket or an RDMA queue pair (rdma.rs); both feed
//! the same [`Queue`]. An RDMA connection puts two descriptors in the epoll
//! set: its completion channel (a CQ with new completions) and its CM event
//! channel (DISCONNECTED). Its completions are polled with a bounded budget
//! and then the CQ is armed again, so an idle connection costs nothing; a
//! connection that used its whole budget is polled again next iteration
//! without waiting.
//!
//! One loop iteration: wait for socket readiness or ring completions (at most
//! one tick), read every readable socket until it would block and run every
//! complete PDU, reap completions, submit new ring work once, then write each
//! connection's accumulated responses with one send. Nothing on this path
//! takes a lock or allocates once the connection's slots have their buffers.
//!
//! Host writes parked behind a copy job's claim (queue.rs) are retried every
//! iteration while any are parked, and the loop then waits at most
//! `PARKED_RETRY_MS` so a released claim is noticed quickly.
//!
//! Backends that complete I/O on threads of their own (volume namespaces)
//! complete into the reactor's [`CompletionSink`], which wakes the loop
//! through the same waker the acceptor uses; each iteration takes every
//! waiting completion and runs it like a ring completion. A connection
//! closed with such operations in flight stays a zombie until they are back.
//!
//! The reactor owns a pool of large data buffers under a byte budget
//! (bufpool.rs). Each iteration takes back the buffers freed slots left in
//! their queues and hands them to the commands waiting for one, oldest
//! first; while one is free and a command waits, the loop does not sleep.
//!
//! A queue that finds one of its slot-state invariants broken (queue.rs)
//! ends its connection and is never freed: the reactor keeps it, and every
//! buffer it holds, for as long as it runs, rather than let the ring or the
//! socket touch freed memory.

use crate::backend::{AsyncCompletion, CompletionSink};
use crate::bufpool::BufPool;
use crate::limits;
use crate::peerlog::{peer_error, peer_warn};
use crate::queue::{split_user_data, user_data_tag, Exec, Queue, Tx};
use crate::rdma::{RdmaIncoming, RdmaLink};
use crate::ring::Ring;
use crate::target::Target;
use mio::net::TcpStream;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

const WAKER: Token = Token(0);
const RING: Token = Token(1);
const FIRST_CONN: usize = 2;

/// New connections waiting for a reactor to adopt them.
const HANDOFF_QUEUE_LEN: usize = 256;

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
    waker: Arc<Waker>,
}

impl ReactorHandle {
    /// Hands a connection over. Err(stream) when the reactor is saturated.
    pub fn adopt(&self, s: std::net::TcpStream) -> Result<(), std::net::TcpStream> {
        match self.tx.try_send(Incoming::Tcp(s)) {
            Ok(()) => {
                let _ = self.waker.wake();
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
                let _ = self.waker.wake();
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
        let _ = self.waker.wake();
    }
}

struct Rx {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Rx {
    fn compact(&mut self) {
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }
}

struct TcpLink {
    sock: TcpStream,
    rx: Rx,
    /// Reading paused until the transmit backlog drains.
    read_paused: bool,
    want_write: bool,
}

enum Link {
    Tcp(TcpLink),
    Rdma(Box<RdmaLink>),
    /// Closed: the socket or queue pair is gone.
    Gone,
}

struct Conn {
    link: Link,
    tx: Tx,
    q: Queue,
    /// No more reading: the queue ended or the peer closed.
    read_done: bool,
    /// Socket closed; the entry lives on until in-flight backend work
    /// (ring or asynchronous) completes.
    zombie: bool,
}

impl Conn {
    fn read_paused(&self) -> bool {
        matches!(&self.link, Link::Tcp(t) if t.read_paused)
    }

    /// Something for flush() to do.
    fn has_output(&self) -> bool {
        self.tx.backlog() > 0 || !self.tx.rdma.is_empty()
    }
}

/// Tokens: two per connection, its socket or completion channel first,
/// then (RDMA) its CM event channel.
fn conn_token(i: usize, cm: bool) -> Token {
    Token(FIRST_CONN + 2 * i + cm as usize)
}

pub struct Reactor {
    id: usize,
    target: Arc<Target>,
    poll: Poll,
    incoming: Receiver<Incoming>,
    ring: Option<Ring>,
    ring_efd: Option<OwnedFd>,
    conns: Vec<Option<Conn>>,
    /// After `conns`: dropped after every connection (an RDMA link holds
    /// registrations of pool buffers).
    bufs: BufPool,
    free: Vec<usize>,
    live: Arc<AtomicUsize>,
    completions: Vec<(u64, i32)>,
    /// Where asynchronous backends complete this reactor's operations.
    sink: Arc<CompletionSink>,
    async_completions: Vec<AsyncCompletion>,
    /// Connections that may have parked commands.
    parked: Vec<usize>,
    /// RDMA connections that used their poll budget: polled again at once.
    rdma_again: Vec<usize>,
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
    /// Creates a reactor. `use_uring` false (or a kernel without io_uring)
    /// runs backends synchronously on the reactor thread.
    pub fn new(
        id: usize,
        target: Arc<Target>,
        live: Arc<AtomicUsize>,
        use_uring: bool,
    ) -> io::Result<(Reactor, ReactorHandle)> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let (tx, incoming) = mpsc::sync_channel(HANDOFF_QUEUE_LEN);
        let (ring, ring_efd) = if use_uring {
            let ring = Ring::new(limits::RING_ENTRIES)?;
            // SAFETY: eventfd takes no pointers; we own the returned fd.
            let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: fd is a fresh descriptor nobody else owns.
            let efd = unsafe { OwnedFd::from_raw_fd(fd) };
            ring.register_eventfd(efd.as_raw_fd())?;
            poll.registry()
                .register(&mut SourceFd(&efd.as_raw_fd()), RING, Interest::READABLE)?;
            (Some(ring), Some(efd))
        } else {
            (None, None)
        };
        let sink_waker = waker.clone();
        let sink = CompletionSink::new(move || {
            let _ = sink_waker.wake();
        });
        let bufs = BufPool::new(id, target.reactor_buffer_budget())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        target.register_buffers(bufs.stats());
        let r = Reactor {
            id,
            target,
            poll,
            incoming,
            ring,
            ring_efd,
            conns: Vec::new(),
            bufs,
            free: Vec::new(),
            live,
            completions: Vec::with_capacity(256),
            sink,
            async_completions: Vec::with_capacity(256),
            parked: Vec::new(),
            rdma_again: Vec::new(),
        };
        Ok((r, ReactorHandle { tx, waker }))
    }

    /// Runs until shutdown has drained every connection.
    pub fn run(mut self) {
        let mut events = Events::with_capacity(1024);
        let mut next_tick = 0;
        let mut drain_deadline: Option<u64> = None;
        loop {
            let timeout = if !self.rdma_again.is_empty() || self.bufs.can_grant() {
                0
            } else if !self.parked.is_empty() {
                limits::PARKED_RETRY_MS
            } else if self.ring.as_ref().is_some_and(|r| r.busy()) {
                limits::TICK_MS.min(10)
            } else {
                limits::TICK_MS
            };
            if let Err(e) = self
                .poll
                .poll(&mut events, Some(Duration::from_millis(timeout)))
            {
                if e.kind() != io::ErrorKind::Interrupted {
                    tracing::error!(reactor = self.id, error = %e, "poll failed");
                }
                continue;
            }
            for ev in events.iter() {
                match ev.token() {
                    WAKER => self.adopt_new(),
                    RING => self.clear_eventfd(),
                    Token(t) => {
                        let (i, cm) = ((t - FIRST_CONN) / 2, (t - FIRST_CONN) % 2 == 1);
                        if cm {
                            self.rdma_cm(i);
                            continue;
                        }
                        if ev.is_writable() {
                            self.flush(i);
                        }
                        if ev.is_readable() || ev.is_read_closed() || ev.is_error() {
                            self.read(i);
                        }
                    }
                }
            }
            for i in std::mem::take(&mut self.rdma_again) {
                self.read(i);
            }
            self.reap();
            self.reap_async();
            self.retry_parked();
            let now = self.target.now_ms();
            if now >= next_tick {
                next_tick = now + limits::TICK_MS;
                self.tick(now);
            }
            self.grant_buffers();
            if let Some(r) = self.ring.as_mut() {
                if let Err(e) = r.submit() {
                    tracing::error!(reactor = self.id, error = %e, "io_uring submit failed");
                }
            }
            self.flush_all();
            // Slots freed by the sends just made: their buffers are taken
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
                let ring_busy = self.ring.as_ref().is_some_and(|r| r.busy());
                // Zombies wait for asynchronous completions (not in the ring).
                let backend_busy =
                    ring_busy || self.conns.iter().flatten().any(|c| c.q.inflight > 0);
                if !open && (!backend_busy || now >= deadline + 1000) {
                    return;
                }
            }
        }
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
        let reg = self.poll.registry();
        let comp = link.comp_fd();
        let r = reg
            .register(
                &mut SourceFd(&comp),
                conn_token(i, false),
                Interest::READABLE,
            )
            .and_then(|()| match link.cm_fd() {
                Some(fd) => {
                    reg.register(&mut SourceFd(&fd), conn_token(i, true), Interest::READABLE)
                }
                None => Ok(()),
            });
        if let Err(e) = r {
            let _ = reg.deregister(&mut SourceFd(&comp));
            self.free.push(i);
            link.disconnect();
            return Err(e);
        }
        tracing::debug!(reactor = self.id, peer = %link.peer, cm_qid = link.cm_qid, "RDMA connection adopted");
        let q = Queue::new_rdma(
            self.target.clone(),
            link.local,
            link.peer,
            self.target.now_ms(),
            link.cm_qid,
        );
        self.conns[i] = Some(Conn {
            link: Link::Rdma(link),
            tx: Tx::default(),
            q,
            read_done: false,
            zombie: false,
        });
        // Capsules may have arrived before the reactor got the connection.
        self.read(i);
        Ok(())
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
        s.set_nonblocking(true)?;
        s.set_nodelay(true)?;
        let local = s.local_addr()?;
        let peer = s.peer_addr()?;
        let mut sock = TcpStream::from_std(s);
        let i = self.slot();
        if let Err(e) =
            self.poll
                .registry()
                .register(&mut sock, conn_token(i, false), Interest::READABLE)
        {
            self.free.push(i);
            return Err(e);
        }
        tracing::debug!(reactor = self.id, %peer, "connection adopted");
        let q = Queue::new(self.target.clone(), local, peer, self.target.now_ms());
        self.conns[i] = Some(Conn {
            link: Link::Tcp(TcpLink {
                sock,
                rx: Rx {
                    buf: vec![0u8; limits::RX_BUF_BYTES].into_boxed_slice(),
                    start: 0,
                    end: 0,
                },
                read_paused: false,
                want_write: false,
            }),
            tx: Tx::default(),
            q,
            read_done: false,
            zombie: false,
        });
        // Data may already be waiting (edge-triggered readiness).
        self.read(i);
        Ok(())
    }

    fn clear_eventfd(&mut self) {
        if let Some(fd) = &self.ring_efd {
            let mut v = 0u64;
            // SAFETY: reads 8 bytes into a u64 from our own eventfd.
            unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        }
    }

    /// Reads what the socket has and runs every complete PDU.
    fn read(&mut self, i: usize) {
        let now = self.target.now_ms();
        let ring = self.ring.as_mut();
        let Some(Some(c)) = self.conns.get_mut(i) else {
            return;
        };
        if c.zombie || c.read_done {
            return;
        }
        let mut ex = Exec {
            ring,
            sink: &self.sink,
            bufs: &mut self.bufs,
            conn: i as u32,
            now_ms: now,
        };
        let mut peer_closed = false;
        match &mut c.link {
            Link::Tcp(t) => loop {
                if c.tx.backlog() > limits::TX_HIGH_WATER_BYTES {
                    t.read_paused = true;
                    break;
                }
                if t.rx.end == t.rx.buf.len() {
                    t.rx.compact();
                }
                match t.sock.read(&mut t.rx.buf[t.rx.end..]) {
                    Ok(0) => {
                        peer_closed = true;
                        break;
                    }
                    Ok(n) => {
                        t.rx.end += n;
                        if !run_pdus(t, &mut c.q, &mut c.tx, &mut c.read_done, &mut ex) {
                            break;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        tracing::debug!(peer = %c.q.peer, error = %e, "socket read failed");
                        peer_closed = true;
                        break;
                    }
                }
            },
            Link::Rdma(l) => {
                if l.poll(&mut c.q, &mut c.tx, &mut ex) && !self.rdma_again.contains(&i) {
                    self.rdma_again.push(i);
                }
                c.q.reclaim(&mut c.tx);
                if c.q.terminated() {
                    c.read_done = true;
                }
                peer_closed = l.failed;
            }
            Link::Gone => {}
        }
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
            let ring = self.ring.as_mut();
            let still = match self.conns.get_mut(i) {
                // A closed connection released its parked slots; an index
                // reused by a new connection is retried harmlessly.
                Some(Some(c)) if !c.zombie => {
                    let mut ex = Exec {
                        ring,
                        sink: &self.sink,
                        bufs: &mut self.bufs,
                        conn: i as u32,
                        now_ms: now,
                    };
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

    fn reap(&mut self) {
        let Some(ring) = self.ring.as_mut() else {
            return;
        };
        let mut done = std::mem::take(&mut self.completions);
        done.clear();
        ring.reap(&mut done);
        let now = self.target.now_ms();
        for &(ud, res) in &done {
            let tag = user_data_tag(ud);
            self.complete(ud, now, |q, slot, tx, ex| {
                q.on_completion(slot, tag, res, tx, ex)
            });
        }
        self.completions = done;
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
        let ring = self.ring.as_mut();
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
        let mut ex = Exec {
            ring,
            sink: &self.sink,
            bufs: &mut self.bufs,
            conn: ci as u32,
            now_ms,
        };
        f(&mut c.q, slot, &mut c.tx, &mut ex);
        c.q.take_returned(&mut self.bufs);
        if c.zombie && c.q.inflight == 0 && !c.q.poisoned() {
            self.conns[ci] = None;
            self.free.push(ci);
        }
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
            let ring = self.ring.as_mut();
            let back = match self.conns.get_mut(ci) {
                Some(Some(c)) if !c.zombie => {
                    let mut ex = Exec {
                        ring,
                        sink: &self.sink,
                        bufs: &mut self.bufs,
                        conn: ci as u32,
                        now_ms: now,
                    };
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
    fn reap_async(&mut self) {
        let mut done = std::mem::take(&mut self.async_completions);
        self.sink.take(&mut done);
        if done.is_empty() {
            self.async_completions = done;
            return;
        }
        let now = self.target.now_ms();
        for c in done.drain(..) {
            let result = c.result;
            self.complete(c.user_data, now, |q, slot, tx, ex| {
                q.on_async_completion(slot, result, tx, ex)
            });
        }
        self.async_completions = done;
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

    fn flush_all(&mut self) {
        for i in 0..self.conns.len() {
            if matches!(&self.conns[i], Some(c) if !c.zombie && (c.has_output() || c.q.wants_close() || c.read_paused()))
            {
                self.flush(i);
            }
        }
    }

    /// Writes pending responses; closes a connection that asked to end once
    /// everything is out; resumes paused reading.
    fn flush(&mut self, i: usize) {
        let Some(Some(c)) = self.conns.get_mut(i) else {
            return;
        };
        if c.zombie {
            return;
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
            return;
        }
        let Link::Tcp(t) = &mut c.link else {
            return;
        };
        let mut failed = false;
        while c.tx.backlog() > 0 {
            match c.tx.write_to(&mut t.sock) {
                Ok(0) => {
                    failed = true;
                    break;
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    failed = true;
                    break;
                }
            }
        }
        c.q.reclaim(&mut c.tx);
        let want_write = c.tx.backlog() > 0;
        if want_write != t.want_write {
            let interest = if want_write {
                Interest::READABLE | Interest::WRITABLE
            } else {
                Interest::READABLE
            };
            let _ = self
                .poll
                .registry()
                .reregister(&mut t.sock, conn_token(i, false), interest);
            t.want_write = want_write;
        }
        let done = c.tx.backlog() == 0 && (c.q.terminated() || (c.q.wants_close() && !c.q.busy()));
        if failed || done {
            self.close(i);
            return;
        }
        if t.read_paused && c.tx.backlog() <= limits::TX_HIGH_WATER_BYTES / 2 {
            t.read_paused = false;
            self.read(i);
        }
    }

    fn close(&mut self, i: usize) {
        let Some(Some(c)) = self.conns.get_mut(i) else {
            return;
        };
        if c.zombie {
            return;
        }
        c.q.detach();
        match std::mem::replace(&mut c.link, Link::Gone) {
            Link::Tcp(mut t) => {
                // Best effort: whatever responses are ready still go out.
                while c.tx.backlog() > 0 {
                    match c.tx.write_to(&mut t.sock) {
                        Ok(n) if n > 0 => {}
                        _ => break,
                    }
                }
                let _ = self.poll.registry().deregister(&mut t.sock);
                let _ = t.sock.shutdown(std::net::Shutdown::Both);
            }
            Link::Rdma(mut l) => {
                if !l.failed {
                    let _ = l.post(&mut c.q, &mut c.tx);
                }
                let reg = self.poll.registry();
                let _ = reg.deregister(&mut SourceFd(&l.comp_fd()));
                if let Some(fd) = l.cm_fd() {
                    let _ = reg.deregister(&mut SourceFd(&fd));
                }
                l.disconnect();
                // Dropping the link destroys the queue pair: nothing more
                // is read from or written to the slots' buffers after this.
                drop(l);
                self.rdma_again.retain(|&x| x != i);
            }
            Link::Gone => {}
        }
        c.tx.rdma.clear();
        c.tx.abandon();
        c.q.reclaim(&mut c.tx);
        c.q.close();
        c.q.take_returned(&mut self.bufs);
        c.zombie = true;
        self.live.fetch_sub(1, Ordering::AcqRel);
        tracing::debug!(peer = %c.q.peer, qid = ?c.q.qid(), "connection closed");
        if c.q.poisoned() {
            peer_error!(peer = %c.q.peer, qid = ?c.q.qid(), "a connection that broke a slot invariant is kept (never freed) until the reactor stops");
        }
        let free = c.q.inflight == 0 && !c.q.poisoned();
        let conn = i as u32;
        self.bufs.forget(|ud| split_user_data(ud).0 == conn);
        if free {
            self.conns[i] = None;
            self.free.push(i);
        }
    }
}

/// Runs every complete PDU in the receive buffer. False: stop reading.
fn run_pdus(
    t: &mut TcpLink,
    q: &mut Queue,
    tx: &mut Tx,
    read_done: &mut bool,
    ex: &mut Exec<'_>,
) -> bool {
    let rx = &mut t.rx;
    loop {
        let avail = rx.end - rx.start;
        if avail < nvpool_wire::tcp::CH_LEN {
            break;
        }
        let hdr = &rx.buf[rx.start..rx.start + nvpool_wire::tcp::CH_LEN];
        let plen = match q.check_header(hdr) {
            Ok(p) => p,
            Err(f) => {
                let hdr = rx.buf[rx.start..rx.end].to_vec();
                q.fail(f, &hdr, tx);
                *read_done = true;
                return false;
            }
        };
        if avail < plen {
            if rx.start + plen > rx.buf.len() {
                rx.compact();
            }
            break;
        }
        let (s, e) = (rx.start, rx.start + plen);
        rx.start = e;
        if q.on_pdu(&rx.buf[s..e], tx, ex).is_err() || q.terminated() {
            *read_done = true;
            return false;
        }
    }
    if rx.start == rx.end {
        rx.start = 0;
        rx.end = 0;
    }
    true
}
