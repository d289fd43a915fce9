-- Prompt tokens a completion took from the worker's prefix cache (their
-- prefill skipped), as OpenAI reports usage.prompt_tokens_details.
-- cached_tokens. 0 for rows written before it was recorded.
ALTER TABLE audit_log
    ADD COLUMN cached_tokens INTEGER NOT NULL DEFAULT 0
        CONSTRAINT audit_log_cached_tokens_range
        CHECK (cached_tokens >= 0 AND cached_tokens <= prompt_tokens);
