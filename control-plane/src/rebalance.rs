//! Moving copies: where a new copy of one extent goes ([`place_copy`]), and
//! which extents to move so the devices of a pool fill evenly
//! ([`plan_rebalance`]). Pure, like [`crate::placement`]: an allocator with
//! every extent occupied and the volumes in, extents and moves out; no
//! store, no clock, no I/O. Running a move (a copy job, [`crate::resync`])
//! is someone else's business.
//!
//! **A new copy** (the destination of a move, or the replacement of a copy
//! whose target is gone) follows the placement rules of
//! docs/ARCHITECTURE.md C6 for one extent — [`place_copy`] picks the
//! device by them, [`place_copy_on`] checks the hard ones on a device
//! picked before (a planned move's):
//!
//! 1. an eligible device: accepting, in the volume's pool, of the volume's
//!    kind (a grain pool for a thin volume, a plain device for a thick one);
//! 2. hard rule: on a target holding no other extent of the row — counting
//!    destinations of copies in flight, and the extent's own current
//!    target, which keeps its copy until the new one is in sync;
//! 3. preferring a failure domain holding no other copy of the same member,
//!    then the domain least used by the row, then the device with the most
//!    free bytes, then the lowest `(target, device)`, as `place_rows` does.
//!
//! **A rebalance plan** is greedy, on a copy of the allocator:
//!
//! ```text
//!   until max_moves, or no move helps:
//!     source ← the fullest device (used / capacity) with an extent that can move
//!     extent ← its first such extent, in (volume, index) order
//!     dest   ← among legal devices where the move strictly lowers Σ c·f²,
//!              the one least full after it, then the lowest (target, device)
//!     simulate: occupy dest at first fit, release the extent from source
//! ```
//!
//! *Legal* is the hard rule above, a device of the extent's own kind — where the sources of moves planned
//! earlier still hold their target, so the moves may run in any order or
//! at once — and a failure domain no worse than the source's: not sharing
//! a domain with another copy of the member unless the source did, nor
//! with more extents of the row. An extent moves at most once per plan,
//! and extents that already have a job (`busy`) never.
//!
//! *Helps*: with `f = used / capacity` and `c = capacity`, a move strictly
//! lowers `Σ c·f² = Σ used² / c` over the devices, computed exactly, so the
//! plan ends even without `max_moves`. For a given total that sum is least
//! when every `f` is equal, whatever the capacities; a move of `L` bytes
//! lowers it exactly when `(used_dest + L/2) / c_dest < (used_src − L/2) /
//! c_src`: the destination, half filled by the move, stays emptier than
//! the source, half emptied. (The plain `Σ f²` would be least with used
//! bytes proportional to `c²`, pushing extents off small devices onto big
//! ones; with equal capacities the two agree.)
//!
//! Only accepting devices of the pool and volumes of the pool take part:
//! draining a cordoned or offline target is another job.

use crate::model::{DeviceRef, Extent, Uuid, Volume};
use crate::placement::{Allocator, DeviceInfo, DeviceSpace, PlacementError};
use nvpool_api::rest::Provisioning;
use serde::Serialize;
use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BTreeSet};

/// Picks and occupies a device for a new copy of `v.extents[slot]`: same
/// member, row and copy, `v.extent_bytes` long, at the first fit.
///
/// `row` is every extent the row holds apart from the slot itself: the
/// volume's other extents of the row and the destinations of copies in
/// flight. The new copy goes to neither their targets nor the slot's own.
/// `NotEnoughTargets` when no eligible target is left outside the row,
/// `NoSpace` when none of those has room; either way nothing is taken.
pub fn place_copy(
    a: &mut Allocator,
    v: &Volume,
    slot: usize,
    row: &[Extent],
) -> Result<Extent, PlacementError> {
    new_copy(a, v, slot, row, None)
}

/// [`place_copy`] on one given device (a planned move's destination), if
/// the hard rules allow it there: `UnknownDevice`, `NotEnoughTargets` when
/// the device is not eligible or its target holds the row already (the
/// plan is stale), `NoSpace` when it is full. The domain preferences were
/// weighed when the device was chosen, so they are not checked again.
pub fn place_copy_on(
    a: &mut Allocator,
    v: &Volume,
    slot: usize,
    row: &[Extent],
    to: &DeviceRef,
) -> Result<Extent, PlacementError> {
    if a.device(to).is_none() {
        return Err(PlacementError::UnknownDevice(to.clone()));
    }
    new_copy(a, v, slot, row, Some(to))
}

/// [`place_copy`], on `only` if given.
fn new_copy(
    a: &mut Allocator,
    v: &Volume,
    slot: usize,
    row: &[Extent],
    only: Option<&DeviceRef>,
) -> Result<Extent, PlacementError> {
    let s = v.extents.get(slot).unwrap_or_else(|| {
        panic!(
            "volume {} has {} extents, no slot {slot}",
            v.uuid,
            v.extents.len()
        )
    });
    assert!(
        row.iter().all(|e| e.row == s.row),
        "a new copy of row {} given extents of another row: {row:?}",
        s.row
    );
    let pool = v.pool.as_deref();
    let thin = a.provisioning_of(v) == Provisioning::Thin;
    let eligible = |d: &DeviceInfo| eligible(d, pool) && d.grain_pool == thin;
    let mut held = RowUse::of(a, row);
    held.hold(&s.target);
    let eligible_targets: BTreeSet<&str> = a
        .devices()
        .iter()
        .filter(|d| eligible(&d.info))
        .map(|d| d.info.target.as_str())
        .collect();
    let held_eligible = eligible_targets.iter().filter(|t| held.holds(t)).count() as u32;
    let mut candidates: Vec<&DeviceSpace> = a
        .devices()
        .iter()
        .filter(|d| eligible(&d.info) && !held.holds(&d.info.target))
        .filter(|d| only.is_none_or(|r| d.info.target == r.target && d.info.device == r.device))
        .collect();
    if candidates.is_empty() {
        return Err(PlacementError::NotEnoughTargets {
            need: held_eligible + 1,
            have: held_eligible,
            pool: pool.map(str::to_owned),
        });
    }
    candidates.sort_by(|x, y| held.rank(x, s.member).cmp(&held.rank(y, s.member)));
    let len = v.extent_bytes;
    let pick = candidates.iter().find_map(|d| {
        let offset = d.first_fit(len)?;
        Some(Extent {
            target: d.info.target.clone(),
            device: d.info.device.clone(),
            offset,
            length: len,
            member: s.member,
            row: s.row,
            copy: s.copy,
        })
    });
    let Some(extent) = pick else {
        return Err(PlacementError::NoSpace {
            need: held_eligible + 1,
            have: held_eligible,
            extent_bytes: len,
            pool: pool.map(str::to_owned),
        });
    };
    a.occupy(&extent).expect("first_fit found a free extent");
    Ok(extent)
}

/// One planned move: copy `volume`'s extent `extent` (its index in
/// `Volume::extents`) from one device to another, then drop the source.
/// The new extent is placed with [`place_copy_on`] `to`, which checks the
/// plan against the state of the moment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Move {
    pub volume: Uuid,
    pub extent: u32,
    pub from: DeviceRef,
    pub to: DeviceRef,
    pub bytes: u64,
}

/// Plans up to `max_moves` moves that even out how full the accepting
/// devices of `pool` are, as the module doc describes.
///
/// `a` has every extent occupied, the destinations of copies in flight
/// included; `in_flight` names those destinations with their volume (they
/// hold their target in their row); `busy` lists `(volume, extent index)`
/// pairs that already have a job. Volumes of other pools are ignored.
/// Deterministic: the same inputs, in any order, give the same plan.
pub fn plan_rebalance(
    a: &Allocator,
    volumes: &[&Volume],
    in_flight: &[(Uuid, Extent)],
    busy: &BTreeSet<(Uuid, u32)>,
    pool: Option<&str>,
    max_moves: usize,
) -> Vec<Move> {
    let mut sim = Sim::new(a, volumes, in_flight, busy, pool);
    let mut moves = Vec::new();
    while moves.len() < max_moves {
        let Some(step) = sim.best_move() else {
            break;
        };
        moves.push(sim.apply(step));
    }
    moves
}

/// How full one device is before and after a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceBalance {
    pub device: DeviceRef,
    pub capacity_bytes: u64,
    pub used_bytes_before: u64,
    pub used_bytes_after: u64,
}

/// Usage of the accepting devices of `pool` once `moves` are done, in
/// `(target, device)` order. Panics if the moves were not planned on `a`
/// for that pool.
pub fn usage_after(a: &Allocator, moves: &[Move], pool: Option<&str>) -> Vec<DeviceBalance> {
    let mut usage: BTreeMap<DeviceRef, DeviceBalance> = a
        .devices()
        .iter()
        .filter(|d| eligible(&d.info, pool))
        .map(|d| {
            let r = DeviceRef::new(&d.info.target, &d.info.device);
            let b = DeviceBalance {
                device: r.clone(),
                capacity_bytes: d.info.capacity_bytes,
                used_bytes_before: d.used_bytes(),
                used_bytes_after: d.used_bytes(),
            };
            (r, b)
        })
        .collect();
    for m in moves {
        let stale = || format!("move {m:?} was not planned on this allocator for pool {pool:?}");
        let from = usage
            .get_mut(&m.from)
            .unwrap_or_else(|| panic!("{}", stale()));
        from.used_bytes_after = from
            .used_bytes_after
            .checked_sub(m.bytes)
            .unwrap_or_else(|| panic!("{}", stale()));
        let to = usage
            .get_mut(&m.to)
            .unwrap_or_else(|| panic!("{}", stale()));
        to.used_bytes_after += m.bytes;
        let space = a.device(&m.to).map_or(0, DeviceSpace::space_bytes);
        assert!(to.used_bytes_after <= space, "{m:?} overfills");
    }
    usage.into_values().collect()
}

/// The bytes a plan copies, and how long it takes at `rate_bytes_per_sec`
/// per copy with `parallel` copies at once, rounded up to whole seconds
/// (0 when the rate is unknown, 0; `parallel` 0 counts as 1).
pub fn describe(moves: &[Move], rate_bytes_per_sec: u64, parallel: usize) -> (u64, u64) {
    let total = moves.iter().fold(0u64, |t, m| t.saturating_add(m.bytes));
    if rate_bytes_per_sec == 0 {
        return (total, 0);
    }
    let per_sec = u128::from(rate_bytes_per_sec) * parallel.max(1) as u128;
    let eta = u128::from(total).div_ceil(per_sec);
    (total, u64::try_from(eta).expect("at most total seconds"))
}

/// Whether a device may take new extents of a volume of `pool`.
fn eligible(d: &DeviceInfo, pool: Option<&str>) -> bool {
    d.accepting && d.pool.as_deref() == pool
}

/// The failure domain of an extent's device; an extent on a device the
/// allocator does not know (its target was removed) is in its target's own
/// domain, as an unlabelled target is.
fn extent_domain(a: &Allocator, e: &Extent) -> String {
    a.device(&e.device_ref())
        .map_or_else(|| format!("target={}", e.target), |d| d.info.domain.clone())
}

/// What the rest of a row holds, as the placement rules see it: the
/// targets a new extent of the row may not use, and how the row's extents
/// spread over failure domains.
#[derive(Debug, Default)]
struct RowUse {
    /// Targets holding an extent of the row, or otherwise excluded.
    targets: BTreeSet<String>,
    /// Domain → extents of the row in it.
    domains: BTreeMap<String, u32>,
    /// Member → domains holding one of its copies.
    member_domains: BTreeMap<u32, BTreeSet<String>>,
}

impl RowUse {
    fn of<'e>(a: &Allocator, extents: impl IntoIterator<Item = &'e Extent>) -> RowUse {
        let mut row = RowUse::default();
        for e in extents {
            row.add(&e.target, &extent_domain(a, e), e.member);
        }
        row
    }

    /// Counts an extent of `member` on `target` in `domain`.
    fn add(&mut self, target: &str, domain: &str, member: u32) {
        self.hold(target);
        *self.domains.entry(domain.to_owned()).or_default() += 1;
        self.member_domains
            .entry(member)
            .or_default()
            .insert(domain.to_owned());
    }

    /// Excludes a target without counting an extent in its domain.
    fn hold(&mut self, target: &str) {
        self.targets.insert(target.to_owned());
    }

    fn holds(&self, target: &str) -> bool {
        self.targets.contains(target)
    }

    /// How good `domain` is for a copy of `member`, smaller is better:
    /// whether it already holds a copy of the member, then how many
    /// extents of the row it holds.
    fn domain_rank(&self, domain: &str, member: u32) -> (bool, u32) {
        (
            self.member_domains
                .get(&member)
                .is_some_and(|d| d.contains(domain)),
            self.domains.get(domain).copied().unwrap_or(0),
        )
    }

    /// The full candidate order of C6: domain rank, most free bytes, then
    /// the lowest `(target, device)`.
    fn rank<'d>(
        &self,
        d: &'d DeviceSpace,
        member: u32,
    ) -> (bool, u32, Reverse<u64>, &'d str, &'d str) {
        let (shared, used) = self.domain_rank(&d.info.domain, member);
        (
            shared,
            used,
            Reverse(d.free_bytes()),
            &d.info.target,
            &d.info.device,
        )
    }
}

/// Compares `n1 / d1` with `n2 / d2` exactly (denominators positive).
fn cmp_fractions((n1, d1): (u64, u64), (n2, d2): (u64, u64)) -> Ordering {
    (u128::from(n1) * u128::from(d2)).cmp(&(u128::from(n2) * u128::from(d1)))
}

/// `a × b` as `(high, low)` 128-bit halves, which compare as the product.
fn mul_wide(a: u128, b: u128) -> (u128, u128) {
    const LOW: u128 = u64::MAX as u128;
    let (a1, a0) = (a >> 64, a & LOW);
    let (b1, b0) = (b >> 64, b & LOW);
    let (p00, p01, p10, p11) = (a0 * b0, a0 * b1, a1 * b0, a1 * b1);
    // Below 3 × 2⁶⁴: no overflow.
    let mid = (p00 >> 64) + (p01 & LOW) + (p10 & LOW);
    let low = (p00 & LOW) | ((mid & LOW) << 64);
    let high = p11 + (p01 >> 64) + (p10 >> 64) + (mid >> 64);
    (high, low)
}

/// Whether moving `len` bytes from a device (`us` used of `cs`) to another
/// (`ud` of `cd`) strictly lowers `us²/cs + ud²/cd`. Multiplied out by
/// `cs cd / len`, that is `cd (2us − len) > cs (2ud + len)`: up to 2¹²⁹, so
/// compared in 256 bits.
fn helps(us: u64, cs: u64, ud: u64, cd: u64, len: u64) -> bool {
    let (us, cs, ud, cd, len) = (
        u128::from(us),
        u128::from(cs),
        u128::from(ud),
        u128::from(cd),
        u128::from(len),
    );
    assert!(len > 0 && us >= len, "the source holds the extent");
    mul_wide(cd, 2 * us - len) > mul_wide(cs, 2 * ud + len)
}

/// A move chosen but not yet applied.
#[derive(Debug)]
struct Step {
    volume: usize,
    extent: usize,
    to: DeviceRef,
    offset: u64,
}

/// The state a plan is computed on: where every extent of the pool's
/// volumes is once the moves planned so far are done.
#[derive(Debug)]
struct Sim<'v> {
    a: Allocator,
    /// Accepting devices of the pool with a capacity.
    scope: Vec<DeviceRef>,
    /// The pool's volumes, by UUID.
    volumes: Vec<&'v Volume>,
    /// `extents[v][i]`: where extent `i` of `volumes[v]` is.
    extents: Vec<Vec<Extent>>,
    /// Per device of the scope, the extents on it that may still move.
    movable: BTreeMap<DeviceRef, BTreeSet<(usize, usize)>>,
    /// `(volume uuid, row)` → destinations of copies in flight.
    in_flight: BTreeMap<(Uuid, u32), Vec<&'v Extent>>,
    /// `(volume, row)` → targets that moves planned so far copy from.
    vacated: BTreeMap<(usize, u32), Vec<String>>,
}

impl<'v> Sim<'v> {
    fn new(
        a: &Allocator,
        volumes: &[&'v Volume],
        in_flight: &'v [(Uuid, Extent)],
        busy: &BTreeSet<(Uuid, u32)>,
        pool: Option<&str>,
    ) -> Sim<'v> {
        let scope: Vec<DeviceRef> = a
            .devices()
            .iter()
            .filter(|d| eligible(&d.info, pool) && d.info.capacity_bytes > 0)
            .map(|d| DeviceRef::new(&d.info.target, &d.info.device))
            .collect();
        let mut volumes: Vec<&Volume> = volumes
            .iter()
            .copied()
            .filter(|v| v.pool.as_deref() == pool)
            .collect();
        volumes.sort_by_key(|v| v.uuid);
        let mut movable: BTreeMap<DeviceRef, BTreeSet<(usize, usize)>> =
            scope.iter().map(|r| (r.clone(), BTreeSet::new())).collect();
        for (vi, v) in volumes.iter().enumerate() {
            for (i, e) in v.extents.iter().enumerate() {
                let index = u32::try_from(i).expect("at most EXTENTS_PER_VOLUME_MAX extents");
                if busy.contains(&(v.uuid, index)) {
                    continue;
                }
                if let Some(on) = movable.get_mut(&e.device_ref()) {
                    on.insert((vi, i));
                }
            }
        }
        let mut flying: BTreeMap<(Uuid, u32), Vec<&Extent>> = BTreeMap::new();
        for (uuid, e) in in_flight {
            flying.entry((*uuid, e.row)).or_default().push(e);
        }
        Sim {
            a: a.clone(),
            scope,
            extents: volumes.iter().map(|v| v.extents.clone()).collect(),
            volumes,
            movable,
            in_flight: flying,
            vacated: BTreeMap::new(),
        }
    }

    fn device(&self, r: &DeviceRef) -> &DeviceSpace {
        self.a.device(r).expect("the scope lists known devices")
    }

    fn fraction(&self, r: &DeviceRef) -> (u64, u64) {
        let d = self.device(r);
        (d.used_bytes(), d.info.capacity_bytes)
    }

    /// The row of extent `i` of volume `vi` without it, the extent's own
    /// target and the sources of moves planned in the row held.
    fn row_use(&self, vi: usize, i: usize) -> RowUse {
        let v = self.volumes[vi];
        let extents = &self.extents[vi];
        let e = &extents[i];
        let per_row = v.layout.extents_per_row() as usize;
        let start = i / per_row * per_row;
        let row = &extents[start..(start + per_row).min(extents.len())];
        assert!(
            row.iter().all(|x| x.row == e.row),
            "volume {} is not in canonical (row, member, copy) order",
            v.uuid
        );
        let others = row
            .iter()
            .enumerate()
            .filter(|&(j, _)| start + j != i)
            .map(|(_, x)| x)
            .chain(
                self.in_flight
                    .get(&(v.uuid, e.row))
                    .into_iter()
                    .flatten()
                    .copied(),
            );
        let mut used = RowUse::of(&self.a, others);
        used.hold(&e.target);
        for t in self.vacated.get(&(vi, e.row)).into_iter().flatten() {
            used.hold(t);
        }
        used
    }

    /// The best legal destination of one extent, if a move there helps.
    fn destination(&self, vi: usize, i: usize) -> Option<Step> {
        let e = &self.extents[vi][i];
        let len = self.volumes[vi].extent_bytes;
        let src = self.device(&e.device_ref());
        let (us, cs) = (src.used_bytes(), src.info.capacity_bytes);
        let used = self.row_use(vi, i);
        let worst = used.domain_rank(&src.info.domain, e.member);
        self.scope
            .iter()
            .filter_map(|r| {
                let d = self.device(r);
                let legal = d.info.grain_pool == src.info.grain_pool
                    && !used.holds(&d.info.target)
                    && used.domain_rank(&d.info.domain, e.member) <= worst;
                if !legal || !helps(us, cs, d.used_bytes(), d.info.capacity_bytes, len) {
                    return None;
                }
                let offset = d.first_fit(len)?;
                Some((d.used_bytes() + len, d.info.capacity_bytes, r, offset))
            })
            .min_by(|x, y| cmp_fractions((x.0, x.1), (y.0, y.1)).then_with(|| x.2.cmp(y.2)))
            .map(|(_, _, to, offset)| Step {
                volume: vi,
                extent: i,
                to: to.clone(),
                offset,
            })
    }

    /// The next move: from the fullest device that has one that helps.
    fn best_move(&self) -> Option<Step> {
        let mut sources: Vec<&DeviceRef> = self
            .movable
            .iter()
            .filter(|(_, on)| !on.is_empty())
            .map(|(r, _)| r)
            .collect();
        sources.sort_by(|x, y| {
            cmp_fractions(self.fraction(y), self.fraction(x)).then_with(|| x.cmp(y))
        });
        sources.into_iter().find_map(|r| {
            // Whether any device at all would take `len` bytes from `r`
            // with profit, by extent size: skips, without weighing each
            // extent's row, the sources nothing can help (all of them, on
            // the round that ends the plan).
            let mut worth: BTreeMap<u64, bool> = BTreeMap::new();
            self.movable[r].iter().find_map(|&(vi, i)| {
                let len = self.volumes[vi].extent_bytes;
                let worth = *worth.entry(len).or_insert_with(|| self.could_help(r, len));
                if worth {
                    self.destination(vi, i)
                } else {
                    None
                }
            })
        })
    }

    /// Whether moving `len` bytes from `from` to some other device of the
    /// scope with room helps, rules of the row aside.
    fn could_help(&self, from: &DeviceRef, len: u64) -> bool {
        let (us, cs) = self.fraction(from);
        let thin = self.device(from).info.grain_pool;
        self.scope.iter().filter(|&r| r != from).any(|r| {
            let d = self.device(r);
            d.info.grain_pool == thin
                && d.free_bytes() >= len
                && helps(us, cs, d.used_bytes(), d.info.capacity_bytes, len)
        })
    }

    fn apply(&mut self, step: Step) -> Move {
        let v = self.volumes[step.volume];
        let old = self.extents[step.volume][step.extent].clone();
        let new = Extent {
            target: step.to.target.clone(),
            device: step.to.device.clone(),
            offset: step.offset,
            length: v.extent_bytes,
            ..old.clone()
        };
        self.a.occupy(&new).expect("first_fit found a free extent");
        self.a
            .release(&old)
            .expect("the allocator holds every extent");
        let from = old.device_ref();
        let moved = self
            .movable
            .get_mut(&from)
            .is_some_and(|on| on.remove(&(step.volume, step.extent)));
        assert!(moved, "only movable extents move");
        self.vacated
            .entry((step.volume, old.row))
            .or_default()
            .push(old.target);
        self.extents[step.volume][step.extent] = new;
        Move {
            volume: v.uuid,
            extent: u32::try_from(step.extent).expect("at most EXTENTS_PER_VOLUME_MAX extents"),
            from,
            to: step.to,
            bytes: v.extent_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::EXTENT_BYTES_MIN;
    use crate::model::{Layout, VolumeSpec};
    use proptest::prelude::*;

    const E: u64 = EXTENT_BYTES_MIN;

    fn info(target: &str, rack: Option<&str>, extents: u64, pool: Option<&str>) -> DeviceInfo {
        DeviceInfo {
            target: target.into(),
            device: "d0".into(),
            capacity_bytes: extents * E,
            grain_pool: false,
            domain: match rack {
                Some(r) => format!("rack={r}"),
                None => format!("target={target}"),
            },
            pool: pool.map(str::to_owned),
            accepting: true,
        }
    }

    /// Targets t0… with one device of `extents` extents each, target i in
    /// rack `racks[i]`.
    fn cluster(racks: &[&str], extents: u64) -> Allocator {
        let mut a = Allocator::new();
        for (i, rack) in racks.iter().enumerate() {
            a.add_device(info(&format!("t{i}"), Some(rack), extents, None))
                .unwrap();
        }
        a
    }

    /// Creates a volume of `rows` rows through the allocator.
    fn create(a: &mut Allocator, n: u8, layout: Layout, rows: u64, pool: Option<&str>) -> Volume {
        let spec = VolumeSpec {
            uuid: Uuid([n; 16]),
            name: format!("v{n}"),
            size_bytes: rows * u64::from(layout.width()) * E,
            layout,
            pool: pool.map(str::to_owned),
        };
        let extents = a.allocate(&spec, E).unwrap();
        let v = Volume {
            uuid: spec.uuid,
            name: spec.name,
            size_bytes: spec.size_bytes,
            layout,
            pool: spec.pool,
            extent_bytes: E,
            extents,
            created_ms: 0,
        };
        v.validate().unwrap();
        v
    }

    /// Occupies `n` filler extents on `target`'s d0, after what is there.
    fn fill(a: &mut Allocator, target: &str, n: u64) {
        for _ in 0..n {
            let d = a.device(&DeviceRef::new(target, "d0")).unwrap();
            let offset = d.first_fit(E).unwrap();
            a.occupy(&Extent {
                target: target.into(),
                device: "d0".into(),
                offset,
                length: E,
                member: 0,
                row: 0,
                copy: 0,
            })
            .unwrap();
        }
    }

    fn domain(a: &Allocator, e: &Extent) -> String {
        a.device(&e.device_ref()).unwrap().info.domain.clone()
    }

    fn raid10() -> Layout {
        Layout::Raid10 {
            stripe_bytes: 4096,
            width: 2,
            copies: 2,
        }
    }

    const RAID1: Layout = Layout::Raid1 { copies: 2 };

    /// Used fractions of the accepting devices of `pool`.
    fn fractions(a: &Allocator, pool: Option<&str>) -> Vec<f64> {
        a.devices()
            .iter()
            .filter(|d| eligible(&d.info, pool))
            .map(|d| d.used_bytes() as f64 / d.info.capacity_bytes as f64)
            .collect()
    }

    fn spread(a: &Allocator, pool: Option<&str>) -> f64 {
        let f = fractions(a, pool);
        let max = f.iter().copied().fold(f64::MIN, f64::max);
        let min = f.iter().copied().fold(f64::MAX, f64::min);
        max - min
    }

    /// As even as whole extents allow: no two devices further apart than
    /// half an extent of each (the end of a plan where rows never stand
    /// in the way).
    fn assert_even(a: &Allocator, pool: Option<&str>) {
        let devices: Vec<&DeviceSpace> = a
            .devices()
            .iter()
            .filter(|d| eligible(&d.info, pool))
            .collect();
        let f = |d: &DeviceSpace| d.used_bytes() as f64 / d.info.capacity_bytes as f64;
        let half = |d: &DeviceSpace| E as f64 / 2.0 / d.info.capacity_bytes as f64;
        for s in &devices {
            for d in &devices {
                assert!(
                    f(s) - f(d) <= half(s) + half(d) + 1e-9,
                    "{} at {} and {} at {}",
                    s.info.target,
                    f(s),
                    d.info.target,
                    f(d)
                );
            }
        }
    }

    /// `Σ used² / capacity`, in extents.
    fn potential(a: &Allocator, pool: Option<&str>) -> f64 {
        a.devices()
            .iter()
            .filter(|d| eligible(&d.info, pool))
            .map(|d| (d.used_bytes() / E).pow(2) as f64 / (d.info.capacity_bytes / E) as f64)
            .sum()
    }

    /// Runs `moves` one at a time on copies of the allocator and volumes
    /// and checks every rule after each; returns the final state.
    fn replay(
        a: &Allocator,
        volumes: &[&Volume],
        in_flight: &[(Uuid, Extent)],
        busy: &BTreeSet<(Uuid, u32)>,
        pool: Option<&str>,
        moves: &[Move],
    ) -> (Allocator, Vec<Volume>) {
        let mut a = a.clone();
        let mut vols: Vec<Volume> = volumes.iter().map(|&v| v.clone()).collect();
        let mut moved = BTreeSet::new();
        // (volume, row) → targets copied from so far: still holding the
        // old copy while the moves run.
        let mut vacated: BTreeMap<(Uuid, u32), BTreeSet<String>> = BTreeMap::new();
        for m in moves {
            let key = (m.volume, m.extent);
            assert!(!busy.contains(&key), "{m:?} moves a busy extent");
            assert!(moved.insert(key), "{m:?} moves an extent twice");
            let v = vols.iter_mut().find(|v| v.uuid == m.volume).unwrap();
            assert_eq!(v.pool.as_deref(), pool, "{m:?} is out of the pool");
            let i = m.extent as usize;
            let old = v.extents[i].clone();
            assert_eq!(old.device_ref(), m.from);
            assert_eq!(m.bytes, v.extent_bytes);
            let to = a.device(&m.to).unwrap();
            assert!(eligible(&to.info, pool), "{m:?} to an ineligible device");
            let new = Extent {
                target: m.to.target.clone(),
                device: m.to.device.clone(),
                offset: to.first_fit(E).expect("the destination has room"),
                ..old.clone()
            };
            // Failure domain no worse than before, against the rest of
            // the row (in-flight copies included).
            let others: Vec<&Extent> = v
                .extents
                .iter()
                .enumerate()
                .filter(|&(j, e)| j != i && e.row == old.row)
                .map(|(_, e)| e)
                .chain(
                    in_flight
                        .iter()
                        .filter(|(u, e)| *u == m.volume && e.row == old.row)
                        .map(|(_, e)| e),
                )
                .collect();
            let rank = |dom: &str| {
                let shared = others
                    .iter()
                    .any(|e| e.member == old.member && domain(&a, e) == dom);
                let count = others.iter().filter(|e| domain(&a, e) == dom).count();
                (shared, count)
            };
            assert!(
                rank(&domain(&a, &new)) <= rank(&domain(&a, &old)),
                "{m:?} worsens the failure domain"
            );
            // Hard rule, with every old copy and in-flight copy held.
            let held = vacated.entry((m.volume, old.row)).or_default();
            held.insert(old.target.clone());
            assert!(
                others.iter().all(|e| e.target != new.target) && !held.contains(&new.target),
                "{m:?} puts two extents of row {} on {}",
                old.row,
                new.target
            );
            let before = potential(&a, pool);
            a.occupy(&new).unwrap();
            a.release(&old).unwrap();
            assert!(
                potential(&a, pool) < before,
                "{m:?} does not lower Σ used² / capacity"
            );
            v.extents[i] = new;
            v.validate().unwrap();
        }
        (a, vols)
    }

    #[test]
    fn place_copy_keeps_the_row_on_distinct_targets() {
        let mut a = cluster(&["a", "b", "c", "d", "e", "f"], 8);
        let v = create(&mut a, 1, raid10(), 2, None);
        for slot in 0..v.extents.len() {
            let e = &v.extents[slot];
            let row: Vec<Extent> = v
                .extents
                .iter()
                .enumerate()
                .filter(|&(j, x)| j != slot && x.row == e.row)
                .map(|(_, x)| x.clone())
                .collect();
            let mut b = a.clone();
            let new = place_copy(&mut b, &v, slot, &row).unwrap();
            assert_eq!((new.member, new.row, new.copy), (e.member, e.row, e.copy));
            assert_eq!(new.length, E);
            assert_ne!(new.target, e.target, "not on the slot's own target");
            assert!(row.iter().all(|x| x.target != new.target), "{new:?}");
            let d = b.device(&new.device_ref()).unwrap();
            assert_eq!(
                d.used_bytes(),
                a.device(&new.device_ref()).unwrap().used_bytes() + E
            );
            // Four of six targets hold the row with the slot; the two left
            // are equally free, in racks of their own: the lower one.
            let left: BTreeSet<String> = (0..6)
                .map(|t| format!("t{t}"))
                .filter(|t| *t != e.target && row.iter().all(|x| x.target != *t))
                .collect();
            assert_eq!(left.len(), 2);
            assert_eq!(Some(&new.target), left.first(), "{new:?}");
        }
    }

    #[test]
    fn place_copy_prefers_free_domains_then_free_space() {
        // t0, t1 in rack a; t2, t3 in b; t4, t5 in c.
        let mut a = cluster(&["a", "a", "b", "b", "c", "c"], 8);
        let v = create(&mut a, 1, RAID1, 1, None);
        let targets: Vec<&str> = v.extents.iter().map(|e| e.target.as_str()).collect();
        assert_eq!(targets, ["t0", "t2"]);
        let row = [v.extents[1].clone()];
        // Rack b holds the other copy: t3 is last although emptiest.
        fill(&mut a, "t1", 3);
        fill(&mut a, "t4", 2);
        fill(&mut a, "t5", 2);
        let new = place_copy(&mut a.clone(), &v, 0, &row).unwrap();
        assert_eq!(new.target, "t4", "rack c, most free, then lowest target");
        fill(&mut a, "t4", 2);
        assert_eq!(
            place_copy(&mut a.clone(), &v, 0, &row).unwrap().target,
            "t5"
        );
        // A copy in flight on t5 takes t5 and makes rack c used by the row:
        // rack a (least used), although t1 has less room than t4.
        let mut flying = v.extents[0].clone();
        (flying.target, flying.offset) = ("t5".into(), 2 * E);
        let row = [v.extents[1].clone(), flying];
        let new = place_copy(&mut a, &v, 0, &row).unwrap();
        assert_eq!((new.target.as_str(), new.offset), ("t1", 3 * E));
        assert_eq!(a.device(&new.device_ref()).unwrap().used_bytes(), 4 * E);
    }

    #[test]
    fn place_copy_refuses_without_a_target_or_space() {
        let mut a = cluster(&["a", "b"], 4);
        let v = create(&mut a, 1, RAID1, 1, None);
        let row = [v.extents[1].clone()];
        let before = a.usage(E);
        let err = place_copy(&mut a, &v, 0, &row).unwrap_err();
        assert_eq!(
            err,
            PlacementError::NotEnoughTargets {
                need: 3,
                have: 2,
                pool: None
            }
        );
        // A third target, ineligible (not accepting, or pooled): the same.
        let mut off = info("t2", None, 4, None);
        off.accepting = false;
        a.add_device(off).unwrap();
        a.add_device(info("t3", None, 4, Some("fast"))).unwrap();
        assert!(matches!(
            place_copy(&mut a, &v, 0, &row),
            Err(PlacementError::NotEnoughTargets {
                need: 3,
                have: 2,
                ..
            })
        ));
        // An eligible one that is full: no space.
        a.add_device(info("t4", None, 1, None)).unwrap();
        fill(&mut a, "t4", 1);
        let before_t4 = a.usage(E);
        let err = place_copy(&mut a, &v, 0, &row).unwrap_err();
        assert_eq!(
            err,
            PlacementError::NoSpace {
                need: 3,
                have: 2,
                extent_bytes: E,
                pool: None
            }
        );
        assert_eq!(a.usage(E), before_t4, "a refusal takes nothing");
        assert_eq!(before.len() + 3, before_t4.len());
        // With the other copy's target gone, replacing it needs only one.
        let mut lost = v.clone();
        lost.extents[0].target = "gone".into();
        let new = place_copy(&mut a, &lost, 1, &[lost.extents[0].clone()]).unwrap();
        assert_eq!(new.target, "t0");
    }

    #[test]
    fn place_copy_uses_only_eligible_devices() {
        let mut a = Allocator::new();
        for (t, pool, accepting) in [
            ("t0", Some("fast"), true),
            ("t1", Some("fast"), true),
            ("t2", None, true),
            ("t3", Some("slow"), true),
            ("t4", Some("fast"), false),
            ("t5", Some("fast"), true),
        ] {
            let mut d = info(t, None, 8, pool);
            d.accepting = accepting;
            a.add_device(d).unwrap();
        }
        let v = create(&mut a, 1, RAID1, 1, Some("fast"));
        let new = place_copy(&mut a, &v, 0, &[v.extents[1].clone()]).unwrap();
        assert_eq!(new.target, "t5");
    }

    #[test]
    fn place_copy_on_a_given_device_checks_the_hard_rules() {
        let mut a = cluster(&["a", "b", "c", "d"], 2);
        let mut off = info("t4", None, 2, None);
        off.accepting = false;
        a.add_device(off).unwrap();
        let v = create(&mut a, 1, RAID1, 1, None);
        let row = [v.extents[1].clone()];
        let on = |t: &str| DeviceRef::new(t, "d0");
        // t3 is not where place_copy would go (t2), but it is legal.
        assert_eq!(
            place_copy(&mut a.clone(), &v, 0, &row).unwrap().target,
            "t2"
        );
        let new = place_copy_on(&mut a, &v, 0, &row, &on("t3")).unwrap();
        assert_eq!((new.target.as_str(), new.offset, new.copy), ("t3", 0, 0));
        let before = a.usage(E);
        for (to, held) in [("t0", "own target"), ("t1", "row"), ("t4", "not accepting")] {
            let err = place_copy_on(&mut a, &v, 0, &row, &on(to)).unwrap_err();
            assert!(
                matches!(err, PlacementError::NotEnoughTargets { .. }),
                "{held}: {err}"
            );
        }
        assert_eq!(
            place_copy_on(&mut a, &v, 0, &row, &on("t9")),
            Err(PlacementError::UnknownDevice(on("t9")))
        );
        fill(&mut a, "t2", 2);
        let before_full = a.usage(E);
        assert!(matches!(
            place_copy_on(&mut a, &v, 0, &row, &on("t2")),
            Err(PlacementError::NoSpace { .. })
        ));
        assert_eq!(a.usage(E), before_full, "a refusal takes nothing");
        assert_ne!(before, before_full);
    }

    /// Four targets about 80 % full with mirrored and striped volumes.
    fn four_full_ish() -> (Allocator, Vec<Volume>) {
        let mut a = cluster(&["a", "b", "c", "d"], 10);
        let vols = vec![
            create(&mut a, 1, RAID1, 6, None),
            create(&mut a, 2, Layout::Concat, 8, None),
            create(&mut a, 3, raid10(), 3, None),
        ];
        (a, vols)
    }

    #[test]
    fn a_new_device_is_filled_until_usage_is_even() {
        let (mut a, vols) = four_full_ish();
        let refs: Vec<&Volume> = vols.iter().collect();
        assert_eq!(fractions(&a, None), [0.8, 0.8, 0.8, 0.8]);
        a.add_device(info("t4", Some("e"), 10, None)).unwrap();
        let busy = BTreeSet::new();
        let moves = plan_rebalance(&a, &refs, &[], &busy, None, usize::MAX);
        assert!(!moves.is_empty());
        assert!(moves.iter().all(|m| m.to.target == "t4"), "{moves:?}");
        let (after, _) = replay(&a, &refs, &[], &busy, None, &moves);
        assert!(
            spread(&after, None) <= 0.1 + 1e-9,
            "{:?}",
            fractions(&after, None)
        );
        assert_even(&after, None);
        assert_eq!(moves.len(), 6, "32 extents over 5 devices: 7, 7, 6, 6, 6");
        // Nothing left to do.
        assert!(plan_rebalance(&after, &refs, &[], &busy, None, 10).is_empty());
        // max_moves bounds the plan, which starts the same way.
        let two = plan_rebalance(&a, &refs, &[], &busy, None, 2);
        assert_eq!(two, moves[..2]);
        // Usage summary matches the replay.
        let usage = usage_after(&a, &moves, None);
        for u in &usage {
            let d = after.device(&u.device).unwrap();
            assert_eq!(u.used_bytes_after, d.used_bytes());
        }
        assert_eq!(usage[4].used_bytes_before, 0);
        assert_eq!(usage[4].used_bytes_after, 6 * E);
    }

    #[test]
    fn moves_keep_rows_on_distinct_targets_and_domains() {
        // Racks a..c, two targets each, full of raid10 and raid1×3; then an
        // empty target in rack a and one in rack c.
        let mut a = cluster(&["a", "a", "b", "b", "c", "c"], 12);
        let vols = [
            create(&mut a, 1, raid10(), 6, None),
            create(&mut a, 2, Layout::Raid1 { copies: 3 }, 8, None),
            create(&mut a, 3, raid10(), 3, None),
        ];
        let refs: Vec<&Volume> = vols.iter().collect();
        a.add_device(info("t6", Some("a"), 12, None)).unwrap();
        a.add_device(info("t7", Some("c"), 24, None)).unwrap();
        let busy = BTreeSet::new();
        let moves = plan_rebalance(&a, &refs, &[], &busy, None, usize::MAX);
        assert!(moves.len() >= 10, "{}", moves.len());
        let (after, vols_after) = replay(&a, &refs, &[], &busy, None, &moves);
        // Copies of a member still in distinct racks, as placed.
        for v in &vols_after {
            for group in v.extents.chunks(usize::from(v.layout.copies())) {
                let racks: BTreeSet<String> = group.iter().map(|e| domain(&after, e)).collect();
                assert_eq!(racks.len(), group.len(), "{group:?}");
            }
        }
        assert!(spread(&after, None) < spread(&a, None));
    }

    #[test]
    fn busy_extents_never_move() {
        let (mut a, vols) = four_full_ish();
        let refs: Vec<&Volume> = vols.iter().collect();
        a.add_device(info("t4", None, 10, None)).unwrap();
        // Everything on t0 and t1 has a job.
        let busy: BTreeSet<(Uuid, u32)> = vols
            .iter()
            .flat_map(|v| {
                v.extents
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| e.target == "t0" || e.target == "t1")
                    .map(|(i, _)| (v.uuid, i as u32))
            })
            .collect();
        let moves = plan_rebalance(&a, &refs, &[], &busy, None, usize::MAX);
        assert!(!moves.is_empty());
        assert!(moves.iter().all(|m| !busy.contains(&(m.volume, m.extent))));
        assert!(moves
            .iter()
            .all(|m| m.from.target == "t2" || m.from.target == "t3"));
        replay(&a, &refs, &[], &busy, None, &moves);
        // All busy: nothing moves.
        let all: BTreeSet<(Uuid, u32)> = vols
            .iter()
            .flat_map(|v| (0..v.extents.len() as u32).map(|i| (v.uuid, i)))
            .collect();
        assert!(plan_rebalance(&a, &refs, &[], &all, None, 100).is_empty());
    }

    #[test]
    fn in_flight_destinations_hold_their_target() {
        let mut a = cluster(&["a", "b", "c", "d"], 10);
        let v = create(&mut a, 1, RAID1, 16, None);
        let refs = [&v];
        a.add_device(info("t4", None, 40, None)).unwrap();
        // Rows 0..8 each have a copy under way to t4.
        let in_flight: Vec<(Uuid, Extent)> = (0..8)
            .map(|row| {
                let mut e = v.copies_of(row, 0)[0].clone();
                (e.target, e.offset) = ("t4".into(), u64::from(row) * E);
                (v.uuid, e)
            })
            .collect();
        for (_, e) in &in_flight {
            a.occupy(e).unwrap();
        }
        let busy = BTreeSet::new();
        let moves = plan_rebalance(&a, &refs, &in_flight, &busy, None, usize::MAX);
        assert!(!moves.is_empty());
        for m in &moves {
            let row = v.extents[m.extent as usize].row;
            assert!(m.to.target != "t4" || row >= 8, "{m:?} of row {row}");
        }
        replay(&a, &refs, &in_flight, &busy, None, &moves);
        // A copy in flight of another volume does not hold the row.
        let other: Vec<(Uuid, Extent)> = in_flight
            .iter()
            .map(|(_, e)| (Uuid([9; 16]), e.clone()))
            .collect();
        let moves = plan_rebalance(&a, &refs, &other, &busy, None, usize::MAX);
        assert!(moves
            .iter()
            .any(|m| m.to.target == "t4" && v.extents[m.extent as usize].row < 8));
        replay(&a, &refs, &other, &busy, None, &moves);
    }

    #[test]
    fn a_balanced_pool_needs_no_moves() {
        let (a, vols) = four_full_ish();
        let refs: Vec<&Volume> = vols.iter().collect();
        let busy = BTreeSet::new();
        assert!(plan_rebalance(&a, &refs, &[], &busy, None, 100).is_empty());
        assert!(plan_rebalance(&a, &refs, &[], &busy, None, 0).is_empty());
        // One extent apart is as even as it gets.
        let mut a = cluster(&["a", "b", "c"], 10);
        let v = create(&mut a, 1, Layout::Concat, 8, None);
        assert!(plan_rebalance(&a, &[&v], &[], &busy, None, 100).is_empty());
        assert!(plan_rebalance(&Allocator::new(), &[], &[], &busy, None, 100).is_empty());
    }

    #[test]
    fn odd_capacities_terminate() {
        let mut a = Allocator::new();
        for (i, extents) in [7, 13, 3, 29, 11, 5].into_iter().enumerate() {
            a.add_device(info(&format!("t{i}"), None, extents, None))
                .unwrap();
        }
        let vols = [
            create(&mut a, 1, RAID1, 7, None),
            create(&mut a, 2, Layout::Concat, 9, None),
            create(&mut a, 3, Layout::Raid1 { copies: 3 }, 4, None),
        ];
        a.add_device(info("t6", None, 17, None)).unwrap();
        a.add_device(info("t7", None, 2, None)).unwrap();
        let refs: Vec<&Volume> = vols.iter().collect();
        let busy = BTreeSet::new();
        let moves = plan_rebalance(&a, &refs, &[], &busy, None, usize::MAX);
        assert!(!moves.is_empty());
        let extents: usize = vols.iter().map(|v| v.extents.len()).sum();
        assert!(moves.len() <= extents);
        let (after, _) = replay(&a, &refs, &[], &busy, None, &moves);
        assert!(spread(&after, None) < spread(&a, None));
        // Planning again from the result finds little or nothing.
        let again = plan_rebalance(&after, &refs, &[], &busy, None, usize::MAX);
        assert!(again.len() < moves.len(), "{again:?}");
        assert_even(&after, None);
        // Small devices took their share too: even the 2-extent one.
        assert!(
            fractions(&after, None).iter().all(|&f| f > 0.3),
            "{:?}",
            fractions(&after, None)
        );
    }

    #[test]
    fn only_the_pool_is_rebalanced() {
        let mut a = Allocator::new();
        for (t, pool) in [
            ("t0", Some("fast")),
            ("t1", Some("fast")),
            ("t2", Some("fast")),
            ("t3", None),
            ("t4", None),
            ("t5", None),
        ] {
            a.add_device(info(t, None, 10, pool)).unwrap();
        }
        let fast = create(&mut a, 1, RAID1, 8, Some("fast"));
        let plain = create(&mut a, 2, RAID1, 8, None);
        for (t, pool, accepting) in [
            ("t6", Some("fast"), true),
            ("t7", None, true),
            ("t8", Some("fast"), false),
            ("t9", Some("slow"), true),
        ] {
            let mut d = info(t, None, 10, pool);
            d.accepting = accepting;
            a.add_device(d).unwrap();
        }
        let refs = [&fast, &plain];
        let busy = BTreeSet::new();
        let moves = plan_rebalance(&a, &refs, &[], &busy, Some("fast"), usize::MAX);
        assert!(!moves.is_empty());
        assert!(moves
            .iter()
            .all(|m| m.volume == fast.uuid && m.to.target == "t6"));
        replay(&a, &refs, &[], &busy, Some("fast"), &moves);
        let moves = plan_rebalance(&a, &refs, &[], &busy, None, usize::MAX);
        assert!(!moves.is_empty());
        assert!(moves
            .iter()
            .all(|m| m.volume == plain.uuid && m.to.target == "t7"));
        replay(&a, &refs, &[], &busy, None, &moves);
        let usage = usage_after(&a, &moves, None);
        let names: Vec<&str> = usage.iter().map(|u| u.device.target.as_str()).collect();
        assert_eq!(names, ["t3", "t4", "t5", "t7"]);
        assert!(plan_rebalance(&a, &refs, &[], &busy, Some("slow"), 9).is_empty());
    }

    #[test]
    fn plans_do_not_depend_on_input_order() {
        let (mut a, vols) = four_full_ish();
        a.add_device(info("t4", None, 10, None)).unwrap();
        let forward: Vec<&Volume> = vols.iter().collect();
        let backward: Vec<&Volume> = vols.iter().rev().collect();
        let busy = BTreeSet::new();
        assert_eq!(
            plan_rebalance(&a, &forward, &[], &busy, None, 100),
            plan_rebalance(&a, &backward, &[], &busy, None, 100)
        );
    }

    #[test]
    fn describe_totals_and_eta() {
        let m = Move {
            volume: Uuid([1; 16]),
            extent: 0,
            from: DeviceRef::new("t0", "d0"),
            to: DeviceRef::new("t1", "d0"),
            bytes: 1 << 30,
        };
        let moves = vec![m.clone(), m.clone(), m];
        assert_eq!(describe(&moves, 256 << 20, 1), (3 << 30, 12));
        assert_eq!(describe(&moves, 256 << 20, 2), (3 << 30, 6));
        assert_eq!(describe(&moves, 1000 << 20, 1), (3 << 30, 4), "rounded up");
        assert_eq!(describe(&moves, 0, 4), (3 << 30, 0), "unknown rate");
        assert_eq!(describe(&moves, 256 << 20, 0), (3 << 30, 12));
        assert_eq!(describe(&[], 1, 1), (0, 0));
        assert_eq!(describe(&moves[..1], u64::MAX, usize::MAX), (1 << 30, 1));
    }

    #[test]
    fn exact_arithmetic_at_the_extremes() {
        assert_eq!(mul_wide(u128::MAX, u128::MAX), (u128::MAX - 1, 1));
        assert_eq!(mul_wide(1 << 64, 1 << 64), (1, 0));
        assert_eq!(mul_wide(u128::MAX, 2), (1, u128::MAX - 1));
        assert_eq!(mul_wide(12345, 678), (0, 12345 * 678));
        let max = u64::MAX;
        assert!(helps(max, max, 0, max, 1 << 30));
        assert!(!helps(1 << 30, max, max - (1 << 30), max, 1 << 30));
        // Equal capacities: helps exactly when more than one extent apart.
        assert!(!helps(3 * E, 10 * E, 2 * E, 10 * E, E));
        assert!(helps(4 * E, 10 * E, 2 * E, 10 * E, E));
        // Unequal: half-way fractions decide. 15/29 → 0/3 helps (1/6 <
        // 14.5/29), which Σ f² would refuse; 10/29 → 1/3 does not.
        assert!(helps(15 * E, 29 * E, 0, 3 * E, E));
        assert!(!helps(10 * E, 29 * E, E, 3 * E, E));
        assert_eq!(cmp_fractions((max, max), (1, 1)), Ordering::Equal);
        assert_eq!(cmp_fractions((max - 1, max), (1, 1)), Ordering::Less);
        // Petabyte devices plan without overflow.
        let mut a = Allocator::new();
        let huge = |t: &str| DeviceInfo {
            capacity_bytes: 1 << 62,
            ..info(t, None, 1, None)
        };
        a.add_device(huge("t0")).unwrap();
        a.add_device(huge("t1")).unwrap();
        let v = create(&mut a, 1, RAID1, 4, None);
        a.add_device(huge("t2")).unwrap();
        let moves = plan_rebalance(&a, &[&v], &[], &BTreeSet::new(), None, 100);
        assert_eq!(moves.len(), 2, "4, 4, 0 extents become 3, 3, 2: {moves:?}");
        replay(&a, &[&v], &[], &BTreeSet::new(), None, &moves);
    }

    fn layouts() -> impl Strategy<Value = Layout> {
        prop_oneof![
            Just(Layout::Concat),
            Just(RAID1),
            Just(Layout::Raid1 { copies: 3 }),
            Just(raid10()),
            Just(Layout::Raid0 {
                stripe_bytes: 4096,
                width: 3
            }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Random clusters (odd capacities, racks or none), random volumes,
        /// empty devices added, some extents busy: every plan ends, stays
        /// legal at every step and lowers Σ used² / capacity with each move.
        #[test]
        fn random_plans_are_legal_and_end(
            devices in prop::collection::vec((1u64..24, prop::option::of(0u8..3)), 3..8),
            volumes in prop::collection::vec((layouts(), 1u64..5), 1..8),
            added in prop::collection::vec(1u64..30, 0..3),
            busy_every in 2usize..9,
            max_moves in prop_oneof![Just(usize::MAX), 0usize..5],
        ) {
            let mut a = Allocator::new();
            for (i, (extents, rack)) in devices.iter().enumerate() {
                let rack = rack.map(|r| r.to_string());
                a.add_device(info(&format!("t{i}"), rack.as_deref(), *extents, None)).unwrap();
            }
            let mut vols = Vec::new();
            for (n, (layout, rows)) in volumes.iter().enumerate() {
                let spec = VolumeSpec {
                    uuid: Uuid([n as u8; 16]),
                    name: format!("v{n}"),
                    size_bytes: rows * u64::from(layout.width()) * E,
                    layout: *layout,
                    pool: None,
                };
                if let Ok(extents) = a.allocate(&spec, E) {
                    vols.push(Volume {
                        uuid: spec.uuid,
                        name: spec.name,
                        size_bytes: spec.size_bytes,
                        layout: *layout,
                        pool: None,
                        extent_bytes: E,
                        extents,
                        created_ms: 0,
                    });
                }
            }
            for (i, extents) in added.iter().enumerate() {
                a.add_device(info(&format!("n{i}"), None, *extents, None)).unwrap();
            }
            let busy: BTreeSet<(Uuid, u32)> = vols
                .iter()
                .flat_map(|v| (0..v.extents.len() as u32).map(|i| (v.uuid, i)))
                .enumerate()
                .filter(|(k, _)| k % busy_every == 0)
                .map(|(_, key)| key)
                .collect();
            let refs: Vec<&Volume> = vols.iter().collect();
            let moves = plan_rebalance(&a, &refs, &[], &busy, None, max_moves);
            prop_assert!(moves.len() <= max_moves);
            let movable: usize = vols.iter().map(|v| v.extents.len()).sum::<usize>() - busy.len();
            prop_assert!(moves.len() <= movable);
            replay(&a, &refs, &[], &busy, None, &moves);
        }
    }
}
