//! The machine's memory read bandwidth, measured by summing a buffer much
//! larger than the caches with `threads` threads (each over its own slice,
//! vectorised with independent lanes as the kernel's loads are).

use std::time::Instant;

/// Reads `bytes` of memory `reps` times with `threads` threads and returns
/// the median bandwidth in bytes per second.
pub fn read_bandwidth(bytes: usize, threads: usize, reps: usize) -> f64 {
    let n = (bytes / 4).max(1024);
    let buf: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let threads = threads.max(1);
    let chunk = n.div_ceil(threads);
    let mut rates = Vec::with_capacity(reps);
    let mut sink = 0f32;
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        let sums: Vec<f32> = std::thread::scope(|sc| {
            let hs: Vec<_> = buf
                .chunks(chunk)
                .map(|c| sc.spawn(move || sum(c)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("bandwidth worker"))
                .collect()
        });
        let dt = t0.elapsed().as_secs_f64();
        sink += sums.iter().sum::<f32>();
        rates.push((n * 4) as f64 / dt);
    }
    std::hint::black_box(sink);
    rates.sort_by(f64::total_cmp);
    rates[rates.len() / 2]
}

fn sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; 32];
    let c = x.chunks_exact(32);
    let r = c.remainder().iter().sum::<f32>();
    for v in c {
        for i in 0..32 {
            acc[i] += v[i];
        }
    }
    acc.iter().sum::<f32>() + r
}
