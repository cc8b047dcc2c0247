//! One NVMe/RDMA connection from the host side: an RC queue pair set up
//! through RDMA CM, with the receive buffers for responses and per-slot
//! bounce buffers for data, all in one region registered once.
//!
//! ```text
//!  region: [ HRQSIZE × 16 B responses | slots × 64 B SQEs | slots × max transfer data ]
//!
//!  command:  SQE (keyed SGL 0x40 → slot's data buffer) ── SEND ──────────▶
//!  write:    bytes copied into the slot buffer first;   ◀── RDMA READ ──
//!  read:     slot buffer filled by the controller       ◀── RDMA WRITE ─
//!  response: 16 B                                       ◀── SEND ───────  (receive re-posted)
//! ```
//!
//! A userspace host cannot fast-register memory, so it offers the keys of
//! its ordinary registration with subtype 0h (0x40) and never 0x4F: with
//! 0x4F the Linux target answers with SEND with Invalidate of that key,
//! which soft-RoCE refuses for a non-fast-registration MR and kills the
//! queue pair.
//!
//! Completions are reaped until the CQ is empty and armed, so whoever waits
//! on [`RdmaConn::fd`] (an epoll set of the completion channel and the CM
//! event channel) is woken by the next completion or CM event.

use crate::error::Error;
use crate::limits::RDMA_SEND_ROOM_WAIT;
use crate::link::{poll_fd, poll_ms};
use nvpool_rdma::{event, CmId, Endpoint, EventChannel, Mr, QpSize, SendKind, SendWr, Wc};
use nvpool_wire::rdma::{CmRequest, KeyedSgl, RESPONSE_LEN};
use nvpool_wire::{Cqe, Sqe};
use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

/// Bytes of one command capsule (no in-capsule data: keyed SGLs only).
const SQE_BYTES: usize = 64;
/// Data buffers start on a page boundary.
const PAGE_BYTES: usize = 4096;
/// Work completions taken per poll call.
const WC_BATCH: usize = 32;
/// wr_id bit telling receives from sends.
const WR_RECV: u64 = 1 << 63;

/// What a command moves, from the host's point of view.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Data<'a> {
    None,
    /// Host to controller (the controller RDMA-READs it).
    Out(&'a [u8]),
    /// Controller to host, this many bytes (the controller RDMA-WRITEs them).
    In(usize),
}

/// The CM private data of a queue's connect request: HRQSIZE = `entries`
/// receive buffers, HSQSIZE = `entries - 1` (0's based), and for I/O queues
/// the admin queue's controller ID.
pub(crate) fn cm_request(qid: u16, entries: u16, cntlid: u16) -> CmRequest {
    CmRequest {
        recfmt: 0,
        qid,
        hrqsize: entries,
        hsqsize: entries - 1,
        cntlid: if qid == 0 { 0 } else { cntlid },
    }
}

/// The keyed descriptor of a command's data in a registered buffer;
/// address 0, length 0, key 0 when it has none.
pub(crate) fn keyed_sgl(addr: u64, rkey: u32, len: usize) -> KeyedSgl {
    if len == 0 {
        KeyedSgl {
            addr: 0,
            len: 0,
            key: 0,
            invalidate: false,
        }
    } else {
        KeyedSgl {
            addr,
            len: len as u32,
            key: rkey,
            invalidate: false,
        }
    }
}

/// Offsets in the registered region.
#[derive(Debug, Clone, Copy)]
struct Layout {
    recvs: usize,
    sqes: usize,
    data: usize,
    slot_bytes: usize,
    total: usize,
}

impl Layout {
    fn new(hrqsize: usize, slots: usize, slot_bytes: usize) -> Layout {
        let sqes = hrqsize * RESPONSE_LEN;
        let data = (sqes + slots * SQE_BYTES).next_multiple_of(PAGE_BYTES);
        Layout {
            recvs: 0,
            sqes,
            data,
            slot_bytes,
            total: data + slots * slot_bytes,
        }
    }
    fn recv(&self, i: usize) -> usize {
        self.recvs + i * RESPONSE_LEN
    }
    fn sqe(&self, slot: usize) -> usize {
        self.sqes + slot * SQE_BYTES
    }
    fn data(&self, slot: usize) -> usize {
        self.data + slot * self.slot_bytes
    }
}

/// One connected NVMe/RDMA queue.
#[derive(Debug)]
pub struct RdmaConn {
    // Dropped in this order: the registration, then the queue pair, CQ, PD
    // and CM id, then the CM channel, and only then the memory.
    mr: Mr,
    ep: Endpoint,
    ch: EventChannel,
    mem: Box<[u8]>,
    /// epoll set of the completion channel and the CM channel.
    waiter: OwnedFd,
    pub addr: SocketAddr,
    layout: Layout,
    hrqsize: usize,
    slots: usize,
    /// Send work requests posted and not yet completed, and the limit.
    sends: u32,
    send_cap: u32,
    /// Whether the CQ is armed (a completion will raise an event).
    armed: bool,
    /// Responses received and not yet taken.
    pending: VecDeque<Cqe>,
    /// A failure seen while posting, reported by the next pump.
    broken: Option<Error>,
}

impl RdmaConn {
    /// Connects queue `req.qid` to `addr`: resolves the address and route,
    /// creates the queue pair, registers `slots` data buffers of
    /// `slot_bytes`, posts `req.hrqsize` receives and connects with `req`
    /// as private data.
    pub(crate) fn connect(
        addr: SocketAddr,
        req: CmRequest,
        slots: usize,
        slot_bytes: usize,
        timeout: Duration,
    ) -> Result<RdmaConn, Error> {
        nvpool_rdma::available().map_err(Error::RdmaUnavailable)?;
        assert!(slots >= 1 && req.hrqsize >= 1, "an RDMA queue has slots");
        let deadline = Instant::now() + timeout;
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        let cerr = |what: &str, e: io::Error| Error::Connect {
            addr: addr.to_string(),
            source: io::Error::new(e.kind(), format!("RDMA {what}: {e}")),
        };
        let ch = EventChannel::new().map_err(|e| cerr("event channel", e))?;
        let id = CmId::new(&ch).map_err(|e| cerr("CM id", e))?;
        id.resolve_addr(None, addr, ms)
            .map_err(|e| cerr("address resolution", e))?;
        wait_event(&ch, addr, deadline, event::ADDR_RESOLVED)?;
        let hrqsize = req.hrqsize as usize;
        let send_cap = 2 * slots as u32 + 2;
        let ep = Endpoint::new(
            id,
            QpSize {
                send_wr: send_cap,
                recv_wr: hrqsize as u32,
                inline: 0,
            },
        )
        .map_err(|e| cerr("queue pair", e))?;
        ep.id()
            .resolve_route(ms)
            .map_err(|e| cerr("route resolution", e))?;
        wait_event(&ch, addr, deadline, event::ROUTE_RESOLVED)?;

        let layout = Layout::new(hrqsize, slots, slot_bytes);
        let mut mem = vec![0u8; layout.total].into_boxed_slice();
        // SAFETY: `mem` lives in this connection and is dropped after the
        // registration and the queue pair (field order); nothing is posted
        // yet.
        let mr = unsafe { ep.register(mem.as_mut_ptr(), mem.len()) }
            .map_err(|e| cerr("memory registration", e))?;
        let waiter =
            nvpool_rt::wake::epoll_of(&[ep.comp_fd(), ch.fd()]).map_err(|e| cerr("epoll", e))?;
        let c = RdmaConn {
            mr,
            ep,
            ch,
            mem,
            waiter,
            addr,
            layout,
            hrqsize,
            slots,
            sends: 0,
            send_cap,
            armed: true,
            pending: VecDeque::with_capacity(hrqsize),
            broken: None,
        };
        for i in 0..hrqsize {
            c.post_recv(i).map_err(|e| cerr("posting receives", e))?;
        }
        let rr = c.ep.max_init_rd_atom.clamp(1, u8::MAX as u32) as u8;
        c.ep.connect(&req.encode(), rr)
            .map_err(|e| cerr("connect", e))?;
        wait_event(&c.ch, addr, deadline, event::ESTABLISHED)?;
        tracing::debug!(%addr, qid = req.qid, hrqsize, slots, "RDMA queue connected");
        Ok(c)
    }

    fn post_recv(&self, i: usize) -> io::Result<()> {
        let mr = &self.mr;
        self.ep.post_recv(
            WR_RECV | i as u64,
            mr.addr + self.layout.recv(i) as u64,
            RESPONSE_LEN as u32,
            mr.lkey,
        )
    }

    fn io_err(&self, what: String) -> Error {
        Error::Io {
            addr: self.addr.to_string(),
            source: io::Error::other(what),
        }
    }

    fn proto(&self, what: impl Into<String>) -> Error {
        Error::Protocol {
            addr: self.addr.to_string(),
            what: what.into(),
        }
    }

    /// Largest data transfer of one command.
    pub fn max_data(&self) -> usize {
        self.layout.slot_bytes
    }

    /// Sends the command of `slot` (its SQE gets the keyed SGL of the
    /// slot's buffer); write data is copied into that buffer first. A
    /// failure shows at the next [`RdmaConn::pump`].
    pub(crate) fn send_command(&mut self, mut sqe: Sqe, slot: usize, data: Data<'_>) {
        assert!(slot < self.slots, "slot {slot} out of {}", self.slots);
        let len = match data {
            Data::None => 0,
            Data::Out(b) => b.len(),
            Data::In(n) => n,
        };
        assert!(
            len <= self.layout.slot_bytes,
            "transfer beyond the slot buffer"
        );
        let (base, lkey, rkey) = (self.mr.addr, self.mr.lkey, self.mr.rkey);
        let at = self.layout.data(slot);
        if let Data::Out(b) = data {
            self.mem[at..at + b.len()].copy_from_slice(b);
        }
        keyed_sgl(base + at as u64, rkey, len).put(&mut sqe);
        let so = self.layout.sqe(slot);
        self.mem[so..so + SQE_BYTES].copy_from_slice(&sqe.0);
        if self.broken.is_some() {
            return;
        }
        if let Err(e) = self.send_room() {
            self.broken = Some(e);
            return;
        }
        let wr = SendWr {
            wr_id: slot as u64,
            kind: SendKind::Send,
            addr: base + so as u64,
            len: SQE_BYTES as u32,
            lkey,
            remote_addr: 0,
            rkey: 0,
            signaled: true,
            inline: false,
        };
        match self.ep.post_send(&[wr]) {
            Ok(()) => self.sends += 1,
            Err(e) => self.broken = Some(self.io_err(format!("posting a send: {e}"))),
        }
    }

    /// Waits until the send queue has an entry free (normally it has: it
    /// holds two per command slot).
    fn send_room(&mut self) -> Result<(), Error> {
        let until = Instant::now() + RDMA_SEND_ROOM_WAIT;
        while self.sends >= self.send_cap {
            self.reap()?;
            if self.sends < self.send_cap {
                break;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    addr: self.addr.to_string(),
                    what: "RDMA send queue room",
                });
            }
            self.wait(left)?;
        }
        Ok(())
    }

    /// The descriptor to wait on for completions and CM events.
    pub fn fd(&self) -> RawFd {
        self.waiter.as_raw_fd()
    }

    /// Reaps completions until a response is ready (Ok(true)) or `timeout`
    /// passes (Ok(false)). On return the CQ is armed.
    pub fn pump(&mut self, timeout: Duration) -> Result<bool, Error> {
        if let Some(e) = self.broken.take() {
            return Err(e);
        }
        let deadline = Instant::now() + timeout;
        loop {
            self.reap()?;
            if !self.pending.is_empty() {
                return Ok(true);
            }
            self.check_cm()?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            self.wait(left)?;
        }
    }

    /// Waits up to `d` for the completion or CM channel.
    fn wait(&self, d: Duration) -> Result<(), Error> {
        poll_fd(self.fd(), libc::POLLIN, poll_ms(d))
            .map(drop)
            .map_err(|source| Error::Io {
                addr: self.addr.to_string(),
                source,
            })
    }

    /// Takes every completion, leaving the CQ empty and armed.
    fn reap(&mut self) -> Result<(), Error> {
        if self.ep.take_comp_events() > 0 {
            self.armed = false;
        }
        let mut wcs = [Wc::default(); WC_BATCH];
        loop {
            let n = self
                .ep
                .poll(&mut wcs)
                .map_err(|e| self.io_err(format!("polling the CQ: {e}")))?;
            for wc in &wcs[..n] {
                self.on_wc(wc)?;
            }
            if n == 0 {
                if self.armed {
                    return Ok(());
                }
                self.ep
                    .arm()
                    .map_err(|e| self.io_err(format!("arming the CQ: {e}")))?;
                self.armed = true;
            }
        }
    }

    fn on_wc(&mut self, wc: &Wc) -> Result<(), Error> {
        if !wc.ok() {
            return Err(if wc.flushed() {
                self.io_err("queue pair flushed (connection closed)".into())
            } else {
                self.io_err(format!(
                    "{} work completion failed with status {}",
                    if wc.is_recv { "receive" } else { "send" },
                    wc.status
                ))
            });
        }
        if !wc.is_recv {
            self.sends = self.sends.saturating_sub(1);
            return Ok(());
        }
        let i = (wc.wr_id & !WR_RECV) as usize;
        if wc.wr_id & WR_RECV == 0 || i >= self.hrqsize {
            return Err(self.proto(format!("receive with unknown id {:#x}", wc.wr_id)));
        }
        if (wc.byte_len as usize) < RESPONSE_LEN {
            return Err(self.proto(format!("response of {} bytes", wc.byte_len)));
        }
        if let Some(key) = wc.invalidated {
            // We never offer a key for invalidation (0x40 only).
            return Err(self.proto(format!("controller invalidated key {key:#x} unasked")));
        }
        let at = self.layout.recv(i);
        let cqe = Cqe::decode(&self.mem[at..at + RESPONSE_LEN])
            .map_err(|e| self.proto(format!("bad response: {e}")))?;
        if self.pending.len() >= 2 * self.hrqsize {
            return Err(self.proto("more responses than commands"));
        }
        self.pending.push_back(cqe);
        self.post_recv(i)
            .map_err(|e| self.io_err(format!("re-posting a receive: {e}")))
    }

    /// Notices a disconnect (the controller may close a queue pair while
    /// nothing is posted that would fail).
    fn check_cm(&mut self) -> Result<(), Error> {
        while let Some(ev) = self
            .ch
            .next()
            .map_err(|e| self.io_err(format!("reading CM events: {e}")))?
        {
            if ev.kind == event::DISCONNECTED || ev.kind == event::DEVICE_REMOVAL {
                return Err(self.io_err(format!("RDMA CM: {}", ev.name())));
            }
            tracing::debug!(addr = %self.addr, event = %ev.name(), "RDMA CM event ignored");
        }
        Ok(())
    }

    /// The next response, if one arrived.
    pub fn next_response(&mut self) -> Option<Cqe> {
        self.pending.pop_front()
    }

    /// Copies the data the controller wrote for `slot` into `dst`.
    pub fn placed(&self, slot: usize, dst: &mut [u8]) -> usize {
        let at = self.layout.data(slot);
        let n = dst.len().min(self.layout.slot_bytes);
        dst[..n].copy_from_slice(&self.mem[at..at + n]);
        n
    }

    pub fn shutdown(&self) {
        self.ep.id().disconnect();
    }
}

impl Drop for RdmaConn {
    fn drop(&mut self) {
        // The queue pair goes to error and stops touching our memory; then
        // the fields drop in order: the registration before the endpoint
        // (its PD), the memory last.
        self.ep.id().disconnect();
    }
}

/// Waits for CM event `want` on `ch`; any other event is a failure.
fn wait_event(
    ch: &EventChannel,
    addr: SocketAddr,
    deadline: Instant,
    want: u32,
) -> Result<(), Error> {
    let fail = |what: String| Error::Connect {
        addr: addr.to_string(),
        source: io::Error::new(io::ErrorKind::ConnectionRefused, what),
    };
    loop {
        let ev = ch.next().map_err(|e| Error::Connect {
            addr: addr.to_string(),
            source: e,
        })?;
        if let Some(ev) = ev {
            if ev.kind == want {
                return Ok(());
            }
            let detail = match ev.kind {
                event::REJECTED => match ev.reject_status() {
                    Some(sts) => format!(
                        "RDMA connect rejected: NVMe/RDMA status {sts:#x} ({})",
                        reject_name(sts)
                    ),
                    None => format!(
                        "RDMA connect rejected (reason {}): no NVMe/RDMA listener there?",
                        ev.status
                    ),
                },
                event::ADDR_RESOLVED | event::ROUTE_RESOLVED | event::ESTABLISHED => {
                    format!("unexpected RDMA CM event {}", ev.name())
                }
                _ if ev.status < 0 => format!(
                    "RDMA CM {} ({}){}",
                    ev.name(),
                    io::Error::from_raw_os_error(-ev.status),
                    if want == event::ADDR_RESOLVED {
                        ": no RDMA device reaches this address?"
                    } else {
                        ""
                    }
                ),
                _ => format!("RDMA CM {} (status {})", ev.name(), ev.status),
            };
            return Err(fail(detail));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout {
                addr: addr.to_string(),
                what: "RDMA connection setup",
            });
        }
        // A failed wait only means looking again.
        let _ = poll_fd(ch.fd(), libc::POLLIN, poll_ms(left));
    }
}

fn reject_name(sts: u16) -> &'static str {
    use nvpool_wire::rdma::reject::*;
    match sts {
        INVALID_PRIVATE_DATA_LENGTH => "invalid private data length",
        INVALID_RECFMT => "invalid RECFMT",
        INVALID_QID => "invalid QID",
        INVALID_HSQSIZE => "invalid HSQSIZE",
        INVALID_HRQSIZE => "invalid HRQSIZE",
        NO_RESOURCES => "no resources",
        INVALID_IRD => "invalid IRD",
        INVALID_ORD => "invalid ORD",
        INVALID_CNTLID => "invalid CNTLID",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_data_follows_the_linux_host() {
        // Admin: HRQSIZE 32, HSQSIZE 31, no CNTLID.
        let a = cm_request(0, 32, 0xFFFF).encode();
        assert_eq!(&a[..10], &[0, 0, 0, 0, 0x20, 0, 0x1F, 0, 0, 0]);
        assert!(a[10..].iter().all(|&b| b == 0));
        // I/O queue 1 of controller 1, 128 entries.
        let io = cm_request(1, 128, 1).encode();
        assert_eq!(&io[..10], &[0, 0, 1, 0, 0x80, 0, 0x7F, 0, 1, 0]);
    }

    #[test]
    fn keyed_sgls_use_subtype_address_and_a_null_descriptor_without_data() {
        let mut sqe = Sqe::new(nvpool_wire::sqe::nvm::FLUSH, 3);
        keyed_sgl(0xdead_0000, 0x1234, 0).put(&mut sqe);
        assert_eq!(
            &sqe.0[24..40],
            &[0; 15].iter().chain(&[0x40]).copied().collect::<Vec<_>>()[..]
        );
        keyed_sgl(0x1000, 0xabcd_ef01, 4096).put(&mut sqe);
        assert_eq!(&sqe.0[24..32], &0x1000u64.to_le_bytes());
        assert_eq!(&sqe.0[32..35], &[0, 0x10, 0]);
        assert_eq!(&sqe.0[35..39], &0xabcd_ef01u32.to_le_bytes());
        assert_eq!(sqe.0[39], nvpool_wire::rdma::sgl_id::KEYED);
    }

    #[test]
    fn layout_keeps_areas_apart_and_pages_aligned() {
        let l = Layout::new(129, 128, 1 << 20);
        assert_eq!(l.recv(128) + RESPONSE_LEN, l.sqe(0));
        assert!(l.sqe(127) + SQE_BYTES <= l.data(0));
        assert_eq!(l.data(0) % PAGE_BYTES, 0);
        assert_eq!(l.total, l.data(127) + (1 << 20));
    }
}
