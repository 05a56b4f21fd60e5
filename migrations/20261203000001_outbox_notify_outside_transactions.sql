-- A transaction that executed NOTIFY holds a database-wide lock from pre-commit until its commit record is
-- flushed, so every business transaction that inserted an outbox row committed alone: no group commit,
-- throughput capped at 1/fsync. Relays are now woken in process after the commit and by a debounced NOTIFY
-- sent outside business transactions (adapters-postgres/src/wakeup.rs).
DROP TRIGGER IF EXISTS outbox_message_notify ON outbox_message;
DROP FUNCTION IF EXISTS outbox_message_notify();
