//! Paged-attention kernels over siliceo's KV formats.
//!
//! - [`codec`]: how K or V of one block and one KV head is stored — `F16`,
//!   `KV8` (int8 with f16 scales per group), `K5` (5-bit per channel across
//!   the block), `V4` (4-bit per token per group) — with documented bit
//!   layouts and error bounds.
//! - [`store`]: a paged store for one layer: sealed blocks in the chosen
//!   codecs plus a full-precision (F16) tail of the most recent tokens, with
//!   optional Hadamard rotation of K ([`hadamard`]). [`KvPages`] holds the
//!   bytes and the operations on blocks by index (write a token, seal, copy
//!   rows), for a caller with its own allocator (a server's, one for all
//!   layers); [`KvStore`] adds its own block bookkeeping ([`BlockPools`]:
//!   which block and row each token goes to, which tail block is sealed
//!   when), shared with the device store.
//! - [`attention`]: the CPU kernel — decode and causal prefill chunks,
//!   grouped-query heads, online softmax, split-context partitions,
//!   multi-threaded on worker threads started on first use and kept between
//!   calls — and the naive f64 reference it is tested against.
//! - [`membw`]: the machine's memory read bandwidth, measured the same way the
//!   kernel reads, to judge the kernel against.
//! - `cuda` (feature `cuda`, off by default): the CUDA kernels of `kernels/*.cu`
//!   (Turing sm_75 and up), loaded at run time through cudarc; with no driver,
//!   no device or no compiled kernels it returns [`KernelError::Cuda`] and the
//!   caller falls back to the CPU kernel.
//! - `device` (features `cuda` or `cuda-emu`): the kernels' host code over a
//!   backend — a layer's KV on the device (`DeviceKv`: alloc or upload,
//!   append with sealing on the device, decode, release) — for the CUDA
//!   driver, or `emu` (feature `cuda-emu`), which runs the kernels' own CUDA
//!   source on the CPU (fibers for threads) so their logic, alignment and
//!   coalescing are tested on machines without a GPU.
//!
//! ```
//! use siliceo_kernels_turing::{KvLayout, KvStore, SeqKv, AttnParams, paged_attention};
//! let layout = KvLayout::preset("k5v4", 2, 64).unwrap();
//! let mut store = KvStore::new(layout, 8, 4).unwrap();
//! let mut seq = SeqKv::default();
//! let kv: Vec<f32> = (0..100 * 2 * 64).map(|i| ((i % 13) as f32 - 6.0) / 6.0).collect();
//! store.append(&mut seq, &kv, &kv).unwrap(); // 100 tokens: 1 sealed block + a 36-token F16 tail
//! let q = vec![0.1f32; 4 * 64]; // one query token, 4 heads (2 per KV head)
//! let mut out = vec![0f32; q.len()];
//! let s = [siliceo_kernels_turing::SeqQuery { kv: &seq, q: &q, n_q: 1 }];
//! paged_attention(&store, 4, 0.125, &s, &mut out, &AttnParams::default()).unwrap();
//! store.release(&mut seq);
//! ```
//!
//! **Architecture invariant:** the only crate that touches cudarc; builds and
//! tests with no CUDA toolkit and no GPU.
#![deny(missing_docs)]

#[cfg(target_endian = "big")]
compile_error!("the KV formats are little-endian; big-endian hosts are not supported");

pub mod attention;
pub mod codec;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(any(feature = "cuda", feature = "cuda-emu"))]
pub mod device;
#[cfg(feature = "cuda-emu")]
pub mod emu;
#[cfg(any(feature = "cuda", feature = "cuda-emu"))]
pub mod graft;
pub mod hadamard;
pub mod membw;
mod pool;
pub mod shapes;
mod simd;
pub mod store;

pub use attention::{
    AttnParams, LayerAttn, Runner, SeqQuery, naive_attention, naive_attention_layer,
    paged_attention, paged_attention_layer,
};
pub use codec::Codec;
pub use store::{AppendStep, BlockPools, KvLayout, KvPages, KvStore, SeqKv, SharedTail};

/// What the kernels can refuse.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// A layout or codec the kernels do not support.
    #[error("unsupported KV layout: {0}")]
    Layout(String),
    /// Arrays of the wrong shape.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// The store has no room for the tokens.
    #[error(
        "KV store full: {tokens} token(s) need more blocks ({sealed_free} sealed and {tail_free} tail blocks free)"
    )]
    OutOfBlocks {
        /// Tokens being appended.
        tokens: usize,
        /// Free sealed blocks.
        sealed_free: usize,
        /// Free tail blocks.
        tail_free: usize,
    },
    /// CUDA is not usable here (no driver, no device, no compiled kernels, or a
    /// driver error); use the CPU kernel.
    #[error("CUDA unavailable: {0}")]
    Cuda(String),
}
