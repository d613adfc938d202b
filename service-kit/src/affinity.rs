//! The CPU device pool: a service's `device` list names cores, and its compute threads are
//! pinned to them so disjoint pools do not compete.
//!
//! Ids are positions in the set of cores this process may run on (`sched_getaffinity`), so a
//! container limited to cores 4-7 names them 0..3, the same way a GPU pod numbers its GPUs.

/// A device id the machine (or the container) does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("device {id} does not exist: this process may use {available} cores (device ids 0..{available}); fix `{key}` or --device")]
pub struct NoSuchCore {
    pub id: u32,
    pub available: usize,
    pub key: &'static str,
}

/// The cores this process may run on, in order.
pub fn allowed_cores() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    unsafe {
        // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it for this process.
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
            return (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect();
        }
    }
    (0..std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1))
        .collect()
}

/// Maps device ids to physical core numbers, refusing ids the process does not have.
pub fn resolve(ids: &[u32], key: &'static str) -> Result<Vec<usize>, NoSuchCore> {
    let cores = allowed_cores();
    ids.iter()
        .map(|&id| {
            cores.get(id as usize).copied().ok_or(NoSuchCore {
                id,
                available: cores.len(),
                key,
            })
        })
        .collect()
}

/// Pins the calling thread to `cores` (physical numbers from [`resolve`]). Best effort: returns
/// false when the OS refuses.
pub fn pin_current_thread(cores: &[usize]) -> bool {
    #[cfg(target_os = "linux")]
    unsafe {
        // SAFETY: as above; sched_setaffinity(0) applies to the calling thread.
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cores {
            libc::CPU_SET(c, &mut set);
        }
        return libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0;
    }
    #[allow(unreachable_code)]
    {
        let _ = cores;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_a_core_the_machine_lacks() {
        let n = allowed_cores().len() as u32;
        assert!(resolve(&[0], "device").is_ok());
        let err = resolve(&[0, n + 5], "visual.device").unwrap_err();
        assert_eq!(err.id, n + 5);
        assert!(err.to_string().contains("visual.device"), "{err}");
    }
}
