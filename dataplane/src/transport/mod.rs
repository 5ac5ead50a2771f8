//! Transports, and the registry that builds them from the configuration.
//!
//! * `loopback`: the destination is a local address of this rdsd; the payload is copied straight
//!   from the sender's tx ring into the receiver's rx ring (one copy).
//! * `tcp`: RDS/TCP over kernel sockets, a `protocol::Link` under the shared protocol layer.
//! * `utcp`: userspace TCP (smoltcp) as a `protocol::Link`, over any smoltcp device.
//! * `dpdk`: `utcp` over a DPDK port (kernel bypass), when the config has a `[dpdk]` section.
//! * `rdma`: RDS over RDMA RC queue pairs (verbs, rdma_cm), when the config has an `[rdma]` section.
//!
//! A transport is a folder here plus one registration line in `register`. A transport with a
//! config section (`[dpdk]`, `[rdma]`) parses and checks it itself ([`Section`]): `config.rs`
//! only keeps it as written. A transport talks to the poll core only through `crate::seam`.

pub mod dpdk;
pub mod handoff;
pub mod loopback;
pub mod rdma;
pub mod tcp;
pub mod utcp;

use crate::config::Config;
use crate::prefix::Prefix;
use crate::quiet::Mutex;
use crate::seam::Transport;
use crate::stats::Stats;
use anyhow::{bail, Context, Result};
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// Which poll thread drives each RDS connection (an address pair) of the network transports
/// that several threads share.
/// * Kernel TCP and RDMA: the thread with the fewest connections when the pair is first seen (by
///   a send on any thread, or by the accept thread), kept for rdsd's life (connections are
///   never removed), so that a host's few busy peers land on different threads; a hash put
///   both of two peers on one thread half the time.
/// * With a DPDK port's queue pairs: the symmetric hash [`crate::config::conn_shard`], so both
///   ends pick the same queue (memif delivers on the queue the peer sent on).
///
/// A lock, taken once per connection and poll thread: each thread keeps what it learnt
/// (`poll::table`), so a send takes no lock.
#[derive(Debug)]
pub struct ConnOwners {
    shards: usize,
    balanced: bool,
    placed: Mutex<Placed>,
}

/// The pairs placed so far and their owners, and how many each thread owns.
#[derive(Debug)]
struct Placed {
    owner: FxHashMap<(u32, u32), u8>,
    load: Vec<u32>,
}

impl ConnOwners {
    /// The owners for `cfg` ([`Config::net_shards`] threads; balanced unless a DPDK port).
    pub fn new(cfg: &Config) -> ConnOwners {
        ConnOwners::with(cfg.net_shards(), cfg.sections.get("dpdk").is_none())
    }

    /// `shards` threads, placed by load (`balanced`) or by the symmetric hash.
    pub fn with(shards: usize, balanced: bool) -> ConnOwners {
        ConnOwners {
            shards: shards.max(1),
            balanced,
            placed: Mutex::new(Placed {
                owner: FxHashMap::default(),
                load: vec![0; shards.max(1)],
            }),
        }
    }

    /// Threads that drive network transports.
    pub fn shards(&self) -> usize {
        self.shards
    }

    /// The thread an inbound connection from `faddr` to `laddr` goes to: its owner (placing
    /// it if new) when the endpoints take such a connection (`laddr` ours, `faddr` not);
    /// thread 0, which refuses it, otherwise, without placing a connection that will never
    /// exist (a probe of a management address would skew the balance for rdsd's life).
    pub fn owner_of_inbound(&self, laddr: u32, faddr: u32, local: &[Prefix]) -> usize {
        let ours = |a: u32| {
            local
                .iter()
                .any(|p| p.contains(std::net::Ipv4Addr::from(a)))
        };
        if ours(laddr) && !ours(faddr) {
            self.owner(laddr, faddr)
        } else {
            0
        }
    }

    /// The thread that owns the connection from `laddr` to `faddr` (placing it if new).
    pub fn owner(&self, laddr: u32, faddr: u32) -> usize {
        if self.shards == 1 {
            return 0;
        }
        if !self.balanced {
            return crate::config::conn_shard(self.shards, laddr, faddr);
        }
        // A thread that panicked holding it has taken rdsd down already.
        let mut p = self.placed.lock();
        if let Some(&k) = p.owner.get(&(laddr, faddr)) {
            return usize::from(k);
        }
        let k = (0..self.shards).min_by_key(|&k| p.load[k]).unwrap_or(0);
        p.load[k] += 1;
        p.owner.insert((laddr, faddr), k as u8);
        k
    }
}

/// The shared protocol layer's settings for a network transport `name` that carries `routes`:
/// the rest (local addresses, paths, path choice) are the daemon's keys, the same for every
/// transport; `state` is its receive-state file, shared by its poll threads' endpoints.
pub fn endpoint_config(
    name: &'static str,
    routes: &[Prefix],
    cfg: &Config,
    state: &Arc<crate::protocol::RxStateFile>,
) -> crate::protocol::EndpointConfig {
    crate::protocol::EndpointConfig {
        name,
        routes: routes.to_vec(),
        local: cfg.local_addrs.clone(),
        npaths: cfg.paths,
        path_choice: cfg.path_choice.into(),
        state: Some(state.clone()),
    }
}

/// Every transport, in routing order (the first that routes a destination carries it), one
/// line each. [`configure`] runs it to parse and check the config sections, [`build`] to
/// start the transports.
fn register(r: &mut Registry<'_>) -> Result<()> {
    r.every_shard(loopback::build)?;
    // Before kernel TCP: the DPDK port's routes win.
    r.section_sharded("dpdk", |cfg, d, stats, _| dpdk::build(cfg, d, stats))?;
    // Before kernel TCP: with an [rdma] section, its routes go over RDMA.
    r.section_sharded("rdma", rdma::build)?;
    r.sharded(tcp::build)?;
    Ok(())
}

/// A transport's own config section (`[name]`), which it parses and checks itself.
pub trait Section: Sized {
    /// The section as written; errors name the key (`dpdk.mtu must be ...`).
    fn parse(table: toml::Table) -> Result<Self>;

    /// Addresses the section makes this host's own (the DPDK port's): they join
    /// `local_addrs`, so apps can bind them and loopback delivers to them.
    fn local_addrs(&self) -> Vec<Prefix> {
        Vec::new()
    }
}

/// Parses and checks every transport's section of `cfg`, adds the addresses they own to
/// `cfg.local_addrs`, and refuses a section that no transport claims. Run once, before the
/// configuration is shared (the poll core and the control thread read `local_addrs`).
pub fn configure(cfg: &mut Config) -> Result<()> {
    let mut r = Registry(Mode::Configure {
        cfg,
        claimed: Vec::new(),
    });
    register(&mut r)?;
    let Mode::Configure { cfg, claimed } = r.0 else {
        unreachable!("configure's registry builds nothing")
    };
    if let Some(name) = cfg.sections.names().find(|n| !claimed.contains(n)) {
        bail!(
            "invalid configuration: unknown section [{name}] (sections: {})",
            claimed
                .iter()
                .map(|c| format!("[{c}]"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    cfg.sections.set_configured();
    Ok(())
}

/// The transports of this configuration (after [`configure`]) for one poll thread, in
/// routing order.
pub fn build(cfg: &Config, stats: &Arc<Stats>) -> Result<Vec<Box<dyn Transport>>> {
    let owners = Arc::new(ConnOwners::with(1, true));
    let mut lists = build_shards(cfg, std::slice::from_ref(stats), &owners)?;
    Ok(lists.pop().expect("one list"))
}

/// The transports of each poll thread (`stats`: one per thread, in order), in routing order:
/// loopback on every thread; kernel TCP and RDMA on each of `Config::net_shards` (the
/// connections `owners` gives each); DPDK on the first `[dpdk] queues` (a queue pair each).
pub fn build_shards(
    cfg: &Config,
    stats: &[Arc<Stats>],
    owners: &Arc<ConnOwners>,
) -> Result<Vec<Vec<Box<dyn Transport>>>> {
    if !cfg.sections.configured() && cfg.sections.names().next().is_some() {
        bail!("the transports' sections were not checked (transport::configure)");
    }
    let mut r = Registry(Mode::Build {
        cfg,
        stats,
        owners,
        lists: stats.iter().map(|_| Vec::new()).collect(),
    });
    register(&mut r)?;
    match r.0 {
        Mode::Build { lists, .. } => Ok(lists),
        Mode::Configure { .. } => unreachable!("build's registry configures nothing"),
    }
}

/// Builds a transport for some poll threads, given each thread's counters (k-th for thread k)
/// and who owns each connection.
type ShardedBuild<T, E> = fn(&Config, &[Arc<Stats>], &Arc<ConnOwners>) -> Result<Vec<T>, E>;

/// What [`register`]'s lines do: check sections, or start transports.
struct Registry<'a>(Mode<'a>);

enum Mode<'a> {
    Configure {
        cfg: &'a mut Config,
        claimed: Vec<&'static str>,
    },
    Build {
        cfg: &'a Config,
        /// One per poll thread.
        stats: &'a [Arc<Stats>],
        /// Who owns each connection (shared with the poll threads).
        owners: &'a Arc<ConnOwners>,
        /// Each poll thread's transports.
        lists: Vec<Vec<Box<dyn Transport>>>,
    },
}

impl Registry<'_> {
    /// A transport without a section on every poll thread; `build` decides from the daemon's
    /// keys whether it runs.
    fn every_shard<T, E>(
        &mut self,
        build: fn(&Config, &Arc<Stats>) -> Result<Option<T>, E>,
    ) -> Result<()>
    where
        T: Transport + 'static,
        E: Into<anyhow::Error>,
    {
        if let Mode::Build {
            cfg, stats, lists, ..
        } = &mut self.0
        {
            for (list, stats) in lists.iter_mut().zip(stats.iter()) {
                if let Some(t) = build(cfg, stats).map_err(Into::into)? {
                    list.push(Box::new(t));
                }
            }
        }
        Ok(())
    }

    /// A transport without a section that `build` makes for some of the poll threads (given
    /// every thread's counters): its k-th result runs on thread k.
    fn sharded<T, E>(&mut self, build: ShardedBuild<T, E>) -> Result<()>
    where
        T: Transport + 'static,
        E: Into<anyhow::Error>,
    {
        if let Mode::Build {
            cfg,
            stats,
            owners,
            lists,
        } = &mut self.0
        {
            let built = build(cfg, stats, owners).map_err(Into::into)?;
            for (list, t) in lists.iter_mut().zip(built) {
                list.push(Box::new(t));
            }
        }
        Ok(())
    }

    /// A transport that runs when the configuration has its section `[name]`, on some of the
    /// poll threads: `build` gets every thread's counters and the connections' owners, and its
    /// k-th result runs on thread k.
    fn section_sharded<S, T, E>(
        &mut self,
        name: &'static str,
        build: impl FnOnce(&Config, &S, &[Arc<Stats>], &Arc<ConnOwners>) -> Result<Vec<T>, E>,
    ) -> Result<()>
    where
        S: Section,
        T: Transport + 'static,
        E: Into<anyhow::Error>,
    {
        if let Mode::Build {
            cfg,
            stats,
            owners,
            lists,
        } = &mut self.0
        {
            if let Some(t) = cfg.sections.get(name) {
                let s = S::parse(t.clone()).with_context(|| format!("[{name}]"))?;
                let built = build(cfg, &s, stats, owners).map_err(Into::into)?;
                for (list, t) in lists.iter_mut().zip(built) {
                    list.push(Box::new(t));
                }
            }
            return Ok(());
        }
        self.section_configure::<S>(name)
    }

    /// Configure mode: claims `[name]`, checks it, and adds the addresses it owns to
    /// `local_addrs`.
    fn section_configure<S: Section>(&mut self, name: &'static str) -> Result<()> {
        if let Mode::Configure { cfg, claimed } = &mut self.0 {
            claimed.push(name);
            if let Some(t) = cfg.sections.get(name) {
                let s = S::parse(t.clone()).with_context(|| format!("[{name}]"))?;
                for p in s.local_addrs() {
                    if !cfg.is_local(p.addr) {
                        cfg.local_addrs.push(p);
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Overrides;

    fn load(text: &str) -> Result<Config> {
        let dir = std::env::temp_dir().join(format!("rdsd-sections-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let f = dir.join(format!("{}.toml", text.len()));
        std::fs::write(&f, text)?;
        let mut cfg = Config::load(Some(&f), &Overrides::default())?;
        let _ = std::fs::remove_file(&f);
        configure(&mut cfg)?;
        Ok(cfg)
    }

    #[test]
    fn each_transport_checks_its_own_section() {
        let c = load("[dpdk]\nvdev = \"net_null0\"\naddr = \"10.254.0.1/24\"\n").unwrap();
        assert!(c.sections.configured());
        assert!(c.sections.get("dpdk").is_some());
        assert!(
            c.is_local("10.254.0.1".parse().unwrap()),
            "the port's address is local"
        );
        assert!(
            !c.is_local("10.254.0.2".parse().unwrap()),
            "only the port's own"
        );
        let e = |t: &str| format!("{:#}", load(t).unwrap_err());
        let bad = e("[dpdk]\nvdev = \"eth0\"\naddr = \"10.1.0.1/24\"\n");
        assert!(
            bad.starts_with("[dpdk]: ") && bad.contains("dpdk.vdev"),
            "{bad}"
        );
        let bad = e("[rdma]\nsend_slots = 100\n");
        assert!(
            bad.starts_with("[rdma]: ") && bad.contains("send_slots"),
            "{bad}"
        );
        let bad = e("[rdma]\ncolour = 1\n");
        assert!(bad.contains("colour"), "{bad}");
        let bad = e("[dpdkk]\nvdev = \"net_null0\"\n");
        assert!(bad.contains("unknown section [dpdkk]"), "{bad}");
        assert!(
            bad.contains("[dpdk], [rdma]"),
            "names the known ones: {bad}"
        );
        // A daemon key written as a table is still the daemon's: its type is wrong.
        assert!(e("[idle]\nx = 1\n").contains("idle"));
    }

    #[test]
    fn build_refuses_sections_nobody_checked() {
        let dir = std::env::temp_dir().join(format!("rdsd-unchecked-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("c.toml");
        std::fs::write(&f, "[rdma]\n").unwrap();
        let cfg = Config::load(Some(&f), &Overrides::default()).unwrap();
        let stats = Arc::new(Stats::default());
        let e = build(&cfg, &stats).err().expect("unchecked sections");
        assert!(format!("{e:#}").contains("transport::configure"));
        let cfg = Config::load(None, &Overrides::default()).unwrap();
        let list = build(&cfg, &stats).unwrap();
        assert_eq!(list.len(), 1, "loopback only without network addresses");
        assert_eq!(list[0].name(), "loopback");
    }

    #[test]
    fn connections_go_to_the_least_loaded_thread_once_and_for_good() {
        let o = ConnOwners::with(3, true);
        assert_eq!(o.shards(), 3);
        let owners: Vec<usize> = (1..=4).map(|p| o.owner(10, p)).collect();
        assert_eq!(owners, [0, 1, 2, 0], "the fewest first, ties to the lowest");
        assert_eq!(o.owner(10, 2), 1, "kept");
        assert_eq!(o.owner(2, 10), 1, "the other direction is another pair");
        assert_eq!(o.owner(10, 5), 2);
        // One thread: always 0; a DPDK port's queues: the symmetric hash.
        assert_eq!(ConnOwners::with(1, true).owner(10, 1), 0);
        let h = ConnOwners::with(4, false);
        for (a, b) in [(1, 2), (7, 3), (0x0a00_0001, 0x0a00_0002)] {
            assert_eq!(h.owner(a, b), crate::config::conn_shard(4, a, b));
            assert_eq!(h.owner(a, b), h.owner(b, a));
        }
    }

    #[test]
    fn an_inbound_connection_the_endpoints_refuse_is_placed_nowhere() {
        let o = ConnOwners::with(2, true);
        let local: Vec<Prefix> = vec!["10.0.0.1/32".parse().unwrap()];
        let (me, peer, mgmt) = (0x0a00_0001, 0x0a00_0002, 0x0b00_0001);
        // To a local address that is not an RDS one (a probe of the management address), and
        // from one of our own: thread 0, nothing placed.
        assert_eq!(o.owner_of_inbound(mgmt, peer, &local), 0);
        assert_eq!(o.owner_of_inbound(me, me, &local), 0);
        // So the first real connection still finds both threads empty (thread 0), and the
        // second goes to thread 1.
        assert_eq!(o.owner_of_inbound(me, peer, &local), 0);
        assert_eq!(o.owner(me, 0x0a00_0003), 1);
        assert_eq!(o.owner_of_inbound(me, peer, &local), 0, "kept");
    }

    #[test]
    fn kernel_tcp_runs_on_every_poll_thread_unless_a_section_needs_thread_0() {
        let dir = std::env::temp_dir().join(format!("rdsd-shards-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let over = Overrides {
            state_file: Some(dir.join("state")),
            local_addrs: vec!["10.253.0.1/32".into()],
            tcp_port: Some(0),
            ..Default::default()
        };
        let mut cfg = Config::load(None, &over).unwrap();
        cfg.poll_cores = vec![None; 3];
        configure(&mut cfg).unwrap();
        let stats: Vec<Arc<Stats>> = (0..3).map(|_| Arc::new(Stats::default())).collect();
        let lists = build_shards(&cfg, &stats, &Arc::new(ConnOwners::new(&cfg))).unwrap();
        let names: Vec<Vec<&str>> = lists
            .iter()
            .map(|l| l.iter().map(|t| t.name()).collect())
            .collect();
        assert_eq!(names, vec![vec!["loopback", "tcp"]; 3]);
        drop(lists);
        let mut cfg = load("[dpdk]\nvdev = \"net_null0\"\naddr = \"10.254.0.1/24\"\n").unwrap();
        cfg.poll_cores = vec![None; 3];
        assert_eq!(
            cfg.net_shards(),
            1,
            "the port's shard 0 keeps kernel TCP too"
        );
        // A queue pair per poll thread: the port's threads share the connections (and kernel
        // TCP's), at most one per poll thread.
        let mut cfg =
            load("[dpdk]\nvdev = \"net_null0\"\naddr = \"10.254.0.1/24\"\nqueues = 2\n").unwrap();
        cfg.poll_cores = vec![None; 3];
        assert_eq!(cfg.net_shards(), 2);
        cfg.poll_cores = vec![None; 1];
        assert_eq!(cfg.net_shards(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
