//! One served volume: the engine over the agent's shared controllers, the
//! copy watcher, the front-end, and their teardown.
//!
//! ```text
//! open ── GET the attachment: plan + copies known to have failed
//!      ├─ Volume::open (controllers shared with every volume of the agent)
//!      ├─ watcher: copy changes and growth, from a thread of its own
//!      ├─ front-end: ublk /dev/ublkbN | kernel nbd /dev/nbdN | FUSE file + /dev/loopN
//!      └─ RUN_DIR/volumes/UUID.json   (what to tear down after a crash)
//! close ── tear the front-end down, flush, hand over what stale copies missed
//! ```

use crate::api::{Frontend, PathOut, VolumeOut, VolumeStatsOut};
use crate::client::{Client, Follower};
use crate::metrics::{Metered, VolumeStats};
use crate::state::{self, Record, Wanted};
use anyhow::{bail, Context};
use nvpool_initiator::follow::{self, AttachmentView, Watcher};
use nvpool_initiator::volume::{Connections, CopyState, Volume, VolumeOptions};
use nvpool_initiator::BlockDev;
use nvpool_rt::lock;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a stop waits for a FUSE teardown refused because the loop
/// device is still mounted (a mount that raced the detach check).
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

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
        Frontend::Nvme => bail!("the agent does not serve kernel NVMe attachments"),
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

/// Where `device` is mounted, from /proc/self/mounts.
pub fn mounted_at(device: &Path) -> Option<String> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    let dev = device.to_string_lossy();
    mounts.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        (f.next()? == dev).then(|| f.next().unwrap_or("?").to_owned())
    })
}

enum Presented {
    Fuse(nvpool_initiator::frontend::fuse::FuseLoop),
    Nbd(nvpool_initiator::frontend::nbd::kernel::KernelNbd),
    #[cfg(feature = "ublk")]
    Ublk(nvpool_initiator::frontend::ublk::UblkDevice),
}

impl Presented {
    fn device(&self) -> PathBuf {
        match self {
            Presented::Fuse(f) => f.device_path().to_path_buf(),
            Presented::Nbd(n) => n.device_path(),
            #[cfg(feature = "ublk")]
            Presented::Ublk(u) => u.path().to_path_buf(),
        }
    }

    fn frontend(&self) -> Frontend {
        match self {
            Presented::Fuse(_) => Frontend::Fuse,
            Presented::Nbd(_) => Frontend::Nbd,
            #[cfg(feature = "ublk")]
            Presented::Ublk(_) => Frontend::Ublk,
        }
    }

    /// The ublk id or nbd index, to ask for again after a restart.
    fn index(&self) -> Option<u32> {
        match self {
            Presented::Fuse(_) => None,
            Presented::Nbd(n) => Some(n.index()),
            #[cfg(feature = "ublk")]
            Presented::Ublk(u) => Some(u.id()),
        }
    }

    /// Shows the volume's new size on the block device.
    fn resize(&self, bytes: u64) -> anyhow::Result<()> {
        match self {
            Presented::Fuse(f) => {
                f.resize().context("growing the loop device")?;
            }
            Presented::Nbd(n) => {
                n.resize().context("growing the nbd device")?;
            }
            #[cfg(feature = "ublk")]
            Presented::Ublk(u) => {
                u.resize(bytes).context("growing the ublk device")?;
            }
        }
        Ok(())
    }

    /// Tears the device down (flushing what the kernel holds).
    fn close(self) -> anyhow::Result<()> {
        match self {
            Presented::Fuse(mut f) => {
                // Teardown refuses while the loop device is mounted.
                let deadline = Instant::now() + STOP_TIMEOUT;
                loop {
                    match f.close() {
                        Ok(()) => return Ok(()),
                        Err(e) if Instant::now() < deadline => {
                            tracing::warn!(error = %e, "teardown refused; retrying");
                            std::thread::sleep(Duration::from_millis(500));
                        }
                        Err(e) => return Err(anyhow::Error::from(e).context("tearing down")),
                    }
                }
            }
            Presented::Nbd(n) => n.detach().context("disconnecting nbd"),
            #[cfg(feature = "ublk")]
            Presented::Ublk(u) => u.stop().context("stopping ublk"),
        }
    }
}

/// A volume the agent serves.
pub struct Served {
    pub wanted: Wanted,
    pub record: Record,
    volume: Arc<Volume>,
    pub stats: Arc<VolumeStats>,
    presented: Arc<Mutex<Option<Presented>>>,
    watcher: Arc<Watcher<Follower>>,
    watch_stop: Arc<AtomicBool>,
    reporter: JoinHandle<()>,
}

impl std::fmt::Debug for Served {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Served")
            .field("record", &self.record)
            .finish_non_exhaustive()
    }
}

/// Whether `e` is the control plane saying the volume is not attached to
/// the host (any more).
pub fn not_attached(e: &anyhow::Error) -> bool {
    e.chain()
        .find_map(|c| c.downcast_ref::<follow::CallError>())
        .and_then(follow::CallError::status)
        == Some(404)
}

/// The control plane of a volume: its endpoint, with the token read now,
/// trusted through `tls` (the agent's `--cacert`).
pub fn control_plane(w: &Wanted, tls: &ureq::tls::TlsConfig) -> anyhow::Result<Follower> {
    let token = match &w.spec.token_file {
        Some(p) => Some(crate::client::read_token(p)?),
        None => None,
    };
    Ok(Follower(Client::with_tls(
        &w.spec.endpoint,
        token,
        tls.clone(),
    )?))
}

/// Serves `w`: opens the volume over `connections`, presents it, writes
/// its record. `w.spec.frontend` must be resolved (not `auto`).
/// `dhchap`: the host's keys, for targets that make it authenticate.
pub fn open(
    w: &Wanted,
    connections: &Arc<Connections>,
    tls: &ureq::tls::TlsConfig,
    dhchap: Option<Arc<nvpool_wire::dhchap::Keys>>,
) -> anyhow::Result<Served> {
    let uuid = w.uuid;
    let host = &w.spec.host_nqn;
    let client = control_plane(w, tls)?;
    let view: AttachmentView = follow::read_attachment(&client, &uuid, host)
        .map_err(|e| anyhow::Error::new(e).context("reading the attachment"))?;
    view.plan
        .validate()
        .map_err(|e| anyhow::anyhow!("unusable connection plan: {e}"))?;
    let name = view.plan.name.clone();

    // Failed copies are reported from a thread of their own: the data
    // path never waits on the control plane.
    let (on_failed, reporter) = follow::spawn_failure_reporter(client.clone(), &uuid, host)
        .context("starting the failure reporter")?;
    let opts = VolumeOptions {
        failed_extents: view.copies.stale_at_open(),
        syncing_extents: view.copies.syncing_at_open(),
        moving: view.copies.moving_at_open(),
        on_extent_failed: Some(on_failed),
        connections: Some(connections.clone()),
        dhchap,
        write_epoch: view.copies.write_epoch,
        write_hold: view.copies.write_hold,
        ..VolumeOptions::default()
    };
    let volume = Arc::new(Volume::open(&view.plan, opts).context("connecting the volume")?);
    let stats = Arc::new(VolumeStats::default());
    let dev: Arc<dyn BlockDev> = Arc::new(Metered {
        dev: volume.clone(),
        stats: stats.clone(),
    });

    let presented = present(w, dev, view.read_only)?;
    let record = Record {
        uuid,
        name: name.clone(),
        host_nqn: host.clone(),
        pid: std::process::id(),
        frontend: presented.frontend(),
        device: presented.device(),
        mountpoint: match &presented {
            Presented::Fuse(f) => Some(f.mount().mountpoint().to_path_buf()),
            _ => None,
        },
        ublk_id: match &presented {
            #[cfg(feature = "ublk")]
            Presented::Ublk(u) => Some(u.id()),
            _ => None,
        },
        nbd_pid: match &presented {
            Presented::Nbd(n) => {
                nvpool_initiator::frontend::nbd::kernel::configured_by(&n.device_path())
            }
            _ => None,
        },
        started_ms: state::now_ms(),
    };
    let mut wanted = w.clone();
    wanted.name = name;
    wanted.index = presented.index();
    let presented = Arc::new(Mutex::new(Some(presented)));
    if let Err(e) = state::write_record(&record) {
        if let Some(p) = take(&presented) {
            let _ = p.close();
        }
        return Err(e);
    }

    // Copy changes and growth are followed from a thread of its own.
    let watch_stop = Arc::new(AtomicBool::new(false));
    let grown = grow_hook(Arc::downgrade(&presented), &record.device);
    let watcher = Arc::new(
        Watcher::new(
            client,
            &uuid,
            host,
            volume.clone(),
            follow::new_session(),
            watch_stop.clone(),
        )
        .on_grown(grown),
    );
    watcher.register(view.copies.revision);
    if let Err(e) = watcher.spawn(view.copies) {
        watch_stop.store(true, Ordering::Relaxed);
        if let Some(p) = take(&presented) {
            let _ = p.close();
        }
        state::remove_record(&uuid);
        return Err(anyhow::Error::from(e).context("starting the copy watcher"));
    }
    tracing::info!(volume = %record.name, device = %record.device.display(), "serving");
    Ok(Served {
        wanted,
        record,
        volume,
        stats,
        presented,
        watcher,
        watch_stop,
        reporter,
    })
}

fn take(p: &Mutex<Option<Presented>>) -> Option<Presented> {
    lock(p).take()
}

/// What the watcher calls once the engine took a bigger plan: the block
/// device grows too (where the front-end and kernel allow).
fn grow_hook(
    presented: Weak<Mutex<Option<Presented>>>,
    device: &Path,
) -> Box<dyn Fn(u64) + Send + Sync> {
    let device = device.to_path_buf();
    Box::new(move |bytes| {
        let Some(p) = presented.upgrade() else {
            return;
        };
        let p = lock(&p);
        if let Some(p) = p.as_ref() {
            match p.resize(bytes) {
                Ok(()) => tracing::info!(device = %device.display(), bytes, "device grown"),
                Err(e) => {
                    tracing::warn!(device = %device.display(), bytes, error = %format!("{e:#}"),
                    "the volume grew but its device keeps its size until it is attached again")
                }
            }
        }
    })
}

/// Presents `dev` with `w`'s front-end; `read_only` (a read-only volume,
/// whose targets refuse writes): as a read-only block device, so the
/// host's writes fail there (EROFS or EPERM) before any reaches a target.
fn present(w: &Wanted, dev: Arc<dyn BlockDev>, read_only: bool) -> anyhow::Result<Presented> {
    let run = state::run_dir();
    Ok(match w.spec.frontend {
        Frontend::Ublk => {
            #[cfg(feature = "ublk")]
            {
                use nvpool_initiator::frontend::ublk::{UblkDevice, UblkOptions};
                let o = UblkOptions {
                    runtime_dir: run.join("ublk"),
                    id: w.index,
                    read_only,
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
            let attach = |index| {
                let nbd = NbdOptions {
                    read_only,
                    ..NbdOptions::default()
                };
                let server =
                    NbdServer::without_listeners(dev.clone(), &nbd).context("NBD server")?;
                let o = KernelOptions {
                    index,
                    ..KernelOptions::default()
                };
                KernelNbd::attach(server, &o).context("handing the volume to the kernel nbd driver")
            };
            // The former index may be taken by now: any free one then.
            match attach(w.index) {
                Ok(n) => Presented::Nbd(n),
                Err(e) if w.index.is_some() => {
                    tracing::info!(error = %format!("{e:#}"), "the volume's former nbd device is taken");
                    Presented::Nbd(attach(None)?)
                }
                Err(e) => return Err(e),
            }
        }
        Frontend::Fuse => {
            use nvpool_initiator::frontend::fuse::{FuseLoop, FuseOptions};
            let mp = run.join("fuse").join(w.uuid.to_string());
            std::fs::create_dir_all(&mp).with_context(|| format!("creating {}", mp.display()))?;
            let o = FuseOptions {
                read_only,
                ..FuseOptions::default()
            };
            Presented::Fuse(FuseLoop::attach(dev, &mp, &o).context("FUSE file and loop device")?)
        }
        Frontend::Auto | Frontend::Nvme => {
            bail!("front-end {:?} is not served here", w.spec.frontend)
        }
    })
}

impl Served {
    pub fn uuid(&self) -> nvpool_layout::Uuid {
        self.record.uuid
    }

    fn state(&self) -> &'static str {
        let h = self.volume.health();
        if !h.lost.is_empty() {
            "lost"
        } else if h.is_degraded() {
            "degraded"
        } else {
            "serving"
        }
    }

    pub fn out(&self) -> VolumeOut {
        VolumeOut {
            uuid: self.record.uuid,
            name: self.record.name.clone(),
            host_nqn: self.record.host_nqn.clone(),
            frontend: self.record.frontend,
            device: Some(self.record.device.clone()),
            size_bytes: self.volume.size(),
            state: self.state().into(),
            error: None,
            pid: self.record.pid,
        }
    }

    pub fn stats_out(&self) -> VolumeStatsOut {
        let mut out = VolumeStatsOut::new(self.record.uuid, self.record.name.clone(), self.state());
        out.device = Some(self.record.device.clone());
        out.size_bytes = self.volume.size();
        self.stats.fill(&mut out);
        // Copies the volume does not read, per target address.
        let plan = self.volume.plan();
        let mut stale = std::collections::BTreeMap::<String, u32>::new();
        for (i, e) in plan.extents.iter().enumerate() {
            if self.volume.copy_state(i) != CopyState::Ok {
                *stale.entry(e.addr.to_string()).or_default() += 1;
            }
        }
        for c in self.volume.controllers() {
            let ctrl = c.controller();
            let addr = ctrl.addr().to_string();
            out.paths.push(PathOut {
                stale_copies: stale.get(&addr).copied().unwrap_or(0),
                addr,
                transport: if ctrl.params.transport.is_tcp() {
                    "tcp"
                } else {
                    "rdma"
                }
                .into(),
                state: if c.is_lost() { "lost" } else { "live" }.into(),
                in_flight: c.in_flight() as u64,
            });
        }
        out
    }

    /// Stops serving: tears the device down (the caller checked that it
    /// is not mounted, unless forced), flushes, hands over what stale
    /// copies missed, removes the record. A device that cannot be torn
    /// down keeps its record, for the next start to clear.
    pub fn close(self) -> anyhow::Result<()> {
        if let Some(p) = take(&self.presented) {
            p.close()?;
        }
        self.watch_stop.store(true, Ordering::Relaxed);
        let flushed = nvpool_initiator::device::block_on(self.volume.flush());
        // No more writes: what stale copies missed is final.
        self.watcher.hand_over();
        let uuid = self.record.uuid;
        drop(self.watcher);
        let closed = match Arc::try_unwrap(self.volume) {
            Ok(v) => v.close(),
            // The watcher thread still holds it for a moment: flushed above.
            Err(_) => Ok(()),
        };
        drop(self.reporter);
        state::remove_record(&uuid);
        flushed.context("flushing the volume")?;
        closed.context("flushing the volume")?;
        tracing::info!(volume = %uuid, "stopped cleanly");
        Ok(())
    }
}

/// Removes what a dead agent left for a volume: the loop device and the
/// dead FUSE mount, the ublk device or the nbd connection; then the record.
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
        // Requests sent on the dead agent's socket would wait for the
        // kernel's dead-connection timeout; disconnecting frees the device
        // now. Only if it is still the one that agent set up (the kernel
        // may have released it and handed the index to someone else): the
        // kernel shows the configuring thread, which is not the agent's
        // main one.
        Frontend::Nbd => {
            use nvpool_initiator::frontend::nbd::kernel;
            let by = kernel::configured_by(&r.device);
            if by.is_some() && by == r.nbd_pid {
                if let Err(e) = kernel::disconnect_dead(&r.device) {
                    tracing::warn!(device = %r.device.display(), error = %e,
                        "disconnecting the dead agent's nbd device failed");
                }
            }
        }
        Frontend::Auto | Frontend::Nvme => {}
    }
    state::remove_record(&r.uuid);
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
