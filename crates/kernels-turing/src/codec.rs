//! KV codecs: how the K or V values of one block and one KV head are stored.
//!
//! A *segment* holds `T` tokens × `D` channels (`T` = block size in tokens,
//! `D` = head dimension) of either K or V for one KV head of one block. Every
//! codec stores a segment in a fixed number of bytes ([`Codec::segment_bytes`]);
//! all multi-byte numbers are little-endian, half precision is IEEE binary16.
//!
//! | codec | layout of one segment (in this order) | bits / element (T=64, D=128, g=32) |
//! |---|---|---|
//! | `F16` | `x[t][d]` as f16 | 16 |
//! | `Kv8{g}` | scales `s[t][D/g]` f16, then codes `c[t][d]` i8 | 8.5 |
//! | `K5` | per channel `scale[d]` f16 then `min[d]` f16; low four bits `n[t][D/2]` (byte `j`: channel `j` in bits 0–3, channel `j + D/2` in bits 4–7); fifth bits `h[t][D/8]` (bit `i` of byte `j`: channel `j + i·D/8`) | 5.5 |
//! | `V4{g}` | per group `scale[t][D/g]` f16 then `min[t][D/g]` f16; codes `n[t][D/2]`, `g/2` bytes per group (byte `j` of group `G`: channel `G·g + j` in bits 0–3, `G·g + j + g/2` in bits 4–7) | 5.0 |
//!
//! Values decode as:
//! - `Kv8`: `x = s[t][d/g] · c[t][d]` (symmetric, codes in −127..=127, `s = max|x| / 127`
//!   over the group).
//! - `K5`: `x = min[d] + scale[d] · c` with `c` in 0..=31 (asymmetric, per channel *across
//!   the block's tokens*: keys have outlier channels, and grouping by channel gives
//!   each its own range).
//! - `V4`: `x = min + scale · c` with `c` in 0..=15, per token per group of `g` channels.
//!
//! **Error bounds** (checked by the tests, per element, `q` = the f16-rounded step):
//! `Kv8`: `|x − x̂| ≤ q/2 + 2⁻¹¹·|x|`; `K5`, `V4`: `|x − x̂| ≤ q/2 + 2⁻¹⁰·(|min| + |max|)`
//! (rounding to nearest code, plus the f16 rounding of the stored scale and minimum).
//!
//! The bit planes are laid out so that decoding a row is a few straight loops
//! over contiguous bytes (split nibbles, OR in the fifth bits, convert, scale):
//! the compiler vectorises them and the CUDA kernel reads them the same way.
//! `F16`: the f16 rounding of `x`.
//!
//! Why `Kv8` scales per group of 32 by default rather than per token and head:
//! see `docs/BENCHMARKS.md` ("KV8 scale granularity"): groups of 32 cost 0.5
//! bit/element instead of 0.125 and cut the mean reconstruction error of
//! model-like keys with outlier channels (the codec tests measure both).

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::KernelError;

/// How one segment (T tokens × D channels of K or V, one KV head, one block) is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// Half precision.
    F16,
    /// 8-bit symmetric, one f16 scale per token per group of `group` channels.
    Kv8 {
        /// Channels per scale (divides the head dimension).
        group: u16,
    },
    /// 5-bit asymmetric, one f16 scale and minimum per channel across the block's tokens.
    K5,
    /// 4-bit asymmetric, one f16 scale and minimum per token per group of `group` channels.
    V4 {
        /// Channels per scale and minimum (divides the head dimension).
        group: u16,
    },
}

impl Codec {
    /// KV8 with groups of 32 channels (the default).
    pub const KV8: Codec = Codec::Kv8 { group: 32 };
    /// V4 with groups of 32 channels (the default).
    pub const V4: Codec = Codec::V4 { group: 32 };

    /// Parses `f16`, `kv8`, `kv8/G` (G channels per scale; `kv8/head` = one per head), `k5`, `v4`, `v4/G`.
    pub fn parse(s: &str, head_dim: usize) -> Result<Codec, KernelError> {
        let bad = || {
            KernelError::Layout(format!(
                "unknown codec `{s}` (f16, kv8[/G|/head], k5, v4[/G])"
            ))
        };
        let (name, group) = match s.split_once('/') {
            Some((n, "head")) => (n, Some(head_dim)),
            Some((n, g)) => (n, Some(g.parse::<usize>().map_err(|_| bad())?)),
            None => (s, None),
        };
        let group = |default: u16| -> Result<u16, KernelError> {
            Ok(match group {
                Some(g) => u16::try_from(g).map_err(|_| bad())?,
                None => default,
            })
        };
        match name.to_ascii_lowercase().as_str() {
            "f16" if group(0)? == 0 => Ok(Codec::F16),
            "kv8" | "q8" => Ok(Codec::Kv8 { group: group(32)? }),
            "k5" if group(0)? == 0 => Ok(Codec::K5),
            "v4" => Ok(Codec::V4 { group: group(32)? }),
            _ => Err(bad()),
        }
    }

    /// Checks that the codec can store segments of `tokens` × `head_dim`.
    pub fn check(self, tokens: usize, head_dim: usize) -> Result<(), KernelError> {
        let err = |m: String| Err(KernelError::Layout(m));
        if head_dim == 0 || !head_dim.is_multiple_of(8) {
            return err(format!(
                "head dimension {head_dim} must be a positive multiple of 8"
            ));
        }
        if tokens == 0 {
            return err("a block must hold at least one token".into());
        }
        match self {
            Codec::Kv8 { group } | Codec::V4 { group } => {
                let g = group as usize;
                if g == 0 || !g.is_multiple_of(2) || !head_dim.is_multiple_of(g) {
                    return err(format!(
                        "{self:?}: group {g} must be even and divide the head dimension {head_dim}"
                    ));
                }
            }
            Codec::F16 | Codec::K5 => {}
        }
        Ok(())
    }

    /// Bytes of one segment of `tokens` × `head_dim`.
    pub fn segment_bytes(self, tokens: usize, head_dim: usize) -> usize {
        let (t, d) = (tokens, head_dim);
        match self {
            Codec::F16 => t * d * 2,
            Codec::Kv8 { group } => t * (d / group as usize) * 2 + t * d,
            Codec::K5 => d * 4 + t * d / 2 + t * d / 8,
            Codec::V4 { group } => t * (d / group as usize) * 4 + t * d / 2,
        }
    }

    /// Average bits per stored element, metadata included.
    pub fn bits_per_element(self, tokens: usize, head_dim: usize) -> f64 {
        self.segment_bytes(tokens, head_dim) as f64 * 8.0 / (tokens * head_dim) as f64
    }

    /// Whether the codec needs all the block's tokens at once (per-channel statistics).
    pub fn needs_full_block(self) -> bool {
        matches!(self, Codec::K5)
    }

    /// Encodes `x` (`tokens` × `head_dim`, row-major by token) into `out` (segment bytes).
    pub fn encode(self, x: &[f32], tokens: usize, head_dim: usize, out: &mut [u8]) {
        let (t, d) = (tokens, head_dim);
        assert_eq!(x.len(), t * d);
        assert_eq!(out.len(), self.segment_bytes(t, d));
        match self {
            Codec::F16 => {
                for (o, v) in out.chunks_exact_mut(2).zip(x) {
                    o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
                }
            }
            Codec::Kv8 { group } => {
                let g = group as usize;
                let (scales, codes) = out.split_at_mut(t * (d / g) * 2);
                for (gi, (xs, cs)) in x.chunks_exact(g).zip(codes.chunks_exact_mut(g)).enumerate() {
                    let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let s = f16::from_f32(amax / 127.0);
                    scales[gi * 2..gi * 2 + 2].copy_from_slice(&s.to_le_bytes());
                    let s = s.to_f32();
                    let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
                    for (c, v) in cs.iter_mut().zip(xs) {
                        *c = (v * inv).round().clamp(-127.0, 127.0) as i8 as u8;
                    }
                }
            }
            Codec::K5 => {
                let (params, rest) = out.split_at_mut(d * 4);
                let (nib, high) = rest.split_at_mut(t * d / 2);
                nib.fill(0);
                high.fill(0);
                for c in 0..d {
                    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
                    for r in 0..t {
                        lo = lo.min(x[r * d + c]);
                        hi = hi.max(x[r * d + c]);
                    }
                    let (scale, min) = quant_params(lo, hi, 31.0);
                    params[c * 2..c * 2 + 2].copy_from_slice(&scale.to_le_bytes());
                    params[d * 2 + c * 2..d * 2 + c * 2 + 2].copy_from_slice(&min.to_le_bytes());
                    let (scale, min) = (scale.to_f32(), min.to_f32());
                    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    for r in 0..t {
                        let code = ((x[r * d + c] - min) * inv).round().clamp(0.0, 31.0) as u8;
                        let (half, e) = (d / 2, d / 8);
                        nib[r * half + c % half] |= (code & 0xF) << (c / half * 4);
                        high[r * e + c % e] |= (code >> 4) << (c / e);
                    }
                }
            }
            Codec::V4 { group } => {
                let g = group as usize;
                let ng = t * (d / g);
                let (params, nib) = out.split_at_mut(ng * 4);
                nib.fill(0);
                for (gi, xs) in x.chunks_exact(g).enumerate() {
                    let (lo, hi) = xs
                        .iter()
                        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), v| {
                            (a.min(*v), b.max(*v))
                        });
                    let (scale, min) = quant_params(lo, hi, 15.0);
                    params[gi * 2..gi * 2 + 2].copy_from_slice(&scale.to_le_bytes());
                    params[ng * 2 + gi * 2..ng * 2 + gi * 2 + 2]
                        .copy_from_slice(&min.to_le_bytes());
                    let (scale, min) = (scale.to_f32(), min.to_f32());
                    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    for (j, v) in xs.iter().enumerate() {
                        let code = ((v - min) * inv).round().clamp(0.0, 15.0) as u8;
                        nib[gi * g / 2 + j % (g / 2)] |= code << (j / (g / 2) * 4);
                    }
                }
            }
        }
    }

    /// Decodes a whole segment into `out` (`tokens` × `head_dim` f32, row-major by token).
    pub fn decode(self, seg: &[u8], tokens: usize, head_dim: usize, out: &mut [f32]) {
        self.decode_rows(seg, tokens, head_dim, 0..tokens, out);
    }

    /// Decodes tokens `rows` of a segment into `out` (`rows.len()` × `head_dim`).
    /// This is the kernel's inner step: straight loops over contiguous memory
    /// that the compiler vectorises.
    pub fn decode_rows(
        self,
        seg: &[u8],
        tokens: usize,
        head_dim: usize,
        rows: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        let (t, d) = (tokens, head_dim);
        let (r0, r1) = (rows.start, rows.end);
        assert_eq!(seg.len(), self.segment_bytes(t, d));
        assert!(r0 <= r1 && r1 <= t);
        let out = &mut out[..(r1 - r0) * d];
        match self {
            Codec::F16 => {
                bytes_as_f16(&seg[r0 * d * 2..r1 * d * 2]).convert_to_f32_slice(out);
            }
            Codec::Kv8 { group } => {
                let g = group as usize;
                let (scales, codes) = seg.split_at(t * (d / g) * 2);
                let scales = &bytes_as_f16(scales)[r0 * (d / g)..r1 * (d / g)];
                let codes = &codes[r0 * d..r1 * d];
                for ((o, c), s) in out
                    .chunks_exact_mut(g)
                    .zip(codes.chunks_exact(g))
                    .zip(scales)
                {
                    let s = s.to_f32();
                    for (o, c) in o.iter_mut().zip(c) {
                        *o = s * (*c as i8) as f32;
                    }
                }
            }
            Codec::K5 => {
                let mut params = [0f32; 2 * MAX_HEAD_DIM];
                let (nib, high) = k5_planes(seg, t, d, r0..r1, &mut params);
                let (scale, min) = params[..2 * d].split_at(d);
                for ((o, n), h) in out
                    .chunks_exact_mut(d)
                    .zip(nib.chunks_exact(d / 2))
                    .zip(high.chunks_exact(d / 8))
                {
                    crate::simd::k5_row(n, h, scale, min, o);
                }
            }
            Codec::V4 { group } => {
                let g = group as usize;
                let ng = t * (d / g);
                let (params, nib) = seg.split_at(ng * 4);
                let params = bytes_as_f16(params);
                let (scales, mins) = params.split_at(ng);
                let (g0, g1) = (r0 * (d / g), r1 * (d / g));
                for (((o, n), s), m) in out
                    .chunks_exact_mut(g)
                    .zip(nib[g0 * g / 2..g1 * g / 2].chunks_exact(g / 2))
                    .zip(&scales[g0..g1])
                    .zip(&mins[g0..g1])
                {
                    crate::simd::v4_group(n, s.to_f32(), m.to_f32(), o);
                }
            }
        }
    }

    /// For KV8 with a power-of-two group: the int8 codes of tokens `rows`
    /// (row-major) and log2 of the group, with the rows' scales written to
    /// `scales` as f32 — what the kernel reads without decoding a tile.
    pub fn kv8_rows<'s>(
        self,
        seg: &'s [u8],
        tokens: usize,
        head_dim: usize,
        rows: std::ops::Range<usize>,
        scales: &mut [f32],
    ) -> Option<(&'s [u8], u32)> {
        let Codec::Kv8 { group } = self else {
            return None;
        };
        let g = group as usize;
        if !g.is_power_of_two() {
            return None;
        }
        let (t, d) = (tokens, head_dim);
        let (sc, codes) = seg.split_at(t * (d / g) * 2);
        let per = d / g;
        bytes_as_f16(&sc[rows.start * per * 2..rows.end * per * 2])
            .convert_to_f32_slice(&mut scales[..rows.len() * per]);
        Some((&codes[rows.start * d..rows.end * d], g.trailing_zeros()))
    }

    /// For K5: the 4-bit and fifth-bit planes of tokens `rows` (`n[rows][D/2]`,
    /// `h[rows][D/8]`), with the per-channel scales then minimums written to
    /// `params` as f32 (`2·D` values) — what the kernel reads without a tile.
    pub fn k5_rows<'s>(
        self,
        seg: &'s [u8],
        tokens: usize,
        head_dim: usize,
        rows: std::ops::Range<usize>,
        params: &mut [f32],
    ) -> Option<(&'s [u8], &'s [u8])> {
        (self == Codec::K5).then(|| k5_planes(seg, tokens, head_dim, rows, params))
    }

    /// For V4: the codes of tokens `rows` (`D/2` bytes per token) and the group
    /// size, with the rows' scales then minimums written to `params` as f32,
    /// group-major (`scale[G][j]` for group `G` of token `j`, then `min[G][j]`,
    /// `D/g × rows.len()` each) so the kernel reads a group's column in
    /// straight lines. `params` holds at least `4 · rows.len() · D/g` values
    /// (the upper half is working space).
    pub fn v4_rows<'s>(
        self,
        seg: &'s [u8],
        tokens: usize,
        head_dim: usize,
        rows: std::ops::Range<usize>,
        params: &mut [f32],
    ) -> Option<(&'s [u8], usize)> {
        let Codec::V4 { group } = self else {
            return None;
        };
        let (t, d, g) = (tokens, head_dim, group as usize);
        let (per, n) = (d / g, rows.len());
        let ng = t * per;
        let (p, codes) = seg.split_at(ng * 4);
        let p = bytes_as_f16(p);
        let (g0, g1) = (rows.start * per, rows.end * per);
        let (out, work) = params[..4 * n * per].split_at_mut(2 * n * per);
        p[g0..g1].convert_to_f32_slice(&mut work[..n * per]);
        p[ng + g0..ng + g1].convert_to_f32_slice(&mut work[n * per..]);
        for (src, dst) in work
            .chunks_exact(n * per)
            .zip(out.chunks_exact_mut(n * per))
        {
            crate::simd::to_group_major(src, per, dst);
        }
        Some((&codes[rows.start * d / 2..rows.end * d / 2], g))
    }

    /// The largest error [`Codec::decode`] may make on one element of a group whose
    /// values are `x` (a row's group for Kv8/V4, a channel's column for K5); see the
    /// module docs.
    pub fn error_bound(self, x: &[f32]) -> f32 {
        let (lo, hi) = x
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), v| {
                (a.min(*v), b.max(*v))
            });
        let amax = lo.abs().max(hi.abs());
        let f16_rel = 1.0 / 2048.0;
        match self {
            Codec::F16 => amax * f16_rel + 6e-8,
            Codec::Kv8 { .. } => {
                let q = f16::from_f32(amax / 127.0).to_f32();
                q / 2.0 + amax * f16_rel + 1e-7
            }
            Codec::K5 | Codec::V4 { .. } => {
                let levels = if self == Codec::K5 { 31.0 } else { 15.0 };
                let (q, _) = quant_params(lo, hi, levels);
                q.to_f32() / 2.0 + (lo.abs() + hi.abs()) * 2.0 * f16_rel + 1e-7
            }
        }
    }
}

/// [`Codec::k5_rows`] for a segment known to be K5 (the one place that
/// knows where its planes start).
fn k5_planes<'s>(
    seg: &'s [u8],
    t: usize,
    d: usize,
    rows: std::ops::Range<usize>,
    params: &mut [f32],
) -> (&'s [u8], &'s [u8]) {
    let (p, rest) = seg.split_at(d * 4);
    let (nib, high) = rest.split_at(t * d / 2);
    bytes_as_f16(p).convert_to_f32_slice(&mut params[..2 * d]);
    let (half, e) = (d / 2, d / 8);
    (
        &nib[rows.start * half..rows.end * half],
        &high[rows.start * e..rows.end * e],
    )
}

/// Largest head dimension the codecs and kernels accept.
pub const MAX_HEAD_DIM: usize = 512;

/// Scale and minimum (both f16) for an asymmetric code with `levels` steps over `lo..=hi`.
fn quant_params(lo: f32, hi: f32, levels: f32) -> (f16, f16) {
    let min = f16::from_f32(lo);
    // The step is taken from the f16 minimum so the top code still reaches `hi`.
    let step = (hi - min.to_f32()).max(0.0) / levels;
    let mut scale = f16::from_f32(step);
    if scale.to_f32() * levels + min.to_f32() < hi {
        scale = f16::from_bits(scale.to_bits() + 1);
    }
    (scale, min)
}

/// Views little-endian f16 bytes as f16 values (alignment checked).
pub(crate) fn bytes_as_f16(b: &[u8]) -> &[f16] {
    // SAFETY: f16 is a plain 2-byte value with no invalid bit patterns; the
    // alignment and length are checked by `align_to`'s contract below.
    let (pre, mid, post) = unsafe { b.align_to::<f16>() };
    assert!(
        pre.is_empty() && post.is_empty(),
        "f16 data not 2-byte aligned"
    );
    mid
}
