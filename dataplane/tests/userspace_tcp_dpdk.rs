//! The exactly-once suite (`suite/mod.rs`) over the userspace-TCP link on a real DPDK device
//! instead of the in-memory wire: two `net_memif` ports in this process (one memif server,
//! one client, joined by a socket file), each under a `UtcpLink<DpdkDevice>`, so the frames
//! go through DPDK's memif driver, mbufs and bursts. Plus path cuts (every socket of one side
//! aborted). No fault injection here (memif loses nothing); loss, duplication and reordering
//! are `userspace_tcp.rs`'s, on the in-memory wire. A real device runs on the real clock:
//! waits poll until what they wait for is seen, with a wall-clock deadline, and never sleep.
//!
//! One test in its own binary: EAL starts once per process. Needs root (EAL) and DPDK's memif
//! PMD (`librte-net-memif23`, pulled in by `libdpdk-dev`, which
//! `dataplane/install-build-deps.sh` installs); in CI (`CI` set) their absence fails the test.

mod suite;

use rdsd::protocol::MonotonicClock;
use rdsd::transport::dpdk::{open_port, start_eal, DpdkConfig, DpdkDevice, Port, RawDpdk};
use rdsd::transport::utcp::{AbortSwitch, UtcpConfig, UtcpLink};
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::time::Duration;
use suite::{run, suite, MakeLink, Run};

use rdsd::quiet::allocations;

#[global_allocator]
static ALLOC: rdsd::quiet::CountingAlloc = rdsd::quiet::CountingAlloc;

fn config(vdev: &str) -> DpdkConfig {
    let raw: RawDpdk = toml::from_str(&format!(
        "vdev = \"{vdev}\"\naddr = \"10.93.0.1/24\"\ncheck_kernel_addr = false\n\
         file_prefix = \"rdsd-utcp-dpdk-{}\"\n",
        std::process::id()
    ))
    .unwrap();
    DpdkConfig::from_raw(raw).unwrap()
}

/// Both sides' ports, opened once; a link is made on a port whenever the suite asks.
struct DpdkLab {
    ports: HashMap<u32, (u16, *mut dpdk_sys::rte_mempool, [u8; 6], u16)>,
    switches: HashMap<u32, AbortSwitch>,
    clock: MonotonicClock,
}

impl MakeLink for DpdkLab {
    type L = UtcpLink<DpdkDevice>;
    type C = MonotonicClock;
    fn clock(&self) -> MonotonicClock {
        self.clock
    }
    fn make(&mut self, addr: u32) -> UtcpLink<DpdkDevice> {
        let (id, pool, mac, mtu) = self.ports[&addr];
        // SAFETY: the port's queue pair 0 is started and its pool lives for the process; the
        // suite drops a side's link before it makes that side's next one, so one device at a
        // time uses the queue pair.
        let dev = unsafe { DpdkDevice::new(id, 0, pool, usize::from(mtu)) };
        let cfg = UtcpConfig::new(mac, Ipv4Addr::from(addr), 8);
        let link = UtcpLink::with_clock(dev, cfg, self.clock);
        self.switches.insert(addr, link.abort_switch());
        link
    }
    fn cut(&mut self, addr: u32) {
        if let Some(s) = self.switches.get(&addr) {
            s.trip();
        }
    }
}

fn prerequisites() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "the suite over DPDK memif needs root (EAL): run tests/run.sh as root"
    );
    eprintln!("\n*** not run: the suite over DPDK memif needs root (EAL) ***\n");
    false
}

#[test]
fn utcp_passes_the_exactly_once_suite_over_dpdk_memif() {
    if !prerequisites() {
        return;
    }
    let sock = std::env::temp_dir().join(format!("rdsd-utcp-memif-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&sock);
    let vdev = |n: u8, role: &str| {
        format!(
            "net_memif{n},role={role},id=0,socket={},socket-abstract=no",
            sock.display()
        )
    };
    let server = config(&vdev(0, "server"));
    let client = config(&vdev(1, "client"));
    let mut eal = server.clone();
    eal.eal_args.push(format!("--vdev={}", client.vdev));
    start_eal(&eal).unwrap_or_else(|e| {
        panic!("EAL with two memif ports: {e:#} (install DPDK's memif PMD: dataplane/install-build-deps.sh)")
    });
    let mut ports = HashMap::new();
    for (addr, cfg) in [(suite::A, &server), (suite::B, &client)] {
        let p: Port = open_port(cfg).unwrap_or_else(|e| panic!("{}: {e:#}", cfg.port_name));
        eprintln!(
            "{}: port {} mtu {} started {}",
            cfg.port_name, p.id, p.mtu, p.started
        );
        ports.insert(addr, (p.id, p.pool, p.mac, p.mtu));
    }
    let new_lab = || DpdkLab {
        ports: ports.clone(),
        switches: HashMap::new(),
        clock: MonotonicClock::new(),
    };
    suite(new_lab, "utcp-memif");
    let o = run(&mut new_lab(), Run::path_cut(), "utcp-memif-cut");
    assert_eq!(o.gaps, 0, "no gap after a path cut over memif");
    bursts_of_a_mib(&mut new_lab());
    ping_pong_allocates_nothing(&mut new_lab());
    let _ = std::fs::remove_file(&sock);
}

/// Writes `msg` on `from`'s path and polls both ends until `to` has read all of it.
fn one_way<L: rdsd::protocol::Link>(
    from: &mut L,
    to: &mut L,
    pf: &mut L::Path,
    pt: &mut L::Path,
    msg: &[u8],
    buf: &mut [u8],
    wait: &mut suite::Wait<MonotonicClock>,
) {
    use rdsd::protocol::{Read, Write};
    while !matches!(from.write(pf, &[msg]), Write::Wrote(n) if n == msg.len()) {
        from.poll_aux();
        to.poll_aux();
        wait.check();
    }
    let mut got = 0;
    while got < msg.len() {
        from.poll_aux();
        to.poll_aux();
        while let Read::Data(d) = to.read(pt, buf) {
            got += d.len();
        }
        wait.check();
    }
}

/// Steady state over the real device allocates nothing: 64 B messages back and forth through
/// the userspace-TCP link and the DPDK device (smoltcp's ingress and egress, the rx and tx
/// bursts, the wire counters, the link's reads in place), counted by this thread's allocator
/// once the first round trips have sized every buffer.
fn ping_pong_allocates_nothing(lab: &mut DpdkLab) {
    let mut a = lab.make(suite::A);
    let mut b = lab.make(suite::B);
    let clock = lab.clock;
    let (mut pa, mut pb) = suite::handshake(&mut a, &mut b, &clock, Duration::from_secs(10));
    let msg = [0x5au8; 64];
    let mut buf = vec![0u8; 1 << 16];
    let mut wait = suite::Wait::new(&clock, Duration::from_secs(20), "64 B ping-pong over memif");
    let mut round_trip = |wait: &mut suite::Wait<MonotonicClock>, buf: &mut [u8]| {
        one_way(&mut a, &mut b, &mut pa, &mut pb, &msg, buf, wait);
        one_way(&mut b, &mut a, &mut pb, &mut pa, &msg, buf, wait);
    };
    for _ in 0..200 {
        round_trip(&mut wait, &mut buf);
    }
    let before = allocations();
    for _ in 0..1000 {
        round_trip(&mut wait, &mut buf);
    }
    let made = allocations() - before;
    eprintln!("64 B ping-pong over memif: {made} allocations in 1000 round trips");
    assert_eq!(
        made, 0,
        "steady state over the DPDK device allocates nothing"
    );
}

/// One 1 MiB message from A to B over one path, counted in bursts: at most 32 frames per
/// receive burst, the sender's frames leave in bursts, and the receiver sends about one ACK
/// per receive burst (per pass), not one per segment.
fn bursts_of_a_mib(lab: &mut DpdkLab) {
    use rdsd::protocol::{Link, Read, Write};
    let mut a = lab.make(suite::A);
    let mut b = lab.make(suite::B);
    let clock = lab.clock;
    let (mut pa, mut pb) = suite::handshake(&mut a, &mut b, &clock, Duration::from_secs(10));
    let mut wait = suite::Wait::new(&clock, Duration::from_secs(10), "1 MiB over memif");
    let (a0, b0) = (a.device().counters(), b.device().counters());
    let msg = vec![0xa5u8; 1 << 20];
    let mut written = 0;
    let mut got = 0;
    let mut buf = vec![0u8; 1 << 16];
    while got < msg.len() {
        if written < msg.len() {
            if let Write::Wrote(n) = a.write(&mut pa, &[&msg[written..]]) {
                written += n;
            }
        }
        a.poll_aux();
        b.poll_aux();
        while let Read::Data(d) = b.read(&mut pb, &mut buf) {
            got += d.len();
        }
        wait.check();
    }
    let (a1, b1) = (a.device().counters(), b.device().counters());
    let (a_tx, a_txb) = (a1.tx_packets - a0.tx_packets, a1.tx_bursts - a0.tx_bursts);
    let (b_rx, b_rxb) = (b1.rx_packets - b0.rx_packets, b1.rx_bursts - b0.rx_bursts);
    let b_tx = b1.tx_packets - b0.tx_packets;
    eprintln!(
        "1 MiB over memif: sender {a_tx} frames in {a_txb} tx bursts ({:.1}/burst); receiver \
         {b_rx} frames in {b_rxb} rx bursts ({:.1}/burst), {b_tx} frames back (ACKs)",
        a_tx as f64 / a_txb.max(1) as f64,
        b_rx as f64 / b_rxb.max(1) as f64,
    );
    assert!(b_rx <= 32 * b_rxb, "at most 32 frames per receive burst");
    assert!(a_tx >= 2 * a_txb, "the sender's frames leave in bursts");
    assert!(
        b_tx <= b_rxb + 8,
        "about one ACK per receive burst: {b_tx} ACK frames for {b_rxb} bursts of {b_rx} frames"
    );
}
