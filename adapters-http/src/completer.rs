//! The completer: finishes requests whose attempt died between the phases of a foreign call and whose
//! client did not come back (README, "Calling other systems").
//!
//! A request held between phases keeps what started it (method, path, content type, body; see
//! [`crate::Tx::foreign_call`]). When its lease lapsed more than a grace period ago — the client had its
//! chance to retry — the completer re-sends that request through the service's own router, marked
//! [`Completing`] and carrying the principal of its scope: the idempotency layer takes the record over like
//! any retry (with the next attempt number, so a late original stays fenced out) and the handler resumes at
//! its recovery point with the same downstream key, so the other side deduplicates the call. Its answer is
//! stored as the retry's would be; the client's next retry replays it.
//!
//! While the outcome stays unknown the record is tried again with exponential backoff (grace × 2^runs, at
//! most `max_backoff`), for as long as the other side's own idempotency window (`window`, counted from the
//! claim) allows; past it a repeat could act twice, so the record is **parked** for an operator (`idem keys
//! held`, `resume`, `abandon`): never silently failed, never cleaned up.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, header};
use idem_ports::{Clock, LapsedRecord, StoreError, TransactionManager};
use prometheus_client::metrics::counter::Counter;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// Marks a request the completer re-sends (a request extension, which no client can set): the
/// authentication middleware accepts the principal the completer put on it.
#[derive(Debug, Clone, Copy)]
pub struct Completing;

/// Puts the principal of a scope on a re-sent request (for the payments API: the [`crate::Merchant`]).
pub type PrincipalFn = Arc<dyn Fn(&str, &mut axum::http::Extensions) + Send + Sync>;

/// How the completer works.
#[derive(Debug, Clone, Copy)]
pub struct CompleterSettings {
    /// How often it looks for lapsed records (`COMPLETER_INTERVAL`, 10 s by default).
    pub interval: Duration,
    /// How long after a lease lapsed the client is taken to have gone away (and the first backoff step).
    pub grace: Duration,
    /// The longest wait between two runs on one record.
    pub max_backoff: Duration,
    /// How long after its claim a record may still be re-sent: the other side's idempotency window (24 h at
    /// Stripe) with a margin. Past it the record is parked.
    pub window: Duration,
    /// Records per round, taken round-robin over merchants (scopes).
    pub batch: i64,
    /// Records re-sent at once within a round.
    pub concurrency: usize,
    /// Longest time one re-sent request may take.
    pub request_timeout: Duration,
}

impl Default for CompleterSettings {
    /// Every 10 s; grace 30 s; backoff up to 15 min; window 23 h; 16 records a round, 4 at once; 60 s a
    /// request.
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            grace: Duration::from_secs(30),
            max_backoff: Duration::from_secs(15 * 60),
            window: Duration::from_secs(23 * 3600),
            batch: 16,
            concurrency: 4,
            request_timeout: Duration::from_secs(60),
        }
    }
}

/// What the completer did, for metrics.
#[derive(Debug, Default)]
pub struct CompleterStats {
    /// Records it drove to a stored answer.
    pub completed: Counter,
    /// Runs that ended with the outcome still unknown (tried again after the backoff).
    pub unknown: Counter,
    /// Records it parked for an operator.
    pub parked: Counter,
    /// Rounds that failed (the store was unreachable).
    pub failed_rounds: Counter,
}

impl CompleterStats {
    /// Registers the counters (`idem_completer_*`).
    pub fn register(self: &Arc<Self>, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "idem_completer_completed",
            "Held requests the completer drove to a stored answer",
            self.completed.clone(),
        );
        registry.register(
            "idem_completer_unknown",
            "Completer runs whose outcome stayed unknown",
            self.unknown.clone(),
        );
        registry.register(
            "idem_completer_parked",
            "Held requests the completer parked for an operator",
            self.parked.clone(),
        );
        registry.register("idem_completer_failed_rounds", "Completer rounds that failed", self.failed_rounds.clone());
    }
}

/// What one round did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Round {
    /// Records answered for good.
    pub completed: usize,
    /// Records whose outcome stayed unknown.
    pub unknown: usize,
    /// Records parked.
    pub parked: usize,
}

/// Drives lapsed records to completion through `router` (the service's own, with its idempotency layer).
#[derive(Clone)]
pub struct Completer {
    tm: Arc<dyn TransactionManager>,
    clock: Arc<dyn Clock>,
    router: axum::Router,
    principal: PrincipalFn,
    settings: CompleterSettings,
    stats: Arc<CompleterStats>,
}

impl std::fmt::Debug for Completer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completer").field("settings", &self.settings).finish_non_exhaustive()
    }
}

impl Completer {
    /// A completer re-sending through `router`, putting each scope's principal on with `principal`.
    pub fn new(
        tm: Arc<dyn TransactionManager>,
        clock: Arc<dyn Clock>,
        router: axum::Router,
        principal: PrincipalFn,
        settings: CompleterSettings,
    ) -> Self {
        Self { tm, clock, router, principal, settings, stats: Arc::default() }
    }

    /// Its counters (register them where metrics are exported).
    pub fn stats(&self) -> Arc<CompleterStats> {
        self.stats.clone()
    }

    /// Rounds every `interval` until `shutdown`.
    pub async fn run_until(self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(self.settings.interval) => {}
            }
            if let Err(e) = self.round().await {
                self.stats.failed_rounds.inc();
                tracing::warn!(error = %e, "completer round failed");
            }
        }
    }

    /// One round: the lapsed records (their runs counted before they are re-sent, so a crash mid-run still
    /// backs off), each parked or re-sent.
    pub async fn round(&self) -> Result<Round, StoreError> {
        let now = self.clock.now();
        let mut uow = self.tm.begin().await?;
        let s = &self.settings;
        let lapsed = uow.idempotency().lapsed(now, s.grace, s.max_backoff, s.batch).await?;
        let mut round = Round::default();
        let mut to_send = Vec::new();
        for record in lapsed {
            let age = (now - record.created_at).to_std().unwrap_or_default();
            let reason = match &record.request {
                _ if age > s.window => Some("past the other side's idempotency window: a repeat could act twice"),
                None => Some("no request kept to re-send"),
                Some(_) => None,
            };
            if let Some(reason) = reason {
                if uow.idempotency().park(&record.scope, &record.key, reason, now).await? {
                    tracing::warn!(scope = %record.scope, key = %record.key.escape_debug(), reason, "held request parked for an operator");
                    round.parked += 1;
                    self.stats.parked.inc();
                }
                continue;
            }
            uow.idempotency().completer_ran(&record.scope, &record.key).await?;
            to_send.push(record);
        }
        uow.commit().await?;
        use futures::StreamExt as _;
        let this = self;
        let done: Vec<bool> = futures::stream::iter(to_send)
            .map(|record| async move { this.resend(&record).await })
            .buffer_unordered(s.concurrency.max(1))
            .collect()
            .await;
        for finished in done {
            if finished {
                round.completed += 1;
                self.stats.completed.inc();
            } else {
                round.unknown += 1;
                self.stats.unknown.inc();
            }
        }
        Ok(round)
    }

    /// Re-sends one held request; true when its answer is final (stored).
    async fn resend(&self, record: &LapsedRecord) -> bool {
        let Some(stored) = &record.request else { return false };
        let mut builder = Request::builder()
            .method(stored.method.as_str())
            .uri(stored.uri.as_str())
            .header(crate::IDEMPOTENCY_KEY, record.key.as_str());
        if let Some(ct) = &stored.content_type {
            builder = builder.header(header::CONTENT_TYPE, ct.as_str());
        }
        let Ok(mut request) = builder.body(Body::from(stored.body.clone())) else {
            tracing::error!(scope = %record.scope, "a held request cannot be rebuilt");
            return false;
        };
        request.extensions_mut().insert(Completing);
        (self.principal)(&record.scope, request.extensions_mut());
        let sent = tokio::time::timeout(self.settings.request_timeout, self.router.clone().oneshot(request)).await;
        let status = match sent {
            Ok(Ok(response)) => response.status(),
            Ok(Err(never)) => match never {},
            Err(_) => {
                tracing::warn!(scope = %record.scope, key = %record.key.escape_debug(), "re-sent request timed out");
                return false;
            }
        };
        let done =
            status.is_success() || (status.is_client_error() && !matches!(status.as_u16(), 408 | 409 | 425 | 429));
        tracing::info!(scope = %record.scope, key = %record.key.escape_debug(), status = status.as_u16(), done, completer_runs = record.completer_runs + 1, "completer re-sent a held request");
        done
    }
}
