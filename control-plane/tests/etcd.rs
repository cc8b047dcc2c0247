//! The etcd store against real etcd (members started by `common::etcd` on
//! loopback ports): the store conformance suite, conflicts between control
//! planes, compaction, failover between endpoints, quorum loss and
//! recovery, TLS with client certificates, and `migrate` from a redb store
//! holding real cluster state. Without an etcd binary the tests are not run
//! (and fail when `CI=true`).

mod common;

use common::etcd::Etcd;
use common::workload::{self, Rng};
use nvpool_control::api::AuthConfig;
use nvpool_control::daemon::{migrate, MigrateArgs, StoreTlsArgs};
use nvpool_control::limits::ETCD_REQUEST_TIMEOUT_MS;
use nvpool_control::model::{Layout, Uuid, VolumeSpec};
use nvpool_control::state::{Cluster, Snapshot, StateConfig};
use nvpool_control::store::conformance::{self, Revisions, SMALL_HISTORY};
use nvpool_control::store::{
    Condition, EtcdConfig, EtcdStore, FailedCondition, Op, RedbStore, Store, StoreError, StoreUrl,
    TxnOutcome,
};
use nvpool_control::ManualClock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Slack over the request deadline for a failing call to come back (thread
/// scheduling on a busy machine).
const DEADLINE_SLACK: Duration = Duration::from_millis(1_500);

fn deadline() -> Duration {
    Duration::from_millis(ETCD_REQUEST_TIMEOUT_MS)
}

fn put(key: &str, value: &[u8]) -> Op {
    Op::Put(key.into(), value.to_vec())
}

fn commit(store: &dyn Store, conditions: &[Condition], ops: &[Op]) -> u64 {
    match store.txn(conditions, ops).unwrap() {
        TxnOutcome::Committed { revision } => revision,
        TxnOutcome::Conflict(f) => panic!("conflict: {f:?}"),
    }
}

/// Writes one key under another prefix of the same etcd: revisions skip.
fn gap_writer(other: &EtcdStore) -> impl Fn() + Sync + '_ {
    let n = AtomicU64::new(0);
    move || {
        let i = n.fetch_add(1, Ordering::Relaxed);
        commit(other, &[], &[put(&format!("/gap/{i}"), b"g")]);
    }
}

/// A put straight through the etcd client, around the store.
fn raw_put(store: &EtcdStore, key: &str, value: &str) {
    let mut client = store.client().clone();
    store
        .runtime()
        .block_on(client.put(key, value, None))
        .unwrap();
}

#[test]
fn conformance_suite_on_etcd() {
    let Some(etcd) = Etcd::start("conformance_suite_on_etcd", 1) else {
        return;
    };
    let store = etcd.store("/test/nvpool");
    let other = etcd.store("/test/nvpool-other");
    // Keys right next to the prefix that are not the store's.
    raw_put(&store, "/test/nvpool", "the bare prefix");
    raw_put(&store, "/test/nvpoolx/a/1", "a longer prefix");
    raw_put(&store, "/test/nvpoo", "a shorter one");
    let gap = gap_writer(&other);
    conformance::run(&store, Revisions::Shared { gap: &gap });
    assert!(other.list("").unwrap().entries.len() >= 5, "the gaps");
    assert!(other.list("/a").unwrap().entries.is_empty());
}

#[test]
fn history_and_concurrency_suites_on_etcd() {
    let Some(etcd) = Etcd::start("history_and_concurrency_suites_on_etcd", 1) else {
        return;
    };
    let other = etcd.store("/test/other");
    let gap = gap_writer(&other);
    let small = etcd.store_with("/test/history", SMALL_HISTORY);
    conformance::history(&small, Revisions::Shared { gap: &gap });
    let store = etcd.store("/test/counter");
    conformance::concurrent_increments(&store, Revisions::Shared { gap: &gap }, 3, 20);
}

/// Two control planes (two clients) on one prefix: a transaction computed
/// from a stale read conflicts and names the version that beat it; whole
/// cluster mutations from both interleave without double allocation.
#[test]
fn conflicts_between_control_planes() {
    let Some(etcd) = Etcd::start("conflicts_between_control_planes", 1) else {
        return;
    };
    let a = etcd.store("/nvpool");
    let b = etcd.store("/nvpool");
    assert!(a.get("/k").unwrap().is_none());
    let rb = commit(&b, &[Condition::Missing("/k".into())], &[put("/k", b"b")]);
    let out = a
        .txn(&[Condition::Missing("/k".into())], &[put("/k", b"a")])
        .unwrap();
    assert_eq!(
        out,
        TxnOutcome::Conflict(vec![FailedCondition {
            index: 0,
            condition: Condition::Missing("/k".into()),
            actual: Some(rb),
        }])
    );
    assert_eq!(a.get("/k").unwrap().unwrap().value, b"b");
    let ra = commit(
        &a,
        &[Condition::VersionIs("/k".into(), rb)],
        &[put("/k", b"a")],
    );
    let stale = b
        .txn(
            &[Condition::VersionIs("/k".into(), rb)],
            &[Op::Delete("/k".into())],
        )
        .unwrap();
    assert!(
        matches!(&stale, TxnOutcome::Conflict(f) if f[0].actual == Some(ra)),
        "{stale:?}"
    );

    // Two clusters, each on its own client, creating volumes at once: the
    // allocation epoch serialises them across processes.
    let clock = Arc::new(ManualClock::new(1_000_000));
    let config = StateConfig {
        extent_bytes: workload::E,
        ..StateConfig::default()
    };
    let c1 = Cluster::new(Arc::new(a), clock.clone(), config.clone()).unwrap();
    let c2 = Cluster::new(Arc::new(b), clock, config).unwrap();
    for i in 0..4 {
        c1.register_target(&workload::registration(i)).unwrap();
    }
    std::thread::scope(|s| {
        for (t, c) in [&c1, &c2].into_iter().enumerate() {
            s.spawn(move || {
                for n in 0..8u8 {
                    let mut bytes = [0u8; 16];
                    bytes[0] = t as u8 + 1;
                    bytes[1] = n + 1;
                    let spec = VolumeSpec {
                        uuid: Uuid(bytes),
                        name: format!("v{t}-{n}"),
                        size_bytes: 2 * workload::E,
                        layout: Layout::Raid1 { copies: 2 },
                        pool: None,
                    };
                    c.create_volume(&spec).unwrap();
                }
            });
        }
    });
    assert_eq!(c1.volumes().unwrap().len(), 16);
    assert_eq!(c2.check().unwrap(), Vec::<String>::new());
}

#[test]
fn compaction_answers_compacted() {
    let Some(etcd) = Etcd::start("compaction_answers_compacted", 1) else {
        return;
    };
    let store = etcd.store("/nvpool");
    let r: Vec<u64> = (0..5)
        .map(|i| commit(&store, &[], &[put(&format!("/k/{i}"), b"v")]))
        .collect();
    let mut client = store.client().clone();
    store
        .runtime()
        .block_on(client.compact(r[3] as i64, None))
        .unwrap();
    let err = store.changes_since(r[2]).unwrap_err();
    assert!(
        matches!(err, StoreError::Compacted { requested, compacted }
            if (requested, compacted) == (r[2], r[3])),
        "{err}"
    );
    assert!(matches!(
        store.changes_since(0),
        Err(StoreError::Compacted { .. })
    ));
    let after = store.changes_since(r[3]).unwrap();
    assert_eq!(after.len(), 1);
    assert_eq!((after[0].revision, after[0].key.as_str()), (r[4], "/k/4"));
    // Compaction drops history, never data.
    assert_eq!(store.list("/k/").unwrap().entries.len(), 5);
}

/// Each member in turn is killed (the leader first): the store's calls
/// still succeed through the others, then it comes back.
#[test]
fn endpoint_failover() {
    let Some(mut etcd) = Etcd::start("endpoint_failover", 3) else {
        return;
    };
    let store = etcd.store("/nvpool");
    let mut last = commit(&store, &[], &[put("/before", b"1")]);
    let leader = etcd.leader().expect("a leader");
    let order: Vec<usize> = std::iter::once(leader)
        .chain((0..3).filter(|&i| i != leader))
        .collect();
    for (round, victim) in order.into_iter().enumerate() {
        let was_leader = etcd.leader() == Some(victim);
        etcd.kill(victim);
        let t = Instant::now();
        // A read first: it rides out the election a dead leader causes. A
        // write sent to a follower before it noticed would wait on etcd's
        // side (see etcd.rs); once a read succeeded, a leader exists.
        let listing = store.list("/").unwrap();
        let first = t.elapsed();
        assert!(listing.entries.len() > round);
        let key = format!("/after/{round}");
        let r = commit(
            &store,
            &[Condition::Missing(key.clone())],
            &[put(&key, b"x")],
        );
        assert!(r > last);
        assert_eq!(store.get(&key).unwrap().unwrap().version, r);
        let changes = store.changes_since(last).unwrap();
        assert_eq!(changes.last().unwrap().key, key);
        assert!(store.revision().unwrap() >= r);
        eprintln!(
            "member {victim} ({}) killed: first call answered after {first:?}, all after {:?}",
            if was_leader {
                "the leader"
            } else {
                "a follower"
            },
            t.elapsed()
        );
        assert!(t.elapsed() < 2 * deadline(), "{:?}", t.elapsed());
        last = r;
        etcd.restart(victim);
        etcd.wait_healthy();
    }

    // A write at once after the leader dies: it commits, or fails
    // Unavailable within the deadline (maybe applied); never hangs, and a
    // retry after a read tells which.
    let leader = etcd.leader().expect("a leader");
    etcd.kill(leader);
    let t = Instant::now();
    let first = store.txn(&[Condition::Missing("/racy".into())], &[put("/racy", b"1")]);
    let took = t.elapsed();
    assert!(took <= deadline() + DEADLINE_SLACK, "{took:?}");
    store.list("/").unwrap();
    let retry = store
        .txn(&[Condition::Missing("/racy".into())], &[put("/racy", b"1")])
        .unwrap();
    let stored = store.get("/racy").unwrap().expect("written once");
    match (&first, &retry) {
        (Ok(TxnOutcome::Committed { revision }), TxnOutcome::Conflict(f)) => {
            assert_eq!(f[0].actual, Some(*revision));
            assert_eq!(stored.version, *revision);
        }
        (Err(StoreError::Unavailable { .. }), _) => {}
        other => panic!("{other:?}"),
    }
    eprintln!(
        "a write right after the leader died: {} after {took:?}",
        match &first {
            Ok(_) => "committed".to_string(),
            Err(e) => e.to_string(),
        }
    );
}

/// Two of three members gone: every call fails with `Unavailable` within
/// the deadline (and the REST API answers 503), then works again with the
/// same store once they are back.
#[test]
fn quorum_loss_is_unavailable_then_recovers() {
    let Some(mut etcd) = Etcd::start("quorum_loss_is_unavailable_then_recovers", 3) else {
        return;
    };
    let store = Arc::new(etcd.store("/nvpool"));
    let server = common::serve_store(store.clone(), AuthConfig::default());
    let r0 = commit(&*store, &[], &[put("/before", b"1")]);
    assert_eq!(server.call("GET", "/v1/volumes", None, None).status, 200);

    let leader = etcd.leader().expect("a leader");
    let follower = (0..3).find(|&i| i != leader).unwrap();
    etcd.kill(leader);
    etcd.kill(follower);
    type Call<'a> = (&'static str, Box<dyn Fn() -> Result<(), StoreError> + 'a>);
    let calls: Vec<Call<'_>> = vec![
        (
            "txn",
            Box::new(|| store.txn(&[], &[put("/during", b"x")]).map(drop)),
        ),
        ("get", Box::new(|| store.get("/before").map(drop))),
        ("list", Box::new(|| store.list("/").map(drop))),
        ("revision", Box::new(|| store.revision().map(drop))),
        (
            "changes_since",
            Box::new(|| store.changes_since(r0 - 1).map(drop)),
        ),
    ];
    for (what, call) in &calls {
        let t = Instant::now();
        let err = call().expect_err(what);
        let took = t.elapsed();
        assert!(
            matches!(err, StoreError::Unavailable { .. }),
            "{what}: {err}"
        );
        let text = err.to_string();
        assert!(
            text.starts_with("etcd at 127.0.0.1:") && text.contains(" is unavailable: "),
            "{text}"
        );
        assert!(took <= deadline() + DEADLINE_SLACK, "{what} took {took:?}");
        eprintln!("{what} without quorum: {took:?}: {text}");
    }
    let t = Instant::now();
    let reply = server.call("GET", "/v1/volumes", None, None);
    server.expect_error(&reply, 503, "unavailable");
    assert!(
        reply.headers.contains("retry-after: 1"),
        "{}",
        reply.headers
    );
    assert!(
        reply.json()["details"]["store"]
            .as_str()
            .is_some_and(|s| s.starts_with("etcd at ")),
        "{}",
        reply.body
    );
    eprintln!("REST without quorum: 503 after {:?}", t.elapsed());

    etcd.restart(leader);
    etcd.restart(follower);
    etcd.wait_healthy();
    let t = Instant::now();
    let r1 = commit(&*store, &[], &[put("/after", b"2")]);
    assert!(r1 > r0);
    assert_eq!(store.get("/after").unwrap().unwrap().version, r1);
    let keys: Vec<String> = store
        .changes_since(r0)
        .unwrap()
        .into_iter()
        .map(|c| c.key)
        .collect();
    assert!(keys.ends_with(&["/after".to_string()]), "{keys:?}");
    assert_eq!(server.call("GET", "/v1/volumes", None, None).status, 200);
    eprintln!("after recovery: first commit in {:?}", t.elapsed());
}

#[test]
fn tls_with_client_certificates() {
    let Some(etcd) = Etcd::start_tls("tls_with_client_certificates") else {
        return;
    };
    let store = etcd.store("/tls/nvpool");
    let other = etcd.store("/tls/other");
    let gap = gap_writer(&other);
    conformance::run(&store, Revisions::Shared { gap: &gap });
    let tls = etcd.tls().unwrap();
    // Without the client certificate, or trusting another CA, nothing
    // connects; both fail within the deadline.
    let attempts = [
        ("no client certificate", tls.etcd_tls(false)),
        ("the wrong CA", {
            let mut t = tls.etcd_tls(true);
            t.ca_pem = std::fs::read(&tls.client_cert).unwrap();
            t
        }),
    ];
    std::thread::scope(|s| {
        for (what, t) in attempts {
            let url = etcd.url("/tls/nvpool");
            s.spawn(move || {
                let start = Instant::now();
                let err = EtcdStore::connect(EtcdConfig {
                    tls: Some(t),
                    ..EtcdConfig::new(url)
                })
                .expect_err(what);
                assert!(
                    start.elapsed() <= deadline() + DEADLINE_SLACK,
                    "{what}: {:?}",
                    start.elapsed()
                );
                eprintln!("{what}: {err}");
            });
        }
    });
    // A plain URL to a TLS etcd, and TLS settings for a plain URL.
    let mut plain = etcd.url("/tls/nvpool");
    plain.tls = false;
    assert!(EtcdStore::connect(EtcdConfig::new(plain.clone())).is_err());
    let mut tls_for_plain = EtcdConfig::new(plain);
    tls_for_plain.tls = Some(tls.etcd_tls(true));
    assert!(EtcdStore::connect(tls_for_plain).is_err());
}

/// The values of every record (versions differ between stores).
fn state_values(s: &Snapshot) -> Vec<String> {
    fn values<K: std::fmt::Debug, T: std::fmt::Debug>(
        m: &std::collections::BTreeMap<K, nvpool_control::state::Versioned<T>>,
    ) -> String {
        format!(
            "{:?}",
            m.iter().map(|(k, v)| (k, &v.value)).collect::<Vec<_>>()
        )
    }
    vec![
        values(&s.targets),
        values(&s.pools),
        values(&s.volumes),
        values(&s.volume_names),
        format!("{:?}", s.alloc_epoch.as_ref().map(|e| e.value)),
        values(&s.attachments),
        values(&s.hosts),
        values(&s.stale_exports),
        values(&s.failed_copies),
        values(&s.copy_states),
    ]
}

#[test]
fn migrate_a_redb_store_into_etcd() {
    let Some(etcd) = Etcd::start("migrate_a_redb_store_into_etcd", 1) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(1_000_000));
    let config = StateConfig {
        extent_bytes: workload::E,
        ..StateConfig::default()
    };
    // Real state: six targets, then creates, grows, attaches, detaches,
    // deletes and resync jobs.
    let (before, volumes, capacity) = {
        let store = Arc::new(RedbStore::open_in_dir(dir.path()).unwrap());
        let c = Cluster::new(store, clock.clone(), config.clone()).unwrap();
        for i in 0..6 {
            c.register_target(&workload::registration(i)).unwrap();
        }
        let live = Mutex::new(Vec::new());
        let mut rng = Rng::new(0x0123_4567_89ab_cdef);
        for _ in 0..300 {
            workload::step(&c, &live, &mut rng);
        }
        assert_eq!(c.check().unwrap(), Vec::<String>::new());
        let s = c.snapshot().unwrap();
        assert!(s.volumes.len() >= 5, "{} volumes", s.volumes.len());
        assert!(!s.attachments.is_empty() && !s.copy_states.is_empty());
        (
            state_values(&s),
            format!("{:?}", c.volumes().unwrap()),
            c.capacity().unwrap(),
        )
    };

    let url = etcd.url_string("/nvpool");
    let args = MigrateArgs {
        from: StoreUrl::Redb(dir.path().to_owned()),
        to: url.parse().unwrap(),
        store_tls: StoreTlsArgs::default(),
    };
    let report = migrate(&args).unwrap();
    eprintln!("{report}");
    assert!(
        report.starts_with("migrated ") && report.ends_with("identical"),
        "{report}"
    );

    let store = Arc::new(etcd.store("/nvpool"));
    let c = Cluster::new(store.clone(), clock.clone(), config.clone()).unwrap();
    let s = c.snapshot().unwrap();
    assert_eq!(state_values(&s), before);
    assert_eq!(format!("{:?}", c.volumes().unwrap()), volumes);
    assert_eq!(c.capacity().unwrap(), capacity);
    assert_eq!(c.check().unwrap(), Vec::<String>::new());
    // The copy is a working store: mutations continue from it.
    let live = Mutex::new(s.volumes.keys().copied().collect());
    let mut rng = Rng::new(0xfeed);
    for _ in 0..20 {
        workload::step(&c, &live, &mut rng);
    }
    assert_eq!(c.check().unwrap(), Vec::<String>::new());

    // Into a store that holds keys: refused, nothing written.
    let keys = store.list("").unwrap().entries.len();
    let err = migrate(&args).unwrap_err();
    assert!(format!("{err:#}").contains("already holds"), "{err:#}");
    assert_eq!(store.list("").unwrap().entries.len(), keys);

    // From a redb store in use (this process holds it): refused, on one
    // line, by the command too.
    let held = RedbStore::open_in_dir(dir.path()).unwrap();
    let to_empty = MigrateArgs {
        to: etcd.url_string("/elsewhere").parse().unwrap(),
        ..args
    };
    let err = format!("{:#}", migrate(&to_empty).unwrap_err());
    assert!(err.contains("in use by another process"), "{err}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_nvpool-control"))
        .arg("migrate")
        .arg("--from")
        .arg(format!("redb:{}", dir.path().display()))
        .args(["--to", &etcd.url_string("/elsewhere")])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("in use by another process"), "{stderr}");
    drop(held);
    assert!(etcd
        .store("/elsewhere")
        .list("")
        .unwrap()
        .entries
        .is_empty());
}

/// Bad store URLs and flags stop the daemon with one line, exit code 2.
#[test]
fn bad_store_arguments_are_one_line_errors() {
    for args in [
        &["--store", "mysql://db"][..],
        &["--store", "etcd://h:99999"],
        &["--store", "etcd://h/a//b"],
        &["--store", "redb:"],
        &["--store", "memory:", "--state-dir", "/tmp/x"],
        &["--store-cert", "c.pem", "--store", "etcds://h"],
        &["migrate", "--from", "redb:/tmp/x"],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_nvpool-control"))
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
    }
}
