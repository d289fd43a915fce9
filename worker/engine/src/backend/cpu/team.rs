//! The threads that run the CPU forward pass's parallel loops.
//!
//! A decode step runs about 150 short parallel loops: every projection,
//! every LoRA pass, attention and SiLU, in each layer, most of them a few
//! tens of microseconds per thread. Between two loops the caller does a
//! little serial work (a norm, a residual add), and an idle rayon worker
//! goes to sleep; waking it again (a futex, and on a virtual machine an
//! interrupt to another virtual CPU) costs about as much as a small loop's
//! share of work, and the caller waits for it at the loop's end. The team's
//! workers instead spin for a short while after each loop, so the next loop
//! of the same step finds them awake, and only then sleep, so an idle
//! engine uses no CPU.
//!
//! A loop is `n` items, handed out in runs of consecutive items (the
//! projections prefetch the panels of the item after theirs) that shrink
//! toward the loop's end. Which thread
//! runs an item never changes what the item computes, so results are the
//! same bits on any number of threads. One loop runs on the team at a time;
//! a loop that finds the team busy (another engine in the same process, as
//! in the tests) runs on rayon instead.

use std::any::Any;
use std::cell::UnsafeCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// How long a worker stays awake after a loop, waiting for the next: longer
/// than the serial work between two loops of a step, short enough that an
/// idle engine is soon idle.
const SPIN: Duration = Duration::from_micros(300);

/// A run takes this many threads' share of the items left: runs of
/// consecutive items, long at first and single items at the end.
const RUNS_PER_THREAD: usize = 2;

/// One published loop, its lifetime erased: valid until `pending` is zero.
type Job = *const (dyn Fn() + Sync + 'static);

struct Shared {
    /// Bumped once per loop; a worker runs each epoch's job once.
    epoch: AtomicU64,
    /// Written by the caller holding `busy`, before `epoch` is bumped, and
    /// read by workers after they see the bump.
    job: UnsafeCell<Option<Job>>,
    /// Workers that have not finished the current loop.
    pending: AtomicUsize,
    /// The first panic of a worker's part of the current loop, for the
    /// caller to resume.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Workers asleep (or about to be) on `wake`.
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is only written by the one caller holding `Team::busy` while
// no worker reads it (`pending` is zero), and read by workers between an
// acquire of the new `epoch` and their release of `pending`.
#[allow(unsafe_code)]
unsafe impl Sync for Shared {}

struct Team {
    shared: &'static Shared,
    workers: usize,
    busy: Mutex<()>,
}

fn team() -> &'static Team {
    static TEAM: OnceLock<Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            epoch: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            pending: AtomicUsize::new(0),
            panic: Mutex::new(None),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
        }));
        // As many threads as rayon's pool (`RAYON_NUM_THREADS`), the caller
        // being one of them.
        let mut workers = 0;
        for i in 1..rayon::current_num_threads() {
            let spawned = std::thread::Builder::new()
                .name(format!("lorafleet-cpu-{i}"))
                .spawn(move || work(shared));
            // Without the thread the team is smaller, not wrong.
            if spawned.is_ok() {
                workers += 1;
            }
        }
        Team {
            shared,
            workers,
            busy: Mutex::new(()),
        }
    })
}

fn work(shared: &'static Shared) {
    let mut seen = 0;
    loop {
        seen = wait_for_epoch(shared, seen);
        // SAFETY: the epoch was bumped after the job was written (acquire
        // above), and the caller keeps it alive until `pending` is zero.
        #[allow(unsafe_code)]
        let job = unsafe { (*shared.job.get()).expect("a loop is published with its epoch") };
        // SAFETY: as above.
        #[allow(unsafe_code)]
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)() })) {
            // Kept, never dropped here: a payload whose drop panics would
            // end this thread before it releases `pending`.
            let mut first = shared.panic.lock().unwrap_or_else(|e| e.into_inner());
            if first.is_none() {
                *first = Some(payload);
            } else {
                std::mem::forget(payload);
            }
        }
        shared.pending.fetch_sub(1, Ordering::Release);
    }
}

/// Spins until the epoch moves past `seen`, then sleeps until it does.
fn wait_for_epoch(shared: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let epoch = shared.epoch.load(Ordering::Acquire);
        if epoch != seen {
            return epoch;
        }
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(256) && start.elapsed() > SPIN {
            // Announce the sleep before the last look at the epoch; the
            // caller bumps the epoch before it looks for sleepers, so one of
            // the two sees the other (both sequentially consistent).
            shared.sleepers.fetch_add(1, Ordering::SeqCst);
            let mut guard = shared.sleep.lock().unwrap_or_else(|e| e.into_inner());
            while shared.epoch.load(Ordering::SeqCst) == seen {
                guard = shared.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
            }
            drop(guard);
            shared.sleepers.fetch_sub(1, Ordering::SeqCst);
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Waits, when dropped, until every worker has finished the current loop:
/// also when the caller's own part panics, since the workers still read
/// the caller's closure.
struct Finish<'a>(&'a Shared);

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        let mut spins = 0u32;
        while self.0.pending.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            // A worker that the OS has switched out needs a core: on a busy
            // machine, give it ours now and then.
            if spins.is_multiple_of(4096) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// Runs `f(state, i)` for every `i` in `0..n` on the team. `state` is
/// scratch: `init` makes one for each thread that gets items (on rayon, for
/// each piece rayon splits the loop into). A panic in any item is resumed
/// on the caller, after every thread has left the loop. An item that calls
/// `for_each` itself finds the team busy, so its loop runs on rayon.
pub fn for_each<S>(
    n: usize,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, usize) + Sync + Send,
) {
    if n <= 1 {
        let mut state = init();
        (0..n).for_each(|i| f(&mut state, i));
        return;
    }
    let team = team();
    let busy = match team.busy.try_lock() {
        Ok(guard) => Some(guard),
        Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    };
    let Some(_busy) = busy.filter(|_| team.workers > 0) else {
        (0..n).into_par_iter().for_each_init(init, f);
        return;
    };
    #[cfg(test)]
    tests::ON_TEAM.with(|count| count.set(count.get() + 1));
    let threads = team.workers + 1;
    let next = AtomicUsize::new(0);
    let body = || {
        // Made on the first run this thread gets: a worker that wakes after
        // the items are gone allocates nothing.
        let mut state = None;
        let mut lo = next.load(Ordering::Relaxed);
        while lo < n {
            // Guided: each run is a share of what is left, so runs shrink
            // toward the end and the threads finish close together.
            let hi = lo + (n - lo).div_ceil(RUNS_PER_THREAD * threads);
            match next.compare_exchange_weak(lo, hi, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => {
                    let state = state.get_or_insert_with(&init);
                    (lo..hi).for_each(|i| f(state, i));
                    lo = next.load(Ordering::Relaxed);
                }
                Err(now) => lo = now,
            }
        }
    };
    let shared = team.shared;
    // A worker's panic from a loop whose caller panicked too is stale now.
    let stale = shared
        .panic
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    drop(stale);
    let job: &(dyn Fn() + Sync + '_) = &body;
    // SAFETY: only the lifetime is erased. The workers call `job` only
    // until they release `pending`, and `finish` below waits for that
    // before `body` goes out of scope, whether or not `body` panics here.
    // No worker reads `job` now: the last loop's `pending` reached zero.
    #[allow(unsafe_code)]
    unsafe {
        let job: Job = std::mem::transmute::<*const (dyn Fn() + Sync + '_), Job>(job);
        *shared.job.get() = Some(job);
    }
    shared.pending.store(team.workers, Ordering::Relaxed);
    // Nothing from here to `finish` may panic: workers that never saw the
    // epoch would leave `pending` above zero for ever.
    shared.epoch.fetch_add(1, Ordering::SeqCst);
    if shared.sleepers.load(Ordering::SeqCst) > 0 {
        let _guard = shared.sleep.lock().unwrap_or_else(|e| e.into_inner());
        shared.wake.notify_all();
    }
    let finish = Finish(shared);
    body();
    drop(finish);
    let payload = shared
        .panic
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    if let Some(payload) = payload {
        std::panic::resume_unwind(payload);
    }
}

/// Runs `f(item, i)` for every item of `items` on the team, each item on
/// one thread: the loop over disjoint rows or buffers that most callers
/// want, without locks or raw pointers of their own.
pub fn for_each_mut<T: Send>(items: &mut [T], f: impl Fn(&mut T, usize) + Sync + Send) {
    let base = Items(items.as_mut_ptr());
    for_each(
        items.len(),
        || (),
        |_, i| {
            // SAFETY: `for_each` runs every index in 0..len exactly once, so
            // no two threads hold the same item, and `items` is borrowed
            // mutably until the loop has ended.
            #[allow(unsafe_code)]
            let item = unsafe { base.get(i) };
            f(item, i)
        },
    );
}

/// The start of a slice whose items [`for_each_mut`] hands to threads.
struct Items<T>(*mut T);

// SAFETY: only ever used to reach distinct items from distinct threads, and
// the items themselves may move between threads (`T: Send`).
#[allow(unsafe_code)]
unsafe impl<T: Send> Sync for Items<T> {}
#[allow(unsafe_code)]
unsafe impl<T: Send> Send for Items<T> {}

impl<T> Items<T> {
    /// # Safety
    /// `i` is inside the slice, and no one else uses item `i` meanwhile.
    #[allow(unsafe_code, clippy::mut_from_ref)]
    unsafe fn get(&self, i: usize) -> &mut T {
        // SAFETY: the caller's contract.
        unsafe { &mut *self.0.add(i) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// Loops this thread ran on the team rather than on rayon.
        pub(super) static ON_TEAM: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    #[test]
    fn every_item_runs_once() {
        // Other tests may hold the team now and then: go on until some
        // loops of this test have run on it.
        let before = ON_TEAM.with(|count| count.get());
        for round in 0.. {
            every_item_runs_once_in_one_round();
            if ON_TEAM.with(|count| count.get()) > before + 10 {
                break;
            }
            assert!(round < 10_000, "no loop ran on the team");
        }
    }

    fn every_item_runs_once_in_one_round() {
        for n in [0, 1, 2, 3, 7, 64, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            for_each(
                n,
                || (),
                |_, i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                },
            );
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
        }
    }

    #[test]
    fn for_each_mut_gives_every_item_to_one_thread() {
        let mut items: Vec<usize> = vec![0; 500];
        for round in 1..=3 {
            for_each_mut(&mut items, |item, i| *item += i * round);
        }
        assert!(items.iter().enumerate().all(|(i, &v)| v == 6 * i));
    }

    #[test]
    fn loops_from_many_threads_at_once_all_complete() {
        // Callers that find the team busy run on rayon: every loop still
        // covers its items exactly once.
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for round in 0..200 {
                        let n = 5 + (t * 7 + round) % 40;
                        let sum = AtomicUsize::new(0);
                        for_each(
                            n,
                            || (),
                            |_, i| {
                                sum.fetch_add(i + 1, Ordering::Relaxed);
                            },
                        );
                        assert_eq!(sum.load(Ordering::Relaxed), n * (n + 1) / 2);
                    }
                });
            }
        });
    }

    #[test]
    fn a_panicking_item_panics_the_caller_and_the_team_still_works() {
        let caught = catch_unwind(|| {
            for_each(64, || (), |_, i| assert!(i != 40, "item 40 fails"));
        });
        // The item's own panic, whichever thread ran it.
        let payload = caught.expect_err("the loop panics");
        let message = payload
            .downcast_ref::<&str>()
            .map(|m| m.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned());
        assert_eq!(message.as_deref(), Some("item 40 fails"));
        // Workers asleep or awake, the next loops run every item.
        std::thread::sleep(SPIN * 3);
        for _ in 0..3 {
            let sum = AtomicUsize::new(0);
            for_each(
                100,
                || (),
                |_, i| {
                    sum.fetch_add(i, Ordering::Relaxed);
                },
            );
            assert_eq!(sum.load(Ordering::Relaxed), 4950);
        }
    }
}
