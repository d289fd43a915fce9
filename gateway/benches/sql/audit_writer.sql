-- The audit writer's shape for pgbench: one 100-row insert a transaction,
-- rows over 10 tenants and 1,000 adapters in the current hour. See
-- BENCHMARKS.md, "The audit writer with the rollups on and off".
INSERT INTO audit_log (request_id, received_at, completed_at, tenant_id, model_name, lora_int_id, adapter_name, adapter_version, base_hash, worker_id, adapter_residency, status, http_status, finish_reason, prompt_tokens, completion_tokens, latency_us, ttft_us, device_us, load_us)
SELECT gen_random_uuid(), now(), now(), md5('t' || (r % 10))::uuid, 'model', 1 + r % 1000, 'adapter-' || (r % 1000), 1, repeat('ab', 32), 'w1', 'device', 'ok', 200, 'stop', 20, 50, 300000, 40000, 5000, 0
  FROM (SELECT (random() * 1e9)::int AS r FROM generate_series(1, 100)) g
ON CONFLICT (request_id, received_at) DO NOTHING;
