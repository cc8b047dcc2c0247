//! Programming targets: the attach, detach and reconcile protocols, which
//! turn attachment records into namespaces on the targets through each
//! target's admin API (`nvpool-target --admin-listen`).
//!
//! ```text
//! attach   begin_attach (record: attaching, NSIDs)      ── store
//!          per target: subsystem + host ACL + namespaces ── targets, in parallel
//!          any target failed → remove what this call added, abort_attach
//!          finish_attach (record: attached) → connection plan
//! detach   begin_detach (record: detaching)
//!          per target: remove namespaces (+ the subsystem when it empties)
//!          a target failed → error, record stays detaching (retry), or with
//!          force: finish anyway, the leftovers recorded as stale exports
//!          finish_detach (record gone)
//! reconcile (a target registered, and periodically)
//!          make the target's host subsystems exactly the records' exports;
//!          release the trees of freed extents of its grain pools;
//!          then forget its stale exports
//! ```
//!
//! Everything here blocks (HTTP calls with a timeout); the API runs it on
//! the blocking pool.

use crate::attach::Attachment;
use crate::attach::{validate_host_nqn, AttachmentState, Export};
use crate::limits::TARGET_CALL_TIMEOUT_MS;
use crate::model::{Target, Uuid};
use crate::plan::{ConnectionPlan, HOST_SUBSYSTEM_PREFIX};
use crate::state::{Cluster, HostKeys, StateError};
use nvpool_api::admin::{
    AnaStateBody, CopyRequest, CopyStatus, DhchapKeys, Identity, NamespaceBody, ReleaseRootsBody,
    RollbackBody, SealBody, SecretText, SnapshotTreesBody, StartCopyBody, SubsystemAccess,
};
use nvpool_api::client::{segment, Client, ClientError, NO_BODY};
use nvpool_api::http::{Call, NoAnswer};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;
use ureq::http::{Method, Response};
use ureq::Body;

/// Why programming a target failed.
#[derive(Debug, thiserror::Error)]
pub enum ProgramError {
    #[error(transparent)]
    State(#[from] StateError),
    /// The target did not answer (down, partitioned, timed out).
    #[error("target {target} is unreachable at {addr}: {message}")]
    Unreachable {
        target: String,
        addr: SocketAddr,
        message: String,
    },
    /// The target answered with an error.
    #[error("target {target} refused {what}: {message}")]
    Refused {
        target: String,
        what: String,
        message: String,
    },
    /// The daemon at the target's admin address is not that target (or
    /// cannot say who it is): nothing was changed there.
    #[error(
        "the daemon at {addr} is not target {target} (it says it is {found}); \
         nothing was changed there: fix the target's registration or its address"
    )]
    WrongTarget {
        target: String,
        addr: SocketAddr,
        found: String,
    },
}

/// A subsystem as the target's admin API lists it.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct SubsystemState {
    pub nqn: String,
    allow_any_host: bool,
    pub allowed_hosts: Vec<String>,
    /// Hosts that must authenticate, with the label of their keys.
    #[serde(default)]
    pub host_auth: BTreeMap<String, HostAuthState>,
    namespaces: Vec<NamespaceState>,
}

/// A host's DH-HMAC-CHAP settings as a target shows them (no secrets).
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct HostAuthState {
    #[serde(default)]
    pub key_id: Option<String>,
}

/// Whether `host` has keys in a subsystem's `host_auth` map (as the admin
/// API shows it, or `host_keys` as it is configured), and their `key_id`.
pub(crate) fn held_key_id<'a>(
    host_auth: Option<&'a serde_json::Value>,
    host: &str,
) -> Option<Option<&'a str>> {
    host_auth
        .and_then(|a| a.get(host))
        .map(|k| k.get("key_id").and_then(|i| i.as_str()))
}

/// What a target is told about `host`'s keys.
pub(crate) fn dhchap_keys(k: &HostKeys) -> DhchapKeys {
    let text = |s: &crate::rest::Secret| SecretText::new(s.expose().to_owned());
    DhchapKeys {
        dhchap_key: text(&k.dhchap_key),
        dhchap_ctrl_key: k.dhchap_ctrl_key.as_ref().map(text),
        dhchap_hash: k.dhchap_hash.clone(),
        dhchap_dhgroup: k.dhchap_dhgroup.clone(),
        key_id: Some(k.key_id.clone()),
    }
}

/// [`dhchap_keys`] as JSON, for bodies still built as values.
pub(crate) fn target_keys(k: &HostKeys) -> serde_json::Value {
    serde_json::to_value(dhchap_keys(k)).expect("keys encode")
}

#[derive(Debug, Clone, Deserialize)]
struct NamespaceState {
    nsid: u32,
    backend: String,
    #[serde(default)]
    read_only: bool,
}

/// A client of one target's admin API, presenting the token the target
/// registered with as a bearer token on every call. A target that
/// registered `admin_tls` is called over https: its certificate must chain
/// to the CA of `nvpool-control --target-cacert` (else the system bundle)
/// and name the IP address of its `admin_addr` (ureq verifies the host of
/// the URL, which is that address).
pub(crate) struct TargetAdmin {
    client: Client,
    target: String,
    addr: SocketAddr,
    /// The daemon at `addr` said it is `target`: set by the first change
    /// made through this client.
    confirmed: std::sync::OnceLock<()>,
}

impl TargetAdmin {
    /// A client of `t`'s admin API with the credential the cluster holds
    /// for it.
    pub(crate) fn new(cluster: &Cluster, t: &Target) -> Result<TargetAdmin, ProgramError> {
        let token = cluster.target_credential(&t.id)?;
        let (scheme, tls) = match t.admin_tls {
            true => ("https", cluster.target_tls()),
            false => ("http", ureq::tls::TlsConfig::default()),
        };
        let client = Client::with_timeout(
            vec![format!("{scheme}://{}", t.admin_addr)],
            token.map(|s| s.expose().to_owned()),
            tls,
            Duration::from_millis(TARGET_CALL_TIMEOUT_MS),
            "the target",
        );
        Ok(TargetAdmin {
            client,
            target: t.id.clone(),
            addr: t.admin_addr,
            confirmed: std::sync::OnceLock::new(),
        })
    }

    fn unreachable(&self, message: String) -> ProgramError {
        ProgramError::Unreachable {
            target: self.target.clone(),
            addr: self.addr,
            message,
        }
    }

    /// No answer: a certificate the control plane does not trust, or one
    /// that does not name the address, says where the trust comes from.
    fn no_answer(&self, e: &NoAnswer) -> ProgramError {
        let message = match e.failures.iter().any(|f| crate::http::is_tls(&f.error)) {
            true => format!(
                "TLS with its admin API failed: {e} (the control plane trusts the CA of \
                 --target-cacert, else the system CA bundle, and the certificate must name \
                 {})",
                self.addr.ip()
            ),
            false => e.to_string(),
        };
        self.unreachable(message)
    }

    /// One call: its answer, `None` for 404, or an error (`what` the
    /// target refused).
    fn call<B: Serialize + ?Sized>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        timeout: Option<Duration>,
        what: &str,
    ) -> Result<Option<Response<Body>>, ProgramError> {
        // One endpoint: nothing to fail over to.
        match self.client.request(Call::Once, method, path, body, timeout) {
            Ok(r) => Ok(Some(r)),
            Err(ClientError::Api { status: 404, .. }) => Ok(None),
            Err(ClientError::Api { message, .. }) => Err(ProgramError::Refused {
                target: self.target.clone(),
                what: what.to_owned(),
                message,
            }),
            Err(ClientError::Unreachable { source, .. }) => Err(self.no_answer(&source)),
            Err(e) => Err(self.unreachable(e.to_string())),
        }
    }

    /// A GET's body as `T`; `None` for 404.
    fn read<T: DeserializeOwned>(&self, path: &str, what: &str) -> Result<Option<T>, ProgramError> {
        match self.call(Method::GET, path, NO_BODY, None, what)? {
            Some(r) => Client::decode(Method::GET, path, r)
                .map(Some)
                .map_err(|e| self.unreachable(e.to_string())),
            None => Ok(None),
        }
    }

    /// A change, after [`confirm_identity`](Self::confirm_identity):
    /// whether the target had what it names (`false` for 404).
    fn change<B: Serialize + ?Sized>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        what: &str,
    ) -> Result<bool, ProgramError> {
        self.confirm_identity()?;
        Ok(self.call(method, path, body, None, what)?.is_some())
    }

    /// A change the target must find its subject for: 404 is `vanished`.
    fn change_existing<B: Serialize + ?Sized>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        timeout: Option<Duration>,
        what: &str,
        vanished: &str,
    ) -> Result<(), ProgramError> {
        self.confirm_identity()?;
        match self.call(method, path, body, timeout, what)? {
            Some(_) => Ok(()),
            None => Err(ProgramError::Refused {
                target: self.target.clone(),
                what: what.to_owned(),
                message: vanished.to_owned(),
            }),
        }
    }

    /// Checks, once per client, that the daemon at the admin address is the
    /// target this client is for, before the first change it makes there:
    /// a record whose admin address another target's daemon now holds (a
    /// stale or mistaken registration) must not make the control plane
    /// remove, replace or add anything on that other target.
    pub(crate) fn confirm_identity(&self) -> Result<(), ProgramError> {
        if self.confirmed.get().is_some() {
            return Ok(());
        }
        let path = "/v1/identity";
        let found = match self.call(Method::GET, path, NO_BODY, None, "reporting its identity")? {
            Some(r) => match Client::decode::<Identity>(Method::GET, path, r) {
                Ok(Identity {
                    target_id: Some(id),
                    ..
                }) => id,
                Ok(Identity {
                    target_id: None, ..
                }) => "no target at all".to_owned(),
                Err(_) => "nothing readable".to_owned(),
            },
            None => "nothing (it has no identity to report)".to_owned(),
        };
        if found != self.target {
            tracing::error!(target = %self.target, admin_addr = %self.addr, found = %found,
                "the daemon at the target's admin address is another one; changing nothing there");
            return Err(ProgramError::WrongTarget {
                target: self.target.clone(),
                addr: self.addr,
                found,
            });
        }
        let _ = self.confirmed.set(());
        Ok(())
    }

    pub(crate) fn subsystems(&self) -> Result<Vec<SubsystemState>, ProgramError> {
        Ok(self
            .read("/v1/subsystems", "listing subsystems")?
            .unwrap_or_default())
    }

    fn subsystem(&self, nqn: &str) -> Result<Option<SubsystemState>, ProgramError> {
        self.subsystem_value(nqn)?
            .map(|v| {
                serde_json::from_value(v).map_err(|e| ProgramError::Refused {
                    target: self.target.clone(),
                    what: format!("reading subsystem {nqn}"),
                    message: format!("unexpected answer: {e}"),
                })
            })
            .transpose()
    }

    fn create_subsystem(
        &self,
        nqn: &str,
        host: &str,
        keys: Option<&HostKeys>,
    ) -> Result<(), ProgramError> {
        let body = SubsystemAccess {
            allowed_hosts: vec![host.to_owned()],
            allow_any_host: false,
            host_keys: keys
                .map(|k| BTreeMap::from([(host.to_owned(), dhchap_keys(k))]))
                .unwrap_or_default(),
        };
        let path = format!("/v1/subsystems/{}", segment(nqn));
        self.change(
            Method::PUT,
            &path,
            Some(&body),
            &format!("creating subsystem {nqn}"),
        )
        .map(drop)
    }

    /// A subsystem as the admin API shows it, untyped (served volumes read
    /// fields the attach protocol does not need).
    pub(crate) fn subsystem_value(
        &self,
        nqn: &str,
    ) -> Result<Option<serde_json::Value>, ProgramError> {
        self.read(
            &format!("/v1/subsystems/{}", segment(nqn)),
            "reading a subsystem",
        )
    }

    /// Every subsystem NQN the target has.
    pub(crate) fn subsystem_nqns(&self) -> Result<Vec<String>, ProgramError> {
        Ok(self.subsystems()?.into_iter().map(|s| s.nqn).collect())
    }

    /// Creates or replaces a subsystem (open namespaces whose spec is
    /// unchanged are kept open by the target).
    pub(crate) fn put_subsystem_value(
        &self,
        nqn: &str,
        body: &serde_json::Value,
    ) -> Result<(), ProgramError> {
        let path = format!("/v1/subsystems/{}", segment(nqn));
        self.change(
            Method::PUT,
            &path,
            Some(body),
            &format!("configuring subsystem {nqn}"),
        )
        .map(drop)
    }

    /// Sets the ANA state the target reports for `nqn`. Leaving a serving
    /// state waits on the target for the I/O in flight, so this call gets
    /// a longer timeout.
    pub(crate) fn set_ana(&self, nqn: &str, state: &str) -> Result<(), ProgramError> {
        self.set_ana_owning(nqn, state, None)
    }

    /// [`set_ana`](Self::set_ana), handing the target the DH-HMAC-CHAP
    /// keys of its owner host NQN (`owner_keys`), with which the volume
    /// engine it opens authenticates to the volume's extents (C19): the
    /// owner gets them over its admin API only, never through the control
    /// plane's REST API.
    pub(crate) fn set_ana_owning(
        &self,
        nqn: &str,
        state: &str,
        owner_keys: Option<&HostKeys>,
    ) -> Result<(), ProgramError> {
        let body = AnaStateBody {
            state: state.to_owned(),
            owner_keys: owner_keys.map(dhchap_keys),
        };
        let timeout = Duration::from_millis(crate::limits::ANA_CHANGE_TIMEOUT_MS);
        self.change_existing(
            Method::PUT,
            &format!("/v1/subsystems/{}/ana", segment(nqn)),
            Some(&body),
            Some(timeout),
            &format!("ANA state {state} of {nqn}"),
            "the subsystem does not exist",
        )
    }

    /// Takes `host` off a subsystem's ACL; one already gone is fine.
    pub(crate) fn disallow_host(&self, nqn: &str, host: &str) -> Result<(), ProgramError> {
        let path = format!("/v1/subsystems/{}/hosts/{}", segment(nqn), segment(host));
        self.change(
            Method::DELETE,
            &path,
            NO_BODY,
            &format!("removing {host} from {nqn}"),
        )
        .map(drop)
    }

    /// Lets `host` in, with `keys` (DH-HMAC-CHAP) when given; without,
    /// keys the host already has on the target stay.
    pub(crate) fn allow_host(
        &self,
        nqn: &str,
        host: &str,
        keys: Option<&HostKeys>,
    ) -> Result<(), ProgramError> {
        let path = format!("/v1/subsystems/{}/hosts/{}", segment(nqn), segment(host));
        self.change_existing(
            Method::PUT,
            &path,
            keys.map(dhchap_keys).as_ref(),
            None,
            &format!("allowing {host} on {nqn}"),
            "the subsystem vanished",
        )
    }

    /// Puts a namespace; `read_only`: write-protected (a read-only
    /// volume's extent, design/thin-snapshots.md T8).
    fn put_namespace(
        &self,
        nqn: &str,
        nsid: u32,
        backend: &str,
        read_only: bool,
    ) -> Result<(), ProgramError> {
        let body = NamespaceBody {
            backend: backend.to_owned(),
            uuid: None,
            read_only,
        };
        self.change_existing(
            Method::PUT,
            &format!("/v1/subsystems/{}/namespaces/{nsid}", segment(nqn)),
            Some(&body),
            None,
            &format!("namespace {nsid} of {nqn}"),
            "the subsystem vanished",
        )
    }

    /// Removes a namespace; one already gone is fine.
    pub(crate) fn delete_namespace(&self, nqn: &str, nsid: u32) -> Result<(), ProgramError> {
        let path = format!("/v1/subsystems/{}/namespaces/{nsid}", segment(nqn));
        let what = format!("removing namespace {nsid} of {nqn}");
        self.change(Method::DELETE, &path, NO_BODY, &what).map(drop)
    }

    /// Has grain pool `device` drop the trees `roots` of freed extents
    /// (idempotent: a tree it does not have counts as released). A device
    /// the target does not know (404) has no trees left to drop.
    pub(crate) fn release_roots(&self, device: &str, roots: &[u64]) -> Result<(), ProgramError> {
        let body = ReleaseRootsBody {
            roots: roots.to_vec(),
        };
        let path = format!("/v1/devices/{}/release", segment(device));
        let what = format!("releasing {} trees of device {device}", roots.len());
        if !self.change(Method::POST, &path, Some(&body), &what)? {
            tracing::warn!(target = %self.target, device, "the device is unknown to the target: \
                nothing to release");
        }
        Ok(())
    }

    /// Has grain pool `device` create new trees sharing everything with
    /// live ones (`POST /v1/devices/{id}/snapshots`; a retry of the same
    /// trees is accepted). An unknown device or live tree is refused.
    pub(crate) fn snapshot_trees(
        &self,
        device: &str,
        body: &SnapshotTreesBody,
    ) -> Result<(), ProgramError> {
        self.change_existing(
            Method::POST,
            &format!("/v1/devices/{}/snapshots", segment(device)),
            Some(body),
            None,
            &format!("creating {} trees on device {device}", body.trees.len()),
            "the device or a live tree is unknown to the target",
        )
    }

    /// Seals snapshot trees of grain pool `device` (`POST …/seal`): writes
    /// tagged at or below their epoch are refused from now on.
    pub(crate) fn seal(&self, device: &str, body: &SealBody) -> Result<(), ProgramError> {
        self.change_existing(
            Method::POST,
            &format!("/v1/devices/{}/seal", segment(device)),
            Some(body),
            None,
            &format!("sealing {} trees of device {device}", body.snapshots.len()),
            "the device is unknown to the target",
        )
    }

    /// Has grain pool `device` give each live tree of `body` the contents
    /// of its snapshot tree (`POST …/rollback`; the same body again
    /// changes nothing more). An unknown device or snapshot tree is
    /// refused.
    pub(crate) fn rollback(&self, device: &str, body: &RollbackBody) -> Result<(), ProgramError> {
        self.change_existing(
            Method::POST,
            &format!("/v1/devices/{}/rollback", segment(device)),
            Some(body),
            None,
            &format!("rolling back {} trees of device {device}", body.trees.len()),
            "the device or a snapshot tree is unknown to the target",
        )
    }

    /// Arms copy job `id` (idempotent for the same body).
    pub(crate) fn arm_copy(&self, id: &str, body: &CopyRequest) -> Result<(), ProgramError> {
        let path = format!("/v1/copies/{}", segment(id));
        self.change(Method::PUT, &path, Some(body), &format!("arming copy {id}"))
            .map(drop)
    }

    /// Starts an armed copy job on `regions` (`None`: all).
    pub(crate) fn start_copy(&self, id: &str, regions: Option<&[u32]>) -> Result<(), ProgramError> {
        let body = StartCopyBody {
            regions: regions.map(<[u32]>::to_vec),
        };
        self.change_existing(
            Method::POST,
            &format!("/v1/copies/{}/start", segment(id)),
            Some(&body),
            None,
            &format!("starting copy {id}"),
            "the target does not know the copy (it restarted)",
        )
    }

    /// A copy job's status; `None` when the target does not know it.
    pub(crate) fn copy_status(&self, id: &str) -> Result<Option<CopyStatus>, ProgramError> {
        self.read(
            &format!("/v1/copies/{}", segment(id)),
            &format!("reading copy {id}"),
        )
    }

    /// Every copy job the target knows.
    pub(crate) fn copies(&self) -> Result<Vec<CopyStatus>, ProgramError> {
        Ok(self
            .read("/v1/copies", "listing copies")?
            .unwrap_or_default())
    }

    /// Cancels and forgets a copy job; one already gone is fine.
    pub(crate) fn delete_copy(&self, id: &str) -> Result<(), ProgramError> {
        let path = format!("/v1/copies/{}", segment(id));
        self.change(
            Method::DELETE,
            &path,
            NO_BODY,
            &format!("removing copy {id}"),
        )
        .map(drop)
    }

    /// Removes a subsystem; one already gone is fine.
    pub(crate) fn delete_subsystem(&self, nqn: &str) -> Result<(), ProgramError> {
        let path = format!("/v1/subsystems/{}", segment(nqn));
        self.change(
            Method::DELETE,
            &path,
            NO_BODY,
            &format!("removing subsystem {nqn}"),
        )
        .map(drop)
    }
}

/// What `ensure_exports` changed on one target, so a failed attach can
/// take exactly that back.
#[derive(Debug, Default)]
pub(crate) struct Added {
    subsystem: Option<String>,
    namespaces: Vec<(String, u32)>,
}

/// Makes `target` export `exports` (all of one host's subsystem) to
/// `host`, leaving other namespaces of the subsystem alone; the host
/// authenticates with `keys` (the cluster's DH-HMAC-CHAP keys for it), or
/// not at all without. Records what it added in `added`, also when it
/// fails half-way.
pub(crate) fn ensure_exports(
    admin: &TargetAdmin,
    target: &Target,
    host: &str,
    keys: Option<&HostKeys>,
    exports: &[Export],
    added: &mut Added,
) -> Result<(), ProgramError> {
    ensure_exports_protected(admin, target, host, keys, exports, None, added)
}

/// [`ensure_exports`], with the NSIDs among `exports` that must be
/// write-protected (the extents of read-only volumes): a namespace there
/// with the right backend but the wrong protection is put again. `None`
/// leaves the protection of existing namespaces as it is and puts new
/// ones writable (what a caller that does not know the volumes does;
/// reconciliation sets it right).
pub(crate) fn ensure_exports_protected(
    admin: &TargetAdmin,
    target: &Target,
    host: &str,
    keys: Option<&HostKeys>,
    exports: &[Export],
    protected: Option<&BTreeSet<u32>>,
    added: &mut Added,
) -> Result<(), ProgramError> {
    let Some(nqn) = exports.first().map(|x| x.subsystem_nqn.clone()) else {
        return Ok(());
    };
    let existing = match admin.subsystem(&nqn)? {
        Some(s) => s,
        None => {
            admin.create_subsystem(&nqn, host, keys)?;
            added.subsystem = Some(nqn.clone());
            SubsystemState {
                nqn: nqn.clone(),
                allow_any_host: false,
                allowed_hosts: vec![host.to_owned()],
                host_auth: keys
                    .map(|k| {
                        let held = HostAuthState {
                            key_id: Some(k.key_id.clone()),
                        };
                        BTreeMap::from([(host.to_owned(), held)])
                    })
                    .unwrap_or_default(),
                namespaces: Vec::new(),
            }
        }
    };
    ensure_host_keys(admin, &nqn, host, keys, &existing.host_auth)?;
    if existing.allow_any_host || existing.allowed_hosts != [host] {
        // Only this host may see its subsystem: rebuild the ACL by
        // recreating would drop namespaces, so fix it in place.
        admin.allow_host(&nqn, host, keys)?;
        if existing.allow_any_host || existing.allowed_hosts.iter().any(|h| h != host) {
            return Err(ProgramError::Refused {
                target: target.id.clone(),
                what: format!("subsystem {nqn}"),
                message: format!(
                    "its access list ({:?}, any host: {}) is not {host} alone; remove the \
                     subsystem on the target and retry",
                    existing.allowed_hosts, existing.allow_any_host
                ),
            });
        }
    }
    let have: BTreeMap<u32, (&str, bool)> = existing
        .namespaces
        .iter()
        .map(|n| (n.nsid, (n.backend.as_str(), n.read_only)))
        .collect();
    for x in exports {
        let spec = x
            .backend_spec(target)
            .ok_or_else(|| ProgramError::Refused {
                target: target.id.clone(),
                what: format!("namespace {}", x.nsid),
                message: format!("device {} is no longer registered", x.device),
            })?;
        let read_only = protected.is_some_and(|p| p.contains(&x.nsid));
        match have.get(&x.nsid) {
            Some(&(b, ro)) if b == spec && (protected.is_none() || ro == read_only) => continue,
            _ => {}
        }
        admin.put_namespace(&nqn, x.nsid, &spec, read_only)?;
        if !have.contains_key(&x.nsid) {
            added.namespaces.push((nqn.clone(), x.nsid));
        }
    }
    Ok(())
}

/// Makes `host`'s keys on subsystem `nqn` (whose hosts' keys are
/// `held`) the cluster's `keys`: set when the target holds none or others,
/// taken away when the cluster has none (the target only drops a host's
/// keys with the host, so the host is let in again at once; its
/// controllers reconnect).
pub(crate) fn ensure_host_keys(
    admin: &TargetAdmin,
    nqn: &str,
    host: &str,
    keys: Option<&HostKeys>,
    held: &BTreeMap<String, HostAuthState>,
) -> Result<(), ProgramError> {
    let have = held.get(host);
    match keys {
        Some(k) if have.and_then(|h| h.key_id.as_deref()) != Some(k.key_id.as_str()) => {
            admin.allow_host(nqn, host, Some(k))?;
            tracing::info!(target = %admin.target, subsystem = %nqn, host,
                key_id = %k.key_id, "DH-HMAC-CHAP keys set");
        }
        None if have.is_some() => {
            admin.disallow_host(nqn, host)?;
            admin.allow_host(nqn, host, None)?;
            tracing::info!(target = %admin.target, subsystem = %nqn, host,
                "DH-HMAC-CHAP keys taken away");
        }
        _ => {}
    }
    Ok(())
}

/// Takes back what a failed `ensure_exports` added (best effort: a target
/// that fails here is cleaned up by reconciliation).
fn undo(admin: &TargetAdmin, added: &Added) {
    for (nqn, nsid) in added.namespaces.iter().rev() {
        if let Err(e) = admin.delete_namespace(nqn, *nsid) {
            tracing::warn!(error = %e, "could not take back a namespace; reconciliation will");
        }
    }
    if let Some(nqn) = &added.subsystem {
        if let Err(e) = admin.delete_subsystem(nqn) {
            tracing::warn!(error = %e, "could not take back a subsystem; reconciliation will");
        }
    }
}

/// Runs `f` for every target at once (one thread each; a volume spans a
/// handful of targets) and returns the results in target order.
fn on_targets<T: Send, F>(items: Vec<(Target, Vec<Export>)>, f: F) -> Vec<(Target, T)>
where
    F: Fn(&Target, &[Export]) -> T + Sync,
{
    std::thread::scope(|scope| {
        let handles: Vec<_> = items
            .iter()
            .map(|(t, xs)| {
                let f = &f;
                scope.spawn(move || f(t, xs))
            })
            .collect();
        items
            .iter()
            .zip(handles)
            .map(|((t, _), h)| {
                let r = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
                (t.clone(), r)
            })
            .collect()
    })
}

/// The result of an attach.
#[derive(Debug, Clone)]
pub struct Attached {
    pub attachment: Attachment,
    pub plan: ConnectionPlan,
    /// False when the attachment existed already.
    pub created: bool,
}

/// Groups an attachment's exports by target, with the target records.
fn exports_by_target(
    cluster: &Cluster,
    volume: &crate::model::Volume,
    a: &Attachment,
) -> Result<Vec<(Target, Vec<Export>)>, StateError> {
    let s = cluster.snapshot()?;
    let mut by: BTreeMap<String, Vec<Export>> = BTreeMap::new();
    for (t, x) in s.attachment_exports(volume, a) {
        by.entry(t).or_default().push(x);
    }
    by.into_iter()
        .map(|(id, xs)| {
            let t = s
                .targets
                .get(&id)
                .ok_or_else(|| StateError::TargetNotFound(id.clone()))?;
            Ok((t.value.clone(), xs))
        })
        .collect()
}

/// Attaches `volume` to `host`: records it, programs every target
/// involved, and returns the connection plan. If any target fails, what
/// this call added is taken back everywhere and the error is returned.
pub fn attach(cluster: &Cluster, volume: &Uuid, host: &str) -> Result<Attached, ProgramError> {
    attach_settling(cluster, volume, host, || Ok(()))
}

/// One target's part of an attach: how it went, and what it added.
type Programmed = (Target, (Result<(), ProgramError>, Added));

/// [`attach`], calling `settle` once the targets are programmed and before
/// judging how that went: a take-over fences the old owner meanwhile
/// (C19), and `settle` waits for that fence, which marks stale the copies
/// on targets it could not reach. A target this attach could not reach
/// either then holds only stale copies and does not stop the attach (see
/// below). An error from `settle` takes back what the attach added.
pub(crate) fn attach_settling(
    cluster: &Cluster,
    volume: &Uuid,
    host: &str,
    settle: impl FnOnce() -> Result<(), ProgramError>,
) -> Result<Attached, ProgramError> {
    validate_host_nqn(host).map_err(StateError::from)?;
    let keys = cluster.keys_to_serve(host)?;
    let start = cluster.begin_attach(volume, host)?;
    let work = exports_by_target(cluster, &start.volume, &start.attachment)?;
    // A read-only volume's namespaces are all write-protected.
    let read_only = cluster.is_read_only(volume)?;
    let results = on_targets(work, |t, xs| {
        let mut added = Added::default();
        let protected: BTreeSet<u32> = if read_only {
            xs.iter().map(|x| x.nsid).collect()
        } else {
            BTreeSet::new()
        };
        let r = TargetAdmin::new(cluster, t).and_then(|admin| {
            let p = Some(&protected);
            ensure_exports_protected(&admin, t, host, keys.as_ref(), xs, p, &mut added)
        });
        (r, added)
    });
    let roll_back = |results: &[Programmed], why: &str| {
        for (t, (_, added)) in results {
            match TargetAdmin::new(cluster, t) {
                Ok(admin) => undo(&admin, added),
                Err(e) => tracing::warn!(target = %t.id, error = %e,
                    "could not take back what the attach added; reconciliation will"),
            }
        }
        let aborted = cluster.abort_attach(volume, host, start.created);
        tracing::warn!(%volume, host, error = %why, "attach failed and was rolled back");
        aborted
    };
    if let Err(e) = settle() {
        roll_back(&results, &e.to_string())?;
        return Err(e);
    }
    // A target that cannot be reached and holds only copies that missed
    // writes (never read, never written) does not stop the attach: its
    // namespaces are recorded and reconciliation exports them when it is
    // back, for the copies to be resynced.
    let stale = cluster.snapshot()?.failed_set(volume);
    let only_stale = |t: &Target| {
        start
            .volume
            .extents
            .iter()
            .enumerate()
            .filter(|(_, e)| e.target == t.id)
            .all(|(i, _)| stale.contains(&(i as u32)))
    };
    let failed = results.iter().find_map(|(t, (r, _))| match r {
        Err(ProgramError::Unreachable { .. }) if only_stale(t) => None,
        r => r.as_ref().err(),
    });
    if let Some(e) = failed {
        roll_back(&results, &e.to_string())?;
        // Hand back the first failure itself.
        let err = results
            .into_iter()
            .find_map(|(t, (r, _))| match r {
                Err(ProgramError::Unreachable { .. }) if only_stale(&t) => None,
                r => r.err(),
            })
            .expect("a failure was found above");
        return Err(err);
    }
    let attachment = cluster.finish_attach(volume, host)?;
    let plan = cluster.plan(&start.volume, &attachment)?;
    tracing::info!(%volume, host, extents = plan.extents.len(), "volume attached");
    Ok(Attached {
        attachment,
        plan,
        created: start.created,
    })
}

/// Detaches `volume` from `host`: removes its namespaces on every target
/// (and the host's subsystem where it empties), then forgets the
/// attachment. A target that cannot be reached fails the detach (the
/// record stays `detaching`; retry), unless `force`, which forgets the
/// attachment anyway and records the leftovers as stale exports.
pub fn detach(
    cluster: &Cluster,
    volume: &Uuid,
    host: &str,
    force: bool,
) -> Result<(), ProgramError> {
    detach_reporting(cluster, volume, host, force).map(drop)
}

/// [`detach`], answering the targets that could not be reached (with
/// `force`, they may still export the host's namespaces: their leftovers
/// are stale exports).
pub fn detach_reporting(
    cluster: &Cluster,
    volume: &Uuid,
    host: &str,
    force: bool,
) -> Result<Vec<String>, ProgramError> {
    validate_host_nqn(host).map_err(StateError::from)?;
    let (a, _) = cluster.begin_detach(volume, host)?;
    let s = cluster.snapshot()?;
    let v = s
        .volumes
        .get(volume)
        .ok_or_else(|| StateError::VolumeNotFound(volume.to_string()))?
        .value
        .clone();
    let work = exports_by_target(cluster, &v, &a)?;
    let results = on_targets(work, |t, xs| -> Result<(), ProgramError> {
        let admin = TargetAdmin::new(cluster, t)?;
        // The host's subsystem goes whole when no other attachment uses it
        // (one call, which takes its namespaces with it and ends its
        // controllers: the fence of C19); else only these namespaces go.
        let desired = cluster.desired_exports(&t.id)?;
        if let Some(x) = xs.first() {
            if !desired.subsystems.contains_key(&x.subsystem_nqn) {
                return admin.delete_subsystem(&x.subsystem_nqn);
            }
        }
        for x in xs {
            admin.delete_namespace(&x.subsystem_nqn, x.nsid)?;
        }
        Ok(())
    });
    let mut stale: BTreeMap<String, Vec<Export>> = BTreeMap::new();
    let mut first_error = None;
    for (t, r) in results {
        if let Err(e) = r {
            tracing::warn!(%volume, host, target = %t.id, error = %e, force, "detach: target failed");
            let xs: Vec<Export> = s
                .attachment_exports(&v, &a)
                .into_iter()
                .filter(|(target, _)| *target == t.id)
                .map(|(_, x)| x)
                .collect();
            stale.insert(t.id.clone(), xs);
            first_error.get_or_insert(e);
        }
    }
    if let Some(e) = first_error {
        if !force {
            return Err(e);
        }
    }
    cluster.finish_detach(volume, host, &stale)?;
    tracing::info!(%volume, host, stale_targets = stale.len(), "volume detached");
    Ok(stale.into_keys().collect())
}

/// What a reconciliation did on one target.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Reconciled {
    pub subsystems_removed: usize,
    pub namespaces_removed: usize,
    pub namespaces_added: usize,
    /// Copies (resync, move) the target ran for jobs that are over.
    pub copies_removed: usize,
    /// Trees of freed extents its grain pools released.
    pub trees_released: usize,
    pub stale_cleared: bool,
}

/// Makes the host subsystems of `target` exactly what the attachment
/// records say (subsystems outside the nvpool host prefix are left
/// alone), has its grain pools release the trees of freed extents, then
/// forgets the target's stale exports (which kept those extents taken).
pub fn reconcile(cluster: &Cluster, target_id: &str) -> Result<Reconciled, ProgramError> {
    let t = cluster.target(target_id)?.target;
    let stale = cluster.stale_exports(target_id)?;
    let desired = cluster.desired_exports(target_id)?;
    let admin = TargetAdmin::new(cluster, &t)?;
    let mut out = Reconciled::default();
    let present = admin.subsystems()?;
    for sub in present
        .iter()
        .filter(|s| s.nqn.starts_with(HOST_SUBSYSTEM_PREFIX))
    {
        match desired.subsystems.get(&sub.nqn) {
            None => {
                admin.delete_subsystem(&sub.nqn)?;
                out.subsystems_removed += 1;
            }
            Some((_, want)) => {
                for n in &sub.namespaces {
                    let keep = want
                        .get(&n.nsid)
                        .and_then(|x| x.backend_spec(&t))
                        .is_some_and(|spec| spec == n.backend);
                    if !keep {
                        admin.delete_namespace(&sub.nqn, n.nsid)?;
                        out.namespaces_removed += 1;
                    }
                }
            }
        }
    }
    for (nqn, (host, want)) in &desired.subsystems {
        let before: BTreeSet<u32> = present
            .iter()
            .find(|s| &s.nqn == nqn)
            .map(|s| s.namespaces.iter().map(|n| n.nsid).collect())
            .unwrap_or_default();
        let xs: Vec<Export> = want.values().cloned().collect();
        let protected: BTreeSet<u32> = desired
            .write_protected
            .iter()
            .filter(|(n, _)| n == nqn)
            .map(|&(_, nsid)| nsid)
            .collect();
        let mut added = Added::default();
        let keys = cluster.host_keys(host)?;
        let p = Some(&protected);
        ensure_exports_protected(&admin, &t, host, keys.as_ref(), &xs, p, &mut added)?;
        out.namespaces_added += xs.iter().filter(|x| !before.contains(&x.nsid)).count();
    }
    // Copies no job names any more (their cleanup did not reach the
    // target): a copier still writing would write an extent that is free.
    // Listed before the jobs are read: a copy is armed after its job is
    // recorded, so every copy listed of a live job finds it.
    let copies = admin.copies()?;
    let live: BTreeSet<String> = cluster
        .snapshot()?
        .copy_states
        .iter()
        .flat_map(|(u, cs)| {
            cs.value
                .jobs
                .iter()
                .flat_map(move |j| crate::families::target_copy_ids(u, j))
        })
        .collect();
    for c in copies {
        if !live.contains(&c.id) {
            admin.delete_copy(&c.id)?;
            out.copies_removed += 1;
        }
    }
    // Served volumes' subsystems (paths of ANA subsystems), after the
    // host subsystems so an owner finds its extents exported.
    out.subsystems_removed += crate::failover::reconcile_target(cluster, target_id)?;
    if let Some((_, version)) = stale {
        // After the namespaces went: a tree still exported is refused.
        for (device, roots) in cluster.snapshot()?.trees_to_release(target_id) {
            admin.release_roots(&device, &roots)?;
            out.trees_released += roots.len();
        }
        cluster.clear_stale_exports(target_id, version)?;
        out.stale_cleared = true;
    }
    if out != Reconciled::default() {
        tracing::info!(target = target_id, ?out, "target reconciled");
    }
    Ok(out)
}

/// Reconciles one target in the background (after it registered).
pub fn spawn_reconcile(cluster: std::sync::Arc<Cluster>, target: String) {
    tokio::task::spawn_blocking(move || {
        if let Err(e) = reconcile(&cluster, &target) {
            tracing::warn!(target = %target, error = %e, "reconciling the target failed; will retry");
        }
    });
}

/// Reconciles every online target every `RECONCILE_INTERVAL_MS`, one at a
/// time, so exports a failed attach, detach or crash left behind (or
/// lost) converge to the records.
pub async fn reconcile_loop(cluster: std::sync::Arc<Cluster>) {
    let mut tick =
        tokio::time::interval(Duration::from_millis(crate::limits::RECONCILE_INTERVAL_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let c = cluster.clone();
        let _ = tokio::task::spawn_blocking(move || {
            // The leader's work (see `leader`).
            if !c.is_leader() {
                return;
            }
            if let Err(e) =
                crate::snapshots::give_up_abandoned(&c, crate::limits::SNAPSHOT_ABANDONED_MS)
            {
                tracing::warn!(error = %e, "reconcile: cannot give up abandoned snapshots");
            }
            let targets = match c.targets() {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(error = %e, "reconcile: cannot list targets");
                    return;
                }
            };
            for t in targets
                .iter()
                .filter(|t| t.health == crate::model::Health::Online)
            {
                if !c.is_leader() {
                    return;
                }
                if let Err(e) = reconcile(&c, &t.target.id) {
                    tracing::warn!(target = %t.target.id, error = %e, "reconcile failed");
                }
            }
            if let Ok(u) = unfinished(&c) {
                for a in u {
                    tracing::info!(volume = %a.volume, host = %a.host_nqn, state = ?a.state,
                        "attachment unfinished: retry the attach or detach");
                }
            }
        })
        .await;
    }
}

/// Attachments still `attaching` or `detaching` (a crash or a failure
/// interrupted them), for the reconcile loop to report.
pub fn unfinished(cluster: &Cluster) -> Result<Vec<Attachment>, StateError> {
    Ok(cluster
        .attachments()?
        .into_iter()
        .filter(|a| a.state != AttachmentState::Attached)
        .collect())
}
