//! Failures with their exit codes, and the HTTP client over the admin API.

use super::*;

/// A failure with the exit code it maps to.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) code: u8,
    pub(crate) message: String,
}

pub(crate) fn fail(code: u8, message: impl Into<String>) -> Failure {
    Failure {
        code,
        message: message.into(),
    }
}

pub(crate) const USAGE: u8 = 2;

pub(crate) struct Client {
    pub(crate) http: reqwest::Client,
    pub(crate) base: String,
    pub(crate) token: Option<String>,
    pub(crate) output: Output,
}

/// Encodes one path segment (model names may hold '/').
pub(crate) fn segment(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Client {
    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}/admin/v1{path}", self.base.trim_end_matches('/'))
    }

    pub(crate) async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<Value>,
        if_match: Option<&str>,
    ) -> Result<reqwest::Response, Failure> {
        let token = self.token.as_deref().ok_or_else(|| {
            fail(
                USAGE,
                "--token: required (or LORAFLEET_ADMIN_TOKEN); mint one with `lorafleetctl token`",
            )
        })?;
        let mut req = self
            .http
            .request(method, self.url(path))
            .bearer_auth(token)
            .query(query);
        if let Some(b) = body {
            req = req.json(&b);
        }
        if let Some(e) = if_match {
            let e = e.trim_matches('"');
            req = req.header("If-Match", format!("\"{e}\""));
        }
        let resp = req.send().await.map_err(|e| {
            fail(
                7,
                format!("cannot reach the admin API at {}: {e}", self.base),
            )
        })?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap_or_default();
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let message = body["error"]["message"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| format!("HTTP {status}: {text}"));
        if self.output == Output::Json && !body.is_null() {
            println!("{body}");
        }
        let code = match status {
            401 | 403 => 3,
            404 => 4,
            409 | 412 | 428 => 5,
            400 | 413 | 422 => 6,
            503 => 7,
            _ => 1,
        };
        Err(fail(code, message))
    }

    pub(crate) async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<Value>,
        if_match: Option<&str>,
    ) -> Result<Value, Failure> {
        let resp = self.send(method, path, query, body, if_match).await?;
        resp.json().await.map_err(|e| {
            fail(
                1,
                format!("the admin API sent a body that is not JSON: {e}"),
            )
        })
    }

    pub(crate) async fn get(&self, path: &str, query: &[(&str, String)]) -> Result<Value, Failure> {
        self.call(reqwest::Method::GET, path, query, None, None)
            .await
    }

    /// A call whose request and answer are the admin API's own types
    /// ([`lorafleet_admin_types`]).
    pub(crate) async fn call_as<T: serde::de::DeserializeOwned>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&impl serde::Serialize>,
        if_match: Option<&str>,
    ) -> Result<T, Failure> {
        let body = body
            .map(serde_json::to_value)
            .transpose()
            .map_err(|e| fail(1, format!("cannot encode the request: {e}")))?;
        let value = self.call(method, path, &[], body, if_match).await?;
        serde_json::from_value(value).map_err(|e| {
            fail(
                1,
                format!("the admin API sent an answer this lorafleetctl does not understand: {e}"),
            )
        })
    }

    pub(crate) async fn get_as<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<T, Failure> {
        let value = self.get(path, query).await?;
        serde_json::from_value(value).map_err(|e| {
            fail(
                1,
                format!("the admin API sent an answer this lorafleetctl does not understand: {e}"),
            )
        })
    }

    pub(crate) async fn post_as<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &impl serde::Serialize,
    ) -> Result<T, Failure> {
        self.call_as(reqwest::Method::POST, path, Some(body), None)
            .await
    }

    pub(crate) async fn patch_as<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &impl serde::Serialize,
    ) -> Result<T, Failure> {
        self.call_as(reqwest::Method::PATCH, path, Some(body), None)
            .await
    }
}

/// A typed answer as JSON, for the table renderers.
pub(crate) fn as_json(v: &impl serde::Serialize) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}
