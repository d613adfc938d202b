//! Hand-made PNG bytes for the decoders' tests: the chunk CRC that a forged header needs.

/// The CRC-32 of a PNG chunk's type and data (ISO 3309, as the PNG specification defines it).
pub fn crc32(data: &[u8]) -> u32 {
    let mut crc = 0xffff_ffffu32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_iend_chunk_has_its_well_known_crc() {
        assert_eq!(super::crc32(b"IEND"), 0xae42_6082);
    }
}
