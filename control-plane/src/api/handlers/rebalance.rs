//! Evening out capacity across a pool.

use crate::api::errors::ApiError;
use crate::api::extract::JsonBody;
use crate::api::Api;
use crate::rest::{ErrorBody, MoveOut, RebalanceBody, RebalanceOut};
use crate::state::{Cluster, StateError};
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;

fn rebalance_out(
    c: &Cluster,
    scopes: &[Option<String>],
    started: bool,
) -> Result<RebalanceOut, StateError> {
    let mut moves = Vec::new();
    let mut running = 0;
    let mut parallel = std::collections::BTreeSet::new();
    for p in scopes {
        let pool = p.as_deref();
        running += c.moves_running(pool)?;
        for m in c.rebalance_plan(pool)? {
            let name = c
                .volume(&m.volume)
                .map(|v| v.volume.name)
                .unwrap_or_default();
            parallel.insert(m.to.target.clone());
            moves.push(MoveOut {
                volume: m.volume,
                volume_name: name,
                extent: m.extent,
                from: m.from.to_string(),
                to: m.to.to_string(),
                bytes: m.bytes,
            });
        }
    }
    let bytes_total = moves.iter().fold(0u64, |t, m| t.saturating_add(m.bytes));
    let rate = c.rebuild_rate();
    let lanes = (parallel.len() * crate::limits::COPIES_PER_TARGET_MAX).max(1) as u64;
    let eta_s = (rate > 0).then(|| bytes_total.div_ceil(rate.saturating_mul(lanes)));
    Ok(RebalanceOut {
        moves,
        bytes_total,
        eta_s,
        started,
        pending: c
            .rebalance_requests()?
            .into_iter()
            .map(|r| r.pool)
            .collect(),
        moves_running: running,
    })
}

fn rebalance_scopes(c: &Cluster, pool: Option<String>) -> Result<Vec<Option<String>>, StateError> {
    Ok(match pool {
        Some(p) => vec![Some(p)],
        None => c
            .pools()?
            .into_iter()
            .map(|p| Some(p.name))
            .chain([None])
            .collect(),
    })
}

/// Evens out used capacity and extents per device across a pool (or every
/// pool): the plan is recomputed as moves finish, placement rules holding
/// at every step, until nothing is worth moving. `dry_run` only returns
/// the plan.
#[utoipa::path(post, path = "/v1/rebalance", tag = "pools", request_body = RebalanceBody, responses((status = 200, description = "the plan (dry run)", body = RebalanceOut), (status = 202, description = "started", body = RebalanceOut), (status = 400, description = "invalid input", body = ErrorBody), (status = 404, description = "no such pool", body = ErrorBody), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn post_rebalance(
    State(api): State<Api>,
    JsonBody(body): JsonBody<RebalanceBody>,
) -> Result<(StatusCode, Json<RebalanceOut>), ApiError> {
    let out = api
        .run(move |c| {
            if let Some(p) = &body.pool {
                crate::model::validate_id("pool name", p, crate::limits::ID_BYTES_MAX)?;
                if !c.pools()?.iter().any(|x| &x.name == p) {
                    return Err(StateError::PoolNotFound(p.clone()));
                }
            }
            let scopes = rebalance_scopes(c, body.pool.clone())?;
            if !body.dry_run {
                for p in &scopes {
                    c.request_rebalance(p.as_deref())?;
                }
            }
            rebalance_out(c, &scopes, !body.dry_run)
        })
        .await?;
    let status = if out.started {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(out)))
}

/// Rebalancing under way: the scopes pending, moves running and the plan
/// left.
#[utoipa::path(get, path = "/v1/rebalance", tag = "pools", responses((status = 200, description = "what is left to move", body = RebalanceOut), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(in crate::api) async fn get_rebalance(
    State(api): State<Api>,
) -> Result<Json<RebalanceOut>, ApiError> {
    let out = api
        .run(move |c| {
            let scopes = rebalance_scopes(c, None)?;
            rebalance_out(c, &scopes, false)
        })
        .await?;
    Ok(Json(out))
}
