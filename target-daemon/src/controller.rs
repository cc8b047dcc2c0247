//! One NVMe controller: the state a host's admin queue and I/O queues share.
//!
//! A controller lives from the admin-queue Connect until the host shuts it
//! down, its admin connection closes, its keep-alive timer expires, or an
//! admin change removes its access. Queues of one controller may run on
//! different reactors, so the fields are atomics or short-held mutexes; none
//! of them is touched per I/O except the liveness flag and `last_seen_ms`.

use crate::limits;
use crate::peerlog::peer_info;
use crate::target::{Subsystem, TargetRef};
use arc_swap::ArcSwap;
use nvpool_rt::lock;
use nvpool_wire::fabrics::{cc, csts};
use nvpool_wire::log::ErrorEntry;
use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Debug, Default)]
struct Events {
    /// Async event completions (DW0) waiting for an outstanding AER.
    pending: VecDeque<u32>,
    /// Namespaces changed since the host last read log page 04h.
    changed_ns: BTreeSet<u32>,
    /// An NS-changed event is outstanding (masked until log 04h is read).
    ns_event_masked: bool,
    /// An ANA change notice is outstanding (masked until log 0Ch is read
    /// with RAE 0).
    ana_event_masked: bool,
    /// Async Event Configuration (feature 0Bh).
    config: u32,
}

#[derive(Debug, Default)]
struct ErrorLog {
    count: u64,
    entries: VecDeque<ErrorEntry>,
}

#[derive(Debug)]
pub struct Controller {
    pub cntlid: u16,
    pub hostnqn: String,
    pub hostid: [u8; 16],
    pub discovery: bool,
    /// The transport of the association (every queue of it uses this one).
    pub transport: crate::config::Transport,
    pub subsys_nqn: String,
    subsys: ArcSwap<Subsystem>,
    kato_ms: AtomicU32,
    cc: AtomicU32,
    csts: AtomicU32,
    last_seen_ms: AtomicU64,
    dead: AtomicBool,
    io_queues_granted: AtomicU16,
    connected_qids: Mutex<BTreeSet<u16>>,
    events: Mutex<Events>,
    errors: Mutex<ErrorLog>,
    target: TargetRef,
}

/// NS Attribute notices enabled in Async Event Configuration.
pub const AEC_NS_ATTR: u32 = nvpool_wire::log::aec::NS_ATTR;
/// ANA change notices (controllers of subsystems with ANA).
pub const AEC_ANA_CHANGE: u32 = nvpool_wire::log::aec::ANA_CHANGE;
/// Discovery log change notices.
pub const AEC_DISCOVERY: u32 = nvpool_wire::log::aec::DISCOVERY;

impl Controller {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        cntlid: u16,
        subsys: Arc<Subsystem>,
        hostnqn: String,
        hostid: [u8; 16],
        kato_ms: u32,
        discovery: bool,
        transport: crate::config::Transport,
        target: TargetRef,
        now_ms: u64,
    ) -> Controller {
        Controller {
            cntlid,
            hostnqn,
            hostid,
            discovery,
            transport,
            subsys_nqn: subsys.nqn.clone(),
            subsys: ArcSwap::new(subsys),
            kato_ms: AtomicU32::new(kato_ms),
            cc: AtomicU32::new(0),
            csts: AtomicU32::new(0),
            last_seen_ms: AtomicU64::new(now_ms),
            dead: AtomicBool::new(false),
            io_queues_granted: AtomicU16::new(0),
            connected_qids: Mutex::new(BTreeSet::new()),
            events: Mutex::new(Events::default()),
            errors: Mutex::new(ErrorLog::default()),
            target,
        }
    }

    pub fn subsystem(&self) -> arc_swap::Guard<Arc<Subsystem>> {
        self.subsys.load()
    }

    pub(crate) fn set_subsystem(&self, s: Arc<Subsystem>) {
        self.subsys.store(s);
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Ends the controller: every queue connection closes at the next tick.
    pub fn kill(&self, why: &str) {
        if !self.dead.swap(true, Ordering::AcqRel) {
            // Hosts create and drop controllers at will (a reconnect loop).
            peer_info!(cntlid = self.cntlid, subsys = %self.subsys_nqn, host = %self.hostnqn, why, "controller removed");
            if let Some(t) = self.target.upgrade() {
                t.forget_controller(self.cntlid);
            }
        }
    }

    pub fn is_ready(&self) -> bool {
        self.csts.load(Ordering::Acquire) & csts::RDY != 0
    }

    // ----- keep-alive -----

    pub fn kato_ms(&self) -> u32 {
        self.kato_ms.load(Ordering::Relaxed)
    }

    pub fn set_kato_ms(&self, ms: u32) {
        self.kato_ms.store(ms, Ordering::Relaxed);
    }

    pub fn touch(&self, now_ms: u64) {
        self.last_seen_ms.store(now_ms, Ordering::Relaxed);
    }

    /// True when the keep-alive timer ran out.
    pub fn expired(&self, now_ms: u64) -> bool {
        let kato = match self.kato_ms() {
            0 if self.discovery => limits::DISCOVERY_IDLE_TIMEOUT_MS,
            0 => return false,
            k => k as u64,
        };
        now_ms.saturating_sub(self.last_seen_ms.load(Ordering::Relaxed)) > kato
    }

    // ----- properties -----

    pub fn cc(&self) -> u32 {
        self.cc.load(Ordering::Acquire)
    }
    pub fn csts(&self) -> u32 {
        self.csts.load(Ordering::Acquire)
    }

    /// Applies a CC write synchronously, as the spec lets a fabrics
    /// controller do: enable sets RDY at once, shutdown completes at once.
    pub fn write_cc(&self, new: u32, now_ms: u64) {
        let old = self.cc.swap(new, Ordering::AcqRel);
        let mut st = self.csts.load(Ordering::Acquire);
        if new & cc::EN != 0 && old & cc::EN == 0 {
            let iosqes = (new >> cc::IOSQES_SHIFT) & 0xF;
            let iocqes = (new >> cc::IOCQES_SHIFT) & 0xF;
            let mps = (new & cc::MPS_MASK) >> cc::MPS_SHIFT;
            let ams = (new & cc::AMS_MASK) >> cc::AMS_SHIFT;
            let css = (new & cc::CSS_MASK) >> cc::CSS_SHIFT;
            let entries_ok = self.discovery || (iosqes == 6 && iocqes == 4);
            if !entries_ok || mps != 0 || ams != 0 || css != 0 {
                st |= csts::CFS;
            } else {
                st |= csts::RDY;
                self.touch(now_ms);
            }
        }
        if new & cc::EN == 0 && old & cc::EN != 0 {
            st &= !(csts::RDY | csts::CFS);
        }
        let shn = new & cc::SHN_MASK;
        if shn != 0 && old & cc::SHN_MASK == 0 {
            st = (st & !csts::RDY & !csts::SHST_MASK) | csts::SHST_COMPLETE;
            tracing::debug!(cntlid = self.cntlid, "shutdown requested by host");
        } else if shn == 0 {
            st &= !csts::SHST_MASK;
        }
        self.csts.store(st, Ordering::Release);
    }

    // ----- queues -----

    pub fn io_queues_granted(&self) -> u16 {
        self.io_queues_granted.load(Ordering::Relaxed)
    }

    /// Number of Queues: grants up to the limit (and keeps the first grant,
    /// as the feature may be set only once per controller life).
    pub fn grant_io_queues(&self, asked: u16) -> u16 {
        let want = asked.clamp(1, limits::IO_QUEUES_PER_CTRL_MAX);
        match self
            .io_queues_granted
            .compare_exchange(0, want, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => want,
            Err(existing) => existing,
        }
    }

    /// Marks `qid` connected; false if it already is.
    pub fn attach_queue(&self, qid: u16) -> bool {
        lock(&self.connected_qids).insert(qid)
    }

    pub fn detach_queue(&self, qid: u16) {
        lock(&self.connected_qids).remove(&qid);
    }

    pub fn connected_queues(&self) -> Vec<u16> {
        lock(&self.connected_qids).iter().copied().collect()
    }

    // ----- async events -----

    pub fn set_event_config(&self, v: u32) {
        lock(&self.events).config = v;
    }
    pub fn event_config(&self) -> u32 {
        lock(&self.events).config
    }

    pub(crate) fn notify_ns_changed(&self, nsids: &[u32]) {
        let mut ev = lock(&self.events);
        ev.changed_ns.extend(nsids.iter().copied());
        if ev.config & AEC_NS_ATTR != 0 && !ev.ns_event_masked {
            ev.ns_event_masked = true;
            ev.pending.push_back(nvpool_wire::log::AEN_NS_CHANGED);
        }
    }

    pub fn notify_discovery_changed(&self) {
        let mut ev = lock(&self.events);
        if ev.config & AEC_DISCOVERY != 0
            && !ev
                .pending
                .contains(&nvpool_wire::log::AEN_DISCOVERY_CHANGED)
        {
            ev.pending
                .push_back(nvpool_wire::log::AEN_DISCOVERY_CHANGED);
        }
    }

    /// The ANA state this controller reports changed: one notice, if the
    /// host enabled them and has read the log since the last one.
    pub(crate) fn notify_ana_changed(&self) {
        let mut ev = lock(&self.events);
        if ev.config & AEC_ANA_CHANGE != 0 && !ev.ana_event_masked {
            ev.ana_event_masked = true;
            ev.pending.push_back(nvpool_wire::log::AEN_ANA_CHANGED);
        }
    }

    /// The host read the ANA log with RAE 0: the next change notifies again.
    pub fn rearm_ana_event(&self) {
        lock(&self.events).ana_event_masked = false;
    }

    /// The next event to complete an AER with, if any.
    pub fn take_event(&self) -> Option<u32> {
        lock(&self.events).pending.pop_front()
    }

    /// Reads (and, unless `retain`, clears) the changed-namespace list.
    pub fn changed_namespaces(&self, retain: bool) -> Vec<u32> {
        let mut ev = lock(&self.events);
        let v: Vec<u32> = ev.changed_ns.iter().copied().collect();
        if !retain {
            ev.changed_ns.clear();
            ev.ns_event_masked = false;
        }
        v
    }

    // ----- error log -----

    pub fn record_error(&self, mut e: ErrorEntry) {
        let mut log = lock(&self.errors);
        log.count += 1;
        e.error_count = log.count;
        log.entries.push_front(e);
        log.entries.truncate(limits::ERROR_LOG_ENTRIES);
    }

    pub fn error_entries(&self) -> Vec<ErrorEntry> {
        lock(&self.errors).entries.iter().copied().collect()
    }
}
