//! Backends that complete I/O on threads of their own (a pooled volume
//! served by the volume engine), and the per-reactor sink their
//! completions come back through.
//!
//! ```text
//!  reactor thread                              backend threads
//!  ─────────────                               ───────────────
//!  Queue::issue ── slot → Backend state
//!       │ AsyncOp (write data copied out) ───► Backend::submit ─► … network …
//!       │ AsyncDone(user_data, sink)     ───►        │
//!       ▼                                            ▼
//!  reap_async ◄── waker (eventfd) ◄── CompletionSink ◄── AsyncDone::complete
//!       │
//!       ▼ Queue::on_async_completion (read data copied into the slot) ─► finish
//! ```
//!
//! The rules are the io_uring ones (docs/ARCHITECTURE.md D4): the command
//! slot stays in `Backend` state, owning its buffer, until the completion
//! is back on the reactor thread, and a closing connection waits as a
//! zombie for it. Nothing crosses threads by pointer: an [`AsyncOp`] owns
//! its data (a write's bytes are copied out of the slot, once) and a read's
//! bytes come back by value, so a reactor that stops early can never leave a
//! backend writing into freed memory.
//!
//! An [`AsyncDone`] completes exactly once: `complete` consumes it, and one
//! dropped without completing completes with an error, so no slot can be
//! stranded by a backend that loses an operation.

use nvpool_rt::lock;
use std::io;
use std::sync::{Arc, Mutex, MutexGuard};

/// One operation for an asynchronous backend. Offsets and lengths are
/// namespace bytes, already range-checked like the synchronous calls'.
#[derive(Debug)]
pub enum AsyncOp {
    /// Read `len` bytes at `off`; completes with `Some(data)`, `data.len() == len`.
    Read { off: u64, len: usize },
    /// Write `data` at `off`; with `fua` durable on completion.
    Write { off: u64, data: Vec<u8>, fua: bool },
    /// Make every completed write durable.
    Flush,
    /// Zero `[off, off + len)`.
    WriteZeroes { off: u64, len: u64 },
    /// Deallocate each `(off, len)` range.
    Discard { ranges: Vec<(u64, u64)> },
}

impl AsyncOp {
    /// True for operations that change the namespace's bytes or their
    /// durability (everything but reads).
    pub fn mutates(&self) -> bool {
        !matches!(self, AsyncOp::Read { .. })
    }
}

/// What an asynchronous operation produced: a read's data (`Some`), or
/// nothing for the other operations.
pub type AsyncResult = io::Result<Option<Vec<u8>>>;

/// The completion of one operation, as the reactor receives it.
#[derive(Debug)]
pub struct AsyncCompletion {
    /// The queue and slot the operation belongs to (`queue::user_data`).
    pub user_data: u64,
    pub result: AsyncResult,
}

/// Where one reactor's asynchronous completions wait for its thread.
///
/// Bounded without a limit of its own: every entry comes from one
/// [`AsyncDone`], each made for one command slot in `Backend` state, so the
/// sink never holds more entries than the reactor's connections have slots
/// (and the reactor takes them all at every loop iteration).
pub struct CompletionSink {
    pending: Mutex<Vec<AsyncCompletion>>,
    /// Wakes the reactor (its poll's waker, an eventfd).
    wake: Box<dyn Fn() + Send + Sync>,
}

impl std::fmt::Debug for CompletionSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionSink")
            .field("pending", &self.lock().len())
            .finish()
    }
}

impl CompletionSink {
    /// A sink that calls `wake` when a completion arrives while it was empty
    /// (one wake-up per batch: the reactor takes everything at once).
    pub fn new(wake: impl Fn() + Send + Sync + 'static) -> Arc<CompletionSink> {
        Arc::new(CompletionSink {
            pending: Mutex::new(Vec::new()),
            wake: Box::new(wake),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Vec<AsyncCompletion>> {
        // Pushes and takes are whole; a panic elsewhere leaves it consistent.
        lock(&self.pending)
    }

    fn push(&self, c: AsyncCompletion) {
        let first = {
            let mut p = self.lock();
            p.push(c);
            p.len() == 1
        };
        if first {
            (self.wake)();
        }
    }

    /// Moves every waiting completion to `out` (the reactor's, reused).
    pub fn take(&self, out: &mut Vec<AsyncCompletion>) {
        let mut p = self.lock();
        if out.is_empty() {
            std::mem::swap(&mut *p, out);
        } else {
            out.append(&mut p);
        }
    }
}

/// Completes one [`AsyncOp`]; callable from any thread, exactly once.
#[derive(Debug)]
pub struct AsyncDone {
    sink: Arc<CompletionSink>,
    user_data: u64,
    done: bool,
}

impl AsyncDone {
    /// A completion handle for the operation of `user_data`, delivered to `sink`.
    pub fn new(sink: Arc<CompletionSink>, user_data: u64) -> AsyncDone {
        AsyncDone {
            sink,
            user_data,
            done: false,
        }
    }

    /// Hands the result back to the reactor. A read's data must be as long
    /// as the read (anything else is a backend bug and crashes the reactor).
    pub fn complete(mut self, result: AsyncResult) {
        self.done = true;
        self.sink.push(AsyncCompletion {
            user_data: self.user_data,
            result,
        });
    }
}

impl Drop for AsyncDone {
    fn drop(&mut self) {
        if !self.done {
            self.sink.push(AsyncCompletion {
                user_data: self.user_data,
                result: Err(io::Error::other(
                    "the backend dropped the operation without completing it",
                )),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn completes_once_and_a_dropped_handle_completes_with_an_error() {
        let wakes = Arc::new(AtomicUsize::new(0));
        let w = wakes.clone();
        let sink = CompletionSink::new(move || {
            w.fetch_add(1, Ordering::Relaxed);
        });
        AsyncDone::new(sink.clone(), 7).complete(Ok(Some(vec![1, 2])));
        drop(AsyncDone::new(sink.clone(), 8));
        let t = std::thread::spawn({
            let sink = sink.clone();
            move || AsyncDone::new(sink, 9).complete(Ok(None))
        });
        t.join().unwrap();
        assert_eq!(wakes.load(Ordering::Relaxed), 1, "one wake per batch");
        let mut out = Vec::new();
        sink.take(&mut out);
        assert_eq!(out.len(), 3);
        assert_eq!(out[0].user_data, 7);
        assert_eq!(
            out[0].result.as_ref().unwrap().as_deref(),
            Some(&[1u8, 2][..])
        );
        assert_eq!(out[1].user_data, 8);
        assert!(out[1].result.is_err());
        assert_eq!(out[2].user_data, 9);
        assert!(matches!(out[2].result, Ok(None)));
        // Empty again: the next completion wakes the reactor again.
        AsyncDone::new(sink.clone(), 10).complete(Ok(None));
        assert_eq!(wakes.load(Ordering::Relaxed), 2);
    }
}
