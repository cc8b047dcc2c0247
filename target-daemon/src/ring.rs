//! A reactor's io_uring: backend I/O and the sockets of its connections.
//!
//! The ring never holds more operations in flight than its completion queue
//! can take, so completions are never dropped; submissions beyond that wait
//! in a bounded backlog (bounded because every entry belongs to a command
//! slot, at most `ZERO_OPS_PER_CMD_MAX` to one, or to a connection, a few
//! each, and both are bounded). The buffers an operation points at belong
//! to command slots or connections, which stay untouched until the
//! operation's completion has been reaped, or are the one shared buffer of
//! zeroes ([`zero_chunk`]), never written.
//!
//! Operations: reads, writes and fdatasync for I/O; fallocate (zero range,
//! punch hole) and writes of zeroes for Write Zeroes and deallocate; for
//! sockets, multishot receives into [`RecvBufs`] (a provided-buffer ring),
//! `sendmsg` of a connection's [`SendMsg`], one-shot polls (RDMA channels),
//! a read of the reactor's [`Wakeup`] eventfd, and cancellations.
//!
//! A multishot receive is one operation with many completions: only its
//! last (without `IORING_CQE_F_MORE`) ends it. Every earlier one carries a
//! provided buffer, so the completion queue is sized for the operations in
//! flight plus one completion per provided buffer.

use crate::backend::AlignedBuf;
use crate::limits::ZERO_WRITE_CHUNK_BYTES;
use io_uring::types::{BufRingEntry, CancelBuilder, Fd, SubmitArgs, Timespec};
use io_uring::{cqueue, opcode, squeue, IoUring, Probe};
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, RawFd};

pub use nvpool_rt::Wakeup;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// One completion: user data, result, flags (`IORING_CQE_F_*`).
pub type Completion = (u64, i32, u32);

pub struct Ring {
    uring: IoUring,
    backlog: VecDeque<squeue::Entry>,
    /// Operations whose last completion has not been reaped.
    inflight: u32,
    /// Most operations in flight at once: the completion queue less one
    /// entry per provided receive buffer.
    cq_capacity: u32,
    /// Where the eventfd read of [`Ring::push_wake_read`] lands: the
    /// ring's own, so it lives as long as the operation can.
    wake_buf: Box<u64>,
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

/// Opcodes the reactor's sockets need (with multishot receive, probed by
/// trying it: [`RecvBufs::new`]).
const REQUIRED_SOCKETS: [(u8, &str); 5] = [
    (opcode::RecvMulti::CODE, "recv"),
    (opcode::SendMsg::CODE, "sendmsg"),
    (opcode::PollAdd::CODE, "poll_add"),
    (opcode::AsyncCancel::CODE, "async_cancel"),
    (opcode::Read::CODE, "read"),
];

fn unsupported(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, what)
}

impl Ring {
    /// Creates a ring and checks the kernel supports every opcode the
    /// backends use.
    pub fn new(entries: u32) -> io::Result<Ring> {
        Self::build(entries, &REQUIRED)
    }

    /// Creates a reactor's ring: backend opcodes and socket opcodes.
    pub fn for_reactor(entries: u32) -> io::Result<Ring> {
        let r = Self::build(entries, &REQUIRED)?;
        r.check(&REQUIRED_SOCKETS)?;
        Ok(r)
    }

    fn build(entries: u32, required: &[(u8, &str)]) -> io::Result<Ring> {
        // Twice the submission entries: room for the completions of
        // multishot receives beside those of every operation in flight.
        let uring = IoUring::builder()
            .setup_cqsize(entries.saturating_mul(2))
            .build(entries)?;
        let cq_capacity = uring.params().cq_entries();
        let r = Ring {
            uring,
            backlog: VecDeque::new(),
            inflight: 0,
            cq_capacity,
            wake_buf: Box::new(0),
        };
        r.check(required)?;
        Ok(r)
    }

    fn check(&self, required: &[(u8, &str)]) -> io::Result<()> {
        let mut probe = Probe::new();
        self.uring.submitter().register_probe(&mut probe)?;
        for &(code, name) in required {
            if !probe.is_supported(code) {
                return Err(unsupported(format!("io_uring lacks the {name} opcode")));
            }
        }
        Ok(())
    }

    /// Queues an operation.
    ///
    /// # Safety
    /// Every buffer the entry points at must stay valid, and not be moved or
    /// accessed, until its last completion is returned by [`Ring::reap`].
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
    }

    /// Submits queued entries to the kernel without waiting.
    pub fn submit(&mut self) -> io::Result<()> {
        self.drain_backlog();
        if self.uring.submission().is_empty() {
            return Ok(());
        }
        match self.uring.submit() {
            Ok(_) => Ok(()),
            Err(e) => Self::benign(e),
        }
    }

    /// Submits queued entries and sleeps until a completion arrives or
    /// `timeout` passes, in one `io_uring_enter`.
    pub fn submit_and_wait(&mut self, timeout: Duration) -> io::Result<()> {
        self.drain_backlog();
        let ts = Timespec::from(timeout);
        let args = SubmitArgs::new().timespec(&ts);
        match self.uring.submitter().submit_with_args(1, &args) {
            Ok(_) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ETIME) => Ok(()),
            Err(e) => Self::benign(e),
        }
    }

    /// Errors of `io_uring_enter` that only mean "not now".
    fn benign(e: io::Error) -> io::Result<()> {
        match e.raw_os_error() {
            // The kernel is short of room (the entries stay queued and go
            // with the next submit), or a signal came.
            Some(libc::EBUSY | libc::EAGAIN | libc::EINTR) => Ok(()),
            _ => Err(e),
        }
    }

    /// A completion is waiting (no system call).
    pub fn has_completions(&mut self) -> bool {
        !self.uring.completion().is_empty()
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
        }
    }

    /// Takes every available completion.
    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        for cqe in self.uring.completion() {
            let flags = cqe.flags();
            // An operation ends with its last completion; the kernel
            // counted it, so saturating only guards against surprises.
            if !cqueue::more(flags) {
                self.inflight = self.inflight.saturating_sub(1);
            }
            out.push((cqe.user_data(), cqe.result(), flags));
        }
    }

    pub fn busy(&self) -> bool {
        self.inflight > 0 || !self.backlog.is_empty()
    }

    /// Arms a multishot receive on socket `fd` into `bufs`. Each
    /// completion with data names the provided buffer holding it
    /// ([`cqueue::buffer_select`]), to be given back with
    /// [`RecvBufs::recycle`].
    pub fn push_recv(&mut self, fd: RawFd, bufs: &RecvBufs, user_data: u64) {
        let e = opcode::RecvMulti::new(Fd(fd), bufs.group)
            .build()
            .user_data(user_data);
        // SAFETY: the operation writes only into provided buffers, which
        // RecvBufs keeps until the ring is idle (see its Drop).
        unsafe { self.push(e) }
    }

    /// Sends the first `n` iovecs of `m` on socket `fd`.
    ///
    /// # Safety
    /// `m` and the memory its iovecs point at must stay valid and unchanged
    /// until the operation's completion is reaped.
    pub unsafe fn push_send(&mut self, fd: RawFd, m: &mut SendMsg, n: usize, user_data: u64) {
        m.msg.msg_iov = m.iov.as_mut_ptr();
        m.msg.msg_iovlen = n.min(m.iov.len()) as _;
        let e = opcode::SendMsg::new(Fd(fd), &*m.msg)
            .flags(libc::MSG_NOSIGNAL as u32)
            .build()
            .user_data(user_data);
        // SAFETY: the caller keeps `m` and the iovecs' memory alive.
        unsafe { self.push(e) }
    }

    /// Waits once for `fd` to be readable.
    pub fn push_poll(&mut self, fd: RawFd, user_data: u64) {
        let e = opcode::PollAdd::new(Fd(fd), libc::POLLIN as u32)
            .build()
            .user_data(user_data);
        // SAFETY: a poll points at no memory.
        unsafe { self.push(e) }
    }

    /// Cancels the operation whose user data is `target`.
    pub fn push_cancel(&mut self, target: u64, user_data: u64) {
        let e = opcode::AsyncCancel::new(target)
            .build()
            .user_data(user_data);
        // SAFETY: a cancellation points at no memory.
        unsafe { self.push(e) }
    }

    /// Cancels every operation in flight (the reactor is stopping).
    pub fn push_cancel_all(&mut self, user_data: u64) {
        let e = opcode::AsyncCancel2::new(CancelBuilder::any())
            .build()
            .user_data(user_data);
        // SAFETY: a cancellation points at no memory.
        unsafe { self.push(e) }
    }

    /// Reads the counter of `w` (completes when something woke it).
    pub fn push_wake_read(&mut self, w: &Wakeup, user_data: u64) {
        let e = opcode::Read::new(
            Fd(w.as_raw_fd()),
            (&mut *self.wake_buf as *mut u64).cast(),
            8,
        )
        .build()
        .user_data(user_data);
        // SAFETY: wake_buf belongs to the ring and is leaked with it if the
        // ring is dropped busy (Drop).
        unsafe { self.push(e) }
    }

    /// Waits (at most `limit`) until nothing is in flight, reaping into
    /// `out`. True when idle.
    pub fn wait_idle(&mut self, limit: Duration, out: &mut Vec<Completion>) -> bool {
        let end = Instant::now() + limit;
        loop {
            self.reap(out);
            if !self.busy() {
                return true;
            }
            let now = Instant::now();
            if now >= end || self.submit_and_wait(end - now).is_err() {
                self.reap(out);
                return !self.busy();
            }
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        if self.busy() {
            // The kernel may still complete an operation after the ring's
            // descriptor closes: keep what it could write into.
            Box::leak(std::mem::replace(&mut self.wake_buf, Box::new(0)));
        }
    }
}

/// The iovecs and message header of one connection's send in flight, at
/// stable addresses (boxed).
pub struct SendMsg {
    iov: Box<[libc::iovec; crate::tx::IOV_MAX]>,
    msg: Box<libc::msghdr>,
}

// SAFETY: the raw pointers point into memory owned by the same connection
// (its Tx and command slots), which lives and is used on one reactor thread;
// the value only moves between threads before any of it is used.
unsafe impl Send for SendMsg {}

impl std::fmt::Debug for SendMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SendMsg")
    }
}

impl Default for SendMsg {
    fn default() -> Self {
        SendMsg {
            iov: Box::new(
                [libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                }; crate::tx::IOV_MAX],
            ),
            // SAFETY: msghdr is plain data (pointers and integers); all
            // zeroes is an empty message.
            msg: Box::new(unsafe { std::mem::zeroed() }),
        }
    }
}

impl SendMsg {
    /// The iovecs to fill before [`Ring::push_send`].
    pub fn iov(&mut self) -> &mut [libc::iovec] {
        &mut self.iov[..]
    }
}

/// Sends `iov` on `fd` now without blocking (a closing connection's last
/// words). Ok(0): nothing was taken.
pub fn send_now(fd: RawFd, iov: &[libc::iovec]) -> io::Result<usize> {
    // SAFETY: msghdr is plain data; zeroes are an empty message.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len() as _;
    // SAFETY: msg points at `iov`, whose entries point at live memory the
    // caller lent for the call only.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// A reactor's provided-buffer ring (`IORING_REGISTER_PBUF_RING`): the
/// buffers multishot receives fill. A completion owns its buffer until
/// [`RecvBufs::recycle`] gives it back; when all are taken, receives end
/// with `ENOBUFS` until some come back.
pub struct RecvBufs {
    /// The ring of entries the kernel takes buffers from (page-aligned,
    /// mapped).
    entries: *mut BufRingEntry,
    entries_len: usize,
    mem: *mut u8,
    mem_len: usize,
    count: u16,
    size: u32,
    group: u16,
    /// Our tail (entries published up to it).
    tail: u16,
    /// The kernel may still write into the buffers: never unmap them.
    leak: bool,
}

// SAFETY: the mappings are owned by this value alone and used by one
// reactor thread; it moves between threads only before first use.
unsafe impl Send for RecvBufs {}

impl std::fmt::Debug for RecvBufs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvBufs")
            .field("count", &self.count)
            .field("size", &self.size)
            .finish()
    }
}

fn map(len: usize) -> io::Result<*mut u8> {
    // SAFETY: an anonymous private mapping touches no existing memory.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(p.cast())
}

const RECV_PROBE: u64 = u64::MAX - 1;
const RECV_PROBE_CANCEL: u64 = u64::MAX - 2;

impl RecvBufs {
    /// Maps `count` buffers of `size` bytes, registers them with `ring` as
    /// buffer group `group`, and checks that the kernel has multishot
    /// receive (Linux 6.0) by trying one on a socket pair.
    pub fn new(ring: &mut Ring, count: u16, size: u32, group: u16) -> io::Result<RecvBufs> {
        assert!(
            count.is_power_of_two(),
            "a buffer ring's size is a power of two"
        );
        // Completions that carry a buffer need room of their own.
        assert!(
            u32::from(count) < ring.cq_capacity,
            "completion queue too small"
        );
        let entries_len = usize::from(count) * std::mem::size_of::<BufRingEntry>();
        let mem_len = usize::from(count) * size as usize;
        let entries = map(entries_len)?.cast::<BufRingEntry>();
        let mem = match map(mem_len) {
            Ok(m) => m,
            Err(e) => {
                // SAFETY: unmaps the mapping made just above.
                unsafe { libc::munmap(entries.cast(), entries_len) };
                return Err(e);
            }
        };
        let mut b = RecvBufs {
            entries,
            entries_len,
            mem,
            mem_len,
            count,
            size,
            group,
            tail: 0,
            leak: false,
        };
        // SAFETY: `entries` is a page-aligned mapping of `count` entries that
        // outlives the registration (unregistered in Drop, or leaked).
        unsafe {
            ring.uring
                .submitter()
                .register_buf_ring_with_flags(entries as u64, count, group, 0)
        }
        .map_err(|e| {
            unsupported(format!(
                "io_uring provided-buffer rings are unavailable ({e}); Linux 6.0 or later is needed"
            ))
        })?;
        // Completions that carry a buffer take room of their own.
        ring.cq_capacity -= u32::from(count);
        for bid in 0..count {
            b.recycle(bid);
        }
        b.publish();
        b.probe_multishot(ring)?;
        Ok(b)
    }

    /// Tries a multishot receive on a socket pair: supported if the first
    /// completion carries the byte and says more will come.
    fn probe_multishot(&mut self, ring: &mut Ring) -> io::Result<()> {
        let (a, b) = std::os::unix::net::UnixStream::pair()?;
        ring.push_recv(a.as_raw_fd(), self, RECV_PROBE);
        io::Write::write_all(&mut &b, &[1])?;
        let mut out = Vec::new();
        let end = Instant::now() + Duration::from_secs(2);
        let mut verdict = None;
        let mut armed = true;
        while armed && Instant::now() < end {
            if let Err(e) = ring.submit_and_wait(Duration::from_millis(100)) {
                // The probe may still be in the ring: its buffers must stay.
                self.leak = true;
                return Err(e);
            }
            out.clear();
            ring.reap(&mut out);
            for &(ud, res, flags) in &out {
                if ud != RECV_PROBE {
                    continue;
                }
                if let Some(bid) = cqueue::buffer_select(flags) {
                    self.recycle(bid);
                    self.publish();
                }
                if !cqueue::more(flags) {
                    armed = false;
                }
                if verdict.is_none() {
                    verdict = Some(res == 1 && cqueue::more(flags));
                    if armed {
                        ring.push_cancel(RECV_PROBE, RECV_PROBE_CANCEL);
                        let _ = a.shutdown(std::net::Shutdown::Both);
                    }
                }
            }
        }
        if armed {
            // The probe is still in the ring: its buffers must never go.
            self.leak = true;
            return Err(unsupported(
                "io_uring multishot receive did not answer".into(),
            ));
        }
        match verdict {
            Some(true) => Ok(()),
            _ => Err(unsupported(
                "io_uring lacks multishot receive (Linux 6.0 or later is needed)".into(),
            )),
        }
    }

    /// The first `len` bytes of buffer `bid` (what a completion received).
    /// None for an id or length the ring never gave.
    pub fn get(&self, bid: u16, len: usize) -> Option<&[u8]> {
        if bid >= self.count || len > self.size as usize {
            return None;
        }
        let off = usize::from(bid) * self.size as usize;
        // SAFETY: the buffer lies inside the mapping; the completion that
        // named it handed it to us, so the kernel does not write it until
        // it is recycled.
        Some(unsafe { std::slice::from_raw_parts(self.mem.add(off), len) })
    }

    /// Gives buffer `bid` back (visible to the kernel at [`publish`]).
    ///
    /// [`publish`]: RecvBufs::publish
    pub fn recycle(&mut self, bid: u16) {
        if bid >= self.count {
            return;
        }
        let i = usize::from(self.tail & (self.count - 1));
        // SAFETY: i < count; the entry at our tail is not the kernel's
        // (it reads only entries before the published tail), and every
        // buffer is given back once, so the ring never overflows.
        let e = unsafe { &mut *self.entries.add(i) };
        // SAFETY: the offset lies inside the mapping.
        e.set_addr(unsafe { self.mem.add(usize::from(bid) * self.size as usize) } as u64);
        e.set_len(self.size);
        e.set_bid(bid);
        self.tail = self.tail.wrapping_add(1);
    }

    /// Makes the recycled buffers visible to the kernel.
    pub fn publish(&mut self) {
        // SAFETY: the tail field lies in the first entry of our mapping;
        // the kernel reads it concurrently, hence the atomic store.
        let tail = unsafe { &*BufRingEntry::tail(self.entries).cast::<AtomicU16>() };
        tail.store(self.tail, Ordering::Release);
    }

    /// The kernel may still write into the buffers (the ring did not go
    /// idle): keep the memory mapped forever.
    pub fn leak(&mut self) {
        self.leak = true;
    }
}

impl Drop for RecvBufs {
    fn drop(&mut self) {
        if self.leak {
            return;
        }
        // SAFETY: both mappings are ours; nothing in the ring uses them
        // (the reactor waited for it to go idle, else it called leak()).
        unsafe {
            libc::munmap(self.mem.cast(), self.mem_len);
            libc::munmap(self.entries.cast(), self.entries_len);
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn reap_until(ring: &mut Ring, want: impl Fn(&[Completion]) -> bool) -> Vec<Completion> {
        let mut all = Vec::new();
        let end = Instant::now() + Duration::from_secs(5);
        while !want(&all) {
            assert!(Instant::now() < end, "completions did not come: {all:?}");
            ring.submit_and_wait(Duration::from_millis(50)).unwrap();
            ring.reap(&mut all);
        }
        all
    }

    /// Receives take provided buffers until none is left (ENOBUFS ends the
    /// receive), and a receive armed again after the buffers came back
    /// gets the bytes that waited in the socket.
    #[test]
    fn receives_stop_when_buffers_run_out_and_resume_when_they_return() {
        const UD: u64 = 7;
        let mut ring = Ring::for_reactor(64).unwrap();
        let mut bufs = RecvBufs::new(&mut ring, 2, 4096, 3).unwrap();
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        ring.push_recv(a.as_raw_fd(), &bufs, UD);
        let mut got = Vec::new();
        let mut held = Vec::new();
        // Three sends: two fill the two buffers, the third finds none.
        for i in 0..3u8 {
            b.write_all(&[i; 100]).unwrap();
            if i < 2 {
                // One completion per send: the kernel takes one buffer each.
                reap_until(&mut ring, |c| !c.is_empty())
                    .into_iter()
                    .for_each(|(ud, res, flags)| {
                        assert_eq!((ud, res), (UD, 100));
                        assert!(cqueue::more(flags));
                        let bid = cqueue::buffer_select(flags).expect("a buffer");
                        got.extend_from_slice(bufs.get(bid, 100).unwrap());
                        held.push(bid);
                    });
            }
        }
        assert_eq!(got, [[0u8; 100], [1u8; 100]].concat());
        let ended = reap_until(&mut ring, |c| !c.is_empty());
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0].0, UD);
        assert_eq!(
            ended[0].1,
            -libc::ENOBUFS,
            "the receive ends for want of buffers"
        );
        assert!(!cqueue::more(ended[0].2));
        for bid in held {
            bufs.recycle(bid);
        }
        bufs.publish();
        ring.push_recv(a.as_raw_fd(), &bufs, UD);
        let done = reap_until(&mut ring, |c| c.iter().any(|&(_, r, _)| r > 0));
        let (_, res, flags) = done.into_iter().find(|&(_, r, _)| r > 0).unwrap();
        let bid = cqueue::buffer_select(flags).unwrap();
        assert_eq!(bufs.get(bid, res as usize).unwrap(), &[2u8; 100][..]);
        bufs.recycle(bid);
        bufs.publish();
        // Closing the peer ends the receive with 0; the ring goes idle.
        drop(b);
        reap_until(&mut ring, |c| {
            c.iter().any(|&(_, r, f)| r == 0 && !cqueue::more(f))
        });
        let mut rest = Vec::new();
        assert!(ring.wait_idle(Duration::from_secs(2), &mut rest));
    }

    /// A wake-up completes the eventfd read the reactor keeps in the ring.
    #[test]
    fn a_wakeup_completes_the_eventfd_read() {
        let mut ring = Ring::for_reactor(8).unwrap();
        let w = Wakeup::new().unwrap();
        ring.push_wake_read(&w, 1);
        ring.submit().unwrap();
        let mut out = Vec::new();
        ring.reap(&mut out);
        assert!(out.is_empty(), "nothing woke it yet");
        w.wake();
        let done = reap_until(&mut ring, |c| !c.is_empty());
        assert_eq!(done, vec![(1, 8, 0)]);
        assert!(!ring.busy());
    }
}
