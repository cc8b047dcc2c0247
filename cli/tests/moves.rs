//! Copies that move, the whole stack in one process: the control plane
//! with its heal loop, real targets with file devices, and a host serving
//! the volume as the agent does (engine + copy watcher) while
//! a writer keeps going. A rebalance fills targets that joined, a drain
//! empties a target which is then removed, and the copies of a target gone
//! past the grace period are replaced; every write survives, and copies of
//! a row are byte-identical on the devices.

mod common;

use common::{control_plane_clocked, file_range, target, Tgt, ADMIN, HOST, MIB};
use nvpool_cli::client::Client;
use nvpool_control::api::ApiServer;
use nvpool_control::Cluster;
use nvpool_initiator::device::block_on;
use nvpool_initiator::volume::Volume;
use nvpool_testkit::wait_for;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

const EXTENT: u64 = 4 * MIB;
const ROWS: u64 = 2;
const CHUNK: u64 = 64 * 1024;
const UUID: &str = "6d1c7f3e-2a4b-4c8d-9e0f-1a2b3c4d5e6f";

fn chunk(seed: u64) -> Vec<u8> {
    (0..CHUNK)
        .map(|i| (i as u8).wrapping_mul(13) ^ (seed as u8).wrapping_add((seed >> 8) as u8))
        .collect()
}

/// A served volume and a writer that rewrites chunks all over it,
/// remembering the last bytes of each.
struct Host {
    volume: Arc<Volume>,
    stop: Arc<AtomicBool>,
    watching: Option<JoinHandle<()>>,
    writing: Arc<AtomicBool>,
    writer: Option<JoinHandle<u64>>,
    written: Arc<Mutex<BTreeMap<u64, u64>>>,
}

impl Host {
    fn attach(client: &Client) -> Host {
        let stop = Arc::new(AtomicBool::new(false));
        let served = common::serve(client, UUID, &stop);
        Host {
            volume: served.volume,
            stop,
            watching: Some(served.watching),
            writing: Arc::new(AtomicBool::new(false)),
            writer: None,
            written: Arc::default(),
        }
    }

    fn start_writing(&mut self) {
        self.writing.store(true, Ordering::Relaxed);
        let (volume, writing, written) = (
            self.volume.clone(),
            self.writing.clone(),
            self.written.clone(),
        );
        self.writer = Some(std::thread::spawn(move || {
            let chunks = ROWS * EXTENT / CHUNK;
            let mut n = 0u64;
            while writing.load(Ordering::Relaxed) {
                // A stride that visits every chunk of both rows.
                let at = (n * 7 % chunks) * CHUNK;
                let (r, _) = block_on(volume.write(at, chunk(n), false));
                r.unwrap_or_else(|e| panic!("write {n} at {at}: {e}"));
                written.lock().unwrap().insert(at, n);
                n += 1;
            }
            n
        }));
    }

    /// Stops the writer and checks every chunk holds its last write.
    fn stop_writing_and_check(&mut self) -> u64 {
        self.writing.store(false, Ordering::Relaxed);
        let n = self.writer.take().map(|w| w.join().unwrap()).unwrap_or(0);
        block_on(self.volume.flush()).unwrap();
        for (&at, &seed) in self.written.lock().unwrap().iter() {
            let (r, got) = block_on(self.volume.read(at, vec![0; CHUNK as usize]));
            r.unwrap();
            assert!(got == chunk(seed), "chunk at {at} lost write {seed}");
        }
        n
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.writing.store(false, Ordering::Relaxed);
        self.stop.store(true, Ordering::Relaxed);
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        // The watcher ends within one long-poll step of the stop.
        drop(self.watching.take());
    }
}

fn volume(client: &Client) -> Value {
    client.get(&format!("/v1/volumes/{UUID}")).unwrap()
}

/// Copies of each row are byte-identical on the devices.
fn copies_agree(client: &Client, targets: &[&Tgt]) {
    let v = volume(client);
    let dev = |e: &Value| {
        targets
            .iter()
            .find(|t| e["target"] == t.id.as_str())
            .unwrap_or_else(|| panic!("extent on an unknown target: {e}"))
            .device_path()
    };
    for row in 0..ROWS as usize {
        let (e0, e1) = (&v["extents"][row * 2], &v["extents"][row * 2 + 1]);
        let a = file_range(&dev(e0), e0["offset"].as_u64().unwrap(), EXTENT);
        let b = file_range(&dev(e1), e1["offset"].as_u64().unwrap(), EXTENT);
        assert!(a == b, "row {row}: the copies differ");
    }
}

fn extents_on(client: &Client, t: &str) -> usize {
    let v = volume(client);
    v["extents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["target"] == t)
        .count()
}

fn setup() -> (
    ApiServer,
    Arc<Cluster>,
    Arc<nvpool_control::ManualClock>,
    Client,
) {
    let (cp, cluster, clock) = control_plane_clocked(EXTENT);
    let client = Client::new(&format!("http://{}", cp.addr), Some(ADMIN.into())).unwrap();
    (cp, cluster, clock, client)
}

fn create(client: &Client) {
    let body = json!({"name": "moving", "size_bytes": ROWS * EXTENT,
                      "layout": {"type": "raid1", "copies": 2}});
    let (_, _): (u16, Value) = client.put(&format!("/v1/volumes/{UUID}"), &body).unwrap();
}

#[test]
fn rebalance_fills_new_targets_and_drain_empties_one_while_the_host_writes() {
    let (cp, cluster, _clock, client) = setup();
    let (stop, _healing) = common::healer(&cluster, 600_000);
    let t0 = target(&cp, "t0");
    let t1 = target(&cp, "t1");
    create(&client);
    let mut host = Host::attach(&client);
    host.start_writing();

    // Two targets join: a dry run says what would move, then it moves.
    let t2 = target(&cp, "t2");
    let t3 = target(&cp, "t3");
    let dry: Value = client
        .post("/v1/rebalance", &json!({"dry_run": true}))
        .unwrap();
    let planned = dry["moves"].as_array().unwrap().len();
    assert!(planned >= 2, "{dry}");
    assert_eq!(dry["bytes_total"], json!(planned as u64 * EXTENT));
    assert_eq!(
        extents_on(&client, "t2") + extents_on(&client, "t3"),
        0,
        "a dry run moves nothing"
    );
    let started: Value = client.post("/v1/rebalance", &json!({})).unwrap();
    assert_eq!(started["started"], true, "{started}");
    wait_for("the rebalance to end", Duration::from_secs(90), || {
        let r: Value = client.get("/v1/rebalance").unwrap();
        r["pending"] == json!([]) && r["moves_running"] == 0
    });
    let per: Vec<usize> = ["t0", "t1", "t2", "t3"]
        .iter()
        .map(|t| extents_on(&client, t))
        .collect();
    assert!(
        per.iter().all(|&n| n == 1),
        "one extent per target: {per:?}"
    );
    let h: Vec<Value> = client.get(&format!("/v1/volumes/{UUID}/history")).unwrap();
    assert!(
        h.iter()
            .all(|r| r["kind"] == "move" && r["result"] == "done"),
        "{h:?}"
    );
    assert_eq!(h.len(), planned);

    // Drain t0 while the writer goes on; then it can be removed.
    let t: Value = client
        .put::<_, Value>("/v1/targets/t0/state", &json!({"state": "draining"}))
        .map(|(_, v)| v)
        .unwrap();
    assert_eq!(t["state"], "draining");
    wait_for("t0 to be drained", Duration::from_secs(90), || {
        let t: Value = client.get("/v1/targets/t0").unwrap();
        t["drained"] == true
    });
    assert_eq!(extents_on(&client, "t0"), 0);
    let writes = host.stop_writing_and_check();
    assert!(writes > 0);
    copies_agree(&client, &[&t0, &t1, &t2, &t3]);
    client.delete("/v1/targets/t0").unwrap();
    let err = client.delete("/v1/targets/t1").unwrap_err();
    assert_eq!(err.status(), Some(409), "t1 holds data: {err}");
    // The host reads and writes on through the new extents.
    host.start_writing();
    std::thread::sleep(Duration::from_millis(300));
    host.stop_writing_and_check();
    stop.store(true, Ordering::Relaxed);
}

#[test]
fn copies_of_a_target_gone_past_the_grace_period_are_replaced() {
    let (cp, cluster, clock, client) = setup();
    let t0 = target(&cp, "t0");
    let mut t1 = target(&cp, "t1");
    create(&client);
    let t2 = target(&cp, "t2");
    let (stop, _healing) = common::healer(&cluster, 60_000);
    let mut host = Host::attach(&client);
    host.start_writing();
    std::thread::sleep(Duration::from_millis(200));
    // t1 dies for good; the host gives its copies up and writes on.
    t1.stop();
    wait_for(
        "the host to give up the copies on t1",
        Duration::from_secs(30),
        || host.volume.health().failed_extents.len() == ROWS as usize,
    );
    // As the agent's reporter does.
    let failed = host.volume.health().failed_extents;
    let path = format!(
        "/v1/volumes/{UUID}/attachments/{}/failed-extents",
        nvpool_cli::client::segment(HOST)
    );
    let (_, _): (u16, Value) = client
        .put(&path, &json!({ "failed_extents": failed }))
        .unwrap();
    // A minute passes without a heartbeat from t1.
    clock.advance(61_000);
    for t in ["t0", "t2"] {
        cluster.heartbeat(t).unwrap();
    }
    wait_for("the copies to be replaced", Duration::from_secs(90), || {
        let v = volume(&client);
        v["failed_extents"] == json!([]) && v["copy_jobs"] == json!([])
    });
    assert_eq!(extents_on(&client, "t1"), 0);
    assert_eq!(extents_on(&client, "t2"), ROWS as usize);
    host.stop_writing_and_check();
    copies_agree(&client, &[&t0, &t2]);
    let h: Vec<Value> = client.get(&format!("/v1/volumes/{UUID}/history")).unwrap();
    assert!(
        h.iter()
            .all(|r| r["kind"] == "replace" && r["result"] == "done"),
        "{h:?}"
    );
    assert_eq!(volume(&client)["status"], "online");
    stop.store(true, Ordering::Relaxed);
}
