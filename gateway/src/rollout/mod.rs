//! Progressive rollouts: the controller that moves a candidate adapter
//! version through a route's steps, or rolls it back, on what the audit
//! log shows.
//!
//! - [`gates`]: the figures of a step's window and the verdict on them;
//! - [`State`], [`Decision`], [`Action`]: a rollout's states, what a
//!   controller or an operator decides, typed end to end (the database
//!   keeps their [`as_str`](Decision::as_str) forms);
//! - [`decide`]: a verdict turned into the controller's decision;
//! - [`run`]: the controller loop. Every gateway replica runs it; the one
//!   holding the lease row `controller_leases.rollouts` takes turns
//!   ([`Turn`]), the others wait to take over when it stops renewing.
//!
//! This module depends on no other gateway module but the registry's
//! weight total: the admin plane implements [`Turn`] (each decision is a
//! route revision written with its `admin_changes` row) and calls
//! [`gates`] and [`decide`], never the other way round.

pub mod gates;

use std::future::Future;
use std::time::Duration;

use sqlx::PgPool;

use gates::Verdict;

/// The lease row that names the replica driving rollouts.
pub const LEASE: &str = "rollouts";
/// The actor of the controller's decisions in `admin_changes`.
pub const CONTROLLER: &str = "rollout-controller";
/// A step still short of requests after this many hold times is
/// inconclusive: the controller pauses the rollout for an operator (resume
/// to give it a fresh window, or abort) rather than hold the candidate's
/// share indefinitely.
pub const INCONCLUSIVE_HOLDS: i64 = 10;

/// A database string that names no value of a rollout enum.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not a rollout {what}")]
pub struct UnknownValue {
    pub what: &'static str,
    pub value: String,
}

/// Declares a string enum: its variants, their database strings, `as_str`,
/// `parse` and the `TryFrom<String>` that reads it from a row.
macro_rules! string_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $variant:ident => $s:literal,)* }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name {
            $($(#[$vm])* $variant,)*
        }

        impl $name {
            /// Every value.
            pub const ALL: &[$name] = &[$($name::$variant),*];

            /// The database's and the API's string.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $s,)*
                }
            }

            /// The value a string names.
            pub fn parse(s: &str) -> Option<$name> {
                $name::ALL.iter().copied().find(|v| v.as_str() == s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = UnknownValue;

            fn try_from(s: String) -> Result<$name, UnknownValue> {
                $name::parse(&s).ok_or(UnknownValue {
                    what: stringify!($name),
                    value: s,
                })
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

string_enum! {
    /// Where a rollout stands (the `rollout_state` type).
    State {
        /// Both versions are being scored on the rollout's evaluation set;
        /// the candidate takes no traffic yet.
        Evaluating => "evaluating",
        Running => "running",
        Paused => "paused",
        Succeeded => "succeeded",
        RolledBack => "rolled_back",
        Aborted => "aborted",
        /// The candidate scored too low on the evaluation set: it never
        /// took traffic.
        Rejected => "rejected",
    }
}

string_enum! {
    /// One decision on a rollout (a `rollout_decisions.decision`, and the
    /// `route.rollout_*` change it records).
    Decision {
        /// An operator started it with an evaluation set: both versions
        /// are scored before any step.
        Evaluate => "evaluate",
        /// It started at its first step: an operator's start, or the
        /// controller's once the candidate passed its evaluation.
        Start => "start",
        /// The controller ended it before any step: the candidate scored
        /// too low.
        Reject => "reject",
        /// The controller moved it to the next step.
        Advance => "advance",
        /// The controller moved it to its last step: all traffic.
        Succeed => "succeed",
        /// The controller sent all traffic back to the stable version.
        RollBack => "roll_back",
        /// The controller or an operator stopped it where it is.
        Pause => "pause",
        /// An operator restarted a paused step's window.
        Resume => "resume",
        /// An operator sent all traffic back to the stable version.
        Abort => "abort",
    }
}

string_enum! {
    /// What an operator can do to a rollout in progress.
    Action {
        Pause => "pause",
        Resume => "resume",
        Abort => "abort",
    }
}

impl Decision {
    /// The state a rollout is in after this decision.
    pub fn state_after(self) -> State {
        match self {
            Decision::Evaluate => State::Evaluating,
            Decision::Start | Decision::Advance | Decision::Resume => State::Running,
            Decision::Reject => State::Rejected,
            Decision::Pause => State::Paused,
            Decision::Succeed => State::Succeeded,
            Decision::RollBack => State::RolledBack,
            Decision::Abort => State::Aborted,
        }
    }

    /// The `admin_changes` action that records it.
    pub fn change_action(self) -> String {
        format!("route.rollout_{}", self.as_str())
    }
}

impl Action {
    /// The decision it records, if a rollout in `state` allows it; an
    /// abort is allowed in any state a rollout in progress has (an
    /// evaluation cannot be paused: abort it and start again).
    pub fn decision_from(self, state: State) -> Option<Decision> {
        match (self, state) {
            (Action::Pause, State::Running) => Some(Decision::Pause),
            (Action::Resume, State::Paused) => Some(Decision::Resume),
            (Action::Abort, State::Evaluating | State::Running | State::Paused) => {
                Some(Decision::Abort)
            }
            _ => None,
        }
    }
}

/// What the controller does on a step's verdict: the decision, the step
/// the rollout is at after it, and the reason it records. `None`: wait.
///
/// A wait that has lasted [`INCONCLUSIVE_HOLDS`] hold times pauses; an
/// advance onto the last step (all traffic) succeeds, since no stable
/// traffic is left to compare with.
pub fn decide(
    verdict: &Verdict,
    step_index: i32,
    next_share_is_all: bool,
    inconclusive: bool,
) -> Option<(Decision, i32, Option<String>)> {
    match verdict {
        Verdict::Wait(why) if inconclusive => Some((
            Decision::Pause,
            step_index,
            Some(format!(
                "inconclusive: after {INCONCLUSIVE_HOLDS} hold times, {why}; resume for a fresh \
                 window or abort"
            )),
        )),
        Verdict::Wait(_) => None,
        Verdict::Advance if next_share_is_all => Some((Decision::Succeed, step_index + 1, None)),
        Verdict::Advance => Some((Decision::Advance, step_index + 1, None)),
        Verdict::RollBack(why) => Some((Decision::RollBack, step_index, Some(why.clone()))),
    }
}

/// One turn of the controller: judge every running rollout and write what
/// is decided. The admin plane implements it; `holder` is the lease holder
/// the writes are checked against.
pub trait Turn: Send + Sync + 'static {
    /// The decisions written.
    fn turn(&self, holder: &str) -> impl Future<Output = Result<usize, sqlx::Error>> + Send;
}

/// Takes or renews the lease `name` for `holder` until `ttl` from now;
/// true when `holder` has it.
pub async fn hold_lease(
    pool: &PgPool,
    name: &str,
    holder: &str,
    ttl: Duration,
) -> Result<bool, sqlx::Error> {
    let got: Option<String> = sqlx::query_scalar(
        "INSERT INTO controller_leases (name, holder, expires_at)
         VALUES ($1, $2, now() + make_interval(secs => $3))
         ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
         WHERE controller_leases.holder = EXCLUDED.holder OR controller_leases.expires_at < now()
         RETURNING holder",
    )
    .bind(name)
    .bind(holder)
    .bind(ttl.as_secs_f64())
    .fetch_optional(pool)
    .await?;
    Ok(got.is_some())
}

/// Does `holder` hold the lease `name` now?
pub async fn holds_lease(pool: &PgPool, name: &str, holder: &str) -> Result<bool, sqlx::Error> {
    let held: Option<i32> = sqlx::query_scalar(
        "SELECT 1 FROM controller_leases WHERE name = $1 AND holder = $2 AND expires_at > now()",
    )
    .bind(name)
    .bind(holder)
    .fetch_optional(pool)
    .await?;
    Ok(held.is_some())
}

/// Settings of the controller (the `--rollout-*` flags).
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// This process's name in the lease: unique among live replicas.
    pub holder: String,
    /// How often the holder judges the running rollouts and renews.
    pub tick: Duration,
    /// How long a lease lasts without renewal: a replica that stops
    /// renewing is replaced after at most this.
    pub lease: Duration,
}

/// The controller loop; runs until the task is dropped.
pub async fn run(pool: PgPool, turns: impl Turn, config: ControllerConfig) {
    let mut leading = false;
    loop {
        let held = match hold_lease(&pool, LEASE, &config.holder, config.lease).await {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = %e, "rollout lease not renewed");
                false
            }
        };
        if held != leading {
            tracing::info!(holder = %config.holder, leading = held, "rollout controller lease");
            leading = held;
        }
        metrics::gauge!("lorafleet_gateway_rollout_leader").set(if held { 1.0 } else { 0.0 });
        if held && let Err(e) = turns.turn(&config.holder).await {
            tracing::warn!(error = %e, "rollout controller turn failed");
        }
        tokio::time::sleep(config.tick).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_decision_and_action_round_trips_through_its_string() {
        for s in State::ALL {
            assert_eq!(State::parse(s.as_str()), Some(*s));
            assert_eq!(State::try_from(s.as_str().to_owned()), Ok(*s));
        }
        for d in Decision::ALL {
            assert_eq!(Decision::parse(d.as_str()), Some(*d));
        }
        for a in Action::ALL {
            assert_eq!(Action::parse(a.as_str()), Some(*a));
        }
        assert!(State::try_from("sideways".to_owned()).is_err());
    }

    #[test]
    fn verdicts_become_decisions_and_operator_actions_respect_the_state() {
        let wait = Verdict::Wait("12 of 50 requests".into());
        assert_eq!(decide(&wait, 1, false, false), None);
        let (d, step, why) = decide(&wait, 1, false, true).unwrap();
        assert_eq!((d, step), (Decision::Pause, 1));
        assert!(why.unwrap().starts_with("inconclusive"));
        assert_eq!(
            decide(&Verdict::Advance, 1, false, false),
            Some((Decision::Advance, 2, None))
        );
        assert_eq!(
            decide(&Verdict::Advance, 2, true, false),
            Some((Decision::Succeed, 3, None))
        );
        let back = Verdict::RollBack("errors".into());
        assert_eq!(
            decide(&back, 2, false, true),
            Some((Decision::RollBack, 2, Some("errors".into())))
        );
        assert_eq!(Decision::Succeed.state_after(), State::Succeeded);
        assert_eq!(Decision::RollBack.state_after(), State::RolledBack);
        assert_eq!(Decision::Advance.state_after(), State::Running);

        assert_eq!(
            Action::Pause.decision_from(State::Running),
            Some(Decision::Pause)
        );
        assert_eq!(Action::Pause.decision_from(State::Paused), None);
        assert_eq!(
            Action::Resume.decision_from(State::Paused),
            Some(Decision::Resume)
        );
        assert_eq!(Action::Resume.decision_from(State::Running), None);
        assert_eq!(
            Action::Abort.decision_from(State::Paused),
            Some(Decision::Abort)
        );
        assert_eq!(Action::Abort.decision_from(State::Succeeded), None);
        assert_eq!(
            Action::Abort.decision_from(State::Evaluating),
            Some(Decision::Abort)
        );
        assert_eq!(Action::Pause.decision_from(State::Evaluating), None);
        assert_eq!(Decision::Evaluate.state_after(), State::Evaluating);
        assert_eq!(Decision::Reject.state_after(), State::Rejected);
        assert_eq!(Action::Abort.decision_from(State::Rejected), None);
    }
}
