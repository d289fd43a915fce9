//! [`GenerationSpec`]: one generation request as a whole (its prompt, its
//! sampling with stops, constraint and log probabilities, and its
//! choices), validated in one function into a [`Valid`] value.

use super::{Field, Invalid, Prompt, Sampling, Valid};

/// The most choices one request may generate (`n`, `best_of`).
pub const MAX_CHOICES: u32 = 16;

/// How many choices a request generates, and how many of them it returns:
/// the most likely by mean log probability when it returns fewer
/// (`best_of` and `n`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choices {
    /// 1 to [`MAX_CHOICES`], at least `returned`.
    pub generated: u32,
    /// 1 to [`MAX_CHOICES`].
    pub returned: u32,
}

impl Choices {
    /// One choice, returned: what a worker runs per request.
    pub const ONE: Choices = Choices {
        generated: 1,
        returned: 1,
    };

    /// Whether the choices are ranked (some generated are not returned).
    pub const fn ranked(self) -> bool {
        self.returned < self.generated
    }
}

impl Default for Choices {
    fn default() -> Choices {
        Choices::ONE
    }
}

/// What a generation request asks for, before it is checked.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationSpec {
    pub prompt: Prompt,
    pub sampling: Sampling,
    pub choices: Choices,
}

impl GenerationSpec {
    /// Checks every part that does not depend on the model: the prompt is
    /// not empty, the sampling is in range ([`Sampling::validate`]), the
    /// choices are in range. The gateway calls it at its edge and the
    /// worker on what its wire carries; nothing checks a `Valid` one again.
    pub fn validate(self) -> Result<Valid<GenerationSpec>, Invalid> {
        let empty = match &self.prompt {
            Prompt::Text(t) if t.is_empty() => Some((Field::PromptText, "is empty")),
            Prompt::TokenIds(ids) if ids.is_empty() => Some((Field::PromptTokenIds, "is empty")),
            Prompt::Chat(c) if c.messages.is_empty() => {
                Some((Field::Messages, "must hold at least one message"))
            }
            _ => None,
        };
        if let Some((field, reason)) = empty {
            return Err(Invalid::new(field, reason));
        }
        let Choices {
            generated,
            returned,
        } = self.choices;
        if !(1..=MAX_CHOICES).contains(&returned) {
            return Err(Invalid::new(
                Field::N,
                format!("{returned} is not from 1 to {MAX_CHOICES}"),
            ));
        }
        if !(returned..=MAX_CHOICES).contains(&generated) {
            return Err(Invalid::new(
                Field::BestOf,
                format!("{generated} is not from n ({returned}) to {MAX_CHOICES}"),
            ));
        }
        let sampling = self.sampling.validate()?.into_inner();
        Ok(Valid(GenerationSpec { sampling, ..self }))
    }
}

impl Valid<GenerationSpec> {
    /// The request for choice `index` alone, as one worker runs it: the
    /// same prompt and sampling, seed + `index` where a seed was given, and
    /// each token's log probability where the choices are ranked (how the
    /// best are chosen). Choice 0 of a one-choice request is the request.
    pub fn choice(&self, index: u32) -> Valid<GenerationSpec> {
        let mut spec = self.0.clone();
        spec.sampling.seed = spec.sampling.seed.map(|s| s.wrapping_add(u64::from(index)));
        if spec.choices.ranked() {
            spec.sampling.logprobs.get_or_insert(0);
        }
        spec.choices = Choices::ONE;
        Valid(spec)
    }

    /// Its prompt and its checked sampling, for the engine.
    pub fn into_parts(self) -> (Prompt, Valid<Sampling>) {
        (self.0.prompt, Valid(self.0.sampling))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generation::{ChatPrompt, Constraint};

    fn spec(prompt: Prompt) -> GenerationSpec {
        GenerationSpec {
            prompt,
            sampling: Sampling::default(),
            choices: Choices::ONE,
        }
    }

    #[test]
    fn an_empty_prompt_bad_choices_or_bad_sampling_are_refused_by_field() {
        let text = || Prompt::Text("hi".into());
        let cases = [
            (spec(Prompt::Text(String::new())), Field::PromptText),
            (spec(Prompt::TokenIds(Vec::new())), Field::PromptTokenIds),
            (
                spec(Prompt::Chat(ChatPrompt {
                    messages: Vec::new(),
                    add_generation_prompt: true,
                    tools_json: None,
                    continuation: None,
                    reasoning_effort: None,
                    template_kwargs_json: None,
                })),
                Field::Messages,
            ),
            (
                GenerationSpec {
                    choices: Choices {
                        generated: 1,
                        returned: 0,
                    },
                    ..spec(text())
                },
                Field::N,
            ),
            (
                GenerationSpec {
                    choices: Choices {
                        generated: MAX_CHOICES + 1,
                        returned: MAX_CHOICES + 1,
                    },
                    ..spec(text())
                },
                Field::N,
            ),
            (
                GenerationSpec {
                    choices: Choices {
                        generated: 2,
                        returned: 3,
                    },
                    ..spec(text())
                },
                Field::BestOf,
            ),
            (
                GenerationSpec {
                    choices: Choices {
                        generated: MAX_CHOICES + 1,
                        returned: 3,
                    },
                    ..spec(text())
                },
                Field::BestOf,
            ),
            (
                GenerationSpec {
                    sampling: Sampling {
                        constraint: Some(Constraint::Choice(Vec::new())),
                        ..Sampling::default()
                    },
                    ..spec(text())
                },
                Field::Constraint(crate::generation::ConstraintKind::Choice),
            ),
        ];
        for (bad, field) in cases {
            let what = format!("{bad:?}");
            assert_eq!(bad.validate().unwrap_err().field, field, "{what}");
        }
        let ok = GenerationSpec {
            choices: Choices {
                generated: MAX_CHOICES,
                returned: 1,
            },
            ..spec(Prompt::TokenIds(vec![1]))
        };
        assert!(ok.validate().is_ok());
    }

    #[test]
    fn each_choice_is_one_request_with_its_own_seed_and_scores_when_ranked() {
        let ranked = GenerationSpec {
            sampling: Sampling {
                seed: Some(u64::MAX),
                ..Sampling::default()
            },
            choices: Choices {
                generated: 3,
                returned: 1,
            },
            ..spec(Prompt::Text("hi".into()))
        }
        .validate()
        .unwrap();
        let c2 = ranked.choice(2);
        assert_eq!(c2.choices, Choices::ONE);
        assert_eq!(c2.sampling.seed, Some(1));
        assert_eq!(c2.sampling.logprobs, Some(0));
        // Choice i of choice 0 is choice i of the request.
        assert_eq!(ranked.choice(0).choice(2), c2);
        // Unranked choices keep the client's log probabilities (none).
        let plain = GenerationSpec {
            choices: Choices {
                generated: 2,
                returned: 2,
            },
            ..spec(Prompt::Text("hi".into()))
        }
        .validate()
        .unwrap();
        let c1 = plain.choice(1);
        assert_eq!((c1.sampling.seed, c1.sampling.logprobs), (None, None));
        let (prompt, sampling) = c1.into_parts();
        assert_eq!(prompt, Prompt::Text("hi".into()));
        assert_eq!(*sampling, Sampling::default());
    }
}
