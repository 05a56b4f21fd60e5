-- Wake outbox relays when rows commit: one notification per inserting statement, delivered at commit
-- (PostgreSQL folds identical notifications of one transaction). Relays poll as a fallback.
CREATE FUNCTION outbox_message_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_message', '');
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_message_notify
    AFTER INSERT ON outbox_message
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_message_notify();
