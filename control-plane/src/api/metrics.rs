//! `GET /metrics`: the cluster in Prometheus text.

use crate::api::errors::ApiError;
use crate::api::Api;
use crate::model::{Health, VolumeStatus};
use crate::state::{Cluster, StateError};
use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use std::fmt::Write as _;

pub(super) fn status_name(s: VolumeStatus) -> &'static str {
    match s {
        VolumeStatus::Online => "online",
        VolumeStatus::Degraded => "degraded",
        VolumeStatus::Offline => "offline",
    }
}

/// Escapes a Prometheus label value.
pub(super) fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

pub(super) fn render_metrics(c: &Cluster) -> Result<String, StateError> {
    let volumes = c.volumes()?;
    let targets = c.targets()?;
    let cap = c.capacity()?;
    let mut out = String::new();
    // `write!` to a String cannot fail: the results are ignored.
    let _ = writeln!(out, "# HELP nvpool_volumes Volumes by status.");
    let _ = writeln!(out, "# TYPE nvpool_volumes gauge");
    for s in [
        VolumeStatus::Online,
        VolumeStatus::Degraded,
        VolumeStatus::Offline,
    ] {
        let n = volumes.iter().filter(|v| v.status == s).count();
        let _ = writeln!(out, "nvpool_volumes{{status=\"{}\"}} {n}", status_name(s));
    }
    let _ = writeln!(
        out,
        "# HELP nvpool_capacity_bytes Device bytes in the cluster."
    );
    let _ = writeln!(out, "# TYPE nvpool_capacity_bytes gauge");
    for (kind, v) in [
        ("total", cap.total.total_bytes),
        ("used", cap.total.used_bytes),
        ("free", cap.total.free_bytes),
    ] {
        let _ = writeln!(out, "nvpool_capacity_bytes{{kind=\"{kind}\"}} {v}");
    }
    let _ = writeln!(
        out,
        "# HELP nvpool_target_up Whether a target heartbeats (1) or is offline (0)."
    );
    let _ = writeln!(out, "# TYPE nvpool_target_up gauge");
    for t in &targets {
        let up = u8::from(t.health == Health::Online);
        let _ = writeln!(
            out,
            "nvpool_target_up{{target=\"{}\"}} {up}",
            label(&t.target.id)
        );
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
    let _ = writeln!(out, "# HELP nvpool_copies_running Copy jobs under way.");
    let _ = writeln!(out, "# TYPE nvpool_copies_running gauge");
    let _ = writeln!(out, "nvpool_copies_running {running}");
    let _ = writeln!(
        out,
        "# HELP nvpool_stale_extents Extent copies not in sync (never read)."
    );
    let _ = writeln!(out, "# TYPE nvpool_stale_extents gauge");
    let _ = writeln!(out, "nvpool_stale_extents {stale}");
    let _ = writeln!(
        out,
        "# HELP nvpool_copy_bytes Bytes copied by the running and the remembered copy jobs."
    );
    let _ = writeln!(out, "# TYPE nvpool_copy_bytes gauge");
    let _ = writeln!(out, "nvpool_copy_bytes {copied}");
    let _ = writeln!(out, "# HELP nvpool_targets Registered targets.");
    let _ = writeln!(out, "# TYPE nvpool_targets gauge");
    let _ = writeln!(out, "nvpool_targets {}", targets.len());
    Ok(out)
}

#[utoipa::path(get, path = "/metrics", tag = "operations", responses((status = 200, description = "Prometheus text format", body = String, content_type = "text/plain"), (status = 503, description = "store busy or unavailable; retry", body = ApiError)))]
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
