-- Tenant limits an admin can change (PATCH /admin/v1/tenants/{tenant}),
-- each one of three things: NULL, the gateway's default (its flag); 0,
-- explicitly unlimited; a positive number, the limit itself.
ALTER TABLE tenants DROP CONSTRAINT tenants_rpm_limit_positive;
ALTER TABLE tenants DROP CONSTRAINT tenants_tpm_limit_positive;
ALTER TABLE tenants
    ADD CONSTRAINT tenants_rpm_limit_positive CHECK (rpm_limit IS NULL OR rpm_limit >= 0),
    ADD CONSTRAINT tenants_tpm_limit_positive CHECK (tpm_limit IS NULL OR tpm_limit >= 0),
    -- Requests the tenant may have in flight at once, across the gateways
    -- (NULL: --max-concurrent-per-tenant).
    ADD COLUMN max_concurrent INTEGER
        CONSTRAINT tenants_max_concurrent_positive CHECK (max_concurrent IS NULL OR max_concurrent >= 0);
