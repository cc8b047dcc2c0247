//! Who may call what: the bearer token of every request checked against
//! [`auth::access`] before any handler runs.

use crate::api::errors::ApiError;
use crate::api::extract::parse_uuid;
use crate::api::Api;
use crate::auth::{self, Access};
use axum::extract::{MatchedPath, RawPathParams, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::RequestPartsExt as _;

/// Checks the caller's bearer token against the route's entry in
/// [`auth::access`] before any handler runs (a `route_layer`, so it sees
/// the matched route template). 401: no known token; 403: a known token
/// whose role may not make this call.
pub(super) async fn authorize(State(api): State<Api>, req: Request, next: Next) -> Response {
    let (mut parts, body) = req.into_parts();
    let Some(template) = parts
        .extensions
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_owned())
    else {
        return next.run(Request::from_parts(parts, body)).await;
    };
    let need = auth::access(parts.method.as_str(), &template);
    let tokens = api.auth.current();
    if need == Access::Public {
        return next.run(Request::from_parts(parts, body)).await;
    }
    if tokens.is_empty() {
        // No tokens (loopback only): every role, but still only the
        // owners the control plane issued.
        if let Err(refused) = check_own_initiators(&api, need, &template, &mut parts).await {
            return refused;
        }
        return next.run(Request::from_parts(parts, body)).await;
    }
    let presented = crate::httpd::bearer_of(&parts.headers)
        .ok()
        .flatten()
        .and_then(|t| std::str::from_utf8(t).ok());
    let Some(presented) = presented else {
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "this call needs an Authorization: Bearer token",
        )
        .into_response();
    };
    let Some(who) = tokens.identify(presented) else {
        note_refused_token(&parts.method, &template);
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "the bearer token is not known",
        )
        .into_response();
    };
    let (host, id) = if matches!(need, Access::Host | Access::Report | Access::Target) {
        match parts.extract::<RawPathParams>().await {
            Ok(params) => {
                let param = |name: &str| {
                    params
                        .iter()
                        .find(|(k, _)| *k == name)
                        .map(|(_, v)| v.to_owned())
                };
                (param("host_nqn"), param("id"))
            }
            Err(e) => return ApiError::invalid(e.body_text()).into_response(),
        }
    } else {
        (None, None)
    };
    if !auth::permits(who, need, host.as_deref(), id.as_deref()) {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!(
                "a {} token may not call {} {template}",
                who.role().name(),
                parts.method
            ),
        )
        .into_response();
    }
    if let Err(refused) = check_own_initiators(&api, need, &template, &mut parts).await {
        return refused;
    }
    // The registration checks a bound target token against the body's id.
    parts.extensions.insert(who.clone());
    next.run(Request::from_parts(parts, body)).await
}

/// What no token may do for nvpool's own initiators ([`auth::reserved`]),
/// and a report for an owner NQN the control plane did not issue
/// ([`auth::owner_issued`]): 403 before any handler runs, so nothing is
/// recorded.
pub(super) async fn check_own_initiators(
    api: &Api,
    need: Access,
    template: &str,
    parts: &mut axum::http::request::Parts,
) -> Result<(), Response> {
    if !template.contains("{host_nqn}") || matches!(need, Access::Public | Access::Read) {
        return Ok(());
    }
    let params = parts
        .extract::<RawPathParams>()
        .await
        .map_err(|e| ApiError::invalid(e.body_text()).into_response())?;
    let param = |name: &str| {
        params
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_owned())
    };
    let Some(host) = param("host_nqn") else {
        return Ok(());
    };
    let forbidden =
        |why: String| ApiError::new(StatusCode::FORBIDDEN, "forbidden", why).into_response();
    if let Some(why) = auth::reserved(need, template, Some(&host)) {
        return Err(forbidden(why));
    }
    if need != Access::Report || !host.starts_with(crate::paths::OWNER_HOST_PREFIX) {
        return Ok(());
    }
    let volume = parse_uuid(&param("uuid").unwrap_or_default()).map_err(|e| e.into_response())?;
    match api
        .run(move |c| auth::owner_issued(c, &volume, &host))
        .await
    {
        Ok(Ok(())) => Ok(()),
        Ok(Err(why)) => Err(forbidden(why)),
        Err(e) => Err(e.into_response()),
    }
}

/// Logs an unknown token at most once per [`REFUSED_TOKEN_LOG_INTERVAL_MS`],
/// with the number of refusals since the last line: a client looping on a
/// wrong token cannot flood the log. The token is never logged.
pub(super) fn note_refused_token(method: &axum::http::Method, template: &str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST_MS: AtomicU64 = AtomicU64::new(0);
    static REFUSED: AtomicU64 = AtomicU64::new(0);
    let refused = REFUSED.fetch_add(1, Ordering::Relaxed) + 1;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let last = LAST_MS.load(Ordering::Relaxed);
    if now.saturating_sub(last) >= REFUSED_TOKEN_LOG_INTERVAL_MS
        && LAST_MS
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        REFUSED.fetch_sub(refused, Ordering::Relaxed);
        tracing::warn!(%method, route = template, refused, "unknown bearer token refused");
    }
}

/// How often a refused token may be logged.
pub(super) const REFUSED_TOKEN_LOG_INTERVAL_MS: u64 = 10_000;
