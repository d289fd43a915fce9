//! Fair admission across tenants: one tenant flooding the engine does not
//! delay another's first tokens, and with fair admission off it does (so
//! the test can fail). Time to first token is counted in engine steps,
//! which is what admission order decides, independent of the machine.

mod common;

use common::*;
use lorafleet_engine::{Engine, EngineSettings, Event, Fairness, Prompt, Request, Sampling};

const MODEL: &str = "llama-gqa";

fn request(id: String, i: usize) -> Request {
    Request {
        id: id.into(),
        adapter: None,
        prompt: Prompt::TokenIds(
            (0..20)
                .map(|k| ((i * 29 + k * 11) % 300 + 3) as u32)
                .collect(),
        ),
        params: Sampling {
            max_tokens: 16,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    }
}

fn engine(fair_admission: bool) -> Engine {
    fixture_engine(
        MODEL,
        EngineSettings {
            max_num_seqs: 8,
            max_batched_tokens: 512,
            fair_admission,
            ..Default::default()
        },
    )
}

/// Submits `a` requests for tenant A, then `b` for tenant B, all at once;
/// runs to the end; returns each tenant's steps to first token, and how
/// many of A's requests completed.
fn run(e: &mut Engine, a: usize, b: usize) -> (Vec<usize>, Vec<usize>, usize) {
    let fair = |key: &str| Fairness {
        key: key.into(),
        weight: 1.0,
    };
    for i in 0..a {
        e.submit_fair(request(format!("a{i}"), i), fair("tenant-a"))
            .unwrap();
    }
    for i in 0..b {
        e.submit_fair(request(format!("b{i}"), 1000 + i), fair("tenant-b"))
            .unwrap();
    }
    let (mut ttft_a, mut ttft_b, mut done_a) = (Vec::new(), Vec::new(), 0);
    let mut seen = std::collections::HashSet::new();
    let mut step = 0;
    while e.has_work() {
        step += 1;
        for (id, event) in e.step().unwrap() {
            match event {
                Event::Delta { .. } if seen.insert(id.clone()) => {
                    if id.starts_with('a') {
                        ttft_a.push(step);
                    } else {
                        ttft_b.push(step);
                    }
                }
                Event::Finished(_) if id.starts_with('a') => done_a += 1,
                Event::Failed(err) => panic!("{id}: {err}"),
                _ => {}
            }
        }
        assert!(step < 100_000, "the engine never drained");
    }
    (ttft_a, ttft_b, done_a)
}

/// The requests that got a first token in the next step.
fn first_tokens(e: &mut Engine) -> Vec<String> {
    e.step()
        .unwrap()
        .into_iter()
        .filter(|(_, ev)| matches!(ev, Event::Delta { .. }))
        .map(|(id, _)| id.into_string())
        .collect()
}

fn median(v: &mut [usize]) -> usize {
    v.sort_unstable();
    v[v.len() / 2]
}

#[test]
fn a_flooding_tenant_does_not_delay_another_tenants_first_tokens() {
    // B alone.
    let (_, mut alone, _) = run(&mut engine(true), 0, 4);
    let alone = median(&mut alone);
    // A submits 10x as many, first; B right after.
    let (_, mut shared, done_a) = run(&mut engine(true), 40, 4);
    let shared = median(&mut shared);
    assert_eq!(done_a, 40, "A's requests all complete");
    assert!(
        shared * 2 <= alone * 3,
        "B's median TTFT {shared} steps against {alone} alone"
    );
    // Arrival order instead: B waits behind all of A.
    let (_, mut fifo, _) = run(&mut engine(false), 40, 4);
    let fifo = median(&mut fifo);
    assert!(
        fifo > 5 * alone,
        "without fair admission B is starved: {fifo} steps against {alone} alone"
    );
    println!("B's median TTFT in steps: alone {alone}, beside A {shared}, arrival order {fifo}");
}

#[test]
fn weights_divide_the_engine_and_idle_time_is_not_banked() {
    // Weight 3 against 1: among the first 8 admitted, 6 are A's.
    let mut e = engine(true);
    for i in 0..20 {
        e.submit_fair(
            request(format!("a{i}"), i),
            Fairness {
                key: "a".into(),
                weight: 3.0,
            },
        )
        .unwrap();
        e.submit_fair(
            request(format!("b{i}"), 100 + i),
            Fairness {
                key: "b".into(),
                weight: 1.0,
            },
        )
        .unwrap();
    }
    let first = first_tokens(&mut e);
    let a = first.iter().filter(|id| id.starts_with('a')).count();
    assert_eq!((first.len(), a), (8, 6), "{first:?}");
    // A weight must be positive.
    let err = e
        .submit_fair(
            request("z".into(), 0),
            Fairness {
                key: "z".into(),
                weight: 0.0,
            },
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            lorafleet_engine::EngineError::InvalidRequest {
                field: lorafleet_engine::Field::FairnessWeight,
                ..
            }
        ),
        "{err}"
    );

    // Idle time is not banked: B arrives new after A has been served
    // alone for a while, and starts level with A instead of owed A's
    // whole history; the next admissions alternate.
    let mut e = engine(true);
    let fair = |key: &str| Fairness {
        key: key.into(),
        weight: 1.0,
    };
    for i in 0..8 {
        e.submit_fair(request(format!("a{i}"), i), fair("a"))
            .unwrap();
    }
    while e.has_work() {
        e.step().unwrap();
    }
    for i in 0..8 {
        e.submit_fair(request(format!("a{}", 10 + i), 10 + i), fair("a"))
            .unwrap();
    }
    for i in 0..8 {
        e.submit_fair(request(format!("b{i}"), 100 + i), fair("b"))
            .unwrap();
    }
    let first = first_tokens(&mut e);
    let b = first.iter().filter(|id| id.starts_with('b')).count();
    assert_eq!((first.len(), b), (8, 4), "{first:?}");
}
