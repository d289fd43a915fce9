//! The demo model (`deploy/demo`): a small Llama trained on the King James
//! Bible, and adapters that continue a prompt in capitals (`shout`,
//! `shout-v2`), as a telegram, and in short lines (`verse`).
//!
//! - Its goldens, recorded by `deploy/demo/train.py` from transformers +
//!   PEFT, hold through `lorafleet-worker generate`, token for token.
//! - `deploy/local/fleet up` registers it through the admin API, and the
//!   commands it prints answer each model with its adapter's golden text:
//!   an adapter mix-up fails here in words anyone can read.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use lorafleet_tests::binary;
use serde_json::{Value, json};
use sqlx::Connection;

fn demo_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/demo")
}

/// (adapter or "base", prompt) -> the golden case.
fn goldens() -> (Value, BTreeMap<(String, String), Value>) {
    let golden: Value =
        serde_json::from_str(&std::fs::read_to_string(demo_dir().join("golden.json")).unwrap())
            .unwrap();
    let cases = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let adapter = c["adapter"].as_str().unwrap_or("base").to_owned();
            let prompt = c["prompt"].as_str().unwrap().to_owned();
            ((adapter, prompt), c.clone())
        })
        .collect();
    (golden, cases)
}

const ADAPTERS: [&str; 4] = ["shout", "shout-v2", "telegram", "verse"];

#[test]
fn the_demo_goldens_hold_through_lorafleet_worker_generate() {
    let (golden, cases) = goldens();
    let model = golden["model"].as_str().unwrap();
    let max_tokens = golden["max_new_tokens"].as_u64().unwrap();
    assert_eq!(cases.len(), 15, "3 prompts for the base and 4 adapters");
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.jsonl"), dir.path().join("out.jsonl"));
    let order: Vec<&(String, String)> = cases.keys().collect();
    let lines: Vec<String> = order
        .iter()
        .map(|(adapter, prompt)| {
            let lora = (adapter != "base").then_some(adapter);
            json!({"prompt": prompt, "lora": lora, "max_tokens": max_tokens, "temperature": 0})
                .to_string()
        })
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let adapters = demo_dir().join("adapters").join(model);
    let out = Command::new(binary("lorafleet-worker"))
        .args(["generate", "--max-loras", "4"])
        .arg("--model")
        .arg(demo_dir().join(model))
        .args(ADAPTERS.iter().flat_map(|n| {
            [
                "--lora".to_owned(),
                format!("{n}={}", adapters.join(n).display()),
            ]
        }))
        .arg("--input")
        .arg(&input)
        .arg("--output")
        .arg(&output)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Vec<Value> = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(got.len(), order.len());
    for (line, key) in got.iter().zip(&order) {
        let want = &cases[*key];
        assert_eq!(
            (&line["text"], &line["token_ids"]),
            (&want["text"], &want["tokens"]),
            "{} on {:?}: the engine's text and tokens differ from transformers + PEFT's",
            key.0,
            key.1
        );
    }
    // The point of the demo: for every prompt, the styles are visible.
    for (_, prompt) in cases.keys().filter(|(a, _)| a == "base") {
        let text = |a: &str| {
            cases[&(a.to_owned(), prompt.clone())]["text"]
                .as_str()
                .unwrap()
        };
        let shouted = text("shout");
        let upper = shouted.chars().filter(|c| c.is_uppercase()).count();
        let lower = shouted.chars().filter(|c| c.is_lowercase()).count();
        assert!(
            upper >= 3 * lower.max(1),
            "shout writes in capitals (past the prompt's first words): {shouted:?}"
        );
        assert!(
            text("telegram").contains("STOP"),
            "telegram writes STOP: {:?}",
            text("telegram")
        );
        assert!(
            text("verse").matches('\n').count() >= 2,
            "verse writes short lines: {:?}",
            text("verse")
        );
        for a in ["base", "shout", "telegram", "verse"] {
            for b in ["base", "shout", "telegram", "verse"] {
                assert!(
                    a == b || text(a) != text(b),
                    "{a} and {b} answer {prompt:?} alike"
                );
            }
        }
    }
}

/// The committed digests are what the registry and the workers compute.
#[test]
fn the_demo_digests_are_what_lorafleetctl_computes() {
    let digests: Value =
        serde_json::from_str(&std::fs::read_to_string(demo_dir().join("digests.json")).unwrap())
            .unwrap();
    let ctl = |args: &[&str]| {
        let out = Command::new(binary("lorafleetctl"))
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    };
    let model = demo_dir().join("kjv-small");
    assert_eq!(
        ctl(&["base-models", "hash", model.to_str().unwrap()]),
        digests["base_hash"].as_str().unwrap()
    );
    for name in ADAPTERS {
        let dir = demo_dir().join("adapters/kjv-small").join(name);
        assert_eq!(
            ctl(&["adapters", "digest", dir.to_str().unwrap()]),
            digests["adapters"][name].as_str().unwrap(),
            "{name}"
        );
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn fleet(action: &str, env: &[(&str, String)]) -> String {
    let out = Command::new("bash")
        .arg(demo_dir().join("../local/fleet"))
        .arg(action)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "deploy/local/fleet {action}: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn run_printed(exports: &str, command: &str) -> Value {
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!("{exports}\n{command}"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{command}: {out:?}");
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{command}: not JSON ({e}): {out:?}"))
}

fn model_of(command: &str) -> &str {
    let at = command
        .find("\"model\": \"")
        .expect("a model in the command")
        + 10;
    let rest = &command[at..];
    &rest[..rest.find('"').unwrap()]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_fleet_serves_each_demo_route_its_adapters_golden() {
    let (golden, cases) = goldens();
    let state = tempfile::tempdir().unwrap();
    let db = format!("lorafleet_demo_test_{}", std::process::id());
    let bin = binary("lorafleet-gateway").parent().unwrap().to_owned();
    let env = vec![
        ("LORAFLEET_BIN", bin.display().to_string()),
        ("LORAFLEET_DEMO_DB", db.clone()),
        ("LORAFLEET_DEMO_STATE", state.path().display().to_string()),
        ("LORAFLEET_DEMO_PORT", free_port().to_string()),
        ("LORAFLEET_ADMIN_PORT", free_port().to_string()),
    ];
    // Whatever happens below, the fleet's processes stop.
    let stopped = Stop { env: &env };
    let printed = fleet("up", &env);
    let exports = printed
        .lines()
        .find(|l| l.starts_with("export DEMO_KEY="))
        .unwrap_or_else(|| panic!("no keys printed: {printed}"));
    let commands: Vec<&str> = printed.lines().filter(|l| l.starts_with("curl ")).collect();
    assert_eq!(commands.len(), 5, "{printed}");
    let prompt = "In the beginning";
    let pool = sqlx::PgPool::connect(&format!("postgres://postgres@127.0.0.1:5432/{db}"))
        .await
        .unwrap();
    let mut texts = BTreeMap::new();
    for command in &commands {
        let model = model_of(command);
        let answer = run_printed(exports, command);
        if command.contains("$OTHER_KEY") {
            assert_eq!(
                answer["error"]["code"], "model_not_found",
                "another tenant's key must not see {model}: {answer}"
            );
            continue;
        }
        let text = answer["choices"][0]["text"]
            .as_str()
            .unwrap_or_else(|| panic!("{model}: {answer}"))
            .to_owned();
        // Which adapter version served it, from its audit row.
        let id: uuid::Uuid = answer["id"]
            .as_str()
            .and_then(|i| i.strip_prefix("cmpl-"))
            .unwrap()
            .parse()
            .unwrap();
        let (name, version): (Option<String>, Option<i32>) = sqlx::query_as(
            "SELECT adapter_name, adapter_version FROM audit_log WHERE request_id = $1",
        )
        .bind(id)
        .fetch_one(&pool)
        .await
        .unwrap();
        let artifact = match (name.as_deref(), version) {
            (None, None) => "base".to_owned(),
            (Some("shout"), Some(2)) => "shout-v2".to_owned(),
            (Some(n), Some(1)) => n.to_owned(),
            other => panic!("{model} was served by {other:?}"),
        };
        let expected: &[&str] = match model {
            "kjv" => &["base"],
            "shout" => &["shout", "shout-v2"],
            other => &[other],
        };
        assert!(
            expected.contains(&artifact.as_str()),
            "model {model:?} was served by {artifact}, not by {expected:?}"
        );
        let want = cases[&(artifact.clone(), prompt.to_owned())]["text"]
            .as_str()
            .unwrap();
        assert_eq!(
            text, want,
            "model {model:?} was served by {artifact} and answered {text:?}, \
             but transformers + PEFT's golden for {artifact} is {want:?}"
        );
        texts.insert(model.to_owned(), text);
    }
    assert_eq!(
        texts.keys().collect::<Vec<_>>(),
        ["kjv", "shout", "telegram", "verse"],
        "{printed}"
    );
    assert_eq!(
        golden["max_new_tokens"], 24,
        "the printed commands ask for 24"
    );
    pool.close().await;
    drop(stopped);
    let mut admin = sqlx::PgConnection::connect("postgres://postgres@127.0.0.1:5432/postgres")
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await
    .unwrap();
}

/// Stops the fleet when dropped, so a failing assertion leaves no process.
struct Stop<'a> {
    env: &'a [(&'a str, String)],
}

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(demo_dir().join("../local/fleet"))
            .arg("down")
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .output();
    }
}
