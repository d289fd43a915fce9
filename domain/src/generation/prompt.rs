//! The prompt of a generation: text, token ids, or chat messages the worker
//! renders with the model's chat template. One definition for the gateway,
//! the wire's two conversions and the engine.

/// A request's prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Tokenized by the worker with the model's special tokens (such as
    /// BOS).
    Text(String),
    /// Used as they are; each below the model's vocabulary.
    TokenIds(Vec<u32>),
    /// Rendered with the model's chat template.
    Chat(ChatPrompt),
}

/// Chat messages and what the template is given with them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatPrompt {
    pub messages: Vec<ChatMessage>,
    /// Appends the template's assistant header, so that the model answers
    /// (what an OpenAI chat completion asks).
    pub add_generation_prompt: bool,
    /// The tools the model may call (OpenAI's `tools`): a JSON array, as
    /// text, for the template.
    pub tools_json: Option<String>,
    /// Text after the rendered chat, tokenized with it (no special tokens
    /// added): a given answer to be scored (a rollout's evaluation). None
    /// for a tenant's chat.
    pub continuation: Option<String>,
    /// How hard a reasoning model thinks before it answers, given to the
    /// template as `reasoning_effort` (GPT-OSS's harmony template writes it
    /// into the system message). None: the template's own default.
    pub reasoning_effort: Option<ReasoningEffort>,
    /// More variables for the template (vLLM's `chat_template_kwargs`:
    /// Qwen3's `enable_thinking`, GPT-OSS's `builtin_tools`): a JSON
    /// object, as text, none of whose names is one the contract gives the
    /// template itself ([`TEMPLATE_NAMES`]). None: none.
    pub template_kwargs_json: Option<String>,
}

/// The variables the contract itself gives a chat template; a request's
/// `template_kwargs_json` cannot name them.
pub const TEMPLATE_NAMES: [&str; 6] = [
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "reasoning_effort",
];

/// OpenAI's `reasoning_effort`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReasoningEffort {
    Low,
    Medium,
    High,
}

impl ReasoningEffort {
    const ALL: [ReasoningEffort; 3] = [
        ReasoningEffort::Low,
        ReasoningEffort::Medium,
        ReasoningEffort::High,
    ];

    /// The word the API, the wire and the template use.
    pub const fn as_str(self) -> &'static str {
        match self {
            ReasoningEffort::Low => "low",
            ReasoningEffort::Medium => "medium",
            ReasoningEffort::High => "high",
        }
    }

    /// The effort a word stands for; None for any other word.
    pub fn parse(word: &str) -> Option<ReasoningEffort> {
        Self::ALL.into_iter().find(|e| e.as_str() == word)
    }
}

/// The message of a harmony answer (GPT-OSS's format) a piece of text
/// belongs to: its header.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Channel {
    /// `analysis` (reasoning), `commentary` (tool calls, preambles) or
    /// `final` (the answer).
    pub channel: String,
    /// Whom the message is for: `functions.NAME` for a tool call; None for
    /// the user.
    pub recipient: Option<String>,
    /// What the body is (`json` for a call's arguments); None: text.
    pub content_type: Option<String>,
}

/// Who speaks a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    const ALL: [Role; 4] = [Role::System, Role::User, Role::Assistant, Role::Tool];

    /// The name chat templates and the wire use.
    pub const fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }

    /// The role a name stands for; None for any other name.
    pub fn parse(name: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == name)
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
    /// An assistant's tool calls: a JSON array in OpenAI's shape, each
    /// call's `arguments` a JSON object (what chat templates read), as
    /// text.
    pub tool_calls_json: Option<String>,
    /// A tool message: the call it answers.
    pub tool_call_id: Option<String>,
    /// The tool's or the participant's name.
    pub name: Option<String>,
    /// An assistant's reasoning before this message (OpenAI-compatible
    /// servers' `reasoning_content`), given back to the template as
    /// `thinking`: GPT-OSS's keeps the reasoning that led to a tool call.
    pub reasoning: Option<String>,
}

impl ChatMessage {
    /// A message of `role` with `content` alone.
    pub fn new(role: Role, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role,
            content: content.into(),
            tool_calls_json: None,
            tool_call_id: None,
            name: None,
            reasoning: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_role_reads_back_from_its_name() {
        for r in Role::ALL {
            assert_eq!(Role::parse(r.as_str()), Some(r));
        }
        assert_eq!(Role::parse("developer"), None);
        assert_eq!(Role::parse("User"), None);
    }

    #[test]
    fn a_reasoning_effort_reads_back_from_its_word() {
        for e in ReasoningEffort::ALL {
            assert_eq!(ReasoningEffort::parse(e.as_str()), Some(e));
        }
        assert_eq!(ReasoningEffort::parse("minimal"), None);
        assert_eq!(ReasoningEffort::parse("High"), None);
    }
}
