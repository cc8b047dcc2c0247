//! Every limit of the initiator, named, with its unit last and its reason.
//!
//! Sizes, depths, counts, timeouts and intervals that bound resources or
//! protocol behaviour live here; bit masks and wire constants stay beside
//! the format they belong to. Durations carry their unit in their type;
//! plain integers name it (`_BYTES`, `_MS`). The `const` assertions tie
//! limits that must fit one another.

use std::time::Duration;

// ---- Controller and queues ----

/// Admin queue entries (the Linux host uses 32).
pub const ADMIN_QUEUE_ENTRIES: u16 = 32;
/// I/O queues (and worker threads) per controller by default: two keep a
/// queue busy while the other's thread handles completions.
pub const IO_QUEUES_PER_CTRL_DEFAULT: u16 = 2;
/// Commands outstanding per I/O queue by default (the Linux host's 128).
pub const IO_QUEUE_DEPTH_DEFAULT: u16 = 128;
/// Requests queued per device worker beyond those in its I/O queue.
pub const JOBS_PER_WORKER_MAX: usize = 256;
/// A command whose data arrives damaged (data digest) is retried this many
/// times before it fails.
pub const DIGEST_RETRIES_MAX: u8 = 3;
/// Extents (with all their copies) one volume flush works on at once:
/// bounds the commands a flush puts in flight and the cost of joining them
/// (every wake-up polls each pending piece).
pub const FLUSH_EXTENTS_IN_FLIGHT_MAX: usize = 64;
/// Most copies of a member a plan may have; a volume's per-group copy
/// states and read `tried` sets are `u32` bitmasks, and the control
/// plane's own limit must fit.
pub const COPIES_MAX: usize = 8;
const _: () = assert!(COPIES_MAX <= u32::BITS as usize);
const _: () = assert!(nvpool_layout::limits::COPIES_MAX as usize <= COPIES_MAX);

// ---- Transfers and buffers ----

/// Largest data transfer one command may carry from this host (I4). The
/// Linux kernel target sends a whole read as one C2HData PDU, so the
/// receive buffer must hold one transfer.
pub const TRANSFER_BYTES_MAX: usize = 1 << 20;
/// TCP receive buffer: one maximal PDU plus room to keep reading behind it.
pub const RX_BUF_BYTES: usize = TRANSFER_BYTES_MAX + (256 << 10);
/// A C2HData payload at least this large that has not fully arrived is read
/// straight into the request's buffer, not through the receive buffer (one
/// copy of every byte less). Smaller ones are not worth the extra reads.
pub const DIRECT_RX_BYTES_MIN: usize = 16 << 10;
/// Largest admin data transfer the host reads in one command.
pub const ADMIN_CHUNK_BYTES: usize = 4096;
/// Largest data of one admin command (Identify and log page chunks are
/// 4 KiB, Connect data 1 KiB): the RDMA admin queue's one data buffer.
pub const ADMIN_DATA_BYTES_MAX: usize = 4096;
/// Bytes the I/O buffer pool may hold: enough for every request in flight
/// on a busy device without pinning memory for a burst long gone.
pub const BUF_POOL_BYTES_MAX: usize = 64 << 20;
/// Buffers the pool keeps per length.
pub const BUF_POOL_PER_LENGTH_MAX: usize = 64;
/// Larger buffers are freed, not pooled (a rare 32 MiB NBD request should
/// not pin 32 MiB).
pub const BUF_POOL_BUF_BYTES_MAX: usize = 4 << 20;

const _: () = assert!(RX_BUF_BYTES > TRANSFER_BYTES_MAX);
const _: () = assert!(ADMIN_CHUNK_BYTES <= ADMIN_DATA_BYTES_MAX);
// A maximal transfer's buffer is reused, and the pool holds several.
const _: () = assert!(BUF_POOL_BUF_BYTES_MAX >= TRANSFER_BYTES_MAX);
const _: () = assert!(BUF_POOL_BYTES_MAX >= 2 * BUF_POOL_BUF_BYTES_MAX);

// ---- Timeouts, retries and intervals ----

/// Controller-loss timeout of volumes with copies (I3): how long writes
/// wait for a dead copy before continuing without it. Long enough for a
/// target restart (a few reconnect attempts), short enough that a dead
/// target stalls writes for seconds, not a minute.
pub const MIRRORED_CTRL_LOSS_TIMEOUT: Duration = Duration::from_secs(5);
/// Controller-loss timeout of volumes without copies (I3, the Linux host's
/// default): nothing to fail over to, so wait for the target to return.
pub const CTRL_LOSS_TIMEOUT: Duration = Duration::from_secs(60);
/// Keep-alive timeout by default (the Linux host's 5 s).
pub const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// First reconnect delay by default; it doubles after each failure. Half a
/// second gives a mirrored volume's 5 s about four attempts.
pub const RECONNECT_DELAY: Duration = Duration::from_millis(500);
/// Reconnect delays double up to this multiple of the configured delay.
pub const RECONNECT_BACKOFF_MAX: u32 = 8;
/// TCP connect and ICResp timeout by default; it adds to the time a dead
/// copy stalls I/O, so it is shorter than a lone controller's 10 s.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Admin commands (keep-alive included) wait this long for their
/// completion; a target that vanished silently is noticed within it.
pub const ADMIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long [`Volume::begin_sync`](crate::Volume::begin_sync) waits for
/// the mutations issued before the switch. A mutation is outstanding that long only when a copy's path
/// is dead: a target that closed its connections stalls writes for about
/// [`MIRRORED_CTRL_LOSS_TIMEOUT`] plus one [`CONNECT_TIMEOUT`], well inside
/// this. A target that vanished silently is noticed by keep-alive first
/// ([`ADMIN_TIMEOUT`]) and may outlast it: begin_sync then fails, the copy
/// stays `Syncing` (written, never read: safe), and the control plane calls
/// it again, which drains again.
pub const SYNC_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// First pause of a drain wait between looks at a counter: mutations take
/// tens of microseconds at least, so looking more often only burns a core.
pub const DRAIN_NAP_MIN: Duration = Duration::from_micros(50);
/// Longest pause between looks: a slow drain (a dead target stalling
/// writes for seconds) is noticed within this of its end, cheaply.
pub const DRAIN_NAP_MAX: Duration = Duration::from_millis(5);
/// A device worker idle in poll(2) wakes this often, to notice a stop
/// request or a controller declared lost while its commands get no answer.
pub const WORKER_IDLE_WAKE: Duration = Duration::from_secs(1);
/// How long dropping an executor waits for its live tasks. Longer than the
/// controller-loss timeout, after which a lost device fails every request,
/// so only a device that never answers is abandoned.
pub const EXECUTOR_DRAIN_TIMEOUT_MS: u64 = 75_000;

// At least four reconnect attempts (0, 1, 3 and 7 delays in) before a
// mirrored copy is given up.
const _: () = assert!(RECONNECT_DELAY.as_millis() * 7 < MIRRORED_CTRL_LOSS_TIMEOUT.as_millis());
const _: () = assert!(MIRRORED_CTRL_LOSS_TIMEOUT.as_millis() <= CTRL_LOSS_TIMEOUT.as_millis());
const _: () = assert!(CONNECT_TIMEOUT.as_millis() < MIRRORED_CTRL_LOSS_TIMEOUT.as_millis());
const _: () = assert!(
    SYNC_DRAIN_TIMEOUT.as_millis()
        > 2 * (MIRRORED_CTRL_LOSS_TIMEOUT.as_millis() + CONNECT_TIMEOUT.as_millis())
);
const _: () = assert!(DRAIN_NAP_MIN.as_micros() < DRAIN_NAP_MAX.as_micros());
const _: () = assert!(EXECUTOR_DRAIN_TIMEOUT_MS as u128 > CTRL_LOSS_TIMEOUT.as_millis());

// ---- RDMA ----

/// Registered data buffers of one RDMA I/O queue (one per command slot, of
/// the maximum transfer each) stay within this; deeper queues of large
/// transfers get fewer entries. 64 MiB: 64 commands of 1 MiB.
pub const RDMA_QUEUE_BUFFER_BYTES_MAX: usize = 64 << 20;
/// Longest wait for a free RDMA send-queue entry before the queue counts as
/// broken.
pub const RDMA_SEND_ROOM_WAIT: Duration = Duration::from_secs(5);

// An RDMA I/O queue has at least two slots of a maximal transfer (one
// command in flight while the next is prepared), and admin data fits.
const _: () = assert!(RDMA_QUEUE_BUFFER_BYTES_MAX >= 2 * TRANSFER_BYTES_MAX);
const _: () = assert!(RDMA_QUEUE_BUFFER_BYTES_MAX >= ADMIN_DATA_BYTES_MAX);

// ---- Front-ends: FUSE and loop device ----

/// Largest READ/WRITE the kernel sends through FUSE (needs FUSE_MAX_PAGES:
/// 256 pages is the kernel's default page limit, so 1 MiB is the most it
/// grants).
pub const FUSE_WRITE_BYTES_MAX: u32 = 1 << 20;
/// Background requests (async direct I/O from the loop device, readahead)
/// the kernel keeps in flight; its default of 16 would cap loop queue depth.
pub const FUSE_BACKGROUND_MAX: u16 = 128;
/// I/Os in flight through the FUSE executor; beyond it session threads wait.
pub const FUSE_IN_FLIGHT_MAX: usize = 256;
/// FUSE attributes change only when the device grows, and then
/// [`FuseLoop::resize`](crate::frontend::fuse::FuseLoop::resize) tells
/// the kernel: let it cache them this long.
pub const FUSE_ATTR_TTL: Duration = Duration::from_secs(60);
/// How long close() retries unmounting while the kernel drops its last
/// references to the file after the loop device let go of it.
pub const FUSE_UNMOUNT_RETRY_MS: u64 = 2_000;
/// Another process may take the free loop device between LOOP_CTL_GET_FREE
/// and LOOP_CONFIGURE; retry that many times (losetup does the same).
pub const LOOP_CONFIGURE_ATTEMPTS_MAX: u32 = 16;
/// How long loop detach waits for the kernel to unbind after the last close.
pub const LOOP_DETACH_WAIT_MS: u64 = 5_000;

// The kernel's background requests all fit in flight; a FUSE request is
// poolable and no larger than one command's transfer.
const _: () = assert!(FUSE_IN_FLIGHT_MAX >= FUSE_BACKGROUND_MAX as usize);
const _: () = assert!(FUSE_WRITE_BYTES_MAX as usize <= BUF_POOL_BUF_BYTES_MAX);
const _: () = assert!(FUSE_WRITE_BYTES_MAX as usize <= TRANSFER_BYTES_MAX);

// ---- Front-ends: NBD ----

/// Largest NBD payload accepted in one request. The protocol says no
/// payload up to 32 MiB should be treated as an attack (and the kernel's
/// nbd driver sends up to 32 MiB), so that is the line; a larger write
/// payload ends the connection, a larger read gets EINVAL.
pub const NBD_PAYLOAD_BYTES_MAX: u32 = 32 << 20;
/// Requests in flight per NBD connection (what the reader may have handed
/// to the executor before its replies were written).
pub const NBD_IN_FLIGHT_MAX: usize = 128;
/// Payload bytes in flight per NBD connection; one request larger than
/// this still runs, alone.
pub const NBD_IN_FLIGHT_BYTES_MAX: usize = 64 << 20;
/// Concurrent connections per NBD server; more are closed at accept.
pub const NBD_CONNECTIONS_MAX: usize = 64;
/// Option data the NBD handshake reads (an export name is at most 4096
/// bytes); longer options are read past and refused with NBD_REP_ERR_TOO_BIG.
pub const NBD_OPTION_DATA_BYTES_MAX: u32 = 8192;
/// Options one NBD connection may send before it is treated as an attack.
pub const NBD_OPTIONS_MAX: u32 = 1024;
/// An NBD client has this long per read to complete the handshake.
pub const NBD_HANDSHAKE_READ_TIMEOUT_MS: u64 = 30_000;
/// Executor threads polling BlockDev futures for one NBD server.
pub const NBD_IO_THREADS_DEFAULT: usize = 2;
/// Futures live across all connections of an NBD server.
pub const NBD_TASKS_MAX: usize = 1024;
/// Peer-triggered NBD warnings are logged at most once per this interval.
pub const NBD_PEER_LOG_INTERVAL_MS: u64 = 1_000;

const _: () = assert!(NBD_IN_FLIGHT_BYTES_MAX >= NBD_PAYLOAD_BYTES_MAX as usize);
const _: () = assert!(NBD_TASKS_MAX >= NBD_IN_FLIGHT_MAX);
// An NBD_OPT_GO naming the longest export (4096 bytes), with its length
// and information request count, is read whole.
const _: () = assert!(NBD_OPTION_DATA_BYTES_MAX >= 4 + 4096 + 2);

// ---- Front-ends: ublk ----

/// Tags (requests in flight) per ublk hardware queue by default, as deep as
/// the Linux NVMe host's I/O queues.
pub const UBLK_QUEUE_DEPTH_DEFAULT: u16 = 128;
/// Largest ublk read or write passed on in one piece, and so each tag's
/// buffer: the initiator caps transfers at 1 MiB (I4), so larger requests
/// would only be split again. Buffers fill lazily: memory follows the
/// largest request each tag has served, at most queues × depth × this.
pub const UBLK_IO_BYTES_MAX: u32 = 1 << 20;
/// Largest ublk discard or write-zeroes request: large enough that `fstrim`
/// of a big volume is a few thousand requests, small enough that one
/// request does not hold a tag for long on a slow target.
pub const UBLK_DISCARD_BYTES_MAX: u32 = 64 << 20;

const _: () = assert!(UBLK_IO_BYTES_MAX as usize <= TRANSFER_BYTES_MAX);
const _: () = assert!(UBLK_IO_BYTES_MAX as usize <= BUF_POOL_BUF_BYTES_MAX);
// libublk refuses I/O buffers over 32 MiB.
const _: () = assert!(UBLK_IO_BYTES_MAX <= 32 << 20);
// Read and write results travel as i32 byte counts.
const _: () = assert!(UBLK_IO_BYTES_MAX <= i32::MAX as u32);
const _: () = assert!(UBLK_DISCARD_BYTES_MAX.is_multiple_of(4096));

// ---- Following the control plane ----

/// Wait after a failed call to the control plane before the next one.
pub const FOLLOW_RETRY: Duration = Duration::from_secs(1);
/// Retry interval of failure reports to an unreachable control plane.
pub const FOLLOW_REPORT_RETRY: Duration = Duration::from_secs(2);
/// How long the failure reporter sleeps with nothing to report before it
/// looks again; it wakes at once for a failure, so this only bounds an
/// idle wait.
pub const FOLLOW_REPORT_IDLE: Duration = Duration::from_secs(3600);
/// Failures queued for the reporter. A failure is reported once per copy
/// and copies are at most the plan's extents; past this many the volume is
/// lost anyway, and a full queue drops (the callback runs inside an I/O
/// and must not block).
pub const FOLLOW_FAILURES_QUEUED_MAX: usize = 1024;
/// Tries of the missed-regions hand-over at stop: a record that does not
/// arrive is treated as lost (a full copy later), so a stopping process
/// does not wait long for an unreachable control plane.
pub const FOLLOW_HAND_OVER_TRIES_MAX: u32 = 3;
/// How long the control plane holds a long-poll of the attachment before
/// it answers unchanged (its `WATCH_WAIT`).
pub const FOLLOW_LONG_POLL: Duration = Duration::from_secs(25);
/// Timeout of one GET of the attachment, a long-poll included: the control
/// plane's wait plus room for a busy store. A request still unanswered
/// then is on a dead connection; the watch is retried.
pub const FOLLOW_GET_TIMEOUT: Duration = Duration::from_secs(60);

const _: () = assert!(FOLLOW_GET_TIMEOUT.as_secs() > 2 * FOLLOW_LONG_POLL.as_secs());
const _: () = assert!(FOLLOW_RETRY.as_millis() < FOLLOW_LONG_POLL.as_millis());
