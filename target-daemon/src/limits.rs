//! Every limit of the target, named, with its unit last and its reason.

/// Entries per I/O submission queue (CAP.MQES + 1). The Linux host asks for
/// 128 by default and up to 1024; 256 leaves room for deep benchmark queues
/// while bounding per-connection buffer memory (see `SLOT_BUF_BYTES_MAX`
/// and `REACTOR_BUF_BUDGET_BYTES`).
pub const IO_QUEUE_ENTRIES_MAX: u16 = 256;
/// Entries of the admin queue: the Linux host uses 32.
pub const ADMIN_QUEUE_ENTRIES_MAX: u16 = 32;
/// I/O queues one controller may create (Number of Queues feature). One per
/// host core is the usual ask; 64 covers large GPU hosts.
pub const IO_QUEUES_PER_CTRL_MAX: u16 = 64;
/// Controllers alive at once, across all subsystems (CNTLIDs 1..=0xFFEF exist).
pub const CONTROLLERS_MAX: usize = 4096;
/// TCP connections alive at once: every controller's admin queue plus I/O queues.
pub const CONNECTIONS_MAX: usize = 16384;
/// The listen backlog asked for: room for as many connections as the
/// target may serve, so a burst waits in the kernel while the reactors'
/// hand-off queues are full (the kernel caps it at net.core.somaxconn,
/// 4096 by default).
pub const LISTEN_BACKLOG: usize = CONNECTIONS_MAX;
/// How soon the acceptor tries again to hand a connection to a reactor
/// whose queue was full (it accepts nothing meanwhile).
pub const ACCEPT_RETRY_MS: u64 = 1;

/// MDTS in units of 4 KiB pages as a power of two: 2^5 × 4 KiB = 128 KiB.
/// Bounds the data buffer one command can need.
pub const MDTS_LOG2_PAGES: u8 = 5;
pub const MDTS_BYTES: usize = 4096 << MDTS_LOG2_PAGES;

/// In-capsule data accepted on I/O queues: 4 KiB writes (and DSM range
/// lists) then need no R2T round trip. The Linux kernel target uses 16 KiB too.
pub const IO_INLINE_DATA_BYTES: usize = 16384;
/// In-capsule data on the admin queue: the Linux host sends all admin write
/// data (Connect, Set Features) in-capsule, up to 8 KiB.
pub const ADMIN_INLINE_DATA_BYTES: usize = 8192;
/// I/O command capsule size advertised in Identify (16-byte units).
pub const IOCCSZ_UNITS: u32 = ((64 + IO_INLINE_DATA_BYTES) / 16) as u32;

/// Largest DATAL accepted in one H2CData PDU. One MDTS: the host then sends
/// each write as one data PDU.
pub const MAXH2CDATA_BYTES: u32 = MDTS_BYTES as u32;

/// Staging buffer per connection for a PDU that arrives split across
/// received buffers: one whole PDU of the largest kind must fit (header,
/// digests, MAXH2CDATA or in-capsule data).
pub const RX_BUF_BYTES: usize = 2 * MDTS_BYTES;
/// A connection's transmit queue copies PDU headers into chunks of this
/// (a larger piece gets a chunk of its own size). Chunks never move, so a
/// send in flight can point into one while responses are appended behind
/// it; 16 KiB holds a full queue's worth of 24-byte responses and headers.
pub const TX_CHUNK_BYTES: usize = 16 << 10;
/// Transmit backlog above which the connection stops reading new commands
/// until the socket drains (back-pressure instead of unbounded buffering).
pub const TX_HIGH_WATER_BYTES: usize = 4 << 20;

/// Data buffer bytes a single command may need: the larger of MDTS and the
/// biggest admin transfer we answer (a discovery log page read in pieces).
pub const CMD_BUF_BYTES_MAX: usize = MDTS_BYTES;

/// A command slot's own data buffer grows to at most this (D3): in-capsule
/// data of either queue kind, Identify data, DSM range lists and 4–16 KiB
/// I/O, so those never wait for a buffer. One connection's own buffers are
/// then at most `IO_QUEUE_ENTRIES_MAX × SLOT_BUF_BYTES_MAX` (4 MiB).
pub const SLOT_BUF_BYTES_MAX: usize = IO_INLINE_DATA_BYTES;
/// Each buffer of a reactor's pool holds the largest transfer (one MDTS):
/// every larger-than-own transfer borrows one, whatever its size, so the
/// pool never frees one buffer to make room for another.
pub const POOL_BUF_BYTES: usize = CMD_BUF_BYTES_MAX;
/// What one reactor's pool of large data buffers may hold, lent to
/// commands or idle (D18): two full I/O queues at MDTS (64 MiB), so two
/// hosts each running a full queue of 128 KiB I/O on one reactor never
/// wait. Beyond it a command that needs a buffer waits in its slot (its
/// R2T or execution delayed) until one comes back.
pub const REACTOR_BUF_BUDGET_BYTES: usize = 2 * IO_QUEUE_ENTRIES_MAX as usize * POOL_BUF_BYTES;

/// Ring operations one Write Zeroes or deallocate keeps in flight (one per
/// DSM range, or one per zero-write chunk): a 256-range DSM or a 256 MiB
/// zero-write fallback submits its next ones as earlier ones complete, so
/// the ring's backlog stays within this times the slots.
pub const ZERO_OPS_PER_CMD_MAX: u32 = 16;
/// Where a filesystem zeroes by no fallocate mode, zeroes are written in
/// chunks of this from one shared buffer of zeroes (a chunk's length must
/// fit the 16-bit tag of its ring operation in 512-byte units).
pub const ZERO_WRITE_CHUNK_BYTES: usize = 1 << 20;

/// Lines one peer-triggerable log call site writes per window
/// (`peerlog.rs`): enough to see what is going on, too few to fill a disk
/// when a host misbehaves in a loop. The rest are counted.
pub const PEER_LOG_LINES_PER_WINDOW: u32 = 10;
pub const PEER_LOG_WINDOW_MS: u64 = 1_000;
/// Sites of a per-peer rate limit (`peerlog::PeerSites`): peers are
/// spread over this many, so all peers together write at most this many
/// times `PEER_LOG_LINES_PER_WINDOW` lines a window however many
/// addresses they send from.
pub const PEER_LOG_KEYED_SITES: usize = 16;

/// Tokens one admin token file may hold: the current one, the one being
/// rotated out, and room for a few clients of their own.
pub const ADMIN_TOKENS_MAX: usize = 16;
/// A token file is read whole; more than this is not a token file.
pub const ADMIN_TOKEN_FILE_BYTES_MAX: u64 = 64 << 10;
/// Random bytes of a generated admin token: 256 bits, written as 64 hex
/// digits.
pub const ADMIN_TOKEN_RANDOM_BYTES: usize = 32;
/// The token file is looked at (stat) at most this often for changes, so
/// a flood of requests costs no file system work; a rotated token works
/// within this.
pub const ADMIN_TOKEN_RECHECK_MS: u64 = 1_000;

/// Outstanding Asynchronous Event Requests per controller (AERL + 1).
pub const AER_MAX: usize = 4;
/// Error log entries kept per controller (ELPE + 1).
pub const ERROR_LOG_ENTRIES: usize = 64;

/// Keep-alive timeout granularity advertised in Identify KAS, 100 ms units.
pub const KAS_100MS: u16 = 10;
/// A discovery controller connected with KATO 0 still expires after this long
/// idle, so forgotten discovery connections do not pile up.
pub const DISCOVERY_IDLE_TIMEOUT_MS: u64 = 120_000;
/// Largest KATO a host may ask for (1 hour).
pub const KATO_MAX_MS: u32 = 3_600_000;
/// The handshake deadline: a connection must have finished ICReq/ICResp
/// (TCP) and a successful Fabrics Connect within this long of being
/// adopted by its reactor (and a queue whose host has DH-HMAC-CHAP keys
/// must have authenticated within this long of its creation), or it is closed and its place under
/// `CONNECTIONS_MAX` freed, so sockets that never finish (idle, or
/// stopped half way) cannot hold the limit. A host does both in a round
/// trip or two; 10 s leaves room for a loaded host and a slow network.
/// Checked by the reactor's tick (`TICK_MS`), never per I/O; tests set a
/// shorter one with `Target::set_handshake_timeout_ms`.
pub const HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// How often reactors check keep-alive deadlines and deliver async events.
pub const TICK_MS: u64 = 50;
/// On SIGTERM, in-flight commands get this long to complete.
pub const SHUTDOWN_DRAIN_MS: u64 = 10_000;

/// Provided buffers of a reactor's multishot receives (one buffer ring per
/// reactor, shared by its connections), and their size. A completion holds
/// one until its bytes are parsed, in the same loop iteration, so this
/// bounds how many receives can complete between two iterations; when all
/// are taken a connection's receive ends (ENOBUFS) and is armed again once
/// they are back. 256 × 32 KiB = 8 MiB per reactor, an eighth of its data
/// buffer budget; 32 KiB takes a burst of small commands or a good part of
/// an MDTS H2CData PDU in one completion.
pub const RECV_BUF_COUNT: u16 = 256;
pub const RECV_BUF_BYTES: u32 = 32 << 10;
/// How long a reactor that had work in its last iteration may watch its
/// completion queue before it sleeps in the kernel (`--reactor-spin-us`,
/// `Target::set_reactor_spin_us`). Off by default: measured on a 2-core
/// host shared with the load generator, a 20 µs spin doubled the target
/// CPU per 4K read at QD32 and the QD1 latency, because every microsecond
/// spun is taken from the peer. On cores given to the reactors alone, 20
/// saves the sleep and wake-up (a few µs each) at queue depth. A spin that
/// keeps finding nothing backs off (reactor.rs), and an idle reactor
/// always sleeps, interrupt-driven.
pub const REACTOR_SPIN_US_DEFAULT: u64 = 0;
/// The longest spin one may set: beyond it a sleep and wake-up cost less.
pub const REACTOR_SPIN_US_MAX: u64 = 100;

/// io_uring entries per reactor. Completions beyond what the ring holds wait
/// in a bounded backlog rather than overflowing the completion queue.
pub const RING_ENTRIES: u32 = 1024;

/// Namespaces per subsystem (Identify NN).
pub const NAMESPACES_PER_SUBSYS_MAX: u32 = 1024;

/// The one ANA group of a subsystem with ANA: every namespace is in it
/// (Identify ANAGRPMAX and NANAGRPID are 1).
pub const ANA_GROUP_ID: u32 = 1;
/// ANA Transition Time (Identify ANATT), seconds: longest a group stays in
/// the change state. The Linux host resets the controller after twice
/// this; nvmet says 10 too.
pub const ANA_TRANSITION_TIME_S: u8 = 10;
/// Identify MNAN of an ANA subsystem: NN, as the host requires 1..=NN.
/// The whole ANA log (one group, MNAN NSIDs) is what the Linux host reads
/// in one command; it must fit MDTS or the host disables ANA.
pub const ANA_MNAN: u32 = NAMESPACES_PER_SUBSYS_MAX;
/// Bytes of the largest ANA log: header, one descriptor, MNAN NSIDs.
pub const ANA_LOG_BYTES_MAX: u64 = nvpool_wire::log::ana_log_len(1, ANA_MNAN as u64);
/// Longest lease one renewal grants (`POST /v1/leases`): a renewer that
/// stops renewing loses its serving state within this.
pub const LEASE_VALID_MAX_MS: u64 = 60_000;
/// Subsystem NQNs one lease renewal may name.
pub const LEASE_RENEW_NQNS_MAX: usize = SUBSYSTEMS_MAX;
/// Subsystems per target.
pub const SUBSYSTEMS_MAX: usize = 4096;
/// Allowed host NQNs per subsystem.
pub const HOSTS_PER_SUBSYS_MAX: usize = 4096;

/// Between heartbeats to the control plane. The control plane marks a
/// target offline after 15 s without one (its `HEARTBEAT_TIMEOUT_MS`), so
/// two heartbeats can be lost before hosts see a flap.
pub const HEARTBEAT_INTERVAL_MS: u64 = 5_000;
/// One request to the control plane, connect to last byte. Shorter than a
/// heartbeat interval so a hung control plane delays at most one beat, and
/// bounds how long shutdown waits for a request in flight.
pub const CONTROL_PLANE_REQUEST_TIMEOUT_MS: u64 = 4_000;
/// First retry after a failed registration; doubles per failure (with
/// jitter) up to the maximum, so a fleet does not hammer a control plane
/// that is coming back.
pub const REGISTER_BACKOFF_MIN_MS: u64 = 1_000;
pub const REGISTER_BACKOFF_MAX_MS: u64 = 30_000;
/// Failed registrations and heartbeats are logged at most this often (the
/// count of the ones in between is logged with the next line).
pub const CONTROL_PLANE_FAILURE_LOG_INTERVAL_MS: u64 = 60_000;

/// Copy jobs (resync of a stale extent copy) known at once, armed, running
/// or finished and not yet deleted by the control plane. Each holds an open
/// destination file and a guard bitmap (see `COPY_GUARD_MEMORY_BUDGET_BYTES`);
/// a target holds a few dozen extents, so more than this many concurrent
/// resyncs means something is leaking jobs.
pub const COPIES_MAX: usize = 32;
/// Copiers running at once. Each streams a whole extent from another target
/// and writes it to local disks that also serve hosts; two keep resync
/// moving without starving foreground I/O. Further started jobs wait.
pub const COPIES_RUNNING_MAX: usize = 2;
/// The copier's read and write unit: one MDTS, the largest read one NVMe/TCP
/// command may carry, so a chunk is one command.
pub const COPY_CHUNK_BYTES: usize = MDTS_BYTES;
/// Source reads a copier keeps in flight: enough to hide a network round
/// trip behind the local write of the previous chunk; bounds its buffers
/// (this many chunks).
pub const COPY_READS_IN_FLIGHT: usize = 4;
/// Granularity of the copy guard's host-written map: the smallest logical
/// block a namespace may have (512 or 4096). Any namespace's writes then
/// cover whole units, so a unit marked written was wholly overwritten by a
/// host and the copier may skip it.
pub const COPY_GUARD_UNIT_BYTES: u64 = 512;
/// Largest destination range of one copy job: the control plane's largest
/// extent (`EXTENT_BYTES_MAX`, 64 GiB; 1 GiB is the default). Its guard map
/// is one bit per unit: 16 MiB at this size.
pub const COPY_DEST_BYTES_MAX: u64 = 64 << 30;
/// What the guard maps of all known copy jobs together may cost: arming a
/// job that would pass it is refused (409) until others are deleted. Room
/// for `COPIES_MAX` jobs of 1 GiB extents (256 KiB each) many times over,
/// or eight of the largest.
pub const COPY_GUARD_MEMORY_BUDGET_BYTES: u64 = 128 << 20;
/// Regions of a copy job (the unit hosts record missed writes in) must be
/// whole 4 KiB pages (O_DIRECT alignment of every chunk) and at most this
/// large (the control plane uses 1 MiB).
pub const COPY_REGION_BYTES_MAX: u64 = 1 << 30;
/// A copier gives up on an unreachable source after this long (the
/// initiator's controller-loss timeout), like mirrored host I/O does: a
/// dead source fails the job in seconds and the control plane retries.
pub const COPY_SOURCE_LOSS_TIMEOUT_MS: u64 = 5_000;
/// Waits of a copier (rate limit, completions) are sliced to this, so a
/// cancelled job stops within about this long.
pub const COPY_CANCEL_POLL_MS: u64 = 20;
/// The rate limiter's bucket holds this much time's worth of bytes (at least
/// one chunk), so a throttled copy sends evenly instead of in bursts.
pub const COPY_RATE_BURST_MS: u64 = 100;
/// Length of a copy job id (the control plane uses UUIDs).
pub const COPY_ID_LEN_MAX: usize = 128;
/// While a host write waits for a copier's claim to be released, the
/// reactor polls at least this often; a claim lasts one chunk write.
pub const PARKED_RETRY_MS: u64 = 1;

/// Threads of the executor that runs the volume engine's calls for every
/// volume namespace of a target. A task is first polled by the reactor
/// that issues it and usually finished by the engine's I/O thread that
/// completes it, so these threads only take what those hand over.
pub const VOLUME_EXEC_THREADS: usize = 2;
/// Volume namespace operations in flight at once, across the target. Each
/// holds at most one transfer's buffer (a write's copied data or a read's
/// buffer, at most MDTS); beyond it an operation is refused with a status
/// the host retries, since a reactor never waits for room.
pub const VOLUME_IO_INFLIGHT_MAX: usize = 1024;
/// What those buffers may cost at most.
pub const VOLUME_IO_MEMORY_BUDGET_BYTES: usize = 128 << 20;
/// Deactivating a volume namespace waits this long for its I/O in flight
/// (like a shutdown drain); later, the volume closes when the I/O ends.
pub const VOLUME_DRAIN_MS: u64 = SHUTDOWN_DRAIN_MS;

/// Operations queued for one grain pool's thread (design/thin-snapshots.md
/// T3); beyond it an operation is refused with a status the host retries.
pub const THIN_QUEUE_LEN: usize = 1024;
/// A grain pool commits what plain writes changed at most this long after
/// its last commit (flushes and FUA writes commit at once).
pub const THIN_COMMIT_INTERVAL_MS: u64 = 100;

const _: () = assert!(VOLUME_IO_INFLIGHT_MAX * MDTS_BYTES <= VOLUME_IO_MEMORY_BUDGET_BYTES);
// One full I/O queue at MDTS fits a reactor's buffer budget: a connection
// alone never waits for buffers its own commands hold.
const _: () = assert!(IO_QUEUE_ENTRIES_MAX as usize * MDTS_BYTES <= REACTOR_BUF_BUDGET_BYTES);
const _: () = assert!(REACTOR_BUF_BUDGET_BYTES.is_multiple_of(POOL_BUF_BYTES));
const _: () = assert!(MDTS_BYTES <= POOL_BUF_BYTES && CMD_BUF_BYTES_MAX <= POOL_BUF_BYTES);
// What arrives with a command (in-capsule data) and the small transfers
// every command kind makes fit a slot's own buffer: they never wait.
const _: () = assert!(IO_INLINE_DATA_BYTES <= SLOT_BUF_BYTES_MAX);
const _: () = assert!(ADMIN_INLINE_DATA_BYTES <= SLOT_BUF_BYTES_MAX);
const _: () = assert!(nvpool_wire::identify::IDENTIFY_LEN <= SLOT_BUF_BYTES_MAX);
const _: () = assert!(SLOT_BUF_BYTES_MAX < POOL_BUF_BYTES);
const _: () = assert!(ZERO_OPS_PER_CMD_MAX >= 1);
const _: () = assert!(ZERO_WRITE_CHUNK_BYTES.is_multiple_of(4096));
const _: () = assert!(ZERO_WRITE_CHUNK_BYTES / 512 <= u16::MAX as usize);
const _: () = assert!(PEER_LOG_LINES_PER_WINDOW >= 1 && PEER_LOG_WINDOW_MS >= 1);
const _: () = assert!(PEER_LOG_KEYED_SITES >= 1);
const _: () = assert!(
    ADMIN_TOKEN_RANDOM_BYTES * 2 >= nvpool_api::rest::SECRET_BYTES_MIN
        && ADMIN_TOKEN_RANDOM_BYTES * 2 <= nvpool_api::rest::SECRET_BYTES_MAX
);
const _: () = assert!(
    ADMIN_TOKENS_MAX as u64 * (nvpool_api::rest::SECRET_BYTES_MAX as u64 + 1)
        <= ADMIN_TOKEN_FILE_BYTES_MAX
);
const _: () = assert!(CONTROL_PLANE_REQUEST_TIMEOUT_MS < HEARTBEAT_INTERVAL_MS);
const _: () = assert!(REGISTER_BACKOFF_MIN_MS <= REGISTER_BACKOFF_MAX_MS);
const _: () = assert!(RX_BUF_BYTES >= MAXH2CDATA_BYTES as usize + 72 + 8);
const _: () = assert!(RX_BUF_BYTES >= IO_INLINE_DATA_BYTES + 72 + 8);
const _: () = assert!(IO_INLINE_DATA_BYTES <= MDTS_BYTES);
const _: () = assert!(ADMIN_INLINE_DATA_BYTES <= CMD_BUF_BYTES_MAX);
const _: () = assert!(MAXH2CDATA_BYTES >= 4096 && MAXH2CDATA_BYTES.is_multiple_of(4));
const _: () = assert!(IO_QUEUE_ENTRIES_MAX >= 128);
const _: () = assert!(COPY_CHUNK_BYTES <= MDTS_BYTES);
const _: () = assert!((COPY_CHUNK_BYTES as u64).is_multiple_of(COPY_GUARD_UNIT_BYTES));
const _: () = assert!(COPIES_RUNNING_MAX <= COPIES_MAX);
const _: () =
    assert!(COPY_DEST_BYTES_MAX / COPY_GUARD_UNIT_BYTES / 8 <= COPY_GUARD_MEMORY_BUDGET_BYTES);
const _: () = assert!(
    COPIES_MAX as u64 * ((1 << 30) / COPY_GUARD_UNIT_BYTES / 8) <= COPY_GUARD_MEMORY_BUDGET_BYTES
);
const _: () =
    assert!(COPY_DEST_BYTES_MAX / COPY_GUARD_UNIT_BYTES <= crate::sync::SYNC_GUARD_UNITS_MAX);
const _: () = assert!(PARKED_RETRY_MS < TICK_MS);
const _: () = assert!(TICK_MS < HANDSHAKE_TIMEOUT_MS);
// The completion queue (2 × RING_ENTRIES) holds one completion per
// provided buffer beside one per operation in flight; a buffer ring's size
// is a power of two.
const _: () = assert!((RECV_BUF_COUNT as u32) < RING_ENTRIES);
const _: () = assert!(RECV_BUF_COUNT.is_power_of_two());
const _: () =
    assert!(RECV_BUF_COUNT as usize * RECV_BUF_BYTES as usize <= REACTOR_BUF_BUDGET_BYTES / 8);
const _: () = assert!(REACTOR_SPIN_US_MAX * 1000 < TICK_MS * 1_000_000);
const _: () = assert!(ANA_MNAN >= 1 && ANA_MNAN <= NAMESPACES_PER_SUBSYS_MAX);
const _: () = assert!(ANA_LOG_BYTES_MAX <= MDTS_BYTES as u64);
const _: () = assert!(ANA_LOG_BYTES_MAX <= CMD_BUF_BYTES_MAX as u64);

/// Longest a subsystem removal waits for the connections of its
/// controllers to close and their commands to complete (the fence of
/// C19): a backend I/O that takes longer is stuck.
pub const FENCE_WAIT_MS: u64 = 10_000;
