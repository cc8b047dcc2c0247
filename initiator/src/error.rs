//! Errors of the initiator.

use nvpool_wire::Status;
use std::io;

/// Why a connection or controller operation failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot reach {addr}")]
    Connect {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("connection to {addr} failed")]
    Io {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("{addr}: protocol error: {what}")]
    Protocol { addr: String, what: String },
    #[error("{addr}: controller terminated the connection (FES {fes:#x})")]
    Terminated { addr: String, fes: u16 },
    #[error("{addr}: {what} failed: {status}")]
    Status {
        addr: String,
        what: &'static str,
        status: Status,
    },
    #[error("{addr}: timed out waiting for {what}")]
    Timeout { addr: String, what: &'static str },
    #[error("{addr}: controller lost: no reconnect succeeded within {timeout:?}")]
    ControllerLost {
        addr: String,
        timeout: std::time::Duration,
    },
    #[error("{0}")]
    Invalid(String),
    /// In-band authentication (DH-HMAC-CHAP) of a queue failed.
    #[error("{addr}: queue {qid}: DH-HMAC-CHAP authentication failed")]
    Auth {
        addr: String,
        qid: u16,
        source: nvpool_wire::dhchap::AuthError,
    },
    /// RDMA was asked for and this machine cannot do it (libraries, kernel
    /// support); the text says why.
    #[error("RDMA unavailable: {0}")]
    RdmaUnavailable(String),
}

impl Error {
    /// True when the failure is of the connection (worth reconnecting),
    /// not of a command or a setting.
    pub fn is_transport(&self) -> bool {
        matches!(
            self,
            Error::Io { .. }
                | Error::Protocol { .. }
                | Error::Terminated { .. }
                | Error::Timeout { .. }
                | Error::Connect { .. }
        )
    }
}

/// Why one I/O failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IoError {
    /// The controller completed the command with an error status.
    #[error("{0}")]
    Status(Status),
    /// The controller is gone and did not come back in time.
    #[error("controller lost")]
    ControllerLost,
    /// The data arrived damaged (data digest) too often.
    #[error("data digest mismatch")]
    Digest,
    /// The request itself is wrong (alignment, range).
    #[error("{0}")]
    Invalid(&'static str),
}
