//! What a request carries, as typed values: path segments, JSON bodies
//! and query options, each refusal a JSON [`ApiError`] like every other.

use crate::api::bodies::ForceQuery;
use crate::api::errors::ApiError;
use crate::model::Uuid;
use axum::extract::rejection::QueryRejection;
use axum::extract::{FromRequest, Query, Request};

/// Path parameters whose rejections (a segment that is not UTF-8 once
/// percent-decoded, say) are JSON errors like every other 400.
#[derive(Debug)]
pub(super) struct Segments<T>(pub(super) T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned + Send> axum::extract::FromRequestParts<S>
    for Segments<T>
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        Ok(Segments(crate::httpd::path(parts, state).await?))
    }
}

impl From<crate::httpd::Rejection> for ApiError {
    fn from(r: crate::httpd::Rejection) -> ApiError {
        ApiError::new(r.status, r.kind, r.message)
    }
}

/// A JSON request body as `T` ([`crate::httpd::json_body`]: 415 without
/// a JSON content type; 400 for anything that does not parse, names a key
/// twice, is an array where the schema has an object, or does not fit
/// the request type).
#[derive(Debug)]
pub(super) struct JsonBody<T>(pub(super) T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match crate::httpd::json_body(req, state, false).await? {
            Some(v) => Ok(JsonBody(v)),
            None => Err(ApiError::invalid("a JSON body is required")),
        }
    }
}

/// [`JsonBody`] for a body that may be left out: an empty body is
/// `None`; any other is held to the same rules.
#[derive(Debug)]
pub(super) struct OptionalJsonBody<T>(pub(super) Option<T>);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for OptionalJsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        Ok(OptionalJsonBody(
            crate::httpd::json_body(req, state, true).await?,
        ))
    }
}

pub(super) fn parse_uuid(s: &str) -> Result<Uuid, ApiError> {
    s.parse::<Uuid>()
        .map_err(|e| ApiError::invalid(e.to_string()))
}

pub(super) fn force_of(q: Result<Query<ForceQuery>, QueryRejection>) -> Result<bool, ApiError> {
    q.map(|Query(q)| q.force)
        .map_err(|e| ApiError::invalid(e.body_text()))
}

pub(super) fn parse_host(s: &str) -> Result<String, ApiError> {
    crate::attach::validate_host_nqn(s).map_err(|e| ApiError::invalid(e.to_string()))?;
    Ok(s.to_owned())
}
