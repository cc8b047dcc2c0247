//! Volumes over in-process targets: every extent of a volume exported as a
//! namespace of one per-host subsystem on each target, the connection plan
//! built by hand, and access to each extent copy beside the volume (to
//! check where bytes landed, or to change a copy behind its back).

use super::{assert_same, params, pattern, subsystem, Tgt, HOST_A};
use nvpool_initiator::device::block_on;
use nvpool_initiator::{Controller, ControllerIo, Device, Volume, VolumeOptions};
use nvpool_layout::model::Uuid;
use nvpool_layout::plan::{ConnectionPlan, LayoutBody, PlanExtent, HOST_SUBSYSTEM_PREFIX};
use nvpool_target::backend::{Backend, FaultBackend, RamBackend};
use nvpool_target::config::{NamespaceConfig, SubsystemConfig};
use nvpool_target::Target;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub const MIB: u64 = 1 << 20;
/// The volumes' logical block.
pub const VOLUME_BLOCK: u64 = 4096;

pub fn host_subsystem() -> String {
    format!("{HOST_SUBSYSTEM_PREFIX}volume-test")
}

/// Targets exporting a volume's extents, and the plan to reach them.
#[derive(Debug)]
pub struct Setup {
    /// `None` while stopped ([`Setup::stop`]).
    targets: Vec<Option<Tgt>>,
    /// Each target's address and subsystem, to restart it as it was.
    addrs: Vec<SocketAddr>,
    configs: Vec<SubsystemConfig>,
    pub plan: ConnectionPlan,
    /// With [`setup_faulty`]: each extent's backend, in plan order.
    pub faults: Vec<Arc<FaultBackend>>,
}

/// Starts `n` targets and exports every extent (`extent_bytes`) of a volume
/// of `layout` and `size` as a namespace (`ns_spec`, e.g. `ram:1M`) of the
/// host subsystem: extent (row, member, copy) lives on target (row +
/// member × copies + copy) mod n, so the extents of a row sit on distinct
/// targets.
pub fn setup(n: usize, layout: LayoutBody, size: u64, extent_bytes: u64, ns_spec: &str) -> Setup {
    let mut plan = ConnectionPlan {
        volume: Uuid([7; 16]),
        name: "vol".into(),
        host_nqn: HOST_A.into(),
        size_bytes: size,
        block_bytes: VOLUME_BLOCK as u32,
        extent_bytes,
        layout,
        extents: Vec::new(),
    };
    let placed = nvpool_testkit::place(&plan.geometry(), n);
    let mut namespaces: Vec<Vec<u32>> = vec![Vec::new(); n];
    for p in &placed {
        namespaces[p.target].push(p.nsid);
    }
    let nqn = host_subsystem();
    let configs: Vec<SubsystemConfig> = namespaces
        .iter()
        .map(|nsids| {
            let ns: Vec<(u32, &str)> = nsids.iter().map(|&id| (id, ns_spec)).collect();
            subsystem(&nqn, &[HOST_A], &ns)
        })
        .collect();
    let targets: Vec<Tgt> = configs
        .iter()
        .map(|c| Tgt::start(std::slice::from_ref(c)))
        .collect();
    for p in placed {
        plan.extents.push(PlanExtent {
            target: format!("target-{}", p.target),
            addr: targets[p.target].addr,
            rdma_addr: None,
            subsystem_nqn: nqn.clone(),
            nsid: p.nsid,
            device: "ram".into(),
            offset: 0,
            length: extent_bytes,
            member: p.member,
            row: p.row,
            copy: p.copy,
        });
    }
    plan.validate().expect("the test builds valid plans");
    Setup {
        addrs: targets.iter().map(|t| t.addr).collect(),
        targets: targets.into_iter().map(Some).collect(),
        configs,
        plan,
        faults: Vec::new(),
    }
}

/// Like [`setup`] with RAM namespaces of 512-byte blocks behind
/// fault-injecting backends.
pub fn setup_faulty(n: usize, layout: LayoutBody, size: u64, extent_bytes: u64) -> Setup {
    let mut s = setup(
        n,
        layout,
        size,
        extent_bytes,
        &format!("ram:{extent_bytes}"),
    );
    for e in &s.plan.extents {
        let t = s.target_of(e.addr);
        let f = Arc::new(FaultBackend::new(Arc::new(RamBackend::new(
            extent_bytes,
            512,
        ))));
        t.target
            .put_namespace_backend(&e.subsystem_nqn, e.nsid, f.clone())
            .expect("swap the backend");
        s.faults.push(f);
    }
    s
}

impl Setup {
    /// Target `t`, which must be running.
    pub fn target(&self, t: usize) -> &Tgt {
        self.targets[t].as_ref().expect("target running")
    }

    /// Every target, which must all be running.
    pub fn all(&self) -> Vec<&Tgt> {
        (0..self.targets.len()).map(|t| self.target(t)).collect()
    }

    fn target_of(&self, addr: SocketAddr) -> &Tgt {
        let t = self.addrs.iter().position(|&a| a == addr).expect("target");
        self.target(t)
    }

    /// Stops target `t`: its listener and connections go.
    pub fn stop(&mut self, t: usize) {
        self.targets[t].take().expect("target running").stop();
    }

    /// Starts target `t` again on its address with its subsystem and fresh
    /// namespaces (RAM: zeroes).
    pub fn restart(&mut self, t: usize) {
        assert!(self.targets[t].is_none(), "target {t} is running");
        let tgt = Tgt::start_on(
            Target::new(None).expect("target"),
            self.addrs[t],
            std::slice::from_ref(&self.configs[t]),
        );
        assert_eq!(tgt.addr, self.addrs[t]);
        self.targets[t] = Some(tgt);
    }

    /// Adds `backend` as the next namespace of target `t`'s host
    /// subsystem, recorded as a RAM namespace of `bytes` (a restart brings
    /// it back empty); returns its NSID.
    fn add_ram_namespace(&mut self, t: usize, bytes: u64, backend: Arc<dyn Backend>) -> u32 {
        let config = &mut self.configs[t];
        let nsid = config.namespaces.iter().map(|n| n.nsid).max().unwrap_or(0) + 1;
        config.namespaces.push(NamespaceConfig {
            nsid,
            backend: format!("ram:{bytes}"),
            uuid: None,
            read_only: false,
        });
        self.target(t)
            .target
            .put_namespace_backend(&host_subsystem(), nsid, backend)
            .expect("add a namespace");
        nsid
    }

    /// A new namespace of the volume's extent size on target `t` (RAM,
    /// behind a fault-injecting backend, which it returns), as the place
    /// plan extent `index` would have there: the destination of a move.
    /// A restart of `t` brings it back empty, without the fault backend.
    pub fn spare(&mut self, index: usize, t: usize) -> (PlanExtent, Arc<FaultBackend>) {
        let bytes = self.plan.extent_bytes;
        let f = Arc::new(FaultBackend::new(Arc::new(RamBackend::new(bytes, 512))));
        let nsid = self.add_ram_namespace(t, bytes, f.clone());
        let slot = &self.plan.extents[index];
        let dest = PlanExtent {
            target: format!("target-{t}"),
            addr: self.addrs[t],
            nsid,
            device: "spare".into(),
            ..slot.clone()
        };
        (dest, f)
    }

    /// The plan grown to `size` bytes as `nvpool volume resize` grows it:
    /// rows appended and placed as [`setup`] places them, each new extent
    /// a RAM namespace in `block`-byte blocks added to its target (a
    /// restart brings it back empty). It is `self.plan` from now on.
    pub fn grow(&mut self, size: u64, block: u32) -> ConnectionPlan {
        let mut plan = self.plan.clone();
        plan.size_bytes = size;
        let g = plan.geometry();
        let bytes = plan.extent_bytes;
        let n = self.addrs.len();
        let nqn = host_subsystem();
        for row in self.plan.geometry().rows()..g.rows() {
            for member in 0..g.width {
                for copy in 0..g.copies {
                    let t =
                        (row as usize + member as usize * usize::from(g.copies) + copy as usize)
                            % n;
                    let nsid =
                        self.add_ram_namespace(t, bytes, Arc::new(RamBackend::new(bytes, block)));
                    plan.extents.push(PlanExtent {
                        target: format!("target-{t}"),
                        addr: self.addrs[t],
                        rdma_addr: None,
                        subsystem_nqn: nqn.clone(),
                        nsid,
                        device: "ram".into(),
                        offset: 0,
                        length: bytes,
                        member,
                        row,
                        copy,
                    });
                }
            }
        }
        plan.validate().expect("the test grows plans validly");
        self.plan = plan.clone();
        plan
    }

    /// Runs `f` on the namespace of plan extent `index`, through a
    /// controller of its own.
    pub fn with_copy<R>(&self, index: usize, f: impl FnOnce(&Device) -> R) -> R {
        self.with_extent(&self.plan.extents[index], f)
    }

    /// Runs `f` on the namespace of `e` (a plan extent or a move's
    /// destination), through a controller of its own.
    pub fn with_extent<R>(&self, e: &PlanExtent, f: impl FnOnce(&Device) -> R) -> R {
        let t = self.target_of(e.addr);
        let ctrl =
            Controller::connect(params(t.addr, &e.subsystem_nqn, HOST_A)).unwrap_or_else(|err| {
                panic!(
                    "verifier connect for {} namespace {}: {err}",
                    e.addr, e.nsid
                )
            });
        let bs = ctrl.namespace(e.nsid).expect("namespace").block_size;
        let io = ControllerIo::start(ctrl.clone(), 1, bs).expect("I/O queue");
        let d = Device::on(&io, e.nsid).expect("namespace handle");
        let r = f(&d);
        drop(d);
        drop(io);
        ctrl.shutdown();
        r
    }

    /// The bytes `[offset, offset + len)` of plan extent `index`.
    pub fn read_copy(&self, index: usize, offset: u64, len: u64) -> Vec<u8> {
        self.read_extent(&self.plan.extents[index], offset, len)
    }

    /// The bytes `[offset, offset + len)` of `e`'s namespace.
    pub fn read_extent(&self, e: &PlanExtent, offset: u64, len: u64) -> Vec<u8> {
        self.with_extent(e, |d| {
            let (r, b) = block_on(d.read(offset, vec![0; len as usize]));
            r.unwrap_or_else(|err| panic!("read of {} ns {} at {offset}: {err}", e.addr, e.nsid));
            b
        })
    }

    /// Writes `data` at `offset` of plan extent `index`, behind the
    /// volume's back.
    pub fn write_copy(&self, index: usize, offset: u64, data: &[u8]) {
        self.write_extent(&self.plan.extents[index], offset, data)
    }

    /// Writes `data` at `offset` of `e`'s namespace, behind the volume's
    /// back.
    pub fn write_extent(&self, e: &PlanExtent, offset: u64, data: &[u8]) {
        self.with_extent(e, |d| {
            let (r, _) = block_on(d.write(offset, data.to_vec(), true));
            r.unwrap_or_else(|err| panic!("write of {} ns {} at {offset}: {err}", e.addr, e.nsid));
        })
    }

    /// Controllers of the test host on target `t`.
    pub fn host_controllers(&self, t: usize) -> usize {
        host_controllers(self.target(t))
    }
}

/// Controllers of the test host on `t`.
pub fn host_controllers(t: &Tgt) -> usize {
    let nqn = host_subsystem();
    t.target
        .controllers()
        .iter()
        .filter(|c| !c.discovery && c.hostnqn == HOST_A && c.subsys_nqn == nqn)
        .count()
}

/// Options for tests: quick reconnects, a short controller-loss timeout.
pub fn volume_opts() -> VolumeOptions {
    VolumeOptions {
        queue_depth: 32,
        reconnect_delay: Duration::from_millis(100),
        connect_timeout: Duration::from_secs(1),
        ctrl_loss_timeout: Some(Duration::from_secs(2)),
        ..VolumeOptions::default()
    }
}

/// Writes `len` bytes of pattern `seed` at `off` through the volume and
/// into `model`; returns the bytes written.
#[track_caller]
pub fn write(v: &Volume, model: &mut [u8], off: u64, len: u64, seed: u64, fua: bool) -> Vec<u8> {
    let data = pattern(seed, len as usize);
    let (r, back) = block_on(v.write(off, data.clone(), fua));
    r.unwrap_or_else(|e| panic!("write of {len} bytes at {off}: {e}"));
    assert_eq!(back.len(), data.len(), "the buffer comes back");
    model[off as usize..(off + len) as usize].copy_from_slice(&data);
    data
}

/// Reads `[off, off + len)` through the volume and compares it with `model`.
#[track_caller]
pub fn read_check(v: &Volume, model: &[u8], off: u64, len: u64) {
    let (r, got) = block_on(v.read(off, vec![0xEE; len as usize]));
    r.unwrap_or_else(|e| panic!("read of {len} bytes at {off}: {e}"));
    assert_same(
        &got,
        &model[off as usize..(off + len) as usize],
        &format!("volume bytes {off}+{len}"),
    );
}

/// Reads `n` times at `off` through the volume: how many returned `a`,
/// how many `b` (anything else fails the test).
#[track_caller]
pub fn reads_seeing(v: &Volume, off: u64, a: &[u8], b: &[u8], n: usize) -> (usize, usize) {
    let mut seen = (0, 0);
    for _ in 0..n {
        let (r, got) = block_on(v.read(off, vec![0xEE; a.len()]));
        r.unwrap_or_else(|e| panic!("read at {off}: {e}"));
        if got == a {
            seen.0 += 1;
        } else if got == b {
            seen.1 += 1;
        } else {
            panic!("a read at {off} returned the bytes of neither copy");
        }
    }
    seen
}

pub type Reports = std::sync::Arc<std::sync::Mutex<Vec<nvpool_initiator::volume::ExtentFailure>>>;

/// Options that collect every failure report.
pub fn reporting(base: VolumeOptions) -> (VolumeOptions, Reports) {
    let reports: Reports = Arc::default();
    let r = reports.clone();
    let o = VolumeOptions {
        on_extent_failed: Some(Arc::new(
            move |f: &nvpool_initiator::volume::ExtentFailure| r.lock().unwrap().push(f.clone()),
        )),
        ..base
    };
    (o, reports)
}
