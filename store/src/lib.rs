//! Adapter artifacts in S3-compatible object stores.
//!
//! An operator names the stores artifacts may come from, the same list on
//! every gateway and worker: `--artifact-store NAME=s3://bucket/prefix`. An
//! artifact URI `s3://bucket/prefix/…/name` is accepted only inside one of
//! them; it names every object under `…/name/` (a PEFT directory uploaded
//! as it is: `adapter_config.json`, `adapter_model.safetensors`). A
//! tenant never gives a URL: URIs come from the registry, which an admin
//! writes.
//!
//! [`ObjectStores::fetch_verified`] copies an artifact into a local
//! directory, hashing every byte as it is written with the artifact digest
//! of `lorafleet_artifact::roots` (the same directory on disk and in a
//! bucket has the same digest), and keeps the copy only if the digest is
//! the one expected: nothing fetched is parsed before it is verified.
//! Fetches are bounded in number, each has a deadline, and the client
//! retries with backoff and jitter. Credentials come from the standard AWS
//! chain (environment, web identity in Kubernetes, instance metadata) and
//! are never logged; `AWS_ENDPOINT_URL` points the client at an
//! S3-compatible server.

mod counting;
mod fetch;
#[cfg(feature = "clap")]
mod flags;
mod push;

use std::sync::Arc;
use std::time::Duration;

use lorafleet_artifact::roots::ArtifactError;
use object_store::ObjectStore;
use object_store::aws::AmazonS3Builder;

#[cfg(feature = "clap")]
pub use flags::StoreFlags;
pub use push::{PushProgress, push_dir};

/// Why the stores' settings cannot be used, naming what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// A store (`NAME=s3://bucket/prefix`) or an `s3://` URI is malformed.
    #[error("{value:?}: {reason}")]
    Spec { value: String, reason: String },
    /// Two stores share a name.
    #[error("{name}: named twice")]
    Duplicate { name: String },
    /// A store's client cannot be built from its settings.
    #[error("{name}: {reason}")]
    Client { name: String, reason: String },
    /// A fetch limit is zero.
    #[error("must be at least 1")]
    Limit { flag: &'static str },
}

impl StoreError {
    /// The flag an operator sets wrong.
    pub fn flag(&self) -> &'static str {
        match self {
            StoreError::Limit { flag } => flag,
            _ => "--artifact-store",
        }
    }
}

/// One allowed store, as an operator writes it: `NAME=s3://bucket/prefix`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreSpec {
    pub name: String,
    pub bucket: String,
    /// Key prefix without leading or trailing '/'; may be empty.
    pub prefix: String,
}

impl std::str::FromStr for StoreSpec {
    type Err = StoreError;

    fn from_str(s: &str) -> Result<StoreSpec, StoreError> {
        let bad = |reason: &str| StoreError::Spec {
            value: s.into(),
            reason: reason.into(),
        };
        let (name, uri) = s
            .split_once('=')
            .ok_or_else(|| bad("expected NAME=s3://bucket/prefix"))?;
        let name_ok = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_".contains(&b));
        if !name_ok {
            return Err(bad("the store's name must be letters, digits, - and _"));
        }
        let (bucket, prefix) = split_s3(uri).map_err(|e| bad(&e.reason))?;
        Ok(StoreSpec {
            name: name.to_owned(),
            bucket,
            prefix,
        })
    }
}

/// `s3://bucket/key` as (bucket, key without leading or trailing '/'),
/// refusing what S3 would not call a bucket name and key segments that are
/// empty, `.` or `..`.
fn split_s3(uri: &str) -> Result<(String, String), BadUri> {
    let bad = |reason: String| BadUri { reason };
    let rest = uri
        .strip_prefix("s3://")
        .ok_or_else(|| bad("only s3:// URIs name an object store".into()))?;
    let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
    let bucket_ok = (3..=63).contains(&bucket.len())
        && bucket
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-.".contains(&b))
        && bucket.as_bytes()[0].is_ascii_alphanumeric()
        && bucket.as_bytes()[bucket.len() - 1].is_ascii_alphanumeric();
    if !bucket_ok {
        return Err(bad(format!("{bucket:?} is not a valid bucket name")));
    }
    let key = key.trim_end_matches('/');
    if !key.is_empty() && key.split('/').any(|seg| matches!(seg, "" | "." | "..")) {
        return Err(bad(format!("{key:?} has an empty, . or .. segment")));
    }
    if key.chars().any(|c| c.is_control()) {
        return Err(bad("the key holds a control character".into()));
    }
    Ok((bucket.to_owned(), key.to_owned()))
}

/// Why an `s3://` URI is malformed.
struct BadUri {
    reason: String,
}

/// Whether `uri` names an object store (whether or not it is allowed).
pub fn is_object_uri(uri: &str) -> bool {
    uri.starts_with("s3://")
}

/// How fetches behave.
#[derive(Debug, Clone)]
pub struct FetchOptions {
    /// An S3-compatible server's URL instead of AWS's (`AWS_ENDPOINT_URL`
    /// when not given); `http://` is allowed only here.
    pub endpoint: Option<String>,
    /// Fetches running at once; more wait their turn.
    pub concurrency: usize,
    /// The deadline of one whole fetch (listing and every object).
    pub timeout: Duration,
    /// Retries of one request after a failure that may pass.
    pub max_retries: usize,
    /// The most bytes one artifact may hold: a listing above it is refused
    /// before any object is read, and an object that streams more than
    /// its listed size is cut off.
    pub max_bytes: u64,
    /// The most objects one artifact may hold.
    pub max_objects: usize,
}

/// `--artifact-max-bytes`'s default: 16 GiB.
pub const DEFAULT_MAX_ARTIFACT_BYTES: u64 = 16 << 30;
/// `--artifact-max-objects`'s default.
pub const DEFAULT_MAX_ARTIFACT_OBJECTS: usize = 256;

impl Default for FetchOptions {
    fn default() -> Self {
        FetchOptions {
            endpoint: None,
            concurrency: 8,
            timeout: Duration::from_secs(300),
            max_retries: 5,
            max_bytes: DEFAULT_MAX_ARTIFACT_BYTES,
            max_objects: DEFAULT_MAX_ARTIFACT_OBJECTS,
        }
    }
}

/// One store and its client.
#[derive(Debug)]
struct Store {
    spec: StoreSpec,
    client: Arc<dyn ObjectStore>,
}

/// The stores artifacts may come from.
#[derive(Debug, Clone)]
pub struct ObjectStores {
    stores: Arc<Vec<Store>>,
    permits: Arc<tokio::sync::Semaphore>,
    options: FetchOptions,
}

/// Where an allowed artifact URI lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    /// The store's name (metrics, logs).
    pub store: String,
    pub bucket: String,
    /// The artifact's key prefix, without a trailing '/'.
    pub key: String,
}

impl ObjectStores {
    /// Clients for `specs`, configured from the environment's AWS chain.
    pub fn new(specs: &[StoreSpec], options: FetchOptions) -> Result<ObjectStores, StoreError> {
        let mut stores = Vec::new();
        for spec in specs {
            if stores.iter().any(|s: &Store| s.spec.name == spec.name) {
                return Err(StoreError::Duplicate {
                    name: spec.name.clone(),
                });
            }
            let endpoint = options
                .endpoint
                .clone()
                .or_else(|| std::env::var("AWS_ENDPOINT_URL").ok());
            let mut builder = AmazonS3Builder::from_env().with_bucket_name(&spec.bucket);
            if let Some(url) = &endpoint {
                builder = builder.with_endpoint(url);
            }
            let client = builder
                .with_http_connector(counting::Counting {
                    store: spec.name.clone(),
                })
                .with_client_options(
                    // One request gets a third of the fetch's deadline, so
                    // a stalled request is retried within it.
                    object_store::ClientOptions::new()
                        .with_timeout((options.timeout / 3).max(Duration::from_secs(1)))
                        .with_connect_timeout(Duration::from_secs(10).min(options.timeout / 3))
                        .with_allow_http(
                            endpoint
                                .as_deref()
                                .is_some_and(|u| u.starts_with("http://")),
                        ),
                )
                .with_retry(object_store::RetryConfig {
                    max_retries: options.max_retries,
                    retry_timeout: options.timeout,
                    backoff: object_store::BackoffConfig {
                        init_backoff: Duration::from_millis(100),
                        max_backoff: Duration::from_secs(5),
                        base: 2.0,
                    },
                })
                .build()
                .map_err(|e| StoreError::Client {
                    name: spec.name.clone(),
                    reason: e.to_string(),
                })?;
            stores.push(Store {
                spec: spec.clone(),
                client: Arc::new(client),
            });
        }
        Ok(ObjectStores {
            stores: Arc::new(stores),
            permits: Arc::new(tokio::sync::Semaphore::new(options.concurrency.max(1))),
            options,
        })
    }

    /// No stores: every object URI is refused.
    pub fn none() -> ObjectStores {
        ObjectStores::new(&[], FetchOptions::default()).expect("no stores")
    }

    pub fn is_empty(&self) -> bool {
        self.stores.is_empty()
    }

    /// Where `uri` lives, if an allowed store holds it.
    pub fn locate(&self, uri: &str) -> Result<Located, ArtifactError> {
        let invalid = |reason: String| ArtifactError::InvalidUri {
            uri: uri.into(),
            reason,
        };
        let (bucket, key) = split_s3(uri).map_err(|e| invalid(e.reason))?;
        if key.is_empty() {
            return Err(invalid("names a whole bucket, not an artifact".into()));
        }
        let store = self
            .stores
            .iter()
            .find(|s| {
                s.spec.bucket == bucket
                    && (s.spec.prefix.is_empty()
                        || key
                            .strip_prefix(&s.spec.prefix)
                            .is_some_and(|rest| rest.starts_with('/')))
            })
            .ok_or_else(|| {
                invalid(format!(
                    "is in no store this process allows ({})",
                    if self.stores.is_empty() {
                        "none is configured: --artifact-store NAME=s3://bucket/prefix".to_owned()
                    } else {
                        self.stores
                            .iter()
                            .map(|s| format!("s3://{}/{}", s.spec.bucket, s.spec.prefix))
                            .collect::<Vec<_>>()
                            .join(", ")
                    }
                ))
            })?;
        Ok(Located {
            store: store.spec.name.clone(),
            bucket,
            key,
        })
    }

    fn client(&self, store: &str) -> &Arc<dyn ObjectStore> {
        &self
            .stores
            .iter()
            .find(|s| s.spec.name == store)
            .expect("a located store")
            .client
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_and_uris_are_checked_by_their_parts() {
        let spec: StoreSpec = "team-a=s3://adapters/prod/".parse().unwrap();
        assert_eq!(
            spec,
            StoreSpec {
                name: "team-a".into(),
                bucket: "adapters".into(),
                prefix: "prod".into()
            }
        );
        for bad in [
            "s3://adapters/prod",
            "a b=s3://adapters",
            "x=http://adapters/prod",
            "x=s3://A_B/prod",
            "x=s3://adapters/../prod",
        ] {
            assert!(bad.parse::<StoreSpec>().is_err(), "{bad}");
        }
        let stores = ObjectStores::new(&[spec], FetchOptions::default()).unwrap();
        let at = stores.locate("s3://adapters/prod/acme/support/v1").unwrap();
        assert_eq!(
            (at.store.as_str(), at.key.as_str()),
            ("team-a", "prod/acme/support/v1")
        );
        for (uri, why) in [
            ("s3://adapters/production/x", "no store"),
            ("s3://other/prod/x", "no store"),
            ("s3://adapters/prod/a/../b", ".."),
            ("s3://adapters/prod//b", "empty"),
            ("s3://adapters", "whole bucket"),
        ] {
            let e = stores.locate(uri).unwrap_err().to_string();
            assert!(e.contains(why), "{uri}: {e}");
        }
        let none = ObjectStores::none();
        let e = none.locate("s3://adapters/prod/x").unwrap_err().to_string();
        assert!(e.contains("--artifact-store"), "{e}");
    }
}
