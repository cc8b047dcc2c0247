//! A volume's identity and layout, and the checks both the control plane
//! (before it allocates) and hosts (before they act on a plan) apply to
//! them. JSON-friendly serde: snake_case enums, UUIDs as strings; compact
//! binary encodings (postcard in the store) get the UUID's 16 bytes.

use crate::limits::{
    BLOCK_BYTES, COPIES_MAX, COPIES_MIN, EXTENTS_PER_VOLUME_MAX, EXTENT_BYTES_MAX,
    EXTENT_BYTES_MIN, STRIPE_BYTES_MIN, STRIPE_WIDTH_MAX,
};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

/// Why a UUID, a layout, a size or a connection plan is invalid. The
/// control plane's `ModelError` has a variant of the same name and text
/// for each (and more for its stored records), and converts from this.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("{kind} {value:?} is not a valid identifier (1..={max} bytes of A-Z a-z 0-9 . _ : -)")]
    InvalidId {
        kind: &'static str,
        value: String,
        max: usize,
    },
    #[error("invalid layout: {0}")]
    InvalidLayout(String),
    #[error("invalid size: {0}")]
    InvalidSize(String),
    #[error("{0}")]
    Invalid(String),
}

/// Checks an address hosts are told to connect to: a wildcard IP or port
/// 0 is where something listens, not where anyone can connect.
pub fn validate_connect_addr(field: &str, addr: SocketAddr) -> Result<(), LayoutError> {
    if addr.ip().is_unspecified() || addr.port() == 0 {
        return Err(LayoutError::Invalid(format!(
            "{field} {addr} is not an address hosts can connect to (needs a specific IP \
             and a port other than 0)"
        )));
    }
    Ok(())
}

/// A volume's identity, chosen by the client so that a retried create is
/// recognised. Canonical text form: lowercase, hyphenated.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Uuid(pub [u8; 16]);

impl Uuid {
    pub fn from_bytes(bytes: [u8; 16]) -> Uuid {
        Uuid(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Display for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, b) in self.0.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                f.write_str("-")?;
            }
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Uuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for Uuid {
    type Err = LayoutError;

    /// Parses `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (either case).
    fn from_str(s: &str) -> Result<Uuid, LayoutError> {
        let bad = || LayoutError::InvalidId {
            kind: "volume UUID",
            value: s.to_owned(),
            max: 36,
        };
        let b = s.as_bytes();
        if b.len() != 36 || [8, 13, 18, 23].iter().any(|&i| b[i] != b'-') {
            return Err(bad());
        }
        let hex: Vec<u8> = b.iter().copied().filter(|&c| c != b'-').collect();
        if hex.len() != 32 || !hex.iter().all(u8::is_ascii_hexdigit) {
            return Err(bad());
        }
        let nibble = |c: u8| (c as char).to_digit(16).expect("checked hex digit") as u8;
        let mut out = [0u8; 16];
        for (o, pair) in out.iter_mut().zip(hex.chunks(2)) {
            *o = nibble(pair[0]) << 4 | nibble(pair[1]);
        }
        Ok(Uuid(out))
    }
}

impl Serialize for Uuid {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(self)
        } else {
            self.0.serialize(s)
        }
    }
}

impl<'de> Deserialize<'de> for Uuid {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Uuid, D::Error> {
        if d.is_human_readable() {
            let s = String::deserialize(d)?;
            s.parse().map_err(serde::de::Error::custom)
        } else {
            <[u8; 16]>::deserialize(d).map(Uuid)
        }
    }
}

/// How a volume's bytes are spread over extents.
///
/// A volume has `width` stripe members (1 for concat and raid1), and each
/// member has `copies` identical copies (1 for concat and raid0). See
/// [`crate::mapping`] for the byte mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// Extents one after another, one copy.
    Concat,
    /// Striped over `width` members in units of `stripe_bytes`, one copy.
    Raid0 { stripe_bytes: u64, width: u32 },
    /// `copies` mirrors of a concatenation.
    Raid1 { copies: u8 },
    /// Striped over `width` members, each mirrored `copies` times.
    Raid10 {
        stripe_bytes: u64,
        width: u32,
        copies: u8,
    },
}

impl Layout {
    /// Stripe members (1 for concat and raid1).
    pub fn width(&self) -> u32 {
        match *self {
            Layout::Concat | Layout::Raid1 { .. } => 1,
            Layout::Raid0 { width, .. } | Layout::Raid10 { width, .. } => width,
        }
    }

    /// Copies of each member (1 for concat and raid0).
    pub fn copies(&self) -> u8 {
        match *self {
            Layout::Concat | Layout::Raid0 { .. } => 1,
            Layout::Raid1 { copies } | Layout::Raid10 { copies, .. } => copies,
        }
    }

    /// The stripe unit of striped layouts.
    pub fn stripe_bytes(&self) -> Option<u64> {
        match *self {
            Layout::Concat | Layout::Raid1 { .. } => None,
            Layout::Raid0 { stripe_bytes, .. } | Layout::Raid10 { stripe_bytes, .. } => {
                Some(stripe_bytes)
            }
        }
    }

    /// Extents in one row: every member's copies.
    pub fn extents_per_row(&self) -> u32 {
        self.width() * u32::from(self.copies())
    }

    /// Checks the layout for volumes built of `extent_bytes` extents: copies
    /// 2..=3, width 2..=`STRIPE_WIDTH_MAX`, stripe a power of two of at
    /// least 4 KiB and at most one extent.
    pub fn validate(&self, extent_bytes: u64) -> Result<(), LayoutError> {
        let bad = |m: String| Err(LayoutError::InvalidLayout(m));
        if let Layout::Raid1 { copies } | Layout::Raid10 { copies, .. } = *self {
            if !(COPIES_MIN..=COPIES_MAX).contains(&copies) {
                return bad(format!(
                    "{copies} copies; mirrored layouts have {COPIES_MIN}..={COPIES_MAX}"
                ));
            }
        }
        if let Layout::Raid0 {
            stripe_bytes,
            width,
        }
        | Layout::Raid10 {
            stripe_bytes,
            width,
            ..
        } = *self
        {
            if !(2..=STRIPE_WIDTH_MAX).contains(&width) {
                return bad(format!(
                    "stripe width {width}; striped layouts have 2..={STRIPE_WIDTH_MAX} members"
                ));
            }
            if !stripe_bytes.is_power_of_two()
                || stripe_bytes < STRIPE_BYTES_MIN
                || stripe_bytes > extent_bytes
            {
                return bad(format!(
                    "stripe of {stripe_bytes} bytes; it must be a power of two from \
                     {STRIPE_BYTES_MIN} to the extent size ({extent_bytes})"
                ));
            }
        }
        Ok(())
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Layout::Concat => write!(f, "concat"),
            Layout::Raid0 {
                stripe_bytes,
                width,
            } => write!(f, "raid0(width {width}, stripe {stripe_bytes})"),
            Layout::Raid1 { copies } => write!(f, "raid1({copies} copies)"),
            Layout::Raid10 {
                stripe_bytes,
                width,
                copies,
            } => write!(
                f,
                "raid10(width {width}, stripe {stripe_bytes}, {copies} copies)"
            ),
        }
    }
}

/// Checks an extent size: a power of two in `EXTENT_BYTES_MIN..=EXTENT_BYTES_MAX`.
pub fn validate_extent_bytes(extent_bytes: u64) -> Result<(), LayoutError> {
    if extent_bytes.is_power_of_two()
        && (EXTENT_BYTES_MIN..=EXTENT_BYTES_MAX).contains(&extent_bytes)
    {
        Ok(())
    } else {
        Err(LayoutError::InvalidSize(format!(
            "extent size {extent_bytes} must be a power of two from {EXTENT_BYTES_MIN} to \
             {EXTENT_BYTES_MAX}"
        )))
    }
}

/// Checks a volume size against its layout and extent size: a positive
/// multiple of 4 KiB that needs at most `EXTENTS_PER_VOLUME_MAX` extents.
pub fn validate_size(
    size_bytes: u64,
    layout: &Layout,
    extent_bytes: u64,
) -> Result<(), LayoutError> {
    if size_bytes == 0 || !size_bytes.is_multiple_of(BLOCK_BYTES) {
        return Err(LayoutError::InvalidSize(format!(
            "{size_bytes} bytes; a volume is a positive multiple of {BLOCK_BYTES} bytes"
        )));
    }
    let rows = size_bytes.div_ceil(extent_bytes * u64::from(layout.width()));
    let extents = rows * u64::from(layout.extents_per_row());
    if extents > u64::from(EXTENTS_PER_VOLUME_MAX) {
        return Err(LayoutError::InvalidSize(format!(
            "{size_bytes} bytes as {layout} needs {extents} extents of {extent_bytes} bytes, \
             at most {EXTENTS_PER_VOLUME_MAX}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    /// The control plane's default extent size.
    const EXTENT_BYTES: u64 = 1 << 30;

    #[test]
    fn uuid_text() {
        assert!(
            "0123456789AB-cdef-0123-4-56789abcdef"
                .parse::<Uuid>()
                .is_err(),
            "misplaced hyphens are refused"
        );
        let u: Uuid = "01234567-89AB-cdef-0123-456789abcdef".parse().unwrap();
        assert_eq!(u.to_string(), "01234567-89ab-cdef-0123-456789abcdef");
        assert!("01234567-89ab-cdef-0123-456789abcdeg"
            .parse::<Uuid>()
            .is_err());
        assert!("01234567-89ab-cdef-0123-456789abcde"
            .parse::<Uuid>()
            .is_err());
        assert!("+1234567-89ab-cdef-0123-456789abcdef"
            .parse::<Uuid>()
            .is_err());
        let json = serde_json::to_string(&u).unwrap();
        assert_eq!(json, "\"01234567-89ab-cdef-0123-456789abcdef\"");
        assert_eq!(serde_json::from_str::<Uuid>(&json).unwrap(), u);
    }

    #[test]
    fn layout_validation() {
        let e = EXTENT_BYTES;
        assert!(Layout::Concat.validate(e).is_ok());
        assert!(Layout::Raid1 { copies: 2 }.validate(e).is_ok());
        assert!(Layout::Raid1 { copies: 3 }.validate(e).is_ok());
        assert!(Layout::Raid1 { copies: 1 }.validate(e).is_err());
        assert!(Layout::Raid1 { copies: 4 }.validate(e).is_err());
        let r0 = |stripe_bytes, width| Layout::Raid0 {
            stripe_bytes,
            width,
        };
        assert!(r0(4096, 2).validate(e).is_ok());
        assert!(r0(e, STRIPE_WIDTH_MAX).validate(e).is_ok());
        assert!(r0(4096, 1).validate(e).is_err());
        assert!(r0(4096, STRIPE_WIDTH_MAX + 1).validate(e).is_err());
        assert!(r0(2048, 2).validate(e).is_err());
        assert!(r0(3 * 4096, 2).validate(e).is_err());
        assert!(r0(2 * e, 2).validate(e).is_err());
        let r10 = Layout::Raid10 {
            stripe_bytes: 65536,
            width: 2,
            copies: 2,
        };
        assert!(r10.validate(e).is_ok());
        assert_eq!(
            (r10.width(), r10.copies(), r10.extents_per_row()),
            (2, 2, 4)
        );
        assert!(Layout::Raid10 {
            stripe_bytes: 65536,
            width: 2,
            copies: 5
        }
        .validate(e)
        .is_err());
    }

    #[test]
    fn size_validation() {
        let e = MIB;
        assert!(validate_size(4096, &Layout::Concat, e).is_ok());
        assert!(validate_size(0, &Layout::Concat, e).is_err());
        assert!(validate_size(4097, &Layout::Concat, e).is_err());
        let max = u64::from(EXTENTS_PER_VOLUME_MAX) * e;
        assert!(validate_size(max, &Layout::Concat, e).is_ok());
        assert!(validate_size(max + 4096, &Layout::Concat, e).is_err());
        assert!(validate_size(max, &Layout::Raid1 { copies: 2 }, e).is_err());
        assert!(validate_size(max / 2, &Layout::Raid1 { copies: 2 }, e).is_ok());
        assert!(validate_extent_bytes(EXTENT_BYTES).is_ok());
        assert!(validate_extent_bytes(EXTENT_BYTES_MIN / 2).is_err());
        assert!(validate_extent_bytes(EXTENT_BYTES_MAX * 2).is_err());
        assert!(validate_extent_bytes(3 * MIB).is_err());
    }
}
