//! The HTTP payment-provider adapter against the stand-in provider: what each answer means, counted at the
//! provider.

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use idem_http::provider::HttpPaymentProvider;
use idem_ports::{ChargeRequest, PaymentProvider, ProviderError};

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
/// key gets that charge), a wrong API key (unknown: the operator's to fix), and the key never shown by `Debug`.
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
    assert!(matches!(failed, Err(ProviderError::Unknown(_))), "{failed:?}");
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
    // a wrong key is the operator's to fix: unknown (retried later), never a refusal stored for the payment
    let refused = wrong.charge("k5", &request("pm_card_visa", 1)).await;
    assert_eq!(refused, Err(ProviderError::Unknown("status 401".into())));
    Ok(())
}
