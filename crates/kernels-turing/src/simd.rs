//! The kernel's two inner loops with explicit AVX2/FMA on x86-64 (chosen at
//! run time; portable code elsewhere), and AVX-512 (F, BW, VNNI) versions
//! where the CPU has them. Measured, not assumed: the portable versions kept
//! their accumulators in memory (one store-to-load chain per FMA) and ran at a
//! fifth of the memory bandwidth (docs/BENCHMARKS.md).
//!
//! - [`group_scores`]: `out[r][j] = q[r] · k[j]` for the query rows of a GQA
//!   group (each K load serves every row), K from an f32 tile or straight from F16.
//! - [`group_accumulate`]: `acc[r] = acc[r] · corr[r] + Σ_j w[r][j] · v[j]`, likewise.
//! - [`max`], [`exp_sum`]: the online softmax's reductions.
//! - [`k5_row`], [`v4_group`]: the packed codecs' decoders.
//!
//! Both group kernels take `ahead`: bytes a later call will read (a later KV
//! head's segment), asked for into L2 a few cache lines per token while this
//! call computes. Measured: without it the kernel waited on memory and
//! computed in turns (F16 at 32k ran at its in-cache time plus its bytes at
//! full bandwidth); the hardware prefetcher alone does not run far enough
//! ahead of short segments (docs/BENCHMARKS.md, session 15).
//!
//! Integer paths and their rounding (each bound checked by a unit test):
//! K5 scores (heads of 128/256) and KV8 scores (groups of 32; AVX2
//! `vpmaddwd`, or AVX-512 `vpdpwssd` for heads of 128) round each query row
//! to 16-bit words with one scale per row, an error of at most
//! `max|q| / 65534 · Σ_c |k_c|` per score (K5: in code units, `Σ code ≤
//! 31·d`); V4 values read in place (AVX2 `vpmaddwd`, or AVX-512
//! `vpdpwssd` for groups of a multiple of 32) round each row's weight × token
//! scale to 16-bit words per group, at most `n · max ws / 65534 · 15` per
//! output value, under 3 % of V4's own worst case (`Σ w · scale / 2`). The
//! AVX-512 F16/F32/KV8 accumulation gives the AVX2 result bit for bit.

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

/// `dst[g·n + j] = src[j·per + g]`: per-token group parameters (`n` tokens ×
/// `per` groups) to group-major. Two or four groups (heads of 64 or 128,
/// groups of 32) are transposed eight tokens at a time in registers.
pub fn to_group_major(src: &[f32], per: usize, dst: &mut [f32]) {
    assert!(per > 0 && src.len() == dst.len() && src.len().is_multiple_of(per));
    let n = src.len() / per;
    let mut j0 = 0;
    #[cfg(target_arch = "x86_64")]
    if (per == 2 || per == 4) && has_avx2_fma() {
        // SAFETY: AVX2 checked; the functions touch tokens < n/8·8 only.
        unsafe {
            if per == 4 {
                x86::group_major4(src, dst, n)
            } else {
                x86::group_major2(src, dst, n)
            }
        };
        j0 = n / 8 * 8;
    }
    for j in j0..n {
        for g in 0..per {
            dst[g * n + j] = src[j * per + g];
        }
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
    /// K5 read in the loops (only as K, see [`k5_in_place`]): the 4-bit plane
    /// (`n × d/2`), the fifth bits (`n × d/8`) and the block's per-channel
    /// scale and minimum (`d` each). The score kernel folds the scale into
    /// the query and adds `q · min` once per row.
    K5 {
        /// Low four bits, `d/2` bytes per token.
        nib: &'a [u8],
        /// Fifth bits, `d/8` bytes per token.
        high: &'a [u8],
        /// Per-channel scale.
        scale: &'a [f32],
        /// Per-channel minimum.
        min: &'a [f32],
    },
    /// V4 read in the loops (only as V, see [`v4_in_place`]): codes (`m × d/2`
    /// for the `m` tokens of the tile; a call may use the first `n ≤ m`) and
    /// each token's group scale and minimum, group-major (`scale[G·m + j]`,
    /// as [`crate::codec::Codec::v4_rows`] writes them).
    V4 {
        /// Codes, `d/2` bytes per token.
        codes: &'a [u8],
        /// Scales, `d/g × m`, group-major.
        scale: &'a [f32],
        /// Minimums, `d/g × m`, group-major.
        min: &'a [f32],
        /// Channels per group.
        group: usize,
    },
}

/// Whether [`group_scores`] reads K5 rows in place for head dimension `d`
/// (x86-64 with AVX2; `d/8` a power of two of at least 8, so 8 channels
/// share one fifth-bit plane). Otherwise K5 is decoded into a tile.
pub fn k5_in_place(d: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        return d.is_multiple_of(64)
            && (d / 8).is_power_of_two()
            && d <= crate::codec::MAX_HEAD_DIM;
    }
    let _ = d;
    false
}

/// Whether [`group_accumulate`] reads V4 rows in place for head dimension
/// `d`, groups of `g` channels and `n` tokens at a time (x86-64 with AVX2,
/// `g` a multiple of 16 so a half group is whole vectors, `n` ≤ 256).
pub fn v4_in_place(d: usize, g: usize, n: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        return g.is_multiple_of(16)
            && d.is_multiple_of(g)
            && d <= crate::codec::MAX_HEAD_DIM
            && n <= MAX_V4_TOKENS;
    }
    let _ = (d, g, n);
    false
}

/// Most tokens one in-place V4 call takes (its per-token weights live on the stack).
const MAX_V4_TOKENS: usize = 256;

impl Rows<'_> {
    fn len_values(&self) -> usize {
        match self {
            Rows::F32(x) => x.len(),
            Rows::F16(b) => b.len() / 2,
            Rows::Kv8 { codes, .. } => codes.len(),
            Rows::K5 { nib, .. } => nib.len() * 2,
            Rows::V4 { codes, .. } => codes.len() * 2,
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
            Rows::K5 {
                nib,
                high,
                scale,
                min,
            } => {
                let (half, e) = (d / 2, d / 8);
                let lo = (nib[j * half + c % half] >> (c / half * 4)) & 0xF;
                let hb = (high[j * e + c % e] >> (c / e)) & 1;
                scale[c].mul_add((lo | (hb << 4)) as f32, min[c])
            }
            Rows::V4 {
                codes,
                scale,
                min,
                group: g,
            } => {
                let m = codes.len() * 2 / d;
                let (gi, k) = (c / g, c % g);
                let b = codes[j * d / 2 + gi * g / 2 + k % (g / 2)];
                let code = (b >> (k / (g / 2) * 4)) & 0xF;
                scale[gi * m + j].mul_add(code as f32, min[gi * m + j])
            }
        }
    }
}

/// Calls `f(first_row, rows)` for consecutive groups of at most 4 query rows
/// (the x86 kernels keep 4 rows' accumulators in registers).
#[cfg(target_arch = "x86_64")]
fn for_row_groups(rows: usize, f: impl FnMut(usize, usize)) {
    for_row_groups_of(4, rows, f);
}

/// [`for_row_groups`] with groups of at most `width` rows.
#[cfg(target_arch = "x86_64")]
fn for_row_groups_of(width: usize, rows: usize, mut f: impl FnMut(usize, usize)) {
    let mut r = 0;
    while r < rows {
        let take = (rows - r).min(width);
        f(r, take);
        r += take;
    }
}

/// `path::func::<R>(args)` with `R` = `take` (1..=4) as a const generic
/// (after the function's own, as in `path::func::<64>(args)`).
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
    ($take:expr, $($f:ident)::+ ::<$g:literal> ($($arg:expr),*)) => {
        match $take {
            4 => $($f)::+::<$g, 4>($($arg),*),
            3 => $($f)::+::<$g, 3>($($arg),*),
            2 => $($f)::+::<$g, 2>($($arg),*),
            _ => $($f)::+::<$g, 1>($($arg),*),
        }
    };
}

/// [`by_rows`] for kernels that hold up to 8 rows (`take` 1..=8).
#[cfg(target_arch = "x86_64")]
macro_rules! by_rows8 {
    ($take:expr, $($f:ident)::+ ($($arg:expr),*)) => {
        match $take {
            8 => $($f)::+::<8>($($arg),*),
            7 => $($f)::+::<7>($($arg),*),
            6 => $($f)::+::<6>($($arg),*),
            5 => $($f)::+::<5>($($arg),*),
            _ => by_rows!($take, $($f)::+ ($($arg),*)),
        }
    };
}

/// Scores of a group of query rows that share K rows:
/// `out[r·n + j] = q[r] · k[j]` for `r < rows`, `j < n`. `ahead` is
/// prefetched into L2 over the tokens (see the module docs; may be empty).
pub fn group_scores(
    q: &[f32],
    rows: usize,
    k: Rows<'_>,
    n: usize,
    d: usize,
    out: &mut [f32],
    ahead: &[u8],
) {
    assert!(
        q.len() >= rows * d
            && k.len_values() >= n * d
            && out.len() >= rows * n
            && d.is_multiple_of(8)
    );
    #[cfg(target_arch = "x86_64")]
    if let Rows::K5 {
        nib,
        high,
        scale,
        min,
    } = k
        && k5_in_place(d)
    {
        assert!(scale.len() >= d && min.len() >= d && high.len() >= n * d / 8);
        for_row_groups(rows, |r, take| {
            let (qs, os) = (&q[r * d..], &mut out[r * n..]);
            let pf = x86::Ahead::of(if r == 0 { ahead } else { &[] });
            // SAFETY: AVX2/FMA checked by `k5_in_place`, which also bounds d;
            // the asserts above cover every access.
            unsafe {
                if d == 128 && has_avx512_vnni() {
                    by_rows!(
                        take,
                        x86::k5_scores_zmm(qs, nib, high, scale, min, n, os, pf)
                    )
                } else if d.is_multiple_of(128) {
                    by_rows!(
                        take,
                        x86::k5_scores_words(qs, nib, high, scale, min, n, d, os, pf)
                    )
                } else {
                    by_rows!(
                        take,
                        x86::k5_scores(qs, nib, high, scale, min, n, d, os, pf)
                    )
                }
            }
        });
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma()
        && let Some(k) = x86::Plain::of(k)
    {
        for_row_groups(rows, |r, take| {
            let (qs, os) = (&q[r * d..], &mut out[r * n..]);
            let pf = x86::Ahead::of(if r == 0 { ahead } else { &[] });
            // SAFETY: AVX2/FMA/F16C checked (and AVX-512 for its kernel); the
            // bounds above cover every access.
            unsafe {
                match k {
                    x86::Plain::Kv8 {
                        codes,
                        scales,
                        shift: 5,
                    } if d == 128 && has_avx512_vnni() => {
                        by_rows!(
                            take,
                            x86::kv8_scores_zmm::<128>(qs, codes, scales, n, os, pf)
                        )
                    }
                    x86::Plain::Kv8 {
                        codes,
                        scales,
                        shift: 5,
                    } if d == 64 && has_avx512_vnni() => {
                        by_rows!(
                            take,
                            x86::kv8_scores_zmm::<64>(qs, codes, scales, n, os, pf)
                        )
                    }
                    x86::Plain::Kv8 {
                        codes,
                        scales,
                        shift: 5,
                    } if d <= crate::codec::MAX_HEAD_DIM => {
                        by_rows!(take, x86::kv8_scores_words(qs, codes, scales, n, d, os, pf))
                    }
                    _ => by_rows!(take, x86::group_scores(qs, k, n, d, os, pf)),
                }
            }
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
/// sharing V rows (`acc` is `rows × d`). `ahead` is prefetched into L2 over
/// the loop (see the module docs; may be empty).
pub fn group_accumulate(
    acc: &mut [f32],
    corr: &[f32],
    w: &[f32],
    v: Rows<'_>,
    n: usize,
    d: usize,
    ahead: &[u8],
) {
    let rows = corr.len();
    assert!(
        acc.len() >= rows * d
            && w.len() >= rows * n
            && v.len_values() >= n * d
            && d.is_multiple_of(8)
    );
    #[cfg(target_arch = "x86_64")]
    if let Rows::V4 {
        codes,
        scale,
        min,
        group,
    } = v
        && v4_in_place(d, group, n)
    {
        let m = codes.len() * 2 / d;
        assert!(scale.len() >= m * (d / group) && min.len() >= m * (d / group));
        for_row_groups(rows, |r, take| {
            let (a, c, ws) = (&mut acc[r * d..], &corr[r..r + take], &w[r * n..]);
            let pf = x86::Ahead::of(if r == 0 { ahead } else { &[] });
            // SAFETY: AVX2/FMA checked by `v4_in_place`, which also bounds d,
            // g and n; the asserts above cover every access.
            unsafe {
                if group.is_multiple_of(32) && has_avx512_vnni() {
                    by_rows!(
                        take,
                        x86::v4_accumulate_words(a, c, ws, codes, scale, min, group, n, m, d, pf)
                    )
                } else {
                    by_rows!(
                        take,
                        x86::v4_accumulate_pairs(a, c, ws, codes, scale, min, group, n, m, d, pf)
                    )
                }
            }
        });
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma()
        && let Some(v) = x86::Plain::of(v)
    {
        // AVX-512 has the registers for 8 rows' accumulators: each V load
        // then serves twice the rows (a row's arithmetic does not change).
        let zmm = d.is_multiple_of(16) && v.sixteen_wide() && has_avx512_vnni();
        for_row_groups_of(if zmm { 8 } else { 4 }, rows, |r, take| {
            let (a, c, ws) = (&mut acc[r * d..], &corr[r..r + take], &w[r * n..]);
            let pf = x86::Ahead::of(if r == 0 { ahead } else { &[] });
            // SAFETY: as in `group_scores` (the AVX-512 kernel: also checked).
            unsafe {
                if zmm {
                    by_rows8!(take, x86::group_accumulate_zmm(a, c, ws, v, n, d, pf))
                } else {
                    by_rows!(take, x86::group_accumulate(a, c, ws, v, n, d, pf))
                }
            }
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

/// AVX-512 with BW and VNNI, for the K5 kernel of heads of 128 (off with
/// `SILICEO_KERNELS_NO_AVX512`, which tests use to check the AVX2 kernels
/// on machines that have it).
#[cfg(target_arch = "x86_64")]
fn has_avx512_vnni() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        has_avx2_fma()
            && std::env::var_os("SILICEO_KERNELS_NO_AVX512").is_none()
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Rows;
    use crate::codec::MAX_HEAD_DIM;

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

    /// A software prefetch spread over a kernel's loop: the cache lines of
    /// bytes a later call reads, asked for into L2 a few at a time.
    #[derive(Clone, Copy)]
    pub(super) struct Ahead {
        p: *const u8,
        lines: usize,
    }

    impl Ahead {
        pub(super) fn of(bytes: &[u8]) -> Ahead {
            Ahead {
                p: bytes.as_ptr(),
                lines: bytes.len().div_ceil(64),
            }
        }

        /// Lines per step for a loop of `steps` steps that covers them all.
        #[inline(always)]
        fn per(self, steps: usize) -> usize {
            self.lines.div_ceil(steps.max(1))
        }

        /// Prefetches lines `i0..i1` (those that exist) into L2.
        #[inline(always)]
        fn lines(self, i0: usize, i1: usize) {
            let mut i = i0;
            while i < i1.min(self.lines) {
                // SAFETY: line i starts inside the bytes `of` was given, and
                // a prefetch never faults.
                unsafe { _mm_prefetch::<_MM_HINT_T1>(self.p.add(i * 64).cast()) };
                i += 1;
            }
        }
    }

    /// The rows the generic loops read: [`Rows`] without the packed formats,
    /// which have their own kernels. (A fourth, panicking arm in `load8`
    /// measured 20 % slower F16 decode at 32k: the loops lose their shape.)
    #[derive(Clone, Copy)]
    pub(super) enum Plain<'a> {
        F32(&'a [f32]),
        F16(&'a [u8]),
        Kv8 {
            codes: &'a [u8],
            scales: &'a [f32],
            shift: u32,
        },
    }

    impl<'a> Plain<'a> {
        /// Whether 16 channels from a multiple of 16 share one KV8 scale
        /// (as [`load16`] reads them).
        pub(super) fn sixteen_wide(self) -> bool {
            !matches!(self, Plain::Kv8 { shift, .. } if shift < 4)
        }

        pub(super) fn of(rows: Rows<'a>) -> Option<Plain<'a>> {
            match rows {
                Rows::F32(x) => Some(Plain::F32(x)),
                Rows::F16(b) => Some(Plain::F16(b)),
                Rows::Kv8 {
                    codes,
                    scales,
                    shift,
                } => Some(Plain::Kv8 {
                    codes,
                    scales,
                    shift,
                }),
                Rows::K5 { .. } | Rows::V4 { .. } => None,
            }
        }
    }

    /// Eight K/V values of row `j` from channel `c`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load8(rows: Plain<'_>, j: usize, c: usize, d: usize) -> __m256 {
        let off = j * d + c;
        // SAFETY: the caller keeps `off + 8` within the rows (and, for KV8,
        // the group of channel c within row j's scales).
        unsafe {
            match rows {
                Plain::F32(x) => _mm256_loadu_ps(x.as_ptr().add(off)),
                Plain::F16(b) => _mm256_cvtph_ps(_mm_loadu_si128(b.as_ptr().add(2 * off).cast())),
                Plain::Kv8 {
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

    /// Sixteen K/V values of row `j` from channel `c` (a multiple of 16; KV8
    /// groups of at least 16), converted as [`load8`] converts each half.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    #[inline]
    unsafe fn load16(rows: Plain<'_>, j: usize, c: usize, d: usize) -> __m512 {
        let off = j * d + c;
        // SAFETY: the caller keeps `off + 16` within the rows (and, for KV8,
        // the group of channel c within row j's scales).
        unsafe {
            match rows {
                Plain::F32(x) => _mm512_loadu_ps(x.as_ptr().add(off)),
                Plain::F16(b) => {
                    _mm512_cvtph_ps(_mm256_loadu_si256(b.as_ptr().add(2 * off).cast()))
                }
                Plain::Kv8 {
                    codes,
                    scales,
                    shift,
                } => {
                    let q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                        codes.as_ptr().add(off).cast(),
                    )));
                    let s = *scales.get_unchecked(j * (d >> shift) + (c >> shift));
                    _mm512_mul_ps(q, _mm512_set1_ps(s))
                }
            }
        }
    }

    /// [`group_accumulate`] 32 channels at a time with AVX-512 (d a multiple
    /// of 16): each lane runs the AVX2 kernel's multiply-adds in the same
    /// order, so the result is the same bit for bit.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn group_accumulate_zmm<const R: usize>(
        acc: &mut [f32],
        corr: &[f32],
        w: &[f32],
        v: Plain<'_>,
        n: usize,
        d: usize,
        ahead: Ahead,
    ) {
        let ap = acc.as_mut_ptr();
        // One prefetch step per (32-channel pass, token).
        let per = ahead.per(d.div_ceil(32) * n);
        // SAFETY: channels c + 32 ≤ d in the loop and c + 16 ≤ d after it
        // (d % 16 == 0), rows r < R of acc (R·d) and w (R·n), tokens j < n
        // of v: checked by the caller.
        unsafe {
            let mut c = 0;
            while c < d {
                let wide = c + 32 <= d;
                let mut a = [[_mm512_setzero_ps(); 2]; R];
                for (r, a) in a.iter_mut().enumerate() {
                    let cv = _mm512_set1_ps(corr[r]);
                    a[0] = _mm512_mul_ps(_mm512_loadu_ps(ap.add(r * d + c)), cv);
                    if wide {
                        a[1] = _mm512_mul_ps(_mm512_loadu_ps(ap.add(r * d + c + 16)), cv);
                    }
                }
                for j in 0..n {
                    let i = (c / 32) * n + j;
                    ahead.lines(i * per, (i + 1) * per);
                    let v0 = load16(v, j, c, d);
                    let v1 = if wide { load16(v, j, c + 16, d) } else { v0 };
                    for (r, a) in a.iter_mut().enumerate() {
                        let wv = _mm512_set1_ps(*w.get_unchecked(r * n + j));
                        a[0] = _mm512_fmadd_ps(wv, v0, a[0]);
                        a[1] = _mm512_fmadd_ps(wv, v1, a[1]);
                    }
                }
                for (r, a) in a.iter().enumerate() {
                    _mm512_storeu_ps(ap.add(r * d + c), a[0]);
                    if wide {
                        _mm512_storeu_ps(ap.add(r * d + c + 16), a[1]);
                    }
                }
                c += 32;
            }
        }
    }

    /// R query rows × 2 tokens in 2R accumulators: each K load serves R rows,
    /// each Q load 2 tokens.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group_scores<const R: usize>(
        q: &[f32],
        k: Plain<'_>,
        n: usize,
        d: usize,
        out: &mut [f32],
        ahead: Ahead,
    ) {
        let qp = q.as_ptr();
        let per = ahead.per(n);
        let mut j = 0;
        // SAFETY: rows r < R of q (R·d values), tokens j < n of k (n·d), and
        // out[r·n + j] are inside the slices (checked by the caller).
        unsafe {
            while j + 2 <= n {
                // Eight tokens' share at a time: a call per pair measured 7 %
                // slower in cache even with nothing to prefetch.
                if j % 8 == 0 {
                    ahead.lines(j * per, (j + 8) * per);
                }
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
                ahead.lines(j * per, (j + 1) * per);
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
        v: Plain<'_>,
        n: usize,
        d: usize,
        ahead: Ahead,
    ) {
        let ap = acc.as_mut_ptr();
        // One prefetch step per (16-channel pass, token).
        let per = ahead.per(d / 16 * n);
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
                    if j % 8 == 0 {
                        let i = (c / 16) * n + j;
                        ahead.lines(i * per, (i + 8) * per);
                    }
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

    /// One query row folded into K5's per-channel parameters: writes
    /// `qs[c] = q[c]·scale[c]` (`d` values) and returns `(q · min, max |qs|)`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn fold_k5_query(
        q: *const f32,
        scale: &[f32],
        min: &[f32],
        d: usize,
        qs: *mut f32,
    ) -> (f32, f32) {
        let sign = _mm256_set1_ps(-0.0);
        let (mut bias, mut amax) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        // SAFETY: the caller gives d readable values at q and d writable at
        // qs; scale and min hold d (d % 8 == 0).
        unsafe {
            for c in (0..d).step_by(8) {
                let qv = _mm256_loadu_ps(q.add(c));
                let v = _mm256_mul_ps(qv, _mm256_loadu_ps(scale.as_ptr().add(c)));
                _mm256_storeu_ps(qs.add(c), v);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
                bias = _mm256_fmadd_ps(qv, _mm256_loadu_ps(min.as_ptr().add(c)), bias);
            }
        }
        (hsum8(bias), hmax8(amax))
    }

    /// Scores over K5 rows read in place: the query rows times the channel
    /// scales (once per call), then 5-bit codes assembled and converted
    /// eight channels at a time, two tokens per pass; `q · min` is added
    /// per row at the end.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn k5_scores<const R: usize>(
        q: &[f32],
        nib: &[u8],
        high: &[u8],
        scale: &[f32],
        min: &[f32],
        n: usize,
        d: usize,
        out: &mut [f32],
        ahead: Ahead,
    ) {
        let per = ahead.per(n);
        let mut qs = std::mem::MaybeUninit::<[f32; 4 * MAX_HEAD_DIM]>::uninit();
        let qs = qs.as_mut_ptr().cast::<f32>();
        let mut bias = [0f32; R];
        // SAFETY: d ≤ MAX_HEAD_DIM and R ≤ 4 (the caller), so qs[r·d + c]
        // stays in the buffer, and only written lanes are read back; q holds
        // R·d values, scale and min d, nib n·d/2 and high n·d/8 (checked by
        // the caller); out[r·n + j] for r < R, j < n likewise.
        unsafe {
            for (r, b) in bias.iter_mut().enumerate() {
                *b = fold_k5_query(q.as_ptr().add(r * d), scale, min, d, qs.add(r * d)).0;
            }
            let mut j = 0;
            while j + 2 <= n {
                ahead.lines(j * per, (j + 2) * per);
                let a = k5_tokens::<R, 2>(qs, nib, high, j, d);
                for (r, a) in a.iter().enumerate() {
                    out[r * n + j] = hsum8(a[0]) + bias[r];
                    out[r * n + j + 1] = hsum8(a[1]) + bias[r];
                }
                j += 2;
            }
            if j < n {
                ahead.lines(j * per, (j + 1) * per);
                let a = k5_tokens::<R, 1>(qs, nib, high, j, d);
                for (r, a) in a.iter().enumerate() {
                    out[r * n + j] = hsum8(a[0]) + bias[r];
                }
            }
        }
    }

    /// Scores of tokens `j` and `j + 1` (if `< n`) from integer sums
    /// `acc[2r + t]` (row r, token t; eight lanes each), all reduced at once.
    /// A macro, not a function: a `#[target_feature]` function cannot be
    /// forced inline, and as a call it measured 10 % of the K5/V4 kernel.
    macro_rules! k5_store_pair {
        ($R:expr, $acc:expr, $row_scale:expr, $bias:expr, $j:expr, $n:expr, $out:expr) => {{
            let (acc, j, n) = ($acc, $j, $n);
            // Eight horizontal sums at once: lane 2r + t = row r, token t.
            let h0 = _mm256_hadd_epi32(acc[0], acc[1]);
            let h1 = _mm256_hadd_epi32(acc[2], acc[3]);
            let h2 = _mm256_hadd_epi32(acc[4], acc[5]);
            let h3 = _mm256_hadd_epi32(acc[6], acc[7]);
            let (g0, g1) = (_mm256_hadd_epi32(h0, h1), _mm256_hadd_epi32(h2, h3));
            let sums = _mm256_add_epi32(
                _mm256_permute2x128_si256::<0x20>(g0, g1),
                _mm256_permute2x128_si256::<0x31>(g0, g1),
            );
            let mut f = [0f32; 8];
            _mm256_storeu_ps(f.as_mut_ptr(), _mm256_cvtepi32_ps(sums));
            for r in 0..$R {
                $out[r * n + j] = f[2 * r].mul_add($row_scale[r], $bias[r]);
                if j + 1 < n {
                    $out[r * n + j + 1] = f[2 * r + 1].mul_add($row_scale[r], $bias[r]);
                }
            }
        }};
    }

    /// Scores over K5 rows with integer dot products (d a multiple of 128, so
    /// 16 channels share one fifth-bit plane): each query row times the
    /// channel scales is rounded to 16-bit integers with one scale per row (an
    /// error of 2⁻¹⁶ of the row's largest element, far below K5's own step),
    /// the codes are assembled as 16-bit words 16 channels at a time, and
    /// `vpmaddwd` forms 16 products per instruction into exact 32-bit sums.
    /// Two tokens × up to four rows are reduced together.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn k5_scores_words<const R: usize>(
        q: &[f32],
        nib: &[u8],
        high: &[u8],
        scale: &[f32],
        min: &[f32],
        n: usize,
        d: usize,
        out: &mut [f32],
        ahead: Ahead,
    ) {
        let per = ahead.per(n);
        let mut qw = std::mem::MaybeUninit::<[i16; 4 * MAX_HEAD_DIM]>::uninit();
        let qw = qw.as_mut_ptr().cast::<i16>();
        let (half, e) = (d / 2, d / 8);
        let e_shift = e.trailing_zeros();
        // SAFETY: d ≤ MAX_HEAD_DIM and R ≤ 4 (the caller), so qw[r·d + c]
        // stays in the buffer and only written words are read; q holds R·d
        // values, scale and min d, nib n·d/2, high n·d/8, out R·n (the
        // caller). Block b's channels 16b..16b+16 < d/2 and their fifth-bit
        // bytes (16b mod e)..+16 ≤ e because e is a power of two ≥ 16.
        unsafe {
            let (bias, row_scale) = k5_query_words::<R>(q, scale, min, d, qw);
            let (low4, five) = (_mm256_set1_epi16(0xF), _mm256_set1_epi16(0x10));
            let mut j = 0;
            while j < n {
                ahead.lines(j * per, (j + 2) * per);
                // Pairs of tokens; an odd last token is paired with itself.
                let pair = [j, (j + 1).min(n - 1)];
                let mut acc = [_mm256_setzero_si256(); 8];
                for c in (0..half).step_by(16) {
                    let p = (c >> e_shift) as i32;
                    let (up, down) = (_mm_cvtsi32_si128(4 - p), _mm_cvtsi32_si128(p));
                    // Both tokens' codes, then each query load serves both.
                    // (Filled in a loop: `pair.map` with a closure measured 1.7× slower.)
                    let mut codes = [(_mm256_setzero_si256(), _mm256_setzero_si256()); 2];
                    for (t, &jj) in pair.iter().enumerate() {
                        let nb = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                            nib.as_ptr().add(jj * half + c).cast(),
                        ));
                        let hb = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                            high.as_ptr().add(jj * e + (c & (e - 1))).cast(),
                        ));
                        // Channel c's fifth bit is in plane p, channel c + half's in p + 4.
                        let lo = _mm256_or_si256(
                            _mm256_and_si256(nb, low4),
                            _mm256_and_si256(_mm256_sll_epi16(hb, up), five),
                        );
                        let hi = _mm256_or_si256(
                            _mm256_srli_epi16::<4>(nb),
                            _mm256_and_si256(_mm256_srl_epi16(hb, down), five),
                        );
                        codes[t] = (lo, hi);
                    }
                    for r in 0..R {
                        let ql = _mm256_loadu_si256(qw.add(r * d + c).cast());
                        let qh = _mm256_loadu_si256(qw.add(r * d + half + c).cast());
                        for (t, &(lo, hi)) in codes.iter().enumerate() {
                            let a = &mut acc[2 * r + t];
                            *a = _mm256_add_epi32(*a, _mm256_madd_epi16(lo, ql));
                            *a = _mm256_add_epi32(*a, _mm256_madd_epi16(hi, qh));
                        }
                    }
                }
                k5_store_pair!(R, acc, row_scale, bias, j, n, out);
                j += 2;
            }
        }
    }

    /// The query rows of a K5 score call as 16-bit words: each row times the
    /// channel scales, rounded with one scale per row (its largest element ↦
    /// 32767). Writes `R·d` words to `qw`, returns each row's `q · min` and
    /// word scale.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn k5_query_words<const R: usize>(
        q: &[f32],
        scale: &[f32],
        min: &[f32],
        d: usize,
        qw: *mut i16,
    ) -> ([f32; R], [f32; R]) {
        let (mut bias, mut row_scale) = ([0f32; R], [0f32; R]);
        let mut qs = std::mem::MaybeUninit::<[f32; MAX_HEAD_DIM]>::uninit();
        let qs = qs.as_mut_ptr().cast::<f32>();
        // SAFETY: d ≤ MAX_HEAD_DIM, d % 16 == 0 and q holds R·d values, qw
        // R·d words (the caller); only written lanes of qs are read.
        unsafe {
            for r in 0..R {
                let (b, m) = fold_k5_query(q.as_ptr().add(r * d), scale, min, d, qs);
                bias[r] = b;
                row_scale[r] = to_words(qs, m, d, qw.add(r * d));
            }
        }
        (bias, row_scale)
    }

    /// `d` values (largest magnitude `amax`) rounded to 16-bit words with one
    /// scale, `amax ↦ 32767`; returns the scale (value = word · scale).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn to_words(x: *const f32, amax: f32, d: usize, out: *mut i16) -> f32 {
        let inv = _mm256_set1_ps(if amax > 0.0 { 32767.0 / amax } else { 0.0 });
        // SAFETY: x holds d readable values and out d writable words, d % 16 == 0.
        unsafe {
            for c in (0..d).step_by(16) {
                let word =
                    |c: usize| _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x.add(c)), inv));
                // packs interleaves the 128-bit halves; the permute restores order.
                let w = _mm256_permute4x64_epi64::<0xD8>(_mm256_packs_epi32(word(c), word(c + 8)));
                _mm256_storeu_si256(out.add(c).cast(), w);
            }
        }
        amax / 32767.0
    }

    /// `R` query rows of `d` values as 16-bit words (each row's largest
    /// magnitude ↦ 32767, see [`to_words`]) into `qw`; returns each row's
    /// word scale.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_to_words<const R: usize>(q: &[f32], d: usize, qw: *mut i16) -> [f32; R] {
        let sign = _mm256_set1_ps(-0.0);
        let mut row_scale = [0f32; R];
        // SAFETY: q holds R·d values and qw R·d writable words, d % 16 == 0
        // (the caller).
        unsafe {
            for (r, rs) in row_scale.iter_mut().enumerate() {
                let qr = q.as_ptr().add(r * d);
                let mut amax = _mm256_setzero_ps();
                for c in (0..d).step_by(8) {
                    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(qr.add(c))));
                }
                *rs = to_words(qr, hmax8(amax), d, qw.add(r * d));
            }
        }
        row_scale
    }

    /// KV8 scores in groups of 32 with AVX2 (`vpmaddwd`; d a multiple of
    /// 32): each query row rounded to 16-bit words with one scale per row (as
    /// [`kv8_scores_zmm`], the same bound), a group's 32 codes widened to
    /// words, two `vpmaddwd` per row into one exact 32-bit sum per lane, then
    /// one multiply-add by the token's group scale; two tokens per pass.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn kv8_scores_words<const R: usize>(
        q: &[f32],
        codes: &[u8],
        scales: &[f32],
        n: usize,
        d: usize,
        out: &mut [f32],
        ahead: Ahead,
    ) {
        let per = ahead.per(n);
        let groups = d / 32;
        let mut qw = std::mem::MaybeUninit::<[i16; 4 * MAX_HEAD_DIM]>::uninit();
        let qw = qw.as_mut_ptr().cast::<i16>();
        // SAFETY: d ≤ MAX_HEAD_DIM and R ≤ 4 (the caller), so qw[r·d + c]
        // stays in the buffer (all written before read); q holds R·d values,
        // codes n·d bytes, scales n·d/32, out R·n (the caller).
        unsafe {
            let row_scale = rows_to_words::<R>(q, d, qw);
            let mut j = 0;
            while j < n {
                // Eight tokens' share at a time, as in `group_scores`.
                if j % 8 == 0 {
                    ahead.lines(j * per, (j + 8) * per);
                }
                // Pairs of tokens; an odd last token is paired with itself.
                let pair = [j, (j + 1).min(n - 1)];
                let mut acc = [[_mm256_setzero_ps(); 2]; R];
                for gi in 0..groups {
                    let mut k = [[_mm256_setzero_si256(); 2]; 2];
                    for (t, &jj) in pair.iter().enumerate() {
                        let src = codes.as_ptr().add(jj * d + 32 * gi);
                        k[t][0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(src.cast()));
                        k[t][1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(src.add(16).cast()));
                    }
                    let s = [
                        _mm256_set1_ps(*scales.get_unchecked(pair[0] * groups + gi)),
                        _mm256_set1_ps(*scales.get_unchecked(pair[1] * groups + gi)),
                    ];
                    for (r, a) in acc.iter_mut().enumerate() {
                        let q0 = _mm256_loadu_si256(qw.add(r * d + 32 * gi).cast());
                        let q1 = _mm256_loadu_si256(qw.add(r * d + 32 * gi + 16).cast());
                        for t in 0..2 {
                            let sum = _mm256_add_epi32(
                                _mm256_madd_epi16(k[t][0], q0),
                                _mm256_madd_epi16(k[t][1], q1),
                            );
                            a[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), s[t], a[t]);
                        }
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    out[r * n + j] = hsum8(a[0]) * row_scale[r];
                    if j + 1 < n {
                        out[r * n + j + 1] = hsum8(a[1]) * row_scale[r];
                    }
                }
                j += 2;
            }
        }
    }

    /// KV8 scores for heads of exactly `D` = 64 or 128 in groups of 32 with
    /// AVX-512 (BW, VNNI): each query row rounded to 16-bit words with one
    /// scale per row (as for K5: an error of at most `max|q| / 65534 · Σ_c
    /// |k_c|` per score), a token's codes regrouped so that every 32-bit lane
    /// of `vpdpwssd` sums channels of one group — D = 128: two 64-bit
    /// permutes, lanes 4g..4g+4 group g; D = 64: one 128-bit lane shuffle,
    /// lanes 0–7 group 0 and 8–15 group 1 — then one multiply by the group
    /// scales per row and token. The query words are regrouped the same way
    /// once per call (a transpose of 128-bit lanes).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    pub(super) unsafe fn kv8_scores_zmm<const D: usize, const R: usize>(
        q: &[f32],
        codes: &[u8],
        scales: &[f32],
        n: usize,
        out: &mut [f32],
        ahead: Ahead,
    ) {
        const { assert!(D == 64 || D == 128) };
        let groups = D / 32;
        let per = ahead.per(n);
        let mut qw = std::mem::MaybeUninit::<[i16; 4 * 128]>::uninit();
        let qw = qw.as_mut_ptr().cast::<i16>();
        // D = 128, regrouped order: vector k, word 8g + i = channel 32g + 8k
        // + i, i.e. 64-bit pieces k, 4 + k, 8 + k, 12 + k of the row (two
        // vectors per permute). D = 64: vector k, word 16g + i = channel 32g
        // + 16k + i, i.e. 128-bit lanes k and 2 + k of the row.
        let (pa, pb) = (
            _mm512_setr_epi64(0, 4, 8, 12, 1, 5, 9, 13),
            _mm512_setr_epi64(2, 6, 10, 14, 3, 7, 11, 15),
        );
        let spread = if D == 128 {
            _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
        } else {
            _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
        };
        // SAFETY: R ≤ 4, so qw[r·D + c] stays in the buffer (all written
        // before read); q holds R·D values, codes D·n bytes, scales D/32·n,
        // out R·n (the caller).
        unsafe {
            let row_scale = rows_to_words::<R>(q, D, qw);
            // Lane 2r + t: row r's scale.
            let rs = |r: usize| row_scale.get(r).copied().unwrap_or(0.0);
            let lane_scale = _mm256_setr_ps(rs(0), rs(0), rs(1), rs(1), rs(2), rs(2), rs(3), rs(3));
            // The query words regrouped like the codes. D = 128: vector g
            // holds group g's 32 words as four 128-bit pieces (8 channels
            // each); vector k of the result takes piece k of every group — a
            // 4 × 4 transpose of 128-bit lanes. D = 64: vector k takes the
            // 256-bit half k of both groups.
            let qv: [[__m512i; 4]; R] = std::array::from_fn(|r| {
                let w: [__m512i; 4] = std::array::from_fn(|g| {
                    if g < groups {
                        _mm512_loadu_si512(qw.add(r * D + 32 * g).cast())
                    } else {
                        _mm512_setzero_si512()
                    }
                });
                let (t0, t1) = (
                    _mm512_shuffle_i64x2::<0x44>(w[0], w[1]),
                    _mm512_shuffle_i64x2::<0xEE>(w[0], w[1]),
                );
                if D == 64 {
                    return [t0, t1, w[2], w[3]];
                }
                let (t2, t3) = (
                    _mm512_shuffle_i64x2::<0x44>(w[2], w[3]),
                    _mm512_shuffle_i64x2::<0xEE>(w[2], w[3]),
                );
                [
                    _mm512_shuffle_i64x2::<0x88>(t0, t2),
                    _mm512_shuffle_i64x2::<0xDD>(t0, t2),
                    _mm512_shuffle_i64x2::<0x88>(t1, t3),
                    _mm512_shuffle_i64x2::<0xDD>(t1, t3),
                ]
            });
            let mut j = 0;
            while j < n {
                ahead.lines(j * per, (j + 2) * per);
                // Pairs of tokens; an odd last token is paired with itself.
                let pair = [j, (j + 1).min(n - 1)];
                let mut f = [[_mm512_setzero_ps(); 2]; R];
                for (t, &jj) in pair.iter().enumerate() {
                    let row = codes.as_ptr().add(jj * D);
                    let z0 = _mm512_loadu_si512(row.cast());
                    let (a, b) = if D == 128 {
                        let z1 = _mm512_loadu_si512(row.add(64).cast());
                        (
                            _mm512_permutex2var_epi64(z0, pa, z1),
                            _mm512_permutex2var_epi64(z0, pb, z1),
                        )
                    } else {
                        // 128-bit lanes 0, 2 | 1, 3.
                        (_mm512_shuffle_i64x2::<0xD8>(z0, z0), z0)
                    };
                    let v = [
                        _mm512_cvtepi8_epi16(_mm512_castsi512_si256(a)),
                        _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64::<1>(a)),
                        _mm512_cvtepi8_epi16(_mm512_castsi512_si256(b)),
                        _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64::<1>(b)),
                    ];
                    let sp = scales.as_ptr().add(jj * groups);
                    let s4 = if D == 128 {
                        _mm_loadu_ps(sp)
                    } else {
                        _mm_castsi128_ps(_mm_loadl_epi64(sp.cast()))
                    };
                    let s = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s4));
                    for (r, f) in f.iter_mut().enumerate() {
                        let mut acc = _mm512_setzero_si512();
                        for (k, v) in v.iter().enumerate().take(groups) {
                            acc = _mm512_dpwssd_epi32(acc, *v, qv[r][k]);
                        }
                        f[t] = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), s);
                    }
                }
                let mut a8 = [_mm256_setzero_ps(); 8];
                for r in 0..R {
                    for t in 0..2 {
                        a8[2 * r + t] = _mm256_add_ps(
                            _mm512_castps512_ps256(f[r][t]),
                            // The upper half (AVX-512F only; `extractf32x8` is DQ).
                            _mm256_castsi256_ps(_mm512_extracti64x4_epi64::<1>(
                                _mm512_castps_si512(f[r][t]),
                            )),
                        );
                    }
                }
                // Eight horizontal sums at once: lane 2r + t = row r, token t.
                let h0 = _mm256_hadd_ps(a8[0], a8[1]);
                let h1 = _mm256_hadd_ps(a8[2], a8[3]);
                let h2 = _mm256_hadd_ps(a8[4], a8[5]);
                let h3 = _mm256_hadd_ps(a8[6], a8[7]);
                let (g0, g1) = (_mm256_hadd_ps(h0, h1), _mm256_hadd_ps(h2, h3));
                let sums = _mm256_add_ps(
                    _mm256_permute2f128_ps::<0x20>(g0, g1),
                    _mm256_permute2f128_ps::<0x31>(g0, g1),
                );
                // Each row's two scores scaled and stored as one 64-bit piece.
                let scaled = _mm256_mul_ps(sums, lane_scale);
                for r in 0..R {
                    let half = if r < 2 {
                        _mm256_castps256_ps128(scaled)
                    } else {
                        _mm256_extractf128_ps::<1>(scaled)
                    };
                    let x = if r % 2 == 0 {
                        half
                    } else {
                        _mm_movehl_ps(half, half)
                    };
                    let o = out.as_mut_ptr().add(r * n + j);
                    if j + 1 < n {
                        _mm_storel_epi64(o.cast(), _mm_castps_si128(x));
                    } else {
                        _mm_store_ss(o, x);
                    }
                }
                j += 2;
            }
        }
    }

    /// [`k5_scores_words`] for heads of exactly 128 with AVX-512 (BW, VNNI):
    /// a token's 128 channels are four vectors of 32 words (the fifth bits
    /// placed with per-word variable shifts), the query words stay in
    /// registers, and `vpdpwssd` multiplies and accumulates in one
    /// instruction. The integer sums are exact, so the scores equal the
    /// AVX2 kernel's bit for bit.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn k5_scores_zmm<const R: usize>(
        q: &[f32],
        nib: &[u8],
        high: &[u8],
        scale: &[f32],
        min: &[f32],
        n: usize,
        out: &mut [f32],
        ahead: Ahead,
    ) {
        const D: usize = 128;
        let per = ahead.per(n);
        let mut qw = std::mem::MaybeUninit::<[i16; 4 * D]>::uninit();
        let qw = qw.as_mut_ptr().cast::<i16>();
        // SAFETY: R ≤ 4 (the caller), so qw[r·128 + c] stays in the buffer
        // and only written words are read; q holds R·128 values, scale and
        // min 128, nib 64·n bytes, high 16·n, out R·n (the caller).
        unsafe {
            let (bias, row_scale) = k5_query_words::<R>(q, scale, min, D, qw);
            // Vector v: channels 32v..32v+32 (v < 2: low nibbles of bytes
            // 32v.., v ≥ 2: high nibbles of bytes 32(v−2)..).
            let qv: [[__m512i; 4]; R] = std::array::from_fn(|r| {
                std::array::from_fn(|v| _mm512_loadu_si512(qw.add(r * D + 32 * v).cast()))
            });
            // Channel c's fifth bit is bit c/16 of byte c mod 16: vector v's
            // words take planes 2v (first 16) and 2v + 1.
            let planes: [__m512i; 4] = std::array::from_fn(|v| {
                let p = 2 * v as i16;
                _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_set1_epi16(p)),
                    _mm256_set1_epi16(p + 1),
                )
            });
            let (low4, five) = (_mm512_set1_epi16(0xF), _mm512_set1_epi16(0x10));
            let mut j = 0;
            while j < n {
                ahead.lines(j * per, (j + 2) * per);
                // Pairs of tokens; an odd last token is paired with itself.
                let pair = [j, (j + 1).min(n - 1)];
                let mut acc = [[_mm512_setzero_si512(); 2]; R];
                for (t, &jj) in pair.iter().enumerate() {
                    let nb = nib.as_ptr().add(jj * D / 2);
                    let w0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(nb.cast()));
                    let w1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(nb.add(32).cast()));
                    let hb =
                        _mm256_cvtepu8_epi16(_mm_loadu_si128(high.as_ptr().add(jj * 16).cast()));
                    let h = _mm512_slli_epi16::<4>(_mm512_broadcast_i64x4(hb));
                    let lo = [
                        _mm512_and_si512(w0, low4),
                        _mm512_and_si512(w1, low4),
                        _mm512_srli_epi16::<4>(w0),
                        _mm512_srli_epi16::<4>(w1),
                    ];
                    for v in 0..4 {
                        // code = nibble | (fifth bit moved to bit 4).
                        let code = _mm512_ternarylogic_epi32::<0xF8>(
                            lo[v],
                            _mm512_srlv_epi16(h, planes[v]),
                            five,
                        );
                        for r in 0..R {
                            acc[r][t] = _mm512_dpwssd_epi32(acc[r][t], code, qv[r][v]);
                        }
                    }
                }
                let mut a8 = [_mm256_setzero_si256(); 8];
                for r in 0..R {
                    for t in 0..2 {
                        let z = acc[r][t];
                        a8[2 * r + t] = _mm256_add_epi32(
                            _mm512_castsi512_si256(z),
                            _mm512_extracti64x4_epi64::<1>(z),
                        );
                    }
                }
                k5_store_pair!(R, a8, row_scale, bias, j, n, out);
                j += 2;
            }
        }
    }

    /// `Σ_c qs[r][c] · code[j + t][c]` for T tokens from `j` in R × T accumulators.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn k5_tokens<const R: usize, const T: usize>(
        qs: *const f32,
        nib: &[u8],
        high: &[u8],
        j: usize,
        d: usize,
    ) -> [[__m256; T]; R] {
        let (half, e) = (d / 2, d / 8);
        let e_shift = e.trailing_zeros();
        let (mask, five) = (_mm256_set1_epi32(0xF), _mm256_set1_epi32(0x10));
        let mut a = [[_mm256_setzero_ps(); T]; R];
        // SAFETY: the caller's bounds (see `k5_scores`); c + 8 ≤ d/2 and
        // idx + 8 ≤ d/8 because d/8 is a power of two ≥ 8.
        unsafe {
            for c in (0..half).step_by(8) {
                // Channels c..c+8 have their fifth bit in plane p (< 4) of
                // bytes idx..idx+8; channels c+half.. in plane p + 4.
                let p = (c >> e_shift) as i32;
                let idx = c & (e - 1);
                let (up, down) = (_mm_cvtsi32_si128(4 - p), _mm_cvtsi32_si128(p));
                for t in 0..T {
                    let nb = u8x8(nib.as_ptr().add((j + t) * half + c));
                    let hb = u8x8(high.as_ptr().add((j + t) * e + idx));
                    let lo = _mm256_or_si256(
                        _mm256_and_si256(nb, mask),
                        _mm256_and_si256(_mm256_sll_epi32(hb, up), five),
                    );
                    let hi = _mm256_or_si256(
                        _mm256_srli_epi32::<4>(nb),
                        _mm256_and_si256(_mm256_srl_epi32(hb, down), five),
                    );
                    let (lo, hi) = (_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi));
                    for (r, a) in a.iter_mut().enumerate() {
                        let x = _mm256_fmadd_ps(_mm256_loadu_ps(qs.add(r * d + c)), lo, a[t]);
                        a[t] = _mm256_fmadd_ps(_mm256_loadu_ps(qs.add(r * d + c + half)), hi, x);
                    }
                }
            }
        }
        a
    }

    /// One V4 group's weights for R rows: `ws[r·n + j] = w[r·n + j] ·
    /// scale[at + j]` and, returned, `Σ_j w[r·n + j] · min[at + j]`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn v4_group_weights<const R: usize>(
        w: &[f32],
        scale: &[f32],
        min: &[f32],
        at: usize,
        n: usize,
        ws: *mut f32,
    ) -> [f32; R] {
        let mut wm = [0f32; R];
        // SAFETY: w holds R·n values, scale and min at + n, ws R·n (the caller).
        unsafe {
            let (sg, mg) = (scale.as_ptr().add(at), min.as_ptr().add(at));
            for (r, wm) in wm.iter_mut().enumerate() {
                let (wr, wsr) = (w.as_ptr().add(r * n), ws.add(r * n));
                let mut m8 = _mm256_setzero_ps();
                let mut j = 0;
                while j + 8 <= n {
                    let wv = _mm256_loadu_ps(wr.add(j));
                    _mm256_storeu_ps(wsr.add(j), _mm256_mul_ps(wv, _mm256_loadu_ps(sg.add(j))));
                    m8 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(mg.add(j)), m8);
                    j += 8;
                }
                *wm = hsum8(m8);
                while j < n {
                    *wsr.add(j) = *wr.add(j) * *sg.add(j);
                    *wm += *wr.add(j) * *mg.add(j);
                    j += 1;
                }
            }
        }
        wm
    }

    /// V4 accumulation as 16-bit integer dot products with AVX-512 (BW, VNNI;
    /// groups of a multiple of 32): per row and group the weights times the
    /// tokens' scales (`ws ≥ 0`) are rounded to 16-bit words with one step
    /// (`max ws ↦ 32767`), the codes of two tokens are interleaved channel by
    /// channel, and `vpdpwssd` adds both tokens' products per lane in exact
    /// 32-bit sums; the sums are scaled back once per call. Error per output
    /// value: at most `n · max_j ws_j / 65534 · 15` (the rounding of each
    /// weight times the largest code), against V4's own `scale / 2` per value.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn v4_accumulate_words<const R: usize>(
        acc: &mut [f32],
        corr: &[f32],
        w: &[f32],
        codes: &[u8],
        scale: &[f32],
        min: &[f32],
        g: usize,
        n: usize,
        m: usize,
        d: usize,
        ahead: Ahead,
    ) {
        const PAIRS: usize = super::MAX_V4_TOKENS / 2;
        let (per, hg, pairs) = (d / g, g / 2, n.div_ceil(2));
        // One prefetch step per (16-byte pass, token pair).
        let step = ahead.per(d / 32 * pairs);
        let mut ws = std::mem::MaybeUninit::<[f32; 4 * super::MAX_V4_TOKENS]>::uninit();
        let ws = ws.as_mut_ptr().cast::<f32>();
        // Row r's weight words, two tokens per 32-bit lane (token 2p low).
        let mut wp = [[0i32; PAIRS]; R];
        let ap = acc.as_mut_ptr();
        let low4 = _mm512_set1_epi16(0xF);
        // SAFETY: as in `v4_accumulate_pairs` (hg here a multiple of 16); masked loads read only the n weights of a row, and
        // an odd last token is paired with itself at weight 0.
        unsafe {
            for gi in 0..per {
                let wm = v4_group_weights::<R>(w, scale, min, gi * m, n, ws);
                let mut unit = [0f32; R];
                for (r, unit) in unit.iter_mut().enumerate() {
                    let row = ws.add(r * n);
                    let mut mx = _mm512_setzero_ps();
                    for j in (0..n).step_by(16) {
                        let k = _cvtu32_mask16((1u32 << (n - j).min(16)) - 1);
                        mx = _mm512_max_ps(mx, _mm512_maskz_loadu_ps(k, row.add(j)));
                    }
                    let mx = _mm512_reduce_max_ps(mx);
                    *unit = mx / 32767.0;
                    let inv = _mm512_set1_ps(if mx > 0.0 { 32767.0 / mx } else { 0.0 });
                    for j in (0..n).step_by(16) {
                        let k = _cvtu32_mask16((1u32 << (n - j).min(16)) - 1);
                        let q = _mm512_cvtps_epi32(_mm512_mul_ps(
                            _mm512_maskz_loadu_ps(k, row.add(j)),
                            inv,
                        ));
                        // 16 words = 8 pair lanes (tokens j + 2i low, j + 2i + 1 high).
                        _mm256_storeu_si256(
                            wp[r].as_mut_ptr().add(j / 2).cast(),
                            _mm512_cvtepi32_epi16(q),
                        );
                    }
                }
                for i0 in (0..hg).step_by(16) {
                    let c = [gi * g + i0, gi * g + hg + i0];
                    let mut a = [[_mm512_setzero_si512(); 2]; R];
                    let src = codes.as_ptr().add(gi * hg + i0);
                    let pass = (gi * hg + i0) / 16;
                    for p in 0..pairs {
                        let i = pass * pairs + p;
                        ahead.lines(i * step, (i + 1) * step);
                        let (j0, j1) = (2 * p, (2 * p + 1).min(n - 1));
                        let b0 = _mm_loadu_si128(src.add(j0 * d / 2).cast());
                        let b1 = _mm_loadu_si128(src.add(j1 * d / 2).cast());
                        // Word 2i = token j0's byte i, word 2i + 1 = token j1's.
                        let x = _mm512_cvtepu8_epi16(_mm256_set_m128i(
                            _mm_unpackhi_epi8(b0, b1),
                            _mm_unpacklo_epi8(b0, b1),
                        ));
                        let lo = _mm512_and_si512(x, low4);
                        let hi = _mm512_srli_epi16::<4>(x);
                        for (r, a) in a.iter_mut().enumerate() {
                            let wv = _mm512_set1_epi32(*wp[r].get_unchecked(p));
                            a[0] = _mm512_dpwssd_epi32(a[0], lo, wv);
                            a[1] = _mm512_dpwssd_epi32(a[1], hi, wv);
                        }
                    }
                    for (r, a) in a.iter().enumerate() {
                        let (cv, mv, uv) = (
                            _mm512_set1_ps(corr[r]),
                            _mm512_set1_ps(wm[r]),
                            _mm512_set1_ps(unit[r]),
                        );
                        for (a, c) in a.iter().zip(c) {
                            let o = ap.add(r * d + c);
                            let base = _mm512_fmadd_ps(_mm512_loadu_ps(o), cv, mv);
                            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(*a), uv, base));
                        }
                    }
                }
            }
        }
    }

    /// V4 accumulation as 16-bit integer dot products with AVX2 (`vpmaddwd`):
    /// per row and group the weights times the tokens' scales are rounded to
    /// 16-bit words as in [`v4_accumulate_words`] (same bound), then eight
    /// code bytes of two tokens are interleaved, widened to words, and each
    /// `vpmaddwd` adds both tokens' products for eight channels (low
    /// nibbles) or the eight channels half a group on (high nibbles).
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn v4_accumulate_pairs<const R: usize>(
        acc: &mut [f32],
        corr: &[f32],
        w: &[f32],
        codes: &[u8],
        scale: &[f32],
        min: &[f32],
        g: usize,
        n: usize,
        m: usize,
        d: usize,
        ahead: Ahead,
    ) {
        const PAIRS: usize = super::MAX_V4_TOKENS / 2;
        let (per, hg, pairs) = (d / g, g / 2, n.div_ceil(2));
        // One prefetch step per (8-byte pass, token pair).
        let step = ahead.per(d / 16 * pairs);
        // Row r's weights of one group, 16 at a time (zero past n).
        let mut ws = [0f32; 4 * super::MAX_V4_TOKENS + 16];
        // Row r's weight words, two tokens per 32-bit lane (token 2p low).
        let mut wp = [[0i32; PAIRS + 8]; R];
        let ap = acc.as_mut_ptr();
        let low4 = _mm256_set1_epi16(0xF);
        // SAFETY: n ≤ MAX_V4_TOKENS and R ≤ 4 (the caller), so ws[r·n + j]
        // and wp[r][p] stay in their buffers and only written values are
        // read (words past n are written as 0); acc holds R·d values, w R·n,
        // codes m·d/2 (n ≤ m), scale and min per·m (the caller); every
        // channel is < d because g divides d and hg is a multiple of 8; an
        // odd last token is paired with itself at weight 0.
        unsafe {
            let wsp = ws.as_mut_ptr();
            for gi in 0..per {
                let wm = v4_group_weights::<R>(w, scale, min, gi * m, n, wsp);
                let mut unit = [0f32; R];
                for (r, unit) in unit.iter_mut().enumerate() {
                    let row = wsp.add(r * n);
                    // ws ≥ 0 (softmax weights × scales), so the largest is
                    // the largest magnitude; lanes past n are read as 0.
                    let mut mx = _mm256_setzero_ps();
                    let mut j = 0;
                    while j + 8 <= n {
                        mx = _mm256_max_ps(mx, _mm256_loadu_ps(row.add(j)));
                        j += 8;
                    }
                    let mut mx = hmax8(mx);
                    for j in j..n {
                        mx = mx.max(*row.add(j));
                    }
                    *unit = mx / 32767.0;
                    let words = wp[r].as_mut_ptr().cast::<i16>();
                    let full = n / 16 * 16;
                    to_words(row, mx, full, words);
                    let inv = if mx > 0.0 { 32767.0 / mx } else { 0.0 };
                    for j in full..2 * pairs {
                        let x = if j < n { *row.add(j) } else { 0.0 };
                        *words.add(j) = (x * inv).round_ties_even() as i16;
                    }
                }
                for i0 in (0..hg).step_by(8) {
                    let c = [gi * g + i0, gi * g + hg + i0];
                    let mut a = [[_mm256_setzero_si256(); 2]; R];
                    let src = codes.as_ptr().add(gi * hg + i0);
                    let pass = (gi * hg + i0) / 8;
                    for p in 0..pairs {
                        let i = pass * pairs + p;
                        ahead.lines(i * step, (i + 1) * step);
                        let (j0, j1) = (2 * p, (2 * p + 1).min(n - 1));
                        let b0 = _mm_loadl_epi64(src.add(j0 * d / 2).cast());
                        let b1 = _mm_loadl_epi64(src.add(j1 * d / 2).cast());
                        // Word 2i = token j0's byte i, word 2i + 1 = token j1's.
                        let x = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(b0, b1));
                        let lo = _mm256_and_si256(x, low4);
                        let hi = _mm256_srli_epi16::<4>(x);
                        for (r, a) in a.iter_mut().enumerate() {
                            let wv = _mm256_set1_epi32(*wp[r].get_unchecked(p));
                            a[0] = _mm256_add_epi32(a[0], _mm256_madd_epi16(lo, wv));
                            a[1] = _mm256_add_epi32(a[1], _mm256_madd_epi16(hi, wv));
                        }
                    }
                    for (r, a) in a.iter().enumerate() {
                        let (cv, mv, uv) = (
                            _mm256_set1_ps(corr[r]),
                            _mm256_set1_ps(wm[r]),
                            _mm256_set1_ps(unit[r]),
                        );
                        for (a, c) in a.iter().zip(c) {
                            let o = ap.add(r * d + c);
                            let base = _mm256_fmadd_ps(_mm256_loadu_ps(o), cv, mv);
                            _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(*a), uv, base));
                        }
                    }
                }
            }
        }
    }

    /// [`super::to_group_major`] for four groups, eight tokens at a time:
    /// two 4 × 4 transposes (one per 128-bit half: even and odd tokens),
    /// then the halves interleaved back into token order.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn group_major4(src: &[f32], dst: &mut [f32], n: usize) {
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        // SAFETY: tokens j + 8 ≤ n: src[j·4 .. j·4 + 32] and dst[g·n + j .. + 8]
        // are inside the slices (4·n values each, checked by the caller).
        unsafe {
            for j in (0..n / 8 * 8).step_by(8) {
                let s = src.as_ptr().add(j * 4);
                // Lane 0 of r0..r3: tokens 0, 2, 4, 6; lane 1: 1, 3, 5, 7.
                let r = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(s.add(o)));
                let (u0, u1) = (
                    _mm256_unpacklo_ps(r[0], r[1]),
                    _mm256_unpackhi_ps(r[0], r[1]),
                );
                let (u2, u3) = (
                    _mm256_unpacklo_ps(r[2], r[3]),
                    _mm256_unpackhi_ps(r[2], r[3]),
                );
                let g = [
                    _mm256_shuffle_ps::<0x44>(u0, u2),
                    _mm256_shuffle_ps::<0xEE>(u0, u2),
                    _mm256_shuffle_ps::<0x44>(u1, u3),
                    _mm256_shuffle_ps::<0xEE>(u1, u3),
                ];
                for (gi, v) in g.into_iter().enumerate() {
                    let v = _mm256_permutevar8x32_ps(v, order);
                    _mm256_storeu_ps(dst.as_mut_ptr().add(gi * n + j), v);
                }
            }
        }
    }

    /// [`super::to_group_major`] for two groups, eight tokens at a time.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn group_major2(src: &[f32], dst: &mut [f32], n: usize) {
        // SAFETY: tokens j + 8 ≤ n: src[j·2 .. j·2 + 16] and dst[g·n + j .. + 8]
        // are inside the slices (2·n values each, checked by the caller).
        unsafe {
            for j in (0..n / 8 * 8).step_by(8) {
                let s = src.as_ptr().add(j * 2);
                let (a, b) = (_mm256_loadu_ps(s), _mm256_loadu_ps(s.add(8)));
                // Per 128-bit half: tokens (0, 1, 4, 5) then (2, 3, 6, 7);
                // the 64-bit permute puts them back in order.
                for (gi, v) in [
                    _mm256_shuffle_ps::<0x88>(a, b),
                    _mm256_shuffle_ps::<0xDD>(a, b),
                ]
                .into_iter()
                .enumerate()
                {
                    let v = _mm256_castpd_ps(_mm256_permute4x64_pd::<0xD8>(_mm256_castps_pd(v)));
                    _mm256_storeu_ps(dst.as_mut_ptr().add(gi * n + j), v);
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
    fn hmax8(a: __m256) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_max_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
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
                group_scores(&q, rows, k, n, d, &mut out, &[]);
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
                group_accumulate(&mut acc, &corr, &w, k, n, d, &[]);
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

    /// K5 keys and V4 values read in place give what the decoded tile gives,
    /// for a whole tile and for the first `n < m` tokens of it (a causal
    /// prefill row), in every row-group size; the portable loops (`get`) too.
    /// The AVX-512 K5 kernel (heads of 128) gives the AVX2 integer kernel's
    /// scores bit for bit: both form exact integer sums of the same words.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx512_k5_scores_equal_the_avx2_kernel_bit_for_bit() {
        use crate::codec::Codec;
        if !has_avx512_vnni() {
            eprintln!("no AVX-512 VNNI here (or SILICEO_KERNELS_NO_AVX512): nothing to compare");
            return;
        }
        let (t, d) = (64, 128);
        let x: Vec<f32> = (0..t * d)
            .map(|i| {
                ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % d == 9) as u8 as f32 * 7.0)
            })
            .collect();
        let mut seg = vec![0u8; Codec::K5.segment_bytes(t, d)];
        Codec::K5.encode(&x, t, d, &mut seg);
        let ahead: Vec<u8> = vec![1; 3000];
        for (r0, r1) in [(0, 64), (7, 40), (63, 64)] {
            let mut params = vec![0f32; 2 * d];
            let (nib, high) = Codec::K5.k5_rows(&seg, t, d, r0..r1, &mut params).unwrap();
            let (scale, min) = params.split_at(d);
            let n = r1 - r0;
            let q: Vec<f32> = (0..4 * d).map(|i| (i as f32 * 0.61).cos() * 3.0).collect();
            for take in 1..=4 {
                let (mut got, mut want) = (vec![0f32; take * n], vec![1f32; take * n]);
                // SAFETY: AVX-512/AVX2 checked above; the slices hold take rows
                // of 128 values, n tokens and take·n scores.
                unsafe {
                    let pf = x86::Ahead::of(&ahead);
                    by_rows!(
                        take,
                        x86::k5_scores_zmm(&q, nib, high, scale, min, n, &mut got, pf)
                    );
                    let none = x86::Ahead::of(&[]);
                    by_rows!(
                        take,
                        x86::k5_scores_words(&q, nib, high, scale, min, n, d, &mut want, none)
                    );
                }
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "rows {take}, tokens {r0}..{r1}, score {i}"
                    );
                }
            }
        }
    }

    /// The AVX-512 V4 accumulation (16-bit weights; groups of 32 and 64)
    /// stays within its documented bound of the AVX2 kernel's f32 result:
    /// `n · max_j ws_j / 65534 · 15` per value.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn v4_word_accumulation_stays_within_its_bound() {
        use crate::codec::Codec;
        if !has_avx2_fma() {
            eprintln!("no AVX2 here (or SILICEO_KERNELS_PORTABLE): nothing to compare");
            return;
        }
        let zmm = has_avx512_vnni();
        let t = 64;
        let ahead: Vec<u8> = vec![1; 3000];
        for (d, group) in [
            (128, 32u16),
            (128, 64),
            (64, 32),
            (256, 32),
            (64, 16),
            (128, 16),
        ] {
            let x: Vec<f32> = (0..t * d)
                .map(|i| (i * 6007 % 997) as f32 / 498.0 - 1.0)
                .collect();
            let codec = Codec::V4 { group };
            let mut seg = vec![0u8; codec.segment_bytes(t, d)];
            codec.encode(&x, t, d, &mut seg);
            for (r0, r1) in [(0, 64), (9, 30)] {
                let m = r1 - r0;
                let mut params = vec![0f32; 4 * (m + 1) * d];
                let (codes, g) = codec.v4_rows(&seg, t, d, r0..r1, &mut params).unwrap();
                let per = m * (d / g);
                let (scale, min) = params[..2 * per].split_at(per);
                let rows = Rows::V4 {
                    codes,
                    scale,
                    min,
                    group: g,
                };
                for n in [m, m - 3] {
                    for take in 1..=4 {
                        let corr: Vec<f32> = (0..take).map(|r| 0.25 + r as f32 / 8.0).collect();
                        let w: Vec<f32> = (0..take * n)
                            .map(|i| ((i * 13) % 11) as f32 / 11.0)
                            .collect();
                        let start: Vec<f32> =
                            (0..take * d).map(|i| (i as f32 * 0.3).sin()).collect();
                        // Exact sums over the decoded values.
                        let want: Vec<f64> = (0..take * d)
                            .map(|i| {
                                let (r, c) = (i / d, i % d);
                                let sum: f64 = (0..n)
                                    .map(|j| f64::from(w[r * n + j]) * f64::from(rows.get(j, c, d)))
                                    .sum();
                                f64::from(start[i]) * f64::from(corr[r]) + sum
                            })
                            .collect();
                        let mut kernels = vec![("AVX2", start.clone())];
                        if zmm && g % 32 == 0 {
                            kernels.push(("AVX-512", start.clone()));
                        }
                        for (k, (name, got)) in kernels.iter_mut().enumerate() {
                            // SAFETY: AVX2 (and, for the second, AVX-512)
                            // checked above; the slices hold take rows of d
                            // values, take·n weights, m ≥ n tokens.
                            unsafe {
                                let pf = x86::Ahead::of(&ahead);
                                if k == 0 {
                                    by_rows!(
                                        take,
                                        x86::v4_accumulate_pairs(
                                            got, &corr, &w, codes, scale, min, g, n, m, d, pf
                                        )
                                    );
                                } else {
                                    by_rows!(
                                        take,
                                        x86::v4_accumulate_words(
                                            got, &corr, &w, codes, scale, min, g, n, m, d, pf
                                        )
                                    );
                                }
                            }
                            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                                let (r, gi) = (i / d, i % d / g);
                                let wmax = (0..n)
                                    .map(|j| w[r * n + j] * scale[gi * m + j])
                                    .fold(0f32, f32::max);
                                let bound = f64::from(n as f32 * wmax / 65534.0 * 15.0)
                                    + 1e-5 * (1.0 + b.abs());
                                assert!(
                                    (f64::from(*a) - b).abs() <= bound,
                                    "{name} d {d} g {g} rows {take} n {n} [{i}]: {a} vs {b} (bound {bound})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The AVX-512 accumulation over F32, F16 and KV8 rows (groups of 16 and
    /// 32; heads of 16, 48, 128: a half-width last pass too) gives the AVX2
    /// kernel's result bit for bit.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx512_plain_accumulation_equals_the_avx2_kernel_bit_for_bit() {
        if !has_avx512_vnni() {
            eprintln!("no AVX-512 VNNI here (or SILICEO_KERNELS_NO_AVX512): nothing to compare");
            return;
        }
        let ahead: Vec<u8> = vec![1; 5000];
        for (n, d) in [(1, 16), (17, 48), (64, 128)] {
            let xf: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.23).cos()).collect();
            let xh: Vec<u8> = xf
                .iter()
                .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
                .collect();
            let codes: Vec<u8> = (0..n * d)
                .map(|i| ((i * 53 % 255) as i32 - 127) as i8 as u8)
                .collect();
            let scales: Vec<f32> = (0..n * d / 16).map(|i| 0.02 + i as f32 * 0.003).collect();
            for rows in [
                x86::Plain::F32(&xf),
                x86::Plain::F16(&xh),
                x86::Plain::Kv8 {
                    codes: &codes,
                    scales: &scales,
                    shift: 4,
                },
                x86::Plain::Kv8 {
                    codes: &codes,
                    scales: &scales,
                    shift: if d % 32 == 0 { 5 } else { 4 },
                },
            ] {
                for take in 1..=4 {
                    let corr: Vec<f32> = (0..take).map(|r| 0.75 - r as f32 / 9.0).collect();
                    let w: Vec<f32> = (0..take * n)
                        .map(|i| ((i * 5) % 13) as f32 / 13.0)
                        .collect();
                    let mut got: Vec<f32> = (0..take * d).map(|i| (i as f32 * 0.7).sin()).collect();
                    let mut want = got.clone();
                    // SAFETY: AVX-512/AVX2 checked above; the slices hold take
                    // rows of d values, take·n weights and n tokens.
                    unsafe {
                        let pf = x86::Ahead::of(&ahead);
                        by_rows!(
                            take,
                            x86::group_accumulate_zmm(&mut got, &corr, &w, rows, n, d, pf)
                        );
                        let none = x86::Ahead::of(&[]);
                        by_rows!(
                            take,
                            x86::group_accumulate(&mut want, &corr, &w, rows, n, d, none)
                        );
                    }
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(a.to_bits(), b.to_bits(), "n {n} d {d} rows {take} [{i}]");
                    }
                }
            }
        }
    }

    /// The integer KV8 scores (groups of 32: AVX2 for heads of 32–256,
    /// AVX-512 for heads of 64 and 128) agree with exact dot products over the decoded keys within the documented bound for a
    /// query rounded to 16-bit words: `max|q| / 65534 · Σ_c |k_c|`.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn kv8_word_scores_stay_within_their_bound() {
        if !has_avx2_fma() {
            eprintln!("no AVX2 here (or SILICEO_KERNELS_PORTABLE): nothing to compare");
            return;
        }
        let ahead: Vec<u8> = vec![1; 2000];
        for d in [32, 64, 128, 256] {
            let groups = d / 32;
            for n in [1, 2, 37, 64] {
                let codes: Vec<u8> = (0..n * d)
                    .map(|i| ((i * 97 % 255) as i32 - 127) as i8 as u8)
                    .collect();
                let scales: Vec<f32> = (0..n * groups)
                    .map(|i| 0.005 + (i % 9) as f32 * 0.004)
                    .collect();
                let k = |j: usize, c: usize| {
                    codes[j * d + c] as i8 as f64 * scales[j * groups + c / 32] as f64
                };
                // One outlier channel, as real queries have.
                let q: Vec<f32> = (0..4 * d)
                    .map(|i| (i as f32 * 0.41).sin() * if i % d == 17 { 12.0 } else { 1.0 })
                    .collect();
                for take in 1..=4 {
                    let mut kernels = vec![("AVX2", vec![0f32; take * n])];
                    if (d == 64 || d == 128) && has_avx512_vnni() {
                        kernels.push(("AVX-512", vec![0f32; take * n]));
                    }
                    for (i, (name, got)) in kernels.iter_mut().enumerate() {
                        let pf = x86::Ahead::of(&ahead);
                        // SAFETY: AVX2 (and for the second, AVX-512) checked
                        // above; q holds take rows of d, codes and scales n
                        // tokens, got take·n scores.
                        unsafe {
                            if i == 0 {
                                by_rows!(
                                    take,
                                    x86::kv8_scores_words(&q, &codes, &scales, n, d, got, pf)
                                );
                            } else if d == 64 {
                                by_rows!(
                                    take,
                                    x86::kv8_scores_zmm::<64>(&q, &codes, &scales, n, got, pf)
                                );
                            } else {
                                by_rows!(
                                    take,
                                    x86::kv8_scores_zmm::<128>(&q, &codes, &scales, n, got, pf)
                                );
                            }
                        }
                        for r in 0..take {
                            let qr = &q[r * d..(r + 1) * d];
                            let qmax = qr.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
                            for j in 0..n {
                                let exact: f64 = (0..d).map(|c| qr[c] as f64 * k(j, c)).sum();
                                let mass: f64 = (0..d).map(|c| k(j, c).abs()).sum();
                                let bound = qmax / 65534.0 * mass + 1e-6 * (1.0 + exact.abs());
                                let err = (got[r * n + j] as f64 - exact).abs();
                                assert!(
                                    err <= bound,
                                    "{name} d {d} n {n} row {r} token {j}: error {err} > bound {bound}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn packed_rows_in_place_match_the_decoded_tile() {
        use crate::codec::Codec;
        for d in [64usize, 128, 256] {
            let t = 64;
            let x: Vec<f32> = (0..t * d)
                .map(|i| {
                    ((i * 7919 % 1000) as f32 / 500.0 - 1.0)
                        * (1.0 + (i % d == 3) as u8 as f32 * 9.0)
                })
                .collect();
            for (codec, value) in [
                (Codec::K5, false),
                (Codec::V4, true),
                (Codec::V4 { group: 64 }, true),
                (Codec::V4 { group: 16 }, true),
            ] {
                let mut seg = vec![0u8; codec.segment_bytes(t, d)];
                codec.encode(&x, t, d, &mut seg);
                for (r0, r1) in [(0, 64), (16, 48), (5, 6)] {
                    let m = r1 - r0;
                    let mut tile = vec![0f32; m * d];
                    codec.decode_rows(&seg, t, d, r0..r1, &mut tile);
                    let mut params = vec![0f32; 4 * (m + 1) * d];
                    let rows = match codec {
                        Codec::K5 => {
                            let (nib, high) =
                                codec.k5_rows(&seg, t, d, r0..r1, &mut params).unwrap();
                            let (scale, min) = params[..2 * d].split_at(d);
                            Rows::K5 {
                                nib,
                                high,
                                scale,
                                min,
                            }
                        }
                        _ => {
                            let (codes, group) =
                                codec.v4_rows(&seg, t, d, r0..r1, &mut params).unwrap();
                            let per = m * (d / group);
                            let (scale, min) = params[..2 * per].split_at(per);
                            Rows::V4 {
                                codes,
                                scale,
                                min,
                                group,
                            }
                        }
                    };
                    for j in 0..m {
                        for c in 0..d {
                            assert_eq!(
                                rows.get(j, c, d),
                                tile[j * d + c],
                                "{codec:?} d={d} [{j}][{c}]"
                            );
                        }
                    }
                    for rows_n in [1, 3, 4, 6] {
                        for n in [m, m.div_ceil(2)] {
                            let q: Vec<f32> =
                                (0..rows_n * d).map(|i| (i as f32 * 0.37).sin()).collect();
                            let (mut got, mut want) =
                                (vec![0f32; rows_n * n], vec![0f32; rows_n * n]);
                            let mut acc: Vec<f32> =
                                (0..rows_n * d).map(|i| i as f32 / 100.0).collect();
                            let mut acc_want = acc.clone();
                            let corr: Vec<f32> =
                                (0..rows_n).map(|r| 0.5 + r as f32 / 10.0).collect();
                            let w: Vec<f32> =
                                (0..rows_n * n).map(|i| (i % 7) as f32 / 7.0).collect();
                            if value {
                                group_accumulate(&mut acc, &corr, &w, rows, n, d, &[]);
                                group_accumulate(
                                    &mut acc_want,
                                    &corr,
                                    &w,
                                    Rows::F32(&tile),
                                    n,
                                    d,
                                    &[],
                                );
                                // The AVX-512 path rounds each row's w·scale to
                                // 16 bits per group: at most n · max / 65534 · 15.
                                let Rows::V4 { scale, group, .. } = rows else {
                                    unreachable!()
                                };
                                for (i, (a, b)) in acc.iter().zip(&acc_want).enumerate() {
                                    let (r, gi) = (i / d, i % d / group);
                                    let wmax = (0..n)
                                        .map(|j| w[r * n + j] * scale[gi * m + j])
                                        .fold(0f32, f32::max);
                                    let bound = n as f32 * wmax / 65534.0 * 15.0;
                                    assert!(
                                        (a - b).abs() < bound + 1e-4 * (1.0 + b.abs()),
                                        "{codec:?} d={d} n={n}: {a} vs {b}"
                                    );
                                }
                            } else {
                                group_scores(&q, rows_n, rows, n, d, &mut got, &[]);
                                group_scores(&q, rows_n, Rows::F32(&tile), n, d, &mut want, &[]);
                                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                                    // The integer path rounds q·scale to 16 bits per row:
                                    // at most half a step times the sum of the codes.
                                    let r = i / n;
                                    let Rows::K5 { scale, .. } = rows else {
                                        unreachable!()
                                    };
                                    let qmax = (0..d)
                                        .map(|c| (q[r * d + c] * scale[c]).abs())
                                        .fold(0f32, f32::max);
                                    let words = k5_in_place(d) && d % 128 == 0;
                                    let bound = if words {
                                        qmax / 65534.0 * 31.0 * d as f32
                                    } else {
                                        0.0
                                    };
                                    assert!(
                                        (a - b).abs() < bound + 1e-4 * (1.0 + b.abs()),
                                        "{codec:?} d={d} n={n}: {a} vs {b} (bound {bound})"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn group_major_matches_the_plain_transpose() {
        for per in [1, 2, 4, 8] {
            for n in [1, 7, 8, 9, 64, 67] {
                let src: Vec<f32> = (0..n * per).map(|i| i as f32).collect();
                let mut dst = vec![0f32; n * per];
                to_group_major(&src, per, &mut dst);
                for j in 0..n {
                    for g in 0..per {
                        assert_eq!(dst[g * n + j], src[j * per + g], "per={per} n={n}");
                    }
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
