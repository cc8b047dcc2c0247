//! The FUSE + loop front-end against the real kernel: ext4 on the loop
//! device, discard and zeroing reaching the BlockDev, unaligned file I/O,
//! and a server killed with SIGKILL. Needs root, /dev/fuse and
//! /dev/loop-control (and mkfs.ext4, e2fsck, mount, blkdiscard); without
//! them each test prints `skipped: <reason>` and returns.

use nvpool_initiator::frontend::fuse::{
    abort_connection, FuseError, FuseLoop, FuseOptions, LoopError,
};
mod common;

use common::memdev::MemDev;
use common::{open_device, pattern, subsystem, Tgt};
use nvpool_initiator::BlockDev;
use std::collections::hash_map::DefaultHasher;
use std::hash::Hasher;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Why this host cannot run the tests, if it cannot.
fn missing() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("not root (FUSE mount and loop devices need root)".into());
    }
    for dev in ["/dev/fuse", "/dev/loop-control"] {
        if !Path::new(dev).exists() {
            return Some(format!("{dev} missing (modprobe fuse / loop)"));
        }
    }
    for tool in [
        "mkfs.ext4",
        "e2fsck",
        "mount",
        "umount",
        "blkdiscard",
        "losetup",
    ] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            return Some(format!(
                "{tool} not found (apt-get install e2fsprogs util-linux mount)"
            ));
        }
    }
    None
}

macro_rules! require_host {
    () => {
        if let Some(why) = missing() {
            println!("skipped: {why}");
            return;
        }
    };
}

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn hash(b: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    h.write(b);
    h.finish()
}

fn opts() -> FuseOptions {
    FuseOptions::default()
}

/// How long one attach may take before the FUSE connection is aborted: a
/// server that stopped answering then fails the test with I/O errors
/// instead of leaving tasks stuck in the kernel.
const WATCHDOG_SECS: u64 = 120;

/// Aborts the FUSE connection of a FuseLoop unless dropped in time.
struct Watchdog(Option<mpsc::SyncSender<()>>);

fn watchdog(fl: &FuseLoop, secs: u64) -> Watchdog {
    let id = fl.mount().connection_id().unwrap();
    let (tx, rx) = mpsc::sync_channel::<()>(1);
    std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(Duration::from_secs(secs)) {
            eprintln!("watchdog: aborting FUSE connection {id} after {secs} s");
            let _ = abort_connection(id);
        }
    });
    Watchdog(Some(tx))
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// Lazily unmounts a filesystem on drop (a failed assertion must not
/// leave ext4 mounted on a loop device).
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        if is_mountpoint(&self.0) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

/// Writes back one filesystem (a global sync(2) would also wait on every
/// other FUSE-backed filesystem on the host).
fn syncfs(dir: &Path) {
    let f = std::fs::File::open(dir).unwrap();
    // SAFETY: syncfs on a descriptor we own.
    let rc = unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&f)) };
    assert_eq!(rc, 0, "syncfs: {}", std::io::Error::last_os_error());
}

/// mkfs, 200 small files + one 64 MiB file, unmount, detach, re-attach,
/// verify every checksum, fsck.
fn ext4_scenario(dev: Arc<dyn BlockDev>, dir: &Path) {
    let fuse_dir = dir.join("fuse");
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let mut fl = FuseLoop::attach(dev.clone(), &fuse_dir, &opts()).unwrap();
    let dog = watchdog(&fl, WATCHDOG_SECS);
    assert!(
        fl.loop_device().direct_io(),
        "loop device runs without direct I/O"
    );
    let loopdev = fl.device_path().to_str().unwrap().to_string();
    let sysfs = format!(
        "/sys/block/{}/queue/logical_block_size",
        loopdev.trim_start_matches("/dev/")
    );
    let lbs: u32 = std::fs::read_to_string(&sysfs)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(lbs, dev.block_size());
    run("mkfs.ext4", &["-q", "-F", &loopdev]);
    run("mount", &["-t", "ext4", &loopdev, mnt.to_str().unwrap()]);
    let _unmount = Unmount(mnt.clone());
    let mut sums = Vec::new();
    for i in 0..200u64 {
        let data = pattern(i, 100 + (i as usize * 997) % 20_000);
        let p = mnt.join(format!("f{i:03}"));
        std::fs::write(&p, &data).unwrap();
        sums.push((p, hash(&data)));
    }
    let big = pattern(4242, 64 << 20);
    let p = mnt.join("big");
    std::fs::write(&p, &big).unwrap();
    sums.push((p, hash(&big)));
    drop(big);
    syncfs(&mnt);
    // Closing while mounted must refuse and leave everything in place.
    let e = fl.close().unwrap_err();
    assert!(matches!(e, FuseError::Loop(LoopError::Busy { .. })), "{e}");
    let check = std::fs::read(&sums[0].0).unwrap();
    assert_eq!(hash(&check), sums[0].1);
    run("umount", &[mnt.to_str().unwrap()]);
    fl.close().unwrap();
    drop(dog);
    assert!(!is_mountpoint(&fuse_dir), "FUSE still mounted after close");
    wait_unbound(loopdev.trim_start_matches("/dev/"));

    let mut fl = FuseLoop::attach(dev.clone(), &fuse_dir, &opts()).unwrap();
    let dog = watchdog(&fl, WATCHDOG_SECS);
    let loopdev = fl.device_path().to_str().unwrap().to_string();
    run("mount", &["-t", "ext4", &loopdev, mnt.to_str().unwrap()]);
    for (p, h) in &sums {
        let got = std::fs::read(p).unwrap();
        assert_eq!(hash(&got), *h, "{} differs after re-attach", p.display());
    }
    run("umount", &[mnt.to_str().unwrap()]);
    run("e2fsck", &["-fn", &loopdev]);
    fl.close().unwrap();
    drop(dog);
    assert!(!is_mountpoint(&fuse_dir), "FUSE still mounted after close");
}

fn wait_unbound(name: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let f = format!("/sys/block/{name}/loop/backing_file");
    while Path::new(&f).exists() {
        assert!(Instant::now() < deadline, "{name} still bound");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn is_mountpoint(p: &Path) -> bool {
    let p = p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    info.lines()
        .any(|l| l.split(' ').nth(4) == Some(p.to_str().unwrap()))
}

#[test]
fn ext4_on_fuse_loop_in_memory() {
    require_host!();
    let dir = tempfile::tempdir().unwrap();
    let dev = MemDev::new(256 << 20, 4096);
    ext4_scenario(dev.clone(), dir.path());
    assert!(
        dev.flushes.load(Ordering::Relaxed) > 0,
        "no flush reached the device"
    );
    assert_eq!(dev.unaligned.load(Ordering::Relaxed), 0);
}

const NQN: &str = "nqn.2026-11.io.nvpool:frontend-fuse";

fn start_target(backend: &str) -> Tgt {
    Tgt::start(&[subsystem(NQN, &[], &[(1, backend)])])
}

#[test]
fn ext4_on_fuse_loop_over_nvme_tcp() {
    require_host!();
    let r = start_target("ram:256M");
    let dev: Arc<dyn BlockDev> = Arc::new(open_device(&r, NQN, 2, 32));
    let dir = tempfile::tempdir().unwrap();
    ext4_scenario(dev.clone(), dir.path());
    drop(dev);
    r.stop();
}

/// An aligned buffer for O_DIRECT.
fn aligned(len: usize) -> (Vec<u8>, usize) {
    let v = vec![0u8; len + 4096];
    let at = v.as_ptr().align_offset(4096);
    (v, at)
}

#[test]
fn discard_zeroing_flush_and_unaligned_io_reach_the_block_device() {
    require_host!();
    let dir = tempfile::tempdir().unwrap();
    let dev = MemDev::new(64 << 20, 512);
    let mut fl = FuseLoop::attach(dev.clone(), &dir.path().join("fuse"), &opts()).unwrap();
    let _dog = watchdog(&fl, WATCHDOG_SECS);
    let loopdev = fl.device_path().to_path_buf();
    let name = loopdev.to_str().unwrap();

    // Data through the loop device (O_DIRECT), then blkdiscard.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&loopdev)
        .unwrap();
    let (mut v, at) = aligned(1 << 20);
    v[at..at + (1 << 20)].copy_from_slice(&pattern(7, 1 << 20));
    f.write_all_at(&v[at..at + (1 << 20)], 1 << 20).unwrap();
    f.sync_all().unwrap();
    assert!(
        dev.flushes.load(Ordering::Relaxed) > 0,
        "fsync did not flush"
    );
    assert_eq!(dev.bytes(1 << 20, 1 << 20), pattern(7, 1 << 20));
    let before = dev.zeroes_unmap.load(Ordering::Relaxed);
    run("blkdiscard", &["-o", "1048576", "-l", "524288", name]);
    assert!(
        dev.zeroes_unmap.load(Ordering::Relaxed) > before,
        "blkdiscard did not reach the device"
    );
    assert!(dev.bytes(1 << 20, 512 << 10).iter().all(|&b| b == 0));
    assert_eq!(
        dev.bytes((1 << 20) + (512 << 10), 512 << 10),
        pattern(7, 1 << 20)[512 << 10..].to_vec()
    );
    // blkdiscard -z zeroes without unmapping.
    let before = dev.zeroes_keep.load(Ordering::Relaxed);
    run("blkdiscard", &["-z", "-o", "1572864", "-l", "65536", name]);
    assert!(dev.zeroes_keep.load(Ordering::Relaxed) > before);
    assert!(dev.bytes(1572864, 65536).iter().all(|&b| b == 0));
    drop(f);

    // Unaligned I/O through the FUSE file: read-modify-write.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(fl.mount().file_path())
        .unwrap();
    let base = pattern(9, 8192);
    file.write_all_at(&base, 8 << 20).unwrap();
    let patch = pattern(10, 1000);
    file.write_all_at(&patch, (8 << 20) + 300).unwrap();
    let mut want = base.clone();
    want[300..1300].copy_from_slice(&patch);
    let mut got = vec![0; 8192];
    file.read_exact_at(&mut got, 8 << 20).unwrap();
    assert_eq!(got, want);
    let mut odd = vec![0; 777];
    file.read_exact_at(&mut odd, (8 << 20) + 1).unwrap();
    assert_eq!(odd, want[1..778]);
    assert_eq!(dev.bytes(8 << 20, 8192), want);
    // Punching a hole zeroes it (unaligned edges by read-modify-write).
    // SAFETY: fallocate on an open descriptor with plain integer arguments.
    let rc = unsafe {
        libc::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(&file),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            (8 << 20) + 100,
            5000,
        )
    };
    assert_eq!(rc, 0, "punch hole: {}", std::io::Error::last_os_error());
    want[100..5100].fill(0);
    assert_eq!(dev.bytes(8 << 20, 8192), want);
    // The file cannot grow or shrink.
    assert!(file.set_len(1 << 20).is_err());
    assert!(file.write_all_at(b"x", 64 << 20).is_err());
    assert_eq!(file.metadata().unwrap().len(), 64 << 20);
    drop(file);
    assert_eq!(dev.unaligned.load(Ordering::Relaxed), 0);
    fl.close().unwrap();
}

const CHILD_DIR: &str = "NVPOOL_FUSE_CHILD_DIR";

/// Run by `kill_9_of_the_server_leaves_a_recoverable_device` in a child
/// process: serve a FuseLoop until killed (at most two minutes).
#[test]
#[ignore = "helper: runs only in the child process of the kill -9 test"]
fn child_serves_until_killed() {
    let Some(dir) = std::env::var_os(CHILD_DIR) else {
        return;
    };
    let dev = MemDev::new(16 << 20, 4096);
    let fl = FuseLoop::attach(dev, &PathBuf::from(dir), &opts()).unwrap();
    println!("LOOP {}", fl.device_path().display());
    std::thread::sleep(Duration::from_secs(120));
    drop(fl);
}

#[test]
fn kill_9_of_the_server_leaves_a_recoverable_device() {
    require_host!();
    let dir = tempfile::tempdir().unwrap();
    let fuse_dir = dir.path().join("fuse");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child_serves_until_killed",
            "--nocapture",
        ])
        .env(CHILD_DIR, &fuse_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let loopdev = loop {
        let l = lines.next().expect("child exited early").unwrap();
        if let Some(p) = l.strip_prefix("LOOP ") {
            break PathBuf::from(p);
        }
    };
    let name = loopdev.file_name().unwrap().to_str().unwrap().to_string();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&loopdev)
        .unwrap();
    let (mut v, at) = aligned(4096);
    f.read_exact_at(&mut v[at..at + 4096], 0).unwrap();

    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();

    // The FUSE connection is aborted: I/O fails, nothing hangs.
    let t = Instant::now();
    let r = f.read_exact_at(&mut v[at..at + 4096], 8192);
    assert!(r.is_err(), "read after the server died succeeded");
    assert!(t.elapsed() < Duration::from_secs(30));
    drop(f);
    // Autoclear unbinds the loop device once its last opener is gone;
    // losetup -d is the manual way and must work too if it has not yet.
    let bound = format!("/sys/block/{name}/loop/backing_file");
    if Path::new(&bound).exists() {
        let _ = Command::new("losetup").arg("-d").arg(&loopdev).status();
    }
    wait_unbound(&name);
    // The dead FUSE mount unmounts normally.
    assert!(is_mountpoint(&fuse_dir));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let st = Command::new("umount").arg(&fuse_dir).status().unwrap();
        if st.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "dead FUSE mount cannot be unmounted"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!is_mountpoint(&fuse_dir));
}

/// The resize tests need root (FUSE mounts, loop devices) and nothing
/// else: without it they print why and pass, unless CI=true, where a
/// test that does not run is a failed one.
macro_rules! require_root {
    () => {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            let why = "not root (FUSE mount and loop devices need root)";
            assert_ne!(
                std::env::var("CI").as_deref(),
                Ok("true"),
                "CI=true, so this must run: {why}"
            );
            println!("not run: {why}");
            return;
        }
    };
}

/// The size of `/dev/loopN` as sysfs has it (not through the FuseLoop).
fn sysfs_bytes(dev: &Path) -> u64 {
    let name = dev.file_name().unwrap().to_str().unwrap();
    let s = std::fs::read_to_string(format!("/sys/block/{name}/size")).unwrap();
    s.trim().parse::<u64>().unwrap() * 512
}

/// Writes `data` at `off` of the loop device with O_DIRECT and fsync, and
/// reads it back the same way.
fn write_read_direct(dev: &Path, off: u64, data: &[u8]) -> std::io::Result<Vec<u8>> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)?;
    let (mut v, at) = aligned(data.len());
    v[at..at + data.len()].copy_from_slice(data);
    f.write_all_at(&v[at..at + data.len()], off)?;
    f.sync_all()?;
    v[at..at + data.len()].fill(0);
    f.read_exact_at(&mut v[at..at + data.len()], off)?;
    Ok(v[at..at + data.len()].to_vec())
}

#[test]
fn a_grown_device_grows_its_loop_device_online() {
    require_root!();
    let dir = tempfile::tempdir().unwrap();
    let dev = MemDev::new(16 << 20, 4096);
    let fl = FuseLoop::attach(dev.clone(), &dir.path().join("fuse"), &opts()).unwrap();
    let _dog = watchdog(&fl, WATCHDOG_SECS);
    let loopdev = fl.device_path().to_path_buf();
    assert_eq!(fl.loop_device().size().unwrap(), 16 << 20);
    assert_eq!(sysfs_bytes(&loopdev), 16 << 20);
    // Held open across the resize, as a mounted filesystem would.
    let held = std::fs::OpenOptions::new()
        .read(true)
        .open(&loopdev)
        .unwrap();
    let before = pattern(31, 64 << 10);
    let got = write_read_direct(&loopdev, (16 << 20) - (64 << 10), &before).unwrap();
    assert_eq!(got, before);
    // The write made the kernel forget the file's size; a stat has it ask
    // again and cache the answer for a minute.
    let file = fl.mount().file_path().to_path_buf();
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 16 << 20);

    dev.grow(40 << 20);
    // Not resized yet: the kernel still has 16 MiB for the file, and the
    // loop device still ends there.
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 16 << 20);
    assert_eq!(sysfs_bytes(&loopdev), 16 << 20);
    assert!(write_read_direct(&loopdev, 16 << 20, &pattern(1, 4096)).is_err());

    assert_eq!(fl.resize().unwrap(), 40 << 20);
    assert_eq!(sysfs_bytes(&loopdev), 40 << 20);
    assert_eq!(fl.loop_device().size().unwrap(), 40 << 20);
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 40 << 20);
    // Past the old end, across it, and at the new end.
    for (off, len, seed) in [
        (16u64 << 20, 1usize << 20, 32u64),
        ((16 << 20) - 8192, 16384, 33),
        ((40 << 20) - 65536, 65536, 34),
    ] {
        let data = pattern(seed, len);
        let got = write_read_direct(&loopdev, off, &data).unwrap();
        assert_eq!(got, data, "loop device bytes {off}+{len}");
        assert_eq!(
            dev.bytes(off as usize, len),
            data,
            "device bytes {off}+{len}"
        );
    }
    assert!(write_read_direct(&loopdev, 40 << 20, &pattern(2, 4096)).is_err());
    // Again without growth: nothing changes.
    assert_eq!(fl.resize().unwrap(), 40 << 20);
    drop(held);
    assert_eq!(dev.unaligned.load(Ordering::Relaxed), 0);
    let mut fl = fl;
    fl.close().unwrap();
}

#[test]
fn a_grown_mirrored_volume_grows_its_loop_device_and_both_copies_get_the_new_bytes() {
    use common::volumes::{self, VOLUME_BLOCK};
    use nvpool_initiator::Volume;
    use nvpool_layout::plan::LayoutBody;
    require_root!();
    const MIB: u64 = 1 << 20;
    let mut s = volumes::setup(2, LayoutBody::Raid1 { copies: 2 }, 4 * MIB, MIB, "ram:1M");
    let v = Arc::new(Volume::open(&s.plan, volumes::volume_opts()).unwrap());
    let dir = tempfile::tempdir().unwrap();
    let mut fl = FuseLoop::attach(v.clone(), &dir.path().join("fuse"), &opts()).unwrap();
    let _dog = watchdog(&fl, WATCHDOG_SECS);
    let loopdev = fl.device_path().to_path_buf();
    assert_eq!(fl.loop_device().block_size(), VOLUME_BLOCK as u32);
    let head = pattern(41, 256 << 10);
    assert_eq!(write_read_direct(&loopdev, MIB, &head).unwrap(), head);
    // Cached by the kernel for a minute from here (see the test above).
    let file = fl.mount().file_path().to_path_buf();
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 4 * MIB);

    let grown = s.grow(7 * MIB, 512);
    assert!(v.grow(&grown).unwrap());
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 4 * MIB);
    assert_eq!(fl.resize().unwrap(), 7 * MIB);
    assert_eq!(sysfs_bytes(&loopdev), 7 * MIB);
    // Across the old end into the new rows, and the last block.
    let tail = pattern(42, 2 * MIB as usize);
    let at = 4 * MIB - 64 * 1024;
    assert_eq!(write_read_direct(&loopdev, at, &tail).unwrap(), tail);
    let last = pattern(43, 4096);
    assert_eq!(
        write_read_direct(&loopdev, 7 * MIB - 4096, &last).unwrap(),
        last
    );
    fl.close().unwrap();
    // Both copies of every extent written hold the bytes (RAID1: row r is
    // extents 2r and 2r + 1, at the offset within the row).
    let expect = |off: u64, data: &[u8]| {
        let mut done = 0u64;
        while done < data.len() as u64 {
            let o = off + done;
            let (row, inside) = (o / MIB, o % MIB);
            let n = (MIB - inside).min(data.len() as u64 - done);
            let want = &data[done as usize..(done + n) as usize];
            for copy in 0..2 {
                let got = s.read_copy(row as usize * 2 + copy, inside, n);
                assert!(got == want, "copy {copy} of row {row} at {inside}+{n}");
            }
            done += n;
        }
    };
    expect(MIB, &head);
    expect(at, &tail);
    expect(7 * MIB - 4096, &last);
    drop(fl);
    let v = Arc::try_unwrap(v).expect("the FUSE mount let go of the volume");
    v.close().unwrap();
}
