//! The `nvpool` command line.

pub mod bench;
pub mod discover;
pub mod size;

use clap::{Parser, Subcommand};
use std::io::IsTerminal;
use std::net::{SocketAddr, ToSocketAddrs};
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(
    name = "nvpool",
    version,
    about = "nvpool: pooled NVMe-over-Fabrics block storage",
    propagate_version = true
)]
pub struct Cli {
    /// Log filter (RUST_LOG syntax).
    #[arg(long, global = true, default_value = "warn", env = "NVPOOL_LOG")]
    pub log: String,
    #[command(subcommand)]
    pub cmd: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the subsystems a discovery controller offers this host (like `nvme discover`).
    Discover(discover::Args),
    /// Load an NVMe/TCP namespace like fio does and report IOPS, bandwidth and latency.
    Bench(bench::Args),
}

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
}

/// Resolves `ADDR` and `PORT` into a socket address.
pub fn resolve(addr: &str, port: u16) -> anyhow::Result<SocketAddr> {
    (addr, port)
        .to_socket_addrs()
        .map_err(|e| anyhow::anyhow!("cannot resolve {addr}: {e}"))?
        .next()
        .ok_or_else(|| anyhow::anyhow!("{addr} has no address"))
}

pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = e.print();
                return if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                    ExitCode::from(2)
                } else {
                    ExitCode::SUCCESS
                };
            }
            // One line: clap's message without the usage block, joined.
            let text = e.render().to_string();
            let msg: Vec<&str> = text
                .lines()
                .map(str::trim)
                .take_while(|l| !l.starts_with("Usage:"))
                .filter(|l| !l.is_empty())
                .collect();
            let msg = msg.join(" ");
            eprintln!("nvpool: {}", msg.trim_start_matches("error: "));
            return ExitCode::from(2);
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let r = match cli.cmd {
        Command::Discover(a) => discover::run(a),
        Command::Bench(a) => bench::run(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvpool: {}", format!("{e:#}").replace('\n', " "));
            ExitCode::from(1)
        }
    }
}
