//! The handshake deadline (`limits::HANDSHAKE_TIMEOUT_MS`, shortened here
//! with `Target::set_handshake_timeout_ms`): a connection that has not
//! finished ICReq/ICResp and a successful Connect by then is closed and
//! its place under the connection limit freed, so sockets that never
//! finish cannot keep hosts out.

mod common;

use common::*;
use nvpool_target::Target;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const DEADLINE_MS: u64 = 400;

fn target(deadline_ms: u64, connections_max: Option<usize>) -> Daemon {
    let t = Target::new(None).expect("target");
    t.set_handshake_timeout_ms(deadline_ms);
    if let Some(n) = connections_max {
        t.set_connections_max(n);
    }
    Daemon::start_with(t, &[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])])
}

/// Waits for the target to close `s` (EOF or reset); returns how long
/// that took, or None if it was still open after `within`.
fn closed_within(s: &mut TcpStream, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(50)))
        .expect("timeout");
    let mut b = [0u8; 256];
    while start.elapsed() < within {
        match s.read(&mut b) {
            Ok(0) => return Some(start.elapsed()),
            // Whatever the target still had to say (an ICResp).
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return Some(start.elapsed()),
        }
    }
    None
}

/// Half a Connect: ICReq done, then the first bytes of a CapsuleCmd.
fn half_connect(d: &Daemon) -> TcpStream {
    let c = Conn::open_ic(d.addr, NO_DIGESTS);
    let mut s = c.sock;
    let mut sqe = nvpool_wire::Sqe::new(nvpool_wire::sqe::admin::FABRICS, 1);
    sqe.set_sgl(NULL_SGL);
    let pdu = capsule_pdu(&sqe, &[0u8; 1024], NO_DIGESTS);
    s.write_all(&pdu[..pdu.len() / 2]).expect("send");
    s
}

#[test]
fn connections_that_do_not_finish_the_handshake_are_closed() {
    let d = target(DEADLINE_MS, None);
    let start = Instant::now();
    let mut silent = TcpStream::connect(d.addr).expect("connect");
    let mut ic_only = Conn::open_ic(d.addr, NO_DIGESTS).sock;
    let mut half = half_connect(&d);
    // A host that finished: its queues outlive the deadline.
    let (mut a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);

    let patience = Duration::from_millis(DEADLINE_MS + 2_000);
    for (what, s) in [
        ("sent nothing", &mut silent),
        ("sent only an ICReq", &mut ic_only),
        ("stopped half way through its Connect", &mut half),
    ] {
        assert!(
            closed_within(s, patience).is_some(),
            "a connection that {what} is still open"
        );
    }
    assert!(
        start.elapsed() >= Duration::from_millis(DEADLINE_MS),
        "closed before the deadline: {:?}",
        start.elapsed()
    );
    std::thread::sleep(Duration::from_millis(DEADLINE_MS));
    let data = pattern(5, 4096);
    q.write(1, 0, &data, 512, false).ok();
    assert_eq!(q.read_ok(1, 0, 8, 512), data);
    a.keep_alive().ok();
}

#[test]
fn idle_sockets_filling_the_connection_limit_give_their_places_back() {
    const MAX: usize = 6;
    let d = target(DEADLINE_MS, Some(MAX));
    let mut idle: Vec<TcpStream> = (0..MAX)
        .map(|_| TcpStream::connect(d.addr).expect("connect"))
        .collect();
    // Let the acceptor hand them all to reactors.
    std::thread::sleep(Duration::from_millis(100));
    // The limit is full: a host is refused now (closed before its ICResp).
    let mut refused = TcpStream::connect(d.addr).expect("the kernel accepts");
    let icreq = nvpool_wire::tcp::IcReq {
        pfv: 0,
        hpda: 0,
        digests: NO_DIGESTS,
        maxr2t: 0,
    }
    .encode();
    let _ = refused.write_all(&icreq);
    let mut b = [0u8; nvpool_wire::tcp::IC_PDU_LEN];
    refused
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    assert!(
        !matches!(refused.read(&mut b), Ok(n) if n > 0),
        "a connection past the limit was served"
    );
    // Past the deadline the idle sockets are gone and hosts get in again.
    for s in &mut idle {
        assert!(
            closed_within(s, Duration::from_millis(DEADLINE_MS + 2_000)).is_some(),
            "an idle socket outlived the deadline"
        );
    }
    std::thread::sleep(Duration::from_millis(100));
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    let data = pattern(6, 8192);
    q.write(1, 8, &data, 512, false).ok();
    assert_eq!(q.read_ok(1, 8, 16, 512), data);
}

#[test]
fn the_deadline_is_ten_seconds_unless_changed() {
    assert_eq!(nvpool_target::limits::HANDSHAKE_TIMEOUT_MS, 10_000);
    let t = Target::new(None).expect("target");
    assert_eq!(t.handshake_timeout_ms(), 10_000);
    assert_eq!(t.connections_max(), nvpool_target::limits::CONNECTIONS_MAX);
    t.set_connections_max(usize::MAX);
    assert_eq!(t.connections_max(), nvpool_target::limits::CONNECTIONS_MAX);
}

/// 1,000 connections opened at once to a target with one reactor, whose
/// hand-off queue holds far fewer, and under the connection limit: every
/// one is adopted and answers its ICReq. The acceptor leaves connections
/// in the kernel's listen backlog while the reactors' queues are full
/// instead of accepting and dropping them.
#[test]
fn a_burst_of_connections_far_beyond_the_hand_off_queue_is_served_whole() {
    const THREADS: usize = 8;
    const PER_THREAD: usize = 125;
    let t = Target::new(None).expect("target");
    t.put_subsystem(&subsystem(SUBNQN, &[], &[(1, RAM_SPEC)]))
        .expect("subsystem");
    let opts = nvpool_target::StartOptions {
        listeners: vec!["127.0.0.1:0".parse().expect("addr")],
        rdma_listeners: vec![],
        reactors: 1,
        io_uring: true,
        admin: None,
    };
    let running = nvpool_target::Running::start(t, &opts).expect("daemon starts");
    let addr = running.listen_addrs()[0];
    let start = std::sync::Arc::new(std::sync::Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let start = start.clone();
            std::thread::spawn(move || {
                start.wait();
                (0..PER_THREAD)
                    .map(|_| TcpStream::connect(addr))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut socks = Vec::new();
    for th in threads {
        for s in th.join().expect("connecting thread") {
            socks.push(s.expect("connect"));
        }
    }
    let icreq = nvpool_wire::tcp::IcReq {
        pfv: 0,
        hpda: 0,
        digests: NO_DIGESTS,
        maxr2t: 0,
    }
    .encode();
    for s in &mut socks {
        s.write_all(&icreq).expect("ICReq sent");
    }
    let mut answered = 0;
    let mut failures = Vec::new();
    for (i, s) in socks.iter_mut().enumerate() {
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut b = [0u8; nvpool_wire::tcp::IC_PDU_LEN];
        match s.read_exact(&mut b) {
            Ok(()) if nvpool_wire::tcp::IcResp::decode(&b).is_ok() => answered += 1,
            Ok(()) => failures.push(format!("{i}: not an ICResp")),
            Err(e) => failures.push(format!("{i}: {e}")),
        }
    }
    assert_eq!(
        answered,
        THREADS * PER_THREAD,
        "connections not served: {}",
        failures
            .iter()
            .take(5)
            .cloned()
            .collect::<Vec<_>>()
            .join("; ")
    );
    drop(socks);
    running.shutdown();
}
