//! The answer: a whole response or an SSE stream, each ending with its
//! row, and cut at the drain deadline.

use super::logprobs::{self, Asked, TextOffset};
use super::*;
use crate::upstream::TokenLogprob;

pub(super) async fn run(
    s: AppState,
    p: Prepared,
    mut trail: Trail,
    span: tracing::Span,
    kind: Kind,
    request_id: Uuid,
) -> Response {
    use tracing::Instrument;
    let started = tokio::select! {
        r = async { start(&s, &p, &mut trail).await }.instrument(span.clone()) => r.map_err(|e| (e, "error")),
        () = cut(s.cut.clone()) => Err((shutting_down(), "cancelled")),
    };
    let started = match started {
        Ok(st) => st,
        Err((e, outcome)) => {
            let Parts {
                status,
                code,
                message,
                ..
            } = e.parts();
            span.in_scope(
                || tracing::warn!(status = status.as_u16(), code, message = %message, "failed"),
            );
            durable(trail.close(outcome, status, Some(code))).await;
            return e.into_response();
        }
    };
    trail.record.ttft_us = Some(trail.started.elapsed().as_micros() as i64);
    trail.record.prompt_tokens = started.accepted.prompt_tokens as i32;
    trail.record.adapter_residency = started
        .accepted
        .residency
        .map(upstream::Residency::label)
        .filter(|_| p.resolved.adapter.is_some())
        .map(str::to_owned);
    let created = Utc::now().timestamp();
    let id = match kind {
        Kind::Completion => format!("cmpl-{request_id}"),
        Kind::Chat => format!("chatcmpl-{request_id}"),
    };
    let meta = Meta {
        id,
        created,
        model: p.model.clone(),
        kind,
    };
    if p.stream {
        stream_response(s, p, started, trail, span, meta)
    } else {
        collect_response(s, p, started, trail, span, meta).await
    }
}

pub(super) struct Meta {
    id: String,
    created: i64,
    model: String,
    kind: Kind,
}

impl Meta {
    fn chunk(
        &self,
        text: Option<&str>,
        role: bool,
        finish: Option<&str>,
        logprobs: Option<Value>,
    ) -> Value {
        let logprobs = logprobs.unwrap_or(Value::Null);
        match self.kind {
            Kind::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text.unwrap_or(""), "logprobs": logprobs,
                             "finish_reason": finish}],
            }),
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish}],
                })
            }
        }
    }

    /// The log probabilities of `entries` in this endpoint's shape, or
    /// None when the request did not ask for them. `offset` is the legacy
    /// shape's running text offset.
    fn logprobs(
        &self,
        asked: &Asked,
        entries: &[TokenLogprob],
        offset: &mut TextOffset,
    ) -> Option<Value> {
        if !asked.tokens {
            return None;
        }
        Some(match self.kind {
            Kind::Completion => logprobs::legacy(entries, offset),
            Kind::Chat => logprobs::chat(entries),
        })
    }

    fn usage_chunk(&self, usage: &Usage) -> Value {
        let object = match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
               "choices": [], "usage": usage})
    }

    fn full(&self, text: &str, finish: &str, usage: &Usage, logprobs: Value) -> Value {
        match self.kind {
            Kind::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                             "finish_reason": finish}],
                "usage": usage,
            }),
            Kind::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0,
                             "message": {"role": "assistant", "content": text},
                             "logprobs": logprobs, "finish_reason": finish}],
                "usage": usage,
            }),
        }
    }
}

/// Records a finished completion in the trail (whose close settles the
/// tenant's token reservation to it); returns the usage to report.
pub(super) fn settle(trail: &mut Trail, f: &upstream::Finished, completion_tokens: usize) -> Usage {
    let usage = Usage::new(
        f.prompt_tokens,
        f.completion_tokens.max(completion_tokens as u32),
        f.cached_prompt_tokens,
    );
    trail.record.prompt_tokens = usage.prompt_tokens as i32;
    trail.record.cached_tokens = usage.prompt_tokens_details.cached_tokens as i32;
    trail.record.completion_tokens = usage.completion_tokens as i32;
    trail.record.finish_reason = Some(openai::finish_reason(f).into());
    usage
}

pub(super) fn shutting_down() -> ApiError {
    ApiError::GatewayShutdown
}

/// How a worker stream ended before its `Finished` event.
pub(super) enum Cut {
    Worker(UpstreamError),
    /// The worker closed the stream without a `Finished` event.
    WorkerStreamEnded,
    Timeout,
    Shutdown,
    /// The client went away (streams only: a whole response's handler is
    /// dropped instead, and its trail records that).
    ClientClosed,
}

impl Cut {
    /// The audit row's outcome, and the error the client is told (None
    /// when no one is left to tell).
    fn ending(self, s: &AppState) -> (&'static str, Option<ApiError>, &'static str) {
        match self {
            Cut::ClientClosed => ("cancelled", None, "client_closed"),
            Cut::Shutdown => ("cancelled", Some(shutting_down()), "gateway_shutdown"),
            Cut::Timeout => {
                let e = ApiError::RequestTimeout {
                    after: s.request_timeout,
                };
                ("error", Some(e), "request_timeout")
            }
            Cut::WorkerStreamEnded => {
                let e = worker_error(&UpstreamError::unavailable(
                    "the worker closed the stream before the end",
                ));
                ("error", Some(e), "worker_stream_ended")
            }
            Cut::Worker(status) => ("error", Some(worker_error(&status)), "worker_failed"),
        }
    }
}

pub(super) async fn collect_response(
    s: AppState,
    // Held to the end: its permits are the request's place in the gateway.
    p: Prepared,
    mut st: Started,
    mut trail: Trail,
    span: tracing::Span,
    meta: Meta,
) -> Response {
    let asked = Asked::new(&p.request.prompt, &p.request.sampling);
    let mut text = String::new();
    let (mut prompt_scored, mut scored) = (Vec::new(), Vec::new());
    let mut event = Some(st.first.clone());
    let deadline = tokio::time::Instant::now() + s.request_timeout;
    let finished = loop {
        match event.take() {
            Some(WorkerEvent::Delta {
                token_ids,
                text: t,
                logprobs,
            }) => {
                text.push_str(&t);
                scored.extend(logprobs);
                // Kept on the row as they come, so a client that goes away
                // leaves a row with the tokens it used.
                trail.record.completion_tokens += token_ids.len() as i32;
            }
            Some(WorkerEvent::PromptLogprobs(v)) => prompt_scored.extend(v),
            Some(WorkerEvent::Finished(f)) => break Ok(f),
            Some(WorkerEvent::Accepted(_)) | None => {}
        }
        tokio::select! {
            m = tokio::time::timeout_at(deadline, st.stream.next()) => match m {
                Ok(Ok(Some(e))) => event = Some(e),
                Ok(Ok(None)) => break Err(Cut::WorkerStreamEnded),
                Ok(Err(status)) => break Err(Cut::Worker(status)),
                Err(_) => break Err(Cut::Timeout),
            },
            () = cut(s.cut.clone()) => break Err(Cut::Shutdown),
        }
    };
    let tokens = trail.record.completion_tokens as usize;
    match finished {
        Ok(f) => {
            let usage = settle(&mut trail, &f, tokens);
            if let Some(echo) = asked.echo_text(&prompt_scored) {
                text.insert_str(0, &echo);
                prompt_scored.append(&mut scored);
                scored = prompt_scored;
            }
            let logprobs = meta.logprobs(&asked, &scored, &mut TextOffset::default());
            let body = meta.full(
                &text,
                openai::finish_reason(&f),
                &usage,
                logprobs.unwrap_or(Value::Null),
            );
            span.in_scope(|| {
                tracing::info!(completion_tokens = usage.completion_tokens, "completed")
            });
            // Served only once its row cannot be lost.
            if !durable(trail.close("ok", StatusCode::OK, None)).await {
                return row_not_durable().into_response();
            }
            axum::Json(body).into_response()
        }
        Err(cut) => {
            // Tokens were produced, so no retry: the client gets an error.
            let (outcome, told, _) = cut.ending(&s);
            let e = told.unwrap_or(ApiError::GatewayShutdown);
            let parts = e.parts();
            span.in_scope(
                || tracing::warn!(message = %parts.message, "failed after the first token"),
            );
            durable(trail.close(outcome, parts.status, Some(parts.code))).await;
            e.into_response()
        }
    }
}

pub(super) fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

pub(super) fn stream_response(
    s: AppState,
    p: Prepared,
    mut st: Started,
    mut trail: Trail,
    span: tracing::Span,
    meta: Meta,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(32);
    let task = async move {
        let mut scores = StreamScores::new(&p);
        let mut sent_role = false;
        let mut event = Some(st.first.clone());
        let deadline = tokio::time::Instant::now() + s.request_timeout;
        // Every send also ends at the drain deadline: a client that stops
        // reading must not hold the shutdown.
        let send = |v: Bytes| {
            let (tx, cut_rx) = (tx.clone(), s.cut.clone());
            async move {
                tokio::select! {
                    r = tx.send(Ok(v)) => r.is_ok(),
                    () = cut(cut_rx) => false,
                }
            }
        };
        if meta.kind == Kind::Chat {
            sent_role = true;
            if !send(sse(&meta.chunk(None, true, None, None))).await {
                let _ = trail.close("cancelled", StatusCode::OK, Some("client_closed"));
                return;
            }
        }
        let outcome: Result<upstream::Finished, Cut> = loop {
            match event.take() {
                Some(WorkerEvent::PromptLogprobs(v)) => scores.prompt(v),
                Some(WorkerEvent::Delta {
                    token_ids,
                    text,
                    logprobs,
                }) => {
                    trail.record.completion_tokens += token_ids.len() as i32;
                    let mut sent = true;
                    let echo = scores.echo(&meta);
                    for chunk in echo
                        .into_iter()
                        .chain(scores.delta(&meta, &text, !sent_role, &logprobs))
                    {
                        sent = sent && send(sse(&chunk)).await;
                    }
                    if !sent {
                        // The client went away (or the drain deadline cut
                        // it): dropping the worker stream cancels the
                        // request there and frees its blocks.
                        break Err(if *s.cut.borrow() {
                            Cut::Shutdown
                        } else {
                            Cut::ClientClosed
                        });
                    }
                }
                Some(WorkerEvent::Finished(f)) => break Ok(f),
                _ => {}
            }
            tokio::select! {
                m = tokio::time::timeout_at(deadline, st.stream.next()) => match m {
                    Ok(Ok(Some(e))) => event = Some(e),
                    Ok(Ok(None)) => break Err(Cut::WorkerStreamEnded),
                    Ok(Err(e)) => break Err(Cut::Worker(e)),
                    Err(_) => break Err(Cut::Timeout),
                },
                () = tx.closed() => break Err(Cut::ClientClosed),
                () = cut(s.cut.clone()) => break Err(Cut::Shutdown),
            }
        };
        let tokens = trail.record.completion_tokens as usize;
        match outcome {
            Ok(f) => {
                let usage = settle(&mut trail, &f, tokens);
                let reason = openai::finish_reason(&f);
                if let Some(chunk) = scores.echo(&meta) {
                    // A prompt scored alone (max_tokens 0).
                    send(sse(&chunk)).await;
                }
                send(sse(&meta.chunk(None, false, Some(reason), None))).await;
                if p.include_usage {
                    send(sse(&meta.usage_chunk(&usage))).await;
                }
                tracing::info!(completion_tokens = usage.completion_tokens, "completed");
                // [DONE] only once the row cannot be lost.
                if durable(trail.close("ok", StatusCode::OK, None)).await {
                    send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                } else {
                    let e = row_not_durable();
                    let p = e.parts();
                    let body = openai::error_body(&p.message, p.kind, None, Some(p.code));
                    send(sse(&body)).await;
                }
            }
            Err(cut) => end_early(&s, &tx, trail, cut).await,
        }
        drop(st);
    };
    tokio::spawn(tracing::Instrument::instrument(task, span));
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .expect("a valid response")
}

/// A stream cut before its end: the row keeps how it ended, and the
/// client, whose headers are gone, is told in-band, OpenAI-style.
async fn end_early(
    s: &AppState,
    tx: &tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>,
    trail: Trail,
    cut: Cut,
) {
    let (status, told, code) = cut.ending(s);
    if let Some(e) = told {
        let p = e.parts();
        let body = openai::error_body(&p.message, p.kind, None, Some(code));
        // Best effort, and never past the deadline.
        let _ = tokio::time::timeout(Duration::from_millis(100), tx.send(Ok(sse(&body)))).await;
    }
    tracing::warn!(status, code, "stream ended early");
    durable(trail.close(status, StatusCode::OK, Some(code))).await;
}

/// What a stream still owes about log probabilities: the echoed prompt,
/// which waits for its last log probabilities and then goes out as the
/// first chunk of text, and the legacy shape's running text offset.
struct StreamScores {
    asked: Asked,
    echo: Option<Vec<TokenLogprob>>,
    offset: TextOffset,
}

impl StreamScores {
    fn new(p: &Prepared) -> StreamScores {
        let asked = Asked::new(&p.request.prompt, &p.request.sampling);
        StreamScores {
            echo: asked.echo.as_ref().map(|_| Vec::new()),
            asked,
            offset: TextOffset::default(),
        }
    }

    fn prompt(&mut self, scored: Vec<TokenLogprob>) {
        if let Some(e) = self.echo.as_mut() {
            e.extend(scored);
        }
    }

    /// The chunk that echoes the prompt, once: its text, and its tokens'
    /// log probabilities when asked.
    fn echo(&mut self, meta: &Meta) -> Option<Value> {
        let prompt = self.echo.take()?;
        let text = self.asked.echo_text(&prompt).unwrap_or_default();
        let logprobs = meta.logprobs(&self.asked, &prompt, &mut self.offset);
        Some(meta.chunk(Some(&text), false, None, logprobs))
    }

    /// The chunk a delta becomes, unless it says nothing (its text held
    /// back, no log probabilities asked).
    fn delta(
        &mut self,
        meta: &Meta,
        text: &str,
        role: bool,
        scored: &[TokenLogprob],
    ) -> Option<Value> {
        let logprobs = meta.logprobs(&self.asked, scored, &mut self.offset);
        (!text.is_empty() || logprobs.is_some())
            .then(|| meta.chunk(Some(text), role, None, logprobs))
    }
}
