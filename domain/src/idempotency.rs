//! HTTP idempotency: the key a client sends, the fingerprint of its request, and what to do with a
//! request given the record stored for its key.

use std::fmt;

use chrono::{DateTime, Utc};
use idem_ports::{IdempotencyRecord, IdempotencyState, StoredResponse};
use sha2::{Digest, Sha256};
use thiserror::Error;

/// Longest accepted key.
pub const MAX_KEY_LEN: usize = 255;

/// Why an `Idempotency-Key` was rejected.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum IdempotencyKeyError {
    #[error("Idempotency-Key must not be empty")]
    /// No key, or an empty one.
    Empty,
    #[error("Idempotency-Key must be at most {MAX_KEY_LEN} characters")]
    /// Longer than 255 characters.
    TooLong,
    #[error("Idempotency-Key must contain only printable ASCII characters (0x21-0x7E)")]
    /// A character outside printable ASCII (0x21–0x7E).
    InvalidCharacter,
    #[error("Idempotency-Key is a malformed structured-field string")]
    /// A structured-field string that does not end or escapes badly.
    MalformedString,
}

/// A client's idempotency key: 1 to 255 printable ASCII characters (0x21–0x7E).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// Validates a key as given.
    pub fn parse(s: &str) -> Result<Self, IdempotencyKeyError> {
        if s.is_empty() {
            return Err(IdempotencyKeyError::Empty);
        }
        if s.len() > MAX_KEY_LEN {
            return Err(IdempotencyKeyError::TooLong);
        }
        if !s.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            return Err(IdempotencyKeyError::InvalidCharacter);
        }
        Ok(Self(s.to_owned()))
    }

    /// Parses an `Idempotency-Key` header value in either form clients send: the bare key (`abc-123`,
    /// Stripe style) or the IETF draft's structured-field string (`"abc-123"`, RFC 8941 §3.3.3). Both name
    /// the same key.
    pub fn from_header_value(raw: &[u8]) -> Result<Self, IdempotencyKeyError> {
        if raw.len() > 2 * MAX_KEY_LEN + 2 {
            return Err(IdempotencyKeyError::TooLong);
        }
        let text = std::str::from_utf8(raw).map_err(|_| IdempotencyKeyError::InvalidCharacter)?;
        let text = text.trim_matches(|c| c == ' ' || c == '\t');
        match text.strip_prefix('"') {
            Some(rest) => Self::parse(&unquote_sf_string(rest)?),
            None => Self::parse(text),
        }
    }

    /// The key as sent (bare form).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// When the key was first sent, if the key tells: a UUID v7 key carries its creation time (the
    /// `first_sent` of AEP-155 / Google AIP-155). Other keys do not.
    pub fn first_sent(&self) -> Option<DateTime<Utc>> {
        crate::events::uuid_v7_time(uuid::Uuid::try_parse(&self.0).ok()?)
    }

    /// Whether the key says it was created longer than `ttl` before `now`: its record, if any, may already
    /// have been cleaned up, so executing it could execute an operation twice. Such a request is refused.
    /// The caller still looks the key's record up first: a record that is alive answers (a late first
    /// send of an old key whose request did run is replayed, not refused).
    /// During a raise of the retention the older limit still applies to keys that may have been recorded
    /// before it ([`crate::TtlPolicy::key_floor`]).
    pub fn is_expired(&self, ttl: &crate::TtlPolicy, now: DateTime<Utc>) -> bool {
        self.first_sent().is_some_and(|t| t < ttl.key_floor(now))
    }

    /// Whether the key says it was created further ahead of `now` than clocks drift
    /// ([`crate::ADMISSION_MARGIN`]): a key minted hours ahead would stay acceptable hours after its
    /// record expired, so it is refused (nothing stored).
    pub fn is_future_dated(&self, now: DateTime<Utc>) -> bool {
        let margin = chrono::Duration::from_std(crate::ADMISSION_MARGIN).unwrap_or(chrono::Duration::hours(1));
        self.first_sent().is_some_and(|t| t > now + margin)
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Unquotes the remainder of an sf-string after its opening quote.
fn unquote_sf_string(rest: &str) -> Result<String, IdempotencyKeyError> {
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e @ ('"' | '\\')) => out.push(e),
                _ => return Err(IdempotencyKeyError::MalformedString),
            },
            '"' => {
                return if chars.next().is_none() { Ok(out) } else { Err(IdempotencyKeyError::MalformedString) };
            }
            c if (' '..='~').contains(&c) => out.push(c),
            _ => return Err(IdempotencyKeyError::MalformedString),
        }
    }
    Err(IdempotencyKeyError::MalformedString)
}

/// SHA-256 of a request: method, route and body. A JSON body is canonicalized first (object keys sorted,
/// insignificant whitespace removed), so a retry that re-serialized the same JSON is the same request.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a request: SHA-256 over method, route and the canonical JSON of the body (or the bytes, if not JSON).
    pub fn of_request(method: &str, route: &str, body: &[u8]) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(method.to_ascii_uppercase().as_bytes());
        hasher.update([0]);
        hasher.update(route.as_bytes());
        hasher.update([0]);
        match serde_json::from_slice::<serde_json::Value>(body) {
            // A number that f64 cannot hold exactly (`0.10000000000000000001`, integers past u64) would
            // fingerprint like its rounded neighbour: such bodies are canonicalized from their text, with
            // every number kept exactly. Others keep the form below (pinned across versions).
            Ok(_) if has_inexact_number(body) => {
                hasher.update(b"json-exact\0");
                let mut pos = 0;
                hasher.update(exact::canonical(body, &mut pos));
            }
            Ok(json) => {
                hasher.update(b"json\0");
                write_canonical(&json, &mut hasher);
            }
            Err(_) => {
                hasher.update(b"raw\0");
                hasher.update(body);
            }
        }
        Self(hasher.finalize().into())
    }

    /// [`Self::of_request`] with the body's JSON fields named in `ignored` left out: fields a client may
    /// change between retries of one operation (a client timestamp, a trace id in the body), so a retry with
    /// a new value — or without the field — replays instead of being a conflict. A name with dots is a path
    /// into nested objects (`meta.sent_at`). Everything else is fingerprinted exactly as
    /// [`Self::of_request`] does, numbers included (the body is cut as text, never rebuilt through `f64`).
    /// A body that is not a JSON object is fingerprinted whole.
    pub fn of_request_ignoring(method: &str, route: &str, body: &[u8], ignored: &[&str]) -> Self {
        let paths: Vec<Vec<&str>> = ignored.iter().map(|f| f.split('.').collect()).collect();
        match std::str::from_utf8(body).ok().and_then(|text| without_fields(text, &paths)) {
            Some(kept) => Self::of_request(method, route, kept.as_bytes()),
            None => Self::of_request(method, route, body),
        }
    }

    /// The fingerprint of a call of `operation` with `input` (a function run once per key, not an HTTP
    /// request): the canonical JSON of `input`, so build `input` from the fields that make two calls the
    /// same operation and leave out the rest.
    pub fn of_call(operation: &str, input: &impl serde::Serialize) -> Result<Self, serde_json::Error> {
        Ok(Self::of_request("CALL", operation, &serde_json::to_vec(input)?))
    }

    /// A fingerprint as stored.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The 32 bytes, as stored.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(self.0))
    }
}

/// The JSON object `text` without the fields at `paths` (each a list of names into nested objects), every
/// other value kept as its text; `None` when `text` is not a JSON object. Duplicate names keep the last, as
/// serde_json does.
fn without_fields(text: &str, paths: &[Vec<&str>]) -> Option<String> {
    let fields: std::collections::BTreeMap<String, &serde_json::value::RawValue> = serde_json::from_str(text).ok()?;
    let mut out = String::with_capacity(text.len());
    out.push('{');
    for (name, value) in &fields {
        let below: Vec<Vec<&str>> =
            paths.iter().filter(|p| p.first() == Some(&name.as_str())).map(|p| p[1..].to_vec()).collect();
        if below.iter().any(Vec::is_empty) {
            continue;
        }
        let stripped = if below.is_empty() { None } else { without_fields(value.get(), &below) };
        if out.len() > 1 {
            out.push(',');
        }
        out.push_str(&serde_json::to_string(name).ok()?);
        out.push(':');
        out.push_str(stripped.as_deref().unwrap_or(value.get()));
    }
    out.push('}');
    Some(out)
}

/// Feeds `value` to `hasher` as JSON with object keys in byte order and no whitespace. Strings and numbers
/// keep serde_json's own (escaped, shortest round-trip) form. Written straight into the hash: building the
/// canonical text first cost an allocation per key and per scalar (callgrind: the fingerprint was 11 % of
/// the service's instructions per charge). The bytes are unchanged (`fingerprints_stay_the_same_across_versions`).
fn write_canonical(value: &serde_json::Value, hasher: &mut Sha256) {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            hasher.update(b"{");
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    hasher.update(b",");
                }
                write_scalar(k, hasher);
                hasher.update(b":");
                write_canonical(v, hasher);
            }
            hasher.update(b"}");
        }
        Value::Array(items) => {
            hasher.update(b"[");
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    hasher.update(b",");
                }
                write_canonical(v, hasher);
            }
            hasher.update(b"]");
        }
        scalar => write_scalar(scalar, hasher),
    }
}

/// serde_json's compact form of a string or scalar, into the hash.
fn write_scalar<T: serde::Serialize + ?Sized>(value: &T, hasher: &mut Sha256) {
    struct Feed<'a>(&'a mut Sha256);
    impl std::io::Write for Feed<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.update(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    // Serializing a `str` or a JSON scalar into a sink that never fails cannot fail.
    let _ = serde_json::to_writer(Feed(hasher), value);
}

/// Whether a JSON text (valid) has a number literal whose value serde_json's `Value` does not hold exactly.
fn has_inexact_number(body: &[u8]) -> bool {
    let mut i = 0;
    while i < body.len() {
        match body[i] {
            b'"' => i = exact::skip_string(body, i),
            b'-' | b'0'..=b'9' => {
                let end = exact::number_end(body, i);
                if !exact::is_exact(&body[i..end]) {
                    return true;
                }
                i = end;
            }
            _ => i += 1,
        }
    }
    false
}

/// Canonical JSON from the text, numbers exact (see [`Fingerprint::of_request`]).
mod exact {
    use std::collections::BTreeMap;

    pub(super) fn skip_string(b: &[u8], start: usize) -> usize {
        let mut i = start + 1;
        while i < b.len() {
            match b[i] {
                b'\\' => i += 2,
                b'"' => return i + 1,
                _ => i += 1,
            }
        }
        i
    }

    pub(super) fn number_end(b: &[u8], start: usize) -> usize {
        let mut i = start;
        while i < b.len() && matches!(b[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9') {
            i += 1;
        }
        i
    }

    /// `(negative, significant digits, exponent)` of a decimal literal: its exact value.
    fn normalize(text: &str) -> (bool, String, i64) {
        let (neg, rest) = match text.strip_prefix('-') {
            Some(r) => (true, r),
            None => (false, text),
        };
        let (mantissa, exp) = match rest.find(['e', 'E']) {
            Some(at) => (&rest[..at], rest[at + 1..].parse::<i64>().unwrap_or(0)),
            None => (rest, 0),
        };
        let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        let digits = format!("{int}{frac}");
        let digits = digits.trim_start_matches('0');
        let trimmed = digits.trim_end_matches('0');
        let exp = exp - frac.len() as i64 + (digits.len() - trimmed.len()) as i64;
        if trimmed.is_empty() { (false, String::new(), 0) } else { (neg, trimmed.to_owned(), exp) }
    }

    /// Whether serde_json's `Value` holds this number literal exactly.
    pub(super) fn is_exact(literal: &[u8]) -> bool {
        let Ok(text) = std::str::from_utf8(literal) else { return false };
        let Ok(value) = serde_json::from_str::<serde_json::Number>(text) else { return false };
        normalize(text) == normalize(&value.to_string())
    }

    fn skip_ws(b: &[u8], pos: &mut usize) {
        while *pos < b.len() && b[*pos].is_ascii_whitespace() {
            *pos += 1;
        }
    }

    /// The canonical bytes of the value at `pos` (the text is valid JSON): keys sorted, the last of
    /// duplicate keys kept (as `Value` does), strings re-encoded, numbers as `serde_json` writes them when
    /// exact and as `#<sign><digits>e<exp>` (never valid JSON, so never equal to another value) when not.
    pub(super) fn canonical(b: &[u8], pos: &mut usize) -> Vec<u8> {
        skip_ws(b, pos);
        let start = *pos;
        match b.get(start) {
            Some(b'{') => {
                *pos += 1;
                let mut entries: BTreeMap<String, Vec<u8>> = BTreeMap::new();
                loop {
                    skip_ws(b, pos);
                    match b.get(*pos) {
                        Some(b'}') => {
                            *pos += 1;
                            break;
                        }
                        Some(b',') => *pos += 1,
                        Some(b'"') => {
                            let end = skip_string(b, *pos);
                            let key: String = serde_json::from_slice(&b[*pos..end]).unwrap_or_default();
                            *pos = end;
                            skip_ws(b, pos);
                            *pos += 1; // ':'
                            let value = canonical(b, pos);
                            entries.insert(key, value);
                        }
                        _ => break,
                    }
                }
                let mut out = b"{".to_vec();
                for (i, (k, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    out.extend(serde_json::to_vec(k).unwrap_or_default());
                    out.push(b':');
                    out.extend(v);
                }
                out.push(b'}');
                out
            }
            Some(b'[') => {
                *pos += 1;
                let mut out = b"[".to_vec();
                let mut first = true;
                loop {
                    skip_ws(b, pos);
                    match b.get(*pos) {
                        Some(b']') | None => {
                            *pos += 1;
                            break;
                        }
                        Some(b',') => *pos += 1,
                        Some(_) => {
                            if !first {
                                out.push(b',');
                            }
                            first = false;
                            out.extend(canonical(b, pos));
                        }
                    }
                }
                out.push(b']');
                out
            }
            Some(b'"') => {
                let end = skip_string(b, start);
                *pos = end;
                let text: String = serde_json::from_slice(&b[start..end]).unwrap_or_default();
                serde_json::to_vec(&text).unwrap_or_default()
            }
            Some(b'-' | b'0'..=b'9') => {
                let end = number_end(b, start);
                *pos = end;
                let literal = std::str::from_utf8(&b[start..end]).unwrap_or_default();
                match serde_json::from_str::<serde_json::Number>(literal) {
                    Ok(n) if is_exact(literal.as_bytes()) => n.to_string().into_bytes(),
                    _ => {
                        let (neg, digits, exp) = normalize(literal);
                        format!("#{}{digits}e{exp}", if neg { "-" } else { "" }).into_bytes()
                    }
                }
            }
            Some(_) => {
                // true, false, null
                let end = (start..b.len()).find(|&i| !b[i].is_ascii_alphabetic()).unwrap_or(b.len());
                *pos = end;
                b[start..end].to_vec()
            }
            None => Vec::new(),
        }
    }
}

/// What to do with a request, given the record stored for its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision<'a> {
    /// No live record: run the handler (and store its response).
    Execute,
    /// The same request already completed: send the stored response again.
    Replay(&'a StoredResponse),
    /// The key was used for a different request: refuse.
    Conflict,
    /// The same request is still executing: do not run it again; wait or ask the client to retry later.
    InFlight,
    /// The same request was held between the phases of a foreign call by `attempt`, whose lease lapsed (its
    /// process died or stalled): take the record over with the next attempt and resume at `recovery_point`
    /// (`crate::phases::claim`).
    Resume {
        /// The attempt that held it.
        attempt: u32,
        /// Where to resume.
        recovery_point: &'a str,
    },
}

/// Decides what to do with a request whose fingerprint is `fingerprint`, given the record stored for its
/// key (if any) at time `now`. An expired record counts as absent. The fingerprint is compared before the
/// state, so a different request under a key still in flight is a conflict, not "in flight".
pub fn decide<'a>(
    existing: Option<&'a IdempotencyRecord>,
    fingerprint: &Fingerprint,
    now: DateTime<Utc>,
) -> Decision<'a> {
    let Some(record) = existing else {
        return Decision::Execute;
    };
    // a record held between phases is never treated as expired: its retention counts from completion
    let held = record.state == IdempotencyState::InFlight && record.phase.is_some();
    if record.expires_at <= now && !held {
        return Decision::Execute;
    }
    if record.command_hash != fingerprint.0 {
        return Decision::Conflict;
    }
    match (record.state, &record.response, &record.phase) {
        (IdempotencyState::Completed, Some(response), _) => Decision::Replay(response),
        (IdempotencyState::InFlight, _, Some(hold)) => {
            let lease = crate::phases::Lease { attempt: hold.attempt, until: hold.lease_until };
            if lease.holds(now) {
                Decision::InFlight
            } else {
                Decision::Resume { attempt: hold.attempt, recovery_point: &hold.recovery_point }
            }
        }
        _ => Decision::InFlight,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fp(body: &str) -> Fingerprint {
        Fingerprint::of_request("POST", "/x", body.as_bytes())
    }

    /// Issue 36: a field left out of the fingerprint may change between retries; any other still conflicts.
    #[test]
    fn ignored_fields_do_not_change_the_fingerprint_and_others_do() {
        let of = |body: &str| Fingerprint::of_request_ignoring("POST", "/x", body.as_bytes(), &["sent_at"]);
        let first = of(r#"{"amount":"10.00","sent_at":"2026-12-05T10:00:00Z"}"#);
        assert_eq!(first, of(r#"{"sent_at":"2026-12-05T10:00:09Z","amount":"10.00"}"#));
        assert_eq!(first, of(r#"{"amount":"10.00"}"#));
        assert_eq!(first, fp(r#"{"amount":"10.00"}"#), "the same as the whole fingerprint of what is kept");
        assert_ne!(first, of(r#"{"amount":"10.01","sent_at":"2026-12-05T10:00:00Z"}"#));
        assert_eq!(of("not json"), fp("not json"));
        let call = |amount: &str| Fingerprint::of_call("credit", &serde_json::json!({ "amount": amount }));
        assert_eq!(call("1").expect("serializes"), call("1").expect("serializes"));
        assert_ne!(call("1").expect("serializes"), call("2").expect("serializes"));
    }

    /// Issue 46.1: the ignored fields are cut from the text, so every other number stays exact (the body was
    /// rebuilt through `f64`: two amounts differing past its precision replayed each other), a retry without
    /// the field replays, and a dotted name reaches into a nested object (it ignored nothing).
    #[test]
    fn ignoring_fields_keeps_every_other_number_exact_and_reaches_nested_fields() {
        let of =
            |body: &str, ignored: &[&str]| Fingerprint::of_request_ignoring("POST", "/x", body.as_bytes(), ignored);
        let wei = |n: &str, at: &str| format!(r#"{{"amount_wei":{n},"sent_at":"{at}"}}"#);
        let first = of(&wei("20000000000000000001", "10:00"), &["sent_at"]);
        assert_ne!(first, of(&wei("20000000000000000002", "10:00"), &["sent_at"]), "integers past u64");
        assert_eq!(first, of(&wei("20000000000000000001", "10:09"), &["sent_at"]), "only the ignored field moved");
        assert_eq!(first, of(r#"{"amount_wei":20000000000000000001}"#, &["sent_at"]), "the field left out");
        assert_eq!(first, fp(r#"{"amount_wei":20000000000000000001}"#), "what is kept, fingerprinted whole");
        let tenth = |n: &str| of(&format!(r#"{{"a":{n},"sent_at":1}}"#), &["sent_at"]);
        assert_ne!(tenth("0.1"), tenth("0.10000000000000000001"), "decimals past f64");
        let nested = |at: &str, amount: &str| {
            of(&format!(r#"{{"meta":{{"sent_at":"{at}","trace":"t"}},"amount":{amount}}}"#), &["meta.sent_at"])
        };
        assert_eq!(nested("10:00", "5"), nested("10:09", "5"), "a nested field ignored");
        assert_ne!(nested("10:00", "5"), nested("10:00", "6"), "others still count");
        assert_eq!(nested("10:00", "5"), fp(r#"{"amount":5,"meta":{"trace":"t"}}"#));
        assert_eq!(of("[1,2]", &["a"]), fp("[1,2]"), "not an object: whole");
    }

    /// Issue 32.5: `IDEMPOTENCY_TTL` raised from 24 h to 72 h by a rolling deploy that takes 5 hours: old
    /// instances keep writing 24 h records meanwhile. A key dated 2 h after the raise began, recorded by an
    /// old instance, is gone 24 h later; retried 30 h after its time it must be refused. Keys got only an
    /// hour of "recorded before the raise" allowance; now they get the day events get.
    #[test]
    fn a_key_recorded_by_an_old_instance_during_a_rolling_raise_keeps_the_old_limit() {
        let hours = |h: u64| std::time::Duration::from_secs(h * 3600);
        let since = DateTime::from_timestamp(1_800_000_000, 0).expect("valid");
        let ttl = crate::TtlPolicy::new(hours(72)).expect("valid").raised_from(hours(24), since);
        let key_time = since + chrono::Duration::hours(2);
        let id = uuid::Builder::from_unix_timestamp_millis(
            u64::try_from(key_time.timestamp_millis()).expect("positive"),
            &[2; 10],
        )
        .into_uuid();
        let key = IdempotencyKey::parse(&id.to_string()).expect("a key");
        assert!(key.is_expired(&ttl, key_time + chrono::Duration::hours(30)), "accepted after its 24 h record");
        assert!(!key.is_expired(&ttl, key_time + chrono::Duration::hours(20)), "refused inside the old retention");
    }

    /// Issue 32.4, as reproduced: TTL 48 h, a refund's v7 key dated 48 h 20 min before the database's
    /// clock, so its record (expiring at key time + 48 h) was cleaned up by the database's clock; the host
    /// checking the retry is 50 minutes behind. The key must be refused, not executed again.
    #[test]
    fn a_key_whose_record_the_database_cleaned_up_is_expired_on_a_host_behind_it() {
        let ttl = crate::TtlPolicy::new(std::time::Duration::from_secs(48 * 3600)).expect("valid");
        let db_now = DateTime::from_timestamp(1_800_000_000, 0).expect("valid");
        let key_time = db_now - chrono::Duration::minutes(48 * 60 + 20);
        let id = uuid::Builder::from_unix_timestamp_millis(
            u64::try_from(key_time.timestamp_millis()).expect("positive"),
            &[1; 10],
        )
        .into_uuid();
        let key = IdempotencyKey::parse(&id.to_string()).expect("a key");
        assert!(ttl.expires_at(key_time) < db_now, "the record is past its expiry by the database's clock");
        for lag in [0, 10, 50, 59] {
            let host_now = db_now - chrono::Duration::minutes(lag);
            assert!(key.is_expired(&ttl, host_now), "a host {lag} min behind refuses the key");
        }
    }

    /// Issue 24.8: numbers were fingerprinted through f64, so a different request replayed.
    #[test]
    fn numbers_are_fingerprinted_exactly() {
        assert_ne!(fp(r#"{"q":0.1}"#), fp(r#"{"q":0.10000000000000000001}"#));
        assert_ne!(fp(r#"{"n":18446744073709551616}"#), fp(r#"{"n":18446744073709551617}"#));
        let (a, b) = ("0.10000000000000000001", "0.10000000000000000002");
        assert_ne!(fp(&format!(r#"{{"a":{a},"b":{b}}}"#)), fp(&format!(r#"{{"a":{b},"b":{a}}}"#)));
        // the same value written differently is the same request
        assert_eq!(fp(r#"{"q":0.1}"#), fp(r#"{"q":1e-1}"#));
        assert_eq!(fp(r#"{"q":0.1}"#), fp(r#"{"q":0.10}"#));
        assert_eq!(
            fp(r#"{"a":0.10000000000000000001, "b":[1,"\u0041",true,null]}"#),
            fp(r#"{"b":[1,"A",true,null],"a":0.100000000000000000010}"#)
        );
        assert_eq!(fp(r#"{"a":1,"a":1.00000000000000000001}"#), fp(r#"{"a":1.00000000000000000001}"#));
    }

    fn record(hash: [u8; 32], state: IdempotencyState, expires_in_secs: i64) -> IdempotencyRecord {
        let now = DateTime::from_timestamp(1_700_000_000, 0).expect("valid");
        IdempotencyRecord {
            scope: "m".into(),
            key: "k".into(),
            command_hash: hash,
            state,
            response: (state == IdempotencyState::Completed).then(|| StoredResponse {
                status_code: 201,
                headers: vec![("content-type".into(), "application/json".into())],
                body: b"{}".to_vec(),
            }),
            created_at: now,
            expires_at: now + chrono::Duration::seconds(expires_in_secs),
            phase: None,
        }
    }

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).expect("valid")
    }

    #[test]
    fn key_rules() {
        assert!(IdempotencyKey::parse("abc-123").is_ok());
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_ok());
        assert_eq!(IdempotencyKey::parse(""), Err(IdempotencyKeyError::Empty));
        assert_eq!(IdempotencyKey::parse(&"k".repeat(256)), Err(IdempotencyKeyError::TooLong));
        assert_eq!(IdempotencyKey::parse("a b"), Err(IdempotencyKeyError::InvalidCharacter));
        assert_eq!(IdempotencyKey::parse("a\u{7f}"), Err(IdempotencyKeyError::InvalidCharacter));
        assert_eq!(IdempotencyKey::parse("ключ"), Err(IdempotencyKeyError::InvalidCharacter));
    }

    #[test]
    fn bare_and_structured_forms_name_the_same_key() {
        let bare = IdempotencyKey::from_header_value(b"abc-123");
        let quoted = IdempotencyKey::from_header_value(b"\"abc-123\"");
        assert_eq!(bare, quoted);
        assert_eq!(IdempotencyKey::from_header_value(br#""a\"b""#).map(|k| k.0), Ok("a\"b".to_owned()));
        assert_eq!(IdempotencyKey::from_header_value(b"\"abc"), Err(IdempotencyKeyError::MalformedString));
        assert_eq!(IdempotencyKey::from_header_value(b"\"a\"b\""), Err(IdempotencyKeyError::MalformedString));
        assert_eq!(IdempotencyKey::from_header_value(b"\"\""), Err(IdempotencyKeyError::Empty));
        assert_eq!(IdempotencyKey::from_header_value(b"\"a b\""), Err(IdempotencyKeyError::InvalidCharacter));
    }

    #[test]
    fn reformatted_json_has_the_same_fingerprint() {
        let a = Fingerprint::of_request("POST", "/payments", br#"{"a":1,"b":{"y":2,"x":[1,2]}}"#);
        let b =
            Fingerprint::of_request("post", "/payments", b"{\n  \"b\": { \"x\": [1, 2], \"y\": 2 },\n  \"a\": 1\n}");
        assert_eq!(a, b);
    }

    /// Fingerprints are stored: a retry handled by a newer version must still match the record an older
    /// version stored (a deploy inside the 24–72 h window). These values were computed by the first
    /// canonical form (JSON tree → `String` → SHA-256) and pin its bytes.
    #[test]
    fn fingerprints_stay_the_same_across_versions() {
        let charge = br#"{"order_id":"0193a3b0-0000-7000-8000-000000000001","customer_id":"0193a3b0-0000-7000-8000-000000000002",
            "provider":"stripe","external_payment_id":"pi_\u00e9\"x","amount":"12.34","currency":"EUR",
            "meta":{"z":[1,2.5,-3e2,true,null,{"b":"\n","a":""}],"a":1}}"#;
        let bodies: [&[u8]; 3] = [charge, b"{}", b"not json \xff"];
        let got: Vec<String> =
            bodies.iter().map(|b| hex::encode(Fingerprint::of_request("POST", "/payments", b).0)).collect();
        assert_eq!(
            got,
            [
                "05c556f872a443e98e066b904898ae7cac2fa238a1253ba0d8fedcea3806d00d",
                "4e521f86b618c66a16968331f713eec56ecd247c5c2ef71d3b3a66470050e71a",
                "e59e5fccaca5d319d8d8eb136b4c1eadd97a13cfa26d5e094b04bd5246b814f2",
            ]
        );
    }

    #[test]
    fn method_route_and_body_change_the_fingerprint() {
        let base = Fingerprint::of_request("POST", "/payments", br#"{"a":1}"#);
        assert_ne!(base, Fingerprint::of_request("PUT", "/payments", br#"{"a":1}"#));
        assert_ne!(base, Fingerprint::of_request("POST", "/payments/x", br#"{"a":1}"#));
        assert_ne!(base, Fingerprint::of_request("POST", "/payments", br#"{"a":2}"#));
        assert_ne!(base, Fingerprint::of_request("POST", "/payments", br#"{"a":"1"}"#));
        // route and body cannot bleed into each other
        assert_ne!(Fingerprint::of_request("POST", "/a", b"b"), Fingerprint::of_request("POST", "/ab", b""));
    }

    #[test]
    fn decisions() {
        let fp = Fingerprint::of_request("POST", "/payments", b"{}");
        let other = Fingerprint::of_request("POST", "/payments", b"{\"x\":1}");
        assert_eq!(decide(None, &fp, now()), Decision::Execute);

        let done = record(fp.0, IdempotencyState::Completed, 60);
        assert!(matches!(decide(Some(&done), &fp, now()), Decision::Replay(r) if r.status_code == 201));
        assert_eq!(decide(Some(&done), &other, now()), Decision::Conflict);

        let running = record(fp.0, IdempotencyState::InFlight, 60);
        assert_eq!(decide(Some(&running), &fp, now()), Decision::InFlight);
        // fingerprint before in-flight
        assert_eq!(decide(Some(&running), &other, now()), Decision::Conflict);

        let expired = record(other.0, IdempotencyState::Completed, 0);
        assert_eq!(decide(Some(&expired), &fp, now()), Decision::Execute);
    }

    proptest! {
        #[test]
        fn header_parser_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..600)) {
            if let Ok(key) = IdempotencyKey::from_header_value(&raw) {
                prop_assert!(!key.as_str().is_empty() && key.as_str().len() <= MAX_KEY_LEN);
                prop_assert!(key.as_str().bytes().all(|b| (0x21..=0x7e).contains(&b)));
            }
        }

        #[test]
        fn valid_keys_parse_in_both_forms(key in "[!#-\\[\\]-~]{1,255}") {
            let bare = IdempotencyKey::from_header_value(key.as_bytes()).expect("bare");
            let quoted = IdempotencyKey::from_header_value(format!("\"{key}\"").as_bytes()).expect("quoted");
            prop_assert_eq!(bare.as_str(), key.as_str());
            prop_assert_eq!(quoted, bare);
        }

        #[test]
        fn key_order_never_changes_the_fingerprint(
            entries in proptest::collection::btree_map("[a-z]{1,6}", any::<i32>(), 0..8)
        ) {
            let forward: serde_json::Map<_, _> =
                entries.iter().map(|(k, v)| (k.clone(), serde_json::json!(v))).collect();
            let mut reversed = String::from("{");
            for (i, (k, v)) in entries.iter().rev().enumerate() {
                if i > 0 { reversed.push_str(" , "); }
                reversed.push_str(&format!("\"{k}\" : {v}"));
            }
            reversed.push('}');
            let a = Fingerprint::of_request("POST", "/p", serde_json::Value::Object(forward).to_string().as_bytes());
            let b = Fingerprint::of_request("POST", "/p", reversed.as_bytes());
            prop_assert_eq!(a, b);
        }

        #[test]
        fn decision_is_total_and_consistent(
            stored in any::<[u8; 32]>(),
            incoming in any::<[u8; 32]>(),
            completed in any::<bool>(),
            expires_in in -100i64..100,
        ) {
            let state = if completed { IdempotencyState::Completed } else { IdempotencyState::InFlight };
            let rec = record(stored, state, expires_in);
            let fp = Fingerprint(incoming);
            let d = decide(Some(&rec), &fp, now());
            let expected = if expires_in <= 0 {
                Decision::Execute
            } else if stored != incoming {
                Decision::Conflict
            } else if completed {
                Decision::Replay(rec.response.as_ref().expect("completed has a response"))
            } else {
                Decision::InFlight
            };
            prop_assert_eq!(d, expected);
        }
    }
}
