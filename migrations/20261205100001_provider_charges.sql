-- Charges through a payment provider (README, "Calling other systems"): a payment is written `pending`
-- before the provider is called, without the provider's charge id, and becomes `captured` with it (or
-- `declined`). UNIQUE (provider, external_payment_id) still makes the API's answer and the provider's
-- webhook one payment; NULLs (pending payments) never collide.
ALTER TABLE payment ALTER COLUMN external_payment_id DROP NOT NULL;
ALTER TABLE payment DROP CONSTRAINT IF EXISTS payment_status_check;
ALTER TABLE payment ADD CONSTRAINT payment_status_check
    CHECK (status IN ('pending', 'captured', 'partially_refunded', 'refunded', 'declined'));
ALTER TABLE payment ADD CONSTRAINT payment_charged_has_external_id
    CHECK (status IN ('pending', 'declined') OR external_payment_id IS NOT NULL);

-- Provider events (webhooks) applied, by the provider's event id: each is applied once, in the transaction
-- of its effect.
CREATE TABLE provider_event (
    provider    text        NOT NULL,
    event_id    text        NOT NULL CHECK (length(event_id) BETWEEN 1 AND 255),
    type        text        NOT NULL,
    received_at timestamptz NOT NULL,
    PRIMARY KEY (provider, event_id)
);
