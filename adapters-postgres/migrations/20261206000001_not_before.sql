-- After an unknown outcome of a call between phases: the earliest next call (the other side's
-- Retry-After, else a backoff), on the database's clock. No takeover, retry or completer run calls before
-- it, so a client retrying every second through an outage sends one call per wait, not one per retry.
ALTER TABLE idempotency_record ADD COLUMN not_before timestamptz;
