//! One request's life inside the engine: its tokens, KV blocks, adapter
//! lease, random stream, and the output side (detokenization, stop strings,
//! finish reasons).

use std::time::{Duration, Instant};

use crate::error::Result;
use crate::kv::{BlockHash, chain};
use crate::model::harmony::{Channel, HarmonyReader, Step};
use crate::model::tokenizer::{IncrementalDecoder, Tokenizer};
use crate::pool::{AdapterId, Lease, Residency};
use crate::sampling::{Rng, Sampling};
use crate::stop::{StopState, StopStrings};
use lorafleet_domain::RequestId;
use lorafleet_domain::generation::Valid;

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token, a stop token or a stop string.
    Stop,
    /// `max_tokens`, or the model's maximum length.
    Length,
}

/// What exactly stopped a sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    Token(u32),
    String(String),
}

/// The summary of a finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    pub reason: FinishReason,
    pub stop: Option<StopReason>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub queue_time: Duration,
    pub time_to_first_token: Duration,
    pub total_time: Duration,
    /// Where the adapter was on arrival; None for the base model.
    pub residency: Option<Residency>,
    pub preemptions: u32,
    /// Prompt tokens served from the prefix cache (their prefill skipped).
    pub cached_tokens: usize,
    /// How long the request waited for its adapter to be in a ready
    /// device slot (zero when it was there on arrival); None for the base
    /// model.
    pub adapter_wait: Option<Duration>,
    /// The forward passes' time this request used: each step's wall time
    /// (forward pass and draws) shared among the step's sequences in
    /// proportion to the tokens each fed it, prefill chunks and decode
    /// tokens alike. Over a run the requests' shares add up to the
    /// engine's busy time (`RunCounters::busy`).
    pub device_time: Duration,
    /// Its share of the copies of its adapter into a device slot made
    /// while it waited or ran: each copy's time split evenly among the
    /// live requests of that adapter. Over a run these shares and the
    /// copies no request waited for (`RunCounters::unattributed_loads`)
    /// add up to `RunCounters::loads`. Zero for the base model.
    pub load_time: Duration,
}

#[derive(Debug)]
pub(crate) struct Sequence {
    pub request_id: RequestId,
    pub adapter: Option<AdapterId>,
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub params: Valid<Sampling>,
    pub rng: Rng,
    /// Positions whose keys and values are in the KV cache.
    pub num_computed: usize,
    pub blocks: Vec<u32>,
    /// The sliding layers' ring of a model with both kinds of layers
    /// (`BackendShape::ring_len`); empty otherwise.
    pub ring: Vec<u32>,
    pub lease: Option<Lease>,
    pub residency: Option<Residency>,
    pub arrived: Instant,
    /// When the scheduler first found its adapter in a ready device slot.
    pub adapter_ready: Option<Instant>,
    pub first_scheduled: Option<Instant>,
    pub first_token: Option<Instant>,
    pub preemptions: u32,
    /// The engine's step count when the request arrived, and how many
    /// steps ran before it was first scheduled.
    pub arrived_step: u64,
    pub waited_steps: Option<u64>,
    /// Steps this request waited while others were admitted past it.
    pub skipped: u32,
    /// The identity of the weights this sequence's KV comes from, which
    /// seeds its blocks' content keys.
    pub weights_seed: BlockHash,
    /// Its KV is rotated by LongRoPE's long frequencies: its length is past
    /// the model's pretraining context.
    pub long_rope: bool,
    /// Content keys of the sequence's full blocks, in order, as far as
    /// they have been needed.
    pub block_hashes: Vec<BlockHash>,
    /// Of `blocks`, how many are registered in the prefix cache.
    pub registered: usize,
    /// Prompt tokens whose prefill the prefix cache saved at admission.
    pub cached_tokens: usize,
    /// With `prompt_logprobs`: the prompt positions whose log probability
    /// has been sent (the first, which has none, counts once sent).
    pub prompt_scored: usize,
    /// The compiled constraint, when the request has one. Shared with the
    /// mask threads, which compute its next mask beside the forward pass.
    pub grammar: Option<std::sync::Arc<std::sync::Mutex<crate::constraint::Grammar>>>,
    /// The adapter's own tokenizer its text is read with; None: the base
    /// model's.
    pub tokenizer: Option<std::sync::Arc<Tokenizer>>,
    /// Draws no token at or past this id (its tokenizer has none there).
    pub id_limit: Option<usize>,
    /// Its logits per position where its adapter grows the vocabulary
    /// past the model's (its own embed_tokens and lm_head rows); None: the
    /// model's `vocab_size`.
    pub vocab: Option<usize>,
    /// A token still to be drawn: its logits are in, its mask was not
    /// when the step's budget ran out. The scheduler passes the sequence
    /// over until a step draws it.
    pub pending: Option<PendingDraw>,
    /// Its share of the steps it ran in ([`Finish::device_time`]).
    pub device_time: Duration,
    /// Its share of its adapter's slot copies ([`Finish::load_time`]).
    pub load_time: Duration,
    /// Whose share of the engine this request uses (the tenant), and the
    /// share's weight.
    pub fair_key: std::sync::Arc<str>,
    pub fair_weight: f64,
    /// A harmony model's answer (GPT-OSS): which message each token is in.
    pub harmony: Option<HarmonyReader>,
    detok: IncrementalDecoder,
    text: String,
    emitted: usize,
    stops: StopStrings,
    stop_state: StopState,
}

/// A constrained row's logits kept for a later step, with its mask in
/// the making.
#[derive(Debug)]
pub struct PendingDraw {
    pub(crate) logits: Vec<f32>,
    pub(crate) mask: crate::masks::MaskSlot,
}

/// What one new token produced.
#[derive(Debug, Default)]
pub(crate) struct TokenOutput {
    pub text: String,
    /// The harmony message `text` belongs to; None for other models and
    /// for a header's tokens.
    pub channel: Option<Channel>,
    pub finished: Option<(FinishReason, Option<StopReason>)>,
}

impl Sequence {
    pub fn new(
        request_id: RequestId,
        adapter: Option<AdapterId>,
        prompt_ids: Vec<u32>,
        params: Valid<Sampling>,
        seed: u64,
        residency: Option<Residency>,
        weights_seed: BlockHash,
    ) -> Sequence {
        Sequence {
            request_id,
            adapter,
            stops: StopStrings::new(&params.stop),
            stop_state: StopState::default(),
            detok: IncrementalDecoder::new(&prompt_ids),
            prompt_ids,
            output_ids: Vec::new(),
            params,
            rng: Rng::new(seed),
            num_computed: 0,
            blocks: Vec::new(),
            ring: Vec::new(),
            lease: None,
            residency,
            arrived: Instant::now(),
            adapter_ready: None,
            first_scheduled: None,
            first_token: None,
            preemptions: 0,
            arrived_step: 0,
            waited_steps: None,
            tokenizer: None,
            id_limit: None,
            vocab: None,
            skipped: 0,
            weights_seed,
            long_rope: false,
            block_hashes: Vec::new(),
            registered: 0,
            cached_tokens: 0,
            prompt_scored: 0,
            grammar: None,
            pending: None,
            device_time: Duration::ZERO,
            load_time: Duration::ZERO,
            fair_key: std::sync::Arc::from(""),
            fair_weight: 1.0,
            harmony: None,
            text: String::new(),
            emitted: 0,
        }
    }

    /// Switches to LongRoPE's long frequencies when the sequence's length
    /// is past `long_after` and its KV was not computed with them: its
    /// blocks' content keys change (other weights, in effect), and the
    /// caller recomputes every position, as transformers' Phi-3 recomputes
    /// its cache on crossing. Returns whether it switched.
    pub fn switch_to_long_rope(&mut self, long_after: Option<usize>) -> bool {
        if self.long_rope || long_after.is_none_or(|n| self.total_len() <= n) {
            return false;
        }
        self.long_rope = true;
        self.weights_seed = chain(&self.weights_seed, &[u32::MAX, 0x4c4f_4e47]);
        self.block_hashes.clear();
        true
    }

    /// Prompt plus output tokens.
    pub fn total_len(&self) -> usize {
        self.prompt_ids.len() + self.output_ids.len()
    }

    /// The content keys of the first `n` full blocks of prompt-then-output
    /// (every one of their positions must hold a token).
    pub fn hashes_upto(&mut self, n: usize, block_size: usize) -> &[BlockHash] {
        while self.block_hashes.len() < n {
            let i = self.block_hashes.len();
            let parent = match i {
                0 => self.weights_seed,
                _ => self.block_hashes[i - 1],
            };
            let tokens: Vec<u32> = (i * block_size..(i + 1) * block_size)
                .map(|p| self.token_at(p))
                .collect();
            self.block_hashes.push(chain(&parent, &tokens));
        }
        &self.block_hashes[..n]
    }

    /// The token at a position of prompt-then-output.
    pub fn token_at(&self, position: usize) -> u32 {
        if position < self.prompt_ids.len() {
            self.prompt_ids[position]
        } else {
            self.output_ids[position - self.prompt_ids.len()]
        }
    }

    /// Appends a sampled token and works out the text and whether to stop.
    pub fn push_token(
        &mut self,
        token: u32,
        tokenizer: &Tokenizer,
        eos: &[u32],
        max_model_len: usize,
    ) -> Result<TokenOutput> {
        if self.first_token.is_none() {
            self.first_token = Some(Instant::now());
        }
        self.output_ids.push(token);
        let mut finished = None;
        let mut channel = None;
        let mut message_ends = false;
        if (!self.params.ignore_eos && eos.contains(&token))
            || self.params.stop_token_ids.contains(&token)
        {
            // `<|call|>` and `<|return|>` end a harmony message as they end
            // the answer.
            if let Some(Step::Ends(c) | Step::Body(c)) =
                self.harmony.as_mut().map(|h| h.push(token, ""))
            {
                channel = Some(c);
            }
            finished = Some((FinishReason::Stop, Some(StopReason::Token(token))));
        } else {
            let before = self.text.len();
            let piece = self.detok.push(tokenizer, token)?;
            let step = self.harmony.as_mut().map(|h| h.push(token, &piece));
            match step {
                None => self.text.push_str(&piece),
                Some(Step::Body(c)) => {
                    self.text.push_str(&piece);
                    channel = Some(c);
                }
                // A header's words are not the answer's text.
                Some(Step::Header) => {}
                Some(Step::Ends(c)) => {
                    // What the message held back goes out with it; a stop
                    // string does not run on into the next message.
                    self.text.push_str(&self.detok.flush(tokenizer)?);
                    self.stop_state = StopState::default();
                    channel = Some(c);
                    message_ends = true;
                }
            }
            if let Some((at, stop)) = self.find_stop(before) {
                self.text.truncate(at);
                finished = Some((FinishReason::Stop, Some(StopReason::String(stop))));
            }
        }
        if finished.is_none()
            && (self.output_ids.len() >= self.params.max_tokens
                || self.total_len() >= max_model_len)
        {
            // The sequence ends here: release any text held for a partial
            // character, which may still complete a stop string (none of a
            // harmony header's).
            let before = self.text.len();
            let rest = self.detok.flush(tokenizer)?;
            if self.harmony.as_ref().is_none_or(HarmonyReader::in_body) {
                self.text.push_str(&rest);
            }
            finished = Some(match self.find_stop(before) {
                Some((at, stop)) => {
                    self.text.truncate(at);
                    (FinishReason::Stop, Some(StopReason::String(stop)))
                }
                None => (FinishReason::Length, None),
            });
        }
        let safe = if finished.is_some() || message_ends {
            self.text.len()
        } else {
            self.text.len() - self.stop_holdback()
        };
        let text = self.text[self.emitted.min(safe)..safe].to_owned();
        self.emitted = self.emitted.max(safe);
        Ok(TokenOutput {
            text,
            channel,
            finished,
        })
    }

    /// Ends the output here (a grammar completed): releases the text held
    /// back for a partial character or a possible stop string.
    pub fn flush(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let rest = self.detok.flush(tokenizer)?;
        if self.harmony.as_ref().is_none_or(HarmonyReader::in_body) {
            self.text.push_str(&rest);
        }
        let text = self.text[self.emitted.min(self.text.len())..].to_owned();
        self.emitted = self.text.len();
        Ok(text)
    }

    /// The first stop string that the text from `before` on completes,
    /// as (where the text is cut, the stop string). Only the new bytes are
    /// fed to the automaton, whose state carries over from earlier tokens.
    fn find_stop(&mut self, before: usize) -> Option<(usize, String)> {
        self.stops
            .feed(&mut self.stop_state, &self.text, before)
            .map(|m| (m.start, m.stop))
    }

    /// Bytes at the end of the text that could be the start of a stop string.
    fn stop_holdback(&self) -> usize {
        self.stops.held(&self.stop_state)
    }

    pub fn finish(&self, reason: FinishReason, stop: Option<StopReason>) -> Finish {
        let now = Instant::now();
        let since =
            |t: Option<Instant>| t.map_or(Duration::ZERO, |t| t.duration_since(self.arrived));
        Finish {
            reason,
            stop,
            prompt_tokens: self.prompt_ids.len(),
            completion_tokens: self.output_ids.len(),
            queue_time: since(self.first_scheduled),
            time_to_first_token: since(self.first_token),
            total_time: now.duration_since(self.arrived),
            residency: self.residency,
            preemptions: self.preemptions,
            cached_tokens: self.cached_tokens,
            adapter_wait: self.adapter.map(|_| since(self.adapter_ready)),
            device_time: self.device_time,
            load_time: self.load_time,
        }
    }
}
