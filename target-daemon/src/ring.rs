//! A reactor's io_uring for backend I/O.
//!
//! The ring never holds more operations in flight than its completion queue
//! can take, so completions are never dropped; submissions beyond that wait
//! in a bounded backlog (bounded because every entry belongs to a command
//! slot, at most `ZERO_OPS_PER_CMD_MAX` to one, and slots are bounded per
//! connection). The buffers an operation points at belong to command slots,
//! which stay untouched until the operation's completion has been reaped,
//! or are the one shared buffer of zeroes ([`zero_chunk`]), never written.
//!
//! Operations: reads, writes and fdatasync for I/O; fallocate (zero range,
//! punch hole) and writes of zeroes for Write Zeroes and deallocate.

use crate::backend::AlignedBuf;
use crate::limits::ZERO_WRITE_CHUNK_BYTES;
use io_uring::{opcode, squeue, IoUring, Probe};
use std::collections::VecDeque;
use std::io;
use std::sync::OnceLock;

pub struct Ring {
    uring: IoUring,
    backlog: VecDeque<squeue::Entry>,
    inflight: u32,
    cq_capacity: u32,
    /// Entries pushed since the last submit (no syscall when zero).
    unsubmitted: u32,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("inflight", &self.inflight)
            .field("backlog", &self.backlog.len())
            .finish()
    }
}

/// Opcodes the data path needs from the kernel.
const REQUIRED: [(u8, &str); 4] = [
    (opcode::Read::CODE, "read"),
    (opcode::Write::CODE, "write"),
    (opcode::Fsync::CODE, "fsync"),
    (opcode::Fallocate::CODE, "fallocate"),
];

impl Ring {
    /// Creates a ring and checks the kernel supports every opcode we use.
    pub fn new(entries: u32) -> io::Result<Ring> {
        let uring = IoUring::builder().build(entries)?;
        let mut probe = Probe::new();
        uring.submitter().register_probe(&mut probe)?;
        for (code, name) in REQUIRED {
            if !probe.is_supported(code) {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("io_uring lacks the {name} opcode"),
                ));
            }
        }
        let cq_capacity = uring.params().cq_entries();
        Ok(Ring {
            uring,
            backlog: VecDeque::new(),
            inflight: 0,
            cq_capacity,
            unsubmitted: 0,
        })
    }

    /// Registers an eventfd that becomes readable when completions arrive.
    pub fn register_eventfd(&self, fd: std::os::fd::RawFd) -> io::Result<()> {
        self.uring.submitter().register_eventfd(fd)
    }

    /// Queues an operation.
    ///
    /// # Safety
    /// Every buffer the entry points at must stay valid, and not be moved or
    /// accessed, until its completion is returned by [`Ring::reap`].
    pub unsafe fn push(&mut self, e: squeue::Entry) {
        if !self.backlog.is_empty() || self.inflight >= self.cq_capacity {
            self.backlog.push_back(e);
            return;
        }
        // SAFETY: the caller upholds the buffer contract.
        if unsafe { self.uring.submission().push(&e) }.is_err() {
            self.backlog.push_back(e);
            return;
        }
        self.inflight += 1;
        self.unsubmitted += 1;
    }

    /// Submits queued entries to the kernel without waiting.
    pub fn submit(&mut self) -> io::Result<()> {
        self.drain_backlog();
        if self.unsubmitted == 0 {
            return Ok(());
        }
        match self.uring.submit() {
            Ok(n) => {
                self.unsubmitted = self.unsubmitted.saturating_sub(n as u32);
                Ok(())
            }
            // The kernel is short of room; the entries stay queued and go
            // with the next submit.
            Err(e)
                if e.raw_os_error() == Some(libc::EBUSY)
                    || e.raw_os_error() == Some(libc::EAGAIN) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    fn drain_backlog(&mut self) {
        while self.inflight < self.cq_capacity {
            let Some(e) = self.backlog.pop_front() else {
                break;
            };
            // SAFETY: entries in the backlog were pushed under push()'s contract.
            if unsafe { self.uring.submission().push(&e) }.is_err() {
                self.backlog.push_front(e);
                break;
            }
            self.inflight += 1;
            self.unsubmitted += 1;
        }
    }

    /// Takes every available completion as (user_data, result).
    pub fn reap(&mut self, out: &mut Vec<(u64, i32)>) {
        for cqe in self.uring.completion() {
            // Every completion is of an entry pushed to the kernel, which
            // counted it; saturating so a kernel surprise cannot wrap it.
            self.inflight = self.inflight.saturating_sub(1);
            out.push((cqe.user_data(), cqe.result()));
        }
    }

    pub fn busy(&self) -> bool {
        self.inflight > 0 || !self.backlog.is_empty()
    }
}

/// The buffer of zeroes that zero writes (Write Zeroes or deallocate where
/// no fallocate mode zeroes) read from: [`ZERO_WRITE_CHUNK_BYTES`], aligned
/// for O_DIRECT, shared by every ring of the process.
struct ZeroChunk(AlignedBuf);

// SAFETY: the buffer is zeroed when allocated and never written or freed
// afterwards (it lives in a static); any number of threads and kernels may
// read it at once.
unsafe impl Sync for ZeroChunk {}

/// The address of the shared buffer of zeroes ([`ZERO_WRITE_CHUNK_BYTES`]
/// bytes, valid for the life of the process, never written).
pub fn zero_chunk() -> *const u8 {
    static ZEROES: OnceLock<ZeroChunk> = OnceLock::new();
    ZEROES
        .get_or_init(|| ZeroChunk(AlignedBuf::new(ZERO_WRITE_CHUNK_BYTES)))
        .0
        .as_ptr()
}
