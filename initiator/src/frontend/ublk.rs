//! The ublk front-end: a [`BlockDev`] served as `/dev/ublkbN` by the
//! kernel's ublk driver (Linux 6.0 or later, module `ublk_drv`), with
//! `libublk` issuing the control commands and the per-queue io_uring
//! commands.
//!
//! ```text
//!   ext4 / fio ── /dev/ublkbN ── blk-mq: Q hardware queues × D tags
//!                                   │ FETCH / COMMIT_AND_FETCH (io_uring commands)
//!   queue thread q (pinned to q's CPUs) ── its io_uring ◄── eventfd poll
//!     │ one task per tag: request → BlockDev future → commit result    ▲
//!     ▼                                                               │ wake
//!   Arc<dyn BlockDev> ── Device / Volume I/O threads ─────────────────┘
//! ```
//!
//! Each queue thread runs its tag tasks as the executor's [`LocalTasks`]
//! and otherwise sleeps in `io_uring_enter`. A tag's I/O completes on
//! another thread (the device's queue workers); its waker puts the tag on
//! the ready list and, if the queue thread is asleep, writes an eventfd
//! that the queue's ring polls, so the thread wakes without waiting for the
//! next ublk command completion. So every tag can have an I/O in flight.
//!
//! Each tag owns one buffer of `max_io` bytes that the kernel copies write
//! data into and read data out of; the same `Vec` moves into the
//! [`BlockDev`] call and comes back, so nothing is copied in userspace.
//!
//! Lifecycle. [`UblkDevice::start`] adds the device, records it under the
//! runtime directory (`/run/nvpool/ublk/<id>`: owner pid and start time),
//! starts the queue threads and returns once the block device exists.
//! [`UblkDevice::stop`] sends STOP_DEV: the kernel writes back what a
//! filesystem still holds (through us), completes the in-flight requests and
//! aborts the idle commands; the queue threads then exit, the device is
//! flushed and deleted (DEL_DEV_ASYNC, so a still-mounted filesystem cannot
//! block it) and the record removed.
//!
//! A serving process that dies (kill -9). The device is created without
//! `UBLK_F_USER_RECOVERY`: when the process's io_uring goes away the kernel
//! fails the requests the dead server held with EIO and removes
//! `/dev/ublkbN` by itself (ublk's stop work); nothing waits for a server
//! that is not coming back. What remains is the control side
//! (`/dev/ublkcN`, state DEAD, its device number): [`cleanup_stale`] deletes
//! every recorded device whose owner is gone, and [`UblkDevice::start`]
//! runs it first, so restarting the initiator cleans up without a reboot
//! (`nvpool volume detach` can call it, or [`delete_device`] for one id).
//! With USER_RECOVERY the kernel would instead queue I/O until a new server
//! recovers the device — no data loss across an initiator restart, but a
//! dead initiator would hang every I/O until someone acts; not chosen yet.
//!
//! Growing. Requests are served up to the [`BlockDev`]'s size when they
//! arrive, so a device that grew (a volume grown online) serves its new
//! bytes at once; [`UblkDevice::resize`] tells the kernel with
//! `UBLK_U_CMD_UPDATE_SIZE` (`_IOWR('u', 0x15, struct ublksrv_ctrl_cmd)`,
//! data[0] = 512-byte sectors), which drivers that report
//! `UBLK_F_UPDATE_SIZE` (bit 10) in GET_FEATURES handle: Linux 6.16 and
//! later. Older drivers do not know the command, and `resize` says so
//! without sending it: the device must be detached and attached again.
//!
//! Known gap: if a queue thread fails to set up (no memory for its ring),
//! START_DEV waits for it forever and [`UblkDevice::start`] does not return.

use super::errno;
use crate::blockdev::BlockDev;
use crate::error::IoError;
use crate::exec::{block_on, LocalTasks};
use crate::limits::{UBLK_DISCARD_BYTES_MAX, UBLK_IO_BYTES_MAX, UBLK_QUEUE_DEPTH_DEFAULT};
use io_uring::{opcode, types};
use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::{with_task_io_ring_mut, UblkDev, UblkQueue};
use libublk::uring_async::{ublk_reap_io_events_with_update_queue, ublk_wake_task};
use libublk::{sys, BufDesc, UblkError, UblkFlags, UblkUringData};
use nvpool_rt::Wakeup;
use std::cell::Cell;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

/// Where the devices this program created are recorded (see
/// [`cleanup_stale`]); tmpfs, so a reboot forgets them with the devices.
pub const RUNTIME_DIR_DEFAULT: &str = "/run/nvpool/ublk";
/// Oldest kernel with the ublk driver.
const KERNEL_MIN: (u32, u32) = (6, 0);
const CONTROL_PATH: &str = "/dev/ublk-control";
/// Submission entries of a queue's ring beyond one per tag: the eventfd poll.
const RING_EXTRA_SQES: u16 = 2;
/// user_data of the eventfd poll. The Target bit makes libublk count it as
/// target I/O, not as a ublk command; it never reaches libublk's wake table.
const KICK_USER_DATA: u64 =
    UblkUringData::Target as u64 | UblkUringData::NonAsync as u64 | 0x6b69_636b;
/// ublk counts in 512-byte sectors whatever the block size.
const SECTOR_SHIFT: u32 = 9;

const _: () = assert!(UBLK_QUEUE_DEPTH_DEFAULT as u32 <= sys::UBLK_MAX_QUEUE_DEPTH);

/// Why the ublk front-end failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("ublk is not available: {0}")]
    Unavailable(String),
    #[error("invalid ublk setup: {0}")]
    Invalid(String),
    /// A ublk control or queue operation failed.
    #[error("ublk: {what} failed: {detail}")]
    Ublk { what: &'static str, detail: String },
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("the ublk device stopped before it started")]
    Stopped,
    #[error("the ublk serving thread panicked")]
    Panicked,
    #[error("flush when stopping the ublk device failed: {0}")]
    Flush(IoError),
    /// The driver lacks `UBLK_F_UPDATE_SIZE` (see the module docs).
    #[error(
        "this kernel's ublk cannot resize a live device (needs UBLK_F_UPDATE_SIZE, Linux \
         6.16+); detach and attach again"
    )]
    ResizeUnsupported,
}

impl Error {
    fn ublk(what: &'static str, e: UblkError) -> Error {
        let detail = match e {
            UblkError::OtherError(n) | UblkError::UringIOError(n) => {
                io::Error::from_raw_os_error(-n).to_string()
            }
            UblkError::IOError(e) => e.to_string(),
            e => e.to_string(),
        };
        Error::Ublk { what, detail }
    }
}

/// How to present the device.
#[derive(Debug, Clone)]
pub struct UblkOptions {
    /// Hardware queues, each served by its own thread; `None`: one per CPU.
    pub queues: Option<u16>,
    /// Tags (requests in flight) per queue.
    pub queue_depth: u16,
    /// Where created devices are recorded for [`cleanup_stale`].
    pub runtime_dir: PathBuf,
    /// The device id to ask for (`/dev/ublkbN`: the name the device had
    /// before a restart); a taken one gets the next free id instead.
    pub id: Option<u32>,
    /// A read-only disk (`UBLK_ATTR_READ_ONLY`): the kernel refuses to
    /// open it for writing and fails writes with EPERM, as for any
    /// read-only block device.
    pub read_only: bool,
}

impl Default for UblkOptions {
    fn default() -> UblkOptions {
        UblkOptions {
            queues: None,
            queue_depth: UBLK_QUEUE_DEPTH_DEFAULT,
            runtime_dir: PathBuf::from(RUNTIME_DIR_DEFAULT),
            id: None,
            read_only: false,
        }
    }
}

/// Whether this host can serve ublk devices: Linux 6.0 or later and an
/// openable `/dev/ublk-control`. The error says what is missing.
pub fn available() -> Result<(), String> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_err(|e| format!("cannot read the kernel version: {e}"))?;
    let (major, minor) = parse_kernel_version(&release)
        .ok_or_else(|| format!("cannot parse the kernel version {:?}", release.trim()))?;
    if (major, minor) < KERNEL_MIN {
        return Err(format!(
            "ublk needs Linux {}.{} or later; this kernel is {major}.{minor}",
            KERNEL_MIN.0, KERNEL_MIN.1
        ));
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(CONTROL_PATH)
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => {
                format!("{CONTROL_PATH} does not exist (modprobe ublk_drv)")
            }
            _ => format!("cannot open {CONTROL_PATH}: {e}"),
        })?;
    Ok(())
}

fn parse_kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(['.', '-', '+']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// A block device served through ublk until [`UblkDevice::stop`] (or until
/// someone else stops or deletes it: [`UblkDevice::wait`]). Dropping it
/// stops it.
pub struct UblkDevice {
    id: u32,
    path: PathBuf,
    /// What the device serves, for [`UblkDevice::resize`]'s checks.
    dev: Arc<dyn BlockDev>,
    thread: Option<JoinHandle<Result<(), Error>>>,
}

impl std::fmt::Debug for UblkDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UblkDevice")
            .field("id", &self.id)
            .field("path", &self.path)
            .field("serving", &self.thread.is_some())
            .finish_non_exhaustive()
    }
}

enum Progress {
    /// The device exists with this id (and is recorded).
    Added(u32),
    /// The block device exists and is served.
    Live,
}

impl UblkDevice {
    /// Adds a ublk device for `dev`, starts serving it and returns once
    /// `/dev/ublkbN` exists. Stale devices of dead owners recorded in
    /// `opts.runtime_dir` are deleted first.
    pub fn start(dev: Arc<dyn BlockDev>, opts: UblkOptions) -> Result<UblkDevice, Error> {
        available().map_err(Error::Unavailable)?;
        let geo = Geometry::new(dev.as_ref(), &opts)?;
        match cleanup_stale(&opts.runtime_dir) {
            Ok(ids) if !ids.is_empty() => {
                tracing::info!(?ids, "deleted ublk devices left by dead initiators")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("cleaning up stale ublk devices: {e}"),
        }
        let (tx, rx) = mpsc::sync_channel(2);
        let dir = opts.runtime_dir;
        let want = opts.id;
        let served = dev.clone();
        let thread = std::thread::Builder::new()
            .name("ublk-ctrl".into())
            .spawn(move || serve(served, geo, want, dir, tx))
            .map_err(|source| Error::Io {
                what: "spawning the ublk control thread".into(),
                source,
            })?;
        let mut id = None;
        loop {
            match rx.recv() {
                Ok(Progress::Added(i)) => id = Some(i),
                Ok(Progress::Live) => break,
                // The thread ended before the device went live.
                Err(_) => {
                    return Err(match thread.join() {
                        Ok(Err(e)) => e,
                        Ok(Ok(())) => Error::Stopped,
                        Err(_) => Error::Panicked,
                    })
                }
            }
        }
        let id = id.expect("the device is added before it goes live");
        Ok(UblkDevice {
            id,
            path: PathBuf::from(format!("/dev/ublkb{id}")),
            dev,
            thread: Some(thread),
        })
    }

    /// The ublk device number (N in `/dev/ublkbN` and `/dev/ublkcN`).
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The block device, `/dev/ublkbN`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Blocking (control commands); call it from a control thread.
    ///
    /// Shows `bytes` as the device's size on `/dev/ublkbN` while it is
    /// served (and mounted), after the [`BlockDev`] grew (a volume grown
    /// online): `UBLK_U_CMD_UPDATE_SIZE`, which sets the disk's capacity
    /// and tells udev. `bytes` must be a multiple of the block size, no
    /// more than the device's size (the kernel would send requests past
    /// its end) and no less than the disk's (a mounted filesystem must not
    /// lose its end). Returns the disk's size read back.
    ///
    /// [`Error::ResizeUnsupported`] when the driver lacks
    /// `UBLK_F_UPDATE_SIZE` (Linux before 6.16, as GET_FEATURES reports
    /// it): the command is then not sent at all.
    pub fn resize(&self, bytes: u64) -> Result<u64, Error> {
        let id =
            i32::try_from(self.id).map_err(|_| Error::Invalid(format!("device id {}", self.id)))?;
        let ctrl = UblkCtrl::new_simple(id).map_err(|e| Error::ublk("opening the device", e))?;
        can_update_size(ctrl.get_driver_features())?;
        let name = format!("ublkb{}", self.id);
        let disk = super::disk_bytes(&name).map_err(|source| Error::Io {
            what: format!("reading the size of /dev/{name}"),
            source,
        })?;
        let bs = self.dev.block_size();
        check_resize(bs, disk, bytes, self.dev.size())?;
        if bytes == disk {
            return Ok(disk);
        }
        ctrl.update_size(bytes)
            .map_err(|e| Error::ublk("resizing the device", e))?;
        let now = super::disk_bytes(&name).map_err(|source| Error::Io {
            what: format!("reading the size of /dev/{name}"),
            source,
        })?;
        tracing::info!(
            id = self.id,
            from = disk,
            bytes = now,
            "ublk device resized"
        );
        Ok(now)
    }

    /// Stops the device (the kernel first writes back what it caches),
    /// flushes the [`BlockDev`] and deletes the device.
    pub fn stop(mut self) -> Result<(), Error> {
        self.stop_inner()
    }

    /// Waits until someone else stops or deletes the device, then flushes
    /// and deletes it like [`UblkDevice::stop`].
    pub fn wait(mut self) -> Result<(), Error> {
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| Error::Panicked)?,
            None => Ok(()),
        }
    }

    fn stop_inner(&mut self) -> Result<(), Error> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        // A control handle of this thread (libublk's control ring is per
        // thread). STOP_DEV returns once the block device is gone; the
        // serving thread then flushes and deletes.
        let stopped = UblkCtrl::new_simple(self.id as i32)
            .and_then(|c| c.kill_dev())
            .map_err(|e| Error::ublk("stopping the device", e));
        if stopped.is_err() && device_exists(self.id) {
            // Without a stop the queues never end; deleting aborts them too.
            if let Err(e) = delete_device(self.id) {
                tracing::warn!(
                    id = self.id,
                    "deleting ublk device after a failed stop: {e}"
                );
            }
        }
        let served = thread.join().map_err(|_| Error::Panicked)?;
        // Stopping fails when the device is already gone; then the serving
        // thread's result says everything.
        served.and(
            stopped
                .map(|_| ())
                .or_else(|e| match device_exists(self.id) {
                    true => Err(e),
                    false => Ok(()),
                }),
        )
    }
}

impl Drop for UblkDevice {
    fn drop(&mut self) {
        if let Err(e) = self.stop_inner() {
            tracing::warn!(id = self.id, "stopping ublk device: {e}");
        }
    }
}

/// The ublk control thread: adds the device, serves it until it is stopped,
/// then flushes and deletes it.
fn serve(
    dev: Arc<dyn BlockDev>,
    geo: Geometry,
    want: Option<u32>,
    dir: PathBuf,
    tx: mpsc::SyncSender<Progress>,
) -> Result<(), Error> {
    let add = |id: i32| {
        UblkCtrlBuilder::default()
            .name("nvpool")
            .id(id)
            .nr_queues(geo.queues)
            .depth(geo.depth)
            .io_buf_bytes(geo.buf_bytes)
            .ctrl_flags(0)
            .dev_flags(UblkFlags::UBLK_DEV_F_ADD_DEV)
            .build()
    };
    let ctrl = match want.and_then(|i| i32::try_from(i).ok()) {
        Some(id) => add(id).or_else(|e| {
            tracing::info!(id, error = %e, "the former ublk id is taken; taking a free one");
            add(-1)
        }),
        None => add(-1),
    }
    .map_err(|e| Error::ublk("adding the device", e))?;
    let id = ctrl.dev_info().dev_id;
    if let Err(e) = write_record(&dir, id) {
        tracing::warn!(id, "recording ublk device in {}: {e}", dir.display());
    }
    let _ = tx.send(Progress::Added(id));
    let live = Arc::new(AtomicBool::new(false));
    let live_flag = live.clone();
    let queue_dev = dev.clone();
    let ran = ctrl.run_target(
        move |udev: &mut UblkDev| {
            udev.tgt.dev_size = geo.size;
            udev.tgt.sq_depth = geo.depth + RING_EXTRA_SQES;
            // One completion per tag plus the poll, with room to spare.
            udev.tgt.cq_depth = geo.depth.saturating_mul(2);
            udev.tgt.params = geo.params();
            Ok(())
        },
        move |qid: u16, udev: &UblkDev| queue_main(qid, udev, queue_dev.as_ref(), geo),
        move |_: &UblkCtrl| {
            live_flag.store(true, Ordering::Release);
            let _ = tx.send(Progress::Live);
        },
    );
    // The queues are done: the device was stopped (or never started).
    let flushed = match live.load(Ordering::Acquire) {
        true => block_on(dev.flush()).map_err(Error::Flush),
        false => Ok(()),
    };
    let deleted = delete_owned(&ctrl);
    remove_record(&dir, id);
    ran.map_err(|e| Error::ublk("serving the device", e))?;
    deleted.and(flushed)
}

/// Deletes the device `ctrl` added, without waiting for the last opener of
/// the block device to close it.
fn delete_owned(ctrl: &UblkCtrl) -> Result<(), Error> {
    match ctrl.del_dev_async() {
        Ok(_) => Ok(()),
        // Kernels without DEL_DEV_ASYNC.
        Err(_) => ctrl
            .del_dev()
            .map(|_| ())
            .map_err(|e| Error::ublk("deleting the device", e)),
    }
}

fn device_exists(id: u32) -> bool {
    Path::new(&format!("/sys/class/ublk-char/ublkc{id}")).exists()
}

/// Deletes ublk device `id` whoever created it: stops it if it is still
/// live, then deletes it without waiting for openers of the block device.
/// Returns false if there was no such device.
pub fn delete_device(id: u32) -> Result<bool, Error> {
    let id_i32 = i32::try_from(id).map_err(|_| Error::Invalid(format!("device id {id}")))?;
    let ctrl = match UblkCtrl::new_simple(id_i32) {
        Ok(c) => c,
        Err(_) if !device_exists(id) => return Ok(false),
        Err(e) => return Err(Error::ublk("opening the device", e)),
    };
    // Already stopped (its server died) is fine.
    let _ = ctrl.kill_dev();
    match ctrl.del_dev_async() {
        Ok(_) => Ok(true),
        Err(_) if !device_exists(id) => Ok(true),
        Err(_) => ctrl
            .del_dev()
            .map(|_| true)
            .map_err(|e| Error::ublk("deleting the device", e)),
    }
}

/// Deletes every device recorded in `dir` whose owner process is gone (a
/// crashed or killed initiator) and forgets it; returns their ids. Records
/// of live owners are left alone.
pub fn cleanup_stale(dir: &Path) -> Result<Vec<u32>, Error> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(Error::Io {
                what: format!("reading {}", dir.display()),
                source,
            })
        }
    };
    let mut deleted = Vec::new();
    for entry in entries.flatten() {
        let Some(id) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let owner = std::fs::read_to_string(entry.path())
            .ok()
            .and_then(|s| parse_record(&s));
        if let Some((pid, start)) = owner {
            if proc_start_time(pid) == Some(start) {
                continue;
            }
        }
        if delete_stale(id, owner.map(|(pid, _)| pid))? {
            deleted.push(id);
        }
        remove_record(dir, id);
    }
    deleted.sort_unstable();
    Ok(deleted)
}

/// Deletes recorded device `id` of the dead process `owner` unless the id
/// now belongs to someone else: a device served by another live process,
/// or one quiesced for recovery (ours never are). True if deleted.
fn delete_stale(id: u32, owner: Option<u32>) -> Result<bool, Error> {
    let Ok(id_i32) = i32::try_from(id) else {
        return Ok(false);
    };
    let ctrl = match UblkCtrl::new_simple(id_i32) {
        Ok(c) => c,
        Err(_) if !device_exists(id) => return Ok(false),
        Err(e) => return Err(Error::ublk("opening a stale device", e)),
    };
    let info = ctrl.dev_info();
    let server = u32::try_from(info.ublksrv_pid).ok().filter(|&p| p > 0);
    let ours = match u32::from(info.state) {
        sys::UBLK_S_DEV_DEAD => true,
        sys::UBLK_S_DEV_LIVE => match server {
            None => true,
            Some(p) => Some(p) == owner || proc_start_time(p).is_none(),
        },
        _ => false,
    };
    if !ours {
        tracing::warn!(
            id,
            ?server,
            "ublk device {id} is no longer ours; leaving it"
        );
        return Ok(false);
    }
    drop(ctrl);
    delete_device(id)
}

/// "PID STARTTIME": the owner, robust against pid reuse.
fn write_record(dir: &Path, id: u32) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let pid = std::process::id();
    let start = proc_start_time(pid).unwrap_or(0);
    let tmp = dir.join(format!(".{id}.tmp"));
    std::fs::write(&tmp, format!("{pid} {start}\n"))?;
    std::fs::rename(tmp, dir.join(id.to_string()))
}

fn remove_record(dir: &Path, id: u32) {
    let _ = std::fs::remove_file(dir.join(id.to_string()));
}

fn parse_record(s: &str) -> Option<(u32, u64)> {
    let mut w = s.split_whitespace();
    Some((w.next()?.parse().ok()?, w.next()?.parse().ok()?))
}

/// Field 22 of /proc/PID/stat (start time in clock ticks since boot).
fn proc_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_start_time(&stat)
}

fn parse_start_time(stat: &str) -> Option<u64> {
    // The command name (field 2) may hold spaces and parentheses.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// What the kernel is told about the device, derived from the
/// [`BlockDev`] and the options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
    size: u64,
    block_bytes: u32,
    block_shift: u8,
    io_opt_shift: u8,
    /// Largest read or write, bytes (a multiple of the block size).
    max_io: u32,
    /// Each tag's buffer: `max_io` rounded up to pages.
    buf_bytes: u32,
    queues: u16,
    depth: u16,
    read_only: bool,
}

impl Geometry {
    fn new(dev: &dyn BlockDev, opts: &UblkOptions) -> Result<Geometry, Error> {
        let bs = dev.block_size();
        // ublk takes logical blocks of 512 bytes up to a page.
        if !bs.is_power_of_two() || !(512..=4096).contains(&bs) {
            return Err(Error::Invalid(format!(
                "block size {bs}: ublk needs a power of two from 512 to 4096"
            )));
        }
        let size = dev.size();
        if size == 0 || !size.is_multiple_of(u64::from(bs)) {
            return Err(Error::Invalid(format!(
                "size {size} is not a positive multiple of the block size {bs}"
            )));
        }
        let depth = opts.queue_depth;
        if depth == 0 || u32::from(depth) > sys::UBLK_MAX_QUEUE_DEPTH {
            return Err(Error::Invalid(format!(
                "queue depth {depth}: must be 1 to {}",
                sys::UBLK_MAX_QUEUE_DEPTH
            )));
        }
        let queues = match opts.queues {
            Some(q) => q,
            None => std::thread::available_parallelism()
                .map_or(1, |n| u16::try_from(n.get()).unwrap_or(u16::MAX)),
        };
        let queues = queues.min(sys::UBLK_MAX_NR_QUEUES as u16);
        if queues == 0 {
            return Err(Error::Invalid("0 queues".into()));
        }
        let page = page_bytes();
        let max_io = (dev.max_io_bytes().min(UBLK_IO_BYTES_MAX) / bs * bs).max(bs);
        let buf_bytes = max_io.div_ceil(page) * page;
        let block_shift = bs.trailing_zeros() as u8;
        // ublk states io_opt as a power of two. A device without a
        // preference gets the block size (which tools read as "none"); a
        // stripe unit that is no power of two gets its largest power-of-two
        // divisor, so I/O aligned to it stays aligned to the stripe unit.
        let io_opt_shift = match dev.optimal_io_bytes() {
            0 => block_shift,
            n => (n.trailing_zeros() as u8).max(block_shift),
        };
        Ok(Geometry {
            size,
            block_bytes: bs,
            block_shift,
            io_opt_shift,
            max_io,
            buf_bytes,
            queues,
            depth,
            read_only: opts.read_only,
        })
    }

    fn params(&self) -> sys::ublk_params {
        let discard_sectors = UBLK_DISCARD_BYTES_MAX >> SECTOR_SHIFT;
        sys::ublk_params {
            types: sys::UBLK_PARAM_TYPE_BASIC | sys::UBLK_PARAM_TYPE_DISCARD,
            basic: sys::ublk_param_basic {
                // A volatile cache makes the kernel send flushes; FUA lets
                // it mark single writes durable instead of flushing after.
                attrs: sys::UBLK_ATTR_VOLATILE_CACHE
                    | sys::UBLK_ATTR_FUA
                    | if self.read_only {
                        sys::UBLK_ATTR_READ_ONLY
                    } else {
                        0
                    },
                logical_bs_shift: self.block_shift,
                physical_bs_shift: self.block_shift,
                io_opt_shift: self.io_opt_shift,
                io_min_shift: self.block_shift,
                max_sectors: self.max_io >> SECTOR_SHIFT,
                dev_sectors: self.size >> SECTOR_SHIFT,
                ..Default::default()
            },
            discard: sys::ublk_param_discard {
                discard_alignment: 0,
                discard_granularity: self.block_bytes,
                max_discard_sectors: discard_sectors,
                max_write_zeroes_sectors: discard_sectors,
                // ublk takes single-range discards only.
                max_discard_segments: 1,
                ..Default::default()
            },
            ..Default::default()
        }
    }
}

fn page_bytes() -> u32 {
    // SAFETY: sysconf reads a constant of the running system.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u32::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

/// Queues a one-shot poll of `kick` on the calling queue thread's ring.
fn arm(kick: &Wakeup) -> io::Result<()> {
    let sqe = opcode::PollAdd::new(types::Fd(kick.as_raw_fd()), libc::POLLIN as u32)
        .build()
        .user_data(KICK_USER_DATA);
    with_task_io_ring_mut(|ring| loop {
        // SAFETY: a poll references no memory, and io_uring holds its
        // own reference to the file while the poll is armed.
        if unsafe { ring.submission().push(&sqe) }.is_ok() {
            return Ok(());
        }
        ring.submit()?;
    })
}

/// Counters of one queue, touched only by its thread (the tag tasks run
/// there); logged when the queue ends.
#[derive(Debug, Default)]
struct QueueStats {
    requests: Cell<u64>,
    in_flight: Cell<u32>,
    /// Most requests the queue's tasks held at once: with a deep enough
    /// submitter, far above 1 (the point of one task per tag).
    peak_in_flight: Cell<u32>,
}

impl QueueStats {
    fn begin(&self) {
        self.requests.set(self.requests.get() + 1);
        let n = self.in_flight.get() + 1;
        self.in_flight.set(n);
        self.peak_in_flight.set(self.peak_in_flight.get().max(n));
    }

    fn end(&self) {
        self.in_flight.set(self.in_flight.get() - 1);
    }
}

/// One queue thread (spawned and pinned by libublk's `run_target`).
fn queue_main(qid: u16, udev: &UblkDev, dev: &dyn BlockDev, geo: Geometry) {
    let q = match UblkQueue::new(qid, udev) {
        Ok(q) => q,
        Err(e) => {
            tracing::error!(qid, "{}", Error::ublk("setting up a queue", e));
            return;
        }
    };
    // Our tags bring their own buffers: nothing for libublk to register,
    // but start_dev waits for every queue to say so.
    udev.notify_buffer_registration_complete(false);
    if let Err(e) = run_queue(&q, dev, geo) {
        tracing::error!(qid, "ublk queue stopped: {e}");
    }
}

/// Runs the queue's tag tasks until every one has ended (the device was
/// stopped: each tag's command came back aborted).
fn run_queue(q: &UblkQueue<'_>, dev: &dyn BlockDev, geo: Geometry) -> io::Result<()> {
    let stats = QueueStats::default();
    let mut tasks = LocalTasks::new(usize::from(geo.depth))?;
    for tag in q.tags() {
        tasks.spawn(usize::from(tag), serve_tag(q, tag, dev, geo, &stats));
    }
    arm(tasks.wakeup())?;
    loop {
        if tasks.run_ready() == 0 {
            tracing::info!(
                qid = q.get_qid(),
                requests = stats.requests.get(),
                peak_in_flight = stats.peak_in_flight.get(),
                "ublk queue done"
            );
            return Ok(());
        }
        let Some(waited) = tasks.sleep(|| with_task_io_ring_mut(|ring| ring.submit_and_wait(1)))
        else {
            continue;
        };
        if let Err(e) = waited {
            if !matches!(
                e.raw_os_error(),
                Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
            ) {
                // The kernel may still write into the tags' buffers; never
                // free them.
                std::mem::forget(tasks);
                return Err(e);
            }
        }
        let mut rearm = false;
        let reaped = ublk_reap_io_events_with_update_queue(q, false, None, |cqe| {
            if cqe.user_data() == KICK_USER_DATA {
                rearm = true;
            } else {
                ublk_wake_task(cqe.user_data(), cqe);
            }
        });
        if let Err(e) = reaped {
            std::mem::forget(tasks);
            return Err(io::Error::other(Error::ublk("reaping completions", e)));
        }
        if rearm {
            tasks.wakeup().drain();
            if let Err(e) = arm(tasks.wakeup()) {
                // As above: the tags' commands are with the kernel.
                std::mem::forget(tasks);
                return Err(e);
            }
        }
    }
}

/// One tag: fetch a request, serve it, commit the result together with the
/// next fetch, until the kernel aborts the command (device stopped).
async fn serve_tag(
    q: &UblkQueue<'_>,
    tag: u16,
    dev: &dyn BlockDev,
    geo: Geometry,
    stats: &QueueStats,
) {
    let buf_bytes = geo.buf_bytes as usize;
    // The kernel copies each write's data into this buffer before handing
    // us the request, and a read's data out of it when we commit. While a
    // command is in flight nothing here touches it.
    let mut buf: Vec<u8> = Vec::with_capacity(buf_bytes);
    let mut fetched = q
        .submit_io_prep_cmd(tag, BufDesc::RawAddress(buf.as_ptr()), 0, None)
        .await;
    loop {
        match fetched {
            Ok(0) => {}
            Err(UblkError::QueueIsDown) => return,
            Ok(r) => {
                let e = io::Error::from_raw_os_error(-r);
                tracing::error!(qid = q.get_qid(), tag, "ublk command refused: {e}");
                return;
            }
            Err(e) => {
                tracing::error!(
                    qid = q.get_qid(),
                    tag,
                    "{}",
                    Error::ublk("a ublk command", e)
                );
                return;
            }
        }
        let iod = *q.get_iod(tag);
        let res;
        stats.begin();
        (res, buf) = serve_request(dev, geo, &iod, buf).await;
        stats.end();
        // The buffer that came back may be another allocation; it must hold
        // the largest request before it is handed to the kernel.
        if buf.capacity() < buf_bytes {
            buf.reserve_exact(buf_bytes - buf.len());
        }
        fetched = q
            .submit_io_commit_cmd(tag, BufDesc::RawAddress(buf.as_ptr()), res)
            .await;
    }
}

/// Whether a driver with `features` (GET_FEATURES; `None`: a driver from
/// before Linux 6.5, which has no GET_FEATURES) can resize a live device.
fn can_update_size(features: Option<u64>) -> Result<(), Error> {
    match features {
        Some(f) if f & sys::UBLK_F_UPDATE_SIZE as u64 != 0 => Ok(()),
        _ => Err(Error::ResizeUnsupported),
    }
}

/// Whether a disk of `disk` bytes in `bs`-byte blocks may become `bytes`,
/// serving a device of `dev_size` bytes.
fn check_resize(bs: u32, disk: u64, bytes: u64, dev_size: u64) -> Result<(), Error> {
    if bytes == 0 || !bytes.is_multiple_of(u64::from(bs)) {
        return Err(Error::Invalid(format!(
            "size {bytes} is not a positive multiple of the block size {bs}"
        )));
    }
    if bytes > dev_size {
        return Err(Error::Invalid(format!(
            "size {bytes}: the device has {dev_size} bytes"
        )));
    }
    if bytes < disk {
        return Err(Error::Invalid(format!(
            "size {bytes}: the disk has {disk} bytes and does not shrink"
        )));
    }
    Ok(())
}

/// The kernel's result for an operation without data.
fn done(r: Result<(), IoError>) -> i32 {
    r.map_or_else(|e| -errno(&e), |()| 0)
}

/// Serves one request; returns the result for the kernel (bytes moved, 0,
/// or a negative errno) and the tag's buffer.
async fn serve_request(
    dev: &dyn BlockDev,
    geo: Geometry,
    iod: &sys::ublksrv_io_desc,
    mut buf: Vec<u8>,
) -> (i32, Vec<u8>) {
    let op = iod.op_flags & 0xff;
    if op == sys::UBLK_IO_OP_FLUSH {
        // A flush carries no range (its sector fields are left over).
        return (done(dev.flush().await), buf);
    }
    let offset = iod.start_sector << SECTOR_SHIFT;
    let len = u64::from(iod.nr_sectors) << SECTOR_SHIFT;
    // The device's size now, not at start: it may have grown since.
    if offset.checked_add(len).is_none_or(|end| end > dev.size()) {
        return (-libc::EINVAL, buf);
    }
    let moved = |r: Result<(), IoError>| match r {
        // len ≤ max_io ≤ UBLK_IO_BYTES_MAX, which fits (asserted in limits.rs).
        Ok(()) => len as i32,
        Err(e) => -errno(&e),
    };
    match op {
        sys::UBLK_IO_OP_READ | sys::UBLK_IO_OP_WRITE if len > u64::from(geo.max_io) => {
            (-libc::EINVAL, buf)
        }
        sys::UBLK_IO_OP_READ => {
            buf.resize(len as usize, 0);
            let (r, buf) = dev.read(offset, buf).await;
            (moved(r), buf)
        }
        sys::UBLK_IO_OP_WRITE => {
            let n = len as usize;
            assert!(buf.capacity() >= n, "a tag buffer is smaller than max_io");
            // SAFETY: n ≤ capacity (asserted), and before completing the
            // fetch the kernel copied the request's n bytes into the start
            // of this very allocation (its address went out with the last
            // command), so they are initialized.
            unsafe { buf.set_len(n) };
            let fua = iod.op_flags & sys::UBLK_IO_F_FUA != 0;
            let (r, buf) = dev.write(offset, buf, fua).await;
            (moved(r), buf)
        }
        sys::UBLK_IO_OP_DISCARD => (done(dev.discard(offset, len).await), buf),
        sys::UBLK_IO_OP_WRITE_ZEROES => {
            let may_unmap = iod.op_flags & sys::UBLK_IO_F_NOUNMAP == 0;
            (done(dev.write_zeroes(offset, len, may_unmap).await), buf)
        }
        _ => (-libc::EOPNOTSUPP, buf),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blockdev::{BufResult, IoFuture};

    struct Fake {
        size: u64,
        bs: u32,
        opt: u32,
        max: u32,
    }

    impl BlockDev for Fake {
        fn size(&self) -> u64 {
            self.size
        }
        fn block_size(&self) -> u32 {
            self.bs
        }
        fn optimal_io_bytes(&self) -> u32 {
            self.opt
        }
        fn max_io_bytes(&self) -> u32 {
            self.max
        }
        fn read(&self, _: u64, buf: Vec<u8>) -> IoFuture<'_, BufResult> {
            Box::pin(async move { (Ok(()), buf) })
        }
        fn write(&self, _: u64, buf: Vec<u8>, _: bool) -> IoFuture<'_, BufResult> {
            Box::pin(async move { (Ok(()), buf) })
        }
        fn flush(&self) -> IoFuture<'_, Result<(), IoError>> {
            Box::pin(async { Ok(()) })
        }
        fn write_zeroes(&self, _: u64, _: u64, _: bool) -> IoFuture<'_, Result<(), IoError>> {
            Box::pin(async { Ok(()) })
        }
        fn discard(&self, _: u64, _: u64) -> IoFuture<'_, Result<(), IoError>> {
            Box::pin(async { Err(IoError::Invalid("nope")) })
        }
    }

    fn fake(bs: u32, opt: u32, max: u32) -> Fake {
        Fake {
            size: 1 << 30,
            bs,
            opt,
            max,
        }
    }

    fn opts(queues: u16) -> UblkOptions {
        UblkOptions {
            queues: Some(queues),
            ..UblkOptions::default()
        }
    }

    #[test]
    fn geometry_follows_the_device() {
        let g = Geometry::new(&fake(4096, 128 << 10, 1 << 20), &opts(2)).unwrap();
        assert_eq!((g.block_shift, g.io_opt_shift), (12, 17));
        assert_eq!((g.max_io, g.buf_bytes), (1 << 20, 1 << 20));
        assert_eq!((g.queues, g.depth), (2, UBLK_QUEUE_DEPTH_DEFAULT));
        let p = g.params();
        assert_eq!(p.basic.dev_sectors, (1 << 30) >> 9);
        assert_eq!(p.basic.max_sectors, 2048);
        assert_eq!(p.basic.io_min_shift, 12);
        assert_eq!(
            p.basic.attrs,
            sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA
        );
        assert_eq!(p.discard.discard_granularity, 4096);
        assert_eq!(p.discard.max_discard_segments, 1);
        assert_eq!(
            p.discard.max_write_zeroes_sectors,
            UBLK_DISCARD_BYTES_MAX >> 9
        );

        // No preference: the block size. Not a power of two: its largest
        // power-of-two divisor. Transfers capped and rounded to blocks.
        let g = Geometry::new(&fake(512, 0, 8 << 20), &opts(1)).unwrap();
        assert_eq!((g.io_opt_shift, g.max_io), (9, UBLK_IO_BYTES_MAX));
        let g = Geometry::new(&fake(512, 3 << 16, 1000), &opts(1)).unwrap();
        assert_eq!(
            (g.io_opt_shift, g.max_io, g.buf_bytes),
            (16, 512, page_bytes())
        );
    }

    #[test]
    fn a_read_only_device_says_so() {
        let o = UblkOptions {
            read_only: true,
            ..opts(1)
        };
        let p = Geometry::new(&fake(4096, 0, 1 << 20), &o).unwrap().params();
        assert_eq!(
            p.basic.attrs,
            sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA | sys::UBLK_ATTR_READ_ONLY
        );
    }

    #[test]
    fn geometry_refuses_what_ublk_cannot_present() {
        assert!(Geometry::new(&fake(8192, 0, 1 << 20), &opts(1)).is_err());
        assert!(Geometry::new(&fake(1000, 0, 1 << 20), &opts(1)).is_err());
        let mut f = fake(4096, 0, 1 << 20);
        f.size = 4096 * 3 + 512;
        assert!(Geometry::new(&f, &opts(1)).is_err());
        assert!(Geometry::new(&fake(4096, 0, 1 << 20), &opts(0)).is_err());
        let o = UblkOptions {
            queue_depth: 0,
            ..opts(1)
        };
        assert!(Geometry::new(&fake(4096, 0, 1 << 20), &o).is_err());
    }

    #[test]
    fn requests_map_to_block_dev_calls() {
        let f = fake(512, 0, 1 << 20);
        let g = Geometry::new(&f, &opts(1)).unwrap();
        let iod = |op: u32, sector: u64, sectors: u32| sys::ublksrv_io_desc {
            op_flags: op,
            nr_sectors: sectors,
            start_sector: sector,
            addr: 0,
        };
        let buf = Vec::with_capacity(g.buf_bytes as usize);
        let (r, buf) = block_on(serve_request(&f, g, &iod(sys::UBLK_IO_OP_READ, 8, 16), buf));
        assert_eq!((r, buf.len()), (8192, 8192));
        let (r, buf) = block_on(serve_request(&f, g, &iod(sys::UBLK_IO_OP_WRITE, 0, 8), buf));
        assert_eq!((r, buf.len()), (4096, 4096));
        let flush = iod(sys::UBLK_IO_OP_FLUSH, u64::MAX >> 9, 7);
        let (r, buf) = block_on(serve_request(&f, g, &flush, buf));
        assert_eq!(r, 0);
        let (r, buf) = block_on(serve_request(
            &f,
            g,
            &iod(sys::UBLK_IO_OP_DISCARD, 0, 8),
            buf,
        ));
        assert_eq!(r, -libc::EINVAL);
        // Past the end, and larger than max_io.
        let end = (1u64 << 30) >> 9;
        let (r, buf) = block_on(serve_request(
            &f,
            g,
            &iod(sys::UBLK_IO_OP_READ, end, 1),
            buf,
        ));
        assert_eq!(r, -libc::EINVAL);
        let (r, _) = block_on(serve_request(
            &f,
            g,
            &iod(sys::UBLK_IO_OP_READ, 0, 4096),
            buf,
        ));
        assert_eq!(r, -libc::EINVAL);
    }

    #[test]
    fn requests_are_served_up_to_the_device_size_now() {
        let small = Fake {
            size: 1 << 20,
            ..fake(512, 0, 1 << 20)
        };
        let g = Geometry::new(&small, &opts(1)).unwrap();
        let grown = Fake {
            size: 2 << 20,
            ..fake(512, 0, 1 << 20)
        };
        let at_old_end = sys::ublksrv_io_desc {
            op_flags: sys::UBLK_IO_OP_READ,
            nr_sectors: 8,
            start_sector: (1 << 20) >> 9,
            addr: 0,
        };
        let buf = Vec::with_capacity(g.buf_bytes as usize);
        let (r, buf) = block_on(serve_request(&small, g, &at_old_end, buf));
        assert_eq!(r, -libc::EINVAL);
        let (r, _) = block_on(serve_request(&grown, g, &at_old_end, buf));
        assert_eq!(r, 4096, "served once the device grew");
    }

    #[test]
    fn resizing_needs_update_size_and_only_grows_within_the_device() {
        // The command and flag as Linux's include/uapi/linux/ublk_cmd.h
        // has them: _IOWR('u', 0x15, struct ublksrv_ctrl_cmd), bit 10.
        let ctrl_cmd = std::mem::size_of::<sys::ublksrv_ctrl_cmd>() as u32;
        assert_eq!(ctrl_cmd, 32);
        let iowr = (3u32 << 30) | (ctrl_cmd << 16) | (u32::from(b'u') << 8) | 0x15;
        assert_eq!(sys::UBLK_U_CMD_UPDATE_SIZE, iowr);
        assert_eq!(sys::UBLK_F_UPDATE_SIZE as u64, 1 << 10);

        let mib = 1u64 << 20;
        let has = Some(sys::UBLK_F_UPDATE_SIZE as u64 | sys::UBLK_F_USER_COPY as u64);
        for features in [None, Some(0), Some(sys::UBLK_F_USER_COPY as u64)] {
            let e = can_update_size(features).unwrap_err();
            assert!(matches!(e, Error::ResizeUnsupported), "{e:?}");
            let m = e.to_string();
            assert!(
                m.contains("UBLK_F_UPDATE_SIZE, Linux 6.16+") && m.contains("detach and attach"),
                "{m}"
            );
        }
        can_update_size(has).unwrap();
        check_resize(4096, mib, 2 * mib, 2 * mib).unwrap();
        check_resize(4096, mib, mib, 2 * mib).unwrap();
        for (bytes, what) in [
            (2 * mib + 512, "not whole blocks"),
            (3 * mib, "past the device"),
            (mib / 2, "a shrink"),
            (0, "nothing"),
        ] {
            let e = check_resize(4096, mib, bytes, 2 * mib).unwrap_err();
            assert!(matches!(e, Error::Invalid(_)), "{what}: {e:?}");
        }
    }

    #[test]
    fn parses_kernel_versions_and_records() {
        assert_eq!(parse_kernel_version("6.12.41+deb13-amd64\n"), Some((6, 12)));
        assert_eq!(parse_kernel_version("5.15.0-91-generic"), Some((5, 15)));
        assert_eq!(parse_kernel_version("garbage"), None);
        assert_eq!(parse_record("123 456\n"), Some((123, 456)));
        assert_eq!(parse_record("123"), None);
        let stat = "42 (a b) c) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987 1000";
        assert_eq!(parse_start_time(stat), Some(987));
        assert!(proc_start_time(std::process::id()).is_some());
    }

    #[test]
    fn cleanup_forgets_records_of_dead_owners_and_keeps_live_ones() {
        let dir = tempfile::tempdir().unwrap();
        write_record(dir.path(), 7).unwrap();
        // A dead owner of a device that does not exist: forgotten.
        std::fs::write(dir.path().join("4000000"), "999999999 1\n").unwrap();
        if Path::new(CONTROL_PATH).exists() {
            return; // a real ublk host: do not touch its devices
        }
        assert_eq!(cleanup_stale(dir.path()).unwrap(), Vec::<u32>::new());
        assert!(dir.path().join("7").exists());
        assert!(!dir.path().join("4000000").exists());
    }
}
