//! The admin API, under `/admin/v1` on its own listen address: tenants, API
//! keys, base models, adapter versions, routes, canaries and progressive
//! rollouts, the fleet view, and audit-log queries.
//!
//! - Callers present an admin JWT whose `role` claim is `admin` (every
//!   operation), `auditor` (reads and audit queries) or `viewer` (reads).
//! - Every change runs in one transaction that also writes its
//!   `admin_changes` row (who, what, when, before and after). After commit
//!   this replica reloads its registry snapshot and the change is announced
//!   on Redis, so the other replicas reload within moments.
//! - Route changes are optimistic: a route's etag is its current revision,
//!   and a change must send `If-Match` with it.
//! - Errors use the OpenAI shape, with `param` naming the field at fault.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use lorafleet_artifact::adapter::{AdapterConfig, AdapterError, saved, tensors};
use lorafleet_artifact::model_config::Architecture;
use lorafleet_artifact::roots::{ArtifactError, ArtifactRoots};
use lorafleet_artifact::safetensors_header;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::{PgPool, Postgres, QueryBuilder, Transaction};
use uuid::Uuid;

use crate::auth::{self, JwtConfig};
use crate::registry::{self, Registry};
use crate::router::fleet::Fleet;
use types::*;

/// SQL assembled from this module's own constants (column lists, a lock
/// clause), never from input: input always travels as bind parameters.
macro_rules! sql {
    ($($t:tt)*) => {
        sqlx::AssertSqlSafe(format!($($t)*))
    };
}

/// Admin roles, from the token's `role` claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Admin,
    Auditor,
    Viewer,
}

/// What an operation needs of the caller's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    Read,
    Audit,
    Write,
}

impl Role {
    fn parse(s: &str) -> Option<Role> {
        match s {
            "admin" => Some(Role::Admin),
            "auditor" => Some(Role::Auditor),
            "viewer" => Some(Role::Viewer),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Auditor => "auditor",
            Role::Viewer => "viewer",
        }
    }

    /// May this role change the registry?
    pub fn can_write(self) -> bool {
        self.allows(Need::Write)
    }

    /// May this role query the audit log and the change log?
    pub fn can_audit(self) -> bool {
        self.allows(Need::Audit)
    }

    /// The one rule: what each role may do.
    pub fn allows(self, need: Need) -> bool {
        match self {
            Role::Admin => true,
            Role::Auditor => need != Need::Write,
            Role::Viewer => need == Need::Read,
        }
    }
}

/// Everything the admin API needs. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AdminState {
    pub pool: PgPool,
    pub registry: Registry,
    pub redis: Option<redis::aio::ConnectionManager>,
    /// The registry change channel.
    pub channel: String,
    pub jwt: Arc<JwtConfig>,
    /// Where adapter artifacts live; None turns adapter registration off.
    pub artifact_roots: Option<Arc<ArtifactRoots>>,
    /// The object stores `s3://` artifacts may be registered from.
    pub artifact_stores: lorafleet_store::ObjectStores,
    /// The largest LoRA rank any worker pool accepts.
    pub max_lora_rank: usize,
    pub fleet: Fleet,
}

// One file per resource, declared after `sql!`, which they use (a macro is
// in scope only below its definition).
/// An audit `cursor` parameter decoded and encoded again, or why it is
/// refused (for the fuzz target).
#[doc(hidden)]
pub fn audit_cursor(s: &str) -> Result<String, AdminError> {
    audit::Cursor::decode(s).map(|c| c.encode())
}

mod actor;
mod adapters;
mod audit;
mod base_models;
mod changes;
mod core;
mod error;
mod evals;
mod fleet;
mod http;
mod keys;
mod prices;
mod rollouts;
mod routes;
mod tenants;
mod tokens;
pub mod types;
mod usage;

use base_models::*;
use error::*;
use rollouts::*;
use routes::*;
use tenants::*;

pub use actor::{Identity, identify};
pub use adapters::{
    ListAdapters, RegisterAdapter, RetireAdapter, artifact_roots, parse_lora_int_id,
};
pub use audit::{
    AuditFilter, AuditPage, AuditQuery, AuditRow, Cursor, ExportAudit, ExportStream,
    ListAuditPartitions, SearchAudit,
};
pub use base_models::{ListBaseModels, RegisterBaseModel};
pub use changes::ListChanges;
pub use core::{Caller, Command, Cx, Query};
pub use error::{AdminCode, AdminError};
pub use evals::{ListEvalSets, RegisterEvalSet};
pub use fleet::{FleetView, TRAFFIC_SQL as FLEET_TRAFFIC_SQL};
pub use http::router;
pub use keys::{CreateKey, ListKeys, RevokeKey};
pub use prices::{ListPrices, SetPrice};
pub use rollouts::WINDOW_SQL as ROLLOUT_WINDOW_SQL;
pub use rollouts::{
    ChangeRollout, ConcludeEvaluation, EvaluationWork, GetRollout, StartRollout, record_outcome,
};
pub use routes::{GetRoute, ListRoutes, Promote, PutRoute, Rollback, RouteWritten, parse_etag};
pub use tenants::{CreateTenant, GetTenant, ListTenants, SetTenantDisabled, UpdateTenant};
pub use tokens::{RevokeAdminToken, RevokeOwnToken, RevokeTenantToken};
pub use usage::UsageReport;
