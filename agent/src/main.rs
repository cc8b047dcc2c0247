//! `nvpool-agent`: see the library.

use clap::Parser;
use std::io::IsTerminal;
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(
    name = "nvpool-agent",
    version,
    about = "nvpool's per-host agent: serves every volume attached to this host"
)]
struct Cli {
    /// Log filter (RUST_LOG syntax).
    #[arg(long, default_value = "info", env = "NVPOOL_LOG")]
    log: String,
    #[command(flatten)]
    args: nvpool_agent::Args,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match nvpool_agent::run(cli.args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvpool-agent: {}", format!("{e:#}").replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}
