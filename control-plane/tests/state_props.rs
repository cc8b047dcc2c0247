//! Property tests of the cluster state over the in-memory store: random
//! clusters (racks, pools), random sequences of creates (and retried
//! creates), grows, deletes, cordons and heartbeat gaps. After every step
//! the stored state is consistent (`Cluster::check`), capacity adds up
//! (free + used = total for every device, pool and the cluster, used =
//! the sum of the volumes' extents), and new extents sit only on targets
//! that were online and active.

use nvpool_control::clock::ManualClock;
use nvpool_control::limits::{EXTENT_BYTES_MIN, HEARTBEAT_TIMEOUT_MS};
use nvpool_control::model::{Device, DeviceRef, Health, Layout, TargetState, Uuid, VolumeSpec};
use nvpool_control::state::{Capacity, Cluster, StateConfig, StateError, TargetRegistration};
use nvpool_control::store::MemStore;
use nvpool_control::PlacementError;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

const E: u64 = EXTENT_BYTES_MIN;
const BLOCKS_PER_E: u64 = E / 4096;

#[derive(Debug, Clone)]
enum Step {
    Create {
        layout: Layout,
        blocks: u64,
        pooled: bool,
    },
    Retry {
        pick: usize,
    },
    Grow {
        pick: usize,
        extra_blocks: u64,
    },
    Delete {
        pick: usize,
    },
    Cordon {
        target: usize,
        cordoned: bool,
    },
    Time {
        advance_ms: u64,
        heartbeats: u8,
    },
}

fn layout() -> impl Strategy<Value = Layout> {
    prop_oneof![
        Just(Layout::Concat),
        (2u32..=3).prop_map(|width| Layout::Raid0 {
            stripe_bytes: 65536,
            width
        }),
        (2u8..=3).prop_map(|copies| Layout::Raid1 { copies }),
        Just(Layout::Raid10 {
            stripe_bytes: 4096,
            width: 2,
            copies: 2
        }),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        5 => (layout(), 1..=3 * BLOCKS_PER_E, prop::bool::weighted(0.3))
            .prop_map(|(layout, blocks, pooled)| Step::Create { layout, blocks, pooled }),
        1 => any::<usize>().prop_map(|pick| Step::Retry { pick }),
        2 => (any::<usize>(), 1..=2 * BLOCKS_PER_E)
            .prop_map(|(pick, extra_blocks)| Step::Grow { pick, extra_blocks }),
        2 => any::<usize>().prop_map(|pick| Step::Delete { pick }),
        1 => (any::<usize>(), any::<bool>())
            .prop_map(|(target, cordoned)| Step::Cordon { target, cordoned }),
        1 => (prop_oneof![Just(1000u64), Just(HEARTBEAT_TIMEOUT_MS + 1)], any::<u8>())
            .prop_map(|(advance_ms, heartbeats)| Step::Time { advance_ms, heartbeats }),
    ]
}

/// (rack, device capacities in extents, which devices join the pool)
type TargetPlan = (u8, Vec<u64>, Vec<bool>);

fn target_plan() -> impl Strategy<Value = TargetPlan> {
    (
        0u8..3,
        prop::collection::vec(0u64..=8, 1..=2),
        prop::collection::vec(prop::bool::weighted(0.3), 2),
    )
}

fn registration(i: usize, plan: &TargetPlan) -> TargetRegistration {
    TargetRegistration {
        id: format!("t{i}"),
        name: format!("host{i}"),
        addr: format!("127.0.0.{}:4420", i + 1).parse().unwrap(),
        admin_addr: format!("127.0.0.{}:4480", i + 1).parse().unwrap(),
        labels: [("rack".to_string(), format!("r{}", plan.0))].into(),
        devices: plan
            .1
            .iter()
            .enumerate()
            .map(|(j, &extents)| Device {
                id: format!("d{j}"),
                backend: format!("ram:{}", extents * E),
                capacity_bytes: extents * E,
                labels: BTreeMap::new(),
            })
            .collect(),
        rdma_addr: None,
        admin_tls: false,
        admin_token: None,
    }
}

fn check(c: &Cluster) {
    assert_eq!(c.check().unwrap(), Vec::<String>::new());
    let report = c.capacity().unwrap();
    let volumes = c.volumes().unwrap();
    let mut used: BTreeMap<DeviceRef, u64> = BTreeMap::new();
    for v in &volumes {
        for e in &v.volume.extents {
            *used.entry(e.device_ref()).or_default() += e.length;
        }
    }
    let mut total = Capacity::default();
    let mut by_pool: BTreeMap<Option<String>, Capacity> = BTreeMap::new();
    for d in &report.devices {
        let r = DeviceRef::new(&d.target, &d.device);
        assert_eq!(d.used_bytes, used.get(&r).copied().unwrap_or(0), "{r}");
        // Plain devices: what is placed is what is used.
        assert_eq!(d.provisioned_bytes, d.used_bytes, "{r}");
        assert_eq!(d.free_bytes + d.used_bytes, d.capacity_bytes, "{r}");
        assert_eq!(
            d.free_extents * E + d.used_bytes + d.capacity_bytes % E,
            d.capacity_bytes
        );
        for cap in [&mut total, by_pool.entry(d.pool.clone()).or_default()] {
            cap.total_bytes += d.capacity_bytes;
            cap.used_bytes += d.used_bytes;
            cap.free_bytes += d.free_bytes;
            cap.free_extents += d.free_extents;
            cap.provisioned_bytes += d.provisioned_bytes;
        }
    }
    assert_eq!(report.total, total);
    assert_eq!(
        report.total.free_bytes + report.total.used_bytes,
        report.total.total_bytes
    );
    assert_eq!(report.unpooled, by_pool.remove(&None).unwrap_or_default());
    for (name, cap) in &report.pools {
        assert_eq!(
            *cap,
            by_pool.remove(&Some(name.clone())).unwrap_or_default()
        );
    }
    assert!(by_pool.is_empty());
}

fn run(plans: Vec<TargetPlan>, steps: Vec<Step>) {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let config = StateConfig {
        extent_bytes: E,
        ..StateConfig::default()
    };
    let c = Cluster::new(Arc::new(MemStore::new()), clock.clone(), config).unwrap();
    let mut pool_devices = Vec::new();
    for (i, plan) in plans.iter().enumerate() {
        c.register_target(&registration(i, plan)).unwrap();
        for (j, _) in plan.1.iter().enumerate() {
            if plan.2[j] {
                pool_devices.push(DeviceRef::new(&format!("t{i}"), &format!("d{j}")));
            }
        }
    }
    let have_pool = !pool_devices.is_empty();
    if have_pool {
        c.create_pool("p", &pool_devices).unwrap();
    }
    // Specs of live volumes as created (a grow makes a retry a conflict).
    let mut live: Vec<(VolumeSpec, bool)> = Vec::new();
    let mut next = 0u32;
    for step in steps {
        match step {
            Step::Create {
                layout,
                blocks,
                pooled,
            } => {
                next += 1;
                let mut uuid = [0u8; 16];
                uuid[12..].copy_from_slice(&next.to_be_bytes());
                let spec = VolumeSpec {
                    uuid: Uuid(uuid),
                    name: format!("vol-{next}"),
                    size_bytes: blocks * 4096,
                    layout,
                    pool: (pooled && have_pool).then(|| "p".to_string()),
                };
                let accepting: BTreeSet<String> = c
                    .targets()
                    .unwrap()
                    .into_iter()
                    .filter(|t| t.health == Health::Online && t.target.state == TargetState::Active)
                    .map(|t| t.target.id)
                    .collect();
                match c.create_volume(&spec) {
                    Ok(created) => {
                        assert!(created.created);
                        for e in &created.volume.extents {
                            assert!(
                                accepting.contains(&e.target),
                                "{e:?} on a target not accepting"
                            );
                        }
                        live.push((spec, false));
                    }
                    Err(StateError::Placement(
                        PlacementError::NoSpace { .. } | PlacementError::NotEnoughTargets { .. },
                    )) => {}
                    Err(e) => panic!("create failed: {e}"),
                }
            }
            Step::Retry { pick } => {
                if live.is_empty() {
                    continue;
                }
                let (spec, grown) = &live[pick % live.len()];
                match c.create_volume(spec) {
                    Ok(again) => {
                        assert!(!grown);
                        assert!(!again.created);
                        assert_eq!(again.volume, c.volume(&spec.uuid).unwrap().volume);
                    }
                    Err(StateError::UuidConflict { .. }) => assert!(grown),
                    Err(e) => panic!("retry failed: {e}"),
                }
            }
            Step::Grow { pick, extra_blocks } => {
                if live.is_empty() {
                    continue;
                }
                let i = pick % live.len();
                let uuid = live[i].0.uuid;
                let before = c.volume(&uuid).unwrap().volume;
                match c.resize_volume(&uuid, before.size_bytes + extra_blocks * 4096) {
                    Ok(after) => {
                        assert_eq!(after.extents[..before.extents.len()], before.extents[..]);
                        live[i].1 = true;
                    }
                    Err(StateError::Placement(
                        PlacementError::NoSpace { .. } | PlacementError::NotEnoughTargets { .. },
                    )) => assert_eq!(c.volume(&uuid).unwrap().volume, before),
                    Err(e) => panic!("grow failed: {e}"),
                }
            }
            Step::Delete { pick } => {
                if live.is_empty() {
                    continue;
                }
                let (spec, _) = live.swap_remove(pick % live.len());
                c.delete_volume(&spec.uuid).unwrap();
            }
            Step::Cordon { target, cordoned } => {
                let id = format!("t{}", target % plans.len());
                let state = if cordoned {
                    TargetState::Cordoned
                } else {
                    TargetState::Active
                };
                c.set_target_state(&id, state).unwrap();
            }
            Step::Time {
                advance_ms,
                heartbeats,
            } => {
                clock.advance(advance_ms);
                for i in 0..plans.len() {
                    if heartbeats & (1 << i) != 0 {
                        c.heartbeat(&format!("t{i}")).unwrap();
                    }
                }
            }
        }
        check(&c);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn cluster_state_stays_consistent(
        plans in prop::collection::vec(target_plan(), 2..=6),
        steps in prop::collection::vec(step(), 1..=25),
    ) {
        run(plans, steps);
    }
}
