//! The loopback transport: delivery to a socket bound on this host, ring to ring (one copy).

use crate::config::Config;
use crate::prefix::Prefix;
use crate::seam::{Delivered, Incoming, OutMsg, SendOutcome, Transport, Upcalls};
use crate::stats::Stats;
use std::net::Ipv4Addr;
use std::sync::Arc;

/// Delivers to local addresses.
pub struct Loopback {
    local: Vec<Prefix>,
    stats: Arc<Stats>,
}

/// The loopback transport: always there.
pub fn build(cfg: &Config, stats: &Arc<Stats>) -> anyhow::Result<Option<Loopback>> {
    Ok(Some(Loopback::new(cfg, stats)))
}

impl Loopback {
    /// Loopback for the configured local addresses.
    pub fn new(cfg: &Config, stats: &Arc<Stats>) -> Loopback {
        Loopback {
            local: cfg.local_addrs.clone(),
            stats: stats.clone(),
        }
    }
}

impl Loopback {
    /// A message to port 0 is an RDS ping (rds-ping): answered, as by the kernel's
    /// `rds_recv_incoming` and by the engine for network peers, with an empty pong from port 0
    /// of the pinged address back to the sender. A ping from port 0 is never answered.
    fn pong(&mut self, up: &mut dyn Upcalls, m: &OutMsg<'_>) -> SendOutcome {
        if m.sport == 0 {
            Stats::bump(&self.stats.drop_unbound_dest);
            return SendOutcome::Dropped;
        }
        match up.deliver(Incoming {
            laddr: m.laddr,
            faddr: m.faddr,
            sport: 0,
            dport: m.sport,
            payload: crate::seam::MsgBytes::from_slice(&[]),
        }) {
            Delivered::Yes => {
                Stats::bump_mine(&self.stats.loop_pings);
                SendOutcome::Delivered
            }
            Delivered::Full => SendOutcome::Blocked,
            Delivered::NoSocket => SendOutcome::Dropped,
        }
    }
}

impl Transport for Loopback {
    fn name(&self) -> &'static str {
        "loopback"
    }

    fn routes_to(&self, dest: Ipv4Addr) -> bool {
        self.local.iter().any(|p| p.contains(dest))
    }

    /// `Blocked` leaves the message on the sender's tx ring for a later pass.
    fn send(&mut self, up: &mut dyn Upcalls, m: OutMsg<'_>) -> SendOutcome {
        if m.dport == 0 {
            return self.pong(up, &m);
        }
        deliver(up, &self.stats, m)
    }
}

/// What [`Loopback`] does with a message to a bound port (not 0): delivered here, ring to
/// ring. Generic over the upcalls, so that a poll thread delivers a message between two of its
/// own sockets with no dynamic call, through this same code.
#[inline]
pub fn deliver<U: Upcalls + ?Sized>(up: &mut U, stats: &Stats, m: OutMsg<'_>) -> SendOutcome {
    debug_assert_ne!(m.dport, 0, "port 0 is a ping: Loopback::send");
    let len = m.payload.len() as u64;
    match up.deliver(Incoming {
        laddr: m.faddr,
        faddr: m.laddr,
        sport: m.sport,
        dport: m.dport,
        payload: m.payload,
    }) {
        Delivered::Yes => {
            Stats::bump_mine(&stats.loop_delivered);
            Stats::add_mine(&stats.loop_bytes, len);
            SendOutcome::Delivered
        }
        Delivered::Full => SendOutcome::Blocked,
        Delivered::NoSocket => SendOutcome::Dropped,
    }
}
