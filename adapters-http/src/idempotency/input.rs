//! The request as the layer reads it: its key, its body (bounded, in time) and the route the default
//! fingerprint names it by; a JSON body compacted before it is stored for the completer.

#[allow(clippy::wildcard_imports)]
use super::*;

/// Path and query: what the default fingerprint names a request by.
pub(super) fn route_of(parts: &Parts) -> &str {
    parts.uri.path_and_query().map_or(parts.uri.path(), |pq| pq.as_str())
}

/// Reads exactly one `Idempotency-Key` header.
pub(super) fn read_key(headers: &HeaderMap) -> Result<IdempotencyKey, Problem> {
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

pub(super) fn too_large(limit: usize) -> Problem {
    layer_problem(ProblemKind::PayloadTooLarge, StatusCode::PAYLOAD_TOO_LARGE)
        .detail(format!("request bodies are limited to {limit} bytes"))
}

pub(super) async fn read_body(body: Body, headers: &HeaderMap, limit: usize) -> Result<Bytes, Problem> {
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large(limit));
    }
    axum::body::to_bytes(body, limit).await.map_err(|e| body_problem(e, limit))
}

/// Why a body could not be read: too large (`413`), not received within the body-read timeout (`408`;
/// it used to be answered `413`), or cut off (`400`). Nothing ran either way.
pub(super) fn body_problem(e: axum::Error, limit: usize) -> Problem {
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

/// `body` without the whitespace between JSON tokens (`None`: not JSON). Strings, numbers and the order of
/// keys are kept byte for byte, so the body means — and fingerprints — the same.
pub(super) fn compact_json(body: &[u8]) -> Option<Vec<u8>> {
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

#[cfg(test)]
mod tests {
    #[test]
    fn a_stored_json_body_loses_its_padding_and_nothing_else() {
        let padded = b" {\n \"amount\" :  \"1.00\",\t\"note\": \"a \\\" b  c\", \"n\": 0.10000000000000000001 }  ";
        let compact = super::compact_json(padded).unwrap_or_default();
        assert_eq!(compact, br#"{"amount":"1.00","note":"a \" b  c","n":0.10000000000000000001}"#.to_vec());
        let fp = |b: &[u8]| idem_domain::Fingerprint::of_request("POST", "/x", b);
        assert_eq!(fp(padded), fp(&compact), "the same request");
        assert_eq!(super::compact_json(b"not json"), None);
    }
}
