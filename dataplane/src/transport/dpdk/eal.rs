//! EAL start-up and the port: once per process, on the main thread, before the poll core runs.

use super::config::DpdkConfig;
use anyhow::{anyhow, bail, Result};
use dpdk_sys as sys;
use std::ffi::{c_char, CString};
use std::net::Ipv4Addr;
use std::sync::Mutex;

/// Whether EAL was started in this process (it can be, once).
static EAL: Mutex<bool> = Mutex::new(false);

/// Starts EAL with `cfg`'s arguments. EAL pins the calling thread to its main lcore; rdsd's
/// threads keep the placement its own config gives them, so the affinity is put back.
pub fn init(cfg: &DpdkConfig) -> Result<()> {
    let mut started = EAL.lock().unwrap_or_else(|e| e.into_inner());
    if *started {
        bail!("EAL is already running in this process (one [dpdk] port per rdsd)");
    }
    let args = cfg.eal_argv();
    let owned: Vec<CString> = args
        .iter()
        .map(|a| CString::new(a.as_str()).map_err(|_| anyhow!("EAL argument {a:?} has a NUL")))
        .collect::<Result<_>>()?;
    // EAL may keep pointers into argv for the life of the process: leak it on purpose.
    let owned: &'static [CString] = Vec::leak(owned);
    let mut argv: Vec<*mut c_char> = owned.iter().map(|c| c.as_ptr() as *mut c_char).collect();
    argv.push(std::ptr::null_mut());
    let argv: &'static mut [*mut c_char] = Vec::leak(argv);

    // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it for this thread.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let len = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: as above; the size is the set's.
    let have_set = unsafe { libc::sched_getaffinity(0, len, &mut set) } == 0;
    tracing::info!(args = ?args, "starting DPDK EAL");
    // SAFETY: argv is a NULL-terminated array of valid C strings that lives forever; EAL is
    // not running in this process (checked above under the lock).
    let ret = unsafe { sys::rte_eal_init((argv.len() - 1) as i32, argv.as_mut_ptr()) };
    // SAFETY: reading the thread-local rte_errno has no preconditions.
    let errno = unsafe { sys::rte_errno() };
    remove_runtime_dir(&cfg.file_prefix);
    if ret < 0 {
        let hint = match errno {
            libc::EINVAL => {
                "EAL rejected an argument: check dpdk.lcores, dpdk.vdev and dpdk.eal_args \
                 (EAL's own message is above)"
            }
            libc::ENOMEM => {
                "not enough memory: free hugepages (hugepage-setup --setup) or set \
                 dpdk.hugepages = false, or lower dpdk.memory_mb"
            }
            libc::EACCES => {
                "permission denied: DPDK needs root (or CAP_NET_RAW, CAP_IPC_LOCK, ...)"
            }
            libc::EALREADY => "EAL is already running in this process",
            _ => "see EAL's message above",
        };
        bail!(
            "rte_eal_init({}) failed: {} ({hint})",
            args[1..].join(" "),
            sys::strerror(errno)
        );
    }
    *started = true;
    if have_set {
        // SAFETY: puts back the affinity read above, for this thread.
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    }
    Ok(())
}

/// Removes EAL's runtime directory (`/var/run/dpdk/<prefix>`): with `--no-shconf` or
/// `--in-memory` nothing in it is used after start-up, and a directory per rdsd process would
/// pile up (one per pid).
fn remove_runtime_dir(prefix: &str) {
    // SAFETY: returns a pointer to EAL's static NUL-terminated path (empty before init).
    let dir = unsafe { std::ffi::CStr::from_ptr(sys::rte_eal_get_runtime_dir()) };
    let dir = std::path::PathBuf::from(dir.to_string_lossy().into_owned());
    if !prefix.is_empty() && dir.file_name().is_some_and(|n| n == prefix) {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A configured, started port with its mempool.
pub struct Port {
    /// DPDK port id.
    pub id: u16,
    /// The mbuf pool its rx queue fills from (and we allocate tx frames from).
    pub pool: *mut sys::rte_mempool,
    /// The port's MAC address.
    pub mac: [u8; 6],
    /// IP MTU.
    pub mtu: u16,
    /// Whether `rte_eth_dev_start` succeeded (a memif client may wait for its server).
    pub started: bool,
    /// Rx/tx queue pairs (`dpdk.queues`).
    pub queues: u16,
}

fn check(rc: i32, what: &str, cfg: &DpdkConfig) -> Result<()> {
    if rc < 0 {
        bail!(
            "DPDK port {}: {what}: {}",
            cfg.port_name,
            sys::strerror(-rc)
        );
    }
    Ok(())
}

/// Ethernet header and CRC: what a frame adds to the IP MTU in DPDK's `max_rx_pktlen`.
const FRAME_OVERHEAD: usize = 14 + 4;

/// The MTU to ask of a port: the configured one, within what the port says it takes
/// (`max_mtu`, and `max_rx_pktlen` for the whole frame); 1500 if it says nothing usable.
fn mtu_to_ask(configured: u16, info: &sys::rte_eth_dev_info) -> u16 {
    let mut m = configured;
    if info.max_mtu >= 576 {
        m = m.min(info.max_mtu);
    }
    if info.max_rx_pktlen as usize >= 576 + FRAME_OVERHEAD {
        m = m.min((info.max_rx_pktlen as usize - FRAME_OVERHEAD).min(usize::from(u16::MAX)) as u16);
    }
    m.max(info.min_mtu).max(576)
}

/// The MTU of kernel interface `name` in this network namespace (`SIOCGIFMTU`), if it has one.
fn interface_mtu(name: &str) -> Option<u16> {
    // SAFETY: `ifreq` is plain old data, for which all zeros is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    let bytes = name.as_bytes();
    if bytes.len() >= req.ifr_name.len() {
        return None;
    }
    for (d, &b) in req.ifr_name.iter_mut().zip(bytes) {
        *d = b as libc::c_char;
    }
    // SAFETY: a fresh datagram socket, closed below; `req` is a valid, NUL-terminated ifreq
    // that the ioctl fills in.
    let mtu = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return None;
        }
        let rc = libc::ioctl(fd, libc::SIOCGIFMTU, &mut req);
        libc::close(fd);
        (rc == 0).then_some(req.ifr_ifru.ifru_mtu)
    }?;
    u16::try_from(mtu).ok()
}

/// The mbuf data room for frames of IP MTU `mtu` in one segment, with room for a VLAN tag
/// (DPDK's default room for standard frames).
/// The largest IP MTU DPDK 22.11's af_xdp driver carries: its UMEM frames are 2048 bytes and
/// the kernel puts XDP's 256-byte headroom in front of each packet, so a frame of more than
/// 1792 bytes (an MTU of 1778) is silently lost, although the driver reports a `max_mtu` of
/// 3542. Found on veth: 1778 carries a 1 MiB stream, 1779 loses every full-size segment.
pub const AF_XDP_MAX_MTU: u16 = 2048 - 256 - 14;

fn data_room(mtu: u16) -> u16 {
    let need = sys::RTE_PKTMBUF_HEADROOM as usize + usize::from(mtu) + FRAME_OVERHEAD;
    need.next_multiple_of(64)
        .max(sys::RTE_MBUF_DEFAULT_BUF_SIZE as usize) as u16
}

/// Configures and starts `cfg`'s port with `dpdk.queues` rx/tx queue pairs (one per poll
/// thread that drives it).
pub fn open_port(cfg: &DpdkConfig) -> Result<Port> {
    let name = CString::new(cfg.port_name.as_str())?;
    let mut id = 0u16;
    // SAFETY: EAL is running; valid name and out-pointer.
    if unsafe { sys::rte_eth_dev_get_port_by_name(name.as_ptr(), &mut id) } != 0 {
        let hint = if cfg.af_xdp_iface().is_some() {
            " (af_xdp: dpdk.queues at most the interface's combined channels, `ethtool -l`)"
        } else {
            ""
        };
        bail!(
            "DPDK port {} not found: its driver refused dpdk.vdev {:?} (DPDK's messages above \
             say why){hint}, or this DPDK has no such driver (librte-net-*)",
            cfg.port_name,
            cfg.vdev
        );
    }
    let mut info = sys::rte_eth_dev_info::default();
    // SAFETY: a valid port; the out-pointer is ours.
    let rc = unsafe { sys::rte_eth_dev_info_get(id, &mut info) };
    check(rc, "device info", cfg)?;
    // memif and af_packet: the driver's reported limit is not its rings'
    // (`DpdkConfig::memif_mtu`, `af_packet_mtu`); ethdev keeps its default MTU and the frames
    // are sized here (af_packet: within the kernel interface's MTU too).
    let own_mtu = cfg
        .memif_mtu()
        .or_else(|| {
            let m = cfg.af_packet_mtu()?;
            let iface = cfg.af_packet_iface().and_then(|i| interface_mtu(&i));
            Some(iface.map_or(m, |i| m.min(i)).max(576))
        })
        .or_else(|| {
            // af_xdp: the kernel interface's MTU, within what the driver's frames hold.
            let iface = cfg.af_xdp_iface()?;
            let m = interface_mtu(&iface).map_or(1500, |i| i.min(cfg.mtu));
            Some(m.min(info.max_mtu).clamp(576, AF_XDP_MAX_MTU))
        });
    let want = own_mtu.unwrap_or_else(|| mtu_to_ask(cfg.mtu, &info));
    let queues = cfg.queues;
    if info.max_rx_queues < queues || info.max_tx_queues < queues {
        bail!(
            "DPDK port {}: dpdk.queues = {queues}, but the port has {} rx and {} tx queues",
            cfg.port_name,
            info.max_rx_queues,
            info.max_tx_queues
        );
    }
    tracing::info!(
        port = %cfg.port_name, min_mtu = info.min_mtu, max_mtu = info.max_mtu,
        max_rx_pktlen = info.max_rx_pktlen, asked = cfg.mtu, trying = want,
        "DPDK port limits"
    );
    let pool_name = CString::new(format!("rdsd_pool_{id}"))?;
    // af_packet copies a whole ring frame's worth into an mbuf, whatever the MTU.
    let room = cfg.af_packet_rx_room().map_or(data_room(want), |r| {
        let need = (sys::RTE_PKTMBUF_HEADROOM + r).next_multiple_of(64);
        data_room(want).max(need.min(u32::from(u16::MAX)) as u16)
    });
    // SAFETY: EAL is running; valid name; sizes within DPDK's limits (cache <= 512; the data
    // room is capped to fit u16).
    let pool = unsafe {
        sys::rte_pktmbuf_pool_create(
            pool_name.as_ptr(),
            cfg.mbufs,
            256,
            0,
            room,
            sys::rte_eth_dev_socket_id(id),
        )
    };
    if pool.is_null() {
        // SAFETY: reading the thread-local rte_errno has no preconditions.
        let e = unsafe { sys::rte_errno() };
        bail!(
            "DPDK mempool of {} mbufs: {} (raise dpdk.memory_mb or lower dpdk.mbufs)",
            cfg.mbufs,
            sys::strerror(e)
        );
    }
    let mut conf = sys::rte_eth_conf::default();
    if own_mtu.is_none() {
        conf.rxmode.mtu = u32::from(want);
    }
    let (mut nrx, mut ntx) = (cfg.rx_desc, cfg.tx_desc);
    let mut mac = sys::rte_ether_addr::default();
    let mut mtu = 0u16;
    let mut started = true;
    // SAFETY: a valid port; out-pointers are ours; the pool outlives the queues (never freed
    // while the port runs).
    unsafe {
        if sys::rte_eth_dev_configure(id, queues, queues, &conf) < 0 {
            tracing::warn!(port = %cfg.port_name, mtu = want, "the port refused the MTU; 1500");
            conf.rxmode.mtu = 0;
            check(
                sys::rte_eth_dev_configure(id, queues, queues, &conf),
                "configure",
                cfg,
            )?;
        }
        // The driver's own MTU (af_packet: the kernel interface's). Drivers without one
        // (memif, null) keep the configured MTU.
        let rc = if own_mtu.is_some() {
            0
        } else {
            sys::rte_eth_dev_set_mtu(id, want)
        };
        if rc < 0 && rc != -libc::ENOTSUP {
            tracing::warn!(
                port = %cfg.port_name, mtu = want, error = %sys::strerror(-rc),
                "the port refused the MTU; using 1500 (af_packet: framesz in dpdk.vdev must \
                 hold the frame, and the peer veth needs the MTU too)"
            );
            let _ = sys::rte_eth_dev_set_mtu(id, 1500);
        }
        check(
            sys::rte_eth_dev_adjust_nb_rx_tx_desc(id, &mut nrx, &mut ntx),
            "descriptor counts",
            cfg,
        )?;
        let socket = sys::rte_eth_dev_socket_id(id) as u32;
        for q in 0..queues {
            check(
                sys::rte_eth_rx_queue_setup(id, q, nrx, socket, std::ptr::null(), pool),
                "rx queue",
                cfg,
            )?;
            check(
                sys::rte_eth_tx_queue_setup(id, q, ntx, socket, std::ptr::null()),
                "tx queue",
                cfg,
            )?;
        }
        let rc = sys::rte_eth_dev_start(id);
        if rc < 0 && cfg.port_name.starts_with("net_memif") {
            // A memif client connects to its server's socket when started; a server that is
            // not there yet is no error: the device starts the port once it is.
            tracing::warn!(
                port = %cfg.port_name, error = %sys::strerror(-rc),
                "memif peer not there yet; starting the port when it is"
            );
            started = false;
        } else {
            check(rc, "start", cfg)?;
        }
        check(sys::rte_eth_macaddr_get(id, &mut mac), "MAC address", cfg)?;
        if let Some(m) = own_mtu {
            mtu = m;
        } else if sys::rte_eth_dev_get_mtu(id, &mut mtu) != 0 || mtu < 576 {
            mtu = 1500;
        }
    }
    // The pool's data room bounds a single-segment frame.
    let room = usize::from(room) - sys::RTE_PKTMBUF_HEADROOM as usize;
    let mtu = mtu.min((room - 14) as u16);
    Ok(Port {
        id,
        pool,
        mac: mac.addr_bytes,
        mtu,
        started,
        queues,
    })
}

/// The kernel interface that has `addr` configured in this network namespace, if any.
pub fn kernel_interface_with(addr: Ipv4Addr) -> Option<String> {
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we free below.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return None;
    }
    let mut found = None;
    let mut p = ifap;
    while !p.is_null() {
        // SAFETY: a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_addr is a valid sockaddr; we read sin_addr only for AF_INET ones.
        unsafe {
            if i32::from((*ifa.ifa_addr).sa_family) != libc::AF_INET {
                continue;
            }
            let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
            if Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)) == addr {
                found = Some(
                    std::ffi::CStr::from_ptr(ifa.ifa_name)
                        .to_string_lossy()
                        .into_owned(),
                );
                break;
            }
        }
    }
    // SAFETY: the list from getifaddrs, freed once; `found` holds a copy of the name.
    unsafe { libc::freeifaddrs(ifap) };
    found
}

/// Refuses a port address the kernel also has: the kernel would answer the port's TCP
/// segments with resets (it knows no such connection) and its ARP replies would race ours.
pub fn check_kernel_address(cfg: &DpdkConfig) -> Result<()> {
    if let Some(ifname) = kernel_interface_with(cfg.addr) {
        bail!(
            "dpdk.addr {} is also configured on kernel interface {ifname}: the kernel would \
             reset the DPDK port's TCP connections. Remove it from the kernel \
             (ip addr del {}/{} dev {ifname}); the DPDK port owns that address",
            cfg.addr,
            cfg.addr,
            cfg.prefix_len
        );
    }
    Ok(())
}
