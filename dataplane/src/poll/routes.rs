//! Which transport carries a destination, remembered per poll thread.
//!
//! A route is a pure function of the configuration: the transports, their routes and the local
//! addresses are fixed when rdsd starts. Looking it up per message scanned every transport's
//! prefixes (about 90 instructions per 64 B message to a DPDK peer, `bench/RESULTS.md`); a
//! small direct-mapped cache answers a poll thread's few destinations in a compare.

use crate::config::Config;
use crate::seam::Transport;
use std::net::Ipv4Addr;

/// Cache entries: a poll thread talks to few destinations at a time; a collision only costs a
/// lookup.
const SLOTS: usize = 64;

/// Where messages to one destination go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Route {
    /// The first transport whose routes hold the destination (`None`: no route).
    pub transport: Option<usize>,
    /// The destination is an address of this host.
    pub local: bool,
}

/// The routes of recently used destinations.
pub(super) struct RouteCache {
    slots: Box<[Option<(u32, Route)>; SLOTS]>,
}

impl RouteCache {
    pub(super) fn new() -> RouteCache {
        RouteCache {
            slots: Box::new([None; SLOTS]),
        }
    }

    /// The route to `dest` over `transports` (the same list every call).
    #[inline]
    pub(super) fn get(
        &mut self,
        dest: u32,
        transports: &[Box<dyn Transport>],
        cfg: &Config,
    ) -> Route {
        // Fibonacci hashing: a cluster's neighbouring addresses land in different slots.
        let i = (dest.wrapping_mul(0x9E37_79B9) >> 26) as usize % SLOTS;
        match self.slots[i] {
            Some((a, r)) if a == dest => r,
            _ => {
                let ip = Ipv4Addr::from(dest);
                let r = Route {
                    transport: transports.iter().position(|t| t.routes_to(ip)),
                    local: cfg.is_local(ip),
                };
                self.slots[i] = Some((dest, r));
                r
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Overrides;
    use crate::seam::{OutMsg, SendOutcome, Upcalls};
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    /// Routes one /24, counting the questions it is asked.
    struct Net(u32, Arc<AtomicU32>);

    impl Transport for Net {
        fn name(&self) -> &'static str {
            "net"
        }
        fn routes_to(&self, dest: Ipv4Addr) -> bool {
            self.1.fetch_add(1, Ordering::Relaxed);
            u32::from(dest) >> 8 == self.0 >> 8
        }
        fn send(&mut self, _up: &mut dyn Upcalls, _m: OutMsg<'_>) -> SendOutcome {
            SendOutcome::Dropped
        }
    }

    #[test]
    fn a_route_is_looked_up_once_per_destination_and_stays_right() {
        let cfg = Config::load(None, &Overrides::default()).unwrap();
        let asked = Arc::new(AtomicU32::new(0));
        let a = u32::from(Ipv4Addr::new(10, 0, 1, 0));
        let b = u32::from(Ipv4Addr::new(10, 0, 2, 0));
        let t: Vec<Box<dyn Transport>> = vec![
            Box::new(Net(a, asked.clone())),
            Box::new(Net(b, asked.clone())),
        ];
        let mut c = RouteCache::new();
        let local = u32::from(Ipv4Addr::LOCALHOST);
        let nowhere = u32::from(Ipv4Addr::new(192, 0, 2, 1));
        // More destinations than slots, three times over: every answer stays right.
        for _ in 0..3 {
            for d in 1..=200u32 {
                assert_eq!(c.get(a + (d & 0xff), &t, &cfg).transport, Some(0));
                assert_eq!(c.get(b + (d & 0xff), &t, &cfg).transport, Some(1));
            }
            let r = c.get(local, &t, &cfg);
            assert_eq!(
                r,
                Route {
                    transport: None,
                    local: true
                }
            );
            let r = c.get(nowhere, &t, &cfg);
            assert_eq!(
                r,
                Route {
                    transport: None,
                    local: false
                }
            );
        }
        let before = asked.load(Ordering::Relaxed);
        for _ in 0..1000 {
            assert_eq!(c.get(a + 7, &t, &cfg).transport, Some(0));
        }
        assert!(
            asked.load(Ordering::Relaxed) <= before + 1,
            "at most one lookup, then the cache answers"
        );
    }
}
