//! NVMe completion status: status code type, status code, DNR and friends.

use std::fmt;

/// A completion status as carried in the upper 15 bits of CQE dword 3.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status {
    /// Status Code Type (0 generic, 1 command specific, 2 media, 3 path).
    pub sct: u8,
    /// Status Code.
    pub sc: u8,
    /// Command Retry Delay index (0..=3).
    pub crd: u8,
    /// More information in the Error log.
    pub more: bool,
    /// Do Not Retry.
    pub dnr: bool,
}

const fn st(sct: u8, sc: u8, dnr: bool) -> Status {
    Status {
        sct,
        sc,
        crd: 0,
        more: false,
        dnr,
    }
}

impl Status {
    pub const SUCCESS: Status = st(0, 0x00, false);
    pub const INVALID_OPCODE: Status = st(0, 0x01, true);
    pub const INVALID_FIELD: Status = st(0, 0x02, true);
    pub const CID_CONFLICT: Status = st(0, 0x03, true);
    pub const DATA_TRANSFER_ERROR: Status = st(0, 0x04, false);
    pub const INTERNAL_ERROR: Status = st(0, 0x06, false);
    pub const ABORT_REQUESTED: Status = st(0, 0x07, false);
    pub const INVALID_NS: Status = st(0, 0x0B, true);
    pub const COMMAND_SEQUENCE_ERROR: Status = st(0, 0x0C, true);
    pub const SGL_DATA_INVALID: Status = st(0, 0x0F, true);
    pub const SGL_TYPE_INVALID: Status = st(0, 0x11, true);
    pub const SGL_OFFSET_INVALID: Status = st(0, 0x16, true);
    pub const KATO_EXPIRED: Status = st(0, 0x19, false);
    pub const KATO_INVALID: Status = st(0, 0x1A, true);
    pub const NS_WRITE_PROTECTED: Status = st(0, 0x20, true);
    pub const TRANSIENT_TRANSPORT_ERROR: Status = st(0, 0x22, false);
    pub const LBA_OUT_OF_RANGE: Status = st(0, 0x80, true);
    pub const CAPACITY_EXCEEDED: Status = st(0, 0x81, true);
    pub const NS_NOT_READY: Status = st(0, 0x82, false);
    /// A write tagged at or below a sealed snapshot's epoch
    /// (design/thin-snapshots.md T5): only a fenced writer sends one.
    pub const RESERVATION_CONFLICT: Status = st(0, 0x83, true);

    pub const INVALID_QUEUE_ID: Status = st(1, 0x01, true);
    pub const INVALID_QUEUE_SIZE: Status = st(1, 0x02, true);
    pub const AER_LIMIT_EXCEEDED: Status = st(1, 0x05, true);
    pub const INVALID_LOG_PAGE: Status = st(1, 0x09, true);
    pub const FEATURE_NOT_CHANGEABLE: Status = st(1, 0x0E, true);
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status = st(1, 0x80, true);
    pub const CONNECT_CONTROLLER_BUSY: Status = st(1, 0x81, true);
    pub const CONNECT_INVALID_PARAMETERS: Status = st(1, 0x82, true);
    pub const CONNECT_RESTART_DISCOVERY: Status = st(1, 0x83, true);
    pub const CONNECT_INVALID_HOST: Status = st(1, 0x84, true);
    /// The queue must complete in-band authentication first (DNR: a hard
    /// error to the host; without DNR the Linux host re-authenticates).
    pub const AUTH_REQUIRED: Status = st(1, 0x91, true);

    pub const WRITE_FAULT: Status = st(2, 0x80, false);
    pub const UNRECOVERED_READ_ERROR: Status = st(2, 0x81, false);

    // Path related (SCT 3). Never with DNR: a host fails these over to
    // another path, and DNR would make it complete the I/O with an error
    // instead.
    /// Asymmetric Access Persistent Loss: the ANA group is lost on this path.
    pub const ANA_PERSISTENT_LOSS: Status = st(3, 0x01, false);
    /// Asymmetric Access Inaccessible: use another path.
    pub const ANA_INACCESSIBLE: Status = st(3, 0x02, false);
    /// Asymmetric Access Transition: the group is changing state on this path.
    pub const ANA_TRANSITION: Status = st(3, 0x03, false);

    /// Encodes into the 16-bit status field (bit 0, the phase tag, is 0 on fabrics).
    pub const fn to_wire(self) -> u16 {
        let v = (self.sc as u16)
            | ((self.sct as u16 & 0x7) << 8)
            | ((self.crd as u16 & 0x3) << 11)
            | ((self.more as u16) << 13)
            | ((self.dnr as u16) << 14);
        v << 1
    }

    /// Decodes the 16-bit status field; the phase tag is ignored.
    pub const fn from_wire(raw: u16) -> Status {
        let v = raw >> 1;
        Status {
            sc: (v & 0xFF) as u8,
            sct: ((v >> 8) & 0x7) as u8,
            crd: ((v >> 11) & 0x3) as u8,
            more: (v >> 13) & 1 == 1,
            dnr: (v >> 14) & 1 == 1,
        }
    }

    pub const fn is_success(self) -> bool {
        self.sct == 0 && self.sc == 0
    }

    /// A path related status (SCT 3): the command may succeed through
    /// another path to the same namespace.
    pub const fn is_path_error(self) -> bool {
        self.sct == 3
    }

    /// The same status without the Do Not Retry bit.
    pub const fn retryable(self) -> Status {
        Status { dnr: false, ..self }
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Status(sct={:#x}, sc={:#04x}{})",
            self.sct,
            self.sc,
            if self.dnr { ", dnr" } else { "" }
        )
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match (self.sct, self.sc) {
            (0, 0x00) => "success",
            (0, 0x01) => "invalid opcode",
            (0, 0x02) => "invalid field",
            (0, 0x04) => "data transfer error",
            (0, 0x06) => "internal error",
            (0, 0x0B) => "invalid namespace",
            (0, 0x0C) => "command sequence error",
            (0, 0x0F) => "SGL data block invalid",
            (0, 0x16) => "SGL offset invalid",
            (0, 0x80) => "LBA out of range",
            (0, 0x81) => "capacity exceeded",
            (0, 0x83) => "reservation conflict",
            (1, 0x84) => "connect: invalid host",
            (1, 0x82) => "connect: invalid parameters",
            (1, 0x91) => "authentication required",
            (2, 0x80) => "write fault",
            (2, 0x81) => "unrecovered read error",
            (3, 0x01) => "ANA persistent loss",
            (3, 0x02) => "ANA inaccessible",
            (3, 0x03) => "ANA transition",
            _ => "status",
        };
        write!(f, "{name} ({:?})", self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_wire_values() {
        assert_eq!(Status::SUCCESS.to_wire(), 0);
        // LBA out of range with DNR: (0x80 | 1<<14) << 1
        assert_eq!(Status::LBA_OUT_OF_RANGE.to_wire(), 0x8100);
        // 1h/91h with DNR, as nvmet answers an unauthenticated queue.
        assert_eq!(Status::AUTH_REQUIRED.to_wire(), (0x191 | 0x4000) << 1);
        // Connect invalid host: sct 1, sc 0x84, dnr.
        assert_eq!(
            Status::CONNECT_INVALID_HOST.to_wire(),
            ((0x84 | 1 << 8 | 1 << 14) << 1) as u16
        );
    }

    #[test]
    fn ana_statuses_are_path_errors_without_dnr() {
        for (s, wire) in [
            (Status::ANA_PERSISTENT_LOSS, 0x0602),
            (Status::ANA_INACCESSIBLE, 0x0604),
            (Status::ANA_TRANSITION, 0x0606),
        ] {
            assert_eq!(s.to_wire(), wire, "{s}");
            assert!(s.is_path_error() && !s.dnr, "{s}");
        }
        assert!(!Status::LBA_OUT_OF_RANGE.is_path_error());
    }

    #[test]
    fn round_trip_every_value() {
        for raw in 0..=u16::MAX {
            let s = Status::from_wire(raw);
            assert_eq!(s.to_wire(), raw & !1, "raw {raw:#x}");
        }
    }
}
