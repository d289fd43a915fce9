//! The tokenizer, the chat template and incremental detokenization on the
//! fixture's byte-level BPE, where multi-byte characters span tokens.

mod common;

use common::*;
use lorafleet_engine::model::tokenizer::{IncrementalDecoder, TemplateMessage, Tokenizer};

#[test]
fn encodes_with_bos_and_renders_the_chat_template() {
    let t = Tokenizer::from_dir(&model_dir("llama-gqa")).unwrap();
    let ids = t.encode("The quick brown fox", true).unwrap();
    assert_eq!(ids[0], 1, "BOS first");
    assert_eq!(t.decode(&ids).unwrap(), "The quick brown fox");
    let messages = vec![
        TemplateMessage {
            role: "system".into(),
            content: "  be brief ".into(),
            ..Default::default()
        },
        TemplateMessage {
            role: "user".into(),
            content: "hi".into(),
            ..Default::default()
        },
    ];
    let text = t.apply_chat_template(&messages, true).unwrap();
    assert_eq!(
        text,
        "<s><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = t.encode_chat(&messages, false).unwrap();
    assert_eq!(
        ids.iter().filter(|&&i| i == 1).count(),
        1,
        "BOS comes from the template only"
    );
}

#[test]
fn incremental_text_never_splits_a_character() {
    let t = Tokenizer::from_dir(&model_dir("llama-gqa")).unwrap();
    let text = "Grüße 🚀 日本語 ∑→ ok";
    let ids = t.encode(text, false).unwrap();
    assert!(
        ids.len() > text.chars().count() / 2,
        "the text spans many tokens"
    );
    let mut d = IncrementalDecoder::new(&[1]);
    let mut out = String::new();
    let mut empty_deltas = 0;
    for &id in &ids {
        let delta = d.push(&t, id).unwrap();
        assert!(
            !delta.contains('\u{FFFD}'),
            "a delta held a broken character: {delta:?}"
        );
        empty_deltas += delta.is_empty() as usize;
        out.push_str(&delta);
    }
    out.push_str(&d.flush(&t).unwrap());
    assert_eq!(out, text);
    assert!(
        empty_deltas > 0,
        "some tokens end mid-character, so their text waited"
    );
}

#[test]
fn a_prompt_cut_inside_a_character_still_streams_text() {
    let t = Tokenizer::from_dir(&model_dir("llama-gqa")).unwrap();
    let ids = t.encode("日本語", false).unwrap();
    // Find a cut where the prefix ends mid-character.
    let cut = (1..ids.len())
        .find(|&k| t.decode(&ids[..k]).unwrap().ends_with('\u{FFFD}'))
        .expect("the fixture tokenizer splits a CJK character");
    let mut d = IncrementalDecoder::new(&ids[..cut]);
    let mut out = String::new();
    for &id in &ids[cut..] {
        out.push_str(&d.push(&t, id).unwrap());
    }
    out.push_str(&d.flush(&t).unwrap());
    assert!(!out.is_empty() && !out.contains('\u{FFFD}'), "{out:?}");
    assert!("日本語".ends_with(&out), "{out:?}");
}

#[test]
fn each_tokens_bytes_concatenate_to_the_text_even_inside_a_character() {
    let t = Tokenizer::from_dir(&model_dir("llama-gqa")).unwrap();
    let text = "Grüße aus München! 🚀 日本語";
    let ids = t.encode(text, false).unwrap();
    let bytes: Vec<u8> = ids
        .iter()
        .flat_map(|&id| t.token_bytes(id).to_vec())
        .collect();
    assert_eq!(bytes, text.as_bytes());
    // Some token holds part of a character: its bytes are not UTF-8.
    assert!(
        ids.iter()
            .any(|&id| std::str::from_utf8(t.token_bytes(id)).is_err()),
        "the fixture splits a multi-byte character"
    );
    assert_eq!(t.token_bytes(1), b"<s>", "a special token is its text");
    assert!(t.token_bytes(1_000_000).is_empty());
}

#[test]
fn the_template_renders_tools_tool_calls_and_tool_results() {
    // A Hermes-style template (what Qwen2.5 ships), on the fixture tokenizer.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        model_dir("llama-gqa").join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    let template = concat!(
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}:{{ t.function.parameters | tojson }};{% endfor %}</tools>\n{% endif %}",
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}",
        "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{% endif %}",
        "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}",
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    );
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        serde_json::json!({"chat_template": template}).to_string(),
    )
    .unwrap();
    let t = Tokenizer::from_dir(dir.path()).unwrap();
    let tools = serde_json::json!([{"type": "function", "function": {"name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let messages = vec![
        TemplateMessage {
            role: "user".into(),
            content: "Paris?".into(),
            ..Default::default()
        },
        TemplateMessage {
            role: "assistant".into(),
            content: String::new(),
            tool_calls: Some(serde_json::json!([{"id": "c1", "type": "function",
                "function": {"name": "weather", "arguments": {"city": "Paris"}}}])),
            ..Default::default()
        },
        TemplateMessage {
            role: "tool".into(),
            content: "sunny".into(),
            tool_call_id: Some("c1".into()),
            ..Default::default()
        },
    ];
    let text = t.render_chat(&messages, Some(&tools), true).unwrap();
    assert_eq!(
        text,
        concat!(
            // `tojson` as transformers' (Python's `json.dumps`): keys in
            // their order, ", " and ": " between items.
            "<tools>weather:{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}};</tools>\n",
            "<|im_start|>user\nParis?<|im_end|>\n",
            "<|im_start|>assistant\n<tool_call>{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call><|im_end|>\n",
            "<|im_start|>tool\nsunny[c1]<|im_end|>\n<|im_start|>assistant\n"
        )
    );
    // Without tools, the template sees none.
    let plain = t.render_chat(&messages[..1], None, false).unwrap();
    assert_eq!(plain, "<|im_start|>user\nParis?<|im_end|>\n");
}
