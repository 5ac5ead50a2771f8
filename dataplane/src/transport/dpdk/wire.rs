//! TCP counters inferred from the frames the device sends and receives.
//!
//! smoltcp keeps its retransmission, reordering and window state private, so the device
//! reads the TCP headers going by: per flow the highest sequence sent and received, the last
//! acknowledgement received and a duplicate-ACK count. A fixed table (no allocation); a flow
//! that loses its slot to another starts over, which can miss an event, never invent one that
//! did not happen on the wire. Keep-alive probes (one already-acknowledged byte) are not
//! counted as retransmissions or duplicates.

/// Flow slots (one per path, with room to spare: 8 paths x 64 peers would collide rarely).
const SLOTS: usize = 256;

/// What the wire showed.
#[derive(Clone, Copy, Debug, Default)]
pub struct TcpCounters {
    /// Data segments we sent again (sequence below the highest already sent).
    pub retransmits: u64,
    /// Of those, sent after three duplicate ACKs (fast retransmit).
    pub fast_retransmits: u64,
    /// Of those, sent without three duplicate ACKs: retransmission timeouts.
    pub rto_retransmits: u64,
    /// Data segments received beyond a gap (an earlier one lost or reordered).
    pub rx_out_of_order: u64,
    /// Data segments received that we had already received (the peer resent them).
    pub rx_duplicates: u64,
    /// Segments from the peer with a zero window (our sending stalls).
    pub zero_window_rx: u64,
    /// Segments we sent with a zero window (the peer's sending stalls).
    pub zero_window_tx: u64,
}

#[derive(Clone, Copy, Default)]
struct Flow {
    key: u64,
    used: bool,
    snd_max: u32,
    rcv_max: u32,
    rcv_seen: bool,
    last_ack: u32,
    dupacks: u32,
}

/// The flow table.
pub struct Flows {
    slots: Box<[Flow; SLOTS]>,
    c: TcpCounters,
}

impl Default for Flows {
    fn default() -> Flows {
        Flows {
            slots: Box::new([Flow::default(); SLOTS]),
            c: TcpCounters::default(),
        }
    }
}

/// The TCP header fields of an Ethernet/IPv4 frame.
struct Seg {
    /// (peer address, our port, peer port) packed.
    key: u64,
    seq: u32,
    ack: u32,
    len: u32,
    syn: bool,
    has_ack: bool,
    rst: bool,
    window: u16,
}

// Inlined: called a dozen times per frame on the poll core (callgrind showed `be32` alone at
// ~200 instructions per round trip as a call).
#[inline(always)]
fn be16(b: &[u8], i: usize) -> u16 {
    u16::from_be_bytes([b[i], b[i + 1]])
}

#[inline(always)]
fn be32(b: &[u8], i: usize) -> u32 {
    u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn lt(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

/// Parses a TCP segment; `outbound` picks which end is ours.
fn parse(f: &[u8], outbound: bool) -> Option<Seg> {
    if f.len() < 14 + 20 || be16(f, 12) != 0x0800 {
        return None;
    }
    let ip = &f[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    if ip[0] >> 4 != 4 || ihl < 20 || ip[9] != 6 || be16(ip, 6) & 0x3fff != 0 {
        return None; // not IPv4/TCP, or a fragment
    }
    let total = usize::from(be16(ip, 2)).min(ip.len());
    if total < ihl + 20 {
        return None;
    }
    let t = &ip[ihl..total];
    let doff = usize::from(t[12] >> 4) * 4;
    if doff < 20 || doff > t.len() {
        return None;
    }
    let (sport, dport) = (be16(t, 0), be16(t, 2));
    let (peer, ours, theirs) = if outbound {
        (be32(ip, 16), sport, dport)
    } else {
        (be32(ip, 12), dport, sport)
    };
    let flags = t[13];
    Some(Seg {
        key: (u64::from(peer) << 32) | (u64::from(ours) << 16) | u64::from(theirs),
        seq: be32(t, 4),
        ack: be32(t, 8),
        len: (t.len() - doff) as u32,
        syn: flags & 0x02 != 0,
        has_ack: flags & 0x10 != 0,
        rst: flags & 0x04 != 0,
        window: be16(t, 14),
    })
}

impl Flows {
    /// The counters so far.
    pub fn counters(&self) -> TcpCounters {
        self.c
    }

    /// The flow's slot (a new one replaces whatever held the slot).
    fn slot(slots: &mut [Flow; SLOTS], key: u64, create: bool) -> Option<&mut Flow> {
        let h = (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as usize % SLOTS;
        let i = (0..4)
            .map(|k| (h + k) % SLOTS)
            .find(|&i| slots[i].used && slots[i].key == key);
        match i {
            Some(i) => Some(&mut slots[i]),
            None if create => {
                let i = (0..4)
                    .map(|k| (h + k) % SLOTS)
                    .find(|&i| !slots[i].used)
                    .unwrap_or(h);
                slots[i] = Flow {
                    key,
                    used: true,
                    ..Flow::default()
                };
                Some(&mut slots[i])
            }
            None => None,
        }
    }

    /// A frame we send.
    pub fn sent(&mut self, frame: &[u8]) {
        let Some(s) = parse(frame, true) else { return };
        if s.has_ack && s.window == 0 && !s.rst {
            self.c.zero_window_tx += 1;
        }
        let Some(fl) = Self::slot(&mut self.slots, s.key, s.syn) else {
            return;
        };
        if s.rst {
            fl.used = false;
            return;
        }
        if s.syn {
            *fl = Flow {
                key: s.key,
                used: true,
                snd_max: s.seq.wrapping_add(1),
                ..Flow::default()
            };
            return;
        }
        if s.len == 0 {
            return;
        }
        let end = s.seq.wrapping_add(s.len);
        if s.len == 1 && end == fl.snd_max {
            return; // a keep-alive probe (one old byte), not a retransmission
        }
        if lt(s.seq, fl.snd_max) {
            let fast = fl.dupacks >= 3;
            self.c.retransmits += 1;
            if fast {
                self.c.fast_retransmits += 1;
            } else {
                self.c.rto_retransmits += 1;
            }
        }
        if lt(fl.snd_max, end) {
            fl.snd_max = end;
        }
    }

    /// A frame we receive.
    pub fn received(&mut self, frame: &[u8]) {
        let Some(s) = parse(frame, false) else { return };
        if s.has_ack && s.window == 0 && !s.rst && !s.syn {
            self.c.zero_window_rx += 1;
        }
        let Some(fl) = Self::slot(&mut self.slots, s.key, s.syn) else {
            return;
        };
        if s.rst {
            fl.used = false;
            return;
        }
        if s.syn {
            fl.rcv_max = s.seq.wrapping_add(1);
            fl.rcv_seen = true;
            return;
        }
        if s.has_ack {
            if s.ack == fl.last_ack && s.len == 0 && lt(s.ack, fl.snd_max) {
                fl.dupacks += 1;
            } else if lt(fl.last_ack, s.ack) || fl.dupacks == 0 {
                fl.last_ack = s.ack;
                fl.dupacks = 0;
            }
        }
        if s.len == 0 {
            return;
        }
        let end = s.seq.wrapping_add(s.len);
        if !fl.rcv_seen {
            fl.rcv_seen = true;
            fl.rcv_max = end;
            return;
        }
        if s.len == 1 && end == fl.rcv_max {
            return; // the peer's keep-alive probe
        }
        if lt(fl.rcv_max, s.seq) {
            self.c.rx_out_of_order += 1;
        } else if !lt(fl.rcv_max, end) {
            self.c.rx_duplicates += 1;
        }
        if lt(fl.rcv_max, end) {
            fl.rcv_max = end;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An Ethernet/IPv4/TCP frame from `src:sp` to `dst:dp`.
    #[allow(clippy::too_many_arguments)] // a test helper spelling out every header field
    fn frame(
        src: u32,
        dst: u32,
        sp: u16,
        dp: u16,
        seq: u32,
        ack: u32,
        flags: u8,
        len: usize,
    ) -> Vec<u8> {
        let mut f = vec![0u8; 14 + 20 + 20 + len];
        f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        let ip = &mut f[14..];
        ip[0] = 0x45;
        ip[2..4].copy_from_slice(&((40 + len) as u16).to_be_bytes());
        ip[9] = 6;
        ip[12..16].copy_from_slice(&src.to_be_bytes());
        ip[16..20].copy_from_slice(&dst.to_be_bytes());
        let t = &mut ip[20..];
        t[0..2].copy_from_slice(&sp.to_be_bytes());
        t[2..4].copy_from_slice(&dp.to_be_bytes());
        t[4..8].copy_from_slice(&seq.to_be_bytes());
        t[8..12].copy_from_slice(&ack.to_be_bytes());
        t[12] = 5 << 4;
        t[13] = flags;
        t[14..16].copy_from_slice(&1000u16.to_be_bytes());
        f
    }

    const SYN: u8 = 0x02;
    const ACK: u8 = 0x10;

    #[test]
    fn retransmits_reordering_and_duplicates_are_counted() {
        let (a, b) = (0x0a00_0001, 0x0a00_0002);
        let mut fl = Flows::default();
        fl.sent(&frame(a, b, 50000, 16385, 100, 0, SYN, 0));
        fl.received(&frame(b, a, 16385, 50000, 900, 101, SYN | ACK, 0));
        // 3 segments of 100 bytes; the first resent after a timeout.
        for i in 0..3 {
            fl.sent(&frame(a, b, 50000, 16385, 101 + 100 * i, 901, ACK, 100));
        }
        fl.sent(&frame(a, b, 50000, 16385, 101, 901, ACK, 100));
        assert_eq!((fl.c.retransmits, fl.c.rto_retransmits), (1, 1));
        // Three duplicate ACKs, then a resend: fast.
        for _ in 0..4 {
            fl.received(&frame(b, a, 16385, 50000, 901, 201, ACK, 0));
        }
        fl.sent(&frame(a, b, 50000, 16385, 201, 901, ACK, 100));
        assert_eq!((fl.c.retransmits, fl.c.fast_retransmits), (2, 1));
        // Receive: in order, then a gap, then a duplicate.
        fl.received(&frame(b, a, 16385, 50000, 901, 301, ACK, 50));
        fl.received(&frame(b, a, 16385, 50000, 1001, 301, ACK, 50));
        assert_eq!(fl.c.rx_out_of_order, 1);
        fl.received(&frame(b, a, 16385, 50000, 901, 301, ACK, 50));
        assert_eq!(fl.c.rx_duplicates, 1);
        let mut z = frame(b, a, 16385, 50000, 1051, 301, ACK, 0);
        z[14 + 20 + 14..14 + 20 + 16].copy_from_slice(&[0, 0]);
        fl.received(&z);
        assert_eq!(fl.c.zero_window_rx, 1);
        // A keep-alive probe (the last byte again) is neither a retransmit nor a duplicate.
        fl.sent(&frame(a, b, 50000, 16385, 400, 1051, ACK, 1));
        assert_eq!(fl.c.retransmits, 2);
        fl.received(&frame(b, a, 16385, 50000, 1050, 401, ACK, 1));
        assert_eq!(fl.c.rx_duplicates, 1);
        // Not TCP: ignored.
        fl.received(&[0u8; 60]);
    }
}
