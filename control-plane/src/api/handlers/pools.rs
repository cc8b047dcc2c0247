//! Pools of devices.

use crate::api::errors::ApiError;
use crate::api::extract::{JsonBody, Segments};
use crate::api::Api;
use crate::model::DeviceRef;
use crate::rest::{CapacityOut, DeviceRefBody, ErrorBody, PoolBody, PoolOut};
use crate::state::{Cluster, StateError};
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;

fn pools_out(c: &Cluster) -> Result<Vec<PoolOut>, StateError> {
    let capacity = c.capacity()?;
    Ok(c.pools()?
        .into_iter()
        .map(|p| PoolOut {
            capacity: capacity
                .pools
                .get(&p.name)
                .map(CapacityOut::from)
                .unwrap_or_default(),
            name: p.name,
            devices: p.devices.into_iter().map(DeviceRefBody::from).collect(),
            created_ms: p.created_ms,
        })
        .collect())
}

#[utoipa::path(put, path = "/v1/pools/{name}", tag = "pools", params(("name" = String, Path, description = "pool name")), request_body = PoolBody, responses((status = 201, description = "created", body = PoolOut), (status = 200, description = "already existed with these devices", body = PoolOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 409, description = "conflicts with the current state", body = ErrorBody), (status = 422, description = "cannot be placed or names an unknown device", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn put_pool(
    State(api): State<Api>,
    Segments(name): Segments<String>,
    JsonBody(body): JsonBody<PoolBody>,
) -> Result<(StatusCode, Json<PoolOut>), ApiError> {
    let (existed, out) = api
        .run(move |c| {
            // Only for the status code: a racing identical create makes
            // both answers 201, which is harmless.
            let existed = c.pools()?.iter().any(|p| p.name == name);
            let devices: Vec<DeviceRef> = body
                .devices
                .iter()
                .map(|d| DeviceRef::new(&d.target, &d.device))
                .collect();
            c.create_pool(&name, &devices)?;
            let out = pools_out(c)?
                .into_iter()
                .find(|p| p.name == name)
                .ok_or(StateError::PoolNotFound(name))?;
            Ok((existed, out))
        })
        .await?;
    let status = if existed {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    Ok((status, Json(out)))
}

#[utoipa::path(get, path = "/v1/pools", tag = "pools", responses((status = 200, description = "every pool with its capacity", body = Vec<PoolOut>), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn list_pools(
    State(api): State<Api>,
) -> Result<Json<Vec<PoolOut>>, ApiError> {
    Ok(Json(api.run(pools_out).await?))
}

#[utoipa::path(get, path = "/v1/pools/{name}", tag = "pools", params(("name" = String, Path, description = "pool name")), responses((status = 200, description = "the pool", body = PoolOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not found", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn get_pool(
    State(api): State<Api>,
    Segments(name): Segments<String>,
) -> Result<Json<PoolOut>, ApiError> {
    let out = api
        .run(move |c| {
            crate::model::validate_id("pool name", &name, crate::limits::ID_BYTES_MAX)?;
            pools_out(c)?
                .into_iter()
                .find(|p| p.name == name)
                .ok_or(StateError::PoolNotFound(name))
        })
        .await?;
    Ok(Json(out))
}

#[utoipa::path(delete, path = "/v1/pools/{name}", tag = "pools", params(("name" = String, Path, description = "pool name")), responses((status = 204, description = "deleted"), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "not found", body = ErrorBody), (status = 409, description = "conflicts with the current state", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn delete_pool(
    State(api): State<Api>,
    Segments(name): Segments<String>,
) -> Result<StatusCode, ApiError> {
    api.run(move |c| c.delete_pool(&name)).await?;
    Ok(StatusCode::NO_CONTENT)
}
