-- idem's own tables, and nothing of the reference payment service: what a toolkit user's database gets.
-- Every statement is idempotent (IF NOT EXISTS, CREATE OR REPLACE, settings re-applied): a database that
-- already holds these tables from the reference service's history (migrations/ at the repository's root,
-- versions 2026120…) is left as it is. Their final shapes are the same; a test compares the two.
-- New toolkit tables and changes are added here as new migrations, never in the reference history.

-- HTTP idempotency records. The scope (the merchant) is part of the key: one client's key can never
-- replay another client's response.
CREATE TABLE IF NOT EXISTS idempotency_record (
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
CREATE INDEX IF NOT EXISTS idempotency_record_expires_at_idx ON idempotency_record (expires_at);

-- Events already processed, per consumer (consumer group).
CREATE TABLE IF NOT EXISTS processed_event (
    consumer_name text        NOT NULL,
    event_id      uuid        NOT NULL,
    topic         text        NOT NULL,
    created_at    timestamptz NOT NULL,
    expires_at    timestamptz NOT NULL,
    PRIMARY KEY (consumer_name, event_id)
);
CREATE INDEX IF NOT EXISTS processed_event_expires_at_idx ON processed_event (expires_at);

-- The time a UUID v7 carries (epoch for other versions): partition key of processed_event_partitioned.
CREATE OR REPLACE FUNCTION uuid_v7_time(id uuid) RETURNS timestamptz
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT CASE WHEN substr(id::text, 15, 1) = '7'
        THEN to_timestamp((('x' || substr(replace(id::text, '-', ''), 1, 12))::bit(48)::bigint) / 1000.0)
        ELSE to_timestamp(0)
    END
$$;

-- The same, in daily partitions on the event id's time (DEDUP_STORAGE=partitioned).
CREATE TABLE IF NOT EXISTS processed_event_partitioned (
    consumer_name text        NOT NULL,
    event_id      uuid        NOT NULL,
    event_time    timestamptz NOT NULL,
    topic         text        NOT NULL,
    created_at    timestamptz NOT NULL,
    expires_at    timestamptz NOT NULL,
    PRIMARY KEY (consumer_name, event_id, event_time)
) PARTITION BY RANGE (event_time);
CREATE TABLE IF NOT EXISTS processed_event_partitioned_default PARTITION OF processed_event_partitioned DEFAULT;
CREATE INDEX IF NOT EXISTS processed_event_partitioned_expires_at_idx ON processed_event_partitioned (expires_at);

-- Transactional outbox, laid out for Debezium's outbox event router (id, aggregatetype, aggregateid, type,
-- payload) plus what idem's relay needs. Rows are deleted when published.
CREATE TABLE IF NOT EXISTS outbox_message (
    id             uuid        PRIMARY KEY,
    seq            bigint      GENERATED ALWAYS AS IDENTITY,
    topic          text        NOT NULL,
    aggregatetype  text        NOT NULL,
    aggregateid    text        NOT NULL,
    type           text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL DEFAULT '{}'::jsonb,
    saga_id        uuid,
    created_at     timestamptz NOT NULL,
    attempts       integer     NOT NULL DEFAULT 0,
    last_error     text,
    key_shard      integer     NOT NULL GENERATED ALWAYS AS ((hashtextextended(aggregateid, 7368) & 63)::integer) STORED,
    quarantined_at timestamptz
);
CREATE INDEX IF NOT EXISTS outbox_message_seq_idx ON outbox_message (seq);
CREATE INDEX IF NOT EXISTS outbox_message_shard_idx ON outbox_message (key_shard, seq);
CREATE INDEX IF NOT EXISTS outbox_message_quarantined_key_idx ON outbox_message (aggregateid) WHERE quarantined_at IS NOT NULL;

-- Saga steps: each (saga_id, step) runs at most once.
CREATE TABLE IF NOT EXISTS saga_step (
    saga_id    uuid        NOT NULL,
    step       text        NOT NULL,
    outcome    jsonb,
    created_at timestamptz NOT NULL,
    PRIMARY KEY (saga_id, step)
);

-- Operators' records: re-driven dead letters and late admissions.
CREATE TABLE IF NOT EXISTS dlq_redrive (
    dlq_topic     text        NOT NULL,
    dlq_partition integer     NOT NULL,
    dlq_offset    bigint      NOT NULL,
    event_id      uuid,
    source_topic  text        NOT NULL,
    reason        text        NOT NULL,
    redriven_by   text        NOT NULL,
    redriven_at   timestamptz NOT NULL,
    admitted_late boolean     NOT NULL DEFAULT false,
    PRIMARY KEY (dlq_topic, dlq_partition, dlq_offset)
);
CREATE TABLE IF NOT EXISTS late_admission (
    consumer    text        NOT NULL,
    event_id    uuid        NOT NULL,
    admitted_by text        NOT NULL,
    admitted_at timestamptz NOT NULL,
    applied_at  timestamptz,
    PRIMARY KEY (consumer, event_id)
);

-- Settings dedup depends on, checked at start.
CREATE TABLE IF NOT EXISTS idem_setting (
    name       text        PRIMARY KEY,
    value      text        NOT NULL,
    previous   text,
    changed_at timestamptz NOT NULL
);

-- High-churn tables: vacuum them early and often; the outbox never truncates (ACCESS EXCLUSIVE lock).
ALTER TABLE idempotency_record SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE processed_event    SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE outbox_message     SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02, vacuum_truncate = false);
