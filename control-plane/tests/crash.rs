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

#[path = "common/workload.rs"]
mod workload;

use nvpool_control::clock::SystemClock;
use nvpool_control::model::Uuid;
use nvpool_control::state::{Cluster, StateConfig};
use nvpool_control::store::{RedbStore, Store};
use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use workload::{registration, step, Expect, Rng, E};

const WORKER_ENV: &str = "NVPOOL_CRASH_WORKER";
/// Kill cycles. Each runs the child for 150..=450 ms.
const CYCLES: u64 = 8;
/// A worker left behind by a dead parent stops by itself after this long.
const WORKER_LIFETIME: Duration = Duration::from_secs(30);

fn cluster(dir: &std::path::Path) -> Cluster {
    let store: Arc<dyn Store> = Arc::new(RedbStore::open_in_dir(dir).expect("store opens"));
    let config = StateConfig {
        extent_bytes: E,
        ..StateConfig::default()
    };
    Cluster::new(store, Arc::new(SystemClock), config).unwrap()
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
                let mut rng =
                    Rng::new(seed.wrapping_add(t.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1);
                while Instant::now() < deadline {
                    step(c, live, &mut rng);
                }
            });
        }
    });
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
    let mut rng = Rng::new(0x5eed_1234_abcd_ef01);
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
