//! A per-thread allocation cache for the MQTT threads only (issue 16).
//!
//! The binary runs on jemalloc with its thread caches off (`src/main.rs`: on every thread
//! they held 10-16 MiB of freed objects at rest after a backlog). But then every allocation
//! and free takes the one arena's lock, and the MQTT thread allocates and frees for every
//! packet it reads or writes, against the agent loop's own traffic on the same lock. So that
//! thread turns a small cache on for itself (slots per size class set in `src/main.rs`) and
//! hands back what it holds when the agent goes idle ([`crate::mqtt::Mqtt::rest`]).
//!
//! Measured (`benches/compare/`, backlog of 1M over 100k keys, then 10 s idle): with a
//! cache on the MQTT thread, RSS at rest 31.4-33.6 MiB against 32.3 without (the spread of
//! runs), CPU per drained input 19.4-22.3 µs against 25.5, and flat out the MQTT thread's
//! CPU per event 17-18.7 -> 15.3-16.2 µs. The agent loop keeps none: with a cache there
//! too, CPU per drained input fell to 20.8 µs but RSS at rest rose to 37.4 MiB even after a
//! flush, because objects that live on (state, the ledger's index, sled's pages) were placed
//! in the slots just freed, spread over slabs that would otherwise have emptied and gone
//! back to the system.
//!
//! Calls go to jemalloc's control interface. Where jemalloc is not the global allocator (the
//! library's tests) they change jemalloc's state for a thread that never allocates from it:
//! harmless.

use std::ffi::CStr;

/// Turn this thread's allocation cache on (or off).
pub fn cache_this_thread(on: bool) {
    let mut value = on;
    // SAFETY: "thread.tcache.enabled" takes a `bool` to write; nothing is read back.
    let r = unsafe {
        tikv_jemalloc_sys::mallctl(
            c"thread.tcache.enabled".as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            (&raw mut value).cast(),
            std::mem::size_of::<bool>(),
        )
    };
    note(c"thread.tcache.enabled", r);
}

/// Give back what this thread's cache holds (nothing when it is off).
pub fn flush_this_thread() {
    // SAFETY: "thread.tcache.flush" takes and returns nothing.
    let r = unsafe {
        tikv_jemalloc_sys::mallctl(
            c"thread.tcache.flush".as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        )
    };
    note(c"thread.tcache.flush", r);
}

/// A refusal costs only speed or memory, never correctness: say so at debug level.
fn note(name: &CStr, r: std::ffi::c_int) {
    if r != 0 {
        log::debug!("jemalloc refused {name:?}: error {r}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jemalloc_takes_both_controls() {
        // Run on a thread of its own: the setting is per thread.
        std::thread::spawn(|| {
            let enabled = || {
                let mut on = false;
                let mut len = std::mem::size_of::<bool>();
                // SAFETY: reads a `bool` into `on`, whose size `len` says.
                let r = unsafe {
                    tikv_jemalloc_sys::mallctl(
                        c"thread.tcache.enabled".as_ptr(),
                        (&raw mut on).cast(),
                        &raw mut len,
                        std::ptr::null_mut(),
                        0,
                    )
                };
                assert_eq!(r, 0, "jemalloc reads thread.tcache.enabled");
                on
            };
            for on in [false, true, false, true] {
                cache_this_thread(on);
                assert_eq!(enabled(), on, "the cache follows the setting");
                flush_this_thread();
            }
        })
        .join()
        .expect("the thread");
    }
}
