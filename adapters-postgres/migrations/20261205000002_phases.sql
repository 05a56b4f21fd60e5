-- Phases around a foreign call (domain/src/phases.rs): a record between its phases is committed in flight
-- with the lease of the attempt that holds it (the attempt number fences a late original out) and the
-- recovery point a resumed attempt starts from. Records without a lease are claims inside their own
-- transaction, as before.
ALTER TABLE idempotency_record
    ADD COLUMN IF NOT EXISTS attempt        integer     NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS lease_until    timestamptz,
    ADD COLUMN IF NOT EXISTS recovery_point text;
-- Only records held between phases: what the gauges of held records read, cheaply, on a large table.
CREATE INDEX IF NOT EXISTS idempotency_record_held_idx ON idempotency_record (created_at)
    WHERE state = 'in_flight' AND lease_until IS NOT NULL;
