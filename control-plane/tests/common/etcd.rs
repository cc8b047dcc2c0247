//! Real etcd for tests: members started from the `etcd` binary on free
//! loopback ports, with data directories in a temporary directory (in
//! /dev/shm when there is one: fsyncs then cost nothing), killed when the
//! [`Etcd`] is dropped.
//!
//! Without an `etcd` binary (`$NVPOOL_ETCD`, else `etcd` on `PATH`) a test
//! is not run and says why, unless `CI=true`: then it fails, so that a CI
//! machine missing etcd cannot pass silently.

use nvpool_control::store::{EtcdConfig, EtcdStore, EtcdTls, EtcdUrl, HistoryLimits};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A member starts and joins its cluster within this on a busy machine.
const START_TIMEOUT: Duration = Duration::from_secs(40);
/// Tries with fresh ports when a port was taken between choosing and binding.
const START_ATTEMPTS: u32 = 3;
/// etcd's request limit for the tests: above `TXN_BYTES_MAX`, as
/// `limits.rs` asks of any etcd used by nvpool.
const MAX_REQUEST_BYTES: u64 = 4 << 20;

/// The etcd binary, or `None` (after saying so) when the test cannot run.
pub fn etcd_binary(test: &str) -> Option<PathBuf> {
    let found = match std::env::var_os("NVPOOL_ETCD") {
        Some(p) => Some(PathBuf::from(p)).filter(|p| p.is_file()),
        None => std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join("etcd"))
                .find(|p| p.is_file())
        }),
    };
    if found.is_none() {
        not_run(
            test,
            "no etcd binary ($NVPOOL_ETCD or etcd on PATH; scripts/setup-deps test)",
        );
    }
    found
}

/// Says that a test is not run, or fails it when `CI=true`.
pub fn not_run(test: &str, why: &str) {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{test}: {why}, and CI=true: the test must run");
    }
    eprintln!("not run: {test}: {why}");
}

/// TLS files of a test etcd: a CA, the server's certificate for 127.0.0.1,
/// and a client certificate, all made by the `openssl` command.
pub struct TlsFiles {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl TlsFiles {
    /// `None` (after saying why) when there is no `openssl` command.
    pub fn make(test: &str, dir: &Path) -> Option<TlsFiles> {
        let openssl = |args: &[&str]| -> bool {
            Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if !openssl(&["version"]) {
            not_run(test, "no openssl command to make certificates");
            return None;
        }
        let ok = openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=nvpool test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ]);
        assert!(ok, "openssl made no CA");
        for (name, cn, usage) in [
            ("server", "127.0.0.1", "serverAuth"),
            ("client", "nvpool-control", "clientAuth"),
        ] {
            let key = format!("{name}.key");
            let csr = format!("{name}.csr");
            let pem = format!("{name}.pem");
            let ext = format!("{name}.ext");
            std::fs::write(
                dir.join(&ext),
                format!(
                    "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
                     extendedKeyUsage={usage}\nsubjectAltName=IP:127.0.0.1\n"
                ),
            )
            .unwrap();
            let subject = format!("/CN={cn}");
            assert!(
                openssl(&[
                    "req",
                    "-newkey",
                    "ec",
                    "-pkeyopt",
                    "ec_paramgen_curve:P-256",
                    "-nodes",
                    "-keyout",
                    &key,
                    "-out",
                    &csr,
                    "-subj",
                    &subject,
                ]) && openssl(&[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-out",
                    &pem,
                    "-days",
                    "2",
                    "-extfile",
                    &ext,
                ]),
                "openssl made no {name} certificate"
            );
        }
        Some(TlsFiles {
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
        })
    }

    pub fn etcd_tls(&self, with_client_certificate: bool) -> EtcdTls {
        EtcdTls {
            ca_pem: std::fs::read(&self.ca).unwrap(),
            client: with_client_certificate.then(|| {
                (
                    std::fs::read(&self.client_cert).unwrap(),
                    std::fs::read(&self.client_key).unwrap(),
                )
            }),
        }
    }
}

struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    metrics_port: u16,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

/// A running etcd cluster of one or more members.
pub struct Etcd {
    binary: PathBuf,
    dir: tempfile::TempDir,
    members: Vec<Member>,
    initial_cluster: String,
    token: String,
    tls: Option<TlsFiles>,
}

fn free_port() -> (TcpListener, u16) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    (l, port)
}

/// An HTTP/1.0 GET on loopback; `None` when nothing answers.
fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

impl Etcd {
    /// `members` members (1 or 3, say) over plain gRPC; `None` when the
    /// test cannot run.
    pub fn start(test: &str, members: usize) -> Option<Etcd> {
        let mut etcd = Etcd::new(etcd_binary(test)?);
        etcd.boot(members);
        Some(etcd)
    }

    /// One member serving clients over TLS and requiring client
    /// certificates; `None` when the test cannot run.
    pub fn start_tls(test: &str) -> Option<Etcd> {
        let mut etcd = Etcd::new(etcd_binary(test)?);
        let certs = etcd.dir.path().join("certs");
        std::fs::create_dir(&certs).unwrap();
        etcd.tls = Some(TlsFiles::make(test, &certs)?);
        etcd.boot(1);
        Some(etcd)
    }

    fn new(binary: PathBuf) -> Etcd {
        Etcd {
            binary,
            dir: tempdir(),
            members: Vec::new(),
            initial_cluster: String::new(),
            token: String::new(),
            tls: None,
        }
    }

    fn boot(&mut self, n: usize) {
        for attempt in 1..=START_ATTEMPTS {
            self.layout(n, attempt);
            for i in 0..n {
                self.spawn(i, "new");
            }
            match self.wait_healthy_all() {
                Ok(()) => return,
                Err(why) if attempt < START_ATTEMPTS => {
                    eprintln!("etcd did not start ({why}); again with other ports");
                    self.kill_all();
                }
                Err(why) => panic!("etcd did not start: {why}\n{}", self.logs()),
            }
        }
    }

    /// Chooses ports and directories for `n` members.
    fn layout(&mut self, n: usize, attempt: u32) {
        // Hold every listener until all ports are chosen, so they differ.
        let mut held = Vec::new();
        let mut port = || {
            let (l, p) = free_port();
            held.push(l);
            p
        };
        self.members = (0..n)
            .map(|i| {
                let name = format!("m{i}");
                let data_dir = self.dir.path().join(format!("{name}-{attempt}"));
                Member {
                    log: self.dir.path().join(format!("{name}-{attempt}.log")),
                    name,
                    client_port: port(),
                    peer_port: port(),
                    metrics_port: port(),
                    data_dir,
                    child: None,
                }
            })
            .collect();
        self.initial_cluster = self
            .members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",");
        self.token = format!("nvpool-test-{}-{attempt}-{}", std::process::id(), n);
    }

    fn client_scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    fn spawn(&mut self, i: usize, state: &str) {
        let scheme = self.client_scheme();
        let m = &self.members[i];
        let client = format!("{scheme}://127.0.0.1:{}", m.client_port);
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&m.log)
            .unwrap();
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--name")
            .arg(&m.name)
            .arg("--data-dir")
            .arg(&m.data_dir)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args([
                "--listen-metrics-urls",
                &format!("http://127.0.0.1:{}", m.metrics_port),
            ])
            .args(["--initial-cluster", &self.initial_cluster])
            .args(["--initial-cluster-state", state])
            .args(["--initial-cluster-token", &self.token])
            .args(["--max-request-bytes", &MAX_REQUEST_BYTES.to_string()])
            .args(["--logger", "zap", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        if let Some(tls) = &self.tls {
            cmd.arg("--cert-file")
                .arg(&tls.server_cert)
                .arg("--key-file")
                .arg(&tls.server_key)
                .arg("--trusted-ca-file")
                .arg(&tls.ca)
                .arg("--client-cert-auth");
        }
        let child = cmd.spawn().expect("etcd starts");
        self.members[i].child = Some(child);
    }

    /// Whether member `i` says it is healthy (it has a leader and answers).
    pub fn healthy(&self, i: usize) -> bool {
        http_get(self.members[i].metrics_port, "/health")
            .is_some_and(|r| r.contains("\"health\":\"true\""))
    }

    fn wait_healthy_all(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            for (i, m) in self.members.iter_mut().enumerate() {
                if let Some(child) = &mut m.child {
                    if let Ok(Some(status)) = child.try_wait() {
                        return Err(format!("member {i} exited: {status}"));
                    }
                }
            }
            let all = (0..self.members.len())
                .filter(|&i| self.members[i].child.is_some())
                .all(|i| self.healthy(i));
            if all {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("not healthy after {START_TIMEOUT:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until every running member is healthy.
    pub fn wait_healthy(&mut self) {
        if let Err(why) = self.wait_healthy_all() {
            panic!("{why}\n{}", self.logs());
        }
    }

    /// The member that is leader now, if any.
    pub fn leader(&self) -> Option<usize> {
        (0..self.members.len()).find(|&i| {
            self.members[i].child.is_some()
                && http_get(self.members[i].metrics_port, "/metrics")
                    .is_some_and(|m| m.lines().any(|l| l == "etcd_server_is_leader 1"))
        })
    }

    /// SIGKILLs member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts member `i` again on its data (it rejoins its cluster).
    pub fn restart(&mut self, i: usize) {
        assert!(self.members[i].child.is_none(), "member {i} runs");
        self.spawn(i, "existing");
    }

    fn kill_all(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }

    /// `127.0.0.1:port` of each member's client listener.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client_port))
            .collect()
    }

    pub fn url(&self, prefix: &str) -> EtcdUrl {
        EtcdUrl {
            tls: self.tls.is_some(),
            endpoints: self.endpoints(),
            prefix: prefix.to_owned(),
        }
    }

    pub fn url_string(&self, prefix: &str) -> String {
        self.url(prefix).to_string()
    }

    pub fn tls(&self) -> Option<&TlsFiles> {
        self.tls.as_ref()
    }

    /// A store on every member, under `prefix`.
    pub fn store(&self, prefix: &str) -> EtcdStore {
        self.store_with(prefix, HistoryLimits::default())
    }

    pub fn store_with(&self, prefix: &str, history: HistoryLimits) -> EtcdStore {
        let config = EtcdConfig {
            url: self.url(prefix),
            tls: self.tls.as_ref().map(|t| t.etcd_tls(true)),
            history,
        };
        EtcdStore::connect(config).expect("the store connects")
    }

    /// Every member's log, for a failure message.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for m in &self.members {
            let text = std::fs::read_to_string(&m.log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(20).collect();
            out.push_str(&format!("--- {} (last lines)\n", m.name));
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill_all();
    }
}

fn tempdir() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        if let Ok(d) = tempfile::Builder::new()
            .prefix("nvpool-etcd-")
            .tempdir_in(shm)
        {
            return d;
        }
    }
    tempfile::Builder::new()
        .prefix("nvpool-etcd-")
        .tempdir()
        .unwrap()
}
