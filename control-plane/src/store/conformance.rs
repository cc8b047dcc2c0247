//! The contract of [`Store`], as a test suite any implementation runs
//! (`MemStore`, `RedbStore`, and a future etcd store): each function takes a
//! fresh, empty store and panics on the first deviation.

use super::{
    Change, Condition, FailedCondition, HistoryLimits, KeyValue, Op, Store, StoreError, TxnOutcome,
};
use crate::limits::VALUE_BYTES_MAX;

/// The history limits [`history`] expects its store to be built with.
pub const SMALL_HISTORY: HistoryLimits = HistoryLimits {
    revisions: 4,
    bytes: 64,
};

fn put(k: &str, v: &[u8]) -> Op {
    Op::Put(k.into(), v.to_vec())
}

fn missing(k: &str) -> Condition {
    Condition::Missing(k.into())
}

fn version_is(k: &str, v: u64) -> Condition {
    Condition::VersionIs(k.into(), v)
}

fn committed(outcome: TxnOutcome) -> u64 {
    match outcome {
        TxnOutcome::Committed { revision } => revision,
        TxnOutcome::Conflict(f) => panic!("expected a commit, got a conflict on {f:?}"),
    }
}

fn keys(store: &dyn Store, prefix: &str) -> Vec<String> {
    let listing = store.list(prefix).expect("list");
    listing.entries.into_iter().map(|kv| kv.key).collect()
}

fn value(store: &dyn Store, key: &str) -> Option<(Vec<u8>, u64)> {
    store
        .get(key)
        .expect("get")
        .map(|kv| (kv.value, kv.version))
}

/// Reads, conditional writes, atomicity, revisions, versions, listing and
/// change history on a fresh store that keeps at least 100 revisions.
pub fn run(store: &dyn Store) {
    // Empty.
    assert_eq!(store.revision().unwrap(), 0);
    assert_eq!(store.get("/a/1").unwrap(), None);
    let empty = store.list("").unwrap();
    assert_eq!((empty.revision, empty.entries.len()), (0, 0));
    assert!(store.changes_since(0).unwrap().is_empty());
    assert!(matches!(
        store.changes_since(1),
        Err(StoreError::FutureRevision {
            requested: 1,
            current: 0
        })
    ));

    // Create-if-missing, once.
    let r1 = committed(
        store
            .txn(&[missing("/a/1")], &[put("/a/1", b"one")])
            .unwrap(),
    );
    assert_eq!(r1, 1);
    assert_eq!(
        store.get("/a/1").unwrap(),
        Some(KeyValue {
            key: "/a/1".into(),
            value: b"one".to_vec(),
            version: 1
        })
    );
    let again = store
        .txn(&[missing("/a/1")], &[put("/a/1", b"two")])
        .unwrap();
    assert_eq!(
        again,
        TxnOutcome::Conflict(vec![FailedCondition {
            index: 0,
            condition: missing("/a/1"),
            actual: Some(1)
        }])
    );
    assert_eq!(
        store.revision().unwrap(),
        1,
        "a conflict consumes no revision"
    );
    assert_eq!(value(store, "/a/1"), Some((b"one".to_vec(), 1)));

    // Several ops share one revision.
    let r2 = committed(
        store
            .txn(
                &[missing("/a/2"), missing("/b/1")],
                &[put("/a/2", b"two"), put("/b/1", b"b"), put("/ab", b"")],
            )
            .unwrap(),
    );
    assert_eq!(r2, 2);
    for k in ["/a/2", "/b/1", "/ab"] {
        assert_eq!(store.get(k).unwrap().unwrap().version, 2, "{k}");
    }
    assert_eq!(value(store, "/ab"), Some((vec![], 2)), "empty values exist");

    // All or nothing: one failing condition stops every op.
    let out = store
        .txn(
            &[version_is("/a/1", 1), version_is("/a/2", 1)],
            &[put("/a/1", b"changed"), Op::Delete("/b/1".into())],
        )
        .unwrap();
    assert_eq!(
        out,
        TxnOutcome::Conflict(vec![FailedCondition {
            index: 1,
            condition: version_is("/a/2", 1),
            actual: Some(2)
        }])
    );
    assert_eq!(value(store, "/a/1"), Some((b"one".to_vec(), 1)));
    assert!(store.get("/b/1").unwrap().is_some());

    // Every failing condition is listed, in order; VersionIs fails on a missing key.
    let out = store
        .txn(
            &[
                version_is("/a/1", 99),
                missing("/a/2"),
                missing("/zzz"),
                version_is("/zzz", 1),
            ],
            &[],
        )
        .unwrap();
    let TxnOutcome::Conflict(failed) = out else {
        panic!("expected a conflict");
    };
    let summary: Vec<(usize, Option<u64>)> = failed.iter().map(|f| (f.index, f.actual)).collect();
    assert_eq!(summary, vec![(0, Some(1)), (1, Some(2)), (3, None)]);

    // Conditions on keys the ops do not touch.
    let r3 = committed(
        store
            .txn(
                &[version_is("/a/1", 1), missing("/nothing")],
                &[put("/a/2", b"TWO")],
            )
            .unwrap(),
    );
    assert_eq!(r3, 3);
    assert_eq!(value(store, "/a/2"), Some((b"TWO".to_vec(), 3)));

    // Listing: key order, prefix is a plain string prefix, revision of the read.
    assert_eq!(keys(store, "/a/"), ["/a/1", "/a/2"]);
    assert_eq!(keys(store, "/a"), ["/a/1", "/a/2", "/ab"]);
    assert_eq!(keys(store, ""), ["/a/1", "/a/2", "/ab", "/b/1"]);
    assert_eq!(keys(store, "/c"), Vec::<String>::new());
    assert_eq!(store.list("/a/").unwrap().revision, 3);

    // Deletes: a real one takes a revision; a missing one, or nothing, does not.
    let r4 = committed(
        store
            .txn(&[version_is("/b/1", 2)], &[Op::Delete("/b/1".into())])
            .unwrap(),
    );
    assert_eq!(r4, 4);
    assert_eq!(store.get("/b/1").unwrap(), None);
    assert_eq!(
        committed(store.txn(&[], &[Op::Delete("/nope".into())]).unwrap()),
        4
    );
    assert_eq!(committed(store.txn(&[], &[]).unwrap()), 4);
    assert_eq!(
        committed(store.txn(&[version_is("/a/1", 1)], &[]).unwrap()),
        4
    );
    assert_eq!(store.revision().unwrap(), 4);

    // Re-creating a deleted key gives it a new, higher version.
    let r5 = committed(
        store
            .txn(&[missing("/b/1")], &[put("/b/1", b"again")])
            .unwrap(),
    );
    assert_eq!(r5, 5);
    assert_eq!(store.get("/b/1").unwrap().unwrap().version, 5);

    // Invalid transactions are refused whole.
    assert!(matches!(
        store.txn(&[], &[put("/x", b"1"), Op::Delete("/x".into())]),
        Err(StoreError::InvalidTxn(_))
    ));
    assert!(matches!(
        store.txn(&[], &[put("/y", b"1"), put("", b"1")]),
        Err(StoreError::InvalidTxn(_))
    ));
    assert!(matches!(
        store.txn(&[], &[put("/y", &vec![0; VALUE_BYTES_MAX + 1])]),
        Err(StoreError::InvalidTxn(_))
    ));
    assert_eq!(store.get("/y").unwrap(), None);
    assert_eq!(store.revision().unwrap(), 5);

    // Binary and large values round-trip.
    let binary: Vec<u8> = (0..=255).collect();
    let large: Vec<u8> = (0..VALUE_BYTES_MAX).map(|i| (i * 7 % 251) as u8).collect();
    let r6 = committed(
        store
            .txn(&[], &[put("/bin", &binary), put("/large", &large)])
            .unwrap(),
    );
    assert_eq!(r6, 6);
    assert_eq!(value(store, "/bin"), Some((binary.clone(), 6)));
    assert_eq!(value(store, "/large"), Some((large.clone(), 6)));
    let r7 = committed(
        store
            .txn(&[version_is("/large", 6)], &[Op::Delete("/large".into())])
            .unwrap(),
    );
    assert_eq!(r7, 7);

    // The change log, in revision and op order.
    let c = |revision, key: &str, value: Option<&[u8]>| Change {
        revision,
        key: key.into(),
        value: value.map(<[u8]>::to_vec),
    };
    let expected = vec![
        c(1, "/a/1", Some(b"one")),
        c(2, "/a/2", Some(b"two")),
        c(2, "/b/1", Some(b"b")),
        c(2, "/ab", Some(b"")),
        c(3, "/a/2", Some(b"TWO")),
        c(4, "/b/1", None),
        c(5, "/b/1", Some(b"again")),
        c(6, "/bin", Some(&binary)),
        c(6, "/large", Some(&large)),
        c(7, "/large", None),
    ];
    assert_eq!(store.changes_since(0).unwrap(), expected);
    assert_eq!(store.changes_since(3).unwrap(), expected[5..]);
    assert!(store.changes_since(7).unwrap().is_empty());
    assert!(matches!(
        store.changes_since(8),
        Err(StoreError::FutureRevision { .. })
    ));

    // A listing and the changes after it reconstruct the present.
    let listing = store.list("/b/").unwrap();
    committed(store.txn(&[], &[put("/b/2", b"later")]).unwrap());
    let after = store.changes_since(listing.revision).unwrap();
    assert_eq!(after, vec![c(8, "/b/2", Some(b"later"))]);
}

/// Trimming of the change log, on a fresh store built with [`SMALL_HISTORY`]
/// (4 revisions, 64 bytes).
pub fn history(store: &dyn Store) {
    // Ten small revisions (8 bytes each): only the last four are kept.
    for i in 0..10 {
        let key = format!("/h/{i}");
        committed(store.txn(&[missing(&key)], &[put(&key, b"vvvv")]).unwrap());
    }
    assert_eq!(store.revision().unwrap(), 10);
    assert!(matches!(
        store.changes_since(5),
        Err(StoreError::Compacted {
            requested: 5,
            compacted: 6
        })
    ));
    assert!(matches!(
        store.changes_since(0),
        Err(StoreError::Compacted { .. })
    ));
    let kept = store.changes_since(6).unwrap();
    let revs: Vec<u64> = kept.iter().map(|c| c.revision).collect();
    assert_eq!(revs, [7, 8, 9, 10]);
    // Trimming history never touches the data.
    assert_eq!(keys(store, "/h/").len(), 10);

    // A 64-byte change pushes the three older 8-byte ones out (byte budget).
    committed(store.txn(&[], &[put("/big", &[1; 60])]).unwrap());
    assert!(matches!(
        store.changes_since(9),
        Err(StoreError::Compacted { compacted: 10, .. })
    ));
    assert_eq!(store.changes_since(10).unwrap().len(), 1);

    // A change larger than the whole budget is still kept, alone.
    committed(store.txn(&[], &[put("/huge", &[2; 200])]).unwrap());
    let kept = store.changes_since(11).unwrap();
    assert_eq!(kept.len(), 1);
    assert_eq!(kept[0].key, "/huge");
    assert!(store.changes_since(10).is_err());
    assert!(store.changes_since(12).unwrap().is_empty());
}

/// `threads` threads each add 1 to a counter `per_thread` times by
/// compare-and-swap, retrying on conflict, on a fresh store that keeps at
/// least `threads * per_thread` revisions. No increment may be lost, and
/// the history must show every value once, in order.
pub fn concurrent_increments(store: &dyn Store, threads: u64, per_thread: u64) {
    const KEY: &str = "/counter";
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                for _ in 0..per_thread {
                    loop {
                        let current = store.get(KEY).unwrap();
                        let (n, condition) = match &current {
                            Some(kv) => (
                                u64::from_le_bytes(kv.value[..].try_into().unwrap()),
                                version_is(KEY, kv.version),
                            ),
                            None => (0, missing(KEY)),
                        };
                        let op = Op::Put(KEY.into(), (n + 1).to_le_bytes().to_vec());
                        match store.txn(&[condition], &[op]).unwrap() {
                            TxnOutcome::Committed { .. } => break,
                            TxnOutcome::Conflict(_) => continue,
                        }
                    }
                }
            });
        }
    });
    let total = threads * per_thread;
    let kv = store.get(KEY).unwrap().unwrap();
    assert_eq!(u64::from_le_bytes(kv.value[..].try_into().unwrap()), total);
    assert_eq!(kv.version, total);
    let seen: Vec<u64> = store
        .changes_since(0)
        .unwrap()
        .iter()
        .map(|c| u64::from_le_bytes(c.value.as_ref().unwrap()[..].try_into().unwrap()))
        .collect();
    assert_eq!(seen, (1..=total).collect::<Vec<_>>());
}
