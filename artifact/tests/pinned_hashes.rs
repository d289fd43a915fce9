//! The base hash and the artifact digest are part of the registry's data:
//! a registered adapter names its base by one and its bytes by the other,
//! so neither may ever change for the same files. These values are pinned
//! here as literals (they also match the independent Python
//! implementation's `base_hashes.json` and `artifact_digests.json` in the
//! engine's fixtures): a change to either algorithm fails this test, even
//! if the fixtures were regenerated with it.

use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../worker/engine/tests/fixtures"
    ))
}

#[test]
fn the_base_hash_of_a_fixture_model_is_pinned() {
    let hash =
        lorafleet_artifact::weights::base_hash(&fixtures().join("llama-gqa"), &mut |_, _| {})
            .unwrap();
    assert_eq!(
        hash.as_str(),
        "1e3ce41ef39b0a233c9ae6f924f17b08a16b3e733146b7c3ba3dd315da509456"
    );
    let python: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("base_hashes.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(python["llama-gqa"], hash.as_str());
}

#[test]
fn the_digest_of_a_fixture_adapter_is_pinned() {
    let digest =
        lorafleet_artifact::roots::digest(&fixtures().join("adapters/llama-gqa/down-r12")).unwrap();
    assert_eq!(
        digest,
        "35ff25a96216415ad26f06c9dd0fe3d763595d0b0cb2f27e1924b2b6478bed88"
    );
    let python: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("artifact_digests.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(python["llama-gqa/down-r12"], digest.as_str());
}
