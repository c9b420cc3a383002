//! The worker threads of [`crate::paged_attention`]: started on first use,
//! kept parked between calls (a decode step calls the kernel once per layer,
//! and starting threads per call cost more than a short context's whole
//! attention), shared by every caller in the process.
//!
//! [`run`] hands one job to the caller's thread and up to `threads − 1`
//! workers and returns when all of them have finished it. Calls from several
//! threads at once take turns (each still gets its `threads`); a job that
//! panics on any thread panics the caller once every thread has stopped.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};

/// A job as the workers see it: the caller's closure with its lifetime
/// erased. Sound because [`run`] does not return (or unwind) before every
/// worker that took the job has stopped touching it.
#[derive(Clone, Copy)]
struct Job(*const (dyn Fn(usize) + Sync + 'static));

// SAFETY: the pointee is `Sync`, and it outlives every use (see `Job`).
unsafe impl Send for Job {}

struct State {
    /// Bumped per job; a worker takes each generation at most once.
    generation: u64,
    job: Option<Job>,
    /// Workers the current job still wants.
    wanted: usize,
    /// Workers that took the current job (their indices are 1..=taken).
    taken: usize,
    /// Workers that took the current job and have not finished it.
    running: usize,
    /// The first panic of the current job on a worker.
    panic: Option<Box<dyn Any + Send>>,
    /// Workers started so far.
    workers: usize,
}

struct Pool {
    state: Mutex<State>,
    /// Workers wait here for a job.
    work: Condvar,
    /// The caller waits here for its workers.
    done: Condvar,
    /// Held for a whole job: concurrent callers take turns.
    turn: Mutex<()>,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        state: Mutex::new(State {
            generation: 0,
            job: None,
            wanted: 0,
            taken: 0,
            running: 0,
            panic: None,
            workers: 0,
        }),
        work: Condvar::new(),
        done: Condvar::new(),
        turn: Mutex::new(()),
    })
}

/// The lock, whatever a panicking holder left behind (the state is only
/// changed in small steps that cannot panic).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `job(0)` on the calling thread and `job(1)`, `job(2)`, … (up to
/// `threads − 1` of them) on pool workers, and returns when all have
/// returned. Workers that have not woken up by the time `job(0)` returns are
/// not waited for and skip the job, so the job must share its work out
/// itself (an atomic counter over work items): the index only names the
/// thread, and each index runs at most once.
pub(crate) fn run(threads: usize, job: &(dyn Fn(usize) + Sync)) {
    let helpers = threads.saturating_sub(1);
    if helpers == 0 {
        job(0);
        return;
    }
    let p = pool();
    let _turn = lock(&p.turn);
    {
        let mut s = lock(&p.state);
        while s.workers < helpers {
            let id = s.workers;
            let started = std::thread::Builder::new()
                .name(format!("siliceo-attn-{id}"))
                .spawn(move || worker(p));
            if started.is_err() {
                break; // run with the workers there are
            }
            s.workers += 1;
        }
        // SAFETY: only the lifetime is erased; see `Job`.
        let erased: &(dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(job) };
        s.generation += 1;
        s.job = Some(Job(erased));
        s.wanted = helpers.min(s.workers);
        s.taken = 0;
        s.running = 0;
        s.panic = None;
    }
    p.work.notify_all();
    let mine = catch_unwind(AssertUnwindSafe(|| job(0)));
    let theirs = {
        let mut s = lock(&p.state);
        // Nobody may take the job from here on; wait for those who did.
        s.wanted = 0;
        while s.running > 0 {
            s = p.done.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        s.job = None;
        s.panic.take()
    };
    if let Err(e) = mine {
        resume_unwind(e);
    }
    if let Some(e) = theirs {
        resume_unwind(e);
    }
}

fn worker(p: &'static Pool) {
    let mut seen = 0u64;
    let mut s = lock(&p.state);
    loop {
        if s.generation != seen && s.wanted > 0 {
            seen = s.generation;
            s.wanted -= 1;
            s.taken += 1;
            s.running += 1;
            let job = s.job.expect("a wanted job is set");
            let id = s.taken;
            drop(s);
            // SAFETY: the caller waits for `running` to drop to zero before
            // the job goes out of scope.
            let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*job.0)(id) }));
            s = lock(&p.state);
            if let Err(e) = r {
                s.panic.get_or_insert(e);
            }
            s.running -= 1;
            if s.running == 0 {
                p.done.notify_all();
            }
        } else {
            seen = s.generation;
            s = p.work.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn all_work_is_done_and_each_index_runs_at_most_once() {
        for threads in [1, 2, 3, 5] {
            for _ in 0..50 {
                let hits: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
                let next = AtomicUsize::new(0);
                let done: Vec<AtomicUsize> = (0..100).map(|_| AtomicUsize::new(0)).collect();
                run(threads, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        if k >= done.len() {
                            break;
                        }
                        done[k].fetch_add(1, Ordering::Relaxed);
                    }
                });
                assert!(done.iter().all(|d| d.load(Ordering::Relaxed) == 1));
                assert_eq!(hits[0].load(Ordering::Relaxed), 1, "the caller runs job(0)");
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) <= 1));
            }
        }
    }

    /// Runs `run(threads, job)` where `job(0)` returns only once `n` workers
    /// have started (so they cannot be skipped).
    fn run_with_workers(threads: usize, n: usize, job: &(dyn Fn(usize) + Sync)) {
        let started = AtomicUsize::new(0);
        run(threads, &|i| {
            if i > 0 {
                started.fetch_add(1, Ordering::SeqCst);
            } else {
                while started.load(Ordering::SeqCst) < n {
                    std::thread::yield_now();
                }
            }
            job(i)
        });
    }

    #[test]
    fn workers_are_waited_for_and_callers_take_turns() {
        let sum = AtomicUsize::new(0);
        std::thread::scope(|sc| {
            for _ in 0..4 {
                sc.spawn(|| {
                    for _ in 0..100 {
                        run_with_workers(3, 2, &|i| {
                            std::thread::yield_now();
                            sum.fetch_add(i + 1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(sum.load(Ordering::Relaxed), 4 * 100 * (1 + 2 + 3));
    }

    #[test]
    fn a_panicking_worker_panics_the_caller_and_the_pool_keeps_working() {
        let r = catch_unwind(|| run_with_workers(3, 2, &|i| assert_eq!(i, 0, "a worker fails")));
        let msg = r.expect_err("the caller sees the panic");
        let text = msg.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(text.contains("a worker fails"), "{text}");
        let n = AtomicUsize::new(0);
        run_with_workers(3, 2, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 3);
    }
}
