-- The scale-out variant of processed_event: daily range partitions on the event's own time, read from
-- its UUID v7 id, so a redelivered event always lands in the same partition and still conflicts. Cleanup
-- detaches and drops whole expired partitions instead of deleting rows. Used when DEDUP_STORAGE=partitioned.

-- Milliseconds since the epoch in the first 48 bits of a UUID v7; other versions map to the epoch (they
-- land in the default partition, cleaned row by row).
CREATE FUNCTION uuid_v7_time(id uuid) RETURNS timestamptz
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT CASE WHEN substr(id::text, 15, 1) = '7'
        THEN to_timestamp((('x' || substr(replace(id::text, '-', ''), 1, 12))::bit(48)::bigint) / 1000.0)
        ELSE to_timestamp(0)
    END
$$;

CREATE TABLE processed_event_partitioned (
    consumer_name text        NOT NULL,
    event_id      uuid        NOT NULL,
    event_time    timestamptz NOT NULL,
    topic         text        NOT NULL,
    created_at    timestamptz NOT NULL,
    expires_at    timestamptz NOT NULL,
    -- event_time is a function of event_id: unique (consumer_name, event_id) as in processed_event
    PRIMARY KEY (consumer_name, event_id, event_time)
) PARTITION BY RANGE (event_time);

CREATE TABLE processed_event_partitioned_default PARTITION OF processed_event_partitioned DEFAULT;
CREATE INDEX processed_event_partitioned_expires_at_idx ON processed_event_partitioned (expires_at);
