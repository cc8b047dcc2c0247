//! Store call latency, every backend side by side in one run: the memory
//! store, redb in a temporary directory (fsync on every commit), and a
//! local one-member etcd when its binary is installed (`common::etcd`
//! starts it). Prints p50/p99 of a 512-byte compare-and-swap transaction
//! and of a get, a list of 100 and of 1000 keys, and `changes_since` one
//! change behind, with each backend's p50 as a ratio to redb's.
//!
//! `cargo bench -p nvpool-control --bench store`

#[allow(dead_code)]
#[path = "../tests/common/etcd.rs"]
mod etcd;

use nvpool_control::store::{Condition, MemStore, Op, RedbStore, Store, TxnOutcome};
use std::time::{Duration, Instant};

const N: usize = 500;

struct Figures {
    name: &'static str,
    txn: Vec<Duration>,
    get: Vec<Duration>,
    list_100: Duration,
    list_1000: Duration,
    changes: Duration,
}

fn commit(store: &dyn Store, conditions: &[Condition], ops: &[Op]) -> u64 {
    match store.txn(conditions, ops).expect("the store answers") {
        TxnOutcome::Committed { revision } => revision,
        TxnOutcome::Conflict(c) => panic!("unexpected conflict: {c:?}"),
    }
}

fn measure(name: &'static str, store: &dyn Store) -> Figures {
    let mut txn = Vec::with_capacity(N);
    let mut get = Vec::with_capacity(N);
    let mut version = None;
    for _ in 0..N {
        let cond = match version {
            Some(v) => Condition::VersionIs("/k".into(), v),
            None => Condition::Missing("/k".into()),
        };
        let t = Instant::now();
        version = Some(commit(
            store,
            &[cond],
            &[Op::Put("/k".into(), vec![7; 512])],
        ));
        txn.push(t.elapsed());
        let t = Instant::now();
        store.get("/k").expect("the store answers");
        get.push(t.elapsed());
    }
    txn.sort();
    get.sort();
    let list = |keys: usize| {
        for chunk in 0..keys / 100 {
            let ops: Vec<Op> = (0..100)
                .map(|i| Op::Put(format!("/l{keys}/{i}-{chunk}"), vec![1; 256]))
                .collect();
            commit(store, &[], &ops);
        }
        let t = Instant::now();
        let l = store
            .list(&format!("/l{keys}/"))
            .expect("the store answers");
        assert_eq!(l.entries.len(), keys);
        t.elapsed()
    };
    let (list_100, list_1000) = (list(100), list(1000));
    let r = store.revision().expect("the store answers");
    commit(store, &[], &[Op::Put("/w".into(), b"1".to_vec())]);
    let t = Instant::now();
    store.changes_since(r).expect("the store answers");
    let changes = t.elapsed();
    Figures {
        name,
        txn,
        get,
        list_100,
        list_1000,
        changes,
    }
}

fn main() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut all = vec![measure("memory", &MemStore::new())];
    let redb = RedbStore::open_in_dir(dir.path()).expect("redb opens");
    all.push(measure("redb", &redb));
    let etcd = etcd::Etcd::start("store bench", 1);
    if let Some(e) = &etcd {
        all.push(measure("etcd (1 member, local)", &e.store("/bench")));
    }
    let redb_txn = all[1].txn[N / 2].as_secs_f64();
    println!(
        "{:<24} {:>10} {:>10} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "store",
        "txn p50",
        "txn p99",
        "÷redb",
        "get p50",
        "get p99",
        "list 100",
        "list 1000",
        "changes"
    );
    for f in &all {
        println!(
            "{:<24} {:>10.2?} {:>10.2?} {:>8.2} {:>10.2?} {:>10.2?} {:>10.2?} {:>10.2?} {:>10.2?}",
            f.name,
            f.txn[N / 2],
            f.txn[N * 99 / 100],
            f.txn[N / 2].as_secs_f64() / redb_txn,
            f.get[N / 2],
            f.get[N * 99 / 100],
            f.list_100,
            f.list_1000,
            f.changes
        );
    }
    if etcd.is_none() {
        println!("etcd: not measured (no etcd binary; Debian: etcd-server)");
    }
}
