//! The admin API, called in process with the session's token.

use axum::http::{Method, Request};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tower::ServiceExt;

use super::*;

/// A refusal, from the admin API or the console's own checks: the status,
/// the stable code, and the field at fault (shown next to that field).
#[derive(Debug, Clone, Serialize)]
pub struct ApiError {
    #[serde(serialize_with = "status_code")]
    pub status: StatusCode,
    pub code: String,
    pub message: String,
    pub param: Option<String>,
}

fn status_code<S: serde::Serializer>(s: &StatusCode, ser: S) -> Result<S::Ok, S::Error> {
    ser.serialize_u16(s.as_u16())
}

impl ApiError {
    /// A refusal the console makes itself.
    pub fn local(status: StatusCode, param: Option<&str>, message: &str) -> ApiError {
        let code = match status.as_u16() {
            401 => "invalid_admin_token",
            403 => "forbidden",
            404 => "not_found",
            _ => "invalid_field",
        };
        ApiError {
            status,
            code: code.into(),
            message: message.into(),
            param: param.map(str::to_owned),
        }
    }

    /// A form value that is not what the field takes.
    pub fn field(param: &str, message: &str) -> ApiError {
        ApiError::local(
            StatusCode::BAD_REQUEST,
            Some(param),
            &format!("{param}: {message}"),
        )
    }
}

/// One admin API call.
pub struct Call<'a> {
    method: Method,
    path: String,
    body: Option<Value>,
    if_match: Option<&'a str>,
}

impl<'a> Call<'a> {
    pub fn get(path: impl Into<String>) -> Call<'a> {
        Call {
            method: Method::GET,
            path: path.into(),
            body: None,
            if_match: None,
        }
    }

    pub fn post(path: impl Into<String>, body: Value) -> Call<'a> {
        Call {
            method: Method::POST,
            path: path.into(),
            body: Some(body),
            if_match: None,
        }
    }

    pub fn put(path: impl Into<String>, body: Value) -> Call<'a> {
        Call {
            method: Method::PUT,
            path: path.into(),
            body: Some(body),
            if_match: None,
        }
    }

    /// Sends the route etag the form was rendered with.
    pub fn if_match(mut self, etag: &'a str) -> Call<'a> {
        self.if_match = Some(etag);
        self
    }
}

/// A path segment, percent-encoded.
pub fn seg(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Console {
    /// Sends `call` to the admin API as the session's admin and returns the
    /// response as it is.
    pub(super) async fn send(&self, s: &Session, call: Call<'_>) -> Response {
        let mut req = Request::builder()
            .method(call.method)
            .uri(&call.path)
            .header(header::AUTHORIZATION, format!("Bearer {}", s.token));
        if let Some(etag) = call.if_match {
            req = req.header(header::IF_MATCH, format!("\"{}\"", etag.trim_matches('"')));
        }
        let body = match call.body {
            Some(b) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                Body::from(b.to_string())
            }
            None => Body::empty(),
        };
        let req = req.body(body).expect("a well-formed admin request");
        match self.admin.clone().oneshot(req).await {
            Ok(r) => r,
            Err(never) => match never {},
        }
    }

    /// Sends `call` and reads its JSON answer, or the refusal.
    pub(super) async fn api<T: DeserializeOwned>(
        &self,
        s: &Session,
        call: Call<'_>,
    ) -> Result<T, ApiError> {
        let r = self.send(s, call).await;
        let status = r.status();
        let bytes = axum::body::to_bytes(r.into_body(), 64 << 20)
            .await
            .map_err(|e| internal(&format!("reading the admin API's answer: {e}")))?;
        if !status.is_success() {
            let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let e = &v["error"];
            return Err(ApiError {
                status,
                code: e["code"].as_str().unwrap_or("error").to_owned(),
                message: e["message"].as_str().map_or_else(
                    || String::from_utf8_lossy(&bytes).into_owned(),
                    str::to_owned,
                ),
                param: e["param"].as_str().map(str::to_owned),
            });
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| internal(&format!("the admin API's answer did not parse: {e}")))
    }
}

fn internal(message: &str) -> ApiError {
    tracing::error!(message, "console: admin API call failed");
    ApiError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        code: "internal_error".into(),
        message: message.into(),
        param: None,
    }
}
