//! # rdsd: RDS in userspace
//!
//! * `control`: the control thread (attach, socket operations, app death, eviction).
//! * `poll`: the poll core (rings, routing, congestion, readiness) and its idle strategies.
//! * `seam`: the transport seam (the `Transport` and `Upcalls` traits) between the two.
//! * `protocol`: the protocol layer shared by network transports (connection table over the
//!   sans-IO engine, pause on full rings, restart-safe receive state) and its `Link` trait.
//! * `transport`: loopback, kernel TCP, userspace TCP over DPDK, RDMA, and the registry that
//!   parses their config sections and builds them.
//! * `shm`: creating and sealing shared regions.
//! * `config`, `stats`: configuration (the daemon's keys; transports' sections kept as written)
//!   and counters. `prefix`: value types shared by all (a leaf).
//! * `quiet`: per-thread counts of allocations and locks, which prove a poll thread quiet.
//! * `fault`: test-only fault hooks (the `fault-injection` feature; inert without it).
//! * `group`: local multicast groups (issue 20), the sequencer's rules without I/O; not wired
//!   into the poll thread yet.
//!
//! The RDS protocol engine itself is the sans-IO crate `rds-proto` (dataplane/proto).

pub mod clock;
pub mod config;
pub mod control;
pub mod fault;
pub mod group;
pub mod poll;
pub mod prefix;
pub mod protocol;
pub mod quiet;
pub mod seam;
pub mod shm;
pub mod statefile;
pub mod stats;
pub mod transport;

use anyhow::{Context, Result};
use config::Config;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

fn pin(core: Option<usize>, what: &str) {
    if let Some(id) = core {
        if core_affinity::set_for_current(core_affinity::CoreId { id }) {
            tracing::info!(cpu = id, "{what} pinned");
        } else {
            tracing::warn!(cpu = id, "could not pin {what}");
        }
    }
}

/// The configuration rdsd runs with: [`Config::load`], then each transport's section parsed and
/// checked by that transport ([`transport::configure`]).
pub fn load_config(file: Option<&std::path::Path>, over: &config::Overrides) -> Result<Config> {
    let mut cfg = Config::load(file, over)?;
    transport::configure(&mut cfg)?;
    Ok(cfg)
}

/// Runs rdsd until `shutdown` is set (SIGINT/SIGTERM in the binary).
pub fn run(cfg: Config, shutdown: Arc<AtomicBool>) -> Result<()> {
    let cfg = Arc::new(cfg);
    let stats = Arc::new(stats::Stats::default());
    let daemon = Arc::new(
        shm::region::DaemonRegion::create(cfg.idle != config::IdleMode::Spin)
            .context("creating the daemon region")?,
    );
    let shards = cfg.poll_cores.len();
    let chans = Arc::new(poll::Channels::with_shards(cfg.max_apps as usize, shards));
    // Per poll thread, the eventfd that wakes it when parked: rung by the control thread and
    // by other poll threads. rdsd's own: never passed to an app (each app gets a doorbell of
    // its own at attach).
    let doorbells = (0..shards)
        .map(|_| shm_api::sys::eventfd().map(Arc::new))
        .collect::<std::io::Result<Vec<_>>>()?;
    let control_wake = Arc::new(shm_api::sys::eventfd()?);
    let listener = control::listen(&cfg.control_socket, cfg.control_group.as_deref())?;
    if let Some(addr) = cfg.metrics_listen {
        control::metrics::spawn(addr, stats.clone(), shutdown.clone())
            .with_context(|| format!("metrics_listen {addr}"))?;
    }
    tracing::info!(socket = %cfg.control_socket.display(), idle = ?cfg.idle, local = ?cfg.local_addrs, poll_threads = shards, "rdsd listening");

    let poll_alive = Arc::new(AtomicBool::new(true));
    // Who owns each network connection: the kernel-TCP accept thread and every poll thread ask.
    let owners = Arc::new(transport::ConnOwners::new(&cfg));
    let fabric = Arc::new(poll::shard::Fabric::new(
        doorbells.clone(),
        daemon.view(),
        poll::shard::open_rebind(&cfg),
        owners.clone(),
    ));
    let shard_stats: Vec<Arc<stats::Stats>> = (0..shards)
        .map(|k| {
            if k == 0 {
                stats.clone()
            } else {
                Arc::new(stats::Stats::default())
            }
        })
        .collect();
    stats.count_others(shard_stats[1..].to_vec());
    // Every shard delivers locally; each of `net_shards` drives kernel TCP and RDMA for the
    // connections it owns, and a queue pair of the DPDK port.
    let transports =
        transport::build_shards(&cfg, &shard_stats, &owners).context("starting the transports")?;
    let mut poll_threads = Vec::with_capacity(shards);
    for (k, (sstats, list)) in shard_stats.into_iter().zip(transports).enumerate() {
        let core = poll::PollCore::shard(
            cfg.clone(),
            sstats,
            daemon.clone(),
            chans.clone(),
            control_wake.clone(),
            list,
            fabric.clone(),
            k,
        );
        let idle = poll::idle::Idle::new(
            cfg.idle,
            cfg.spin,
            cfg.yield_for,
            cfg.park_timeout_ms,
            doorbells[k].clone(),
        );
        let poll_core = cfg.poll_cores[k];
        let (sd, alive) = (shutdown.clone(), poll_alive.clone());
        poll_threads.push(
            std::thread::Builder::new()
                .name(format!("rdsd-poll-{k}"))
                .spawn(move || {
                    pin(poll_core, &format!("poll thread {k}"));
                    // If a poll thread ever panics, the control thread stops too instead of
                    // hanging apps.
                    struct Alive(Arc<AtomicBool>);
                    impl Drop for Alive {
                        fn drop(&mut self) {
                            self.0.store(false, Ordering::Relaxed);
                        }
                    }
                    let _guard = Alive(alive);
                    poll::run(core, idle, sd);
                })?,
        );
    }

    if let Some(k) = cfg
        .control_core
        .and_then(|c| cfg.poll_cores.iter().position(|&p| p == Some(c)))
    {
        // Allowed (a host or CPU set of one CPU has no other choice), but the control thread
        // then waits for poll thread k's slices: attaches and connects slow down.
        tracing::warn!(
            cpu = cfg.control_core,
            "the control thread shares its CPU with poll thread {k}"
        );
    }
    pin(cfg.control_core, "control thread");
    let mut ctl = control::Control::new(
        cfg.clone(),
        stats.clone(),
        daemon,
        chans,
        doorbells.clone(),
        control_wake,
        listener,
        shutdown.clone(),
        poll_alive.clone(),
    );
    ctl.run();
    shutdown.store(true, Ordering::Relaxed);
    for d in &doorbells {
        shm_api::sys::eventfd_signal(std::os::fd::AsRawFd::as_raw_fd(&**d));
    }
    let mut panicked = false;
    for t in poll_threads {
        panicked |= t.join().is_err();
    }
    tracing::info!("rdsd stopped\n{}", stats.render());
    if panicked || !poll_alive.load(Ordering::Relaxed) && !shutdown.load(Ordering::Relaxed) {
        anyhow::bail!("poll thread died");
    }
    Ok(())
}
