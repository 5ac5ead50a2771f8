//! Value types shared by the configuration, the transports and the protocol layer. A leaf:
//! it names nothing else of the crate, so anything may use it without making a cycle.

use anyhow::{bail, Context, Result};
use std::net::Ipv4Addr;

/// An IPv4 prefix such as `127.0.0.0/8`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefix {
    /// Network address.
    pub addr: Ipv4Addr,
    /// Prefix length, 0..=32.
    pub len: u8,
}

impl Prefix {
    /// True if `ip` is inside the prefix.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        let mask = if self.len == 0 {
            0
        } else {
            u32::MAX << (32 - self.len)
        };
        u32::from(ip) & mask == u32::from(self.addr) & mask
    }

    /// True if the two prefixes share an address (one holds the other's network).
    pub fn overlaps(&self, other: &Prefix) -> bool {
        let shorter = if self.len <= other.len { self } else { other };
        let longer = if self.len <= other.len { other } else { self };
        shorter.contains(longer.addr)
    }
}

impl std::str::FromStr for Prefix {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Prefix> {
        let (a, l) = s.split_once('/').unwrap_or((s, "32"));
        let addr: Ipv4Addr = a
            .parse()
            .with_context(|| format!("bad address in prefix {s:?}"))?;
        let len: u8 = l
            .parse()
            .with_context(|| format!("bad length in prefix {s:?}"))?;
        if len > 32 {
            bail!("prefix length above 32 in {s:?}");
        }
        Ok(Prefix { addr, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes() {
        let p: Prefix = "192.168.0.0/16".parse().unwrap();
        assert!(p.contains("192.168.7.1".parse().unwrap()));
        assert!(!p.contains("192.169.0.1".parse().unwrap()));
        assert!("1.2.3.4/33".parse::<Prefix>().is_err());
        let all: Prefix = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("8.8.8.8".parse().unwrap()));
        let mcast: Prefix = "224.0.0.0/4".parse().unwrap();
        for (p, hit) in [
            ("0.0.0.0/0", true),
            ("239.1.2.3/32", true),
            ("224.0.0.0/3", true),
            ("192.168.0.0/16", false),
            ("240.0.0.0/4", false),
        ] {
            let p: Prefix = p.parse().unwrap();
            assert_eq!(p.overlaps(&mcast), hit, "{p:?}");
            assert_eq!(mcast.overlaps(&p), hit, "symmetric: {p:?}");
        }
    }
}
