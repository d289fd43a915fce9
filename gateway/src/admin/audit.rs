//! Audit queries: filters, keyset pages and streamed exports.

use super::*;

/// Filters of `GET /admin/v1/audit`; all optional, combined with AND.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditFilter {
    pub tenant: Option<String>,
    /// An API key prefix.
    pub api_key: Option<String>,
    pub model: Option<String>,
    /// An adapter name, or `name:version`.
    pub adapter: Option<String>,
    pub lora_int_id: Option<i64>,
    pub worker: Option<String>,
    pub status: Option<String>,
    pub request_id: Option<Uuid>,
    /// RFC 3339; inclusive.
    pub since: Option<DateTime<Utc>>,
    /// RFC 3339; exclusive.
    pub until: Option<DateTime<Utc>>,
    /// Rows per page, 1 to 1000 (default 100).
    pub limit: Option<u32>,
    /// A client address (see `--trusted-proxies`): its requests and its
    /// failed authentications.
    pub client: Option<std::net::IpAddr>,
    /// The `next_cursor` of the previous page.
    pub cursor: Option<String>,
    /// json (one page, default), jsonl or csv (every matching row).
    pub format: Option<String>,
}

/// One audit row as compliance sees it.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct AuditRow {
    pub id: i64,
    pub request_id: Uuid,
    pub received_at: DateTime<Utc>,
    pub completed_at: DateTime<Utc>,
    pub tenant: Option<String>,
    pub api_key: Option<String>,
    pub subject: Option<String>,
    /// The OpenAI `user` field the request sent.
    pub user: Option<String>,
    pub model: String,
    pub route_revision: Option<i32>,
    pub lora_int_id: Option<i64>,
    pub adapter_name: Option<String>,
    pub adapter_version: Option<i32>,
    pub base_hash: Option<String>,
    pub worker_id: Option<String>,
    pub adapter_residency: Option<String>,
    pub status: String,
    pub http_status: i16,
    pub error_code: Option<String>,
    pub finish_reason: Option<String>,
    pub prompt_tokens: i32,
    pub completion_tokens: i32,
    /// Of the prompt tokens, those the worker's prefix cache served.
    pub cached_tokens: i32,
    /// The API features the request used, comma-separated.
    pub features: String,
    pub latency_us: i64,
    pub ttft_us: Option<i64>,
    pub attempts: i16,
    /// The client's address.
    pub client: Option<String>,
    /// The requests this row stands for: 1, or one source's failed
    /// authentications in one window.
    pub occurrences: i32,
    /// Of such a row, the last API key prefix seen (`api_key` is the
    /// first).
    pub last_api_key: Option<String>,
}

pub(super) const AUDIT_COLUMNS: &[&str] = &[
    "id",
    "request_id",
    "received_at",
    "completed_at",
    "tenant",
    "api_key",
    "subject",
    "user",
    "model",
    "route_revision",
    "lora_int_id",
    "adapter_name",
    "adapter_version",
    "base_hash",
    "worker_id",
    "adapter_residency",
    "status",
    "http_status",
    "error_code",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "features",
    "latency_us",
    "ttft_us",
    "attempts",
    "client",
    "occurrences",
    "last_api_key",
];

/// A validated audit query, ready to run page by page.
#[derive(Debug, Clone)]
pub struct AuditQuery {
    pub(super) tenant: Option<Uuid>,
    pub(super) api_key: Option<Uuid>,
    pub(super) model: Option<String>,
    /// With an adapter filter: the `lora_int_id`s registered under its
    /// name (and version).
    pub(super) adapter_ids: Option<Vec<i64>>,
    pub(super) lora_int_id: Option<i64>,
    pub(super) worker: Option<String>,
    pub(super) status: Option<String>,
    pub(super) request_id: Option<Uuid>,
    pub(super) client: Option<std::net::IpAddr>,
    pub(super) since: Option<DateTime<Utc>>,
    pub(super) until: Option<DateTime<Utc>>,
    pub limit: i64,
}

/// Keyset position: rows strictly older than (received_at, id).
#[derive(Debug, Clone, Copy)]
pub struct Cursor {
    pub(super) received_at: DateTime<Utc>,
    pub(super) id: i64,
}

impl Cursor {
    pub fn encode(&self) -> String {
        format!("{}_{}", self.received_at.timestamp_micros(), self.id)
    }

    pub fn decode(s: &str) -> Result<Cursor, AdminError> {
        let bad = || {
            AdminError::field(
                "cursor",
                format!("{s:?} is not a cursor from a previous page"),
            )
        };
        let (t, id) = s.split_once('_').ok_or_else(bad)?;
        let micros: i64 = t.parse().map_err(|_| bad())?;
        let id: i64 = id.parse().map_err(|_| bad())?;
        Ok(Cursor {
            received_at: DateTime::from_timestamp_micros(micros).ok_or_else(bad)?,
            id,
        })
    }
}

impl AuditQuery {
    /// Checks the filters and resolves names to ids.
    pub async fn new(pool: &PgPool, f: &AuditFilter) -> Result<AuditQuery, AdminError> {
        let tenant = match &f.tenant {
            Some(t) => Some(tenant_id(pool, t, "tenant").await?),
            None => None,
        };
        let api_key = match &f.api_key {
            Some(p) => Some(
                sqlx::query_scalar::<_, Uuid>("SELECT id FROM api_keys WHERE prefix = $1")
                    .bind(p)
                    .fetch_optional(pool)
                    .await
                    .map_err(db_error)?
                    .ok_or_else(|| AdminError::not_found("api_key", format!("API key {p:?}")))?,
            ),
            None => None,
        };
        let adapter = match &f.adapter {
            None => None,
            Some(a) => match a.rsplit_once(':') {
                Some((name, v)) => {
                    let v: i32 = v.parse().ok().filter(|v| *v > 0).ok_or_else(|| {
                        AdminError::field(
                            "adapter",
                            format!("{a:?}: the version after ':' must be a positive integer"),
                        )
                    })?;
                    Some((name.to_owned(), Some(v)))
                }
                None => Some((a.clone(), None)),
            },
        };
        // Adapter versions are never deleted nor renamed, and a row copies
        // the id with the name, so the ids registered under the name are
        // exactly those its rows can hold: the query then walks the
        // adapter's index instead of every row of the tenant's range.
        let adapter_ids: Option<Vec<i64>> = match &adapter {
            None => None,
            Some((name, version)) => Some(
                sqlx::query_scalar(
                    "SELECT lora_int_id FROM adapters
                  WHERE name = $1 AND ($2::INT4 IS NULL OR version = $2)",
                )
                .bind(name)
                .bind(*version)
                .fetch_all(pool)
                .await
                .map_err(db_error)?,
            ),
        };
        if let Some(st) = &f.status
            && crate::audit::AuditStatus::parse(st).is_none()
        {
            return Err(AdminError::field(
                "status",
                format!("{st:?} is not ok, cancelled, rejected or error"),
            ));
        }
        if let (Some(a), Some(b)) = (f.since, f.until)
            && a >= b
        {
            return Err(AdminError::field("until", "must be after since"));
        }
        let limit = f.limit.unwrap_or(100);
        if !(1..=1000).contains(&limit) {
            return Err(AdminError::field(
                "limit",
                format!("{limit} must be between 1 and 1000"),
            ));
        }
        Ok(AuditQuery {
            tenant,
            api_key,
            model: f.model.clone(),
            adapter_ids,
            lora_int_id: f.lora_int_id,
            worker: f.worker.clone(),
            status: f.status.clone(),
            request_id: f.request_id,
            client: f.client,
            since: f.since,
            until: f.until,
            limit: i64::from(limit),
        })
    }

    /// One page, newest first, after `cursor`. The cursor of the next page
    /// is Some when this page is full.
    pub async fn page(
        &self,
        pool: &PgPool,
        cursor: Option<Cursor>,
    ) -> Result<(Vec<AuditRow>, Option<Cursor>), sqlx::Error> {
        let mut q = self.select("", cursor);
        let rows: Vec<AuditRow> = q.build_query_as().fetch_all(pool).await?;
        let next = if rows.len() as i64 == self.limit {
            rows.last().map(|r| Cursor {
                received_at: r.received_at,
                id: r.id,
            })
        } else {
            None
        };
        Ok((rows, next))
    }

    /// Postgres's plan of [`page`](Self::page) (`EXPLAIN` in text form):
    /// which partitions of the log it reads.
    pub async fn explain(
        &self,
        pool: &PgPool,
        cursor: Option<Cursor>,
    ) -> Result<String, sqlx::Error> {
        let mut q = self.select("EXPLAIN ", cursor);
        let lines: Vec<String> = q.build_query_scalar().fetch_all(pool).await?;
        Ok(lines.join("\n"))
    }

    /// The page's query. Every bound on time is also a bound on
    /// `received_at` alone (the partition key), so that Postgres reads only
    /// the partitions that can hold the page: the cursor's time, and the
    /// time a UUIDv7 request id was minted (the gateway mints it on
    /// receipt).
    fn select(&self, prefix: &'static str, cursor: Option<Cursor>) -> QueryBuilder<Postgres> {
        let mut q: QueryBuilder<Postgres> = QueryBuilder::new(prefix);
        q.push(
            "SELECT l.id, l.request_id, l.received_at, l.completed_at, t.name AS tenant,
                    COALESCE(l.api_key_prefix, k.prefix) AS api_key, l.subject,
                    l.end_user AS user, l.model_name AS model, l.route_revision,
                    l.lora_int_id, l.adapter_name, l.adapter_version, l.base_hash, l.worker_id,
                    l.adapter_residency, l.status::TEXT AS status, l.http_status, l.error_code,
                    l.finish_reason, l.prompt_tokens, l.completion_tokens, l.cached_tokens, l.features, l.latency_us,
                    l.ttft_us, l.attempts, host(l.client_addr) AS client, l.occurrences,
                    l.last_key_prefix AS last_api_key
             FROM audit_log l
             LEFT JOIN tenants t ON t.id = l.tenant_id
             LEFT JOIN api_keys k ON k.id = l.api_key_id
             WHERE TRUE",
        );
        if let Some(v) = self.tenant {
            q.push(" AND l.tenant_id = ").push_bind(v);
        }
        if let Some(v) = self.api_key {
            q.push(" AND l.api_key_id = ").push_bind(v);
        }
        if let Some(v) = &self.model {
            q.push(" AND l.model_name = ").push_bind(v.clone());
        }
        if let Some(ids) = &self.adapter_ids {
            // The ids alone: a row copies the id with the name and version,
            // so they say the same, and a name or version beside them would
            // make Postgres take the rows as a thousandfold rarer than they
            // are and read all of the adapter's rows of the range to sort
            // them. One id (the common case) is an equality, which the
            // `(lora_int_id, received_at DESC, id DESC)` index serves in page
            // order, stopping after the page.
            match ids.as_slice() {
                [id] => {
                    q.push(" AND l.lora_int_id = ").push_bind(*id);
                }
                ids => {
                    q.push(" AND l.lora_int_id = ANY(")
                        .push_bind(ids.to_vec())
                        .push(")");
                }
            }
        }
        if let Some(v) = self.lora_int_id {
            q.push(" AND l.lora_int_id = ").push_bind(v);
        }
        if let Some(v) = &self.worker {
            q.push(" AND l.worker_id = ").push_bind(v.clone());
        }
        if let Some(v) = &self.status {
            q.push(" AND l.status = ")
                .push_bind(v.clone())
                .push("::audit_status");
        }
        if let Some(v) = self.request_id {
            q.push(" AND l.request_id = ").push_bind(v);
            if let Some(minted) = minted_at(v) {
                q.push(" AND l.received_at >= ")
                    .push_bind(minted - REQUEST_ID_SLACK)
                    .push(" AND l.received_at < ")
                    .push_bind(minted + REQUEST_ID_SLACK);
            }
        }
        if let Some(v) = self.client {
            q.push(" AND l.client_addr = ")
                .push_bind(v.to_string())
                .push("::inet");
        }
        if let Some(v) = self.since {
            q.push(" AND l.received_at >= ").push_bind(v);
        }
        if let Some(v) = self.until {
            q.push(" AND l.received_at < ").push_bind(v);
        }
        if let Some(c) = cursor {
            q.push(" AND l.received_at <= ")
                .push_bind(c.received_at)
                .push(" AND (l.received_at, l.id) < (")
                .push_bind(c.received_at)
                .push(", ")
                .push_bind(c.id)
                .push(")");
        }
        q.push(" ORDER BY l.received_at DESC, l.id DESC LIMIT ")
            .push_bind(self.limit);
        q
    }
}

/// `GET /admin/v1/audit/partitions`: the log's partitions, oldest first,
/// and the replica maintaining them. Takes no filters.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListAuditPartitions {}

impl Query for ListAuditPartitions {
    type Output = AuditPartitions;
    const NEED: Need = Need::Audit;

    async fn run(self, s: &AdminState) -> Result<AuditPartitions, AdminError> {
        use crate::audit::partitions;
        let partitions = partitions::list(&s.pool)
            .await
            .map_err(db_error)?
            .into_iter()
            .map(|p| AuditPartition {
                name: p.name,
                from_time: p.from_time,
                to_time: p.to_time,
                estimated_rows: p.estimated_rows,
            })
            .collect();
        let lease: Option<(String, DateTime<Utc>)> =
            sqlx::query_as("SELECT holder, expires_at FROM controller_leases WHERE name = $1")
                .bind(partitions::LEASE)
                .fetch_optional(&s.pool)
                .await
                .map_err(db_error)?;
        let (maintainer, maintainer_lease_expires_at) = lease.unzip();
        Ok(AuditPartitions {
            partitions,
            maintainer,
            maintainer_lease_expires_at,
        })
    }
}

/// How far a row's `received_at` may be from its UUIDv7 request id's time:
/// the gateway mints the id on receipt (a failed-authentication row's, at
/// the window's first failure), so seconds apart at most; an hour is room
/// for any clock step.
const REQUEST_ID_SLACK: chrono::TimeDelta = chrono::TimeDelta::hours(1);

/// When a UUIDv7 was minted; None for any other version.
fn minted_at(id: Uuid) -> Option<DateTime<Utc>> {
    if id.get_version_num() != 7 {
        return None;
    }
    let (secs, nanos) = id.get_timestamp()?.to_unix();
    DateTime::from_timestamp(i64::try_from(secs).ok()?, nanos)
}

/// One CSV cell. A text cell that a spreadsheet would read as a formula
/// (it starts with `=`, `+`, `-`, `@`, a tab or a carriage return) gets a
/// leading `'`, so opening an export never runs what a client sent.
pub(super) fn csv_field(v: &Value) -> String {
    let s = match v {
        Value::Null => return String::new(),
        Value::String(s) if s.starts_with(['=', '+', '-', '@', '\t', '\r']) => format!("'{s}"),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s
    }
}

pub(super) fn csv_line(row: &AuditRow) -> String {
    let v = to_json(row);
    let mut line = AUDIT_COLUMNS
        .iter()
        .map(|c| csv_field(&v[*c]))
        .collect::<Vec<_>>()
        .join(",");
    line.push('\n');
    line
}

/// One page of the audit log, newest first, and the cursor of the next.
#[derive(Debug)]
pub struct SearchAudit(pub AuditFilter);

/// A page of audit rows.
#[derive(Debug, Serialize)]
pub struct AuditPage {
    pub rows: Vec<AuditRow>,
    pub next_cursor: Option<String>,
}

impl Query for SearchAudit {
    type Output = AuditPage;
    const NEED: Need = Need::Audit;

    async fn run(self, s: &AdminState) -> Result<AuditPage, AdminError> {
        let q = AuditQuery::new(&s.pool, &self.0).await?;
        let cursor = self.0.cursor.as_deref().map(Cursor::decode).transpose()?;
        let (rows, next) = q.page(&s.pool, cursor).await.map_err(db_error)?;
        Ok(AuditPage {
            rows,
            next_cursor: next.map(|c| c.encode()),
        })
    }
}

/// Every matching audit row, streamed page by page as CSV (with a header
/// line) or JSON lines, so an export's size is not bounded by memory. A
/// database failure midway ends the stream with an error, so the client
/// sees a failed transfer rather than a short export.
#[derive(Debug)]
pub struct ExportAudit {
    pub filter: AuditFilter,
    pub csv: bool,
}

/// An export's bytes as they are read.
pub type ExportStream = tokio_stream::wrappers::ReceiverStream<Result<Bytes, std::io::Error>>;

impl Query for ExportAudit {
    type Output = ExportStream;
    const NEED: Need = Need::Audit;

    async fn run(self, s: &AdminState) -> Result<ExportStream, AdminError> {
        let mut q = AuditQuery::new(&s.pool, &self.filter).await?;
        let mut cursor = self
            .filter
            .cursor
            .as_deref()
            .map(Cursor::decode)
            .transpose()?;
        let csv = self.csv;
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
        let pool = s.pool.clone();
        q.limit = 1000;
        tokio::spawn(async move {
            if csv {
                let _ = tx
                    .send(Ok(Bytes::from(format!("{}\n", AUDIT_COLUMNS.join(",")))))
                    .await;
            }
            loop {
                match q.page(&pool, cursor).await {
                    Ok((rows, next)) => {
                        let mut chunk = String::new();
                        for r in &rows {
                            if csv {
                                chunk.push_str(&csv_line(r));
                            } else {
                                chunk.push_str(&to_json(r).to_string());
                                chunk.push('\n');
                            }
                        }
                        if tx.send(Ok(Bytes::from(chunk))).await.is_err() {
                            return;
                        }
                        match next {
                            Some(c) => cursor = Some(c),
                            None => return,
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
                        return;
                    }
                }
            }
        });
        Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
    }
}

#[cfg(test)]
mod csv_tests {
    use super::*;

    #[test]
    fn csv_cells_that_look_like_formulas_are_neutralised() {
        for (cell, want) in [
            ("=HYPERLINK(\"x\")", "\"'=HYPERLINK(\"\"x\"\")\""),
            ("+1", "'+1"),
            ("-2", "'-2"),
            ("@SUM(A1)", "'@SUM(A1)"),
            ("\tx", "'\tx"),
            ("plain", "plain"),
        ] {
            assert_eq!(csv_field(&Value::String(cell.into())), want, "{cell:?}");
        }
        // Numbers are numbers, not client text.
        assert_eq!(csv_field(&json!(-5)), "-5");
        assert_eq!(csv_field(&Value::Null), "");
    }
}
