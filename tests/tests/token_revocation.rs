//! A stolen admin token cannot make itself unrevocable: its holder's own
//! revocation with an expiry already past is refused by field, and one
//! asked to last a moment is kept for the maximum token lifetime (the
//! server's expiry), which every replica honours within two seconds. And every admin token
//! can be revoked and ends within the maximum lifetime: one without a
//! `jti`, or living longer than `--admin-jwt-max-ttl-secs`, is refused.
//! Tenant JWTs are revoked by `jti` through the admin API, `lorafleetctl`
//! and the console. A replica's snapshot rebuilds may overlap, and the one
//! that began before a change never undoes it.
//! Real gateways, real Postgres, the real `lorafleetctl`.

#[path = "support/admin_plane.rs"]
mod admin_plane;

use std::time::{Duration, Instant};

use admin_plane::*;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_cannot_be_blocked_by_the_token_it_revokes() {
    let p = plane("token_revocation_race").await;
    let status = |replica: usize, token: String| {
        let req = p
            .http
            .get(format!("{}/admin/v1/tenants", p.admin_url(replica)))
            .bearer_auth(token)
            .send();
        async move { req.await.unwrap().status().as_u16() }
    };
    // The thief holds an admin's token.
    let stolen = p.token("mallory", "admin");
    let (jti, _) = jti_and_exp(&stolen);
    assert_eq!(status(0, stolen.clone()).await, 200);
    let revoke = |expires_at: String| {
        p.http
            .post(format!("{}/admin/v1/tokens/revoke", p.admin_url(0)))
            .bearer_auth(&stolen)
            .json(&json!({"jti": jti, "expires_at": expires_at}))
            .send()
    };
    // An expiry already past would record a revocation that denies
    // nothing: refused by the field.
    let past = (chrono::Utc::now() - chrono::Duration::seconds(60)).to_rfc3339();
    let r = revoke(past).await.unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["param"], "expires_at", "{body}");
    // One asked to last a second is kept as long as any admin token may
    // live (a day): the server's expiry, not the request's, so the token
    // stays refused after the second has passed.
    let soon = (chrono::Utc::now() + chrono::Duration::seconds(1)).to_rfc3339();
    let r = revoke(soon).await.unwrap();
    assert_eq!(r.status(), 200);
    let row: Value = r.json().await.unwrap();
    let kept = chrono::DateTime::parse_from_rfc3339(row["expires_at"].as_str().unwrap()).unwrap();
    assert!(
        kept > chrono::Utc::now() + chrono::Duration::hours(23),
        "kept until {kept}, not for the maximum lifetime"
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let start = Instant::now();
    for replica in 0..2 {
        while status(replica, stolen.clone()).await != 401 {
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "replica {replica} still accepts the revoked token"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // The real revocation, until the token's own expiry, finds it covered
    // and changes nothing, saying so; the token stays refused.
    p.ctl(&["token", "revoke", &stolen])
        .refused(5, "already revoked");
    assert_eq!(status(1, stolen.clone()).await, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_token_must_be_revocable_and_end_within_the_maximum_lifetime() {
    let p = plane("token_lifetime").await;
    let status = |token: String| {
        let req = p
            .http
            .get(format!("{}/admin/v1/tenants", p.admin_url(0)))
            .bearer_auth(token)
            .send();
        async move {
            let r = req.await.unwrap();
            let code = r.status().as_u16();
            (code, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    // The default maximum is a day: a day's token works, a second more
    // is refused, saying why.
    assert_eq!(status(p.token_for("dana", "viewer", 86_400)).await.0, 200);
    let (code, body) = status(p.token_for("dana", "viewer", 86_401)).await;
    assert_eq!(code, 401, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("--admin-jwt-max-ttl-secs"), "{message}");
    // A token without a jti, otherwise valid, could never be revoked.
    let secret = std::fs::read(&p.secret).unwrap();
    let now = chrono::Utc::now().timestamp();
    let claims = json!({
        "sub": "eve", "role": "admin", "iss": ISSUER, "aud": AUDIENCE,
        "iat": now, "nbf": now, "exp": now + 600,
    });
    let no_jti = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(secret.trim_ascii()),
    )
    .unwrap();
    let (code, body) = status(no_jti).await;
    assert_eq!(code, 401, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no jti"),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_jwt_is_revoked_by_its_jti_on_every_replica_within_two_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("tenant-jwt.secret");
    let secret = "a-tenant-jwt-secret-of-at-least-thirty-two-bytes";
    std::fs::write(&secret_file, secret).unwrap();
    let extra = Extra {
        gateway_args: vec![
            "--jwt-hmac-secret-file".into(),
            secret_file.to_str().unwrap().into(),
            "--jwt-algorithms".into(),
            "HS256".into(),
            "--jwt-issuer".into(),
            "idp".into(),
            "--jwt-audience".into(),
            "lorafleet".into(),
        ],
        ..Default::default()
    };
    let p = plane_with("tenant_token_revocation", 2, 1, "llama-gqa", &extra).await;
    p.ctl_json(&["tenants", "create", "acme"]);
    let exp = chrono::Utc::now().timestamp() + 3600;
    let mint = |jti: &str| {
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &json!({"tenant": "acme", "sub": "app", "scope": "models:read",
                    "iss": "idp", "aud": "lorafleet", "exp": exp, "jti": jti}),
            &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()),
        )
        .unwrap()
    };
    let (revoked, other) = (mint("tok-1"), mint("tok-2"));
    let models = |replica: usize, token: &str| {
        let req = p
            .http
            .get(format!("{}/v1/models", p.api_url(replica)))
            .bearer_auth(token)
            .send();
        async move {
            let r = req.await.unwrap();
            let code = r.status().as_u16();
            (code, r.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    for replica in 0..2 {
        let start = Instant::now();
        while models(replica, &revoked).await.0 != 200 {
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "the tenant never loaded"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // An admin revokes it by its jti until its exp (a viewer may not).
    let revoke = |token: &str| {
        p.http
            .post(format!("{}/admin/v1/tenant-tokens/revoke", p.admin_url(0)))
            .bearer_auth(token)
            .json(&json!({"jti": "tok-1",
                          "expires_at": chrono::DateTime::from_timestamp(exp, 0).unwrap().to_rfc3339()}))
            .send()
    };
    assert_eq!(
        revoke(&p.token("vic", "viewer")).await.unwrap().status(),
        403
    );
    // A malformed revocation is refused by the field at fault.
    let past = (chrono::Utc::now() - chrono::Duration::seconds(5)).to_rfc3339();
    for (body, field) in [
        (json!({"jti": "", "expires_at": past}), "jti"),
        (json!({"jti": "tok-1", "expires_at": past}), "expires_at"),
        (json!({"jti": "tok-1"}), "expires_at"),
    ] {
        let r = p
            .http
            .post(format!("{}/admin/v1/tenant-tokens/revoke", p.admin_url(0)))
            .bearer_auth(&p.admin_token)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{body}");
        let e: Value = r.json().await.unwrap();
        assert!(
            e["error"]["message"].as_str().unwrap().contains(field),
            "{body}: {e}"
        );
    }
    let r = revoke(&p.admin_token).await.unwrap();
    assert_eq!(r.status(), 200);
    let start = Instant::now();
    for replica in 0..2 {
        loop {
            let (code, body) = models(replica, &revoked).await;
            if code == 401 {
                assert!(
                    body["error"]["message"]
                        .as_str()
                        .unwrap()
                        .contains("revoked"),
                    "{body}"
                );
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "replica {replica} still accepts the revoked tenant token"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // The same tenant's other tokens are untouched; the change log has it.
    assert_eq!(models(0, &other).await.0, 200);
    assert_eq!(
        revoke(&p.admin_token).await.unwrap().status(),
        409,
        "extends nothing"
    );
    let changes = p.ctl_json(&["changes", "--object-type", "tenant_token"]);
    assert_eq!(changes["changes"].as_array().unwrap().len(), 1, "{changes}");
    // lorafleetctl revokes one from the token itself.
    let revoked = p.ctl_json(&["token", "revoke-tenant", &other]);
    assert_eq!(revoked["jti"], "tok-2", "{revoked}");
    let start = Instant::now();
    while models(1, &other).await.0 != 401 {
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "tok-2 still accepted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // And from the console: the token pasted whole; what is not a token is
    // refused by its field, and never shown back.
    let third = mint("tok-3");
    assert_eq!(models(0, &third).await.0, 200);
    let b = lorafleet_tests::browser::Browser::start().await;
    let console = p.admin_url(0);
    b.goto(&format!("{console}/console/login")).await;
    b.fill("#login textarea[name=token]", &p.admin_token).await;
    b.click("#login button[type=submit]").await;
    b.find("#me").await;
    b.goto(&format!("{console}/console/tenants")).await;
    b.fill("#revoke-token-form textarea[name=token]", "not-a-token")
        .await;
    b.click("#revoke-token-form button[type=submit]").await;
    let refusal = b.text(".refusal").await;
    assert!(refusal.contains("token: is not a JWT"), "{refusal}");
    b.fill("#revoke-token-form textarea[name=token]", &third)
        .await;
    b.click("#revoke-token-form button[type=submit]").await;
    let notice = b.text("#notice").await;
    assert!(notice.contains("tenant token tok-3 revoked"), "{notice}");
    assert!(
        !b.text("main").await.contains(&third),
        "the token shown back"
    );
    let start = Instant::now();
    for replica in 0..2 {
        while models(replica, &third).await.0 != 401 {
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "replica {replica} still accepts tok-3"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Waits until `n` sessions wait for a lock on `table`.
async fn until_waiting_on(pool: &sqlx::PgPool, table: &str, n: i64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
             WHERE c.relname = $1 AND NOT l.granted",
        )
        .bind(table)
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{waiting} of {n} wait on {table}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// An admin command reloads its own replica's snapshot while the rebuild an
/// earlier announcement began may still be reading: the one begun before
/// the change, finishing with it or after it, never puts back the registry
/// without the change. (Before rebuilds were ordered, a route just set was
/// now and then "not found" on the replica that set it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_begun_before_a_change_never_undoes_it() {
    use lorafleet_gateway::registry::{Registry, Snapshot};
    let db = lorafleet_tests::migrated_db("overlapping_rebuilds").await;
    let pool = db.pool().await;
    let registry = Registry::new(Snapshot::load(&pool).await.unwrap());
    let reload = |registry: &Registry| {
        let (registry, pool) = (registry.clone(), pool.clone());
        tokio::spawn(async move { registry.reload(&pool).await })
    };
    // The two finish in either order once the lock is gone; eight rounds
    // leave the unordered rebuild about one chance in 256 to pass.
    for round in 0..8 {
        // A rebuild reads the tenants first and the tenant token
        // revocations last: holding the latter, one begun now has read the
        // tenants as they were and waits.
        let mut blocker = pool.begin().await.unwrap();
        sqlx::query("LOCK TABLE tenant_token_revocations IN ACCESS EXCLUSIVE MODE")
            .execute(&mut *blocker)
            .await
            .unwrap();
        let early = reload(&registry);
        until_waiting_on(&pool, "tenant_token_revocations", 1).await;
        let name = format!("late-{round}");
        sqlx::query("INSERT INTO tenants (name) VALUES ($1)")
            .bind(&name)
            .execute(&pool)
            .await
            .unwrap();
        let late = reload(&registry);
        until_waiting_on(&pool, "tenant_token_revocations", 2).await;
        blocker.rollback().await.unwrap();
        late.await.unwrap().unwrap();
        early.await.unwrap().unwrap();
        assert!(
            registry.snapshot().tenant_by_name(&name).is_some(),
            "round {round}: the rebuild begun before tenant {name} was added put back the registry without it"
        );
    }
}
