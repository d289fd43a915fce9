//! `lorafleet-worker generate`: the offline batch command, like vLLM's
//! `LLM.generate`. Every input line is checked before any work starts.

use std::collections::BTreeMap;
use std::io::{BufRead, BufWriter, IsTerminal, Write};
use std::path::PathBuf;

use anyhow::{Context, bail};
use lorafleet_engine::constraint::Constraint;
use lorafleet_engine::{
    AdapterSource, Choices, Engine, EngineError, Field, FinishReason, GenerationSpec, Prompt,
    Request, Sampling,
};
use serde::Deserialize;

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// The base model directory.
    #[arg(long, env = "LORAFLEET_MODEL")]
    model: PathBuf,
    /// An adapter as NAME=DIR; repeat for more. Input lines name adapters by NAME.
    #[arg(long = "lora", value_name = "NAME=DIR")]
    loras: Vec<String>,
    /// The requests, one JSON object per line.
    #[arg(long)]
    input: PathBuf,
    /// Where to write the results, one JSON object per line, in input order.
    #[arg(long)]
    output: PathBuf,
    /// Where to write the run's statistics as JSON: adapter loads, steps,
    /// tokens, time, distinct adapters per step, the longest wait.
    #[arg(long)]
    stats: Option<PathBuf>,
    #[command(flatten)]
    engine: lorafleet_worker::server::EngineFlags,
}

/// One input line. Unknown fields are refused, not ignored.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InputLine {
    /// Text, tokenized with the model's special tokens; or
    /// `prompt_token_ids`, used as they are. Exactly one.
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    prompt_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    lora: Option<String>,
    #[serde(default = "default_max_tokens")]
    max_tokens: usize,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<usize>,
    min_p: Option<f32>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stop: Option<Vec<String>>,
    #[serde(default)]
    stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    ignore_eos: bool,
    /// Log probabilities of each completion token with this many
    /// alternatives; `prompt_logprobs` the same for the prompt's tokens.
    #[serde(default)]
    logprobs: Option<usize>,
    #[serde(default)]
    prompt_logprobs: Option<usize>,
    /// Token id -> bias, -100 to 100.
    #[serde(default)]
    logit_bias: BTreeMap<u32, f32>,
    #[serde(default)]
    min_tokens: usize,
    #[serde(default)]
    repetition_penalty: Option<f32>,
    #[serde(default)]
    frequency_penalty: f32,
    #[serde(default)]
    presence_penalty: f32,
    /// Structured outputs, at most one: a JSON schema (an object), any
    /// JSON object (`"json_object": true`), a regular expression, one of a
    /// list of strings, or a Lark grammar.
    #[serde(default)]
    json_schema: Option<serde_json::Value>,
    #[serde(default)]
    json_object: bool,
    #[serde(default)]
    regex: Option<String>,
    #[serde(default)]
    choice: Option<Vec<String>>,
    #[serde(default)]
    grammar: Option<String>,
}

impl InputLine {
    /// The line's constraint, or why it cannot have one.
    fn constraint(&mut self) -> Result<Option<Constraint>, String> {
        let mut found = Vec::new();
        if let Some(s) = self.json_schema.take() {
            found.push(Constraint::JsonSchema(s.to_string()));
        }
        if self.json_object {
            found.push(Constraint::JsonObject);
        }
        if let Some(r) = self.regex.take() {
            found.push(Constraint::Regex(r));
        }
        if let Some(c) = self.choice.take() {
            found.push(Constraint::Choice(c));
        }
        if let Some(g) = self.grammar.take() {
            found.push(Constraint::Grammar(g));
        }
        if found.len() > 1 {
            return Err(
                "at most one of json_schema, json_object, regex, choice and grammar".into(),
            );
        }
        Ok(found.pop())
    }
}

/// An input line's key for a field: the prompt's own two, else the
/// sampling field's name on the worker's wire, which a line's keys follow.
fn line_key(field: Field) -> String {
    match field {
        Field::Prompt | Field::PromptText => "prompt".into(),
        Field::PromptTokenIds => "prompt_token_ids".into(),
        other => {
            let path = other.wire_path();
            match path.strip_prefix("sampling.") {
                Some(key) => key.to_owned(),
                None => path,
            }
        }
    }
}

/// One position's log probability, as an output line carries it.
#[derive(Debug, serde::Serialize)]
struct Scored {
    token_id: u32,
    /// Null for the prompt's first token.
    logprob: Option<f32>,
    /// `[token_id, logprob]`, most likely first.
    top: Vec<(u32, f32)>,
}

fn scored(entries: &[lorafleet_engine::logprobs::TokenLogprob]) -> Vec<Scored> {
    entries
        .iter()
        .map(|e| Scored {
            token_id: e.token,
            logprob: e.logprob,
            top: e.top.clone(),
        })
        .collect()
}

fn default_max_tokens() -> usize {
    16
}

#[derive(Debug, serde::Serialize)]
struct OutputLine<'a> {
    index: usize,
    lora: Option<&'a str>,
    prompt_token_ids: &'a [u32],
    token_ids: &'a [u32],
    text: &'a str,
    finish_reason: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<Vec<Scored>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_logprobs: Option<Vec<Scored>>,
}

/// What `--stats` writes.
#[derive(Debug, serde::Serialize)]
struct RunStats {
    device_loads: u64,
    host_loads: u64,
    steps: u64,
    prompt_tokens: usize,
    generated_tokens: usize,
    wall_secs: f64,
    mean_distinct_adapters_per_step: f64,
    /// The most steps that ran while a request waited for its first one.
    max_wait_steps: u64,
    /// Copies into free device slots started for waiting requests, and the
    /// admissions that found their adapter where a prefetch put it.
    prefetches: u64,
    prefetch_hits: u64,
    /// Device loads at admission that a prefetch could have started a
    /// step earlier (a slot was free, the adapter in the host tier).
    late_loads: u64,
    device_evictions: u64,
    /// Times a running sequence was preempted, all requests together.
    preemptions: u64,
    /// How long the requests on an adapter waited for it to be in a ready
    /// device slot.
    adapter_wait: AdapterWait,
    /// With `--memory-budget-bytes`: the budget and the most of it KV
    /// blocks and filled adapter slots each took.
    #[serde(skip_serializing_if = "Option::is_none")]
    memory: Option<MemoryPeaks>,
}

#[derive(Debug, serde::Serialize)]
struct MemoryPeaks {
    budget_bytes: u64,
    peak_kv_bytes: u64,
    peak_adapter_bytes: u64,
}

/// Adapter-wait figures over the requests that named an adapter.
#[derive(Debug, serde::Serialize)]
struct AdapterWait {
    requests: usize,
    /// Of those, the ones whose adapter was not ready on arrival.
    waited: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

impl AdapterWait {
    fn of(waits: impl Iterator<Item = std::time::Duration>) -> AdapterWait {
        let mut ms: Vec<f64> = waits.map(|d| d.as_secs_f64() * 1e3).collect();
        ms.sort_by(f64::total_cmp);
        let at = |q: f64| {
            ms.get(((ms.len().max(1) - 1) as f64 * q).round() as usize)
                .copied()
                .unwrap_or(0.0)
        };
        AdapterWait {
            requests: ms.len(),
            waited: ms.iter().filter(|&&m| m > 0.0).count(),
            p50_ms: at(0.5),
            p99_ms: at(0.99),
            max_ms: ms.last().copied().unwrap_or(0.0),
        }
    }
}

/// Parses the `--lora NAME=DIR` flags.
fn parse_loras(flags: &[String]) -> anyhow::Result<BTreeMap<String, PathBuf>> {
    let mut out = BTreeMap::new();
    for flag in flags {
        let Some((name, dir)) = flag.split_once('=') else {
            bail!("--lora {flag:?}: expected NAME=DIR");
        };
        if name.is_empty() || dir.is_empty() {
            bail!("--lora {flag:?}: NAME and DIR must both be non-empty");
        }
        if out.insert(name.to_owned(), PathBuf::from(dir)).is_some() {
            bail!("--lora {flag:?}: the name {name:?} is given twice");
        }
    }
    Ok(out)
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let loras = parse_loras(&args.loras)?;
    let settings = args.engine.settings()?;
    let choice = args.engine.backend()?;
    let input = std::fs::File::open(&args.input)
        .with_context(|| format!("--input {}", args.input.display()))?;
    // Opened now, so a path that cannot be written fails before any work.
    let stats_file = args
        .stats
        .as_ref()
        .map(|path| {
            std::fs::File::create(path).with_context(|| format!("--stats {}", path.display()))
        })
        .transpose()?;
    let mut engine = Engine::load(&args.model, settings, choice)
        .with_context(|| format!("--model {}", args.model.display()))?;
    let ids: BTreeMap<&str, lorafleet_engine::AdapterId> = loras
        .keys()
        .zip(1..)
        .filter_map(|(n, i)| Some((n.as_str(), lorafleet_engine::AdapterId::new(i)?)))
        .collect();
    for (name, dir) in &loras {
        let source = AdapterSource {
            name: name.clone(),
            dir: dir.clone(),
            declared_base_hash: None,
            digest: None,
        };
        engine.register_adapter(ids[name.as_str()], source)?;
    }

    // Check every line before any work starts.
    let mut requests = Vec::new();
    let mut names: Vec<Option<String>> = Vec::new();
    let mut wants: Vec<(bool, bool)> = Vec::new();
    for (n, line) in std::io::BufReader::new(input).lines().enumerate() {
        let line_no = n + 1;
        let line = line.with_context(|| format!("{}: line {line_no}", args.input.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let at =
            |reason: String| anyhow::anyhow!("{}: line {line_no}: {reason}", args.input.display());
        let mut parsed: InputLine = serde_json::from_str(&line).map_err(|e| at(e.to_string()))?;
        let constraint = parsed.constraint().map_err(at)?;
        let adapter = match &parsed.lora {
            None => None,
            Some(name) => Some(*ids.get(name.as_str()).ok_or_else(|| {
                at(format!(
                    "lora: {name:?} is not one of the --lora names {:?}",
                    ids.keys().collect::<Vec<_>>()
                ))
            })?),
        };
        let params = Sampling {
            max_tokens: parsed.max_tokens,
            temperature: parsed.temperature.unwrap_or(1.0),
            top_p: parsed.top_p.unwrap_or(1.0),
            top_k: parsed.top_k.unwrap_or(0),
            min_p: parsed.min_p.unwrap_or(0.0),
            seed: parsed.seed,
            stop: parsed.stop.unwrap_or_default(),
            stop_token_ids: parsed.stop_token_ids.unwrap_or_default(),
            ignore_eos: parsed.ignore_eos,
            logprobs: parsed.logprobs,
            prompt_logprobs: parsed.prompt_logprobs,
            logit_bias: parsed.logit_bias.into_iter().collect(),
            min_tokens: parsed.min_tokens,
            repetition_penalty: parsed.repetition_penalty.unwrap_or(1.0),
            frequency_penalty: parsed.frequency_penalty,
            presence_penalty: parsed.presence_penalty,
            constraint,
        };
        let prompt = match (parsed.prompt, parsed.prompt_token_ids) {
            (Some(text), None) => Prompt::Text(text),
            (None, Some(ids)) => Prompt::TokenIds(ids),
            _ => {
                return Err(at(
                    "exactly one of prompt and prompt_token_ids is required".into()
                ));
            }
        };
        // A refusal names the line's own key.
        let refuse = |field: Field, reason: &str| at(format!("{}: {reason}", line_key(field)));
        let spec = GenerationSpec {
            prompt,
            sampling: params,
            choices: Choices::ONE,
        };
        let spec = spec.validate().map_err(|e| refuse(e.field, &e.reason))?;
        // The line's adapter's text side: its own tokenizer and vocabulary
        // where it has them, the base model's otherwise.
        let text = engine.text_side(adapter);
        spec.sampling
            .check_vocab(text.vocab)
            .map_err(|e| refuse(e.field, &e.reason))?;
        let refused = |e: EngineError| match e {
            EngineError::InvalidRequest { field, reason } => refuse(field, &reason),
            other => at(other.to_string()),
        };
        if let Some(c) = &spec.sampling.constraint {
            text.constraints.compile(c).map(drop).map_err(refused)?;
        }
        let prompt_len = text.prompter.tokenize(&spec.prompt).map_err(refused)?.len();
        let s = &spec.sampling;
        if prompt_len + s.max_tokens > engine.max_model_len() {
            return Err(at(format!(
                "max_tokens: the prompt ({prompt_len} tokens) plus max_tokens ({}) exceeds max_model_len {}",
                s.max_tokens,
                engine.max_model_len()
            )));
        }
        wants.push((s.logprobs.is_some(), s.prompt_logprobs.is_some()));
        requests.push(Request::new(
            format!("line-{line_no}").into(),
            adapter,
            spec,
        ));
        names.push(parsed.lora);
    }

    let show = std::io::stderr().is_terminal();
    let started = std::time::Instant::now();
    let results = engine.run_with_progress(requests, &mut |done, total| {
        if show {
            eprint!(
                "\r{done}/{total} requests done, {:.1}s",
                started.elapsed().as_secs_f64()
            );
        }
    })?;
    let wall_secs = started.elapsed().as_secs_f64();
    if show {
        eprintln!();
    }
    if let (Some(mut file), Some(path)) = (stats_file, &args.stats) {
        let stats = engine.stats();
        let run = RunStats {
            device_loads: stats.pool.device_loads,
            host_loads: stats.pool.host_loads,
            steps: stats.run.steps,
            prompt_tokens: results.iter().map(|c| c.prompt_ids.len()).sum(),
            generated_tokens: results.iter().map(|c| c.token_ids.len()).sum(),
            wall_secs,
            mean_distinct_adapters_per_step: stats.run.mean_distinct_adapters(),
            max_wait_steps: stats.run.max_wait_steps,
            prefetches: stats.pool.prefetches,
            prefetch_hits: stats.pool.prefetch_hits,
            late_loads: stats.pool.late_loads,
            device_evictions: stats.pool.device_evictions,
            preemptions: results
                .iter()
                .filter_map(|c| c.finish.as_ref())
                .map(|f| u64::from(f.preemptions))
                .sum(),
            adapter_wait: AdapterWait::of(
                results
                    .iter()
                    .filter_map(|c| c.finish.as_ref()?.adapter_wait),
            ),
            memory: stats.memory.map(|m| MemoryPeaks {
                budget_bytes: m.budget,
                peak_kv_bytes: m.peak_kv,
                peak_adapter_bytes: m.peak_adapters,
            }),
        };
        let text = serde_json::to_string_pretty(&run)?;
        file.write_all((text + "\n").as_bytes())
            .with_context(|| format!("--stats {}", path.display()))?;
    }
    let out = std::fs::File::create(&args.output)
        .with_context(|| format!("--output {}", args.output.display()))?;
    let mut out = BufWriter::new(out);
    for (index, ((c, lora), &(logprobs, prompt_logprobs))) in
        results.iter().zip(&names).zip(&wants).enumerate()
    {
        if let Some(e) = &c.error {
            bail!("request {index} ({}) failed: {e}", c.request_id);
        }
        let finish = c
            .finish
            .as_ref()
            .expect("a completion without an error has finished");
        let line = OutputLine {
            index,
            lora: lora.as_deref(),
            prompt_token_ids: &c.prompt_ids,
            token_ids: &c.token_ids,
            text: &c.text,
            finish_reason: match finish.reason {
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
            },
            logprobs: logprobs.then(|| scored(&c.logprobs)),
            prompt_logprobs: prompt_logprobs.then(|| scored(&c.prompt_logprobs)),
        };
        serde_json::to_writer(&mut out, &line)?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    Ok(())
}
