//! The DPDK transport: RDS/TCP over userspace TCP (smoltcp) on a DPDK port, kernel bypass.
//!
//! It is the shared protocol layer over the userspace-TCP link over a DPDK device,
//! `Endpoint<UtcpLink<DpdkDevice>>`, exactly as the kernel-TCP transport is
//! `Endpoint<TcpLink>`; nothing of RDS is here. [`DpdkTransport`] only adds what a port without
//! a file descriptor needs: how an idle poll core parks, registering the poll thread with EAL,
//! and the port's counters.
//!
//! * **Set-up** (`eal.rs`), from the `[dpdk]` section (`config.rs`, `default.toml`): EAL with
//!   `-l <lcores> --no-pci --file-prefix=<unique> --in-memory --no-telemetry -m <MiB>`,
//!   `--no-huge` or hugepages (`--huge-dir`), `--vdev=<vdev>` and any `eal_args`; EAL's
//!   affinity change of the main thread is undone. `queues` rx/tx queue pairs (1 by default), a
//!   mempool of `mbufs` mbufs, the MAC from the port. The MTU: `mtu` (9000 by default, jumbo
//!   frames) capped by what the port says it takes (`rte_eth_dev_info`: `max_mtu`, and
//!   `max_rx_pktlen` for the whole frame), set with `rte_eth_conf.rxmode.mtu` and
//!   `rte_eth_dev_set_mtu`; the mbufs' data room is
//!   sized so a frame fits one mbuf; 1500 if the port refuses. DPDK 22.11's memif and
//!   af_packet both report a 1518-byte `max_rx_pktlen`, a constant of each driver and not of
//!   its rings, so on them rdsd sizes the rings itself and leaves ethdev's MTU alone:
//!   - memif: `bsize=` added to the vdev for an `mtu`-sized frame (unless the vdev sets it),
//!     the mbufs to match (`DpdkConfig::memif_mtu`);
//!   - af_packet: `framesz=` and `blocksz=` added for an `mtu`-sized frame when DPDK's
//!     default 2048-byte ring frame is too small (unless the vdev sets them), the mbufs to
//!     hold a whole ring frame, and the MTU capped by the kernel interface's, which rdsd reads
//!     and never changes (`DpdkConfig::af_packet_mtu`; set the veth's MTU, both ends, to
//!     9000 for jumbo frames);
//!   - af_xdp (`net_af_xdp0,iface=...`: an AF_XDP socket per queue, on the driver's XDP
//!     program): the kernel interface's MTU, never changed, capped at `AF_XDP_MAX_MTU` (1778:
//!     DPDK 22.11's af_xdp frames are 2048 bytes with XDP's 256-byte headroom in front, and
//!     larger frames vanish although the driver reports a `max_mtu` of 3542); `queue_count=`
//!     added for `queues` > 1 (the interface needs that many combined channels, `ethtool -l`;
//!     veth reports none, so on a veth DPDK 22.11's af_xdp takes one queue only, and several
//!     queues are untested here). Its XDP program takes
//!     every frame of the queue, so the kernel sees none of the port's traffic. Without a
//!     mounted bpffs, libxdp says so on stderr and loads the program without its dispatcher.
//!     Tests: `tests/tests/dpdk.rs::af_xdp_*` (both ways up to 1 MiB, against kernel TCP in
//!     both connect orders, no receive syscall, the receiver SIGKILLed mid-stream),
//!     `dpdk_startup.rs::af_xdp_*`.
//!
//!   A 64 KiB message then crosses in 8 frames instead of 45 (`tests/tests/dpdk_pass_cost.rs`:
//!   `a_64k_message_crosses_memif_in_jumbo_frames`,
//!   `a_64k_message_crosses_af_packet_in_jumbo_frames_on_a_jumbo_veth`); a peer with smaller
//!   frames is served by TCP's MSS.
//! * **Several poll threads** (`queues` = N > 1, at most the poll-thread count): the port gets
//!   N queue pairs and each of the first N poll threads drives one with an endpoint of its
//!   own (its smoltcp interface, connections, timers), owning the connections
//!   `config::conn_shard` gives it (a symmetric hash of the address pair, as kernel TCP's
//!   shards). A frame received on another thread's queue is handed to its owner (`steer.rs`;
//!   counted, `dpdk_steered`): af_packet (`qpairs=N`, which rdsd adds to the vdev) fans frames
//!   out by the kernel's flow hash, so many are; memif delivers on the queue the peer sent on,
//!   so with the same `queues` at both ends none are. memif ends must have the same count:
//!   DPDK 22.11's memif server accepts a client with fewer rings and then transmits on rings
//!   never set up (their descriptors alias the first ring's), so with `queues` > 1 rdsd makes
//!   the count part of the memif `id` (`id + queues * 2^24`), and ends that differ never
//!   connect (a client warns after 10 failed reconnects). Only queue 0's thread starts or
//!   restarts the port; the others burst behind its gate. The receive-state file is shared.
//!   Tests: `tests/tests/dpdk.rs` (`*_with_a_queue_pair_per_poll_thread*`),
//!   `tests/tests/dpdk_startup.rs` (memif with two queues, every start order).
//! * **Start-up order.** Either rdsd may start first. A memif client whose server is not
//!   there yet starts its port later, from the poll thread, and a memif client whose link
//!   stays down is restarted (memif connects only when a port starts); see `device.rs`.
//!   `tests/tests/dpdk_startup.rs` starts two rdsd in every order and requires an RDS ping
//!   answered within 2 s (before: a client started first made rdsd exit with "start:
//!   Operation not permitted", and a connection refused by a server not yet started left the
//!   link down for good).
//! * **No kernel address.** The port's address must not be on any kernel interface of the
//!   namespace: the kernel would see the port's TCP segments (af_packet and af_xdp share the
//!   interface with it), know no such connection, and reset it. rdsd checks at start-up
//!   and refuses to start (`check_kernel_addr = false` skips the check, for setups where the
//!   kernel cannot see the port's traffic).
//! * **Addresses and routes.** The port's address is added to `local_addrs` (apps bind it);
//!   the transport carries the port's subnet, or everything with a gateway, or `routes`. It
//!   comes before kernel TCP in routing order.
//! * **Parking.** A DPDK port has no descriptor to wait on, so an idle poll core cannot sleep
//!   until a frame arrives. With `idle = "spin"` it never parks (lowest latency; what a DPDK
//!   host should use). With `idle = "backoff"` it spins, yields, then parks for at most
//!   `park_us` (1 ms by default) and polls the port again: an idle rdsd then costs ~1000 wake-ups
//!   a second, and the first frame after an idle spell waits up to `park_us`.
//! * **Receive state** persists in its own file (`<state_file>` with extension
//!   `dpdk.rxseq`): the file is locked per endpoint.
//! * **Counters** (`dpdk_*` in `rdsctl stats`): the protocol layer's (`dpdk_delivered`, ...),
//!   the port's (`dpdk_rx_packets`, `dpdk_tx_bursts`, `dpdk_mbuf_alloc_failures`,
//!   `dpdk_tx_drops`, ...) and TCP's as seen on the wire (`dpdk_tcp_retransmits`,
//!   `dpdk_tcp_rto_retransmits`, `dpdk_tcp_rx_out_of_order`, `dpdk_tcp_zero_window_rx`, ...;
//!   see `wire.rs`).

//! * **Peer restarts.** A SIGKILLed rdsd on DPDK sends no FIN or RST (its TCP lived in the dead
//!   process), so the peer keeps the dead incarnation's paths until a keep-alive (1 s) draws a
//!   RST from the restarted stack, or the 10 s idle timeout. The userspace-TCP link binds
//!   source ports with `port % 8 == path` and announces SPORT_IDX, so the passive side maps
//!   each reconnected path to its own index whatever order the old paths die in (accept-order
//!   mapping mismapped them and stalled the stream in about half the runs of
//!   `dpdk_sender_rdsd_sigkilled_and_restarted`).
//!
//! # Known gaps
//!
//! * Jumbo frames on af_packet need the kernel interface's MTU raised by the operator (and the
//!   peer's, on a veth): rdsd takes the interface's MTU as it finds it.
//! * While the peer still holds a dead incarnation's path, the restarted side's connects for
//!   that path are refused and retried at once (the engine resets the backoff when TCP comes
//!   up): hundreds to thousands of refused connects a second for up to the 1 s keep-alive
//!   (`dpdk_accepts_refused` on the peer).
//! * The port is not stopped and EAL not cleaned up at exit (the process ends anyway); the
//!   hugepage path (`hugepages = true`) is untested here (no hugepages on the test machine).
//! * Connections, not paths, are what the queue pairs' threads share out: all paths of one
//!   peer are one thread's, so a host with one busy peer (memif, always one) loads one thread.
//!   Steering is software: a frame on the wrong queue costs a hand-over between cores.

pub mod config;
mod device;
mod eal;
pub mod steer;
pub mod wire;

pub use config::{DpdkConfig, RawDpdk};
pub use device::{DpdkDevice, PortCounters};
pub use eal::kernel_interface_with;
/// EAL and a started port without the rest of the transport: for tests that run the
/// userspace-TCP link over a real DPDK device (`dataplane/tests/userspace_tcp_dpdk.rs`).
pub use eal::{init as start_eal, open_port, Port};
pub use wire::TcpCounters;

use crate::config::Config;
use crate::protocol::{Endpoint, RxStateFile};
use crate::seam::{OutMsg, SendOutcome, Transport, Upcalls};
use crate::stats::Stats;
use crate::transport::utcp::{UtcpConfig, UtcpLink};
use std::net::Ipv4Addr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// The protocol layer over userspace TCP over a DPDK port.
pub type DpdkEndpoint = Endpoint<UtcpLink<DpdkDevice>>;

/// [`DpdkEndpoint`] as a transport: delegates everything, adds parking, thread registration
/// and the port's counters. (Every `Transport` method is forwarded explicitly: a method the
/// seam gains later with a default body must be added here too.)
pub struct DpdkTransport {
    ep: DpdkEndpoint,
    stats: Arc<Stats>,
    park: Duration,
    registered: bool,
}

/// Starts EAL and the port (the configuration has a `[dpdk]` section, `d`): one transport per
/// queue pair, for the first `d.queues` poll threads (`stats`: every poll thread's counters).
pub fn build(
    cfg: &Config,
    d: &DpdkConfig,
    stats: &[Arc<Stats>],
) -> anyhow::Result<Vec<DpdkTransport>> {
    if usize::from(d.queues) > stats.len() {
        anyhow::bail!(
            "dpdk.queues = {} but rdsd runs {} poll thread(s): one queue pair per poll thread \
             (add poll_cores, or lower dpdk.queues)",
            d.queues,
            stats.len()
        );
    }
    if d.check_kernel_addr {
        eal::check_kernel_address(d)?;
    }
    eal::init(d)?;
    let port = eal::open_port(d)?;
    let m = port.mac;
    tracing::info!(
        port = %d.port_name, addr = %d.addr, prefix = d.prefix_len,
        mac = %format!("{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}", m[0], m[1], m[2], m[3], m[4], m[5]),
        mtu = port.mtu, queues = port.queues, "DPDK port up"
    );
    if stats.len() > usize::from(port.queues) {
        // Not an error (a port with one queue pair works with any number of threads), but the
        // network then loads the first threads only: say how to spread it.
        tracing::warn!(
            queues = port.queues,
            poll_threads = stats.len(),
            "the network's connections (the DPDK port's, and kernel TCP's and RDMA's beside \
             it) run on the first {} of {} poll threads: set [dpdk] queues = {} to give each \
             thread a queue pair (memif: the same at both ends)",
            port.queues,
            stats.len(),
            stats.len()
        );
    }
    let steering =
        (port.queues > 1).then(|| Arc::new(steer::Steering::new(port.queues.into(), port.started)));
    // One state file for every queue's endpoint (a slot claim takes its lock).
    let state = RxStateFile::open_shared(&cfg.state_file.with_extension("dpdk.rxseq"))?;
    (0..port.queues)
        .zip(stats)
        .map(|(q, stats)| {
            // SAFETY: queue pair q is set up (queue 0's device starts the port), the pool is
            // never freed while rdsd runs, and only this device uses the queue pair.
            let mut dev = unsafe { DpdkDevice::new(port.id, q, port.pool, usize::from(port.mtu)) };
            if q == 0 {
                if !port.started {
                    dev.start_later();
                }
                if d.memif_client() {
                    dev.reconnect_when_down();
                }
            }
            if let Some(s) = &steering {
                dev.steer(s.clone());
            }
            if !d.verify_checksums {
                dev.skip_rx_checksums();
            }
            transport(cfg, d, dev, &port, state.clone(), stats)
        })
        .collect()
}

/// The transport of one queue pair.
fn transport(
    cfg: &Config,
    d: &DpdkConfig,
    dev: DpdkDevice,
    port: &Port,
    state: Arc<RxStateFile>,
    stats: &Arc<Stats>,
) -> anyhow::Result<DpdkTransport> {
    let mut ucfg = UtcpConfig::new(port.mac, d.addr, d.prefix_len);
    ucfg.gateway = d.gateway;
    ucfg.port = cfg.tcp_port;
    ucfg.rx_buf = d.buf_bytes;
    ucfg.tx_buf = d.buf_bytes;
    ucfg.rto_min = d.rto_min;
    ucfg.rto_initial = ucfg.rto_initial.max(d.rto_min);
    ucfg.ack_delay = d.ack_delay;
    ucfg.congestion_control = d.congestion_control;
    ucfg.zero_copy_min = cfg.tcp_zero_copy_min;
    // One listener per concurrent inbound handshake: all paths of a few peers at once.
    ucfg.listeners = usize::from(cfg.paths) * 2;
    let link = UtcpLink::new(dev, ucfg);
    let ep = crate::transport::endpoint_config("dpdk", &d.routes, cfg, &state);
    let ep = Endpoint::new(link, ep, stats.clone(), |s| &s.dpdk);
    Ok(DpdkTransport {
        ep,
        stats: stats.clone(),
        park: d.park,
        registered: false,
    })
}

impl DpdkTransport {
    /// The endpoint, for tests and diagnostics.
    pub fn endpoint(&self) -> &DpdkEndpoint {
        &self.ep
    }
}

impl Transport for DpdkTransport {
    fn name(&self) -> &'static str {
        "dpdk"
    }

    fn routes_to(&self, dest: Ipv4Addr) -> bool {
        self.ep.routes_to(dest)
    }

    fn send(&mut self, up: &mut dyn Upcalls, msg: OutMsg<'_>) -> SendOutcome {
        self.ep.send(up, msg)
    }

    fn zero_copy(&self) -> bool {
        self.ep.zero_copy()
    }

    fn zero_copy_min(&self) -> usize {
        self.ep.zero_copy_min()
    }

    fn region_attached(&mut self, id: u64, base: *const u8, len: usize) {
        self.ep.region_attached(id, base, len);
    }

    fn region_detached(&mut self, id: u64) {
        self.ep.region_detached(id);
    }

    fn poll(&mut self, up: &mut dyn Upcalls) -> usize {
        if !self.registered {
            // SAFETY: EAL is running; registering the calling thread has no other
            // precondition. A failure (no free lcore) only costs the cache. Once, on the poll
            // thread: an lcore id gives it the mempool's per-lcore cache (without one every
            // mbuf comes from the shared ring).
            let rc = unsafe { dpdk_sys::rte_thread_register() };
            if rc != 0 {
                tracing::warn!("rte_thread_register failed: mbufs without a per-lcore cache");
            }
            self.registered = true;
        }
        self.ep.poll(up)
    }

    fn cancel(&mut self, laddr: u32, sport: u16, dest: Option<(u32, u16)>) {
        self.ep.cancel(laddr, sport, dest)
    }

    fn local_congestion_changed(&mut self, laddr: u32) {
        self.ep.local_congestion_changed(laddr)
    }

    fn park_fds(&self, out: &mut Vec<libc::pollfd>) {
        self.ep.park_fds(out)
    }

    fn next_timeout(&self) -> Option<Duration> {
        // No descriptor wakes us when a frame arrives: park briefly, then poll the port.
        Some(
            self.ep
                .next_timeout()
                .map_or(self.park, |t| t.min(self.park)),
        )
    }

    fn snapshot(&mut self, out: &mut Vec<crate::seam::ConnSnapshot>, listed: &mut usize) {
        self.ep.snapshot(out, listed)
    }

    fn publish_counters(&self) {
        self.ep.publish_counters();
        let c = self.ep.link().device().counters();
        let p = &self.stats.dpdk_port;
        for (a, v) in [
            (&p.rx_packets, c.rx_packets),
            (&p.rx_bursts, c.rx_bursts),
            (&p.tx_packets, c.tx_packets),
            (&p.tx_bursts, c.tx_bursts),
            (&p.mbuf_alloc_failures, c.mbuf_alloc_failures),
            (&p.tx_drops, c.tx_drops),
            (&p.rx_drops, c.rx_drops),
            (&p.tcp_retransmits, c.tcp.retransmits),
            (&p.tcp_fast_retransmits, c.tcp.fast_retransmits),
            (&p.tcp_rto_retransmits, c.tcp.rto_retransmits),
            (&p.tcp_rx_out_of_order, c.tcp.rx_out_of_order),
            (&p.tcp_rx_duplicates, c.tcp.rx_duplicates),
            (&p.tcp_zero_window_rx, c.tcp.zero_window_rx),
            (&p.tcp_zero_window_tx, c.tcp.zero_window_tx),
            (&p.egress_runs, self.ep.link().egress_runs()),
            (&p.egress_sockets, self.ep.link().egress_visits()),
            (&p.egress_examined, self.ep.link().egress_examined()),
            (&p.ingress_examined, self.ep.link().ingress_examined()),
            (&p.steered, c.steered),
            (&p.steer_drops, c.steer_drops),
        ] {
            a.store(v, Ordering::Relaxed);
        }
    }
}
