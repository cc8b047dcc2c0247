//! The contract of [`Store`], as a test suite any implementation runs
//! (`MemStore`, `RedbStore`, `EtcdStore`): each function takes a fresh,
//! empty store and panics on the first deviation.
//!
//! Revisions are asserted in relative terms: a commit that changes
//! something returns a revision above every earlier one, the versions of
//! the keys it wrote equal that revision, and `changes_since(r)` returns
//! exactly the changes after `r`. A store with a private counter (see
//! [`Revisions`]) is held to more: it starts at 0 and counts in steps of
//! exactly 1. etcd's revision is shared by every key in that etcd, so an
//! etcd store starts wherever the etcd is and has gaps wherever someone
//! else wrote; the suite makes such gaps itself (`Revisions::Shared`) so
//! that they are tested, not merely tolerated.

use super::{
    Change, Condition, FailedCondition, HistoryLimits, KeyValue, Op, Revision, Store, StoreError,
    TxnOutcome,
};
use crate::limits::VALUE_BYTES_MAX;

/// The history limits [`history`] expects its store to be built with.
pub const SMALL_HISTORY: HistoryLimits = HistoryLimits {
    revisions: 4,
    bytes: 64,
};

/// How the store under test numbers its revisions.
#[derive(Clone, Copy)]
pub enum Revisions<'a> {
    /// Its own counter (`MemStore`, `RedbStore`): 0 when fresh, and every
    /// transaction that changes something adds exactly 1.
    Private,
    /// A counter shared with other writers (etcd): anywhere when fresh, and
    /// growing by 1 or more. The suite calls `gap` between some of its
    /// steps; it should commit a write outside the store under test (in
    /// another prefix of the same etcd) so that revisions skip.
    Shared { gap: &'a (dyn Fn() + Sync) },
}

impl std::fmt::Debug for Revisions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Revisions::Private => "Private",
            Revisions::Shared { .. } => "Shared",
        })
    }
}

/// Follows the revisions of the suite's commits.
struct Tracker<'a> {
    mode: Revisions<'a>,
    last: Revision,
}

impl<'a> Tracker<'a> {
    fn start(store: &dyn Store, mode: Revisions<'a>) -> Tracker<'a> {
        let base = store.revision().unwrap();
        if let Revisions::Private = mode {
            assert_eq!(base, 0, "a fresh store is at revision 0");
        }
        Tracker { mode, last: base }
    }

    /// A commit that changed something returned `r`.
    fn changed(&mut self, r: Revision) -> Revision {
        match self.mode {
            Revisions::Private => assert_eq!(r, self.last + 1, "revisions count in steps of 1"),
            Revisions::Shared { .. } => assert!(r > self.last, "revision {r} after {}", self.last),
        }
        self.last = r;
        r
    }

    /// Another writer commits, outside the store (a no-op when private).
    fn gap(&mut self, store: &dyn Store) {
        if let Revisions::Shared { gap } = self.mode {
            gap();
            let now = store.revision().unwrap();
            assert!(now > self.last, "the gap wrote nothing");
            self.last = now;
        }
    }
}

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
pub fn run(store: &dyn Store, revisions: Revisions<'_>) {
    let mut rev = Tracker::start(store, revisions);
    let base = rev.last;

    // Empty.
    assert_eq!(store.get("/a/1").unwrap(), None);
    let empty = store.list("").unwrap();
    assert_eq!((empty.revision, empty.entries.len()), (base, 0));
    assert!(store.changes_since(base).unwrap().is_empty());
    assert!(matches!(
        store.changes_since(base + 1),
        Err(StoreError::FutureRevision { requested, current })
            if (requested, current) == (base + 1, base)
    ));

    // Create-if-missing, once.
    let r1 = rev.changed(committed(
        store
            .txn(&[missing("/a/1")], &[put("/a/1", b"one")])
            .unwrap(),
    ));
    assert_eq!(
        store.get("/a/1").unwrap(),
        Some(KeyValue {
            key: "/a/1".into(),
            value: b"one".to_vec(),
            version: r1
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
            actual: Some(r1)
        }])
    );
    assert_eq!(
        store.revision().unwrap(),
        r1,
        "a conflict consumes no revision"
    );
    assert_eq!(value(store, "/a/1"), Some((b"one".to_vec(), r1)));
    rev.gap(store);

    // Several ops share one revision.
    let r2 = rev.changed(committed(
        store
            .txn(
                &[missing("/a/2"), missing("/b/1")],
                &[put("/a/2", b"two"), put("/b/1", b"b"), put("/ab", b"")],
            )
            .unwrap(),
    ));
    for k in ["/a/2", "/b/1", "/ab"] {
        assert_eq!(store.get(k).unwrap().unwrap().version, r2, "{k}");
    }
    assert_eq!(
        value(store, "/ab"),
        Some((vec![], r2)),
        "empty values exist"
    );

    // All or nothing: one failing condition stops every op.
    let out = store
        .txn(
            &[version_is("/a/1", r1), version_is("/a/2", r1)],
            &[put("/a/1", b"changed"), Op::Delete("/b/1".into())],
        )
        .unwrap();
    assert_eq!(
        out,
        TxnOutcome::Conflict(vec![FailedCondition {
            index: 1,
            condition: version_is("/a/2", r1),
            actual: Some(r2)
        }])
    );
    assert_eq!(value(store, "/a/1"), Some((b"one".to_vec(), r1)));
    assert!(store.get("/b/1").unwrap().is_some());

    // Every failing condition is listed, in order; VersionIs fails on a
    // missing key, and a version no key can have (0, or far ahead) fails.
    let out = store
        .txn(
            &[
                version_is("/a/1", r2 + 1_000),
                missing("/a/2"),
                missing("/zzz"),
                version_is("/zzz", r1),
                version_is("/a/1", 0),
                version_is("/zzz", 0),
            ],
            &[],
        )
        .unwrap();
    let TxnOutcome::Conflict(failed) = out else {
        panic!("expected a conflict");
    };
    let summary: Vec<(usize, Option<u64>)> = failed.iter().map(|f| (f.index, f.actual)).collect();
    assert_eq!(
        summary,
        vec![
            (0, Some(r1)),
            (1, Some(r2)),
            (3, None),
            (4, Some(r1)),
            (5, None)
        ]
    );
    rev.gap(store);

    // Conditions on keys the ops do not touch.
    let r3 = rev.changed(committed(
        store
            .txn(
                &[version_is("/a/1", r1), missing("/nothing")],
                &[put("/a/2", b"TWO")],
            )
            .unwrap(),
    ));
    assert_eq!(value(store, "/a/2"), Some((b"TWO".to_vec(), r3)));

    // Listing: key order, prefix is a plain string prefix, revision of the read.
    assert_eq!(keys(store, "/a/"), ["/a/1", "/a/2"]);
    assert_eq!(keys(store, "/a"), ["/a/1", "/a/2", "/ab"]);
    assert_eq!(keys(store, ""), ["/a/1", "/a/2", "/ab", "/b/1"]);
    assert_eq!(keys(store, "/c"), Vec::<String>::new());
    assert_eq!(store.list("/a/").unwrap().revision, r3);
    // Keys are paths: anything else names no key.
    assert_eq!(store.get("a/1").unwrap(), None);
    assert_eq!(store.list("a").unwrap().revision, r3);
    assert_eq!(keys(store, "a"), Vec::<String>::new());

    // Deletes: a real one takes a revision; a missing one, or nothing, does not.
    let r4 = rev.changed(committed(
        store
            .txn(&[version_is("/b/1", r2)], &[Op::Delete("/b/1".into())])
            .unwrap(),
    ));
    assert_eq!(store.get("/b/1").unwrap(), None);
    assert_eq!(
        committed(store.txn(&[], &[Op::Delete("/nope".into())]).unwrap()),
        r4
    );
    assert_eq!(committed(store.txn(&[], &[]).unwrap()), r4);
    assert_eq!(
        committed(store.txn(&[version_is("/a/1", r1)], &[]).unwrap()),
        r4
    );
    assert_eq!(store.revision().unwrap(), r4);

    // Re-creating a deleted key gives it a new, higher version.
    let r5 = rev.changed(committed(
        store
            .txn(&[missing("/b/1")], &[put("/b/1", b"again")])
            .unwrap(),
    ));
    assert_eq!(store.get("/b/1").unwrap().unwrap().version, r5);

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
        store.txn(&[], &[put("/y", b"1"), put("y", b"1")]),
        Err(StoreError::InvalidTxn(_))
    ));
    assert!(matches!(
        store.txn(&[], &[put("/y", &vec![0; VALUE_BYTES_MAX + 1])]),
        Err(StoreError::InvalidTxn(_))
    ));
    assert_eq!(store.get("/y").unwrap(), None);
    assert_eq!(store.revision().unwrap(), r5);
    rev.gap(store);

    // Binary and large values round-trip.
    let binary: Vec<u8> = (0..=255).collect();
    let large: Vec<u8> = (0..VALUE_BYTES_MAX).map(|i| (i * 7 % 251) as u8).collect();
    let r6 = rev.changed(committed(
        store
            .txn(&[], &[put("/bin", &binary), put("/large", &large)])
            .unwrap(),
    ));
    assert_eq!(value(store, "/bin"), Some((binary.clone(), r6)));
    assert_eq!(value(store, "/large"), Some((large.clone(), r6)));
    rev.gap(store);
    let between = store.revision().unwrap();
    let r7 = rev.changed(committed(
        store
            .txn(&[version_is("/large", r6)], &[Op::Delete("/large".into())])
            .unwrap(),
    ));
    rev.gap(store);

    // The change log, in revision and op order.
    let c = |revision, key: &str, value: Option<&[u8]>| Change {
        revision,
        key: key.into(),
        value: value.map(<[u8]>::to_vec),
    };
    let expected = vec![
        c(r1, "/a/1", Some(b"one")),
        c(r2, "/a/2", Some(b"two")),
        c(r2, "/b/1", Some(b"b")),
        c(r2, "/ab", Some(b"")),
        c(r3, "/a/2", Some(b"TWO")),
        c(r4, "/b/1", None),
        c(r5, "/b/1", Some(b"again")),
        c(r6, "/bin", Some(&binary)),
        c(r6, "/large", Some(&large)),
        c(r7, "/large", None),
    ];
    assert_eq!(store.changes_since(base).unwrap(), expected);
    assert_eq!(store.changes_since(r3).unwrap(), expected[5..]);
    assert_eq!(
        store.changes_since(between).unwrap(),
        expected[9..],
        "from a revision another writer made"
    );
    assert!(store.changes_since(r7).unwrap().is_empty());
    let now = store.revision().unwrap();
    assert!(store.changes_since(now).unwrap().is_empty());
    assert!(matches!(
        store.changes_since(now + 1),
        Err(StoreError::FutureRevision { requested, current })
            if (requested, current) == (now + 1, now)
    ));

    // A listing and the changes after it reconstruct the present.
    let listing = store.list("/b/").unwrap();
    assert_eq!(listing.revision, now);
    rev.gap(store);
    let r8 = rev.changed(committed(store.txn(&[], &[put("/b/2", b"later")]).unwrap()));
    let after = store.changes_since(listing.revision).unwrap();
    assert_eq!(after, vec![c(r8, "/b/2", Some(b"later"))]);
}

/// Trimming of the change log, on a fresh store built with [`SMALL_HISTORY`]
/// (4 revisions, 64 bytes).
pub fn history(store: &dyn Store, revisions: Revisions<'_>) {
    let mut rev = Tracker::start(store, revisions);
    let base = rev.last;
    // Ten small revisions (8 bytes each): only the last four are kept.
    let mut r = Vec::new();
    for i in 0..10 {
        let key = format!("/h/{i}");
        r.push(rev.changed(committed(
            store.txn(&[missing(&key)], &[put(&key, b"vvvv")]).unwrap(),
        )));
        if i % 3 == 1 {
            rev.gap(store);
        }
    }
    assert!(matches!(
        store.changes_since(r[4]),
        Err(StoreError::Compacted {
            requested,
            compacted
        }) if (requested, compacted) == (r[4], r[5])
    ));
    assert!(matches!(
        store.changes_since(base),
        Err(StoreError::Compacted { .. })
    ));
    let kept = store.changes_since(r[5]).unwrap();
    let revs: Vec<u64> = kept.iter().map(|c| c.revision).collect();
    assert_eq!(revs, r[6..]);
    // Trimming history never touches the data.
    assert_eq!(keys(store, "/h/").len(), 10);

    // A 64-byte change pushes the three older 8-byte ones out (byte budget).
    let big = rev.changed(committed(store.txn(&[], &[put("/big", &[1; 60])]).unwrap()));
    assert!(matches!(
        store.changes_since(r[8]),
        Err(StoreError::Compacted { compacted, .. }) if compacted == r[9]
    ));
    assert_eq!(store.changes_since(r[9]).unwrap().len(), 1);

    // A change larger than the whole budget is still kept, alone.
    let huge = rev.changed(committed(
        store.txn(&[], &[put("/huge", &[2; 200])]).unwrap(),
    ));
    let kept = store.changes_since(big).unwrap();
    assert_eq!(kept.len(), 1);
    assert_eq!(kept[0].key, "/huge");
    assert!(store.changes_since(r[9]).is_err());
    assert!(store.changes_since(huge).unwrap().is_empty());
}

/// `threads` threads each add 1 to a counter `per_thread` times by
/// compare-and-swap, retrying on conflict, on a fresh store that keeps at
/// least `threads * per_thread` revisions. No increment may be lost, and
/// the history must show every value once, in order.
pub fn concurrent_increments(
    store: &dyn Store,
    revisions: Revisions<'_>,
    threads: u64,
    per_thread: u64,
) {
    const KEY: &str = "/counter";
    let rev = Tracker::start(store, revisions);
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
    let history = store.changes_since(rev.last).unwrap();
    let seen: Vec<u64> = history
        .iter()
        .map(|c| u64::from_le_bytes(c.value.as_ref().unwrap()[..].try_into().unwrap()))
        .collect();
    assert_eq!(seen, (1..=total).collect::<Vec<_>>());
    assert!(history.windows(2).all(|w| w[0].revision < w[1].revision));
    assert_eq!(history.last().unwrap().revision, kv.version);
    if let Revisions::Private = revisions {
        assert_eq!(kv.version, total, "one revision per increment");
    }
}
