//! The engine: one base model, its adapter pool, and mixed-adapter
//! continuous batching. One thread owns it and drives it with [`Engine::step`].

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, BackendShape};
use crate::error::{EngineError, Result};
use crate::kv::BlockAllocator;
use crate::model::tokenizer::Tokenizer;
use crate::model::{ModelConfig, WeightFiles};
use crate::pool::{AdapterId, AdapterPool, AdapterSource, AdapterStatus, PoolCounters, Residency};
use crate::prompter::Prompter;
use crate::scheduler::{Queues, SeqId};
use crate::sequence::Sequence;
use lorafleet_domain::RequestId;
use lorafleet_domain::digest::BaseHash;
use lorafleet_domain::generation::Field;

use crate::masks;
pub use crate::masks::lower_priority as lower_thread_priority;
mod step;
pub mod texts;

pub use crate::request::{Accepted, Completion, Event, Fairness, Prompt, Request};
pub use crate::settings::{BackendChoice, EngineSettings};

/// A point-in-time view of the engine's load.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    /// Blocks whose contents are kept for reuse (held or idle).
    pub kv_blocks_cached: usize,
    pub prefix: crate::kv::PrefixCounters,
    pub pool: PoolCounters,
    pub adapters: Vec<AdapterStatus>,
    /// Changes whenever adapter residency changes.
    pub residency_generation: u64,
    /// Per fairness key (tenant) that has been served: its waiting
    /// requests and its weighted service so far.
    pub fair_shares: Vec<FairShare>,
    /// How decode steps ran through CUDA graphs (None on the CPU backend).
    pub graphs: Option<crate::backend::GraphCounters>,
    pub run: RunCounters,
    /// How the memory budget shared by KV blocks and adapter slots is
    /// divided now; None without one.
    pub memory: Option<crate::budget::MemorySplit>,
}

/// One fairness key's place in the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct FairShare {
    pub key: String,
    pub waiting: usize,
    /// Tokens fed (prefill and decode), divided by the key's weight.
    pub served: f64,
}

/// What a run of the engine has done, for run statistics: steps that ran a
/// batch, the distinct adapters over them, and the longest a request
/// waited, in steps that ran without it, before it was first scheduled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunCounters {
    pub steps: u64,
    /// The sum over steps of the distinct adapters (the base counts as
    /// one) in each.
    pub distinct_adapters: u64,
    pub max_wait_steps: u64,
    /// Constrained rows whose mask was not in by their step's budget: each
    /// waited a step instead of the batch.
    pub late_masks: u64,
    /// Wall time of the steps' forward passes and draws: what the
    /// requests' [`Finish::device_time`](crate::Finish) shares add up to.
    pub busy: std::time::Duration,
    /// Time of the adapter copies into device slots: what the requests'
    /// [`Finish::load_time`](crate::Finish) shares and
    /// `unattributed_loads` add up to.
    pub loads: std::time::Duration,
    /// Of `loads`, the copies no live request of the adapter waited for
    /// (a promotion ahead of traffic).
    pub unattributed_loads: std::time::Duration,
}

impl RunCounters {
    /// The mean distinct adapters per step that ran a batch.
    pub fn mean_distinct_adapters(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            self.distinct_adapters as f64 / self.steps as f64
        }
    }
}

/// What one step did, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepStats {
    pub sequences: usize,
    pub tokens: usize,
    pub distinct_adapters: usize,
    pub preempted: usize,
    /// Constrained rows whose mask came too late for the step.
    pub late_masks: usize,
}

/// The multi-LoRA engine.
pub struct Engine {
    config: ModelConfig,
    tokenizer: Arc<Tokenizer>,
    prompter: Prompter,
    backend: Box<dyn Backend>,
    base_hash: BaseHash,
    settings: EngineSettings,
    pool: AdapterPool,
    kv: BlockAllocator,
    /// The sliding layers' rings (a model with both kinds of layers).
    ring: BlockAllocator,
    /// The byte budget the KV cache and the slots share, if any.
    budget: Option<Arc<crate::budget::MemoryBudget>>,
    queues: Queues,
    seqs: HashMap<SeqId, Sequence>,
    by_request: HashMap<RequestId, SeqId>,
    next_seq: SeqId,
    seed_source: crate::sampling::Rng,
    last_step: StepStats,
    run: RunCounters,
    fair: crate::scheduler::FairShares,
    constraints: crate::constraint::Compiler,
    /// The threads that compute constrained rows' token masks.
    masks: masks::MaskPool,
    /// A harmony model's markers (GPT-OSS): its answers are read as
    /// messages, each token's text tagged with its message's channel.
    harmony: Option<crate::model::harmony::HarmonyTokens>,
    /// The adapters that ship a tokenizer of their own ([`texts`]).
    texts: HashMap<AdapterId, texts::TextSide>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.backend.name())
            .field("base_hash", &self.base_hash)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Loads a model directory onto the CPU backend.
    pub fn load_cpu(model_dir: &Path, settings: EngineSettings) -> Result<Engine> {
        Engine::load(model_dir, settings, BackendChoice::Cpu)
    }

    /// Loads a model directory onto the chosen backend.
    pub fn load(
        model_dir: &Path,
        settings: EngineSettings,
        choice: BackendChoice,
    ) -> Result<Engine> {
        settings.validate()?;
        // A missing GPU stack fails before the model is read.
        if let BackendChoice::Cuda { .. } = choice {
            crate::backend::cuda::probe()?;
        }
        let config = ModelConfig::from_dir(model_dir)?;
        let mut settings = settings;
        // A model with both kinds of layers (Gemma) keeps each running
        // sequence's sliding-layer keys and values in a ring that covers
        // what one step reads and writes: the window behind a chunk and
        // the chunk, and a block for the alignment.
        let ring_len = match config.sliding_window {
            Some(window) if config.mixed_layers() => {
                (window + settings.max_batched_tokens - 1).div_ceil(settings.block_size) + 1
            }
            _ => 0,
        };
        if let Some(bytes) = settings.memory_budget_bytes {
            if !matches!(choice, BackendChoice::Cpu) {
                return Err(EngineError::setting(
                    "memory_budget_bytes",
                    "the cuda backend divides device memory by its memory plan; a budget shared by KV blocks and adapter slots is the cpu backend's",
                ));
            }
            let units =
                CpuBackend::memory_units(&config, settings.block_size, settings.max_lora_rank);
            let rings = ring_bytes(&config, ring_len, &settings)?;
            settings.kv_blocks =
                crate::budget::MemoryBudget::new(bytes - rings, units)?.max_kv_blocks();
        }
        let base_hash = WeightFiles::open_model_dir(model_dir)?.base_hash(&mut |_, _| {})?;
        let shape = BackendShape {
            slots: settings.max_loras,
            max_lora_rank: settings.max_lora_rank,
            kv_blocks: settings.kv_blocks,
            block_size: settings.block_size,
            ring_len,
            ring_blocks: ring_len * settings.max_num_seqs,
        };
        let backend: Box<dyn Backend> = match choice {
            BackendChoice::Cpu => Box::new(CpuBackend::load(model_dir, &config, shape)?),
            BackendChoice::Cuda {
                device,
                dtype,
                lora_dtype,
                graphs,
                pdl,
            } => {
                let limits = crate::backend::cuda::StepLimits {
                    max_tokens: settings.max_batched_tokens,
                    max_rows: settings.max_num_seqs.min(settings.max_batched_tokens),
                };
                let mut cuda = crate::backend::cuda::CudaBackend::load_with_slot_dtype(
                    model_dir, &config, shape, device, dtype, lora_dtype, limits,
                )?;
                cuda.set_graphs(graphs);
                cuda.set_pdl(pdl);
                Box::new(cuda)
            }
        };
        let tokenizer = Tokenizer::from_dir(model_dir)?;
        Engine::new(config, tokenizer, backend, base_hash, settings)
    }

    /// Assembles an engine around a loaded backend.
    pub fn new(
        config: ModelConfig,
        tokenizer: Tokenizer,
        backend: Box<dyn Backend>,
        base_hash: BaseHash,
        settings: EngineSettings,
    ) -> Result<Engine> {
        settings.validate()?;
        let shape = backend.shape();
        if shape.slots != settings.max_loras || shape.max_lora_rank != settings.max_lora_rank {
            return Err(EngineError::Backend(
                "the backend's slots do not match the settings".into(),
            ));
        }
        let mut pool = AdapterPool::new(
            config.clone(),
            settings.max_lora_rank,
            settings.max_loras,
            settings.max_cpu_loras,
            base_hash.clone(),
        );
        if let Some(p) = settings.max_pinned {
            pool.set_max_pinned(p);
        }
        pool.set_host_byte_budget(settings.max_cpu_lora_bytes);
        pool.set_eviction(settings.eviction);
        // A block's sliding-layer keys are gone once the window passes
        // it, so a model with rings caches no prefixes.
        let mut kv = BlockAllocator::with_caching(
            settings.kv_blocks,
            settings.block_size,
            settings.prefix_caching && shape.ring_len == 0,
        );
        let ring = BlockAllocator::with_caching(shape.ring_blocks, settings.block_size, false);
        let budget = match settings.memory_budget_bytes {
            None => None,
            Some(bytes) => {
                let units = backend.memory_units().ok_or_else(|| {
                    EngineError::setting(
                        "memory_budget_bytes",
                        format!(
                            "the {} backend divides its memory by its own plan, not by a shared budget",
                            backend.name()
                        ),
                    )
                })?;
                let rings = ring_bytes(&config, shape.ring_len, &settings)?;
                let budget = Arc::new(crate::budget::MemoryBudget::new(bytes - rings, units)?);
                if settings.kv_blocks > budget.max_kv_blocks() {
                    return Err(EngineError::setting(
                        "kv_blocks",
                        format!(
                            "{} blocks do not fit a memory budget of {bytes} bytes beside one slot (at most {})",
                            settings.kv_blocks,
                            budget.max_kv_blocks()
                        ),
                    ));
                }
                kv.set_budget(budget.clone());
                pool.set_budget(budget.clone());
                Some(budget)
            }
        };
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let tokenizer = Arc::new(tokenizer);
        let harmony = crate::model::harmony::HarmonyTokens::of(&tokenizer);
        let constraints = crate::constraint::Compiler::new(
            tokenizer.clone(),
            config.vocab_size,
            config.eos_token_ids.first().copied().unwrap_or(0),
            harmony.is_some(),
        );
        let prompter = Prompter::new(
            tokenizer.clone(),
            config.vocab_size,
            config.rope.max_model_len(config.max_position_embeddings),
        );
        Ok(Engine {
            kv,
            ring,
            budget,
            config,
            tokenizer,
            prompter,
            backend,
            base_hash,
            settings,
            pool,
            queues: Queues::default(),
            seqs: HashMap::new(),
            by_request: HashMap::new(),
            next_seq: 0,
            seed_source: crate::sampling::Rng::new(seed),
            last_step: StepStats::default(),
            run: RunCounters::default(),
            fair: crate::scheduler::FairShares::default(),
            constraints,
            masks: masks::MaskPool::new(masks::MASK_THREADS),
            harmony,
            texts: HashMap::new(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn base_hash(&self) -> &BaseHash {
        &self.base_hash
    }

    pub fn settings(&self) -> EngineSettings {
        self.settings
    }

    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    pub fn device_name(&self) -> String {
        self.backend.device_name()
    }

    /// Changes whenever adapter residency changes: the same number as
    /// [`EngineStats::residency_generation`], without building the stats.
    pub fn residency_generation(&self) -> u64 {
        self.pool.generation()
    }

    /// Device memory in use and in all, where the backend has its own.
    pub fn device_memory(&self) -> Option<crate::backend::DeviceMemory> {
        self.backend.device_memory()
    }

    /// How long each adapter's copy into a device slot took, since the
    /// last call.
    pub fn take_slot_upload_times(&mut self) -> Vec<Duration> {
        self.pool.take_upload_times()
    }

    /// Bytes the base model's weights take in the backend's memory.
    pub fn weight_bytes(&self) -> u64 {
        self.backend.weight_bytes()
    }

    /// How the backend divides device memory, if it has its own.
    pub fn memory_plan(&self) -> Option<crate::backend::cuda::plan::MemoryPlan> {
        self.backend.memory_plan()
    }

    /// The longest prompt plus completion accepted.
    pub fn max_model_len(&self) -> usize {
        self.config
            .rope
            .max_model_len(self.config.max_position_embeddings)
    }

    /// Makes an adapter known under its id. Loading happens on first use or
    /// on [`Engine::prefetch`].
    pub fn register_adapter(&mut self, id: AdapterId, source: AdapterSource) -> Result<()> {
        self.register_loaded_adapter(id, source, None)
    }

    /// [`Engine::register_adapter`] with the adapter already read from
    /// `source` and checked, so it is not read and parsed a second time.
    pub fn register_loaded_adapter(
        &mut self,
        id: AdapterId,
        source: AdapterSource,
        loaded: Option<crate::lora::HostAdapter>,
    ) -> Result<()> {
        let text = self.adapter_text(&source.name, &source.dir)?;
        let vocab = text.as_ref().map_or(self.config.vocab_size, |t| t.vocab);
        if let Some(adapter) = &loaded {
            crate::pool::check_fits(
                adapter,
                vocab,
                self.config.vocab_size,
                self.budget.as_deref(),
            )
            .map_err(|e| EngineError::request(Field::Adapter, e.to_string()))?;
        }
        self.pool
            .register_loaded(id, source, loaded)
            .map_err(|e| EngineError::request(Field::Adapter, e.to_string()))?;
        self.pool.set_vocab(id, vocab);
        match text {
            Some(t) => self.texts.insert(id, t),
            None => self.texts.remove(&id),
        };
        Ok(())
    }

    pub fn is_registered(&self, id: AdapterId) -> bool {
        self.pool.is_registered(id)
    }

    /// Starts loading a registered adapter into the host tier.
    pub fn prefetch(&mut self, id: AdapterId) {
        self.pool.request_load(id);
    }

    pub fn pool(&mut self) -> &mut AdapterPool {
        &mut self.pool
    }

    /// Puts a host-resident adapter into a device slot now, if one can be had.
    pub fn promote(&mut self, id: AdapterId) -> Result<Option<usize>> {
        let slot = self.pool.ensure_device(id, &[], self.backend.as_mut());
        self.charge_loads();
        slot
    }

    /// Unloads an adapter now, or once the requests using it finish.
    pub fn unload_adapter(&mut self, id: AdapterId) -> Result<(Residency, u32)> {
        self.pool.unload(id, self.backend.as_mut())
    }

    /// Turns a prompt into token ids.
    /// Makes every token mask wait `delay` before it is computed (tests:
    /// a mask later than any step's budget).
    #[doc(hidden)]
    pub fn delay_masks(&self, delay: std::time::Duration) {
        self.masks.set_delay(delay);
    }

    /// Queues a request. Fails at once for a bad request, an unknown
    /// adapter, a duplicate id or a full queue.
    pub fn submit(&mut self, request: Request) -> Result<Accepted> {
        self.submit_fair(request, Fairness::default())
    }

    /// [`Engine::submit`], on the share of `fairness.key`.
    pub fn submit_fair(&mut self, request: Request, fairness: Fairness) -> Result<Accepted> {
        if !(fairness.weight.is_finite() && fairness.weight > 0.0) {
            return Err(EngineError::request(
                Field::FairnessWeight,
                format!("{} is not a positive number", fairness.weight),
            ));
        }
        if request.id.as_str().is_empty() {
            return Err(EngineError::request(Field::RequestId, "is required"));
        }
        if self.by_request.contains_key(&request.id) {
            return Err(EngineError::request(
                Field::RequestId,
                format!("{:?} is already running", request.id.as_str()),
            ));
        }
        if self.queues.waiting.len() >= self.settings.max_waiting {
            return Err(EngineError::QueueFull {
                waiting: self.queues.waiting.len(),
            });
        }
        if let Some(a) = request.adapter
            && !self.pool.is_registered(a)
        {
            return Err(EngineError::request(
                Field::Adapter,
                format!("adapter {a} is not registered"),
            ));
        }
        let own = request.adapter.and_then(|a| self.texts.get(&a)).cloned();
        let vocab = own.as_ref().map_or(self.config.vocab_size, |t| t.vocab);
        request.params.check_vocab(vocab)?;
        let prompter = own.as_ref().map_or(&self.prompter, |t| &t.prompter);
        // Token ids (as the worker sends, having tokenized on another
        // thread) are only checked here; text is tokenized here.
        let prompt_ids = match request.prompt {
            Prompt::TokenIds(ids) => {
                prompter.check(&ids)?;
                ids
            }
            ref other => prompter.tokenize(other)?,
        };
        prompter.check_length(prompt_ids.len(), request.params.max_tokens)?;
        let needed = prompt_ids.len() + request.params.max_tokens;
        let (blocks, room) = (self.kv_need(needed), self.kv_room(request.adapter));
        if blocks > room {
            return Err(EngineError::request(
                Field::MaxTokens,
                format!("{needed} tokens need {blocks} KV blocks; the cache has {room}"),
            ));
        }
        let harmony = self.harmony.and_then(|t| {
            crate::model::harmony::HarmonyReader::after_prompt(t, &prompt_ids, &self.tokenizer)
        });
        if let (Some(_), None, Some(c)) = (self.harmony, &harmony, &request.params.constraint) {
            // A harmony model's constraints bind a message's body.
            return Err(EngineError::request(
                c.field(),
                "on a harmony (GPT-OSS) model a constraint binds an answer's message; \
                 this prompt opens none (ask through chat)",
            ));
        }
        let grammar = match &request.params.constraint {
            Some(c) => Some(std::sync::Arc::new(std::sync::Mutex::new(
                own.as_ref()
                    .map_or(&self.constraints, |t| &t.constraints)
                    .compile(c)?,
            ))),
            None => None,
        };
        let residency = request.adapter.map(|a| self.pool.on_arrival(a));
        let seed = request
            .params
            .seed
            .unwrap_or_else(|| self.seed_source.next_u64());
        let accepted = Accepted {
            prompt_tokens: prompt_ids.len(),
            residency,
        };
        // The identity of the weights the KV will come from: the adapter's
        // artifact digest, or the base hash (never a name or an id alone).
        let identity = match request.adapter {
            Some(a) => self.pool.weights_identity(a).unwrap_or_default(),
            None => self.base_hash.as_str(),
        };
        let mut weights_seed = crate::kv::weights_seed(identity);
        // Dynamic NTK rotates a prompt longer than the model's context by
        // frequencies of its own length: its blocks are its length's alone.
        if let Some(n) = self.config.rope.dynamic_after()
            && prompt_ids.len() > n
        {
            let len = u32::try_from(prompt_ids.len()).unwrap_or(u32::MAX);
            weights_seed = crate::kv::chain(&weights_seed, &[u32::MAX - 1, len]);
        }
        let id = self.next_seq;
        self.next_seq += 1;
        self.by_request.insert(request.id.clone(), id);
        self.seqs.insert(
            id,
            Sequence::new(
                request.id,
                request.adapter,
                prompt_ids,
                request.params,
                seed,
                residency,
                weights_seed,
            ),
        );
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.arrived_step = self.run.steps;
            seq.grammar = grammar;
            seq.id_limit = own.as_ref().and_then(|t| t.id_limit);
            seq.vocab = (vocab != self.config.vocab_size).then_some(vocab);
            seq.tokenizer = own.map(|t| t.tokenizer().clone());
            seq.harmony = harmony;
            // Its adapter was in a device slot when it came: no wait.
            if residency == Some(Residency::Device) {
                seq.adapter_ready = Some(seq.arrived);
            }
        }
        let key: std::sync::Arc<str> = std::sync::Arc::from(fairness.key.as_str());
        // The other live requests' keys (this one is in `seqs` already).
        let others: Vec<std::sync::Arc<str>> = self
            .seqs
            .iter()
            .filter(|(s, _)| **s != id)
            .map(|(_, s)| s.fair_key.clone())
            .collect();
        if !others.contains(&key) {
            self.fair.activate(&key, others.iter().map(|k| &**k));
        }
        let seq = self.seqs.get_mut(&id).expect("just inserted");
        seq.fair_key = key;
        seq.fair_weight = fairness.weight;
        self.queues.waiting.push_back(id);
        Ok(accepted)
    }

    /// Cancels a request, freeing its KV blocks and lease at once. Returns
    /// whether it was live.
    pub fn abort(&mut self, request_id: &RequestId) -> bool {
        let Some(id) = self.by_request.remove(request_id) else {
            return false;
        };
        self.remove(id);
        true
    }

    fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let mut seq = self.seqs.remove(&id)?;
        self.by_request.remove(&seq.request_id);
        self.kv.release(&mut seq.blocks);
        self.ring.release(&mut seq.ring);
        if self.queues.waiting.contains(&id) {
            self.queues.waiting.retain(|&w| w != id);
            if let Some(a) = seq.adapter {
                self.pool.on_dequeue(a);
            }
        }
        self.queues.running.retain(|&r| r != id);
        seq.lease = None;
        Some(seq)
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.seqs.is_empty()
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.queues.running.len(),
            waiting: self.queues.waiting.len(),
            kv_blocks_used: self.kv.used_blocks(),
            kv_blocks_total: self.kv.total(),
            kv_blocks_cached: self.kv.cached_blocks(),
            prefix: self.kv.counters(),
            pool: self.pool.counters(),
            adapters: self.pool.statuses(),
            residency_generation: self.pool.generation(),
            fair_shares: self.fair_shares(),
            graphs: self.backend.graph_counters(),
            run: self.run,
            memory: self.budget.as_ref().map(|b| b.split()),
        }
    }

    fn fair_shares(&self) -> Vec<FairShare> {
        let mut waiting: HashMap<&str, usize> = HashMap::new();
        for id in &self.queues.waiting {
            *waiting.entry(&self.seqs[id].fair_key).or_default() += 1;
        }
        let mut out: Vec<FairShare> = self
            .fair
            .keys()
            .map(|(key, served)| FairShare {
                key: key.to_owned(),
                waiting: waiting.get(key).copied().unwrap_or(0),
                served,
            })
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        out
    }

    /// What the last step ran.
    pub fn last_step(&self) -> StepStats {
        self.last_step
    }
}

/// What the sliding layers' rings of `ring_len` blocks a sequence take,
/// which a shared memory budget sets aside before it divides the rest;
/// refused when they alone do not fit it.
fn ring_bytes(config: &ModelConfig, ring_len: usize, settings: &EngineSettings) -> Result<u64> {
    let shape = BackendShape {
        slots: settings.max_loras,
        max_lora_rank: settings.max_lora_rank,
        kv_blocks: settings.kv_blocks,
        block_size: settings.block_size,
        ring_len,
        ring_blocks: ring_len * settings.max_num_seqs,
    };
    let rings = CpuBackend::ring_bytes(config, &shape);
    match settings.memory_budget_bytes {
        Some(bytes) if bytes < rings => Err(EngineError::setting(
            "memory_budget_bytes",
            format!(
                "{bytes} bytes do not hold the sliding layers' rings ({rings} bytes for max_num_seqs {})",
                settings.max_num_seqs
            ),
        )),
        _ => Ok(rings),
    }
}

impl Engine {
    /// Submits every request at once and steps until all are done: one
    /// continuous mixed batch. Results are in request order.
    pub fn run_to_completion(&mut self, requests: Vec<Request>) -> Result<Vec<Completion>> {
        self.run_with_progress(requests, &mut |_, _| {})
    }

    /// [`Engine::run_to_completion`], calling `progress(done, total)` as
    /// requests finish.
    pub fn run_with_progress(
        &mut self,
        requests: Vec<Request>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Vec<Completion>> {
        let total = requests.len();
        let mut index = HashMap::new();
        let mut out: Vec<Completion> = Vec::with_capacity(total);
        let mut backlog = std::collections::VecDeque::new();
        for (i, request) in requests.into_iter().enumerate() {
            let mut completion = Completion {
                request_id: request.id.clone(),
                prompt_ids: self
                    .text_side(request.adapter)
                    .prompter
                    .tokenize(&request.prompt)
                    .unwrap_or_default(),
                token_ids: Vec::new(),
                text: String::new(),
                finish: None,
                error: None,
                logprobs: Vec::new(),
                prompt_logprobs: Vec::new(),
            };
            if index.contains_key(&request.id) {
                completion.error = Some(EngineError::request(
                    Field::RequestId,
                    format!("{:?} appears twice in the batch", request.id.as_str()),
                ));
            } else {
                index.insert(request.id.clone(), i);
                backlog.push_back((i, request));
            }
            out.push(completion);
        }
        let mut done = out.iter().filter(|c| c.error.is_some()).count();
        progress(done, total);
        loop {
            // Feed the queue as it drains, so a batch larger than
            // max_waiting runs instead of being refused.
            while self.queues.waiting.len() < self.settings.max_waiting
                && let Some((i, request)) = backlog.pop_front()
            {
                if let Err(e) = self.submit(request) {
                    out[i].error = Some(e);
                    done += 1;
                    progress(done, total);
                }
            }
            if !self.has_work() {
                break;
            }
            for (request_id, event) in self.step()? {
                let c = &mut out[index[&request_id]];
                match event {
                    Event::Delta {
                        token_ids,
                        text,
                        logprobs,
                        ..
                    } => {
                        c.token_ids.extend(token_ids);
                        c.text.push_str(&text);
                        c.logprobs.extend(logprobs);
                    }
                    Event::PromptLogprobs(scored) => c.prompt_logprobs.extend(scored),
                    Event::Finished(f) => {
                        c.finish = Some(f);
                        done += 1;
                        progress(done, total);
                    }
                    Event::Failed(e) => {
                        c.error = Some(e);
                        done += 1;
                        progress(done, total);
                    }
                }
            }
        }
        Ok(out)
    }
}
