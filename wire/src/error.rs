//! The single error type of every decoder in this crate.

/// Why a byte sequence is not a valid instance of the structure asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("{what} needs {need} bytes, got {have}")]
    Truncated {
        what: &'static str,
        need: usize,
        have: usize,
    },
    #[error("unknown PDU type {0:#04x}")]
    UnknownPduType(u8),
    #[error("{what}: field {field} has invalid value {value:#x}")]
    BadField {
        what: &'static str,
        field: &'static str,
        value: u64,
    },
    #[error("{what}: string field {field} is not valid UTF-8")]
    BadString {
        what: &'static str,
        field: &'static str,
    },
}

impl WireError {
    pub(crate) fn check_len(what: &'static str, b: &[u8], need: usize) -> Result<(), WireError> {
        if b.len() < need {
            return Err(WireError::Truncated {
                what,
                need,
                have: b.len(),
            });
        }
        Ok(())
    }

    pub(crate) fn bad(what: &'static str, field: &'static str, value: impl Into<u64>) -> Self {
        WireError::BadField {
            what,
            field,
            value: value.into(),
        }
    }
}
