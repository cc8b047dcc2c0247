//! Who may call what: bearer tokens with roles, and the one table that
//! says which role each route needs.
//!
//! A token is a secret string; the control plane knows it only from files
//! (never from the command line, where `ps` would show it). Each token
//! has one role:
//!
//! | role | may |
//! |---|---|
//! | `admin` | everything |
//! | `reader` | every `GET` (lists, views, `/metrics`) |
//! | `target` | read; register, heartbeat, renew owner leases; report (session, missed regions, failed copies, sync) for the owner host NQNs the control plane issued |
//! | `target` bound to a target id | the same, for that one target only (its id in the registration and the path, its own issued owner host NQNs) |
//! | `host` (bound to one host NQN) | read; attach, detach and report (session, missed regions, failed copies, sync) for its own NQN only |
//!
//! nvpool's own initiators — a served volume's owner
//! (`nqn.2026-11.io.nvpool:owner:{volume}:{target}`) and a target's copier
//! (`nqn.2026-11.io.nvpool:copier:{target}`) — are attached, detached and
//! given their DH-HMAC-CHAP keys by the control plane alone, never through
//! this API ([`reserved`]): no token, not even the admin's, attaches or
//! detaches one, and no host token may be bound to one. A report for an
//! owner NQN is taken, whatever the token, only for the owner the control
//! plane issued ([`owner_issued`]): the NQN names the path's volume, that
//! volume is served, the NQN's target is its current owner, and the owner's
//! attachment exists. Anything else is 403 before a handler runs, so
//! nothing is recorded for a made-up owner. Knowing an owner's or a
//! copier's NQN gives no data either: the targets make them authenticate
//! with keys only the control plane and that target's admin API hold.
//!
//! `GET /healthz` and `GET /v1/openapi.json` need no token. A request
//! without a known token gets 401; a known token whose role does not allow
//! the call gets 403. When no token is configured at all, every call is
//! allowed: a development setup, which the daemon only serves on
//! loopback.
//!
//! Tokens are looked up by their SHA-256, so finding one costs the same
//! whichever token is presented and how much of it matches, and the table
//! holds digests rather than the secrets.
//!
//! [`access`] is the table: every route the API serves is classified by
//! its method and path template, and the OpenAPI document's security
//! requirements are written from the same table, so what the document
//! says is what the server enforces. A route the table does not name is
//! admin-only (a `GET`: any token), so a new route cannot be left open by
//! forgetting it.

use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

/// A token file larger than this is a mistake (a key file, a log).
pub const TOKEN_FILE_BYTES_MAX: u64 = 1 << 20;
/// Shortest token accepted: 16 characters, 64 bits of a hex secret at
/// least; `openssl rand -hex 32` gives 64.
pub const TOKEN_CHARS_MIN: usize = 16;
/// Longest token accepted; a longer `Authorization` header is refused
/// without hashing it.
pub const TOKEN_CHARS_MAX: usize = 512;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Admin,
    Reader,
    Target,
    Host,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Reader => "reader",
            Role::Target => "target",
            Role::Host => "host",
        }
    }

    fn parse(s: &str) -> Option<Role> {
        Some(match s {
            "admin" => Role::Admin,
            "reader" => Role::Reader,
            "target" => Role::Target,
            "host" => Role::Host,
            _ => return None,
        })
    }
}

/// Who presented a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    Admin,
    Reader,
    Target,
    /// One target (`target TOKEN ID`): a target's calls for that id only,
    /// so that a target's stolen token cannot act for another (keep a dead
    /// owner's leases alive, re-register it elsewhere).
    BoundTarget(String),
    /// A host's agent, for this host NQN only.
    Host(String),
}

impl Principal {
    pub fn role(&self) -> Role {
        match self {
            Principal::Admin => Role::Admin,
            Principal::Reader => Role::Reader,
            Principal::Target | Principal::BoundTarget(_) => Role::Target,
            Principal::Host(_) => Role::Host,
        }
    }
}

/// What a route needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// No token.
    Public,
    /// Any known token.
    Read,
    /// A target's token (or the admin's).
    Target,
    /// Attach or detach: the host named by the path's `{host_nqn}`, or the
    /// admin; never for one of nvpool's own initiators ([`reserved`]).
    Host,
    /// A report under an attachment (session, missed regions, failed
    /// copies, sync): the host named by `{host_nqn}`; a target when that
    /// NQN is an owner host NQN the control plane issued
    /// ([`owner_issued`]); or the admin.
    Report,
    /// The admin's token.
    Admin,
}

/// The access table: what a call of `method` on the route `template`
/// (axum's path template, e.g. `/v1/volumes/{uuid}`) needs.
pub fn access(method: &str, template: &str) -> Access {
    if matches!(template, "/healthz" | "/v1/openapi.json") {
        return Access::Public;
    }
    if method == "GET" || method == "HEAD" {
        return Access::Read;
    }
    match (method, template) {
        ("POST", "/v1/targets")
        | ("PUT", "/v1/targets/{id}/heartbeat")
        | ("POST", "/v1/targets/{id}/lease") => Access::Target,
        (_, "/v1/volumes/{uuid}/attachments/{host_nqn}") => Access::Host,
        (_, t) if t.starts_with("/v1/volumes/{uuid}/attachments/{host_nqn}/") => Access::Report,
        _ => Access::Admin,
    }
}

/// Whether `who` may make a call that needs `access`; `host_nqn` is the
/// path's `{host_nqn}` (percent-decoded) for [`Access::Host`] and
/// [`Access::Report`], `target_id` its `{id}` for [`Access::Target`]. The
/// one target route without an `{id}`, the registration, carries the id
/// in its body: its handler checks a bound target's id there
/// ([`permits_registration`]). What no token may do ([`reserved`]) and
/// whether an owner NQN was issued ([`owner_issued`], a store read) are
/// checked after this, for every token.
pub fn permits(
    who: &Principal,
    access: Access,
    host_nqn: Option<&str>,
    target_id: Option<&str>,
) -> bool {
    let owner_of = |h: Option<&str>| h.and_then(crate::paths::parse_owner_host).map(|(_, t)| t);
    match (who, access) {
        (_, Access::Public | Access::Read) | (Principal::Admin, _) => true,
        (Principal::Target, Access::Target) => true,
        (Principal::BoundTarget(mine), Access::Target) => target_id.is_none_or(|t| t == mine),
        (Principal::Target, Access::Report) => owner_of(host_nqn).is_some(),
        (Principal::BoundTarget(mine), Access::Report) => owner_of(host_nqn).as_ref() == Some(mine),
        (Principal::Host(mine), Access::Host | Access::Report) => host_nqn == Some(mine.as_str()),
        _ => false,
    }
}

/// Host NQN prefix of a target's copier (`resync::copier_nqn`).
pub const COPIER_HOST_PREFIX: &str = "nqn.2026-11.io.nvpool:copier:";

/// Whether `nqn` is one of nvpool's own initiators: a served volume's
/// owner or a target's copier. The control plane alone attaches them and
/// holds their keys.
pub fn is_internal_host(nqn: &str) -> bool {
    nqn.starts_with(crate::paths::OWNER_HOST_PREFIX) || nqn.starts_with(COPIER_HOST_PREFIX)
}

/// Why no token, whatever its role, may make a call that needs `access`
/// on the route `template` for the path's `host_nqn`: attaching or
/// detaching one of nvpool's own initiators (the control plane does that
/// itself: failover, copy jobs), setting or clearing their DH-HMAC-CHAP
/// keys (the control plane draws them), or reporting as a copier (copiers
/// report to the control plane through their target's admin API, never
/// here). `None`: the role decides.
pub fn reserved(access: Access, template: &str, host_nqn: Option<&str>) -> Option<String> {
    let host = host_nqn?;
    match access {
        Access::Admin if template.starts_with("/v1/hosts/{host_nqn}") && is_internal_host(host) => {
            Some(format!(
                "{host} is one of nvpool's own initiators: the control plane draws its \
                 DH-HMAC-CHAP keys itself"
            ))
        }
        Access::Host if is_internal_host(host) => Some(format!(
            "{host} is one of nvpool's own initiators (an owner or a copier): only the \
             control plane attaches and detaches it"
        )),
        Access::Report if host.starts_with(COPIER_HOST_PREFIX) => Some(format!(
            "{host} is a target's copier: it reports nothing through this API"
        )),
        _ => None,
    }
}

/// Whether a report under `/v1/volumes/{volume}/attachments/{host}` may
/// be taken for `host`, when it is an owner host NQN: only for the owner
/// the control plane issued — the NQN names `volume`, the volume is
/// served, the NQN's target is its owner now, and that owner's attachment
/// exists. `Ok(Err(why))` refuses (403); any other host NQN is `Ok(Ok(()))`.
pub fn owner_issued(
    cluster: &crate::state::Cluster,
    volume: &crate::model::Uuid,
    host: &str,
) -> Result<Result<(), String>, crate::state::StateError> {
    if !host.starts_with(crate::paths::OWNER_HOST_PREFIX) {
        return Ok(Ok(()));
    }
    let not_issued = |why: String| {
        Ok(Err(format!(
            "{host} is not an owner NQN the control plane issued for volume {volume}: {why}"
        )))
    };
    let Some((named, target)) = crate::paths::parse_owner_host(host) else {
        return not_issued("it is malformed".into());
    };
    if named != *volume {
        return not_issued(format!("it names volume {named}"));
    }
    let Some((served, _)) = cluster.served(volume)? else {
        return not_issued("the volume is not served".into());
    };
    if served.owner.as_deref() != Some(target.as_str()) {
        return not_issued(format!("target {target} does not own the volume"));
    }
    // One key read, not a snapshot: every report of an owner passes here.
    let key = crate::attach::attach_keys::attachment(volume, host);
    match cluster.store().get(&key)? {
        Some(_) => Ok(Ok(())),
        None => not_issued("the owner is not attached".into()),
    }
}

/// Whether `who` may register (or re-register) the target `id`: a bound
/// target token only its own.
pub fn permits_registration(who: Option<&Principal>, id: &str) -> bool {
    match who {
        Some(Principal::BoundTarget(mine)) => mine == id,
        _ => true,
    }
}

/// A malformed token file or entry.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {bytes} bytes; a token file is at most {TOKEN_FILE_BYTES_MAX}")]
    TooLarge { path: String, bytes: u64 },
    #[error("{where_}: {why}")]
    Invalid { where_: String, why: String },
}

/// A set of tokens and their principals, keyed by the token's SHA-256.
/// Debug output shows roles, never a token or its digest.
#[derive(Clone, Default)]
pub struct Tokens {
    by_digest: HashMap<[u8; 32], Principal>,
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut roles: Vec<&str> = self.by_digest.values().map(|p| p.role().name()).collect();
        roles.sort_unstable();
        f.debug_struct("Tokens").field("roles", &roles).finish()
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Tokens {
    pub fn new() -> Tokens {
        Tokens::default()
    }

    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }

    /// Whether some token has this role.
    pub fn has(&self, role: Role) -> bool {
        self.by_digest.values().any(|p| p.role() == role)
    }

    /// Adds `token` for `who`. The same token twice is refused: it would
    /// be ambiguous which principal presents it.
    pub fn add(&mut self, who: Principal, token: &str) -> Result<(), String> {
        check_token(token)?;
        if let Principal::Host(nqn) = &who {
            crate::attach::validate_host_nqn(nqn).map_err(|e| e.to_string())?;
            if is_internal_host(nqn) {
                return Err(format!(
                    "{nqn} is one of nvpool's own initiators: a host token cannot act for it"
                ));
            }
        }
        if let Principal::BoundTarget(id) = &who {
            crate::model::validate_id("target id", id, crate::limits::ID_BYTES_MAX)
                .map_err(|e| e.to_string())?;
        }
        match self.by_digest.entry(digest(token)) {
            std::collections::hash_map::Entry::Occupied(_) => {
                Err("the same token appears twice".to_owned())
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(who);
                Ok(())
            }
        }
    }

    /// `add`, for tests that build a set by hand.
    ///
    /// # Panics
    ///
    /// On a token `add` refuses; code that reads tokens from anywhere else
    /// calls `add` and handles the error.
    pub fn with(mut self, who: Principal, token: &str) -> Tokens {
        if let Err(why) = self.add(who, token) {
            panic!("Tokens::with: {why}");
        }
        self
    }

    /// The principal that holds `token`, if any.
    pub fn identify(&self, token: &str) -> Option<&Principal> {
        if token.len() > TOKEN_CHARS_MAX {
            return None;
        }
        self.by_digest.get(&digest(token))
    }

    /// Adds the entries of a tokens file: one per line, `ROLE TOKEN`,
    /// `target TOKEN TARGET_ID` or `host TOKEN HOSTNQN`, separated by blanks; blank lines and lines
    /// starting with `#` are skipped. `origin` names the file in errors,
    /// which never quote a token.
    pub fn add_file_text(&mut self, origin: &str, text: &str) -> Result<(), TokenError> {
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let invalid = |why: String| TokenError::Invalid {
                where_: format!("{origin} line {}", i + 1),
                why,
            };
            let fields: Vec<&str> = line.split_whitespace().collect();
            let role = Role::parse(fields[0]).ok_or_else(|| {
                invalid(format!(
                    "unknown role {:?} (admin, reader, target or host)",
                    fields[0]
                ))
            })?;
            let who = match (role, &fields[1..]) {
                (Role::Admin, [_]) => Principal::Admin,
                (Role::Reader, [_]) => Principal::Reader,
                (Role::Target, [_]) => Principal::Target,
                (Role::Target, [_, id]) => Principal::BoundTarget((*id).to_owned()),
                (Role::Host, [_, nqn]) => Principal::Host((*nqn).to_owned()),
                (Role::Host, _) => return Err(invalid("expected `host TOKEN HOSTNQN`".into())),
                (Role::Target, _) => {
                    return Err(invalid("expected `target TOKEN [TARGET_ID]`".into()))
                }
                _ => return Err(invalid(format!("expected `{} TOKEN`", role.name()))),
            };
            self.add(who, fields[1]).map_err(invalid)?;
        }
        Ok(())
    }
}

fn check_token(token: &str) -> Result<(), String> {
    let n = token.chars().count();
    if !(TOKEN_CHARS_MIN..=TOKEN_CHARS_MAX).contains(&n) {
        return Err(format!(
            "a token is {TOKEN_CHARS_MIN}..={TOKEN_CHARS_MAX} characters; this one has {n}"
        ));
    }
    if !token.chars().all(|c| c.is_ascii_graphic()) {
        return Err("a token is printable ASCII without blanks".to_owned());
    }
    Ok(())
}

/// Reads a file of at most [`TOKEN_FILE_BYTES_MAX`] bytes.
pub fn read_token_file(path: &Path) -> Result<String, TokenError> {
    let shown = path.display().to_string();
    let bytes = std::fs::metadata(path)
        .map_err(|source| TokenError::Read {
            path: shown.clone(),
            source,
        })?
        .len();
    if bytes > TOKEN_FILE_BYTES_MAX {
        return Err(TokenError::TooLarge { path: shown, bytes });
    }
    std::fs::read_to_string(path).map_err(|source| TokenError::Read {
        path: shown,
        source,
    })
}

/// Where the daemon's tokens come from: files, re-read when they change.
#[derive(Debug, Clone, Default)]
pub struct TokenFiles {
    /// Files of `ROLE TOKEN [HOSTNQN | TARGET_ID]` lines.
    pub tokens: Vec<PathBuf>,
    /// A file holding one admin token.
    pub admin: Option<PathBuf>,
    /// A file holding one target token.
    pub target: Option<PathBuf>,
}

impl TokenFiles {
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty() && self.admin.is_none() && self.target.is_none()
    }

    /// Reads every file into one set.
    pub fn load(&self) -> Result<Tokens, TokenError> {
        let mut set = Tokens::new();
        for path in &self.tokens {
            set.add_file_text(&path.display().to_string(), &read_token_file(path)?)?;
        }
        for (path, who) in [
            (&self.admin, Principal::Admin),
            (&self.target, Principal::Target),
        ] {
            let Some(path) = path else { continue };
            let text = read_token_file(path)?;
            set.add(who, text.trim())
                .map_err(|why| TokenError::Invalid {
                    where_: path.display().to_string(),
                    why,
                })?;
        }
        Ok(set)
    }

    /// A fingerprint of the files' state (length and modification time of
    /// each), to notice a change without reading them.
    pub fn stamp(&self) -> Vec<Option<(u64, std::time::SystemTime)>> {
        self.tokens
            .iter()
            .chain(self.admin.iter())
            .chain(self.target.iter())
            .map(|p| {
                let m = std::fs::metadata(p).ok()?;
                Some((m.len(), m.modified().ok()?))
            })
            .collect()
    }
}

/// The API's tokens, replaceable while it serves (a rotated file is read
/// again). Clones share the set.
#[derive(Clone, Default)]
pub struct AuthConfig {
    tokens: Arc<RwLock<Arc<Tokens>>>,
}

impl fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AuthConfig").field(&self.current()).finish()
    }
}

impl AuthConfig {
    pub fn new(tokens: Tokens) -> AuthConfig {
        AuthConfig {
            tokens: Arc::new(RwLock::new(Arc::new(tokens))),
        }
    }

    /// No tokens: every call is allowed.
    pub fn open() -> AuthConfig {
        AuthConfig::default()
    }

    /// The set in force now.
    pub fn current(&self) -> Arc<Tokens> {
        match self.tokens.read() {
            Ok(t) => t.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Puts `tokens` in force for every later request.
    pub fn replace(&self, tokens: Tokens) {
        let new = Arc::new(tokens);
        match self.tokens.write() {
            Ok(mut t) => *t = new,
            Err(poisoned) => *poisoned.into_inner() = new,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "admin-0123456789abcdef";
    const R: &str = "reader-0123456789abcdef";
    const T: &str = "target-0123456789abcdef";
    const H: &str = "host-0123456789abcdef";
    const NQN: &str = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555";

    #[test]
    fn file_format() {
        let mut t = Tokens::new();
        let text = format!("# roles\nadmin {A}\n\nreader   {R}\ntarget\t{T}\nhost {H} {NQN}\n");
        t.add_file_text("f", &text).unwrap();
        assert_eq!(t.identify(A), Some(&Principal::Admin));
        assert_eq!(t.identify(R), Some(&Principal::Reader));
        assert_eq!(t.identify(T), Some(&Principal::Target));
        assert_eq!(t.identify(H), Some(&Principal::Host(NQN.into())));
        assert_eq!(t.identify("admin-0123456789abcdeX"), None);
        assert_eq!(t.identify(""), None);
        assert!(!format!("{t:?}").contains("0123"), "{t:?}");
        for bad in [
            format!("root {A}"),
            format!("host {H}"),
            format!("admin {A} extra"),
            "admin short".to_owned(),
            format!("admin {A}\nreader {A}"),
            format!("host {H} not-an-nqn"),
        ] {
            let e = Tokens::new().add_file_text("f", &bad).unwrap_err();
            assert!(
                !e.to_string().contains("0123"),
                "an error quotes a token: {e}"
            );
        }
        assert!(Tokens::new()
            .add_file_text("f", "admin short")
            .unwrap_err()
            .to_string()
            .contains("f line 1"));
    }

    #[test]
    fn table() {
        assert_eq!(access("GET", "/healthz"), Access::Public);
        assert_eq!(access("GET", "/v1/openapi.json"), Access::Public);
        assert_eq!(access("GET", "/metrics"), Access::Read);
        assert_eq!(access("GET", "/v1/volumes/{uuid}"), Access::Read);
        assert_eq!(access("POST", "/v1/targets"), Access::Target);
        assert_eq!(access("PUT", "/v1/targets/{id}/heartbeat"), Access::Target);
        assert_eq!(access("DELETE", "/v1/targets/{id}"), Access::Admin);
        assert_eq!(
            access("PUT", "/v1/volumes/{uuid}/attachments/{host_nqn}/missed"),
            Access::Report
        );
        assert_eq!(
            access(
                "PUT",
                "/v1/volumes/{uuid}/attachments/{host_nqn}/sync/{job}"
            ),
            Access::Report
        );
        for m in ["PUT", "DELETE"] {
            assert_eq!(
                access(m, "/v1/volumes/{uuid}/attachments/{host_nqn}"),
                Access::Host
            );
        }
        assert_eq!(
            access("PUT", "/v1/volumes/{uuid}/exports/{host_nqn}"),
            Access::Admin
        );
        assert_eq!(access("PATCH", "/v1/some/new/route"), Access::Admin);
    }

    #[test]
    fn roles() {
        let host = Principal::Host(NQN.into());
        let owner = "nqn.2026-11.io.nvpool:owner:11111111-2222-3333-4444-555555555555:t1";
        assert!(crate::paths::parse_owner_host(owner).is_some());
        for who in [
            &Principal::Admin,
            &Principal::Reader,
            &Principal::Target,
            &host,
        ] {
            assert!(permits(who, Access::Read, None, None));
            assert!(permits(who, Access::Public, None, None));
        }
        assert!(permits(&Principal::Admin, Access::Admin, None, None));
        for who in [&Principal::Reader, &Principal::Target, &host] {
            assert!(!permits(who, Access::Admin, None, None));
        }
        assert!(permits(&Principal::Target, Access::Target, None, None));
        assert!(!permits(&Principal::Reader, Access::Target, None, None));
        assert!(!permits(&host, Access::Target, None, None));
        for a in [Access::Host, Access::Report] {
            assert!(permits(&host, a, Some(NQN), None));
            assert!(!permits(&host, a, Some(owner), None));
            assert!(!permits(&host, a, None, None));
            assert!(!permits(&Principal::Target, a, Some(NQN), None));
            assert!(!permits(&Principal::Reader, a, Some(NQN), None));
        }
        assert!(permits(
            &Principal::Target,
            Access::Report,
            Some(owner),
            None
        ));
        // A target never attaches or detaches: the control plane attaches
        // owners itself.
        assert!(!permits(
            &Principal::Target,
            Access::Host,
            Some(owner),
            None
        ));
    }

    /// nvpool's own initiators: no token attaches or detaches them, no
    /// one reports as a copier, and no host token is bound to one.
    #[test]
    fn own_initiators_are_reserved() {
        let owner = "nqn.2026-11.io.nvpool:owner:11111111-2222-3333-4444-555555555555:t1";
        let copier = "nqn.2026-11.io.nvpool:copier:t1";
        assert!(is_internal_host(owner) && is_internal_host(copier));
        assert!(!is_internal_host(NQN));
        let at = "/v1/volumes/{uuid}/attachments/{host_nqn}";
        let report = "/v1/volumes/{uuid}/attachments/{host_nqn}/session";
        let keys = "/v1/hosts/{host_nqn}/dhchap";
        assert!(reserved(Access::Host, at, Some(owner)).is_some());
        assert!(reserved(Access::Host, at, Some(copier)).is_some());
        assert!(reserved(Access::Report, report, Some(copier)).is_some());
        assert!(reserved(Access::Admin, keys, Some(owner)).is_some());
        assert!(reserved(Access::Admin, keys, Some(copier)).is_some());
        assert_eq!(reserved(Access::Report, report, Some(owner)), None);
        assert_eq!(reserved(Access::Host, at, Some(NQN)), None);
        assert_eq!(reserved(Access::Admin, keys, Some(NQN)), None);
        assert_eq!(reserved(Access::Read, keys, Some(owner)), None);
        for nqn in [owner, copier] {
            let e = Tokens::new()
                .add_file_text("f", &format!("host {H} {nqn}"))
                .unwrap_err()
                .to_string();
            assert!(e.contains("own initiators") && !e.contains("0123"), "{e}");
        }
    }

    /// An owner NQN is taken only as issued: for the path's volume, served,
    /// owned by the NQN's target, attached.
    #[test]
    fn owner_nqns_are_taken_only_as_issued() {
        use crate::model::{Layout, Uuid, VolumeSpec};
        use crate::moves::tests::{cluster, register};
        let e = crate::limits::EXTENT_BYTES_MIN;
        let (c, _) = cluster(e);
        register(&c, 0, 4 * e);
        register(&c, 1, 4 * e);
        let (vol, other_vol) = (Uuid([7; 16]), Uuid([8; 16]));
        for uuid in [vol, other_vol] {
            c.create_volume(&VolumeSpec {
                uuid,
                name: format!("v{}", uuid.0[0]),
                size_bytes: e,
                layout: Layout::Concat,
                pool: None,
            })
            .unwrap();
        }
        let owner = crate::paths::owner_host_nqn(&vol, "t0");
        let refused = |volume: &Uuid, host: &str| owner_issued(&c, volume, host).unwrap().is_err();
        // Not an owner NQN: not this check's business.
        assert_eq!(owner_issued(&c, &vol, NQN).unwrap(), Ok(()));
        // Not served yet.
        assert!(refused(&vol, &owner));
        let served = c.add_served_host(&vol, NQN, 2).unwrap();
        let served = c
            .update_served(&vol, served.generation, |s| {
                s.owner = Some("t0".into());
                s.generation += 1;
            })
            .unwrap()
            .unwrap();
        // Served and owned, but never attached.
        assert!(refused(&vol, &owner));
        c.begin_attach(&vol, &owner).unwrap();
        c.finish_attach(&vol, &owner).unwrap();
        assert_eq!(owner_issued(&c, &vol, &owner).unwrap(), Ok(()));
        // The same NQN under another volume's path, another target's NQN,
        // a malformed one.
        assert!(refused(&other_vol, &owner));
        assert!(refused(&vol, &crate::paths::owner_host_nqn(&vol, "t1")));
        assert!(refused(
            &vol,
            &format!("{}{vol}", crate::paths::OWNER_HOST_PREFIX)
        ));
        // The owner moved: its old NQN is refused, attached or not.
        c.update_served(&vol, served.generation, |s| s.owner = Some("t1".into()))
            .unwrap()
            .unwrap();
        assert!(refused(&vol, &owner));
    }

    #[test]
    fn a_bound_target_token_acts_for_its_own_target_only() {
        let t1 = Principal::BoundTarget("t1".into());
        let own = "nqn.2026-11.io.nvpool:owner:11111111-2222-3333-4444-555555555555:t1";
        let other = "nqn.2026-11.io.nvpool:owner:11111111-2222-3333-4444-555555555555:t2";
        assert_eq!(t1.role(), Role::Target);
        assert!(permits(&t1, Access::Read, None, None));
        assert!(permits(&t1, Access::Target, None, Some("t1")));
        assert!(!permits(&t1, Access::Target, None, Some("t2")));
        assert!(permits(&t1, Access::Report, Some(own), None));
        assert!(!permits(&t1, Access::Report, Some(other), None));
        assert!(!permits(&t1, Access::Report, Some(NQN), None));
        assert!(!permits(&t1, Access::Host, Some(own), None));
        assert!(!permits(&t1, Access::Admin, None, None));
        assert!(permits_registration(Some(&t1), "t1"));
        assert!(!permits_registration(Some(&t1), "t2"));
        assert!(permits_registration(Some(&Principal::Target), "t2"));
        assert!(permits_registration(None, "t2"));

        let mut set = Tokens::new();
        set.add_file_text(
            "tokens",
            "target shared-target-token-0001\ntarget bound-target-token-0001 t1\n",
        )
        .unwrap();
        assert_eq!(
            set.identify("shared-target-token-0001"),
            Some(&Principal::Target)
        );
        assert_eq!(set.identify("bound-target-token-0001"), Some(&t1));
        let e = Tokens::new()
            .add_file_text("tokens", "target bound-target-token-0001 t1 extra\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 1") && !e.contains("bound-target"), "{e}");
        let e = Tokens::new()
            .add_file_text("tokens", "target bound-target-token-0001 bad/id\n")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("bound-target"), "{e}");
    }

    #[test]
    fn files_reload_by_stamp() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens");
        std::fs::write(&path, format!("admin {A}\n")).unwrap();
        let files = TokenFiles {
            tokens: vec![path.clone()],
            ..TokenFiles::default()
        };
        let auth = AuthConfig::new(files.load().unwrap());
        assert!(auth.current().has(Role::Admin));
        let before = files.stamp();
        std::fs::write(&path, format!("admin {A}\nreader {R}\n")).unwrap();
        assert_ne!(files.stamp(), before, "a longer file has another stamp");
        auth.replace(files.load().unwrap());
        assert_eq!(auth.current().identify(R), Some(&Principal::Reader));
        let big = dir.path().join("big");
        std::fs::write(&big, vec![b'#'; TOKEN_FILE_BYTES_MAX as usize + 1]).unwrap();
        assert!(matches!(
            TokenFiles {
                admin: Some(big),
                ..TokenFiles::default()
            }
            .load(),
            Err(TokenError::TooLarge { .. })
        ));
    }
}
