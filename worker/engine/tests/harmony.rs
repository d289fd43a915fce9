//! GPT-OSS's harmony chat format (`scripts/make_harmony_fixtures.py`: the
//! tiny GPT-OSS trained to answer three chats in harmony, with the
//! `chat_template.jinja` GPT-OSS ships): the template renders as
//! transformers renders it (messages, tools, a past call and its result,
//! `reasoning_effort`, today's date), and an answer's tokens equal
//! transformers' greedy ones, read out as messages (channel, recipient,
//! body) as the harmony grammar defines them.

mod common;

use common::*;
use lorafleet_domain::generation::{ConstraintKind, Field, ToolCall, ToolFunction};
use lorafleet_engine::model::harmony::Channel;
use lorafleet_engine::model::tokenizer::{TemplateChat, TemplateMessage, Tokenizer};
use lorafleet_engine::{
    BackendChoice, Constraint, Engine, EngineError, EngineSettings, Event, Prompt, Request,
    Sampling,
};
use serde::Deserialize;
use serde_json::Value;

const MODEL: &str = "gpt-oss-harmony";

/// A chat as transformers renders it with the template.
#[derive(Deserialize)]
struct Render {
    name: String,
    messages: Vec<Value>,
    tools: Option<Value>,
    reasoning_effort: Option<String>,
    date: String,
    rendered: String,
    prompt_ids: Vec<u32>,
}

/// A trained chat and transformers' answer.
#[derive(Deserialize)]
struct Case {
    name: String,
    prompt_ids: Vec<u32>,
    logits: Vec<f32>,
    greedy: Vec<u32>,
    answer: Vec<Message>,
}

#[derive(Deserialize, Debug, PartialEq)]
struct Message {
    channel: String,
    recipient: Option<String>,
    text: String,
}

#[derive(Deserialize)]
struct HarmonyGolden {
    cases: Vec<Case>,
    renders: Vec<Render>,
}

/// The harmony model on the CPU backend (it has no adapters).
fn engine() -> Engine {
    Engine::load(
        &model_dir(MODEL),
        EngineSettings::default(),
        BackendChoice::Cpu,
    )
    .unwrap()
}

fn golden() -> HarmonyGolden {
    let path = fixtures().join("golden_harmony.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A golden chat's messages as the template sees them.
fn template_messages(case: &Render) -> Vec<TemplateMessage> {
    case.messages
        .iter()
        .map(|m| TemplateMessage {
            role: m["role"].as_str().unwrap().into(),
            content: m["content"].as_str().unwrap_or_default().into(),
            tool_calls: m.get("tool_calls").cloned(),
            tool_call_id: m["tool_call_id"].as_str().map(Into::into),
            name: None,
            thinking: m["thinking"].as_str().map(Into::into),
        })
        .collect()
}

#[test]
fn the_template_gpt_oss_ships_renders_as_transformers_renders_it() {
    let t = Tokenizer::from_dir(&model_dir(MODEL)).unwrap();
    let golden = golden();
    assert!(
        golden.renders.len() >= 10,
        "3 chats, 3 efforts, reasoning given back"
    );
    assert!(
        golden
            .renders
            .iter()
            .any(|r| r.rendered.matches("<|channel|>analysis").count() == 1),
        "a past call's reasoning is rendered"
    );
    let today = chrono::Local::now().format("%Y-%m-%d").to_string();
    for case in &golden.renders {
        let messages = template_messages(case);
        let text = t
            .render(&TemplateChat {
                extra: None,
                messages: &messages,
                tools: case.tools.as_ref(),
                add_generation_prompt: true,
                reasoning_effort: case.reasoning_effort.as_deref(),
            })
            .unwrap();
        // The template writes today's date; the golden was rendered on its
        // own day.
        let ours = format!("Current date: {today}\n");
        assert!(text.contains(&ours), "{}: {text}", case.name);
        let text = text.replace(&ours, &format!("Current date: {}\n", case.date));
        assert_eq!(
            text, case.rendered,
            "{} ({:?})",
            case.name, case.reasoning_effort
        );
        assert_eq!(
            t.encode(&text, false).unwrap(),
            case.prompt_ids,
            "{}",
            case.name
        );
    }
}

/// The messages an answer's events make: consecutive pieces under the
/// same header joined.
fn messages_of(events: &[(String, Option<Channel>)]) -> Vec<Message> {
    let mut out: Vec<(Channel, String)> = Vec::new();
    for (text, channel) in events {
        let Some(c) = channel else {
            assert!(text.is_empty(), "text outside any message: {text:?}");
            continue;
        };
        match out.last_mut() {
            Some((last, body)) if last == c => body.push_str(text),
            _ => out.push((c.clone(), text.clone())),
        }
    }
    out.into_iter()
        .map(|(c, text)| Message {
            channel: c.channel,
            recipient: c.recipient,
            text,
        })
        .collect()
}

#[test]
fn a_harmony_answer_equals_transformers_and_is_read_as_its_messages() {
    let golden = golden();
    // All at once: the chats share the batch.
    let requests = golden
        .cases
        .iter()
        .map(|case| greedy(Prompt::TokenIds(case.prompt_ids.clone()), None))
        .collect();
    let (tokens, pieces): (Vec<_>, Vec<_>) = run(&mut engine(), requests).into_iter().unzip();
    for (i, case) in golden.cases.iter().enumerate() {
        assert_eq!(tokens[i], case.greedy, "{}: greedy tokens", case.name);
        assert_eq!(
            messages_of(&pieces[i]),
            case.answer,
            "{}: messages",
            case.name
        );
    }
    // What the goldens hold: reasoning, then an answer or a call.
    let first = &golden.cases[0].answer;
    assert_eq!(
        (first[0].channel.as_str(), first[1].channel.as_str()),
        ("analysis", "final")
    );
    let call = golden
        .cases
        .iter()
        .find(|c| c.name == "weather")
        .unwrap()
        .answer
        .last()
        .unwrap();
    assert_eq!(call.recipient.as_deref(), Some("functions.get_weather"));
}

#[test]
fn the_trained_model_matches_transformers_logits_and_greedy_tokens() {
    let golden = golden();
    let cases = Golden {
        max_new_tokens: 128,
        cases: golden
            .cases
            .iter()
            .map(|c| GoldenCase {
                model: MODEL.into(),
                adapter: None,
                prompt: c.name.clone(),
                prompt_ids: c.prompt_ids.clone(),
                greedy: c.greedy.clone(),
                logits: c.logits.clone(),
            })
            .collect(),
    };
    assert_eq!(check_golden_cases_on_cpu(&cases, MODEL, MODEL), 9);
}

#[test]
fn a_text_prompt_that_opens_no_message_is_plain_text() {
    // Without `<|start|>` in the prompt nothing is read as harmony.
    let mut e = engine();
    e.submit(Request {
        id: "plain".into(),
        adapter: None,
        prompt: Prompt::Text("Say hello.".into()),
        params: Sampling {
            max_tokens: 8,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    })
    .unwrap();
    let mut channels = 0;
    while e.has_work() {
        for (_, event) in e.step().unwrap() {
            if let Event::Delta { channel, .. } = event {
                channels += usize::from(channel.is_some());
            }
        }
    }
    assert_eq!(channels, 0);
}

/// A greedy request of up to 128 tokens.
fn greedy(prompt: Prompt, constraint: Option<Constraint>) -> Request {
    Request {
        id: String::new().into(),
        adapter: None,
        prompt,
        params: Sampling {
            max_tokens: 128,
            temperature: 0.0,
            constraint,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    }
}

/// Runs `requests` together (as `h0`, `h1`, ...) to the end: each one's
/// tokens and its deltas' (text, channel).
#[allow(clippy::type_complexity)]
fn run(e: &mut Engine, requests: Vec<Request>) -> Vec<(Vec<u32>, Vec<(String, Option<Channel>)>)> {
    let mut out = vec![(Vec::new(), Vec::new()); requests.len()];
    for (i, r) in requests.into_iter().enumerate() {
        e.submit(Request {
            id: format!("h{i}").into(),
            ..r
        })
        .unwrap();
    }
    while e.has_work() {
        for (id, event) in e.step().unwrap() {
            let i: usize = id[1..].parse().unwrap();
            match event {
                Event::Delta {
                    token_ids,
                    text,
                    channel,
                    ..
                } => {
                    out[i].0.extend(token_ids);
                    out[i].1.push((text, channel));
                }
                Event::Failed(err) => panic!("{id}: {err}"),
                _ => {}
            }
        }
    }
    out
}

/// One greedy request on the harmony model: its tokens and messages.
fn answer(prompt: Prompt, constraint: Option<Constraint>) -> (Vec<u32>, Vec<Message>) {
    let (tokens, pieces) = run(&mut engine(), vec![greedy(prompt, constraint)]).remove(0);
    (tokens, messages_of(&pieces))
}

fn call_of(functions: &[(&str, &str)]) -> Constraint {
    Constraint::ToolCall(ToolCall {
        functions: functions
            .iter()
            .map(|(name, parameters)| ToolFunction {
                name: (*name).into(),
                parameters: (*parameters).into(),
            })
            .collect(),
        parallel: true,
    })
}

#[test]
fn a_constraint_binds_one_message_of_a_harmony_answer() {
    let golden = golden();
    let case = |name: &str| golden.cases.iter().find(|c| c.name == name).unwrap();
    let ids = |name: &str| Prompt::TokenIds(case(name).prompt_ids.clone());

    // The call the model was going to make anyway: the same tokens.
    let weather =
        r#"{"type":"object","properties":{"location":{"type":"string"}},"required":["location"]}"#;
    let (tokens, _) = answer(ids("weather"), Some(call_of(&[("get_weather", weather)])));
    assert_eq!(tokens, case("weather").greedy);

    // A greeting forced into a call: it thinks as trained, then writes a
    // call message to the function with arguments of its schema.
    let city = r#"{"type":"object","properties":{"location":{"enum":["Paris","Rome"]}},"required":["location"],"additionalProperties":false}"#;
    let (_, messages) = answer(
        ids("greeting"),
        Some(call_of(&[("get_weather", city), ("get_time", "{}")])),
    );
    assert_eq!(messages[0], case("greeting").answer[0], "the reasoning");
    let call = messages.last().unwrap();
    assert_eq!(call.channel, "commentary");
    assert_eq!(call.recipient.as_deref(), Some("functions.get_weather"));
    let args: Value = serde_json::from_str(&call.text).unwrap();
    assert!(
        ["Paris", "Rome"].contains(&args["location"].as_str().unwrap()),
        "{args}"
    );

    // A content constraint binds the final message's body.
    let (_, messages) = answer(
        ids("greeting"),
        Some(Constraint::Choice(vec!["yes".into(), "no".into()])),
    );
    let last = messages.last().unwrap();
    assert_eq!(
        (last.channel.as_str(), last.recipient.as_ref()),
        ("final", None)
    );
    assert!(["yes", "no"].contains(&last.text.as_str()), "{messages:?}");
    let (_, messages) = answer(ids("greeting"), Some(Constraint::JsonObject));
    let body: Value = serde_json::from_str(&messages.last().unwrap().text).unwrap();
    assert!(body.is_object());
    // A client's Lark grammar is the final body too, its rules its own
    // (`answer` and `body` are also rules of the answer's grammar).
    let lark =
        "start: answer \"!\"\nanswer: body | \"well, \" body\nbody: \"hi\" | \"hello there\"\n";
    let (_, messages) = answer(ids("greeting"), Some(Constraint::Grammar(lark.into())));
    assert_eq!(messages[0], case("greeting").answer[0], "the reasoning");
    let last = messages.last().unwrap();
    assert_eq!(
        (last.channel.as_str(), last.recipient.as_ref()),
        ("final", None)
    );
    assert!(
        ["hi!", "hello there!", "well, hi!", "well, hello there!"].contains(&last.text.as_str()),
        "{messages:?}"
    );
}

#[test]
fn a_constraint_a_harmony_answer_cannot_bind_is_refused_by_field() {
    let golden = golden();
    let submit = |prompt: Prompt, c: Constraint| {
        engine()
            .submit(Request {
                id: "r".into(),
                adapter: None,
                prompt,
                params: Sampling {
                    max_tokens: 8,
                    constraint: Some(c),
                    ..Default::default()
                }
                .validate()
                .unwrap(),
            })
            .unwrap_err()
    };
    let chat = Prompt::TokenIds(golden.cases[0].prompt_ids.clone());
    let field_of = |e: EngineError| match e {
        EngineError::InvalidRequest { field, reason } => (field, reason),
        other => panic!("{other}"),
    };
    // A client's grammar that does not compile is refused as its own.
    let (field, _) = field_of(submit(chat, Constraint::Grammar("start: (".into())));
    assert_eq!(field, Field::Constraint(ConstraintKind::Grammar));
    // A prompt that opens no message has no message to bind.
    let (field, reason) = field_of(submit(
        Prompt::Text("Say hello.".into()),
        Constraint::JsonObject,
    ));
    assert_eq!(field, Field::Constraint(ConstraintKind::JsonObject));
    assert!(reason.contains("opens none"), "{reason}");
}

#[test]
fn a_chat_s_template_kwargs_reach_the_template_and_cannot_shadow_its_own() {
    let e = engine();
    let chat = |kwargs: Option<&str>| {
        Prompt::Chat(lorafleet_engine::ChatPrompt {
            messages: vec![lorafleet_engine::ChatMessage {
                role: lorafleet_engine::Role::User,
                content: "Say hello.".into(),
                tool_calls_json: None,
                tool_call_id: None,
                name: None,
                reasoning: None,
            }],
            add_generation_prompt: true,
            tools_json: None,
            continuation: None,
            reasoning_effort: None,
            template_kwargs_json: kwargs.map(Into::into),
        })
    };
    let text = |kwargs| {
        let ids = e.tokenize(&chat(kwargs)).unwrap();
        e.tokenizer().decode(&ids).unwrap()
    };
    // GPT-OSS's template takes `builtin_tools` and `model_identity`.
    let plain = text(None);
    assert!(!plain.contains("## python"), "{plain}");
    assert!(plain.contains("You are ChatGPT"), "{plain}");
    let given = text(Some(
        r#"{"builtin_tools": ["python"], "model_identity": "You are a tiny test model."}"#,
    ));
    assert!(given.contains("## python"), "{given}");
    assert!(given.contains("You are a tiny test model."), "{given}");
    assert!(!given.contains("You are ChatGPT"), "{given}");
    // The request's own variables are not for the kwargs to set, and the
    // kwargs are an object.
    for bad in [
        r#"{"messages": []}"#,
        r#"{"reasoning_effort": "high"}"#,
        r#"["python"]"#,
        "{",
    ] {
        match e.tokenize(&chat(Some(bad))).unwrap_err() {
            EngineError::InvalidRequest { field, .. } => {
                assert_eq!(field, Field::TemplateKwargs, "{bad}")
            }
            other => panic!("{bad}: {other}"),
        }
    }
}
