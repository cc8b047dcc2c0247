//! The libibverbs and librdmacm ABI nvpool uses, loaded with `dlopen` at run
//! time so the binaries need neither library to build or to start.
//!
//! Only the fields nvpool touches are named; the rest is padding of the
//! right size. `tests/layout.rs` compiles a C probe against the system
//! headers (when they are installed) and checks every offset here.
//!
//! `ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq` and `ibv_req_notify_cq`
//! are inline functions in `verbs.h` that call through the context's
//! provider operations; they are reproduced here the same way.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_uint,
    pub send_flags: c_uint,
    /// `imm_data` or `invalidate_rkey`.
    pub invalidate_rkey: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    /// The rest of the `wr` union (atomic is its largest member).
    pub _wr_rest: [u32; 5],
    pub _qp_type: u32,
    pub _pad: u32,
    /// The bind_mw / tso union.
    pub _tail: [u64; 6],
}

impl Default for ibv_send_wr {
    fn default() -> Self {
        ibv_send_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
            opcode: 0,
            send_flags: 0,
            invalidate_rkey: 0,
            remote_addr: 0,
            rkey: 0,
            _wr_rest: [0; 5],
            _qp_type: 0,
            _pad: 0,
            _tail: [0; 6],
        }
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_uint,
    pub opcode: c_uint,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// `imm_data` or `invalidated_rkey`.
    pub invalidated_rkey: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
}

/// `struct ibv_context`: the device pointer, then the provider operations.
#[repr(C)]
#[derive(Debug)]
pub struct ibv_context {
    pub device: *mut c_void,
    pub ops: ibv_context_ops,
}

pub type PollCq = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
pub type ReqNotifyCq = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
pub type PostSend =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
pub type PostRecv =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

/// `struct ibv_context_ops` up to `post_recv`.
#[repr(C)]
#[derive(Debug)]
pub struct ibv_context_ops {
    pub _before_poll_cq: [*mut c_void; 11],
    pub poll_cq: Option<PollCq>,
    pub req_notify_cq: Option<ReqNotifyCq>,
    pub _before_post_send: [*mut c_void; 12],
    pub post_send: Option<PostSend>,
    pub post_recv: Option<PostRecv>,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub _ptrs: [*mut c_void; 5],
    pub handle: u32,
    pub qp_num: u32,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut c_void,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// `struct ibv_device_attr` (232 bytes); the limits nvpool reads.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_device_attr {
    pub _head: [u8; 112],
    pub max_qp_wr: c_int,
    pub _x: c_int,
    pub max_sge: c_int,
    pub _y: [u8; 20],
    pub max_qp_rd_atom: c_int,
    pub _z: [u8; 8],
    pub max_qp_init_rd_atom: c_int,
    pub _tail: [u8; 72],
}

#[repr(C)]
#[derive(Debug)]
pub struct rdma_event_channel {
    pub fd: c_int,
}

/// `struct rdma_cm_id` up to the route's addresses (`rdma_get_local_addr`
/// and `rdma_get_peer_addr` are inline functions reading them).
#[repr(C)]
pub struct rdma_cm_id {
    pub verbs: *mut ibv_context,
    pub channel: *mut rdma_event_channel,
    pub context: *mut c_void,
    pub qp: *mut ibv_qp,
    /// `route.addr.src_addr` (a sockaddr_storage-sized union).
    pub src_addr: libc::sockaddr_storage,
    /// `route.addr.dst_addr`.
    pub dst_addr: libc::sockaddr_storage,
}

impl std::fmt::Debug for rdma_cm_id {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("rdma_cm_id").field("qp", &self.qp).finish()
    }
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct rdma_conn_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: u8,
    pub qp_num: u32,
}

#[repr(C)]
#[derive(Debug)]
pub struct rdma_cm_event {
    pub id: *mut rdma_cm_id,
    pub listen_id: *mut rdma_cm_id,
    pub event: c_uint,
    pub status: c_int,
    pub conn: rdma_conn_param,
    /// The rest of the `param` union (the UD parameters are longer).
    pub _rest: [u8; 32],
}

pub const IBV_QPT_RC: c_uint = 2;
pub const RDMA_PS_TCP: c_int = 0x0106;

pub const IBV_WR_RDMA_WRITE: c_uint = 0;
pub const IBV_WR_SEND: c_uint = 2;
pub const IBV_WR_RDMA_READ: c_uint = 4;
pub const IBV_WR_SEND_WITH_INV: c_uint = 9;

pub const IBV_SEND_SIGNALED: c_uint = 2;
pub const IBV_SEND_INLINE: c_uint = 8;

pub const IBV_WC_SUCCESS: c_uint = 0;
pub const IBV_WC_WR_FLUSH_ERR: c_uint = 5;
pub const IBV_WC_RECV: c_uint = 128;
pub const IBV_WC_WITH_INV: c_uint = 8;

pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 2;
pub const IBV_ACCESS_REMOTE_READ: c_int = 4;

pub const RDMA_CM_EVENT_ADDR_RESOLVED: c_uint = 0;
pub const RDMA_CM_EVENT_ROUTE_RESOLVED: c_uint = 2;
pub const RDMA_CM_EVENT_CONNECT_REQUEST: c_uint = 4;
pub const RDMA_CM_EVENT_REJECTED: c_uint = 8;
pub const RDMA_CM_EVENT_ESTABLISHED: c_uint = 9;
pub const RDMA_CM_EVENT_DISCONNECTED: c_uint = 10;
pub const RDMA_CM_EVENT_DEVICE_REMOVAL: c_uint = 11;
pub const RDMA_CM_EVENT_TIMEWAIT_EXIT: c_uint = 15;

/// The functions nvpool calls, resolved from the two libraries.
#[derive(Debug)]
pub struct Lib {
    pub ibv_alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut c_void,
    pub ibv_dealloc_pd: unsafe extern "C" fn(*mut c_void) -> c_int,
    pub ibv_reg_mr: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> *mut ibv_mr,
    pub ibv_dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    pub ibv_create_comp_channel: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel,
    pub ibv_destroy_comp_channel: unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
    pub ibv_create_cq: unsafe extern "C" fn(
        *mut ibv_context,
        c_int,
        *mut c_void,
        *mut ibv_comp_channel,
        c_int,
    ) -> *mut ibv_cq,
    pub ibv_destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    pub ibv_get_cq_event:
        unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int,
    pub ibv_ack_cq_events: unsafe extern "C" fn(*mut ibv_cq, c_uint),
    pub ibv_query_device: unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int,
    pub rdma_create_event_channel: unsafe extern "C" fn() -> *mut rdma_event_channel,
    pub rdma_destroy_event_channel: unsafe extern "C" fn(*mut rdma_event_channel),
    pub rdma_create_id: unsafe extern "C" fn(
        *mut rdma_event_channel,
        *mut *mut rdma_cm_id,
        *mut c_void,
        c_int,
    ) -> c_int,
    pub rdma_destroy_id: unsafe extern "C" fn(*mut rdma_cm_id) -> c_int,
    pub rdma_bind_addr: unsafe extern "C" fn(*mut rdma_cm_id, *const libc::sockaddr) -> c_int,
    pub rdma_listen: unsafe extern "C" fn(*mut rdma_cm_id, c_int) -> c_int,
    pub rdma_resolve_addr: unsafe extern "C" fn(
        *mut rdma_cm_id,
        *const libc::sockaddr,
        *const libc::sockaddr,
        c_int,
    ) -> c_int,
    pub rdma_resolve_route: unsafe extern "C" fn(*mut rdma_cm_id, c_int) -> c_int,
    pub rdma_connect: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_conn_param) -> c_int,
    pub rdma_accept: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_conn_param) -> c_int,
    pub rdma_reject: unsafe extern "C" fn(*mut rdma_cm_id, *const c_void, u8) -> c_int,
    pub rdma_disconnect: unsafe extern "C" fn(*mut rdma_cm_id) -> c_int,
    pub rdma_get_cm_event:
        unsafe extern "C" fn(*mut rdma_event_channel, *mut *mut rdma_cm_event) -> c_int,
    pub rdma_ack_cm_event: unsafe extern "C" fn(*mut rdma_cm_event) -> c_int,
    pub rdma_create_qp:
        unsafe extern "C" fn(*mut rdma_cm_id, *mut c_void, *mut ibv_qp_init_attr) -> c_int,
    pub rdma_destroy_qp: unsafe extern "C" fn(*mut rdma_cm_id),
    pub rdma_migrate_id: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_event_channel) -> c_int,
    pub rdma_event_str: unsafe extern "C" fn(c_uint) -> *const c_char,
}

// SAFETY: Lib holds only function pointers into libraries that stay loaded
// for the life of the process.
unsafe impl Send for Lib {}
// SAFETY: as above; the functions themselves are thread-safe per libibverbs.
unsafe impl Sync for Lib {}

/// Why RDMA cannot be used on this machine.
pub type Unavailable = String;

static LIB: OnceLock<Result<Lib, Unavailable>> = OnceLock::new();

/// The loaded libraries, loading them on first use.
pub fn lib() -> Result<&'static Lib, &'static str> {
    LIB.get_or_init(load).as_ref().map_err(|s| s.as_str())
}

fn open(name: &CStr) -> Result<*mut c_void, Unavailable> {
    // SAFETY: dlopen with a NUL-terminated name; the handle is never closed.
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        return Err(format!(
            "{} not found (install rdma-core's libibverbs1, librdmacm1 and ibverbs-providers)",
            name.to_string_lossy()
        ));
    }
    Ok(h)
}

fn sym(h: *mut c_void, name: &CStr) -> Result<*mut c_void, Unavailable> {
    // SAFETY: h is a live dlopen handle and name is NUL-terminated.
    let p = unsafe { libc::dlsym(h, name.as_ptr()) };
    if p.is_null() {
        return Err(format!("symbol {} missing", name.to_string_lossy()));
    }
    Ok(p)
}

/// A symbol's address as the function pointer type of its `Lib` field.
fn fn_ptr<F: Copy>(p: *mut c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: F is one of `Lib`'s `unsafe extern "C" fn` types, pointer
    // sized (asserted), and the symbol has that C signature, as in the
    // rdma-core headers.
    unsafe { std::mem::transmute_copy(&p) }
}

fn load() -> Result<Lib, Unavailable> {
    let v = open(c"libibverbs.so.1")?;
    let c = open(c"librdmacm.so.1")?;
    macro_rules! f {
        ($h:expr, $name:ident) => {{
            let p = sym(
                $h,
                &std::ffi::CString::new(stringify!($name)).expect("symbol name"),
            )?;
            fn_ptr(p)
        }};
    }
    Ok(Lib {
        ibv_alloc_pd: f!(v, ibv_alloc_pd),
        ibv_dealloc_pd: f!(v, ibv_dealloc_pd),
        ibv_reg_mr: f!(v, ibv_reg_mr),
        ibv_dereg_mr: f!(v, ibv_dereg_mr),
        ibv_create_comp_channel: f!(v, ibv_create_comp_channel),
        ibv_destroy_comp_channel: f!(v, ibv_destroy_comp_channel),
        ibv_create_cq: f!(v, ibv_create_cq),
        ibv_destroy_cq: f!(v, ibv_destroy_cq),
        ibv_get_cq_event: f!(v, ibv_get_cq_event),
        ibv_ack_cq_events: f!(v, ibv_ack_cq_events),
        ibv_query_device: f!(v, ibv_query_device),
        rdma_create_event_channel: f!(c, rdma_create_event_channel),
        rdma_destroy_event_channel: f!(c, rdma_destroy_event_channel),
        rdma_create_id: f!(c, rdma_create_id),
        rdma_destroy_id: f!(c, rdma_destroy_id),
        rdma_bind_addr: f!(c, rdma_bind_addr),
        rdma_listen: f!(c, rdma_listen),
        rdma_resolve_addr: f!(c, rdma_resolve_addr),
        rdma_resolve_route: f!(c, rdma_resolve_route),
        rdma_connect: f!(c, rdma_connect),
        rdma_accept: f!(c, rdma_accept),
        rdma_reject: f!(c, rdma_reject),
        rdma_disconnect: f!(c, rdma_disconnect),
        rdma_get_cm_event: f!(c, rdma_get_cm_event),
        rdma_ack_cm_event: f!(c, rdma_ack_cm_event),
        rdma_create_qp: f!(c, rdma_create_qp),
        rdma_destroy_qp: f!(c, rdma_destroy_qp),
        rdma_migrate_id: f!(c, rdma_migrate_id),
        rdma_event_str: f!(c, rdma_event_str),
    })
}

const _: () = assert!(std::mem::size_of::<ibv_send_wr>() == 128);
const _: () = assert!(std::mem::size_of::<ibv_recv_wr>() == 32);
const _: () = assert!(std::mem::size_of::<ibv_wc>() == 48);
const _: () = assert!(std::mem::size_of::<ibv_qp_init_attr>() == 64);
const _: () = assert!(std::mem::size_of::<rdma_conn_param>() == 24);
const _: () = assert!(std::mem::size_of::<rdma_cm_event>() == 80);
const _: () = assert!(std::mem::size_of::<ibv_device_attr>() == 232);
