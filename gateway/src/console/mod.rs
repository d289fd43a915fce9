//! The admin console: server-rendered pages under `/console` on the admin
//! listener, for the people who run the fleet.
//!
//! - **One authority.** Every read and write is a typed query or command of
//!   the admin plane's core, run as the signed-in admin: the console adds
//!   no rule of its own, so roles, validation, etags and the change log hold
//!   exactly as for the admin API and `lorafleetctl`.
//! - **The session is the admin token**, kept in an `HttpOnly`,
//!   `SameSite=Strict` cookie scoped to `/console`, and valid until the
//!   token's own expiry, at most 12 hours. A token never appears in a URL.
//! - **Writes are forms** that carry a CSRF token derived from the session;
//!   a cross-site request is refused before the token is even compared.
//!   Every write handler takes a `session::Write`, the extractor that runs
//!   both checks, so none can skip them.
//! - **Every response carries a strict Content-Security-Policy**: scripts
//!   and styles only from `/console/static`, no inline code, no framing.
//! - Pages are minijinja templates compiled into the binary; the only
//!   script is `static/console.js` (live refresh of the fleet view). There
//!   is no front-end build step and no third-party front-end code.

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use minijinja::Environment;
use serde_json::{Value, json};

use crate::admin::AdminState;

mod chart;
mod client;
mod pages;
mod session;

use client::ApiError;
pub use session::COOKIE;
use session::{Fields, Session, Write};

/// How the console is served.
#[derive(Debug, Clone, Copy)]
pub struct ConsoleOptions {
    /// Mark the session cookie `Secure` (HTTPS only; browsers also keep it
    /// on `http://localhost`). Off only for plain HTTP on another host.
    pub secure_cookie: bool,
}

/// What every console handler shares. Cheap to clone.
#[derive(Clone)]
pub struct Console {
    /// The admin plane's core, called in process.
    admin: AdminState,
    templates: Arc<Environment<'static>>,
    options: ConsoleOptions,
}

impl std::fmt::Debug for Console {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// The policy every console response carries.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
                   connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

const TEMPLATES: &[(&str, &str)] = &[
    ("base.html", include_str!("templates/base.html")),
    ("macros.html", include_str!("templates/macros.html")),
    ("login.html", include_str!("templates/login.html")),
    ("error.html", include_str!("templates/error.html")),
    ("fleet.html", include_str!("templates/fleet.html")),
    ("fleet_live.html", include_str!("templates/fleet_live.html")),
    ("routes.html", include_str!("templates/routes.html")),
    ("route.html", include_str!("templates/route.html")),
    ("adapters.html", include_str!("templates/adapters.html")),
    ("tenants.html", include_str!("templates/tenants.html")),
    ("tenant.html", include_str!("templates/tenant.html")),
    ("audit.html", include_str!("templates/audit.html")),
    ("audit_row.html", include_str!("templates/audit_row.html")),
    ("changes.html", include_str!("templates/changes.html")),
    ("usage.html", include_str!("templates/usage.html")),
];

fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    // `{{ x|seg }}`: a value percent-encoded as one path segment, for
    // links built from data (HTML escaping alone would let a `/` or `?`
    // change where the link goes).
    env.add_filter("seg", |s: String| client::seg(&s));
    for (name, source) in TEMPLATES {
        env.add_template(name, source)
            .unwrap_or_else(|e| panic!("console template {name}: {e}"));
    }
    env
}

/// The console's routes, to merge into the admin listener's router.
pub fn router(admin_state: AdminState, options: ConsoleOptions) -> Router {
    let console = Console {
        admin: admin_state,
        templates: Arc::new(environment()),
        options,
    };
    Router::new()
        .route("/console", get(|| async { Redirect::to("/console/fleet") }))
        .route(
            "/console/",
            get(|| async { Redirect::to("/console/fleet") }),
        )
        .route("/console/login", get(login_page).post(session::login))
        .route("/console/logout", post(session::logout))
        .route("/console/static/console.css", get(stylesheet))
        .route("/console/static/console.js", get(script))
        .merge(pages::router())
        // Not a fallback: the admin router this merges into has its own.
        .route("/console/{*rest}", get(not_found).post(not_found))
        .layer(axum::middleware::map_response_with_state(
            options,
            security_headers,
        ))
        .with_state(console)
}

async fn security_headers(State(options): State<ConsoleOptions>, mut r: Response) -> Response {
    let h = r.headers_mut();
    if options.secure_cookie {
        // The session cookie is `Secure`, so the console is meant to be
        // reached over HTTPS only; browsers ignore this header over HTTP.
        h.insert(
            header::STRICT_TRANSPORT_SECURITY,
            HeaderValue::from_static("max-age=31536000"),
        );
    }
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(
        "cross-origin-opener-policy",
        HeaderValue::from_static("same-origin"),
    );
    // Pages hold registry and audit data: never cached.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

async fn stylesheet() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("static/console.css"),
    )
        .into_response()
}

async fn script() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("static/console.js"),
    )
        .into_response()
}

async fn login_page(State(c): State<Console>) -> Response {
    c.render(None, "login.html", StatusCode::OK, json!({}))
}

async fn not_found(State(c): State<Console>, session: Option<Session>) -> Response {
    c.error_page(
        session.as_ref(),
        &ApiError::local(StatusCode::NOT_FOUND, None, "no such console page"),
    )
}

impl Console {
    /// Renders `template` with `data` (a JSON object) plus who is signed in
    /// and the session's CSRF token.
    fn render(
        &self,
        session: Option<&Session>,
        template: &str,
        status: StatusCode,
        mut data: Value,
    ) -> Response {
        if let (Some(s), Some(obj)) = (session, data.as_object_mut()) {
            obj.insert(
                "me".into(),
                json!({
                    "subject": s.identity.subject,
                    "role": s.identity.role.name(),
                    "can_write": s.identity.role.can_write(),
                    "can_audit": s.identity.role.can_audit(),
                }),
            );
            obj.insert("csrf".into(), Value::String(s.csrf.clone()));
        }
        let rendered = self
            .templates
            .get_template(template)
            .and_then(|t| t.render(&data));
        match rendered {
            Ok(html) => (
                status,
                [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
                html,
            )
                .into_response(),
            Err(e) => {
                tracing::error!(template, error = %e, "console template failed");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the page could not be rendered",
                )
                    .into_response()
            }
        }
    }

    /// A page that only says what went wrong.
    fn error_page(&self, session: Option<&Session>, e: &ApiError) -> Response {
        self.render(
            session,
            "error.html",
            e.status,
            json!({ "error": e, "title": e.status.canonical_reason().unwrap_or("Error") }),
        )
    }
}

/// A plain response (for the audit export) with the console's headers.
fn passthrough(status: StatusCode, headers: HeaderMap, body: Body) -> Response {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    *r.headers_mut() = headers;
    r
}

/// A form's value, trimmed, or None when blank.
fn non_blank(v: &str) -> Option<&str> {
    let v = v.trim();
    (!v.is_empty()).then_some(v)
}
