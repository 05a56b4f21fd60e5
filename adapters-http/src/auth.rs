//! Bearer API keys mapped to merchants.
//!
//! # Capacity and tenants
//!
//! - Two pools: HTTP uses `DATABASE_MAX_CONNECTIONS`; the consumer, relay, cleaner and readiness use
//!   `DATABASE_BACKGROUND_CONNECTIONS` — neither side can starve the other. Every session has
//!   `statement_timeout` 30 s and `idle_in_transaction_session_timeout` 60 s (migrations run on a dedicated
//!   connection without the statement timeout).
//! - A duplicate of a key this process is executing waits in process (`InFlight` in `idempotency.rs`), holding
//!   no connection, then claims in the database, which stays authoritative across instances.
//! - Each merchant has at most `MERCHANT_CONCURRENCY` requests in progress; beyond that 429 problem+json with
//!   `Retry-After` (`auth.rs`).
//! - `UNIQUE (provider, external_payment_id)` is global (the second protection of money). A merchant that
//!   presents another merchant's provider payment id gets the same generic 409 whatever the other payment
//!   holds, and a `security_event="provider_payment_id_collision"` log line (merchants and provider, never
//!   keys or amounts). Compensations from the orders topic only ever touch `ORDERS_MERCHANT_ID`'s payments.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use crate::problem::{Problem, ProblemKind};

/// The merchant a request is authenticated as; the idempotency scope and the owner of its payments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Merchant(pub Arc<str>);

/// API keys → merchants. Keys are kept only as SHA-256 digests, so neither `Debug` nor a heap dump shows
/// them, and lookups do not compare secrets byte by byte.
///
/// Each merchant may also have a bound on its requests in progress ([`ApiKeys::with_concurrency_limit`]):
/// beyond it a request is answered 429 with `Retry-After` at once, so one merchant's burst can never hold
/// the connections and workers every other merchant needs.
#[derive(Clone, Default)]
pub struct ApiKeys {
    by_digest: HashMap<[u8; 32], Merchant>,
    limits: HashMap<Arc<str>, Arc<tokio::sync::Semaphore>>,
    /// Requests refused 401 (a missing, malformed or unknown key): a guessing client shows here.
    failures: prometheus_client::metrics::counter::Counter,
}

/// The shortest API key accepted: 16 characters, about 105 bits when drawn at random from printable ASCII
/// (`openssl rand -base64 24` gives 32 characters, 192 bits). Eight characters, the old minimum, are within
/// reach of a guessing client.
pub const MIN_KEY_LEN: usize = 16;

impl fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut merchants: Vec<&str> = self.by_digest.values().map(|m| &*m.0).collect();
        merchants.sort_unstable();
        f.debug_struct("ApiKeys").field("merchants", &merchants).finish()
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl ApiKeys {
    /// Parses `merchant_a:key_a,merchant_b:key_b`. Merchant names are 1–64 characters of `A-Z a-z 0-9 _ -`;
    /// keys are [`MIN_KEY_LEN`] to 256 printable ASCII characters and unique. A key may be given as its SHA-256 digest,
    /// `merchant:sha256:<64 hex digits>`, so that the configuration holds no usable key (only the digest
    /// is ever kept either way).
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut by_digest = HashMap::new();
        for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (merchant, key) =
                pair.split_once(':').ok_or_else(|| "IDEM_API_KEYS entries must be merchant:key".to_owned())?;
            let (merchant, key) = (merchant.trim(), key.trim());
            let name_ok = (1..=64).contains(&merchant.len())
                && merchant.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if !name_ok {
                return Err("IDEM_API_KEYS merchant names must be 1-64 characters of A-Z, a-z, 0-9, '_' or '-'".into());
            }
            // Anything that starts like a digest is one or an error: a mistyped digest (63 digits, a stray
            // character) must not silently become a usable plaintext key, the opposite of what was meant.
            let digest_prefix = key.get(..7).is_some_and(|p| p.eq_ignore_ascii_case("sha256:"));
            let given_digest = digest_prefix
                .then(|| hex::decode(&key[7..]).ok().and_then(|d| <[u8; 32]>::try_from(d).ok()))
                .map(|d| {
                    d.ok_or_else(|| {
                        format!("IDEM_API_KEYS key of merchant {merchant} starts with 'sha256:' but is not a SHA-256 digest (64 hex digits)")
                    })
                })
                .transpose()?;
            if given_digest.is_none()
                && (key.len() < MIN_KEY_LEN || key.len() > 256 || !key.bytes().all(|b| (0x21..=0x7e).contains(&b)))
            {
                return Err(format!(
                    "IDEM_API_KEYS key of merchant {merchant} must be {MIN_KEY_LEN} to 256 printable characters \
                     (generate one with `openssl rand -base64 24`)"
                ));
            }
            let digest = given_digest.unwrap_or_else(|| digest(key));
            if by_digest.insert(digest, Merchant(merchant.into())).is_some() {
                return Err(format!("IDEM_API_KEYS gives the same key twice (merchant {merchant})"));
            }
        }
        Ok(Self { by_digest, limits: HashMap::new(), failures: Default::default() })
    }

    /// Bounds each merchant's requests in progress to `limit` (0 is refused: at least 1).
    pub fn with_concurrency_limit(mut self, limit: usize) -> Self {
        self.limits = self
            .by_digest
            .values()
            .map(|m| (m.0.clone(), Arc::new(tokio::sync::Semaphore::new(limit.max(1)))))
            .collect();
        self
    }

    /// Registers `idem_http_authentication_failures_total`.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.sub_registry_with_prefix("idem_http").register(
            "authentication_failures",
            "Requests refused 401: a missing, malformed or unknown API key",
            self.failures.clone(),
        );
    }

    /// Whether `merchant` has a key here.
    pub fn has_merchant(&self, merchant: &str) -> bool {
        self.by_digest.values().any(|m| &*m.0 == merchant)
    }

    /// Whether no key is configured.
    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }

    /// The merchant of a key.
    pub fn merchant(&self, key: &str) -> Option<&Merchant> {
        self.by_digest.get(&digest(key))
    }
}

fn unauthorized(detail: &str) -> Response {
    Problem::new(ProblemKind::Unauthorized, StatusCode::UNAUTHORIZED).detail(detail).into_response()
}

/// Middleware: authenticates `Authorization: Bearer <key>` and adds the [`Merchant`] extension.
pub async fn authenticate(State(keys): State<Arc<ApiKeys>>, mut req: Request, next: Next) -> Response {
    // the completer's in-process re-send carries its merchant already (an extension no client can set)
    if req.extensions().get::<crate::completer::Completing>().is_some() && req.extensions().get::<Merchant>().is_some()
    {
        return next.run(req).await;
    }
    let mut values = req.headers().get_all(header::AUTHORIZATION).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        keys.failures.inc();
        return unauthorized("send exactly one Authorization: Bearer <api key> header");
    };
    let token = value.to_str().ok().and_then(bearer_token);
    let Some(merchant) = token.and_then(|t| keys.merchant(t)).cloned() else {
        keys.failures.inc();
        return unauthorized("the API key is not valid");
    };
    let _permit = match keys.limits.get(&merchant.0).map(|s| s.clone().try_acquire_owned()) {
        Some(Err(_)) => {
            return Problem::new(ProblemKind::TooManyRequests, StatusCode::TOO_MANY_REQUESTS)
                .detail("too many requests of this merchant in progress; retry after the given delay")
                .retry_after(1)
                .no_store()
                .into_response();
        }
        Some(Ok(permit)) => Some(permit),
        None => None,
    };
    req.extensions_mut().insert(merchant);
    next.run(req).await
}

/// The credentials of a `Bearer` authorization; the scheme name is case-insensitive (RFC 9110 §11.1).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

#[cfg(test)]
mod tests {
    /// Issue 23.6: a key configured as its SHA-256 digest authenticates the key itself; the digest text
    /// does not.
    #[test]
    fn keys_may_be_configured_as_sha256_digests() {
        let digest = hex::encode(Sha256::digest(b"real_key_0123456789"));
        let keys = ApiKeys::parse(&format!("m:sha256:{digest},n:plain_key_0123456")).expect("parses");
        assert_eq!(keys.merchant("real_key_0123456789").map(|m| &*m.0), Some("m"));
        assert!(keys.merchant(&format!("sha256:{digest}")).is_none());
        assert_eq!(keys.merchant("plain_key_0123456").map(|m| &*m.0), Some("n"));
        let same = ApiKeys::parse(&format!("m:sha256:{digest},n:real_key_0123456789"));
        assert!(same.expect_err("the same key twice").contains("same key twice"));
        let upper = ApiKeys::parse(&format!("m:SHA256:{}", digest.to_uppercase())).expect("any case");
        assert_eq!(upper.merchant("real_key_0123456789").map(|m| &*m.0), Some("m"));
    }

    /// Issue 38.2: a mistyped digest (a digit short, a stray character, an odd prefix case) is refused,
    /// naming the merchant and never the text; it never becomes a plaintext key.
    #[test]
    fn a_mistyped_digest_is_refused_not_taken_as_a_key() {
        let digest = hex::encode(Sha256::digest(b"real_key_0123456789"));
        for typo in [&digest[..63], &format!("{}x", &digest[..63]), &format!("{digest}0")] {
            for prefix in ["sha256:", "SHA256:", "Sha256:"] {
                let entry = format!("wallet:{prefix}{typo}");
                let err = ApiKeys::parse(&entry).expect_err("a mistyped digest is refused");
                assert!(err.contains("wallet") && err.contains("sha256"), "{err}");
                assert!(!err.contains(typo), "the text is never shown: {err}");
            }
        }
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for v in ["Bearer k_123", "bearer k_123", "BEARER k_123", "bEaReR   k_123 "] {
            assert_eq!(super::bearer_token(v), Some("k_123"), "{v}");
        }
        assert_eq!(super::bearer_token("Basic k_123"), None);
        assert_eq!(super::bearer_token("Bearerk_123"), None);
    }

    use super::*;

    #[test]
    fn parses_and_never_shows_keys() {
        let keys = ApiKeys::parse("merchant_a:key_a_1234567890, merchant_b:key_b_1234567890").expect("valid");
        assert_eq!(keys.merchant("key_a_1234567890").map(|m| &*m.0), Some("merchant_a"));
        assert_eq!(keys.merchant("key_b_1234567890").map(|m| &*m.0), Some("merchant_b"));
        assert!(keys.merchant("key_c_1234567890").is_none());
        let shown = format!("{keys:?}");
        assert!(!shown.contains("key_a") && shown.contains("merchant_b"), "{shown}");
    }

    #[test]
    fn rejects_bad_configuration() {
        assert!(ApiKeys::parse("nocolon").is_err());
        assert!(ApiKeys::parse("m:short").is_err());
        // issue 38.5: eight characters were accepted; a key now needs a random key's strength
        let err = ApiKeys::parse("m:key_1234567").expect_err("15 characters");
        assert!(err.contains("16 to 256") && err.contains("openssl rand"), "{err}");
        assert!(ApiKeys::parse("m:same_key_1_abcdef,n:same_key_1_abcdef").is_err());
        assert!(ApiKeys::parse("bad name:key_123456789").is_err());
        assert!(ApiKeys::parse("").is_ok_and(|k| k.is_empty()));
    }
}
