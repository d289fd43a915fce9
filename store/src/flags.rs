//! The stores' command-line flags, the same on the gateway and the worker.

use crate::{FetchOptions, ObjectStores, StoreError, StoreSpec};

#[derive(Debug, Clone, Default, clap::Args)]
pub struct StoreFlags {
    /// An object store `s3://` artifact URIs may name,
    /// NAME=s3://bucket/prefix; repeatable (env: comma-separated), the same
    /// list on the gateways and the workers. Credentials come from the AWS
    /// chain (environment, web identity, instance metadata).
    #[arg(
        long = "artifact-store",
        env = "LORAFLEET_ARTIFACT_STORES",
        value_delimiter = ','
    )]
    pub artifact_stores: Vec<StoreSpec>,
    /// An S3-compatible server's URL for the stores (default: AWS, or
    /// AWS_ENDPOINT_URL).
    #[arg(long, env = "LORAFLEET_ARTIFACT_STORE_ENDPOINT")]
    pub artifact_store_endpoint: Option<String>,
    /// The most bytes one artifact fetched from a store may hold: a larger
    /// one is refused from its listing, before any byte is read.
    #[arg(long, env = "LORAFLEET_ARTIFACT_MAX_BYTES",
          default_value_t = crate::DEFAULT_MAX_ARTIFACT_BYTES)]
    pub artifact_max_bytes: u64,
    /// The most objects one artifact fetched from a store may hold.
    #[arg(long, env = "LORAFLEET_ARTIFACT_MAX_OBJECTS",
          default_value_t = crate::DEFAULT_MAX_ARTIFACT_OBJECTS)]
    pub artifact_max_objects: usize,
}

impl StoreFlags {
    /// The stores' clients, fetching with `options` (whose endpoint these
    /// flags set).
    pub fn stores(&self, options: FetchOptions) -> Result<ObjectStores, StoreError> {
        if self.artifact_max_bytes == 0 {
            return Err(StoreError::Limit {
                flag: "--artifact-max-bytes",
            });
        }
        if self.artifact_max_objects == 0 {
            return Err(StoreError::Limit {
                flag: "--artifact-max-objects",
            });
        }
        ObjectStores::new(
            &self.artifact_stores,
            FetchOptions {
                endpoint: self.artifact_store_endpoint.clone(),
                max_bytes: self.artifact_max_bytes,
                max_objects: self.artifact_max_objects,
                ..options
            },
        )
    }
}
