//! Tenant limits while Redis is away and after it returns, with two real
//! gateways (`--gateway-replicas 2`) sharing Redis through a proxy the
//! test cuts: a tenant's concurrency cap and its requests per minute fall
//! back, on each replica, to its share of the limit (fail closed: the
//! fleet never admits more than the limit), serving goes on, and once
//! Redis is back the cap is fleet-wide again.

#[path = "support/admin_plane.rs"]
mod admin_plane;

use std::time::Duration;

use admin_plane::*;

/// Tokens each request of a burst generates: long enough (about a second
/// on the fixture model) that a burst's requests all overlap even on a
/// loaded machine, so those that ran ran at once.
const LONG: u32 = 400;

/// Of `answers`, how many ran.
fn ran(answers: &[(u16, serde_json::Value)]) -> usize {
    answers.iter().filter(|(s, _)| *s == 200).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_fall_back_to_a_replica_share_without_redis_and_are_fleet_wide_again_after() {
    let p = plane("limits_without_redis").await;
    let (key, _, _) = acme_support(&p, "llama-gqa/o-r2");
    p.ctl_json(&["tenants", "update", "acme", "--max-concurrent", "4"]);
    p.until_status(1, &key, "support", 200).await;

    // Redis up: one gateway may run the whole fleet-wide cap of four.
    let answers = at_once_to(&p, Some(0), &key, 6, LONG).await;
    assert_eq!(ran(&answers), 4, "{answers:?}");

    // Redis away. Requests per minute: a limit of 4 is 2 on each replica
    // (counted from the cut, in the replica's own window).
    away_from_a_minute_boundary().await;
    p.redis.cut();
    p.ctl_json(&["tenants", "update", "acme", "--rpm-limit", "4"]);
    let mut passed = 0;
    for _ in 0..4 {
        let (status, body) = p.complete(0, &key, "support", "u").await;
        match status {
            200 => passed += 1,
            429 => assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}"),
            other => panic!("{other}: {body}"),
        }
    }
    assert_eq!(passed, 2, "half the minute's requests on one replica");

    p.ctl_json(&["tenants", "update", "acme", "--rpm-limit", "unlimited"]);

    // Concurrency: each replica keeps its share, two; the tenant is still
    // served, and the fleet never runs more than the cap.
    let answers = at_once_to(&p, Some(0), &key, 6, LONG).await;
    let alone = ran(&answers);
    assert!(
        (1..=2).contains(&alone),
        "{alone} ran on one replica: {answers:?}"
    );
    for (s, b) in answers.iter().filter(|(s, _)| *s != 200) {
        assert_eq!(*s, 429, "{b}");
        assert_eq!(b["error"]["code"], "tenant_concurrency_limit", "{b}");
    }
    let answers = at_once(&p, &key, 8, LONG).await;
    let both = ran(&answers);
    assert!(
        (2..=4).contains(&both),
        "{both} ran on two replicas: {answers:?}"
    );

    // Redis back: the cap is fleet-wide again, one gateway may take all
    // four (once the replica's Redis connection is back).
    p.redis.restore();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let answers = at_once_to(&p, Some(0), &key, 6, LONG).await;
        let n = ran(&answers);
        assert!(n <= 4, "{n} ran: {answers:?}");
        if n == 4 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the cap never became fleet-wide again: {answers:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
