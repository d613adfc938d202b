//! The workspace's binaries (built when missing), the tiny checkpoint made once, the tests'
//! config, and a process's memory as /proc shows it.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Serialises the tests of one test binary (each starts its own processes).
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// A binary of the workspace (`vlm` or a service) in the target directory these tests run from
/// (a test binary lives in `<target>/<profile>/deps`); builds all four when one is missing.
pub fn bin(name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    let dir = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    let path = |n: &str| dir.join(format!("{n}{}", std::env::consts::EXE_SUFFIX));
    BUILT.get_or_init(|| {
        if ["vlm", "vision-service", "lm-service", "gateway"]
            .iter()
            .all(|n| path(n).is_file())
        {
            return;
        }
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(workspace_root()).args([
            "build",
            "-p",
            "vlm-cli",
            "-p",
            "vlm-vision-service",
            "-p",
            "vlm-lm-service",
            "-p",
            "vlm-gateway",
        ]);
        if dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("running cargo build");
        assert!(status.success(), "cargo build of the binaries failed");
    });
    path(name)
}

/// The tiny random checkpoint (seed 0), made once per target directory. It is written to a
/// temporary directory and renamed into place, so test binaries running at once never see a
/// half-written checkpoint.
/// The tiny checkpoint's tokenizer and the in-process pipeline (f32, CPU kernels, 256-token
/// blocks): the oracle the services are compared with.
pub fn tiny_oracle() -> (
    vlm_tokenizer::ChatTokenizer,
    vlm_model::oracle::Oracle<vlm_backend_cpu::CpuKernels>,
) {
    let dir = tiny_model();
    let tok = vlm_tokenizer::ChatTokenizer::from_dir(&dir).unwrap();
    let kernels = vlm_backend_cpu::CpuKernels::new(vlm_backend_cpu::CpuOptions::detect());
    let pipeline = vlm_model::oracle::Oracle::load(&kernels, &dir, vlm_model::DType::F32)
        .unwrap()
        .with_block_len(256);
    (tok, pipeline)
}

pub fn tiny_model() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("e2e-tiny-s0");
        let done = dir.join(".complete");
        if !done.is_file() {
            let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join(format!("e2e-tiny-s0.tmp-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&tmp);
            let opts = vlm_make_model::MakeOptions::new(vlm_make_model::Preset::Tiny);
            vlm_make_model::make_model(&tmp, &opts).expect("make the tiny checkpoint");
            std::fs::write(tmp.join(".complete"), b"").unwrap();
            if !done.is_file() {
                // A leftover without `.complete` is an interrupted older run.
                let _ = std::fs::remove_dir_all(&dir);
                if std::fs::rename(&tmp, &dir).is_err() {
                    assert!(
                        done.is_file(),
                        "could not move the tiny checkpoint into {}",
                        dir.display()
                    );
                }
            }
            let _ = std::fs::remove_dir_all(&tmp);
        }
        dir
    })
    .clone()
}

/// The harness's config (`LM_DEVICE` is filled in by [`write_config`]).
pub const CONFIG: &str = "\
visual:
  max_seq_len: [1024, 4096, 16384]
  num_devices: 1
  device: [0]
  oversize: reject
max_seq_len: 4096
kvcache_partition_len: 256
kvcache_num_blocks: 64
batch_size: 8
decoder_batch_sizes: [1, 2, 4, 8]
prefill_chunk_size: 128
num_devices: 1
device: [LM_DEVICE]
";

/// The nested config every service of the harness reads (vision on core 0, the LM on core 1
/// when there is one).
pub fn config_file() -> PathBuf {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| write_config("e2e-local.yaml", CONFIG))
        .clone()
}

/// Writes `yaml` to `name` in the target's temporary directory, with `LM_DEVICE` replaced by
/// core 1 when the machine has two cores (vision keeps core 0), else 0.
pub fn write_config(name: &str, yaml: &str) -> PathBuf {
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let lm = if cores > 1 { "1" } else { "0" };
    let p = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&p, yaml.replace("LM_DEVICE", lm)).unwrap();
    p
}

/// Runs `vlm ARGS` to completion and returns its output; panics with its stderr unless it
/// succeeded.
pub fn vlm_ok<I, S>(args: I) -> std::process::Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let out = Command::new(bin("vlm")).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `VmRSS` (resident set) of `pid` in bytes.
pub fn vm_rss(pid: u32) -> u64 {
    proc_status_bytes(pid, "VmRSS:")
}

/// `VmHWM` (peak resident set) of `pid` in bytes.
pub fn vm_hwm(pid: u32) -> u64 {
    proc_status_bytes(pid, "VmHWM:")
}

/// A `kB` line of `/proc/PID/status`, in bytes.
fn proc_status_bytes(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(key))
        .unwrap_or_else(|| panic!("{key} in /proc/{pid}/status"));
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}
