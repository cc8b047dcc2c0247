//! The extent allocator: which device holds each extent of a volume. Pure:
//! devices and their existing extents in, extents out; no store, no clock.
//!
//! **What is allocated.** Fixed-size extents of the volume's `extent_bytes`
//! (default [`EXTENT_BYTES`](crate::limits::EXTENT_BYTES)), each at an
//! offset that is a multiple of that size, first fit on its device. A device
//! is a set of non-overlapping `[offset, offset + length)` intervals inside
//! `[0, capacity)`; the allocator refuses (`Overlap`, `OutOfBounds`) to load
//! any extent that breaks this, so a corrupt state is never built upon.
//!
//! **Where.** A volume is placed one *row* at a time: row `r` is the `r`-th
//! extent of every member and every copy, `W × C` extents (see
//! [`crate::mapping`]). The rules, in order:
//!
//! 1. *Eligible devices only*: the target is online and active, and the
//!    device belongs to the volume's pool (or to no pool when the volume has
//!    none).
//! 2. *Hard rule: the `W × C` extents of a row sit on `W × C` distinct
//!    targets.* Copies are then independent, and stripe members do not
//!    share a target's network link. With fewer eligible targets the
//!    request fails with `NotEnoughTargets`; with enough targets but fewer
//!    than `W × C` of them having room for one more extent, `NoSpace`.
//! 3. *Failure domains, best effort with a guarantee.* Each device has a
//!    failure domain: the value of the configured label (default `rack`) on
//!    the device, else on its target, else the target itself. Each pick
//!    prefers, in order: a domain not yet holding a copy of the same member
//!    in this row, then the domain least used by the row so far. Hence:
//!    **when, as a row is placed, at least `W × C` domains have room for an
//!    extent, every extent of the row is in a different domain**; with
//!    fewer, copies of one member still spread over as many domains as the
//!    picks allow. Domains only order the candidates: a row is refused only
//!    when fewer than `W × C` eligible targets have room.
//! 4. *Balance*: among equally good devices, the one with the most free
//!    bytes, then the lowest `(target, device)` so results are
//!    deterministic.
//!
//! **Thin and thick.** A volume's extents are all on grain pools (thin) or
//! all on plain devices (thick): each kind is placed only on its own
//! devices, which is how a volume's kind is known without storing it. A
//! grain pool's space is virtual, [`GRAIN_POOL_VIRTUAL_BYTES`] whatever
//! its real capacity (its extents take space when written), so thin
//! volumes may promise more than the pool holds. Nothing here grows with
//! that size: a device is the list of its extents, and free space is
//! counted from the gaps between them. An extent's tree on a grain pool is
//! named by `offset / THIN_ROOT_UNIT_BYTES`; offsets are multiples of the
//! extent size, itself a multiple of that unit, so distinct extents name
//! distinct trees (`occupy` refuses a stored one that does not).
//!
//! Growing a volume places its new rows by the same rules; existing rows
//! never move. An allocation that fails part-way releases what it took.

use crate::limits::GRAIN_POOL_VIRTUAL_BYTES;
use crate::mapping::Geometry;
use crate::model::{
    validate_size, Device, DeviceRef, Extent, Layout, ModelError, Target, Volume, VolumeSpec,
};
use nvpool_api::admin::THIN_ROOT_UNIT_BYTES;
use nvpool_api::rest::Provisioning;
use std::collections::{BTreeMap, BTreeSet};

/// The label whose values are failure domains when none is configured.
pub const DEFAULT_FAILURE_DOMAIN_LABEL: &str = "rack";

/// Why the allocator refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// The layout, size or extent size is invalid.
    #[error(transparent)]
    Invalid(#[from] ModelError),
    #[error(
        "need {need} distinct targets (one per member and copy) that are online, active and \
         {scope}; only {have} are",
        scope = pool_scope(pool)
    )]
    NotEnoughTargets {
        need: u32,
        have: u32,
        pool: Option<String>,
    },
    #[error(
        "no space: a row of extents needs {need} distinct targets with a free \
         {extent_bytes}-byte extent {scope}; only {have} have one",
        scope = pool_scope(pool)
    )]
    NoSpace {
        need: u32,
        have: u32,
        extent_bytes: u64,
        pool: Option<String>,
    },
    #[error("device {0} is unknown")]
    UnknownDevice(DeviceRef),
    #[error("device {0} is added twice")]
    DuplicateDevice(DeviceRef),
    #[error("extent [{offset}, {end}) on {device} overlaps the extent at {existing}")]
    Overlap {
        device: DeviceRef,
        offset: u64,
        end: u64,
        existing: u64,
    },
    #[error("extent [{offset}, {end}) is outside device {device} ({capacity} bytes)")]
    OutOfBounds {
        device: DeviceRef,
        offset: u64,
        end: u64,
        capacity: u64,
    },
    #[error("no extent at {offset} on {device} to release")]
    NotAllocated { device: DeviceRef, offset: u64 },
    #[error(
        "extent at {offset} on grain pool {device} is not a multiple of {THIN_ROOT_UNIT_BYTES} \
         bytes: it names no tree of its own"
    )]
    Misaligned { device: DeviceRef, offset: u64 },
    #[error(
        "a {kind} volume needs {what} {scope}; there are none",
        kind = provisioning_name(*provisioning),
        what = match provisioning {
            Provisioning::Thin => "grain pools (thin: devices)",
            Provisioning::Thick => "plain devices (not grain pools)",
        },
        scope = pool_scope(pool)
    )]
    NoDevicesOfKind {
        provisioning: Provisioning,
        pool: Option<String>,
    },
}

pub(crate) fn provisioning_name(p: Provisioning) -> &'static str {
    match p {
        Provisioning::Thin => "thin",
        Provisioning::Thick => "thick",
    }
}

fn pool_scope(pool: &Option<String>) -> String {
    match pool {
        Some(p) => format!("in pool {p}"),
        None => "outside every pool".into(),
    }
}

/// The failure domain of a device: the label's value on the device, else
/// on its target, else the target itself (an unlabelled target is its own
/// domain).
pub fn failure_domain(target: &Target, device: &Device, label: &str) -> String {
    match device.labels.get(label) {
        Some(value) => format!("{label}={value}"),
        None => target_domain(target, label),
    }
}

/// The failure domain of a target as a whole (its `label`, else the
/// target itself): where a served volume's paths are spread.
pub fn target_domain(target: &Target, label: &str) -> String {
    match target.labels.get(label) {
        Some(value) => format!("{label}={value}"),
        None => format!("target={}", target.id),
    }
}

/// What the allocator needs to know about one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub target: String,
    pub device: String,
    /// The device's real capacity.
    pub capacity_bytes: u64,
    /// A grain pool: holds thin volumes' extents, in virtual space.
    pub grain_pool: bool,
    /// See [`failure_domain`].
    pub domain: String,
    /// The pool the device belongs to, if any.
    pub pool: Option<String>,
    /// Whether the target takes new extents (online and active).
    pub accepting: bool,
}

/// A device and the extents on it.
#[derive(Debug, Clone)]
pub struct DeviceSpace {
    pub info: DeviceInfo,
    /// offset → end of every extent on the device.
    used: BTreeMap<u64, u64>,
    used_bytes: u64,
}

impl DeviceSpace {
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// The space extents are placed in: the capacity, or a grain pool's
    /// virtual size.
    pub fn space_bytes(&self) -> u64 {
        if self.info.grain_pool {
            GRAIN_POOL_VIRTUAL_BYTES
        } else {
            self.info.capacity_bytes
        }
    }

    /// Unplaced bytes of [`Self::space_bytes`].
    pub fn free_bytes(&self) -> u64 {
        self.space_bytes() - self.used_bytes
    }

    /// The extents on the device as `(offset, end)`, in offset order.
    pub fn extents(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.used.iter().map(|(&s, &e)| (s, e))
    }

    /// The lowest `size`-aligned offset where `size` free bytes start.
    pub(crate) fn first_fit(&self, size: u64) -> Option<u64> {
        let mut cursor = 0u64;
        for (&start, &end) in &self.used {
            let candidate = cursor.next_multiple_of(size);
            if candidate.checked_add(size)? <= start {
                return Some(candidate);
            }
            cursor = cursor.max(end);
        }
        let candidate = cursor.next_multiple_of(size);
        (candidate.checked_add(size)? <= self.space_bytes()).then_some(candidate)
    }

    /// How many more `size`-byte extents fit.
    pub fn free_extents(&self, size: u64) -> u64 {
        let mut n = 0;
        let mut cursor = 0u64;
        let space = self.space_bytes();
        let gaps = self
            .used
            .iter()
            .map(|(&s, &e)| (s, e))
            .chain(std::iter::once((space, space)));
        for (start, end) in gaps {
            let first = cursor.next_multiple_of(size);
            if first < start {
                n += (start - first) / size;
            }
            cursor = cursor.max(end);
        }
        n
    }
}

/// Usage of one device, for capacity reports.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceUsage {
    pub target: String,
    pub device: String,
    pub pool: Option<String>,
    pub accepting: bool,
    /// A grain pool: `used_bytes` is what its extents promise (they take
    /// space when written, which only the target knows), and may exceed
    /// the capacity; `free_bytes` stops at 0 and `free_extents` counts the
    /// virtual space.
    #[serde(default)]
    pub grain_pool: bool,
    /// The real capacity.
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    /// `capacity_bytes - used_bytes` (at least 0).
    pub free_bytes: u64,
    /// Extents of the requested size that still fit (the capacity's tail
    /// beyond the last whole extent never holds one).
    pub free_extents: u64,
}

/// Devices, their extents, and the placement algorithm.
#[derive(Debug, Clone, Default)]
pub struct Allocator {
    devices: Vec<DeviceSpace>,
    index: BTreeMap<DeviceRef, usize>,
}

impl Allocator {
    pub fn new() -> Allocator {
        Allocator::default()
    }

    pub fn add_device(&mut self, info: DeviceInfo) -> Result<(), PlacementError> {
        let r = DeviceRef::new(&info.target, &info.device);
        if self.index.contains_key(&r) {
            return Err(PlacementError::DuplicateDevice(r));
        }
        self.index.insert(r, self.devices.len());
        self.devices.push(DeviceSpace {
            info,
            used: BTreeMap::new(),
            used_bytes: 0,
        });
        Ok(())
    }

    pub fn devices(&self) -> &[DeviceSpace] {
        &self.devices
    }

    pub fn device(&self, r: &DeviceRef) -> Option<&DeviceSpace> {
        self.index.get(r).map(|&i| &self.devices[i])
    }

    /// Marks an existing extent as used.
    pub fn occupy(&mut self, e: &Extent) -> Result<(), PlacementError> {
        let r = e.device_ref();
        let &i = self
            .index
            .get(&r)
            .ok_or_else(|| PlacementError::UnknownDevice(r.clone()))?;
        let d = &mut self.devices[i];
        let space = d.space_bytes();
        let end = e
            .offset
            .checked_add(e.length)
            .filter(|&end| e.length > 0 && end <= space);
        let Some(end) = end else {
            return Err(PlacementError::OutOfBounds {
                device: r,
                offset: e.offset,
                end: e.offset.saturating_add(e.length),
                capacity: space,
            });
        };
        if d.info.grain_pool && !e.offset.is_multiple_of(THIN_ROOT_UNIT_BYTES) {
            return Err(PlacementError::Misaligned {
                device: r,
                offset: e.offset,
            });
        }
        let before = d.used.range(..end).next_back();
        if let Some((&s, &x)) = before {
            if x > e.offset {
                return Err(PlacementError::Overlap {
                    device: r,
                    offset: e.offset,
                    end,
                    existing: s,
                });
            }
        }
        d.used.insert(e.offset, end);
        d.used_bytes += e.length;
        Ok(())
    }

    /// Frees an extent previously occupied.
    pub fn release(&mut self, e: &Extent) -> Result<(), PlacementError> {
        let r = e.device_ref();
        let not_allocated = || PlacementError::NotAllocated {
            device: r.clone(),
            offset: e.offset,
        };
        let &i = self.index.get(&r).ok_or_else(not_allocated)?;
        let d = &mut self.devices[i];
        match d.used.get(&e.offset) {
            Some(&end) if end == e.end() => {
                d.used.remove(&e.offset);
                d.used_bytes -= e.length;
                Ok(())
            }
            _ => Err(not_allocated()),
        }
    }

    /// Occupies every extent of a volume, or none of them.
    pub fn occupy_volume(&mut self, v: &Volume) -> Result<(), PlacementError> {
        for (i, e) in v.extents.iter().enumerate() {
            if let Err(err) = self.occupy(e) {
                for done in &v.extents[..i] {
                    self.release(done).expect("just occupied");
                }
                return Err(err);
            }
        }
        Ok(())
    }

    /// Releases every extent of a volume.
    pub fn release_volume(&mut self, v: &Volume) -> Result<(), PlacementError> {
        v.extents.iter().try_for_each(|e| self.release(e))
    }

    /// The kind a new volume of `pool` (None: the unpooled devices) gets:
    /// the one asked for, or thin when a grain pool is among the pool's
    /// devices (online or not), else thick. `NoDevicesOfKind` when the
    /// pool has devices but none of the kind asked for (with none at all,
    /// placing says `NotEnoughTargets`, as for any volume).
    pub fn provisioning_for(
        &self,
        pool: Option<&str>,
        asked: Option<Provisioning>,
    ) -> Result<Provisioning, PlacementError> {
        let mut scope = self
            .devices
            .iter()
            .filter(|d| d.info.pool.as_deref() == pool)
            .peekable();
        let kind = match asked {
            Some(p) => p,
            None if scope.clone().any(|d| d.info.grain_pool) => Provisioning::Thin,
            None => Provisioning::Thick,
        };
        let thin = kind == Provisioning::Thin;
        if scope.peek().is_none() || scope.any(|d| d.info.grain_pool == thin) {
            Ok(kind)
        } else {
            Err(PlacementError::NoDevicesOfKind {
                provisioning: kind,
                pool: pool.map(str::to_owned),
            })
        }
    }

    /// A volume's kind ([`Volume::provisioning`]) from the allocator's
    /// devices.
    pub fn provisioning_of(&self, v: &Volume) -> Provisioning {
        v.provisioning(|e| self.device(&e.device_ref()).map(|d| d.info.grain_pool))
    }

    /// Places a new volume of its pool's default kind and occupies its
    /// extents, returned in canonical `(row, member, copy)` order.
    pub fn allocate(
        &mut self,
        spec: &VolumeSpec,
        extent_bytes: u64,
    ) -> Result<Vec<Extent>, PlacementError> {
        let kind = self.provisioning_for(spec.pool.as_deref(), None)?;
        self.allocate_as(spec, extent_bytes, kind)
    }

    /// [`Self::allocate`] of a given kind (see [`Self::provisioning_for`]).
    pub fn allocate_as(
        &mut self,
        spec: &VolumeSpec,
        extent_bytes: u64,
        provisioning: Provisioning,
    ) -> Result<Vec<Extent>, PlacementError> {
        spec.validate(extent_bytes)?;
        let g = Geometry::new(spec.size_bytes, extent_bytes, &spec.layout);
        self.place_rows(
            &spec.layout,
            extent_bytes,
            spec.pool.as_deref(),
            provisioning,
            0..g.rows(),
        )
    }

    /// Places the rows a volume needs to grow to `new_size_bytes` and
    /// occupies them; returns only the new extents, to append. A size that
    /// fits in the rows already allocated returns none.
    pub fn grow(&mut self, v: &Volume, new_size_bytes: u64) -> Result<Vec<Extent>, PlacementError> {
        if new_size_bytes < v.size_bytes {
            return Err(ModelError::InvalidSize(format!(
                "volumes only grow: {new_size_bytes} < {}",
                v.size_bytes
            ))
            .into());
        }
        validate_size(new_size_bytes, &v.layout, v.extent_bytes).map_err(ModelError::from)?;
        let old = v.geometry().rows();
        let new = Geometry::new(new_size_bytes, v.extent_bytes, &v.layout).rows();
        let kind = self.provisioning_of(v);
        self.place_rows(&v.layout, v.extent_bytes, v.pool.as_deref(), kind, old..new)
    }

    fn place_rows(
        &mut self,
        layout: &Layout,
        extent_bytes: u64,
        pool: Option<&str>,
        provisioning: Provisioning,
        rows: std::ops::Range<u32>,
    ) -> Result<Vec<Extent>, PlacementError> {
        let width = layout.width();
        let copies = layout.copies();
        let need = layout.extents_per_row();
        let thin = provisioning == Provisioning::Thin;
        let eligible: Vec<usize> = (0..self.devices.len())
            .filter(|&i| {
                let d = &self.devices[i].info;
                d.accepting && d.pool.as_deref() == pool && d.grain_pool == thin
            })
            .collect();
        let have = eligible
            .iter()
            .map(|&i| self.devices[i].info.target.as_str())
            .collect::<BTreeSet<_>>()
            .len() as u32;
        if have < need {
            return Err(PlacementError::NotEnoughTargets {
                need,
                have,
                pool: pool.map(str::to_owned),
            });
        }
        let mut placed: Vec<Extent> = Vec::new();
        // Devices found without a free extent; they stay full for the rest
        // of this call (we only add extents).
        let mut full = BTreeSet::new();
        for row in rows {
            let mut row_targets: BTreeSet<String> = BTreeSet::new();
            let mut row_domains: BTreeMap<String, u32> = BTreeMap::new();
            for member in 0..width {
                let mut member_domains: BTreeSet<String> = BTreeSet::new();
                for copy in 0..copies {
                    let pick = loop {
                        let best = eligible
                            .iter()
                            .copied()
                            .filter(|i| !full.contains(i))
                            .filter(|&i| !row_targets.contains(&self.devices[i].info.target))
                            .filter(|&i| self.devices[i].free_bytes() >= extent_bytes)
                            .min_by_key(|&i| {
                                let d = &self.devices[i];
                                (
                                    member_domains.contains(&d.info.domain),
                                    row_domains.get(&d.info.domain).copied().unwrap_or(0),
                                    std::cmp::Reverse(d.free_bytes()),
                                    &d.info.target,
                                    &d.info.device,
                                )
                            });
                        let Some(i) = best else {
                            break None;
                        };
                        match self.devices[i].first_fit(extent_bytes) {
                            Some(offset) => break Some((i, offset)),
                            None => {
                                full.insert(i);
                            }
                        }
                    };
                    let Some((i, offset)) = pick else {
                        // Every eligible target outside this row is full:
                        // the row's targets are all that had room.
                        let err = PlacementError::NoSpace {
                            need,
                            have: row_targets.len() as u32,
                            extent_bytes,
                            pool: pool.map(str::to_owned),
                        };
                        for e in &placed {
                            self.release(e).expect("placed by this call");
                        }
                        return Err(err);
                    };
                    let d = &self.devices[i].info;
                    let extent = Extent {
                        target: d.target.clone(),
                        device: d.device.clone(),
                        offset,
                        length: extent_bytes,
                        member,
                        row,
                        copy,
                    };
                    row_targets.insert(d.target.clone());
                    *row_domains.entry(d.domain.clone()).or_default() += 1;
                    member_domains.insert(d.domain.clone());
                    self.occupy(&extent).expect("first_fit found a free extent");
                    placed.push(extent);
                }
            }
        }
        Ok(placed)
    }

    /// Per-device usage, with free extents counted in `extent_bytes` units.
    pub fn usage(&self, extent_bytes: u64) -> Vec<DeviceUsage> {
        self.devices
            .iter()
            .map(|d| DeviceUsage {
                target: d.info.target.clone(),
                device: d.info.device.clone(),
                pool: d.info.pool.clone(),
                accepting: d.info.accepting,
                grain_pool: d.info.grain_pool,
                capacity_bytes: d.info.capacity_bytes,
                used_bytes: d.used_bytes,
                free_bytes: d.info.capacity_bytes.saturating_sub(d.used_bytes),
                free_extents: d.free_extents(extent_bytes),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::EXTENT_BYTES_MIN;
    use crate::model::Uuid;

    const E: u64 = EXTENT_BYTES_MIN;

    /// `targets` targets named t0…, one device each of `extents` extents,
    /// target i in rack `racks[i]`.
    fn cluster(racks: &[&str], extents: u64) -> Allocator {
        let mut a = Allocator::new();
        for (i, rack) in racks.iter().enumerate() {
            a.add_device(DeviceInfo {
                target: format!("t{i}"),
                device: "d0".into(),
                capacity_bytes: extents * E,
                grain_pool: false,
                domain: format!("rack={rack}"),
                pool: None,
                accepting: true,
            })
            .unwrap();
        }
        a
    }

    fn spec(n: u8, layout: Layout, size_bytes: u64) -> VolumeSpec {
        VolumeSpec {
            uuid: Uuid([n; 16]),
            name: format!("v{n}"),
            size_bytes,
            layout,
            pool: None,
        }
    }

    fn volume(spec: &VolumeSpec, extents: Vec<Extent>) -> Volume {
        Volume {
            uuid: spec.uuid,
            name: spec.name.clone(),
            size_bytes: spec.size_bytes,
            layout: spec.layout,
            pool: spec.pool.clone(),
            extent_bytes: E,
            extents,
            created_ms: 0,
        }
    }

    fn domain(a: &Allocator, e: &Extent) -> String {
        a.device(&e.device_ref()).unwrap().info.domain.clone()
    }

    #[test]
    fn concat_fills_first_fit_and_balances() {
        let mut a = cluster(&["a", "b", "c"], 4);
        let s = spec(1, Layout::Concat, 3 * E);
        let ext = a.allocate(&s, E).unwrap();
        let v = volume(&s, ext.clone());
        v.validate().unwrap();
        // Most free first: each row goes to the emptiest target.
        let targets: Vec<&str> = ext.iter().map(|e| e.target.as_str()).collect();
        assert_eq!(targets, ["t0", "t1", "t2"]);
        assert!(ext.iter().all(|e| e.offset == 0 && e.length == E));
        let ext2 = a.allocate(&spec(2, Layout::Concat, E), E).unwrap();
        assert_eq!((ext2[0].target.as_str(), ext2[0].offset), ("t0", E));
        let used: u64 = a.usage(E).iter().map(|u| u.used_bytes).sum();
        assert_eq!(used, 4 * E);
    }

    #[test]
    fn mirrors_need_distinct_targets() {
        let mut a = cluster(&["a"], 8);
        let err = a
            .allocate(&spec(1, Layout::Raid1 { copies: 2 }, E), E)
            .unwrap_err();
        assert_eq!(
            err,
            PlacementError::NotEnoughTargets {
                need: 2,
                have: 1,
                pool: None
            }
        );
        assert!(err.to_string().contains("need 2 distinct targets"), "{err}");
        let mut a = cluster(&["a", "a", "a"], 8);
        let s = spec(1, Layout::Raid1 { copies: 3 }, 5 * E);
        let ext = a.allocate(&s, E).unwrap();
        volume(&s, ext).validate().unwrap();
    }

    #[test]
    fn copies_and_members_spread_over_failure_domains() {
        // Six targets in three racks; raid1×3 puts each copy in its own rack.
        let mut a = cluster(&["a", "a", "b", "b", "c", "c"], 16);
        let ext = a
            .allocate(&spec(1, Layout::Raid1 { copies: 3 }, 4 * E), E)
            .unwrap();
        for row in ext.chunks(3) {
            let racks: BTreeSet<String> = row.iter().map(|e| domain(&a, e)).collect();
            assert_eq!(racks.len(), 3, "{row:?}");
        }
        // raid10 2×2 over 3 racks: 4 extents cannot all differ, but each
        // member's two copies do.
        let layout = Layout::Raid10 {
            stripe_bytes: 4096,
            width: 2,
            copies: 2,
        };
        let ext = a.allocate(&spec(2, layout, 6 * E), E).unwrap();
        for pair in ext.chunks(2) {
            assert_ne!(domain(&a, &pair[0]), domain(&a, &pair[1]), "{pair:?}");
        }
        // raid0 width 4 over 4 racks: every member in a different rack.
        let mut a = cluster(&["a", "a", "b", "c", "d"], 16);
        let layout = Layout::Raid0 {
            stripe_bytes: 65536,
            width: 4,
        };
        let ext = a.allocate(&spec(3, layout, 8 * E), E).unwrap();
        for row in ext.chunks(4) {
            let racks: BTreeSet<String> = row.iter().map(|e| domain(&a, e)).collect();
            assert_eq!(racks.len(), 4, "{row:?}");
        }
    }

    #[test]
    fn no_space_releases_everything() {
        let mut a = cluster(&["a", "b"], 3);
        a.allocate(&spec(1, Layout::Concat, 2 * E), E).unwrap();
        let before = a.usage(E);
        // Needs 3 rows of 2 copies; only 2 + 2 extents are left.
        let err = a
            .allocate(&spec(2, Layout::Raid1 { copies: 2 }, 3 * E), E)
            .unwrap_err();
        assert!(
            matches!(err, PlacementError::NoSpace { need: 2, .. }),
            "{err}"
        );
        assert_eq!(a.usage(E), before, "a failed allocation takes nothing");
        let ext = a
            .allocate(&spec(3, Layout::Raid1 { copies: 2 }, 2 * E), E)
            .unwrap();
        assert_eq!(ext.len(), 4);
        assert!(a.usage(E).iter().all(|u| u.free_extents == 0));
    }

    #[test]
    fn only_accepting_devices_of_the_pool_are_used() {
        let mut a = cluster(&["a", "b"], 4);
        for (i, pool, accepting) in [
            (2, Some("fast"), true),
            (3, Some("fast"), true),
            (4, None, false),
        ] {
            a.add_device(DeviceInfo {
                target: format!("t{i}"),
                device: "d0".into(),
                capacity_bytes: 4 * E,
                grain_pool: false,
                domain: format!("target=t{i}"),
                pool: pool.map(str::to_owned),
                accepting,
            })
            .unwrap();
        }
        let mut s = spec(1, Layout::Raid1 { copies: 2 }, 3 * E);
        s.pool = Some("fast".into());
        let ext = a.allocate(&s, E).unwrap();
        assert!(ext.iter().all(|e| e.target == "t2" || e.target == "t3"));
        let err = a
            .allocate(&spec(2, Layout::Raid1 { copies: 3 }, E), E)
            .unwrap_err();
        assert_eq!(
            err,
            PlacementError::NotEnoughTargets {
                need: 3,
                have: 2,
                pool: None
            },
            "t4 is not accepting, t2 and t3 are pooled"
        );
    }

    #[test]
    fn grow_appends_rows_under_the_same_rules() {
        let mut a = cluster(&["a", "b", "c", "d"], 8);
        let layout = Layout::Raid0 {
            stripe_bytes: 4096,
            width: 2,
        };
        let s = spec(1, layout, E + 4096);
        let mut v = volume(&s, a.allocate(&s, E).unwrap());
        assert_eq!(v.extents.len(), 2, "one row of two members");
        assert!(a.grow(&v, 2 * E).unwrap().is_empty(), "still one row");
        let added = a.grow(&v, 5 * E).unwrap();
        assert_eq!(added.len(), 4);
        assert!(added.iter().all(|e| e.row >= 1));
        v.size_bytes = 5 * E;
        v.extents.extend(added);
        v.validate().unwrap();
        assert!(matches!(a.grow(&v, E), Err(PlacementError::Invalid(_))));
        assert!(matches!(
            a.grow(&v, 5 * E + 1),
            Err(PlacementError::Invalid(_))
        ));
        // Release and re-occupy round-trip.
        let before = a.usage(E);
        a.release_volume(&v).unwrap();
        assert!(a.usage(E).iter().all(|u| u.used_bytes == 0));
        a.occupy_volume(&v).unwrap();
        assert_eq!(a.usage(E), before);
    }

    #[test]
    fn grain_pools_hold_thin_volumes_in_virtual_space() {
        use crate::limits::GRAIN_POOL_VIRTUAL_BYTES;
        let mut a = cluster(&["a", "b"], 4);
        assert_eq!(a.provisioning_for(None, None), Ok(Provisioning::Thick));
        let refused = a.provisioning_for(None, Some(Provisioning::Thin));
        assert!(
            matches!(refused, Err(PlacementError::NoDevicesOfKind { .. })),
            "{refused:?}"
        );
        for i in 2..4 {
            a.add_device(DeviceInfo {
                target: format!("t{i}"),
                device: "d0".into(),
                capacity_bytes: 4 * E,
                grain_pool: true,
                domain: format!("target=t{i}"),
                pool: None,
                accepting: true,
            })
            .unwrap();
        }
        assert_eq!(a.provisioning_for(None, None), Ok(Provisioning::Thin));
        // 64 extents a copy on pools of 4: over-committed.
        let s = spec(1, Layout::Raid1 { copies: 2 }, 64 * E);
        let v = volume(&s, a.allocate(&s, E).unwrap());
        assert!(v
            .extents
            .iter()
            .all(|e| e.target == "t2" || e.target == "t3"));
        assert_eq!(a.provisioning_of(&v), Provisioning::Thin);
        let u = a.usage(E);
        let t2 = u.iter().find(|u| u.target == "t2").unwrap();
        assert!(t2.grain_pool);
        assert_eq!((t2.used_bytes, t2.free_bytes), (64 * E, 0));
        assert_eq!(t2.free_extents, GRAIN_POOL_VIRTUAL_BYTES / E - 64);
        let s2 = spec(2, Layout::Raid1 { copies: 2 }, 2 * E);
        let thick = volume(&s2, a.allocate_as(&s2, E, Provisioning::Thick).unwrap());
        assert!(thick
            .extents
            .iter()
            .all(|e| e.target == "t0" || e.target == "t1"));
        assert_eq!(a.provisioning_of(&thick), Provisioning::Thick);
        // Growing keeps the kind.
        let added = a.grow(&v, 66 * E).unwrap();
        assert!(added.iter().all(|e| e.target == "t2" || e.target == "t3"));
        // Rebalancing never moves an extent to a device of the other kind,
        // however full the pools look against their real capacity.
        let moves =
            crate::rebalance::plan_rebalance(&a, &[&v, &thick], &[], &BTreeSet::new(), None, 100);
        assert!(moves.is_empty(), "{moves:?}");
        // A stored extent between two trees' places names no tree of its own.
        let stray = Extent {
            offset: 100 * E + 4096,
            ..v.extents[0].clone()
        };
        assert!(
            matches!(a.occupy(&stray), Err(PlacementError::Misaligned { .. })),
            "{stray:?}"
        );
    }

    #[test]
    fn occupy_refuses_overlaps_and_strays() {
        let mut a = cluster(&["a"], 4);
        let e = |offset, length| Extent {
            target: "t0".into(),
            device: "d0".into(),
            offset,
            length,
            member: 0,
            row: 0,
            copy: 0,
        };
        a.occupy(&e(E, E)).unwrap();
        assert!(matches!(
            a.occupy(&e(E, E)),
            Err(PlacementError::Overlap { .. })
        ));
        assert!(matches!(
            a.occupy(&e(E / 2, E)),
            Err(PlacementError::Overlap { .. })
        ));
        assert!(matches!(
            a.occupy(&e(2 * E - 4096, E)),
            Err(PlacementError::Overlap { .. })
        ));
        assert!(matches!(
            a.occupy(&e(3 * E + 4096, E)),
            Err(PlacementError::OutOfBounds { .. })
        ));
        assert!(matches!(
            a.occupy(&e(0, 0)),
            Err(PlacementError::OutOfBounds { .. })
        ));
        assert!(matches!(
            a.occupy(&e(u64::MAX, 2)),
            Err(PlacementError::OutOfBounds { .. })
        ));
        a.occupy(&e(0, E)).unwrap();
        a.occupy(&e(2 * E, E / 2)).unwrap();
        // Free extents are counted on extent boundaries only.
        assert_eq!(
            a.device(&DeviceRef::new("t0", "d0"))
                .unwrap()
                .free_extents(E),
            1
        );
        let mut stray = e(0, E);
        stray.target = "nope".into();
        assert!(matches!(
            a.occupy(&stray),
            Err(PlacementError::UnknownDevice(_))
        ));
        assert!(matches!(
            a.release(&e(0, E / 2)),
            Err(PlacementError::NotAllocated { .. })
        ));
        a.release(&e(0, E)).unwrap();
        assert!(a.release(&e(0, E)).is_err());
        let dup = a.devices()[0].info.clone();
        assert!(matches!(
            a.add_device(dup),
            Err(PlacementError::DuplicateDevice(_))
        ));
        // A half-free aligned slot is skipped: next fit is at 3E.
        let ext = a.allocate(&spec(1, Layout::Concat, 2 * E), E).unwrap();
        let offsets: Vec<u64> = ext.iter().map(|e| e.offset).collect();
        assert_eq!(offsets, [0, 3 * E]);
    }

    #[test]
    fn failure_domain_resolution() {
        let mut t = Target {
            id: "t1".into(),
            name: "host1".into(),
            addr: "127.0.0.1:4420".parse().unwrap(),
            admin_addr: "127.0.0.1:4480".parse().unwrap(),
            labels: BTreeMap::new(),
            devices: vec![],
            registered_ms: 0,
            last_heartbeat_ms: 0,
            state: crate::model::TargetState::Active,
            rdma_addr: None,
            admin_tls: false,
        };
        let mut d = Device {
            id: "d".into(),
            backend: "ram:1G".into(),
            capacity_bytes: E,
            labels: BTreeMap::new(),
        };
        assert_eq!(failure_domain(&t, &d, "rack"), "target=t1");
        t.labels.insert("rack".into(), "r7".into());
        assert_eq!(failure_domain(&t, &d, "rack"), "rack=r7");
        d.labels.insert("rack".into(), "r9".into());
        assert_eq!(failure_domain(&t, &d, "rack"), "rack=r9");
        assert_eq!(failure_domain(&t, &d, "zone"), "target=t1");
    }
}
