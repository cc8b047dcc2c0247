//! The `nvpool` command line.
//!
//! ```text
//!   discover, bench ── NVMe/TCP or NVMe/RDMA straight to a target (nvpool-initiator)
//!   target, pool, volume ── REST to the control plane (client.rs; cluster.rs, volume.rs)
//! ```
//!
//! Exit codes: 0 success, 1 failure, 2 usage error; every error is one
//! `nvpool: …` line on stderr.

pub mod attach;
pub mod bench;
pub mod cluster;
pub mod dataset;
pub use nvpool_agent::dhchap;
pub mod discover;
pub mod nvmef;
pub mod size;
pub mod snapshot;
pub mod top;
pub mod verify;
pub mod volume;

use clap::{Parser, Subcommand};
pub use nvpool_api::client;
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
    /// Control plane URL (target, pool and volume commands); a comma-separated list names instances of one control plane, tried in turn.
    #[arg(long, global = true, env = "NVPOOL_ENDPOINT", default_value = client::DEFAULT_ENDPOINT, value_name = "URL")]
    pub endpoint: String,
    /// File holding the bearer token for the control plane (an admin token for changes; a reader token can list and show).
    #[arg(long, global = true, env = "NVPOOL_TOKEN_FILE", value_name = "PATH")]
    pub token_file: Option<std::path::PathBuf>,
    /// CA certificates (PEM) to trust for https endpoints, instead of the system's.
    #[arg(long, global = true, env = "NVPOOL_CACERT", value_name = "FILE")]
    pub cacert: Option<std::path::PathBuf>,
    #[command(subcommand)]
    pub cmd: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the subsystems a discovery controller offers this host (like `nvme discover`).
    Discover(discover::Args),
    /// Load an NVMe/TCP or NVMe/RDMA namespace like fio does and report IOPS, bandwidth and latency.
    Bench(bench::Args),
    /// Storage targets registered with the control plane.
    Target(cluster::TargetArgs),
    /// Pools: named sets of target devices that volumes are placed on.
    Pool(cluster::PoolArgs),
    /// Hosts: the DH-HMAC-CHAP secrets targets make them authenticate with.
    Host(cluster::HostArgs),
    /// Volumes: create, list, grow, delete, attach to and detach from hosts.
    Volume(volume::VolumeArgs),
    /// Snapshots of thin volumes: take, list, show and delete (`VOLUME@SNAPSHOT`).
    Snapshot(snapshot::SnapshotArgs),
    /// A small-file training dataset: write one, or read it like an epoch (verified).
    Dataset(dataset::Args),
    /// The volumes this host serves, live: requests, bandwidth, latency and paths (like `iostat -x`).
    Top(top::Args),
    /// Run this host's agent in the foreground (what `volume attach` starts; the systemd unit runs `nvpool-agent`).
    Agent(nvpool_agent::Args),
}

/// A command line that parsed but makes no sense (a flag that does not
/// apply, a size that is not whole blocks): exit code 2, like clap's own.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

/// Output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
}

/// The fabric `discover` and `bench` use (`-t`, as in `nvme discover`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportArg {
    #[default]
    Tcp,
    Rdma,
}

impl From<TransportArg> for nvpool_initiator::Transport {
    fn from(t: TransportArg) -> Self {
        match t {
            TransportArg::Tcp => nvpool_initiator::Transport::Tcp,
            TransportArg::Rdma => nvpool_initiator::Transport::Rdma,
        }
    }
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
    nvpool_rt::log::to_stderr(&cli.log, "warn");
    if !matches!(cli.cmd, Command::Agent(_)) {
        // `nvpool volume history … | head`: a reader that stops early ends a
        // printing command quietly, as it does any Unix tool, instead of a
        // panic in println!. The agent keeps Rust's default (ignored), since
        // it writes to sockets and pipes it must survive losing.
        // SAFETY: called before any thread is started; SIG_DFL is a valid
        // disposition for SIGPIPE.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let conn = cluster::Connection {
        endpoint: cli.endpoint,
        token_file: cli.token_file,
        cacert: cli.cacert,
    };
    let r = match cli.cmd {
        Command::Discover(a) => discover::run(a),
        Command::Bench(a) => bench::run(&conn, a),
        Command::Target(a) => cluster::run_target(&conn, a),
        Command::Pool(a) => cluster::run_pool(&conn, a),
        Command::Host(a) => cluster::run_host(&conn, a),
        Command::Volume(a) => volume::run(&conn, a),
        Command::Snapshot(a) => snapshot::run(&conn, a),
        Command::Dataset(a) => dataset::run(a),
        Command::Top(a) => top::run(a),
        Command::Agent(mut a) => {
            // The global --cacert: whom the volumes' control planes are trusted by.
            a.cacert = conn.cacert.clone();
            nvpool_agent::run(a)
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvpool: {}", format!("{e:#}").replace('\n', " "));
            let usage = e.downcast_ref::<Usage>().is_some()
                || matches!(
                    e.downcast_ref::<client::ClientError>(),
                    Some(client::ClientError::Endpoint { .. } | client::ClientError::Tls(_))
                );
            if usage {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn global_options_go_anywhere() {
        let c = Cli::try_parse_from([
            "nvpool",
            "--endpoint",
            "http://cp:1",
            "volume",
            "ls",
            "-o",
            "json",
        ])
        .unwrap();
        assert_eq!(c.endpoint, "http://cp:1");
        let c = Cli::try_parse_from(["nvpool", "pool", "-o", "json", "ls", "--token-file", "/t"])
            .unwrap();
        assert_eq!(c.token_file.as_deref(), Some(std::path::Path::new("/t")));
    }
}
