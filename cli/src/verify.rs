//! `nvpool volume verify`: proof that a volume's copies agree.
//!
//! The volume is exported to a verifier host NQN of its own (a fresh one per
//! run, so runs never share an attachment, and copy jobs do not wait for it:
//! it only reads). Every in-sync copy of every extent is read through its
//! target, region by region ([`RESYNC_REGION_BYTES`]), and the copies of a
//! region are compared byte for byte. Copies that are stale or being filled
//! are not compared (they are known not to agree yet); a row with a single
//! in-sync copy has nothing to compare and is counted as such.
//!
//! It runs online: a host may be writing the region at that moment, and its
//! write reaches the copies a few microseconds apart. A region that differs
//! is read again (`retries` times, `RETRY_PAUSE` apart); only a difference
//! that persists is reported. It is throttled (`rate_bytes_per_sec` of reads
//! over all copies) so that client I/O keeps its bandwidth.

use crate::client::{segment, Client};
use anyhow::Context;
use nvpool_api::names::VERIFIER_NQN_PREFIX;
use nvpool_initiator::admin::{ConnectParams, Controller};
use nvpool_initiator::device::{block_on, Device};
use nvpool_initiator::follow::{new_session, AttachmentView};
use nvpool_layout::plan::RESYNC_REGION_BYTES;
use nvpool_layout::Uuid;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Wait between reads of a region whose copies differed.
const RETRY_PAUSE: Duration = Duration::from_millis(200);
/// How long a copy's target may be away before the verification fails.
const CTRL_LOSS_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// Bytes read per second over all copies (0: as fast as they go).
    pub rate_bytes_per_sec: u64,
    /// Reads again of a region whose copies differ before it counts.
    pub retries: u32,
}

impl Default for VerifyOptions {
    fn default() -> VerifyOptions {
        VerifyOptions {
            rate_bytes_per_sec: 256 << 20,
            retries: 3,
        }
    }
}

/// One region whose copies hold different bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Difference {
    pub row: u32,
    pub member: u32,
    /// The compared copies (indices into the volume's extents).
    pub extents: Vec<u32>,
    /// Region index within the extent.
    pub region: u32,
    /// Byte range within the extent.
    pub offset: u64,
    pub length: u64,
}

/// What a verification found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// Extent copies read and compared.
    pub copies_compared: u32,
    /// Bytes read from all copies.
    pub bytes_read: u64,
    /// Rows and members with fewer than two in-sync copies (nothing to
    /// compare): stale or syncing copies are left out.
    pub groups_skipped: u32,
    pub differences: Vec<Difference>,
}

/// A fresh verifier host NQN.
fn verifier_nqn() -> String {
    format!("{VERIFIER_NQN_PREFIX}{:016x}", new_session())
}

/// Takes the verifier's attachment back when verification ends, however.
struct Attached<'a> {
    client: &'a Client,
    path: String,
}

impl Drop for Attached<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.client.delete(&format!("{}?force=true", self.path)) {
            tracing::warn!(error = %e, "removing the verifier's attachment failed");
        }
    }
}

/// Verifies volume `uuid` (see the module docs).
pub fn verify(client: &Client, uuid: &Uuid, opts: &VerifyOptions) -> anyhow::Result<Report> {
    let host = verifier_nqn();
    let path = format!("/v1/volumes/{uuid}/attachments/{}", segment(&host));
    let _: (u16, serde_json::Value) = client.put_empty(&path)?;
    let _attached = Attached {
        client,
        path: path.clone(),
    };
    let view: AttachmentView = client.get(&path)?;
    let plan = &view.plan;
    plan.validate()
        .map_err(|e| anyhow::anyhow!("unusable connection plan: {e}"))?;
    let not_in_sync: BTreeSet<u32> = view
        .copies
        .failed_extents
        .iter()
        .chain(view.copies.syncing.iter().map(|s| &s.extent))
        .copied()
        .collect();

    // One controller per (target, subsystem), one namespace handle per copy
    // compared.
    let mut ctrls: HashMap<(SocketAddr, String), Arc<Controller>> = HashMap::new();
    let mut report = Report::default();
    let copies = usize::from(plan.geometry().copies);
    let mut bucket = Bucket::new(opts.rate_bytes_per_sec);
    for (g, group) in plan.extents.chunks(copies).enumerate() {
        let first = &group[0];
        let in_sync: Vec<u32> = (0..group.len())
            .map(|c| (g * copies + c) as u32)
            .filter(|i| !not_in_sync.contains(i))
            .collect();
        if in_sync.len() < 2 {
            report.groups_skipped += 1;
            continue;
        }
        let mut devs = Vec::with_capacity(in_sync.len());
        for &i in &in_sync {
            let e = &plan.extents[i as usize];
            let key = (e.addr, e.subsystem_nqn.clone());
            let ctrl = match ctrls.get(&key) {
                Some(c) => c.clone(),
                None => {
                    let mut p = ConnectParams::new(e.addr, &e.subsystem_nqn);
                    p.hostnqn = host.clone();
                    p.io_queues = 1;
                    p.ctrl_loss_timeout = CTRL_LOSS_TIMEOUT;
                    let c = Controller::connect(p).with_context(|| {
                        format!("connecting to {} ({}) for extent {i}", e.target, e.addr)
                    })?;
                    ctrls.insert(key, c.clone());
                    c
                }
            };
            devs.push(
                Device::open(ctrl, e.nsid, 1)
                    .with_context(|| format!("opening extent {i} on {}", e.target))?,
            );
        }
        report.copies_compared += in_sync.len() as u32;
        let region_bytes = RESYNC_REGION_BYTES.min(first.length);
        let regions = first.length.div_ceil(region_bytes);
        for r in 0..regions {
            let offset = r * region_bytes;
            let len = region_bytes.min(first.length - offset);
            let mut agree = false;
            for attempt in 0..=opts.retries {
                if attempt > 0 {
                    std::thread::sleep(RETRY_PAUSE);
                }
                let mut first_copy: Option<Vec<u8>> = None;
                agree = true;
                for (d, &i) in devs.iter().zip(&in_sync) {
                    bucket.take(len);
                    let (res, buf) = block_on(d.read(offset, vec![0u8; len as usize]));
                    res.map_err(|e| anyhow::anyhow!("reading extent {i} at {offset}: {e}"))?;
                    report.bytes_read += len;
                    match &first_copy {
                        None => first_copy = Some(buf),
                        Some(f) => agree &= *f == buf,
                    }
                }
                if agree {
                    break;
                }
            }
            if !agree {
                report.differences.push(Difference {
                    row: first.row,
                    member: first.member,
                    extents: in_sync.clone(),
                    region: r as u32,
                    offset,
                    length: len,
                });
            }
        }
    }
    Ok(report)
}

/// Paces reads at a byte rate (one second of burst).
struct Bucket {
    rate: u64,
    start: Instant,
    spent: u64,
}

impl Bucket {
    fn new(rate: u64) -> Bucket {
        Bucket {
            rate,
            start: Instant::now(),
            spent: 0,
        }
    }

    fn take(&mut self, n: u64) {
        if self.rate == 0 {
            return;
        }
        self.spent += n;
        let due = Duration::from_secs_f64(self.spent as f64 / self.rate as f64);
        let elapsed = self.start.elapsed();
        if due > elapsed + Duration::from_secs(1) {
            std::thread::sleep(due - elapsed - Duration::from_secs(1));
        }
    }
}
