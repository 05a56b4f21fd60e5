//! The HTTP payment-provider adapter against the stand-in provider: what each answer means, counted at the
//! provider.

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use idem_ports::{ChargeRequest, PaymentProvider, ProviderError};
use idem_provider::HttpPaymentProvider;

fn request(payment_method: &str, amount_minor: i64) -> ChargeRequest {
    ChargeRequest {
        amount_minor,
        currency: "EUR".into(),
        payment_method: payment_method.into(),
        reference: "0193a000-0000-7000-8000-000000000001".into(),
    }
}

/// Issue 33: a charge, its retry with the same key (the first answer, no second charge), the same key with
/// other parameters (refused), a decline (refused, nothing charged), a `500` before charging (unknown,
/// nothing charged), an answer later than the call's bound (unknown, but charged: the retry with the same
/// key gets that charge), a wrong API key (held: the operator's to fix), and the key never shown by `Debug`.
#[tokio::test]
async fn each_answer_of_the_provider_means_what_the_contract_says() -> anyhow::Result<()> {
    let (standin, base) = idem_tests::provider::start("sk_test_provider_key").await?;
    let provider = HttpPaymentProvider::new("standin", &base, "sk_test_provider_key", Duration::from_millis(500))?;
    assert!(!format!("{provider:?}").contains("sk_test"), "{provider:?}");
    assert_eq!(provider.name(), "standin");

    let first = provider.charge("k1", &request("pm_card_visa", 1234)).await?;
    let again = provider.charge("k1", &request("pm_card_visa", 1234)).await?;
    assert_eq!((first.amount_minor, first.currency.as_str()), (1234, "EUR"));
    assert_eq!(again, first, "a repeated key gets the first answer");
    assert_eq!(standin.charges.load(SeqCst), 1);
    let reused = provider.charge("k1", &request("pm_card_visa", 999)).await;
    assert_eq!(reused, Err(ProviderError::Refused { code: "key_reused".into() }));

    let declined = provider.charge("k2", &request("pm_card_declined", 500)).await;
    assert_eq!(declined, Err(ProviderError::Refused { code: "card_declined".into() }));

    standin.fail_status.store(500, SeqCst);
    standin.failures.store(1, SeqCst);
    let failed = provider.charge("k3", &request("pm_card_visa", 100)).await;
    assert!(matches!(failed, Err(ProviderError::Unknown { .. })), "{failed:?}");
    assert_eq!(standin.charges_for("k3"), 0, "a 500 before charging charged nothing");

    standin.delay_ms.store(1_000, SeqCst);
    let late = provider.charge("k4", &request("pm_card_visa", 700)).await;
    assert!(matches!(late, Err(ProviderError::NoAnswer(_))), "no answer: it may still be in process: {late:?}");
    assert_eq!(standin.charges_for("k4"), 1, "the late answer's charge happened");
    standin.delay_ms.store(0, SeqCst);
    let retried = provider.charge("k4", &request("pm_card_visa", 700)).await?;
    assert_eq!(retried.amount_minor, 700);
    assert_eq!(standin.charges.load(SeqCst), 2, "k1 and k4: the retry of k4 did not charge again");

    let wrong = HttpPaymentProvider::new("standin", &base, "sk_wrong", Duration::from_millis(500))?;
    // a wrong key is the operator's to fix: held like no answer (asked again later, an alert fires), never
    // a refusal stored for the payment
    let refused = wrong.charge("k5", &request("pm_card_visa", 1)).await;
    assert!(matches!(&refused, Err(ProviderError::NoAnswer(why)) if why.starts_with("status 401")), "{refused:?}");
    Ok(())
}

/// A server answering every request with `status`, `headers` and `body`; counts what it received.
async fn answering(
    status: u16,
    headers: &'static [(&'static str, &'static str)],
    body: &'static str,
) -> anyhow::Result<(std::sync::Arc<std::sync::atomic::AtomicUsize>, String)> {
    let received = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = received.clone();
    let router = axum::Router::new().fallback(move || {
        let counter = counter.clone();
        async move {
            counter.fetch_add(1, SeqCst);
            let mut response = axum::response::Response::new(axum::body::Body::from(body));
            *response.status_mut() = axum::http::StatusCode::from_u16(status).unwrap_or_default();
            for (name, value) in headers {
                response.headers_mut().insert(*name, axum::http::HeaderValue::from_static(value));
            }
            response
        }
    });
    Ok((received, idem_tests::serve(router).await?))
}

/// Issue 44: a `307` re-sent the charge (card token included) to another host and took its answer as the
/// charge. Redirects are never followed: a 3xx is no answer, and the other host receives nothing.
#[tokio::test]
async fn a_redirect_is_never_followed_and_is_no_answer() -> anyhow::Result<()> {
    let (elsewhere, other) = answering(200, &[], r#"{"id":"ch_elsewhere","amount_minor":1,"currency":"EUR"}"#).await?;
    let location: &'static str = Box::leak(format!("{other}/v1/charges").into_boxed_str());
    let leaked: &'static [(&'static str, &'static str)] = Box::leak(Box::new([("location", location)]));
    let (redirecting, base) = answering(307, leaked, "").await?;
    let provider = HttpPaymentProvider::new("standin", &base, "sk_test_provider_key", Duration::from_millis(500))?;
    let charged = provider.charge("k1", &request("pm_card_visa", 1)).await;
    assert!(matches!(&charged, Err(ProviderError::NoAnswer(_))), "{charged:?}");
    assert_eq!(redirecting.load(SeqCst), 1);
    assert_eq!(elsewhere.load(SeqCst), 0, "the redirect's target received the charge");
    Ok(())
}

/// Issue 45: only what the provider said. A gateway's `504` is no answer (the charge may still run behind
/// it); a `404` from an ingress is never a refusal (held, counted for the alert); the provider's own `503`
/// with its error body is answered-nothing-in-process with its `Retry-After`; an answer longer than
/// `MAX_ANSWER` is not the provider's.
#[tokio::test]
async fn only_what_the_provider_said_is_taken_as_its_answer() -> anyhow::Result<()> {
    let key = "sk_test_provider_key";
    let timeout = Duration::from_millis(500);
    let (_, gateway) = answering(504, &[], "<html>Gateway Timeout</html>").await?;
    let provider = HttpPaymentProvider::new("standin", &gateway, key, timeout)?;
    let answer = provider.charge("k1", &request("pm_card_visa", 1)).await;
    assert!(matches!(&answer, Err(ProviderError::NoAnswer(_))), "504 from a gateway: {answer:?}");

    let (_, ingress) = answering(404, &[], "404 page not found").await?;
    let provider = HttpPaymentProvider::new("standin", &ingress, key, timeout)?;
    let mut registry = prometheus_client::registry::Registry::default();
    provider.register(&mut registry);
    let answer = provider.charge("k1", &request("pm_card_visa", 1)).await;
    assert!(matches!(&answer, Err(ProviderError::NoAnswer(_))), "404 from an ingress: {answer:?}");
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)?;
    assert!(text.contains("idem_provider_unrecognised_answers_total 1"), "{text}");

    let (_, busy) =
        answering(503, &[("retry-after", "5")], r#"{"error":{"type":"api_error","code":"overloaded"}}"#).await?;
    let provider = HttpPaymentProvider::new("standin", &busy, key, timeout)?;
    let answer = provider.charge("k1", &request("pm_card_visa", 1)).await;
    assert_eq!(
        answer,
        Err(ProviderError::Unknown { why: "status 503".into(), retry_after: Some(Duration::from_secs(5)) })
    );

    let huge: &'static str = Box::leak("x".repeat(idem_provider::MAX_ANSWER + 1).into_boxed_str());
    let (_, long) = answering(200, &[], huge).await?;
    let provider = HttpPaymentProvider::new("standin", &long, key, timeout)?;
    let answer = provider.charge("k1", &request("pm_card_visa", 1)).await;
    assert!(matches!(&answer, Err(ProviderError::NoAnswer(_))), "{answer:?}");
    Ok(())
}

/// Issue 44: the provider's URL carries no credentials and is `https://` unless its host is loopback.
#[test]
fn the_provider_url_is_https_without_credentials() {
    use idem_provider::check_base_url;
    for good in ["https://api.provider.example", "http://127.0.0.1:4010", "http://localhost:1", "http://[::1]:2"] {
        assert_eq!(check_base_url(good), Ok(()), "{good}");
    }
    for bad in
        ["http://api.provider.example", "https://user:pw@api.provider.example", "https://sk_live@x.example", "ftp://x"]
    {
        let why = check_base_url(bad).expect_err(bad);
        assert!(!why.contains("pw") && !why.contains("sk_live"), "{why}");
    }
    assert!(HttpPaymentProvider::new("p", "https://u:secret@x.example", "k", Duration::from_secs(1)).is_err());
}
