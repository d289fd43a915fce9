//! The stable reason codes of worker refusals.
//!
//! A worker puts one of these in a refusal's `google.rpc.ErrorInfo` (domain
//! [`ERROR_DOMAIN`]); the gateway reads it back with [`Reason::parse`] and
//! decides by it, never by the message. The strings are part of the wire
//! contract: a code is added, never renamed.

/// The `ErrorInfo.domain` of every worker refusal.
pub const ERROR_DOMAIN: &str = "lorafleet.worker";

/// Declares [`Reason`], its wire strings and [`Reason::ALL`] from one list,
/// so no variant can miss its string or its place in `ALL`.
macro_rules! reasons {
    ($($(#[$doc:meta])* $variant:ident => $wire:literal,)*) => {
        /// Why a worker refused a call.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Reason {
            $($(#[$doc])* $variant,)*
        }

        impl Reason {
            /// Every reason, for tests and documentation.
            pub const ALL: &[Reason] = &[$(Reason::$variant),*];

            /// The wire string.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Reason::$variant => $wire,)*
                }
            }
        }
    };
}

reasons! {
    /// A field of the request itself (prompt, sampling, ids) is invalid.
    InvalidField => "invalid_field",
    /// The prompt plus max_tokens does not fit the model's context.
    ContextLengthExceeded => "context_length_exceeded",
    /// The prompt cannot be tokenized or templated.
    PromptInvalid => "prompt_invalid",
    /// A field of the adapter descriptor is invalid.
    DescriptorInvalid => "descriptor_invalid",
    /// The artifact URI is malformed or outside the allowed roots.
    ArtifactUriInvalid => "artifact_uri_invalid",
    /// No artifact at the URI.
    ArtifactNotFound => "artifact_not_found",
    /// The artifact exists but cannot be read.
    ArtifactUnreadable => "artifact_unreadable",
    /// The artifact's bytes do not hash to the registered digest.
    ArtifactDigestMismatch => "artifact_digest_mismatch",
    /// The object store holding the artifact failed or did not answer in
    /// time, after its retries.
    ArtifactStoreUnavailable => "artifact_store_unavailable",
    /// The artifact holds more bytes or objects than the worker fetches.
    ArtifactTooLarge => "artifact_too_large",
    /// The adapter was trained on another base model.
    AdapterBaseHashMismatch => "adapter_base_hash_mismatch",
    /// The adapter's rank is above the worker's maximum.
    AdapterRankTooLarge => "adapter_rank_too_large",
    /// The artifact's rank is above the descriptor's.
    AdapterRankMismatch => "adapter_rank_mismatch",
    /// The adapter id is loaded already from another artifact.
    AdapterIdReused => "adapter_id_reused",
    /// The adapter targets modules the engine cannot serve.
    AdapterUnsupported => "adapter_unsupported",
    /// The adapter's files are malformed.
    AdapterInvalid => "adapter_invalid",
    /// The adapter did not reach the asked tier in time.
    AdapterLoadTimeout => "adapter_load_timeout",
    /// The engine's waiting queue is full.
    QueueFull => "queue_full",
    /// Every slot that could be pinned is pinned.
    PinLimit => "pin_limit",
    /// The worker is draining and takes no new work.
    Draining => "draining",
    /// The worker failed; its log says why.
    Internal => "internal",
}

impl Reason {
    /// The reason a wire string names; None for a code this build does not
    /// know (a newer worker's).
    pub fn parse(s: &str) -> Option<Reason> {
        Reason::ALL.iter().copied().find(|r| r.as_str() == s)
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_round_trips_through_its_wire_string_and_the_strings_are_distinct() {
        let mut seen = std::collections::BTreeSet::new();
        for &r in Reason::ALL {
            assert_eq!(Reason::parse(r.as_str()), Some(r));
            assert!(seen.insert(r.as_str()), "{r} twice");
            assert!(
                r.as_str()
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'_')
            );
        }
        assert_eq!(Reason::parse("no_such_reason"), None);
    }
}
