//! A small executor that polls [`BlockDev`](crate::BlockDev) futures on a
//! few threads, so front-end threads (FUSE sessions, NBD readers) hand an
//! I/O off and go back to reading requests.
//!
//! ```text
//!  spawn(fut) ──(waits while TASKS at limit)──► run queue ──► executor threads
//!        ▲                                          ▲              │ poll
//!        └──────────── slot freed when done         └── waker ◄────┘ (I/O thread)
//! ```
//!
//! A task sits in the run queue at most once (a `queued` flag guards the
//! push), so the queue never holds more entries than there are live tasks,
//! and live tasks are bounded by `max_tasks`: nothing here grows without
//! bound.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::task::{Context, Wake, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long dropping an executor waits for its live tasks. Longer than the
/// initiator's controller-loss timeout (60 s), after which a lost device
/// fails every request, so only a device that never answers is abandoned.
const DRAIN_TIMEOUT_MS: u64 = 75_000;

type BoxTask = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

#[derive(Default)]
struct RunState {
    queue: VecDeque<Arc<Task>>,
    live: usize,
    stop: bool,
}

struct Shared {
    run: Mutex<RunState>,
    /// Executor threads wait here for work.
    work: Condvar,
    /// Spawners wait here for a free task slot.
    room: Condvar,
    max_tasks: usize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, RunState> {
        self.run.lock().unwrap_or_else(|p| p.into_inner())
    }
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
        if let Some(shared) = self.shared.upgrade() {
            shared.lock().queue.push_back(self.clone());
            shared.work.notify_one();
        }
    }
}

/// A fixed set of threads polling spawned futures to completion.
pub(crate) struct Executor {
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
    pub(crate) fn new(name: &str, threads: usize, max_tasks: usize) -> std::io::Result<Executor> {
        assert!(
            threads > 0 && max_tasks > 0,
            "an executor needs threads and tasks"
        );
        let shared = Arc::new(Shared {
            run: Mutex::new(RunState::default()),
            work: Condvar::new(),
            room: Condvar::new(),
            max_tasks,
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
    pub(crate) fn spawn<F: Future<Output = ()> + Send + 'static>(&self, fut: F) {
        let task = Arc::new(Task {
            fut: Mutex::new(Some(Box::pin(fut))),
            queued: AtomicBool::new(true),
            shared: Arc::downgrade(&self.shared),
        });
        let mut g = self.shared.lock();
        while g.live >= self.shared.max_tasks {
            g = self.shared.room.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        g.live += 1;
        g.queue.push_back(task);
        drop(g);
        self.shared.work.notify_one();
    }

    /// Futures spawned and not yet complete.
    #[allow(dead_code)]
    pub(crate) fn live(&self) -> usize {
        self.shared.lock().live
    }
}

impl Drop for Executor {
    /// Lets every live task finish, then stops the threads. Tasks still
    /// pending after [`DRAIN_TIMEOUT_MS`] (a device that never completes
    /// them) are abandoned with their threads, so teardown stays bounded.
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_millis(DRAIN_TIMEOUT_MS);
        let mut g = self.shared.lock();
        g.stop = true;
        self.shared.work.notify_all();
        while g.live > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::error!(
                    pending = g.live,
                    "block device did not complete I/O within {DRAIN_TIMEOUT_MS} ms; abandoning it"
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
            let mut g = shared.lock();
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
        let mut slot = task.fut.lock().unwrap_or_else(|p| p.into_inner());
        let Some(fut) = slot.as_mut() else {
            continue; // woken after it completed
        };
        let waker = Waker::from(task.clone());
        let mut cx = Context::from_waker(&waker);
        let done = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            fut.as_mut().poll(&mut cx)
        })) {
            Ok(p) => p.is_ready(),
            Err(_) => {
                // A front-end task panicked: an invariant is broken. A
                // half-served request would wedge its client; crash loudly.
                tracing::error!("front-end I/O task panicked; aborting");
                std::process::abort();
            }
        };
        if done {
            *slot = None;
            drop(slot);
            let mut g = shared.lock();
            g.live -= 1;
            let last = g.stop && g.live == 0;
            drop(g);
            if last {
                shared.room.notify_all();
                shared.work.notify_all();
            } else {
                shared.room.notify_one();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::task::Poll;

    #[test]
    fn runs_tasks_woken_from_other_threads_and_drains_on_drop() {
        let ex = Executor::new("t", 2, 4).unwrap();
        let n = Arc::new(AtomicUsize::new(0));
        for i in 0..32u64 {
            let n = n.clone();
            ex.spawn(async move {
                // Completes after another thread wakes it.
                let flag = Arc::new(AtomicBool::new(false));
                let f2 = flag.clone();
                let mut started = false;
                std::future::poll_fn(|cx| {
                    if flag.load(Ordering::Acquire) {
                        return Poll::Ready(());
                    }
                    if !started {
                        started = true;
                        let w = cx.waker().clone();
                        let f3 = f2.clone();
                        std::thread::spawn(move || {
                            std::thread::sleep(std::time::Duration::from_millis(i % 3));
                            f3.store(true, Ordering::Release);
                            w.wake();
                        });
                    }
                    Poll::Pending
                })
                .await;
                n.fetch_add(1, Ordering::Relaxed);
            });
            assert!(ex.live() <= 4);
        }
        drop(ex);
        assert_eq!(n.load(Ordering::Relaxed), 32);
    }
}
