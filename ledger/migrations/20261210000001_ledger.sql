-- The ledger's own tables, installed beside idem's (PgStore::migrate_with applies idem's migrations, then
-- these; both are recorded in _sqlx_migrations, so versions must not collide with idem's 202612020…/202612030…).
CREATE TABLE ledger_entry (
    id         uuid          PRIMARY KEY,
    merchant   text          NOT NULL,
    account    text          NOT NULL,
    amount     numeric(19,4) NOT NULL CHECK (amount > 0),
    source     text          NOT NULL,
    created_at timestamptz   NOT NULL
);

CREATE TABLE ledger_balance (
    merchant text          NOT NULL,
    account  text          NOT NULL,
    balance  numeric(19,4) NOT NULL,
    PRIMARY KEY (merchant, account)
);
