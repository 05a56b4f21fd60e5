//! The OpenAPI 3.1 document of the public API, built from the rules the server enforces.
//!
//! Every constraint comes from the constant or table that the request path checks: key length and
//! characters (`idem_domain::idempotency`), amount digits and scale (`idem_domain::money`), the ISO 4217
//! codes and their minor units (`Currency::accepted_codes`), reference lengths (`usecases::charge`), the
//! refund reason (`usecases::refund`). Amount and currency are tied: an amount finer than its currency's
//! minor unit is not schema-valid. What depends on stored state (a refund above what is left, a payment
//! id that does not exist, a key already used) is documented as 404/409, never as a schema rule.
//! schemathesis runs against this document with every check and its stateful phase (`tests/tests/ops/`).
//!
//! utoipa derives documents from the types that deserialize requests; idem's handlers parse JSON by hand
//! to name the offending field in each problem, and several rules span two fields, so the document is
//! written here, next to those rules, instead.

use idem_domain::Currency;
use idem_domain::idempotency::MAX_KEY_LEN;
use idem_domain::money::{MAX_INTEGER_DIGITS, MAX_SCALE};
use idem_domain::usecases::{
    EXTERNAL_PAYMENT_ID_MAX_LEN, PAYMENT_METHOD_MAX_LEN, PROVIDER_MAX_LEN, REFUND_REASON_MAX_CHARS,
};
use serde_json::{Value, json};

use crate::problem::ProblemKind;

/// Longest accepted amount text (`Amount::parse`).
const AMOUNT_MAX_LEN: usize = 64;

/// A positive amount with at most `scale` significant decimals and at most `MAX_INTEGER_DIGITS` integer
/// digits; leading zeros and trailing zeros of the fraction are accepted, as `Amount::parse` does.
fn amount_pattern(scale: u32) -> String {
    let scale = scale.min(MAX_SCALE) as usize;
    let fraction = |scale: usize| if scale == 0 { "0+".to_owned() } else { format!("[0-9]{{1,{scale}}}0*") };
    let whole = format!("0*[1-9][0-9]{{0,{}}}(\\.{})?", MAX_INTEGER_DIGITS - 1, fraction(scale));
    if scale == 0 {
        return format!("^{whole}$");
    }
    // zero integer part: a non-zero digit within the first `scale` decimals
    let small: Vec<String> = (0..scale).map(|j| format!("0{{{j}}}[1-9][0-9]{{0,{}}}", scale - 1 - j)).collect();
    format!("^(?:{whole}|0+\\.(?:{})0*)$", small.join("|"))
}

fn problem_response(description: &str, retry_after: bool) -> Value {
    let mut headers = json!({});
    if retry_after {
        headers["Retry-After"] = json!({ "$ref": "#/components/headers/RetryAfter" });
    }
    json!({
        "description": description,
        "headers": headers,
        "content": { "application/problem+json": { "schema": { "$ref": "#/components/schemas/Problem" } } }
    })
}

fn problem_types() -> Vec<&'static str> {
    ProblemKind::ALL.iter().map(|k| k.type_uri()).collect()
}

/// The responses every idempotent POST may give besides its own.
fn post_problems() -> Value {
    json!({
        "400": problem_response("Malformed JSON, or an invalid or missing Idempotency-Key", false),
        "401": problem_response("Missing or unknown API key", false),
        "409": problem_response("The key was used with another request (idempotency-key-reused), a request with this key is in flight (request-in-flight, with Retry-After), or the request conflicts with stored state", true),
        "408": problem_response("The body did not arrive within HTTP_BODY_READ_TIMEOUT (nothing executed): send it again with the same key", false),
        "413": problem_response("The body is larger than 64 KiB", false),
        "415": problem_response("The body is not application/json", false),
        "422": problem_response("A field is invalid (field names it), or a UUID v7 key is older than the retention (idempotency-key-expired)", false),
        "429": problem_response("This merchant has too many requests in progress; retry after Retry-After", true),
        "503": problem_response("The database is unreachable (nothing executed) or the commit's outcome is unknown (outcome-unknown): retry with the same key", true),
    })
}

fn success(description: &str, schema: &str, links: Value) -> Value {
    json!({
        "description": description,
        "headers": {
            "Location": { "description": "The payment's URL", "schema": { "type": "string" } },
            "Idempotent-Replayed": { "$ref": "#/components/headers/IdempotentReplayed" }
        },
        "content": { "application/json": { "schema": { "$ref": format!("#/components/schemas/{schema}") } } },
        "links": links
    })
}

/// The document, serialized once (`provider`: the service charges through a payment provider).
pub fn json(provider: bool) -> &'static str {
    static PLAIN: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| document().to_string());
    static WITH_PROVIDER: std::sync::LazyLock<String> =
        std::sync::LazyLock::new(|| document_with_provider().to_string());
    if provider { &WITH_PROVIDER } else { &PLAIN }
}

/// The document of a service that charges through a payment provider: charges with a `payment_method`
/// (`402 card-declined`, final and replayed) and the provider's webhooks besides the recording flow.
pub fn document_with_provider() -> Value {
    let mut doc = document();
    let schemas = &mut doc["components"]["schemas"];
    let recorded = schemas["ChargeRequest"].clone();
    let mut through = recorded.clone();
    through["required"] = json!(["order_id", "customer_id", "payment_method", "amount", "currency"]);
    if let Some(properties) = through["properties"].as_object_mut() {
        properties.remove("provider");
        properties.remove("external_payment_id");
        properties.insert(
            "payment_method".into(),
            json!({ "type": "string", "pattern": format!("^[!-~]{{1,{PAYMENT_METHOD_MAX_LEN}}}$"),
                    "description": "The provider's token of the card or account: the charge goes through the provider" }),
        );
    }
    schemas["RecordedChargeRequest"] = recorded;
    schemas["ProviderChargeRequest"] = through;
    schemas["ChargeRequest"] = json!({ "oneOf": [
        { "$ref": "#/components/schemas/RecordedChargeRequest" },
        { "$ref": "#/components/schemas/ProviderChargeRequest" }
    ] });
    let charge = &mut doc["paths"]["/payments"]["post"]["responses"];
    charge["402"] = problem_response(
        "The payment provider declined the charge (card-declined): final, replayed to every retry; the payment is declined",
        false,
    );
    doc["paths"]["/webhooks/payment-provider"] = json!({ "post": {
        "operationId": "providerWebhook", "security": [],
        "description": "The payment provider's events, signed: Provider-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, \"<t>.<body>\")>, 5 minutes' tolerance. Each event id is applied once.",
        "parameters": [{ "name": "Provider-Signature", "in": "header", "required": true, "schema": { "type": "string" } }],
        "requestBody": { "required": true, "content": { "application/json": { "schema": { "type": "object" } } } },
        "responses": {
            "200": { "description": "Applied, or applied before (outcome)", "content": { "application/json": { "schema": { "type": "object" } } } },
            "400": problem_response("No or a malformed signature, or a malformed event", false),
            "401": problem_response("A wrong or stale signature: nothing changed", false),
            "503": problem_response("Not applied now (the database, or a refund before its charge): deliver it again", true)
        }
    } });
    doc
}

/// The document served at `GET /openapi.json`.
pub fn document() -> Value {
    let currencies = Currency::accepted_codes();
    let mut by_scale: std::collections::BTreeMap<u32, Vec<&str>> = Default::default();
    for (code, units) in &currencies {
        by_scale.entry(*units).or_default().push(code);
    }
    let amount_in_currency: Vec<Value> = by_scale
        .iter()
        .map(|(scale, codes)| {
            json!({ "properties": {
                "currency": { "enum": codes },
                "amount": { "pattern": amount_pattern(*scale) }
            } })
        })
        .collect();
    let codes: Vec<&str> = currencies.iter().map(|(c, _)| *c).collect();
    let key_pattern = format!("^[!#-~][!-~]{{0,{}}}$", MAX_KEY_LEN - 1);
    let reference = |max: usize| json!({ "type": "string", "pattern": format!("^[!-~]{{1,{max}}}$") });
    let uuid =
        json!({ "type": "string", "format": "uuid", "not": { "const": "00000000-0000-0000-0000-000000000000" } });
    let payment_links = json!({
        "GetPayment": { "operationId": "getPayment", "parameters": { "id": "$response.body#/id" } },
        "RefundPayment": { "operationId": "refundPayment", "parameters": { "id": "$response.body#/id" } }
    });
    let refund_links = json!({
        "GetRefundedPayment": { "operationId": "getPayment", "parameters": { "id": "$response.body#/payment_id" } }
    });
    let mut charge_responses = post_problems();
    charge_responses["201"] = success("Charged", "Payment", payment_links.clone());
    charge_responses["200"] = success(
        "The same provider payment already exists for this merchant with the same details",
        "Payment",
        payment_links.clone(),
    );
    let mut refund_responses = post_problems();
    refund_responses["201"] = success("Refunded", "Refund", refund_links);
    refund_responses["404"] = problem_response("No such payment for this merchant (the key stays free)", false);
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "idem payments API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Idempotent payments. POST requests require an Idempotency-Key (1-255 printable ASCII characters, bare or as a structured-field string). A retry with the same key and request replays the stored response (Idempotent-Replayed: true) for the idempotency TTL (48 h by default, 24-72 h); the same key with another request is 409 (or 422 when configured). Errors are RFC 9457 problem+json."
        },
        "components": {
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } },
            "headers": {
                "IdempotentReplayed": {
                    "description": "Present (true) when the response is the stored response of an earlier request with the same key",
                    "schema": { "type": "string", "enum": ["true"] }
                },
                "RetryAfter": { "description": "Seconds to wait before retrying with the same key", "schema": { "type": "string", "pattern": "^[0-9]+$" } }
            },
            "parameters": {
                "IdempotencyKey": {
                    "name": "Idempotency-Key", "in": "header", "required": true,
                    "schema": { "type": "string", "pattern": key_pattern },
                    "description": "One key per business operation, reused on every retry of it (a UUID v7 is recommended)."
                },
                "PaymentId": { "name": "id", "in": "path", "required": true, "schema": { "type": "string", "format": "uuid" } }
            },
            "schemas": {
                "Amount": {
                    "type": "string", "maxLength": AMOUNT_MAX_LEN, "pattern": amount_pattern(MAX_SCALE),
                    "description": "A positive decimal string; at most as many decimals as the currency's minor unit", "example": "12.34"
                },
                "ChargeRequest": {
                    "type": "object", "additionalProperties": false,
                    "required": ["order_id", "customer_id", "provider", "external_payment_id", "amount", "currency"],
                    "properties": {
                        "order_id": uuid,
                        "customer_id": uuid,
                        "provider": reference(PROVIDER_MAX_LEN),
                        "external_payment_id": reference(EXTERNAL_PAYMENT_ID_MAX_LEN),
                        "amount": { "$ref": "#/components/schemas/Amount" },
                        "currency": { "type": "string", "enum": codes, "description": "ISO 4217 code" }
                    },
                    "anyOf": amount_in_currency
                },
                "Payment": {
                    "type": "object",
                    "required": ["id", "order_id", "customer_id", "provider", "external_payment_id", "amount", "currency", "status", "refunded_amount", "created_at"],
                    "properties": {
                        "id": { "type": "string", "format": "uuid" },
                        "order_id": { "type": "string", "format": "uuid" },
                        "customer_id": { "type": "string", "format": "uuid" },
                        "provider": { "type": "string" },
                        "external_payment_id": { "type": ["string", "null"], "description": "The provider's charge id; null while a charge through the provider is pending, or declined" },
                        "amount": { "type": "string" },
                        "currency": { "type": "string" },
                        "status": { "type": "string", "enum": ["pending", "captured", "partially_refunded", "refunded", "declined"] },
                        "refunded_amount": { "type": "string" },
                        "created_at": { "type": "string", "format": "date-time" }
                    }
                },
                "RefundRequest": {
                    "type": "object", "additionalProperties": false,
                    "properties": {
                        "amount": { "allOf": [{ "$ref": "#/components/schemas/Amount" }], "description": "Left out: everything left to refund when the refund runs" },
                        "reason": {
                            "type": ["string", "null"], "maxLength": REFUND_REASON_MAX_CHARS,
                            "pattern": "^[^\\u0000-\\u001F\\u007F-\\u009F]*$",
                            "description": "Free text without control characters"
                        }
                    }
                },
                "Refund": {
                    "type": "object",
                    "required": ["id", "payment_id", "amount", "reason", "created_at", "payment_status", "refunded_amount"],
                    "properties": {
                        "id": { "type": "string", "format": "uuid" },
                        "payment_id": { "type": "string", "format": "uuid" },
                        "amount": { "type": "string" },
                        "reason": { "type": ["string", "null"] },
                        "created_at": { "type": "string", "format": "date-time" },
                        "payment_status": { "type": "string", "enum": ["pending", "captured", "partially_refunded", "refunded", "declined"] },
                        "refunded_amount": { "type": "string" }
                    }
                },
                "Problem": {
                    "type": "object", "required": ["type", "title", "status"],
                    "properties": {
                        "type": { "type": "string", "enum": problem_types() },
                        "title": { "type": "string" },
                        "status": { "type": "integer" },
                        "detail": { "type": "string" },
                        "field": { "type": "string", "description": "The request field at fault" }
                    }
                }
            }
        },
        "security": [{ "bearer": [] }],
        "paths": {
            "/payments": {
                "post": {
                    "operationId": "chargePayment",
                    "parameters": [{ "$ref": "#/components/parameters/IdempotencyKey" }],
                    "requestBody": { "required": true, "content": { "application/json": { "schema": { "$ref": "#/components/schemas/ChargeRequest" } } } },
                    "responses": charge_responses
                }
            },
            "/payments/{id}": {
                "get": {
                    "operationId": "getPayment",
                    "parameters": [{ "$ref": "#/components/parameters/PaymentId" }],
                    "responses": {
                        "200": { "description": "The payment", "content": { "application/json": { "schema": { "$ref": "#/components/schemas/Payment" } } } },
                        "401": problem_response("Missing or unknown API key", false),
                        "404": problem_response("No such payment for this merchant", false),
                        "503": problem_response("The database is unreachable", true)
                    }
                }
            },
            "/payments/{id}/refund": {
                "post": {
                    "operationId": "refundPayment",
                    "parameters": [{ "$ref": "#/components/parameters/PaymentId" }, { "$ref": "#/components/parameters/IdempotencyKey" }],
                    "requestBody": { "required": true, "content": { "application/json": { "schema": { "$ref": "#/components/schemas/RefundRequest" } } } },
                    "responses": refund_responses
                }
            },
            "/healthz": { "get": { "operationId": "alive", "security": [], "responses": { "200": { "description": "The process is alive", "content": { "text/plain": { "schema": { "type": "string" } } } } } } },
            "/openapi.json": { "get": { "operationId": "openapi", "security": [], "responses": { "200": { "description": "This document", "content": { "application/json": { "schema": { "type": "object" } } } } } } }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_domain::{Amount, Money};

    fn matches(pattern: &str, text: &str) -> bool {
        // the patterns only use what `regex` and ECMA 262 share
        regex_lite::Regex::new(pattern).expect("pattern").is_match(text)
    }

    #[test]
    fn amount_patterns_accept_exactly_what_the_money_rules_accept() {
        let samples = [
            "0",
            "0.0",
            "00",
            "1",
            "01",
            "10",
            "12.3",
            "12.34",
            "12.340",
            "12.345",
            "12.3456",
            "12.34567",
            "0.1",
            "0.01",
            "0.001",
            "0.0001",
            "0.00001",
            "0.10",
            "0.000",
            "1.",
            ".5",
            "1.0",
            "1.00000",
            "999999999999999",
            "9999999999999999",
            "0999999999999999",
            "1e3",
            "-1",
            "+1",
            " 1",
            "1,5",
        ];
        let codes = Currency::accepted_codes();
        let one_per_scale = (0..=MAX_SCALE).filter_map(|u| codes.iter().find(|(_, x)| *x == u));
        for (code, scale) in one_per_scale.copied() {
            let currency = Currency::parse(code).expect("currency");
            let pattern = amount_pattern(scale);
            for s in samples {
                let rules = Amount::parse(s).ok().is_some_and(|a| Money::new(a, currency).is_ok());
                assert_eq!(matches(&pattern, s), rules, "{s:?} in {code}: pattern {pattern}");
            }
        }
    }

    #[test]
    fn a_service_with_a_provider_documents_its_charges_declines_and_webhooks() {
        let doc = document_with_provider();
        let schemas = &doc["components"]["schemas"];
        assert_eq!(schemas["ChargeRequest"]["oneOf"].as_array().map(Vec::len), Some(2));
        let through = &schemas["ProviderChargeRequest"];
        assert!(through["required"].as_array().is_some_and(|r| r.contains(&json!("payment_method"))));
        assert!(through["properties"].get("provider").is_none(), "a provider charge names no provider payment");
        assert!(through["anyOf"].is_array(), "amount and currency stay tied");
        assert!(doc["paths"]["/payments"]["post"]["responses"]["402"].is_object());
        assert!(doc["paths"]["/webhooks/payment-provider"]["post"].is_object());
        assert!(document()["paths"].get("/webhooks/payment-provider").is_none());
    }

    #[test]
    fn every_problem_type_is_listed_and_every_code_tied_to_its_scale() {
        let doc = document();
        let types =
            doc["components"]["schemas"]["Problem"]["properties"]["type"]["enum"].as_array().expect("enum").len();
        assert_eq!(types, ProblemKind::ALL.len());
        let groups = doc["components"]["schemas"]["ChargeRequest"]["anyOf"].as_array().expect("anyOf");
        let grouped: usize =
            groups.iter().map(|g| g["properties"]["currency"]["enum"].as_array().map_or(0, Vec::len)).sum();
        assert_eq!(grouped, Currency::accepted_codes().len());
        assert!(Currency::accepted_codes().iter().any(|(c, u)| *c == "JPY" && *u == 0));
    }
}
