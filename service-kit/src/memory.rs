//! Giving freed heap back to the system. glibc's allocator keeps the pages of large freed
//! allocations in its arenas (a refused 30 MB prompt left the gateway ~58 MiB above its baseline
//! for good); `malloc_trim` returns every arena's free pages. Called after requests that carried
//! large bodies, not per request: it walks the arenas.

/// Request bodies from this size on are followed by [`release_free_memory`].
pub const TRIM_AFTER_BYTES: u64 = 4 << 20;

/// Returns the allocator's free pages to the system (glibc); a no-op elsewhere.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases memory the allocator holds unused.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Calls [`release_free_memory`] when dropped, if armed: held by whatever owns a large
/// request's data until it ends (a refusal, the end of a stream, a cancelled one).
#[derive(Debug)]
pub struct TrimOnDrop(bool);

impl TrimOnDrop {
    /// Armed when `bytes` reaches [`TRIM_AFTER_BYTES`].
    pub fn for_bytes(bytes: u64) -> TrimOnDrop {
        TrimOnDrop(bytes >= TRIM_AFTER_BYTES)
    }
}

impl Drop for TrimOnDrop {
    fn drop(&mut self) {
        if !self.0 {
            return;
        }
        // The transport frees the request's encoded bytes only after the handler's answer is
        // on its way: trim once more a moment later (inside a runtime) to return those too.
        release_free_memory();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                release_free_memory();
            });
        }
    }
}
