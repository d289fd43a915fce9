//! Structured outputs' token masks, computed beside the forward pass on a
//! few threads of their own, at a lower CPU priority than the engine's.
//!
//! A step submits each constrained row's mask before its forward pass and
//! waits for it only until a budget after the forward ends (the forward's
//! own time, at least [`MIN_GRACE`]). A row whose mask is not ready then
//! waits a step instead of the batch: its logits are kept
//! ([`crate::sequence::PendingDraw`]), the scheduler passes the sequence
//! over, and a later step draws its token from them once the mask is in.
//! One tenant's costly grammar thus delays its own tokens, never the
//! others'.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::constraint::{Allowed, Grammar};
use crate::error::Result;

/// Threads the masks are computed on.
pub(crate) const MASK_THREADS: usize = 4;

/// The least a step waits for its masks past the forward pass.
pub(crate) const MIN_GRACE: Duration = Duration::from_micros(500);

/// The nice value of the mask threads: the engine's own threads (the
/// forward pass) come first when the CPU is short.
const MASK_NICE: i32 = 10;

type Job = Box<dyn FnOnce() + Send>;

/// The mask threads; they end when the pool is dropped.
pub(crate) struct MaskPool {
    jobs: Mutex<Sender<Job>>,
    /// Microseconds every job waits first ([`MaskPool::set_delay`]).
    delay_us: Arc<AtomicU64>,
}

impl std::fmt::Debug for MaskPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MaskPool")
    }
}

/// One row's mask, filled by a mask thread.
#[derive(Clone, Default)]
pub(crate) struct MaskSlot(Arc<(Mutex<Option<Result<Allowed>>>, Condvar)>);

impl std::fmt::Debug for MaskSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("MaskSlot").field(&self.ready()).finish()
    }
}

impl MaskSlot {
    fn fill(&self, mask: Result<Allowed>) {
        let (lock, ready) = &*self.0;
        *lock.lock().expect("a mask slot's lock") = Some(mask);
        ready.notify_all();
    }

    /// Whether the mask is in.
    pub(crate) fn ready(&self) -> bool {
        self.0.0.lock().expect("a mask slot's lock").is_some()
    }

    /// Waits for the mask until `deadline`; true once it is in.
    pub(crate) fn wait_until(&self, deadline: Instant) -> bool {
        let (lock, ready) = &*self.0;
        let mut mask = lock.lock().expect("a mask slot's lock");
        while mask.is_none() {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            mask = ready
                .wait_timeout(mask, deadline - now)
                .expect("a mask slot's lock")
                .0;
        }
        true
    }

    /// The mask, once in.
    pub(crate) fn take(&self) -> Option<Result<Allowed>> {
        self.0.0.lock().expect("a mask slot's lock").take()
    }
}

impl MaskPool {
    pub(crate) fn new(threads: usize) -> MaskPool {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for k in 0..threads.max(1) {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("masks-{k}"))
                .spawn(move || {
                    lower_priority();
                    loop {
                        let job = rx.lock().expect("the mask queue's lock").recv();
                        match job {
                            Ok(job) => job(),
                            // The pool is gone.
                            Err(_) => return,
                        }
                    }
                })
                .expect("spawn a mask thread");
        }
        MaskPool {
            jobs: Mutex::new(tx),
            delay_us: Arc::default(),
        }
    }

    /// Makes every job wait `delay` before it computes (tests).
    pub(crate) fn set_delay(&self, delay: Duration) {
        self.delay_us
            .store(delay.as_micros() as u64, Ordering::Relaxed);
    }

    /// Starts computing `grammar`'s next mask.
    pub(crate) fn submit(&self, grammar: Arc<Mutex<Grammar>>) -> MaskSlot {
        let slot = MaskSlot::default();
        let filled = slot.clone();
        let delay = Duration::from_micros(self.delay_us.load(Ordering::Relaxed));
        let job: Job = Box::new(move || {
            if !delay.is_zero() {
                std::thread::sleep(delay);
            }
            let mask = grammar.lock().expect("a grammar's lock").allowed();
            filled.fill(mask);
        });
        if let Err(std::sync::mpsc::SendError(job)) =
            self.jobs.lock().expect("the mask queue's lock").send(job)
        {
            // No mask thread is left (it cannot happen while the pool
            // stands): computed here rather than never.
            job();
        }
        slot
    }
}

/// Lowers the calling thread's CPU priority (Linux: per thread), below
/// the engine's: for tenant-driven work beside it (masks, constraint
/// compiles). Once lowered it stays so (raising it back needs a privilege
/// a server does not hold).
pub fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: gettid and setpriority take no pointers; a failure leaves
    // the thread at its priority, which is harmless.
    #[allow(unsafe_code)]
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid, MASK_NICE);
    }
}

/// How long a step waits for its masks past a forward pass of `forward`.
pub(crate) fn grace(forward: Duration) -> Duration {
    forward.max(MIN_GRACE)
}
