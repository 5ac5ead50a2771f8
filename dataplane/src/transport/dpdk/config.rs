//! The `[dpdk]` section of rdsd's configuration (absent: no DPDK transport), parsed and
//! checked here, behind the transport's registration line (`transport::register`).

use crate::prefix::Prefix;
use crate::transport::Section;
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::net::Ipv4Addr;
use std::path::PathBuf;

/// The section as written.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDpdk {
    vdev: String,
    addr: String,
    #[serde(default)]
    gateway: String,
    #[serde(default = "d_lcores")]
    lcores: String,
    #[serde(default)]
    hugepages: bool,
    #[serde(default)]
    huge_dir: String,
    #[serde(default = "d_memory_mb")]
    memory_mb: u32,
    #[serde(default)]
    file_prefix: String,
    #[serde(default)]
    eal_args: Vec<String>,
    #[serde(default)]
    routes: Vec<String>,
    #[serde(default = "d_mbufs")]
    mbufs: u32,
    #[serde(default = "d_desc")]
    rx_desc: u16,
    #[serde(default = "d_desc")]
    tx_desc: u16,
    #[serde(default = "d_buf_kib")]
    buf_kib: u32,
    #[serde(default = "d_park_us")]
    park_us: u64,
    #[serde(default = "d_mtu")]
    mtu: u16,
    #[serde(default = "d_rto_min_ms")]
    rto_min_ms: u64,
    #[serde(default = "d_ack_delay_us")]
    ack_delay_us: u64,
    #[serde(default = "d_true")]
    check_kernel_addr: bool,
    /// Absent: false on memif, true on any other port.
    verify_checksums: Option<bool>,
    /// "cubic" or "none"; absent: "none" on memif, "cubic" on any other port.
    congestion_control: Option<String>,
    #[serde(default = "d_queues")]
    queues: u16,
}

fn d_queues() -> u16 {
    1
}

/// Most queue pairs `dpdk.queues` accepts (DPDK's af_packet driver takes 16).
pub const MAX_QUEUES: u16 = 16;

/// EAL refuses a main lcore outside the process's CPU set (a cgroup cpuset): the first CPU of it.
fn d_lcores() -> String {
    shm_api::sys::affinity_cpus()
        .first()
        .map_or_else(|| "0".into(), |c| c.to_string())
}
fn d_memory_mb() -> u32 {
    256
}
fn d_mbufs() -> u32 {
    8191
}
fn d_desc() -> u16 {
    1024
}
fn d_buf_kib() -> u32 {
    1280
}
fn d_mtu() -> u16 {
    9000
}
/// A request's ACK rides on its reply when the reply comes within this; a sender whose send
/// buffer is half used asks for its ACK at once (`RDS_FLAG_ACK_REQUIRED`), so it never waits
/// for the timer. 200 µs: many round trips of a datacenter wire (the kernel's floor,
/// `TCP_DELACK_MIN`, is 40 ms).
fn d_ack_delay_us() -> u64 {
    200
}
fn d_rto_min_ms() -> u64 {
    5
}
fn d_park_us() -> u64 {
    1000
}
fn d_true() -> bool {
    true
}

/// Smallest IP MTU `dpdk.mtu` accepts (IPv4's minimum datagram).
pub const MIN_MTU: u16 = 576;
/// Largest IP MTU `dpdk.mtu` accepts (a 9216-byte jumbo frame with VLAN tag and CRC).
pub const MAX_MTU: u16 = 9194;

/// The validated `[dpdk]` section.
#[derive(Clone, Debug)]
pub struct DpdkConfig {
    /// `--vdev` value, e.g. `net_af_packet0,iface=veth0`.
    pub vdev: String,
    /// The ethdev name (the vdev string up to its first comma).
    pub port_name: String,
    /// The port's IPv4 address.
    pub addr: Ipv4Addr,
    /// Its prefix length.
    pub prefix_len: u8,
    /// Default gateway for off-link peers.
    pub gateway: Option<Ipv4Addr>,
    /// EAL `-l` core list (EAL's main lcore; the poll thread stays where rdsd pins it).
    pub lcores: String,
    /// Hugepages (true) or `--no-huge` (false).
    pub hugepages: bool,
    /// `--huge-dir`, if given.
    pub huge_dir: Option<PathBuf>,
    /// `-m`: EAL memory in MiB (mempool and driver rings).
    pub memory_mb: u32,
    /// `--file-prefix` (default `rdsd-<pid>`).
    pub file_prefix: String,
    /// Further EAL arguments, verbatim.
    pub eal_args: Vec<String>,
    /// Destinations carried by this port.
    pub routes: Vec<Prefix>,
    /// Mbufs in the pool.
    pub mbufs: u32,
    /// Rx / tx descriptors.
    pub rx_desc: u16,
    /// Tx descriptors.
    pub tx_desc: u16,
    /// Per-path TCP send and receive buffer, bytes.
    pub buf_bytes: usize,
    /// Longest park of an idle poll core (a port has no fd to wake it).
    pub park: std::time::Duration,
    /// Refuse to start if the port's address is also on a kernel interface.
    pub check_kernel_addr: bool,
    /// IP MTU asked of the port; it gets the largest it supports up to this (jumbo frames
    /// where the port allows).
    pub mtu: u16,
    /// Floor of TCP's retransmission timeout (smoltcp's, patched: `dataplane/vendor/smoltcp`).
    pub rto_min: std::time::Duration,
    /// TCP delayed-ACK timer (`None`: acknowledge in the pass that received the data).
    pub ack_delay: Option<std::time::Duration>,
    /// Verify received IPv4 and TCP checksums. Off by default on memif, a shared-memory
    /// channel to a process on this host: nothing between the two ends can corrupt a frame,
    /// and a peer that writes wrong bytes can as well write a right checksum. Checksums are
    /// always computed on transmit, for a peer that verifies.
    pub verify_checksums: bool,
    /// TCP congestion control (CUBIC) on the paths. Off by default on memif: shared memory
    /// with one process of this host has no network to congest, and the peer's receive window
    /// already bounds what is in flight; on any other port (af_packet may sit on a real NIC)
    /// it stays on.
    pub congestion_control: bool,
    /// On a memif port, the bytes one memif buffer holds (its `bsize`): the largest frame that
    /// crosses in one descriptor. rdsd adds `bsize=` to the vdev for an `mtu`-sized frame
    /// unless the vdev sets it; see [`DpdkConfig::memif_mtu`].
    pub memif_buffer: Option<u16>,
    /// On an af_packet port, the bytes of one packet-ring frame (its `framesz`, DPDK's default
    /// 2048 unless the vdev sets it). rdsd adds `framesz=` and `blocksz=` for an `mtu`-sized
    /// frame when 2048 is too small; see [`DpdkConfig::af_packet_mtu`].
    pub af_packet_frame: Option<u32>,
    /// Rx/tx queue pairs, one per poll thread that drives the port (the first `queues` poll
    /// threads; each owns the connections `config::conn_shard` gives it).
    pub queues: u16,
}

/// With `queues` > 1 a memif port's id is `id + queues * MEMIF_ID_QUEUES` (see `from_raw`).
pub const MEMIF_ID_QUEUES: u32 = 1 << 24;

/// The value of a vdev's `key=value` argument.
fn devarg(vdev: &str, key: &str) -> Option<String> {
    vdev.split(',').skip(1).find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

/// What a frame adds to its IP packet in a memif buffer: the Ethernet header and a VLAN tag
/// (no CRC crosses memif).
const MEMIF_FRAME_OVERHEAD: u16 = 14 + 4;

/// The `bsize` rdsd gives a memif port for frames of IP MTU `mtu`: whole cache lines.
fn memif_buffer_for(mtu: u16) -> u16 {
    (mtu + MEMIF_FRAME_OVERHEAD).next_multiple_of(64)
}

/// What an af_packet ring frame holds before the Ethernet header: the kernel's TPACKET2
/// header and address, aligned (the received frame starts at `TPACKET_ALIGN(TPACKET2_HDRLEN +
/// 16) - 14` = 66), plus the Ethernet header itself: IP MTU = `framesz` - 80.
const AF_PACKET_FRAME_HEAD: u32 = 80;
/// DPDK 22.11's af_packet `framesz` when the vdev gives none.
const AF_PACKET_DEFAULT_FRAME: u32 = 2048;

/// `framesz=` and `blocksz=` for frames of IP MTU `mtu`. The kernel wants a block of whole
/// pages holding whole frames, and DPDK's driver addresses frame `i` at `i * framesz`, so a
/// block must also be a multiple of the frame, with nothing between frames: frames of whole
/// 2 KiB units, blocks of one frame (a multiple of 4 KiB) or two.
fn af_packet_ring_for(mtu: u16) -> (u32, u32) {
    let frame = (u32::from(mtu) + AF_PACKET_FRAME_HEAD).next_multiple_of(2048);
    let block = if frame.is_multiple_of(4096) {
        frame
    } else {
        2 * frame
    };
    (frame, block)
}

/// EAL options of DPDK 22.11 (`dpdk-app --help`), to name a bad one in `eal_args` before EAL
/// rejects the lot with a bare EINVAL.
const EAL_OPTIONS: &[&str] = &[
    "-c",
    "-l",
    "--lcores",
    "-s",
    "-S",
    "--main-lcore",
    "--service-corelist",
    "-n",
    "-r",
    "-b",
    "-a",
    "--block",
    "--allow",
    "--vdev",
    "-d",
    "--no-pci",
    "-m",
    "--in-memory",
    "--iova-mode",
    "--huge-dir",
    "--file-prefix",
    "--socket-mem",
    "--socket-limit",
    "--huge-unlink",
    "--no-huge",
    "--no-shconf",
    "--proc-type",
    "--log-level",
    "--syslog",
    "--legacy-mem",
    "--single-file-segments",
    "--match-allocations",
    "--base-virtaddr",
    "--create-uio-dev",
    "--vfio-intr",
    "--vfio-vf-token",
    "--telemetry",
    "--no-telemetry",
    "--force-max-simd-bitwidth",
    "-v",
    "--mbuf-pool-ops-name",
    "--trace",
    "--trace-dir",
    "--trace-bufsz",
    "--trace-mode",
    "--no-hpet",
    "--vmware-tsc-map",
    "--huge-worker-stack",
];

impl Section for DpdkConfig {
    fn parse(table: toml::Table) -> Result<DpdkConfig> {
        let raw: RawDpdk = table.try_into().context("invalid configuration")?;
        DpdkConfig::from_raw(raw)
    }

    /// The port's address: apps bind it.
    fn local_addrs(&self) -> Vec<Prefix> {
        vec![self.local_prefix()]
    }
}

impl DpdkConfig {
    /// Validates the section; every error names its key.
    pub fn from_raw(r: RawDpdk) -> Result<DpdkConfig> {
        let port_name = r.vdev.split(',').next().unwrap_or("").trim().to_string();
        if !port_name.starts_with("net_") || port_name.contains(char::is_whitespace) {
            bail!(
                "dpdk.vdev {:?}: expected a virtual net device such as \
                 \"net_af_packet0,iface=veth0\" or \"net_memif0,role=server\"",
                r.vdev
            );
        }
        let p: Prefix = r.addr.parse().with_context(|| {
            format!(
                "dpdk.addr {:?} (an address with its prefix, e.g. \"10.1.0.1/24\")",
                r.addr
            )
        })?;
        if !r.addr.contains('/') || p.len == 0 || p.addr.is_unspecified() {
            bail!("dpdk.addr {:?}: give the port's address with its prefix length, e.g. \"10.1.0.1/24\"", r.addr);
        }
        let gateway = match r.gateway.as_str() {
            "" => None,
            g => {
                let gw: Ipv4Addr = g.parse().with_context(|| format!("dpdk.gateway {g:?}"))?;
                if !p.contains(gw) {
                    bail!("dpdk.gateway {gw} is not on the port's subnet {}", r.addr);
                }
                Some(gw)
            }
        };
        if r.lcores.is_empty()
            || !r
                .lcores
                .chars()
                .all(|c| c.is_ascii_digit() || ",-@()".contains(c))
        {
            bail!(
                "dpdk.lcores {:?}: an EAL core list such as \"0\" or \"2-3\"",
                r.lcores
            );
        }
        for a in &r.eal_args {
            let name = a.split('=').next().unwrap_or("");
            if a.starts_with('-') && !EAL_OPTIONS.contains(&name) {
                bail!("dpdk.eal_args: {name:?} is not an EAL option of DPDK 22.11");
            }
            if name == "--no-pci" || name == "--vdev" || name == "--file-prefix" {
                bail!("dpdk.eal_args: {name} is set by rdsd (use dpdk.vdev / dpdk.file_prefix)");
            }
        }
        if r.file_prefix.contains('/') || r.file_prefix.contains(char::is_whitespace) {
            bail!("dpdk.file_prefix {:?}: no slashes or spaces", r.file_prefix);
        }
        if !r.hugepages && !r.huge_dir.is_empty() {
            bail!("dpdk.huge_dir is set but dpdk.hugepages = false (EAL would run with --no-huge)");
        }
        if r.memory_mb < 16 {
            bail!("dpdk.memory_mb must be at least 16 (got {})", r.memory_mb);
        }
        if r.mbufs < 1024 {
            bail!("dpdk.mbufs must be at least 1024 (got {})", r.mbufs);
        }
        if !(64..=4096).contains(&r.rx_desc) || !(64..=4096).contains(&r.tx_desc) {
            bail!("dpdk.rx_desc and dpdk.tx_desc must be 64..=4096");
        }
        if !(16..=16384).contains(&r.buf_kib) {
            bail!("dpdk.buf_kib must be 16..=16384 (got {})", r.buf_kib);
        }
        if !(MIN_MTU..=MAX_MTU).contains(&r.mtu) {
            bail!(
                "dpdk.mtu must be {MIN_MTU}..={MAX_MTU} (got {}; 1500 for standard frames, \
                 9000 for jumbo frames)",
                r.mtu
            );
        }
        if !(1..=1000).contains(&r.rto_min_ms) {
            bail!("dpdk.rto_min_ms must be 1..=1000 (got {})", r.rto_min_ms);
        }
        if r.ack_delay_us >= r.rto_min_ms.saturating_mul(1000) {
            // The peer would resend a lone message before our ACK leaves.
            bail!(
                "dpdk.ack_delay_us must be below rto_min_ms ({} µs; got {})",
                r.rto_min_ms * 1000,
                r.ack_delay_us
            );
        }
        if !(1..=100_000).contains(&r.park_us) {
            bail!("dpdk.park_us must be 1..=100000 (got {})", r.park_us);
        }
        let net = Prefix {
            addr: Ipv4Addr::from(u32::from(p.addr) & (u32::MAX << (32 - p.len))),
            len: p.len,
        };
        let routes = if r.routes.is_empty() {
            let mut v = vec![net];
            if gateway.is_some() {
                v.push("0.0.0.0/0".parse()?);
            }
            v
        } else {
            r.routes
                .iter()
                .map(|s| s.parse().with_context(|| format!("dpdk.routes {s:?}")))
                .collect::<Result<Vec<Prefix>>>()?
        };
        let verify_checksums = r
            .verify_checksums
            .unwrap_or(!port_name.starts_with("net_memif"));
        let congestion_control = match r.congestion_control.as_deref() {
            None => !port_name.starts_with("net_memif"),
            Some("cubic") => true,
            Some("none") => false,
            Some(other) => {
                bail!("dpdk.congestion_control must be \"cubic\" or \"none\" (got {other:?})")
            }
        };
        if !(1..=MAX_QUEUES).contains(&r.queues) {
            bail!("dpdk.queues must be 1..={MAX_QUEUES} (got {})", r.queues);
        }
        let mut r = r;
        if port_name.starts_with("net_af_packet") {
            // af_packet opens one packet socket per queue pair (`qpairs`, fanned out by the
            // kernel's flow hash; rdsd steers each frame to its connection's owner).
            match devarg(&r.vdev, "qpairs") {
                Some(q) if q.parse::<u16>().ok() != Some(r.queues) => bail!(
                    "dpdk.vdev sets qpairs={q} but dpdk.queues = {} (leave qpairs out: rdsd \
                     sets it)",
                    r.queues
                ),
                Some(_) => {}
                None if r.queues > 1 => {
                    r.vdev = format!("{},qpairs={}", r.vdev.trim_end_matches(','), r.queues)
                }
                None => {}
            }
        }
        if port_name.starts_with("net_af_xdp") {
            // One AF_XDP socket per queue pair, on the interface's queues `start_queue` on.
            match devarg(&r.vdev, "queue_count") {
                Some(q) if q.parse::<u16>().ok() != Some(r.queues) => bail!(
                    "dpdk.vdev sets queue_count={q} but dpdk.queues = {} (leave queue_count \
                     out: rdsd sets it)",
                    r.queues
                ),
                Some(_) => {}
                None if r.queues > 1 => {
                    r.vdev = format!("{},queue_count={}", r.vdev.trim_end_matches(','), r.queues)
                }
                None => {}
            }
            // DPDK's af_xdp asks the kernel for preferred busy polling by default and then
            // makes a `recvfrom` on every rx burst (about 40 per message); the poll thread
            // already polls the rings, so none unless the vdev asks.
            if devarg(&r.vdev, "busy_budget").is_none() {
                r.vdev = format!("{},busy_budget=0", r.vdev.trim_end_matches(','));
            }
        }
        if port_name.starts_with("net_memif") && r.queues > 1 {
            // DPDK 22.11's memif server accepts a client with fewer rings than its own queues
            // and then transmits on rings that were never set up (their descriptors alias the
            // first ring's): shared-memory corruption. So the queue count is part of the memif
            // id, which both ends must match to connect: ends with different `queues` stay
            // apart (link down) instead.
            let id: u32 = match devarg(&r.vdev, "id") {
                None => 0,
                Some(v) => v
                    .parse()
                    .ok()
                    .filter(|&id| id < MEMIF_ID_QUEUES)
                    .with_context(|| {
                        format!(
                            "dpdk.vdev: memif id={v:?} must be below {MEMIF_ID_QUEUES} with \
                             dpdk.queues > 1"
                        )
                    })?,
            };
            let id = id + u32::from(r.queues) * MEMIF_ID_QUEUES;
            let rest: Vec<&str> = r
                .vdev
                .split(',')
                .filter(|kv| kv.split_once('=').is_none_or(|(k, _)| k.trim() != "id"))
                .collect();
            r.vdev = format!("{},id={id}", rest.join(",").trim_end_matches(','));
        }
        let (vdev, memif_buffer) = if port_name.starts_with("net_memif") {
            match devarg(&r.vdev, "bsize") {
                Some(v) => {
                    let b: u16 = v
                        .parse()
                        .ok()
                        .filter(|&b| b >= MIN_MTU + MEMIF_FRAME_OVERHEAD)
                        .with_context(|| {
                            format!(
                                "dpdk.vdev: memif bsize={v:?} must be {}..=65535 (bytes per memif \
                             buffer; leave it out and rdsd sizes it for dpdk.mtu)",
                                MIN_MTU + MEMIF_FRAME_OVERHEAD
                            )
                        })?;
                    (r.vdev, Some(b))
                }
                None => {
                    let b = memif_buffer_for(r.mtu);
                    (
                        format!("{},bsize={b}", r.vdev.trim_end_matches(',')),
                        Some(b),
                    )
                }
            }
        } else {
            (r.vdev, None)
        };
        let (vdev, af_packet_frame) = if port_name.starts_with("net_af_packet") {
            match devarg(&vdev, "framesz") {
                Some(v) => {
                    let f: u32 = v
                        .parse()
                        .ok()
                        .filter(|&f| f >= u32::from(MIN_MTU) + AF_PACKET_FRAME_HEAD)
                        .with_context(|| {
                            format!(
                                "dpdk.vdev: af_packet framesz={v:?} must be at least {} (bytes \
                                 per packet-ring frame; leave it out and rdsd sizes it for \
                                 dpdk.mtu)",
                                u32::from(MIN_MTU) + AF_PACKET_FRAME_HEAD
                            )
                        })?;
                    (vdev, Some(f))
                }
                None if u32::from(r.mtu) + AF_PACKET_FRAME_HEAD > AF_PACKET_DEFAULT_FRAME
                    && devarg(&vdev, "blocksz").is_none() =>
                {
                    let (f, b) = af_packet_ring_for(r.mtu);
                    (
                        format!("{},framesz={f},blocksz={b}", vdev.trim_end_matches(',')),
                        Some(f),
                    )
                }
                None => (vdev, Some(AF_PACKET_DEFAULT_FRAME)),
            }
        } else {
            (vdev, None)
        };
        Ok(DpdkConfig {
            vdev,
            port_name,
            addr: p.addr,
            prefix_len: p.len,
            gateway,
            lcores: r.lcores,
            hugepages: r.hugepages,
            huge_dir: (!r.huge_dir.is_empty()).then(|| PathBuf::from(r.huge_dir)),
            memory_mb: r.memory_mb,
            file_prefix: if r.file_prefix.is_empty() {
                format!("rdsd-{}", std::process::id())
            } else {
                r.file_prefix
            },
            eal_args: r.eal_args,
            routes,
            mbufs: r.mbufs,
            rx_desc: r.rx_desc,
            tx_desc: r.tx_desc,
            buf_bytes: r.buf_kib as usize * 1024,
            park: std::time::Duration::from_micros(r.park_us),
            check_kernel_addr: r.check_kernel_addr,
            mtu: r.mtu,
            rto_min: std::time::Duration::from_millis(r.rto_min_ms),
            ack_delay: (r.ack_delay_us > 0)
                .then(|| std::time::Duration::from_micros(r.ack_delay_us)),
            verify_checksums,
            congestion_control,
            memif_buffer,
            af_packet_frame,
            queues: r.queues,
        })
    }

    /// On a memif port, the IP MTU rdsd uses: `mtu`, or less if the vdev's `bsize` cannot
    /// hold such a frame. DPDK 22.11's memif driver reports a 1518-byte `max_rx_pktlen` to
    /// ethdev, a constant of the driver: its rings carry any frame of up to `bsize` bytes in
    /// one descriptor (copied on both sides), so rdsd sizes the buffers and mbufs for jumbo
    /// frames itself and leaves ethdev's MTU alone. A peer with smaller frames is no
    /// problem: each TCP end sends segments no larger than the other's MSS.
    pub fn memif_mtu(&self) -> Option<u16> {
        self.memif_buffer
            .map(|b| self.mtu.min(b.saturating_sub(MEMIF_FRAME_OVERHEAD)))
    }

    /// On an af_packet port, the largest IP MTU its packet rings carry: `mtu`, or less if the
    /// ring frame (`framesz`) cannot hold such a frame. The port's own MTU is the kernel
    /// interface's, which rdsd reads when it opens the port and never raises: DPDK 22.11's
    /// af_packet driver reports a 1518-byte `max_rx_pktlen` (a constant), so ethdev would
    /// refuse a larger MTU although the rings and the interface carry it. Set the interface's
    /// MTU (and its peer's, for a veth) to use jumbo frames.
    pub fn af_packet_mtu(&self) -> Option<u16> {
        self.af_packet_frame.map(|f| {
            let m = f
                .saturating_sub(AF_PACKET_FRAME_HEAD)
                .min(u32::from(u16::MAX)) as u16;
            self.mtu.min(m)
        })
    }

    /// The mbuf data room an af_packet port needs whatever the MTU: DPDK 22.11 refuses an rx
    /// queue whose mbufs cannot hold a whole ring frame (less the 32 bytes before the frame).
    pub fn af_packet_rx_room(&self) -> Option<u32> {
        self.af_packet_frame.map(|f| f.saturating_sub(32))
    }

    /// The af_packet port's kernel interface (`iface=`).
    pub fn af_packet_iface(&self) -> Option<String> {
        self.port_name
            .starts_with("net_af_packet")
            .then(|| devarg(&self.vdev, "iface"))
            .flatten()
    }

    /// The af_xdp port's kernel interface (`iface=`). Its MTU is the port's: rdsd reads it
    /// and never changes it (DPDK's af_xdp driver would set the kernel interface's MTU, and a
    /// veth refuses XDP above 3506 bytes, a frame in one page with XDP's headroom).
    pub fn af_xdp_iface(&self) -> Option<String> {
        self.port_name
            .starts_with("net_af_xdp")
            .then(|| devarg(&self.vdev, "iface"))
            .flatten()
    }

    /// Whether the port is a memif client (memif's default role), which connects to its
    /// server's socket.
    pub fn memif_client(&self) -> bool {
        self.port_name.starts_with("net_memif")
            && !self
                .vdev
                .split(',')
                .any(|kv| kv.trim().replace(' ', "") == "role=server")
    }

    /// The port's address as an RDS local prefix (/32).
    pub fn local_prefix(&self) -> Prefix {
        Prefix {
            addr: self.addr,
            len: 32,
        }
    }

    /// EAL's argv (`argv[0]` included).
    pub fn eal_argv(&self) -> Vec<String> {
        let mut v = vec![
            "rdsd".to_string(),
            "-l".into(),
            self.lcores.clone(),
            "--no-pci".into(),
            format!("--file-prefix={}", self.file_prefix),
            "--no-telemetry".into(),
            "-m".into(),
            self.memory_mb.to_string(),
        ];
        if self.hugepages {
            // No hugepage files: a SIGKILLed rdsd leaves none behind holding pages.
            v.push("--in-memory".into());
            if let Some(d) = &self.huge_dir {
                v.push(format!("--huge-dir={}", d.display()));
            }
        } else {
            // `--no-huge -m` is legacy memory, which `--in-memory` refuses; no shared files.
            v.push("--no-huge".into());
            v.push("--no-shconf".into());
        }
        if !self.eal_args.iter().any(|a| a.starts_with("--log-level")) {
            // EAL's start-up chatter at info level; warnings and errors still show.
            v.push("--log-level=lib.eal:warning".into());
        }
        v.push(format!("--vdev={}", self.vdev));
        v.extend(self.eal_args.iter().cloned());
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(extra: &str) -> Result<DpdkConfig> {
        let t = format!("vdev = \"net_af_packet0,iface=v0\"\naddr = \"10.9.0.1/24\"\n{extra}");
        let r: RawDpdk = toml::from_str(&t)?;
        DpdkConfig::from_raw(r)
    }

    /// The section with this `vdev` and the `extra` lines.
    fn cfg(vdev: &str, extra: &str) -> Result<DpdkConfig> {
        let r: RawDpdk = toml::from_str(&format!(
            "vdev = \"{vdev}\"\naddr = \"10.0.0.1/24\"\n{extra}"
        ))?;
        DpdkConfig::from_raw(r)
    }

    #[test]
    fn defaults_and_eal_arguments() {
        let c = raw("").unwrap();
        assert_eq!(c.port_name, "net_af_packet0");
        assert_eq!(c.mtu, 9000, "jumbo frames asked for by default");
        assert!(
            c.buf_bytes > 1 << 20,
            "a 1 MiB message fits a path's buffers"
        );
        assert_eq!(c.routes, vec!["10.9.0.0/24".parse::<Prefix>().unwrap()]);
        let a = c.eal_argv();
        for want in [
            "--no-pci",
            "--no-huge",
            "--no-shconf",
            "--vdev=net_af_packet0,iface=v0,framesz=10240,blocksz=20480",
        ] {
            assert!(a.iter().any(|x| x == want), "{want} in {a:?}");
        }
        assert!(a.iter().any(|x| x.starts_with("--file-prefix=rdsd-")));
        let c =
            raw("hugepages = true\nhuge_dir = \"/mnt/huge\"\ngateway = \"10.9.0.254\"").unwrap();
        assert!(!c.eal_argv().iter().any(|x| x == "--no-huge"));
        assert!(c.eal_argv().iter().any(|x| x == "--in-memory"));
        assert!(c.eal_argv().iter().any(|x| x == "--huge-dir=/mnt/huge"));
        assert_eq!(c.routes.len(), 2, "a gateway routes everything");
    }

    #[test]
    fn received_checksums_are_verified_except_on_memif_unless_told() {
        let cfg = |vdev: &str, extra: &str| cfg(vdev, extra).unwrap().verify_checksums;
        assert!(cfg("net_af_packet0,iface=v0", ""));
        assert!(cfg("net_tap0", ""));
        assert!(!cfg("net_memif0,role=server,socket=/tmp/m.sock", ""));
        assert!(cfg("net_memif0", "verify_checksums = true"));
        assert!(!cfg("net_af_packet0,iface=v0", "verify_checksums = false"));
    }

    #[test]
    fn congestion_control_is_off_on_memif_unless_told() {
        let cc = |vdev: &str, extra: &str| cfg(vdev, extra).map(|c| c.congestion_control);
        assert!(cc("net_af_packet0,iface=v0", "").unwrap());
        assert!(cc("net_tap0", "").unwrap());
        assert!(!cc("net_memif0,role=server,socket=/tmp/m.sock", "").unwrap());
        assert!(cc("net_memif0", "congestion_control = \"cubic\"").unwrap());
        assert!(!cc("net_af_packet0,iface=v0", "congestion_control = \"none\"").unwrap());
        let e = cc("net_tap0", "congestion_control = \"bbr\"").unwrap_err();
        assert!(
            format!("{e:#}").contains("dpdk.congestion_control"),
            "{e:#}"
        );
    }

    #[test]
    fn memif_buffers_are_sized_for_jumbo_frames_unless_the_vdev_says() {
        let c = cfg("net_memif0,role=server,socket=/tmp/m.sock", "").unwrap();
        assert_eq!(
            c.vdev,
            "net_memif0,role=server,socket=/tmp/m.sock,bsize=9024"
        );
        assert_eq!(c.memif_buffer, Some(9024));
        assert_eq!(c.memif_mtu(), Some(9000));
        assert!(c.eal_argv().iter().any(|a| a.ends_with(",bsize=9024")));
        // Standard frames asked for: standard buffers.
        let c = cfg("net_memif0", "mtu = 1500").unwrap();
        assert_eq!(
            (c.vdev.as_str(), c.memif_mtu()),
            ("net_memif0,bsize=1536", Some(1500))
        );
        // The vdev's own bsize bounds the MTU.
        let c = cfg("net_memif0,bsize=2048,role=client", "").unwrap();
        assert_eq!(c.vdev, "net_memif0,bsize=2048,role=client");
        assert_eq!(c.memif_mtu(), Some(2030));
        let e = format!("{:#}", cfg("net_memif0,bsize=100", "").unwrap_err());
        assert!(e.contains("bsize"), "{e}");
        // Other ports: nothing added.
        let c = cfg("net_tap0", "").unwrap();
        assert_eq!(
            (c.vdev.as_str(), c.memif_mtu(), c.af_packet_mtu()),
            ("net_tap0", None, None)
        );
    }

    #[test]
    fn af_packet_rings_are_sized_for_jumbo_frames_unless_the_vdev_says() {
        // 9000 + 80 bytes before the IP packet, in 2 KiB units; a block of two such frames
        // (whole pages, frames back to back).
        let c = cfg("net_af_packet0,iface=v0", "").unwrap();
        assert_eq!(
            c.vdev,
            "net_af_packet0,iface=v0,framesz=10240,blocksz=20480"
        );
        assert_eq!((c.af_packet_mtu(), c.memif_mtu()), (Some(9000), None));
        assert_eq!(c.af_packet_rx_room(), Some(10208));
        assert_eq!(af_packet_ring_for(4000), (4096, 4096));
        assert_eq!(c.af_packet_iface().as_deref(), Some("v0"));
        // Standard frames fit DPDK's default 2048-byte frame: nothing added.
        let c = cfg("net_af_packet0,iface=v0", "mtu = 1500").unwrap();
        assert_eq!(c.vdev, "net_af_packet0,iface=v0");
        assert_eq!(c.af_packet_mtu(), Some(1500));
        // The vdev's own framesz bounds the MTU; a blocksz alone is left to DPDK's framesz.
        let c = cfg("net_af_packet0,iface=v0,framesz=4096", "").unwrap();
        assert_eq!(c.vdev, "net_af_packet0,iface=v0,framesz=4096");
        assert_eq!(c.af_packet_mtu(), Some(4016));
        let c = cfg("net_af_packet0,iface=v0,blocksz=8192", "").unwrap();
        assert_eq!(c.vdev, "net_af_packet0,iface=v0,blocksz=8192");
        assert_eq!(c.af_packet_mtu(), Some(1968));
        let e = format!(
            "{:#}",
            cfg("net_af_packet0,iface=v0,framesz=100", "").unwrap_err()
        );
        assert!(e.contains("framesz"), "{e}");
    }

    #[test]
    fn several_queues_shape_the_vdev() {
        // memif: the count is part of the id, so that ends with different counts never
        // connect.
        let c = cfg(
            "net_memif0,role=server,id=3,socket=/tmp/m.sock",
            "queues = 2",
        )
        .unwrap();
        assert_eq!(
            c.vdev,
            format!(
                "net_memif0,role=server,socket=/tmp/m.sock,id={},bsize=9024",
                3 + 2 * MEMIF_ID_QUEUES
            )
        );
        assert_eq!(c.queues, 2);
        let c = cfg("net_memif0", "queues = 4").unwrap();
        assert_eq!(
            c.vdev,
            format!("net_memif0,id={},bsize=9024", 4 * MEMIF_ID_QUEUES)
        );
        assert!(cfg("net_memif0,id=16777216", "queues = 2").is_err());
        assert_eq!(
            cfg("net_memif0,id=7", "").unwrap().vdev,
            "net_memif0,id=7,bsize=9024"
        );
        // af_packet: a packet socket per queue pair.
        let c = cfg("net_af_packet0,iface=v0", "queues = 2\nmtu = 1500").unwrap();
        assert_eq!(c.vdev, "net_af_packet0,iface=v0,qpairs=2");
        assert!(cfg("net_af_packet0,iface=v0,qpairs=2", "queues = 2").is_ok());
        let e = format!(
            "{:#}",
            cfg("net_af_packet0,iface=v0,qpairs=4", "queues = 2").unwrap_err()
        );
        assert!(e.contains("qpairs") && e.contains("dpdk.queues"), "{e}");
        // af_xdp: an AF_XDP socket per queue, on the interface's queues from start_queue.
        // No receive syscall per rx burst (preferred busy polling) unless the vdev asks.
        let c = cfg("net_af_xdp0,iface=v0", "queues = 2").unwrap();
        assert_eq!(c.vdev, "net_af_xdp0,iface=v0,queue_count=2,busy_budget=0");
        assert_eq!(c.af_xdp_iface().as_deref(), Some("v0"));
        assert_eq!(
            cfg("net_af_xdp0,iface=v0,busy_budget=32", "").unwrap().vdev,
            "net_af_xdp0,iface=v0,busy_budget=32"
        );
        let e = format!(
            "{:#}",
            cfg("net_af_xdp0,iface=v0,queue_count=1", "queues = 2").unwrap_err()
        );
        assert!(
            e.contains("queue_count") && e.contains("dpdk.queues"),
            "{e}"
        );
    }

    #[test]
    fn errors_name_the_key() {
        let e = |x: &str| format!("{:#}", raw(x).unwrap_err());
        assert!(e("eal_args = [\"--bogus\"]").contains("--bogus"));
        assert!(e("eal_args = [\"--vdev=net_null0\"]").contains("--vdev"));
        assert!(e("lcores = \"zero\"").contains("dpdk.lcores"));
        assert!(e("gateway = \"10.8.0.1\"").contains("dpdk.gateway"));
        assert!(e("huge_dir = \"/x\"").contains("dpdk.huge_dir"));
        assert!(e("colour = 1").contains("colour"));
        assert!(e("mtu = 100").contains("dpdk.mtu"));
        assert!(e("rto_min_ms = 0").contains("dpdk.rto_min_ms"));
        assert!(e("ack_delay_us = 5000").contains("dpdk.ack_delay_us"));
        assert!(raw("ack_delay_us = 200").is_ok());
        let r: RawDpdk =
            toml::from_str("vdev = \"net_memif0,role=server\"\naddr = \"10.0.0.1/24\"").unwrap();
        let d = DpdkConfig::from_raw(r).unwrap();
        assert_eq!(
            d.ack_delay,
            Some(std::time::Duration::from_micros(200)),
            "the default"
        );
        let r: RawDpdk = toml::from_str(
            "vdev = \"net_memif0,role=server\"\naddr = \"10.0.0.1/24\"\nack_delay_us = 0",
        )
        .unwrap();
        assert_eq!(
            DpdkConfig::from_raw(r).unwrap().ack_delay,
            None,
            "0 turns it off"
        );
        assert!(e("mtu = 65000").contains("dpdk.mtu"));
        assert!(e("queues = 0").contains("dpdk.queues"));
        assert!(e("queues = 17").contains("dpdk.queues"));
        let r: RawDpdk = toml::from_str("vdev = \"eth0\"\naddr = \"10.0.0.1/24\"").unwrap();
        assert!(format!("{:#}", DpdkConfig::from_raw(r).unwrap_err()).contains("dpdk.vdev"));
        let r: RawDpdk = toml::from_str("vdev = \"net_null0\"\naddr = \"10.0.0.1\"").unwrap();
        assert!(format!("{:#}", DpdkConfig::from_raw(r).unwrap_err()).contains("dpdk.addr"));
    }
}
