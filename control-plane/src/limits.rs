//! Every limit of the control plane, named, with its unit last and its reason.

/// Allocation unit of device space. Volumes are built from extents of one
/// fixed size: placement then never fragments a device into unusable
/// slivers, a freed extent fits any later volume, and a volume record stays
/// small (a 1 TiB mirror is 2048 extents). 1 GiB is small enough that the
/// rounding waste of a volume is negligible and large enough that a
/// many-terabyte volume needs only thousands of extents. Each volume records
/// the extent size it was created with, so changing the default later
/// leaves existing volumes readable.
pub const EXTENT_BYTES: u64 = 1 << 30;

// The limits a volume's layout is checked against (extent sizes, block and
// stripe sizes, copies, extents per volume) are shared with hosts, which
// check received plans against them: `nvpool-layout` owns them.
pub use nvpool_layout::limits::{
    BLOCK_BYTES, COPIES_MAX, COPIES_MIN, EXTENTS_PER_VOLUME_MAX, EXTENT_BYTES_MAX,
    EXTENT_BYTES_MIN, STRIPE_BYTES_MIN, STRIPE_WIDTH_MAX,
};

/// Target, device and pool identifiers. They appear in store keys and in
/// every extent of a volume record, so they are short; a UUID (36 bytes)
/// fits with room to spare.
pub const ID_BYTES_MAX: usize = 64;
/// Human names of targets and volumes.
pub const NAME_BYTES_MAX: usize = 128;
/// Labels per target or device (host, rack, zone, class…).
pub const LABELS_MAX: usize = 16;
/// Label keys and values: 63 bytes, like Kubernetes label values.
pub const LABEL_BYTES_MAX: usize = 63;
/// Backend spec of a device (`file:/dev/disk/by-id/…`): a path, bounded.
pub const BACKEND_SPEC_BYTES_MAX: usize = 512;
/// Devices one target may register: a 2U server holds 24 NVMe drives,
/// some hold 36; 64 leaves room for partitions.
pub const DEVICES_PER_TARGET_MAX: usize = 64;
/// Targets in one cluster. Every mutation reads the whole cluster state
/// (one consistent snapshot), so the cluster's size is bounded.
pub const TARGETS_MAX: usize = 1024;
/// A device's capacity: 256 TiB, beyond the largest NVMe drives of 2026
/// (245 TB). Bounded so that a cluster's totals fit in a u64 (below); the
/// sums saturate besides, so a bound raised carelessly shows a capped
/// total rather than a wrapped one.
pub const DEVICE_BYTES_MAX: u64 = 1 << 48;
const _: () = assert!(
    (TARGETS_MAX as u128) * (DEVICES_PER_TARGET_MAX as u128) * (DEVICE_BYTES_MAX as u128)
        <= 1u128 << 64
);
/// The space placement sees on a grain pool (`thin:` device), whatever its
/// real capacity: an extent there is a tree that takes no space until
/// written, so a pool may promise more than it holds (over-commit; the
/// real use is what targets report). 1 PiB: four times `DEVICE_BYTES_MAX`,
/// room for many volumes larger than the drive, and still a multiple of
/// every extent size, so the allocator's first fit keeps its alignment.
/// Capacity sums keep counting real bytes, not this.
pub const GRAIN_POOL_VIRTUAL_BYTES: u64 = 1 << 50;
const _: () = assert!(GRAIN_POOL_VIRTUAL_BYTES.is_multiple_of(EXTENT_BYTES_MAX));
// A tree of a grain pool is named by its extent's offset in these units:
// extents (powers of two from the smallest) sit at multiples of their
// size, so every extent names a tree of its own.
const _: () = assert!(EXTENT_BYTES_MIN.is_multiple_of(nvpool_api::admin::THIN_ROOT_UNIT_BYTES));
/// Pools in one cluster.
pub const POOLS_MAX: usize = 256;
/// Devices named by one pool: every device of `TARGETS_MAX` targets at a
/// typical 16 devices each.
pub const DEVICES_PER_POOL_MAX: usize = 16384;
/// Volumes in one cluster.
pub const VOLUMES_MAX: usize = 65536;

/// A call that changes a served volume's ANA state on a target: leaving
/// a serving state waits there for the I/O in flight (at most 10 s).
pub const ANA_CHANGE_TIMEOUT_MS: u64 = 15_000;

/// Hosts a served volume's subsystem admits (its ACL on every path).
pub const HOSTS_PER_SERVED_VOLUME_MAX: usize = 256;

/// Namespaces of one host's subsystem on one target: each attached extent
/// is one. Matches the target's per-subsystem namespace limit.
pub const NAMESPACES_PER_HOST_TARGET_MAX: usize = 1024;

/// One call to a target's admin API (a namespace opens a file: quick), so
/// an attach to a dead target fails in seconds, not minutes.
pub const TARGET_CALL_TIMEOUT_MS: u64 = 5_000;

/// Targets changed at once when a host's DH-HMAC-CHAP keys change (one
/// thread each): a rollout over a large cluster takes
/// ⌈targets / this⌉ rounds, each bounded by the calls' timeout.
pub const HOST_KEY_ROLLOUT_PARALLEL: usize = 16;

/// How often every online target is reconciled against the attachment
/// records (besides right after it registers).
pub const RECONCILE_INTERVAL_MS: u64 = 30_000;

/// Finished copies kept per volume for `nvpool volume history`: enough to
/// see a day of flapping, small enough to keep the record one store value.
pub const COPY_HISTORY_MAX: usize = 64;
/// How often the heal loop looks for stale copies and moves jobs on; a
/// copy's progress is polled this often too.
pub const HEAL_INTERVAL_MS: u64 = 2_000;
/// The heal loop's interval while copy jobs run: each step of a job (and
/// seeing its copy done) waits for a round, so rounds come quickly then.
/// A round reads the store and asks each running job's target once.
pub const HEAL_BUSY_INTERVAL_MS: u64 = 200;
/// Copy jobs whose destination is one target, at once: each runs a copier
/// thread there and reads a source over the network; two keep a target's
/// disk busy without starving its clients.
pub const COPIES_PER_TARGET_MAX: usize = 2;
/// How long hosts have to confirm they mirror to a copy before its job is
/// given up (and retried later): a host that cannot be reached blocks the
/// copy, never corrupts it, and never blocks it for ever.
pub const MIRROR_CONFIRM_TIMEOUT_MS: u64 = 60_000;
/// After a job on a copy failed, wait this long before trying again.
pub const RESYNC_RETRY_MS: u64 = 10_000;

/// How long a target may be gone (no heartbeat) before the control plane
/// replaces its copies elsewhere rather than waiting to resync them in
/// place; the usual grace period of replicated block stores.
pub const REPLACE_AFTER_MS: u64 = 600_000;
/// Default copy rate per job (`--rebuild-rate`): about a third of one NVMe
/// drive's bandwidth, so client I/O keeps most of it.
pub const REBUILD_RATE_BYTES_PER_SEC: u64 = 256 << 20;

/// A target whose last heartbeat is older than this is offline: placement
/// skips it and the volumes with extents on it are degraded or offline.
/// Three missed heartbeats, so one lost packet or a slow control-plane
/// write does not flap a target.
pub const HEARTBEAT_TIMEOUT_MS: u64 = 15_000;
/// How often targets are expected to heartbeat.
pub const HEARTBEAT_INTERVAL_MS: u64 = 5_000;

/// Attempts of one read → compute → compare-and-swap operation before it
/// gives up with `Contention`. Every conflict means another mutation
/// committed, so the system as a whole progresses; 32 losses in a row only
/// happen under a pathological write storm.
pub const TXN_ATTEMPTS_MAX: u32 = 32;
/// Backoff before the second attempt: up to this long (random), doubling
/// per attempt. A commit takes about a millisecond (one fsync), so 0.5 ms
/// spreads two colliding writers apart.
pub const TXN_BACKOFF_BASE_US: u64 = 500;
/// Backoff cap: 32 attempts then take at most about 1.5 s in total, which
/// a REST client will wait for.
pub const TXN_BACKOFF_MAX_US: u64 = 50_000;

/// Store keys. etcd allows more, but our keys are a prefix and an ID.
pub const KEY_BYTES_MAX: usize = 512;
/// One store value: etcd's default request limit (`--max-request-bytes`,
/// 1.5 MiB), so a volume record is one value there too.
pub const VALUE_BYTES_MAX: usize = 3 << 19;
/// Keys and values written by one transaction. An etcd backend must run with
/// `--max-request-bytes` above this (4 MiB, say).
pub const TXN_BYTES_MAX: usize = 2 << 20;
/// Operations (puts and deletes) in one transaction: etcd's `--max-txn-ops`
/// default.
pub const TXN_OPS_MAX: usize = 128;
/// Conditions in one transaction (same bound as operations).
pub const TXN_CONDITIONS_MAX: usize = 128;

/// Revisions kept in the change log for watchers (`changes_since`). A
/// watcher polling once a second falls behind only after this many
/// mutations in between; it then re-lists.
pub const CHANGE_LOG_REVISIONS_MAX: u64 = 10_000;
/// Bytes of keys and values kept in the change log, so a burst of large
/// volume records cannot make the log unbounded in size.
pub const CHANGE_LOG_BYTES_MAX: u64 = 64 << 20;

/// Endpoints of one etcd store URL: etcd clusters have 3, 5 or 7 members;
/// 16 leaves room for listing client-facing proxies too.
pub const ETCD_ENDPOINTS_MAX: usize = 16;
/// The key prefix of one cluster in a shared etcd (`/nvpool`): a short path.
/// Every etcd key is this plus a store key, so keys stay within etcd's
/// limits with room to spare.
pub const ETCD_PREFIX_BYTES_MAX: usize = 128;
/// Every request to etcd (a get, one page of a list, a transaction, a
/// watch read of `changes_since`) ends within this, retries included: long
/// enough to ride out an etcd leader election (1 s with etcd's default
/// election timeout) and a failover to another endpoint, short enough that
/// a REST client hears 503 instead of hanging when etcd lost its quorum.
pub const ETCD_REQUEST_TIMEOUT_MS: u64 = 5_000;
/// One attempt of a read: an endpoint that hangs (a stopped process, a
/// partition) is given up for another after this, within the request's
/// deadline. Writes get no second attempt unless the first surely never
/// reached etcd (connection refused, no leader), so they have no attempt
/// timeout of their own.
pub const ETCD_READ_ATTEMPT_TIMEOUT_MS: u64 = 2_000;
/// Connecting to one etcd endpoint: loopback or a LAN answers in
/// milliseconds; a dead host is skipped after this.
pub const ETCD_CONNECT_TIMEOUT_MS: u64 = 1_000;
/// TCP keep-alive on etcd connections, so that an idle connection to a
/// vanished host is found dead. Not HTTP/2 pings: etcd answers pings more
/// often than every 5 s (its `--grpc-keepalive-min-time`), or any while no
/// request is open, by closing the connection, which fails the requests on
/// it. A member that hangs is left by the read attempt timeout instead.
pub const ETCD_TCP_KEEPALIVE_MS: u64 = 5_000;
/// Waits between retries of one request: from the minimum, doubling, to the
/// maximum; a leader election takes about a second.
pub const ETCD_RETRY_BACKOFF_MIN_MS: u64 = 10;
pub const ETCD_RETRY_BACKOFF_MAX_MS: u64 = 250;
/// Keys per page of a list: a page of the largest values still fits one
/// response (below), and a cluster of small records lists in few round trips.
pub const ETCD_LIST_PAGE_KEYS: usize = 64;
/// Times a list starts again when etcd compacted the revision it was
/// reading between two pages (rare: compaction runs every few minutes).
pub const ETCD_LIST_RESTARTS_MAX: u32 = 3;
/// One gRPC message from etcd: a full page of a list, or one fragment of a
/// watch response (etcd splits those at its `--max-request-bytes`, which an
/// etcd for nvpool sets to a few MiB, above `TXN_BYTES_MAX`).
pub const ETCD_RESPONSE_BYTES_MAX: usize = 128 << 20;

/// The leader's etcd lease: when the leader dies or is cut off, another
/// control plane takes over within this (plus one campaign interval).
pub const LEADER_LEASE_TTL_S: u32 = 5;
/// How often the leader renews its lease, and how often the others try to
/// take the leader key.
pub const LEADER_RENEW_INTERVAL_MS: u64 = 1_000;
pub const LEADER_CAMPAIGN_INTERVAL_MS: u64 = 1_000;
/// The leader stops acting this long before its lease could expire in
/// etcd (measured from when it sent the request that granted or renewed
/// the lease, so network delay only shortens its term): room for the
/// clock rates of two machines to differ and for a round of work that has
/// just checked it is still the leader.
pub const LEADER_MARGIN_MS: u64 = 1_500;
/// One election request (grant, campaign, renew): shorter than a renewal
/// interval's share of the lease, so a hung endpoint is left in time.
pub const LEADER_REQUEST_TIMEOUT_MS: u64 = 1_500;

/// Worst-case encoded size of one extent in a volume record: two IDs with
/// their length prefixes, offset and length as 10-byte varints, member and
/// row as 5-byte varints, the copy index as one byte.
pub const EXTENT_ENCODED_BYTES_MAX: usize = 2 * (1 + ID_BYTES_MAX) + 2 * 10 + 2 * 5 + 1;
/// Worst-case encoded size of a volume record without its extents: format
/// byte, UUID, name, pool ID, layout and a handful of varints.
pub const VOLUME_FIXED_ENCODED_BYTES_MAX: usize =
    1 + 17 + (2 + NAME_BYTES_MAX) + (2 + ID_BYTES_MAX) + 32 + 8 * 10;
/// Worst-case encoded size of a volume record.
pub const VOLUME_ENCODED_BYTES_MAX: usize =
    VOLUME_FIXED_ENCODED_BYTES_MAX + 5 + EXTENTS_PER_VOLUME_MAX as usize * EXTENT_ENCODED_BYTES_MAX;

const _: () = assert!(EXTENT_BYTES.is_power_of_two());
const _: () = assert!(EXTENT_BYTES >= EXTENT_BYTES_MIN && EXTENT_BYTES <= EXTENT_BYTES_MAX);
const _: () = assert!(HEARTBEAT_TIMEOUT_MS >= 3 * HEARTBEAT_INTERVAL_MS);
// A volume record always fits one store value, and its transaction (the
// record, its name-index key and the allocation epoch) fits one transaction.
const _: () = assert!(VOLUME_ENCODED_BYTES_MAX <= VALUE_BYTES_MAX);
const _: () = assert!(VALUE_BYTES_MAX + 4 * KEY_BYTES_MAX + 1024 <= TXN_BYTES_MAX);
// A page of the largest values fits one etcd response, with room for the
// per-key fields (revisions, lengths) of the protocol.
const _: () = assert!(
    ETCD_LIST_PAGE_KEYS * (VALUE_BYTES_MAX + KEY_BYTES_MAX + ETCD_PREFIX_BYTES_MAX + 64)
        <= ETCD_RESPONSE_BYTES_MAX
);
// A read gets at least two attempts within its request's deadline.
const _: () = assert!(2 * ETCD_READ_ATTEMPT_TIMEOUT_MS <= ETCD_REQUEST_TIMEOUT_MS);
const _: () = assert!(ETCD_CONNECT_TIMEOUT_MS < ETCD_READ_ATTEMPT_TIMEOUT_MS);
const _: () = assert!(ETCD_RETRY_BACKOFF_MIN_MS <= ETCD_RETRY_BACKOFF_MAX_MS);
// A leader renews several times per lease, each request ends before its
// term would, and the margin leaves it a real term.
const _: () = assert!(3 * LEADER_RENEW_INTERVAL_MS <= LEADER_LEASE_TTL_S as u64 * 1_000);
const _: () =
    assert!(LEADER_REQUEST_TIMEOUT_MS + LEADER_MARGIN_MS < LEADER_LEASE_TTL_S as u64 * 1_000);
// The newest transaction always survives trimming of the change log.
const _: () = assert!(CHANGE_LOG_BYTES_MAX >= 2 * TXN_BYTES_MAX as u64);

/// How long a snapshot waits for its volume's engines to confirm the
/// raised write epoch before it is given up (`Cluster::set_snapshot_confirm_wait_ms`).
pub const SNAPSHOT_CONFIRM_WAIT_MS: u64 = 30_000;

/// A snapshot still `creating`, or a clone still pending, this long after
/// it began was abandoned by whoever began it (the wait above and each
/// target call's timeout bound that work): the leader gives it up.
pub const SNAPSHOT_ABANDONED_MS: u64 = 120_000;
