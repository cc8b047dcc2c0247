//! Test support for the loopback integration tests: an in-process
//! nvpool-target ([`Daemon`]) and a small synchronous NVMe/TCP host
//! ([`Conn`]) that speaks raw PDUs over a `std::net::TcpStream`.
//!
//! The host checks every PDU the target sends against the rules the Linux
//! host enforces (HLEN 24 on C2H PDUs, digest flags and values, C2H data
//! in order and unpadded), so every test also checks framing.
//!
//! Every test binary compiles this module and uses a different part of it.
#![allow(dead_code)]

use nvpool_control::rest::Secret;
use nvpool_target::config::SubsystemConfig;
use nvpool_target::{AdminTokens, StartOptions, Target};
use nvpool_testkit::target::{self as tk, Serving, LOOPBACK};
use nvpool_wire::fabrics::{cc, csts, fctype, prop, ConnectCmd, ConnectData, PropertyCmd};
use nvpool_wire::identify::{self, IdentifyController, IdentifyNamespace, NsId, IDENTIFY_LEN};
use nvpool_wire::log::GetLogPage;
use nvpool_wire::sqe::{admin, nvm, sgl_id};
use nvpool_wire::tcp::{
    self, encode_capsule_cmd, flags, CommonHeader, DataHeader, Digests, IcReq, IcResp, PduType,
    R2t, TermReq,
};
use nvpool_wire::{Cqe, Sgl, Sqe, Status};
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const SUBNQN: &str = "nqn.2026-11.io.nvpool:itest-disk";
pub const OTHER_NQN: &str = "nqn.2026-11.io.nvpool:itest-other";
pub const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-4000-8000-00000000000a";
pub const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-4000-8000-00000000000b";
/// The admin API token of every test daemon; [`http`] sends it.
pub const ADMIN_TOKEN: &str = "itest-admin-token-5f0c2d7e9a41";

/// The tokens of a test daemon's admin API: [`ADMIN_TOKEN`].
pub fn test_tokens() -> AdminTokens {
    AdminTokens::fixed(vec![Secret::new(ADMIN_TOKEN).expect("token")])
}

/// How long any single read from the target may take before a test fails
/// instead of hanging.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// A RAM namespace of this size (16 MiB of 512-byte blocks).
pub const RAM_SPEC: &str = "ram:16M";
pub const RAM_BLOCKS: u64 = (16 << 20) / 512;

/// Fabrics "no data" SGL the Linux host puts in every data-less command.
pub const NULL_SGL: Sgl = Sgl {
    addr: 0,
    len: 0,
    id: sgl_id::TRANSPORT,
};

// ----- daemon -----

// What the suites of every crate share (nvpool-testkit), under the names
// these tests use; each test binary uses some of them.
#[allow(unused_imports)]
pub use nvpool_testkit::target::subsystem;
#[allow(unused_imports)]
pub use nvpool_testkit::{file_spec, free_port, pattern, wait_exit, wait_for};

/// An nvpool-target running inside the test process on loopback ports.
#[derive(Debug)]
pub struct Daemon {
    serving: Serving,
    pub target: Arc<Target>,
    /// The NVMe/TCP listener.
    pub addr: SocketAddr,
    /// The admin HTTP API.
    pub api: SocketAddr,
    /// The tokens it accepts.
    pub tokens: AdminTokens,
}

impl Daemon {
    /// A target without a state directory serving `subsystems`.
    pub fn start(subsystems: &[SubsystemConfig]) -> Daemon {
        Daemon::start_with(Target::new(None).expect("target"), subsystems)
    }

    /// Starts `target` after adding `subsystems` to it.
    pub fn start_with(target: Arc<Target>, subsystems: &[SubsystemConfig]) -> Daemon {
        Daemon::start_with_tokens(target, subsystems, test_tokens())
    }

    /// [`Daemon::start_with`], its admin API accepting `tokens`.
    pub fn start_with_tokens(
        target: Arc<Target>,
        subsystems: &[SubsystemConfig],
        tokens: AdminTokens,
    ) -> Daemon {
        for s in subsystems {
            target.put_subsystem(s).expect("put_subsystem");
        }
        let opts = StartOptions {
            admin: Some(tk::admin(LOOPBACK, tokens.clone())),
            ..tk::loopback()
        };
        let serving = tk::start(&target, &opts);
        Daemon {
            addr: serving.addr,
            api: serving.admin_addr(),
            tokens,
            target,
            serving,
        }
    }

    /// Stops the daemon: drains in-flight commands and flushes backends.
    pub fn shutdown(mut self) {
        self.serving.stop();
    }
}

/// A zero-filled sparse file of `size` bytes on the build disk.
pub fn scratch_file(size: u64) -> (tempfile::TempDir, PathBuf) {
    nvpool_testkit::scratch_file(env!("CARGO_TARGET_TMPDIR"), size)
}

// ----- PDUs -----

/// One PDU received from the target, whole.
#[derive(Debug, Clone)]
pub struct Pdu {
    pub ch: CommonHeader,
    pub raw: Vec<u8>,
}

impl Pdu {
    pub fn kind(&self) -> PduType {
        self.ch.pdu_type
    }

    pub fn cqe(&self) -> Cqe {
        tcp::decode_capsule_resp(&self.raw).expect("CapsuleResp decodes")
    }

    pub fn term(&self) -> TermReq {
        TermReq::decode(&self.raw).expect("TermReq decodes")
    }

    /// The offending header a TermReq quotes.
    pub fn term_quote(&self) -> &[u8] {
        &self.raw[tcp::TERM_HLEN..]
    }

    pub fn r2t(&self) -> R2t {
        R2t::decode(&self.raw).expect("R2T decodes")
    }
}

/// Encodes a CapsuleCmd with optional in-capsule data (and its digest).
pub fn capsule_pdu(sqe: &Sqe, icd: &[u8], dg: Digests) -> Vec<u8> {
    let mut hdr = [0u8; tcp::CAPSULE_CMD_HLEN + tcp::DIGEST_LEN];
    let n = encode_capsule_cmd(sqe, icd.len(), dg, &mut hdr);
    let mut v = hdr[..n].to_vec();
    v.extend_from_slice(icd);
    if dg.data && !icd.is_empty() {
        v.extend_from_slice(&nvpool_wire::digest::crc32c(icd).to_le_bytes());
    }
    v
}

/// Encodes an H2CData PDU.
pub fn h2c_pdu(cccid: u16, ttag: u16, datao: u32, data: &[u8], last: bool, dg: Digests) -> Vec<u8> {
    let mut hdr = [0u8; tcp::DATA_HLEN + tcp::DIGEST_LEN];
    let h = DataHeader {
        cccid,
        ttag,
        datao,
        datal: data.len() as u32,
    };
    let n = h.encode(
        PduType::H2CData,
        if last { flags::LAST_PDU } else { 0 },
        dg,
        &mut hdr,
    );
    let mut v = hdr[..n].to_vec();
    v.extend_from_slice(data);
    if dg.data {
        v.extend_from_slice(&nvpool_wire::digest::crc32c(data).to_le_bytes());
    }
    v
}

// ----- commands -----

/// What one command returned.
#[derive(Debug, Clone)]
pub struct Completion {
    pub cid: u16,
    pub status: Status,
    pub dw0: u32,
    pub dw1: u32,
    /// Controller-to-host data, in order.
    pub data: Vec<u8>,
    /// Completed by a C2HData PDU with the SUCCESS flag (no CapsuleResp).
    pub by_success_flag: bool,
}

impl Completion {
    #[track_caller]
    pub fn ok(&self) -> &Completion {
        assert!(
            self.status.is_success(),
            "command {} failed: {}",
            self.cid,
            self.status
        );
        self
    }

    #[track_caller]
    pub fn expect_status(&self, want: Status) {
        assert_eq!(
            (self.status.sct, self.status.sc, self.status.dnr),
            (want.sct, want.sc, want.dnr),
            "command {}: got {}, want {}",
            self.cid,
            self.status,
            want
        );
    }
}

pub fn read_cmd(nsid: u32, slba: u64, blocks: u32, block_size: usize) -> Sqe {
    let mut s = Sqe::new(nvm::READ, 0);
    s.set_nsid(nsid);
    s.set_slba(slba);
    s.set_nlb((blocks - 1) as u16);
    s.set_sgl(Sgl {
        addr: 0,
        len: blocks * block_size as u32,
        id: sgl_id::TRANSPORT,
    });
    s
}

/// A Write without its SGL (set when submitted, from the data).
pub fn write_cmd(nsid: u32, slba: u64, blocks: u32, fua: bool) -> Sqe {
    let mut s = Sqe::new(nvm::WRITE, 0);
    s.set_nsid(nsid);
    s.set_slba(slba);
    s.set_nlb((blocks - 1) as u16);
    if fua {
        s.set_cdw(12, s.cdw(12) | 1 << 30);
    }
    s
}

pub fn flush_cmd(nsid: u32) -> Sqe {
    let mut s = Sqe::new(nvm::FLUSH, 0);
    s.set_nsid(nsid);
    s.set_sgl(NULL_SGL);
    s
}

pub fn write_zeroes_cmd(nsid: u32, slba: u64, blocks: u32) -> Sqe {
    let mut s = Sqe::new(nvm::WRITE_ZEROES, 0);
    s.set_nsid(nsid);
    s.set_slba(slba);
    s.set_nlb((blocks - 1) as u16);
    s.set_sgl(NULL_SGL);
    s
}

/// Dataset Management with the deallocate attribute and `ranges` ranges.
pub fn dsm_cmd(nsid: u32, ranges: usize) -> Sqe {
    let mut s = Sqe::new(nvm::DATASET_MANAGEMENT, 0);
    s.set_nsid(nsid);
    s.set_cdw(10, ranges as u32 - 1);
    s.set_cdw(11, 1 << 2);
    s
}

/// The 4096-byte DSM range buffer the Linux host sends: (SLBA, NLB) ranges,
/// NLB a 1-based count, the rest zero.
pub fn dsm_ranges(ranges: &[(u64, u32)]) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    for (i, &(slba, nlb)) in ranges.iter().enumerate() {
        b[i * 16 + 4..i * 16 + 8].copy_from_slice(&nlb.to_le_bytes());
        b[i * 16 + 8..i * 16 + 16].copy_from_slice(&slba.to_le_bytes());
    }
    b
}

pub fn identify_cmd(cns: u8, nsid: u32) -> Sqe {
    let mut s = Sqe::new(admin::IDENTIFY, 0);
    s.set_nsid(nsid);
    s.set_cdw(10, cns as u32);
    s.set_sgl(Sgl {
        addr: 0,
        len: IDENTIFY_LEN as u32,
        id: sgl_id::TRANSPORT,
    });
    s
}

// ----- the host -----

/// One NVMe/TCP connection (one queue) to the target.
#[derive(Debug)]
pub struct Conn {
    pub sock: TcpStream,
    pub dg: Digests,
    /// From ICResp.
    pub maxh2cdata: u32,
    /// Writes up to this size go in-capsule; larger ones wait for an R2T.
    pub inline_max: usize,
    /// Bytes per H2CData PDU (further capped by MAXH2CDATA), small enough
    /// that large writes take several PDUs.
    pub h2c_chunk: usize,
    /// CNTLID of the controller this queue belongs to (after Connect).
    pub cntlid: u16,
    next_cid: u16,
    /// Write data waiting for R2Ts, by CID.
    writes: HashMap<u16, Vec<u8>>,
    /// Read data received so far, by CID.
    reads: HashMap<u16, Vec<u8>>,
}

impl Conn {
    /// Opens a TCP connection (no ICReq yet).
    pub fn open(addr: SocketAddr) -> Conn {
        let sock = TcpStream::connect(addr).expect("connect to target");
        sock.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
        sock.set_nodelay(true).expect("nodelay");
        Conn {
            sock,
            dg: Digests::default(),
            maxh2cdata: 0,
            inline_max: nvpool_target::limits::IO_INLINE_DATA_BYTES,
            h2c_chunk: 16 << 10,
            cntlid: 0,
            next_cid: 1,
            writes: HashMap::new(),
            reads: HashMap::new(),
        }
    }

    /// Opens a connection and exchanges ICReq/ICResp.
    pub fn open_ic(addr: SocketAddr, dg: Digests) -> Conn {
        let mut c = Conn::open(addr);
        c.icreq(dg);
        c
    }

    /// Sends ICReq and checks ICResp as the Linux host does.
    pub fn icreq(&mut self, dg: Digests) -> IcResp {
        self.send_raw(
            &IcReq {
                pfv: 0,
                hpda: 0,
                digests: dg,
                maxr2t: 0,
            }
            .encode(),
        );
        let mut b = [0u8; tcp::IC_PDU_LEN];
        self.sock.read_exact(&mut b).expect("ICResp arrives");
        let r = IcResp::decode(&b).expect("ICResp decodes");
        assert_eq!((r.pfv, r.cpda), (0, 0), "PFV and CPDA must be 0");
        assert_eq!(r.digests, dg, "digests must echo the request");
        assert!(
            r.maxh2cdata >= 4096 && r.maxh2cdata.is_multiple_of(4),
            "MAXH2CDATA {}",
            r.maxh2cdata
        );
        self.dg = dg;
        self.maxh2cdata = r.maxh2cdata;
        r
    }

    pub fn send_raw(&mut self, b: &[u8]) {
        self.sock.write_all(b).expect("send to target");
    }

    /// Like [`Conn::send_raw`], but the target may already have closed.
    pub fn try_send_raw(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.sock.write_all(b)
    }

    /// Receives one whole PDU and checks its framing and digests.
    pub fn recv_pdu(&mut self) -> std::io::Result<Pdu> {
        let mut ch_raw = [0u8; tcp::CH_LEN];
        self.sock.read_exact(&mut ch_raw)?;
        let ch = CommonHeader::decode(&ch_raw).map_err(|e| {
            std::io::Error::new(
                ErrorKind::InvalidData,
                format!("bad header {ch_raw:02x?}: {e}"),
            )
        })?;
        let plen = ch.plen as usize;
        assert!(plen <= 1 << 22, "implausible PLEN {plen}");
        let mut raw = vec![0u8; plen];
        raw[..tcp::CH_LEN].copy_from_slice(&ch_raw);
        self.sock.read_exact(&mut raw[tcp::CH_LEN..])?;
        let t = ch.pdu_type;
        assert!(
            matches!(
                t,
                PduType::CapsuleResp | PduType::C2HData | PduType::R2T | PduType::C2HTermReq
            ),
            "a target may not send {t:?}"
        );
        assert_eq!(ch.hlen as usize, 24, "C2H PDUs have HLEN 24");
        if t == PduType::C2HTermReq {
            assert!((24..=152).contains(&plen), "C2HTermReq PLEN {plen}");
            assert_eq!(
                ch.flags & (flags::HDGSTF | flags::DDGSTF),
                0,
                "TermReq carries no digests"
            );
            return Ok(Pdu { ch, raw });
        }
        if self.dg.header {
            assert_ne!(ch.flags & flags::HDGSTF, 0, "{t:?} without HDGSTF");
            assert!(
                tcp::header_digest_ok(&raw, 24),
                "{t:?} header digest mismatch"
            );
        } else {
            assert_eq!(
                ch.flags & flags::HDGSTF,
                0,
                "{t:?} with HDGSTF but no header digest"
            );
        }
        if t == PduType::C2HData {
            let h = DataHeader::decode(&ch, &raw, self.dg).expect("C2HData header");
            assert_eq!(
                ch.pdo as usize,
                24 + self.dg.hdgst_len(),
                "C2H data must not be padded"
            );
            if self.dg.data {
                assert_ne!(ch.flags & flags::DDGSTF, 0, "C2HData without DDGSTF");
                let s = ch.pdo as usize;
                let e = s + h.datal as usize;
                let want = nvpool_wire::digest::crc32c(&raw[s..e]).to_le_bytes();
                assert_eq!(raw[e..e + 4], want, "C2HData data digest mismatch");
            }
        } else {
            assert_eq!(ch.pdo, 0, "{t:?} carries no data");
            assert_eq!(plen, 24 + self.dg.hdgst_len(), "{t:?} PLEN");
        }
        Ok(Pdu { ch, raw })
    }

    /// The next PDU, which must be a C2HTermReq; returns (FES, FEI, PDU).
    #[track_caller]
    pub fn expect_term(&mut self) -> (u16, u32, Pdu) {
        let p = match self.recv_pdu() {
            Ok(p) => p,
            Err(e) => panic!("expected a C2HTermReq, got {e}"),
        };
        assert_eq!(
            p.kind(),
            PduType::C2HTermReq,
            "expected a C2HTermReq, got {p:?}"
        );
        let t = p.term();
        (t.fes, t.fei, p)
    }

    /// Waits until the target closes the connection. Returns the bytes that
    /// arrived before the close.
    #[track_caller]
    pub fn expect_closed(&mut self, within: Duration) -> Vec<u8> {
        let deadline = Instant::now() + within;
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "connection still open after {within:?} ({} bytes came)",
                got.len()
            );
            self.sock.set_read_timeout(Some(left)).expect("timeout");
            match self.sock.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break, // reset: closed as well
            }
        }
        self.sock
            .set_read_timeout(Some(IO_TIMEOUT))
            .expect("timeout");
        got
    }

    /// True when nothing arrives and the connection stays open for `dur`.
    pub fn quiet_for(&mut self, dur: Duration) -> bool {
        let deadline = Instant::now() + dur;
        let mut b = [0u8; 1];
        let quiet = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break true;
            }
            self.sock.set_read_timeout(Some(left)).expect("timeout");
            match self.sock.read(&mut b) {
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                _ => break false,
            }
        };
        self.sock
            .set_read_timeout(Some(IO_TIMEOUT))
            .expect("timeout");
        quiet
    }

    pub fn close(self) {
        let _ = self.sock.shutdown(Shutdown::Both);
    }

    fn take_cid(&mut self) -> u16 {
        let c = self.next_cid;
        self.next_cid = self.next_cid.wrapping_add(1);
        if self.next_cid == 0xFFFF {
            self.next_cid = 1;
        }
        c
    }

    /// Sends a command as built (SGL included); returns its CID.
    pub fn submit(&mut self, sqe: Sqe) -> u16 {
        self.try_submit(sqe).expect("send command")
    }

    pub fn try_submit(&mut self, mut sqe: Sqe) -> std::io::Result<u16> {
        let cid = self.take_cid();
        sqe.set_cid(cid);
        let dg = self.dg;
        self.try_send_raw(&capsule_pdu(&sqe, &[], dg))?;
        Ok(cid)
    }

    /// Sends a host-to-controller command with `data`, in-capsule or (for
    /// `in_capsule` false) announced for R2T; returns its CID.
    pub fn submit_write(&mut self, sqe: Sqe, data: Vec<u8>, in_capsule: bool) -> u16 {
        self.try_submit_write(sqe, data, in_capsule)
            .expect("send command")
    }

    pub fn try_submit_write(
        &mut self,
        mut sqe: Sqe,
        data: Vec<u8>,
        in_capsule: bool,
    ) -> std::io::Result<u16> {
        let cid = self.take_cid();
        sqe.set_cid(cid);
        let dg = self.dg;
        if in_capsule {
            sqe.set_sgl(Sgl {
                addr: 0,
                len: data.len() as u32,
                id: sgl_id::IN_CAPSULE,
            });
            self.try_send_raw(&capsule_pdu(&sqe, &data, dg))?;
        } else {
            sqe.set_sgl(Sgl {
                addr: 0,
                len: data.len() as u32,
                id: sgl_id::TRANSPORT,
            });
            self.writes.insert(cid, data);
            self.try_send_raw(&capsule_pdu(&sqe, &[], dg))?;
        }
        Ok(cid)
    }

    /// Receives PDUs until some command completes, answering R2Ts and
    /// collecting C2H data on the way.
    pub fn next_completion(&mut self) -> Completion {
        match self.try_next_completion() {
            Ok(c) => c,
            Err(e) => panic!("waiting for a completion: {e}"),
        }
    }

    /// Like [`Conn::next_completion`]; Err when the connection fails or closes.
    pub fn try_next_completion(&mut self) -> std::io::Result<Completion> {
        loop {
            let p = self.recv_pdu()?;
            match p.kind() {
                PduType::CapsuleResp => {
                    let q = p.cqe();
                    self.writes.remove(&q.cid);
                    return Ok(Completion {
                        cid: q.cid,
                        status: q.status,
                        dw0: q.dw0,
                        dw1: q.dw1,
                        data: self.reads.remove(&q.cid).unwrap_or_default(),
                        by_success_flag: false,
                    });
                }
                PduType::C2HData => {
                    let h = DataHeader::decode(&p.ch, &p.raw, self.dg).expect("C2HData");
                    let s = p.ch.pdo as usize;
                    let buf = self.reads.entry(h.cccid).or_default();
                    assert_eq!(h.datao as usize, buf.len(), "C2HData must arrive in order");
                    buf.extend_from_slice(&p.raw[s..s + h.datal as usize]);
                    let last = p.ch.flags & flags::LAST_PDU != 0;
                    if p.ch.flags & flags::SUCCESS != 0 {
                        assert!(last, "SUCCESS without LAST_PDU");
                        return Ok(Completion {
                            cid: h.cccid,
                            status: Status::SUCCESS,
                            dw0: 0,
                            dw1: 0,
                            data: self.reads.remove(&h.cccid).unwrap_or_default(),
                            by_success_flag: true,
                        });
                    }
                }
                PduType::R2T => self.answer_r2t(p.r2t())?,
                PduType::C2HTermReq => {
                    let t = p.term();
                    panic!(
                        "target terminated the connection: FES {:#x} FEI {}",
                        t.fes, t.fei
                    );
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }

    fn answer_r2t(&mut self, r: R2t) -> std::io::Result<()> {
        let data = self
            .writes
            .get(&r.cccid)
            .unwrap_or_else(|| panic!("R2T for unknown CID {r:?}"));
        let (start, end) = (r.r2to as usize, r.r2to as usize + r.r2tl as usize);
        assert!(end <= data.len(), "R2T beyond the write: {r:?}");
        let chunk = self.h2c_chunk.min(self.maxh2cdata as usize).max(1);
        let mut out = Vec::new();
        let mut off = start;
        while off < end {
            let n = chunk.min(end - off);
            let last = off + n == end;
            out.extend(h2c_pdu(
                r.cccid,
                r.ttag,
                off as u32,
                &data[off..off + n],
                last,
                self.dg,
            ));
            off += n;
        }
        self.try_send_raw(&out)
    }

    /// Waits for the completion of `cid`, which must be the next one.
    #[track_caller]
    pub fn wait(&mut self, cid: u16) -> Completion {
        let c = self.next_completion();
        assert_eq!(c.cid, cid, "completion for an unexpected CID");
        c
    }

    pub fn exec(&mut self, sqe: Sqe) -> Completion {
        let cid = self.submit(sqe);
        self.wait(cid)
    }

    pub fn exec_write(&mut self, sqe: Sqe, data: Vec<u8>, in_capsule: bool) -> Completion {
        let cid = self.submit_write(sqe, data, in_capsule);
        self.wait(cid)
    }

    // ----- fabrics and admin -----

    #[allow(clippy::too_many_arguments)]
    pub fn connect_cmd(
        &mut self,
        qid: u16,
        sqsize: u16,
        cattr: u8,
        kato_ms: u32,
        subnqn: &str,
        hostnqn: &str,
        cntlid: u16,
    ) -> Completion {
        let sqe = ConnectCmd {
            recfmt: 0,
            qid,
            sqsize,
            cattr,
            kato_ms,
        }
        .to_sqe(0);
        let hostid = host_id(hostnqn);
        let data = ConnectData {
            hostid,
            cntlid,
            subnqn,
            hostnqn,
        }
        .encode();
        let c = self.exec_write(sqe, data.to_vec(), true);
        if c.status.is_success() && qid == 0 {
            self.cntlid = c.dw0 as u16;
        } else if c.status.is_success() {
            self.cntlid = cntlid;
        }
        c
    }

    /// Admin Connect as the Linux host sends it (SQSIZE 31, CNTLID 0xFFFF).
    pub fn admin_connect(&mut self, subnqn: &str, hostnqn: &str, kato_ms: u32) -> Completion {
        self.inline_max = nvpool_target::limits::ADMIN_INLINE_DATA_BYTES;
        self.connect_cmd(0, 31, 0, kato_ms, subnqn, hostnqn, 0xFFFF)
    }

    pub fn io_connect(
        &mut self,
        subnqn: &str,
        hostnqn: &str,
        cntlid: u16,
        qid: u16,
        sqsize: u16,
    ) -> Completion {
        self.connect_cmd(qid, sqsize, 0, 0, subnqn, hostnqn, cntlid)
    }

    pub fn prop_get_cmd(&mut self, offset: u32, size8: bool) -> Completion {
        self.exec(
            PropertyCmd {
                size8,
                offset,
                value: 0,
            }
            .to_sqe(0, fctype::PROPERTY_GET),
        )
    }

    #[track_caller]
    pub fn prop_get(&mut self, offset: u32, size8: bool) -> u64 {
        let c = self.prop_get_cmd(offset, size8);
        c.ok();
        c.dw0 as u64 | (c.dw1 as u64) << 32
    }

    pub fn prop_set(&mut self, offset: u32, value: u64) -> Completion {
        self.exec(
            PropertyCmd {
                size8: false,
                offset,
                value,
            }
            .to_sqe(0, fctype::PROPERTY_SET),
        )
    }

    /// CC.EN=1 the Linux way, then poll CSTS until RDY.
    #[track_caller]
    pub fn enable(&mut self) {
        self.prop_set(prop::CC, cc::LINUX_ENABLE as u64).ok();
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let st = self.prop_get(prop::CSTS, false) as u32;
            assert_eq!(st & csts::CFS, 0, "controller fatal status after enable");
            if st & csts::RDY != 0 {
                return;
            }
            assert!(Instant::now() < deadline, "CSTS.RDY never came");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    pub fn identify(&mut self, cns: u8, nsid: u32) -> Completion {
        self.exec(identify_cmd(cns, nsid))
    }

    #[track_caller]
    pub fn identify_controller(&mut self) -> IdentifyController {
        let c = self.identify(identify::cns::CONTROLLER, 0);
        c.ok();
        assert_eq!(c.data.len(), IDENTIFY_LEN);
        IdentifyController::decode(&c.data).expect("Identify Controller decodes")
    }

    #[track_caller]
    pub fn identify_namespace(&mut self, nsid: u32) -> IdentifyNamespace {
        let c = self.identify(identify::cns::NAMESPACE, nsid);
        c.ok();
        IdentifyNamespace::decode(&c.data).expect("Identify Namespace decodes")
    }

    #[track_caller]
    pub fn ns_descriptors(&mut self, nsid: u32) -> Vec<NsId> {
        let c = self.identify(identify::cns::NS_DESCRIPTORS, nsid);
        c.ok();
        identify::decode_ns_descriptors(&c.data).expect("descriptors decode")
    }

    #[track_caller]
    pub fn active_namespaces(&mut self, after: u32) -> Vec<u32> {
        let c = self.identify(identify::cns::ACTIVE_NS_LIST, after);
        c.ok();
        identify::decode_active_ns_list(&c.data).expect("NS list decodes")
    }

    pub fn set_features(&mut self, fid: u8, cdw11: u32) -> Completion {
        let mut s = Sqe::new(admin::SET_FEATURES, 0);
        s.set_cdw(10, fid as u32);
        s.set_cdw(11, cdw11);
        s.set_sgl(NULL_SGL);
        self.exec(s)
    }

    /// Set Features Number of Queues; returns the granted (NSQA, NCQA), 1-based.
    #[track_caller]
    pub fn set_queue_count(&mut self, n: u16) -> (u16, u16) {
        let c = self.set_features(0x07, (n as u32 - 1) | (n as u32 - 1) << 16);
        c.ok();
        ((c.dw0 & 0xFFFF) as u16 + 1, (c.dw0 >> 16) as u16 + 1)
    }

    pub fn get_log_page(&mut self, lid: u8, nsid: u32, offset: u64, len: u64) -> Completion {
        self.exec(
            GetLogPage {
                lid,
                rae: true,
                len,
                offset,
            }
            .to_sqe(0, nsid),
        )
    }

    pub fn keep_alive(&mut self) -> Completion {
        let mut s = Sqe::new(admin::KEEP_ALIVE, 0);
        s.set_sgl(NULL_SGL);
        self.exec(s)
    }

    // ----- I/O -----

    pub fn read(&mut self, nsid: u32, slba: u64, blocks: u32, block_size: usize) -> Completion {
        self.exec(read_cmd(nsid, slba, blocks, block_size))
    }

    /// Reads and checks success and length; returns the data.
    #[track_caller]
    pub fn read_ok(&mut self, nsid: u32, slba: u64, blocks: u32, block_size: usize) -> Vec<u8> {
        let c = self.read(nsid, slba, blocks, block_size);
        c.ok();
        assert_eq!(
            c.data.len(),
            blocks as usize * block_size,
            "read returned a short buffer"
        );
        c.data
    }

    /// Writes in-capsule when the data fits, else through R2T/H2CData.
    pub fn write(
        &mut self,
        nsid: u32,
        slba: u64,
        data: &[u8],
        block_size: usize,
        fua: bool,
    ) -> Completion {
        let in_capsule = data.len() <= self.inline_max;
        self.write_via(nsid, slba, data, block_size, fua, in_capsule)
    }

    pub fn write_via(
        &mut self,
        nsid: u32,
        slba: u64,
        data: &[u8],
        block_size: usize,
        fua: bool,
        in_capsule: bool,
    ) -> Completion {
        let blocks = (data.len() / block_size) as u32;
        self.exec_write(
            write_cmd(nsid, slba, blocks, fua),
            data.to_vec(),
            in_capsule,
        )
    }

    pub fn flush(&mut self, nsid: u32) -> Completion {
        self.exec(flush_cmd(nsid))
    }

    pub fn write_zeroes(&mut self, nsid: u32, slba: u64, blocks: u32) -> Completion {
        self.exec(write_zeroes_cmd(nsid, slba, blocks))
    }

    /// DSM deallocate with the 4096-byte range buffer the Linux host sends.
    pub fn deallocate(&mut self, nsid: u32, ranges: &[(u64, u32)]) -> Completion {
        let in_capsule = 4096 <= self.inline_max;
        self.exec_write(dsm_cmd(nsid, ranges.len()), dsm_ranges(ranges), in_capsule)
    }
}

/// A stable HOSTID per host NQN.
pub fn host_id(hostnqn: &str) -> [u8; 16] {
    let a = nvpool_wire::digest::crc32c(hostnqn.as_bytes());
    let mut id = [0u8; 16];
    for (i, c) in id.chunks_mut(4).enumerate() {
        c.copy_from_slice(&(a ^ i as u32).to_le_bytes());
    }
    id
}

/// An enabled admin queue of a new controller (KATO 30 s).
#[track_caller]
pub fn admin_session(addr: SocketAddr, dg: Digests, subnqn: &str, hostnqn: &str) -> Conn {
    let mut a = Conn::open_ic(addr, dg);
    a.admin_connect(subnqn, hostnqn, 30_000).ok();
    a.enable();
    a
}

/// An I/O queue `qid` (128 entries) of controller `cntlid`.
#[track_caller]
pub fn io_session(
    addr: SocketAddr,
    dg: Digests,
    subnqn: &str,
    hostnqn: &str,
    cntlid: u16,
    qid: u16,
) -> Conn {
    let mut q = Conn::open_ic(addr, dg);
    q.io_connect(subnqn, hostnqn, cntlid, qid, 127).ok();
    q
}

/// A controller with an enabled admin queue and I/O queue 1.
#[track_caller]
pub fn controller(addr: SocketAddr, dg: Digests, subnqn: &str, hostnqn: &str) -> (Conn, Conn) {
    let mut a = admin_session(addr, dg, subnqn, hostnqn);
    a.set_queue_count(4);
    let cntlid = a.cntlid;
    let q = io_session(addr, dg, subnqn, hostnqn, cntlid, 1);
    (a, q)
}

pub const NO_DIGESTS: Digests = Digests {
    header: false,
    data: false,
};
pub const ALL_DIGESTS: Digests = Digests {
    header: true,
    data: true,
};

// ----- admin API over HTTP/1.1 -----

/// A response of the admin API.
#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub content_type: Option<String>,
    pub www_authenticate: Option<String>,
    pub body: String,
}

impl HttpResponse {
    #[track_caller]
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }
}

/// One request with `Connection: close` and the test daemons' token;
/// handles Content-Length and chunked bodies.
pub fn http(api: SocketAddr, method: &str, path: &str, body: Option<&str>) -> HttpResponse {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    http_auth(api, Some(&auth), method, path, body)
}

/// [`http`] with this `Authorization` header value, or none.
pub fn http_auth(
    api: SocketAddr,
    authorization: Option<&str>,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> HttpResponse {
    let mut s = TcpStream::connect(api).expect("connect to admin API");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    let body = body.unwrap_or("");
    let auth = authorization.map_or(String::new(), |a| format!("Authorization: {a}\r\n"));
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {api}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("send request");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    let text = String::from_utf8(raw).expect("UTF-8 response");
    let (head, rest) = text.split_once("\r\n\r\n").expect("response head");
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad status line in {head:?}"));
    let mut content_type = None;
    let mut www_authenticate = None;
    let mut chunked = false;
    for l in lines {
        let (k, v) = l.split_once(':').expect("header line");
        match k.trim().to_ascii_lowercase().as_str() {
            "content-type" => content_type = Some(v.trim().to_owned()),
            "www-authenticate" => www_authenticate = Some(v.trim().to_owned()),
            "transfer-encoding" => chunked = v.trim().eq_ignore_ascii_case("chunked"),
            _ => {}
        }
    }
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_owned()
    };
    HttpResponse {
        status,
        content_type,
        www_authenticate,
        body,
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n").expect("chunk size line");
        let n = usize::from_str_radix(size.trim(), 16).expect("chunk size");
        if n == 0 {
            return out;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
}

/// Sends an Asynchronous Event Request with `cid`; it stays outstanding
/// until the target has an event.
pub fn send_aer(c: &mut Conn, cid: u16) {
    let mut s = Sqe::new(admin::ASYNC_EVENT_REQUEST, cid);
    s.set_sgl(NULL_SGL);
    let dg = c.dg;
    c.send_raw(&capsule_pdu(&s, &[], dg));
}

/// The completion of the outstanding AER `cid`, which must come within
/// `within`; returns its DW0 (the event).
#[track_caller]
pub fn expect_aer(c: &mut Conn, cid: u16, within: Duration) -> u32 {
    c.sock.set_read_timeout(Some(within)).expect("timeout");
    let p = c
        .recv_pdu()
        .unwrap_or_else(|e| panic!("no asynchronous event within {within:?}: {e}"));
    c.sock.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    let q = p.cqe();
    assert_eq!(q.cid, cid);
    assert!(q.status.is_success(), "{}", q.status);
    q.dw0
}

// ----- the daemon binary -----

/// `nvpool-target` with none of its settings taken from this process's
/// environment, logging warnings only.
pub fn daemon_bin() -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_nvpool-target"));
    c.env_remove("NVPOOL_CONTROL_PLANE")
        .env_remove("NVPOOL_TARGET_TOKEN_FILE")
        .env_remove("NVPOOL_TARGET_ADMIN_TOKEN_FILE")
        .env_remove("NVPOOL_TARGET_CONFIG")
        .env_remove("NVPOOL_TARGET_STATE_DIR")
        .env("NVPOOL_LOG", "warn");
    c
}

/// Runs the daemon with `args` expecting it to refuse to start; returns
/// what it wrote to stderr.
#[track_caller]
pub fn start_error(args: &[&str]) -> String {
    let mut cmd = daemon_bin();
    cmd.args(["--listen", "127.0.0.1:0"]);
    if !args.contains(&"--admin-listen") {
        cmd.args(["--admin-listen", "127.0.0.1:0"]);
    }
    let out = cmd.args(args).output().unwrap();
    assert!(!out.status.success(), "{args:?} started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}
