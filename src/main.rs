//! The `cairn` binary: the CLI (`src/cli`), on an allocator set for a small box.

/// jemalloc instead of glibc's malloc (issue 16). Draining a backlog of 1M inputs over 100k
/// keys, glibc kept 34 MiB of heap resident at rest around 14 MiB of live data: sled's cache
/// and page versions come and go in small pieces among long-lived ones, and `malloc_trim`
/// can only return whole free pages. jemalloc's size-class slabs keep that churn apart, and
/// it returns freed pages on a timer. Measured with `cargo bench --bench compare` (options
/// below, against glibc with `M_ARENA_MAX=2`, a 256 KiB mmap threshold and trims): peak RSS
/// 82 -> 68-74 MiB, at rest 55 -> 34 MiB, CPU per drained input 24 -> 20 µs. It costs a C
/// build of jemalloc (a C compiler and make, as `ring` already needs the former) and about
/// 0.5 MiB of binary. mimalloc 0.1.52 was tried first (default settings): a quarter less CPU,
/// far more memory (peak 177 MiB, 124 at rest, 67 at rest with 1,000 keys).
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read once before the first allocation. An operator can still
/// override any of them with `_RJEM_MALLOC_CONF` in the environment. Each measured on the
/// backlog run above (peak / at rest / CPU per input; jemalloc's defaults: 110 / 57 MiB /
/// 17.8 µs):
///
/// - `tcache:false`: per-thread caches held 10-16 MiB of freed objects at rest on threads
///   that had gone quiet (tcache on, decay 0: 72-77 / 45-50 MiB), and even small ones
///   (`tcache_max:1024`, 8-16 slots a bin) kept slabs from emptying (87 / 41 MiB);
/// - `tcache_max:4096,tcache_nslots_small_max:32,tcache_nslots_large:4`: the cache the MQTT
///   threads turn on for themselves (`src/alloc.rs`), small objects only and few of each;
/// - `narenas:1`: the agent has one busy thread; more arenas only keep more free pages;
/// - `background_thread:true,dirty_decay_ms:200,muzzy_decay_ms:0`: a jemalloc thread hands
///   freed pages back 200 ms after they are freed, so an idle agent shrinks without
///   allocating. Purging at once instead (`dirty_decay_ms:0`, no thread) kept the same
///   memory for 25.5 µs per input instead of 20: every free paid for its `madvise`.
/// - `slab_sizes:1-1280:1`: objects up to 1,280 bytes come from one-page slabs instead of
///   jemalloc's 1-7 pages a slab. After the drain, 10.4 MB of small objects that live on
///   were spread over 17.3 MB of slabs (jemalloc's statistics, in a build with them on), a
///   few in each, and a slab goes back to the system only once it is empty: the 640-byte
///   class alone held 2,508 objects in 173 slabs of 5 pages. With one-page slabs the same
///   objects took 14.2 MB: at rest 32.6-33.9 -> 30.1-31.2 MiB in three runs each, the peak
///   within the runs' spread; jemalloc's share of the loop's CPU samples rose by about two
///   points (fresh slabs are needed more often). A page does not divide evenly by every
///   class (640 bytes: 6 a page, 256 bytes left over); above 1,280 one-page slabs would
///   waste up to a quarter (1,536 bytes: 2 a page) or more.
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: ConfText = ConfText(
    c"narenas:1,tcache:false,tcache_max:4096,tcache_nslots_small_max:32,tcache_nslots_large:4,background_thread:true,dirty_decay_ms:200,muzzy_decay_ms:0,slab_sizes:1-1280:1".as_ptr(),
);

/// A pointer to a C string, as jemalloc reads `malloc_conf`.
#[repr(transparent)]
struct ConfText(*const std::ffi::c_char);

// SAFETY: it points at a static C string that nothing writes.
unsafe impl Sync for ConfText {}

fn main() {
    std::process::exit(cairn::cli::main());
}
