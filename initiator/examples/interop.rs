//! Interoperability check of the userspace initiator against a real NVMe/TCP
//! or NVMe/RDMA target, written for the Linux kernel's nvmet-tcp and
//! nvmet-rdma (`scripts/vm/guest/initiator-vs-kernel.sh` and
//! `initiator-vs-kernel-rdma.sh` run it in a QEMU guest).
//!
//! ```text
//! cargo build --release -p nvpool-initiator --example interop
//! interop --addr 127.0.0.1:4420 --nqn NQN [--transport tcp|rdma] [--hostnqn H]
//!         [--nsid 1] [--digests] [--idle SECS] [--expect-blip] [--expect-loss]
//!         [--timeout SECS]
//! ```
//!
//! Prints one line per step, `STEP <name> ok (<secs>s) <details>`, or
//! `FAIL <name>: <reason>` and exits 1. Blocks it writes carry their LBA and a
//! per-run seed, so a misdirected or stale block is named in the failure.
//! The last normal step writes marker blocks and prints
//! `MARK <byte offset> <text>` for each, so the caller can check them on the
//! target's backing device (a round trip through the same addressing code
//! cannot catch an LBA bug that reads and writes share).
//!
//! `--idle SECS` adds a step that sends nothing but keep-alives for that long.
//! With `--expect-blip` it prints `READY-FOR-BLIP` and runs verified I/O on
//! both queues for 10 s while the caller takes the subsystem off the port and
//! puts it back: every command must succeed (reconnect and reissue) and the
//! completions must show the outage as a stall.
//! With `--expect-loss` it then prints `READY-FOR-REMOVAL`, keeps I/O going
//! while the caller removes the subsystem from the target's port, and checks
//! that the outstanding and the next I/Os fail with "controller lost" within
//! the controller-loss timeout (no hang, no panic).

use nvpool_initiator::{
    Completion, ConnectParams, Controller, Error, IoError, IoQueue, NamespaceInfo, Op, Request,
    Transport,
};
use nvpool_rt::random::Rng;
use nvpool_wire::tcp::Digests;
use std::error::Error as StdError;
use std::io::Write as _;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Transfer sizes of the pattern step (each skipped if the namespace's block
/// size does not divide it or the controller cannot move it in one command).
/// 16 KiB is the Linux target's default in-capsule limit; 16.5 KiB is just
/// past it (R2T), 3.5 KiB is not a power of two.
const PATTERN_SIZES: [usize; 8] = [
    512,
    3584,
    4 << 10,
    16 << 10,
    16896,
    64 << 10,
    128 << 10,
    1 << 20,
];
/// A synchronous command waits this long for its completion.
const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// Deep-queue phase: each command stays inside one unit of this size.
const DEEP_UNIT_BYTES: u64 = 128 << 10;
/// Deep-queue phase with maximal transfers: commands in flight per queue.
const DEEP_MAX_DEPTH: usize = 16;
/// Controller-loss settings for the loss phase (the Linux host's defaults
/// are 600 s and 10 s; short ones keep the test short).
const CTRL_LOSS_TIMEOUT: Duration = Duration::from_secs(5);
const RECONNECT_DELAY: Duration = Duration::from_millis(500);
/// Loss phase: the removal must show within this long of READY-FOR-REMOVAL.
const LOSS_WAIT: Duration = Duration::from_secs(90);
/// Loss phase: commands kept in flight while waiting for the removal.
const LOSS_DEPTH: usize = 8;
/// Slack on top of the controller-loss timeout before "lost" counts as late
/// (a reconnect attempt may take a while under emulation).
const LOSS_SLACK: Duration = Duration::from_secs(10);
/// Blip phase: how long I/O runs after READY-FOR-BLIP (the caller takes the
/// subsystem off the port and puts it back within this, well inside the
/// controller-loss timeout), and the commands in flight per queue.
const BLIP_WINDOW: Duration = Duration::from_secs(10);
const BLIP_DEPTH: usize = 16;
/// Blip phase: the outage counts as seen when completions stalled this long.
const BLIP_MIN_STALL: Duration = Duration::from_millis(1000);

type Res<T> = Result<T, String>;

#[derive(Debug)]
struct Args {
    addr: SocketAddr,
    transport: Transport,
    nqn: String,
    hostnqn: Option<String>,
    nsid: u32,
    digests: bool,
    expect_loss: bool,
    expect_blip: bool,
    idle: Duration,
    timeout: Duration,
}

const USAGE: &str = "usage: interop --addr IP:PORT --nqn NQN [--transport tcp|rdma] \
                     [--hostnqn NQN] [--nsid N] \
                     [--digests] [--idle SECS] [--expect-blip] [--expect-loss] \
                     [--timeout SECS]";

fn parse_args() -> Res<Args> {
    let mut addr = None;
    let mut transport = Transport::Tcp;
    let mut nqn = None;
    let mut hostnqn = None;
    let mut nsid = 1u32;
    let mut digests = false;
    let mut expect_loss = false;
    let mut expect_blip = false;
    let mut idle = Duration::ZERO;
    let mut timeout = Duration::from_secs(600);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--addr" => {
                let v = value()?;
                addr = Some(v.parse().map_err(|e| format!("--addr {v}: {e}"))?);
            }
            "--nqn" => nqn = Some(value()?),
            "--transport" => {
                transport = match value()?.as_str() {
                    "tcp" => Transport::Tcp,
                    "rdma" => Transport::Rdma,
                    v => return Err(format!("--transport {v}: tcp or rdma")),
                }
            }
            "--hostnqn" => hostnqn = Some(value()?),
            "--nsid" => {
                let v = value()?;
                nsid = v.parse().map_err(|e| format!("--nsid {v}: {e}"))?;
            }
            "--timeout" => {
                let v = value()?;
                timeout =
                    Duration::from_secs(v.parse().map_err(|e| format!("--timeout {v}: {e}"))?);
            }
            "--idle" => {
                let v = value()?;
                idle = Duration::from_secs(v.parse().map_err(|e| format!("--idle {v}: {e}"))?);
            }
            "--digests" => digests = true,
            "--expect-blip" => expect_blip = true,
            "--expect-loss" => expect_loss = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ => return Err(format!("unknown argument {a}")),
        }
    }
    if digests && transport == Transport::Rdma {
        return Err("--digests is NVMe/TCP only".into());
    }
    Ok(Args {
        addr: addr.ok_or("--addr is required")?,
        transport,
        nqn: nqn.ok_or("--nqn is required")?,
        hostnqn,
        nsid,
        digests,
        expect_loss,
        expect_blip,
        idle,
        timeout,
    })
}

/// The step running now, for the watchdog's message.
static CURRENT_STEP: Mutex<String> = Mutex::new(String::new());

fn print_line(s: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{s}");
    let _ = out.flush();
}

#[derive(Debug)]
struct Failed {
    step: String,
    why: String,
}

/// Runs one step: prints `STEP name ok (secs) details` or returns the failure.
fn step<T>(name: &str, f: impl FnOnce() -> Res<(T, String)>) -> Result<T, Failed> {
    *CURRENT_STEP.lock().unwrap_or_else(|p| p.into_inner()) = name.to_owned();
    let t0 = Instant::now();
    match f() {
        Ok((v, details)) => {
            print_line(&format!(
                "STEP {name} ok ({:.2}s) {details}",
                t0.elapsed().as_secs_f64()
            ));
            Ok(v)
        }
        Err(why) => Err(Failed {
            step: name.to_owned(),
            why,
        }),
    }
}

/// Exits the process if the program is still running after `limit`: a hang
/// inside the library must show up as a failure, not as a stuck guest.
fn start_watchdog(limit: Duration, done: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        let until = Instant::now() + limit;
        while Instant::now() < until {
            if done.load(Ordering::Acquire) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let s = CURRENT_STEP
            .lock()
            .map(|s| s.clone())
            .unwrap_or_else(|p| p.into_inner().clone());
        print_line(&format!(
            "FAIL {s}: watchdog: still running after {} s (hung?)",
            limit.as_secs()
        ));
        std::process::exit(1);
    });
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("interop: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let done = Arc::new(AtomicBool::new(false));
    start_watchdog(args.timeout, done.clone());
    let r = run(&args);
    done.store(true, Ordering::Release);
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            print_line(&format!("FAIL {}: {}", f.step, f.why));
            ExitCode::from(1)
        }
    }
}

/// The data this run writes at `lba`: per block, the LBA, the run seed and
/// a fill derived from both.
fn pattern(seed: u64, lba: u64, blocks: u32, bs: usize) -> Vec<u8> {
    let mut buf = vec![0u8; blocks as usize * bs];
    for (i, blk) in buf.chunks_mut(bs).enumerate() {
        let l = lba + i as u64;
        nvpool_testkit::fill(seed ^ l.wrapping_mul(0x9E37_79B9_7F4A_7C15), blk);
        blk[0..8].copy_from_slice(&l.to_le_bytes());
        blk[8..16].copy_from_slice(&seed.to_le_bytes());
    }
    buf
}

/// Compares a read against what was expected; on a mismatch names the first
/// bad block and what it holds (another LBA's block, an older run's, zeroes).
fn compare(expect: &[u8], got: &[u8], lba: u64, bs: usize, seed: u64) -> Res<()> {
    if got.len() < expect.len() {
        return Err(format!(
            "read returned {} bytes, expected {}",
            got.len(),
            expect.len()
        ));
    }
    let Some(i) = expect.iter().zip(got).position(|(a, b)| a != b) else {
        return Ok(());
    };
    let blk = i / bs;
    let b = &got[blk * bs..(blk + 1) * bs];
    let tag = u64::from_le_bytes(b[0..8].try_into().expect("8 bytes"));
    let tseed = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
    let what = if b.iter().all(|&x| x == 0) {
        "all zeroes".to_owned()
    } else if tseed == seed {
        format!("this run's block for LBA {tag}")
    } else {
        format!("a block tagged LBA {tag} seed {tseed:#x} (this run: {seed:#x})")
    };
    Err(format!(
        "data mismatch at byte {i} of the transfer (LBA {}, offset {} in the block): block holds {what}",
        lba + blk as u64,
        i % bs
    ))
}

fn request(op: Op, nsid: u32, lba: u64, blocks: u32, buf: Vec<u8>) -> Request {
    Request {
        op,
        nsid,
        lba,
        blocks,
        fua: false,
        buf,
        shared: None,
        token: 0,
    }
}

fn describe(r: &Request) -> String {
    format!("{:?} LBA {} x{} (nsid {})", r.op, r.lba, r.blocks, r.nsid)
}

/// Submits one command and waits for its completion (the queue must have
/// nothing else outstanding).
fn exec(q: &mut IoQueue, req: Request) -> Res<Completion> {
    let what = describe(&req);
    q.submit(req)
        .map_err(|(_, e)| format!("{what}: submit: {e}"))?;
    let deadline = Instant::now() + IO_TIMEOUT;
    let mut out = Vec::with_capacity(1);
    loop {
        if let Err(e) = q.poll(&mut out, Duration::from_millis(500)) {
            return Err(format!("{what}: poll: {e}"));
        }
        if let Some(c) = out.pop() {
            return Ok(c);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{what}: no completion within {} s",
                IO_TIMEOUT.as_secs()
            ));
        }
    }
}

/// `exec` that also requires success.
fn exec_ok(q: &mut IoQueue, req: Request) -> Res<Vec<u8>> {
    let what = describe(&req);
    let c = exec(q, req)?;
    c.result.map_err(|e| format!("{what}: {e}"))?;
    Ok(c.buf)
}

fn write_pattern(q: &mut IoQueue, ns: &NamespaceInfo, seed: u64, lba: u64, blocks: u32) -> Res<()> {
    let bs = ns.block_size as usize;
    let buf = pattern(seed, lba, blocks, bs);
    exec_ok(q, request(Op::Write, ns.nsid, lba, blocks, buf)).map(|_| ())
}

fn read(q: &mut IoQueue, ns: &NamespaceInfo, lba: u64, blocks: u32) -> Res<Vec<u8>> {
    let n = blocks as usize * ns.block_size as usize;
    // Poisoned, so a read that moves no data cannot pass for zeroes.
    exec_ok(q, request(Op::Read, ns.nsid, lba, blocks, vec![0xA5; n]))
}

fn verify_pattern(
    q: &mut IoQueue,
    ns: &NamespaceInfo,
    seed: u64,
    lba: u64,
    blocks: u32,
) -> Res<()> {
    let bs = ns.block_size as usize;
    let got = read(q, ns, lba, blocks)?;
    compare(&pattern(seed, lba, blocks, bs), &got, lba, bs, seed)
        .map_err(|e| format!("read-back of LBA {lba} x{blocks}: {e}"))
}

fn expect_zeroes(q: &mut IoQueue, ns: &NamespaceInfo, lba: u64, blocks: u32) -> Res<()> {
    let got = read(q, ns, lba, blocks)?;
    match got.iter().position(|&b| b != 0) {
        None => Ok(()),
        Some(i) => Err(format!(
            "LBA {lba} x{blocks}: byte {i} (LBA {}) is {:#04x}, expected zeroes",
            lba + (i / ns.block_size as usize) as u64,
            got[i]
        )),
    }
}

fn status_of(c: &Completion) -> Res<String> {
    match &c.result {
        Err(IoError::Status(s)) => Ok(format!("sct {:#x} sc {:#04x} dnr {}", s.sct, s.sc, s.dnr)),
        Err(e) => Err(format!("failed without a status: {e}")),
        Ok(()) => Err("succeeded".into()),
    }
}

fn run(a: &Args) -> Result<(), Failed> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ (std::process::id() as u64) << 32;
    let digests = Digests {
        header: a.digests,
        data: a.digests,
    };

    let ctrl = step("connect", || {
        let mut p = ConnectParams::new(a.addr, &a.nqn);
        p.transport = a.transport;
        if let Some(h) = &a.hostnqn {
            p.hostid = h
                .rsplit_once(":uuid:")
                .and_then(|(_, u)| nvpool_initiator::hostnqn::parse_uuid(u))
                .unwrap_or(p.hostid);
            p.hostnqn = h.clone();
        }
        p.digests = digests;
        p.io_queues = 2;
        p.ctrl_loss_timeout = CTRL_LOSS_TIMEOUT;
        p.reconnect_delay = RECONNECT_DELAY;
        let c = Controller::connect(p).map_err(|e| format!("{e}: {}", chain(&e)))?;
        let id = &c.identify;
        let d = format!(
            "cntlid {} mdts {} nn {} maxcmd {} mqes {} ioccsz {} (in-capsule {} B) \
             max-transfer {} B io-queues {} transport {} digests {} model '{}' fw '{}'",
            id.cntlid,
            id.mdts,
            id.nn,
            id.maxcmd,
            c.cap.mqes,
            id.ioccsz,
            c.inline_data_max(),
            c.max_transfer(),
            c.io_queue_count(),
            a.transport,
            if a.digests { "hdr+data" } else { "off" },
            id.model.trim(),
            id.firmware.trim(),
        );
        Ok((c, d))
    })?;

    let ns = step("namespace", || {
        let ns = ctrl
            .namespace(a.nsid)
            .map_err(|e| format!("identify namespace {}: {e}", a.nsid))?;
        if ns.size_bytes() < 4 * DEEP_UNIT_BYTES.max(2 << 20) {
            return Err(format!("namespace too small: {} bytes", ns.size_bytes()));
        }
        let d = format!(
            "nsid {} blocks {} block-size {} size {} MiB zeroes-on-deallocate {} uuid {}",
            ns.nsid,
            ns.blocks,
            ns.block_size,
            ns.size_bytes() >> 20,
            ns.zeroes_on_deallocate,
            ns.uuid
                .map_or("none".into(), |u| nvpool_initiator::hostnqn::format_uuid(
                    &u
                )),
        );
        Ok((ns, d))
    })?;
    let bs = ns.block_size as usize;

    let mut qs = step("io-queues", || {
        if ctrl.io_queue_count() < 2 {
            return Err(format!(
                "controller granted {} I/O queues, need 2",
                ctrl.io_queue_count()
            ));
        }
        let mut qs = Vec::new();
        for qid in 1..=2 {
            let mut q = ctrl
                .io_queue(qid)
                .map_err(|e| format!("connect I/O queue {qid}: {e}: {}", chain(&e)))?;
            q.set_block_size(ns.block_size);
            qs.push(q);
        }
        let d = format!("2 queues, depth {}", qs[0].depth());
        Ok((qs, d))
    })?;

    step("rw-patterns", || {
        let max = ctrl.max_transfer();
        let mut done = Vec::new();
        let mut skipped = Vec::new();
        let mut n = 0usize;
        for size in PATTERN_SIZES {
            if size % bs != 0 || size > max {
                skipped.push(size);
                continue;
            }
            let blocks = (size / bs) as u32;
            let last = ns.blocks - blocks as u64;
            for (pos, lba) in [("first", 0), ("middle", ns.blocks / 2), ("last", last)] {
                // Write on one queue, read on the other; FUA on the last LBAs.
                let (w, r) = if n.is_multiple_of(2) { (0, 1) } else { (1, 0) };
                n += 1;
                let mut req = request(
                    Op::Write,
                    ns.nsid,
                    lba,
                    blocks,
                    pattern(seed, lba, blocks, bs),
                );
                req.fua = pos == "last";
                exec_ok(&mut qs[w], req).map_err(|e| format!("{size} B at {pos}: {e}"))?;
                verify_pattern(&mut qs[r], &ns, seed, lba, blocks)
                    .map_err(|e| format!("{size} B at {pos}: {e}"))?;
            }
            done.push(size);
        }
        let d = format!(
            "sizes {:?} at first/middle/last LBAs verified{}",
            done,
            if skipped.is_empty() {
                String::new()
            } else {
                format!(", skipped {skipped:?}")
            }
        );
        Ok(((), d))
    })?;

    step("deep-queue", || {
        let spec = Deep {
            unit_bytes: DEEP_UNIT_BYTES,
            depth: 0,
            whole: false,
        };
        Ok(((), deep_both(&mut qs, &ns, seed, spec)?))
    })?;

    step("deep-queue-max", || {
        // Back-to-back maximal transfers: the kernel target answers each read
        // with one C2HData PDU as large as the transfer.
        let spec = Deep {
            unit_bytes: ctrl.max_transfer() as u64,
            depth: DEEP_MAX_DEPTH,
            whole: true,
        };
        Ok(((), deep_both(&mut qs, &ns, seed ^ 0x3A3A, spec)?))
    })?;

    step("flush", || {
        exec_ok(&mut qs[0], request(Op::Flush, ns.nsid, 0, 0, Vec::new()))?;
        exec_ok(&mut qs[1], request(Op::Flush, ns.nsid, 0, 0, Vec::new()))?;
        Ok(((), "both queues".into()))
    })?;

    step("write-zeroes", || {
        let q = &mut qs[0];
        // A small range, plain and with DEAC set (both must read zeroes).
        let lba = ns.blocks / 4 * 3 / 8 * 8;
        let blocks = ((64 << 10) / bs) as u32;
        for deallocate in [false, true] {
            write_pattern(q, &ns, seed, lba, blocks + 1)?;
            verify_pattern(q, &ns, seed, lba, blocks + 1)?;
            exec_ok(
                q,
                request(
                    Op::WriteZeroes { deallocate },
                    ns.nsid,
                    lba,
                    blocks,
                    Vec::new(),
                ),
            )?;
            expect_zeroes(q, &ns, lba, blocks)
                .map_err(|e| format!("after write zeroes (deac {deallocate}): {e}"))?;
            verify_pattern(q, &ns, seed, lba + blocks as u64, 1)
                .map_err(|e| format!("block after the zeroed range (deac {deallocate}): {e}"))?;
        }
        // The largest range one command covers (NLB 0xFFFF), if it fits.
        let big = 65536u32;
        let mut d = format!("{blocks} blocks (deac off, on)");
        let start = ns.blocks / 8;
        if start + big as u64 + 1 < ns.blocks / 4 * 3 {
            let end = start + big as u64;
            write_pattern(q, &ns, seed, start, 8)?;
            write_pattern(q, &ns, seed, end - 8, 9)?;
            exec_ok(
                q,
                request(
                    Op::WriteZeroes { deallocate: false },
                    ns.nsid,
                    start,
                    big,
                    Vec::new(),
                ),
            )?;
            expect_zeroes(q, &ns, start, 8).map_err(|e| format!("65536-block range, head: {e}"))?;
            expect_zeroes(q, &ns, end - 8, 8)
                .map_err(|e| format!("65536-block range, tail: {e}"))?;
            verify_pattern(q, &ns, seed, end, 1)
                .map_err(|e| format!("block after the 65536-block range: {e}"))?;
            d.push_str(&format!(
                ", {big} blocks ({} MiB)",
                (big as usize * bs) >> 20
            ));
        }
        Ok(((), d))
    })?;

    step("deallocate", || {
        let q = &mut qs[1];
        // Page-aligned, so a backend that frees whole pages frees all of it.
        let lba = (ns.blocks / 4 * 3 + 4096) / 8 * 8;
        let blocks = ((64 << 10) / bs) as u32;
        write_pattern(q, &ns, seed, lba, blocks + 1)?;
        verify_pattern(q, &ns, seed, lba, blocks + 1)?;
        exec_ok(q, request(Op::Deallocate, ns.nsid, lba, blocks, Vec::new()))?;
        let got = read(q, &ns, lba, blocks)?;
        let zero = got.iter().all(|&b| b == 0);
        let old = compare(&pattern(seed, lba, blocks, bs), &got, lba, bs, seed).is_ok();
        if ns.zeroes_on_deallocate && !zero {
            return Err(format!(
                "DLFEAT says deallocated blocks read as zeroes, but LBA {lba} x{blocks} reads {}",
                if old { "the old data" } else { "other data" }
            ));
        }
        verify_pattern(q, &ns, seed, lba + blocks as u64, 1)
            .map_err(|e| format!("block after the deallocated range: {e}"))?;
        let d = format!(
            "{blocks} blocks deallocated; reads back {} (zeroes {} by DLFEAT)",
            if zero {
                "zeroes"
            } else if old {
                "the old data"
            } else {
                "other data"
            },
            if ns.zeroes_on_deallocate {
                "promised"
            } else {
                "not promised"
            }
        );
        Ok(((), d))
    })?;

    step("read-past-end", || {
        let q = &mut qs[0];
        let n = bs;
        let past = exec(q, request(Op::Read, ns.nsid, ns.blocks, 1, vec![0; n]))?;
        let past = status_of(&past)
            .map_err(|e| format!("read of LBA {} (past the end) {e}", ns.blocks))?;
        let across = exec(
            q,
            request(Op::Read, ns.nsid, ns.blocks - 1, 2, vec![0; 2 * n]),
        )?;
        let across = status_of(&across).map_err(|e| {
            format!(
                "read of LBAs {}..={} (across the end) {e}",
                ns.blocks - 1,
                ns.blocks
            )
        })?;
        let bad_ns = exec(
            q,
            request(Op::Read, ns.nsid.wrapping_add(1000), 0, 1, vec![0; n]),
        )?;
        let bad_ns =
            status_of(&bad_ns).map_err(|e| format!("read from nsid {} {e}", ns.nsid + 1000))?;
        // The queue must still work after the errors.
        read(q, &ns, ns.blocks - 1, 1)
            .map_err(|e| format!("read of the last LBA after the errors: {e}"))?;
        Ok((
            (),
            format!("past end: {past}; across end: {across}; unknown nsid: {bad_ns}; queue still usable"),
        ))
    })?;

    if !a.idle.is_zero() {
        step("idle", || {
            // Nothing but keep-alives for longer than the KATO: the controller
            // and every queue must still be there (the caller checks the
            // target created no second controller).
            std::thread::sleep(a.idle);
            ctrl.namespace(ns.nsid)
                .map_err(|e| format!("admin command after idling: {e}"))?;
            for (i, q) in qs.iter_mut().enumerate() {
                let lba = ns.blocks / 3 + i as u64 * 64;
                write_pattern(q, &ns, seed, lba, 8)
                    .and_then(|()| verify_pattern(q, &ns, seed, lba, 8))
                    .map_err(|e| format!("queue {} after idling: {e}", q.qid()))?;
            }
            Ok((
                (),
                format!(
                    "{} s without I/O (KATO {} s), then admin and both queues work",
                    a.idle.as_secs(),
                    ctrl.params.kato.as_secs()
                ),
            ))
        })?;
    }

    step("marks", || {
        let mut lines = Vec::new();
        for lba in [0, ns.blocks / 2 + 1, ns.blocks - 1] {
            let text = format!("NVPOOL-INTEROP-{seed:016x}-LBA-{lba}");
            let mut buf = vec![0u8; bs];
            buf[..text.len()].copy_from_slice(text.as_bytes());
            exec_ok(&mut qs[0], request(Op::Write, ns.nsid, lba, 1, buf))?;
            lines.push(format!("MARK {} {text}", lba * bs as u64));
        }
        exec_ok(&mut qs[0], request(Op::Flush, ns.nsid, 0, 0, Vec::new()))?;
        for l in &lines {
            print_line(l);
        }
        Ok((
            (),
            format!("{} marker blocks written and flushed", lines.len()),
        ))
    })?;

    if a.expect_blip {
        step("blip", || blip(&mut qs, &ns, seed))?;
    }

    if a.expect_loss {
        step("loss", || loss(&ctrl, &mut qs, &ns, seed))?;
        drop(qs);
        drop(ctrl);
        return Ok(());
    }

    step("shutdown", || {
        drop(qs);
        ctrl.shutdown();
        Ok(((), "CC.SHN, connections closed".into()))
    })?;
    Ok(())
}

/// The chain of sources of an error, for messages.
fn chain(e: &Error) -> String {
    let mut parts = Vec::new();
    let mut s = StdError::source(e);
    while let Some(x) = s {
        parts.push(x.to_string());
        s = x.source();
    }
    if parts.is_empty() {
        "no further cause".into()
    } else {
        parts.join(": ")
    }
}

/// The shape of a deep-queue phase.
#[derive(Debug, Clone, Copy)]
struct Deep {
    /// Every command stays inside one unit of this size.
    unit_bytes: u64,
    /// Commands in flight at once; 0 for the queue's depth.
    depth: usize,
    /// Each command covers its whole unit (else a random piece of it).
    whole: bool,
}

/// Runs `deep_queue` on both queues at once, one thread each.
fn deep_both(qs: &mut [IoQueue], ns: &NamespaceInfo, seed: u64, spec: Deep) -> Res<String> {
    let stride = qs.len() as u64;
    let results: Vec<Res<String>> = std::thread::scope(|s| {
        let hs: Vec<_> = qs
            .iter_mut()
            .enumerate()
            .map(|(k, q)| {
                s.spawn(move || {
                    deep_queue(q, ns, seed, k as u64, stride, spec)
                        .map_err(|e| format!("queue {}: {e}", q.qid()))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into())))
            .collect()
    });
    let mut d = Vec::new();
    for r in results {
        d.push(r?);
    }
    Ok(d.join("; "))
}

/// Fills the queue (to its depth, or `spec.depth`) with verified writes at
/// random LBAs (unit `k` of every `stride` units, so queues do not overlap),
/// then reads them all back the same way.
fn deep_queue(
    q: &mut IoQueue,
    ns: &NamespaceInfo,
    seed: u64,
    k: u64,
    stride: u64,
    spec: Deep,
) -> Res<String> {
    let bs = ns.block_size as usize;
    let full = spec.depth == 0 || spec.depth >= q.depth();
    let depth = if full { q.depth() } else { spec.depth };
    let unit_blocks = (spec.unit_bytes / bs as u64) as u32;
    let units = ns.size_bytes() / spec.unit_bytes;
    let mut rng = Rng::new(seed ^ (k + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
    let mut chosen = std::collections::HashSet::new();
    let mut ios = Vec::with_capacity(depth);
    let mine = units / stride;
    if (mine as usize) < depth {
        return Err(format!("namespace too small for {depth} distinct units"));
    }
    while ios.len() < depth {
        let unit = rng.below(mine) * stride + k;
        if !chosen.insert(unit) {
            continue;
        }
        let blocks = if spec.whole {
            unit_blocks
        } else {
            1 + rng.below(unit_blocks as u64) as u32
        };
        let off = rng.below((unit_blocks - blocks + 1) as u64);
        ios.push((unit * unit_blocks as u64 + off, blocks));
    }
    let mut bytes = 0usize;
    for (phase, op) in [("write", Op::Write), ("read", Op::Read)] {
        for (i, &(lba, blocks)) in ios.iter().enumerate() {
            let buf = match op {
                Op::Write => pattern(seed, lba, blocks, bs),
                _ => vec![0xA5; blocks as usize * bs],
            };
            let mut req = request(op, ns.nsid, lba, blocks, buf);
            req.token = i as u64;
            q.submit(req).map_err(|(r, e)| {
                format!("{phase} submit {} of {depth}: {}: {e}", i + 1, describe(&r))
            })?;
        }
        if q.outstanding() != depth {
            return Err(format!(
                "{} outstanding after {depth} submits",
                q.outstanding()
            ));
        }
        // One more than the depth must be refused and handed back.
        if full {
            match q.submit(request(Op::Flush, ns.nsid, 0, 0, Vec::new())) {
                Err((r, _)) if r.op == Op::Flush => {}
                Err((_, e)) => {
                    return Err(format!("submit beyond the depth: wrong request back ({e})"))
                }
                Ok(()) => return Err(format!("submit beyond the depth {depth} accepted")),
            }
        }
        let deadline = Instant::now() + IO_TIMEOUT * 2;
        let mut out = Vec::with_capacity(depth);
        let mut seen = vec![false; depth];
        let mut left = depth;
        while left > 0 {
            out.clear();
            q.poll(&mut out, Duration::from_millis(500))
                .map_err(|e| format!("{phase} poll with {left} outstanding: {e}"))?;
            for c in out.drain(..) {
                let i = c.token as usize;
                let Some((lba, blocks)) = ios.get(i).copied() else {
                    return Err(format!("completion with unknown token {i}"));
                };
                if std::mem::replace(&mut seen[i], true) {
                    return Err(format!("second completion for {phase} {i}"));
                }
                left -= 1;
                c.result
                    .map_err(|e| format!("{phase} LBA {lba} x{blocks}: {e}"))?;
                if op == Op::Read {
                    compare(&pattern(seed, lba, blocks, bs), &c.buf, lba, bs, seed)
                        .map_err(|e| format!("read LBA {lba} x{blocks}: {e}"))?;
                    bytes += c.buf.len();
                }
            }
            if left > 0 && Instant::now() > deadline {
                return Err(format!(
                    "{phase}: {left} of {depth} commands never completed"
                ));
            }
        }
        seen.fill(false);
    }
    Ok(format!(
        "queue {}: {depth} writes then {depth} reads in flight at once, {} KiB verified",
        q.qid(),
        bytes >> 10
    ))
}

/// What one I/O of the loss phase ended with.
#[derive(Debug, Default)]
struct LossTally {
    ok: u64,
    lost: u64,
    other: Vec<String>,
}

/// Keeps I/O going until the target goes away, then checks how it failed.
fn loss(
    ctrl: &Arc<Controller>,
    qs: &mut [IoQueue],
    ns: &NamespaceInfo,
    seed: u64,
) -> Res<((), String)> {
    let bs = ns.block_size as usize;
    let blocks = (4096 / bs).max(1) as u32;
    let span = ns.blocks / blocks as u64;
    let mut rng = Rng::new(seed ^ 0x1055);
    print_line("READY-FOR-REMOVAL");
    let ready = Instant::now();
    let mut t = LossTally::default();
    let mut inflight = 0usize;
    let mut last_ok = ready;
    // When the first failure showed, and what it was.
    let mut first_fail: Option<(Instant, String)> = None;
    let mut out = Vec::with_capacity(LOSS_DEPTH);
    let mut token = 0u64;
    loop {
        while first_fail.is_none() && inflight < LOSS_DEPTH {
            let lba = rng.below(span) * blocks as u64;
            let (op, buf) = if token.is_multiple_of(2) {
                (Op::Write, pattern(seed, lba, blocks, bs))
            } else {
                (Op::Read, vec![0; blocks as usize * bs])
            };
            let mut req = request(op, ns.nsid, lba, blocks, buf);
            req.token = token;
            token += 1;
            match qs[0].submit(req) {
                Ok(()) => inflight += 1,
                Err((_, e)) => {
                    first_fail = Some((Instant::now(), format!("submit: {e}")));
                    if matches!(e, Error::ControllerLost { .. }) {
                        t.lost += 1;
                    }
                }
            }
        }
        out.clear();
        let r = qs[0].poll(&mut out, Duration::from_millis(200));
        let now = Instant::now();
        for c in out.drain(..) {
            inflight -= 1;
            match c.result {
                Ok(()) => {
                    t.ok += 1;
                    last_ok = now;
                }
                Err(e) => {
                    if e == IoError::ControllerLost {
                        t.lost += 1;
                    } else {
                        t.other.push(e.to_string());
                    }
                    first_fail.get_or_insert((now, format!("completion: {e}")));
                }
            }
        }
        if let Err(e) = r {
            if !matches!(e, Error::ControllerLost { .. }) {
                t.other.push(format!("poll: {e}"));
            }
            first_fail.get_or_insert((now, format!("poll: {e}")));
        }
        if first_fail.is_some() && inflight == 0 {
            break;
        }
        if now > ready + LOSS_WAIT {
            return Err(format!(
                "{} s after READY-FOR-REMOVAL: {} I/Os ok, {inflight} in flight, first failure {:?}",
                LOSS_WAIT.as_secs(),
                t.ok,
                first_fail.map(|f| f.1)
            ));
        }
    }
    let (failed_at, first) = first_fail.expect("loop ends after a failure");
    if t.ok == 0 {
        return Err(format!(
            "no I/O succeeded before the removal (first failure: {first})"
        ));
    }
    if t.lost == 0 {
        return Err(format!(
            "I/Os failed, but none with 'controller lost': {first}; others: {:?}",
            t.other
        ));
    }
    let took = failed_at.saturating_duration_since(last_ok);
    if took > CTRL_LOSS_TIMEOUT + LOSS_SLACK {
        return Err(format!(
            "controller lost declared {:.1} s after the last good I/O (timeout {} s)",
            took.as_secs_f64(),
            CTRL_LOSS_TIMEOUT.as_secs()
        ));
    }
    // The next I/O on the same queue fails at once.
    let t0 = Instant::now();
    let next = match qs[0].submit(request(
        Op::Read,
        ns.nsid,
        0,
        blocks,
        vec![0; blocks as usize * bs],
    )) {
        Err((_, Error::ControllerLost { .. })) => "controller lost at submit".to_owned(),
        Err((_, e)) => {
            return Err(format!(
                "next I/O on queue 1 refused with {e}, expected controller lost"
            ))
        }
        Ok(()) => return Err("next I/O on queue 1 accepted after the controller was lost".into()),
    };
    // The other queue, idle all along, fails its next I/O too, in bounded time.
    let other = match exec(
        &mut qs[1],
        request(Op::Read, ns.nsid, 0, blocks, vec![0; blocks as usize * bs]),
    ) {
        Ok(c) => match c.result {
            Err(IoError::ControllerLost) => "controller lost".to_owned(),
            r => return Err(format!("I/O on idle queue 2 after the loss: {r:?}")),
        },
        Err(e) if e.contains("controller lost") => format!("error ({e})"),
        Err(e) => return Err(format!("I/O on idle queue 2 after the loss: {e}")),
    };
    let admin = match ctrl.namespace(ns.nsid) {
        Ok(_) => return Err("admin command succeeded after the controller was lost".into()),
        Err(e) => e.to_string(),
    };
    if t0.elapsed() > CTRL_LOSS_TIMEOUT + LOSS_SLACK {
        return Err(format!(
            "failing the follow-up commands took {:.1} s",
            t0.elapsed().as_secs_f64()
        ));
    }
    Ok((
        (),
        format!(
            "{} I/Os ok before the removal; {} failed 'controller lost' {:.1} s after the last good one \
             (first: {first}){}; next I/O: {next}; idle queue 2: {other}; admin: {admin}",
            t.ok,
            t.lost,
            took.as_secs_f64(),
            if t.other.is_empty() {
                String::new()
            } else {
                format!("; other errors: {:?}", t.other)
            }
        ),
    ))
}

/// A command of the blip phase in flight.
#[derive(Debug, Clone, Copy)]
struct BlipIo {
    unit: u64,
    lba: u64,
    blocks: u32,
    write: bool,
}

/// Keeps verified I/O going on both queues while the caller takes the
/// subsystem off the port and puts it back: every command must complete
/// successfully (the queues reconnect and reissue what was outstanding) and
/// every read must return what was written.
fn blip(qs: &mut [IoQueue], ns: &NamespaceInfo, seed: u64) -> Res<((), String)> {
    let bs = ns.block_size as usize;
    let seed = seed ^ 0xB11B;
    // 64 KiB units in the first quarter of the namespace; queue k uses the
    // units u with u % 2 == k. A unit is written whole with 4 KiB or 64 KiB
    // commands (in-capsule and R2T) and read back whole once written.
    let unit_blocks = ((64 << 10) / bs) as u32;
    let units = ns.blocks / 4 / unit_blocks as u64;
    let mut rng = Rng::new(seed);
    let mut written: Vec<Vec<u64>> = vec![Vec::new(), Vec::new()];
    let mut inflight: Vec<std::collections::HashMap<u64, BlipIo>> =
        vec![Default::default(), Default::default()];
    let mut token = 0u64;
    let (mut writes, mut reads) = (0u64, 0u64);
    let mut out = Vec::new();
    print_line("READY-FOR-BLIP");
    let start = Instant::now();
    let end = start + BLIP_WINDOW;
    let mut last_done = start;
    let mut longest = (Duration::ZERO, 0u64);
    loop {
        let now = Instant::now();
        let running = now < end;
        for k in 0..qs.len().min(2) {
            while running && inflight[k].len() < BLIP_DEPTH {
                let read = !written[k].is_empty() && rng.next_u64().is_multiple_of(2);
                let io = if read {
                    let unit = written[k][rng.below(written[k].len() as u64) as usize];
                    BlipIo {
                        unit,
                        lba: unit * unit_blocks as u64,
                        blocks: unit_blocks,
                        write: false,
                    }
                } else {
                    let unit = rng.below(units / 2) * 2 + k as u64;
                    // A whole unit: one 64 KiB command or 16 of 4 KiB, the
                    // latter as one command per 4 KiB piece.
                    let piece = if rng.next_u64().is_multiple_of(2) {
                        unit_blocks
                    } else {
                        ((4096 / bs) as u32).max(1)
                    };
                    let i = rng.below((unit_blocks / piece) as u64);
                    BlipIo {
                        unit,
                        lba: unit * unit_blocks as u64 + i * piece as u64,
                        blocks: piece,
                        write: true,
                    }
                };
                let buf = if io.write {
                    pattern(seed, io.lba, io.blocks, bs)
                } else {
                    vec![0xA5; io.blocks as usize * bs]
                };
                let op = if io.write { Op::Write } else { Op::Read };
                let mut req = request(op, ns.nsid, io.lba, io.blocks, buf);
                req.token = token;
                qs[k]
                    .submit(req)
                    .map_err(|(r, e)| format!("queue {} submit {}: {e}", k + 1, describe(&r)))?;
                inflight[k].insert(token, io);
                token += 1;
            }
            out.clear();
            let wait = if running { 20 } else { 200 };
            qs[k]
                .poll(&mut out, Duration::from_millis(wait))
                .map_err(|e| {
                    format!(
                        "queue {} poll {:.1} s into the blip: {e}",
                        k + 1,
                        start.elapsed().as_secs_f64()
                    )
                })?;
            let t = Instant::now();
            for c in out.drain(..) {
                let io = inflight[k].remove(&c.token).ok_or_else(|| {
                    format!("queue {}: completion for unknown token {}", k + 1, c.token)
                })?;
                let gap = t.saturating_duration_since(last_done);
                if gap > longest.0 {
                    longest = (gap, writes + reads);
                }
                last_done = t;
                c.result.map_err(|e| {
                    format!(
                        "queue {} {} LBA {} x{} failed {:.1} s into the blip: {e}",
                        k + 1,
                        if io.write { "write" } else { "read" },
                        io.lba,
                        io.blocks,
                        start.elapsed().as_secs_f64()
                    )
                })?;
                if io.write {
                    writes += 1;
                    // Readable once every piece of the unit was written; the
                    // pieces are random, so a unit counts when a whole-unit
                    // write completed.
                    if io.blocks == unit_blocks && !written[k].contains(&io.unit) {
                        written[k].push(io.unit);
                    }
                } else {
                    reads += 1;
                    compare(
                        &pattern(seed, io.lba, io.blocks, bs),
                        &c.buf,
                        io.lba,
                        bs,
                        seed,
                    )
                    .map_err(|e| {
                        format!(
                            "queue {} read {:.1} s into the blip: {e}",
                            k + 1,
                            start.elapsed().as_secs_f64()
                        )
                    })?;
                }
            }
        }
        if !running && inflight.iter().all(|m| m.is_empty()) {
            break;
        }
        if now > end + IO_TIMEOUT {
            return Err(format!(
                "{} commands still outstanding {} s after the blip window",
                inflight.iter().map(|m| m.len()).sum::<usize>(),
                IO_TIMEOUT.as_secs()
            ));
        }
    }
    if longest.0 < BLIP_MIN_STALL {
        return Err(format!(
            "no stall of {} ms or more: the outage was not seen (longest {} ms)",
            BLIP_MIN_STALL.as_millis(),
            longest.0.as_millis()
        ));
    }
    let after = writes + reads - longest.1;
    if after < 2 * BLIP_DEPTH as u64 {
        return Err(format!("only {after} I/Os completed after the outage"));
    }
    Ok((
        (),
        format!(
            "{writes} writes, {reads} verified reads, all ok; completions stalled {:.1} s \
             (outage), then {after} more completed",
            longest.0.as_secs_f64()
        ),
    ))
}
