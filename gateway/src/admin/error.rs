//! The admin API's error type and its one mapping to a status and a stable code.

use super::*;

/// An error response: `{"error": {"message", "type", "code", "param"}}`.
#[derive(Debug)]
pub struct AdminError {
    pub(super) status: StatusCode,
    pub(super) code: &'static str,
    pub(super) param: Option<String>,
    pub(super) message: String,
}

impl AdminError {
    pub(super) fn new(
        status: StatusCode,
        code: &'static str,
        param: Option<&str>,
        message: String,
    ) -> AdminError {
        AdminError {
            status,
            code,
            param: param.map(str::to_owned),
            message,
        }
    }

    /// A field that is malformed: 400.
    pub(super) fn field(param: &str, message: impl Into<String>) -> AdminError {
        AdminError::new(
            StatusCode::BAD_REQUEST,
            "invalid_field",
            Some(param),
            format!("{param}: {}", message.into()),
        )
    }

    /// Well-formed but refused by a rule: 422.
    pub(super) fn unprocessable(
        code: &'static str,
        param: &str,
        message: impl Into<String>,
    ) -> AdminError {
        AdminError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            code,
            Some(param),
            format!("{param}: {}", message.into()),
        )
    }

    pub(super) fn not_found(param: &str, what: impl Into<String>) -> AdminError {
        AdminError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            Some(param),
            format!("{param}: {} does not exist", what.into()),
        )
    }

    pub(super) fn conflict(
        code: &'static str,
        param: &str,
        message: impl Into<String>,
    ) -> AdminError {
        AdminError::new(
            StatusCode::CONFLICT,
            code,
            Some(param),
            format!("{param}: {}", message.into()),
        )
    }

    pub(super) fn internal(e: impl std::fmt::Display) -> AdminError {
        tracing::error!(error = %e, "admin request failed");
        AdminError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            None,
            format!("internal error: {e}"),
        )
    }
}

impl IntoResponse for AdminError {
    fn into_response(self) -> Response {
        let kind = match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            409 | 412 | 428 => "conflict_error",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        };
        let body = json!({"error": {
            "message": self.message,
            "type": kind,
            "code": self.code,
            "param": self.param,
        }});
        (self.status, axum::Json(body)).into_response()
    }
}

/// Maps a database error to the field it concerns, using the schema's
/// named constraints; anything else is a 500 (or 503 when Postgres is away).
pub(super) fn db_error(e: sqlx::Error) -> AdminError {
    if let sqlx::Error::Database(d) = &e
        && let Some(constraint) = d.constraint()
    {
        let message = d.message().to_owned();
        let (status, code, param) = match constraint {
            "tenants_name_unique" => (StatusCode::CONFLICT, "duplicate", "name"),
            "tenants_name_format" => (StatusCode::BAD_REQUEST, "invalid_field", "name"),
            "tenants_rpm_limit_positive" => (StatusCode::BAD_REQUEST, "invalid_field", "rpm_limit"),
            "tenants_tpm_limit_positive" => (StatusCode::BAD_REQUEST, "invalid_field", "tpm_limit"),
            "base_models_name_unique" => (StatusCode::CONFLICT, "duplicate", "name"),
            "base_models_base_hash_unique" => (StatusCode::CONFLICT, "duplicate", "base_hash"),
            "adapters_name_version_unique" => (StatusCode::CONFLICT, "duplicate", "version"),
            "adapters_name_format" => (StatusCode::BAD_REQUEST, "invalid_field", "name"),
            "adapters_artifact_uri_relative" => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "artifact_outside_root",
                "artifact_uri",
            ),
            "adapters_alpha_finite_positive" => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_adapter_config",
                "adapter_config.json.lora_alpha",
            ),
            "routes_model_name_format" => (StatusCode::BAD_REQUEST, "invalid_field", "model"),
            "route_weights_adapter_active" => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "adapter_retired",
                "weights",
            ),
            "route_weights_adapter_tenant" => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "adapter_of_another_tenant",
                "weights",
            ),
            "route_weights_adapter_same_base_fk" => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "mixed_base_models",
                "weights",
            ),
            "route_revisions_weights_sum_10000" => {
                (StatusCode::UNPROCESSABLE_ENTITY, "weights_sum", "weights")
            }
            "api_keys_expiry_after_creation" => {
                (StatusCode::BAD_REQUEST, "invalid_field", "expires_at")
            }
            _ => return AdminError::internal(e),
        };
        return AdminError::new(status, code, Some(param), format!("{param}: {message}"));
    }
    if matches!(e, sqlx::Error::PoolTimedOut | sqlx::Error::Io(_)) {
        return AdminError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "database_unavailable",
            None,
            format!("the registry database is unavailable: {e}"),
        );
    }
    AdminError::internal(e)
}

/// Parses a JSON body, naming the field that is wrong.
pub(super) fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, AdminError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            AdminError::field("body", format!("is not a valid JSON object: {inner}"))
        } else {
            AdminError::field(&path, inner.to_string())
        }
    })
}
