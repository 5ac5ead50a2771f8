//! Harness for the integration tests: starts a real `rdsd` binary on a private control socket,
//! and real app processes (`rds-testapp`), and cleans both up.

use std::io::{BufRead, BufReader};
use std::net::SocketAddrV4;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Directory holding the workspace's binaries: the test executable runs from
/// `target/<profile>/deps/`, the binaries sit in `target/<profile>/`.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().expect("exe dir");
    if dir.ends_with("deps") {
        dir.parent().expect("profile dir").to_path_buf()
    } else {
        dir.to_path_buf()
    }
}

fn workspace_bin(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    assert!(
        p.exists(),
        "{} missing: run `cargo build --workspace --bins` first",
        p.display()
    );
    p
}

/// Path of the `rdsd` binary. The README's test command builds it before running tests.
pub fn rdsd_bin() -> PathBuf {
    workspace_bin("rdsd")
}

/// rdsd built with its `fault-injection` feature (the test-only `--fault` hooks of
/// `dataplane/src/fault.rs`), for the tests that stall the poll core or error RDMA QPs.
///
/// It is built into its own target directory, `target/fault-injection/`, by `cargo build
/// --features fault-injection` (once per test process; a no-op when up to date), never by a
/// dependency of this crate: a workspace member that enabled the feature would, through
/// feature unification, put the hooks into the ordinary `rdsd` that `cargo build --workspace`
/// ships.
pub fn rdsd_fault_bin() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let profile_dir = bin_dir();
            let profile = profile_dir.file_name().expect("profile").to_owned();
            let target_dir = profile_dir
                .parent()
                .expect("target dir")
                .join("fault-injection");
            let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../dataplane/Cargo.toml");
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let mut cmd = Command::new(cargo);
            cmd.args([
                "build",
                "-q",
                "--bin",
                "rdsd",
                "--features",
                "fault-injection",
            ])
            .arg("--manifest-path")
            .arg(&manifest)
            .arg("--target-dir")
            .arg(&target_dir);
            if profile == "release" {
                cmd.arg("--release");
            }
            let status = cmd.status().expect("run cargo");
            assert!(
                status.success(),
                "cargo build --features fault-injection failed ({status})"
            );
            let bin = target_dir.join(profile).join("rdsd");
            assert!(bin.exists(), "{} missing after the build", bin.display());
            bin
        })
        .clone()
}

/// Path of the test app binary.
pub fn testapp_bin() -> PathBuf {
    workspace_bin("rds-testapp")
}

/// A running rdsd on its own control socket. Killed on drop.
pub struct Daemon {
    /// The process.
    pub child: Option<Child>,
    /// Its control socket.
    pub socket: PathBuf,
    extra: Vec<String>,
    env: Vec<(String, String)>,
    netns: Option<String>,
    bin: PathBuf,
}

impl Daemon {
    /// Starts rdsd with `extra` flags on a fresh control socket and waits until it serves.
    pub fn start(extra: &[&str]) -> Daemon {
        Daemon::start_in(None, extra)
    }

    /// Starts rdsd inside network namespace `netns` (if given).
    pub fn start_in(netns: Option<&str>, extra: &[&str]) -> Daemon {
        Daemon::start_full(netns, &[], extra)
    }

    /// Starts rdsd with extra environment variables and `extra` flags.
    pub fn start_env(env: &[(&str, &str)], extra: &[&str]) -> Daemon {
        Daemon::start_full(None, env, extra)
    }

    /// Starts the fault-injection build of rdsd ([`rdsd_fault_bin`]) with `hooks` armed (each
    /// `(name, value)` a `--fault name=value`, `dataplane/src/fault.rs`) and `extra` flags.
    pub fn start_with_faults(hooks: &[(&str, &str)], extra: &[&str]) -> Daemon {
        let flags: Vec<String> = hooks
            .iter()
            .flat_map(|(k, v)| ["--fault".to_string(), format!("{k}={v}")])
            .chain(extra.iter().map(|s| s.to_string()))
            .collect();
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        Daemon::start_bin(rdsd_fault_bin(), None, &[], &flags)
    }

    fn start_full(netns: Option<&str>, env: &[(&str, &str)], extra: &[&str]) -> Daemon {
        Daemon::start_bin(rdsd_bin(), netns, env, extra)
    }

    fn start_bin(
        bin: PathBuf,
        netns: Option<&str>,
        env: &[(&str, &str)],
        extra: &[&str],
    ) -> Daemon {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let socket =
            std::env::temp_dir().join(format!("rdsd-test-{}-{n}.sock", std::process::id()));
        let mut d = Daemon {
            child: None,
            socket,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            netns: netns.map(str::to_string),
            bin,
        };
        d.spawn();
        d
    }

    /// (Re)starts the process on the same socket.
    pub fn spawn(&mut self) {
        let mut cmd = match &self.netns {
            // `ip netns exec` execs rdsd itself, so the child pid is rdsd's.
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(&self.bin);
                c
            }
            None => Command::new(&self.bin),
        };
        cmd.arg("--control-socket").arg(&self.socket);
        // Tests share two cores: never pin, and let the poll threads park when idle.
        // `RDSD_TESTS_POLL_THREADS=N` runs every test daemon with N poll threads (run.sh runs
        // the socket, hostile and delivery suites again with 2).
        if !self.extra.iter().any(|a| a == "--poll-core") {
            for _ in 0..poll_threads() {
                cmd.args(["--poll-core", "-2"]);
            }
        }
        // `RDSD_TESTS_PLACEMENT=socket`: each test process's sockets spread over the poll
        // threads (run.sh runs the socket and delivery suites so with 2).
        if let Ok(p) = std::env::var("RDSD_TESTS_PLACEMENT") {
            if !self.extra.iter().any(|a| a == "--placement") {
                cmd.args(["--placement", &p]);
            }
        }
        // `RDSD_TESTS_LOG=debug` (or any `--log` filter) to see a failing run's daemons.
        let log = std::env::var("RDSD_TESTS_LOG").unwrap_or_else(|_| "warn".into());
        cmd.args(["--control-core", "-2", "--log", &log]);
        cmd.args(&self.extra);
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd.stdout(Stdio::null()).stderr(Stdio::inherit());
        let child = cmd.spawn().expect("spawn rdsd");
        self.child = Some(child);
        wait_for(
            || shm_api::Rdsd::attach_at(&self.socket).is_ok(),
            Duration::from_secs(20),
            "rdsd to serve",
        );
    }

    /// Attaches this process to the daemon.
    pub fn attach(&self) -> shm_api::Rdsd {
        shm_api::Rdsd::attach_at(&self.socket).expect("attach")
    }

    /// rdsd's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Sends `sig` to rdsd.
    pub fn signal(&self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, sig) };
        }
    }

    /// SIGKILLs rdsd and reaps it.
    /// Starts it again (after [`Daemon::kill`]) with `extra` flags instead of the first ones
    /// (same control socket and state file).
    pub fn spawn_with(&mut self, extra: &[&str]) {
        self.extra = extra.iter().map(|s| s.to_string()).collect();
        self.spawn();
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// rdsd's counters (`name value` lines), read over the control socket without attaching
    /// (no region, no `apps_attached`/`apps_detached` of its own, no poll-core pass). The
    /// transports' protocol counters in it are summed lazily (every 256 passes and before the
    /// poll core parks); [`Daemon::exact_stats`] makes them exact first.
    pub fn stats(&self) -> String {
        shm_api::stats_at(&self.socket).expect("stats")
    }

    /// Counter `name` from [`Daemon::stats`].
    /// `rdsctl info --json` with `sections` (`-n`, `-g`, ...), parsed.
    pub fn info_json(&self, sections: &[&str]) -> serde_json::Value {
        let out = Command::new(bin_dir().join("rdsctl"))
            .arg("-s")
            .arg(&self.socket)
            .arg("info")
            .args(sections)
            .arg("--json")
            .output()
            .expect("rdsctl");
        assert!(out.status.success(), "rdsctl: {out:?}");
        serde_json::from_slice(&out.stdout).expect("json")
    }

    pub fn stat(&self, name: &str) -> u64 {
        stat_from(&self.stats(), name)
    }

    /// Like [`Daemon::stats`], but with every lazily summed counter exact as of one poll-core
    /// pass: an `Info` request for the sockets section is answered by the poll core between two
    /// passes, and it publishes the transports' counters before answering. Two calls always
    /// have at least one whole pass between them (the poll core takes every queued command at
    /// the start of a pass and answers only after taking them).
    pub fn exact_stats(&self) -> String {
        shm_api::info_at(&self.socket, shm_api::ctrl::INFO_SOCKETS).expect("info snapshot");
        self.stats()
    }

    /// Counter `name` from [`Daemon::exact_stats`].
    pub fn exact_stat(&self, name: &str) -> u64 {
        stat_from(&self.exact_stats(), name)
    }

    /// True while rdsd runs (started, and neither exited nor killed; a zombie is not running).
    pub fn running(&self) -> bool {
        let Some(c) = &self.child else { return false };
        std::fs::read_to_string(format!("/proc/{}/stat", c.id()))
            .ok()
            .and_then(|s| {
                Some(
                    s.get(s.rfind(')')? + 2..)?
                        .starts_with(['R', 'S', 'D', 't', 'T']),
                )
            })
            .unwrap_or(false)
    }

    /// Thread id of rdsd's poll thread (`rdsd-poll-0`).
    pub fn poll_thread(&self) -> u32 {
        self.poll_thread_at(0)
    }

    /// The thread id of poll thread `k` (`rdsd-poll-k`).
    pub fn poll_thread_at(&self, k: usize) -> u32 {
        let name = format!("rdsd-poll-{k}");
        let pid = self.pid();
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("rdsd's tasks");
        tasks
            .filter_map(Result::ok)
            .find(|t| {
                std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == name)
            })
            .and_then(|t| t.file_name().to_str()?.parse().ok())
            .unwrap_or_else(|| panic!("{name} thread"))
    }

    /// True while the poll thread sleeps in `nanosleep`: it does so only in the test-only stall
    /// hook (`--fault stall-poll-ms`; idling yields and parks in `poll`).
    pub fn poll_core_stalled(&self) -> bool {
        wait_channel(self.pid(), self.poll_thread()).contains("nanosleep")
    }

    /// Starts a test app process: `rds-testapp <args>` attached to this daemon.
    pub fn app(&self, args: &[&str]) -> App {
        App::spawn(&self.socket, args)
    }
}

/// Idle passes ask no path whether it is ready (issue 17, `Link::ready_epoch`): over half a
/// second without traffic, each daemon's `{prefix}_path_checks` grow by at most 2 per pass
/// (`{prefix}_passes`). Without the epoch every path is asked every pass; a timer's segment
/// (a keep-alive and its ACK) moves the epoch, and the pass after asks every path once.
pub fn assert_idle_passes_ask_no_path(daemons: [&Daemon; 2], prefix: &str, paths: u8) {
    let names = [format!("{prefix}_passes"), format!("{prefix}_path_checks")];
    let read = |d: &Daemon| {
        let s = d.exact_stats();
        [stat_from(&s, &names[0]), stat_from(&s, &names[1])]
    };
    // The last ACKs and acknowledgement queries go by, then a quiet stretch is counted.
    std::thread::sleep(Duration::from_millis(300));
    let before = daemons.map(read);
    std::thread::sleep(Duration::from_millis(500));
    let after = daemons.map(read);
    for (d, side) in ["active", "passive"].iter().enumerate() {
        let passes = after[d][0] - before[d][0];
        let checks = after[d][1] - before[d][1];
        eprintln!("{prefix}, {side}, {paths} paths idle: {checks} path checks in {passes} passes");
        assert!(passes > 0, "{side}: the stats reads cost a pass");
        assert!(
            checks <= 2 * passes,
            "{prefix}, {side}: {checks} readiness checks in {passes} idle passes with {paths} paths up"
        );
    }
}

/// Reads counter `name` out of a stats text.
pub fn stat_from(stats: &str, name: &str) -> u64 {
    stats
        .lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .and_then(|r| r.strip_prefix(' '))
                .map(|v| v.trim().parse().expect("number"))
        })
        .unwrap_or_else(|| panic!("no counter {name} in:\n{stats}"))
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// A running `rds-testapp`; its stdout lines are readable. Killed on drop.
pub struct App {
    /// The process.
    pub child: Child,
    lines: BufReader<std::process::ChildStdout>,
}

impl App {
    fn spawn(socket: &Path, args: &[&str]) -> App {
        let mut child = Command::new(testapp_bin())
            .env("RDSD_SOCKET", socket)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn rds-testapp");
        let lines = BufReader::new(child.stdout.take().expect("stdout"));
        App { child, lines }
    }

    /// Next stdout line (panics at EOF).
    pub fn line(&mut self) -> String {
        let mut s = String::new();
        let n = self.lines.read_line(&mut s).expect("read app stdout");
        assert!(
            n > 0,
            "app exited early (status {:?})",
            self.child.try_wait()
        );
        s.trim_end().to_string()
    }

    /// Reads lines until one starts with `prefix`; returns the rest of it.
    pub fn expect(&mut self, prefix: &str) -> String {
        loop {
            let l = self.line();
            assert!(!l.starts_with("FAIL"), "app reported: {l}");
            if let Some(rest) = l.strip_prefix(prefix) {
                return rest.trim().to_string();
            }
        }
    }

    /// Like [`App::expect`], but panics if no matching line arrives within `limit` (a hung
    /// app fails the test instead of blocking it). Relies on the app writing whole lines.
    pub fn expect_within(&mut self, prefix: &str, limit: Duration) -> String {
        use std::os::fd::AsRawFd;
        let deadline = Instant::now() + limit;
        loop {
            if !self.lines.buffer().contains(&b'\n') {
                let left = deadline.saturating_duration_since(Instant::now());
                let fd = self.lines.get_ref().as_raw_fd();
                let rev = shm_api::sys::poll_one(fd, libc::POLLIN, left.as_millis() as i32)
                    .expect("poll app stdout");
                assert!(
                    rev != 0,
                    "timed out after {limit:?} waiting for app line {prefix:?}"
                );
            }
            let l = self.line();
            assert!(!l.starts_with("FAIL"), "app reported: {l}");
            if let Some(rest) = l.strip_prefix(prefix) {
                return rest.trim().to_string();
            }
        }
    }

    /// Waits up to `limit` for exit; `None` if the app is still running then.
    pub fn wait_within(&mut self, limit: Duration) -> Option<i32> {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return Some(st.code().unwrap_or(-1));
            }
            if start.elapsed() >= limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for exit and returns the exit code.
    pub fn wait(mut self) -> i32 {
        let st = self.child.wait().expect("wait");
        st.code().unwrap_or(-1)
    }

    /// SIGKILLs the app.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends a signal.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, sig) };
    }
}

impl Drop for App {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits for observable state instead of sleeping: reads `observe` (a counter, a flag, a
/// process state) every 10 ms until `done` accepts the value, and returns that value. Panics
/// after `limit` naming `what` and the last value read. Give `limit` room for a machine loaded
/// by other builds: it only bounds a hang, a passing run never waits for it.
pub fn wait_until<T: std::fmt::Debug>(
    limit: Duration,
    what: &str,
    mut observe: impl FnMut() -> T,
    mut done: impl FnMut(&T) -> bool,
) -> T {
    let start = Instant::now();
    loop {
        let v = observe();
        if done(&v) {
            return v;
        }
        assert!(
            start.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}; last observed: {v:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Polls `f` until it is true, or panics after `limit` ([`wait_until`] for a plain condition).
pub fn wait_for(mut f: impl FnMut() -> bool, limit: Duration, what: &str) {
    wait_until(limit, what, &mut f, |&ok| ok);
}

/// The kernel function thread `tid` of process `pid` sleeps in (`/proc/PID/task/TID/wchan`:
/// `futex_do_wait`, `hrtimer_nanosleep`, ...), empty while it runs. Lets a test wait until a
/// process really blocks where it should.
pub fn wait_channel(pid: u32, tid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/wchan")).unwrap_or_default()
}

/// True while process `pid`'s main thread sleeps on a futex (a blocking `recv` of the library
/// waits on the slot's futex).
pub fn blocked_on_futex(pid: u32) -> bool {
    wait_channel(pid, pid).contains("futex")
}

/// `127.0.0.1:port`.
pub fn lo(port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, port)
}

/// Payload that carries its sequence number, for exactly-once / in-order checks.
pub fn seq_payload(seq: u64, len: usize) -> Vec<u8> {
    let mut v = vec![(seq % 251) as u8; len.max(8)];
    v[..8].copy_from_slice(&seq.to_le_bytes());
    v
}

/// The sequence number in a [`seq_payload`].
pub fn payload_seq(p: &[u8]) -> u64 {
    u64::from_le_bytes(p[..8].try_into().expect("8 bytes"))
}

/// A 64 B request/reply exchange between a socket of `d0` bound to `a0` and one of `d1` bound
/// to `a1`, for `total` round trips; the reply side runs in a thread. The tests that count
/// the work per round trip (`pass_cost`, `dpdk_pass_cost`) drive it.
pub struct PingPong {
    s0: shm_api::Socket,
    _r0: shm_api::Rdsd,
    to: SocketAddrV4,
    buf: [u8; 64],
    echo: std::thread::JoinHandle<(shm_api::Socket, shm_api::Rdsd)>,
    spin: bool,
    echo_tid: u32,
}

/// A receive that never sleeps in rdsd's library: non-blocking tries (the socket must be
/// non-blocking), yielding the CPU between them (so that no poll thread has a futex to wake),
/// until `timeout`.
pub fn recv_spinning(
    s: &shm_api::Socket,
    buf: &mut [u8],
    timeout: Duration,
) -> std::io::Result<(usize, SocketAddrV4)> {
    let until = Instant::now() + timeout;
    loop {
        match s.recv_from(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < until => {
                std::thread::yield_now()
            }
            r => return r,
        }
    }
}

impl PingPong {
    /// Binds both sockets (receive timeout `timeout`) and starts the reply side.
    pub fn start(
        d0: &Daemon,
        a0: SocketAddrV4,
        d1: &Daemon,
        a1: SocketAddrV4,
        total: u64,
        timeout: Duration,
    ) -> PingPong {
        Self::start_on([d0.attach(), d1.attach()], [a0, a1], total, timeout, false)
    }

    /// The same from attachments the caller made (to choose their poll threads: `apps[0]`
    /// binds `addrs[0]` and sends the requests), with both sides receiving without ever
    /// blocking in the library (non-blocking tries and `sched_yield`): a poll thread then
    /// never has an app thread to wake, so its steady state can be checked for system calls.
    pub fn start_spinning_on(
        apps: [shm_api::Rdsd; 2],
        addrs: [SocketAddrV4; 2],
        total: u64,
        timeout: Duration,
    ) -> PingPong {
        Self::start_on(apps, addrs, total, timeout, true)
    }

    fn start_on(
        [r0, r1]: [shm_api::Rdsd; 2],
        [a0, a1]: [SocketAddrV4; 2],
        total: u64,
        timeout: Duration,
        spin: bool,
    ) -> PingPong {
        let (s0, s1) = (r0.socket().unwrap(), r1.socket().unwrap());
        s0.bind(a0).unwrap();
        s1.bind(a1).unwrap();
        for s in [&s0, &s1] {
            s.set_recv_timeout(Some(timeout)).unwrap();
            s.set_nonblocking(spin).unwrap();
        }
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let echo = std::thread::spawn(move || {
            // SAFETY: gettid takes no argument and cannot fail.
            let _ = tid_tx.send(unsafe { libc::syscall(libc::SYS_gettid) } as u32);
            let mut buf = [0u8; 64];
            for _ in 0..total {
                let (n, from) = if spin {
                    recv_spinning(&s1, &mut buf, timeout)
                } else {
                    s1.recv_from(&mut buf)
                }
                .expect("request");
                s1.send_to(&buf[..n], from).expect("reply");
            }
            (s1, r1)
        });
        PingPong {
            s0,
            _r0: r0,
            to: a1,
            buf: [0; 64],
            echo,
            spin,
            echo_tid: tid_rx.recv().expect("the reply side's thread id"),
        }
    }

    /// The thread id of the reply side (it does nothing but receive and reply until its
    /// `total` round trips are done: what an app's thread costs, to strace).
    pub fn echo_tid(&self) -> u32 {
        self.echo_tid
    }

    /// Round trip `seq`: its reply must come back in order, exactly once.
    pub fn round_trip(&mut self, seq: u64) {
        self.s0
            .send_to(&seq_payload(seq, 64), self.to)
            .expect("request");
        let (n, _) = if self.spin {
            recv_spinning(&self.s0, &mut self.buf, Duration::from_secs(10))
        } else {
            self.s0.recv_from(&mut self.buf)
        }
        .expect("reply");
        assert_eq!(
            payload_seq(&self.buf[..n]),
            seq,
            "replies in order, exactly once"
        );
    }

    /// Waits for the reply side to have answered its `total` requests.
    pub fn finish(self) {
        self.echo.join().expect("echo side");
    }
}

/// A well-behaved app (`rds-testapp pingpong`) bouncing messages between 127.0.0.1:`port` and
/// 127.0.0.1:`port + 1` through `d`: at least `count` round trips and `secs` seconds, each
/// receive within `limit_ms`. Returns once it has attached and bound (within 10 s).
pub fn traffic(d: &Daemon, port: u16, count: u64, secs: u64, limit_ms: u64) -> App {
    let (a, b) = (lo(port).to_string(), lo(port + 1).to_string());
    let mut app = d.app(&[
        "pingpong",
        &a,
        &b,
        &count.to_string(),
        &secs.to_string(),
        &limit_ms.to_string(),
    ]);
    app.expect_within("started", Duration::from_secs(10));
    app
}

/// Waits up to `limit` for a [`traffic`] app to report; returns its round trips.
pub fn traffic_done(app: &mut App, limit: Duration) -> u64 {
    let l = app.expect_within("pingpong", limit);
    eprintln!("well-behaved traffic: pingpong {l}");
    l.split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .expect("round trips")
}

/// Checks the `done got G gaps N missing M restarts R` line of the test app's
/// `recv-resilient` after one restart of host `victim` (1: the receiver's rdsd): at most one
/// gap, at the restart point, and a receiver whose rdsd restarted re-attached once.
pub fn assert_one_restart(done: &str, victim: usize) {
    let f: Vec<u64> = done
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(f[1] <= 1, "at most one gap at the restart point: {done}");
    if victim == 1 {
        assert_eq!(f[3], 1, "the receiver re-attached once: {done}");
    }
}

/// Writes a TOML config for rdsd into a fresh temp file and returns its path (pass it with
/// `-c PATH`).
pub fn config_file(toml: &str) -> PathBuf {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let p = std::env::temp_dir().join(format!("rdsd-test-{}-{n}.toml", std::process::id()));
    std::fs::write(&p, toml).expect("write config");
    p
}

pub mod netns;
pub mod raw;
pub mod vmlab;

/// True when the tests run in CI (`CI` set to anything but empty, `0` or `false`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

/// What to do about a missing prerequisite (see [`skip_or_fail`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Missing {
    /// In CI: fail the test with this message (it names the install step).
    Fail(String),
    /// Elsewhere: report the skip with this message and return.
    Skip(String),
}

/// The decision, apart from its effects (unit-tested below).
pub fn missing(in_ci: bool, test: &str, why: &str, install: &str) -> Missing {
    if in_ci {
        Missing::Fail(format!(
            "{test}: prerequisite missing in CI: {why}; install step: {install}"
        ))
    } else {
        Missing::Skip(format!(
            "SKIPPED {test}: {why} (NOT TESTED; to run it: {install})"
        ))
    }
}

/// File where skips are counted (one line each) for the summary `tests/run.sh` prints.
pub fn skips_file() -> PathBuf {
    bin_dir()
        .parent()
        .map_or_else(std::env::temp_dir, Path::to_path_buf)
        .join("rdsd-test-skips.txt")
}

/// A test cannot run here because `why`; `install` is the step that provides what is missing.
/// In CI ([`in_ci`]) the test fails with both; elsewhere the skip is printed loudly and added
/// to [`skips_file`] (which `tests/run.sh` counts and prints at the end), and the caller must
/// return at once: a skip never reads as a pass. Use it through [`require!`].
pub fn skip_or_fail(why: &str, install: &str) {
    let current = std::thread::current();
    let test = current.name().unwrap_or("test");
    match missing(in_ci(), test, why, install) {
        Missing::Fail(msg) => panic!("{msg}"),
        Missing::Skip(msg) => {
            eprintln!("\n*** {msg} ***\n");
            use std::io::Write;
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(skips_file())
            {
                let _ = writeln!(f, "{msg}");
            }
        }
    }
}

/// `require!(check, install)`: `check` is a `Result<_, impl Display>`; on `Err(why)` the
/// prerequisite is missing ([`skip_or_fail`]) and the enclosing function returns
/// `Default::default()` (a test returns `()`, a lab builder `None`).
#[macro_export]
macro_rules! require {
    ($check:expr, $install:expr $(,)?) => {
        if let Err(why) = $check {
            $crate::skip_or_fail(&why.to_string(), $install);
            return Default::default();
        }
    };
}

/// `Ok` as root, else why not (for [`require!`]).
pub fn root() -> Result<(), &'static str> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        Ok(())
    } else {
        Err("needs root")
    }
}

/// Install step for tests that need root: the suite runs as root in CI.
pub const AS_ROOT: &str = "run the suite as root: sudo -E bash tests/run.sh";

/// The `[dpdk]` line for `RDSD_TESTS_DPDK_QUEUES=N` (a queue pair per poll thread; run.sh
/// runs the DPDK suite so with 2 poll threads), unless `lines` set `queues` themselves.
pub fn dpdk_queues_line(lines: &str) -> String {
    let n: u16 = std::env::var("RDSD_TESTS_DPDK_QUEUES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    if n > 1 && !lines.contains("queues") {
        format!("queues = {n}\n")
    } else {
        String::new()
    }
}

/// Poll threads of every daemon a test starts: `RDSD_TESTS_POLL_THREADS`, 1 by default.
pub fn poll_threads() -> usize {
    std::env::var("RDSD_TESTS_POLL_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

/// `strace -c` attached to one daemon's first poll thread: the system calls it makes from
/// [`PollThreadSyscalls::attach`] until [`PollThreadSyscalls::finish`]. `None` when strace is
/// not installed (a failure in CI, where tests/run.sh installs it).
pub struct PollThreadSyscalls {
    child: Child,
    out: PathBuf,
}

impl PollThreadSyscalls {
    pub fn attach(d: &Daemon) -> Option<PollThreadSyscalls> {
        Self::attach_at(d, 0)
    }

    /// The same for poll thread `k`.
    pub fn attach_at(d: &Daemon, k: usize) -> Option<PollThreadSyscalls> {
        Self::attach_thread(d.pid(), d.poll_thread_at(k), &format!("rdsd-poll-{k}"))
    }

    /// The same for thread `tid` of process `pid` (`what` names it in a failure): an app's
    /// thread, this test's own.
    pub fn attach_thread(pid: u32, tid: u32, what: &str) -> Option<PollThreadSyscalls> {
        if !strace_installed() {
            return None;
        }
        static N: AtomicU32 = AtomicU32::new(0);
        let out = std::env::temp_dir().join(format!(
            "strace-{}-{}.txt",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let child = Command::new("strace")
            .args(["-c", "-o"])
            .arg(&out)
            .args(["-p", &tid.to_string()])
            .stderr(Stdio::null())
            .spawn()
            .expect("strace");
        // Counting starts once strace has attached to the thread.
        wait_until(
            Duration::from_secs(10),
            &format!("strace to attach to {what} (its TracerPid)"),
            || tracer_of(pid, tid),
            |&tracer| tracer == child.id(),
        );
        Some(PollThreadSyscalls { child, out })
    }

    /// Stops counting; returns strace's summary and its calls per system call name.
    pub fn finish(self) -> (String, std::collections::HashMap<String, u64>) {
        // SAFETY: kill(2) on our own child's pid; SIGINT makes strace print its summary.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        self.child.wait_with_output().expect("strace ends");
        let text = std::fs::read_to_string(&self.out).unwrap_or_else(|e| {
            panic!(
                "no strace summary ({e}): could strace attach to the poll thread (ptrace allowed)?"
            )
        });
        let _ = std::fs::remove_file(&self.out);
        let counts = strace_counts(&text);
        (text, counts)
    }
}

/// The pid tracing thread `tid` of process `pid` (0: none), from its `status`.
fn tracer_of(pid: u32, tid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Whether strace runs here; its absence fails in CI, where tests/run.sh installs it.
pub fn strace_installed() -> bool {
    let ok = Command::new("strace")
        .arg("-V")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok || std::env::var_os("CI").is_none(),
        "strace is missing: apt-get install strace (tests/run.sh installs it)"
    );
    ok
}

/// `strace -c` output: syscall name → calls.
pub fn strace_counts(text: &str) -> std::collections::HashMap<String, u64> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // % time, seconds, usecs/call, calls, [errors,] syscall
            let name = *f.last()?;
            let calls: u64 = f.get(3)?.parse().ok()?;
            (name != "total" && name != "syscall").then(|| (name.to_string(), calls))
        })
        .collect()
}

/// Sends numbered messages with `send` (given the number, from `*seq` on) until at least
/// `at_least` are out (counting from 0) and then `errno` (EAGAIN: the send buffer is full;
/// ENOBUFS: the port is congested) comes 50 times in a row; the other of the two restarts the
/// count. A slow poll thread (a loaded machine) only makes it take longer; past 60 s it fails.
pub fn send_until_refused(
    mut send: impl FnMut(u64) -> std::io::Result<usize>,
    seq: &mut u64,
    errno: i32,
    at_least: u64,
) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut refused = 0;
    while refused < 50 || *seq < at_least {
        assert!(
            Instant::now() < deadline,
            "{} sent, errno {errno} {refused} times in a row",
            *seq
        );
        match send(*seq) {
            Ok(_) => {
                *seq += 1;
                refused = 0;
            }
            Err(e) => {
                let got = e.raw_os_error().expect("an errno");
                assert!(got == libc::EAGAIN || got == libc::ENOBUFS, "send: {e}");
                refused = if got == errno { refused + 1 } else { 0 };
                std::thread::sleep(Duration::from_millis(2)); // paces the retries only
            }
        }
    }
}

/// A receiver `hog` (bound at `base + 1`, SO_RCVBUF 1 GiB) reads nothing while `tx` (`base`)
/// sends it 4 MiB of 8 KiB messages: twice its rx ring, below its backlog share (8 MiB). Then
/// `tx` reaches `other` (`base + 2`) at once; `tx` goes on until refused for good (the share is
/// full: `tx_held_for_backlog`, `info -r` says the hog is backed up, far below the cap), and
/// `tx2` (`base + 3`) still reaches `other`. Then the hog reads everything once, in order, and
/// `tx` sends again. The kernel's receive queue grows up to SO_RCVBUF and holds up nobody else;
/// rdsd's backlog does the same up to its share.
pub fn hog_holds_up_no_other_destination(
    d: &Daemon,
    [tx, hog, other, tx2]: [&shm_api::Socket; 4],
    base: u16,
) {
    const LEN: usize = 8 << 10;
    hog.bind(lo(base + 1)).unwrap();
    hog.set_recv_buffer_size(1 << 30).unwrap();
    other.bind(lo(base + 2)).unwrap();
    other
        .set_recv_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    tx.bind(lo(base)).unwrap();
    tx.set_nonblocking(true).unwrap();
    tx2.bind(lo(base + 3)).unwrap();
    let send = |i| tx.send_to(&seq_payload(i, LEN), lo(base + 1));
    let mut sent = 0u64;
    let deadline = Instant::now() + Duration::from_secs(20);
    while sent < 512 {
        match send(sent) {
            Ok(_) => sent += 1,
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                assert!(
                    Instant::now() < deadline,
                    "held at {sent} messages of 8 KiB"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("{e}"),
        }
    }
    // The same sender reaches another socket while the hog reads nothing.
    let mut buf = vec![0u8; 64 << 10];
    tx.set_nonblocking(false).unwrap();
    tx.send_to(b"not held up", lo(base + 2)).unwrap();
    let (n, from) = other.recv_from(&mut buf).expect("past the hog");
    assert_eq!((&buf[..n], from), (&b"not held up"[..], lo(base)));
    assert!(d.exact_stat("rx_backlogged") > 0, "{}", d.exact_stats());
    // On until refused for good: the share is full, the sender waits.
    tx.set_nonblocking(true).unwrap();
    let at_least = sent;
    send_until_refused(send, &mut sent, libc::EAGAIN, at_least);
    let stats = d.exact_stats();
    let stat = |name: &str| stat_from(&stats, name);
    assert!(stat("tx_held_for_backlog") > 0, "{stats}");
    assert_eq!(stat("rx_backlog_capped"), 0, "{stats}");
    // Ring (2 MiB), share (8 MiB), the send buffer and what was on its way.
    assert!(sent * (LEN as u64) < 16 << 20, "{sent} messages of 8 KiB");
    let q = d.info_json(&["-r"]);
    let entry = q["recv_queue"]["entries"]
        .as_array()
        .and_then(|e| e.iter().find(|e| e["port"] == base + 1))
        .unwrap_or_else(|| panic!("the hog in the receive queue: {q}"));
    assert_eq!(entry["backed_up"], true, "{entry}");
    // Another sender still reaches `other`.
    tx2.send_to(b"another sender", lo(base + 2)).unwrap();
    let (n, from) = other.recv_from(&mut buf).expect("past the held sender");
    assert_eq!((&buf[..n], from), (&b"another sender"[..], lo(base + 3)));
    // The hog reads: everything once, in order; its sender goes on.
    hog.set_recv_timeout(Some(Duration::from_secs(20))).unwrap();
    for i in 0..sent {
        let n = hog.recv(&mut buf).unwrap();
        assert_eq!((n, payload_seq(&buf[..n])), (LEN, i));
    }
    let mut again = sent;
    send_until_refused(send, &mut again, libc::EAGAIN, sent + 256);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_prerequisite_fails_in_ci_and_is_a_reported_skip_elsewhere() {
        let ci = missing(
            true,
            "t1",
            "qemu missing",
            "apt-get install qemu-system-x86",
        );
        assert_eq!(
            ci,
            Missing::Fail(
                "t1: prerequisite missing in CI: qemu missing; install step: apt-get install \
                 qemu-system-x86"
                    .into()
            )
        );
        match missing(
            false,
            "t1",
            "qemu missing",
            "apt-get install qemu-system-x86",
        ) {
            Missing::Skip(m) => {
                assert!(m.starts_with("SKIPPED t1: qemu missing"), "{m}");
                assert!(m.contains("apt-get install qemu-system-x86"), "{m}");
            }
            other => panic!("{other:?}"),
        }
    }

    fn guarded(check: Result<(), &str>, ran: &mut bool) -> Option<u32> {
        require!(check, "the install step");
        *ran = true;
        Some(1)
    }

    #[test]
    fn require_returns_early_and_counts_the_skip_outside_ci() {
        if in_ci() {
            // The CI branch panics by design; `missing` covers its message above.
            let r = std::panic::catch_unwind(|| guarded(Err("absent"), &mut false));
            assert!(r.is_err(), "a missing prerequisite fails in CI");
            return;
        }
        let file = skips_file();
        let before = std::fs::read_to_string(&file).unwrap_or_default();
        let mut ran = false;
        assert_eq!(guarded(Err("absent"), &mut ran), None);
        assert!(!ran, "the body after require! does not run");
        let after = std::fs::read_to_string(&file).unwrap_or_default();
        assert!(after.len() > before.len(), "the skip is counted");
        assert!(after.contains("absent"), "{after}");
        // Not a real skip: keep it out of the suite's summary.
        let _ = std::fs::write(&file, before);
        assert_eq!(guarded(Ok(()), &mut ran), Some(1));
        assert!(ran);
    }
}
