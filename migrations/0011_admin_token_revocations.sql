-- Admin tokens revoked before they expire: a deny-list of their `jti`
-- claims, which every gateway replica loads with its registry snapshot
-- (so a revocation is honoured fleet-wide within the reload time). A row
-- is worth keeping only until the token's own expiry.
CREATE TABLE admin_token_revocations (
    jti        TEXT        PRIMARY KEY,
    -- The token's `exp`: after it, the token is refused anyway.
    expires_at TIMESTAMPTZ NOT NULL,
    revoked_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- The admin subject that revoked it (its holder, for a sign-out).
    revoked_by TEXT        NOT NULL,
    CONSTRAINT admin_token_revocations_jti_length CHECK (length(jti) BETWEEN 1 AND 256)
);

GRANT SELECT ON admin_token_revocations TO lorafleet_runtime;
GRANT SELECT, INSERT ON admin_token_revocations TO lorafleet_admin;
