//! The admin plane's core, called in process as the signed-in admin: every
//! page reads through [`AdminState::read`] and every form changes through
//! [`AdminState::exec`], so roles, validation, etags and the change log
//! hold exactly as for the admin API and `lorafleetctl`.

use serde::Serialize;

use super::*;
use crate::admin::{AdminCode, AdminError, Caller, Command, Query};

/// A refusal, from the admin plane or the console's own checks: the status,
/// the stable code, and the field at fault (shown next to that field).
#[derive(Debug, Clone, Serialize)]
pub struct ApiError {
    #[serde(serialize_with = "status_code")]
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub param: Option<String>,
}

fn status_code<S: serde::Serializer>(s: &StatusCode, ser: S) -> Result<S::Ok, S::Error> {
    ser.serialize_u16(s.as_u16())
}

impl From<AdminError> for ApiError {
    fn from(e: AdminError) -> ApiError {
        ApiError {
            status: e.code().status(),
            code: e.code().as_str(),
            message: e.message().to_owned(),
            param: e.param().map(str::to_owned),
        }
    }
}

impl ApiError {
    /// A refusal the console makes itself.
    pub fn local(status: StatusCode, param: Option<&str>, message: &str) -> ApiError {
        let code = match status.as_u16() {
            401 => AdminCode::InvalidAdminToken.as_str(),
            403 => "forbidden",
            404 => AdminCode::NotFound.as_str(),
            _ => AdminCode::InvalidField.as_str(),
        };
        ApiError {
            status,
            code,
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

    /// Is this the admin plane's `code`?
    pub fn is(&self, code: AdminCode) -> bool {
        self.code == code.as_str()
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
    /// A read, as the session's admin.
    pub(super) async fn read<Q: Query>(&self, s: &Session, q: Q) -> Result<Q::Output, ApiError> {
        Ok(self.admin.read(&Caller::new(&s.identity), q).await?)
    }

    /// A change, as the session's admin.
    pub(super) async fn exec<C: Command>(&self, s: &Session, c: C) -> Result<C::Output, ApiError> {
        Ok(self.admin.exec(&Caller::new(&s.identity), c).await?)
    }
}
