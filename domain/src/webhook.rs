//! A payment provider's webhook signature: `Provider-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret,
//! "<t>.<raw body>")>` (Stripe's scheme). A body is accepted only with a valid signature made within the
//! tolerance of now (replays of old deliveries are refused); a few `v1` values are allowed (a secret being
//! rotated, at most [`MAX_SIGNATURES`]). The MAC is computed once per request and compared in constant time.

use chrono::{DateTime, Utc};
use hmac::digest::CtOutput;
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

/// Most `v1` signatures one header may carry (a provider rotating its secret sends two): a header with more
/// is malformed, so an unauthenticated caller can never make one request cost more than one MAC.
pub const MAX_SIGNATURES: usize = 4;

/// Most comma-separated parts one header may have (`t`, the `v1`s and a few schemes idem ignores, like
/// Stripe's `v0`).
const MAX_PARTS: usize = 8;

/// The shortest webhook secret accepted (like API keys): an empty or short secret lets anyone sign.
pub const MIN_SECRET_LEN: usize = 16;

/// Verifies `header` for `body` under `secret` at `now`. The MAC of the body is computed once, whatever the
/// header holds, and compared in constant time with each `v1` of the right length (32 bytes).
pub fn verify(secret: &[u8], header: &str, body: &[u8], now: DateTime<Utc>) -> Result<(), WebhookError> {
    let mut timestamp = None;
    let mut signatures: Vec<[u8; 32]> = Vec::new();
    let mut v1s = 0;
    for (i, part) in header.split(',').enumerate() {
        if i == MAX_PARTS {
            return Err(WebhookError::Malformed);
        }
        match part.trim().split_once('=') {
            Some(("t", t)) => timestamp = t.parse::<i64>().ok(),
            Some(("v1", v)) => {
                v1s += 1;
                if v1s > MAX_SIGNATURES {
                    return Err(WebhookError::Malformed);
                }
                let bytes = hex::decode(v).map_err(|_| WebhookError::Malformed)?;
                // another length can never match: not a candidate
                if let Ok(sig) = <[u8; 32]>::try_from(bytes.as_slice()) {
                    signatures.push(sig);
                }
            }
            _ => {}
        }
    }
    let (Some(t), true) = (timestamp, v1s > 0) else { return Err(WebhookError::Malformed) };
    let tolerance = i64::try_from(WEBHOOK_TOLERANCE.as_secs()).unwrap_or(300);
    if (now.timestamp() - t).abs() > tolerance {
        return Err(WebhookError::Stale);
    }
    if signatures.is_empty() || secret.len() < MIN_SECRET_LEN {
        return Err(WebhookError::Mismatch);
    }
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret) else { return Err(WebhookError::Mismatch) };
    mac.update(t.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let expected = mac.finalize();
    // `CtOutput`'s equality is constant-time (`subtle`)
    let matches = |sig: &[u8; 32]| expected == CtOutput::new((*sig).into());
    if signatures.iter().any(matches) { Ok(()) } else { Err(WebhookError::Mismatch) }
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

    const SECRET: &[u8] = b"whsec_test_0123456789";

    #[test]
    fn a_signature_is_checked_for_its_body_its_secret_and_its_age() {
        let now = DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default();
        let body = br#"{"id":"evt_1","type":"charge.succeeded"}"#;
        let header = sign(SECRET, body, now);
        assert_eq!(verify(SECRET, &header, body, now), Ok(()));
        assert_eq!(verify(SECRET, &header, body, now + chrono::Duration::seconds(299)), Ok(()));
        assert_eq!(verify(b"whsec_other_0123456789", &header, body, now), Err(WebhookError::Mismatch));
        assert_eq!(verify(SECRET, &header, b"{}", now), Err(WebhookError::Mismatch));
        let late = now + chrono::Duration::seconds(301);
        assert_eq!(verify(SECRET, &header, body, late), Err(WebhookError::Stale));
        for bad in ["", "t=abc,v1=00", "v1=00", "t=1800000000", "t=1800000000,v1=zz"] {
            assert_eq!(verify(SECRET, bad, body, now), Err(WebhookError::Malformed), "{bad:?}");
        }
        // rotation: the old secret's signature beside the new one's
        let old = sign(b"whsec_old_0123456789", body, now);
        let both = format!("{header},{}", old.split(',').nth(1).unwrap_or_default());
        assert_eq!(verify(b"whsec_old_0123456789", &both, body, now), Ok(()));
        assert!(!format!("{:?}", WebhookError::Mismatch).contains("whsec"));
    }

    /// Issue 44: an unauthenticated header could carry thousands of `v1`s, each costing a MAC over the body.
    #[test]
    fn a_header_with_more_than_a_few_signatures_is_malformed_and_one_mac_decides() {
        let now = DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default();
        let body = br#"{"id":"evt_1"}"#;
        let good = sign(SECRET, body, now);
        let v1 = good.split(',').nth(1).unwrap_or_default().to_owned();
        let junk = format!("v1={}", "00".repeat(32));
        let t = format!("t={}", now.timestamp());
        // the right one among MAX_SIGNATURES candidates, wherever it is
        for position in 0..MAX_SIGNATURES {
            let mut parts = vec![junk.clone(); MAX_SIGNATURES];
            parts[position] = v1.clone();
            let header = format!("{t},{}", parts.join(","));
            assert_eq!(verify(SECRET, &header, body, now), Ok(()), "{position}");
        }
        let too_many = format!("{t},{},{v1}", vec![junk.clone(); MAX_SIGNATURES].join(","));
        assert_eq!(verify(SECRET, &too_many, body, now), Err(WebhookError::Malformed));
        let padded = format!("{t},{v1}{}", ",x=1".repeat(MAX_PARTS));
        assert_eq!(verify(SECRET, &padded, body, now), Err(WebhookError::Malformed));
        // a candidate of another length is no candidate
        let short = format!("{t},v1={}", &v1[3..3 + 62]);
        assert_eq!(verify(SECRET, &short, body, now), Err(WebhookError::Mismatch));
    }

    /// Issue 44: a body signed with an empty (or short) key is never accepted, whatever the configuration.
    #[test]
    fn a_signature_under_an_empty_or_short_secret_never_verifies() {
        let now = DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default();
        let body = br#"{"id":"evt_1","type":"charge.succeeded"}"#;
        for weak in [&b""[..], b"short", b"fifteen_chars__"] {
            let header = sign(weak, body, now);
            assert_eq!(verify(weak, &header, body, now), Err(WebhookError::Mismatch), "{weak:?}");
        }
        let header = sign(b"sixteen_chars___", body, now);
        assert_eq!(verify(b"sixteen_chars___", &header, body, now), Ok(()));
    }
}
