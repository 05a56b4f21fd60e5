-- Which claim of a key a held record is (the claim's time in microseconds): intent ids and downstream keys
-- derive from it, so a key reused after its record expired (or was cleaned up) names new rows and new
-- calls, never the earlier request's payment or refund. NULL for records claimed before this column: their
-- names keep the earlier derivation.
ALTER TABLE idempotency_record ADD COLUMN generation bigint;
