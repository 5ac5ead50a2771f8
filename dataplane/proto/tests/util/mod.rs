//! A simulated two-host network for the general layer (in the spirit of quinn-proto's
//! `tests/util.rs` Pair): a virtual clock, two `Connection`s (10.0.0.1 is the active side),
//! and one simulated TCP connection per path that delivers bytes in random chunks after random
//! delays, reports acknowledgements lazily, and can be reset or restart a host.
//!
//! Model of TCP acknowledgement: an ack never covers bytes the receiving `Connection` has not
//! consumed yet (the receiver's kernel acks on receipt, and consumption is when rdsd reads),
//! and when a host restarts, everything it consumed is acked to its peer first (its kernel
//! FINs with the final ack). Bytes in flight on a reset connection are lost.
//!
//! Writes use either the copying `poll_transmit` or, with probability [`Faults::vectored_prob`],
//! the vectored `poll_transmit_slices` with a random frame limit and slice-array size, of
//! which the simulated socket takes a random prefix (possibly nothing, possibly ending inside
//! any header or payload); after every write the engine's stream offset must equal the bytes
//! the link carried.
//!
//! [`Pair::crash_restart`] models a crash instead: the peer learns no final acknowledgement,
//! and the restarted host can restore the receive state its I/O layer persisted
//! ([`PersistedRx`], updated on every delivery as the crate docs prescribe).

#![allow(dead_code)]

use rds_proto::rng::SplitMix64;
use rds_proto::wire::CongMap;
use rds_proto::wire::MAX_PATHS;
use rds_proto::{Config, Connection, Delivery, Event, Instant};
use std::collections::{BTreeMap, VecDeque};
use std::net::Ipv4Addr;
use std::time::Duration;

pub const ADDR_A: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
pub const ADDR_B: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);

/// Fault and timing knobs.
#[derive(Debug, Clone)]
pub struct Faults {
    /// Per step, chance that one random established link is reset.
    pub reset_prob: f64,
    /// Chance that a connect attempt fails.
    pub connect_fail_prob: f64,
    /// Largest one-way delay of a segment.
    pub max_delay: Duration,
    /// Largest number of bytes the "socket" takes per write / delivers per read.
    pub max_chunk: usize,
    /// Per step and direction, chance that the receiver's ack reaches the sender.
    pub ack_prob: f64,
    /// On a reset, the acks for bytes the receiver already consumed are lost too. Off, the
    /// sender learns them before it sees the reset (the usual TCP case: the receiver's kernel
    /// acks data before the application reads it).
    pub lose_acks_on_reset: bool,
    /// Per write, chance of using the vectored API (`poll_transmit_slices`, up to
    /// [`MAX_GATHER`] frames, random partial take) instead of the copying `poll_transmit`.
    pub vectored_prob: f64,
}

/// Most frames one simulated vectored write gathers, and slots of its slice array.
pub const MAX_GATHER: usize = 32;
const MAX_SLICES: usize = 2 * MAX_GATHER;

impl Default for Faults {
    fn default() -> Self {
        Faults {
            reset_prob: 0.0,
            connect_fail_prob: 0.0,
            max_delay: Duration::from_micros(200),
            max_chunk: 3000,
            ack_prob: 0.3,
            lose_acks_on_reset: true,
            vectored_prob: 0.5,
        }
    }
}

/// A message handed to a local socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivered {
    pub path: usize,
    pub sequence: u64,
    pub sport: u16,
    pub dport: u16,
    pub payload: Vec<u8>,
}

/// What an I/O layer persists (in a small shared-memory file) so that a restarted daemon can
/// call `Connection::restore_rx_state`: the peer generation and, per path, one past the last
/// sequence number delivered to a socket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PersistedRx {
    pub peer_generation: u32,
    pub next_rx_seq: [u64; MAX_PATHS],
}

impl PersistedRx {
    /// The update rule documented on `Connection::restore_rx_state`, applied once the message
    /// reached the socket.
    pub fn record(&mut self, d: &Delivery<'_>) {
        if d.peer_generation != 0 {
            if self.peer_generation != 0 && self.peer_generation != d.peer_generation {
                self.next_rx_seq = [0; MAX_PATHS];
            }
            self.peer_generation = d.peer_generation;
        }
        self.next_rx_seq[d.path] = d.sequence + 1;
    }

    /// After each call into the engine (and on `Event::PeerRestarted`): store the generation
    /// the engine knows; a change from another non-zero one means the stored numbers belong
    /// to the peer's previous incarnation. Idempotent with `record` having seen it already.
    pub fn sync_generation(&mut self, generation: u32) {
        if generation != 0 && generation != self.peer_generation {
            if self.peer_generation != 0 {
                self.next_rx_seq = [0; MAX_PATHS];
            }
            self.peer_generation = generation;
        }
    }
}

/// Hands a delivery to the application and persists its receive state.
fn deliver(delivered: &mut Vec<Delivered>, persisted: &mut PersistedRx, d: Delivery<'_>) {
    delivered.push(Delivered {
        path: d.path,
        sequence: d.sequence,
        sport: d.sport,
        dport: d.dport,
        payload: d.payload.to_vec(),
    });
    persisted.record(&d);
}

pub struct Host {
    pub conn: Connection<Vec<u8>>,
    pub config: Config,
    pub local_map: CongMap,
    /// Deliveries to local sockets, across restarts (the application's view).
    pub delivered: Vec<Delivered>,
    /// Tokens released, per incarnation merged.
    pub released: Vec<u64>,
    /// Every event seen (except Released), for assertions.
    pub events: Vec<Event>,
    pub restarts: u32,
    /// The receive state the I/O layer persisted, across restarts.
    pub persisted_rx: PersistedRx,
}

#[derive(Debug, Default)]
struct Pipe {
    segments: VecDeque<(Instant, Vec<u8>)>,
    written: u64,
    consumed: u64,
    ack_reported: u64,
}

#[derive(Debug)]
struct Link {
    /// Path index on host 0 and host 1.
    paths: [usize; 2],
    /// `pipes[i]` carries bytes from host i to host 1 - i.
    pipes: [Pipe; 2],
    /// Steps since the link was established.
    age: u32,
}

impl Link {
    /// Random resets only hit links that made some progress (or lived long), so that a high
    /// reset rate cannot livelock the 8 KiB congestion map every new connection starts with.
    fn resettable(&self) -> bool {
        let consumed: u64 = self.pipes.iter().map(|p| p.consumed).sum();
        (self.age >= 20 && consumed >= 100_000) || self.age >= 3_000
    }
}

pub struct Pair {
    pub now: Instant,
    pub rng: SplitMix64,
    pub hosts: [Host; 2],
    links: Vec<Link>,
    pub faults: Faults,
    port_counter: u16,
    /// Links whose two ends disagree about the path index (should stay 0 with SPORT_IDX).
    pub path_mismatches: u32,
    pub resets: u32,
    /// Vectored writes done, and how many of them took only part of the gathered bytes.
    pub vectored_writes: u64,
    pub partial_vectored_writes: u64,
    /// Most slices one vectored write gathered.
    pub max_gathered_slices: usize,
    buf: Vec<u8>,
}

/// `Connection::paths_with_work` holds every path with something to send or acknowledge
/// (debug builds also check it against the path's lists). Returns it.
pub fn check_work_mask(c: &Connection<Vec<u8>>) -> u8 {
    let mask = c.paths_with_work();
    for p in 0..MAX_PATHS {
        if c.has_pending_transmit(p) || c.unacked_messages(p) > 0 {
            assert_ne!(mask & 1 << p, 0, "path {p} has work outside {mask:#010b}");
        }
    }
    mask
}

pub fn config(local: Ipv4Addr, peer: Ipv4Addr, npaths: u8, generation: u32, seed: u64) -> Config {
    let mut c = Config::new(local, peer, generation, seed);
    c.npaths = npaths;
    c.sport_idx = true;
    c
}

impl Host {
    fn new(config: Config) -> Self {
        Host {
            conn: Connection::new(config.clone()).expect("valid config"),
            config,
            local_map: CongMap::new(),
            delivered: Vec::new(),
            released: Vec::new(),
            events: Vec::new(),
            restarts: 0,
            persisted_rx: PersistedRx::default(),
        }
    }
}

impl Pair {
    /// Two hosts offering `npaths` paths each, with SPORT_IDX.
    pub fn new(seed: u64, npaths: u8, faults: Faults) -> Self {
        let a = config(ADDR_A, ADDR_B, npaths, 0x1000_0001, seed ^ 0xa);
        let b = config(ADDR_B, ADDR_A, npaths, 0x2000_0002, seed ^ 0xb);
        Self::with_configs(seed, a, b, faults)
    }

    pub fn with_configs(seed: u64, a: Config, b: Config, faults: Faults) -> Self {
        Pair {
            now: Instant::from_nanos(1_000_000),
            rng: SplitMix64::new(seed),
            hosts: [Host::new(a), Host::new(b)],
            links: Vec::new(),
            faults,
            port_counter: 0,
            path_mismatches: 0,
            resets: 0,
            vectored_writes: 0,
            partial_vectored_writes: 0,
            max_gathered_slices: 0,
            buf: vec![0u8; 1 << 16],
        }
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (self.rng.next_u64() as f64 / u64::MAX as f64) < p
    }

    fn rand_range(&mut self, lo: usize, hi_inclusive: usize) -> usize {
        lo + self.rng.below((hi_inclusive - lo + 1) as u64) as usize
    }

    pub fn conn(&mut self, host: usize) -> &mut Connection<Vec<u8>> {
        &mut self.hosts[host].conn
    }

    /// Sends from `host`; returns the path or panics on a send error.
    pub fn send(
        &mut self,
        host: usize,
        sport: u16,
        dport: u16,
        payload: Vec<u8>,
        token: u64,
    ) -> usize {
        let now = self.now;
        self.hosts[host]
            .conn
            .send(now, sport, dport, payload, token)
            .expect("send accepted")
    }

    /// Drains and acts on every pending event of both hosts.
    pub fn process_events(&mut self) {
        loop {
            let mut any = false;
            for host in 0..2 {
                while let Some(event) = self.hosts[host].conn.poll_event() {
                    any = true;
                    self.handle_event(host, event);
                }
            }
            if !any {
                break;
            }
        }
    }

    fn handle_event(&mut self, host: usize, event: Event) {
        let now = self.now;
        let peer = 1 - host;
        match event {
            Event::Connect { path } => {
                self.hosts[host].events.push(event);
                let sport = self.tcp_source_port(host, path);
                if self.chance(self.faults.connect_fail_prob) {
                    self.hosts[host].conn.handle_path_down(now, path).unwrap();
                    return;
                }
                match self.hosts[peer].conn.handle_accepted(now, sport) {
                    Ok(peer_path) => {
                        if peer_path != path {
                            self.path_mismatches += 1;
                        }
                        let mut paths = [0; 2];
                        paths[host] = path;
                        paths[peer] = peer_path;
                        self.links.push(Link {
                            paths,
                            pipes: [Pipe::default(), Pipe::default()],
                            age: 0,
                        });
                        self.hosts[host].conn.handle_connected(now, path).unwrap();
                    }
                    Err(_) => self.hosts[host].conn.handle_path_down(now, path).unwrap(),
                }
            }
            Event::Doorbell => {
                self.hosts[host].events.push(event);
                let sport = self.tcp_source_port(host, 0);
                // The smaller side resets it and connects back.
                assert!(self.hosts[peer].conn.handle_accepted(now, sport).is_err());
            }
            Event::Close { path } => {
                self.hosts[host].events.push(event);
                match self.links.iter().position(|l| l.paths[host] == path) {
                    Some(i) => self.drop_link(i),
                    None => self.hosts[host].conn.handle_path_down(now, path).unwrap(),
                }
            }
            Event::Released { token, .. } => self.hosts[host].released.push(token),
            Event::PeerRestarted { new_generation, .. } => {
                self.hosts[host]
                    .persisted_rx
                    .sync_generation(new_generation);
                self.hosts[host].events.push(event);
            }
            other => self.hosts[host].events.push(other),
        }
    }

    fn tcp_source_port(&mut self, host: usize, path: usize) -> u16 {
        self.port_counter = self.port_counter.wrapping_add(1) % 2000;
        let base = 40000 + 8 * self.port_counter;
        if self.hosts[host].config.sport_idx {
            base + path as u16
        } else {
            base + self.rng.below(8) as u16
        }
    }

    /// Resets link `i`: bytes in flight are lost, both ends see the path go down.
    fn drop_link(&mut self, i: usize) {
        let link = self.links.swap_remove(i);
        let now = self.now;
        if !self.faults.lose_acks_on_reset {
            for host in 0..2 {
                self.hosts[host]
                    .conn
                    .handle_acked(link.paths[host], link.pipes[host].consumed);
            }
        }
        for host in 0..2 {
            self.hosts[host]
                .conn
                .handle_path_down(now, link.paths[host])
                .unwrap();
        }
    }

    /// Resets one random link, if any.
    pub fn reset_random_link(&mut self) {
        if !self.links.is_empty() {
            let i = self.rng.below(self.links.len() as u64) as usize;
            if !self.links[i].resettable() {
                return;
            }
            self.resets += 1;
            self.drop_link(i);
            self.process_events();
        }
    }

    /// Feeds raw bytes to `host` as if they arrived on its `path`.
    pub fn inject(&mut self, host: usize, path: usize, bytes: &[u8]) {
        let now = self.now;
        let h = &mut self.hosts[host];
        let (delivered, persisted) = (&mut h.delivered, &mut h.persisted_rx);
        h.conn
            .handle_stream_data(now, path, bytes, |d| deliver(delivered, persisted, d));
        h.persisted_rx.sync_generation(h.conn.peer_generation());
        self.process_events();
    }

    /// Resets every link that carries `path` on host 0.
    pub fn reset_path(&mut self, path: usize) {
        if let Some(i) = self.links.iter().position(|l| l.paths[0] == path) {
            self.drop_link(i);
            self.process_events();
        }
    }

    /// Replaces host `host`'s Connection with a fresh one (new generation), as after a daemon
    /// restart. Everything the host consumed is acknowledged to the peer first; then every
    /// link is reset.
    pub fn restart(&mut self, host: usize, new_generation: u32) {
        self.restart_with(host, new_generation, true, false);
    }

    /// Replaces host `host`'s Connection as after a daemon crash: every link is reset, bytes in
    /// flight are lost, and the peer learns nothing more about what the host consumed (its
    /// unreported acknowledgements are lost with the connections). With `restore`, the new
    /// Connection gets the receive state the host persisted (`restore_rx_state`).
    pub fn crash_restart(&mut self, host: usize, new_generation: u32, restore: bool) {
        self.restart_with(host, new_generation, false, restore);
    }

    fn restart_with(&mut self, host: usize, new_generation: u32, final_acks: bool, restore: bool) {
        let now = self.now;
        let peer = 1 - host;
        if final_acks {
            for link in &self.links {
                let consumed = link.pipes[peer].consumed;
                self.hosts[peer]
                    .conn
                    .handle_acked(link.paths[peer], consumed);
            }
        }
        while let Some(link) = self.links.pop() {
            self.hosts[peer]
                .conn
                .handle_path_down(now, link.paths[peer])
                .unwrap();
        }
        let mut config = self.hosts[host].config.clone();
        config.generation = new_generation;
        config.rng_seed = config.rng_seed.wrapping_add(0x5555);
        let h = &mut self.hosts[host];
        h.conn = Connection::new(config.clone()).unwrap();
        if restore {
            let saved = h.persisted_rx;
            h.conn
                .restore_rx_state(saved.peer_generation, saved.next_rx_seq);
        }
        h.config = config;
        h.restarts += 1;
        // The restarted daemon's sockets come back uncongested.
        h.local_map = CongMap::new();
        self.process_events();
    }

    /// Number of established links.
    pub fn link_count(&self) -> usize {
        self.links.len()
    }

    fn in_flight(&self) -> bool {
        self.links
            .iter()
            .any(|l| l.pipes.iter().any(|p| !p.segments.is_empty()))
    }

    fn transmit_pending(&self) -> bool {
        self.links
            .iter()
            .any(|l| (0..2).any(|h| self.hosts[h].conn.has_pending_transmit(l.paths[h])))
    }

    fn acks_pending(&self) -> bool {
        self.links
            .iter()
            .any(|l| l.pipes.iter().any(|p| p.ack_reported < p.consumed))
    }

    /// True when nothing is in flight, queued or unacknowledged.
    pub fn quiescent(&self) -> bool {
        !self.in_flight()
            && !self.transmit_pending()
            && !self.hosts.iter().any(|h| h.conn.has_pending_messages())
    }

    /// One simulation step: timers, events, writes, deliveries, acks, faults, clock.
    pub fn step(&mut self) {
        let now = self.now;
        for host in &self.hosts {
            check_work_mask(&host.conn);
        }
        for host in 0..2 {
            if self.hosts[host]
                .conn
                .poll_timeout()
                .is_some_and(|t| t <= now)
            {
                self.hosts[host].conn.handle_timeout(now);
            }
        }
        self.process_events();

        // Writes: each direction of each link takes a random number of bytes.
        for li in 0..self.links.len() {
            for host in 0..2 {
                let path = self.links[li].paths[host];
                let chunk = self.rand_range(1, self.faults.max_chunk);
                let delay = self.rng.below(self.faults.max_delay.as_nanos() as u64 + 1);
                let n = if self.chance(self.faults.vectored_prob) {
                    self.vectored_write(host, path, chunk)
                } else {
                    let h = &mut self.hosts[host];
                    h.conn
                        .poll_transmit(now, path, &h.local_map, &mut self.buf[..chunk])
                };
                let written = self.links[li].pipes[host].written + n as u64;
                assert_eq!(
                    self.hosts[host].conn.stream_offset(path),
                    written,
                    "host {host} path {path}: stream offset vs bytes on the link"
                );
                if n > 0 {
                    let pipe = &mut self.links[li].pipes[host];
                    let arrival = now + Duration::from_nanos(delay);
                    let arrival = pipe
                        .segments
                        .back()
                        .map_or(arrival, |(t, _)| arrival.max(*t));
                    pipe.segments.push_back((arrival, self.buf[..n].to_vec()));
                    pipe.written += n as u64;
                }
            }
        }
        self.process_events();

        // Deliveries, in random read sizes.
        let mut li = 0;
        while li < self.links.len() {
            for host in 0..2 {
                if li >= self.links.len() {
                    break;
                }
                let receiver = 1 - host;
                let path = self.links[li].paths[receiver];
                while self.links[li].pipes[host]
                    .segments
                    .front()
                    .is_some_and(|(t, _)| *t <= now)
                {
                    let (_, bytes) = self.links[li].pipes[host].segments.pop_front().unwrap();
                    let mut rest = &bytes[..];
                    while !rest.is_empty() {
                        let n = self.rand_range(1, self.faults.max_chunk).min(rest.len());
                        let h = &mut self.hosts[receiver];
                        let (delivered, persisted) = (&mut h.delivered, &mut h.persisted_rx);
                        h.conn.handle_stream_data(now, path, &rest[..n], |d| {
                            deliver(delivered, persisted, d)
                        });
                        h.persisted_rx.sync_generation(h.conn.peer_generation());
                        rest = &rest[n..];
                    }
                    self.links[li].pipes[host].consumed += bytes.len() as u64;
                }
            }
            li += 1;
        }
        self.process_events();

        // Lazy acknowledgements: any point between the last report and what was consumed.
        for li in 0..self.links.len() {
            for host in 0..2 {
                if !self.chance(self.faults.ack_prob) {
                    continue;
                }
                let pipe = &self.links[li].pipes[host];
                if pipe.ack_reported >= pipe.consumed {
                    continue;
                }
                let span = pipe.consumed - pipe.ack_reported;
                let ack = pipe.ack_reported + 1 + self.rng.below(span);
                self.links[li].pipes[host].ack_reported = ack;
                let path = self.links[li].paths[host];
                self.hosts[host].conn.handle_acked(path, ack);
            }
        }
        self.process_events();

        // A device that reads a written frame until it has arrived (as RDMA's posted SENDs,
        // `Config::hold_cancelled_written`): cancelled messages it may still be reading are
        // released once it is done. (Nothing to do for a host without the option.)
        for li in 0..self.links.len() {
            for host in 0..2 {
                let path = self.links[li].paths[host];
                if self.hosts[host].conn.holds_cancelled(path) {
                    let done = self.links[li].pipes[host].consumed;
                    self.hosts[host].conn.release_cancelled_read(path, done);
                }
            }
        }
        self.process_events();

        for link in &mut self.links {
            link.age += 1;
        }
        if self.chance(self.faults.reset_prob) {
            self.reset_random_link();
        }

        // Clock: small steps while busy, jump to the next timer or arrival when idle.
        let busy = self.transmit_pending() || self.acks_pending();
        let next_arrival = self
            .links
            .iter()
            .flat_map(|l| {
                l.pipes
                    .iter()
                    .filter_map(|p| p.segments.front().map(|(t, _)| *t))
            })
            .min();
        let next_timer = self
            .hosts
            .iter()
            .filter_map(|h| h.conn.poll_timeout())
            .min();
        let small = self.now + Duration::from_nanos(1 + self.rng.below(20_000));
        self.now = if busy {
            small
        } else {
            [next_arrival, next_timer]
                .into_iter()
                .flatten()
                .min()
                .map_or(small, |t| t.max(small))
        };
    }

    /// One `sendmsg` with the vectored API: gathers up to a random number of frames into a
    /// slice array of random size, and the socket takes a random prefix of at most `chunk`
    /// bytes (sometimes none: EAGAIN), copied to `self.buf`. Returns the bytes taken.
    fn vectored_write(&mut self, host: usize, path: usize, chunk: usize) -> usize {
        let now = self.now;
        let max_frames = self.rand_range(1, MAX_GATHER);
        let slots = self.rand_range(1, MAX_SLICES);
        let eagain = self.chance(0.05);
        let mut slices: [&[u8]; MAX_SLICES] = [&[]; MAX_SLICES];
        let h = &mut self.hosts[host];
        let got =
            h.conn
                .poll_transmit_slices(now, path, &h.local_map, max_frames, &mut slices[..slots]);
        assert!(got.slices <= slots);
        let slices = &slices[..got.slices];
        assert!(slices.iter().all(|s| !s.is_empty()), "empty slice returned");
        assert_eq!(slices.iter().map(|s| s.len()).sum::<usize>(), got.bytes);
        if got.bytes == 0 {
            return 0;
        }
        self.vectored_writes += 1;
        self.max_gathered_slices = self.max_gathered_slices.max(got.slices);
        let take = if eagain { 0 } else { chunk.min(got.bytes) };
        if take < got.bytes {
            self.partial_vectored_writes += 1;
        }
        let mut filled = 0;
        for s in slices {
            let n = s.len().min(take - filled);
            self.buf[filled..filled + n].copy_from_slice(&s[..n]);
            filled += n;
        }
        self.hosts[host].conn.advance_transmit(path, take);
        take
    }

    /// Steps until quiescent (after at least one step) or the step budget runs out.
    pub fn drive(&mut self, max_steps: usize) -> bool {
        for _ in 0..max_steps {
            self.step();
            if self.quiescent() {
                // Let remaining acks and events settle.
                self.step();
                if self.quiescent() {
                    return true;
                }
            }
        }
        false
    }

    /// The harness replaces a restarted host's Connection at once, with its probe queued; rdsd
    /// creates one on the first send or accept. Until opened it is the same as none, but its
    /// probe keeps `quiescent` false: opening it lets the probe out, so a run whose restart
    /// came after its last send still ends.
    pub fn reopen_after_restarts(&mut self) {
        let now = self.now;
        for host in 0..2 {
            if self.hosts[host].restarts > 0 {
                self.conn(host).open(now);
            }
        }
    }

    /// Steps for a span of virtual time.
    pub fn run_for(&mut self, span: Duration) {
        let end = self.now + span;
        while self.now < end {
            self.step();
        }
    }
}

/// A scripted application workload: flows (src host, sport, dport) sending numbered messages.
pub struct Workload {
    pub flows: Vec<Flow>,
}

pub struct Flow {
    pub host: usize,
    pub sport: u16,
    pub dport: u16,
    pub next_id: u64,
    pub remaining: u32,
    /// Ids accepted by `send`, with the incarnation (restart count) of the sender.
    pub sent: Vec<(u64, u32)>,
    /// Ids pending (not released) when the sender restarted.
    pub lost_on_restart: Vec<u64>,
    /// Ids below this were sent before the flow's last RDS_CANCEL_SENT_TO: each may be lost.
    pub cancelled_below: u64,
}

pub fn token(host: usize, flow: usize, id: u64) -> u64 {
    ((host as u64) << 56) | ((flow as u64) << 40) | id
}

pub fn payload_for(flow: usize, id: u64, len: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(len.max(16));
    p.extend_from_slice(&(flow as u64).to_be_bytes());
    p.extend_from_slice(&id.to_be_bytes());
    let fill = len.saturating_sub(16);
    p.extend((0..fill).map(|i| (id as usize + i) as u8));
    p
}

pub fn parse_payload(p: &[u8]) -> (usize, u64) {
    let flow = u64::from_be_bytes(p[0..8].try_into().unwrap()) as usize;
    let id = u64::from_be_bytes(p[8..16].try_into().unwrap());
    (flow, id)
}

impl Workload {
    /// `sockets_per_host` sockets on each host, each sending to `dests` ports of the peer.
    pub fn new(sockets_per_host: u16, dests: u16, per_flow: u32) -> Self {
        let mut flows = Vec::new();
        for host in 0..2 {
            for s in 0..sockets_per_host {
                for d in 0..dests {
                    flows.push(Flow {
                        host,
                        sport: 2000 + 37 * s + host as u16,
                        dport: 3000 + d,
                        next_id: 1,
                        remaining: per_flow,
                        sent: Vec::new(),
                        lost_on_restart: Vec::new(),
                        cancelled_below: 0,
                    });
                }
            }
        }
        Workload { flows }
    }

    /// Only `from`'s sockets send (to the other host).
    pub fn one_way(from: usize, sockets: u16, dests: u16, per_flow: u32) -> Self {
        let mut w = Self::new(sockets, dests, per_flow);
        w.flows.retain(|f| f.host == from);
        w
    }

    /// Whether some flow was delivered a message twice.
    pub fn has_duplicate(&self, pair: &Pair) -> bool {
        self.delivered(pair).values().any(|ids| {
            let mut sorted = ids.clone();
            sorted.sort_unstable();
            sorted.windows(2).any(|w| w[0] == w[1])
        })
    }

    pub fn done(&self) -> bool {
        self.flows.iter().all(|f| f.remaining == 0)
    }

    /// Sends one message on a random unfinished flow.
    pub fn send_one(&mut self, pair: &mut Pair, max_len: usize) {
        let open: Vec<usize> = (0..self.flows.len())
            .filter(|&i| self.flows[i].remaining > 0)
            .collect();
        if open.is_empty() {
            return;
        }
        let fi = open[pair.rng.below(open.len() as u64) as usize];
        let len = if pair.rng.below(20) == 0 {
            pair.rng.below(40_000)
        } else {
            pair.rng.below(max_len as u64 + 1)
        } as usize;
        let flow = &mut self.flows[fi];
        let id = flow.next_id;
        flow.next_id += 1;
        flow.remaining -= 1;
        let incarnation = pair.hosts[flow.host].restarts;
        flow.sent.push((id, incarnation));
        let (host, sport, dport) = (flow.host, flow.sport, flow.dport);
        pair.send(
            host,
            sport,
            dport,
            payload_for(fi, id, len),
            token(host, fi, id),
        );
    }

    /// RDS_CANCEL_SENT_TO on a random flow that has sent something: what it sent so far may
    /// be lost (or delivered, if it was on its way).
    pub fn cancel_one(&mut self, pair: &mut Pair) {
        let started: Vec<usize> = (0..self.flows.len())
            .filter(|&i| !self.flows[i].sent.is_empty())
            .collect();
        if started.is_empty() {
            return;
        }
        let fi = started[pair.rng.below(started.len() as u64) as usize];
        let flow = &mut self.flows[fi];
        flow.cancelled_below = flow.next_id;
        pair.conn(flow.host).cancel_sent_to(flow.sport, flow.dport);
    }

    /// With cancels: per flow no duplicate and no reordering, nothing unknown, everything sent
    /// after the flow's last cancel delivered; every token released exactly once.
    pub fn check_exactly_once_but_cancelled(&self, pair: &Pair) {
        let delivered = self.delivered(pair);
        for (fi, flow) in self.flows.iter().enumerate() {
            let got = delivered.get(&fi).cloned().unwrap_or_default();
            let sent: Vec<u64> = flow.sent.iter().map(|&(id, _)| id).collect();
            check_increasing_and_known(fi, &got, &sent);
            for id in sent.iter().filter(|&&id| id >= flow.cancelled_below) {
                assert!(
                    got.contains(id),
                    "flow {fi}: id {id} (not cancelled) lost: {got:?}"
                );
            }
        }
        self.check_released_once(pair);
    }

    /// Records which of `host`'s messages were still unreleased just before it restarts.
    pub fn note_restart(&mut self, pair: &Pair, host: usize) {
        let released: std::collections::HashSet<u64> =
            pair.hosts[host].released.iter().copied().collect();
        for (fi, flow) in self.flows.iter_mut().enumerate() {
            if flow.host != host {
                continue;
            }
            for &(id, _) in &flow.sent {
                if !released.contains(&token(host, fi, id)) && !flow.lost_on_restart.contains(&id) {
                    flow.lost_on_restart.push(id);
                }
            }
        }
    }

    /// Delivered ids per flow, in delivery order, checking that ports match the flow.
    pub fn delivered(&self, pair: &Pair) -> BTreeMap<usize, Vec<u64>> {
        let mut out: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
        for host in 0..2 {
            for d in &pair.hosts[host].delivered {
                let (fi, id) = parse_payload(&d.payload);
                let flow = &self.flows[fi];
                assert_eq!(flow.host, 1 - host, "delivered on the wrong host");
                assert_eq!(
                    (flow.sport, flow.dport),
                    (d.sport, d.dport),
                    "ports mismatch"
                );
                out.entry(fi).or_default().push(id);
            }
        }
        out
    }

    /// Exactly once, in order, for every flow; every token released exactly once.
    pub fn check_exactly_once(&self, pair: &Pair) {
        let delivered = self.delivered(pair);
        for (fi, flow) in self.flows.iter().enumerate() {
            let sent: Vec<u64> = flow.sent.iter().map(|&(id, _)| id).collect();
            let got = delivered.get(&fi).cloned().unwrap_or_default();
            assert_eq!(
                got, sent,
                "flow {fi} ({}:{}->{})",
                flow.host, flow.sport, flow.dport
            );
        }
        self.check_released_once(pair);
    }

    /// Every token sent was released exactly once.
    pub fn check_released_once(&self, pair: &Pair) {
        for host in 0..2 {
            let mut released = pair.hosts[host].released.clone();
            released.sort_unstable();
            let mut expected: Vec<u64> = self
                .flows
                .iter()
                .enumerate()
                .filter(|(_, f)| f.host == host)
                .flat_map(|(fi, f)| f.sent.iter().map(move |&(id, _)| token(host, fi, id)))
                .collect();
            expected.sort_unstable();
            assert_eq!(released, expected, "host {host}: every token released once");
        }
    }

    /// No duplicate, no reordering, at most one gap, and only messages the restarted sender
    /// still held at its restart may be missing.
    pub fn check_restart_semantics(&self, pair: &Pair) {
        let delivered = self.delivered(pair);
        for (fi, flow) in self.flows.iter().enumerate() {
            let got = delivered.get(&fi).cloned().unwrap_or_default();
            let sent: Vec<u64> = flow.sent.iter().map(|&(id, _)| id).collect();
            check_increasing_and_known(fi, &got, &sent);
            let delivered_set: std::collections::HashSet<u64> = got.iter().copied().collect();
            let missing_positions: Vec<usize> = (0..sent.len())
                .filter(|&i| !delivered_set.contains(&sent[i]))
                .collect();
            for &i in &missing_positions {
                assert!(
                    flow.lost_on_restart.contains(&sent[i]),
                    "flow {fi}: id {} missing but its sender did not lose it (got {got:?})",
                    sent[i]
                );
            }
            if let (Some(first), Some(last)) = (missing_positions.first(), missing_positions.last())
            {
                assert_eq!(
                    last - first + 1,
                    missing_positions.len(),
                    "flow {fi}: more than one gap"
                );
            }
        }
    }
}

/// Flow `fi` got no duplicate, no reordering and nothing it did not send.
fn check_increasing_and_known(fi: usize, got: &[u64], sent: &[u64]) {
    assert!(
        got.windows(2).all(|w| w[0] < w[1]),
        "flow {fi}: duplicate or reorder: {got:?}"
    );
    for id in got {
        assert!(sent.contains(id), "flow {fi}: delivered unknown id {id}");
    }
}
