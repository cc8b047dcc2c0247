//! Property tests of the extent allocator: random clusters, random
//! sequences of creates, grows and deletes. After every step:
//!
//! - no two extents overlap, and every extent lies inside its device;
//! - every volume is complete and canonical, each row on distinct targets;
//! - the failure-domain guarantee holds where its precondition does;
//! - new extents sit only on accepting devices of the volume's pool;
//! - per device, used bytes equal the live extents' lengths, and
//!   free extents × E + used + tail = capacity (free + used = total);
//! - a refused request takes nothing.

use nvpool_control::limits::EXTENT_BYTES_MIN;
use nvpool_control::model::{DeviceRef, Extent, Layout, Uuid, Volume, VolumeSpec};
use nvpool_control::placement::{Allocator, DeviceInfo, PlacementError};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const E: u64 = EXTENT_BYTES_MIN;

#[derive(Debug, Clone)]
struct Dev {
    capacity_bytes: u64,
    pool: Option<String>,
}

#[derive(Debug, Clone)]
struct Tgt {
    rack: Option<u8>,
    accepting: bool,
    devices: Vec<Dev>,
}

#[derive(Debug, Clone)]
enum Step {
    Create {
        layout: Layout,
        blocks: u64,
        pooled: bool,
    },
    Grow {
        pick: usize,
        extra_blocks: u64,
    },
    Delete {
        pick: usize,
    },
}

fn dev() -> impl Strategy<Value = Dev> {
    (
        0u64..=10,
        prop_oneof![Just(0u64), 1u64..=255],
        prop::bool::weighted(0.25),
    )
        .prop_map(|(extents, tail_blocks, pooled)| Dev {
            capacity_bytes: extents * E + tail_blocks * 4096,
            pool: pooled.then(|| "p".to_string()),
        })
}

fn target() -> impl Strategy<Value = Tgt> {
    (
        prop::option::weighted(0.8, 0u8..4),
        prop::bool::weighted(0.9),
        prop::collection::vec(dev(), 1..=3),
    )
        .prop_map(|(rack, accepting, devices)| Tgt {
            rack,
            accepting,
            devices,
        })
}

fn layout() -> impl Strategy<Value = Layout> {
    let stripe = (12u32..=20).prop_map(|s| 1u64 << s);
    prop_oneof![
        Just(Layout::Concat),
        (stripe.clone(), 2u32..=4).prop_map(|(stripe_bytes, width)| Layout::Raid0 {
            stripe_bytes,
            width
        }),
        (2u8..=3).prop_map(|copies| Layout::Raid1 { copies }),
        (stripe, 2u32..=3, 2u8..=3).prop_map(|(stripe_bytes, width, copies)| Layout::Raid10 {
            stripe_bytes,
            width,
            copies
        }),
    ]
}

/// Sizes in 4 KiB blocks: up to four extents' worth.
const BLOCKS_PER_E: u64 = E / 4096;

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (layout(), 1..=4 * BLOCKS_PER_E, prop::bool::weighted(0.3)).prop_map(
            |(layout, blocks, pooled)| Step::Create { layout, blocks, pooled }
        ),
        2 => (any::<usize>(), 0..=3 * BLOCKS_PER_E)
            .prop_map(|(pick, extra_blocks)| Step::Grow { pick, extra_blocks }),
        2 => any::<usize>().prop_map(|pick| Step::Delete { pick }),
    ]
}

fn domain_of(i: usize, t: &Tgt) -> String {
    match t.rack {
        Some(r) => format!("rack={r}"),
        None => format!("target=t{i}"),
    }
}

fn build(targets: &[Tgt]) -> Allocator {
    let mut a = Allocator::new();
    for (i, t) in targets.iter().enumerate() {
        for (j, d) in t.devices.iter().enumerate() {
            a.add_device(DeviceInfo {
                target: format!("t{i}"),
                device: format!("d{j}"),
                capacity_bytes: d.capacity_bytes,
                grain_pool: false,
                domain: domain_of(i, t),
                pool: d.pool.clone(),
                accepting: t.accepting,
            })
            .unwrap();
        }
    }
    a
}

/// Domains holding one eligible device with room for `rows` more extents.
fn roomy_domains(a: &Allocator, pool: Option<&str>, rows: u64) -> usize {
    a.devices()
        .iter()
        .filter(|d| d.info.accepting && d.info.pool.as_deref() == pool)
        .filter(|d| d.free_extents(E) >= rows)
        .map(|d| d.info.domain.clone())
        .collect::<BTreeSet<_>>()
        .len()
}

fn eligible_targets(a: &Allocator, pool: Option<&str>) -> u32 {
    a.devices()
        .iter()
        .filter(|d| d.info.accepting && d.info.pool.as_deref() == pool)
        .map(|d| d.info.target.clone())
        .collect::<BTreeSet<_>>()
        .len() as u32
}

/// Checks the rows `from..` of `v` against the placement rules.
fn check_new_rows(a: &Allocator, v: &Volume, from: u32, domains_guaranteed: bool) {
    let per_row = v.layout.extents_per_row() as usize;
    for row in v.extents.chunks(per_row).skip(from as usize) {
        for e in row {
            let d = a.device(&e.device_ref()).unwrap();
            assert!(d.info.accepting, "{e:?} on a non-accepting target");
            assert_eq!(d.info.pool, v.pool, "{e:?} outside the volume's pool");
        }
        if domains_guaranteed {
            let domains: BTreeSet<String> = row
                .iter()
                .map(|e| a.device(&e.device_ref()).unwrap().info.domain.clone())
                .collect();
            assert_eq!(
                domains.len(),
                per_row,
                "row not spread over domains: {row:?}"
            );
        }
    }
}

/// The global invariants, recomputed from scratch.
fn check_invariants(a: &Allocator, targets: &[Tgt], live: &[Volume]) {
    let mut fresh = build(targets);
    let mut per_device: BTreeMap<DeviceRef, Vec<&Extent>> = BTreeMap::new();
    for v in live {
        v.validate().unwrap();
        fresh
            .occupy_volume(v)
            .expect("live extents overlap or stray");
        for e in &v.extents {
            per_device.entry(e.device_ref()).or_default().push(e);
        }
    }
    assert_eq!(
        fresh.usage(E),
        a.usage(E),
        "incremental and rebuilt usage differ"
    );
    for u in a.usage(E) {
        let r = DeviceRef::new(&u.target, &u.device);
        let extents = per_device.get(&r).map(Vec::as_slice).unwrap_or(&[]);
        let used: u64 = extents.iter().map(|e| e.length).sum();
        assert_eq!(u.used_bytes, used);
        assert!(u.used_bytes <= u.capacity_bytes);
        assert_eq!(u.free_bytes + u.used_bytes, u.capacity_bytes);
        // Brute force: every aligned slot is either free or exactly one extent.
        let slots = u.capacity_bytes / E;
        let free = (0..slots)
            .filter(|k| {
                extents
                    .iter()
                    .all(|e| e.end() <= k * E || e.offset >= (k + 1) * E)
            })
            .count() as u64;
        assert_eq!(u.free_extents, free);
        assert_eq!(
            u.free_extents * E + u.used_bytes + u.capacity_bytes % E,
            u.capacity_bytes
        );
    }
}

fn run(targets: Vec<Tgt>, steps: Vec<Step>) {
    let mut a = build(&targets);
    let mut live: Vec<Volume> = Vec::new();
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
                uuid[..4].copy_from_slice(&next.to_le_bytes());
                let spec = VolumeSpec {
                    uuid: Uuid(uuid),
                    name: format!("v{next}"),
                    size_bytes: blocks * 4096,
                    layout,
                    pool: pooled.then(|| "p".to_string()),
                };
                let rows = nvpool_control::Geometry::new(spec.size_bytes, E, &layout).rows();
                let need = layout.extents_per_row();
                let guaranteed =
                    roomy_domains(&a, spec.pool.as_deref(), u64::from(rows)) >= need as usize;
                let eligible = eligible_targets(&a, spec.pool.as_deref());
                let before = a.usage(E);
                match a.allocate(&spec, E) {
                    Ok(extents) => {
                        let v = Volume {
                            uuid: spec.uuid,
                            name: spec.name.clone(),
                            size_bytes: spec.size_bytes,
                            layout,
                            pool: spec.pool.clone(),
                            extent_bytes: E,
                            extents,
                            created_ms: 0,
                        };
                        v.validate().unwrap();
                        check_new_rows(&a, &v, 0, guaranteed);
                        live.push(v);
                    }
                    Err(PlacementError::NotEnoughTargets { need: n, have, .. }) => {
                        assert_eq!((n, have), (need, eligible));
                        assert!(have < need);
                        assert_eq!(a.usage(E), before);
                    }
                    Err(PlacementError::NoSpace { need: n, have, .. }) => {
                        assert_eq!(n, need);
                        assert!(have < need && eligible >= need);
                        assert_eq!(a.usage(E), before, "a refused create leaked space");
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            Step::Grow { pick, extra_blocks } => {
                if live.is_empty() {
                    continue;
                }
                let i = pick % live.len();
                let v = &mut live[i];
                let new_size = v.size_bytes + extra_blocks * 4096;
                let old_rows = v.rows();
                let new_rows = nvpool_control::Geometry::new(new_size, E, &v.layout).rows();
                let need = v.layout.extents_per_row() as usize;
                let guaranteed =
                    roomy_domains(&a, v.pool.as_deref(), u64::from(new_rows - old_rows)) >= need;
                let before = a.usage(E);
                match a.grow(v, new_size) {
                    Ok(added) => {
                        assert_eq!(
                            added.len(),
                            (new_rows - old_rows) as usize * need,
                            "grow adds exactly the missing rows"
                        );
                        v.size_bytes = new_size;
                        v.extents.extend(added);
                        v.validate().unwrap();
                        check_new_rows(&a, v, old_rows, guaranteed);
                    }
                    Err(
                        PlacementError::NotEnoughTargets { .. } | PlacementError::NoSpace { .. },
                    ) => {
                        assert_eq!(a.usage(E), before, "a refused grow leaked space");
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            Step::Delete { pick } => {
                if live.is_empty() {
                    continue;
                }
                let v = live.swap_remove(pick % live.len());
                a.release_volume(&v).unwrap();
            }
        }
        check_invariants(&a, &targets, &live);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn allocator_keeps_its_invariants(
        targets in prop::collection::vec(target(), 1..=8),
        steps in prop::collection::vec(step(), 1..=30),
    ) {
        run(targets, steps);
    }
}

/// Large, roomy clusters: every row must land in distinct racks.
#[test]
fn roomy_racks_always_separate_rows() {
    let targets: Vec<Tgt> = (0..12)
        .map(|i| Tgt {
            rack: Some((i % 6) as u8),
            accepting: true,
            devices: vec![Dev {
                capacity_bytes: 64 * E,
                pool: None,
            }],
        })
        .collect();
    let layouts = [
        Layout::Raid1 { copies: 3 },
        Layout::Raid10 {
            stripe_bytes: 65536,
            width: 3,
            copies: 2,
        },
        Layout::Raid0 {
            stripe_bytes: 4096,
            width: 4,
        },
    ];
    let steps = (0..30)
        .map(|i| Step::Create {
            layout: layouts[i % 3],
            blocks: (i as u64 % 4 + 1) * BLOCKS_PER_E,
            pooled: false,
        })
        .collect();
    run(targets, steps);
}
