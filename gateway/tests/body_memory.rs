//! A request body is read into typed structs straight from its bytes: its
//! peak memory stays about its own size whatever it holds. Parsed through
//! `serde_json::Value`, a megabyte of small numbers takes many megabytes.
//!
//! Its own test binary, because it counts every allocation of the process.
//! A global allocator needs `unsafe`; here, and only here in the gateway,
//! it is allowed: the counter forwards every call to the system allocator.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use lorafleet_gateway::api::openai::{ChatRequest, CompletionRequest};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(live, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Held for a whole test: the counter is the whole process's, so another
/// test building its bodies while this one measures would count too.
fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// The peak of live bytes above the start while `f` runs; call it under
/// [`alone`].
fn peak_during(f: impl FnOnce()) -> usize {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    f();
    PEAK.load(Ordering::Relaxed) - base
}

/// `[0,0,0,...]` of about `bytes` bytes.
fn numbers(bytes: usize) -> String {
    let mut s = String::with_capacity(bytes + 2);
    s.push('[');
    while s.len() < bytes {
        s.push_str("0,");
    }
    s.push('0');
    s.push(']');
    s
}

#[test]
fn a_megabyte_of_numbers_costs_about_a_megabyte() {
    let _alone = alone();
    const MIB: usize = 1 << 20;
    let n = numbers(MIB);
    // Skipped: an unknown field, and an unknown field inside a known one.
    for body in [
        format!(r#"{{"model":"m","prompt":"x","unknown":{n}}}"#),
        format!(r#"{{"model":"m","prompt":"x","stream_options":{{"a":{n}}}}}"#),
    ] {
        let peak = peak_during(|| {
            let r = CompletionRequest::parse(body.as_bytes()).expect("a valid body");
            drop(std::hint::black_box(r));
        });
        assert!(peak <= MIB / 4, "a skipped field is not kept: {peak} bytes");
    }
    // Kept: half a million token ids, four bytes each in a vector that
    // doubles as it grows. As `Value`, each is a 32-byte node: over 16 MiB.
    let body = format!(r#"{{"model":"m","prompt":{n}}}"#);
    let peak = peak_during(|| {
        let r = CompletionRequest::parse(body.as_bytes()).expect("a valid body");
        drop(std::hint::black_box(r.to_worker().expect("valid fields")));
    });
    assert!(peak <= 8 * MIB, "token ids peaked at {peak} bytes");
    let chat = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}],"x":{n}}}"#);
    let peak = peak_during(|| {
        drop(std::hint::black_box(ChatRequest::parse(chat.as_bytes())));
    });
    assert!(peak <= MIB / 4, "a skipped field is not kept: {peak} bytes");
}

#[test]
fn the_value_route_would_fail_this_check() {
    let _alone = alone();
    // The bound above is meaningful: the old way, through `Value`, breaks it.
    let n = numbers(1 << 20);
    let body = format!(r#"{{"model":"m","prompt":"x","unknown":{n}}}"#);
    let peak = peak_during(|| {
        let v: serde_json::Value = serde_json::from_slice(body.as_bytes()).unwrap();
        drop(std::hint::black_box(v));
    });
    assert!(peak > 8 << 20, "{peak}");
}
