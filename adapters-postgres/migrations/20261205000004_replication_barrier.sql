-- Before idem answers from a record it read (a replay, a duplicate event) it commits a write of its own and
-- so waits until the synchronous standby has everything committed before it, the record included
-- (adapters-postgres/src/replication.rs): a commit whose standby wait was cancelled is visible on the primary
-- although no standby has it. A transaction that writes no WAL never waits for a standby, so the barrier
-- touches one of 64 rows (spread, so concurrent replays rarely wait on each other's row lock; HOT updates in
-- half-filled pages, so no index is written).
CREATE TABLE IF NOT EXISTS idem_replication_barrier (
    slot       smallint PRIMARY KEY,
    touched_at timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 50);
INSERT INTO idem_replication_barrier (slot) SELECT generate_series(0, 63) ON CONFLICT DO NOTHING;
