//! [`Field`]: the part of a generation request a refusal is about, one
//! variant each. The worker's wire names it by its path in
//! `lorafleet.worker.v1` ([`Field::wire_path`], read back by
//! [`Field::from_wire_path`]); the gateway names it by the parameter its
//! client sent, from one table of its own.

use std::fmt;

/// Which structured-output constraint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConstraintKind {
    JsonSchema,
    JsonObject,
    Regex,
    Choice,
    Grammar,
    /// A call of one of the request's functions (`tool_choice`).
    ToolCall,
}

impl ConstraintKind {
    const ALL: [ConstraintKind; 6] = [
        ConstraintKind::JsonSchema,
        ConstraintKind::JsonObject,
        ConstraintKind::Regex,
        ConstraintKind::Choice,
        ConstraintKind::Grammar,
        ConstraintKind::ToolCall,
    ];

    /// Its name in the wire's `SamplingParams.constraint`.
    pub const fn wire_name(self) -> &'static str {
        match self {
            ConstraintKind::JsonSchema => "json_schema",
            ConstraintKind::JsonObject => "json_object",
            ConstraintKind::Regex => "regex",
            ConstraintKind::Choice => "choice",
            ConstraintKind::Grammar => "grammar",
            ConstraintKind::ToolCall => "tool_call",
        }
    }
}

/// A part of one chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessagePart {
    Role,
    Content,
    /// An assistant's tool calls.
    ToolCalls,
    ToolCallId,
    Name,
    Reasoning,
}

impl MessagePart {
    const ALL: [MessagePart; 6] = [
        MessagePart::Role,
        MessagePart::Content,
        MessagePart::ToolCalls,
        MessagePart::ToolCallId,
        MessagePart::Name,
        MessagePart::Reasoning,
    ];

    /// Its name in the wire's `ChatMessage`.
    pub const fn wire_name(self) -> &'static str {
        match self {
            MessagePart::Role => "role",
            MessagePart::Content => "content",
            MessagePart::ToolCalls => "tool_calls_json",
            MessagePart::ToolCallId => "tool_call_id",
            MessagePart::Name => "name",
            MessagePart::Reasoning => "reasoning",
        }
    }
}

/// The part of a generation request a refusal is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Field {
    RequestId,
    /// The adapter the request names.
    Adapter,
    /// Whose share of the worker the request uses, and its weight.
    FairnessKey,
    FairnessWeight,
    /// The prompt as a whole (for example: too long for the context).
    Prompt,
    PromptText,
    PromptTokenIds,
    /// A chat prompt's messages as a whole (for example: the template
    /// refused them).
    Messages,
    Message {
        index: usize,
        part: MessagePart,
    },
    /// The tools a chat prompt offers the model.
    Tools,
    /// A given answer scored after a chat prompt.
    Continuation,
    /// How hard a reasoning model thinks, for the chat template.
    ReasoningEffort,
    /// A chat prompt's further template variables.
    TemplateKwargs,
    /// The sampling parameters as a whole.
    Sampling,
    MaxTokens,
    Temperature,
    TopP,
    TopK,
    MinP,
    Seed,
    Stop,
    /// One stop string, by its index.
    StopString(usize),
    StopTokenIds,
    Logprobs,
    PromptLogprobs,
    LogitBias,
    /// One token's bias, by the token's id.
    LogitBiasToken(u32),
    MinTokens,
    RepetitionPenalty,
    FrequencyPenalty,
    PresencePenalty,
    Constraint(ConstraintKind),
    /// The choices a request returns, and those it generates. Not on the
    /// worker's wire (a worker runs one choice a request); their paths are
    /// OpenAI's names.
    N,
    BestOf,
}

/// The fields whose wire path is a fixed string.
const FIXED: [(Field, &str); 30] = [
    (Field::RequestId, "request_id"),
    (Field::Adapter, "adapter.lora_int_id"),
    (Field::FairnessKey, "fairness_key"),
    (Field::FairnessWeight, "fairness_weight"),
    (Field::Prompt, "prompt"),
    (Field::PromptText, "prompt.text"),
    (Field::PromptTokenIds, "prompt.token_ids.ids"),
    (Field::Messages, "prompt.chat.messages"),
    (Field::Tools, "prompt.chat.tools_json"),
    (Field::Continuation, "prompt.chat.continuation"),
    (Field::ReasoningEffort, "prompt.chat.reasoning_effort"),
    (Field::TemplateKwargs, "prompt.chat.template_kwargs_json"),
    (Field::Sampling, "sampling"),
    (Field::MaxTokens, "sampling.max_tokens"),
    (Field::Temperature, "sampling.temperature"),
    (Field::TopP, "sampling.top_p"),
    (Field::TopK, "sampling.top_k"),
    (Field::MinP, "sampling.min_p"),
    (Field::Seed, "sampling.seed"),
    (Field::Stop, "sampling.stop"),
    (Field::StopTokenIds, "sampling.stop_token_ids"),
    (Field::Logprobs, "sampling.logprobs"),
    (Field::PromptLogprobs, "sampling.prompt_logprobs"),
    (Field::LogitBias, "sampling.logit_bias"),
    (Field::MinTokens, "sampling.min_tokens"),
    (Field::RepetitionPenalty, "sampling.repetition_penalty"),
    (Field::FrequencyPenalty, "sampling.frequency_penalty"),
    (Field::PresencePenalty, "sampling.presence_penalty"),
    (Field::N, "n"),
    (Field::BestOf, "best_of"),
];

impl Field {
    /// Its path in the wire's `GenerateRequest`, as a gRPC `BadRequest`
    /// violation names it: `sampling.max_tokens`, `sampling.stop[2]`,
    /// `prompt.chat.messages[1].content`.
    pub fn wire_path(self) -> String {
        if let Some((_, path)) = FIXED.iter().find(|(f, _)| *f == self) {
            return (*path).to_owned();
        }
        match self {
            Field::StopString(i) => format!("sampling.stop[{i}]"),
            Field::LogitBiasToken(id) => format!("sampling.logit_bias[{id}]"),
            Field::Message { index, part } => {
                format!("prompt.chat.messages[{index}].{}", part.wire_name())
            }
            Field::Constraint(kind) => format!("sampling.{}", kind.wire_name()),
            // Every other field is in FIXED.
            other => format!("{other:?}"),
        }
    }

    /// The field a wire path names; None for a path that is no field of
    /// the contract (an adapter descriptor's own parts, say).
    pub fn from_wire_path(path: &str) -> Option<Field> {
        if let Some((f, _)) = FIXED.iter().find(|(_, p)| *p == path) {
            return Some(*f);
        }
        let indexed = |prefix: &str| -> Option<&str> {
            path.strip_prefix(prefix)?
                .strip_prefix('[')?
                .split_once(']')
                .map(|(i, rest)| if rest.is_empty() { i } else { "" })
                .filter(|i| !i.is_empty())
        };
        if let Some(i) = indexed("sampling.stop") {
            return i.parse().ok().map(Field::StopString);
        }
        if let Some(id) = indexed("sampling.logit_bias") {
            return id.parse().ok().map(Field::LogitBiasToken);
        }
        if let Some(kind) = path.strip_prefix("sampling.") {
            return ConstraintKind::ALL
                .into_iter()
                .find(|k| k.wire_name() == kind)
                .map(Field::Constraint);
        }
        let (index, part) = path
            .strip_prefix("prompt.chat.messages[")?
            .split_once("].")?;
        Some(Field::Message {
            index: index.parse().ok()?,
            part: MessagePart::ALL
                .into_iter()
                .find(|p| p.wire_name() == part)?,
        })
    }
}

/// The wire path.
impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.wire_path())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_reads_back_from_its_wire_path() {
        let mut fields: Vec<Field> = FIXED.iter().map(|(f, _)| *f).collect();
        fields.extend([Field::StopString(3), Field::LogitBiasToken(70_000)]);
        fields.extend(ConstraintKind::ALL.map(Field::Constraint));
        fields.extend(MessagePart::ALL.map(|part| Field::Message { index: 12, part }));
        let mut paths = std::collections::HashSet::new();
        for f in fields {
            let path = f.wire_path();
            assert!(!path.contains("::") && !path.contains('{'), "{f:?}: {path}");
            assert!(paths.insert(path.clone()), "{path} names two fields");
            assert_eq!(Field::from_wire_path(&path), Some(f), "{path}");
        }
        assert_eq!(
            Field::Message {
                index: 1,
                part: MessagePart::ToolCalls
            }
            .to_string(),
            "prompt.chat.messages[1].tool_calls_json"
        );
    }

    #[test]
    fn paths_outside_the_contract_name_no_field() {
        for path in [
            "",
            "adapter.artifact_uri",
            "trace_context",
            "sampling.stop[]",
            "sampling.stop[x]",
            "sampling.stop[1].x",
            "sampling.unknown",
            "prompt.chat.messages[1]",
            "prompt.chat.messages[a].role",
            "prompt.chat.messages[1].colour",
        ] {
            assert_eq!(Field::from_wire_path(path), None, "{path}");
        }
    }
}
