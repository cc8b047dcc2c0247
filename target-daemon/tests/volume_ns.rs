//! Volume namespaces on loopback: a target serves a pooled volume (the
//! initiator's volume engine running inside it) to a host, over three
//! backing targets that hold the volume's extents in files.
//!
//! ```text
//!  host (nvpool_initiator::Device) ──► serving target: namespace volume:UUID
//!                                        │ Volume (RAID1 / RAID10), opened by a test VolumeSource
//!                         ┌──────────────┼──────────────┐
//!                     backing 0      backing 1      backing 2   (file extents, fault-injecting)
//! ```
//!
//! Every wait has a deadline: a test that would hang fails instead.

mod common;

use common::{pattern, scratch_file, subsystem, Daemon, HOST_A, NO_DIGESTS};
use nvpool_control::model::Uuid;
use nvpool_control::plan::{ConnectionPlan, LayoutBody, PlanExtent};
use nvpool_initiator::device::block_on;
use nvpool_initiator::{ConnectParams, Controller, Device, IoError, Volume, VolumeOptions};
use nvpool_target::backend::{
    Backend, BackendSpec, FaultBackend, FaultConfig, OpenedVolume, VolumeBackend, VolumeSource,
};
use nvpool_target::config::{AnaConfig, AnaState, SubsystemConfig};
use nvpool_target::Target;
use nvpool_testkit::wait_for;
use nvpool_wire::Status;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// The subsystem the serving target exports the volume namespace in.
const SERVE_NQN: &str = "nqn.2026-11.io.nvpool:volume-ns-serve";
/// The backing targets' subsystem holding the volume's extents.
const BACKING_NQN: &str = "nqn.2026-11.io.nvpool:volume-ns-backing";
/// The serving target's identity as a host of the backing targets.
const SERVER_HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:cccccccc-2222-4000-8000-00000000000c";
const MIB: u64 = 1 << 20;
const EXTENT: u64 = MIB;
const BLOCK: u64 = 4096;
const BACKING_TARGETS: usize = 3;
/// Longest any wait in these tests may take.
const WAIT: Duration = Duration::from_secs(30);

// ----- backing targets -----

/// A backing target: one file, each namespace an extent of it behind a
/// fault-injecting backend.
struct Backing {
    daemon: Option<Daemon>,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
    path: PathBuf,
    faults: Vec<Arc<FaultBackend>>,
}

impl Backing {
    fn start(namespaces: u32) -> Backing {
        let (dir, path) = scratch_file(u64::from(namespaces.max(1)) * EXTENT);
        let daemon = Daemon::start(&[subsystem(BACKING_NQN, &[SERVER_HOST], &[])]);
        let mut faults = Vec::new();
        for k in 0..namespaces {
            let spec = format!(
                "file:{},offset={},length={EXTENT}",
                path.display(),
                u64::from(k) * EXTENT
            );
            let inner = BackendSpec::parse(&spec)
                .and_then(|s| s.open())
                .expect("open the extent");
            let f = Arc::new(FaultBackend::new(inner));
            daemon
                .target
                .put_namespace_backend(BACKING_NQN, k + 1, f.clone())
                .expect("export the extent");
            faults.push(f);
        }
        Backing {
            addr: daemon.addr,
            daemon: Some(daemon),
            _dir: dir,
            path,
            faults,
        }
    }
}

/// Three backing targets holding a volume, and the plan to reach it.
struct Cluster {
    backing: Vec<Backing>,
    plan: ConnectionPlan,
}

/// Places every extent (row, member, copy) of a volume on backing target
/// (row + member × copies + copy) mod 3, so the copies of a member sit on
/// distinct targets, and starts the targets.
fn cluster(layout: LayoutBody, size: u64, uuid: u8) -> Cluster {
    let mut plan = ConnectionPlan {
        volume: Uuid([uuid; 16]),
        name: format!("vol-{uuid}"),
        host_nqn: SERVER_HOST.into(),
        size_bytes: size,
        block_bytes: BLOCK as u32,
        extent_bytes: EXTENT,
        layout,
        extents: Vec::new(),
    };
    let placed = nvpool_testkit::place(&plan.geometry(), BACKING_TARGETS);
    let mut count = [0u32; BACKING_TARGETS];
    for p in &placed {
        count[p.target] = count[p.target].max(p.nsid);
    }
    let backing: Vec<Backing> = count.iter().map(|&n| Backing::start(n)).collect();
    for p in placed {
        let b = &backing[p.target];
        plan.extents.push(PlanExtent {
            target: format!("backing-{}", p.target),
            addr: b.addr,
            rdma_addr: None,
            subsystem_nqn: BACKING_NQN.into(),
            nsid: p.nsid,
            device: b.path.display().to_string(),
            offset: u64::from(p.nsid - 1) * EXTENT,
            length: EXTENT,
            member: p.member,
            row: p.row,
            copy: p.copy,
        });
    }
    plan.validate().expect("the test builds a valid plan");
    Cluster { backing, plan }
}

impl Cluster {
    fn uuid(&self) -> String {
        self.plan.volume.to_string()
    }

    /// `volume:UUID,size=…,block_size=…` for this volume.
    fn spec(&self) -> String {
        format!(
            "volume:{},size={},block_size={}",
            self.uuid(),
            self.plan.size_bytes,
            self.plan.block_bytes
        )
    }

    /// Checks that every copy of every extent under `[off, off + data.len())`
    /// holds `data`, reading the backing files.
    #[track_caller]
    fn assert_copies_hold(&self, off: u64, data: &[u8]) {
        let g = self.plan.geometry();
        let segments = g
            .segments(off, data.len() as u64)
            .expect("inside the volume");
        for seg in segments {
            let first = seg.location.first_extent_index(&g);
            let want = &data[(seg.volume_offset - off) as usize..][..seg.len as usize];
            for c in 0..usize::from(g.copies) {
                let e = &self.plan.extents[first + c];
                let b = self
                    .backing
                    .iter()
                    .find(|b| b.addr == e.addr)
                    .expect("backing target");
                let f = std::fs::File::open(&b.path).expect("open backing file");
                let mut got = vec![0u8; seg.len as usize];
                f.read_exact_at(&mut got, e.offset + seg.location.offset_in_extent)
                    .expect("read backing file");
                assert!(
                    got == want,
                    "copy {c} of row {} member {} (on {}) misses volume bytes {}+{}",
                    e.row,
                    e.member,
                    e.target,
                    seg.volume_offset,
                    seg.len
                );
            }
        }
    }

    /// Adds `latency` to every operation of every backing namespace.
    fn set_latency(&self, latency: Duration) {
        for b in &self.backing {
            for f in &b.faults {
                f.set(FaultConfig {
                    latency,
                    ..FaultConfig::default()
                });
            }
        }
    }

    /// Stops backing target `t`: its listener and connections go.
    fn stop(&mut self, t: usize) {
        self.backing[t]
            .daemon
            .take()
            .expect("target running")
            .shutdown();
    }
}

// ----- the serving target's volume source -----

/// Opens the volumes it knows the plans of; counts opens and closed
/// sessions, and keeps a weak handle on each opened volume.
#[derive(Default)]
struct TestSource {
    plans: Mutex<HashMap<String, ConnectionPlan>>,
    opened: Mutex<Vec<Weak<Volume>>>,
    opens: AtomicUsize,
    sessions_closed: Arc<AtomicUsize>,
}

/// Stands for what follows the control plane for an open volume.
struct Session(Arc<AtomicUsize>);

impl Drop for Session {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

impl TestSource {
    fn new(c: &Cluster) -> Arc<TestSource> {
        let s = TestSource::default();
        s.plans.lock().unwrap().insert(c.uuid(), c.plan.clone());
        Arc::new(s)
    }

    /// The volume opened last, while it is open.
    fn volume(&self) -> Option<Arc<Volume>> {
        self.opened.lock().unwrap().last().and_then(Weak::upgrade)
    }

    fn sessions_closed(&self) -> usize {
        self.sessions_closed.load(Ordering::SeqCst)
    }
}

impl VolumeSource for TestSource {
    fn open(&self, volume: &str) -> Result<OpenedVolume, String> {
        let plan = self
            .plans
            .lock()
            .unwrap()
            .get(volume)
            .cloned()
            .ok_or_else(|| format!("volume {volume} is unknown"))?;
        let opts = VolumeOptions {
            queue_depth: 32,
            reconnect_delay: Duration::from_millis(100),
            connect_timeout: Duration::from_secs(1),
            ctrl_loss_timeout: Some(Duration::from_secs(2)),
            ..VolumeOptions::default()
        };
        let v = Arc::new(Volume::open(&plan, opts).map_err(|e| e.to_string())?);
        self.opened.lock().unwrap().push(Arc::downgrade(&v));
        self.opens.fetch_add(1, Ordering::SeqCst);
        Ok(OpenedVolume {
            volume: v,
            session: Box::new(Session(self.sessions_closed.clone())),
        })
    }
}

/// A serving target with `source` installed, exporting `namespaces` to HOST_A.
fn serving(source: Arc<TestSource>, namespaces: &[(u32, &str)]) -> Daemon {
    let target = Target::new(None).expect("target");
    target.set_volume_source(source);
    Daemon::start_with(target, &[subsystem(SERVE_NQN, &[HOST_A], namespaces)])
}

/// A serving target whose namespace 1 is a volume backend built here, so
/// the test sees its in-flight count.
fn serving_by_hand(c: &Cluster, source: Arc<TestSource>) -> (Daemon, Arc<VolumeBackend>) {
    let d = serving(source, &[]);
    let vb = Arc::new(VolumeBackend::new(
        c.uuid(),
        c.plan.size_bytes,
        c.plan.block_bytes,
        d.target.volumes().clone(),
    ));
    d.target
        .put_namespace_backend(SERVE_NQN, 1, vb.clone())
        .expect("add the volume namespace");
    (d, vb)
}

fn backend_of(t: &Target, nsid: u32) -> Arc<dyn Backend> {
    t.subsystem(SERVE_NQN).expect("subsystem").namespaces[&nsid]
        .backend
        .clone()
}

// ----- the host -----

/// Namespace `nsid` of the serving target, as HOST_A sees it.
fn connect_host(addr: SocketAddr, nsid: u32) -> Arc<Device> {
    let mut p = ConnectParams::new(addr, SERVE_NQN);
    p.hostnqn = HOST_A.into();
    p.hostid = common::host_id(HOST_A);
    p.io_queues = 2;
    p.queue_depth = 32;
    p.reconnect_delay = Duration::from_millis(100);
    p.ctrl_loss_timeout = Duration::from_secs(5);
    p.connect_timeout = Duration::from_secs(2);
    let c = Controller::connect(p).expect("host connects");
    Arc::new(Device::open(c, nsid, 2).expect("open the namespace"))
}

/// Runs `f` on a thread of its own; fails the test when it takes longer
/// than `WAIT` (an I/O that hangs) or panics.
#[track_caller]
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::sync_channel(1);
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(WAIT) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what} did not finish within {WAIT:?}"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{what} panicked"),
    }
}

fn write(dev: &Arc<Device>, off: u64, data: Vec<u8>) -> Result<(), IoError> {
    let d = dev.clone();
    within("a write", move || block_on(d.write(off, data, false)).0)
}

fn read(dev: &Arc<Device>, off: u64, len: usize) -> Result<Vec<u8>, IoError> {
    let d = dev.clone();
    within("a read", move || {
        let (r, b) = block_on(d.read(off, vec![0xEE; len]));
        r.map(|()| b)
    })
}

fn flush(dev: &Arc<Device>) -> Result<(), IoError> {
    let d = dev.clone();
    within("a flush", move || block_on(d.flush()))
}

#[track_caller]
fn expect_status<T: std::fmt::Debug>(r: Result<T, IoError>, want: Status) {
    match r {
        Err(IoError::Status(s)) if (s.sct, s.sc) == (want.sct, want.sc) => {}
        other => panic!("want {want}, got {other:?}"),
    }
}

#[track_caller]
fn read_check(dev: &Arc<Device>, off: u64, want: &[u8]) {
    let got = read(dev, off, want.len()).unwrap_or_else(|e| panic!("read at {off}: {e}"));
    assert!(got == want, "volume bytes {off}+{} differ", want.len());
}

// ----- tests -----

#[test]
fn io_fails_while_inactive_and_a_raid1_volume_serves_after_activate() {
    let c = cluster(LayoutBody::Raid1 { copies: 2 }, 4 * MIB, 0x11);
    let src = TestSource::new(&c);
    let spec = c.spec();
    let s = serving(src.clone(), &[(1, &spec)]);
    // Saved as its spec: after a restart the namespace is there again.
    let saved = s.target.running_config();
    assert!(
        saved
            .subsystems
            .iter()
            .flat_map(|x| &x.namespaces)
            .any(|n| n.backend == spec),
        "the volume namespace is saved as {spec}"
    );
    let backend = backend_of(&s.target, 1);
    assert_eq!(backend.describe(), format!("volume {}", c.uuid()));
    // The target may have activated it when it was published.
    backend.deactivate();

    let dev = connect_host(s.addr, 1);
    assert_eq!(dev.size(), c.plan.size_bytes, "the geometry of the spec");
    assert_eq!(u64::from(dev.block_size()), BLOCK);

    // Inactive: every I/O fails at once, with a path error (ANA
    // inaccessible, no DNR) that sends a multipath host elsewhere.
    expect_status(read(&dev, 0, 4096), Status::ANA_INACCESSIBLE);
    expect_status(write(&dev, 0, vec![1; 4096]), Status::ANA_INACCESSIBLE);
    expect_status(flush(&dev), Status::ANA_INACCESSIBLE);
    assert!(!backend.failed(), "inactive is not a device failure");

    backend.activate().expect("activate");
    // Opened once more than closed (twice if publishing activated it).
    assert_eq!(src.opens.load(Ordering::SeqCst), src.sessions_closed() + 1);
    let size = c.plan.size_bytes;
    let writes: [(u64, usize); 4] = [
        // First LBAs.
        (0, 16 << 10),
        // Across the middle, where one extent ends and the next begins.
        (size / 2 - 8192, 16 << 10),
        // Larger than in-capsule data: through R2T.
        (EXTENT + (64 << 10), 128 << 10),
        // The last LBA.
        (size - BLOCK, BLOCK as usize),
    ];
    for (i, &(off, len)) in writes.iter().enumerate() {
        let data = pattern(i as u64 + 1, len);
        write(&dev, off, data.clone()).unwrap_or_else(|e| panic!("write at {off}: {e}"));
        read_check(&dev, off, &data);
        c.assert_copies_hold(off, &data);
    }
    flush(&dev).expect("flush");

    // Write Zeroes and Deallocate reach the volume too.
    let d = dev.clone();
    within("write zeroes", move || {
        block_on(d.write_zeroes(0, 8192, false))
    })
    .expect("zeroes");
    read_check(&dev, 0, &[0; 8192]);
    c.assert_copies_hold(0, &[0; 8192]);
    let d = dev.clone();
    within("deallocate", move || block_on(d.discard(EXTENT, 64 << 10))).expect("deallocate");
    assert!(!backend.failed());

    // Deactivated: the session goes, the volume closes, I/O fails again.
    backend.deactivate();
    assert_eq!(src.sessions_closed(), src.opens.load(Ordering::SeqCst));
    assert!(src.volume().is_none(), "the volume is closed");
    expect_status(read(&dev, 0, 4096), Status::ANA_INACCESSIBLE);
    expect_status(write(&dev, 0, vec![1; 4096]), Status::ANA_INACCESSIBLE);
    assert!(!backend.failed());

    // Active again: the bytes are where they were.
    backend.activate().expect("activate again");
    let (off, len) = writes[3];
    read_check(&dev, off, &pattern(4, len));
    backend.deactivate();
}

/// 32 host threads keep one verified I/O each in flight (write a pattern,
/// read it back) on their own regions; a backing target stops mid-run and
/// I/O carries on, on the other copies, without an error.
#[test]
fn qd32_verified_io_survives_a_dead_backing_target() {
    const THREADS: u64 = 32;
    let size = 8 * MIB;
    let region = size / THREADS;
    let mut c = cluster(LayoutBody::Raid1 { copies: 2 }, size, 0x22);
    let src = TestSource::new(&c);
    let s = serving(src.clone(), &[(1, &c.spec())]);
    let backend = backend_of(&s.target, 1);
    backend.activate().expect("activate");
    let dev = connect_host(s.addr, 1);

    let ops = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let first_error: Mutex<Option<String>> = Mutex::new(None);
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (dev, ops, stop, first_error) = (&dev, &ops, &stop, &first_error);
            scope.spawn(move || {
                let base = t * region;
                let mut model = vec![0u8; region as usize];
                let mut k = 0u64;
                let fail = |what: String| {
                    first_error.lock().unwrap().get_or_insert(what);
                    stop.store(true, Ordering::SeqCst);
                };
                while !stop.load(Ordering::SeqCst) {
                    let len = BLOCK * (1 + (t + k) % 16);
                    let slots = (region - len) / BLOCK + 1;
                    let off = ((k * 7 + t) % slots) * BLOCK;
                    let data = pattern(t << 32 | k, len as usize);
                    let (r, _) = block_on(dev.write(base + off, data.clone(), false));
                    if let Err(e) = r {
                        return fail(format!("thread {t} write {k} at {}: {e}", base + off));
                    }
                    model[off as usize..(off + len) as usize].copy_from_slice(&data);
                    let (r, got) = block_on(dev.read(base + off, vec![0; len as usize]));
                    match r {
                        Err(e) => {
                            return fail(format!("thread {t} read {k} at {}: {e}", base + off))
                        }
                        Ok(()) if got != data => {
                            return fail(format!("thread {t} read {k}: other bytes"))
                        }
                        Ok(()) => {}
                    }
                    ops.fetch_add(1, Ordering::SeqCst);
                    k += 1;
                }
                // Everything this thread wrote, read back whole.
                let (r, got) = block_on(dev.read(base, vec![0; region as usize]));
                match r {
                    Err(e) => fail(format!("thread {t} final read: {e}")),
                    Ok(()) if got != model => fail(format!("thread {t}: region differs")),
                    Ok(()) => {}
                }
            });
        }
        let running = |n: usize| ops.load(Ordering::SeqCst) >= n || stop.load(Ordering::SeqCst);
        wait_for("I/O under way", WAIT, || running(THREADS as usize * 8));
        // Backing target 1 holds a copy of every other row.
        c.stop(1);
        let volume = src.volume().expect("volume open");
        wait_for("the copies on the stopped target failed", WAIT, || {
            stop.load(Ordering::SeqCst) || !volume.health().failed_extents.is_empty()
        });
        let after = ops.load(Ordering::SeqCst);
        wait_for("I/O after the failover", WAIT, || {
            running(after + THREADS as usize * 8)
        });
        stop.store(true, Ordering::SeqCst);
    });
    if let Some(e) = first_error.lock().unwrap().take() {
        panic!("{e}");
    }
    let volume = src.volume().expect("volume open");
    let health = volume.health();
    assert!(!health.failed_extents.is_empty() && health.lost.is_empty());
    drop(volume);
    assert!(!backend.failed());
    backend.deactivate();
    assert_eq!(src.sessions_closed(), 1);
}

/// Deactivating waits for the I/O in flight (it completes, and reached the
/// volume); I/O after it fails until the next activation.
#[test]
fn raid10_deactivate_waits_for_io_in_flight_and_later_io_fails() {
    const WRITES: u64 = 8;
    let layout = LayoutBody::Raid10 {
        stripe_bytes: 64 << 10,
        width: 2,
        copies: 2,
    };
    let c = cluster(layout, 4 * MIB, 0x33);
    let src = TestSource::new(&c);
    let (s, vb) = serving_by_hand(&c, src.clone());
    vb.activate().expect("activate");
    assert!(vb.is_active());
    let dev = connect_host(s.addr, 1);
    // Stripe units on both members, in both rows.
    let at = |i: u64| (i * 448) << 10;
    for i in 0..WRITES {
        write(&dev, at(i), pattern(100 + i, 64 << 10)).expect("write");
    }

    c.set_latency(Duration::from_millis(200));
    let (tx, rx) = mpsc::sync_channel(WRITES as usize);
    for i in 0..WRITES {
        let (d, tx) = (dev.clone(), tx.clone());
        std::thread::spawn(move || {
            let (r, _) = block_on(d.write(at(i), pattern(200 + i, 64 << 10), false));
            let _ = tx.send((i, r));
        });
    }
    wait_for("every write in the volume", WAIT, || {
        vb.in_flight() >= WRITES as usize
    });
    vb.deactivate();
    assert!(!vb.is_active());
    assert_eq!(
        vb.in_flight(),
        0,
        "deactivate returns after the I/O in flight"
    );
    assert_eq!(src.sessions_closed(), 1);
    for _ in 0..WRITES {
        let (i, r) = rx.recv_timeout(WAIT).expect("the write was answered");
        r.unwrap_or_else(|e| panic!("write {i}, in flight at deactivate: {e}"));
    }
    c.set_latency(Duration::ZERO);

    expect_status(read(&dev, 0, 4096), Status::ANA_INACCESSIBLE);
    expect_status(write(&dev, 0, vec![1; 4096]), Status::ANA_INACCESSIBLE);
    assert!(!vb.failed());

    vb.activate().expect("activate again");
    for i in 0..WRITES {
        let data = pattern(200 + i, 64 << 10);
        read_check(&dev, at(i), &data);
        c.assert_copies_hold(at(i), &data);
    }
    vb.deactivate();
}

/// A host that goes away with commands in the volume leaves no slot
/// behind: the completions free them, and the target shuts down at once.
#[test]
fn closing_the_host_connection_with_io_in_flight_strands_no_slot() {
    const IOS: u64 = 16;
    let c = cluster(LayoutBody::Raid1 { copies: 2 }, 4 * MIB, 0x44);
    let src = TestSource::new(&c);
    let (s, vb) = serving_by_hand(&c, src.clone());
    vb.activate().expect("activate");

    c.set_latency(Duration::from_millis(200));
    let (admin, mut q) = common::controller(s.addr, NO_DIGESTS, SERVE_NQN, HOST_A);
    let blocks_per_io = 4;
    for i in 0..IOS {
        let lba = i * 16;
        if i % 2 == 0 {
            // In-capsule writes go to the volume at once.
            let data = pattern(300 + i, BLOCK as usize);
            q.submit_write(common::write_cmd(1, lba, 1, false), data, true);
        } else {
            q.submit(common::read_cmd(1, lba, blocks_per_io, BLOCK as usize));
        }
    }
    wait_for("the commands in the volume", WAIT, || {
        vb.in_flight() >= IOS as usize
    });
    q.close();
    admin.close();
    wait_for("the host's controller gone", WAIT, || {
        s.target.controllers().iter().all(|c| c.hostnqn != HOST_A)
    });
    wait_for("every operation completed", WAIT, || vb.in_flight() == 0);
    c.set_latency(Duration::ZERO);

    // The target serves on: a new host reads what the old one wrote.
    let dev = connect_host(s.addr, 1);
    read_check(&dev, 0, &pattern(300, BLOCK as usize));
    drop(dev);

    // No zombie waits for a completion: shutdown ends well inside its
    // drain deadline (a stranded slot would hold it past that).
    let t0 = Instant::now();
    s.shutdown();
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(nvpool_target::limits::SHUTDOWN_DRAIN_MS / 2),
        "shutdown took {took:?}"
    );
    assert!(!vb.failed());
    vb.deactivate();
    assert_eq!(src.sessions_closed(), 1);
}

// ----- hand-over and fence with writes in the engine (C19) -----

/// Writes the host keeps in the volume across the end of its path's
/// term: enough that some of them wait, on every backing connection,
/// behind one the backing target is still executing when the path stops
/// serving.
const FENCE_WRITES: u64 = 8;
/// Latency of every backing operation in these tests.
const FENCE_LATENCY: Duration = Duration::from_millis(500);

/// What a fence does to an old owner's engine, made deterministic: every
/// copy fails the writes still waiting at the backing targets, so each of
/// those writes fails in the engine with no copy left that took it (as
/// when the fence kills the engine's controllers and its reconnects are
/// refused, sc 0x82, until the controller-loss timeout).
fn fence(c: &Cluster) {
    for b in &c.backing {
        for f in &b.faults {
            f.set(FaultConfig {
                latency: FENCE_LATENCY,
                fail_writes: true,
                ..FaultConfig::default()
            });
        }
    }
}

/// Sends `FENCE_WRITES` single-block writes (all on row 0, so every
/// backing connection of the row's copies holds several), each from a
/// thread of its own; their results arrive on the returned channel.
fn fence_writes(dev: &Arc<Device>) -> mpsc::Receiver<(u64, Result<(), IoError>)> {
    let (tx, rx) = mpsc::sync_channel(FENCE_WRITES as usize);
    for i in 0..FENCE_WRITES {
        let (d, tx) = (dev.clone(), tx.clone());
        std::thread::spawn(move || {
            let (r, _) = block_on(d.write(i * BLOCK, pattern(500 + i, BLOCK as usize), false));
            let _ = tx.send((i, r));
        });
    }
    rx
}

/// Every write is answered: either it completed (it reached the copies
/// before the fence) or it failed with ANA inaccessible, a path status a
/// multipath host retries on another path. Never a media error (Write
/// Fault, which the Linux host reports as a critical medium error and
/// does not retry), never anything else. Returns how many got the path
/// status.
#[track_caller]
fn expect_path_status_or_success(rx: &mpsc::Receiver<(u64, Result<(), IoError>)>) -> usize {
    let mut path_errors = 0;
    for _ in 0..FENCE_WRITES {
        let (i, r) = rx.recv_timeout(WAIT).expect("every write is answered");
        match r {
            Ok(()) => {}
            Err(IoError::Status(s))
                if (s.sct, s.sc) == (Status::ANA_INACCESSIBLE.sct, Status::ANA_INACCESSIBLE.sc) =>
            {
                assert!(
                    !s.dnr,
                    "write {i}: a path status must let the host retry: {s}"
                );
                path_errors += 1;
            }
            Err(e) => panic!("write {i}, in the engine across the fence, failed with {e}"),
        }
    }
    path_errors
}

/// A planned hand-over whose fence comes while writes are still in the
/// old owner's engine (its deactivation waits for them; the control plane
/// fences once it answered, or once that answer timed out): the engine's
/// controllers to the extents are killed and its reconnects refused, so
/// the writes fail in the engine, after the namespace stopped serving the
/// volume. Each is answered with a path status, the backend is not
/// failed, and the namespace serves again once activated.
#[test]
fn writes_failed_by_a_fence_during_deactivation_get_a_path_status() {
    let c = cluster(LayoutBody::Raid1 { copies: 2 }, 4 * MIB, 0x55);
    let src = TestSource::new(&c);
    // No ANA on this path: only the backend knows it stopped serving.
    let (s, vb) = serving_by_hand(&c, src.clone());
    vb.activate().expect("activate");
    let dev = connect_host(s.addr, 1);
    write(&dev, 0, pattern(1, BLOCK as usize)).expect("a write before the hand-over");

    c.set_latency(FENCE_LATENCY);
    let rx = fence_writes(&dev);
    wait_for("every write in the volume", WAIT, || {
        vb.in_flight() >= FENCE_WRITES as usize
    });
    let closer = {
        let vb = vb.clone();
        std::thread::spawn(move || vb.deactivate())
    };
    wait_for("the namespace to stop serving", WAIT, || !vb.is_active());
    assert!(vb.in_flight() > 0, "the writes are still in the engine");
    fence(&c);
    let path_errors = expect_path_status_or_success(&rx);
    assert!(
        path_errors > 0,
        "no write failed in the engine: the test did not put one across the fence"
    );
    closer.join().expect("deactivate");
    assert_eq!(vb.in_flight(), 0);
    assert!(
        !vb.failed(),
        "a fenced engine's errors are no device failure"
    );
    // Inactive now: I/O gets the same path status at once.
    expect_status(write(&dev, 0, vec![1; 4096]), Status::ANA_INACCESSIBLE);
}

/// The owner's lease runs out while writes are in its engine (the control
/// plane stopped renewing it, and takes the volume over after the lease):
/// the backend still has the volume open, but the path no longer serves,
/// so the writes the fence then fails are answered with the path's ANA
/// status, not a media error.
#[test]
fn writes_failed_by_a_fence_after_the_lease_ran_out_get_a_path_status() {
    // Long enough that the writes reach the engine well inside it, even on
    // a busy machine; the backing targets hold them past it.
    const LEASE_MS: u64 = 2_000;
    let c = cluster(LayoutBody::Raid1 { copies: 2 }, 4 * MIB, 0x66);
    let src = TestSource::new(&c);
    let target = Target::new(None).expect("target");
    target.set_volume_source(src.clone());
    let sub = SubsystemConfig {
        ana: Some(AnaConfig {
            state: AnaState::Optimized,
            cntlid_min: 1,
            cntlid_max: 0x0FFF,
            lease: true,
        }),
        ..subsystem(SERVE_NQN, &[HOST_A], &[])
    };
    let s = Daemon::start_with(target, &[sub]);
    let vb = Arc::new(VolumeBackend::new(
        c.uuid(),
        c.plan.size_bytes,
        c.plan.block_bytes,
        s.target.volumes().clone(),
    ));
    // Optimized as configured: published, the namespace opens the volume.
    s.target
        .put_namespace_backend(SERVE_NQN, 1, vb.clone())
        .expect("add the volume namespace");
    assert!(vb.is_active());
    let dev = connect_host(s.addr, 1);

    c.set_latency(Duration::from_millis(LEASE_MS / 2));
    // The owner's one renewal (a lease never moves backwards).
    let until = s.target.now_ms() + LEASE_MS;
    s.target.renew_leases(&[SERVE_NQN], until);
    let rx = fence_writes(&dev);
    wait_for("every write in the volume", WAIT, || {
        vb.in_flight() >= FENCE_WRITES as usize
    });
    assert!(
        s.target.now_ms() < until,
        "the writes reached the volume only after the lease: the test proves nothing"
    );
    wait_for("the lease to run out", WAIT, || s.target.now_ms() > until);
    let effective = s
        .target
        .subsystem(SERVE_NQN)
        .expect("subsystem")
        .ana
        .as_ref()
        .map(|a| a.effective(s.target.now_ms()));
    assert_eq!(effective, Some(AnaState::Inaccessible));
    assert!(vb.in_flight() > 0, "the writes are still in the engine");
    // Only now, as the control plane does after the lease.
    fence(&c);
    let path_errors = expect_path_status_or_success(&rx);
    assert!(
        path_errors > 0,
        "no write failed in the engine: the test did not put one across the fence"
    );
    assert!(
        vb.is_active(),
        "the path answered by its lease, not by a deactivation"
    );
    vb.deactivate();
}
