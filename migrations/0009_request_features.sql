-- Which OpenAI API features a completion used, for compliance and billing
-- queries: a comma-separated list of stable names in a fixed order
-- (logprobs, echo, n, best_of, logit_bias, penalties, min_tokens,
-- structured_output, tools). Empty for a plain request, and for rows written
-- before it was recorded.
ALTER TABLE audit_log
    ADD COLUMN features TEXT NOT NULL DEFAULT ''
        CONSTRAINT audit_log_features_format
        CHECK (features ~ '^([a-z_]+(,[a-z_]+)*)?$');
