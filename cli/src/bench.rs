//! `nvpool bench`: a fio-like load generator on the userspace initiator.
//!
//! Each job is a thread that owns one I/O queue (its own TCP connection or
//! RDMA queue pair, `-t`) and keeps `iodepth` commands in flight, timing
//! each from submission to completion into an HDR histogram. With `--verify` every written block
//! carries a self-describing header (magic, LBA, seed, CRC32C) and a
//! seed-derived fill, reads are checked against what this run wrote, and
//! every block written is read back and checked at the end.

use crate::size::{parse_duration, parse_size};
use crate::Format;
use anyhow::{bail, Context};
use hdrhistogram::Histogram;
use nvpool_initiator::{Completion, ConnectParams, Controller, IoQueue, Op, Request};
use nvpool_rt::lock;
use nvpool_rt::random::Rng;
use nvpool_wire::tcp::Digests;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Rw {
    Read,
    Write,
    Randread,
    Randwrite,
    Randrw,
}

#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Transport (rdma: no digests, no --volume).
    #[arg(short = 't', long = "transport", value_enum, default_value_t = crate::TransportArg::Tcp)]
    pub transport: crate::TransportArg,
    /// Target address.
    #[arg(short = 'a', long = "traddr", required_unless_present = "volume")]
    pub addr: Option<String>,
    /// Target port.
    #[arg(short = 's', long = "trsvcid", default_value_t = 4420)]
    pub port: u16,
    /// Subsystem NQN.
    #[arg(short = 'n', long = "nqn", required_unless_present = "volume")]
    pub nqn: Option<String>,
    /// Instead of one namespace: a pooled volume (name or UUID) through the
    /// client-side volume engine in this process (attached to the host NQN
    /// for the run, like `volume attach` does; detached after unless it was
    /// attached before). Random reads and writes only, no --verify.
    #[arg(long, conflicts_with_all = ["addr", "nqn", "verify", "hdr_digest", "data_digest"])]
    pub volume: Option<String>,
    /// Namespace ID.
    #[arg(long, default_value_t = 1)]
    pub nsid: u32,
    /// Host NQN (default /etc/nvme/hostnqn, else a generated one).
    #[arg(short = 'q', long)]
    pub hostnqn: Option<String>,
    #[command(flatten)]
    pub dhchap: crate::dhchap::DhchapArgs,
    /// I/O pattern.
    #[arg(long, value_enum)]
    pub rw: Rw,
    /// Block size per I/O (binary units: 4k, 128k).
    #[arg(long, default_value = "4k", value_parser = parse_size)]
    pub bs: u64,
    /// Commands in flight per job.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub iodepth: u16,
    /// Jobs (threads, each with its own I/O queue).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub jobs: u16,
    /// How long to run (10s, 500ms, 2m).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub runtime: Duration,
    /// Bytes of the namespace to use, from offset 0 (default: all of it).
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,
    /// Percentage of reads in randrw.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u8).range(0..=100))]
    pub rwmixread: u8,
    /// Check data: written blocks carry headers and are read back and compared.
    #[arg(long)]
    pub verify: bool,
    /// Header digest (CRC32C).
    #[arg(short = 'g', long)]
    pub hdr_digest: bool,
    /// Data digest (CRC32C).
    #[arg(short = 'G', long)]
    pub data_digest: bool,
    /// Random seed (0: from the clock).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(short = 'o', long = "output-format", value_enum, default_value_t = Format::Table)]
    pub output: Format,
}

const VERIFY_MAGIC: u64 = 0x4656_4c4f_4f50_564e; // "NVPOOLVF"
const VERIFY_HDR: usize = 32;

/// What a job, a `--volume` task or the whole run did.
struct Tally {
    hist: Histogram<u64>,
    ops: u64,
    bytes: u64,
    errors: u64,
    checked: u64,
    failed: u64,
    first_error: Option<String>,
}

impl Tally {
    fn new() -> Tally {
        Tally {
            hist: Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid histogram bounds"),
            ops: 0,
            bytes: 0,
            errors: 0,
            checked: 0,
            failed: 0,
            first_error: None,
        }
    }

    /// Adds another job's counts; the first error seen stays first.
    fn add(&mut self, o: Tally) {
        self.hist.add(&o.hist).expect("same bounds");
        self.ops += o.ops;
        self.bytes += o.bytes;
        self.errors += o.errors;
        self.checked += o.checked;
        self.failed += o.failed;
        self.first_error = self.first_error.take().or(o.first_error);
    }
}

pub fn run(conn: &crate::cluster::Connection, a: Args) -> anyhow::Result<()> {
    if a.bs == 0 || !a.bs.is_multiple_of(512) {
        bail!("--bs must be a multiple of 512");
    }
    let rdma = a.transport == crate::TransportArg::Rdma;
    if rdma && (a.volume.is_some() || a.hdr_digest || a.data_digest) {
        return Err(crate::Usage(
            "-t rdma works on --traddr/--nqn without digests (RDMA has none)".into(),
        )
        .into());
    }
    if let Some(v) = a.volume.clone() {
        return run_volume(conn, &a, &v);
    }
    let (Some(target), Some(nqn)) = (a.addr.clone(), a.nqn.clone()) else {
        bail!("give --traddr and --nqn, or --volume");
    };
    let addr = crate::resolve(&target, a.port)?;
    let mut p = ConnectParams::new(addr, &nqn);
    p.transport = a.transport.into();
    if let Some(h) = &a.hostnqn {
        p.hostid = h
            .rsplit_once(":uuid:")
            .and_then(|(_, u)| nvpool_initiator::hostnqn::parse_uuid(u))
            .unwrap_or(p.hostid);
        p.hostnqn = h.clone();
    }
    p.digests = Digests {
        header: a.hdr_digest,
        data: a.data_digest,
    };
    p.io_queues = a.jobs;
    p.queue_depth = a.iodepth.max(2);
    p.dhchap = a.dhchap.keys()?;
    let ctrl = Controller::connect(p).with_context(|| format!("connecting to {nqn} at {addr}"))?;
    let ns = ctrl.namespace(a.nsid)?;
    let bsz = ns.block_size as u64;
    if !a.bs.is_multiple_of(bsz) {
        bail!(
            "--bs {} is not a multiple of the namespace block size {bsz}",
            a.bs
        );
    }
    if a.bs as usize > ctrl.max_transfer() {
        bail!(
            "--bs {} exceeds the controller's maximum transfer of {} bytes",
            a.bs,
            ctrl.max_transfer()
        );
    }
    let size = a.size.unwrap_or(ns.size_bytes()).min(ns.size_bytes());
    let units = size / a.bs;
    if units < a.jobs as u64 {
        bail!(
            "--size {size} holds fewer than one block of {} per job",
            a.bs
        );
    }
    let granted = ctrl.io_queue_count();
    if granted < a.jobs {
        bail!(
            "the controller granted {granted} I/O queues, fewer than --jobs {}",
            a.jobs
        );
    }
    let seed = if a.seed != 0 {
        a.seed
    } else {
        Instant::now().elapsed().as_nanos() as u64
            ^ std::process::id() as u64
            ^ 0x9E37_79B9_7F4A_7C15
    };
    let mut queues = Vec::new();
    for j in 0..a.jobs {
        let mut q = ctrl.io_queue(j + 1)?;
        q.set_block_size(ns.block_size);
        queues.push(q);
    }
    let start = Instant::now();
    let cpu0 = crate::dataset::cpu_seconds();
    let deadline = start + a.runtime;
    let per_job = units / a.jobs as u64;
    let results: Vec<anyhow::Result<(Tally, Instant)>> = std::thread::scope(|s| {
        let hs: Vec<_> = queues
            .into_iter()
            .enumerate()
            .map(|(j, q)| {
                let a = &a;
                let region = (j as u64 * per_job, per_job);
                let js = seed.wrapping_add(j as u64 * 0x9E37_79B9);
                s.spawn(move || job(q, a, bsz, region, deadline, js))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("job thread panicked")))
            })
            .collect()
    });
    let mut timed_end = start;
    let mut total = Tally::new();
    for r in results {
        let (t, end) = r?;
        timed_end = timed_end.max(end);
        total.add(t);
    }
    let cpu = crate::dataset::cpu_seconds() - cpu0;
    drop(ctrl);
    report(
        &a,
        &format!(
            "{nqn} nsid {} ({addr}, {})",
            a.nsid,
            nvpool_initiator::Transport::from(a.transport)
        ),
        timed_end.duration_since(start).as_secs_f64().max(1e-3),
        cpu,
        total,
    )
}

/// Prints what a run of `secs` did; `cpu` is this process's CPU seconds
/// during the timed phase (and verify).
fn report(a: &Args, what: &str, secs: f64, cpu: f64, t: Tally) -> anyhow::Result<()> {
    let Tally {
        hist,
        ops,
        bytes,
        errors,
        checked,
        failed,
        first_error,
    } = t;
    let cpu_us_per_io = cpu * 1e6 / ops.max(1) as f64;
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    let out = serde_json::json!({
        "target": what,
        "nqn": a.nqn,
        "volume": a.volume,
        "rw": format!("{:?}", a.rw).to_lowercase(),
        "bs": a.bs,
        "iodepth": a.iodepth,
        "jobs": a.jobs,
        "runtime_s": secs,
        "ops": ops,
        "iops": ops as f64 / secs,
        "bw_bytes_per_sec": bytes as f64 / secs,
        "lat_us": { "mean": hist.mean() / 1000.0, "p50": us(0.5), "p99": us(0.99), "p999": us(0.999), "max": hist.max() as f64 / 1000.0 },
        "errors": errors,
        "verify": { "checked": checked, "failed": failed },
        "cpu_us_per_io": cpu_us_per_io,
    });
    match a.output {
        Format::Json => println!("{}", serde_json::to_string_pretty(&out)?),
        Format::Table => {
            println!(
                "{} bs={} iodepth={} jobs={} on {what}",
                out["rw"].as_str().unwrap_or_default(),
                a.bs,
                a.iodepth,
                a.jobs,
            );
            println!(
                "  IOPS {:.0}, {:.1} MB/s, {ops} I/Os in {secs:.2} s, {errors} errors",
                ops as f64 / secs,
                bytes as f64 / secs / 1e6
            );
            println!(
                "  latency (µs): mean {:.1}, p50 {:.1}, p99 {:.1}, p99.9 {:.1}, max {:.1}",
                hist.mean() / 1000.0,
                us(0.5),
                us(0.99),
                us(0.999),
                hist.max() as f64 / 1000.0
            );
            println!("  host CPU: {cpu_us_per_io:.1} µs per I/O");
            if a.verify {
                println!("  verify: {checked} blocks checked, {failed} failed");
            }
        }
    }
    if errors > 0 || failed > 0 {
        bail!(
            "{errors} I/O errors, {failed} verification failures{}",
            first_error
                .map(|e| format!("; first: {e}"))
                .unwrap_or_default()
        );
    }
    Ok(())
}

fn fill(buf: &mut [u8], lba: u64, seed: u64) {
    // `| 1`: the stream blocks written by earlier versions carry.
    Rng::new(seed | 1).fill(&mut buf[VERIFY_HDR..]);
    buf[0..8].copy_from_slice(&VERIFY_MAGIC.to_le_bytes());
    buf[8..16].copy_from_slice(&lba.to_le_bytes());
    buf[16..24].copy_from_slice(&seed.to_le_bytes());
    let crc = nvpool_wire::digest::crc32c(&buf[VERIFY_HDR..]);
    buf[24..28].copy_from_slice(&crc.to_le_bytes());
    buf[28..32].fill(0);
}

/// Checks a block read back: Ok(true) verified, Ok(false) never written by
/// a verifying run, Err on damage.
fn check(buf: &[u8], lba: u64, expect_seed: Option<u64>) -> Result<bool, String> {
    let magic = u64::from_le_bytes(buf[0..8].try_into().expect("8 bytes"));
    if magic != VERIFY_MAGIC {
        return match expect_seed {
            Some(_) => Err(format!(
                "LBA {lba}: block this run wrote has no verify header"
            )),
            None => Ok(false),
        };
    }
    let got_lba = u64::from_le_bytes(buf[8..16].try_into().expect("8 bytes"));
    let seed = u64::from_le_bytes(buf[16..24].try_into().expect("8 bytes"));
    let crc = u32::from_le_bytes(buf[24..28].try_into().expect("4 bytes"));
    if got_lba != lba {
        return Err(format!("LBA {lba}: block carries LBA {got_lba}"));
    }
    if nvpool_wire::digest::crc32c(&buf[VERIFY_HDR..]) != crc {
        return Err(format!("LBA {lba}: data does not match its CRC32C"));
    }
    if let Some(s) = expect_seed {
        if s != seed {
            return Err(format!(
                "LBA {lba}: stale data (seed {seed:#x}, expected {s:#x})"
            ));
        }
    }
    Ok(true)
}

struct Inflight {
    start: Instant,
    lba: u64,
    write: bool,
}

fn job(
    mut q: IoQueue,
    a: &Args,
    block: u64,
    (first, units): (u64, u64),
    deadline: Instant,
    seed: u64,
) -> anyhow::Result<(Tally, Instant)> {
    let bs = a.bs as usize;
    let blocks = (a.bs / block) as u32;
    let depth = (a.iodepth as usize).min(q.depth());
    let mut rng = Rng::new(seed);
    let mut res = Tally::new();
    let mut bufs: Vec<Vec<u8>> = (0..depth)
        .map(|i| vec![(i as u8).wrapping_mul(31) | 1; bs])
        .collect();
    let mut slots: Vec<Option<Inflight>> = (0..depth).map(|_| None).collect();
    let mut free: Vec<usize> = (0..depth).rev().collect();
    let mut written: HashMap<u64, u64> = HashMap::new();
    // With --verify no two commands touch one block at once: NVMe does not
    // order outstanding commands, so overlapping ones have no defined result.
    let mut busy: HashSet<u64> = HashSet::new();
    let mut cursor = 0u64;
    let mut comps: Vec<Completion> = Vec::with_capacity(depth);
    let fail = |res: &mut Tally, msg: String| {
        res.failed += 1;
        res.first_error.get_or_insert(msg);
    };
    loop {
        let now = Instant::now();
        let running = now < deadline;
        while running && !free.is_empty() {
            let mut pick = None;
            for _ in 0..64 {
                let unit = match a.rw {
                    Rw::Read | Rw::Write => {
                        let u = cursor;
                        cursor = (cursor + 1) % units;
                        u
                    }
                    _ => rng.below(units),
                };
                let lba = (first + unit) * blocks as u64;
                if !a.verify || !busy.contains(&lba) {
                    pick = Some(lba);
                    break;
                }
            }
            let Some(lba) = pick else { break };
            let write = match a.rw {
                Rw::Write | Rw::Randwrite => true,
                Rw::Randrw => rng.below(100) >= a.rwmixread as u64,
                _ => false,
            };
            let t = free.pop().expect("checked non-empty");
            let mut buf = std::mem::take(&mut bufs[t]);
            if write && a.verify {
                let s = rng.next_u64();
                fill(&mut buf, lba, s);
                written.insert(lba, s);
            }
            if a.verify {
                busy.insert(lba);
            }
            let req = Request {
                op: if write { Op::Write } else { Op::Read },
                nsid: a.nsid,
                lba,
                blocks,
                fua: false,
                buf,
                shared: None,
                token: t as u64,
            };
            slots[t] = Some(Inflight {
                start: Instant::now(),
                lba,
                write,
            });
            if let Err((req, e)) = q.submit(req) {
                bail!("submit failed: {e} (LBA {})", req.lba);
            }
        }
        if free.len() == depth && !running {
            break;
        }
        comps.clear();
        q.poll(&mut comps, Duration::from_secs(1))?;
        let done = Instant::now();
        for c in comps.drain(..) {
            let t = c.token as usize;
            let inf = slots[t].take().expect("completion for a token in flight");
            let ns = done.duration_since(inf.start).as_nanos() as u64;
            let _ = res.hist.record(ns.max(1));
            res.ops += 1;
            res.bytes += bs as u64;
            if let Err(e) = &c.result {
                res.errors += 1;
                res.first_error
                    .get_or_insert(format!("LBA {}: {e}", inf.lba));
            } else if a.verify && !inf.write {
                match check(&c.buf, inf.lba, written.get(&inf.lba).copied()) {
                    Ok(true) => res.checked += 1,
                    Ok(false) => {}
                    Err(m) => fail(&mut res, m),
                }
            }
            busy.remove(&inf.lba);
            bufs[t] = c.buf;
            free.push(t);
        }
    }
    let timed_end = Instant::now();
    if a.verify && !written.is_empty() {
        verify_all(&mut q, a, blocks, &written, &mut res, &mut bufs)?;
    }
    Ok((res, timed_end))
}

/// Reads back every block this job wrote and compares it.
fn verify_all(
    q: &mut IoQueue,
    a: &Args,
    blocks: u32,
    written: &HashMap<u64, u64>,
    res: &mut Tally,
    bufs: &mut [Vec<u8>],
) -> anyhow::Result<()> {
    let mut pending: Vec<(u64, u64)> = written.iter().map(|(&l, &s)| (l, s)).collect();
    pending.sort_unstable();
    let depth = bufs.len();
    let mut free: Vec<usize> = (0..depth).collect();
    let mut lbas = vec![(0u64, 0u64); depth];
    let mut comps = Vec::with_capacity(depth);
    let mut next = 0;
    while next < pending.len() || free.len() < depth {
        while next < pending.len() && !free.is_empty() {
            let t = free.pop().expect("checked non-empty");
            lbas[t] = pending[next];
            let req = Request {
                op: Op::Read,
                nsid: a.nsid,
                lba: pending[next].0,
                blocks,
                fua: false,
                buf: std::mem::take(&mut bufs[t]),
                shared: None,
                token: t as u64,
            };
            next += 1;
            if let Err((_, e)) = q.submit(req) {
                bail!("verify read submit failed: {e}");
            }
        }
        comps.clear();
        q.poll(&mut comps, Duration::from_secs(1))?;
        for c in comps.drain(..) {
            let t = c.token as usize;
            let (lba, seed) = lbas[t];
            match c.result {
                Err(e) => {
                    res.errors += 1;
                    res.first_error
                        .get_or_insert(format!("verify read of LBA {lba}: {e}"));
                }
                Ok(()) => match check(&c.buf, lba, Some(seed)) {
                    Ok(_) => res.checked += 1,
                    Err(m) => {
                        res.failed += 1;
                        res.first_error.get_or_insert(m);
                    }
                },
            }
            bufs[t] = c.buf;
            free.push(t);
        }
    }
    Ok(())
}

/// `--volume`: the same random load through the client-side volume engine
/// in this process: `jobs` executor threads, `jobs × iodepth` tasks each
/// keeping one request in flight.
fn run_volume(conn: &crate::cluster::Connection, a: &Args, volume: &str) -> anyhow::Result<()> {
    use nvpool_initiator::follow;
    use nvpool_initiator::{Volume, VolumeOptions};
    use std::sync::{Arc, Mutex};
    if a.verify || matches!(a.rw, Rw::Read | Rw::Write) {
        bail!("--volume runs randread, randwrite or randrw");
    }
    let c = conn.client()?;
    let (uuid, _) = crate::volume::resolve(&c, volume)?;
    let host = crate::volume::host_nqn(a.hostnqn.clone())?;
    let path = follow::attachment_path(&uuid, &host);
    let (status, _): (u16, serde_json::Value) = c.put_empty(&path)?;
    let detach = |c: &crate::client::Client| {
        if status == 201 {
            let _ = c.delete(&path);
        }
    };
    let follower = nvpool_agent::client::Follower(c.clone());
    let view = match follow::read_attachment(&follower, &uuid, &host) {
        Ok(v) => v,
        Err(e) => {
            detach(&c);
            bail!("reading the attachment: {e}");
        }
    };
    let opts = VolumeOptions {
        queues_per_controller: a.jobs,
        queue_depth: a.iodepth.max(2),
        failed_extents: view.copies.stale_at_open(),
        syncing_extents: view.copies.syncing_at_open(),
        moving: view.copies.moving_at_open(),
        // Tagged like any engine's writes; with no follower this run never
        // confirms a new epoch, so a snapshot taken meanwhile is given up.
        write_epoch: view.copies.write_epoch,
        write_hold: view.copies.write_hold,
        ..VolumeOptions::default()
    };
    let vol = match Volume::open(&view.plan, opts) {
        Ok(v) => Arc::new(v),
        Err(e) => {
            detach(&c);
            bail!("opening volume {volume}: {e}");
        }
    };
    let size = a.size.unwrap_or(vol.size()).min(vol.size());
    let units = size / a.bs;
    let tasks = a.jobs as usize * a.iodepth as usize;
    let ex = nvpool_initiator::exec::Executor::new("bench", a.jobs as usize, tasks, false)?;
    let results: Arc<Mutex<Vec<Tally>>> = Arc::default();
    let start = Instant::now();
    let cpu0 = crate::dataset::cpu_seconds();
    let deadline = start + a.runtime;
    let seed = if a.seed != 0 {
        a.seed
    } else {
        start.elapsed().as_nanos() as u64 | 1
    };
    for t in 0..tasks {
        let (vol, results) = (vol.clone(), results.clone());
        let (bs, rw, mix) = (a.bs, a.rw, a.rwmixread as u64);
        ex.spawn(async move {
            let mut rng = Rng::new(seed ^ (t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let mut tally = Tally::new();
            let mut buf = vec![0x5a; bs as usize];
            while Instant::now() < deadline {
                let off = rng.below(units) * bs;
                let write = match rw {
                    Rw::Randwrite => true,
                    Rw::Randrw => rng.below(100) >= mix,
                    _ => false,
                };
                let t0 = Instant::now();
                let (r, b) = if write {
                    vol.write(off, buf, false).await
                } else {
                    vol.read(off, buf).await
                };
                buf = b;
                tally.hist.saturating_record(t0.elapsed().as_nanos() as u64);
                tally.ops += 1;
                tally.bytes += bs;
                if let Err(e) = r {
                    tally.errors += 1;
                    tally
                        .first_error
                        .get_or_insert(format!("offset {off}: {e}"));
                }
            }
            lock(&results).push(tally);
        });
    }
    drop(ex);
    let cpu = crate::dataset::cpu_seconds() - cpu0;
    let secs = start.elapsed().as_secs_f64().max(1e-3);
    let mut total = Tally::new();
    for t in lock(&results).drain(..) {
        total.add(t);
    }
    if let Ok(v) = Arc::try_unwrap(vol) {
        let _ = v.close();
    }
    detach(&c);
    report(
        a,
        &format!("volume {volume} ({uuid}) through the client-side engine"),
        secs,
        cpu,
        total,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_blocks_detect_damage() {
        let mut b = vec![0u8; 4096];
        fill(&mut b, 77, 0xABCD);
        assert_eq!(check(&b, 77, Some(0xABCD)), Ok(true));
        assert!(check(&b, 78, None).is_err(), "wrong LBA");
        assert!(check(&b, 77, Some(0xABCE)).is_err(), "stale seed");
        b[100] ^= 1;
        assert!(check(&b, 77, None).is_err(), "flipped bit");
        assert_eq!(check(&[0u8; 4096], 5, None), Ok(false));
        assert!(check(&[0u8; 4096], 5, Some(1)).is_err());
    }
}
