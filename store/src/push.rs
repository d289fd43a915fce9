//! Uploading a PEFT directory as an artifact.

use std::path::{Path, PathBuf};

use futures::StreamExt;
use lorafleet_artifact::roots::ArtifactError;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, PutPayload};

use crate::ObjectStores;

/// Where an upload stands: bytes sent of bytes in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushProgress {
    pub sent: u64,
    pub total: u64,
}

/// Uploads every file under `dir` to the artifact at `uri` and returns the
/// directory's digest (computed before anything is sent, so a file
/// changed during the upload cannot go unnoticed: the digest registered
/// is what the files held when they were hashed, and a worker refuses
/// anything else). An artifact is immutable: a prefix that already holds
/// objects is refused.
pub async fn push_dir(
    stores: &ObjectStores,
    dir: &Path,
    uri: &str,
    progress: &mut dyn FnMut(PushProgress),
) -> Result<String, ArtifactError> {
    let at = stores.locate(uri)?;
    let client = stores.client(&at.store).clone();
    let unavailable = |e: &dyn std::fmt::Display| ArtifactError::StoreUnavailable {
        uri: uri.into(),
        reason: e.to_string(),
    };
    let (digest, files) = {
        let dir = dir.to_path_buf();
        tokio::task::spawn_blocking(move || -> Result<_, ArtifactError> {
            let digest = lorafleet_artifact::roots::digest(&dir)?;
            Ok((digest, walk(&dir)?))
        })
        .await
        .map_err(|e| unavailable(&e))??
    };
    let prefix = ObjectPath::from(at.key.as_str());
    if let Some(first) = client.list(Some(&prefix)).next().await {
        let first = first.map_err(|e| unavailable(&e))?;
        return Err(ArtifactError::InvalidUri {
            uri: uri.into(),
            reason: format!(
                "already holds {}; artifacts are immutable, push to a new prefix",
                first.location
            ),
        });
    }
    let total: u64 = files.iter().map(|(_, _, len)| len).sum();
    let mut sent = 0u64;
    progress(PushProgress { sent, total });
    for (relative, path, len) in files {
        let data = tokio::fs::read(&path)
            .await
            .map_err(|source| ArtifactError::Unreadable {
                path: path.display().to_string(),
                source,
            })?;
        let location = ObjectPath::from(format!("{}/{relative}", at.key));
        client
            .put(&location, PutPayload::from(data))
            .await
            .map_err(|e| unavailable(&e))?;
        sent += len;
        progress(PushProgress { sent, total });
    }
    Ok(digest)
}

/// Every regular file under `dir`: (relative path, path, length).
fn walk(dir: &Path) -> Result<Vec<(String, PathBuf, u64)>, ArtifactError> {
    let unreadable = |path: &Path, source| ArtifactError::Unreadable {
        path: path.display().to_string(),
        source,
    };
    let mut files = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), String::new())];
    while let Some((at, prefix)) = stack.pop() {
        for entry in std::fs::read_dir(&at).map_err(|e| unreadable(&at, e))? {
            let entry = entry.map_err(|e| unreadable(&at, e))?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let relative = if prefix.is_empty() {
                name
            } else {
                format!("{prefix}/{name}")
            };
            let meta = std::fs::metadata(&path).map_err(|e| unreadable(&path, e))?;
            if meta.is_dir() {
                stack.push((path, relative));
            } else if meta.is_file() {
                files.push((relative, path, meta.len()));
            }
        }
    }
    files.sort();
    Ok(files)
}
