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
//! * `fault`: test-only fault hooks (the `fault-injection` feature; inert without it).
//!
//! The RDS protocol engine itself is the sans-IO crate `rds-proto` (dataplane/proto).

pub mod config;
pub mod control;
pub mod fault;
pub mod poll;
pub mod prefix;
pub mod protocol;
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
        shm::region::DaemonRegion::create(cfg.idle == config::IdleMode::Backoff)
            .context("creating the daemon region")?,
    );
    let chans = Arc::new(poll::Channels::new(cfg.max_apps as usize));
    // The control thread's doorbell to wake a parked poll core. rdsd's own: never passed to an
    // app (each app gets a doorbell of its own at attach).
    let doorbell = Arc::new(shm_api::sys::eventfd()?);
    let control_wake = Arc::new(shm_api::sys::eventfd()?);
    let listener = control::listen(&cfg.control_socket, cfg.control_group.as_deref())?;
    if let Some(addr) = cfg.metrics_listen {
        control::metrics::spawn(addr, stats.clone(), shutdown.clone())
            .with_context(|| format!("metrics_listen {addr}"))?;
    }
    tracing::info!(socket = %cfg.control_socket.display(), idle = ?cfg.idle, local = ?cfg.local_addrs, "rdsd listening");

    let poll_alive = Arc::new(AtomicBool::new(true));
    let transports = transport::build(&cfg, &stats).context("starting the transports")?;
    let core = poll::PollCore::new(
        cfg.clone(),
        stats.clone(),
        daemon.clone(),
        chans.clone(),
        control_wake.clone(),
        transports,
    );
    let idle = poll::idle::Idle::new(
        cfg.idle,
        cfg.spin,
        cfg.yield_for,
        cfg.park_timeout_ms,
        doorbell.clone(),
    );
    let poll_core = cfg.poll_cores[0];
    let (sd, alive) = (shutdown.clone(), poll_alive.clone());
    let poll_thread = std::thread::Builder::new()
        .name("rdsd-poll-0".into())
        .spawn(move || {
            pin(poll_core, "poll thread 0");
            // If the poll core ever panics, the control thread stops too instead of hanging apps.
            struct Alive(Arc<AtomicBool>);
            impl Drop for Alive {
                fn drop(&mut self) {
                    self.0.store(false, Ordering::Relaxed);
                }
            }
            let _guard = Alive(alive);
            poll::run(core, idle, sd);
        })?;

    pin(cfg.control_core, "control thread");
    let mut ctl = control::Control::new(
        cfg.clone(),
        stats.clone(),
        daemon,
        chans,
        doorbell.clone(),
        control_wake,
        listener,
        shutdown.clone(),
        poll_alive.clone(),
    );
    ctl.run();
    shutdown.store(true, Ordering::Relaxed);
    shm_api::sys::eventfd_signal(std::os::fd::AsRawFd::as_raw_fd(&*doorbell));
    let panicked = poll_thread.join().is_err();
    tracing::info!("rdsd stopped\n{}", stats.render());
    if panicked || !poll_alive.load(Ordering::Relaxed) && !shutdown.load(Ordering::Relaxed) {
        anyhow::bail!("poll thread died");
    }
    Ok(())
}
