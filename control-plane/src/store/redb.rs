//! The embedded [`Store`]: one redb file under the control plane's state
//! directory.
//!
//! redb gives us atomic, durable write transactions (copy-on-write B-trees
//! and a checksummed commit slot: after a crash at any point the file opens
//! at the last committed transaction) and snapshot reads. On top we keep
//! etcd's model in three tables:
//!
//! | table | key | value |
//! |---|---|---|
//! | `kv` | the key (UTF-8) | version (u64 little-endian) ‖ value bytes |
//! | `meta` | `format`, `revision`, `compacted`, `log_bytes` | u64 |
//! | `log` | revision (u64) | the changes of that revision, encoded below |
//!
//! A `log` entry: a format byte (1), then per change in op order a kind byte
//! (0 put, 1 delete), the key length (u32 LE) and key, and for a put the
//! value length (u32 LE) and value. `log` holds exactly the revisions
//! `compacted + 1 ..= revision`; `log_bytes` is the sum of their keys' and
//! values' lengths ([`Change::history_bytes`]), which is what the history
//! limits bound.
//!
//! Every `txn` evaluates its conditions, applies its ops, appends to the
//! log and trims it inside one redb write transaction committed with
//! `Durability::Immediate` (fsync before `txn` returns): a transaction is
//! either wholly on disk when the caller hears "committed", or absent after
//! a crash. redb serialises write transactions, which is what makes the
//! condition check and the writes one atomic compare-and-swap. After a
//! failed commit redb refuses further writes (its `PreviousIo` error) until
//! the store is reopened, so an unknown on-disk state is never built upon.
//! The file is locked: one process opens it at a time.

use super::{
    check_history, failed_conditions, validate_txn, Change, Condition, HistoryLimits, KeyValue,
    Listing, Op, Revision, Store, StoreError, TxnOutcome,
};
use ::redb::{Database, Durability, ReadableTable, TableDefinition};
use std::path::{Path, PathBuf};

/// The store's file name inside the state directory.
pub const STORE_FILE: &str = "control.redb";

/// On-disk format of the tables above; bumped on any incompatible change.
const FORMAT: u64 = 1;
/// Format byte in front of every `log` entry.
const LOG_ENTRY_FORMAT: u8 = 1;

const KV: TableDefinition<&str, &[u8]> = TableDefinition::new("kv");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");

const META_FORMAT: &str = "format";
const META_REVISION: &str = "revision";
const META_COMPACTED: &str = "compacted";
const META_LOG_BYTES: &str = "log_bytes";

/// A [`Store`] in one redb file.
#[derive(Debug)]
pub struct RedbStore {
    db: Database,
    path: PathBuf,
    limits: HistoryLimits,
}

fn backend<E: Into<::redb::Error>>(op: &'static str) -> impl FnOnce(E) -> StoreError {
    move |e| StoreError::Backend {
        op,
        source: Box::new(e.into()),
    }
}

/// Creates `path` mode 0600 if it is missing (whatever the umask), and
/// narrows an existing file readable by others to 0600: the store holds
/// secrets.
fn private_file(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)?;
    let mode = f.metadata()?.permissions().mode();
    if mode & 0o077 != 0 {
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        tracing::warn!(path = %path.display(), was = format!("{:o}", mode & 0o777),
            "store file was readable by others; now 0600");
    }
    Ok(())
}

impl RedbStore {
    /// Opens (creating if needed) `dir/control.redb`, creating `dir` too.
    /// The store holds targets' admin tokens and hosts' DH-HMAC-CHAP
    /// secrets, so `dir` is made (or narrowed to) 0700, whatever the umask.
    pub fn open_in_dir(dir: &Path) -> Result<RedbStore, StoreError> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let io = |op: &'static str| {
            move |e: std::io::Error| StoreError::Backend {
                op,
                source: Box::new(e),
            }
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io("create state directory"))?;
        let mode = std::fs::metadata(dir)
            .map_err(io("stat state directory"))?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                .map_err(io("restrict state directory"))?;
            tracing::warn!(dir = %dir.display(), was = format!("{:o}", mode & 0o777),
                "state directory was readable by others; now 0700");
        }
        Self::open(&dir.join(STORE_FILE))
    }

    /// Opens (creating if needed) the store file at `path`, keeping the
    /// default history. A file left by a crash is repaired on open.
    pub fn open(path: &Path) -> Result<RedbStore, StoreError> {
        Self::open_with_history(path, HistoryLimits::default())
    }

    /// Opens with explicit history limits (tests use small ones).
    pub fn open_with_history(path: &Path, limits: HistoryLimits) -> Result<RedbStore, StoreError> {
        private_file(path).map_err(|e| StoreError::Backend {
            op: "create store file",
            source: Box::new(e),
        })?;
        let db = Database::create(path).map_err(|e| match e {
            ::redb::DatabaseError::DatabaseAlreadyOpen => {
                StoreError::InUse(path.display().to_string())
            }
            e => backend("open")(e),
        })?;
        let store = RedbStore {
            db,
            path: path.to_owned(),
            limits,
        };
        store.init()?;
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creates the tables of a new file, checks the format of an old one.
    fn init(&self) -> Result<(), StoreError> {
        let mut w = self.db.begin_write().map_err(backend("begin init"))?;
        w.set_durability(Durability::Immediate);
        {
            w.open_table(KV).map_err(backend("open kv"))?;
            w.open_table(LOG).map_err(backend("open log"))?;
            let mut meta = w.open_table(META).map_err(backend("open meta"))?;
            let format = meta.get(META_FORMAT).map_err(backend("read format"))?;
            match format.map(|g| g.value()) {
                Some(FORMAT) => {}
                Some(other) => {
                    return Err(StoreError::Corrupt(format!(
                        "{} has store format {other}; this build reads format {FORMAT}",
                        self.path.display()
                    )))
                }
                None => {
                    meta.insert(META_FORMAT, FORMAT)
                        .map_err(backend("write format"))?;
                    for k in [META_REVISION, META_COMPACTED, META_LOG_BYTES] {
                        meta.insert(k, 0).map_err(backend("write meta"))?;
                    }
                }
            }
        }
        w.commit().map_err(backend("commit init"))
    }
}

fn meta_get<T: ReadableTable<&'static str, u64>>(
    meta: &T,
    key: &'static str,
) -> Result<u64, StoreError> {
    meta.get(key)
        .map_err(backend("read meta"))?
        .map(|g| g.value())
        .ok_or_else(|| StoreError::Corrupt(format!("meta key {key} is missing")))
}

fn decode_kv(key: &str, raw: &[u8]) -> Result<KeyValue, StoreError> {
    if raw.len() < 8 {
        return Err(StoreError::Corrupt(format!(
            "value of {key:?} is {} bytes, shorter than its version",
            raw.len()
        )));
    }
    let (version, value) = raw.split_at(8);
    Ok(KeyValue {
        key: key.to_owned(),
        value: value.to_vec(),
        version: u64::from_le_bytes(version.try_into().expect("8 bytes")),
    })
}

fn encode_kv(version: Revision, value: &[u8]) -> Vec<u8> {
    let mut raw = Vec::with_capacity(8 + value.len());
    raw.extend_from_slice(&version.to_le_bytes());
    raw.extend_from_slice(value);
    raw
}

fn encode_log_entry(changes: &[Change]) -> Vec<u8> {
    let mut out = vec![LOG_ENTRY_FORMAT];
    for c in changes {
        out.push(u8::from(c.value.is_none()));
        out.extend_from_slice(&(c.key.len() as u32).to_le_bytes());
        out.extend_from_slice(c.key.as_bytes());
        if let Some(v) = &c.value {
            out.extend_from_slice(&(v.len() as u32).to_le_bytes());
            out.extend_from_slice(v);
        }
    }
    out
}

fn decode_log_entry(revision: Revision, raw: &[u8]) -> Result<Vec<Change>, StoreError> {
    let corrupt = |what: &str| StoreError::Corrupt(format!("log entry {revision}: {what}"));
    let (&format, mut rest) = raw.split_first().ok_or_else(|| corrupt("empty"))?;
    if format != LOG_ENTRY_FORMAT {
        return Err(corrupt("unknown format"));
    }
    fn take<'a>(rest: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        if rest.len() < n {
            return None;
        }
        let (head, tail) = rest.split_at(n);
        *rest = tail;
        Some(head)
    }
    fn take_len(rest: &mut &[u8]) -> Option<usize> {
        take(rest, 4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
    }
    let mut changes = Vec::new();
    while let Some(kind) = take(&mut rest, 1) {
        let key_len = take_len(&mut rest).ok_or_else(|| corrupt("truncated key length"))?;
        let key = take(&mut rest, key_len).ok_or_else(|| corrupt("truncated key"))?;
        let key = String::from_utf8(key.to_vec()).map_err(|_| corrupt("key is not UTF-8"))?;
        let value = match kind[0] {
            0 => {
                let len = take_len(&mut rest).ok_or_else(|| corrupt("truncated value length"))?;
                Some(
                    take(&mut rest, len)
                        .ok_or_else(|| corrupt("truncated value"))?
                        .to_vec(),
                )
            }
            1 => None,
            _ => return Err(corrupt("unknown change kind")),
        };
        changes.push(Change {
            revision,
            key,
            value,
        });
    }
    Ok(changes)
}

impl Store for RedbStore {
    fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        let r = self.db.begin_read().map_err(backend("begin read"))?;
        let kv = r.open_table(KV).map_err(backend("open kv"))?;
        let found = kv.get(key).map_err(backend("get"))?;
        found.map(|g| decode_kv(key, g.value())).transpose()
    }

    fn list(&self, prefix: &str) -> Result<Listing, StoreError> {
        let r = self.db.begin_read().map_err(backend("begin read"))?;
        let meta = r.open_table(META).map_err(backend("open meta"))?;
        let revision = meta_get(&meta, META_REVISION)?;
        let kv = r.open_table(KV).map_err(backend("open kv"))?;
        let mut entries = Vec::new();
        for item in kv.range(prefix..).map_err(backend("list"))? {
            let (k, v) = item.map_err(backend("list"))?;
            let key = k.value();
            if !key.starts_with(prefix) {
                break;
            }
            entries.push(decode_kv(key, v.value())?);
        }
        Ok(Listing { revision, entries })
    }

    fn txn(&self, conditions: &[Condition], ops: &[Op]) -> Result<TxnOutcome, StoreError> {
        validate_txn(conditions, ops)?;
        let mut w = self.db.begin_write().map_err(backend("begin write"))?;
        w.set_durability(Durability::Immediate);
        let (outcome, changed) = {
            let mut kv = w.open_table(KV).map_err(backend("open kv"))?;
            let mut meta = w.open_table(META).map_err(backend("open meta"))?;
            let mut log = w.open_table(LOG).map_err(backend("open log"))?;
            let failed = failed_conditions(conditions, |k| {
                let raw = kv.get(k).map_err(backend("get"))?;
                raw.map(|g| decode_kv(k, g.value()).map(|kv| kv.version))
                    .transpose()
            })?;
            if !failed.is_empty() {
                (TxnOutcome::Conflict(failed), false)
            } else {
                let current = meta_get(&meta, META_REVISION)?;
                let revision = current + 1;
                let mut changes = Vec::new();
                for op in ops {
                    match op {
                        Op::Put(key, value) => {
                            kv.insert(key.as_str(), encode_kv(revision, value).as_slice())
                                .map_err(backend("put"))?;
                            changes.push(Change {
                                revision,
                                key: key.clone(),
                                value: Some(value.clone()),
                            });
                        }
                        Op::Delete(key) => {
                            if kv
                                .remove(key.as_str())
                                .map_err(backend("delete"))?
                                .is_some()
                            {
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
                    (TxnOutcome::Committed { revision: current }, false)
                } else {
                    let bytes: u64 = changes.iter().map(Change::history_bytes).sum();
                    log.insert(revision, encode_log_entry(&changes).as_slice())
                        .map_err(backend("append log"))?;
                    let mut compacted = meta_get(&meta, META_COMPACTED)?;
                    let mut log_bytes = meta_get(&meta, META_LOG_BYTES)? + bytes;
                    while self.limits.exceeded(revision - compacted, log_bytes) {
                        let (rev, raw) = log
                            .pop_first()
                            .map_err(backend("trim log"))?
                            .ok_or_else(|| StoreError::Corrupt("log shorter than meta".into()))?;
                        let (rev, raw) = (rev.value(), raw.value());
                        if rev != compacted + 1 {
                            return Err(StoreError::Corrupt(format!(
                                "log starts at revision {rev}, expected {}",
                                compacted + 1
                            )));
                        }
                        let dropped: u64 = decode_log_entry(rev, raw)?
                            .iter()
                            .map(Change::history_bytes)
                            .sum();
                        log_bytes -= dropped;
                        compacted = rev;
                    }
                    meta.insert(META_REVISION, revision)
                        .map_err(backend("write meta"))?;
                    meta.insert(META_COMPACTED, compacted)
                        .map_err(backend("write meta"))?;
                    meta.insert(META_LOG_BYTES, log_bytes)
                        .map_err(backend("write meta"))?;
                    (TxnOutcome::Committed { revision }, true)
                }
            }
        };
        if changed {
            w.commit().map_err(backend("commit"))?;
        } else {
            w.abort().map_err(backend("abort"))?;
        }
        Ok(outcome)
    }

    fn revision(&self) -> Result<Revision, StoreError> {
        let r = self.db.begin_read().map_err(backend("begin read"))?;
        let meta = r.open_table(META).map_err(backend("open meta"))?;
        meta_get(&meta, META_REVISION)
    }

    fn changes_since(&self, revision: Revision) -> Result<Vec<Change>, StoreError> {
        let r = self.db.begin_read().map_err(backend("begin read"))?;
        let meta = r.open_table(META).map_err(backend("open meta"))?;
        let current = meta_get(&meta, META_REVISION)?;
        let compacted = meta_get(&meta, META_COMPACTED)?;
        check_history(revision, compacted, current)?;
        let log = r.open_table(LOG).map_err(backend("open log"))?;
        let mut out = Vec::new();
        for item in log.range(revision + 1..).map_err(backend("read log"))? {
            let (rev, raw) = item.map_err(backend("read log"))?;
            out.extend(decode_log_entry(rev.value(), raw.value())?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::conformance::{self, Revisions};

    #[test]
    fn conformance_suite() {
        let dir = tempfile::tempdir().unwrap();
        conformance::run(
            &RedbStore::open_in_dir(dir.path()).unwrap(),
            Revisions::Private,
        );
    }

    fn mode(p: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    /// The store holds secrets: a new state directory is 0700 and its file
    /// 0600 whatever the umask, and ones left readable by others (made by
    /// hand, or by a version before this) are narrowed when opened.
    #[test]
    fn the_store_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let top = tempfile::tempdir().unwrap();
        let fresh = top.path().join("a/state");
        drop(RedbStore::open_in_dir(&fresh).unwrap());
        assert_eq!(mode(&fresh), 0o700);
        assert_eq!(mode(&fresh.join(STORE_FILE)), 0o600);

        let old = top.path().join("old");
        std::fs::create_dir(&old).unwrap();
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).unwrap();
        drop(RedbStore::open_in_dir(&old).unwrap());
        std::fs::set_permissions(old.join(STORE_FILE), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).unwrap();
        let store = RedbStore::open_in_dir(&old).unwrap();
        assert_eq!(mode(&old), 0o700);
        assert_eq!(mode(&old.join(STORE_FILE)), 0o600);
        drop(store);
        let direct = top.path().join("direct.redb");
        drop(RedbStore::open(&direct).unwrap());
        assert_eq!(mode(&direct), 0o600);
    }

    #[test]
    fn history_suite() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(STORE_FILE);
        let limits = conformance::SMALL_HISTORY;
        conformance::history(
            &RedbStore::open_with_history(&path, limits).unwrap(),
            Revisions::Private,
        );
    }

    #[test]
    fn concurrent_compare_and_swap() {
        let dir = tempfile::tempdir().unwrap();
        conformance::concurrent_increments(
            &RedbStore::open_in_dir(dir.path()).unwrap(),
            Revisions::Private,
            3,
            20,
        );
    }

    #[test]
    fn reopen_keeps_data_revision_and_history() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(STORE_FILE);
        {
            let s = RedbStore::open(&path).unwrap();
            let out = s
                .txn(
                    &[Condition::Missing("/k".into())],
                    &[Op::Put("/k".into(), b"v".to_vec())],
                )
                .unwrap();
            assert_eq!(out, TxnOutcome::Committed { revision: 1 });
            let out = s.txn(&[], &[Op::Put("/j".into(), b"w".to_vec())]).unwrap();
            assert_eq!(out, TxnOutcome::Committed { revision: 2 });
            assert!(
                matches!(RedbStore::open(&path), Err(StoreError::InUse(_))),
                "a second open of the same file is refused"
            );
        }
        let s = RedbStore::open(&path).unwrap();
        assert_eq!(s.revision().unwrap(), 2);
        assert_eq!(s.get("/k").unwrap().unwrap().version, 1);
        assert_eq!(s.changes_since(0).unwrap().len(), 2);
        let out = s.txn(&[], &[Op::Delete("/k".into())]).unwrap();
        assert_eq!(out, TxnOutcome::Committed { revision: 3 });
    }

    #[test]
    fn log_entries_round_trip() {
        let changes = vec![
            Change {
                revision: 9,
                key: "/a".into(),
                value: Some(vec![1, 2, 3]),
            },
            Change {
                revision: 9,
                key: "/b".into(),
                value: None,
            },
            Change {
                revision: 9,
                key: "/c".into(),
                value: Some(vec![]),
            },
        ];
        let raw = encode_log_entry(&changes);
        assert_eq!(decode_log_entry(9, &raw).unwrap(), changes);
        for cut in 1..raw.len() {
            if let Ok(partial) = decode_log_entry(9, &raw[..cut]) {
                assert!(
                    partial.len() < changes.len(),
                    "a cut entry never decodes whole"
                );
            }
        }
        assert!(decode_log_entry(9, &[]).is_err());
        assert!(decode_log_entry(9, &[2]).is_err());
    }
}
