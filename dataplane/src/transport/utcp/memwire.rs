//! An in-memory Ethernet segment for tests: a [`Hub`] with one [`Port`] (a smoltcp
//! `phy::Device`) per attached interface, and faults on the wire (loss, duplication,
//! reordering, a blackout), plus a record of how long dropped data segments took to be
//! retransmitted (the measured RTO).
//!
//! The wire keeps time (blackouts, resend delays) on the clock it is given
//! ([`Hub::with_clock`]): with a `VirtualClock` shared by the wire, the links and the
//! endpoints, a test is a replayable run with no sleep in it.
//!
//! Not for production: frames are heap vectors behind a mutex. The DPDK device replaces it.

use crate::protocol::{Clock, MonotonicClock};
use rds_proto::Instant as Time;
use smoltcp::phy::{self, Device, DeviceCapabilities, Medium};
use smoltcp::time::Instant;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Faults applied to every frame put on the wire (parts per 10 000).
#[derive(Clone, Copy, Debug, Default)]
pub struct Faults {
    /// Frames lost.
    pub drop_ppm: u32,
    /// Frames delivered twice.
    pub dup_ppm: u32,
    /// Frames held back and delivered after the next frame to the same port.
    pub reorder_ppm: u32,
}

#[derive(Default)]
struct PortQ {
    frames: VecDeque<Vec<u8>>,
    /// A frame held back for reordering.
    held: Option<Vec<u8>>,
}

/// (source IPv4, source port, sequence number) of a dropped data segment.
type SegKey = (u32, u16, u32);

#[derive(Default)]
struct HubInner {
    ports: HashMap<u64, PortQ>,
    next_id: u64,
    faults: Faults,
    rng: u64,
    blackout_until: Option<Time>,
    drop_next: u32,
    dropped_data: HashMap<SegKey, Time>,
    retransmit_delays: Vec<Duration>,
    frames: u64,
    dropped: u64,
    duplicated: u64,
    reordered: u64,
    largest_frame: usize,
    data_segments: u64,
    timestamped_data_segments: u64,
    pure_acks: u64,
    mtu: Option<usize>,
}

impl HubInner {
    fn roll(&mut self, ppm: u32) -> bool {
        if ppm == 0 {
            return false;
        }
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (r >> 32) % 10_000 < u64::from(ppm)
    }

    fn put(&mut self, from: u64, frame: &[u8], now: Time) {
        self.frames += 1;
        self.largest_frame = self.largest_frame.max(frame.len());
        let seg = data_segment(frame);
        if seg.is_some() {
            self.data_segments += 1;
            if has_timestamp(frame) {
                self.timestamped_data_segments += 1;
            }
        } else if is_pure_ack(frame) {
            self.pure_acks += 1;
        }
        if let Some(k) = seg {
            if let Some(t) = self.dropped_data.remove(&k) {
                self.retransmit_delays
                    .push(now.saturating_duration_since(t));
            }
        }
        let blackout = self.blackout_until.is_some_and(|t| now < t);
        let targeted = self.drop_next > 0 && seg.is_some();
        if targeted {
            self.drop_next -= 1;
        }
        if blackout || targeted || self.roll(self.faults.drop_ppm) {
            self.dropped += 1;
            if let Some(k) = seg {
                self.dropped_data.entry(k).or_insert(now);
            }
            return;
        }
        let copies = if self.roll(self.faults.dup_ppm) {
            self.duplicated += 1;
            2
        } else {
            1
        };
        let reorder = self.roll(self.faults.reorder_ppm);
        if reorder {
            self.reordered += 1;
        }
        for (_, q) in self.ports.iter_mut().filter(|(&id, _)| id != from) {
            for _ in 0..copies {
                if reorder && q.held.is_none() {
                    q.held = Some(frame.to_vec());
                    continue;
                }
                q.frames.push_back(frame.to_vec());
                if let Some(h) = q.held.take() {
                    q.frames.push_back(h);
                }
            }
        }
    }
}

/// The TCP data segment in an Ethernet/IPv4 frame, if it carries payload.
fn data_segment(f: &[u8]) -> Option<SegKey> {
    if f.len() < 14 + 20 + 20 || f[12..14] != [0x08, 0x00] {
        return None;
    }
    let ip = &f[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    if ip[9] != 6 || ip.len() < ihl + 20 {
        return None;
    }
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let tcp = &ip[ihl..];
    let doff = usize::from(tcp[12] >> 4) * 4;
    if total <= ihl + doff {
        return None;
    }
    let src = u32::from_be_bytes([ip[12], ip[13], ip[14], ip[15]]);
    let sport = u16::from_be_bytes([tcp[0], tcp[1]]);
    let seq = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
    Some((src, sport, seq))
}

/// Whether an Ethernet/IPv4 frame is a TCP segment with only the ACK flag and no payload.
fn is_pure_ack(f: &[u8]) -> bool {
    if f.len() < 14 + 20 + 20 || f[12..14] != [0x08, 0x00] {
        return false;
    }
    let ip = &f[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    if ip[9] != 6 || ip.len() < ihl + 20 {
        return false;
    }
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let tcp = &ip[ihl..];
    // ACK only (PSH, URG, ECE, CWR ignored); no SYN, FIN or RST.
    total == ihl + usize::from(tcp[12] >> 4) * 4 && tcp[13] & 0x17 == 0x10
}

/// Whether a TCP segment in an Ethernet/IPv4 frame (already checked by [`data_segment`])
/// carries the timestamp option (kind 8).
fn has_timestamp(f: &[u8]) -> bool {
    let ip = &f[14..];
    let tcp = &ip[usize::from(ip[0] & 0x0f) * 4..];
    let opts = &tcp[20..(usize::from(tcp[12] >> 4) * 4).min(tcp.len())];
    let mut i = 0;
    while i < opts.len() {
        match opts[i] {
            0 => return false,
            1 => i += 1,
            8 => return true,
            _ => i += usize::from(opts.get(i + 1).copied().unwrap_or(0)).max(2),
        }
    }
    false
}

/// One Ethernet segment shared by every [`Port`] attached to it.
#[derive(Clone)]
pub struct Hub {
    inner: Arc<Mutex<HubInner>>,
    clock: Arc<dyn Clock + Sync>,
}

impl Default for Hub {
    fn default() -> Hub {
        Hub::with_clock(MonotonicClock::new())
    }
}

/// The IP MTU a [`Port`] reports unless [`Hub::set_mtu`] says otherwise.
pub const DEFAULT_MTU: usize = 1500;

/// What the wire did, for reports.
#[derive(Clone, Debug, Default)]
pub struct WireStats {
    /// Frames put on the wire.
    pub frames: u64,
    /// Frames lost (faults and blackouts).
    pub dropped: u64,
    /// Frames duplicated.
    pub duplicated: u64,
    /// Frames reordered.
    pub reordered: u64,
    /// For each dropped data segment that was sent again: how long that took.
    pub retransmit_delays: Vec<Duration>,
    /// Longest frame put on the wire (Ethernet header included).
    pub largest_frame: usize,
    /// TCP segments with payload put on the wire.
    pub data_segments: u64,
    /// Of those, segments carrying the timestamp option.
    pub timestamped_data_segments: u64,
    /// TCP segments that only acknowledge (no payload, no SYN/FIN/RST).
    pub pure_acks: u64,
}

impl Hub {
    /// A clean wire on the monotonic clock.
    pub fn new() -> Hub {
        Hub::default()
    }

    /// A clean wire whose blackouts and resend delays are timed by `clock`.
    pub fn with_clock(clock: impl Clock + Sync + 'static) -> Hub {
        Hub {
            inner: Arc::default(),
            clock: Arc::new(clock),
        }
    }

    /// Sets the faults (and the seed of their random numbers).
    pub fn set_faults(&self, faults: Faults, seed: u64) {
        let mut h = self.inner.lock().unwrap();
        h.faults = faults;
        h.rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    }

    /// The IP MTU of ports attached from now on (9000: jumbo frames).
    pub fn set_mtu(&self, mtu: usize) {
        self.inner.lock().unwrap().mtu = Some(mtu);
    }

    /// Drops every frame for `d` from now.
    pub fn blackout(&self, d: Duration) {
        let until = self.clock.now() + d;
        self.inner.lock().unwrap().blackout_until = Some(until);
    }

    /// Drops the next `n` TCP data segments (whichever way they go).
    pub fn drop_next_data(&self, n: u32) {
        self.inner.lock().unwrap().drop_next = n;
    }

    /// Attaches a new interface.
    pub fn port(&self) -> Port {
        let mut h = self.inner.lock().unwrap();
        h.next_id += 1;
        let id = h.next_id;
        h.ports.insert(id, PortQ::default());
        Port {
            hub: self.clone(),
            id,
            mtu: h.mtu.unwrap_or(DEFAULT_MTU),
        }
    }

    /// What the wire did so far.
    pub fn stats(&self) -> WireStats {
        let h = self.inner.lock().unwrap();
        WireStats {
            frames: h.frames,
            dropped: h.dropped,
            duplicated: h.duplicated,
            reordered: h.reordered,
            retransmit_delays: h.retransmit_delays.clone(),
            largest_frame: h.largest_frame,
            data_segments: h.data_segments,
            timestamped_data_segments: h.timestamped_data_segments,
            pure_acks: h.pure_acks,
        }
    }
}

/// One interface's attachment to a [`Hub`]; detached when dropped.
pub struct Port {
    hub: Hub,
    id: u64,
    mtu: usize,
}

impl Drop for Port {
    fn drop(&mut self) {
        self.hub.inner.lock().unwrap().ports.remove(&self.id);
    }
}

/// A received frame.
pub struct RxToken(Vec<u8>);

/// Room for a frame to send.
pub struct TxToken<'a>(&'a Port);

impl phy::RxToken for RxToken {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        f(&self.0)
    }
}

impl phy::TxToken for TxToken<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let mut buf = vec![0u8; len];
        let r = f(&mut buf);
        let hub = &self.0.hub;
        let now = hub.clock.now();
        hub.inner.lock().unwrap().put(self.0.id, &buf, now);
        r
    }
}

/// Frames go onto the hub as they are sent.
impl super::Flush for Port {}

impl Device for Port {
    type RxToken<'a> = RxToken;
    type TxToken<'a> = TxToken<'a>;

    fn receive(&mut self, _now: Instant) -> Option<(RxToken, TxToken<'_>)> {
        let frame = {
            let mut h = self.hub.inner.lock().unwrap();
            let q = h.ports.get_mut(&self.id)?;
            match q.frames.pop_front() {
                Some(f) => f,
                // A held-back frame goes out once nothing else overtakes it.
                None => q.held.take()?,
            }
        };
        Some((RxToken(frame), TxToken(self)))
    }

    fn transmit(&mut self, _now: Instant) -> Option<TxToken<'_>> {
        Some(TxToken(self))
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut c = DeviceCapabilities::default();
        c.medium = Medium::Ethernet;
        c.max_transmission_unit = self.mtu + 14;
        c.max_burst_size = Some(32);
        c
    }
}
