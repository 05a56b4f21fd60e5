-- Operations: who re-drove which dead letter, and events older than the dedup window that an operator
-- admitted deliberately.
--
-- A dead letter is re-driven at most once (its topic, partition and offset are the key); the message goes
-- back to its source topic with its original event_id, so consumer dedup still holds.
CREATE TABLE dlq_redrive (
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

-- An event refused as older-than-dedup-window is applied only if admitted here, and only once: the consumer
-- sets applied_at in the transaction that applies it. The row is kept (it is that event's dedup record,
-- which the dedup table no longer guarantees at that age).
CREATE TABLE late_admission (
    consumer    text        NOT NULL,
    event_id    uuid        NOT NULL,
    admitted_by text        NOT NULL,
    admitted_at timestamptz NOT NULL,
    applied_at  timestamptz,
    PRIMARY KEY (consumer, event_id)
);
