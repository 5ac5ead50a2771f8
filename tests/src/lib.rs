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

    /// Starts rdsd with extra environment variables (e.g. test-only hooks) and `extra` flags.
    pub fn start_env(env: &[(&str, &str)], extra: &[&str]) -> Daemon {
        Daemon::start_full(None, env, extra)
    }

    fn start_full(netns: Option<&str>, env: &[(&str, &str)], extra: &[&str]) -> Daemon {
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
                c.args(["netns", "exec", ns]).arg(rdsd_bin());
                c
            }
            None => Command::new(rdsd_bin()),
        };
        cmd.arg("--control-socket").arg(&self.socket);
        // Tests share two cores: never pin, and let the poll core park when idle.
        cmd.args(["--poll-core", "-2", "--control-core", "-2", "--log", "warn"]);
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
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Counter `name` from rdsd's stats.
    pub fn stat(&self, name: &str) -> u64 {
        let s = self.attach().stats().expect("stats");
        stat_from(&s, name)
    }

    /// Starts a test app process: `rds-testapp <args>` attached to this daemon.
    pub fn app(&self, args: &[&str]) -> App {
        App::spawn(&self.socket, args)
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

/// Polls `f` until it is true, or panics after `limit`.
pub fn wait_for(mut f: impl FnMut() -> bool, limit: Duration, what: &str) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
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
