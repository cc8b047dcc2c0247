//! One NVMe/TCP connection from the host side: ICReq/ICResp, PDU framing,
//! digests, and a nonblocking send/receive pump that never deadlocks (it
//! reads while it waits to write).

use crate::error::Error;
use crate::limits::{DIRECT_RX_BYTES_MIN, RX_BUF_BYTES};
use nvpool_wire::tcp::{
    self, flags, CommonHeader, DataHeader, Digests, IcReq, IcResp, PduType, R2t, TermReq,
};
use nvpool_wire::{Cqe, Sqe};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// A PDU received from the controller. Data is referenced by its range in
/// the receive buffer ([`Conn::data`]), valid until the next [`Conn::pump`].
#[derive(Debug, Clone)]
pub enum Pdu {
    Resp(Cqe),
    Data {
        hdr: DataHeader,
        flags: u8,
        range: Range<usize>,
        digest_ok: bool,
    },
    /// The start of a large C2HData whose payload has not all arrived:
    /// `range` holds the part that has (in the receive buffer); the rest is
    /// read straight into the caller's buffer with [`Conn::read_direct`].
    DataStart {
        hdr: DataHeader,
        flags: u8,
        range: Range<usize>,
    },
    R2t(R2t),
    Term(TermReq),
}

#[derive(Debug)]
pub struct Conn {
    sock: TcpStream,
    pub addr: SocketAddr,
    pub dg: Digests,
    pub maxh2cdata: u32,
    rx: Box<[u8]>,
    rs: usize,
    re: usize,
    tx: Vec<u8>,
    ts: usize,
    /// Payload bytes of the current C2HData still to come through
    /// `read_direct` (0: none); the receive buffer is not read meanwhile.
    direct: usize,
}

impl Conn {
    /// Opens TCP, exchanges ICReq/ICResp, and switches to nonblocking mode.
    pub fn connect(addr: SocketAddr, dg: Digests, timeout: Duration) -> Result<Conn, Error> {
        let cerr = |source| Error::Connect {
            addr: addr.to_string(),
            source,
        };
        let mut sock = TcpStream::connect_timeout(&addr, timeout).map_err(cerr)?;
        sock.set_nodelay(true).map_err(cerr)?;
        sock.set_read_timeout(Some(timeout)).map_err(cerr)?;
        sock.set_write_timeout(Some(timeout)).map_err(cerr)?;
        sock.write_all(
            &IcReq {
                pfv: 0,
                hpda: 0,
                digests: dg,
                maxr2t: 0,
            }
            .encode(),
        )
        .map_err(cerr)?;
        let mut b = [0u8; tcp::IC_PDU_LEN];
        sock.read_exact(&mut b).map_err(|e| {
            if e.kind() == io::ErrorKind::WouldBlock {
                Error::Timeout {
                    addr: addr.to_string(),
                    what: "ICResp",
                }
            } else {
                cerr(e)
            }
        })?;
        let proto = |what: String| Error::Protocol {
            addr: addr.to_string(),
            what,
        };
        if b[0] == PduType::C2HTermReq as u8 {
            let t = TermReq::decode(&b).map_err(|e| proto(e.to_string()))?;
            return Err(Error::Terminated {
                addr: addr.to_string(),
                fes: t.fes,
            });
        }
        let resp = IcResp::decode(&b).map_err(|e| proto(format!("bad ICResp: {e}")))?;
        if resp.pfv != 0 || resp.cpda != 0 {
            return Err(proto(format!(
                "unsupported ICResp (PFV {}, CPDA {})",
                resp.pfv, resp.cpda
            )));
        }
        if resp.digests != dg {
            return Err(proto(format!(
                "digest mismatch: asked {dg:?}, controller answered {:?}",
                resp.digests
            )));
        }
        sock.set_nonblocking(true).map_err(cerr)?;
        Ok(Conn {
            sock,
            addr,
            dg,
            maxh2cdata: resp.maxh2cdata,
            rx: vec![0u8; RX_BUF_BYTES].into_boxed_slice(),
            rs: 0,
            re: 0,
            tx: Vec::with_capacity(64 << 10),
            ts: 0,
            direct: 0,
        })
    }

    fn io_err(&self, source: io::Error) -> Error {
        Error::Io {
            addr: self.addr.to_string(),
            source,
        }
    }

    fn proto(&self, what: impl Into<String>) -> Error {
        Error::Protocol {
            addr: self.addr.to_string(),
            what: what.into(),
        }
    }

    /// Queues a command capsule with optional in-capsule data.
    pub fn queue_capsule(&mut self, sqe: &Sqe, icd: &[u8]) {
        let mut h = [0u8; tcp::CAPSULE_CMD_HLEN + tcp::DIGEST_LEN];
        let n = tcp::encode_capsule_cmd(sqe, icd.len(), self.dg, &mut h);
        self.tx.extend_from_slice(&h[..n]);
        if !icd.is_empty() {
            self.tx.extend_from_slice(icd);
            if self.dg.data {
                self.tx
                    .extend_from_slice(&nvpool_wire::digest::crc32c(icd).to_le_bytes());
            }
        }
    }

    /// Queues H2CData PDUs answering one R2T, split at MAXH2CDATA.
    pub fn queue_h2c(&mut self, cid: u16, ttag: u16, offset: u32, data: &[u8]) {
        let max = self.maxh2cdata as usize;
        let mut done = 0;
        while done < data.len() {
            let n = (data.len() - done).min(max);
            let last = done + n == data.len();
            let mut h = [0u8; tcp::DATA_HLEN + tcp::DIGEST_LEN];
            let piece = &data[done..done + n];
            let hdr = DataHeader {
                cccid: cid,
                ttag,
                datao: offset + done as u32,
                datal: n as u32,
            };
            let hl = hdr.encode(
                PduType::H2CData,
                if last { flags::LAST_PDU } else { 0 },
                self.dg,
                &mut h,
            );
            self.tx.extend_from_slice(&h[..hl]);
            self.tx.extend_from_slice(piece);
            if self.dg.data {
                self.tx
                    .extend_from_slice(&nvpool_wire::digest::crc32c(piece).to_le_bytes());
            }
            done += n;
        }
    }

    pub fn fd(&self) -> std::os::fd::RawFd {
        self.sock.as_raw_fd()
    }

    pub fn tx_pending(&self) -> bool {
        self.ts < self.tx.len()
    }

    /// Sends what is queued and reads what arrived, until a complete PDU is
    /// buffered (Ok(true)) or `timeout` passes (Ok(false)). With a zero
    /// timeout it only does what needs no waiting.
    pub fn pump(&mut self, timeout: Duration) -> Result<bool, Error> {
        let deadline = Instant::now() + timeout;
        if self.direct > 0 {
            // The payload goes to the caller's buffer: only wait for it.
            return self.wait_readable(deadline);
        }
        if self.rs > 0
            && (self.re == self.rx.len()
                || self.rs == self.re
                || self.rx.len() - self.re < tcp::CAPSULE_RESP_HLEN + 8)
        {
            self.compact();
        }
        loop {
            self.try_write()?;
            let got = self.try_read()?;
            if self.complete_pdu_buffered() {
                // Keep sending while we have data: the peer may need it.
                self.try_write()?;
                return Ok(true);
            }
            if got {
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            let ms = (deadline - now).as_millis().clamp(1, i32::MAX as u128) as i32;
            self.poll_sock(self.wanted_events(), ms)?;
        }
    }

    /// Readable, and writable too while something waits to be sent.
    fn wanted_events(&self) -> i16 {
        libc::POLLIN | if self.tx_pending() { libc::POLLOUT } else { 0 }
    }

    /// Waits up to `ms` for `events` on the socket; the events that came
    /// (none after a timeout or an interrupted wait).
    fn poll_sock(&self, events: i16, ms: i32) -> Result<i16, Error> {
        crate::link::poll_fd(self.sock.as_raw_fd(), events, ms).map_err(|e| self.io_err(e))
    }

    /// Sends what it can and waits until the socket has data (Ok(true)) or
    /// the deadline passes (Ok(false)).
    fn wait_readable(&mut self, deadline: Instant) -> Result<bool, Error> {
        loop {
            self.try_write()?;
            let ms = deadline
                .saturating_duration_since(Instant::now())
                .as_millis()
                .min(i32::MAX as u128) as i32;
            let revents = self.poll_sock(self.wanted_events(), ms)?;
            if revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0 {
                return Ok(true);
            }
            if ms == 0 {
                return Ok(false);
            }
        }
    }

    /// Reads the pending C2HData payload (see [`Pdu::DataStart`]) into
    /// `dst`, as much as has arrived; returns the bytes placed. `dst` is the
    /// part of the request's buffer the payload still has to fill.
    pub fn read_direct(&mut self, dst: &mut [u8]) -> Result<usize, Error> {
        let want = dst.len().min(self.direct);
        let mut got = 0;
        while got < want {
            match self.sock.read(&mut dst[got..want]) {
                Ok(0) => return Err(self.io_err(io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_err(e)),
            }
        }
        self.direct -= got;
        Ok(got)
    }

    /// Whether the buffered bytes start a C2HData whose payload is large,
    /// unguarded by a data digest and not all here: worth placing directly.
    /// Returns its data offset.
    fn direct_candidate(&self) -> Option<usize> {
        let avail = self.re - self.rs;
        if self.dg.data || avail < tcp::CH_LEN {
            return None;
        }
        let b = &self.rx[self.rs..self.re];
        if b[0] != PduType::C2HData as u8 {
            return None;
        }
        let (hlen, pdo) = (b[2] as usize, b[3] as usize);
        let plen = nvpool_wire::le::u32_at(b, 4) as usize;
        let ds = if pdo != 0 {
            pdo
        } else {
            hlen + self.dg.hdgst_len()
        };
        (avail >= ds && avail < plen && plen.saturating_sub(ds) >= DIRECT_RX_BYTES_MIN)
            .then_some(ds)
    }

    fn compact(&mut self) {
        self.rx.copy_within(self.rs..self.re, 0);
        self.re -= self.rs;
        self.rs = 0;
    }

    /// Sends what is queued as far as the socket takes it, never waiting.
    pub fn send_nowait(&mut self) -> Result<(), Error> {
        self.try_write()
    }

    fn try_write(&mut self) -> Result<(), Error> {
        while self.ts < self.tx.len() {
            match self.sock.write(&self.tx[self.ts..]) {
                Ok(0) => return Err(self.io_err(io::ErrorKind::WriteZero.into())),
                Ok(n) => self.ts += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_err(e)),
            }
        }
        if self.ts == self.tx.len() {
            self.tx.clear();
            self.ts = 0;
        }
        Ok(())
    }

    /// Reads what is available; true if anything arrived.
    fn try_read(&mut self) -> Result<bool, Error> {
        let mut any = false;
        loop {
            if self.re == self.rx.len() {
                if self.rs == 0 {
                    return Ok(any);
                }
                self.compact();
            }
            match self.sock.read(&mut self.rx[self.re..]) {
                Ok(0) => return Err(self.io_err(io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => {
                    self.re += n;
                    any = true;
                    if self.complete_pdu_buffered() {
                        return Ok(true);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(any),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_err(e)),
            }
        }
    }

    fn complete_pdu_buffered(&self) -> bool {
        let avail = self.re - self.rs;
        if avail < tcp::CH_LEN {
            return false;
        }
        let plen = nvpool_wire::le::u32_at(&self.rx, self.rs + 4) as usize;
        // A PDU that can never fit is reported by next_pdu as an error.
        avail >= plen || plen > self.rx.len() || self.direct_candidate().is_some()
    }

    /// Takes the next complete PDU from the receive buffer, checking its
    /// framing and header digest. Ok(None): none complete yet.
    pub fn next_pdu(&mut self) -> Result<Option<Pdu>, Error> {
        let avail = self.re - self.rs;
        if avail < tcp::CH_LEN {
            return Ok(None);
        }
        let b = &self.rx[self.rs..self.re];
        let ch = CommonHeader::decode(b).map_err(|e| self.proto(format!("bad PDU header: {e}")))?;
        let plen = ch.plen as usize;
        if plen > self.rx.len() {
            return Err(self.proto(format!("PDU of {plen} bytes exceeds the receive buffer")));
        }
        if avail < plen {
            return match self.direct_candidate() {
                Some(ds) => self.data_start(&ch, ds, plen).map(Some),
                None => Ok(None),
            };
        }
        let start = self.rs;
        let pdu = &self.rx[start..start + plen];
        if ch.pdu_type == PduType::C2HTermReq {
            let t = TermReq::decode(pdu).map_err(|e| self.proto(e.to_string()))?;
            self.rs += plen;
            return Ok(Some(Pdu::Term(t)));
        }
        if !matches!(
            ch.pdu_type,
            PduType::CapsuleResp | PduType::C2HData | PduType::R2T
        ) {
            return Err(self.proto(format!("unexpected PDU type {:?}", ch.pdu_type)));
        }
        if (ch.flags & flags::HDGSTF != 0) != self.dg.header {
            return Err(self.proto("header digest flag does not match the negotiated digest"));
        }
        if self.dg.header && !tcp::header_digest_ok(pdu, ch.hlen as usize) {
            return Err(self.proto("header digest mismatch"));
        }
        let out = match ch.pdu_type {
            PduType::CapsuleResp => {
                if plen != tcp::CAPSULE_RESP_HLEN + self.dg.hdgst_len() {
                    return Err(self.proto("CapsuleResp with a bad PLEN"));
                }
                Pdu::Resp(tcp::decode_capsule_resp(pdu).map_err(|e| self.proto(e.to_string()))?)
            }
            PduType::R2T => Pdu::R2t(R2t::decode(pdu).map_err(|e| self.proto(e.to_string()))?),
            _ => {
                let hdr =
                    DataHeader::decode(&ch, pdu, self.dg).map_err(|e| self.proto(e.to_string()))?;
                if self.dg.data && ch.flags & flags::DDGSTF == 0 {
                    return Err(self.proto("data digest flag missing"));
                }
                let ds = tcp::data_offset(&ch, self.dg);
                let de = ds + hdr.datal as usize;
                let digest_ok = !self.dg.data
                    || nvpool_wire::digest::crc32c(&pdu[ds..de]).to_le_bytes() == pdu[de..de + 4];
                Pdu::Data {
                    hdr,
                    flags: ch.flags,
                    range: start + ds..start + de,
                    digest_ok,
                }
            }
        };
        self.rs += plen;
        Ok(Some(out))
    }

    /// Takes the header of a partly arrived C2HData (and the payload that is
    /// here); the rest of its payload is left for `read_direct`.
    fn data_start(&mut self, ch: &CommonHeader, ds: usize, plen: usize) -> Result<Pdu, Error> {
        let start = self.rs;
        let head = &self.rx[start..start + ds];
        if (ch.flags & flags::HDGSTF != 0) != self.dg.header {
            return Err(self.proto("header digest flag does not match the negotiated digest"));
        }
        if self.dg.header && !tcp::header_digest_ok(head, ch.hlen as usize) {
            return Err(self.proto("header digest mismatch"));
        }
        if ch.flags & flags::DDGSTF != 0 {
            return Err(self.proto("data digest flag without a negotiated data digest"));
        }
        let hdr = DataHeader::decode(ch, head, self.dg).map_err(|e| self.proto(e.to_string()))?;
        if ds + hdr.datal as usize != plen {
            return Err(self.proto("C2HData whose PLEN does not match its DATAL"));
        }
        let here = start + ds..self.re;
        self.direct = hdr.datal as usize - here.len();
        self.rs = self.re;
        Ok(Pdu::DataStart {
            hdr,
            flags: ch.flags,
            range: here,
        })
    }

    /// Data of a received PDU.
    pub fn data(&self, r: Range<usize>) -> &[u8] {
        &self.rx[r]
    }

    /// Sends everything queued, waiting as long as `timeout`.
    pub fn flush(&mut self, timeout: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + timeout;
        while self.tx_pending() {
            self.try_write()?;
            if !self.tx_pending() {
                break;
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    addr: self.addr.to_string(),
                    what: "send",
                });
            }
            // A failed wait only means trying again sooner.
            let _ = self.poll_sock(libc::POLLOUT, 10);
        }
        Ok(())
    }

    pub fn shutdown(&self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}
