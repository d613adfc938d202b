//! What the workspace's tests share; a dev-dependency only, never a library's dependency.
//!
//! [`skip!`]: a test that cannot run (part of) its work on this machine (a CPU feature, a GPU,
//! cores, a fixture that is not here) says so on stderr and, when `VLM_SKIP_LOG` names a file,
//! appends `crate test: reason` to it. `.ci/run` sets it and prints the list at the end, so a
//! green run says which hardware paths did not run on that machine.
//!
//! [`raise_file_limit`]: for the tests that hold thousands of connections.
//!
//! [`fixtures_dir`], [`tiny_dir`]: the workspace's golden fixtures (one folder, see its
//! README.md) and the tiny checkpoint among them.
//!
//! [`ffmpeg`]: video fixtures made with the ffmpeg CLI.
pub mod exif;
pub mod ffmpeg;
pub mod png;

use std::io::Write;
use std::path::PathBuf;

/// The workspace's root folder.
pub fn workspace_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("test-support sits in the workspace")
        .to_path_buf()
}

/// The golden fixtures every crate's tests read (checkpoints, reference tensors, goldens).
pub fn fixtures_dir() -> PathBuf {
    workspace_dir().join("fixtures")
}

/// The tiny checkpoint of the fixtures (random weights, transformers' goldens beside it).
pub fn tiny_dir() -> PathBuf {
    fixtures_dir().join("tiny")
}

/// Records that the running test skips work, and why (see the crate's doc).
#[macro_export]
macro_rules! skip {
    ($($reason:tt)*) => {
        $crate::record(env!("CARGO_CRATE_NAME"), &format!($($reason)*))
    };
}

/// [`skip!`]'s body: the test's name is its thread's (the test harness names each test's
/// thread after it).
pub fn record(krate: &str, reason: &str) {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("?");
    eprintln!("skipped: {reason}");
    if let Some(path) = std::env::var_os("VLM_SKIP_LOG") {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            // One write of the whole line: appends of parallel tests do not interleave.
            let _ = f.write_all(format!("{krate} {test}: {reason}\n").as_bytes());
        }
    }
}

/// `len` pseudo-random bytes (xorshift64, a fixed seed): the same "random bytes" input every
/// run.
pub fn noise(len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Raises this process's open-file limit to its hard limit (a test that holds thousands of
/// connections, and the services it starts, which inherit it); returns the soft limit now in
/// force.
pub fn raise_file_limit() -> u64 {
    // SAFETY: getrlimit/setrlimit on this process with a valid, initialised struct.
    unsafe {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        r.rlim_cur = r.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        r.rlim_cur
    }
}
