//! Every message of `lorafleet.worker.v1` survives encode → decode unchanged,
//! with every one of its fields set in at least one sample.
//!
//! The list of messages and fields comes from the compiled descriptor set, so
//! a message or field added to the `.proto` without a sample here fails the
//! test rather than going unchecked.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;

use lorafleet_proto::FILE_DESCRIPTOR_SET;
use lorafleet_proto::worker::v1::*;
use prost::Message;
use prost_types::{Duration, FileDescriptorSet, Timestamp};

const PACKAGE: &str = "lorafleet.worker.v1";

/// Field numbers (and oneof groups) of every message in the package.
#[derive(Debug, Default)]
struct MessageShape {
    fields: BTreeSet<i32>,
    /// Field number -> name, for readable failures.
    names: BTreeMap<i32, String>,
}

fn package_messages() -> BTreeMap<String, MessageShape> {
    let fds = FileDescriptorSet::decode(FILE_DESCRIPTOR_SET).expect("descriptor set decodes");
    let mut out = BTreeMap::new();
    for file in fds.file.iter().filter(|f| f.package() == PACKAGE) {
        for msg in &file.message_type {
            // A map field's entry type is the only nested message.
            assert!(
                msg.nested_type
                    .iter()
                    .all(|n| n.options.as_ref().is_some_and(|o| o.map_entry())),
                "nested messages other than map entries are not expected in {PACKAGE}"
            );
            let mut shape = MessageShape::default();
            for field in &msg.field {
                shape.fields.insert(field.number());
                shape.names.insert(field.number(), field.name().to_owned());
            }
            out.insert(format!("{PACKAGE}.{}", msg.name()), shape);
        }
    }
    out
}

/// Top-level field numbers present in an encoded message.
fn encoded_fields(mut buf: &[u8]) -> BTreeSet<i32> {
    fn varint(buf: &mut &[u8]) -> u64 {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = buf[0];
            *buf = &buf[1..];
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return value;
            }
        }
        panic!("varint too long");
    }
    let mut seen = BTreeSet::new();
    while !buf.is_empty() {
        let key = varint(&mut buf);
        seen.insert((key >> 3) as i32);
        match key & 7 {
            0 => {
                varint(&mut buf);
            }
            1 => buf = &buf[8..],
            2 => {
                let len = varint(&mut buf) as usize;
                buf = &buf[len..];
            }
            5 => buf = &buf[4..],
            other => panic!("unexpected wire type {other}"),
        }
    }
    seen
}

#[derive(Default)]
struct Coverage {
    checked: BTreeMap<String, BTreeSet<i32>>,
}

impl Coverage {
    fn check<M>(&mut self, samples: Vec<M>)
    where
        M: Message + prost::Name + Default + PartialEq + Debug,
    {
        let name = M::full_name();
        assert!(!samples.is_empty(), "{name}: no samples");
        let seen = self.checked.entry(name.clone()).or_default();
        for sample in samples {
            let bytes = sample.encode_to_vec();
            let decoded =
                M::decode(bytes.as_slice()).unwrap_or_else(|e| panic!("{name}: decode: {e}"));
            assert_eq!(decoded, sample, "{name}: changed in a round trip");
            // Decoding must also accept the length-delimited framing used in streams.
            let framed = sample.encode_length_delimited_to_vec();
            assert_eq!(
                M::decode_length_delimited(framed.as_slice()).unwrap(),
                sample
            );
            seen.extend(encoded_fields(&bytes));
        }
    }
}

fn ts(seconds: i64, nanos: i32) -> Timestamp {
    Timestamp { seconds, nanos }
}

fn dur(seconds: i64, nanos: i32) -> Duration {
    Duration { seconds, nanos }
}

fn descriptor() -> AdapterDescriptor {
    AdapterDescriptor {
        lora_int_id: 42,
        artifact_uri: "acme/support/v3".into(),
        artifact_sha256: "ab".repeat(32),
        base_hash: "cd".repeat(32),
        rank: 16,
        display_name: "support-bot@3".into(),
        artifact_bytes: 1_234_567,
        artifact_files: 2,
    }
}

fn base_model() -> BaseModel {
    BaseModel {
        name: "tiny-llama".into(),
        base_hash: "cd".repeat(32),
        architecture: "llama".into(),
        max_model_len: 4096,
        vocab_size: 32000,
        quantization: "gptq-int4, groups of 128".into(),
        weights_bytes: 35_000_000_000,
    }
}

fn capacity() -> Capacity {
    Capacity {
        max_loras: 8,
        max_lora_rank: 64,
        device_slots: 8,
        host_slots: 128,
        kv_blocks_total: 4096,
        kv_block_size: 16,
        max_waiting: 256,
    }
}

fn adapter_state() -> AdapterState {
    AdapterState {
        lora_int_id: 42,
        artifact_sha256: "ab".repeat(32),
        rank: 16,
        residency: Residency::Device as i32,
        pinned: true,
        active_requests: 3,
        queued_requests: 2,
        last_used: Some(ts(1_790_000_000, 123)),
        display_name: "support-bot@3".into(),
    }
}

fn sampling() -> SamplingParams {
    SamplingParams {
        max_tokens: 128,
        temperature: Some(0.0),
        top_p: Some(0.9),
        top_k: 40,
        min_p: 0.05,
        seed: Some(0),
        stop: vec!["\n\n".into(), "</s>".into()],
        stop_token_ids: vec![2, 7],
        ignore_eos: true,
        logprobs: Some(5),
        prompt_logprobs: Some(0),
        logit_bias: [(7, 2.5), (9, -100.0)].into_iter().collect(),
        min_tokens: 3,
        repetition_penalty: Some(1.1),
        frequency_penalty: 0.5,
        presence_penalty: -0.5,
        constraint: Some(sampling_params::Constraint::JsonSchema(
            r#"{"type":"object"}"#.into(),
        )),
    }
}

fn token_logprob(logprob: Option<f32>) -> TokenLogprob {
    TokenLogprob {
        token_id: 450,
        logprob,
        token: vec![0xE2, 0x9C],
        top: vec![TopLogprob {
            token_id: 7,
            logprob: -0.25,
            token: b"The".to_vec(),
        }],
    }
}

#[test]
fn every_message_round_trips_with_every_field_set() {
    let mut cov = Coverage::default();

    cov.check(vec![descriptor()]);
    cov.check(vec![base_model()]);
    cov.check(vec![capacity()]);
    cov.check(vec![TraceContext {
        traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
        tracestate: "vendor=opaque".into(),
    }]);
    cov.check(vec![TokenIds {
        ids: vec![1, 15043, 3186, 0, u32::MAX],
    }]);
    cov.check(vec![
        ChatMessage {
            role: "user".into(),
            content: "héllo ✓".into(),
            ..Default::default()
        },
        ChatMessage {
            role: "assistant".into(),
            content: String::new(),
            tool_calls_json:
                r#"[{"id":"c1","type":"function","function":{"name":"f","arguments":{}}}]"#.into(),
            tool_call_id: String::new(),
            name: "bot".into(),
            reasoning: "Need f.".into(),
        },
        ChatMessage {
            role: "tool".into(),
            content: "42".into(),
            tool_call_id: "c1".into(),
            ..Default::default()
        },
    ]);
    cov.check(vec![ChatPrompt {
        messages: vec![
            ChatMessage {
                role: "system".into(),
                content: "be brief".into(),
                ..Default::default()
            },
            ChatMessage {
                role: "user".into(),
                content: "hi".into(),
                ..Default::default()
            },
        ],
        add_generation_prompt: true,
        tools_json: r#"[{"type":"function","function":{"name":"f"}}]"#.into(),
        continuation: " yes".into(),
        reasoning_effort: "low".into(),
        template_kwargs_json: r#"{"enable_thinking":false}"#.into(),
    }]);
    let with = |c| SamplingParams {
        constraint: Some(c),
        ..sampling()
    };
    cov.check(vec![
        sampling(),
        with(sampling_params::Constraint::JsonObject(true)),
        with(sampling_params::Constraint::Regex("[0-9]+".into())),
        with(sampling_params::Constraint::Choice(Choices {
            choices: vec!["yes".into(), "no".into()],
        })),
        with(sampling_params::Constraint::Grammar("start: \"x\"".into())),
        with(sampling_params::Constraint::ToolCall(ToolCallConstraint {
            functions: vec![ToolFunction {
                name: "get_weather".into(),
                parameters_json: r#"{"type":"object"}"#.into(),
            }],
            parallel: true,
        })),
    ]);
    cov.check(vec![Choices {
        choices: vec!["a".into()],
    }]);
    let function = ToolFunction {
        name: "get_weather".into(),
        parameters_json: r#"{"type":"object"}"#.into(),
    };
    cov.check(vec![function.clone()]);
    cov.check(vec![ToolCallConstraint {
        functions: vec![function],
        parallel: true,
    }]);
    let trace = TraceContext {
        traceparent: "00-01-02-01".into(),
        tracestate: String::new(),
    };
    cov.check(vec![
        GenerateRequest {
            request_id: "0193a1c2-0000-7000-8000-000000000001".into(),
            adapter: Some(descriptor()),
            prompt: Some(generate_request::Prompt::Text("Once upon a time".into())),
            sampling: Some(sampling()),
            trace_context: Some(trace.clone()),
            fairness_key: "0197a3b2-tenant".into(),
            fairness_weight: 2.5,
        },
        GenerateRequest {
            request_id: "r2".into(),
            adapter: None,
            prompt: Some(generate_request::Prompt::TokenIds(TokenIds {
                ids: vec![1, 2, 3],
            })),
            sampling: Some(SamplingParams {
                max_tokens: 1,
                ..Default::default()
            }),
            trace_context: None,
            fairness_key: String::new(),
            fairness_weight: 0.0,
        },
        GenerateRequest {
            request_id: "r3".into(),
            adapter: Some(descriptor()),
            prompt: Some(generate_request::Prompt::Chat(ChatPrompt {
                messages: vec![ChatMessage {
                    role: "user".into(),
                    content: "hi".into(),
                    ..Default::default()
                }],
                add_generation_prompt: true,
                tools_json: String::new(),
                continuation: String::new(),
                reasoning_effort: String::new(),
                template_kwargs_json: String::new(),
            })),
            sampling: Some(sampling()),
            trace_context: Some(trace),
            fairness_key: String::new(),
            fairness_weight: 0.0,
        },
    ]);
    cov.check(vec![Accepted {
        prompt_tokens: 12,
        adapter_residency: Residency::Host as i32,
    }]);
    let channel = HarmonyChannel {
        channel: "commentary".into(),
        recipient: "functions.get_weather".into(),
        content_type: "json".into(),
    };
    cov.check(vec![channel.clone()]);
    cov.check(vec![TokenDelta {
        token_ids: vec![450, 29871],
        text: "The ✓".into(),
        logprobs: vec![token_logprob(Some(-1.5)), token_logprob(Some(0.0))],
        channel: Some(channel),
        device_time: Some(dur(0, 1_250_000)),
        load_time: Some(dur(0, 40_000)),
    }]);
    cov.check(vec![PromptLogprobs {
        logprobs: vec![token_logprob(None), token_logprob(Some(-3.0))],
    }]);
    cov.check(vec![token_logprob(Some(-1.0))]);
    cov.check(vec![TopLogprob {
        token_id: 1,
        logprob: -0.5,
        token: vec![1],
    }]);
    cov.check(vec![Usage {
        prompt_tokens: 12,
        completion_tokens: 34,
        cached_prompt_tokens: 8,
    }]);
    let finished = |stop| Finished {
        finish_reason: FinishReason::Stop as i32,
        stop_reason: Some(stop),
        usage: Some(Usage {
            prompt_tokens: 12,
            completion_tokens: 34,
            cached_prompt_tokens: 8,
        }),
        queue_time: Some(dur(0, 1_500_000)),
        time_to_first_token: Some(dur(0, 25_000_000)),
        total_time: Some(dur(1, 5)),
        adapter_residency: Residency::NotLoaded as i32,
        preemptions: 1,
        device_time: Some(dur(0, 7_250_000)),
        load_time: Some(dur(0, 310_000)),
    };
    cov.check(vec![
        finished(finished::StopReason::StopTokenId(2)),
        finished(finished::StopReason::StopString("\n\n".into())),
    ]);
    cov.check(vec![
        GenerateEvent {
            event: Some(generate_event::Event::Accepted(Accepted {
                prompt_tokens: 3,
                adapter_residency: Residency::Device as i32,
            })),
        },
        GenerateEvent {
            event: Some(generate_event::Event::Delta(TokenDelta {
                token_ids: vec![9],
                text: "x".into(),
                logprobs: vec![],
                channel: None,
                device_time: None,
                load_time: None,
            })),
        },
        GenerateEvent {
            event: Some(generate_event::Event::Finished(finished(
                finished::StopReason::StopTokenId(2),
            ))),
        },
        GenerateEvent {
            event: Some(generate_event::Event::PromptLogprobs(PromptLogprobs {
                logprobs: vec![token_logprob(None)],
            })),
        },
    ]);
    cov.check(vec![LoadAdapterRequest {
        adapter: Some(descriptor()),
        target: Residency::Device as i32,
        pin: Some(false),
    }]);
    cov.check(vec![LoadAdapterResponse {
        adapter: Some(adapter_state()),
        previous_residency: Residency::NotLoaded as i32,
        load_time: Some(dur(0, 80_000_000)),
    }]);
    cov.check(vec![UnloadAdapterRequest {
        lora_int_id: u64::MAX,
    }]);
    cov.check(vec![UnloadAdapterResponse {
        previous_residency: Residency::Host as i32,
        draining_requests: 2,
    }]);
    // Empty messages have no fields to cover; the round trip still counts.
    cov.check(vec![ListAdaptersRequest {}]);
    cov.check(vec![ListAdaptersResponse {
        adapters: vec![adapter_state(), adapter_state()],
    }]);
    cov.check(vec![adapter_state()]);
    cov.check(vec![WatchRequest {
        subscriber: "gateway-7f9c".into(),
    }]);
    cov.check(vec![Load {
        running_sequences: 31,
        waiting_sequences: 4,
        kv_blocks_used: 2000,
    }]);
    let counters = PoolCounters {
        device_hits: 1,
        host_hits: 2,
        host_loads: 3,
        device_loads: 4,
        device_evictions: 5,
        host_evictions: 6,
    };
    cov.check(vec![counters]);
    cov.check(vec![WorkerReport {
        worker_id: "lorafleet-worker-0".into(),
        sequence: 17,
        produced_at: Some(ts(1_790_000_000, 999_999_999)),
        status: ServingStatus::Draining as i32,
        base_model: Some(base_model()),
        capacity: Some(capacity()),
        load: Some(Load {
            running_sequences: 1,
            waiting_sequences: 0,
            kv_blocks_used: 9,
        }),
        adapters: vec![adapter_state()],
        counters: Some(counters),
        instance_id: "0193a1c2-0000-7000-8000-00000000abcd".into(),
    }]);
    cov.check(vec![InfoRequest {}]);
    let plan = MemoryPlan {
        weights_bytes: 16_060_000_000,
        kv_cache_bytes: 8 << 30,
        adapter_slots_bytes: 1 << 30,
        workspace_bytes: 300 << 20,
        margin_bytes: 4_600 << 20,
        device_total_bytes: 85_520_000_000,
    };
    cov.check(vec![plan]);
    cov.check(vec![InfoResponse {
        worker_id: "lorafleet-worker-0".into(),
        instance_id: "i-1".into(),
        base_model: Some(base_model()),
        capacity: Some(capacity()),
        backend: "cpu".into(),
        device_name: "x86_64".into(),
        version: "0.1.0".into(),
        artifact_schemes: vec!["file".into()],
        status: ServingStatus::Serving as i32,
        memory_plan: Some(plan),
    }]);

    let shapes = package_messages();
    let declared: BTreeSet<&String> = shapes.keys().collect();
    let covered: BTreeSet<&String> = cov.checked.keys().collect();
    assert_eq!(
        covered, declared,
        "every message in {PACKAGE} needs round-trip samples"
    );
    for (name, shape) in &shapes {
        let seen = &cov.checked[name];
        let missing: Vec<&str> = shape
            .fields
            .difference(seen)
            .map(|n| shape.names[n].as_str())
            .collect();
        assert!(
            missing.is_empty(),
            "{name}: no sample sets fields {missing:?}"
        );
    }
}

#[test]
fn service_methods_and_streaming_are_as_documented() {
    let fds = FileDescriptorSet::decode(FILE_DESCRIPTOR_SET).unwrap();
    let service = fds
        .file
        .iter()
        .filter(|f| f.package() == PACKAGE)
        .flat_map(|f| &f.service)
        .find(|s| s.name() == "Worker")
        .expect("service Worker");
    let methods: Vec<(&str, &str, &str, bool, bool)> = service
        .method
        .iter()
        .map(|m| {
            (
                m.name(),
                m.input_type().trim_start_matches(&format!(".{PACKAGE}.")),
                m.output_type().trim_start_matches(&format!(".{PACKAGE}.")),
                m.client_streaming(),
                m.server_streaming(),
            )
        })
        .collect();
    assert_eq!(
        methods,
        vec![
            ("Generate", "GenerateRequest", "GenerateEvent", false, true),
            (
                "LoadAdapter",
                "LoadAdapterRequest",
                "LoadAdapterResponse",
                false,
                false
            ),
            (
                "UnloadAdapter",
                "UnloadAdapterRequest",
                "UnloadAdapterResponse",
                false,
                false
            ),
            (
                "ListAdapters",
                "ListAdaptersRequest",
                "ListAdaptersResponse",
                false,
                false
            ),
            ("Watch", "WatchRequest", "WorkerReport", false, true),
            ("Info", "InfoRequest", "InfoResponse", false, false),
        ]
    );
    assert_eq!(
        lorafleet_proto::WORKER_SERVICE_NAME,
        format!("{PACKAGE}.{}", service.name())
    );
}

#[test]
fn every_enum_starts_with_unspecified_zero() {
    let fds = FileDescriptorSet::decode(FILE_DESCRIPTOR_SET).unwrap();
    let enums: Vec<_> = fds
        .file
        .iter()
        .filter(|f| f.package() == PACKAGE)
        .flat_map(|f| &f.enum_type)
        .collect();
    assert!(enums.len() >= 3);
    for e in enums {
        let first = &e.value[0];
        assert_eq!(first.number(), 0, "{}", e.name());
        assert!(
            first.name().ends_with("_UNSPECIFIED"),
            "{}: zero value is {}",
            e.name(),
            first.name()
        );
    }
}

#[test]
fn an_unknown_enum_value_decodes_and_reads_as_unspecified() {
    // A newer worker may send a residency this gateway does not know.
    let state = AdapterState {
        residency: 99,
        ..adapter_state()
    };
    let decoded = AdapterState::decode(state.encode_to_vec().as_slice()).unwrap();
    assert_eq!(decoded.residency, 99);
    assert_eq!(decoded.residency(), Residency::Unspecified);
}
