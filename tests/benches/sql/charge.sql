-- The SQL transaction one POST /payments executes with the idempotency layer on (same statements, same
-- order, same round trips), for pgbench: the ceiling the HTTP service is measured against. Since issue 37:
-- the payment and its announcement in one statement, then the completed record inserted once.
\set n random(1, 1000000000000000)
BEGIN;
WITH inserted AS (
  INSERT INTO payment (id, merchant_id, order_id, customer_id, provider, external_payment_id, amount, currency,
                       status, created_at, updated_at)
    VALUES (md5(:n::text || 'p')::uuid, 'pgbench', md5(:n::text || 'o')::uuid, md5(:n::text || 'c')::uuid,
            'pgbench', md5(:n::text), 12.3400, 'EUR', 'captured', now(), now())
    ON CONFLICT (provider, external_payment_id) DO NOTHING
    RETURNING id, merchant_id, order_id, customer_id, provider, external_payment_id, amount, currency, status,
              refunded_amount, created_at
), announced AS (
  INSERT INTO outbox_message (id, topic, aggregatetype, aggregateid, type, payload, headers, saga_id, created_at)
    SELECT md5(:n::text || 'm')::uuid, 'payments', 'payment', md5(:n::text || 'o'), 'PaymentCaptured',
           '{"type":"PaymentCaptured","amount":"12.3400","currency":"EUR","provider":"pgbench"}', '{}', NULL, now()
    FROM inserted
)
SELECT * FROM inserted;
INSERT INTO idempotency_record AS r (scope, key, command_hash, state, status_code, response_headers, response_body,
                                     created_at, expires_at)
  SELECT 'pgbench', md5(:n::text), sha256(:n::text::bytea), 'completed', 201,
         '[["content-type","application/json"]]',
         convert_to('{"id":"00000000-0000-0000-0000-000000000000","status":"captured"}', 'UTF8'),
         now(), now() + interval '48 hours'
  FROM (SELECT set_config('lock_timeout', '2000ms', true)) AS bounded_wait
  ON CONFLICT (scope, key) DO UPDATE
    SET command_hash = EXCLUDED.command_hash, state = 'completed', status_code = EXCLUDED.status_code,
        response_headers = EXCLUDED.response_headers, response_body = EXCLUDED.response_body,
        created_at = EXCLUDED.created_at, expires_at = EXCLUDED.expires_at
    WHERE r.expires_at <= now()
  RETURNING set_config('lock_timeout', NULL, true) IS NOT NULL;
END;
