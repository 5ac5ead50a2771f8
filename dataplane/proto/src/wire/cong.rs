//! Congestion maps (spec §8): one bit per RDS port, 8192 bytes, port P is byte `P >> 3`,
//! bit `P & 7` (least-significant bit first).

use super::Error;

/// Size of a congestion map on the wire (`RDS_CONG_MAP_BYTES`).
pub const CONG_MAP_BYTES: usize = 65536 / 8;

/// A 65536-bit congestion bitmap. A set bit means "the socket bound to this port is congested".
#[derive(PartialEq, Eq)]
pub struct CongMap {
    bits: Box<[u8; CONG_MAP_BYTES]>,
}

impl Clone for CongMap {
    fn clone(&self) -> Self {
        let mut map = CongMap::new();
        map.clone_from(self);
        map
    }

    /// Copies in place, without allocating.
    fn clone_from(&mut self, source: &Self) {
        self.bits.copy_from_slice(&source.bits[..]);
    }
}

impl core::fmt::Debug for CongMap {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let set = self.bits.iter().map(|b| b.count_ones()).sum::<u32>();
        write!(f, "CongMap({set} ports congested)")
    }
}

impl Default for CongMap {
    fn default() -> Self {
        Self::new()
    }
}

const fn locate(port: u16) -> (usize, u8) {
    ((port >> 3) as usize, 1 << (port & 7))
}

impl CongMap {
    /// A map with no port congested.
    pub fn new() -> Self {
        // Built on the heap directly; no 8 KiB stack temporary.
        let bits: Box<[u8; CONG_MAP_BYTES]> = vec![0u8; CONG_MAP_BYTES]
            .into_boxed_slice()
            .try_into()
            .unwrap_or_else(|_| unreachable!("vec has CONG_MAP_BYTES elements"));
        CongMap { bits }
    }

    /// Builds a map from wire bytes; they must be exactly [`CONG_MAP_BYTES`] long.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, Error> {
        let mut map = CongMap::new();
        map.copy_from(bytes)?;
        Ok(map)
    }

    /// The wire bytes.
    pub fn as_bytes(&self) -> &[u8; CONG_MAP_BYTES] {
        &self.bits
    }

    /// Replaces the contents with wire bytes (exactly [`CONG_MAP_BYTES`] long).
    pub fn copy_from(&mut self, bytes: &[u8]) -> Result<(), Error> {
        if bytes.len() != CONG_MAP_BYTES {
            return Err(Error::BadCongMapLen(bytes.len()));
        }
        self.bits.copy_from_slice(bytes);
        Ok(())
    }

    /// Marks a port congested.
    pub fn set(&mut self, port: u16) {
        let (byte, bit) = locate(port);
        self.bits[byte] |= bit;
    }

    /// Marks a port uncongested.
    pub fn clear(&mut self, port: u16) {
        let (byte, bit) = locate(port);
        self.bits[byte] &= !bit;
    }

    /// Sets or clears a port; returns true if the bit changed.
    pub fn set_congested(&mut self, port: u16, congested: bool) -> bool {
        let before = self.test(port);
        if congested {
            self.set(port);
        } else {
            self.clear(port);
        }
        before != congested
    }

    /// Whether a port is congested.
    pub fn test(&self, port: u16) -> bool {
        let (byte, bit) = locate(port);
        self.bits[byte] & bit != 0
    }

    /// True when no port is congested.
    pub fn is_clear(&self) -> bool {
        self.bits.iter().all(|&b| b == 0)
    }

    /// Replaces the map with `new` (exactly [`CONG_MAP_BYTES`] long) and returns the
    /// [`uncongested_mask`] of the change.
    pub fn update(&mut self, new: &[u8]) -> Result<u64, Error> {
        if new.len() != CONG_MAP_BYTES {
            return Err(Error::BadCongMapLen(new.len()));
        }
        let mask = uncongested_mask(&self.bits[..], new);
        self.bits.copy_from_slice(new);
        Ok(mask)
    }
}

/// The "ports that went from congested to uncongested" mask of an update, as RDS/IB computes
/// it: for each little-endian u64 word, the bits that were 1 in `old` and are 0 in `new`, OR-ed
/// together. Bit `P % 64` stands for port P (the `RDS_CONG_MONITOR_MASK` convention).
/// Bytes beyond the shorter input are ignored.
pub fn uncongested_mask(old: &[u8], new: &[u8]) -> u64 {
    old.chunks_exact(8)
        .zip(new.chunks_exact(8))
        .fold(0u64, |acc, (o, n)| {
            let o = u64::from_le_bytes(o.try_into().unwrap_or([0; 8]));
            let n = u64::from_le_bytes(n.try_into().unwrap_or([0; 8]));
            acc | (o & !n)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bit_layout() {
        let mut m = CongMap::new();
        m.set(0);
        m.set(9);
        m.set(65535);
        assert_eq!(m.as_bytes()[0], 0x01);
        assert_eq!(m.as_bytes()[1], 0x02);
        assert_eq!(m.as_bytes()[8191], 0x80);
        assert!(m.test(9) && !m.test(8));
        m.clear(9);
        assert!(!m.test(9));
        assert!(m.set_congested(100, true));
        assert!(!m.set_congested(100, true));
        assert!(m.set_congested(100, false));
    }

    #[test]
    fn mask_reports_cleared_ports_mod_64() {
        let mut m = CongMap::new();
        m.set(3);
        m.set(64 + 5);
        m.set(700);
        let mut next = m.clone();
        next.clear(64 + 5);
        next.clear(700);
        next.set(1);
        let mask = m.update(next.as_bytes()).unwrap();
        assert_eq!(mask, (1 << 5) | (1 << (700 % 64)));
        assert!(m.test(1) && m.test(3) && !m.test(700));
        assert_eq!(m.update(&[0u8; 10]), Err(Error::BadCongMapLen(10)));
    }
}
