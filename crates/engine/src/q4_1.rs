//! Q4_1 weight products for many tokens at once, on llama.cpp's own threads,
//! with llama.cpp's exact bits.
//!
//! llama.cpp has no batched Q4_1 product on x86 (llamafile's tinyBLAS and
//! the repacked and tiled paths do not take Q4_1), so a `MUL_MAT` over Q4_1
//! weights runs `ggml_vec_dot_q4_1_q8_1` once per (row, token): a step of 8
//! tokens costs about 4.8× a step of one, and each token unpacks every
//! weight block again. This kernel unpacks a block once for up to
//! [`TILE`] tokens, two rows at a time (one AVX-512 register) or one row
//! (AVX2 without AVX-512, the CPUs of most consumer machines), and keeps
//! every (row, token) sum in the order and the arithmetic of llama.cpp's
//! AVX2/VNNI `vec_dot` — the same 8 lanes of 4-product integer sums, the
//! same `fma(d_w·d_a, sum, acc)` per block, the same horizontal sum, the
//! same `m·s` terms — on activations quantized by ggml's own `from_float`.
//! Its output is llama.cpp's bit for bit, which [`Q41Kernel::probe`] checks
//! against ggml's `vec_dot` at start-up (the kernel is used only if it
//! matches), so batch invariance and every comparison with the llama.cpp
//! path are unchanged.
//!
//! How it runs: while llama.cpp asks the evaluation callback about each node
//! before computing it, a host `MUL_MAT` over Q4_1 weights is turned into a
//! `GGML_OP_CUSTOM` node calling [`mul_mat`] (and turned back after the
//! decode). ggml's CPU backend calls it on each of its threads (`ith` of
//! `nth`) as it calls its own ops: every thread quantizes its share of the
//! blocks, a barrier, then rows in chunks (see [`chunk_rows`]) from a
//! shared counter. No graph split, no thread of our own. A tile of one
//! token (decode of one stream) takes one row at a time, two blocks per
//! register, so that the weights stream from memory in one run per thread:
//! two rows at once, two streams, measured slower than ggml there. On AVX2
//! a one-token product stays llama.cpp's: there is nothing to unpack once
//! for many tokens (four rows at once, four accumulator chains, was tried:
//! faster than `vec_dot` on weights in cache, no faster on two threads
//! streaming them from memory).

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_void};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use llama_cpp_sys_2 as sys;

/// Tokens per tile: one accumulator register per token.
pub(crate) const TILE: usize = 8;
/// Rows per work item over many tiles (a chunk's weights stay in L1 across
/// them); over one or two tiles, where the weights stream from memory,
/// [`STREAM_ROWS`] (longer runs for the prefetcher, fewer turns at the
/// shared counter; chosen as ggml chooses, not measured apart).
pub(crate) const CHUNK_ROWS: usize = 16;
/// Rows per work item over one or two tiles (ggml's own decode chunk).
pub(crate) const STREAM_ROWS: usize = 64;

/// Rows per work item for `rows` × `tokens` on `nth` threads: at least four
/// items per thread where the rows allow, an even count (rows go in pairs).
fn chunk_rows(rows: usize, tokens: usize, nth: usize) -> usize {
    let want = if tokens <= 2 * TILE {
        STREAM_ROWS
    } else {
        CHUNK_ROWS
    };
    let most = (rows / (4 * nth)).max(2);
    (want.min(most) + 1) & !1
}

/// An atomic alone on its cache line (the threads of a node hit it).
#[derive(Debug, Default)]
#[repr(align(64))]
struct Line<T>(T);

const QK: usize = 32;
/// `block_q4_1`: f16 d, f16 m, 16 bytes of nibbles.
const Q4_1_BYTES: usize = 20;
/// `block_q8_1`: f16 d, f16 s, 32 signed bytes.
const Q8_1_BYTES: usize = 36;

/// The kernel, once checked against llama.cpp's own `vec_dot` (see
/// [`Q41Kernel::probe`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Q41Kernel {
    /// ggml's `from_float` for Q8_1 (`quantize_row_q8_1`).
    quantize: unsafe extern "C" fn(*const f32, *mut c_void, i64),
    isa: Isa,
}

/// The instructions the kernel runs on (see [`isa`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    /// AVX-512 F/BW/VL/VNNI, F16C, FMA: two rows per register, one-token
    /// products too.
    Avx512,
    /// AVX2, F16C, FMA: one row per register, products of two or more
    /// tokens.
    Avx2,
}

impl Isa {
    /// The fewest tokens of a product this kernel takes from llama.cpp.
    pub(crate) fn min_tokens(self) -> usize {
        match self {
            Isa::Avx512 => 1,
            Isa::Avx2 => 2,
        }
    }
}

/// Activations of one product as ggml quantizes them (Q8_1), in tiles of
/// [`TILE`] tokens: per tile, per block, per token, 32 bytes (and `d`, `s`
/// as f32, exactly as ggml widens them). Tokens past the end are zero.
#[derive(Debug, Default)]
struct Acts {
    qs: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
}

impl Acts {
    fn reserve(&mut self, blocks: usize, tokens: usize) {
        let n = tokens.div_ceil(TILE) * blocks * TILE;
        if self.d.len() < n {
            self.qs.resize(n * QK, 0);
            self.d.resize(n, 0.0);
            self.s.resize(n, 0.0);
        }
    }
}

/// A barrier for the `nth` threads of one node.
#[derive(Debug, Default)]
struct SpinBarrier {
    count: AtomicUsize,
    generation: AtomicUsize,
}

impl SpinBarrier {
    fn wait(&self, n: usize) {
        if n <= 1 {
            return;
        }
        let g = self.generation.load(Ordering::Acquire);
        if self.count.fetch_add(1, Ordering::AcqRel) + 1 == n {
            self.count.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == g {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1 << 14) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// What every custom node of a context shares (the node's user data).
#[derive(Debug)]
pub(crate) struct Shared {
    kernel: Q41Kernel,
    /// Written by the threads of a node, each its own blocks, between the
    /// node's start and its barrier; sized before the graph computes.
    acts: UnsafeCell<Acts>,
    barrier: Line<SpinBarrier>,
    next_chunk: Line<AtomicUsize>,
    failed: Line<AtomicBool>,
    error: Mutex<Option<String>>,
    /// Nodes switched to this kernel in the decode in flight, with the op
    /// parameters they had.
    switched: Vec<(usize, [i32; 16])>,
    /// Nodes the last decode switched.
    last_switched: usize,
}

// SAFETY: `acts` is written only at disjoint places by the threads of one
// node (each its own blocks), read after the node's barrier, and resized
// only while no graph computes (the callback's question about a node).
unsafe impl Sync for Shared {}

impl Shared {
    pub(crate) fn new(kernel: Q41Kernel) -> Shared {
        Shared {
            kernel,
            acts: UnsafeCell::new(Acts::default()),
            barrier: Line::default(),
            next_chunk: Line::default(),
            failed: Line::default(),
            error: Mutex::new(None),
            switched: Vec::new(),
            last_switched: 0,
        }
    }

    /// Asked about `t` before the graph computes: a product this kernel
    /// takes becomes a custom node calling it.
    ///
    /// # Safety
    /// `t` is a live node of the graph about to compute, `self` outlives
    /// the graph's computation (the pointer is the node's user data), and
    /// no graph computes while this runs.
    pub(crate) unsafe fn take(&mut self, t: &mut sys::ggml_tensor) {
        // SAFETY: a node's sources live as long as the graph.
        let (Some(w), Some(x)) = (unsafe { t.src[0].as_ref() }, unsafe { t.src[1].as_ref() })
        else {
            return;
        };
        let host = |b: *mut sys::ggml_backend_buffer| {
            // SAFETY: a live tensor's buffer, checked non-null first.
            !b.is_null() && unsafe { sys::ggml_backend_buffer_is_host(b) }
        };
        // Only a node the CPU backend computes: its output in a CPU buffer
        // (a GPU backend's nodes live in its own buffers).
        // SAFETY: as above; the CPU buffer type is a static of ggml.
        let cpu = !t.buffer.is_null()
            && unsafe {
                sys::ggml_backend_buffer_get_type(t.buffer) == sys::ggml_backend_cpu_buffer_type()
            };
        let k = x.ne[0] as usize;
        let fits = w.type_ == sys::GGML_TYPE_Q4_1
            && x.ne[1] as usize >= self.kernel.isa.min_tokens()
            && x.type_ == sys::GGML_TYPE_F32
            && t.type_ == sys::GGML_TYPE_F32
            && k.is_multiple_of(QK)
            && w.ne[0] == x.ne[0]
            && t.ne[0] == w.ne[1]
            && t.ne[1] == x.ne[1]
            && w.ne[2] == 1
            && w.ne[3] == 1
            && x.ne[2] == 1
            && x.ne[3] == 1
            && w.nb[0] == Q4_1_BYTES
            && x.nb[0] == 4
            && t.nb[0] == 4
            && t.src[2].is_null()
            && host(w.buffer)
            && host(x.buffer)
            && cpu
            && !w.data.is_null()
            && !t.data.is_null();
        if !fits {
            return;
        }
        self.acts.get_mut().reserve(k / QK, x.ne[1] as usize);
        self.switched
            .push((t as *mut sys::ggml_tensor as usize, t.op_params));
        let p = CustomOpParams {
            fun: Some(mul_mat),
            n_tasks: -1,
            userdata: self as *mut Shared as *mut c_void,
        };
        t.op_params = [0; 16];
        // SAFETY: the struct (24 bytes) fits in the 64 bytes of op_params,
        // where ggml's CPU backend reads it for GGML_OP_CUSTOM.
        unsafe {
            std::ptr::copy_nonoverlapping(
                &p as *const _ as *const u8,
                t.op_params.as_mut_ptr() as *mut u8,
                std::mem::size_of_val(&p),
            );
        }
        t.op = sys::GGML_OP_CUSTOM;
    }

    /// After the decode: the switched nodes are llama.cpp's again (it may
    /// reuse the graph). Returns the first failure of the decode, if any.
    pub(crate) fn restore(&mut self) -> Option<String> {
        self.last_switched = self.switched.len();
        for (a, params) in self.switched.drain(..) {
            // SAFETY: the graph lives until llama.cpp builds the next one,
            // after the decode returned.
            let t = unsafe { &mut *(a as *mut sys::ggml_tensor) };
            t.op = sys::GGML_OP_MUL_MAT;
            t.op_params = params;
        }
        if self.failed.0.swap(false, Ordering::Relaxed) {
            let mut e = self.error.lock().unwrap_or_else(|p| p.into_inner());
            return Some(e.take().unwrap_or_else(|| "the Q4_1 product failed".into()));
        }
        None
    }

    /// Products the last decode computed with this kernel.
    pub(crate) fn last_switched(&self) -> usize {
        self.last_switched
    }

    fn fail(&self, what: String) {
        self.failed.0.store(true, Ordering::Relaxed);
        let mut e = self.error.lock().unwrap_or_else(|p| p.into_inner());
        e.get_or_insert(what);
    }
}

/// ggml's `struct ggml_custom_op_params` (ggml-impl.h, not in the bindings).
#[repr(C)]
struct CustomOpParams {
    fun: sys::ggml_custom_op_t,
    n_tasks: c_int,
    userdata: *mut c_void,
}

/// The custom node's function: thread `ith` of `nth`.
///
/// # Safety
/// Called by ggml's CPU backend for a node [`Shared::take`] switched, on all
/// `nth` threads of the graph at once.
unsafe extern "C" fn mul_mat(dst: *mut sys::ggml_tensor, ith: c_int, nth: c_int, ud: *mut c_void) {
    // SAFETY: the user data `take` set, alive while the graph computes.
    let sh = unsafe { &*(ud as *const Shared) };
    let (ith, nth) = (ith.max(0) as usize, nth.max(1) as usize);
    // SAFETY: the node and its sources, live while the graph computes.
    let (t, w, x) = unsafe { (&*dst, &*(*dst).src[0], &*(*dst).src[1]) };
    let (k, tokens, rows) = (x.ne[0] as usize, x.ne[1] as usize, w.ne[1] as usize);
    let blocks = k / QK;
    // SAFETY: sized for this node while it was asked about; each thread
    // writes its own blocks only.
    let acts = unsafe { &*sh.acts.get() };
    let (qs, d, s) = (
        acts.qs.as_ptr() as *mut i8,
        acts.d.as_ptr() as *mut f32,
        acts.s.as_ptr() as *mut f32,
    );
    // Each thread quantizes its own range of blocks of every token (Q8_1
    // blocks are independent, so a part of a row quantizes as the whole row
    // does): in the tiled layout that range is one contiguous run per tile,
    // so no two threads write one cache line but at its ends. (Split by
    // token instead, two threads wrote interleaved floats of the same lines:
    // decode on two threads ran slower than on one.)
    let (b0, b1) = (ith * blocks / nth, (ith + 1) * blocks / nth);
    let quantized = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        PART.with_borrow_mut(|part| {
            part.resize((b1 - b0) * Q8_1_BYTES, 0);
            for tok in 0..tokens.div_ceil(TILE) * TILE {
                let (tile, tt) = (tok / TILE, tok % TILE);
                if tok < tokens && b1 > b0 {
                    // SAFETY: token `tok`'s row of k f32 (nb0 = 4), from block b0.
                    unsafe {
                        (sh.kernel.quantize)(
                            ((x.data as *const u8).add(tok * x.nb[1]) as *const f32).add(b0 * QK),
                            part.as_mut_ptr().cast(),
                            ((b1 - b0) * QK) as i64,
                        )
                    };
                }
                for b in b0..b1 {
                    let i = (tile * blocks + b) * TILE + tt;
                    // SAFETY: within the reserved tiles; this thread's blocks.
                    unsafe {
                        if tok >= tokens {
                            std::ptr::write_bytes(qs.add(i * QK), 0, QK);
                            *d.add(i) = 0.0;
                            *s.add(i) = 0.0;
                            continue;
                        }
                        let blk = &part[(b - b0) * Q8_1_BYTES..(b - b0 + 1) * Q8_1_BYTES];
                        *d.add(i) = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                        *s.add(i) = half::f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                        std::ptr::copy_nonoverlapping(
                            blk[4..].as_ptr() as *const i8,
                            qs.add(i * QK),
                            QK,
                        );
                    }
                }
            }
        })
    }));
    if quantized.is_err() {
        sh.fail("a panic while quantizing a Q4_1 product's activations".into());
    }
    if ith == 0 {
        sh.next_chunk.0.store(nth, Ordering::Relaxed);
    }
    sh.barrier.0.wait(nth);
    if sh.failed.0.load(Ordering::Relaxed) {
        return;
    }
    let chunk = chunk_rows(rows, tokens, nth);
    let chunks = rows.div_ceil(chunk);
    let computed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut c = ith;
        while c < chunks {
            let r0 = c * chunk;
            let r1 = (r0 + chunk).min(rows);
            for tile in 0..tokens.div_ceil(TILE) {
                let nt = (tokens - tile * TILE).min(TILE);
                let base = tile * blocks * TILE;
                // Weight row `r`; this tile's activations (filled before the
                // barrier); the output row of the tile's token `tt`.
                let wrow = |r: usize| (w.data as *const u8).wrapping_add(r * w.nb[1]);
                let (tq, td, ts) = (
                    qs.wrapping_add(base * QK) as *const i8,
                    d.wrapping_add(base) as *const f32,
                    s.wrapping_add(base) as *const f32,
                );
                let dst = |tt: usize| {
                    (t.data as *mut u8).wrapping_add((tile * TILE + tt) * t.nb[1]) as *mut f32
                };
                if sh.kernel.isa == Isa::Avx2 {
                    // One row at a time, each block unpacked once for the
                    // tile's tokens.
                    for r in r0..r1 {
                        let mut out = [0f32; TILE];
                        // SAFETY: row `r` of the weights and the tile's
                        // activations; dst is [rows, tokens] f32.
                        unsafe {
                            row(nt, wrow(r), blocks, tq, td, ts, &mut out);
                            for (tt, o) in out.iter().enumerate().take(nt) {
                                *dst(tt).add(r) = *o;
                            }
                        }
                    }
                    continue;
                }
                if nt == 1 {
                    // One token: a row at a time, one stream of weights.
                    for r in r0..r1 {
                        // SAFETY: row `r` of the weights, the tile's one
                        // token, one output of its row.
                        unsafe { *dst(0).add(r) = single(wrow(r), blocks, tq, td, ts) };
                    }
                    continue;
                }
                for r in (r0..r1).step_by(2) {
                    let rb = (r + 1).min(rows - 1);
                    let mut out = [[0f32; 2]; TILE];
                    // SAFETY: rows `r`, `rb` of the weights and the tile's
                    // activations; dst is [rows, tokens] f32.
                    unsafe {
                        pair(nt, wrow(r), wrow(rb), blocks, tq, td, ts, &mut out);
                        for (tt, o) in out.iter().enumerate().take(nt) {
                            *dst(tt).add(r) = o[0];
                            if rb != r {
                                *dst(tt).add(rb) = o[1];
                            }
                        }
                    }
                }
            }
            c = sh.next_chunk.0.fetch_add(1, Ordering::Relaxed);
        }
    }));
    if computed.is_err() {
        sh.fail("a panic in a Q4_1 product".into());
    }
}

thread_local! {
    /// One thread's Q8_1 blocks of one token row, reused node after node
    /// (not allocated per product: a decode step runs hundreds).
    static PART: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Row `a` (`blocks` Q4_1 blocks) against a tile's one token (`qs`, `d`,
/// `s` at the tile's first block), exactly as ggml's `vec_dot_q4_1_q8_1`.
///
/// # Safety
/// The pointers hold what they say; the CPU has the features of the
/// kernel's [`Isa`] (AVX-512 here; no product is taken elsewhere:
/// [`Q41Kernel::probe`]).
unsafe fn single(a: *const u8, blocks: usize, qs: *const i8, d: *const f32, s: *const f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as the caller promises.
    return unsafe { avx512::single(a, blocks, qs, d, s) };
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("no Q4_1 product is taken without the kernel's CPU features");
}

/// Rows `a` and `b` (`blocks` Q4_1 blocks each) against the `nt` (2 to
/// [`TILE`]) tokens of one tile (`qs`, `d`, `s` at the tile's first block):
/// `out[t] = [row a · token t, row b · token t]`, each exactly as ggml's
/// `vec_dot_q4_1_q8_1`.
///
/// # Safety
/// As [`single`].
#[allow(clippy::too_many_arguments)]
unsafe fn pair(
    nt: usize,
    a: *const u8,
    b: *const u8,
    blocks: usize,
    qs: *const i8,
    d: *const f32,
    s: *const f32,
    out: &mut [[f32; 2]; TILE],
) {
    #[cfg(target_arch = "x86_64")]
    macro_rules! go {
        ($($n:literal)*) => {
            match nt {
                $(
                    // SAFETY: as the caller promises.
                    $n => unsafe { avx512::pair::<$n>(a, b, blocks, qs, d, s, out) },
                )*
                _ => unreachable!("a tile of two rows holds 2 to {TILE} tokens"),
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    go!(2 3 4 5 6 7 8);
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("no Q4_1 product is taken without the kernel's CPU features");
}

/// Row `a` (`blocks` Q4_1 blocks) against the `nt` (1 to [`TILE`]) tokens
/// of one tile (`qs`, `d`, `s` at the tile's first block): `out[t]` = row ·
/// token t, exactly as ggml's `vec_dot_q4_1_q8_1`.
///
/// # Safety
/// As [`single`], with [`Isa::Avx2`]'s features.
#[allow(clippy::too_many_arguments)]
unsafe fn row(
    nt: usize,
    a: *const u8,
    blocks: usize,
    qs: *const i8,
    d: *const f32,
    s: *const f32,
    out: &mut [f32; TILE],
) {
    #[cfg(target_arch = "x86_64")]
    macro_rules! go {
        ($($n:literal)*) => {
            match nt {
                $(
                    // SAFETY: as the caller promises.
                    $n => unsafe { avx2::row::<$n>(a, blocks, qs, d, s, out) },
                )*
                _ => unreachable!("a tile holds 1 to {TILE} tokens"),
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    go!(1 2 3 4 5 6 7 8);
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("no Q4_1 product is taken without the kernel's CPU features");
}

/// The instructions this CPU runs the kernel on: AVX-512 F/BW/VL/VNNI with
/// F16C and FMA, else AVX2 with F16C and FMA (also where
/// `SILICEO_KERNELS_NO_AVX512` is set, as for the attention kernels, so
/// that tests check the AVX2 kernel on machines with AVX-512), else none.
pub(crate) fn isa() -> Option<Isa> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if !(has!("avx2") && has!("f16c") && has!("fma")) {
            return None;
        }
        let avx512 = has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni");
        Some(
            if avx512 && std::env::var_os("SILICEO_KERNELS_NO_AVX512").is_none() {
                Isa::Avx512
            } else {
                Isa::Avx2
            },
        )
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// ggml's `hsum_float_8`, in its order (both kernels end with it).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx")]
fn hsum8(x: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let r = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    let r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// The AVX2 kernel: ggml's AVX2 `vec_dot_q4_1_q8_1` (`maddubs` pairs summed
/// by `madd` into the same 8 lanes of 4-product sums as VNNI's `dpbusd`:
/// nibbles times bytes cannot saturate 16 bits), each weight block
/// unpacked once for all the tile's tokens.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Q4_1_BYTES, QK, TILE, hsum8};

    /// One Q4_1 block at `pa`: `[d, m, 0, 0]` as f32 (exact, as ggml widens
    /// them) and its 32 weights, one byte each, as ggml's
    /// `bytes_from_nibbles_32` lays them out (low nibbles, then high).
    ///
    /// # Safety
    /// `pa` holds a Q4_1 block.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn block(pa: *const u8) -> (__m128, __m256i) {
        // SAFETY: a Q4_1 block: f16 d, f16 m, 16 bytes of nibbles.
        let (dm, t) = unsafe {
            (
                (pa as *const i32).read_unaligned(),
                _mm_loadu_si128(pa.add(4) as *const __m128i),
            )
        };
        let qx = _mm256_and_si256(
            _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(t), _mm_srli_epi16::<4>(t)),
            _mm256_set1_epi8(0x0F),
        );
        (_mm_cvtph_ps(_mm_cvtsi32_si128(dm)), qx)
    }

    /// See [`super::row`]: one accumulator per token, as ggml's `acc`.
    #[inline]
    #[target_feature(enable = "avx2,f16c,fma")]
    pub(super) unsafe fn row<const NT: usize>(
        a: *const u8,
        blocks: usize,
        qs: *const i8,
        d: *const f32,
        s: *const f32,
        out: &mut [f32; TILE],
    ) {
        let mut acc = [_mm256_setzero_ps(); NT];
        // Lane t: token t's `summs`.
        let mut summs = _mm256_setzero_ps();
        let ones = _mm256_set1_epi16(1);
        for blk in 0..blocks {
            // SAFETY (whole block): the caller's pointers hold `blocks`
            // blocks of the row and of each of the tile's tokens.
            unsafe {
                let (dm, qx) = block(a.add(blk * Q4_1_BYTES));
                let dw = _mm256_broadcastss_ps(dm);
                let mw = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
                // ggml's `summs += m * s`: a product of two f16 values is
                // exact in f32, so fused or not, the same bits.
                summs = _mm256_fmadd_ps(mw, _mm256_loadu_ps(s.add(blk * TILE)), summs);
                let tok = qs.add(blk * TILE * QK);
                let dt = d.add(blk * TILE);
                for (t, acc) in acc.iter_mut().enumerate() {
                    let qy = _mm256_loadu_si256(tok.add(t * QK) as *const __m256i);
                    let xy =
                        _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, _mm256_maddubs_epi16(qx, qy)));
                    let dd = _mm256_mul_ps(dw, _mm256_broadcast_ss(&*dt.add(t)));
                    *acc = _mm256_fmadd_ps(dd, xy, *acc);
                }
            }
        }
        let mut sm = [0f32; TILE];
        // SAFETY: TILE (8) f32 of room.
        unsafe { _mm256_storeu_ps(sm.as_mut_ptr(), summs) };
        for (t, acc) in acc.iter().enumerate() {
            out[t] = hsum8(*acc) + sm[t];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{Q4_1_BYTES, QK, TILE, hsum8};

    /// The f16 `d` and `m` of blocks `pa` and `pb`: `[d_a, m_a, d_b, m_b]`
    /// as f32 (exact, as ggml widens them).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
    unsafe fn scales(pa: *const u8, pb: *const u8) -> __m128 {
        // SAFETY: two Q4_1 blocks, as the caller promises.
        let dm = unsafe {
            _mm_set_epi32(
                0,
                0,
                (pb as *const i32).read_unaligned(),
                (pa as *const i32).read_unaligned(),
            )
        };
        _mm_cvtph_ps(dm)
    }

    /// ggml's `bytes_from_nibbles_32` for blocks `pa` and `pb` at once:
    /// `[a lo, a hi | b lo, b hi]`, one byte per weight.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
    unsafe fn nibbles(pa: *const u8, pb: *const u8) -> __m512i {
        // SAFETY: two Q4_1 blocks (16 bytes of nibbles after d and m).
        let lo = unsafe {
            _mm256_inserti128_si256::<1>(
                _mm256_castsi128_si256(_mm_loadu_si128(pa.add(4) as *const __m128i)),
                _mm_loadu_si128(pb.add(4) as *const __m128i),
            )
        };
        let hi = _mm256_srli_epi16::<4>(lo);
        let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
        _mm512_and_si512(
            _mm512_shuffle_i64x2::<0b11_01_10_00>(z, z),
            _mm512_set1_epi8(0x0F),
        )
    }

    /// One row against one token: two blocks per register (lanes 0–7 block
    /// 2j, 8–15 block 2j+1), one stream of weights; block 2j's fma before
    /// 2j+1's, on the two halves, as ggml's one accumulator.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
    pub(super) unsafe fn single(
        a: *const u8,
        blocks: usize,
        qs: *const i8,
        d: *const f32,
        s: *const f32,
    ) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut summs = 0f32;
        let zero = _mm512_setzero_si512();
        let idx_d = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
        let high = |v: __m512| _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let mut blk = 0;
        // SAFETY (whole loop): `blocks` blocks of the row and of the token.
        unsafe {
            while blk + 2 <= blocks {
                let pa = a.add(blk * Q4_1_BYTES);
                let pb = pa.add(Q4_1_BYTES);
                // [d_2j, m_2j, d_2j+1, m_2j+1].
                let f4 = scales(pa, pb);
                let mut fm = [0f32; 4];
                _mm_storeu_ps(fm.as_mut_ptr(), f4);
                let dw = _mm512_permutexvar_ps(idx_d, _mm512_castps128_ps512(f4));
                let qx = nibbles(pa, pb);
                let qy = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_loadu_si256(
                        qs.add(blk * TILE * QK) as *const __m256i
                    )),
                    _mm256_loadu_si256(qs.add((blk + 1) * TILE * QK) as *const __m256i),
                );
                let xy = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, qx, qy));
                let d1 = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                    _mm512_castps_pd(_mm512_castps256_ps512(_mm256_set1_ps(*d.add(blk * TILE)))),
                    _mm256_castps_pd(_mm256_set1_ps(*d.add((blk + 1) * TILE))),
                ));
                let dd = _mm512_mul_ps(dw, d1);
                acc = _mm256_fmadd_ps(_mm512_castps512_ps256(dd), _mm512_castps512_ps256(xy), acc);
                acc = _mm256_fmadd_ps(high(dd), high(xy), acc);
                // Exact products (f16 × f16), so as ggml's `summs += m * s`.
                summs += fm[1] * *s.add(blk * TILE);
                summs += fm[3] * *s.add((blk + 1) * TILE);
                blk += 2;
            }
            if blk < blocks {
                let (f4, qx) = super::avx2::block(a.add(blk * Q4_1_BYTES));
                let mut fm = [0f32; 4];
                _mm_storeu_ps(fm.as_mut_ptr(), f4);
                let qy = _mm256_loadu_si256(qs.add(blk * TILE * QK) as *const __m256i);
                let xy = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), qx, qy));
                let dd = _mm256_mul_ps(_mm256_set1_ps(fm[0]), _mm256_set1_ps(*d.add(blk * TILE)));
                acc = _mm256_fmadd_ps(dd, xy, acc);
                summs += fm[1] * *s.add(blk * TILE);
            }
        }
        hsum8(acc) + summs
    }

    /// See [`super::pair`]: lanes 0–7 are row `a`, 8–15 row `b`; per token
    /// one accumulator, as ggml's `acc` for each of the two rows.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
    pub(super) unsafe fn pair<const NT: usize>(
        a: *const u8,
        b: *const u8,
        blocks: usize,
        qs: *const i8,
        d: *const f32,
        s: *const f32,
        out: &mut [[f32; 2]; TILE],
    ) {
        let mut acc = [_mm512_setzero_ps(); NT];
        // Lanes 0–7: row a's `summs` for tokens 0–7; 8–15: row b's.
        let mut summs = _mm512_setzero_ps();
        let zero = _mm512_setzero_si512();
        let idx_d = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
        let idx_m = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
        for blk in 0..blocks {
            // SAFETY (whole block): the caller's pointers hold `blocks`
            // blocks of each row and of each of the tile's tokens.
            unsafe {
                let pa = a.add(blk * Q4_1_BYTES);
                let pb = b.add(blk * Q4_1_BYTES);
                let f = _mm512_castps128_ps512(scales(pa, pb));
                let dw = _mm512_permutexvar_ps(idx_d, f);
                let mw = _mm512_permutexvar_ps(idx_m, f);
                let qx = nibbles(pa, pb);
                let sv = _mm512_broadcast_f32x8(_mm256_loadu_ps(s.add(blk * TILE)));
                // ggml's `summs += m * s`: the product of two f16 values is
                // exact in f32, so fused or not, the same bits.
                summs = _mm512_fmadd_ps(mw, sv, summs);
                let tok = qs.add(blk * TILE * QK);
                let dt = d.add(blk * TILE);
                for (t, acc) in acc.iter_mut().enumerate() {
                    let qy = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        tok.add(t * QK) as *const __m256i
                    ));
                    let xy = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, qx, qy));
                    let dd = _mm512_mul_ps(dw, _mm512_set1_ps(*dt.add(t)));
                    *acc = _mm512_fmadd_ps(dd, xy, *acc);
                }
            }
        }
        let mut sm = [0f32; 16];
        // SAFETY: 16 f32 of room.
        unsafe { _mm512_storeu_ps(sm.as_mut_ptr(), summs) };
        for (t, acc) in acc.iter().enumerate() {
            let ra = hsum8(_mm512_castps512_ps256(*acc));
            let rb = hsum8(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                _mm512_castps_pd(*acc),
            )));
            out[t] = [ra + sm[t], rb + sm[TILE + t]];
        }
    }
}

impl Q41Kernel {
    /// The kernel, if this CPU runs it and it reproduces llama.cpp's own
    /// `vec_dot_q4_1_q8_1` bit for bit on random data (`None` when it does
    /// not, or when `SILICEO_LLAMA_MATMUL=1` asks for llama.cpp's products).
    pub(crate) fn probe() -> Option<Q41Kernel> {
        static PROBED: std::sync::OnceLock<Option<Q41Kernel>> = std::sync::OnceLock::new();
        *PROBED.get_or_init(|| {
            if std::env::var("SILICEO_LLAMA_MATMUL").is_ok_and(|v| v == "1") {
                return None;
            }
            let isa = isa()?;
            // SAFETY: ggml's type-traits tables; ggml_cpu_init is idempotent.
            let quantize = unsafe {
                sys::ggml_cpu_init();
                (*sys::ggml_get_type_traits_cpu(sys::GGML_TYPE_Q8_1)).from_float?
            };
            let k = Q41Kernel { quantize, isa };
            let found = [(7, 6, 11, 1), (18, 4, 8, 2), (48, 2, 3, 3), (18, 40, 1, 4)]
                .into_iter()
                .all(|(b, r, t, seed)| k.compare(&probe_case(b, r, t, seed)).is_ok())
                .then_some(k);
            if found.is_none() {
                tracing::info!(
                    "the Q4_1 kernel does not reproduce llama.cpp's vec_dot here; \
                     llama.cpp computes Q4_1 products"
                );
            }
            found
        })
    }

    /// Runs the kernel over `c` on one thread and compares every output
    /// with ggml's `vec_dot`: `Err` names the first difference.
    fn compare(&self, c: &ProbeCase) -> Result<(), String> {
        let mut sh = Shared::new(*self);
        let ours = c.run(&mut sh)?;
        let theirs = c.reference()?;
        match ours
            .iter()
            .zip(&theirs)
            .position(|(a, b)| a.to_bits() != b.to_bits())
        {
            Some(i) => Err(format!(
                "output {i}: {} (ours) against {} (ggml)",
                ours[i], theirs[i]
            )),
            None => Ok(()),
        }
    }
}

/// Random Q4_1 weights and f32 activations, as a node of ggml would hold
/// them.
pub(crate) struct ProbeCase {
    blocks: usize,
    rows: usize,
    tokens: usize,
    w: Vec<u8>,
    x: Vec<f32>,
}

/// `rows` × `blocks·32` weights and `tokens` activation rows from `seed`
/// (values of a few scales and offsets, as real weights and activations
/// have).
pub(crate) fn probe_case(blocks: usize, rows: usize, tokens: usize, seed: u64) -> ProbeCase {
    let k = blocks * QK;
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    };
    let wf: Vec<f32> = (0..rows * k)
        .map(|i| (next() * (0.02 + (i / QK % 5) as f64 * 0.03) + 0.01) as f32)
        .collect();
    let x: Vec<f32> = (0..tokens * k)
        .map(|i| (next() * (1.0 + (i % 7) as f64)) as f32)
        .collect();
    let mut w = vec![0u8; rows * blocks * Q4_1_BYTES];
    // SAFETY: ggml's Q4_1 quantization of `rows` rows into room for them.
    unsafe {
        sys::ggml_cpu_init();
        let q = (*sys::ggml_get_type_traits_cpu(sys::GGML_TYPE_Q4_1))
            .from_float
            .expect("ggml quantizes Q4_1");
        q(wf.as_ptr(), w.as_mut_ptr().cast(), (rows * k) as i64);
    }
    ProbeCase {
        blocks,
        rows,
        tokens,
        w,
        x,
    }
}

impl ProbeCase {
    /// The kernel's outputs, `[token][row]`, through a real ggml tensor
    /// node on one thread.
    pub(crate) fn run(&self, sh: &mut Shared) -> Result<Vec<f32>, String> {
        self.run_on(sh, 1)
    }

    /// [`ProbeCase::run`] on `nth` threads at once, as ggml's backend runs
    /// a node.
    pub(crate) fn run_on(&self, sh: &mut Shared, nth: usize) -> Result<Vec<f32>, String> {
        let k = self.blocks * QK;
        let mut out = vec![0f32; self.rows * self.tokens];
        // SAFETY: zeroed tensors are valid plain data; we set what the
        // kernel reads (type, shape, strides, data, sources).
        let mut wt: sys::ggml_tensor = unsafe { std::mem::zeroed() };
        let mut xt: sys::ggml_tensor = unsafe { std::mem::zeroed() };
        let mut dt: sys::ggml_tensor = unsafe { std::mem::zeroed() };
        wt.type_ = sys::GGML_TYPE_Q4_1;
        wt.ne = [k as i64, self.rows as i64, 1, 1];
        wt.nb[0] = Q4_1_BYTES;
        wt.nb[1] = self.blocks * Q4_1_BYTES;
        wt.data = self.w.as_ptr() as *mut c_void;
        xt.type_ = sys::GGML_TYPE_F32;
        xt.ne = [k as i64, self.tokens as i64, 1, 1];
        xt.nb[0] = 4;
        xt.nb[1] = k * 4;
        xt.data = self.x.as_ptr() as *mut c_void;
        dt.type_ = sys::GGML_TYPE_F32;
        dt.ne = [self.rows as i64, self.tokens as i64, 1, 1];
        dt.nb[0] = 4;
        dt.nb[1] = self.rows * 4;
        dt.data = out.as_mut_ptr() as *mut c_void;
        dt.src[0] = &mut wt;
        dt.src[1] = &mut xt;
        sh.acts.get_mut().reserve(self.blocks, self.tokens);
        let (node, ud) = (
            &mut dt as *mut sys::ggml_tensor as usize,
            sh as *mut Shared as usize,
        );
        // SAFETY: a node as `take` would have switched it, on `nth` threads
        // at once; it and `sh` outlive them (scoped).
        let call = move |ith: usize| unsafe {
            mul_mat(
                node as *mut _,
                ith as c_int,
                nth as c_int,
                ud as *mut c_void,
            )
        };
        if nth <= 1 {
            call(0);
        } else {
            std::thread::scope(|sc| {
                for ith in 0..nth {
                    sc.spawn(move || call(ith));
                }
            });
        }
        match sh.restore() {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// ggml's `vec_dot` over the rows on `nth` threads (contiguous row
    /// ranges in chunks of 64, as ggml's decode does), the activations
    /// quantized once (a timing aid).
    #[cfg(test)]
    pub(crate) fn reference_threads(&self, nth: usize) -> Vec<f32> {
        let k = self.blocks * QK;
        let mut out = vec![0f32; self.rows * self.tokens];
        unsafe {
            let q4 = &*sys::ggml_get_type_traits_cpu(sys::GGML_TYPE_Q4_1);
            let q8 = &*sys::ggml_get_type_traits_cpu(sys::GGML_TYPE_Q8_1);
            let (dot, quantize) = (q4.vec_dot.unwrap(), q8.from_float.unwrap());
            let mut y = vec![0u8; self.tokens * self.blocks * Q8_1_BYTES];
            for t in 0..self.tokens {
                quantize(
                    self.x[t * k..].as_ptr(),
                    y[t * self.blocks * Q8_1_BYTES..].as_mut_ptr().cast(),
                    k as i64,
                );
            }
            let next = AtomicUsize::new(nth);
            let chunks = self.rows.div_ceil(64);
            let (op, yp, wp) = (
                out.as_mut_ptr() as usize,
                y.as_ptr() as usize,
                self.w.as_ptr() as usize,
            );
            let (rows, blocks, tokens) = (self.rows, self.blocks, self.tokens);
            std::thread::scope(|sc| {
                for ith in 0..nth {
                    let next = &next;
                    sc.spawn(move || {
                        let mut c = ith;
                        while c < chunks {
                            for r in c * 64..((c + 1) * 64).min(rows) {
                                for t in 0..tokens {
                                    dot(
                                        k as c_int,
                                        (op as *mut f32).add(t * rows + r),
                                        0,
                                        (wp as *const u8).add(r * blocks * Q4_1_BYTES).cast(),
                                        0,
                                        (yp as *const u8).add(t * blocks * Q8_1_BYTES).cast(),
                                        0,
                                        1,
                                    );
                                }
                            }
                            c = next.fetch_add(1, Ordering::Relaxed);
                        }
                    });
                }
            });
        }
        out
    }

    /// ggml's own outputs: `from_float` then `vec_dot` per (row, token).
    pub(crate) fn reference(&self) -> Result<Vec<f32>, String> {
        let k = self.blocks * QK;
        // SAFETY: ggml's type traits; buffers sized for k values.
        unsafe {
            sys::ggml_cpu_init();
            let q4 = &*sys::ggml_get_type_traits_cpu(sys::GGML_TYPE_Q4_1);
            let q8 = &*sys::ggml_get_type_traits_cpu(sys::GGML_TYPE_Q8_1);
            let (Some(dot), Some(quantize)) = (q4.vec_dot, q8.from_float) else {
                return Err("ggml has no Q4_1 vec_dot".into());
            };
            if q4.vec_dot_type != sys::GGML_TYPE_Q8_1 || q4.nrows != 1 {
                return Err("ggml's Q4_1 product is not vec_dot over Q8_1".into());
            }
            let mut y = vec![0u8; self.blocks * Q8_1_BYTES];
            let mut out = vec![0f32; self.rows * self.tokens];
            for t in 0..self.tokens {
                quantize(self.x[t * k..].as_ptr(), y.as_mut_ptr().cast(), k as i64);
                for r in 0..self.rows {
                    dot(
                        k as c_int,
                        &mut out[t * self.rows + r],
                        0,
                        self.w[r * self.blocks * Q4_1_BYTES..].as_ptr().cast(),
                        0,
                        y.as_ptr().cast(),
                        0,
                        1,
                    );
                }
            }
            Ok(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_gives_ggml_vec_dot_bits_for_every_tile_width() {
        let Some(kernel) = Q41Kernel::probe() else {
            assert!(
                isa().is_none() || std::env::var("SILICEO_LLAMA_MATMUL").is_ok(),
                "the CPU runs the kernel, yet it does not reproduce ggml's vec_dot"
            );
            return;
        };
        for (blocks, rows, tokens) in [
            (1, 1, 1),
            (2, 3, 9),
            (18, 17, 16),
            (48, 5, 23),
            (3, 2, 8),
            (18, 42, 1),
        ] {
            for seed in 10..13 {
                let c = probe_case(blocks, rows, tokens, seed);
                kernel.compare(&c).unwrap_or_else(|e| {
                    panic!("{blocks} blocks, {rows} rows, {tokens} tokens: {e}")
                });
            }
        }
    }

    /// Several threads share a node as ggml's backend runs it: each
    /// quantizes its blocks, a barrier, then row chunks from the counter —
    /// still ggml's bits, for any thread count (chunks of 2 to 64 rows).
    #[test]
    fn threads_sharing_a_node_give_the_same_bits() {
        let Some(kernel) = Q41Kernel::probe() else {
            return;
        };
        for nth in [2, 3, 5] {
            for (blocks, rows, tokens) in [(18, 600, 1), (3, 10, 9), (48, 130, 17), (5, 2, 8)] {
                let c = probe_case(blocks, rows, tokens, nth as u64);
                let mut sh = Shared::new(kernel);
                let want = c.reference().unwrap();
                for _ in 0..3 {
                    let got = c.run_on(&mut sh, nth).unwrap();
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{nth} threads, {blocks} blocks, {rows} rows, {tokens} tokens"
                    );
                }
            }
        }
    }

    #[test]
    #[ignore = "a timing, not a check: cargo test --release -p siliceo-engine q4_1_speed -- --ignored --nocapture"]
    fn q4_1_speed() {
        let Some(kernel) = Q41Kernel::probe() else {
            return;
        };
        for nth in [1, 2] {
            for (blocks, rows) in [(18, 100_000), (48, 40_000)] {
                for tokens in [1, 2, 3, 4, 8] {
                    let c = probe_case(blocks, rows, tokens, 5);
                    let mut sh = Shared::new(kernel);
                    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
                    for _ in 0..9 {
                        let t0 = std::time::Instant::now();
                        let a = c.run_on(&mut sh, nth).unwrap();
                        ours.push(t0.elapsed().as_secs_f64());
                        let t0 = std::time::Instant::now();
                        let b = c.reference_threads(nth);
                        theirs.push(t0.elapsed().as_secs_f64());
                        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
                    }
                    ours.sort_by(f64::total_cmp);
                    theirs.sort_by(f64::total_cmp);
                    let gb = (rows * blocks * Q4_1_BYTES) as f64 / 1e9;
                    println!(
                        "{nth} threads, k={} rows={rows} tokens={tokens}: ours {:.2} ms ({:.1} GB/s), ggml {:.2} ms ({:.1} GB/s)",
                        blocks * QK,
                        ours[4] * 1e3,
                        gb / ours[4],
                        theirs[4] * 1e3,
                        gb / theirs[4]
                    );
                }
            }
        }
        for (blocks, rows) in [(18, 1536)] {
            for tokens in [1, 2, 8] {
                let c = probe_case(blocks, rows, tokens, 5);
                let mut sh = Shared::new(kernel);
                let reps = 20;
                let mut ours = Vec::new();
                let mut theirs = Vec::new();
                for _ in 0..reps {
                    let t0 = std::time::Instant::now();
                    std::hint::black_box(c.run(&mut sh).unwrap());
                    ours.push(t0.elapsed().as_secs_f64());
                    let t0 = std::time::Instant::now();
                    std::hint::black_box(c.reference().unwrap());
                    theirs.push(t0.elapsed().as_secs_f64());
                }
                ours.sort_by(f64::total_cmp);
                theirs.sort_by(f64::total_cmp);
                let (o, t) = (ours[reps / 2], theirs[reps / 2]);
                println!(
                    "k={} rows={rows} tokens={tokens}: ours {:.1} us, ggml vec_dot {:.1} us, {:.2}x",
                    blocks * QK,
                    o * 1e6,
                    t * 1e6,
                    t / o
                );
            }
        }
    }
}
