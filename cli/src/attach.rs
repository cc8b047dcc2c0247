//! The host side of `nvpool volume attach` and `detach`: a background
//! process per attached volume that connects to its targets (the volume
//! engine) and presents it as a block device through a front-end, like
//! `rbd map`.
//!
//! ```text
//! nvpool volume attach NAME
//!   ├─ PUT attachment on the control plane (targets export the extents)
//!   ├─ spawn `nvpool volume serve UUID …` (own session; log in RUN_DIR)
//!   │     ├─ GET the attachment: plan + copies known to have failed
//!   │     ├─ Volume::open (one controller per target)
//!   │     ├─ front-end: ublk /dev/ublkbN | kernel nbd /dev/nbdN | FUSE file + /dev/loopN
//!   │     ├─ RUN_DIR/volumes/UUID.json   (what to tear down, pid)
//!   │     ├─ "READY /dev/…" on stdout, then stdout goes quiet
//!   │     └─ serve until SIGTERM: flush, tear down, remove the record
//!   └─ print the device
//! nvpool volume detach NAME
//!   ├─ refuse while the device is mounted (unless --force)
//!   ├─ SIGTERM the server and wait; a server that died (kill -9) leaves
//!   │  a loop device, a dead FUSE mount or a ublk device: removed here
//!   └─ DELETE the attachment on the control plane
//! ```

use crate::client::Client;
use anyhow::{bail, Context};
use nvpool_control::Uuid;
use nvpool_initiator::follow::{self, AttachmentView, Watcher};
use nvpool_initiator::volume::{Volume, VolumeOptions};
use nvpool_initiator::BlockDev;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long `attach` waits for the server to present the device.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How long `detach` waits for the server to flush and exit.
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// Block-device front-ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Frontend {
    /// The best this host supports: ublk, else kernel nbd, else FUSE + loop.
    Auto,
    /// Linux ublk (6.0+, module ublk_drv): /dev/ublkbN.
    Ublk,
    /// The kernel nbd driver (module nbd), fed by our NBD server: /dev/nbdN.
    Nbd,
    /// A file in a FUSE mount behind a loop device (direct I/O): /dev/loopN.
    Fuse,
    /// Served by targets, connected by this host's kernel NVMe/TCP driver
    /// with native multipath (module nvme-tcp): /dev/nvmeXnY. No nvpool
    /// process stays on the host.
    Nvme,
}

/// Where records, logs and mountpoints of attached volumes live:
/// `NVPOOL_RUN_DIR`, else /run/nvpool for root, else a per-user directory.
pub fn run_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("NVPOOL_RUN_DIR") {
        return PathBuf::from(d);
    }
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    if uid == 0 {
        return PathBuf::from("/run/nvpool");
    }
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) => PathBuf::from(d).join("nvpool"),
        None => std::env::temp_dir().join(format!("nvpool-{uid}")),
    }
}

/// What a serving process leaves behind, for `detach`, `ls` and cleanup.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub uuid: Uuid,
    pub name: String,
    pub host_nqn: String,
    pub pid: u32,
    pub frontend: Frontend,
    /// The block device.
    pub device: PathBuf,
    /// FUSE: the mountpoint holding the volume file.
    pub mountpoint: Option<PathBuf>,
    /// ublk: the device id.
    pub ublk_id: Option<u32>,
    pub log: PathBuf,
    pub started_ms: u64,
}

fn record_path(uuid: &Uuid) -> PathBuf {
    run_dir().join("volumes").join(format!("{uuid}.json"))
}

fn log_path(uuid: &Uuid) -> PathBuf {
    run_dir().join("volumes").join(format!("{uuid}.log"))
}

/// The local record of a volume, if this host serves it.
pub fn record(uuid: &Uuid) -> Option<Record> {
    let bytes = std::fs::read(record_path(uuid)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Every local record.
pub fn records() -> Vec<Record> {
    let Ok(dir) = std::fs::read_dir(run_dir().join("volumes")) else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| serde_json::from_slice(&std::fs::read(e.path()).ok()?).ok())
        .collect()
}

fn write_record(r: &Record) -> anyhow::Result<()> {
    let path = record_path(&r.uuid);
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(r)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Whether process `pid` exists.
fn alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks for existence.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Where `device` is mounted, from /proc/self/mounts.
pub fn mounted_at(device: &Path) -> Option<String> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    let dev = device.to_string_lossy();
    mounts.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        (f.next()? == dev).then(|| f.next().unwrap_or("?").to_owned())
    })
}

/// Resolves `auto` and checks that the chosen front-end can work here.
pub fn frontend_choice(f: Frontend) -> anyhow::Result<Frontend> {
    use nvpool_initiator::frontend::nbd::kernel as nbd;
    match f {
        Frontend::Auto => Ok(if ublk_available().is_ok() {
            Frontend::Ublk
        } else if nbd::available() {
            Frontend::Nbd
        } else {
            Frontend::Fuse
        }),
        Frontend::Nbd => {
            if !nbd::available() {
                bail!("the kernel nbd driver is not loaded (modprobe nbd)");
            }
            Ok(Frontend::Nbd)
        }
        Frontend::Ublk => {
            ublk_available().map_err(|why| anyhow::anyhow!("ublk is not available: {why}"))?;
            Ok(Frontend::Ublk)
        }
        Frontend::Fuse => Ok(Frontend::Fuse),
        Frontend::Nvme => {
            crate::nvmef::available()?;
            Ok(Frontend::Nvme)
        }
    }
}

#[cfg(feature = "ublk")]
fn ublk_available() -> Result<(), String> {
    nvpool_initiator::frontend::ublk::available()
}

#[cfg(not(feature = "ublk"))]
fn ublk_available() -> Result<(), String> {
    Err("this nvpool was built without the ublk feature".into())
}

/// What `attach` reports.
#[derive(Debug, Clone, Serialize)]
pub struct Attached {
    pub device: PathBuf,
    pub frontend: Frontend,
    pub pid: u32,
    /// False when the volume was already attached here.
    pub started: bool,
}

/// Starts (or finds) the serving process of `uuid` and returns its device.
/// `created` says whether the attachment on the control plane was new, so
/// a failure here can take it back.
pub fn start_server(
    endpoint: &str,
    token_file: Option<&Path>,
    uuid: &Uuid,
    host: &str,
    frontend: Frontend,
    progress: bool,
) -> anyhow::Result<Attached> {
    if let Some(r) = record(uuid) {
        if alive(r.pid) {
            return Ok(Attached {
                device: r.device,
                frontend: r.frontend,
                pid: r.pid,
                started: false,
            });
        }
        // Its server died: clear what it left before starting anew.
        cleanup_leftovers(&r);
    }
    let frontend = frontend_choice(frontend)?;
    let dir = run_dir().join("volumes");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let log = log_path(uuid);
    let log_file =
        std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let exe = std::env::current_exe().context("locating the nvpool executable")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("--endpoint").arg(endpoint);
    if let Some(t) = token_file {
        cmd.arg("--token-file").arg(t);
    }
    cmd.args(["volume", "serve", &uuid.to_string(), "--host-nqn", host])
        .arg("--frontend")
        .arg(match frontend {
            Frontend::Ublk => "ublk",
            Frontend::Nbd => "nbd",
            _ => "fuse",
        })
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(log_file);
    // SAFETY: setsid is async-signal-safe and touches nothing of the
    // parent; it detaches the server from the caller's terminal and
    // process group, so the caller's Ctrl-C does not reach it.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    if progress {
        eprintln!("starting the {} front-end…", frontend_name(frontend));
    }
    let mut child = cmd.spawn().context("starting the volume server")?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(READY_TIMEOUT).unwrap_or_default();
    if let Some(dev) = line.trim().strip_prefix("READY ") {
        return Ok(Attached {
            device: PathBuf::from(dev),
            frontend,
            pid: child.id(),
            started: true,
        });
    }
    // It failed (or hung): stop it and say why, from its log.
    let _ = child.kill();
    let _ = child.wait();
    let why = line
        .trim()
        .strip_prefix("ERROR ")
        .map(str::to_owned)
        .unwrap_or_else(|| {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            text.lines()
                .last()
                .unwrap_or("no output; the server did not start")
                .to_owned()
        });
    bail!("the volume server failed: {why} (log: {})", log.display())
}

fn frontend_name(f: Frontend) -> &'static str {
    match f {
        Frontend::Auto => "auto",
        Frontend::Ublk => "ublk",
        Frontend::Nbd => "kernel nbd",
        Frontend::Fuse => "FUSE + loop",
        Frontend::Nvme => "kernel NVMe/TCP",
    }
}

/// Stops the local server of `uuid` (flushing) and clears anything a dead
/// one left. Refuses while the device is mounted unless `force`. Returns
/// the record that was stopped, if there was one.
pub fn stop_server(uuid: &Uuid, force: bool) -> anyhow::Result<Option<Record>> {
    let Some(r) = record(uuid) else {
        return Ok(None);
    };
    if let Some(at) = mounted_at(&r.device) {
        if !force {
            bail!(
                "{} is mounted at {at}; unmount it first (or detach --force)",
                r.device.display()
            );
        }
    }
    if alive(r.pid) {
        // SAFETY: sending SIGTERM to a pid has no memory-safety effects.
        unsafe { libc::kill(r.pid as i32, libc::SIGTERM) };
        let deadline = Instant::now() + STOP_TIMEOUT;
        while alive(r.pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            // A zombie child of ours would never go: reap if it is one.
            // SAFETY: waitpid with WNOHANG on a pid only reaps our child.
            unsafe { libc::waitpid(r.pid as i32, std::ptr::null_mut(), libc::WNOHANG) };
        }
        if alive(r.pid) {
            bail!(
                "the volume server (pid {}) did not stop within {:?}; see {}",
                r.pid,
                STOP_TIMEOUT,
                r.log.display()
            );
        }
    }
    // A clean stop removed everything; after kill -9 this clears the rest.
    cleanup_leftovers(&r);
    Ok(Some(r))
}

/// Removes what a dead server left: the loop device and the dead FUSE
/// mount, or the ublk device; then the record.
pub fn cleanup_leftovers(r: &Record) {
    match r.frontend {
        Frontend::Fuse => {
            if r.device.exists() && loop_backed_by(&r.device, r.mountpoint.as_deref()) {
                detach_loop(&r.device);
            }
            if let Some(mp) = &r.mountpoint {
                let c = std::ffi::CString::new(mp.as_os_str().as_encoded_bytes());
                if let Ok(c) = c {
                    // SAFETY: umount2 takes a valid C string; MNT_DETACH
                    // also succeeds on a FUSE mount whose server died.
                    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
                }
                let _ = std::fs::remove_dir(mp);
            }
        }
        Frontend::Ublk =>
        {
            #[cfg(feature = "ublk")]
            if let Some(id) = r.ublk_id {
                if let Err(e) = nvpool_initiator::frontend::ublk::delete_device(id) {
                    tracing::warn!(id, error = %e, "removing the ublk device failed");
                }
            }
        }
        // Requests sent on the dead server's socket would wait for the
        // kernel's dead-connection timeout; disconnecting frees the device
        // now. Only if it is still the one that server set up (the kernel
        // may have released it and handed the index to someone else).
        Frontend::Nbd => {
            use nvpool_initiator::frontend::nbd::kernel;
            if kernel::configured_by(&r.device) == Some(r.pid) {
                if let Err(e) = kernel::disconnect_dead(&r.device) {
                    tracing::warn!(device = %r.device.display(), error = %e,
                        "disconnecting the dead server's nbd device failed");
                }
            }
        }
        Frontend::Auto | Frontend::Nvme => {}
    }
    let _ = std::fs::remove_file(record_path(&r.uuid));
}

/// Whether loop device `dev` is bound to a file under `mountpoint` (so we
/// never detach a loop device someone else reused).
fn loop_backed_by(dev: &Path, mountpoint: Option<&Path>) -> bool {
    let (Some(name), Some(mp)) = (dev.file_name(), mountpoint) else {
        return false;
    };
    let f = Path::new("/sys/block")
        .join(name)
        .join("loop")
        .join("backing_file");
    std::fs::read_to_string(f).is_ok_and(|b| Path::new(b.trim()).starts_with(mp))
}

fn detach_loop(dev: &Path) {
    const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
    let Ok(f) = std::fs::OpenOptions::new().read(true).open(dev) else {
        return;
    };
    use std::os::fd::AsRawFd;
    // SAFETY: LOOP_CLR_FD takes no argument; the descriptor is open.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), LOOP_CLR_FD as _, 0) };
    if rc != 0 {
        tracing::warn!(device = %dev.display(), error = %std::io::Error::last_os_error(),
            "detaching the loop device failed");
    }
}

/// `nvpool volume serve`: the server process (started by attach).
pub fn serve(client: &Client, uuid: &Uuid, host: &str, frontend: Frontend) -> anyhow::Result<()> {
    match serve_inner(client, uuid, host, frontend) {
        Ok(()) => Ok(()),
        Err(e) => {
            // Attach reads this line; our stdout may already be gone.
            let mut out = std::io::stdout();
            let _ = writeln!(out, "ERROR {}", format!("{e:#}").replace('\n', " "));
            let _ = out.flush();
            Err(e)
        }
    }
}

enum Presented {
    Fuse(nvpool_initiator::frontend::fuse::FuseLoop),
    Nbd(nvpool_initiator::frontend::nbd::kernel::KernelNbd),
    #[cfg(feature = "ublk")]
    Ublk(nvpool_initiator::frontend::ublk::UblkDevice),
}

fn serve_inner(client: &Client, uuid: &Uuid, host: &str, frontend: Frontend) -> anyhow::Result<()> {
    let path = follow::attachment_path(uuid, host);
    let view: serde_json::Value = client.get(&path)?;
    let view: AttachmentView =
        serde_json::from_value(view).context("the control plane's attachment")?;
    view.plan
        .validate()
        .map_err(|e| anyhow::anyhow!("unusable connection plan: {e}"))?;
    let name = view.plan.name.clone();

    // Failed copies are reported to the control plane from a thread of
    // their own: the data path never waits on it.
    let (on_failed, reporter) = follow::spawn_failure_reporter(client.clone(), uuid, host)
        .context("starting the failure reporter")?;
    let opts = VolumeOptions {
        failed_extents: view.copies.stale_at_open(),
        syncing_extents: view.copies.syncing_at_open(),
        moving: view.copies.moving_at_open(),
        on_extent_failed: Some(on_failed),
        ..VolumeOptions::default()
    };
    let volume = Arc::new(Volume::open(&view.plan, opts).context("connecting the volume")?);
    let dev: Arc<dyn BlockDev> = volume.clone();

    // Copy changes (resync) are followed from a thread of their own.
    let watch_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = Arc::new(Watcher::new(
        client.clone(),
        uuid,
        host,
        volume.clone(),
        follow::new_session(),
        watch_stop.clone(),
    ));
    watcher.register(view.copies.revision);
    watcher
        .spawn(view.copies.clone())
        .context("starting the copy watcher")?;

    let run = run_dir();
    let presented = match frontend {
        Frontend::Ublk => {
            #[cfg(feature = "ublk")]
            {
                use nvpool_initiator::frontend::ublk::{UblkDevice, UblkOptions};
                let o = UblkOptions {
                    runtime_dir: run.join("ublk"),
                    ..UblkOptions::default()
                };
                Presented::Ublk(UblkDevice::start(dev, o).context("starting ublk")?)
            }
            #[cfg(not(feature = "ublk"))]
            bail!("this nvpool was built without the ublk feature")
        }
        Frontend::Nbd => {
            use nvpool_initiator::frontend::nbd::kernel::{KernelNbd, KernelOptions};
            use nvpool_initiator::frontend::nbd::{NbdOptions, NbdServer};
            let server =
                NbdServer::without_listeners(dev, &NbdOptions::default()).context("NBD server")?;
            Presented::Nbd(
                KernelNbd::attach(server, &KernelOptions::default())
                    .context("handing the volume to the kernel nbd driver")?,
            )
        }
        _ => {
            use nvpool_initiator::frontend::fuse::{FuseLoop, FuseOptions};
            let mp = run.join("fuse").join(uuid.to_string());
            std::fs::create_dir_all(&mp).with_context(|| format!("creating {}", mp.display()))?;
            Presented::Fuse(
                FuseLoop::attach(dev, &mp, &FuseOptions::default())
                    .context("FUSE file and loop device")?,
            )
        }
    };
    let (device, mountpoint, ublk_id) = match &presented {
        Presented::Fuse(f) => (
            f.device_path().to_path_buf(),
            Some(f.mount().mountpoint().to_path_buf()),
            None,
        ),
        Presented::Nbd(n) => (n.device_path(), None, None),
        #[cfg(feature = "ublk")]
        Presented::Ublk(u) => (u.path().to_path_buf(), None, Some(u.id())),
    };
    let record = Record {
        uuid: *uuid,
        name,
        host_nqn: host.to_owned(),
        pid: std::process::id(),
        frontend: match presented {
            Presented::Fuse(_) => Frontend::Fuse,
            Presented::Nbd(_) => Frontend::Nbd,
            #[cfg(feature = "ublk")]
            Presented::Ublk(_) => Frontend::Ublk,
        },
        device: device.clone(),
        mountpoint,
        ublk_id,
        log: log_path(uuid),
        started_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
    };
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
    ])
    .context("signal handlers")?;
    write_record(&record)?;
    {
        let mut out = std::io::stdout();
        writeln!(out, "READY {}", device.display())?;
        out.flush()?;
    }
    quiet_stdout();
    tracing::info!(device = %device.display(), "serving");
    let sig = signals.forever().next();
    tracing::info!(?sig, "stopping");
    let mut failure = None;
    match presented {
        Presented::Fuse(mut f) => {
            // Teardown refuses while the loop device is mounted; the
            // detach command checked, but a mount may have raced it.
            let deadline = Instant::now() + STOP_TIMEOUT;
            loop {
                match f.close() {
                    Ok(()) => break,
                    Err(e) if Instant::now() < deadline => {
                        tracing::warn!(error = %e, "teardown refused; retrying");
                        std::thread::sleep(Duration::from_millis(500));
                    }
                    Err(e) => {
                        failure = Some(anyhow::Error::from(e).context("tearing down"));
                        break;
                    }
                }
            }
        }
        Presented::Nbd(n) => {
            if let Err(e) = n.detach() {
                failure = Some(anyhow::Error::from(e).context("disconnecting nbd"));
            }
        }
        #[cfg(feature = "ublk")]
        Presented::Ublk(u) => {
            if let Err(e) = u.stop() {
                failure = Some(anyhow::Error::from(e).context("stopping ublk"));
            }
        }
    }
    if let Some(e) = failure {
        return Err(e);
    }
    watch_stop.store(true, std::sync::atomic::Ordering::Relaxed);
    nvpool_initiator::device::block_on(volume.flush()).context("flushing the volume")?;
    // No more writes: what stale copies missed is final.
    watcher.hand_over();
    drop(watcher);
    match Arc::try_unwrap(volume) {
        Ok(v) => v.close().context("flushing the volume")?,
        Err(v) => {
            nvpool_initiator::device::block_on(v.flush()).context("flushing the volume")?;
        }
    }
    let _ = std::fs::remove_file(record_path(uuid));
    drop(reporter);
    tracing::info!("stopped cleanly");
    Ok(())
}

/// Points stdout at /dev/null: attach has read the one line it waits for
/// and gone, so later writes must not hit a closed pipe.
fn quiet_stdout() {
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        use std::os::fd::AsRawFd;
        // SAFETY: dup2 onto fd 1 with a valid descriptor.
        unsafe { libc::dup2(null.as_raw_fd(), 1) };
    }
}
