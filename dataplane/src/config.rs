//! Configuration: an embedded default (`default.toml`), an optional TOML file laid over it, and
//! command-line flags laid over both. Unknown keys are errors, so typos don't pass silently.
//!
//! The top-level keys are the daemon's. A `[section]` belongs to a transport: this module keeps
//! it as written ([`Sections`]) and knows none of them; `transport::configure` hands each to
//! the transport registered for it, which parses and checks it (and refuses a section no
//! transport claims).

use crate::prefix::Prefix;
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;

/// The embedded default configuration.
pub const DEFAULT_TOML: &str = include_str!("default.toml");

/// The largest `backlog_share`: what all backlogs of one poll thread may hold.
pub const MAX_BACKLOG_SHARE: u64 = 64 << 20;

/// How a poll core waits when it has nothing to do.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum IdleMode {
    /// Spin, then yield, then park until an app or the control thread rings the doorbell.
    Backoff,
    /// Busy-poll forever: lowest latency, one full core.
    Spin,
    /// Backoff, except that no poll thread parks while an app thread sleeps in a receive on
    /// any of rdsd's sockets (they yield instead): such a thread is then woken by one kernel
    /// wake-up, not two (the poll thread's and its own), at the cost of the poll cores' CPU
    /// while it waits.
    Watch,
}

/// Whether app regions use hugetlbfs pages.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum HugepageMode {
    /// Hugetlbfs when pages are free, else 4 KiB pages with MADV_HUGEPAGE.
    Auto,
    /// Fail the attach if no hugetlbfs pages are free.
    Require,
    /// Never use hugetlbfs.
    Off,
}

/// Which mprds path a message takes (`path_choice`; see `rds_proto::PathChoice`).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum PathChoice {
    /// By the sending socket's port, as Linux: a socket's messages to one host stay in order
    /// whatever their destination ports.
    SourcePort,
    /// By the pair of ports (the default): a reply takes its request's path, so with several
    /// paths no message draws a pure ACK segment; order holds per (socket, destination).
    #[default]
    PortPair,
}

impl From<PathChoice> for rds_proto::PathChoice {
    fn from(c: PathChoice) -> Self {
        match c {
            PathChoice::SourcePort => rds_proto::PathChoice::SourcePort,
            PathChoice::PortPair => rds_proto::PathChoice::PortPair,
        }
    }
}

/// How an app's sockets are placed on the poll threads (`placement`).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// Each attachment (an app) on one poll thread, the one serving the fewest apps: one rank
    /// per core spreads over the threads, and a rank's sockets never cross between threads.
    #[default]
    App,
    /// A process's sockets spread over the poll threads, round-robin as they are opened: its
    /// library opens one attachment per poll thread as it needs them, each on the thread it
    /// asks for (a multi-threaded app, or any app under `librds_preload`, on every thread).
    Socket,
}

impl Placement {
    /// The wire code in the attach reply (`shm_api::ctrl::HelloInfo::placement`).
    pub fn code(self) -> u32 {
        match self {
            Placement::App => shm_api::ctrl::PLACEMENT_APP,
            Placement::Socket => shm_api::ctrl::PLACEMENT_SOCKET,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    control_socket: PathBuf,
    control_group: String,
    local_addrs: Vec<String>,
    control_core: i64,
    poll_cores: Vec<i64>,
    placement: Placement,
    idle: IdleMode,
    spin_us: u64,
    yield_us: u64,
    park_timeout_ms: u64,
    hugepages: HugepageMode,
    max_apps: u32,
    max_sockets_per_app: u32,
    tx_ring_bytes: u32,
    rx_ring_bytes: u32,
    tcp_port: u16,
    tcp_routes: Vec<String>,
    tcp_zero_copy_min: u32,
    paths: u8,
    path_choice: PathChoice,
    state_file: String,
    hello_timeout_ms: u64,
    control_timeout_ms: u64,
    rebind_grace_ms: u64,
    reply_timeout_ms: u64,
    max_apps_per_uid: u32,
    max_regions_per_uid: u32,
    backlog_share: u64,
    metrics_listen: String,
    trace_hops: bool,
    group_owners: Vec<String>,
}

/// rdsd's validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// Control socket path.
    pub control_socket: PathBuf,
    /// Group allowed to attach, if any.
    pub control_group: Option<String>,
    /// Local address prefixes.
    pub local_addrs: Vec<Prefix>,
    /// Control thread CPU (`None` = don't pin).
    pub control_core: Option<usize>,
    /// Poll thread CPUs; one poll thread each (`None` = don't pin that thread).
    pub poll_cores: Vec<Option<usize>>,
    /// How apps' sockets are placed on the poll threads.
    pub placement: Placement,
    /// Idle strategy.
    pub idle: IdleMode,
    /// Backoff: how long an idle core spins (`pause`) before it yields.
    pub spin: std::time::Duration,
    /// Backoff: how long it then yields the CPU between passes before it parks.
    pub yield_for: std::time::Duration,
    /// Backoff: longest park.
    pub park_timeout_ms: u64,
    /// Hugepage policy.
    pub hugepages: HugepageMode,
    /// Most attached processes.
    pub max_apps: u32,
    /// Socket slots per process.
    pub max_sockets_per_app: u32,
    /// Bytes of each tx ring.
    pub tx_ring_bytes: u32,
    /// Bytes of each rx ring.
    pub rx_ring_bytes: u32,
    /// TCP port of the RDS/TCP listener and of outgoing connections.
    pub tcp_port: u16,
    /// Destinations reached over kernel TCP.
    pub tcp_routes: Vec<Prefix>,
    /// Kernel and userspace TCP: messages of at least this many bytes are sent from the app's
    /// tx ring in place (no copy), their ring space held until TCP acknowledged them; `None`:
    /// every message is copied.
    pub tcp_zero_copy_min: Option<usize>,
    /// Paths offered per peer (mprds), 1..=8.
    pub paths: u8,
    /// Which path a message takes.
    pub path_choice: PathChoice,
    /// Where the receive sequence numbers survive a restart (see `protocol::RxStateFile`).
    pub state_file: PathBuf,
    /// A new control connection must send Hello within this time, or it is closed.
    pub hello_timeout: std::time::Duration,
    /// A command the poll core has not taken within this time is withdrawn and its app gets
    /// ETIMEDOUT (one it has taken is always waited for).
    pub control_timeout: std::time::Duration,
    /// A client whose control socket stays full (replies unread) this long is disconnected.
    pub reply_timeout: std::time::Duration,
    /// After a restart, messages for ports bound before it wait this long for an app to bind
    /// them again (0: dropped at once, as for any unbound port).
    pub rebind_grace: std::time::Duration,
    /// Most control connections (attached or not) of one uid.
    pub max_apps_per_uid: u32,
    /// Most app regions rdsd holds for one uid (attached, attaching, or not yet freed).
    pub max_regions_per_uid: u32,
    /// Bytes a socket's backlog may hold before its senders wait and its path pauses
    /// (`poll/backlog.rs`); 0: a full rx ring holds them up at once.
    pub backlog_share: u64,
    /// Where the Prometheus metrics endpoint listens (HTTP/1.0 `GET /metrics`); `None` = off.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Stamp traced messages at each hop of the poll core (`shm_api::hoptrace`): the latency
    /// breakdown of `rds-bench --breakdown`. Off: one flag test per message.
    pub trace_hops: bool,
    /// Multicast group addresses ordered by another host: `(groups, owner)`, the first match
    /// wins. A group outside every entry (or whose owner is a local address) is local.
    pub group_owners: Vec<(Prefix, Ipv4Addr)>,
    /// The transports' `[sections]`, as written (`[dpdk]`, `[rdma]`; none by default).
    pub sections: Sections,
}

/// The `[name]` tables of the configuration, each as written: the transport registered under
/// that name parses its own (`transport::configure`, then `transport::build`).
#[derive(Clone, Debug, Default)]
pub struct Sections {
    tables: BTreeMap<String, toml::Table>,
    configured: bool,
}

impl Sections {
    /// The section `[name]`, if the configuration has one.
    pub fn get(&self, name: &str) -> Option<&toml::Table> {
        self.tables.get(name)
    }

    /// The names of every section, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tables.keys().map(String::as_str)
    }

    /// Whether `transport::configure` has checked the sections (and added what they own, such
    /// as the DPDK port's address, to the configuration).
    pub fn configured(&self) -> bool {
        self.configured
    }

    /// Marks the sections as checked (`transport::configure`).
    pub fn set_configured(&mut self) {
        self.configured = true;
    }

    /// Takes the sections out of a configuration table: the tables whose key is not one of
    /// the daemon's (the embedded default names every one of those).
    fn split_from(table: &mut toml::Table, daemon_keys: &toml::Table) -> Sections {
        let names: Vec<String> = table
            .iter()
            .filter(|(k, v)| v.is_table() && !daemon_keys.contains_key(*k))
            .map(|(k, _)| k.clone())
            .collect();
        let mut tables = BTreeMap::new();
        for name in names {
            if let Some(toml::Value::Table(t)) = table.remove(&name) {
                tables.insert(name, t);
            }
        }
        Sections {
            tables,
            configured: false,
        }
    }
}

/// Command-line overrides (all optional).
#[derive(Clone, Debug, Default, clap::Args)]
pub struct Overrides {
    /// Control socket path.
    #[arg(long)]
    pub control_socket: Option<PathBuf>,
    /// Local address prefix (repeatable; replaces the configured list).
    #[arg(long = "local-addr")]
    pub local_addrs: Vec<String>,
    /// Poll-thread CPU (repeatable; -1 = the last CPU this process may use, -3 = the first,
    /// -2 = don't pin).
    #[arg(long = "poll-core", allow_hyphen_values = true)]
    pub poll_cores: Vec<i64>,
    /// Control-thread CPU (-1 = the last CPU this process may use, -3 = the first, -2 = don't
    /// pin).
    #[arg(long, allow_hyphen_values = true)]
    pub control_core: Option<i64>,
    /// How apps' sockets are placed on the poll threads: by app, or each process's sockets
    /// spread over them.
    #[arg(long, value_enum)]
    pub placement: Option<Placement>,
    /// Idle strategy.
    #[arg(long, value_enum)]
    pub idle: Option<IdleMode>,
    /// Hugepage policy.
    #[arg(long, value_enum)]
    pub hugepages: Option<HugepageMode>,
    /// Socket slots per process.
    #[arg(long)]
    pub max_sockets_per_app: Option<u32>,
    /// RDS/TCP port (listener and peers).
    #[arg(long)]
    pub tcp_port: Option<u16>,
    /// Smallest message sent in place from the app's tx ring over TCP, kernel or userspace
    /// (bytes; 0 = copy every message).
    #[arg(long)]
    pub tcp_zero_copy_min: Option<u32>,
    /// Paths offered per peer, 1..=8.
    #[arg(long)]
    pub paths: Option<u8>,
    /// Which path a message takes: by the pair of ports (default) or by the sender's port (as
    /// Linux).
    #[arg(long, value_enum)]
    pub path_choice: Option<PathChoice>,
    /// Receive-state file (default: next to the control socket, extension .rxseq).
    #[arg(long)]
    pub state_file: Option<PathBuf>,
    /// Serve Prometheus metrics over HTTP at ADDR:PORT ("" = off).
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// Stamp messages that carry a hop-trace block (rds-bench --breakdown) at each hop.
    #[arg(long)]
    pub trace_hops: bool,
    /// Bytes a socket's backlog may hold (a receiver whose rx ring is full) before its
    /// senders wait and its network path pauses; 0 = hold them up at once.
    #[arg(long)]
    pub backlog_share: Option<u64>,
    /// PREFIX=OWNER: multicast groups in PREFIX are ordered by host OWNER (repeatable;
    /// replaces the configured list).
    #[arg(long = "group-owner")]
    pub group_owners: Vec<String>,
}

fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        base.insert(k, v);
    }
}

/// A timeout key: 1 ms ..= 10 min.
fn ms(v: u64, key: &str) -> Result<std::time::Duration> {
    if v == 0 || v > 600_000 {
        bail!("{key} must be 1..=600000 (got {v})");
    }
    Ok(std::time::Duration::from_millis(v))
}

/// `PREFIX=OWNER` of `group_owners`: PREFIX inside 224.0.0.0/4, OWNER a unicast address.
fn parse_group_owner(e: &str) -> Result<(Prefix, Ipv4Addr)> {
    let (prefix, owner) = e
        .split_once('=')
        .with_context(|| format!("group_owners entry {e:?} is not PREFIX=OWNER"))?;
    let prefix: Prefix = prefix.trim().parse()?;
    let owner: Ipv4Addr = owner
        .trim()
        .parse()
        .with_context(|| format!("group_owners entry {e:?}: bad owner address"))?;
    if !prefix.addr.is_multicast() || prefix.len < 4 {
        bail!("group_owners entry {e:?}: the prefix must lie inside 224.0.0.0/4");
    }
    if owner.is_multicast() || owner.is_unspecified() || owner.is_broadcast() {
        bail!("group_owners entry {e:?}: the owner must be a host's unicast address");
    }
    Ok((prefix, owner))
}

/// `allowed` as a CPU list in taskset's notation ("0-3,8,10-11").
fn cpu_list(allowed: &[usize]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < allowed.len() {
        let mut j = i;
        while j + 1 < allowed.len() && allowed[j + 1] == allowed[j] + 1 {
            j += 1;
        }
        if !out.is_empty() {
            out.push(',');
        }
        if j == i {
            out += &allowed[i].to_string();
        } else {
            out += &format!("{}-{}", allowed[i], allowed[j]);
        }
        i = j + 1;
    }
    out
}

/// Addresses that `local_addrs` may not hold, and what they are.
const NOT_HOST_ADDRS: [(&str, &str); 3] = [
    ("0.0.0.0/8", "\"this network\" and bind()'s wildcard"),
    ("224.0.0.0/4", "multicast (group) addresses"),
    ("255.255.255.255/32", "the broadcast address"),
];

/// One CPU setting: a CPU of `allowed` (the process's CPU set), -1 (the last of them), -3 (the
/// first) or -2 (not pinned). Checked against the set, so rdsd never pins a thread where its
/// operator did not let it run.
fn core(n: i64, allowed: &[usize]) -> Result<Option<usize>> {
    match n {
        -2 => Ok(None),
        -1 => Ok(allowed.last().copied()),
        -3 => Ok(allowed.first().copied()),
        n if n >= 0 && allowed.contains(&(n as usize)) => Ok(Some(n as usize)),
        n if n >= 0 => bail!(
            "cpu {n} is not one this process may run on (its CPUs: {}; taskset, a cgroup \
             cpuset or systemd's CPUAffinity= set them)",
            cpu_list(allowed)
        ),
        n => bail!("cpu {n}: a CPU number, -1 (the last CPU), -3 (the first) or -2 (not pinned)"),
    }
}

/// The poll threads' CPUs: one each, so that no two spinning threads take turns on one CPU (a
/// scheduler slice at a time). Unpinned threads (`None`) may be any number.
fn poll_cpus(polls: &[i64], allowed: &[usize]) -> Result<Vec<Option<usize>>> {
    let cores = polls
        .iter()
        .map(|&n| core(n, allowed))
        .collect::<Result<Vec<_>>>()
        .context("poll_cores")?;
    if cores.is_empty() || cores.len() > shm_api::layout::MAX_POLL_THREADS {
        bail!(
            "poll_cores must name 1..={} poll threads (it has {})",
            shm_api::layout::MAX_POLL_THREADS,
            cores.len()
        );
    }
    for (k, c) in cores.iter().enumerate() {
        if let Some(j) = c.and_then(|c| cores[..k].iter().position(|&o| o == Some(c))) {
            bail!(
                "poll_cores pins poll threads {j} and {k} both to cpu {}: a poll thread keeps \
                 its CPU busy, so two on one would take turns a scheduler slice at a time; give \
                 each a CPU of its own, or -2 to leave them unpinned",
                c.unwrap_or_default()
            );
        }
    }
    Ok(cores)
}

impl Config {
    /// The embedded default, then `file` (if any), then `over`.
    pub fn load(file: Option<&std::path::Path>, over: &Overrides) -> Result<Config> {
        let default: toml::Table = DEFAULT_TOML.parse().context("embedded default config")?;
        let mut table = default.clone();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let t: toml::Table = text
                .parse()
                .with_context(|| format!("parsing {}", path.display()))?;
            merge(&mut table, t);
        }
        let sections = Sections::split_from(&mut table, &default);
        let raw: RawConfig = table.try_into().context("invalid configuration")?;
        Config::from_raw(raw, sections, over)
    }

    fn from_raw(raw: RawConfig, sections: Sections, over: &Overrides) -> Result<Config> {
        // Read before any thread pins itself: the process's own CPU set.
        let cpus = shm_api::sys::affinity_cpus();
        let addrs = if over.local_addrs.is_empty() {
            raw.local_addrs
        } else {
            over.local_addrs.clone()
        };
        let local_addrs = addrs
            .iter()
            .map(|s| s.parse())
            .collect::<Result<Vec<Prefix>>>()?;
        if local_addrs.is_empty() {
            bail!("local_addrs is empty: rdsd needs at least one local address");
        }
        // Host addresses only: 0.0.0.0 is bind()'s wildcard, multicast addresses name groups
        // (and `group_owners`), 255.255.255.255 is no host's.
        for p in &local_addrs {
            for (bad, what) in NOT_HOST_ADDRS {
                let bad: Prefix = bad.parse().expect("a valid prefix");
                if p.overlaps(&bad) {
                    bail!(
                        "local_addrs {}/{}: holds {what} ({}/{}), which no host owns",
                        p.addr,
                        p.len,
                        bad.addr,
                        bad.len
                    );
                }
            }
        }
        let polls = if over.poll_cores.is_empty() {
            raw.poll_cores
        } else {
            over.poll_cores.clone()
        };
        let poll_cores = poll_cpus(&polls, &cpus)?;
        let cfg = Config {
            control_socket: over.control_socket.clone().unwrap_or(raw.control_socket),
            control_group: (!raw.control_group.is_empty()).then_some(raw.control_group),
            local_addrs,
            control_core: core(over.control_core.unwrap_or(raw.control_core), &cpus)
                .context("control_core")?,
            poll_cores,
            placement: over.placement.unwrap_or(raw.placement),
            idle: over.idle.unwrap_or(raw.idle),
            spin: std::time::Duration::from_micros(raw.spin_us.min(10_000_000)),
            yield_for: std::time::Duration::from_micros(raw.yield_us.min(10_000_000)),
            park_timeout_ms: raw.park_timeout_ms.clamp(1, 10_000),
            hugepages: over.hugepages.unwrap_or(raw.hugepages),
            max_apps: raw.max_apps,
            max_sockets_per_app: over.max_sockets_per_app.unwrap_or(raw.max_sockets_per_app),
            tx_ring_bytes: raw.tx_ring_bytes,
            rx_ring_bytes: raw.rx_ring_bytes,
            tcp_port: over.tcp_port.unwrap_or(raw.tcp_port),
            tcp_routes: raw
                .tcp_routes
                .iter()
                .map(|s| s.parse())
                .collect::<Result<Vec<Prefix>>>()?,
            tcp_zero_copy_min: Some(over.tcp_zero_copy_min.unwrap_or(raw.tcp_zero_copy_min))
                .filter(|&n| n > 0)
                .map(|n| n as usize),
            paths: over.paths.unwrap_or(raw.paths),
            path_choice: over.path_choice.unwrap_or(raw.path_choice),
            state_file: PathBuf::new(),
            hello_timeout: ms(raw.hello_timeout_ms, "hello_timeout_ms")?,
            control_timeout: ms(raw.control_timeout_ms, "control_timeout_ms")?,
            reply_timeout: ms(raw.reply_timeout_ms, "reply_timeout_ms")?,
            rebind_grace: std::time::Duration::from_millis(raw.rebind_grace_ms.min(60_000)),
            max_apps_per_uid: raw.max_apps_per_uid,
            max_regions_per_uid: raw.max_regions_per_uid,
            backlog_share: over.backlog_share.unwrap_or(raw.backlog_share),
            metrics_listen: match over
                .metrics_listen
                .as_deref()
                .unwrap_or(&raw.metrics_listen)
            {
                "" => None,
                a => Some(a.parse().with_context(|| {
                    format!("metrics_listen must be ADDR:PORT or \"\" (got {a:?})")
                })?),
            },
            trace_hops: raw.trace_hops || over.trace_hops,
            group_owners: Vec::new(),
            sections,
        };
        let mut cfg = cfg;
        let owners = if over.group_owners.is_empty() {
            &raw.group_owners
        } else {
            &over.group_owners
        };
        cfg.group_owners = owners
            .iter()
            .map(|e| parse_group_owner(e))
            .collect::<Result<Vec<_>>>()?;
        // A group this host owns is local: only entries naming another host remain.
        let local = cfg.local_addrs.clone();
        cfg.group_owners
            .retain(|(_, owner)| !local.iter().any(|p| p.contains(*owner)));
        cfg.state_file = match (&over.state_file, raw.state_file.as_str()) {
            (Some(p), _) => p.clone(),
            (None, "") => cfg.control_socket.with_extension("rxseq"),
            (None, p) => PathBuf::from(p),
        };
        if cfg.paths == 0 || cfg.paths > 8 {
            bail!("paths must be 1..=8 (got {})", cfg.paths);
        }
        // A release token has 12 bits of app index; index 4095 names rdsd's own host links.
        if cfg.max_apps == 0 || cfg.max_apps > 4095 {
            bail!("max_apps must be 1..=4095");
        }
        if cfg.backlog_share > MAX_BACKLOG_SHARE {
            bail!(
                "backlog_share must be at most {MAX_BACKLOG_SHARE} (all backlogs of a poll \
                 thread hold at most that; got {})",
                cfg.backlog_share
            );
        }
        if cfg.max_apps_per_uid == 0 || cfg.max_regions_per_uid == 0 {
            bail!("max_apps_per_uid and max_regions_per_uid must be at least 1");
        }
        cfg.geometry()
            .validate()
            .map_err(|m| anyhow::anyhow!("invalid ring configuration: {m}"))?;
        Ok(cfg)
    }

    /// The app-region layout this configuration asks for.
    pub fn geometry(&self) -> shm_api::layout::RegionGeometry {
        shm_api::layout::RegionGeometry {
            max_sockets: self.max_sockets_per_app,
            tx_ring_capacity: self.tx_ring_bytes,
            rx_ring_capacity: self.rx_ring_bytes,
        }
    }

    /// True if some local address is outside 127.0.0.0/8: this host talks to the network.
    pub fn wants_network(&self) -> bool {
        let lo = Prefix {
            addr: Ipv4Addr::new(127, 0, 0, 0),
            len: 8,
        };
        self.local_addrs
            .iter()
            .any(|p| !(p.len >= 8 && lo.contains(p.addr)))
    }

    /// True if `ip` is one of this host's RDS addresses.
    pub fn is_local(&self, ip: Ipv4Addr) -> bool {
        self.local_addrs.iter().any(|p| p.contains(ip))
    }

    /// Poll threads that each drive the network transports for the connections
    /// `transport::ConnOwners` gives them: all of them when this host talks to the network over
    /// kernel TCP and RDMA only (each thread its own QPs and CQs; the PDs are the process's);
    /// with a `[dpdk]` section, its `queues` (one queue pair of the port per thread; 1 by
    /// default), which the kernel-TCP and RDMA connections then share.
    pub fn net_shards(&self) -> usize {
        if !self.wants_network() {
            return 1;
        }
        match self.sections.get("dpdk") {
            Some(d) => d
                .get("queues")
                .and_then(|q| q.as_integer())
                .map_or(1, |q| (q.max(1) as usize).min(self.poll_cores.len())),
            None => self.poll_cores.len(),
        }
    }
}

/// The owner of connection `(laddr, faddr)` among `shards` network poll threads that drive a
/// DPDK port's queue pairs (`transport::ConnOwners`). Symmetric in the two addresses:
/// two hosts with as many threads pick the same one, so on a DPDK port with a queue pair per
/// thread (memif: queue k to queue k) a connection's frames arrive on its owner's queue at
/// both ends and need no steering.
pub fn conn_shard(shards: usize, laddr: u32, faddr: u32) -> usize {
    if shards <= 1 {
        return 0;
    }
    // Fibonacci hashing: neighbouring addresses (a cluster's) spread over the shards.
    let key = (u64::from(laddr.min(faddr)) << 32) | u64::from(laddr.max(faddr));
    ((key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % shards as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_spread_over_the_kernel_tcp_shards() {
        assert_eq!(conn_shard(1, 7, 9), 0, "one shard owns everything");
        // One host's peers on a /24: every shard owns some, none more than twice its share,
        // wherever the host sits in the subnet; and both ends pick the same shard.
        for shards in [2usize, 3, 4, 8] {
            for me in [1u32, 128, 254] {
                let mut load = vec![0usize; shards];
                let at = |h: u32| u32::from(Ipv4Addr::new(10, 0, 0, 0)) | h;
                for peer in (1..=255u32).filter(|&p| p != me) {
                    let k = conn_shard(shards, at(me), at(peer));
                    assert!(k < shards);
                    assert_eq!(k, conn_shard(shards, at(peer), at(me)), "symmetric");
                    load[k] += 1;
                }
                let fair = 254 / shards;
                assert!(
                    load.iter().all(|&l| l > 0 && l <= 2 * fair),
                    "{shards} shards, host .{me}: {load:?}"
                );
            }
        }
        // Sharded only while the host talks to the network (a [dpdk] section's `queues` sets
        // the count: `transport::tests`).
        let mut c = Config::load(None, &Overrides::default()).unwrap();
        c.poll_cores = vec![None, None];
        c.local_addrs.push("10.9.0.1/32".parse().unwrap());
        assert_eq!(c.net_shards(), 2);
        // RDMA is sharded as kernel TCP is: each thread its own QPs.
        c.sections = Sections::split_from(&mut "[rdma]\n".parse().unwrap(), &toml::Table::new());
        assert_eq!(c.net_shards(), 2, "[rdma] shards too");
        c.sections = Sections::default();
        c.local_addrs
            .retain(|p| p.addr != Ipv4Addr::new(10, 9, 0, 1));
        assert_eq!(c.net_shards(), 1, "loopback only: no network");
    }

    #[test]
    fn cpus_come_from_the_process_cpu_set() {
        // A process confined to CPUs 8-11 and 14 (taskset -c 8-11,14).
        let set = [8, 9, 10, 11, 14];
        assert_eq!(cpu_list(&set), "8-11,14");
        assert_eq!(core(-1, &set).unwrap(), Some(14), "-1: the set's last CPU");
        assert_eq!(core(-3, &set).unwrap(), Some(8), "-3: the set's first CPU");
        assert_eq!(core(-2, &set).unwrap(), None);
        assert_eq!(core(10, &set).unwrap(), Some(10));
        for outside in [0, 12, 15, 999] {
            let e = core(outside, &set).unwrap_err().to_string();
            assert!(e.contains(&format!("cpu {outside} is not")), "{e}");
            assert!(e.contains("8-11,14"), "names the set: {e}");
        }
        assert!(core(-4, &set).is_err());
        assert_eq!(
            poll_cpus(&[8, -1, -2, -2, 10], &set).unwrap(),
            vec![Some(8), Some(14), None, None, Some(10)]
        );
        // Two poll threads on one CPU, however it is spelled, are refused.
        for twice in [[9, 9], [14, -1], [-3, 8]] {
            let e = poll_cpus(&twice, &set).unwrap_err().to_string();
            assert!(e.contains("poll threads 0 and 1"), "{twice:?}: {e}");
        }
        let e = format!("{:#}", poll_cpus(&[12], &set).unwrap_err());
        assert!(e.contains("poll_cores") && e.contains("cpu 12"), "{e}");
        assert!(poll_cpus(&[], &set).is_err());
        // The embedded default pins inside whatever set this test runs in.
        let here = shm_api::sys::affinity_cpus();
        let c = Config::load(None, &Overrides::default()).unwrap();
        assert_eq!(c.control_core, here.first().copied());
        assert_eq!(c.poll_cores, vec![here.last().copied()]);
    }

    #[test]
    fn local_addrs_are_host_addresses() {
        let with = |a: &str| {
            Config::load(
                None,
                &Overrides {
                    local_addrs: vec![a.into()],
                    ..Default::default()
                },
            )
        };
        for ok in [
            "10.0.0.1/32",
            "192.168.0.0/16",
            "127.0.0.0/8",
            "223.255.255.255/32",
        ] {
            assert!(with(ok).is_ok(), "{ok}");
        }
        for (bad, says) in [
            ("0.0.0.0/0", "this network"),
            ("0.0.0.0/32", "wildcard"),
            ("239.1.2.3/32", "multicast"),
            ("192.0.0.0/2", "multicast"),
            ("255.255.255.255/32", "broadcast"),
        ] {
            let e = format!("{:#}", with(bad).unwrap_err());
            assert!(e.contains("local_addrs") && e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn embedded_default_loads_without_a_file() {
        let c = Config::load(None, &Overrides::default()).unwrap();
        assert!(c.is_local("127.3.4.5".parse().unwrap()));
        assert!(!c.is_local("10.0.0.1".parse().unwrap()));
        assert_eq!(c.idle, IdleMode::Backoff);
        assert_eq!(c.control_socket, PathBuf::from("/run/rdsd/rdsd.sock"));
        assert_eq!(c.state_file, PathBuf::from("/run/rdsd/rdsd.rxseq"));
        assert_eq!(c.hello_timeout, std::time::Duration::from_secs(1));
        assert!(
            c.max_apps_per_uid < c.max_apps,
            "one uid can't take every slot"
        );
        assert!(
            c.max_apps_per_uid >= 256 && c.max_regions_per_uid >= 256,
            "an MPI job's 256 ranks of one user attach with the defaults"
        );
    }

    #[test]
    fn file_and_flags_override_and_typos_fail() {
        let dir = std::env::temp_dir().join(format!("rdsd-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("c.toml");
        std::fs::write(&f, "idle = \"spin\"\nlocal_addrs = [\"10.1.0.0/16\"]\n").unwrap();
        let over = Overrides {
            control_socket: Some("/tmp/x.sock".into()),
            ..Default::default()
        };
        let c = Config::load(Some(&f), &over).unwrap();
        assert_eq!(c.idle, IdleMode::Spin);
        assert!(c.is_local("10.1.2.3".parse().unwrap()));
        assert_eq!(c.control_socket, PathBuf::from("/tmp/x.sock"));
        std::fs::write(&f, "idel = \"spin\"\n").unwrap();
        let e = Config::load(Some(&f), &Overrides::default()).unwrap_err();
        assert!(format!("{e:#}").contains("idel"), "{e:#}");
        std::fs::write(&f, "tx_ring_bytes = 1000\n").unwrap();
        assert!(Config::load(Some(&f), &Overrides::default()).is_err());
        std::fs::write(&f, "metrics_listen = \"127.0.0.1:9464\"\n").unwrap();
        let c = Config::load(Some(&f), &Overrides::default()).unwrap();
        assert_eq!(c.metrics_listen, Some("127.0.0.1:9464".parse().unwrap()));
        std::fs::write(&f, "metrics_listen = \"localhost\"\n").unwrap();
        let e = Config::load(Some(&f), &Overrides::default()).unwrap_err();
        assert!(format!("{e:#}").contains("metrics_listen"), "{e:#}");
        assert_eq!(
            Config::load(None, &Overrides::default())
                .unwrap()
                .metrics_listen,
            None
        );
        // The backlog share: 8 MiB by default, 0 allowed, at most what a thread's backlogs hold.
        assert_eq!(
            Config::load(None, &Overrides::default())
                .unwrap()
                .backlog_share,
            8 << 20
        );
        std::fs::write(&f, "backlog_share = 0\n").unwrap();
        let c = Config::load(Some(&f), &Overrides::default()).unwrap();
        assert_eq!(c.backlog_share, 0);
        let over = Overrides {
            backlog_share: Some(MAX_BACKLOG_SHARE + 1),
            ..Default::default()
        };
        let e = Config::load(Some(&f), &over).unwrap_err();
        assert!(format!("{e:#}").contains("backlog_share"), "{e:#}");
    }

    #[test]
    fn group_owners_name_other_hosts_and_bad_entries_fail() {
        let with = |entries: &[&str]| {
            Config::load(
                None,
                &Overrides {
                    local_addrs: vec!["10.0.0.2/32".into()],
                    group_owners: entries.iter().map(|e| e.to_string()).collect(),
                    ..Default::default()
                },
            )
        };
        assert!(Config::load(None, &Overrides::default())
            .unwrap()
            .group_owners
            .is_empty());
        let c = with(&["239.1.0.0/16=10.0.0.1", "239.2.0.0/16=10.0.0.2"]).unwrap();
        // The second names this host: its groups are local.
        assert_eq!(
            c.group_owners,
            vec![("239.1.0.0/16".parse().unwrap(), "10.0.0.1".parse().unwrap())]
        );
        for bad in [
            "239.1.0.0/16",
            "10.0.0.0/8=10.0.0.1",
            "0.0.0.0/0=10.0.0.1",
            "239.1.0.0/16=239.0.0.1",
            "239.1.0.0/16=nowhere",
        ] {
            let e = with(&[bad]).unwrap_err();
            assert!(format!("{e:#}").contains("group_owners"), "{bad}: {e:#}");
        }
    }
}
