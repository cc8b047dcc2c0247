//! Which control plane acts on its own: one leader among the processes
//! that share a store.
//!
//! Every control plane serves the whole REST API: a request changes the
//! store through conditional transactions, so two processes answering at
//! once stay consistent. Work nobody asked for — reconciling targets,
//! scheduling resyncs and moves, deciding failovers, granting owners their
//! leases — runs on the leader alone, because two processes deciding it at
//! once would undo each other's work (and two processes granting owner
//! leases could let two owners serve one volume).
//!
//! ```text
//!   election thread ── campaign / renew every second ──► Elector (etcd lease on /leader)
//!        │ term: lease, version of /leader, valid until
//!        ▼
//!   Leadership ◄── is_leader() ── heal, reconcile, failover loops; lease grants
//!              ◄── fence()     ── Cluster::commit of a fenced Cluster:
//!                                 every write also requires /leader at the term's version
//! ```
//!
//! - **Election**: the leader key is put under an etcd lease of
//!   [`LEADER_LEASE_TTL_S`] only if it is missing; its `mod_revision` is the
//!   term. The holder renews every [`LEADER_RENEW_INTERVAL_MS`]; the others
//!   try to take the key as often. When the leader dies or is cut off from
//!   etcd, etcd deletes the key when the lease runs out, and the next
//!   campaign wins: a handover takes at most the TTL plus one interval.
//!   A leader that stops cleanly revokes its lease: the handover is then one
//!   interval.
//! - **A deposed leader stops before another can start.** A term is valid
//!   until the time the request that granted or last renewed the lease was
//!   *sent*, plus the TTL, minus [`LEADER_MARGIN_MS`]: etcd counts the TTL
//!   from when it received that request, so the term ends before etcd could
//!   hand the key to anyone else, whatever the network delay. `is_leader`
//!   turns false at that time on its own, even if the election thread hangs.
//! - **Fencing**: a write by the leader's work also conditions on the leader
//!   key's version. A process that lost its term (a pause longer than the
//!   margin, a clock that jumped) cannot commit anything once another
//!   process holds the key: its write fails with `NotLeader` instead.
//! - Side effects outside the store (calls to targets) are checked with
//!   `is_leader` before each round and each target call; what the fence
//!   cannot cover is a call already in flight when the term ends, which the
//!   next leader's reconciliation repairs (target calls are idempotent).
//! - A store only one process can open (redb, memory) has no election: its
//!   process is the leader, always.

use crate::limits::{
    LEADER_CAMPAIGN_INTERVAL_MS, LEADER_LEASE_TTL_S, LEADER_MARGIN_MS, LEADER_RENEW_INTERVAL_MS,
};
use crate::store::{Campaign, Condition, Revision, Store, LEADER_KEY};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// One term of leadership.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Term {
    lease: i64,
    /// The leader key's version: the fencing condition.
    version: Revision,
    /// Acting stops at this instant unless a renewal moves it on.
    valid_until: Instant,
}

/// Whether this process leads, shared by everything that asks.
#[derive(Debug)]
pub struct Leadership {
    /// What this process writes into the leader key (and logs).
    holder: String,
    /// `None` for a store with no election: always the leader.
    term: Option<Mutex<Option<Term>>>,
    /// Terms this process has won (0: none yet); a loop that sees it change
    /// knows a new term began.
    terms: std::sync::atomic::AtomicU64,
}

/// This process is not the leader (or no longer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("this control plane is not the leader")]
pub struct NotLeader;

impl Leadership {
    /// The leader, always: for a store only this process can open.
    pub fn solo(holder: impl Into<String>) -> Arc<Leadership> {
        Arc::new(Leadership {
            holder: holder.into(),
            term: None,
            terms: 1.into(),
        })
    }

    /// Not the leader until [`run`] wins a term.
    pub fn elected(holder: impl Into<String>) -> Arc<Leadership> {
        Arc::new(Leadership {
            holder: holder.into(),
            term: Some(Mutex::new(None)),
            terms: 0.into(),
        })
    }

    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// Whether this process is elected at all (false: it is the only one).
    pub fn is_elected(&self) -> bool {
        self.term.is_some()
    }

    fn current(&self) -> Option<Term> {
        let term = self.term.as_ref()?;
        let t = *term.lock().unwrap_or_else(PoisonError::into_inner);
        t.filter(|t| Instant::now() < t.valid_until)
    }

    /// True while this process may act as the leader.
    pub fn is_leader(&self) -> bool {
        self.term.is_none() || self.current().is_some()
    }

    /// How many terms this process has won: a change means a new term (the
    /// first with no election counts as 1).
    pub fn terms(&self) -> u64 {
        self.terms.load(Ordering::Relaxed)
    }

    /// The condition every write of the leader's work carries: `None` with
    /// no election; `NotLeader` outside a term.
    pub fn fence(&self) -> Result<Option<Condition>, NotLeader> {
        if self.term.is_none() {
            return Ok(None);
        }
        let t = self.current().ok_or(NotLeader)?;
        Ok(Some(Condition::VersionIs(LEADER_KEY.to_owned(), t.version)))
    }

    /// A fenced write failed its fence: the key moved on, the term is over.
    pub fn lost(&self, version: Revision) {
        if let Some(term) = &self.term {
            let mut t = term.lock().unwrap_or_else(PoisonError::into_inner);
            if t.is_some_and(|t| t.version == version) {
                tracing::warn!(holder = %self.holder, "lost the leadership: the leader key moved on");
                *t = None;
            }
        }
    }

    /// Begins a term won by a campaign whose request was sent at `sent`
    /// (the election loop does this; tests that campaign by hand too).
    pub fn begin(&self, lease: i64, version: Revision, sent: Instant) {
        self.terms.fetch_add(1, Ordering::Relaxed);
        self.set(Some(Term {
            lease,
            version,
            valid_until: valid_from(sent),
        }));
    }

    fn set(&self, term: Option<Term>) {
        if let Some(slot) = &self.term {
            *slot.lock().unwrap_or_else(PoisonError::into_inner) = term;
        }
    }

    fn held(&self) -> Option<Term> {
        let slot = self.term.as_ref()?;
        *slot.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The end of a term granted or renewed by a request sent at `sent`.
fn valid_from(sent: Instant) -> Instant {
    sent + Duration::from_secs(u64::from(LEADER_LEASE_TTL_S))
        - Duration::from_millis(LEADER_MARGIN_MS)
}

/// Runs the election for `leadership` until `stop`, then resigns. Call it
/// on a thread of its own (the store blocks). `on_elected` runs at the start
/// of every term won, before any work of the term can see it.
pub fn run(
    store: Arc<dyn Store>,
    leadership: Arc<Leadership>,
    stop: Arc<AtomicBool>,
    on_elected: impl Fn(),
) {
    let Some(elector) = store.elector() else {
        return;
    };
    let mut last_holder: Option<String> = None;
    while !stop.load(Ordering::Relaxed) {
        let wait = match leadership.held() {
            Some(term) => {
                let sent = Instant::now();
                match elector.renew(term.lease) {
                    Ok(true) => {
                        leadership.set(Some(Term {
                            valid_until: valid_from(sent),
                            ..term
                        }));
                    }
                    Ok(false) => {
                        tracing::warn!(holder = %leadership.holder, "lost the leadership: the lease expired");
                        leadership.set(None);
                    }
                    Err(e) => {
                        // The term runs out on its own if this goes on.
                        if Instant::now() >= term.valid_until {
                            tracing::warn!(holder = %leadership.holder, error = %e, "lost the leadership: the lease could not be renewed in time");
                            leadership.set(None);
                        } else {
                            tracing::debug!(error = %e, "renewing the leader lease failed; retrying");
                        }
                    }
                }
                LEADER_RENEW_INTERVAL_MS
            }
            None => {
                let sent = Instant::now();
                match elector.campaign(&leadership.holder, LEADER_LEASE_TTL_S) {
                    Ok(Campaign::Won { lease, version }) => {
                        on_elected();
                        leadership.begin(lease, version, sent);
                        tracing::info!(holder = %leadership.holder, term = version, "elected the leader");
                        last_holder = None;
                        LEADER_RENEW_INTERVAL_MS
                    }
                    Ok(Campaign::Held { holder }) => {
                        if last_holder.as_deref() != Some(holder.as_str()) {
                            tracing::info!(leader = %holder, "following");
                            last_holder = Some(holder);
                        }
                        LEADER_CAMPAIGN_INTERVAL_MS
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "campaign failed; retrying");
                        LEADER_CAMPAIGN_INTERVAL_MS
                    }
                }
            }
        };
        sleep_unless(&stop, Duration::from_millis(wait));
    }
    if let Some(term) = leadership.held() {
        leadership.set(None);
        elector.resign(term.lease);
        tracing::info!(holder = %leadership.holder, "resigned the leadership");
    }
}

/// Sleeps `d` in small steps, returning early once `stop` is set.
pub fn sleep_unless(stop: &AtomicBool, mut d: Duration) {
    while !d.is_zero() && !stop.load(Ordering::Relaxed) {
        let step = d.min(Duration::from_millis(100));
        std::thread::sleep(step);
        d -= step;
    }
}

/// What this process writes into the leader key: host, pid and the address
/// it serves, so an operator reading the key knows which process leads.
pub fn holder_name(listen: std::net::SocketAddr) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    format!("{host} pid {} serving {listen}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_solo_process_always_leads_without_a_fence() {
        let l = Leadership::solo("me");
        assert!(l.is_leader());
        assert!(!l.is_elected());
        assert_eq!(l.fence(), Ok(None));
        assert_eq!(l.terms(), 1);
    }

    #[test]
    fn an_elected_process_leads_only_within_its_term() {
        let l = Leadership::elected("me");
        assert!(!l.is_leader());
        assert_eq!(l.fence(), Err(NotLeader));
        l.set(Some(Term {
            lease: 7,
            version: 42,
            valid_until: Instant::now() + Duration::from_secs(60),
        }));
        assert!(l.is_leader());
        assert_eq!(
            l.fence(),
            Ok(Some(Condition::VersionIs(LEADER_KEY.into(), 42)))
        );
        // A term that ran out is no term, even before anyone clears it.
        l.set(Some(Term {
            lease: 7,
            version: 42,
            valid_until: Instant::now() - Duration::from_millis(1),
        }));
        assert!(!l.is_leader());
        assert_eq!(l.fence(), Err(NotLeader));
        // A failed fence of an older term leaves a newer one alone.
        l.set(Some(Term {
            lease: 8,
            version: 50,
            valid_until: Instant::now() + Duration::from_secs(60),
        }));
        l.lost(42);
        assert!(l.is_leader());
        l.lost(50);
        assert!(!l.is_leader());
    }

    #[test]
    fn a_term_ends_before_etcd_could_expire_its_lease() {
        let sent = Instant::now();
        let etcd_expiry = sent + Duration::from_secs(u64::from(LEADER_LEASE_TTL_S));
        assert!(valid_from(sent) + Duration::from_millis(LEADER_MARGIN_MS) <= etcd_expiry);
        assert!(valid_from(sent) > sent + Duration::from_millis(LEADER_RENEW_INTERVAL_MS));
    }
}
