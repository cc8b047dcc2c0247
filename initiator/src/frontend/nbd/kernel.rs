//! Hands a volume to the Linux nbd driver through its generic netlink
//! family: a socket pair, one end served by an [`NbdServer`] in
//! transmission mode, the other given to the kernel with
//! `NBD_CMD_CONNECT`, which answers with the `/dev/nbdN` it set up.
//!
//! ```text
//!  /dev/nbdN ── kernel nbd ── socketpair ── NbdServer (transmission only)
//!                 ▲ NBD_CMD_CONNECT / NBD_CMD_DISCONNECT (genetlink "nbd")
//! ```
//!
//! The kernel skips the handshake: it is told the size, block size and
//! transmission flags here, uses simple replies, and sends requests no
//! larger than its own limit (32 MiB), which the server accepts. When the
//! device grows while served, [`KernelNbd::resize`] tells the kernel the
//! new size with `NBD_CMD_RECONFIGURE`: its `NBD_ATTR_SIZE_BYTES` goes
//! through the same size update as at connect (Linux 6.12's
//! `nbd_genl_reconfigure` calls `nbd_genl_size_set`, which freezes the
//! queue, sets the capacity and tells udev), so `/dev/nbdN` grows online.
//! `DEAD_CONN_TIMEOUT` lets the device survive a short loss of the socket;
//! after it, I/O fails. Without the nbd module (`modprobe nbd`), attaching
//! fails with [`KernelNbdError::ModuleMissing`] before anything is set up.
//!
//! When the serving process dies, requests already sent on its socket wait
//! for replies that cannot come. [`configured_by`] tells which process set a
//! device up and [`disconnect_dead`] frees it at once, as `nbd-client -d`
//! does, so whoever cleans up after the dead server need not wait.

use super::{NbdError, NbdServer};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

const NETLINK_GENERIC: libc::c_int = 16;
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLMSG_ERROR: u16 = 0x2;
const NLA_F_NESTED: u16 = 1 << 15;
const NLA_TYPE_MASK: u16 = !((1 << 15) | (1 << 14));

const NBD_FAMILY: &str = "nbd";
const NBD_GENL_VERSION: u8 = 1;
const NBD_CMD_CONNECT: u8 = 1;
const NBD_CMD_DISCONNECT: u8 = 2;
const NBD_CMD_RECONFIGURE: u8 = 3;
const NBD_ATTR_INDEX: u16 = 1;
const NBD_ATTR_SIZE_BYTES: u16 = 2;
const NBD_ATTR_BLOCK_SIZE_BYTES: u16 = 3;
const NBD_ATTR_TIMEOUT: u16 = 4;
const NBD_ATTR_SERVER_FLAGS: u16 = 5;
const NBD_ATTR_CLIENT_FLAGS: u16 = 6;
const NBD_ATTR_SOCKETS: u16 = 7;
const NBD_ATTR_DEAD_CONN_TIMEOUT: u16 = 8;
const NBD_SOCK_ITEM: u16 = 1;
const NBD_SOCK_FD: u16 = 1;
/// Free the device once disconnected, so indexes do not pile up.
const NBD_CFLAG_DESTROY_ON_DISCONNECT: u64 = 1 << 0;

/// Size of the buffer a netlink answer is read into (an ack or a CONNECT
/// reply is a few dozen bytes; an error echoes our request back).
const NETLINK_REPLY_BYTES: usize = 8192;

/// Why the kernel device could not be set up or torn down.
#[derive(Debug, thiserror::Error)]
pub enum KernelNbdError {
    #[error("the kernel has no nbd driver (generic netlink family \"nbd\" not found); run `modprobe nbd`")]
    ModuleMissing,
    #[error("netlink {op}")]
    Netlink {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("netlink {op}: malformed answer")]
    Malformed { op: &'static str },
    #[error("NBD server")]
    Server(#[from] NbdError),
    /// The kernel took the new size but the device kept another (a driver
    /// that does not resize a live device).
    #[error(
        "{device}: the kernel's nbd driver kept {kept} bytes, not {wanted}; it cannot resize \
         a live device: detach and attach again"
    )]
    NotResized {
        device: PathBuf,
        wanted: u64,
        kept: u64,
    },
    #[error("cannot read the size of {device}")]
    Size {
        device: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the nbd device is detached")]
    Detached,
}

/// How the kernel device is configured.
#[derive(Debug, Clone, Copy)]
pub struct KernelOptions {
    /// `/dev/nbdN` to use; None lets the kernel pick a free one.
    pub index: Option<u32>,
    /// Per-request timeout; None keeps the kernel's default.
    pub io_timeout: Option<Duration>,
    /// How long the device waits for a lost socket to be replaced before
    /// failing I/O.
    pub dead_conn_timeout: Duration,
}

impl Default for KernelOptions {
    fn default() -> KernelOptions {
        KernelOptions {
            index: None,
            io_timeout: None,
            dead_conn_timeout: Duration::from_secs(30),
        }
    }
}

/// A generic netlink socket.
struct Genl {
    fd: OwnedFd,
    seq: u32,
}

fn nla(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf.resize(buf.len().next_multiple_of(4), 0);
}

/// Starts a nested attribute; returns where to patch its length.
fn nest_start(buf: &mut Vec<u8>, kind: u16) -> usize {
    let at = buf.len();
    buf.extend_from_slice(&[0, 0]);
    buf.extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
    at
}

fn nest_end(buf: &mut [u8], at: usize) {
    let len = (buf.len() - at) as u16;
    buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
}

/// Iterates `(type, payload)` over a run of attributes.
fn attrs(mut b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if b.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let kind = u16::from_ne_bytes([b[2], b[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > b.len() {
            return None;
        }
        let payload = &b[4..len];
        b = &b[len.next_multiple_of(4).min(b.len())..];
        Some((kind, payload))
    })
}

impl Genl {
    fn open() -> Result<Genl, KernelNbdError> {
        let err = |source| KernelNbdError::Netlink {
            op: "socket",
            source,
        };
        // SAFETY: plain socket(2) call; the descriptor is owned below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                NETLINK_GENERIC,
            )
        };
        if fd < 0 {
            return Err(err(io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_nl is plain data; all-zero is a valid value.
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: sa is a valid sockaddr_nl of the given size.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sa as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(err(io::Error::last_os_error()));
        }
        Ok(Genl { fd, seq: 1 })
    }

    /// Sends one request and returns the payload (after the genl header)
    /// of the answer, or the kernel's errno.
    fn call(
        &mut self,
        op: &'static str,
        family: u16,
        cmd: u8,
        version: u8,
        attrs: &[u8],
    ) -> Result<Vec<u8>, KernelNbdError> {
        self.seq += 1;
        let seq = self.seq;
        let len = 16 + 4 + attrs.len();
        let mut m = Vec::with_capacity(len);
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&family.to_ne_bytes());
        m.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&[cmd, version, 0, 0]);
        m.extend_from_slice(attrs);
        let io_err = |source| KernelNbdError::Netlink { op, source };
        // SAFETY: m is a valid buffer of m.len() bytes.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), m.as_ptr().cast(), m.len(), 0) };
        if n < 0 {
            return Err(io_err(io::Error::last_os_error()));
        }
        let mut answer = None;
        let mut buf = vec![0u8; NETLINK_REPLY_BYTES];
        // Read until the ack (an NLMSG_ERROR with errno 0, or the error).
        loop {
            // SAFETY: buf is a valid writable buffer of buf.len() bytes.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(io_err(e));
            }
            let mut b = &buf[..n as usize];
            while b.len() >= 16 {
                let mlen = u32::from_ne_bytes(b[0..4].try_into().expect("4 bytes")) as usize;
                let kind = u16::from_ne_bytes([b[4], b[5]]);
                let mseq = u32::from_ne_bytes(b[8..12].try_into().expect("4 bytes"));
                if mlen < 16 || mlen > b.len() {
                    return Err(KernelNbdError::Malformed { op });
                }
                let body = &b[16..mlen];
                b = &b[mlen.next_multiple_of(4).min(b.len())..];
                if mseq != seq {
                    continue;
                }
                if kind == NLMSG_ERROR {
                    let code = i32::from_ne_bytes(
                        body.get(0..4)
                            .ok_or(KernelNbdError::Malformed { op })?
                            .try_into()
                            .expect("4 bytes"),
                    );
                    if code != 0 {
                        return Err(io_err(io::Error::from_raw_os_error(-code)));
                    }
                    // The ack; commands that return data sent it before.
                    return Ok(answer.unwrap_or_default());
                }
                if body.len() >= 4 {
                    answer = Some(body[4..].to_vec());
                }
            }
        }
    }

    /// The id of the "nbd" family, or ModuleMissing.
    fn nbd_family(&mut self) -> Result<u16, KernelNbdError> {
        let mut a = Vec::new();
        let mut name = NBD_FAMILY.as_bytes().to_vec();
        name.push(0);
        nla(&mut a, CTRL_ATTR_FAMILY_NAME, &name);
        let r = self.call(
            "CTRL_CMD_GETFAMILY",
            GENL_ID_CTRL,
            CTRL_CMD_GETFAMILY,
            1,
            &a,
        );
        let body = match r {
            Ok(b) => b,
            Err(KernelNbdError::Netlink { source, .. })
                if source.raw_os_error() == Some(libc::ENOENT) =>
            {
                return Err(KernelNbdError::ModuleMissing)
            }
            Err(e) => return Err(e),
        };
        let id = attrs(&body)
            .find(|(k, p)| *k == CTRL_ATTR_FAMILY_ID && p.len() >= 2)
            .map(|(_, p)| u16::from_ne_bytes([p[0], p[1]]));
        id.ok_or(KernelNbdError::Malformed {
            op: "CTRL_CMD_GETFAMILY",
        })
    }
}

/// True when the running kernel has the nbd driver loaded.
pub fn available() -> bool {
    Genl::open().and_then(|mut g| g.nbd_family()).is_ok()
}

/// The process that connected `/dev/nbdN` (its sysfs `pid`), or None when
/// the device is not connected.
pub fn configured_by(dev: &Path) -> Option<u32> {
    let name = dev.file_name()?.to_str()?;
    let pid = std::fs::read_to_string(format!("/sys/block/{name}/pid")).ok()?;
    pid.trim().parse().ok()
}

/// Disconnects `/dev/nbdN` whose server is gone: `NBD_DISCONNECT` then
/// `NBD_CLEAR_SOCK` (the two ioctls the kernel also takes on a device set up
/// through netlink). Requests waiting on the dead socket fail at once and the
/// device is released, instead of after the dead-connection timeout.
pub fn disconnect_dead(dev: &Path) -> io::Result<()> {
    const NBD_CLEAR_SOCK: libc::c_ulong = 0xab04;
    const NBD_DISCONNECT: libc::c_ulong = 0xab08;
    let f = std::fs::OpenOptions::new().read(true).open(dev)?;
    for (name, req) in [
        ("NBD_DISCONNECT", NBD_DISCONNECT),
        ("NBD_CLEAR_SOCK", NBD_CLEAR_SOCK),
    ] {
        // SAFETY: both requests take no argument; the descriptor is open.
        if unsafe { libc::ioctl(f.as_raw_fd(), req, 0) } < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("{name}: {e}")));
        }
    }
    Ok(())
}

/// A `/dev/nbdN` served by an [`NbdServer`] in this process.
#[derive(Debug)]
pub struct KernelNbd {
    index: u32,
    family: u16,
    server: Option<NbdServer>,
}

impl KernelNbd {
    /// Serves `server`'s device as a kernel block device. The server's own
    /// listeners (if any) keep working; the kernel's socket is one more
    /// connection.
    pub fn attach(server: NbdServer, opts: &KernelOptions) -> Result<KernelNbd, KernelNbdError> {
        let mut nl = Genl::open()?;
        let family = nl.nbd_family()?;
        let (ours, theirs) = UnixStream::pair().map_err(|source| KernelNbdError::Netlink {
            op: "socketpair",
            source,
        })?;
        let ex = server.shared.export;
        server.serve_transmission(ours)?;
        let mut a = Vec::new();
        if let Some(i) = opts.index {
            nla(&mut a, NBD_ATTR_INDEX, &i.to_ne_bytes());
        }
        nla(
            &mut a,
            NBD_ATTR_SIZE_BYTES,
            &server.shared.span.size().to_ne_bytes(),
        );
        nla(
            &mut a,
            NBD_ATTR_BLOCK_SIZE_BYTES,
            &(ex.min_block as u64).to_ne_bytes(),
        );
        nla(
            &mut a,
            NBD_ATTR_SERVER_FLAGS,
            &(ex.flags as u64).to_ne_bytes(),
        );
        nla(
            &mut a,
            NBD_ATTR_CLIENT_FLAGS,
            &NBD_CFLAG_DESTROY_ON_DISCONNECT.to_ne_bytes(),
        );
        if let Some(t) = opts.io_timeout {
            nla(&mut a, NBD_ATTR_TIMEOUT, &t.as_secs().max(1).to_ne_bytes());
        }
        nla(
            &mut a,
            NBD_ATTR_DEAD_CONN_TIMEOUT,
            &opts.dead_conn_timeout.as_secs().to_ne_bytes(),
        );
        let socks = nest_start(&mut a, NBD_ATTR_SOCKETS);
        let item = nest_start(&mut a, NBD_SOCK_ITEM);
        nla(
            &mut a,
            NBD_SOCK_FD,
            &(theirs.as_raw_fd() as u32).to_ne_bytes(),
        );
        nest_end(&mut a, item);
        nest_end(&mut a, socks);
        let body = nl.call(
            "NBD_CMD_CONNECT",
            family,
            NBD_CMD_CONNECT,
            NBD_GENL_VERSION,
            &a,
        )?;
        // The kernel took its own reference to the socket.
        drop(theirs);
        let index = attrs(&body)
            .find(|(k, p)| *k == NBD_ATTR_INDEX && p.len() >= 4)
            .map(|(_, p)| u32::from_ne_bytes([p[0], p[1], p[2], p[3]]))
            .or(opts.index)
            .ok_or(KernelNbdError::Malformed {
                op: "NBD_CMD_CONNECT",
            })?;
        Ok(KernelNbd {
            index,
            family,
            server: Some(server),
        })
    }

    pub fn index(&self) -> u32 {
        self.index
    }

    /// `/dev/nbdN`.
    pub fn device_path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/nbd{}", self.index))
    }

    /// Blocking (netlink); call it from a control thread.
    ///
    /// Shows the device's size now (after it grew: a volume grown online)
    /// on `/dev/nbdN` while it is served and mounted: `NBD_CMD_RECONFIGURE`
    /// with `NBD_ATTR_SIZE_BYTES` (see the module docs). The server serves
    /// the new bytes already. Returns the block device's size read back;
    /// [`KernelNbdError::NotResized`] when the kernel kept another.
    pub fn resize(&self) -> Result<u64, KernelNbdError> {
        let server = self.server.as_ref().ok_or(KernelNbdError::Detached)?;
        let wanted = server.shared.span.size();
        let mut nl = Genl::open()?;
        let mut a = Vec::new();
        nla(&mut a, NBD_ATTR_INDEX, &self.index.to_ne_bytes());
        nla(&mut a, NBD_ATTR_SIZE_BYTES, &wanted.to_ne_bytes());
        nl.call(
            "NBD_CMD_RECONFIGURE",
            self.family,
            NBD_CMD_RECONFIGURE,
            NBD_GENL_VERSION,
            &a,
        )?;
        let device = self.device_path();
        let kept =
            crate::frontend::disk_bytes(&format!("nbd{}", self.index)).map_err(|source| {
                KernelNbdError::Size {
                    device: device.clone(),
                    source,
                }
            })?;
        if kept != wanted {
            return Err(KernelNbdError::NotResized {
                device,
                wanted,
                kept,
            });
        }
        tracing::info!(device = %device.display(), bytes = kept, "nbd device resized");
        Ok(kept)
    }

    /// Asks the kernel to disconnect (it sends NBD_CMD_DISC after its
    /// outstanding requests), then stops the server.
    pub fn detach(mut self) -> Result<(), KernelNbdError> {
        self.disconnect()
    }

    fn disconnect(&mut self) -> Result<(), KernelNbdError> {
        let Some(server) = self.server.take() else {
            return Ok(());
        };
        let mut nl = Genl::open()?;
        let mut a = Vec::new();
        nla(&mut a, NBD_ATTR_INDEX, &self.index.to_ne_bytes());
        let r = nl.call(
            "NBD_CMD_DISCONNECT",
            self.family,
            NBD_CMD_DISCONNECT,
            NBD_GENL_VERSION,
            &a,
        );
        server.shutdown();
        r.map(|_| ())
    }
}

impl Drop for KernelNbd {
    fn drop(&mut self) {
        if let Err(e) = self.disconnect() {
            tracing::warn!(index = self.index, error = %e, "nbd disconnect failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_round_trip_with_padding_and_nesting() {
        let mut a = Vec::new();
        nla(&mut a, 5, b"abc");
        let n = nest_start(&mut a, 7);
        nla(&mut a, 1, &9u32.to_ne_bytes());
        nest_end(&mut a, n);
        let got: Vec<(u16, Vec<u8>)> = attrs(&a).map(|(k, p)| (k, p.to_vec())).collect();
        assert_eq!(got[0], (5, b"abc".to_vec()));
        assert_eq!(got[1].0, 7);
        let inner: Vec<(u16, Vec<u8>)> = attrs(&got[1].1).map(|(k, p)| (k, p.to_vec())).collect();
        assert_eq!(inner, vec![(1, 9u32.to_ne_bytes().to_vec())]);
        // Truncated or lying lengths end the walk instead of panicking.
        assert_eq!(attrs(&a[..6]).count(), 0);
        assert_eq!(attrs(&[255, 255, 0, 0, 1]).count(), 0);
    }
}
