//! Log lines a remote peer can trigger, rate-limited (STYLE 11).
//!
//! A host that sends malformed PDUs, connects with a bad NQN in a loop,
//! stops its keep-alives or fails every I/O on a broken disk could make
//! the target write a line as fast as it can send a packet. Every such line
//! goes through [`peer_warn!`], [`peer_info!`] or [`peer_error!`] instead of
//! the plain `tracing` macros: each call site writes at most
//! [`limits::PEER_LOG_LINES_PER_WINDOW`] lines per
//! [`limits::PEER_LOG_WINDOW_MS`]; the lines beyond are counted, and the
//! first line the site writes after them carries `suppressed = K`, the
//! number of similar lines left out in between.
//!
//! A call site is one [`Site`], a `static` the macro declares where it is
//! used. `peer_warn!(site = EXPR; ...)` takes an explicit one instead, for
//! a limit per object (a volume namespace keeps its own, so one failing
//! volume does not hide another's warnings). [`PeerSites`] gives a site per
//! peer address for lines anyone on the network can trigger (the admin
//! API's refused requests): one noisy peer then does not hide the lines
//! of another.
//!
//! ```text
//!   peer_warn!(peer = %addr, "connect refused")
//!     └─ static SITE ─ admit(now) ─ Some(K) ─► tracing::warn!(suppressed = K, …) when K > 0
//!                                 └ None ───► counted in SITE, written with the next line
//! ```

use crate::limits::{PEER_LOG_KEYED_SITES, PEER_LOG_LINES_PER_WINDOW, PEER_LOG_WINDOW_MS};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// The rate limit of one call site. Lock-free: reactors on several threads
/// may log through one site at once. Under such a race a window may admit
/// a line or two more than its limit; no line is ever counted twice or
/// lost from the `suppressed` counts.
#[derive(Debug)]
pub struct Site {
    /// Start of the current window in [`now_ms`] milliseconds; 0: none yet.
    window_start_ms: AtomicU64,
    /// Lines asked for in the current window (written or not).
    lines: AtomicU64,
    /// Lines left out since the last one written.
    suppressed: AtomicU64,
}

impl Default for Site {
    fn default() -> Site {
        Site::new()
    }
}

impl Site {
    pub const fn new() -> Site {
        Site {
            window_start_ms: AtomicU64::new(0),
            lines: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Whether a line asked for at `now_ms` may be written: `Some(K)` with
    /// the K lines left out since the last written one, or `None` (the line
    /// is counted and left out).
    pub fn admit(&self, now_ms: u64) -> Option<u64> {
        let now_ms = now_ms.max(1);
        let start = self.window_start_ms.load(Ordering::Relaxed);
        if (start == 0 || now_ms.saturating_sub(start) >= PEER_LOG_WINDOW_MS)
            && self
                .window_start_ms
                .compare_exchange(start, now_ms, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.lines.store(0, Ordering::Relaxed);
        }
        if self.lines.fetch_add(1, Ordering::Relaxed) < u64::from(PEER_LOG_LINES_PER_WINDOW) {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// A rate limit per peer IP address for one kind of line, in fixed
/// memory: [`PEER_LOG_KEYED_SITES`] sites, a peer's address picking one
/// by its hash. Peers whose addresses share a site share its limit (what
/// either leaves out is still counted); all of them together write at
/// most `PEER_LOG_KEYED_SITES × PEER_LOG_LINES_PER_WINDOW` lines a window.
#[derive(Debug)]
pub struct PeerSites {
    sites: [Site; PEER_LOG_KEYED_SITES],
}

impl Default for PeerSites {
    fn default() -> PeerSites {
        PeerSites::new()
    }
}

impl PeerSites {
    pub const fn new() -> PeerSites {
        PeerSites {
            sites: [const { Site::new() }; PEER_LOG_KEYED_SITES],
        }
    }

    /// The site of lines about `peer`.
    pub fn site(&self, peer: IpAddr) -> &Site {
        // FNV-1a over the address bytes: cheap and spreads neighbours.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let v6 = match peer {
            IpAddr::V4(a) => a.to_ipv6_mapped(),
            IpAddr::V6(a) => a,
        };
        for b in v6.octets() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x100_0000_01b3);
        }
        &self.sites[(h % PEER_LOG_KEYED_SITES as u64) as usize]
    }
}

/// Milliseconds on the clock sites measure their windows with (monotonic,
/// from the first call, never 0).
pub fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// The one implementation behind [`peer_warn!`], [`peer_info!`] and
/// [`peer_error!`]: `$level` is the `tracing` macro to write with.
macro_rules! peer_log {
    ($level:ident, site = $site:expr; $($arg:tt)+) => {{
        if let Some(suppressed) = $crate::peerlog::Site::admit($site, $crate::peerlog::now_ms()) {
            if suppressed == 0 {
                ::tracing::$level!($($arg)+);
            } else {
                ::tracing::$level!(suppressed, $($arg)+);
            }
        }
    }};
    ($level:ident, $($arg:tt)+) => {{
        static SITE: $crate::peerlog::Site = $crate::peerlog::Site::new();
        $crate::peerlog::peer_log!($level, site = &SITE; $($arg)+)
    }};
}

/// `tracing::warn!` for a line a remote peer can trigger: rate-limited per
/// call site (or per `site = EXPR;` given first). See the module docs.
macro_rules! peer_warn {
    ($($arg:tt)+) => { $crate::peerlog::peer_log!(warn, $($arg)+) };
}

/// `tracing::info!` for a line a remote peer can trigger; see [`peer_warn!`].
macro_rules! peer_info {
    ($($arg:tt)+) => { $crate::peerlog::peer_log!(info, $($arg)+) };
}

/// `tracing::error!` for a line a remote peer can trigger; see [`peer_warn!`].
macro_rules! peer_error {
    ($($arg:tt)+) => { $crate::peerlog::peer_log!(error, $($arg)+) };
}

pub(crate) use {peer_error, peer_info, peer_log, peer_warn};

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    const N: u64 = PEER_LOG_LINES_PER_WINDOW as u64;

    #[test]
    fn a_window_writes_its_limit_then_counts_what_it_leaves_out() {
        let s = Site::new();
        for i in 0..N {
            assert_eq!(s.admit(5_000 + i), Some(0), "line {i}");
        }
        for _ in 0..7 {
            assert_eq!(s.admit(5_000 + N), None);
        }
        // Still the same window just before it ends.
        assert_eq!(s.admit(5_000 + PEER_LOG_WINDOW_MS - 1), None);
        // The next window's first line reports the 8 left out, once.
        assert_eq!(s.admit(5_000 + PEER_LOG_WINDOW_MS), Some(8));
        assert_eq!(s.admit(5_000 + PEER_LOG_WINDOW_MS), Some(0));
    }

    #[test]
    fn sites_are_independent_and_a_clock_at_zero_still_works() {
        let (a, b) = (Site::new(), Site::new());
        for _ in 0..N {
            assert!(a.admit(0).is_some());
        }
        assert_eq!(a.admit(0), None);
        assert_eq!(
            b.admit(0),
            Some(0),
            "another site is not limited by the first"
        );
        // A window measured from 0 (clamped to 1) ends like any other.
        assert_eq!(a.admit(1 + PEER_LOG_WINDOW_MS), Some(1));
    }

    #[test]
    fn every_line_is_written_or_counted_exactly_once_across_threads() {
        let s = Arc::new(Site::new());
        let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let reported = Arc::new(std::sync::atomic::AtomicU64::new(0));
        const THREADS: u64 = 4;
        const CALLS: u64 = 20_000;
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let (s, written, reported) = (s.clone(), written.clone(), reported.clone());
                std::thread::spawn(move || {
                    for i in 0..CALLS {
                        // Windows go by as the calls go on (a fake clock).
                        if let Some(k) = s.admit(1 + (t + i * THREADS) / 50) {
                            written.fetch_add(1, Ordering::Relaxed);
                            reported.fetch_add(k, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let (w, r) = (
            written.load(Ordering::Relaxed),
            reported.load(Ordering::Relaxed),
        );
        let left = s.suppressed.load(Ordering::Relaxed);
        assert_eq!(w + r + left, THREADS * CALLS);
        assert!(
            w < THREADS * CALLS / 10,
            "the limit held back most lines: {w} written"
        );
    }

    #[test]
    fn peers_get_sites_of_their_own() {
        let p = PeerSites::new();
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        // Find a peer on another site than `a`.
        let b = (2..=255u8)
            .map(|i| IpAddr::from([192, 0, 2, i]))
            .find(|b| !std::ptr::eq(p.site(a), p.site(*b)))
            .expect("some address lands elsewhere");
        for _ in 0..N {
            assert!(p.site(a).admit(7).is_some());
        }
        assert_eq!(p.site(a).admit(7), None, "a is limited");
        assert_eq!(p.site(b).admit(7), Some(0), "b is not limited by a");
        assert!(std::ptr::eq(p.site(a), p.site(a)), "one site per peer");
        // An IPv4 peer and its IPv6-mapped form are the same peer.
        let mapped: IpAddr = "::ffff:192.0.2.1".parse().unwrap();
        assert!(std::ptr::eq(p.site(a), p.site(mapped)));
    }

    /// What the macros write, captured from a `tracing` subscriber.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn noisy(peer: &str) {
        peer_warn!(peer, "a line a peer can trigger");
    }

    fn other_site() {
        peer_info!("another call site");
    }

    #[test]
    fn the_macro_limits_each_call_site_and_reports_what_it_left_out() {
        let out = Captured::default();
        let w = out.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .finish();
        tracing::subscriber::with_default(sub, || {
            for _ in 0..3 * N {
                noisy("192.0.2.1:1234");
            }
            other_site();
            // The next window: one line with the count of those left out.
            std::thread::sleep(std::time::Duration::from_millis(PEER_LOG_WINDOW_MS + 50));
            noisy("192.0.2.1:1234");
        });
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let noisy_lines: Vec<&&str> = lines
            .iter()
            .filter(|l| l.contains("a line a peer can trigger"))
            .collect();
        assert_eq!(noisy_lines.len() as u64, N + 1, "{text}");
        assert!(noisy_lines[..N as usize].iter().all(|l| l.contains("WARN")
            && l.contains("192.0.2.1:1234")
            && !l.contains("suppressed")));
        assert!(
            noisy_lines[N as usize].contains(&format!("suppressed={}", 2 * N)),
            "{text}"
        );
        assert_eq!(
            lines
                .iter()
                .filter(|l| l.contains("another call site"))
                .count(),
            1,
            "{text}"
        );
    }
}
