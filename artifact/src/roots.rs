//! Adapter artifacts on disk: resolving a registry URI inside the configured
//! artifact roots, and the artifact digest that the registry records and the
//! worker verifies before first use.
//!
//! # URIs
//!
//! An artifact URI is a path relative to one of the roots (`acme/support/v3`),
//! optionally written `file:acme/support/v3`. `file:///abs/path` and bare
//! absolute paths are accepted only when they lie inside a root. Refused:
//! any `..` segment, any other scheme, and anything whose real path (after
//! following symlinks) leaves the root it was found in.
//!
//! # The artifact digest
//!
//! ```text
//! sha256( "lorafleet-artifact-v1\n"
//!         for each regular file under the directory, recursively, sorted by
//!         its path relative to the directory ('/'-separated, byte order):
//!             u64le(len(path)) path  u64le(len(data)) data )
//! ```
//!
//! printed as 64 lowercase hex digits. Every file counts (configs, weights,
//! a README alike), so any change to the directory changes the digest.
//! Symlinks inside the directory are followed only if they stay inside the
//! root.

use std::io::Read;
use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};

const DIGEST_DOMAIN: &[u8] = b"lorafleet-artifact-v1\n";

/// Why an artifact was refused.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    /// The URI is malformed, uses an unsupported scheme, or contains `..`.
    #[error("artifact URI {uri:?}: {reason}")]
    InvalidUri { uri: String, reason: String },
    /// The URI (or a symlink on its way) points outside the artifact roots.
    #[error("artifact URI {uri:?}: resolves outside the artifact roots")]
    OutsideRoots { uri: String },
    /// No root holds the artifact.
    #[error("artifact URI {uri:?}: not found in any artifact root or store")]
    NotFound { uri: String },
    /// The artifact exists but cannot be read.
    #[error("artifact {path}: cannot be read: {source}")]
    Unreadable {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The object store holding the artifact did not answer in time or
    /// failed (after its retries); another try may succeed.
    #[error("artifact {uri}: the object store is unavailable: {reason}")]
    StoreUnavailable { uri: String, reason: String },
    /// The artifact holds more bytes or objects than a fetch may take.
    #[error("artifact {uri}: {reason}")]
    TooLarge { uri: String, reason: String },
    /// The files differ from what the registry recorded.
    #[error("artifact {path}: digest {actual} does not match the expected {expected}")]
    DigestMismatch {
        path: String,
        expected: String,
        actual: String,
    },
}

/// Why a list of artifact roots cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RootsError {
    #[error("at least one artifact root is required")]
    None,
    #[error("artifact root {}: {source}", root.display())]
    Unusable {
        root: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("artifact root {} is not a directory", root.display())]
    NotDirectory { root: PathBuf },
}

/// The directories artifacts may be read from.
#[derive(Debug, Clone)]
pub struct ArtifactRoots {
    /// Canonical paths.
    roots: Vec<PathBuf>,
}

impl ArtifactRoots {
    /// Canonicalises each root; every root must be an existing directory.
    pub fn new(roots: &[PathBuf]) -> Result<ArtifactRoots, RootsError> {
        if roots.is_empty() {
            return Err(RootsError::None);
        }
        let mut out = Vec::new();
        for root in roots {
            let canonical = root.canonicalize().map_err(|source| RootsError::Unusable {
                root: root.clone(),
                source,
            })?;
            if !canonical.is_dir() {
                return Err(RootsError::NotDirectory { root: root.clone() });
            }
            out.push(canonical);
        }
        Ok(ArtifactRoots { roots: out })
    }

    /// No roots at all: every file URI is refused (a worker that reads
    /// artifacts from object stores only).
    pub fn none() -> ArtifactRoots {
        ArtifactRoots { roots: Vec::new() }
    }

    pub fn roots(&self) -> &[PathBuf] {
        &self.roots
    }

    /// Resolves a URI to a directory inside a root.
    pub fn resolve(&self, uri: &str) -> Result<PathBuf, ArtifactError> {
        let invalid = |reason: &str| ArtifactError::InvalidUri {
            uri: uri.into(),
            reason: reason.into(),
        };
        let path = if let Some(rest) = uri.strip_prefix("file://") {
            if !rest.starts_with('/') {
                return Err(invalid("file:// URIs must not name a host"));
            }
            rest
        } else if let Some(rest) = uri.strip_prefix("file:") {
            rest
        } else if has_scheme(uri) {
            return Err(invalid("only relative paths and file: URIs are supported"));
        } else {
            uri
        };
        if path.is_empty() {
            return Err(invalid("the path is empty"));
        }
        if path.contains('\0') {
            return Err(invalid("the path contains a NUL byte"));
        }
        let path = Path::new(path);
        if path.components().any(|c| c == Component::ParentDir) {
            return Err(invalid("\"..\" segments are not allowed"));
        }
        if path.is_absolute() {
            let real = match path.canonicalize() {
                Ok(p) => p,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(ArtifactError::NotFound { uri: uri.into() });
                }
                Err(source) => {
                    return Err(ArtifactError::Unreadable {
                        path: path.display().to_string(),
                        source,
                    });
                }
            };
            if !self.roots.iter().any(|r| real.starts_with(r)) {
                return Err(ArtifactError::OutsideRoots { uri: uri.into() });
            }
            return checked_dir(uri, real);
        }
        for root in &self.roots {
            let candidate = root.join(path);
            match candidate.canonicalize() {
                Ok(real) if real.starts_with(root) => return checked_dir(uri, real),
                Ok(_) => return Err(ArtifactError::OutsideRoots { uri: uri.into() }),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(source) => {
                    return Err(ArtifactError::Unreadable {
                        path: candidate.display().to_string(),
                        source,
                    });
                }
            }
        }
        Err(ArtifactError::NotFound { uri: uri.into() })
    }

    /// Resolves a URI and checks its digest against `expected` (lowercase hex).
    pub fn resolve_verified(&self, uri: &str, expected: &str) -> Result<PathBuf, ArtifactError> {
        let dir = self.resolve(uri)?;
        let actual = self.digest(&dir)?;
        if !actual.eq_ignore_ascii_case(expected) {
            return Err(ArtifactError::DigestMismatch {
                path: uri.into(),
                expected: expected.to_ascii_lowercase(),
                actual,
            });
        }
        Ok(dir)
    }

    /// Resolves `uri` and copies the artifact into `dest` (which must not
    /// exist), hashing exactly the bytes it copies: the copy holds the
    /// bytes whose digest was checked, whatever happens to the original
    /// afterwards. On a mismatch or an error nothing is left at `dest`.
    pub fn copy_verified(
        &self,
        uri: &str,
        expected: &str,
        dest: &Path,
    ) -> Result<PathBuf, ArtifactError> {
        self.copy_checked(uri, dest, |actual| {
            if actual.eq_ignore_ascii_case(expected) {
                Ok(())
            } else {
                Err(ArtifactError::DigestMismatch {
                    path: uri.into(),
                    expected: expected.to_ascii_lowercase(),
                    actual: actual.to_owned(),
                })
            }
        })?;
        Ok(dest.to_path_buf())
    }

    /// Resolves `uri` and copies the artifact into `dest` (which must not
    /// exist), returning the digest of exactly the bytes it copied: what
    /// registration inspects and records is the copy, never the original
    /// read a second time. On an error nothing is left at `dest`.
    pub fn copy_hashed(&self, uri: &str, dest: &Path) -> Result<String, ArtifactError> {
        self.copy_checked(uri, dest, |_| Ok(()))
    }

    fn copy_checked(
        &self,
        uri: &str,
        dest: &Path,
        check: impl FnOnce(&str) -> Result<(), ArtifactError>,
    ) -> Result<String, ArtifactError> {
        let dir = self.resolve(uri)?;
        let parent = dest.parent().unwrap_or(Path::new("."));
        let name = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let partial = parent.join(format!(".{name}.partial-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&partial);
        let cleanup = |e| {
            let _ = std::fs::remove_dir_all(&partial);
            e
        };
        std::fs::create_dir_all(&partial).map_err(|source| {
            cleanup(ArtifactError::Unreadable {
                path: partial.display().to_string(),
                source,
            })
        })?;
        let actual = digest_into(
            &dir,
            &mut |real| self.roots.iter().any(|r| real.starts_with(r)),
            &mut |_, _| {},
            Some(&partial),
        )
        .map_err(cleanup)?;
        check(&actual).map_err(cleanup)?;
        std::fs::rename(&partial, dest).map_err(|source| {
            cleanup(ArtifactError::Unreadable {
                path: dest.display().to_string(),
                source,
            })
        })?;
        Ok(actual)
    }

    /// The digest of a resolved artifact directory, refusing symlinks inside
    /// it that leave the roots.
    pub fn digest(&self, dir: &Path) -> Result<String, ArtifactError> {
        self.digest_with_progress(dir, &mut |_, _| {})
    }

    /// [`ArtifactRoots::digest`], calling `progress` with (bytes hashed,
    /// bytes in all) as it goes.
    pub fn digest_with_progress(
        &self,
        dir: &Path,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<String, ArtifactError> {
        digest_with(
            dir,
            &mut |real| self.roots.iter().any(|r| real.starts_with(r)),
            progress,
        )
    }
}

/// The digest of an artifact directory (see the module docs). Symlinks are
/// followed only while they stay inside `dir`.
pub fn digest(dir: &Path) -> Result<String, ArtifactError> {
    digest_with_progress(dir, &mut |_, _| {})
}

/// [`digest`], calling `progress` with (bytes hashed, bytes in all).
pub fn digest_with_progress(
    dir: &Path,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<String, ArtifactError> {
    let real_dir = dir
        .canonicalize()
        .map_err(|source| ArtifactError::Unreadable {
            path: dir.display().to_string(),
            source,
        })?;
    digest_with(dir, &mut |real| real.starts_with(&real_dir), progress)
}

/// The artifact digest of files given one at a time, in byte order of
/// their relative paths (see the module docs): how an artifact fetched
/// from an object store is hashed while it is written, to the digest the
/// same directory has on disk.
pub struct ArtifactHasher {
    hasher: Sha256,
    /// Bytes the current file declared and bytes given so far.
    declared: u64,
    given: u64,
}

impl std::fmt::Debug for ArtifactHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArtifactHasher")
            .field("declared", &self.declared)
            .field("given", &self.given)
            .finish_non_exhaustive()
    }
}

impl Default for ArtifactHasher {
    fn default() -> Self {
        let mut hasher = Sha256::new();
        hasher.update(DIGEST_DOMAIN);
        ArtifactHasher {
            hasher,
            declared: 0,
            given: 0,
        }
    }
}

impl ArtifactHasher {
    /// Starts the file at `relative` ('/'-separated) of `len` bytes. False
    /// if the previous file was given another number of bytes than it
    /// declared.
    pub fn file(&mut self, relative: &str, len: u64) -> bool {
        let whole = self.given == self.declared;
        self.hasher.update((relative.len() as u64).to_le_bytes());
        self.hasher.update(relative.as_bytes());
        self.hasher.update(len.to_le_bytes());
        (self.declared, self.given) = (len, 0);
        whole
    }

    /// The current file's next bytes.
    pub fn update(&mut self, data: &[u8]) {
        self.hasher.update(data);
        self.given += data.len() as u64;
    }

    /// The digest, or None if the last file was given another number of
    /// bytes than it declared.
    pub fn finish(self) -> Option<String> {
        (self.given == self.declared).then(|| hex::encode(self.hasher.finalize()))
    }
}

fn has_scheme(uri: &str) -> bool {
    let Some((scheme, _)) = uri.split_once(':') else {
        return false;
    };
    let mut chars = scheme.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

fn checked_dir(uri: &str, real: PathBuf) -> Result<PathBuf, ArtifactError> {
    if real.is_dir() {
        Ok(real)
    } else {
        Err(ArtifactError::InvalidUri {
            uri: uri.into(),
            reason: "does not name a directory".into(),
        })
    }
}

fn digest_with(
    dir: &Path,
    allowed: &mut dyn FnMut(&Path) -> bool,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<String, ArtifactError> {
    digest_into(dir, allowed, progress, None)
}

/// The digest; with `copy_to`, every file is also written there, under its
/// relative path, from the very buffers that were hashed.
fn digest_into(
    dir: &Path,
    allowed: &mut dyn FnMut(&Path) -> bool,
    progress: &mut dyn FnMut(u64, u64),
    copy_to: Option<&Path>,
) -> Result<String, ArtifactError> {
    let unreadable = |path: &Path, source| ArtifactError::Unreadable {
        path: path.display().to_string(),
        source,
    };
    let mut files: Vec<(String, PathBuf)> = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), String::new())];
    while let Some((at, prefix)) = stack.pop() {
        for entry in std::fs::read_dir(&at).map_err(|e| unreadable(&at, e))? {
            let entry = entry.map_err(|e| unreadable(&at, e))?;
            let path = entry.path();
            let name = entry.file_name().into_string().map_err(|_| {
                unreadable(
                    &path,
                    std::io::Error::new(std::io::ErrorKind::InvalidData, "file name is not UTF-8"),
                )
            })?;
            let relative = if prefix.is_empty() {
                name
            } else {
                format!("{prefix}/{name}")
            };
            let real = path.canonicalize().map_err(|e| unreadable(&path, e))?;
            if !allowed(&real) {
                return Err(unreadable(
                    &path,
                    std::io::Error::new(
                        std::io::ErrorKind::PermissionDenied,
                        "a symlink leaves the artifact root",
                    ),
                ));
            }
            if real.is_dir() {
                stack.push((path, relative));
            } else if real.is_file() {
                files.push((relative, path));
            }
        }
    }
    files.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let total: u64 = files
        .iter()
        .filter_map(|(_, p)| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
    let mut done = 0u64;
    let mut hasher = ArtifactHasher::default();
    let mut buf = vec![0u8; 1 << 20];
    for (relative, path) in files {
        let mut file = std::fs::File::open(&path).map_err(|e| unreadable(&path, e))?;
        let len = file.metadata().map_err(|e| unreadable(&path, e))?.len();
        hasher.file(&relative, len);
        let mut copy = match copy_to {
            Some(root) => {
                let target = root.join(&relative);
                if let Some(parent) = target.parent() {
                    std::fs::create_dir_all(parent).map_err(|e| unreadable(parent, e))?;
                }
                Some((
                    std::fs::File::create_new(&target).map_err(|e| unreadable(&target, e))?,
                    target,
                ))
            }
            None => None,
        };
        let mut read = 0u64;
        loop {
            let n = file.read(&mut buf).map_err(|e| unreadable(&path, e))?;
            if n == 0 {
                break;
            }
            read += n as u64;
            hasher.update(&buf[..n]);
            if let Some((out, target)) = copy.as_mut() {
                std::io::Write::write_all(out, &buf[..n]).map_err(|e| unreadable(target, e))?;
            }
            done += n as u64;
            progress(done, total.max(done));
        }
        if read != len {
            return Err(unreadable(
                &path,
                std::io::Error::other("the file changed while it was hashed"),
            ));
        }
    }
    Ok(hasher
        .finish()
        .expect("every file was given the bytes it declared"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verified_copy_holds_the_hashed_bytes_and_a_mismatch_leaves_nothing() {
        let (root, roots) = tree();
        let cache = tempfile::tempdir().unwrap();
        let want = roots.digest(&root.path().join("acme/support/v3")).unwrap();
        let dest = cache.path().join("7-copy");
        let copy = roots
            .copy_verified("acme/support/v3", &want, &dest)
            .unwrap();
        assert_eq!(copy, dest);
        assert_eq!(
            digest(&copy).unwrap(),
            want,
            "the copy has the checked digest"
        );
        // The original changes; the copy does not.
        std::fs::write(
            root.path().join("acme/support/v3/adapter_config.json"),
            b"{}",
        )
        .unwrap();
        assert_eq!(digest(&copy).unwrap(), want);
        let again = cache.path().join("7-again");
        let err = roots
            .copy_verified("acme/support/v3", &want, &again)
            .unwrap_err();
        assert!(matches!(err, ArtifactError::DigestMismatch { .. }), "{err}");
        assert!(!again.exists());
        assert_eq!(
            std::fs::read_dir(cache.path()).unwrap().count(),
            1,
            "no partial copy left"
        );
    }

    #[test]
    fn a_hashed_copy_returns_the_digest_of_the_bytes_it_holds() {
        let (root, roots) = tree();
        let cache = tempfile::tempdir().unwrap();
        let before = roots.digest(&root.path().join("acme/support/v3")).unwrap();
        let dest = cache.path().join("registration");
        let got = roots.copy_hashed("acme/support/v3", &dest).unwrap();
        assert_eq!(got, before);
        assert_eq!(digest(&dest).unwrap(), got, "the copy is what was hashed");
        std::fs::write(
            root.path().join("acme/support/v3/adapter_config.json"),
            b"{\"r\": 64}",
        )
        .unwrap();
        assert_eq!(
            std::fs::read(dest.join("adapter_config.json")).unwrap(),
            b"{\"r\": 8}",
            "a later change to the original never reaches the copy"
        );
        let missing = cache.path().join("missing");
        assert!(roots.copy_hashed("acme/nothing", &missing).is_err());
        assert!(!missing.exists());
    }

    fn tree() -> (tempfile::TempDir, ArtifactRoots) {
        let root = tempfile::tempdir().unwrap();
        let adapter = root.path().join("acme/support/v3");
        std::fs::create_dir_all(adapter.join("nested")).unwrap();
        std::fs::write(adapter.join("adapter_config.json"), b"{\"r\": 8}").unwrap();
        std::fs::write(adapter.join("nested/extra.bin"), b"\x00\x01").unwrap();
        let roots = ArtifactRoots::new(&[root.path().to_path_buf()]).unwrap();
        (root, roots)
    }

    #[test]
    fn resolves_relative_and_file_uris_inside_the_root() {
        let (root, roots) = tree();
        let want = root.path().join("acme/support/v3").canonicalize().unwrap();
        assert_eq!(roots.resolve("acme/support/v3").unwrap(), want);
        assert_eq!(roots.resolve("file:acme/support/v3").unwrap(), want);
        let abs = format!("file://{}", want.display());
        assert_eq!(roots.resolve(&abs).unwrap(), want);
        assert_eq!(roots.resolve(want.to_str().unwrap()).unwrap(), want);
    }

    #[test]
    fn refuses_traversal_schemes_escapes_and_missing() {
        let (root, roots) = tree();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("adapter_config.json"), b"{}").unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(outside.path(), root.path().join("escape")).unwrap();
        let cases: Vec<(String, &str)> = vec![
            ("../etc".into(), "InvalidUri"),
            ("acme/../../x".into(), "InvalidUri"),
            ("s3://bucket/a".into(), "InvalidUri"),
            ("https://example.invalid/a".into(), "InvalidUri"),
            ("file://host/a".into(), "InvalidUri"),
            ("".into(), "InvalidUri"),
            (outside.path().display().to_string(), "OutsideRoots"),
            ("escape".into(), "OutsideRoots"),
            ("acme/missing".into(), "NotFound"),
            ("acme/support/v3/adapter_config.json".into(), "InvalidUri"),
        ];
        for (uri, kind) in cases {
            let err = roots.resolve(&uri).unwrap_err();
            assert!(
                format!("{err:?}").starts_with(kind),
                "{uri:?}: expected {kind}, got {err:?}"
            );
        }
    }

    #[test]
    fn the_digest_covers_every_file_and_is_verified() {
        let (root, roots) = tree();
        let dir = roots.resolve("acme/support/v3").unwrap();
        let d1 = roots.digest(&dir).unwrap();
        assert_eq!(d1, digest(&dir).unwrap());
        assert_eq!(d1.len(), 64);
        roots.resolve_verified("acme/support/v3", &d1).unwrap();
        roots
            .resolve_verified("acme/support/v3", &d1.to_uppercase())
            .unwrap();

        std::fs::write(dir.join("nested/extra.bin"), b"\x00\x02").unwrap();
        let err = roots.resolve_verified("acme/support/v3", &d1).unwrap_err();
        assert!(matches!(err, ArtifactError::DigestMismatch { .. }), "{err}");

        // A renamed file changes the digest even with the same bytes.
        std::fs::write(dir.join("nested/extra.bin"), b"\x00\x01").unwrap();
        assert_eq!(roots.digest(&dir).unwrap(), d1);
        std::fs::rename(dir.join("nested/extra.bin"), dir.join("nested/other.bin")).unwrap();
        assert_ne!(roots.digest(&dir).unwrap(), d1);

        // A symlink inside the artifact that leaves the root is refused.
        #[cfg(unix)]
        {
            let outside = tempfile::tempdir().unwrap();
            std::fs::write(outside.path().join("secret"), b"x").unwrap();
            std::os::unix::fs::symlink(outside.path().join("secret"), dir.join("link")).unwrap();
            let err = roots.digest(&dir).unwrap_err().to_string();
            assert!(err.contains("leaves the artifact root"), "{err}");
        }
        drop(root);
    }
}
