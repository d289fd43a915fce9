//! The registry schema enforces its rules in the database itself. Each test
//! has its own database, migrated by the real `lorafleet-gateway migrate`.

use lorafleet_tests::migrated_db;
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

/// The constraint a database error names, or a description of a non-database error.
fn constraint_of(err: &sqlx::Error) -> String {
    match err.as_database_error() {
        Some(db) => db
            .constraint()
            .map(str::to_owned)
            .unwrap_or_else(|| format!("<no constraint: {db}>")),
        None => format!("<not a database error: {err}>"),
    }
}

#[track_caller]
fn assert_violates<T: std::fmt::Debug>(result: Result<T, sqlx::Error>, constraint: &str) {
    match result {
        Ok(v) => panic!("expected a violation of {constraint}, but it succeeded with {v:?}"),
        Err(e) => assert_eq!(constraint_of(&e), constraint, "error was: {e}"),
    }
}

fn hash(byte: u8) -> String {
    format!("{byte:02x}").repeat(32)
}

async fn tenant(pool: &PgPool, name: &str) -> Uuid {
    sqlx::query_scalar("INSERT INTO tenants (name) VALUES ($1) RETURNING id")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn base_model(pool: &PgPool, name: &str, hash_byte: u8) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO base_models (name, base_hash, architecture) VALUES ($1, $2, 'llama') RETURNING id",
    )
    .bind(name)
    .bind(hash(hash_byte))
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Inserts an adapter version with sensible defaults; `rank` and the base are the knobs tests turn.
async fn try_adapter(
    pool: &PgPool,
    name: &str,
    version: i32,
    base_model_id: i64,
    tenant_id: Option<Uuid>,
    rank: i32,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "INSERT INTO adapters (name, version, base_model_id, tenant_id, rank, alpha, target_modules,
                               artifact_uri, artifact_sha256)
         VALUES ($1, $2, $3, $4, $5, 32, ARRAY['q_proj', 'v_proj'], $6, $7)
         RETURNING lora_int_id",
    )
    .bind(name)
    .bind(version)
    .bind(base_model_id)
    .bind(tenant_id)
    .bind(rank)
    .bind(format!("{name}/v{version}"))
    .bind(hash(version as u8))
    .fetch_one(pool)
    .await
}

async fn adapter(pool: &PgPool, name: &str, version: i32, base_model_id: i64) -> i64 {
    try_adapter(pool, name, version, base_model_id, None, 16)
        .await
        .unwrap()
}

/// Writes one revision of a route inside `tx` (creating the route for
/// revision 1). Returns the first statement error, if any.
async fn write_revision(
    tx: &mut PgConnection,
    route_id: Uuid,
    tenant_id: Uuid,
    revision: i32,
    base_model_id: i64,
    weights: &[(i64, i32)],
) -> Result<(), sqlx::Error> {
    if revision == 1 {
        sqlx::query("INSERT INTO routes (id, tenant_id, model_name, current_revision) VALUES ($1, $2, $3, 1)")
            .bind(route_id)
            .bind(tenant_id)
            .bind(format!("model-{}", &route_id.simple().to_string()[..8]))
            .execute(&mut *tx)
            .await?;
    } else {
        sqlx::query("UPDATE routes SET current_revision = $2, updated_at = now() WHERE id = $1")
            .bind(route_id)
            .bind(revision)
            .execute(&mut *tx)
            .await?;
    }
    let target = if weights.is_empty() {
        "base"
    } else {
        "adapters"
    };
    sqlx::query(
        "INSERT INTO route_revisions (route_id, revision, base_model_id, target)
         VALUES ($1, $2, $3, $4::route_target)",
    )
    .bind(route_id)
    .bind(revision)
    .bind(base_model_id)
    .bind(target)
    .execute(&mut *tx)
    .await?;
    for (lora_int_id, weight_bp) in weights {
        sqlx::query(
            "INSERT INTO route_weights (route_id, revision, base_model_id, lora_int_id, weight_bp)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(route_id)
        .bind(revision)
        .bind(base_model_id)
        .bind(lora_int_id)
        .bind(weight_bp)
        .execute(&mut *tx)
        .await?;
    }
    Ok(())
}

/// Writes a revision in its own transaction and commits it.
async fn commit_revision(
    conn: &mut PgConnection,
    route_id: Uuid,
    tenant_id: Uuid,
    revision: i32,
    base_model_id: i64,
    weights: &[(i64, i32)],
) -> Result<(), sqlx::Error> {
    let mut tx = conn.begin().await?;
    write_revision(
        &mut tx,
        route_id,
        tenant_id,
        revision,
        base_model_id,
        weights,
    )
    .await?;
    tx.commit().await
}

#[tokio::test]
async fn route_weights_must_sum_to_10000_checked_at_commit() {
    let db = migrated_db("weights_sum").await;
    let pool = db.pool().await;
    let t = tenant(&pool, "acme").await;
    let base = base_model(&pool, "llama-tiny", 1).await;
    let v1 = adapter(&pool, "support", 1, base).await;
    let v2 = adapter(&pool, "support", 2, base).await;
    let mut conn = db.connection().await;

    // 5000 + 4000: every statement succeeds; only COMMIT refuses.
    let route = Uuid::new_v4();
    let mut tx = conn.begin().await.unwrap();
    write_revision(&mut tx, route, t, 1, base, &[(v1, 5000), (v2, 4000)])
        .await
        .expect("statements are accepted while the transaction is open");
    assert_violates(tx.commit().await, "route_revisions_weights_sum_10000");
    let routes: i64 = sqlx::query_scalar("SELECT count(*) FROM routes")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(routes, 0, "nothing of the refused route remains");

    // Over 10000 is refused too.
    assert_violates(
        commit_revision(
            &mut conn,
            Uuid::new_v4(),
            t,
            1,
            base,
            &[(v1, 10000), (v2, 1)],
        )
        .await,
        "route_revisions_weights_sum_10000",
    );

    // A 90/10 canary commits, and so does a later 100% revision.
    commit_revision(&mut conn, route, t, 1, base, &[(v1, 9000), (v2, 1000)])
        .await
        .unwrap();
    commit_revision(&mut conn, route, t, 2, base, &[(v2, 10000)])
        .await
        .unwrap();
    let current: i32 = sqlx::query_scalar("SELECT current_revision FROM routes WHERE id = $1")
        .bind(route)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(current, 2);

    // A revision that names adapters but carries no weights sums to 0.
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("UPDATE routes SET current_revision = 3 WHERE id = $1")
        .bind(route)
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO route_revisions (route_id, revision, base_model_id, target) VALUES ($1, 3, $2, 'adapters')",
    )
    .bind(route)
    .bind(base)
    .execute(&mut *tx)
    .await
    .unwrap();
    assert_violates(tx.commit().await, "route_revisions_weights_sum_10000");

    // Weights themselves are in (0, 10000].
    assert_violates(
        commit_revision(
            &mut conn,
            Uuid::new_v4(),
            t,
            1,
            base,
            &[(v1, 10000), (v2, 0)],
        )
        .await,
        "route_weights_weight_bp_range",
    );
}

#[tokio::test]
async fn a_base_route_has_no_weights_and_history_is_immutable() {
    let db = migrated_db("base_route").await;
    let pool = db.pool().await;
    let t = tenant(&pool, "acme").await;
    let base = base_model(&pool, "llama-tiny", 1).await;
    let v1 = adapter(&pool, "support", 1, base).await;
    let mut conn = db.connection().await;

    let route = Uuid::new_v4();
    commit_revision(&mut conn, route, t, 1, base, &[])
        .await
        .expect("a base-model route");

    let mut tx = conn.begin().await.unwrap();
    sqlx::query("UPDATE routes SET current_revision = 2 WHERE id = $1")
        .bind(route)
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("INSERT INTO route_revisions (route_id, revision, base_model_id, target) VALUES ($1, 2, $2, 'base')")
        .bind(route)
        .bind(base)
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO route_weights (route_id, revision, base_model_id, lora_int_id, weight_bp) VALUES ($1, 2, $2, $3, 10000)",
    )
    .bind(route)
    .bind(base)
    .bind(v1)
    .execute(&mut *tx)
    .await
    .unwrap();
    assert_violates(tx.commit().await, "route_revisions_base_has_no_weights");

    assert_violates(
        sqlx::query("UPDATE route_revisions SET target = 'adapters' WHERE route_id = $1")
            .bind(route)
            .execute(&pool)
            .await,
        "route_revisions_immutable",
    );
    assert_violates(
        sqlx::query("DELETE FROM route_revisions WHERE route_id = $1")
            .bind(route)
            .execute(&pool)
            .await,
        "route_revisions_immutable",
    );

    // The current revision must be one of the route's own.
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("UPDATE routes SET current_revision = 7 WHERE id = $1")
        .bind(route)
        .execute(&mut *tx)
        .await
        .unwrap();
    assert_violates(tx.commit().await, "routes_current_revision_fk");
}

#[tokio::test]
async fn a_route_cannot_mix_base_models() {
    let db = migrated_db("mixed_base").await;
    let pool = db.pool().await;
    let t = tenant(&pool, "acme").await;
    let base_a = base_model(&pool, "llama-a", 1).await;
    let base_b = base_model(&pool, "llama-b", 2).await;
    let on_a = adapter(&pool, "support", 1, base_a).await;
    let on_b = adapter(&pool, "support", 2, base_b).await;
    let mut conn = db.connection().await;

    // Two versions over two base models, weights otherwise valid.
    assert_violates(
        commit_revision(
            &mut conn,
            Uuid::new_v4(),
            t,
            1,
            base_a,
            &[(on_a, 5000), (on_b, 5000)],
        )
        .await,
        "route_weights_adapter_same_base_fk",
    );
    // One version whose base is not the revision's base.
    assert_violates(
        commit_revision(&mut conn, Uuid::new_v4(), t, 1, base_a, &[(on_b, 10000)]).await,
        "route_weights_adapter_same_base_fk",
    );
    // A weight row cannot claim a base other than its revision's.
    let route = Uuid::new_v4();
    let mut tx = conn.begin().await.unwrap();
    write_revision(&mut tx, route, t, 1, base_a, &[])
        .await
        .unwrap();
    assert_violates(
        sqlx::query(
            "INSERT INTO route_weights (route_id, revision, base_model_id, lora_int_id, weight_bp) VALUES ($1, 1, $2, $3, 10000)",
        )
        .bind(route)
        .bind(base_b)
        .bind(on_b)
        .execute(&mut *tx)
        .await,
        "route_weights_revision_fk",
    );
    drop(tx);

    // The same base on both versions is fine.
    let on_a2 = adapter(&pool, "support", 3, base_a).await;
    commit_revision(
        &mut conn,
        Uuid::new_v4(),
        t,
        1,
        base_a,
        &[(on_a, 5000), (on_a2, 5000)],
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn lora_int_ids_come_from_a_sequence_and_are_never_reused() {
    let db = migrated_db("lora_int_id").await;
    let pool = db.pool().await;
    let base = base_model(&pool, "llama-tiny", 1).await;
    let first = adapter(&pool, "support", 1, base).await;
    let second = adapter(&pool, "support", 2, base).await;
    assert!(
        first > 0 && second > first,
        "ids ascend from the sequence: {first}, {second}"
    );

    // The id cannot be chosen by the caller...
    let err = sqlx::query(
        "INSERT INTO adapters (lora_int_id, name, version, base_model_id, rank, alpha, target_modules,
                               artifact_uri, artifact_sha256)
         VALUES ($1, 'other', 1, $2, 8, 16, ARRAY['q_proj'], 'other/v1', $3)",
    )
    .bind(first)
    .bind(base)
    .bind(hash(9))
    .execute(&pool)
    .await
    .unwrap_err();
    assert_eq!(
        err.as_database_error().and_then(|e| e.code()).as_deref(),
        Some("428C9"),
        "{err}"
    );

    // ...and even forcing it cannot reuse one.
    assert_violates(
        sqlx::query(
            "INSERT INTO adapters (lora_int_id, name, version, base_model_id, rank, alpha, target_modules,
                                   artifact_uri, artifact_sha256)
             OVERRIDING SYSTEM VALUE
             VALUES ($1, 'other', 1, $2, 8, 16, ARRAY['q_proj'], 'other/v1', $3)",
        )
        .bind(first)
        .bind(base)
        .bind(hash(9))
        .execute(&pool)
        .await,
        "adapters_pkey",
    );

    // A version cannot be deleted to free its id, nor have its weights swapped.
    assert_violates(
        sqlx::query("DELETE FROM adapters WHERE lora_int_id = $1")
            .bind(first)
            .execute(&pool)
            .await,
        "adapters_immutable",
    );
    assert_violates(
        sqlx::query("UPDATE adapters SET artifact_sha256 = $2 WHERE lora_int_id = $1")
            .bind(first)
            .bind(hash(0xee))
            .execute(&pool)
            .await,
        "adapters_immutable",
    );
    // Nor the size its artifact had at registration.
    assert_violates(
        sqlx::query(
            "UPDATE adapters SET artifact_bytes = 1 << 40, artifact_files = 9 WHERE lora_int_id = $1",
        )
        .bind(first)
        .execute(&pool)
        .await,
        "adapters_immutable",
    );
    // Nor what it does beyond plain LoRA; and a feature must be one the
    // workers know.
    assert_violates(
        sqlx::query("UPDATE adapters SET features = '{dora}' WHERE lora_int_id = $1")
            .bind(first)
            .execute(&pool)
            .await,
        "adapters_immutable",
    );
    assert_violates(
        sqlx::query(
            "INSERT INTO adapters (name, version, base_model_id, rank, alpha, use_rslora,
                                   target_modules, artifact_uri, artifact_sha256, features)
             SELECT name, 98, base_model_id, rank, alpha, use_rslora, target_modules,
                    artifact_uri, artifact_sha256, '{vera}'
             FROM adapters WHERE lora_int_id = $1",
        )
        .bind(first)
        .execute(&pool)
        .await,
        "adapters_features_known",
    );
    // A size is recorded whole, or not at all.
    assert_violates(
        sqlx::query(
            "INSERT INTO adapters (name, version, base_model_id, rank, alpha, use_rslora,
                                   target_modules, artifact_uri, artifact_sha256, artifact_bytes)
             SELECT name, 99, base_model_id, rank, alpha, use_rslora, target_modules,
                    artifact_uri, artifact_sha256, 10
             FROM adapters WHERE lora_int_id = $1",
        )
        .bind(first)
        .execute(&pool)
        .await,
        "adapters_artifact_size_recorded",
    );
    // A new version gets a fresh id.
    let third = adapter(&pool, "support", 3, base).await;
    assert!(third > second);
    // The same (name, version) cannot be registered twice.
    assert_violates(
        try_adapter(&pool, "support", 3, base, None, 16).await,
        "adapters_name_version_unique",
    );
}

#[tokio::test]
async fn an_adapter_needs_an_existing_base_model_and_a_positive_rank() {
    let db = migrated_db("adapter_checks").await;
    let pool = db.pool().await;
    let base = base_model(&pool, "llama-tiny", 1).await;

    assert_violates(
        try_adapter(&pool, "orphan", 1, base + 1000, None, 16).await,
        "adapters_base_model_fk",
    );
    assert_violates(
        try_adapter(&pool, "zero", 1, base, None, 0).await,
        "adapters_rank_positive",
    );
    assert_violates(
        try_adapter(&pool, "negative", 1, base, None, -4).await,
        "adapters_rank_positive",
    );
    try_adapter(&pool, "ok", 1, base, None, 1)
        .await
        .expect("rank 1 is valid");

    // Other per-column rules.
    let insert = |alpha: f64, modules: Vec<&'static str>, uri: &'static str, sha: String| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO adapters (name, version, base_model_id, rank, alpha, target_modules, artifact_uri, artifact_sha256)
                 VALUES ('x', 1, $1, 8, $2, $3, $4, $5)",
            )
            .bind(base)
            .bind(alpha)
            .bind(modules)
            .bind(uri)
            .bind(sha)
            .execute(&pool)
            .await
        }
    };
    let good_sha = hash(3);
    assert_violates(
        insert(f64::NAN, vec!["q_proj"], "x/v1", good_sha.clone()).await,
        "adapters_alpha_finite_positive",
    );
    assert_violates(
        insert(0.0, vec!["q_proj"], "x/v1", good_sha.clone()).await,
        "adapters_alpha_finite_positive",
    );
    assert_violates(
        insert(16.0, vec!["wte"], "x/v1", good_sha.clone()).await,
        "adapters_target_modules_known",
    );
    assert_violates(
        insert(16.0, vec![], "x/v1", good_sha.clone()).await,
        "adapters_target_modules_known",
    );
    for uri in [
        "/etc/passwd",
        "a/../../b",
        "..",
        "http://bucket/x",
        "s3://Bad_Bucket/x",
        "s3://bucket/../x",
        "s3://bucket",
        "s3:///x",
        "file:///abs",
    ] {
        assert_violates(
            insert(16.0, vec!["q_proj"], uri, good_sha.clone()).await,
            "adapters_artifact_uri_relative",
        );
    }
    assert_violates(
        insert(16.0, vec!["q_proj"], "x/v1", "ABC".into()).await,
        "adapters_artifact_sha256_format",
    );
    insert(
        16.0,
        vec!["q_proj", "down_proj"],
        "file:x/v1",
        good_sha.clone(),
    )
    .await
    .expect("a file: URI relative to a root");
    // An object store's artifact (which stores are allowed is the
    // processes' --artifact-store list).
    sqlx::query(
        "INSERT INTO adapters (name, version, base_model_id, rank, alpha, target_modules, artifact_uri, artifact_sha256)
         VALUES ('y', 1, $1, 8, 16, ARRAY['q_proj'], 's3://adapters/prod/acme/v1', $2)",
    )
    .bind(base)
    .bind(good_sha)
    .execute(&pool)
    .await
        .expect("an s3:// URI");
}

#[tokio::test]
async fn retired_and_foreign_adapters_cannot_receive_traffic() {
    let db = migrated_db("retired_foreign").await;
    let pool = db.pool().await;
    let acme = tenant(&pool, "acme").await;
    let globex = tenant(&pool, "globex").await;
    let base = base_model(&pool, "llama-tiny", 1).await;
    let globex_only = try_adapter(&pool, "globex-bot", 1, base, Some(globex), 8)
        .await
        .unwrap();
    let shared = adapter(&pool, "shared", 1, base).await;
    let mut conn = db.connection().await;

    assert_violates(
        commit_revision(
            &mut conn,
            Uuid::new_v4(),
            acme,
            1,
            base,
            &[(globex_only, 10000)],
        )
        .await,
        "route_weights_adapter_tenant",
    );
    commit_revision(
        &mut conn,
        Uuid::new_v4(),
        globex,
        1,
        base,
        &[(globex_only, 10000)],
    )
    .await
    .unwrap();
    commit_revision(&mut conn, Uuid::new_v4(), acme, 1, base, &[(shared, 10000)])
        .await
        .unwrap();

    // Retiring needs a timestamp, and is one-way.
    assert_violates(
        sqlx::query("UPDATE adapters SET state = 'retired' WHERE lora_int_id = $1")
            .bind(shared)
            .execute(&pool)
            .await,
        "adapters_retired_at_matches_state",
    );
    sqlx::query("UPDATE adapters SET state = 'retired', retired_at = now() WHERE lora_int_id = $1")
        .bind(shared)
        .execute(&pool)
        .await
        .unwrap();
    assert_violates(
        sqlx::query(
            "UPDATE adapters SET state = 'active', retired_at = NULL WHERE lora_int_id = $1",
        )
        .bind(shared)
        .execute(&pool)
        .await,
        "adapters_immutable",
    );
    assert_violates(
        commit_revision(&mut conn, Uuid::new_v4(), acme, 1, base, &[(shared, 10000)]).await,
        "route_weights_adapter_active",
    );
}

#[tokio::test]
async fn api_keys_store_only_a_hash_with_known_scopes() {
    let db = migrated_db("api_keys").await;
    let pool = db.pool().await;
    let t = tenant(&pool, "acme").await;
    let insert = |prefix: &'static str, hash_len: usize, scopes: Vec<&'static str>| {
        let pool = pool.clone();
        async move {
            sqlx::query("INSERT INTO api_keys (tenant_id, prefix, secret_hash, scopes) VALUES ($1, $2, $3, $4)")
                .bind(t)
                .bind(prefix)
                .bind(vec![7u8; hash_len])
                .bind(scopes)
                .execute(&pool)
                .await
        }
    };
    insert("lf_abcdEFGH12", 32, vec!["inference", "models:read"])
        .await
        .expect("a valid key");
    assert_violates(
        insert("lf_abcdEFGH12", 32, vec!["inference"]).await,
        "api_keys_prefix_unique",
    );
    assert_violates(
        insert("lf_short", 32, vec!["inference"]).await,
        "api_keys_prefix_format",
    );
    assert_violates(
        insert("lf_abcdEFGH99", 31, vec!["inference"]).await,
        "api_keys_secret_hash_sha256",
    );
    assert_violates(
        insert("lf_abcdEFGH98", 32, vec!["admin"]).await,
        "api_keys_scopes_known",
    );
    assert_violates(
        insert("lf_abcdEFGH97", 32, vec![]).await,
        "api_keys_scopes_known",
    );
    assert_violates(
        sqlx::query(
            "INSERT INTO api_keys (tenant_id, prefix, secret_hash, scopes, expires_at)
             VALUES ($1, 'lf_abcdEFGH96', $2, ARRAY['inference'], now() - interval '1 day')",
        )
        .bind(t)
        .bind(vec![7u8; 32])
        .execute(&pool)
        .await,
        "api_keys_expiry_after_creation",
    );
    assert_violates(
        sqlx::query("INSERT INTO tenants (name) VALUES ('Not A Slug')")
            .execute(&pool)
            .await,
        "tenants_name_format",
    );
}

#[tokio::test]
async fn the_audit_log_is_append_only_and_replays_idempotently() {
    let db = migrated_db("audit_log").await;
    let pool = db.pool().await;
    let request_id = Uuid::now_v7();
    // A replay carries the time the row was first written with.
    let received_at = chrono::Utc::now() - chrono::TimeDelta::seconds(1);
    let insert = |status: &'static str, finish: Option<&'static str>| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO audit_log (request_id, received_at, completed_at, tenant_id, model_name,
                                        lora_int_id, adapter_name, adapter_version, base_hash, worker_id,
                                        adapter_residency, status, http_status, finish_reason,
                                        prompt_tokens, completion_tokens, latency_us, ttft_us)
                 VALUES ($1, $6, $6 + interval '1 second', $2, 'support', 7, 'support', 3, $3,
                         'worker-0', 'device', $4::audit_status, 200, $5, 12, 34, 1000000, 25000)
                 ON CONFLICT (request_id, received_at) DO NOTHING",
            )
            .bind(request_id)
            .bind(Uuid::new_v4())
            .bind(hash(1))
            .bind(status)
            .bind(finish)
            .bind(received_at)
            .execute(&pool)
            .await
            .map(|r| r.rows_affected())
        }
    };
    assert_eq!(insert("ok", Some("stop")).await.unwrap(), 1);
    assert_eq!(
        insert("ok", Some("stop")).await.unwrap(),
        0,
        "a replayed row is skipped, not duplicated"
    );
    assert_violates(
        sqlx::query("UPDATE audit_log SET completion_tokens = 0")
            .execute(&pool)
            .await,
        "audit_log_append_only",
    );
    // Status and finish reason agree.
    let other = Uuid::now_v7();
    assert_violates(
        sqlx::query(
            "INSERT INTO audit_log (request_id, received_at, completed_at, model_name, status, http_status, latency_us)
             VALUES ($1, now(), now(), 'm', 'ok', 200, 5)",
        )
        .bind(other)
        .execute(&pool)
        .await,
        "audit_log_ok_has_finish_reason",
    );
    // A refused request before authentication has no tenant.
    sqlx::query(
        "INSERT INTO audit_log (request_id, received_at, completed_at, model_name, status, http_status,
                                error_code, latency_us)
         VALUES ($1, now(), now(), 'm', 'rejected', 401, 'invalid_api_key', 5)",
    )
    .bind(other)
    .execute(&pool)
    .await
    .unwrap();

    // The per-tenant and per-adapter time-range indexes exist.
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexname::TEXT FROM pg_indexes WHERE tablename = 'audit_log' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    for wanted in [
        "audit_log_tenant_time",
        "audit_log_adapter_time",
        "audit_log_received_at_brin",
    ] {
        assert!(
            indexes.iter().any(|i| i == wanted),
            "missing index {wanted}: {indexes:?}"
        );
    }
}
