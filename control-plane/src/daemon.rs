//! The `nvpool-control` daemon: command line, store, REST API, shutdown.
//! `main.rs` only calls [`main_exit_code`].

use crate::api::router;
use crate::auth::{AuthConfig, Role, TokenFiles};
use crate::clock::SystemClock;
use crate::limits::EXTENT_BYTES;
use crate::state::{Cluster, StateConfig};
use crate::store::RedbStore;
use anyhow::Context as _;
use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

/// Default state directory when running as root.
const STATE_DIR_DEFAULT: &str = "/var/lib/nvpool-control";
/// How often token files are checked for a change.
const TOKEN_FILES_CHECK_MS: u64 = 2_000;

/// nvpool control plane: targets, pools and volumes over a REST API.
#[derive(Debug, Parser)]
#[command(name = "nvpool-control", version)]
pub struct Args {
    /// Address of the REST API.
    #[arg(long, default_value = "127.0.0.1:4430")]
    pub listen: SocketAddr,
    /// Directory of the metadata store (default /var/lib/nvpool-control
    /// when running as root; required otherwise).
    #[arg(long, env = "NVPOOL_CONTROL_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// File of bearer tokens with their roles, one per line: `admin TOKEN`,
    /// `reader TOKEN`, `target TOKEN` or `host TOKEN HOSTNQN` (repeatable).
    /// Files are read again when they change, so a token is rotated by
    /// adding the new one, moving clients, then removing the old.
    #[arg(
        long = "tokens-file",
        value_name = "PATH",
        env = "NVPOOL_CONTROL_TOKENS_FILE"
    )]
    pub tokens_file: Vec<PathBuf>,
    /// File holding one admin token (as a line `admin TOKEN` would).
    #[arg(long, value_name = "PATH")]
    pub admin_token_file: Option<PathBuf>,
    /// File holding one target token (as a line `target TOKEN` would).
    #[arg(long, value_name = "PATH")]
    pub target_token_file: Option<PathBuf>,
    /// Extent size of new volumes, in bytes (power of two, 1 MiB..=64 GiB).
    #[arg(long, default_value_t = EXTENT_BYTES, value_parser = parse_extent_size)]
    pub extent_size: u64,
    /// Copy rate of each resync job, bytes per second with an optional
    /// K/M/G suffix (`256M`); 0 copies as fast as the disks go. Client I/O
    /// keeps the rest of the bandwidth.
    #[arg(long, default_value = "256M", value_parser = parse_rate)]
    pub rebuild_rate: u64,
    /// How long a target may be gone (no heartbeat) before its copies are
    /// rebuilt on other targets instead of waiting to resync them in place:
    /// seconds, or with an s/m/h suffix (`10m`).
    #[arg(long, default_value = "10m", value_parser = parse_duration_ms)]
    pub replace_after: u64,
    /// Log filter (tracing env-filter syntax), e.g. `info` or `nvpool_control=debug`.
    #[arg(long, default_value = "info", env = "NVPOOL_LOG", value_parser = parse_log_filter)]
    pub log: String,
}

fn parse_extent_size(s: &str) -> Result<u64, String> {
    let n: u64 = s.parse().map_err(|e| format!("{e}"))?;
    crate::model::validate_extent_bytes(n).map_err(|e| e.to_string())?;
    Ok(n)
}

/// A duration in milliseconds from seconds (`90`) or `90s`, `10m`, `1h`.
fn parse_duration_ms(s: &str) -> Result<u64, String> {
    let (digits, unit_ms) = match s.as_bytes().last() {
        Some(b's') => (&s[..s.len() - 1], 1_000),
        Some(b'm') => (&s[..s.len() - 1], 60_000),
        Some(b'h') => (&s[..s.len() - 1], 3_600_000),
        _ => (s, 1_000),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 600, 90s or 10m"))?;
    n.checked_mul(unit_ms)
        .ok_or_else(|| format!("{s:?} is too long"))
}

fn parse_rate(s: &str) -> Result<u64, String> {
    let (digits, shift) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        None => (s, 0),
        Some((i, _)) => {
            let shift = match s[i..].trim_end_matches("iB").trim_end_matches('B') {
                "K" | "k" => 10,
                "M" | "m" => 20,
                "G" | "g" => 30,
                other => return Err(format!("unknown suffix {other:?} (use K, M or G)")),
            };
            (&s[..i], shift)
        }
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a byte rate like 256M"))?;
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{s:?} is too large"))
}

fn parse_log_filter(s: &str) -> Result<String, String> {
    tracing_subscriber::EnvFilter::try_new(s).map_err(|e| e.to_string())?;
    Ok(s.to_owned())
}

fn is_root() -> bool {
    // No libc dependency for this: root's /proc/self is owned by uid 0.
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

/// Runs the daemon until SIGTERM or SIGINT.
pub fn run(args: Args) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log)
        .with_context(|| format!("invalid --log filter {:?}", args.log))?;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let state_dir = match args.state_dir {
        Some(d) => d,
        None if is_root() => PathBuf::from(STATE_DIR_DEFAULT),
        None => anyhow::bail!("--state-dir is required when not running as root"),
    };
    let token_files = TokenFiles {
        tokens: args.tokens_file.clone(),
        admin: args.admin_token_file.clone(),
        target: args.target_token_file.clone(),
    };
    let tokens = token_files.load().context("reading the tokens")?;
    if tokens.is_empty() {
        anyhow::ensure!(
            args.listen.ip().is_loopback(),
            "no tokens: anyone reaching {} could change the cluster; give --tokens-file \
             (or --admin-token-file), or listen on a loopback address",
            args.listen
        );
        tracing::warn!("no tokens configured: every call is allowed (loopback only)");
    } else if !tokens.has(Role::Admin) {
        tracing::warn!("no admin token configured: pools, volumes and targets cannot be changed");
    }
    let auth = AuthConfig::new(tokens);
    let config = StateConfig {
        extent_bytes: args.extent_size,
        rebuild_rate_bytes_per_sec: args.rebuild_rate,
        ..StateConfig::default()
    };
    config.validate().context("invalid --extent-size")?;
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("creating {}", state_dir.display()))?;
    let store = RedbStore::open_in_dir(&state_dir)
        .with_context(|| format!("opening the store in {}", state_dir.display()))?;
    let cluster = Cluster::new(Arc::new(store), Arc::new(SystemClock), config)?;
    let cluster = Arc::new(cluster);
    let app = router(cluster.clone(), auth.clone());
    let heal_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let heal = crate::heal::spawn(
        cluster.clone(),
        crate::heal::HealConfig {
            rate_bytes_per_sec: args.rebuild_rate,
            replace_after_ms: args.replace_after,
            ..crate::heal::HealConfig::default()
        },
        heal_stop.clone(),
    )
    .context("starting the heal loop")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("listening on {}", args.listen))?;
        tracing::info!(addr = %listener.local_addr()?, state_dir = %state_dir.display(), "nvpool-control serving");
        tokio::spawn(crate::program::reconcile_loop(cluster.clone()));
        tokio::spawn(crate::failover::watch_loop(cluster.clone()));
        if !token_files.is_empty() {
            tokio::spawn(reload_tokens(token_files, auth));
        }
        axum::serve(listener, app)
            .with_graceful_shutdown({
                let c = cluster.clone();
                async move {
                    shutdown_signal().await;
                    c.begin_shutdown();
                }
            })
            .await
            .context("serving the API")?;
        anyhow::Ok(())
    })?;
    heal_stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = heal.join();
    tracing::info!("stopped");
    Ok(())
}

/// Puts the token files' new content in force when they change. A file
/// that no longer parses keeps the old set in force, with an error logged.
async fn reload_tokens(files: TokenFiles, auth: AuthConfig) {
    let mut stamp = files.stamp();
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(TOKEN_FILES_CHECK_MS)).await;
        let now = files.stamp();
        if now == stamp {
            continue;
        }
        stamp = now;
        match files.load() {
            Ok(tokens) => {
                tracing::info!(?tokens, "token files changed: new tokens in force");
                auth.replace(tokens);
            }
            Err(e) => tracing::error!(
                "token files changed but cannot be used (the old tokens stay in force): {e}"
            ),
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; stop with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
}

/// Parses the command line and runs: exit code 0 on a clean stop, 2 for a
/// bad command line, 1 for any other failure.
pub fn main_exit_code() -> i32 {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) if e.use_stderr() => {
            let text = e.to_string();
            let first = text.lines().next().unwrap_or("invalid arguments");
            eprintln!("nvpool-control: {first} (see --help)");
            return 2;
        }
        Err(e) => {
            // --help and --version.
            let _ = e.print();
            return 0;
        }
    };
    if args.state_dir.is_none() && !is_root() {
        eprintln!("nvpool-control: --state-dir is required when not running as root (see --help)");
        return 2;
    }
    match run(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("nvpool-control: {e:#}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn command_line() {
        Args::command().debug_assert();
        let a = Args::try_parse_from(["nvpool-control", "--state-dir", "/tmp/s"]).unwrap();
        assert_eq!(a.listen, "127.0.0.1:4430".parse().unwrap());
        assert_eq!(a.extent_size, EXTENT_BYTES);
        assert_eq!(a.rebuild_rate, 256 << 20);
        let a = Args::try_parse_from(["nvpool-control", "--rebuild-rate", "0"]).unwrap();
        assert_eq!(a.rebuild_rate, 0);
        let a = Args::try_parse_from(["nvpool-control", "--rebuild-rate", "8MiB"]).unwrap();
        assert_eq!(a.rebuild_rate, 8 << 20);
        assert_eq!(a.replace_after, 600_000, "ten minutes by default");
        for (arg, ms) in [
            ("90", 90_000),
            ("5s", 5_000),
            ("2m", 120_000),
            ("1h", 3_600_000),
        ] {
            let a = Args::try_parse_from(["nvpool-control", "--replace-after", arg]).unwrap();
            assert_eq!(a.replace_after, ms, "{arg}");
        }
        for bad in [
            &["--replace-after", "soon"][..],
            &["--replace-after", "5d"],
            &["--rebuild-rate", "fast"],
            &["--rebuild-rate", "5X"],
            &["--extent-size", "3"],
            &["--extent-size", "x"],
            &["--listen", "nope"],
            &["--log", "a=b=c"],
        ] {
            let argv = ["nvpool-control"].iter().chain(bad);
            assert!(Args::try_parse_from(argv).is_err(), "{bad:?}");
        }
    }
}
