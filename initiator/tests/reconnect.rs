//! Losing the target under load.
//!
//! A restart on the same address must be invisible to the caller: the
//! queues reconnect, reissue what had not completed, no error surfaces, no
//! read ever returns wrong data, and every acknowledged write is on disk.
//! A target that never comes back must fail every outstanding I/O with
//! `ControllerLost` after the controller-loss timeout: no hang, no panic.

mod common;

use common::*;
use nvpool_initiator::{Completion, Controller, Error, IoError, IoQueue, Op};
use nvpool_target::Target;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const FILE_BYTES: u64 = 32 << 20;
const BS: u32 = 512;
/// Units each slot cycles through (write, read back, next unit).
const UNITS_PER_SLOT: u64 = 4;
/// Bytes each slot owns: UNITS_PER_SLOT units of the largest size.
const SLOT_BYTES: u64 = UNITS_PER_SLOT * (128 << 10);
/// Transfer size of slot `i`: in-capsule and R2T writes, small and MDTS reads.
const SIZES: [usize; 4] = [4096, 16 << 10, 64 << 10, 128 << 10];

/// What one writer thread saw.
#[derive(Debug, Default)]
struct Outcome {
    completed: u64,
    io_errors: Vec<String>,
    wrong_data: Vec<String>,
    poll_error: Option<String>,
    /// (LBA, length, seed) of the last acknowledged write of every unit.
    acked: Vec<(u64, usize, u64)>,
}

/// One slot's place in its write → read-back cycle.
#[derive(Debug, Clone, Copy)]
struct Slot {
    base_lba: u64,
    len: usize,
    unit: u64,
    version: u64,
    reading: bool,
    /// Seed of the last acknowledged write, per unit.
    acked: [Option<u64>; UNITS_PER_SLOT as usize],
}

impl Slot {
    fn lba(&self) -> u64 {
        self.base_lba + self.unit * (128 << 10) / BS as u64
    }
}

fn seed(qid: u16, slot: usize, unit: u64, version: u64) -> u64 {
    (qid as u64) << 56 | (slot as u64) << 40 | unit << 32 | version
}

/// Keeps every slot of `q` busy with verified writes and reads until
/// `stop`, then drains. Counts completions into `progress`.
fn writer(mut q: IoQueue, stop: &AtomicBool, progress: &AtomicU64) -> Outcome {
    let qid = q.qid();
    let depth = q.depth();
    let mut out = Outcome::default();
    let first = (qid as u64 - 1) * depth as u64 * SLOT_BYTES;
    let mut slots: Vec<Slot> = (0..depth)
        .map(|i| Slot {
            base_lba: (first + i as u64 * SLOT_BYTES) / BS as u64,
            len: SIZES[i % SIZES.len()],
            unit: 0,
            version: 1,
            reading: false,
            acked: [None; UNITS_PER_SLOT as usize],
        })
        .collect();
    let submit = |q: &mut IoQueue, i: usize, s: &Slot| {
        let blocks = (s.len / BS as usize) as u32;
        let r = if s.reading {
            req(Op::Read, s.lba(), blocks, vec![0u8; s.len], i as u64)
        } else {
            let data = pattern(seed(qid, i, s.unit, s.version), s.len);
            req(Op::Write, s.lba(), blocks, data, i as u64)
        };
        q.submit(r).map_err(|(_, e)| e)
    };
    for (i, s) in slots.iter().enumerate() {
        submit(&mut q, i, s).expect("initial submit");
    }
    let mut comps: Vec<Completion> = Vec::with_capacity(depth);
    let mut drain_by: Option<Instant> = None;
    loop {
        let stopping = stop.load(Ordering::Acquire);
        if stopping {
            let by = *drain_by.get_or_insert(Instant::now() + WAIT);
            if q.outstanding() == 0 {
                break;
            }
            if Instant::now() > by {
                out.poll_error = Some(format!("{} I/Os never completed", q.outstanding()));
                break;
            }
        }
        comps.clear();
        if let Err(e) = q.poll(&mut comps, Duration::from_millis(100)) {
            out.poll_error = Some(format!("poll: {e}"));
            break;
        }
        for c in comps.drain(..) {
            let i = c.token as usize;
            out.completed += 1;
            progress.fetch_add(1, Ordering::Relaxed);
            let s = &mut slots[i];
            let what = format!(
                "queue {qid} slot {i} unit {} v{} {}",
                s.unit,
                s.version,
                if s.reading { "read" } else { "write" }
            );
            if let Err(e) = c.result {
                out.io_errors.push(format!("{what}: {e}"));
                continue;
            }
            if s.reading {
                let want = s.acked[s.unit as usize].expect("read after an acked write");
                if c.buf != pattern(want, s.len) {
                    out.wrong_data.push(what.clone());
                }
                s.reading = false;
                s.unit = (s.unit + 1) % UNITS_PER_SLOT;
                s.version += 1;
            } else {
                s.acked[s.unit as usize] = Some(seed(qid, i, s.unit, s.version));
                s.reading = true;
            }
            if !stopping {
                let s = *s;
                if let Err(e) = submit(&mut q, i, &s) {
                    out.io_errors.push(format!("{what}: resubmit refused: {e}"));
                }
            }
        }
    }
    for s in &slots {
        for u in 0..UNITS_PER_SLOT {
            if let Some(sd) = s.acked[u as usize] {
                let lba = s.base_lba + u * (128 << 10) / BS as u64;
                out.acked.push((lba, s.len, sd));
            }
        }
    }
    out
}

/// Checks the file holds every acknowledged write.
fn check_file(path: &Path, acked: &[(u64, usize, u64)]) {
    let disk = std::fs::read(path).expect("read the backing file");
    for &(lba, len, sd) in acked {
        let off = lba as usize * BS as usize;
        assert_same(
            &disk[off..off + len],
            &pattern(sd, len),
            &format!("acknowledged write of {len} B at LBA {lba} (seed {sd:#x}) in the file"),
        );
    }
}

#[test]
fn target_restart_during_io_is_invisible() {
    let (dir, path) = scratch_file(FILE_BYTES);
    let state = dir.path().join("state");
    let subs = [subsystem(SUBNQN, &[HOST_A], &[(1, &file_spec(&path))])];
    let t1 = Tgt::start_on(
        Target::new(Some(state.clone())).expect("target 1"),
        "127.0.0.1:0".parse().expect("addr"),
        &subs,
    );
    let addr = t1.addr;
    let mut p = params(addr, SUBNQN, HOST_A);
    p.kato = Duration::from_secs(2);
    p.ctrl_loss_timeout = Duration::from_secs(10);
    let c = Controller::connect(p).expect("connect");
    let ns = c.namespace(1).expect("namespace");
    assert_eq!(ns.block_size, BS);
    assert_eq!(ns.size_bytes(), FILE_BYTES);
    let uuid = ns.uuid.expect("uuid");
    let queues: Vec<IoQueue> = (1..=c.io_queue_count())
        .map(|qid| {
            let mut q = c.io_queue(qid).expect("queue");
            q.set_block_size(BS);
            q
        })
        .collect();
    assert_eq!(queues.len(), 2);
    assert!(2 * queues[0].depth() as u64 * SLOT_BYTES <= FILE_BYTES);

    let stop = AtomicBool::new(false);
    let progress = AtomicU64::new(0);
    let outcomes = std::thread::scope(|sc| {
        let (stop, progress) = (&stop, &progress);
        let hs: Vec<_> = queues
            .into_iter()
            .map(|q| sc.spawn(move || writer(q, stop, progress)))
            .collect();
        let stop_guard = StopOnDrop(stop);

        wait_for("I/O before the restart", WAIT, || {
            progress.load(Ordering::Relaxed) >= 300
        });
        let t = Instant::now();
        t1.stop();
        let before = progress.load(Ordering::Relaxed);
        eprintln!(
            "target 1 stopped in {:?} after {before} completions",
            t.elapsed()
        );
        std::thread::sleep(Duration::from_millis(300));
        let during = progress.load(Ordering::Relaxed);
        let t2 = Tgt::start_on(
            Target::new(Some(state.clone())).expect("target 2"),
            addr,
            &subs,
        );
        assert_eq!(t2.addr, addr, "restarted on the same address");
        wait_for("I/O after the restart", WAIT, || {
            progress.load(Ordering::Relaxed) >= during + 1000
        });
        assert!(
            t2.target
                .controllers()
                .iter()
                .any(|x| x.hostnqn == HOST_A && x.subsys_nqn == SUBNQN),
            "the initiator reconnected to target 2"
        );
        drop(stop_guard);
        let outcomes: Vec<Outcome> = hs
            .into_iter()
            .map(|h| h.join().expect("writer does not panic"))
            .collect();
        // The controller reconnected transparently for admin commands too,
        // and the namespace kept its identity (same state directory).
        assert_eq!(
            c.namespace(1).expect("namespace after restart").uuid,
            Some(uuid)
        );
        t2.stop();
        outcomes
    });

    for o in &outcomes {
        assert!(o.poll_error.is_none(), "poll failed: {:?}", o.poll_error);
        assert!(
            o.io_errors.is_empty(),
            "I/O errors reached the caller: {:?}",
            o.io_errors
        );
        assert!(
            o.wrong_data.is_empty(),
            "reads returned wrong data: {:?}",
            o.wrong_data
        );
        assert!(o.completed > 0);
    }
    let acked: Vec<_> = outcomes
        .iter()
        .flat_map(|o| o.acked.iter().copied())
        .collect();
    assert!(acked.len() > 100, "{} units acknowledged", acked.len());
    check_file(&path, &acked);
}

#[test]
fn target_gone_for_good_fails_io_with_controller_lost() {
    let t = Tgt::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let loss = Duration::from_millis(1500);
    let mut p = params(t.addr, SUBNQN, HOST_A);
    p.ctrl_loss_timeout = loss;
    let c = Controller::connect(p).expect("connect");
    let mut q1 = c.io_queue(1).expect("queue 1");
    let mut q2 = c.io_queue(2).expect("queue 2");
    q1.set_block_size(512);
    q2.set_block_size(512);
    write(&mut q1, 0, &pattern(1, 4096), 512).expect("write while up");

    t.stop();

    // A full queue of reads and a few writes, submitted to a dead target.
    let depth = q1.depth();
    for i in 0..depth {
        q1.submit(req(Op::Read, i as u64 * 8, 8, vec![0; 4096], i as u64))
            .map_err(|(_, e)| e)
            .expect("submit queues locally");
    }
    for i in 0..4u64 {
        q2.submit(req(Op::Write, i * 256, 256, pattern(i, 128 << 10), i))
            .map_err(|(_, e)| e)
            .expect("submit queues locally");
    }
    let start = Instant::now();
    let mut got = Vec::new();
    let err = loop {
        assert!(
            start.elapsed() < loss + Duration::from_secs(10),
            "queue 1 still waiting {:?} after the target died",
            start.elapsed()
        );
        match q1.poll(&mut got, Duration::from_millis(200)) {
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    let took = start.elapsed();
    eprintln!("queue 1 gave up after {took:?}: {err}");
    assert!(matches!(err, Error::ControllerLost { .. }), "{err:?}");
    assert!(
        took >= loss - Duration::from_millis(200),
        "gave up after {took:?}, before the {loss:?} controller-loss timeout"
    );
    assert_eq!(got.len(), depth, "every outstanding I/O completed");
    let mut tokens: Vec<u64> = got.iter().map(|c| c.token).collect();
    tokens.sort_unstable();
    assert_eq!(tokens, (0..depth as u64).collect::<Vec<_>>());
    for c in &got {
        assert_eq!(c.result, Err(IoError::ControllerLost), "token {}", c.token);
        assert_eq!(c.buf.len(), 4096, "buffer handed back");
    }
    assert_eq!(q1.outstanding(), 0);

    // Further submits fail at once, the request handed back.
    let (back, e) = q1
        .submit(req(Op::Read, 0, 1, vec![0; 512], 77))
        .expect_err("controller lost");
    assert_eq!(back.token, 77);
    assert!(matches!(e, Error::ControllerLost { .. }), "{e:?}");

    // The other queue learns it without waiting another timeout.
    let t2 = Instant::now();
    let mut got2 = Vec::new();
    let e2 = loop {
        assert!(t2.elapsed() < Duration::from_secs(5), "queue 2 hangs");
        match q2.poll(&mut got2, Duration::from_millis(200)) {
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    assert!(matches!(e2, Error::ControllerLost { .. }), "{e2:?}");
    assert!(t2.elapsed() < loss, "queue 2 took {:?}", t2.elapsed());
    assert_eq!(got2.len(), 4);
    assert!(got2
        .iter()
        .all(|c| c.result == Err(IoError::ControllerLost)));
    assert!(q2.submit(req(Op::Flush, 0, 0, Vec::new(), 0)).is_err());

    // Admin commands fail too, and dropping everything returns promptly.
    assert!(matches!(c.namespace(1), Err(Error::ControllerLost { .. })));
    let t3 = Instant::now();
    drop(q1);
    drop(q2);
    drop(c);
    assert!(
        t3.elapsed() < Duration::from_secs(3),
        "drop took {:?}",
        t3.elapsed()
    );
}

/// An idle controller whose target vanishes: the keep-alive thread notices,
/// gives up after the loss timeout, and a later submit fails instead of
/// waiting for a target that is not coming back.
#[test]
fn idle_queue_after_controller_lost_fails_fast() {
    let t = Tgt::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let mut p = params(t.addr, SUBNQN, HOST_A);
    p.kato = Duration::from_millis(400);
    p.ctrl_loss_timeout = Duration::from_millis(600);
    let c = Controller::connect(p).expect("connect");
    let mut q = c.io_queue(1).expect("queue");
    q.set_block_size(512);
    t.stop();
    // Let the keep-alive thread find the target gone and give up.
    wait_for("the controller to be declared lost", WAIT, || {
        matches!(c.namespace(1), Err(Error::ControllerLost { .. }))
    });
    let start = Instant::now();
    q.submit(req(Op::Read, 0, 1, vec![0; 512], 1))
        .map_err(|(_, e)| e)
        .expect("queued locally");
    let mut got = Vec::new();
    let e = loop {
        assert!(start.elapsed() < Duration::from_secs(5), "poll hangs");
        match q.poll(&mut got, Duration::from_millis(100)) {
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    assert!(matches!(e, Error::ControllerLost { .. }), "{e:?}");
    assert!(
        start.elapsed() < Duration::from_millis(500),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].result, Err(IoError::ControllerLost));
}

/// Shutting a controller down while its keep-alive thread is busy
/// reconnecting to a vanished target must not wait out the whole
/// controller-loss timeout (60 s by default): `Controller::shutdown` joins
/// the keep-alive thread, whose retry loop in `Controller::reconnect` holds
/// the state lock and never looks at the shutdown flag after it starts.
#[test]
fn shutting_down_a_controller_while_it_reconnects_is_prompt() {
    let t = Tgt::start(&[subsystem(SUBNQN, &[], &[(1, RAM_SPEC)])]);
    let mut p = params(t.addr, SUBNQN, HOST_A);
    p.kato = Duration::from_millis(400);
    p.ctrl_loss_timeout = Duration::from_secs(8);
    let c = Controller::connect(p).expect("connect");
    t.stop();
    // The keep-alive thread (every 200 ms) finds the target gone and starts
    // reconnecting.
    std::thread::sleep(Duration::from_millis(600));
    let start = Instant::now();
    c.shutdown();
    let took = start.elapsed();
    assert!(took < Duration::from_secs(2), "shutdown took {took:?}");
}
