//! The NBD front-end: a raw-protocol client checks the handshake, every
//! command, structured replies, out-of-order completion and malformed
//! input; then real clients (nbdinfo, fio's nbd engine) where installed,
//! and the kernel hand-off's error path on a host without the nbd module.

use nvpool_initiator::frontend::nbd::kernel::{self, KernelNbd, KernelNbdError, KernelOptions};
use nvpool_initiator::frontend::nbd::{NbdOptions, NbdServer};
mod common;

use common::memdev::MemDev;
use common::{open_device, pattern, subsystem, Tgt};
use nvpool_initiator::BlockDev;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Reads at this offset take [`SLOW_MS`] to complete.
const SLOW_OFFSET: u64 = 1 << 20;
const SLOW_MS: u64 = 300;

// Protocol numbers, written out independently of the server's.
const NBDMAGIC: u64 = 0x4e42444d41474943;
const IHAVEOPT: u64 = 0x49484156454F5054;
const REPLY_MAGIC: u64 = 0x3e889045565a9;
const REQ_MAGIC: u32 = 0x25609513;
const SIMPLE_MAGIC: u32 = 0x67446698;
const STRUCT_MAGIC: u32 = 0x668e33ef;
const ACK: u32 = 1;
const ERR_UNSUP: u32 = (1 << 31) + 1;
const ERR_INVALID: u32 = (1 << 31) + 3;
const ERR_UNKNOWN: u32 = (1 << 31) + 6;
const ERR_TOO_BIG: u32 = (1 << 31) + 9;
const READ: u16 = 0;
const WRITE: u16 = 1;
const DISC: u16 = 2;
const FLUSH: u16 = 3;
const TRIM: u16 = 4;
const WRITE_ZEROES: u16 = 6;
const FUA: u16 = 1;
const NO_HOLE: u16 = 2;

fn server(dev: Arc<dyn BlockDev>, dir: &Path) -> NbdServer {
    let opts = NbdOptions {
        export_name: "vol".into(),
        description: "test volume".into(),
        unix_socket: Some(dir.join("nbd.sock")),
        tcp: Some("127.0.0.1:0".parse().unwrap()),
        ..NbdOptions::default()
    };
    NbdServer::start(dev, &opts).unwrap()
}

/// The NBD tests' device: prefers 4 KiB I/O, and reads at `SLOW_OFFSET`
/// take `SLOW_MS` (for out-of-order replies).
fn nbd_dev(size: usize, bs: u32) -> std::sync::Arc<MemDev> {
    MemDev::build(size, bs, 4096, Some((SLOW_OFFSET, SLOW_MS)))
}

struct Client {
    s: UnixStream,
}

impl Client {
    /// Connects and completes the initial exchange with `cflags`.
    fn connect(path: &Path, cflags: u32) -> Client {
        let s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut c = Client { s };
        assert_eq!(c.u64(), NBDMAGIC);
        assert_eq!(c.u64(), IHAVEOPT);
        let hflags = c.u16();
        assert_eq!(hflags & 3, 3, "FIXED_NEWSTYLE and NO_ZEROES");
        c.s.write_all(&cflags.to_be_bytes()).unwrap();
        c
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0; n];
        self.s.read_exact(&mut b).unwrap();
        b
    }
    fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.bytes(2).try_into().unwrap())
    }
    fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.bytes(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.bytes(8).try_into().unwrap())
    }

    /// True once the server closed the connection.
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 64];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }

    fn opt(&mut self, opt: u32, data: &[u8]) {
        let mut m = IHAVEOPT.to_be_bytes().to_vec();
        m.extend_from_slice(&opt.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        self.s.write_all(&m).unwrap();
    }

    fn opt_reply(&mut self, opt: u32) -> (u32, Vec<u8>) {
        assert_eq!(self.u64(), REPLY_MAGIC);
        assert_eq!(self.u32(), opt);
        let kind = self.u32();
        let len = self.u32() as usize;
        (kind, self.bytes(len))
    }

    /// NBD_OPT_INFO/GO; returns the NBD_REP_INFO payloads and the final reply.
    fn info(&mut self, opt: u32, name: &str, reqs: &[u16]) -> (Vec<Vec<u8>>, u32) {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(reqs.len() as u16).to_be_bytes());
        for r in reqs {
            d.extend_from_slice(&r.to_be_bytes());
        }
        self.opt(opt, &d);
        let mut infos = Vec::new();
        loop {
            let (k, data) = self.opt_reply(opt);
            if k == 3 {
                infos.push(data);
            } else {
                return (infos, k);
            }
        }
    }

    fn request(&mut self, flags: u16, cmd: u16, cookie: u64, off: u64, len: u32, payload: &[u8]) {
        let mut m = REQ_MAGIC.to_be_bytes().to_vec();
        m.extend_from_slice(&flags.to_be_bytes());
        m.extend_from_slice(&cmd.to_be_bytes());
        m.extend_from_slice(&cookie.to_be_bytes());
        m.extend_from_slice(&off.to_be_bytes());
        m.extend_from_slice(&len.to_be_bytes());
        m.extend_from_slice(payload);
        self.s.write_all(&m).unwrap();
    }

    /// A simple reply: (error, cookie); read data follows for reads.
    fn simple(&mut self) -> (u32, u64) {
        assert_eq!(self.u32(), SIMPLE_MAGIC);
        let e = self.u32();
        (e, self.u64())
    }

    /// One structured chunk: (flags, type, cookie, payload).
    fn chunk(&mut self) -> (u16, u16, u64, Vec<u8>) {
        assert_eq!(self.u32(), STRUCT_MAGIC);
        let f = self.u16();
        let t = self.u16();
        let c = self.u64();
        let l = self.u32() as usize;
        (f, t, c, self.bytes(l))
    }

    /// Into transmission with NBD_OPT_EXPORT_NAME; returns (size, flags).
    fn export_name(&mut self, name: &str) -> (u64, u16) {
        self.opt(1, name.as_bytes());
        (self.u64(), self.u16())
    }

    fn write_ok(&mut self, off: u64, data: &[u8], flags: u16) {
        self.request(flags, WRITE, 77, off, data.len() as u32, data);
        assert_eq!(self.simple(), (0, 77));
    }

    fn read_simple(&mut self, off: u64, len: u32) -> Vec<u8> {
        self.request(0, READ, 78, off, len, &[]);
        assert_eq!(self.simple(), (0, 78));
        self.bytes(len as usize)
    }
}

#[test]
fn handshake_options_and_info() {
    let dir = tempfile::tempdir().unwrap();
    let dev = nbd_dev(64 << 20, 512);
    let srv = server(dev, dir.path());
    let sock = srv.unix_socket().unwrap().to_path_buf();
    let mut c = Client::connect(&sock, 3);
    // NBD_OPT_LIST
    c.opt(3, &[]);
    let (k, d) = c.opt_reply(3);
    assert_eq!(k, 2);
    assert_eq!(d, [&3u32.to_be_bytes()[..], b"vol"].concat());
    assert_eq!(c.opt_reply(3).0, ACK);
    c.opt(3, b"junk");
    assert_eq!(c.opt_reply(3).0, ERR_INVALID);
    // Unknown options and STARTTLS are unsupported.
    c.opt(99, b"whatever");
    assert_eq!(c.opt_reply(99).0, ERR_UNSUP);
    c.opt(5, &[]);
    assert_eq!(c.opt_reply(5).0, ERR_UNSUP);
    // Structured reply takes no data.
    c.opt(8, b"x");
    assert_eq!(c.opt_reply(8).0, ERR_INVALID);
    // Meta contexts need structured replies first.
    c.opt(10, &[0, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(c.opt_reply(10).0, ERR_INVALID);
    // Unknown export, malformed request.
    assert_eq!(c.info(6, "nope", &[]), (vec![], ERR_UNKNOWN));
    c.opt(6, &[0, 0, 0, 9, b'a']);
    assert_eq!(c.opt_reply(6).0, ERR_INVALID);
    // Oversized option data is skipped and refused.
    c.opt(6, &vec![0u8; 100_000]);
    assert_eq!(c.opt_reply(6).0, ERR_TOO_BIG);
    // INFO on the named and the default export.
    for name in ["vol", ""] {
        let (infos, k) = c.info(6, name, &[3, 1, 2]);
        assert_eq!(k, ACK);
        let export = infos.iter().find(|i| i[0..2] == [0, 0]).unwrap();
        assert_eq!(
            u64::from_be_bytes(export[2..10].try_into().unwrap()),
            64 << 20
        );
        let flags = u16::from_be_bytes(export[10..12].try_into().unwrap());
        // HAS_FLAGS, SEND_FLUSH, SEND_FUA, SEND_TRIM, SEND_WRITE_ZEROES, CAN_MULTI_CONN; not read-only.
        assert_eq!(flags, 1 | 4 | 8 | 32 | 64 | 256);
        let bs = infos.iter().find(|i| i[0..2] == [0, 3]).unwrap();
        let v: Vec<u32> = bs[2..]
            .chunks(4)
            .map(|c| u32::from_be_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(v, vec![512, 4096, 1 << 20]);
        let n = infos.iter().find(|i| i[0..2] == [0, 1]).unwrap();
        assert_eq!(&n[2..], b"vol");
        let d = infos.iter().find(|i| i[0..2] == [0, 2]).unwrap();
        assert_eq!(&d[2..], b"test volume");
    }
    // Structured replies, then meta contexts: none offered.
    c.opt(8, &[]);
    assert_eq!(c.opt_reply(8).0, ACK);
    let mut q = 0u32.to_be_bytes().to_vec();
    q.extend_from_slice(&1u32.to_be_bytes());
    q.extend_from_slice(&15u32.to_be_bytes());
    q.extend_from_slice(b"base:allocation");
    c.opt(9, &q);
    assert_eq!(c.opt_reply(9), (ACK, vec![]));
    // Abort: acknowledged, then closed.
    c.opt(2, &[]);
    assert_eq!(c.opt_reply(2).0, ACK);
    assert!(c.closed());

    // Over TCP too, into transmission with GO.
    let mut t = std::net::TcpStream::connect(srv.tcp_addr().unwrap()).unwrap();
    let mut hello = [0u8; 18];
    t.read_exact(&mut hello).unwrap();
    assert_eq!(&hello[0..8], b"NBDMAGIC");
    drop(t);
    srv.shutdown();
    assert!(!sock.exists(), "socket file left behind");
}

#[test]
fn every_command_with_simple_replies() {
    let dir = tempfile::tempdir().unwrap();
    let dev = nbd_dev(64 << 20, 512);
    let srv = server(dev.clone(), dir.path());
    let mut c = Client::connect(srv.unix_socket().unwrap(), 3);
    let (size, flags) = c.export_name("vol");
    assert_eq!(size, 64 << 20);
    assert_eq!(flags & 1, 1);

    let data = pattern(1, 65536);
    c.write_ok(4096, &data, FUA);
    assert!(dev.fua_writes.load(Ordering::Relaxed) >= 1);
    assert_eq!(c.read_simple(4096, 65536), data);
    assert_eq!(dev.bytes(4096, 65536), data);
    // Unaligned (no block sizes were negotiated): read-modify-write.
    let odd = pattern(2, 1001);
    c.write_ok(4096 + 7, &odd, 0);
    let mut want = data.clone();
    want[7..1008].copy_from_slice(&odd);
    assert_eq!(c.read_simple(4096, 65536), want);
    assert_eq!(c.read_simple(4096 + 3, 10), want[3..13].to_vec());

    c.request(0, FLUSH, 5, 0, 0, &[]);
    assert_eq!(c.simple(), (0, 5));
    assert!(dev.flushes.load(Ordering::Relaxed) >= 1);
    c.request(0, TRIM, 6, 1 << 20, 1 << 20, &[]);
    assert_eq!(c.simple(), (0, 6));
    assert_eq!(dev.discards.load(Ordering::Relaxed), 1);
    c.request(0, WRITE_ZEROES, 7, 4096, 8192, &[]);
    assert_eq!(c.simple(), (0, 7));
    assert_eq!(dev.zeroes_unmap.load(Ordering::Relaxed), 1);
    c.request(NO_HOLE | FUA, WRITE_ZEROES, 8, 12288, 4096, &[]);
    assert_eq!(c.simple(), (0, 8));
    assert_eq!(dev.zeroes_keep.load(Ordering::Relaxed), 1);
    assert!(dev.bytes(4096, 12288).iter().all(|&b| b == 0));
    assert_eq!(dev.bytes(16384, 4096), want[12288..16384].to_vec());

    // Errors keep the connection.
    c.request(0, READ, 9, (64 << 20) - 512, 1024, &[]);
    assert_eq!(c.simple(), (22, 9), "read past the end: EINVAL");
    c.request(0, WRITE, 10, (64 << 20) - 512, 1024, &[0; 1024]);
    assert_eq!(c.simple(), (28, 10), "write past the end: ENOSPC");
    c.request(0, WRITE_ZEROES, 11, 64 << 20, 512, &[]);
    assert_eq!(c.simple(), (28, 11), "zeroes past the end: ENOSPC");
    c.request(0, TRIM, 12, u64::MAX - 10, 512, &[]);
    assert_eq!(c.simple(), (22, 12), "trim overflowing: EINVAL");
    c.request(0, 77, 13, 0, 0, &[]);
    assert_eq!(c.simple(), (22, 13), "unknown command: EINVAL");
    c.request(1 << 9, WRITE, 14, 0, 512, &[0; 512]);
    assert_eq!(c.simple(), (22, 14), "unknown flag: EINVAL");
    c.request(4, READ, 15, 0, 512, &[]);
    assert_eq!(
        c.simple(),
        (22, 15),
        "DF without structured replies: EINVAL"
    );
    c.request(0, READ, 16, 0, (32 << 20) + 1, &[]);
    assert_eq!(c.simple(), (22, 16), "read over the payload limit: EINVAL");
    assert_eq!(c.read_simple(4096, 512), vec![0; 512]);

    c.request(0, DISC, 17, 0, 0, &[]);
    assert!(c.closed());
    drop(srv);
}

#[test]
fn a_grown_device_is_served_to_its_new_end_and_announced_to_new_clients() {
    let dir = tempfile::tempdir().unwrap();
    let dev = nbd_dev(16 << 20, 512);
    let srv = server(dev.clone(), dir.path());
    let mut c = Client::connect(srv.unix_socket().unwrap(), 3);
    assert_eq!(c.export_name("vol").0, 16 << 20);
    c.request(0, READ, 1, 16 << 20, 4096, &[]);
    assert_eq!(c.simple(), (22, 1), "past the end: EINVAL");

    dev.grow(24 << 20);
    // The same connection: served from now on (the kernel driver learns
    // the size out of band and keeps its socket).
    let data = pattern(3, 8192);
    c.write_ok((16 << 20) - 4096, &data, 0);
    assert_eq!(c.read_simple((16 << 20) - 4096, 8192), data);
    assert_eq!(dev.bytes((16 << 20) - 4096, 8192), data);
    c.request(0, WRITE, 2, 24 << 20, 512, &[0; 512]);
    assert_eq!(c.simple(), (28, 2), "past the new end: ENOSPC");
    // A new client is told the new size.
    let mut d = Client::connect(srv.unix_socket().unwrap(), 3);
    assert_eq!(d.export_name("vol").0, 24 << 20);
    for cl in [&mut c, &mut d] {
        cl.request(0, DISC, 3, 0, 0, &[]);
        assert!(cl.closed());
    }
    drop(srv);
}

#[test]
fn structured_replies_and_out_of_order_completion() {
    let dir = tempfile::tempdir().unwrap();
    let dev = nbd_dev(64 << 20, 4096);
    let srv = server(dev.clone(), dir.path());
    let mut c = Client::connect(srv.unix_socket().unwrap(), 3);
    c.opt(8, &[]);
    assert_eq!(c.opt_reply(8).0, ACK);
    let (_, k) = c.info(7, "vol", &[3]);
    assert_eq!(k, ACK);
    let slow = pattern(3, 4096);
    let fast = pattern(4, 8192);
    c.write_ok(SLOW_OFFSET, &slow, 0);
    c.write_ok(0, &fast, 0);
    // The slow read is sent first but completes last.
    c.request(0, READ, 1, SLOW_OFFSET, 4096, &[]);
    c.request(0, READ, 2, 0, 8192, &[]);
    let t = Instant::now();
    let (f, ty, cookie, p) = c.chunk();
    assert_eq!((f, ty, cookie), (1, 1, 2), "fast read answered first");
    assert_eq!(u64::from_be_bytes(p[0..8].try_into().unwrap()), 0);
    assert_eq!(&p[8..], &fast[..]);
    let (f, ty, cookie, p) = c.chunk();
    assert_eq!((f, ty, cookie), (1, 1, 1));
    assert_eq!(u64::from_be_bytes(p[0..8].try_into().unwrap()), SLOW_OFFSET);
    assert_eq!(&p[8..], &slow[..]);
    assert!(t.elapsed() >= Duration::from_millis(SLOW_MS / 2));

    // Many pipelined requests, answered by cookie.
    for i in 0..200u64 {
        c.request(0, READ, 1000 + i, (i % 16) * 4096, 4096, &[]);
    }
    let mut seen = std::collections::HashSet::new();
    for _ in 0..200 {
        let (_, ty, cookie, p) = c.chunk();
        assert_eq!(ty, 1);
        assert_eq!(p.len(), 8 + 4096);
        assert!(seen.insert(cookie));
    }
    // Errors on reads are structured error chunks; block sizes were
    // negotiated, so unaligned requests are refused.
    c.request(0, READ, 3, 100, 4096, &[]);
    let (f, ty, cookie, p) = c.chunk();
    assert_eq!((f, ty, cookie), (1, (1 << 15) + 1, 3));
    assert_eq!(u32::from_be_bytes(p[0..4].try_into().unwrap()), 22);
    assert_eq!(p.len(), 6);
    c.request(0, WRITE, 4, 100, 512, &[0; 512]);
    assert_eq!(c.simple(), (22, 4));
    // A zero-length read is an empty final chunk.
    c.request(0, READ, 5, 0, 0, &[]);
    assert_eq!(c.chunk(), (1, 0, 5, vec![]));
    // Writes answer with simple replies.
    c.write_ok(8192, &pattern(9, 4096), FUA);
    c.request(0, DISC, 6, 0, 0, &[]);
    assert!(c.closed());
}

#[test]
fn malformed_input_closes_only_that_connection() {
    let dir = tempfile::tempdir().unwrap();
    let dev = nbd_dev(16 << 20, 512);
    let srv = server(dev, dir.path());
    let sock = srv.unix_socket().unwrap().to_path_buf();
    let mut good = Client::connect(&sock, 3);
    good.export_name("");
    good.write_ok(0, &pattern(5, 4096), 0);

    // Unknown client flags.
    let mut c = Client::connect(&sock, 1 << 7);
    assert!(c.closed());
    // Bad option magic.
    let mut c = Client::connect(&sock, 3);
    c.s.write_all(&[0xAB; 16]).unwrap();
    assert!(c.closed());
    // Unknown export with EXPORT_NAME: nothing to answer but closing.
    let mut c = Client::connect(&sock, 3);
    c.opt(1, b"nope");
    assert!(c.closed());
    // Bad request magic.
    let mut c = Client::connect(&sock, 3);
    c.export_name("vol");
    c.s.write_all(&[0x55; 28]).unwrap();
    assert!(c.closed());
    // A write payload over the limit.
    let mut c = Client::connect(&sock, 3);
    c.export_name("vol");
    c.request(0, WRITE, 1, 0, u32::MAX, &[]);
    assert!(c.closed());
    // Truncated request, then the client goes away.
    let mut c = Client::connect(&sock, 3);
    c.export_name("vol");
    c.s.write_all(&REQ_MAGIC.to_be_bytes()).unwrap();
    drop(c);

    // The first connection never noticed.
    assert_eq!(good.read_simple(0, 4096), pattern(5, 4096));
    let deadline = Instant::now() + Duration::from_secs(5);
    while srv.connections() != 1 {
        assert!(
            Instant::now() < deadline,
            "{} connections",
            srv.connections()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    good.request(0, DISC, 1, 0, 0, &[]);
    assert!(good.closed());
    // Shutting down with nothing connected is quick.
    srv.shutdown();
}

#[test]
fn kernel_handoff_reports_a_missing_nbd_module() {
    let dev = nbd_dev(16 << 20, 4096);
    let srv = NbdServer::without_listeners(dev.clone(), &NbdOptions::default()).unwrap();
    if kernel::available() {
        // A kernel with nbd (the VM tests): attach, write, read, detach.
        let k = KernelNbd::attach(srv, &KernelOptions::default()).unwrap();
        let path = k.device_path();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        use std::os::unix::fs::FileExt;
        f.write_all_at(&pattern(6, 4096), 8192).unwrap();
        f.sync_all().unwrap();
        assert_eq!(dev.bytes(8192, 4096), pattern(6, 4096));
        // Grown while attached and open: the kernel is told, and the new
        // bytes are served.
        dev.grow(24 << 20);
        assert_eq!(k.resize().unwrap(), 24 << 20);
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        let sectors = std::fs::read_to_string(format!("/sys/block/{name}/size")).unwrap();
        assert_eq!(sectors.trim().parse::<u64>().unwrap() * 512, 24 << 20);
        drop(f);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        f.write_all_at(&pattern(7, 8192), (16 << 20) - 4096)
            .unwrap();
        f.sync_all().unwrap();
        assert_eq!(dev.bytes((16 << 20) - 4096, 8192), pattern(7, 8192));
        drop(f);
        k.detach().unwrap();
        return;
    }
    let e = KernelNbd::attach(srv, &KernelOptions::default()).unwrap_err();
    assert!(matches!(e, KernelNbdError::ModuleMissing), "{e:?}");
    assert!(e.to_string().contains("modprobe nbd"), "{e}");
}

fn tool(name: &str, package: &str) -> Option<PathBuf> {
    let out = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .ok()?;
    if out.status.success() {
        return Some(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    }
    println!("skipped: {name} not installed (apt-get install {package})");
    None
}

#[test]
fn nbdinfo_sees_size_block_sizes_and_flags() {
    let Some(nbdinfo) = tool("nbdinfo", "libnbd-bin") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let dev = nbd_dev(64 << 20, 512);
    let srv = server(dev, dir.path());
    let uri = format!(
        "nbd+unix:///vol?socket={}",
        srv.unix_socket().unwrap().display()
    );
    let out = Command::new(nbdinfo)
        .arg("--json")
        .arg(&uri)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let compact: String = text.split_whitespace().collect();
    for want in [
        "\"export-size\":67108864",
        "\"block_size_minimum\":512",
        "\"block_size_preferred\":4096",
        "\"block_size_maximum\":1048576",
        "\"is_read_only\":false",
        "\"can_flush\":true",
        "\"can_fua\":true",
        "\"can_trim\":true",
        "\"can_zero\":true",
        "\"can_multi_conn\":true",
        "\"protocol\":\"newstyle-fixed\"",
        "\"description\":\"testvolume\"",
    ] {
        assert!(compact.contains(want), "{want} missing from:\n{text}");
    }
}

/// fio writes with its nbd engine, reads back and checks crc32c.
fn fio_verify(uri: &str, size: &str) {
    let Some(fio) = tool("fio", "fio") else {
        return;
    };
    let engines = Command::new(&fio).arg("--enghelp").output().unwrap();
    if !String::from_utf8_lossy(&engines.stdout).contains("nbd") {
        println!("skipped: this fio is built without the nbd engine");
        return;
    }
    // `timeout` bounds a hung run (fio has no I/O timeout of its own).
    let out = Command::new("timeout")
        .arg("300")
        .arg(&fio)
        .args([
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bsrange=4k-256k",
            &format!("--size={size}"),
            "--iodepth=16",
            "--numjobs=1",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            // No verify state file in the working directory.
            "--verify_state_save=0",
            "--output-format=terse",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "fio failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Terse v3: field 5 is KiB read, which here is the verify pass over
    // everything written.
    let fields: Vec<&str> = text.trim().split(';').collect();
    let read_kib: u64 = fields.get(5).and_then(|f| f.parse().ok()).unwrap_or(0);
    println!("fio verified {read_kib} KiB");
    assert!(
        read_kib >= 16 << 10,
        "fio verified only {read_kib} KiB: {text}"
    );
}

#[test]
fn fio_nbd_engine_verifies_crc32c_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let dev = nbd_dev(64 << 20, 512);
    let srv = server(dev, dir.path());
    let uri = format!(
        "nbd+unix:///vol?socket={}",
        srv.unix_socket().unwrap().display()
    );
    fio_verify(&uri, "48M");
}

const NQN: &str = "nqn.2026-11.io.nvpool:frontend-nbd";

fn start_target(backend: &str) -> Tgt {
    Tgt::start(&[subsystem(NQN, &[], &[(1, backend)])])
}

#[test]
fn fio_nbd_engine_verifies_crc32c_over_nvme_tcp() {
    let r = start_target("ram:64M");
    let dev: Arc<dyn BlockDev> = Arc::new(open_device(&r, NQN, 2, 32));
    let dir = tempfile::tempdir().unwrap();
    let srv = server(dev, dir.path());
    let uri = format!(
        "nbd+unix:///vol?socket={}",
        srv.unix_socket().unwrap().display()
    );
    fio_verify(&uri, "48M");
    drop(srv);
    r.stop();
}
