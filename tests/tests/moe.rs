//! A Mixture-of-Experts model served end to end: `lorafleet-worker
//! generate` gives the transformers + PEFT goldens on Qwen3-MoE, and a
//! tenant's completion through the gateway, routed to a worker on that
//! model with LoRA adapters registered through `lorafleetctl` (one on
//! attention, one on the experts), gives the same text.

#[path = "support/admin_plane.rs"]
mod admin_plane;
#[path = "support/goldens.rs"]
mod goldens;

use admin_plane::*;
use goldens::{assert_gateway_gives, generate_goldens};
use serde_json::{Value, json};

const MODEL: &str = "qwen3-moe";

/// The adapters served, and the route each gets.
const ADAPTERS: [(&str, &str); 2] = [("qv-r8", "support"), ("experts-r4", "experts")];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_gets_a_moe_adapters_golden_text_through_the_gateway() {
    let names: Vec<&str> = ADAPTERS.iter().map(|(a, _)| *a).collect();
    let expected = generate_goldens("golden_moe.json", MODEL, MODEL, &names, 9);
    let p = plane_on("moe_e2e", 1, MODEL).await;
    let (key, _) = tenant_on_fixture_base(&p, "acme", MODEL, "qwen3_moe");
    let mut ids = Vec::new();
    for (adapter, route) in ADAPTERS {
        let id = p.ctl_json(&[
            "adapters",
            "register",
            route,
            "--tenant",
            "acme",
            "--base-model",
            MODEL,
            "--artifact-uri",
            &format!("{MODEL}/{adapter}"),
        ])["lora_int_id"]
            .as_i64()
            .unwrap();
        p.ctl_json(&[
            "routes",
            "set",
            "acme",
            route,
            "--weights",
            &format!("{id}=10000"),
        ]);
        ids.push(id);
    }
    let v1 = ids[0];
    p.ctl_json(&[
        "routes",
        "set",
        "acme",
        "base",
        "--base",
        "--base-model",
        MODEL,
    ]);
    // Per-expert modules (which a transformers 5 MoE does not have) are
    // refused at registration, naming the field.
    let bad = p.root.path().join("qwen3-moe/experts");
    copy_dir(&p.root.path().join("qwen3-moe/qv-r8"), &bad);
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(bad.join("adapter_config.json")).unwrap())
            .unwrap();
    config["target_modules"] = json!(["q_proj", "down_proj"]);
    std::fs::write(bad.join("adapter_config.json"), config.to_string()).unwrap();
    p.ctl(&[
        "adapters",
        "register",
        "experts",
        "--tenant",
        "acme",
        "--base-model",
        MODEL,
        "--artifact-uri",
        "qwen3-moe/experts",
    ])
    .refused(6, "target_modules");

    assert_gateway_gives(&p, &key, &expected, |adapter| match adapter {
        Some(a) => ADAPTERS.iter().find(|(n, _)| *n == a).unwrap().1,
        None => "base",
    })
    .await;
    // The audit log names the adapter version that served, and the fleet
    // view the worker's base model.
    let rows = p.audit_rows("acme", "support", 3).await;
    assert!(rows.iter().all(|r| r["lora_int_id"].as_i64() == Some(v1)));
    let rows = p.audit_rows("acme", "experts", 3).await;
    assert!(
        rows.iter()
            .all(|r| r["lora_int_id"].as_i64() == Some(ids[1]))
    );
    let fleet = p.ctl_json(&["fleet"]);
    assert_eq!(fleet["workers"][0]["base_model"], MODEL);
}
