//! `rdsctl`: talks to rdsd's control socket. `status` says whether rdsd serves and prints its
//! counters; `stats` prints the raw counters (`name value` per line).

use clap::{Parser, Subcommand};
use shm_api::ctrl::{Reply, Request, MAX_DATAGRAM};
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

/// Reads the counters without attaching (no shared region is created).
fn fetch_stats(path: &std::path::Path) -> std::io::Result<String> {
    use std::os::fd::AsRawFd;
    let sock = shm_api::sys::connect_seqpacket(path)?;
    shm_api::sys::send_with_fds(sock.as_raw_fd(), &Request::Stats.encode(), &[])?;
    let mut buf = vec![0u8; MAX_DATAGRAM];
    let (n, _) = shm_api::sys::recv_with_fds(sock.as_raw_fd(), &mut buf, 0)?;
    let reply = Reply::decode(&buf[..n])
        .ok_or_else(|| std::io::Error::other("malformed reply from rdsd"))?;
    if reply.errno != 0 {
        return Err(std::io::Error::from_raw_os_error(reply.errno));
    }
    Ok(String::from_utf8_lossy(&reply.body).into_owned())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let path = cli
        .socket
        .or_else(|| std::env::var_os("RDSD_SOCKET").map(PathBuf::from))
        .unwrap_or_else(|| shm_api::DEFAULT_CONTROL_SOCKET.into());
    let stats = match fetch_stats(&path) {
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
