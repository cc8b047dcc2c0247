//! Malformed PDUs: each on its own connection must end that connection with
//! a C2HTermReq naming the error (FES, and FEI for invalid header fields),
//! quoting the offending header, and then a close, while a healthy
//! connection of another controller keeps doing I/O.

mod common;

use common::*;
use nvpool_wire::fabrics::fctype;
use nvpool_wire::sqe::admin;
use nvpool_wire::tcp::{fes, flags, Digests, IcReq};
use nvpool_wire::{Sgl, Sqe};
use std::net::{Shutdown, SocketAddr};
use std::time::Duration;

/// What a case expects from the target.
#[derive(Debug)]
enum Expect {
    /// A C2HTermReq with this FES (and FEI, when given), then a close.
    Term { fes: u16, fei: Option<u32> },
    /// A close with nothing sent.
    Close,
}

/// One malformed exchange: the connection it used, the offending bytes,
/// and what the target must do.
struct Case {
    conn: Conn,
    offending: Vec<u8>,
    expect: Expect,
}

/// The live controller the cases attach I/O queues to.
#[derive(Clone, Copy, Debug)]
struct Env {
    addr: SocketAddr,
    cntlid: u16,
}

fn keep_alive_sqe() -> Sqe {
    let mut s = Sqe::new(admin::KEEP_ALIVE, 9);
    s.set_sgl(NULL_SGL);
    s
}

fn send(mut conn: Conn, offending: Vec<u8>, expect: Expect) -> Case {
    // The target may close before it has read everything we send.
    let _ = conn.try_send_raw(&offending);
    Case {
        conn,
        offending,
        expect,
    }
}

/// An I/O queue (QID 2) of the live controller.
fn io_queue(env: Env, dg: Digests) -> Conn {
    let mut q = Conn::open_ic(env.addr, dg);
    q.io_connect(SUBNQN, HOST_A, env.cntlid, 2, 7).ok();
    q
}

fn wrong_hlen(env: Env) -> Case {
    let c = Conn::open_ic(env.addr, NO_DIGESTS);
    let mut pdu = capsule_pdu(&keep_alive_sqe(), &[], NO_DIGESTS);
    pdu[2] = 71;
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::INVALID_HEADER_FIELD,
            fei: Some(2),
        },
    )
}

fn plen_shorter_than_hlen(env: Env) -> Case {
    let c = Conn::open_ic(env.addr, NO_DIGESTS);
    let mut pdu = capsule_pdu(&keep_alive_sqe(), &[], NO_DIGESTS);
    pdu[4..8].copy_from_slice(&40u32.to_le_bytes());
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::INVALID_HEADER_FIELD,
            fei: Some(4),
        },
    )
}

fn plen_longer_than_a_dataless_capsule(env: Env) -> Case {
    let c = Conn::open_ic(env.addr, NO_DIGESTS);
    let mut pdu = capsule_pdu(&keep_alive_sqe(), &[], NO_DIGESTS);
    pdu[4..8].copy_from_slice(&100u32.to_le_bytes());
    pdu.resize(100, 0);
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::INVALID_HEADER_FIELD,
            fei: Some(4),
        },
    )
}

fn pdo_inside_the_header(env: Env) -> Case {
    let c = Conn::open_ic(env.addr, NO_DIGESTS);
    let mut pdu = capsule_pdu(&keep_alive_sqe(), &[], NO_DIGESTS);
    pdu[3] = 16;
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::INVALID_HEADER_FIELD,
            fei: Some(3),
        },
    )
}

fn unknown_pdu_type(env: Env) -> Case {
    let c = Conn::open_ic(env.addr, NO_DIGESTS);
    let mut pdu = vec![0u8; 24];
    pdu[..8].copy_from_slice(&[0x08, 0, 24, 0, 24, 0, 0, 0]);
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::INVALID_HEADER_FIELD,
            fei: Some(0),
        },
    )
}

fn c2h_pdu_from_the_host(env: Env) -> Case {
    let c = Conn::open_ic(env.addr, NO_DIGESTS);
    // A CapsuleResp (controller to host only).
    let mut pdu = vec![0u8; 24];
    pdu[..8].copy_from_slice(&[0x05, 0, 24, 0, 24, 0, 0, 0]);
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::INVALID_HEADER_FIELD,
            fei: Some(0),
        },
    )
}

fn capsule_before_icreq(env: Env) -> Case {
    let c = Conn::open(env.addr);
    let pdu = capsule_pdu(&keep_alive_sqe(), &[], NO_DIGESTS);
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::PDU_SEQUENCE_ERROR,
            fei: None,
        },
    )
}

fn second_icreq(env: Env) -> Case {
    let c = Conn::open_ic(env.addr, NO_DIGESTS);
    let pdu = IcReq {
        pfv: 0,
        hpda: 0,
        digests: NO_DIGESTS,
        maxr2t: 0,
    }
    .encode()
    .to_vec();
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::PDU_SEQUENCE_ERROR,
            fei: None,
        },
    )
}

fn icreq_with_hpda(env: Env) -> Case {
    let c = Conn::open(env.addr);
    let pdu = IcReq {
        pfv: 0,
        hpda: 3,
        digests: NO_DIGESTS,
        maxr2t: 0,
    }
    .encode()
    .to_vec();
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::UNSUPPORTED_PARAMETER,
            fei: Some(10),
        },
    )
}

fn bad_header_digest(env: Env) -> Case {
    let dg = Digests {
        header: true,
        data: false,
    };
    let c = Conn::open_ic(env.addr, dg);
    let mut pdu = capsule_pdu(&keep_alive_sqe(), &[], dg);
    pdu[72] ^= 0xFF;
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::HEADER_DIGEST_ERROR,
            fei: None,
        },
    )
}

fn header_digest_flag_not_negotiated(env: Env) -> Case {
    let c = Conn::open_ic(env.addr, NO_DIGESTS);
    let mut pdu = capsule_pdu(&keep_alive_sqe(), &[], NO_DIGESTS);
    pdu[1] |= flags::HDGSTF;
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::INVALID_HEADER_FIELD,
            fei: Some(1),
        },
    )
}

fn h2c_data_unknown_ttag(env: Env) -> Case {
    let c = io_queue(env, NO_DIGESTS);
    let pdu = h2c_pdu(5, 77, 0, &[0xAB; 512], true, NO_DIGESTS);
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::INVALID_HEADER_FIELD,
            fei: Some(10),
        },
    )
}

/// Starts a 16 KiB R2T write on a fresh I/O queue; returns the queue, CID and TTAG.
fn awaiting_data(env: Env) -> (Conn, u16, u16) {
    let mut c = io_queue(env, NO_DIGESTS);
    let mut w = write_cmd(1, 0, 32, false);
    w.set_sgl(Sgl {
        addr: 0,
        len: 16384,
        id: nvpool_wire::sqe::sgl_id::TRANSPORT,
    });
    w.set_cid(40);
    c.send_raw(&capsule_pdu(&w, &[], NO_DIGESTS));
    let r = c.recv_pdu().expect("R2T").r2t();
    assert_eq!((r.cccid, r.r2to, r.r2tl), (40, 0, 16384));
    (c, 40, r.ttag)
}

fn h2c_data_wrong_datao(env: Env) -> Case {
    let (c, cid, ttag) = awaiting_data(env);
    let pdu = h2c_pdu(cid, ttag, 512, &[0xAB; 4096], false, NO_DIGESTS);
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::DATA_OUT_OF_RANGE,
            fei: None,
        },
    )
}

fn h2c_data_beyond_the_transfer(env: Env) -> Case {
    let (mut c, cid, ttag) = awaiting_data(env);
    c.send_raw(&h2c_pdu(cid, ttag, 0, &[0xAB; 8192], false, NO_DIGESTS));
    let pdu = h2c_pdu(cid, ttag, 8192, &[0xAB; 12288], true, NO_DIGESTS);
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::DATA_OUT_OF_RANGE,
            fei: None,
        },
    )
}

fn h2c_data_wrong_cccid(env: Env) -> Case {
    let (c, cid, ttag) = awaiting_data(env);
    let pdu = h2c_pdu(cid + 1, ttag, 0, &[0xAB; 4096], false, NO_DIGESTS);
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::INVALID_HEADER_FIELD,
            fei: Some(8),
        },
    )
}

fn h2c_data_datal_disagrees_with_plen(env: Env) -> Case {
    let (c, cid, ttag) = awaiting_data(env);
    let mut pdu = h2c_pdu(cid, ttag, 0, &[0xAB; 4096], false, NO_DIGESTS);
    pdu[16..20].copy_from_slice(&2048u32.to_le_bytes());
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::INVALID_HEADER_FIELD,
            fei: Some(16),
        },
    )
}

fn oversize_h2c_data(env: Env) -> Case {
    let (c, cid, ttag) = awaiting_data(env);
    // Only the header: PLEN announces 1 MiB, far above MAXH2CDATA.
    let mut pdu = h2c_pdu(cid, ttag, 0, &[0xAB; 16], false, NO_DIGESTS);
    pdu.truncate(24);
    pdu[4..8].copy_from_slice(&(1u32 << 20).to_le_bytes());
    pdu[16..20].copy_from_slice(&((1u32 << 20) - 24).to_le_bytes());
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::R2T_LIMIT_EXCEEDED,
            fei: None,
        },
    )
}

fn oversize_capsule(env: Env) -> Case {
    let c = io_queue(env, NO_DIGESTS);
    let mut w = write_cmd(1, 0, 64, false);
    w.set_sgl(Sgl {
        addr: 0,
        len: 32768,
        id: nvpool_wire::sqe::sgl_id::IN_CAPSULE,
    });
    // 32 KiB of in-capsule data: above the 16 KiB the target accepts.
    let mut pdu = capsule_pdu(&w, &[0xCD; 32768], NO_DIGESTS);
    pdu.truncate(72);
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::INVALID_HEADER_FIELD,
            fei: Some(4),
        },
    )
}

fn too_many_commands_outstanding(env: Env) -> Case {
    // Queue of 8 entries (SQSIZE 7): the ninth command has no slot.
    let mut c = io_queue(env, NO_DIGESTS);
    let mut last = Vec::new();
    for cid in 0..9u16 {
        let mut w = write_cmd(1, cid as u64 * 8, 8, false);
        w.set_sgl(Sgl {
            addr: 0,
            len: 4096,
            id: nvpool_wire::sqe::sgl_id::TRANSPORT,
        });
        w.set_cid(cid);
        last = capsule_pdu(&w, &[], NO_DIGESTS);
        if cid < 8 {
            c.send_raw(&last);
            assert_eq!(
                c.recv_pdu().expect("R2T").kind(),
                nvpool_wire::tcp::PduType::R2T
            );
        }
    }
    send(
        c,
        last,
        Expect::Term {
            fes: fes::PDU_SEQUENCE_ERROR,
            fei: None,
        },
    )
}

fn garbage_before_icreq(env: Env) -> Case {
    // Someone speaking HTTP to the NVMe/TCP port.
    let c = Conn::open(env.addr);
    let pdu = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
    send(
        c,
        pdu,
        Expect::Term {
            fes: fes::INVALID_HEADER_FIELD,
            fei: Some(0),
        },
    )
}

fn garbage_after_icreq(env: Env) -> Case {
    let c = Conn::open_ic(env.addr, NO_DIGESTS);
    send(
        c,
        pattern(99, 300).iter().map(|b| b | 0x80).collect(),
        Expect::Term {
            fes: fes::INVALID_HEADER_FIELD,
            fei: None,
        },
    )
}

fn host_term_req(env: Env) -> Case {
    let c = Conn::open_ic(env.addr, NO_DIGESTS);
    let mut pdu = vec![0u8; 24];
    pdu[..8].copy_from_slice(&[0x02, 0, 24, 0, 24, 0, 0, 0]);
    pdu[8] = fes::PDU_SEQUENCE_ERROR as u8;
    send(c, pdu, Expect::Close)
}

fn closed_mid_pdu(env: Env) -> Case {
    let mut c = Conn::open_ic(env.addr, NO_DIGESTS);
    let pdu = capsule_pdu(&keep_alive_sqe(), &[], NO_DIGESTS);
    c.send_raw(&pdu[..40]);
    c.sock.shutdown(Shutdown::Write).expect("half close");
    Case {
        conn: c,
        offending: Vec::new(),
        expect: Expect::Close,
    }
}

fn closed_mid_h2c_data(env: Env) -> Case {
    let (mut c, cid, ttag) = awaiting_data(env);
    let pdu = h2c_pdu(cid, ttag, 0, &[0xAB; 16384], true, NO_DIGESTS);
    c.send_raw(&pdu[..5000]);
    c.sock.shutdown(Shutdown::Write).expect("half close");
    Case {
        conn: c,
        offending: Vec::new(),
        expect: Expect::Close,
    }
}

fn closed_mid_connect_data(env: Env) -> Case {
    let mut c = Conn::open_ic(env.addr, NO_DIGESTS);
    let sqe = nvpool_wire::fabrics::ConnectCmd {
        recfmt: 0,
        qid: 0,
        sqsize: 31,
        cattr: 0,
        kato_ms: 0,
    }
    .to_sqe(1);
    let data = nvpool_wire::fabrics::ConnectData {
        hostid: [1; 16],
        cntlid: 0xFFFF,
        subnqn: SUBNQN,
        hostnqn: HOST_A,
    }
    .encode();
    let pdu = capsule_pdu(&sqe, &data, NO_DIGESTS);
    assert_eq!(sqe.fctype(), fctype::CONNECT);
    c.send_raw(&pdu[..600]);
    c.sock.shutdown(Shutdown::Write).expect("half close");
    Case {
        conn: c,
        offending: Vec::new(),
        expect: Expect::Close,
    }
}

/// Runs one case and checks the target's answer.
fn check(name: &str, case: Case) {
    let Case {
        mut conn,
        offending,
        expect,
    } = case;
    match expect {
        Expect::Term { fes, fei } => {
            let (got_fes, got_fei, pdu) = conn.expect_term();
            assert_eq!(got_fes, fes, "{name}: FES");
            if let Some(fei) = fei {
                assert_eq!(got_fei, fei, "{name}: FEI");
            }
            let quote = pdu.term_quote();
            assert!(
                !quote.is_empty() && quote.len() <= 128,
                "{name}: quoted {} bytes",
                quote.len()
            );
            assert_eq!(
                quote,
                &offending[..quote.len().min(offending.len())],
                "{name}: the quote is the offending header"
            );
            let rest = conn.expect_closed(Duration::from_secs(3));
            assert!(
                rest.is_empty(),
                "{name}: {} bytes after the C2HTermReq",
                rest.len()
            );
        }
        Expect::Close => {
            let rest = conn.expect_closed(Duration::from_secs(3));
            assert!(
                rest.is_empty(),
                "{name}: {} bytes before the close: {rest:02x?}",
                rest.len()
            );
        }
    }
}

/// A daemon, a healthy controller, and the check that it keeps working.
fn with_healthy<F: FnOnce(Env, &mut dyn FnMut(u64))>(f: F) {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let mut a = admin_session(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    a.set_queue_count(4);
    // The healthy queue belongs to a different controller than the cases use.
    let (_ha, mut hq) = controller(d.addr, ALL_DIGESTS, SUBNQN, HOST_B);
    let env = Env {
        addr: d.addr,
        cntlid: a.cntlid,
    };
    let mut healthy = |seed: u64| {
        let data = pattern(seed, 32 << 10);
        hq.write(1, 1024, &data, 512, false).ok();
        assert_eq!(hq.read_ok(1, 1024, 64, 512), data);
    };
    healthy(0);
    f(env, &mut healthy);
    // Still serving new connections.
    let (_na, mut nq) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    nq.flush(1).ok();
    a.keep_alive().ok();
}

fn run_one(name: &str, f: CaseFn) {
    with_healthy(|env, healthy| {
        check(name, f(env));
        healthy(1);
    });
}

type CaseFn = fn(Env) -> Case;

/// Declares the case table and one test per case (in module `each`).
macro_rules! cases {
    ($($name:ident),* $(,)?) => {
        const CASES: &[(&str, CaseFn)] = &[$((stringify!($name), $name)),*];

        mod each {
            $(
                #[test]
                fn $name() {
                    super::run_one(stringify!($name), super::$name);
                }
            )*
        }
    };
}

cases!(
    wrong_hlen,
    plen_shorter_than_hlen,
    plen_longer_than_a_dataless_capsule,
    pdo_inside_the_header,
    unknown_pdu_type,
    c2h_pdu_from_the_host,
    capsule_before_icreq,
    second_icreq,
    icreq_with_hpda,
    bad_header_digest,
    header_digest_flag_not_negotiated,
    h2c_data_unknown_ttag,
    h2c_data_wrong_datao,
    h2c_data_beyond_the_transfer,
    h2c_data_wrong_cccid,
    h2c_data_datal_disagrees_with_plen,
    oversize_h2c_data,
    oversize_capsule,
    too_many_commands_outstanding,
    garbage_before_icreq,
    garbage_after_icreq,
    host_term_req,
    closed_mid_pdu,
    closed_mid_h2c_data,
    closed_mid_connect_data,
);

/// Every case, one after another, against one daemon.
#[test]
fn all_cases_in_a_row_leave_the_daemon_serving() {
    with_healthy(|env, healthy| {
        for (i, (name, f)) in CASES.iter().enumerate() {
            check(name, f(env));
            healthy(i as u64 + 1);
        }
    });
}
