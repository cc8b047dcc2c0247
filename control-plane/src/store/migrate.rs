//! Copying a whole store into another (`nvpool-control migrate`), e.g. from
//! the embedded redb file into etcd when a cluster moves to several control
//! planes.
//!
//! The source is read from one snapshot (`list("")`) and must not change
//! meanwhile (a redb source is locked by this process, so no control plane
//! can be running on it). The destination must be empty. Keys are written in
//! transactions within the store limits, each conditioned on its keys being
//! missing, so a writer that appears in the destination during the copy
//! stops it instead of being overwritten. Afterwards the destination is
//! read back and compared key by key, value by value.
//!
//! Versions are not copied: the destination gives every key its own (the
//! revision of the copy). The layers above use versions only as
//! compare-and-swap tokens read just before a write, and no stored value
//! holds a store revision, so the cluster state reads back the same.

use super::{Condition, KeyValue, Op, Revision, Store, StoreError, TxnOutcome};
use crate::limits::{TXN_BYTES_MAX, TXN_CONDITIONS_MAX, TXN_OPS_MAX};

/// What a copy did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copied {
    pub keys: usize,
    /// Keys and values, in bytes.
    pub bytes: u64,
    pub transactions: usize,
    /// The source's revision the copy was read at.
    pub source_revision: Revision,
}

/// Why a copy stopped.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error(
        "the destination already holds {keys} keys (the first is {first}); migrate only into \
         an empty store"
    )]
    NotEmpty { keys: usize, first: String },
    #[error(
        "the destination changed during the copy ({key} appeared); is a control plane using it? \
         It now holds a partial copy"
    )]
    DestinationChanged { key: String },
    #[error(
        "the source changed during the copy (revision {before}, now {after}); is a control \
         plane using it?"
    )]
    SourceChanged { before: Revision, after: Revision },
    #[error("the copy does not read back the same: {0}")]
    Mismatch(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Copies every key of `from` into the empty store `to` and checks the
/// result. On an error after the first transaction the destination holds
/// a partial copy: empty it before trying again.
pub fn copy_all(from: &dyn Store, to: &dyn Store) -> Result<Copied, MigrateError> {
    let existing = to.list("")?;
    if let Some(first) = existing.entries.first() {
        return Err(MigrateError::NotEmpty {
            keys: existing.entries.len(),
            first: first.key.clone(),
        });
    }
    let source = from.list("")?;
    let mut copied = Copied {
        keys: 0,
        bytes: 0,
        transactions: 0,
        source_revision: source.revision,
    };
    for batch in batches(&source.entries) {
        let conditions: Vec<Condition> = batch
            .iter()
            .map(|kv| Condition::Missing(kv.key.clone()))
            .collect();
        let ops: Vec<Op> = batch
            .iter()
            .map(|kv| Op::Put(kv.key.clone(), kv.value.clone()))
            .collect();
        match to.txn(&conditions, &ops)? {
            TxnOutcome::Committed { .. } => {}
            TxnOutcome::Conflict(failed) => {
                return Err(MigrateError::DestinationChanged {
                    key: failed[0].condition.key().to_owned(),
                })
            }
        }
        copied.transactions += 1;
        copied.keys += batch.len();
        copied.bytes += batch.iter().map(entry_bytes).sum::<u64>();
    }
    let after = from.revision()?;
    if after != source.revision {
        return Err(MigrateError::SourceChanged {
            before: source.revision,
            after,
        });
    }
    verify(&source.entries, &to.list("")?.entries)?;
    Ok(copied)
}

fn entry_bytes(kv: &KeyValue) -> u64 {
    (kv.key.len() + kv.value.len()) as u64
}

/// Splits entries into runs that each fit one transaction.
fn batches(entries: &[KeyValue]) -> Vec<&[KeyValue]> {
    let per_txn = TXN_OPS_MAX.min(TXN_CONDITIONS_MAX);
    let mut out = Vec::new();
    let mut start = 0;
    let mut bytes = 0usize;
    for (i, kv) in entries.iter().enumerate() {
        let size = kv.key.len() + kv.value.len();
        if i > start && (i - start == per_txn || bytes + size > TXN_BYTES_MAX) {
            out.push(&entries[start..i]);
            start = i;
            bytes = 0;
        }
        bytes += size;
    }
    if start < entries.len() {
        out.push(&entries[start..]);
    }
    out
}

fn verify(source: &[KeyValue], copy: &[KeyValue]) -> Result<(), MigrateError> {
    if source.len() != copy.len() {
        return Err(MigrateError::Mismatch(format!(
            "{} keys copied, {} read back",
            source.len(),
            copy.len()
        )));
    }
    for (s, c) in source.iter().zip(copy) {
        if s.key != c.key {
            return Err(MigrateError::Mismatch(format!(
                "key {} read back as {}",
                s.key, c.key
            )));
        }
        if s.value != c.value {
            return Err(MigrateError::Mismatch(format!(
                "the value of {} differs",
                s.key
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::VALUE_BYTES_MAX;
    use crate::store::MemStore;

    fn put_all(store: &dyn Store, kvs: &[(String, Vec<u8>)]) {
        for (k, v) in kvs {
            let out = store.txn(&[], &[Op::Put(k.clone(), v.clone())]).unwrap();
            assert!(matches!(out, TxnOutcome::Committed { .. }));
        }
    }

    #[test]
    fn copies_everything_in_batches_and_refuses_a_full_destination() {
        let from = MemStore::new();
        let mut kvs: Vec<(String, Vec<u8>)> = (0..300)
            .map(|i| (format!("/k/{i:04}"), vec![i as u8; i % 7]))
            .collect();
        // Two values too large to share a transaction.
        kvs.push(("/big/1".into(), vec![1; VALUE_BYTES_MAX]));
        kvs.push(("/big/2".into(), vec![2; VALUE_BYTES_MAX]));
        put_all(&from, &kvs);
        let to = MemStore::new();
        let copied = copy_all(&from, &to).unwrap();
        assert_eq!(copied.keys, kvs.len());
        assert_eq!(copied.source_revision, from.revision().unwrap());
        assert_eq!(
            copied.bytes,
            kvs.iter()
                .map(|(k, v)| (k.len() + v.len()) as u64)
                .sum::<u64>()
        );
        assert_eq!(
            copied.transactions, 4,
            "the large values apart, then runs of 128 keys"
        );
        let a = from.list("").unwrap().entries;
        let b = to.list("").unwrap().entries;
        assert_eq!(a.len(), b.len());
        assert!(a
            .iter()
            .zip(&b)
            .all(|(x, y)| x.key == y.key && x.value == y.value));

        let again = copy_all(&from, &to).unwrap_err();
        assert!(
            matches!(again, MigrateError::NotEmpty { keys, .. } if keys == kvs.len()),
            "{again}"
        );
        assert!(matches!(
            copy_all(&MemStore::new(), &MemStore::new()),
            Ok(Copied { keys: 0, .. })
        ));
    }

    #[test]
    fn batches_respect_the_limits() {
        let kv = |n: usize| KeyValue {
            key: format!("/{n}"),
            value: vec![0; n],
            version: 1,
        };
        let entries: Vec<KeyValue> = [10, VALUE_BYTES_MAX, VALUE_BYTES_MAX, 5]
            .into_iter()
            .map(kv)
            .collect();
        let b = batches(&entries);
        assert_eq!(b.iter().map(|b| b.len()).collect::<Vec<_>>(), [2, 2]);
        assert!(batches(&[]).is_empty());
    }
}
