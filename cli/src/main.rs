//! `rdsctl`: talks to rdsd's control socket. `status` says whether rdsd serves and prints its
//! counters; `stats` prints the raw counters (`name value` per line).

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(version, about = "Inspect a running rdsd")]
struct Cli {
    /// rdsd's control socket (default: $RDSD_SOCKET or /run/rdsd/rdsd.sock).
    #[arg(long, short)]
    socket: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand, Clone, Copy)]
enum Cmd {
    /// Is rdsd up? Prints the non-zero counters.
    Status,
    /// All counters, `name value` per line.
    Stats,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let path = cli
        .socket
        .or_else(|| std::env::var_os("RDSD_SOCKET").map(PathBuf::from))
        .unwrap_or_else(|| shm_api::DEFAULT_CONTROL_SOCKET.into());
    let stats = match shm_api::stats_at(&path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("rdsctl: rdsd at {} is not reachable: {e}", path.display());
            return ExitCode::FAILURE;
        }
    };
    match cli.cmd.unwrap_or(Cmd::Status) {
        Cmd::Stats => print!("{stats}"),
        Cmd::Status => {
            println!("rdsd at {}: up", path.display());
            for line in stats.lines().filter(|l| !l.ends_with(" 0")) {
                println!("  {line}");
            }
        }
    }
    ExitCode::SUCCESS
}
