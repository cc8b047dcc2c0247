//! `nvpool dataset`: a small-file training dataset, written once and read
//! like a training epoch (every file, in random order, by several
//! loader threads), with every byte verified.
//!
//! File `i` of a dataset with seed `s` is `HEADER_BYTES` of header (magic,
//! seed, index, length) followed by a pseudo-random stream derived from
//! `(s, i)`, so an epoch verifies each file without a manifest and a file
//! swapped with another, truncated or corrupted is caught.

use crate::size::parse_size;
use crate::Format;
use anyhow::{bail, Context};
use clap::{Args as ClapArgs, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use nvpool_rt::lock;
use nvpool_rt::random::Rng;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

const MAGIC: &[u8; 8] = b"NVPDSET1";
const HEADER_BYTES: usize = 32;
/// Files per subdirectory, so no directory grows huge.
const FILES_PER_DIR: usize = 1000;
/// Loader threads at most.
const THREADS_MAX: usize = 256;

#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Debug, Subcommand)]
pub enum Cmd {
    /// Write a dataset of small files into DIR.
    Make(MakeArgs),
    /// Read every file of the dataset in DIR once, in random order, verifying each.
    Epoch(EpochArgs),
}

#[derive(Debug, ClapArgs)]
pub struct MakeArgs {
    pub dir: PathBuf,
    /// Number of files.
    #[arg(long, default_value_t = 2000)]
    pub files: usize,
    /// Smallest file (IEC units: 64K = 64 KiB).
    #[arg(long, default_value = "64K")]
    pub min_size: String,
    /// Largest file.
    #[arg(long, default_value = "256K")]
    pub max_size: String,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Writer threads.
    #[arg(long, default_value_t = 4)]
    pub threads: usize,
    #[arg(short, long, value_enum, default_value = "table")]
    pub output: Format,
}

#[derive(Debug, ClapArgs)]
pub struct EpochArgs {
    pub dir: PathBuf,
    /// Loader threads reading files at once.
    #[arg(long, default_value_t = 8)]
    pub threads: usize,
    /// Seed of the read order.
    #[arg(long, default_value_t = 7)]
    pub order_seed: u64,
    /// Write back dirty pages and drop the page cache first (root), so the
    /// epoch reads from the device.
    #[arg(long)]
    pub drop_caches: bool,
    #[arg(short, long, value_enum, default_value = "table")]
    pub output: Format,
}

/// The stream of file `index` of dataset `seed`. The mix starts
/// neighbouring (seed, index) pairs far apart; it and the `| 1` are part
/// of every dataset already written.
fn stream(seed: u64, index: u64) -> Rng {
    let mut x = seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491_4f6c_dd1d;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    Rng::new(x | 1)
}

/// The size of file `index`: uniform in `[min, max]`, whole 512-byte units.
fn file_len(seed: u64, index: u64, min: u64, max: u64) -> usize {
    let mut s = stream(seed ^ 0x5151, index);
    let span = (max - min) / 512 + 1;
    (min + s.below(span) * 512) as usize
}

/// The full contents of file `index`.
fn contents(seed: u64, index: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    buf[..8].copy_from_slice(MAGIC);
    buf[8..16].copy_from_slice(&seed.to_le_bytes());
    buf[16..24].copy_from_slice(&index.to_le_bytes());
    buf[24..32].copy_from_slice(&(len as u64).to_le_bytes());
    stream(seed, index).fill(&mut buf[HEADER_BYTES..]);
    buf
}

/// Checks a file's bytes; says what is wrong.
fn verify(bytes: &[u8]) -> Result<(), String> {
    if bytes.len() < HEADER_BYTES || &bytes[..8] != MAGIC {
        return Err("not a dataset file (bad header)".into());
    }
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let (seed, index, len) = (word(8), word(16), word(24));
    if len != bytes.len() as u64 {
        return Err(format!("{} bytes, its header says {len}", bytes.len()));
    }
    let differs = |n: usize| {
        Err(format!(
            "content differs at byte {} (file {index} of seed {seed})",
            HEADER_BYTES + n * 8
        ))
    };
    // Word by word: the loaders verify every byte they read, so this loop is
    // on the epoch's critical path and must not cost more than the read.
    let mut s = stream(seed, index);
    let mut words = bytes[HEADER_BYTES..].chunks_exact(8);
    let mut n = 0;
    for w in &mut words {
        if u64::from_le_bytes(w.try_into().expect("8 bytes")) != s.next_u64() {
            return differs(n);
        }
        n += 1;
    }
    let rest = words.remainder();
    if rest != &s.next_u64().to_le_bytes()[..rest.len()] {
        return differs(n);
    }
    Ok(())
}

fn path_of(dir: &Path, index: usize) -> PathBuf {
    dir.join(format!("d{:03}", index / FILES_PER_DIR))
        .join(format!("f{index:07}.bin"))
}

fn progress(len: u64, what: &str) -> ProgressBar {
    bar(
        len,
        what,
        "  {prefix} [{bar:30}] {pos}/{len} files  {per_sec}  eta {eta}",
    )
}

/// A progress bar on stderr when it is a terminal (hidden otherwise), in
/// indicatif's `template`.
pub(crate) fn bar(len: u64, prefix: &str, template: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(
        Some(len),
        if std::io::stderr().is_terminal() {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    let style = ProgressStyle::with_template(template)
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_prefix(prefix.to_owned());
    bar
}

/// Runs `work(i)` for `i in 0..n` on `threads` threads; the first error
/// stops everyone.
fn parallel(
    n: usize,
    threads: usize,
    work: impl Fn(usize) -> anyhow::Result<()> + Sync,
) -> anyhow::Result<()> {
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, THREADS_MAX) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                if let Err(e) = work(i) {
                    let mut f = lock(&failed);
                    f.get_or_insert(e);
                    next.store(n, Ordering::Relaxed);
                    break;
                }
            });
        }
    });
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    match args.cmd {
        Cmd::Make(a) => make(a),
        Cmd::Epoch(a) => epoch(a),
    }
}

fn make(a: MakeArgs) -> anyhow::Result<()> {
    let min = parse_size(&a.min_size).map_err(|e| crate::Usage(format!("--min-size: {e}")))?;
    let max = parse_size(&a.max_size).map_err(|e| crate::Usage(format!("--max-size: {e}")))?;
    if min < HEADER_BYTES as u64 || max < min || max > 1 << 30 {
        return Err(crate::Usage(format!(
            "file sizes must satisfy {HEADER_BYTES} <= --min-size <= --max-size <= 1G"
        ))
        .into());
    }
    if a.files == 0 {
        return Err(crate::Usage("--files must be at least 1".into()).into());
    }
    for d in 0..a.files.div_ceil(FILES_PER_DIR) {
        let p = a.dir.join(format!("d{d:03}"));
        std::fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
    }
    let bytes = AtomicU64::new(0);
    let bar = progress(a.files as u64, "writing");
    let start = Instant::now();
    let cpu0 = cpu_seconds();
    parallel(a.files, a.threads, |i| {
        let len = file_len(a.seed, i as u64, min, max);
        let data = contents(a.seed, i as u64, len);
        let p = path_of(&a.dir, i);
        std::fs::write(&p, &data).with_context(|| format!("writing {}", p.display()))?;
        bytes.fetch_add(len as u64, Ordering::Relaxed);
        bar.inc(1);
        Ok(())
    })?;
    // Durable before we report it written.
    sync_fs(&a.dir)?;
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    report(
        a.output,
        "written",
        a.files,
        bytes.load(Ordering::Relaxed),
        secs,
        cpu_seconds() - cpu0,
        None,
    );
    Ok(())
}

/// syncfs(2) on the filesystem holding `dir`.
fn sync_fs(dir: &Path) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(dir).with_context(|| format!("opening {}", dir.display()))?;
    // SAFETY: syncfs takes a valid open descriptor, which `f` holds.
    if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
        return Err(std::io::Error::last_os_error()).context("syncfs");
    }
    Ok(())
}

fn list(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for d in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let d = d?.path();
        if !d.is_dir() {
            continue;
        }
        for f in std::fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let f = f?.path();
            if f.extension().is_some_and(|e| e == "bin") {
                out.push(f);
            }
        }
    }
    out.sort();
    Ok(out)
}

fn epoch(a: EpochArgs) -> anyhow::Result<()> {
    let mut files = list(&a.dir)?;
    if files.is_empty() {
        bail!("no dataset files under {}", a.dir.display());
    }
    // Fisher–Yates with the order seed: a random but repeatable epoch.
    let mut s = stream(a.order_seed, 0);
    for i in (1..files.len()).rev() {
        let j = s.below(i as u64 + 1) as usize;
        files.swap(i, j);
    }
    if a.drop_caches {
        sync_fs(&a.dir)?;
        std::fs::write("/proc/sys/vm/drop_caches", "3\n")
            .context("dropping the page cache (needs root)")?;
    }
    let bytes = AtomicU64::new(0);
    let hist = Mutex::new(
        hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)
            .context("latency histogram")?,
    );
    let bar = progress(files.len() as u64, "epoch");
    let start = Instant::now();
    let cpu0 = cpu_seconds();
    parallel(files.len(), a.threads, |i| {
        let t = Instant::now();
        let p = &files[i];
        let data = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
        let us = t.elapsed().as_micros() as u64;
        verify(&data).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
        bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
        let _ = lock(&hist).record(us.max(1));
        bar.inc(1);
        Ok(())
    })?;
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    let h = hist.into_inner().unwrap_or_else(|p| p.into_inner());
    report(
        a.output,
        "read and verified",
        files.len(),
        bytes.load(Ordering::Relaxed),
        secs,
        cpu_seconds() - cpu0,
        Some(&h),
    );
    Ok(())
}

/// CPU time (user + system) this process has used so far, in seconds.
pub(crate) fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the zeroed struct it is given and nothing else.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(u.ru_utime) + secs(u.ru_stime)
}

/// Prints what a run did; `cpu_secs` is this process's CPU time during it
/// (the loaders' share of the machine: reading, verifying, the page cache).
fn report(
    format: Format,
    what: &str,
    files: usize,
    bytes: u64,
    secs: f64,
    cpu_secs: f64,
    lat: Option<&hdrhistogram::Histogram<u64>>,
) {
    let secs = secs.max(1e-9);
    let files_per_sec = files as f64 / secs;
    let mb_per_sec = bytes as f64 / secs / 1e6;
    match format {
        Format::Json => {
            let mut j = serde_json::json!({
                "files": files,
                "bytes": bytes,
                "seconds": secs,
                "files_per_sec": files_per_sec,
                "mb_per_sec": mb_per_sec,
                "cpu_seconds": cpu_secs,
            });
            if let Some(h) = lat {
                j["file_latency_us"] = serde_json::json!({
                    "p50": h.value_at_quantile(0.5),
                    "p99": h.value_at_quantile(0.99),
                    "max": h.max(),
                });
            }
            println!("{j}");
        }
        Format::Table => {
            print!(
                "{files} files ({:.1} MiB) {what} in {:.2} s: {files_per_sec:.0} files/s, \
                 {mb_per_sec:.1} MB/s",
                bytes as f64 / f64::from(1 << 20),
                secs
            );
            if let Some(h) = lat {
                print!(
                    "; per file p50 {} us, p99 {} us",
                    h.value_at_quantile(0.5),
                    h.value_at_quantile(0.99)
                );
            }
            println!();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_verify_and_damage_is_caught() {
        for (i, len) in [(0u64, 32usize), (1, 33), (2, 4096), (3, 65537)] {
            let mut data = contents(9, i, len);
            verify(&data).unwrap();
            if len > HEADER_BYTES {
                let at = len - 1;
                data[at] ^= 1;
                assert!(verify(&data).unwrap_err().contains("differs"));
                data[at] ^= 1;
            }
            data.push(0);
            assert!(verify(&data).is_err());
        }
        // Another file's contents under the same header are caught.
        let mut a = contents(9, 1, 4096);
        let b = contents(9, 2, 4096);
        a[HEADER_BYTES..].copy_from_slice(&b[HEADER_BYTES..]);
        assert!(verify(&a).is_err());
        assert!(verify(b"short").is_err());
    }

    #[test]
    fn sizes_stay_in_range_and_vary() {
        let lens: Vec<usize> = (0..1000).map(|i| file_len(1, i, 65536, 262_144)).collect();
        assert!(lens.iter().all(|&l| (65536..=262_144).contains(&l)));
        assert!(lens.iter().any(|&l| l < 100_000) && lens.iter().any(|&l| l > 200_000));
    }

    #[test]
    fn make_then_epoch_reads_everything_and_catches_corruption() {
        let dir = tempfile::tempdir().unwrap();
        make(MakeArgs {
            dir: dir.path().into(),
            files: 1500,
            min_size: "1K".into(),
            max_size: "8K".into(),
            seed: 3,
            threads: 3,
            output: Format::Json,
        })
        .unwrap();
        let files = list(dir.path()).unwrap();
        assert_eq!(files.len(), 1500);
        let epoch_args = || EpochArgs {
            dir: dir.path().into(),
            threads: 4,
            order_seed: 1,
            drop_caches: false,
            output: Format::Json,
        };
        epoch(epoch_args()).unwrap();
        let victim = path_of(dir.path(), 1234);
        let mut data = std::fs::read(&victim).unwrap();
        data[100] ^= 0xff;
        std::fs::write(&victim, &data).unwrap();
        let err = epoch(epoch_args()).unwrap_err().to_string();
        assert!(err.contains("f0001234.bin"), "{err}");
    }
}
