//! HTTP adapter (axum + tower): the payments API and the reusable idempotency layer.
//!
//! API boundary: [`router`] builds the service's router; [`IdempotencyLayer`] and its [`Tx`] extractor can
//! be added to any axum router whose handlers write through an [`idem_ports::UnitOfWork`].

#![warn(missing_docs)]

pub mod api;
pub mod auth;
pub mod client;
pub mod completer;
pub mod idempotency;
pub mod metrics;
pub mod openapi;
pub mod problem;
pub mod quota;
pub mod reconcile;
pub mod server;
pub mod trace;
pub mod webhooks;

use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::middleware;
use axum::response::IntoResponse;
use axum::routing::{get, post};

pub use api::ApiState;
pub use auth::{ApiKeys, Merchant};
pub use idempotency::{
    FastPath, FingerprintFn, ForeignCall, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyConfig, IdempotencyLayer,
    ScopeFn, Tx,
};
pub use metrics::HttpMetrics;
pub use problem::{CommitRefusal, PROBLEM_JSON, Problem, ProblemJson, ProblemKind};

/// The principal of a re-sent request of the payments API ([`completer::Completer`]): the merchant of its scope.
pub fn merchant_principal() -> completer::PrincipalFn {
    Arc::new(|scope, extensions| {
        extensions.insert(Merchant(scope.into()));
    })
}

/// The scope function of the payments API: the authenticated merchant.
pub fn merchant_scope() -> ScopeFn {
    Arc::new(|parts| parts.extensions.get::<Merchant>().map(|m| m.0.to_string()))
}

/// The payments API. `idempotency` wraps the two POST routes (use [`IdempotencyLayer::transaction_only`]
/// to switch keys off); authentication wraps everything.
pub fn router(state: ApiState, keys: Arc<ApiKeys>, idempotency: IdempotencyLayer) -> Router {
    router_with_metrics(state, keys, idempotency, HttpMetrics::default())
}

/// [`router`], counting requests and idempotency outcomes into `metrics`.
pub fn router_with_metrics(
    state: ApiState,
    keys: Arc<ApiKeys>,
    idempotency: IdempotencyLayer,
    metrics: HttpMetrics,
) -> Router {
    let idempotency = idempotency.with_metrics(metrics.clone());
    let with_provider = state.provider.is_some();
    // Layer order: authentication (outer, on every route) runs first, so the idempotency layer (inner,
    // route_layer on the POST routes only) can scope keys by the merchant it established.
    let commands = Router::new()
        .route("/payments", post(api::charge))
        .route("/payments/{id}/refund", post(api::refund))
        .route_layer(idempotency);
    Router::new()
        .route("/payments/{id}", get(api::get_payment))
        .merge(commands)
        .layer(middleware::from_fn_with_state(keys, auth::authenticate))
        .route(
            "/openapi.json",
            get(move || async move {
                ([(axum::http::header::CONTENT_TYPE, "application/json")], openapi::json(with_provider))
            }),
        )
        .route_layer(middleware::from_fn_with_state(metrics, metrics::track))
        .method_not_allowed_fallback(|| async {
            Problem::new(ProblemKind::MethodNotAllowed, StatusCode::METHOD_NOT_ALLOWED).into_response()
        })
        .fallback(|| async { Problem::new(ProblemKind::NotFound, StatusCode::NOT_FOUND).into_response() })
        .with_state(state)
}
