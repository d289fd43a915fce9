-- Adapter artifacts in object stores: an artifact URI may also be
-- s3://bucket/key (a bucket name as S3 allows it, a key without empty, .
-- or .. segments). Which buckets are allowed is the gateways' and workers'
-- --artifact-store list; the database keeps out what no list could allow.
ALTER TABLE adapters DROP CONSTRAINT adapters_artifact_uri_relative;
ALTER TABLE adapters ADD CONSTRAINT adapters_artifact_uri_relative CHECK (
    artifact_uri <> ''
    AND artifact_uri !~ '(^|/)\.\.(/|$)'
    AND (
        (
            artifact_uri !~ '^/'
            AND (artifact_uri !~ '^[A-Za-z][A-Za-z0-9+.-]*:' OR artifact_uri ~ '^file:[^/]')
        )
        OR artifact_uri ~ '^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/[^/]'
    )
);
