//! What grain pools really hold, and what the control plane says when
//! space runs short (design/thin-snapshots.md T4).
//!
//! A grain pool's extents are trees that take space only when written, so
//! the bytes placed on it (its *provisioned* bytes) say nothing of what it
//! holds. Its target measures that and reports it with every heartbeat;
//! the report is kept under `/target-usage/{id}` ([`TargetUsage`]), written
//! in the heartbeat's transaction, so every control plane on one store
//! (C21) reads the same numbers whichever one the target reached.
//!
//! After a heartbeat the control plane compares each pool's (and the
//! unpooled devices') real use with its real capacity: crossing
//! [`THRESHOLDS_PERCENT`] upwards logs a warning and records an
//! [`Event`], once per crossing; falling back below re-arms it. Both the
//! crossing levels and the events are this process's memory (several
//! control planes each raise their own), as the log lines are.

use crate::limits::{DEVICES_PER_TARGET_MAX, DEVICE_BYTES_MAX};
use crate::model::{validate_id, Device, ModelError, Target};
use crate::rest::HeartbeatBody;
use crate::state::{Capacity, CapacityReport};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, PoisonError};

/// Store keys of the targets' usage reports.
pub const TARGET_USAGE: &str = "/target-usage/";

pub fn key(target: &str) -> String {
    format!("{TARGET_USAGE}{target}")
}

/// The grain pools' usage a target last reported.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetUsage {
    pub target: String,
    /// Device id → allocated bytes, for the target's grain pools only.
    pub devices: BTreeMap<String, u64>,
}

impl crate::model::Stored for TargetUsage {}

/// Refuses a report that names one device twice (which would it be?),
/// more devices than a target may have, or more bytes used than any
/// device may hold.
pub fn validate_report(report: &HeartbeatBody) -> Result<(), ModelError> {
    if report.devices.len() > DEVICES_PER_TARGET_MAX {
        return Err(ModelError::Invalid(format!(
            "{} devices reported, at most {DEVICES_PER_TARGET_MAX}",
            report.devices.len()
        )));
    }
    let mut seen = std::collections::BTreeSet::new();
    for d in &report.devices {
        validate_id("device id", &d.id, crate::limits::ID_BYTES_MAX)?;
        if d.used_bytes > DEVICE_BYTES_MAX {
            return Err(ModelError::Invalid(format!(
                "device {}: {} bytes used, at most {DEVICE_BYTES_MAX} (256 TiB)",
                d.id, d.used_bytes
            )));
        }
        if !seen.insert(d.id.as_str()) {
            return Err(ModelError::Invalid(format!(
                "device {} reported twice",
                d.id
            )));
        }
    }
    Ok(())
}

impl TargetUsage {
    /// `held` updated with `report`: a device the report leaves out keeps
    /// its last value; a device `target` does not have (the report crossed
    /// a re-registration) or that is no grain pool (its use is its placed
    /// extents) is ignored, and dropped from what was held.
    pub fn merged(held: Option<&TargetUsage>, target: &Target, report: &HeartbeatBody) -> Self {
        let mut devices = held.map(|h| h.devices.clone()).unwrap_or_default();
        for d in &report.devices {
            devices.insert(d.id.clone(), d.used_bytes);
        }
        devices.retain(|id, _| target.device(id).is_some_and(Device::is_grain_pool));
        TargetUsage {
            target: target.id.clone(),
            devices,
        }
    }
}

/// Real use, in percent of real capacity, at which the control plane
/// warns: a warning at the first, a critical event at the second.
pub const THRESHOLDS_PERCENT: [u8; 2] = [80, 90];

/// Events kept in memory: the oldest go first.
pub const EVENTS_MAX: usize = 256;

/// Something the control plane wants an operator to see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// Milliseconds since the Unix epoch (the cluster's clock).
    pub time_ms: u64,
    /// What happened, for machines: `capacity_warning` (80 %),
    /// `capacity_critical` (90 %).
    pub kind: &'static str,
    /// The same for people.
    pub message: String,
}

/// The last [`EVENTS_MAX`] events of this process, oldest first; any
/// subsystem holding the cluster may push one.
#[derive(Debug, Default)]
pub struct Events {
    list: Mutex<VecDeque<Event>>,
}

impl Events {
    pub fn push(&self, time_ms: u64, kind: &'static str, message: String) {
        // The lock guards a list whose every state is valid: a panic of a
        // previous holder leaves nothing to repair.
        let mut list = self.list.lock().unwrap_or_else(PoisonError::into_inner);
        if list.len() == EVENTS_MAX {
            list.pop_front();
        }
        list.push_back(Event {
            time_ms,
            kind,
            message,
        });
    }

    /// Every event held, oldest first.
    pub fn list(&self) -> Vec<Event> {
        let list = self.list.lock().unwrap_or_else(PoisonError::into_inner);
        list.iter().cloned().collect()
    }
}

/// The threshold each pool (`None`: the unpooled devices) was last seen
/// at or above (0: below every one).
#[derive(Debug, Default)]
pub struct Levels {
    seen: Mutex<BTreeMap<Option<String>, u8>>,
}

/// The highest threshold `c`'s real use reaches (0: none, or no capacity).
fn level(c: &Capacity) -> u8 {
    let used = u128::from(c.used_bytes) * 100;
    THRESHOLDS_PERCENT
        .into_iter()
        .filter(|&p| c.total_bytes > 0 && used >= u128::from(p) * u128::from(c.total_bytes))
        .max()
        .unwrap_or(0)
}

impl Levels {
    /// Compares `report` with the levels seen before: each threshold a pool
    /// crossed upwards is logged and pushed to `events` (once: the next
    /// check at the same level says nothing); a pool that fell below one
    /// can cross it again. Run after a heartbeat: the report is the one
    /// its answer is built from, so the check costs no store read.
    pub fn check(&self, report: &CapacityReport, events: &Events, now_ms: u64) {
        let scopes = report
            .pools
            .iter()
            .map(|(name, c)| (Some(name.clone()), c))
            .chain(std::iter::once((None, &report.unpooled)));
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let mut present = Vec::new();
        for (scope, c) in scopes {
            let now = level(c);
            let before = seen.insert(scope.clone(), now).unwrap_or(0);
            let name = scope.as_deref().map_or_else(
                || "the unpooled devices".to_owned(),
                |p| format!("pool {p}"),
            );
            for p in THRESHOLDS_PERCENT
                .into_iter()
                .filter(|&p| before < p && p <= now)
            {
                let kind = if p == THRESHOLDS_PERCENT[0] {
                    "capacity_warning"
                } else {
                    "capacity_critical"
                };
                let message = format!(
                    "{name}: {p} % of the real capacity is used ({} of {} bytes; {} provisioned)",
                    c.used_bytes, c.total_bytes, c.provisioned_bytes
                );
                tracing::warn!(
                    pool = scope.as_deref().unwrap_or("(unpooled)"),
                    used_bytes = c.used_bytes,
                    total_bytes = c.total_bytes,
                    provisioned_bytes = c.provisioned_bytes,
                    "{message}"
                );
                events.push(now_ms, kind, message);
            }
            if now < before {
                tracing::info!(
                    pool = scope.as_deref().unwrap_or("(unpooled)"),
                    used_bytes = c.used_bytes,
                    total_bytes = c.total_bytes,
                    "{name}: real use fell below {before} % of the capacity"
                );
            }
            present.push(scope);
        }
        // A deleted pool starts afresh if one of its name comes back.
        seen.retain(|scope, _| present.contains(scope));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(used: u64, total: u64) -> CapacityReport {
        let c = Capacity {
            total_bytes: total,
            used_bytes: used,
            free_bytes: total - used,
            free_extents: 0,
            provisioned_bytes: 4 * total,
        };
        CapacityReport {
            pools: BTreeMap::from([("fast".to_owned(), c)]),
            ..CapacityReport::default()
        }
    }

    #[test]
    fn each_crossing_is_raised_once() {
        let (levels, events) = (Levels::default(), Events::default());
        let kinds = |e: &Events| e.list().iter().map(|e| e.kind).collect::<Vec<_>>();
        levels.check(&report(79, 100), &events, 1);
        assert!(events.list().is_empty());
        levels.check(&report(80, 100), &events, 2);
        levels.check(&report(85, 100), &events, 3);
        assert_eq!(kinds(&events), ["capacity_warning"]);
        assert!(events.list()[0].message.contains("pool fast"));
        // Both at once when use jumps past both.
        levels.check(&report(10, 100), &events, 4);
        levels.check(&report(95, 100), &events, 5);
        assert_eq!(
            kinds(&events),
            ["capacity_warning", "capacity_warning", "capacity_critical"]
        );
        levels.check(&report(95, 100), &events, 6);
        assert_eq!(events.list().len(), 3);
        // An empty pool never warns.
        levels.check(&report(0, 0), &events, 7);
        assert_eq!(events.list().len(), 3);
    }

    #[test]
    fn the_list_is_bounded_oldest_out() {
        let events = Events::default();
        for i in 0..EVENTS_MAX as u64 + 3 {
            events.push(i, "capacity_warning", format!("{i}"));
        }
        let list = events.list();
        assert_eq!(list.len(), EVENTS_MAX);
        assert_eq!(
            (list[0].time_ms, list[EVENTS_MAX - 1].time_ms),
            (3, EVENTS_MAX as u64 + 2)
        );
    }
}
