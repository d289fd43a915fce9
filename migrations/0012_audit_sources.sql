-- Where each request came from, and failed authentications aggregated.
--
-- client_addr: the client's address as the gateway decided it (the TCP
-- peer, or the X-Forwarded-For hop a trusted proxy vouched for). NULL for
-- rows written before it was kept.
--
-- occurrences: the requests a row stands for. 1 for every completion; a
-- row of failed authentications (error_code invalid_api_key or
-- too_many_failed_authentications, no tenant) counts one source's failures
-- in one window, received_at and completed_at being the first and last,
-- api_key_prefix and last_key_prefix the first and last key prefix seen.
ALTER TABLE audit_log
    ADD COLUMN client_addr INET,
    ADD COLUMN occurrences INTEGER NOT NULL DEFAULT 1
        CONSTRAINT audit_log_occurrences_positive CHECK (occurrences >= 1),
    ADD COLUMN last_key_prefix TEXT;
