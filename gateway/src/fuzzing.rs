//! Entry points for the fuzz targets in `fuzz/`: each feeds outside input
//! to one parser the gateway runs on it, exactly as the gateway does, and
//! must return (with an error or not) without panicking. Not an API.

use std::sync::OnceLock;

use crate::api::openai::{ChatRequest, CompletionRequest};
use crate::auth::{self, JwtConfig};
use crate::registry::Snapshot;

/// A completions and a chat request body, parsed and mapped to the worker.
pub fn openai_body(data: &[u8]) {
    if let Ok(r) = CompletionRequest::parse(data) {
        let _ = r.to_worker();
    }
    if let Ok(r) = ChatRequest::parse(data) {
        let _ = r.to_worker();
    }
}

/// An `Authorization` header value: an API key against an empty registry,
/// or a JWT against an HMAC configuration.
pub fn authorization(data: &[u8]) {
    static JWT: OnceLock<Option<JwtConfig>> = OnceLock::new();
    let jwt = JWT.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("lorafleet-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let secret = dir.join("hmac.secret");
        std::fs::write(&secret, "a-fuzzing-secret-of-at-least-32-bytes-long!!").ok()?;
        let config = auth::jwt_config(
            "--jwt-",
            Some(&secret),
            None,
            &["HS256".to_owned()],
            Some("fuzz"),
            Some("fuzz"),
        );
        // The secret is read; the run leaves nothing behind.
        let _ = std::fs::remove_dir_all(&dir);
        config.ok().flatten()
    });
    let Ok(header) = std::str::from_utf8(data) else {
        return;
    };
    let _ = auth::authenticate(Some(header), &Snapshot::default(), jwt.as_ref());
}

/// An audit cursor from a client's `cursor` parameter.
pub fn audit_cursor(data: &[u8]) {
    if let Ok(s) = std::str::from_utf8(data)
        && let Ok(c) = crate::admin::audit_cursor(s)
    {
        // A cursor that decodes encodes back to a cursor that decodes.
        let again = crate::admin::audit_cursor(&c).expect("a decoded cursor re-encodes");
        assert_eq!(again, c);
    }
}

/// An evaluation set file, as an admin registers it: a set that is read
/// stores and reads back as the same items, and its regular expressions
/// compile again when scored.
pub fn eval_set(data: &[u8]) {
    use crate::evaluation::{score, set};
    if let Ok(s) = set::parse(data) {
        let stored = serde_json::to_value(&s.items).expect("items serialize");
        let back: Vec<set::Item> = serde_json::from_value(stored).expect("stored items read back");
        assert_eq!(back, s.items);
        for item in &s.items {
            if let set::Item::Generate {
                expected, matching, ..
            } = item
            {
                let _ = score::matches(expected, *matching, "AN ANSWER");
            }
        }
    }
}
