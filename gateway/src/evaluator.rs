//! The evaluator: scores each evaluating rollout's items on both versions
//! through the fleet, records each outcome, and concludes.
//!
//! Every gateway replica with an admin plane runs it; it works only while
//! its replica holds the rollout controller's lease, sends each item
//! through the fleet as the gateway's own low-priority traffic
//! ([`crate::api::internal`]), records each outcome as it goes (a replica
//! that takes over goes on where the last stopped), and has the admin
//! plane conclude: the first step, or `rejected`. Scoring itself is
//! [`crate::evaluation`]'s.

use crate::api::params::Endpoint;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use uuid::Uuid;

use crate::admin::{AdminState, Caller, ConcludeEvaluation, EvaluationWork, record_outcome};
use crate::api::internal::{self, InternalCall};
use crate::api::{ApiError, AppState, WorkerFailure};
use crate::evaluation::score::{self, Outcome};
use crate::evaluation::set::{Item, Message, Prompt};
use crate::registry::{Adapter, Route};
use crate::upstream;

/// The worker's fairness key of evaluation traffic: one share for all of
/// it, apart from every tenant's.
pub const FAIRNESS_KEY: &str = "lorafleet-evaluation";
/// Its weight: each token it is served counts a hundred times, so a
/// tenant's waiting request is always admitted first.
pub const FAIRNESS_WEIGHT: f64 = 0.01;
/// How many times in a row an item may fail by the version's own fault
/// (its adapter cannot be loaded, the worker refuses the request) before
/// it is recorded as failed, and so wrong. Other failures (no worker,
/// timeouts) are the fleet's: retried at every tick until an operator
/// aborts.
pub const ATTEMPTS_BEFORE_FAILED: u32 = 3;
/// The subject of its audit rows.
pub const SUBJECT: &str = "rollout-evaluator";

/// Where the evaluator runs.
#[derive(Debug, Clone)]
pub struct EvaluatorConfig {
    /// This replica's name in the controller's lease.
    pub holder: String,
    /// How often it looks for work (and retries an item that failed).
    pub tick: Duration,
}

/// The evaluator loop; runs until the task is dropped. One rollout is
/// evaluated at a time per rollout, one request at a time per rollout.
pub async fn run(admin: AdminState, api: AppState, config: EvaluatorConfig) {
    let busy: Arc<Mutex<HashSet<Uuid>>> = Arc::default();
    let attempts: Attempts = Arc::default();
    loop {
        let held = crate::rollout::holds_lease(&admin.pool, crate::rollout::LEASE, &config.holder)
            .await
            .unwrap_or(false);
        if held {
            let in_hand = busy.lock().expect("not poisoned").clone();
            match EvaluationWork::load(&admin, &in_hand).await {
                Ok(work) => {
                    for w in work {
                        if busy.lock().expect("not poisoned").insert(w.rollout) {
                            spawn(&admin, &api, &config.holder, &busy, &attempts, w);
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e.message(), "evaluations not loaded"),
            }
        }
        tokio::time::sleep(config.tick).await;
    }
}

/// One rollout's evaluation in a task of its own, marked busy until it
/// ends.
fn spawn(
    admin: &AdminState,
    api: &AppState,
    holder: &str,
    busy: &Arc<Mutex<HashSet<Uuid>>>,
    attempts: &Attempts,
    w: EvaluationWork,
) {
    let (admin, api, holder, busy, attempts) = (
        admin.clone(),
        api.clone(),
        holder.to_owned(),
        busy.clone(),
        attempts.clone(),
    );
    tokio::spawn(async move {
        let id = w.rollout;
        evaluate(&admin, &api, &holder, &attempts, w).await;
        busy.lock().expect("not poisoned").remove(&id);
    });
}

/// Failed attempts in a row, by (rollout, version, item).
type Attempts = Arc<Mutex<HashMap<(Uuid, i64, i32), u32>>>;

/// Is a failure the version's own (its adapter, the request as it makes
/// it), rather than the fleet's?
fn versions_fault(e: &ApiError) -> bool {
    matches!(
        e,
        ApiError::Worker(
            WorkerFailure::AdapterUnavailable { .. } | WorkerFailure::InvalidRequest { .. }
        ) | ApiError::ContextLength { .. }
    )
}

/// Scores every item not yet recorded, stable then candidate item by item,
/// and concludes once all are. Stops at the first failure (the next tick
/// retries from there; the version's own fault, [`ATTEMPTS_BEFORE_FAILED`]
/// times in a row, records the item failed) or when the lease or the
/// rollout moves on.
async fn evaluate(
    admin: &AdminState,
    api: &AppState,
    holder: &str,
    attempts: &Attempts,
    w: EvaluationWork,
) {
    let Some(route) = api.registry.snapshot().route(&w.tenant, &w.model) else {
        tracing::warn!(rollout = %w.rollout, "the evaluated route is not in the registry snapshot yet");
        return;
    };
    tracing::info!(rollout = %w.rollout, items = w.items.len(), done = w.done.len(), "evaluating");
    for (i, item) in w.items.iter().enumerate() {
        let index = i as i32;
        for adapter in [&w.stable, &w.candidate] {
            let id = adapter.lora_int_id.to_registry();
            if w.done.contains(&(id, index)) {
                continue;
            }
            let mut requests = Vec::new();
            let scored = score_item(api, &route, adapter, item, w.seed, &mut requests).await;
            let key = (w.rollout, id, index);
            let outcome = match scored {
                Ok(o) => o,
                Err(f) => {
                    let (code, message, theirs) = match &f {
                        Failure::Api(e) => {
                            let p = e.parts();
                            (p.code, p.message, versions_fault(e))
                        }
                        Failure::Unscorable(u) => ("unscorable", u.to_string(), true),
                    };
                    metrics::counter!("lorafleet_gateway_rollout_eval_failures_total", "code" => code)
                        .increment(1);
                    let tries = {
                        let mut a = attempts.lock().expect("not poisoned");
                        let n = a.entry(key).or_default();
                        *n += u32::from(theirs);
                        *n
                    };
                    if tries < ATTEMPTS_BEFORE_FAILED {
                        tracing::warn!(rollout = %w.rollout, item = i, lora_int_id = id, code,
                                       error = %message, tries,
                                       "an evaluation item failed; retried at the next tick");
                        return;
                    }
                    tracing::warn!(rollout = %w.rollout, item = i, lora_int_id = id, code,
                                   error = %message, "an evaluation item failed again: recorded wrong");
                    Outcome::Failed {
                        code: code.to_owned(),
                        message,
                    }
                }
            };
            attempts.lock().expect("not poisoned").remove(&key);
            let recorded =
                record_outcome(admin, holder, w.rollout, id, index, &outcome, &requests).await;
            match recorded {
                Ok(true) => {}
                Ok(false) => {
                    tracing::info!(rollout = %w.rollout, "evaluation stopped: the lease or the rollout moved on");
                    return;
                }
                Err(e) => {
                    tracing::warn!(rollout = %w.rollout, error = %e.message(), "an outcome not recorded");
                    return;
                }
            }
        }
    }
    let conclude = ConcludeEvaluation {
        holder: holder.to_owned(),
        rollout: w.rollout,
    };
    match admin.exec(&Caller::controller(), conclude).await {
        Ok(Some(d)) => {
            tracing::info!(rollout = %w.rollout, decision = d.as_str(), "evaluation concluded")
        }
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(rollout = %w.rollout, error = %e.message(), "evaluation not concluded")
        }
    }
}

/// Why an item could not be scored this time.
enum Failure {
    /// Its request failed as a tenant's would.
    Api(ApiError),
    /// The answer cannot be scored (a choice with no token of its own).
    Unscorable(score::Unscorable),
}

impl From<ApiError> for Failure {
    fn from(e: ApiError) -> Failure {
        Failure::Api(e)
    }
}

/// One request of an evaluation.
fn call(
    route: &Arc<Route>,
    adapter: &Arc<Adapter>,
    prompt: upstream::Prompt,
    sampling: upstream::Sampling,
    features: &str,
) -> Result<InternalCall, ApiError> {
    let endpoint = Endpoint::of(&prompt);
    let spec = upstream::GenerationSpec {
        prompt,
        sampling,
        choices: upstream::Choices::ONE,
    };
    Ok(InternalCall {
        route: route.clone(),
        adapter: adapter.clone(),
        spec: crate::api::openai::checked(spec, endpoint)?,
        subject: SUBJECT.into(),
        features: features.into(),
        fairness_key: FAIRNESS_KEY.into(),
        fairness_weight: FAIRNESS_WEIGHT,
    })
}

/// A prompt's tokens with their log probabilities (None for the first),
/// the prompt scored alone.
async fn token_logprobs(
    api: &AppState,
    route: &Arc<Route>,
    adapter: &Arc<Adapter>,
    prompt: upstream::Prompt,
    seed: u64,
    requests: &mut Vec<Uuid>,
) -> Result<Vec<upstream::TokenLogprob>, ApiError> {
    let sampling = upstream::Sampling {
        max_tokens: 0,
        prompt_logprobs: Some(0),
        seed: Some(seed),
        ..Default::default()
    };
    let c = call(route, adapter, prompt, sampling, "echo,evaluation")?;
    let answer = internal::generate(api, c).await?;
    requests.push(answer.request_id);
    Ok(answer.prompt_logprobs)
}

/// An item's chat messages as the worker takes them, with a given answer
/// after them to be scored, if any.
/// A role the set's check let through (system, user, assistant) always
/// parses; another is refused by field, never read as a different role.
fn chat(messages: &[Message], continuation: Option<&str>) -> Result<upstream::Prompt, ApiError> {
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let role = upstream::Role::parse(&m.role).ok_or_else(|| {
            ApiError::BadRequest(crate::api::openai::bad(
                &format!("messages[{i}].role"),
                format!("{:?} is not a chat role", m.role),
            ))
        })?;
        out.push(upstream::ChatMessage::new(role, m.content.clone()));
    }
    Ok(upstream::Prompt::Chat(upstream::ChatPrompt {
        messages: out,
        add_generation_prompt: true,
        tools_json: None,
        template_kwargs_json: None,
        continuation: continuation.map(str::to_owned),
        reasoning_effort: None,
    }))
}

/// Each choice's loglikelihood after `prompt`: the context scored alone
/// for its token count (lm-evaluation-harness's split: white space ending
/// it moves to the continuation), then context and choice together.
async fn loglikelihoods(
    api: &AppState,
    route: &Arc<Route>,
    adapter: &Arc<Adapter>,
    (prompt, choices): (&Prompt, &[String]),
    seed: u64,
    requests: &mut Vec<Uuid>,
) -> Result<Vec<f64>, Failure> {
    let context_tokens = match prompt {
        Prompt::Text(t) => {
            let (context, _) = score::split(t, "");
            let p = upstream::Prompt::Text(context.to_owned());
            token_logprobs(api, route, adapter, p, seed, requests)
                .await?
                .len()
        }
        Prompt::Messages(m) => {
            let tokens =
                token_logprobs(api, route, adapter, chat(m, None)?, seed, requests).await?;
            let bytes: Vec<&[u8]> = tokens.iter().map(|t| t.bytes.as_slice()).collect();
            score::chat_context_tokens(&bytes).map_err(Failure::Unscorable)?
        }
    };
    let mut out = Vec::with_capacity(choices.len());
    for choice in choices {
        let whole = match prompt {
            Prompt::Text(t) => {
                let (context, continuation) = score::split(t, choice);
                upstream::Prompt::Text(format!("{context}{continuation}"))
            }
            Prompt::Messages(m) => chat(m, Some(choice))?,
        };
        let lps: Vec<Option<f32>> = token_logprobs(api, route, adapter, whole, seed, requests)
            .await?
            .iter()
            .map(|t| t.logprob)
            .collect();
        out.push(score::loglikelihood(context_tokens, &lps).map_err(Failure::Unscorable)?);
    }
    Ok(out)
}

/// What `adapter` does on `item`, with the audit rows of its requests.
async fn score_item(
    api: &AppState,
    route: &Arc<Route>,
    adapter: &Arc<Adapter>,
    item: &Item,
    seed: u64,
    requests: &mut Vec<Uuid>,
) -> Result<Outcome, Failure> {
    let outcome = match item {
        Item::Choice {
            prompt,
            choices,
            answer,
        } => {
            let loglikelihoods =
                loglikelihoods(api, route, adapter, (prompt, choices), seed, requests).await?;
            let chosen = score::choose(&loglikelihoods);
            Outcome::Choice {
                loglikelihoods,
                chosen,
                correct: chosen == *answer,
            }
        }
        Item::Generate {
            prompt,
            expected,
            matching,
            max_tokens,
            stop,
        } => {
            let prompt = match prompt {
                Prompt::Text(t) => upstream::Prompt::Text(t.clone()),
                Prompt::Messages(m) => chat(m, None)?,
            };
            let sampling = upstream::Sampling {
                max_tokens: *max_tokens as usize,
                temperature: 0.0,
                seed: Some(seed),
                stop: stop.clone(),
                ..Default::default()
            };
            let c = call(route, adapter, prompt, sampling, "evaluation")?;
            let answer = internal::generate(api, c).await?;
            requests.push(answer.request_id);
            let correct = score::matches(expected, *matching, &answer.text);
            Outcome::Generate {
                answer: answer.text,
                correct,
            }
        }
    };
    Ok(outcome)
}
