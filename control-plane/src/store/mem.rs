//! An in-memory [`Store`] for tests and simulations: the same semantics and
//! limits as the redb store, nothing durable.

use super::{
    check_history, failed_conditions, validate_txn, Change, Condition, HistoryLimits, KeyValue,
    Listing, Op, Revision, Store, StoreError, TxnOutcome,
};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, MutexGuard};

/// The whole store behind one mutex: transactions are serialised, reads see
/// a consistent state.
#[derive(Debug, Default)]
pub struct MemStore {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// key → (version, value)
    kv: BTreeMap<String, (Revision, Vec<u8>)>,
    revision: Revision,
    /// Highest revision no longer in `log` (0: nothing trimmed yet).
    compacted: Revision,
    /// One entry per revision in `(compacted, revision]`, oldest first.
    log: VecDeque<(Vec<Change>, u64)>,
    log_bytes: u64,
    limits: HistoryLimits,
}

impl MemStore {
    pub fn new() -> Self {
        Self::with_history(HistoryLimits::default())
    }

    /// A store that keeps at most `limits` of change history.
    pub fn with_history(limits: HistoryLimits) -> Self {
        MemStore {
            inner: Mutex::new(Inner {
                limits,
                ..Inner::default()
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Nothing in this file panics while holding the lock; a poisoned lock
        // means a bug, and a half-applied transaction must not be read.
        self.inner.lock().expect("MemStore lock poisoned")
    }
}

impl Store for MemStore {
    fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        Ok(self.lock().kv.get(key).map(|(version, value)| KeyValue {
            key: key.to_owned(),
            value: value.clone(),
            version: *version,
        }))
    }

    fn list(&self, prefix: &str) -> Result<Listing, StoreError> {
        let inner = self.lock();
        let entries = inner
            .kv
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, (version, value))| KeyValue {
                key: k.clone(),
                value: value.clone(),
                version: *version,
            })
            .collect();
        Ok(Listing {
            revision: inner.revision,
            entries,
        })
    }

    fn txn(&self, conditions: &[Condition], ops: &[Op]) -> Result<TxnOutcome, StoreError> {
        validate_txn(conditions, ops)?;
        let mut inner = self.lock();
        let failed = failed_conditions(conditions, |k| Ok(inner.kv.get(k).map(|(v, _)| *v)))?;
        if !failed.is_empty() {
            return Ok(TxnOutcome::Conflict(failed));
        }
        let revision = inner.revision + 1;
        let mut changes = Vec::new();
        for op in ops {
            match op {
                Op::Put(key, value) => {
                    inner.kv.insert(key.clone(), (revision, value.clone()));
                    changes.push(Change {
                        revision,
                        key: key.clone(),
                        value: Some(value.clone()),
                    });
                }
                Op::Delete(key) => {
                    if inner.kv.remove(key).is_some() {
                        changes.push(Change {
                            revision,
                            key: key.clone(),
                            value: None,
                        });
                    }
                }
            }
        }
        if changes.is_empty() {
            return Ok(TxnOutcome::Committed {
                revision: inner.revision,
            });
        }
        let bytes: u64 = changes.iter().map(Change::history_bytes).sum();
        inner.revision = revision;
        inner.log.push_back((changes, bytes));
        inner.log_bytes += bytes;
        while inner
            .limits
            .exceeded(inner.revision - inner.compacted, inner.log_bytes)
        {
            let (_, bytes) = inner
                .log
                .pop_front()
                .expect("log holds every kept revision");
            inner.log_bytes -= bytes;
            inner.compacted += 1;
        }
        Ok(TxnOutcome::Committed { revision })
    }

    fn revision(&self) -> Result<Revision, StoreError> {
        Ok(self.lock().revision)
    }

    fn changes_since(&self, revision: Revision) -> Result<Vec<Change>, StoreError> {
        let inner = self.lock();
        check_history(revision, inner.compacted, inner.revision)?;
        let skip = (revision - inner.compacted) as usize;
        Ok(inner
            .log
            .iter()
            .skip(skip)
            .flat_map(|(changes, _)| changes.iter().cloned())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::conformance::{self, Revisions};

    #[test]
    fn conformance_suite() {
        conformance::run(&MemStore::new(), Revisions::Private);
    }

    #[test]
    fn history_suite() {
        let limits = conformance::SMALL_HISTORY;
        conformance::history(&MemStore::with_history(limits), Revisions::Private);
    }

    #[test]
    fn concurrent_compare_and_swap() {
        conformance::concurrent_increments(&MemStore::new(), Revisions::Private, 4, 50);
    }
}
