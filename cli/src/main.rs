//! `rdsctl`: inspect a running rdsd through its control socket.
//!
//! * `status`: is rdsd up; its identity and non-zero counters.
//! * `stats`: every counter, `name value` per line; `--prometheus` in the Prometheus text
//!   format (what rdsd serves on `metrics_listen`).
//! * `info`: rds-info's sections: `-c` counters, `-k` sockets, `-n` connections, `-p` paths,
//!   `-r`/`-s`/`-t` receive, send and retransmit queues, and rdsd's own `-g` multicast groups
//!   and `-T` poll threads (all of them without a flag).
//! * `ping ADDR`: rds-ping: empty messages to ADDR port 0, one line of µs per reply.
//! * `threads [-i SECS]`: the poll threads, how busy each is and what it moves per second.
//!
//! `--json` (anywhere on the line) prints one JSON document instead. Exit status: 0 success,
//! 1 failure (an error from rdsd, no ping reply), 2 bad usage, 3 rdsd not running, 4 not
//! permitted to use its control socket.

mod client;
mod ping;
mod render;

use clap::{Args, Parser, Subcommand};
use serde_json::{json, Value};
use shm_api::ctrl;
use std::io;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Inspect a running rdsd",
    after_help = "Exit status: 0 success, 1 failure (rdsd error, no ping reply), 2 bad usage, \
                  3 rdsd not running (no control socket), 4 permission denied on the control socket."
)]
struct Cli {
    /// rdsd's control socket (default: $RDSD_SOCKET or /run/rdsd/rdsd.sock).
    #[arg(long, short)]
    socket: Option<PathBuf>,
    /// Print one JSON document (any subcommand).
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Is rdsd up? Its identity and non-zero counters (the default).
    Status,
    /// All counters, `name value` per line.
    Stats {
        /// Prometheus text exposition format (HELP/TYPE lines, `rdsd_` prefix).
        #[arg(long)]
        prometheus: bool,
    },
    /// Sockets, connections, paths, queues (like rds-info) and multicast groups (every section
    /// without a flag).
    Info(InfoArgs),
    /// RDS ping: empty messages to ADDR port 0, one line per reply with the round trip in µs.
    Ping(PingCmd),
    /// The poll threads: each one's CPU, apps, sockets, connections and groups, how busy it
    /// is, and the messages it moves per second (local, network, across threads).
    Threads {
        /// Seconds to measure over (0: totals since rdsd started).
        #[arg(short = 'i', long, default_value = "1", value_parser = secs)]
        interval: Duration,
    },
}

#[derive(Args, Debug, Default)]
struct InfoArgs {
    /// Counters.
    #[arg(short = 'c')]
    counters: bool,
    /// Sockets: bound address and port, buffers, queued bytes, congestion monitor.
    #[arg(short = 'k')]
    sockets: bool,
    /// Connections: addresses, transport, state, generations.
    #[arg(short = 'n')]
    connections: bool,
    /// Paths: state, next tx/rx sequence numbers, messages and bytes in flight.
    #[arg(short = 'p')]
    paths: bool,
    /// Receive queues (bytes delivered, not yet read).
    #[arg(short = 'r')]
    recv: bool,
    /// Send queues (bytes not yet released, messages waiting on paths).
    #[arg(short = 's')]
    send: bool,
    /// Retransmit queues (messages sent, not yet acknowledged).
    #[arg(short = 't')]
    retrans: bool,
    /// Multicast groups: creator, members with their flags and filters, last sequence number,
    /// sends, deliveries, DROP_WHEN_FULL drops and filter rejections.
    #[arg(short = 'g', long = "groups")]
    groups: bool,
    /// Every message on the send, retransmit and receive queues (rds-info's -s, -t and -r
    /// listings; not part of the default summary).
    #[arg(short = 'm', long = "messages")]
    messages: bool,
    /// Poll threads: CPU, apps, sockets, connections, groups and counters since rdsd started
    /// (`rdsctl threads` gives rates).
    #[arg(short = 'T', long = "threads")]
    threads: bool,
}

#[derive(Args, Debug)]
struct PingCmd {
    /// Address to ping.
    addr: Ipv4Addr,
    /// Number of pings (default: until interrupted).
    #[arg(short = 'c', value_parser = clap::value_parser!(u64).range(1..))]
    count: Option<u64>,
    /// Seconds between pings.
    #[arg(short = 'i', default_value = "1", value_parser = secs)]
    interval: Duration,
    /// Local address to send from (default: ADDR if rdsd owns it, else rdsd's first local
    /// address).
    #[arg(short = 'I')]
    source: Option<Ipv4Addr>,
    /// Seconds to wait for each reply.
    #[arg(short = 'W', default_value = "1", value_parser = secs)]
    timeout: Duration,
}

fn secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(0.0..=3600.0).contains(&v) {
        return Err(format!("{s} is not within 0..=3600 seconds"));
    }
    Ok(Duration::from_secs_f64(v))
}

/// Why rdsctl failed, and its exit status.
#[derive(Debug)]
enum Failure {
    /// No rdsd at the socket (ENOENT, ECONNREFUSED).
    NotRunning(String),
    /// The socket (or its directory) is not ours to use.
    Denied(String),
    /// Anything else.
    Other(String),
}

impl Failure {
    fn code(&self) -> u8 {
        match self {
            Failure::Other(_) => 1,
            Failure::NotRunning(_) => 3,
            Failure::Denied(_) => 4,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Failure::Other(_) => "error",
            Failure::NotRunning(_) => "not_running",
            Failure::Denied(_) => "permission_denied",
        }
    }

    fn message(&self) -> &str {
        match self {
            Failure::NotRunning(m) | Failure::Denied(m) | Failure::Other(m) => m,
        }
    }
}

/// Turns an error talking to rdsd at `path` into a clear sentence and an exit status.
fn classify(path: &Path, e: &io::Error) -> Failure {
    let p = path.display();
    match e.raw_os_error() {
        Some(libc::ENOENT) => Failure::NotRunning(format!(
            "rdsd is not running: no control socket at {p} (start rdsd, or pass -s/--socket \
             or RDSD_SOCKET)"
        )),
        Some(libc::ECONNREFUSED) => Failure::NotRunning(format!(
            "rdsd is not running: {p} exists but nobody listens on it (a stale socket)"
        )),
        Some(libc::EACCES) | Some(libc::EPERM) => Failure::Denied(format!(
            "permission denied on rdsd's control socket {p}: run as root, or as a member of \
             rdsd's control_group ({e})"
        )),
        _ => Failure::Other(format!("rdsd at {p}: {}", shm_api::explain(e))),
    }
}

fn sections(a: &InfoArgs) -> u32 {
    let mut s = 0;
    for (on, bit) in [
        (a.counters, ctrl::INFO_COUNTERS),
        (a.sockets, ctrl::INFO_SOCKETS),
        (a.connections, ctrl::INFO_CONNECTIONS),
        (a.paths, ctrl::INFO_PATHS),
        (a.recv, ctrl::INFO_RECV_QUEUE),
        (a.send, ctrl::INFO_SEND_QUEUE),
        (a.retrans, ctrl::INFO_RETRANS_QUEUE),
        (a.groups, ctrl::INFO_GROUPS),
        (a.messages, ctrl::INFO_MESSAGES),
        (a.threads, ctrl::INFO_THREADS),
    ] {
        if on {
            s |= bit;
        }
    }
    if s == 0 {
        ctrl::INFO_ALL
    } else {
        s
    }
}

/// The text of `info` for the sections asked.
fn info_text(doc: &Value, s: u32) -> String {
    let mut parts = Vec::new();
    type Render = fn(&Value) -> String;
    let table: [(u32, Render); 10] = [
        (ctrl::INFO_COUNTERS, render::counters),
        (ctrl::INFO_SOCKETS, render::sockets),
        (ctrl::INFO_CONNECTIONS, render::connections),
        (ctrl::INFO_PATHS, render::paths),
        (ctrl::INFO_RECV_QUEUE, render::recv_queue),
        (ctrl::INFO_SEND_QUEUE, render::send_queue),
        (ctrl::INFO_RETRANS_QUEUE, render::retransmit_queue),
        (ctrl::INFO_GROUPS, render::groups),
        (ctrl::INFO_MESSAGES, render::messages),
        (ctrl::INFO_THREADS, |doc| {
            let rows = render::thread_rows(None, doc).unwrap_or_default();
            render::threads(&rows, 0.0)
        }),
    ];
    for (bit, f) in table {
        if s & bit != 0 {
            parts.push(f(doc));
        }
    }
    parts.join("\n")
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).expect("json")
}

fn run(cli: Cli, path: &Path) -> Result<ExitCode, Failure> {
    let json = cli.json;
    let fail = |e: io::Error| classify(path, &e);
    match cli.cmd.unwrap_or(Cmd::Status) {
        Cmd::Status => {
            let doc = client::counters(path).map_err(fail)?;
            let nonzero: serde_json::Map<String, Value> = doc
                .get("counters")
                .and_then(Value::as_object)
                .into_iter()
                .flatten()
                .filter(|(_, v)| v.as_u64() != Some(0))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            if json {
                let out = json!({
                    "socket": path.display().to_string(),
                    "up": true,
                    "rdsd": doc.get("rdsd"),
                    "counters": nonzero,
                });
                println!("{}", pretty(&out));
            } else {
                println!(
                    "rdsd at {}: up ({})",
                    path.display(),
                    render::identity(&doc)
                );
                for (k, v) in nonzero {
                    println!("  {k} {v}");
                }
            }
        }
        Cmd::Stats { prometheus } => {
            if prometheus && json {
                return Err(Failure::Other(
                    "--prometheus and --json are two formats: choose one".into(),
                ));
            }
            if prometheus {
                let doc = client::counters(path).map_err(fail)?;
                print!("{}", render::prometheus(&doc));
            } else {
                let text = client::stats(path).map_err(fail)?;
                if json {
                    let mut m = serde_json::Map::new();
                    for l in text.lines() {
                        if let Some((k, v)) = l.split_once(' ') {
                            m.insert(k.into(), json!(v.trim().parse::<u64>().unwrap_or(0)));
                        }
                    }
                    println!("{}", pretty(&json!({ "counters": m })));
                } else {
                    print!("{text}");
                }
            }
        }
        Cmd::Info(a) => {
            let s = sections(&a);
            let doc = client::info(path, s).map_err(fail)?;
            if json {
                println!("{}", pretty(&doc));
            } else {
                print!("{}", info_text(&doc, s));
            }
        }
        Cmd::Threads { interval } => {
            let s = ctrl::INFO_THREADS;
            let first = client::info(path, s).map_err(fail)?;
            let secs = interval.as_secs_f64();
            let (before, after) = if secs > 0.0 {
                std::thread::sleep(interval);
                (Some(first), client::info(path, s).map_err(fail)?)
            } else {
                (None, first)
            };
            let Some(rows) = render::thread_rows(before.as_ref(), &after) else {
                return Err(Failure::Other(
                    "this rdsd does not report its poll threads (it is older than rdsctl)".into(),
                ));
            };
            if json {
                println!("{}", pretty(&json!({ "seconds": secs, "threads": rows })));
            } else {
                print!("{}", render::threads(&rows, secs));
            }
        }
        Cmd::Ping(p) => {
            if json && p.count.is_none() {
                eprintln!("rdsctl: ping --json prints one document at the end: give -c COUNT");
                return Ok(ExitCode::from(2));
            }
            let source = match p.source {
                Some(s) => s,
                None => {
                    let doc = client::counters(path).map_err(fail)?;
                    let addrs: Vec<String> = doc
                        .pointer("/rdsd/local_addrs")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .filter_map(|v| v.as_str().map(String::from))
                        .collect();
                    ping::default_source(&addrs, p.addr).ok_or_else(|| {
                        Failure::Other("rdsd reports no local address; pass -I ADDR".into())
                    })?
                }
            };
            let args = ping::PingArgs {
                dest: p.addr,
                count: p.count,
                interval: p.interval,
                timeout: p.timeout,
                json,
            };
            let r = ping::run(path, &args, source).map_err(fail)?;
            if r.received == 0 {
                if !json {
                    eprintln!("rdsctl: no reply from {} ({} sent)", p.addr, r.sent);
                }
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let path = cli
        .socket
        .clone()
        .or_else(|| std::env::var_os("RDSD_SOCKET").map(PathBuf::from))
        .unwrap_or_else(|| shm_api::DEFAULT_CONTROL_SOCKET.into());
    let json = cli.json;
    match run(cli, &path) {
        Ok(c) => c,
        Err(f) => {
            eprintln!("rdsctl: {}", f.message());
            if json {
                let out = json!({"error": f.message(), "kind": f.kind(),
                                 "socket": path.display().to_string()});
                println!("{}", pretty(&out));
            }
            ExitCode::from(f.code())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("rdsctl").chain(args.iter().copied()))
    }

    #[test]
    fn flags_parse_and_bad_ones_fail() {
        let c = parse(&["-s", "/x.sock", "info", "-k", "-p", "--json"]).unwrap();
        assert!(c.json);
        assert_eq!(c.socket.as_deref(), Some(Path::new("/x.sock")));
        let Some(Cmd::Info(a)) = c.cmd else {
            panic!("info")
        };
        assert_eq!(sections(&a), ctrl::INFO_SOCKETS | ctrl::INFO_PATHS);
        assert_eq!(sections(&InfoArgs::default()), ctrl::INFO_ALL);
        for g in ["-g", "--groups"] {
            let Some(Cmd::Info(a)) = parse(&["info", g, "-c"]).unwrap().cmd else {
                panic!("info")
            };
            assert_eq!(sections(&a), ctrl::INFO_GROUPS | ctrl::INFO_COUNTERS);
        }
        let Some(Cmd::Ping(p)) = parse(&["ping", "10.0.0.2", "-c", "3", "-i", "0.2"])
            .unwrap()
            .cmd
        else {
            panic!("ping")
        };
        assert_eq!(
            (p.count, p.interval, p.timeout),
            (Some(3), Duration::from_millis(200), Duration::from_secs(1))
        );
        for bad in [
            &["info", "-x"][..],
            &["ping"],
            &["ping", "not-an-ip"],
            &["ping", "1.2.3.4", "-c", "0"],
            &["ping", "1.2.3.4", "-i", "-1"],
            &["ping", "1.2.3.4", "-i", "soon"],
            &["frobnicate"],
            &["stats", "--prom"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} parsed");
        }
        assert!(matches!(
            parse(&["stats", "--prometheus"]).unwrap().cmd,
            Some(Cmd::Stats { prometheus: true })
        ));
    }

    #[test]
    fn errors_are_classified_by_errno() {
        let p = Path::new("/run/rdsd/rdsd.sock");
        let e = |n| io::Error::from_raw_os_error(n);
        let f = classify(p, &e(libc::ENOENT));
        assert_eq!((f.code(), f.kind()), (3, "not_running"));
        assert!(f.message().contains("not running") && f.message().contains("/run/rdsd"));
        assert_eq!(classify(p, &e(libc::ECONNREFUSED)).code(), 3);
        let f = classify(p, &e(libc::EACCES));
        assert_eq!((f.code(), f.kind()), (4, "permission_denied"));
        assert!(f.message().contains("permission denied"));
        assert_eq!(classify(p, &e(libc::EUSERS)).code(), 1);
    }

    #[test]
    fn info_text_has_only_the_sections_asked() {
        let doc = json!({"counters": {"a": 1}, "sockets": []});
        let t = info_text(&doc, ctrl::INFO_SOCKETS | ctrl::INFO_COUNTERS);
        assert!(
            t.starts_with("RDS counters:\n") && t.contains("RDS sockets:\n"),
            "{t}"
        );
        assert!(!t.contains("RDS paths"));
        assert!(info_text(&doc, ctrl::INFO_ALL).contains("Retransmit queue"));
        assert!(info_text(&doc, ctrl::INFO_ALL).contains("RDS groups:"));
        assert!(!t.contains("RDS groups"));
        assert!(!info_text(&doc, ctrl::INFO_ALL).contains("RDS messages"));
        let doc = json!({"send_messages": [{"transport": "tcp", "path": 1, "seq": 9, "len": 64,
            "laddr": "10.0.0.1", "lport": 4000, "faddr": "10.0.0.2", "fport": 5000}]});
        let t = info_text(&doc, ctrl::INFO_MESSAGES);
        assert!(
            t.contains("send") && t.contains("10.0.0.1:4000") && t.contains("10.0.0.2:5000"),
            "{t}"
        );
    }
}
