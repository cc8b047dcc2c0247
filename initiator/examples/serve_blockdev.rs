//! Serves one NVMe/TCP namespace (or a pooled volume) as a local block
//! device through a kernel front-end, for the VM tests
//! (`scripts/vm/guest/ublk-fs.sh`, `nbd-fs.sh`) and for trying it by hand.
//!
//! ```text
//! cargo build --release -p nvpool-initiator --example serve_blockdev
//! serve_blockdev --frontend ublk|nbd --target ADDR --subnqn NQN --nsid N
//!                [--hostnqn NQN] [--queues N] [--depth N]
//! serve_blockdev --frontend ublk|nbd --plan FILE      # a ConnectionPlan (JSON)
//! serve_blockdev --cleanup                            # delete ublk devices of dead servers
//! serve_blockdev --nbd-disconnect /dev/nbdN           # disconnect an nbd device (nbd-client -d)
//! ```
//!
//! Prints `DEVICE /dev/…` once the device exists. SIGTERM or SIGINT stops
//! it: the kernel writes back what it caches, the device is flushed and
//! removed, `STOPPED` is printed and the exit status is 0. `--cleanup`
//! prints `DELETED <id>` for each stale ublk device it deleted,
//! `--nbd-disconnect` prints `DISCONNECTED /dev/nbdN`.

use nvpool_initiator::device::block_on;
use nvpool_initiator::{BlockDev, ConnectParams, Controller, Device, Volume, VolumeOptions};
use std::error::Error as StdError;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

type Res<T> = Result<T, Box<dyn StdError>>;

const USAGE: &str = "usage: serve_blockdev --frontend ublk|nbd (--target ADDR --subnqn NQN \
--nsid N [--hostnqn NQN] | --plan FILE) [--queues N] [--depth N] [--runtime-dir DIR]\n       \
serve_blockdev --cleanup [--runtime-dir DIR]\n       \
serve_blockdev --nbd-disconnect /dev/nbdN";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frontend {
    Ublk,
    Nbd,
}

#[derive(Debug, Default)]
struct Args {
    frontend: Option<Frontend>,
    target: Option<SocketAddr>,
    subnqn: Option<String>,
    nsid: Option<u32>,
    hostnqn: Option<String>,
    plan: Option<PathBuf>,
    queues: Option<u16>,
    depth: Option<u16>,
    runtime_dir: Option<PathBuf>,
    cleanup: bool,
    nbd_disconnect: Option<PathBuf>,
}

fn parse_args() -> Res<Args> {
    let mut a = Args::default();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--cleanup" {
            a.cleanup = true;
            continue;
        }
        if flag == "-h" || flag == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let v = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        match flag.as_str() {
            "--frontend" => {
                a.frontend = Some(match v.as_str() {
                    "ublk" => Frontend::Ublk,
                    "nbd" => Frontend::Nbd,
                    _ => return Err(format!("--frontend {v}: expected ublk or nbd").into()),
                })
            }
            "--target" => a.target = Some(v.parse().map_err(|e| format!("--target {v}: {e}"))?),
            "--subnqn" => a.subnqn = Some(v),
            "--nsid" => a.nsid = Some(v.parse().map_err(|e| format!("--nsid {v}: {e}"))?),
            "--hostnqn" => a.hostnqn = Some(v),
            "--plan" => a.plan = Some(v.into()),
            "--queues" => a.queues = Some(v.parse().map_err(|e| format!("--queues {v}: {e}"))?),
            "--depth" => a.depth = Some(v.parse().map_err(|e| format!("--depth {v}: {e}"))?),
            "--runtime-dir" => a.runtime_dir = Some(v.into()),
            "--nbd-disconnect" => a.nbd_disconnect = Some(v.into()),
            _ => return Err(format!("unknown option {flag}\n{USAGE}").into()),
        }
    }
    Ok(a)
}

/// Blocks SIGTERM and SIGINT in this thread and every thread it starts
/// later, so that `wait_for_signal` can take them synchronously.
fn block_stop_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initializes it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t owned by this frame; the calls
    // only modify it and this thread's signal mask.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    set
}

fn wait_for_signal(set: &libc::sigset_t) -> i32 {
    let mut sig = 0;
    // SAFETY: `set` is initialized and `sig` is a valid out pointer.
    while unsafe { libc::sigwait(set, &mut sig) } != 0 {}
    sig
}

fn open_blockdev(a: &Args) -> Res<Arc<dyn BlockDev>> {
    if let Some(path) = &a.plan {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let plan: nvpool_layout::plan::ConnectionPlan =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut opts = VolumeOptions::default();
        if let Some(d) = a.depth {
            opts.queue_depth = d;
        }
        let vol = Volume::open(&plan, opts)?;
        return Ok(Arc::new(vol));
    }
    let (Some(addr), Some(subnqn), Some(nsid)) = (a.target, &a.subnqn, a.nsid) else {
        return Err(format!("give --target, --subnqn and --nsid, or --plan\n{USAGE}").into());
    };
    let mut params = ConnectParams::new(addr, subnqn);
    if let Some(h) = &a.hostnqn {
        params.hostnqn = h.clone();
    }
    if let Some(q) = a.queues {
        params.io_queues = q;
    }
    let queues = params.io_queues;
    let ctrl = Controller::connect(params)?;
    let dev = Device::open(ctrl, nsid, queues)?;
    Ok(Arc::new(dev))
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[cfg(feature = "ublk")]
fn ublk_options(a: &Args) -> nvpool_initiator::frontend::ublk::UblkOptions {
    let mut o = nvpool_initiator::frontend::ublk::UblkOptions {
        queues: a.queues,
        ..Default::default()
    };
    if let Some(d) = a.depth {
        o.queue_depth = d;
    }
    if let Some(dir) = &a.runtime_dir {
        o.runtime_dir = dir.clone();
    }
    o
}

#[cfg(feature = "ublk")]
fn serve_ublk(a: &Args, dev: Arc<dyn BlockDev>, signals: &libc::sigset_t) -> Res<()> {
    use nvpool_initiator::frontend::ublk::UblkDevice;
    let device = UblkDevice::start(dev, ublk_options(a))?;
    say(&format!("DEVICE {}", device.path().display()));
    let sig = wait_for_signal(signals);
    eprintln!(
        "serve_blockdev: signal {sig}: stopping {}",
        device.path().display()
    );
    device.stop()?;
    Ok(())
}

#[cfg(not(feature = "ublk"))]
fn serve_ublk(_: &Args, _: Arc<dyn BlockDev>, _: &libc::sigset_t) -> Res<()> {
    Err("built without the ublk feature".into())
}

#[cfg(feature = "ublk")]
fn cleanup(a: &Args) -> Res<()> {
    use nvpool_initiator::frontend::ublk;
    let dir = a
        .runtime_dir
        .clone()
        .unwrap_or_else(|| ublk::RUNTIME_DIR_DEFAULT.into());
    for id in ublk::cleanup_stale(&dir)? {
        say(&format!("DELETED {id}"));
    }
    Ok(())
}

#[cfg(not(feature = "ublk"))]
fn cleanup(_: &Args) -> Res<()> {
    Err("built without the ublk feature".into())
}

/// The kernel nbd driver on a socket pair (netlink NBD_CMD_CONNECT). At a
/// signal: write back the kernel's cache and flush through the device,
/// disconnect, flush the volume.
fn serve_nbd(_: &Args, dev: Arc<dyn BlockDev>, signals: &libc::sigset_t) -> Res<()> {
    use nvpool_initiator::frontend::nbd::kernel::{KernelNbd, KernelOptions};
    use nvpool_initiator::frontend::nbd::{NbdOptions, NbdServer};
    let server = NbdServer::without_listeners(dev.clone(), &NbdOptions::default())?;
    let nbd = KernelNbd::attach(server, &KernelOptions::default())?;
    let path = nbd.device_path();
    say(&format!("DEVICE {}", path.display()));
    let sig = wait_for_signal(signals);
    eprintln!("serve_blockdev: signal {sig}: stopping {}", path.display());
    // fsync of the block device writes back its page cache and sends a flush.
    std::fs::File::open(&path)?.sync_all()?;
    nbd.detach()?;
    block_on(dev.flush())?;
    Ok(())
}

/// Frees an nbd device whose server is gone (what `nbd-client -d` does).
fn nbd_disconnect(path: &std::path::Path) -> Res<()> {
    nvpool_initiator::frontend::nbd::kernel::disconnect_dead(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    say(&format!("DISCONNECTED {}", path.display()));
    Ok(())
}

fn run(a: &Args, signals: &libc::sigset_t) -> Res<()> {
    if a.cleanup {
        return cleanup(a);
    }
    if let Some(path) = &a.nbd_disconnect {
        return nbd_disconnect(path);
    }
    let frontend = a
        .frontend
        .ok_or_else(|| format!("--frontend is required\n{USAGE}"))?;
    let dev = open_blockdev(a)?;
    eprintln!(
        "serve_blockdev: {} bytes, {}-byte blocks, serving through {frontend:?}",
        dev.size(),
        dev.block_size()
    );
    match frontend {
        Frontend::Ublk => serve_ublk(a, dev, signals)?,
        Frontend::Nbd => serve_nbd(a, dev, signals)?,
    }
    say("STOPPED");
    Ok(())
}

fn main() -> ExitCode {
    let signals = block_stop_signals();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,libublk=warn")),
        )
        .init();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("serve_blockdev: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args, &signals) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut msg = e.to_string();
            let mut src = e.source();
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            eprintln!("serve_blockdev: {msg}");
            ExitCode::FAILURE
        }
    }
}
