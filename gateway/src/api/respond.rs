//! The answer: a whole response or an SSE stream, each ending with its
//! row, and cut at the drain deadline.

use super::choices::{Choices, Ended};
use super::logprobs::{self, Asked, TextOffset};
use super::params::Endpoint;
use super::worker::start_siblings;
use super::*;
use crate::audit::AuditStatus;
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
        r = async {
            let first = start(&s, &p.resolved, &p.request, p.endpoint(), &mut trail).await?;
            let others = start_siblings(&s, &p, &first).await?;
            Ok(Choices::new(std::iter::once(first).chain(others).collect()))
        }.instrument(span.clone()) => r.map_err(|e| (e, AuditStatus::Error)),
        () = cut(s.cut.clone()) => Err((shutting_down(), AuditStatus::Cancelled)),
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
        index: usize,
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
                "choices": [{"index": index, "text": text.unwrap_or(""), "logprobs": logprobs,
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
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
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

    /// The whole response: each choice's (text, finish reason, log
    /// probabilities), in index order.
    fn full(&self, choices: &[ChoiceBody], usage: &Usage) -> Value {
        let choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(index, c)| match self.kind {
                Kind::Completion => json!({"index": index, "text": c.text, "logprobs": c.logprobs,
                                           "finish_reason": c.finish}),
                Kind::Chat => {
                    let mut message = json!({"role": "assistant", "content": c.text});
                    if let Some(r) = &c.reasoning {
                        message["reasoning_content"] = r.as_str().into();
                    }
                    if let Some(calls) = &c.tool_calls {
                        message["tool_calls"] = calls.clone();
                    }
                    json!({"index": index, "message": message, "logprobs": c.logprobs,
                           "finish_reason": c.finish})
                }
            })
            .collect();
        let object = match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
               "choices": choices, "usage": usage})
    }
}

/// Records a finished request in the trail (whose close settles the
/// tenant's token reservation to it); returns the usage to report. The
/// prompt counts once; completion tokens are every choice's. The row's
/// finish reason is choice 0's.
pub(super) fn settle(
    trail: &mut Trail,
    finished: &[upstream::Finished],
    completion_tokens: usize,
) -> Usage {
    let first = &finished[0];
    let reported: u32 = finished.iter().map(|f| f.completion_tokens).sum();
    let usage = Usage::new(
        first.prompt_tokens,
        reported.max(completion_tokens as u32),
        first.cached_prompt_tokens,
    );
    trail.record.prompt_tokens = usage.prompt_tokens as i32;
    trail.record.cached_tokens = usage.prompt_tokens_details.cached_tokens as i32;
    trail.record.completion_tokens = usage.completion_tokens as i32;
    trail.record.finish_reason = Some(openai::finish_reason(first).into());
    let device: std::time::Duration = finished.iter().map(|f| f.device_time).sum();
    trail.record.device_us = Some(crate::audit::micros(device));
    let load: std::time::Duration = finished.iter().map(|f| f.load_time).sum();
    trail.record.load_us = Some(crate::audit::micros(load));
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
    fn ending(
        self,
        s: &AppState,
        endpoint: Endpoint,
    ) -> (AuditStatus, Option<ApiError>, &'static str) {
        match self {
            Cut::ClientClosed => (AuditStatus::Cancelled, None, "client_closed"),
            Cut::Shutdown => (
                AuditStatus::Cancelled,
                Some(shutting_down()),
                "gateway_shutdown",
            ),
            Cut::Timeout => {
                let e = ApiError::RequestTimeout {
                    after: s.request_timeout,
                };
                (AuditStatus::Error, Some(e), "request_timeout")
            }
            Cut::WorkerStreamEnded => {
                let e = worker_error(
                    &UpstreamError::unavailable("the worker closed the stream before the end"),
                    endpoint,
                );
                (AuditStatus::Error, Some(e), "worker_stream_ended")
            }
            Cut::Worker(status) => (
                AuditStatus::Error,
                Some(worker_error(&status, endpoint)),
                "worker_failed",
            ),
        }
    }
}

impl From<Ended> for Cut {
    fn from(e: Ended) -> Cut {
        match e {
            Ended::Worker(e) => Cut::Worker(e),
            Ended::Closed => Cut::WorkerStreamEnded,
        }
    }
}

/// What one choice of a whole response has produced so far.
#[derive(Default)]
struct Collected {
    text: String,
    /// A harmony model's answer, by channel (the text of its messages is
    /// not in `text`).
    harmony: Option<harmony::Answer>,
    prompt_scored: Vec<TokenLogprob>,
    scored: Vec<TokenLogprob>,
    finished: Option<upstream::Finished>,
}

/// One choice of a whole response.
struct ChoiceBody {
    /// None: a chat answer that is only tool calls.
    text: Option<String>,
    /// A reasoning model's reasoning (harmony's `analysis` channel).
    reasoning: Option<String>,
    finish: &'static str,
    logprobs: Value,
    tool_calls: Option<Value>,
}

impl Collected {
    /// The choice once finished: the echoed prompt first, and a chat
    /// answer's tool calls read out of its text.
    fn into_choice(
        mut self,
        meta: &Meta,
        asked: &Asked,
        tools: Option<&openai::tools::Tools>,
    ) -> ChoiceBody {
        let finish = openai::finish_reason(self.finished.as_ref().expect("a finished choice"));
        if let Some(echo) = asked.echo_text(&self.prompt_scored) {
            self.text.insert_str(0, &echo);
            self.prompt_scored.append(&mut self.scored);
            self.scored = self.prompt_scored;
        }
        let logprobs = meta
            .logprobs(asked, &self.scored, &mut TextOffset::default())
            .unwrap_or(Value::Null);
        if let Some(answer) = self.harmony {
            let called = !answer.calls().is_empty();
            let tool_calls = called.then(|| calls::tool_calls(answer.calls(), false));
            return ChoiceBody {
                text: Some(answer.content).filter(|c| !(called && c.is_empty())),
                reasoning: Some(answer.reasoning).filter(|r| !r.is_empty()),
                finish: if called { "tool_calls" } else { finish },
                logprobs,
                tool_calls,
            };
        }
        match tools.and_then(|t| t.read(&self.text)) {
            Some((content, found)) => ChoiceBody {
                text: content,
                reasoning: None,
                finish: "tool_calls",
                logprobs,
                tool_calls: Some(calls::tool_calls(&found, false)),
            },
            None => ChoiceBody {
                text: Some(self.text),
                reasoning: None,
                finish,
                logprobs,
                tool_calls: None,
            },
        }
    }
}

/// The `keep` choices with the highest cumulative log probability, most
/// likely first (`best_of`); all of them, in order, when none is dropped.
fn best(mut choices: Vec<Collected>, keep: usize) -> Vec<Collected> {
    if keep >= choices.len() {
        return choices;
    }
    let total = |c: &Collected| -> f64 {
        c.scored
            .iter()
            .filter_map(|t| t.logprob)
            .map(f64::from)
            .sum()
    };
    // Stable: equal scores keep their index order.
    choices.sort_by(|a, b| total(b).total_cmp(&total(a)));
    choices.truncate(keep);
    choices
}

pub(super) async fn collect_response(
    s: AppState,
    // Held to the end: its permits are the request's place in the gateway.
    p: Prepared,
    mut st: Choices,
    mut trail: Trail,
    span: tracing::Span,
    meta: Meta,
) -> Response {
    let asked = Asked::new(
        &p.request.spec.prompt,
        &p.request.spec.sampling,
        p.show_logprobs,
    );
    let mut choices: Vec<Collected> = (0..st.len()).map(|_| Collected::default()).collect();
    let mut left = st.len();
    let deadline = tokio::time::Instant::now() + s.request_timeout;
    let finished = loop {
        let (i, event) = tokio::select! {
            m = tokio::time::timeout_at(deadline, st.next()) => match m {
                Ok(Ok(e)) => e,
                Ok(Err(ended)) => break Err(Cut::from(ended)),
                Err(_) => break Err(Cut::Timeout),
            },
            () = cut(s.cut.clone()) => break Err(Cut::Shutdown),
        };
        let c = &mut choices[i];
        match event {
            WorkerEvent::Delta {
                token_ids,
                text,
                logprobs,
                channel,
                device_time,
                load_time,
            } => {
                trail.spent(i, device_time, load_time);
                // Only a chat answer is read by channel.
                match channel.filter(|_| meta.kind == Kind::Chat) {
                    Some(ch) => {
                        c.harmony.get_or_insert_default().push(&ch, &text);
                    }
                    None => c.text.push_str(&text),
                }
                c.scored.extend(logprobs);
                // Kept on the row as they come, so a client that goes away
                // leaves a row with the tokens it used.
                trail.record.completion_tokens += token_ids.len() as i32;
            }
            WorkerEvent::PromptLogprobs(v) => c.prompt_scored.extend(v),
            WorkerEvent::Finished(f) => {
                c.finished = Some(f);
                left -= 1;
                if left == 0 {
                    break Ok(());
                }
            }
            WorkerEvent::Accepted(_) => {}
        }
    };
    let tokens = trail.record.completion_tokens as usize;
    match finished {
        Ok(()) => {
            let ends: Vec<upstream::Finished> = choices.iter().filter_map(|c| c.finished).collect();
            let usage = settle(&mut trail, &ends, tokens);
            // Usage counts every choice generated, returned or not.
            let choices: Vec<_> = best(choices, p.choices.returned as usize)
                .into_iter()
                .map(|c| c.into_choice(&meta, &asked, p.tools.as_ref()))
                .collect();
            let body = meta.full(&choices, &usage);
            span.in_scope(|| {
                tracing::info!(completion_tokens = usage.completion_tokens, "completed")
            });
            // Served only once its row cannot be lost.
            if !durable(trail.close(AuditStatus::Ok, StatusCode::OK, None)).await {
                return row_not_durable().into_response();
            }
            axum::Json(body).into_response()
        }
        Err(cut) => {
            // Tokens were produced, so no retry: the client gets an error.
            let (outcome, told, _) = cut.ending(&s, p.endpoint());
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
    mut st: Choices,
    mut trail: Trail,
    span: tracing::Span,
    meta: Meta,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(32);
    let endpoint = p.endpoint();
    let task = async move {
        let n = st.len();
        let mut scores: Vec<StreamScores> = (0..n).map(|_| StreamScores::new(&p)).collect();
        let mut ends: Vec<Option<upstream::Finished>> = vec![None; n];
        let mut left = n;
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
            for i in 0..n {
                if !send(sse(&meta.chunk(i, None, true, None, None))).await {
                    let _ = trail.close(
                        AuditStatus::Cancelled,
                        StatusCode::OK,
                        Some("client_closed"),
                    );
                    return;
                }
            }
        }
        let outcome: Result<(), Cut> = loop {
            let (i, event) = tokio::select! {
                m = tokio::time::timeout_at(deadline, st.next()) => match m {
                    Ok(Ok(e)) => e,
                    Ok(Err(ended)) => break Err(Cut::from(ended)),
                    Err(_) => break Err(Cut::Timeout),
                },
                () = tx.closed() => break Err(Cut::ClientClosed),
                () = cut(s.cut.clone()) => break Err(Cut::Shutdown),
            };
            let (chunks, end) = scores[i].chunks(&meta, i, event, &mut trail);
            if let Some(f) = end {
                ends[i] = Some(f);
                left -= 1;
            }
            let mut sent = true;
            for chunk in chunks {
                sent = sent && send(sse(&chunk)).await;
            }
            if left == 0 {
                break Ok(());
            }
            if !sent {
                // The client went away (or the drain deadline cut it):
                // dropping the worker streams cancels the requests there
                // and frees their blocks.
                break Err(if *s.cut.borrow() {
                    Cut::Shutdown
                } else {
                    Cut::ClientClosed
                });
            }
        };
        let tokens = trail.record.completion_tokens as usize;
        match outcome {
            Ok(()) => {
                let ends: Vec<upstream::Finished> = ends.into_iter().flatten().collect();
                let usage = settle(&mut trail, &ends, tokens);
                if p.include_usage {
                    send(sse(&meta.usage_chunk(&usage))).await;
                }
                tracing::info!(completion_tokens = usage.completion_tokens, "completed");
                // [DONE] only once the row cannot be lost.
                if durable(trail.close(AuditStatus::Ok, StatusCode::OK, None)).await {
                    send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                } else {
                    let e = row_not_durable();
                    let p = e.parts();
                    let body = openai::error_body(&p.message, p.kind, None, Some(p.code));
                    send(sse(&body)).await;
                }
            }
            Err(cut) => end_early(&s, &tx, trail, cut, endpoint).await,
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
    endpoint: Endpoint,
) {
    let (status, told, code) = cut.ending(s, endpoint);
    if let Some(e) = told {
        let p = e.parts();
        let body = openai::error_body(&p.message, p.kind, None, Some(code));
        // Best effort, and never past the deadline.
        let _ = tokio::time::timeout(Duration::from_millis(100), tx.send(Ok(sse(&body)))).await;
    }
    tracing::warn!(status = status.as_str(), code, "stream ended early");
    durable(trail.close(status, StatusCode::OK, Some(code))).await;
}

/// What a stream still owes about log probabilities: the echoed prompt,
/// which waits for its last log probabilities and then goes out as the
/// first chunk of text, and the legacy shape's running text offset.
struct StreamScores {
    asked: Asked,
    echo: Option<Vec<TokenLogprob>>,
    offset: TextOffset,
    /// With tools, the answer's text, held until it is complete and read
    /// for calls.
    held: Option<calls::Holder>,
    tools: Option<openai::tools::Tools>,
    /// Each choice's harmony answer, once its first message came: its
    /// calls are held to the end.
    harmony: Vec<Option<harmony::Answer>>,
}

impl StreamScores {
    fn new(p: &Prepared) -> StreamScores {
        let asked = Asked::new(
            &p.request.spec.prompt,
            &p.request.spec.sampling,
            p.show_logprobs,
        );
        StreamScores {
            echo: asked.echo.as_ref().map(|_| Vec::new()),
            asked,
            offset: TextOffset::default(),
            held: p
                .tools
                .as_ref()
                .filter(|t| t.reads_calls())
                .map(calls::Holder::new),
            tools: p.tools.clone(),
            harmony: Vec::new(),
        }
    }

    /// The chunks one event of choice `index` becomes, and its end when it
    /// is the choice's `Finished`.
    fn chunks(
        &mut self,
        meta: &Meta,
        index: usize,
        event: WorkerEvent,
        trail: &mut Trail,
    ) -> (Vec<Value>, Option<upstream::Finished>) {
        match event {
            WorkerEvent::PromptLogprobs(v) => {
                self.prompt(v);
                (Vec::new(), None)
            }
            WorkerEvent::Delta {
                token_ids,
                text,
                logprobs,
                channel,
                device_time,
                load_time,
            } => {
                trail.spent(index, device_time, load_time);
                trail.record.completion_tokens += token_ids.len() as i32;
                let echo = self.echo(meta, index);
                // Only a chat answer is read by channel.
                let delta = match channel.filter(|_| meta.kind == Kind::Chat) {
                    Some(ch) => self.harmony_delta(meta, index, &ch, &text, &logprobs),
                    None => self.delta(meta, index, &text, &logprobs),
                };
                (echo.into_iter().chain(delta).collect(), None)
            }
            WorkerEvent::Finished(f) => {
                // An echo not sent yet: a prompt scored alone.
                let mut chunks: Vec<Value> = self.echo(meta, index).into_iter().collect();
                let mut reason = openai::finish_reason(&f);
                let answer = self.harmony.get_mut(index).and_then(Option::take);
                if let Some(found) = answer.as_ref().map(harmony::Answer::calls)
                    && !found.is_empty()
                {
                    let mut chunk = meta.chunk(index, None, false, None, None);
                    chunk["choices"][0]["delta"]["tool_calls"] = calls::tool_calls(found, true);
                    chunks.push(chunk);
                    reason = "tool_calls";
                } else if let Some(text) = self.held.take().map(calls::Holder::finish) {
                    // What was held: its calls, or its text.
                    match self.tools.as_ref().and_then(|t| t.read(&text)) {
                        Some((content, found)) => {
                            let mut chunk =
                                meta.chunk(index, content.as_deref(), false, None, None);
                            chunk["choices"][0]["delta"]["tool_calls"] =
                                calls::tool_calls(&found, true);
                            chunks.push(chunk);
                            reason = "tool_calls";
                        }
                        None if !text.is_empty() => {
                            chunks.push(meta.chunk(index, Some(&text), false, None, None));
                        }
                        None => {}
                    }
                }
                chunks.push(meta.chunk(index, None, false, Some(reason), None));
                (chunks, Some(f))
            }
            WorkerEvent::Accepted(_) => (Vec::new(), None),
        }
    }

    fn prompt(&mut self, scored: Vec<TokenLogprob>) {
        if let Some(e) = self.echo.as_mut() {
            e.extend(scored);
        }
    }

    /// The chunk that echoes the prompt, once: its text, and its tokens'
    /// log probabilities when asked.
    fn echo(&mut self, meta: &Meta, index: usize) -> Option<Value> {
        let prompt = self.echo.take()?;
        let text = self.asked.echo_text(&prompt).unwrap_or_default();
        let logprobs = meta.logprobs(&self.asked, &prompt, &mut self.offset);
        Some(meta.chunk(index, Some(&text), false, None, logprobs))
    }

    /// The chunk a harmony delta becomes: its text as `content` or as
    /// `reasoning_content`, or nothing for a call's arguments (held to the
    /// end), unless it says nothing.
    fn harmony_delta(
        &mut self,
        meta: &Meta,
        index: usize,
        channel: &upstream::Channel,
        text: &str,
        scored: &[TokenLogprob],
    ) -> Option<Value> {
        let logprobs = meta.logprobs(&self.asked, scored, &mut self.offset);
        if self.harmony.len() <= index {
            self.harmony.resize_with(index + 1, || None);
        }
        let part = self.harmony[index]
            .get_or_insert_default()
            .push(channel, text);
        let said = match part {
            harmony::Part::Call => "",
            _ => text,
        };
        if said.is_empty() && logprobs.is_none() {
            return None;
        }
        let mut chunk = meta.chunk(index, None, false, None, logprobs);
        if !said.is_empty() {
            let key = match part {
                harmony::Part::Reasoning => "reasoning_content",
                _ => "content",
            };
            chunk["choices"][0]["delta"][key] = said.into();
        }
        Some(chunk)
    }

    /// The chunk a delta becomes, unless it says nothing (its text held
    /// back, no log probabilities asked).
    fn delta(
        &mut self,
        meta: &Meta,
        index: usize,
        text: &str,
        scored: &[TokenLogprob],
    ) -> Option<Value> {
        let logprobs = meta.logprobs(&self.asked, scored, &mut self.offset);
        let text = match self.held.as_mut() {
            Some(held) => held.push(text),
            None => text.to_owned(),
        };
        (!text.is_empty() || logprobs.is_some())
            .then(|| meta.chunk(index, Some(&text), false, None, logprobs))
    }
}
