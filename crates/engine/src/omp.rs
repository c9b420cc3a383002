//! Our attention kernel on llama.cpp's own OpenMP threads.
//!
//! llama.cpp (built with OpenMP) computes each graph split in an OpenMP
//! parallel region; between splits — where grafted attention runs, in the
//! evaluation callback on the calling thread — its worker threads spin,
//! waiting for the next region. A thread pool of our own would then fight
//! them for the cores (on two cores, a third runnable thread halves someone's
//! time). Opening a parallel region of our own from the callback hands the
//! kernel's work to those same spinning workers instead: `GOMP_parallel` is
//! libgomp's entry point for `#pragma omp parallel` (the ABI GCC's generated
//! code calls), and a region opened by the thread that runs llama.cpp's
//! regions reuses its team.

use std::any::Any;
use std::ffi::{c_int, c_uint, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Mutex;

unsafe extern "C" {
    fn GOMP_parallel(
        f: extern "C" fn(*mut c_void),
        data: *mut c_void,
        threads: c_uint,
        flags: c_uint,
    );
    fn omp_get_thread_num() -> c_int;
}

struct Region<'a> {
    job: &'a (dyn Fn(usize) + Sync),
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

extern "C" fn body(data: *mut c_void) {
    // SAFETY: `data` is the `Region` `run` keeps alive until GOMP_parallel
    // returns, which is after every thread of the region has left this body.
    let region = unsafe { &*(data as *const Region<'_>) };
    // SAFETY: a plain libgomp query inside the region.
    let i = unsafe { omp_get_thread_num() }.max(0) as usize;
    // A panic must not unwind into C: kept, and raised after the region.
    if let Err(e) = catch_unwind(AssertUnwindSafe(|| (region.job)(i))) {
        let mut p = region.panic.lock().unwrap_or_else(|p| p.into_inner());
        p.get_or_insert(e);
    }
}

/// A [`siliceo_kernels_turing::Runner`] on libgomp's thread team: `job(i)`
/// for the region's thread `i` (the caller is thread 0), at most `threads`
/// threads (libgomp may give fewer).
pub(crate) fn run(threads: usize, job: &(dyn Fn(usize) + Sync)) {
    if threads <= 1 {
        job(0);
        return;
    }
    let region = Region {
        job,
        panic: Mutex::new(None),
    };
    // SAFETY: libgomp's documented ABI for a parallel region; `region`
    // outlives it (GOMP_parallel returns after the region has ended).
    unsafe {
        GOMP_parallel(
            body,
            &region as *const Region<'_> as *mut c_void,
            threads as c_uint,
            0,
        )
    };
    if let Some(e) = region.panic.into_inner().unwrap_or_else(|p| p.into_inner()) {
        resume_unwind(e);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_thread_runs_the_job_once_and_panics_come_back() {
        let hits: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
        super::run(4, &|i| {
            hits[i].fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits[0].load(Ordering::Relaxed), 1, "the caller runs job(0)");
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) <= 1));
        let r = std::panic::catch_unwind(|| super::run(2, &|i| assert_ne!(i, 1, "thread 1 fails")));
        // libgomp may give one thread only; a panic, when thread 1 ran, comes back.
        if let Err(e) = r {
            let msg = e.downcast_ref::<String>().cloned().unwrap_or_default();
            assert!(msg.contains("thread 1 fails"), "{msg}");
        }
        super::run(2, &|_| {});
    }
}
