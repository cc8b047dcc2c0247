//! Admin commands (and fabrics Property Get/Set) of I/O and discovery
//! controllers. Each handler is synchronous: it reads the SQE and any
//! host-to-controller data, and writes controller-to-host data into the
//! command's buffer.

use crate::config::Transport;
use crate::controller::Controller;
use crate::limits;
use crate::target::{Subsystem, Target};
use nvpool_wire::fabrics::{self, prop, Cap, PropertyCmd, VS_1_3};
use nvpool_wire::identify::{
    self, cns, cntrltype, IdentifyController, IdentifyNamespace, NsId, IDENTIFY_LEN,
};
use nvpool_wire::log::{self, lid, AnaGroup, AnaLog, AnaState, DiscoveryEntry, GetLogPage};
use nvpool_wire::rdma;
use nvpool_wire::sqe::admin as op;
use nvpool_wire::{Sqe, Status};
use std::net::SocketAddr;

/// What a command produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply {
    pub status: Status,
    pub dw0: u32,
    pub dw1: u32,
    /// Bytes of controller-to-host data at the start of the command buffer.
    pub data_len: usize,
}

impl Reply {
    pub fn ok() -> Reply {
        Reply {
            status: Status::SUCCESS,
            dw0: 0,
            dw1: 0,
            data_len: 0,
        }
    }
    pub fn status(s: Status) -> Reply {
        Reply {
            status: s,
            ..Reply::ok()
        }
    }
    pub fn data(n: usize) -> Reply {
        Reply {
            data_len: n,
            ..Reply::ok()
        }
    }
    pub fn dw0(v: u32) -> Reply {
        Reply {
            dw0: v,
            ..Reply::ok()
        }
    }
}

/// Feature identifiers.
mod fid {
    pub const TEMPERATURE_THRESHOLD: u8 = 0x04;
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0B;
    pub const KEEP_ALIVE_TIMER: u8 = 0x0F;
}

/// Context an admin command may need beyond the controller.
#[derive(Debug)]
pub struct AdminCtx<'a> {
    pub target: &'a Target,
    pub ctrl: &'a Controller,
    /// The local address the host reached us on (discovery TRADDR for wildcard listeners).
    pub local: SocketAddr,
    pub now_ms: u64,
}

/// Executes one admin command (not Connect, not AER: the queue owns those).
/// `buf` holds host data on entry and receives controller data.
pub fn execute(cx: &AdminCtx<'_>, sqe: &Sqe, buf: &mut [u8], scratch: &mut Vec<u8>) -> Reply {
    let ctrl = cx.ctrl;
    if sqe.opcode() == op::FABRICS {
        return match sqe.fctype() {
            fabrics::fctype::PROPERTY_GET => property_get(ctrl, &PropertyCmd::from_sqe(sqe)),
            fabrics::fctype::PROPERTY_SET => {
                property_set(ctrl, &PropertyCmd::from_sqe(sqe), cx.now_ms)
            }
            fabrics::fctype::CONNECT => Reply::status(Status::COMMAND_SEQUENCE_ERROR),
            _ => Reply::status(Status::INVALID_OPCODE),
        };
    }
    // Everything but fabrics commands needs an enabled controller.
    if !ctrl.is_ready() {
        return Reply::status(Status::COMMAND_SEQUENCE_ERROR);
    }
    match sqe.opcode() {
        op::IDENTIFY => identify(cx, sqe, buf),
        op::GET_LOG_PAGE => get_log_page(cx, sqe, buf, scratch),
        op::SET_FEATURES => set_features(ctrl, sqe),
        op::GET_FEATURES => get_features(ctrl, sqe),
        op::KEEP_ALIVE => {
            if ctrl.kato_ms() == 0 && !ctrl.discovery {
                Reply::status(Status::KATO_INVALID)
            } else {
                ctrl.touch(cx.now_ms);
                Reply::ok()
            }
        }
        // Abort: we never abort (commands complete quickly); DW0 bit 0 says
        // "not aborted", which is a valid answer.
        op::ABORT if !ctrl.discovery => Reply::dw0(1),
        _ => Reply::status(Status::INVALID_OPCODE),
    }
}

fn property_get(ctrl: &Controller, p: &PropertyCmd) -> Reply {
    let cap = Cap {
        mqes: if ctrl.discovery {
            limits::ADMIN_QUEUE_ENTRIES_MAX - 1
        } else {
            limits::IO_QUEUE_ENTRIES_MAX - 1
        },
        to: 15,
        css_nvm: true,
    }
    .to_u64();
    match (p.offset, p.size8) {
        (prop::CAP, true) => Reply {
            dw0: cap as u32,
            dw1: (cap >> 32) as u32,
            ..Reply::ok()
        },
        (prop::CAP, false) => Reply::dw0(cap as u32),
        (prop::VS, false) => Reply::dw0(VS_1_3),
        (prop::CC, false) => Reply::dw0(ctrl.cc()),
        (prop::CSTS, false) => Reply::dw0(ctrl.csts()),
        _ => Reply::status(Status::INVALID_FIELD),
    }
}

fn property_set(ctrl: &Controller, p: &PropertyCmd, now_ms: u64) -> Reply {
    match (p.offset, p.size8) {
        (prop::CC, false) => {
            ctrl.write_cc(p.value as u32, now_ms);
            Reply::ok()
        }
        _ => Reply::status(Status::INVALID_FIELD),
    }
}

fn identify(cx: &AdminCtx<'_>, sqe: &Sqe, buf: &mut [u8]) -> Reply {
    let Some(out): Option<&mut [u8; IDENTIFY_LEN]> =
        buf.get_mut(..IDENTIFY_LEN).and_then(|b| b.try_into().ok())
    else {
        return Reply::status(Status::INTERNAL_ERROR);
    };
    let cns_v = sqe.cdw(10) as u8;
    let ctrl = cx.ctrl;
    if ctrl.discovery && cns_v != cns::CONTROLLER {
        return Reply::status(Status::INVALID_FIELD);
    }
    let subsys = ctrl.subsystem();
    let nsid = sqe.nsid();
    match cns_v {
        cns::CONTROLLER => {
            identify_controller(ctrl, &subsys).encode(out);
            Reply::data(IDENTIFY_LEN)
        }
        cns::NAMESPACE | cns::NVM_NAMESPACE => {
            if nsid == 0 || nsid == u32::MAX {
                return Reply::status(Status::INVALID_NS);
            }
            out.fill(0);
            if let (cns::NAMESPACE, Some(ns)) = (cns_v, subsys.namespaces.get(&nsid)) {
                let ana = subsys.ana.as_ref();
                // Nothing of a namespace is usable through a path that lost
                // it (nvmet reports NUSE 0 too).
                let lost = ana.is_some_and(|a| {
                    matches!(
                        a.effective(cx.now_ms),
                        AnaState::Inaccessible | AnaState::PersistentLoss
                    )
                });
                IdentifyNamespace {
                    nsze: ns.blocks,
                    ncap: ns.blocks,
                    nuse: if lost { 0 } else { ns.blocks },
                    nsfeat: 0,
                    // Shared: several controllers (and, with ANA, several
                    // targets) reach it.
                    nmic: 1,
                    anagrpid: if ana.is_some() {
                        limits::ANA_GROUP_ID
                    } else {
                        0
                    },
                    // Deallocated blocks read as zeroes; Write Zeroes may deallocate.
                    dlfeat: 0x09,
                    lbads: ns.block_shift,
                    noiob: 0,
                    nguid: ns.nguid,
                    eui64: ns.eui64,
                }
                .encode(out);
                out[99] = ns.read_only as u8; // NSATTR bit 0: write protected
            }
            // An inactive NSID gets an all-zero structure, as the spec says.
            Reply::data(IDENTIFY_LEN)
        }
        cns::ACTIVE_NS_LIST => {
            if nsid >= 0xFFFF_FFFE {
                return Reply::status(Status::INVALID_NS);
            }
            identify::encode_active_ns_list(subsys.namespaces.keys().copied(), nsid, out);
            Reply::data(IDENTIFY_LEN)
        }
        cns::NS_DESCRIPTORS => match subsys.namespaces.get(&nsid) {
            Some(ns) => {
                identify::encode_ns_descriptors(
                    &[
                        NsId::Uuid(ns.uuid),
                        NsId::Nguid(ns.nguid),
                        NsId::Eui64(ns.eui64),
                        NsId::Csi(0),
                    ],
                    out,
                );
                Reply::data(IDENTIFY_LEN)
            }
            None => Reply::status(Status::INVALID_NS),
        },
        cns::NVM_CONTROLLER => {
            out.fill(0);
            Reply::data(IDENTIFY_LEN)
        }
        _ => Reply::status(Status::INVALID_FIELD),
    }
}

/// The Identify Controller structure this target reports.
pub fn identify_controller(ctrl: &Controller, subsys: &Subsystem) -> IdentifyController {
    let common = IdentifyController {
        serial: subsys.serial.clone(),
        model: subsys.model.clone().unwrap_or_else(|| "nvpool".into()),
        firmware: env!("CARGO_PKG_VERSION").chars().take(8).collect(),
        mdts: limits::MDTS_LOG2_PAGES,
        cntlid: ctrl.cntlid,
        ver: VS_1_3,
        acl: 3,
        aerl: (limits::AER_MAX - 1) as u8,
        // Bit 2: Get Log Page honours offsets and long lengths.
        lpa: 0x04,
        elpe: (limits::ERROR_LOG_ENTRIES - 1) as u8,
        sqes: 0x66,
        cqes: 0x44,
        sgls: match ctrl.transport {
            // Bit 20: in-capsule data at offsets; bits 1:0 = 01b: SGLs.
            Transport::Tcp => 0x0010_0001,
            // Bit 2: keyed SGL data blocks (the RDMA host requires it).
            Transport::Rdma => 0x0010_0005,
        },
        subnqn: subsys.nqn.clone(),
        msdbd: 1,
        ..Default::default()
    };
    if ctrl.discovery {
        return IdentifyController {
            cntrltype: cntrltype::DISCOVERY,
            oaes: 1 << 31,
            maxcmd: limits::ADMIN_QUEUE_ENTRIES_MAX,
            ..common
        };
    }
    let io = IdentifyController {
        // Several controllers (hosts, or reconnects) may share a subsystem.
        cmic: identify::cmic::MULTI_CONTROLLER,
        oaes: log::aec::NS_ATTR,
        cntrltype: cntrltype::IO,
        kas: limits::KAS_100MS,
        maxcmd: limits::IO_QUEUE_ENTRIES_MAX,
        nn: limits::NAMESPACES_PER_SUBSYS_MAX,
        oncs: identify::oncs::DSM | identify::oncs::WRITE_ZEROES,
        vwc: 1,
        ioccsz: limits::IOCCSZ_UNITS,
        iorcsz: 1,
        ..common
    };
    if subsys.ana.is_none() {
        return io;
    }
    // One path of a subsystem several targets present: one ANA group.
    IdentifyController {
        cmic: identify::cmic::MULTI_PORT
            | identify::cmic::MULTI_CONTROLLER
            | identify::cmic::ANA_REPORTING,
        oaes: io.oaes | log::aec::ANA_CHANGE,
        anatt: limits::ANA_TRANSITION_TIME_S,
        // Every state may be reported.
        anacap: 0x1F,
        anagrpmax: limits::ANA_GROUP_ID,
        nanagrpid: 1,
        mnan: limits::ANA_MNAN,
        ..io
    }
}

/// The ANA log of an I/O controller of a subsystem with ANA (None
/// otherwise): one group holding every namespace, in its effective state.
fn ana_log(cx: &AdminCtx<'_>, subsys: &Subsystem) -> Option<AnaLog> {
    let (state, chgcnt) = cx.target.check_ana(subsys)?;
    Some(AnaLog {
        chgcnt,
        groups: vec![AnaGroup {
            grpid: limits::ANA_GROUP_ID,
            chgcnt,
            state,
            nsids: subsys.namespaces.keys().copied().collect(),
        }],
    })
}

fn get_log_page(cx: &AdminCtx<'_>, sqe: &Sqe, buf: &mut [u8], scratch: &mut Vec<u8>) -> Reply {
    let g = GetLogPage::from_sqe(sqe);
    let len = g.len as usize;
    if len > buf.len() || !g.offset.is_multiple_of(4) {
        return Reply::status(Status::INVALID_FIELD);
    }
    let ctrl = cx.ctrl;
    scratch.clear();
    let mut rearm_ana = false;
    match (g.lid, ctrl.discovery) {
        (lid::DISCOVERY, true) => discovery_log(cx, scratch),
        (lid::ERROR, false) => {
            for e in ctrl.error_entries() {
                let at = scratch.len();
                scratch.resize(at + log::ERROR_ENTRY_LEN, 0);
                e.encode(&mut scratch[at..]);
            }
        }
        (lid::SMART, false) => {
            scratch.resize(log::SMART_LEN, 0);
            log::SmartLog {
                available_spare: 100,
                spare_threshold: 10,
                ..Default::default()
            }
            .encode(scratch);
        }
        (lid::FW_SLOT, false) => scratch.resize(512, 0),
        (lid::CHANGED_NS, false) => {
            scratch.resize(log::CHANGED_NS_LEN, 0);
            log::encode_changed_ns(&ctrl.changed_namespaces(g.rae), scratch);
        }
        (lid::ANA, false) => {
            let Some(ana) = ana_log(cx, &ctrl.subsystem()) else {
                return Reply::status(Status::INVALID_LOG_PAGE);
            };
            let rgo = GetLogPage::lsp(sqe) & log::ANA_LSP_RGO != 0;
            ana.encode(rgo, scratch);
            rearm_ana = !g.rae;
        }
        _ => return Reply::status(Status::INVALID_LOG_PAGE),
    }
    let off = g.offset as usize;
    if g.offset > scratch.len() as u64 {
        return Reply::status(Status::INVALID_FIELD);
    }
    if rearm_ana {
        ctrl.rearm_ana_event();
    }
    let n = (scratch.len() - off).min(len);
    buf[..n].copy_from_slice(&scratch[off..off + n]);
    buf[n..len].fill(0);
    Reply::data(len)
}

/// Builds the discovery log this host may see: the discovery subsystem on
/// every listener, then each NVM subsystem the host may access on every
/// I/O listener (every TCP listener not on the discovery port 8009, unless
/// that is the only one; every RDMA listener, whose port serves both).
fn discovery_log(cx: &AdminCtx<'_>, out: &mut Vec<u8>) {
    let tcp = cx.target.listeners();
    let tcp_io: Vec<SocketAddr> = {
        let v: Vec<_> = tcp.iter().copied().filter(|a| a.port() != 8009).collect();
        if v.is_empty() {
            tcp.clone()
        } else {
            v
        }
    };
    let listeners: Vec<(Transport, SocketAddr)> = tcp
        .iter()
        .map(|&a| (Transport::Tcp, a))
        .chain(
            cx.target
                .rdma_listeners()
                .into_iter()
                .map(|a| (Transport::Rdma, a)),
        )
        .collect();
    let entry = |(t, addr): &(Transport, SocketAddr), subtype, nqn: &str, portid: usize| {
        let ip = if addr.ip().is_unspecified() {
            cx.local.ip()
        } else {
            addr.ip()
        };
        DiscoveryEntry {
            trtype: t.trtype(),
            adrfam: if ip.is_ipv4() {
                log::adrfam::IPV4
            } else {
                log::adrfam::IPV6
            },
            subtype,
            // Secure channel not required; SQ flow control disable supported.
            treq: 0x02 | 0x04,
            portid: portid as u16 + 1,
            cntlid: 0xFFFF,
            asqsz: limits::ADMIN_QUEUE_ENTRIES_MAX,
            trsvcid: addr.port().to_string(),
            subnqn: nqn.to_owned(),
            traddr: ip.to_string(),
            tsas: match t {
                Transport::Tcp => [0; 3],
                Transport::Rdma => [
                    rdma::tsas::QPTYPE_CONNECTED,
                    rdma::tsas::PRTYPE_NOT_SPECIFIED,
                    rdma::tsas::CMS_RDMA_CM,
                ],
            },
        }
    };
    let mut entries = Vec::new();
    for (i, l) in listeners.iter().enumerate() {
        entries.push(entry(
            l,
            log::subtype::CURRENT_DISCOVERY,
            nvpool_wire::DISCOVERY_NQN,
            i,
        ));
    }
    for s in cx
        .target
        .subsystems()
        .values()
        .filter(|s| s.host_allowed(&cx.ctrl.hostnqn))
    {
        for (i, l) in listeners.iter().enumerate() {
            if l.0 == Transport::Tcp && !tcp_io.contains(&l.1) {
                continue;
            }
            entries.push(entry(l, log::subtype::NVM, &s.nqn, i));
        }
    }
    log::encode_discovery_log(cx.target.discovery_genctr(), &entries, out);
}

fn set_features(ctrl: &Controller, sqe: &Sqe) -> Reply {
    let cdw11 = sqe.cdw(11);
    match (sqe.cdw(10) as u8, ctrl.discovery) {
        (fid::NUMBER_OF_QUEUES, false) => {
            let nsqr = cdw11 as u16;
            let ncqr = (cdw11 >> 16) as u16;
            if nsqr == 0xFFFF || ncqr == 0xFFFF {
                return Reply::status(Status::INVALID_FIELD);
            }
            let n = ctrl.grant_io_queues(nsqr.min(ncqr).saturating_add(1)) as u32 - 1;
            Reply::dw0(n | n << 16)
        }
        (fid::ASYNC_EVENT_CONFIG, _) => {
            let supported = if ctrl.discovery {
                crate::controller::AEC_DISCOVERY
            } else if ctrl.subsystem().ana.is_some() {
                crate::controller::AEC_NS_ATTR | crate::controller::AEC_ANA_CHANGE
            } else {
                crate::controller::AEC_NS_ATTR
            };
            if cdw11 & !supported != 0 {
                return Reply::status(Status::INVALID_FIELD);
            }
            ctrl.set_event_config(cdw11);
            Reply::ok()
        }
        (fid::KEEP_ALIVE_TIMER, _) => {
            if cdw11 > limits::KATO_MAX_MS {
                return Reply::status(Status::INVALID_FIELD);
            }
            ctrl.set_kato_ms(cdw11);
            Reply::ok()
        }
        (fid::VOLATILE_WRITE_CACHE, false) => Reply::ok(),
        _ => Reply::status(Status::INVALID_FIELD),
    }
}

fn get_features(ctrl: &Controller, sqe: &Sqe) -> Reply {
    match (sqe.cdw(10) as u8, ctrl.discovery) {
        (fid::NUMBER_OF_QUEUES, false) => {
            let n = match ctrl.io_queues_granted() {
                0 => limits::IO_QUEUES_PER_CTRL_MAX,
                g => g,
            } as u32
                - 1;
            Reply::dw0(n | n << 16)
        }
        (fid::ASYNC_EVENT_CONFIG, _) => Reply::dw0(ctrl.event_config()),
        (fid::KEEP_ALIVE_TIMER, _) => Reply::dw0(ctrl.kato_ms()),
        (fid::VOLATILE_WRITE_CACHE, false) => Reply::dw0(1),
        (fid::TEMPERATURE_THRESHOLD, false) => Reply::dw0(0),
        _ => Reply::status(Status::INVALID_FIELD),
    }
}
