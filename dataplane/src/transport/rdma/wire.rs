//! RDS/IB wire details the link owns (spec §12): the rdma_cm private data, fragment sizes and
//! the header fields the link rewrites per fragment (`h_ack`, `h_credit`, checksum).

use rds_proto::wire::flags;
use rds_proto::wire::HeaderPacket;

/// RDS/IB's rdma_cm port for IPv4 peers.
pub const RDS_IB_PORT: u16 = 18634;
/// The RDS header that starts every fragment.
pub const HDR: usize = 48;
/// Payload bytes per fragment (one IB SEND carries `[header][<= 4096 bytes]`).
pub const FRAG: usize = 4096;
/// One send or receive buffer: a header and a fragment.
pub const SLOT: usize = HDR + FRAG;
/// `private_data_len` of the IPv4 layout.
pub const PRIV_LEN: usize = 32;
/// The protocol version we propose and accept: 3.1, minor mask 0x0003 (mainline's).
pub const VERSION: (u8, u8) = (3, 1);
const MINOR_MASK: u16 = 0x0003;
/// Reject data for an incompatible version (`RDS_RDMA_REJ_INCOMPAT`, a native int 1).
pub const REJ_INCOMPAT: i32 = 1;
/// Reject data for a doorbell (a connect from the larger address): 0, which a kernel peer
/// answers by dropping the attempt and connecting again later.
pub const REJ_DOORBELL: i32 = 0;
/// An ack is worth sending once this many posted receive buffers wait to be advertised.
pub const CREDIT_ACK_THRESHOLD: u32 = 16;

/// The IPv4 private data exchanged in the REQ and the REP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrivData {
    /// Sender's RDS address.
    pub saddr: u32,
    /// Receiver's RDS address.
    pub daddr: u32,
    /// Protocol major.
    pub major: u8,
    /// Protocol minor.
    pub minor: u8,
    /// Last sequence received (frees acknowledged messages at the peer).
    pub ack_seq: u64,
    /// Initial send credits granted to the peer (our posted receive buffers).
    pub credit: u32,
}

impl PrivData {
    /// Ours, for a connection from `saddr` to `daddr`.
    pub fn new(saddr: u32, daddr: u32, ack_seq: u64, credit: u32) -> PrivData {
        PrivData {
            saddr,
            daddr,
            major: VERSION.0,
            minor: VERSION.1,
            ack_seq,
            credit,
        }
    }

    /// The 32-byte big-endian layout.
    pub fn encode(&self) -> [u8; PRIV_LEN] {
        let mut b = [0u8; PRIV_LEN];
        b[0..4].copy_from_slice(&self.saddr.to_be_bytes());
        b[4..8].copy_from_slice(&self.daddr.to_be_bytes());
        b[8] = self.major;
        b[9] = self.minor;
        b[10..12].copy_from_slice(&MINOR_MASK.to_be_bytes());
        b[16..24].copy_from_slice(&self.ack_seq.to_be_bytes());
        b[24..28].copy_from_slice(&self.credit.to_be_bytes());
        b
    }

    /// Parses the layout; `None` when shorter than 32 bytes.
    pub fn decode(b: &[u8]) -> Option<PrivData> {
        if b.len() < PRIV_LEN {
            return None;
        }
        let u32_at = |o: usize| u32::from_be_bytes(b[o..o + 4].try_into().expect("4"));
        Some(PrivData {
            saddr: u32_at(0),
            daddr: u32_at(4),
            major: b[8],
            minor: b[9],
            ack_seq: u64::from_be_bytes(b[16..24].try_into().expect("8")),
            credit: u32_at(24),
        })
    }

    /// True when we speak the version the peer proposed (exactly 3.1; spec §12).
    pub fn compatible(&self) -> bool {
        (self.major, self.minor) == VERSION
    }
}

/// Fragments for a message payload of `len` bytes: max(1, ceil(len / 4096)).
pub fn fragments(len: usize) -> usize {
    len.div_ceil(FRAG).max(1)
}

/// The fields of a received fragment header the link checks and uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FragHdr {
    pub seq: u64,
    pub ack: u64,
    pub len: u32,
    pub sport: u16,
    pub dport: u16,
    pub credit: u8,
}

impl FragHdr {
    /// Reads a fragment header (no checksum check: the engine checks the first fragment's).
    pub fn parse(b: &[u8]) -> Option<FragHdr> {
        if b.len() < HDR {
            return None;
        }
        let h = HeaderPacket::new_unchecked(&b[..HDR]);
        Some(FragHdr {
            seq: h.sequence(),
            ack: h.ack(),
            len: h.len(),
            sport: h.sport(),
            dport: h.dport(),
            credit: h.credit(),
        })
    }

    /// An ACK-only frame: ports 0/0, no payload, sequence 0 (spec §12).
    pub fn is_ack_only(&self) -> bool {
        self.sport == 0 && self.dport == 0 && self.len == 0 && self.seq == 0
    }

    /// The same message as `first` (the four fields every fragment repeats).
    pub fn same_message(&self, first: &FragHdr) -> bool {
        (self.seq, self.len, self.sport, self.dport)
            == (first.seq, first.len, first.sport, first.dport)
    }
}

/// Frames sent between two that ask for an ack (`max_unacked_packets`, spec §7).
pub const MAX_UNACKED: u32 = 8;

/// Stamps `h_ack` and `h_credit` into a fragment header, sets `RDS_FLAG_ACK_REQUIRED` when
/// asked, and refreshes the checksum.
pub fn stamp(hdr: &mut [u8], ack: u64, credit: u8, ack_required: bool) {
    let mut h = HeaderPacket::new_unchecked(&mut hdr[..HDR]);
    h.set_ack(ack);
    h.set_credit(credit);
    if ack_required {
        let f = h.flags();
        h.set_flags(f | flags::ACK_REQUIRED);
    }
    h.fill_checksum();
}

/// True for a congestion map (its flags must stay exactly 0x01 on the wire).
pub fn is_cong_map(hdr: &[u8]) -> bool {
    flags::is_cong_bitmap(HeaderPacket::new_unchecked(&hdr[..HDR]).flags())
}

/// An ACK-only header.
pub fn ack_only(hdr: &mut [u8], ack: u64, credit: u8) {
    hdr[..HDR].fill(0);
    stamp(hdr, ack, credit, false);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_data_has_the_kernels_v4_layout() {
        let p = PrivData::new(0x0a00_0001, 0x0a00_0002, 0x0102_0304_0506_0708, 64);
        let b = p.encode();
        assert_eq!(b.len(), 32);
        assert_eq!(&b[0..4], &[10, 0, 0, 1]);
        assert_eq!(&b[4..8], &[10, 0, 0, 2]);
        assert_eq!((b[8], b[9]), (3, 1));
        assert_eq!(&b[10..12], &[0, 3]);
        assert_eq!(&b[12..16], &[0; 4]);
        assert_eq!(&b[16..24], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&b[24..28], &[0, 0, 0, 64]);
        assert_eq!(&b[28..32], &[0; 4]);
        assert_eq!(PrivData::decode(&b), Some(p));
        assert!(p.compatible());
        assert!(PrivData::decode(&b[..31]).is_none());
        let mut v4 = b;
        v4[8] = 4;
        assert!(!PrivData::decode(&v4).unwrap().compatible());
    }

    #[test]
    fn fragment_counts() {
        assert_eq!(fragments(0), 1);
        assert_eq!(fragments(1), 1);
        assert_eq!(fragments(4096), 1);
        assert_eq!(fragments(4097), 2);
        assert_eq!(fragments(65536), 16);
        assert_eq!(fragments(1 << 20), 256);
    }

    #[test]
    fn ack_only_frames_are_recognised_and_checksummed() {
        let mut h = [0xffu8; HDR];
        ack_only(&mut h, 77, 9);
        let f = FragHdr::parse(&h).unwrap();
        assert!(f.is_ack_only());
        assert_eq!((f.ack, f.credit), (77, 9));
        assert!(HeaderPacket::new_unchecked(&h[..]).verify_checksum());
    }

    #[test]
    fn ack_required_is_stamped_with_a_valid_checksum() {
        let mut h = [0u8; HDR];
        ack_only(&mut h, 1, 0);
        HeaderPacket::new_unchecked(&mut h[..]).set_flags(flags::RETRANSMITTED);
        stamp(&mut h, 5, 3, true);
        let p = HeaderPacket::new_unchecked(&h[..]);
        assert_eq!(p.flags(), flags::RETRANSMITTED | flags::ACK_REQUIRED);
        assert!(p.verify_checksum());
        stamp(&mut h, 6, 0, false);
        assert_eq!(
            HeaderPacket::new_unchecked(&h[..]).flags(),
            flags::RETRANSMITTED | flags::ACK_REQUIRED,
            "never cleared: a frame keeps what its first post asked"
        );
        let mut m = [0u8; HDR];
        HeaderPacket::new_unchecked(&mut m[..]).set_flags(flags::CONG_BITMAP);
        assert!(is_cong_map(&m));
        assert!(!is_cong_map(&h));
    }
}
