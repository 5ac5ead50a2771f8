//! The application API: [`Rdsd`] (an attachment to the daemon) and [`Socket`] (an RDS socket
//! with the semantics of rds(7)). Data moves through the app's shared region with no syscall;
//! only bind/options/close and blocking waits talk to the kernel.

use crate::bias_lock::{BiasedMutex, LockCounts};
use crate::ctrl::{self, HelloInfo, Reply, Request, MAX_DATAGRAM, REQUEST_LEN};
use crate::layout::{
    cong_monitor_bit, group_copy_pending, AppRegionHeader, DaemonView, RegionGeometry, SlotControl,
    DAEMON_REGION_LEN, DEFAULT_BUF, LAYOUT_VERSION, MAX_BUF, MAX_MSG_SIZE, MIN_BUF, RX_FLAG_GROUP,
    SHM_MAGIC,
};
use crate::ring::{Consumer, Producer, PushError, RawRing, Record, RecordHeader, RingMemory};
use crate::sys::{self, Mapping};
use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[path = "socket/group.rs"]
mod group;
pub use group::{is_group, GroupFilter, GroupFlags};

/// What a call runs before it may sleep: set once by a library built on this one (the C ABI
/// ends its lock-free read of the fd table there, so that closing an fd never waits for a
/// sleeping call).
static BEFORE_BLOCK: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Sets the function every call runs before it may sleep (in a blocking wait, or a request
/// to rdsd over the control socket). The first setting stays.
pub fn set_before_block(f: fn()) {
    let _ = BEFORE_BLOCK.set(f);
}

#[inline]
fn before_block() {
    if let Some(f) = BEFORE_BLOCK.get() {
        f();
    }
}

/// Default control socket path (override with `RDSD_SOCKET`).
pub const DEFAULT_CONTROL_SOCKET: &str = "/run/rdsd/rdsd.sock";

/// How long a blocked call sleeps before it checks that rdsd is still alive.
const LIVENESS_SLICE: Duration = Duration::from_millis(100);
/// Sleeps of blocking receives in this process that ended by [`sys::EitherWake`]: `First`
/// (rdsd's wake-up, a timeout or a signal) and `Second` (a sender that found the poll thread
/// parked woke the receiver directly).
static RECV_SLEEPS: [std::sync::atomic::AtomicU64; 2] = [
    std::sync::atomic::AtomicU64::new(0),
    std::sync::atomic::AtomicU64::new(0),
];
/// Sleeps (receives and sends) that lasted their whole liveness slice although what they
/// waited for had happened by its end: see [`RecvWakeups::missed`].
static MISSED_WAKEUPS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How this process's blocking receives ended their sleeps, since it started: a count that
/// tests and benchmarks read (not a clock).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecvWakeups {
    /// Woken by rdsd's poll thread after a delivery, or by the liveness slice or a signal.
    pub by_rdsd_or_timeout: u64,
    /// Woken by a sender of the same poll thread while that thread was parked: the
    /// receiver then waits for the delivery spinning, one kernel wake-up instead of two.
    pub by_sender: u64,
    /// Sleeps of blocking receives and sends that ran out their whole liveness slice (100 ms)
    /// although what they waited for was there at its end: a wake-up that never came (the
    /// app and rdsd pair a fence each around `waiters`; 0 unless that pairing is broken or
    /// the event landed in the slice's last instant).
    pub missed: u64,
}

/// This process's [`RecvWakeups`] so far.
pub fn recv_wakeups() -> RecvWakeups {
    RecvWakeups {
        by_rdsd_or_timeout: RECV_SLEEPS[0].load(Ordering::Relaxed),
        by_sender: RECV_SLEEPS[1].load(Ordering::Relaxed),
        missed: MISSED_WAKEUPS.load(Ordering::Relaxed),
    }
}

/// Whether senders wake the receivers of a parked poll thread directly (see
/// [`Client::ring_doorbell_after_send`]), and how long such a receiver then spins for the
/// delivery: `RDS_WOKEN_SPIN_US` (`off`, or microseconds). By default 200 µs on a host with 4
/// CPUs or more and off below: with fewer CPUs than busy threads, the woken receiver's spin
/// takes the CPU the poll thread needs to deliver (bench/RESULTS.md, "Wake-up after idle").
fn woken_spin() -> Option<Duration> {
    static SPIN: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        woken_spin_from(
            std::env::var("RDS_WOKEN_SPIN_US").ok().as_deref(),
            sys::online_cpus(),
        )
    })
}

/// [`woken_spin`] from the variable and the host's online CPUs: the host's, not this
/// process's CPU set, since an MPI rank bound to one core spins on that core, not on the
/// poll thread's.
fn woken_spin_from(var: Option<&str>, online_cpus: usize) -> Option<Duration> {
    match var.map(str::trim) {
        Some("off") => None,
        Some(v) => v.parse().ok().map(Duration::from_micros),
        None => (online_cpus >= 4).then(|| Duration::from_micros(200)),
    }
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

/// The error every call returns once rdsd has gone away. Attach again with [`Rdsd::attach`].
pub fn daemon_gone() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionReset,
        "rdsd is gone (its control socket closed); attach again once it is back",
    )
}

/// True if `e` is the error of [`daemon_gone`].
pub fn is_daemon_gone(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::ConnectionReset && e.raw_os_error().is_none()
}

struct Ctrl {
    sock: UnixStream,
    /// Id of the next request (ids start at 2: the Hello was 1).
    next_id: u64,
}

struct Client {
    ctrl: Mutex<Ctrl>,
    ctrl_fd: RawFd,
    region: Mapping,
    _daemon: Mapping,
    daemon_view: DaemonView,
    /// The poll thread serving this app (index of its sleep flag in the daemon region).
    poll_shard: usize,
    geometry: RegionGeometry,
    /// This app's own doorbell: one end of a datagram socketpair whose other end only rdsd
    /// holds (nothing here is shared with another app).
    doorbell: OwnedFd,
    dead: AtomicBool,
    hugetlb: bool,
    /// rdsd makes a global membarrier before a poll thread parks and this process registered
    /// for it (`DaemonHeader::park_barrier`): the doorbell check after a publish needs no
    /// fence of its own.
    light_doorbell: bool,
    /// When `check_alive` last made its poll(2), in ns since `epoch` (0 = never).
    last_alive_check: AtomicU64,
    epoch: Instant,
}

impl Client {
    fn request(&self, req: Request) -> io::Result<(Reply, Vec<OwnedFd>)> {
        if self.dead.load(Ordering::Relaxed) {
            return Err(daemon_gone());
        }
        before_block();
        let mut ctrl = self.ctrl.lock().unwrap_or_else(|p| p.into_inner());
        let fail = |e: io::Error| {
            if matches!(
                e.raw_os_error(),
                Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN)
            ) {
                self.dead.store(true, Ordering::Relaxed);
                daemon_gone()
            } else {
                e
            }
        };
        let id = ctrl.next_id;
        ctrl.next_id += 1;
        let fd = ctrl.sock.as_raw_fd();
        sys::send_with_fds(fd, &req.encode(id), &[]).map_err(fail)?;
        let mut buf = vec![0u8; MAX_DATAGRAM];
        loop {
            let (n, fds) = sys::recv_with_fds(fd, &mut buf, 0).map_err(fail)?;
            if n == 0 {
                self.dead.store(true, Ordering::Relaxed);
                return Err(daemon_gone());
            }
            let reply = Reply::decode(&buf[..n])
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad reply from rdsd"))?;
            if reply.id == 0 && reply.errno != 0 {
                // rdsd is dropping this connection and says why.
                return Err(errno(reply.errno));
            }
            if reply.id != id {
                // Not ours (a reply to an earlier request we stopped waiting for): discard.
                continue;
            }
            if reply.errno != 0 {
                return Err(errno(reply.errno));
            }
            return Ok((reply, fds));
        }
    }

    /// Errors out if rdsd is gone. One poll(2) at most every millisecond: empty non-blocking
    /// receives call this, and a busy-polling app must not pay a syscall per miss.
    fn check_alive(&self) -> io::Result<()> {
        if self.dead.load(Ordering::Relaxed) {
            return Err(daemon_gone());
        }
        let now = self.epoch.elapsed().as_nanos() as u64 + 1;
        let last = self.last_alive_check.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < 1_000_000 {
            return Ok(());
        }
        self.last_alive_check.store(now, Ordering::Relaxed);
        let rev = sys::poll_one(self.ctrl_fd, libc::POLLRDHUP, 0).unwrap_or(0);
        if rev & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR | libc::POLLNVAL) != 0 {
            self.dead.store(true, Ordering::Relaxed);
            return Err(daemon_gone());
        }
        Ok(())
    }

    /// Wakes the poll core if it parked. Costs a fence and a load unless it sleeps.
    fn ring_doorbell(&self) {
        self.ring_doorbell_for(false);
    }

    /// After a send: also wakes, in parallel with the poll core, the receivers of this poll
    /// thread that sleep in `recv` (they wait on its sleep flag as well as on their own word,
    /// see [`Socket::wait`]). A parked poll thread then costs the receiver one wake-up on the
    /// critical path instead of two in series (the poll core's, then the receiver's).
    fn ring_doorbell_after_send(&self) {
        self.ring_doorbell_for(true);
    }

    fn ring_doorbell_for(&self, wake_receivers: bool) {
        let h = self.daemon_view.header();
        if h.may_sleep.load(Ordering::Relaxed) == 0 {
            return;
        }
        // Pairs with the poll core's fence between raising its sleep flag and its last scan:
        // our publish must be visible to that scan, or the flag to this load. With the light
        // doorbell the poll core's membarrier makes that fence for us (on this thread, if it
        // runs; a thread off its CPU is ordered by the switch), so a send pays no fence.
        if self.light_doorbell {
            std::sync::atomic::compiler_fence(Ordering::SeqCst);
        } else {
            fence(Ordering::SeqCst);
        }
        let sleeping = self.daemon_view.sleeping(self.poll_shard);
        if sleeping.load(Ordering::Relaxed) != 0 {
            // EAGAIN means a ring is already queued: rdsd wakes either way.
            let _ = sys::send_dontwait(self.doorbell.as_raw_fd(), &[1]);
            if wake_receivers && woken_spin().is_some() {
                sys::futex_wake(sleeping);
            }
        }
    }

    fn slot_control(&self, slot: u32) -> &SlotControl {
        let off = self.geometry.slot_offset(slot);
        assert!(off + std::mem::size_of::<SlotControl>() <= self.region.len());
        // SAFETY: in bounds (asserted), 128-aligned (slots are page aligned), and SlotControl
        // holds only atomics and padding. The region outlives `self`.
        unsafe { &*(self.region.as_ptr().add(off) as *const SlotControl) }
    }

    fn ring(&self, off: usize, capacity: u32) -> RawRing {
        assert!(off + crate::layout::RING_HEADER_LEN + capacity as usize <= self.region.len());
        // SAFETY: the range is inside our mapping (asserted) and 128-aligned; the mapping lives
        // as long as the Client, which every Socket holding the ring keeps alive through an Arc.
        unsafe {
            RawRing::new(
                NonNull::new(self.region.as_ptr().add(off)).expect("non-null"),
                capacity as usize,
            )
        }
    }
}

/// An attachment to rdsd: one control connection and one shared region for this process.
/// Cheap to clone; sockets keep it alive.
///
/// When rdsd places sockets rather than apps on its poll threads (`placement = "socket"`, and
/// more than one poll thread), the handle spreads the sockets it opens over the threads,
/// round-robin: it opens one more attachment per poll thread the first time it needs one,
/// each asked for that thread. Each is a region and a control connection of its own, and
/// counts against rdsd's per-uid limits; if rdsd refuses one, sockets meant for that thread
/// stay on the first attachment.
#[derive(Clone)]
pub struct Rdsd {
    client: Arc<Client>,
    spread: Option<Arc<Spread>>,
}

/// A process's attachments, one per poll thread (`placement = "socket"`).
struct Spread {
    path: PathBuf,
    /// The next socket's poll thread, modulo `clients.len()`.
    next: AtomicUsize,
    /// Per poll thread: its attachment, once opened (the first one's own thread from the
    /// start; the first one too where rdsd refused another).
    clients: Mutex<Vec<Option<Arc<Client>>>>,
}

impl Spread {
    fn client_for_next_socket(&self, fallback: &Arc<Client>) -> Arc<Client> {
        let mut clients = lock(&self.clients);
        let k = self.next.fetch_add(1, Ordering::Relaxed) % clients.len();
        // Once opened, kept: an attachment whose rdsd went away answers `daemon_gone`, as every
        // handle does (never a silent reattach to a restarted rdsd).
        if let Some(c) = &clients[k] {
            return c.clone();
        }
        if fallback.check_alive().is_err() {
            return fallback.clone();
        }
        let c = match Rdsd::connect(&self.path, Some(k as u8)) {
            Ok((c, _)) => c,
            // Refused (a per-uid limit, no memory): this thread's sockets stay on the first.
            Err(_) => fallback.clone(),
        };
        clients[k] = Some(c.clone());
        c
    }
}

impl Rdsd {
    /// Attaches to rdsd at `$RDSD_SOCKET`, or [`DEFAULT_CONTROL_SOCKET`].
    pub fn attach() -> io::Result<Rdsd> {
        let path = std::env::var_os("RDSD_SOCKET")
            .map(PathBuf::from)
            .unwrap_or_else(|| DEFAULT_CONTROL_SOCKET.into());
        Rdsd::attach_at(&path)
    }

    /// Attaches to the rdsd listening at `path`.
    ///
    /// Refusals are plain OS errors, so `raw_os_error()` tells them apart (see [`explain`] for
    /// a sentence to log): EUSERS = rdsd already serves `max_apps` apps; EDQUOT = this user's
    /// `max_apps_per_uid` or `max_regions_per_uid` limit; ETIMEDOUT = rdsd's poll core did not
    /// take the attach within `control_timeout_ms` (nothing was attached); ENOMEM = no memory
    /// for the region. A library/daemon version mismatch is an `Unsupported` error that says
    /// both versions.
    pub fn attach_at(path: &Path) -> io::Result<Rdsd> {
        let (client, info) = Rdsd::connect(path, None)?;
        let threads = (info.poll_threads as usize).min(crate::layout::MAX_POLL_THREADS);
        let spread = (info.placement == crate::ctrl::PLACEMENT_SOCKET && threads > 1).then(|| {
            let mut clients = vec![None; threads];
            let own = client.poll_shard;
            if own < threads {
                clients[own] = Some(client.clone());
            }
            Arc::new(Spread {
                path: path.to_path_buf(),
                // The first socket on the first attachment's own thread.
                next: AtomicUsize::new(own),
                clients: Mutex::new(clients),
            })
        });
        Ok(Rdsd { client, spread })
    }

    /// One attachment: the Hello (asking for poll thread `shard`, if any), the region and
    /// the daemon region mapped.
    fn connect(path: &Path, shard: Option<u8>) -> io::Result<(Arc<Client>, HelloInfo)> {
        let ctrl = sys::connect_seqpacket(path)?;
        const HELLO_ID: u64 = 1;
        let sent = sys::send_with_fds(
            ctrl.as_raw_fd(),
            &Request::Hello {
                version: LAYOUT_VERSION,
                shard,
            }
            .encode(HELLO_ID),
            &[],
        );
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let first = match sent {
            Ok(_) => sys::recv_with_fds(ctrl.as_raw_fd(), &mut buf, 0),
            Err(e) => Err(e),
        };
        let (n, mut fds) = match first {
            Ok(x) => x,
            // rdsd may have refused the connection and closed it before our Hello arrived: the
            // send fails (EPIPE), or the first receive reports the reset (ECONNRESET, which the
            // kernel hands out before queued data). Its reason is still queued for us.
            Err(e) => {
                let mut queued = None;
                for _ in 0..2 {
                    if let Ok((n, fds)) =
                        sys::recv_with_fds(ctrl.as_raw_fd(), &mut buf, libc::MSG_DONTWAIT)
                    {
                        if n > 0 {
                            queued = Some((n, fds));
                        }
                        break;
                    }
                }
                queued.ok_or(e)?
            }
        };
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                "rdsd closed the connection during attach",
            ));
        }
        if Reply::is_legacy_len(n) {
            // Only a v1 rdsd answers with a 16-byte header (it rejected our 32-byte Hello).
            return Err(version_mismatch(1));
        }
        let reply = Reply::decode(&buf[..n])
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad hello reply"))?;
        if reply.id != HELLO_ID && reply.id != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "rdsd answered a request this library never sent",
            ));
        }
        if reply.errno == libc::EPROTONOSUPPORT {
            return Err(version_mismatch(reply.value as u32));
        }
        if reply.errno != 0 {
            return Err(errno(reply.errno));
        }
        let info = HelloInfo::decode(&reply.body)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad hello body"))?;
        if fds.len() != 3 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "rdsd sent the wrong number of descriptors",
            ));
        }
        let doorbell = fds.pop().expect("3 fds");
        let daemon_fd = fds.pop().expect("3 fds");
        let region_fd = fds.pop().expect("3 fds");
        if info.daemon_region_len as usize != DAEMON_REGION_LEN {
            return Err(version_mismatch(0));
        }
        let region = Mapping::new(region_fd.as_raw_fd(), info.region_len as usize, true, false)?;
        let daemon = Mapping::new(daemon_fd.as_raw_fd(), DAEMON_REGION_LEN, false, false)?;
        if region.len() < std::mem::size_of::<AppRegionHeader>() {
            return Err(version_mismatch(0));
        }
        // SAFETY: the mapping is at least a header long (checked) and page aligned.
        let hdr = unsafe { std::ptr::read(region.as_ptr() as *const AppRegionHeader) };
        if hdr.magic != SHM_MAGIC || hdr.version != LAYOUT_VERSION {
            return Err(version_mismatch(hdr.version));
        }
        if hdr.poll_shard as usize >= crate::layout::MAX_POLL_THREADS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "region names a poll thread out of range",
            ));
        }
        let geometry = RegionGeometry {
            max_sockets: hdr.max_sockets,
            tx_ring_capacity: hdr.tx_ring_capacity,
            rx_ring_capacity: hdr.rx_ring_capacity,
        };
        geometry
            .validate()
            .map_err(|m| io::Error::new(io::ErrorKind::InvalidData, m))?;
        if geometry.region_len(1) > region.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "region smaller than its header claims",
            ));
        }
        // SAFETY: a read-only mapping of DAEMON_REGION_LEN bytes that the Client owns; the
        // library only reads through the view.
        let daemon_view = unsafe { DaemonView::new(daemon.as_ptr()) };
        let light_doorbell = daemon_view.header().park_barrier.load(Ordering::Acquire) != 0
            && sys::membarrier_register().is_ok();
        let ctrl_fd = ctrl.as_raw_fd();
        let client = Arc::new(Client {
            ctrl: Mutex::new(Ctrl {
                sock: ctrl,
                next_id: HELLO_ID + 1,
            }),
            ctrl_fd,
            region,
            _daemon: daemon,
            daemon_view,
            poll_shard: hdr.poll_shard as usize,
            geometry,
            doorbell,
            dead: AtomicBool::new(false),
            hugetlb: info.hugetlb != 0,
            light_doorbell,
            last_alive_check: AtomicU64::new(0),
            epoch: Instant::now(),
        });
        Ok((client, info))
    }

    /// Opens a new RDS socket (on the next poll thread's attachment when rdsd places
    /// sockets, see [`Rdsd`]).
    pub fn socket(&self) -> io::Result<Socket> {
        let client = match &self.spread {
            Some(s) => s.client_for_next_socket(&self.client),
            None => self.client.clone(),
        };
        let (reply, mut fds) = client.request(Request::SocketOpen)?;
        let slot = reply.value as u32;
        if slot >= client.geometry.max_sockets || fds.len() != 1 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bad socket-open reply",
            ));
        }
        let c = &client;
        let g = c.geometry;
        let tx = c.ring(g.tx_ring_offset(slot), g.tx_ring_capacity);
        let rx = c.ring(g.rx_ring_offset(slot), g.rx_ring_capacity);
        let ctl = c.slot_control(slot);
        // The slot's earlier socket may have left a wait for ring room behind.
        ctl.tx_ring_want.store(0, Ordering::Relaxed);
        Ok(Socket {
            client: client.clone(),
            slot,
            fd: fds.pop().expect("one fd"),
            readiness: AtomicBool::new(false),
            bound: AtomicU64::new(0),
            peer: AtomicU64::new(0),
            nonblocking: AtomicBool::new(false),
            monitor: AtomicBool::new(false),
            sndbuf: AtomicU32::new(DEFAULT_BUF),
            rcvbuf: AtomicU32::new(DEFAULT_BUF),
            timeouts: Mutex::new((None, None)),
            tx: BiasedMutex::new(TxSide {
                ring_want: false,
                producer: Producer::new(tx),
                sent: ctl.tx_sent_bytes.load(Ordering::Relaxed),
                released_seen: ctl.tx_released_bytes.load(Ordering::Acquire),
                room_reads: 0,
                cong_hint: usize::MAX,
            }),
            rx: BiasedMutex::new(RxSide {
                consumer: Consumer::new(rx),
                consumed: ctl.rx_consumed_bytes.load(Ordering::Relaxed),
            }),
        })
    }

    /// rdsd's counters, one `name value` per line.
    pub fn stats(&self) -> io::Result<String> {
        let (reply, _) = self.client.request(Request::Stats)?;
        Ok(String::from_utf8_lossy(&reply.body).into_owned())
    }

    /// The rdsd poll thread that serves this attachment (0 with one poll thread); with
    /// sockets spread over the poll threads, the first attachment's
    /// ([`Socket::poll_thread`] tells each socket's).
    pub fn poll_thread(&self) -> usize {
        self.client.poll_shard
    }

    /// How many attachments this handle holds (more than one when rdsd places sockets on
    /// its poll threads and this process's sockets were spread over them).
    pub fn attachments(&self) -> usize {
        self.spread.as_ref().map_or(1, |s| {
            let clients = lock(&s.clients);
            let mut seen: Vec<*const Client> = clients.iter().flatten().map(Arc::as_ptr).collect();
            seen.push(Arc::as_ptr(&self.client));
            seen.sort();
            seen.dedup();
            seen.len()
        })
    }

    /// True if this process's region is backed by hugetlbfs pages.
    pub fn uses_hugepages(&self) -> bool {
        self.client.hugetlb
    }

    /// True if a send checks whether its poll thread parked with no fence of its own: rdsd
    /// makes a global membarrier before a poll thread parks, and this process registered for
    /// it (`layout::DaemonHeader::park_barrier`). False in spin mode, where nobody parks.
    pub fn light_doorbell(&self) -> bool {
        self.client.light_doorbell
    }

    /// True unless rdsd has been seen to go away.
    pub fn is_alive(&self) -> bool {
        self.client.check_alive().is_ok()
    }

    /// Raw access to this process's own region, for isolation tests that scribble on it.
    #[doc(hidden)]
    pub fn region_for_tests(&self) -> (*mut u8, usize) {
        (self.client.region.as_ptr(), self.client.region.len())
    }

    /// Byte offset of a socket slot in the region, for isolation tests.
    #[doc(hidden)]
    pub fn slot_offset_for_tests(&self, slot: u32) -> usize {
        self.client.geometry.slot_offset(slot)
    }
}

/// rdsd's counters (`name value` per line), read over its control socket without attaching:
/// no region is created. Used by `rdsctl` and `rds-bench`.
pub fn stats_at(path: &Path) -> io::Result<String> {
    let (reply, _) = unattached_request(path, Request::Stats)?;
    Ok(String::from_utf8_lossy(&reply.body).into_owned())
}

/// rdsd's `Info` document (JSON, schema [`crate::ctrl::INFO_SCHEMA`]) for `sections`
/// (`ctrl::INFO_*`), without attaching, whole however long (asked with
/// [`crate::ctrl::INFO_WHOLE`]). Used by the C ABI's `RDS_INFO_*` tables.
pub fn info_at(path: &Path, sections: u32) -> io::Result<String> {
    let (reply, fds) = unattached_request(
        path,
        Request::Info {
            sections: sections | ctrl::INFO_WHOLE,
        },
    )?;
    let body = info_body(reply, fds)?;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// The document of an `Info` reply: its body, or, when rdsd sent it whole in a memory file
/// (`ctrl::INFO_WHOLE`), that file's bytes. The file's length must be the reply's value and
/// at most [`ctrl::MAX_INFO_DOCUMENT`]; it is read at offset 0 (rdsd's writes moved the file
/// offset both ends share).
pub fn info_body(reply: Reply, fds: Vec<OwnedFd>) -> io::Result<Vec<u8>> {
    let Some(fd) = fds.into_iter().next() else {
        return Ok(reply.body);
    };
    let bad = |why: &str| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("rdsd's info reply: {why}"),
        )
    };
    let len = usize::try_from(reply.value).unwrap_or(usize::MAX);
    if !reply.body.is_empty() || len > ctrl::MAX_INFO_DOCUMENT {
        return Err(bad("a document file with a body, or longer than the limit"));
    }
    let file = std::fs::File::from(fd);
    if file.metadata()?.len() != len as u64 {
        return Err(bad("the document file's length is not the one announced"));
    }
    let mut doc = vec![0u8; len];
    std::os::unix::fs::FileExt::read_exact_at(&file, &mut doc, 0)?;
    Ok(doc)
}

fn unattached_request(path: &Path, req: Request) -> io::Result<(Reply, Vec<OwnedFd>)> {
    let sock = sys::connect_seqpacket(path)?;
    sys::send_with_fds(sock.as_raw_fd(), &req.encode(1), &[])?;
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let (n, fds) = sys::recv_with_fds(sock.as_raw_fd(), &mut buf, 0)?;
    if Reply::is_legacy_len(n) {
        return Err(version_mismatch(1));
    }
    let reply =
        Reply::decode(&buf[..n]).ok_or_else(|| io::Error::other("malformed reply from rdsd"))?;
    if reply.errno != 0 {
        return Err(errno(reply.errno));
    }
    Ok((reply, fds))
}

/// A sentence for logs about an error from [`Rdsd::attach_at`] (or any call): the plain OS
/// errors rdsd answers with (which keep `raw_os_error()` intact) in rdsd's terms.
pub fn explain(e: &io::Error) -> String {
    let why = match e.raw_os_error() {
        Some(libc::EUSERS) => {
            "rdsd refused the attach: it already serves its maximum number of apps (max_apps)"
        }
        Some(libc::EDQUOT) => {
            "rdsd refused the attach: this user already has as many apps or regions as rdsd \
             allows one user (max_apps_per_uid / max_regions_per_uid)"
        }
        Some(libc::ETIMEDOUT) => {
            "rdsd's poll core did not take the request in time (control_timeout_ms); \
             nothing was done"
        }
        _ => return e.to_string(),
    };
    format!("{why} ({e})")
}

fn version_mismatch(daemon: u32) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!(
            "shm layout mismatch: rdsd speaks v{daemon}, this shm-api speaks v{LAYOUT_VERSION}; \
             build the application and rdsd from the same release"
        ),
    )
}

struct TxSide {
    producer: Producer<RawRing>,
    sent: u64,
    /// `SlotControl::tx_released_bytes` as last read: never ahead of rdsd's (it only grows),
    /// so `sent - released_seen` overstates what is queued and room it shows is really there.
    released_seen: u64,
    /// Times `released_seen` was read again (`Socket::send_room_reads`).
    room_reads: u64,
    cong_hint: usize,
    /// `SlotControl::tx_ring_want` is nonzero (a send found the ring full).
    ring_want: bool,
}

impl TxSide {
    /// Whether what is queued (`sent` less what rdsd released) is below `sndbuf`. rdsd's count
    /// is read only when the one last seen says no: it is on rdsd's cache line, which the poll
    /// thread writes after every burst it takes from this ring.
    #[inline]
    fn sndbuf_room(&mut self, ctl: &SlotControl, sndbuf: usize) -> bool {
        if (self.sent.wrapping_sub(self.released_seen) as usize) < sndbuf {
            return true;
        }
        self.room_reads += 1;
        self.released_seen = ctl.tx_released_bytes.load(Ordering::Acquire);
        (self.sent.wrapping_sub(self.released_seen) as usize) < sndbuf
    }
}

/// True if `m` took a record off the rx ring (not a peek, not a congestion notification).
fn took_record(m: &RecvMsg, flags: RecvFlags) -> bool {
    !flags.peek && m.cong_update.is_none()
}

/// Copies `rec` into `buf` and, unless peeking, consumes it (the ring is released later).
fn take_record(rx: &mut RxSide, rec: &Record, buf: &mut [u8], flags: RecvFlags) -> RecvMsg {
    let full = rec.header.len as usize;
    let copied = rx.consumer.read_payload(rec, buf);
    let from = SocketAddrV4::new(Ipv4Addr::from(rec.header.addr), rec.header.port);
    if !flags.peek {
        rx.consumer.consume(rec);
        rx.consumed += full as u64;
    }
    RecvMsg {
        len: if flags.trunc { full } else { copied },
        from: Some(from),
        truncated: full > buf.len(),
        cong_update: None,
    }
}

struct RxSide {
    consumer: Consumer<RawRing>,
    consumed: u64,
}

/// Flags for [`Socket::recv_msg`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecvFlags {
    /// MSG_PEEK: leave the message queued.
    pub peek: bool,
    /// MSG_TRUNC: return the full message length even if the buffer was shorter.
    pub trunc: bool,
    /// MSG_DONTWAIT: don't block this call.
    pub dontwait: bool,
}

/// What [`Socket::recv_msg`] got.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecvMsg {
    /// Bytes copied, or the full length with `RecvFlags::trunc`.
    pub len: usize,
    /// The sender (`None` for a congestion notification).
    pub from: Option<SocketAddrV4>,
    /// MSG_TRUNC in msg_flags: the message was longer than the buffer.
    pub truncated: bool,
    /// RDS_CMSG_CONG_UPDATE: ports (bit = port % 64) that became uncongested.
    pub cong_update: Option<u64>,
}

/// An RDS socket (`socket(AF_RDS, SOCK_SEQPACKET, 0)`) served by rdsd.
pub struct Socket {
    client: Arc<Client>,
    slot: u32,
    fd: OwnedFd,
    readiness: AtomicBool,
    bound: AtomicU64,
    peer: AtomicU64,
    nonblocking: AtomicBool,
    monitor: AtomicBool,
    sndbuf: AtomicU32,
    rcvbuf: AtomicU32,
    timeouts: Mutex<(Option<Duration>, Option<Duration>)>,
    /// Biased to the thread that sends (module `bias_lock`): no locked instruction per send.
    tx: BiasedMutex<TxSide>,
    /// Biased to the thread that receives.
    rx: BiasedMutex<RxSide>,
}

const PRESENT: u64 = 1 << 48;

fn pack(a: SocketAddrV4) -> u64 {
    PRESENT | (u32::from(*a.ip()) as u64) << 16 | a.port() as u64
}

fn unpack(v: u64) -> Option<SocketAddrV4> {
    (v & PRESENT != 0).then(|| SocketAddrV4::new(Ipv4Addr::from((v >> 16) as u32), v as u16))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn bad_unicast(ip: &Ipv4Addr) -> bool {
    ip.is_unspecified() || ip.is_broadcast() || ip.is_multicast()
}

impl Socket {
    /// Binds to a specific local IPv4 address. Port 0 picks a free port.
    /// EINVAL for a wildcard, broadcast or multicast address, port 1, or a second bind;
    /// EADDRINUSE if taken; EADDRNOTAVAIL if the address is not local to rdsd.
    pub fn bind(&self, addr: SocketAddrV4) -> io::Result<()> {
        if self.local_addr().is_some() || bad_unicast(addr.ip()) || addr.port() == 1 {
            return Err(errno(libc::EINVAL));
        }
        let (reply, _) = self.client.request(Request::Bind {
            slot: self.slot,
            addr: *addr.ip(),
            port: addr.port(),
        })?;
        self.bound.store(
            pack(SocketAddrV4::new(*addr.ip(), reply.value as u16)),
            Ordering::Release,
        );
        Ok(())
    }

    /// The bound address, if any.
    pub fn local_addr(&self) -> Option<SocketAddrV4> {
        unpack(self.bound.load(Ordering::Acquire))
    }

    /// Records a default destination (nothing goes on the wire).
    /// A group address (224.0.0.0/4, rdsd's multicast groups) is a destination too; rdsd then
    /// keeps POLLOUT in step with the group's flow control.
    pub fn connect(&self, addr: SocketAddrV4) -> io::Result<()> {
        if addr.ip().is_unspecified() {
            return Err(errno(libc::EDESTADDRREQ));
        }
        if addr.ip().is_broadcast() || (is_group(addr) && addr.port() == 0) {
            return Err(errno(libc::EINVAL));
        }
        let old = unpack(self.peer.load(Ordering::Acquire));
        if is_group(addr) || old.is_some_and(is_group) {
            self.group_connect(Some(addr))?;
        }
        self.peer.store(pack(addr), Ordering::Release);
        Ok(())
    }

    /// The default destination; ENOTCONN if none.
    pub fn peer_addr(&self) -> io::Result<SocketAddrV4> {
        unpack(self.peer.load(Ordering::Acquire)).ok_or_else(|| errno(libc::ENOTCONN))
    }

    /// How many times this socket's sends read rdsd's count of released send-buffer bytes. A
    /// send reads it only when the count it last saw leaves no `SO_SNDBUF` room: it sits on the
    /// line rdsd writes after every burst it takes from this socket, so a sender that read it
    /// on every message would pull that line across cores each time. A count for tests.
    pub fn send_room_reads(&self) -> u64 {
        self.tx.lock().room_reads
    }

    /// How this socket's send side and receive side were locked so far: a send or receive by
    /// the thread the side is biased to takes no locked instruction (`bias_lock`). Counts for
    /// tests.
    pub fn lock_counts(&self) -> (LockCounts, LockCounts) {
        (self.tx.counts(), self.rx.counts())
    }

    /// Sends one message to `dest`; returns its length.
    pub fn send_to(&self, buf: &[u8], dest: SocketAddrV4) -> io::Result<usize> {
        self.send_inner(buf, Some(dest), false)
    }

    /// Sends one message to the connected destination.
    pub fn send(&self, buf: &[u8]) -> io::Result<usize> {
        self.send_inner(buf, None, false)
    }

    /// `sendmsg` with MSG_DONTWAIT when `dontwait`.
    pub fn send_msg(
        &self,
        buf: &[u8],
        dest: Option<SocketAddrV4>,
        dontwait: bool,
    ) -> io::Result<usize> {
        self.send_inner(buf, dest, dontwait)
    }

    /// sendmmsg(2): sends `msgs` (payload, destination or `None` for the connected one) in
    /// order, and publishes them to rdsd together: one release of the tx ring, one update of
    /// the sent bytes and at most one doorbell for the batch instead of one per message. A
    /// blocking call waits as `send` would (publishing what it pushed before it sleeps).
    /// Returns how many were sent; if one fails after others were sent, the count so far (as
    /// sendmmsg: its error is for the next call), else its error.
    pub fn send_batch(
        &self,
        msgs: &[(&[u8], Option<SocketAddrV4>)],
        dontwait: bool,
    ) -> io::Result<usize> {
        let mut tx = self.tx.lock();
        let mut pending = false;
        let mut sent = 0;
        for &(buf, dest) in msgs {
            if let Err(e) = self.push_one(&mut tx, buf, dest, dontwait, &mut pending) {
                self.flush_tx(&mut tx, &mut pending);
                return if sent > 0 { Ok(sent) } else { Err(e) };
            }
            sent += 1;
        }
        self.flush_tx(&mut tx, &mut pending);
        Ok(sent)
    }

    fn send_inner(
        &self,
        buf: &[u8],
        dest: Option<SocketAddrV4>,
        dontwait: bool,
    ) -> io::Result<usize> {
        let mut tx = self.tx.lock();
        let mut pending = false;
        let r = self.push_one(&mut tx, buf, dest, dontwait, &mut pending);
        self.flush_tx(&mut tx, &mut pending);
        r
    }

    /// Makes what `push_one` pushed visible to rdsd: the sent bytes (for POLLOUT), the
    /// ring's producer position, and the doorbell if the poll thread sleeps.
    fn flush_tx(&self, tx: &mut TxSide, pending: &mut bool) {
        if !std::mem::take(pending) {
            return;
        }
        let c = &*self.client;
        c.slot_control(self.slot)
            .tx_sent_bytes
            .store(tx.sent, Ordering::Release);
        tx.producer.publish();
        c.ring_doorbell_after_send();
    }

    /// Pushes one message onto the tx ring, not yet published (`pending` set), waiting as a
    /// send does for congestion and send-buffer room; before it waits or gives up it
    /// publishes what is pending, so that rdsd can drain it.
    fn push_one(
        &self,
        tx: &mut TxSide,
        buf: &[u8],
        dest: Option<SocketAddrV4>,
        dontwait: bool,
        pending: &mut bool,
    ) -> io::Result<usize> {
        if let Some(d) = dest {
            // A multicast address is a group (port 0 names none).
            if d.ip().is_unspecified() || d.ip().is_broadcast() || (is_group(d) && d.port() == 0) {
                return Err(errno(libc::EINVAL));
            }
        }
        if self.local_addr().is_none() {
            return Err(errno(libc::ENOTCONN));
        }
        let dest = dest
            .or_else(|| unpack(self.peer.load(Ordering::Acquire)))
            .ok_or_else(|| errno(libc::ENOTCONN))?;
        let sndbuf = self.sndbuf.load(Ordering::Relaxed) as usize;
        if buf.len() > MAX_MSG_SIZE || buf.len() > sndbuf {
            return Err(errno(libc::EMSGSIZE));
        }
        let nonblock = dontwait || self.nonblocking.load(Ordering::Relaxed);
        let c = &*self.client;
        let ctl = c.slot_control(self.slot);
        let dest_ip = u32::from(*dest.ip());
        let mut deadline = None;
        loop {
            if c.dead.load(Ordering::Relaxed) {
                return Err(daemon_gone());
            }
            if c.daemon_view
                .is_congested(dest_ip, dest.port(), &mut tx.cong_hint)
            {
                self.flush_tx(tx, pending);
                if nonblock && is_group(dest) {
                    // A member without DROP_WHEN_FULL is full: nobody got the message.
                    return Err(errno(libc::EAGAIN));
                }
                if nonblock {
                    if self.monitor.load(Ordering::Relaxed) {
                        ctl.cong_interest
                            .fetch_or(cong_monitor_bit(dest.port()), Ordering::Release);
                    }
                    return Err(errno(libc::ENOBUFS));
                }
                let mut hint = tx.cong_hint;
                self.wait(&mut deadline, true, || {
                    !c.daemon_view.is_congested(dest_ip, dest.port(), &mut hint)
                })?;
                continue;
            }
            let room = tx.sndbuf_room(ctl, sndbuf);
            let pushed = if room {
                tx.producer
                    .push(RecordHeader::data(0, dest_ip, dest.port()), buf)
            } else {
                Err(PushError::Full)
            };
            match pushed {
                Ok(()) => {
                    tx.sent += buf.len() as u64;
                    *pending = true;
                    if std::mem::take(&mut tx.ring_want) {
                        ctl.tx_ring_want.store(0, Ordering::Relaxed);
                    }
                    return Ok(buf.len());
                }
                Err(PushError::TooLarge) => return Err(errno(libc::EMSGSIZE)),
                Err(PushError::Full) => {
                    if room {
                        // The ring is full, not SO_SNDBUF: POLLOUT waits for this room too.
                        // A record behind a pad that does not fit yet may need more than the
                        // ring: then it waits for an empty ring, and the retry writes the pad.
                        let cap = tx.producer.memory().capacity();
                        let need = tx.producer.room_needed(buf.len()).min(cap);
                        ctl.tx_ring_want.store(need as u32, Ordering::Relaxed);
                        tx.ring_want = true;
                    }
                    self.flush_tx(tx, pending);
                    if nonblock {
                        c.check_alive()?;
                        c.ring_doorbell();
                        return Err(errno(libc::EAGAIN));
                    }
                    let sent = tx.sent;
                    let producer = &mut tx.producer;
                    let need = crate::ring::record_size(buf.len());
                    self.wait(&mut deadline, true, || {
                        let q = sent.wrapping_sub(ctl.tx_released_bytes.load(Ordering::Acquire))
                            as usize;
                        q < sndbuf && producer.free_bytes() >= need
                    })?;
                }
            }
        }
    }

    /// Receives one message; returns (length, sender).
    pub fn recv_from(&self, buf: &mut [u8]) -> io::Result<(usize, SocketAddrV4)> {
        let m = self.recv_msg(buf, RecvFlags::default())?;
        // A congestion notification reads as 0 bytes from 0.0.0.0:0.
        Ok((
            m.len,
            m.from
                .unwrap_or(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)),
        ))
    }

    /// Receives one message; returns its length.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        self.recv_from(buf).map(|(n, _)| n)
    }

    /// `recvmsg` with MSG_PEEK / MSG_TRUNC / MSG_DONTWAIT. In monitor mode a pending
    /// congestion update comes first, as a 0-byte message with `cong_update` set.
    pub fn recv_msg(&self, buf: &mut [u8], flags: RecvFlags) -> io::Result<RecvMsg> {
        let mut rx = self.rx.lock();
        let m = self.recv_first(&mut rx, buf, flags)?;
        if took_record(&m, flags) {
            self.release_rx(&mut rx);
        }
        Ok(m)
    }

    /// `recvmmsg` with MSG_WAITFORONE: receives up to `bufs.len()` messages (`out[i]` tells
    /// what went into `bufs[i]`), waiting as [`Socket::recv_msg`] does for the first only,
    /// then taking what is already queued. The rx ring is released, and rdsd's doorbell rung
    /// if it sleeps, once for the whole batch rather than once a message. A congestion
    /// notification is a message of its own (returned alone or ending the batch before it),
    /// and so is MSG_PEEK's: a peek returns one message. Errors are the first message's; the
    /// batch just ends where a later one would wait (an uncommitted group copy, an empty ring).
    pub fn recv_batch(
        &self,
        bufs: &mut [&mut [u8]],
        out: &mut [RecvMsg],
        flags: RecvFlags,
    ) -> io::Result<usize> {
        let n = bufs.len().min(out.len());
        if n == 0 {
            return Ok(0);
        }
        let mut rx = self.rx.lock();
        out[0] = self.recv_first(&mut rx, bufs[0], flags)?;
        if !took_record(&out[0], flags) {
            return Ok(1);
        }
        let mut got = 1;
        while got < n {
            match self.take_ready(&mut rx, bufs[got], flags) {
                Some(m) => {
                    out[got] = m;
                    got += 1;
                }
                None => break,
            }
        }
        self.release_rx(&mut rx);
        Ok(got)
    }

    /// The next message, waiting for it unless non-blocking: what `recv_msg` does, short of
    /// releasing the ring.
    fn recv_first(&self, rx: &mut RxSide, buf: &mut [u8], flags: RecvFlags) -> io::Result<RecvMsg> {
        let nonblock = flags.dontwait || self.nonblocking.load(Ordering::Relaxed);
        let c = &*self.client;
        let ctl = c.slot_control(self.slot);
        let mut deadline = None;
        loop {
            // Once rdsd is gone, what it delivered is still read out (then the error): a
            // group message is at all its members or at none, whoever noticed first.
            let dead = c.dead.load(Ordering::Relaxed);
            if !dead && self.monitor.load(Ordering::Relaxed) {
                let mask = ctl.cong_notify.load(Ordering::Acquire);
                if mask != 0 {
                    if !flags.peek {
                        ctl.cong_notify.fetch_and(!mask, Ordering::AcqRel);
                    }
                    return Ok(RecvMsg {
                        len: 0,
                        from: None,
                        truncated: false,
                        cong_update: Some(mask),
                    });
                }
            }
            let rec = rx
                .consumer
                .peek()
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
            let pending = rec.is_some_and(|r| {
                r.header.flags & RX_FLAG_GROUP != 0
                    && group_copy_pending(ctl, &c.daemon_view, r.end())
            });
            if let Some(r) = rec.filter(|_| pending) {
                // A group copy whose fan-out is not committed yet: rdsd commits it right after
                // publishing every member's copy (then wakes the receivers that wait), or
                // never if it died in between.
                if dead || c.check_alive().is_err() {
                    return Err(daemon_gone());
                }
                if nonblock {
                    return Err(errno(libc::EAGAIN));
                }
                let committed = || !group_copy_pending(ctl, &c.daemon_view, r.end());
                if !spin_until(committed) {
                    self.wait(&mut deadline, false, committed)?;
                }
                continue;
            }
            if let Some(rec) = rec {
                return Ok(take_record(rx, &rec, buf, flags));
            }
            if dead {
                return Err(daemon_gone());
            }
            if nonblock {
                c.check_alive()?;
                return Err(errno(libc::EAGAIN));
            }
            let monitor = self.monitor.load(Ordering::Relaxed);
            let consumer = &mut rx.consumer;
            if spin_until(|| !consumer.is_empty().unwrap_or(false)) {
                continue;
            }
            self.wait(&mut deadline, false, || {
                !consumer.is_empty().unwrap_or(false)
                    || (monitor && ctl.cong_notify.load(Ordering::Acquire) != 0)
            })?;
        }
    }

    /// One more message of a batch if it can be read now: not a congestion notification
    /// (its own message), not an uncommitted group copy, not a ring that fails to parse (the
    /// next call reports it).
    fn take_ready(&self, rx: &mut RxSide, buf: &mut [u8], flags: RecvFlags) -> Option<RecvMsg> {
        let c = &*self.client;
        let ctl = c.slot_control(self.slot);
        if self.monitor.load(Ordering::Relaxed)
            && !c.dead.load(Ordering::Relaxed)
            && ctl.cong_notify.load(Ordering::Acquire) != 0
        {
            return None;
        }
        let rec = rx.consumer.peek().ok()??;
        if rec.header.flags & RX_FLAG_GROUP != 0
            && group_copy_pending(ctl, &c.daemon_view, rec.end())
        {
            return None;
        }
        Some(take_record(rx, &rec, buf, flags))
    }

    /// Hands the ring space of the messages taken back to rdsd, and the bytes to its receive
    /// accounting (SO_RCVBUF, congestion); wakes it if it sleeps.
    fn release_rx(&self, rx: &mut RxSide) {
        let c = &*self.client;
        rx.consumer.release();
        c.slot_control(self.slot)
            .rx_consumed_bytes
            .store(rx.consumed, Ordering::Release);
        if !c.dead.load(Ordering::Relaxed) {
            c.ring_doorbell();
        }
    }

    /// Blocks until `ready()` or an event from rdsd, honouring SO_SNDTIMEO/SO_RCVTIMEO
    /// (ETIMEDOUT on expiry) and noticing rdsd's death.
    fn wait(
        &self,
        deadline: &mut Option<Option<Instant>>,
        sending: bool,
        mut ready: impl FnMut() -> bool,
    ) -> io::Result<()> {
        before_block();
        let c = &*self.client;
        let ctl = c.slot_control(self.slot);
        let dl = *deadline.get_or_insert_with(|| {
            let t = lock(&self.timeouts);
            let timeout = if sending { t.0 } else { t.1 };
            timeout.map(|d| Instant::now() + d)
        });
        let seq = ctl.wake_seq.load(Ordering::Acquire);
        let me = if sending {
            crate::layout::SEND_WAITER
        } else {
            crate::layout::RECV_WAITER
        };
        ctl.waiters.fetch_add(me, Ordering::SeqCst);
        // Pairs with rdsd's fence between changing state and reading `waiters`.
        fence(Ordering::SeqCst);
        let result = if ready() {
            Ok(())
        } else {
            let now = Instant::now();
            match dl {
                Some(d) if now >= d => Err(errno(libc::ETIMEDOUT)),
                _ => {
                    let slice = dl.map_or(LIVENESS_SLICE, |d| (d - now).min(LIVENESS_SLICE));
                    c.ring_doorbell();
                    let woken_spin = woken_spin().filter(|_| !sending);
                    if let Some(limit) = woken_spin {
                        // Also on the poll thread's sleep flag: a sender that finds it parked
                        // wakes us at the same time as the poll thread.
                        let shard = c.daemon_view.sleeping(c.poll_shard);
                        let parked = shard.load(Ordering::Acquire);
                        let woke =
                            sys::futex_wait_either(&ctl.wake_seq, seq, shard, parked, Some(slice));
                        RECV_SLEEPS[woke as usize].fetch_add(1, Ordering::Relaxed);
                        if woke == sys::EitherWake::Second {
                            // The poll thread is waking at the same time and delivers within
                            // microseconds: spin for it rather than yield, which on a busy
                            // core hands the CPU away for a whole slice.
                            let start = Instant::now();
                            while !ready() && start.elapsed() < limit {
                                std::hint::spin_loop();
                            }
                        }
                    } else {
                        sys::futex_wait(&ctl.wake_seq, seq, Some(slice));
                        if !sending {
                            RECV_SLEEPS[0].fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    if ctl.wake_seq.load(Ordering::Acquire) == seq {
                        if now.elapsed() >= slice && ready() {
                            MISSED_WAKEUPS.fetch_add(1, Ordering::Relaxed);
                        }
                        c.check_alive()
                    } else {
                        Ok(())
                    }
                }
            }
        };
        ctl.waiters.fetch_sub(me, Ordering::SeqCst);
        result
    }

    /// O_NONBLOCK for later sends and receives.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.nonblocking.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// SO_SNDTIMEO (`None` = wait forever).
    pub fn set_send_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        lock(&self.timeouts).0 = t;
        Ok(())
    }

    /// SO_RCVTIMEO (`None` = wait forever).
    pub fn set_recv_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        lock(&self.timeouts).1 = t;
        Ok(())
    }

    /// SO_SNDBUF. The value is the effective limit (getsockopt on Linux reports twice it).
    pub fn set_send_buffer_size(&self, bytes: usize) -> io::Result<()> {
        let b = bytes.clamp(MIN_BUF as usize, MAX_BUF as usize) as u32;
        self.client.request(Request::SetSndBuf {
            slot: self.slot,
            bytes: b,
        })?;
        self.sndbuf.store(b, Ordering::Relaxed);
        Ok(())
    }

    /// The effective SO_SNDBUF limit.
    pub fn send_buffer_size(&self) -> usize {
        self.sndbuf.load(Ordering::Relaxed) as usize
    }

    /// SO_RCVBUF: the port becomes congested above this many queued bytes.
    pub fn set_recv_buffer_size(&self, bytes: usize) -> io::Result<()> {
        let b = bytes.clamp(MIN_BUF as usize, MAX_BUF as usize) as u32;
        self.client.request(Request::SetRcvBuf {
            slot: self.slot,
            bytes: b,
        })?;
        self.rcvbuf.store(b, Ordering::Relaxed);
        Ok(())
    }

    /// The effective SO_RCVBUF limit.
    pub fn recv_buffer_size(&self) -> usize {
        self.rcvbuf.load(Ordering::Relaxed) as usize
    }

    /// RDS_CONG_MONITOR. Turning it off clears pending notifications.
    pub fn set_cong_monitor(&self, on: bool) -> io::Result<()> {
        self.client.request(Request::SetCongMonitor {
            slot: self.slot,
            on,
        })?;
        self.monitor.store(on, Ordering::Relaxed);
        if !on {
            let ctl = self.client.slot_control(self.slot);
            ctl.cong_notify.store(0, Ordering::Release);
            ctl.cong_interest.store(0, Ordering::Release);
        }
        Ok(())
    }

    /// RDS_CANCEL_SENT_TO: drop messages queued to `dest` (every destination if `None`).
    /// ENOTCONN if unbound.
    pub fn cancel_sent_to(&self, dest: Option<SocketAddrV4>) -> io::Result<()> {
        if self.local_addr().is_none() {
            return Err(errno(libc::ENOTCONN));
        }
        self.client.request(Request::CancelSentTo {
            slot: self.slot,
            dest: dest.map(|d| (*d.ip(), d.port())),
        })?;
        Ok(())
    }

    /// The socket's pollable descriptor: POLLIN when a message or notification is queued,
    /// POLLOUT while there is send-buffer room. rdsd keeps it in sync from the first call on.
    pub fn pollable_fd(&self) -> io::Result<RawFd> {
        if !self.readiness.swap(true, Ordering::AcqRel) {
            if let Err(e) = self
                .client
                .request(Request::EnableReadiness { slot: self.slot })
            {
                self.readiness.store(false, Ordering::Release);
                return Err(e);
            }
        }
        Ok(self.fd.as_raw_fd())
    }

    /// The descriptor [`Socket::pollable_fd`] returns, without asking rdsd to keep it in sync:
    /// its readiness means nothing until `pollable_fd` is called once. For the C ABI, which
    /// hands out this fd (a dup of it) as the socket's own and turns readiness on only when the
    /// app polls it, so that apps that never poll cost the poll core no readiness syscalls.
    pub fn pollable_fd_unsynced(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// The rdsd poll thread that serves this socket.
    pub fn poll_thread(&self) -> usize {
        self.client.poll_shard
    }

    /// This socket's slot in its attachment's region.
    #[doc(hidden)]
    pub fn slot_for_tests(&self) -> u32 {
        self.slot
    }
}

impl AsRawFd for Socket {
    /// Same as [`Socket::pollable_fd`]; if rdsd can't be asked, the fd is returned anyway.
    fn as_raw_fd(&self) -> RawFd {
        let _ = self.pollable_fd();
        self.fd.as_raw_fd()
    }
}

impl Drop for Socket {
    fn drop(&mut self) {
        let _ = self.client.request(Request::Close { slot: self.slot });
    }
}

impl std::fmt::Debug for Socket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Socket")
            .field("slot", &self.slot)
            .field("local", &self.local_addr())
            .finish()
    }
}

const _: () = assert!(REQUEST_LEN == 32);

/// How long a blocking receive polls its ring, yielding the CPU between looks, before it
/// sleeps on the futex (`RDS_RECV_SPIN_US`, default 50 µs; 0 turns it off). A reply that comes
/// back within a round trip then costs no futex wake-up, and yielding (rather than spinning)
/// lets an rdsd poll thread that shares the core run meanwhile.
fn recv_spin() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        let us = std::env::var("RDS_RECV_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(50u64);
        Duration::from_micros(us)
    })
}

/// Polls `ready` with yields for up to [`recv_spin`]; true once it holds.
fn spin_until(mut ready: impl FnMut() -> bool) -> bool {
    let limit = recv_spin();
    if limit.is_zero() {
        return false;
    }
    let start = Instant::now();
    loop {
        if ready() {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_woken_spin_follows_the_hosts_cpus_and_the_variable() {
        let on = Some(Duration::from_micros(200));
        // By the host's CPU count: a rank bound to one core of a 64-CPU host still spins.
        assert_eq!(woken_spin_from(None, 64), on);
        assert_eq!(woken_spin_from(None, 4), on);
        assert_eq!(woken_spin_from(None, 2), None);
        assert_eq!(woken_spin_from(Some("off"), 64), None);
        assert_eq!(
            woken_spin_from(Some(" 50 "), 2),
            Some(Duration::from_micros(50))
        );
        assert_eq!(woken_spin_from(Some("soon"), 64), None, "unparsable: off");
    }
}
