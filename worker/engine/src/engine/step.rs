//! One engine iteration: settle adapter loads, schedule, run the forward
//! pass, score and sample the rows that want it, and turn the results into
//! each request's events.

use std::collections::HashMap;
use std::time::Duration;

use super::{Engine, StepStats};
use crate::backend::{Backend, DeviceSample, StepBatch};
use crate::constraint::Allowed;
use crate::error::{EngineError, Result};
use crate::logprobs::{TokenLogprob, score};
use crate::penalties::{History, adjust};
use crate::request::Event;
use crate::sampling::{Rng, sample};
use crate::scheduler::{Limits, Scheduler, SeqId};
use crate::sequence::{FinishReason, PendingDraw, Sequence};
use std::time::Instant;

use lorafleet_domain::RequestId;

use crate::masks::{MaskPool, MaskSlot};

/// One scheduled sequence's place in a step: its slot, id, how many tokens
/// it feeds, and the rows of the step's logits that are its own.
struct Row {
    id: SeqId,
    chunk: usize,
    /// Its first logit row, and how many it has.
    first_row: usize,
    rows: usize,
}

impl Sequence {
    /// How many of this chunk's last positions need logits: the prompt
    /// positions whose next token is still to be scored, and the last
    /// position when the chunk reaches the end (it chooses the next token).
    fn logit_rows(&self, chunk: usize) -> usize {
        let end = self.num_computed + chunk;
        let mut from = if end == self.total_len() {
            end - 1
        } else {
            end
        };
        if self.params.prompt_logprobs.is_some() && self.prompt_scored < self.prompt_ids.len() {
            // Position p's logits score prompt token p + 1.
            from = from.min(self.num_computed.max(self.prompt_scored.saturating_sub(1)));
        }
        end - from.min(end)
    }

    /// Whether a chunk ending at the sequence's end draws a token: not when
    /// the request only scores its prompt (`max_tokens` 0).
    fn draws(&self, chunk: usize) -> bool {
        self.num_computed + chunk == self.total_len() && self.params.max_tokens > 0
    }
}

impl Engine {
    /// Runs one iteration: settles adapter loads, schedules, runs the
    /// forward pass and samples. Returns each request's new events.
    ///
    /// When nothing can run because every waiting request's adapter is
    /// still loading, it waits briefly for a load rather than spinning.
    pub fn step(&mut self) -> Result<Vec<(RequestId, Event)>> {
        let mut events = Vec::new();
        self.settle_loads(None, &mut events);
        self.pool.settle_unloads(self.backend.as_mut())?;
        // Tokens whose masks came in since: drawn from the logits kept.
        self.draw_pending(&mut events);

        let plan = Scheduler {
            queues: &mut self.queues,
            seqs: &mut self.seqs,
            pool: &mut self.pool,
            kv: &mut self.kv,
            ring: &mut self.ring,
            backend: self.backend.as_mut(),
            limits: Limits {
                max_num_seqs: self.settings.max_num_seqs,
                max_batched_tokens: self.settings.max_batched_tokens,
                max_loras: self.settings.max_loras,
            },
            fair: self.settings.fair_admission.then_some(&mut self.fair),
            budget: self.budget.as_deref(),
        }
        .schedule();
        // Copies the scheduler made are charged even when it then failed.
        self.charge_loads();
        let plan = plan?;
        if plan.scheduled.is_empty() {
            self.last_step = StepStats {
                preempted: plan.preempted.len(),
                ..Default::default()
            };
            // Only masks in the making: wait for one rather than spin.
            if let Some(mask) = self
                .seqs
                .values()
                .find_map(|s| s.pending.as_ref().map(|p| p.mask.clone()))
            {
                mask.wait_until(std::time::Instant::now() + Duration::from_millis(10));
            }
            if self.pool.loads_in_flight() > 0 {
                self.settle_loads(Some(Duration::from_millis(20)), &mut events);
            }
            return Ok(events);
        }

        // How long each newly scheduled request waited, in steps that ran
        // without it.
        for &(id, _) in &plan.scheduled {
            let seq = self.seqs.get_mut(&id).expect("a scheduled sequence");
            if seq.waited_steps.is_none() {
                let waited = self.run.steps - seq.arrived_step;
                seq.waited_steps = Some(waited);
                self.run.max_wait_steps = self.run.max_wait_steps.max(waited);
            }
        }
        // Order by slot (base first) so each adapter's tokens are one segment.
        let mut order: Vec<(Option<usize>, SeqId, usize)> = plan
            .scheduled
            .iter()
            .map(|&(id, chunk)| {
                (
                    self.seqs[&id].adapter.and_then(|a| self.pool.slot_of(a)),
                    id,
                    chunk,
                )
            })
            .collect();
        order.sort_by_key(|&(slot, id, _)| (slot.map_or(0, |s| s + 1), id));
        for &(_, id, _) in &order {
            if let Some(a) = self.seqs[&id].adapter {
                self.pool.touch(a);
            }
        }

        let mut batch = StepBatch::default();
        let mut tokens = Vec::new();
        let mut rows: Vec<Row> = Vec::with_capacity(order.len());
        let mut next_row = 0;
        for &(slot, id, chunk) in &order {
            let seq = &self.seqs[&id];
            tokens.clear();
            tokens.extend((seq.num_computed..seq.num_computed + chunk).map(|p| seq.token_at(p)));
            let n = seq.logit_rows(chunk);
            batch.push_rows(&tokens, seq.num_computed, &seq.blocks, slot, n);
            if let Some(s) = batch.seqs.last_mut() {
                s.long_rope = seq.long_rope;
                s.prompt_len = seq.prompt_ids.len();
                s.ring = &seq.ring;
            }
            rows.push(Row {
                id,
                chunk,
                first_row: next_row,
                rows: n,
            });
            next_row += n;
        }
        // The widest vocabulary of the step's rows (an adapter's grown one).
        batch.width = order
            .iter()
            .filter_map(|&(_, id, _)| self.seqs[&id].vocab)
            .max()
            .unwrap_or(0);
        batch.finish();
        self.last_step = StepStats {
            sequences: batch.seqs.len(),
            tokens: batch.tokens.len(),
            distinct_adapters: batch.distinct_adapters(),
            preempted: plan.preempted.len(),
            late_masks: 0,
        };
        self.run.steps += 1;
        self.run.distinct_adapters += batch.distinct_adapters() as u64;

        let started = std::time::Instant::now();
        let (logits, draws) = forward_and_draw(
            self.backend.as_mut(),
            &self.seqs,
            self.config.vocab_size,
            &self.config.eos_token_ids,
            &batch,
            &rows,
            &self.masks,
        )?;
        let busy = started.elapsed();
        let width = batch.logits_width(self.config.vocab_size);
        drop(batch);
        self.run.busy += busy;
        self.charge(&rows, busy);
        let scored = self.score_and_collect(&rows, &logits, width, draws);
        let mut scored = scored.into_iter();
        let mut finished = Vec::new();
        let mut late_masks = 0;
        for row in &rows {
            let seq = self
                .seqs
                .get_mut(&row.id)
                .expect("scheduled sequence exists");
            let (prompt, drawn) = scored.next().expect("one result per scheduled sequence");
            if !prompt.is_empty() {
                events.push((seq.request_id.clone(), Event::PromptLogprobs(prompt)));
            }
            let draws = seq.draws(row.chunk);
            let reaches_end = seq.num_computed + row.chunk == seq.total_len();
            seq.num_computed += row.chunk;
            // Blocks this step filled are registered for reuse.
            let full = seq.num_computed / self.kv.block_size();
            if self.kv.caching() && full > seq.registered {
                seq.hashes_upto(full, self.kv.block_size());
                for i in seq.registered..full {
                    self.kv.register(seq.blocks[i], seq.block_hashes[i]);
                }
                seq.registered = full;
            }
            if !reaches_end {
                continue; // a prefill chunk that does not reach the end yet
            }
            if !draws {
                // The prompt alone was asked for (max_tokens 0).
                events.push((
                    seq.request_id.clone(),
                    Event::Finished(seq.finish(FinishReason::Length, None)),
                ));
                finished.push(row.id);
                continue;
            }
            let drawn = drawn.expect("a drawing row was sampled");
            if let Some(pending) = drawn.pending {
                // Its mask was late: the token is drawn in a later step.
                seq.pending = Some(pending);
                late_masks += 1;
                continue;
            }
            self.accept(row.id, drawn, &mut events, &mut finished);
        }
        self.last_step.late_masks = late_masks;
        self.run.late_masks += late_masks as u64;
        for id in finished {
            self.remove(id);
        }
        Ok(events)
    }

    /// Shares a step's `busy` time among its sequences in proportion to
    /// the tokens each fed it; the shares add up to `busy` exactly (the
    /// last row takes what rounding left).
    fn charge(&mut self, rows: &[Row], busy: Duration) {
        let total: u128 = rows.iter().map(|r| r.chunk as u128).sum();
        if total == 0 {
            return;
        }
        let nanos = busy.as_nanos();
        let mut left = nanos;
        for (i, row) in rows.iter().enumerate() {
            let share = if i + 1 == rows.len() {
                left
            } else {
                (nanos * row.chunk as u128 / total).min(left)
            };
            left -= share;
            if let Some(seq) = self.seqs.get_mut(&row.id) {
                seq.device_time += Duration::from_nanos(share as u64);
            }
        }
    }

    /// Charges each adapter copy into a device slot since the last call to
    /// the live requests of that adapter (waiting or running), split
    /// evenly; the shares add up to the copy's time exactly (the first
    /// takes what rounding left). A copy no request waits for is counted
    /// apart.
    pub(super) fn charge_loads(&mut self) {
        for (adapter, took) in self.pool.take_load_charges() {
            self.run.loads += took;
            let mut waiters: Vec<&mut crate::sequence::Sequence> = self
                .seqs
                .values_mut()
                .filter(|s| s.adapter == Some(adapter))
                .collect();
            if waiters.is_empty() {
                self.run.unattributed_loads += took;
                continue;
            }
            let nanos = took.as_nanos();
            let each = nanos / waiters.len() as u128;
            let first = nanos - each * (waiters.len() as u128 - 1);
            for (i, seq) in waiters.iter_mut().enumerate() {
                let share = if i == 0 { first } else { each };
                seq.load_time += Duration::from_nanos(share as u64);
            }
        }
    }

    /// Takes a drawn token into its sequence: the text it completes, its
    /// grammar advanced, and the events it makes; a sequence that ends is
    /// put in `finished`.
    fn accept(
        &mut self,
        id: SeqId,
        drawn: Drawn,
        events: &mut Vec<(RequestId, Event)>,
        finished: &mut Vec<SeqId>,
    ) {
        let seq = self.seqs.get_mut(&id).expect("a drawing sequence exists");
        let Drawn {
            rng,
            token,
            logprob,
            failed,
            pending: _,
        } = drawn;
        if let Some(e) = failed {
            events.push((seq.request_id.clone(), Event::Failed(e)));
            finished.push(id);
            return;
        }
        seq.rng = rng;
        let tokenizer = seq.tokenizer.as_ref().unwrap_or(&self.tokenizer).clone();
        let out = match seq.push_token(
            token,
            &tokenizer,
            &self.config.eos_token_ids,
            self.config
                .rope
                .max_model_len(self.config.max_position_embeddings),
        ) {
            Ok(out) => out,
            Err(e) => {
                // Only this sequence is affected; the rest of the step stands.
                events.push((seq.request_id.clone(), Event::Failed(e)));
                finished.push(id);
                return;
            }
        };
        let mut out = out;
        if out.finished.is_none()
            && let Some(grammar) = seq.grammar.as_mut()
        {
            // No mask thread holds it: its next mask is asked for only
            // once this token is in.
            let advanced = grammar.lock().expect("a grammar's lock").advance(token);
            match advanced {
                // The grammar is complete: the output ends here.
                Ok(true) => match seq.flush(&tokenizer) {
                    Ok(rest) => {
                        out.text.push_str(&rest);
                        out.finished = Some((FinishReason::Stop, None));
                    }
                    Err(e) => {
                        events.push((seq.request_id.clone(), Event::Failed(e)));
                        finished.push(id);
                        return;
                    }
                },
                Ok(false) => {}
                Err(e) => {
                    events.push((seq.request_id.clone(), Event::Failed(e)));
                    finished.push(id);
                    return;
                }
            }
        }
        events.push((
            seq.request_id.clone(),
            Event::Delta {
                token_ids: vec![token],
                text: out.text,
                logprobs: logprob.into_iter().collect(),
                channel: out.channel,
                device_time: seq.device_time,
                load_time: seq.load_time,
            },
        ));
        if let Some((reason, stop)) = out.finished {
            events.push((
                seq.request_id.clone(),
                Event::Finished(seq.finish(reason, stop)),
            ));
            finished.push(id);
        }
    }

    /// Draws the tokens whose masks have come in since their step, from
    /// the logits kept, in sequence order.
    fn draw_pending(&mut self, events: &mut Vec<(RequestId, Event)>) {
        let mut ready: Vec<SeqId> = self
            .seqs
            .iter()
            .filter(|(_, s)| s.pending.as_ref().is_some_and(|p| p.mask.ready()))
            .map(|(&id, _)| id)
            .collect();
        if ready.is_empty() {
            return;
        }
        ready.sort_unstable();
        let mut finished = Vec::new();
        let eos = self.config.eos_token_ids.clone();
        for id in ready {
            let seq = self.seqs.get_mut(&id).expect("a pending sequence exists");
            let pending = seq.pending.take().expect("filtered above");
            let mut rng = seq.rng.clone();
            let (token, failed) =
                draw_token(&pending.logits, seq, pending.mask.take(), &mut rng, &eos);
            let logprob = seq
                .params
                .logprobs
                .map(|n| score(&pending.logits, token, n));
            let drawn = Drawn {
                rng,
                token,
                logprob,
                failed,
                pending: None,
            };
            self.accept(id, drawn, events, &mut finished);
        }
        for id in finished {
            self.remove(id);
        }
    }

    /// Per scheduled sequence in `rows` order, the prompt positions it
    /// scored and the token it drew (with the generator that drew it,
    /// written back only once the step stands, and the token's log
    /// probabilities when asked).
    #[allow(clippy::type_complexity)]
    fn score_and_collect(
        &mut self,
        rows: &[Row],
        logits: &[f32],
        width: usize,
        draws: Vec<Draw>,
    ) -> Vec<(Vec<TokenLogprob>, Option<Drawn>)> {
        let model_vocab = self.config.vocab_size;
        let mut draws = draws.into_iter().peekable();
        let mut out = Vec::with_capacity(rows.len());
        for (i, r) in rows.iter().enumerate() {
            let seq = self.seqs.get_mut(&r.id).expect("scheduled sequence exists");
            // Its own logits of the row: the step's may be wider.
            let vocab = seq.vocab.unwrap_or(model_vocab);
            let row_of = |k: usize| &logits[k * width..k * width + vocab];
            let mut prompt = Vec::new();
            if let Some(top_n) = seq.params.prompt_logprobs
                && seq.prompt_scored < seq.prompt_ids.len()
                && r.rows > 0
            {
                if seq.prompt_scored == 0 {
                    // The first token, which nothing predicts, opens the list.
                    prompt.push(TokenLogprob {
                        token: seq.prompt_ids[0],
                        logprob: None,
                        top: Vec::new(),
                    });
                    seq.prompt_scored = 1;
                }
                let first_position = seq.num_computed + r.chunk - r.rows;
                for k in 0..r.rows {
                    let target = first_position + k + 1;
                    if target == seq.prompt_scored && target < seq.prompt_ids.len() {
                        let token = seq.prompt_ids[target];
                        prompt.push(score(row_of(r.first_row + k), token, top_n));
                        seq.prompt_scored += 1;
                    }
                }
            }
            let drawn = match draws.peek() {
                Some(d) if d.index == i => {
                    let d = draws.next().expect("peeked");
                    let pending = d.deferred.map(|mask| PendingDraw {
                        logits: row_of(d.row).to_vec(),
                        mask,
                    });
                    Some(Drawn {
                        rng: d.rng,
                        token: d.token,
                        logprob: d.logprob,
                        failed: d.failed,
                        pending,
                    })
                }
                _ => None,
            };
            out.push((prompt, drawn));
        }
        out
    }

    /// The KV blocks a sequence of `tokens` positions holds at most. Under
    /// a window every layer slides by, that is the window behind a chunk,
    /// the chunk, and a block of alignment.
    pub(super) fn kv_need(&self, tokens: usize) -> usize {
        match self.config.uniform_window() {
            Some(window) => self.kv.blocks_for(tokens).min(
                self.kv
                    .blocks_for(window + self.settings.max_batched_tokens)
                    + 1,
            ),
            None => self.kv.blocks_for(tokens),
        }
    }

    /// The KV blocks a sequence of `adapter` can ever hold: the cache's,
    /// and under a shared budget what the budget leaves beside the
    /// adapter's slot and its own lm_head (known once it is read).
    pub(super) fn kv_room(&self, adapter: Option<crate::pool::AdapterId>) -> usize {
        match (&self.budget, adapter) {
            (Some(b), Some(a)) => {
                let extra = self.pool.slot_extra_of(a);
                self.kv.total().min(
                    ((b.bytes() - b.slot_bytes()).saturating_sub(extra) / b.block_bytes()) as usize,
                )
            }
            _ => self.kv.total(),
        }
    }

    /// Takes finished adapter loads; fails the requests whose adapter could
    /// not be loaded.
    pub(super) fn settle_loads(
        &mut self,
        wait: Option<std::time::Duration>,
        events: &mut Vec<(RequestId, Event)>,
    ) {
        for (adapter, err) in self.pool.poll_loads(wait) {
            let victims: Vec<SeqId> = self
                .queues
                .waiting
                .iter()
                .copied()
                .filter(|id| self.seqs[id].adapter == Some(adapter))
                .collect();
            for id in victims {
                if let Some(seq) = self.remove(id) {
                    events.push((
                        seq.request_id,
                        Event::Failed(EngineError::Adapter(err.duplicate())),
                    ));
                }
            }
        }
        // A waiting sequence whose adapter, now read, packs an lm_head of
        // its own that leaves its KV no room under the budget (checked at
        // submission where the adapter was read already) is refused, not
        // preempted for ever.
        if self.budget.is_some() {
            let too_long: Vec<(SeqId, usize, usize, usize)> = self
                .queues
                .waiting
                .iter()
                .filter_map(|&id| {
                    let s = &self.seqs[&id];
                    let needed = s.prompt_ids.len() + s.params.max_tokens;
                    let (blocks, room) = (self.kv_need(needed), self.kv_room(s.adapter));
                    (blocks > room).then_some((id, needed, blocks, room))
                })
                .collect();
            for (id, needed, blocks, room) in too_long {
                if let Some(seq) = self.remove(id) {
                    events.push((
                        seq.request_id,
                        Event::Failed(EngineError::request(
                            lorafleet_domain::generation::Field::MaxTokens,
                            format!(
                                "{needed} tokens need {blocks} KV blocks; beside its adapter's \
                                 slot and own lm_head the cache has {room}"
                            ),
                        )),
                    ));
                }
            }
        }
    }
}

/// What a sequence drew: its generator after the draw, the token, the
/// token's log probabilities when asked, or why the draw failed.
struct Drawn {
    rng: Rng,
    token: u32,
    logprob: Option<TokenLogprob>,
    failed: Option<EngineError>,
    /// The mask was late: no token yet; the logits are kept for a later
    /// step.
    pending: Option<PendingDraw>,
}

/// A sequence that draws a token this step: its index in the step's rows,
/// a copy of its generator, the token, and its logit row.
struct Draw {
    index: usize,
    rng: Rng,
    token: u32,
    row: usize,
    /// The constraint's mask could not be computed: the sequence fails.
    failed: Option<EngineError>,
    /// The token's log probabilities, when asked (scored on the sampling
    /// threads, beside the draw).
    logprob: Option<TokenLogprob>,
    /// The constraint's mask was not in by the step's budget: the row is
    /// not drawn now.
    deferred: Option<MaskSlot>,
}

/// Runs the forward pass and draws the next token of every sequence whose
/// chunk reaches its end. Returns the logits brought to the host (empty
/// when the backend sampled on its device) and the draws, in row order.
fn forward_and_draw(
    backend: &mut dyn Backend,
    seqs: &HashMap<SeqId, Sequence>,
    model_vocab: usize,
    eos: &[u32],
    batch: &StepBatch<'_>,
    rows: &[Row],
    masks: &MaskPool,
) -> Result<(Vec<f32>, Vec<Draw>)> {
    let mut draws: Vec<Draw> = rows
        .iter()
        .enumerate()
        .filter(|(_, r)| seqs[&r.id].draws(r.chunk))
        .map(|(index, r)| Draw {
            index,
            rng: seqs[&r.id].rng.clone(),
            token: 0,
            row: r.first_row + r.rows - 1,
            failed: None,
            logprob: None,
            deferred: None,
        })
        .collect();
    // Scoring, min-p and the controls that change logits run on the host.
    let scores = rows.iter().any(|r| {
        let p = &seqs[&r.id].params;
        p.min_p > 0.0
            || p.logprobs.is_some()
            || p.prompt_logprobs.is_some()
            || p.adjusts_logits()
            || p.constraint.is_some()
            || seqs[&r.id].id_limit.is_some()
    });
    let width = batch.logits_width(model_vocab);
    if backend.samples_on_device() && !scores && width == model_vocab {
        // The uniform draw comes from the request's own stream, here, as
        // the host sampler would take it (only when sampling), so a
        // request's tokens do not depend on its batch.
        let device_rows: Vec<DeviceSample> = draws
            .iter_mut()
            .map(|d| {
                let params = &seqs[&rows[d.index].id].params;
                DeviceSample {
                    temperature: params.temperature,
                    top_k: params.top_k,
                    top_p: params.top_p,
                    u: if params.temperature > 0.0 {
                        d.rng.next_f64() as f32
                    } else {
                        0.0
                    },
                }
            })
            .collect();
        let picked = backend.forward_sampled(batch, &device_rows)?;
        if picked.len() != draws.len() {
            return Err(EngineError::Backend(format!(
                "the backend sampled {} tokens for {} rows",
                picked.len(),
                draws.len()
            )));
        }
        for (d, t) in draws.iter_mut().zip(picked) {
            d.token = t;
        }
        return Ok((Vec::new(), draws));
    }
    // A step that scores (or a backend without its own sampler) brings the
    // logits to the host and samples there.
    // The constrained rows' token masks depend only on the tokens so far:
    // they are computed on the mask threads while the forward pass runs,
    // and waited for until a budget past its end; a row whose mask is
    // later waits a step, not the batch (`masks.rs`).
    let constrained: Vec<(usize, MaskSlot)> = draws
        .iter()
        .enumerate()
        .filter_map(|(i, d)| {
            let grammar = seqs[&rows[d.index].id].grammar.clone()?;
            Some((i, masks.submit(grammar)))
        })
        .collect();
    let started = Instant::now();
    let logits = backend.forward(batch)?;
    let deadline = Instant::now() + crate::masks::grace(started.elapsed());
    // Each draw's mask, in draw order.
    let mut mask_of: Vec<Option<Result<Allowed>>> = (0..draws.len()).map(|_| None).collect();
    for (i, slot) in constrained {
        if slot.wait_until(deadline) {
            mask_of[i] = slot.take();
        } else {
            draws[i].deferred = Some(slot);
        }
    }
    let want = rows.iter().map(|r| r.rows).sum::<usize>() * width;
    if logits.len() != want {
        return Err(EngineError::Backend(format!(
            "the backend returned {} logits for {want}",
            logits.len()
        )));
    }
    // Sample every row that wants a token, in parallel: each draws only
    // from its own request's generator, so the order does not matter. On
    // the team that runs the CPU backend's loops: with that backend its
    // workers are usually still awake from the forward pass.
    let mut work: Vec<(&mut Draw, Option<Result<Allowed>>)> =
        draws.iter_mut().zip(mask_of).collect();
    crate::backend::cpu::team::for_each_mut(&mut work, |(d, mask), _| {
        if d.deferred.is_some() {
            // Drawn later, under its mask: never without it.
            return;
        }
        let seq = &seqs[&rows[d.index].id];
        let row = &logits[d.row * width..d.row * width + seq.vocab.unwrap_or(model_vocab)];
        let (token, failed) = draw_token(row, seq, mask.take(), &mut d.rng, eos);
        d.token = token;
        d.failed = failed;
        d.logprob = seq.params.logprobs.map(|n| score(row, d.token, n));
    });
    Ok((logits, draws))
}

/// Draws one token from a row of logits: the sequence's logit controls,
/// then its mask when it has a constraint, then its sampler. A mask that
/// could not be computed fails the draw.
fn draw_token(
    row: &[f32],
    seq: &Sequence,
    mask: Option<Result<Allowed>>,
    rng: &mut Rng,
    eos: &[u32],
) -> (u32, Option<EngineError>) {
    let history = History {
        prompt: &seq.prompt_ids,
        output: &seq.output_ids,
        eos,
    };
    let mut adjusted = adjust(row, &seq.params, &history);
    // Ids its tokenizer lacks are never drawn.
    if let Some(limit) = seq.id_limit.filter(|&l| l < row.len()) {
        let masked = adjusted.get_or_insert_with(|| row.to_vec());
        masked[limit..].fill(f32::NEG_INFINITY);
    }
    match (mask, adjusted) {
        (Some(Ok(allowed)), adjusted) => {
            let mut masked = adjusted.unwrap_or_else(|| row.to_vec());
            allowed.apply(&mut masked);
            (sample(&masked, &seq.params, rng), None)
        }
        (Some(Err(e)), _) => (0, Some(e)),
        (None, Some(adjusted)) => (sample(&adjusted, &seq.params, rng), None),
        (None, None) => (sample(row, &seq.params, rng), None),
    }
}
