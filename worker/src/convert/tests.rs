use lorafleet_proto::tonic_types::StatusExt;

use super::*;

fn adapter_error(which: usize) -> AdapterError {
    let (adapter, field, reason) = ("a".to_owned(), "f".to_owned(), "r".to_owned());
    match which {
        0 => AdapterError::RankTooLarge {
            adapter,
            field,
            rank: 9,
            max: 8,
        },
        1 => AdapterError::BaseHashMismatch {
            adapter,
            declared: "x".into(),
            actual: "y".into(),
        },
        2 => AdapterError::Unsupported {
            adapter,
            field,
            reason,
        },
        3 => AdapterError::Invalid {
            adapter,
            field,
            reason,
        },
        4 => AdapterError::InvalidTensor {
            adapter,
            tensor: "t".into(),
            reason,
        },
        _ => AdapterError::Io {
            adapter,
            path: "/secret/path".into(),
            source: std::io::Error::other("denied"),
        },
    }
}

/// One refusal of every kind the worker can give.
fn every_refusal() -> Vec<Refusal> {
    let id = AdapterId::new(7).unwrap();
    let io = || std::io::Error::other("denied");
    let mut all = vec![
        Refusal::field(Field::TopP, "must be in (0, 1]"),
        Refusal::descriptor("adapter.rank", "must be positive"),
        Refusal::Draining,
        Refusal::AdapterIdReused { id },
        Refusal::BaseHashMismatch {
            asked: Sha256Hex::parse(&"a".repeat(64)).unwrap(),
            served: Sha256Hex::parse(&"b".repeat(64)).unwrap(),
        },
        Refusal::RankTooLarge { rank: 64, max: 16 },
        Refusal::RankMismatch {
            declared: 8,
            actual: 16,
        },
        Refusal::LoadTimeout {
            id,
            target: Residency::Device,
            waited: Duration::from_secs(60),
        },
        Refusal::TaskFailed { what: "a check" },
        Refusal::Artifact(ArtifactError::InvalidUri {
            uri: "x".into(),
            reason: "r".into(),
        }),
        Refusal::Artifact(ArtifactError::OutsideRoots { uri: "x".into() }),
        Refusal::Artifact(ArtifactError::NotFound { uri: "x".into() }),
        Refusal::Artifact(ArtifactError::StoreUnavailable {
            uri: "s3://b/x".into(),
            reason: "timed out".into(),
        }),
        Refusal::Artifact(ArtifactError::TooLarge {
            uri: "s3://b/x".into(),
            reason: "holds 9 objects, above the limit of 8".into(),
        }),
        Refusal::Artifact(ArtifactError::Unreadable {
            path: "/secret/path".into(),
            source: io(),
        }),
        Refusal::Artifact(ArtifactError::DigestMismatch {
            path: "/secret/path".into(),
            expected: "e".repeat(64),
            actual: "f".repeat(64),
        }),
        Refusal::Engine(EngineError::InvalidRequest {
            field: Field::Prompt,
            reason: "too long".into(),
        }),
        Refusal::Engine(EngineError::ContextLength {
            prompt_tokens: 9,
            max_tokens: 8,
            max_model_len: 16,
        }),
        Refusal::Engine(EngineError::QueueFull { waiting: 3 }),
        Refusal::Engine(EngineError::PinLimit { pinned: 3 }),
        Refusal::Engine(EngineError::Tokenizer("bad".into())),
        Refusal::Engine(EngineError::ChatTemplate("bad".into())),
        Refusal::Engine(EngineError::Backend("oom".into())),
        Refusal::Engine(EngineError::Io {
            path: "/secret/path".into(),
            source: io(),
        }),
        Refusal::Engine(EngineError::InvalidModel {
            file: "/secret/path".into(),
            field: "f".into(),
            reason: "r".into(),
        }),
    ];
    all.extend((0..6).map(|i| Refusal::Engine(EngineError::Adapter(adapter_error(i)))));
    all
}

#[test]
fn every_refusal_carries_a_known_reason_code_and_never_a_path_or_digest() {
    let mut reasons = std::collections::BTreeSet::new();
    for r in every_refusal() {
        let s = status(&r);
        let info = s
            .get_details_error_info()
            .unwrap_or_else(|| panic!("{r:?}: no ErrorInfo"));
        assert_eq!(info.domain, ERROR_DOMAIN, "{r:?}");
        let reason = Reason::parse(&info.reason)
            .unwrap_or_else(|| panic!("{r:?}: unknown reason {}", info.reason));
        reasons.insert(reason.as_str());
        assert_ne!(s.code(), Code::Ok, "{r:?}");
        assert!(!s.message().is_empty(), "{r:?}");
        assert!(
            !s.message().contains("/secret/path"),
            "{r:?}: {}",
            s.message()
        );
        assert!(
            !s.message().contains(&"f".repeat(64)),
            "{r:?}: {}",
            s.message()
        );
        // The field at fault, when named, is also the message's subject.
        if let Some(bad) = s.get_details_bad_request() {
            let field = &bad.field_violations[0].field;
            assert!(
                s.message().starts_with(field.as_str()),
                "{r:?}: {}",
                s.message()
            );
        }
    }
    // Every reason a worker can send is one some refusal gives.
    let all: std::collections::BTreeSet<_> = Reason::ALL.iter().map(|r| r.as_str()).collect();
    assert_eq!(reasons, all);
}

#[test]
fn descriptor_fields_and_request_fields_carry_different_reasons() {
    let d = pb::AdapterDescriptor {
        lora_int_id: 0,
        ..Default::default()
    };
    let refused = status(&descriptor(&d, "adapter").unwrap_err());
    let info = refused.get_details_error_info().unwrap();
    assert_eq!(info.reason, Reason::DescriptorInvalid.as_str());
    let r = pb::GenerateRequest::default();
    let refused = status(&generate_request(&r).unwrap_err());
    let info = refused.get_details_error_info().unwrap();
    assert_eq!(info.reason, Reason::InvalidField.as_str());
    assert!(refused.message().starts_with("request_id"));
}

#[test]
fn a_recorded_artifact_size_is_read_or_refused_by_field() {
    let base = pb::AdapterDescriptor {
        lora_int_id: 7,
        artifact_uri: "acme/v1".into(),
        artifact_sha256: "ab".repeat(32),
        base_hash: "cd".repeat(32),
        rank: 8,
        ..Default::default()
    };
    assert_eq!(descriptor(&base, "adapter").unwrap().artifact_size, None);
    let sized = pb::AdapterDescriptor {
        artifact_bytes: 4096,
        artifact_files: 2,
        ..base.clone()
    };
    assert_eq!(
        descriptor(&sized, "adapter").unwrap().artifact_size,
        Some((4096, 2))
    );
    let half = pb::AdapterDescriptor {
        artifact_bytes: 4096,
        ..base
    };
    let refused = status(&descriptor(&half, "adapter").unwrap_err());
    assert!(
        refused.message().starts_with("adapter.artifact_files"),
        "{}",
        refused.message()
    );
}

#[test]
fn tool_json_that_does_not_parse_is_refused_by_field() {
    let request = |chat: pb::ChatPrompt| pb::GenerateRequest {
        request_id: "r".into(),
        prompt: Some(pb::generate_request::Prompt::Chat(chat)),
        sampling: Some(pb::SamplingParams {
            max_tokens: 1,
            ..Default::default()
        }),
        ..Default::default()
    };
    let user = pb::ChatMessage {
        role: "user".into(),
        content: "hi".into(),
        ..Default::default()
    };
    for (chat, field) in [
        (
            pb::ChatPrompt {
                messages: vec![user.clone()],
                tools_json: "{not json".into(),
                ..Default::default()
            },
            "prompt.chat.tools_json",
        ),
        (
            pb::ChatPrompt {
                messages: vec![user.clone()],
                tools_json: r#"{"type":"function"}"#.into(),
                ..Default::default()
            },
            "prompt.chat.tools_json",
        ),
        (
            pb::ChatPrompt {
                messages: vec![
                    user.clone(),
                    pb::ChatMessage {
                        role: "assistant".into(),
                        tool_calls_json: "[".into(),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            },
            "prompt.chat.messages[1].tool_calls_json",
        ),
    ] {
        let refused = status(&generate_request(&request(chat)).unwrap_err());
        assert!(
            refused.message().starts_with(field),
            "{}",
            refused.message()
        );
    }
    let (_, spec) = generate_request(&request(pb::ChatPrompt {
        messages: vec![user],
        tools_json: r#"[{"type":"function","function":{"name":"f"}}]"#.into(),
        ..Default::default()
    }))
    .unwrap();
    let Prompt::Chat(chat) = &spec.prompt else {
        panic!()
    };
    assert_eq!(
        chat.tools_json.as_deref(),
        Some(r#"[{"type":"function","function":{"name":"f"}}]"#)
    );
}

#[test]
fn a_reasoning_effort_the_contract_does_not_know_is_refused_by_field() {
    let request = |effort: &str| pb::GenerateRequest {
        request_id: "r".into(),
        prompt: Some(pb::generate_request::Prompt::Chat(pb::ChatPrompt {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "hi".into(),
                ..Default::default()
            }],
            reasoning_effort: effort.into(),
            ..Default::default()
        })),
        sampling: Some(pb::SamplingParams {
            max_tokens: 1,
            ..Default::default()
        }),
        ..Default::default()
    };
    let refused = status(&generate_request(&request("max")).unwrap_err());
    assert!(
        refused
            .message()
            .starts_with("prompt.chat.reasoning_effort"),
        "{}",
        refused.message()
    );
    let (_, spec) = generate_request(&request("high")).unwrap();
    let Prompt::Chat(chat) = &spec.prompt else {
        panic!()
    };
    assert_eq!(chat.reasoning_effort, Some(ReasoningEffort::High));
    let (_, spec) = generate_request(&request("")).unwrap();
    let Prompt::Chat(chat) = &spec.prompt else {
        panic!()
    };
    assert_eq!(chat.reasoning_effort, None);
    // The template's further variables: an object naming none of the
    // request's own.
    for (kwargs, ok) in [
        (r#"{"enable_thinking":false}"#, true),
        (r#"{"messages":[]}"#, false),
        ("[1]", false),
    ] {
        let mut r = request("");
        if let Some(pb::generate_request::Prompt::Chat(c)) = &mut r.prompt {
            c.template_kwargs_json = kwargs.into();
        }
        match generate_request(&r) {
            Ok((_, spec)) => {
                assert!(ok, "{kwargs}");
                let Prompt::Chat(chat) = &spec.prompt else {
                    panic!()
                };
                assert_eq!(chat.template_kwargs_json.as_deref(), Some(kwargs));
            }
            Err(e) => {
                assert!(!ok, "{kwargs}");
                let message = status(&e).message().to_owned();
                assert!(
                    message.starts_with("prompt.chat.template_kwargs_json"),
                    "{message}"
                );
            }
        }
    }
}
