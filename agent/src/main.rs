//! `nvpool-agent`: see the library.

use clap::Parser;
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
    nvpool_rt::log::to_stderr(&cli.log, "info");
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
