//! `rdsd`: the daemon binary.

use clap::Parser;
use rdsd::config::{Overrides, DEFAULT_TOML};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Userspace RDS daemon: apps attach over shared memory; rdsd moves their messages.
#[derive(Parser)]
#[command(version)]
struct Cli {
    /// TOML configuration laid over the embedded default.
    #[arg(short, long)]
    config: Option<PathBuf>,
    /// Print the embedded default configuration and exit.
    #[arg(long)]
    print_default_config: bool,
    /// Log filter (tracing EnvFilter syntax); RDSD_LOG works too.
    #[arg(long, default_value = "info")]
    log: String,
    #[command(flatten)]
    over: Overrides,
    /// Test-only fault hook, NAME=VALUE (repeatable; `src/fault.rs`). Only in a build with the
    /// `fault-injection` feature.
    #[cfg(feature = "fault-injection")]
    #[arg(long = "fault", value_name = "NAME=VALUE")]
    faults: Vec<String>,
}

/// Counts each thread's allocations: the poll threads publish theirs (`poll_allocations`).
#[global_allocator]
static ALLOC: rdsd::quiet::CountingAlloc = rdsd::quiet::CountingAlloc;

fn main() {
    let cli = Cli::parse();
    if cli.print_default_config {
        print!("{DEFAULT_TOML}");
        return;
    }
    let filter = std::env::var("RDSD_LOG").unwrap_or(cli.log.clone());
    // Structured events (`key=value` fields). Under systemd (JOURNAL_STREAM is set when stderr
    // goes to the journal) no colours and no timestamps: the journal stamps each line itself.
    let journal = std::env::var_os("JOURNAL_STREAM").is_some();
    let ansi = !journal && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    if journal {
        fmt.without_time().init();
    } else {
        fmt.init();
    }
    #[cfg(feature = "fault-injection")]
    if let Err(e) = rdsd::fault::arm(&cli.faults) {
        eprintln!("rdsd: {e:#}");
        std::process::exit(2);
    }
    let cfg = match rdsd::load_config(cli.config.as_deref(), &cli.over) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rdsd: {e:#}");
            std::process::exit(2);
        }
    };
    let shutdown = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        if let Err(e) = signal_hook::flag::register(sig, shutdown.clone()) {
            eprintln!("rdsd: cannot install signal handler: {e}");
            std::process::exit(1);
        }
    }
    if let Err(e) = rdsd::run(cfg, shutdown) {
        eprintln!("rdsd: {e:#}");
        std::process::exit(1);
    }
}
