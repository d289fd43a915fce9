use super::*;

/// Each out-of-range value is refused, naming its own field.
#[test]
fn every_bad_value_is_refused_by_its_field() {
    let s = Sampling::default;
    let bad: Vec<(Sampling, Field)> = vec![
        (
            Sampling {
                max_tokens: 0,
                ..s()
            },
            Field::MaxTokens,
        ),
        (
            Sampling {
                temperature: 2.5,
                ..s()
            },
            Field::Temperature,
        ),
        (
            Sampling {
                temperature: f32::NAN,
                ..s()
            },
            Field::Temperature,
        ),
        (Sampling { top_p: 0.0, ..s() }, Field::TopP),
        (Sampling { top_p: 1.5, ..s() }, Field::TopP),
        (Sampling { min_p: 1.5, ..s() }, Field::MinP),
        (Sampling { min_p: -0.1, ..s() }, Field::MinP),
        (
            Sampling {
                stop: vec!["x".into(), String::new()],
                ..s()
            },
            Field::StopString(1),
        ),
        (
            Sampling {
                stop: vec!["x".repeat(MAX_STOP_STRING_BYTES + 1)],
                ..s()
            },
            Field::StopString(0),
        ),
        (
            Sampling {
                stop: vec!["x".into(); MAX_STOP_STRINGS + 1],
                ..s()
            },
            Field::Stop,
        ),
        (
            Sampling {
                stop_token_ids: vec![1; MAX_STOP_TOKEN_IDS + 1],
                ..s()
            },
            Field::StopTokenIds,
        ),
        (
            Sampling {
                frequency_penalty: 2.5,
                ..s()
            },
            Field::FrequencyPenalty,
        ),
        (
            Sampling {
                presence_penalty: f32::NAN,
                ..s()
            },
            Field::PresencePenalty,
        ),
        (
            Sampling {
                repetition_penalty: 0.0,
                ..s()
            },
            Field::RepetitionPenalty,
        ),
        (
            Sampling {
                logit_bias: vec![(3, 101.0)],
                ..s()
            },
            Field::LogitBiasToken(3),
        ),
        (
            Sampling {
                logit_bias: vec![(1, 1.0); MAX_LOGIT_BIAS + 1],
                ..s()
            },
            Field::LogitBias,
        ),
        (
            Sampling {
                min_tokens: 17,
                ..s()
            },
            Field::MinTokens,
        ),
        (
            Sampling {
                logprobs: Some(21),
                ..s()
            },
            Field::Logprobs,
        ),
        (
            Sampling {
                prompt_logprobs: Some(21),
                ..s()
            },
            Field::PromptLogprobs,
        ),
        (
            Sampling {
                constraint: Some(Constraint::Regex("a".repeat(MAX_CONSTRAINT_BYTES + 1))),
                ..s()
            },
            Field::Constraint(ConstraintKind::Regex),
        ),
        (
            Sampling {
                constraint: Some(Constraint::Choice(vec![])),
                ..s()
            },
            Field::Constraint(ConstraintKind::Choice),
        ),
        (
            Sampling {
                constraint: Some(Constraint::Choice(vec!["a".into(), String::new()])),
                ..s()
            },
            Field::Constraint(ConstraintKind::Choice),
        ),
        (
            Sampling {
                constraint: Some(Constraint::ToolCall(ToolCall {
                    functions: vec![],
                    parallel: false,
                })),
                ..s()
            },
            Field::Constraint(ConstraintKind::ToolCall),
        ),
        (
            Sampling {
                constraint: Some(Constraint::ToolCall(ToolCall {
                    functions: vec![
                        ToolFunction {
                            name: "f".into(),
                            parameters: "{}".into(),
                        },
                        ToolFunction {
                            name: "f".into(),
                            parameters: "{}".into(),
                        },
                    ],
                    parallel: false,
                })),
                ..s()
            },
            Field::Constraint(ConstraintKind::ToolCall),
        ),
        (
            Sampling {
                constraint: Some(Constraint::ToolCall(ToolCall {
                    functions: vec![ToolFunction {
                        name: "".into(),
                        parameters: "{}".into(),
                    }],
                    parallel: false,
                })),
                ..s()
            },
            Field::Constraint(ConstraintKind::ToolCall),
        ),
    ];
    for (sampling, field) in bad {
        let refused = sampling.clone().validate().unwrap_err();
        assert_eq!(refused.field, field, "{sampling:?}: {refused}");
        assert!(
            refused.to_string().starts_with(&field.wire_path()),
            "{refused}"
        );
    }
}

#[test]
fn the_defaults_and_a_scored_prompt_are_valid() {
    let valid = Sampling::default().validate().unwrap();
    assert_eq!(*valid, Sampling::default());
    let scored = Sampling {
        max_tokens: 0,
        prompt_logprobs: Some(0),
        ..Sampling::default()
    };
    assert_eq!(scored.clone().validate().unwrap().into_inner(), scored);
}

#[test]
fn token_ids_are_checked_against_the_vocabulary() {
    let s = Sampling {
        stop_token_ids: vec![49],
        logit_bias: vec![(10, 1.0)],
        ..Sampling::default()
    };
    s.check_vocab(50).unwrap();
    let bias = Sampling {
        logit_bias: vec![(60, 1.0)],
        ..s.clone()
    };
    assert_eq!(
        bias.check_vocab(50).unwrap_err().field,
        Field::LogitBiasToken(60)
    );
    let stop = Sampling {
        stop_token_ids: vec![50],
        ..s
    };
    assert_eq!(stop.check_vocab(50).unwrap_err().field, Field::StopTokenIds);
}
