//! Finding rdsd: a running one at `--socket`, or one rds-bench starts itself.

use anyhow::{bail, Context, Result};
use shm_api::Rdsd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How to reach rdsd (flattened into every subcommand).
#[derive(clap::Args, Clone, Debug)]
pub struct DaemonArgs {
    /// Control socket of an rdsd that is already running. Without it (and without
    /// --spawn-rdsd), `rtt`, `tput`, `blocking` and `--pair` start the `rdsd` that sits next to
    /// rds-bench's executable; the active and passive sides use $RDSD_SOCKET or
    /// /run/rdsd/rdsd.sock.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Start this rdsd binary on a temporary control socket (with --idle) and stop it (SIGTERM)
    /// at the end.
    #[arg(long, conflicts_with = "socket", value_name = "PATH_TO_RDSD")]
    pub spawn_rdsd: Option<PathBuf>,
    /// Poll-thread CPU of a spawned rdsd (-1 = the last CPU this process may use, -2 = don't pin).
    #[arg(long, default_value_t = -1, allow_hyphen_values = true)]
    pub poll_core: i64,
    /// Log filter of a spawned rdsd.
    #[arg(long, default_value = "warn")]
    pub rdsd_log: String,
    /// Idle strategy of a spawned rdsd (`spin` or `backoff`, rdsd's default). Default: spin for
    /// `rtt` and `tput`; backoff for `blocking` and the default (rds-stress) mode, whose
    /// baselines run while rdsd is still up.
    #[arg(long)]
    pub idle: Option<String>,
    /// A spawned rdsd stamps traced messages (`--trace-hops`; set by `--breakdown`).
    #[arg(skip)]
    pub trace_hops: bool,
}

/// The rdsd a benchmark talks to.
pub enum Target {
    /// Someone else's: left running.
    External(PathBuf),
    /// Ours: stopped on drop.
    Spawned(Spawned),
}

impl Target {
    /// Connects to rdsd as `args` says, starting it if needed.
    pub fn open(args: &DaemonArgs) -> Result<Target> {
        if let Some(s) = &args.socket {
            return Ok(Target::External(s.clone()));
        }
        let bin = match &args.spawn_rdsd {
            Some(b) => b.clone(),
            None => {
                let exe = std::env::current_exe().context("cannot find rds-bench's own path")?;
                let b = exe.with_file_name("rdsd");
                if !b.exists() {
                    bail!(
                        "no --socket given and no rdsd next to {} to start; build it \
                         (cargo build --release -p rdsd) or pass --socket / --spawn-rdsd",
                        exe.display()
                    );
                }
                b
            }
        };
        Ok(Target::Spawned(Spawned::start(
            &bin,
            args.poll_core,
            &args.rdsd_log,
            args.idle.as_deref().unwrap_or("spin"),
            args.trace_hops,
        )?))
    }

    pub fn socket(&self) -> &Path {
        match self {
            Target::External(p) => p,
            Target::Spawned(s) => &s.socket,
        }
    }

    pub fn attach(&self) -> Result<Rdsd> {
        Rdsd::attach_at(self.socket()).with_context(|| {
            format!(
                "cannot attach to rdsd at {} (is rdsd running there? start it, pass --socket, or let \
                 rds-bench start one with --spawn-rdsd)",
                self.socket().display()
            )
        })
    }

    /// One line saying which rdsd this is.
    pub fn describe(&self) -> String {
        match self {
            Target::External(p) => {
                format!("running rdsd at {} (its own configuration)", p.display())
            }
            Target::Spawned(s) => format!("spawned {} {}", s.bin.display(), s.args.join(" ")),
        }
    }

    /// The spawned rdsd's process id (`None` for an external one).
    pub fn pid(&self) -> Option<u32> {
        match self {
            Target::External(_) => None,
            Target::Spawned(s) => s.child.as_ref().map(|c| c.id()),
        }
    }

    pub fn is_spawned(&self) -> bool {
        matches!(self, Target::Spawned(_))
    }

    /// Stops a spawned rdsd now (no-op for an external one).
    pub fn stop(self) -> Result<()> {
        match self {
            Target::External(_) => Ok(()),
            Target::Spawned(s) => s.stop(),
        }
    }
}

/// An rdsd process started by rds-bench.
pub struct Spawned {
    child: Option<Child>,
    bin: PathBuf,
    args: Vec<String>,
    socket: PathBuf,
}

impl Spawned {
    fn start(bin: &Path, poll_core: i64, log: &str, idle: &str, trace: bool) -> Result<Spawned> {
        let socket = std::env::temp_dir().join(format!("rds-bench-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&socket);
        let args: Vec<String> = [
            "--control-socket",
            &socket.display().to_string(),
            "--idle",
            idle,
            "--poll-core",
            &poll_core.to_string(),
            "--control-core",
            "-2",
            "--hugepages",
            "auto",
            "--log",
            log,
        ]
        .iter()
        .map(|s| s.to_string())
        .chain(trace.then(|| "--trace-hops".to_string()))
        .collect();
        let mut cmd = Command::new(bin);
        cmd.args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        // SAFETY: prctl(2) is async-signal-safe and touches no memory of the parent; it makes
        // the kernel SIGTERM rdsd if rds-bench dies without stopping it.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong);
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", bin.display()))?;
        let mut s = Spawned {
            child: Some(child),
            bin: bin.to_path_buf(),
            args,
            socket,
        };
        let start = Instant::now();
        loop {
            if Rdsd::attach_at(&s.socket).is_ok() {
                return Ok(s);
            }
            if let Some(st) = s.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                s.child = None;
                bail!(
                    "{} exited during start-up ({st}); see its messages above",
                    bin.display()
                );
            }
            if start.elapsed() > Duration::from_secs(20) {
                bail!(
                    "{} did not answer on {} within 20 s",
                    bin.display(),
                    s.socket.display()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM, then wait up to 5 s (SIGKILL after that).
    fn stop(mut self) -> Result<()> {
        self.terminate()
    }

    fn terminate(&mut self) -> Result<()> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        // Let rdsd finish detaching our attachments first: a detach racing with shutdown
        // makes it log a (harmless) "poll core did not answer" error.
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(1) {
            match shm_api::stats_at(&self.socket) {
                Ok(s) if counter(&s, "apps_attached") <= counter(&s, "apps_detached") => break,
                Ok(_) => std::thread::sleep(Duration::from_millis(2)),
                Err(_) => break,
            }
        }
        let _ = std::fs::remove_file(&self.socket);
        if let Ok(Some(st)) = child.try_wait() {
            bail!("rdsd had already exited ({st})");
        }
        // SAFETY: kill(2) on the pid of our own child, which has not been reaped yet.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let start = Instant::now();
        loop {
            match child.try_wait() {
                Ok(Some(st)) if st.success() => return Ok(()),
                Ok(Some(st)) => bail!("rdsd exited with {st} after SIGTERM"),
                Ok(None) if start.elapsed() < Duration::from_secs(5) => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    bail!("rdsd ignored SIGTERM for 5 s; killed it");
                }
            }
        }
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Err(e) = self.terminate() {
            eprintln!("rds-bench: {e:#}");
        }
    }
}

/// Counter `name` in a stats text (0 if absent).
pub fn counter(stats: &str, name: &str) -> u64 {
    stats
        .lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .and_then(|r| r.strip_prefix(' '))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}
