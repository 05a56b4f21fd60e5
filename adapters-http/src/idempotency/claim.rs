//! The claim sequence: a key's request decided once — the replay fast path, the in-process leader, the
//! record-at-commit run, then claim first: a new key claimed (its token taken), a live record replayed,
//! refused as a conflict, taken over after its lease lapsed on the database's clock, or answered in flight.

#[allow(clippy::wildcard_imports)]
use super::*;
use idem_domain::usecases::{KeyClaim, claim_for, claim_key};

pub(super) async fn handle<S>(shared: Arc<Shared>, inner: S, req: Request<Body>) -> Response
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
    // a key dated ahead (within the margin) is accepted until its own time + TTL: its record lives as long
    let claim = claim_for(&scope, &key, &fingerprint, &config.ttl, now);
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
    match claim_key(uow.as_mut(), &claim, &key, &config.ttl, now, claim_wait).await {
        Ok(KeyClaim::Expired) => refuse_expired(),
        Ok(KeyClaim::Claimed) => {
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
        Ok(KeyClaim::Existing(record)) => match decide(Some(&record), &fingerprint, now) {
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
pub(super) struct Held {
    attempt: u32,
    resume_at: String,
    generation: Option<i64>,
}

/// Takes over a record held by `held` (its attempt and recovery point) when the database's clock says its
/// lease lapsed and its wait after an unknown outcome passed: the handler runs again from the recovery
/// point as the next attempt. A live lease is `409` in flight; a wait is `503` with the time left, and
/// nothing is sent meanwhile.
#[allow(clippy::too_many_arguments)]
pub(super) async fn take_over<S>(
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
pub(super) const UNCLAIMED_KEY_WAIT: Duration = Duration::from_millis(100);

/// What is left of a request's wait budget ending at `deadline`, for a lock wait on its key: at least
/// 100 ms, so a claim made late still waits for a concurrent transaction to end.
pub(super) fn wait_left(deadline: tokio::time::Instant) -> Duration {
    deadline.saturating_duration_since(tokio::time::Instant::now()).max(Duration::from_millis(100))
}
