//! GPT-OSS's harmony format through the gateway, asked with the official
//! OpenAI Python SDK (`tests/openai_sdk/harmony.py`): the tiny GPT-OSS
//! trained to answer in harmony (`make_harmony_fixtures.py`, with the chat
//! template GPT-OSS ships) registered as a `gpt_oss` base, served by a
//! worker. A chat answer's `analysis` message is `reasoning_content` and
//! its `final` one `content`, whole and streamed; a call in the
//! `commentary` channel is a tool call; the call's result rendered back in
//! gives the trained answer; `reasoning_effort` and `chat_template_kwargs`
//! reach the template; a forced call, a content constraint and a Lark
//! grammar bind their own message; what cannot be served is refused by
//! name.

#[path = "support/admin_plane.rs"]
mod admin_plane;

use std::path::PathBuf;
use std::process::Command;

use admin_plane::*;
use lorafleet_tests::{engine_fixtures, sdk_python};
use serde_json::Value;

const MODEL: &str = "gpt-oss-harmony";

/// The body of the message in `channel` of the trained answer to chat
/// `name`, as the fixture script parsed it from transformers' greedy
/// answer.
fn trained(name: &str, channel: &str) -> Value {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(engine_fixtures().join("golden_harmony.json")).unwrap(),
    )
    .unwrap();
    let case = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap();
    let message = case["answer"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["channel"] == channel)
        .unwrap();
    message["text"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpt_oss_chat_answer_separates_reasoning_content_and_tool_calls() {
    let p = plane_on("harmony_sdk", 1, MODEL).await;
    let (key, _) = tenant_on_fixture_base(&p, "acme", MODEL, "gpt_oss");
    p.ctl_json(&[
        "routes",
        "set",
        "acme",
        "oss",
        "--base",
        "--base-model",
        MODEL,
    ]);
    p.until_status(0, &key, "oss", 200).await;

    let out = Command::new(sdk_python())
        .args([
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("openai_sdk/harmony.py")
                .to_str()
                .unwrap(),
            &format!("{}/v1", p.api_url(0)),
            "oss",
        ])
        .env("OPENAI_API_KEY", &key)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();

    // Reasoning apart from the answer, whole and streamed, at every effort.
    for case in ["hello", "hello_streamed", "hello_low", "hello_high"] {
        let r = &got[case];
        assert_eq!(
            r["reasoning_content"],
            trained("greeting", "analysis"),
            "{case}: {r}"
        );
        assert_eq!(r["content"], trained("greeting", "final"), "{case}: {r}");
        assert_eq!(r["finish_reason"], "stop", "{case}: {r}");
        assert_eq!(r["tool_calls"], Value::Array(vec![]), "{case}: {r}");
    }
    // `reasoning_effort` reached the template: its system message differs.
    let tokens = |case: &str| got[case]["prompt_tokens"].as_u64().unwrap();
    assert_ne!(tokens("hello_low"), tokens("hello_high"), "{got}");
    // So did `chat_template_kwargs`: the python tool's description is in
    // the system message.
    assert!(tokens("hello_python") > tokens("hello") + 20, "{got}");

    // A call in the commentary channel is a tool call, with its reasoning.
    for case in ["weather", "weather_streamed"] {
        let r = &got[case];
        assert_eq!(
            r["reasoning_content"],
            trained("weather", "analysis"),
            "{case}: {r}"
        );
        assert_eq!(r["finish_reason"], "tool_calls", "{case}: {r}");
        let calls = r["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{case}: {r}");
        assert_eq!(calls[0]["name"], "get_weather", "{case}: {r}");
        assert_eq!(
            calls[0]["arguments"],
            trained("weather", "commentary"),
            "{case}: {r}"
        );
        assert!(
            r["content"].is_null() || r["content"] == "",
            "{case}: no text besides the call: {r}"
        );
    }
    // The call and its result, rendered back by the template, give the
    // trained answer.
    let r = &got["weather_result"];
    assert_eq!(r["content"], trained("weather-result", "final"), "{r}");
    assert_eq!(
        r["reasoning_content"],
        trained("weather-result", "analysis"),
        "{r}"
    );

    // A forced call (named, and `required`, streamed) binds the call
    // message: the trained call, after the trained reasoning.
    for case in ["forced_call", "forced_call_streamed"] {
        let r = &got[case];
        assert_eq!(r["finish_reason"], "tool_calls", "{case}: {r}");
        assert_eq!(r["tool_calls"][0]["name"], "get_weather", "{case}: {r}");
        assert_eq!(
            r["tool_calls"][0]["arguments"],
            trained("weather", "commentary"),
            "{case}: {r}"
        );
        assert_eq!(
            r["reasoning_content"],
            trained("weather", "analysis"),
            "{case}: {r}"
        );
    }
    // A content constraint binds the final message's body, not the
    // reasoning before it.
    let r = &got["chosen"];
    assert!(r["content"] == "yes" || r["content"] == "no", "{r}");
    assert_eq!(
        r["reasoning_content"],
        trained("greeting", "analysis"),
        "{r}"
    );

    // So does a Lark grammar, a grammar of its own beside the answer's
    // (its rule `answer` is also one of the answer's).
    let r = &got["grammar"];
    assert!(
        r["content"] == "hi!" || r["content"] == "hello there!",
        "{r}"
    );
    assert_eq!(
        r["reasoning_content"],
        trained("greeting", "analysis"),
        "{r}"
    );

    // Refused by name: an effort the API does not know, and a Lark
    // grammar that does not compile.
    assert_eq!(got["refused_effort"], "reasoning_effort", "{got}");
    assert_eq!(got["refused_grammar"], "guided_grammar", "{got}");
    assert_eq!(
        got["refused_kwargs"], "chat_template_kwargs.messages",
        "{got}"
    );

    // One audit row per completion, every one served by the base.
    let rows = p.audit_rows("acme", "oss", 13).await;
    assert!(rows.iter().all(|r| r["lora_int_id"].is_null()), "{rows:?}");
}
