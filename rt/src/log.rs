//! Where the daemons' and the CLI's log lines go: stderr, filtered by a
//! `RUST_LOG`-style option, coloured only when a person is reading.

use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

/// Sends tracing's events to stderr, filtered by `filter`, or by
/// `fallback` when `filter` does not parse (a typo in `--log` should not
/// cost the daemon its logs). A process that already has a subscriber
/// keeps it: a test may start a daemon in process more than once.
pub fn to_stderr(filter: &str, fallback: &str) {
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new(fallback));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// `filter` itself if [`to_stderr`] can use it, else why not: a clap
/// `value_parser` for options that refuse a bad filter up front.
pub fn parse_filter(filter: &str) -> Result<String, String> {
    EnvFilter::try_new(filter).map_err(|e| e.to_string())?;
    Ok(filter.to_owned())
}
