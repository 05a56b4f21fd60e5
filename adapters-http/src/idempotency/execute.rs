//! One execution of a keyed request: the handler run on its unit of work, then its answer stored and
//! committed with its effects, or everything rolled back (refusals, failures, a key taken meanwhile).

#[allow(clippy::wildcard_imports)]
use super::*;

/// One execution of a keyed request: its claim, attempt and recovery point, and whether the claim row is
/// already its own (claim first) or is inserted completed at the end (record at commit).
pub(super) struct Run {
    pub(super) claim: IdempotencyClaim,
    pub(super) attempt: u32,
    pub(super) past_window: bool,
    pub(super) generation: Option<i64>,
    pub(super) resume_at: Option<String>,
    pub(super) claimed: bool,
    pub(super) deadline: tokio::time::Instant,
}

/// How an execution ended.
pub(super) enum Executed {
    /// The answer to send (executed, refused, failed).
    Answer(Response),
    /// Record at commit only: the key turned out taken (the record's insert or a first phase found it);
    /// everything was rolled back, nothing answered: decide again, claim first.
    KeyTaken,
}

pub(super) async fn execute<S>(
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
