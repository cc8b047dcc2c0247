//! The NBD front-end: a server for the Network Block Device protocol
//! (fixed newstyle handshake, structured replies) on a Unix socket and/or
//! TCP, and [`kernel`], which hands a socket to the Linux nbd driver.
//!
//! ```text
//!  client ──► reader thread ── header, payload ──► exec::Executor ── BlockDev
//!     ▲        (one per connection; waits for         │
//!     │         an in-flight slot)                     ▼ reply (any order)
//!     └────────── writer thread ◄── bounded channel ◄──┘
//! ```
//!
//! Requests on one connection run concurrently and are answered as they
//! complete, matched by cookie. Each connection holds at most
//! [`NBD_IN_FLIGHT_MAX`] requests and [`NBD_IN_FLIGHT_BYTES_MAX`] bytes of payload;
//! the reader waits for room, and the reply channel holds one slot per
//! in-flight request, so nothing queues without bound.
//!
//! Bad input is answered with the protocol's error and the connection
//! keeps serving (unknown command or flag → EINVAL, read or trim past the
//! end → EINVAL, write or write-zeroes past the end → ENOSPC, write to a
//! read-only export → EPERM). Input that makes the stream unreadable
//! (bad request magic, a write payload over [`NBD_PAYLOAD_BYTES_MAX`],
//! unknown client flags) ends that connection only. Nothing a client sends
//! can panic the server or touch another connection.
//!
//! Every connection goes to the same [`BlockDev`], whose `flush` makes
//! every completed write durable, so a flush on one connection covers
//! writes completed on any: the server advertises `NBD_FLAG_CAN_MULTI_CONN`.
//!
//! Block sizes: the minimum is the device's block size, the preferred its
//! optimal I/O size (4096 without one), the maximum its largest request.
//! A client that asked for block sizes (`NBD_INFO_BLOCK_SIZE` in
//! `NBD_OPT_GO`) must respect them and gets EINVAL otherwise; one that did
//! not (`NBD_OPT_EXPORT_NAME`, or GO without the request) may send any
//! alignment, served by read-modify-write.
//!
//! The export's size is the device's at the time: a handshake announces
//! it as it is then, and a request is inside the export when it ends
//! within the device as it is when the request arrives. A device that
//! grows while served (a volume grown online) serves its new bytes at
//! once, to clients that learn the new size (a new handshake, or the
//! kernel told by [`kernel::KernelNbd::resize`]).

pub mod kernel;

use super::span::Span;
use crate::blockdev::BlockDev;
use crate::exec::Executor;
use crate::limits::{
    NBD_CONNECTIONS_MAX, NBD_HANDSHAKE_READ_TIMEOUT_MS, NBD_IN_FLIGHT_BYTES_MAX, NBD_IN_FLIGHT_MAX,
    NBD_IO_THREADS_DEFAULT, NBD_OPTIONS_MAX, NBD_OPTION_DATA_BYTES_MAX, NBD_PAYLOAD_BYTES_MAX,
    NBD_PEER_LOG_INTERVAL_MS, NBD_TASKS_MAX,
};
use nvpool_rt::{lock, wake, Wakeup};
use std::collections::HashMap;
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

// Handshake.
const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
const FLAG_NO_ZEROES: u16 = 1 << 1;
const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
const FLAG_C_NO_ZEROES: u32 = 1 << 1;

const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_LIST: u32 = 3;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const OPT_LIST_META_CONTEXT: u32 = 9;
const OPT_SET_META_CONTEXT: u32 = 10;

const REP_ACK: u32 = 1;
const REP_SERVER: u32 = 2;
const REP_INFO: u32 = 3;
const REP_ERR: u32 = 1 << 31;
const REP_ERR_UNSUP: u32 = REP_ERR | 1;
const REP_ERR_INVALID: u32 = REP_ERR | 3;
const REP_ERR_UNKNOWN: u32 = REP_ERR | 6;
const REP_ERR_SHUTDOWN: u32 = REP_ERR | 7;
const REP_ERR_TOO_BIG: u32 = REP_ERR | 9;

const INFO_EXPORT: u16 = 0;
const INFO_NAME: u16 = 1;
const INFO_DESCRIPTION: u16 = 2;
const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags (the `NBD_FLAG_*` of the export).
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_READ_ONLY: u16 = 1 << 1;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;

// Transmission.
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
const REQUEST_BYTES: usize = 28;

const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_TRIM: u16 = 4;
const CMD_WRITE_ZEROES: u16 = 6;

const CMD_FLAG_FUA: u16 = 1 << 0;
const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
const CMD_FLAG_DF: u16 = 1 << 2;

const REPLY_FLAG_DONE: u16 = 1 << 0;
const REPLY_TYPE_NONE: u16 = 0;
const REPLY_TYPE_OFFSET_DATA: u16 = 1;
const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;

const EPERM: u32 = 1;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;

/// Why a server could not start.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    #[error("cannot listen on {addr}")]
    Listen {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("{0} exists and is not a socket")]
    NotASocket(PathBuf),
    #[error("nothing to listen on: give a Unix socket path or a TCP address")]
    NoListener,
    #[error("cannot start a server thread")]
    Thread(#[source] io::Error),
}

/// How to serve.
#[derive(Debug, Clone)]
pub struct NbdOptions {
    /// The export's name; the default export (empty name) is always it too.
    pub export_name: String,
    /// Shown by `nbdinfo` and friends (NBD_INFO_DESCRIPTION).
    pub description: String,
    /// Unix socket to listen on (created; a stale socket there is replaced).
    pub unix_socket: Option<PathBuf>,
    /// TCP address to listen on, e.g. 127.0.0.1:10809 (port 0 = any).
    pub tcp: Option<SocketAddr>,
    pub read_only: bool,
    /// Threads polling BlockDev futures.
    pub io_threads: usize,
}

impl Default for NbdOptions {
    fn default() -> NbdOptions {
        NbdOptions {
            export_name: "nvpool".into(),
            description: String::new(),
            unix_socket: None,
            tcp: None,
            read_only: false,
            io_threads: NBD_IO_THREADS_DEFAULT,
        }
    }
}

/// Logs a peer-triggered event at most once per [`NBD_PEER_LOG_INTERVAL_MS`].
fn peer_warn(what: &str, detail: &dyn std::fmt::Display) {
    static LAST_MS: AtomicU64 = AtomicU64::new(0);
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let now = START.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1;
    let last = LAST_MS.load(Ordering::Relaxed);
    if (last == 0 || now.saturating_sub(last) >= NBD_PEER_LOG_INTERVAL_MS)
        && LAST_MS
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        tracing::warn!(detail = %detail, "nbd: {what}");
    } else {
        tracing::debug!(detail = %detail, "nbd: {what}");
    }
}

/// A connected socket of either kind.
#[derive(Debug)]
enum Sock {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Sock {
    fn try_clone(&self) -> io::Result<Sock> {
        Ok(match self {
            Sock::Unix(s) => Sock::Unix(s.try_clone()?),
            Sock::Tcp(s) => Sock::Tcp(s.try_clone()?),
        })
    }

    fn shutdown(&self) {
        let _ = match self {
            Sock::Unix(s) => s.shutdown(Shutdown::Both),
            Sock::Tcp(s) => s.shutdown(Shutdown::Both),
        };
    }

    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Sock::Unix(s) => s.set_read_timeout(t),
            Sock::Tcp(s) => s.set_read_timeout(t),
        }
    }
}

impl Read for Sock {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Sock::Unix(s) => s.read(buf),
            Sock::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Sock {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Sock::Unix(s) => s.write(buf),
            Sock::Tcp(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Sock::Unix(s) => s.write_vectored(bufs),
            Sock::Tcp(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Writes every byte of `a` then `b` (header and payload) in as few
/// system calls as the socket allows.
fn write_two(w: &mut Sock, mut a: &[u8], mut b: &[u8]) -> io::Result<()> {
    while !a.is_empty() || !b.is_empty() {
        let n = if a.is_empty() {
            w.write(b)?
        } else {
            w.write_vectored(&[IoSlice::new(a), IoSlice::new(b)])?
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let from_a = n.min(a.len());
        a = &a[from_a..];
        b = &b[n - from_a..];
    }
    Ok(())
}

/// What the export looks like to clients besides its size, which is the
/// device's at the time asked (a volume may grow while served).
#[derive(Debug, Clone, Copy)]
struct Export {
    flags: u16,
    min_block: u32,
    preferred_block: u32,
    max_block: u32,
}

impl Export {
    fn of(dev: &dyn BlockDev, read_only: bool) -> Export {
        let min = dev.block_size();
        let preferred = match dev.optimal_io_bytes() {
            n if n.is_power_of_two() && n >= min => n,
            _ => 4096u32.max(min),
        };
        let max = dev
            .max_io_bytes()
            .clamp(preferred, NBD_PAYLOAD_BYTES_MAX.max(preferred));
        let mut flags = FLAG_HAS_FLAGS
            | FLAG_SEND_FLUSH
            | FLAG_SEND_FUA
            | FLAG_SEND_TRIM
            | FLAG_SEND_WRITE_ZEROES
            | FLAG_CAN_MULTI_CONN;
        if read_only {
            flags |= FLAG_READ_ONLY;
        }
        Export {
            flags,
            min_block: min,
            preferred_block: preferred,
            max_block: max - max % min,
        }
    }
}

/// State shared by the listeners and every connection.
struct Shared {
    span: Arc<Span>,
    exec: Executor,
    export: Export,
    name: String,
    description: String,
    read_only: bool,
    stopping: AtomicBool,
    conns: Mutex<HashMap<u64, ConnEntry>>,
    next_id: AtomicU64,
}

/// What the server keeps of a connection to end it at shutdown.
struct ConnEntry {
    sock: Sock,
    thread: Option<JoinHandle<()>>,
}

impl Shared {
    fn conns(&self) -> MutexGuard<'_, HashMap<u64, ConnEntry>> {
        lock(&self.conns)
    }

    fn name_matches(&self, name: &[u8]) -> bool {
        name.is_empty() || name == self.name.as_bytes()
    }
}

/// A running NBD server. Dropping it (or [`NbdServer::shutdown`]) stops
/// accepting, ends every connection after its in-flight requests complete
/// and removes the Unix socket.
pub struct NbdServer {
    shared: Arc<Shared>,
    stop: Arc<Wakeup>,
    listeners: Vec<JoinHandle<()>>,
    unix_socket: Option<PathBuf>,
    tcp: Option<SocketAddr>,
}

impl std::fmt::Debug for NbdServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdServer")
            .field("export", &self.shared.name)
            .field("unix_socket", &self.unix_socket)
            .field("tcp", &self.tcp)
            .finish()
    }
}

/// How a connection enters transmission.
#[derive(Debug, Clone, Copy)]
struct Negotiated {
    structured: bool,
    /// The client asked for block sizes and must keep to them.
    strict_blocks: bool,
}

impl NbdServer {
    /// Starts serving `dev` on the listeners in `opts`.
    pub fn start(dev: Arc<dyn BlockDev>, opts: &NbdOptions) -> Result<NbdServer, NbdError> {
        if opts.unix_socket.is_none() && opts.tcp.is_none() {
            return Err(NbdError::NoListener);
        }
        let mut srv = NbdServer::without_listeners(dev, opts)?;
        if let Some(path) = &opts.unix_socket {
            let l = bind_unix(path)?;
            srv.unix_socket = Some(path.clone());
            srv.spawn_listener(Listener::Unix(l))?;
        }
        if let Some(addr) = opts.tcp {
            let l = TcpListener::bind(addr).map_err(|source| NbdError::Listen {
                addr: addr.to_string(),
                source,
            })?;
            srv.tcp = l.local_addr().ok();
            srv.spawn_listener(Listener::Tcp(l))?;
        }
        Ok(srv)
    }

    /// A server with no listener; connections come through
    /// [`NbdServer::serve_transmission`] (the kernel driver's socket).
    pub fn without_listeners(
        dev: Arc<dyn BlockDev>,
        opts: &NbdOptions,
    ) -> Result<NbdServer, NbdError> {
        let export = Export::of(dev.as_ref(), opts.read_only);
        let exec = Executor::new(
            "nvpool-nbd-io",
            opts.io_threads.max(1),
            NBD_TASKS_MAX,
            false,
        )
        .map_err(NbdError::Thread)?;
        let stop = Arc::new(Wakeup::nonblocking().map_err(NbdError::Thread)?);
        Ok(NbdServer {
            shared: Arc::new(Shared {
                span: Arc::new(Span::new(dev)),
                exec,
                export,
                name: opts.export_name.clone(),
                description: opts.description.clone(),
                read_only: opts.read_only,
                stopping: AtomicBool::new(false),
                conns: Mutex::new(HashMap::new()),
                next_id: AtomicU64::new(1),
            }),
            stop,
            listeners: Vec::new(),
            unix_socket: None,
            tcp: None,
        })
    }

    pub fn unix_socket(&self) -> Option<&Path> {
        self.unix_socket.as_deref()
    }

    /// The TCP address actually bound (port 0 resolved).
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp
    }

    /// Connections being served.
    pub fn connections(&self) -> usize {
        self.shared.conns().len()
    }

    /// Serves a socket that skips the handshake and starts in transmission
    /// with simple replies and the advertised block sizes: what the kernel
    /// nbd driver expects of a socket handed to it.
    pub fn serve_transmission(&self, sock: UnixStream) -> Result<(), NbdError> {
        let neg = Negotiated {
            structured: false,
            strict_blocks: true,
        };
        spawn_conn(&self.shared, Sock::Unix(sock), Some(neg)).map_err(NbdError::Thread)
    }

    fn spawn_listener(&mut self, l: Listener) -> Result<(), NbdError> {
        let shared = self.shared.clone();
        let stop = self.stop.clone();
        let t = std::thread::Builder::new()
            .name("nvpool-nbd-accept".into())
            .spawn(move || accept_loop(l, &shared, &stop))
            .map_err(NbdError::Thread)?;
        self.listeners.push(t);
        Ok(())
    }

    /// Stops accepting, ends every connection once its in-flight requests
    /// completed, and waits for all of it.
    pub fn shutdown(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.stop.wake();
        for t in self.listeners.drain(..) {
            let _ = t.join();
        }
        let threads: Vec<JoinHandle<()>> = {
            let mut g = self.shared.conns();
            g.values_mut()
                .filter_map(|c| {
                    c.sock.shutdown();
                    c.thread.take()
                })
                .collect()
        };
        for t in threads {
            let _ = t.join();
        }
        if let Some(p) = self.unix_socket.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        self.stop_all();
    }
}

enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Listener::Unix(l) => l.as_fd(),
            Listener::Tcp(l) => l.as_fd(),
        }
    }

    fn accept(&self) -> io::Result<Sock> {
        Ok(match self {
            Listener::Unix(l) => {
                let s = l.accept()?.0;
                s.set_nonblocking(false)?;
                Sock::Unix(s)
            }
            Listener::Tcp(l) => {
                let s = l.accept()?.0;
                s.set_nonblocking(false)?;
                let _ = s.set_nodelay(true);
                Sock::Tcp(s)
            }
        })
    }
}

fn bind_unix(path: &Path) -> Result<UnixListener, NbdError> {
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if !m.file_type().is_socket() {
            return Err(NbdError::NotASocket(path.to_path_buf()));
        }
        // A live server answers; a stale socket file is replaced.
        if UnixStream::connect(path).is_ok() {
            return Err(NbdError::Listen {
                addr: path.display().to_string(),
                source: io::ErrorKind::AddrInUse.into(),
            });
        }
        let _ = std::fs::remove_file(path);
    }
    UnixListener::bind(path).map_err(|source| NbdError::Listen {
        addr: path.display().to_string(),
        source,
    })
}

fn accept_loop(l: Listener, shared: &Arc<Shared>, stop: &Wakeup) {
    let nonblocking = match &l {
        Listener::Unix(u) => u.set_nonblocking(true),
        Listener::Tcp(t) => t.set_nonblocking(true),
    };
    if let Err(e) = nonblocking {
        tracing::error!(error = %e, "nbd: listener setup failed");
        return;
    }
    loop {
        let mut fds = [
            wake::pollfd(l.fd().as_raw_fd(), libc::POLLIN),
            wake::pollfd(stop.as_raw_fd(), libc::POLLIN),
        ];
        // Interrupted: no events, look again.
        if let Err(e) = wake::poll(&mut fds, None) {
            tracing::error!(error = %e, "nbd: poll failed");
            return;
        }
        if fds[1].revents != 0 || shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        if fds[0].revents == 0 {
            continue;
        }
        let sock = match l.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                peer_warn("accept failed", &e);
                // EMFILE and friends: do not spin.
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if shared.conns().len() >= NBD_CONNECTIONS_MAX {
            peer_warn(
                "connection limit reached; closing a new connection",
                &NBD_CONNECTIONS_MAX,
            );
            continue;
        }
        if let Err(e) = spawn_conn(shared, sock, None) {
            tracing::error!(error = %e, "nbd: cannot start a connection thread");
        }
    }
}

/// Registers a connection and starts its thread; `neg` skips the
/// handshake (kernel sockets).
fn spawn_conn(shared: &Arc<Shared>, sock: Sock, neg: Option<Negotiated>) -> io::Result<()> {
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let handle = sock.try_clone()?;
    // Hold the registry lock until the entry is complete, so the thread's
    // own removal at exit cannot run first.
    let mut g = shared.conns();
    let s2 = shared.clone();
    let t = std::thread::Builder::new()
        .name(format!("nvpool-nbd-{id}"))
        .spawn(move || {
            if let Err(e) = serve_conn(&s2, sock, neg) {
                tracing::debug!(error = %e, conn = id, "nbd: connection ended");
            }
            s2.conns().remove(&id);
        })?;
    g.insert(
        id,
        ConnEntry {
            sock: handle,
            thread: Some(t),
        },
    );
    Ok(())
}

fn serve_conn(shared: &Arc<Shared>, sock: Sock, neg: Option<Negotiated>) -> io::Result<()> {
    let mut w = sock.try_clone()?;
    let mut r = BufReader::with_capacity(64 << 10, sock);
    let neg = match neg {
        Some(n) => n,
        None => {
            r.get_ref()
                .set_read_timeout(Some(Duration::from_millis(NBD_HANDSHAKE_READ_TIMEOUT_MS)))?;
            let n = handshake(shared, &mut r, &mut w)?;
            r.get_ref().set_read_timeout(None)?;
            match n {
                Some(n) => n,
                None => return Ok(()),
            }
        }
    };
    transmission(shared, r, w, neg)
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

fn protocol(what: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

fn opt_reply(w: &mut Sock, opt: u32, kind: u32, data: &[u8]) -> io::Result<()> {
    let mut h = [0u8; 20];
    h[0..8].copy_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    h[8..12].copy_from_slice(&opt.to_be_bytes());
    h[12..16].copy_from_slice(&kind.to_be_bytes());
    h[16..20].copy_from_slice(&(data.len() as u32).to_be_bytes());
    write_two(w, &h, data)
}

/// An NBD_OPT_INFO / NBD_OPT_GO request: export name and info requests.
fn parse_info(data: &[u8]) -> Option<(&[u8], Vec<u16>)> {
    let name_len = u32::from_be_bytes(data.get(0..4)?.try_into().ok()?) as usize;
    let name = data.get(4..4usize.checked_add(name_len)?)?;
    let rest = &data[4 + name_len..];
    let n = u16::from_be_bytes(rest.get(0..2)?.try_into().ok()?) as usize;
    let reqs = rest.get(2..)?;
    if reqs.len() != n * 2 {
        return None;
    }
    Some((
        name,
        reqs.chunks_exact(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
            .collect(),
    ))
}

/// NBD_OPT_{LIST,SET}_META_CONTEXT: export name and queries; only checked
/// for shape, since no metadata context is offered.
fn parse_meta(data: &[u8]) -> Option<&[u8]> {
    let name_len = u32::from_be_bytes(data.get(0..4)?.try_into().ok()?) as usize;
    let name = data.get(4..4usize.checked_add(name_len)?)?;
    let mut rest = &data[4 + name_len..];
    let n = u32::from_be_bytes(rest.get(0..4)?.try_into().ok()?);
    rest = &rest[4..];
    for _ in 0..n {
        let l = u32::from_be_bytes(rest.get(0..4)?.try_into().ok()?) as usize;
        rest = rest.get(4usize.checked_add(l)?..)?;
    }
    rest.is_empty().then_some(name)
}

/// Option haggling. Returns how to run transmission, or None when the
/// client ended the session.
fn handshake(
    shared: &Shared,
    r: &mut BufReader<Sock>,
    w: &mut Sock,
) -> io::Result<Option<Negotiated>> {
    let mut hello = [0u8; 18];
    hello[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    hello[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    hello[16..18].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    w.write_all(&hello)?;
    let cflags = read_u32(r)?;
    if cflags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        // The protocol requires closing on client flags we do not know.
        peer_warn(
            "unknown client flags; closing",
            &format_args!("{cflags:#x}"),
        );
        return Ok(None);
    }
    let no_zeroes = cflags & FLAG_C_NO_ZEROES != 0;
    let ex = shared.export;
    let mut structured = false;
    for _ in 0..NBD_OPTIONS_MAX {
        if read_u64(r)? != IHAVEOPT {
            peer_warn("bad option magic; closing", &"");
            return Err(protocol("bad option magic"));
        }
        let opt = read_u32(r)?;
        let len = read_u32(r)?;
        if len > NBD_OPTION_DATA_BYTES_MAX {
            io::copy(&mut r.by_ref().take(len as u64), &mut io::sink())?;
            if opt == OPT_EXPORT_NAME {
                return Err(protocol("export name too long"));
            }
            opt_reply(w, opt, REP_ERR_TOO_BIG, b"option data too long")?;
            continue;
        }
        let mut data = vec![0; len as usize];
        r.read_exact(&mut data)?;
        if shared.stopping.load(Ordering::SeqCst) && opt != OPT_ABORT {
            if opt == OPT_EXPORT_NAME {
                return Ok(None);
            }
            opt_reply(w, opt, REP_ERR_SHUTDOWN, b"server shutting down")?;
            continue;
        }
        match opt {
            OPT_EXPORT_NAME => {
                if !shared.name_matches(&data) {
                    // No way to answer an error here but closing.
                    return Ok(None);
                }
                let mut b = [0u8; 10 + 124];
                b[0..8].copy_from_slice(&shared.span.size().to_be_bytes());
                b[8..10].copy_from_slice(&ex.flags.to_be_bytes());
                let n = if no_zeroes { 10 } else { b.len() };
                w.write_all(&b[..n])?;
                return Ok(Some(Negotiated {
                    structured,
                    strict_blocks: false,
                }));
            }
            OPT_ABORT => {
                // The client may already be gone; that is fine.
                let _ = opt_reply(w, opt, REP_ACK, &[]);
                return Ok(None);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    opt_reply(w, opt, REP_ERR_INVALID, b"NBD_OPT_LIST takes no data")?;
                    continue;
                }
                let mut d = Vec::with_capacity(4 + shared.name.len());
                d.extend_from_slice(&(shared.name.len() as u32).to_be_bytes());
                d.extend_from_slice(shared.name.as_bytes());
                opt_reply(w, opt, REP_SERVER, &d)?;
                opt_reply(w, opt, REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => {
                let Some((name, reqs)) = parse_info(&data) else {
                    opt_reply(w, opt, REP_ERR_INVALID, b"malformed NBD_OPT_INFO/GO")?;
                    continue;
                };
                if !shared.name_matches(name) {
                    opt_reply(w, opt, REP_ERR_UNKNOWN, b"no such export")?;
                    continue;
                }
                let mut e = [0u8; 12];
                e[0..2].copy_from_slice(&INFO_EXPORT.to_be_bytes());
                e[2..10].copy_from_slice(&shared.span.size().to_be_bytes());
                e[10..12].copy_from_slice(&ex.flags.to_be_bytes());
                opt_reply(w, opt, REP_INFO, &e)?;
                // Sent even when not asked: the client may ignore it.
                let mut b = [0u8; 14];
                b[0..2].copy_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
                b[2..6].copy_from_slice(&ex.min_block.to_be_bytes());
                b[6..10].copy_from_slice(&ex.preferred_block.to_be_bytes());
                b[10..14].copy_from_slice(&ex.max_block.to_be_bytes());
                opt_reply(w, opt, REP_INFO, &b)?;
                if reqs.contains(&INFO_NAME) {
                    let mut d = INFO_NAME.to_be_bytes().to_vec();
                    d.extend_from_slice(shared.name.as_bytes());
                    opt_reply(w, opt, REP_INFO, &d)?;
                }
                if reqs.contains(&INFO_DESCRIPTION) && !shared.description.is_empty() {
                    let mut d = INFO_DESCRIPTION.to_be_bytes().to_vec();
                    d.extend_from_slice(shared.description.as_bytes());
                    opt_reply(w, opt, REP_INFO, &d)?;
                }
                opt_reply(w, opt, REP_ACK, &[])?;
                if opt == OPT_GO {
                    return Ok(Some(Negotiated {
                        structured,
                        strict_blocks: reqs.contains(&INFO_BLOCK_SIZE),
                    }));
                }
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    opt_reply(w, opt, REP_ERR_INVALID, b"takes no data")?;
                    continue;
                }
                structured = true;
                opt_reply(w, opt, REP_ACK, &[])?;
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                if !structured {
                    opt_reply(w, opt, REP_ERR_INVALID, b"needs structured replies")?;
                    continue;
                }
                match parse_meta(&data) {
                    None => opt_reply(w, opt, REP_ERR_INVALID, b"malformed meta context")?,
                    Some(n) if !shared.name_matches(n) => {
                        opt_reply(w, opt, REP_ERR_UNKNOWN, b"no such export")?
                    }
                    // No metadata contexts are offered: an empty list.
                    Some(_) => opt_reply(w, opt, REP_ACK, &[])?,
                }
            }
            _ => opt_reply(w, opt, REP_ERR_UNSUP, b"option not supported")?,
        }
    }
    peer_warn("too many options; closing", &NBD_OPTIONS_MAX);
    Ok(None)
}

/// Counts what one connection has in flight.
#[derive(Debug, Default)]
struct InFlight {
    state: Mutex<(usize, usize)>,
    cv: Condvar,
}

impl InFlight {
    fn lock(&self) -> MutexGuard<'_, (usize, usize)> {
        lock(&self.state)
    }

    /// Waits for room for one more request of `bytes` payload.
    fn acquire(&self, bytes: usize) {
        let mut g = self.lock();
        while g.0 >= NBD_IN_FLIGHT_MAX || (g.0 > 0 && g.1 + bytes > NBD_IN_FLIGHT_BYTES_MAX) {
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        g.0 += 1;
        g.1 += bytes;
    }

    fn release(&self, bytes: usize) {
        let mut g = self.lock();
        g.0 -= 1;
        g.1 -= bytes;
        drop(g);
        self.cv.notify_one();
    }
}

/// A reply on its way to the writer thread.
#[derive(Debug)]
struct Out {
    cookie: u64,
    /// Payload bytes counted in flight for this request.
    held: usize,
    body: Body,
}

#[derive(Debug)]
enum Body {
    /// Success (with `data[range]` for a read) or an NBD error value.
    Done {
        error: u32,
        read: bool,
        offset: u64,
        data: Vec<u8>,
        range: std::ops::Range<usize>,
    },
}

fn done(cookie: u64, held: usize, error: u32, read: bool) -> Out {
    Out {
        cookie,
        held,
        body: Body::Done {
            error,
            read,
            offset: 0,
            data: Vec::new(),
            range: 0..0,
        },
    }
}

fn nbd_errno(e: &crate::error::IoError) -> u32 {
    super::errno(e) as u32
}

/// Reads requests until DISC, EOF or a stream error; the writer thread
/// answers them.
fn transmission(
    shared: &Arc<Shared>,
    mut r: BufReader<Sock>,
    w: Sock,
    neg: Negotiated,
) -> io::Result<()> {
    let flight = Arc::new(InFlight::default());
    let (tx, rx) = mpsc::sync_channel::<Out>(NBD_IN_FLIGHT_MAX);
    let writer = {
        let flight = flight.clone();
        let span = shared.span.clone();
        let shut = w.try_clone()?;
        std::thread::Builder::new()
            .name("nvpool-nbd-tx".into())
            .spawn(move || writer_loop(w, shut, rx, &flight, &span, neg.structured))?
    };
    let result = read_requests(shared, &mut r, &tx, &flight, neg);
    drop(tx);
    // The writer ends once every in-flight request has been answered.
    let _ = writer.join();
    r.get_ref().shutdown();
    result
}

fn read_requests(
    shared: &Arc<Shared>,
    r: &mut BufReader<Sock>,
    tx: &SyncSender<Out>,
    flight: &Arc<InFlight>,
    neg: Negotiated,
) -> io::Result<()> {
    let span = &shared.span;
    loop {
        let mut h = [0u8; REQUEST_BYTES];
        match r.read_exact(&mut h) {
            Ok(()) => {}
            // A client that just closes (instead of DISC) ends here.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let magic = u32::from_be_bytes(h[0..4].try_into().expect("4 bytes"));
        let flags = u16::from_be_bytes(h[4..6].try_into().expect("2 bytes"));
        let cmd = u16::from_be_bytes(h[6..8].try_into().expect("2 bytes"));
        let cookie = u64::from_be_bytes(h[8..16].try_into().expect("8 bytes"));
        let offset = u64::from_be_bytes(h[16..24].try_into().expect("8 bytes"));
        let len = u32::from_be_bytes(h[24..28].try_into().expect("4 bytes"));
        if magic != REQUEST_MAGIC {
            peer_warn("bad request magic; closing", &format_args!("{magic:#x}"));
            return Err(protocol("bad request magic"));
        }
        if cmd == CMD_DISC {
            return Ok(());
        }
        let end = offset.checked_add(len as u64);
        let inside = end.is_some_and(|e| e <= span.size());
        let misaligned = neg.strict_blocks && !span.is_aligned(offset, len as u64);
        let fua = flags & CMD_FLAG_FUA != 0;
        match cmd {
            CMD_WRITE => {
                if len > NBD_PAYLOAD_BYTES_MAX {
                    // Its payload cannot be skipped at a reasonable cost.
                    peer_warn("write payload too large; closing", &len);
                    return Err(protocol("write payload too large"));
                }
                let n = len as usize;
                flight.acquire(n);
                let mut buf = span.pool.get(n);
                if let Err(e) = r.read_exact(&mut buf) {
                    flight.release(n);
                    span.pool.put(buf);
                    return Err(e);
                }
                let error = if flags & !CMD_FLAG_FUA != 0 || misaligned {
                    EINVAL
                } else if shared.read_only {
                    EPERM
                } else if !inside {
                    ENOSPC
                } else {
                    0
                };
                if error != 0 || n == 0 {
                    span.pool.put(buf);
                    send(tx, done(cookie, n, error, false));
                    continue;
                }
                let (span, tx) = (span.clone(), tx.clone());
                shared.exec.spawn(async move {
                    let (r, buf) = span.write(offset, buf, fua).await;
                    span.pool.put(buf);
                    let error = r.err().map_or(0, |e| nbd_errno(&e));
                    send(&tx, done(cookie, n, error, false));
                });
            }
            CMD_READ => {
                let bad = flags & !(CMD_FLAG_FUA | CMD_FLAG_DF) != 0
                    || (flags & CMD_FLAG_DF != 0 && !neg.structured)
                    || len > NBD_PAYLOAD_BYTES_MAX
                    || !inside
                    || misaligned;
                let n = if bad { 0 } else { len as usize };
                flight.acquire(n);
                if bad || n == 0 {
                    send(tx, done(cookie, n, if bad { EINVAL } else { 0 }, true));
                    continue;
                }
                let (span, tx) = (span.clone(), tx.clone());
                shared.exec.spawn(async move {
                    let (r, data, range) = span.read(offset, n).await;
                    let error = r.err().map_or(0, |e| nbd_errno(&e));
                    send(
                        &tx,
                        Out {
                            cookie,
                            held: n,
                            body: Body::Done {
                                error,
                                read: true,
                                offset,
                                data,
                                range,
                            },
                        },
                    );
                });
            }
            CMD_FLUSH => {
                flight.acquire(0);
                if flags & !CMD_FLAG_FUA != 0 {
                    send(tx, done(cookie, 0, EINVAL, false));
                    continue;
                }
                let (span, tx) = (span.clone(), tx.clone());
                shared.exec.spawn(async move {
                    let error = span.dev().flush().await.err().map_or(0, |e| nbd_errno(&e));
                    send(&tx, done(cookie, 0, error, false));
                });
            }
            CMD_TRIM | CMD_WRITE_ZEROES => {
                flight.acquire(0);
                let zeroes = cmd == CMD_WRITE_ZEROES;
                let allowed = if zeroes {
                    CMD_FLAG_FUA | CMD_FLAG_NO_HOLE
                } else {
                    CMD_FLAG_FUA
                };
                let error = if flags & !allowed != 0 || misaligned {
                    EINVAL
                } else if shared.read_only {
                    EPERM
                } else if !inside {
                    if zeroes {
                        ENOSPC
                    } else {
                        EINVAL
                    }
                } else {
                    0
                };
                if error != 0 || len == 0 {
                    send(tx, done(cookie, 0, error, false));
                    continue;
                }
                let unmap = flags & CMD_FLAG_NO_HOLE == 0;
                let (span, tx) = (span.clone(), tx.clone());
                shared.exec.spawn(async move {
                    let mut r = if zeroes {
                        span.zero(offset, len as u64, unmap).await
                    } else {
                        span.discard(offset, len as u64).await
                    };
                    if r.is_ok() && fua {
                        r = span.dev().flush().await;
                    }
                    let error = r.err().map_or(0, |e| nbd_errno(&e));
                    send(&tx, done(cookie, 0, error, false));
                });
            }
            _ => {
                // Unknown (or not advertised) command: no payload is
                // assumed, as the protocol says.
                flight.acquire(0);
                send(tx, done(cookie, 0, EINVAL, cmd == CMD_READ));
            }
        }
    }
}

/// Queues a reply. The channel holds a slot for every in-flight request,
/// so this never waits; if the writer is gone the reply is dropped.
fn send(tx: &SyncSender<Out>, out: Out) {
    let _ = tx.send(out);
}

fn writer_loop(
    mut w: Sock,
    shut: Sock,
    rx: Receiver<Out>,
    flight: &InFlight,
    span: &Span,
    structured: bool,
) {
    let mut dead = false;
    for out in rx.iter() {
        let held = out.held;
        let Body::Done {
            error,
            read,
            offset,
            data,
            range,
        } = out.body;
        if !dead {
            let r = write_reply(
                &mut w,
                out.cookie,
                error,
                read,
                offset,
                &data[range],
                structured,
            );
            if let Err(e) = r {
                tracing::debug!(error = %e, "nbd: reply write failed; closing");
                dead = true;
                // Unblocks the reader; later replies are dropped.
                shut.shutdown();
            }
        }
        span.pool.put(data);
        flight.release(held);
    }
}

fn write_reply(
    w: &mut Sock,
    cookie: u64,
    error: u32,
    read: bool,
    offset: u64,
    payload: &[u8],
    structured: bool,
) -> io::Result<()> {
    if !(structured && read) {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        h[4..8].copy_from_slice(&error.to_be_bytes());
        h[8..16].copy_from_slice(&cookie.to_be_bytes());
        let data = if error == 0 && read { payload } else { &[] };
        return write_two(w, &h, data);
    }
    // Structured replies: reads always get a chunk, even for errors.
    let mut h = [0u8; 20 + 8];
    h[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    h[4..6].copy_from_slice(&REPLY_FLAG_DONE.to_be_bytes());
    h[8..16].copy_from_slice(&cookie.to_be_bytes());
    if error != 0 {
        h[6..8].copy_from_slice(&REPLY_TYPE_ERROR.to_be_bytes());
        h[16..20].copy_from_slice(&6u32.to_be_bytes());
        h[20..24].copy_from_slice(&error.to_be_bytes());
        // Message length 0.
        return write_two(w, &h[..26], &[]);
    }
    if payload.is_empty() {
        h[6..8].copy_from_slice(&REPLY_TYPE_NONE.to_be_bytes());
        return write_two(w, &h[..20], &[]);
    }
    h[6..8].copy_from_slice(&REPLY_TYPE_OFFSET_DATA.to_be_bytes());
    h[16..20].copy_from_slice(&(8 + payload.len() as u32).to_be_bytes());
    h[20..28].copy_from_slice(&offset.to_be_bytes());
    write_two(w, &h, payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_and_meta_parsing_rejects_bad_lengths() {
        let mut d = 3u32.to_be_bytes().to_vec();
        d.extend_from_slice(b"abc");
        d.extend_from_slice(&2u16.to_be_bytes());
        d.extend_from_slice(&3u16.to_be_bytes());
        d.extend_from_slice(&1u16.to_be_bytes());
        let (n, r) = parse_info(&d).unwrap();
        assert_eq!(n, b"abc");
        assert_eq!(r, vec![3, 1]);
        assert!(parse_info(&d[..d.len() - 1]).is_none());
        let mut huge = u32::MAX.to_be_bytes().to_vec();
        huge.extend_from_slice(&[0; 6]);
        assert!(parse_info(&huge).is_none());
        assert!(parse_info(&[]).is_none());

        let mut m = 0u32.to_be_bytes().to_vec();
        m.extend_from_slice(&1u32.to_be_bytes());
        m.extend_from_slice(&5u32.to_be_bytes());
        m.extend_from_slice(b"base:");
        assert_eq!(parse_meta(&m), Some(&b""[..]));
        m.push(0);
        assert!(parse_meta(&m).is_none());
        let mut m2 = 0u32.to_be_bytes().to_vec();
        m2.extend_from_slice(&1u32.to_be_bytes());
        m2.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_meta(&m2).is_none());
    }
}
