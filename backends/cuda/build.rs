//! With the `cuda` feature: compiles `src/kernels/*.cu` to PTX with nvcc for
//! `sm_$CUDA_COMPUTE_CAP` (default 90, Hopper) into OUT_DIR, where `gpu::module` includes it.
//! Without it, nothing (the crate's CPU parts need no toolkit).
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/kernels");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("vlm_kernels.ptx");
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17", &format!("-arch=sm_{cap}")])
        .arg("src/kernels/vlm_kernels.cu")
        .arg("-o")
        .arg(&out)
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "the cuda feature needs nvcc ({nvcc}: {e}); `source scripts/cuda-toolkit.sh` first"
            )
        });
    assert!(
        status.success(),
        "nvcc failed on src/kernels/vlm_kernels.cu"
    );
}
