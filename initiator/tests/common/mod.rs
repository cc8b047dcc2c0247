//! Test support for the initiator's interop tests: an in-process
//! nvpool-target on loopback ([`Tgt`]), connect parameters tuned for tests,
//! and synchronous helpers over [`IoQueue`] that never hang (every wait has
//! a deadline and a failing test says what it was waiting for).
//!
//! Every test binary compiles this module and uses a different part of it.
#![allow(dead_code)]

use nvpool_initiator::{Completion, ConnectParams, IoError, IoQueue, Op, Request};
use nvpool_target::config::SubsystemConfig;
use nvpool_target::{StartOptions, Target};
use nvpool_testkit::target::{loopback, start, Serving, LOOPBACK};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub mod memdev;
pub mod tap;
pub mod volumes;

pub const SUBNQN: &str = "nqn.2026-11.io.nvpool:init-disk";
pub const OTHER_NQN: &str = "nqn.2026-11.io.nvpool:init-other";
pub const THIRD_NQN: &str = "nqn.2026-11.io.nvpool:init-third";
pub const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-1111-4000-8000-00000000000a";
pub const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-1111-4000-8000-00000000000b";

/// A RAM namespace of 16 MiB in 512-byte blocks.
pub const RAM_SPEC: &str = "ram:16M";
pub const RAM_BLOCKS: u64 = (16 << 20) / 512;

/// Longest any single synchronous helper waits before the test fails.
pub const WAIT: Duration = Duration::from_secs(15);

/// Sets the stop flag when a test assertion unwinds, so writer threads end.
pub struct StopOnDrop<'a>(pub &'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }
}

// What the suites of every crate share (nvpool-testkit), under the names
// these tests use; each test binary uses some of them.
#[allow(unused_imports)]
pub use nvpool_testkit::target::subsystem;
#[allow(unused_imports)]
pub use nvpool_testkit::{file_spec, pattern, wait_for};

/// An nvpool-target running inside the test process.
#[derive(Debug)]
pub struct Tgt {
    serving: Serving,
    pub target: Arc<Target>,
    /// The one NVMe/TCP listener (it also serves discovery).
    pub addr: SocketAddr,
}

impl Tgt {
    /// A target without a state directory on 127.0.0.1, port 0.
    pub fn start(subsystems: &[SubsystemConfig]) -> Tgt {
        Tgt::start_on(Target::new(None).expect("target"), LOOPBACK, subsystems)
    }

    /// Starts `target` on `addr` after adding `subsystems`. Binding an
    /// address a previous target just left is retried for a while.
    pub fn start_on(target: Arc<Target>, addr: SocketAddr, subsystems: &[SubsystemConfig]) -> Tgt {
        for s in subsystems {
            target.put_subsystem(s).expect("put_subsystem");
        }
        let opts = StartOptions {
            listeners: vec![addr],
            ..loopback()
        };
        let serving = start(&target, &opts);
        Tgt {
            addr: serving.addr,
            target,
            serving,
        }
    }

    /// Stops the target: drains in-flight commands and flushes backends.
    pub fn stop(mut self) {
        self.serving.stop();
    }
}

/// Namespace 1 of `subnqn` on `t` as a [`nvpool_initiator::Device`] over
/// `queues` I/O queues `depth` deep (any host may connect).
pub fn open_device(t: &Tgt, subnqn: &str, queues: u16, depth: u16) -> nvpool_initiator::Device {
    let mut p = ConnectParams::new(t.addr, subnqn);
    p.io_queues = queues;
    p.queue_depth = depth;
    let c = nvpool_initiator::Controller::connect(p).expect("connect");
    nvpool_initiator::Device::open(c, 1, queues).expect("open namespace 1")
}

/// Connect parameters for tests: a fixed host identity, two 32-deep I/O
/// queues, quick reconnects and a controller-loss timeout of seconds.
pub fn params(addr: SocketAddr, subnqn: &str, hostnqn: &str) -> ConnectParams {
    let mut p = ConnectParams::new(addr, subnqn);
    p.hostnqn = hostnqn.to_owned();
    p.hostid = nvpool_initiator::hostnqn::parse_uuid(
        hostnqn.rsplit_once(":uuid:").expect("uuid host NQN").1,
    )
    .expect("host NQN carries a UUID");
    p.io_queues = 2;
    p.queue_depth = 32;
    p.kato = Duration::from_secs(5);
    p.reconnect_delay = Duration::from_millis(100);
    p.ctrl_loss_timeout = Duration::from_secs(5);
    p.connect_timeout = Duration::from_secs(2);
    p
}

/// A zero-filled sparse file of `size` bytes on the build disk.
pub fn scratch_file(size: u64) -> (tempfile::TempDir, PathBuf) {
    nvpool_testkit::scratch_file(env!("CARGO_TARGET_TMPDIR"), size)
}

/// Same status code, ignoring DNR, CRD and More.
pub fn same_code(a: nvpool_wire::Status, b: nvpool_wire::Status) -> bool {
    a.sct == b.sct && a.sc == b.sc
}

pub fn req(op: Op, lba: u64, blocks: u32, buf: Vec<u8>, token: u64) -> Request {
    Request {
        op,
        nsid: 1,
        lba,
        blocks,
        fua: false,
        buf,
        shared: None,
        token,
    }
}

/// Submits every request (they must fit the queue) and polls until all
/// have completed. Completions come back sorted by token.
#[track_caller]
pub fn exec(q: &mut IoQueue, reqs: Vec<Request>) -> Vec<Completion> {
    let n = reqs.len();
    for r in reqs {
        if let Err((r, e)) = q.submit(r) {
            panic!("submit of {:?} at LBA {} refused: {e}", r.op, r.lba);
        }
    }
    let mut out = Vec::with_capacity(n);
    let deadline = Instant::now() + WAIT;
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} commands still outstanding after {WAIT:?}",
            n - out.len()
        );
        if let Err(e) = q.poll(&mut out, Duration::from_millis(200)) {
            panic!("poll failed: {e}");
        }
    }
    assert_eq!(q.outstanding(), 0, "nothing left outstanding");
    out.sort_by_key(|c| c.token);
    out
}

/// One request, synchronously.
#[track_caller]
pub fn exec1(q: &mut IoQueue, r: Request) -> Completion {
    exec(q, vec![r]).pop().expect("one completion")
}

#[track_caller]
pub fn write(q: &mut IoQueue, lba: u64, data: &[u8], bs: u32) -> Result<(), IoError> {
    let blocks = (data.len() / bs as usize) as u32;
    exec1(q, req(Op::Write, lba, blocks, data.to_vec(), 0)).result
}

#[track_caller]
pub fn read(q: &mut IoQueue, lba: u64, len: usize, bs: u32) -> Result<Vec<u8>, IoError> {
    let blocks = (len / bs as usize) as u32;
    let c = exec1(q, req(Op::Read, lba, blocks, vec![0u8; len], 0));
    c.result.map(|()| c.buf)
}

/// Asserts two buffers are equal, naming the first differing byte instead
/// of dumping kilobytes.
#[track_caller]
pub fn assert_same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i} (got {:#04x}, want {:#04x})",
            got[i], want[i]
        );
    }
}
