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

// The layer by mechanism: what it reads (`input`), decides (`claim`), runs and stores (`execute`), the
// phases around a foreign call (`phases`), what one process shares (`flight`) and its own answers (`answers`).
mod answers;
mod claim;
mod execute;
mod flight;
mod input;
mod phases;

use answers::*;
use claim::*;
use execute::*;
use flight::*;
use input::*;
use phases::*;
pub use phases::{ForeignCall, Tx, UnitOfWorkHandle};

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

    /// Leaves the body's JSON fields `fields` out of the fingerprint (a client timestamp, a request id in
    /// the body): a retry that changed only them, or left them out, replays instead of conflicting. A name
    /// with dots is a path into nested objects (`meta.sent_at`); every other value, numbers included, is
    /// fingerprinted exactly ([`Fingerprint::of_request_ignoring`]). The list applies to **every route of
    /// this layer**: give routes that need different lists layers of their own.
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
