//! Log probabilities through the real gateway and workers: `echo` and
//! `logprobs` on /v1/completions and `logprobs`/`top_logprobs` on chat,
//! whole and streamed, equal to transformers + PEFT; and two real clients,
//! lm-evaluation-harness (its loglikelihoods equal to its own `hf` backend
//! on the same model and adapter) and the official OpenAI Python SDK.

#[path = "support/fleet.rs"]
mod fleet;

use std::path::PathBuf;
use std::process::Command;

use fleet::*;
use lorafleet_tests::engine_fixtures;
use serde_json::{Value, json};

/// transformers + PEFT log probabilities of the engine's fixtures.
fn golden_case(adapter: Option<&str>, prompt: usize) -> Value {
    let g = fixture_json("golden_logprobs.json");
    g["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["model"] == "llama-gqa" && c["adapter"].as_str() == adapter)
        .nth(prompt)
        .unwrap()
        .clone()
}

fn close(got: &Value, want: &Value, what: &str) {
    let (g, w) = (got.as_f64().unwrap(), want.as_f64().unwrap());
    assert!((g - w).abs() <= 1e-4, "{what}: {g} against {w}");
}

/// Reads an SSE body's JSON events (not `[DONE]`).
fn events(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[tokio::test]
async fn echo_and_logprobs_through_the_gateway_equal_transformers_and_peft() {
    let f = fleet("openai_logprobs").await;
    for (model, adapter) in [("support", Some("qv-r8")), ("base-llama", None)] {
        let case = golden_case(adapter, 0);
        let ids = case["prompt_ids"].clone();
        let n_prompt = ids.as_array().unwrap().len();
        let completion = case["completion"].as_array().unwrap();
        let body = json!({"model": model, "prompt": ids, "max_tokens": completion.len(),
                          "temperature": 0, "logprobs": 5, "echo": true, "ignore_eos": true});
        let (status, v) = f
            .post("/v1/completions", Some(ACME_KEY), body.clone())
            .await;
        assert_eq!(status, 200, "{v}");
        let lp = &v["choices"][0]["logprobs"];
        let values = lp["token_logprobs"].as_array().unwrap();
        assert_eq!(values.len(), n_prompt + completion.len(), "{v}");
        assert_eq!(values[0], Value::Null, "nothing predicts the first token");
        assert_eq!(lp["top_logprobs"][0], Value::Null);
        for (i, want) in case["prompt"].as_array().unwrap().iter().enumerate() {
            close(
                &values[i + 1],
                &want["logprob"],
                &format!("{model} prompt[{}]", i + 1),
            );
        }
        for (i, want) in completion.iter().enumerate() {
            let at = n_prompt + i;
            close(
                &values[at],
                &want["logprob"],
                &format!("{model} completion[{i}]"),
            );
            // Greedy: the chosen token is the most likely one.
            let top = lp["top_logprobs"][at].as_object().unwrap();
            assert!(top.len() >= 5, "{top:?}");
            close(
                &json!(
                    top.values()
                        .map(|x| x.as_f64().unwrap())
                        .fold(f64::MIN, f64::max)
                ),
                &want["top"][0][1],
                "the best alternative",
            );
        }
        // The text offsets walk the echoed text, which the text opens.
        let offsets: Vec<u64> = lp["text_offset"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o.as_u64().unwrap())
            .collect();
        assert_eq!(offsets[0], 0);
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
        let chars = text(&v).chars().count() as u64;
        assert!(*offsets.last().unwrap() < chars, "{offsets:?} in {chars}");
        assert_eq!(v["usage"]["completion_tokens"], completion.len());

        // Streamed: the same tokens and values, chunk by chunk.
        let mut streamed = body.clone();
        streamed["stream"] = true.into();
        let text = f.stream("/v1/completions", &streamed).await;
        let mut s_tokens = Vec::new();
        let mut s_values = Vec::new();
        let mut s_text = String::new();
        for e in events(&text) {
            let choice = &e["choices"][0];
            s_text.push_str(choice["text"].as_str().unwrap_or(""));
            if let Some(l) = choice["logprobs"].as_object() {
                s_tokens.extend(l["tokens"].as_array().unwrap().clone());
                s_values.extend(l["token_logprobs"].as_array().unwrap().clone());
            }
        }
        assert_eq!(s_tokens, lp["tokens"].as_array().unwrap().clone(), "{text}");
        assert_eq!(&s_values, values);
        assert_eq!(s_text, v["choices"][0]["text"].as_str().unwrap());

        // The prompt alone: max_tokens 0 with echo.
        let (status, v) = f
            .post(
                "/v1/completions",
                Some(ACME_KEY),
                json!({"model": model, "prompt": case["prompt_ids"], "max_tokens": 0,
                       "echo": true, "logprobs": 0}),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 0);
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        let values = v["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap();
        assert_eq!(values.len(), n_prompt);
        close(
            &values[n_prompt - 1],
            &case["prompt"][n_prompt - 2]["logprob"],
            "last prompt token",
        );
    }

    // A text prompt's echo is the client's own text.
    let (status, v) = f
        .post(
            "/v1/completions",
            Some(ACME_KEY),
            json!({"model": "support", "prompt": "Grüße aus", "max_tokens": 2, "echo": true,
                   "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert!(text(&v).starts_with("Grüße aus"), "{v}");
    assert_eq!(
        v["choices"][0]["logprobs"],
        Value::Null,
        "echo without logprobs"
    );

    // Chat: content[] with bytes and the asked number of alternatives.
    let chat = json!({"model": "support", "messages": [{"role": "user", "content": "Grüße aus München! 🚀"}],
                      "max_tokens": 6, "temperature": 0, "logprobs": true, "top_logprobs": 3,
                      "ignore_eos": true});
    let (status, v) = f
        .post("/v1/chat/completions", Some(ACME_KEY), chat.clone())
        .await;
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 6, "{v}");
    let mut bytes = Vec::new();
    for c in content {
        let top = c["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the first alternative.
        assert_eq!(c["logprob"], top[0]["logprob"], "{c}");
        assert!(c["logprob"].as_f64().unwrap() <= 0.0);
        bytes.extend(
            c["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8),
        );
    }
    // The tokens' bytes spell the message's text.
    let message = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&bytes).replace('\u{FFFD}', ""),
        message.replace('\u{FFFD}', "")
    );
    let mut streamed = chat.clone();
    streamed["stream"] = true.into();
    let text = f.stream("/v1/chat/completions", &streamed).await;
    let s_content: Vec<Value> = events(&text)
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&s_content, content);

    // The sampling controls reach the worker: a bias of 100 on one token
    // makes it every token; min_tokens holds back a biased end.
    let (status, v) = f
        .post(
            "/v1/completions",
            Some(ACME_KEY),
            json!({"model": "support", "prompt": "The quick", "max_tokens": 4, "temperature": 0,
                   "logit_bias": {"7": 100}, "logprobs": 0, "presence_penalty": 0.5,
                   "frequency_penalty": 0.5, "repetition_penalty": 1.1}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let tokens = v["choices"][0]["logprobs"]["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 4);
    assert!(tokens.iter().all(|t| *t == tokens[0]), "{v}");
    let (status, v) = f
        .post(
            "/v1/completions",
            Some(ACME_KEY),
            json!({"model": "support", "prompt": "The quick", "max_tokens": 6, "temperature": 0,
                   "logit_bias": {"2": 100}, "min_tokens": 3}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["usage"]["completion_tokens"], 4,
        "three tokens, then EOS: {v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    // n choices: choice i is the request with seed + i; usage counts every
    // choice's tokens and the prompt once.
    let body = |n: u32, seed: u64, stream: bool| {
        json!({"model": "support", "prompt": "Once upon a time", "max_tokens": 5, "n": n,
               "temperature": 1.0, "seed": seed, "ignore_eos": true, "stream": stream})
    };
    let (status, v) = f
        .post("/v1/completions", Some(ACME_KEY), body(3, 40, false))
        .await;
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    assert_eq!(v["usage"]["completion_tokens"], 15, "{v}");
    let (_, one) = f
        .post("/v1/completions", Some(ACME_KEY), body(1, 40, false))
        .await;
    let prompt_tokens = one["usage"]["prompt_tokens"].clone();
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        let (_, alone) = f
            .post(
                "/v1/completions",
                Some(ACME_KEY),
                body(1, 40 + i as u64, false),
            )
            .await;
        assert_eq!(c["text"], alone["choices"][0]["text"], "choice {i}");
    }
    assert_ne!(choices[0]["text"], choices[1]["text"], "the seeds differ");
    // The choices after the first take the prompt's full KV blocks from
    // the worker's prefix cache.
    let hits = || async {
        let mut total = 0.0;
        for w in &f.workers {
            let text = reqwest::get(format!("http://{}/metrics", w.addr("metrics")))
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            total += text
                .lines()
                .find(|l| l.starts_with("lorafleet_prefix_cache_hit_tokens_total"))
                .and_then(|l| l.split_whitespace().last())
                .map_or(0.0, |v| v.parse::<f64>().unwrap());
        }
        total
    };
    let long = "Once upon a time, there was a little model that served many adapters. ".repeat(3);
    // The workers report their counters every 500 ms: earlier requests'
    // hits land before the count starts.
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    let before = hits().await;
    let (status, v) = f
        .post(
            "/v1/completions",
            Some(ACME_KEY),
            json!({"model": "support", "prompt": long, "max_tokens": 2, "n": 4, "temperature": 1.0}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap() as f64;
    let shared = 3.0 * ((prompt - 1.0) / 16.0).floor() * 16.0;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while hits().await - before < shared {
        assert!(
            std::time::Instant::now() < deadline,
            "{} prefix-cache hits, {shared} expected",
            hits().await - before
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    // Streamed: every chunk names its choice, each choice ends with its own
    // finish reason, and the texts are the whole response's.
    let streamed = f.stream("/v1/completions", &body(3, 40, true)).await;
    let mut texts = vec![String::new(); 3];
    let mut finishes = 0;
    for e in events(&streamed) {
        for c in e["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            texts[i].push_str(c["text"].as_str().unwrap_or(""));
            finishes += usize::from(c["finish_reason"].is_string());
        }
    }
    assert_eq!(finishes, 3, "{streamed}");
    for (i, t) in texts.iter().enumerate() {
        assert_eq!(
            t,
            choices[i]["text"].as_str().unwrap(),
            "streamed choice {i}"
        );
    }
    // best_of: the n of best_of choices with the highest cumulative log
    // probability; usage counts all of them.
    let mut four = body(4, 40, false);
    four["logprobs"] = 0.into();
    let (_, all) = f.post("/v1/completions", Some(ACME_KEY), four).await;
    let mut ranked: Vec<(f64, String)> = all["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let total = c["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .sum();
            (total, c["text"].as_str().unwrap().to_owned())
        })
        .collect();
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut best_of = body(2, 40, false);
    best_of["best_of"] = 4.into();
    let (status, v) = f.post("/v1/completions", Some(ACME_KEY), best_of).await;
    assert_eq!(status, 200, "{v}");
    let texts: Vec<&str> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(
        texts,
        [ranked[0].1.as_str(), ranked[1].1.as_str()],
        "{ranked:?}"
    );
    assert_eq!(v["choices"][0]["logprobs"], Value::Null, "not asked for");
    assert_eq!(v["usage"]["completion_tokens"], 20);

    let (status, v) = f
        .post(
            "/v1/chat/completions",
            Some(ACME_KEY),
            json!({"model": "support", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 3, "n": 2, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let c = v["choices"].as_array().unwrap();
    assert_eq!(c.len(), 2);
    assert_eq!(c[0]["message"], c[1]["message"], "greedy choices agree");

    // Structured outputs: sampled answers parse and validate; streamed too.
    let schema = json!({"type": "object", "properties": {
        "answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["answer", "n"], "additionalProperties": false});
    for seed in 0..3 {
        let (status, v) = f
            .post(
                "/v1/chat/completions",
                Some(ACME_KEY),
                json!({"model": "support", "messages": [{"role": "user", "content": "Answer in JSON"}],
                       "max_tokens": 60, "temperature": 1.0, "seed": seed,
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "a", "strict": true, "schema": schema}}}),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        let content = v["choices"][0]["message"]["content"].as_str().unwrap();
        let parsed: Value =
            serde_json::from_str(content).unwrap_or_else(|e| panic!("{content:?}: {e}"));
        assert!(
            ["yes", "no"].contains(&parsed["answer"].as_str().unwrap()),
            "{parsed}"
        );
        assert!(parsed["n"].as_u64().unwrap() <= 99, "{parsed}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
    let choice = json!({"model": "support", "prompt": "Pick:", "max_tokens": 10, "temperature": 1.0,
                        "seed": 3, "guided_choice": ["alpha", "beta gamma"]});
    let streamed = f.stream("/v1/completions", &choice).await;
    let text: String = events(&streamed)
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str().map(str::to_owned))
        .collect();
    assert!(["alpha", "beta gamma"].contains(&text.as_str()), "{text:?}");
    // A constraint the worker cannot compile is the client's field.
    let (status, v) = f
        .post(
            "/v1/completions",
            Some(ACME_KEY),
            json!({"model": "support", "prompt": "x", "guided_regex": "(unclosed"}),
        )
        .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "guided_regex", "{v}");

    // Tool calls: a named function or `required` always gives valid calls.
    let tools = json!([
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
            "additionalProperties": false}}},
        {"type": "function", "function": {"name": "time", "parameters": {"type": "object",
            "properties": {}, "additionalProperties": false}}},
    ]);
    let ask = |choice: Value, stream: bool| {
        json!({"model": "support", "messages": [{"role": "user", "content": "Weather in Paris?"}],
               "max_tokens": 120, "temperature": 1.0, "seed": 5, "tools": tools,
               "tool_choice": choice, "parallel_tool_calls": false, "stream": stream})
    };
    let named = json!({"type": "function", "function": {"name": "weather"}});
    for choice in [named.clone(), json!("required")] {
        let (status, v) = f
            .post(
                "/v1/chat/completions",
                Some(ACME_KEY),
                ask(choice.clone(), false),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{v}");
        assert_eq!(c["message"]["content"], Value::Null, "{v}");
        let call = &c["message"]["tool_calls"][0];
        assert_eq!(call["type"], "function");
        assert!(call["id"].as_str().unwrap().starts_with("call_"));
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        match call["function"]["name"].as_str().unwrap() {
            "weather" => assert!(
                args["city"].as_str().unwrap().chars().count() <= 8,
                "{args}"
            ),
            "time" => assert_eq!(args, json!({})),
            other => panic!("{other}"),
        }
        if choice == named {
            assert_eq!(call["function"]["name"], "weather");
        }
    }
    let streamed = f
        .stream("/v1/chat/completions", &ask(named.clone(), true))
        .await;
    let deltas: Vec<Value> = events(&streamed)
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["tool_calls"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(deltas.len(), 1, "{streamed}");
    assert_eq!(deltas[0]["index"], 0);
    assert_eq!(deltas[0]["function"]["name"], "weather");
    assert!(
        streamed.contains(r#""finish_reason":"tool_calls""#),
        "{streamed}"
    );
    // Tool results round-trip through the template; `auto` leaves a text
    // answer as text.
    let (status, v) = f
        .post(
            "/v1/chat/completions",
            Some(ACME_KEY),
            json!({"model": "support", "max_tokens": 4, "temperature": 0, "tools": tools,
                   "messages": [
                       {"role": "user", "content": "Weather in Paris?"},
                       {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
                           "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            json!({"model": "support", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            "/v1/completions",
            json!({"model": "support", "prompt": "x", "tools": tools}),
            "tools",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "support", "messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice.function.name",
        ),
    ] {
        let (status, v) = f.post(path, Some(ACME_KEY), body).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }

    // Each endpoint refuses the other's shape, by field.
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            json!({"model": "support", "messages": [{"role": "user", "content": "x"}], "logprobs": 2}),
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            json!({"model": "support", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
            "top_logprobs",
        ),
        (
            "/v1/completions",
            json!({"model": "support", "prompt": "x", "logprobs": 21}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"model": "support", "prompt": "x", "max_tokens": 0}),
            "max_tokens",
        ),
    ] {
        let (status, v) = f.post(path, Some(ACME_KEY), body).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }

    // Each row records the features its request used.
    let want = [
        "logprobs,echo",
        "echo",
        "n",
        "n,best_of",
        "logprobs,n",
        "logit_bias,min_tokens",
        "logprobs,logit_bias,penalties",
        "structured_output",
        "tools",
    ];
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let rows: Vec<String> =
            sqlx::query_scalar("SELECT features FROM audit_log WHERE status = 'ok'")
                .fetch_all(&f.pool)
                .await
                .unwrap();
        let missing: Vec<&&str> = want
            .iter()
            .filter(|w| !rows.iter().any(|r| r == **w))
            .collect();
        if missing.is_empty() {
            assert!(
                rows.iter().any(String::is_empty),
                "plain requests record none"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "missing {missing:?} in {rows:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

fn python() -> PathBuf {
    lorafleet_tests::sdk_python()
}

fn run_python(args: &[&str], envs: &[(&str, &str)]) -> String {
    let out = Command::new(python())
        .args(args)
        .envs(envs.iter().copied())
        .env("HF_DATASETS_OFFLINE", "1")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?} failed:\n{stderr}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn lm_eval_and_the_openai_sdk_are_served_as_by_the_reference() {
    let f = fleet("openai_clients").await;
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::tempdir().unwrap();
    let results = out.path().join("gateway.json");
    let tokenizer = engine_fixtures().join("llama-gqa");
    run_python(
        &[
            here.join("lm_eval/run.py").to_str().unwrap(),
            "gateway",
            &f.base_url,
            "support",
            tokenizer.to_str().unwrap(),
            results.to_str().unwrap(),
        ],
        &[("OPENAI_API_KEY", ACME_KEY)],
    );
    let got: Value = serde_json::from_str(&std::fs::read_to_string(&results).unwrap()).unwrap();
    let want: Value =
        serde_json::from_str(&std::fs::read_to_string(here.join("lm_eval/goldens.json")).unwrap())
            .unwrap();
    // Loglikelihoods (multiple choice): lm-eval's `hf` backend on the same
    // model and adapter, within 1e-3.
    let mc = want["lorafleet_mc"].as_object().unwrap();
    assert_eq!(got["lorafleet_mc"].as_object().unwrap().len(), mc.len());
    for (doc, choices) in mc {
        for (i, w) in choices.as_array().unwrap().iter().enumerate() {
            let g = &got["lorafleet_mc"][doc][i];
            let (g, w) = (g.as_f64().unwrap(), w.as_f64().unwrap());
            assert!(
                (g - w).abs() <= 1e-3,
                "doc {doc} choice {i}: {g} against {w}"
            );
        }
    }
    // Greedy generations: the same text.
    assert_eq!(got["lorafleet_gen"], want["lorafleet_gen"]);
    // Through chat (the template applied): an answer per document.
    let chat = got["lorafleet_gen_chat"].as_object().unwrap();
    assert_eq!(chat.len(), want["lorafleet_gen"].as_object().unwrap().len());

    // The official SDK parses every shape, streaming included.
    let said = run_python(
        &[
            here.join("openai_sdk/check.py").to_str().unwrap(),
            &format!("{}/v1", f.base_url),
            "support",
        ],
        &[("OPENAI_API_KEY", ACME_KEY)],
    );
    assert!(said.contains("openai sdk: ok"), "{said}");
}
