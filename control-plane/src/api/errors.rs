//! [`ApiError`], the body of every failed request, and the one mapping
//! from cluster and target errors to HTTP statuses.

use crate::api::bodies::spec_body;
use crate::placement::PlacementError;
use crate::program::ProgramError;
use crate::state::StateError;
use crate::store::StoreError;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use nvpool_api::rest::ErrorBody;
use serde_json::{json, Value};

/// A failed request: its status, and the body every failure answers with
/// (`nvpool-api`'s [`ErrorBody`], always with `details`, an object).
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    body: ErrorBody,
}

impl ApiError {
    pub(super) fn new(
        status: StatusCode,
        kind: &'static str,
        message: impl Into<String>,
    ) -> ApiError {
        let mut body = ErrorBody::new(kind, message);
        body.details = json!({});
        ApiError { status, body }
    }

    pub(super) fn with(mut self, details: Value) -> ApiError {
        self.body.details = details;
        self
    }

    pub(super) fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid", message)
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn kind(&self) -> &str {
        &self.body.kind
    }

    /// The one mapping from cluster errors to HTTP: 400 for invalid input,
    /// 404 for unknown objects, 409 for conflicts with the current state,
    /// 422 for requests the cluster cannot satisfy (placement), 503 for a
    /// busy or failed store, 500 for corruption and bugs only.
    pub fn from_state(e: StateError) -> ApiError {
        use StatusCode as S;
        let message = e.to_string();
        let (status, kind, details) = match &e {
            StateError::Invalid(_) => (S::BAD_REQUEST, "invalid", json!({})),
            StateError::Placement(p) => match p {
                PlacementError::Invalid(_) => (S::BAD_REQUEST, "invalid", json!({})),
                PlacementError::NotEnoughTargets { need, have, pool } => (
                    S::UNPROCESSABLE_ENTITY,
                    "not_enough_targets",
                    json!({"need": need, "have": have, "pool": pool}),
                ),
                PlacementError::NoSpace {
                    need,
                    have,
                    extent_bytes,
                    pool,
                } => (
                    S::UNPROCESSABLE_ENTITY,
                    "no_space",
                    json!({"need": need, "have": have, "extent_bytes": extent_bytes, "pool": pool}),
                ),
                PlacementError::NoDevicesOfKind { provisioning, pool } => (
                    S::UNPROCESSABLE_ENTITY,
                    "no_devices_of_kind",
                    json!({"provisioning": provisioning, "pool": pool}),
                ),
                // The rest come from loading stored extents: a bug or a
                // corrupt store, never the request.
                _ => (S::INTERNAL_SERVER_ERROR, "inconsistent", json!({})),
            },
            StateError::Store(s) => match s {
                StoreError::Backend { .. } => (S::SERVICE_UNAVAILABLE, "unavailable", json!({})),
                StoreError::Unavailable { store, .. } => (
                    S::SERVICE_UNAVAILABLE,
                    "unavailable",
                    json!({"store": store}),
                ),
                _ => (S::INTERNAL_SERVER_ERROR, "store", json!({})),
            },
            StateError::TargetNotFound(id) => (S::NOT_FOUND, "not_found", json!({"target": id})),
            StateError::PoolNotFound(p) => (S::NOT_FOUND, "not_found", json!({"pool": p})),
            StateError::VolumeNotFound(v) => (S::NOT_FOUND, "not_found", json!({"volume": v})),
            StateError::UuidConflict {
                uuid,
                existing,
                provisioning,
            } => (
                S::CONFLICT,
                "uuid_conflict",
                json!({"uuid": uuid, "existing": spec_body(existing, *provisioning)}),
            ),
            StateError::NameTaken { name, uuid } => (
                S::CONFLICT,
                "name_taken",
                json!({"name": name, "uuid": uuid}),
            ),
            StateError::PoolConflict(p) => (S::CONFLICT, "pool_conflict", json!({"pool": p})),
            StateError::UnknownDevice(d) => (
                S::UNPROCESSABLE_ENTITY,
                "unknown_device",
                json!({"device": d}),
            ),
            StateError::DeviceInPool { device, pool } => (
                S::CONFLICT,
                "device_in_pool",
                json!({"device": device, "pool": pool}),
            ),
            StateError::DeviceInUse { device, .. } => {
                (S::CONFLICT, "device_in_use", json!({"device": device}))
            }
            StateError::PoolInUse { pool, volumes } => (
                S::CONFLICT,
                "pool_in_use",
                json!({"pool": pool, "volumes": volumes}),
            ),
            StateError::AddressTaken { kind, addr, target } => (
                S::CONFLICT,
                "address_taken",
                json!({"field": kind.field(), "addr": addr.to_string(), "target": target}),
            ),
            StateError::TargetInUse { target, extents } => (
                S::CONFLICT,
                "target_in_use",
                json!({"target": target, "extents": extents}),
            ),
            StateError::Shrink {
                size_bytes,
                requested,
                ..
            } => (
                S::CONFLICT,
                "shrink",
                json!({"size_bytes": size_bytes, "requested": requested}),
            ),
            StateError::TooMany { what, max } => {
                (S::CONFLICT, "limit", json!({"what": what, "max": max}))
            }
            StateError::LastInSyncCopy { volume, extent } => (
                S::CONFLICT,
                "last_in_sync_copy",
                json!({"volume": volume, "extent": extent}),
            ),
            StateError::Attached { volume, hosts } => (
                S::CONFLICT,
                "attached",
                json!({"volume": volume, "hosts": hosts}),
            ),
            StateError::Deleting(volume) => (S::CONFLICT, "deleting", json!({"volume": volume})),
            StateError::NoHostKeys(host) => (S::NOT_FOUND, "not_found", json!({"host_nqn": host})),
            StateError::HostKeysRequired(host) => {
                (S::CONFLICT, "host_keys_required", json!({"host_nqn": host}))
            }
            StateError::NotAttached { volume, host } => (
                S::NOT_FOUND,
                "not_found",
                json!({"volume": volume, "host_nqn": host}),
            ),
            StateError::Contention { attempts } => (
                S::SERVICE_UNAVAILABLE,
                "contention",
                json!({"attempts": attempts}),
            ),
            StateError::Conflict { kind, .. } => (S::CONFLICT, *kind, json!({})),
            StateError::Unprocessable { kind, .. } => (S::UNPROCESSABLE_ENTITY, *kind, json!({})),
            StateError::StaleSession {
                volume,
                host,
                session,
            } => (
                S::CONFLICT,
                "stale_session",
                json!({"volume": volume, "host_nqn": host, "session": session}),
            ),
            StateError::SnapshotNotFound { volume, name } => (
                S::NOT_FOUND,
                "not_found",
                json!({"volume": volume, "snapshot": name}),
            ),
            // Its trees were freed and its record is gone: taking it again
            // starts afresh.
            StateError::SnapshotFailed {
                volume,
                name,
                reason,
            } => (
                S::SERVICE_UNAVAILABLE,
                "snapshot_failed",
                json!({"volume": volume, "snapshot": name, "reason": reason}),
            ),
            // Only the leader answers this call: ask another endpoint.
            StateError::NotLeader(_) => (S::SERVICE_UNAVAILABLE, "not_leader", json!({})),
            StateError::Corrupt { .. } | StateError::Inconsistent(_) => {
                (S::INTERNAL_SERVER_ERROR, "inconsistent", json!({}))
            }
        };
        if status.is_server_error() {
            tracing::warn!(error = %e, kind, "request failed");
        }
        ApiError::new(status, kind, message).with(details)
    }
}

impl ApiError {
    /// Target failures: 503 when a target cannot be reached (retry later),
    /// 422 when one refused (the request cannot be satisfied as things are).
    pub fn from_program(e: ProgramError) -> ApiError {
        let message = e.to_string();
        match e {
            ProgramError::State(s) => ApiError::from_state(s),
            ProgramError::Unreachable { target, addr, .. } => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "target_unreachable",
                message,
            )
            .with(json!({"target": target, "admin_addr": addr.to_string()})),
            ProgramError::Refused { target, what, .. } => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "target_refused", message)
                    .with(json!({"target": target, "what": what}))
            }
            // The record and the daemon at its address disagree: nothing
            // was changed; an operator must fix the registration.
            ProgramError::WrongTarget {
                target,
                addr,
                found,
            } => ApiError::new(StatusCode::CONFLICT, "wrong_target", message)
                .with(json!({"target": target, "admin_addr": addr.to_string(), "found": found})),
        }
    }
}

impl From<StateError> for ApiError {
    fn from(e: StateError) -> ApiError {
        ApiError::from_state(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(&self.body)).into_response();
        match self.status {
            StatusCode::UNAUTHORIZED => {
                r.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            StatusCode::SERVICE_UNAVAILABLE => {
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            _ => {}
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_statuses() {
        let cases: Vec<(StateError, u16, &str)> = vec![
            (
                StateError::Invalid(crate::model::ModelError::InvalidSize("0".into())),
                400,
                "invalid",
            ),
            (StateError::VolumeNotFound("v".into()), 404, "not_found"),
            (StateError::PoolConflict("p".into()), 409, "pool_conflict"),
            (
                StateError::Placement(PlacementError::NoSpace {
                    need: 2,
                    have: 1,
                    extent_bytes: 1 << 20,
                    pool: None,
                }),
                422,
                "no_space",
            ),
            (StateError::Contention { attempts: 32 }, 503, "contention"),
            (
                StateError::NotLeader(crate::leader::NotLeader),
                503,
                "not_leader",
            ),
            (
                StateError::Store(StoreError::Backend {
                    op: "commit",
                    source: "disk full".into(),
                }),
                503,
                "unavailable",
            ),
            (StateError::Inconsistent("x".into()), 500, "inconsistent"),
        ];
        for (e, status, kind) in cases {
            let a = ApiError::from_state(e);
            assert_eq!((a.status().as_u16(), a.kind()), (status, kind));
        }
        let r = ApiError::from_state(StateError::Contention { attempts: 1 }).into_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }
}
