use super::*;
use crate::config::{NamespaceConfig, SubsystemConfig};
use crate::copier::{CopyRequest, CopySource};
use nvpool_wire::fabrics::{cc, ConnectCmd, ConnectData};
use nvpool_wire::Sgl;
use std::path::PathBuf;

const NQN: &str = "nqn.2026-11.io.nvpool:queue-test";
const HOST: &str = "nqn.2026-11.io.nvpool:queue-test-host";
/// The namespace is device bytes [NS_BASE, NS_BASE + NS_LEN) of the file.
const NS_BASE: u64 = 64 << 10;
const NS_LEN: u64 = 512 << 10;

/// An I/O queue (run without io_uring, so backend I/O is inline) of a
/// target exporting a file extent, with a copy job armed over the same
/// extent.
struct Rig {
    _dir: tempfile::TempDir,
    path: PathBuf,
    target: Arc<Target>,
    q: Queue,
    tx: Tx,
    bufs: BufPool,
    next_cid: u16,
}

impl Rig {
    fn new() -> Rig {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.img");
        std::fs::write(&path, vec![0x11u8; 1 << 20]).unwrap();
        let extent = format!("file:{},offset={NS_BASE},length={NS_LEN}", path.display());
        let target = target_with(NQN, &extent);
        target
            .copies()
            .arm(
                "job",
                CopyRequest {
                    dest: extent,
                    source: CopySource {
                        addr: "127.0.0.1:9".into(),
                        subsystem_nqn: "nqn.2026-11.io.nvpool:src".into(),
                        nsid: 1,
                        host_nqn: "nqn.2026-11.io.nvpool:copier:t".into(),
                        dhchap: None,
                    },
                    region_bytes: 1 << 20,
                    rate_bytes_per_sec: 0,
                    base_root: None,
                },
            )
            .unwrap();
        let ctrl = target
            .create_controller(
                target.subsystem(NQN).unwrap(),
                HOST,
                [7; 16],
                0,
                false,
                Transport::Tcp,
            )
            .unwrap();
        ctrl.write_cc(cc::LINUX_ENABLE, 0);
        let addr = "127.0.0.1:4420".parse().unwrap();
        let mut r = Rig {
            _dir: dir,
            path,
            q: Queue::new(target.clone(), addr, addr, 0),
            target,
            tx: Tx::default(),
            bufs: BufPool::new(0, limits::REACTOR_BUF_BUDGET_BYTES).unwrap(),
            next_cid: 1,
        };
        r.feed(
            &IcReq {
                pfv: 0,
                hpda: 0,
                digests: Digests::default(),
                maxr2t: 0,
            }
            .encode(),
        );
        let data = ConnectData {
            hostid: [7; 16],
            cntlid: ctrl.cntlid,
            subnqn: NQN,
            hostnqn: HOST,
        }
        .encode();
        let sqe = ConnectCmd {
            recfmt: 0,
            qid: 1,
            sqsize: 31,
            cattr: 0,
            kato_ms: 0,
        }
        .to_sqe(0);
        r.feed(&capsule(&sqe, &data));
        let out = r.responses();
        assert_eq!(out.len(), 1, "one Connect response");
        assert!(out[0].status.is_success(), "{}", out[0].status);
        r
    }

    fn feed(&mut self, pdu: &[u8]) {
        let mut ex = exec(&mut self.bufs);
        self.q.on_pdu(pdu, &mut self.tx, &mut ex).unwrap();
    }

    fn retry(&mut self) {
        let mut ex = exec(&mut self.bufs);
        self.q.retry_parked(&mut self.tx, &mut ex);
    }

    /// CapsuleResps the queue produced since the last call (the ICResp
    /// is skipped).
    fn responses(&mut self) -> Vec<Cqe> {
        let mut raw = Vec::new();
        while self.tx.backlog() > 0 {
            self.tx.write_to(&mut raw).unwrap();
        }
        self.q.reclaim(&mut self.tx);
        let mut out = Vec::new();
        let mut at = 0;
        while at < raw.len() {
            let ch = CommonHeader::decode(&raw[at..]).unwrap();
            let end = at + ch.plen as usize;
            if ch.pdu_type == PduType::CapsuleResp {
                out.push(wtcp::decode_capsule_resp(&raw[at..end]).unwrap());
            }
            at = end;
        }
        out
    }

    /// A 4 KiB in-capsule Write at namespace byte `off`.
    fn write(&mut self, off: u64, fill: u8) -> u16 {
        let cid = self.next_cid;
        self.next_cid += 1;
        let mut sqe = Sqe::new(nvm::WRITE, cid);
        sqe.set_nsid(1);
        sqe.set_slba(off / 512);
        sqe.set_nlb(7);
        sqe.set_sgl(Sgl {
            addr: 0,
            len: 4096,
            id: sgl_id::IN_CAPSULE,
        });
        self.feed(&capsule(&sqe, &[fill; 4096]));
        cid
    }

    /// Device bytes [off, off + len) of the file.
    fn file(&self, off: u64, len: usize) -> Vec<u8> {
        let all = std::fs::read(&self.path).unwrap();
        all[off as usize..off as usize + len].to_vec()
    }

    /// What the reactor does each iteration: takes freed buffers back
    /// and hands one to the oldest waiting command. The slot it went to.
    fn r2t_free_grant(&mut self) -> Option<u16> {
        self.q.take_returned(&mut self.bufs);
        let (ud, b) = self.bufs.grant()?;
        let slot = split_user_data(ud).1;
        let mut ex = exec(&mut self.bufs);
        assert!(self.q.on_buffer(slot, b, &mut self.tx, &mut ex).is_none());
        Some(slot)
    }

    fn guard(&self) -> Arc<crate::copier::ActiveCopy> {
        self.target.copies().guards.snapshot()[0].clone()
    }
}

/// Where the rigs' asynchronous backends complete (the tests take
/// their completions from it themselves).
/// A target with subsystem `nqn` open to any host, namespace 1 on
/// `backend`.
pub(super) fn target_with(nqn: &str, backend: &str) -> Arc<Target> {
    let target = Target::new(None).unwrap();
    target
        .put_subsystem(&SubsystemConfig {
            nqn: nqn.into(),
            allowed_hosts: Vec::new(),
            allow_any_host: true,
            host_keys: Default::default(),
            serial: None,
            model: None,
            ana: None,
            namespaces: vec![NamespaceConfig {
                nsid: 1,
                backend: backend.into(),
                uuid: None,
                read_only: false,
            }],
        })
        .unwrap();
    target
}

pub(super) static SINK: std::sync::LazyLock<Arc<CompletionSink>> =
    std::sync::LazyLock::new(|| CompletionSink::new(|| {}));

/// What the rigs hand their queue: no ring, the shared sink, `bufs`.
pub(super) fn exec(bufs: &mut BufPool) -> Exec<'_> {
    Exec {
        ring: None,
        sink: &SINK,
        bufs,
        conn: 0,
        now_ms: 0,
    }
}

/// An asynchronous backend that keeps every operation until the test
/// completes it.
#[derive(Debug, Default)]
struct HeldOps(std::sync::Mutex<Vec<(AsyncOp, AsyncDone)>>);

impl crate::backend::Backend for HeldOps {
    fn size(&self) -> u64 {
        1 << 20
    }
    fn block_size(&self) -> u32 {
        512
    }
    fn describe(&self) -> String {
        "held".into()
    }
    fn read_at(&self, _: &mut [u8], _: u64) -> std::io::Result<()> {
        unreachable!("an asynchronous backend is never run inline")
    }
    fn write_at(&self, _: &[u8], _: u64, _: bool) -> std::io::Result<()> {
        unreachable!("an asynchronous backend is never run inline")
    }
    fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn write_zeroes(&self, _: u64, _: u64) -> std::io::Result<()> {
        unreachable!("an asynchronous backend is never run inline")
    }
    fn discard(&self, _: u64, _: u64) -> std::io::Result<()> {
        unreachable!("an asynchronous backend is never run inline")
    }
    fn failed(&self) -> bool {
        false
    }
    fn mark_failed(&self) {}
    fn is_async(&self) -> bool {
        true
    }
    fn submit(&self, op: AsyncOp, done: AsyncDone) {
        self.0.lock().unwrap().push((op, done));
    }
}

impl HeldOps {
    fn take(&self) -> Vec<(AsyncOp, AsyncDone)> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

/// A rig whose namespace 2 is a [`HeldOps`] backend.
fn async_rig() -> (Rig, Arc<HeldOps>) {
    let r = Rig::new();
    let held = Arc::new(HeldOps::default());
    r.target
        .put_namespace_backend(NQN, 2, held.clone())
        .unwrap();
    (r, held)
}

/// Hands the sink's completions (for connection 0) to the rig's queue.
fn deliver(r: &mut Rig) -> usize {
    let mut out = Vec::new();
    SINK.take(&mut out);
    let n = out.len();
    let mut ex = exec(&mut r.bufs);
    for c in out {
        let (conn, slot) = split_user_data(c.user_data);
        assert_eq!(conn, 0);
        r.q.on_async_completion(slot, c.result, &mut r.tx, &mut ex);
    }
    n
}

/// A 4 KiB Read of namespace 2 at byte `off`.
fn read_ns2(r: &mut Rig, off: u64) -> u16 {
    let cid = r.next_cid;
    r.next_cid += 1;
    let mut sqe = Sqe::new(nvm::READ, cid);
    sqe.set_nsid(2);
    sqe.set_slba(off / 512);
    sqe.set_nlb(7);
    sqe.set_sgl(Sgl {
        addr: 0,
        len: 4096,
        id: sgl_id::TRANSPORT,
    });
    r.feed(&capsule(&sqe, &[]));
    cid
}

fn capsule(sqe: &Sqe, icd: &[u8]) -> Vec<u8> {
    let mut hdr = [0u8; wtcp::CAPSULE_CMD_HLEN + wtcp::DIGEST_LEN];
    let n = wtcp::encode_capsule_cmd(sqe, icd.len(), Digests::default(), &mut hdr);
    let mut v = hdr[..n].to_vec();
    v.extend_from_slice(icd);
    v
}

// The tests of asynchronous backends share SINK: they run one at a time.
static ASYNC_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn an_async_backend_owns_the_slot_until_its_completion() {
    let _one = ASYNC_TESTS.lock().unwrap_or_else(|p| p.into_inner());
    let (mut r, held) = async_rig();
    // A write: its data is copied out; no answer until completion.
    let mut sqe = Sqe::new(nvm::WRITE, 100);
    sqe.set_nsid(2);
    sqe.set_slba(8);
    sqe.set_nlb(7);
    sqe.set_sgl(Sgl {
        addr: 0,
        len: 4096,
        id: sgl_id::IN_CAPSULE,
    });
    r.feed(&capsule(&sqe, &[0x5A; 4096]));
    read_ns2(&mut r, 8192);
    assert!(r.responses().is_empty());
    assert_eq!(r.q.inflight, 2);
    let ops = held.take();
    assert_eq!(ops.len(), 2);
    let mut it = ops.into_iter();
    let (w, wdone) = it.next().unwrap();
    let (rop, rdone) = it.next().unwrap();
    match w {
        AsyncOp::Write { off, data, fua } => {
            assert_eq!((off, fua), (4096, false));
            assert_eq!(data, vec![0x5A; 4096]);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        rop,
        AsyncOp::Read {
            off: 8192,
            len: 4096
        }
    ));
    // Completed from another thread, delivered on "the reactor".
    std::thread::spawn(move || {
        wdone.complete(Ok(None));
        rdone.complete(Ok(Some(vec![0xC3; 4096])));
    })
    .join()
    .unwrap();
    assert_eq!(deliver(&mut r), 2);
    assert_eq!(r.q.inflight, 0);
    let mut raw = Vec::new();
    while r.tx.backlog() > 0 {
        r.tx.write_to(&mut raw).unwrap();
    }
    r.q.reclaim(&mut r.tx);
    assert!(
        raw.windows(4096).any(|w| w == [0xC3; 4096]),
        "the read's data is sent"
    );
    assert!(!r.q.busy());
}

#[test]
fn async_errors_become_statuses_and_a_dropped_op_fails() {
    let _one = ASYNC_TESTS.lock().unwrap_or_else(|p| p.into_inner());
    let (mut r, held) = async_rig();
    let a = read_ns2(&mut r, 0);
    let b = read_ns2(&mut r, 4096);
    let mut ops = held.take().into_iter();
    let (_, adone) = ops.next().unwrap();
    adone.complete(Err(std::io::Error::from_raw_os_error(libc::EAGAIN)));
    // The backend loses the other operation: it fails, never hangs.
    drop(ops);
    assert_eq!(deliver(&mut r), 2);
    let mut out = r.responses();
    out.sort_by_key(|c| c.cid);
    assert_eq!(out.len(), 2);
    assert_eq!((out[0].cid, out[0].status), (a, Status::NS_NOT_READY));
    assert_eq!(
        (out[1].cid, out[1].status),
        (b, Status::UNRECOVERED_READ_ERROR)
    );
    assert!(!r.q.busy());
}

#[test]
fn a_closed_queue_keeps_async_slots_until_they_complete() {
    let _one = ASYNC_TESTS.lock().unwrap_or_else(|p| p.into_inner());
    let (mut r, held) = async_rig();
    read_ns2(&mut r, 0);
    r.q.close();
    assert!(r.q.busy(), "the slot is the backend's until it completes");
    assert_eq!(r.q.inflight, 1);
    let (_, done) = held.take().pop().unwrap();
    done.complete(Ok(Some(vec![1; 4096])));
    assert_eq!(deliver(&mut r), 1);
    assert!(!r.q.busy());
    assert!(r.responses().is_empty(), "nothing answered after close");
}

#[test]
fn a_write_under_a_claim_is_issued_only_after_release() {
    let mut r = Rig::new();
    let g = r.guard();
    // The copier claims the first 128 KiB of the extent (device offsets).
    let parts = g.guard.claim(NS_BASE, 128 << 10);
    assert_eq!(parts, vec![(NS_BASE, 128 << 10)], "nothing written yet");
    // A host writes 4 KiB at namespace offset 8 KiB: marked, parked.
    let cid = r.write(8192, 0xAB);
    assert!(r.responses().is_empty(), "a parked write is not answered");
    assert!(r.q.has_parked());
    assert!(r.q.busy(), "a parked command keeps the queue busy");
    assert_eq!(r.file(NS_BASE + 8192, 4096), vec![0x11; 4096]);
    assert_eq!(g.guard.written_units(), 8);
    // Retrying while the claim is held changes nothing.
    r.retry();
    assert!(r.responses().is_empty());
    assert_eq!(r.file(NS_BASE + 8192, 4096), vec![0x11; 4096]);
    // A write outside the claim (but inside the guard) goes at once and
    // is recorded too.
    let other = r.write(256 << 10, 0xCD);
    let out = r.responses();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].cid, other);
    assert_eq!(r.file(NS_BASE + (256 << 10), 4096), vec![0xCD; 4096]);
    assert_eq!(g.guard.written_units(), 16);
    // The copier writes its (older) bytes over its claim, then releases.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&r.path)
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0x22; 128 << 10], NS_BASE).unwrap();
    g.guard.release();
    r.retry();
    let out = r.responses();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].cid, cid);
    assert!(out[0].status.is_success());
    assert!(!r.q.has_parked());
    // The host's write landed after the copier's.
    assert_eq!(r.file(NS_BASE + 8192, 4096), vec![0xAB; 4096]);
    assert_eq!(r.file(NS_BASE, 8192), vec![0x22; 8192]);
    // A later claim leaves out what hosts wrote.
    let parts = g.guard.claim(NS_BASE, 128 << 10);
    assert_eq!(
        parts,
        vec![(NS_BASE, 8192), (NS_BASE + 12288, (128 << 10) - 12288)]
    );
    g.guard.release();
}

#[test]
fn zeroes_and_deallocate_are_guarded_too() {
    let mut r = Rig::new();
    let g = r.guard();
    g.guard.claim(NS_BASE, 128 << 10);
    let mut wz = Sqe::new(nvm::WRITE_ZEROES, 1);
    wz.set_nsid(1);
    wz.set_slba(0);
    wz.set_nlb(7);
    r.feed(&capsule(&wz, &[]));
    let mut dsm = Sqe::new(nvm::DATASET_MANAGEMENT, 2);
    dsm.set_nsid(1);
    dsm.set_cdw(10, 0);
    dsm.set_cdw(11, 1 << 2);
    dsm.set_sgl(Sgl {
        addr: 0,
        len: 16,
        id: sgl_id::IN_CAPSULE,
    });
    let mut range = [0u8; 16];
    range[4..8].copy_from_slice(&8u32.to_le_bytes());
    range[8..16].copy_from_slice(&64u64.to_le_bytes());
    r.feed(&capsule(&dsm, &range));
    assert!(r.responses().is_empty(), "both parked");
    assert_eq!(g.guard.written_units(), 16);
    assert_eq!(r.file(NS_BASE, 4096), vec![0x11; 4096]);
    g.guard.release();
    r.retry();
    let mut cids: Vec<u16> = r.responses().iter().map(|c| c.cid).collect();
    cids.sort_unstable();
    assert_eq!(cids, vec![1, 2]);
    assert_eq!(r.file(NS_BASE, 4096), vec![0; 4096]);
    assert_eq!(r.file(NS_BASE + 64 * 512, 4096), vec![0; 4096]);
}

#[test]
fn closing_a_queue_frees_its_parked_commands() {
    let mut r = Rig::new();
    let g = r.guard();
    g.guard.claim(NS_BASE, 128 << 10);
    r.write(0, 0xAB);
    r.write(4096, 0xAC);
    assert!(r.q.busy());
    r.q.close();
    assert!(!r.q.has_parked());
    assert!(!r.q.busy(), "every slot is free again");
    g.guard.release();
    r.retry();
    assert!(r.responses().is_empty(), "nothing answered after close");
    assert_eq!(r.file(NS_BASE, 8192), vec![0x11; 8192], "nothing issued");
}

#[test]
fn a_disarmed_guard_lets_parked_writes_go() {
    let mut r = Rig::new();
    let g = r.guard();
    g.guard.claim(NS_BASE, 128 << 10);
    let cid = r.write(0, 0xAB);
    assert!(r.responses().is_empty());
    // DELETE of the job while the claim is still held (a copier that
    // died mid-chunk would release through its drop guard; here the
    // registry simply no longer has the guard).
    r.target.copies().delete("job").unwrap();
    r.retry();
    let out = r.responses();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].cid, cid);
    assert_eq!(r.file(NS_BASE, 4096), vec![0xAB; 4096]);
}

/// Every PDU the queue produced since the last call, whole.
fn pdus(r: &mut Rig) -> Vec<Vec<u8>> {
    let mut raw = Vec::new();
    while r.tx.backlog() > 0 {
        r.tx.write_to(&mut raw).unwrap();
    }
    r.q.reclaim(&mut r.tx);
    let mut out = Vec::new();
    let mut at = 0;
    while at < raw.len() {
        let ch = CommonHeader::decode(&raw[at..]).unwrap();
        out.push(raw[at..at + ch.plen as usize].to_vec());
        at += ch.plen as usize;
    }
    out
}

fn r2ts(p: &[Vec<u8>]) -> Vec<R2t> {
    p.iter()
        .filter(|b| CommonHeader::decode(b).unwrap().pdu_type == PduType::R2T)
        .map(|b| R2t::decode(b).unwrap())
        .collect()
}

fn h2c(cid: u16, ttag: u16, data: &[u8]) -> Vec<u8> {
    let mut hdr = [0u8; wtcp::DATA_HLEN + wtcp::DIGEST_LEN];
    let n = DataHeader {
        cccid: cid,
        ttag,
        datao: 0,
        datal: data.len() as u32,
    }
    .encode(
        PduType::H2CData,
        flags::LAST_PDU,
        Digests::default(),
        &mut hdr,
    );
    [&hdr[..n], data].concat()
}

/// A 128 KiB Write at namespace byte `off` whose data comes by R2T.
fn big_write(r: &mut Rig, off: u64) -> u16 {
    let cid = r.next_cid;
    r.next_cid += 1;
    let mut sqe = Sqe::new(nvm::WRITE, cid);
    sqe.set_nsid(1);
    sqe.set_slba(off / 512);
    sqe.set_nlb(255);
    sqe.set_sgl(Sgl {
        addr: 0,
        len: 128 << 10,
        id: sgl_id::TRANSPORT,
    });
    r.feed(&capsule(&sqe, &[]));
    cid
}

#[test]
fn a_large_write_waits_for_a_buffer_and_gets_its_r2t_when_one_comes_back() {
    let mut r = Rig::new();
    r.target.copies().delete("job").unwrap();
    r.bufs = BufPool::new(0, limits::POOL_BUF_BYTES).unwrap();
    let a = big_write(&mut r, 0);
    let b = big_write(&mut r, 128 << 10);
    // Small commands never wait: a 4 KiB write goes through meanwhile.
    let small = r.write(256 << 10, 0x33);
    let p = pdus(&mut r);
    let t = r2ts(&p);
    assert_eq!(t.len(), 1, "only the first has a buffer");
    assert_eq!(t[0].cccid, a);
    let f = r.bufs.stats().figures();
    assert_eq!((f.lent_bytes, f.waiting), (limits::POOL_BUF_BYTES, 1));
    assert_eq!(
        p.iter()
            .filter(|b| b[0] == PduType::CapsuleResp as u8)
            .count(),
        1,
        "the small write"
    );
    let _ = small;
    // The first's data arrives; it runs and answers; its buffer is back.
    r.feed(&h2c(a, t[0].ttag, &[0xA1; 128 << 10]));
    let p = pdus(&mut r);
    assert_eq!(p.len(), 1, "its response only");
    assert!(
        r.r2t_free_grant().is_some(),
        "the waiting write gets the buffer"
    );
    let t = r2ts(&pdus(&mut r));
    assert_eq!(t.len(), 1);
    assert_eq!((t[0].cccid, t[0].r2tl), (b, 128 << 10));
    r.feed(&h2c(b, t[0].ttag, &[0xB2; 128 << 10]));
    assert_eq!(pdus(&mut r).len(), 1);
    r.q.take_returned(&mut r.bufs);
    let f = r.bufs.stats().figures();
    assert_eq!((f.lent_bytes, f.waiting, f.waits_total), (0, 0, 1));
    assert_eq!(r.file(NS_BASE, 128 << 10), vec![0xA1; 128 << 10]);
    assert_eq!(
        r.file(NS_BASE + (128 << 10), 128 << 10),
        vec![0xB2; 128 << 10]
    );
    assert_eq!(r.file(NS_BASE + (256 << 10), 4096), vec![0x33; 4096]);
    assert!(!r.q.busy());
}

#[test]
fn a_closing_queue_gives_its_buffers_back_and_a_late_grant_is_refused() {
    let mut r = Rig::new();
    r.target.copies().delete("job").unwrap();
    r.bufs = BufPool::new(0, limits::POOL_BUF_BYTES).unwrap();
    big_write(&mut r, 0);
    big_write(&mut r, 128 << 10);
    assert_eq!(r.bufs.lent(), 1);
    r.q.close();
    assert!(!r.q.busy(), "waiting for data or a buffer holds nothing");
    r.q.take_returned(&mut r.bufs);
    assert_eq!(r.bufs.lent(), 0);
    // The reactor would have forgotten the wait; a grant that races the
    // close comes back untouched.
    let (ud, b) = r.bufs.grant().unwrap();
    let mut ex = exec(&mut r.bufs);
    let back = r.q.on_buffer(split_user_data(ud).1, b, &mut r.tx, &mut ex);
    assert!(back.is_some());
    r.bufs.give_back(back.unwrap());
    assert!(!r.q.poisoned());
}

#[test]
fn broken_slot_steps_end_the_connection_instead_of_panicking() {
    // A ring completion for a slot that is not in the backend.
    let mut r = Rig::new();
    let mut ex = exec(&mut r.bufs);
    r.q.on_completion(5, 0, 4096, &mut r.tx, &mut ex);
    assert!(r.q.poisoned() && r.q.terminated() && r.q.wants_close());
    // Nothing runs any more on it.
    let before = r.tx.backlog();
    let mut sqe = Sqe::new(nvm::FLUSH, 9);
    sqe.set_nsid(1);
    r.feed(&capsule(&sqe, &[]));
    assert_eq!(r.tx.backlog(), before, "a poisoned queue answers nothing");

    // Data "sent" from a slot that was not sending: freeing it would
    // put it on the free list twice.
    let mut r = Rig::new();
    r.tx.released.push(3);
    r.q.reclaim(&mut r.tx);
    assert!(r.q.poisoned());
    assert!(r.tx.released.is_empty());

    // An asynchronous completion nobody waits for.
    let mut r = Rig::new();
    let mut ex = exec(&mut r.bufs);
    r.q.on_async_completion(1, Ok(None), &mut r.tx, &mut ex);
    assert!(r.q.poisoned());
    assert_eq!(r.q.inflight, 0);
}

/// Zero writes (where no fallocate mode zeroes) go through a real ring
/// in chunks, each tagged with its length, a window at a time, until
/// the range is done.
#[test]
fn zero_writes_cover_a_large_range_through_the_ring() {
    const CHUNK: u64 = limits::ZERO_WRITE_CHUNK_BYTES as u64;
    // More chunks than the window: the job refills it as writes finish.
    const SPAN: u64 = (limits::ZERO_OPS_PER_CMD_MAX as u64 + 4) * CHUNK + 4096;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("z.img");
    std::fs::write(&path, vec![0x11u8; (SPAN + 8192) as usize]).unwrap();
    let target = target_with(NQN, &format!("file:{}", path.display()));
    let ns = target.subsystem(NQN).unwrap().namespaces[&1].clone();
    let t = ns.backend.uring_target().expect("a file has a ring target");
    let mut ring = Ring::new(64).expect("io_uring");
    let mut slot = Slot::new();
    slot.kind = IoKind::WriteZeroes;
    slot.off = 4096;
    slot.span = SPAN;
    slot.state = SlotState::Backend;
    slot.zero = Some(ZeroJob::new(ZeroMode::Write));
    let ud = user_data(7, 3);
    let (mut inflight, mut done) = pump_zero(&mut slot, &ns, &mut ring, t, ud);
    assert_eq!(inflight, limits::ZERO_OPS_PER_CMD_MAX);
    let mut out = Vec::new();
    let mut max_inflight = inflight;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while done.is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "zero writes did not complete"
        );
        ring.submit().unwrap();
        out.clear();
        ring.reap(&mut out);
        for &(u, res, _) in &out {
            assert_eq!(split_user_data(u), (7, 3));
            inflight -= 1;
            let job = slot.zero.as_mut().unwrap();
            job.complete(job.mode(), res, u64::from(user_data_tag(u)) << 9);
            let (n, d) = pump_zero(&mut slot, &ns, &mut ring, t, ud);
            inflight += n;
            max_inflight = max_inflight.max(inflight);
            done = done.or(d);
        }
        if out.is_empty() {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
    assert_eq!(done, Some(Ok(())));
    assert_eq!(inflight, 0);
    assert_eq!(
        max_inflight,
        limits::ZERO_OPS_PER_CMD_MAX,
        "never more than the window"
    );
    let all = std::fs::read(&path).unwrap();
    assert!(all[..4096].iter().all(|&b| b == 0x11), "before the range");
    assert!(
        all[4096..(4096 + SPAN) as usize].iter().all(|&b| b == 0),
        "the range is zero"
    );
    assert!(
        all[(4096 + SPAN) as usize..].iter().all(|&b| b == 0x11),
        "after it"
    );
}
