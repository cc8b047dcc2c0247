use super::*;
use nvpool_wire::fabrics::{cc, ConnectCmd, ConnectData};
use nvpool_wire::Sgl;

const NQN: &str = "nqn.2026-11.io.nvpool:rdma-queue-test";
const HOST: &str = "nqn.2026-11.io.nvpool:rdma-queue-test-host";
const KEY: u32 = 0x1234_5678;
const RADDR: u64 = 0x7f00_1000;

fn target() -> Arc<Target> {
    super::tests::target_with(NQN, "ram:1M")
}

struct Rig {
    target: Arc<Target>,
    q: Queue,
    tx: Tx,
    bufs: BufPool,
}

impl Rig {
    fn queue(target: &Arc<Target>, cm_qid: u16) -> Rig {
        let addr = "192.0.2.10:4420".parse().unwrap();
        Rig {
            target: target.clone(),
            q: Queue::new_rdma(target.clone(), addr, addr, 0, cm_qid),
            tx: Tx::default(),
            bufs: BufPool::new(0, limits::REACTOR_BUF_BUDGET_BYTES).unwrap(),
        }
    }

    fn send(&mut self, cap: &[u8]) -> Result<(), Fatal> {
        let mut ex = super::tests::exec(&mut self.bufs);
        self.q.on_rdma_capsule(cap, &mut self.tx, &mut ex)
    }

    /// Plays the RDMA READ the queue asked for: `data` lands in the slot.
    fn fetched(&mut self, slot: u16, data: &[u8]) {
        let b = self.q.slot_buffer(slot);
        let (ptr, cap) = (b.ptr, b.cap);
        assert!(cap >= data.len());
        // SAFETY: the slot's buffer holds `cap` bytes and nothing else
        // refers to it while the test writes (as an RDMA READ would).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, data.len()) };
        let mut ex = super::tests::exec(&mut self.bufs);
        self.q.on_rdma_fetched(slot, &mut self.tx, &mut ex);
    }

    fn work(&mut self) -> Vec<RdmaWork> {
        assert_eq!(self.tx.backlog(), 0, "no TCP bytes on an RDMA queue");
        std::mem::take(&mut self.tx.rdma)
    }

    /// The one response queued, decoded.
    fn response(&mut self) -> (Cqe, Option<u32>) {
        let w = self.work();
        assert_eq!(w.len(), 1, "one response: {w:?}");
        match w[0] {
            RdmaWork::Respond {
                cqe, invalidate, ..
            } => (Cqe::decode(&cqe).unwrap(), invalidate),
            other => panic!("expected a response, got {other:?}"),
        }
    }

    /// An enabled controller over RDMA and this I/O queue connected to
    /// it with in-capsule Connect data, as the Linux host sends it.
    fn io() -> Rig {
        let target = target();
        let ctrl = target
            .create_controller(
                target.subsystem(NQN).unwrap(),
                HOST,
                [7; 16],
                0,
                false,
                Transport::Rdma,
            )
            .unwrap();
        ctrl.write_cc(cc::LINUX_ENABLE, 0);
        let mut r = Rig::queue(&target, 1);
        let data = connect_data(ctrl.cntlid);
        let mut sqe = connect_sqe(1);
        sqe.set_sgl(Sgl {
            addr: 0,
            len: data.len() as u32,
            id: sgl_id::IN_CAPSULE,
        });
        r.send(&[&sqe.0[..], &data].concat()).unwrap();
        let (cqe, inval) = r.response();
        assert!(cqe.status.is_success(), "{}", cqe.status);
        assert_eq!(inval, None);
        r
    }
}

fn connect_data(cntlid: u16) -> Vec<u8> {
    ConnectData {
        hostid: [7; 16],
        cntlid,
        subnqn: NQN,
        hostnqn: HOST,
    }
    .encode()
    .to_vec()
}

fn connect_sqe(qid: u16) -> Sqe {
    ConnectCmd {
        recfmt: 0,
        qid,
        sqsize: 31,
        cattr: 0,
        kato_ms: 0,
    }
    .to_sqe(3)
}

fn keyed(sqe: &mut Sqe, len: u32, invalidate: bool) {
    KeyedSgl {
        addr: RADDR,
        len,
        key: KEY,
        invalidate,
    }
    .put(sqe);
}

fn rw(opcode: u8, cid: u16, slba: u64, blocks: u16) -> Sqe {
    let mut s = Sqe::new(opcode, cid);
    s.set_nsid(1);
    s.set_slba(slba);
    s.set_nlb(blocks - 1);
    s
}

#[test]
fn admin_connect_reads_its_data_then_answers_with_invalidate() {
    let target = target();
    let mut r = Rig::queue(&target, 0);
    let data = connect_data(0xFFFF);
    let mut sqe = connect_sqe(0);
    keyed(&mut sqe, data.len() as u32, true);
    r.send(&sqe.0).unwrap();
    let w = r.work();
    let [RdmaWork::Fetch {
        slot,
        len,
        raddr,
        rkey,
    }] = w[..]
    else {
        panic!("expected one RDMA READ, got {w:?}");
    };
    assert_eq!((len, raddr, rkey), (data.len() as u32, RADDR, KEY));
    r.fetched(slot, &data);
    let (cqe, inval) = r.response();
    assert!(cqe.status.is_success(), "{}", cqe.status);
    assert_eq!(inval, Some(KEY), "0x4F asks for the key to be invalidated");
    let ctrl = r.target.controller(cqe.dw0 as u16).expect("controller");
    assert_eq!(ctrl.transport, Transport::Rdma);
}

#[test]
fn writes_are_fetched_and_reads_written_before_the_response() {
    let mut r = Rig::io();
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
    let mut w = rw(nvm::WRITE, 10, 8, 8);
    keyed(&mut w, 4096, false);
    r.send(&w.0).unwrap();
    let work = r.work();
    let [RdmaWork::Fetch {
        slot, len: 4096, ..
    }] = work[..]
    else {
        panic!("expected one 4 KiB READ, got {work:?}");
    };
    r.fetched(slot, &data);
    let (cqe, inval) = r.response();
    assert!(cqe.status.is_success(), "{}", cqe.status);
    assert_eq!((cqe.cid, inval), (10, None), "0x40: nothing to invalidate");

    let mut rd = rw(nvm::READ, 11, 8, 8);
    keyed(&mut rd, 4096, true);
    r.send(&rd.0).unwrap();
    let work = r.work();
    let [RdmaWork::Deliver {
        slot,
        len: 4096,
        raddr: RADDR,
        rkey: KEY,
    }, RdmaWork::Respond {
        cqe,
        invalidate: Some(KEY),
        release: Some(released),
    }] = work[..]
    else {
        panic!("expected an RDMA WRITE then the response, got {work:?}");
    };
    assert_eq!(slot, released, "the slot is held until the SEND completes");
    assert!(Cqe::decode(&cqe).unwrap().status.is_success());
    let ptr = r.q.slot_buffer(slot).ptr;
    // SAFETY: the slot is in Sending state; its buffer holds the read.
    let got = unsafe { std::slice::from_raw_parts(ptr, 4096) };
    assert_eq!(got, &data[..], "the WRITE sends what was written");
    assert!(r.q.busy());
    r.tx.released.push(slot);
    r.q.reclaim(&mut r.tx);
    assert!(!r.q.busy(), "the SEND completion frees the slot");
}

#[test]
fn bad_descriptors_get_their_status_and_the_queue_lives_on() {
    let mut r = Rig::io();
    type Case = (&'static str, Box<dyn Fn(&mut Sqe)>, Status);
    let cases: [Case; 5] = [
        (
            "TCP's transport SGL",
            Box::new(|s: &mut Sqe| {
                s.set_sgl(Sgl {
                    addr: 0,
                    len: 4096,
                    id: sgl_id::TRANSPORT,
                })
            }),
            Status::SGL_TYPE_INVALID,
        ),
        (
            "keyed subtype 1h",
            Box::new(|s: &mut Sqe| {
                keyed(s, 4096, false);
                s.0[39] = 0x41;
            }),
            Status::INVALID_FIELD,
        ),
        (
            "length other than NLB",
            Box::new(|s: &mut Sqe| keyed(s, 2048, false)),
            Status::SGL_DATA_INVALID,
        ),
        (
            "in-capsule length beyond the capsule",
            Box::new(|s: &mut Sqe| {
                s.set_sgl(Sgl {
                    addr: 0,
                    len: 4096,
                    id: sgl_id::IN_CAPSULE,
                })
            }),
            Status::SGL_DATA_INVALID,
        ),
        (
            "past the end of the namespace",
            Box::new(|s: &mut Sqe| {
                s.set_slba(2047);
                keyed(s, 4096, false);
            }),
            Status::LBA_OUT_OF_RANGE,
        ),
    ];
    for (i, (what, f, want)) in cases.iter().enumerate() {
        let mut w = rw(nvm::WRITE, 20 + i as u16, 0, 8);
        f(&mut w);
        r.send(&w.0).unwrap();
        let (cqe, _) = r.response();
        assert_eq!(cqe.status, *want, "{what}");
        assert!(cqe.status.dnr, "{what}: not retryable");
    }
    let mut big = rw(nvm::READ, 30, 0, (limits::MDTS_BYTES / 512 + 8) as u16);
    keyed(&mut big, (limits::MDTS_BYTES + 4096) as u32, false);
    r.send(&big.0).unwrap();
    assert_eq!(r.response().0.status, Status::INVALID_FIELD, "above MDTS");
    assert!(!r.q.terminated() && !r.q.busy());
}

#[test]
fn in_capsule_data_is_refused_on_the_admin_queue() {
    let target = target();
    let mut r = Rig::queue(&target, 0);
    let data = connect_data(0xFFFF);
    let mut sqe = connect_sqe(0);
    sqe.set_sgl(Sgl {
        addr: 0,
        len: data.len() as u32,
        id: sgl_id::IN_CAPSULE,
    });
    r.send(&[&sqe.0[..], &data].concat()).unwrap();
    let (cqe, _) = r.response();
    assert_eq!(cqe.status, Status::SGL_OFFSET_INVALID);
    assert!(r.target.controllers().is_empty());
}

#[test]
fn a_connect_for_another_qid_or_transport_is_refused() {
    let target = target();
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
    let data = connect_data(ctrl.cntlid);
    for (cm_qid, qid, what) in [
        (2, 1, "CM QID 2, Connect QID 1"),
        (1, 1, "a TCP controller"),
    ] {
        let mut r = Rig::queue(&target, cm_qid);
        let mut sqe = connect_sqe(qid);
        sqe.set_sgl(Sgl {
            addr: 0,
            len: data.len() as u32,
            id: sgl_id::IN_CAPSULE,
        });
        r.send(&[&sqe.0[..], &data].concat()).unwrap();
        let (cqe, _) = r.response();
        assert_eq!(cqe.status, Status::CONNECT_INVALID_PARAMETERS, "{what}");
    }
}

#[test]
fn a_runt_capsule_ends_the_queue_pair() {
    let target = target();
    let mut r = Rig::queue(&target, 0);
    assert!(r.send(&[0u8; 40]).is_err());
    assert!(r.q.terminated());
    assert!(r.work().is_empty(), "no termination PDU on RDMA");
}
