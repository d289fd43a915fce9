//! The request shapes: parsing, refusals by field, and the worker fields.

use super::*;

#[test]
fn type_errors_name_the_field() {
    let e =
        CompletionRequest::parse(br#"{"model":"m","prompt":"x","max_tokens":"ten"}"#).unwrap_err();
    assert_eq!(e.param, "max_tokens", "{e:?}");
    assert!(e.message.starts_with("max_tokens: invalid type"), "{e:?}");
    let e = ChatRequest::parse(br#"{"model":"m","messages":[{"role":1}]}"#).unwrap_err();
    assert_eq!(e.param, "messages[0].role", "{e:?}");
    let e = ChatRequest::parse(br#"{"messages":[]}"#).unwrap_err();
    assert_eq!(e.param, "model", "{e:?}");
    let e = CompletionRequest::parse(br#"{"model":"m"}"#).unwrap_err();
    assert_eq!(e.param, "prompt", "{e:?}");
    let e = ChatRequest::parse(b"not json").unwrap_err();
    assert!(e.message.contains("not valid JSON"), "{e:?}");
}

#[test]
fn every_shape_is_read_without_an_intermediate_value() {
    let prompt = |body: &str| CompletionRequest::parse(body.as_bytes()).map(|r| r.prompt);
    assert_eq!(
        prompt(r#"{"model":"m","prompt":[[1,2],[3]]}"#).unwrap(),
        PromptInput::TokenLists(vec![vec![1, 2], vec![3]])
    );
    assert_eq!(
        prompt(r#"{"model":"m","prompt":["a"]}"#).unwrap(),
        PromptInput::Texts(vec!["a".into()])
    );
    assert_eq!(
        prompt(r#"{"model":"m","prompt":[]}"#).unwrap(),
        PromptInput::Tokens(vec![])
    );
    for bad_prompt in [r#"["a",1]"#, "[1,[2]]", "[4294967296]", "[-1]", "{}", "7"] {
        let body = format!(r#"{{"model":"m","prompt":{bad_prompt}}}"#);
        let e = prompt(&body).unwrap_err();
        assert_eq!(e.param, "prompt", "{bad_prompt}: {e:?}");
        assert!(e.message.contains(PROMPT_EXPECTED), "{e:?}");
    }
    let e = CompletionRequest::parse(br#"{"model":"m","prompt":"x","stop":[1]}"#).unwrap_err();
    assert_eq!(e.param, "stop[0]", "{e:?}");
    let e = CompletionRequest::parse(br#"{"model":"x\ud800y","prompt":"p"}"#).unwrap_err();
    assert_eq!(e.param, "model", "{e:?}");
    assert!(e.message.contains("not valid JSON text"), "{e:?}");
    for (body, says) in [
        (&b"[1,2]"[..], "must be a JSON object"),
        (b"  ", "not valid JSON"),
        (br#"{"model":"m","prompt":"x"} trailing"#, "not valid JSON"),
        (br#"{"model":"m","prompt":"x""#, "not valid JSON"),
    ] {
        let e = CompletionRequest::parse(body).unwrap_err();
        assert_eq!(e.param, "", "{e:?}");
        assert!(e.message.contains(says), "{e:?}");
    }
    let e = ChatRequest::parse(br#"{"model":"m","messages":[{"role":"user","content":7}]}"#)
        .unwrap_err();
    assert_eq!(e.param, "messages[0].content", "{e:?}");
    // Off values are accepted; anything else not.
    for off in [
        r#""logprobs":false"#,
        r#""logit_bias":{}"#,
        r#""top_logprobs":null"#,
        r#""presence_penalty":0"#,
        r#""typical_p":1.0,"use_beam_search":false,"length_penalty":1,"bad_words":[]"#,
        r#""allowed_token_ids":[],"include_stop_str_in_output":false,"truncate_prompt_tokens":null"#,
    ] {
        let body = format!(r#"{{"model":"m","prompt":"x",{off}}}"#);
        let r = CompletionRequest::parse(body.as_bytes()).unwrap();
        assert!(r.to_worker().is_ok(), "{off}");
    }
    for (on, param) in [
        (r#""logprobs":{}"#, "logprobs"),
        (r#""top_logprobs":[1]"#, "top_logprobs"),
        (r#""logit_bias":false"#, "logit_bias"),
        (r#""logit_bias":{"x":1}"#, "logit_bias"),
        (r#""logit_bias":{"5":101}"#, "logit_bias.5"),
        (r#""presence_penalty":2.5"#, "presence_penalty"),
        (r#""frequency_penalty":-3"#, "frequency_penalty"),
        (r#""repetition_penalty":0"#, "repetition_penalty"),
        (r#""min_tokens":17"#, "min_tokens"),
        (r#""min_p":1.5"#, "min_p"),
        (r#""typical_p":0.9"#, "typical_p"),
        (r#""use_beam_search":true"#, "use_beam_search"),
        (r#""length_penalty":2"#, "length_penalty"),
        (r#""bad_words":["x"]"#, "bad_words"),
        (r#""allowed_token_ids":[1]"#, "allowed_token_ids"),
        (
            r#""include_stop_str_in_output":true"#,
            "include_stop_str_in_output",
        ),
        (r#""truncate_prompt_tokens":8"#, "truncate_prompt_tokens"),
    ] {
        let body = format!(r#"{{"model":"m","prompt":"x",{on}}}"#);
        let e = CompletionRequest::parse(body.as_bytes())
            .and_then(|r| r.to_worker())
            .unwrap_err();
        assert_eq!(e.param, param, "{on}");
    }
    // A refused body's model and user, for its row.
    assert_eq!(
        refused_echo(br#"{"model":"x\ud800y","user":null,"n":[1]}"#),
        Some((Some("x\u{fffd}y".into()), None))
    );
    assert_eq!(
        refused_echo(br#"{"model":{"a":1},"user":7}"#),
        Some((Some("{object}".into()), Some("7".into())))
    );
    assert_eq!(refused_echo(b"[]"), None);
}

#[test]
fn unsupported_fields_that_change_output_are_refused_by_name() {
    for (body, param) in [
        (r#"{"model":"m","prompt":"x","n":17}"#, "n"),
        (r#"{"model":"m","prompt":"x","n":0}"#, "n"),
        (
            r#"{"model":"m","prompt":"x","n":2,"best_of":17}"#,
            "best_of",
        ),
        (r#"{"model":"m","prompt":"x","logprobs":21}"#, "logprobs"),
        (r#"{"model":"m","prompt":"x","logprobs":-1}"#, "logprobs"),
        (r#"{"model":"m","prompt":"x","logprobs":true}"#, "logprobs"),
        (
            r#"{"model":"m","prompt":"x","top_logprobs":2}"#,
            "top_logprobs",
        ),
        (
            r#"{"model":"m","prompt":"x","temperature":3}"#,
            "temperature",
        ),
        (r#"{"model":"m","prompt":"x","max_tokens":0}"#, "max_tokens"),
        (r#"{"model":"m","prompt":["a","b"]}"#, "prompt"),
        (r#"{"model":"m","prompt":""}"#, "prompt"),
        (r#"{"model":"","prompt":"x"}"#, "model"),
        (r#"{"model":"m","prompt":"x","stop":["a",""]}"#, "stop[1]"),
        (
            r#"{"model":"m","prompt":"x","stream_options":{"include_usage":true}}"#,
            "stream_options",
        ),
    ] {
        let r = CompletionRequest::parse(body.as_bytes()).unwrap();
        let e = r.to_worker().unwrap_err();
        assert_eq!(e.param, param, "{body}: {e:?}");
    }
    let long = format!(
        r#"{{"model":"m","prompt":"x","stop":["{}"]}}"#,
        "s".repeat(lorafleet_domain::generation::MAX_STOP_STRING_BYTES + 1)
    );
    let e = CompletionRequest::parse(long.as_bytes())
        .unwrap()
        .to_worker()
        .unwrap_err();
    assert_eq!(e.param, "stop[0]", "{e:?}");
    let r = ChatRequest::parse(br#"{"model":"m","messages":[{"role":"wizard","content":"x"}]}"#)
        .unwrap();
    assert_eq!(r.to_worker().unwrap_err().param, "messages[0].role");
    let r = ChatRequest::parse(
        br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
    )
    .unwrap();
    assert_eq!(
        r.to_worker().unwrap_err().param,
        "messages[0].content[0].type"
    );
    for (extra, param) in [
        (r#""logprobs":2"#, "logprobs"),
        (r#""top_logprobs":3"#, "top_logprobs"),
        (r#""logprobs":true,"top_logprobs":21"#, "top_logprobs"),
        (r#""echo":true"#, "echo"),
        (r#""max_tokens":0,"logprobs":true"#, "max_tokens"),
    ] {
        let body =
            format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],{extra}}}"#);
        let e = ChatRequest::parse(body.as_bytes())
            .unwrap()
            .to_worker()
            .unwrap_err();
        assert_eq!(e.param, param, "{extra}: {e:?}");
    }
}

#[test]
fn logprobs_and_echo_map_to_the_worker_fields() {
    let completion = |extra: &str| {
        let body = format!(r#"{{"model":"m","prompt":"x",{extra}}}"#);
        let spec = CompletionRequest::parse(body.as_bytes())
            .unwrap()
            .to_worker()
            .unwrap();
        let s = &spec.sampling;
        (s.max_tokens, s.logprobs, s.prompt_logprobs)
    };
    assert_eq!(completion(r#""logprobs":5"#), (16, Some(5), None));
    assert_eq!(completion(r#""logprobs":0"#), (16, Some(0), None));
    // lm-evaluation-harness's loglikelihood request.
    assert_eq!(
        completion(r#""logprobs":1,"echo":true,"max_tokens":1"#),
        (1, Some(1), Some(1))
    );
    // The prompt alone, with its text.
    assert_eq!(
        completion(r#""echo":true,"max_tokens":0"#),
        (0, None, Some(0))
    );
    let chat = |extra: &str| {
        let body =
            format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],{extra}}}"#);
        let spec = ChatRequest::parse(body.as_bytes())
            .unwrap()
            .to_worker()
            .unwrap();
        let s = &spec.sampling;
        (s.logprobs, s.prompt_logprobs)
    };
    assert_eq!(chat(r#""logprobs":true"#), (Some(0), None));
    assert_eq!(chat(r#""logprobs":true,"top_logprobs":4"#), (Some(4), None));
    assert_eq!(chat(r#""logprobs":false,"top_logprobs":0"#), (None, None));
}

#[test]
fn accepted_requests_map_to_the_worker_fields() {
    let r = CompletionRequest::parse(
        br#"{"model":"m","prompt":[1,2,3],"max_tokens":5,"temperature":0,"stop":"x","seed":7,"logprobs":null,"unknown":1}"#,
    )
    .unwrap();
    let spec = r.to_worker().unwrap();
    let (prompt, s) = (&spec.prompt, &spec.sampling);
    assert_eq!(*prompt, Prompt::TokenIds(vec![1, 2, 3]));
    assert_eq!((s.max_tokens, s.temperature, s.seed), (5, 0.0, Some(7)));
    assert_eq!(s.stop, vec!["x".to_owned()]);
    let r = ChatRequest::parse(
        br#"{"model":"m","messages":[{"role":"developer","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"max_completion_tokens":9}"#,
    )
    .unwrap();
    let spec = r.to_worker().unwrap();
    let (prompt, s) = (&spec.prompt, &spec.sampling);
    let Prompt::Chat(upstream::ChatPrompt { messages, .. }) = prompt else {
        panic!()
    };
    assert_eq!(
        (messages[0].role.as_str(), messages[0].content.as_str()),
        ("system", "ab")
    );
    assert_eq!(s.max_tokens, 9);
}

#[test]
fn a_reasoning_model_s_fields_reach_the_template() {
    let r = ChatRequest::parse(
        br#"{"model":"m","reasoning_effort":"high","messages":[{"role":"user","content":"q"},
            {"role":"assistant","content":null,"reasoning_content":"Need f.",
             "tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]}]}"#,
    )
    .unwrap();
    let spec = r.to_worker().unwrap();
    let Prompt::Chat(chat) = &spec.prompt else {
        panic!()
    };
    assert_eq!(chat.reasoning_effort, Some(upstream::ReasoningEffort::High));
    assert_eq!(chat.messages[1].reasoning.as_deref(), Some("Need f."));
    assert_eq!(chat.messages[0].reasoning, None);
    let refused = |body: &[u8]| {
        ChatRequest::parse(body)
            .and_then(|r| r.to_worker())
            .unwrap_err()
    };
    let e = refused(
        br#"{"model":"m","reasoning_effort":"max","messages":[{"role":"user","content":"q"}]}"#,
    );
    assert_eq!(e.param, "reasoning_effort");
    let e = CompletionRequest::parse(br#"{"model":"m","prompt":"q","reasoning_effort":"low"}"#)
        .and_then(|r| r.to_worker())
        .unwrap_err();
    assert_eq!(e.param, "reasoning_effort");
    // vLLM's `chat_template_kwargs`: the client's object, as text.
    let kwargs = |extra: &str| {
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"q"}}],"chat_template_kwargs":{extra}}}"#
        );
        ChatRequest::parse(body.as_bytes())
            .and_then(|r| r.to_worker())
            .map(|spec| match &spec.prompt {
                Prompt::Chat(chat) => chat.template_kwargs_json.clone(),
                _ => panic!(),
            })
    };
    assert_eq!(
        kwargs(r#"{"enable_thinking": false}"#),
        Ok(Some(r#"{"enable_thinking": false}"#.into()))
    );
    assert_eq!(kwargs("{}"), Ok(None));
    assert_eq!(kwargs("null"), Ok(None));
    assert_eq!(kwargs("[1]").unwrap_err().param, "chat_template_kwargs");
    assert_eq!(
        kwargs(r#"{"a": 1, "tools": []}"#).unwrap_err().param,
        "chat_template_kwargs.tools"
    );
    let e = CompletionRequest::parse(
        br#"{"model":"m","prompt":"q","chat_template_kwargs":{"enable_thinking":true}}"#,
    )
    .and_then(|r| r.to_worker())
    .unwrap_err();
    assert_eq!(e.param, "chat_template_kwargs");
}

#[test]
fn structured_output_fields_map_to_one_constraint() {
    use upstream::Constraint as C;
    let constraint = |extra: &str| {
        let body =
            format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],{extra}}}"#);
        ChatRequest::parse(body.as_bytes())
            .and_then(|r| r.to_worker())
            .map(|spec| spec.sampling.constraint.clone())
    };
    assert_eq!(constraint(r#""response_format":{"type":"text"}"#), Ok(None));
    assert_eq!(
        constraint(r#""response_format":{"type":"json_object"}"#),
        Ok(Some(C::JsonObject))
    );
    // The schema travels as the client's own text.
    assert_eq!(
        constraint(
            r#""response_format":{"type":"json_schema","json_schema":{"name":"p","strict":true,"schema":{"type": "integer"}}}"#
        ),
        Ok(Some(C::JsonSchema(r#"{"type": "integer"}"#.into())))
    );
    assert_eq!(
        constraint(r#""guided_json":"{\"type\":\"string\"}""#),
        Ok(Some(C::JsonSchema(r#"{"type":"string"}"#.into())))
    );
    assert_eq!(
        constraint(r#""guided_choice":["a","b"]"#),
        Ok(Some(C::Choice(vec!["a".into(), "b".into()])))
    );
    assert_eq!(
        constraint(r#""guided_regex":"[0-9]+""#),
        Ok(Some(C::Regex("[0-9]+".into())))
    );
    for (extra, param) in [
        (
            r#""response_format":{"type":"xml"}"#,
            "response_format.type",
        ),
        (
            r#""response_format":{"type":"json_schema","json_schema":{"name":"p"}}"#,
            "response_format.json_schema.schema",
        ),
        (r#""guided_choice":[]"#, "guided_choice"),
        (
            r#""guided_regex":"a","guided_choice":["b"]"#,
            "guided_choice",
        ),
    ] {
        assert_eq!(constraint(extra).unwrap_err().param, param, "{extra}");
    }
    let big = format!(
        r#""guided_regex":"{}""#,
        "a".repeat(MAX_CONSTRAINT_BYTES + 1)
    );
    assert_eq!(constraint(&big).unwrap_err().param, "guided_regex");
}
