//! A reusable tower layer that makes an axum route idempotent and transactional.
//!
//! For each request the layer:
//! 1. buffers the body (bounded) and reads the `Idempotency-Key` (exactly one, bare or sf-string form);
//! 2. begins a unit of work and **claims** `(scope, key)` in it — an in-flight row, uncommitted;
//!    a concurrent request with the same key blocks on that row for at most `wait`. A first send instead
//!    **records at commit** ([`IdempotencyConfig::record_at_commit`], the default): no row before the
//!    handler, one completed row inserted at step 5; a concurrent duplicate's insert blocks on it the same
//!    way, and a send that finds the key taken there rolls back and goes through steps 2–5 claim first;
//! 3. if the key holds a live record, decides with [`idem_domain::decide`]: replay the stored response,
//!    409/422 for a different request, 409 + `Retry-After` while the first is still running. A retry
//!    whose record is already completed and matches is replayed before step 2, from one read without a
//!    transaction (`TransactionManager::completed_record`): a completed record is immutable until it expires;
//! 4. otherwise hands the unit of work to the handler through a request extension (extractor [`Tx`]);
//!    the handler writes its business rows through it and returns;
//! 5. for a 1xx–3xx answer, stores status, allow-listed headers and body in the same unit and commits —
//!    the business effect and its idempotency record become visible together, or not at all;
//!    for a 4xx or 5xx answer rolls everything back and stores nothing — the handler's writes included — so
//!    the key stays free and a retry executes again. A 4xx the handler marked [`CommitRefusal`]
//!    ([`Problem::commit`]) is the exception, chosen explicitly: stored and committed like a success, and
//!    replayed to every retry with its key.
//!
//! With [`IdempotencyLayer::transaction_only`] the layer skips steps 1–3 (no key needed) and just runs the
//! handler in a unit of work: the "layer off" baseline.
//!
//! # Guarantees
//!
//!
//! - **A duplicate never executes twice.** The claim row is uncommitted while the first request runs;
//!   PostgreSQL makes a concurrent `INSERT … ON CONFLICT` on the same key wait for that transaction. When it
//!   commits, the waiter sees the completed record and replays; when it rolls back, the waiter claims and
//!   executes; when the wait exceeds `IdempotencyConfig::wait`, the waiter answers 409 `request-in-flight`
//!   with `Retry-After: 1`. Recorded at commit, a duplicate on another instance may run its handler, but
//!   its writes wait on the same row at the end and roll back: at most one execution's effects commit
//!   (`model/src/http_claim.rs`). Duplicates within one process wait for the first in memory and claim first.
//! - **Crash safety.** There is no moment where a payment exists without its record or the reverse: they
//!   commit together. A crash before the commit leaves nothing; the client's retry executes again.
//! - **Keys are scoped.** The primary key is `(scope, key)`; merchant B's key `k` is a different row from
//!   merchant A's `k`, so B can never replay A's response.
//! - **Money is protected twice.** Even under a new key, `UNIQUE (provider, external_payment_id)` with
//!   `INSERT … ON CONFLICT DO NOTHING` returns the existing payment (200) when the details match, 409
//!   `payment-conflict` when they differ — never a second row, and never an aborted transaction.
//! - **Expiry.** Records live `IdempotencyConfig::ttl` (24–72 h; `idem serve`'s default 48 h): an expired record counts as absent
//!   (checked in the claim statement itself), and the cleaner deletes them.
//! - **Store down.** `BEGIN` failing answers 503 problem+json with `Retry-After`, nothing executed; every
//!   answer the layer makes itself carries `Cache-Control: no-store`.
//! - **Commit with an unknown outcome.** A failing COMMIT may have been applied: the answer is 503
//!   `outcome-unknown` ("retry with the same key"), never "not executed"; the retry replays or executes.
//! - **Keys that tell their age.** A UUID v7 key whose time is older than the TTL is refused with 422
//!   `idempotency-key-expired` before anything runs (its record may be gone; AIP-155's `first_sent` rule).
//! - **Refusals never burn a key, and never commit by accident.** A 4xx answer rolls back whatever the
//!   handler wrote and stores nothing — a bad path parameter, an unknown payment, validation, media type,
//!   size, an amount finer than its currency's minor unit (ISO 4217 via the `iso_currency` crate), or a
//!   business refusal after writes ("insufficient stock") — unless the handler chose [`CommitRefusal`].
//!
//! `IdempotencyLayer::transaction_only` runs the same handlers in a unit of work without keys: the baseline
//! the benchmark compares against, never a production mode.

use std::collections::HashMap;
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::FromRequestParts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use idem_domain::phases::Lease;
use idem_domain::{Decision, Fingerprint, IdempotencyKey, TtlPolicy, decide};
use idem_ports::{
    ClaimOutcome, Clock, IdempotencyClaim, PhaseHold, StoreError, StoredRequest, StoredResponse, TakeOver,
    TransactionManager, UnitOfWork,
};
use tokio::sync::{Mutex, OwnedMutexGuard, watch};
use tower::{Layer, Service};

use crate::metrics::HttpMetrics;
pub use crate::problem::CommitRefusal;
use crate::problem::{Problem, ProblemKind};

/// The request header carrying the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// Set to `true` on a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Response headers stored and replayed. Everything else (Set-Cookie, Date, auth, request ids, rate
/// limits, framing such as Content-Length/Transfer-Encoding) is never replayed.
pub const REPLAYED_HEADERS: &[&str] =
    &["content-type", "content-language", "location", "etag", "last-modified", "link"];

/// Derives the idempotency scope (for example the authenticated merchant) from the request. `None`
/// refuses the request with 401: a key must never be shared across principals by accident.
pub type ScopeFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

/// Idempotency settings.
#[derive(Clone)]
pub struct IdempotencyConfig {
    /// How long a stored response is replayed.
    pub ttl: TtlPolicy,
    /// How long a duplicate waits for the in-flight first request before answering 409.
    pub wait: Duration,
    /// Status for a key reused with a different request: 409 (seed) or 422 (IETF draft).
    pub conflict_status: StatusCode,
    /// Whose keys are whose (for example the authenticated merchant).
    pub scope: ScopeFn,
    /// Largest request body accepted (413 beyond).
    pub max_request_body: usize,
    /// Largest response body stored (a larger one is a 500, rolled back).
    pub max_response_body: usize,
    /// When to answer a retry of a completed, matching key from one read before claiming (see the module
    /// docs). The read costs every first execution a round trip (0.90 of the rate without it, measured), so
    /// by default it runs only while replays are a noticeable share of the traffic: a retry storm.
    pub replay_fast_path: FastPath,
    /// New keys a scope may store per second ([`NewKeyQuota`](crate::quota::NewKeyQuota)); `None`: no
    /// bound (the default of the toolkit; `idem serve` sets `MERCHANT_NEW_KEYS_PER_SECOND`).
    pub new_keys: Option<Arc<crate::quota::NewKeyQuota>>,
    /// How long an attempt holds a record between the phases of a foreign call without renewing it
    /// (`IDEMPOTENCY_LEASE`; see [`Tx::foreign_call`]).
    pub lease: Duration,
    /// The longest a foreign call may take (its client's timeout, plus a margin): a call starts only while
    /// its attempt holds at least this much of its lease on the database's clock, confirmed after the first
    /// phase committed — a commit that waited (for a synchronous standby) may be visible with its lease
    /// already lapsed or nearly so, and another attempt could then call at the same time. Zero (the
    /// default): the lease must only be live. Keep it below `lease` (`idem serve` sets
    /// `PAYMENT_PROVIDER_TIMEOUT` + 1 s and refuses a shorter `IDEMPOTENCY_LEASE`).
    pub call_bound: Duration,
    /// The other side's idempotency window, from a request's first claim (`COMPLETER_WINDOW` in `idem
    /// serve`): an attempt that takes a request over past it must not send its call again under the old key
    /// — [`ForeignCall::past_window`] says so, and the handler looks the outcome up instead (found: the
    /// second phase with it; not found: [`Tx::park`]). `None` (the toolkit's default): no window.
    pub window: Option<Duration>,
    /// Whether a first send records its key at commit (one write of the record, after the handler) instead
    /// of claiming it first (a write before the handler and its completion after): `true` by default. Both
    /// keep every guarantee (`model/src/http_claim.rs`); at commit, a duplicate on another instance runs
    /// its handler until its record's insert waits for the first request, then rolls back and replays —
    /// set `false` where a handler's writes are costly to throw away.
    pub record_at_commit: bool,
    /// What makes two requests under one key the same request; `None`: method, path and query, and the
    /// whole body as canonical JSON ([`Fingerprint::of_request`]). [`Self::ignoring_fields`] leaves out
    /// body fields a client may change between retries.
    pub fingerprint: Option<FingerprintFn>,
}

impl fmt::Debug for IdempotencyConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyConfig")
            .field("ttl", &self.ttl)
            .field("wait", &self.wait)
            .field("conflict_status", &self.conflict_status)
            .field("max_request_body", &self.max_request_body)
            .finish_non_exhaustive()
    }
}

impl IdempotencyConfig {
    /// Defaults: 2 s wait, 409 on reuse, 64 KiB requests, 1 MiB responses.
    pub fn new(ttl: TtlPolicy, scope: ScopeFn) -> Self {
        Self {
            ttl,
            wait: Duration::from_secs(2),
            conflict_status: StatusCode::CONFLICT,
            scope,
            max_request_body: 64 * 1024,
            max_response_body: 1024 * 1024,
            replay_fast_path: FastPath::Adaptive,
            new_keys: None,
            lease: idem_domain::phases::DEFAULT_LEASE,
            call_bound: Duration::ZERO,
            window: None,
            record_at_commit: true,
            fingerprint: None,
        }
    }

    /// Leaves the body's top-level JSON fields `fields` out of the fingerprint (a client timestamp, a
    /// request id in the body): a retry that changed only them replays instead of conflicting.
    pub fn ignoring_fields(mut self, fields: &[&str]) -> Self {
        let fields: Vec<String> = fields.iter().map(|f| (*f).to_owned()).collect();
        self.fingerprint = Some(Arc::new(move |parts: &Parts, body: &[u8]| {
            let ignored: Vec<&str> = fields.iter().map(String::as_str).collect();
            Fingerprint::of_request_ignoring(parts.method.as_str(), route_of(parts), body, &ignored)
        }));
        self
    }
}

/// Computes a request's fingerprint from its head and body ([`IdempotencyConfig::fingerprint`]).
pub type FingerprintFn = Arc<dyn Fn(&Parts, &[u8]) -> Fingerprint + Send + Sync>;

/// Path and query: what the default fingerprint names a request by.
fn route_of(parts: &Parts) -> &str {
    parts.uri.path_and_query().map_or(parts.uri.path(), |pq| pq.as_str())
}

/// When the replay fast path runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FastPath {
    /// Before every claim.
    Always,
    /// While more than 1 in 10 of the recent keyed requests were replays (an exponentially weighted share
    /// over about the last hundred): a retry storm turns it on within a few dozen requests, ordinary
    /// traffic leaves first executions without the extra read.
    Adaptive,
    /// Never (every request claims).
    Never,
}

/// The share of recent keyed requests that were replays, in millionths (an exponentially weighted
/// average with weight 1/64 per request; lock-free, races only blur it).
#[derive(Default)]
struct ReplayShare(std::sync::atomic::AtomicU32);

impl ReplayShare {
    const ONE: u32 = 1_000_000;

    fn record(&self, replayed: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let old = self.0.load(Relaxed);
        let target = if replayed { Self::ONE } else { 0 };
        let new = i64::from(old) + (i64::from(target) - i64::from(old)) / 64;
        self.0.store(u32::try_from(new.clamp(0, i64::from(Self::ONE))).unwrap_or(0), Relaxed);
    }

    fn storm(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed) > Self::ONE / 10
    }
}

#[derive(Clone)]
struct Shared {
    tm: Arc<dyn TransactionManager>,
    clock: Arc<dyn Clock>,
    config: IdempotencyConfig,
    enforce_keys: bool,
    metrics: HttpMetrics,
    in_flight: Arc<InFlight>,
    replays: Arc<ReplayShare>,
}

/// The (scope, key) pairs this process is executing right now. A duplicate of one of them waits here,
/// holding no database connection, until the first request ends; only then does it claim in the database
/// (which stays the authority across instances) and replays. Without this, every waiting duplicate would
/// hold a pooled connection blocked on the claim row for up to `wait`.
#[derive(Default)]
struct InFlight(std::sync::Mutex<HashMap<(String, String), DoneSignal>>);

/// Flips to `true` when the leading request of a key ends.
type DoneSignal = Arc<watch::Sender<bool>>;

/// Held while this process executes a key; dropping it (the request ended, or was cancelled) lets the
/// waiting duplicates go.
struct Leader {
    in_flight: Arc<InFlight>,
    slot: (String, String),
    done: DoneSignal,
}

impl Drop for Leader {
    fn drop(&mut self) {
        let mut map = self.in_flight.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if map.get(&self.slot).is_some_and(|s| Arc::ptr_eq(s, &self.done)) {
            map.remove(&self.slot);
        }
        drop(map);
        self.done.send_replace(true);
    }
}

impl InFlight {
    /// Becomes the leader of `slot`, waiting (up to `deadline`) while another request of this process
    /// leads it; with whether it waited. `None` when the deadline passed first.
    async fn lead(self: &Arc<Self>, slot: (String, String), deadline: tokio::time::Instant) -> Option<(Leader, bool)> {
        let mut waited = false;
        loop {
            let mut running = {
                let mut map = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                match map.get(&slot) {
                    Some(other) => other.subscribe(),
                    None => {
                        let done = Arc::new(watch::channel(false).0);
                        map.insert(slot.clone(), done.clone());
                        return Some((Leader { in_flight: self.clone(), slot, done }, waited));
                    }
                }
            };
            waited = true;
            match tokio::time::timeout_at(deadline, running.wait_for(|done| *done)).await {
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
    }
}

/// The layer. Apply it with `Router::route_layer` to the routes that must be idempotent, inside the
/// authentication layer (the scope function reads what authentication established).
#[derive(Clone)]
pub struct IdempotencyLayer {
    shared: Arc<Shared>,
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("config", &self.shared.config)
            .field("enforce_keys", &self.shared.enforce_keys)
            .finish()
    }
}

impl IdempotencyLayer {
    /// The layer, claiming keys in units of work from `tm`.
    pub fn new(tm: Arc<dyn TransactionManager>, clock: Arc<dyn Clock>, config: IdempotencyConfig) -> Self {
        Self {
            shared: Arc::new(Shared {
                tm,
                clock,
                config,
                enforce_keys: true,
                metrics: HttpMetrics::default(),
                in_flight: Arc::default(),
                replays: Arc::default(),
            }),
        }
    }

    /// Runs each request in a unit of work without idempotency keys (the baseline to measure the layer
    /// against). Body limits still apply.
    pub fn transaction_only(tm: Arc<dyn TransactionManager>, clock: Arc<dyn Clock>, config: IdempotencyConfig) -> Self {
        Self {
            shared: Arc::new(Shared {
                tm,
                clock,
                config,
                enforce_keys: false,
                metrics: HttpMetrics::default(),
                in_flight: Arc::default(),
                replays: Arc::default(),
            }),
        }
    }
}

impl IdempotencyLayer {
    /// Counts outcomes into `metrics` (shared with the rest of the HTTP adapter).
    pub fn with_metrics(self, metrics: HttpMetrics) -> Self {
        Self { shared: Arc::new(Shared { metrics, ..(*self.shared).clone() }) }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService { inner, shared: self.shared.clone() }
    }
}

/// The service the layer wraps around a route.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService").finish_non_exhaustive()
    }
}

impl<S> Service<Request<Body>> for IdempotencyService<S>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        // The clone that was driven to readiness is the one used (tower's documented pattern).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        Box::pin(async move {
            let mut response = handle(shared.clone(), inner, req).await;
            if let Some(LayerOutcome(outcome)) = response.extensions_mut().remove::<LayerOutcome>() {
                shared.metrics.outcome(outcome);
                // on the request's span (`crate::trace::server_span` declares the field)
                tracing::Span::current().record("idempotency.outcome", outcome);
            }
            Ok(response)
        })
    }
}

/// The unit of work handed to the handler (request extension). The layer keeps the other reference and
/// takes the unit back after the handler returned.
#[derive(Clone)]
pub struct UnitOfWorkHandle(
    Arc<Mutex<Option<Box<dyn UnitOfWork>>>>,
    Arc<std::sync::atomic::AtomicBool>,
    Option<Arc<PhaseContext>>,
);

/// What a handler needs to cut its request in phases around a foreign call ([`Tx::foreign_call`]).
struct PhaseContext {
    tm: Arc<dyn TransactionManager>,
    clock: Arc<dyn Clock>,
    lease: Duration,
    /// [`IdempotencyConfig::call_bound`].
    call_bound: Duration,
    /// Taken over past the other side's window ([`ForeignCall::past_window`]).
    past_window: bool,
    /// Which claim of the key this is ([`PhaseHold::generation`]): names derive from it.
    generation: Option<i64>,
    /// This execution's attempt (1, or one more than the attempt it took over).
    attempt: u32,
    /// The recovery point a taken-over record had reached.
    resume_at: Option<String>,
    /// The handler committed a first phase.
    entered: std::sync::atomic::AtomicBool,
    /// The request, kept as cheap clones (shared buffers) until a first phase stores it for the completer.
    request: (http::Method, http::Uri, Option<http::HeaderValue>, Bytes),
    /// The key's claim: made before the handler (claim first), or by the layer at the end or by a first
    /// phase ([`Tx::foreign_call`]) on the record-at-commit path.
    claim: IdempotencyClaim,
    /// The claim row is this unit's (always on the claim-first path).
    claimed: std::sync::atomic::AtomicBool,
    /// Record at commit: a first phase found the key taken (its writes roll back, the request is decided
    /// again on the claim-first path).
    key_taken: std::sync::atomic::AtomicBool,
    /// The end of the request's wait budget (bounds the lock wait of a claim made later).
    deadline: tokio::time::Instant,
}

impl fmt::Debug for UnitOfWorkHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UnitOfWorkHandle")
    }
}

/// Extractor: the request's unit of work. Holding it gives the handler exclusive use of the transaction;
/// it never commits — the layer does, after storing the response.
pub struct Tx(OwnedMutexGuard<Option<Box<dyn UnitOfWork>>>, Option<Arc<PhaseContext>>);

/// A foreign call between the phases of a request ([`Tx::foreign_call`]): its downstream idempotency key,
/// and the renewal of the attempt's lease while it runs (stopped when it is dropped or resumed).
#[derive(Debug)]
pub struct ForeignCall {
    key: String,
    renewal: tokio::task::JoinHandle<()>,
    /// The call's span: from the first phase's commit to the second phase (or the answer without one).
    span: tracing::Span,
    past_window: bool,
}

impl ForeignCall {
    /// The call's idempotency key for the other side (`Idempotency-Key` of its API): the same on every
    /// attempt of this request, on every instance, after any restart ([`idem_domain::phases::downstream_key`]).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Whether this attempt took the request over past the other side's idempotency window
    /// ([`IdempotencyConfig::window`]): the other side may have forgotten the key, so sending the call
    /// again could act twice. Look its outcome up instead (by a reference the first call carried); found,
    /// resume with it; not found, [`Tx::park`] it for an operator.
    pub fn past_window(&self) -> bool {
        self.past_window
    }

    /// The call's span: instrument the call with it (`.instrument(call.span().clone())`) so the client's
    /// own spans (an HTTP client's) are its children.
    pub fn span(&self) -> &tracing::Span {
        &self.span
    }
}

impl Drop for ForeignCall {
    fn drop(&mut self) {
        self.renewal.abort();
    }
}

impl fmt::Debug for Tx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Tx")
    }
}

impl Tx {
    /// The unit of work holding the claim: write the business rows through it (or its adapter's transaction).
    ///
    /// # Panics
    /// Between [`Tx::foreign_call`] and [`Tx::resume`]: no transaction is open then, by design.
    pub fn uow(&mut self) -> &mut dyn UnitOfWork {
        match self.0.as_deref_mut() {
            Some(uow) => uow,
            None => panic!("no unit of work between Tx::foreign_call and Tx::resume: resume first"),
        }
    }

    /// Where this execution resumes: `None` for a first execution, the step of its last
    /// [`Tx::foreign_call`] when it took over a request whose attempt died between the phases (its first
    /// phase's writes — the intent — are committed; do not write them again).
    pub fn recovery_point(&self) -> Option<&str> {
        self.1.as_ref().and_then(|p| p.resume_at.as_deref())
    }

    /// The id of an intent this request writes in its first phase (a `pending` payment), derived from the
    /// request's scope, key and `name` ([`idem_domain::phases::intent_id`]): every attempt — a retry, a
    /// takeover, the completer — names the same row, so a resumed attempt finds what the first one wrote.
    /// `None` without an `Idempotency-Key`.
    pub fn intent_id(&self, name: &str) -> Option<uuid::Uuid> {
        self.1.as_ref().map(|p| {
            idem_domain::phases::intent_id(
                &p.claim.scope,
                &idem_domain::phases::generational_key(&p.claim.key, p.generation),
                name,
            )
        })
    }

    /// Ends the first phase before a call to another system (a payment provider, an email, another
    /// service): commits what the handler wrote so far (the intent, e.g. a `pending` payment) with the key's
    /// record held by this attempt under a lease and the recovery point `step`, and releases the
    /// connection — no transaction is open and no pooled connection is held during the call. The lease is
    /// renewed while the call runs; a duplicate meanwhile is answered `409` in flight. If this process dies,
    /// the lease lapses and the next retry takes the record over and runs the handler again from
    /// [`Tx::recovery_point`], with the same [`ForeignCall::key`], so the other side deduplicates the call.
    /// Then [`Tx::resume`] starts the second phase.
    ///
    /// If the call's outcome is unknown (a timeout, `5xx`, the other side's "in progress"), answer `503`
    /// without resuming: the record stays held, and the client's retry (after the lease) calls again with
    /// the same key. A definitive refusal is answered after resuming, with `Problem::commit` to store it.
    pub async fn foreign_call(&mut self, step: &str) -> Result<ForeignCall, Problem> {
        let internal = |why: &str| {
            tracing::error!("{why}");
            Problem::new(ProblemKind::Internal, StatusCode::INTERNAL_SERVER_ERROR)
        };
        let ctx = self.1.clone().ok_or_else(|| internal("Tx::foreign_call needs a request with an Idempotency-Key"))?;
        let mut uow = self.0.take().ok_or_else(|| internal("Tx::foreign_call twice without Tx::resume"))?;
        if !ctx.claimed.load(std::sync::atomic::Ordering::Relaxed) {
            // record at commit: the first phase commits the claim with the intent, so it claims here
            match uow.idempotency().claim(&ctx.claim, ctx.clock.now(), ctx.unclaimed_key_wait()).await {
                Ok(ClaimOutcome::Claimed) => ctx.claimed.store(true, std::sync::atomic::Ordering::Relaxed),
                Ok(ClaimOutcome::Existing(_)) | Err(StoreError::LockTimeout) => {
                    // the key was taken meanwhile: these writes roll back, the layer decides again
                    ctx.key_taken.store(true, std::sync::atomic::Ordering::Relaxed);
                    return Err(Problem::new(ProblemKind::RequestInFlight, StatusCode::CONFLICT).retry_after(1));
                }
                Err(e) => return Err(phase_store_problem(&e)),
            }
        }
        // the first hold keeps the request, so the completer can finish it if this process dies
        let first_hold = PhaseHold { request: Some(ctx.stored_request()), ..ctx.hold(step) };
        match uow.idempotency().hold(&ctx.claim.scope, &ctx.claim.key, &first_hold).await {
            Ok(true) => {}
            Ok(false) => return Err(taken_over()),
            Err(e) => return Err(phase_store_problem(&e)),
        }
        if let Err(e) = uow.commit().await {
            tracing::warn!(error = %e, "first phase commit failed; outcome unknown");
            return Err(Problem::new(ProblemKind::OutcomeUnknown, StatusCode::SERVICE_UNAVAILABLE)
                .detail("the request's first phase may or may not have been recorded: retry with the same key")
                .retry_after(1));
        }
        ctx.entered.store(true, std::sync::atomic::Ordering::Relaxed);
        // the first phase is visible: the call starts only if this attempt still owns the record with the
        // call's bound left on the database's clock (renewed once if not); else nothing is sent
        match ctx.confirm_lease(step).await {
            Ok(true) => {}
            Ok(false) => {
                // nothing was sent: the lease (if still this attempt's) is given up, so a retry goes on
                let released = async {
                    let mut uow = ctx.tm.begin().await?;
                    uow.idempotency().defer(&ctx.claim.scope, &ctx.claim.key, ctx.attempt, Duration::ZERO).await?;
                    uow.commit().await
                };
                if let Err(e) = released.await {
                    tracing::warn!(error = %e, "could not give up a lease whose call was not sent");
                }
                return Err(Problem::new(ProblemKind::OutcomeUnknown, StatusCode::SERVICE_UNAVAILABLE)
                    .detail("the request's lease could not be confirmed before its call to another system: nothing was sent; retry with the same Idempotency-Key")
                    .retry_after(1));
            }
            Err(e) => return Err(phase_store_problem(&e)),
        }
        let (renewer, step_name) = (ctx.clone(), step.to_owned());
        let renewal = tokio::spawn(async move {
            let every = (renewer.lease / 3).max(Duration::from_millis(100));
            loop {
                tokio::time::sleep(every).await;
                let hold = renewer.hold(&step_name);
                let renewed = async {
                    let mut uow = renewer.tm.begin().await?;
                    let held = uow.idempotency().hold(&renewer.claim.scope, &renewer.claim.key, &hold).await?;
                    uow.commit().await?;
                    Ok::<_, StoreError>(held)
                };
                match renewed.await {
                    Ok(true) => {}
                    Ok(false) => return, // taken over: this attempt's resume will be fenced out
                    Err(e) => tracing::warn!(error = %e, "lease renewal failed; retrying"),
                }
            }
        });
        Ok(ForeignCall {
            key: idem_domain::phases::downstream_key(
                &ctx.claim.scope,
                &idem_domain::phases::generational_key(&ctx.claim.key, ctx.generation),
                step,
            ),
            renewal,
            past_window: ctx.past_window,
            span: if idem_ports::trace::current_sampled() {
                tracing::debug_span!("foreign call", otel.kind = "internal", step, attempt = ctx.attempt)
            } else {
                tracing::Span::none()
            },
        })
    }

    /// Ends a [`Tx::foreign_call`] whose outcome is unknown although the call is over at the other side (it
    /// answered `5xx`, `429` or its own "in progress", or the connection was refused): the record stays at
    /// its recovery point, its lease ends, and no attempt calls again before a backoff (growing with the
    /// attempts) on the database's clock — a retry before it is answered `503` with the time left and sends
    /// nothing. The answer is `503 outcome-unknown` with that `Retry-After`: return it from the handler.
    /// When the other side said how long to wait, use [`Tx::outcome_unknown_after`]; after no answer at all
    /// use [`Tx::unanswered`].
    pub async fn outcome_unknown(&mut self, call: ForeignCall) -> Problem {
        self.outcome_unknown_after(call, None).await
    }

    /// [`Tx::outcome_unknown`] when the other side sent `Retry-After`: no call before `retry_after` (at
    /// most an hour); `None` waits the backoff.
    pub async fn outcome_unknown_after(&mut self, call: ForeignCall, retry_after: Option<Duration>) -> Problem {
        drop(call);
        let mut wait = Duration::from_secs(1);
        if let Some(ctx) = self.1.clone() {
            // attempt n (1-based) waits about 2^(n-1) s, at most a minute, unless the other side said otherwise
            let backoff = idem_ports::Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
            wait = retry_after
                .unwrap_or_else(|| backoff.nth(ctx.attempt.saturating_sub(1)))
                .clamp(Duration::from_secs(1), Duration::from_secs(3600));
            let deferred = async {
                let mut uow = ctx.tm.begin().await?;
                uow.idempotency().defer(&ctx.claim.scope, &ctx.claim.key, ctx.attempt, wait).await?;
                uow.commit().await
            };
            if let Err(e) = deferred.await {
                // the lease then lapses on its own: the retry waits for it
                tracing::warn!(error = %e, "could not record the wait after an unknown outcome");
                wait = ctx.lease;
            }
        }
        Problem::new(ProblemKind::OutcomeUnknown, StatusCode::SERVICE_UNAVAILABLE)
            .detail("the other system's answer is unknown; retry with the same Idempotency-Key after Retry-After: the retry asks it again under the same key, so it acts at most once")
            .retry_after(u32::try_from(wait.as_secs().max(1)).unwrap_or(u32::MAX))
    }

    /// Ends a [`Tx::foreign_call`] that got no answer (a timeout, a reset): the call may still be in process
    /// at the other side, so the lease is kept — it lapses one `IdempotencyConfig::lease` after its last
    /// renewal, longer than any call — and only then may a retry or the completer call again with the same
    /// key (two calls in process at once are what a provider without concurrent deduplication would charge
    /// twice; `model/src/phases.rs`). The answer is `503 outcome-unknown` with `Retry-After` until then.
    pub fn unanswered(&mut self, call: ForeignCall) -> Problem {
        drop(call); // stops the renewals: the lease lapses on its own
        let wait = self.1.as_ref().map_or(1, |ctx| u32::try_from(ctx.lease.as_secs().max(1)).unwrap_or(u32::MAX));
        Problem::new(ProblemKind::OutcomeUnknown, StatusCode::SERVICE_UNAVAILABLE)
            .detail("the other system did not answer; retry with the same Idempotency-Key after Retry-After: the retry asks it again under the same key, so it acts at most once")
            .retry_after(wait)
    }

    /// Parks a [`Tx::foreign_call`] whose outcome cannot be known without an operator (past the other
    /// side's window and not found there): no retry or completer sends it again until `idem keys resume`
    /// (which looks it up again) or `abandon`. Answers `503 outcome-unknown`; return it from the handler.
    pub async fn park(&mut self, call: ForeignCall, reason: &str) -> Problem {
        drop(call);
        if let Some(ctx) = self.1.clone() {
            let parked = async {
                let mut uow = ctx.tm.begin().await?;
                let now = ctx.clock.now();
                uow.idempotency().park(&ctx.claim.scope, &ctx.claim.key, reason, now).await?;
                uow.commit().await
            };
            if let Err(e) = parked.await {
                tracing::warn!(error = %e, "could not park a request; its lease lapses and it is decided again");
            }
            tracing::warn!(scope = %ctx.claim.scope, key = %ctx.claim.key.escape_debug(), reason, "request parked for an operator");
        }
        Problem::new(ProblemKind::OutcomeUnknown, StatusCode::SERVICE_UNAVAILABLE)
            .detail("the request is parked for an operator: its outcome at the other system cannot be known safely (past its idempotency window, not found there); retrying does not change it")
            .retry_after(3600)
    }

    /// Starts the second phase after a [`Tx::foreign_call`]: a new unit of work that holds the key's record
    /// only if this attempt still owns it (the fencing check: a late original whose record was taken over
    /// gets `503 outcome-unknown`, and its retry replays what the other attempt stored). Record the call's
    /// result, the business effect and the outbox row through [`Tx::uow`]; the layer stores the answer and
    /// commits them together.
    pub async fn resume(&mut self, call: ForeignCall) -> Result<(), Problem> {
        drop(call);
        let Some(ctx) = self.1.clone() else {
            return Err(Problem::new(ProblemKind::Internal, StatusCode::INTERNAL_SERVER_ERROR));
        };
        let mut uow = ctx.tm.begin().await.map_err(|e| phase_store_problem(&e))?;
        match uow.idempotency().owns(&ctx.claim.scope, &ctx.claim.key, ctx.attempt).await {
            Ok(true) => {
                *self.0 = Some(uow);
                Ok(())
            }
            Ok(false) => Err(taken_over()),
            Err(e) => Err(phase_store_problem(&e)),
        }
    }
}

impl PhaseContext {
    /// What is left of the request's wait budget for a lock wait on the key.
    fn claim_wait(&self) -> Duration {
        wait_left(self.deadline)
    }

    /// The wait for the key of a request recorded at commit, whose handler may hold row locks by then:
    /// short, so the two claim paths wait for locks in one order. A claim-first request takes the key,
    /// then its rows; this one took rows first, so it does not wait on the key for long (a claim-first
    /// request holding the key may be waiting for these rows: a deadlock, 1 s until PostgreSQL breaks
    /// it) but rolls back and is decided again claim first, key first.
    fn unclaimed_key_wait(&self) -> Duration {
        self.claim_wait().min(UNCLAIMED_KEY_WAIT)
    }

    /// The request as the completer re-sends it.
    fn stored_request(&self) -> StoredRequest {
        let (method, uri, content_type, body) = &self.request;
        StoredRequest {
            method: method.as_str().to_owned(),
            uri: uri.path_and_query().map_or_else(|| uri.path().to_owned(), |p| p.as_str().to_owned()),
            content_type: content_type.as_ref().and_then(|v| v.to_str().ok()).map(str::to_owned),
            // a JSON body without its insignificant whitespace (every value, number and key order kept, so
            // its fingerprint is the same): a padded body costs the table nothing
            body: compact_json(body).unwrap_or_else(|| body.to_vec()),
        }
    }

    /// Whether this attempt owns the record with at least `call_bound` of its lease left, on the database's
    /// clock: read once, and if too little is left renewed (fenced) and read again.
    async fn confirm_lease(&self, step: &str) -> Result<bool, StoreError> {
        let left = async {
            let mut uow = self.tm.begin().await?;
            let left = uow.idempotency().lease_left(&self.claim.scope, &self.claim.key, self.attempt).await?;
            uow.commit().await?;
            Ok::<_, StoreError>(left)
        };
        match left.await? {
            None => return Ok(false),
            Some(left) if left > self.call_bound => return Ok(true),
            Some(_) => {}
        }
        let mut uow = self.tm.begin().await?;
        if !uow.idempotency().hold(&self.claim.scope, &self.claim.key, &self.hold(step)).await? {
            return Ok(false);
        }
        uow.commit().await?;
        let mut uow = self.tm.begin().await?;
        let left = uow.idempotency().lease_left(&self.claim.scope, &self.claim.key, self.attempt).await?;
        uow.commit().await?;
        Ok(left.is_some_and(|left| left > self.call_bound))
    }

    /// This attempt's hold on the record at `step`, its lease from now.
    fn hold(&self, step: &str) -> PhaseHold {
        let now = self.clock.now();
        let lease = Lease { attempt: self.attempt, until: now }.renewed(now, self.lease);
        PhaseHold {
            attempt: lease.attempt,
            lease_until: lease.until,
            lease: self.lease,
            not_before: None,
            generation: None,
            recovery_point: step.to_owned(),
            request: None,
        }
    }
}

/// The answer of a request whose call to another system may have been sent (its first phase committed) and
/// that then failed: whatever the failure said (`503 service-unavailable` means nothing was executed), the
/// outcome is unknown — the other system may have acted. The record stays held; the retry resumes with the
/// same downstream key. An answer that already says so goes out as it is.
fn after_a_call(response: Response) -> Response {
    if response.status() == StatusCode::SERVICE_UNAVAILABLE
        && response.extensions().get::<ProblemKind>() == Some(&ProblemKind::OutcomeUnknown)
    {
        return response;
    }
    let retry_after = response.headers().get(header::RETRY_AFTER).cloned();
    tracing::warn!(status = %response.status(), "a request failed after its call to another system: outcome unknown");
    let mut unknown = Problem::new(ProblemKind::OutcomeUnknown, StatusCode::SERVICE_UNAVAILABLE)
        .detail("the request failed after its call to another system, which may have acted: retry with the same Idempotency-Key (the retry asks it again under the same key and records its answer)")
        .retry_after(1)
        .into_response();
    if let Some(value) = retry_after {
        unknown.headers_mut().insert(header::RETRY_AFTER, value);
    }
    unknown
}

/// `body` without the whitespace between JSON tokens (`None`: not JSON). Strings, numbers and the order of
/// keys are kept byte for byte, so the body means — and fingerprints — the same.
fn compact_json(body: &[u8]) -> Option<Vec<u8>> {
    // as the fingerprint reads it (`Value` refuses invalid UTF-8 and lone surrogates; such a body is
    // fingerprinted raw, so it is stored raw)
    serde_json::from_slice::<serde_json::Value>(body).ok()?;
    let mut out = Vec::with_capacity(body.len());
    let (mut in_string, mut escaped) = (false, false);
    for &b in body {
        if in_string {
            out.push(b);
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
        } else if !matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
            in_string = b == b'"';
            out.push(b);
        }
    }
    Some(out)
}

/// The answer of an attempt whose record another attempt took over (it lost its lease).
fn taken_over() -> Problem {
    Problem::new(ProblemKind::OutcomeUnknown, StatusCode::SERVICE_UNAVAILABLE)
        .detail("another attempt took this request over; retry with the same Idempotency-Key to get its answer")
        .retry_after(1)
}

fn phase_store_problem(e: &StoreError) -> Problem {
    tracing::warn!(error = %e, "idempotency store failed between phases");
    Problem::new(ProblemKind::OutcomeUnknown, StatusCode::SERVICE_UNAVAILABLE)
        .detail("the request may be part-way: retry with the same Idempotency-Key")
        .retry_after(1)
}

impl<St: Send + Sync> FromRequestParts<St> for Tx {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _state: &St) -> Result<Self, Problem> {
        let missing = || {
            tracing::error!("handler needs a unit of work but the IdempotencyLayer is not installed on its route");
            Problem::new(ProblemKind::Internal, StatusCode::INTERNAL_SERVER_ERROR)
        };
        let handle = parts.extensions.get::<UnitOfWorkHandle>().cloned().ok_or_else(missing)?;
        // One `Tx` per request: a second one would wait for the first for ever (the handler holds both)
        let Ok(guard) = handle.0.try_lock_owned() else {
            tracing::error!("the handler extracted `Tx` twice; a request has one unit of work: take it once");
            return Err(Problem::new(ProblemKind::Internal, StatusCode::INTERNAL_SERVER_ERROR)
                .detail("the handler asked for its unit of work twice"));
        };
        if guard.is_none() {
            return Err(missing());
        }
        handle.1.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(Tx(guard, handle.2.clone()))
    }
}

/// What the layer did with a request, carried on the response to the metrics.
#[derive(Debug, Clone, Copy)]
struct LayerOutcome(&'static str);

fn tagged(mut response: Response, outcome: &'static str) -> Response {
    response.extensions_mut().insert(LayerOutcome(outcome));
    response
}

fn layer_problem(kind: ProblemKind, status: StatusCode) -> Problem {
    Problem::new(kind, status).no_store()
}

fn unavailable(err: &StoreError) -> Response {
    tracing::warn!(error = %err, "idempotency store unavailable");
    let problem = layer_problem(ProblemKind::StoreUnavailable, StatusCode::SERVICE_UNAVAILABLE)
        .detail("the request was not executed; retry with the same Idempotency-Key")
        .retry_after(1);
    tagged(problem.into_response(), "unavailable")
}

fn store_failure(err: &StoreError) -> Response {
    if err.is_transient() {
        return unavailable(err);
    }
    tracing::error!(error = %err, "idempotency store failed");
    tagged(layer_problem(ProblemKind::Internal, StatusCode::INTERNAL_SERVER_ERROR).into_response(), "failed")
}

fn in_flight() -> Response {
    let problem = layer_problem(ProblemKind::RequestInFlight, StatusCode::CONFLICT)
        .detail("a request with this Idempotency-Key is still being processed; retry later")
        .retry_after(1);
    tagged(problem.into_response(), "in_flight")
}

/// Reads exactly one `Idempotency-Key` header.
fn read_key(headers: &HeaderMap) -> Result<IdempotencyKey, Problem> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    match (values.next(), values.next()) {
        (None, _) => Err(layer_problem(ProblemKind::IdempotencyKeyMissing, StatusCode::BAD_REQUEST)
            .detail("send an Idempotency-Key header (one per business operation, reused on every retry)")),
        (Some(_), Some(_)) => Err(layer_problem(ProblemKind::IdempotencyKeyInvalid, StatusCode::BAD_REQUEST)
            .detail("send exactly one Idempotency-Key header")),
        (Some(v), None) => IdempotencyKey::from_header_value(v.as_bytes()).map_err(|e| {
            layer_problem(ProblemKind::IdempotencyKeyInvalid, StatusCode::BAD_REQUEST).detail(e.to_string())
        }),
    }
}

fn too_large(limit: usize) -> Problem {
    layer_problem(ProblemKind::PayloadTooLarge, StatusCode::PAYLOAD_TOO_LARGE)
        .detail(format!("request bodies are limited to {limit} bytes"))
}

async fn read_body(body: Body, headers: &HeaderMap, limit: usize) -> Result<Bytes, Problem> {
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large(limit));
    }
    axum::body::to_bytes(body, limit).await.map_err(|e| body_problem(e, limit))
}

/// Why a body could not be read: too large (`413`), not received within the body-read timeout (`408`;
/// it used to be answered `413`), or cut off (`400`). Nothing ran either way.
fn body_problem(e: axum::Error, limit: usize) -> Problem {
    let inner = e.into_inner();
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(inner.as_ref());
    while let Some(err) = source {
        if err.is::<http_body_util::LengthLimitError>() {
            return too_large(limit);
        }
        if err.is::<tower_http::timeout::TimeoutError>() {
            return layer_problem(ProblemKind::RequestTimeout, StatusCode::REQUEST_TIMEOUT)
                .detail("the request body did not arrive in time; send it again with the same Idempotency-Key");
        }
        source = err.source();
    }
    layer_problem(ProblemKind::MalformedJson, StatusCode::BAD_REQUEST).detail("the request body could not be read")
}

fn replay(stored: &StoredResponse) -> Response {
    let mut response = Response::new(Body::from(stored.body.clone()));
    *response.status_mut() = StatusCode::from_u16(stored.status_code).unwrap_or(StatusCode::OK);
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        if let (Ok(n), Ok(v)) = (HeaderName::try_from(name.as_str()), HeaderValue::try_from(value.as_str())) {
            headers.append(n, v);
        }
    }
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

async fn handle<S>(shared: Arc<Shared>, inner: S, req: Request<Body>) -> Response
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Clone + Send,
    S::Future: Send,
{
    let (parts, body) = req.into_parts();
    let config = &shared.config;
    if !shared.enforce_keys {
        let body = match read_body(body, &parts.headers, config.max_request_body).await {
            Ok(b) => b,
            Err(problem) => return tagged(problem.into_response(), "rejected_input"),
        };
        let uow = match shared.tm.begin().await {
            Ok(uow) => uow,
            Err(e) => return store_failure(&e),
        };
        return match execute(&shared, inner, parts, body, uow, None).await {
            Executed::Answer(response) => response,
            Executed::KeyTaken => in_flight(), // no key, no record: never
        };
    }

    let key = match read_key(&parts.headers) {
        Ok(k) => k,
        Err(problem) => return tagged(problem.into_response(), "rejected_input"),
    };
    let Some(scope) = (config.scope)(&parts) else {
        // the service's scope function found no principal: a key is never shared across principals by accident
        let problem = Problem::new(ProblemKind::Unauthorized, StatusCode::UNAUTHORIZED)
            .detail("no principal to scope this Idempotency-Key by: nothing was executed or stored");
        return tagged(problem.into_response(), "rejected_input");
    };
    let body = match read_body(body, &parts.headers, config.max_request_body).await {
        Ok(b) => b,
        Err(problem) => return tagged(problem.into_response(), "rejected_input"),
    };
    let fingerprint = match &config.fingerprint {
        Some(of) => of(&parts, &body),
        None => Fingerprint::of_request(parts.method.as_str(), route_of(&parts), &body),
    };

    if key.is_future_dated(shared.clock.now()) {
        let problem = layer_problem(ProblemKind::IdempotencyKeyFutureDated, StatusCode::UNPROCESSABLE_ENTITY).detail(
            "this UUID v7 Idempotency-Key carries a creation time in the future: the client's clock is wrong; \
             nothing was executed or stored — mint keys from a correct clock",
        );
        return tagged(problem.into_response(), "rejected_input");
    }
    // Replay fast path: a completed record never changes until it expires, so a retry whose record is
    // completed and matches is answered from one read — no claim transaction, no wait behind a leader.
    // Anything else (no record, in flight, another request, a read that failed, a store without the
    // read) takes the full path below, which decides again under the claim.
    let fast_path = match config.replay_fast_path {
        FastPath::Always => true,
        FastPath::Adaptive => shared.replays.storm(),
        FastPath::Never => false,
    };
    if fast_path
        && let Ok(Some(record)) = shared.tm.completed_record(&scope, key.as_str()).await
        && let Decision::Replay(stored) = decide(Some(&record), &fingerprint, shared.clock.now())
    {
        // a record visible on the primary may be one no standby has (a cancelled commit wait): the
        // answer waits until a standby has it, or is not given
        if let Err(e) = shared.tm.confirm_replicated().await {
            return store_failure(&e);
        }
        tracing::debug!(key = %key.as_str(), "idempotent replay (fast path)");
        shared.replays.record(true);
        return tagged(replay(stored), "replayed");
    }
    // An old key is refused only when its record is gone (looked up below): a late first send of a key
    // whose request did run replays.
    let expired = key.is_expired(&config.ttl, shared.clock.now());
    // One wait budget for both: the in-process wait for a leader of this key, then the database claim.
    let deadline = tokio::time::Instant::now() + config.wait;
    let Some((_leader, waited)) = shared.in_flight.lead((scope.clone(), key.as_str().to_owned()), deadline).await
    else {
        return in_flight();
    };
    let now = shared.clock.now();
    let claim = IdempotencyClaim {
        scope,
        key: key.as_str().to_owned(),
        command_hash: *fingerprint.as_bytes(),
        created_at: now,
        // a key dated ahead (within the margin) is accepted until its own time + TTL: its record lives as long
        expires_at: config.ttl.retain_until(now, key.first_sent()),
    };
    // Record at commit: a first send runs the handler before any record exists, and the completed record
    // is inserted once, at the end of the same unit (`IdempotencyRepository::insert_completed`), instead of
    // claimed first and completed (two writes of the row). The unique key still serialises a concurrent
    // duplicate on another instance: its insert waits for this unit, finds the record, rolls its writes
    // back and is decided again below. Claim first instead for a duplicate that waited behind a leader of
    // this process (its record is most likely there: no work is done for nothing), an old v7 key (refused
    // if its record is gone), and a scope out of new-key tokens (only a known key may pass). The handler's
    // foreign call claims in its first phase (`Tx::foreign_call`). Model: `model/src/http_claim.rs`.
    let mut token_taken = false;
    if config.record_at_commit && !waited && !expired {
        // the send is taken to be new: it takes a token now (one that turns out known gives it back)
        let token = config.new_keys.as_ref().map(|q| q.take(&claim.scope).is_ok());
        token_taken = token == Some(true);
        if token != Some(false) {
            let uow = match shared.tm.begin().await {
                Ok(uow) => uow,
                Err(e) => return store_failure(&e),
            };
            let generation = Some(claim.created_at.timestamp_micros());
            let run = Run {
                claim: claim.clone(),
                attempt: 1,
                past_window: false,
                generation,
                resume_at: None,
                claimed: false,
                deadline,
            };
            match execute(&shared, inner.clone(), parts.clone(), body.clone(), uow, Some(run)).await {
                Executed::Answer(response) => return response,
                Executed::KeyTaken => {
                    tracing::debug!(key = %claim.key, "key taken meanwhile: decided again");
                    // a known key is free: its token goes back (a claim below that finds it new takes one)
                    if let (true, Some(quota)) = (token_taken, config.new_keys.as_ref()) {
                        quota.give_back(&claim.scope);
                        token_taken = false;
                    }
                }
            }
        }
    }
    let answer = |executed: Executed| match executed {
        Executed::Answer(response) => response,
        // a claim-first run holds its claim from the start: nobody can take the key from it
        Executed::KeyTaken => in_flight(),
    };
    let refuse_expired = || {
        let problem = layer_problem(ProblemKind::IdempotencyKeyExpired, StatusCode::UNPROCESSABLE_ENTITY).detail(
            "this UUID v7 Idempotency-Key was created longer ago than idempotency records are kept: its first \
             request may have run and been forgotten, so it is not executed again; if the operation is still \
             wanted, check its outcome first, then send it under a new key",
        );
        tagged(problem.into_response(), "rejected_input")
    };
    let claim_wait = wait_left(deadline);
    let mut uow = match shared.tm.begin().await {
        Ok(uow) => uow,
        Err(e) => return store_failure(&e),
    };
    let outcome = if expired {
        match uow.idempotency().get(&claim.scope, &claim.key).await {
            Ok(Some(record)) if record.expires_at > now => Ok(ClaimOutcome::Existing(record)),
            Ok(_) => return refuse_expired(),
            Err(e) => Err(e),
        }
    } else {
        uow.idempotency().claim(&claim, now, claim_wait).await
    };
    match outcome {
        Ok(ClaimOutcome::Claimed) => {
            shared.replays.record(false);
            if !token_taken && let Some(Err(wait)) = config.new_keys.as_ref().map(|q| q.take(&claim.scope)) {
                drop(uow); // rolled back: nothing ran, nothing is stored, the key stays free
                let problem = layer_problem(ProblemKind::TooManyRequests, StatusCode::TOO_MANY_REQUESTS)
                    .detail("too many new Idempotency-Keys of this client; retry with the same key after the given delay")
                    .retry_after(u32::try_from(wait.as_secs().max(1)).unwrap_or(u32::MAX));
                return tagged(problem.into_response(), "rate_limited");
            }
            let generation = Some(claim.created_at.timestamp_micros());
            let run = Run { claim, attempt: 1, past_window: false, generation, resume_at: None, claimed: true, deadline };
            answer(execute(&shared, inner, parts, body, uow, Some(run)).await)
        }
        Ok(ClaimOutcome::Existing(record)) => match decide(Some(&record), &fingerprint, now) {
            // held between phases (with a live lease by this host's clock too: the database's clock decides)
            Decision::Resume { .. } | Decision::InFlight if record.phase.is_some() => {
                let held = record
                    .phase
                    .as_ref()
                    .map(|h| Held { attempt: h.attempt, resume_at: h.recovery_point.clone(), generation: h.generation })
                    .unwrap_or_default();
                take_over(&shared, inner, parts, body, uow, claim, held, deadline).await
            }
            Decision::Replay(stored) => {
                // as on the fast path: answered only once a synchronous standby has the record (bounded:
                // a standby that does not confirm is a prompt 503, not a request held open)
                drop(uow);
                if let Err(e) = shared.tm.confirm_replicated().await {
                    return store_failure(&e);
                }
                tracing::debug!(key = %claim.key, "idempotent replay");
                shared.replays.record(true);
                tagged(replay(stored), "replayed")
            }
            Decision::Conflict => tagged(
layer_problem(ProblemKind::IdempotencyKeyReused, config.conflict_status)
                .detail("this Idempotency-Key was already used with a different request; use a new key for a new operation")
                .into_response(),
                "conflict",
            ),
            Decision::Resume { .. } | Decision::InFlight | Decision::Execute => in_flight(),
        },
        Err(StoreError::LockTimeout) => in_flight(),
        Err(e) => store_failure(&e),
    }
}

/// What a held record says of the attempt that holds it.
#[derive(Default)]
struct Held {
    attempt: u32,
    resume_at: String,
    generation: Option<i64>,
}

/// Takes over a record held by `held` (its attempt and recovery point) when the database's clock says its
/// lease lapsed and its wait after an unknown outcome passed: the handler runs again from the recovery
/// point as the next attempt. A live lease is `409` in flight; a wait is `503` with the time left, and
/// nothing is sent meanwhile.
#[allow(clippy::too_many_arguments)]
async fn take_over<S>(
    shared: &Arc<Shared>,
    inner: S,
    parts: Parts,
    body: Bytes,
    mut uow: Box<dyn UnitOfWork>,
    claim: IdempotencyClaim,
    Held { attempt, resume_at, generation }: Held,
    deadline: tokio::time::Instant,
) -> Response
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Clone + Send,
    S::Future: Send,
{
    let config = &shared.config;
    match uow.idempotency().take_over(&claim.scope, &claim.key, attempt, config.lease, config.window).await {
        Ok(TakeOver::Taken { past_window }) => {
            let attempt = attempt + 1;
            tracing::info!(key = %claim.key, attempt, resume_at, past_window, "taking over a request whose attempt lost its lease");
            let run =
                Run { claim, attempt, past_window, generation, resume_at: Some(resume_at), claimed: true, deadline };
            match execute(shared, inner, parts, body, uow, Some(run)).await {
                Executed::Answer(response) => response,
                Executed::KeyTaken => in_flight(),
            }
        }
        // held, or locked by the live attempt's second phase (the claim's bounded lock wait ran out)
        Ok(TakeOver::Held) | Err(StoreError::LockTimeout) => in_flight(),
        Ok(TakeOver::Parked) => {
            let problem = Problem::new(ProblemKind::OutcomeUnknown, StatusCode::SERVICE_UNAVAILABLE)
                .detail("the request is parked for an operator (`idem keys held --parked`): nothing is sent until it is resumed or abandoned")
                .retry_after(3600);
            tagged(problem.into_response(), "in_flight")
        }
        Ok(TakeOver::NotBefore(wait)) => {
            let problem = Problem::new(ProblemKind::OutcomeUnknown, StatusCode::SERVICE_UNAVAILABLE)
                .detail("the other system's answer to this request is unknown and it asked to wait: retry with the same Idempotency-Key after Retry-After; nothing was sent")
                .retry_after(u32::try_from(wait.as_secs().max(1)).unwrap_or(u32::MAX));
            tagged(problem.into_response(), "in_flight")
        }
        Err(e) => store_failure(&e),
    }
}

/// See [`PhaseContext::unclaimed_key_wait`]: well below PostgreSQL's `deadlock_timeout` (1 s).
const UNCLAIMED_KEY_WAIT: Duration = Duration::from_millis(100);

/// What is left of a request's wait budget ending at `deadline`, for a lock wait on its key: at least
/// 100 ms, so a claim made late still waits for a concurrent transaction to end.
fn wait_left(deadline: tokio::time::Instant) -> Duration {
    deadline.saturating_duration_since(tokio::time::Instant::now()).max(Duration::from_millis(100))
}

/// One execution of a keyed request: its claim, attempt and recovery point, and whether the claim row is
/// already its own (claim first) or is inserted completed at the end (record at commit).
struct Run {
    claim: IdempotencyClaim,
    attempt: u32,
    past_window: bool,
    generation: Option<i64>,
    resume_at: Option<String>,
    claimed: bool,
    deadline: tokio::time::Instant,
}

/// How an execution ended.
enum Executed {
    /// The answer to send (executed, refused, failed).
    Answer(Response),
    /// Record at commit only: the key turned out taken (the record's insert or a first phase found it);
    /// everything was rolled back, nothing answered: decide again, claim first.
    KeyTaken,
}

async fn execute<S>(
    shared: &Shared,
    mut inner: S,
    parts: Parts,
    body: Bytes,
    uow: Box<dyn UnitOfWork>,
    run: Option<Run>,
) -> Executed
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Send,
    S::Future: Send,
{
    let phase = run.map(|run| {
        Arc::new(PhaseContext {
            tm: shared.tm.clone(),
            clock: shared.clock.clone(),
            lease: shared.config.lease,
            call_bound: shared.config.call_bound,
            past_window: run.past_window,
            generation: run.generation,
            attempt: run.attempt,
            resume_at: run.resume_at,
            entered: std::sync::atomic::AtomicBool::new(false),
            request: (
                parts.method.clone(),
                parts.uri.clone(),
                parts.headers.get(header::CONTENT_TYPE).cloned(),
                body.clone(),
            ),
            claim: run.claim,
            claimed: std::sync::atomic::AtomicBool::new(run.claimed),
            key_taken: std::sync::atomic::AtomicBool::new(false),
            deadline: run.deadline,
        })
    });
    let handle = UnitOfWorkHandle(Arc::new(Mutex::new(Some(uow))), Arc::default(), phase.clone());
    let route = parts.extensions.get::<axum::extract::MatchedPath>().map(|p| p.as_str().to_owned());
    let mut req = Request::from_parts(parts, Body::from(body));
    req.extensions_mut().insert(handle.clone());
    // driven to readiness here: a request decided again runs on a clone of the service
    let response = match tower::ServiceExt::ready(&mut inner).await {
        Ok(ready) => match ready.call(req).await {
            Ok(r) => r,
            Err(never) => match never {},
        },
        Err(never) => match never {},
    };
    let flag = |f: fn(&PhaseContext) -> &std::sync::atomic::AtomicBool| {
        phase.as_deref().is_some_and(|p| f(p).load(std::sync::atomic::Ordering::Relaxed))
    };
    if flag(|p| &p.key_taken) {
        drop(handle.0.lock().await.take()); // rolled back
        return Executed::KeyTaken;
    }
    let entered = flag(|p| &p.entered);
    let Some(mut uow) = handle.0.lock().await.take() else {
        if entered && !response.status().is_success() {
            // between the phases: the first is committed and the record held; the call may have been sent,
            // so the answer is an outcome unknown, and the retry resumes with the same downstream key
            return Executed::Answer(tagged(after_a_call(response), "phase_pending"));
        }
        return Executed::Answer(
            layer_problem(ProblemKind::Internal, StatusCode::INTERNAL_SERVER_ERROR).into_response(),
        );
    };
    // record at commit, nothing claimed yet: the record is inserted below (or the key found taken)
    let unclaimed = phase.as_deref().filter(|p| !p.claimed.load(std::sync::atomic::Ordering::Relaxed));
    let status = response.status();
    let commits = !status.is_server_error()
        && (!status.is_client_error() || response.extensions().get::<CommitRefusal>().is_some());
    if !commits {
        // A refusal on the record-at-commit path may come from the key being taken meanwhile (the
        // handler's writes met the other request's): decided again if a live record exists now.
        if let Some(p) = unclaimed {
            let now = shared.clock.now();
            match uow.idempotency().get(&p.claim.scope, &p.claim.key).await {
                Ok(Some(record)) if record.expires_at > now => return Executed::KeyTaken,
                Ok(_) => {}
                Err(_) => return Executed::KeyTaken, // an aborted unit cannot tell: decide again
            }
        }
        // Roll back the business effect and the claim: nothing is stored, a retry executes again.
        drop(uow);
        if entered {
            // a second phase that failed after its call: the record stays held at its recovery point
            return Executed::Answer(tagged(after_a_call(response), "phase_pending"));
        }
        let outcome = if status.is_server_error() { "failed" } else { "rejected_input" };
        return Executed::Answer(tagged(response, outcome));
    }
    if !handle.1.load(std::sync::atomic::Ordering::Relaxed) {
        // Its answer is stored, but whatever it wrote went through another connection: not atomic with the
        // record (a crash between the two commits loses one of them). Often deliberate (nothing to write).
        tracing::debug!(
            route = route.as_deref().unwrap_or("?"),
            "the handler answered without taking its unit of work (Tx): writes it made elsewhere are not atomic with the idempotency record"
        );
    }
    let (mut resp_parts, resp_body) = response.into_parts();
    let Ok(resp_bytes) = axum::body::to_bytes(resp_body, shared.config.max_response_body).await else {
        tracing::error!("response body too large to store; rolled back");
        return Executed::Answer(
            layer_problem(ProblemKind::Internal, StatusCode::INTERNAL_SERVER_ERROR).into_response(),
        );
    };
    if let Some(p) = phase.as_deref() {
        let stored = StoredResponse {
            status_code: resp_parts.status.as_u16(),
            headers: resp_parts
                .headers
                .iter()
                .filter(|(n, _)| REPLAYED_HEADERS.contains(&n.as_str()))
                .filter_map(|(n, v)| Some((n.as_str().to_owned(), v.to_str().ok()?.to_owned())))
                .collect(),
            body: resp_bytes.to_vec(),
        };
        if unclaimed.is_some() {
            let now = shared.clock.now();
            match uow.idempotency().insert_completed(&p.claim, &stored, now, p.unclaimed_key_wait()).await {
                Ok(ClaimOutcome::Claimed) => shared.replays.record(false),
                // the writes were made for a key another request took (or holds, uncommitted): rolled back,
                // so that request's wait on these rows ends, and decided again claim first
                Ok(ClaimOutcome::Existing(_)) | Err(StoreError::LockTimeout) => {
                    drop(uow);
                    return Executed::KeyTaken;
                }
                Err(e) => return Executed::Answer(store_failure(&e)),
            }
        } else if let Err(e) = uow.idempotency().complete(&p.claim.scope, &p.claim.key, &stored).await {
            let failed = store_failure(&e);
            return Executed::Answer(if entered { after_a_call(failed) } else { failed });
        }
    }
    if let Err(e) = uow.commit().await {
        // The COMMIT was sent: it may have been applied before the connection failed. Never claim that
        // nothing ran. A retry with the same key is safe either way: it replays the stored response if the
        // commit happened, or executes the request if it did not.
        tracing::warn!(error = %e, "commit failed; outcome unknown");
        let problem = layer_problem(ProblemKind::OutcomeUnknown, StatusCode::SERVICE_UNAVAILABLE)
            .detail(
                "the service lost its database connection while committing: the request may or may not have \
                 been executed; retry with the same Idempotency-Key (the retry replays the result or executes \
                 the request)",
            )
            .retry_after(1);
        return Executed::Answer(tagged(problem.into_response(), "outcome_unknown"));
    }
    resp_parts.headers.remove(header::CONTENT_LENGTH);
    Executed::Answer(tagged(Response::from_parts(resp_parts, Body::from(resp_bytes)), "executed"))
}

#[cfg(test)]
mod fast_path_tests {
    use super::ReplayShare;

    #[test]
    fn a_stored_json_body_loses_its_padding_and_nothing_else() {
        let padded = b" {\n \"amount\" :  \"1.00\",\t\"note\": \"a \\\" b  c\", \"n\": 0.10000000000000000001 }  ";
        let compact = super::compact_json(padded).unwrap_or_default();
        assert_eq!(compact, br#"{"amount":"1.00","note":"a \" b  c","n":0.10000000000000000001}"#.to_vec());
        let fp = |b: &[u8]| idem_domain::Fingerprint::of_request("POST", "/x", b);
        assert_eq!(fp(padded), fp(&compact), "the same request");
        assert_eq!(super::compact_json(b"not json"), None);
    }

    #[test]
    fn a_retry_storm_turns_the_fast_path_on_and_ordinary_traffic_off() {
        let share = ReplayShare::default();
        for _ in 0..1000 {
            share.record(false);
        }
        assert!(!share.storm(), "first executions alone");
        for _ in 0..20 {
            share.record(true);
        }
        assert!(share.storm(), "twenty replays in a row are a storm");
        for i in 0..1000 {
            share.record(i % 50 == 0); // 2 % replays: ordinary retries
        }
        assert!(!share.storm(), "a few retries among first executions");
    }
}
