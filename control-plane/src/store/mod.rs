//! The metadata store: a small, transactional key-value map with etcd's
//! data model, embedded (redb) for one control plane or on etcd so that
//! several control planes can share it, without touching the layers above.
//!
//! ```text
//!   state.rs ── get / list(prefix) ──────────────► Store ─┬─ RedbStore (one file, default)
//!            ── txn(conditions, ops) ─ CAS ──────►        ├─ EtcdStore (etcd v3, feature "etcd")
//!   watchers ── changes_since(revision) ─ poll ──►        └─ MemStore  (tests)
//!   migrate  ── copy_all(from, to) ── every key, into an empty store
//! ```
//!
//! The model, and why each part is there:
//!
//! - **Keys are paths, values bytes.** Keys start with `/` (`/targets/{id}`,
//!   `/volumes/{uuid}`) so that `list(prefix)` reads one kind of object, and
//!   so that an etcd store can put them under its own prefix (`/nvpool` +
//!   key) without two clusters' keys ever meeting.
//! - **A store revision counts committed transactions that changed
//!   something.** Every transaction that puts or deletes at least one key
//!   gets a new, higher revision; all its changes carry that revision. A
//!   transaction that changes nothing (only deletes of missing keys, or no
//!   operations) does not consume one. The embedded stores count from 0 in
//!   steps of 1; etcd's revision is shared by everything in that etcd, so
//!   there it grows in steps of 1 or more, and callers only ever compare
//!   revisions.
//! - **Every key has a version: the revision that last wrote it** (etcd's
//!   `mod_revision`). It is never 0 for an existing key, and a deleted and
//!   re-created key gets a new, higher one, so "unchanged since I read it"
//!   is exactly "version equal".
//! - **One write primitive: `txn(conditions, ops)`.** Conditions are
//!   `VersionIs` and `Missing`; if all hold, every op is applied atomically
//!   and durably, else nothing is and the failing conditions are returned.
//!   That is etcd's `Txn(Compare…).Then(…)` without the `Else` branch, and
//!   it is all the layers above need for optimistic read → compute → commit.
//! - **`list` returns the revision it read at.** A watcher lists, then polls
//!   `changes_since(that revision)`; together they never miss a change.
//! - **History is bounded.** `changes_since` serves at most
//!   `CHANGE_LOG_REVISIONS_MAX` revisions and `CHANGE_LOG_BYTES_MAX` bytes
//!   of changes; asking for older changes fails with `Compacted`, and the
//!   watcher lists again (etcd's watch has the same contract, and an etcd
//!   store also answers `Compacted` when etcd compacted its own history).
//!
//! Deliberately absent from `Store`: leases (heartbeats are timestamps in
//! the records, judged by the reader; the one lease, the leader's, is the
//! separate [`Elector`] of a shared store), range deletes, and reads inside
//! transactions (the caller reads first and conditions on versions).

pub mod conformance;
#[cfg(feature = "etcd")]
pub mod etcd;
mod mem;
pub mod migrate;
#[cfg(feature = "redb")]
mod redb;
pub mod url;

#[cfg(feature = "etcd")]
pub use etcd::{EtcdConfig, EtcdStore, EtcdTls};
pub use mem::MemStore;
#[cfg(feature = "redb")]
pub use redb::{RedbStore, STORE_FILE};
pub use url::{EtcdUrl, StoreUrl};

use crate::limits::{
    CHANGE_LOG_BYTES_MAX, CHANGE_LOG_REVISIONS_MAX, KEY_BYTES_MAX, TXN_BYTES_MAX,
    TXN_CONDITIONS_MAX, TXN_OPS_MAX, VALUE_BYTES_MAX,
};
use std::collections::BTreeSet;
use std::fmt;

/// A store revision, and the version of a key (the revision that last wrote it).
pub type Revision = u64;

/// One key as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    /// The revision that last wrote this key; never 0.
    pub version: Revision,
}

/// The answer to `list`: every key under a prefix, in key order, as of one
/// revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listing {
    /// The store revision the listing was read at: `changes_since(revision)`
    /// continues exactly where this listing ends.
    pub revision: Revision,
    pub entries: Vec<KeyValue>,
}

/// A precondition of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Condition {
    /// The key exists and was last written at this revision.
    VersionIs(String, Revision),
    /// The key does not exist.
    Missing(String),
}

impl Condition {
    pub fn key(&self) -> &str {
        match self {
            Condition::VersionIs(k, _) | Condition::Missing(k) => k,
        }
    }

    /// Whether the condition holds for a key whose current version is `actual`.
    pub fn holds(&self, actual: Option<Revision>) -> bool {
        match self {
            Condition::VersionIs(_, v) => actual == Some(*v),
            Condition::Missing(_) => actual.is_none(),
        }
    }
}

/// A write of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Put(String, Vec<u8>),
    /// Deleting a missing key is not an error and records no change.
    Delete(String),
}

impl Op {
    pub fn key(&self) -> &str {
        match self {
            Op::Put(k, _) | Op::Delete(k) => k,
        }
    }
}

/// A condition that did not hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedCondition {
    /// Its position in the `conditions` slice.
    pub index: usize,
    pub condition: Condition,
    /// The key's version when the transaction was evaluated (`None`: missing).
    pub actual: Option<Revision>,
}

/// The result of a transaction that the store evaluated.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum TxnOutcome {
    /// Every op was applied, durably. `revision` is the new store revision,
    /// or the unchanged current one when the ops changed nothing.
    Committed { revision: Revision },
    /// Nothing was applied: these conditions failed (all of them, in order).
    Conflict(Vec<FailedCondition>),
}

/// One change of one key, as recorded in the change log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The revision of the transaction that made the change.
    pub revision: Revision,
    pub key: String,
    /// The new value; `None` when the key was deleted.
    pub value: Option<Vec<u8>>,
}

impl Change {
    /// What the change costs in the change log's byte budget.
    pub fn history_bytes(&self) -> u64 {
        (self.key.len() + self.value.as_ref().map_or(0, Vec::len)) as u64
    }
}

/// How much history a store keeps for `changes_since`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryLimits {
    /// Revisions kept (at least 1: the newest revision is always kept).
    pub revisions: u64,
    /// Bytes of keys and values kept; the newest revision is kept even if it
    /// alone is larger.
    pub bytes: u64,
}

impl Default for HistoryLimits {
    fn default() -> Self {
        HistoryLimits {
            revisions: CHANGE_LOG_REVISIONS_MAX,
            bytes: CHANGE_LOG_BYTES_MAX,
        }
    }
}

impl HistoryLimits {
    /// Whether the log must drop its oldest revision, holding `revisions`
    /// revisions of `bytes` in total.
    pub(crate) fn exceeded(&self, revisions: u64, bytes: u64) -> bool {
        revisions > 1 && (revisions > self.revisions.max(1) || bytes > self.bytes)
    }
}

/// Why a store operation failed. `Conflict` is not an error: it is a
/// [`TxnOutcome`].
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The change log no longer holds the changes after `requested`: list
    /// again and continue from the listing's revision.
    #[error(
        "changes after revision {requested} are compacted (history starts after revision \
         {compacted}); list again"
    )]
    Compacted {
        requested: Revision,
        compacted: Revision,
    },
    #[error("revision {requested} is ahead of the store (at revision {current})")]
    FutureRevision {
        requested: Revision,
        current: Revision,
    },
    /// The transaction breaks a limit or repeats a key; nothing was applied.
    #[error("invalid transaction: {0}")]
    InvalidTxn(String),
    /// The storage underneath failed (I/O, lock, full disk). After a failed
    /// commit the redb store refuses further writes until reopened.
    #[error("store {op} failed")]
    Backend {
        op: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The stored bytes do not decode.
    #[error("store is corrupt: {0}")]
    Corrupt(String),
    /// The store's servers cannot answer: every etcd endpoint is down, etcd
    /// lost its quorum, or no answer came within the deadline. A `txn` that
    /// fails so may or may not have been applied: read again before
    /// deciding (the layers above always do, they condition on versions).
    #[error("{store} is unavailable: {reason}")]
    Unavailable {
        /// Which store, e.g. `etcd at 10.0.0.1:2379,10.0.0.2:2379`.
        store: String,
        reason: String,
    },
    /// Another process holds the store (redb locks its file): a second
    /// control plane, or a migration, on the same directory.
    #[error("store {0} is in use by another process (is nvpool-control running on it?)")]
    InUse(String),
}

/// A transactional key-value store with revisions and bounded history. See
/// the module documentation for the model. Implementations are shared
/// between threads: every method may be called concurrently.
pub trait Store: Send + Sync + fmt::Debug {
    /// The key's value and version, or `None` if it is missing.
    fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError>;
    /// Every key starting with `prefix` (all keys for `""`), in key order,
    /// read from one consistent snapshot.
    fn list(&self, prefix: &str) -> Result<Listing, StoreError>;
    /// Applies every op atomically and durably if every condition holds.
    /// A key may appear in at most one op.
    fn txn(&self, conditions: &[Condition], ops: &[Op]) -> Result<TxnOutcome, StoreError>;
    /// The current store revision: 0 for a never-written embedded store;
    /// an etcd store starts wherever that etcd's revision is.
    fn revision(&self) -> Result<Revision, StoreError>;
    /// Every change with a revision greater than `revision` (up to the
    /// current revision), in revision order (changes of one transaction in
    /// op order), or `Compacted` if some of them were trimmed from the
    /// history, or `FutureRevision` if `revision` is ahead of the store.
    fn changes_since(&self, revision: Revision) -> Result<Vec<Change>, StoreError>;
    /// Leader election among the processes sharing this store, for stores
    /// that several processes can share (etcd); `None` for a store only one
    /// process can open, whose process is always the leader.
    fn elector(&self) -> Option<&dyn Elector> {
        None
    }
}

/// The store key an elected leader holds, under a lease; its version is the
/// leader's term, and the fencing condition of every write the leader makes.
pub const LEADER_KEY: &str = "/leader";

/// What a campaign found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Campaign {
    /// The leader key is now ours: held under `lease`, written at `version`.
    Won { lease: i64, version: Revision },
    /// Another process holds it (its holder text, as it wrote it).
    Held { holder: String },
}

/// Leader election on a shared store: one key under a lease that the
/// store's servers expire on their own clock when it is not renewed. See
/// `crate::leader` for how the control plane uses it.
pub trait Elector: Send + Sync + fmt::Debug {
    /// Grants a lease of `ttl_s` seconds and puts [`LEADER_KEY`] = `holder`
    /// under it if the key is missing. A lost campaign revokes its lease.
    fn campaign(&self, holder: &str, ttl_s: u32) -> Result<Campaign, StoreError>;
    /// Renews `lease`: `Ok(false)` when it is gone (expired or revoked).
    fn renew(&self, lease: i64) -> Result<bool, StoreError>;
    /// Gives the lease up now (and with it the leader key), best effort.
    fn resign(&self, lease: i64);
}

/// Checks the limits every implementation enforces, so that a transaction
/// valid on one store is valid on all of them.
pub(crate) fn validate_txn(conditions: &[Condition], ops: &[Op]) -> Result<(), StoreError> {
    if conditions.len() > TXN_CONDITIONS_MAX {
        return Err(StoreError::InvalidTxn(format!(
            "{} conditions, at most {TXN_CONDITIONS_MAX}",
            conditions.len()
        )));
    }
    if ops.len() > TXN_OPS_MAX {
        return Err(StoreError::InvalidTxn(format!(
            "{} operations, at most {TXN_OPS_MAX}",
            ops.len()
        )));
    }
    for c in conditions {
        validate_key(c.key())?;
    }
    let mut keys = BTreeSet::new();
    let mut bytes = 0usize;
    for op in ops {
        validate_key(op.key())?;
        if !keys.insert(op.key()) {
            return Err(StoreError::InvalidTxn(format!(
                "key {:?} appears in more than one operation",
                op.key()
            )));
        }
        bytes += op.key().len();
        if let Op::Put(key, value) = op {
            if value.len() > VALUE_BYTES_MAX {
                return Err(StoreError::InvalidTxn(format!(
                    "value of {key:?} is {} bytes, at most {VALUE_BYTES_MAX}",
                    value.len()
                )));
            }
            bytes += value.len();
        }
    }
    if bytes > TXN_BYTES_MAX {
        return Err(StoreError::InvalidTxn(format!(
            "transaction writes {bytes} bytes, at most {TXN_BYTES_MAX}"
        )));
    }
    Ok(())
}

fn validate_key(key: &str) -> Result<(), StoreError> {
    if !key.starts_with('/') || key.len() > KEY_BYTES_MAX {
        return Err(StoreError::InvalidTxn(format!(
            "key {key:?} must start with '/' and be at most {KEY_BYTES_MAX} bytes"
        )));
    }
    Ok(())
}

/// Evaluates conditions against current versions; returns the failed ones.
pub(crate) fn failed_conditions(
    conditions: &[Condition],
    mut version_of: impl FnMut(&str) -> Result<Option<Revision>, StoreError>,
) -> Result<Vec<FailedCondition>, StoreError> {
    let mut failed = Vec::new();
    for (index, condition) in conditions.iter().enumerate() {
        let actual = version_of(condition.key())?;
        if !condition.holds(actual) {
            failed.push(FailedCondition {
                index,
                condition: condition.clone(),
                actual,
            });
        }
    }
    Ok(failed)
}

/// Checks a `changes_since` request against the retained history window
/// `(compacted, current]`.
pub(crate) fn check_history(
    requested: Revision,
    compacted: Revision,
    current: Revision,
) -> Result<(), StoreError> {
    if requested > current {
        return Err(StoreError::FutureRevision { requested, current });
    }
    if requested < compacted {
        return Err(StoreError::Compacted {
            requested,
            compacted,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn txn_limits() {
        let put = |k: &str, n: usize| Op::Put(k.into(), vec![0; n]);
        assert!(validate_txn(&[], &[put("/a", 10), Op::Delete("/b".into())]).is_ok());
        assert!(validate_txn(&[], &[put("/a", 1), Op::Delete("/a".into())]).is_err());
        assert!(validate_txn(&[], &[put("", 1)]).is_err());
        assert!(validate_txn(&[], &[put("a", 1)]).is_err(), "keys are paths");
        assert!(validate_txn(&[Condition::Missing("a".into())], &[]).is_err());
        assert!(validate_txn(&[], &[put(&"k".repeat(KEY_BYTES_MAX + 1), 1)]).is_err());
        assert!(validate_txn(&[], &[put("/a", VALUE_BYTES_MAX + 1)]).is_err());
        assert!(validate_txn(
            &[],
            &[put("/a", VALUE_BYTES_MAX), put("/b", VALUE_BYTES_MAX)]
        )
        .is_err());
        let many: Vec<Op> = (0..=TXN_OPS_MAX)
            .map(|i| put(&format!("/{i}"), 0))
            .collect();
        assert!(validate_txn(&[], &many).is_err());
        let conds: Vec<Condition> = (0..=TXN_CONDITIONS_MAX)
            .map(|i| Condition::Missing(format!("/{i}")))
            .collect();
        assert!(validate_txn(&conds, &[]).is_err());
    }

    #[test]
    fn history_window() {
        assert!(check_history(5, 5, 9).is_ok());
        assert!(check_history(9, 5, 9).is_ok());
        assert!(matches!(
            check_history(4, 5, 9),
            Err(StoreError::Compacted { .. })
        ));
        assert!(matches!(
            check_history(10, 5, 9),
            Err(StoreError::FutureRevision { .. })
        ));
        let l = HistoryLimits {
            revisions: 3,
            bytes: 100,
        };
        assert!(!l.exceeded(3, 100));
        assert!(l.exceeded(4, 0));
        assert!(l.exceeded(2, 101));
        assert!(!l.exceeded(1, 1_000), "the newest revision is always kept");
    }
}
