//! A lab of "hosts" in network namespaces joined by a bridge, each running its own rdsd.
//! Needs root (CI and the README's test command run as root).

use crate::Daemon;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

static LAB: AtomicU32 = AtomicU32::new(0);

fn sh(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Loads an nftables ruleset into network namespace `ns`; panics on failure.
pub fn nft_in(ns: &str, ruleset: &str) {
    use std::io::Write;
    let mut c = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("nft");
    c.stdin
        .take()
        .unwrap()
        .write_all(ruleset.as_bytes())
        .unwrap();
    let out = c.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "nft: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// True when this process may create namespaces.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// One host: a namespace, its address on the lab subnet, and (usually) an rdsd.
pub struct Host {
    /// Namespace name.
    pub ns: String,
    /// RDS/TCP address.
    pub addr: Ipv4Addr,
    /// rdsd serving this host, if started.
    pub daemon: Option<Daemon>,
}

impl Host {
    /// The host's rdsd.
    pub fn d(&self) -> &Daemon {
        self.daemon.as_ref().expect("host has an rdsd")
    }

    /// `addr:port` on this host.
    pub fn at(&self, port: u16) -> String {
        format!("{}:{port}", self.addr)
    }

    /// Runs a command inside the namespace; panics on failure.
    pub fn exec(&self, args: &[&str]) {
        let mut v = vec!["ip", "netns", "exec", &self.ns];
        v.extend_from_slice(args);
        sh(&v);
    }

    /// Loads an nftables ruleset into the namespace.
    pub fn nft(&self, ruleset: &str) {
        nft_in(&self.ns, ruleset);
    }

    /// Takes the host's link down or up.
    pub fn link(&self, up: bool) {
        sh(&[
            "ip",
            "-n",
            &self.ns,
            "link",
            "set",
            "eth0",
            if up { "up" } else { "down" },
        ]);
    }
}

/// Several hosts on one bridged subnet.
pub struct Lab {
    /// The hosts, addresses .1, .2, ... in order.
    pub hosts: Vec<Host>,
    sw: String,
}

impl Lab {
    /// `n` hosts; the first `with_rdsd` of them run rdsd with `extra` flags.
    pub fn new(n: usize, with_rdsd: usize, extra: &[&str]) -> Lab {
        assert!(
            is_root(),
            "the multi-host tests create network namespaces and need root"
        );
        let id = LAB.fetch_add(1, Ordering::Relaxed);
        let tag = format!("r{}x{id}", std::process::id() % 100_000);
        let subnet = 100 + (std::process::id() as usize * 7 + id as usize) % 150;
        let sw = format!("{tag}sw");
        let _ = Command::new("ip")
            .args(["netns", "del", &sw])
            .stderr(Stdio::null())
            .status();
        sh(&["ip", "netns", "add", &sw]);
        sh(&["ip", "-n", &sw, "link", "add", "br0", "type", "bridge"]);
        sh(&["ip", "-n", &sw, "link", "set", "br0", "up"]);
        let mut hosts = Vec::new();
        for i in 0..n {
            let ns = format!("{tag}h{i}");
            let _ = Command::new("ip")
                .args(["netns", "del", &ns])
                .stderr(Stdio::null())
                .status();
            sh(&["ip", "netns", "add", &ns]);
            let peer = format!("p{i}");
            sh(&[
                "ip", "link", "add", "eth0", "netns", &ns, "type", "veth", "peer", "name", &peer,
                "netns", &sw,
            ]);
            sh(&["ip", "-n", &sw, "link", "set", &peer, "master", "br0"]);
            sh(&["ip", "-n", &sw, "link", "set", &peer, "up"]);
            let addr = Ipv4Addr::new(10, subnet as u8, 0, i as u8 + 1);
            sh(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{addr}/24"),
                "dev",
                "eth0",
            ]);
            sh(&["ip", "-n", &ns, "link", "set", "eth0", "up"]);
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
            hosts.push(Host {
                ns,
                addr,
                daemon: None,
            });
        }
        let mut lab = Lab { hosts, sw };
        for i in 0..with_rdsd {
            lab.start(i, extra);
        }
        lab
    }

    /// Starts (or restarts) rdsd on host `i`.
    pub fn start(&mut self, i: usize, extra: &[&str]) {
        let h = &mut self.hosts[i];
        let local = format!("{}/32", h.addr);
        let mut args = vec!["--local-addr", &local, "--local-addr", "127.0.0.0/8"];
        args.extend_from_slice(extra);
        h.daemon = Some(Daemon::start_in(Some(&h.ns), &args));
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for h in &mut self.hosts {
            h.daemon = None;
            let _ = Command::new("ip").args(["netns", "del", &h.ns]).status();
        }
        let _ = Command::new("ip").args(["netns", "del", &self.sw]).status();
    }
}
