//! Userspace TCP: a [`Link`] on smoltcp, device-agnostic (issue 10).
//!
//! [`UtcpLink<D>`] runs RDS/TCP's paths over a smoltcp [`Interface`] and [`SocketSet`] on any
//! `smoltcp::phy::Device` `D` that also implements [`Flush`] (send what a pass queued). The
//! DPDK transport (`transport::dpdk`) is this link over a device whose tokens wrap DPDK mbufs
//! (`rte_eth_rx_burst`/`rte_eth_tx_burst`); the link is proved with the shared exactly-once
//! suite over [`memwire`], an in-memory Ethernet segment with loss, duplication and
//! reordering (`dataplane/tests/userspace_tcp.rs`), and between real rdsd processes over
//! DPDK in `tests/tests/dpdk.rs`.
//!
//! # Mapping
//!
//! * One TCP socket per path. `connect` binds an ephemeral local port (49152..65535, ours:
//!   smoltcp does not pick one) with `port % 8 == path`, so the endpoint announces SPORT_IDX
//!   (`Link::SPORT_IDX`) and a passive peer maps paths by source port, on the RDS source
//!   address, and connects to `faddr:port`;
//!   `poll_connect` reads the socket state (Established: up; Closed: failed).
//! * A pool of listening sockets on the RDS port (16385 by default): smoltcp takes one
//!   listening socket per concurrent handshake. `accept` hands out a listener that became
//!   established (endpoints from the socket) and arms a new one in its place, oldest
//!   handshake first (stamped per pass, ties by lower peer port), like a kernel accept queue;
//!   `connect` sends its SYN at once. Both matter: without SPORT_IDX the protocol layer maps
//!   paths in accept order, and with an arbitrary order a path cut lost messages in the suite
//!   (a reconnected path's retransmissions were judged against another path's sequence
//!   numbers). A SYN lost or reordered on the wire can still swap paths (as with kernel TCP).
//! * smoltcp acknowledges what a listening socket receives before the endpoint accepts it,
//!   and the sender releases messages on that acknowledgement. So the endpoint never resets
//!   an accepted path it cannot map yet; it parks it (`Endpoint::accept`). After a cut the
//!   receiver's paused path (full receiver) had not noticed its reset, the peer's new
//!   connection for that path looked busy and was reset with acknowledged messages on it:
//!   they were lost (`utcp_reconnect_while_the_receiver_is_full_loses_nothing`).
//! * `read` lends the received bytes in place (`Socket::recv`: dequeued, and untouched while
//!   the link is borrowed), not copied out; `Closed` once the socket is closed, reset or timed out and its
//!   receive buffer is drained. `write` copies the slices in order, as much as fits, straight
//!   into the send buffer's free space (`Socket::send`, one call per contiguous stretch).
//!   `acked` is bytes written minus `send_queue()` (smoltcp's unacknowledged plus unsent
//!   bytes); smoltcp keeps the send buffer when a RST closes the socket, so this stays right
//!   for `final_acked` too.
//! * `close` aborts (RST) or closes (FIN) and parks the socket until the RST or FIN went out
//!   (at most [`UtcpConfig::linger`]); then the socket, with its buffers, goes back to a spare
//!   list for the next path.
//! * `doorbell` is a connection that is aborted as soon as it is established (or failed).
//! * `poll_aux` runs smoltcp's ingress (the pass's whole rx burst) once per pass, then its
//!   egress if anything may go out: `Interface::egress_at` (vendored patch, item 4) answers in
//!   O(1), now once a socket got input or was handed out by `&mut` (a write, a read that may
//!   open the window, a connect, a close, an abort), else at the earliest socket timer. The
//!   egress then dispatches only those sockets, not every path and listener. Order within a
//!   pass of `Endpoint::poll`: `accept` (every 16 passes; nothing to look at until a listener
//!   left LISTEN), `poll_aux` (frames in, timers, frames out), per path `read` and `write`,
//!   then `end_pass`, whose egress sends what the pass wrote: every pass's writes go out as
//!   one burst (what a DPDK `tx_burst` wants) in the pass that wrote them. The listeners are
//!   checked (a handshake to stamp, a dead one to replace) only when smoltcp touched one
//!   (`Interface::take_touched`: a packet for it, or its dispatch). The same mask keeps
//!   `path_ready` cheap: a path socket found not ready is remembered (a bit per slot) until
//!   smoltcp touches it or rdsd aborts, closes or replaces it, so an idle path is a bit test.
//!
//! # smoltcp settings, and why
//!
//! * smoltcp 0.14.0 (MSRV 1.91), **patched** (`dataplane/vendor/smoltcp`, `[patch.crates-io]`; the patch
//!   and its reasons are in `dataplane/vendor/smoltcp/PATCHES.md`): settable RTO bounds, RTT
//!   smoothing that rounds down, ARP retried after 100 ms, and an egress that dispatches only
//!   the sockets that may have something to send. Features `medium-ethernet`, `proto-ipv4`, `socket-tcp`,
//!   `socket-tcp-cubic` (congestion control, for a real NIC), `std` (clock), 64
//!   neighbour-cache entries (one per peer host, not per path) and 8 interface addresses.
//! * Nagle off: RDS writes whole frames and wants them out now (kernel RDS sets
//!   `TCP_NODELAY`).
//! * ACK delay: off in [`UtcpConfig::new`], 200 µs on a DPDK port (`[dpdk] ack_delay_us`). A
//!   request's ACK then rides on its reply, or joins later ones when the reply takes another
//!   path: one frame per message instead of two (`dpdk_pass_cost.rs`). The sender's `acked`
//!   releases send-buffer space, so a sender whose send buffer is half used must not wait for
//!   the timer: its messages carry `RDS_FLAG_ACK_REQUIRED` and [`Link::ack_now`] acknowledges
//!   them at once (`utcp_acknowledges_an_ack_required_message_at_once`). Even without the
//!   timer, ACKs are **per pass, not per segment**: 0.14 acknowledges in-order data from its egress half, and `Interface::poll`
//!   takes the pass's whole burst in (up to 32 frames from a DPDK port) before it sends, so a
//!   burst of segments draws one ACK (or rides on the data going back). Out-of-order segments
//!   are still answered at once (RFC 5681 duplicate ACKs, for fast retransmit). Measured:
//!   a 1 MiB message, 741 segments, 38 ACKs, one per receiver pass
//!   (`utcp_window_holds_a_mib_and_acks_are_per_pass`; 0.12 sent one ACK per segment).
//! * Buffers: 1.25 MiB receive and send per path ([`DEFAULT_BUF`]; DPDK: `[dpdk] buf_kib`),
//!   so a whole 1 MiB message with its header is in flight at once; window scaling is derived
//!   from the receive buffer (shift 5) and always offered. Allocated when a path's socket is
//!   first created, then recycled.
//! * **Timestamps on** (RFC 7323, a millisecond clock): 0.14 sizes a segment with the
//!   12-byte option inside the MTU (0.12 did not, and full segments with timestamps were never
//!   sent). Proved by the suite: every data segment carries them and the largest frames are
//!   exactly 1514 B (9014 B with a 9000 B MTU) (`utcp_passes_the_exactly_once_suite`,
//!   `utcp_passes_the_suite_with_jumbo_frames`). smoltcp itself only echoes the peer's value
//!   (no PAWS, and its RTT samples come from its own clock); they serve a peer that uses them
//!   (kernel TCP in interop: RTT per segment, PAWS), at 12 bytes a segment.
//! * SACK: smoltcp offers SACK blocks as a receiver when the peer permits them, but as a
//!   sender ignores the peer's (it retransmits from the first unacknowledged byte).
//! * Keep-alive 1 s and a 10 s idle timeout, so a dead peer is noticed (kernel TCP would
//!   retransmit for ~15 minutes).
//! * MSS from the device's MTU: 1500, or up to 9000 on a DPDK port that takes jumbo frames
//!   (`[dpdk] mtu`, `transport::dpdk`).
//!
//! # Retransmission timeout (measured)
//!
//! Unpatched 0.14 follows RFC 6298 to the letter: 1 s initial RTO, **1 s floor**, 60 s
//! ceiling, constants without a knob. RFC 6298's floor is for the Internet; on a datacenter
//! wire with RTTs of tens of microseconds it turns every tail loss (a message's last segment
//! lost: no duplicate ACKs, no fast retransmit) into a 1 s stall. Measured with unpatched
//! 0.14 (debug build, in-memory wire, `dataplane/tests/userspace_tcp.rs`, 2-core shared VM):
//! a single tail loss after warm-up resent after 1.000 s in 20 of 20 runs; the lossy suite
//! (2% loss, 1% duplication, 0.5% reordering) took 26.3 s, 23 of its 59 resends after 1-2 s;
//! a 300 ms blackout healed after 1 s.
//!
//! So the vendored smoltcp takes per-socket bounds ([`UtcpConfig::rto_initial`] 100 ms,
//! [`UtcpConfig::rto_min`] 5 ms, [`UtcpConfig::rto_max`] 1 s): 5 ms is far above a
//! datacenter RTT and above a poll core's scheduling hiccups on a shared host (a spurious
//! retransmission only costs a duplicate the peer drops); 100 ms for a SYN or a fresh path's
//! first segment (no sample yet); a 1 s ceiling so that backoff never leaves a healed wire
//! idle for long (the 10 s idle timeout bounds a dead peer anyway). RTT samples are whole
//! milliseconds; the RTO is `srtt + max(5 ms, 4 * rttvar)` clamped to the bounds, so on a
//! sub-millisecond wire it settles at 5 ms (0.14's round-up smoothing held it at 20-40 ms;
//! the patch rounds down). Fast retransmit on 3 duplicate ACKs. Measured with the patch on
//! the in-memory wire (`tests/userspace_tcp.rs`, virtual time: 100 µs per pass, the same
//! figures every run):
//!
//! * a single tail loss after warm-up (`utcp_rto_after_a_single_tail_loss`): delivered after
//!   exactly the RTO, 5 ms, every time (lossless delivery: within the pass); the RTO is 5 ms
//!   after the handshake's sample and after warm-up (the test asserts both);
//! * the first data segment of a fresh path lost: 5 ms (the handshake gave a sample);
//! * the lossy suite: 0.54 s of virtual time (26 s of real time unpatched); resends after
//!   0.1-10 ms, median 3.3 ms, p90 5.1 ms (fast retransmits under 5 ms, the rest RTOs);
//! * a 300 ms blackout: consecutive resends 5-160 ms apart (backoff from 5 ms), no path lost,
//!   nothing lost or doubled; the run took 0.36 s of virtual time;
//! * over DPDK af_packet on a veth (`tests/tests/dpdk.rs`, 11 MB each way in messages up to
//!   1 MiB, debug build on the shared 2-core VM): 1 path, 32 timeouts, all spurious (the peer
//!   saw 32 duplicates), against 444 with 0.12; 8 paths, 91, about as many duplicates. Such a
//!   host deschedules a poll core for longer than 5 ms; a dedicated core does not. The floor
//!   is `[dpdk] rto_min_ms` for hosts that need more.
//!
//! 0.13 fixed the spurious timeouts of 0.12 under a continuous flow (an ACK that did not
//! acknowledge everything in flight did not restart the timer, smoltcp issue #949, PR #1018)
//! and aligned backoff to RFC 6298 (PR #1023); 0.14 reworked fast retransmit and CUBIC.
//!
//! # Missing
//!
//! * Counters: retransmits, out-of-order segments, RTO expiries and window stalls are not
//!   exposed by smoltcp's public API; the DPDK device infers them from the TCP headers it
//!   carries (`transport::dpdk`, `wire.rs`).
//! * A poll-core timeout from `Interface::poll_delay` (the `Link` trait has no hook; with
//!   `acks_need_polling` the poll core wakes every 1 ms while messages are unacknowledged,
//!   which drives smoltcp's timers; the DPDK transport parks at most `park_us` anyway).
//! * Allocation in steady state: none on the data path; a new path's socket allocates its
//!   buffers only when no spare socket is left, and the `SocketSet` grows its slot vector when
//!   more sockets are live than ever before. ARP resolution is smoltcp's.

pub mod memwire;

use crate::protocol::{
    Accepted, Clock, ConnectPoll, Framing, InPlaceBytes, Link, MonotonicClock, Payload, PoolBuf,
    Read, Write,
};
use crate::seam::MsgBytes;
use smoltcp::iface::{
    Config as IfaceConfig, Interface, PollIngressSingleResult, PollResult, SocketHandle,
    SocketMask, SocketSet,
};
use smoltcp::phy::Device;
use smoltcp::socket::tcp;
use smoltcp::time::{Duration as SDuration, Instant as SInstant};
use smoltcp::wire::{EthernetAddress, HardwareAddress, IpAddress, IpCidr, Ipv4Address};
use std::cell::Cell;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The RDS/TCP port.
pub const RDS_PORT: u16 = 16385;

/// Default per-path receive and send buffer: a whole 1 MiB RDS message (plus its header) in
/// flight, with room to spare so the window does not close while the app drains it.
pub const DEFAULT_BUF: usize = 1024 * 1024 + 256 * 1024;

/// TCP timestamp clock (RFC 7323 wants 1 ms to 1 s per tick): milliseconds since the first
/// call in this process. A plain `fn`, as smoltcp's generator type requires.
fn tsval() -> u32 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u32
}

/// How a [`UtcpLink`] is set up.
#[derive(Clone, Debug)]
pub struct UtcpConfig {
    /// The interface's MAC address.
    pub mac: [u8; 6],
    /// The interface's addresses (the RDS addresses it serves) with their prefix lengths.
    pub addrs: Vec<(Ipv4Addr, u8)>,
    /// Default gateway, if peers are off-link.
    pub gateway: Option<Ipv4Addr>,
    /// The RDS port we listen on and connect to.
    pub port: u16,
    /// Listening sockets kept armed (concurrent inbound handshakes).
    pub listeners: usize,
    /// Receive buffer per path.
    pub rx_buf: usize,
    /// Send buffer per path.
    pub tx_buf: usize,
    /// Delayed-ACK timer (`None`: ACK at once).
    pub ack_delay: Option<Duration>,
    /// Keep-alive interval on established paths.
    pub keep_alive: Option<Duration>,
    /// Close a path that heard nothing from its peer for this long.
    pub idle_timeout: Option<Duration>,
    /// Longest a closed socket waits for its FIN or RST to go out before it is recycled.
    pub linger: Duration,
    /// Seed for smoltcp's initial sequence numbers and our ephemeral ports.
    pub seed: u64,
    /// Retransmission timeout before the first RTT sample (SYNs, a fresh path's first data).
    pub rto_initial: Duration,
    /// Floor of the computed retransmission timeout.
    pub rto_min: Duration,
    /// Ceiling of the retransmission timeout and of its exponential backoff.
    pub rto_max: Duration,
    /// TCP timestamps (RFC 7323) on the paths we open and accept.
    pub timestamps: bool,
    /// Congestion control (smoltcp's CUBIC) on the paths; off, the peer's receive window
    /// alone limits what is in flight.
    pub congestion_control: bool,
    /// Payloads of at least this many bytes are written from the app's ring, not copied
    /// first (`tcp_zero_copy_min`); `None`: every payload is copied.
    pub zero_copy_min: Option<usize>,
}

impl UtcpConfig {
    /// Defaults for an interface with one address.
    pub fn new(mac: [u8; 6], addr: Ipv4Addr, prefix: u8) -> UtcpConfig {
        UtcpConfig {
            mac,
            addrs: vec![(addr, prefix)],
            gateway: None,
            port: RDS_PORT,
            listeners: 8,
            rx_buf: DEFAULT_BUF,
            tx_buf: DEFAULT_BUF,
            ack_delay: None,
            keep_alive: Some(Duration::from_secs(1)),
            idle_timeout: Some(Duration::from_secs(10)),
            linger: Duration::from_secs(2),
            seed: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
                ^ u64::from(addr.to_bits()),
            rto_initial: Duration::from_millis(100),
            rto_min: Duration::from_millis(5),
            rto_max: Duration::from_secs(1),
            timestamps: true,
            congestion_control: true,
            zero_copy_min: Some(crate::protocol::TCP_ZERO_COPY_MIN),
        }
    }
}

/// A device that queues transmissions during a pass and sends them together (DPDK's
/// `tx_burst`): [`UtcpLink`] calls `flush` after every `Interface::poll` and after a connect's
/// SYN, so each pass's frames leave as one burst. Devices that send at once keep the default.
pub trait Flush {
    /// Sends what was queued.
    fn flush(&mut self) {}
}

/// One path: a TCP socket in the link's socket set.
#[derive(Debug)]
pub struct UtcpPath {
    handle: SocketHandle,
    /// The socket's slot alone ([`SocketMask::single`]: empty for a slot from 63 on), for the
    /// link's "known not ready" set ([`Link::path_ready`]).
    bit: SocketMask,
    /// Established and reported so (`poll_connect` said Up, or accepted): from then on the
    /// path is ready only with input, instead of every pass for connect progress.
    up: bool,
}

/// A shared switch that makes the link abort every path at its next pass (a link cut, or an
/// operator's reset).
#[derive(Clone, Debug, Default)]
pub struct AbortSwitch(Arc<AtomicBool>);

impl AbortSwitch {
    /// Asks the link to abort every path.
    pub fn trip(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Userspace TCP over a smoltcp device: every path of every RDS connection of one interface.
/// smoltcp's timers (RTO, keep-alive, idle timeout) and the link's own deadlines run on `C`.
pub struct UtcpLink<D: Device, C: Clock = MonotonicClock> {
    cfg: UtcpConfig,
    clock: C,
    device: D,
    iface: Interface,
    sockets: SocketSet<'static>,
    /// Listening sockets, each with the pass in which it left LISTEN (0: still listening).
    listeners: Vec<(SocketHandle, u64)>,
    /// The listeners' slots, to test smoltcp's touched sockets against (`poll_aux`).
    listener_mask: SocketMask,
    /// Sockets smoltcp touched (ingress fed them, or the egress dispatched them) since the
    /// listeners were last checked (`poll_aux`).
    touched: SocketMask,
    /// Path sockets known not ready (`path_ready` found them so, and nothing that could
    /// change that happened since): an idle path's `path_ready` is a bit test. Slots from 63
    /// on are never in it ([`SocketMask::single`]). A `Cell`: `path_ready` takes `&self`.
    not_ready: Cell<SocketMask>,
    /// Moves on whenever a socket may have left `not_ready` (`Link::ready_epoch`).
    ready_epoch: Cell<u64>,
    /// Path sockets whose acknowledgements `acked` read, untouched by smoltcp since: only a
    /// segment for the socket (ingress feeds it: `take_fed`) or an abort moves `snd_una`, and a `send`
    /// moves the bytes written and the send queue alike, so `acked` would answer the same.
    acks_read: SocketMask,
    /// Listeners that left LISTEN (a handshake; `accept` has nothing to do while none did).
    handshakes: usize,
    /// `poll_aux` passes so far.
    passes: u64,
    /// Live path sockets (connected, connecting or accepted), for a cut.
    live: Vec<SocketHandle>,
    /// Closed sockets whose FIN or RST may still have to go out.
    closing: Vec<(SocketHandle, rds_proto::Instant)>,
    doorbells: Vec<(SocketHandle, rds_proto::Instant)>,
    /// Sockets (with their buffers) ready for reuse.
    spare: Vec<tcp::Socket<'static>>,
    next_port: u16,
    abort: AbortSwitch,
    /// Egress walks so far (`poll_aux` and `end_pass`), for tests and diagnostics.
    egress_runs: u64,
}

/// smoltcp's time (microseconds) for a clock reading.
fn smol(t: rds_proto::Instant) -> SInstant {
    SInstant::from_micros((t.as_nanos() / 1000) as i64)
}

fn sdur(d: Duration) -> SDuration {
    SDuration::from_micros(d.as_micros() as u64)
}

impl<D: Device + Flush> UtcpLink<D> {
    /// An interface on `device` with `cfg`'s addresses, listening on `cfg.port`, on the
    /// monotonic clock.
    pub fn new(device: D, cfg: UtcpConfig) -> UtcpLink<D> {
        UtcpLink::with_clock(device, cfg, MonotonicClock::new())
    }
}

impl<D: Device + Flush, C: Clock> UtcpLink<D, C> {
    /// An interface on `device` with `cfg`'s addresses, listening on `cfg.port`, whose TCP
    /// timers run on `clock`.
    pub fn with_clock(mut device: D, cfg: UtcpConfig, clock: C) -> UtcpLink<D, C> {
        let mut ic = IfaceConfig::new(HardwareAddress::Ethernet(EthernetAddress(cfg.mac)));
        ic.random_seed = cfg.seed;
        let mut iface = Interface::new(ic, &mut device, smol(clock.now()));
        iface.update_ip_addrs(|a| {
            for &(addr, len) in &cfg.addrs {
                let _ = a.push(IpCidr::new(IpAddress::Ipv4(addr), len));
            }
        });
        if let Some(gw) = cfg.gateway {
            let _ = iface.routes_mut().add_default_ipv4_route(gw);
        }
        let next_port = 49152 + (cfg.seed % 16384) as u16;
        let mut link = UtcpLink {
            clock,
            device,
            iface,
            sockets: SocketSet::new(Vec::with_capacity(64)),
            listeners: Vec::with_capacity(cfg.listeners),
            listener_mask: SocketMask::EMPTY,
            touched: SocketMask::EMPTY,
            not_ready: Cell::new(SocketMask::EMPTY),
            ready_epoch: Cell::new(0),
            acks_read: SocketMask::EMPTY,
            handshakes: 0,
            passes: 0,
            live: Vec::with_capacity(64),
            closing: Vec::with_capacity(16),
            doorbells: Vec::new(),
            spare: Vec::new(),
            next_port,
            abort: AbortSwitch::default(),
            egress_runs: 0,
            cfg,
        };
        for _ in 0..link.cfg.listeners.max(1) {
            link.arm_listener();
        }
        link
    }

    /// How many times smoltcp's egress walked the sockets (a pass with no input, nothing
    /// changed and no timer due skips it).
    pub fn egress_runs(&self) -> u64 {
        self.egress_runs
    }

    /// How many sockets smoltcp's egress has dispatched so far (a walk dispatches only the
    /// sockets that may have something to send: vendored smoltcp, PATCHES.md item 4).
    pub fn egress_visits(&self) -> u64 {
        self.iface.egress_visits()
    }

    /// How many sockets smoltcp's egress has examined so far, dispatched or skipped: the
    /// walk's length (only the due sockets unless a timer may have come: PATCHES.md item 4).
    pub fn egress_examined(&self) -> u64 {
        self.iface.egress_examined()
    }

    /// How many TCP sockets smoltcp's ingress has asked to take a segment so far: one per
    /// segment once its port pair is known (PATCHES.md item 6), not every listener first.
    pub fn ingress_examined(&self) -> u64 {
        self.iface.tcp_ingress_examined()
    }

    /// The device, for its counters.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The switch that aborts every path (see [`AbortSwitch`]).
    pub fn abort_switch(&self) -> AbortSwitch {
        self.abort.clone()
    }

    /// Sockets in the set now (paths, listeners, closing), for tests and diagnostics.
    pub fn socket_count(&self) -> usize {
        self.sockets.iter().count()
    }

    /// (state, local port, remote port, send queue, receive queue) of every socket, for
    /// diagnostics.
    pub fn socket_states(&self) -> Vec<(tcp::State, u16, u16, usize, usize)> {
        self.sockets
            .iter()
            .filter_map(|(_, s)| match s {
                smoltcp::socket::Socket::Tcp(t) => Some((
                    t.state(),
                    t.local_endpoint().map_or(0, |e| e.port),
                    t.remote_endpoint().map_or(0, |e| e.port),
                    t.send_queue(),
                    t.recv_queue(),
                )),
                #[allow(unreachable_patterns)]
                _ => None,
            })
            .collect()
    }

    /// The retransmission timeout a path's socket would use now (RTT estimate and bounds).
    pub fn retransmission_timeout(&self, p: &UtcpPath) -> Duration {
        let rto = self
            .sockets
            .get::<tcp::Socket>(p.handle)
            .retransmission_timeout();
        Duration::from_micros(rto.total_micros())
    }

    fn new_socket(&mut self) -> tcp::Socket<'static> {
        if let Some(s) = self.spare.pop() {
            return s;
        }
        let mut s = tcp::Socket::new(
            tcp::SocketBuffer::new(vec![0u8; self.cfg.rx_buf]),
            tcp::SocketBuffer::new(vec![0u8; self.cfg.tx_buf]),
        );
        s.set_nagle_enabled(false);
        s.set_ack_delay(self.cfg.ack_delay.map(sdur));
        s.set_tsval_generator(self.cfg.timestamps.then_some(tsval as fn() -> u32));
        s.set_congestion_control(if self.cfg.congestion_control {
            tcp::CongestionControl::Cubic
        } else {
            tcp::CongestionControl::None
        });
        // RFC 6298's 1 s floor is for the Internet; see the module doc.
        s.set_rto_bounds(
            sdur(self.cfg.rto_initial),
            sdur(self.cfg.rto_min),
            sdur(self.cfg.rto_max),
        );
        s.set_keep_alive(self.cfg.keep_alive.map(sdur));
        s.set_timeout(self.cfg.idle_timeout.map(sdur));
        s
    }

    fn arm_listener(&mut self) {
        let mut s = self.new_socket();
        if s.listen(self.cfg.port).is_ok() {
            let h = self.add(s);
            self.listeners.push((h, 0));
            self.listener_mask.insert(h);
        }
    }

    /// Takes listener `i` out of the pool.
    fn remove_listener(&mut self, i: usize) -> SocketHandle {
        let (h, since) = self.listeners.swap_remove(i);
        self.handshakes -= usize::from(since != 0);
        self.listener_mask = SocketMask::EMPTY;
        for &(l, _) in &self.listeners {
            self.listener_mask.insert(l);
        }
        h
    }

    /// The next ephemeral port; for a path, one with `port % 8 == path` (SPORT_IDX's rule, so a
    /// peer that maps paths by source port finds the right one; harmless for one that doesn't).
    fn ephemeral_port(&mut self, path: Option<usize>) -> u16 {
        loop {
            let p = self.next_port;
            self.next_port = if p == u16::MAX { 49152 } else { p + 1 };
            if path.is_none_or(|k| usize::from(p) % 8 == k % 8) {
                return p;
            }
        }
    }

    /// A socket to change: smoltcp's next egress looks at it (`SocketSet::get_mut` marks it),
    /// and `path_ready` looks at it again (an abort or a close may make it ready).
    fn sock(&mut self, h: SocketHandle) -> &mut tcp::Socket<'static> {
        self.forget_not_ready(SocketMask::single(h));
        self.acks_read = self.acks_read.difference(SocketMask::single(h));
        self.sockets.get_mut::<tcp::Socket>(h)
    }

    /// A path's socket to send on or receive from: smoltcp's next egress looks at it, but it
    /// stays known not ready if it was: `send` only adds to its send buffer and `recv` only
    /// takes from its receive buffer, neither changes its state, so neither can make a socket
    /// with an empty receive buffer and an open receive half ready.
    fn sock_io(&mut self, h: SocketHandle) -> &mut tcp::Socket<'static> {
        self.sockets.get_mut::<tcp::Socket>(h)
    }

    /// Puts a socket in the set. Its slot may be a closed path's: no longer known not ready.
    fn add(&mut self, s: tcp::Socket<'static>) -> SocketHandle {
        let h = self.sockets.add(s);
        self.forget_not_ready(SocketMask::single(h));
        self.acks_read = self.acks_read.difference(SocketMask::single(h));
        h
    }

    /// The sockets of `m` are no longer known not ready, and `ready_epoch` moves on (also for
    /// an empty `m`: a socket from slot 63 on has no bit of its own).
    fn forget_not_ready(&self, m: SocketMask) {
        self.not_ready.set(self.not_ready.get().difference(m));
        self.ready_epoch.set(self.ready_epoch.get().wrapping_add(1));
    }

    /// Takes smoltcp's touched sockets (after every ingress and egress call, so that
    /// `not_ready` is right whenever `path_ready` is asked): they are no longer known not
    /// ready, and the listeners among them are checked at the next `poll_aux`.
    fn absorb_touched(&mut self) {
        let t = self.iface.take_touched();
        if !t.is_empty() {
            self.touched = self.touched.union(t);
            self.forget_not_ready(t);
        }
        // Acknowledgements move only with a segment in (smoltcp patch item 9): a socket the
        // egress dispatched sent, and its path is not visited again to ask.
        self.acks_read = self.acks_read.difference(self.iface.take_fed());
    }

    /// What `path_ready` answers, computed: a connecting path, bytes to read, or a socket that
    /// can receive no more (its close is input).
    fn path_ready_now(&self, p: &UtcpPath) -> bool {
        let s = self.sockets.get::<tcp::Socket>(p.handle);
        !p.up || s.can_recv() || !s.may_recv()
    }

    /// Gives a socket back: it stays in the set until its FIN/RST went out.
    fn retire(&mut self, h: SocketHandle) {
        if let Some(i) = self.live.iter().position(|&x| x == h) {
            self.live.swap_remove(i);
        }
        let deadline = self.clock.now() + self.cfg.linger;
        self.closing.push((h, deadline));
    }

    /// Stamps the `touched` listeners that left LISTEN (a handshake) or came back to it (a
    /// RST), and replaces those whose handshake died before `accept`.
    fn check_listeners(&mut self, touched: SocketMask) {
        let mut k = 0;
        while k < self.listeners.len() {
            let (h, since) = self.listeners[k];
            if !touched.contains(h) {
                k += 1;
                continue;
            }
            let state = self.sockets.get::<tcp::Socket>(h).state();
            if matches!(
                state,
                tcp::State::Listen
                    | tcp::State::SynReceived
                    | tcp::State::Established
                    | tcp::State::CloseWait
            ) {
                let listening = state == tcp::State::Listen;
                if listening != (since == 0) {
                    // Stamped when a SYN arrives; cleared if a RST sends it back to LISTEN.
                    self.listeners[k].1 = if listening { 0 } else { self.passes };
                    if listening {
                        self.handshakes -= 1;
                    } else {
                        self.handshakes += 1;
                    }
                }
                k += 1;
            } else {
                // A handshake that died before accept (timed out, reset, closed): the
                // socket is no listener any more; replace it.
                self.remove_listener(k);
                self.sock(h).abort();
                self.retire(h);
                self.arm_listener();
            }
        }
    }

    fn reap(&mut self) {
        let t = self.clock.now();
        let mut i = 0;
        while i < self.closing.len() {
            let (h, deadline) = self.closing[i];
            // Read only: a `&mut` would make smoltcp's next egress look at the socket.
            let s = self.sockets.get::<tcp::Socket>(h);
            let done = match s.state() {
                // A RST or FIN exchange is over once smoltcp forgot the peer.
                tcp::State::Closed => s.remote_endpoint().is_none(),
                tcp::State::TimeWait => true,
                _ => false,
            };
            if done || t >= deadline {
                self.closing.swap_remove(i);
                self.forget_not_ready(SocketMask::single(h));
                // Irrefutable with only `socket-tcp`, not if a dependent enables more kinds.
                #[allow(irrefutable_let_patterns)]
                if let smoltcp::socket::Socket::Tcp(mut tcp) = self.sockets.remove(h) {
                    tcp.abort();
                    self.spare.push(tcp);
                }
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.doorbells.len() {
            let (h, deadline) = self.doorbells[i];
            let st = self.sockets.get::<tcp::Socket>(h).state();
            if st == tcp::State::Established || st == tcp::State::Closed || t >= deadline {
                self.sock(h).abort();
                self.doorbells.swap_remove(i);
                self.closing.push((h, t + self.cfg.linger));
            } else {
                i += 1;
            }
        }
    }

    fn start_connect(
        &mut self,
        laddr: u32,
        faddr: u32,
        path: Option<usize>,
    ) -> std::io::Result<SocketHandle> {
        let mut s = self.new_socket();
        let port = self.ephemeral_port(path);
        let remote = (IpAddress::Ipv4(Ipv4Address::from(faddr)), self.cfg.port);
        let local = (IpAddress::Ipv4(Ipv4Address::from(laddr)), port);
        match s.connect(self.iface.context(), remote, local) {
            Ok(()) => Ok(self.add(s)),
            Err(e) => {
                self.spare.push(s);
                Err(std::io::Error::new(
                    std::io::ErrorKind::AddrNotAvailable,
                    format!("smoltcp connect: {e}"),
                ))
            }
        }
    }

    /// Runs the interface once: frames in, then frames out if there may be any (a socket got
    /// input or changed, or a timer is due). True when a socket's state may have changed.
    fn poll_iface(&mut self) -> bool {
        let now = smol(self.clock.now());
        let mut changed = false;
        loop {
            match self
                .iface
                .poll_ingress_single(now, &mut self.device, &mut self.sockets)
            {
                PollIngressSingleResult::None => break,
                PollIngressSingleResult::PacketProcessed => {}
                PollIngressSingleResult::SocketStateChanged => changed = true,
            }
        }
        changed |= self.egress(now, true);
        self.device.flush();
        self.absorb_touched();
        changed
    }

    /// What the sockets have to send (`drain`: all of it; else one segment per socket, as
    /// smoltcp's `poll_egress`), if anything may go out: smoltcp (patched, PATCHES.md item 4)
    /// keeps when that is, in O(1): now after a socket got input, was added or handed out by
    /// `&mut` (a write, a read that may open the window, a connect, a close), else its next
    /// timer. A walk then dispatches only those sockets, not every path and listener.
    fn egress(&mut self, now: SInstant, drain: bool) -> bool {
        if self
            .iface
            .egress_at(now, &self.sockets)
            .is_none_or(|t| t > now)
        {
            return false;
        }
        self.egress_runs += 1;
        let mut changed = false;
        while self
            .iface
            .poll_egress(now, &mut self.device, &mut self.sockets)
            == PollResult::SocketStateChanged
        {
            changed = true;
            if !drain {
                break;
            }
        }
        changed
    }
}

fn v4(a: IpAddress) -> u32 {
    match a {
        IpAddress::Ipv4(a) => u32::from(a),
    }
}

impl<D: Device + Flush + Send, C: Clock> Link for UtcpLink<D, C> {
    type Path = UtcpPath;
    type Payload = Payload;
    const FRAMING: Framing = Framing::Stream;
    const SPORT_IDX: bool = true;

    fn payload(&mut self, bytes: MsgBytes<'_>) -> Payload {
        Payload::Copy(PoolBuf::copy_of(bytes))
    }

    fn zero_copy(&self) -> bool {
        self.cfg.zero_copy_min.is_some()
    }

    fn zero_copy_min(&self) -> usize {
        self.cfg.zero_copy_min.unwrap_or(usize::MAX)
    }

    fn payload_in_place(&mut self, bytes: MsgBytes<'_>, _region: u64) -> Option<Payload> {
        // Any region: `write` copies the bytes into smoltcp's send buffer with a raw copy.
        let min = self.cfg.zero_copy_min?;
        // SAFETY: offered in place (`OutMsg::in_place`): the poll core keeps the region
        // mapped and the ring space unused until the message is released, which the engine
        // does only once every byte of its frame was written (even when it is cancelled).
        (bytes.len() >= min).then(|| Payload::InPlace(unsafe { InPlaceBytes::new(bytes) }))
    }

    fn accept(&mut self) -> Option<Accepted<UtcpPath>> {
        debug_assert_eq!(
            self.handshakes,
            self.listeners
                .iter()
                .filter(|&&(_, since)| since != 0)
                .count()
        );
        if self.handshakes == 0 {
            return None;
        }
        // Oldest handshake first (then the lower peer port: the peer's connects of one pass),
        // as a kernel accept queue: in classic RDS/TCP the accept order maps paths.
        let mut best: Option<(usize, (u64, u16))> = None;
        for (i, &(h, since)) in self.listeners.iter().enumerate() {
            let s = self.sockets.get::<tcp::Socket>(h);
            if since == 0 || !matches!(s.state(), tcp::State::Established | tcp::State::CloseWait) {
                continue;
            }
            let key = (since, s.remote_endpoint().map_or(0, |e| e.port));
            if best.is_none_or(|(_, k)| key < k) {
                best = Some((i, key));
            }
        }
        let (i, _) = best?;
        let h = self.remove_listener(i);
        self.arm_listener();
        let s = self.sockets.get::<tcp::Socket>(h);
        let (Some(local), Some(remote)) = (s.local_endpoint(), s.remote_endpoint()) else {
            self.retire(h);
            return None;
        };
        self.live.push(h);
        tracing::debug!(peer = %remote.addr, port = remote.port, "utcp: accepted");
        Some(Accepted {
            path: UtcpPath {
                handle: h,
                bit: SocketMask::single(h),
                up: true,
            },
            laddr: v4(local.addr),
            faddr: v4(remote.addr),
            peer_port: remote.port,
        })
    }

    fn connect(&mut self, laddr: u32, faddr: u32, path: usize) -> std::io::Result<UtcpPath> {
        let h = self.start_connect(laddr, faddr, Some(path))?;
        tracing::debug!(
            path,
            port = self
                .sockets
                .get::<tcp::Socket>(h)
                .local_endpoint()
                .map_or(0, |e| e.port),
            "utcp: connect"
        );
        self.live.push(h);
        // The SYN leaves now, so that the peer sees our paths' handshakes in path order (the
        // socket set's egress order is slot order, not connect order).
        let now = smol(self.clock.now());
        self.iface
            .poll_egress(now, &mut self.device, &mut self.sockets);
        self.device.flush();
        self.absorb_touched();
        Ok(UtcpPath {
            handle: h,
            bit: SocketMask::single(h),
            up: false,
        })
    }

    fn poll_connect(&mut self, p: &mut UtcpPath) -> ConnectPoll {
        match self.sockets.get::<tcp::Socket>(p.handle).state() {
            tcp::State::Established => {
                p.up = true;
                ConnectPoll::Up
            }
            tcp::State::SynSent | tcp::State::SynReceived => ConnectPoll::Pending,
            _ => ConnectPoll::Failed,
        }
    }

    fn doorbell(&mut self, laddr: u32, faddr: u32) {
        if let Ok(h) = self.start_connect(laddr, faddr, None) {
            let deadline = self.clock.now() + Duration::from_secs(1);
            self.doorbells.push((h, deadline));
        }
    }

    fn read<'a>(&'a mut self, p: &mut UtcpPath, buf: &'a mut [u8]) -> Read<'a> {
        let max = buf.len();
        // In place, not copied into `buf`: `recv` dequeues the bytes and lends them, and they
        // stay as they are while the borrow of `self` lasts (nothing can enqueue meanwhile).
        // At most `max`, and only up to the ring's wrap: the next read takes the rest. The
        // socket counts as due for smoltcp's egress only if the read opened its window enough
        // for a window update (`tcp_recv`, smoltcp patch item 7): no dispatch per read.
        let got = self.sockets.tcp_recv(p.handle, |b| {
            let n = b.len().min(max);
            let (head, _) = b.split_at_mut(n);
            (n, &*head)
        });
        match got {
            Ok([]) => Read::WouldBlock,
            Ok(data) => Read::Data(data),
            Err(e) => {
                tracing::debug!(error = %e, "utcp: read: closed");
                Read::Closed
            }
        }
    }

    fn write(&mut self, p: &mut UtcpPath, slices: &[&[u8]]) -> Write {
        let s = self.sock_io(p.handle);
        // The slices go straight into the send buffer's free space, one `send` per contiguous
        // stretch of it (two when it wraps around the ring's end): `send_slice` per slice
        // costs ~140 instructions of ring-buffer and socket checks, against ~30 for copying a
        // 48 B header or a 64 B payload (issue 17).
        let (mut next, mut offset) = (0, 0); // the next byte: slices[next][offset]
        let mut total = 0;
        while next < slices.len() {
            let sent = s.send(|buf| {
                let mut n = 0;
                while let Some(sl) = slices.get(next) {
                    let src = &sl[offset..];
                    let k = src.len().min(buf.len() - n);
                    // SAFETY: `k` bytes fit in both; the source may be an app's tx ring
                    // (`Payload::InPlace`), which the app can write while we copy, so it is
                    // copied raw, never read through a typed reference; rdsd's own send
                    // buffer cannot overlap an app region.
                    unsafe {
                        std::ptr::copy_nonoverlapping(src.as_ptr(), buf[n..].as_mut_ptr(), k);
                    }
                    n += k;
                    if k < src.len() {
                        offset += k;
                        break;
                    }
                    (next, offset) = (next + 1, 0);
                }
                (n, n)
            });
            match sent {
                Ok(0) => break,
                Ok(n) => total += n,
                Err(_) if total == 0 => return Write::Closed,
                Err(_) => break,
            }
        }
        if total == 0 {
            Write::WouldBlock
        } else {
            Write::Wrote(total)
        }
    }

    fn acked(&mut self, p: &UtcpPath, written: u64) -> Option<u64> {
        let q = self.sockets.get::<tcp::Socket>(p.handle).send_queue() as u64;
        self.acks_read = self.acks_read.union(p.bit);
        Some(written.saturating_sub(q))
    }

    fn acks_may_have_moved(&self, p: &UtcpPath) -> bool {
        !self.acks_read.intersects(p.bit)
    }

    fn ack_now(&mut self, p: &mut UtcpPath) {
        self.sock_io(p.handle).ack_now();
    }

    fn endpoints(&self, p: &UtcpPath) -> Option<(SocketAddrV4, SocketAddrV4)> {
        let s = self.sockets.get::<tcp::Socket>(p.handle);
        let v4 = |e: smoltcp::wire::IpEndpoint| match e.addr {
            smoltcp::wire::IpAddress::Ipv4(a) => Some(SocketAddrV4::new(a, e.port)),
        };
        Some((v4(s.local_endpoint()?)?, v4(s.remote_endpoint()?)?))
    }

    fn close(&mut self, p: UtcpPath, reset: bool) {
        let s = self.sock(p.handle);
        tracing::debug!(reset, state = %s.state(), local = s.local_endpoint().map_or(0, |e| e.port), remote = s.remote_endpoint().map_or(0, |e| e.port), "utcp: close");
        if reset {
            s.abort();
        } else {
            s.close();
        }
        self.retire(p.handle);
    }

    fn poll_aux(&mut self) -> usize {
        if self.abort.0.swap(false, Ordering::Relaxed) {
            for k in 0..self.live.len() {
                let h = self.live[k];
                self.sock(h).abort();
            }
        }
        let changed = self.poll_iface();
        self.passes += 1;
        // A listener changes only by input (a SYN, the handshake's ACK, a RST) or by its
        // dispatch (a timeout): only those smoltcp touched since the last pass are checked.
        let touched = std::mem::take(&mut self.touched);
        if touched.intersects(self.listener_mask) {
            self.check_listeners(touched);
        }
        if !self.closing.is_empty() || !self.doorbells.is_empty() {
            self.reap();
        }
        usize::from(changed)
    }

    fn acks_need_polling(&self) -> bool {
        true
    }

    /// Memory reads only (the interface's ingress ran in `poll_aux`): a connecting path, bytes
    /// to read, or a socket that can receive no more (its close is input). An idle
    /// established path is not visited.
    ///
    /// A path found not ready is remembered (`not_ready`), and answers from that bit until
    /// something could make it ready. Why the bit never hides a ready path: not ready means up
    /// (`up` never goes back to false for a `UtcpPath`), an empty receive buffer and a state
    /// that may receive (Established, FIN-WAIT-1/2). Only smoltcp's ingress (a segment: data,
    /// FIN, RST), its dispatch (a timeout that closes the socket) or our `&mut` calls change
    /// those: the first two put the socket in `Interface::take_touched`, which
    /// `absorb_touched` takes after every ingress and egress call and removes from the set;
    /// `sock` (abort, close, connect) removes it; `sock_io` (send, recv) cannot make it ready;
    /// a socket put in a freed slot (`add`) or removed from it (`reap`) is removed too.
    fn ready_epoch(&self) -> Option<u64> {
        Some(self.ready_epoch.get())
    }

    fn path_ready(&self, p: &UtcpPath) -> bool {
        let known = self.not_ready.get();
        if known.intersects(p.bit) {
            debug_assert!(
                !self.path_ready_now(p),
                "a path known not ready is ready (socket {})",
                p.handle
            );
            return false;
        }
        let ready = self.path_ready_now(p);
        if !ready {
            self.not_ready.set(known.union(p.bit));
        }
        ready
    }

    fn end_pass(&mut self, wrote: bool) {
        if wrote {
            // What the pass wrote leaves now, not at the next pass's `poll_aux`.
            let now = smol(self.clock.now());
            self.egress(now, false);
            self.device.flush();
            self.absorb_touched();
        }
    }
}

#[cfg(test)]
mod tests {
    //! The "known not ready" set behind `path_ready`, over the in-memory wire. Every cached
    //! answer is also checked against the full computation (the debug assertion in
    //! `path_ready`), here and in the exactly-once suites (`tests/userspace_tcp.rs`).
    use super::memwire::{Hub, Port};
    use super::*;
    use crate::protocol::VirtualClock;

    type MemLink = UtcpLink<Port, VirtualClock>;

    const A: u32 = 0x0a00_0001;
    const B: u32 = 0x0a00_0002;

    fn link(hub: &Hub, clock: &VirtualClock, addr: u32) -> MemLink {
        let ip = Ipv4Addr::from(addr);
        let o = ip.octets();
        let mut cfg = UtcpConfig::new([0x02, 0, o[0], o[1], o[2], o[3]], ip, 8);
        cfg.seed = u64::from(addr);
        UtcpLink::with_clock(hub.port(), cfg, clock.clone())
    }

    /// One pass of each link, 100 µs apart.
    fn pass(a: &mut MemLink, b: &mut MemLink, clock: &VirtualClock) {
        a.poll_aux();
        b.poll_aux();
        clock.advance(Duration::from_micros(100));
    }

    fn pair() -> (MemLink, MemLink, UtcpPath, UtcpPath, VirtualClock) {
        let clock = VirtualClock::new();
        let hub = Hub::with_clock(clock.clone());
        let (mut a, mut b) = (link(&hub, &clock, A), link(&hub, &clock, B));
        let mut pa = a.connect(A, B, 0).unwrap();
        for _ in 0..1000 {
            pass(&mut a, &mut b, &clock);
            if a.poll_connect(&mut pa) == ConnectPoll::Up {
                if let Some(acc) = b.accept() {
                    // The handshake's last ACK and anything else in flight settle.
                    for _ in 0..10 {
                        pass(&mut a, &mut b, &clock);
                    }
                    return (a, b, pa, acc.path, clock);
                }
            }
        }
        panic!("no handshake");
    }

    fn known_not_ready(l: &MemLink, p: &UtcpPath) -> bool {
        l.not_ready.get().intersects(p.bit)
    }

    /// An idle path is found not ready once, then answers from its bit; data from the peer
    /// (smoltcp's ingress touches the socket) clears the bit and the path is ready; reading
    /// and writing leave a known not-ready socket so.
    #[test]
    fn utcp_not_ready_is_cached_until_smoltcp_touches_the_socket() {
        let (mut a, mut b, mut pa, mut pb, clock) = pair();
        assert!(!known_not_ready(&b, &pb));
        assert!(!b.path_ready(&pb), "an idle established path");
        assert!(known_not_ready(&b, &pb), "remembered");
        assert!(!b.path_ready(&pb), "answered from the bit");
        assert!(!a.path_ready(&pa));

        // A write on a known not-ready path keeps it so (send cannot make it ready).
        assert_eq!(a.write(&mut pa, &[b"hello"]), Write::Wrote(5));
        assert!(known_not_ready(&a, &pa));
        a.end_pass(true);
        assert!(!b.path_ready(&pb), "nothing came in yet");
        b.poll_aux();
        assert!(!known_not_ready(&b, &pb), "ingress touched b's socket");
        assert!(b.path_ready(&pb), "a socket that received data is ready");
        let mut buf = [0u8; 64];
        match b.read(&mut pb, &mut buf) {
            Read::Data(d) => assert_eq!(d, b"hello"),
            _ => panic!("the bytes read back"),
        }
        assert!(!b.path_ready(&pb), "drained");
        assert!(known_not_ready(&b, &pb));
        // Its ACK touches a's socket (a's egress dispatched it too): a asks again, still idle.
        a.poll_aux();
        assert!(!known_not_ready(&a, &pa));
        assert!(!a.path_ready(&pa));
        for _ in 0..10 {
            pass(&mut a, &mut b, &clock);
        }
        assert!(!a.path_ready(&pa) && !b.path_ready(&pb));

        // The peer's FIN: b's receive half closes, the path is ready (its close is input).
        a.close(pa, false);
        for _ in 0..10 {
            pass(&mut a, &mut b, &clock);
            if b.path_ready(&pb) {
                break;
            }
        }
        assert!(b.path_ready(&pb), "a peer's close makes the path ready");
        assert!(matches!(b.read(&mut pb, &mut buf), Read::Closed));
    }

    /// Our own abort (`&mut` access, no touched mark yet) makes a known not-ready path ready.
    #[test]
    fn utcp_abort_clears_not_ready() {
        let (mut a, mut b, pa, _pb, clock) = pair();
        assert!(!a.path_ready(&pa));
        assert!(known_not_ready(&a, &pa));
        a.abort_switch().trip();
        a.poll_aux();
        assert!(
            a.path_ready(&pa),
            "an aborted socket is ready (its close is input)"
        );
        pass(&mut a, &mut b, &clock);
    }

    /// A socket in a closed path's slot is not known not ready: a new path there is ready
    /// until it is up (connect progress) and then found idle on its own.
    #[test]
    fn utcp_slot_reuse_clears_not_ready() {
        let (mut a, mut b, pa, _pb, clock) = pair();
        assert!(!a.path_ready(&pa));
        let (slot, bit) = (pa.handle, pa.bit);
        assert_ne!(bit, SocketMask::EMPTY);
        a.close(pa, true);
        for _ in 0..1000 {
            pass(&mut a, &mut b, &clock);
            if a.closing.is_empty() {
                break;
            }
        }
        assert!(
            a.closing.is_empty(),
            "the RST went out, the socket was reaped"
        );
        assert!(!a.not_ready.get().intersects(bit));
        // A stale bit (as if the reap had not cleared it): `add` clears it for the socket put
        // in the slot (a doorbell's here: no egress, so no touched mark, runs in between).
        a.not_ready.set(a.not_ready.get().union(bit));
        a.doorbell(A, B);
        assert_eq!(
            a.doorbells[0].0, slot,
            "the doorbell's socket took the freed slot"
        );
        assert!(!a.not_ready.get().intersects(bit));
        // A new path (in the next slot) is ready while it connects, then found idle.
        let mut pa = a.connect(A, B, 0).unwrap();
        assert!(!known_not_ready(&a, &pa));
        assert!(a.path_ready(&pa), "connecting");
        let mut up = false;
        for _ in 0..1000 {
            pass(&mut a, &mut b, &clock);
            if a.poll_connect(&mut pa) == ConnectPoll::Up {
                up = b.accept().is_some();
                if up {
                    break;
                }
            }
        }
        assert!(up);
        for _ in 0..10 {
            pass(&mut a, &mut b, &clock);
        }
        assert!(!a.path_ready(&pa));
        assert!(known_not_ready(&a, &pa));
    }

    /// Slots from 63 on have no bit of their own: never cached, always computed.
    #[test]
    fn utcp_high_slots_are_never_cached() {
        let clock = VirtualClock::new();
        let hub = Hub::with_clock(clock.clone());
        let small = |addr: u32| {
            let ip = Ipv4Addr::from(addr);
            let o = ip.octets();
            let mut cfg = UtcpConfig::new([0x02, 0, o[0], o[1], o[2], o[3]], ip, 8);
            cfg.seed = u64::from(addr);
            (cfg.rx_buf, cfg.tx_buf) = (4096, 4096);
            UtcpLink::with_clock(hub.port(), cfg, clock.clone())
        };
        let (mut a, mut b) = (small(A), small(B));
        // 8 listeners in slots 0..8, then the paths, 8 at a time (one handshake per listener):
        // 64 of them reach slot 71.
        let mut paths: Vec<UtcpPath> = Vec::new();
        for _ in 0..8 {
            let mut batch: Vec<UtcpPath> = (0..8).map(|k| a.connect(A, B, k).unwrap()).collect();
            let mut accepted = 0;
            for _ in 0..1000 {
                pass(&mut a, &mut b, &clock);
                while b.accept().is_some() {
                    accepted += 1;
                }
                for p in batch.iter_mut().filter(|p| !p.up) {
                    assert_ne!(a.poll_connect(p), ConnectPoll::Failed);
                }
                if accepted == batch.len() && batch.iter().all(|p| p.up) {
                    break;
                }
            }
            assert!(accepted == batch.len() && batch.iter().all(|p| p.up));
            paths.append(&mut batch);
        }
        for _ in 0..10 {
            pass(&mut a, &mut b, &clock);
        }
        let mut low = SocketMask::EMPTY;
        for p in &paths {
            assert!(!a.path_ready(p), "idle");
            low = low.union(p.bit);
        }
        assert!(
            paths.iter().any(|p| p.bit == SocketMask::EMPTY),
            "some in high slots"
        );
        assert_eq!(a.not_ready.get(), low, "only the low slots are remembered");
        for p in &paths {
            assert!(!a.path_ready(p), "still idle");
        }
    }
}
