//! NVMe/RDMA transport formats (NVM Express RDMA Transport Specification
//! 1.0): the RDMA CM private data exchanged when a queue pair connects, and
//! the keyed SGL data block descriptor that names host memory.
//!
//! NVMe/RDMA has no PDU framing: one SEND carries one command capsule (the
//! 64-byte SQE, then in-capsule data on I/O queues) or one 16-byte response.
//! Data the SGL names in host memory moves by RDMA READ (host to controller)
//! and RDMA WRITE (controller to host), both issued by the controller.

use crate::error::WireError;
use crate::le::{put_u16, put_u32, put_u64, u16_at, u32_at, u64_at};
use crate::sqe::Sqe;

/// Length of the private data in RDMA_CM_REQUEST and RDMA_CM_ACCEPT.
pub const CM_PRIVATE_LEN: usize = 32;
/// Length of the private data in RDMA_CM_REJECT.
pub const CM_REJECT_LEN: usize = 4;
/// The conventional NVMe/RDMA port, for I/O and discovery alike.
pub const DEFAULT_PORT: u16 = 4420;
/// A response capsule is one completion queue entry (IORCSZ 1).
pub const RESPONSE_LEN: usize = 16;

/// SGL identifiers (SQE byte 39) NVMe/RDMA uses.
pub mod sgl_id {
    /// Keyed SGL data block, Address subtype: host memory named by a key.
    pub const KEYED: u8 = 0x40;
    /// Keyed SGL data block, Invalidate Key subtype: the host asks the
    /// controller to invalidate the key with its response (SEND with
    /// Invalidate).
    pub const KEYED_INVALIDATE: u8 = 0x4F;
    /// Data block, Offset subtype: data inside the capsule.
    pub const IN_CAPSULE: u8 = crate::sqe::sgl_id::IN_CAPSULE;
    /// The descriptor type nibble of keyed data blocks.
    pub const KEYED_TYPE: u8 = 0x4;
}

/// RDMA_CM_REJECT status values (RDMA transport spec, Figure 11).
pub mod reject {
    pub const INVALID_PRIVATE_DATA_LENGTH: u16 = 0x1;
    pub const INVALID_RECFMT: u16 = 0x2;
    pub const INVALID_QID: u16 = 0x3;
    pub const INVALID_HSQSIZE: u16 = 0x4;
    pub const INVALID_HRQSIZE: u16 = 0x5;
    pub const NO_RESOURCES: u16 = 0x6;
    pub const INVALID_IRD: u16 = 0x7;
    pub const INVALID_ORD: u16 = 0x8;
    pub const INVALID_CNTLID: u16 = 0x9;
}

/// Discovery log TSAS for RDMA (bytes 768..): queue pair, provider and
/// connection management types.
pub mod tsas {
    /// RDMA_QPTYPE: reliable connected.
    pub const QPTYPE_CONNECTED: u8 = 1;
    /// RDMA_PRTYPE: no particular provider.
    pub const PRTYPE_NOT_SPECIFIED: u8 = 1;
    /// RDMA_CMS: RDMA IP connection management.
    pub const CMS_RDMA_CM: u8 = 1;
}

/// RDMA_CM_REQUEST private data, host to controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmRequest {
    pub recfmt: u16,
    /// 0 for the admin queue, 1.. for I/O queues.
    pub qid: u16,
    /// Receive buffers the host posted for responses (a count).
    pub hrqsize: u16,
    /// The host's submission queue size, 0's based (Connect SQSIZE).
    pub hsqsize: u16,
    /// I/O queues: the controller the admin queue got (0 from older hosts).
    pub cntlid: u16,
}

impl CmRequest {
    /// Decodes the private data of a connect request. The CM delivers the
    /// whole private-data area of its message (56 bytes over RoCE, zero
    /// padded), so anything of at least 32 bytes is accepted.
    pub fn decode(b: &[u8]) -> Result<CmRequest, u16> {
        if b.len() < CM_PRIVATE_LEN {
            return Err(reject::INVALID_PRIVATE_DATA_LENGTH);
        }
        let r = CmRequest {
            recfmt: u16_at(b, 0),
            qid: u16_at(b, 2),
            hrqsize: u16_at(b, 4),
            hsqsize: u16_at(b, 6),
            cntlid: u16_at(b, 8),
        };
        if r.recfmt != 0 {
            return Err(reject::INVALID_RECFMT);
        }
        Ok(r)
    }

    pub fn encode(&self) -> [u8; CM_PRIVATE_LEN] {
        let mut b = [0u8; CM_PRIVATE_LEN];
        put_u16(&mut b, 0, self.recfmt);
        put_u16(&mut b, 2, self.qid);
        put_u16(&mut b, 4, self.hrqsize);
        put_u16(&mut b, 6, self.hsqsize);
        put_u16(&mut b, 8, self.cntlid);
        b
    }
}

/// RDMA_CM_ACCEPT private data, controller to host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmAccept {
    pub recfmt: u16,
    /// Receive buffers the controller posted for commands (a count).
    pub crqsize: u16,
}

impl CmAccept {
    pub fn decode(b: &[u8]) -> Result<CmAccept, WireError> {
        WireError::check_len("RDMA CM accept", b, 4)?;
        Ok(CmAccept {
            recfmt: u16_at(b, 0),
            crqsize: u16_at(b, 2),
        })
    }

    pub fn encode(&self) -> [u8; CM_PRIVATE_LEN] {
        let mut b = [0u8; CM_PRIVATE_LEN];
        put_u16(&mut b, 0, self.recfmt);
        put_u16(&mut b, 2, self.crqsize);
        b
    }
}

/// RDMA_CM_REJECT private data: RECFMT 0 and a status from [`reject`].
pub fn encode_reject(sts: u16) -> [u8; CM_REJECT_LEN] {
    let mut b = [0u8; CM_REJECT_LEN];
    put_u16(&mut b, 2, sts);
    b
}

/// The status of a reject's private data, if it is one.
pub fn decode_reject(b: &[u8]) -> Option<u16> {
    (b.len() >= CM_REJECT_LEN && u16_at(b, 0) == 0).then(|| u16_at(b, 2))
}

/// A keyed SGL data block descriptor (SQE bytes 24..40).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyedSgl {
    /// Where in the remote memory region (opaque to the controller).
    pub addr: u64,
    /// Bytes, at most 2^24 - 1.
    pub len: u32,
    /// The remote key.
    pub key: u32,
    /// The host asked for the key to be invalidated with the response.
    pub invalidate: bool,
}

/// The largest length a keyed descriptor can carry.
pub const KEYED_LEN_MAX: u32 = (1 << 24) - 1;

impl KeyedSgl {
    /// Reads descriptor 1 of `sqe` as a keyed data block; `None` when its
    /// type nibble is not 4h (subtypes other than 0h/Fh are returned with
    /// `invalidate` false and must be refused by the caller through
    /// [`keyed_subtype_ok`]).
    pub fn of(sqe: &Sqe) -> Option<KeyedSgl> {
        let b = &sqe.0;
        if b[39] >> 4 != sgl_id::KEYED_TYPE {
            return None;
        }
        Some(KeyedSgl {
            addr: u64_at(b, 24),
            len: u32_at(b, 32) & KEYED_LEN_MAX,
            key: u32_at(b, 35),
            invalidate: b[39] == sgl_id::KEYED_INVALIDATE,
        })
    }

    /// Writes this descriptor as descriptor 1 of `sqe`.
    pub fn put(&self, sqe: &mut Sqe) {
        let b = &mut sqe.0;
        put_u64(b, 24, self.addr);
        // LENGTH is 24 bits, KEY the 32 bits after it.
        put_u32(b, 32, self.len & KEYED_LEN_MAX);
        put_u32(b, 35, self.key);
        b[39] = if self.invalidate {
            sgl_id::KEYED_INVALIDATE
        } else {
            sgl_id::KEYED
        };
    }
}

/// Whether a keyed identifier's subtype is one NVMe/RDMA defines.
pub fn keyed_subtype_ok(id: u8) -> bool {
    id == sgl_id::KEYED || id == sgl_id::KEYED_INVALIDATE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linux_admin_and_io_requests_decode() {
        // A 6.12 host's admin request, padded to 56 bytes as the CM delivers it.
        let mut admin = [0u8; 56];
        admin[..10].copy_from_slice(&[0, 0, 0, 0, 0x20, 0, 0x1F, 0, 0, 0]);
        let r = CmRequest::decode(&admin).unwrap();
        assert_eq!((r.qid, r.hrqsize, r.hsqsize, r.cntlid), (0, 32, 31, 0));
        let io = [
            0, 0, 1, 0, 0x80, 0, 0x7F, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0, 0, 0, 0, 0,
        ];
        let r = CmRequest::decode(&io).unwrap();
        assert_eq!((r.qid, r.hrqsize, r.hsqsize, r.cntlid), (1, 128, 127, 1));
        assert_eq!(r.encode(), io);
    }

    #[test]
    fn bad_requests_get_the_spec_status() {
        assert_eq!(
            CmRequest::decode(&[0; 31]),
            Err(reject::INVALID_PRIVATE_DATA_LENGTH)
        );
        let mut b = [0u8; 32];
        b[0] = 1;
        assert_eq!(CmRequest::decode(&b), Err(reject::INVALID_RECFMT));
        assert_eq!(encode_reject(reject::INVALID_HSQSIZE), [0, 0, 4, 0]);
        assert_eq!(
            decode_reject(&[0, 0, 6, 0, 9, 9]),
            Some(reject::NO_RESOURCES)
        );
        assert_eq!(decode_reject(&[1, 0, 6, 0]), None);
    }

    #[test]
    fn keyed_descriptors_round_trip() {
        let mut sqe = Sqe::default();
        let k = KeyedSgl {
            addr: 0x1234_5678_9abc_def0,
            len: 4096,
            key: 0xdead_beef,
            invalidate: true,
        };
        k.put(&mut sqe);
        assert_eq!(&sqe.0[32..40], &[0, 0x10, 0, 0xef, 0xbe, 0xad, 0xde, 0x4f]);
        assert_eq!(KeyedSgl::of(&sqe), Some(k));
        let plain = KeyedSgl {
            invalidate: false,
            len: KEYED_LEN_MAX,
            ..k
        };
        plain.put(&mut sqe);
        assert_eq!(KeyedSgl::of(&sqe), Some(plain));
        assert!(keyed_subtype_ok(sqe.0[39]));
        sqe.0[39] = 0x5A;
        assert_eq!(KeyedSgl::of(&sqe), None);
        sqe.0[39] = 0x41;
        assert!(!keyed_subtype_ok(sqe.0[39]));
    }
}
