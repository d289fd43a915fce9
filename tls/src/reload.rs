//! A rustls config rebuilt whenever its PEM files change.

use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use crate::{Loaded, PemFiles, TlsError, metric};

type Build<C> = dyn Fn(&Loaded) -> Result<C, TlsError> + Send + Sync;

/// The current config built from `files`. A task polls the files every
/// interval and swaps in a new config when their bytes change; connections
/// opened after that use it, open ones keep theirs. Polling (rather than
/// inotify) is what works with Kubernetes Secret volumes, whose updates
/// swap a symlink.
pub struct Reloading<C> {
    current: Arc<RwLock<Arc<C>>>,
}

impl<C> Clone for Reloading<C> {
    fn clone(&self) -> Self {
        Reloading {
            current: self.current.clone(),
        }
    }
}

impl<C> std::fmt::Debug for Reloading<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloading").finish_non_exhaustive()
    }
}

impl<C: Send + Sync + 'static> Reloading<C> {
    /// Loads the files now (an error here is a startup error), then, inside
    /// a Tokio runtime, keeps reloading them every `every` until the last
    /// clone is dropped.
    pub fn start(
        files: PemFiles,
        every: Duration,
        build: impl Fn(&Loaded) -> Result<C, TlsError> + Send + Sync + 'static,
    ) -> Result<Reloading<C>, TlsError> {
        let raw = files.read()?;
        let config = build(&files.parse(&raw)?)?;
        let current = Arc::new(RwLock::new(Arc::new(config)));
        let watched = Arc::downgrade(&current);
        tokio::spawn(watch(files, every, raw.digest, watched, Box::new(build)));
        Ok(Reloading { current })
    }

    /// A config that never changes (a client made for one purpose, such as
    /// a test that presents no certificate).
    pub fn fixed(config: C) -> Reloading<C> {
        Reloading {
            current: Arc::new(RwLock::new(Arc::new(config))),
        }
    }

    /// The config for a new connection.
    pub fn current(&self) -> Arc<C> {
        self.current.read().expect("tls config").clone()
    }
}

async fn watch<C>(
    files: PemFiles,
    every: Duration,
    mut seen: [u8; 32],
    current: Weak<RwLock<Arc<C>>>,
    build: Box<Build<C>>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(current) = current.upgrade() else {
            return;
        };
        let raw = {
            let files = files.clone();
            match tokio::task::spawn_blocking(move || files.read()).await {
                Ok(r) => r,
                Err(_) => continue,
            }
        };
        let raw = match raw {
            Ok(raw) if raw.digest == seen => continue,
            Ok(raw) => raw,
            Err(e) => {
                // A Secret mid-update can lack a file for a moment; the
                // last good config stays in use.
                tracing::warn!(error = %e, "TLS files unreadable; keeping the current certificates");
                metrics::counter!(metric::RELOADS, "result" => "error").increment(1);
                continue;
            }
        };
        // Remember the bytes even when they fail to build, so one broken
        // update is reported once, not at every poll.
        seen = raw.digest;
        match files.parse(&raw).and_then(|l| build(&l)) {
            Ok(config) => {
                *current.write().expect("tls config") = Arc::new(config);
                tracing::info!(cert = %files.cert.display(), "TLS certificates reloaded");
                metrics::counter!(metric::RELOADS, "result" => "ok").increment(1);
            }
            Err(e) => {
                tracing::warn!(error = %e, "new TLS files refused; keeping the current certificates");
                metrics::counter!(metric::RELOADS, "result" => "error").increment(1);
            }
        }
    }
}
