-- idem: initial schema.
-- Every table that expires has an index on expires_at so cleanup deletes by index, never by full scan.

CREATE TABLE payment (
    id                  uuid          PRIMARY KEY,
    merchant_id         text          NOT NULL,
    order_id            uuid          NOT NULL,
    customer_id         uuid          NOT NULL,
    provider            text          NOT NULL,
    external_payment_id text          NOT NULL,
    amount              numeric(19,4) NOT NULL CHECK (amount > 0),
    currency            char(3)       NOT NULL CHECK (currency ~ '^[A-Z]{3}$'),
    status              text          NOT NULL
        CHECK (status IN ('pending', 'captured', 'partially_refunded', 'refunded')),
    refunded_amount     numeric(19,4) NOT NULL DEFAULT 0
        CHECK (refunded_amount >= 0 AND refunded_amount <= amount),
    created_at          timestamptz   NOT NULL,
    updated_at          timestamptz   NOT NULL,
    -- the second protection of money: one payment per provider payment, whatever the idempotency key
    CONSTRAINT payment_provider_external_id_key UNIQUE (provider, external_payment_id)
);
CREATE INDEX payment_order_id_idx ON payment (order_id);

CREATE TABLE refund (
    id          uuid          PRIMARY KEY,
    payment_id  uuid          NOT NULL REFERENCES payment (id),
    amount      numeric(19,4) NOT NULL CHECK (amount > 0),
    reason      text,
    created_at  timestamptz   NOT NULL
);
CREATE INDEX refund_payment_id_idx ON refund (payment_id);

-- HTTP idempotency records. The scope (the merchant) is part of the key: one client's key can never
-- replay another client's response.
CREATE TABLE idempotency_record (
    scope            text        NOT NULL,
    key              text        NOT NULL CHECK (length(key) BETWEEN 1 AND 255),
    command_hash     bytea       NOT NULL CHECK (length(command_hash) = 32),
    state            text        NOT NULL CHECK (state IN ('in_flight', 'completed')),
    status_code      smallint,
    response_headers jsonb,
    response_body    bytea,
    created_at       timestamptz NOT NULL,
    expires_at       timestamptz NOT NULL,
    PRIMARY KEY (scope, key),
    CHECK (state = 'in_flight' OR (status_code IS NOT NULL AND response_body IS NOT NULL))
);
CREATE INDEX idempotency_record_expires_at_idx ON idempotency_record (expires_at);

-- Events already processed, per consumer (consumer group): two groups reading one topic never dedup
-- each other.
CREATE TABLE processed_event (
    consumer_name text        NOT NULL,
    event_id      uuid        NOT NULL,
    topic         text        NOT NULL,
    created_at    timestamptz NOT NULL,
    expires_at    timestamptz NOT NULL,
    PRIMARY KEY (consumer_name, event_id)
);
CREATE INDEX processed_event_expires_at_idx ON processed_event (expires_at);

-- Transactional outbox, laid out for Debezium's outbox event router (id, aggregatetype, aggregateid,
-- type, payload) plus what idem's own relay needs.
CREATE TABLE outbox_message (
    id            uuid        PRIMARY KEY,
    seq           bigint      GENERATED ALWAYS AS IDENTITY,
    topic         text        NOT NULL,
    aggregatetype text        NOT NULL,
    aggregateid   text        NOT NULL,
    type          text        NOT NULL,
    payload       jsonb       NOT NULL,
    headers       jsonb       NOT NULL DEFAULT '{}'::jsonb,
    saga_id       uuid,
    created_at    timestamptz NOT NULL,
    published_at  timestamptz,
    expires_at    timestamptz,
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text
);
CREATE INDEX outbox_message_unpublished_idx ON outbox_message (seq) WHERE published_at IS NULL;
CREATE INDEX outbox_message_expires_at_idx ON outbox_message (expires_at) WHERE expires_at IS NOT NULL;

-- Saga steps: each (saga_id, step) runs at most once.
CREATE TABLE saga_step (
    saga_id    uuid        NOT NULL,
    step       text        NOT NULL,
    outcome    jsonb,
    created_at timestamptz NOT NULL,
    PRIMARY KEY (saga_id, step)
);

-- The order projection kept by the order-event handler; versions only move forward.
CREATE TABLE order_projection (
    order_id   uuid        PRIMARY KEY,
    version    bigint      NOT NULL,
    status     text        NOT NULL,
    updated_at timestamptz NOT NULL
);

-- High-churn tables: vacuum them early and often.
ALTER TABLE idempotency_record SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE processed_event    SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE outbox_message     SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);
