//! RDMA verbs and connection management for nvpool's NVMe/RDMA transport:
//! a small safe layer over libibverbs and librdmacm, loaded at run time
//! ([`ffi`]). A machine without the libraries (or without RDMA in its
//! kernel) builds and runs nvpool; [`available`] says why RDMA is off.
//!
//! The model is the one NVMe/RDMA needs and nothing more: reliable
//! connected queue pairs set up through RDMA CM, one completion queue per
//! connection whose channel is a file descriptor an event loop can wait on,
//! memory regions registered once and reused, SEND/RECV for capsules and
//! controller-issued RDMA READ/WRITE for data.

pub mod ffi;

use ffi::*;
use std::ffi::{c_int, c_void};
use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::ptr;

/// Loads the RDMA libraries and checks that the kernel offers RDMA CM.
/// Err: why RDMA cannot be used here (for a log line at start).
pub fn available() -> Result<(), String> {
    let lib = lib().map_err(str::to_owned)?;
    // SAFETY: creating and destroying an event channel touches nothing else.
    let ch = unsafe { (lib.rdma_create_event_channel)() };
    if ch.is_null() {
        let e = io::Error::last_os_error();
        return Err(format!("no RDMA connection manager in this kernel ({e})"));
    }
    // SAFETY: ch was just created and is not used afterwards.
    unsafe { (lib.rdma_destroy_event_channel)(ch) };
    Ok(())
}

fn l() -> io::Result<&'static Lib> {
    lib().map_err(|e| io::Error::new(io::ErrorKind::Unsupported, e))
}

fn check(rc: c_int) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else if rc > 0 {
        // Verbs post/notify calls return the error number itself.
        Err(io::Error::from_raw_os_error(rc))
    } else {
        Err(io::Error::last_os_error())
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own, no pointers.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn sockaddr_of(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in sockaddr_storage.
            unsafe { ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            unsafe { ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// Reads a socket address librdmacm returned.
///
/// # Safety
/// `sa` is null or points to a valid sockaddr_in/sockaddr_in6.
unsafe fn socket_addr_from(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: the caller guarantees a valid sockaddr; the family says which.
    unsafe {
        match (*sa).sa_family as c_int {
            libc::AF_INET => {
                let sin = &*(sa as *const libc::sockaddr_in);
                let ip = std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
                Some(SocketAddr::from((ip, u16::from_be(sin.sin_port))))
            }
            libc::AF_INET6 => {
                let sin6 = &*(sa as *const libc::sockaddr_in6);
                let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                Some(SocketAddr::from((ip, u16::from_be(sin6.sin6_port))))
            }
            _ => None,
        }
    }
}

/// An RDMA CM event channel (the file descriptor CM events arrive on).
#[derive(Debug)]
pub struct EventChannel {
    raw: *mut rdma_event_channel,
}

// SAFETY: the channel is a file descriptor wrapper; librdmacm allows using
// it from any thread, and it is owned by one owner at a time.
unsafe impl Send for EventChannel {}

impl EventChannel {
    /// A new, non-blocking channel.
    pub fn new() -> io::Result<EventChannel> {
        let lib = l()?;
        // SAFETY: no arguments; a null return sets errno.
        let raw = unsafe { (lib.rdma_create_event_channel)() };
        if raw.is_null() {
            return Err(io::Error::last_os_error());
        }
        let ch = EventChannel { raw };
        set_nonblocking(ch.fd())?;
        Ok(ch)
    }

    pub fn fd(&self) -> RawFd {
        // SAFETY: raw is a live channel.
        unsafe { (*self.raw).fd }
    }

    /// The next event, copied out and acknowledged; `None` when none waits.
    pub fn next(&self) -> io::Result<Option<CmEvent>> {
        let lib = l()?;
        let mut ev: *mut rdma_cm_event = ptr::null_mut();
        // SAFETY: raw is live; ev receives an event we acknowledge below.
        let rc = unsafe { (lib.rdma_get_cm_event)(self.raw, &mut ev) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock => Ok(None),
                _ => Err(e),
            };
        }
        // SAFETY: ev is a valid event until acknowledged; private data is
        // private_data_len bytes long when not null.
        let out = unsafe {
            let e = &*ev;
            let p = &e.conn;
            let private = if p.private_data.is_null() {
                Vec::new()
            } else {
                std::slice::from_raw_parts(p.private_data as *const u8, p.private_data_len as usize)
                    .to_vec()
            };
            CmEvent {
                kind: e.event,
                id: e.id,
                status: e.status,
                private,
                responder_resources: p.responder_resources,
                initiator_depth: p.initiator_depth,
            }
        };
        // SAFETY: ev came from rdma_get_cm_event and is acknowledged once.
        unsafe { (lib.rdma_ack_cm_event)(ev) };
        Ok(Some(out))
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        if let Ok(lib) = l() {
            // SAFETY: every id on this channel was destroyed or migrated first.
            unsafe { (lib.rdma_destroy_event_channel)(self.raw) };
        }
    }
}

/// The kinds of CM events nvpool acts on.
pub mod event {
    pub use crate::ffi::{
        RDMA_CM_EVENT_ADDR_RESOLVED as ADDR_RESOLVED,
        RDMA_CM_EVENT_CONNECT_REQUEST as CONNECT_REQUEST,
        RDMA_CM_EVENT_DEVICE_REMOVAL as DEVICE_REMOVAL, RDMA_CM_EVENT_DISCONNECTED as DISCONNECTED,
        RDMA_CM_EVENT_ESTABLISHED as ESTABLISHED, RDMA_CM_EVENT_REJECTED as REJECTED,
        RDMA_CM_EVENT_ROUTE_RESOLVED as ROUTE_RESOLVED,
        RDMA_CM_EVENT_TIMEWAIT_EXIT as TIMEWAIT_EXIT,
    };
}

/// One CM event, already acknowledged.
#[derive(Debug)]
pub struct CmEvent {
    pub kind: u32,
    id: *mut rdma_cm_id,
    pub status: i32,
    /// The peer's private data (connect request, accept, reject).
    pub private: Vec<u8>,
    pub responder_resources: u8,
    pub initiator_depth: u8,
}

// SAFETY: the raw id is only adopted by the channel's owner.
unsafe impl Send for CmEvent {}

impl CmEvent {
    /// The event's name as librdmacm spells it.
    pub fn name(&self) -> String {
        match l() {
            // SAFETY: rdma_event_str returns a static string for any value.
            Ok(lib) => unsafe { std::ffi::CStr::from_ptr((lib.rdma_event_str)(self.kind)) }
                .to_string_lossy()
                .into_owned(),
            Err(_) => format!("event {}", self.kind),
        }
    }

    /// Takes ownership of the new id a connect request carries (once).
    pub fn take_request_id(&mut self) -> Option<CmId> {
        if self.kind != event::CONNECT_REQUEST || self.id.is_null() {
            return None;
        }
        let raw = std::mem::replace(&mut self.id, ptr::null_mut());
        Some(CmId { raw })
    }

    /// The status a reject carried in its private data, if it is NVMe's.
    pub fn reject_status(&self) -> Option<u16> {
        nvpool_wire::rdma::decode_reject(&self.private)
    }
}

/// An RDMA CM identifier (the RDMA analogue of a socket).
#[derive(Debug)]
pub struct CmId {
    raw: *mut rdma_cm_id,
}

// SAFETY: an id is used by one owner at a time; librdmacm calls on it are
// thread-safe.
unsafe impl Send for CmId {}

impl CmId {
    /// A new reliable-connected id whose events arrive on `ch`.
    pub fn new(ch: &EventChannel) -> io::Result<CmId> {
        let lib = l()?;
        let mut raw = ptr::null_mut();
        // SAFETY: ch is live; raw receives the new id.
        check(unsafe { (lib.rdma_create_id)(ch.raw, &mut raw, ptr::null_mut(), RDMA_PS_TCP) })?;
        Ok(CmId { raw })
    }

    pub fn bind(&self, addr: SocketAddr) -> io::Result<()> {
        let (ss, _) = sockaddr_of(addr);
        // SAFETY: ss holds a valid sockaddr for the call's duration.
        check(unsafe {
            (l()?.rdma_bind_addr)(self.raw, (&ss as *const libc::sockaddr_storage).cast())
        })
    }

    pub fn listen(&self, backlog: i32) -> io::Result<()> {
        // SAFETY: raw is a bound id.
        check(unsafe { (l()?.rdma_listen)(self.raw, backlog) })
    }

    /// Starts resolving `dst` (from `src` when given); ADDR_RESOLVED follows.
    pub fn resolve_addr(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        ms: i32,
    ) -> io::Result<()> {
        let s = src.map(sockaddr_of);
        let (d, _) = sockaddr_of(dst);
        let sp = s.as_ref().map_or(ptr::null(), |(ss, _)| {
            (ss as *const libc::sockaddr_storage).cast()
        });
        // SAFETY: both addresses live for the call's duration.
        check(unsafe {
            (l()?.rdma_resolve_addr)(
                self.raw,
                sp,
                (&d as *const libc::sockaddr_storage).cast(),
                ms,
            )
        })
    }

    /// Starts resolving the route; ROUTE_RESOLVED follows.
    pub fn resolve_route(&self, ms: i32) -> io::Result<()> {
        // SAFETY: raw is an id with a resolved address.
        check(unsafe { (l()?.rdma_resolve_route)(self.raw, ms) })
    }

    /// Refuses a connect request with `private` data (NVMe's reject record).
    pub fn reject(&self, private: &[u8]) -> io::Result<()> {
        // SAFETY: private lives for the call; its length fits u8.
        check(unsafe {
            (l()?.rdma_reject)(
                self.raw,
                private.as_ptr().cast(),
                private.len().min(255) as u8,
            )
        })
    }

    /// Moves the id's events to `ch`.
    pub fn migrate(&self, ch: &EventChannel) -> io::Result<()> {
        // SAFETY: raw and ch are live; no events of this id are unacknowledged.
        check(unsafe { (l()?.rdma_migrate_id)(self.raw, ch.raw) })
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: raw is live; the route's source address is inside the id.
        unsafe { socket_addr_from(ptr::addr_of!((*self.raw).src_addr).cast()) }
    }

    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as above, the destination address.
        unsafe { socket_addr_from(ptr::addr_of!((*self.raw).dst_addr).cast()) }
    }

    /// Starts an orderly disconnect (the QP goes to error, posted work
    /// requests are flushed, DISCONNECTED follows on both sides).
    pub fn disconnect(&self) {
        if let Ok(lib) = l() {
            // SAFETY: raw is live; disconnecting twice is harmless.
            unsafe { (lib.rdma_disconnect)(self.raw) };
        }
    }

    fn verbs(&self) -> *mut ibv_context {
        // SAFETY: raw is live.
        unsafe { (*self.raw).verbs }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        if let Ok(lib) = l() {
            // SAFETY: the QP was destroyed first (Endpoint's drop order).
            unsafe { (lib.rdma_destroy_id)(self.raw) };
        }
    }
}

/// Sizes of a connection's queue pair.
#[derive(Debug, Clone, Copy)]
pub struct QpSize {
    pub send_wr: u32,
    pub recv_wr: u32,
    /// Bytes a SEND may carry inline (copied at post time, no registration).
    pub inline: u32,
}

/// A registered memory region. Must be dropped before its [`Endpoint`].
#[derive(Debug)]
pub struct Mr {
    raw: *mut ibv_mr,
    pub addr: u64,
    pub len: usize,
    pub lkey: u32,
    pub rkey: u32,
}

// SAFETY: an MR handle may be used and freed from any thread.
unsafe impl Send for Mr {}

impl Drop for Mr {
    fn drop(&mut self) {
        if let Ok(lib) = l() {
            // SAFETY: raw came from ibv_reg_mr and is deregistered once.
            unsafe { (lib.ibv_dereg_mr)(self.raw) };
        }
    }
}

/// What a send-queue work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendKind {
    /// SEND of the local bytes (a capsule or a response).
    Send,
    /// SEND with Invalidate of the peer's key.
    SendInvalidate(u32),
    /// RDMA WRITE of the local bytes to (remote address, key).
    Write,
    /// RDMA READ from (remote address, key) into the local bytes.
    Read,
}

/// One send-queue work request. `addr`/`len`/`lkey` name local memory
/// (registered, or any memory with `inline`).
#[derive(Debug, Clone, Copy)]
pub struct SendWr {
    pub wr_id: u64,
    pub kind: SendKind,
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    pub signaled: bool,
    pub inline: bool,
}

/// A work completion.
#[derive(Debug, Clone, Copy, Default)]
pub struct Wc {
    pub wr_id: u64,
    pub status: u32,
    /// Received bytes (receives).
    pub byte_len: u32,
    pub is_recv: bool,
    /// A receive that invalidated one of our keys (SEND with Invalidate).
    pub invalidated: Option<u32>,
}

impl Wc {
    pub fn ok(&self) -> bool {
        self.status == IBV_WC_SUCCESS
    }
    /// Flushed by a queue pair that went to error (expected at teardown).
    pub fn flushed(&self) -> bool {
        self.status == IBV_WC_WR_FLUSH_ERR
    }
}

/// One connected queue pair with its protection domain, completion queue
/// and completion channel, and the CM id (and, once migrated, the event
/// channel) it belongs to.
#[derive(Debug)]
pub struct Endpoint {
    pd: *mut c_void,
    comp: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    /// Completion events taken and not yet acknowledged.
    unacked: u32,
    /// The provider's data-path calls, resolved once (None until the QP
    /// exists).
    ops: Option<ProviderOps>,
    /// Reused by every `post_send` (no allocation per post).
    sges: Vec<ibv_sge>,
    wrs: Vec<ibv_send_wr>,
    id: CmId,
    channel: Option<EventChannel>,
    pub max_init_rd_atom: u32,
}

/// The inline verbs calls of `verbs.h`: provider function pointers.
#[derive(Debug, Clone, Copy)]
struct ProviderOps {
    post_send: PostSend,
    post_recv: PostRecv,
    poll_cq: PollCq,
    req_notify_cq: ReqNotifyCq,
}

// SAFETY: all handles belong to this endpoint, used by one thread at a time.
unsafe impl Send for Endpoint {}

impl Endpoint {
    /// Creates the resources of a connection on `id` (after ADDR_RESOLVED on
    /// the active side, or on a connect request's id).
    pub fn new(id: CmId, size: QpSize) -> io::Result<Endpoint> {
        let lib = l()?;
        let ctx = id.verbs();
        if ctx.is_null() {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "id has no device yet",
            ));
        }
        let mut ep = Endpoint {
            pd: ptr::null_mut(),
            comp: ptr::null_mut(),
            cq: ptr::null_mut(),
            qp: ptr::null_mut(),
            unacked: 0,
            ops: None,
            sges: Vec::new(),
            wrs: Vec::new(),
            id,
            channel: None,
            max_init_rd_atom: 1,
        };
        // SAFETY: ctx is the id's live device context; every handle made
        // here is owned by `ep` and freed in its Drop, also on early return.
        unsafe {
            let mut attr: ibv_device_attr = std::mem::zeroed();
            if (lib.ibv_query_device)(ctx, &mut attr) == 0 {
                ep.max_init_rd_atom = attr.max_qp_init_rd_atom.max(1) as u32;
            }
            ep.pd = (lib.ibv_alloc_pd)(ctx);
            if ep.pd.is_null() {
                return Err(io::Error::last_os_error());
            }
            ep.comp = (lib.ibv_create_comp_channel)(ctx);
            if ep.comp.is_null() {
                return Err(io::Error::last_os_error());
            }
            set_nonblocking((*ep.comp).fd)?;
            let cqe = (size.send_wr + size.recv_wr) as c_int;
            ep.cq = (lib.ibv_create_cq)(ctx, cqe, ptr::null_mut(), ep.comp, 0);
            if ep.cq.is_null() {
                return Err(io::Error::last_os_error());
            }
            let mut init = ibv_qp_init_attr {
                qp_context: ptr::null_mut(),
                send_cq: ep.cq,
                recv_cq: ep.cq,
                srq: ptr::null_mut(),
                cap: ibv_qp_cap {
                    max_send_wr: size.send_wr,
                    max_recv_wr: size.recv_wr,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: size.inline,
                },
                qp_type: IBV_QPT_RC,
                sq_sig_all: 0,
            };
            check((lib.rdma_create_qp)(ep.id.raw, ep.pd, &mut init))?;
            ep.qp = (*ep.id.raw).qp;
            let ops = &(*ctx).ops;
            ep.ops = match (ops.post_send, ops.post_recv, ops.poll_cq, ops.req_notify_cq) {
                (Some(post_send), Some(post_recv), Some(poll_cq), Some(req_notify_cq)) => {
                    Some(ProviderOps {
                        post_send,
                        post_recv,
                        poll_cq,
                        req_notify_cq,
                    })
                }
                _ => {
                    return Err(io::Error::new(
                        io::ErrorKind::Unsupported,
                        "the RDMA provider lacks a data-path call",
                    ))
                }
            };
        }
        ep.arm()?;
        Ok(ep)
    }

    /// Gives the id its own event channel (so the connection's owner sees
    /// its ESTABLISHED/DISCONNECTED events).
    pub fn own_events(&mut self) -> io::Result<()> {
        let ch = EventChannel::new()?;
        self.id.migrate(&ch)?;
        self.channel = Some(ch);
        Ok(())
    }

    /// The CM event channel this endpoint owns, if any.
    pub fn events(&self) -> Option<&EventChannel> {
        self.channel.as_ref()
    }

    pub fn id(&self) -> &CmId {
        &self.id
    }

    /// The completion channel's descriptor (readable when the armed CQ
    /// has a new completion).
    pub fn comp_fd(&self) -> RawFd {
        // SAFETY: comp is live.
        unsafe { (*self.comp).fd }
    }

    /// Registers `len` bytes at `addr` for local writes and remote reads
    /// and writes.
    ///
    /// # Safety
    /// The memory must stay allocated until the returned [`Mr`] is dropped
    /// and no work request using it is outstanding.
    pub unsafe fn register(&self, addr: *mut u8, len: usize) -> io::Result<Mr> {
        let lib = l()?;
        let access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
        // SAFETY: the caller keeps the memory alive; pd is live.
        let raw = unsafe { (lib.ibv_reg_mr)(self.pd, addr.cast(), len, access) };
        if raw.is_null() {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: raw is a valid MR.
        let (lkey, rkey) = unsafe { ((*raw).lkey, (*raw).rkey) };
        Ok(Mr {
            raw,
            addr: addr as u64,
            len,
            lkey,
            rkey,
        })
    }

    /// Posts one receive of up to `len` bytes into registered memory.
    pub fn post_recv(&self, wr_id: u64, addr: u64, len: u32, lkey: u32) -> io::Result<()> {
        let mut sge = ibv_sge {
            addr,
            length: len,
            lkey,
        };
        let mut wr = ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: qp is live; the provider's post_recv reads wr and sge
        // during the call only.
        check(unsafe { (self.ops()?.post_recv)(self.qp, &mut wr, &mut bad) })
    }

    fn ops(&self) -> io::Result<ProviderOps> {
        self.ops
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotConnected, "no queue pair"))
    }

    /// Posts a chain of send-queue work requests in one call.
    pub fn post_send(&mut self, wrs: &[SendWr]) -> io::Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let ops = self.ops()?;
        let sges = &mut self.sges;
        sges.clear();
        sges.extend(wrs.iter().map(|w| ibv_sge {
            addr: w.addr,
            length: w.len,
            lkey: w.lkey,
        }));
        let raw = &mut self.wrs;
        raw.clear();
        for (w, sge) in wrs.iter().zip(sges.iter_mut()) {
            let mut r = ibv_send_wr {
                wr_id: w.wr_id,
                sg_list: sge,
                num_sge: if w.len == 0 { 0 } else { 1 },
                ..Default::default()
            };
            r.opcode = match w.kind {
                SendKind::Send => IBV_WR_SEND,
                SendKind::SendInvalidate(k) => {
                    r.invalidate_rkey = k;
                    IBV_WR_SEND_WITH_INV
                }
                SendKind::Write => IBV_WR_RDMA_WRITE,
                SendKind::Read => IBV_WR_RDMA_READ,
            };
            r.remote_addr = w.remote_addr;
            r.rkey = w.rkey;
            if w.signaled {
                r.send_flags |= IBV_SEND_SIGNALED;
            }
            if w.inline {
                r.send_flags |= IBV_SEND_INLINE;
            }
            raw.push(r);
        }
        let n = raw.len();
        let base = raw.as_mut_ptr();
        for i in 0..n - 1 {
            // SAFETY: i + 1 < n; the vector is not reallocated any more.
            unsafe { (*base.add(i)).next = base.add(i + 1) };
        }
        let mut bad = ptr::null_mut();
        // SAFETY: qp is live; the chain and its SGEs live for the call.
        check(unsafe { (ops.post_send)(self.qp, base, &mut bad) })
    }

    /// Takes up to `out.len()` completions.
    pub fn poll(&self, out: &mut [Wc]) -> io::Result<usize> {
        let mut raw = [ibv_wc::default(); 32];
        let want = out.len().min(raw.len());
        let ops = self.ops()?;
        // SAFETY: cq is live; raw holds `want` entries.
        let n = unsafe { (ops.poll_cq)(self.cq, want as c_int, raw.as_mut_ptr()) };
        if n < 0 {
            return Err(io::Error::other("ibv_poll_cq failed"));
        }
        for (o, r) in out.iter_mut().zip(&raw[..n as usize]) {
            *o = Wc {
                wr_id: r.wr_id,
                status: r.status,
                byte_len: r.byte_len,
                is_recv: r.opcode & IBV_WC_RECV != 0,
                invalidated: (r.wc_flags & IBV_WC_WITH_INV != 0).then_some(r.invalidated_rkey),
            };
        }
        Ok(n as usize)
    }

    /// Asks for a completion event on the next completion. Poll again after
    /// arming: a completion that came in between raises no event.
    pub fn arm(&self) -> io::Result<()> {
        let ops = self.ops()?;
        // SAFETY: cq is live.
        check(unsafe { (ops.req_notify_cq)(self.cq, 0) })
    }

    /// Consumes the completion channel's pending events (after its fd was
    /// readable) and says how many it took: each one means the CQ fired and
    /// is no longer armed.
    pub fn take_comp_events(&mut self) -> u32 {
        let Ok(lib) = l() else { return 0 };
        let mut n = 0;
        loop {
            let mut cq = ptr::null_mut();
            let mut cx = ptr::null_mut();
            // SAFETY: comp is live and non-blocking.
            if unsafe { (lib.ibv_get_cq_event)(self.comp, &mut cq, &mut cx) } != 0 {
                break;
            }
            self.unacked += 1;
            n += 1;
        }
        if self.unacked >= 64 {
            // SAFETY: cq is live; acknowledging events we took.
            unsafe { (lib.ibv_ack_cq_events)(self.cq, self.unacked) };
            self.unacked = 0;
        }
        n
    }

    /// Accepts a connect request with `private` data.
    pub fn accept(&self, private: &[u8], initiator_depth: u8) -> io::Result<()> {
        let mut p = conn_param(private, 0, initiator_depth);
        // SAFETY: the id is a connect request's; p and private live for the call.
        check(unsafe { (l()?.rdma_accept)(self.id.raw, &mut p) })
    }

    /// Connects (after ROUTE_RESOLVED) with `private` data, accepting up to
    /// `responder_resources` RDMA READs from the peer.
    pub fn connect(&self, private: &[u8], responder_resources: u8) -> io::Result<()> {
        let mut p = conn_param(private, responder_resources, 0);
        // SAFETY: as above.
        check(unsafe { (l()?.rdma_connect)(self.id.raw, &mut p) })
    }
}

fn conn_param(private: &[u8], responder_resources: u8, initiator_depth: u8) -> rdma_conn_param {
    rdma_conn_param {
        private_data: private.as_ptr().cast(),
        private_data_len: private.len().min(255) as u8,
        responder_resources,
        initiator_depth,
        flow_control: 1,
        retry_count: 7,
        // NVMe/RDMA wants infinite RNR retry (the spec's value 7).
        rnr_retry_count: 7,
        srq: 0,
        qp_num: 0,
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        let Ok(lib) = l() else { return };
        // SAFETY: each handle is destroyed once, QP before CQ before
        // channel before PD; the id (a field) is destroyed after this.
        unsafe {
            if !self.qp.is_null() {
                (lib.rdma_destroy_qp)(self.id.raw);
            }
            if !self.cq.is_null() {
                if self.unacked > 0 {
                    (lib.ibv_ack_cq_events)(self.cq, self.unacked);
                }
                (lib.ibv_destroy_cq)(self.cq);
            }
            if !self.comp.is_null() {
                (lib.ibv_destroy_comp_channel)(self.comp);
            }
            if !self.pd.is_null() {
                (lib.ibv_dealloc_pd)(self.pd);
            }
        }
    }
}
