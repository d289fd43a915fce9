-- A revocation of an admin token already revoked until an earlier time
-- extends that row (ON CONFLICT ... DO UPDATE): a short-lived revocation
-- made by the token's own holder cannot block the real one.
GRANT UPDATE ON admin_token_revocations TO lorafleet_admin;
