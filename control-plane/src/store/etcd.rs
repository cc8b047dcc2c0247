//! The [`Store`] on etcd's v3 API, so that several control planes can share
//! one etcd; one etcd can also hold several clusters, each under its own key
//! prefix. Written for etcd 3.4 and later (Range, Txn, Watch and Compact,
//! nothing newer).
//!
//! What maps to what:
//!
//! | store | etcd |
//! |---|---|
//! | key `/targets/t1` | key `{prefix}/targets/t1` (prefix `/nvpool` by default) |
//! | a key's version | its `mod_revision` |
//! | the store revision | etcd's revision: shared by every key in that etcd, so it grows in steps of 1 or more |
//! | `VersionIs(k, v)` | `Compare(mod_revision(k) = v)` |
//! | `Missing(k)` | `Compare(version(k) = 0)` |
//! | `Put`, `Delete` | `Put`, `DeleteRange` of that one key |
//! | `txn` | one `Txn`: the compares; the ops as its success branch; as its failure branch a keys-only `Range` of each condition's key, so a conflict names every failed condition with the version etcd saw |
//! | `get`, `revision` | a linearizable `Range` |
//! | `list(p)` | `Range` over `{prefix}{p}`, [`ETCD_LIST_PAGE_KEYS`] keys a page, every page at the first page's revision |
//! | `changes_since(r)` | a `Watch` from revision `r` (below) |
//!
//! **`changes_since`.** It reads the current revision `c` (a linearizable
//! read), then watches *every* key from revision `r` and keeps the events
//! under the prefix with revisions in `(r, c]`, until an event at or past
//! `c` has arrived. Every etcd revision is made by at least one put or
//! delete, so such an event always comes; watching only the prefix would
//! leave no way to know that the last change under it has arrived (a watch
//! says nothing when nothing matches, and etcd 3.4's progress request may
//! answer before older events). etcd delivers a revision's events together
//! and in the order of the transaction's ops; watch responses split in
//! fragments (etcd's `fragment` flag) are read to the last fragment before
//! stopping. The watch starts at `r` rather than `r + 1` so that etcd
//! refuses it exactly when `r` is older than its compaction: that answers
//! `Compacted`. The answer is held to the same history limits as the
//! embedded stores ([`HistoryLimits`]: oldest revisions trimmed first), so a
//! watcher far behind re-lists on every backend alike. The costs: other
//! clusters' changes in a shared etcd are read too (etcd auth restricted to
//! the prefix would need a different scheme), and etcd serves a watch that
//! starts in the past from a loop that runs every 100 ms, so a call that
//! has changes to return takes up to that long (one with none returns after
//! the revision read).
//!
//! **Deadlines and failover.** The store is synchronous; it calls etcd on a
//! small tokio runtime of its own (one worker thread), from the caller's
//! thread, which must not be an async task (the REST layer runs store calls
//! on blocking threads). Every request to etcd ends within
//! [`ETCD_REQUEST_TIMEOUT_MS`]. The client balances over all endpoints of
//! the URL and asks etcd to refuse requests on a member without a leader
//! (`require_leader`). Reads are retried on any unavailability (another
//! endpoint, or the same one after an election) until the deadline, each
//! attempt at most [`ETCD_READ_ATTEMPT_TIMEOUT_MS`]. A transaction is
//! retried only when it surely never reached etcd (the connection was
//! refused, or the member had no leader and refused it before acting);
//! otherwise — a connection lost mid-request, a timeout — it fails with
//! [`StoreError::Unavailable`] and may or may not have been applied, which
//! the layers above handle by reading again. One such case: a write that
//! reaches a follower just after its leader died waits inside etcd (the
//! proposal forwarded to the dead leader is lost, and etcd does not send it
//! again) until the deadline; reads ride out the election, and once one has
//! succeeded a leader exists. With the quorum lost, calls fail with
//! `Unavailable` within the deadline, and work again once it is back, with
//! the same store. The connections carry no HTTP/2 pings (etcd closes a
//! connection that pings too often, failing its requests); TCP keep-alive
//! finds a vanished host.
//!
//! **Compaction** is etcd's, configured on etcd (e.g.
//! `--auto-compaction-mode=revision --auto-compaction-retention=10000`);
//! the store never compacts (other clusters may share the etcd), and
//! without compaction etcd's history grows until its space quota is hit.
//!
//! **TLS** (`etcds://`): the servers' certificates are checked against the
//! given CA only; a client certificate and key are presented when given.

use super::{
    check_history, failed_conditions, validate_txn, Campaign, Change, Condition, Elector,
    HistoryLimits, KeyValue, Listing, Op, Revision, Store, StoreError, TxnOutcome, LEADER_KEY,
};
use crate::limits::{
    ETCD_CONNECT_TIMEOUT_MS, ETCD_LIST_PAGE_KEYS, ETCD_LIST_RESTARTS_MAX,
    ETCD_READ_ATTEMPT_TIMEOUT_MS, ETCD_REQUEST_TIMEOUT_MS, ETCD_RESPONSE_BYTES_MAX,
    ETCD_RETRY_BACKOFF_MAX_MS, ETCD_RETRY_BACKOFF_MIN_MS, ETCD_TCP_KEEPALIVE_MS,
    LEADER_REQUEST_TIMEOUT_MS,
};
use crate::store::url::EtcdUrl;
use etcd_client::proto::{PbKeyValue, PbTxnOpResponse};
use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, GetOptions, Identity, KvClient,
    PutOptions, TlsOptions, Txn, TxnOp, WatchClient, WatchOptions,
};
use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::time::{Duration, Instant};

/// How to reach the etcd of a store.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    pub url: EtcdUrl,
    /// Required for `etcds://`, refused for `etcd://`.
    pub tls: Option<EtcdTls>,
    /// How much history `changes_since` serves (the embedded stores' default).
    pub history: HistoryLimits,
}

impl EtcdConfig {
    pub fn new(url: EtcdUrl) -> EtcdConfig {
        EtcdConfig {
            url,
            tls: None,
            history: HistoryLimits::default(),
        }
    }
}

/// TLS material, PEM encoded.
#[derive(Clone)]
pub struct EtcdTls {
    /// The CA certificate(s) that sign the etcd servers' certificates.
    pub ca_pem: Vec<u8>,
    /// A client certificate and its key, for an etcd that requires them.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key.
        f.debug_struct("EtcdTls")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field("client_certificate", &self.client.is_some())
            .finish()
    }
}

/// A [`Store`] in etcd. See the module documentation.
pub struct EtcdStore {
    /// `Some` until dropped.
    runtime: Option<tokio::runtime::Runtime>,
    client: Client,
    kv: KvClient,
    watch: WatchClient,
    url: EtcdUrl,
    /// `etcd at h1:2379,h2:2379`.
    name: String,
    limits: HistoryLimits,
}

impl fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdStore")
            .field("url", &self.url.to_string())
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        // Without waiting for the runtime's tasks (connections), and
        // without panicking should the store be dropped inside another
        // runtime.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Why one attempt of a request failed.
enum Failure {
    /// It surely did not reach etcd, or etcd refused it before acting:
    /// sending it again is safe, even for a write.
    NotSent(String),
    /// etcd could not answer it; a write may or may not have happened.
    Unavailable(String),
    /// etcd answered with an error (a bad request, a permission…).
    Refused(etcd_client::Error),
}

/// Which requests may be sent again after a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// Reads: after any unavailability, each attempt within its own timeout.
    Reads,
    /// Writes: only when the request surely never reached etcd.
    Writes,
}

/// An error's message and, when it has sources, the innermost one's: the
/// cause a reader needs (`tcp connect error: Connection refused`), without
/// the layers in between.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut root = None;
    let mut source = e.source();
    while let Some(s) = source {
        root = Some(s);
        source = s.source();
    }
    match root.map(|r| r.to_string()) {
        Some(cause) if !cause.is_empty() => format!("{e}: {cause}"),
        _ => e.to_string(),
    }
}

/// A gRPC status as a reason: its message (tonic's `Display` of a status
/// also prints its code and the source's debug form) and its root cause.
fn status_reason(status: &tonic::Status) -> String {
    let mut root = None;
    let mut source = std::error::Error::source(status);
    while let Some(s) = source {
        root = Some(s);
        source = s.source();
    }
    let message = status.message();
    match root.map(|r| r.to_string()) {
        Some(cause) if !cause.is_empty() && cause != message => format!("{message}: {cause}"),
        _ => message.to_owned(),
    }
}

fn classify(e: etcd_client::Error) -> Failure {
    use tonic::Code;
    match e {
        etcd_client::Error::GRpcStatus(status) => {
            let reason = status_reason(&status);
            match status.code() {
                Code::Unavailable => {
                    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&status);
                    let mut connect = false;
                    while let Some(s) = source {
                        connect |= s.is::<tonic::ConnectError>();
                        source = s.source();
                    }
                    // etcd's answer when `require_leader` finds no leader:
                    // refused before anything was proposed.
                    if connect || status.message() == "etcdserver: no leader" {
                        Failure::NotSent(reason)
                    } else {
                        Failure::Unavailable(reason)
                    }
                }
                Code::DeadlineExceeded | Code::Cancelled | Code::Unknown | Code::Internal => {
                    Failure::Unavailable(reason)
                }
                _ => Failure::Refused(etcd_client::Error::GRpcStatus(status)),
            }
        }
        etcd_client::Error::TransportError(t) => Failure::Unavailable(error_chain(&t)),
        etcd_client::Error::IoError(io) => Failure::Unavailable(error_chain(&io)),
        etcd_client::Error::WatchError(w) => Failure::Unavailable(w),
        other => Failure::Refused(other),
    }
}

fn revision_of(what: &str, r: i64) -> Result<Revision, StoreError> {
    u64::try_from(r).map_err(|_| StoreError::Corrupt(format!("etcd sent {what} {r}")))
}

/// The first key after every key starting with `prefix` (etcd's range end
/// of a prefix). Keys are UTF-8, so no byte is 0xff.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// The changes of a `changes_since` answer, trimmed like the embedded
/// stores' change log: oldest revisions first, while more than the limits.
struct History {
    limits: HistoryLimits,
    revisions: VecDeque<(Revision, Vec<Change>)>,
    bytes: u64,
    /// The newest revision trimmed.
    trimmed: Option<Revision>,
}

impl History {
    fn new(limits: HistoryLimits) -> History {
        History {
            limits,
            revisions: VecDeque::new(),
            bytes: 0,
            trimmed: None,
        }
    }

    fn push(&mut self, change: Change) {
        self.bytes += change.history_bytes();
        match self.revisions.back_mut() {
            Some((r, changes)) if *r == change.revision => changes.push(change),
            _ => self.revisions.push_back((change.revision, vec![change])),
        }
        while self
            .limits
            .exceeded(self.revisions.len() as u64, self.bytes)
        {
            let (r, changes) = self
                .revisions
                .pop_front()
                .expect("more than one revision is held");
            self.bytes -= changes.iter().map(Change::history_bytes).sum::<u64>();
            self.trimmed = Some(r);
        }
    }

    fn finish(self, requested: Revision) -> Result<Vec<Change>, StoreError> {
        match self.trimmed {
            Some(compacted) => Err(StoreError::Compacted {
                requested,
                compacted,
            }),
            None => Ok(self.revisions.into_iter().flat_map(|(_, c)| c).collect()),
        }
    }
}

impl EtcdStore {
    /// Connects to etcd and checks that it answers (within the deadline):
    /// `Unavailable` if it does not.
    pub fn connect(config: EtcdConfig) -> Result<EtcdStore, StoreError> {
        let misconfigured = |what: &str| StoreError::Backend {
            op: "configure the etcd client",
            source: what.into(),
        };
        match (config.url.tls, &config.tls) {
            (true, None) => return Err(misconfigured("etcds:// needs a CA certificate")),
            (false, Some(_)) => {
                return Err(misconfigured(
                    "TLS settings are for etcds:// URLs, not etcd://",
                ))
            }
            _ => {}
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("nvpool-etcd")
            .enable_all()
            .build()
            .map_err(|e| StoreError::Backend {
                op: "start the etcd client's runtime",
                source: Box::new(e),
            })?;
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_millis(ETCD_CONNECT_TIMEOUT_MS))
            .with_tcp_keepalive(Duration::from_millis(ETCD_TCP_KEEPALIVE_MS))
            .with_require_leader(true);
        if let Some(tls) = &config.tls {
            let mut t = TlsOptions::new().ca_certificate(Certificate::from_pem(&tls.ca_pem));
            if let Some((cert, key)) = &tls.client {
                t = t.identity(Identity::from_pem(cert, key));
            }
            options = options.with_tls(t);
        }
        let endpoints = config.url.endpoint_urls();
        // Connections are made lazily, by the requests: this only sets up
        // the balanced channel.
        let client = runtime
            .block_on(async {
                tokio::time::timeout(
                    Duration::from_millis(ETCD_REQUEST_TIMEOUT_MS),
                    Client::connect(&endpoints, Some(options)),
                )
                .await
            })
            .map_err(|_| misconfigured("setting up the client took too long"))?
            .map_err(|e| StoreError::Backend {
                op: "configure the etcd client",
                source: Box::new(e),
            })?;
        let kv = client
            .kv_client()
            .max_decoding_message_size(ETCD_RESPONSE_BYTES_MAX);
        let watch = client
            .watch_client()
            .max_decoding_message_size(ETCD_RESPONSE_BYTES_MAX);
        let store = EtcdStore {
            runtime: Some(runtime),
            client,
            kv,
            watch,
            name: config.url.describe(),
            url: config.url,
            limits: config.history,
        };
        store.revision()?;
        Ok(store)
    }

    /// The etcd client, for what the store itself does not do (leases and
    /// a fencing condition for leader election, later). Call it on
    /// [`EtcdStore::runtime`].
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The runtime the client's connections live on.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        self.rt().handle()
    }

    /// This store's key prefix in etcd (`/nvpool`).
    pub fn prefix(&self) -> &str {
        &self.url.prefix
    }

    pub fn url(&self) -> &EtcdUrl {
        &self.url
    }

    fn rt(&self) -> &tokio::runtime::Runtime {
        self.runtime
            .as_ref()
            .expect("the runtime lives until the store is dropped")
    }

    /// The etcd key of a store key (which starts with `/`).
    fn etcd_key(&self, key: &str) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.url.prefix.len() + key.len());
        k.extend_from_slice(self.url.prefix.as_bytes());
        k.extend_from_slice(key.as_bytes());
        k
    }

    /// The store key of an etcd key, if it is one of this store's.
    fn store_key<'a>(&self, key: &'a [u8]) -> Option<&'a [u8]> {
        key.strip_prefix(self.url.prefix.as_bytes())
            .filter(|k| k.starts_with(b"/"))
    }

    fn key_value(&self, kv: &PbKeyValue) -> Result<KeyValue, StoreError> {
        let key = self
            .store_key(&kv.key)
            .and_then(|k| std::str::from_utf8(k).ok())
            .ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "etcd returned key {:?} outside {}",
                    String::from_utf8_lossy(&kv.key),
                    self.url.prefix
                ))
            })?;
        let version = revision_of("mod_revision", kv.mod_revision)?;
        if version == 0 {
            return Err(StoreError::Corrupt(format!("{key} has mod_revision 0")));
        }
        Ok(KeyValue {
            key: key.to_owned(),
            value: kv.value.clone(),
            version,
        })
    }

    fn unavailable(&self, reason: String) -> StoreError {
        StoreError::Unavailable {
            store: self.name.clone(),
            reason,
        }
    }

    /// Runs one request to completion on the store's runtime.
    fn run<T>(
        &self,
        request: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        self.rt().block_on(request)
    }

    /// One request: `attempt` until it succeeds, retried as `retry` allows,
    /// all within `ETCD_REQUEST_TIMEOUT_MS`.
    async fn request<T, F, Fut>(
        &self,
        retry: Retry,
        op: &'static str,
        mut attempt: F,
    ) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let deadline = Instant::now() + Duration::from_millis(ETCD_REQUEST_TIMEOUT_MS);
        let mut backoff = nvpool_rt::Backoff::new(
            Duration::from_millis(ETCD_RETRY_BACKOFF_MIN_MS),
            Duration::from_millis(ETCD_RETRY_BACKOFF_MAX_MS),
        );
        /// Distinct failures an `Unavailable` error names: the endpoints
        /// may each fail differently (refused, no leader, no answer).
        const REASONS_SHOWN: usize = 3;
        let mut reasons: Vec<String> = Vec::new();
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let left = deadline.saturating_duration_since(Instant::now());
            let limit = match retry {
                Retry::Reads => left.min(Duration::from_millis(ETCD_READ_ATTEMPT_TIMEOUT_MS)),
                Retry::Writes => left,
            };
            let reason = match tokio::time::timeout(limit, attempt()).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(e)) => match classify(e) {
                    Failure::Refused(e) => {
                        return Err(StoreError::Backend {
                            op,
                            source: Box::new(e),
                        })
                    }
                    Failure::NotSent(reason) => reason,
                    Failure::Unavailable(reason) if retry == Retry::Reads => reason,
                    Failure::Unavailable(reason) => {
                        return Err(self.unavailable(format!(
                            "{op}: {reason} (it may or may not have been applied)"
                        )))
                    }
                },
                Err(_) if retry == Retry::Reads => {
                    format!("no answer within {} ms", limit.as_millis())
                }
                Err(_) => {
                    return Err(self.unavailable(format!(
                        "{op}: no answer within {ETCD_REQUEST_TIMEOUT_MS} ms (it may or may not \
                         have been applied)"
                    )))
                }
            };
            if !reasons.contains(&reason) && reasons.len() < REASONS_SHOWN {
                reasons.push(reason);
            }
            let pause = backoff.step();
            if Instant::now() + pause >= deadline {
                return Err(self.unavailable(format!(
                    "{op}: {} ({attempts} attempts in {ETCD_REQUEST_TIMEOUT_MS} ms)",
                    reasons.join("; ")
                )));
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// A linearizable read of etcd's current revision.
    async fn current_revision(&self) -> Result<Revision, StoreError> {
        let key = self.url.prefix.clone().into_bytes();
        let resp = self
            .request(Retry::Reads, "read the revision", || {
                let mut kv = self.kv.clone();
                let key = key.clone();
                async move { kv.get(key, Some(GetOptions::new().with_count_only())).await }
            })
            .await?;
        let header = resp
            .header()
            .ok_or_else(|| StoreError::Corrupt("etcd answered without a header".into()))?;
        revision_of("revision", header.revision())
    }

    async fn list_at_one_revision(
        &self,
        start: &[u8],
        end: &[u8],
    ) -> Result<Option<Listing>, StoreError> {
        let mut from = start.to_vec();
        let mut revision: Option<i64> = None;
        let mut entries = Vec::new();
        loop {
            let mut options = GetOptions::new()
                .with_range(end.to_vec())
                .with_limit(ETCD_LIST_PAGE_KEYS as i64);
            if let Some(r) = revision {
                options = options.with_revision(r);
            }
            let page = self
                .request(Retry::Reads, "list", || {
                    let mut kv = self.kv.clone();
                    let (key, options) = (from.clone(), options.clone());
                    async move { kv.get(key, Some(options)).await }
                })
                .await;
            let page = match page {
                Ok(p) => p,
                // etcd compacted the revision between two pages: start again.
                Err(StoreError::Backend { source, .. })
                    if revision.is_some()
                        && source
                            .to_string()
                            .contains("required revision has been compacted") =>
                {
                    return Ok(None)
                }
                Err(e) => return Err(e),
            };
            if revision.is_none() {
                let header = page
                    .header()
                    .ok_or_else(|| StoreError::Corrupt("etcd answered without a header".into()))?;
                revision = Some(header.revision());
            }
            for kv in &page.0.kvs {
                entries.push(self.key_value(kv)?);
            }
            match page.0.kvs.last() {
                Some(last) if page.more() => {
                    from = last.key.clone();
                    from.push(0);
                }
                _ => break,
            }
        }
        let revision = revision_of("revision", revision.unwrap_or(0))?;
        Ok(Some(Listing { revision, entries }))
    }

    /// The changes under the prefix in `(after, current]`, read from a watch
    /// of every key (see the module documentation). The outer error is the
    /// watch's, for the retry loop; the inner one is the answer's.
    async fn watch_changes(
        &self,
        after: Revision,
        current: Revision,
    ) -> Result<Result<Vec<Change>, StoreError>, etcd_client::Error> {
        let start = i64::try_from(after.max(1)).unwrap_or(i64::MAX);
        let options = WatchOptions::new()
            .with_all_keys()
            .with_start_revision(start)
            .with_fragment();
        let mut watch = self.watch.clone();
        let mut stream = watch.watch(Vec::<u8>::new(), Some(options)).await?;
        let mut history = History::new(self.limits);
        // The newest revision in (after, current] seen, and whether any
        // event after `current` was.
        let mut seen = after;
        let mut beyond = false;
        loop {
            let Some(message) = stream.message().await? else {
                return Err(etcd_client::Error::WatchError(
                    "etcd ended the watch".into(),
                ));
            };
            let message = message.0;
            if message.canceled {
                return Ok(Err(if message.compact_revision > 0 {
                    StoreError::Compacted {
                        requested: after,
                        compacted: message.compact_revision as Revision,
                    }
                } else {
                    StoreError::Backend {
                        op: "watch",
                        source: format!("etcd cancelled the watch: {}", message.cancel_reason)
                            .into(),
                    }
                }));
            }
            for event in message.events {
                let Some(kv) = event.kv else {
                    return Ok(Err(StoreError::Corrupt(
                        "etcd sent a watch event without a key".into(),
                    )));
                };
                let revision = match revision_of("mod_revision", kv.mod_revision) {
                    Ok(r) => r,
                    Err(e) => return Ok(Err(e)),
                };
                if revision <= after {
                    continue;
                }
                if revision > current {
                    beyond = true;
                    continue;
                }
                seen = seen.max(revision);
                let Some(key) = self.store_key(&kv.key) else {
                    continue;
                };
                let Ok(key) = String::from_utf8(key.to_vec()) else {
                    return Ok(Err(StoreError::Corrupt(format!(
                        "key {:?} under {} is not UTF-8",
                        String::from_utf8_lossy(key),
                        self.url.prefix
                    ))));
                };
                let value = match event.r#type {
                    0 => Some(kv.value),
                    1 => None,
                    other => {
                        return Ok(Err(StoreError::Corrupt(format!(
                            "etcd sent a watch event of unknown type {other}"
                        ))))
                    }
                };
                history.push(Change {
                    revision,
                    key,
                    value,
                });
            }
            // Stop only at the end of a response (its last fragment): a
            // revision's events never span two responses.
            if !message.fragment && (seen >= current || beyond) {
                return Ok(history.finish(after));
            }
        }
    }
}

impl Store for EtcdStore {
    fn get(&self, key: &str) -> Result<Option<KeyValue>, StoreError> {
        if !key.starts_with('/') {
            // Not a store key (they are paths); under the prefix it could
            // name another cluster's key.
            return Ok(None);
        }
        let key = self.etcd_key(key);
        let resp = self.run(self.request(Retry::Reads, "get", || {
            let mut kv = self.kv.clone();
            let key = key.clone();
            async move { kv.get(key, None).await }
        }))?;
        resp.0.kvs.first().map(|kv| self.key_value(kv)).transpose()
    }

    fn list(&self, prefix: &str) -> Result<Listing, StoreError> {
        if !prefix.is_empty() && !prefix.starts_with('/') {
            // No key matches (keys start with '/').
            return Ok(Listing {
                revision: self.revision()?,
                entries: Vec::new(),
            });
        }
        // "" lists the whole store: everything under "{prefix}/".
        let start = self.etcd_key(if prefix.is_empty() { "/" } else { prefix });
        let end = prefix_end(&start);
        self.run(async {
            for _ in 0..=ETCD_LIST_RESTARTS_MAX {
                if let Some(listing) = self.list_at_one_revision(&start, &end).await? {
                    return Ok(listing);
                }
            }
            Err(self.unavailable(format!(
                "list {prefix}: etcd compacted the revision being read {} times in a row",
                ETCD_LIST_RESTARTS_MAX + 1
            )))
        })
    }

    fn txn(&self, conditions: &[Condition], ops: &[Op]) -> Result<TxnOutcome, StoreError> {
        validate_txn(conditions, ops)?;
        let compares: Vec<Compare> = conditions
            .iter()
            .map(|c| {
                let key = self.etcd_key(c.key());
                match c {
                    // Versions are never 0, and etcd compares a missing
                    // key's mod_revision as 0: `VersionIs(k, 0)` (or one
                    // beyond etcd's range) never holds, and says so.
                    Condition::VersionIs(_, v) => match i64::try_from(*v) {
                        Ok(v) if v > 0 => Compare::mod_revision(key, CompareOp::Equal, v),
                        _ => Compare::version(key, CompareOp::Less, 0),
                    },
                    Condition::Missing(_) => Compare::version(key, CompareOp::Equal, 0),
                }
            })
            .collect();
        let then: Vec<TxnOp> = ops
            .iter()
            .map(|op| match op {
                Op::Put(k, v) => TxnOp::put(self.etcd_key(k), v.clone(), None),
                Op::Delete(k) => TxnOp::delete(self.etcd_key(k), None),
            })
            .collect();
        let mut read_back: Vec<Vec<u8>> =
            conditions.iter().map(|c| self.etcd_key(c.key())).collect();
        read_back.sort();
        read_back.dedup();
        let otherwise: Vec<TxnOp> = read_back
            .iter()
            .map(|k| TxnOp::get(k.clone(), Some(GetOptions::new().with_keys_only())))
            .collect();
        let txn = Txn::new().when(compares).and_then(then).or_else(otherwise);
        let resp = self.run(self.request(Retry::Writes, "txn", || {
            let mut kv = self.kv.clone();
            let txn = txn.clone();
            async move { kv.txn(txn).await }
        }))?;
        let revision = revision_of(
            "revision",
            resp.0
                .header
                .as_ref()
                .ok_or_else(|| StoreError::Corrupt("etcd answered without a header".into()))?
                .revision,
        )?;
        if resp.0.succeeded {
            return Ok(TxnOutcome::Committed { revision });
        }
        // The failure branch read every condition's key as the compares saw it.
        let mut versions: BTreeMap<Vec<u8>, Revision> = BTreeMap::new();
        for r in &resp.0.responses {
            if let Some(PbTxnOpResponse::ResponseRange(range)) = &r.response {
                for kv in &range.kvs {
                    versions.insert(
                        kv.key.clone(),
                        revision_of("mod_revision", kv.mod_revision)?,
                    );
                }
            }
        }
        let failed =
            failed_conditions(conditions, |k| Ok(versions.get(&self.etcd_key(k)).copied()))?;
        if failed.is_empty() {
            return Err(StoreError::Corrupt(
                "etcd refused a transaction whose conditions all held".into(),
            ));
        }
        Ok(TxnOutcome::Conflict(failed))
    }

    fn revision(&self) -> Result<Revision, StoreError> {
        self.run(self.current_revision())
    }

    fn changes_since(&self, revision: Revision) -> Result<Vec<Change>, StoreError> {
        self.run(async {
            let current = self.current_revision().await?;
            check_history(revision, 0, current)?;
            if revision == current {
                return Ok(Vec::new());
            }
            self.request(Retry::Reads, "watch", || {
                self.watch_changes(revision, current)
            })
            .await?
        })
    }

    fn elector(&self) -> Option<&dyn Elector> {
        Some(self)
    }
}

impl EtcdStore {
    /// One election request, once, within `LEADER_REQUEST_TIMEOUT_MS`: the
    /// election loop retries on its own schedule, and a request that hangs
    /// must not outlive the term it would renew.
    async fn elect<T>(
        &self,
        op: &'static str,
        request: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, StoreError> {
        let limit = Duration::from_millis(LEADER_REQUEST_TIMEOUT_MS);
        match tokio::time::timeout(limit, request).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(match classify(e) {
                Failure::NotSent(reason) | Failure::Unavailable(reason) => {
                    self.unavailable(format!("{op}: {reason}"))
                }
                Failure::Refused(e) => StoreError::Backend {
                    op,
                    source: Box::new(e),
                },
            }),
            Err(_) => Err(self.unavailable(format!(
                "{op}: no answer within {LEADER_REQUEST_TIMEOUT_MS} ms"
            ))),
        }
    }
}

/// The leader key is one etcd key under a lease: etcd deletes it when the
/// lease is not renewed in time, on etcd's own clock. The key's
/// `mod_revision` when won is the term; the leader's writes compare it.
impl Elector for EtcdStore {
    fn campaign(&self, holder: &str, ttl_s: u32) -> Result<Campaign, StoreError> {
        let key = self.etcd_key(LEADER_KEY);
        self.run(async {
            let lease = self
                .elect("grant the leader lease", {
                    let mut leases = self.client.lease_client();
                    async move { leases.grant(i64::from(ttl_s), None).await }
                })
                .await?
                .id();
            let txn = Txn::new()
                .when([Compare::version(key.clone(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(
                    key.clone(),
                    holder,
                    Some(PutOptions::new().with_lease(lease)),
                )])
                .or_else([TxnOp::get(key.clone(), None)]);
            let answer = self
                .elect("take the leader key", {
                    let mut kv = self.kv.clone();
                    async move { kv.txn(txn).await }
                })
                .await;
            let resp = match answer {
                Ok(resp) => resp,
                Err(e) => {
                    // It may have been applied: the revoke takes the key
                    // back with the lease, so no unknown leader remains.
                    self.revoke(lease).await;
                    return Err(e);
                }
            };
            if resp.0.succeeded {
                let revision = resp
                    .0
                    .header
                    .as_ref()
                    .ok_or_else(|| StoreError::Corrupt("etcd answered without a header".into()))?
                    .revision;
                return Ok(Campaign::Won {
                    lease,
                    version: revision_of("revision", revision)?,
                });
            }
            self.revoke(lease).await;
            let holder = resp
                .0
                .responses
                .iter()
                .find_map(|r| match &r.response {
                    Some(PbTxnOpResponse::ResponseRange(range)) => range.kvs.first(),
                    _ => None,
                })
                .map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
                // Expired between the compare and the read: nobody, for now.
                .unwrap_or_default();
            Ok(Campaign::Held { holder })
        })
    }

    fn renew(&self, lease: i64) -> Result<bool, StoreError> {
        self.run(async {
            let mut leases = self.client.lease_client();
            // Opening the stream sends the first keep-alive; its answer
            // is the lease's remaining time, 0 once it is gone.
            let (_keeper, mut answers) = self
                .elect("renew the leader lease", leases.keep_alive(lease))
                .await?;
            let answer = self
                .elect("renew the leader lease", answers.message())
                .await?;
            Ok(answer.is_some_and(|a| a.ttl() > 0))
        })
    }

    fn resign(&self, lease: i64) {
        self.run(async {
            self.revoke(lease).await;
            Ok(())
        })
        .unwrap_or(());
    }
}

impl EtcdStore {
    /// Revokes a lease, best effort: an unrevoked lease expires by itself.
    async fn revoke(&self, lease: i64) {
        let mut leases = self.client.lease_client();
        if let Err(e) = self
            .elect("revoke the leader lease", async move {
                leases.revoke(lease).await
            })
            .await
        {
            tracing::debug!(error = %e, "revoking a lease failed; it will expire");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends() {
        assert_eq!(prefix_end(b"/nvpool/"), b"/nvpool0");
        assert_eq!(prefix_end(b"/a\xff"), b"/b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
    }

    #[test]
    fn history_is_trimmed_like_the_change_log() {
        let change = |revision, n: usize| Change {
            revision,
            key: "/k".into(),
            value: Some(vec![0; n]),
        };
        let limits = HistoryLimits {
            revisions: 2,
            bytes: 100,
        };
        let mut h = History::new(limits);
        for r in [5, 5, 9] {
            h.push(change(r, 1));
        }
        assert_eq!(h.finish(4).unwrap().len(), 3, "two revisions fit");
        let mut h = History::new(limits);
        for r in [5, 9, 9, 12] {
            h.push(change(r, 1));
        }
        assert!(matches!(
            h.finish(3),
            Err(StoreError::Compacted {
                requested: 3,
                compacted: 5
            })
        ));
        let mut h = History::new(limits);
        h.push(change(5, 10));
        h.push(change(7, 200));
        assert!(
            matches!(h.finish(1), Err(StoreError::Compacted { compacted: 5, .. })),
            "bytes trim too"
        );
        let mut h = History::new(limits);
        h.push(change(7, 500));
        assert_eq!(h.finish(6).unwrap().len(), 1, "the newest revision stays");
    }
}
