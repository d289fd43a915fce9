-- The registry: tenants, their API keys, base models, immutable adapter
-- versions, and routes from (tenant, model name) to a base model or to
-- weighted adapter versions.
--
-- Constraints live here, not only in code: every gateway replica, the admin
-- API and a person with psql all meet the same rules. Constraints are named
-- so that code can map a violation to the field it concerns.

-- ---------------------------------------------------------------------------
-- Tenants
-- ---------------------------------------------------------------------------

CREATE TABLE tenants (
    id           UUID        PRIMARY KEY DEFAULT gen_random_uuid(),
    -- A stable, URL-safe handle, for example "acme".
    name         TEXT        NOT NULL,
    display_name TEXT        NOT NULL DEFAULT '',
    -- Requests per minute and tokens per minute, shared across gateway
    -- replicas. NULL: the gateway's default.
    rpm_limit    INTEGER,
    tpm_limit    BIGINT,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- A disabled tenant's requests are refused with 403.
    disabled_at  TIMESTAMPTZ,
    CONSTRAINT tenants_name_unique UNIQUE (name),
    CONSTRAINT tenants_name_format CHECK (name ~ '^[a-z0-9][a-z0-9-]{0,62}$'),
    CONSTRAINT tenants_rpm_limit_positive CHECK (rpm_limit IS NULL OR rpm_limit > 0),
    CONSTRAINT tenants_tpm_limit_positive CHECK (tpm_limit IS NULL OR tpm_limit > 0)
);

-- ---------------------------------------------------------------------------
-- API keys
-- ---------------------------------------------------------------------------

-- A key is shown to its owner once, as "<prefix>.<secret>". Only the prefix
-- (for lookup) and SHA-256 of the secret are stored. Secrets are 256-bit
-- random strings, so a fast hash is enough: there is nothing to brute-force.
CREATE TABLE api_keys (
    id          UUID        PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id   UUID        NOT NULL,
    prefix      TEXT        NOT NULL,
    secret_hash BYTEA       NOT NULL,
    name        TEXT        NOT NULL DEFAULT '',
    scopes      TEXT[]      NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- NULL: never expires.
    expires_at  TIMESTAMPTZ,
    revoked_at  TIMESTAMPTZ,
    CONSTRAINT api_keys_tenant_fk FOREIGN KEY (tenant_id) REFERENCES tenants (id),
    CONSTRAINT api_keys_prefix_unique UNIQUE (prefix),
    CONSTRAINT api_keys_prefix_format CHECK (prefix ~ '^lf_[A-Za-z0-9]{8,32}$'),
    CONSTRAINT api_keys_secret_hash_sha256 CHECK (octet_length(secret_hash) = 32),
    CONSTRAINT api_keys_scopes_known CHECK (
        cardinality(scopes) > 0
        AND scopes <@ ARRAY['inference', 'models:read']::TEXT[]
        AND array_position(scopes, NULL) IS NULL
    ),
    CONSTRAINT api_keys_expiry_after_creation CHECK (expires_at IS NULL OR expires_at > created_at)
);

CREATE INDEX api_keys_tenant ON api_keys (tenant_id);

-- ---------------------------------------------------------------------------
-- Base models
-- ---------------------------------------------------------------------------

CREATE TABLE base_models (
    id           BIGINT      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name         TEXT        NOT NULL,
    -- SHA-256 over the weights in canonical order, as workers compute it.
    base_hash    TEXT        NOT NULL,
    -- The Hugging Face model_type.
    architecture TEXT        NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT base_models_name_unique UNIQUE (name),
    CONSTRAINT base_models_name_format CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$'),
    CONSTRAINT base_models_base_hash_unique UNIQUE (base_hash),
    CONSTRAINT base_models_base_hash_format CHECK (base_hash ~ '^[0-9a-f]{64}$'),
    CONSTRAINT base_models_architecture_known CHECK (architecture IN ('llama', 'mistral', 'qwen2'))
);

-- What makes a base model what it is cannot change under the adapters
-- registered against it.
CREATE FUNCTION base_models_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'base model % cannot be deleted', OLD.id
            USING ERRCODE = 'restrict_violation', CONSTRAINT = 'base_models_immutable';
    END IF;
    IF NEW.base_hash IS DISTINCT FROM OLD.base_hash
       OR NEW.architecture IS DISTINCT FROM OLD.architecture THEN
        RAISE EXCEPTION 'base model %: base_hash and architecture are immutable', OLD.id
            USING ERRCODE = 'restrict_violation', CONSTRAINT = 'base_models_immutable';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER base_models_immutable
    BEFORE UPDATE OR DELETE ON base_models
    FOR EACH ROW EXECUTE FUNCTION base_models_immutable();

-- ---------------------------------------------------------------------------
-- Adapters: immutable versions
-- ---------------------------------------------------------------------------

CREATE TYPE adapter_state AS ENUM ('active', 'retired');

CREATE TABLE adapters (
    -- Taken from the identity sequence and never reused: rows cannot be
    -- deleted, and the key is unique.
    lora_int_id     BIGINT        GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name            TEXT          NOT NULL,
    version         INTEGER       NOT NULL,
    base_model_id   BIGINT        NOT NULL,
    -- The tenant that owns these weights; NULL for a platform-wide adapter.
    -- A tenant's routes may use only its own adapters and platform-wide ones.
    tenant_id       UUID,
    rank            INTEGER       NOT NULL,
    alpha           DOUBLE PRECISION NOT NULL,
    use_rslora      BOOLEAN       NOT NULL DEFAULT false,
    target_modules  TEXT[]        NOT NULL,
    -- Relative to the workers' artifact roots; never an absolute path.
    artifact_uri    TEXT          NOT NULL,
    artifact_sha256 TEXT          NOT NULL,
    state           adapter_state NOT NULL DEFAULT 'active',
    created_at      TIMESTAMPTZ   NOT NULL DEFAULT now(),
    retired_at      TIMESTAMPTZ,
    CONSTRAINT adapters_lora_int_id_positive CHECK (lora_int_id > 0),
    CONSTRAINT adapters_base_model_fk FOREIGN KEY (base_model_id) REFERENCES base_models (id),
    CONSTRAINT adapters_tenant_fk FOREIGN KEY (tenant_id) REFERENCES tenants (id),
    CONSTRAINT adapters_name_format CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$'),
    CONSTRAINT adapters_name_version_unique UNIQUE (name, version),
    CONSTRAINT adapters_version_positive CHECK (version > 0),
    CONSTRAINT adapters_rank_positive CHECK (rank > 0),
    -- NaN compares greater than every number in Postgres, so rule it out by name.
    CONSTRAINT adapters_alpha_finite_positive CHECK (
        alpha > 0 AND alpha <> 'NaN'::DOUBLE PRECISION AND alpha <> 'Infinity'::DOUBLE PRECISION
    ),
    CONSTRAINT adapters_target_modules_known CHECK (
        cardinality(target_modules) > 0
        AND target_modules <@ ARRAY['q_proj', 'k_proj', 'v_proj', 'o_proj',
                                    'gate_proj', 'up_proj', 'down_proj']::TEXT[]
        AND array_position(target_modules, NULL) IS NULL
    ),
    CONSTRAINT adapters_artifact_uri_relative CHECK (
        artifact_uri <> ''
        AND artifact_uri !~ '^/'
        AND artifact_uri !~ '(^|/)\.\.(/|$)'
        AND (artifact_uri !~ '^[A-Za-z][A-Za-z0-9+.-]*:' OR artifact_uri ~ '^file:[^/]')
    ),
    CONSTRAINT adapters_artifact_sha256_format CHECK (artifact_sha256 ~ '^[0-9a-f]{64}$'),
    CONSTRAINT adapters_retired_at_matches_state CHECK ((state = 'retired') = (retired_at IS NOT NULL)),
    -- Lets routes reference (adapter, base model) pairs, so a route's
    -- versions provably share one base model.
    CONSTRAINT adapters_lora_int_id_base_model_unique UNIQUE (lora_int_id, base_model_id)
);

CREATE INDEX adapters_base_model ON adapters (base_model_id);
CREATE INDEX adapters_tenant ON adapters (tenant_id) WHERE tenant_id IS NOT NULL;

-- A version is immutable: only its state may move, from active to retired.
-- Deleting is refused too, so a lora_int_id can never come back with other
-- weights behind it.
CREATE FUNCTION adapters_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'adapter lora_int_id % cannot be deleted; retire it instead', OLD.lora_int_id
            USING ERRCODE = 'restrict_violation', CONSTRAINT = 'adapters_immutable';
    END IF;
    IF (NEW.lora_int_id, NEW.name, NEW.version, NEW.base_model_id, NEW.tenant_id, NEW.rank,
        NEW.alpha, NEW.use_rslora, NEW.target_modules, NEW.artifact_uri, NEW.artifact_sha256,
        NEW.created_at)
       IS DISTINCT FROM
       (OLD.lora_int_id, OLD.name, OLD.version, OLD.base_model_id, OLD.tenant_id, OLD.rank,
        OLD.alpha, OLD.use_rslora, OLD.target_modules, OLD.artifact_uri, OLD.artifact_sha256,
        OLD.created_at) THEN
        RAISE EXCEPTION 'adapter lora_int_id % is immutable; register a new version instead', OLD.lora_int_id
            USING ERRCODE = 'restrict_violation', CONSTRAINT = 'adapters_immutable';
    END IF;
    IF OLD.state = 'retired' AND NEW.state = 'active' THEN
        RAISE EXCEPTION 'adapter lora_int_id % is retired and cannot be reactivated', OLD.lora_int_id
            USING ERRCODE = 'restrict_violation', CONSTRAINT = 'adapters_immutable';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER adapters_immutable
    BEFORE UPDATE OR DELETE ON adapters
    FOR EACH ROW EXECUTE FUNCTION adapters_immutable();

-- ---------------------------------------------------------------------------
-- Routes
-- ---------------------------------------------------------------------------

-- A route maps (tenant, public model name) to its current revision. Every
-- change makes a new revision, so history is kept and rollback is a copy;
-- current_revision doubles as the optimistic-concurrency version (etag).
CREATE TABLE routes (
    id               UUID        PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id        UUID        NOT NULL,
    model_name       TEXT        NOT NULL,
    current_revision INTEGER     NOT NULL,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT routes_tenant_fk FOREIGN KEY (tenant_id) REFERENCES tenants (id),
    CONSTRAINT routes_tenant_model_unique UNIQUE (tenant_id, model_name),
    CONSTRAINT routes_model_name_format CHECK (model_name ~ '^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$'),
    CONSTRAINT routes_current_revision_positive CHECK (current_revision > 0)
);

CREATE TYPE route_target AS ENUM ('base', 'adapters');

-- One immutable revision of a route: either the base model alone, or
-- adapter versions of that base model with weights summing to 10000 bp.
CREATE TABLE route_revisions (
    route_id      UUID         NOT NULL,
    revision      INTEGER      NOT NULL,
    base_model_id BIGINT       NOT NULL,
    target        route_target NOT NULL,
    created_at    TIMESTAMPTZ  NOT NULL DEFAULT now(),
    -- Who made the change, as the admin plane knows them.
    created_by    TEXT         NOT NULL DEFAULT '',
    CONSTRAINT route_revisions_pkey PRIMARY KEY (route_id, revision),
    CONSTRAINT route_revisions_route_fk FOREIGN KEY (route_id) REFERENCES routes (id),
    CONSTRAINT route_revisions_base_model_fk FOREIGN KEY (base_model_id) REFERENCES base_models (id),
    CONSTRAINT route_revisions_revision_positive CHECK (revision > 0),
    CONSTRAINT route_revisions_route_revision_base_unique UNIQUE (route_id, revision, base_model_id)
);

-- The current revision must be one of the route's own. Deferred, because a
-- new route and its first revision reference each other.
ALTER TABLE routes
    ADD CONSTRAINT routes_current_revision_fk
    FOREIGN KEY (id, current_revision) REFERENCES route_revisions (route_id, revision)
    DEFERRABLE INITIALLY DEFERRED;

CREATE TABLE route_weights (
    route_id      UUID    NOT NULL,
    revision      INTEGER NOT NULL,
    -- Repeats the revision's base model so that both foreign keys below can
    -- pin it: every version of one revision shares that base model.
    base_model_id BIGINT  NOT NULL,
    lora_int_id   BIGINT  NOT NULL,
    -- Share of traffic in basis points; a revision's weights sum to 10000.
    weight_bp     INTEGER NOT NULL,
    CONSTRAINT route_weights_pkey PRIMARY KEY (route_id, revision, lora_int_id),
    CONSTRAINT route_weights_revision_fk FOREIGN KEY (route_id, revision, base_model_id)
        REFERENCES route_revisions (route_id, revision, base_model_id),
    CONSTRAINT route_weights_adapter_same_base_fk FOREIGN KEY (lora_int_id, base_model_id)
        REFERENCES adapters (lora_int_id, base_model_id),
    CONSTRAINT route_weights_weight_bp_range CHECK (weight_bp > 0 AND weight_bp <= 10000)
);

CREATE INDEX route_weights_adapter ON route_weights (lora_int_id);

-- Revisions and their weights are history: written once, never changed.
CREATE FUNCTION route_history_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '%: route revisions are immutable; create a new revision instead', TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation', CONSTRAINT = TG_TABLE_NAME || '_immutable';
END;
$$;

CREATE TRIGGER route_revisions_immutable
    BEFORE UPDATE OR DELETE ON route_revisions
    FOR EACH ROW EXECUTE FUNCTION route_history_immutable();

CREATE TRIGGER route_weights_immutable
    BEFORE UPDATE OR DELETE ON route_weights
    FOR EACH ROW EXECUTE FUNCTION route_history_immutable();

-- A new weight may not point at a retired adapter, nor at another tenant's.
CREATE FUNCTION route_weights_adapter_usable() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    adapter_tenant UUID;
    adapter_state_now adapter_state;
    route_tenant UUID;
BEGIN
    SELECT a.tenant_id, a.state INTO adapter_tenant, adapter_state_now
        FROM adapters a WHERE a.lora_int_id = NEW.lora_int_id;
    SELECT r.tenant_id INTO route_tenant FROM routes r WHERE r.id = NEW.route_id;
    IF adapter_state_now = 'retired' THEN
        RAISE EXCEPTION 'adapter lora_int_id % is retired and cannot receive traffic', NEW.lora_int_id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'route_weights_adapter_active';
    END IF;
    IF adapter_tenant IS NOT NULL AND adapter_tenant IS DISTINCT FROM route_tenant THEN
        RAISE EXCEPTION 'adapter lora_int_id % belongs to another tenant', NEW.lora_int_id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'route_weights_adapter_tenant';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER route_weights_adapter_usable
    BEFORE INSERT ON route_weights
    FOR EACH ROW EXECUTE FUNCTION route_weights_adapter_usable();

-- Checked at commit, once all of a revision's rows are in: a base revision
-- has no weights; an adapter revision has weights that sum to exactly 10000.
CREATE FUNCTION route_revision_weights_valid() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    rev_target route_target;
    weight_rows INTEGER;
    weight_sum BIGINT;
BEGIN
    SELECT target INTO rev_target
        FROM route_revisions WHERE route_id = NEW.route_id AND revision = NEW.revision;
    SELECT count(*), COALESCE(sum(weight_bp), 0) INTO weight_rows, weight_sum
        FROM route_weights WHERE route_id = NEW.route_id AND revision = NEW.revision;
    IF rev_target = 'base' AND weight_rows > 0 THEN
        RAISE EXCEPTION 'route % revision %: a base-model revision has no adapter weights',
                NEW.route_id, NEW.revision
            USING ERRCODE = 'check_violation', CONSTRAINT = 'route_revisions_base_has_no_weights';
    END IF;
    IF rev_target = 'adapters' AND weight_sum <> 10000 THEN
        RAISE EXCEPTION 'route % revision %: adapter weights sum to % bp, not 10000',
                NEW.route_id, NEW.revision, weight_sum
            USING ERRCODE = 'check_violation', CONSTRAINT = 'route_revisions_weights_sum_10000';
    END IF;
    RETURN NULL;
END;
$$;

CREATE CONSTRAINT TRIGGER route_revisions_weights_valid
    AFTER INSERT ON route_revisions
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION route_revision_weights_valid();

CREATE CONSTRAINT TRIGGER route_weights_sum_valid
    AFTER INSERT ON route_weights
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION route_revision_weights_valid();
