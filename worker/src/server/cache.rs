//! The worker's default adapter cache: a directory of this process under
//! the temporary directory, with a lock file that the process holds locked
//! for its whole life. A worker that is killed or crashes cannot remove its
//! directory, but its lock ends with it: at start, every other worker's
//! default cache whose lock is free is removed.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// The start of every default cache directory's name.
pub const PREFIX: &str = "lorafleet-adapter-cache-";
/// The lock file inside a cache directory.
const LOCK: &str = ".lock";

/// The default cache of `worker_id` in this process, under `root`: named
/// after the worker id and the process, since tests run several workers
/// with one id at once.
pub fn default_dir(root: &Path, worker_id: &str) -> PathBuf {
    let name: String = worker_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    root.join(format!("{PREFIX}{name}-{}", std::process::id()))
}

/// Creates `dir` empty, with its lock file locked by the returned handle
/// (held until dropped, or until the process ends).
pub fn create_locked(dir: &Path) -> io::Result<File> {
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::create_dir_all(dir)?;
    let lock = File::create(dir.join(LOCK))?;
    lock.lock()?;
    Ok(lock)
}

/// Removes the default caches under `root` whose worker is gone: their
/// lock file is not locked (or, for a cache without one, the process its
/// name ends with does not run). A cache still being created (no lock file
/// yet, its process alive) is left alone. Returns what it removed.
pub fn sweep(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let is_cache = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(PREFIX))
            && path.is_dir();
        if is_cache && gone(&path) && std::fs::remove_dir_all(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
}

/// Whether the worker that made the cache `dir` has ended.
fn gone(dir: &Path) -> bool {
    match File::open(dir.join(LOCK)) {
        // Free: no process holds it. The lock taken here ends with `f`.
        Ok(f) => f.try_lock().is_ok(),
        Err(_) => {
            let pid = dir
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.rsplit('-').next())
                .and_then(|p| p.parse::<u32>().ok());
            let proc = Path::new("/proc");
            match pid {
                Some(pid) if proc.is_dir() => !proc.join(pid.to_string()).exists(),
                _ => false,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_caches_of_workers_that_are_gone_are_swept() {
        let root = tempfile::tempdir().unwrap();
        let live = default_dir(root.path(), "w/live");
        let held = create_locked(&live).unwrap();
        let dead = root.path().join(format!("{PREFIX}w-dead-1"));
        drop(create_locked(&dead).unwrap());
        // Without a lock file: judged by the process its name ends with.
        let legacy_gone = root.path().join(format!("{PREFIX}w-4194305"));
        std::fs::create_dir_all(&legacy_gone).unwrap();
        let legacy_alive = root
            .path()
            .join(format!("{PREFIX}w-{}", std::process::id()));
        std::fs::create_dir_all(&legacy_alive).unwrap();
        let other = root.path().join("something-else-1");
        std::fs::create_dir_all(&other).unwrap();

        let mut removed = sweep(root.path());
        removed.sort();
        let mut expected = vec![dead.clone(), legacy_gone.clone()];
        expected.sort();
        assert_eq!(removed, expected);
        assert!(live.exists() && legacy_alive.exists() && other.exists());
        assert!(live.ends_with(format!("{PREFIX}w_live-{}", std::process::id())));
        // Once its worker ends, the live one goes too.
        drop(held);
        assert_eq!(sweep(root.path()), vec![live]);
    }
}
