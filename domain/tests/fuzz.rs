//! High-iteration property tests of every parser that faces requests and messages: no panic, no
//! unbounded work, and what is accepted satisfies the rules. `FUZZ_CASES` raises the iteration count
//! (default 10,000 per property).

#![allow(clippy::disallowed_methods)] // tests make their own ids and read the clock

use std::sync::Arc;

use idem_domain::usecases::OrderEventHandler;
use idem_domain::{Amount, Currency, EventId, Fingerprint, IdempotencyKey};
use idem_ports::{EventHandler, HandlerError, InboundEvent, MockUnitOfWork, SystemClock, UuidV7Generator};
use proptest::prelude::*;
use uuid::Uuid;

fn cases() -> u32 {
    std::env::var("FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000)
}

fn handler() -> OrderEventHandler {
    OrderEventHandler {
        charges_through_provider: false,
        clock: Arc::new(SystemClock),
        ids: Arc::new(UuidV7Generator),
        payments_topic: "payments".into(),
        merchant_id: "m".into(),
        payments_of: idem_ports::mock_payments_of,
    }
}

fn event(payload: Vec<u8>, saga: Option<Uuid>) -> InboundEvent {
    InboundEvent {
        event_id: Uuid::now_v7(),
        saga_id: saga,
        topic: "orders".into(),
        partition: 0,
        offset: 0,
        key: None,
        payload,
        headers: Vec::new(),
    }
}

/// A JSON value that is sometimes a plausible field and often not.
fn field() -> impl Strategy<Value = serde_json::Value> {
    prop_oneof![
        Just(serde_json::Value::Null),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(serde_json::Value::from),
        "\\PC{0,40}".prop_map(serde_json::Value::from),
        "[0-9]{1,20}(\\.[0-9]{0,6})?".prop_map(serde_json::Value::from),
        Just(serde_json::Value::from("0193a000-0000-7000-8000-000000000001")),
        Just(serde_json::Value::from("EUR")),
        Just(serde_json::json!({"nested": [1, 2, {"deep": true}]})),
    ]
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        (-1e9f64..1e9).prop_map(Value::from),
        "\\PC{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map("[a-z]{1,6}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn idempotency_key_header(raw in proptest::collection::vec(any::<u8>(), 0..700)) {
        if let Ok(key) = IdempotencyKey::from_header_value(&raw) {
            prop_assert!((1..=255).contains(&key.as_str().len()));
            prop_assert!(key.as_str().bytes().all(|b| (0x21..=0x7e).contains(&b)));
        }
    }

    #[test]
    fn money(amount in "\\PC{0,70}", currency in "\\PC{0,6}") {
        if let Ok(a) = Amount::parse(&amount) {
            prop_assert!(a.value() > rust_decimal::Decimal::ZERO);
            prop_assert!(a.value().scale() == 4);
        }
        if let Ok(c) = Currency::parse(&currency) {
            prop_assert!(c.as_str().bytes().all(|b| b.is_ascii_uppercase()) && c.as_str().len() == 3);
        }
    }

    /// Re-serializing the same JSON (whitespace, key order) is the same request; any other route, method
    /// or changed leaf is another. Arbitrary bytes never panic.
    #[test]
    fn json_bodies_fingerprint(
        value in json_value(),
        route in "/[a-z]{0,12}",
        body in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        let compact = serde_json::to_vec(&value).expect("json");
        let pretty = serde_json::to_vec_pretty(&value).expect("json");
        prop_assert_eq!(Fingerprint::of_request("POST", &route, &compact), Fingerprint::of_request("post", &route, &pretty));
        prop_assert_ne!(Fingerprint::of_request("POST", &route, &compact), Fingerprint::of_request("PUT", &route, &compact));
        prop_assert_ne!(Fingerprint::of_request("POST", &route, &compact), Fingerprint::of_request("POST", &format!("{route}/"), &compact));
        let changed = serde_json::json!({ "wrapped": value.clone() });
        prop_assert_ne!(Fingerprint::of_request("POST", &route, &compact), Fingerprint::of_request("POST", &route, &serde_json::to_vec(&changed).expect("json")));
        // the same object with its keys written in the reverse order is the same request
        if let serde_json::Value::Object(map) = &value {
            let reversed: Vec<String> = map
                .iter()
                .rev()
                .map(|(k, v)| format!("{}:{}", serde_json::to_string(k).expect("json"), serde_json::to_string(v).expect("json")))
                .collect();
            let reordered = format!("{{{}}}", reversed.join(","));
            prop_assert_eq!(
                Fingerprint::of_request("POST", &route, &compact),
                Fingerprint::of_request("POST", &route, reordered.as_bytes())
            );
        }
        // a body that differs in one byte of a string leaf is another request
        if let Some(pos) = compact.iter().position(|b| b.is_ascii_alphabetic()) {
            let mut flipped = compact.clone();
            flipped[pos] = if flipped[pos] == b'a' { b'b' } else { b'a' };
            if serde_json::from_slice::<serde_json::Value>(&flipped).is_ok_and(|v| v != value) {
                prop_assert_ne!(Fingerprint::of_request("POST", &route, &compact), Fingerprint::of_request("POST", &route, &flipped));
            }
        }
        let _ = Fingerprint::of_request("POST", &route, &body);
    }

    #[test]
    fn event_id_header(raw in proptest::collection::vec(any::<u8>(), 0..80)) {
        if let Ok(id) = EventId::parse_bytes(&raw) {
            prop_assert!(matches!(id.as_uuid().get_version_num(), 4 | 7));
        }
    }

    #[test]
    fn event_bodies_are_applied_or_refused_as_malformed(
        kind in prop_oneof![Just("OrderPlaced".to_owned()), Just("OrderCancelled".to_owned()), "\\PC{0,12}"],
        fields in proptest::collection::btree_map(
            prop_oneof![Just("order_id".to_owned()), Just("customer_id".to_owned()), Just("amount".to_owned()),
                        Just("currency".to_owned()), Just("provider".to_owned()),
                        Just("external_payment_id".to_owned()), Just("version".to_owned()), "[a-z]{1,8}"],
            field(), 0..9),
        saga in proptest::option::of(Just(Uuid::from_u128(0x0193_a000_0000_7000_8000_0000_0000_0009))),
        raw in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..200)),
    ) {
        let payload = match raw {
            Some(bytes) => bytes,
            None => {
                let mut obj: serde_json::Map<String, serde_json::Value> = fields.into_iter().collect();
                obj.insert("type".into(), kind.into());
                serde_json::to_vec(&obj).expect("serializable")
            }
        };
        let mut uow = MockUnitOfWork::default();
        // an accepted event reaches the projection, which says "older version": nothing else is touched
        uow.projections.expect_apply_order_version().returning(|_, _, _, _| Ok(false));
        let result = futures::executor::block_on(handler().handle(&mut uow, &event(payload, saga)));
        prop_assert!(matches!(result, Ok(()) | Err(HandlerError::Malformed(_))), "{result:?}");
    }
}
