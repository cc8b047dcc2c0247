//! The limits a volume's layout is checked against, named, with the unit
//! last and the reason. Hosts check received plans against the same
//! numbers the control plane allocates by.

/// Smallest configurable extent. Tests use 1 MiB extents to build many-extent
/// volumes on small fake devices; nothing smaller is useful.
pub const EXTENT_BYTES_MIN: u64 = 1 << 20;
/// Largest configurable extent: with `EXTENTS_PER_VOLUME_MAX` it bounds a
/// volume at 512 TiB of raw space.
pub const EXTENT_BYTES_MAX: u64 = 64 << 30;

/// Volume sizes and stripe units are multiples of this: the logical block
/// size every target namespace offers and the smallest O_DIRECT unit.
pub const BLOCK_BYTES: u64 = 4096;
/// Smallest stripe unit (one block).
pub const STRIPE_BYTES_MIN: u64 = BLOCK_BYTES;
/// Stripe members of a raid0/raid10 volume. Each member of a row sits on its
/// own target, so this is also the number of targets one row may span; 32
/// covers any sensible fan-out and keeps a row's placement a small loop.
pub const STRIPE_WIDTH_MAX: u32 = 32;
/// Copies of a mirrored volume: 2 survives one failure, 3 survives two;
/// more buys nothing a failure-domain-aware 3 does not.
pub const COPIES_MIN: u8 = 2;
pub const COPIES_MAX: u8 = 3;

/// Extents of one volume, all members and copies counted. Bounds the size
/// of a volume record (see the control plane's `VOLUME_ENCODED_BYTES_MAX`)
/// so that one volume is one store value even on etcd. 8192 extents of the
/// default size is 8 TiB of raw space; larger volumes need a larger extent
/// size.
pub const EXTENTS_PER_VOLUME_MAX: u32 = 8192;

const _: () = assert!(EXTENT_BYTES_MIN.is_power_of_two() && EXTENT_BYTES_MAX.is_power_of_two());
const _: () =
    assert!(EXTENT_BYTES_MIN.is_multiple_of(BLOCK_BYTES) && STRIPE_BYTES_MIN <= EXTENT_BYTES_MIN);
const _: () = assert!(COPIES_MIN <= COPIES_MAX);
