//! Attachments of volumes to hosts, and what a host's serving process
//! reports about them.

use crate::api::bodies::{attachment_out, attachment_with_plan, ForceQuery, WatchQuery};
use crate::api::errors::ApiError;
use crate::api::extract::{force_of, parse_host, parse_uuid, JsonBody, Segments};
use crate::api::Api;
use crate::program;
use crate::rest::{
    AttachmentOut, EpochBody, ErrorBody, FailedExtentsBody, MissedBody, SessionBody, SyncBody,
};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::Json;
use std::collections::BTreeMap;

/// Attaches a volume to a host: every target holding its extents exports
/// them, as namespaces of that host's subsystem visible to that host
/// alone; the answer is the connection plan. Idempotent: attaching again
/// returns the same plan (200) and re-exports anything missing. If a
/// target fails, whatever this call set up is taken back.
#[utoipa::path(put, path = "/v1/volumes/{uuid}/attachments/{host_nqn}", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), responses((status = 201, description = "attached", body = AttachmentOut), (status = 200, description = "was attached already", body = AttachmentOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "no such volume", body = ErrorBody), (status = 409, description = "a limit was reached, the daemon at a target's admin address is another target (wrong_target), or the cluster requires DH-HMAC-CHAP keys the host does not have (host_keys_required)", body = ErrorBody), (status = 422, description = "a target refused; nothing was left behind", body = ErrorBody), (status = 503, description = "a target is unreachable (nothing was left behind), or the store is busy; retry", body = ErrorBody)))]
pub(in crate::api) async fn put_attachment(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
) -> Result<(StatusCode, Json<AttachmentOut>), ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    let (r, write_epoch, read_only) = api
        .program(move |c| {
            let r = program::attach(c, &uuid, &host)?;
            Ok((r, c.write_epoch(&uuid)?, c.is_read_only(&uuid)?))
        })
        .await?;
    let code = if r.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let mut out = attachment_out(r.attachment, r.plan);
    out.write_epoch = write_epoch;
    out.read_only = read_only;
    Ok((code, Json(out)))
}

#[utoipa::path(get, path = "/v1/volumes/{uuid}/attachments/{host_nqn}", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)"), WatchQuery), responses((status = 200, description = "the attachment and its connection plan", body = AttachmentOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not attached to that host", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn get_attachment(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
    query: Result<Query<WatchQuery>, QueryRejection>,
) -> Result<Json<AttachmentOut>, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    let Query(q) = query.map_err(|e| ApiError::invalid(e.body_text()))?;
    if let Some(after) = q.after_revision {
        // An unknown attachment answers at once.
        let (u, h) = (uuid, host.clone());
        api.run(move |c| c.attachment(&u, &h)).await?;
        // Long poll: one key read per step, not a snapshot.
        let deadline = tokio::time::Instant::now() + WATCH_WAIT;
        loop {
            let rev = api.run(move |c| Ok(c.copy_state(&uuid)?.revision)).await?;
            if rev > after || tokio::time::Instant::now() >= deadline || api.cluster.closing() {
                break;
            }
            tokio::time::sleep(WATCH_STEP).await;
        }
    }
    let out = api
        .run(move |c| attachment_with_plan(c, c.attachment(&uuid, &host)?))
        .await?;
    Ok(Json(out))
}

/// Longest a watching `GET` of an attachment waits: under common proxy and
/// client timeouts (30 s and more).
pub(in crate::api) const WATCH_WAIT: std::time::Duration = std::time::Duration::from_secs(25);
/// How often a watching `GET` looks at the revision: hosts hear of a copy
/// within this, at one key read per step per watcher.
pub(in crate::api) const WATCH_STEP: std::time::Duration = std::time::Duration::from_millis(250);

#[utoipa::path(get, path = "/v1/volumes/{uuid}/attachments", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID")), responses((status = 200, description = "every host the volume is attached to", body = Vec<AttachmentOut>), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "no such volume", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn list_attachments(
    State(api): State<Api>,
    Segments(uuid): Segments<String>,
) -> Result<Json<Vec<AttachmentOut>>, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let out = api
        .run(move |c| {
            c.volume_attachments(&uuid)?
                .into_iter()
                .map(|a| attachment_with_plan(c, a))
                .collect()
        })
        .await?;
    Ok(Json(out))
}

/// Detaches a volume from a host: the targets stop exporting its extents
/// to that host. An unreachable target fails the detach (503; the
/// attachment stays `detaching`, retry) unless `force`.
#[utoipa::path(delete, path = "/v1/volumes/{uuid}/attachments/{host_nqn}", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)"), ForceQuery), responses((status = 204, description = "detached"), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not attached to that host", body = ErrorBody), (status = 409, description = "the daemon at a target's admin address is another target (wrong_target): nothing was changed there", body = ErrorBody), (status = 422, description = "a target refused", body = ErrorBody), (status = 503, description = "a target is unreachable, or the store is busy; retry or force", body = ErrorBody)))]
pub(in crate::api) async fn delete_attachment(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
    query: Result<Query<ForceQuery>, QueryRejection>,
) -> Result<StatusCode, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    let force = force_of(query)?;
    api.program(move |c| program::detach(c, &uuid, &host, force))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A host reports copies it stopped using because I/O to them failed (the
/// volume engine keeps serving from the other copies). The failure is the
/// volume's: it turns degraded and stays so after detach, and every later
/// attach, by any host, carries the list so the stale copies are never read.
/// Failures accumulate until the extent is rebuilt.
#[utoipa::path(put, path = "/v1/volumes/{uuid}/attachments/{host_nqn}/failed-extents", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), request_body = FailedExtentsBody, responses((status = 200, description = "recorded", body = AttachmentOut), (status = 400, description = "invalid input (an extent index out of range)", body = ErrorBody), (status = 404, description = "not attached to that host", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn put_failed_extents(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
    JsonBody(body): JsonBody<FailedExtentsBody>,
) -> Result<Json<AttachmentOut>, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    let out = api
        .run(move |c| {
            let a = c.report_failed_extents(&uuid, &host, &body.failed_extents)?;
            attachment_with_plan(c, a)
        })
        .await?;
    tracing::warn!(volume = %uuid, host = %out.host_nqn, failed = ?out.failed_extents,
        "host reported failed extents; volume degraded");
    Ok(Json(out))
}

/// A host's serving process starts: its session, and the copy-state
/// revision it opened the volume at. A different earlier session of the
/// same host that never handed over its records loses them (its stale
/// copies are then copied whole).
#[utoipa::path(put, path = "/v1/volumes/{uuid}/attachments/{host_nqn}/session", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), request_body = SessionBody, responses((status = 204, description = "recorded"), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not attached to that host", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn put_session(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
    JsonBody(body): JsonBody<SessionBody>,
) -> Result<StatusCode, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    api.run(move |c| c.register_session(&uuid, &host, body.session, body.revision))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A host's serving process stops and hands over what each stale copy
/// missed from it.
#[utoipa::path(put, path = "/v1/volumes/{uuid}/attachments/{host_nqn}/missed", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), request_body = MissedBody, responses((status = 204, description = "merged"), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "no such volume", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn put_missed(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
    JsonBody(body): JsonBody<MissedBody>,
) -> Result<StatusCode, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    let mut extents = BTreeMap::new();
    for (k, v) in body.extents {
        let e: u32 = k
            .parse()
            .map_err(|_| ApiError::invalid(format!("extent {k:?} is not an index")))?;
        extents.insert(e, v);
    }
    api.run(move |c| c.hand_over_missed(&uuid, &host, body.session, &extents))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A host's engine of `session` tags new writes with `epoch` (its
/// attachment's `write_epoch`) and every write it tagged lower has
/// completed: a snapshot waiting on the volume counts it. A session other
/// than the one the host registered is refused (409 `stale_session`).
#[utoipa::path(put, path = "/v1/volumes/{uuid}/attachments/{host_nqn}/epoch", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)")), request_body = EpochBody, responses((status = 204, description = "recorded"), (status = 400, description = "invalid input (an epoch the volume never had)", body = ErrorBody), (status = 404, description = "no such volume, or not attached to that host", body = ErrorBody), (status = 409, description = "the session is not the one serving the volume on that host (stale_session)", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn put_epoch(
    State(api): State<Api>,
    Segments((uuid, host)): Segments<(String, String)>,
    JsonBody(body): JsonBody<EpochBody>,
) -> Result<StatusCode, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    api.run(move |c| c.confirm_epoch(&uuid, &host, body.session, body.epoch, body.held))
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

/// A host writes to job `job`'s copy and every write it issued before has
/// completed. The copier starts once every host writing the volume said so.
#[utoipa::path(put, path = "/v1/volumes/{uuid}/attachments/{host_nqn}/sync/{job}", tag = "attachments", params(("uuid" = String, Path, description = "the volume UUID"), ("host_nqn" = String, Path, description = "the host's NQN (percent-encoded)"), ("job" = u64, Path, description = "the copy job")), request_body = SyncBody, responses((status = 204, description = "recorded"), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "no such volume, or the job is over", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn put_sync(
    State(api): State<Api>,
    Segments((uuid, host, job)): Segments<(String, String, String)>,
    JsonBody(body): JsonBody<SyncBody>,
) -> Result<StatusCode, ApiError> {
    let uuid = parse_uuid(&uuid)?;
    let host = parse_host(&host)?;
    let job = crate::resync::validate_job_id(&job).map_err(|e| ApiError::invalid(e.to_string()))?;
    let known = api
        .run(move |c| {
            if body.failed {
                return c.job_failed_at_host(&uuid, &host, job);
            }
            c.confirm_sync(
                &uuid,
                &host,
                job,
                body.session,
                body.missed_regions.as_deref(),
            )
        })
        .await?;
    if known {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("copy job {job} of volume {uuid} is over"),
        ))
    }
}
