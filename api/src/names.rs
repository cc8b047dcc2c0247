//! The NQNs one process makes up and another recognises: the subsystem of
//! a volume served by targets, the host NQN an owner reaches the volume's
//! extents with, and the host NQNs of `nvpool volume verify` runs; and how
//! a name (an NQN, an ID) goes into a URL path ([`segment`]).

use nvpool_layout::Uuid;

/// Subsystem NQN prefix of volumes served by targets.
pub const VOLUME_SUBSYSTEM_PREFIX: &str = "nqn.2026-11.io.nvpool:volume:";
/// Host NQN prefix of owners reaching a volume's extents.
pub const OWNER_HOST_PREFIX: &str = "nqn.2026-11.io.nvpool:owner:";
/// Host NQNs of `nvpool volume verify` runs start with this. They only
/// read, so copy jobs do not wait for them to mirror.
pub const VERIFIER_NQN_PREFIX: &str = "nqn.2026-11.io.nvpool:verify:";
/// Most paths a served volume may have (each takes a CNTLID range).
pub const PATHS_MAX: usize = 8;

/// The subsystem every path of `volume` presents.
pub fn volume_subsystem_nqn(volume: &Uuid) -> String {
    format!("{VOLUME_SUBSYSTEM_PREFIX}{volume}")
}

/// The volume a served subsystem NQN names.
pub fn volume_of_subsystem(nqn: &str) -> Option<Uuid> {
    nqn.strip_prefix(VOLUME_SUBSYSTEM_PREFIX)?.parse().ok()
}

/// The host NQN target `target` uses to reach `volume`'s extents while it
/// owns the volume.
pub fn owner_host_nqn(volume: &Uuid, target: &str) -> String {
    format!("{OWNER_HOST_PREFIX}{volume}:{target}")
}

/// (volume, target) of an owner host NQN.
pub fn parse_owner_host(nqn: &str) -> Option<(Uuid, String)> {
    let rest = nqn.strip_prefix(OWNER_HOST_PREFIX)?;
    let (v, t) = rest.split_at_checked(36)?;
    let t = t.strip_prefix(':')?;
    (!t.is_empty()).then_some(())?;
    Some((v.parse().ok()?, t.to_owned()))
}

/// Percent-encodes one URL path segment: everything but RFC 3986
/// unreserved characters (`A-Z a-z 0-9 - . _ ~`). NQNs hold `:` and may
/// hold any printable byte; the servers decode what this encodes.
pub fn segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_keep_only_unreserved_characters() {
        assert_eq!(segment("aZ0-._~"), "aZ0-._~");
        assert_eq!(
            segment("nqn.2026-11.io.nvpool:host/a b@c%"),
            "nqn.2026-11.io.nvpool%3Ahost%2Fa%20b%40c%25"
        );
        assert_eq!(segment("\u{e9}"), "%C3%A9");
    }
}
