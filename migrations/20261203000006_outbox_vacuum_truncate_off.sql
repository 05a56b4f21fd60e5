-- The outbox is a queue: rows come and go every second and the relay vacuums it every few seconds
-- (PgStore::vacuum_outbox). Truncating its empty tail would take an ACCESS EXCLUSIVE lock that blocks the
-- business transactions' inserts, and the space is reused at once anyway.
ALTER TABLE outbox_message SET (vacuum_truncate = false);
