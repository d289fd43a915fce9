//! Adapters beyond plain LoRA served end to end, through a real gateway,
//! worker and Postgres: an adapter that ships its own tokenizer (a row of
//! the base's vocabulary given to a new token, `<tool>`, trained in the
//! embeddings and the lm_head: `trainable_token_indices`) is registered
//! with `lorafleetctl`, and a tenant's completion is tokenized and
//! detokenized with that tokenizer, giving transformers + PEFT's greedy
//! text (`golden_adapter_tokenizer.json`); the base model's route, asked
//! the same prompt, reads it with the base's tokenizer. An adapter whose
//! vocabulary grows past the base's (`golden_grown_vocab.json`) answers
//! its tenant the same way.

#[path = "support/admin_plane.rs"]
mod admin_plane;

use admin_plane::*;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_s_own_tokenizer_reads_and_writes_its_tenant_s_text() {
    let golden = fixture_json("golden_adapter_tokenizer.json");
    let p = plane("adapter_tokenizer").await;
    let (key, _, _) = acme_support(&p, "llama-gqa/o-r2");
    let id = register_adapter(&p, "acme", "tools", "saved/llama-gqa/tool-token-r4");
    let row = &p.ctl_json(&["adapters", "list", "--name", "tools"])["adapters"][0];
    assert_eq!(row["features"], json!(["trainable_tokens"]), "{row}");
    route_all(&p, "acme", "tools", id);
    p.ctl_json(&[
        "routes",
        "set",
        "acme",
        "base",
        "--base",
        "--base-model",
        "llama-gqa",
    ]);
    p.until_status(0, &key, "tools", 200).await;
    let ask = |model: &'static str, prompt: String, stream: bool| {
        let (http, url, key) = (p.http.clone(), p.api_url(0), key.clone());
        async move {
            let body = json!({"model": model, "prompt": prompt, "max_tokens": 12,
                              "temperature": 0, "stream": stream});
            let resp = http
                .post(format!("{url}/v1/completions"))
                .bearer_auth(&key)
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = resp.status();
            let text = resp.text().await.unwrap();
            assert_eq!(status, 200, "{text}");
            text
        }
    };
    for case in golden["cases"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap().to_owned();
        let whole: Value =
            serde_json::from_str(&ask("tools", prompt.clone(), false).await).unwrap();
        assert_eq!(
            whole["choices"][0]["text"], case["text"],
            "{prompt}: {whole}"
        );
        assert_eq!(
            whole["usage"]["prompt_tokens"],
            case["prompt_ids"].as_array().unwrap().len(),
            "{prompt}"
        );
        // Streamed, the pieces add up to the same text.
        let streamed: String = ask("tools", prompt.clone(), true)
            .await
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_owned))
            .collect();
        assert_eq!(streamed, case["text"].as_str().unwrap(), "{prompt}");
        let base: Value = serde_json::from_str(&ask("base", prompt.clone(), false).await).unwrap();
        assert_eq!(
            base["usage"]["prompt_tokens"],
            case["base_prompt_ids"].as_array().unwrap().len(),
            "{prompt}: {base}"
        );
        assert!(
            !base["choices"][0]["text"]
                .as_str()
                .unwrap()
                .contains("<tool>")
        );
    }
    let first = golden["cases"][0]["text"].as_str().unwrap();
    assert!(first.contains("<tool>"), "{first}");
    let rows = p.audit_rows("acme", "tools", 4).await;
    assert!(rows.iter().all(|r| r["lora_int_id"].as_i64() == Some(id)));

    // An adapter whose vocabulary grows past the base's (three chat tokens
    // added, its embed_tokens and lm_head saved with their rows): the
    // registry records its vocabulary, and its tenant's text reads and
    // writes the new tokens as transformers + PEFT do.
    let grown = fixture_json("golden_grown_vocab.json");
    let id = register_adapter(&p, "acme", "chat", "saved/llama-gqa/grown-vocab-r4");
    let row = &p.ctl_json(&["adapters", "list", "--name", "chat"])["adapters"][0];
    assert_eq!(row["vocab_size"], grown["rows"], "{row}");
    assert_eq!(row["features"], json!(["modules_to_save"]), "{row}");
    route_all(&p, "acme", "chat", id);
    p.until_status(0, &key, "chat", 200).await;
    for case in grown["cases"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap().to_owned();
        let whole: Value = serde_json::from_str(&ask("chat", prompt.clone(), false).await).unwrap();
        assert_eq!(
            whole["choices"][0]["text"], case["text"],
            "{prompt}: {whole}"
        );
        assert_eq!(
            whole["usage"]["prompt_tokens"],
            case["prompt_ids"].as_array().unwrap().len(),
            "{prompt}"
        );
        assert_eq!(
            whole["usage"]["completion_tokens"],
            case["greedy"].as_array().unwrap().len(),
            "{prompt}"
        );
    }
}
