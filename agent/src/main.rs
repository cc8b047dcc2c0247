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
    /// CA certificates (PEM) to trust for the volumes' https control planes, instead of the system's.
    #[arg(long, env = "NVPOOL_CACERT", value_name = "FILE")]
    cacert: Option<std::path::PathBuf>,
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
    let mut args = cli.args;
    args.cacert = cli.cacert;
    match nvpool_agent::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvpool-agent: {}", format!("{e:#}").replace('\n', " "));
            // An unusable --cacert or certificate, or options that do not
            // go together, are usage errors.
            let usage = matches!(
                e.downcast_ref::<nvpool_agent::client::ClientError>(),
                Some(nvpool_agent::client::ClientError::Tls(_))
            ) || e.is::<nvpool_api::tls::TlsError>()
                || e.is::<nvpool_agent::server::Usage>();
            if usage {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
