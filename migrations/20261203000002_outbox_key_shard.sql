-- Relays lock key shards, not keys: at most 64 advisory locks in the whole cluster, whatever the backlog or
-- the plan (adapters-postgres/src/repos.rs, claim_unpublished). A key always hashes to the same shard.
ALTER TABLE outbox_message
    ADD COLUMN key_shard integer NOT NULL GENERATED ALWAYS AS ((hashtextextended(aggregateid, 7368) & 63)::integer) STORED;
CREATE INDEX outbox_message_unpublished_shard_idx ON outbox_message (key_shard, seq) WHERE published_at IS NULL;
