-- Each tenant's weight in the workers' fair admission: while tenants wait,
-- one of weight 2 is fed twice the tokens of one of weight 1. The gateway
-- sends it with every request, beside the tenant's id as the fairness key.
ALTER TABLE tenants
    ADD COLUMN weight DOUBLE PRECISION NOT NULL DEFAULT 1
        CONSTRAINT tenants_weight_range CHECK (weight > 0 AND weight <= 1000);
