//! Read-only dataset volumes (design/thin-snapshots.md T8): a volume any
//! number of hosts attach at once and none can write, the form training
//! data takes (one dataset, many GPU hosts).
//!
//! A volume is read-only when its mark exists; the mark is written before
//! the volume (a create puts or removes it while no volume of that UUID
//! exists) and goes with the volume's delete, so it never changes while
//! the volume exists and is read without a transaction. A record of its
//! own, like `/write-epochs/{uuid}`, so the volume's value format stays.
//!
//! | key | value |
//! |---|---|
//! | `/read-only/{uuid}` | [`ReadOnlyMark`]: the volume is read-only |
//!
//! What it changes: every namespace exporting the volume's extents to a
//! host is put write-protected (a target answers a write with Namespace
//! Is Write Protected and reports it in Identify Namespace, so a Linux host
//! marks the device read-only), attachments say so
//! (`AttachmentOut::read_only`: the engine opens it without a writer's
//! duties and the host presents a read-only device), and it cannot be
//! served by targets (they would present a writable namespace). Any number
//! of hosts may attach it: attach never excluded other hosts.

use crate::model::{decode, encode, Uuid};
use crate::state::{keys, Cluster, StateError, Txn};
use crate::store::{Condition, Op};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;

/// Store key prefix of read-only marks.
pub const READ_ONLY: &str = "/read-only/";

pub fn read_only_key(volume: &Uuid) -> String {
    format!("{READ_ONLY}{volume}")
}

/// The volume is read-only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadOnlyMark {
    pub volume: Uuid,
}

impl crate::model::Stored for ReadOnlyMark {}

impl Cluster {
    /// Whether `volume` is read-only (whether or not it exists).
    pub fn is_read_only(&self, volume: &Uuid) -> Result<bool, StateError> {
        Ok(self.store().get(&read_only_key(volume))?.is_some())
    }

    /// Every volume marked read-only.
    pub fn read_only_volumes(&self) -> Result<BTreeSet<Uuid>, StateError> {
        self.store()
            .list(READ_ONLY)?
            .entries
            .into_iter()
            .map(|kv| Ok(decode::<ReadOnlyMark>("read-only mark", &kv.value)?.volume))
            .collect()
    }

    /// Before a create of `volume`: marks it read-only, or takes a mark
    /// left by an earlier volume of that UUID away, while no volume of
    /// that UUID exists. When one exists (a repeated create) its mark must
    /// agree with `read_only`, else `uuid_conflict`.
    pub fn prepare_read_only(&self, volume: &Uuid, read_only: bool) -> Result<(), StateError> {
        let key = read_only_key(volume);
        self.transact(|s| {
            let marked = self.store().get(&key)?.is_some();
            if s.volumes.contains_key(volume) {
                if marked != read_only {
                    return Err(mismatch(volume, marked));
                }
                return Ok(Txn::Done(()));
            }
            let op = if read_only {
                Op::Put(key.clone(), encode(&ReadOnlyMark { volume: *volume }))
            } else if marked {
                Op::Delete(key.clone())
            } else {
                return Ok(Txn::Done(()));
            };
            Ok(Txn::Commit(
                vec![Condition::Missing(keys::volume(volume))],
                vec![op],
                (),
            ))
        })
    }

    /// After a create: the volume's mark agrees with `read_only` (a
    /// concurrent create of the same UUID asking otherwise may have
    /// changed the mark first), else `uuid_conflict`.
    pub fn check_read_only(&self, volume: &Uuid, read_only: bool) -> Result<(), StateError> {
        let marked = self.is_read_only(volume)?;
        if marked != read_only {
            return Err(mismatch(volume, marked));
        }
        Ok(())
    }
}

fn mismatch(volume: &Uuid, marked: bool) -> StateError {
    let (is, not) = if marked {
        ("read-only", "")
    } else {
        ("writable", "not ")
    };
    StateError::Conflict {
        kind: "uuid_conflict",
        message: format!("volume {volume} exists and is {is}: it was {not}created read-only"),
    }
}
