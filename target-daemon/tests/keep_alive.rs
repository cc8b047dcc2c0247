//! Keep-alive: a silent controller is removed once its KATO runs out (every
//! queue connection closes); one that sends Keep Alive in time lives on.
//! Deadlines here are generous: this checks behaviour, not timing precision.

mod common;

use common::*;
use std::time::{Duration, Instant};

const KATO_MS: u32 = 1000;

/// An enabled controller with KATO 1 s and I/O queue 1.
fn short_kato_controller(d: &Daemon) -> (Conn, Conn) {
    let mut a = Conn::open_ic(d.addr, NO_DIGESTS);
    a.admin_connect(SUBNQN, HOST_A, KATO_MS).ok();
    a.enable();
    a.set_queue_count(1);
    let q = io_session(d.addr, NO_DIGESTS, SUBNQN, HOST_A, a.cntlid, 1);
    (a, q)
}

#[test]
fn silent_controller_expires_and_a_live_one_stays() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let (mut silent_a, mut silent_q) = short_kato_controller(&d);
    let (mut live_a, mut live_q) = short_kato_controller(&d);
    let silent_id = silent_a.cntlid;
    let start = Instant::now();

    let pinger = std::thread::spawn(move || {
        // Keep Alive every 300 ms for 3 s; only the admin queue talks.
        while start.elapsed() < Duration::from_secs(3) {
            live_a.keep_alive().ok();
            std::thread::sleep(Duration::from_millis(300));
        }
        live_a
    });

    // Not before the timeout (KATO minus slack) ...
    assert!(
        silent_a.quiet_for(Duration::from_millis(600)),
        "closed long before KATO"
    );
    // ... but well within three times it.
    let extra = silent_a.expect_closed(Duration::from_secs(3));
    assert!(
        extra.is_empty(),
        "nothing is sent on expiry, got {} bytes",
        extra.len()
    );
    silent_q.expect_closed(Duration::from_secs(1));
    let expired_after = start.elapsed();
    assert!(
        expired_after >= Duration::from_millis(900),
        "expired after {expired_after:?}"
    );
    assert!(
        d.target.controller(silent_id).is_none(),
        "the expired controller is gone"
    );

    let mut live_a = pinger.join().expect("pinger");
    // Three KATOs later the live controller and its I/O queue still work.
    live_a.keep_alive().ok();
    live_q.flush(1).ok();
    let data = pattern(1, 4096);
    live_q.write(1, 0, &data, 512, false).ok();
    assert_eq!(live_q.read_ok(1, 0, 8, 512), data);

    // A new I/O Connect naming the expired CNTLID is refused.
    let mut q = Conn::open_ic(d.addr, NO_DIGESTS);
    q.io_connect(SUBNQN, HOST_A, silent_id, 1, 31)
        .expect_status(nvpool_wire::Status::CONNECT_INVALID_PARAMETERS);
}

#[test]
fn io_commands_count_as_keep_alive_traffic() {
    // Any command resets the controller's timer (as on the Linux target):
    // a controller busy with I/O but silent on its admin queue stays alive.
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let (mut a, mut q) = short_kato_controller(&d);
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(2500) {
        q.flush(1).ok();
        std::thread::sleep(Duration::from_millis(200));
    }
    a.keep_alive().ok();
}

#[test]
fn kato_changed_by_set_features() {
    let d = Daemon::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let mut a = Conn::open_ic(d.addr, NO_DIGESTS);
    a.admin_connect(SUBNQN, HOST_A, 60_000).ok();
    a.enable();
    // Feature 0Fh: KATO 500 ms, then silence.
    a.set_features(0x0F, 500).ok();
    let start = Instant::now();
    a.expect_closed(Duration::from_secs(3));
    assert!(
        start.elapsed() >= Duration::from_millis(400),
        "expired after {:?}",
        start.elapsed()
    );
}
