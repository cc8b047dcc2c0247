//! The transport under the one NVMe protocol core: the admin queue
//! (`admin.rs`) and the I/O queues (`queue.rs`) keep slots, CIDs, status
//! handling and reconnects, and talk to a [`Link`] — a TCP connection
//! ([`Conn`]) or an RDMA queue pair ([`RdmaConn`]) — through the few
//! operations both have: send a command with its data, pump, take what
//! arrived, a descriptor to wait on, shut down.
//!
//! TCP delivers responses, read data (C2HData) and R2Ts as PDUs; RDMA
//! delivers only responses, the controller having moved the data by RDMA
//! before (read data is then taken with [`Link::placed`]).

use crate::admin::{ConnectParams, Transport};
use crate::conn::{Conn, Pdu};
use crate::error::Error;
use crate::rdma::{cm_request, Data, RdmaConn};
use nvpool_wire::sqe::sgl_id;
use nvpool_wire::{Sgl, Sqe};
use std::net::SocketAddr;
use std::ops::Range;
use std::os::fd::RawFd;
use std::time::Duration;

#[derive(Debug)]
pub(crate) enum Link {
    Tcp(Conn),
    Rdma(Box<RdmaConn>),
}

impl Link {
    /// Opens queue `qid` with `entries` entries; `slots` commands of up to
    /// `slot_bytes` each may be outstanding (RDMA registers that much).
    pub(crate) fn connect(
        p: &ConnectParams,
        qid: u16,
        entries: u16,
        cntlid: u16,
        slots: usize,
        slot_bytes: usize,
    ) -> Result<Link, Error> {
        match p.transport {
            Transport::Tcp => Conn::connect(p.addr, p.digests, p.connect_timeout).map(Link::Tcp),
            Transport::Rdma => RdmaConn::connect(
                p.addr,
                cm_request(qid, entries, cntlid),
                slots,
                slot_bytes,
                p.connect_timeout,
            )
            .map(|c| Link::Rdma(Box::new(c))),
        }
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        match self {
            Link::Tcp(c) => c.addr,
            Link::Rdma(c) => c.addr,
        }
    }

    /// Largest data one command may carry on this link.
    pub(crate) fn max_data(&self) -> usize {
        match self {
            Link::Tcp(_) => usize::MAX,
            Link::Rdma(c) => c.max_data(),
        }
    }

    /// Queues (TCP) or posts (RDMA) the command of `slot` with its data
    /// pointer. TCP carries write data of up to `inline_max` bytes in the
    /// capsule and the rest when the controller asks (R2T); RDMA names the
    /// slot's registered buffer.
    pub(crate) fn command(&mut self, mut sqe: Sqe, slot: usize, data: Data<'_>, inline_max: usize) {
        match self {
            Link::Tcp(c) => {
                let (sgl, icd): (Sgl, &[u8]) = match data {
                    Data::Out(b) if b.len() <= inline_max => (
                        Sgl {
                            addr: 0,
                            len: b.len() as u32,
                            id: sgl_id::IN_CAPSULE,
                        },
                        b,
                    ),
                    Data::Out(b) => (transport_sgl(b.len()), &[]),
                    Data::In(n) => (transport_sgl(n), &[]),
                    Data::None => (transport_sgl(0), &[]),
                };
                sqe.set_sgl(sgl);
                c.queue_capsule(&sqe, icd);
            }
            Link::Rdma(c) => c.send_command(sqe, slot, data),
        }
    }

    pub(crate) fn fd(&self) -> RawFd {
        match self {
            Link::Tcp(c) => c.fd(),
            Link::Rdma(c) => c.fd(),
        }
    }

    /// Bytes wait for the socket (never on RDMA: sends are posted at once).
    pub(crate) fn tx_pending(&self) -> bool {
        match self {
            Link::Tcp(c) => c.tx_pending(),
            Link::Rdma(_) => false,
        }
    }

    /// Sends what is queued, as far as the socket takes it now (TCP; RDMA
    /// posts at once).
    pub(crate) fn send_nowait(&mut self) -> Result<(), Error> {
        match self {
            Link::Tcp(c) => c.send_nowait(),
            Link::Rdma(_) => Ok(()),
        }
    }

    /// Sends what is queued and takes what arrived until something is
    /// ready (Ok(true)) or `timeout` passes (Ok(false)).
    pub(crate) fn pump(&mut self, timeout: Duration) -> Result<bool, Error> {
        match self {
            Link::Tcp(c) => c.pump(timeout),
            Link::Rdma(c) => c.pump(timeout),
        }
    }

    pub(crate) fn next_pdu(&mut self) -> Result<Option<Pdu>, Error> {
        match self {
            Link::Tcp(c) => c.next_pdu(),
            Link::Rdma(c) => Ok(c.next_response().map(Pdu::Resp)),
        }
    }

    /// Data of a received PDU (TCP; RDMA has no data PDUs).
    pub(crate) fn data(&self, r: Range<usize>) -> &[u8] {
        match self {
            Link::Tcp(c) => c.data(r),
            Link::Rdma(_) => &[],
        }
    }

    /// Read data the controller placed for `slot` before its response:
    /// copied into `dst` on RDMA (Some(bytes)); None on TCP, where data came
    /// in PDUs.
    pub(crate) fn placed(&self, slot: usize, dst: &mut [u8]) -> Option<usize> {
        match self {
            Link::Tcp(_) => None,
            Link::Rdma(c) => Some(c.placed(slot, dst)),
        }
    }

    /// Answers an R2T (TCP only: RDMA controllers read the data themselves).
    pub(crate) fn queue_h2c(&mut self, cid: u16, ttag: u16, offset: u32, data: &[u8]) {
        if let Link::Tcp(c) = self {
            c.queue_h2c(cid, ttag, offset, data);
        }
    }

    /// Reads a directly placed C2HData payload (TCP only).
    pub(crate) fn read_direct(&mut self, dst: &mut [u8]) -> Result<usize, Error> {
        match self {
            Link::Tcp(c) => c.read_direct(dst),
            Link::Rdma(_) => Ok(0),
        }
    }

    pub(crate) fn shutdown(&self) {
        match self {
            Link::Tcp(c) => c.shutdown(),
            Link::Rdma(c) => c.shutdown(),
        }
    }
}

fn transport_sgl(len: usize) -> Sgl {
    Sgl {
        addr: 0,
        len: len as u32,
        id: sgl_id::TRANSPORT,
    }
}

/// Waits up to `ms` for `events` on `fd` (a socket, or a link's epoll set):
/// the events that came, none after a timeout or an interrupted wait. The
/// one blocking wait of both transports.
pub(crate) fn poll_fd(fd: RawFd, events: i16, ms: i32) -> std::io::Result<i16> {
    let ms = u64::try_from(ms).unwrap_or(0);
    nvpool_rt::wake::poll_one(fd, events, Some(Duration::from_millis(ms)))
}

/// A wait's timeout in poll(2) milliseconds: at least 1, at most `i32::MAX`.
pub(crate) fn poll_ms(d: Duration) -> i32 {
    d.as_millis().clamp(1, i32::MAX as u128) as i32
}
