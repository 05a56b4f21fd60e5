-- The settings idem's guarantees depend on, as the last start recorded them (`idem serve` checks them at
-- start): the dedup storage and retention per consumer group, the group reading each topic, the
-- idempotency retention. A change that would re-open processed events or keys is refused or handled
-- (a raised retention keeps the old one's limits for what was recorded before `changed_at`).
CREATE TABLE idem_setting (
    name       text        PRIMARY KEY,
    value      text        NOT NULL,
    previous   text,
    changed_at timestamptz NOT NULL
);
