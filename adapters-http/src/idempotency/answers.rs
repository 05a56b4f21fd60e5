//! The answers the layer makes itself (never stored, `Cache-Control: no-store`), tagged with their outcome
//! for the metrics, and a stored answer replayed.

#[allow(clippy::wildcard_imports)]
use super::*;

/// What the layer did with a request, carried on the response to the metrics.
#[derive(Debug, Clone, Copy)]
pub(super) struct LayerOutcome(pub(super) &'static str);

pub(super) fn tagged(mut response: Response, outcome: &'static str) -> Response {
    response.extensions_mut().insert(LayerOutcome(outcome));
    response
}

pub(super) fn layer_problem(kind: ProblemKind, status: StatusCode) -> Problem {
    Problem::new(kind, status).no_store()
}

pub(super) fn unavailable(err: &StoreError) -> Response {
    tracing::warn!(error = %err, "idempotency store unavailable");
    let problem = layer_problem(ProblemKind::StoreUnavailable, StatusCode::SERVICE_UNAVAILABLE)
        .detail("the request was not executed; retry with the same Idempotency-Key")
        .retry_after(1);
    tagged(problem.into_response(), "unavailable")
}

pub(super) fn store_failure(err: &StoreError) -> Response {
    if err.is_transient() {
        return unavailable(err);
    }
    tracing::error!(error = %err, "idempotency store failed");
    tagged(layer_problem(ProblemKind::Internal, StatusCode::INTERNAL_SERVER_ERROR).into_response(), "failed")
}

pub(super) fn in_flight() -> Response {
    let problem = layer_problem(ProblemKind::RequestInFlight, StatusCode::CONFLICT)
        .detail("a request with this Idempotency-Key is still being processed; retry later")
        .retry_after(1);
    tagged(problem.into_response(), "in_flight")
}

pub(super) fn replay(stored: &StoredResponse) -> Response {
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
