-- Which payments idem charged itself through the configured provider (README, "Calling other systems"):
-- only those are refunded through the provider. A payment recorded with a provider's name (the recording
-- flow, an order event) names a charge made elsewhere, and its refunds are recorded in idem only.
-- Adding a column with a constant default rewrites nothing (PostgreSQL 11+).
ALTER TABLE payment ADD COLUMN through_provider boolean NOT NULL DEFAULT false;
-- The charges made through the provider before this column: their ids are the layer's intent ids, UUID
-- version 8 (idem_domain::phases::intent_id); every other payment id is a UUID v7 minted by the service.
UPDATE payment SET through_provider = true WHERE substr(id::text, 15, 1) = '8';
