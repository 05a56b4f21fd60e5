//! Phases around a call to another system: the handler's [`Tx`], its [`Tx::foreign_call`] (the first phase,
//! the lease confirmed on the database's clock, renewals), the ways a call ends (unknown, unanswered,
//! parked) and [`Tx::resume`] (the fenced second phase).

#[allow(clippy::wildcard_imports)]
use super::*;

/// The unit of work handed to the handler (request extension). The layer keeps the other reference and
/// takes the unit back after the handler returned.
#[derive(Clone)]
pub struct UnitOfWorkHandle(
    pub(super) Arc<Mutex<Option<Box<dyn UnitOfWork>>>>,
    pub(super) Arc<std::sync::atomic::AtomicBool>,
    pub(super) Option<Arc<PhaseContext>>,
);

/// What a handler needs to cut its request in phases around a foreign call ([`Tx::foreign_call`]).
pub(super) struct PhaseContext {
    pub(super) tm: Arc<dyn TransactionManager>,
    pub(super) clock: Arc<dyn Clock>,
    pub(super) lease: Duration,
    /// [`IdempotencyConfig::call_bound`].
    pub(super) call_bound: Duration,
    /// Taken over past the other side's window ([`ForeignCall::past_window`]).
    pub(super) past_window: bool,
    /// Which claim of the key this is ([`PhaseHold::generation`]): names derive from it.
    pub(super) generation: Option<i64>,
    /// This execution's attempt (1, or one more than the attempt it took over).
    pub(super) attempt: u32,
    /// The recovery point a taken-over record had reached.
    pub(super) resume_at: Option<String>,
    /// The handler committed a first phase.
    pub(super) entered: std::sync::atomic::AtomicBool,
    /// The request, kept as cheap clones (shared buffers) until a first phase stores it for the completer.
    pub(super) request: (http::Method, http::Uri, Option<http::HeaderValue>, Bytes),
    /// The key's claim: made before the handler (claim first), or by the layer at the end or by a first
    /// phase ([`Tx::foreign_call`]) on the record-at-commit path.
    pub(super) claim: IdempotencyClaim,
    /// The claim row is this unit's (always on the claim-first path).
    pub(super) claimed: std::sync::atomic::AtomicBool,
    /// Record at commit: a first phase found the key taken (its writes roll back, the request is decided
    /// again on the claim-first path).
    pub(super) key_taken: std::sync::atomic::AtomicBool,
    /// The end of the request's wait budget (bounds the lock wait of a claim made later).
    pub(super) deadline: tokio::time::Instant,
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
    pub(super) fn claim_wait(&self) -> Duration {
        wait_left(self.deadline)
    }

    /// The wait for the key of a request recorded at commit, whose handler may hold row locks by then:
    /// short, so the two claim paths wait for locks in one order. A claim-first request takes the key,
    /// then its rows; this one took rows first, so it does not wait on the key for long (a claim-first
    /// request holding the key may be waiting for these rows: a deadlock, 1 s until PostgreSQL breaks
    /// it) but rolls back and is decided again claim first, key first. (A handler that held its rows
    /// about `deadlock_timeout` before this wait can still meet PostgreSQL's detector first: the
    /// claim-first request is then the one rolled back, `503`, and its retry replays.)
    pub(super) fn unclaimed_key_wait(&self) -> Duration {
        self.claim_wait().min(UNCLAIMED_KEY_WAIT)
    }

    /// The request as the completer re-sends it.
    pub(super) fn stored_request(&self) -> StoredRequest {
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
    pub(super) async fn confirm_lease(&self, step: &str) -> Result<bool, StoreError> {
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
    pub(super) fn hold(&self, step: &str) -> PhaseHold {
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
pub(super) fn after_a_call(response: Response) -> Response {
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

/// The answer of an attempt whose record another attempt took over (it lost its lease).
pub(super) fn taken_over() -> Problem {
    Problem::new(ProblemKind::OutcomeUnknown, StatusCode::SERVICE_UNAVAILABLE)
        .detail("another attempt took this request over; retry with the same Idempotency-Key to get its answer")
        .retry_after(1)
}

pub(super) fn phase_store_problem(e: &StoreError) -> Problem {
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
