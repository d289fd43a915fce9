//! The admin plane's usage report: every tenant's, from the rollups
//! ([`crate::usage`]).

use super::*;
use crate::usage::{Grouping, UsageError, UsageQuery};

/// `GET /admin/v1/usage?from&to&group_by&tenant`: usage over `[from, to)`
/// (RFC 3339; at most 366 days), grouped by any of `tenant`, `route`,
/// `adapter` and one period, `day` or `hour` (UTC); evaluation traffic is
/// always a group of its own.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageReport {
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    /// Comma-separated; none: one row per kind of traffic.
    pub group_by: Option<String>,
    pub tenant: Option<Uuid>,
}

impl Query for UsageReport {
    type Output = UsageList;
    const NEED: Need = Need::Audit;

    async fn run(self, s: &AdminState) -> Result<UsageList, AdminError> {
        let grouping = Grouping::parse(
            self.group_by.as_deref(),
            &["tenant", "route", "adapter", "day", "hour"],
        )
        .map_err(refused)?;
        let rows = UsageQuery::new(self.from, self.to, grouping, self.tenant)
            .map_err(refused)?
            .rows(&s.pool)
            .await
            .map_err(refused)?;
        Ok(UsageList { rows })
    }
}

/// A refused report as the admin API says it.
fn refused(e: UsageError) -> AdminError {
    match e {
        UsageError::Field { field, reason } => AdminError::field(field, reason),
        UsageError::Db(e) => db_error(e),
    }
}
