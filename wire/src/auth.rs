//! NVMe in-band authentication on the wire: the Authentication Send and
//! Receive commands (Fabrics types 05h and 06h) and the DH-HMAC-CHAP
//! messages they carry (NVMe Base 2.0 §8.13).
//!
//! Every message starts with AUTH_TYPE, AUTH_ID, two reserved bytes and the
//! transaction id T_ID (u16 at byte 4). One message per command:
//!
//! ```text
//!   host (Send)               controller (Receive)
//!   AUTH_Negotiate      ─►
//!                       ◄─    DH-HMAC-CHAP_Challenge  (or AUTH_Failure1)
//!   DH-HMAC-CHAP_Reply  ─►
//!                       ◄─    DH-HMAC-CHAP_Success1   (or AUTH_Failure1)
//!   [DH-HMAC-CHAP_Success2 or AUTH_Failure2 ─►]       (bidirectional only)
//! ```
//!
//! Decoders read only the bytes of their message; what follows (the zero
//! fill of a 4096-byte Receive buffer) is ignored. Lengths inside a message
//! (HL, DHVLEN, HALEN, DHLEN, NAPD) are checked against the buffer and
//! against the limits below before any slice is taken.

use crate::le::{put_u16, put_u32, u16_at, u32_at};
use crate::sqe::{admin, sgl_id, Sgl, Sqe};
use crate::WireError;

/// SECP of NVMe in-band authentication.
pub const SECP_AUTH: u8 = 0xE9;
/// SPSP0 and SPSP1 of in-band authentication.
pub const SPSP_AUTH: u8 = 0x01;
/// Longest message either side sends or accepts: the allocation length the
/// Linux host gives every Authentication Receive, and the largest Reply
/// (16 + 2·64 + 1024 bytes for SHA-512 with ffdhe8192) fits well inside it.
pub const AUTH_MSG_MAX: usize = 4096;
/// The descriptor of one protocol in AUTH_Negotiate.
pub const NEGOTIATE_DESC_LEN: usize = 64;
/// Header of AUTH_Negotiate before its descriptors.
pub const NEGOTIATE_HLEN: usize = 8;
/// Length of every DH-HMAC-CHAP message header (Challenge, Reply, Success).
pub const DHCHAP_HLEN: usize = 16;
/// AUTH_Failure1/2: header, reason, explanation.
pub const FAILURE_LEN: usize = 8;
/// Hash and DH group lists in a Negotiate descriptor are 30 bytes each.
pub const ID_LIST_MAX: usize = 30;
/// Largest DH value any ffdhe group has (ffdhe8192: 1024 bytes).
pub const DHVLEN_MAX: usize = 1024;
/// Longest digest (SHA-512).
pub const HL_MAX: usize = 64;

const _: () = assert!(DHCHAP_HLEN + 2 * HL_MAX + DHVLEN_MAX <= AUTH_MSG_MAX);
const _: () = assert!(NEGOTIATE_HLEN + NEGOTIATE_DESC_LEN <= AUTH_MSG_MAX);

/// AUTH_TYPE values.
pub mod auth_type {
    pub const COMMON: u8 = 0x00;
    pub const DHCHAP: u8 = 0x01;
}

/// AUTH_ID values of each AUTH_TYPE.
pub mod auth_id {
    pub const NEGOTIATE: u8 = 0x00;
    pub const CHALLENGE: u8 = 0x01;
    pub const REPLY: u8 = 0x02;
    pub const SUCCESS1: u8 = 0x03;
    pub const SUCCESS2: u8 = 0x04;
    pub const FAILURE2: u8 = 0xF0;
    pub const FAILURE1: u8 = 0xF1;
}

/// The protocol id of DH-HMAC-CHAP in a Negotiate descriptor.
pub const AUTHID_DHCHAP: u8 = 0x01;

/// Reason code of an AUTH_Failure message (the only one defined).
pub const FAILURE_REASON: u8 = 0x01;

/// Explanations of an AUTH_Failure message.
pub mod failure {
    pub const FAILED: u8 = 0x01;
    pub const PROTOCOL_UNUSABLE: u8 = 0x02;
    pub const SCC_MISMATCH: u8 = 0x03;
    pub const HASH_UNUSABLE: u8 = 0x04;
    pub const DHGROUP_UNUSABLE: u8 = 0x05;
    pub const INCORRECT_PAYLOAD: u8 = 0x06;
    pub const INCORRECT_PROTOCOL_MESSAGE: u8 = 0x07;
}

/// The SQE fields of Authentication Send (TL) and Receive (AL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AuthCmd {
    pub secp: u8,
    pub spsp0: u8,
    pub spsp1: u8,
    /// Transfer length (Send) or allocation length (Receive), in bytes.
    pub len: u32,
}

impl AuthCmd {
    /// An in-band authentication command of `len` bytes.
    pub fn new(len: u32) -> AuthCmd {
        AuthCmd {
            secp: SECP_AUTH,
            spsp0: SPSP_AUTH,
            spsp1: SPSP_AUTH,
            len,
        }
    }

    pub fn from_sqe(s: &Sqe) -> AuthCmd {
        AuthCmd {
            spsp0: s.0[41],
            spsp1: s.0[42],
            secp: s.0[43],
            len: u32_at(&s.0, 44),
        }
    }

    /// SECP and SPSP name in-band authentication and the length is usable.
    pub fn valid(&self) -> bool {
        self.secp == SECP_AUTH
            && self.spsp0 == SPSP_AUTH
            && self.spsp1 == SPSP_AUTH
            && self.len > 0
            && self.len as usize <= AUTH_MSG_MAX
    }

    /// The SQE: `fct` is [`crate::fabrics::fctype::AUTH_SEND`] (data in the
    /// capsule) or `AUTH_RECEIVE` (data from the controller).
    pub fn to_sqe(&self, cid: u16, fct: u8) -> Sqe {
        let mut s = Sqe::new(admin::FABRICS, cid);
        s.set_fctype(fct);
        let id = if fct == crate::fabrics::fctype::AUTH_SEND {
            sgl_id::IN_CAPSULE
        } else {
            sgl_id::TRANSPORT
        };
        s.set_sgl(Sgl {
            addr: 0,
            len: self.len,
            id,
        });
        s.0[41] = self.spsp0;
        s.0[42] = self.spsp1;
        s.0[43] = self.secp;
        put_u32(&mut s.0, 44, self.len);
        s
    }
}

/// AUTH_Negotiate: the host's offer (one DH-HMAC-CHAP descriptor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiate<'a> {
    pub t_id: u16,
    /// Secure channel concatenation requested (0: none).
    pub sc_c: u8,
    /// Hash identifiers offered, in the host's order of preference.
    pub hashes: &'a [u8],
    /// DH group identifiers offered.
    pub dhgroups: &'a [u8],
}

/// DH-HMAC-CHAP_Challenge (controller to host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Challenge<'a> {
    pub t_id: u16,
    pub hash_id: u8,
    pub dhgroup_id: u8,
    pub seqnum: u32,
    /// C1; its length is HL.
    pub c1: &'a [u8],
    /// The controller's DH public value (empty with the null group).
    pub dhv: &'a [u8],
}

/// DH-HMAC-CHAP_Reply (host to controller).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply<'a> {
    pub t_id: u16,
    /// The host asks the controller to authenticate itself (C2 valid).
    pub cvalid: bool,
    /// S2; 0 when the host does not authenticate the controller.
    pub seqnum: u32,
    pub r1: &'a [u8],
    /// C2, as long as R1 (zeros when not valid).
    pub c2: &'a [u8],
    /// The host's DH public value.
    pub dhv: &'a [u8],
}

/// DH-HMAC-CHAP_Success1 (controller to host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Success1<'a> {
    pub t_id: u16,
    /// HL: the digest length of the negotiated hash.
    pub hl: u8,
    /// R2, when the host asked for controller authentication.
    pub r2: Option<&'a [u8]>,
}

/// One in-band authentication message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message<'a> {
    Negotiate(Negotiate<'a>),
    Challenge(Challenge<'a>),
    Reply(Reply<'a>),
    Success1(Success1<'a>),
    Success2 {
        t_id: u16,
    },
    /// AUTH_Failure1 (`from_controller`) or AUTH_Failure2.
    Failure {
        from_controller: bool,
        t_id: u16,
        reason: u8,
        explanation: u8,
    },
}

const WHAT: &str = "authentication message";

fn take<'a>(
    b: &'a [u8],
    off: usize,
    len: usize,
    field: &'static str,
) -> Result<&'a [u8], WireError> {
    let end = off
        .checked_add(len)
        .ok_or(WireError::bad(WHAT, field, len as u64))?;
    if end > b.len() || end > AUTH_MSG_MAX {
        return Err(WireError::Truncated {
            what: WHAT,
            need: end,
            have: b.len(),
        });
    }
    Ok(&b[off..end])
}

impl<'a> Message<'a> {
    /// The transaction id every message carries.
    pub fn t_id(&self) -> u16 {
        match *self {
            Message::Negotiate(m) => m.t_id,
            Message::Challenge(m) => m.t_id,
            Message::Reply(m) => m.t_id,
            Message::Success1(m) => m.t_id,
            Message::Success2 { t_id } | Message::Failure { t_id, .. } => t_id,
        }
    }

    /// A short name for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Negotiate(_) => "AUTH_Negotiate",
            Message::Challenge(_) => "DH-HMAC-CHAP_Challenge",
            Message::Reply(_) => "DH-HMAC-CHAP_Reply",
            Message::Success1(_) => "DH-HMAC-CHAP_Success1",
            Message::Success2 { .. } => "DH-HMAC-CHAP_Success2",
            Message::Failure {
                from_controller: true,
                ..
            } => "AUTH_Failure1",
            Message::Failure { .. } => "AUTH_Failure2",
        }
    }

    pub fn decode(b: &'a [u8]) -> Result<Message<'a>, WireError> {
        WireError::check_len(WHAT, b, 8)?;
        let t_id = u16_at(b, 4);
        match (b[0], b[1]) {
            (auth_type::COMMON, auth_id::NEGOTIATE) => {
                let napd = b[7] as usize;
                if napd == 0 {
                    return Err(WireError::bad(WHAT, "NAPD", 0u8));
                }
                // The descriptors that fit the largest message; the first
                // DH-HMAC-CHAP one is the offer.
                let descs = take(b, NEGOTIATE_HLEN, napd * NEGOTIATE_DESC_LEN, "NAPD")?;
                let d = descs
                    .chunks_exact(NEGOTIATE_DESC_LEN)
                    .find(|d| d[0] == AUTHID_DHCHAP)
                    .ok_or(WireError::bad(WHAT, "AUTHID", descs[0]))?;
                let (halen, dhlen) = (d[2] as usize, d[3] as usize);
                if halen > ID_LIST_MAX {
                    return Err(WireError::bad(WHAT, "HALEN", d[2]));
                }
                if dhlen > ID_LIST_MAX {
                    return Err(WireError::bad(WHAT, "DHLEN", d[3]));
                }
                Ok(Message::Negotiate(Negotiate {
                    t_id,
                    sc_c: b[6],
                    hashes: &d[4..4 + halen],
                    dhgroups: &d[34..34 + dhlen],
                }))
            }
            (auth_type::COMMON, id @ (auth_id::FAILURE1 | auth_id::FAILURE2)) => {
                Ok(Message::Failure {
                    from_controller: id == auth_id::FAILURE1,
                    t_id,
                    reason: b[6],
                    explanation: b[7],
                })
            }
            (auth_type::DHCHAP, id) => {
                WireError::check_len(WHAT, b, DHCHAP_HLEN)?;
                let hl = b[6] as usize;
                let dhvlen = u16_at(b, 10) as usize;
                match id {
                    auth_id::CHALLENGE => {
                        check_hl(hl)?;
                        check_dhvlen(dhvlen)?;
                        let c1 = take(b, DHCHAP_HLEN, hl, "HL")?;
                        let dhv = take(b, DHCHAP_HLEN + hl, dhvlen, "DHVLEN")?;
                        Ok(Message::Challenge(Challenge {
                            t_id,
                            hash_id: b[8],
                            dhgroup_id: b[9],
                            seqnum: u32_at(b, 12),
                            c1,
                            dhv,
                        }))
                    }
                    auth_id::REPLY => {
                        check_hl(hl)?;
                        check_dhvlen(dhvlen)?;
                        let r1 = take(b, DHCHAP_HLEN, hl, "HL")?;
                        let c2 = take(b, DHCHAP_HLEN + hl, hl, "HL")?;
                        let dhv = take(b, DHCHAP_HLEN + 2 * hl, dhvlen, "DHVLEN")?;
                        Ok(Message::Reply(Reply {
                            t_id,
                            cvalid: b[8] & 1 != 0,
                            seqnum: u32_at(b, 12),
                            r1,
                            c2,
                            dhv,
                        }))
                    }
                    auth_id::SUCCESS1 => {
                        check_hl(hl)?;
                        let r2 = if b[8] & 1 != 0 {
                            Some(take(b, DHCHAP_HLEN, hl, "HL")?)
                        } else {
                            None
                        };
                        Ok(Message::Success1(Success1 { t_id, hl: b[6], r2 }))
                    }
                    auth_id::SUCCESS2 => Ok(Message::Success2 { t_id }),
                    other => Err(WireError::bad(WHAT, "AUTH_ID", other)),
                }
            }
            (auth_type::COMMON, other) => Err(WireError::bad(WHAT, "AUTH_ID", other)),
            (other, _) => Err(WireError::bad(WHAT, "AUTH_TYPE", other)),
        }
    }

    /// Bytes [`Message::encode`] writes.
    pub fn len(&self) -> usize {
        match self {
            Message::Negotiate(_) => NEGOTIATE_HLEN + NEGOTIATE_DESC_LEN,
            Message::Challenge(m) => DHCHAP_HLEN + m.c1.len() + m.dhv.len(),
            Message::Reply(m) => DHCHAP_HLEN + m.r1.len() + m.c2.len() + m.dhv.len(),
            Message::Success1(m) => DHCHAP_HLEN + m.r2.map_or(0, <[u8]>::len),
            Message::Success2 { .. } => DHCHAP_HLEN,
            Message::Failure { .. } => FAILURE_LEN,
        }
    }

    /// Never empty: every message has a header.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Encodes into a new buffer. The caller builds messages from values
    /// it checked (HL, DHVLEN, list lengths within their limits); a value
    /// out of range here is a bug.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; self.len()];
        put_u16(&mut b, 4, self.t_id());
        match *self {
            Message::Negotiate(m) => {
                assert!(m.hashes.len() <= ID_LIST_MAX && m.dhgroups.len() <= ID_LIST_MAX);
                b[0] = auth_type::COMMON;
                b[1] = auth_id::NEGOTIATE;
                b[6] = m.sc_c;
                b[7] = 1;
                let d = &mut b[NEGOTIATE_HLEN..];
                d[0] = AUTHID_DHCHAP;
                d[2] = m.hashes.len() as u8;
                d[3] = m.dhgroups.len() as u8;
                d[4..4 + m.hashes.len()].copy_from_slice(m.hashes);
                d[34..34 + m.dhgroups.len()].copy_from_slice(m.dhgroups);
            }
            Message::Challenge(m) => {
                assert!(m.c1.len() <= HL_MAX && m.dhv.len() <= DHVLEN_MAX);
                b[0] = auth_type::DHCHAP;
                b[1] = auth_id::CHALLENGE;
                b[6] = m.c1.len() as u8;
                b[8] = m.hash_id;
                b[9] = m.dhgroup_id;
                put_u16(&mut b, 10, m.dhv.len() as u16);
                put_u32(&mut b, 12, m.seqnum);
                let hl = m.c1.len();
                b[16..16 + hl].copy_from_slice(m.c1);
                b[16 + hl..].copy_from_slice(m.dhv);
            }
            Message::Reply(m) => {
                assert!(m.r1.len() <= HL_MAX && m.c2.len() == m.r1.len());
                assert!(m.dhv.len() <= DHVLEN_MAX);
                b[0] = auth_type::DHCHAP;
                b[1] = auth_id::REPLY;
                b[6] = m.r1.len() as u8;
                b[8] = m.cvalid as u8;
                put_u16(&mut b, 10, m.dhv.len() as u16);
                put_u32(&mut b, 12, m.seqnum);
                let hl = m.r1.len();
                b[16..16 + hl].copy_from_slice(m.r1);
                b[16 + hl..16 + 2 * hl].copy_from_slice(m.c2);
                b[16 + 2 * hl..].copy_from_slice(m.dhv);
            }
            Message::Success1(m) => {
                b[0] = auth_type::DHCHAP;
                b[1] = auth_id::SUCCESS1;
                b[6] = m.hl;
                if let Some(r2) = m.r2 {
                    assert_eq!(r2.len(), m.hl as usize);
                    b[8] = 1;
                    b[16..].copy_from_slice(r2);
                }
            }
            Message::Success2 { .. } => {
                b[0] = auth_type::DHCHAP;
                b[1] = auth_id::SUCCESS2;
            }
            Message::Failure {
                from_controller,
                reason,
                explanation,
                ..
            } => {
                b[0] = auth_type::COMMON;
                b[1] = if from_controller {
                    auth_id::FAILURE1
                } else {
                    auth_id::FAILURE2
                };
                b[6] = reason;
                b[7] = explanation;
            }
        }
        b
    }
}

fn check_hl(hl: usize) -> Result<(), WireError> {
    if hl == 0 || hl > HL_MAX {
        return Err(WireError::bad(WHAT, "HL", hl as u64));
    }
    Ok(())
}

fn check_dhvlen(n: usize) -> Result<(), WireError> {
    if n > DHVLEN_MAX {
        return Err(WireError::bad(WHAT, "DHVLEN", n as u64));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabrics::fctype;

    #[test]
    fn auth_command_fields() {
        let s = AuthCmd::new(4096).to_sqe(7, fctype::AUTH_RECEIVE);
        assert_eq!(s.0[0], 0x7F);
        assert_eq!(s.0[4], 0x06);
        assert_eq!(&s.0[41..48], &[1, 1, 0xE9, 0, 0x10, 0, 0]);
        assert_eq!(s.sgl().id, sgl_id::TRANSPORT);
        let c = AuthCmd::from_sqe(&s);
        assert!(c.valid());
        assert_eq!(c.len, 4096);
        let mut bad = c;
        bad.secp = 0xEA;
        assert!(!bad.valid());
        assert!(!AuthCmd::new(0).valid());
        assert!(!AuthCmd::new(4097).valid());
        let send = AuthCmd::new(72).to_sqe(1, fctype::AUTH_SEND);
        assert_eq!(send.sgl().id, sgl_id::IN_CAPSULE);
    }

    #[test]
    fn negotiate_as_linux_sends_it() {
        // Layout per NVMe Base 2.0 §8.13.5.2, with the Linux host's lists.
        let mut b = [0u8; 72];
        b[4] = 3; // T_ID
        b[7] = 1; // NAPD
        b[8] = 1; // AUTHID DH-HMAC-CHAP
        b[10] = 3;
        b[11] = 6;
        b[12..15].copy_from_slice(&[1, 2, 3]);
        b[42..48].copy_from_slice(&[0, 1, 2, 3, 4, 5]);
        let m = Message::decode(&b).unwrap();
        let Message::Negotiate(n) = m else {
            panic!("{m:?}")
        };
        assert_eq!(n.t_id, 3);
        assert_eq!(n.hashes, &[1, 2, 3]);
        assert_eq!(n.dhgroups, &[0, 1, 2, 3, 4, 5]);
        assert_eq!(m.encode(), b.to_vec());
    }

    #[test]
    fn hostile_lengths_are_errors() {
        // NAPD pointing past the buffer, HALEN over 30, HL 0 and over 64,
        // DHVLEN past the buffer and over the largest group.
        let mut n = Message::Negotiate(Negotiate {
            t_id: 1,
            sc_c: 0,
            hashes: &[1],
            dhgroups: &[0],
        })
        .encode();
        n[7] = 2;
        assert!(Message::decode(&n).is_err());
        n[7] = 1;
        n[10] = 31;
        assert!(Message::decode(&n).is_err());
        let c1 = [9u8; 32];
        let mut c = Message::Challenge(Challenge {
            t_id: 1,
            hash_id: 1,
            dhgroup_id: 0,
            seqnum: 5,
            c1: &c1,
            dhv: &[],
        })
        .encode();
        assert!(Message::decode(&c).is_ok());
        c[6] = 0;
        assert!(Message::decode(&c).is_err());
        c[6] = 65;
        assert!(Message::decode(&c).is_err());
        c[6] = 32;
        put_u16(&mut c, 10, 0xFFFF);
        assert!(Message::decode(&c).is_err());
        put_u16(&mut c, 10, 8);
        assert!(Message::decode(&c).is_err(), "DHVLEN past the end");
        assert!(Message::decode(&[1, 9, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(Message::decode(&[2, 0, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(Message::decode(&[0, 0, 0]).is_err());
    }
}
