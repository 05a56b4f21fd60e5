-- Rows the broker can never accept (too large, not authorized, invalid) are quarantined after a few
-- attempts instead of being retried for ever: kept, counted, listed for an operator. Later rows of the same
-- key wait behind a quarantined row (per-key order); the small partial index finds such keys.
ALTER TABLE outbox_message ADD COLUMN quarantined_at timestamptz;
CREATE INDEX outbox_message_quarantined_key_idx ON outbox_message (aggregateid)
    WHERE quarantined_at IS NOT NULL AND published_at IS NULL;
