//! CRC-32C digests as NVMe/TCP uses them for HDGST and DDGST.
//!
//! The algorithm is CRC-32C (Castagnoli), initial value and final XOR
//! 0xFFFFFFFF; the 32-bit result goes on the wire little-endian.

/// Digest of one contiguous buffer.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// Continues a digest over the next piece of a buffer that arrives in parts.
#[inline]
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    crc32c::crc32c_append(crc, data)
}

#[cfg(test)]
mod tests {
    #[test]
    fn check_value_matches_the_spec() {
        assert_eq!(super::crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn append_equals_whole() {
        let data: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        let (a, b) = data.split_at(4097);
        assert_eq!(
            super::crc32c_append(super::crc32c(a), b),
            super::crc32c(&data)
        );
    }
}
