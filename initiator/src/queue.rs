//! An I/O queue: one connection (TCP or an RDMA queue pair, see
//! `link.rs`), owned by one thread.

use crate::admin::Controller;
use crate::conn::Pdu;
use crate::error::{Error, IoError};
use crate::limits::DIGEST_RETRIES_MAX;
use crate::link::Link;
use crate::rdma::Data;
use nvpool_wire::sqe::nvm;
use nvpool_wire::{Sqe, Status};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    Flush,
    /// Write Zeroes; `deallocate` lets the controller unmap the blocks.
    WriteZeroes {
        deallocate: bool,
    },
    /// Dataset Management, deallocate one range.
    Deallocate,
}

/// One I/O. `buf` is the data (Write) or is filled (Read); it comes back in
/// the completion, so callers can reuse buffers and allocate nothing.
#[derive(Debug)]
pub struct Request {
    pub op: Op,
    pub nsid: u32,
    pub lba: u64,
    /// Logical blocks (1-based count; 0 for Flush).
    pub blocks: u32,
    /// Force Unit Access (Read/Write).
    pub fua: bool,
    pub buf: Vec<u8>,
    /// Write data shared with other requests (the copies of one mirrored
    /// write), sent in place of `buf`; released at completion.
    pub shared: Option<Arc<Vec<u8>>>,
    /// Handed back untouched in the completion.
    pub token: u64,
}

impl Request {
    /// The bytes a write sends.
    fn out(&self) -> &[u8] {
        self.shared.as_deref().unwrap_or(&self.buf)
    }
}

#[derive(Debug)]
pub struct Completion {
    pub token: u64,
    pub result: Result<(), IoError>,
    pub buf: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    Sent,
}

#[derive(Debug)]
struct Slot {
    state: SlotState,
    req: Option<Request>,
    /// Read bytes received so far.
    got: usize,
    /// Generation nibble in the CID (catches stale completions).
    gen: u16,
    /// Data-digest retries so far.
    retries: u8,
    /// CDW2 of a Write, Write Zeroes or Dataset Management: the write
    /// epoch the request was submitted with, sent again on a reissue.
    write_epoch: u32,
}

/// CIDs are slot | generation << 12, as the Linux host does.
const SLOT_BITS: u16 = 12;
const MAX_DEPTH: u16 = 1 << SLOT_BITS;
// The default depth needs no clamping by the CID format.
const _: () = assert!(crate::limits::IO_QUEUE_DEPTH_DEFAULT <= MAX_DEPTH);

#[derive(Debug)]
pub struct IoQueue {
    ctrl: Arc<Controller>,
    conn: Link,
    qid: u16,
    generation: u64,
    slots: Vec<Slot>,
    free: Vec<u16>,
    inline_max: usize,
    block_size: u32,
    failed: bool,
    /// DSM range buffer (4096 bytes, like the Linux host), reused.
    dsm: Vec<u8>,
    /// A C2HData whose payload is being read straight into its slot's
    /// buffer: the slot, the PDU's flags and where its payload ends.
    direct: Option<DirectData>,
    /// Read payload bytes placed straight into request buffers.
    direct_bytes: u64,
    /// A transport failure [`IoQueue::poll_nowait`] saw and left for the
    /// next [`IoQueue::poll`] to repair.
    broken: Option<Error>,
}

#[derive(Debug, Clone, Copy)]
struct DirectData {
    si: usize,
    flags: u8,
    end: usize,
}

impl IoQueue {
    pub(crate) fn connect(ctrl: Arc<Controller>, qid: u16) -> Result<IoQueue, Error> {
        let entries = ctrl.io_queue_entries();
        let depth = (entries - 1).min(MAX_DEPTH);
        let (cntlid, generation) = ctrl.current()?;
        let conn = ctrl.connect_io(qid, cntlid, entries)?;
        let slots = (0..depth)
            .map(|_| Slot {
                state: SlotState::Free,
                req: None,
                got: 0,
                gen: 0,
                retries: 0,
                write_epoch: 0,
            })
            .collect();
        let inline_max = ctrl.inline_data_max();
        Ok(IoQueue {
            ctrl,
            conn,
            qid,
            generation,
            slots,
            free: (0..depth).rev().collect(),
            inline_max,
            block_size: 512,
            failed: false,
            dsm: vec![0; 4096],
            direct: None,
            direct_bytes: 0,
            broken: None,
        })
    }

    pub fn qid(&self) -> u16 {
        self.qid
    }

    /// Commands that may be outstanding at once.
    pub fn depth(&self) -> usize {
        self.slots.len()
    }

    /// Read payload bytes that went from the socket straight into request
    /// buffers (the rest passed through the receive buffer): a statistic.
    pub fn direct_bytes(&self) -> u64 {
        self.direct_bytes
    }

    /// Commands outstanding now.
    pub fn outstanding(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    pub fn max_transfer(&self) -> usize {
        self.ctrl.max_transfer()
    }

    /// The socket, for callers that wait on it together with other events.
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.conn.fd()
    }

    /// Queued bytes wait for the socket to accept them.
    pub fn wants_write(&self) -> bool {
        self.conn.tx_pending()
    }

    pub fn controller(&self) -> &Arc<Controller> {
        &self.ctrl
    }

    /// The namespace's logical block size, in which requests count blocks
    /// (from its Identify; 512 until set).
    pub fn set_block_size(&mut self, bs: u32) {
        self.block_size = bs;
    }

    /// Queues a request. Err gives the request back: the queue is full, or
    /// the request is malformed, or the controller is lost.
    pub fn submit(&mut self, req: Request) -> Result<(), (Request, Error)> {
        self.submit_tagged(req, 0)
    }

    /// [`IoQueue::submit`] for a volume engine: a Write, Write Zeroes or
    /// Deallocate carries `write_epoch` in CDW2 (every time it is issued,
    /// reissues after a reconnect too); other requests ignore it. 0 is
    /// untagged, what [`IoQueue::submit`] sends. The tag sits beside the
    /// request rather than in it so that callers outside the engine build
    /// their requests as before.
    pub fn submit_tagged(
        &mut self,
        req: Request,
        write_epoch: u32,
    ) -> Result<(), (Request, Error)> {
        if self.failed {
            let e = Error::ControllerLost {
                addr: self.ctrl.addr().to_string(),
                timeout: self.ctrl.params.ctrl_loss_timeout,
            };
            return Err((req, e));
        }
        let data_len = match req.op {
            Op::Read | Op::Write => req.blocks as usize * self.block_size as usize,
            _ => 0,
        };
        if matches!(req.op, Op::WriteZeroes { .. }) && (req.blocks == 0 || req.blocks > 65536) {
            return Err((
                req,
                Error::Invalid("write zeroes covers 1..=65536 blocks".into()),
            ));
        }
        if req.shared.is_some() && req.op != Op::Write {
            return Err((
                req,
                Error::Invalid("only a write sends a shared buffer".into()),
            ));
        }
        let have = match req.op {
            Op::Write => req.out().len(),
            _ => req.buf.len(),
        };
        if matches!(req.op, Op::Read | Op::Write)
            && (req.blocks == 0
                || req.blocks > 65536
                || data_len > self.max_transfer()
                || have < data_len)
        {
            let msg = format!(
                "bad I/O size: {} blocks ({data_len} bytes), buffer {have} bytes, max transfer {}",
                req.blocks,
                self.max_transfer()
            );
            return Err((req, Error::Invalid(msg)));
        }
        let Some(si) = self.free.pop() else {
            return Err((req, Error::Invalid("queue full".into())));
        };
        let s = &mut self.slots[si as usize];
        s.state = SlotState::Sent;
        s.got = 0;
        s.retries = 0;
        s.write_epoch = write_epoch;
        s.req = Some(req);
        self.issue(si);
        Ok(())
    }

    /// Builds and queues the command of slot `si` (also used to reissue).
    fn issue(&mut self, si: u16) {
        let bs = self.block_size as usize;
        let s = &mut self.slots[si as usize];
        s.gen = (s.gen + 1) & 0xF;
        s.got = 0;
        let cid = si | s.gen << SLOT_BITS;
        let write_epoch = s.write_epoch;
        let req = s.req.as_ref().expect("slot in use has a request");
        let mut sqe;
        let data;
        match req.op {
            Op::Read | Op::Write => {
                sqe = Sqe::new(
                    if req.op == Op::Read {
                        nvm::READ
                    } else {
                        nvm::WRITE
                    },
                    cid,
                );
                sqe.set_slba(req.lba);
                sqe.set_nlb((req.blocks - 1) as u16);
                if req.fua {
                    sqe.set_cdw(12, sqe.cdw(12) | 1 << 30);
                }
                let len = req.blocks as usize * bs;
                data = if req.op == Op::Write {
                    Data::Out(&req.out()[..len])
                } else {
                    Data::In(len)
                };
            }
            Op::Flush => {
                sqe = Sqe::new(nvm::FLUSH, cid);
                data = Data::None;
            }
            Op::WriteZeroes { deallocate } => {
                sqe = Sqe::new(nvm::WRITE_ZEROES, cid);
                sqe.set_slba(req.lba);
                sqe.set_nlb((req.blocks.max(1) - 1) as u16);
                if deallocate {
                    sqe.set_cdw(12, sqe.cdw(12) | 1 << 25);
                }
                data = Data::None;
            }
            Op::Deallocate => {
                sqe = Sqe::new(nvm::DATASET_MANAGEMENT, cid);
                sqe.set_cdw(10, 0); // one range
                sqe.set_cdw(11, 1 << 2); // AD
                self.dsm.fill(0);
                self.dsm[4..8].copy_from_slice(&req.blocks.to_le_bytes());
                self.dsm[8..16].copy_from_slice(&req.lba.to_le_bytes());
                data = Data::Out(&self.dsm);
            }
        }
        if matches!(req.op, Op::Write | Op::WriteZeroes { .. } | Op::Deallocate) {
            sqe.set_write_epoch(write_epoch);
        }
        sqe.set_nsid(req.nsid);
        self.conn.command(sqe, si as usize, data, self.inline_max);
    }

    /// Sends queued commands and collects completions into `out`, waiting up
    /// to `timeout` for at least one when none is ready. Returns how many
    /// were added. Reconnects (and reissues outstanding commands) when the
    /// connection breaks; fails them all when the controller is lost.
    pub fn poll(&mut self, out: &mut Vec<Completion>, timeout: Duration) -> Result<usize, Error> {
        let before = out.len();
        let deadline = Instant::now() + timeout;
        loop {
            let r = match self.broken.take() {
                Some(e) => Err(e),
                None => self.poll_once(out, deadline),
            };
            match r {
                Ok(()) => return Ok(out.len() - before),
                Err(e) if e.is_transport() => {
                    tracing::warn!(qid = self.qid, error = %e, "I/O queue connection failed; reconnecting");
                    if let Err(e) = self.recover() {
                        self.fail_all(out);
                        return Err(e);
                    }
                    if out.len() > before || Instant::now() >= deadline {
                        return Ok(out.len() - before);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Sends what is queued without reading or waiting, and never
    /// reconnects: a thread that must not block (a front-end's, submitting
    /// its own request) calls this after [`IoQueue::submit`], and the
    /// queue's own thread reads the completions. A broken connection is
    /// kept for that thread, whose next [`IoQueue::poll`] reconnects.
    pub fn send_nowait(&mut self) {
        if self.broken.is_none() {
            if let Err(e) = self.conn.send_nowait() {
                self.broken = Some(e);
            }
        }
    }

    /// Reads what came on a connection with nothing outstanding, without
    /// waiting or reconnecting: its end is kept for the next
    /// [`IoQueue::poll`], as a command would find it.
    pub fn poll_idle(&mut self, out: &mut Vec<Completion>) -> Result<(), Error> {
        if self.broken.is_some() {
            return Ok(());
        }
        match self.poll_once(out, Instant::now()) {
            Err(e) if e.is_transport() => {
                self.broken = Some(e);
                Ok(())
            }
            r => r,
        }
    }

    /// A transport failure waits for [`IoQueue::poll`] (see
    /// [`IoQueue::send_nowait`]).
    pub fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    fn poll_once(&mut self, out: &mut Vec<Completion>, deadline: Instant) -> Result<(), Error> {
        let start = out.len();
        loop {
            let now = Instant::now();
            let wait = if out.len() > start || self.outstanding() == 0 {
                Duration::ZERO
            } else {
                deadline.saturating_duration_since(now)
            };
            let ready = self.conn.pump(wait)?;
            if !ready {
                return Ok(());
            }
            if self.direct.is_some() {
                self.continue_direct(out)?;
            }
            // The stream is mid-payload while a direct read is pending.
            while self.direct.is_none() {
                let Some(pdu) = self.conn.next_pdu()? else {
                    break;
                };
                self.on_pdu(pdu, out)?;
            }
            if out.len() > start && !self.conn.tx_pending() {
                return Ok(());
            }
        }
    }

    fn slot_for(&mut self, cid: u16, what: &str) -> Result<usize, Error> {
        let si = (cid & (MAX_DEPTH - 1)) as usize;
        match self.slots.get(si) {
            Some(s) if s.state == SlotState::Sent && s.gen == cid >> SLOT_BITS => Ok(si),
            _ => Err(Error::Protocol {
                addr: self.conn.addr().to_string(),
                what: format!("{what} for unknown command id {cid:#x}"),
            }),
        }
    }

    fn on_pdu(&mut self, pdu: Pdu, out: &mut Vec<Completion>) -> Result<(), Error> {
        match pdu {
            Pdu::Resp(cqe) => {
                let si = self.slot_for(cqe.cid, "completion")?;
                let s = &mut self.slots[si];
                let req = s.req.as_mut().expect("sent slot has a request");
                if cqe.status.is_success() && req.op == Op::Read {
                    let len = req.blocks as usize * self.block_size as usize;
                    if let Some(n) = self.conn.placed(si, &mut req.buf[..len]) {
                        s.got = n;
                    }
                }
                let s = &self.slots[si];
                let req = s.req.as_ref().expect("sent slot has a request");
                if cqe.status.is_success()
                    && req.op == Op::Read
                    && s.got != req.blocks as usize * self.block_size as usize
                {
                    return Err(Error::Protocol {
                        addr: self.conn.addr().to_string(),
                        what: "read completed with short data".into(),
                    });
                }
                if cqe.status == Status::TRANSIENT_TRANSPORT_ERROR && s.retries < DIGEST_RETRIES_MAX
                {
                    self.slots[si].retries += 1;
                    self.issue(si as u16);
                    return Ok(());
                }
                let r = if cqe.status.is_success() {
                    Ok(())
                } else {
                    Err(IoError::Status(cqe.status))
                };
                self.complete(si, r, out);
            }
            Pdu::DataStart { hdr, flags, range } => {
                let si = self.data_slot(&hdr)?;
                let s = &mut self.slots[si];
                let req = s.req.as_mut().expect("sent slot has a request");
                req.buf[s.got..s.got + range.len()].copy_from_slice(self.conn.data(range.clone()));
                let end = s.got + hdr.datal as usize;
                s.got += range.len();
                self.direct = Some(DirectData { si, flags, end });
                self.continue_direct(out)?;
            }
            Pdu::Data {
                hdr,
                flags,
                range,
                digest_ok,
            } => {
                let si = self.data_slot(&hdr)?;
                let s = &mut self.slots[si];
                let req = s.req.as_mut().expect("sent slot has a request");
                let len = req.blocks as usize * self.block_size as usize;
                if range.len() != hdr.datal as usize || s.got + range.len() > len {
                    return Err(Error::Protocol {
                        addr: self.conn.addr().to_string(),
                        what: "C2HData outside the read".into(),
                    });
                }
                req.buf[s.got..s.got + range.len()].copy_from_slice(self.conn.data(range.clone()));
                s.got += range.len();
                if !digest_ok {
                    // Damaged data: the connection is suspect; reconnecting
                    // reissues the read.
                    return Err(Error::Protocol {
                        addr: self.conn.addr().to_string(),
                        what: "data digest mismatch".into(),
                    });
                }
                if flags & nvpool_wire::tcp::flags::SUCCESS != 0 {
                    if s.got != len {
                        return Err(Error::Protocol {
                            addr: self.conn.addr().to_string(),
                            what: "SUCCESS with short data".into(),
                        });
                    }
                    self.complete(si, Ok(()), out);
                }
            }
            Pdu::R2t(r) => {
                let si = self.slot_for(r.cccid, "R2T")?;
                let bs = self.block_size as usize;
                let req = self.slots[si]
                    .req
                    .as_ref()
                    .expect("sent slot has a request");
                let len = match req.op {
                    Op::Write => req.blocks as usize * bs,
                    Op::Deallocate => self.dsm.len(),
                    _ => 0,
                };
                let end = r.r2to as usize + r.r2tl as usize;
                if end > len {
                    return Err(Error::Protocol {
                        addr: self.conn.addr().to_string(),
                        what: "R2T beyond the command's data".into(),
                    });
                }
                let IoQueue {
                    slots, dsm, conn, ..
                } = self;
                let req = slots[si].req.as_ref().expect("sent slot has a request");
                let src = if req.op == Op::Deallocate {
                    &dsm[..]
                } else {
                    req.out()
                };
                conn.queue_h2c(r.cccid, r.ttag, r.r2to, &src[r.r2to as usize..end]);
            }
            Pdu::Term(t) => {
                return Err(Error::Terminated {
                    addr: self.conn.addr().to_string(),
                    fes: t.fes,
                })
            }
        }
        Ok(())
    }

    /// The slot a C2HData belongs to, checked: a read, at the offset where
    /// the data so far ends, and inside it.
    fn data_slot(&mut self, hdr: &nvpool_wire::tcp::DataHeader) -> Result<usize, Error> {
        let si = self.slot_for(hdr.cccid, "C2HData")?;
        let s = &self.slots[si];
        let req = s.req.as_ref().expect("sent slot has a request");
        let len = req.blocks as usize * self.block_size as usize;
        if req.op != Op::Read || hdr.datao as usize != s.got || s.got + hdr.datal as usize > len {
            return Err(Error::Protocol {
                addr: self.conn.addr().to_string(),
                what: "C2HData outside the read".into(),
            });
        }
        Ok(si)
    }

    /// Reads what has arrived of a directly placed C2HData payload into its
    /// slot's buffer; when it is all there, ends the PDU (and the command if
    /// the PDU said SUCCESS).
    fn continue_direct(&mut self, out: &mut Vec<Completion>) -> Result<(), Error> {
        let Some(d) = self.direct else {
            return Ok(());
        };
        let s = &mut self.slots[d.si];
        let req = s.req.as_mut().expect("sent slot has a request");
        let n = self.conn.read_direct(&mut req.buf[s.got..d.end])?;
        s.got += n;
        self.direct_bytes += n as u64;
        if s.got < d.end {
            return Ok(());
        }
        self.direct = None;
        if d.flags & nvpool_wire::tcp::flags::SUCCESS != 0 {
            if s.got != req.blocks as usize * self.block_size as usize {
                return Err(Error::Protocol {
                    addr: self.conn.addr().to_string(),
                    what: "SUCCESS with short data".into(),
                });
            }
            self.complete(d.si, Ok(()), out);
        }
        Ok(())
    }

    fn complete(&mut self, si: usize, result: Result<(), IoError>, out: &mut Vec<Completion>) {
        let s = &mut self.slots[si];
        let req = s.req.take().expect("sent slot has a request");
        s.state = SlotState::Free;
        self.free.push(si as u16);
        out.push(Completion {
            token: req.token,
            result,
            buf: req.buf,
        });
    }

    /// Reconnects this queue (and the controller if needed), then reissues
    /// every outstanding command.
    fn recover(&mut self) -> Result<(), Error> {
        self.conn.shutdown();
        // A payload half read belongs to the dead connection; the command
        // is reissued from scratch below.
        self.direct = None;
        let give_up = Instant::now() + self.ctrl.params.ctrl_loss_timeout;
        loop {
            let (cntlid, gen) = self.ctrl.reconnect(self.generation)?;
            match self
                .ctrl
                .connect_io(self.qid, cntlid, self.ctrl.io_queue_entries())
            {
                Ok(c) => {
                    self.conn = c;
                    self.generation = gen;
                    break;
                }
                Err(e) => {
                    if Instant::now() >= give_up {
                        return Err(Error::ControllerLost {
                            addr: self.ctrl.addr().to_string(),
                            timeout: self.ctrl.params.ctrl_loss_timeout,
                        });
                    }
                    tracing::warn!(qid = self.qid, error = %e, "I/O queue reconnect failed; retrying");
                    // The admin queue may be fine while this queue is refused
                    // (e.g. the controller was replaced): force a new controller.
                    self.generation = gen;
                    std::thread::sleep(self.ctrl.params.reconnect_delay);
                }
            }
        }
        let reissue: Vec<u16> = (0..self.slots.len() as u16)
            .filter(|&i| self.slots[i as usize].state == SlotState::Sent)
            .collect();
        tracing::info!(
            qid = self.qid,
            reissued = reissue.len(),
            "I/O queue reconnected"
        );
        for si in reissue {
            self.issue(si);
        }
        Ok(())
    }

    fn fail_all(&mut self, out: &mut Vec<Completion>) {
        self.failed = true;
        self.direct = None;
        for si in 0..self.slots.len() {
            if self.slots[si].state == SlotState::Sent {
                self.complete(si, Err(IoError::ControllerLost), out);
            }
        }
    }
}

impl Drop for IoQueue {
    fn drop(&mut self) {
        self.conn.shutdown();
    }
}
