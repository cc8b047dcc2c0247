//! The host's identity: NQN and host ID.

/// Where nvme-cli keeps the host NQN and host ID.
pub const HOSTNQN_PATH: &str = "/etc/nvme/hostnqn";
pub const HOSTID_PATH: &str = "/etc/nvme/hostid";

/// The host NQN and 16-byte host ID to connect with: `/etc/nvme/hostnqn`
/// (and `/etc/nvme/hostid`) when present, else a fresh UUID-based NQN.
pub fn host_identity() -> (String, [u8; 16]) {
    let nqn = std::fs::read_to_string(HOSTNQN_PATH)
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| s.starts_with("nqn."));
    let id = std::fs::read_to_string(HOSTID_PATH)
        .ok()
        .and_then(|s| parse_uuid(s.trim()));
    match (nqn, id) {
        (Some(n), Some(i)) => (n, i),
        (Some(n), None) => {
            let i = n
                .rsplit_once(":uuid:")
                .and_then(|(_, u)| parse_uuid(u))
                .unwrap_or_else(random_uuid);
            (n, i)
        }
        (None, _) => {
            let u = random_uuid();
            (uuid_nqn(&u), u)
        }
    }
}

pub use nvpool_wire::nqn::{format_uuid, parse_uuid, uuid_nqn};

pub fn random_uuid() -> [u8; 16] {
    let mut b = [0u8; 16];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    assert_eq!(n, 16, "getrandom failed");
    b[6] = (b[6] & 0x0F) | 0x40;
    b[8] = (b[8] & 0x3F) | 0x80;
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_nqn_round_trip() {
        let u = random_uuid();
        let n = uuid_nqn(&u);
        assert!(n.starts_with("nqn.2014-08.org.nvmexpress:uuid:"));
        assert_eq!(parse_uuid(n.rsplit_once(":uuid:").unwrap().1), Some(u));
        assert_eq!(u[6] >> 4, 4, "version 4");
    }
}
