//! Extension headers in the 16-byte `h_exthdr` area (spec §5).
//!
//! Records are `[type:u8][payload]` with no length byte; the type implies the length. The reader
//! reproduces the kernel's quirks exactly: it stops at type 0 or any type >= 16, stops when a
//! record would run past byte 16, and treats an *unknown* type below 16 as zero-length (the next
//! byte is read as a new type).

use super::Error;

/// Size of the extension area.
pub const EXT_SPACE: usize = 16;

/// Extension type codes must be below this (`__RDS_EXTHDR_MAX`).
pub const EXT_TYPE_MAX: u8 = 16;

/// Extension type codes.
pub mod ext_type {
    /// Terminator.
    pub const NONE: u8 = 0;
    /// u32 protocol version (parsed, ignored; not sent by mainline).
    pub const VERSION: u8 = 1;
    /// u32 R_Key of a use-once MR (IB).
    pub const RDMA: u8 = 2;
    /// u32 R_Key + u32 offset (IB).
    pub const RDMA_DEST: u8 = 3;
    /// u32 byte count + u8 direction + 3 pad (recent IB).
    pub const RDMA_BYTES: u8 = 4;
    /// u16 number of paths offered (mprds probe).
    pub const NPATHS: u8 = 5;
    /// u32 sender generation number (mprds probe).
    pub const GEN_NUM: u8 = 6;
    /// u8 (always 0): "my TCP source port encodes the path index".
    pub const SPORT_IDX: u8 = 8;
}

/// Payload length implied by a type code, as in mainline's table; 0 for unknown types.
pub const fn ext_payload_len(ty: u8) -> usize {
    match ty {
        ext_type::VERSION | ext_type::RDMA | ext_type::GEN_NUM => 4,
        ext_type::RDMA_DEST | ext_type::RDMA_BYTES => 8,
        ext_type::NPATHS => 2,
        ext_type::SPORT_IDX => 1,
        _ => 0,
    }
}

const fn is_known(ty: u8) -> bool {
    matches!(
        ty,
        ext_type::VERSION
            | ext_type::RDMA
            | ext_type::RDMA_DEST
            | ext_type::RDMA_BYTES
            | ext_type::NPATHS
            | ext_type::GEN_NUM
            | ext_type::SPORT_IDX
    )
}

/// One parsed extension record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtHeader {
    /// `RDS_EXTHDR_VERSION`.
    Version(u32),
    /// `RDS_EXTHDR_RDMA`.
    Rdma {
        /// Remote key.
        rkey: u32,
    },
    /// `RDS_EXTHDR_RDMA_DEST`.
    RdmaDest {
        /// Remote key.
        rkey: u32,
        /// Offset in the MR.
        offset: u32,
    },
    /// `RDS_EXTHDR_RDMA_BYTES`; the three pad bytes are written as zero and ignored.
    RdmaBytes {
        /// Byte count.
        bytes: u32,
        /// 1 = write, 2 = read.
        direction: u8,
    },
    /// `RDS_EXTHDR_NPATHS`.
    NPaths(u16),
    /// `RDS_EXTHDR_GEN_NUM`.
    GenNum(u32),
    /// `RDS_EXTHDR_SPORT_IDX` (payload always 0).
    SportIdx(u8),
    /// A type below 16 this implementation has no length for; read as zero-length.
    Unknown(u8),
}

impl ExtHeader {
    /// The type code.
    pub const fn type_code(&self) -> u8 {
        match self {
            ExtHeader::Version(_) => ext_type::VERSION,
            ExtHeader::Rdma { .. } => ext_type::RDMA,
            ExtHeader::RdmaDest { .. } => ext_type::RDMA_DEST,
            ExtHeader::RdmaBytes { .. } => ext_type::RDMA_BYTES,
            ExtHeader::NPaths(_) => ext_type::NPATHS,
            ExtHeader::GenNum(_) => ext_type::GEN_NUM,
            ExtHeader::SportIdx(_) => ext_type::SPORT_IDX,
            ExtHeader::Unknown(t) => *t,
        }
    }

    /// Bytes the record occupies (type byte included).
    pub const fn record_len(&self) -> usize {
        1 + ext_payload_len(self.type_code())
    }

    fn parse(ty: u8, p: &[u8]) -> ExtHeader {
        let u32_at = |i: usize| u32::from_be_bytes([p[i], p[i + 1], p[i + 2], p[i + 3]]);
        match ty {
            ext_type::VERSION => ExtHeader::Version(u32_at(0)),
            ext_type::RDMA => ExtHeader::Rdma { rkey: u32_at(0) },
            ext_type::RDMA_DEST => ExtHeader::RdmaDest {
                rkey: u32_at(0),
                offset: u32_at(4),
            },
            ext_type::RDMA_BYTES => ExtHeader::RdmaBytes {
                bytes: u32_at(0),
                direction: p[4],
            },
            ext_type::NPATHS => ExtHeader::NPaths(u16::from_be_bytes([p[0], p[1]])),
            ext_type::GEN_NUM => ExtHeader::GenNum(u32_at(0)),
            ext_type::SPORT_IDX => ExtHeader::SportIdx(p[0]),
            other => ExtHeader::Unknown(other),
        }
    }

    fn write_payload(&self, out: &mut [u8]) {
        match *self {
            ExtHeader::Version(v) | ExtHeader::Rdma { rkey: v } | ExtHeader::GenNum(v) => {
                out[..4].copy_from_slice(&v.to_be_bytes())
            }
            ExtHeader::RdmaDest { rkey, offset } => {
                out[..4].copy_from_slice(&rkey.to_be_bytes());
                out[4..8].copy_from_slice(&offset.to_be_bytes());
            }
            ExtHeader::RdmaBytes { bytes, direction } => {
                out[..4].copy_from_slice(&bytes.to_be_bytes());
                out[4] = direction;
                out[5..8].fill(0);
            }
            ExtHeader::NPaths(n) => out[..2].copy_from_slice(&n.to_be_bytes()),
            ExtHeader::SportIdx(v) => out[0] = v,
            ExtHeader::Unknown(_) => {}
        }
    }
}

/// The 16-byte extension area, kept as raw bytes so that parse/emit is lossless.
#[derive(Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct ExtHeaders {
    bytes: [u8; EXT_SPACE],
}

impl core::fmt::Debug for ExtHeaders {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl ExtHeaders {
    /// An empty (all-zero) area.
    pub const fn new() -> Self {
        ExtHeaders {
            bytes: [0; EXT_SPACE],
        }
    }

    /// Wraps raw bytes from the wire.
    pub const fn from_bytes(bytes: [u8; EXT_SPACE]) -> Self {
        ExtHeaders { bytes }
    }

    /// The raw bytes.
    pub const fn as_bytes(&self) -> &[u8; EXT_SPACE] {
        &self.bytes
    }

    /// Iterates over the records with the kernel's reader rules.
    pub fn iter(&self) -> ExtIter<'_> {
        ExtIter {
            bytes: &self.bytes,
            pos: 0,
            stop: Stop::Running,
        }
    }

    /// First record of the given type code, if any.
    pub fn find(&self, ty: u8) -> Option<ExtHeader> {
        self.iter().find(|e| e.type_code() == ty)
    }

    /// Offset where the next record would go, or `None` if the reader would not reach the end
    /// of the list (it stops on a type >= 16 or an overrun), so nothing can be appended safely.
    fn append_offset(&self) -> Option<usize> {
        let mut it = self.iter();
        while it.next().is_some() {}
        match it.stop {
            Stop::Terminator | Stop::Running => Some(it.pos),
            Stop::Invalid => None,
        }
    }

    /// Appends a record after the existing ones (recent-kernel writer). Refuses unknown types
    /// and records that do not fit; the area stays zero-filled after the last record.
    pub fn push(&mut self, ext: ExtHeader) -> Result<(), Error> {
        let ty = ext.type_code();
        if !is_known(ty) {
            return Err(Error::ExtUnknownType(ty));
        }
        let at = self.append_offset().ok_or(Error::ExtOverflow)?;
        let end = at + ext.record_len();
        if end > EXT_SPACE {
            return Err(Error::ExtOverflow);
        }
        self.bytes[at] = ty;
        ext.write_payload(&mut self.bytes[at + 1..end]);
        Ok(())
    }

    /// Builds an area from a list of records.
    pub fn from_records(records: &[ExtHeader]) -> Result<Self, Error> {
        let mut ext = ExtHeaders::new();
        for r in records {
            ext.push(*r)?;
        }
        Ok(ext)
    }

    /// True when the area holds no record.
    pub fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// Still walking, or walked exactly to the end of the 16 bytes.
    Running,
    /// Type 0.
    Terminator,
    /// Type >= 16, or a record that would overrun the area.
    Invalid,
}

/// Iterator over the records of an [`ExtHeaders`].
#[derive(Debug, Clone)]
pub struct ExtIter<'a> {
    bytes: &'a [u8; EXT_SPACE],
    pos: usize,
    stop: Stop,
}

impl ExtIter<'_> {
    /// After iteration: true when the walk stopped on a type >= 16 or on a record that would
    /// overrun the area, rather than on a terminator or the end of the area.
    pub fn stopped_on_invalid(&self) -> bool {
        self.stop == Stop::Invalid
    }

    fn halt(&mut self, why: Stop) -> Option<ExtHeader> {
        self.stop = why;
        None
    }
}

impl Iterator for ExtIter<'_> {
    type Item = ExtHeader;

    fn next(&mut self) -> Option<ExtHeader> {
        if self.stop != Stop::Running || self.pos >= EXT_SPACE {
            return None;
        }
        let ty = self.bytes[self.pos];
        if ty == ext_type::NONE {
            return self.halt(Stop::Terminator);
        }
        if ty >= EXT_TYPE_MAX {
            return self.halt(Stop::Invalid);
        }
        let len = ext_payload_len(ty);
        let start = self.pos + 1;
        if start + len > EXT_SPACE {
            return self.halt(Stop::Invalid);
        }
        self.pos = start + len;
        Some(ExtHeader::parse(ty, &self.bytes[start..start + len]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_layout_matches_recent_kernel() {
        let ext = ExtHeaders::from_records(&[
            ExtHeader::NPaths(8),
            ExtHeader::GenNum(0xdead_beef),
            ExtHeader::SportIdx(0),
        ])
        .unwrap();
        assert_eq!(
            ext.as_bytes(),
            &[5, 0, 8, 6, 0xde, 0xad, 0xbe, 0xef, 8, 0, 0, 0, 0, 0, 0, 0]
        );
        let parsed: Vec<_> = ext.iter().collect();
        assert_eq!(
            parsed,
            vec![
                ExtHeader::NPaths(8),
                ExtHeader::GenNum(0xdead_beef),
                ExtHeader::SportIdx(0)
            ]
        );
    }

    #[test]
    fn unknown_type_below_16_is_zero_length() {
        // type 7 (UEK CAP_BITS) with a 4-byte payload: the payload bytes are read as types.
        let ext = ExtHeaders::from_bytes([7, 5, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        let parsed: Vec<_> = ext.iter().collect();
        assert_eq!(parsed, vec![ExtHeader::Unknown(7), ExtHeader::NPaths(2)]);
    }

    #[test]
    fn stops_on_large_type_and_overrun() {
        let ext = ExtHeaders::from_bytes([5, 0, 1, 16, 5, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(ext.iter().collect::<Vec<_>>(), vec![ExtHeader::NPaths(1)]);
        // RDMA_DEST (8 bytes) starting at offset 10 would end at 19 > 16.
        let mut raw = [0u8; 16];
        raw[..10].copy_from_slice(&[2, 0, 0, 0, 1, 2, 0, 0, 0, 2]);
        raw[10] = 3;
        let ext = ExtHeaders::from_bytes(raw);
        assert_eq!(
            ext.iter().collect::<Vec<_>>(),
            vec![ExtHeader::Rdma { rkey: 1 }, ExtHeader::Rdma { rkey: 2 }]
        );
        let mut copy = ext;
        assert_eq!(copy.push(ExtHeader::SportIdx(0)), Err(Error::ExtOverflow));
    }

    #[test]
    fn full_area_has_no_terminator() {
        let mut ext = ExtHeaders::new();
        ext.push(ExtHeader::RdmaDest { rkey: 1, offset: 2 })
            .unwrap(); // 9
        ext.push(ExtHeader::GenNum(3)).unwrap(); // 14
        ext.push(ExtHeader::NPaths(4)).unwrap_err();
        ext.push(ExtHeader::SportIdx(0)).unwrap(); // 16
        assert_eq!(ext.iter().count(), 3);
        assert_eq!(ext.push(ExtHeader::SportIdx(0)), Err(Error::ExtOverflow));
        assert_eq!(
            ext.push(ExtHeader::Unknown(9)),
            Err(Error::ExtUnknownType(9))
        );
    }

    #[test]
    fn rdma_bytes_zero_pads() {
        let ext = ExtHeaders::from_records(&[ExtHeader::RdmaBytes {
            bytes: 0x100,
            direction: 2,
        }])
        .unwrap();
        assert_eq!(&ext.as_bytes()[..10], &[4, 0, 0, 1, 0, 2, 0, 0, 0, 0]);
        assert_eq!(
            ext.find(ext_type::RDMA_BYTES),
            Some(ExtHeader::RdmaBytes {
                bytes: 0x100,
                direction: 2
            })
        );
    }
}
