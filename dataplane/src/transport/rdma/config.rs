//! The `[rdma]` section of rdsd's configuration (absent: no RDMA transport), parsed and
//! checked here, behind the transport's registration line (`transport::register`).

use super::wire;
use crate::prefix::Prefix;
use crate::transport::Section;
use anyhow::Context;
use serde::Deserialize;

/// The `[rdma]` section as written.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRdma {
    /// rdma_cm port (default 18634, RDS/IB's).
    #[serde(default)]
    pub port: Option<u16>,
    /// Destinations carried over RDMA (default: every non-local address).
    #[serde(default)]
    pub routes: Option<Vec<String>>,
    /// Receive buffers posted per path (= initial credits), 32..=1024.
    #[serde(default)]
    pub recv_buffers: Option<u32>,
    /// Send slots per path, at least 260 (a 1 MiB message is 256 fragments).
    #[serde(default)]
    pub send_slots: Option<u32>,
    /// Send payloads in place from the apps' regions, registered at attach (default true).
    /// Off: payloads are copied into the path's registered send slots.
    #[serde(default)]
    pub zero_copy: Option<bool>,
}

/// The validated `[rdma]` section.
#[derive(Clone, Debug)]
pub struct RdmaConfig {
    /// rdma_cm port.
    pub port: u16,
    /// Destinations carried over RDMA.
    pub routes: Vec<Prefix>,
    /// Receive buffers per path.
    pub recv_buffers: u32,
    /// Send slots per path.
    pub send_slots: u32,
    /// Zero-copy sends from app regions.
    pub zero_copy: bool,
}

impl RdmaConfig {
    /// Validates the raw section.
    pub fn from_raw(r: RawRdma) -> anyhow::Result<RdmaConfig> {
        let routes = r
            .routes
            .unwrap_or_else(|| vec!["0.0.0.0/0".into()])
            .iter()
            .map(|s| s.parse())
            .collect::<anyhow::Result<Vec<Prefix>>>()?;
        let recv_buffers = r.recv_buffers.unwrap_or(64);
        let send_slots = r.send_slots.unwrap_or(320);
        if !(32..=1024).contains(&recv_buffers) {
            anyhow::bail!("recv_buffers must be 32..=1024 (got {recv_buffers})");
        }
        if !(260..=4096).contains(&send_slots) {
            anyhow::bail!("send_slots must be 260..=4096 (got {send_slots})");
        }
        Ok(RdmaConfig {
            port: r.port.unwrap_or(wire::RDS_IB_PORT),
            routes,
            recv_buffers,
            send_slots,
            zero_copy: r.zero_copy.unwrap_or(true),
        })
    }
}

impl Section for RdmaConfig {
    fn parse(table: toml::Table) -> anyhow::Result<RdmaConfig> {
        let raw: RawRdma = table.try_into().context("invalid configuration")?;
        RdmaConfig::from_raw(raw)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_defaults_and_bounds() {
        let raw: RawRdma = toml::from_str("").unwrap();
        let c = RdmaConfig::from_raw(raw).unwrap();
        assert_eq!(c.port, 18634);
        assert_eq!((c.recv_buffers, c.send_slots), (64, 320));
        assert!(c.zero_copy, "zero copy is the default");
        let raw: RawRdma = toml::from_str("zero_copy = false").unwrap();
        assert!(!RdmaConfig::from_raw(raw).unwrap().zero_copy);
        assert!(c.routes[0].contains(std::net::Ipv4Addr::new(10, 1, 2, 3)));
        let raw: RawRdma = toml::from_str("send_slots = 100").unwrap();
        assert!(RdmaConfig::from_raw(raw).is_err());
        assert!(toml::from_str::<RawRdma>("bogus = 1").is_err());
    }
}
