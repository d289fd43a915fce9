//! A chat answer in OpenAI's harmony format (GPT-OSS), as its messages
//! come from the worker, each piece of text tagged with its message's
//! channel: `final` is the answer's `content`, `analysis` its
//! `reasoning_content` (as vLLM returns it), and a `commentary` message to
//! `functions.NAME` one of its `tool_calls`, its body the call's arguments.

use super::openai::tools::Call;
use crate::upstream::Channel;

/// The prefix of a recipient that names one of the request's functions.
const FUNCTIONS: &str = "functions.";

/// Where a piece of a harmony answer goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    /// The answer (`final`, or a `commentary` preamble to the user).
    Content,
    /// The model's reasoning (`analysis`, or a message to a tool that is
    /// not one of the functions, such as a built-in browser).
    Reasoning,
    /// A tool call's arguments: held until the answer ends.
    Call,
}

/// Which part a message's text is.
pub(super) fn part(channel: &Channel) -> Part {
    match channel.recipient.as_deref() {
        Some(r) if r.starts_with(FUNCTIONS) => Part::Call,
        Some(_) => Part::Reasoning,
        None if channel.channel == "analysis" => Part::Reasoning,
        None => Part::Content,
    }
}

/// One choice's harmony answer so far.
#[derive(Debug, Default)]
pub(super) struct Answer {
    pub content: String,
    pub reasoning: String,
    calls: Vec<Call>,
    /// The header of the message the last call's text came in: text under
    /// another header opens another call.
    last_call: Option<Channel>,
}

impl Answer {
    /// Takes one piece of text; returns which part it is.
    pub fn push(&mut self, channel: &Channel, text: &str) -> Part {
        let part = part(channel);
        match part {
            Part::Content => self.content.push_str(text),
            Part::Reasoning => self.reasoning.push_str(text),
            Part::Call => {
                if self.last_call.as_ref() != Some(channel) {
                    let name = channel.recipient.as_deref().unwrap_or_default();
                    self.calls.push(Call {
                        name: name[FUNCTIONS.len()..].to_owned(),
                        arguments: String::new(),
                    });
                    self.last_call = Some(channel.clone());
                }
                if let Some(call) = self.calls.last_mut() {
                    call.arguments.push_str(text);
                }
            }
        }
        if part != Part::Call {
            self.last_call = None;
        }
        part
    }

    pub fn calls(&self) -> &[Call] {
        &self.calls
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(channel: &str, recipient: Option<&str>) -> Channel {
        Channel {
            channel: channel.into(),
            recipient: recipient.map(Into::into),
            content_type: recipient.map(|_| "json".into()),
        }
    }

    #[test]
    fn each_channel_lands_in_its_part_of_the_answer() {
        let mut a = Answer::default();
        let analysis = header("analysis", None);
        let call = header("commentary", Some("functions.get_weather"));
        assert_eq!(a.push(&analysis, "Need "), Part::Reasoning);
        assert_eq!(a.push(&analysis, "weather."), Part::Reasoning);
        assert_eq!(a.push(&call, "{\"location\": "), Part::Call);
        assert_eq!(a.push(&call, "\"Paris\"}"), Part::Call);
        assert_eq!(
            a.push(&header("commentary", None), "Checking. "),
            Part::Content
        );
        assert_eq!(a.push(&header("final", None), "Sunny."), Part::Content);
        assert_eq!(
            a.push(&header("commentary", Some("browser.search")), "q"),
            Part::Reasoning
        );
        assert_eq!(a.reasoning, "Need weather.q");
        assert_eq!(a.content, "Checking. Sunny.");
        assert_eq!(
            a.calls(),
            [Call {
                name: "get_weather".into(),
                arguments: "{\"location\": \"Paris\"}".into()
            }]
        );
        // A second message to the same function is a second call.
        a.push(&call, "{}");
        assert_eq!(a.calls().len(), 2);
    }
}
