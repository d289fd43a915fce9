//! The audit spool: where rows wait, on disk, while Postgres is unreachable.
//!
//! Layout: `ROOT/OWNER/SEGMENT.jsonl`, one directory per gateway process
//! (`OWNER` is its pod name), each segment a file of JSON lines, fsynced
//! after every append. A process holds an exclusive lock on `OWNER/LOCK`
//! for its life; a directory whose lock is free belongs to a process that
//! is gone, and any gateway sharing `ROOT` adopts it and replays its rows.
//! So rows survive a crash (the same process replays them when it
//! restarts) and a pod that never comes back (another one adopts them).
//!
//! - A process never appends to a segment it did not create in this life,
//!   and a failed append is cut back to the last whole line, so a torn line
//!   can only be a segment's last, and never glues two rows together.
//! - Replay reads one segment at a time, in chunks of at most
//!   [`CHUNK_ROWS`] lines, and deletes a segment only after every one of
//!   its rows is committed. A line that is torn, not UTF-8 or not a row is
//!   handed back as a [`BadLine`] to be quarantined, never dropped.
//! - Disk use is bounded: an append that would take the spool past its
//!   limit fails with [`SpoolError::Full`].
//! - **Journal.** With `--audit-durability journal` every batch is
//!   appended here before its insert, and answered once fsynced. Such a
//!   segment is tracked: replay skips it while inserts of its rows are in
//!   flight; once sealed with all of them committed it is deleted unread,
//!   and if any insert failed it is replayed like an outage's. A segment
//!   from an earlier life is untracked, so replay reads it (inserts are
//!   idempotent on `request_id`, so a row both inserted and replayed stays
//!   one row).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::AuditRecord;

/// Most lines read per replay chunk.
pub const CHUNK_ROWS: usize = 500;
/// A line longer than this is not a row (rows are capped far below it); its
/// first bytes are quarantined and the rest of the line skipped.
const MAX_LINE: usize = 64 * 1024;
const LOCK: &str = "LOCK";
const EXT: &str = "jsonl";

#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    #[error("the spool is full: {used} of {max} bytes used")]
    Full { used: u64, max: u64 },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{0} is locked by another running gateway; give each process its own --audit-spool-owner"
    )]
    InUse(PathBuf),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SpoolError + '_ {
    move |source| SpoolError::Io {
        path: path.to_owned(),
        source,
    }
}

/// A spool line that could not be read back as a row.
#[derive(Debug)]
pub struct BadLine {
    /// Where it was: `OWNER/SEGMENT:OFFSET`, unique, so quarantining it
    /// twice (a retry after an outage) keeps one copy.
    pub origin: String,
    pub reason: String,
    /// The line as it is on disk (its first [`MAX_LINE`] bytes).
    pub bytes: Vec<u8>,
}

/// Up to [`CHUNK_ROWS`] lines of one segment.
#[derive(Debug)]
pub struct Chunk {
    pub rows: Vec<AuditRecord>,
    pub bad: Vec<BadLine>,
    segment: PathBuf,
    start: u64,
    end: u64,
    last: bool,
}

/// Where replay stands in the segment it is reading.
#[derive(Debug)]
struct Cursor {
    segment: PathBuf,
    offset: u64,
}

#[derive(Debug)]
struct Current {
    path: PathBuf,
    file: File,
    len: u64,
}

/// A journal segment of this life: inserts of its rows in flight, and
/// whether one failed (its rows then wait for replay).
#[derive(Debug, Default)]
struct Journaled {
    in_flight: usize,
    failed: bool,
}

#[derive(Debug)]
pub struct Spool {
    root: PathBuf,
    own: PathBuf,
    _lock: File,
    /// Directories of gone processes whose locks this one holds.
    adopted: BTreeMap<PathBuf, File>,
    current: Option<Current>,
    seq: u64,
    segment_bytes: u64,
    max_bytes: u64,
    used: Arc<AtomicU64>,
    cursor: Option<Cursor>,
    journal: BTreeMap<PathBuf, Journaled>,
}

impl Spool {
    /// Opens (creating) `root/owner` and locks it for this process. If
    /// another live gateway holds that directory (it adopted it from this
    /// owner's previous life, say), this process writes to a fresh
    /// `owner-XXXXXXXX` instead; the other one replays the old rows.
    pub fn open(
        root: &Path,
        owner: &str,
        segment_bytes: u64,
        max_bytes: u64,
    ) -> Result<Spool, SpoolError> {
        std::fs::create_dir_all(root).map_err(io(root))?;
        let mut own = root.join(owner);
        std::fs::create_dir_all(&own).map_err(io(&own))?;
        let mut lock = try_lock(&own)?;
        for _ in 0..8 {
            if lock.is_some() {
                break;
            }
            let fresh = format!(
                "{owner}-{}",
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            );
            tracing::warn!(dir = %own.display(), fresh, "audit spool directory held by another gateway; writing to a fresh one");
            own = root.join(fresh);
            std::fs::create_dir_all(&own).map_err(io(&own))?;
            lock = try_lock(&own)?;
        }
        let lock = lock.ok_or_else(|| SpoolError::InUse(own.clone()))?;
        let mut spool = Spool {
            root: root.to_owned(),
            own,
            _lock: lock,
            adopted: BTreeMap::new(),
            current: None,
            seq: 0,
            segment_bytes,
            max_bytes,
            used: Arc::new(AtomicU64::new(0)),
            cursor: None,
            journal: BTreeMap::new(),
        };
        spool.recount();
        Ok(spool)
    }

    /// Sets the disk use to what this process's own and adopted
    /// directories hold (other live gateways count their own).
    fn recount(&mut self) {
        let used: u64 = std::iter::once(&self.own)
            .chain(self.adopted.keys())
            .flat_map(|d| segments_in(d))
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.len())
            .sum();
        self.used.store(used, Ordering::Relaxed);
    }

    /// Bytes on disk, shared with admission control.
    pub fn used(&self) -> Arc<AtomicU64> {
        self.used.clone()
    }

    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Appends rows as whole lines and fsyncs them, for replay. On failure
    /// nothing of this call stays in the segment.
    pub fn append(&mut self, rows: &[&AuditRecord]) -> Result<(), SpoolError> {
        self.write(rows)?;
        // Rows no insert will commit: a journal segment holding them must
        // be replayed, not deleted.
        if let Some(c) = &self.current
            && let Some(j) = self.journal.get_mut(&c.path)
        {
            j.failed = true;
        }
        Ok(())
    }

    fn write(&mut self, rows: &[&AuditRecord]) -> Result<(), SpoolError> {
        let mut buf = Vec::new();
        for r in rows {
            serde_json::to_writer(&mut buf, r).map_err(|e| SpoolError::Io {
                path: self.own.clone(),
                source: std::io::Error::other(e),
            })?;
            buf.push(b'\n');
        }
        let used = self.used.load(Ordering::Relaxed);
        if used + buf.len() as u64 > self.max_bytes {
            return Err(SpoolError::Full {
                used,
                max: self.max_bytes,
            });
        }
        if self
            .current
            .as_ref()
            .is_some_and(|c| c.len > 0 && c.len + buf.len() as u64 > self.segment_bytes)
        {
            self.seal();
        }
        if self.current.is_none() {
            self.current = Some(self.new_segment()?);
        }
        let c = self.current.as_mut().expect("a current segment");
        let written = c.file.write_all(&buf).and_then(|()| c.file.sync_data());
        if let Err(e) = written {
            // Cut back to the last whole line, and never write here again.
            let _ = c.file.set_len(c.len);
            let path = c.path.clone();
            self.current = None;
            return Err(SpoolError::Io { path, source: e });
        }
        c.len += buf.len() as u64;
        self.used.fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Appends a batch whose insert is about to start (the journal), and
    /// names its segment for [`Spool::journal_done`].
    pub fn journal(&mut self, rows: &[&AuditRecord]) -> Result<PathBuf, SpoolError> {
        self.write(rows)?;
        let path = self.current.as_ref().expect("appended").path.clone();
        self.journal.entry(path.clone()).or_default().in_flight += 1;
        Ok(path)
    }

    /// The insert of a batch journaled in `segment` has ended: its rows are
    /// committed (`inserted`), or they wait for replay. A sealed segment
    /// whose rows are all committed is deleted.
    pub fn journal_done(&mut self, segment: &Path, inserted: bool) {
        if let Some(j) = self.journal.get_mut(segment) {
            j.in_flight = j.in_flight.saturating_sub(1);
            j.failed |= !inserted;
        }
        self.drop_finished(segment);
    }

    /// Deletes `segment` when it is sealed and every row it journaled is
    /// committed; forgets it once it needs no more tracking.
    fn drop_finished(&mut self, segment: &Path) {
        let current = self.current.as_ref().is_some_and(|c| c.path == segment);
        let Some(j) = self.journal.get(segment) else {
            return;
        };
        if current || j.in_flight > 0 {
            return;
        }
        if j.failed {
            // Replay reads it from now on, as any outage segment.
            self.journal.remove(segment);
            return;
        }
        let size = std::fs::metadata(segment).map_or(0, |m| m.len());
        match std::fs::remove_file(segment) {
            Ok(()) => {
                self.journal.remove(segment);
                let _ = self
                    .used
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                        Some(u.saturating_sub(size))
                    });
            }
            Err(e) => {
                // Left for replay, which re-inserts idempotently.
                tracing::warn!(segment = %segment.display(), error = %e, "journal segment not removed; replay will read it");
                self.journal.remove(segment);
            }
        }
    }

    /// True when replay must leave `segment` alone: a journal segment of
    /// this life with inserts in flight or none failed.
    fn journaled(&self, segment: &Path) -> bool {
        self.journal
            .get(segment)
            .is_some_and(|j| j.in_flight > 0 || !j.failed)
    }

    /// Closes the segment being appended to, so replay may read it (or, for
    /// a journal segment whose rows are all committed, so it is deleted).
    pub fn seal(&mut self) {
        if let Some(c) = self.current.take() {
            self.drop_finished(&c.path);
        }
    }

    fn new_segment(&mut self) -> Result<Current, SpoolError> {
        let millis = chrono::Utc::now().timestamp_millis();
        loop {
            self.seq += 1;
            let path = self.own.join(format!("{millis:016}-{:06}.{EXT}", self.seq));
            match OpenOptions::new().append(true).create_new(true).open(&path) {
                Ok(file) => {
                    // The new name itself must survive a crash.
                    File::open(&self.own)
                        .and_then(|d| d.sync_all())
                        .map_err(io(&self.own))?;
                    return Ok(Current { path, file, len: 0 });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(SpoolError::Io { path, source: e }),
            }
        }
    }

    /// Segments replay may read: this process's sealed ones and those of
    /// directories it could adopt, oldest first.
    fn replayable(&mut self) -> Vec<PathBuf> {
        for dir in subdirs(&self.root) {
            if dir == self.own || self.adopted.contains_key(&dir) {
                continue;
            }
            if let Ok(Some(lock)) = try_lock(&dir) {
                tracing::info!(dir = %dir.display(), "adopting the audit spool of a gateway that is gone");
                self.adopted.insert(dir, lock);
            }
        }
        self.recount();
        let current = self.current.as_ref().map(|c| c.path.clone());
        let mut out: Vec<PathBuf> = std::iter::once(self.own.clone())
            .chain(self.adopted.keys().cloned())
            .flat_map(|d| segments_in(&d))
            .filter(|p| Some(p) != current.as_ref() && !self.journaled(p))
            .collect();
        out.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
        out
    }

    /// True when some segment of this process's own waits for replay.
    /// Adopting other directories is left to replay, which runs only while
    /// Postgres answers.
    pub fn has_backlog(&self) -> bool {
        self.cursor.is_some() || segments_in(&self.own).iter().any(|p| !self.journaled(p))
    }

    /// After a failed chunk: the next read starts at the chunk again.
    pub fn rewind(&mut self, chunk: &Chunk) {
        self.cursor = Some(Cursor {
            segment: chunk.segment.clone(),
            offset: chunk.start,
        });
    }

    /// The next lines to replay, or None when nothing waits.
    pub fn next_chunk(&mut self) -> Result<Option<Chunk>, SpoolError> {
        let cursor = match self.cursor.take() {
            Some(c) => c,
            None => match self.replayable().into_iter().next() {
                Some(segment) => Cursor { segment, offset: 0 },
                None => {
                    self.release_empty_adopted();
                    return Ok(None);
                }
            },
        };
        let path = cursor.segment.clone();
        let mut file = File::open(&path).map_err(io(&path))?;
        file.seek(SeekFrom::Start(cursor.offset))
            .map_err(io(&path))?;
        let mut reader = BufReader::new(file);
        let mut chunk = Chunk {
            rows: Vec::new(),
            bad: Vec::new(),
            segment: path.clone(),
            start: cursor.offset,
            end: cursor.offset,
            last: false,
        };
        let name = path
            .strip_prefix(&self.root)
            .unwrap_or(&path)
            .display()
            .to_string();
        while chunk.rows.len() + chunk.bad.len() < CHUNK_ROWS {
            let line = read_line(&mut reader).map_err(io(&path))?;
            let Some(line) = line else {
                chunk.last = true;
                break;
            };
            let offset = chunk.end;
            chunk.end += line.consumed;
            if line.bytes.iter().all(u8::is_ascii_whitespace) && line.complete {
                continue;
            }
            let bad = |reason: String| BadLine {
                origin: format!("{name}:{offset}"),
                reason,
                bytes: line.bytes.clone(),
            };
            if line.too_long {
                chunk.bad.push(bad(format!(
                    "a line of more than {MAX_LINE} bytes is not a row"
                )));
            } else if !line.complete {
                chunk.bad.push(bad(
                    "torn line: the segment ends without a newline (a write cut short)".into(),
                ));
            } else {
                match std::str::from_utf8(&line.bytes) {
                    Err(e) => chunk.bad.push(bad(format!("not UTF-8: {e}"))),
                    Ok(text) => match serde_json::from_str::<AuditRecord>(text) {
                        Ok(r) => chunk.rows.push(r),
                        Err(e) => chunk.bad.push(bad(format!("not an audit row: {e}"))),
                    },
                }
            }
        }
        if !chunk.last {
            // Exactly at the end is the end, too.
            chunk.last = reader.fill_buf().map_err(io(&path))?.is_empty();
        }
        Ok(Some(chunk))
    }

    /// Records that every row and bad line of `chunk` is safely in
    /// Postgres; a segment read to its end is deleted.
    pub fn commit(&mut self, chunk: &Chunk) -> Result<(), SpoolError> {
        if !chunk.last {
            self.cursor = Some(Cursor {
                segment: chunk.segment.clone(),
                offset: chunk.end,
            });
            return Ok(());
        }
        let size = std::fs::metadata(&chunk.segment).map_or(0, |m| m.len());
        std::fs::remove_file(&chunk.segment).map_err(io(&chunk.segment))?;
        if let Some(dir) = chunk.segment.parent() {
            let _ = File::open(dir).and_then(|d| d.sync_all());
        }
        let _ = self
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                Some(u.saturating_sub(size))
            });
        self.cursor = None;
        Ok(())
    }

    /// Removes adopted directories that hold no segment any more.
    fn release_empty_adopted(&mut self) {
        let empty: Vec<PathBuf> = self
            .adopted
            .keys()
            .filter(|d| segments_in(d).is_empty())
            .cloned()
            .collect();
        for dir in empty {
            // Still holding its lock, so no process can be writing there.
            let _ = std::fs::remove_file(dir.join(LOCK));
            let _ = std::fs::remove_dir(&dir);
            self.adopted.remove(&dir);
            tracing::info!(dir = %dir.display(), "adopted audit spool replayed and removed");
        }
    }
}

/// Locks `dir/LOCK` without waiting: None when another process holds it.
fn try_lock(dir: &Path) -> Result<Option<File>, SpoolError> {
    let path = dir.join(LOCK);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io(&path))?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => Ok(None),
        Err(std::fs::TryLockError::Error(e)) => Err(SpoolError::Io { path, source: e }),
    }
}

fn subdirs(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    out.sort();
    out
}

fn segments_in(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == EXT) && p.is_file())
        .collect()
}

struct Line {
    bytes: Vec<u8>,
    /// Bytes of the file this line took, its newline included.
    consumed: u64,
    /// It ended with a newline.
    complete: bool,
    too_long: bool,
}

/// Reads one line, keeping at most [`MAX_LINE`] of its bytes; None at the
/// end of the file.
fn read_line(reader: &mut impl BufRead) -> std::io::Result<Option<Line>> {
    let mut line = Line {
        bytes: Vec::new(),
        consumed: 0,
        complete: false,
        too_long: false,
    };
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            return Ok((line.consumed > 0).then_some(line));
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        let content = if done { &buf[..take - 1] } else { &buf[..take] };
        let room = MAX_LINE.saturating_sub(line.bytes.len());
        if content.len() > room {
            line.too_long = true;
        }
        line.bytes
            .extend_from_slice(&content[..content.len().min(room)]);
        reader.consume(take);
        line.consumed += take as u64;
        if done {
            line.complete = true;
            return Ok(Some(line));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(i: u32) -> AuditRecord {
        let mut r = AuditRecord::refused(uuid::Uuid::now_v7(), chrono::Utc::now());
        r.model_name = format!("m{i}");
        r.http_status = 401;
        r.latency_us = 1;
        r
    }

    fn replayed(spool: &mut Spool) -> Vec<String> {
        let mut names = Vec::new();
        while let Some(chunk) = spool.next_chunk().unwrap() {
            names.extend(chunk.rows.iter().map(|r| r.model_name.clone()));
            spool.commit(&chunk).unwrap();
        }
        names
    }

    #[test]
    fn a_journal_segment_is_deleted_once_its_rows_are_committed_and_replayed_otherwise() {
        let dir = tempfile::tempdir().unwrap();
        let mut spool = Spool::open(dir.path(), "gw", 1 << 20, 1 << 30).unwrap();

        // Every insert committed: the sealed segment goes, unread.
        let seg = spool.journal(&[&row(0)]).unwrap();
        assert!(!spool.has_backlog(), "rows being inserted are no backlog");
        spool.journal_done(&seg, true);
        assert!(seg.exists(), "the current segment stays until sealed");
        spool.seal();
        assert!(!seg.exists());
        assert_eq!(spool.used().load(Ordering::Relaxed), 0);
        assert!(replayed(&mut spool).is_empty());

        // A failed insert: its rows are replayed.
        let seg = spool.journal(&[&row(1)]).unwrap();
        spool.journal_done(&seg, false);
        spool.seal();
        assert!(spool.has_backlog());
        assert_eq!(replayed(&mut spool), ["m1"]);
        assert!(!seg.exists());

        // Rows spooled during an outage into a journal segment keep it for
        // replay, though the journaled batch's insert succeeded.
        let seg = spool.journal(&[&row(2)]).unwrap();
        spool.append(&[&row(3)]).unwrap();
        spool.journal_done(&seg, true);
        spool.seal();
        assert!(seg.exists());
        assert_eq!(replayed(&mut spool), ["m2", "m3"]);

        // While an insert is in flight, replay leaves the segment alone,
        // even sealed.
        let seg = spool.journal(&[&row(4)]).unwrap();
        spool.seal();
        assert!(replayed(&mut spool).is_empty());
        spool.journal_done(&seg, true);
        assert!(!seg.exists());
    }
}
