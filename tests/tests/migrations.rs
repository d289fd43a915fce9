//! `lorafleet-gateway migrate` against a real, empty Postgres database.

use lorafleet_tests::{TestDb, run};

const TABLES: &[&str] = &[
    "adapters",
    "admin_changes",
    "admin_token_revocations",
    "api_keys",
    "audit_dead_letter",
    "audit_log",
    "audit_retention_floor",
    "base_models",
    "controller_leases",
    "eval_sets",
    "prices",
    "rollout_decisions",
    "rollout_eval_results",
    "rollouts",
    "route_revisions",
    "route_weights",
    "routes",
    "tenant_token_revocations",
    "tenants",
    "usage_daily",
    "usage_hourly",
];

#[tokio::test]
async fn migrations_apply_to_an_empty_database_and_rerun_as_a_no_op() {
    let db = TestDb::create("migrate_empty").await;
    let pool = db.pool().await;
    let before: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(before, 0, "the database starts empty");

    let url = db.url();
    for pass in 0..2 {
        let out = run(
            "lorafleet-gateway",
            &["migrate", "--database-url", &url],
            &[],
        );
        assert!(
            out.status.success(),
            "pass {pass}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::TEXT FROM information_schema.tables
         WHERE table_schema = 'public' AND table_name NOT LIKE '\\_sqlx%'
           AND NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.relname = table_name AND c.relispartition)
         ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(tables, TABLES);

    let applied: Vec<(i64, bool)> =
        sqlx::query_as("SELECT version, success FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        applied,
        vec![
            (1, true),
            (2, true),
            (3, true),
            (4, true),
            (5, true),
            (6, true),
            (7, true),
            (8, true),
            (9, true),
            (10, true),
            (11, true),
            (12, true),
            (13, true),
            (14, true),
            (15, true),
            (16, true),
            (17, true),
            (18, true),
            (19, true),
            (20, true),
            (21, true),
            (22, true),
            (23, true),
            (24, true),
            (25, true),
            (26, true),
            (27, true),
            (28, true),
            (29, true),
            (30, true),
            (31, true)
        ],
        "each migration applied exactly once"
    );
}

#[tokio::test]
async fn migrate_takes_the_url_from_the_environment() {
    let db = TestDb::create("migrate_env").await;
    let out = run(
        "lorafleet-gateway",
        &["migrate"],
        &[("DATABASE_URL", &db.url())],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
        .fetch_one(&db.pool().await)
        .await
        .unwrap();
    assert_eq!(n, 31);
}

#[test]
fn migrate_refuses_bad_settings_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["migrate", "--database-url", "mysql://u:hunter2@127.0.0.1/x"],
            "--database-url: must start with postgres://",
        ),
        (
            &["migrate", "--database-url", ""],
            "--database-url: is empty",
        ),
        (
            &[
                "migrate",
                "--database-url",
                "postgres://127.0.0.1/x",
                "--connect-timeout-secs",
                "0",
            ],
            "--connect-timeout-secs: must be at least 1",
        ),
        (&["migrate"], "--database-url"),
    ];
    for (args, expected) in cases {
        let out = run("lorafleet-gateway", args, &[]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(
            stderr.contains(expected),
            "{args:?}: expected {expected:?} in {stderr}"
        );
        assert!(!stderr.contains("hunter2"), "the password leaked: {stderr}");
    }
}

#[test]
fn migrate_reports_an_unreachable_database() {
    // Port 1 on loopback has no listener: the connection is refused at once.
    let out = run(
        "lorafleet-gateway",
        &[
            "migrate",
            "--database-url",
            "postgres://u:hunter2@127.0.0.1:1/x",
            "--connect-timeout-secs",
            "2",
        ],
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("cannot connect to the registry database at 127.0.0.1:1/x"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");
}
