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

/// The host ID that belongs to host NQN `nqn`: the UUID of a `…:uuid:`
/// NQN, else one derived from the NQN (stable, and different for
/// different NQNs). The Linux host refuses an NQN whose host ID another
/// NQN already uses, and several host NQNs may connect from one machine
/// (the owners of served volumes, say), so the ID must follow the NQN.
pub fn host_id_of(nqn: &str) -> [u8; 16] {
    if let Some(u) = nqn.rsplit_once(":uuid:").and_then(|(_, u)| parse_uuid(u)) {
        return u;
    }
    // FNV-1a, twice with different offsets, shaped as a version-4 UUID.
    let mut b = [0u8; 16];
    for (i, seed) in [0xcbf2_9ce4_8422_2325u64, 0x8422_2325_cbf2_9ce4]
        .iter()
        .enumerate()
    {
        let mut h = *seed;
        for c in nqn.bytes() {
            h = (h ^ u64::from(c)).wrapping_mul(0x0100_0000_01b3);
        }
        b[i * 8..i * 8 + 8].copy_from_slice(&h.to_le_bytes());
    }
    b[6] = (b[6] & 0x0F) | 0x40;
    b[8] = (b[8] & 0x3F) | 0x80;
    b
}

pub fn random_uuid() -> [u8; 16] {
    let mut b: [u8; 16] = nvpool_rt::random::bytes();
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

    #[test]
    fn host_ids_follow_their_nqn() {
        let u = random_uuid();
        assert_eq!(host_id_of(&uuid_nqn(&u)), u);
        let a = host_id_of("nqn.2026-11.io.nvpool:owner:v:t0");
        assert_eq!(a, host_id_of("nqn.2026-11.io.nvpool:owner:v:t0"));
        assert_ne!(a, host_id_of("nqn.2026-11.io.nvpool:owner:v:t1"));
        assert_eq!(a[6] >> 4, 4, "version 4");
    }
}
