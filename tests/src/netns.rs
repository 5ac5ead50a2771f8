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

    /// Counter `field` of the kernel's TCP in this namespace (`Tcp:` of `/proc/net/snmp`, read
    /// through the host's rdsd, which lives in the namespace): `RetransSegs`, `OutRsts`, ...
    pub fn kernel_tcp_stat(&self, field: &str) -> u64 {
        let pid = self.d().pid();
        let snmp = std::fs::read_to_string(format!("/proc/{pid}/net/snmp")).expect("net/snmp");
        let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
        let (names, values) = (
            tcp.next().expect("Tcp names"),
            tcp.next().expect("Tcp values"),
        );
        names
            .split_whitespace()
            .zip(values.split_whitespace())
            .find(|(n, _)| *n == field)
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or_else(|| panic!("no TCP counter {field} in /proc/{pid}/net/snmp"))
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

static PAIR: AtomicU32 = AtomicU32::new(0);

/// Two network namespaces joined by one veth pair: `v0` in the first, `v1` in the second,
/// both up, with **no** address in the kernel (a DPDK port on each end owns the address; see
/// `tests/dpdk.rs`). IPv6 is off on both ends, so the kernel stays quiet on the wire. Both
/// namespaces (and the pair) are deleted on drop, also when a test fails.
pub struct VethPair {
    /// The two namespaces.
    pub ns: [String; 2],
    /// The /24 subnet 10.`subnet`.0.0 the hosts use.
    pub subnet: u8,
}

impl VethPair {
    /// A fresh pair of namespaces.
    pub fn new() -> VethPair {
        assert!(
            is_root(),
            "the DPDK tests create network namespaces and need root"
        );
        let id = PAIR.fetch_add(1, Ordering::Relaxed);
        let tag = format!("dp{}x{id}", std::process::id() % 100_000);
        let ns = [format!("{tag}a"), format!("{tag}b")];
        for n in &ns {
            let _ = Command::new("ip")
                .args(["netns", "del", n])
                .stderr(Stdio::null())
                .status();
            sh(&["ip", "netns", "add", n]);
        }
        let pair = VethPair {
            ns,
            subnet: (10 + (std::process::id() as usize * 3 + id as usize) % 90) as u8,
        };
        sh(&[
            "ip",
            "link",
            "add",
            "v0",
            "netns",
            &pair.ns[0],
            "type",
            "veth",
            "peer",
            "name",
            "v1",
            "netns",
            &pair.ns[1],
        ]);
        for i in 0..2 {
            let ns = &pair.ns[i];
            let v = VethPair::iface(i);
            sh(&[
                "ip",
                "netns",
                "exec",
                ns,
                "sysctl",
                "-qw",
                &format!("net.ipv6.conf.{v}.disable_ipv6=1"),
            ]);
            sh(&["ip", "-n", ns, "link", "set", v, "up"]);
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        pair
    }

    /// The veth end in namespace `i`.
    pub fn iface(i: usize) -> &'static str {
        ["v0", "v1"][i]
    }

    /// Host `i`'s address, 10.subnet.0.(i + 1).
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, self.subnet, 0, i as u8 + 1)
    }

    /// Starts rdsd in host `i`'s namespace on a `net_memif` port at `sock` (host 0 the
    /// server, host 1 the client) with `paths` paths and the `extra` arguments.
    pub fn memif_daemon(
        &self,
        i: usize,
        sock: &std::path::Path,
        paths: u8,
        extra: &[&str],
    ) -> Daemon {
        self.memif_daemon_with(i, sock, paths, "", extra)
    }

    /// [`Self::memif_daemon`] with more lines for its `[dpdk]` section (`dpdk_lines`).
    pub fn memif_daemon_with(
        &self,
        i: usize,
        sock: &std::path::Path,
        paths: u8,
        dpdk_lines: &str,
        extra: &[&str],
    ) -> Daemon {
        let role = ["server", "client"][i];
        let vdev = format!(
            "net_memif0,role={role},id=0,socket={},socket-abstract=no",
            sock.display()
        );
        self.dpdk_daemon_on(i, &vdev, paths, dpdk_lines, extra)
    }

    /// Starts rdsd in host `i`'s namespace on a `net_af_packet` port on its veth end, with
    /// `paths` paths, more `[dpdk]` lines and the `extra` arguments.
    pub fn af_packet_daemon_with(
        &self,
        i: usize,
        paths: u8,
        dpdk_lines: &str,
        extra: &[&str],
    ) -> Daemon {
        let vdev = format!("net_af_packet0,iface={}", VethPair::iface(i));
        self.dpdk_daemon_on(i, &vdev, paths, dpdk_lines, extra)
    }

    /// rdsd in host `i`'s namespace on DPDK port `vdev` with host `i`'s address.
    fn dpdk_daemon_on(
        &self,
        i: usize,
        vdev: &str,
        paths: u8,
        dpdk_lines: &str,
        extra: &[&str],
    ) -> Daemon {
        let cfg = crate::config_file(&format!(
            "[dpdk]\nvdev = \"{vdev}\"\naddr = \"{}/24\"\n{dpdk_lines}\n{}",
            self.addr(i),
            crate::dpdk_queues_line(dpdk_lines)
        ));
        let cfg = cfg.to_str().unwrap().to_string();
        let p = paths.to_string();
        let mut args = vec!["-c", &cfg, "--local-addr", "127.0.0.0/8", "--paths", &p];
        args.extend_from_slice(extra);
        Daemon::start_in(Some(&self.ns[i]), &args)
    }

    /// Sets the MTU of both veth ends (jumbo frames: 9000).
    pub fn set_mtu(&self, mtu: u16) {
        for i in 0..2 {
            sh(&[
                "ip",
                "-n",
                &self.ns[i],
                "link",
                "set",
                VethPair::iface(i),
                "mtu",
                &mtu.to_string(),
            ]);
        }
    }

    /// Gives host `i`'s address to the kernel on its veth end (a kernel-TCP host).
    pub fn kernel_addr(&self, i: usize) {
        sh(&[
            "ip",
            "-n",
            &self.ns[i],
            "addr",
            "add",
            &format!("{}/24", self.addr(i)),
            "dev",
            VethPair::iface(i),
        ]);
    }

    /// Turns transmit checksum offload (and with it TSO) off on host `i`'s veth end, as
    /// `ethtool -K v tx off` does. A kernel-TCP host needs it when its peer's port is
    /// net_af_packet: veth hands the peer's packet socket segments whose checksum was left to
    /// the "hardware" (and 64 KiB TSO segments), which a userspace stack rightly drops.
    pub fn no_tx_offload(&self, i: usize) {
        let ns = format!("/var/run/netns/{}", self.ns[i]);
        let iface = VethPair::iface(i);
        // setns moves only the calling thread: do it on a thread of its own.
        std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            let f = std::fs::File::open(&ns).expect("open netns");
            // SAFETY: setns on a namespace fd we hold; affects this thread only.
            let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
            #[repr(C)]
            struct EthtoolValue {
                cmd: u32,
                data: u32,
            }
            #[repr(C)]
            struct IfReq {
                name: [u8; 16],
                data: *mut libc::c_void,
                _pad: [u8; 16],
            }
            const SIOCETHTOOL: libc::c_ulong = 0x8946;
            const ETHTOOL_STXCSUM: u32 = 0x17;
            let mut v = EthtoolValue {
                cmd: ETHTOOL_STXCSUM,
                data: 0,
            };
            let mut req = IfReq {
                name: [0; 16],
                data: (&mut v as *mut EthtoolValue).cast(),
                _pad: [0; 16],
            };
            req.name[..iface.len()].copy_from_slice(iface.as_bytes());
            // SAFETY: a datagram socket for the ioctl, closed below.
            let s = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
            assert!(s >= 0);
            // SAFETY: SIOCETHTOOL reads the ifreq and the ethtool_value it points to, both
            // alive for the call.
            let rc = unsafe { libc::ioctl(s, SIOCETHTOOL as _, &mut req) };
            let err = std::io::Error::last_os_error();
            // SAFETY: our socket, closed once.
            unsafe { libc::close(s) };
            assert_eq!(rc, 0, "ETHTOOL_STXCSUM off on {iface}: {err}");
        })
        .join()
        .expect("tx offload thread");
    }
}

impl Default for VethPair {
    fn default() -> VethPair {
        VethPair::new()
    }
}

impl Drop for VethPair {
    fn drop(&mut self) {
        for n in &self.ns {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}
