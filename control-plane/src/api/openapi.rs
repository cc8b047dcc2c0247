//! The OpenAPI document: the handlers' annotations, and what the server
//! checks (token roles, patterns, ranges) written into it from the same
//! tables the server enforces.

use super::handlers::{
    self, attachments, exports, hosts, pools, rebalance, rollback, snapshot_groups, snapshots,
    targets, volumes,
};
use super::metrics;
use crate::auth::{self, Access};
use crate::model::TargetState;
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "nvpool control plane",
        description = "Targets, pools and volumes of an nvpool cluster. Errors are \
                       {kind, message, details}; sizes are bytes."
    ),
    paths(
        handlers::healthz, metrics::metrics, metrics::events, handlers::openapi,
        targets::register_target,
        targets::heartbeat, targets::list_targets, targets::get_target, pools::put_pool,
        pools::list_pools, pools::get_pool, pools::delete_pool, volumes::put_volume,
        volumes::list_volumes, volumes::get_volume, volumes::resize_volume,
        volumes::delete_volume, attachments::put_attachment, attachments::get_attachment,
        attachments::list_attachments, attachments::delete_attachment,
        attachments::put_failed_extents, attachments::put_session, attachments::put_missed,
        attachments::put_sync, attachments::put_epoch, snapshots::post_snapshot,
        snapshots::list_snapshots, snapshots::get_snapshot, snapshots::delete_snapshot,
        rollback::post_rollback, snapshot_groups::post_snapshot_group,
        volumes::get_history, volumes::post_resync,
        targets::reconcile_target, targets::put_target_state, targets::delete_target,
        rebalance::post_rebalance, rebalance::get_rebalance, exports::put_export,
        exports::get_exports, exports::delete_export, targets::post_lease,
        hosts::put_host_keys, hosts::get_host_keys, hosts::delete_host_keys
    ),
    modifiers(&BearerSchemes, &Formats)
)]
pub(super) struct ApiDoc;

/// A documented answer whose body is an error (`ErrorBody`, named
/// `ApiError` in the document).
pub(super) fn error_answer(what: &str) -> utoipa::openapi::Response {
    use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
    ResponseBuilder::new()
        .description(what)
        .content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ApiError")))
                .build(),
        )
        .build()
}

/// The operations of a path, with their methods.
pub(super) fn operations(
    item: &mut utoipa::openapi::PathItem,
) -> [(&'static str, &mut Option<utoipa::openapi::path::Operation>); 4] {
    [
        ("GET", &mut item.get),
        ("PUT", &mut item.put),
        ("POST", &mut item.post),
        ("DELETE", &mut item.delete),
    ]
}

/// The schema of an inline object, if `schema` is one.
pub(super) fn object(
    schema: Option<&mut utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>>,
) -> Option<&mut utoipa::openapi::schema::Object> {
    use utoipa::openapi::{schema::Schema, RefOr};
    match schema {
        Some(RefOr::T(Schema::Object(o))) => Some(o),
        _ => None,
    }
}

/// The property `field` of the component schema `schema`, when it is an
/// object schema (a string, a number, a map…).
pub(super) fn body_field<'a>(
    components: &'a mut utoipa::openapi::Components,
    schema: &str,
    field: &str,
) -> Option<&'a mut utoipa::openapi::schema::Object> {
    match body_schema(components, schema, field) {
        Some(utoipa::openapi::schema::Schema::Object(o)) => Some(o),
        _ => None,
    }
}

/// The property `field` of the component schema `schema`, whatever it is.
pub(super) fn body_schema<'a>(
    components: &'a mut utoipa::openapi::Components,
    schema: &str,
    field: &str,
) -> Option<&'a mut utoipa::openapi::schema::Schema> {
    match object(components.schemas.get_mut(schema))?
        .properties
        .get_mut(field)
    {
        Some(utoipa::openapi::RefOr::T(s)) => Some(s),
        _ => None,
    }
}

/// Declares the bearer-token schemes and writes every operation's
/// security requirements, and its 401 and 403 answers, from
/// [`auth::access`]: the same table the server enforces.
#[derive(Debug)]
pub(super) struct BearerSchemes;

impl utoipa::Modify for BearerSchemes {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{
            HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
        };
        use utoipa::openapi::Ref;
        let schemes = [
            ("admin_token", "an admin token: every call"),
            ("reader_token", "a reader token: every GET"),
            ("target_token", "a target token: registration, heartbeats, leases, and reports for the owner host NQNs the control plane issued"),
            ("host_token", "a host token, bound to one host NQN: attach, detach and report for that NQN"),
        ];
        let components = doc.components.get_or_insert_with(Default::default);
        for (name, what) in schemes {
            components.add_security_scheme(
                name,
                SecurityScheme::Http(
                    HttpBuilder::new()
                        .scheme(HttpAuthScheme::Bearer)
                        .description(Some(what))
                        .build(),
                ),
            );
        }
        for (name, what) in [
            ("Unauthorized", "no bearer token, or an unknown one"),
            ("Forbidden", "the token's role may not make this call"),
        ] {
            components
                .responses
                .insert(name.into(), error_answer(what).into());
        }
        for (path, item) in doc.paths.paths.iter_mut() {
            for (method, op) in operations(item) {
                let Some(op) = op else { continue };
                let allowed: &[&str] = match auth::access(method, path) {
                    Access::Public => continue,
                    Access::Read => &["admin_token", "reader_token", "target_token", "host_token"],
                    Access::Target => &["admin_token", "target_token"],
                    Access::Host => &["admin_token", "host_token"],
                    Access::Report => &["admin_token", "host_token", "target_token"],
                    Access::Admin => &["admin_token"],
                };
                op.security = Some(
                    allowed
                        .iter()
                        .map(|n| SecurityRequirement::new(*n, Vec::<String>::new()))
                        .collect(),
                );
                let answers = &mut op.responses.responses;
                answers.insert("401".into(), Ref::from_response_name("Unauthorized").into());
                answers.insert("403".into(), Ref::from_response_name("Forbidden").into());
            }
        }
    }
}

/// What the server checks of identifiers, sizes and layouts, stated in
/// the document: patterns of path parameters and body fields, ranges of
/// layout fields, no extra properties in a layout, and the 415 answer of
/// every call with a body.
#[derive(Debug)]
pub(super) struct Formats;

/// Ids (targets, devices, pools): see `model::validate_id`.
pub(super) const ID_PATTERN: &str = "^[A-Za-z0-9._:-]+$";
pub(super) const UUID_PATTERN: &str =
    "^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$";
/// `SocketAddr`'s text: IPv4:port or [IPv6]:port (an IPv6 scope id
/// allowed), the port 0..=65535 in up to 5 digits.
pub(super) const ADDR_PATTERN: &str =
    "^([0-9]{1,3}([.][0-9]{1,3}){3}|\\[[0-9A-Fa-f:.]+(%[0-9A-Za-z]+)?\\]):[0-9]{1,5}$";
/// The longest such text: `[` IPv6 with an IPv4 tail `%` scope `]:65535`.
pub(super) const ADDR_BYTES_MAX: usize = 64;
/// `nqn.` then printable ASCII without `/`: see `attach::validate_host_nqn`.
pub(super) const NQN_PATTERN: &str = "^nqn\\.[!-.0-~]+$";

impl utoipa::Modify for Formats {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        use crate::attach::NQN_BYTES_MAX;
        use crate::limits::{
            DEVICE_BYTES_MAX, ID_BYTES_MAX, LABELS_MAX, LABEL_BYTES_MAX, NAME_BYTES_MAX,
        };
        use nvpool_layout::limits::{BLOCK_BYTES, EXTENTS_PER_VOLUME_MAX};
        use nvpool_layout::limits::{COPIES_MAX, COPIES_MIN, STRIPE_BYTES_MIN, STRIPE_WIDTH_MAX};
        use utoipa::openapi::schema::{AdditionalProperties, Object, Schema};
        use utoipa::openapi::{Ref, RefOr};
        fn text(o: &mut Object, pattern: &str, max: usize) {
            o.pattern = Some(pattern.into());
            o.min_length = Some(1);
            o.max_length = Some(max);
        }
        let uuid = |o: &mut Object| {
            text(o, UUID_PATTERN, 36);
            o.format = Some(utoipa::openapi::SchemaFormat::Custom("uuid".into()));
        };
        for item in doc.paths.paths.values_mut() {
            for op in operations(item)
                .into_iter()
                .filter_map(|(_, op)| op.as_mut())
            {
                for p in op.parameters.iter_mut().flatten() {
                    let RefOr::T(p) = p else { continue };
                    let Some(o) = object(p.schema.as_mut()) else {
                        continue;
                    };
                    match p.name.as_str() {
                        "uuid" => uuid(o),
                        "id" | "name" => text(o, ID_PATTERN, ID_BYTES_MAX),
                        "host_nqn" => text(o, NQN_PATTERN, NQN_BYTES_MAX),
                        _ => {}
                    }
                }
                if op.request_body.is_some() {
                    op.responses.responses.insert(
                        "415".into(),
                        Ref::from_response_name("UnsupportedMediaType").into(),
                    );
                }
            }
        }
        // Bodies that may be left out (`OptionalJsonBody`).
        for path in [
            "/v1/volumes/{uuid}/exports/{host_nqn}",
            "/v1/targets/{id}/heartbeat",
        ] {
            let op = doc.paths.paths.get_mut(path).and_then(|i| i.put.as_mut());
            if let Some(utoipa::openapi::RefOr::T(b)) = op.and_then(|o| o.request_body.as_mut()) {
                b.required = Some(utoipa::openapi::Required::False);
            }
        }
        let components = doc.components.get_or_insert_with(Default::default);
        components.responses.insert(
            "UnsupportedMediaType".into(),
            error_answer("the body is not sent as application/json").into(),
        );
        let fields: [(&str, &str, &str, usize); 9] = [
            ("VolumeSpecBody", "name", ID_PATTERN, NAME_BYTES_MAX),
            ("VolumeSpecBody", "pool", ID_PATTERN, ID_BYTES_MAX),
            ("RegisterTargetBody", "id", ID_PATTERN, ID_BYTES_MAX),
            ("RegisterTargetBody", "name", ID_PATTERN, NAME_BYTES_MAX),
            ("DeviceBody", "id", ID_PATTERN, ID_BYTES_MAX),
            ("DeviceRefBody", "target", ID_PATTERN, ID_BYTES_MAX),
            ("DeviceRefBody", "device", ID_PATTERN, ID_BYTES_MAX),
            ("RebalanceBody", "pool", ID_PATTERN, ID_BYTES_MAX),
            ("DeviceUsageBody", "id", ID_PATTERN, ID_BYTES_MAX),
        ];
        for (schema, field, pattern, max) in fields {
            if let Some(f) = body_field(components, schema, field) {
                text(f, pattern, max);
            }
        }
        if let Some(f) = body_field(components, "DeviceBody", "capacity_bytes") {
            f.maximum = Some(utoipa::Number::UInt(DEVICE_BYTES_MAX as usize));
        }
        // Labels (`model::validate_labels`): keys may hold `/`, values may
        // be empty.
        for schema in ["RegisterTargetBody", "DeviceBody"] {
            let Some(labels) = body_field(components, schema, "labels") else {
                continue;
            };
            labels.max_properties = Some(LABELS_MAX);
            if let Some(Schema::Object(k)) = labels.property_names.as_deref_mut() {
                text(k, "^[A-Za-z0-9._/-]+$", LABEL_BYTES_MAX);
            }
            if let Some(AdditionalProperties::RefOr(RefOr::T(Schema::Object(v)))) =
                labels.additional_properties.as_deref_mut()
            {
                v.pattern = Some("^[A-Za-z0-9._-]*$".into());
                v.max_length = Some(LABEL_BYTES_MAX);
            }
        }
        // A volume is at most EXTENTS_PER_VOLUME_MAX extents: the bound
        // below is for the default extent size (a daemon with smaller
        // extents answers 400 above its own bound).
        for schema in ["VolumeSpecBody", "ResizeBody"] {
            if let Some(f) = body_field(components, schema, "size_bytes") {
                f.minimum = Some(utoipa::Number::UInt(BLOCK_BYTES as usize));
                f.maximum = Some(utoipa::Number::UInt(
                    (u64::from(EXTENTS_PER_VOLUME_MAX) * crate::limits::EXTENT_BYTES) as usize,
                ));
                f.multiple_of = Some(utoipa::Number::UInt(BLOCK_BYTES as usize));
            }
        }
        if let Some(f) = body_field(components, "DeviceBody", "backend") {
            f.min_length = Some(1);
            f.max_length = Some(crate::limits::BACKEND_SPEC_BYTES_MAX);
        }
        // A target's state (`model::TargetState`), in and out.
        for schema in ["TargetStateBody", "TargetOut"] {
            if let Some(f) = body_field(components, schema, "state") {
                f.enum_values = Some(TargetState::ALL.iter().map(|s| s.name().into()).collect());
            }
        }
        // The target's admin token (`rest::Secret`).
        if let Some(f) = body_field(components, "RegisterTargetBody", "admin_token") {
            f.pattern = Some("^[!-~]+$".into());
            f.min_length = Some(crate::rest::SECRET_BYTES_MIN);
            f.max_length = Some(crate::rest::SECRET_BYTES_MAX);
        }
        // Addresses are IP:port (an IPv6 address in brackets), never a
        // name; that the IP is not a wildcard and the port not 0 (for the
        // addresses hosts are told) the pattern does not say.
        for field in ["addr", "admin_addr", "rdma_addr"] {
            if let Some(f) = body_field(components, "RegisterTargetBody", field) {
                f.pattern = Some(ADDR_PATTERN.into());
                f.min_length = Some(1);
                f.max_length = Some(ADDR_BYTES_MAX);
            }
        }
        let lists: [(&str, &str, usize); 3] = [
            (
                "RegisterTargetBody",
                "devices",
                crate::limits::DEVICES_PER_TARGET_MAX,
            ),
            ("PoolBody", "devices", crate::limits::DEVICES_PER_POOL_MAX),
            (
                "HeartbeatBody",
                "devices",
                crate::limits::DEVICES_PER_TARGET_MAX,
            ),
        ];
        for (schema, field, max) in lists {
            if let Some(Schema::Array(a)) = body_schema(components, schema, field) {
                a.max_items = Some(max);
            }
        }
        if let Some(f) = body_field(components, "ExportBody", "paths") {
            f.minimum = Some(utoipa::Number::UInt(1));
            f.maximum = Some(utoipa::Number::UInt(crate::paths::PATHS_MAX));
        }
        if let Some(extents) = body_field(components, "MissedBody", "extents") {
            if let Some(Schema::Object(k)) = extents.property_names.as_deref_mut() {
                k.pattern = Some("^(0|[1-9][0-9]{0,9})$".into());
            }
        }
        if let Some(RefOr::T(Schema::OneOf(layouts))) = components.schemas.get_mut("LayoutBody") {
            for variant in layouts.items.iter_mut() {
                let RefOr::T(Schema::Object(v)) = variant else {
                    continue;
                };
                v.additional_properties = Some(Box::new(AdditionalProperties::FreeForm(false)));
                let ranges: [(&str, usize, usize); 3] = [
                    ("copies", COPIES_MIN.into(), COPIES_MAX.into()),
                    ("width", 2, STRIPE_WIDTH_MAX as usize),
                    ("stripe_bytes", STRIPE_BYTES_MIN as usize, usize::MAX),
                ];
                for (field, min, max) in ranges {
                    if let Some(f) = object(v.properties.get_mut(field)) {
                        f.minimum = Some(utoipa::Number::UInt(min));
                        f.maximum = (max != usize::MAX).then_some(utoipa::Number::UInt(max));
                    }
                }
            }
        }
    }
}

/// The OpenAPI 3 document of this API, as served at `/v1/openapi.json`
/// and checked in as `docs/openapi.json`: pretty JSON with a final newline.
pub fn openapi_json() -> String {
    let mut doc = ApiDoc::openapi();
    // The crate's version would make the checked-in copy stale on every
    // release; the API carries its version in its paths.
    doc.info.version = "v1".into();
    let mut text = doc
        .to_pretty_json()
        .expect("an OpenAPI document serialises to JSON");
    text.push('\n');
    text
}
