//! DH-HMAC-CHAP: secrets, the computations and the two per-queue state
//! machines (controller and host) of NVMe in-band authentication.
//!
//! Sans-IO like the rest of this crate: messages in, messages out, and the
//! caller hands in the random bytes (challenges, sequence numbers, DH
//! private exponents), so both ends run in tests without sockets and with
//! fixed randomness.
//!
//! Computations (NVMe Base 2.0 §8.13.5; H is the negotiated hash):
//!
//! ```text
//!   Kh  = transform(host secret, host NQN)        Kc = transform(ctrl secret, subsystem NQN)
//!   transform(k, nqn) = k                         (DHHC-1:00)
//!                     = HMAC-H'(k, nqn ‖ "NVMe-over-Fabrics")   (H' from DHHC-1:01..03)
//!   Z   = (peer public)^(own private) mod p, big-endian, padded to the modulus
//!   Ca  = HMAC-H(H(Z), C)     (DH group ≠ null; else Ca = C)
//!   R1  = HMAC-H(Kh, Ca1 ‖ le32 S1 ‖ le16 T_ID ‖ SC_C ‖ "HostHost" ‖ hostnqn ‖ 00h ‖ subnqn)
//!   R2  = HMAC-H(Kc, Ca2 ‖ le32 S2 ‖ le16 T_ID ‖ SC_C ‖ "Controller" ‖ subnqn ‖ 00h ‖ hostnqn)
//! ```
//!
//! The controller's state machine, one per queue:
//!
//! ```text
//!   Idle ─Negotiate─► ChallengeDue ─Receive─► AwaitReply ─Reply─► Success1Due ─Receive─┬─► Done (unidirectional)
//!                                                                                      └─► AwaitSuccess2 ─Success2─► Done
//!   any unexpected message, wrong T_ID, bad value or wrong R1 ─► FailureDue ─Receive─► Failed (Failure1 sent)
//!   Failure2 from the host ─► Failed
//! ```
//!
//! `Done` is the only state that lets other commands through; a new
//! Negotiate on a `Done` queue re-authenticates it and a failure there
//! makes the queue unusable again.

use crate::auth::{self, failure, Challenge, Message, Negotiate, Reply, Success1, FAILURE_REASON};
use crate::le::u32_at;
use base64::Engine;
use hmac::{Mac, SimpleHmac};
use num_bigint::BigUint;
use sha2::{Digest, Sha256, Sha384, Sha512};
use std::sync::Arc;
use zeroize::{Zeroize, Zeroizing};

/// Bits of a DH private exponent: at least twice the security strength of
/// the largest group (ffdhe8192, about 200 bits; RFC 7919 §5.2 allows such
/// short exponents), and cheap to exponentiate with.
pub const DH_PRIVATE_BITS: usize = 512;
const DH_PRIVATE_BYTES: usize = DH_PRIVATE_BITS / 8;

/// Random bytes one exchange step may need: a challenge, a sequence number
/// and a private exponent.
pub const RANDOM_BYTES: usize = auth::HL_MAX + 4 + DH_PRIVATE_BYTES;

/// A hash function of DH-HMAC-CHAP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HashId {
    Sha256,
    Sha384,
    Sha512,
}

impl HashId {
    pub const ALL: [HashId; 3] = [HashId::Sha256, HashId::Sha384, HashId::Sha512];

    pub fn id(self) -> u8 {
        match self {
            HashId::Sha256 => 1,
            HashId::Sha384 => 2,
            HashId::Sha512 => 3,
        }
    }

    pub fn from_id(id: u8) -> Option<HashId> {
        HashId::ALL.into_iter().find(|h| h.id() == id)
    }

    /// Digest length in bytes (HL).
    pub fn digest_len(self) -> usize {
        match self {
            HashId::Sha256 => 32,
            HashId::Sha384 => 48,
            HashId::Sha512 => 64,
        }
    }

    /// The name configuration uses: `sha256`, `sha384`, `sha512`.
    pub fn name(self) -> &'static str {
        match self {
            HashId::Sha256 => "sha256",
            HashId::Sha384 => "sha384",
            HashId::Sha512 => "sha512",
        }
    }

    /// Accepts `sha256` and nvmet's `hmac(sha256)` spelling.
    pub fn from_name(s: &str) -> Option<HashId> {
        let s = s
            .strip_prefix("hmac(")
            .and_then(|r| r.strip_suffix(')'))
            .unwrap_or(s);
        HashId::ALL.into_iter().find(|h| h.name() == s)
    }

    pub fn digest(self, data: &[u8]) -> Vec<u8> {
        match self {
            HashId::Sha256 => Sha256::digest(data).to_vec(),
            HashId::Sha384 => Sha384::digest(data).to_vec(),
            HashId::Sha512 => Sha512::digest(data).to_vec(),
        }
    }

    /// HMAC over the concatenation of `parts`.
    pub fn hmac(self, key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
        fn run<M: Mac + hmac::digest::KeyInit>(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
            let mut m = <M as hmac::digest::KeyInit>::new_from_slice(key)
                .expect("HMAC takes keys of any length");
            for p in parts {
                m.update(p);
            }
            m.finalize().into_bytes().to_vec()
        }
        match self {
            HashId::Sha256 => run::<SimpleHmac<Sha256>>(key, parts),
            HashId::Sha384 => run::<SimpleHmac<Sha384>>(key, parts),
            HashId::Sha512 => run::<SimpleHmac<Sha512>>(key, parts),
        }
    }
}

/// A DH group of DH-HMAC-CHAP: none, or an RFC 7919 ffdhe group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DhGroup {
    Null,
    Ffdhe2048,
    Ffdhe3072,
    Ffdhe4096,
    Ffdhe6144,
    Ffdhe8192,
}

impl DhGroup {
    pub const ALL: [DhGroup; 6] = [
        DhGroup::Null,
        DhGroup::Ffdhe2048,
        DhGroup::Ffdhe3072,
        DhGroup::Ffdhe4096,
        DhGroup::Ffdhe6144,
        DhGroup::Ffdhe8192,
    ];

    pub fn id(self) -> u8 {
        match self {
            DhGroup::Null => 0,
            DhGroup::Ffdhe2048 => 1,
            DhGroup::Ffdhe3072 => 2,
            DhGroup::Ffdhe4096 => 3,
            DhGroup::Ffdhe6144 => 4,
            DhGroup::Ffdhe8192 => 5,
        }
    }

    pub fn from_id(id: u8) -> Option<DhGroup> {
        DhGroup::ALL.into_iter().find(|g| g.id() == id)
    }

    /// `null`, `ffdhe2048` … `ffdhe8192` (nvmet's names).
    pub fn name(self) -> &'static str {
        match self {
            DhGroup::Null => "null",
            DhGroup::Ffdhe2048 => "ffdhe2048",
            DhGroup::Ffdhe3072 => "ffdhe3072",
            DhGroup::Ffdhe4096 => "ffdhe4096",
            DhGroup::Ffdhe6144 => "ffdhe6144",
            DhGroup::Ffdhe8192 => "ffdhe8192",
        }
    }

    pub fn from_name(s: &str) -> Option<DhGroup> {
        DhGroup::ALL.into_iter().find(|g| g.name() == s)
    }

    /// DHVLEN: the modulus length in bytes (0 for the null group).
    pub fn value_len(self) -> usize {
        match self {
            DhGroup::Null => 0,
            DhGroup::Ffdhe2048 => 256,
            DhGroup::Ffdhe3072 => 384,
            DhGroup::Ffdhe4096 => 512,
            DhGroup::Ffdhe6144 => 768,
            DhGroup::Ffdhe8192 => 1024,
        }
    }

    fn prime(self) -> Option<BigUint> {
        let hex = match self {
            DhGroup::Null => return None,
            DhGroup::Ffdhe2048 => crate::ffdhe::FFDHE2048_HEX,
            DhGroup::Ffdhe3072 => crate::ffdhe::FFDHE3072_HEX,
            DhGroup::Ffdhe4096 => crate::ffdhe::FFDHE4096_HEX,
            DhGroup::Ffdhe6144 => crate::ffdhe::FFDHE6144_HEX,
            DhGroup::Ffdhe8192 => crate::ffdhe::FFDHE8192_HEX,
        };
        Some(BigUint::parse_bytes(hex.as_bytes(), 16).expect("RFC 7919 prime constants are hex"))
    }
}

/// One side's ephemeral DH key pair in an ffdhe group.
struct DhKey {
    p: BigUint,
    x: BigUint,
    len: usize,
}

impl std::fmt::Debug for DhKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DhKey(<private>)")
    }
}

impl DhKey {
    /// A key pair from `random` (DH_PRIVATE_BYTES bytes); None for the null group.
    fn new(group: DhGroup, random: &[u8]) -> Option<DhKey> {
        let p = group.prime()?;
        let mut x = BigUint::from_bytes_be(&random[..DH_PRIVATE_BYTES]);
        // Keep the exponent away from 0 and 1 (a random 512-bit value never
        // is, but fixed test randomness may be).
        x.set_bit(DH_PRIVATE_BITS as u64 - 1, true);
        Some(DhKey {
            p,
            x,
            len: group.value_len(),
        })
    }

    /// g^x mod p, big-endian, padded to the modulus length.
    fn public(&self) -> Vec<u8> {
        pad(&BigUint::from(2u8).modpow(&self.x, &self.p), self.len)
    }

    /// Z = peer^x mod p, padded; None when the peer's value is not in
    /// 2..=p-2 (1 and p-1 would pin Z to a known value).
    fn shared(&self, peer: &[u8]) -> Option<Zeroizing<Vec<u8>>> {
        if peer.is_empty() || peer.len() > self.len {
            return None;
        }
        let y = BigUint::from_bytes_be(peer);
        let one = BigUint::from(1u8);
        if y <= one || y >= &self.p - &one {
            return None;
        }
        Some(Zeroizing::new(pad(&y.modpow(&self.x, &self.p), self.len)))
    }
}

fn pad(v: &BigUint, len: usize) -> Vec<u8> {
    let b = v.to_bytes_be();
    let mut out = vec![0u8; len.saturating_sub(b.len())];
    out.extend_from_slice(&b);
    out
}

/// The augmented challenge: HMAC-H(H(Z), C), or C itself without DH.
fn augment(hash: HashId, z: Option<&[u8]>, c: &[u8]) -> Vec<u8> {
    match z {
        None => c.to_vec(),
        Some(z) => {
            let k = Zeroizing::new(hash.digest(z));
            hash.hmac(&k, &[c])
        }
    }
}

/// R1 (`host` true) or R2: the response to challenge `ca` (already
/// augmented), keyed with a transformed secret.
#[allow(clippy::too_many_arguments)]
pub fn response(
    hash: HashId,
    key: &[u8],
    ca: &[u8],
    seqnum: u32,
    t_id: u16,
    sc_c: u8,
    host: bool,
    hostnqn: &str,
    subnqn: &str,
) -> Vec<u8> {
    let (who, first, second): (&[u8], &str, &str) = if host {
        (b"HostHost", hostnqn, subnqn)
    } else {
        (b"Controller", subnqn, hostnqn)
    };
    hash.hmac(
        key,
        &[
            ca,
            &seqnum.to_le_bytes(),
            &t_id.to_le_bytes(),
            &[sc_c],
            who,
            first.as_bytes(),
            &[0],
            second.as_bytes(),
        ],
    )
}

/// Why a secret string was refused. Never carries the secret's text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error("a DH-HMAC-CHAP secret must look like DHHC-1:XX:<base64>:")]
    Format,
    #[error("DHHC-1 key transformation {0:?} is not 00, 01, 02 or 03")]
    Transform(String),
    #[error("the secret's base64 does not decode")]
    Base64,
    #[error("the secret holds {0} key bytes; 32, 48 or 64 are allowed")]
    Length(usize),
    #[error("the secret's CRC-32 does not match its key")]
    Crc,
}

/// A DH-HMAC-CHAP secret (`DHHC-1:XX:base64(key ‖ crc32):`). Its Debug
/// output hides the key; the key is wiped when dropped.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret {
    key: Zeroizing<Vec<u8>>,
    /// The key transformation hash (None: 00, the key is used as is).
    transform: Option<HashId>,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl std::str::FromStr for Secret {
    type Err = SecretError;

    fn from_str(s: &str) -> Result<Secret, SecretError> {
        let s = s.trim_end_matches(['\n', '\r']);
        let rest = s.strip_prefix("DHHC-1:").ok_or(SecretError::Format)?;
        let (xx, b64) = rest.split_once(':').ok_or(SecretError::Format)?;
        let b64 = b64.strip_suffix(':').ok_or(SecretError::Format)?;
        let transform = match xx {
            "00" => None,
            "01" => Some(HashId::Sha256),
            "02" => Some(HashId::Sha384),
            "03" => Some(HashId::Sha512),
            other => return Err(SecretError::Transform(other.chars().take(4).collect())),
        };
        let raw = Zeroizing::new(
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|_| SecretError::Base64)?,
        );
        let klen = raw.len().saturating_sub(4);
        if ![32, 48, 64].contains(&klen) || raw.len() != klen + 4 {
            return Err(SecretError::Length(klen));
        }
        let crc = u32_at(&raw, klen);
        if crc32fast::hash(&raw[..klen]) != crc {
            return Err(SecretError::Crc);
        }
        Ok(Secret {
            key: Zeroizing::new(raw[..klen].to_vec()),
            transform,
        })
    }
}

impl Secret {
    /// A secret holding `key` (32, 48 or 64 bytes), transformed with `transform`.
    pub fn new(key: &[u8], transform: Option<HashId>) -> Result<Secret, SecretError> {
        if ![32, 48, 64].contains(&key.len()) {
            return Err(SecretError::Length(key.len()));
        }
        Ok(Secret {
            key: Zeroizing::new(key.to_vec()),
            transform,
        })
    }

    /// The `DHHC-1:XX:…:` text. Only for writing it where secrets belong
    /// (a key file, the state file); never for logs.
    pub fn to_dhhc(&self) -> String {
        let mut raw = Zeroizing::new(self.key.to_vec());
        raw.extend_from_slice(&crc32fast::hash(&self.key).to_le_bytes());
        let xx = self.transform.map_or(0, HashId::id);
        format!(
            "DHHC-1:{xx:02}:{}:",
            base64::engine::general_purpose::STANDARD.encode(&*raw)
        )
    }

    /// The transformed key for `nqn` (host NQN for a host secret,
    /// subsystem NQN for a controller secret).
    pub fn transformed(&self, nqn: &str) -> Zeroizing<Vec<u8>> {
        match self.transform {
            None => self.key.clone(),
            Some(h) => Zeroizing::new(h.hmac(&self.key, &[nqn.as_bytes(), b"NVMe-over-Fabrics"])),
        }
    }
}

/// The keys of one host: its own secret and, for bidirectional
/// authentication, the controller's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    pub host: Secret,
    pub ctrl: Option<Secret>,
}

/// What the controller allows for one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CtrlPolicy {
    pub keys: Keys,
    /// The hash to use; None: the strongest the host offers.
    pub hash: Option<HashId>,
    /// The DH group to use (nvmet's default: null).
    pub dhgroup: DhGroup,
}

/// Why an exchange failed, as the AUTH_Failure explanation says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("authentication failed")]
    Failed,
    #[error("no usable authentication protocol offered")]
    ProtocolUnusable,
    #[error("secure channel concatenation is not supported")]
    SccMismatch,
    #[error("no usable hash function")]
    HashUnusable,
    #[error("no usable DH group")]
    DhGroupUnusable,
    #[error("incorrect payload")]
    IncorrectPayload,
    #[error("unexpected protocol message")]
    IncorrectProtocolMessage,
    /// The controller answered with AUTH_Failure1.
    #[error("the controller refused authentication (explanation {0:#04x})")]
    Refused(u8),
    /// The controller's response R2 did not match (bidirectional).
    #[error("the controller failed to authenticate itself")]
    ControllerResponse,
    /// The controller asked for authentication and the host has no secret.
    #[error("the controller requires authentication and no DH-HMAC-CHAP secret is configured")]
    NoKey,
}

impl AuthError {
    /// The explanation code an AUTH_Failure message carries for it.
    pub fn explanation(self) -> u8 {
        match self {
            AuthError::Failed
            | AuthError::Refused(_)
            | AuthError::ControllerResponse
            | AuthError::NoKey => failure::FAILED,
            AuthError::ProtocolUnusable => failure::PROTOCOL_UNUSABLE,
            AuthError::SccMismatch => failure::SCC_MISMATCH,
            AuthError::HashUnusable => failure::HASH_UNUSABLE,
            AuthError::DhGroupUnusable => failure::DHGROUP_UNUSABLE,
            AuthError::IncorrectPayload => failure::INCORRECT_PAYLOAD,
            AuthError::IncorrectProtocolMessage => failure::INCORRECT_PROTOCOL_MESSAGE,
        }
    }
}

fn failure_msg(from_controller: bool, t_id: u16, e: AuthError) -> Vec<u8> {
    Message::Failure {
        from_controller,
        t_id,
        reason: FAILURE_REASON,
        explanation: e.explanation(),
    }
    .encode()
}

/// Constant-time equality of two responses.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Where a controller-side exchange stands.
#[derive(Debug)]
enum CtrlStep {
    Idle,
    ChallengeDue {
        t_id: u16,
        hash: HashId,
        group: DhGroup,
    },
    AwaitReply(Box<Pending>),
    Success1Due {
        t_id: u16,
        hash: HashId,
        r2: Option<Vec<u8>>,
    },
    AwaitSuccess2 {
        t_id: u16,
    },
    FailureDue {
        t_id: u16,
        why: AuthError,
    },
    Done,
    Failed,
}

/// What the controller keeps between its Challenge and the host's Reply.
#[derive(Debug)]
struct Pending {
    t_id: u16,
    hash: HashId,
    c1: Vec<u8>,
    s1: u32,
    dh: Option<DhKey>,
}

/// The controller's side of DH-HMAC-CHAP on one queue.
#[derive(Debug)]
pub struct CtrlAuth {
    policy: Arc<CtrlPolicy>,
    hostnqn: String,
    subnqn: String,
    step: CtrlStep,
    /// The queue passed an exchange and no later one failed.
    authenticated: bool,
}

impl CtrlAuth {
    pub fn new(policy: Arc<CtrlPolicy>, hostnqn: &str, subnqn: &str) -> CtrlAuth {
        CtrlAuth {
            policy,
            hostnqn: hostnqn.to_owned(),
            subnqn: subnqn.to_owned(),
            step: CtrlStep::Idle,
            authenticated: false,
        }
    }

    /// Replaces the keys and policy the next exchange uses, when no
    /// exchange is under way (none yet, or the last one over); returns
    /// whether it did. A re-authentication on a live queue then checks the
    /// host's keys as they are now, not as they were at Connect.
    pub fn renew_policy(&mut self, policy: Arc<CtrlPolicy>) -> bool {
        let between = matches!(
            self.step,
            CtrlStep::Idle | CtrlStep::Done | CtrlStep::Failed
        );
        if between {
            self.policy = policy;
        }
        between
    }

    /// Commands other than authentication may run on the queue.
    pub fn authenticated(&self) -> bool {
        self.authenticated
    }

    /// The exchange ended in failure (a Failure1 was sent or a Failure2
    /// received) and no new one started.
    pub fn failed(&self) -> bool {
        matches!(self.step, CtrlStep::Failed)
    }

    fn fail(&mut self, t_id: u16, why: AuthError) {
        self.authenticated = false;
        self.step = CtrlStep::FailureDue { t_id, why };
    }

    /// The data of an Authentication Send. A message the controller
    /// rejects does not fail the command: the next Receive returns
    /// AUTH_Failure1 (NVMe Base 2.0 §8.13.4).
    pub fn on_send(&mut self, data: &[u8]) {
        let msg = match Message::decode(data) {
            Ok(m) => m,
            Err(_) => {
                let t_id = data
                    .get(4..6)
                    .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
                return self.fail(t_id, AuthError::IncorrectPayload);
            }
        };
        let step = std::mem::replace(&mut self.step, CtrlStep::Idle);
        match (msg, step) {
            (Message::Negotiate(n), CtrlStep::Idle | CtrlStep::Done | CtrlStep::Failed) => {
                match self.choose(&n) {
                    Ok((hash, group)) => {
                        self.step = CtrlStep::ChallengeDue {
                            t_id: n.t_id,
                            hash,
                            group,
                        }
                    }
                    Err(e) => self.fail(n.t_id, e),
                }
            }
            (Message::Reply(r), CtrlStep::AwaitReply(p)) if r.t_id == p.t_id => {
                match self.check_reply(&r, &p) {
                    Ok(r2) => {
                        self.step = CtrlStep::Success1Due {
                            t_id: p.t_id,
                            hash: p.hash,
                            r2,
                        }
                    }
                    Err(e) => self.fail(p.t_id, e),
                }
            }
            (Message::Success2 { t_id }, CtrlStep::AwaitSuccess2 { t_id: want })
                if t_id == want =>
            {
                self.authenticated = true;
                self.step = CtrlStep::Done;
            }
            (Message::Failure { .. }, _) => {
                self.authenticated = false;
                self.step = CtrlStep::Failed;
            }
            (m, _) => self.fail(m.t_id(), AuthError::IncorrectProtocolMessage),
        }
    }

    /// Picks the hash and DH group for an offer.
    fn choose(&self, n: &Negotiate<'_>) -> Result<(HashId, DhGroup), AuthError> {
        if n.sc_c != 0 {
            return Err(AuthError::SccMismatch);
        }
        let offered: Vec<HashId> = n
            .hashes
            .iter()
            .filter_map(|&i| HashId::from_id(i))
            .collect();
        let hash = match self.policy.hash {
            Some(h) if offered.contains(&h) => h,
            Some(_) => return Err(AuthError::HashUnusable),
            None => offered.into_iter().max().ok_or(AuthError::HashUnusable)?,
        };
        let group = self.policy.dhgroup;
        if !n.dhgroups.contains(&group.id()) {
            return Err(AuthError::DhGroupUnusable);
        }
        Ok((hash, group))
    }

    /// Checks R1 and computes R2 when asked for.
    fn check_reply(&self, r: &Reply<'_>, p: &Pending) -> Result<Option<Vec<u8>>, AuthError> {
        if r.r1.len() != p.hash.digest_len() {
            return Err(AuthError::IncorrectPayload);
        }
        let z = match &p.dh {
            None if r.dhv.is_empty() => None,
            None => return Err(AuthError::IncorrectPayload),
            Some(k) => Some(k.shared(r.dhv).ok_or(AuthError::IncorrectPayload)?),
        };
        let ca1 = augment(p.hash, z.as_deref().map(|v| &v[..]), &p.c1);
        let kh = self.policy.keys.host.transformed(&self.hostnqn);
        let want = response(
            p.hash,
            &kh,
            &ca1,
            p.s1,
            p.t_id,
            0,
            true,
            &self.hostnqn,
            &self.subnqn,
        );
        if !same(&want, r.r1) {
            return Err(AuthError::Failed);
        }
        if !r.cvalid {
            return Ok(None);
        }
        // Bidirectional: the host's challenge C2 with sequence number S2.
        let kc = match &self.policy.keys.ctrl {
            Some(c) if r.seqnum != 0 => c.transformed(&self.subnqn),
            _ => return Err(AuthError::Failed),
        };
        let ca2 = augment(p.hash, z.as_deref().map(|v| &v[..]), r.c2);
        Ok(Some(response(
            p.hash,
            &kc,
            &ca2,
            r.seqnum,
            p.t_id,
            0,
            false,
            &self.hostnqn,
            &self.subnqn,
        )))
    }

    /// The message an Authentication Receive returns (at most `al` bytes
    /// are transferred; the caller zero-fills up to `al`).
    pub fn on_receive(&mut self, random: &[u8; RANDOM_BYTES]) -> Vec<u8> {
        let step = std::mem::replace(&mut self.step, CtrlStep::Failed);
        match step {
            CtrlStep::ChallengeDue { t_id, hash, group } => {
                let hl = hash.digest_len();
                let c1 = random[..hl].to_vec();
                let s1 = u32_at(random, auth::HL_MAX).max(1);
                let dh = DhKey::new(group, &random[auth::HL_MAX + 4..]);
                let dhv = dh.as_ref().map(DhKey::public).unwrap_or_default();
                let out = Message::Challenge(Challenge {
                    t_id,
                    hash_id: hash.id(),
                    dhgroup_id: group.id(),
                    seqnum: s1,
                    c1: &c1,
                    dhv: &dhv,
                })
                .encode();
                self.step = CtrlStep::AwaitReply(Box::new(Pending {
                    t_id,
                    hash,
                    c1,
                    s1,
                    dh,
                }));
                out
            }
            CtrlStep::Success1Due { t_id, hash, r2 } => {
                let out = Message::Success1(Success1 {
                    t_id,
                    hl: hash.digest_len() as u8,
                    r2: r2.as_deref(),
                })
                .encode();
                if r2.is_some() {
                    self.step = CtrlStep::AwaitSuccess2 { t_id };
                } else {
                    self.authenticated = true;
                    self.step = CtrlStep::Done;
                }
                out
            }
            CtrlStep::FailureDue { t_id, why } => {
                self.authenticated = false;
                failure_msg(true, t_id, why)
            }
            // A Receive nothing asked for: the exchange is out of order.
            other => {
                let t_id = match &other {
                    CtrlStep::AwaitReply(p) => p.t_id,
                    CtrlStep::AwaitSuccess2 { t_id } => *t_id,
                    _ => 0,
                };
                self.authenticated = false;
                failure_msg(true, t_id, AuthError::IncorrectProtocolMessage)
            }
        }
    }
}

/// What the host offers in its Negotiate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostOffer {
    pub hashes: Vec<HashId>,
    pub dhgroups: Vec<DhGroup>,
}

impl Default for HostOffer {
    /// Everything, like the Linux host.
    fn default() -> HostOffer {
        HostOffer {
            hashes: HashId::ALL.to_vec(),
            dhgroups: DhGroup::ALL.to_vec(),
        }
    }
}

/// What the host does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostStep {
    /// Send this message (Authentication Send), then receive the next.
    Send(Vec<u8>),
    /// Send this final message (Success2); the queue is authenticated.
    SendAndDone(Vec<u8>),
    /// The queue is authenticated; nothing more to send.
    Done,
    /// The exchange failed; send this AUTH_Failure2 when given, then stop.
    Fail(Option<Vec<u8>>, AuthError),
}

#[derive(Debug)]
enum HostState {
    Start,
    AwaitChallenge,
    AwaitSuccess1 {
        hash: HashId,
        /// The R2 the controller must send (bidirectional).
        r2: Option<Zeroizing<Vec<u8>>>,
    },
    Finished,
}

/// The host's side of DH-HMAC-CHAP on one queue.
#[derive(Debug)]
pub struct HostAuth<'k> {
    keys: &'k Keys,
    offer: HostOffer,
    hostnqn: &'k str,
    subnqn: &'k str,
    t_id: u16,
    state: HostState,
    /// The hash and group the controller chose (for logs).
    pub chosen: Option<(HashId, DhGroup)>,
}

impl<'k> HostAuth<'k> {
    pub fn new(
        keys: &'k Keys,
        offer: HostOffer,
        hostnqn: &'k str,
        subnqn: &'k str,
        t_id: u16,
    ) -> HostAuth<'k> {
        HostAuth {
            keys,
            offer,
            hostnqn,
            subnqn,
            t_id,
            state: HostState::Start,
            chosen: None,
        }
    }

    /// AUTH_Negotiate, the first message.
    pub fn negotiate(&mut self) -> Vec<u8> {
        self.state = HostState::AwaitChallenge;
        let hashes: Vec<u8> = self.offer.hashes.iter().map(|h| h.id()).collect();
        let groups: Vec<u8> = self.offer.dhgroups.iter().map(|g| g.id()).collect();
        Message::Negotiate(Negotiate {
            t_id: self.t_id,
            sc_c: 0,
            hashes: &hashes[..hashes.len().min(auth::ID_LIST_MAX)],
            dhgroups: &groups[..groups.len().min(auth::ID_LIST_MAX)],
        })
        .encode()
    }

    fn fail(&mut self, e: AuthError, send: bool) -> HostStep {
        self.state = HostState::Finished;
        HostStep::Fail(send.then(|| failure_msg(false, self.t_id, e)), e)
    }

    /// The data of an Authentication Receive.
    pub fn on_receive(&mut self, data: &[u8], random: &[u8; RANDOM_BYTES]) -> HostStep {
        let msg = match Message::decode(data) {
            Ok(m) => m,
            Err(_) => return self.fail(AuthError::IncorrectPayload, true),
        };
        if let Message::Failure {
            from_controller: true,
            explanation,
            ..
        } = msg
        {
            self.state = HostState::Finished;
            return HostStep::Fail(None, AuthError::Refused(explanation));
        }
        if msg.t_id() != self.t_id {
            return self.fail(AuthError::IncorrectProtocolMessage, true);
        }
        match (msg, std::mem::replace(&mut self.state, HostState::Finished)) {
            (Message::Challenge(c), HostState::AwaitChallenge) => self.on_challenge(&c, random),
            (Message::Success1(s), HostState::AwaitSuccess1 { hash, r2 }) => {
                if s.hl as usize != hash.digest_len() {
                    return self.fail(AuthError::IncorrectPayload, true);
                }
                match (r2, s.r2) {
                    (None, _) => HostStep::Done,
                    (Some(want), Some(got)) if same(&want, got) => {
                        HostStep::SendAndDone(Message::Success2 { t_id: self.t_id }.encode())
                    }
                    (Some(_), _) => self.fail(AuthError::ControllerResponse, true),
                }
            }
            _ => self.fail(AuthError::IncorrectProtocolMessage, true),
        }
    }

    fn on_challenge(&mut self, c: &Challenge<'_>, random: &[u8; RANDOM_BYTES]) -> HostStep {
        let Some(hash) = HashId::from_id(c.hash_id).filter(|h| self.offer.hashes.contains(h))
        else {
            return self.fail(AuthError::HashUnusable, true);
        };
        if c.c1.len() != hash.digest_len() {
            return self.fail(AuthError::IncorrectPayload, true);
        }
        let Some(group) =
            DhGroup::from_id(c.dhgroup_id).filter(|g| self.offer.dhgroups.contains(g))
        else {
            return self.fail(AuthError::DhGroupUnusable, true);
        };
        if (group == DhGroup::Null) != c.dhv.is_empty() {
            return self.fail(AuthError::IncorrectPayload, true);
        }
        let dh = DhKey::new(group, &random[auth::HL_MAX + 4..]);
        let (z, dhv) = match &dh {
            None => (None, Vec::new()),
            Some(k) => match k.shared(c.dhv) {
                Some(z) => (Some(z), k.public()),
                None => return self.fail(AuthError::IncorrectPayload, true),
            },
        };
        let z = z.as_deref().map(|v| &v[..]);
        let kh = self.keys.host.transformed(self.hostnqn);
        let ca1 = augment(hash, z, c.c1);
        let r1 = response(
            hash,
            &kh,
            &ca1,
            c.seqnum,
            self.t_id,
            0,
            true,
            self.hostnqn,
            self.subnqn,
        );
        let hl = hash.digest_len();
        let (cvalid, s2, c2, r2) = match &self.keys.ctrl {
            None => (false, 0, vec![0u8; hl], None),
            Some(kc) => {
                let c2 = random[..hl].to_vec();
                let s2 = u32_at(random, auth::HL_MAX).max(1);
                let ca2 = augment(hash, z, &c2);
                let kc = kc.transformed(self.subnqn);
                let r2 = response(
                    hash,
                    &kc,
                    &ca2,
                    s2,
                    self.t_id,
                    0,
                    false,
                    self.hostnqn,
                    self.subnqn,
                );
                (true, s2, c2, Some(Zeroizing::new(r2)))
            }
        };
        self.chosen = Some((hash, group));
        self.state = HostState::AwaitSuccess1 { hash, r2 };
        HostStep::Send(
            Message::Reply(Reply {
                t_id: self.t_id,
                cvalid,
                seqnum: s2,
                r1: &r1,
                c2: &c2,
                dhv: &dhv,
            })
            .encode(),
        )
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.c1.zeroize();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Known answers computed once with Python's hashlib, hmac, zlib and
    // base64 from the formulas in this module's header (not from this
    // code): key bytes 00h..1Fh, C1 = A5h × 32, S1 = 01020304h, T_ID 0102h.
    const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:kat-host";
    const SUBNQN: &str = "nqn.2026-11.io.nvpool:kat";
    const KAT_SECRET: &str = "DHHC-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:";

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn secret_text_round_trips_and_transforms() {
        let s: Secret = KAT_SECRET.parse().unwrap();
        assert_eq!(s.to_dhhc(), KAT_SECRET);
        assert_eq!(
            Secret::new(&(0..32).collect::<Vec<u8>>(), Some(HashId::Sha256)).unwrap(),
            s
        );
        assert_eq!(
            hex(&s.transformed(HOSTNQN)),
            "0c05f11141c2438e3ae13db16bf212dae6f5e206b256826260fd3c250ea9625a"
        );
        assert_eq!(format!("{s:?}"), "Secret(<redacted>)");
        let k00: Secret = KAT_SECRET.replace(":01:", ":00:").parse().unwrap();
        assert_eq!(
            &k00.transformed(HOSTNQN)[..],
            &(0..32).collect::<Vec<u8>>()[..]
        );
    }

    #[test]
    fn malformed_secrets_are_refused_without_echoing_them() {
        let bad_crc = KAT_SECRET.replace("KfiaR", "KfiaS");
        for (s, e) in [
            ("DHHC-2:01:AAAA:", SecretError::Format),
            ("DHHC-1:01:AAAA", SecretError::Format),
            ("DHHC-1:04:AAAA:", SecretError::Transform("04".into())),
            ("DHHC-1:01:!!!!:", SecretError::Base64),
            ("DHHC-1:01:AAAAAAAAAAAA:", SecretError::Length(5)),
            (bad_crc.as_str(), SecretError::Crc),
        ] {
            let got = s.parse::<Secret>().unwrap_err();
            assert_eq!(got, e, "{s}");
            assert!(!got.to_string().contains("AAEC"));
        }
    }

    #[test]
    fn responses_match_known_answers() {
        let s: Secret = KAT_SECRET.parse().unwrap();
        let kh = s.transformed(HOSTNQN);
        let c1 = [0xA5u8; 32];
        let r1 = response(
            HashId::Sha256,
            &kh,
            &c1,
            0x0102_0304,
            0x0102,
            0,
            true,
            HOSTNQN,
            SUBNQN,
        );
        assert_eq!(
            hex(&r1),
            "ad28af7307bab00072ebda918a5a9d6b8d614390c6fd08bb7285c628bfb7255a"
        );
        // A 48-byte controller secret transformed with SHA-384, used with a
        // negotiated SHA-512: C2 = 3Ch × 64, S2 = 7, T_ID 9.
        let kc = Secret::new(&(100..148).collect::<Vec<u8>>(), Some(HashId::Sha384))
            .unwrap()
            .transformed(SUBNQN);
        let r2 = response(
            HashId::Sha512,
            &kc,
            &[0x3C; 64],
            7,
            9,
            0,
            false,
            HOSTNQN,
            SUBNQN,
        );
        assert_eq!(
            hex(&r2),
            "65d59498c776f99312c8d485182555518040c9a5e322955f57ffc14b3d1b58b2\
             d42f92c24c999bdb935f64ca09300ad99e15c7c8b8467eec1d9544627fdd3426"
        );
    }

    #[test]
    fn ffdhe2048_public_value_and_augmented_challenge_match_known_answers() {
        // Private exponents: 11h × 64 and 22h × 64, top bit forced on.
        let a = DhKey::new(DhGroup::Ffdhe2048, &[0x11; 64]).unwrap();
        let b = DhKey::new(DhGroup::Ffdhe2048, &[0x22; 64]).unwrap();
        let pa = a.public();
        assert_eq!(pa.len(), 256);
        assert_eq!(
            hex(&HashId::Sha256.digest(&pa)),
            "3e51e135034635df833ab0c7f301623b106477ba9be84179dc51e11a757d1769"
        );
        let z = a.shared(&b.public()).unwrap();
        assert_eq!(z, b.shared(&pa).unwrap());
        assert_eq!(
            hex(&augment(HashId::Sha256, Some(&z), &[0xA5; 32])),
            "03e1993c385194b897895728a7009de019ba33e23b370cf167ea01843afe30df"
        );
        // 0, 1 and p-1 are refused as peer values.
        let p = DhGroup::Ffdhe2048.prime().unwrap();
        assert!(a.shared(&[0]).is_none());
        assert!(a.shared(&[1]).is_none());
        assert!(a.shared(&pad(&(p - 1u8), 256)).is_none());
        assert!(a.shared(&[7; 257]).is_none());
    }

    #[test]
    fn primes_have_the_rfc_7919_shape() {
        for g in &DhGroup::ALL[1..] {
            let p = g.prime().unwrap();
            let b = p.to_bytes_be();
            assert_eq!(b.len(), g.value_len(), "{g:?}");
            assert!(b[..8].iter().chain(&b[b.len() - 8..]).all(|&x| x == 0xFF));
        }
        // A safe prime p ≡ 7 (mod 8): 2 is a quadratic residue, 2^((p-1)/2) = 1.
        let p = DhGroup::Ffdhe2048.prime().unwrap();
        let e: BigUint = (&p - 1u8) >> 1;
        assert_eq!(BigUint::from(2u8).modpow(&e, &p), BigUint::from(1u8));
    }

    fn keys(ctrl: bool) -> Keys {
        Keys {
            host: Secret::new(&[0x41; 32], Some(HashId::Sha256)).unwrap(),
            ctrl: ctrl.then(|| Secret::new(&[0x42; 64], Some(HashId::Sha512)).unwrap()),
        }
    }

    /// Runs one exchange; returns whether the controller let the queue
    /// through and what the host concluded.
    fn exchange(
        ctrl_keys: Keys,
        host_keys: &Keys,
        hash: Option<HashId>,
        group: DhGroup,
    ) -> (bool, Result<(), AuthError>) {
        let policy = CtrlPolicy {
            keys: ctrl_keys,
            hash,
            dhgroup: group,
        };
        let mut c = CtrlAuth::new(Arc::new(policy), HOSTNQN, SUBNQN);
        assert!(!c.authenticated());
        run(&mut c, host_keys)
    }

    /// Runs one exchange on `c` (first or re-authentication).
    fn run(c: &mut CtrlAuth, host_keys: &Keys) -> (bool, Result<(), AuthError>) {
        let mut h = HostAuth::new(host_keys, HostOffer::default(), HOSTNQN, SUBNQN, 5);
        let (mut rc, mut rh) = ([0u8; RANDOM_BYTES], [0u8; RANDOM_BYTES]);
        for (i, x) in rc.iter_mut().enumerate() {
            *x = (i * 7 + 3) as u8;
        }
        for (i, x) in rh.iter_mut().enumerate() {
            *x = (i * 13 + 1) as u8;
        }
        c.on_send(&h.negotiate());
        let mut msg = c.on_receive(&rc);
        loop {
            match h.on_receive(&msg, &rh) {
                HostStep::Send(m) => {
                    c.on_send(&m);
                    assert!(!c.authenticated(), "authenticated before Success1");
                    msg = c.on_receive(&rc);
                }
                HostStep::SendAndDone(m) => {
                    assert!(!c.authenticated(), "bidirectional: not before Success2");
                    c.on_send(&m);
                    return (c.authenticated(), Ok(()));
                }
                HostStep::Done => return (c.authenticated(), Ok(())),
                HostStep::Fail(m, e) => {
                    if let Some(m) = m {
                        c.on_send(&m);
                    }
                    return (c.authenticated(), Err(e));
                }
            }
        }
    }

    #[test]
    fn round_trips_for_every_hash_and_the_null_and_ffdhe2048_groups() {
        for hash in HashId::ALL {
            for group in [DhGroup::Null, DhGroup::Ffdhe2048] {
                for bidi in [false, true] {
                    let k = keys(bidi);
                    let (ok, host) = exchange(k.clone(), &k, Some(hash), group);
                    assert!(
                        ok && host.is_ok(),
                        "{hash:?} {group:?} bidi {bidi}: {host:?}"
                    );
                }
            }
        }
        // Default policy: the strongest hash offered.
        let k = keys(false);
        assert!(exchange(k.clone(), &k, None, DhGroup::Ffdhe3072).0);
    }

    #[test]
    fn a_re_authentication_checks_the_keys_as_they_are_now() {
        let old = keys(true);
        let new = Keys {
            host: Secret::new(&[0x51; 32], None).unwrap(),
            ctrl: Some(Secret::new(&[0x52; 48], None).unwrap()),
        };
        let policy = |k: &Keys| {
            Arc::new(CtrlPolicy {
                keys: k.clone(),
                hash: None,
                dhgroup: DhGroup::Ffdhe2048,
            })
        };
        let mut c = CtrlAuth::new(policy(&old), HOSTNQN, SUBNQN);
        assert_eq!(run(&mut c, &old), (true, Ok(())));
        // Rotated on the controller: the old secret no longer passes a
        // re-authentication, and the queue stops being authenticated.
        assert!(c.renew_policy(policy(&new)));
        let (ok, _) = run(&mut c, &old);
        assert!(!ok && !c.authenticated());
        // The new one does, on the same queue.
        assert_eq!(run(&mut c, &new), (true, Ok(())));
        // Never in the middle of an exchange.
        let mut h = HostAuth::new(&new, HostOffer::default(), HOSTNQN, SUBNQN, 5);
        c.on_send(&h.negotiate());
        assert!(!c.renew_policy(policy(&old)));
    }

    #[test]
    fn a_wrong_host_secret_is_refused() {
        for group in [DhGroup::Null, DhGroup::Ffdhe2048] {
            let mut wrong = keys(false);
            wrong.host = Secret::new(&[0x40; 32], Some(HashId::Sha256)).unwrap();
            let (ok, host) = exchange(keys(false), &wrong, None, group);
            assert!(!ok);
            assert_eq!(host, Err(AuthError::Refused(failure::FAILED)));
        }
    }

    #[test]
    fn a_wrong_controller_secret_is_refused_by_the_host() {
        let mut ctrl = keys(true);
        ctrl.ctrl = Some(Secret::new(&[0x43; 64], Some(HashId::Sha512)).unwrap());
        let (ok, host) = exchange(ctrl, &keys(true), None, DhGroup::Ffdhe2048);
        assert_eq!(host, Err(AuthError::ControllerResponse));
        assert!(!ok, "the host's Failure2 leaves the queue unauthenticated");
    }

    #[test]
    fn bidirectional_without_a_controller_secret_fails() {
        let (ok, host) = exchange(keys(false), &keys(true), None, DhGroup::Null);
        assert!(!ok);
        assert_eq!(host, Err(AuthError::Refused(failure::FAILED)));
    }

    #[test]
    fn unusable_offers_and_out_of_order_steps_get_failure1() {
        let policy = Arc::new(CtrlPolicy {
            keys: keys(false),
            hash: Some(HashId::Sha384),
            dhgroup: DhGroup::Ffdhe4096,
        });
        let r = [9u8; RANDOM_BYTES];
        let fail1 = |m: &[u8]| match Message::decode(m).unwrap() {
            Message::Failure {
                from_controller: true,
                explanation,
                t_id,
                ..
            } => (explanation, t_id),
            other => panic!("{other:?}"),
        };
        let neg = |hashes: &[u8], groups: &[u8]| {
            Message::Negotiate(Negotiate {
                t_id: 4,
                sc_c: 0,
                hashes,
                dhgroups: groups,
            })
            .encode()
        };
        let mut c = CtrlAuth::new(policy.clone(), HOSTNQN, SUBNQN);
        c.on_send(&neg(&[1], &[0, 3]));
        assert_eq!(fail1(&c.on_receive(&r)), (failure::HASH_UNUSABLE, 4));
        c.on_send(&neg(&[2], &[0, 1]));
        assert_eq!(fail1(&c.on_receive(&r)), (failure::DHGROUP_UNUSABLE, 4));
        // A Receive first, a Reply before any Challenge, a Success2 early.
        let mut c = CtrlAuth::new(policy.clone(), HOSTNQN, SUBNQN);
        assert_eq!(
            fail1(&c.on_receive(&r)).0,
            failure::INCORRECT_PROTOCOL_MESSAGE
        );
        c.on_send(&Message::Success2 { t_id: 4 }.encode());
        assert_eq!(
            fail1(&c.on_receive(&r)).0,
            failure::INCORRECT_PROTOCOL_MESSAGE
        );
        // A Reply with the wrong T_ID.
        let mut c = CtrlAuth::new(policy, HOSTNQN, SUBNQN);
        c.on_send(&neg(&[2], &[3]));
        let ch = c.on_receive(&r);
        assert!(matches!(Message::decode(&ch), Ok(Message::Challenge(_))));
        let k = keys(false);
        let mut h = HostAuth::new(&k, HostOffer::default(), HOSTNQN, SUBNQN, 5);
        h.negotiate();
        let mut ch = ch;
        ch[4] = 5; // the host accepts it under its own T_ID 5
        let HostStep::Send(reply) = h.on_receive(&ch, &r) else {
            panic!("no reply")
        };
        c.on_send(&reply);
        assert_eq!(
            fail1(&c.on_receive(&r)),
            (failure::INCORRECT_PROTOCOL_MESSAGE, 5)
        );
        assert!(!c.authenticated() && c.failed());
    }
}
