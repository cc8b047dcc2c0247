//! An async block device on one namespace: byte-addressed reads, writes,
//! flush, write-zeroes and discard, for the block-device front-ends.
//!
//! ```text
//!  async callers ──► bounded channel ──► worker thread 1 ── IoQueue 1 ── TCP
//!         ▲                          └─► worker thread N ── IoQueue N ── TCP
//!         └──────── completion cell (pooled) ◄── worker
//! ```
//!
//! Each worker thread owns one [`IoQueue`] and waits on its socket and an
//! eventfd together. Requests are split at the controller's maximum transfer
//! (Write Zeroes and Deallocate at 65536 blocks); unsplit reads and writes
//! travel in the caller's own buffer, which comes back with the result.
//! Completion cells are pooled and the number of requests in flight is
//! bounded (callers wait for a permit), so the steady state allocates
//! nothing per I/O.

use crate::admin::{Controller, NamespaceInfo};
use crate::error::{Error, IoError};
use crate::queue::{Completion, IoQueue, Op, Request};
use std::collections::VecDeque;
use std::future::Future;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::Duration;

/// Requests queued per worker beyond those in its I/O queue.
const JOBS_PER_WORKER: usize = 256;

#[derive(Debug, Default)]
struct CellState {
    result: Option<Result<(), IoError>>,
    buf: Option<Vec<u8>>,
    waker: Option<Waker>,
}

/// Where a worker leaves a result for the waiting future.
#[derive(Debug, Default)]
struct Cell(Mutex<CellState>);

impl Cell {
    fn lock(&self) -> std::sync::MutexGuard<'_, CellState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn complete(&self, r: Result<(), IoError>, buf: Vec<u8>) {
        let w = {
            let mut s = self.lock();
            s.result = Some(r);
            s.buf = Some(buf);
            s.waker.take()
        };
        if let Some(w) = w {
            w.wake();
        }
    }
}

#[derive(Debug)]
struct Job {
    nsid: u32,
    op: Op,
    lba: u64,
    blocks: u64,
    fua: bool,
    buf: Vec<u8>,
    cell: Arc<Cell>,
}

#[derive(Debug)]
struct Worker {
    tx: SyncSender<Job>,
    efd: Arc<OwnedFd>,
    /// The worker sleeps in poll(2); submitters then write the eventfd.
    sleeping: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Permits bound the requests in flight across the device.
#[derive(Debug)]
struct Permits {
    free: Mutex<(usize, VecDeque<Waker>)>,
}

impl Permits {
    fn try_take(&self, w: &Waker) -> bool {
        let mut g = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if g.0 > 0 {
            g.0 -= 1;
            true
        } else {
            if !g.1.iter().any(|x| x.will_wake(w)) {
                g.1.push_back(w.clone());
            }
            false
        }
    }

    fn give(&self) {
        let w = {
            let mut g = self.free.lock().unwrap_or_else(|p| p.into_inner());
            g.0 += 1;
            g.1.pop_front()
        };
        if let Some(w) = w {
            w.wake();
        }
    }
}

/// A namespace opened for I/O through several queues.
#[derive(Debug)]
pub struct Device {
    ctrl: Arc<Controller>,
    info: NamespaceInfo,
    workers: Vec<Worker>,
    next: AtomicUsize,
    cells: Mutex<Vec<Arc<Cell>>>,
    permits: Permits,
    stop: Arc<AtomicBool>,
}

impl Device {
    /// Opens namespace `nsid` with `queues` I/O queues (at most what the
    /// controller granted), each driven by its own thread.
    pub fn open(ctrl: Arc<Controller>, nsid: u32, queues: u16) -> Result<Device, Error> {
        let info = ctrl.namespace(nsid)?;
        let n = queues.clamp(1, ctrl.io_queue_count().max(1));
        let stop = Arc::new(AtomicBool::new(false));
        let mut workers = Vec::new();
        let mut depth_total = 0;
        for qid in 1..=n {
            let mut q = ctrl.io_queue(qid)?;
            q.set_block_size(info.block_size);
            depth_total += q.depth();
            let (tx, rx) = mpsc::sync_channel(JOBS_PER_WORKER);
            // SAFETY: eventfd takes no pointers; the fd is owned below.
            let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if fd < 0 {
                return Err(Error::Invalid(format!(
                    "eventfd: {}",
                    std::io::Error::last_os_error()
                )));
            }
            // SAFETY: a fresh descriptor nobody else owns.
            let efd = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
            let sleeping = Arc::new(AtomicBool::new(false));
            let (e2, s2, st2) = (efd.clone(), sleeping.clone(), stop.clone());
            let bs = info.block_size;
            let thread = std::thread::Builder::new()
                .name(format!("nvpool-io-{qid}"))
                .spawn(move || worker_loop(q, rx, e2, s2, st2, bs))
                .map_err(|e| Error::Invalid(format!("cannot start I/O thread: {e}")))?;
            workers.push(Worker {
                tx,
                efd,
                sleeping,
                thread: Some(thread),
            });
        }
        let permits = Permits {
            free: Mutex::new((
                depth_total + n as usize * JOBS_PER_WORKER / 2,
                VecDeque::new(),
            )),
        };
        Ok(Device {
            ctrl,
            info,
            workers,
            next: AtomicUsize::new(0),
            cells: Mutex::new(Vec::new()),
            permits,
            stop,
        })
    }

    pub fn info(&self) -> NamespaceInfo {
        self.info
    }

    pub fn size(&self) -> u64 {
        self.info.size_bytes()
    }

    pub fn block_size(&self) -> u32 {
        self.info.block_size
    }

    pub fn controller(&self) -> &Arc<Controller> {
        &self.ctrl
    }

    fn check(&self, offset: u64, len: u64) -> Result<(u64, u64), IoError> {
        let bs = self.info.block_size as u64;
        if !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) {
            return Err(IoError::Invalid(
                "offset and length must be multiples of the block size",
            ));
        }
        if offset.checked_add(len).is_none_or(|e| e > self.size()) {
            return Err(IoError::Invalid("range past the end of the device"));
        }
        Ok((offset / bs, len / bs))
    }

    /// Reads `buf.len()` bytes at `offset`; the buffer comes back filled.
    pub async fn read(&self, offset: u64, buf: Vec<u8>) -> (Result<(), IoError>, Vec<u8>) {
        match self.check(offset, buf.len() as u64) {
            Ok((lba, blocks)) => self.run(Op::Read, lba, blocks, false, buf).await,
            Err(e) => (Err(e), buf),
        }
    }

    /// Writes `buf` at `offset`; with `fua` it is durable on completion.
    pub async fn write(
        &self,
        offset: u64,
        buf: Vec<u8>,
        fua: bool,
    ) -> (Result<(), IoError>, Vec<u8>) {
        match self.check(offset, buf.len() as u64) {
            Ok((lba, blocks)) => self.run(Op::Write, lba, blocks, fua, buf).await,
            Err(e) => (Err(e), buf),
        }
    }

    /// Makes every completed write durable.
    pub async fn flush(&self) -> Result<(), IoError> {
        self.run(Op::Flush, 0, 0, false, Vec::new()).await.0
    }

    /// Zeroes a range (deallocating it when the device allows).
    pub async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        deallocate: bool,
    ) -> Result<(), IoError> {
        let (lba, blocks) = self.check(offset, len)?;
        self.run(
            Op::WriteZeroes { deallocate },
            lba,
            blocks,
            false,
            Vec::new(),
        )
        .await
        .0
    }

    /// Discards (deallocates) a range.
    pub async fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        let (lba, blocks) = self.check(offset, len)?;
        self.run(Op::Deallocate, lba, blocks, false, Vec::new())
            .await
            .0
    }

    async fn run(
        &self,
        op: Op,
        lba: u64,
        blocks: u64,
        fua: bool,
        buf: Vec<u8>,
    ) -> (Result<(), IoError>, Vec<u8>) {
        if blocks == 0 && op != Op::Flush {
            return (Ok(()), buf);
        }
        if op == Op::Flush {
            // A flush must follow every write completed before it, on every queue.
            let mut first = Ok(());
            for w in 0..self.workers.len() {
                let (r, _) = self.run_on(w, op, 0, 0, false, Vec::new()).await;
                if first.is_ok() {
                    first = r;
                }
            }
            return (first, buf);
        }
        let w = self.next.fetch_add(1, Ordering::Relaxed) % self.workers.len();
        self.run_on(w, op, lba, blocks, fua, buf).await
    }

    async fn run_on(
        &self,
        w: usize,
        op: Op,
        lba: u64,
        blocks: u64,
        fua: bool,
        buf: Vec<u8>,
    ) -> (Result<(), IoError>, Vec<u8>) {
        std::future::poll_fn(|cx| {
            if self.permits.try_take(cx.waker()) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        let cell = self
            .cells
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .unwrap_or_default();
        let job = Job {
            nsid: self.info.nsid,
            op,
            lba,
            blocks,
            fua,
            buf,
            cell: cell.clone(),
        };
        let worker = &self.workers[w];
        let mut job = Some(job);
        std::future::poll_fn(
            |cx| match worker.tx.try_send(job.take().expect("job present")) {
                Ok(()) => Poll::Ready(()),
                Err(TrySendError::Full(j)) => {
                    job = Some(j);
                    // The channel has room again within one queue completion.
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                Err(TrySendError::Disconnected(j)) => {
                    j.cell.complete(Err(IoError::ControllerLost), j.buf);
                    Poll::Ready(())
                }
            },
        )
        .await;
        std::sync::atomic::fence(Ordering::SeqCst);
        if worker.sleeping.load(Ordering::SeqCst) {
            let one = 1u64;
            // SAFETY: writes 8 bytes from a u64 to our own eventfd.
            unsafe { libc::write(worker.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
        let out = Wait { cell: &cell }.await;
        self.cells
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(cell);
        self.permits.give();
        out
    }

    /// Blocking helpers for threads that are not async (FUSE, ublk queues).
    pub fn block_on<F: Future>(f: F) -> F::Output {
        block_on(f)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for w in &self.workers {
            let one = 1u64;
            // SAFETY: writes 8 bytes from a u64 to our own eventfd.
            unsafe { libc::write(w.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
        for w in &mut self.workers {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

struct Wait<'a> {
    cell: &'a Cell,
}

impl Future for Wait<'_> {
    type Output = (Result<(), IoError>, Vec<u8>);
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut s = self.cell.lock();
        match s.result.take() {
            Some(r) => Poll::Ready((r, s.buf.take().unwrap_or_default())),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// A request being split into commands.
#[derive(Debug)]
struct Parent {
    job: Job,
    /// Commands not yet completed.
    left: u32,
    /// Next block to issue (relative to job.lba).
    next: u64,
    err: Option<IoError>,
}

fn worker_loop(
    mut q: IoQueue,
    rx: Receiver<Job>,
    efd: Arc<OwnedFd>,
    sleeping: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    bs: u32,
) {
    let max_blocks = match (q.max_transfer() / bs as usize) as u64 {
        0 => 1,
        n => n,
    };
    let mut parents: Vec<Option<Parent>> = Vec::new();
    let mut free_parents: Vec<usize> = Vec::new();
    let mut open: VecDeque<usize> = VecDeque::new();
    let mut scratch: Vec<Vec<u8>> = Vec::new();
    let mut comps: Vec<Completion> = Vec::with_capacity(q.depth());
    let mut lost = false;
    let mut stash: Option<Job> = None;
    loop {
        // Take new jobs while the queue has room.
        while open.is_empty() || q.outstanding() < q.depth() {
            match stash.take().map_or_else(|| rx.try_recv(), Ok) {
                Ok(job) => {
                    let id = free_parents.pop().unwrap_or_else(|| {
                        parents.push(None);
                        parents.len() - 1
                    });
                    parents[id] = Some(Parent {
                        job,
                        left: 0,
                        next: 0,
                        err: None,
                    });
                    open.push_back(id);
                }
                Err(_) => break,
            }
        }
        // Issue commands for open jobs.
        while let Some(&id) = open.front() {
            if q.outstanding() >= q.depth() {
                break;
            }
            let p = parents[id].as_mut().expect("open parent exists");
            if lost {
                p.err = Some(IoError::ControllerLost);
                p.next = p.job.blocks.max(1);
            }
            let total = p.job.blocks;
            if p.next >= total.max(1) {
                open.pop_front();
                if p.left == 0 {
                    finish(&mut parents, &mut free_parents, id);
                }
                continue;
            }
            let op = p.job.op;
            let per = match op {
                Op::Read | Op::Write => max_blocks,
                Op::Flush => 1,
                Op::WriteZeroes { .. } | Op::Deallocate => 65536,
            };
            let n = (total - p.next).min(per);
            let whole = p.next == 0 && n == total;
            let buf = match op {
                Op::Read | Op::Write if whole => std::mem::take(&mut p.job.buf),
                Op::Read | Op::Write => {
                    let len = (n * bs as u64) as usize;
                    let mut b = scratch.pop().unwrap_or_default();
                    b.resize(len, 0);
                    if op == Op::Write {
                        let off = (p.next * bs as u64) as usize;
                        b.copy_from_slice(&p.job.buf[off..off + len]);
                    }
                    b
                }
                _ => Vec::new(),
            };
            let req = Request {
                op,
                nsid: p.job.nsid,
                lba: p.job.lba + p.next,
                blocks: n as u32,
                fua: p.job.fua,
                buf,
                token: (id as u64) << 32 | p.next,
            };
            p.next += n.max(1);
            p.left += 1;
            if let Err((req, e)) = q.submit(req) {
                tracing::warn!(error = %e, "submit failed");
                p.left -= 1;
                p.err.get_or_insert(IoError::ControllerLost);
                if whole {
                    p.job.buf = req.buf;
                }
            }
        }
        if stop.load(Ordering::Acquire) && q.outstanding() == 0 {
            return;
        }
        // Handle the socket, then sleep until it or a submitter wakes us.
        let mut got = 0;
        if q.outstanding() > 0 {
            comps.clear();
            if let Err(e) = q.poll(&mut comps, Duration::ZERO) {
                tracing::error!(error = %e, "I/O queue failed");
                lost = true;
            }
            got = comps.len();
            for c in comps.drain(..) {
                on_completion(c, &mut parents, &mut free_parents, &mut scratch, bs);
            }
        }
        let can_issue = !open.is_empty() && q.outstanding() < q.depth();
        if can_issue || got > 0 {
            continue;
        }
        sleeping.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        match rx.try_recv() {
            Ok(j) => stash = Some(j),
            Err(_) => {
                let mut fds = [
                    libc::pollfd {
                        fd: efd.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    },
                    libc::pollfd {
                        fd: q.fd(),
                        events: libc::POLLIN | if q.wants_write() { libc::POLLOUT } else { 0 },
                        revents: 0,
                    },
                ];
                let n = if q.outstanding() > 0 { 2 } else { 1 };
                // SAFETY: fds holds n valid pollfds for the call's duration.
                unsafe { libc::poll(fds.as_mut_ptr(), n, 1000) };
                if fds[0].revents & libc::POLLIN != 0 {
                    let mut v = 0u64;
                    // SAFETY: reads 8 bytes into a u64 from our own eventfd.
                    unsafe { libc::read(efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
                }
            }
        }
        sleeping.store(false, Ordering::SeqCst);
    }
}

fn on_completion(
    c: Completion,
    parents: &mut [Option<Parent>],
    free: &mut Vec<usize>,
    scratch: &mut Vec<Vec<u8>>,
    bs: u32,
) {
    let id = (c.token >> 32) as usize;
    let at = c.token & 0xFFFF_FFFF;
    let p = parents[id].as_mut().expect("completion for a live request");
    p.left -= 1;
    if let Err(e) = c.result {
        p.err.get_or_insert(e);
    }
    match p.job.op {
        Op::Read | Op::Write
            if p.job.buf.is_empty()
                && at == 0
                && c.buf.len() as u64 == p.job.blocks * bs as u64 =>
        {
            p.job.buf = c.buf
        }
        Op::Read => {
            let off = (at * bs as u64) as usize;
            p.job.buf[off..off + c.buf.len()].copy_from_slice(&c.buf);
            scratch.push(c.buf);
        }
        Op::Write => scratch.push(c.buf),
        _ => {}
    }
    if p.left == 0 && p.next >= p.job.blocks.max(1) {
        finish(parents, free, id);
    }
}

fn finish(parents: &mut [Option<Parent>], free: &mut Vec<usize>, id: usize) {
    let p = parents[id].take().expect("finishing a live request");
    free.push(id);
    let r = match p.err {
        Some(e) => Err(e),
        None => Ok(()),
    };
    p.job.cell.complete(r, p.job.buf);
}

/// Runs a future to completion on this thread.
pub fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}
