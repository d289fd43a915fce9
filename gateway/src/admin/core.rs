//! The admin plane's core: every change is a typed [`Command`], every read
//! a typed [`Query`], and [`AdminState::exec`] / [`AdminState::read`] are
//! the only ways to run them.
//!
//! - **Authorised in one place**: `exec` and `read` check the caller's role
//!   against what the operation needs ([`Role::allows`]) before it runs.
//! - **One transaction per command, with its change record**: a command
//!   works inside the transaction `exec` gives it ([`Cx::db`]) and states
//!   what it changed ([`Cx::record`]); `exec` writes those `admin_changes`
//!   rows in the same transaction, commits, reloads this replica's registry
//!   and announces the change to the others. A command that records nothing
//!   changed nothing: its transaction is rolled back.
//! - The HTTP handlers, the console and the rollout controller are callers
//!   of these two functions and nothing else.

use super::*;

/// Who asks: a verified identity (or the rollout controller) and the id of
/// this request, which every change record carries.
#[derive(Debug, Clone)]
pub struct Caller {
    pub(super) subject: String,
    pub(super) role: Role,
    pub(super) request_id: Uuid,
    /// The caller's token: its `jti` and `exp` (for revoking it).
    pub(super) token_id: Option<String>,
    pub(super) token_expires_at: i64,
}

impl Caller {
    /// A verified admin token's holder, for one request.
    pub fn new(identity: &Identity) -> Caller {
        Caller {
            subject: identity.subject.clone(),
            role: identity.role,
            request_id: Uuid::now_v7(),
            token_id: identity.jti.clone(),
            token_expires_at: identity.expires_at,
        }
    }

    /// The rollout controller: it decides steps as an admin would.
    pub(crate) fn controller() -> Caller {
        Caller {
            subject: crate::rollout::CONTROLLER.into(),
            role: Role::Admin,
            request_id: Uuid::now_v7(),
            token_id: None,
            token_expires_at: 0,
        }
    }

    pub fn request_id(&self) -> Uuid {
        self.request_id
    }

    /// The one role check.
    fn may(&self, need: Need) -> Result<(), AdminError> {
        if self.role.allows(need) {
            return Ok(());
        }
        let what = match need {
            Need::Read => "read the registry",
            Need::Audit => "query the audit log",
            Need::Write => "change the registry",
        };
        Err(AdminError::new(
            AdminCode::InsufficientRole,
            None,
            format!("role {} may not {what}", self.role.name()),
        ))
    }
}

/// A change of the registry. `run` works inside the transaction of `cx`
/// and records what it changed; [`AdminState::exec`] does the rest.
pub trait Command: Send {
    type Output: Send;
    /// What the caller's role must allow: a change, unless the command
    /// says otherwise (signing out revokes one's own token at any role).
    const NEED: Need = Need::Write;

    fn run(self, cx: &mut Cx<'_>) -> impl Future<Output = Result<Self::Output, AdminError>> + Send;
}

/// A read of the registry, the fleet or the logs.
pub trait Query: Send {
    type Output: Send;
    /// What the caller's role must allow.
    const NEED: Need;

    fn run(self, s: &AdminState) -> impl Future<Output = Result<Self::Output, AdminError>> + Send;
}

/// One `admin_changes` row: what changed, before and after.
#[derive(Debug)]
struct Change {
    action: String,
    object_type: &'static str,
    object_id: String,
    before: Option<Value>,
    after: Option<Value>,
}

/// A command's context: its caller, the admin state, and its transaction,
/// begun when the command first touches the database (so work before it,
/// such as hashing an artifact, holds no transaction open).
pub struct Cx<'a> {
    pub(super) caller: &'a Caller,
    pub(super) state: &'a AdminState,
    tx: Option<Transaction<'static, Postgres>>,
    changes: Vec<Change>,
}

impl std::fmt::Debug for Cx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cx")
            .field("caller", &self.caller)
            .field("changes", &self.changes)
            .finish_non_exhaustive()
    }
}

impl Cx<'_> {
    /// The command's transaction.
    pub(super) async fn db(&mut self) -> Result<&mut sqlx::PgConnection, AdminError> {
        if self.tx.is_none() {
            self.tx = Some(self.state.pool.begin().await.map_err(db_error)?);
        }
        Ok(&mut **self.tx.as_mut().expect("the transaction just begun"))
    }

    /// Records one change, written with the command's transaction.
    pub(super) fn record(
        &mut self,
        action: &str,
        object: (&'static str, &str),
        before: Option<Value>,
        after: Option<Value>,
    ) {
        self.changes.push(Change {
            action: action.to_owned(),
            object_type: object.0,
            object_id: object.1.to_owned(),
            before,
            after,
        });
    }
}

impl AdminState {
    /// Runs a change as `caller`: the role check, the transaction, its
    /// change records, the commit and the announcement.
    pub async fn exec<C: Command>(
        &self,
        caller: &Caller,
        command: C,
    ) -> Result<C::Output, AdminError> {
        caller.may(C::NEED)?;
        let mut cx = Cx {
            caller,
            state: self,
            tx: None,
            changes: Vec::new(),
        };
        let out = command.run(&mut cx).await?;
        let Cx { tx, changes, .. } = cx;
        let Some(mut tx) = tx.filter(|_| !changes.is_empty()) else {
            // Nothing recorded: nothing changed, and a transaction begun is
            // rolled back as it drops.
            return Ok(out);
        };
        for c in &changes {
            insert_change(&mut tx, caller, c).await?;
        }
        tx.commit().await.map_err(db_error)?;
        self.announce().await;
        Ok(out)
    }

    /// Runs a read as `caller`, after the role check.
    pub async fn read<Q: Query>(&self, caller: &Caller, query: Q) -> Result<Q::Output, AdminError> {
        caller.may(Q::NEED)?;
        query.run(self).await
    }

    /// After a commit: this replica reloads now, the others on the
    /// announcement (or at their next refresh if Redis is away).
    async fn announce(&self) {
        let _ = self.registry.reload(&self.pool).await;
        if let Some(mut redis) = self.redis.clone()
            && let Err(e) = registry::announce_change(&mut redis, &self.channel).await
        {
            tracing::warn!(error = %e, "could not announce a registry change; other replicas pick it up at their next refresh");
        }
    }
}

async fn insert_change(
    tx: &mut Transaction<'static, Postgres>,
    caller: &Caller,
    c: &Change,
) -> Result<(), AdminError> {
    sqlx::query(
        "INSERT INTO admin_changes (actor, role, action, object_type, object_id, before, after, request_id)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(&caller.subject)
    .bind(caller.role.name())
    .bind(&c.action)
    .bind(c.object_type)
    .bind(&c.object_id)
    .bind(&c.before)
    .bind(&c.after)
    .bind(caller.request_id)
    .execute(&mut **tx)
    .await
    .map_err(db_error)?;
    tracing::info!(
        actor = %caller.subject,
        action = c.action,
        object_type = c.object_type,
        object_id = c.object_id,
        request_id = %caller.request_id,
        "admin change"
    );
    Ok(())
}
