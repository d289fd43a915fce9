//! Fetching an artifact into a local directory, hashed while written.

use std::path::Path;
use std::time::Instant;

use futures::StreamExt;
use lorafleet_artifact::roots::{ArtifactError, ArtifactHasher};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectMeta, ObjectStoreExt};
use tokio::io::AsyncWriteExt;

use crate::{Located, ObjectStores};

impl ObjectStores {
    /// Copies the artifact at `uri` into `dest` (which must not exist) and
    /// returns its digest. Every object under the artifact's prefix is
    /// written under its relative path, from the very bytes hashed; with
    /// `expected`, a copy whose digest differs is removed and refused. On
    /// any error nothing is left at `dest`.
    pub async fn fetch_verified(
        &self,
        uri: &str,
        expected: Option<&str>,
        dest: &Path,
    ) -> Result<String, ArtifactError> {
        self.fetch_verified_within(uri, expected, dest, None).await
    }

    /// [`ObjectStores::fetch_verified`], refusing from the listing an
    /// artifact that holds more than `recorded` (bytes, objects: what it
    /// held at registration) as well as more than the stores' limits.
    pub async fn fetch_verified_within(
        &self,
        uri: &str,
        expected: Option<&str>,
        dest: &Path,
        recorded: Option<(u64, u32)>,
    ) -> Result<String, ArtifactError> {
        let at = self.locate(uri)?;
        let _permit = self
            .permits
            .acquire()
            .await
            .expect("the semaphore is never closed");
        let started = Instant::now();
        let parent = dest.parent().unwrap_or(Path::new("."));
        let name = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let partial = parent.join(format!(".{name}.fetching-{}", std::process::id()));
        let _ = tokio::fs::remove_dir_all(&partial).await;
        let timeout = self.options.timeout;
        let fetched = match tokio::time::timeout(
            timeout,
            self.fetch_into(&at, uri, &partial, recorded),
        )
        .await
        {
            Ok(result) => result,
            Err(_) => Err(ArtifactError::StoreUnavailable {
                uri: uri.into(),
                reason: format!("the fetch did not finish within {timeout:?}"),
            }),
        };
        let verified = fetched.and_then(|(digest, bytes)| match expected {
            Some(want) if !want.eq_ignore_ascii_case(&digest) => {
                Err(ArtifactError::DigestMismatch {
                    path: uri.into(),
                    expected: want.to_ascii_lowercase(),
                    actual: digest,
                })
            }
            _ => Ok((digest, bytes)),
        });
        let store = at.store.clone();
        let outcome = match verified {
            Ok((digest, bytes)) => match tokio::fs::rename(&partial, dest).await {
                Ok(()) => {
                    tracing::info!(
                        store = %store,
                        uri,
                        bytes,
                        ms = started.elapsed().as_millis() as u64,
                        "artifact fetched"
                    );
                    metrics::counter!("lorafleet_artifact_fetch_bytes_total", "store" => store.clone())
                        .increment(bytes);
                    Ok(digest)
                }
                Err(source) => Err(ArtifactError::Unreadable {
                    path: dest.display().to_string(),
                    source,
                }),
            },
            Err(e) => Err(e),
        };
        if let Err(e) = &outcome {
            let _ = tokio::fs::remove_dir_all(&partial).await;
            let reason = match e {
                ArtifactError::NotFound { .. } => "not_found",
                ArtifactError::DigestMismatch { .. } => "digest_mismatch",
                ArtifactError::StoreUnavailable { .. } => "unavailable",
                ArtifactError::TooLarge { .. } => "too_large",
                _ => "unreadable",
            };
            metrics::counter!("lorafleet_artifact_fetch_failures_total", "store" => store.clone(), "reason" => reason)
                .increment(1);
            tracing::warn!(store = %store, uri, error = %e, "artifact fetch failed");
        }
        metrics::histogram!("lorafleet_artifact_fetch_seconds", "store" => store)
            .record(started.elapsed().as_secs_f64());
        outcome
    }

    /// Lists the artifact, then writes and hashes each object in the
    /// digest's order into `partial`: (digest, bytes).
    async fn fetch_into(
        &self,
        at: &Located,
        uri: &str,
        partial: &Path,
        recorded: Option<(u64, u32)>,
    ) -> Result<(String, u64), ArtifactError> {
        let too_large = |reason: String| ArtifactError::TooLarge {
            uri: uri.into(),
            reason,
        };
        let client = self.client(&at.store).clone();
        let unavailable = |e: &dyn std::fmt::Display| ArtifactError::StoreUnavailable {
            uri: uri.into(),
            reason: e.to_string(),
        };
        let prefix = ObjectPath::from(at.key.as_str());
        let mut objects: Vec<(String, ObjectMeta)> = Vec::new();
        let mut listing = client.list(Some(&prefix));
        while let Some(meta) = listing.next().await {
            let meta = meta.map_err(|e| unavailable(&e))?;
            let relative = meta
                .location
                .as_ref()
                .strip_prefix(at.key.as_str())
                .and_then(|r| r.strip_prefix('/'))
                .unwrap_or_default()
                .to_owned();
            if relative.is_empty() || relative.split('/').any(|s| matches!(s, "" | "." | "..")) {
                return Err(ArtifactError::InvalidUri {
                    uri: uri.into(),
                    reason: format!("holds an object named {:?}", meta.location.as_ref()),
                });
            }
            objects.push((relative, meta));
            if objects.len() > self.options.max_objects {
                return Err(too_large(format!(
                    "holds more than {} objects (--artifact-max-objects)",
                    self.options.max_objects
                )));
            }
            if let Some((_, files)) = recorded
                && objects.len() > files as usize
            {
                return Err(too_large(format!(
                    "holds more than the {files} objects it held at registration"
                )));
            }
        }
        if objects.is_empty() {
            return Err(ArtifactError::NotFound { uri: uri.into() });
        }
        // Refused from the listing, before any byte is read.
        let listed: u64 = objects.iter().map(|(_, m)| m.size).sum();
        if listed > self.options.max_bytes {
            return Err(too_large(format!(
                "holds {listed} bytes, above the limit of {} (--artifact-max-bytes)",
                self.options.max_bytes
            )));
        }
        if let Some((bytes, _)) = recorded
            && listed > bytes
        {
            return Err(too_large(format!(
                "holds {listed} bytes, more than the {bytes} it held at registration"
            )));
        }
        objects.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        let io = |path: &Path, source: std::io::Error| ArtifactError::Unreadable {
            path: path.display().to_string(),
            source,
        };
        tokio::fs::create_dir_all(partial)
            .await
            .map_err(|e| io(partial, e))?;
        let mut hasher = ArtifactHasher::default();
        let mut bytes = 0u64;
        for (relative, meta) in &objects {
            hasher.file(relative, meta.size);
            let target = partial.join(relative);
            if let Some(dir) = target.parent() {
                tokio::fs::create_dir_all(dir)
                    .await
                    .map_err(|e| io(dir, e))?;
            }
            // Buffered: the stream's chunks are small, and each write to a
            // tokio file is a trip to the blocking pool.
            let mut file = tokio::io::BufWriter::with_capacity(
                1 << 20,
                tokio::fs::File::create_new(&target)
                    .await
                    .map_err(|e| io(&target, e))?,
            );
            let got = client.get(&meta.location).await.map_err(|e| match e {
                object_store::Error::NotFound { .. } => ArtifactError::NotFound { uri: uri.into() },
                other => unavailable(&other),
            })?;
            let mut stream = got.into_stream();
            let mut read = 0u64;
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| unavailable(&e))?;
                // An object never streams past its listed size: the total
                // stays within what the listing was allowed.
                if read + chunk.len() as u64 > meta.size {
                    return Err(unavailable(&format!(
                        "object {} streams more than its listed {} bytes",
                        meta.location, meta.size
                    )));
                }
                hasher.update(&chunk);
                file.write_all(&chunk).await.map_err(|e| io(&target, e))?;
                read += chunk.len() as u64;
            }
            file.flush().await.map_err(|e| io(&target, e))?;
            if read != meta.size {
                return Err(unavailable(&format!(
                    "object {} changed while it was fetched ({read} of {} bytes)",
                    meta.location, meta.size
                )));
            }
            bytes += read;
        }
        let digest = hasher
            .finish()
            .ok_or_else(|| unavailable(&"an object's length changed while it was fetched"))?;
        Ok((digest, bytes))
    }
}
