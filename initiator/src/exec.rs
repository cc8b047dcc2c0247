//! A small executor that polls I/O futures ([`BlockDev`](crate::BlockDev)
//! and [`Volume`](crate::Volume) calls) on a few threads, so the threads
//! that receive requests (FUSE sessions, NBD readers, the target's
//! reactors serving a volume namespace) hand an I/O off and go back to
//! their own work. The project has one executor, in two shapes: [`Executor`],
//! a pool every user starts its own instance of, and [`LocalTasks`], the
//! tasks of one thread that polls them itself (a ublk queue's).
//!
//! ```text
//!  spawn(fut) ──(waits while TASKS at limit)──► first poll on the caller's thread
//!  try_spawn(make) ──(refused at limit)──────►        │ pending: the device holds the waker
//!        ▲                                           ▼
//!        └── slot freed when done ◄── executor threads ◄── run queue ◄── waker (I/O thread)
//! ```
//!
//! A task sits in the run queue at most once (a `queued` flag guards the
//! push), so the queue never holds more entries than there are live tasks,
//! and live tasks are bounded by `max_tasks`: nothing here grows without
//! bound. A thread that must never wait (a reactor) uses
//! [`Executor::try_spawn`], which is refused instead of waiting for a slot.

use crate::limits::EXECUTOR_DRAIN_TIMEOUT_MS;
use nvpool_rt::{lock, Wakeup};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::task::{Context, Wake, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type BoxTask = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;
type LocalTask<'a> = Pin<Box<dyn Future<Output = ()> + 'a>>;

#[derive(Default)]
struct RunState {
    queue: VecDeque<Arc<Task>>,
    live: usize,
    stop: bool,
    /// Spawners waiting on `room`: a finished task signals it only then
    /// (a signal costs a system call even with nobody waiting).
    waiting: usize,
}

struct Shared {
    run: Mutex<RunState>,
    /// Executor threads wait here for work.
    work: Condvar,
    /// Spawners wait here for a free task slot.
    room: Condvar,
    max_tasks: usize,
    /// Whether a wake polls the task on the waking thread (see
    /// [`Executor::new`]).
    inline_wake: bool,
}

struct Task {
    fut: Mutex<Option<BoxTask>>,
    queued: AtomicBool,
    shared: Weak<Shared>,
}

impl Wake for Task {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.queued.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(shared) = self.shared.upgrade() else {
            return;
        };
        if shared.inline_wake {
            // Poll right here unless another thread is polling it now (that
            // one cannot see this wake: queue it as usual).
            let slot = match self.fut.try_lock() {
                Ok(g) => Some(g),
                Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            };
            if let Some(slot) = slot {
                self.queued.store(false, Ordering::Release);
                poll_locked(&shared, self, slot);
                return;
            }
        }
        lock(&shared.run).queue.push_back(self.clone());
        shared.work.notify_one();
    }
}

/// A fixed set of threads polling spawned futures to completion.
pub struct Executor {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("threads", &self.threads.len())
            .field("max_tasks", &self.shared.max_tasks)
            .finish()
    }
}

impl Executor {
    /// Starts `threads` threads named `name-N`; at most `max_tasks` futures
    /// are live at once ([`Executor::spawn`] waits for a free slot).
    ///
    /// With `inline_wake` a woken task is polled on the thread that woke it
    /// (the device's I/O thread), which then also sends the reply: one
    /// context switch less per request, for front-ends whose replies never
    /// block (FUSE writes them to /dev/fuse). Front-ends that may wait on a
    /// slow client while replying must not use it: they would stall the
    /// device's queue.
    pub fn new(
        name: &str,
        threads: usize,
        max_tasks: usize,
        inline_wake: bool,
    ) -> std::io::Result<Executor> {
        assert!(
            threads > 0 && max_tasks > 0,
            "an executor needs threads and tasks"
        );
        let shared = Arc::new(Shared {
            run: Mutex::new(RunState::default()),
            work: Condvar::new(),
            room: Condvar::new(),
            max_tasks,
            inline_wake,
        });
        let mut ex = Executor {
            shared,
            threads: Vec::with_capacity(threads),
        };
        for i in 0..threads {
            let s = ex.shared.clone();
            let t = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || run(s))?;
            ex.threads.push(t);
        }
        Ok(ex)
    }

    /// Runs `fut` on the executor; waits while `max_tasks` are live.
    ///
    /// The first poll happens here, on the caller's thread: it issues the
    /// I/O, so no executor thread has to be woken just to submit it (one
    /// context switch less per request). Later polls, after the device
    /// wakes the task, run on the executor threads.
    pub fn spawn<F: Future<Output = ()> + Send + 'static>(&self, fut: F) {
        let task = Arc::new(Task {
            fut: Mutex::new(Some(Box::pin(fut))),
            queued: AtomicBool::new(false),
            shared: Arc::downgrade(&self.shared),
        });
        let mut g = lock(&self.shared.run);
        while g.live >= self.shared.max_tasks {
            g.waiting += 1;
            g = self.shared.room.wait(g).unwrap_or_else(|p| p.into_inner());
            g.waiting -= 1;
        }
        g.live += 1;
        drop(g);
        poll_task(&self.shared, &task);
    }

    /// Runs the future `make` builds, unless `max_tasks` are live: then
    /// `make` is not called and false is returned. Never waits, so a thread
    /// that must not block (a reactor) can hand work off; whatever `make`
    /// would have captured stays with the caller when refused.
    ///
    /// The first poll happens here, on the caller's thread, as in
    /// [`Executor::spawn`]: the future must not block in it either.
    pub fn try_spawn<F, M>(&self, make: M) -> bool
    where
        F: Future<Output = ()> + Send + 'static,
        M: FnOnce() -> F,
    {
        {
            let mut g = lock(&self.shared.run);
            if g.live >= self.shared.max_tasks {
                return false;
            }
            g.live += 1;
        }
        let task = Arc::new(Task {
            fut: Mutex::new(Some(Box::pin(make()))),
            queued: AtomicBool::new(false),
            shared: Arc::downgrade(&self.shared),
        });
        poll_task(&self.shared, &task);
        true
    }

    /// Futures spawned and not yet complete.
    pub fn live(&self) -> usize {
        lock(&self.shared.run).live
    }
}

impl Drop for Executor {
    /// Lets every live task finish, then stops the threads. Tasks still
    /// pending after [`EXECUTOR_DRAIN_TIMEOUT_MS`] (a device that never completes
    /// them) are abandoned with their threads, so teardown stays bounded.
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_millis(EXECUTOR_DRAIN_TIMEOUT_MS);
        let mut g = lock(&self.shared.run);
        g.stop = true;
        self.shared.work.notify_all();
        while g.live > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::error!(
                    pending = g.live,
                    "block device did not complete I/O within {EXECUTOR_DRAIN_TIMEOUT_MS} ms; abandoning it"
                );
                return;
            }
            // Woken by the last completion (see `run`).
            g = self
                .shared
                .room
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        drop(g);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn run(shared: Arc<Shared>) {
    loop {
        let task = {
            let mut g = lock(&shared.run);
            loop {
                if let Some(t) = g.queue.pop_front() {
                    break t;
                }
                if g.stop && g.live == 0 {
                    drop(g);
                    // Wake the other threads so they see the same.
                    shared.work.notify_all();
                    return;
                }
                g = shared.work.wait(g).unwrap_or_else(|p| p.into_inner());
            }
        };
        task.queued.store(false, Ordering::Release);
        poll_task(&shared, &task);
    }
}

/// Polls `task` once on this thread; frees its slot when it completes.
fn poll_task(shared: &Shared, task: &Arc<Task>) {
    let slot = lock(&task.fut);
    poll_locked(shared, task, slot);
}

fn poll_locked(shared: &Shared, task: &Arc<Task>, mut slot: MutexGuard<'_, Option<BoxTask>>) {
    let Some(fut) = slot.as_mut() else {
        return; // woken after it completed
    };
    let waker = Waker::from(task.clone());
    let mut cx = Context::from_waker(&waker);
    let done =
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fut.as_mut().poll(&mut cx)))
        {
            Ok(p) => p.is_ready(),
            Err(_) => {
                // An I/O task panicked: an invariant is broken. A
                // half-served request would wedge its client; crash loudly.
                tracing::error!("I/O task panicked; aborting");
                std::process::abort();
            }
        };
    if done {
        *slot = None;
        drop(slot);
        let mut g = lock(&shared.run);
        g.live -= 1;
        let last = g.stop && g.live == 0;
        let waiting = g.waiting > 0;
        drop(g);
        if last {
            shared.room.notify_all();
            shared.work.notify_all();
        } else if waiting {
            shared.room.notify_one();
        }
    }
}

/// Polls `fut` to completion on the calling thread, parking it between
/// wakes: for threads that are not executor threads and may wait (FUSE
/// sessions, ublk queues' flushes, tests, blocking helpers).
pub fn block_on<F: Future>(fut: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    loop {
        if let std::task::Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// The executor's second shape: the tasks of one thread that polls them
/// itself and sleeps on a ring of its own (a ublk queue, whose ring is
/// thread-local). Tasks need not be `Send` and may borrow from the stack;
/// each has a fixed slot (a ublk tag), so nothing grows. Any thread may wake
/// a slot; the owner alternates [`LocalTasks::run_ready`] and [`LocalTasks::sleep`].
pub struct LocalTasks<'a> {
    ready: Arc<Ready>,
    wakers: Vec<Waker>,
    tasks: Vec<Option<LocalTask<'a>>>,
    live: usize,
    /// The slots being polled, swapped with the ready list's vector.
    batch: Vec<usize>,
}

impl std::fmt::Debug for LocalTasks<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTasks")
            .field("live", &self.live)
            .finish_non_exhaustive()
    }
}

/// The wake side of a [`LocalTasks`], shared with its wakers.
struct Ready {
    wakeup: Wakeup,
    /// False only while the owner is about to sleep or sleeping: then a
    /// waker must write `wakeup`.
    awake: AtomicBool,
    /// Slots to poll; each at most once (see `queued`), so never more
    /// than there are slots.
    slots: Mutex<Vec<usize>>,
    /// Per slot: on the ready list (or being polled and woken again).
    queued: Box<[AtomicBool]>,
}

/// The waker of one slot.
struct SlotWake {
    slot: usize,
    ready: Arc<Ready>,
}

impl Wake for SlotWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.ready.queued[self.slot].swap(true, Ordering::AcqRel) {
            return;
        }
        lock(&self.ready.slots).push(self.slot);
        // Pairs with the SeqCst store in `sleep`.
        if !self.ready.awake.swap(true, Ordering::SeqCst) {
            self.ready.wakeup.wake();
        }
    }
}

impl<'a> LocalTasks<'a> {
    /// `slots` empty slots.
    pub fn new(slots: usize) -> std::io::Result<LocalTasks<'a>> {
        let ready = Arc::new(Ready {
            wakeup: Wakeup::nonblocking()?,
            awake: AtomicBool::new(true),
            slots: Mutex::new(Vec::with_capacity(slots)),
            queued: (0..slots).map(|_| AtomicBool::new(false)).collect(),
        });
        Ok(LocalTasks {
            wakers: (0..slots)
                .map(|slot| {
                    let ready = ready.clone();
                    Waker::from(Arc::new(SlotWake { slot, ready }))
                })
                .collect(),
            tasks: (0..slots).map(|_| None).collect(),
            live: 0,
            batch: Vec::with_capacity(slots),
            ready,
        })
    }

    /// Puts `fut` in the free slot `slot`; the next
    /// [`LocalTasks::run_ready`] polls it first.
    pub fn spawn(&mut self, slot: usize, fut: impl Future<Output = ()> + 'a) {
        assert!(self.tasks[slot].is_none(), "task slot {slot} is taken");
        self.tasks[slot] = Some(Box::pin(fut));
        self.live += 1;
        self.wakers[slot].wake_by_ref();
    }

    /// Polls the woken slots, and those woken meanwhile, until none is;
    /// returns how many tasks are not complete.
    pub fn run_ready(&mut self) -> usize {
        loop {
            std::mem::swap(&mut *lock(&self.ready.slots), &mut self.batch);
            if self.batch.is_empty() {
                return self.live;
            }
            for &slot in &self.batch {
                // Cleared before polling: a wake during the poll queues it again.
                self.ready.queued[slot].store(false, Ordering::Release);
                let Some(task) = self.tasks[slot].as_mut() else {
                    continue; // woken after it completed
                };
                let mut cx = Context::from_waker(&self.wakers[slot]);
                if task.as_mut().poll(&mut cx).is_ready() {
                    self.tasks[slot] = None;
                    self.live -= 1;
                }
            }
            self.batch.clear();
        }
    }

    /// Runs `wait`, the owner's sleep on its ring, unless a slot was woken
    /// since [`LocalTasks::run_ready`] (then `None`). While it runs a wake
    /// also writes [`LocalTasks::wakeup`], so the sleep must watch that.
    pub fn sleep<R>(&self, wait: impl FnOnce() -> R) -> Option<R> {
        self.ready.awake.store(false, Ordering::SeqCst);
        // Pairs with the swap in `SlotWake::wake_by_ref`: either this sees the
        // slot or the waker sees the owner asleep. Unlocked before sleeping.
        let idle = lock(&self.ready.slots).is_empty();
        let slept = idle.then(wait);
        self.ready.awake.store(true, Ordering::SeqCst);
        slept
    }

    /// What a wake writes while the owner sleeps: nonblocking, so the
    /// owner's ring polls it and the owner drains it once it fired.
    pub fn wakeup(&self) -> &Wakeup {
        &self.ready.wakeup
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::os::fd::AsRawFd;
    use std::sync::atomic::AtomicUsize;
    use std::task::Poll;

    #[test]
    fn runs_tasks_woken_from_other_threads_and_drains_on_drop() {
        woken_tasks_complete(false);
    }

    #[test]
    fn inline_wake_polls_on_the_waking_thread_and_drains_on_drop() {
        woken_tasks_complete(true);
    }

    #[test]
    fn try_spawn_is_refused_at_the_limit_and_never_waits() {
        let ex = Executor::new("t", 1, 2, false).unwrap();
        let release = Arc::new(AtomicBool::new(false));
        let wakers: Arc<Mutex<Vec<Waker>>> = Arc::default();
        let done = Arc::new(AtomicUsize::new(0));
        let parked = |release: Arc<AtomicBool>,
                      wakers: Arc<Mutex<Vec<Waker>>>,
                      done: Arc<AtomicUsize>| async move {
            std::future::poll_fn(|cx| {
                if release.load(Ordering::Acquire) {
                    return Poll::Ready(());
                }
                wakers.lock().unwrap().push(cx.waker().clone());
                Poll::Pending
            })
            .await;
            done.fetch_add(1, Ordering::Relaxed);
        };
        for _ in 0..2 {
            let (r, w, d) = (release.clone(), wakers.clone(), done.clone());
            assert!(ex.try_spawn(move || parked(r, w, d)));
        }
        assert_eq!(ex.live(), 2);
        let mut built = false;
        assert!(!ex.try_spawn(|| {
            built = true;
            async {}
        }));
        assert!(!built, "a refused future is never built");
        release.store(true, Ordering::Release);
        for w in wakers.lock().unwrap().drain(..) {
            w.wake();
        }
        drop(ex);
        assert_eq!(done.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn foreign_wakes_reach_the_ready_list_and_the_eventfd() {
        let set = LocalTasks::new(4).unwrap();
        let waker = set.wakers[3].clone();
        let slept = set.sleep(|| {
            std::thread::spawn(move || {
                waker.wake_by_ref();
                waker.wake();
            })
            .join()
            .unwrap()
        });
        assert!(slept.is_some());
        let mut out = Vec::new();
        std::mem::swap(&mut *lock(&set.ready.slots), &mut out);
        assert_eq!(out, vec![3]);
        let efd = set.wakeup().as_raw_fd();
        let mut n = 0u64;
        // SAFETY: reads 8 bytes into a u64 from the test's eventfd.
        let r = unsafe { libc::read(efd, (&mut n as *mut u64).cast(), 8) };
        assert_eq!((r, n), (8, 1));
        // Awake: further wakes only queue.
        set.ready.queued[3].store(false, Ordering::Release);
        set.wakers[3].wake_by_ref();
        // SAFETY: as above.
        let r = unsafe { libc::read(efd, (&mut n as *mut u64).cast(), 8) };
        assert_eq!(r, -1);
    }

    #[test]
    fn local_tasks_borrow_the_stack_and_sleep_until_another_thread_wakes_them() {
        let done = Cell::new(0);
        let release = Arc::new(AtomicBool::new(false));
        let wakers: Arc<Mutex<Vec<Waker>>> = Arc::default();
        let mut set = LocalTasks::new(3).unwrap();
        for slot in 0..3 {
            let (done, release, wakers) = (&done, release.clone(), wakers.clone());
            set.spawn(slot, async move {
                std::future::poll_fn(|cx| {
                    if release.load(Ordering::Acquire) {
                        return Poll::Ready(());
                    }
                    wakers.lock().unwrap().push(cx.waker().clone());
                    Poll::Pending
                })
                .await;
                done.set(done.get() + 1);
            });
        }
        assert_eq!(wakers.lock().unwrap().len(), 0, "spawning does not poll");
        assert!(set.sleep(|| ()).is_none(), "spawned slots are woken");
        assert_eq!(set.run_ready(), 3);
        assert_eq!((done.get(), wakers.lock().unwrap().len()), (0, 3));
        assert!(!set.wakeup().is_woken());
        let parked = std::mem::take(&mut *wakers.lock().unwrap());
        // The owner's wait on its ring (here poll(2) of the eventfd) ends
        // when another thread wakes the tasks.
        let revents = set.sleep(|| {
            let waking = std::thread::spawn(move || {
                release.store(true, Ordering::Release);
                parked.iter().for_each(Waker::wake_by_ref);
            });
            let fd = set.wakeup().as_raw_fd();
            let r = nvpool_rt::wake::poll_one(fd, libc::POLLIN, Some(Duration::from_secs(5)));
            // The first wake ends the wait; the test wants all three queued.
            waking.join().unwrap();
            r.unwrap()
        });
        assert_ne!(revents.unwrap() & libc::POLLIN, 0);
        set.wakeup().drain();
        assert_eq!(set.run_ready(), 0);
        assert_eq!(done.get(), 3);
        assert!(set.sleep(|| ()).is_some(), "nothing left to poll");
    }

    #[test]
    fn a_wake_during_its_poll_polls_the_slot_again_and_a_done_slot_is_free() {
        let polls = Cell::new(0);
        let mut set = LocalTasks::new(2).unwrap();
        set.spawn(
            1,
            std::future::poll_fn(|cx| {
                polls.set(polls.get() + 1);
                if polls.get() == 2 {
                    return Poll::Ready(());
                }
                cx.waker().wake_by_ref();
                Poll::Pending
            }),
        );
        assert_eq!(set.run_ready(), 0);
        assert_eq!(polls.get(), 2);
        assert!(set.sleep(|| ()).is_some());
        // A stale wake of the completed slot polls nothing.
        set.wakers[1].wake_by_ref();
        assert_eq!(set.run_ready(), 0);
        assert_eq!(polls.get(), 2);
        set.spawn(1, async { polls.set(10) });
        assert_eq!(set.run_ready(), 0);
        assert_eq!(polls.get(), 10);
    }

    fn woken_tasks_complete(inline_wake: bool) {
        let ex = Executor::new("t", 2, 4, inline_wake).unwrap();
        let n = Arc::new(AtomicUsize::new(0));
        let me = std::thread::current().id();
        // Where each task was first polled and where it finished.
        let seen = Arc::new(Mutex::new(Vec::new()));
        for i in 0..32u64 {
            let n = n.clone();
            let seen = seen.clone();
            ex.spawn(async move {
                // Completes after another thread wakes it.
                let flag = Arc::new(AtomicBool::new(false));
                let f2 = flag.clone();
                let mut started = None;
                std::future::poll_fn(|cx| {
                    if flag.load(Ordering::Acquire) {
                        return Poll::Ready(());
                    }
                    if started.is_none() {
                        started = Some(std::thread::current().id());
                        let w = cx.waker().clone();
                        let f3 = f2.clone();
                        std::thread::spawn(move || {
                            std::thread::sleep(std::time::Duration::from_millis(1 + i % 3));
                            f3.store(true, Ordering::Release);
                            w.wake();
                        });
                    }
                    Poll::Pending
                })
                .await;
                let on_executor = std::thread::current()
                    .name()
                    .is_some_and(|t| t.starts_with("t-"));
                seen.lock().unwrap().push((started.unwrap(), on_executor));
                n.fetch_add(1, Ordering::Relaxed);
            });
            assert!(ex.live() <= 4);
        }
        drop(ex);
        assert_eq!(n.load(Ordering::Relaxed), 32);
        let seen = seen.lock().unwrap();
        // The first poll (issuing the I/O) runs on the spawning thread.
        assert!(seen.iter().all(|&(first, _)| first == me));
        let on_executor = seen.iter().filter(|&&(_, e)| e).count();
        if inline_wake {
            // Woken by a thread other than the executor's: polled there
            // (unless that thread found the task being polled elsewhere,
            // which a preempted spawner can cause now and then).
            assert!(on_executor < 32, "every task finished on the executor");
        } else {
            assert_eq!(on_executor, 32);
        }
    }
}
