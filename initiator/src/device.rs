//! Async I/O on namespaces: one pool of I/O queues per controller
//! ([`ControllerIo`]) serving any number of namespace handles ([`Device`]),
//! with byte-addressed reads, writes, flush, write-zeroes and discard for
//! the block-device front-ends and the volume engine.
//!
//! ```text
//!  caller's thread ── try_lock(queue k) ── submit + send ──────────► TCP
//!        │ every queue held                                          │
//!        └─► bounded channel ─► queue k's thread ◄── poll(socket, eventfd)
//!                                     │ reads completions, reconnects
//!  Device (nsid …) ── future ◄── completion cell (pooled) ◄──┘
//! ```
//!
//! Each I/O queue ([`IoQueue`], one connection) sits behind a lock, with
//! a thread of its own. A caller issues its request on the calling thread
//! when it finds a queue nobody holds: the command goes to the socket from
//! there, with no hand-off and no wake-up of another thread. The queue's
//! thread sleeps in poll(2) on the socket (even with nothing outstanding,
//! so a caller's command needs no wake-up) and an eventfd; it reads the
//! completions, wakes the callers after letting go of the lock (a woken
//! task may submit again at once), reconnects a broken connection (a
//! caller never blocks on that: it leaves the failure for this thread),
//! and takes the requests callers hand over the channel when every queue
//! was held. A request carries its NSID, so the queues of one
//! controller serve every namespace the host reaches through it: the
//! connections to a target grow with the controllers, not with the
//! namespaces (a pooled volume has one namespace per extent). The queues
//! count blocks in one size, so the namespaces sharing a pool share a block
//! size.
//!
//! Requests are split at the controller's maximum transfer (Write Zeroes and
//! Deallocate at 65536 blocks); unsplit reads and writes travel in the
//! caller's own buffer, which comes back with the result; a write may also
//! send a buffer it shares with other writes (the copies of a mirrored
//! write, [`Device::write_shared`]). Completion cells
//! are pooled and the number of requests in flight is bounded (callers wait
//! for a permit), so the steady state allocates nothing per I/O.
//!
//! When the controller is lost (no reconnect within its controller-loss
//! timeout) every outstanding and later request fails with
//! [`IoError::ControllerLost`]. A queue whose commands see no traffic for a
//! second also asks the controller whether it was declared lost (its
//! keep-alive notices a silent target even when the I/O sockets do not) and
//! then fails its commands too, so a dead target never holds I/O forever.

use crate::admin::{Controller, NamespaceInfo};
use crate::error::{Error, IoError};
pub use crate::exec::block_on;
use crate::limits::{JOBS_PER_WORKER_MAX, WORKER_IDLE_WAKE};
use crate::queue::{Completion, IoQueue, Op, Request};
use nvpool_rt::{lock, wake, Wakeup};
use std::collections::VecDeque;
use std::future::Future;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::Duration;

/// Blocks per Write Zeroes or Deallocate command (NLB is 16 bits).
const ZEROES_BLOCKS_MAX: u64 = 65536;

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
    /// A write's data shared with other jobs (see [`Device::write_shared`]).
    shared: Option<Arc<Vec<u8>>>,
    /// CDW2 of each of its commands (see [`Device::tagged`]).
    write_epoch: u32,
    cell: Arc<Cell>,
}

impl Job {
    /// The bytes a write sends.
    fn out(&self) -> &[u8] {
        self.shared.as_deref().unwrap_or(&self.buf)
    }
}

/// Bits of [`QueueShared::asleep`]: the queue's thread sleeps, and what
/// on the socket it waits for besides its eventfd.
const ASLEEP: u8 = 1;
const ASLEEP_IN: u8 = 2;
const ASLEEP_OUT: u8 = 4;
/// Never part of a sleeping mask: the thread must run (a broken connection
/// to repair).
const NEEDS_RUN: u8 = 8;

/// One I/O queue: its state, taken by whichever thread holds the lock (a
/// submitter issuing its own request, or the queue's thread), and the
/// queue's thread's wake-up.
#[derive(Debug)]
struct QueueShared {
    state: Mutex<QueueState>,
    efd: Wakeup,
    /// `ASLEEP` and what it waits for while the queue's thread sleeps in
    /// poll(2); 0 while it runs. Set under the state lock.
    asleep: AtomicU8,
}

impl QueueShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        lock(&self.state)
    }

    fn wake(&self) {
        self.efd.wake();
    }

    /// Issues `job` on the calling thread when nobody holds the queue: no
    /// hand-off to the queue's thread, and no wake-up of it unless it
    /// sleeps without watching what the command needs (the socket's
    /// writability when the command did not fit, or a broken connection).
    /// Hands the job back when the queue is held.
    fn try_submit(&self, job: Job) -> Result<(), Job> {
        let mut s = match self.state.try_lock() {
            Ok(s) => s,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Err(job),
        };
        s.accept(job);
        s.issue();
        // Read under the lock, which the queue's thread holds when it
        // decides to sleep: awake, it sends what is queued on its next
        // turn, together with whatever else came meanwhile (one send for
        // many commands under load); asleep, the command goes now.
        let a = self.asleep.load(Ordering::SeqCst);
        if a & ASLEEP != 0 {
            if let Some(q) = s.q.as_mut() {
                q.send_nowait();
            }
        }
        let needs = s.needs();
        let done = take_done(&mut s);
        drop(s);
        complete_all(done);
        if a & ASLEEP != 0 && needs & !a != 0 {
            self.wake();
        }
        Ok(())
    }
}

/// What the queue's thread finished, completed once the lock is let go
/// (a completion may poll a task that submits again on this queue).
type Done = (Arc<Cell>, Result<(), IoError>, Vec<u8>);

thread_local! {
    /// The finished-list a thread hands back and forth with the queues, so
    /// finishing requests allocates nothing.
    static SPARE_DONE: std::cell::RefCell<Vec<Done>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn take_done(s: &mut QueueState) -> Vec<Done> {
    if s.done.is_empty() {
        return Vec::new();
    }
    let spare = SPARE_DONE.with_borrow_mut(std::mem::take);
    std::mem::replace(&mut s.done, spare)
}

fn complete_all(mut done: Vec<Done>) {
    if done.capacity() == 0 {
        return;
    }
    for (cell, r, buf) in done.drain(..) {
        cell.complete(r, buf);
    }
    SPARE_DONE.with_borrow_mut(|spare| {
        if spare.capacity() < done.capacity() {
            *spare = done;
        }
    });
}

#[derive(Debug)]
struct Worker {
    tx: SyncSender<Job>,
    shared: Arc<QueueShared>,
    thread: Option<JoinHandle<()>>,
}

/// Permits bound the requests in flight across the controller's queues.
#[derive(Debug)]
struct Permits {
    free: Mutex<(usize, VecDeque<Waker>)>,
}

impl Permits {
    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, VecDeque<Waker>)> {
        lock(&self.free)
    }

    fn try_take(&self, w: &Waker) -> bool {
        let mut g = self.lock();
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
            let mut g = self.lock();
            g.0 += 1;
            g.1.pop_front()
        };
        if let Some(w) = w {
            w.wake();
        }
    }
}

/// The I/O queues of one controller, each driven by its own thread, shared
/// by every namespace handle ([`Device`]) opened on it. Dropping the last
/// handle stops the threads and closes the queues.
#[derive(Debug)]
pub struct ControllerIo {
    ctrl: Arc<Controller>,
    block_size: u32,
    workers: Vec<Worker>,
    next: AtomicUsize,
    cells: Mutex<Vec<Arc<Cell>>>,
    permits: Permits,
    stop: Arc<AtomicBool>,
    /// Requests submitted and not yet completed (load balancing).
    in_flight: AtomicUsize,
    /// Set by a worker that gave up its queue (controller lost): every
    /// request it gets fails from then on, so the pool is dead for good.
    lost: Arc<AtomicBool>,
}

impl ControllerIo {
    /// Opens `queues` I/O queues on `ctrl` (at most what the controller
    /// granted), each driven by its own thread, for namespaces whose
    /// logical blocks are `block_size` bytes.
    pub fn start(
        ctrl: Arc<Controller>,
        queues: u16,
        block_size: u32,
    ) -> Result<Arc<ControllerIo>, Error> {
        let n = queues.clamp(1, ctrl.io_queue_count().max(1));
        // Built up in place: on an error, dropping it stops the workers
        // started so far.
        let mut io = ControllerIo {
            ctrl,
            block_size,
            workers: Vec::with_capacity(n as usize),
            next: AtomicUsize::new(0),
            cells: Mutex::new(Vec::new()),
            permits: Permits {
                free: Mutex::new((0, VecDeque::new())),
            },
            stop: Arc::new(AtomicBool::new(false)),
            in_flight: AtomicUsize::new(0),
            lost: Arc::new(AtomicBool::new(false)),
        };
        let mut depth_total = 0;
        for qid in 1..=n {
            let mut q = io.ctrl.io_queue(qid)?;
            q.set_block_size(block_size);
            depth_total += q.depth();
            let (tx, rx) = mpsc::sync_channel(JOBS_PER_WORKER_MAX);
            let efd = Wakeup::nonblocking().map_err(|e| Error::Invalid(format!("eventfd: {e}")))?;
            let shared = Arc::new(QueueShared {
                state: Mutex::new(QueueState::new(
                    q,
                    block_size,
                    rx,
                    io.stop.clone(),
                    io.lost.clone(),
                )),
                efd,
                asleep: AtomicU8::new(0),
            });
            let run = shared.clone();
            let thread = std::thread::Builder::new()
                .name(format!("nvpool-io-{qid}"))
                .spawn(move || run_queue(&run))
                .map_err(|e| Error::Invalid(format!("cannot start I/O thread: {e}")))?;
            io.workers.push(Worker {
                tx,
                shared,
                thread: Some(thread),
            });
        }
        io.permits.lock().0 = depth_total + n as usize * JOBS_PER_WORKER_MAX / 2;
        Ok(Arc::new(io))
    }

    pub fn controller(&self) -> &Arc<Controller> {
        &self.ctrl
    }

    /// The logical block size the queues count in.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Requests submitted through this controller and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// The controller was lost (no reconnect within its controller-loss
    /// timeout) or one of the I/O queues gave up: requests fail with
    /// [`IoError::ControllerLost`] from now on, and only a new controller
    /// reaches the target again.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire) || self.ctrl.current().is_err()
    }

    /// A handle on namespace `info.nsid`, which must count in this pool's
    /// block size.
    pub fn device(self: &Arc<Self>, info: NamespaceInfo) -> Result<Device, Error> {
        if info.block_size != self.block_size {
            return Err(Error::Invalid(format!(
                "namespace {} of {} has {}-byte blocks; the I/O queues of this controller \
                 count {}-byte blocks",
                info.nsid, self.ctrl.params.subnqn, info.block_size, self.block_size
            )));
        }
        Ok(Device {
            io: self.clone(),
            info,
        })
    }

    #[allow(clippy::too_many_arguments)]
    async fn run(
        &self,
        nsid: u32,
        op: Op,
        lba: u64,
        blocks: u64,
        fua: bool,
        buf: Vec<u8>,
        shared: Option<Arc<Vec<u8>>>,
        write_epoch: u32,
    ) -> (Result<(), IoError>, Vec<u8>) {
        if blocks == 0 && op != Op::Flush {
            return (Ok(()), buf);
        }
        if op == Op::Flush {
            // A flush must follow every write completed before it, on every
            // queue; the queues take it concurrently.
            let all = (0..self.workers.len())
                .map(|w| self.run_on(w, true, nsid, op, 0, 0, false, Vec::new(), None, 0));
            let r = join_all(all)
                .await
                .into_iter()
                .map(|(r, _)| r)
                .find(Result::is_err)
                .unwrap_or(Ok(()));
            return (r, buf);
        }
        let w = self.next.fetch_add(1, Ordering::Relaxed) % self.workers.len();
        self.run_on(
            w,
            false,
            nsid,
            op,
            lba,
            blocks,
            fua,
            buf,
            shared,
            write_epoch,
        )
        .await
    }

    /// Runs one request on queue `w` (`pinned`), or on the first of the
    /// queues from `w` on that nobody holds.
    #[allow(clippy::too_many_arguments)]
    async fn run_on(
        &self,
        w: usize,
        pinned: bool,
        nsid: u32,
        op: Op,
        lba: u64,
        blocks: u64,
        fua: bool,
        buf: Vec<u8>,
        shared: Option<Arc<Vec<u8>>>,
        write_epoch: u32,
    ) -> (Result<(), IoError>, Vec<u8>) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        std::future::poll_fn(|cx| {
            if self.permits.try_take(cx.waker()) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        let cell = lock(&self.cells).pop().unwrap_or_default();
        let mut job = Some(Job {
            nsid,
            op,
            lba,
            blocks,
            fua,
            buf,
            shared,
            write_epoch,
            cell: cell.clone(),
        });
        let n = self.workers.len();
        let tries = if pinned { 1 } else { n };
        for i in 0..tries {
            let Some(j) = job.take() else { break };
            if let Err(j) = self.workers[(w + i) % n].shared.try_submit(j) {
                job = Some(j);
            }
        }
        if job.is_some() {
            // Every queue was busy: hand it to queue w's thread.
            let worker = &self.workers[w];
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
            if worker.shared.asleep.load(Ordering::SeqCst) & ASLEEP != 0 {
                worker.shared.wake();
            }
        }
        let out = Wait { cell: &cell }.await;
        lock(&self.cells).push(cell);
        self.permits.give();
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        out
    }
}

impl Drop for ControllerIo {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for w in &self.workers {
            w.shared.wake();
        }
        for w in &mut self.workers {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// A namespace opened for I/O: a light handle on its controller's
/// [`ControllerIo`].
#[derive(Debug)]
pub struct Device {
    io: Arc<ControllerIo>,
    info: NamespaceInfo,
}

impl Device {
    /// Opens namespace `nsid` with `queues` I/O queues of its own (at most
    /// what the controller granted), each driven by its own thread. To
    /// serve several namespaces of one controller, start a
    /// [`ControllerIo`] and use [`Device::on`] instead.
    pub fn open(ctrl: Arc<Controller>, nsid: u32, queues: u16) -> Result<Device, Error> {
        let info = ctrl.namespace(nsid)?;
        ControllerIo::start(ctrl, queues, info.block_size)?.device(info)
    }

    /// Namespace `nsid` of `io`'s controller, served by `io`'s queues.
    pub fn on(io: &Arc<ControllerIo>, nsid: u32) -> Result<Device, Error> {
        let info = io.controller().namespace(nsid)?;
        io.device(info)
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
        self.io.controller()
    }

    /// The queues serving this namespace (shared with the controller's
    /// other namespace handles).
    pub fn io(&self) -> &Arc<ControllerIo> {
        &self.io
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
            Ok((lba, blocks)) => self.run(Op::Read, lba, blocks, false, buf, 0).await,
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
        self.tagged(0).write(offset, buf, fua).await
    }

    /// Writes `buf` at `offset` without taking it: the copies of a
    /// mirrored write share one buffer, each request holding a reference
    /// until it completes.
    pub async fn write_shared(
        &self,
        offset: u64,
        buf: Arc<Vec<u8>>,
        fua: bool,
    ) -> Result<(), IoError> {
        self.tagged(0).write_shared(offset, buf, fua).await
    }

    /// Makes every completed write durable.
    pub async fn flush(&self) -> Result<(), IoError> {
        self.run(Op::Flush, 0, 0, false, Vec::new(), 0).await.0
    }

    /// Zeroes a range (deallocating it when the device allows).
    pub async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        deallocate: bool,
    ) -> Result<(), IoError> {
        self.tagged(0).write_zeroes(offset, len, deallocate).await
    }

    /// Discards (deallocates) a range.
    pub async fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.tagged(0).discard(offset, len).await
    }

    /// This namespace's writes, write-zeroes and discards with every
    /// command carrying `write_epoch` in CDW2: how a volume engine tags its
    /// mutations for the targets' snapshots (design/thin-snapshots.md T5).
    /// The untagged calls above are these with 0.
    pub fn tagged(&self, write_epoch: u32) -> Tagged<'_> {
        Tagged {
            dev: self,
            write_epoch,
        }
    }

    async fn run(
        &self,
        op: Op,
        lba: u64,
        blocks: u64,
        fua: bool,
        buf: Vec<u8>,
        write_epoch: u32,
    ) -> (Result<(), IoError>, Vec<u8>) {
        self.io
            .run(self.info.nsid, op, lba, blocks, fua, buf, None, write_epoch)
            .await
    }
}

/// A [`Device`]'s mutations tagged with a write epoch ([`Device::tagged`]).
#[derive(Debug, Clone, Copy)]
pub struct Tagged<'a> {
    dev: &'a Device,
    write_epoch: u32,
}

impl Tagged<'_> {
    /// [`Device::write`], tagged.
    pub async fn write(
        self,
        offset: u64,
        buf: Vec<u8>,
        fua: bool,
    ) -> (Result<(), IoError>, Vec<u8>) {
        match self.dev.check(offset, buf.len() as u64) {
            Ok((lba, blocks)) => {
                self.dev
                    .run(Op::Write, lba, blocks, fua, buf, self.write_epoch)
                    .await
            }
            Err(e) => (Err(e), buf),
        }
    }

    /// [`Device::write_shared`], tagged.
    pub async fn write_shared(
        self,
        offset: u64,
        buf: Arc<Vec<u8>>,
        fua: bool,
    ) -> Result<(), IoError> {
        let d = self.dev;
        let (lba, blocks) = d.check(offset, buf.len() as u64)?;
        d.io.run(
            d.info.nsid,
            Op::Write,
            lba,
            blocks,
            fua,
            Vec::new(),
            Some(buf),
            self.write_epoch,
        )
        .await
        .0
    }

    /// [`Device::write_zeroes`], tagged.
    pub async fn write_zeroes(
        self,
        offset: u64,
        len: u64,
        deallocate: bool,
    ) -> Result<(), IoError> {
        let (lba, blocks) = self.dev.check(offset, len)?;
        let op = Op::WriteZeroes { deallocate };
        let r = self
            .dev
            .run(op, lba, blocks, false, Vec::new(), self.write_epoch);
        r.await.0
    }

    /// [`Device::discard`], tagged.
    pub async fn discard(self, offset: u64, len: u64) -> Result<(), IoError> {
        let (lba, blocks) = self.dev.check(offset, len)?;
        let r = self.dev.run(
            Op::Deallocate,
            lba,
            blocks,
            false,
            Vec::new(),
            self.write_epoch,
        );
        r.await.0
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

/// One queue's state: the queue (until the controller is lost) and the
/// requests on it. Whoever holds its lock drives it: a submitter issuing
/// its own request, or the queue's thread ([`run_queue`]), which reads the
/// completions, reconnects, and takes requests handed over the channel.
#[derive(Debug)]
struct QueueState {
    /// None once the controller is lost: every request then fails at once.
    q: Option<IoQueue>,
    rx: Receiver<Job>,
    stop: Arc<AtomicBool>,
    /// Shared with [`ControllerIo::is_lost`].
    lost: Arc<AtomicBool>,
    bs: u32,
    /// Blocks per read or write command (the maximum transfer).
    max_blocks: u64,
    parents: Vec<Option<Parent>>,
    free: Vec<usize>,
    /// Requests with commands still to issue, oldest first.
    open: VecDeque<usize>,
    /// Buffers of split commands, reused.
    scratch: Vec<Vec<u8>>,
    comps: Vec<Completion>,
    /// Finished requests, completed once the lock is let go.
    done: Vec<Done>,
    /// A job taken from the channel just before going to sleep.
    stash: Option<Job>,
    /// The socket had something (or its end) when the queue's thread
    /// woke: read it even with nothing outstanding.
    socket_ready: bool,
}

impl QueueState {
    fn new(
        q: IoQueue,
        bs: u32,
        rx: Receiver<Job>,
        stop: Arc<AtomicBool>,
        lost: Arc<AtomicBool>,
    ) -> QueueState {
        let max_blocks = (q.max_transfer() / bs as usize).max(1) as u64;
        let comps = Vec::with_capacity(q.depth());
        QueueState {
            q: Some(q),
            rx,
            stop,
            lost,
            bs,
            max_blocks,
            parents: Vec::new(),
            free: Vec::new(),
            open: VecDeque::new(),
            scratch: Vec::new(),
            comps,
            done: Vec::new(),
            stash: None,
            socket_ready: false,
        }
    }

    fn outstanding(&self) -> usize {
        self.q.as_ref().map_or(0, IoQueue::outstanding)
    }

    fn has_room(&self) -> bool {
        self.q.as_ref().is_none_or(|q| q.outstanding() < q.depth())
    }

    /// What the queue's thread must watch for this queue's sake: the
    /// socket's reads while commands are out, its writes while bytes wait,
    /// or a run at once (a connection to repair).
    fn needs(&self) -> u8 {
        let Some(q) = self.q.as_ref() else { return 0 };
        if q.is_broken() {
            return NEEDS_RUN;
        }
        let mut n = 0;
        if q.outstanding() > 0 {
            n |= ASLEEP_IN;
        }
        if q.wants_write() {
            n |= ASLEEP_OUT;
        }
        n
    }

    /// Takes new jobs while the queue has room.
    fn take_jobs(&mut self) {
        while self.open.is_empty() || self.has_room() {
            let job = match self.stash.take() {
                Some(j) => j,
                None => match self.rx.try_recv() {
                    Ok(j) => j,
                    Err(_) => return,
                },
            };
            self.accept(job);
        }
    }

    /// Puts a job on the open list.
    fn accept(&mut self, job: Job) {
        let id = self.free.pop().unwrap_or_else(|| {
            self.parents.push(None);
            self.parents.len() - 1
        });
        self.parents[id] = Some(Parent {
            job,
            left: 0,
            next: 0,
            err: None,
        });
        self.open.push_back(id);
    }

    /// Issues commands for open jobs while the queue has room.
    fn issue(&mut self) {
        let QueueState {
            q,
            bs,
            max_blocks,
            parents,
            free,
            open,
            scratch,
            done,
            ..
        } = self;
        let bs = *bs as u64;
        while let Some(&id) = open.front() {
            let p = parents[id].as_mut().expect("open parent exists");
            let Some(q) = q.as_mut() else {
                p.err.get_or_insert(IoError::ControllerLost);
                p.next = p.job.blocks.max(1);
                open.pop_front();
                if p.left == 0 {
                    finish(parents, free, done, id);
                }
                continue;
            };
            if q.outstanding() >= q.depth() {
                break;
            }
            let total = p.job.blocks;
            debug_assert!(
                p.next < total.max(1),
                "open requests have commands to issue"
            );
            let op = p.job.op;
            let per = match op {
                Op::Read | Op::Write => *max_blocks,
                Op::Flush => 1,
                Op::WriteZeroes { .. } | Op::Deallocate => ZEROES_BLOCKS_MAX,
            };
            let n = (total - p.next).min(per);
            let whole = p.next == 0 && n == total;
            let mut shared = None;
            let buf = match op {
                Op::Write if whole && p.job.shared.is_some() => {
                    shared = p.job.shared.clone();
                    Vec::new()
                }
                Op::Read | Op::Write if whole => std::mem::take(&mut p.job.buf),
                Op::Read | Op::Write => {
                    let len = (n * bs) as usize;
                    let mut b = scratch.pop().unwrap_or_default();
                    b.resize(len, 0);
                    if op == Op::Write {
                        let off = (p.next * bs) as usize;
                        b.copy_from_slice(&p.job.out()[off..off + len]);
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
                shared,
                token: (id as u64) << 32 | p.next,
            };
            p.next += n.max(1);
            p.left += 1;
            if let Err((req, e)) = q.submit_tagged(req, p.job.write_epoch) {
                tracing::warn!(error = %e, "submit failed");
                p.left -= 1;
                p.err.get_or_insert(match e {
                    Error::Invalid(_) => IoError::Invalid("the I/O queue refused the request"),
                    _ => IoError::ControllerLost,
                });
                if whole && req.shared.is_none() {
                    p.job.buf = req.buf;
                } else if req.buf.capacity() > 0 {
                    scratch.push(req.buf);
                }
            }
            // Issued in full: off the open list at once, so a completion
            // that finishes it never leaves a finished request there.
            if p.next >= total.max(1) {
                open.pop_front();
                if p.left == 0 {
                    finish(parents, free, done, id);
                }
            }
        }
    }

    /// Handles the socket; returns the completions it saw.
    fn reap(&mut self) -> usize {
        let socket_ready = std::mem::take(&mut self.socket_ready);
        let QueueState {
            q,
            bs,
            parents,
            free,
            scratch,
            comps,
            done,
            ..
        } = self;
        let Some(queue) = q.as_mut() else { return 0 };
        comps.clear();
        let r = if queue.outstanding() > 0 {
            queue.poll(comps, Duration::ZERO).map(drop)
        } else if socket_ready {
            // An idle connection's end is repaired when a command needs it,
            // as before the queue watched its socket while idle.
            queue.poll_idle(comps)
        } else {
            return 0;
        };
        let got = comps.len();
        for c in comps.drain(..) {
            on_completion(c, parents, free, scratch, done, *bs);
        }
        if let Err(e) = r {
            tracing::error!(error = %e, "I/O queue failed");
            self.abandon();
        }
        got
    }

    /// The controller is lost: drops the queue and fails every request.
    /// Buffers still inside the queue are lost with it; the requests get
    /// fresh ones of their length back.
    fn abandon(&mut self) {
        self.q = None;
        self.lost.store(true, Ordering::Release);
        let bs = self.bs as usize;
        for id in 0..self.parents.len() {
            if let Some(p) = self.parents[id].as_mut() {
                p.err.get_or_insert(IoError::ControllerLost);
                p.left = 0;
                p.next = p.job.blocks.max(1);
                let len = p.job.blocks as usize * bs;
                if matches!(p.job.op, Op::Read | Op::Write)
                    && p.job.shared.is_none()
                    && p.job.buf.len() != len
                {
                    p.job.buf = vec![0; len];
                }
                finish(&mut self.parents, &mut self.free, &mut self.done, id);
            }
        }
        self.open.clear();
    }
}

/// The queue's thread: takes requests handed over the channel, reads
/// completions and repairs the connection; sleeps in poll(2) on its
/// eventfd and, while commands are out, the socket. Submitters that issue
/// on the socket themselves wake it only when it sleeps without watching
/// what their command needs.
fn run_queue(shared: &QueueShared) {
    loop {
        let mut s = shared.lock();
        s.take_jobs();
        s.issue();
        if s.stop.load(Ordering::Acquire) && s.outstanding() == 0 {
            let done = take_done(&mut s);
            drop(s);
            complete_all(done);
            return;
        }
        let got = s.reap();
        let can_issue = !s.open.is_empty() && s.has_room();
        let done = take_done(&mut s);
        if can_issue || got > 0 || !done.is_empty() {
            drop(s);
            complete_all(done);
            continue;
        }
        let needs = s.needs();
        if needs & NEEDS_RUN != 0 && s.outstanding() > 0 {
            // A submitter found the connection broken: reap reconnects.
            continue;
        }
        // The socket is watched even with nothing outstanding, so a
        // submitter's command needs no wake-up. What comes on an idle
        // connection is its end, kept until a command needs the queue.
        let watch = if s.q.is_some() && needs & NEEDS_RUN == 0 {
            ASLEEP_IN
        } else {
            0
        };
        let mask = ASLEEP | watch | (needs & !NEEDS_RUN);
        shared.asleep.store(mask, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        // A job that arrived after the last look is taken instead of
        // sleeping, unless one already waits for room in the queue (taking
        // another would overwrite it).
        if s.stash.is_none() {
            if let Ok(j) = s.rx.try_recv() {
                s.stash = Some(j);
                shared.asleep.store(0, Ordering::SeqCst);
                continue;
            }
        }
        let qfd = s.q.as_ref().map_or(-1, IoQueue::fd);
        drop(s);
        let mut events = 0;
        if mask & ASLEEP_IN != 0 {
            events |= libc::POLLIN;
        }
        if mask & ASLEEP_OUT != 0 {
            events |= libc::POLLOUT;
        }
        let mut fds = [
            wake::pollfd(shared.efd.as_raw_fd(), libc::POLLIN),
            wake::pollfd(qfd, events),
        ];
        let n = if events != 0 && qfd >= 0 { 2 } else { 1 };
        // An interrupted wait looks like a timeout: the check below is
        // harmless then.
        let ready = wake::poll(&mut fds[..n], Some(WORKER_IDLE_WAKE)).unwrap_or(1);
        shared.asleep.store(0, Ordering::SeqCst);
        if n == 2 && fds[1].revents != 0 {
            shared.lock().socket_ready = true;
        }
        if fds[0].revents & libc::POLLIN != 0 {
            shared.efd.drain();
        }
        // Commands and a silent socket: a target that vanished without
        // closing its connections looks like this. Its controller's
        // keep-alive declares it lost in bounded time.
        if ready == 0 {
            let mut s = shared.lock();
            let lost = s.outstanding() > 0
                && s.q
                    .as_ref()
                    .is_some_and(|q| q.controller().current().is_err());
            if lost {
                tracing::error!("controller lost with commands outstanding; failing them");
                s.abandon();
                let done = take_done(&mut s);
                drop(s);
                complete_all(done);
            }
        }
    }
}

fn on_completion(
    c: Completion,
    parents: &mut [Option<Parent>],
    free: &mut Vec<usize>,
    scratch: &mut Vec<Vec<u8>>,
    done: &mut Vec<Done>,
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
        Op::Write if c.buf.capacity() > 0 => scratch.push(c.buf),
        _ => {}
    }
    if p.left == 0 && p.next >= p.job.blocks.max(1) {
        finish(parents, free, done, id);
    }
}

fn finish(parents: &mut [Option<Parent>], free: &mut Vec<usize>, done: &mut Vec<Done>, id: usize) {
    let p = parents[id].take().expect("finishing a live request");
    free.push(id);
    let r = match p.err {
        Some(e) => Err(e),
        None => Ok(()),
    };
    done.push((p.job.cell, r, p.job.buf));
}

/// Runs futures concurrently; their outputs in the order given.
pub(crate) fn join_all<F: Future>(futures: impl IntoIterator<Item = F>) -> JoinAll<F> {
    let futures: Vec<_> = futures.into_iter().map(|f| Some(Box::pin(f))).collect();
    let mut out = Vec::with_capacity(futures.len());
    out.resize_with(futures.len(), || None);
    JoinAll { futures, out }
}

/// See [`join_all`]. Each future is polled again on every wake-up until it
/// is done, which suits the handful of pieces one request splits into.
pub(crate) struct JoinAll<F: Future> {
    futures: Vec<Option<Pin<Box<F>>>>,
    out: Vec<Option<F::Output>>,
}

// The futures are pinned in their own boxes and the outputs are never
// pinned, so moving a JoinAll is fine.
impl<F: Future> Unpin for JoinAll<F> {}

impl<F: Future> Future for JoinAll<F> {
    type Output = Vec<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let mut pending = false;
        for (slot, out) in this.futures.iter_mut().zip(this.out.iter_mut()) {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => {
                        *out = Some(v);
                        *slot = None;
                    }
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            return Poll::Pending;
        }
        Poll::Ready(
            this.out
                .iter_mut()
                .map(|o| o.take().expect("every future finished"))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_all_keeps_the_order_and_runs_everything() {
        let n = std::cell::Cell::new(0);
        let futs = (0..5).map(|i| {
            let n = &n;
            async move {
                // Yield once so the futures interleave.
                let mut yielded = false;
                std::future::poll_fn(|cx| {
                    if yielded {
                        Poll::Ready(())
                    } else {
                        yielded = true;
                        cx.waker().wake_by_ref();
                        Poll::Pending
                    }
                })
                .await;
                n.set(n.get() + 1);
                i * 10
            }
        });
        assert_eq!(block_on(join_all(futs)), vec![0, 10, 20, 30, 40]);
        assert_eq!(n.get(), 5);
        let none: Vec<std::future::Ready<u8>> = Vec::new();
        assert!(block_on(join_all(none)).is_empty());
    }
}
