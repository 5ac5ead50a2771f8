//! A smoltcp [`Device`] over one DPDK rx/tx queue pair.
//!
//! * Receive: one `rte_eth_rx_burst` of up to [`BURST`] mbufs per pass; each [`RxToken`] owns
//!   one mbuf and frees it when dropped (consumed or not). Multi-segment mbufs (a frame larger
//!   than the pool's data room) are freed unread and counted: the MTU fits one segment.
//! * Transmit: a [`TxToken`] takes an mbuf from the mempool, lets smoltcp write the frame into
//!   it and queues it; [`Flush::flush`] (after every `Interface::poll`) sends the pass's queue
//!   with one `rte_eth_tx_burst` (earlier if [`TX_QUEUE`] frames are waiting). Frames the
//!   driver refuses are freed and counted (`tx_drops`): TCP resends them.
//! * No allocation per packet: mbufs come from the pool's per-lcore cache (the poll thread
//!   registers itself with EAL, `rte_thread_register`, for that cache), the burst arrays are
//!   fixed. When the pool is empty a frame is written into a scratch buffer and dropped
//!   (`mbuf_alloc_failures`, `tx_drops`): smoltcp's tokens must run their closure.
//! * Bursts: at most one `rx_burst` of [`BURST`] (32) frames per pass, and `tx_burst`s of up
//!   to [`TX_QUEUE`] (32) frames: one per pass unless the pass sends more; `Interface::poll` takes the whole rx burst in before it sends, so a burst of
//!   segments draws one ACK. Counted: `dpdk_rx_bursts`/`dpdk_rx_packets`,
//!   `dpdk_tx_bursts`/`dpdk_tx_packets` (frames per burst = packets / bursts).
//! * A port that is not started (a memif client whose server's socket is not there yet) is
//!   started from the poll thread, every 25 ms backing off to 250 ms; no burst is called on it
//!   meanwhile. DPDK's memif connects a client once, at start, so a memif client whose link
//!   stays down for 300 ms (its connection refused by a server whose port was not started yet,
//!   or its server restarted) is stopped and started again.
//! * TCP counters that smoltcp does not expose are inferred from the wire
//!   ([`wire::Flows`]): retransmitted segments (split into fast retransmits, after three
//!   duplicate ACKs, and timeouts), out-of-order and duplicate segments received, and zero
//!   windows advertised by the peer (window stalls) or by us.

use super::steer::{self, Mbuf, Owner, Steering};
use super::wire::{Flows, TcpCounters};
use crate::transport::utcp::Flush;
use dpdk_sys as sys;
use smoltcp::phy::{self, Checksum, Device, DeviceCapabilities, Medium};
use smoltcp::time::Instant;
use std::sync::Arc;

/// Most frames taken from the port per pass.
pub const BURST: usize = 32;
/// Most frames queued for transmission before a burst goes out.
pub const TX_QUEUE: usize = 32;
/// First and longest wait between attempts to start a port whose peer is not there yet.
const START_RETRY_MIN_MS: u64 = 25;
const START_RETRY_MAX_MS: u64 = 250;
/// How often a reconnecting port's link status is read, and how long it may stay down.
const LINK_CHECK_MS: u64 = 50;
const RECONNECT_AFTER_MS: u64 = 300;
/// Restarts of a link that stays down before a warning says why it might (about 3 s).
const WARN_AFTER_RECONNECTS: u32 = 10;

/// The device's counters (plain integers: only the poll thread touches them; the transport
/// copies them into the daemon's stats when counters are published).
#[derive(Clone, Copy, Debug, Default)]
pub struct PortCounters {
    /// Frames received.
    pub rx_packets: u64,
    /// Non-empty receive bursts.
    pub rx_bursts: u64,
    /// Frames sent (accepted by the driver).
    pub tx_packets: u64,
    /// Transmit bursts.
    pub tx_bursts: u64,
    /// Frames that found the mempool empty.
    pub mbuf_alloc_failures: u64,
    /// Frames not sent (driver queue full, or no mbuf).
    pub tx_drops: u64,
    /// Received frames dropped unread (more than one segment).
    pub rx_drops: u64,
    /// Attempts to start a port that was not started (a memif client waiting for its server).
    pub start_attempts: u64,
    /// Restarts of a port whose link stayed down (a memif client reconnecting).
    pub reconnects: u64,
    /// TCP, inferred from the wire.
    pub tcp: TcpCounters,
    /// Frames received on this queue that another poll thread's connection owns, handed over.
    pub steered: u64,
    /// Of those, dropped (the owner's inbox was full; TCP resends).
    pub steer_drops: u64,
}

/// The transmit half (a separate field, so that a receive token and a transmit token can be
/// alive together, as smoltcp wants).
struct TxSide {
    pool: *mut sys::rte_mempool,
    queue: [*mut sys::rte_mbuf; TX_QUEUE],
    n: usize,
    scratch: Vec<u8>,
    alloc_failures: u64,
    dropped: u64,
    /// Frames the driver took, and `tx_burst` calls.
    sent: u64,
    bursts: u64,
    /// TCP as seen on the wire (both directions; here so that every burst records its frames).
    flows: Flows,
    /// Several queues: the port's gate, checked around each burst on queues other than 0.
    steer: Option<Arc<Steering>>,
}

/// One DPDK port's queue pair as a smoltcp device.
pub struct DpdkDevice {
    port: u16,
    queue: u16,
    mtu: usize,
    rx: [*mut sys::rte_mbuf; BURST],
    rx_n: usize,
    rx_pos: usize,
    /// One rx burst per pass: `Interface::poll` reads until the device says none, which on a
    /// busy port would never end.
    rx_done: bool,
    tx: TxSide,
    counters: PortCounters,
    /// False while the port waits to be started (a memif client whose server was not there
    /// yet): no bursts then (DPDK's are not callable on a stopped port).
    started: bool,
    /// When to try `rte_eth_dev_start` again, and the wait after that.
    next_start: Instant,
    start_backoff: u64,
    /// Restart the port when its link stays down ([`DpdkDevice::reconnect_when_down`]).
    reconnect: bool,
    /// smoltcp verifies received checksums ([`DpdkDevice::skip_rx_checksums`]).
    verify_rx_checksums: bool,
    /// When to read the link status next, and since when it has been down.
    next_link_check: Instant,
    down_since: Option<Instant>,
    /// Restarts since the link was last seen up (a warning names the likely causes once).
    failed_reconnects: u32,
    /// Several queue pairs ([`DpdkDevice::steer`]): the frames other threads handed over,
    /// and the port's gate.
    steer: Option<Arc<Steering>>,
    /// How many of the current rx array's frames came from the inbox (already steered).
    rx_handed: usize,
}

// SAFETY: the raw pointers are the mempool (thread-safe in DPDK) and mbufs this device owns
// exclusively; the queue pair is used by whichever single thread owns the device (it is built
// on the main thread and then moved, once, to the poll thread).
unsafe impl Send for DpdkDevice {}

impl DpdkDevice {
    /// A device on `port`'s queue `queue` (configured and started), allocating from `pool`;
    /// `mtu` is the IP MTU (1500 on Ethernet).
    ///
    /// # Safety
    /// `port`/`queue` must be a started queue pair and `pool` a valid mbuf pool, both outliving
    /// the device, and no one else may use that queue pair.
    pub unsafe fn new(port: u16, queue: u16, pool: *mut sys::rte_mempool, mtu: usize) -> Self {
        DpdkDevice {
            port,
            queue,
            mtu,
            rx: [std::ptr::null_mut(); BURST],
            rx_n: 0,
            rx_pos: 0,
            rx_done: false,
            tx: TxSide {
                pool,
                queue: [std::ptr::null_mut(); TX_QUEUE],
                n: 0,
                scratch: vec![0u8; mtu + 14],
                alloc_failures: 0,
                dropped: 0,
                sent: 0,
                bursts: 0,
                flows: Flows::default(),
                steer: None,
            },
            counters: PortCounters::default(),
            started: true,
            next_start: Instant::ZERO,
            start_backoff: START_RETRY_MIN_MS,
            reconnect: false,
            verify_rx_checksums: true,
            next_link_check: Instant::ZERO,
            down_since: None,
            failed_reconnects: 0,
            steer: None,
            rx_handed: 0,
        }
    }

    /// One of several queue pairs of the port, each driven by its own poll thread: frames
    /// that belong to another thread's connection go to it through `s`, and frames handed
    /// here are read first. On queue 0 the device starts and stops the port (and opens and
    /// closes `s`'s gate); on the others it only bursts while the gate is open.
    pub fn steer(&mut self, s: Arc<Steering>) {
        if self.queue != 0 {
            // Port-level work is queue 0's: the port's state comes through the gate.
            self.started = true;
            self.reconnect = false;
        }
        self.tx.steer = Some(s.clone());
        self.steer = Some(s);
    }

    /// Queue 0 (or the only queue): the one that may start and stop the port.
    fn owns_port(&self) -> bool {
        self.queue == 0
    }

    /// Received IPv4 and TCP checksums are not verified (memif, `[dpdk] verify_checksums`);
    /// transmitted ones are still computed. Verifying a received 64 KiB message is about
    /// 42 000 instructions (callgrind), 5 % of a 64 KiB round trip's work in each rdsd.
    pub fn skip_rx_checksums(&mut self) {
        self.verify_rx_checksums = false;
    }

    /// A memif client: DPDK's memif connects a client once, when the port starts, and never
    /// again. A connection its server refused (the server's port was not started yet) or lost
    /// (the server restarted) would leave the link down for good; so a link down for
    /// [`RECONNECT_AFTER_MS`] is stopped and started again (a new connection).
    pub fn reconnect_when_down(&mut self) {
        self.reconnect = true;
    }

    /// Reads the link status every [`LINK_CHECK_MS`] and restarts a port whose link stayed
    /// down (memif clients only, see [`DpdkDevice::reconnect_when_down`]).
    fn watch_link(&mut self, now: Instant) {
        if now < self.next_link_check {
            return;
        }
        self.next_link_check = now + smoltcp::time::Duration::from_millis(LINK_CHECK_MS);
        let mut link = sys::rte_eth_link::default();
        // SAFETY: a valid port; the out-pointer is ours. Nowait: reads the driver's state.
        let rc = unsafe { sys::rte_eth_link_get_nowait(self.port, &mut link) };
        if rc != 0 || link.link_status() == sys::RTE_ETH_LINK_UP as u16 {
            self.down_since = None;
            self.failed_reconnects = 0;
            return;
        }
        let since = *self.down_since.get_or_insert(now);
        if now - since >= smoltcp::time::Duration::from_millis(RECONNECT_AFTER_MS) {
            tracing::info!(
                port = self.port,
                "DPDK port link down: restarting it to reconnect"
            );
            self.counters.reconnects += 1;
            self.failed_reconnects += 1;
            if self.failed_reconnects == WARN_AFTER_RECONNECTS {
                tracing::warn!(
                    port = self.port,
                    "DPDK memif link still down after {WARN_AFTER_RECONNECTS} reconnects: is \
                     the server up, and do both ends name the same socket and id and set the \
                     same [dpdk] queues (part of the memif id with queues > 1)?"
                );
            }
            if let Some(s) = &self.steer {
                s.gate.close();
            }
            // SAFETY: the port is started and no thread bursts on it (the gate is closed on
            // every other queue); the mbufs we hold (unread rx, queued tx) stay ours and valid
            // across a stop.
            unsafe { sys::rte_eth_dev_stop(self.port) };
            self.started = false;
            self.down_since = None;
            self.next_start = now;
            self.start_backoff = START_RETRY_MIN_MS;
        }
    }

    /// The port is not started yet: try `rte_eth_dev_start` from the poll thread, every
    /// 25 ms at first, backing off to every 250 ms, until it succeeds.
    pub fn start_later(&mut self) {
        self.started = false;
    }

    /// Whether the port runs (false while a memif client waits for its server).
    pub fn started(&self) -> bool {
        self.started
    }

    /// Tries to start a port that is not started yet, at most every `start_backoff` ms.
    fn try_start(&mut self, now: Instant) -> bool {
        if self.started {
            return true;
        }
        if now < self.next_start {
            return false;
        }
        self.counters.start_attempts += 1;
        // SAFETY: a configured port whose queues are set up (DpdkDevice::new's contract); the
        // poll thread is the only user of the port.
        let rc = unsafe { sys::rte_eth_dev_start(self.port) };
        if rc == 0 {
            tracing::info!(
                port = self.port,
                "DPDK port started (its memif peer is there)"
            );
            self.started = true;
            if let Some(s) = &self.steer {
                s.gate.open();
            }
        } else {
            self.next_start = now + smoltcp::time::Duration::from_millis(self.start_backoff);
            self.start_backoff = (self.start_backoff * 2).min(START_RETRY_MAX_MS);
        }
        self.started
    }

    /// The counters so far.
    pub fn counters(&self) -> PortCounters {
        let mut c = self.counters;
        c.mbuf_alloc_failures = self.tx.alloc_failures;
        c.tx_drops += self.tx.dropped;
        c.tx_packets = self.tx.sent;
        c.tx_bursts = self.tx.bursts;
        c.tcp = self.tx.flows.counters();
        if let Some(s) = &self.steer {
            c.steer_drops = s.drops(usize::from(self.queue));
        }
        c
    }

    /// Fills the rx array for a pass: frames handed over by other threads first, then one
    /// burst from the queue.
    fn fill_rx(&mut self) -> usize {
        let mut n = 0;
        let q = usize::from(self.queue);
        if let Some(s) = &self.steer {
            while n < BURST {
                match s.take(q) {
                    Some(Mbuf(m)) => {
                        self.rx[n] = m;
                        n += 1;
                    }
                    None => break,
                }
            }
        }
        self.rx_handed = n;
        if n == BURST {
            return n;
        }
        let gated = !self.owns_port() && self.steer.as_ref().is_some_and(|s| !s.gate.enter(q));
        if gated {
            return n;
        }
        // SAFETY: `rx[n..]` has room for BURST - n pointers; the queue pair is ours (new()).
        let got = unsafe {
            sys::rte_eth_rx_burst(
                self.port,
                self.queue,
                self.rx.as_mut_ptr().add(n),
                (BURST - n) as u16,
            )
        };
        if !self.owns_port() {
            if let Some(s) = &self.steer {
                s.gate.leave(q);
            }
        }
        if got > 0 {
            self.counters.rx_bursts += 1;
            self.counters.rx_packets += u64::from(got);
        }
        n + usize::from(got)
    }

    /// A frame received on this queue that is not (only) this thread's: hands it (or a copy)
    /// over; true if it is gone.
    fn hand_over(&mut self, m: *mut sys::rte_mbuf, frame: &[u8]) -> bool {
        let Some(s) = &self.steer else { return false };
        let q = usize::from(self.queue);
        match steer::owner(frame, s.queues()) {
            Owner::Thread(k) if k != q => {
                s.hand_over(q, k, Mbuf(m));
                self.counters.steered += 1;
                true
            }
            Owner::All => {
                // An ARP reply: a copy for every other thread's neighbour cache (rare).
                for k in (0..s.queues()).filter(|&k| k != q) {
                    if let Some(c) = copy_frame(self.tx.pool, frame) {
                        s.hand_over(q, k, Mbuf(c));
                    }
                }
                false
            }
            _ => false,
        }
    }

    /// Takes the next frame of this pass's burst.
    fn next_rx(&mut self) -> Option<*mut sys::rte_mbuf> {
        loop {
            if self.rx_pos == self.rx_n {
                if self.rx_done {
                    return None;
                }
                self.rx_done = true;
                self.rx_n = self.fill_rx();
                self.rx_pos = 0;
                if self.rx_n == 0 {
                    return None;
                }
            }
            let i = self.rx_pos;
            let m = self.rx[i];
            self.rx_pos += 1;
            // SAFETY: `m` is an mbuf the driver just handed us.
            if unsafe { sys::rte_pktmbuf_nb_segs(m) } != 1 {
                // SAFETY: ours, and never used again.
                unsafe { sys::rte_pktmbuf_free(m) };
                self.counters.rx_drops += 1;
                continue;
            }
            // SAFETY: a single-segment mbuf: `data_len` bytes at `mtod` are the frame.
            let frame = unsafe { mbuf_bytes(m) };
            if i >= self.rx_handed && self.hand_over(m, frame) {
                continue;
            }
            self.tx.flows.received(frame);
            return Some(m);
        }
    }
}

/// A copy of `frame` in a fresh mbuf of `pool` (None if the pool is empty).
fn copy_frame(pool: *mut sys::rte_mempool, frame: &[u8]) -> Option<*mut sys::rte_mbuf> {
    // SAFETY: the pool outlives the device (new()).
    let m = unsafe { sys::rte_pktmbuf_alloc(pool) };
    if m.is_null() {
        return None;
    }
    // SAFETY: a fresh mbuf; append returns `len` writable bytes or null.
    let data = unsafe { sys::rte_pktmbuf_append(m, frame.len() as u16) as *mut u8 };
    if data.is_null() {
        // SAFETY: ours, never handed out.
        unsafe { sys::rte_pktmbuf_free(m) };
        return None;
    }
    // SAFETY: `data..data + len` is the new mbuf's data area; the frame is another mbuf's.
    unsafe { std::ptr::copy_nonoverlapping(frame.as_ptr(), data, frame.len()) };
    Some(m)
}

/// The bytes of a single-segment mbuf.
///
/// # Safety
/// `m` must be a valid single-segment mbuf that stays alive and unmodified while the slice is.
unsafe fn mbuf_bytes<'a>(m: *mut sys::rte_mbuf) -> &'a [u8] {
    // SAFETY: caller's contract; mtod + data_len is the segment's data.
    unsafe {
        std::slice::from_raw_parts(
            sys::rte_pktmbuf_mtod(m) as *const u8,
            usize::from(sys::rte_pktmbuf_data_len(m)),
        )
    }
}

impl TxSide {
    /// Sends the queue, counting what the driver took and what it refused (freed: TCP resends).
    fn burst(&mut self, port: u16, queue: u16) {
        if self.n == 0 {
            return;
        }
        for &m in &self.queue[..self.n] {
            // SAFETY: queued mbufs are single-segment frames we built and still own.
            self.flows.sent(unsafe { mbuf_bytes(m) });
        }
        // Queues other than 0 burst only while the port runs (queue 0 may stop it).
        let gate = self.steer.as_ref().filter(|_| queue != 0);
        if gate.is_some_and(|s| !s.gate.enter(usize::from(queue))) {
            // SAFETY: queued mbufs are ours; freed once, never sent (TCP resends).
            unsafe { sys::rte_pktmbuf_free_bulk(self.queue.as_mut_ptr(), self.n as u32) };
            self.dropped += self.n as u64;
            self.n = 0;
            return;
        }
        let (mbufs, n) = (self.queue.as_mut_ptr(), self.n as u16);
        // SAFETY: the first `n` entries are mbufs we own; the driver takes the first `sent`.
        let sent = unsafe { sys::rte_eth_tx_burst(port, queue, mbufs, n) };
        if let Some(s) = gate {
            s.gate.leave(usize::from(queue));
        }
        let sent = usize::from(sent);
        let refused = self.n - sent;
        if refused > 0 {
            // SAFETY: the driver did not take these; still ours, freed once.
            unsafe {
                sys::rte_pktmbuf_free_bulk(self.queue.as_mut_ptr().add(sent), refused as u32)
            };
        }
        self.n = 0;
        self.bursts += 1;
        self.sent += sent as u64;
        self.dropped += refused as u64;
    }
}

impl Flush for DpdkDevice {
    fn flush(&mut self) {
        self.rx_done = false;
        self.tx.burst(self.port, self.queue);
    }
}

impl Drop for DpdkDevice {
    fn drop(&mut self) {
        // SAFETY: the unread rest of the rx burst and the unsent tx queue are ours.
        unsafe {
            for &m in &self.rx[self.rx_pos..self.rx_n] {
                sys::rte_pktmbuf_free(m);
            }
            sys::rte_pktmbuf_free_bulk(self.tx.queue.as_mut_ptr(), self.tx.n as u32);
        }
    }
}

/// A received frame: owns its mbuf.
pub struct RxToken {
    m: *mut sys::rte_mbuf,
}

impl Drop for RxToken {
    fn drop(&mut self) {
        // SAFETY: the token owns the mbuf; it is freed exactly once, here.
        unsafe { sys::rte_pktmbuf_free(self.m) };
    }
}

impl phy::RxToken for RxToken {
    fn consume<R, F: FnOnce(&[u8]) -> R>(self, f: F) -> R {
        // SAFETY: single-segment (checked in next_rx), alive until `self` drops after `f`.
        f(unsafe { mbuf_bytes(self.m) })
    }
}

/// Room for one frame to send.
pub struct TxToken<'a> {
    tx: &'a mut TxSide,
    port: u16,
    queue: u16,
}

impl phy::TxToken for TxToken<'_> {
    fn consume<R, F: FnOnce(&mut [u8]) -> R>(self, len: usize, f: F) -> R {
        let tx = self.tx;
        if tx.n == TX_QUEUE {
            tx.burst(self.port, self.queue);
        }
        // SAFETY: the pool outlives the device (new()).
        let m = unsafe { sys::rte_pktmbuf_alloc(tx.pool) };
        let data = if m.is_null() || len > usize::from(u16::MAX) {
            std::ptr::null_mut()
        } else {
            // SAFETY: a fresh mbuf; append returns `len` writable bytes or null.
            unsafe { sys::rte_pktmbuf_append(m, len as u16) as *mut u8 }
        };
        if data.is_null() {
            if m.is_null() {
                tx.alloc_failures += 1;
            } else {
                // SAFETY: ours, never queued.
                unsafe { sys::rte_pktmbuf_free(m) };
            }
            tx.dropped += 1;
            if tx.scratch.len() < len {
                tx.scratch.resize(len, 0);
            }
            return f(&mut tx.scratch[..len]);
        }
        // SAFETY: `data..data + len` is the mbuf's data area, ours until the burst.
        let r = f(unsafe { std::slice::from_raw_parts_mut(data, len) });
        tx.queue[tx.n] = m;
        tx.n += 1;
        r
    }
}

impl Device for DpdkDevice {
    type RxToken<'a> = RxToken;
    type TxToken<'a> = TxToken<'a>;

    fn receive(&mut self, now: Instant) -> Option<(RxToken, TxToken<'_>)> {
        if self.reconnect && self.started {
            self.watch_link(now);
        }
        if !self.try_start(now) {
            return None;
        }
        let m = self.next_rx()?;
        let (port, queue) = (self.port, self.queue);
        Some((
            RxToken { m },
            TxToken {
                tx: &mut self.tx,
                port,
                queue,
            },
        ))
    }

    fn transmit(&mut self, _now: Instant) -> Option<TxToken<'_>> {
        if !self.started {
            return None;
        }
        Some(TxToken {
            tx: &mut self.tx,
            port: self.port,
            queue: self.queue,
        })
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut c = DeviceCapabilities::default();
        c.medium = Medium::Ethernet;
        c.max_transmission_unit = self.mtu + 14;
        c.max_burst_size = Some(BURST);
        if !self.verify_rx_checksums {
            // Tx: computed on transmit only.
            c.checksum.ipv4 = Checksum::Tx;
            c.checksum.tcp = Checksum::Tx;
            c.checksum.udp = Checksum::Tx;
            c.checksum.icmpv4 = Checksum::Tx;
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skipping_rx_checksums_keeps_computing_them_on_transmit() {
        // SAFETY: only the capabilities are read: no burst, no allocation, nothing to free.
        let mut dev = unsafe { DpdkDevice::new(0, 0, std::ptr::null_mut(), 1500) };
        let c = dev.capabilities().checksum;
        assert!(c.ipv4.rx() && c.ipv4.tx() && c.tcp.rx() && c.tcp.tx());
        dev.skip_rx_checksums();
        let c = dev.capabilities().checksum;
        assert!(!c.ipv4.rx() && c.ipv4.tx() && !c.tcp.rx() && c.tcp.tx());
    }
}
