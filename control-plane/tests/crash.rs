//! Crash safety of the embedded store and the cluster state: a child
//! process hammers a redb-backed cluster with volume creates, grows and
//! deletes from two threads and is killed with SIGKILL at a random moment;
//! the parent reopens the store and checks, every cycle:
//!
//! - the store opens (redb repairs the file) and its revision never goes back;
//! - the state is consistent: no overlapping or double-allocated extents,
//!   every volume complete, name index and pools coherent, every copy job
//!   writing only a stale copy and reading an in-sync one (`Cluster::check`);
//! - durability: every operation the child saw committed is there (created
//!   volumes exist unless a delete of them had started, deleted ones are
//!   gone, grown ones are at least that large), and no volume exists that
//!   the child never started to create.
//!
//! The child is this test executable itself, re-run with `NVPOOL_CRASH_WORKER`
//! set so that `crash_worker` enters worker mode; it reports each operation
//! on stdout as `BEGIN op uuid [size]` before and `OK op uuid [size]` after.

use nvpool_control::clock::SystemClock;
use nvpool_control::limits::EXTENT_BYTES_MIN;
use nvpool_control::model::{Device, Layout, Uuid, VolumeSpec};
use nvpool_control::state::{Cluster, StateConfig, StateError, TargetRegistration};
use nvpool_control::store::{RedbStore, Store};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const WORKER_ENV: &str = "NVPOOL_CRASH_WORKER";
const E: u64 = EXTENT_BYTES_MIN;
/// Kill cycles. Each runs the child for 150..=450 ms.
const CYCLES: u64 = 8;
/// A worker left behind by a dead parent stops by itself after this long.
const WORKER_LIFETIME: Duration = Duration::from_secs(30);

/// xorshift64*: enough randomness for choosing operations, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn cluster(dir: &std::path::Path) -> Cluster {
    let store: Arc<dyn Store> = Arc::new(RedbStore::open_in_dir(dir).expect("store opens"));
    let config = StateConfig {
        extent_bytes: E,
        ..StateConfig::default()
    };
    Cluster::new(store, Arc::new(SystemClock), config).unwrap()
}

fn registration(i: usize) -> TargetRegistration {
    TargetRegistration {
        id: format!("t{i}"),
        name: format!("host{i}"),
        addr: format!("127.0.0.1:{}", 4420 + i).parse().unwrap(),
        admin_addr: format!("127.0.0.1:{}", 5420 + i).parse().unwrap(),
        labels: [("rack".to_string(), format!("r{}", i % 3))].into(),
        devices: (0..2)
            .map(|d| Device {
                id: format!("d{d}"),
                backend: format!("ram:{}", 48 * E),
                capacity_bytes: 48 * E,
                labels: BTreeMap::new(),
            })
            .collect(),
        rdma_addr: None,
        admin_token: None,
    }
}

fn worker(dir: &std::path::Path) {
    let c = cluster(dir);
    for i in 0..6 {
        c.register_target(&registration(i)).unwrap();
    }
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        ^ u64::from(std::process::id()) << 32;
    let live: Mutex<Vec<Uuid>> = Mutex::new(
        c.volumes()
            .unwrap()
            .into_iter()
            .map(|v| v.volume.uuid)
            .collect(),
    );
    let deadline = Instant::now() + WORKER_LIFETIME;
    std::thread::scope(|s| {
        for t in 0..2u64 {
            // Each thread acts as its own control-plane process on the
            // shared store: only compare-and-swap keeps them apart.
            let c =
                Cluster::new(c.store().clone(), Arc::new(SystemClock), c.config().clone()).unwrap();
            let live = &live;
            s.spawn(move || {
                let c = &c;
                let mut rng = Rng(seed.wrapping_add(t.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1);
                while Instant::now() < deadline {
                    step(c, live, &mut rng);
                }
            });
        }
    });
}

fn step(c: &Cluster, live: &Mutex<Vec<Uuid>>, rng: &mut Rng) {
    let roll = rng.below(100);
    let pick = {
        let mut l = live.lock().unwrap();
        if l.is_empty() || roll < 60 {
            None
        } else {
            // Take it out so the other thread does not operate on it too.
            let i = rng.below(l.len() as u64) as usize;
            Some(l.swap_remove(i))
        }
    };
    match pick {
        None => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&rng.next().to_le_bytes());
            bytes[8..].copy_from_slice(&rng.next().to_le_bytes());
            let uuid = Uuid(bytes);
            let layout = match rng.below(4) {
                0 => Layout::Concat,
                1 => Layout::Raid0 {
                    stripe_bytes: 65536,
                    width: 3,
                },
                2 => Layout::Raid1 { copies: 2 },
                _ => Layout::Raid10 {
                    stripe_bytes: 4096,
                    width: 2,
                    copies: 3,
                },
            };
            let spec = VolumeSpec {
                uuid,
                name: uuid.to_string(),
                size_bytes: (1 + rng.below(4 * 256)) * 4096,
                layout,
                pool: None,
            };
            println!("@@ BEGIN create {uuid}");
            match c.create_volume(&spec) {
                Ok(_) => {
                    println!("@@ OK create {uuid}");
                    live.lock().unwrap().push(uuid);
                }
                Err(StateError::Placement(_)) => println!("@@ FULL create {uuid}"),
                Err(e) => panic!("create: {e}"),
            }
        }
        Some(uuid) if roll < 75 => {
            // Detach every host first (a delete of an attached volume is
            // refused), now and then as a forced detach that leaves stale
            // exports behind on one target.
            for a in c.volume_attachments(&uuid).unwrap() {
                let host = a.host_nqn;
                println!("@@ BEGIN detach {uuid} {host}");
                let (a, by_target) = c.begin_detach(&uuid, &host).unwrap();
                let mut stale = BTreeMap::new();
                if rng.below(2) == 0 {
                    if let Some((t, xs)) = by_target.into_iter().next() {
                        stale.insert(t, xs);
                    }
                }
                c.finish_detach(&a.volume, &host, &stale).unwrap();
                println!("@@ OK detach {uuid} {host}");
            }
            println!("@@ BEGIN delete {uuid}");
            c.delete_volume(&uuid).unwrap();
            println!("@@ OK delete {uuid}");
            // Sometimes a target "reconciles": its stale exports go.
            if rng.below(3) == 0 {
                let t = format!("t{}", rng.below(6));
                if let Some((_, version)) = c.stale_exports(&t).unwrap() {
                    c.clear_stale_exports(&t, version).unwrap();
                }
            }
        }
        Some(uuid) if roll < 90 => {
            let host = format!("nqn.2014-08.org.nvmexpress:uuid:host-{}", rng.below(3));
            println!("@@ BEGIN attach {uuid} {host}");
            c.begin_attach(&uuid, &host).unwrap();
            c.finish_attach(&uuid, &host).unwrap();
            println!("@@ OK attach {uuid} {host}");
            live.lock().unwrap().push(uuid);
        }
        Some(uuid) if roll < 95 => {
            println!("@@ BEGIN resync {uuid}");
            resync_step(c, &uuid, rng);
            println!("@@ OK resync {uuid}");
            live.lock().unwrap().push(uuid);
        }
        Some(uuid) => {
            let size = c.volume(&uuid).unwrap().volume.size_bytes + (1 + rng.below(512)) * 4096;
            println!("@@ BEGIN grow {uuid} {size}");
            match c.resize_volume(&uuid, size) {
                Ok(_) => println!("@@ OK grow {uuid} {size}"),
                Err(StateError::Placement(_)) => println!("@@ FULL grow {uuid} {size}"),
                Err(e) => panic!("grow: {e}"),
            }
            live.lock().unwrap().push(uuid);
        }
    }
}

/// One step of a copy's life on a mirrored volume: a host reports a copy
/// failed, a job starts on it, moves through its states, and ends done or
/// failed (the heal loop's transitions, without targets).
fn resync_step(c: &Cluster, uuid: &Uuid, rng: &mut Rng) {
    let view = c.volume(uuid).unwrap();
    let copies = u32::from(view.volume.layout.copies());
    if copies < 2 {
        return;
    }
    let host = "nqn.2014-08.org.nvmexpress:uuid:host-0";
    if c.attachment(uuid, host).is_err() {
        println!("@@ BEGIN attach {uuid} {host}");
        c.begin_attach(uuid, host).unwrap();
        c.finish_attach(uuid, host).unwrap();
        println!("@@ OK attach {uuid} {host}");
    }
    let cs = c.copy_state(uuid).unwrap();
    match cs.jobs.first() {
        None if view.failed_extents.is_empty() && rng.below(2) == 0 => {
            let e = rng.below(u64::from(copies)) as u32;
            c.report_failed_extents(uuid, host, &[e]).unwrap();
        }
        None if view.failed_extents.is_empty() => {
            // Move a copy to a new extent (as a drain or a rebalance does).
            let e = rng.below(u64::from(copies)) as u32;
            let k = nvpool_control::resync::Candidate {
                volume: *uuid,
                extent: e,
                source: e,
                kind: nvpool_control::resync::CopyKind::Move,
                to: None,
            };
            match c.create_job(&k) {
                Ok(_) | Err(StateError::Placement(_)) => {}
                Err(e) => panic!("create a move: {e}"),
            }
        }
        None => {
            let mine: Vec<_> = c
                .resync_candidates(0)
                .unwrap()
                .into_iter()
                .filter(|k| k.volume == *uuid)
                .collect();
            if let Some(k) = mine.first() {
                c.create_job(k).unwrap();
            }
        }
        Some(j) => {
            use nvpool_control::resync::JobState;
            match j.state {
                JobState::Arming => {
                    c.job_mirroring(uuid, j.id).unwrap();
                }
                JobState::Mirroring => {
                    for a in c.volume_attachments(uuid).unwrap() {
                        c.confirm_sync(uuid, &a.host_nqn, j.id, 1, Some(&[0]))
                            .unwrap();
                    }
                    c.job_copying(uuid, j.id).unwrap();
                }
                JobState::Copying if j.dest.is_some() && rng.below(3) != 0 => {
                    c.job_switching(uuid, j.id).unwrap();
                }
                JobState::Copying => {
                    let error = (rng.below(3) == 0).then_some("copier failed");
                    c.finish_job(uuid, j.id, error).unwrap();
                }
                JobState::Switching => {
                    for a in c.volume_attachments(uuid).unwrap() {
                        c.confirm_sync(uuid, &a.host_nqn, j.id, 1, None).unwrap();
                    }
                    assert!(c.job_confirmed(uuid, j.id).unwrap());
                    c.finish_job(uuid, j.id, None).unwrap();
                }
            }
        }
    }
}

/// What the parent knows from the child's reports, across all cycles.
#[derive(Default)]
struct Expect {
    started: BTreeSet<String>,
    created: BTreeSet<String>,
    delete_started: BTreeSet<String>,
    deleted: BTreeSet<String>,
    grown: BTreeMap<String, u64>,
    attach_started: BTreeSet<(String, String)>,
    ok_ops: usize,
    /// Cycles killed while an operation was under way.
    killed_in_flight: usize,
}

impl Expect {
    fn absorb(&mut self, output: &str) {
        let mut in_flight = BTreeSet::new();
        for line in output.lines() {
            // The test harness may print on the same line before ours.
            let Some(at) = line.find("@@ ") else {
                continue;
            };
            let words: Vec<&str> = line[at + 3..].split_whitespace().collect();
            if let [kind, op, u, ..] = words[..] {
                if kind == "BEGIN" {
                    in_flight.insert((op, u));
                } else {
                    in_flight.remove(&(op, u));
                }
            }
            match words[..] {
                ["BEGIN", "create", u] => {
                    self.started.insert(u.into());
                }
                ["OK", "create", u] => {
                    self.created.insert(u.into());
                    self.ok_ops += 1;
                }
                ["BEGIN", "delete", u] => {
                    self.delete_started.insert(u.into());
                }
                ["OK", "delete", u] => {
                    self.deleted.insert(u.into());
                    self.ok_ops += 1;
                }
                ["BEGIN", "attach", u, h] => {
                    self.attach_started.insert((u.into(), h.into()));
                }
                ["OK", "attach", ..] | ["OK", "detach", ..] => self.ok_ops += 1,
                ["OK", "grow", u, size] => {
                    let size: u64 = size.parse().unwrap();
                    let g = self.grown.entry(u.into()).or_default();
                    *g = (*g).max(size);
                    self.ok_ops += 1;
                }
                _ => {}
            }
        }
        if !in_flight.is_empty() {
            self.killed_in_flight += 1;
        }
    }

    fn verify(&self, c: &Cluster) {
        let volumes: BTreeMap<String, u64> = c
            .volumes()
            .unwrap()
            .into_iter()
            .map(|v| (v.volume.uuid.to_string(), v.volume.size_bytes))
            .collect();
        for u in volumes.keys() {
            assert!(self.started.contains(u), "volume {u} was never created");
            assert!(!self.deleted.contains(u), "deleted volume {u} is back");
        }
        for u in &self.created {
            if !self.delete_started.contains(u) {
                assert!(volumes.contains_key(u), "committed volume {u} is lost");
            }
        }
        for a in c.attachments().unwrap() {
            let k = (a.volume.to_string(), a.host_nqn.clone());
            assert!(
                self.attach_started.contains(&k),
                "attachment {k:?} was never made"
            );
        }
        for (u, &size) in &self.grown {
            if let Some(&now) = volumes.get(u) {
                assert!(now >= size, "volume {u} lost a committed grow to {size}");
            }
        }
    }
}

#[test]
fn crash_worker() {
    // Worker mode only when the parent test re-runs this executable.
    if let Some(dir) = std::env::var_os(WORKER_ENV) {
        worker(std::path::Path::new(&dir));
    }
}

#[test]
fn kill_9_during_mutations_leaves_a_consistent_store() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut rng = Rng(0x5eed_1234_abcd_ef01);
    let mut expect = Expect::default();
    let mut last_revision = 0;
    for cycle in 0..CYCLES {
        let mut child = Command::new(&exe)
            .args(["--exact", "crash_worker", "--nocapture", "--test-threads=1"])
            .env(WORKER_ENV, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        // Drain stdout while the child runs, so it never blocks on a full pipe.
        let mut stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut output = String::new();
            stdout.read_to_string(&mut output).unwrap();
            output
        });
        std::thread::sleep(Duration::from_millis(150 + rng.below(301)));
        assert!(
            child.try_wait().unwrap().is_none(),
            "cycle {cycle}: the worker stopped before it was killed"
        );
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        expect.absorb(&reader.join().unwrap());

        let c = cluster(dir.path());
        let revision = c.store().revision().unwrap();
        assert!(revision >= last_revision, "revision went back");
        last_revision = revision;
        assert_eq!(c.check().unwrap(), Vec::<String>::new(), "cycle {cycle}");
        expect.verify(&c);
        let cap = c.capacity().unwrap();
        assert_eq!(
            cap.total.free_bytes + cap.total.used_bytes,
            cap.total.total_bytes
        );
    }
    assert!(
        expect.ok_ops >= 20 && expect.killed_in_flight >= 1 && !expect.attach_started.is_empty(),
        "{} operations committed ({} attaches), {} cycles killed mid-operation: the test \
         exercised nothing",
        expect.ok_ops,
        expect.attach_started.len(),
        expect.killed_in_flight
    );
}
