//! The `nvpool-control` daemon: command line, store, REST API, shutdown;
//! and `nvpool-control migrate`, which copies one store into another.
//! `main.rs` only calls [`main_exit_code`].

use crate::api::router;
use crate::auth::{AuthConfig, Role, TokenFiles};
use crate::clock::SystemClock;
use crate::leader::Leadership;
use crate::limits::EXTENT_BYTES;
use crate::state::{Cluster, StateConfig};
use crate::store::migrate::copy_all;
use crate::store::{
    EtcdConfig, EtcdStore, EtcdTls, MemStore, RedbStore, Store, StoreUrl, STORE_FILE,
};
use anyhow::Context as _;
use clap::Parser;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Default state directory when running as root.
const STATE_DIR_DEFAULT: &str = "/var/lib/nvpool-control";
/// How often token files are checked for a change.
const TOKEN_FILES_CHECK_MS: u64 = 2_000;
/// A PEM certificate chain or key for etcd: a few KiB; anything this large
/// is the wrong file.
const TLS_FILE_BYTES_MAX: u64 = 1 << 20;

/// nvpool control plane: targets, pools and volumes over a REST API.
#[derive(Debug, Parser)]
#[command(
    name = "nvpool-control",
    version,
    args_conflicts_with_subcommands = true
)]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Address of the REST API.
    #[arg(long, default_value = "127.0.0.1:4430")]
    pub listen: SocketAddr,
    /// Serve https with this certificate chain (PEM, leaf first); with --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Serve plain HTTP on a non-loopback --listen (tokens cross the network in clear).
    #[arg(long, conflicts_with = "tls_cert")]
    pub insecure_http: bool,
    /// CA certificates (PEM) that sign the https admin APIs of targets
    /// (`nvpool-target --admin-tls-cert`); default: the system CA bundle.
    /// A target's certificate must name the IP address of its admin API.
    #[arg(long, value_name = "FILE")]
    pub target_cacert: Option<PathBuf>,
    /// Attach and serve volumes only to hosts with DH-HMAC-CHAP keys
    /// (`nvpool host set-keys`): no host reaches a namespace without a
    /// credential. Others get 409 host_keys_required.
    #[arg(long)]
    pub require_host_keys: bool,
    /// Directory of the metadata store (default /var/lib/nvpool-control
    /// when running as root; required otherwise).
    #[arg(long, env = "NVPOOL_CONTROL_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// The metadata store instead: redb:DIR (the embedded store, what
    /// --state-dir DIR means), memory: (nothing survives a restart), or
    /// etcd://HOST:PORT[,HOST:PORT…][/PREFIX] shared by several control
    /// planes (etcds:// for TLS; prefix /nvpool by default).
    #[arg(
        long,
        env = "NVPOOL_CONTROL_STORE",
        value_name = "URL",
        conflicts_with = "state_dir"
    )]
    pub store: Option<StoreUrl>,
    #[command(flatten)]
    pub store_tls: StoreTlsArgs,
    /// File of bearer tokens with their roles, one per line: `admin TOKEN`,
    /// `reader TOKEN`, `target TOKEN [TARGET_ID]` (an id binds it to that
    /// target) or `host TOKEN HOSTNQN` (repeatable).
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
    #[arg(long, default_value = "info", env = "NVPOOL_LOG", value_parser = nvpool_rt::log::parse_filter)]
    pub log: String,
}

/// Subcommands; without one, the daemon runs.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Copy every key of a store into another, empty one (redb:DIR into
    /// etcd://…, say), then read it back and compare. Stop the control
    /// plane first: the source must not be in use.
    Migrate(MigrateArgs),
}

#[derive(Debug, clap::Args)]
pub struct MigrateArgs {
    /// The store to copy: redb:DIR or etcd://…
    #[arg(long, value_name = "URL")]
    pub from: StoreUrl,
    /// The empty store to copy into: etcd://… or redb:DIR.
    #[arg(long, value_name = "URL")]
    pub to: StoreUrl,
    #[command(flatten)]
    pub store_tls: StoreTlsArgs,
}

/// TLS to etcd, for etcds:// stores.
#[derive(Debug, Default, clap::Args)]
pub struct StoreTlsArgs {
    /// CA certificate (PEM) that signs the etcd servers' certificates;
    /// required for etcds://.
    #[arg(long, value_name = "FILE")]
    pub store_cacert: Option<PathBuf>,
    /// Client certificate (PEM) to present to etcd, with --store-key.
    #[arg(long, value_name = "FILE", requires = "store_key")]
    pub store_cert: Option<PathBuf>,
    /// Key of --store-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "store_cert")]
    pub store_key: Option<PathBuf>,
}

impl StoreTlsArgs {
    /// The TLS material for the etcds:// URLs among `urls`: an error when
    /// an etcds:// URL has no CA, or when files are given and no URL uses
    /// TLS.
    fn load(&self, urls: &[&StoreUrl]) -> anyhow::Result<Option<EtcdTls>> {
        let tls_url = urls
            .iter()
            .find(|u| matches!(u, StoreUrl::Etcd(e) if e.tls));
        let Some(url) = tls_url else {
            anyhow::ensure!(
                self.store_cacert.is_none() && self.store_cert.is_none(),
                "--store-cacert, --store-cert and --store-key are for etcds:// stores only"
            );
            return Ok(None);
        };
        let Some(ca) = &self.store_cacert else {
            anyhow::bail!("{url} needs --store-cacert (the CA that signs etcd's certificates)");
        };
        let client = match (&self.store_cert, &self.store_key) {
            (Some(cert), Some(key)) => Some((read_pem(cert)?, read_pem(key)?)),
            _ => None,
        };
        Ok(Some(EtcdTls {
            ca_pem: read_pem(ca)?,
            client,
        }))
    }
}

fn read_pem(path: &Path) -> anyhow::Result<Vec<u8>> {
    let len = std::fs::metadata(path)
        .with_context(|| format!("reading {}", path.display()))?
        .len();
    anyhow::ensure!(
        len <= TLS_FILE_BYTES_MAX,
        "{} is {len} bytes; a PEM certificate or key is at most {TLS_FILE_BYTES_MAX}",
        path.display()
    );
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// Opens the store `url` names; `tls` is used for an etcds:// URL.
pub fn open_store(url: &StoreUrl, tls: Option<&EtcdTls>) -> anyhow::Result<Arc<dyn Store>> {
    Ok(match url {
        StoreUrl::Redb(dir) => {
            // open_in_dir makes the directory itself, private (0700).
            Arc::new(
                RedbStore::open_in_dir(dir)
                    .with_context(|| format!("opening the store in {}", dir.display()))?,
            )
        }
        StoreUrl::Memory => Arc::new(MemStore::new()),
        StoreUrl::Etcd(e) => {
            let config = EtcdConfig {
                tls: if e.tls { tls.cloned() } else { None },
                ..EtcdConfig::new(e.clone())
            };
            Arc::new(EtcdStore::connect(config).with_context(|| format!("opening {url}"))?)
        }
    })
}

/// `nvpool-control migrate`: copies, checks, and says what it did.
pub fn migrate(args: &MigrateArgs) -> anyhow::Result<String> {
    for url in [&args.from, &args.to] {
        anyhow::ensure!(
            !matches!(url, StoreUrl::Memory),
            "memory: is not a store to migrate from or to (nothing outlives the process)"
        );
    }
    if let StoreUrl::Redb(dir) = &args.from {
        // Opening would create an empty store, and copy nothing.
        let file = dir.join(STORE_FILE);
        anyhow::ensure!(file.exists(), "no store at {}", file.display());
    }
    anyhow::ensure!(args.from != args.to, "--from and --to name the same store");
    let tls = args.store_tls.load(&[&args.from, &args.to])?;
    let from = open_store(&args.from, tls.as_ref())?;
    let to = open_store(&args.to, tls.as_ref())?;
    let copied = copy_all(&*from, &*to)
        .with_context(|| format!("copying {} into {}", args.from, args.to))?;
    Ok(format!(
        "migrated {} keys ({} bytes) from {} (revision {}) to {} in {} transactions; read back \
         and compared: identical",
        copied.keys, copied.bytes, args.from, copied.source_revision, args.to, copied.transactions
    ))
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

fn is_root() -> bool {
    // No libc dependency for this: root's /proc/self is owned by uid 0.
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

/// Runs the daemon until SIGTERM or SIGINT.
pub fn run(args: Args) -> anyhow::Result<()> {
    // `args.log` parsed already (`--log`'s value parser).
    nvpool_rt::log::to_stderr(&args.log, "info");
    let store_url = match (args.store, args.state_dir) {
        (Some(url), _) => url,
        (None, Some(dir)) => StoreUrl::Redb(dir),
        (None, None) if is_root() => StoreUrl::Redb(PathBuf::from(STATE_DIR_DEFAULT)),
        (None, None) => anyhow::bail!("--state-dir is required when not running as root"),
    };
    let tls = args.store_tls.load(&[&store_url])?;
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
    let server_tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(crate::tls::ServerTls::load(cert, key)?),
        _ => {
            crate::tls::check_plain_http(args.listen, args.insecure_http, "--insecure-http")
                .map_err(anyhow::Error::msg)?;
            None
        }
    };
    // Read once: every call to a target's https admin API trusts it.
    let target_tls = crate::tls::client_tls_for("--target-cacert", args.target_cacert.as_deref())?;
    let auth = AuthConfig::new(tokens);
    let config = StateConfig {
        extent_bytes: args.extent_size,
        rebuild_rate_bytes_per_sec: args.rebuild_rate,
        require_host_keys: args.require_host_keys,
        ..StateConfig::default()
    };
    config.validate().context("invalid --extent-size")?;
    let store = open_store(&store_url, tls.as_ref())?;
    if store_url == StoreUrl::Memory {
        tracing::warn!("memory: store: nothing survives a restart");
    }
    let holder = crate::leader::holder_name(args.listen);
    let leadership = if store.elector().is_some() {
        Leadership::elected(holder)
    } else {
        Leadership::solo(holder)
    };
    let cluster = Cluster::new(store.clone(), Arc::new(SystemClock), config)?
        .with_leadership(leadership.clone())
        .with_target_tls(target_tls);
    let cluster = Arc::new(cluster);
    // The leader's own work runs on a fenced cluster (see `leader`).
    let leader_work = Arc::new(cluster.fenced());
    let app = router(cluster.clone(), auth.clone());
    let heal_stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let election = {
        let (stop, cluster) = (heal_stop.clone(), cluster.clone());
        std::thread::Builder::new()
            .name("nvpool-election".into())
            .spawn(move || crate::leader::run(store, leadership, stop, || cluster.begin_term()))
            .context("starting the election")?
    };
    let heal = crate::heal::spawn(
        leader_work.clone(),
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
        tracing::info!(addr = %listener.local_addr()?, store = %store_url,
            tls = server_tls.is_some(), "nvpool-control serving");
        tokio::spawn(crate::program::reconcile_loop(leader_work.clone()));
        tokio::spawn(crate::failover::watch_loop(leader_work));
        if !token_files.is_empty() {
            tokio::spawn(reload_tokens(token_files, auth));
        }
        let stopping = {
            let c = cluster.clone();
            async move {
                shutdown_signal().await;
                c.begin_shutdown();
            }
        };
        nvpool_api::serve::serve(listener, server_tls.as_ref(), app, stopping)
            .await
            .context("serving the API")?;
        anyhow::Ok(())
    })?;
    heal_stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = heal.join();
    // Resigns, so another control plane takes over at once.
    let _ = election.join();
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
/// bad command line (an unusable TLS file given on it too), 1 for any
/// other failure.
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
    if let Some(Command::Migrate(m)) = &args.command {
        return match migrate(m) {
            Ok(report) => {
                println!("{report}");
                0
            }
            Err(e) => {
                eprintln!("nvpool-control migrate: {e:#}");
                1
            }
        };
    }
    if args.state_dir.is_none() && args.store.is_none() && !is_root() {
        eprintln!(
            "nvpool-control: --state-dir (or --store) is required when not running as root \
             (see --help)"
        );
        return 2;
    }
    match run(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("nvpool-control: {e:#}");
            if e.chain().any(|c| c.is::<crate::tls::TlsError>()) {
                2
            } else {
                1
            }
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
        assert_eq!(a.target_cacert, None, "the system CA bundle by default");
        let a = Args::try_parse_from(["nvpool-control", "--target-cacert", "ca.pem"]).unwrap();
        assert_eq!(a.target_cacert, Some(PathBuf::from("ca.pem")));
        for (arg, ms) in [
            ("90", 90_000),
            ("5s", 5_000),
            ("2m", 120_000),
            ("1h", 3_600_000),
        ] {
            let a = Args::try_parse_from(["nvpool-control", "--replace-after", arg]).unwrap();
            assert_eq!(a.replace_after, ms, "{arg}");
        }
        let a =
            Args::try_parse_from(["nvpool-control", "--store", "etcd://h1,h2:2380/c1"]).unwrap();
        assert_eq!(
            a.store.unwrap().to_string(),
            "etcd://h1:2379,h2:2380/c1",
            "the URL, parsed"
        );
        let a = Args::try_parse_from(["nvpool-control", "--store", "redb:/tmp/s"]).unwrap();
        assert_eq!(a.store, Some(StoreUrl::Redb("/tmp/s".into())));
        let a = Args::try_parse_from([
            "nvpool-control",
            "migrate",
            "--from",
            "redb:/var/lib/nvpool-control",
            "--to",
            "etcds://10.0.0.1/prod",
            "--store-cacert",
            "ca.pem",
        ])
        .unwrap();
        let Some(Command::Migrate(m)) = a.command else {
            panic!("migrate");
        };
        assert_eq!(m.to.to_string(), "etcds://10.0.0.1:2379/prod");
        assert_eq!(m.store_tls.store_cacert, Some("ca.pem".into()));
        for bad in [
            &["--store", "etcd://"][..],
            &["--store", "file:/x"],
            &["--store", "memory:", "--state-dir", "/tmp/s"],
            &["--store-cert", "c.pem"],
            &["--store-key", "k.pem"],
            &[
                "--listen",
                "127.0.0.1:1",
                "migrate",
                "--from",
                "redb:/a",
                "--to",
                "memory:",
            ],
            &["migrate", "--from", "redb:/a"],
            &["--replace-after", "soon"],
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

    #[test]
    fn store_tls_flags_go_with_etcds() {
        let plain: StoreUrl = "etcd://h".parse().unwrap();
        let tls: StoreUrl = "etcds://h".parse().unwrap();
        let redb: StoreUrl = "redb:/x".parse().unwrap();
        let none = StoreTlsArgs::default();
        assert!(none.load(&[&plain, &redb]).unwrap().is_none());
        let err = none.load(&[&redb, &tls]).unwrap_err().to_string();
        assert!(err.contains("needs --store-cacert"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "-----BEGIN CERTIFICATE-----\n").unwrap();
        let with_ca = StoreTlsArgs {
            store_cacert: Some(ca.clone()),
            ..StoreTlsArgs::default()
        };
        let err = with_ca.load(&[&plain]).unwrap_err().to_string();
        assert!(err.contains("etcds:// stores only"), "{err}");
        let loaded = with_ca.load(&[&redb, &tls]).unwrap().unwrap();
        assert_eq!(loaded.ca_pem, b"-----BEGIN CERTIFICATE-----\n");
        assert!(loaded.client.is_none());
        let missing = StoreTlsArgs {
            store_cacert: Some(dir.path().join("nope.pem")),
            ..StoreTlsArgs::default()
        };
        assert!(missing.load(&[&tls]).is_err());
    }

    #[test]
    fn migrate_refuses_what_cannot_work() {
        let dir = tempfile::tempdir().unwrap();
        let args = |from: &str, to: &str| MigrateArgs {
            from: from.parse().unwrap(),
            to: to.parse().unwrap(),
            store_tls: StoreTlsArgs::default(),
        };
        let missing = format!("redb:{}", dir.path().join("none").display());
        let err = migrate(&args(&missing, "etcd://127.0.0.1:1")).unwrap_err();
        assert!(err.to_string().starts_with("no store at "), "{err}");
        assert!(
            !dir.path().join("none").exists(),
            "a missing source is not created"
        );
        let err = migrate(&args("memory:", "etcd://h")).unwrap_err();
        assert!(err.to_string().contains("memory:"), "{err}");
        let src = format!("redb:{}", dir.path().display());
        RedbStore::open_in_dir(dir.path()).unwrap();
        let err = migrate(&args(&src, &src)).unwrap_err();
        assert!(err.to_string().contains("same store"), "{err}");
        // redb into redb works too (and back out of etcd, the same way).
        let to = format!("redb:{}", dir.path().join("copy").display());
        let report = migrate(&args(&src, &to)).unwrap();
        assert!(report.starts_with("migrated 0 keys"), "{report}");
    }
}
