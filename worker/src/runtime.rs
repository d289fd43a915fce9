//! The engine's own thread, and the async handle the gRPC service uses.
//!
//! One thread owns the [`Engine`] and drives it; everything else talks to it
//! through commands on a channel. Each request's events flow back on its own
//! channel; dropping a [`RequestStream`] before it finishes aborts the
//! request, so a client that disconnects frees its KV blocks at once. The
//! thread publishes a [`Report`] on a `watch` channel whenever adapter
//! residency changes, soon after a sequence is admitted or leaves, and at
//! least every `report_interval`; watchers always
//! see only the latest report, so a slow watcher never slows the engine.

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime};

use lorafleet_domain::RequestId;
use lorafleet_engine::engine::texts::TextSide;
use lorafleet_engine::lora::HostAdapter;
use lorafleet_engine::{
    Accepted, AdapterId, AdapterSource, Engine, EngineError, EngineStats, Event, Prompt, Request,
    Residency, StepStats,
};
use tokio::sync::{mpsc, oneshot, watch};

/// A snapshot of the engine, published by its thread.
#[derive(Debug, Clone)]
pub struct Report {
    /// Increases with every report.
    pub sequence: u64,
    pub produced_at: SystemTime,
    pub stats: EngineStats,
    pub last_step: StepStats,
}

type Reply<T> = oneshot::Sender<Result<T, EngineError>>;

enum Command {
    Submit {
        /// Boxed: a request's sampling parameters are large beside the
        /// other commands.
        request: Box<Request>,
        fairness: lorafleet_engine::Fairness,
        events: mpsc::UnboundedSender<Event>,
        reply: Reply<Accepted>,
    },
    Abort {
        id: RequestId,
    },
    Register {
        id: AdapterId,
        source: AdapterSource,
        loaded: Option<Box<HostAdapter>>,
        reply: Reply<Option<TextSide>>,
    },
    Prefetch {
        id: AdapterId,
        promote: bool,
        pin: Option<bool>,
        reply: Reply<()>,
    },
    Unload {
        id: AdapterId,
        reply: Reply<(Residency, u32)>,
    },
    Shutdown,
}

/// The async side of the engine thread. Cheap to clone.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    commands: std_mpsc::Sender<Command>,
    reports: watch::Receiver<Report>,
    prompter: lorafleet_engine::Prompter,
    constraints: lorafleet_engine::constraint::Compiler,
    /// The adapters that ship a tokenizer of their own, as registered.
    texts: Arc<RwLock<HashMap<AdapterId, TextSide>>>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Command::Submit { .. } => "Submit",
            Command::Abort { .. } => "Abort",
            Command::Register { .. } => "Register",
            Command::Prefetch { .. } => "Prefetch",
            Command::Unload { .. } => "Unload",
            Command::Shutdown => "Shutdown",
        })
    }
}

/// A request's events. Dropping it before `Finished` or `Failed` aborts the
/// request in the engine.
#[derive(Debug)]
pub struct RequestStream {
    id: RequestId,
    events: mpsc::UnboundedReceiver<Event>,
    commands: std_mpsc::Sender<Command>,
    done: bool,
}

impl RequestStream {
    /// The next event; None once the request has ended.
    pub async fn next(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        let event = self.events.recv().await;
        if matches!(
            event,
            None | Some(Event::Finished(_)) | Some(Event::Failed(_))
        ) {
            self.done = true;
        }
        event
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            // The engine thread may already be gone at shutdown; nothing to free then.
            let _ = self.commands.send(Command::Abort {
                id: self.id.clone(),
            });
        }
    }
}

/// The engine thread stopped, so the request cannot be served.
fn gone() -> EngineError {
    EngineError::Backend("the engine thread has stopped".into())
}

impl EngineHandle {
    /// Moves the engine onto its own thread.
    pub fn spawn(engine: Engine, report_interval: Duration) -> EngineHandle {
        let (commands, rx) = std_mpsc::channel();
        let first = Report {
            sequence: 0,
            produced_at: SystemTime::now(),
            stats: engine.stats(),
            last_step: engine.last_step(),
        };
        let (report_tx, reports) = watch::channel(first);
        let prompter = engine.prompter();
        let constraints = engine.constraint_compiler();
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || run(engine, rx, report_tx, report_interval))
            .expect("spawn the engine thread");
        EngineHandle {
            commands,
            reports,
            prompter,
            constraints,
            texts: Arc::default(),
        }
    }

    /// The text side of `adapter`'s requests: its own tokenizer's where
    /// it ships one, the base model's otherwise.
    pub fn text_side(&self, adapter: Option<AdapterId>) -> TextSide {
        adapter
            .and_then(|a| self.texts.read().expect("the texts' lock").get(&a).cloned())
            .unwrap_or_else(|| TextSide {
                prompter: self.prompter.clone(),
                constraints: self.constraints.clone(),
                id_limit: None,
                vocab: self.prompter.vocab_size(),
            })
    }

    /// Compiles a request's constraint on a blocking thread, never the
    /// engine's: a costly schema delays no one else's tokens, and the
    /// engine's own compile at submission finds it compiled (the cache
    /// the two share). A constraint that does not compile is refused here.
    pub async fn compile_constraint(
        &self,
        adapter: Option<AdapterId>,
        constraint: Option<&lorafleet_engine::constraint::Constraint>,
    ) -> Result<(), EngineError> {
        let Some(c) = constraint.cloned() else {
            return Ok(());
        };
        let compiler = self.text_side(adapter).constraints;
        let started = std::time::Instant::now();
        tokio::task::spawn_blocking(move || {
            // Below the engine thread: a tenant's costly schema takes
            // spare CPU, not the decode's.
            lorafleet_engine::engine::lower_thread_priority();
            compiler.compile(&c).map(drop)
        })
        .await
        .map_err(|e| EngineError::Backend(format!("the constraint thread failed: {e}")))??;
        crate::telemetry::record_constraint_compile(started.elapsed());
        Ok(())
    }

    /// Tokenizes a prompt and checks it against the model on a blocking
    /// thread, never the engine's: a long prompt delays no one else's
    /// tokens, and one that cannot fit never reaches the engine.
    pub async fn prepare(
        &self,
        adapter: Option<AdapterId>,
        prompt: Prompt,
        max_tokens: usize,
    ) -> Result<Vec<u32>, EngineError> {
        let prompter = self.text_side(adapter).prompter;
        let started = std::time::Instant::now();
        let ids = tokio::task::spawn_blocking(move || prompter.prepare(&prompt, max_tokens))
            .await
            .map_err(|e| EngineError::Backend(format!("the tokenizer thread failed: {e}")))??;
        crate::telemetry::record_tokenize(started.elapsed());
        Ok(ids)
    }

    /// Queues a request and returns its acceptance and its event stream.
    /// The model's tokenizer and limits.
    pub fn prompter(&self) -> &lorafleet_engine::Prompter {
        &self.prompter
    }

    pub async fn submit(&self, request: Request) -> Result<(Accepted, RequestStream), EngineError> {
        self.submit_fair(request, lorafleet_engine::Fairness::default())
            .await
    }

    /// [`EngineHandle::submit`] on the share of `fairness.key`.
    pub async fn submit_fair(
        &self,
        request: Request,
        fairness: lorafleet_engine::Fairness,
    ) -> Result<(Accepted, RequestStream), EngineError> {
        let (events_tx, events) = mpsc::unbounded_channel();
        let (reply, accepted) = oneshot::channel();
        let id = request.id.clone();
        self.commands
            .send(Command::Submit {
                request: Box::new(request),
                fairness,
                events: events_tx,
                reply,
            })
            .map_err(|_| gone())?;
        let accepted = accepted.await.map_err(|_| gone())??;
        Ok((
            accepted,
            RequestStream {
                id,
                events,
                commands: self.commands.clone(),
                done: false,
            },
        ))
    }

    /// Makes an adapter known to the engine; `loaded` is the adapter
    /// already read and checked from `source`, if the caller has it.
    pub async fn register(
        &self,
        id: AdapterId,
        source: AdapterSource,
        loaded: Option<HostAdapter>,
    ) -> Result<(), EngineError> {
        let loaded = loaded.map(Box::new);
        let text = self
            .call(|reply| Command::Register {
                id,
                source,
                loaded,
                reply,
            })
            .await?;
        let mut texts = self.texts.write().expect("the texts' lock");
        match text {
            Some(t) => texts.insert(id, t),
            None => texts.remove(&id),
        };
        Ok(())
    }

    /// Starts loading an adapter into the host tier; with `promote`, also
    /// into a device slot once loaded. `pin` pins or unpins it.
    pub async fn prefetch(
        &self,
        id: AdapterId,
        promote: bool,
        pin: Option<bool>,
    ) -> Result<(), EngineError> {
        self.call(|reply| Command::Prefetch {
            id,
            promote,
            pin,
            reply,
        })
        .await
    }

    /// Unloads an adapter; returns where it was and the leases still held.
    pub async fn unload(&self, id: AdapterId) -> Result<(Residency, u32), EngineError> {
        self.call(|reply| Command::Unload { id, reply }).await
    }

    /// The latest report, and a receiver for the ones to come.
    pub fn reports(&self) -> watch::Receiver<Report> {
        self.reports.clone()
    }

    /// Stops the engine thread after its current step.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
    }

    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.commands.send(make(reply)).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

/// The least time between two reports published for load changes alone.
const MIN_REPORT_GAP: Duration = Duration::from_millis(20);

/// The engine thread's loop.
fn run(
    mut engine: Engine,
    commands: std_mpsc::Receiver<Command>,
    reports: watch::Sender<Report>,
    interval: Duration,
) {
    let mut streams: HashMap<RequestId, mpsc::UnboundedSender<Event>> = HashMap::new();
    let mut pending_promotions: Vec<AdapterId> = Vec::new();
    let mut sequence = 0u64;
    let mut last_report = Instant::now();
    let mut last_generation = engine.residency_generation();
    // Set when a sequence is admitted or leaves, so routers see load moves
    // within MIN_REPORT_GAP instead of the next periodic report.
    let mut load_changed = false;
    loop {
        // Block for a command only when idle; otherwise take what is queued.
        let first = if engine.has_work() {
            commands.try_recv().ok()
        } else {
            let wait = if load_changed {
                MIN_REPORT_GAP.saturating_sub(last_report.elapsed())
            } else if pending_promotions.is_empty() {
                interval
                    .saturating_sub(last_report.elapsed())
                    .max(Duration::from_millis(1))
            } else {
                Duration::from_millis(10)
            };
            match commands.recv_timeout(wait) {
                Ok(c) => Some(c),
                Err(std_mpsc::RecvTimeoutError::Timeout) => None,
                Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
            }
        };
        let mut next = first;
        while let Some(command) = next.take() {
            match command {
                Command::Submit {
                    request,
                    fairness,
                    events,
                    reply,
                } => {
                    let id = request.id.clone();
                    let result = engine.submit_fair(*request, fairness);
                    if result.is_ok() {
                        streams.insert(id, events);
                        load_changed = true;
                    }
                    let _ = reply.send(result);
                }
                Command::Abort { id } => {
                    streams.remove(&id);
                    engine.abort(&id);
                    load_changed = true;
                }
                Command::Register {
                    id,
                    source,
                    loaded,
                    reply,
                } => {
                    let loaded = loaded.map(|b| *b);
                    let registered = engine.register_loaded_adapter(id, source, loaded);
                    let _ = reply.send(registered.map(|()| engine.own_text(id)));
                }
                Command::Prefetch {
                    id,
                    promote,
                    pin,
                    reply,
                } => {
                    let pinned = match pin {
                        Some(pin) => engine.pool().set_pinned(id, pin),
                        None => Ok(()),
                    };
                    if pinned.is_ok() {
                        engine.prefetch(id);
                        if promote {
                            pending_promotions.push(id);
                        }
                    }
                    let _ = reply.send(pinned);
                }
                Command::Unload { id, reply } => {
                    pending_promotions.retain(|&p| p != id);
                    let _ = reply.send(engine.unload_adapter(id));
                }
                Command::Shutdown => return,
            }
            next = commands.try_recv().ok();
        }

        if engine.has_work() {
            let step_started = Instant::now();
            match engine.step() {
                Ok(events) => {
                    let step_time = step_started.elapsed();
                    let generated: usize = events
                        .iter()
                        .map(|(_, e)| {
                            if let Event::Delta { token_ids, .. } = e {
                                token_ids.len()
                            } else {
                                0
                            }
                        })
                        .sum();
                    crate::telemetry::record_step(&engine.last_step(), generated, step_time);
                    for (id, event) in events {
                        let last = matches!(event, Event::Finished(_) | Event::Failed(_));
                        let delivered = streams.get(&id).is_some_and(|tx| tx.send(event).is_ok());
                        if last {
                            streams.remove(&id);
                            load_changed = true;
                        } else if !delivered {
                            // The client went away: free the sequence now.
                            streams.remove(&id);
                            engine.abort(&id);
                            load_changed = true;
                        }
                    }
                }
                Err(e) => {
                    // A backend failure fails every live request; the engine
                    // stays up for the next ones.
                    let message = e.to_string();
                    for (id, tx) in streams.drain() {
                        engine.abort(&id);
                        let _ = tx.send(Event::Failed(EngineError::Backend(message.clone())));
                    }
                }
            }
        }
        if !pending_promotions.is_empty() {
            if !engine.has_work() {
                // No request waits on these loads, so no failure needs routing.
                engine.pool().poll_loads(None);
            }
            pending_promotions.retain(|&id| match engine.promote(id) {
                Ok(Some(_)) => false,
                // Still loading, or no free slot yet: try again next round,
                // unless the load failed and the adapter is gone.
                Ok(None) => {
                    engine.pool().residency(id) == Residency::Loading
                        || engine.pool().host_adapter(id).is_some()
                }
                Err(_) => false,
            });
        }

        // Every turn of the loop: read without building the stats, which
        // clone every adapter's status.
        let generation = engine.residency_generation();
        let since = last_report.elapsed();
        if generation != last_generation
            || since >= interval
            || (load_changed && since >= MIN_REPORT_GAP)
        {
            load_changed = false;
            sequence += 1;
            let stats = engine.stats();
            crate::telemetry::record_stats(&stats);
            crate::telemetry::record_device(
                engine.device_memory(),
                &engine.take_slot_upload_times(),
            );
            let _ = reports.send(Report {
                sequence,
                produced_at: SystemTime::now(),
                stats,
                last_step: engine.last_step(),
            });
            last_generation = generation;
            last_report = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use lorafleet_engine::{EngineSettings, Prompt, Sampling};

    use super::*;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("engine/tests/fixtures")
    }

    async fn handle() -> EngineHandle {
        let engine =
            Engine::load_cpu(&fixtures().join("llama-gqa"), EngineSettings::default()).unwrap();
        let h = EngineHandle::spawn(engine, Duration::from_millis(100));
        for (id, name) in [(1, "qv-r8"), (2, "patterns")] {
            let dir = fixtures().join("adapters/llama-gqa").join(name);
            h.register(
                AdapterId::new(id).unwrap(),
                AdapterSource {
                    name: name.into(),
                    dir,
                    declared_base_hash: None,
                    digest: None,
                },
                None,
            )
            .await
            .unwrap();
        }
        h
    }

    fn request(id: &str, adapter: Option<u64>, max_tokens: usize) -> Request {
        Request {
            id: id.into(),
            adapter: adapter.and_then(AdapterId::new),
            prompt: Prompt::Text("The quick brown fox".into()),
            params: Sampling {
                max_tokens,
                temperature: 0.0,
                ignore_eos: true,
                ..Default::default()
            }
            .validate()
            .unwrap(),
        }
    }

    #[tokio::test]
    async fn a_constraint_is_compiled_off_the_engine_thread_which_only_clones_it() {
        use lorafleet_engine::constraint::Constraint;
        let h = handle().await;
        let c = Constraint::Regex("[0-9]{3}".into());
        h.compile_constraint(None, Some(&c)).await.unwrap();
        let counters = h.constraints.counters();
        assert_eq!((counters.compiles, counters.hits), (1, 0));
        let mut r = request("c", None, 10);
        let mut params = r.params.into_inner();
        params.constraint = Some(c);
        params.ignore_eos = false;
        r.params = params.validate().unwrap();
        let (_, stream) = h.submit(r).await.unwrap();
        let (tokens, finished) = collect(stream).await;
        assert!(finished && !tokens.is_empty());
        // The engine's compile at submission found it compiled.
        let counters = h.constraints.counters();
        assert_eq!((counters.compiles, counters.hits), (1, 1));
        // One that does not compile is refused before the engine sees it.
        let err = h
            .compile_constraint(None, Some(&Constraint::Regex("(".into())))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("sampling.regex"), "{err}");
    }

    async fn collect(mut stream: RequestStream) -> (Vec<u32>, bool) {
        let mut tokens = Vec::new();
        let mut finished = false;
        while let Some(event) = stream.next().await {
            match event {
                Event::Delta { token_ids, .. } => tokens.extend(token_ids),
                Event::Finished(_) => finished = true,
                Event::Failed(e) => panic!("{e}"),
                Event::PromptLogprobs(_) => {}
            }
        }
        (tokens, finished)
    }

    #[tokio::test]
    async fn concurrent_requests_stream_to_the_end() {
        let h = handle().await;
        let (a, sa) = h.submit(request("a", Some(1), 5)).await.unwrap();
        let (_, sb) = h.submit(request("b", None, 7)).await.unwrap();
        let (_, sc) = h.submit(request("c", Some(2), 3)).await.unwrap();
        assert_eq!(a.residency, Some(Residency::NotLoaded));
        let (ra, rb, rc) = tokio::join!(collect(sa), collect(sb), collect(sc));
        assert_eq!((ra.0.len(), rb.0.len(), rc.0.len()), (5, 7, 3));
        assert!(ra.1 && rb.1 && rc.1);
        // A duplicate id while the first is live is refused at submit.
        let (_, _s) = h.submit(request("d", None, 50)).await.unwrap();
        let err = h.submit(request("d", None, 5)).await.unwrap_err();
        assert!(err.to_string().contains("already running"), "{err}");
        h.shutdown();
    }

    #[tokio::test]
    async fn dropping_a_stream_frees_its_kv_blocks_and_reports_show_it() {
        let h = handle().await;
        let mut reports = h.reports();
        let (_, mut stream) = h.submit(request("long", Some(1), 400)).await.unwrap();
        // Wait for a few tokens so the sequence holds KV blocks.
        for _ in 0..3 {
            stream.next().await.unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            reports.changed().await.unwrap();
            if reports.borrow().stats.kv_blocks_used > 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no report showed the running sequence"
            );
        }
        drop(stream);
        loop {
            reports.changed().await.unwrap();
            let r = reports.borrow().clone();
            if r.stats.kv_blocks_used == 0 && r.stats.running == 0 {
                assert!(
                    r.stats.adapters.iter().all(|a| a.active == 0),
                    "the lease is released"
                );
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the dropped stream's blocks were never freed"
            );
        }
        h.shutdown();
    }

    #[tokio::test]
    async fn prefetch_promotes_and_pins_and_reports_keep_coming() {
        let h = handle().await;
        let mut reports = h.reports();
        h.prefetch(AdapterId::new(2).unwrap(), true, Some(true))
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut last_seq = reports.borrow_and_update().sequence;
        let mut seen = 0;
        loop {
            reports.changed().await.unwrap();
            let r = reports.borrow_and_update().clone();
            assert!(r.sequence > last_seq);
            last_seq = r.sequence;
            seen += 1;
            let a = r.stats.adapters.iter().find(|a| a.id.get() == 2);
            // Reports keep coming while idle, not only on changes.
            if a.is_some_and(|a| a.residency == Residency::Device && a.pinned) && seen >= 4 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "adapter 2 never reached a device slot: {:?}",
                r.stats.adapters
            );
        }
        let (before, draining) = h.unload(AdapterId::new(2).unwrap()).await.unwrap();
        assert_eq!((before, draining), (Residency::Device, 0));
        h.shutdown();
    }
}
