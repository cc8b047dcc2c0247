//! This target as a path of volumes served to stock hosts (C19, D16): the
//! [`VolumeSource`] that opens a volume namespace's engine as the owner's
//! host NQN, from the control plane's attachment, following its copy
//! changes like any serving host; and the lease keeper, which renews the
//! owner lease every [`LEASE_RENEW_MS`] while this target has subsystems
//! whose serving state needs one.
//!
//! Both talk to the control plane through the registration's client, so
//! they use the same URL and target token. The engine authenticates to the
//! volume's extents with the owner keys the control plane gave this target
//! with the serving state, over its admin API
//! ([`Target::set_ana_state_owning`]): the target token gives none.

use crate::backend::{OpenedVolume, VolumeSource};
use crate::register::{Client, RegistrationConfig};
use crate::target::Target;
use nvpool_api::http::Call;
use nvpool_api::names::{owner_host_nqn, volume_subsystem_nqn};
use nvpool_api::rest::{LeaseGrant, LEASE_RENEW_MS};
use nvpool_initiator::follow::{self, ControlPlane, Watcher};
use nvpool_initiator::{Volume, VolumeOptions};
use nvpool_layout::Uuid;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

impl ControlPlane for Client {
    fn get(&self, path: &str, timeout: Duration) -> Result<(u16, Vec<u8>), String> {
        self.call_raw(Call::Idempotent, "GET", path, None, Some(timeout))
    }

    fn put_json(&self, path: &str, body: &serde_json::Value) -> Result<(u16, Vec<u8>), String> {
        self.call_raw(Call::Idempotent, "PUT", path, Some(body), None)
    }
}

/// Opens volumes for volume namespaces as this target's owner host NQN.
#[derive(Debug)]
pub struct ControlPlaneSource {
    client: Arc<Client>,
    /// Where the owner keys are (weak: the target holds this source).
    target: Weak<Target>,
}

impl ControlPlaneSource {
    pub fn new(cfg: RegistrationConfig, target: &Arc<Target>) -> ControlPlaneSource {
        ControlPlaneSource {
            client: Arc::new(Client::new(cfg)),
            target: Arc::downgrade(target),
        }
    }
}

/// What keeps an opened volume current: the copy-following thread. Its
/// drop stops it and hands over the missed-regions record.
struct Session {
    stop: Arc<AtomicBool>,
    watcher: Arc<Watcher<Arc<Client>>>,
    _thread: JoinHandle<()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // The thread ends at its next long-poll step; the record goes now.
        self.watcher.hand_over();
    }
}

impl VolumeSource for ControlPlaneSource {
    fn open(&self, volume: &str) -> Result<OpenedVolume, String> {
        let uuid: Uuid = volume
            .parse()
            .map_err(|_| format!("{volume:?} is not a volume UUID"))?;
        let host = owner_host_nqn(&uuid, self.client.target_id());
        let view = follow::read_attachment(&self.client, &uuid, &host)
            .map_err(|e| format!("reading the attachment of {host}: {e}"))?;
        view.plan
            .validate()
            .map_err(|e| format!("the control plane sent an unusable plan: {e}"))?;
        let keys = self
            .target
            .upgrade()
            .and_then(|t| t.owner_keys(&volume_subsystem_nqn(&uuid)))
            .map(|k| Arc::new(k.policy.keys.clone()));
        // Set when the session drops (the namespace closed the volume): the
        // copy watcher stops, and so does the failure reporter, which drops
        // what this term did not report (see spawn_failure_reporter_until).
        let stop = Arc::new(AtomicBool::new(false));
        let (on_failed, _reporter) =
            follow::spawn_failure_reporter_until(self.client.clone(), &uuid, &host, stop.clone())
                .map_err(|e| format!("starting the failure reporter: {e}"))?;
        let opts = VolumeOptions {
            failed_extents: view.copies.stale_at_open(),
            syncing_extents: view.copies.syncing_at_open(),
            moving: view.copies.moving_at_open(),
            on_extent_failed: Some(on_failed),
            host_id: Some(nvpool_initiator::hostnqn::host_id_of(&host)),
            dhchap: keys,
            write_epoch: view.copies.write_epoch,
            write_hold: view.copies.write_hold,
            ..VolumeOptions::default()
        };
        let vol = Arc::new(
            Volume::open(&view.plan, opts).map_err(|e| format!("opening the volume: {e}"))?,
        );
        let watcher = Arc::new(Watcher::new(
            self.client.clone(),
            &uuid,
            &host,
            vol.clone(),
            follow::new_session(),
            stop.clone(),
        ));
        watcher.register(view.copies.revision);
        let thread = watcher
            .spawn(view.copies)
            .map_err(|e| format!("starting the copy watcher: {e}"))?;
        tracing::info!(%uuid, host, extents = view.plan.extents.len(), "volume engine open");
        Ok(OpenedVolume {
            volume: vol,
            session: Box::new(Session {
                stop,
                watcher,
                _thread: thread,
            }),
        })
    }
}

/// The thread that renews this target's owner leases.
#[derive(Debug)]
pub struct LeaseKeeper {
    stop: Option<SyncSender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl LeaseKeeper {
    pub fn start(cfg: RegistrationConfig, target: Arc<Target>) -> std::io::Result<LeaseKeeper> {
        let (tx, rx) = mpsc::sync_channel::<()>(1);
        let client = Client::new(cfg);
        let thread = std::thread::Builder::new()
            .name("nvpool-lease".into())
            .spawn(move || renew_loop(&client, &target, &rx))?;
        Ok(LeaseKeeper {
            stop: Some(tx),
            thread: Some(thread),
        })
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Whether any subsystem here serves only under a lease.
fn wants_leases(target: &Target) -> bool {
    target
        .subsystems()
        .values()
        .any(|s| s.ana.as_ref().is_some_and(|a| a.config.lease))
}

fn renew_loop(client: &Client, target: &Target, stop: &mpsc::Receiver<()>) {
    let path = format!("/v1/targets/{}/lease", client.target_id());
    let mut failing = false;
    loop {
        if wants_leases(target) {
            // The lease counts from before the request left: never later
            // than the control plane's idea of it.
            let sent_ms = target.now_ms();
            let answer = client
                // A renewal grants the same lease again: safe on another
                // instance (and a non-leader's 503 sends it there).
                .call_raw(Call::Idempotent, "POST", &path, None, None)
                .and_then(|(status, body)| {
                    if status != 200 {
                        return Err(format!("HTTP {status}: {}", String::from_utf8_lossy(&body)));
                    }
                    serde_json::from_slice::<LeaseGrant>(&body).map_err(|e| e.to_string())
                });
            match answer {
                Ok(g) => {
                    target.renew_leases(&g.nqns, sent_ms + g.valid_ms);
                    if failing {
                        tracing::info!("owner leases renewed again");
                    }
                    failing = false;
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e,
                            "cannot renew owner leases: served volumes stop when they run out");
                    }
                    failing = true;
                }
            }
        }
        match stop.recv_timeout(Duration::from_millis(LEASE_RENEW_MS)) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}
