// Paged attention over siliceo's KV formats, for Turing (sm_75) and newer.
//
// The memory layout is the CPU crate's (crates/kernels-turing/src/store.rs and
// codec.rs): a sealed block holds, for each KV head, a K segment then a V
// segment in the layout's codecs; a tail block holds the same in F16. Block
// tables are u32 indices into the two pools. Q comes pre-scaled (and
// Hadamard-rotated when the layout rotates K) from the host.
//
// Kernels (extern "C", names stable; the Rust loader in cuda.rs uses them):
//   siliceo_attn_decode_<k>_<v>_d<D>_g<GT>  (D = 64, 128, 256, 512) one query token per sequence;
//       grid (kv_heads, sequences, partitions), 128 threads; each CTA serves
//       the G ≤ GT query heads of one KV head over one partition of the
//       context (GT = 1, 2, 4, 8, or up to 4 for D = 512: G rounded up to a
//       power of two). With one
//       partition it writes the output, else partial (max, sum, acc) rows.
//   siliceo_attn_reduce               merges the partitions of each head.
//   siliceo_kv_append                 writes new K/V rows (f32) into tail
//       blocks as f16 (the F16 tail of recent tokens).
//   siliceo_kv_seal_<k>_<v>           quantizes one full tail block into a
//       sealed block (the tail block ageing out), all heads.
//   siliceo_kv_write_strided          grafted serving: writes a step's K/V
//       rows straight from llama.cpp's tensors (any strides, f16 or f32)
//       into tail blocks, K Hadamard-rotated when asked.
//   siliceo_gather_q                  grafted serving: llama.cpp's Q (any
//       strides) into the decode kernel's pre-scaled, rotated query rows.
//   siliceo_kv_copy_rows              copies token rows of one tail block
//       into another (copy-on-write, token-tree branches).
//
// Codec ids: 0 F16, 1 KV8 (int8 + f16 scale per group), 2 K5 (5-bit per
// channel across the block), 3 V4 (4-bit per token per group).

#include <cuda_fp16.h>
#include <stdint.h>

// Dynamic shared memory (the CPU emulator in kernels/emu defines its own).
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

// K/V loads go through gload(): a plain load on a GPU. The CPU emulator
// defines TRACE_LOAD to see which bytes each warp-wide load touches (how many
// 32-byte sectors it costs), so coalescing is checked without a GPU.
#ifndef TRACE_LOAD
#define TRACE_LOAD(p, bytes)
#endif
template <class T>
__device__ __forceinline__ T gload(const T* p) {
    TRACE_LOAD(p, sizeof(T));
    return *p;
}

#define WARPS 4
#define THREADS (WARPS * 32)
#define F16 0
#define KV8 1
#define K5 2
#define V4 3

__device__ __forceinline__ int seg_bytes(int codec, int T, int D, int g) {
    switch (codec) {
    case KV8: return T * (D / g) * 2 + T * D;
    case K5: return D * 4 + T * D / 2 + T * D / 8;
    case V4: return T * (D / g) * 4 + T * D / 2;
    default: return T * D * 2;
    }
}

struct Tables {
    const uint8_t* sealed;
    const uint8_t* tail;
    const uint32_t* sealed_tab;  // [S][max_sealed]
    const uint32_t* tail_tab;    // [S][max_tail]
    const int* seq_len;          // [S]
    const int* n_sealed;         // [S]
    int max_sealed, max_tail;
};

// Eight consecutive channels c0..c0+7 of row `t` of a segment, dequantized
// (fused into the attention loops), in a few vector loads per lane (groups are
// a multiple of 8 channels, c0 a multiple of 8, so the eight channels' bits
// sit side by side): F16 one 16-byte load; KV8 one 8-byte load plus the
// group's scale; K5 the channels' scales and minima (16 bytes each) and one
// 8-byte load from each bit plane (low nibbles, fifth bits); V4 the group's
// scale and minimum and one 8-byte load of nibbles (4 bytes for groups of 8).
template <int C>
__device__ __forceinline__ void row8(const uint8_t* seg, int T, int D, int g, int t, int c0, float* x) {
    if constexpr (C == F16) {
        uint4 u = gload(reinterpret_cast<const uint4*>(seg + ((size_t)t * D + c0) * 2));
        const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 f = __half22float2(h[i]);
            x[2 * i] = f.x;
            x[2 * i + 1] = f.y;
        }
    } else if constexpr (C == KV8) {
        const __half* scales = reinterpret_cast<const __half*>(seg);
        const float sc = __half2float(gload(&scales[t * (D / g) + c0 / g]));
        uint2 u = gload(reinterpret_cast<const uint2*>(seg + T * (D / g) * 2 + (size_t)t * D + c0));
        const int8_t* b = reinterpret_cast<const int8_t*>(&u);
#pragma unroll
        for (int i = 0; i < 8; i++) x[i] = sc * (float)b[i];
    } else if constexpr (C == K5) {
        const int half_d = D / 2, e = D / 8;
        const uint4 su = gload(reinterpret_cast<const uint4*>(seg + c0 * 2));
        const uint4 mu = gload(reinterpret_cast<const uint4*>(seg + D * 2 + c0 * 2));
        const uint8_t* planes = seg + D * 4;
        const uint2 lu = gload(reinterpret_cast<const uint2*>(planes + (size_t)t * half_d + c0 % half_d));
        const uint2 hu = gload(reinterpret_cast<const uint2*>(planes + (size_t)T * half_d + (size_t)t * e + c0 % e));
        const __half* sc = reinterpret_cast<const __half*>(&su);
        const __half* mn = reinterpret_cast<const __half*>(&mu);
        const uint8_t* lo = reinterpret_cast<const uint8_t*>(&lu);
        const uint8_t* hi = reinterpret_cast<const uint8_t*>(&hu);
        const int lshift = (c0 / half_d) * 4, hshift = c0 / e;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int code = ((lo[i] >> lshift) & 0xF) | (((hi[i] >> hshift) & 1) << 4);
            x[i] = __half2float(mn[i]) + __half2float(sc[i]) * (float)code;
        }
    } else {
        static_assert(C == V4, "row8 reads F16, KV8, K5 and V4");
        const int ng = T * (D / g), hg = g / 2;
        const int gi = t * (D / g) + c0 / g, j = c0 % g;
        const __half* params = reinterpret_cast<const __half*>(seg);
        const float sc = __half2float(gload(&params[gi])), mn = __half2float(gload(&params[ng + gi]));
        const uint8_t* nib = seg + ng * 4 + (size_t)gi * hg;
        if (hg >= 8) {
            // Channels j..j+7 of the group: bytes j % hg.., one nibble each.
            const uint2 u = gload(reinterpret_cast<const uint2*>(nib + j % hg));
            const uint8_t* b = reinterpret_cast<const uint8_t*>(&u);
            const int shift = (j / hg) * 4;
#pragma unroll
            for (int i = 0; i < 8; i++) x[i] = mn + sc * (float)((b[i] >> shift) & 0xF);
        } else {
            // Groups of 8: the group's 4 bytes, low nibbles then high.
            const uint32_t u = gload(reinterpret_cast<const uint32_t*>(nib));
#pragma unroll
            for (int i = 0; i < 8; i++) x[i] = mn + sc * (float)((u >> ((i % 4) * 8 + (i / 4) * 4)) & 0xF);
        }
    }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// What a row's accumulated values are multiplied by at the end: 1 / l, or
// with an attention sink (a logit that joins the softmax's denominator and
// weighs no value) e^(m−t) / (l·e^(m−t) + e^(sink−t)), t the larger of the
// row's maximum m and the sink.
__device__ __forceinline__ float row_norm(float l, float m, const float* sinks, int head) {
    if (!sinks) return 1.f / l;
    const float sink = sinks[head], t = fmaxf(m, sink), c = __expf(m - t);
    return c / (l * c + __expf(sink - t));
}

// One CTA's partition of one sequence's context, for one KV head: where
// each of its tokens' K and V rows live.
struct Partition {
    Tables tb;
    int s, kh, start, n, T, ns, kg, vg, ksb, vsb, sealed_bb, tail_seg, tail_bb;

    // Eight channels from c0 of the K (V = false) or V row of the partition's
    // token j, dequantized; zeros for j past the end.
    template <int D, int KC, int VC, bool V>
    __device__ __forceinline__ void row(int j, int c0, float* x) const {
        if (j >= n) {
#pragma unroll
            for (int i = 0; i < 8; i++) x[i] = 0.f;
            return;
        }
        const int tok = start + j, b = tok / T, r = tok % T;
        if (b < ns) {
            const uint8_t* seg =
                tb.sealed + (size_t)tb.sealed_tab[s * tb.max_sealed + b] * sealed_bb + kh * (ksb + vsb);
            if (V) row8<VC>(seg + ksb, T, D, vg, r, c0, x);
            else row8<KC>(seg, T, D, kg, r, c0, x);
        } else {
            const uint8_t* seg = tb.tail + (size_t)tb.tail_tab[s * tb.max_tail + (b - ns)] * tail_bb + kh * 2 * tail_seg;
            row8<F16>(seg + (V ? tail_seg : 0), T, D, 0, r, c0, x);
        }
    }
};

// Decode attention for one KV head of one sequence over one partition of
// its context, for the GT (≥ G, a power of two) query heads that share the
// KV head; every loop over heads is unrolled so per-head values stay in
// registers.
//
// A token's row is read by LPT = D/8 lanes (at most 32), eight channels each
// (one 16-byte load for F16); heads of 512 take NC = 2 such reads per lane, of
// channels c0 and c0 + 256 (LPT = 32). A warp covers TPW = 32/LPT tokens per
// load and keeps U such loads in flight before using them. Scores go to shared memory, then the
// softmax over the partition (a warp per head), then V the same way as K,
// summed over a warp's token groups by shuffles and over warps in shared
// memory.
//
// A sliding window (window > 0) hides the partition's tokens before
// len − window: their scores are not used and a partition wholly before it
// writes an empty partial (sum 0, which the reduction skips).
//
// Shared memory: qs[GT][D] | scores[GT][part_tokens] | red[WARPS][GT][D].
template <int D, int KC, int VC, int GT, int U>
__device__ void attn_decode(float* out, float* part_m, float* part_l, float* part_acc, const float* q,
                            Tables tb, int H, int KVH, int T, int kg, int vg, int part_tokens, int P,
                            const int* tokens, int window, const float* sinks) {
    constexpr int NC = D > 256 ? D / 256 : 1, CH = D / NC;  // channel chunks per lane, each CH wide
    constexpr int LPT = CH / 8, TPW = 32 / LPT, STEP = WARPS * TPW * U;
    static_assert(LPT <= 32 && CH * NC == D, "heads of 64, 128, 256 or 512");
    DYNAMIC_SHARED(float, smem);
    float* qs = smem;
    float* sc = qs + GT * D;
    float* red = sc + GT * part_tokens;
    __shared__ float m_s[GT], l_s[GT];

    const int kh = blockIdx.x, s = blockIdx.y, p = blockIdx.z;
    const int G = H / KVH;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sub = lane / LPT, c0 = (lane % LPT) * 8;
    // The batch token whose query, output and partial rows are sequence s's.
    const size_t tok = tokens ? tokens[s] : s;
    const int len = tb.seq_len[s];
    const int start = p * part_tokens;
    const int n = max(0, min(len, start + part_tokens) - start);
    // The partition's first token inside the window.
    const int j0 = window > 0 ? min(n, max(0, len - window - start)) : 0;
    const int ksb = seg_bytes(KC, T, D, kg), vsb = seg_bytes(VC, T, D, vg);
    const Partition pt = {tb, s, kh, start, n, T, tb.n_sealed[s], kg, vg, ksb, vsb, KVH * (ksb + vsb), T * D * 2,
                          KVH * 2 * T * D * 2};

    for (int i = threadIdx.x; i < GT * D; i += THREADS)
        qs[i] = i < G * D ? q[(tok * H + kh * G) * D + i] : 0.f;
    __syncthreads();

    float qr[GT][8 * NC];
#pragma unroll
    for (int g = 0; g < GT; g++)
#pragma unroll
        for (int h = 0; h < NC; h++)
#pragma unroll
            for (int i = 0; i < 8; i++) qr[g][h * 8 + i] = qs[g * D + h * CH + c0 + i];

    // Scores. The loop bound is the same for every lane of a warp (the
    // shuffles need all 32); lanes past the end load nothing.
    for (int base = 0; base < n; base += STEP) {
        float k[U][8 * NC];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int h = 0; h < NC; h++)
                pt.row<D, KC, VC, false>(base + (u * WARPS + warp) * TPW + sub, h * CH + c0, k[u] + h * 8);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int j = base + (u * WARPS + warp) * TPW + sub;
#pragma unroll
            for (int g = 0; g < GT; g++) {
                float x = 0.f;
#pragma unroll
                for (int i = 0; i < 8 * NC; i++) x += qr[g][i] * k[u][i];
#pragma unroll
                for (int o = LPT / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
                if (lane % LPT == 0 && j < n) sc[g * part_tokens + j] = x;
            }
        }
    }
    __syncthreads();

    // Softmax over the partition: a warp per query head.
    for (int g = warp; g < GT; g += WARPS) {
        float m = -INFINITY;
        for (int j = j0 + lane; j < n; j += 32) m = fmaxf(m, sc[g * part_tokens + j]);
        m = warp_max(m);
        float l = 0.f;
        for (int j = j0 + lane; j < n; j += 32) {
            float e = __expf(sc[g * part_tokens + j] - m);
            sc[g * part_tokens + j] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) {
            m_s[g] = n > j0 ? m : -INFINITY;
            l_s[g] = l;
        }
    }
    __syncthreads();

    // V: the same token mapping as K; acc holds this lane's eight channels.
    float acc[GT][8 * NC];
#pragma unroll
    for (int g = 0; g < GT; g++)
#pragma unroll
        for (int i = 0; i < 8 * NC; i++) acc[g][i] = 0.f;
    for (int base = 0; base < n; base += STEP) {
        float v[U][8 * NC];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int h = 0; h < NC; h++)
                pt.row<D, KC, VC, true>(base + (u * WARPS + warp) * TPW + sub, h * CH + c0, v[u] + h * 8);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int j = base + (u * WARPS + warp) * TPW + sub;
            if (j >= j0 && j < n) {
#pragma unroll
                for (int g = 0; g < GT; g++) {
                    const float w = sc[g * part_tokens + j];
#pragma unroll
                    for (int i = 0; i < 8 * NC; i++) acc[g][i] += w * v[u][i];
                }
            }
        }
    }
    // Sum the warp's TPW token groups (lanes with the same channels), then
    // the warps through shared memory.
#pragma unroll
    for (int g = 0; g < GT; g++)
#pragma unroll
        for (int i = 0; i < 8 * NC; i++)
#pragma unroll
            for (int o = LPT; o < 32; o <<= 1) acc[g][i] += __shfl_xor_sync(0xffffffffu, acc[g][i], o);
    if (sub == 0) {
#pragma unroll
        for (int g = 0; g < GT; g++)
#pragma unroll
            for (int h = 0; h < NC; h++)
#pragma unroll
                for (int i = 0; i < 8; i++) red[(warp * GT + g) * D + h * CH + c0 + i] = acc[g][h * 8 + i];
    }
    __syncthreads();
    for (int x = threadIdx.x; x < G * D; x += THREADS) {
        int g = x / D, c = x % D;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) v += red[(w * GT + g) * D + c];
        size_t row = tok * H + kh * G + g;
        if (P == 1) {
            out[row * D + c] = v * row_norm(l_s[g], m_s[g], sinks, kh * G + g);
        } else {
            part_acc[(row * P + p) * D + c] = v;
            if (c == 0) {
                part_m[row * P + p] = m_s[g];
                part_l[row * P + p] = l_s[g];
            }
        }
    }
}

// U: K or V rows each lane loads before it uses them (loads in flight).
// The default, 4 (2 for eight heads, whose registers are fuller), has no
// suffix; F16 heads of 128 also come with _u1/_u2/_u4/_u8 so one GPU run can
// compare them (`bench --gpu --loads`).
#define DECODE_U(NAME, KC, VC, D, GT, U, SUFFIX)                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) siliceo_attn_decode_##NAME##_d##D##_g##GT##SUFFIX(  \
        float* out, float* part_m, float* part_l, float* part_acc, const float* q, const uint8_t* sealed,      \
        const uint8_t* tail, const uint32_t* sealed_tab, const uint32_t* tail_tab, const int* seq_len,        \
        const int* n_sealed, int max_sealed, int max_tail, int H, int KVH, int T, int kg, int vg,             \
        int part_tokens, int P, const int* tokens, int window, const float* sinks) {                          \
        Tables tb = {sealed, tail, sealed_tab, tail_tab, seq_len, n_sealed, max_sealed, max_tail};            \
        attn_decode<D, KC, VC, GT, U>(out, part_m, part_l, part_acc, q, tb, H, KVH, T, kg, vg, part_tokens,    \
                                      P, tokens, window, sinks);                                              \
    }
#define DECODE(NAME, KC, VC, D, GT) DECODE_U(NAME, KC, VC, D, GT, (GT >= 8 ? 2 : 4), )

#define DECODE_GROUPS(NAME, KC, VC, D) \
    DECODE(NAME, KC, VC, D, 1)         \
    DECODE(NAME, KC, VC, D, 2)         \
    DECODE(NAME, KC, VC, D, 4)         \
    DECODE(NAME, KC, VC, D, 8)

#define DECODE_LOADS(GT)                                 \
    DECODE_U(f16_f16, F16, F16, 128, GT, 1, _u1)         \
    DECODE_U(f16_f16, F16, F16, 128, GT, 2, _u2)         \
    DECODE_U(f16_f16, F16, F16, 128, GT, 4, _u4)         \
    DECODE_U(f16_f16, F16, F16, 128, GT, 8, _u8)

DECODE_LOADS(1)
DECODE_LOADS(2)
DECODE_LOADS(4)
DECODE_LOADS(8)

DECODE_GROUPS(f16_f16, F16, F16, 64)
DECODE_GROUPS(f16_f16, F16, F16, 128)
DECODE_GROUPS(f16_f16, F16, F16, 256)
DECODE_GROUPS(kv8_kv8, KV8, KV8, 64)
DECODE_GROUPS(kv8_kv8, KV8, KV8, 128)
DECODE_GROUPS(kv8_kv8, KV8, KV8, 256)
DECODE_GROUPS(k5_v4, K5, V4, 64)
DECODE_GROUPS(k5_v4, K5, V4, 128)
DECODE_GROUPS(k5_v4, K5, V4, 256)
// Heads of 512 (Gemma 4's global layers): up to four query heads per KV
// head, what 64 KiB of shared memory holds (qs, scores and the warps' sums
// of eight heads of 512 alone are 80 KiB), with U = 2 (two 8-channel reads
// per lane and load).
#define DECODE_512(NAME, KC, VC)              \
    DECODE_U(NAME, KC, VC, 512, 1, 2, )       \
    DECODE_U(NAME, KC, VC, 512, 2, 2, )       \
    DECODE_U(NAME, KC, VC, 512, 4, 2, )
DECODE_512(f16_f16, F16, F16)
DECODE_512(kv8_kv8, KV8, KV8)
DECODE_512(k5_v4, K5, V4)

// Prefill attention: one CTA serves R query rows of one KV head — consecutive
// (token, query head) pairs of one query run, the run's tokens in order and
// the G heads of the KV head within each — over one partition of the run's
// context. The partition is read KT keys at a time: a tile's K rows are
// dequantized into shared memory once for all R rows (where the decode
// kernel reads them once per token), its scores masked causally (token j of
// the run sees the first len0 + j tokens), an online softmax keeps each
// row's running maximum and sum, then the tile's V rows are read the same way
// and summed into the rows' outputs.
//
// tiles[5·y]: the run's sequence (its block table), the tile's first row in
// the run (row x is token x / G, head x % G), the tile's rows (≤ R), the
// run's first batch token, and the tokens the run's first token sees (len0).
// Queries, outputs and partial rows are the batch token's (as the decode
// kernel's with a token map). With several partitions it writes partial
// (max, sum, acc) rows for siliceo_attn_reduce.
//
// Threads: scores as 16 row groups × 8 key lanes (RM rows × KM keys each,
// keys k·8 + lane so a row group's 8 lanes read 8 different K rows in
// different banks); V as D/8 channel groups × 128/(D/8) row groups (eight
// channels × RO rows each).
//
// Shared memory: qs[R][D + 4] | kvs[KT][D + 4] | ps[R][KT], f32 (rows padded
// by 4 floats so 16-byte reads of neighbouring rows fall in other banks).
template <int D>
struct PrefillTile {
    static constexpr int R = D <= 128 ? 32 : 16;  // query rows per CTA
    static constexpr int KT = 4096 / D;           // keys per tile: 64, 32, 16, 8
    static constexpr int RP = D + 4;              // a padded row in shared memory
    static constexpr int RM = R / 16, KM = KT / 8;
    static constexpr int CG = D / 8, RO = R / (THREADS / CG);
};

// The partition's keys kb.. kb + KT (K or V rows) into kvs, dequantized.
template <int D, int KC, int VC, bool V>
__device__ __forceinline__ void prefill_tile_rows(const Partition& pt, int kb, float* kvs) {
    using P = PrefillTile<D>;
    const int c0 = (threadIdx.x % P::CG) * 8;
    for (int t = threadIdx.x / P::CG; t < P::KT; t += THREADS / P::CG) {
        float x[8];
        pt.row<D, KC, VC, V>(kb + t, c0, x);
        float4* dst = reinterpret_cast<float4*>(kvs + t * P::RP + c0);
        dst[0] = make_float4(x[0], x[1], x[2], x[3]);
        dst[1] = make_float4(x[4], x[5], x[6], x[7]);
    }
}

template <int D, int KC, int VC>
__device__ void attn_prefill(float* out, float* part_m, float* part_l, float* part_acc, const float* q,
                             Tables tb, const int* tiles, int H, int KVH, int T, int kg, int vg,
                             int part_tokens, int P, int window, const float* sinks) {
    using PT = PrefillTile<D>;
    constexpr int R = PT::R, KT = PT::KT, RP = PT::RP, RM = PT::RM, KM = PT::KM, CG = PT::CG, RO = PT::RO;
    DYNAMIC_SHARED(float, smem);
    float* qs = smem;
    float* kvs = qs + R * RP;
    float* ps = kvs + KT * RP;
    __shared__ float corr_s[R], m_s[R], l_s[R];

    const int kh = blockIdx.x, p = blockIdx.z;
    const int* tile = tiles + 5 * blockIdx.y;
    const int seq = tile[0], row0 = tile[1], rows = tile[2], token0 = tile[3], len0 = tile[4];
    const int G = H / KVH, tid = threadIdx.x;
    const int start = p * part_tokens;
    // Tokens of the partition the tile's last row sees (the most of any).
    const int n = max(0, min(len0 + (row0 + rows - 1) / G, start + part_tokens) - start);
    const int ksb = seg_bytes(KC, T, D, kg), vsb = seg_bytes(VC, T, D, vg);
    const Partition pt = {tb, seq, kh, start, n, T, tb.n_sealed[seq], kg, vg, ksb, vsb, KVH * (ksb + vsb), T * D * 2,
                          KVH * 2 * T * D * 2};

    for (int i = tid; i < R * D; i += THREADS) {
        const int r = i / D, x = row0 + r;
        qs[r * RP + i % D] =
            r < rows ? q[((size_t)(token0 + x / G) * H + kh * G + x % G) * D + i % D] : 0.f;
    }

    // Scores: rows sr.. sr + RM, keys lane + 8·k of each tile.
    const int sr = (tid / 8) * RM, lane8 = tid % 8;
    float m[RM], l[RM];
    int sees[RM];  // keys of the partition row sr + i sees: from[i].. sees[i]
    int from[RM];  // (a sliding window hides the keys before from[i])
#pragma unroll
    for (int i = 0; i < RM; i++) {
        m[i] = -INFINITY;
        l[i] = 0.f;
        sees[i] = sr + i < rows ? min(n, len0 + (row0 + sr + i) / G - start) : 0;
        from[i] = window > 0 ? max(0, len0 + (row0 + sr + i) / G - window - start) : 0;
    }
    // V: rows vr.. vr + RO, channels c0.. c0 + 8.
    const int vr = (tid / CG) * RO, c0 = (tid % CG) * 8;
    float acc[RO][8];
#pragma unroll
    for (int i = 0; i < RO; i++)
#pragma unroll
        for (int c = 0; c < 8; c++) acc[i][c] = 0.f;

    for (int kb = 0; kb < n; kb += KT) {
        __syncthreads();  // the last tile's V and weights are used up (and qs is written)
        prefill_tile_rows<D, KC, VC, false>(pt, kb, kvs);
        __syncthreads();
        float s[RM][KM];
#pragma unroll
        for (int i = 0; i < RM; i++)
#pragma unroll
            for (int k = 0; k < KM; k++) s[i][k] = 0.f;
        for (int d = 0; d < D; d += 4) {
            float4 qv[RM], kv[KM];
#pragma unroll
            for (int i = 0; i < RM; i++) qv[i] = *reinterpret_cast<const float4*>(qs + (sr + i) * RP + d);
#pragma unroll
            for (int k = 0; k < KM; k++) kv[k] = *reinterpret_cast<const float4*>(kvs + (k * 8 + lane8) * RP + d);
#pragma unroll
            for (int i = 0; i < RM; i++)
#pragma unroll
                for (int k = 0; k < KM; k++)
                    s[i][k] += qv[i].x * kv[k].x + qv[i].y * kv[k].y + qv[i].z * kv[k].z + qv[i].w * kv[k].w;
        }
#pragma unroll
        for (int i = 0; i < RM; i++) {
            float tmax = -INFINITY;
#pragma unroll
            for (int k = 0; k < KM; k++) {
                if (kb + k * 8 + lane8 >= sees[i] || kb + k * 8 + lane8 < from[i]) s[i][k] = -INFINITY;
                tmax = fmaxf(tmax, s[i][k]);
            }
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
            const float mn = fmaxf(m[i], tmax);
            // Nothing seen yet: the row keeps its zeros.
            const float corr = mn == -INFINITY ? 1.f : __expf(m[i] - mn);
            float sum = 0.f;
#pragma unroll
            for (int k = 0; k < KM; k++) {
                const float e = mn == -INFINITY ? 0.f : __expf(s[i][k] - mn);
                ps[(sr + i) * KT + k * 8 + lane8] = e;
                sum += e;
            }
#pragma unroll
            for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            l[i] = l[i] * corr + sum;
            m[i] = mn;
            if (lane8 == 0) corr_s[sr + i] = corr;
        }
        __syncthreads();  // K used up; weights and corrections written
        prefill_tile_rows<D, KC, VC, true>(pt, kb, kvs);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < RO; i++) {
            const float corr = corr_s[vr + i];
#pragma unroll
            for (int c = 0; c < 8; c++) acc[i][c] *= corr;
        }
        for (int t = 0; t < KT; t++) {
            const float4 v0 = *reinterpret_cast<const float4*>(kvs + t * RP + c0);
            const float4 v1 = *reinterpret_cast<const float4*>(kvs + t * RP + c0 + 4);
#pragma unroll
            for (int i = 0; i < RO; i++) {
                const float w = ps[(vr + i) * KT + t];
                acc[i][0] += w * v0.x;
                acc[i][1] += w * v0.y;
                acc[i][2] += w * v0.z;
                acc[i][3] += w * v0.w;
                acc[i][4] += w * v1.x;
                acc[i][5] += w * v1.y;
                acc[i][6] += w * v1.z;
                acc[i][7] += w * v1.w;
            }
        }
    }
    if (lane8 == 0) {
#pragma unroll
        for (int i = 0; i < RM; i++) {
            m_s[sr + i] = m[i];
            l_s[sr + i] = l[i];
        }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < RO; i++) {
        const int r = vr + i, x = row0 + r;
        if (r >= rows) continue;
        const size_t row = (size_t)(token0 + x / G) * H + kh * G + x % G;
        if (P == 1) {
            const float f = row_norm(l_s[r], m_s[r], sinks, kh * G + x % G);
#pragma unroll
            for (int c = 0; c < 8; c++) out[row * D + c0 + c] = acc[i][c] * f;
        } else {
#pragma unroll
            for (int c = 0; c < 8; c++) part_acc[(row * P + p) * D + c0 + c] = acc[i][c];
            if (c0 == 0) {
                part_m[row * P + p] = m_s[r];
                part_l[row * P + p] = l_s[r];
            }
        }
    }
}

#define PREFILL(NAME, KC, VC, D)                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) siliceo_attn_prefill_##NAME##_d##D(                \
        float* out, float* part_m, float* part_l, float* part_acc, const float* q, const uint8_t* sealed,      \
        const uint8_t* tail, const uint32_t* sealed_tab, const uint32_t* tail_tab, const int* seq_len,        \
        const int* n_sealed, int max_sealed, int max_tail, const int* tiles, int H, int KVH, int T, int kg,   \
        int vg, int part_tokens, int P, int window, const float* sinks) {                                     \
        Tables tb = {sealed, tail, sealed_tab, tail_tab, seq_len, n_sealed, max_sealed, max_tail};            \
        attn_prefill<D, KC, VC>(out, part_m, part_l, part_acc, q, tb, tiles, H, KVH, T, kg, vg, part_tokens, \
                                P, window, sinks);                                                            \
    }
#define PREFILL_DIMS(NAME, KC, VC) \
    PREFILL(NAME, KC, VC, 64)      \
    PREFILL(NAME, KC, VC, 128)     \
    PREFILL(NAME, KC, VC, 256)     \
    PREFILL(NAME, KC, VC, 512)

PREFILL_DIMS(f16_f16, F16, F16)
PREFILL_DIMS(kv8_kv8, KV8, KV8)
PREFILL_DIMS(k5_v4, K5, V4)

// Grid (H, S), D threads: merges P partial rows per head. Row y's batch
// token is tokens[y] (y itself when tokens is null).
extern "C" __global__ void siliceo_attn_reduce(float* out, const float* part_m, const float* part_l,
                                               const float* part_acc, int H, int D, int P, const int* tokens,
                                               const float* sinks) {
    const size_t row = (size_t)(tokens ? tokens[blockIdx.y] : blockIdx.y) * H + blockIdx.x;
    const int c = threadIdx.x;
    if (c >= D) return;
    float m = -INFINITY;
    for (int p = 0; p < P; p++) m = fmaxf(m, part_m[row * P + p]);
    float l = 0.f, v = 0.f;
    for (int p = 0; p < P; p++) {
        float pl = part_l[row * P + p];
        if (pl == 0.f) continue;
        float w = __expf(part_m[row * P + p] - m);
        l += pl * w;
        v += part_acc[(row * P + p) * D + c] * w;
    }
    out[row * D + c] = v * row_norm(l, m, sinks, blockIdx.x);
}

// One thread per (token, head, channel): row `slot_row[i]` of tail block
// `slot_block[i]` gets token i's K and V as f16.
extern "C" __global__ void siliceo_kv_append(uint8_t* tail, const float* k, const float* v,
                                             const uint32_t* slot_block, const int* slot_row, int n, int KVH,
                                             int D, int T) {
    size_t x = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (x >= (size_t)n * KVH * D) return;
    int c = x % D, h = (x / D) % KVH, i = x / ((size_t)D * KVH);
    size_t seg = (size_t)T * D * 2;
    uint8_t* base = tail + (size_t)slot_block[i] * KVH * 2 * seg + h * 2 * seg;
    reinterpret_cast<__half*>(base)[slot_row[i] * D + c] = __float2half(k[x]);
    reinterpret_cast<__half*>(base + seg)[slot_row[i] * D + c] = __float2half(v[x]);
}

// Scale and minimum of an asymmetric code with `levels` steps, as the CPU
// codec, bit for bit: the top-code check multiplies and adds with separate
// roundings (`_rn`: nvcc would otherwise fuse them into one FMA, and a
// borderline scale would differ from the CPU's), so a block sealed here
// holds the same bytes as one the CPU store seals.
__device__ __forceinline__ void quant_params(float lo, float hi, float levels, __half* scale, __half* minv) {
    __half mn = __float2half(lo);
    float step = fmaxf(hi - __half2float(mn), 0.f) / levels;
    __half sc = __float2half(step);
    if (__fadd_rn(__fmul_rn(__half2float(sc), levels), __half2float(mn)) < hi)
        sc = __ushort_as_half(__half_as_ushort(sc) + 1);
    *scale = sc;
    *minv = mn;
}

// Scale and minimum (stored as the CPU codec stores them) of the `n` values
// src[i · stride]; returns the decoded minimum and 1 / scale for asym_code.
__device__ __forceinline__ float2 asym_params(const __half* src, int n, int stride, float levels, __half* scale,
                                              __half* minv) {
    float lo = INFINITY, hi = -INFINITY;
    for (int i = 0; i < n; i++) {
        float x = __half2float(src[i * stride]);
        lo = fminf(lo, x);
        hi = fmaxf(hi, x);
    }
    quant_params(lo, hi, levels, scale, minv);
    const float sf = __half2float(*scale);
    return make_float2(__half2float(*minv), sf > 0.f ? 1.f / sf : 0.f);
}

// The code of x on the grid asym_params returned: nearest step, 0..top.
__device__ __forceinline__ int asym_code(__half x, float2 p, float top) {
    return (int)fminf(fmaxf(roundf((__half2float(x) - p.x) * p.y), 0.f), top);
}

// Quantizes one segment (T × D f16 in `src`) with codec C into `dst`.
// codes: shared scratch of T × D bytes.
template <int C>
__device__ void seal_segment(const __half* src, uint8_t* dst, int T, int D, int g, uint8_t* codes) {
    const int tid = threadIdx.x;
    if (C == F16) {
        for (int i = tid; i < T * D; i += blockDim.x) reinterpret_cast<__half*>(dst)[i] = src[i];
        return;
    }
    if (C == KV8) {
        __half* scales = reinterpret_cast<__half*>(dst);
        int8_t* out = reinterpret_cast<int8_t*>(dst + T * (D / g) * 2);
        for (int gi = tid; gi < T * (D / g); gi += blockDim.x) {
            float amax = 0.f;
            for (int j = 0; j < g; j++) amax = fmaxf(amax, fabsf(__half2float(src[gi * g + j])));
            __half s = __float2half(amax / 127.f);
            scales[gi] = s;
            float sf = __half2float(s), inv = sf > 0.f ? 1.f / sf : 0.f;
            for (int j = 0; j < g; j++)
                out[gi * g + j] = (int8_t)fminf(fmaxf(roundf(__half2float(src[gi * g + j]) * inv), -127.f), 127.f);
        }
        return;
    }
    if (C == K5) {
        __half* params = reinterpret_cast<__half*>(dst);
        for (int c = tid; c < D; c += blockDim.x) {
            const float2 p = asym_params(src + c, T, D, 31.f, &params[c], &params[D + c]);
            for (int t = 0; t < T; t++) codes[t * D + c] = (uint8_t)asym_code(src[t * D + c], p, 31.f);
        }
        __syncthreads();
        uint8_t* nib = dst + D * 4;
        uint8_t* high = nib + T * D / 2;
        int half_d = D / 2, e = D / 8;
        for (int x = tid; x < T * half_d; x += blockDim.x) {
            int t = x / half_d, j = x % half_d;
            nib[x] = (codes[t * D + j] & 0xF) | ((codes[t * D + j + half_d] & 0xF) << 4);
        }
        for (int x = tid; x < T * e; x += blockDim.x) {
            int t = x / e, j = x % e;
            uint8_t b = 0;
            for (int i = 0; i < 8; i++) b |= ((codes[t * D + j + i * e] >> 4) & 1) << i;
            high[x] = b;
        }
        return;
    }
    // V4
    int ng = T * (D / g), hg = g / 2;
    __half* params = reinterpret_cast<__half*>(dst);
    uint8_t* nib = dst + ng * 4;
    for (int gi = tid; gi < ng; gi += blockDim.x) {
        const float2 p = asym_params(src + gi * g, g, 1, 15.f, &params[gi], &params[ng + gi]);
        for (int j = 0; j < hg; j++) {
            int a = asym_code(src[gi * g + j], p, 15.f);
            int b = asym_code(src[gi * g + j + hg], p, 15.f);
            nib[gi * hg + j] = (uint8_t)(a | (b << 4));
        }
    }
}

// Grid (KVH, 2): y = 0 seals K, y = 1 seals V of head x. Dynamic shared
// memory: T × D bytes (K5's codes).
#define SEAL(NAME, KC, VC)                                                                                 \
    extern "C" __global__ void siliceo_kv_seal_##NAME(uint8_t* sealed, const uint8_t* tail, uint32_t src,  \
                                                       uint32_t dst, int KVH, int D, int T, int kg, int vg) { \
        DYNAMIC_SHARED(uint8_t, codes);                                                                 \
        const int h = blockIdx.x, which = blockIdx.y;                                                      \
        const int ksb = seg_bytes(KC, T, D, kg), vsb = seg_bytes(VC, T, D, vg);                            \
        size_t tseg = (size_t)T * D * 2;                                                                   \
        const __half* s = reinterpret_cast<const __half*>(tail + (size_t)src * KVH * 2 * tseg +            \
                                                          (2 * h + which) * tseg);                         \
        uint8_t* d = sealed + (size_t)dst * KVH * (ksb + vsb) + h * (ksb + vsb) + which * ksb;             \
        if (which == 0) seal_segment<KC>(s, d, T, D, kg, codes);                                           \
        else seal_segment<VC>(s, d, T, D, vg, codes);                                                      \
    }

SEAL(f16_f16, F16, F16)
SEAL(kv8_kv8, KV8, KV8)
SEAL(k5_v4, K5, V4)

// ---------------------------------------------------------------------------
// Grafted serving: llama.cpp computes Q, K and V of a layer on the device; the
// kernels below take them from its tensors as they lie (a `[D, tokens, heads]`
// view with byte strides nb0, nb1, nb2, f16 or f32 elements).

__device__ __forceinline__ float strided_elem(const uint8_t* base, int f16, size_t off) {
    if (f16) return __half2float(*reinterpret_cast<const __half*>(base + off));
    return *reinterpret_cast<const float*>(base + off);
}

// The normalised Walsh–Hadamard transform of the D values in shared `xs`, one
// thread per value (blockDim.x == D), as the CPU's `hadamard`: the same
// butterflies in the same order, each sum rounded once, then × norm.
__device__ __forceinline__ float rotate_shared(float* xs, int c, int D, float norm) {
    __syncthreads();
    for (int h = 1; h < D; h *= 2) {
        if ((c & h) == 0) {
            float u = xs[c], w = xs[c + h];
            xs[c] = __fadd_rn(u, w);
            xs[c + h] = __fsub_rn(u, w);
        }
        __syncthreads();
    }
    return __fmul_rn(xs[c], norm);
}

// Grid (KVH, n), D threads, D floats of dynamic shared memory: batch token i's
// K and V of head h (element c at c·nb0 + i·nb1 + h·nb2) go to row
// slot_row[i] of tail block slot_block[i] as f16; K rotated when `rotate`.
extern "C" __global__ void siliceo_kv_write_strided(uint8_t* tail, const uint8_t* k, const uint8_t* v,
                                                    int k_f16, int v_f16, unsigned k_nb0, unsigned k_nb1,
                                                    unsigned k_nb2, unsigned v_nb0, unsigned v_nb1,
                                                    unsigned v_nb2, const uint32_t* slot_block,
                                                    const int* slot_row, int KVH, int D, int T, int rotate,
                                                    float norm) {
    DYNAMIC_SHARED(float, xs);
    const int h = blockIdx.x, i = blockIdx.y, c = threadIdx.x;
    float x = strided_elem(k, k_f16, (size_t)c * k_nb0 + (size_t)i * k_nb1 + (size_t)h * k_nb2);
    if (rotate) {
        xs[c] = x;
        x = rotate_shared(xs, c, D, norm);
    }
    const float y = strided_elem(v, v_f16, (size_t)c * v_nb0 + (size_t)i * v_nb1 + (size_t)h * v_nb2);
    const size_t seg = (size_t)T * D * 2;
    uint8_t* base = tail + (size_t)slot_block[i] * KVH * 2 * seg + h * 2 * seg;
    reinterpret_cast<__half*>(base)[slot_row[i] * D + c] = __float2half(x);
    reinterpret_cast<__half*>(base + seg)[slot_row[i] * D + c] = __float2half(y);
}

// Grid (H, n), D threads, D floats of dynamic shared memory: query head h of
// batch token i, × scale and rotated when `rotate` (as the host prepares
// queries for the decode kernel), into q[(i·H + h)·D + c].
extern "C" __global__ void siliceo_gather_q(float* q, const uint8_t* src, int f16, unsigned nb0, unsigned nb1,
                                            unsigned nb2, int H, int D, float scale, int rotate, float norm) {
    DYNAMIC_SHARED(float, xs);
    const int h = blockIdx.x, i = blockIdx.y, c = threadIdx.x;
    float x = strided_elem(src, f16, (size_t)c * nb0 + (size_t)i * nb1 + (size_t)h * nb2) * scale;
    if (rotate) {
        xs[c] = x;
        x = rotate_shared(xs, c, D, norm);
    }
    q[((size_t)i * H + h) * D + c] = x;
}

// Grid (ceil(rows·D / 256), KVH, 2), 256 threads: rows row0.. row0 + rows of
// tail block src, K (z = 0) or V (z = 1) of head y, into the same rows of dst.
extern "C" __global__ void siliceo_kv_copy_rows(uint8_t* tail, uint32_t src, uint32_t dst, int row0, int rows,
                                                int KVH, int D, int T) {
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    if (x >= rows * D) return;
    const size_t seg = (size_t)T * D * 2;
    const size_t off = (2 * blockIdx.y + blockIdx.z) * seg + ((size_t)row0 * D + x) * 2;
    const uint8_t* s = tail + (size_t)src * KVH * 2 * seg + off;
    uint8_t* d = tail + (size_t)dst * KVH * 2 * seg + off;
    *reinterpret_cast<__half*>(d) = *reinterpret_cast<const __half*>(s);
}
