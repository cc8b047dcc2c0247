//! `GET /metrics`: the cluster in Prometheus text; `GET /v1/events`: what
//! this control plane wants an operator to see.

use crate::api::errors::ApiError;
use crate::api::Api;
use crate::model::{Health, VolumeStatus};
use crate::rest::{ErrorBody, EventOut};
use crate::state::{Cluster, StateError};
use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::Json;
use nvpool_api::prometheus::{Kind, Text};

pub(super) fn render_metrics(c: &Cluster) -> Result<String, StateError> {
    let volumes = c.volumes()?;
    let targets = c.targets()?;
    let cap = c.capacity()?;
    let mut out = Text::new();
    out.family("nvpool_volumes", Kind::Gauge, "Volumes by status.");
    for s in [
        VolumeStatus::Online,
        VolumeStatus::Degraded,
        VolumeStatus::Offline,
    ] {
        let n = volumes.iter().filter(|v| v.status == s).count();
        out.sample("nvpool_volumes", &[("status", s.name())], n);
    }
    let snapshots = c.snapshot()?.snapshots;
    let name = "nvpool_snapshots";
    let help = "Snapshots of thin volumes by state (creating: waiting for engines or targets).";
    out.family(name, Kind::Gauge, help);
    for (state, label) in [
        (crate::snapshots::SnapshotState::Creating, "creating"),
        (crate::snapshots::SnapshotState::Ready, "ready"),
    ] {
        let n = snapshots
            .values()
            .filter(|r| r.value.state == state)
            .count();
        out.sample(name, &[("state", label)], n);
    }
    let name = "nvpool_capacity_bytes";
    out.family(name, Kind::Gauge, "Device bytes in the cluster.");
    for (kind, v) in [
        ("total", cap.total.total_bytes),
        ("used", cap.total.used_bytes),
        ("free", cap.total.free_bytes),
    ] {
        out.sample(name, &[("kind", kind)], v);
    }
    // Per pool, real bytes against what was promised: a grain pool's
    // extents take space only when written (design/thin-snapshots.md T4).
    let name = "nvpool_pool_bytes";
    let help = "Bytes of a pool's devices (pool=\"(unpooled)\": the devices in none): \
                real capacity, really used, and provisioned (placed extents).";
    out.family(name, Kind::Gauge, help);
    let pools = cap.pools.iter().map(|(p, c)| (p.as_str(), c));
    for (pool, c) in pools.chain(std::iter::once(("(unpooled)", &cap.unpooled))) {
        for (kind, v) in [
            ("capacity", c.total_bytes),
            ("used", c.used_bytes),
            ("provisioned", c.provisioned_bytes),
        ] {
            out.sample(name, &[("pool", pool), ("kind", kind)], v);
        }
    }
    let name = "nvpool_target_up";
    let help = "Whether a target heartbeats (1) or is offline (0).";
    out.family(name, Kind::Gauge, help);
    for t in &targets {
        let up = u8::from(t.health == Health::Online);
        out.sample(name, &[("target", &t.target.id)], up);
    }
    let (mut running, mut copied, mut stale) = (0u64, 0u64, 0u64);
    for v in &volumes {
        running += v.jobs.len() as u64;
        stale += v.failed_extents.len() as u64;
        copied = v
            .jobs
            .iter()
            .fold(copied, |t, j| t.saturating_add(j.bytes_copied));
    }
    // Finished copies, from one read of every copy-state record.
    for cs in c.snapshot()?.copy_states.values() {
        copied = cs
            .value
            .history
            .iter()
            .fold(copied, |t, r| t.saturating_add(r.bytes_copied));
    }
    let totals: [(&str, &str, u64); 4] = [
        ("nvpool_copies_running", "Copy jobs under way.", running),
        (
            "nvpool_stale_extents",
            "Extent copies not in sync (never read).",
            stale,
        ),
        (
            "nvpool_copy_bytes",
            "Bytes copied by the running and the remembered copy jobs.",
            copied,
        ),
        (
            "nvpool_targets",
            "Registered targets.",
            targets.len() as u64,
        ),
    ];
    for (name, help, v) in totals {
        out.family(name, Kind::Gauge, help).sample(name, &[], v);
    }
    Ok(out.finish())
}

/// This control plane's events, newest last: a pool whose real use
/// crossed 80 % or 90 % of its capacity. Kept in memory (the last 256):
/// each control plane lists its own, and a restart forgets them.
#[utoipa::path(get, path = "/v1/events", tag = "operations", responses((status = 200, description = "the events, oldest first", body = Vec<EventOut>)))]
pub(super) async fn events(State(api): State<Api>) -> Json<Vec<EventOut>> {
    let list = api.cluster.events().list();
    Json(
        list.into_iter()
            .map(|e| EventOut {
                time_ms: e.time_ms,
                kind: e.kind.to_owned(),
                message: e.message,
            })
            .collect(),
    )
}

#[utoipa::path(get, path = "/metrics", tag = "operations", responses((status = 200, description = "Prometheus text format", body = String, content_type = "text/plain"), (status = 503, description = "store busy or unavailable; retry", body = ErrorBody)))]
pub(super) async fn metrics(State(api): State<Api>) -> Result<Response, ApiError> {
    let text = api.run(render_metrics).await?;
    Ok((
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        text,
    )
        .into_response())
}
