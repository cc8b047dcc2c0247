//! Per-volume counters, kept on the data path with relaxed atomic adds (no
//! lock, no allocation), and their Prometheus text form.

use crate::api::VolumeStatsOut;
use nvpool_api::prometheus::{Kind, Text};
use nvpool_initiator::blockdev::{BlockDev, BufResult, IoFuture};
use nvpool_initiator::error::IoError;
use nvpool_initiator::Volume;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

/// Latency buckets: below 1 µs, 2 µs, 4 µs … 2^(BUCKETS-2) µs (≈ 8.4 s),
/// and the rest.
pub const BUCKETS: usize = 25;

/// A log2 latency histogram.
#[derive(Debug)]
pub struct Histogram {
    buckets: [AtomicU64; BUCKETS],
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Histogram {
    /// The bucket of a latency: the first whose bound (2^i µs) exceeds it.
    pub fn bucket(ns: u64) -> usize {
        let us = ns / 1000;
        // 0 µs → 0; 1 µs → 1 (below 2 µs); 2..3 → 2; …
        let i = (u64::BITS - us.leading_zeros()) as usize;
        i.min(BUCKETS - 1)
    }

    fn record(&self, ns: u64) {
        self.buckets[Self::bucket(ns)].fetch_add(1, Relaxed);
    }

    pub fn snapshot(&self) -> Vec<u64> {
        self.buckets.iter().map(|b| b.load(Relaxed)).collect()
    }
}

/// What one volume did since it was served.
#[derive(Debug, Default)]
pub struct VolumeStats {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub others: AtomicU64,
    pub read_bytes: AtomicU64,
    pub write_bytes: AtomicU64,
    pub read_ns: AtomicU64,
    pub write_ns: AtomicU64,
    pub errors: AtomicU64,
    pub in_flight: AtomicU64,
    pub read_latency: Histogram,
    pub write_latency: Histogram,
}

enum Op {
    Read,
    Write,
    Other,
}

impl VolumeStats {
    fn begin(&self) -> Instant {
        self.in_flight.fetch_add(1, Relaxed);
        Instant::now()
    }

    fn end(&self, op: Op, bytes: u64, started: Instant, ok: bool) {
        let ns = started.elapsed().as_nanos() as u64;
        self.in_flight.fetch_sub(1, Relaxed);
        if !ok {
            self.errors.fetch_add(1, Relaxed);
        }
        match op {
            Op::Read => {
                self.reads.fetch_add(1, Relaxed);
                self.read_bytes.fetch_add(bytes, Relaxed);
                self.read_ns.fetch_add(ns, Relaxed);
                self.read_latency.record(ns);
            }
            Op::Write => {
                self.writes.fetch_add(1, Relaxed);
                self.write_bytes.fetch_add(bytes, Relaxed);
                self.write_ns.fetch_add(ns, Relaxed);
                self.write_latency.record(ns);
            }
            Op::Other => {
                self.others.fetch_add(1, Relaxed);
            }
        }
    }

    /// The counters into `out`.
    pub fn fill(&self, out: &mut VolumeStatsOut) {
        out.reads = self.reads.load(Relaxed);
        out.writes = self.writes.load(Relaxed);
        out.others = self.others.load(Relaxed);
        out.read_bytes = self.read_bytes.load(Relaxed);
        out.write_bytes = self.write_bytes.load(Relaxed);
        out.read_ns = self.read_ns.load(Relaxed);
        out.write_ns = self.write_ns.load(Relaxed);
        out.errors = self.errors.load(Relaxed);
        out.in_flight = self.in_flight.load(Relaxed);
        out.read_latency_us_log2 = self.read_latency.snapshot();
        out.write_latency_us_log2 = self.write_latency.snapshot();
    }
}

/// A volume whose requests are counted: what the front-end serves. It
/// calls the volume's own async methods, so a request costs one boxed
/// future (the front-end's), not one for the counting and one for the
/// volume.
pub struct Metered {
    pub dev: Arc<Volume>,
    pub stats: Arc<VolumeStats>,
}

impl std::fmt::Debug for Metered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metered")
            .field("stats", &self.stats)
            .finish()
    }
}

impl BlockDev for Metered {
    fn size(&self) -> u64 {
        BlockDev::size(&*self.dev)
    }

    fn block_size(&self) -> u32 {
        BlockDev::block_size(&*self.dev)
    }

    fn optimal_io_bytes(&self) -> u32 {
        BlockDev::optimal_io_bytes(&*self.dev)
    }

    fn max_io_bytes(&self) -> u32 {
        BlockDev::max_io_bytes(&*self.dev)
    }

    fn read(&self, offset: u64, buf: Vec<u8>) -> IoFuture<'_, BufResult> {
        Box::pin(async move {
            let len = buf.len() as u64;
            let t = self.stats.begin();
            let (r, buf) = self.dev.read(offset, buf).await;
            self.stats.end(Op::Read, len, t, r.is_ok());
            (r, buf)
        })
    }

    fn write(&self, offset: u64, buf: Vec<u8>, fua: bool) -> IoFuture<'_, BufResult> {
        Box::pin(async move {
            let len = buf.len() as u64;
            let t = self.stats.begin();
            let (r, buf) = self.dev.write(offset, buf, fua).await;
            self.stats.end(Op::Write, len, t, r.is_ok());
            (r, buf)
        })
    }

    fn flush(&self) -> IoFuture<'_, Result<(), IoError>> {
        Box::pin(async move {
            let t = self.stats.begin();
            let r = self.dev.flush().await;
            self.stats.end(Op::Other, 0, t, r.is_ok());
            r
        })
    }

    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> IoFuture<'_, Result<(), IoError>> {
        Box::pin(async move {
            let t = self.stats.begin();
            let r = self.dev.write_zeroes(offset, len, may_unmap).await;
            self.stats.end(Op::Other, 0, t, r.is_ok());
            r
        })
    }

    fn discard(&self, offset: u64, len: u64) -> IoFuture<'_, Result<(), IoError>> {
        Box::pin(async move {
            let t = self.stats.begin();
            let r = self.dev.discard(offset, len).await;
            self.stats.end(Op::Other, 0, t, r.is_ok());
            r
        })
    }
}

/// Every volume's counters in Prometheus' text exposition format.
pub fn prometheus(volumes: &[VolumeStatsOut]) -> String {
    let mut o = Text::new();
    let families: [(&str, Kind, &str); 6] = [
        (
            "nvpool_volume_ops_total",
            Kind::Counter,
            "Requests completed, by kind.",
        ),
        (
            "nvpool_volume_bytes_total",
            Kind::Counter,
            "Bytes read and written.",
        ),
        (
            "nvpool_volume_errors_total",
            Kind::Counter,
            "Requests that failed.",
        ),
        (
            "nvpool_volume_in_flight",
            Kind::Gauge,
            "Requests in flight.",
        ),
        ("nvpool_volume_size_bytes", Kind::Gauge, "Volume size."),
        (
            "nvpool_volume_up",
            Kind::Gauge,
            "1 while served, 0 while waiting to be served again.",
        ),
    ];
    let uuids: Vec<String> = volumes.iter().map(|v| v.uuid.to_string()).collect();
    for (name, kind, help) in families {
        o.family(name, kind, help);
        for (v, uuid) in volumes.iter().zip(&uuids) {
            let l = [("volume", v.name.as_str()), ("uuid", uuid.as_str())];
            let op = |op| [l[0], l[1], ("op", op)];
            match name {
                "nvpool_volume_ops_total" => o
                    .sample(name, &op("read"), v.reads)
                    .sample(name, &op("write"), v.writes)
                    .sample(name, &op("other"), v.others),
                "nvpool_volume_bytes_total" => o.sample(name, &op("read"), v.read_bytes).sample(
                    name,
                    &op("write"),
                    v.write_bytes,
                ),
                "nvpool_volume_errors_total" => o.sample(name, &l, v.errors),
                "nvpool_volume_in_flight" => o.sample(name, &l, v.in_flight),
                "nvpool_volume_size_bytes" => o.sample(name, &l, v.size_bytes),
                _ => o.sample(name, &l, u8::from(v.state != "pending")),
            };
        }
    }
    let name = "nvpool_volume_latency_seconds";
    let help = "Time from the front-end's request to its completion.";
    o.family(name, Kind::Histogram, help);
    for (v, uuid) in volumes.iter().zip(&uuids) {
        for (op, buckets, ns, count) in [
            ("read", &v.read_latency_us_log2, v.read_ns, v.reads),
            ("write", &v.write_latency_us_log2, v.write_ns, v.writes),
        ] {
            let l = [("volume", v.name.as_str()), ("uuid", uuid), ("op", op)];
            // Bucket i holds latencies below 2^i µs.
            let bounds = buckets.iter().enumerate().take(BUCKETS - 1);
            let bounds = bounds.map(|(i, n)| ((1u64 << i) as f64 / 1e6, *n));
            let total = buckets.iter().sum();
            o.histogram(name, &l, bounds, total, ns as f64 / 1e9, count);
        }
    }
    let name = "nvpool_path_up";
    o.family(
        name,
        Kind::Gauge,
        "1 while the controller to a target is live.",
    );
    for (v, uuid) in volumes.iter().zip(&uuids) {
        for p in &v.paths {
            let l = [
                ("volume", v.name.as_str()),
                ("uuid", uuid),
                ("addr", &p.addr),
                ("transport", &p.transport),
            ];
            o.sample(name, &l, u8::from(p.state == "live"));
        }
    }
    let name = "nvpool_path_stale_copies";
    let help = "Copies on the path the volume does not read (failed or being filled).";
    o.family(name, Kind::Gauge, help);
    for (v, uuid) in volumes.iter().zip(&uuids) {
        for p in &v.paths {
            let l = [
                ("volume", v.name.as_str()),
                ("uuid", uuid),
                ("addr", &p.addr),
            ];
            o.sample(name, &l, p.stale_copies);
        }
    }
    o.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_of_microseconds() {
        assert_eq!(Histogram::bucket(0), 0);
        assert_eq!(Histogram::bucket(999), 0);
        assert_eq!(Histogram::bucket(1_000), 1);
        assert_eq!(Histogram::bucket(1_999), 1);
        assert_eq!(Histogram::bucket(2_000), 2);
        assert_eq!(Histogram::bucket(100_000), 7);
        assert_eq!(Histogram::bucket(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn prometheus_text_is_cumulative_and_escaped() {
        let uuid = "0b5e1f9a-6c1d-4c55-9d0e-2f8a3b7c1d42".parse().unwrap();
        let mut v = VolumeStatsOut::new(uuid, "a\"b".into(), "serving");
        v.reads = 3;
        v.read_ns = 3_000_000;
        v.read_latency_us_log2 = vec![0; BUCKETS];
        v.read_latency_us_log2[1] = 1;
        v.read_latency_us_log2[3] = 2;
        v.write_latency_us_log2 = vec![0; BUCKETS];
        let t = prometheus(&[v]);
        assert!(t.contains(r#"volume="a\"b""#), "{t}");
        assert!(t.contains(r#"op="read",le="0.000002"} 1"#), "{t}");
        assert!(t.contains(r#"op="read",le="0.000008"} 3"#), "{t}");
        assert!(t.contains(r#"op="read",le="+Inf"} 3"#), "{t}");
        assert!(t.contains(r#"nvpool_volume_latency_seconds_sum{volume="a\"b",uuid="#));
        assert!(t.contains("nvpool_volume_up{"), "{t}");
    }
}
