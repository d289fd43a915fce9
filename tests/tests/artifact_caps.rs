//! An artifact fetched from an object store is bounded before a byte is
//! read: more objects than `--artifact-max-objects`, or more bytes in its
//! listing than `--artifact-max-bytes`, or more of either than it held at
//! registration, is refused by name with nothing left behind; within the
//! limits it is fetched and hashed as always.
//! A real S3-compatible server (`s3s-fs`) on loopback.

use lorafleet_artifact::roots::ArtifactError;
use lorafleet_store::{FetchOptions, ObjectStores, StoreSpec};
use lorafleet_tests::s3::S3Server;

#[test]
#[allow(unsafe_code)]
fn a_fetch_is_refused_from_its_listing_past_the_object_and_byte_limits() {
    let s3 = S3Server::start(&["caps"]);
    for (k, v) in s3.client_env() {
        // SAFETY: the only test of this binary, before any other thread
        // of it starts.
        unsafe { std::env::set_var(k, v) };
    }
    let work = tempfile::tempdir().unwrap();
    let source = work.path().join("adapter");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("adapter_config.json"), b"{\"r\": 8}").unwrap();
    std::fs::write(source.join("adapter_model.safetensors"), vec![7u8; 4000]).unwrap();
    let total = 8 + 4000;
    let spec: StoreSpec = "caps=s3://caps/prod".parse().unwrap();
    let stores = |max_bytes: u64, max_objects: usize| {
        ObjectStores::new(
            std::slice::from_ref(&spec),
            FetchOptions {
                endpoint: Some(s3.endpoint.clone()),
                max_bytes,
                max_objects,
                ..Default::default()
            },
        )
        .unwrap()
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let uri = "s3://caps/prod/acme/v1";
    let digest = rt
        .block_on(lorafleet_store::push_dir(
            &stores(1 << 30, 10),
            &source,
            uri,
            &mut |_| {},
        ))
        .unwrap();

    // Within the limits (exactly at them): fetched, the same digest.
    let dest = work.path().join("fetched");
    let got = rt
        .block_on(stores(total, 2).fetch_verified(uri, Some(&digest), &dest))
        .unwrap();
    assert_eq!(got, digest);
    assert!(dest.join("adapter_model.safetensors").is_file());

    for (max_bytes, max_objects, flag) in [
        (total - 1, 2, "--artifact-max-bytes"),
        (total, 1, "--artifact-max-objects"),
    ] {
        let dest = work
            .path()
            .join(format!("refused-{max_bytes}-{max_objects}"));
        let err = rt
            .block_on(stores(max_bytes, max_objects).fetch_verified(uri, Some(&digest), &dest))
            .unwrap_err();
        assert!(
            matches!(err, ArtifactError::TooLarge { .. }),
            "{flag}: {err}"
        );
        assert!(err.to_string().contains(flag), "{err}");
        assert!(!dest.exists(), "{flag}: a refused fetch left {dest:?}");
    }
    // Against what it held at registration (bytes, objects): the same,
    // fetched; one byte or one object fewer recorded, refused.
    let dest = work.path().join("recorded");
    rt.block_on(stores(1 << 30, 10).fetch_verified_within(
        uri,
        Some(&digest),
        &dest,
        Some((total, 2)),
    ))
    .unwrap();
    std::fs::remove_dir_all(&dest).unwrap();
    for recorded in [(total - 1, 2), (total, 1)] {
        let err = rt
            .block_on(stores(1 << 30, 10).fetch_verified_within(
                uri,
                Some(&digest),
                &dest,
                Some(recorded),
            ))
            .unwrap_err();
        assert!(matches!(err, ArtifactError::TooLarge { .. }), "{err}");
        assert!(err.to_string().contains("at registration"), "{err}");
        assert!(!dest.exists());
    }
    // Nothing partial is left beside the refused ones either.
    let left: Vec<String> = std::fs::read_dir(work.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mut left = left;
    left.sort();
    assert_eq!(left, ["adapter", "fetched"]);
}
