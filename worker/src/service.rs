//! The `lorafleet.worker.v1.Worker` gRPC service over the engine handle.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lorafleet_engine::artifact::{ArtifactError, ArtifactRoots};
use lorafleet_engine::lora::{AdapterLimits, HostAdapter};
use lorafleet_engine::{AdapterId, AdapterSource, EngineError, Event, Prompt, Request, Residency};
use lorafleet_proto::worker::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{ReceiverStream, WatchStream};
use tonic::{Response, Status};
use tracing::Instrument;

use crate::convert::{self, Descriptor};
use crate::info::WorkerInfo;
use crate::refusal::Refusal;
use crate::runtime::{EngineHandle, Report};
use crate::telemetry;

/// How long LoadAdapter waits for the adapter to reach its tier.
const LOAD_WAIT: Duration = Duration::from_secs(60);

/// The gRPC service. Cheap to clone.
#[derive(Debug, Clone)]
pub struct WorkerService {
    engine: EngineHandle,
    roots: ArtifactRoots,
    /// The object stores `s3://` artifact URIs may name.
    stores: lorafleet_store::ObjectStores,
    /// This worker's private copies of verified artifacts, one directory
    /// per (lora_int_id, digest): the pool reads adapters only from here.
    cache: Arc<std::path::PathBuf>,
    info: Arc<WorkerInfo>,
    /// lora_int_id -> the artifact digest verified for it. A std mutex,
    /// never held across an await.
    verified: Arc<Mutex<HashMap<AdapterId, String>>>,
    /// One first-use verification per lora_int_id at a time: concurrent
    /// first requests wait for it rather than copy the artifact twice.
    verifying: Arc<Mutex<HashMap<AdapterId, Arc<tokio::sync::Mutex<()>>>>>,
    draining: Arc<AtomicBool>,
    /// Generate streams whose final message the client has not yet taken.
    in_flight: Arc<AtomicUsize>,
}

/// Counts a stream in flight until dropped.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl WorkerService {
    pub fn new(
        engine: EngineHandle,
        roots: ArtifactRoots,
        cache: std::path::PathBuf,
        info: WorkerInfo,
        draining: Arc<AtomicBool>,
    ) -> Self {
        WorkerService {
            engine,
            roots,
            stores: lorafleet_store::ObjectStores::none(),
            cache: Arc::new(cache),
            info: Arc::new(info),
            verified: Arc::default(),
            verifying: Arc::default(),
            draining,
            in_flight: Arc::default(),
        }
    }

    /// Some(result) when this id was verified already (or with another
    /// digest, which is refused).
    fn already_verified(&self, d: &Descriptor) -> Option<Result<AdapterId, Refusal>> {
        let verified = self.verified.lock().expect("verified map");
        let sha = verified.get(&d.lora_int_id)?;
        Some(if sha.as_str() == d.artifact_sha256.as_str() {
            Ok(d.lora_int_id)
        } else {
            // Which digest it was loaded with is not the caller's to learn.
            tracing::warn!(lora_int_id = d.lora_int_id.get(), loaded = %sha, asked = %d.artifact_sha256, "adapter id reused with another digest");
            Err(Refusal::AdapterIdReused { id: d.lora_int_id })
        })
    }

    /// Where this worker keeps its verified copy of an adapter.
    fn copy_dir(&self, d: &Descriptor) -> std::path::PathBuf {
        self.cache.join(format!(
            "{}-{}",
            d.lora_int_id,
            d.artifact_sha256.to_ascii_lowercase()
        ))
    }

    /// The object stores `s3://` artifact URIs may name (none by default).
    pub fn with_stores(mut self, stores: lorafleet_store::ObjectStores) -> Self {
        self.stores = stores;
        self
    }

    /// Generate streams not yet delivered to the end; drain waits for zero.
    pub fn in_flight(&self) -> Arc<AtomicUsize> {
        self.in_flight.clone()
    }

    /// Checks a descriptor against this worker, verifies and validates its
    /// artifact on first use, and registers it with the engine.
    async fn ensure_adapter(&self, d: &Descriptor) -> Result<AdapterId, Refusal> {
        let base = &self.info.base_model.base_hash;
        if d.base_hash != *base {
            return Err(Refusal::BaseHashMismatch {
                asked: d.base_hash.clone(),
                served: base.clone(),
            });
        }
        let max_rank = self.info.capacity.max_lora_rank as usize;
        if d.rank > max_rank {
            return Err(Refusal::RankTooLarge {
                rank: d.rank,
                max: max_rank,
            });
        }
        if let Some(done) = self.already_verified(d) {
            return done;
        }
        let gate = self
            .verifying
            .lock()
            .expect("verifying map")
            .entry(d.lora_int_id)
            .or_default()
            .clone();
        let _one_at_a_time = gate.lock().await;
        if let Some(done) = self.already_verified(d) {
            return done;
        }
        let (roots, info, desc) = (self.roots.clone(), self.info.clone(), d.clone());
        let copy = self.copy_dir(d);
        let count_mismatch = |e: &ArtifactError| {
            if matches!(e, ArtifactError::DigestMismatch { .. }) {
                metrics::counter!("lorafleet_adapter_digest_mismatches_total").increment(1);
            }
        };
        // From an object store: fetched into the private copy, hashed as
        // it is written, and kept only if the digest matches.
        let fetched = if lorafleet_store::is_object_uri(&d.artifact_uri) {
            let _ = tokio::fs::remove_dir_all(&copy).await;
            self.stores
                .fetch_verified_within(
                    &d.artifact_uri,
                    Some(&d.artifact_sha256),
                    &copy,
                    d.artifact_size,
                )
                .await
                .inspect_err(count_mismatch)?;
            true
        } else {
            false
        };
        let (dir, adapter) = tokio::task::spawn_blocking(move || -> Result<_, Refusal> {
            // The bytes hashed are the bytes kept: a private copy, so a
            // file changed in the artifact root later is never read.
            let dir = if fetched {
                copy
            } else {
                let _ = std::fs::remove_dir_all(&copy);
                roots
                    .copy_verified(&desc.artifact_uri, &desc.artifact_sha256, &copy)
                    .inspect_err(count_mismatch)?
            };
            // Parsed once, here, so a bad adapter fails this call with a
            // precise status; the pool takes this parse into its host tier.
            let limits = AdapterLimits {
                model: &info.model_config,
                max_lora_rank: info.capacity.max_lora_rank as usize,
                base_hash_check: Some((&info.base_model.base_hash, &desc.base_hash)),
            };
            let checked = HostAdapter::load(&desc.display_name, &dir, limits)
                .map_err(|e| Refusal::Engine(EngineError::Adapter(e)))
                .and_then(|adapter| {
                    if adapter.rank > desc.rank {
                        return Err(Refusal::RankMismatch {
                            declared: desc.rank,
                            actual: adapter.rank,
                        });
                    }
                    Ok(adapter)
                });
            match checked {
                Ok(adapter) => Ok((dir, adapter)),
                Err(refusal) => {
                    // A refused adapter leaves no copy behind.
                    let _ = std::fs::remove_dir_all(&dir);
                    Err(refusal)
                }
            }
        })
        .await
        .map_err(|e| {
            tracing::error!(error = %e, "artifact check task failed");
            Refusal::TaskFailed {
                what: "the artifact check",
            }
        })??;
        let source = AdapterSource {
            name: d.display_name.clone(),
            dir: dir.clone(),
            declared_base_hash: Some(d.base_hash.clone()),
            // Verified above: the bytes the pool reads hash to this.
            digest: Some(d.artifact_sha256.to_string()),
        };
        if let Err(e) = self
            .engine
            .register(d.lora_int_id, source, Some(adapter))
            .await
        {
            let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(dir)).await;
            return Err(e.into());
        }
        self.verified
            .lock()
            .expect("verified map")
            .insert(d.lora_int_id, d.artifact_sha256.to_string());
        // Later callers find it verified; waiters still hold the gate.
        self.verifying
            .lock()
            .expect("verifying map")
            .remove(&d.lora_int_id);
        Ok(d.lora_int_id)
    }

    fn report(&self, r: &Report) -> pb::WorkerReport {
        let verified = self.verified.lock().expect("verified map").clone();
        convert::report(&self.info, r, self.status(), self.adapters(r, &verified))
    }

    fn adapters(&self, r: &Report, verified: &HashMap<AdapterId, String>) -> Vec<pb::AdapterState> {
        r.stats
            .adapters
            .iter()
            .map(|a| {
                convert::adapter_state(
                    a,
                    verified.get(&a.id).map_or("", String::as_str),
                    r.produced_at,
                )
            })
            .collect()
    }

    fn status(&self) -> pb::ServingStatus {
        if self.draining.load(Ordering::Acquire) {
            pb::ServingStatus::Draining
        } else {
            pb::ServingStatus::Serving
        }
    }
}

type EventResult = Result<pb::GenerateEvent, Status>;

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    type GenerateStream = ReceiverStream<EventResult>;
    type WatchStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<pb::WorkerReport, Status>> + Send>,
    >;

    async fn generate(
        &self,
        request: tonic::Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        if self.draining.load(Ordering::Acquire) {
            return Err(Refusal::Draining.into());
        }
        let r = request.into_inner();
        let started = Instant::now();
        let span = tracing::info_span!(
            "generate",
            request_id = %r.request_id,
            lora_int_id = r.adapter.as_ref().map_or(0, |a| a.lora_int_id),
            trace_id = tracing::field::Empty,
        );
        if let Some(tc) = &r.trace_context {
            lorafleet_telemetry::set_parent(&span, &tc.traceparent, &tc.tracestate);
        }
        if let Some(id) = lorafleet_telemetry::trace_id(&span) {
            span.record("trace_id", id);
        }
        let admitted = async {
            let (id, spec) = convert::generate_request(&r)?;
            let (prompt, params) = spec.into_parts();
            let fairness = convert::fairness(&r)?;
            let adapter = match &r.adapter {
                Some(d) => Some(
                    self.ensure_adapter(&convert::descriptor(d, "adapter")?)
                        .await?,
                ),
                None => None,
            };
            let (ids, ()) = tokio::try_join!(
                self.engine.prepare(adapter, prompt, params.max_tokens),
                self.engine
                    .compile_constraint(adapter, params.constraint.as_ref()),
            )?;
            self.engine
                .submit_fair(
                    Request {
                        id,
                        adapter,
                        prompt: Prompt::TokenIds(ids),
                        params,
                    },
                    fairness,
                )
                .await
                .map(|admitted| (admitted, adapter))
                .map_err(Refusal::from)
        }
        .instrument(span.clone())
        .await
        .map_err(Status::from);
        let ((accepted, mut stream), adapter) = admitted.inspect_err(|status| {
            telemetry::record_request(code_name(status.code()));
            span.in_scope(|| {
                tracing::warn!(code = ?status.code(), message = status.message(), "refused");
            });
        })?;
        span.in_scope(|| {
            tracing::info!(
                prompt_tokens = accepted.prompt_tokens,
                residency = ?accepted.residency,
                "accepted"
            );
        });
        let (tx, rx) = mpsc::channel::<EventResult>(64);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        let in_flight = InFlight(self.in_flight.clone());
        let first = convert::accepted_event(accepted.prompt_tokens, accepted.residency);
        // Token bytes as the request's own tokenizer spells them.
        let prompter = self.engine.text_side(adapter).prompter;
        tokio::spawn(
            async move {
                let _in_flight = in_flight;
                if tx.send(Ok(first)).await.is_err() {
                    return;
                }
                let mut last_token: Option<Instant> = None;
                while let Some(event) = stream.next().await {
                    let message = match event {
                        Event::Delta {
                            token_ids,
                            text,
                            logprobs,
                            channel,
                            device_time,
                            load_time,
                        } => {
                            let now = Instant::now();
                            match last_token {
                                None => telemetry::record_ttft(now - started),
                                Some(t) => telemetry::record_inter_token(now - t),
                            }
                            last_token = Some(now);
                            Ok(convert::delta_event(
                                token_ids,
                                text,
                                &logprobs,
                                channel,
                                (device_time, load_time),
                                &prompter,
                            ))
                        }
                        Event::PromptLogprobs(scored) => {
                            Ok(convert::prompt_logprobs_event(&scored, &prompter))
                        }
                        Event::Finished(f) => {
                            telemetry::record_request("ok");
                            if let Some(wait) = f.adapter_wait {
                                telemetry::record_adapter_wait(wait);
                            }
                            tracing::info!(
                                completion_tokens = f.completion_tokens,
                                finish_reason = ?f.reason,
                                "finished"
                            );
                            Ok(convert::finished_event(&f))
                        }
                        Event::Failed(e) => {
                            tracing::warn!(error = %e, "failed");
                            let status = convert::status(&Refusal::Engine(e));
                            telemetry::record_request(code_name(status.code()));
                            Err(status)
                        }
                    };
                    // A closed channel means the client went away; dropping
                    // `stream` then aborts the request in the engine.
                    if tx.send(message).await.is_err() {
                        tracing::info!("cancelled by the client");
                        return;
                    }
                }
            }
            .instrument(span),
        );
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn load_adapter(
        &self,
        request: tonic::Request<pb::LoadAdapterRequest>,
    ) -> Result<Response<pb::LoadAdapterResponse>, Status> {
        let r = request.into_inner();
        let d = convert::descriptor(
            r.adapter
                .as_ref()
                .ok_or_else(|| Refusal::descriptor("adapter", "is required"))?,
            "adapter",
        )?;
        let target = match r.target() {
            pb::Residency::Device => Residency::Device,
            pb::Residency::Host | pb::Residency::Unspecified => Residency::Host,
            other => {
                return Err(Refusal::call_field(
                    "target",
                    format!("{other:?} is not DEVICE or HOST"),
                )
                .into());
            }
        };
        let started = Instant::now();
        let mut reports = self.engine.reports();
        let residency_of = |r: &Report| {
            r.stats
                .adapters
                .iter()
                .find(|a| a.id == d.lora_int_id)
                .map_or(Residency::NotLoaded, |a| a.residency)
        };
        let previous = residency_of(&reports.borrow_and_update());
        let id = self.ensure_adapter(&d).await?;
        self.engine
            .prefetch(id, target == Residency::Device, r.pin)
            .await
            .map_err(Refusal::from)?;
        let deadline = Instant::now() + LOAD_WAIT;
        loop {
            let report = reports.borrow_and_update().clone();
            let now = residency_of(&report);
            if now == Residency::Device || (now == Residency::Host && target == Residency::Host) {
                let verified = self.verified.lock().expect("verified map").clone();
                let state = self
                    .adapters(&report, &verified)
                    .into_iter()
                    .find(|a| a.lora_int_id == id.get());
                let load_time = if previous == now {
                    Duration::ZERO
                } else {
                    started.elapsed()
                };
                return Ok(Response::new(convert::load_response(
                    state, previous, load_time,
                )));
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            if wait.is_zero() || tokio::time::timeout(wait, reports.changed()).await.is_err() {
                return Err(Refusal::LoadTimeout {
                    id,
                    target,
                    waited: LOAD_WAIT,
                }
                .into());
            }
        }
    }

    async fn unload_adapter(
        &self,
        request: tonic::Request<pb::UnloadAdapterRequest>,
    ) -> Result<Response<pb::UnloadAdapterResponse>, Status> {
        let id = convert::adapter_id(request.into_inner().lora_int_id, "lora_int_id")?;
        let (previous, draining) = self.engine.unload(id).await.map_err(Refusal::from)?;
        // The next use verifies the artifact again, from the root: files
        // changed there since are refused then, never served. The copy goes
        // only once nothing holds or waits for the adapter.
        let sha = self.verified.lock().expect("verified map").remove(&id);
        if let Some(sha) = sha
            && draining == 0
        {
            let copy = self.cache.join(format!("{id}-{sha}"));
            let _ = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(copy)).await;
        }
        Ok(Response::new(convert::unload_response(previous, draining)))
    }

    async fn list_adapters(
        &self,
        _request: tonic::Request<pb::ListAdaptersRequest>,
    ) -> Result<Response<pb::ListAdaptersResponse>, Status> {
        let report = self.engine.reports().borrow().clone();
        let verified = self.verified.lock().expect("verified map").clone();
        Ok(Response::new(convert::list_response(
            self.adapters(&report, &verified),
        )))
    }

    async fn watch(
        &self,
        _request: tonic::Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let this = self.clone();
        // WatchStream yields the current report at once, then only the
        // latest one each time it changes: a slow watcher skips, never queues.
        let stream = WatchStream::new(self.engine.reports()).map(move |r| Ok(this.report(&r)));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn info(
        &self,
        _request: tonic::Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        Ok(Response::new(convert::info_response(
            &self.info,
            self.status(),
        )))
    }
}

/// A stable metric label for a gRPC code.
fn code_name(code: tonic::Code) -> &'static str {
    match code {
        tonic::Code::Ok => "ok",
        tonic::Code::Cancelled => "cancelled",
        tonic::Code::InvalidArgument => "invalid_argument",
        tonic::Code::NotFound => "not_found",
        tonic::Code::FailedPrecondition => "failed_precondition",
        tonic::Code::ResourceExhausted => "resource_exhausted",
        tonic::Code::Unavailable => "unavailable",
        tonic::Code::DeadlineExceeded => "deadline_exceeded",
        _ => "internal",
    }
}
