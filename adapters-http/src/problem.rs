//! RFC 9457 problem details (`application/problem+json`), with a stable `type` per kind of error.

use std::borrow::Cow;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// Media type of problem responses.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The kinds of error the API answers with. Each has a stable `type` URI clients may match on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProblemKind {
    /// 401: missing or unknown API key.
    Unauthorized,
    /// 400: no `Idempotency-Key`.
    IdempotencyKeyMissing,
    /// 400: an invalid `Idempotency-Key`.
    IdempotencyKeyInvalid,
    /// 409 (or 422): the key was used with another request.
    IdempotencyKeyReused,
    /// 422: a UUID v7 key older than the retention.
    IdempotencyKeyExpired,
    /// 422: a UUID v7 Idempotency-Key dated further ahead than clocks drift.
    IdempotencyKeyFutureDated,
    /// 409: a request with the key is in flight.
    RequestInFlight,
    /// 503: the database is unreachable.
    StoreUnavailable,
    /// 503: the commit's outcome is unknown.
    OutcomeUnknown,
    /// 429: too many requests of this merchant in progress.
    TooManyRequests,
    /// 413: body too large.
    PayloadTooLarge,
    /// 408: the body did not arrive within the body-read timeout.
    RequestTimeout,
    /// 415: not JSON.
    UnsupportedMediaType,
    /// 400: malformed JSON.
    MalformedJson,
    /// 422: a field is missing or invalid.
    InvalidField,
    /// 404.
    NotFound,
    /// 405.
    MethodNotAllowed,
    /// 409: the provider payment id belongs to another payment.
    PaymentConflict,
    /// 409: more than is left to refund.
    RefundExceedsCaptured,
    /// 409: the payment cannot be refunded.
    RefundNotAllowed,
    /// 409: a refund finer than the payment's currency.
    AmountFinerThanCurrency,
    /// 402: the payment provider declined the charge (a final answer, replayed).
    CardDeclined,
    /// 400/401: a webhook whose signature is missing, wrong or too old.
    WebhookSignatureInvalid,
    /// 409: an operator ended a request parked between its phases (`idem keys abandon`), after checking
    /// the other side; replayed to every retry.
    RequestAbandoned,
    /// 500.
    Internal,
}

impl ProblemKind {
    /// Every kind (the API document lists their type URIs).
    pub const ALL: [Self; 25] = [
        Self::Unauthorized,
        Self::IdempotencyKeyMissing,
        Self::IdempotencyKeyInvalid,
        Self::IdempotencyKeyReused,
        Self::IdempotencyKeyExpired,
        Self::IdempotencyKeyFutureDated,
        Self::RequestInFlight,
        Self::StoreUnavailable,
        Self::OutcomeUnknown,
        Self::TooManyRequests,
        Self::PayloadTooLarge,
        Self::RequestTimeout,
        Self::UnsupportedMediaType,
        Self::MalformedJson,
        Self::InvalidField,
        Self::NotFound,
        Self::MethodNotAllowed,
        Self::PaymentConflict,
        Self::RefundExceedsCaptured,
        Self::RefundNotAllowed,
        Self::AmountFinerThanCurrency,
        Self::CardDeclined,
        Self::WebhookSignatureInvalid,
        Self::RequestAbandoned,
        Self::Internal,
    ];

    /// The stable `type` URI.
    pub fn type_uri(self) -> &'static str {
        match self {
            Self::Unauthorized => "urn:idem:problem:unauthorized",
            Self::IdempotencyKeyMissing => "urn:idem:problem:idempotency-key-missing",
            Self::IdempotencyKeyInvalid => "urn:idem:problem:idempotency-key-invalid",
            Self::IdempotencyKeyReused => "urn:idem:problem:idempotency-key-reused",
            Self::IdempotencyKeyExpired => "urn:idem:problem:idempotency-key-expired",
            Self::IdempotencyKeyFutureDated => "urn:idem:problem:idempotency-key-future-dated",
            Self::RequestInFlight => "urn:idem:problem:request-in-flight",
            Self::StoreUnavailable => "urn:idem:problem:service-unavailable",
            Self::OutcomeUnknown => "urn:idem:problem:outcome-unknown",
            Self::TooManyRequests => "urn:idem:problem:too-many-requests",
            Self::PayloadTooLarge => "urn:idem:problem:payload-too-large",
            Self::RequestTimeout => "urn:idem:problem:request-timeout",
            Self::UnsupportedMediaType => "urn:idem:problem:unsupported-media-type",
            Self::MalformedJson => "urn:idem:problem:malformed-json",
            Self::InvalidField => "urn:idem:problem:invalid-field",
            Self::NotFound => "urn:idem:problem:not-found",
            Self::MethodNotAllowed => "urn:idem:problem:method-not-allowed",
            Self::PaymentConflict => "urn:idem:problem:payment-conflict",
            Self::RefundExceedsCaptured => "urn:idem:problem:refund-exceeds-captured",
            Self::RefundNotAllowed => "urn:idem:problem:refund-not-allowed",
            Self::AmountFinerThanCurrency => "urn:idem:problem:amount-finer-than-currency",
            Self::CardDeclined => "urn:idem:problem:card-declined",
            Self::WebhookSignatureInvalid => "urn:idem:problem:webhook-signature-invalid",
            Self::RequestAbandoned => "urn:idem:problem:request-abandoned",
            Self::Internal => "urn:idem:problem:internal",
        }
    }

    /// The human-readable summary (`title`).
    pub fn title(self) -> &'static str {
        match self {
            Self::Unauthorized => "The request is not authenticated",
            Self::IdempotencyKeyMissing => "Idempotency-Key header is required",
            Self::IdempotencyKeyInvalid => "Idempotency-Key header is invalid",
            Self::IdempotencyKeyReused => "Idempotency-Key was already used with a different request",
            Self::IdempotencyKeyExpired => "Idempotency-Key is older than the retention of idempotency records",
            Self::IdempotencyKeyFutureDated => "Idempotency-Key is dated in the future",
            Self::RequestInFlight => "A request with this Idempotency-Key is still being processed",
            Self::StoreUnavailable => "Service temporarily unavailable",
            Self::OutcomeUnknown => "The outcome of the request is unknown",
            Self::TooManyRequests => "Too many requests in progress",
            Self::PayloadTooLarge => "Request body too large",
            Self::RequestTimeout => "Request body not received in time",
            Self::UnsupportedMediaType => "Request body must be application/json",
            Self::MalformedJson => "Request body is not valid JSON",
            Self::InvalidField => "Request field is missing or invalid",
            Self::NotFound => "Not found",
            Self::MethodNotAllowed => "Method not allowed",
            Self::PaymentConflict => "A different payment already uses this provider payment id",
            Self::RefundExceedsCaptured => "Refund exceeds what is left to refund",
            Self::RefundNotAllowed => "Payment cannot be refunded",
            Self::AmountFinerThanCurrency => "Amount is finer than the payment's currency allows",
            Self::CardDeclined => "The payment provider declined the charge",
            Self::WebhookSignatureInvalid => "Webhook signature is missing, invalid or too old",
            Self::RequestAbandoned => "The request was abandoned by an operator",
            Self::Internal => "Internal error",
        }
    }
}

/// Marks a 4xx answer to be **committed**: the writes the handler made and the answer itself are stored, and
/// a retry with the key replays the refusal. Without it a 4xx rolls back and stores nothing, like a 5xx: the
/// key stays free and a retry executes again (after the client corrected the request, or the state it
/// depended on changed). Set it with [`Problem::commit`], or put it in any response tuple
/// (`(CommitRefusal, StatusCode::CONFLICT, body)`).
#[derive(Debug, Clone, Copy)]
pub struct CommitRefusal;

impl axum::response::IntoResponseParts for CommitRefusal {
    type Error = std::convert::Infallible;

    fn into_response_parts(
        self,
        mut res: axum::response::ResponseParts,
    ) -> Result<axum::response::ResponseParts, Self::Error> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}

/// A problem response.
#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    type_uri: Cow<'static, str>,
    title: Cow<'static, str>,
    status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
    /// The request field at fault, for validation problems.
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<String>,
    #[serde(skip)]
    kind: Option<ProblemKind>,
    #[serde(skip)]
    retry_after_secs: Option<u32>,
    #[serde(skip)]
    no_store: bool,
    #[serde(skip)]
    commit: bool,
}

impl Problem {
    /// A problem of one of idem's kinds.
    pub fn new(kind: ProblemKind, status: StatusCode) -> Self {
        let mut problem = Self::custom(kind.type_uri(), kind.title(), status);
        problem.kind = Some(kind);
        problem
    }

    /// A problem of the application's own: its type URI (`https://example.com/problems/out-of-stock`, or a
    /// URN), a short human-readable title, and the status. Like every 4xx and 5xx answer, it rolls back
    /// under the idempotency layer unless [`Problem::commit`] says otherwise.
    pub fn custom(
        type_uri: impl Into<Cow<'static, str>>,
        title: impl Into<Cow<'static, str>>,
        status: StatusCode,
    ) -> Self {
        Self {
            type_uri: type_uri.into(),
            title: title.into(),
            status: status.as_u16(),
            detail: None,
            field: None,
            kind: None,
            retry_after_secs: None,
            no_store: false,
            commit: false,
        }
    }

    /// Commits this refusal under the idempotency layer (see [`CommitRefusal`]): the handler's writes and
    /// this answer are stored, and a retry with the key replays it. Only for refusals that must stay the
    /// answer to this key whatever happens later; by default a refusal rolls back and leaves the key free.
    pub fn commit(mut self) -> Self {
        self.commit = true;
        self
    }

    /// The type URI.
    pub fn type_uri(&self) -> &str {
        &self.type_uri
    }

    /// Sets `detail`.
    pub fn detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Sets `field`: the request field at fault.
    pub fn field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    /// Adds `Retry-After: secs`.
    pub fn retry_after(mut self, secs: u32) -> Self {
        self.retry_after_secs = Some(secs);
        self
    }

    /// Marks the answer as not cacheable (`Cache-Control: no-store`): used for the idempotency layer's own
    /// answers, which describe a transient state of the key.
    pub fn no_store(mut self) -> Self {
        self.no_store = true;
        self
    }

    /// The kind, when one of idem's.
    pub fn kind(&self) -> Option<ProblemKind> {
        self.kind
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = serde_json::to_vec(&self).unwrap_or_else(|_| b"{}".to_vec());
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(secs) = self.retry_after_secs {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.no_store {
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        }
        if status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if self.commit {
            response.extensions_mut().insert(CommitRefusal);
        }
        if let Some(kind) = self.kind {
            response.extensions_mut().insert(kind);
        }
        response
    }
}

/// `axum::Json` whose rejections are problem+json with the right status: 415 `unsupported-media-type` (no
/// JSON content type), 400 `malformed-json` (not JSON), 422 `invalid-field` (JSON of the wrong shape: a
/// missing, unknown or mistyped field), 413 `payload-too-large`. Under the idempotency layer a rejection
/// rolls back like any 4xx: the key stays free for the corrected request.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProblemJson<T>(pub T);

impl<T, S> axum::extract::FromRequest<S> for ProblemJson<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = Problem;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Problem> {
        use axum::extract::rejection::JsonRejection;
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(value)) => Ok(Self(value)),
            Err(rejection) => {
                let (kind, status) = match &rejection {
                    JsonRejection::MissingJsonContentType(_) => {
                        (ProblemKind::UnsupportedMediaType, StatusCode::UNSUPPORTED_MEDIA_TYPE)
                    }
                    JsonRejection::JsonDataError(_) => (ProblemKind::InvalidField, StatusCode::UNPROCESSABLE_ENTITY),
                    r if r.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                        (ProblemKind::PayloadTooLarge, StatusCode::PAYLOAD_TOO_LARGE)
                    }
                    _ => (ProblemKind::MalformedJson, StatusCode::BAD_REQUEST),
                };
                Err(Problem::new(kind, status).detail(rejection.body_text()))
            }
        }
    }
}
