use std::path::Path;

use serde_json::Value;

use super::*;
use crate::error::Result;
use crate::json::Fields;

fn rope(config: Value) -> Result<Rope> {
    let map = config.as_object().unwrap().clone();
    let f = Fields {
        file: Path::new("config.json"),
        map: &map,
    };
    Rope::parse(&f, 64)
}

#[test]
fn llama3_keeps_high_frequencies_divides_low_ones_and_smooths_between() {
    let r = rope(serde_json::json!({
        "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    }))
    .unwrap();
    let plain = Rope::plain(500000.0, 64).inv_freq();
    let scaled = r.inv_freq();
    assert_eq!(scaled[0], plain[0], "the highest frequency is kept");
    assert_eq!(
        scaled[31],
        plain[31] / 8.0,
        "the lowest is divided by the factor"
    );
    assert!(
        scaled
            .iter()
            .zip(&plain)
            .all(|(s, p)| s <= p && *s >= p / 8.0),
        "every frequency lies between the two"
    );
    assert_eq!(r.attention_factor(), 1.0);
}

#[test]
fn yarn_reads_its_attention_factor_from_mscale() {
    let r = rope(serde_json::json!({
        "rope_theta": 10000.0, "max_position_embeddings": 32768,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    }))
    .unwrap();
    assert!((r.attention_factor() - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);
    let r = rope(serde_json::json!({
        "rope_parameters": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                            "beta_fast": 32, "beta_slow": 1, "rope_theta": 150000.0}
    }))
    .unwrap();
    assert_eq!(r.attention_factor(), 1.0, "mscale over mscale_all_dim");
    assert_eq!(r.theta, 150000.0);
}

#[test]
fn partial_rotary_factor_rotates_the_leading_dimensions() {
    let r = rope(serde_json::json!({"partial_rotary_factor": 0.75})).unwrap();
    assert_eq!(r.rotary_dim, 48);
    assert_eq!(r.inv_freq().len(), 24);
}

#[test]
fn what_it_does_not_implement_or_contradicts_itself_is_refused_by_field() {
    for (config, needle) in [
        (
            serde_json::json!({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0, "beta_fast": 1}}),
            "`rope_scaling.beta_fast`: is not a field of rope type \"dynamic\"",
        ),
        (
            serde_json::json!({"max_position_embeddings": 64, "rope_scaling": {"rope_type": "longrope",
                "short_factor": [1.0], "long_factor": [1.0]}}),
            "`rope_scaling.short_factor`: has 1 factors; the 64 rotary dimensions need 32",
        ),
        (
            serde_json::json!({"max_position_embeddings": 64, "rope_scaling": {"rope_type": "longrope",
                "short_factor": [1.0], "long_factor": [-1.0]}}),
            "`rope_scaling.long_factor[0]`: must be a positive number",
        ),
        (
            serde_json::json!({"rope_scaling": {"type": "su"}}),
            "`rope_scaling.type`: rope type \"su\"",
        ),
        (
            serde_json::json!({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}),
            "`rope_scaling.factor`: -2 must be a positive number",
        ),
        (
            serde_json::json!({"rope_scaling": {"rope_type": "linear"}}),
            "`rope_scaling.factor`: is required",
        ),
        (
            serde_json::json!({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 3}}),
            "`rope_scaling.beta_fast`: is not a field of rope type \"linear\"",
        ),
        (
            serde_json::json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                "low_freq_factor": 4.0, "high_freq_factor": 1.0}}),
            "`rope_scaling.high_freq_factor`",
        ),
        (
            serde_json::json!({"partial_rotary_factor": 1.5}),
            "`partial_rotary_factor`",
        ),
        (serde_json::json!({"rope_theta": 0.0}), "`rope_theta`"),
        (
            serde_json::json!({"max_position_embeddings": 64, "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "truncate": "no"}}),
            "`rope_scaling.truncate`",
        ),
    ] {
        let err = rope(config).unwrap_err().to_string();
        assert!(err.contains(needle), "{needle}: {err}");
    }
}
