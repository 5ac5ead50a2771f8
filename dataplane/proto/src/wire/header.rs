//! The 48-byte `struct rds_header` (spec §2, §3).

use super::ext::{ExtHeaders, EXT_SPACE};
use super::Error;

/// Size of the RDS header on the wire.
pub const HEADER_LEN: usize = 48;

/// Byte ranges of the header fields (all big-endian).
pub(crate) mod field {
    use core::ops::Range;

    pub const SEQUENCE: Range<usize> = 0..8;
    pub const ACK: Range<usize> = 8..16;
    pub const LEN: Range<usize> = 16..20;
    pub const SPORT: Range<usize> = 20..22;
    pub const DPORT: Range<usize> = 22..24;
    pub const FLAGS: usize = 24;
    pub const CREDIT: usize = 25;
    pub const PADDING: Range<usize> = 26..30;
    pub const CHECKSUM: Range<usize> = 30..32;
    pub const EXTHDR: Range<usize> = 32..48;
}

/// `h_flags` bits.
pub mod flags {
    /// Congestion-map update. Receivers compare `h_flags` to this value with exact equality;
    /// use [`is_cong_bitmap`].
    pub const CONG_BITMAP: u8 = 0x01;
    /// IB only: the receiver should acknowledge promptly. Never sent on TCP.
    pub const ACK_REQUIRED: u8 = 0x02;
    /// The message is a resend after a reconnect; enables duplicate dropping.
    pub const RETRANSMITTED: u8 = 0x04;
    /// Recent kernels: an `RDMA_BYTES` extension was added. Informational.
    pub const EXTHDR_EXTENSION: u8 = 0x20;

    /// True when a message with these flags is a congestion map (`h_flags == 0x01` exactly).
    pub const fn is_cong_bitmap(flags: u8) -> bool {
        flags == CONG_BITMAP
    }
}

/// A read/write view of a header in a byte buffer.
#[derive(Debug, Clone)]
pub struct HeaderPacket<T: AsRef<[u8]>> {
    buffer: T,
}

fn be_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    u64::from_be_bytes(a)
}

fn be_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(b);
    u32::from_be_bytes(a)
}

fn be_u16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

impl<T: AsRef<[u8]>> HeaderPacket<T> {
    /// Wraps a buffer without checking its length; accessors may panic if it is short.
    /// Prefer [`HeaderPacket::new_checked`].
    pub const fn new_unchecked(buffer: T) -> Self {
        HeaderPacket { buffer }
    }

    /// Wraps a buffer of at least [`HEADER_LEN`] bytes.
    pub fn new_checked(buffer: T) -> Result<Self, Error> {
        let packet = Self::new_unchecked(buffer);
        packet.check_len()?;
        Ok(packet)
    }

    /// Fails with [`Error::Truncated`] if the buffer cannot hold a header.
    pub fn check_len(&self) -> Result<(), Error> {
        if self.buffer.as_ref().len() < HEADER_LEN {
            Err(Error::Truncated)
        } else {
            Ok(())
        }
    }

    /// Returns the wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn bytes(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// `h_sequence`.
    pub fn sequence(&self) -> u64 {
        be_u64(&self.bytes()[field::SEQUENCE])
    }

    /// `h_ack` (IB only; 0 on TCP).
    pub fn ack(&self) -> u64 {
        be_u64(&self.bytes()[field::ACK])
    }

    /// `h_len`: payload length, header excluded.
    pub fn len(&self) -> u32 {
        be_u32(&self.bytes()[field::LEN])
    }

    /// True when `h_len` is 0.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `h_sport`.
    pub fn sport(&self) -> u16 {
        be_u16(&self.bytes()[field::SPORT])
    }

    /// `h_dport`.
    pub fn dport(&self) -> u16 {
        be_u16(&self.bytes()[field::DPORT])
    }

    /// `h_flags`.
    pub fn flags(&self) -> u8 {
        self.bytes()[field::FLAGS]
    }

    /// `h_credit` (IB only).
    pub fn credit(&self) -> u8 {
        self.bytes()[field::CREDIT]
    }

    /// `h_padding` (sent as zero, ignored on receipt).
    pub fn padding(&self) -> [u8; 4] {
        let mut p = [0u8; 4];
        p.copy_from_slice(&self.bytes()[field::PADDING]);
        p
    }

    /// `h_csum` (0 on TCP).
    pub fn checksum(&self) -> u16 {
        be_u16(&self.bytes()[field::CHECKSUM])
    }

    /// The raw 16-byte extension area.
    pub fn exthdr(&self) -> &[u8] {
        &self.bytes()[field::EXTHDR]
    }

    /// Checks the header checksum with the receiver's rule (§4).
    pub fn verify_checksum(&self) -> bool {
        super::verify_header_checksum(self.bytes())
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> HeaderPacket<T> {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }

    /// Sets `h_sequence`.
    pub fn set_sequence(&mut self, value: u64) {
        self.bytes_mut()[field::SEQUENCE].copy_from_slice(&value.to_be_bytes());
    }

    /// Sets `h_ack`.
    pub fn set_ack(&mut self, value: u64) {
        self.bytes_mut()[field::ACK].copy_from_slice(&value.to_be_bytes());
    }

    /// Sets `h_len`.
    pub fn set_len(&mut self, value: u32) {
        self.bytes_mut()[field::LEN].copy_from_slice(&value.to_be_bytes());
    }

    /// Sets `h_sport`.
    pub fn set_sport(&mut self, value: u16) {
        self.bytes_mut()[field::SPORT].copy_from_slice(&value.to_be_bytes());
    }

    /// Sets `h_dport`.
    pub fn set_dport(&mut self, value: u16) {
        self.bytes_mut()[field::DPORT].copy_from_slice(&value.to_be_bytes());
    }

    /// Sets `h_flags`.
    pub fn set_flags(&mut self, value: u8) {
        self.bytes_mut()[field::FLAGS] = value;
    }

    /// Sets `h_credit`.
    pub fn set_credit(&mut self, value: u8) {
        self.bytes_mut()[field::CREDIT] = value;
    }

    /// Sets `h_padding`.
    pub fn set_padding(&mut self, value: [u8; 4]) {
        self.bytes_mut()[field::PADDING].copy_from_slice(&value);
    }

    /// Sets `h_csum`.
    pub fn set_checksum(&mut self, value: u16) {
        self.bytes_mut()[field::CHECKSUM].copy_from_slice(&value.to_be_bytes());
    }

    /// The raw extension area, writable.
    pub fn exthdr_mut(&mut self) -> &mut [u8] {
        &mut self.bytes_mut()[field::EXTHDR]
    }

    /// Computes and stores the header checksum (as RDS/IB does).
    pub fn fill_checksum(&mut self) {
        let csum = super::compute_header_checksum(self.bytes()).unwrap_or(0);
        self.set_checksum(csum);
    }
}

/// The parsed header. Padding and checksum are not represented: [`HeaderRepr::emit`] writes
/// them as zero, as the kernel's TCP transport does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeaderRepr {
    /// Per-path sequence number (0 for congestion maps).
    pub sequence: u64,
    /// IB acknowledgement (0 on TCP).
    pub ack: u64,
    /// Payload length.
    pub len: u32,
    /// Source RDS port.
    pub sport: u16,
    /// Destination RDS port.
    pub dport: u16,
    /// `h_flags`, see [`flags`].
    pub flags: u8,
    /// IB credit grant (0 on TCP).
    pub credit: u8,
    /// Extension area.
    pub exthdr: ExtHeaders,
}

impl HeaderRepr {
    /// Parses a header. Like the kernel's TCP receiver it validates nothing beyond the length:
    /// flags, padding, checksum and `h_len` bounds are the caller's business.
    pub fn parse<T: AsRef<[u8]>>(packet: &HeaderPacket<T>) -> Result<HeaderRepr, Error> {
        packet.check_len()?;
        let mut ext = [0u8; EXT_SPACE];
        ext.copy_from_slice(packet.exthdr());
        Ok(HeaderRepr {
            sequence: packet.sequence(),
            ack: packet.ack(),
            len: packet.len(),
            sport: packet.sport(),
            dport: packet.dport(),
            flags: packet.flags(),
            credit: packet.credit(),
            exthdr: ExtHeaders::from_bytes(ext),
        })
    }

    /// Parses the first [`HEADER_LEN`] bytes of `bytes`.
    pub fn parse_bytes(bytes: &[u8]) -> Result<HeaderRepr, Error> {
        HeaderRepr::parse(&HeaderPacket::new_checked(bytes)?)
    }

    /// Length of the emitted header.
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header, with zero padding and a zero checksum.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, packet: &mut HeaderPacket<T>) {
        packet.set_sequence(self.sequence);
        packet.set_ack(self.ack);
        packet.set_len(self.len);
        packet.set_sport(self.sport);
        packet.set_dport(self.dport);
        packet.set_flags(self.flags);
        packet.set_credit(self.credit);
        packet.set_padding([0; 4]);
        packet.set_checksum(0);
        packet.exthdr_mut().copy_from_slice(self.exthdr.as_bytes());
    }

    /// Emits into a fresh 48-byte array.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        self.emit(&mut HeaderPacket::new_unchecked(&mut out[..]));
        out
    }

    /// True when this header announces a congestion map (`h_flags == 0x01` exactly).
    pub const fn is_cong_bitmap(&self) -> bool {
        flags::is_cong_bitmap(self.flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::ExtHeader;

    #[test]
    fn field_offsets_match_spec() {
        let repr = HeaderRepr {
            sequence: 0x0102_0304_0506_0708,
            ack: 0x1112_1314_1516_1718,
            len: 0x2122_2324,
            sport: 0x2526,
            dport: 0x2728,
            flags: 0x04,
            credit: 0x29,
            exthdr: ExtHeaders::new(),
        };
        let bytes = repr.to_bytes();
        assert_eq!(&bytes[0..8], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            &bytes[8..16],
            &[0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18]
        );
        assert_eq!(&bytes[16..20], &[0x21, 0x22, 0x23, 0x24]);
        assert_eq!(&bytes[20..22], &[0x25, 0x26]);
        assert_eq!(&bytes[22..24], &[0x27, 0x28]);
        assert_eq!(bytes[24], 0x04);
        assert_eq!(bytes[25], 0x29);
        assert_eq!(&bytes[26..48], &[0u8; 22]);
        assert_eq!(HeaderRepr::parse_bytes(&bytes), Ok(repr));
    }

    #[test]
    fn short_buffer_is_an_error() {
        assert_eq!(
            HeaderPacket::new_checked(&[0u8; 47][..]).err(),
            Some(Error::Truncated)
        );
        assert_eq!(HeaderRepr::parse_bytes(&[0u8; 3]), Err(Error::Truncated));
    }

    #[test]
    fn exact_cong_bitmap_test() {
        assert!(flags::is_cong_bitmap(0x01));
        assert!(!flags::is_cong_bitmap(0x05));
        assert!(!flags::is_cong_bitmap(0x00));
    }

    #[test]
    fn checksum_helpers_on_packet() {
        let mut ext = ExtHeaders::new();
        ext.push(ExtHeader::NPaths(8)).unwrap();
        let repr = HeaderRepr {
            sequence: 9,
            len: 100,
            sport: 5,
            dport: 6,
            exthdr: ext,
            ..Default::default()
        };
        let mut bytes = repr.to_bytes();
        let mut packet = HeaderPacket::new_unchecked(&mut bytes[..]);
        packet.fill_checksum();
        assert_ne!(packet.checksum(), 0);
        assert!(packet.verify_checksum());
        packet.set_sport(7);
        assert!(!packet.verify_checksum());
    }
}
