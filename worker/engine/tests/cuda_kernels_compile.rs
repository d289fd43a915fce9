//! Every CUDA kernel compiles to PTX with NVRTC, for each weight type and
//! for the shapes of the golden fixtures and of a 4096-wide model. NVRTC
//! needs no GPU: the `nvidia-cuda-nvrtc` wheel provides the library on any
//! machine (`.ci/run` installs it and sets `LORAFLEET_REQUIRE_NVRTC=1`, so
//! CI cannot skip this test).

use lorafleet_engine::backend::cuda::Dtype;
use lorafleet_engine::backend::cuda::kernels::{self, KERNELS, KernelShapes};

fn nvrtc_or_skip() -> bool {
    if kernels::nvrtc_present() {
        return true;
    }
    assert!(
        std::env::var("LORAFLEET_REQUIRE_NVRTC").as_deref() != Ok("1"),
        "LORAFLEET_REQUIRE_NVRTC=1 but libnvrtc.so cannot be loaded; put the nvidia-cuda-nvrtc \
         wheel's lib directory on LD_LIBRARY_PATH"
    );
    eprintln!("skipped: libnvrtc.so is not on this machine's library path");
    false
}

#[test]
fn every_kernel_compiles_to_ptx_for_every_weight_type_and_shape() {
    if !nvrtc_or_skip() {
        return;
    }
    let shapes = [
        // The golden fixtures: head_dim 16, hidden 64, rank 16.
        (16, 16, 64),
        // A Llama-7B-like model: head_dim 128, hidden 4096, rank 64.
        (128, 64, 512),
        // Odd sizes: a rank that is no power of two, a short chunk.
        (64, 24, 96),
    ];
    let mut compiled = 0;
    for dtype in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
        for &(head_dim, max_rank, shrink_kc) in &shapes {
            for arch in ["compute_80", "compute_90"] {
                let spec = KernelShapes {
                    dtype,
                    slot_dtype: dtype,
                    head_dim,
                    max_rank,
                    shrink_kc,
                };
                let ptx = kernels::compile(&spec, arch)
                    .unwrap_or_else(|e| panic!("{spec:?} for {arch}: {e}"))
                    .to_src();
                for name in KERNELS {
                    assert!(
                        ptx.contains(&format!(".entry {name}(")),
                        "{spec:?} for {arch}: no entry point {name} in the PTX"
                    );
                }
                let target = arch.replace("compute_", "sm_");
                assert!(
                    ptx.contains(&format!(".target {target}")),
                    "{spec:?}: PTX not for {target}"
                );
                compiled += 1;
            }
        }
    }
    assert_eq!(compiled, 18);
}

#[test]
fn every_launched_kernel_is_in_the_source_and_the_list_is_complete() {
    let declared: Vec<&str> = [kernels::SOURCE, kernels::QUANT_SOURCE]
        .into_iter()
        .flat_map(|source| {
            source
                .match_indices("extern \"C\" __global__ void ")
                .map(move |(at, m)| {
                    let mut rest = &source[at + m.len()..];
                    if let Some(bounded) = rest.strip_prefix("__launch_bounds__(") {
                        rest = bounded[bounded.find(')').unwrap() + 1..].trim_start();
                    }
                    &rest[..rest.find('(').unwrap()]
                })
        })
        .collect();
    let mut listed: Vec<&str> = KERNELS.to_vec();
    listed.sort_unstable();
    let mut declared_sorted = declared.clone();
    declared_sorted.sort_unstable();
    assert_eq!(listed, declared_sorted);
}

#[test]
fn shapes_the_kernels_cannot_take_are_refused_by_name() {
    // Caught before NVRTC runs, so on every machine.
    let odd = KernelShapes {
        dtype: Dtype::F32,
        slot_dtype: Dtype::F32,
        head_dim: 15,
        max_rank: 16,
        shrink_kc: 64,
    };
    let err = kernels::compile(&odd, "compute_90")
        .unwrap_err()
        .to_string();
    assert!(err.contains("head_dim 15 must be even"), "{err}");
    // A chunk that is not a multiple of 32 too.
    let chunk = KernelShapes {
        shrink_kc: 40,
        ..odd
    };
    let err = kernels::compile(
        &KernelShapes {
            head_dim: 16,
            ..chunk
        },
        "compute_90",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("shrink chunk 40"), "{err}");
}

#[test]
fn the_cuda_backend_without_a_driver_is_an_error_not_a_panic() {
    // On a machine with a GPU this is the GPU check's business.
    if driver_present() {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    let err = lorafleet_engine::backend::cuda::probe()
        .unwrap_err()
        .to_string();
    assert!(err.contains("libcuda.so"), "{err}");
    assert!(err.contains("no usable CUDA installation"), "{err}");
}

fn driver_present() -> bool {
    // probe() reports the driver first; any other failure means it loaded.
    match lorafleet_engine::backend::cuda::probe() {
        Ok(()) => true,
        Err(e) => !e.to_string().contains("libcuda.so"),
    }
}
