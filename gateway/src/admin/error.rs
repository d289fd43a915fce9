//! The admin API's errors: every stable code is an [`AdminCode`], mapped in
//! one exhaustive place ([`AdminCode::status`]) to its HTTP status, and the
//! error type OpenAI-style clients read from the status.

use super::*;

/// A stable error code of the admin API; it decides the HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum AdminCode {
    AdapterInUse,
    AdapterOfAnotherTenant,
    AdapterRetired,
    ArtifactNotFound,
    ArtifactOutsideRoot,
    ArtifactUnreadable,
    ArtifactTooLarge,
    BaseModelMismatch,
    DatabaseUnavailable,
    Duplicate,
    EtagRequired,
    InsufficientRole,
    InternalError,
    InvalidAdapterConfig,
    InvalidAdapterWeights,
    InvalidAdminToken,
    InvalidArtifactUri,
    InvalidField,
    MixedBaseModels,
    NoArtifactRoot,
    NoChange,
    NoPreviousRevision,
    NotFound,
    NoActiveRollout,
    RankTooLarge,
    RolloutActive,
    RolloutNeedsOneVersion,
    StaleEtag,
    UnknownAdapter,
    WeightsSum,
}

impl AdminCode {
    /// Every code.
    #[cfg(test)]
    pub const ALL: [AdminCode; 30] = [
        AdminCode::AdapterInUse,
        AdminCode::AdapterOfAnotherTenant,
        AdminCode::AdapterRetired,
        AdminCode::ArtifactNotFound,
        AdminCode::ArtifactOutsideRoot,
        AdminCode::ArtifactUnreadable,
        AdminCode::ArtifactTooLarge,
        AdminCode::BaseModelMismatch,
        AdminCode::DatabaseUnavailable,
        AdminCode::Duplicate,
        AdminCode::EtagRequired,
        AdminCode::InsufficientRole,
        AdminCode::InternalError,
        AdminCode::InvalidAdapterConfig,
        AdminCode::InvalidAdapterWeights,
        AdminCode::InvalidAdminToken,
        AdminCode::InvalidArtifactUri,
        AdminCode::InvalidField,
        AdminCode::MixedBaseModels,
        AdminCode::NoArtifactRoot,
        AdminCode::NoChange,
        AdminCode::NoPreviousRevision,
        AdminCode::NotFound,
        AdminCode::NoActiveRollout,
        AdminCode::RankTooLarge,
        AdminCode::RolloutActive,
        AdminCode::RolloutNeedsOneVersion,
        AdminCode::StaleEtag,
        AdminCode::UnknownAdapter,
        AdminCode::WeightsSum,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            AdminCode::AdapterInUse => "adapter_in_use",
            AdminCode::AdapterOfAnotherTenant => "adapter_of_another_tenant",
            AdminCode::AdapterRetired => "adapter_retired",
            AdminCode::ArtifactNotFound => "artifact_not_found",
            AdminCode::ArtifactOutsideRoot => "artifact_outside_root",
            AdminCode::ArtifactUnreadable => "artifact_unreadable",
            AdminCode::ArtifactTooLarge => "artifact_too_large",
            AdminCode::BaseModelMismatch => "base_model_mismatch",
            AdminCode::DatabaseUnavailable => "database_unavailable",
            AdminCode::Duplicate => "duplicate",
            AdminCode::EtagRequired => "etag_required",
            AdminCode::InsufficientRole => "insufficient_role",
            AdminCode::InternalError => "internal_error",
            AdminCode::InvalidAdapterConfig => "invalid_adapter_config",
            AdminCode::InvalidAdapterWeights => "invalid_adapter_weights",
            AdminCode::InvalidAdminToken => "invalid_admin_token",
            AdminCode::InvalidArtifactUri => "invalid_artifact_uri",
            AdminCode::InvalidField => "invalid_field",
            AdminCode::MixedBaseModels => "mixed_base_models",
            AdminCode::NoArtifactRoot => "no_artifact_root",
            AdminCode::NoChange => "no_change",
            AdminCode::NoPreviousRevision => "no_previous_revision",
            AdminCode::NotFound => "not_found",
            AdminCode::NoActiveRollout => "no_active_rollout",
            AdminCode::RankTooLarge => "rank_too_large",
            AdminCode::RolloutActive => "rollout_active",
            AdminCode::RolloutNeedsOneVersion => "rollout_needs_one_version",
            AdminCode::StaleEtag => "stale_etag",
            AdminCode::UnknownAdapter => "unknown_adapter",
            AdminCode::WeightsSum => "weights_sum",
        }
    }

    /// The one mapping from a code to its status.
    pub const fn status(self) -> StatusCode {
        match self {
            AdminCode::AdapterInUse => StatusCode::CONFLICT,
            AdminCode::AdapterOfAnotherTenant => StatusCode::UNPROCESSABLE_ENTITY,
            AdminCode::AdapterRetired => StatusCode::UNPROCESSABLE_ENTITY,
            AdminCode::ArtifactNotFound => StatusCode::UNPROCESSABLE_ENTITY,
            AdminCode::ArtifactOutsideRoot => StatusCode::UNPROCESSABLE_ENTITY,
            AdminCode::ArtifactUnreadable => StatusCode::UNPROCESSABLE_ENTITY,
            AdminCode::ArtifactTooLarge => StatusCode::UNPROCESSABLE_ENTITY,
            AdminCode::BaseModelMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            AdminCode::DatabaseUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            AdminCode::Duplicate => StatusCode::CONFLICT,
            AdminCode::EtagRequired => StatusCode::PRECONDITION_REQUIRED,
            AdminCode::InsufficientRole => StatusCode::FORBIDDEN,
            AdminCode::InternalError => StatusCode::INTERNAL_SERVER_ERROR,
            AdminCode::InvalidAdapterConfig => StatusCode::UNPROCESSABLE_ENTITY,
            AdminCode::InvalidAdapterWeights => StatusCode::UNPROCESSABLE_ENTITY,
            AdminCode::InvalidAdminToken => StatusCode::UNAUTHORIZED,
            AdminCode::InvalidArtifactUri => StatusCode::UNPROCESSABLE_ENTITY,
            AdminCode::InvalidField => StatusCode::BAD_REQUEST,
            AdminCode::MixedBaseModels => StatusCode::UNPROCESSABLE_ENTITY,
            AdminCode::NoArtifactRoot => StatusCode::SERVICE_UNAVAILABLE,
            AdminCode::NoChange => StatusCode::CONFLICT,
            AdminCode::NoPreviousRevision => StatusCode::CONFLICT,
            AdminCode::NotFound => StatusCode::NOT_FOUND,
            AdminCode::NoActiveRollout => StatusCode::CONFLICT,
            AdminCode::RankTooLarge => StatusCode::UNPROCESSABLE_ENTITY,
            AdminCode::RolloutActive => StatusCode::CONFLICT,
            AdminCode::RolloutNeedsOneVersion => StatusCode::CONFLICT,
            AdminCode::StaleEtag => StatusCode::PRECONDITION_FAILED,
            AdminCode::UnknownAdapter => StatusCode::UNPROCESSABLE_ENTITY,
            AdminCode::WeightsSum => StatusCode::UNPROCESSABLE_ENTITY,
        }
    }
}

/// An error response: `{"error": {"message", "type", "code", "param"}}`.
#[derive(Debug)]
pub struct AdminError {
    pub(super) code: AdminCode,
    pub(super) param: Option<String>,
    pub(super) message: String,
}

impl AdminError {
    /// What went wrong, as the admin API would say it.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The stable code, which decides the status.
    pub fn code(&self) -> AdminCode {
        self.code
    }

    /// The field at fault, if one is.
    pub fn param(&self) -> Option<&str> {
        self.param.as_deref()
    }

    pub(super) fn new(code: AdminCode, param: Option<&str>, message: String) -> AdminError {
        AdminError {
            code,
            param: param.map(str::to_owned),
            message,
        }
    }

    pub(super) fn status(&self) -> StatusCode {
        self.code.status()
    }

    /// A field that is malformed: 400.
    pub(super) fn field(param: &str, message: impl Into<String>) -> AdminError {
        AdminError::new(
            AdminCode::InvalidField,
            Some(param),
            format!("{param}: {}", message.into()),
        )
    }

    /// Well-formed but refused by a rule: 422.
    pub(super) fn unprocessable(
        code: AdminCode,
        param: &str,
        message: impl Into<String>,
    ) -> AdminError {
        debug_assert_eq!(code.status(), StatusCode::UNPROCESSABLE_ENTITY, "{code:?}");
        AdminError::new(code, Some(param), format!("{param}: {}", message.into()))
    }

    pub(super) fn not_found(param: &str, what: impl Into<String>) -> AdminError {
        AdminError::new(
            AdminCode::NotFound,
            Some(param),
            format!("{param}: {} does not exist", what.into()),
        )
    }

    pub(super) fn conflict(code: AdminCode, param: &str, message: impl Into<String>) -> AdminError {
        debug_assert_eq!(code.status(), StatusCode::CONFLICT, "{code:?}");
        AdminError::new(code, Some(param), format!("{param}: {}", message.into()))
    }

    pub(super) fn internal(e: impl std::fmt::Display) -> AdminError {
        tracing::error!(error = %e, "admin request failed");
        AdminError::new(
            AdminCode::InternalError,
            None,
            format!("internal error: {e}"),
        )
    }
}

impl IntoResponse for AdminError {
    fn into_response(self) -> Response {
        let status = self.status();
        let kind = match status.as_u16() {
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
            "code": self.code.as_str(),
            "param": self.param,
        }});
        (status, axum::Json(body)).into_response()
    }
}

/// Maps a database error to the field it concerns, using the schema's
/// named constraints; anything else is a 500 (or 503 when Postgres is away).
pub(super) fn db_error(e: sqlx::Error) -> AdminError {
    if let sqlx::Error::Database(d) = &e
        && let Some(constraint) = d.constraint()
    {
        let message = d.message().to_owned();
        let (code, param) = match constraint {
            "tenants_name_unique" => (AdminCode::Duplicate, "name"),
            "tenants_name_format" => (AdminCode::InvalidField, "name"),
            "tenants_rpm_limit_positive" => (AdminCode::InvalidField, "rpm_limit"),
            "tenants_tpm_limit_positive" => (AdminCode::InvalidField, "tpm_limit"),
            "tenants_weight_range" => (AdminCode::InvalidField, "weight"),
            "base_models_name_unique" => (AdminCode::Duplicate, "name"),
            "base_models_base_hash_unique" => (AdminCode::Duplicate, "base_hash"),
            "adapters_name_version_unique" => (AdminCode::Duplicate, "version"),
            "adapters_name_format" => (AdminCode::InvalidField, "name"),
            "adapters_artifact_uri_relative" => (AdminCode::ArtifactOutsideRoot, "artifact_uri"),
            "adapters_alpha_finite_positive" => (
                AdminCode::InvalidAdapterConfig,
                "adapter_config.json.lora_alpha",
            ),
            "routes_model_name_format" => (AdminCode::InvalidField, "model"),
            "route_weights_adapter_active" => (AdminCode::AdapterRetired, "weights"),
            "route_weights_adapter_tenant" => (AdminCode::AdapterOfAnotherTenant, "weights"),
            "route_weights_adapter_same_base_fk" => (AdminCode::MixedBaseModels, "weights"),
            "route_revisions_weights_sum_10000" => (AdminCode::WeightsSum, "weights"),
            "api_keys_expiry_after_creation" => (AdminCode::InvalidField, "expires_at"),
            "eval_sets_name_format" => (AdminCode::InvalidField, "name"),
            "eval_sets_name_version_unique" => (AdminCode::Duplicate, "name"),
            "rollouts_one_active_per_route" => (AdminCode::RolloutActive, "model"),
            "prices_whole_hours" => (AdminCode::InvalidField, "effective_at"),
            "prices_one_per_time" => (AdminCode::Duplicate, "effective_at"),
            _ => return AdminError::internal(e),
        };
        return AdminError::new(code, Some(param), format!("{param}: {message}"));
    }
    if matches!(e, sqlx::Error::PoolTimedOut | sqlx::Error::Io(_)) {
        return AdminError::new(
            AdminCode::DatabaseUnavailable,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_is_unique_and_has_one_status() {
        let names: std::collections::BTreeSet<&str> =
            AdminCode::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(names.len(), AdminCode::ALL.len());
        for c in AdminCode::ALL {
            let status = c.status();
            assert!(
                status.is_client_error() || status.is_server_error(),
                "{c:?}: {status}"
            );
            assert!(
                c.as_str()
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'_')
            );
        }
        assert_eq!(
            AdminCode::StaleEtag.status(),
            StatusCode::PRECONDITION_FAILED
        );
        assert_eq!(AdminCode::Duplicate.status(), StatusCode::CONFLICT);
    }
}
