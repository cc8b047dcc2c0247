//! Hosts' DH-HMAC-CHAP keys, held by the control plane
//! (docs/ARCHITECTURE.md C24).
//!
//! An admin sets a host's keys once (`PUT /v1/hosts/{host_nqn}/dhchap`);
//! every target that exports anything to that host — the host's own
//! subsystem for attached volumes, and the subsystems of volumes served to
//! it — then requires them on every queue the host opens. The keys travel
//! with each programming call (`program::ensure_exports`,
//! `failover::ensure_path`), so a target that is added, restarted or
//! repaired later gets them from reconciliation as well; a change is also
//! rolled out at once ([`roll_out`]) and whatever could not be reached
//! then converges on its next reconciliation.
//!
//! Targets show, beside each host, the `key_id` of the keys it holds: a
//! random label drawn at every change, which tells the control plane that
//! a target holds older keys without secrets ever being read back.

use crate::limits::HOST_KEY_ROLLOUT_PARALLEL;
use crate::model::{Health, ModelError};
use crate::program::{ensure_host_keys, ProgramError, TargetAdmin};
use crate::rest::{HostKeysBody, HostKeysOut, KeyRollout, PendingTarget, Secret};
use crate::state::{Cluster, HostKeys, StateError};
use nvpool_wire::dhchap::{DhGroup, HashId};

/// Checks a body (syntax of both secrets, hash and group names) and turns
/// it into the record to store; the `key_id` and time are the store's to
/// set. Errors never quote a secret.
pub fn check(host: &str, body: &HostKeysBody) -> Result<HostKeys, ModelError> {
    crate::attach::validate_host_nqn(host)?;
    let secret = |text: &str, field: &str| -> Result<Secret, ModelError> {
        text.parse::<nvpool_wire::dhchap::Secret>()
            .map_err(|e| ModelError::Invalid(format!("{field}: {e}")))?;
        Secret::new(text).map_err(|e| ModelError::Invalid(format!("{field}: {e}")))
    };
    let dhchap_key = secret(&body.dhchap_key, "dhchap_key")?;
    let dhchap_ctrl_key = match &body.dhchap_ctrl_key {
        Some(c) if c == &body.dhchap_key => {
            return Err(ModelError::Invalid(
                "dhchap_ctrl_key: the controller's secret must differ from the host's".into(),
            ))
        }
        Some(c) => Some(secret(c, "dhchap_ctrl_key")?),
        None => None,
    };
    if let Some(h) = &body.dhchap_hash {
        HashId::from_name(h).ok_or_else(|| {
            ModelError::Invalid(format!(
                "dhchap_hash {h:?}: expected sha256, sha384 or sha512"
            ))
        })?;
    }
    if let Some(g) = &body.dhchap_dhgroup {
        DhGroup::from_name(g).ok_or_else(|| {
            ModelError::Invalid(format!(
                "dhchap_dhgroup {g:?}: expected null, ffdhe2048, ffdhe3072, ffdhe4096, \
                 ffdhe6144 or ffdhe8192"
            ))
        })?;
    }
    Ok(HostKeys {
        host: host.to_owned(),
        key_id: String::new(),
        dhchap_key,
        dhchap_ctrl_key,
        dhchap_hash: body.dhchap_hash.clone(),
        dhchap_dhgroup: body.dhchap_dhgroup.clone(),
        updated_ms: 0,
    })
}

/// The answer for `k`: everything but the secrets.
pub fn out(k: &HostKeys, rollout: Option<KeyRollout>) -> HostKeysOut {
    HostKeysOut {
        host_nqn: k.host.clone(),
        key_id: k.key_id.clone(),
        bidirectional: k.dhchap_ctrl_key.is_some(),
        dhchap_hash: k.dhchap_hash.clone(),
        dhchap_dhgroup: k.dhchap_dhgroup.clone().unwrap_or_else(|| "null".into()),
        updated_ms: k.updated_ms,
        rollout,
    }
}

/// Makes every target that exports anything to `host` hold `keys` for it
/// (`None`: no keys). Targets are changed [`HOST_KEY_ROLLOUT_PARALLEL`] at
/// a time; one that is offline or fails is reported as pending, for
/// reconciliation to finish.
pub fn roll_out(
    cluster: &Cluster,
    host: &str,
    keys: Option<&HostKeys>,
) -> Result<KeyRollout, StateError> {
    let targets = cluster.targets()?;
    let mut results: Vec<(String, Result<bool, ProgramError>)> = Vec::new();
    for round in targets.chunks(HOST_KEY_ROLLOUT_PARALLEL) {
        std::thread::scope(|scope| {
            let handles: Vec<_> = round
                .iter()
                .map(|tv| scope.spawn(move || roll_out_on(cluster, tv, host, keys)))
                .collect();
            for (tv, h) in round.iter().zip(handles) {
                let r = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
                results.push((tv.target.id.clone(), r));
            }
        });
    }
    let mut rollout = KeyRollout::default();
    for (target, r) in results {
        match r {
            Ok(true) => rollout.updated.push(target),
            Ok(false) => {}
            Err(e) => rollout.pending.push(PendingTarget {
                target,
                error: e.to_string(),
            }),
        }
    }
    Ok(rollout)
}

/// [`roll_out`] on one target: whether it exports anything to `host`.
fn roll_out_on(
    cluster: &Cluster,
    tv: &crate::state::TargetView,
    host: &str,
    keys: Option<&HostKeys>,
) -> Result<bool, ProgramError> {
    if tv.health != Health::Online {
        return Err(ProgramError::Unreachable {
            target: tv.target.id.clone(),
            addr: tv.target.admin_addr,
            message: "offline (no recent heartbeat)".into(),
        });
    }
    let admin = TargetAdmin::new(cluster, &tv.target)?;
    let mut exports = false;
    for s in admin.subsystems()? {
        if !s.allowed_hosts.iter().any(|h| h == host) {
            continue;
        }
        exports = true;
        ensure_host_keys(&admin, &s.nqn, host, keys, &s.host_auth)?;
    }
    Ok(exports)
}

/// Fresh DH-HMAC-CHAP keys for one of nvpool's own initiators (a served
/// volume's owner, a target's copier; `auth::is_internal_host`): a random
/// 256-bit host secret and a random controller secret (bidirectional, so
/// the initiator checks the extent's target too), in the standard
/// `DHHC-1:01:…:` form, stored as `host`'s keys under a fresh `key_id`.
/// Every target exporting to `host` then requires them ([`roll_out`]
/// sets them on the ones already exporting; attach and reconciliation
/// hand them to the others); the initiator gets them from the control
/// plane over its own target's admin API only.
pub fn draw_internal(cluster: &Cluster, host: &str) -> Result<HostKeys, StateError> {
    let draw = || -> Result<Secret, StateError> {
        let mut key = [0u8; 32];
        nvpool_rt::random::fill(&mut key).map_err(|e| {
            StateError::Store(crate::store::StoreError::Backend {
                op: "drawing a DH-HMAC-CHAP secret",
                source: e.into(),
            })
        })?;
        // The wire crate's secret wipes its copy when dropped.
        let secret = nvpool_wire::dhchap::Secret::new(&key, Some(HashId::Sha256));
        key.fill(0);
        let text = secret
            .map_err(|e| StateError::Invalid(ModelError::Invalid(e.to_string())))?
            .to_dhhc();
        Secret::new(text).map_err(|e| StateError::Invalid(ModelError::Invalid(e.to_string())))
    };
    let keys = HostKeys {
        host: host.to_owned(),
        key_id: String::new(),
        dhchap_key: draw()?,
        dhchap_ctrl_key: Some(draw()?),
        dhchap_hash: None,
        dhchap_dhgroup: None,
        updated_ms: 0,
    };
    cluster.set_host_keys(keys)
}

/// The keys of one of nvpool's own initiators: the ones it has, or fresh
/// ones ([`draw_internal`]) when it has none or `fresh` (an owner that
/// just took over: the keys of an earlier term of the same target stop
/// working).
pub fn internal_keys(cluster: &Cluster, host: &str, fresh: bool) -> Result<HostKeys, StateError> {
    match cluster.host_keys(host)? {
        Some(k) if !fresh => Ok(k),
        _ => draw_internal(cluster, host),
    }
}

/// Forgets the keys of one of nvpool's own initiators once nothing exports
/// to it any more (a fenced owner); none is fine.
pub fn forget_internal(cluster: &Cluster, host: &str) -> Result<(), StateError> {
    match cluster.remove_host_keys(host) {
        Ok(()) | Err(StateError::NoHostKeys(_)) => Ok(()),
        Err(e) => Err(e),
    }
}
