//! Seeded simulation of one NVMe/TCP association driving the real queue
//! core (`nvpool_target::queue::Queue`) without sockets or a ring, as
//! `mirror_sim.rs` drives the copy guard.
//!
//! # Model
//!
//! A host opens an admin queue and one I/O queue to a target that exports
//! a RAM namespace. The simulation plays both the host and the reactor:
//!
//! - the host writes whole PDUs into a byte stream; the "network" hands the
//!   target a random number of bytes at a time, and the reactor's parser
//!   (check the common header at 8 bytes, then the whole PDU) feeds
//!   `Queue::on_pdu`, as `reactor.rs` does;
//! - the target's transmit queue is written out a random number of bytes at
//!   a time (partial sends), its sent slots reclaimed, and the host parses
//!   what arrived;
//! - each turn the reactor takes freed pool buffers back and grants them to
//!   waiting commands (`BufPool`, a two-buffer budget so large transfers
//!   wait), and now and then ticks the queues;
//! - the namespace is RAM (the queue runs I/O inline) or a file, whose
//!   operations the queue hands to the reactor's ring as values
//!   (`Exec::ring`, a `Submit`): here a simulated ring holds them and
//!   performs them on an in-memory disk, in random order, now and then
//!   transferring fewer bytes than asked (the queue asks for the rest) or
//!   answering a fallocate with EOPNOTSUPP (the queue falls back).
//!
//! Connect: ICReq/ICResp (random header and data digests), Fabrics Connect
//! of the admin queue, Property Set CC.EN, Connect of the I/O queue.
//!
//! I/O: reads and writes of 1 to 256 blocks at random offsets, at most
//! `DEPTH - 1` outstanding, never two over the same bytes (so the model is
//! exact): a write's data in-capsule or by R2T/H2CData in chunks of random
//! size, the chunks of different commands interleaved at random; Write
//! Zeroes; reads and writes larger than the MDTS, which are refused.
//!
//! # Endings
//!
//! - clean: every command answered, the I/O queue closed gracefully;
//! - vanish: the host stops in the middle of a PDU (a command's or its
//!   data's) and the reactor closes the connection (EOF), commands maybe
//!   still in the backend;
//! - malformed: the host sends a PDU the queue must refuse (unknown type,
//!   wrong HLEN, a second ICReq, a PDU longer than allowed, H2CData for an
//!   unknown transfer tag or outside its range), after which it reads
//!   nothing more and its last PDU is a C2HTermReq.
//!
//! # Invariants
//!
//! - Every command is answered exactly once, and only a command in
//!   flight; successfully, but for one over the MDTS (Invalid Field, no
//!   R2T, no data); a read returns the model's bytes, a write's bytes
//!   become the model's on its answer.
//! - An R2T asks for the whole write; C2HData comes in order.
//! - The queue's count of backend operations in flight is what the ring
//!   holds; once it is `Closed` it submits nothing more.
//! - No panic; after the close (and the ring's last completions) the queue
//!   is `Closed` and not poisoned, holds no command, and every pool buffer
//!   is back.
//!
//! Reproduce one seed: `QUEUE_SIM_SEED=123 cargo test -p nvpool-target --test queue_sim`;
//! run more: `QUEUE_SIM_SEEDS=5000`.

use nvpool_rt::random::Rng;
use nvpool_target::backend::CompletionSink;
use nvpool_target::bufpool::BufPool;
use nvpool_target::config::{NamespaceConfig, SubsystemConfig};
use nvpool_target::limits;
use nvpool_target::queue::{
    split_user_data, user_data_tag, Exec, FileOp, FileOpKind, Phase, Queue, Submit, Tx,
};
use nvpool_target::Target;
use nvpool_wire::fabrics::{cc, fctype, prop, ConnectCmd, ConnectData, PropertyCmd};
use nvpool_wire::sqe::{nvm, sgl_id};
use nvpool_wire::tcp::{
    self, flags, CommonHeader, DataHeader, Digests, IcReq, PduType, R2t, TermReq,
};
use nvpool_wire::{Cqe, Sgl, Sqe, Status};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

const NQN: &str = "nqn.2026-11.io.nvpool:queue-sim";
const HOST: &str = "nqn.2026-11.io.nvpool:queue-sim-host";
/// The namespace: small, so a seed runs in a few milliseconds.
const NS_BYTES: usize = 1 << 20;
const BLOCK_BYTES: usize = 512;
const BLOCKS: usize = NS_BYTES / BLOCK_BYTES;
/// Entries of the I/O queue (SQSIZE + 1).
const DEPTH: u16 = 16;
/// Host actions per seed before the ending.
const STEPS: usize = 300;
/// Seeds a default run covers.
const SEEDS: u64 = 300;

/// The seeded generator: the whole run follows from its seed.
struct SimRng(Rng);

impl SimRng {
    fn below(&mut self, n: usize) -> usize {
        self.0.below(n.max(1) as u64) as usize
    }
    fn chance(&mut self, pct: usize) -> bool {
        self.below(100) < pct
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.0.fill(&mut v);
        v
    }
}

/// The ring of a file namespace: the operations the queue submitted, and
/// the file's bytes (offsets are the namespace's: the file is all of it).
#[derive(Debug)]
struct SimRing {
    pending: Vec<FileOp>,
    disk: Vec<u8>,
    submitted: usize,
}

impl Submit for SimRing {
    unsafe fn submit(&mut self, op: FileOp) {
        self.pending.push(op);
        self.submitted += 1;
    }
}

/// A writer that takes at most `room` bytes: a partial send.
struct Capped<'a> {
    out: &'a mut Vec<u8>,
    room: usize,
}

impl std::io::Write for Capped<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let n = b.len().min(self.room);
        self.out.extend_from_slice(&b[..n]);
        self.room -= n;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Admin,
    Read,
    Write,
    Zeroes,
}

#[derive(Debug)]
struct Cmd {
    op: Op,
    /// Namespace bytes [off, off + len).
    off: usize,
    len: usize,
    /// A write's data.
    data: Vec<u8>,
    /// A write by R2T: its transfer tag and the bytes sent so far.
    r2t: Option<(u16, usize)>,
    /// A read's data received so far.
    got: Vec<u8>,
    /// Over the MDTS: refused with this status.
    refused: Option<Status>,
}

/// What the reactor keeps per connection, and the host's end of it.
struct Conn {
    conn: u32,
    q: Queue,
    tx: Tx,
    dg: Digests,
    /// Host bytes on the network, not yet received by the target.
    wire_out: VecDeque<u8>,
    /// Bytes the target received and has not parsed yet.
    rx: Vec<u8>,
    /// The target still reads (no termination yet).
    reading: bool,
    /// Target bytes the host received and has not parsed yet.
    wire_in: Vec<u8>,
    ic_resp: bool,
    /// The FES of the C2HTermReq the host received.
    term: Option<u16>,
    cmds: BTreeMap<u16, Cmd>,
    /// Answers of admin commands, for the host to read.
    admin_answers: Vec<Cqe>,
    next_cid: u16,
    answered: usize,
}

/// What the connections share: the target, the reactor's pool and clock,
/// the randomness and the namespace's model.
struct Env {
    target: Arc<Target>,
    sink: Arc<CompletionSink>,
    bufs: BufPool,
    now_ms: u64,
    rng: SimRng,
    model: Vec<u8>,
    r2ts: usize,
    /// A file namespace's ring (None: a RAM namespace).
    ring: Option<SimRing>,
    short: usize,
}

impl Env {
    fn exec(&mut self, conn: u32) -> Exec<'_> {
        Exec {
            ring: self.ring.as_mut().map(|r| r as &mut dyn Submit),
            sink: &self.sink,
            bufs: &mut self.bufs,
            conn,
            now_ms: self.now_ms,
        }
    }
}

impl Conn {
    fn new(env: &mut Env, conn: u32) -> Conn {
        let addr = "127.0.0.1:4420".parse().unwrap();
        let peer = format!("127.0.0.1:{}", 40000 + conn).parse().unwrap();
        let dg = Digests {
            header: env.rng.chance(30),
            data: env.rng.chance(30),
        };
        Conn {
            conn,
            q: Queue::new(env.target.clone(), addr, peer, env.now_ms),
            tx: Tx::default(),
            dg,
            wire_out: VecDeque::new(),
            rx: Vec::new(),
            reading: true,
            wire_in: Vec::new(),
            ic_resp: false,
            term: None,
            cmds: BTreeMap::new(),
            admin_answers: Vec::new(),
            next_cid: 1,
            answered: 0,
        }
    }

    fn send_icreq(&mut self) {
        let ic = IcReq {
            pfv: 0,
            hpda: 0,
            digests: self.dg,
            maxr2t: 0,
        };
        self.wire_out.extend(ic.encode());
    }

    fn capsule(&mut self, sqe: &Sqe, icd: &[u8]) {
        let mut hdr = [0u8; tcp::CAPSULE_CMD_HLEN + tcp::DIGEST_LEN];
        let n = tcp::encode_capsule_cmd(sqe, icd.len(), self.dg, &mut hdr);
        self.wire_out.extend(&hdr[..n]);
        self.wire_out.extend(icd);
        if self.dg.data && !icd.is_empty() {
            self.wire_out
                .extend(nvpool_wire::digest::crc32c(icd).to_le_bytes());
        }
    }

    fn h2c(&mut self, cid: u16, ttag: u16, datao: usize, data: &[u8], last: bool) {
        let mut hdr = [0u8; tcp::DATA_HLEN + tcp::DIGEST_LEN];
        let n = DataHeader {
            cccid: cid,
            ttag,
            datao: datao as u32,
            datal: data.len() as u32,
        }
        .encode(
            PduType::H2CData,
            if last { flags::LAST_PDU } else { 0 },
            self.dg,
            &mut hdr,
        );
        self.wire_out.extend(&hdr[..n]);
        self.wire_out.extend(data);
        if self.dg.data {
            self.wire_out
                .extend(nvpool_wire::digest::crc32c(data).to_le_bytes());
        }
    }

    fn cid(&mut self) -> u16 {
        let cid = self.next_cid;
        self.next_cid = self.next_cid.wrapping_add(1).max(1);
        cid
    }

    /// An admin command with in-capsule data `icd`.
    fn admin(&mut self, sqe_of: impl FnOnce(u16) -> Sqe, icd: &[u8]) -> u16 {
        let cid = self.cid();
        let sqe = sqe_of(cid);
        self.capsule(&sqe, icd);
        self.cmds.insert(
            cid,
            Cmd {
                op: Op::Admin,
                off: 0,
                len: 0,
                data: Vec::new(),
                r2t: None,
                got: Vec::new(),
                refused: None,
            },
        );
        cid
    }

    /// The network hands the target up to `n` bytes; the reactor's parser
    /// runs every whole PDU.
    fn deliver(&mut self, env: &mut Env, n: usize) {
        let n = n.min(self.wire_out.len());
        if !self.reading {
            // Nothing is read after a termination.
            self.wire_out.clear();
            return;
        }
        self.rx.extend(self.wire_out.drain(..n));
        while self.reading && self.rx.len() >= tcp::CH_LEN {
            let plen = match self.q.check_header(&self.rx[..tcp::CH_LEN]) {
                Ok(p) => p,
                Err(f) => {
                    self.q.fail(f, &self.rx, &mut self.tx);
                    self.reading = false;
                    break;
                }
            };
            if self.rx.len() < plen {
                break;
            }
            let pdu: Vec<u8> = self.rx.drain(..plen).collect();
            let mut ex = env.exec(self.conn);
            if self.q.on_pdu(&pdu, &mut self.tx, &mut ex).is_err() || self.q.terminated() {
                self.reading = false;
            }
        }
    }

    /// One send of at most `room` bytes, then the host reads what came.
    fn flush(&mut self, env: &mut Env, room: usize) {
        if self.tx.backlog() > 0 && room > 0 {
            let mut w = Capped {
                out: &mut self.wire_in,
                room,
            };
            self.tx.write_to(&mut w).unwrap();
        }
        self.q.reclaim(&mut self.tx);
        self.q.take_returned(&mut env.bufs);
        self.host_read(env);
    }

    /// What the reactor does each turn for this connection: buffers back,
    /// and granted to the oldest waiting command.
    fn reactor_turn(&mut self, env: &mut Env) {
        self.q.take_returned(&mut env.bufs);
        while let Some((ud, b)) = env.bufs.grant() {
            let (conn, slot) = split_user_data(ud);
            assert_eq!(conn, self.conn, "only the I/O queue waits for buffers");
            let mut ex = env.exec(conn);
            if let Some(b) = self.q.on_buffer(slot, b, &mut self.tx, &mut ex) {
                env.bufs.give_back(b);
            }
            self.q.take_returned(&mut env.bufs);
        }
    }

    /// The host parses every whole PDU it received.
    fn host_read(&mut self, env: &mut Env) {
        while self.wire_in.len() >= tcp::CH_LEN {
            let ch = CommonHeader::decode(&self.wire_in).expect("the target sends valid headers");
            let plen = ch.plen as usize;
            if self.wire_in.len() < plen {
                return;
            }
            let pdu: Vec<u8> = self.wire_in.drain(..plen).collect();
            assert!(self.term.is_none(), "a PDU after the C2HTermReq");
            match ch.pdu_type {
                PduType::IcResp => {
                    assert!(!self.ic_resp, "a second ICResp");
                    self.ic_resp = true;
                }
                PduType::CapsuleResp => {
                    let cqe = tcp::decode_capsule_resp(&pdu).unwrap();
                    let cmd = self
                        .cmds
                        .remove(&cqe.cid)
                        .unwrap_or_else(|| panic!("an answer for cid {}, not in flight", cqe.cid));
                    self.answered += 1;
                    if let Some(st) = cmd.refused {
                        assert_eq!(cqe.status, st, "{:?} over the MDTS", cmd.op);
                        assert!(cmd.got.is_empty() && cmd.r2t.is_none());
                        continue;
                    }
                    assert!(
                        cqe.status.is_success(),
                        "{:?} cid {} failed: {}",
                        cmd.op,
                        cqe.cid,
                        cqe.status
                    );
                    match cmd.op {
                        Op::Admin => self.admin_answers.push(cqe),
                        Op::Write => {
                            assert!(
                                cmd.r2t.is_none_or(|(_, sent)| sent == cmd.len),
                                "a write answered before all its data was sent"
                            );
                            env.model[cmd.off..cmd.off + cmd.len].copy_from_slice(&cmd.data);
                        }
                        Op::Zeroes => env.model[cmd.off..cmd.off + cmd.len].fill(0),
                        Op::Read => {
                            assert_eq!(cmd.got.len(), cmd.len, "read cid {} short", cqe.cid);
                            assert!(
                                cmd.got == env.model[cmd.off..cmd.off + cmd.len],
                                "read cid {} of {} bytes at {} returned other data",
                                cqe.cid,
                                cmd.len,
                                cmd.off
                            );
                        }
                    }
                }
                PduType::C2HData => {
                    let h = DataHeader::decode(&ch, &pdu, self.dg).unwrap();
                    let cmd = self
                        .cmds
                        .get_mut(&h.cccid)
                        .expect("data for a command in flight");
                    assert_eq!(cmd.op, Op::Read, "C2HData for a {:?}", cmd.op);
                    assert_eq!(h.datao as usize, cmd.got.len(), "C2HData out of order");
                    assert_eq!(
                        ch.flags & flags::SUCCESS,
                        0,
                        "SUCCESS without SQ flow control disabled"
                    );
                    let at = tcp::data_offset(&ch, self.dg);
                    let data = &pdu[at..at + h.datal as usize];
                    if self.dg.data {
                        let d = &pdu[at + h.datal as usize..];
                        assert_eq!(d, nvpool_wire::digest::crc32c(data).to_le_bytes());
                    }
                    cmd.got.extend_from_slice(data);
                }
                PduType::R2T => {
                    let r = R2t::decode(&pdu).unwrap();
                    let cmd = self
                        .cmds
                        .get_mut(&r.cccid)
                        .expect("an R2T for a command in flight");
                    assert_eq!(cmd.op, Op::Write, "an R2T for a {:?}", cmd.op);
                    assert!(cmd.r2t.is_none(), "a second R2T");
                    assert_eq!((r.r2to, r.r2tl as usize), (0, cmd.len), "R2T range");
                    cmd.r2t = Some((r.ttag, 0));
                    env.r2ts += 1;
                }
                PduType::C2HTermReq => {
                    self.term = Some(TermReq::decode(&pdu).unwrap().fes);
                }
                other => panic!("the target sent {other:?}"),
            }
        }
    }

    /// A write by R2T with data still to send: (cid, ttag, sent, len).
    fn pending_data(&self, pick: usize) -> Option<(u16, u16, usize, usize)> {
        let v: Vec<_> = self
            .cmds
            .iter()
            .filter_map(|(&cid, c)| match c.r2t {
                Some((ttag, sent)) if sent < c.len => Some((cid, ttag, sent, c.len)),
                _ => None,
            })
            .collect();
        if v.is_empty() {
            None
        } else {
            Some(v[pick % v.len()])
        }
    }

    /// Sends the next H2CData chunk of a write that got its R2T.
    fn send_data(&mut self, env: &mut Env) -> bool {
        let pick = env.rng.below(DEPTH as usize);
        let Some((cid, ttag, sent, len)) = self.pending_data(pick) else {
            return false;
        };
        let max = (limits::MAXH2CDATA_BYTES as usize).min(len - sent);
        let n = match env.rng.below(3) {
            0 => max,
            1 => (1 + env.rng.below(8)) * BLOCK_BYTES,
            _ => 1 + env.rng.below(max),
        }
        .min(max);
        let data = self.cmds[&cid].data[sent..sent + n].to_vec();
        self.h2c(cid, ttag, sent, &data, sent + n == len);
        if let Some(c) = self.cmds.get_mut(&cid) {
            c.r2t = Some((ttag, sent + n));
        }
        true
    }

    /// Submits a read or a write over bytes no command in flight touches.
    fn submit_io(&mut self, env: &mut Env) -> bool {
        if self.cmds.len() >= DEPTH as usize - 1 {
            return false;
        }
        let blocks = match env.rng.below(20) {
            0..=4 => 1 + env.rng.below(256),
            5..=9 => 1 + env.rng.below(32),
            10 => limits::MDTS_BYTES / BLOCK_BYTES + 1 + env.rng.below(256),
            _ => 1 + env.rng.below(8),
        };
        let slba = env.rng.below(BLOCKS - blocks + 1);
        let (off, len) = (slba * BLOCK_BYTES, blocks * BLOCK_BYTES);
        if self
            .cmds
            .values()
            .any(|c| c.op != Op::Admin && c.off < off + len && off < c.off + c.len)
        {
            return false;
        }
        let cid = self.cid();
        let op = match env.rng.below(20) {
            0 => Op::Zeroes,
            1..=10 => Op::Write,
            _ => Op::Read,
        };
        let write = op == Op::Write;
        let opc = match op {
            Op::Zeroes => nvm::WRITE_ZEROES,
            Op::Write => nvm::WRITE,
            _ => nvm::READ,
        };
        let mut sqe = Sqe::new(opc, cid);
        sqe.set_nsid(1);
        sqe.set_slba(slba as u64);
        sqe.set_nlb((blocks - 1) as u16);
        let inline = write && len <= limits::IO_INLINE_DATA_BYTES && env.rng.chance(60);
        let refused =
            (op != Op::Zeroes && len > limits::MDTS_BYTES).then_some(Status::INVALID_FIELD);
        sqe.set_sgl(Sgl {
            addr: 0,
            len: if op == Op::Zeroes { 0 } else { len as u32 },
            id: if inline {
                sgl_id::IN_CAPSULE
            } else {
                sgl_id::TRANSPORT
            },
        });
        let data = if write {
            env.rng.bytes(len)
        } else {
            Vec::new()
        };
        self.capsule(&sqe, if inline { &data } else { &[] });
        self.cmds.insert(
            cid,
            Cmd {
                op,
                off,
                len,
                data,
                r2t: None,
                got: Vec::new(),
                refused,
            },
        );
        true
    }

    /// The ring completes up to `n` of its operations, picked at random
    /// (a Read or Write maybe short, a fallocate maybe unsupported).
    fn complete(&mut self, env: &mut Env, n: usize) {
        for _ in 0..n {
            let Some(r) = env.ring.as_mut().filter(|r| !r.pending.is_empty()) else {
                return;
            };
            let op = r.pending.swap_remove(env.rng.below(r.pending.len()));
            let at = op.off as usize;
            // A zero write (tagged) is whole: a short one fails the command.
            let whole = user_data_tag(op.ud) > 0 || !env.rng.chance(15);
            let short = |rng: &mut SimRng, len: u32| match whole || len < 2 {
                true => len as usize,
                false => 1 + rng.below(len as usize - 1),
            };
            let res = match op.kind {
                FileOpKind::Read { buf, len } => {
                    let n = short(&mut env.rng, len);
                    // SAFETY: the queue keeps the buffer until this
                    // operation's completion (Submit's contract).
                    unsafe { std::ptr::copy_nonoverlapping(r.disk[at..].as_ptr(), buf, n) };
                    n as i32
                }
                FileOpKind::Write { buf, len, .. } => {
                    let n = short(&mut env.rng, len);
                    // SAFETY: as for a read.
                    let src = unsafe { std::slice::from_raw_parts(buf, n) };
                    r.disk[at..at + n].copy_from_slice(src);
                    n as i32
                }
                FileOpKind::Fsync => 0,
                FileOpKind::Fallocate { len, .. } => match env.rng.chance(25) {
                    true => -libc::EOPNOTSUPP,
                    false => {
                        r.disk[at..at + len as usize].fill(0);
                        0
                    }
                },
            };
            if matches!(op.kind, FileOpKind::Read { len, .. } | FileOpKind::Write { len, .. } if res < len as i32)
            {
                env.short += 1;
            }
            let (conn, slot) = split_user_data(op.ud);
            assert_eq!(conn, self.conn, "only the I/O queue uses the ring");
            let mut ex = env.exec(conn);
            self.q
                .on_completion(slot, user_data_tag(op.ud), res, &mut self.tx, &mut ex);
        }
    }

    /// The queue counts as in flight what the ring holds.
    fn check_inflight(&self, env: &Env) {
        if let Some(r) = &env.ring {
            assert_eq!(
                self.q.inflight as usize,
                r.pending.len(),
                "backend operations in flight"
            );
        }
    }

    /// Runs network, reactor and host until nothing moves.
    fn settle(&mut self, env: &mut Env) {
        for _ in 0..100_000 {
            let quiet = self.wire_out.is_empty()
                && self.tx.backlog() == 0
                && self.pending_data(0).is_none()
                && env.ring.as_ref().is_none_or(|r| r.pending.is_empty());
            if quiet {
                self.reactor_turn(env);
                if self.tx.backlog() == 0 {
                    return;
                }
            }
            self.send_data(env);
            let n = 1 + env.rng.below(64 << 10);
            self.deliver(env, n);
            let n = env.rng.below(4);
            self.complete(env, n);
            self.reactor_turn(env);
            let room = 1 + env.rng.below(64 << 10);
            self.flush(env, room);
        }
        panic!("the connection never settled");
    }

    /// What the reactor does when it closes a connection: whatever is
    /// ready goes out first when `flush` (a termination), then detach,
    /// drop unsent data, close, take every buffer back.
    fn close(&mut self, env: &mut Env, flush: bool) {
        if flush {
            while self.tx.backlog() > 0 {
                self.flush(env, usize::MAX);
            }
        }
        self.q.detach();
        self.tx.abandon();
        self.q.reclaim(&mut self.tx);
        self.q.close();
        self.q.take_returned(&mut env.bufs);
        let conn = self.conn;
        env.bufs.forget(|ud| split_user_data(ud).0 == conn);
        // The reactor keeps the closed connection until the ring gave back
        // every operation of its commands.
        let submitted = env.ring.as_ref().map(|r| r.submitted);
        while self.q.inflight > 0 {
            self.complete(env, 1);
            self.q.take_returned(&mut env.bufs);
        }
        assert_eq!(
            env.ring.as_ref().map(|r| r.submitted),
            submitted,
            "backend I/O submitted after the close"
        );
        assert_eq!(self.q.phase(), Phase::Closed { poisoned: false });
        assert!(!self.q.busy(), "a closed queue still holds commands");
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Clean,
    Vanish,
    Malformed,
}

#[derive(Debug, Default)]
struct Stats {
    answered: usize,
    r2ts: usize,
    buffer_waits: u64,
    terminations: usize,
    vanished: usize,
    /// Commands still in the backend when the connection closed.
    closed_in_backend: usize,
    ring_ops: usize,
    short: usize,
}

fn target(backend: String) -> Arc<Target> {
    let target = Target::new(None).unwrap();
    target
        .put_subsystem(&SubsystemConfig {
            nqn: NQN.into(),
            allowed_hosts: Vec::new(),
            allow_any_host: true,
            host_keys: Default::default(),
            serial: None,
            model: None,
            ana: None,
            namespaces: vec![NamespaceConfig {
                nsid: 1,
                backend,
                uuid: None,
                read_only: false,
            }],
        })
        .unwrap();
    target
}

/// ICReq and Connect of one queue; returns the Connect answer's DW0.
fn connect(c: &mut Conn, env: &mut Env, qid: u16, cntlid: u16, sqsize: u16) -> u32 {
    c.send_icreq();
    c.settle(env);
    assert!(c.ic_resp, "no ICResp");
    let data = ConnectData {
        hostid: [7; 16],
        cntlid,
        subnqn: NQN,
        hostnqn: HOST,
    }
    .encode();
    let cmd = ConnectCmd {
        recfmt: 0,
        qid,
        sqsize,
        cattr: 0,
        kato_ms: 0,
    };
    c.admin(|cid| cmd.to_sqe(cid), &data);
    c.settle(env);
    let a = c.admin_answers.pop().expect("a Connect answer");
    assert!(c.cmds.is_empty());
    a.dw0
}

fn run(seed: u64, stats: &mut Stats) {
    let mut rng = SimRng(Rng::new(seed));
    // The queue never touches the file itself: its ring is the simulation's.
    let file = rng.chance(50).then(|| {
        let f = tempfile::NamedTempFile::new().unwrap();
        f.as_file().set_len(NS_BYTES as u64).unwrap();
        f
    });
    let backend = match &file {
        Some(f) => format!("file:{}", f.path().display()),
        None => format!("ram:{NS_BYTES}"),
    };
    let mut env = Env {
        target: target(backend),
        sink: CompletionSink::new(|| {}),
        bufs: BufPool::new(0, 2 * limits::POOL_BUF_BYTES).unwrap(),
        now_ms: 0,
        rng,
        model: vec![0u8; NS_BYTES],
        r2ts: 0,
        ring: file.is_some().then(|| SimRing {
            pending: Vec::new(),
            disk: vec![0u8; NS_BYTES],
            submitted: 0,
        }),
        short: 0,
    };
    let ending = match env.rng.below(3) {
        0 => Ending::Clean,
        1 => Ending::Vanish,
        _ => Ending::Malformed,
    };

    // Connect.
    let mut admin = Conn::new(&mut env, 0);
    let cntlid = connect(&mut admin, &mut env, 0, 0xFFFF, 31) as u16;
    let enable = PropertyCmd {
        size8: false,
        offset: prop::CC,
        value: cc::LINUX_ENABLE as u64,
    };
    admin.admin(|cid| enable.to_sqe(cid, fctype::PROPERTY_SET), &[]);
    admin.settle(&mut env);
    assert!(admin.cmds.is_empty(), "Property Set unanswered");
    let mut io = Conn::new(&mut env, 1);
    connect(&mut io, &mut env, 1, cntlid, DEPTH - 1);
    assert_eq!(io.q.qid(), Some(1));

    // I/O.
    let end_at = env.rng.below(STEPS);
    for step in 0..STEPS {
        if ending != Ending::Clean && step == end_at {
            break;
        }
        env.now_ms += 1;
        match env.rng.below(12) {
            0..=2 => {
                io.submit_io(&mut env);
            }
            3..=4 => {
                io.send_data(&mut env);
            }
            5..=6 => {
                let n = 1 + env.rng.below(32 << 10);
                io.deliver(&mut env, n);
            }
            7..=8 => {
                let room = 1 + env.rng.below(32 << 10);
                io.flush(&mut env, room);
            }
            9..=10 => {
                let n = 1 + env.rng.below(4);
                io.complete(&mut env, n);
            }
            _ => {
                io.reactor_turn(&mut env);
                if env.rng.chance(20) {
                    assert!(io.q.tick(env.now_ms, &mut io.tx), "the I/O queue ended");
                    assert!(
                        admin.q.tick(env.now_ms, &mut admin.tx),
                        "the admin queue ended"
                    );
                }
            }
        }
        assert!(!io.q.poisoned(), "a slot invariant broke");
        io.check_inflight(&env);
    }

    match ending {
        Ending::Clean => {
            while !io.cmds.is_empty() {
                io.settle(&mut env);
            }
            assert!(
                !io.q.busy(),
                "every command is answered, yet the queue is busy"
            );
            io.q.request_close();
            assert!(io.q.wants_close());
            io.close(&mut env, true);
        }
        Ending::Vanish => {
            // The host sends part of one more PDU (maybe data), then is gone.
            if env.rng.chance(50) {
                io.send_data(&mut env);
            }
            if io.wire_out.is_empty() && !io.submit_io(&mut env) {
                io.send_icreq();
            }
            let n = env.rng.below(io.wire_out.len());
            io.deliver(&mut env, n);
            stats.closed_in_backend += io.q.inflight as usize;
            io.close(&mut env, false);
            stats.vanished += 1;
        }
        Ending::Malformed => {
            malformed(&mut io, &mut env);
            let n = io.wire_out.len();
            io.deliver(&mut env, n);
            assert!(!io.reading, "the target kept reading after a malformed PDU");
            assert!(io.q.terminated());
            while io.tx.backlog() > 0 {
                io.flush(&mut env, usize::MAX);
            }
            assert!(io.term.is_some(), "no C2HTermReq");
            io.close(&mut env, true);
            stats.terminations += 1;
        }
    }
    // The admin queue ends too (its controller with it).
    admin.close(&mut env, true);
    assert_eq!(env.bufs.lent(), 0, "pool buffers not given back");
    stats.answered += io.answered + admin.answered;
    stats.r2ts += env.r2ts;
    stats.buffer_waits += env.bufs.stats().figures().waits_total;
    stats.ring_ops += env.ring.as_ref().map_or(0, |r| r.submitted);
    stats.short += env.short;
    if let Some(r) = &env.ring {
        // What the host last wrote is what the file holds.
        if ending == Ending::Clean {
            assert!(r.disk == env.model, "the file differs from the model");
        }
    }
}

/// Appends one PDU the queue must refuse with a C2HTermReq.
fn malformed(c: &mut Conn, env: &mut Env) {
    let capsule_header = |c: &Conn| {
        let mut sqe = Sqe::new(nvm::FLUSH, 0xBEEF);
        sqe.set_nsid(1);
        let mut hdr = [0u8; tcp::CAPSULE_CMD_HLEN + tcp::DIGEST_LEN];
        let n = tcp::encode_capsule_cmd(&sqe, 0, c.dg, &mut hdr);
        hdr[..n].to_vec()
    };
    match env.rng.below(6) {
        0 => {
            // An unknown PDU type.
            c.wire_out.extend([0x0F, 0, 8, 0, 8, 0, 0, 0]);
        }
        1 => {
            // A CapsuleCmd whose HLEN is not 72.
            let mut h = capsule_header(c);
            h[2] = 0x20;
            c.wire_out.extend(h);
        }
        2 => c.send_icreq(),
        3 => {
            // A CapsuleCmd longer than in-capsule data allows.
            let mut h = capsule_header(c);
            h[4..8].copy_from_slice(&(1u32 << 24).to_le_bytes());
            c.wire_out.extend(h);
        }
        4 => {
            // H2CData for a transfer tag no command has.
            let data = vec![0x5A; BLOCK_BYTES];
            c.h2c(0x7777, DEPTH + 3, 0, &data, true);
        }
        _ => match c.pending_data(env.rng.below(DEPTH as usize)) {
            Some((cid, ttag, sent, _)) => {
                // H2CData past the bytes sent so far.
                let data = vec![0x5A; BLOCK_BYTES];
                c.h2c(cid, ttag, sent + BLOCK_BYTES, &data, false);
            }
            None => c.send_icreq(),
        },
    }
}

fn seed_list() -> Vec<u64> {
    if let Ok(s) = std::env::var("QUEUE_SIM_SEED") {
        return vec![s.parse().expect("QUEUE_SIM_SEED is a number")];
    }
    let n = std::env::var("QUEUE_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(SEEDS);
    (0..n).collect()
}

#[test]
fn the_queue_survives_every_seed() {
    let mut stats = Stats::default();
    for seed in seed_list() {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(seed, &mut stats)));
        if r.is_err() {
            panic!("queue_sim: seed {seed} failed; replay with QUEUE_SIM_SEED={seed}");
        }
    }
    eprintln!("queue_sim: {stats:?}");
    if std::env::var("QUEUE_SIM_SEED").is_err() {
        // The run reached what it means to test.
        assert!(stats.r2ts > 0, "no write went by R2T");
        assert!(
            stats.buffer_waits > 0,
            "no command waited for a pool buffer"
        );
        assert!(stats.terminations > 0 && stats.vanished > 0);
        assert!(
            stats.ring_ops > 0 && stats.short > 0,
            "the ring was not exercised"
        );
        assert!(
            stats.closed_in_backend > 0,
            "no connection closed with I/O in the backend"
        );
    }
}
