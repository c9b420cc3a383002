//! The kernel's two inner loops with explicit AVX2/FMA on x86-64 (chosen at
//! run time; portable code elsewhere). Measured, not assumed: the portable
//! versions kept their accumulators in memory (one store-to-load chain per
//! FMA) and ran at a fifth of the memory bandwidth (docs/BENCHMARKS.md).
//!
//! - [`scores`]: `out[j] = q · k[j]` for the rows of a K tile.
//! - [`accumulate`]: `acc = acc · corr + Σ_j w[j] · v[j]` over the rows of a V tile.
//! - [`max`], [`exp_sum`]: the online softmax's reductions.
//! - [`k5_row`], [`v4_group`]: the packed codecs' decoders.

/// `out[j] = q · k[j·d .. (j+1)·d]` for `j < out.len()`.
#[inline]
pub fn scores(q: &[f32], k: &[f32], d: usize, out: &mut [f32]) {
    assert!(q.len() >= d && k.len() >= out.len() * d && d.is_multiple_of(8));
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked), and the bounds above
        // cover every load and store the function makes.
        unsafe { x86::scores(q, k, d, out) };
        return;
    }
    for (j, o) in out.iter_mut().enumerate() {
        *o = portable_dot(q, &k[j * d..(j + 1) * d]);
    }
}

/// `acc = acc · corr + Σ_j w[j] · v[j·d .. (j+1)·d]`.
#[inline]
pub fn accumulate(acc: &mut [f32], corr: f32, w: &[f32], v: &[f32], d: usize) {
    assert!(acc.len() == d && v.len() >= w.len() * d && d.is_multiple_of(8));
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: as in `scores`.
        unsafe { x86::accumulate(acc, corr, w, v, d) };
        return;
    }
    for a in acc.iter_mut() {
        *a *= corr;
    }
    for (j, &wj) in w.iter().enumerate() {
        for (a, x) in acc.iter_mut().zip(&v[j * d..(j + 1) * d]) {
            *a = x.mul_add(wj, *a);
        }
    }
}

/// The largest value of `x` (−∞ when empty).
#[inline]
pub fn max(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 checked; the function reads only inside `x`.
        return unsafe { x86::max(x) };
    }
    x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// `x[i] = e^(x[i] − m)` for every element; returns their sum.
#[inline]
pub fn exp_sum(x: &mut [f32], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA checked; the function touches only `x`.
        return unsafe { x86::exp_sum(x, m) };
    }
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = crate::attention::fast_exp(*v - m);
        sum += *v;
    }
    sum
}

/// Decodes one K5 row: `n` (D/2 bytes of low nibbles), `h` (D/8 bytes of
/// fifth bits), per-channel `scale` and `min` (see [`crate::codec`]).
#[inline]
pub fn k5_row(n: &[u8], h: &[u8], scale: &[f32], min: &[f32], out: &mut [f32]) {
    let d = out.len();
    assert!(n.len() == d / 2 && h.len() == d / 8 && scale.len() == d && min.len() == d);
    #[cfg(target_arch = "x86_64")]
    if d.is_multiple_of(64) && has_avx2_fma() {
        // SAFETY: AVX2 checked; lengths checked above; d/8 is a multiple of 8.
        unsafe { x86::k5_row(n, h, scale, min, out) };
        return;
    }
    let (half, e) = (d / 2, d / 8);
    for c in 0..d {
        let lo = (n[c % half] >> (c / half * 4)) & 0xF;
        let hb = (h[c % e] >> (c / e)) & 1;
        out[c] = scale[c].mul_add((lo | (hb << 4)) as f32, min[c]);
    }
}

/// Decodes one V4 group: `n` (g/2 bytes: channel j low nibble, j + g/2 high).
#[inline]
pub fn v4_group(n: &[u8], scale: f32, min: f32, out: &mut [f32]) {
    let g = out.len();
    assert!(n.len() == g / 2);
    #[cfg(target_arch = "x86_64")]
    if g.is_multiple_of(16) && has_avx2_fma() {
        // SAFETY: AVX2 checked; g/2 is a multiple of 8 and the lengths match.
        unsafe { x86::v4_group(n, scale, min, out) };
        return;
    }
    let (lo, hi) = out.split_at_mut(g / 2);
    for ((l, h), b) in lo.iter_mut().zip(hi.iter_mut()).zip(n) {
        *l = scale.mul_add((b & 0xF) as f32, min);
        *h = scale.mul_add((b >> 4) as f32, min);
    }
}

fn portable_dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

#[cfg(target_arch = "x86_64")]
fn has_avx2_fma() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        std::env::var_os("SILICEO_KERNELS_PORTABLE").is_none()
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Eight tokens at a time: one Q load serves eight K rows, eight FMA chains
    /// run side by side, and one transpose-and-add turns the eight
    /// accumulators into eight scores.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores(q: &[f32], k: &[f32], d: usize, out: &mut [f32]) {
        let n = out.len();
        let (qp, kp, op) = (q.as_ptr(), k.as_ptr(), out.as_mut_ptr());
        let mut j = 0;
        // SAFETY (all pointer arithmetic below): rows j..j+8 < n and channels
        // c..c+8 ≤ d are inside `k` (n·d values) and `q` (d values); the
        // caller checked those lengths.
        unsafe {
            while j + 8 <= n {
                let mut a = [_mm256_setzero_ps(); 8];
                let mut c = 0;
                while c < d {
                    let qv = _mm256_loadu_ps(qp.add(c));
                    for (t, a) in a.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp.add((j + t) * d + c)), *a);
                    }
                    c += 8;
                }
                _mm256_storeu_ps(op.add(j), hsum8x8(a));
                j += 8;
            }
            while j < n {
                let mut a = _mm256_setzero_ps();
                let mut c = 0;
                while c < d {
                    a = _mm256_fmadd_ps(
                        _mm256_loadu_ps(qp.add(c)),
                        _mm256_loadu_ps(kp.add(j * d + c)),
                        a,
                    );
                    c += 8;
                }
                *op.add(j) = hsum8(a);
                j += 1;
            }
        }
    }

    /// 64 channels at a time in eight registers (eight independent FMA
    /// chains) across all the tokens; then 8 at a time for the rest.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn accumulate(acc: &mut [f32], corr: f32, w: &[f32], v: &[f32], d: usize) {
        let (ap, vp) = (acc.as_mut_ptr(), v.as_ptr());
        let cv = _mm256_set1_ps(corr);
        let mut c = 0;
        // SAFETY: channels c..c+64 (or c+8) ≤ d lie inside `acc` (d values)
        // and rows j < w.len() inside `v` (w.len()·d values), checked by the caller.
        unsafe {
            while c + 64 <= d {
                let mut a = [_mm256_setzero_ps(); 8];
                for (u, a) in a.iter_mut().enumerate() {
                    *a = _mm256_mul_ps(_mm256_loadu_ps(ap.add(c + 8 * u)), cv);
                }
                for (j, &wj) in w.iter().enumerate() {
                    let wv = _mm256_set1_ps(wj);
                    let row = vp.add(j * d + c);
                    for (u, a) in a.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(row.add(8 * u)), *a);
                    }
                }
                for (u, a) in a.iter().enumerate() {
                    _mm256_storeu_ps(ap.add(c + 8 * u), *a);
                }
                c += 64;
            }
            while c < d {
                let mut a = _mm256_mul_ps(_mm256_loadu_ps(ap.add(c)), cv);
                for (j, &wj) in w.iter().enumerate() {
                    a = _mm256_fmadd_ps(_mm256_set1_ps(wj), _mm256_loadu_ps(vp.add(j * d + c)), a);
                }
                _mm256_storeu_ps(ap.add(c), a);
                c += 8;
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn max(x: &[f32]) -> f32 {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        let c = x.chunks_exact(8);
        let rest = c
            .remainder()
            .iter()
            .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        for v in c {
            // SAFETY: `v` holds 8 values.
            m = _mm256_max_ps(m, unsafe { _mm256_loadu_ps(v.as_ptr()) });
        }
        let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_max_ss(h, _mm_shuffle_ps::<1>(h, h));
        _mm_cvtss_f32(h).max(rest)
    }

    /// `fast_exp` eight lanes at a time (same constants, same result to rounding).
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        let x = _mm256_min_ps(
            _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
            _mm256_set1_ps(88.0),
        );
        let n = _mm256_floor_ps(_mm256_fmadd_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
            _mm256_set1_ps(0.5),
        ));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
        let mut p = _mm256_set1_ps(1.0 / 5040.0);
        for c in [
            1.0 / 720.0,
            1.0 / 120.0,
            1.0 / 24.0,
            1.0 / 6.0,
            0.5,
            1.0,
            1.0,
        ] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(p, _mm256_castsi256_ps(e))
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sum(x: &mut [f32], m: f32) -> f32 {
        let mv = _mm256_set1_ps(m);
        let mut sum = _mm256_setzero_ps();
        let mut c = x.chunks_exact_mut(8);
        for v in &mut c {
            // SAFETY: `v` holds 8 values.
            unsafe {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(v.as_ptr()), mv));
                _mm256_storeu_ps(v.as_mut_ptr(), e);
                sum = _mm256_add_ps(sum, e);
            }
        }
        let mut rest = 0.0;
        for v in c.into_remainder() {
            *v = crate::attention::fast_exp(*v - m);
            rest += *v;
        }
        hsum8(sum) + rest
    }

    /// Eight bytes at `p`, zero-extended to eight 32-bit lanes.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn u8x8(p: *const u8) -> __m256i {
        // SAFETY: the caller guarantees 8 readable bytes at `p`.
        _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(p.cast()) })
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn k5_row(n: &[u8], h: &[u8], scale: &[f32], min: &[f32], out: &mut [f32]) {
        let d = out.len();
        let (half, e) = (d / 2, d / 8);
        let mask = _mm256_set1_epi32(0xF);
        let one = _mm256_set1_epi32(1);
        // SAFETY: every index below is < d (channels), < d/2 (n) or < d/8 (h),
        // in steps of 8 that divide those lengths (d % 64 == 0).
        unsafe {
            for j in (0..half).step_by(8) {
                let b = u8x8(n.as_ptr().add(j));
                for (c, nib) in [
                    (j, _mm256_and_si256(b, mask)),
                    (j + half, _mm256_srli_epi32::<4>(b)),
                ] {
                    let plane = (c / e) as i32;
                    let hb =
                        _mm256_srl_epi32(u8x8(h.as_ptr().add(c % e)), _mm_cvtsi32_si128(plane));
                    let code =
                        _mm256_or_si256(nib, _mm256_slli_epi32::<4>(_mm256_and_si256(hb, one)));
                    let v = _mm256_fmadd_ps(
                        _mm256_loadu_ps(scale.as_ptr().add(c)),
                        _mm256_cvtepi32_ps(code),
                        _mm256_loadu_ps(min.as_ptr().add(c)),
                    );
                    _mm256_storeu_ps(out.as_mut_ptr().add(c), v);
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn v4_group(n: &[u8], scale: f32, min: f32, out: &mut [f32]) {
        let half = out.len() / 2;
        let (s, m) = (_mm256_set1_ps(scale), _mm256_set1_ps(min));
        let mask = _mm256_set1_epi32(0xF);
        // SAFETY: j + 8 ≤ half = n.len(), and j + half + 8 ≤ out.len().
        unsafe {
            for j in (0..half).step_by(8) {
                let b = u8x8(n.as_ptr().add(j));
                let lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
                let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(b));
                _mm256_storeu_ps(out.as_mut_ptr().add(j), _mm256_fmadd_ps(s, lo, m));
                _mm256_storeu_ps(out.as_mut_ptr().add(j + half), _mm256_fmadd_ps(s, hi, m));
            }
        }
    }

    /// Lane `t` of the result is the sum of the lanes of `a[t]`.
    #[target_feature(enable = "avx2,fma")]
    fn hsum8x8(a: [__m256; 8]) -> __m256 {
        let t0 = _mm256_hadd_ps(a[0], a[1]);
        let t1 = _mm256_hadd_ps(a[2], a[3]);
        let t2 = _mm256_hadd_ps(a[4], a[5]);
        let t3 = _mm256_hadd_ps(a[6], a[7]);
        let u0 = _mm256_hadd_ps(t0, t1);
        let u1 = _mm256_hadd_ps(t2, t3);
        let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
        let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
        _mm256_add_ps(lo, hi)
    }

    #[target_feature(enable = "avx2,fma")]
    fn hsum8(a: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simd_and_portable_agree() {
        for d in [8, 24, 64, 72, 128] {
            let n = 19;
            let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin()).collect();
            let k: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.11).cos()).collect();
            let mut got = vec![0f32; n];
            scores(&q, &k, d, &mut got);
            for j in 0..n {
                let want: f32 = q
                    .iter()
                    .zip(&k[j * d..(j + 1) * d])
                    .map(|(a, b)| a * b)
                    .sum();
                assert!(
                    (got[j] - want).abs() < 1e-4,
                    "d={d} j={j}: {} vs {want}",
                    got[j]
                );
            }
            let mut e = got.clone();
            let m = max(&got);
            assert_eq!(m, got.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)));
            let sum = exp_sum(&mut e, m);
            let want_sum: f32 = got.iter().map(|x| (x - m).exp()).sum();
            assert!(
                (sum - want_sum).abs() < 1e-5 * want_sum,
                "{sum} vs {want_sum}"
            );
            for (a, x) in e.iter().zip(&got) {
                assert!((a - (x - m).exp()).abs() < 1e-6, "{a} vs e^({x} - {m})");
            }
            let w: Vec<f32> = (0..n).map(|j| j as f32 / n as f32).collect();
            let mut acc: Vec<f32> = (0..d).map(|c| c as f32).collect();
            let mut want = acc.clone();
            accumulate(&mut acc, 0.5, &w, &k, d);
            for (c, x) in want.iter_mut().enumerate() {
                *x = *x * 0.5 + (0..n).map(|j| w[j] * k[j * d + c]).sum::<f32>();
            }
            for (a, b) in acc.iter().zip(&want) {
                assert!((a - b).abs() < 1e-4, "d={d}: {a} vs {b}");
            }
        }
    }
}
