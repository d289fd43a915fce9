//! The one table from the generation contract's [`Field`] to the parameter
//! a client sent: a refusal, the gateway's own or a worker's, names what
//! the client wrote (`max_tokens`, `stop[1]`, `messages[2].content`,
//! `echo`, `guided_regex`), never the worker's wire.

use lorafleet_domain::generation::{ConstraintKind, Field, MessagePart};

/// Which OpenAI endpoint the request came to: a chat completion sent its
/// prompt as `messages`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    /// The endpoint a worker prompt came from: chat messages came to chat.
    pub fn of(prompt: &crate::upstream::Prompt) -> Endpoint {
        match prompt {
            crate::upstream::Prompt::Chat(_) => Endpoint::Chat,
            _ => Endpoint::Completions,
        }
    }
}

/// The parameter the client sent that `field` stands for; None for a field
/// of the worker's request that no client parameter stands for (the
/// request id, the adapter, a rollout's continuation).
pub fn client_param(field: Field, endpoint: Endpoint) -> Option<String> {
    let prompt = match endpoint {
        Endpoint::Completions => "prompt",
        Endpoint::Chat => "messages",
    };
    let name = match field {
        Field::RequestId
        | Field::Adapter
        | Field::FairnessKey
        | Field::FairnessWeight
        | Field::Continuation
        | Field::Sampling => return None,
        Field::Prompt | Field::PromptText | Field::PromptTokenIds | Field::Messages => prompt,
        Field::Message { index, part } => {
            let part = match part {
                MessagePart::Role => "role",
                MessagePart::Content => "content",
                MessagePart::ToolCalls => "tool_calls",
                MessagePart::ToolCallId => "tool_call_id",
                MessagePart::Name => "name",
                MessagePart::Reasoning => "reasoning_content",
            };
            return Some(format!("messages[{index}].{part}"));
        }
        Field::Tools => "tools",
        Field::ReasoningEffort => "reasoning_effort",
        Field::TemplateKwargs => "chat_template_kwargs",
        Field::MaxTokens => "max_tokens",
        Field::Temperature => "temperature",
        Field::TopP => "top_p",
        Field::TopK => "top_k",
        Field::MinP => "min_p",
        Field::Seed => "seed",
        Field::Stop => "stop",
        Field::StopString(i) => return Some(format!("stop[{i}]")),
        Field::StopTokenIds => "stop_token_ids",
        Field::Logprobs => match endpoint {
            Endpoint::Completions => "logprobs",
            Endpoint::Chat => "top_logprobs",
        },
        Field::PromptLogprobs => "echo",
        Field::LogitBias => "logit_bias",
        Field::LogitBiasToken(id) => return Some(format!("logit_bias.{id}")),
        Field::MinTokens => "min_tokens",
        Field::RepetitionPenalty => "repetition_penalty",
        Field::FrequencyPenalty => "frequency_penalty",
        Field::PresencePenalty => "presence_penalty",
        Field::N => "n",
        Field::BestOf => "best_of",
        Field::Constraint(kind) => match kind {
            ConstraintKind::JsonSchema | ConstraintKind::JsonObject => "response_format",
            ConstraintKind::Regex => "guided_regex",
            ConstraintKind::Choice => "guided_choice",
            ConstraintKind::Grammar => "guided_grammar",
            ConstraintKind::ToolCall => "tool_choice",
        },
    };
    Some(name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_field_is_named_as_the_client_sent_it() {
        use Endpoint::{Chat, Completions};
        for (field, endpoint, client) in [
            (Field::MaxTokens, Completions, Some("max_tokens")),
            (Field::StopString(0), Chat, Some("stop[0]")),
            (Field::Logprobs, Completions, Some("logprobs")),
            (Field::Logprobs, Chat, Some("top_logprobs")),
            (Field::PromptLogprobs, Completions, Some("echo")),
            (
                Field::Constraint(ConstraintKind::JsonSchema),
                Chat,
                Some("response_format"),
            ),
            (
                Field::Constraint(ConstraintKind::Regex),
                Completions,
                Some("guided_regex"),
            ),
            (Field::LogitBiasToken(7), Completions, Some("logit_bias.7")),
            (Field::Prompt, Completions, Some("prompt")),
            (Field::PromptTokenIds, Completions, Some("prompt")),
            (Field::Prompt, Chat, Some("messages")),
            (
                Field::Message {
                    index: 2,
                    part: MessagePart::ToolCalls,
                },
                Chat,
                Some("messages[2].tool_calls"),
            ),
            (Field::ReasoningEffort, Chat, Some("reasoning_effort")),
            (Field::TemplateKwargs, Chat, Some("chat_template_kwargs")),
            (Field::BestOf, Completions, Some("best_of")),
            (Field::N, Chat, Some("n")),
            (Field::RequestId, Completions, None),
            (Field::FairnessKey, Chat, None),
            (Field::Sampling, Chat, None),
        ] {
            assert_eq!(
                client_param(field, endpoint).as_deref(),
                client,
                "{field:?}"
            );
        }
    }
}
