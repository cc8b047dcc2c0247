//! A workload that builds real cluster state without targets: targets
//! registered, volumes of every layout created, grown, attached, detached
//! (now and then forced, leaving stale exports) and deleted, copies
//! failed, moved and resynced through every job state. Used by the crash
//! test (which kills it) and by the etcd migration test (which copies what
//! it built). Each operation is reported on stdout as `@@ BEGIN op uuid`
//! before and `@@ OK op uuid` after.

use nvpool_control::limits::EXTENT_BYTES_MIN;
use nvpool_control::model::{Device, Layout, Uuid, VolumeSpec};
use nvpool_control::state::{Cluster, StateError, TargetRegistration};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

/// The extent size of the workload's clusters, and of its devices' capacity.
pub const E: u64 = EXTENT_BYTES_MIN;

/// Chooses the operations, from a seed.
pub use nvpool_rt::random::Rng;

/// Target `i`: two devices of 48 extents, in rack `r{i % 3}`.
pub fn registration(i: usize) -> TargetRegistration {
    TargetRegistration {
        id: format!("t{i}"),
        name: format!("host{i}"),
        addr: format!("127.0.0.1:{}", 4420 + i).parse().unwrap(),
        admin_addr: format!("127.0.0.1:{}", 5420 + i).parse().unwrap(),
        labels: [("rack".to_string(), format!("r{}", i % 3))].into(),
        devices: (0..2)
            .map(|d| Device {
                id: format!("d{d}"),
                backend: format!("ram:{}", 48 * E),
                capacity_bytes: 48 * E,
                labels: BTreeMap::new(),
            })
            .collect(),
        rdma_addr: None,
        admin_tls: false,
        admin_token: None,
    }
}

/// One random operation on `c`; `live` holds the volumes it may pick.
pub fn step(c: &Cluster, live: &Mutex<Vec<Uuid>>, rng: &mut Rng) {
    let roll = rng.below(100);
    let pick = {
        let mut l = live.lock().unwrap();
        if l.is_empty() || roll < 60 {
            None
        } else {
            // Take it out so the other thread does not operate on it too.
            let i = rng.below(l.len() as u64) as usize;
            Some(l.swap_remove(i))
        }
    };
    match pick {
        None => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&rng.next_u64().to_le_bytes());
            bytes[8..].copy_from_slice(&rng.next_u64().to_le_bytes());
            let uuid = Uuid(bytes);
            let layout = match rng.below(4) {
                0 => Layout::Concat,
                1 => Layout::Raid0 {
                    stripe_bytes: 65536,
                    width: 3,
                },
                2 => Layout::Raid1 { copies: 2 },
                _ => Layout::Raid10 {
                    stripe_bytes: 4096,
                    width: 2,
                    copies: 3,
                },
            };
            let spec = VolumeSpec {
                uuid,
                name: uuid.to_string(),
                size_bytes: (1 + rng.below(4 * 256)) * 4096,
                layout,
                pool: None,
            };
            println!("@@ BEGIN create {uuid}");
            match c.create_volume(&spec) {
                Ok(_) => {
                    println!("@@ OK create {uuid}");
                    live.lock().unwrap().push(uuid);
                }
                Err(StateError::Placement(_)) => println!("@@ FULL create {uuid}"),
                Err(e) => panic!("create: {e}"),
            }
        }
        Some(uuid) if roll < 75 => {
            // Detach every host first (a delete of an attached volume is
            // refused), now and then as a forced detach that leaves stale
            // exports behind on one target.
            for a in c.volume_attachments(&uuid).unwrap() {
                let host = a.host_nqn;
                println!("@@ BEGIN detach {uuid} {host}");
                let (a, by_target) = c.begin_detach(&uuid, &host).unwrap();
                let mut stale = BTreeMap::new();
                if rng.below(2) == 0 {
                    if let Some((t, xs)) = by_target.into_iter().next() {
                        stale.insert(t, xs);
                    }
                }
                c.finish_detach(&a.volume, &host, &stale).unwrap();
                println!("@@ OK detach {uuid} {host}");
            }
            println!("@@ BEGIN delete {uuid}");
            c.delete_volume(&uuid).unwrap();
            println!("@@ OK delete {uuid}");
            // Sometimes a target "reconciles": its stale exports go.
            if rng.below(3) == 0 {
                let t = format!("t{}", rng.below(6));
                if let Some((_, version)) = c.stale_exports(&t).unwrap() {
                    c.clear_stale_exports(&t, version).unwrap();
                }
            }
        }
        Some(uuid) if roll < 90 => {
            let host = format!("nqn.2014-08.org.nvmexpress:uuid:host-{}", rng.below(3));
            println!("@@ BEGIN attach {uuid} {host}");
            c.begin_attach(&uuid, &host).unwrap();
            c.finish_attach(&uuid, &host).unwrap();
            println!("@@ OK attach {uuid} {host}");
            live.lock().unwrap().push(uuid);
        }
        Some(uuid) if roll < 95 => {
            println!("@@ BEGIN resync {uuid}");
            resync_step(c, &uuid, rng);
            println!("@@ OK resync {uuid}");
            live.lock().unwrap().push(uuid);
        }
        Some(uuid) => {
            let size = c.volume(&uuid).unwrap().volume.size_bytes + (1 + rng.below(512)) * 4096;
            println!("@@ BEGIN grow {uuid} {size}");
            match c.resize_volume(&uuid, size) {
                Ok(_) => println!("@@ OK grow {uuid} {size}"),
                Err(StateError::Placement(_)) => println!("@@ FULL grow {uuid} {size}"),
                Err(e) => panic!("grow: {e}"),
            }
            live.lock().unwrap().push(uuid);
        }
    }
}

/// One step of a copy's life on a mirrored volume: a host reports a copy
/// failed, a job starts on it, moves through its states, and ends done or
/// failed (the heal loop's transitions, without targets).
pub fn resync_step(c: &Cluster, uuid: &Uuid, rng: &mut Rng) {
    let view = c.volume(uuid).unwrap();
    let copies = u32::from(view.volume.layout.copies());
    if copies < 2 {
        return;
    }
    let host = "nqn.2014-08.org.nvmexpress:uuid:host-0";
    if c.attachment(uuid, host).is_err() {
        println!("@@ BEGIN attach {uuid} {host}");
        c.begin_attach(uuid, host).unwrap();
        c.finish_attach(uuid, host).unwrap();
        println!("@@ OK attach {uuid} {host}");
    }
    let cs = c.copy_state(uuid).unwrap();
    match cs.jobs.first() {
        None if view.failed_extents.is_empty() && rng.below(2) == 0 => {
            let e = rng.below(u64::from(copies)) as u32;
            c.report_failed_extents(uuid, host, &[e]).unwrap();
        }
        None if view.failed_extents.is_empty() => {
            // Move a copy to a new extent (as a drain or a rebalance does).
            let e = rng.below(u64::from(copies)) as u32;
            let k = nvpool_control::resync::Candidate {
                volume: *uuid,
                extent: e,
                source: e,
                kind: nvpool_control::resync::CopyKind::Move,
                to: None,
            };
            match c.create_job(&k) {
                Ok(_) | Err(StateError::Placement(_)) => {}
                Err(e) => panic!("create a move: {e}"),
            }
        }
        None => {
            let mine: Vec<_> = c
                .resync_candidates(0)
                .unwrap()
                .into_iter()
                .filter(|k| k.volume == *uuid)
                .collect();
            if let Some(k) = mine.first() {
                c.create_job(k).unwrap();
            }
        }
        Some(j) => {
            use nvpool_control::resync::JobState;
            match j.state {
                JobState::Arming => {
                    c.job_mirroring(uuid, j.id).unwrap();
                }
                JobState::Mirroring => {
                    for a in c.volume_attachments(uuid).unwrap() {
                        c.confirm_sync(uuid, &a.host_nqn, j.id, 1, Some(&[0]))
                            .unwrap();
                    }
                    c.job_copying(uuid, j.id).unwrap();
                }
                JobState::Copying if j.dest.is_some() && rng.below(3) != 0 => {
                    c.job_switching(uuid, j.id).unwrap();
                }
                JobState::Copying => {
                    let error = (rng.below(3) == 0).then_some("copier failed");
                    c.finish_job(uuid, j.id, error).unwrap();
                }
                JobState::Switching => {
                    for a in c.volume_attachments(uuid).unwrap() {
                        c.confirm_sync(uuid, &a.host_nqn, j.id, 1, None).unwrap();
                    }
                    assert!(c.job_confirmed(uuid, j.id).unwrap());
                    c.finish_job(uuid, j.id, None).unwrap();
                }
            }
        }
    }
}

/// What a checker knows from a workload's reports (`@@ BEGIN op uuid …`
/// before an operation, `@@ OK op uuid …` after), across runs; what the
/// store must then hold.
#[derive(Default)]
pub struct Expect {
    pub started: BTreeSet<String>,
    pub created: BTreeSet<String>,
    pub delete_started: BTreeSet<String>,
    pub deleted: BTreeSet<String>,
    pub grown: BTreeMap<String, u64>,
    pub attach_started: BTreeSet<(String, String)>,
    pub ok_ops: usize,
    /// Runs that ended while an operation was under way.
    pub killed_in_flight: usize,
}

impl Expect {
    pub fn absorb(&mut self, output: &str) {
        let mut in_flight = BTreeSet::new();
        for line in output.lines() {
            // The test harness may print on the same line before ours.
            let Some(at) = line.find("@@ ") else {
                continue;
            };
            let words: Vec<&str> = line[at + 3..].split_whitespace().collect();
            if let [kind, op, u, ..] = words[..] {
                if kind == "BEGIN" {
                    in_flight.insert((op, u));
                } else {
                    in_flight.remove(&(op, u));
                }
            }
            match words[..] {
                ["BEGIN", "create", u] => {
                    self.started.insert(u.into());
                }
                ["OK", "create", u] => {
                    self.created.insert(u.into());
                    self.ok_ops += 1;
                }
                ["BEGIN", "delete", u] => {
                    self.delete_started.insert(u.into());
                }
                ["OK", "delete", u] => {
                    self.deleted.insert(u.into());
                    self.ok_ops += 1;
                }
                ["BEGIN", "attach", u, h] => {
                    self.attach_started.insert((u.into(), h.into()));
                }
                ["OK", "attach", ..] | ["OK", "detach", ..] => self.ok_ops += 1,
                ["OK", "grow", u, size] => {
                    let size: u64 = size.parse().unwrap();
                    let g = self.grown.entry(u.into()).or_default();
                    *g = (*g).max(size);
                    self.ok_ops += 1;
                }
                _ => {}
            }
        }
        if !in_flight.is_empty() {
            self.killed_in_flight += 1;
        }
    }

    pub fn verify(&self, c: &Cluster) {
        let volumes: BTreeMap<String, u64> = c
            .volumes()
            .unwrap()
            .into_iter()
            .map(|v| (v.volume.uuid.to_string(), v.volume.size_bytes))
            .collect();
        for u in volumes.keys() {
            assert!(self.started.contains(u), "volume {u} was never created");
            assert!(!self.deleted.contains(u), "deleted volume {u} is back");
        }
        for u in &self.created {
            if !self.delete_started.contains(u) {
                assert!(volumes.contains_key(u), "committed volume {u} is lost");
            }
        }
        for a in c.attachments().unwrap() {
            let k = (a.volume.to_string(), a.host_nqn.clone());
            assert!(
                self.attach_started.contains(&k),
                "attachment {k:?} was never made"
            );
        }
        for (u, &size) in &self.grown {
            if let Some(&now) = volumes.get(u) {
                assert!(now >= size, "volume {u} lost a committed grow to {size}");
            }
        }
    }
}
