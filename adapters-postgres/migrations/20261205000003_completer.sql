-- The completer (adapters-http/src/completer.rs): a record held between the phases of a foreign call keeps
-- the request that started it, so the completer can drive it to completion when the attempt died and its
-- client went away; the count of its runs sets its backoff; a record it gave up on (past the other side's
-- idempotency window, or no request to re-drive) is parked for an operator: never taken over, never cleaned
-- up, never silently failed.
ALTER TABLE idempotency_record
    ADD COLUMN IF NOT EXISTS request_method       text,
    ADD COLUMN IF NOT EXISTS request_uri          text,
    ADD COLUMN IF NOT EXISTS request_content_type text,
    ADD COLUMN IF NOT EXISTS request_body         bytea,
    ADD COLUMN IF NOT EXISTS completer_runs       integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS parked_at            timestamptz,
    ADD COLUMN IF NOT EXISTS parked_reason        text;
