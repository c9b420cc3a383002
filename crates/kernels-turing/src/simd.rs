//! The kernel's two inner loops with explicit AVX2/FMA on x86-64 (chosen at
//! run time; portable code elsewhere). Measured, not assumed: the portable
//! versions kept their accumulators in memory (one store-to-load chain per
//! FMA) and ran at a fifth of the memory bandwidth (docs/BENCHMARKS.md).
//!
//! - [`group_scores`]: `out[r][j] = q[r] · k[j]` for the query rows of a GQA
//!   group (each K load serves every row), K from an f32 tile or straight from F16.
//! - [`group_accumulate`]: `acc[r] = acc[r] · corr[r] + Σ_j w[r][j] · v[j]`, likewise.
//! - [`max`], [`exp_sum`]: the online softmax's reductions.
//! - [`k5_row`], [`v4_group`]: the packed codecs' decoders.

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

/// Rows of K or V the group kernels read: an f32 tile, or F16 bytes read and
/// converted in the loop (no tile at all: the F16 format and the F16 tail).
#[derive(Debug, Clone, Copy)]
pub enum Rows<'a> {
    /// `n × d` f32, row-major.
    F32(&'a [f32]),
    /// `n × d` little-endian f16 bytes, row-major.
    F16(&'a [u8]),
    /// KV8 read in the loops: `n × d` int8 codes and the rows' scales as f32
    /// (`n × d/g`), groups of `g = 1 << shift` channels.
    Kv8 {
        /// Codes, row-major.
        codes: &'a [u8],
        /// Scales, `d >> shift` per row.
        scales: &'a [f32],
        /// log2 of the group size.
        shift: u32,
    },
}

impl Rows<'_> {
    fn len_values(&self) -> usize {
        match self {
            Rows::F32(x) => x.len(),
            Rows::F16(b) => b.len() / 2,
            Rows::Kv8 { codes, .. } => codes.len(),
        }
    }
    fn get(&self, j: usize, c: usize, d: usize) -> f32 {
        let i = j * d + c;
        match self {
            Rows::F32(x) => x[i],
            Rows::F16(b) => half::f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32(),
            Rows::Kv8 {
                codes,
                scales,
                shift,
            } => codes[i] as i8 as f32 * scales[j * (d >> shift) + (c >> shift)],
        }
    }
}

/// Calls `f(first_row, rows)` for consecutive groups of at most 4 query rows
/// (the x86 kernels keep 4 rows' accumulators in registers).
#[cfg(target_arch = "x86_64")]
fn for_row_groups(rows: usize, mut f: impl FnMut(usize, usize)) {
    let mut r = 0;
    while r < rows {
        let take = (rows - r).min(4);
        f(r, take);
        r += take;
    }
}

/// `path::func::<R>(args)` with `R` = `take` (1..=4) as a const generic.
#[cfg(target_arch = "x86_64")]
macro_rules! by_rows {
    ($take:expr, $($f:ident)::+ ($($arg:expr),*)) => {
        match $take {
            4 => $($f)::+::<4>($($arg),*),
            3 => $($f)::+::<3>($($arg),*),
            2 => $($f)::+::<2>($($arg),*),
            _ => $($f)::+::<1>($($arg),*),
        }
    };
}

/// Scores of a group of query rows that share K rows:
/// `out[r·n + j] = q[r] · k[j]` for `r < rows`, `j < n`.
pub fn group_scores(q: &[f32], rows: usize, k: Rows<'_>, n: usize, d: usize, out: &mut [f32]) {
    assert!(
        q.len() >= rows * d
            && k.len_values() >= n * d
            && out.len() >= rows * n
            && d.is_multiple_of(8)
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        for_row_groups(rows, |r, take| {
            let (qs, os) = (&q[r * d..], &mut out[r * n..]);
            // SAFETY: AVX2/FMA/F16C checked; the bounds above cover every access.
            unsafe { by_rows!(take, x86::group_scores(qs, k, n, d, os)) }
        });
        return;
    }
    for r in 0..rows {
        for j in 0..n {
            out[r * n + j] = (0..d).map(|c| q[r * d + c] * k.get(j, c, d)).sum();
        }
    }
}

/// `acc[r] = acc[r] · corr[r] + Σ_j w[r·n + j] · v[j]` for a group of rows
/// sharing V rows (`acc` is `rows × d`).
pub fn group_accumulate(acc: &mut [f32], corr: &[f32], w: &[f32], v: Rows<'_>, n: usize, d: usize) {
    let rows = corr.len();
    assert!(
        acc.len() >= rows * d
            && w.len() >= rows * n
            && v.len_values() >= n * d
            && d.is_multiple_of(8)
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        for_row_groups(rows, |r, take| {
            let (a, c, ws) = (&mut acc[r * d..], &corr[r..r + take], &w[r * n..]);
            // SAFETY: as in `group_scores`.
            unsafe { by_rows!(take, x86::group_accumulate(a, c, ws, v, n, d)) }
        });
        return;
    }
    for r in 0..rows {
        for c in 0..d {
            let mut a = acc[r * d + c] * corr[r];
            for j in 0..n {
                a += w[r * n + j] * v.get(j, c, d);
            }
            acc[r * d + c] = a;
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx2_fma() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        std::env::var_os("SILICEO_KERNELS_PORTABLE").is_none()
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Rows;

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

    /// Eight K/V values of row `j` from channel `c`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load8(rows: Rows<'_>, j: usize, c: usize, d: usize) -> __m256 {
        let off = j * d + c;
        // SAFETY: the caller keeps `off + 8` within the rows (and, for KV8,
        // the group of channel c within row j's scales).
        unsafe {
            match rows {
                Rows::F32(x) => _mm256_loadu_ps(x.as_ptr().add(off)),
                Rows::F16(b) => _mm256_cvtph_ps(_mm_loadu_si128(b.as_ptr().add(2 * off).cast())),
                Rows::Kv8 {
                    codes,
                    scales,
                    shift,
                } => {
                    let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                        codes.as_ptr().add(off).cast(),
                    )));
                    let s = *scales.get_unchecked(j * (d >> shift) + (c >> shift));
                    _mm256_mul_ps(q, _mm256_set1_ps(s))
                }
            }
        }
    }

    /// R query rows × 2 tokens in 2R accumulators: each K load serves R rows,
    /// each Q load 2 tokens.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group_scores<const R: usize>(
        q: &[f32],
        k: Rows<'_>,
        n: usize,
        d: usize,
        out: &mut [f32],
    ) {
        let qp = q.as_ptr();
        let mut j = 0;
        // SAFETY: rows r < R of q (R·d values), tokens j < n of k (n·d), and
        // out[r·n + j] are inside the slices (checked by the caller).
        unsafe {
            while j + 2 <= n {
                let mut a = [[_mm256_setzero_ps(); 2]; R];
                let mut c = 0;
                while c < d {
                    let k0 = load8(k, j, c, d);
                    let k1 = load8(k, j + 1, c, d);
                    for (r, a) in a.iter_mut().enumerate() {
                        let qv = _mm256_loadu_ps(qp.add(r * d + c));
                        a[0] = _mm256_fmadd_ps(qv, k0, a[0]);
                        a[1] = _mm256_fmadd_ps(qv, k1, a[1]);
                    }
                    c += 8;
                }
                for (r, a) in a.iter().enumerate() {
                    out[r * n + j] = hsum8(a[0]);
                    out[r * n + j + 1] = hsum8(a[1]);
                }
                j += 2;
            }
            if j < n {
                let mut a = [_mm256_setzero_ps(); R];
                let mut c = 0;
                while c < d {
                    let k0 = load8(k, j, c, d);
                    for (r, a) in a.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(r * d + c)), k0, *a);
                    }
                    c += 8;
                }
                for (r, a) in a.iter().enumerate() {
                    out[r * n + j] = hsum8(*a);
                }
            }
        }
    }

    /// 16 channels × R rows in 2R accumulators across all tokens: each V load
    /// serves R rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group_accumulate<const R: usize>(
        acc: &mut [f32],
        corr: &[f32],
        w: &[f32],
        v: Rows<'_>,
        n: usize,
        d: usize,
    ) {
        let ap = acc.as_mut_ptr();
        // SAFETY: channels c + 16 ≤ d (d % 8 == 0: the tail step is 8), rows
        // r < R of acc (R·d) and w (R·n), tokens j < n of v: checked by the caller.
        unsafe {
            let mut c = 0;
            while c + 16 <= d {
                let mut a = [[_mm256_setzero_ps(); 2]; R];
                for (r, a) in a.iter_mut().enumerate() {
                    let cv = _mm256_set1_ps(corr[r]);
                    a[0] = _mm256_mul_ps(_mm256_loadu_ps(ap.add(r * d + c)), cv);
                    a[1] = _mm256_mul_ps(_mm256_loadu_ps(ap.add(r * d + c + 8)), cv);
                }
                for j in 0..n {
                    let v0 = load8(v, j, c, d);
                    let v1 = load8(v, j, c + 8, d);
                    for (r, a) in a.iter_mut().enumerate() {
                        let wv = _mm256_set1_ps(*w.get_unchecked(r * n + j));
                        a[0] = _mm256_fmadd_ps(wv, v0, a[0]);
                        a[1] = _mm256_fmadd_ps(wv, v1, a[1]);
                    }
                }
                for (r, a) in a.iter().enumerate() {
                    _mm256_storeu_ps(ap.add(r * d + c), a[0]);
                    _mm256_storeu_ps(ap.add(r * d + c + 8), a[1]);
                }
                c += 16;
            }
            if c < d {
                let mut a = [_mm256_setzero_ps(); R];
                for (r, a) in a.iter_mut().enumerate() {
                    *a = _mm256_mul_ps(_mm256_loadu_ps(ap.add(r * d + c)), _mm256_set1_ps(corr[r]));
                }
                for j in 0..n {
                    let v0 = load8(v, j, c, d);
                    for (r, a) in a.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(_mm256_set1_ps(*w.get_unchecked(r * n + j)), v0, *a);
                    }
                }
                for (r, a) in a.iter().enumerate() {
                    _mm256_storeu_ps(ap.add(r * d + c), *a);
                }
            }
        }
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
                    // e = d/8 is a power of two for the usual head sizes:
                    // shifts instead of two integer divisions per 8 channels.
                    let (plane, idx) = if e.is_power_of_two() {
                        (c >> e.trailing_zeros(), c & (e - 1))
                    } else {
                        (c / e, c % e)
                    };
                    let hb = _mm256_srl_epi32(
                        u8x8(h.as_ptr().add(idx)),
                        _mm_cvtsi32_si128(plane as i32),
                    );
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
    fn group_kernels_match_plain_loops_for_f32_and_f16_rows() {
        for (rows, n, d) in [(1, 5, 8), (3, 16, 64), (4, 17, 128), (6, 9, 24), (8, 2, 72)] {
            let q: Vec<f32> = (0..rows * d).map(|i| (i as f32 * 0.37).sin()).collect();
            let kf: Vec<f32> = (0..n * d)
                .map(|i| half::f16::from_f32((i as f32 * 0.11).cos()).to_f32())
                .collect();
            let kh: Vec<u8> = kf
                .iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect();
            // KV8 rows: codes and per-8-channel scales whose product is kf'.
            let codes: Vec<u8> = (0..n * d)
                .map(|i| ((i * 37 % 255) as i32 - 127) as i8 as u8)
                .collect();
            let scales: Vec<f32> = (0..n * d / 8).map(|i| 0.01 + i as f32 * 0.001).collect();
            let k8: Vec<f32> = (0..n * d)
                .map(|i| codes[i] as i8 as f32 * scales[(i / d) * (d / 8) + (i % d) / 8])
                .collect();
            let kv8 = Rows::Kv8 {
                codes: &codes,
                scales: &scales,
                shift: 3,
            };
            for (k, kf) in [(Rows::F32(&kf), &kf), (Rows::F16(&kh), &kf), (kv8, &k8)] {
                let mut out = vec![0f32; rows * n];
                group_scores(&q, rows, k, n, d, &mut out);
                for r in 0..rows {
                    for j in 0..n {
                        let want: f32 = (0..d).map(|c| q[r * d + c] * kf[j * d + c]).sum();
                        assert!(
                            (out[r * n + j] - want).abs() < 1e-4,
                            "rows={rows} d={d} [{r}][{j}]"
                        );
                    }
                }
                let w: Vec<f32> = (0..rows * n).map(|i| (i % 7) as f32 / 7.0).collect();
                let corr: Vec<f32> = (0..rows).map(|r| 0.5 + r as f32 / 10.0).collect();
                let mut acc: Vec<f32> = (0..rows * d).map(|i| i as f32 / 100.0).collect();
                let mut want = acc.clone();
                group_accumulate(&mut acc, &corr, &w, k, n, d);
                for r in 0..rows {
                    for c in 0..d {
                        want[r * d + c] = want[r * d + c] * corr[r]
                            + (0..n).map(|j| w[r * n + j] * kf[j * d + c]).sum::<f32>();
                    }
                }
                for (a, b) in acc.iter().zip(&want) {
                    assert!(
                        (a - b).abs() < 1e-4 * (1.0 + b.abs()),
                        "rows={rows} d={d}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn softmax_reductions_match_std() {
        for n in [1, 7, 16, 19, 64] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.7).collect();
            let m = max(&x);
            assert_eq!(m, x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)));
            let mut e = x.clone();
            let sum = exp_sum(&mut e, m);
            let want_sum: f32 = x.iter().map(|v| (v - m).exp()).sum();
            assert!(
                (sum - want_sum).abs() < 1e-5 * want_sum,
                "{sum} vs {want_sum}"
            );
            for (a, v) in e.iter().zip(&x) {
                assert!((a - (v - m).exp()).abs() < 1e-6, "{a} vs e^({v} - {m})");
            }
        }
    }
}
