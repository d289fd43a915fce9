//! The admin console in a real headless Chromium, against two real
//! gateway replicas, two workers on the fixture model, Postgres and Redis.
//!
//! With `LORAFLEET_CONSOLE_SCREENSHOTS=<dir>` the run also saves a
//! screenshot of each page there (README links the committed ones in
//! `docs/console/`).

#[path = "support/admin_plane.rs"]
mod admin_plane;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use admin_plane::*;
use lorafleet_tests::browser::Browser;
use serde_json::json;

/// Where screenshots go, if this run takes them.
fn screenshots() -> Option<PathBuf> {
    let dir = std::env::var_os("LORAFLEET_CONSOLE_SCREENSHOTS")?;
    let dir = PathBuf::from(dir);
    // Relative to the repository root, not to this crate.
    let dir = if dir.is_absolute() {
        dir
    } else {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(dir)
    };
    std::fs::create_dir_all(&dir).unwrap();
    Some(dir)
}

async fn shoot(b: &Browser, name: &str) {
    if let Some(dir) = screenshots() {
        b.screenshot(&dir.join(format!("{name}.png"))).await;
    }
}

/// Tenant acme with a key, `support` v1 at 100% and v2 registered (see
/// `acme_support`), and a second tenant. Returns (key, v1, v2).
fn setup(p: &Plane) -> (String, i64, i64) {
    let ids = acme_support(p, "llama-gqa/o-r2");
    p.ctl_json(&["tenants", "create", "globex", "--display-name", "Globex"]);
    ids
}

fn route_weights(p: &Plane) -> (String, Vec<(i64, i64)>) {
    let r = p.ctl_json(&["routes", "get", "acme", "support"]);
    let weights = r["weights"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["lora_int_id"].as_i64().unwrap(),
                w["weight_bp"].as_i64().unwrap(),
            )
        })
        .collect();
    (
        r["etag"].as_str().unwrap().trim_matches('"').to_owned(),
        weights,
    )
}

async fn sign_in(b: &Browser, console: &str, token: &str) {
    b.goto(&format!("{console}/console/login")).await;
    b.fill("#login textarea[name=token]", token).await;
    b.click("#login button[type=submit]").await;
    b.find("#me").await;
}

/// The value a field of the limits form shows.
async fn shown(b: &Browser, name: &str) -> String {
    let input = b.find(&format!("#limits-form input[name={name}]")).await;
    b.attribute(&input, "value").await.unwrap_or_default()
}

/// Waits until the text of `css` satisfies `ok`, without reloading.
async fn until_text(b: &Browser, css: &str, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let t = b.text(css).await;
        if ok(&t) {
            return t;
        }
        assert!(
            Instant::now() < deadline,
            "{css} never showed {what}; it shows {t:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_runs_the_fleet_from_the_console() {
    let p = plane_with_workers("console_admin", 2).await;
    let (key, v1, v2) = setup(&p);
    let console = p.admin_url(0);
    let b = Browser::start().await;

    // Signing in: an unauthenticated page sends the browser to sign in;
    // the token lives in an HttpOnly cookie, never in a URL or in reach of
    // the page's scripts.
    b.goto(&format!("{console}/console/fleet")).await;
    b.find("#login").await;
    assert!(b.url().await.ends_with("/console/login"));
    shoot(&b, "login").await;
    sign_in(&b, &console, &p.admin_token).await;
    assert!(b.url().await.ends_with("/console/fleet"));
    assert!(!b.url().await.contains(&p.admin_token));
    let cookies = b.cookies().await;
    let session = cookies
        .iter()
        .find(|c| c["name"] == lorafleet_gateway::console::COOKIE)
        .unwrap_or_else(|| panic!("no session cookie in {cookies:?}"));
    assert_eq!(session["httpOnly"], true, "{session}");
    assert_eq!(session["sameSite"], "Strict", "{session}");
    assert_eq!(
        b.run("return document.cookie;", json!([])).await,
        "",
        "the page's scripts must not see the session"
    );
    assert_eq!(b.text("#role").await, "admin");

    // The fleet: both workers, and v1 absent everywhere until a request
    // brings it to a device slot; the live view shows that without a
    // reload.
    for w in ["w0", "w1"] {
        let row = b.text(&format!("#workers tr[data-worker={w}]")).await;
        assert!(
            row.contains("serving") && row.contains("llama-gqa"),
            "{w}: {row}"
        );
    }
    let cell = |w: &str| format!("#residency td[data-adapter='{v1}'][data-worker='{w}']");
    for w in ["w0", "w1"] {
        assert_eq!(b.text(&cell(w)).await, "absent");
    }
    let (status, done) = p.complete(0, &key, "support", "console").await;
    assert_eq!(status, 200, "{done}");
    let request_id = request_id(&done);
    let first_row = p.audit_rows("acme", "support", 1).await[0].clone();
    let served = first_row["worker_id"].as_str().unwrap().to_owned();
    until_text(&b, &cell(&served), "device", |t| t == "device").await;
    let other = if served == "w0" { "w1" } else { "w0" };
    assert_eq!(b.text(&cell(other)).await, "absent");
    // The live part is the script's doing: it has refreshed at least once.
    let refreshed = b.find("#fleet-live").await;
    assert!(b.attribute(&refreshed, "data-refreshed-at").await.is_some());
    // Rates: the first request found v1 absent, the second on a device.
    let (status, _) = p.complete(0, &key, "support", "console-again").await;
    assert_eq!(status, 200);
    let rates = until_text(
        &b,
        &format!("#residency tr[data-adapter='{v1}']"),
        "its rates",
        |t| t.ends_with(" 50%"),
    )
    .await;
    assert!(
        rates.contains(" 0.4 "),
        "2 requests in 300 s is 0.4 a minute: {rates}"
    );
    shoot(&b, "fleet").await;

    // A 90/10 canary, then promote the candidate.
    b.goto(&format!("{console}/console/routes/acme/support"))
        .await;
    let bp = b.all("#weights-form input[name=weight_bp]").await;
    let ids = b.all("#weights-form input[name=lora_int_id]").await;
    assert_eq!(
        b.attribute(&ids[0], "value").await.as_deref(),
        Some(&*v1.to_string())
    );
    assert_eq!(bp.len(), 3, "one row per version plus two empty rows");
    b.fill(
        "#weights-form tbody tr:nth-child(1) input[name=weight_bp]",
        "9000",
    )
    .await;
    b.fill(
        "#weights-form tbody tr:nth-child(2) input[name=lora_int_id]",
        &v2.to_string(),
    )
    .await;
    b.fill(
        "#weights-form tbody tr:nth-child(2) input[name=weight_bp]",
        "1000",
    )
    .await;
    b.click("#weights-form button[type=submit]").await;
    until_text(&b, "#etag", "etag 2", |t| t == "2").await;
    assert_eq!(
        route_weights(&p),
        ("2".into(), vec![(v1, 9000), (v2, 1000)])
    );
    let legend = b.text(".legend").await;
    assert!(legend.contains("90%") && legend.contains("10%"), "{legend}");
    shoot(&b, "route").await;
    b.goto(&format!("{console}/console/routes")).await;
    b.find("#routes tr[data-route='acme/support'] svg.bar")
        .await;
    shoot(&b, "routes").await;
    b.goto(&format!("{console}/console/routes/acme/support"))
        .await;
    b.run(
        "document.querySelector('#promote-form select').value = arguments[0]; return true;",
        json!([v2.to_string()]),
    )
    .await;
    b.click("#promote-form button[type=submit]").await;
    until_text(&b, "#etag", "etag 3", |t| t == "3").await;
    assert_eq!(route_weights(&p), ("3".into(), vec![(v2, 10000)]));
    let history = b.text("#history").await;
    assert!(
        history.contains("promote") && history.contains("alice"),
        "{history}"
    );

    // A stale etag from a second tab: tab A still shows etag 3 when tab B
    // rolls back; A's change is refused with the conflict, not applied.
    let tab_a = b.new_tab().await;
    b.goto(&format!("{console}/console/routes/acme/support"))
        .await;
    b.click("#rollback-form button[type=submit]").await;
    until_text(&b, "#etag", "etag 4", |t| t == "4").await;
    let after_rollback = route_weights(&p);
    assert_eq!(after_rollback, ("4".into(), vec![(v1, 9000), (v2, 1000)]));
    b.switch_to(&tab_a).await;
    assert_eq!(b.text("#etag").await, "3");
    b.fill(
        "#weights-form tbody tr:nth-child(1) input[name=weight_bp]",
        "5000",
    )
    .await;
    b.fill(
        "#weights-form tbody tr:nth-child(2) input[name=lora_int_id]",
        &v1.to_string(),
    )
    .await;
    b.fill(
        "#weights-form tbody tr:nth-child(2) input[name=weight_bp]",
        "5000",
    )
    .await;
    b.click("#weights-form button[type=submit]").await;
    let refusal = b.find("#refusal").await;
    assert_eq!(
        b.attribute(&refusal, "data-code").await.as_deref(),
        Some("stale_etag")
    );
    assert!(b.text_of(&refusal).await.contains("stale"));
    // The page now shows the route as it is, and nothing was overwritten.
    assert_eq!(b.text("#etag").await, "4");
    assert_eq!(route_weights(&p), after_rollback);
    shoot(&b, "route-conflict").await;

    // A progressive rollout from the route page: refused while the route
    // splits traffic, then started from one version, paused and aborted.
    b.goto(&format!("{console}/console/routes/acme/support"))
        .await;
    b.fill(
        "#rollout-form input[name=candidate_lora_int_id]",
        &v2.to_string(),
    )
    .await;
    b.fill("#rollout-form input[name=steps]", "100,10000").await;
    b.fill("#rollout-form input[name=hold_secs]", "600").await;
    b.click("#rollout-form button[type=submit]").await;
    let refusal = b.find("#refusal").await;
    assert_eq!(
        b.attribute(&refusal, "data-code").await.as_deref(),
        Some("rollout_needs_one_version")
    );
    let etag = route_weights(&p).0;
    p.ctl_json(&[
        "routes",
        "set",
        "acme",
        "support",
        "--weights",
        &format!("{v1}=10000"),
        "--etag",
        &etag,
    ]);
    b.goto(&format!("{console}/console/routes/acme/support"))
        .await;
    b.fill(
        "#rollout-form input[name=candidate_lora_int_id]",
        &v2.to_string(),
    )
    .await;
    b.fill("#rollout-form input[name=steps]", "100,10000").await;
    b.fill("#rollout-form input[name=hold_secs]", "600").await;
    b.click("#rollout-form button[type=submit]").await;
    assert_eq!(b.text("#rollout-state").await, "running");
    assert_eq!(b.text("ol.steps li.current").await, "1%");
    let (_, weights) = route_weights(&p);
    assert_eq!(weights, vec![(v1, 9900), (v2, 100)]);
    assert!(b.all("#weights-form").await.is_empty() && b.all("#manual-locked").await.len() == 1);
    shoot(&b, "route-rollout").await;
    b.click("#rollout-pause button").await;
    assert_eq!(b.text("#rollout-state").await, "paused");
    b.click("#rollout-abort button").await;
    assert_eq!(b.text("#rollout-state").await, "aborted");
    assert!(b.text("#rollout-decisions").await.contains("abort"));
    assert_eq!(route_weights(&p).1, vec![(v1, 10000)]);
    let after_rollback = route_weights(&p);

    // Adapters: a refusal is shown beside the field it names; a good
    // registration is listed.
    b.goto(&format!("{console}/console/adapters")).await;
    b.fill("#register-form input[name=name]", "billing").await;
    b.fill("#register-form input[name=tenant]", "acme").await;
    b.fill("#register-form input[name=artifact_uri]", "../escape")
        .await;
    b.click("#register-form button[type=submit]").await;
    let error = b.text("[data-error-for=artifact_uri]").await;
    assert!(error.contains("artifact_uri"), "{error}");
    shoot(&b, "adapters-refusal").await;
    assert_eq!(
        b.attribute(&b.find("#register-form input[name=name]").await, "value")
            .await
            .as_deref(),
        Some("billing"),
        "the form keeps what was typed"
    );
    b.fill("#register-form input[name=artifact_uri]", "llama-gqa/qv-r8")
        .await;
    b.click("#register-form button[type=submit]").await;
    let notice = b.text("#notice").await;
    assert!(
        notice.contains("billing:v1"),
        "{notice}: {}",
        b.text("main").await
    );
    assert!(b.text("#adapters").await.contains("billing"));
    shoot(&b, "adapters").await;

    // Keys: the secret is shown once and works; revoked, it gets 401.
    b.goto(&format!("{console}/console/tenants")).await;
    shoot(&b, "tenants").await;
    b.goto(&format!("{console}/console/tenants/acme")).await;
    b.fill("#key-form input[name=name]", "console-made").await;
    b.click("#key-form button[type=submit]").await;
    let made = b.text("#created-key").await;
    assert!(made.starts_with("lf_"), "{made}");
    p.until_status(0, &made, "support", 200).await;
    shoot(&b, "tenant-keys").await;
    let prefix = made.split('.').next().unwrap().to_owned();
    b.goto(&format!("{console}/console/tenants/acme")).await;
    assert!(
        b.all("#created-key").await.is_empty(),
        "the secret is shown only once"
    );
    b.click(&format!("#keys tr[data-key='{prefix}'] form.revoke button"))
        .await;
    until_text(
        &b,
        &format!("#keys tr[data-key='{prefix}']"),
        "revoked",
        |t| t.contains("revoked"),
    )
    .await;
    p.until_status(0, &made, "support", 401).await;
    p.until_status(1, &made, "support", 401).await;

    // Limits: shown as they are; a bad one is refused beside its field; a
    // good change is saved and recorded.
    b.goto(&format!("{console}/console/tenants/acme")).await;
    assert_eq!(shown(&b, "rpm_limit").await, "default");
    b.fill("#limits-form input[name=rpm_limit]", "lots").await;
    b.click("#limits-form button[type=submit]").await;
    let error = b.text("[data-error-for=rpm_limit]").await;
    assert!(error.contains("not a limit"), "{error}");
    b.fill("#limits-form input[name=rpm_limit]", "700").await;
    b.fill("#limits-form input[name=tpm_limit]", "unlimited")
        .await;
    b.click("#limits-form button[type=submit]").await;
    assert_eq!(shown(&b, "rpm_limit").await, "700");
    assert_eq!(shown(&b, "tpm_limit").await, "unlimited");
    shoot(&b, "tenant-limits").await;
    let acme = p.ctl_json(&["tenants", "list"])["tenants"][0].clone();
    assert_eq!(
        (acme["name"].as_str(), acme["rpm_limit"].as_u64()),
        (Some("acme"), Some(700))
    );
    assert_eq!(acme["tpm_limit"], "unlimited");

    // The audit log filtered to one request, and that request's details.
    b.goto(&format!("{console}/console/audit")).await;
    assert!(b.all("#audit-rows tbody tr[data-request]").await.len() > 1);
    shoot(&b, "audit").await;
    b.fill("#audit-filters input[name=request_id]", &request_id)
        .await;
    b.click("#audit-filters button[type=submit]").await;
    until_text(&b, "#audit-rows", "one row", |_| true).await;
    let rows = b.all("#audit-rows tbody tr[data-request]").await;
    assert_eq!(rows.len(), 1);
    assert_eq!(
        b.attribute(&rows[0], "data-request").await.as_deref(),
        Some(&*request_id)
    );
    b.click("#audit-rows tbody tr[data-request] a").await;
    assert_eq!(b.text("#detail-worker").await, served);
    // Where the adapter was when the request arrived: not yet on a device.
    let arrival = first_row["adapter_residency"].as_str().unwrap();
    assert_ne!(arrival, "device");
    assert_eq!(b.text("#detail-residency").await, arrival);
    assert!(b.text("#detail-adapter").await.contains("support:v1"));
    assert!(b.text("#detail-ttft").await.ends_with("ms"));
    shoot(&b, "audit-row").await;

    // Keyset pages: one row a page, and the next page is another row.
    b.goto(&format!("{console}/console/audit?tenant=acme&limit=1"))
        .await;
    let first = b
        .attribute(
            &b.find("#audit-rows tbody tr[data-request]").await,
            "data-request",
        )
        .await;
    b.click("#next-page").await;
    let second = b
        .attribute(
            &b.find("#audit-rows tbody tr[data-request]").await,
            "data-request",
        )
        .await;
    assert!(
        first.is_some() && second.is_some() && first != second,
        "{first:?} {second:?}"
    );
    // The export link carries the filters and downloads every matching row.
    b.goto(&format!("{console}/console/audit?request_id={request_id}"))
        .await;
    let csv = b
        .run(
            "const r = await fetch(document.querySelector('#export-csv').href);
             return [r.headers.get('content-disposition'), await r.text()];",
            json!([]),
        )
        .await;
    assert_eq!(csv[0], "attachment; filename=\"audit.csv\"", "{csv}");
    let lines: Vec<&str> = csv[1].as_str().unwrap().lines().collect();
    assert_eq!(lines.len(), 2, "a header and the one row: {lines:?}");
    assert!(lines[1].contains(&request_id));

    // The change log: every change made here, by alice, through the API.
    b.goto(&format!("{console}/console/changes")).await;
    let changes = b.text("#changes").await;
    for action in ["promote", "rollback", "revoke"] {
        assert!(
            changes.contains(action),
            "no {action} in the change log: {changes}"
        );
    }
    shoot(&b, "changes").await;

    // Usage and cost: acme's device time this month, drawn as a stacked
    // bar per day, its tokens against that time, and its adapter among the
    // costliest.
    b.goto(&format!("{console}/console/usage")).await;
    let bars = b.all("#usage-chart svg rect[data-series]").await;
    assert!(!bars.is_empty(), "the chart draws acme's device time");
    assert_eq!(
        b.attribute(&bars[0], "data-series").await.as_deref(),
        Some("acme")
    );
    let tenants = b.text("#usage-tenants").await;
    assert!(tenants.contains("acme"), "{tenants}");
    let adapters = b.text("#usage-adapters").await;
    assert!(adapters.contains("acme / support:v"), "{adapters}");
    // acme as a point of tokens against device time, its adapter a bar.
    let mut points = Vec::new();
    for point in b.all("#usage-tokens-chart svg circle[data-point]").await {
        points.push(b.attribute(&point, "data-point").await.unwrap_or_default());
    }
    assert!(
        points.iter().any(|p| p == "acme"),
        "the scatter draws acme: {points:?}"
    );
    let cost_bars = b.all("#usage-cost-chart svg rect[data-bar]").await;
    let mut named = Vec::new();
    for bar in &cost_bars {
        named.push(b.attribute(bar, "data-bar").await.unwrap_or_default());
    }
    assert!(
        named.iter().any(|n| n.starts_with("acme / support:v")),
        "{named:?}"
    );
    shoot(&b, "usage").await;
    // Another tenant's filter shows none of acme's.
    b.goto(&format!("{console}/console/usage?tenant=nobody"))
        .await;
    assert!(b.all("#usage-chart svg rect[data-series]").await.is_empty());
    assert!(b.all("#usage-tokens-chart svg circle").await.is_empty());
    assert!(b.all("#usage-cost-chart svg rect").await.is_empty());
    // A span that is not a number of days is refused by that field.
    b.goto(&format!("{console}/console/usage?days=forever"))
        .await;
    let page = b.text("main").await;
    assert!(page.contains("days") && page.contains("1 to 366"), "{page}");

    // Writes from another site are refused even with the session's CSRF
    // token; a form without the token is refused too.
    let csrf = b
        .attribute(&b.find("form.signout input[name=csrf]").await, "value")
        .await
        .unwrap();
    let http = reqwest::Client::new();
    let url = format!("{console}/console/routes/acme/support/rollback");
    let cookie = format!("{}={}", lorafleet_gateway::console::COOKIE, p.admin_token);
    let cross = http
        .post(&url)
        .header("cookie", &cookie)
        .header("sec-fetch-site", "cross-site")
        .form(&[("csrf", csrf.as_str()), ("etag", "4")])
        .send()
        .await
        .unwrap();
    assert_eq!(cross.status(), 403);
    let tokenless = http
        .post(&url)
        .header("cookie", &cookie)
        .header("sec-fetch-site", "same-origin")
        .form(&[("etag", "4")])
        .send()
        .await
        .unwrap();
    assert_eq!(tokenless.status(), 403);
    assert!(tokenless.text().await.unwrap().contains("CSRF"));
    // Neither Sec-Fetch-Site nor Origin: no browser sends that, so it is
    // refused even with the token.
    let headerless = http
        .post(&url)
        .header("cookie", &cookie)
        .form(&[("csrf", csrf.as_str()), ("etag", "4")])
        .send()
        .await
        .unwrap();
    assert_eq!(headerless.status(), 403);
    assert!(
        headerless.text().await.unwrap().contains("neither"),
        "names the missing headers"
    );
    assert_eq!(route_weights(&p), after_rollback);

    // Every response carries the strict policy.
    let page = http
        .get(format!("{console}/console/login"))
        .send()
        .await
        .unwrap();
    let csp = page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    for directive in [
        "default-src 'none'",
        "script-src 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(csp.contains(directive), "{csp}");
    }
    assert!(!csp.contains("unsafe-inline"), "{csp}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_viewer_sees_no_write_controls_and_cannot_forge_one() {
    let p = plane_with_workers("console_viewer", 1).await;
    let (_key, v1, v2) = setup(&p);
    p.ctl_json(&[
        "routes",
        "set",
        "acme",
        "support",
        "--weights",
        &format!("{v1}=9000,{v2}=1000"),
        "--etag",
        "1",
    ]);
    let console = p.admin_url(0);
    let b = Browser::start().await;
    // A token that is not one is refused beside the field.
    b.goto(&format!("{console}/console/login")).await;
    b.fill("#login textarea[name=token]", "not-a-token").await;
    b.click("#login button[type=submit]").await;
    let refused = b.text("[data-error-for=token]").await;
    assert!(refused.contains("invalid token"), "{refused}");
    // A valid token that outlives a console session (12 h) is refused
    // too: a cookie taken from a browser must not be worth a day.
    let long = p.token_for("vera", "viewer", 24 * 3600);
    b.fill("#login textarea[name=token]", &long).await;
    b.click("#login button[type=submit]").await;
    let refused = b.text("[data-error-for=token]").await;
    assert!(refused.contains("at most 12 hours"), "{refused}");
    assert!(b.cookies().await.is_empty());
    let viewer = p.token("vera", "viewer");
    sign_in(&b, &console, &viewer).await;
    assert_eq!(b.text("#role").await, "viewer");
    // Reads only: no audit or change log in reach.
    let nav = b.text("header nav").await;
    assert!(
        nav.contains("Routes") && !nav.contains("Audit") && !nav.contains("Changes"),
        "{nav}"
    );

    for page in [
        "/console/fleet",
        "/console/routes",
        "/console/routes/acme/support",
        "/console/adapters",
        "/console/tenants",
        "/console/tenants/acme",
    ] {
        b.goto(&format!("{console}{page}")).await;
        b.find("main h1").await;
        let writes = b
            .all("form[method=post]:not(.signout), button:not(.link)")
            .await;
        assert!(
            writes.is_empty(),
            "{page} shows {} write controls to a viewer",
            writes.len()
        );
    }
    // The weights are there to see.
    b.goto(&format!("{console}/console/routes/acme/support"))
        .await;
    let legend = b.text(".legend").await;
    assert!(legend.contains("90%") && legend.contains("10%"), "{legend}");

    // A forged promote from the viewer's own page, with its valid CSRF
    // token: the server refuses it with 403 and nothing changes.
    let csrf = b
        .attribute(&b.find("form.signout input[name=csrf]").await, "value")
        .await
        .unwrap();
    let status = b
        .run(
            "const body = new URLSearchParams({csrf: arguments[0], etag: '2', lora_int_id: arguments[1]});
             const r = await fetch('/console/routes/acme/support/promote', {method: 'POST', body});
             return [r.status, await r.text()];",
            json!([csrf, v2.to_string()]),
        )
        .await;
    assert_eq!(status[0], 403, "{status}");
    assert!(
        status[1].as_str().unwrap().contains("insufficient_role"),
        "{status}"
    );
    assert_eq!(
        route_weights(&p),
        ("2".into(), vec![(v1, 9000), (v2, 1000)])
    );
    // So is one that goes straight to the audit log.
    b.goto(&format!("{console}/console/audit")).await;
    assert!(b.text("main").await.contains("insufficient_role"));

    // Signing out revokes the session's token: within 2 s every replica
    // refuses it, to the API and to a copied cookie alike.
    b.goto(&format!("{console}/console/fleet")).await;
    b.click("form.signout button").await;
    b.find("#login").await;
    let http = reqwest::Client::new();
    let start = Instant::now();
    for replica in 0..2 {
        loop {
            let r = http
                .get(format!("{}/admin/v1/tenants", p.admin_url(replica)))
                .bearer_auth(&viewer)
                .send()
                .await
                .unwrap();
            if r.status() == 401 {
                assert!(r.text().await.unwrap().contains("revoked"));
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "replica {replica} still accepts a signed-out token"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let cookie = format!("{}={viewer}", lorafleet_gateway::console::COOKIE);
    let page = http
        .get(format!("{console}/console/fleet"))
        .header("cookie", cookie)
        .send()
        .await
        .unwrap();
    assert!(
        page.url().path().ends_with("/console/login") || page.status() == 401,
        "{} {}",
        page.status(),
        page.url()
    );
}
