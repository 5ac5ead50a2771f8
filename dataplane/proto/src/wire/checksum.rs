//! RFC 1071 Internet checksum over the 48-byte header (spec §4). RDS/TCP never uses it (the
//! kernel sends 0), RDS/IB does.

use super::header::{field, HEADER_LEN};

/// One's-complement sum of big-endian 16-bit words, with the checksum field read as zero.
fn ones_complement_sum(header: &[u8], skip_checksum_field: bool) -> u16 {
    let mut sum: u32 = 0;
    for (i, word) in header.chunks(2).enumerate() {
        if skip_checksum_field && i * 2 == field::CHECKSUM.start {
            continue;
        }
        let hi = u32::from(word[0]) << 8;
        let lo = u32::from(word.get(1).copied().unwrap_or(0));
        sum += hi | lo;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// The checksum to store at offset 30 of a header: the complemented one's-complement sum of the
/// 48 header bytes with the checksum field taken as zero. Only the first 48 bytes of `header`
/// are used; `None` if it is shorter.
pub fn compute_header_checksum(header: &[u8]) -> Option<u16> {
    let header = header.get(..HEADER_LEN)?;
    Some(!ones_complement_sum(header, true))
}

/// The receiver's test: a header passes if its checksum field is 0, or if the sum over all 48
/// bytes (checksum included) folds to 0xFFFF. `false` if `header` is shorter than 48 bytes.
pub fn verify_header_checksum(header: &[u8]) -> bool {
    let Some(header) = header.get(..HEADER_LEN) else {
        return false;
    };
    let stored = u16::from_be_bytes([
        header[field::CHECKSUM.start],
        header[field::CHECKSUM.start + 1],
    ]);
    stored == 0 || !ones_complement_sum(header, false) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_corruption() {
        let mut h = [0u8; HEADER_LEN];
        for (i, b) in h.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37).wrapping_add(1);
        }
        h[30] = 0;
        h[31] = 0;
        assert!(verify_header_checksum(&h), "zero checksum always passes");
        let c = compute_header_checksum(&h).unwrap();
        h[30..32].copy_from_slice(&c.to_be_bytes());
        assert!(verify_header_checksum(&h));
        h[5] ^= 0x40;
        assert!(!verify_header_checksum(&h));
        assert!(!verify_header_checksum(&h[..47]));
        assert_eq!(compute_header_checksum(&h[..10]), None);
    }
}
