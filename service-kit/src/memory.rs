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
