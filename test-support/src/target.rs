//! An nvpool-target inside the test process: the subsystems it serves
//! ([`subsystem`]), how it listens ([`loopback`], [`admin`]) and the
//! running daemon ([`start`] → [`Serving`]), stopped when dropped.

use nvpool_target::config::{NamespaceConfig, SubsystemConfig};
use nvpool_target::{AdminOptions, AdminTokens, Running, StartOptions, Target};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// 127.0.0.1, a port the kernel picks.
pub const LOOPBACK: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 0);

/// How long [`start`] retries binding an address a previous daemon of the
/// same test has just left (its sockets may linger a moment).
pub const BIND_RETRY: Duration = Duration::from_secs(5);

/// A subsystem with the given allowed hosts (none: any host) and namespaces
/// (NSID, backend spec such as `ram:16M` or `file:PATH`).
pub fn subsystem(nqn: &str, hosts: &[&str], namespaces: &[(u32, &str)]) -> SubsystemConfig {
    SubsystemConfig {
        nqn: nqn.to_owned(),
        allowed_hosts: hosts.iter().map(|h| h.to_string()).collect(),
        allow_any_host: hosts.is_empty(),
        host_keys: Default::default(),
        serial: None,
        model: None,
        ana: None,
        namespaces: namespaces
            .iter()
            .map(|&(nsid, backend)| NamespaceConfig {
                nsid,
                backend: backend.to_owned(),
                uuid: None,
                read_only: false,
            })
            .collect(),
    }
}

/// One NVMe/TCP listener on [`LOOPBACK`], two reactors on io_uring, no
/// admin API: change what a test needs with `..loopback()`.
pub fn loopback() -> StartOptions {
    StartOptions {
        listeners: vec![LOOPBACK],
        rdma_listeners: vec![],
        reactors: 2,
        io_uring: true,
        admin: None,
    }
}

/// An admin API over plain HTTP on `listen` accepting `tokens`.
pub fn admin(listen: SocketAddr, tokens: AdminTokens) -> AdminOptions {
    AdminOptions {
        listen,
        tokens,
        tls: None,
        devices: Vec::new(),
    }
}

/// A target daemon running inside the test process; dropping it stops it.
#[derive(Debug)]
pub struct Serving {
    running: Option<Running>,
    /// Its first NVMe/TCP listener.
    pub addr: SocketAddr,
    /// Its admin API, when it has one.
    pub admin: Option<SocketAddr>,
}

/// Starts `target` as `opts` say, retrying for [`BIND_RETRY`] while an
/// address is still taken; fails the test when it does not start.
#[track_caller]
pub fn start(target: &Arc<Target>, opts: &StartOptions) -> Serving {
    let give_up = Instant::now() + BIND_RETRY;
    let running = loop {
        match Running::start(target.clone(), opts) {
            Ok(r) => break r,
            Err(e) if Instant::now() < give_up => {
                eprintln!(
                    "target start on {:?} failed ({e:#}); retrying",
                    opts.listeners
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("target does not start on {:?}: {e:#}", opts.listeners),
        }
    };
    let addrs = running.listen_addrs();
    assert_eq!(addrs.len(), opts.listeners.len(), "listeners: {addrs:?}");
    Serving {
        addr: addrs[0],
        admin: running.admin_addr(),
        running: Some(running),
    }
}

impl Serving {
    /// The admin API's address; fails the test when it has none.
    #[track_caller]
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin.expect("the target serves an admin API")
    }

    /// Whether it still runs ([`Serving::stop`] not called yet).
    pub fn is_running(&self) -> bool {
        self.running.is_some()
    }

    /// Stops it: drains in-flight commands and flushes backends. Stopping
    /// a stopped target does nothing.
    pub fn stop(&mut self) {
        if let Some(r) = self.running.take() {
            r.shutdown();
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.stop();
    }
}
