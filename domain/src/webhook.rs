//! A payment provider's webhook signature: `Provider-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret,
//! "<t>.<raw body>")>` (Stripe's scheme). A body is accepted only with a valid signature made within the
//! tolerance of now (replays of old deliveries are refused); several `v1` values are allowed (a secret being
//! rotated). Comparison is constant-time.

use chrono::{DateTime, Utc};
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// How far a signature's time may be from now (either way): 5 minutes.
pub const WEBHOOK_TOLERANCE: std::time::Duration = std::time::Duration::from_secs(300);

/// Why a webhook was refused (never shows the secret or the signature).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WebhookError {
    /// No `Provider-Signature`, or not `t=…,v1=…`.
    #[error("malformed signature header")]
    Malformed,
    /// Signed longer ago (or further ahead) than the tolerance: a replayed or delayed delivery.
    #[error("signature timestamp outside the tolerance")]
    Stale,
    /// No `v1` matches the body under the secret.
    #[error("signature does not match")]
    Mismatch,
}

/// Verifies `header` for `body` under `secret` at `now`.
pub fn verify(secret: &[u8], header: &str, body: &[u8], now: DateTime<Utc>) -> Result<(), WebhookError> {
    let mut timestamp = None;
    let mut signatures = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", t)) => timestamp = t.parse::<i64>().ok(),
            Some(("v1", v)) => signatures.push(hex::decode(v).map_err(|_| WebhookError::Malformed)?),
            _ => {}
        }
    }
    let (Some(t), false) = (timestamp, signatures.is_empty()) else { return Err(WebhookError::Malformed) };
    let tolerance = i64::try_from(WEBHOOK_TOLERANCE.as_secs()).unwrap_or(300);
    if (now.timestamp() - t).abs() > tolerance {
        return Err(WebhookError::Stale);
    }
    let signed = |sig: &[u8]| {
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret) else { return false };
        mac.update(t.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        mac.verify_slice(sig).is_ok()
    };
    if signatures.iter().any(|s| signed(s)) { Ok(()) } else { Err(WebhookError::Mismatch) }
}

/// The header a provider would send for `body` at `t` (for tests and the stand-in provider).
pub fn sign(secret: &[u8], body: &[u8], t: DateTime<Utc>) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).unwrap_or_else(|_| unreachable!("HMAC takes any key length"));
    mac.update(t.timestamp().to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("t={},v1={}", t.timestamp(), hex::encode(mac.finalize().into_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_is_checked_for_its_body_its_secret_and_its_age() {
        let now = DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default();
        let body = br#"{"id":"evt_1","type":"charge.succeeded"}"#;
        let header = sign(b"whsec_test", body, now);
        assert_eq!(verify(b"whsec_test", &header, body, now), Ok(()));
        assert_eq!(verify(b"whsec_test", &header, body, now + chrono::Duration::seconds(299)), Ok(()));
        assert_eq!(verify(b"whsec_other", &header, body, now), Err(WebhookError::Mismatch));
        assert_eq!(verify(b"whsec_test", &header, b"{}", now), Err(WebhookError::Mismatch));
        let late = now + chrono::Duration::seconds(301);
        assert_eq!(verify(b"whsec_test", &header, body, late), Err(WebhookError::Stale));
        for bad in ["", "t=abc,v1=00", "v1=00", "t=1800000000", "t=1800000000,v1=zz"] {
            assert_eq!(verify(b"whsec_test", bad, body, now), Err(WebhookError::Malformed), "{bad:?}");
        }
        // rotation: the old secret's signature beside the new one's
        let old = sign(b"whsec_old", body, now);
        let both = format!("{header},{}", old.split(',').nth(1).unwrap_or_default());
        assert_eq!(verify(b"whsec_old", &both, body, now), Ok(()));
        assert!(!format!("{:?}", WebhookError::Mismatch).contains("whsec"));
    }
}
