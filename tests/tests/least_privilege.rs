//! Least privilege between the gateway's two faces: the admin plane runs
//! as its own process (`serve --admin-only`) holding the `lorafleet_admin`
//! login, with no public listener, while a public gateway with only the
//! `lorafleet_runtime` login serves tenants. Real gateways, a real worker,
//! real Postgres.

#[path = "support/admin_plane.rs"]
mod admin_plane;

use admin_plane::*;
use lorafleet_tests::{Server, gateway_command, login_member_of};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_plane_serves_alone_and_the_public_gateway_needs_no_admin_login() {
    let p = plane("least_privilege").await;
    let admin_url = p
        ._db
        .url_as(&login_member_of(&p.pool, "lorafleet_admin").await);
    let runtime_url = p
        ._db
        .url_as(&login_member_of(&p.pool, "lorafleet_runtime").await);
    let worker = p.worker.addr("grpc").to_owned();
    let spool = tempfile::tempdir().unwrap();
    let mut cmd = gateway_command();
    // `gateway_command` passes `--listen 127.0.0.1:0`: it is not bound.
    cmd.arg("--admin-only")
        .args(["--admin-listen", "127.0.0.1:0"])
        .args(["--database-url", &runtime_url])
        .args(["--admin-database-url", &admin_url])
        .args(["--workers", &worker])
        .arg("--admin-jwt-hmac-secret-file")
        .arg(&p.secret)
        .args(["--admin-jwt-algorithms", "HS256"])
        .args(["--admin-jwt-issuer", ISSUER])
        .args(["--admin-jwt-audience", AUDIENCE])
        .arg("--artifact-root")
        .arg(p.root.path())
        .arg("--audit-spool")
        .arg(spool.path());
    let admin_only = Server::start(cmd, "lorafleet-gateway listening ");
    assert!(
        !admin_only.addrs.contains_key("http"),
        "{:?}",
        admin_only.addrs
    );
    // Its admin API serves: a tenant made there is seen by everyone.
    let admin = format!("http://{}", admin_only.addr("admin"));
    let made = p
        .http
        .post(format!("{admin}/admin/v1/tenants"))
        .bearer_auth(&p.admin_token)
        .json(&serde_json::json!({"name": "solo"}))
        .send()
        .await
        .unwrap();
    assert_eq!(made.status(), 201, "{}", made.text().await.unwrap());

    // A public gateway with the runtime login alone and no admin plane.
    let spool = tempfile::tempdir().unwrap();
    let mut cmd = gateway_command();
    cmd.args(["--database-url", &runtime_url])
        .args(["--workers", &worker])
        .arg("--audit-spool")
        .arg(spool.path());
    let public = Server::start(cmd, "lorafleet-gateway listening ");
    assert!(!public.addrs.contains_key("admin"), "{:?}", public.addrs);
    let base = format!("http://{}", public.addr("http"));
    let health = p.http.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    // No admin routes on the public port.
    let admin_there = p
        .http
        .get(format!("{base}/admin/v1/tenants"))
        .bearer_auth(&p.admin_token)
        .send()
        .await
        .unwrap();
    assert_eq!(admin_there.status(), 404);
}
