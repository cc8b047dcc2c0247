//! The controller: admin queue, connect and enable sequence, Identify,
//! features, keep-alive, and reconnection shared by its I/O queues.

use crate::conn::Pdu;
use crate::error::Error;
use crate::limits::{
    ADMIN_CHUNK_BYTES, ADMIN_DATA_BYTES_MAX, ADMIN_QUEUE_ENTRIES, ADMIN_TIMEOUT,
    RDMA_QUEUE_BUFFER_BYTES_MAX, RECONNECT_BACKOFF_MAX, TRANSFER_BYTES_MAX,
};
use crate::link::Link;
use crate::rdma::Data;
use nvpool_rt::lock;
use nvpool_wire::auth::{AuthCmd, AUTH_MSG_MAX};
use nvpool_wire::dhchap::{AuthError, HostAuth, HostOffer, HostStep, Keys, RANDOM_BYTES};
use nvpool_wire::fabrics::{cc, csts, fctype, prop, Cap, ConnectCmd, ConnectData, PropertyCmd};
use nvpool_wire::identify::{self, cns, IdentifyController, IdentifyNamespace, NsId};
use nvpool_wire::log::GetLogPage;
use nvpool_wire::sqe::admin as aop;
use nvpool_wire::tcp::Digests;
use nvpool_wire::{Cqe, Sqe, Status};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The fabric a controller is reached over (and, in the target's
/// configuration, the one a listener serves).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// NVMe/TCP.
    #[default]
    Tcp,
    /// NVMe/RDMA (RoCE, iWARP or InfiniBand through RDMA CM).
    Rdma,
}

impl Transport {
    /// The conventional port of a discovery controller on this transport.
    pub fn discovery_port(self) -> u16 {
        match self {
            Transport::Tcp => 8009,
            Transport::Rdma => nvpool_wire::rdma::DEFAULT_PORT,
        }
    }

    pub fn is_tcp(&self) -> bool {
        *self == Transport::Tcp
    }

    /// The discovery log's TRTYPE.
    pub fn trtype(self) -> u8 {
        match self {
            Transport::Tcp => nvpool_wire::log::trtype::TCP,
            Transport::Rdma => nvpool_wire::log::trtype::RDMA,
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Transport::Tcp => "tcp",
            Transport::Rdma => "rdma",
        })
    }
}

/// Connect response DW0 bit 17, ATR: the queue must authenticate.
const AUTHREQ_ATR: u32 = 1 << 17;

/// Transaction ids of this process's authentications (any value is valid;
/// distinct ones make a controller's logs easier to follow).
static NEXT_AUTH_TRANSACTION: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(1);

/// How to reach and use one controller.
#[derive(Debug, Clone)]
pub struct ConnectParams {
    pub addr: SocketAddr,
    /// TCP (default) or RDMA.
    pub transport: Transport,
    pub subnqn: String,
    pub hostnqn: String,
    pub hostid: [u8; 16],
    pub digests: Digests,
    /// Keep-alive timeout; zero disables keep-alive (discovery).
    pub kato: Duration,
    /// I/O queues to ask for (0 for discovery controllers).
    pub io_queues: u16,
    /// Commands outstanding per I/O queue.
    pub queue_depth: u16,
    /// Give up reconnecting after this long.
    pub ctrl_loss_timeout: Duration,
    /// Wait before the second reconnect attempt; it doubles after each
    /// failure, up to `RECONNECT_BACKOFF_MAX` times this value.
    pub reconnect_delay: Duration,
    /// Connection setup timeout (TCP connect and ICResp; RDMA address and
    /// route resolution and CM connect).
    pub connect_timeout: Duration,
    /// DH-HMAC-CHAP keys: used on every queue whose Connect response asks
    /// for authentication (ATR). With a controller key the host also
    /// authenticates the controller and refuses one that answers wrongly.
    /// Without keys a controller that asks for authentication is refused.
    pub dhchap: Option<Arc<Keys>>,
}

impl ConnectParams {
    /// Defaults like the Linux host's: KATO 5 s, 128-deep queues, reconnect
    /// every second for up to 60 s.
    pub fn new(addr: SocketAddr, subnqn: &str) -> ConnectParams {
        let (hostnqn, hostid) = crate::hostnqn::host_identity();
        ConnectParams {
            addr,
            transport: Transport::Tcp,
            subnqn: subnqn.to_owned(),
            hostnqn,
            hostid,
            digests: Digests::default(),
            kato: Duration::from_secs(5),
            io_queues: std::thread::available_parallelism().map_or(1, |n| n.get() as u16),
            queue_depth: 128,
            ctrl_loss_timeout: Duration::from_secs(60),
            reconnect_delay: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(10),
            dhchap: None,
        }
    }
}

/// A namespace as Identify describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamespaceInfo {
    pub nsid: u32,
    pub blocks: u64,
    pub block_size: u32,
    pub uuid: Option<[u8; 16]>,
    pub nguid: [u8; 16],
    /// Write Zeroes may deallocate and deallocated blocks read as zeroes.
    pub zeroes_on_deallocate: bool,
}

impl NamespaceInfo {
    pub fn size_bytes(&self) -> u64 {
        self.blocks * self.block_size as u64
    }
}

/// One admin queue connection.
#[derive(Debug)]
pub(crate) struct AdminQueue {
    conn: Link,
    next_cid: u16,
}

impl AdminQueue {
    fn connect(
        p: &ConnectParams,
        cntlid: u16,
        qid: u16,
        entries: u16,
        slots: usize,
        slot_bytes: usize,
    ) -> Result<(Link, u16), Error> {
        let mut conn = Link::connect(p, qid, entries, cntlid, slots, slot_bytes)?;
        let kato_ms = if qid == 0 {
            p.kato.as_millis().min(u32::MAX as u128) as u32
        } else {
            0
        };
        let cmd = ConnectCmd {
            recfmt: 0,
            qid,
            sqsize: entries - 1,
            cattr: 0,
            kato_ms,
        };
        let data = ConnectData {
            hostid: p.hostid,
            cntlid,
            subnqn: &p.subnqn,
            hostnqn: &p.hostnqn,
        }
        .encode();
        let mut q = AdminQueue { conn, next_cid: 0 };
        let (cqe, _) = q.exec(cmd.to_sqe(0), &data, 0, "connect")?;
        if cqe.dw0 & AUTHREQ_ATR != 0 {
            q.authenticate(p, qid)?;
        }
        conn = q.conn;
        Ok((conn, cqe.dw0 as u16))
    }

    /// DH-HMAC-CHAP on this queue, right after its Connect: Negotiate,
    /// Challenge, Reply, Success1 (and Success2 when the host checks the
    /// controller too), one Authentication Send or Receive each.
    fn authenticate(&mut self, p: &ConnectParams, qid: u16) -> Result<(), Error> {
        let fail = |source| Error::Auth {
            addr: p.addr.to_string(),
            qid,
            source,
        };
        let keys = p.dhchap.as_deref().ok_or(fail(AuthError::NoKey))?;
        let t_id = NEXT_AUTH_TRANSACTION.fetch_add(1, Ordering::Relaxed);
        let mut h = HostAuth::new(keys, HostOffer::default(), &p.hostnqn, &p.subnqn, t_id);
        self.auth_send(&h.negotiate())?;
        loop {
            let (_, msg) = self.exec(
                AuthCmd::new(AUTH_MSG_MAX as u32).to_sqe(0, fctype::AUTH_RECEIVE),
                &[],
                AUTH_MSG_MAX,
                "authentication receive",
            )?;
            let mut random = zeroize::Zeroizing::new([0u8; RANDOM_BYTES]);
            nvpool_rt::random::fill(&mut random[..])
                .map_err(|e| Error::Invalid(format!("no random bytes: {e}")))?;
            match h.on_receive(&msg, &random) {
                HostStep::Send(m) => self.auth_send(&m)?,
                HostStep::SendAndDone(m) => {
                    self.auth_send(&m)?;
                    break;
                }
                HostStep::Done => break,
                HostStep::Fail(m, e) => {
                    if let Some(m) = m {
                        // Tell the controller why; the queue is useless either way.
                        let _ = self.auth_send(&m);
                    }
                    return Err(fail(e));
                }
            }
        }
        if let Some((hash, group)) = h.chosen {
            tracing::debug!(addr = %p.addr, qid, hash = hash.name(), dhgroup = group.name(),
                bidirectional = keys.ctrl.is_some(), "queue authenticated");
        }
        Ok(())
    }

    fn auth_send(&mut self, msg: &[u8]) -> Result<(), Error> {
        let sqe = AuthCmd::new(msg.len() as u32).to_sqe(0, fctype::AUTH_SEND);
        self.exec(sqe, msg, 0, "authentication send").map(|_| ())
    }

    /// Runs one command synchronously; returns its completion and any data.
    fn exec(
        &mut self,
        mut sqe: Sqe,
        out: &[u8],
        in_len: usize,
        what: &'static str,
    ) -> Result<(Cqe, Vec<u8>), Error> {
        let cid = self.next_cid;
        self.next_cid = (self.next_cid + 1) % (ADMIN_QUEUE_ENTRIES - 1);
        sqe.set_cid(cid);
        let addr = self.conn.addr().to_string();
        let len = out.len().max(in_len);
        if len > self.conn.max_data() {
            return Err(Error::Invalid(format!(
                "{what}: {len} bytes of data exceed the queue's limit of {}",
                self.conn.max_data()
            )));
        }
        let data = if !out.is_empty() {
            Data::Out(out)
        } else if in_len > 0 {
            Data::In(in_len)
        } else {
            Data::None
        };
        // Admin data travels in the capsule on TCP, never on RDMA (the
        // controller's admin receive buffers hold a bare SQE).
        self.conn.command(sqe, 0, data, usize::MAX);
        let deadline = Instant::now() + ADMIN_TIMEOUT;
        let mut data = Vec::with_capacity(in_len);
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout { addr, what });
            }
            if !self.conn.pump(deadline - now)? {
                continue;
            }
            while let Some(pdu) = self.conn.next_pdu()? {
                match pdu {
                    Pdu::Resp(cqe) if cqe.cid == cid => {
                        if !cqe.status.is_success() {
                            return Err(Error::Status {
                                addr,
                                what,
                                status: cqe.status,
                            });
                        }
                        if in_len > 0 {
                            let mut placed = vec![0; in_len];
                            if self.conn.placed(0, &mut placed).is_some() {
                                data = placed;
                            }
                        }
                        return Ok((cqe, data));
                    }
                    Pdu::Resp(cqe) => tracing::debug!(
                        cid = cqe.cid,
                        "admin completion for another command ignored"
                    ),
                    Pdu::Data {
                        hdr,
                        flags,
                        range,
                        digest_ok,
                    } if hdr.cccid == cid => {
                        if !digest_ok {
                            return Err(Error::Protocol {
                                addr,
                                what: "data digest mismatch".into(),
                            });
                        }
                        if data.len() + range.len() > in_len {
                            return Err(Error::Protocol {
                                addr,
                                what: format!("{what}: more data than asked for"),
                            });
                        }
                        data.extend_from_slice(self.conn.data(range));
                        if flags & nvpool_wire::tcp::flags::SUCCESS != 0 {
                            return Ok((Cqe::new(cid, Status::SUCCESS), data));
                        }
                    }
                    Pdu::Term(t) => return Err(Error::Terminated { addr, fes: t.fes }),
                    other => {
                        return Err(Error::Protocol {
                            addr,
                            what: format!("{what}: unexpected {other:?}"),
                        })
                    }
                }
            }
        }
    }
}

#[derive(Debug)]
struct State {
    admin: Option<AdminQueue>,
    cntlid: u16,
    /// Bumped at every (re)connect of the admin queue.
    generation: u64,
    io_queues: u16,
    lost: bool,
}

/// A connected controller.
#[derive(Debug)]
pub struct Controller {
    pub params: ConnectParams,
    pub identify: IdentifyController,
    pub cap: Cap,
    state: Mutex<State>,
    stop: Arc<(Mutex<bool>, Condvar)>,
    keep_alive: Mutex<Option<JoinHandle<()>>>,
    reconnecting: Mutex<()>,
    shut: AtomicBool,
}

impl Controller {
    /// Connects the admin queue, enables the controller and reads Identify.
    pub fn connect(params: ConnectParams) -> Result<Arc<Controller>, Error> {
        if params.queue_depth < 2 {
            return Err(Error::Invalid("queue depth must be at least 2".into()));
        }
        let (admin, cntlid, cap, identify, io_queues) = Self::establish(&params)?;
        let c = Arc::new(Controller {
            params,
            identify,
            cap,
            state: Mutex::new(State {
                admin: Some(admin),
                cntlid,
                generation: 1,
                io_queues,
                lost: false,
            }),
            stop: Arc::new((Mutex::new(false), Condvar::new())),
            keep_alive: Mutex::new(None),
            reconnecting: Mutex::new(()),
            shut: AtomicBool::new(false),
        });
        if !c.params.kato.is_zero() {
            let weak = Arc::downgrade(&c);
            let stop = c.stop.clone();
            let every = c.params.kato / 2;
            let h = std::thread::Builder::new()
                .name("nvpool-keepalive".into())
                .spawn(move || keep_alive_loop(weak, stop, every))
                .map_err(|e| Error::Invalid(format!("cannot start keep-alive thread: {e}")))?;
            *lock(&c.keep_alive) = Some(h);
        }
        Ok(c)
    }

    fn establish(
        p: &ConnectParams,
    ) -> Result<(AdminQueue, u16, Cap, IdentifyController, u16), Error> {
        let addr = p.addr.to_string();
        let (conn, cntlid) =
            AdminQueue::connect(p, 0xFFFF, 0, ADMIN_QUEUE_ENTRIES, 1, ADMIN_DATA_BYTES_MAX)?;
        let mut q = AdminQueue { conn, next_cid: 1 };
        let cap = Cap::from_u64(prop_get(&mut q, prop::CAP, true)?);
        prop_set(&mut q, prop::CC, cc::LINUX_ENABLE & !cc::EN)?;
        prop_set(&mut q, prop::CC, cc::LINUX_ENABLE)?;
        let ready_by = Instant::now() + Duration::from_millis(500 * (cap.to as u64 + 1));
        loop {
            let st = prop_get(&mut q, prop::CSTS, false)? as u32;
            if st & csts::CFS != 0 {
                return Err(Error::Protocol {
                    addr,
                    what: "controller fatal status while enabling".into(),
                });
            }
            if st & csts::RDY != 0 {
                break;
            }
            if Instant::now() > ready_by {
                return Err(Error::Timeout {
                    addr,
                    what: "controller ready",
                });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut sqe = Sqe::new(aop::IDENTIFY, 0);
        sqe.set_cdw(10, cns::CONTROLLER as u32);
        let (_, data) = q.exec(sqe, &[], identify::IDENTIFY_LEN, "identify controller")?;
        let id = IdentifyController::decode(&data).map_err(|e| Error::Protocol {
            addr: addr.clone(),
            what: e.to_string(),
        })?;
        if id.cntlid != cntlid {
            return Err(Error::Protocol {
                addr,
                what: format!(
                    "Identify CNTLID {} differs from Connect's {cntlid}",
                    id.cntlid
                ),
            });
        }
        let mut io_queues = 0;
        if p.io_queues > 0 {
            let mut sqe = Sqe::new(aop::SET_FEATURES, 0);
            let n = (p.io_queues - 1) as u32;
            sqe.set_cdw(10, 0x07);
            sqe.set_cdw(11, n | n << 16);
            let (cqe, _) = q.exec(sqe, &[], 0, "set number of queues")?;
            io_queues = ((cqe.dw0 & 0xFFFF).min(cqe.dw0 >> 16) + 1).min(p.io_queues as u32) as u16;
        }
        tracing::debug!(%addr, cntlid, io_queues, "controller connected");
        Ok((q, cntlid, cap, id, io_queues))
    }

    pub fn addr(&self) -> SocketAddr {
        self.params.addr
    }

    /// I/O queues the controller granted.
    pub fn io_queue_count(&self) -> u16 {
        self.lock().io_queues
    }

    /// The entries each I/O queue is created with (depth + 1), clamped to
    /// what the controller supports.
    pub fn io_queue_entries(&self) -> u16 {
        let mut e = self
            .params
            .queue_depth
            .saturating_add(1)
            .min(self.cap.mqes.saturating_add(1));
        if self.identify.maxcmd > 0 {
            e = e.min(self.identify.maxcmd);
        }
        if self.params.transport == Transport::Rdma {
            let slots = RDMA_QUEUE_BUFFER_BYTES_MAX / self.max_transfer().max(ADMIN_DATA_BYTES_MAX);
            e = e.min(slots.min(u16::MAX as usize - 1) as u16 + 1);
        }
        e.max(2)
    }

    /// Largest transfer per command: MDTS, capped by our receive buffer.
    pub fn max_transfer(&self) -> usize {
        let mdts = match self.identify.mdts {
            0 => usize::MAX,
            m => 4096usize.checked_shl(m as u32).unwrap_or(usize::MAX),
        };
        mdts.min(TRANSFER_BYTES_MAX)
    }

    /// Bytes of write data that may travel in-capsule on I/O queues.
    pub fn inline_data_max(&self) -> usize {
        (self.identify.ioccsz as usize * 16).saturating_sub(64)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Current (CNTLID, generation), for I/O queue connects.
    pub(crate) fn current(&self) -> Result<(u16, u64), Error> {
        let s = self.lock();
        if s.lost {
            return Err(self.lost_error());
        }
        Ok((s.cntlid, s.generation))
    }

    fn lost_error(&self) -> Error {
        Error::ControllerLost {
            addr: self.params.addr.to_string(),
            timeout: self.params.ctrl_loss_timeout,
        }
    }

    /// Re-establishes the admin queue if it is still the one of generation
    /// `seen` (another queue may have done it already). Retries every
    /// reconnect delay until the controller-loss timeout.
    pub(crate) fn reconnect(&self, seen: u64) -> Result<(u16, u64), Error> {
        // One reconnect at a time; the state lock is held only briefly so
        // queues and shutdown are never stuck behind a sleeping retry loop.
        let _one = lock(&self.reconnecting);
        {
            let mut s = self.lock();
            if s.lost {
                return Err(self.lost_error());
            }
            if s.generation != seen {
                return Ok((s.cntlid, s.generation));
            }
            if let Some(a) = s.admin.take() {
                a.conn.shutdown();
            }
        }
        let give_up = Instant::now() + self.params.ctrl_loss_timeout;
        let delay = self.params.reconnect_delay;
        let mut backoff = nvpool_rt::Backoff::new(delay, delay * RECONNECT_BACKOFF_MAX);
        let mut attempt = 0u32;
        loop {
            if self.shut.load(Ordering::Acquire) {
                return Err(self.lost_error());
            }
            attempt += 1;
            match Self::establish(&self.params) {
                Ok((q, cntlid, _, _, io_queues)) => {
                    tracing::info!(addr = %self.params.addr, cntlid, attempt, "controller reconnected");
                    let mut s = self.lock();
                    s.admin = Some(q);
                    s.cntlid = cntlid;
                    s.io_queues = io_queues;
                    s.generation += 1;
                    return Ok((cntlid, s.generation));
                }
                Err(e) if !e.is_transport() && !matches!(e, Error::Status { .. }) => return Err(e),
                Err(e) => {
                    let now = Instant::now();
                    if now >= give_up {
                        tracing::error!(addr = %self.params.addr, error = %e, "controller lost");
                        self.lock().lost = true;
                        return Err(self.lost_error());
                    }
                    tracing::warn!(addr = %self.params.addr, attempt, error = %e, "reconnect failed; retrying");
                    // Sleep until the next attempt, waking early on shutdown.
                    let nap = backoff.step().min(give_up - now);
                    let (m, cv) = &*self.stop;
                    let g = lock(m);
                    let _ = cv
                        .wait_timeout_while(g, nap, |stopped| !*stopped)
                        .unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }

    /// Runs an admin command (reconnecting once if the admin queue broke).
    pub fn admin(
        &self,
        sqe: Sqe,
        out: &[u8],
        in_len: usize,
        what: &'static str,
    ) -> Result<(Cqe, Vec<u8>), Error> {
        let gen = {
            let mut s = self.lock();
            if s.lost {
                return Err(self.lost_error());
            }
            let gen = s.generation;
            match s.admin.as_mut() {
                Some(a) => match a.exec(sqe, out, in_len, what) {
                    Err(e) if e.is_transport() => {
                        tracing::warn!(error = %e, "admin queue failed");
                        gen
                    }
                    r => return r,
                },
                None => gen,
            }
        };
        self.reconnect(gen)?;
        let mut s = self.lock();
        match s.admin.as_mut() {
            Some(a) => a.exec(sqe, out, in_len, what),
            None => Err(self.lost_error()),
        }
    }

    /// Identify Namespace plus its descriptor list.
    pub fn namespace(&self, nsid: u32) -> Result<NamespaceInfo, Error> {
        let mut sqe = Sqe::new(aop::IDENTIFY, 0);
        sqe.set_nsid(nsid);
        sqe.set_cdw(10, cns::NAMESPACE as u32);
        let (_, data) = self.admin(sqe, &[], identify::IDENTIFY_LEN, "identify namespace")?;
        let id = IdentifyNamespace::decode(&data).map_err(|e| Error::Invalid(e.to_string()))?;
        if id.ncap == 0 || id.nsze == 0 {
            return Err(Error::Invalid(format!(
                "namespace {nsid} is not active on {}",
                self.params.subnqn
            )));
        }
        let bs = id.block_size();
        if !(512..=65536).contains(&bs) {
            return Err(Error::Invalid(format!(
                "namespace {nsid} has unsupported block size {bs}"
            )));
        }
        let mut sqe = Sqe::new(aop::IDENTIFY, 0);
        sqe.set_nsid(nsid);
        sqe.set_cdw(10, cns::NS_DESCRIPTORS as u32);
        let uuid = self
            .admin(sqe, &[], identify::IDENTIFY_LEN, "namespace descriptors")
            .ok()
            .and_then(|(_, d)| identify::decode_ns_descriptors(&d).ok())
            .and_then(|v| {
                v.into_iter()
                    .find_map(|x| if let NsId::Uuid(u) = x { Some(u) } else { None })
            });
        Ok(NamespaceInfo {
            nsid,
            blocks: id.nsze,
            block_size: bs as u32,
            uuid,
            nguid: id.nguid,
            zeroes_on_deallocate: id.dlfeat & 0x7 == 1,
        })
    }

    /// Active namespace IDs.
    pub fn active_namespaces(&self) -> Result<Vec<u32>, Error> {
        let mut all = Vec::new();
        let mut after = 0;
        loop {
            let mut sqe = Sqe::new(aop::IDENTIFY, 0);
            sqe.set_nsid(after);
            sqe.set_cdw(10, cns::ACTIVE_NS_LIST as u32);
            let (_, data) =
                self.admin(sqe, &[], identify::IDENTIFY_LEN, "active namespace list")?;
            let v = identify::decode_active_ns_list(&data)
                .map_err(|e| Error::Invalid(e.to_string()))?;
            let full = v.len() == identify::IDENTIFY_LEN / 4;
            after = v.last().copied().unwrap_or(0);
            all.extend(v);
            if !full {
                return Ok(all);
            }
        }
    }

    /// Reads a log page in chunks of at most 4 KiB (as nvme-cli does).
    pub fn log_page(&self, lid: u8, nsid: u32, offset: u64, len: usize) -> Result<Vec<u8>, Error> {
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            let n = (len - out.len()).min(ADMIN_CHUNK_BYTES);
            let g = GetLogPage {
                lid,
                rae: false,
                len: n as u64,
                offset: offset + out.len() as u64,
            };
            let (_, d) = self.admin(g.to_sqe(0, nsid), &[], n, "get log page")?;
            out.extend_from_slice(&d);
            if d.len() < n {
                break;
            }
        }
        Ok(out)
    }

    /// Orderly shutdown (CC.SHN, wait for SHST complete), then close.
    pub fn shutdown(&self) {
        if self.shut.swap(true, Ordering::AcqRel) {
            return;
        }
        {
            let (m, cv) = &*self.stop;
            *lock(m) = true;
            cv.notify_all();
        }
        if let Some(h) = lock(&self.keep_alive).take() {
            // The keep-alive thread may hold the last reference itself.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        let mut s = self.lock();
        if let Some(mut a) = s.admin.take() {
            let shn = cc::LINUX_ENABLE | (1 << cc::SHN_SHIFT);
            if prop_set(&mut a, prop::CC, shn).is_ok() {
                let until = Instant::now() + Duration::from_secs(5);
                while Instant::now() < until {
                    match prop_get(&mut a, prop::CSTS, false) {
                        Ok(v) if v as u32 & csts::SHST_MASK == csts::SHST_COMPLETE => break,
                        Ok(_) => std::thread::sleep(Duration::from_millis(2)),
                        Err(_) => break,
                    }
                }
            }
            a.conn.shutdown();
        }
    }

    /// Opens I/O queue `qid` (1-based).
    pub fn io_queue(self: &Arc<Self>, qid: u16) -> Result<crate::IoQueue, Error> {
        crate::queue::IoQueue::connect(self.clone(), qid)
    }

    pub(crate) fn connect_io(&self, qid: u16, cntlid: u16, entries: u16) -> Result<Link, Error> {
        let slot_bytes = self.max_transfer().max(ADMIN_DATA_BYTES_MAX);
        AdminQueue::connect(
            &self.params,
            cntlid,
            qid,
            entries,
            entries as usize - 1,
            slot_bytes,
        )
        .map(|(c, _)| c)
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn prop_get(q: &mut AdminQueue, off: u32, size8: bool) -> Result<u64, Error> {
    let (cqe, _) = q.exec(
        PropertyCmd {
            size8,
            offset: off,
            value: 0,
        }
        .to_sqe(0, fctype::PROPERTY_GET),
        &[],
        0,
        "property get",
    )?;
    Ok(cqe.dw0 as u64 | (cqe.dw1 as u64) << 32)
}

fn prop_set(q: &mut AdminQueue, off: u32, v: u32) -> Result<(), Error> {
    q.exec(
        PropertyCmd {
            size8: false,
            offset: off,
            value: v as u64,
        }
        .to_sqe(0, fctype::PROPERTY_SET),
        &[],
        0,
        "property set",
    )
    .map(|_| ())
}

fn keep_alive_loop(
    ctrl: std::sync::Weak<Controller>,
    stop: Arc<(Mutex<bool>, Condvar)>,
    every: Duration,
) {
    let (m, cv) = &*stop;
    loop {
        {
            let g = lock(m);
            let (g, _) = cv
                .wait_timeout_while(g, every, |stopped| !*stopped)
                .unwrap_or_else(|p| p.into_inner());
            if *g {
                return;
            }
        }
        let Some(c) = ctrl.upgrade() else { return };
        match c.admin(Sqe::new(aop::KEEP_ALIVE, 0), &[], 0, "keep alive") {
            Ok(_) => {}
            Err(Error::ControllerLost { .. }) => return,
            Err(e) => tracing::warn!(error = %e, "keep alive failed"),
        }
    }
}
