//! Explicit little-endian field access.
//!
//! Every helper takes a slice and a byte offset. Callers pass buffers whose
//! length was checked against the structure's fixed size, so an out-of-range
//! offset is a bug in this crate (it panics), never an input error.

#[inline]
pub fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

#[inline]
pub fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

#[inline]
pub fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

#[inline]
pub fn put_u16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}

#[inline]
pub fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

#[inline]
pub fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// Writes `s` into `dst`, padding the rest with `pad` (spaces for Identify
/// strings, NULs for NQNs). Truncates when `s` is longer than `dst`.
pub fn put_str_padded(dst: &mut [u8], s: &str, pad: u8) {
    let n = s.len().min(dst.len());
    dst[..n].copy_from_slice(&s.as_bytes()[..n]);
    dst[n..].fill(pad);
}

/// Reads a NUL- or space-terminated ASCII/UTF-8 string from a fixed field.
/// Returns `None` when the bytes are not UTF-8.
pub fn str_in(field: &[u8]) -> Option<&str> {
    let end = field.iter().position(|&c| c == 0).unwrap_or(field.len());
    std::str::from_utf8(&field[..end])
        .ok()
        .map(|s| s.trim_end_matches(' '))
}
