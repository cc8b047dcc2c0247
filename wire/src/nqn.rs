//! NQN and UUID text forms: `nqn.2014-08.org.nvmexpress:uuid:<uuid>` host
//! NQNs and the 8-4-4-4-12 hex form of 16-byte UUIDs (host IDs, namespace
//! UUIDs).

/// The prefix of UUID-based NQNs.
pub const UUID_NQN_PREFIX: &str = "nqn.2014-08.org.nvmexpress:uuid:";

/// Parses `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (hex digits, either case).
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let b = s.as_bytes();
    if b.len() != 36 || [8, 13, 18, 23].iter().any(|&i| b[i] != b'-') {
        return None;
    }
    let hex: Vec<u8> = b.iter().copied().filter(|&c| c != b'-').collect();
    if hex.len() != 32 || !hex.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let pair = std::str::from_utf8(&hex[i * 2..i * 2 + 2]).ok()?;
        *o = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(out)
}

/// Formats 16 bytes as a lower-case UUID.
pub fn format_uuid(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// The UUID-based NQN of a host ID.
pub fn uuid_nqn(u: &[u8; 16]) -> String {
    format!("{UUID_NQN_PREFIX}{}", format_uuid(u))
}

/// The UUID inside a UUID-based NQN.
pub fn nqn_uuid(nqn: &str) -> Option<[u8; 16]> {
    nqn.strip_prefix(UUID_NQN_PREFIX).and_then(parse_uuid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let u = parse_uuid("01234567-89ab-CDEF-0123-456789abcdef").unwrap();
        assert_eq!(format_uuid(&u), "01234567-89ab-cdef-0123-456789abcdef");
        assert_eq!(nqn_uuid(&uuid_nqn(&u)), Some(u));
        for bad in [
            "",
            "0123456789abcdef0123456789abcdef",
            "01234567-89ab-cdef-0123-456789abcdeg",
            "01234567-89ab-cdef-01234-56789abcdef",
            "+1234567-89ab-cdef-0123-456789abcdef",
        ] {
            assert_eq!(parse_uuid(bad), None, "{bad}");
        }
        assert_eq!(nqn_uuid("nqn.2026-11.io.nvpool:x"), None);
    }
}
