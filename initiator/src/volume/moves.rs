//! Moving an extent copy to another extent, host side: replacing a dead
//! copy, or moving a live one to another target or device.
//!
//! A move gives one copy slot (a plan extent index) an extra copy for a
//! while, written by every mutation of the slot's row and member besides
//! the group's own copies, and never read:
//!
//! ```text
//!            begin_move(dest)             switch_move                end_move
//!  slot: old ──────────────► old ────────────────────────► dest ─────────────► dest
//!                            + incoming dest                + leaving old
//!                              (taken like Syncing;           (written, results
//!                               dropped on a stray)            ignored)
//! ```
//!
//! The *incoming* copy is the destination while the control plane's copy
//! job fills it. Like a `Syncing` copy it must take exactly what the
//! copies in sync take, and its answers never count; unlike one, when it
//! strays it is dropped and remembered ([`Volume::move_failed`]) rather
//! than failing the slot: the slot's own copy is fine, only the move
//! failed. After the switch the destination is the slot's copy (read and
//! written, `Ok`) and the old one is *leaving*: hosts that have not
//! switched yet still read it, so it takes every mutation until the
//! control plane ends the move; its errors are for those hosts to find.
//!
//! **Shadows.** The incoming and leaving copies of a group's slots are one
//! immutable record ([`Shadows`]) behind one `ArcSwapOption` per group,
//! replaced whole on every change, under the group's lock (the control
//! calls, and a mutation dropping an incoming copy that strayed: rare). A
//! group without moves holds `None`: a mutation there pays one load.
//!
//! **A mutation never writes only one of old and dest.** A mutation takes
//! its view of a group in this order: the shadow record, then each copy's
//! state and, for copies in use, its handle, then the shadow record again;
//! when the two shadow loads differ it starts over. Its states and handles
//! were therefore loaded while one shadow record was current: every load
//! and store involved is `SeqCst` (arc-swap's loads and stores are too), so
//! they sit in one total order, and every change installs a fresh record
//! while the mutation holds the one it loaded, so comparing pointers sees
//! every store. [`Volume::switch_move`] stores, holding the group's lock:
//!
//! 1. shadows := {incoming: dest, leaving: old};
//! 2. the slot's handle := dest, then its state := `Ok`;
//! 3. shadows := {leaving: old}.
//!
//! A view under the record before step 1 has the incoming dest, and its
//! handle was loaded before step 2: old (or none, for a failed copy being
//! replaced, which has nothing to keep). A view under step 1's record
//! names both. A view under step 3's record loaded state and handle after
//! step 2: `Ok` and dest, and the record names old. So every view writes
//! old and dest, during the switch sometimes one of them twice (the same
//! bytes to the same device within one run: harmless). With a single
//! load, a mutation could load the record before step 1 and the handle
//! after step 2, and write dest twice and old never.
//!
//! A first load that finds `None` needs no second one: no switch can be
//! under way. The group had no incoming copy then, and a switch needs one
//! installed by [`Volume::begin_move`] *and drained* (begin_move marks it
//! after its drain; switch_move refuses one not marked). That drain waited
//! for this mutation, which took its drain count before the load, so all
//! of the switch's stores come after the mutation completed. (`None` after
//! a replacement's switch, with no leaving copy, is that switch's end:
//! the state and handle are already dest's.)
//!
//! **begin_move's drain** is begin_sync's: installing the incoming copy is
//! a `SeqCst` store, every mutation loads the shadows after taking its
//! drain count, and drain.rs's argument carries over with the shadow
//! record in place of the copy's state: once begin_move returns, every
//! mutation that did not write dest has completed.
//!
//! **Failures.** A mutation that saw an incoming copy stray drops it only
//! if it is still the slot's incoming copy. If it was switched in
//! meanwhile (the slot's handle is the incoming one), the slot's own copy
//! missed the change and fails like any copy, reported. Conversely a
//! failure on a handle that is no longer the slot's (the old copy, leaving
//! since) fails nothing: `fail_extent` compares handles.

use super::{lock, CopyState, Mark, Table, Volume};
use crate::device::Device;
use crate::error::{Error, IoError};
use crate::limits::SYNC_DRAIN_TIMEOUT;
use arc_swap::ArcSwapOption;
use nvpool_layout::plan::PlanExtent;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// A copy being moved when the volume opens ([`super::VolumeOptions::moving`]):
/// the control plane's record of a move a host must take part in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MovingCopy {
    /// The slot: index in the plan's extents.
    pub extent: usize,
    /// Where the copy goes: the slot's row, member and copy, another
    /// target, device or namespace.
    pub dest: PlanExtent,
    /// Hosts switched to `dest`: it is the slot's copy (read and written)
    /// and the plan's extent is leaving (written only). Otherwise `dest` is
    /// the incoming copy (written only) and the plan's extent the slot's.
    pub switched: bool,
}

/// The destination of a move before the switch.
#[derive(Debug)]
pub(super) struct Incoming {
    pub dest: PlanExtent,
    pub dev: Arc<Device>,
    /// begin_move's drain ended after it was installed: every mutation
    /// that did not write it has completed, so it may be switched in.
    pub drained: AtomicBool,
}

/// The extra copies of one slot.
#[derive(Debug, Clone, Default)]
pub(super) struct Shadow {
    pub incoming: Option<Arc<Incoming>>,
    pub leaving: Option<Arc<Device>>,
}

/// One copy a mutation writes besides the group's own.
#[derive(Debug)]
pub(super) struct Extra {
    /// The slot's copy number in its group.
    pub copy: usize,
    pub dev: Arc<Device>,
    /// `Some` for an incoming copy (checked like a `Syncing` copy), `None`
    /// for a leaving one (results ignored).
    pub incoming: Option<Arc<Incoming>>,
}

/// The extra copies of one group's slots, as mutations see them. Never
/// changed in place: a change stores a new record.
#[derive(Debug)]
pub(super) struct Shadows {
    slots: Vec<Shadow>,
    /// `slots` flattened for the data path, each slot's incoming copy
    /// first.
    pub list: Vec<Extra>,
}

/// The moves of one group (row, member).
#[derive(Debug, Default)]
pub(super) struct GroupMoves {
    /// `None` while no slot of the group has an extra copy.
    pub shadow: ArcSwapOption<Shadows>,
    /// Held to replace `shadow`, and by switch_move across its stores.
    pub edit: Mutex<()>,
}

impl GroupMoves {
    /// Slot `copy`'s extra copies now.
    pub fn get(&self, copy: usize) -> Shadow {
        self.shadow
            .load()
            .as_deref()
            .map(|s| s.slots[copy].clone())
            .unwrap_or_default()
    }

    /// Makes `shadow` slot `copy`'s extra copies (of `copies` in the
    /// group). The caller holds `edit`.
    pub fn set(&self, copies: usize, copy: usize, shadow: Shadow) {
        let mut slots = match &*self.shadow.load() {
            Some(s) => s.slots.clone(),
            None => vec![Shadow::default(); copies],
        };
        slots[copy] = shadow;
        let list: Vec<Extra> = slots
            .iter()
            .enumerate()
            .flat_map(|(c, s)| {
                let incoming = s.incoming.as_ref().map(|i| Extra {
                    copy: c,
                    dev: i.dev.clone(),
                    incoming: Some(i.clone()),
                });
                let leaving = s.leaving.as_ref().map(|d| Extra {
                    copy: c,
                    dev: d.clone(),
                    incoming: None,
                });
                incoming.into_iter().chain(leaving)
            })
            .collect();
        // Back to `None` when nothing is left: the cheap path again.
        let record = (!list.is_empty()).then(|| Arc::new(Shadows { slots, list }));
        self.shadow.store(record);
    }
}

/// Same target, subsystem and namespace: the same copy.
pub(super) fn same_place(a: &PlanExtent, b: &PlanExtent) -> bool {
    (a.addr, &a.subsystem_nqn, a.nsid) == (b.addr, &b.subsystem_nqn, b.nsid)
}

/// Checks a move's destination against the slot's plan extent.
pub(super) fn check_dest(
    volume: &str,
    index: usize,
    slot: &PlanExtent,
    dest: &PlanExtent,
) -> Result<(), Error> {
    if (dest.row, dest.member, dest.copy) != (slot.row, slot.member, slot.copy) {
        return Err(Error::Invalid(format!(
            "{volume}: a move of extent {index} (row {} member {} copy {}) cannot go to \
             row {} member {} copy {}",
            slot.row, slot.member, slot.copy, dest.row, dest.member, dest.copy
        )));
    }
    Ok(())
}

impl Volume {
    /// Blocking; call it from a control thread, never from an I/O callback
    /// or an async task.
    ///
    /// Starts moving copy `index` to `dest` (the slot's row, member and
    /// copy elsewhere): connects a namespace handle to `dest` like
    /// [`Volume::begin_sync`] does (a live controller of this volume or of
    /// its [`super::Connections`], else a new one; the namespace checked as
    /// at open) and installs it as the slot's *incoming* copy: from now on
    /// every write, write-zeroes, discard and flush of the slot's row and
    /// member goes to it as well, it is never read, and its answers never
    /// count. Then waits up to [`SYNC_DRAIN_TIMEOUT`] until every mutation
    /// issued before has completed, so the copy job may start. Works
    /// whether the slot's own copy is in use (a move: it stays read and
    /// written) or failed (a replacement).
    ///
    /// An incoming copy already at `dest` just drains again (a retry after
    /// a timeout is safe); one elsewhere is replaced. Refused for an index
    /// outside the plan or a `dest` that is the copy's current place. When
    /// the incoming copy strays before the drain ends the call fails and
    /// [`Volume::move_failed`] says so.
    pub fn begin_move(&self, index: usize, dest: &PlanExtent) -> Result<(), Error> {
        let t = self.table();
        let Some(x) = t.extents.get(index) else {
            return Err(self.not_in_plan(&t, index));
        };
        check_dest(&t.plan.name, index, &t.plan.extents[index], dest)?;
        if same_place(&x.location.load(), dest) {
            return Err(Error::Invalid(format!(
                "{}: extent {index} is at {} {} namespace {} already",
                t.plan.name, dest.addr, dest.subsystem_nqn, dest.nsid
            )));
        }
        let _one = lock(&self.syncing);
        self.release_lost_controllers();
        let g = &t.groups[index / self.copies].moves;
        let c = index % self.copies;
        let incoming = match g.get(c).incoming {
            Some(i) if i.dest == *dest => i,
            _ => {
                let dev = Arc::new(self.connect_copy(index, dest)?);
                let i = Arc::new(Incoming {
                    dest: dest.clone(),
                    dev,
                    drained: AtomicBool::new(false),
                });
                let _m = lock(&g.edit);
                x.move_failed.store(false, Ordering::SeqCst);
                let mut s = g.get(c);
                s.incoming = Some(i.clone());
                g.set(self.copies, c, s);
                i
            }
        };
        tracing::info!(
            volume = %t.plan.name,
            extent = index,
            target = %dest.target,
            addr = %dest.addr,
            nsid = dest.nsid,
            "extent copy moving; draining"
        );
        if !self.drain.wait(SYNC_DRAIN_TIMEOUT) {
            return Err(Error::Timeout {
                addr: format!("volume {} extent {index}", t.plan.name),
                what: "the writes issued before the move began",
            });
        }
        // A mutation that saw it stray dropped it before the drain ended.
        if x.move_failed.load(Ordering::SeqCst) {
            return Err(Error::Invalid(format!(
                "{}: the destination of extent {index} failed while its move began",
                t.plan.name
            )));
        }
        incoming.drained.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// The incoming copy of slot `index` becomes its copy: reads and writes
    /// use the destination from now on and the slot is [`CopyState::Ok`]
    /// (also when it was failed: a replacement forgets the dead copy and
    /// its missed regions). An old copy in use becomes the slot's
    /// *leaving* copy, still written by every mutation (its results
    /// ignored, its errors silent), never read, until
    /// [`Volume::end_move`]; a leaving copy of an earlier move is dropped.
    ///
    /// Refused when the slot has no incoming copy, or one that failed or
    /// whose [`Volume::begin_move`] did not complete. Waits for a
    /// begin_sync or begin_move under way. Every mutation, however it
    /// interleaves with the switch, writes both the old copy and the
    /// destination (see the module docs).
    pub fn switch_move(&self, index: usize) -> Result<(), Error> {
        let t = self.table();
        let Some(x) = t.extents.get(index) else {
            return Err(self.not_in_plan(&t, index));
        };
        // begin_sync leaves Failed too: one of them at a time.
        let _one = lock(&self.syncing);
        let g = &t.groups[index / self.copies].moves;
        let c = index % self.copies;
        let _m = lock(&g.edit);
        let incoming = match g.get(c).incoming {
            Some(i) if i.drained.load(Ordering::SeqCst) => i,
            Some(_) => {
                return Err(Error::Invalid(format!(
                    "{}: the move of extent {index} has not begun (begin_move did not \
                     complete)",
                    t.plan.name
                )))
            }
            None => {
                let why = if x.move_failed.load(Ordering::SeqCst) {
                    "its destination failed"
                } else {
                    "it is not moving"
                };
                return Err(Error::Invalid(format!(
                    "{}: extent {index} cannot switch: {why}",
                    t.plan.name
                )));
            }
        };
        let _e = lock(&x.edit);
        let old = match x.state() {
            CopyState::Failed => None,
            _ => x.dev.load_full(),
        };
        // The three stores of the module docs, in this order.
        g.set(
            self.copies,
            c,
            Shadow {
                incoming: Some(incoming.clone()),
                leaving: old.clone(),
            },
        );
        // The handle before the state (CopyIo's invariant).
        x.dev.store(Some(incoming.dev.clone()));
        x.location.store(Arc::new(incoming.dest.clone()));
        x.set_state(CopyState::Ok);
        x.missed.store(None);
        g.set(
            self.copies,
            c,
            Shadow {
                incoming: None,
                leaving: old.clone(),
            },
        );
        tracing::info!(
            volume = %t.plan.name,
            extent = index,
            target = %incoming.dest.target,
            addr = %incoming.dest.addr,
            nsid = incoming.dest.nsid,
            leaving = old.is_some(),
            "extent copy switched to its destination"
        );
        Ok(())
    }

    /// Drops the leaving copy of slot `index`: the old extent is written no
    /// more (mutations already issued may still reach it). No-op when there
    /// is none or for an index outside the plan.
    pub fn end_move(&self, index: usize) {
        let t = self.table();
        if index >= t.extents.len() {
            return;
        }
        let g = &t.groups[index / self.copies].moves;
        let c = index % self.copies;
        let _m = lock(&g.edit);
        let mut s = g.get(c);
        if s.leaving.take().is_some() {
            g.set(self.copies, c, s);
            tracing::info!(volume = %t.plan.name, extent = index, "extent copy move ended");
        }
    }

    /// Drops the incoming copy of slot `index` (the move failed or was
    /// cancelled): not written from now on (mutations already issued may
    /// still reach it), and [`Volume::move_failed`] is false again. No-op
    /// when there is none or for an index outside the plan.
    pub fn abort_move(&self, index: usize) {
        let t = self.table();
        let Some(x) = t.extents.get(index) else {
            return;
        };
        let g = &t.groups[index / self.copies].moves;
        let c = index % self.copies;
        let _m = lock(&g.edit);
        x.move_failed.store(false, Ordering::SeqCst);
        let mut s = g.get(c);
        if s.incoming.take().is_some() {
            g.set(self.copies, c, s);
            tracing::info!(volume = %t.plan.name, extent = index, "extent copy move aborted");
        }
    }

    /// The incoming copy of slot `index` strayed (an error, or a change no
    /// copy in sync took) and was dropped; true until the next
    /// [`Volume::begin_move`] or [`Volume::abort_move`] of the slot. False
    /// for an index outside the plan.
    pub fn move_failed(&self, index: usize) -> bool {
        self.table
            .load()
            .extents
            .get(index)
            .is_some_and(|x| x.move_failed.load(Ordering::SeqCst))
    }

    /// Where copy `index` is now: its plan extent, or the destination its
    /// last [`Volume::switch_move`] (or [`super::VolumeOptions::moving`])
    /// switched it to.
    ///
    /// # Panics
    /// If `index` is not an extent of the plan.
    pub fn extent_location(&self, index: usize) -> PlanExtent {
        (**self.table.load().extents[index].location.load()).clone()
    }

    /// Slots of `t` with an incoming copy, ascending.
    pub(super) fn moving_extents(&self, t: &Table) -> Vec<usize> {
        t.groups
            .iter()
            .enumerate()
            .flat_map(|(g, group)| {
                let s = group.moves.shadow.load_full();
                (0..self.copies).filter_map(move |c| {
                    let s = s.as_deref()?;
                    s.slots[c].incoming.as_ref().map(|_| g * self.copies + c)
                })
            })
            .collect()
    }

    /// A mutation found the incoming copy `incoming` of slot `index`
    /// strayed (`error`, `mark` as for a copy in use): dropped when it is
    /// still the slot's incoming copy, the slot failed when it has been
    /// switched in since (its copy missed the change).
    pub(super) fn incoming_strayed(
        &self,
        index: usize,
        incoming: &Arc<Incoming>,
        error: &IoError,
        mark: Mark,
    ) {
        let t = self.table();
        let x = &t.extents[index];
        let g = &t.groups[index / self.copies].moves;
        let c = index % self.copies;
        {
            let _m = lock(&g.edit);
            let mut s = g.get(c);
            if s.incoming
                .as_ref()
                .is_some_and(|i| Arc::ptr_eq(i, incoming))
            {
                s.incoming = None;
                x.move_failed.store(true, Ordering::SeqCst);
                g.set(self.copies, c, s);
                tracing::warn!(
                    volume = %t.plan.name,
                    extent = index,
                    target = %incoming.dest.target,
                    addr = %incoming.dest.addr,
                    nsid = incoming.dest.nsid,
                    error = %error,
                    "destination of an extent copy move failed; no longer written"
                );
                return;
            }
        }
        // Replaced or aborted since: nothing to do; switched in: the
        // slot's copy (fail_extent checks that the handle is still its).
        self.fail_extent(index, &incoming.dev, error, mark);
    }

    /// The leaving copy of slot `index` opened by [`Volume::open`] for a
    /// switched move.
    pub(super) fn open_leaving(&self, index: usize, dev: Device) {
        let t = self.table();
        let g = &t.groups[index / self.copies].moves;
        let c = index % self.copies;
        let _m = lock(&g.edit);
        let mut s = g.get(c);
        s.leaving = Some(Arc::new(dev));
        g.set(self.copies, c, s);
    }

    /// The incoming copy of slot `index` opened by [`Volume::open`]:
    /// nothing was issued before it, so it is drained.
    pub(super) fn open_incoming(&self, index: usize, dest: &PlanExtent, dev: Device) {
        let t = self.table();
        let g = &t.groups[index / self.copies].moves;
        let c = index % self.copies;
        let _m = lock(&g.edit);
        let mut s = g.get(c);
        s.incoming = Some(Arc::new(Incoming {
            dest: dest.clone(),
            dev: Arc::new(dev),
            drained: AtomicBool::new(true),
        }));
        g.set(self.copies, c, s);
    }

    pub(super) fn not_in_plan(&self, t: &Table, index: usize) -> Error {
        Error::Invalid(format!(
            "{}: extent {index} is not in the plan ({} extents)",
            t.plan.name,
            t.extents.len()
        ))
    }
}
