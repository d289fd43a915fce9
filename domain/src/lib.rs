//! The values the gateway and the worker both speak of, with one type
//! each: the adapter id, where an adapter resides, a SHA-256 digest, a
//! refused flag, and the generation contract ([`generation`]: sampling,
//! its checks, the field a refusal names). No I/O, no dependencies; each
//! side converts them to its wire or its database at its own boundary.

pub mod digest;
pub mod flag;
pub mod generation;

use std::fmt;
use std::num::NonZeroU64;

/// An adapter version's id: the registry's `lora_int_id`, which always
/// names the same weights. Never zero: "no adapter" (the base model) is
/// `Option::<AdapterId>::None` everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AdapterId(NonZeroU64);

impl AdapterId {
    /// None for 0, which is no adapter id.
    pub const fn new(id: u64) -> Option<AdapterId> {
        match NonZeroU64::new(id) {
            Some(n) => Some(AdapterId(n)),
            None => None,
        }
    }

    pub const fn get(self) -> u64 {
        self.0.get()
    }

    /// From the registry's `bigint` column: None unless positive.
    pub fn from_registry(id: i64) -> Option<AdapterId> {
        u64::try_from(id).ok().and_then(AdapterId::new)
    }

    /// For the registry's `bigint` column. The registry hands ids out from
    /// a sequence, so every id it gave fits.
    pub fn to_registry(self) -> i64 {
        i64::try_from(self.get()).unwrap_or(i64::MAX)
    }
}

impl fmt::Display for AdapterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Text ids, one type each, so a worker's id is never passed where a
/// fairness key is expected. Each side converts to its wire (a string) at
/// its boundary.
macro_rules! text_ids {
    ($($(#[$doc:meta])* $name:ident;)*) => {$(
        $(#[$doc])*
        #[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);

        impl $name {
            pub fn new(id: impl Into<String>) -> $name {
                $name(id.into())
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }

            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<String> for $name {
            fn from(id: String) -> $name {
                $name(id)
            }
        }

        impl From<&str> for $name {
            fn from(id: &str) -> $name {
                $name(id.to_owned())
            }
        }

        impl std::ops::Deref for $name {
            type Target = str;

            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl std::borrow::Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }
    )*};
}

text_ids! {
    /// A worker's id as it reports itself (`--worker-id`): what the
    /// gateway's ring, fleet view and audit rows name it by.
    WorkerId;
    /// Whose share of a worker's engine a request uses: its tenant's id,
    /// or a key of the gateway's own (a rollout's evaluation traffic).
    FairnessKey;
    /// One generation's id, the gateway's (or a client's own
    /// `x-request-id`): what the worker's streams, the engine's request map
    /// and events, cancellation and the audit row name it by. A request of
    /// `n` choices sends each choice with an id of its own.
    RequestId;
}

/// Where a worker holds an adapter. An adapter a worker does not know is
/// `NotLoaded`; one a worker did not describe (an older or newer worker)
/// is `Option::<Residency>::None` where that can happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Residency {
    /// In a device slot: a request runs without a copy.
    Device,
    /// In host memory: a request waits for a host-to-device copy.
    Host,
    /// Being read from disk into host memory.
    Loading,
    NotLoaded,
}

impl Residency {
    /// The label audit rows, metrics and the admin API use.
    pub const fn label(self) -> &'static str {
        match self {
            Residency::Device => "device",
            Residency::Host => "host",
            Residency::Loading => "loading",
            Residency::NotLoaded => "not_loaded",
        }
    }

    /// The residency a label names.
    pub fn from_label(label: &str) -> Option<Residency> {
        [
            Residency::Device,
            Residency::Host,
            Residency::Loading,
            Residency::NotLoaded,
        ]
        .into_iter()
        .find(|r| r.label() == label)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_ids_keep_their_text() {
        let w = WorkerId::new("worker-a");
        assert_eq!((w.as_str(), w.to_string()), ("worker-a", "worker-a".into()));
        assert_eq!(
            FairnessKey::from("t1"),
            FairnessKey::new(String::from("t1"))
        );
        assert_eq!(FairnessKey::from("t1").into_string(), "t1");
    }

    #[test]
    fn zero_and_negative_ids_are_no_adapter_ids() {
        assert_eq!(AdapterId::new(0), None);
        assert_eq!(AdapterId::from_registry(0), None);
        assert_eq!(AdapterId::from_registry(-7), None);
        let id = AdapterId::from_registry(42).unwrap();
        assert_eq!(
            (id.get(), id.to_registry(), id.to_string()),
            (42, 42, "42".into())
        );
        // The niche: no adapter costs nothing.
        assert_eq!(
            std::mem::size_of::<Option<AdapterId>>(),
            std::mem::size_of::<u64>()
        );
    }

    #[test]
    fn labels_name_one_residency_each() {
        for r in [
            Residency::Device,
            Residency::Host,
            Residency::Loading,
            Residency::NotLoaded,
        ] {
            assert_eq!(Residency::from_label(r.label()), Some(r));
        }
        assert_eq!(Residency::from_label("absent"), None);
    }
}
