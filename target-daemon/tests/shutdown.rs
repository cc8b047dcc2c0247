//! Clean shutdown under load: commands in flight when `shutdown()` is
//! called are either answered correctly or not at all, shutdown returns
//! promptly, and every write the target acknowledged is in the file.

mod common;

use common::*;
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

const DEPTH: usize = 16;
/// Each connection writes its own half of the file.
const FILE_BYTES: u64 = 256 << 20;
const REGION_BLOCKS: u64 = FILE_BYTES / 512 / 2;

/// One write the load generator sent.
#[derive(Debug)]
struct Sent {
    off: u64,
    data: Vec<u8>,
    acked: bool,
}

/// What the load generator saw.
#[derive(Debug, Default)]
struct Seen {
    /// Every write sent, answered or not.
    sent: Vec<Sent>,
    answered: usize,
}

/// Keeps DEPTH writes in flight on `q` until the connection ends, writing
/// region `region` of the file front to back (wrapping if it must).
/// Every answer must be a success for a CID in flight.
fn load(mut q: Conn, region: u64, r2t_every: usize) -> Seen {
    let mut seen = Seen::default();
    // CID -> index into seen.sent.
    let mut outstanding: HashMap<u16, usize> = HashMap::new();
    let base = region * REGION_BLOCKS;
    let mut next_lba = base;
    let mut i = 0usize;
    loop {
        while outstanding.len() < DEPTH {
            let r2t = r2t_every > 0 && i.is_multiple_of(r2t_every);
            let len = if r2t { 64 << 10 } else { 4096 };
            let blocks = (len / 512) as u64;
            if next_lba + blocks > base + REGION_BLOCKS {
                next_lba = base;
            }
            let data = pattern(i as u64 + 1, len);
            let cmd = write_cmd(1, next_lba, blocks as u32, false);
            match q.try_submit_write(cmd, data.clone(), !r2t) {
                Ok(cid) => {
                    outstanding.insert(cid, seen.sent.len());
                    seen.sent.push(Sent {
                        off: next_lba * 512,
                        data,
                        acked: false,
                    });
                }
                Err(_) => return seen,
            }
            next_lba += blocks;
            i += 1;
        }
        let c = match q.try_next_completion() {
            Ok(c) => c,
            Err(_) => return seen,
        };
        let w = outstanding
            .remove(&c.cid)
            .unwrap_or_else(|| panic!("answer for CID {} not in flight", c.cid));
        c.ok();
        seen.answered += 1;
        seen.sent[w].acked = true;
    }
}

/// Checks acknowledged writes against the file.
fn check_file(path: &Path, acked: &[&Sent]) {
    let file = std::fs::read(path).expect("read backing file");
    for w in acked {
        let o = w.off as usize;
        assert!(
            file[o..o + w.data.len()] == w.data[..],
            "acknowledged write at byte {} is not in the file",
            w.off
        );
    }
}

/// Acknowledged writes that no other write sent (answered or not)
/// overlaps: their bytes in the file are unambiguous.
fn unambiguous(sent: &mut [Sent]) -> Vec<&Sent> {
    sent.sort_by_key(|w| w.off);
    let end = |w: &Sent| w.off + w.data.len() as u64;
    let mut keep = Vec::new();
    let mut max_end_before = 0u64;
    for (i, w) in sent.iter().enumerate() {
        let next_start = sent.get(i + 1).map_or(u64::MAX, |n| n.off);
        if w.acked && max_end_before <= w.off && end(w) <= next_start {
            keep.push(w);
        }
        max_end_before = max_end_before.max(end(w));
    }
    keep
}

fn shutdown_under_load(r2t_every: usize) {
    let (_dir, path) = scratch_file(FILE_BYTES);
    let spec = file_spec(&path);
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, &spec)])]);
    let mut workers = Vec::new();
    let mut admins = Vec::new();
    for (region, host) in [HOST_A, HOST_B].into_iter().enumerate() {
        let (a, q) = controller(d.addr, NO_DIGESTS, SUBNQN, host);
        admins.push(a);
        workers.push(std::thread::spawn(move || {
            load(q, region as u64, r2t_every)
        }));
    }
    // Let the load run, then stop the daemon under it.
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    d.shutdown();
    let took = t.elapsed();
    let mut sent = Vec::new();
    for w in workers {
        let seen = w.join().expect("load thread");
        assert!(seen.answered > 0, "no I/O completed before shutdown");
        sent.extend(seen.sent);
    }
    let checkable = unambiguous(&mut sent);
    assert!(!checkable.is_empty());
    check_file(&path, &checkable);
    assert!(took < Duration::from_secs(5), "shutdown took {took:?}");
    for mut a in admins {
        a.expect_closed(Duration::from_secs(2));
    }
}

#[test]
fn shutdown_with_in_capsule_writes_in_flight() {
    shutdown_under_load(0);
}

#[test]
fn shutdown_with_r2t_writes_in_flight() {
    shutdown_under_load(3);
}

#[test]
fn shutdown_with_idle_connections_is_quick() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let (mut a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    q.flush(1).ok();
    let t = Instant::now();
    d.shutdown();
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "shutdown took {:?}",
        t.elapsed()
    );
    a.expect_closed(Duration::from_secs(1));
    q.expect_closed(Duration::from_secs(1));
}

/// A controller whose admin queue and I/O queue run on the same reactor:
/// the acceptor hands connections to the two reactors in turn, so a
/// throwaway connection between them puts both on reactor 0.
fn same_reactor_controller(d: &Daemon) -> (Conn, Conn) {
    let mut a = admin_session(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    a.set_queue_count(2);
    let other = Conn::open_ic(d.addr, NO_DIGESTS);
    let q = io_session(d.addr, NO_DIGESTS, SUBNQN, HOST_A, a.cntlid, 1);
    other.close();
    (a, q)
}

/// A write whose R2T is out when shutdown begins and whose data arrives
/// during the drain: the command either completes or is dropped, and
/// shutdown does not sit out the whole drain deadline waiting for it.
#[test]
fn shutdown_with_write_data_arriving_during_the_drain() {
    let (_dir, path) = scratch_file(4 << 20);
    let spec = file_spec(&path);
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, &spec)])]);
    let (mut a, mut q) = same_reactor_controller(&d);
    let data = pattern(5, 16 << 10);
    let mut w = write_cmd(1, 0, 32, false);
    w.set_sgl(nvpool_wire::Sgl {
        addr: 0,
        len: data.len() as u32,
        id: nvpool_wire::sqe::sgl_id::TRANSPORT,
    });
    w.set_cid(300);
    q.send_raw(&capsule_pdu(&w, &[], NO_DIGESTS));
    let r = q.recv_pdu().expect("R2T").r2t();
    assert_eq!(r.cccid, 300);

    let stopper = std::thread::spawn(move || {
        let t = Instant::now();
        d.shutdown();
        t.elapsed()
    });
    // The drain has begun when the data comes.
    std::thread::sleep(Duration::from_millis(200));
    let _ = q.try_send_raw(&h2c_pdu(300, r.ttag, 0, &data, true, NO_DIGESTS));
    if let Ok(c) = q.try_next_completion() {
        assert_eq!(c.cid, 300);
        c.ok();
        let file = std::fs::read(&path).expect("read file");
        assert_eq!(
            file[..data.len()],
            data[..],
            "acknowledged write is not in the file"
        );
    }
    let took = stopper.join().expect("shutdown thread");
    assert!(
        took < Duration::from_secs(5),
        "shutdown waited {took:?} for a command it will never run"
    );
    a.expect_closed(Duration::from_secs(1));
}

/// A command executing when shutdown begins is answered before its
/// connection closes ("in-flight commands get SHUTDOWN_DRAIN_MS to
/// complete"), also when the controller's admin queue is on another reactor.
#[test]
fn command_executing_at_shutdown_is_answered() {
    use nvpool_target::backend::{FaultBackend, FaultConfig, RamBackend};
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[])]);
    let slow = std::sync::Arc::new(FaultBackend::new(std::sync::Arc::new(RamBackend::new(
        1 << 20,
        512,
    ))));
    d.target
        .put_namespace_backend(SUBNQN, 1, slow.clone())
        .expect("namespace");
    // Admin queue on reactor 0, I/O queue on reactor 1.
    let (_a, mut q) = controller(d.addr, NO_DIGESTS, SUBNQN, HOST_A);
    slow.set(FaultConfig {
        latency: Duration::from_millis(600),
        ..Default::default()
    });
    let data = pattern(6, 4096);
    let cid = q.submit_write(write_cmd(1, 0, 8, false), data.clone(), true);
    std::thread::sleep(Duration::from_millis(100));
    let stopper = std::thread::spawn(move || d.shutdown());
    let answer = q.try_next_completion();
    stopper.join().expect("shutdown thread");
    let c = answer
        .unwrap_or_else(|e| panic!("the write in flight at shutdown was never answered ({e})"));
    assert_eq!(c.cid, cid);
    c.ok();
    slow.set(FaultConfig::default());
    let mut back = vec![0u8; 4096];
    nvpool_target::backend::Backend::read_at(&*slow, &mut back, 0).expect("read back");
    assert_eq!(back, data);
}
