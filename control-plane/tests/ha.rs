//! Several control planes on one etcd (three real members on loopback,
//! started by `common::etcd`): one leader at a time, handed over when it
//! dies or stops; a deposed leader's writes refused by the fence; and
//! three `nvpool-control` processes under attach/detach/resize churn from
//! two clients while the leader is SIGKILLed again and again and an etcd
//! member is stopped and restarted: the store stays consistent, every
//! acknowledged operation is there, and what was cut off half-way finishes
//! when asked again. Without an etcd binary the tests are not run (and
//! fail when `CI=true`).

mod common;

use common::etcd::Etcd;
use common::nodes::{enc, Node, HOST_A, HOST_B};
use common::workload::{Expect, Rng};
use common::{http, Reply, MIB};
use nvpool_control::clock::SystemClock;
use nvpool_control::leader::{Leadership, NotLeader};
use nvpool_control::limits::{LEADER_CAMPAIGN_INTERVAL_MS, LEADER_LEASE_TTL_S};
use nvpool_control::model::Device;
use nvpool_control::state::{Cluster, StateConfig, StateError, TargetRegistration};
use nvpool_control::store::{Campaign, Store};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The longest a handover may take: the lease running out, one campaign
/// interval, and slack for a loaded machine.
fn handover_bound() -> Duration {
    Duration::from_secs(u64::from(LEADER_LEASE_TTL_S))
        + Duration::from_millis(LEADER_CAMPAIGN_INTERVAL_MS)
        + Duration::from_secs(10)
}

/// One `nvpool-control` process on a loopback port, on the etcd store.
struct ControlPlane {
    addr: SocketAddr,
    store: String,
    log: PathBuf,
    child: Option<Child>,
}

impl ControlPlane {
    fn start(store: &str, dir: &Path, i: usize) -> ControlPlane {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut cp = ControlPlane {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            store: store.to_owned(),
            log: dir.join(format!("control-{i}.log")),
            child: None,
        };
        cp.spawn();
        cp
    }

    fn spawn(&mut self) {
        assert!(self.child.is_none());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_nvpool-control"))
            .args(["--listen", &self.addr.to_string(), "--store", &self.store])
            .args(["--extent-size", &MIB.to_string(), "--log", "info"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.leads().is_none() {
            assert!(Instant::now() < deadline, "{} does not serve", self.addr);
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL: no resignation, the lease has to run out.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, and wait for the process to end.
    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pid = libc::pid_t::try_from(c.id()).unwrap();
            // SAFETY: kill(2) on the pid of a child this test spawned and
            // has not reaped.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            let _ = c.wait();
        }
    }

    fn running(&self) -> bool {
        self.child.is_some()
    }

    /// `Some(is the leader)` from `/healthz`, `None` when it does not answer.
    fn leads(&self) -> Option<bool> {
        let r = http(self.addr, "GET", "/healthz", None, None).ok()?;
        (r.status == 200).then(|| r.json()["leader"].as_bool())?
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The index of the one leader among running control planes, once there
/// is exactly one; panics when there are two at once or none in time.
fn one_leader(cps: &[ControlPlane], within: Duration) -> usize {
    let deadline = Instant::now() + within;
    loop {
        let leaders: Vec<usize> = (0..cps.len())
            .filter(|&i| cps[i].running() && cps[i].leads() == Some(true))
            .collect();
        assert!(leaders.len() <= 1, "two leaders at once: {leaders:?}");
        if let [l] = leaders[..] {
            return l;
        }
        assert!(Instant::now() < deadline, "no leader within {within:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Three control planes sharing `etcd` under `prefix`, logging into `dir`.
fn three_control_planes(etcd: &Etcd, prefix: &str, dir: &Path) -> Vec<ControlPlane> {
    let url = etcd.url_string(prefix);
    (0..3).map(|i| ControlPlane::start(&url, dir, i)).collect()
}

fn logs(cps: &[ControlPlane]) -> String {
    cps.iter()
        .map(|c| std::fs::read_to_string(&c.log).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn one_leader_handed_over_when_it_dies_or_stops() {
    let Some(etcd) = Etcd::start("one_leader_handed_over_when_it_dies_or_stops", 3) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut cps = three_control_planes(&etcd, "/ha-leader", dir.path());
    let first = one_leader(&cps, handover_bound());
    // Killed: the lease runs out and another takes over.
    cps[first].kill();
    let second = one_leader(&cps, handover_bound());
    assert_ne!(second, first);
    // Back: it follows.
    cps[first].spawn();
    std::thread::sleep(Duration::from_millis(3 * LEADER_CAMPAIGN_INTERVAL_MS));
    assert_eq!(one_leader(&cps, handover_bound()), second);
    // Stopped cleanly: it resigns, and the handover takes about one
    // campaign interval instead of a whole lease.
    let stopped = Instant::now();
    cps[second].stop();
    let third = one_leader(&cps, handover_bound());
    assert_ne!(third, second);
    let took = stopped.elapsed();
    let logs = logs(&cps);
    assert!(
        logs.contains("resigned the leadership"),
        "the stopped leader resigned: {logs}"
    );
    eprintln!("handover after a clean stop: {took:?}");
}

/// A leader that lost its lease without noticing (a long pause) writes
/// nothing once another holds the key: the fence refuses its writes.
#[test]
fn a_deposed_leader_cannot_write() {
    let Some(etcd) = Etcd::start("a_deposed_leader_cannot_write", 1) else {
        return;
    };
    let store_a: Arc<dyn Store> = Arc::new(etcd.store("/ha-fence"));
    let store_b: Arc<dyn Store> = Arc::new(etcd.store("/ha-fence"));
    let cluster = |store: &Arc<dyn Store>, l: &Arc<Leadership>| {
        Cluster::new(store.clone(), Arc::new(SystemClock), StateConfig::default())
            .unwrap()
            .with_leadership(l.clone())
            .fenced()
    };
    let (a, b) = (Leadership::elected("a"), Leadership::elected("b"));
    let (ca, cb) = (cluster(&store_a, &a), cluster(&store_b, &b));
    assert!(matches!(
        ca.register_target(&registration(0)),
        Err(StateError::NotLeader(NotLeader))
    ));
    // A wins; B cannot.
    let campaign = |store: &Arc<dyn Store>, holder: &str| {
        store
            .elector()
            .expect("etcd elects")
            .campaign(holder, LEADER_LEASE_TTL_S)
            .expect("etcd answers")
    };
    let Campaign::Won { lease, version } = campaign(&store_a, "a") else {
        panic!("the first campaign wins");
    };
    a.begin(lease, version, Instant::now());
    assert!(a.is_leader());
    ca.register_target(&registration(0)).unwrap();
    assert_eq!(
        campaign(&store_b, "b"),
        Campaign::Held { holder: "a".into() }
    );
    // A's lease is gone (as when it expires during a pause of A), and B
    // takes the key while A still believes it leads.
    store_a.elector().unwrap().resign(lease);
    let Campaign::Won { lease, version } = campaign(&store_b, "b") else {
        panic!("the key is free");
    };
    b.begin(lease, version, Instant::now());
    assert!(a.is_leader(), "A has not noticed yet");
    let r = ca.register_target(&registration(1));
    assert!(
        matches!(r, Err(StateError::NotLeader(_))),
        "the fence refused A's write: {r:?}"
    );
    assert!(!a.is_leader(), "a refused fence ends A's term");
    assert!(ca.target("t1").is_err(), "nothing of A's write is stored");
    cb.register_target(&registration(1)).unwrap();
    assert!(cb.target("t1").is_ok());
}

fn registration(i: usize) -> TargetRegistration {
    TargetRegistration {
        id: format!("t{i}"),
        name: format!("t{i}"),
        addr: format!("127.0.0.1:{}", 4420 + i).parse().unwrap(),
        admin_addr: format!("127.0.0.1:{}", 5420 + i).parse().unwrap(),
        labels: BTreeMap::new(),
        devices: vec![Device {
            id: "d0".into(),
            backend: format!("ram:{}", 16 * MIB),
            capacity_bytes: 16 * MIB,
            labels: BTreeMap::new(),
        }],
        rdma_addr: None,
        admin_tls: false,
        admin_token: None,
    }
}

/// The control planes' addresses, of those running: what a client with an
/// endpoint list would have.
type Endpoints = Mutex<Vec<SocketAddr>>;

/// A request to any control plane: on no answer or a 503 the next one is
/// tried, round after round, for up to 60 s. `None`: nobody answered (the
/// outcome is unknown). Only for idempotent calls.
fn any(
    endpoints: &Endpoints,
    rng: &mut Rng,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> Option<Reply> {
    let body = body.map(|b| b.to_string());
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let eps = endpoints.lock().unwrap().clone();
        let start = rng.below(eps.len() as u64) as usize;
        for k in 0..eps.len() {
            let addr = eps[(start + k) % eps.len()];
            if let Ok(r) = http(addr, method, path, None, body.as_deref()) {
                if r.status != 503 {
                    return Some(r);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    None
}

/// One client's churn on its own volumes: create, attach, detach, grow,
/// delete, reported as `@@ BEGIN`/`@@ OK` lines for [`Expect`].
fn churn(endpoints: &Endpoints, stop: &AtomicBool, seed: u64, report: &Mutex<String>) {
    let mut rng = Rng::new(seed);
    let mut mine: Vec<(String, u64, Vec<&str>)> = Vec::new();
    let line = |s: String| {
        let mut r = report.lock().unwrap();
        r.push_str("@@ ");
        r.push_str(&s);
        r.push('\n');
    };
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let roll = rng.below(100);
        if mine.len() < 2 || (roll < 25 && mine.len() < 4) {
            n += 1;
            let uuid = format!("{:08x}-0000-4000-8000-{:012x}", seed as u32, n);
            let layout = if rng.below(2) == 0 {
                json!({"type": "raid1", "copies": 2})
            } else {
                json!({"type": "concat"})
            };
            let size = (1 + rng.below(2)) * MIB;
            line(format!("BEGIN create {uuid}"));
            let body = json!({"name": format!("v-{uuid}"), "size_bytes": size, "layout": layout});
            match any(
                endpoints,
                &mut rng,
                "PUT",
                &format!("/v1/volumes/{uuid}"),
                Some(body),
            ) {
                Some(r) if r.status == 201 || r.status == 200 => {
                    line(format!("OK create {uuid}"));
                    mine.push((uuid, size, Vec::new()));
                }
                Some(r) if r.status == 422 => line(format!("FULL create {uuid}")),
                Some(r) => panic!("create {uuid}: {} {}", r.status, r.body),
                None => {}
            }
            continue;
        }
        let i = rng.below(mine.len() as u64) as usize;
        let (uuid, size, hosts) = &mut mine[i];
        let host = if rng.below(2) == 0 { HOST_A } else { HOST_B };
        let path = format!("/v1/volumes/{uuid}/attachments/{}", enc(host));
        if roll < 50 && !hosts.contains(&host) {
            line(format!("BEGIN attach {uuid} {host}"));
            match any(endpoints, &mut rng, "PUT", &path, None) {
                Some(r) if r.status == 201 || r.status == 200 => {
                    line(format!("OK attach {uuid} {host}"));
                    hosts.push(host);
                }
                // A target may refuse while another control plane
                // reconciles it at the same moment: nothing was left
                // behind (the answer says so), and the client may retry.
                Some(r) if r.status == 422 => {
                    eprintln!("attach {uuid} refused: {}", r.body);
                    line(format!("REFUSED attach {uuid} {host}"));
                }
                Some(r) => panic!("attach {uuid}: {} {}", r.status, r.body),
                None => {}
            }
        } else if roll < 70 && !hosts.is_empty() {
            let host = hosts[0];
            let path = format!("/v1/volumes/{uuid}/attachments/{}", enc(host));
            line(format!("BEGIN detach {uuid} {host}"));
            match any(endpoints, &mut rng, "DELETE", &path, None) {
                Some(r) if r.status == 204 || r.status == 404 => {
                    line(format!("OK detach {uuid} {host}"));
                    hosts.retain(|h| *h != host);
                }
                Some(r) => panic!("detach {uuid}: {} {}", r.status, r.body),
                None => {}
            }
        } else if roll < 85 {
            let grown = *size + MIB;
            line(format!("BEGIN grow {uuid} {grown}"));
            let body = json!({"size_bytes": grown});
            match any(
                endpoints,
                &mut rng,
                "POST",
                &format!("/v1/volumes/{uuid}/resize"),
                Some(body),
            ) {
                Some(r) if r.status == 200 => {
                    line(format!("OK grow {uuid} {grown}"));
                    *size = grown;
                }
                Some(r) if r.status == 422 => line(format!("FULL grow {uuid} {grown}")),
                Some(r) => panic!("grow {uuid}: {} {}", r.status, r.body),
                None => {}
            }
        } else if hosts.is_empty() {
            line(format!("BEGIN delete {uuid}"));
            match any(
                endpoints,
                &mut rng,
                "DELETE",
                &format!("/v1/volumes/{uuid}"),
                None,
            ) {
                Some(r) if r.status == 204 || r.status == 404 => {
                    line(format!("OK delete {uuid}"));
                    mine.swap_remove(i);
                }
                Some(r) => panic!("delete {uuid}: {} {}", r.status, r.body),
                None => {}
            }
        }
    }
}

#[test]
fn leader_killed_under_churn_loses_nothing() {
    let Some(mut etcd) = Etcd::start("leader_killed_under_churn_loses_nothing", 3) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut cps = three_control_planes(&etcd, "/ha-churn", dir.path());
    let endpoints: Endpoints = Mutex::new(cps.iter().map(|c| c.addr).collect());
    let nodes: Vec<Node> = (0..3).map(Node::start).collect();
    let mut rng = Rng::new(0x4a11_cafe_d00d_0001);
    let register = |rng: &mut Rng| {
        for (i, node) in nodes.iter().enumerate() {
            let r = any(
                &endpoints,
                rng,
                "POST",
                "/v1/targets",
                Some(node.registration(&format!("r{i}"))),
            )
            .expect("a control plane answers");
            assert_eq!(r.status, 200, "{}", r.body);
        }
    };
    register(&mut rng);
    one_leader(&cps, handover_bound());

    let stop = AtomicBool::new(false);
    let report = Mutex::new(String::new());
    let mut kills = 0;
    std::thread::scope(|s| {
        // The targets' heartbeats (their registrars are not running here).
        s.spawn(|| {
            let mut rng = Rng::new(7);
            while !stop.load(Ordering::Relaxed) {
                register(&mut rng);
                std::thread::sleep(Duration::from_millis(1_000));
            }
        });
        for seed in [0x1111_2222_3333_4445u64, 0x5555_6666_7777_8889] {
            let (endpoints, stop, report) = (&endpoints, &stop, &report);
            s.spawn(move || churn(endpoints, stop, seed, report));
        }
        for round in 0..4 {
            std::thread::sleep(Duration::from_millis(2_000));
            let leader = one_leader(&cps, handover_bound());
            cps[leader].kill();
            kills += 1;
            if round == 1 {
                // An etcd member goes away and comes back meanwhile.
                etcd.kill(2);
                std::thread::sleep(Duration::from_millis(1_500));
                etcd.restart(2);
            }
            std::thread::sleep(Duration::from_millis(1_000));
            cps[leader].spawn();
        }
        stop.store(true, Ordering::Relaxed);
    });
    etcd.wait_healthy();
    one_leader(&cps, handover_bound());

    let mut expect = Expect::default();
    expect.absorb(&report.lock().unwrap());
    let store: Arc<dyn Store> = Arc::new(etcd.store("/ha-churn"));
    let config = StateConfig {
        extent_bytes: MIB,
        ..StateConfig::default()
    };
    let c = Cluster::new(store, Arc::new(SystemClock), config).unwrap();
    assert_eq!(c.check().unwrap(), Vec::<String>::new(), "{}", logs(&cps));
    expect.verify(&c);
    assert!(
        expect.ok_ops >= 10 && kills == 4,
        "{} operations acknowledged across {kills} leader kills: the test exercised nothing",
        expect.ok_ops
    );

    // Whatever a killed control plane left half-done finishes when asked
    // again: every detach, then every delete, then nothing is exported.
    for a in c.attachments().unwrap() {
        let path = format!("/v1/volumes/{}/attachments/{}", a.volume, enc(&a.host_nqn));
        let r = any(&endpoints, &mut rng, "DELETE", &path, None).expect("an answer");
        assert!(
            r.status == 204 || r.status == 404,
            "{} {}",
            r.status,
            r.body
        );
    }
    for v in c.volumes().unwrap() {
        let path = format!("/v1/volumes/{}", v.volume.uuid);
        let r = any(&endpoints, &mut rng, "DELETE", &path, None).expect("an answer");
        assert!(
            r.status == 204 || r.status == 404,
            "{} {}",
            r.status,
            r.body
        );
    }
    assert!(c.volumes().unwrap().is_empty());
    for node in &nodes {
        let path = format!("/v1/targets/{}/reconcile", node.id);
        let r = any(&endpoints, &mut rng, "POST", &path, None).expect("an answer");
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            node.host_subsystems(),
            vec![],
            "{} still exports volumes that are gone",
            node.id
        );
    }
    eprintln!(
        "{} operations acknowledged, {} leader kills",
        expect.ok_ops, kills
    );
}
