//! Signing in and out, the session cookie, and the checks every write
//! passes: same-site origin and the session's CSRF token.

use axum::Form;
use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::http::request::Parts;
use sha2::{Digest, Sha256};

use super::*;
use crate::admin::Identity;

/// The session cookie's name.
pub const COOKIE: &str = "lorafleet_console";

/// The longest a console session lasts: a token that would outlive it is
/// refused at sign-in, so a cookie taken from a browser is worth hours,
/// not the days a long-lived automation token may carry.
pub const MAX_SESSION_SECS: i64 = 12 * 3600;

/// The signed-in admin: the token, who it names, and the CSRF token
/// derived from it.
#[derive(Clone)]
pub struct Session {
    pub token: String,
    pub identity: Identity,
    pub csrf: String,
}

/// Never prints the token or the CSRF token: a `?session` in a log line
/// must not hand out the admin's credential.
impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl Session {
    fn from_token(c: &Console, token: &str) -> Result<Session, ApiError> {
        let identity = c
            .admin
            .verify(token)
            .map_err(|e| ApiError::local(StatusCode::UNAUTHORIZED, None, e.message()))?;
        Ok(Session {
            token: token.to_owned(),
            identity,
            csrf: csrf_token(token),
        })
    }
}

/// The CSRF token of a session: a digest of its admin token, so only a
/// page that the session itself loaded can know it (a cross-site page can
/// neither read the `HttpOnly` cookie nor our pages), and every replica
/// derives the same one without shared state.
fn csrf_token(token: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"lorafleet-console-csrf\n");
    h.update(token.as_bytes());
    hex::encode(h.finalize())
}

/// The session cookie's value. Two cookies of that name (one set for a
/// parent domain by a sibling site, say) mean no session: which one the
/// browser meant cannot be told, and taking either could sign the admin
/// in as someone else.
fn cookie_token(headers: &HeaderMap) -> Option<&str> {
    let mut found = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .filter(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v);
    let first = found.next()?;
    found.next().is_none().then_some(first)
}

/// Without a valid session, a page sends the browser to sign in.
impl FromRequestParts<Console> for Session {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, c: &Console) -> Result<Session, Response> {
        let token = cookie_token(&parts.headers).ok_or_else(to_login)?;
        Session::from_token(c, token).map_err(|_| {
            let mut r = to_login();
            r.headers_mut()
                .insert(header::SET_COOKIE, clear_cookie(c.options));
            r
        })
    }
}

impl OptionalFromRequestParts<Console> for Session {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        c: &Console,
    ) -> Result<Option<Session>, Self::Rejection> {
        Ok(cookie_token(&parts.headers).and_then(|t| Session::from_token(c, t).ok()))
    }
}

fn to_login() -> Response {
    Redirect::to("/console/login").into_response()
}

fn cookie_attributes(options: ConsoleOptions) -> &'static str {
    if options.secure_cookie {
        "Path=/console; HttpOnly; SameSite=Strict; Secure"
    } else {
        "Path=/console; HttpOnly; SameSite=Strict"
    }
}

fn clear_cookie(options: ConsoleOptions) -> HeaderValue {
    HeaderValue::from_str(&format!(
        "{COOKIE}=; Max-Age=0; {}",
        cookie_attributes(options)
    ))
    .expect("a constant cookie")
}

/// Refuses a request another site made the browser send. `Sec-Fetch-Site`
/// where the browser sends it, else `Origin` against `Host`; a POST with
/// neither is refused too, since every browser the console supports sends
/// one, and sign-in has no CSRF token to fall back on.
fn same_origin(headers: &HeaderMap) -> Result<(), ApiError> {
    let refused = |why: &str| {
        ApiError::local(
            StatusCode::FORBIDDEN,
            None,
            &format!("cross-site request refused: {why}"),
        )
    };
    if let Some(site) = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()) {
        return match site {
            "same-origin" | "none" => Ok(()),
            other => Err(refused(&format!("Sec-Fetch-Site is {other}"))),
        };
    }
    if let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        let origin_host = origin.split_once("://").map_or(origin, |(_, h)| h);
        if origin_host != host {
            return Err(refused(&format!("Origin {origin} is not this console")));
        }
        return Ok(());
    }
    Err(refused(
        "the request carries neither Sec-Fetch-Site nor Origin",
    ))
}

/// A submitted form, once its origin and CSRF token are checked.
pub struct Fields(Vec<(String, String)>);

/// Prints the field names only: values may be secrets (the CSRF token).
impl std::fmt::Debug for Fields {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(k, _)| k))
            .finish()
    }
}

impl Fields {
    /// Checks a write: same origin, then the session's CSRF token.
    pub fn check(
        session: &Session,
        headers: &HeaderMap,
        Form(pairs): Form<Vec<(String, String)>>,
    ) -> Result<Fields, ApiError> {
        same_origin(headers)?;
        let sent = pairs
            .iter()
            .find(|(k, _)| k == "csrf")
            .map(|(_, v)| v.as_str())
            .unwrap_or_default();
        // Compared in constant time: the token is a secret.
        let matches = sent.len() == session.csrf.len()
            && sent
                .bytes()
                .zip(session.csrf.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
        if !matches {
            return Err(ApiError::local(
                StatusCode::FORBIDDEN,
                Some("csrf"),
                "the form's CSRF token is missing or not this session's; reload the page and retry",
            ));
        }
        Ok(Fields(pairs))
    }

    /// The first value of `name`, trimmed ("" when absent).
    pub fn get(&self, name: &str) -> &str {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map_or("", |(_, v)| v.trim())
    }

    /// Every value of `name`, in order.
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.trim())
            .collect()
    }

    /// The values as they were typed, to show the form again after a
    /// refusal (never the CSRF token).
    pub fn echo(&self) -> Value {
        let mut m = serde_json::Map::new();
        for (k, v) in &self.0 {
            if k != "csrf" {
                m.entry(k.clone())
                    .or_insert_with(|| Value::String(v.clone()));
            }
        }
        Value::Object(m)
    }
}

/// A write: the session and its submitted form, once the origin and the
/// CSRF token are checked. Every POST handler but sign-in takes one, so no
/// handler can skip the checks; a refusal is the error page.
pub struct Write {
    pub session: Session,
    pub fields: Fields,
}

impl axum::extract::FromRequest<Console> for Write {
    type Rejection = Response;

    async fn from_request(req: axum::extract::Request, c: &Console) -> Result<Write, Response> {
        let (mut parts, body) = req.into_parts();
        let session =
            <Session as FromRequestParts<Console>>::from_request_parts(&mut parts, c).await?;
        let headers = parts.headers.clone();
        let form = Form::<Vec<(String, String)>>::from_request(
            axum::extract::Request::from_parts(parts, body),
            c,
        )
        .await
        .map_err(IntoResponse::into_response)?;
        match Fields::check(&session, &headers, form) {
            Ok(fields) => Ok(Write { session, fields }),
            Err(e) => Err(c.error_page(Some(&session), &e)),
        }
    }
}

/// `POST /console/login`: a pasted admin token becomes the session.
pub(super) async fn login(
    State(c): State<Console>,
    headers: HeaderMap,
    Form(pairs): Form<Vec<(String, String)>>,
) -> Response {
    let token = pairs
        .iter()
        .find(|(k, _)| k == "token")
        .map_or("", |(_, v)| v.trim());
    let refused = |e: ApiError| c.render(None, "login.html", e.status, json!({ "error": e }));
    if let Err(e) = same_origin(&headers) {
        return refused(e);
    }
    if token.is_empty() {
        return refused(ApiError::local(
            StatusCode::BAD_REQUEST,
            Some("token"),
            "paste an admin token (lorafleetctl token prints one)",
        ));
    }
    let session = match Session::from_token(&c, token) {
        Ok(s) => s,
        Err(mut e) => {
            e.param = Some("token".into());
            return refused(e);
        }
    };
    let max_age = (session.identity.expires_at - chrono::Utc::now().timestamp()).max(0);
    if max_age > MAX_SESSION_SECS {
        return refused(ApiError::local(
            StatusCode::BAD_REQUEST,
            Some("token"),
            &format!(
                "the token is valid for {}; a console session lasts at most {} hours: \
                 mint one with `lorafleetctl token --ttl-secs {MAX_SESSION_SECS}` or less",
                humantime_secs(max_age),
                MAX_SESSION_SECS / 3600
            ),
        ));
    }
    let cookie = format!(
        "{COOKIE}={}; Max-Age={max_age}; {}",
        session.token,
        cookie_attributes(c.options)
    );
    tracing::info!(actor = %session.identity.subject, role = session.identity.role.name(), "console sign-in");
    let mut r = Redirect::to("/console/fleet").into_response();
    match HeaderValue::from_str(&cookie) {
        Ok(v) => {
            r.headers_mut().insert(header::SET_COOKIE, v);
            r
        }
        Err(_) => refused(ApiError::local(
            StatusCode::BAD_REQUEST,
            Some("token"),
            "the token holds characters a cookie cannot carry",
        )),
    }
}

/// "3 h 20 min" for a number of seconds.
fn humantime_secs(secs: i64) -> String {
    match (secs / 3600, (secs % 3600) / 60) {
        (0, m) => format!("{m} min"),
        (h, 0) => format!("{h} h"),
        (h, m) => format!("{h} h {m} min"),
    }
}

/// `POST /console/logout`.
/// Signs out: the session's token is revoked (fleet-wide within the
/// registry's reload time), then the cookie cleared. A token without a
/// `jti` cannot be revoked; it ends at its expiry, at most 12 hours.
pub(super) async fn logout(State(c): State<Console>, w: Write) -> Response {
    if w.session.identity.jti.is_some()
        && let Err(e) = c.exec(&w.session, crate::admin::RevokeOwnToken).await
        && !e.is(crate::admin::AdminCode::NoChange)
    {
        tracing::warn!(error = %e.message, "console sign-out: the token was not revoked");
    }
    let mut r = Redirect::to("/console/login").into_response();
    r.headers_mut()
        .insert(header::SET_COOKIE, clear_cookie(c.options));
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admin::Role;

    fn session(token: &str) -> Session {
        Session {
            token: token.into(),
            identity: Identity {
                subject: "alice".into(),
                role: Role::Admin,
                expires_at: 0,
                jti: None,
            },
            csrf: csrf_token(token),
        }
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn form(pairs: &[(&str, &str)]) -> Form<Vec<(String, String)>> {
        Form(
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        )
    }

    #[test]
    fn the_csrf_token_is_the_sessions_own() {
        assert_eq!(csrf_token("a.b.c"), csrf_token("a.b.c"));
        assert_ne!(csrf_token("a.b.c"), csrf_token("a.b.d"));
        assert!(!csrf_token("a.b.c").contains("a.b.c"));
    }

    #[test]
    fn the_session_cookie_is_found_among_others() {
        let h = headers(&[("cookie", "x=1; lorafleet_console=tok.en.sig; y=2")]);
        assert_eq!(cookie_token(&h), Some("tok.en.sig"));
        let h = headers(&[("cookie", "lorafleet_console_x=no")]);
        assert_eq!(cookie_token(&h), None);
        // Two of them (one planted for a parent domain): neither is taken.
        let h = headers(&[(
            "cookie",
            "lorafleet_console=mine; lorafleet_console=planted",
        )]);
        assert_eq!(cookie_token(&h), None);
        let h = headers(&[
            ("cookie", "lorafleet_console=mine"),
            ("cookie", "lorafleet_console=planted"),
        ]);
        assert_eq!(cookie_token(&h), None);
    }

    #[test]
    fn debug_output_never_holds_the_token_or_the_csrf_token() {
        let s = session("secret.admin.token");
        let fields = Fields(vec![("csrf".into(), s.csrf.clone())]);
        let printed = format!("{s:?} {fields:?}");
        assert!(printed.contains("alice"), "{printed}");
        assert!(!printed.contains("secret.admin.token"), "{printed}");
        assert!(!printed.contains(&s.csrf), "{printed}");
    }

    #[test]
    fn a_write_needs_the_same_origin_and_the_sessions_token() {
        let s = session("t1");
        let good = || form(&[("csrf", &s.csrf), ("name", " acme ")]);
        let fields = Fields::check(&s, &headers(&[("sec-fetch-site", "same-origin")]), good())
            .expect("a same-origin form with the token");
        assert_eq!(fields.get("name"), "acme");
        assert!(
            fields.echo().get("csrf").is_none(),
            "the token is never echoed"
        );
        for h in [
            headers(&[("sec-fetch-site", "cross-site")]),
            headers(&[("sec-fetch-site", "same-site")]),
            headers(&[("origin", "https://evil.example"), ("host", "console:8081")]),
            // Neither header: a browser always sends one, so this is not one.
            headers(&[("host", "console:8081")]),
        ] {
            let e = Fields::check(&s, &h, good()).unwrap_err();
            assert_eq!(e.status, StatusCode::FORBIDDEN);
        }
        // Origin matching Host, without Sec-Fetch-Site (older browsers).
        let h = headers(&[("origin", "http://console:8081"), ("host", "console:8081")]);
        assert!(Fields::check(&s, &h, good()).is_ok());
        for bad in [
            form(&[("name", "acme")]),
            form(&[("csrf", &csrf_token("another session"))]),
            form(&[("csrf", "")]),
        ] {
            let same = headers(&[("sec-fetch-site", "same-origin")]);
            let e = Fields::check(&s, &same, bad).unwrap_err();
            assert_eq!(
                (e.status, e.param.as_deref()),
                (StatusCode::FORBIDDEN, Some("csrf"))
            );
        }
    }
}
