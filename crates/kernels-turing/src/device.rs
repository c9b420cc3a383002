//! The host side of the kernels in `kernels/paged_attention.cu`, over any
//! [`Backend`] that can run them: the CUDA driver (`cuda::Cuda`, feature
//! `cuda`) or the CPU emulator (`emu::Emulator`, feature `cuda-emu`), which
//! runs the kernels' own source on the CPU so that their logic and this
//! code's arguments are tested on machines without a GPU.
//!
//! Everything here — shape checks, block tables, the pre-scaled (and
//! rotated) queries, grid and shared-memory sizes, argument order — is the
//! same for both backends.
//!
//! A layer's KV lives on the device as a [`DeviceKv`], filled and read the
//! way a [`KvStore`] is on the host:
//!
//! ```
//! use siliceo_kernels_turing::device::{Backend, Kernels};
//! use siliceo_kernels_turing::{KernelError, KvLayout, SeqKv};
//!
//! // A sequence of 100 tokens, then one decode step, on any backend.
//! fn decode_once<B: Backend>(k: &Kernels<B>) -> Result<Vec<f32>, KernelError> {
//!     let layout = KvLayout::preset("k5v4", 2, 64)?; // 2 KV heads of 64
//!     let mut kv = k.alloc(layout, 8, 2)?; // 8 sealed and 2 F16 tail blocks
//!     let mut seq = SeqKv::default();
//!     let row: Vec<f32> = (0..2 * 64).map(|i| (i % 7) as f32 / 7.0).collect();
//!     for _ in 0..100 {
//!         // One token's K and V; the 64th fills the first block, which is
//!         // quantized into a sealed block on the device.
//!         k.append(&mut kv, &mut seq, &row, &row)?;
//!     }
//!     let q = vec![0.1f32; 4 * 64]; // 4 query heads: 2 per KV head
//!     let out = k.decode(&kv, &[&seq], &q, 4, 0.125, 0)?;
//!     kv.release(&mut seq);
//!     Ok(out)
//! }
//! # #[cfg(feature = "cuda-emu")]
//! # assert_eq!(decode_once(&siliceo_kernels_turing::emu::EmuKernels::emulated()).unwrap().len(), 4 * 64);
//! ```
//!
//! On a GPU, `k` is a `cuda::CudaKernels` (feature `cuda`); where
//! `CudaKernels::new` fails (no driver, no device, no compiled kernels:
//! [`KernelError::Cuda`]) the same appends go to a [`KvStore`] and decode to
//! [`paged_attention`], the CPU kernel.

use std::time::Instant;

use crate::KernelError;
use crate::attention::{AttnParams, SeqQuery, paged_attention};
use crate::hadamard::hadamard;
use crate::shapes::codec_names;
pub use crate::shapes::{MAX_GROUP, check_attention};
use crate::store::{AppendStep, BlockPools, KvLayout, KvStore, SeqKv};

/// Warps per CTA in the decode kernel (`WARPS` in the .cu file).
const WARPS: usize = 4;
/// Most tokens in one decode partition (the kernel keeps its scores in shared memory).
pub const MAX_PARTITION_TOKENS: usize = 1024;
/// CTAs a decode call aims for when the caller leaves the partition size to
/// the kernels: several per SM on the GPUs this targets (40–132 SMs), so the
/// loads of many CTAs overlap.
pub const TARGET_CTAS: usize = 512;

/// The partition size used when the caller passes `partition_tokens = 0`:
/// enough partitions that KV heads × sequences × partitions reaches
/// [`TARGET_CTAS`], in whole 64-token steps, no shorter than 128 tokens (a
/// CTA's fixed costs — loading the queries, the softmax, the reduction —
/// want some tokens to spread over) and no longer than `most` (shared
/// memory). One sequence of 32k tokens over 8 KV heads gets 512-token
/// partitions (512 CTAs), over one KV head (MQA) 128-token ones (256 CTAs);
/// eight such sequences over 8 KV heads get `most`.
pub fn auto_partition_tokens(max_len: usize, kv_heads: usize, seqs: usize, most: usize) -> usize {
    let per_seq = TARGET_CTAS.div_ceil((kv_heads * seqs).max(1));
    let tokens = max_len.div_ceil(per_seq).div_ceil(64) * 64;
    tokens.clamp(128, most.max(128)).min(most)
}

/// Shared memory a CTA may use on every GPU the kernels target (sm_75's
/// opt-in limit).
pub const SHARED_BYTES_LIMIT: usize = 64 * 1024;

/// The longest decode partition (in tokens, a multiple of 64, at most
/// [`MAX_PARTITION_TOKENS`]) whose shared memory — query rows, scores and the
/// warps' partial sums, `group · (5·head_dim + tokens)` floats, plus two
/// floats per head — fits [`SHARED_BYTES_LIMIT`].
pub fn max_partition_tokens(group: usize, head_dim: usize) -> usize {
    let floats = SHARED_BYTES_LIMIT / 4 - 2 * group;
    let tokens = (floats / group).saturating_sub((WARPS + 1) * head_dim);
    (tokens / 64 * 64).min(MAX_PARTITION_TOKENS)
}

/// Grid, block and dynamic shared memory of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// CTAs in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per CTA (x only).
    pub block: u32,
    /// Bytes of dynamic shared memory per CTA.
    pub shared_bytes: u32,
}

/// One kernel argument, in the kernel's order.
#[derive(Debug)]
pub enum Arg<'a, B> {
    /// A device buffer (passed as its pointer).
    Buf(&'a B),
    /// A 32-bit signed integer.
    I32(i32),
    /// A 32-bit unsigned integer.
    U32(u32),
    /// A 32-bit float.
    F32(f32),
    /// A device address the backend did not allocate (a llama.cpp tensor's
    /// data on the same device: on CUDA a `CUdeviceptr` of the primary
    /// context, in the emulator a host address).
    Ptr(u64),
}

// Copy for any buffer type: an argument holds a buffer by reference.
impl<B> Clone for Arg<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Arg<'_, B> {}

impl<B> Arg<'_, B> {
    /// The argument's kind as the emulator checks it: pointer, int, unsigned.
    pub fn kind(&self) -> char {
        match self {
            Arg::Buf(_) | Arg::Ptr(_) => 'p',
            Arg::I32(_) => 'i',
            Arg::U32(_) => 'u',
            Arg::F32(_) => 'f',
        }
    }
}

/// Something that holds device buffers and runs the kernels.
pub trait Backend {
    /// A device buffer of bytes.
    type Buf;
    /// A buffer holding `bytes` (at least one byte is allocated, so an
    /// empty pool is still a valid pointer).
    fn upload(&self, bytes: &[u8]) -> Result<Self::Buf, KernelError>;
    /// A zeroed buffer of `bytes` (at least one byte is allocated).
    fn zeros(&self, bytes: usize) -> Result<Self::Buf, KernelError>;
    /// The buffer's bytes (waits for queued work).
    fn download(&self, buf: &Self::Buf) -> Result<Vec<u8>, KernelError>;
    /// The buffer's size in bytes.
    fn buf_len(buf: &Self::Buf) -> usize;
    /// The buffer's device address (for [`Arg::Ptr`] and kernels that take
    /// memory the backend did not allocate, such as tests standing in for
    /// llama.cpp's tensors).
    fn addr(&self, buf: &Self::Buf) -> u64;
    /// `len` bytes of the buffer from `offset` (waits for queued work).
    /// Callers check the range against [`Backend::buf_len`].
    fn read_at(&self, buf: &Self::Buf, offset: usize, len: usize) -> Result<Vec<u8>, KernelError>;
    /// Writes `bytes` into the buffer at `offset` (waits for queued work).
    /// Callers check the range against [`Backend::buf_len`].
    fn write_at(&self, buf: &mut Self::Buf, offset: usize, bytes: &[u8])
    -> Result<(), KernelError>;
    /// Queues a launch of the kernel named `kernel`.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters in order and type, and every
    /// address the kernel computes from them must lie inside the buffers.
    unsafe fn launch(
        &self,
        kernel: &str,
        launch: Launch,
        args: &[Arg<'_, Self::Buf>],
    ) -> Result<(), KernelError>;
    /// Waits for every queued launch.
    fn synchronize(&self) -> Result<(), KernelError>;
}

/// The kernels on a backend.
#[derive(Debug)]
pub struct Kernels<B> {
    backend: B,
}

/// A paged KV store for one layer on a backend: the sealed and tail pools in
/// device memory, and their bookkeeping ([`BlockPools`]) on the host. Filled
/// through [`Kernels::append`], it holds the same bytes in the same blocks as
/// a [`KvStore`] given the same appends and releases.
#[derive(Debug)]
pub struct DeviceKv<B: Backend> {
    pub(crate) layout: KvLayout,
    pub(crate) sealed: B::Buf,
    pub(crate) tail: B::Buf,
    pub(crate) pools: BlockPools,
}

impl<B: Backend> DeviceKv<B> {
    /// The store's layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Bytes of the sealed and tail pools (their blocks: an empty pool,
    /// f16's sealed one, takes none, though the backends allocate a byte).
    pub fn bytes(&self) -> usize {
        let (sealed, tail) = self.pools.capacity();
        sealed * self.layout.block_bytes() + tail * self.layout.tail_block_bytes()
    }

    /// The block bookkeeping (which blocks are free).
    pub fn pools(&self) -> &BlockPools {
        &self.pools
    }

    /// Free (sealed, tail) blocks.
    pub fn free_blocks(&self) -> (usize, usize) {
        self.pools.free_blocks()
    }

    /// Returns the sequence's blocks to the pools and empties it.
    pub fn release(&mut self, seq: &mut SeqKv) {
        self.pools.release(seq);
    }

    /// A shape error unless every block of `seq` lies inside the pools (a
    /// block table from another store would send the kernels past them).
    fn check_blocks(&self, seq: &SeqKv) -> Result<(), KernelError> {
        let (sealed, tail) = self.pools.capacity();
        if seq.sealed.iter().any(|&b| b as usize >= sealed)
            || seq.tail.iter().any(|&b| b as usize >= tail)
        {
            return Err(KernelError::Shape(format!(
                "a block table names a block outside the pools ({sealed} sealed, {tail} tail blocks)"
            )));
        }
        Ok(())
    }
}

/// Little-endian bytes of numbers (what a device buffer holds).
pub(crate) fn le_bytes<T, const N: usize>(x: &[T], to_le: impl Fn(&T) -> [u8; N]) -> Vec<u8> {
    x.iter().flat_map(to_le).collect()
}

pub(crate) fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

impl<B: Backend> Kernels<B> {
    /// The kernels on `backend`.
    pub fn from_backend(backend: B) -> Kernels<B> {
        Kernels { backend }
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Uploads a store's pools, with its bookkeeping: the store's sequences
    /// can be decoded, appended to and released on the device.
    pub fn upload(&self, store: &KvStore) -> Result<DeviceKv<B>, KernelError> {
        Ok(DeviceKv {
            layout: *store.layout(),
            sealed: self.backend.upload(store.sealed_bytes())?,
            tail: self.backend.upload(store.tail_bytes())?,
            pools: store.pools().clone(),
        })
    }

    /// An empty store of `sealed_blocks` and `tail_blocks` (zeroed, all free)
    /// for `layout`, filled by [`Kernels::append`].
    pub fn alloc(
        &self,
        layout: KvLayout,
        sealed_blocks: usize,
        tail_blocks: usize,
    ) -> Result<DeviceKv<B>, KernelError> {
        let pools = BlockPools::new(&layout, sealed_blocks, tail_blocks)?;
        Ok(DeviceKv {
            layout,
            sealed: self.backend.zeros(sealed_blocks * layout.block_bytes())?,
            tail: self
                .backend
                .zeros(tail_blocks * layout.tail_block_bytes())?,
            pools,
        })
    }

    /// Appends `n` tokens to `seq`, as [`KvStore::append`] does on the host:
    /// `k` and `v` are `n × kv_heads × head_dim` (token-major, then head); K is
    /// rotated when the layout says so, tokens go into the F16 tail, and tail
    /// blocks that age out are sealed on the device. When blocks run out,
    /// nothing is written and nothing changes. When the device fails midway,
    /// `seq` and the pools are left as they were but the sequence's bytes may
    /// be partly overwritten (a tail block sealed early in the call can be
    /// reused by a later token): release it.
    pub fn append(
        &self,
        kv: &mut DeviceKv<B>,
        seq: &mut SeqKv,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KernelError> {
        let l = kv.layout;
        let n = l.tokens_in(k, v)?;
        kv.check_blocks(seq)?;
        let (mut pools, mut planned) = (kv.pools.clone(), seq.clone());
        let steps = pools.plan_append(&mut planned, n)?;
        let mut rotated = Vec::new();
        let k = if l.rotate_k {
            rotated.extend_from_slice(k);
            rotated.chunks_exact_mut(l.head_dim).for_each(hadamard);
            &rotated[..]
        } else {
            k
        };
        let row = l.kv_heads * l.head_dim;
        // Runs of consecutive tokens are written by one launch each, in order
        // with the seals between them (a sealed tail block may be reused).
        let (mut first, mut blocks, mut rows) = (0, Vec::new(), Vec::new());
        let flush =
            |kv: &mut DeviceKv<B>, first: usize, blocks: &mut Vec<u32>, rows: &mut Vec<i32>| {
                let span = first * row..(first + blocks.len()) * row;
                let r = self.write_rows(kv, &k[span.clone()], &v[span], blocks, rows);
                blocks.clear();
                rows.clear();
                r
            };
        for step in steps {
            match step {
                AppendStep::Write { token, block, row } => {
                    if blocks.is_empty() {
                        first = token;
                    }
                    blocks.push(block);
                    rows.push(row as i32);
                }
                AppendStep::Seal { src, dst } => {
                    flush(kv, first, &mut blocks, &mut rows)?;
                    self.seal(kv, src, dst)?;
                }
            }
        }
        flush(kv, first, &mut blocks, &mut rows)?;
        kv.pools = pools;
        *seq = planned;
        Ok(())
    }

    /// Copies the device pools back (sealed, tail).
    pub fn download(&self, kv: &DeviceKv<B>) -> Result<(Vec<u8>, Vec<u8>), KernelError> {
        Ok((
            self.backend.download(&kv.sealed)?,
            self.backend.download(&kv.tail)?,
        ))
    }

    /// Decode attention (one query token per sequence) on the device. `q` is
    /// `seqs.len() × n_heads × head_dim`; partitions of `partition_tokens`
    /// (at most [`max_partition_tokens`]; 0 = [`auto_partition_tokens`]) split
    /// long contexts over more CTAs, reduced by a second kernel.
    /// Returns the output, same shape as `q`.
    pub fn decode(
        &self,
        kv: &DeviceKv<B>,
        seqs: &[&SeqKv],
        q: &[f32],
        n_heads: usize,
        scale: f32,
        partition_tokens: usize,
    ) -> Result<Vec<f32>, KernelError> {
        let run = self.prepare_decode(kv, seqs, q, n_heads, scale, partition_tokens)?;
        run.launch(self, kv)?;
        run.output(self)
    }

    /// Uploads everything a decode call needs; [`DecodeRun::launch`] then only
    /// launches (what the benchmark times).
    pub fn prepare_decode(
        &self,
        kv: &DeviceKv<B>,
        seqs: &[&SeqKv],
        q: &[f32],
        n_heads: usize,
        scale: f32,
        partition_tokens: usize,
    ) -> Result<DecodeRun<B>, KernelError> {
        let l = kv.layout;
        let d = l.head_dim;
        if q.len() != seqs.len() * n_heads * d || seqs.is_empty() {
            return Err(KernelError::Shape(format!(
                "q has {} values for {} sequences",
                q.len(),
                seqs.len()
            )));
        }
        let mut qh = q.to_vec();
        for row in qh.chunks_exact_mut(d) {
            for x in row.iter_mut() {
                *x *= scale;
            }
            if l.rotate_k {
                hadamard(row);
            }
        }
        self.decode_run(kv, seqs, n_heads, partition_tokens, Some(&qh), None)
    }

    /// A decode run over `seqs`: checks, block tables, partitions. With
    /// `q` (pre-scaled and rotated) it owns its query and output buffers;
    /// without, a caller's query buffer is read and the output goes where
    /// the caller points it ([`Kernels::graft_layer`]). With `tokens`
    /// (`map`, `batch`) sequence `i`'s query, output and partial rows are
    /// those of batch token `map[i]` of a batch of `batch` tokens.
    pub(crate) fn decode_run(
        &self,
        kv: &DeviceKv<B>,
        seqs: &[&SeqKv],
        n_heads: usize,
        partition_tokens: usize,
        q: Option<&[f32]>,
        tokens: Option<(&[i32], usize)>,
    ) -> Result<DecodeRun<B>, KernelError> {
        let l = kv.layout;
        let d = l.head_dim;
        let (name, kg, vg) = self.check_attention(&l, n_heads)?;
        // Query heads per KV head, rounded up to the kernel's 1, 2, 4 or 8.
        let group = (n_heads / l.kv_heads).next_power_of_two();
        let max_len = seqs.iter().map(|s| s.len).max().unwrap_or(0);
        let tables = BlockTables::new(self, kv, seqs)?;
        let most = max_partition_tokens(group, d);
        let part = if partition_tokens == 0 {
            auto_partition_tokens(max_len, l.kv_heads, seqs.len(), most)
        } else {
            partition_tokens
        }
        .min(max_len);
        if part > most {
            return Err(KernelError::Shape(format!(
                "partitions of {part} tokens exceed the kernel's shared memory with heads of {d} and {group} query heads per KV head; split with partition_tokens ≤ {most}"
            )));
        }
        let p = max_len.div_ceil(part);
        let b = &self.backend;
        let (map, rows) = match tokens {
            Some((map, batch)) => {
                if map.len() != seqs.len() || map.iter().any(|&t| t < 0 || t as usize >= batch) {
                    return Err(KernelError::Shape(format!(
                        "a token map of {} entries for {} sequences in a batch of {batch}",
                        map.len(),
                        seqs.len()
                    )));
                }
                (Some(upload_i32(b, map)?), batch * n_heads)
            }
            None => (None, seqs.len() * n_heads),
        };
        Ok(DecodeRun {
            kernel: format!("siliceo_attn_decode_{name}_d{d}_g{group}"),
            group,
            out: match q {
                Some(_) => Some(b.zeros(rows * d * 4)?),
                None => None,
            },
            part_m: b.zeros(rows * p * 4)?,
            part_l: b.zeros(rows * p * 4)?,
            part_acc: b.zeros(rows * p * d * 4)?,
            q: match q {
                Some(q) => Some(b.upload(&le_bytes(q, |x| x.to_le_bytes()))?),
                None => None,
            },
            tokens: map,
            tables,
            shape: DecodeShape {
                heads: n_heads as i32,
                kv_heads: l.kv_heads as i32,
                block_tokens: l.block_tokens as i32,
                k_group: kg,
                v_group: vg,
                partition_tokens: part as i32,
                partitions: p as i32,
            },
            seqs: seqs.len(),
            d,
            store: (l, kv.pools.capacity()),
        })
    }

    /// [`check_attention`] (the kernels' name for the layout's codecs).
    pub(crate) fn check_attention(
        &self,
        l: &KvLayout,
        n_heads: usize,
    ) -> Result<(&'static str, i32, i32), KernelError> {
        check_attention(l, n_heads)
    }

    /// Writes `n` new tokens' K and V (`n × kv_heads × head_dim` f32 each)
    /// into the F16 tail: token `i` goes to row `rows[i]` of tail block
    /// `blocks[i]`. K is written as given (not rotated). A raw step for
    /// callers that keep their own block tables: it leaves the pools'
    /// bookkeeping alone, where [`Kernels::append`] keeps it.
    pub fn write_rows(
        &self,
        kv: &mut DeviceKv<B>,
        k: &[f32],
        v: &[f32],
        blocks: &[u32],
        rows: &[i32],
    ) -> Result<(), KernelError> {
        let l = kv.layout;
        let n = blocks.len();
        if k.len() != n * l.kv_heads * l.head_dim || v.len() != k.len() || rows.len() != n {
            return Err(KernelError::Shape(
                "write_rows: K, V, blocks and rows disagree".into(),
            ));
        }
        if blocks
            .iter()
            .any(|&b| (b as usize + 1) * l.tail_block_bytes() > B::buf_len(&kv.tail))
        {
            return Err(KernelError::Shape(
                "write_rows: a tail block index is outside the pool".into(),
            ));
        }
        if rows.iter().any(|&r| r < 0 || r as usize >= l.block_tokens) {
            return Err(KernelError::Shape(
                "write_rows: a row is outside the block".into(),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        let b = &self.backend;
        let (dk, dv) = (
            b.upload(&le_bytes(k, |x| x.to_le_bytes()))?,
            b.upload(&le_bytes(v, |x| x.to_le_bytes()))?,
        );
        let (db, dr) = (
            b.upload(&le_bytes(blocks, |x| x.to_le_bytes()))?,
            b.upload(&le_bytes(rows, |x| x.to_le_bytes()))?,
        );
        let total = (n * l.kv_heads * l.head_dim) as u32;
        let launch = Launch {
            grid: (total.div_ceil(256), 1, 1),
            block: 256,
            shared_bytes: 0,
        };
        let args = [
            Arg::Buf(&kv.tail),
            Arg::Buf(&dk),
            Arg::Buf(&dv),
            Arg::Buf(&db),
            Arg::Buf(&dr),
            Arg::I32(n as i32),
            Arg::I32(l.kv_heads as i32),
            Arg::I32(l.head_dim as i32),
            Arg::I32(l.block_tokens as i32),
        ];
        // SAFETY: the arguments match `siliceo_kv_append` in paged_attention.cu;
        // it runs n·kv_heads·head_dim threads (the rest return) and writes row
        // rows[i] < block_tokens of tail block blocks[i], both checked above.
        unsafe { b.launch("siliceo_kv_append", launch, &args) }?;
        b.synchronize()
    }

    /// Queues `siliceo_attn_reduce`: merges the `P` partial rows of each of
    /// `rows` rows' `heads` heads of `d` into `out`; row `i` is batch token
    /// `tokens[i]` (`Arg::Ptr(0)`: token `i`).
    ///
    /// # Safety
    /// The partial buffers (max, sum, acc) hold `P` (× `d`) f32 for every
    /// (token, head) row named, and `out` `d` f32 for each.
    pub(crate) unsafe fn reduce(
        &self,
        out: Arg<'_, B::Buf>,
        [m, l, acc]: [&B::Buf; 3],
        (heads, d, p): (i32, usize, i32),
        rows: usize,
        tokens: Arg<'_, B::Buf>,
        sinks: u64,
    ) -> Result<(), KernelError> {
        let args = [
            out,
            Arg::Buf(m),
            Arg::Buf(l),
            Arg::Buf(acc),
            Arg::I32(heads),
            Arg::I32(d as i32),
            Arg::I32(p),
            tokens,
            Arg::Ptr(sinks),
        ];
        let launch = Launch {
            grid: (heads as u32, rows as u32, 1),
            block: d as u32,
            shared_bytes: 0,
        };
        // SAFETY: arguments match `siliceo_attn_reduce`; sizes as the caller
        // promised.
        unsafe { self.backend.launch("siliceo_attn_reduce", launch, &args) }
    }

    /// Quantizes tail block `src` (full, F16) into sealed block `dst` with the
    /// layout's codecs (the tail block ageing out). A raw step like
    /// [`Kernels::write_rows`]: the pools' bookkeeping is left alone.
    pub fn seal(&self, kv: &mut DeviceKv<B>, src: u32, dst: u32) -> Result<(), KernelError> {
        self.enqueue_seal(kv, src, dst)?;
        self.backend.synchronize()
    }

    /// [`Kernels::seal`], queued without waiting.
    pub(crate) fn enqueue_seal(
        &self,
        kv: &mut DeviceKv<B>,
        src: u32,
        dst: u32,
    ) -> Result<(), KernelError> {
        let l = kv.layout;
        if (src as usize + 1) * l.tail_block_bytes() > B::buf_len(&kv.tail)
            || (dst as usize + 1) * l.block_bytes() > B::buf_len(&kv.sealed)
        {
            return Err(KernelError::Shape(
                "seal: block index outside the pool".into(),
            ));
        }
        let (name, kg, vg) = codec_names(&l)?;
        let launch = Launch {
            grid: (l.kv_heads as u32, 2, 1),
            block: 128,
            shared_bytes: (l.block_tokens * l.head_dim) as u32,
        };
        let args = [
            Arg::Buf(&kv.sealed),
            Arg::Buf(&kv.tail),
            Arg::U32(src),
            Arg::U32(dst),
            Arg::I32(l.kv_heads as i32),
            Arg::I32(l.head_dim as i32),
            Arg::I32(l.block_tokens as i32),
            Arg::I32(kg),
            Arg::I32(vg),
        ];
        // SAFETY: the arguments match `siliceo_kv_seal_*`; both blocks were
        // checked against the pools above.
        unsafe {
            self.backend
                .launch(&format!("siliceo_kv_seal_{name}"), launch, &args)
        }
    }
}

/// The block tables of a kernel launch's sequences on the device: each
/// sequence's sealed and tail blocks (rows of the longest's length), its
/// length and its sealed blocks' count — the `Tables` of the .cu file.
#[derive(Debug)]
pub(crate) struct BlockTables<B: Backend> {
    sealed_tab: B::Buf,
    tail_tab: B::Buf,
    lens: B::Buf,
    n_sealed: B::Buf,
    max_sealed: i32,
    max_tail: i32,
}

impl<B: Backend> BlockTables<B> {
    /// Checks `seqs` against `kv`'s pools (tokens, tables that match their
    /// lengths, blocks inside the pools) and uploads their tables.
    pub(crate) fn new(
        k: &Kernels<B>,
        kv: &DeviceKv<B>,
        seqs: &[&SeqKv],
    ) -> Result<BlockTables<B>, KernelError> {
        let bt = kv.layout.block_tokens;
        if seqs.is_empty() {
            return Err(KernelError::Shape("a decode needs a sequence".into()));
        }
        if seqs
            .iter()
            .any(|s| s.len == 0 || s.blocks() != s.len.div_ceil(bt))
        {
            return Err(KernelError::Shape(
                "every sequence needs tokens and a matching block table".into(),
            ));
        }
        for s in seqs {
            kv.check_blocks(s)?;
        }
        let max_sealed = seqs
            .iter()
            .map(|s| s.sealed.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let max_tail = seqs.iter().map(|s| s.tail.len()).max().unwrap_or(0).max(1);
        let mut sealed_tab = vec![0u32; seqs.len() * max_sealed];
        let mut tail_tab = vec![0u32; seqs.len() * max_tail];
        for (i, s) in seqs.iter().enumerate() {
            sealed_tab[i * max_sealed..i * max_sealed + s.sealed.len()].copy_from_slice(&s.sealed);
            tail_tab[i * max_tail..i * max_tail + s.tail.len()].copy_from_slice(&s.tail);
        }
        let lens: Vec<i32> = seqs.iter().map(|s| s.len as i32).collect();
        let n_sealed: Vec<i32> = seqs.iter().map(|s| s.sealed.len() as i32).collect();
        let b = k.backend();
        Ok(BlockTables {
            sealed_tab: b.upload(&le_bytes(&sealed_tab, |x| x.to_le_bytes()))?,
            tail_tab: b.upload(&le_bytes(&tail_tab, |x| x.to_le_bytes()))?,
            lens: upload_i32(b, &lens)?,
            n_sealed: upload_i32(b, &n_sealed)?,
            max_sealed: max_sealed as i32,
            max_tail: max_tail as i32,
        })
    }

    /// The kernels' arguments from `sealed` to `max_tail`, in their order.
    pub(crate) fn args<'a>(&'a self, kv: &'a DeviceKv<B>) -> [Arg<'a, B::Buf>; 8] {
        [
            Arg::Buf(&kv.sealed),
            Arg::Buf(&kv.tail),
            Arg::Buf(&self.sealed_tab),
            Arg::Buf(&self.tail_tab),
            Arg::Buf(&self.lens),
            Arg::Buf(&self.n_sealed),
            Arg::I32(self.max_sealed),
            Arg::I32(self.max_tail),
        ]
    }
}

/// `x` in a new device buffer.
pub(crate) fn upload_i32<B: Backend>(b: &B, x: &[i32]) -> Result<B::Buf, KernelError> {
    b.upload(&le_bytes(x, |v| v.to_le_bytes()))
}

/// A sliding window as the kernels' `int` argument (0 = none).
pub(crate) fn window_arg(window: usize) -> Result<i32, KernelError> {
    i32::try_from(window).map_err(|_| KernelError::Shape(format!("a window of {window} tokens")))
}

/// A decode call with its inputs on the device, ready to launch again and
/// again (the benchmark times [`DecodeRun::enqueue`]).
#[derive(Debug)]
pub struct DecodeRun<B: Backend> {
    kernel: String,
    /// Query heads per KV head the kernel is built for (`GT`).
    group: usize,
    /// The output, unless the caller names one ([`DecodeRun::enqueue_into`]).
    out: Option<B::Buf>,
    part_m: B::Buf,
    part_l: B::Buf,
    part_acc: B::Buf,
    /// The queries, unless the caller's buffer holds them.
    q: Option<B::Buf>,
    /// Each sequence's batch token (none: sequence i is token i).
    tokens: Option<B::Buf>,
    tables: BlockTables<B>,
    shape: DecodeShape,
    seqs: usize,
    d: usize,
    /// The layout and pool sizes the block tables were checked against.
    store: (KvLayout, (usize, usize)),
}

/// The decode kernel's integer arguments after the block tables, in its order.
#[derive(Debug, Clone, Copy)]
struct DecodeShape {
    heads: i32,
    kv_heads: i32,
    block_tokens: i32,
    k_group: i32,
    v_group: i32,
    partition_tokens: i32,
    partitions: i32,
}

impl<B: Backend> DecodeRun<B> {
    /// Grid, block and shared memory of the decode kernel.
    fn decode_launch(&self) -> Launch {
        let (sh, d) = (self.shape, self.d);
        Launch {
            grid: (sh.kv_heads as u32, self.seqs as u32, sh.partitions as u32),
            block: (WARPS * 32) as u32,
            // qs[GT][D] | scores[GT][part] | red[WARPS][GT][D], f32.
            shared_bytes: (self.group * (d + sh.partition_tokens as usize + WARPS * d) * 4) as u32,
        }
    }

    /// Queues the decode kernel (and the reduction when there are several
    /// partitions) without waiting.
    pub fn enqueue(&self, k: &Kernels<B>, kv: &DeviceKv<B>) -> Result<(), KernelError> {
        let (Some(out), Some(q)) = (self.out.as_ref(), self.q.as_ref()) else {
            return Err(KernelError::Shape(
                "this decode run reads and writes where its caller says".into(),
            ));
        };
        // SAFETY: the run's own buffers: queries and output of seqs × heads ×
        // head_dim f32.
        unsafe { self.enqueue_into(k, kv, Arg::Buf(out), Arg::Buf(q), 0, 0) }
    }

    /// [`DecodeRun::enqueue`] with the queries read from `q` and the output
    /// written to `out`, each query seeing its last `window` tokens (0 = all),
    /// with the attention sinks at device address `sinks` (f32 per query
    /// head; 0 = none).
    ///
    /// # Safety
    /// `q` and `out` must be device buffers (or addresses) holding `rows ×
    /// heads × head_dim` f32, `rows` the run's sequences or, with a token
    /// map, its batch's tokens; `sinks`, when not 0, one f32 per head.
    pub(crate) unsafe fn enqueue_into(
        &self,
        k: &Kernels<B>,
        kv: &DeviceKv<B>,
        out: Arg<'_, B::Buf>,
        q: Arg<'_, B::Buf>,
        window: usize,
        sinks: u64,
    ) -> Result<(), KernelError> {
        let window = window_arg(window)?;
        if (kv.layout, kv.pools.capacity()) != self.store {
            return Err(KernelError::Shape(
                "a decode run launched on a store of another layout or size than it was prepared for"
                    .into(),
            ));
        }
        let sh = self.shape;
        if !matches!(out, Arg::Buf(_) | Arg::Ptr(_)) || !matches!(q, Arg::Buf(_) | Arg::Ptr(_)) {
            return Err(KernelError::Shape(
                "a decode's queries and output are buffers".into(),
            ));
        }
        let tokens = match &self.tokens {
            Some(t) => Arg::Buf(t),
            None => Arg::Ptr(0),
        };
        let [sealed, tail, st, tt, lens, ns, ms, mt] = self.tables.args(kv);
        let args = [
            out,
            Arg::Buf(&self.part_m),
            Arg::Buf(&self.part_l),
            Arg::Buf(&self.part_acc),
            q,
            sealed,
            tail,
            st,
            tt,
            lens,
            ns,
            ms,
            mt,
            Arg::I32(sh.heads),
            Arg::I32(sh.kv_heads),
            Arg::I32(sh.block_tokens),
            Arg::I32(sh.k_group),
            Arg::I32(sh.v_group),
            Arg::I32(sh.partition_tokens),
            Arg::I32(sh.partitions),
            tokens,
            Arg::I32(window),
            Arg::Ptr(sinks),
        ];
        // SAFETY: the arguments match `siliceo_attn_decode_*` in
        // paged_attention.cu; the tables were checked against pools of this
        // layout and size (above and in `BlockTables::new`), so every block
        // index is inside the pools, and every mapped token inside the batch.
        unsafe { k.backend.launch(&self.kernel, self.decode_launch(), &args) }?;
        if sh.partitions > 1 {
            // SAFETY: the partial buffers hold rows × P (× D) for every row
            // the kernel wrote; `out` as the caller promised.
            unsafe {
                k.reduce(
                    out,
                    [&self.part_m, &self.part_l, &self.part_acc],
                    (sh.heads, self.d, sh.partitions),
                    self.seqs,
                    tokens,
                    sinks,
                )
            }?;
        }
        Ok(())
    }

    /// Switches to the variant of the kernel that keeps `loads` K/V rows in
    /// flight per lane (1, 2, 4 or 8; 0 keeps the default). Only F16 heads of
    /// 128 have variants (for tuning on a GPU: `bench --gpu --loads`).
    pub fn with_loads_in_flight(mut self, loads: usize) -> Result<Self, KernelError> {
        if loads == 0 {
            return Ok(self);
        }
        let base = "siliceo_attn_decode_f16_f16_d128_g";
        if !self.kernel.starts_with(base) || self.kernel.contains("_u") {
            return Err(KernelError::Layout(format!(
                "{}: only F16 heads of 128 come with loads-in-flight variants",
                self.kernel
            )));
        }
        if ![1, 2, 4, 8].contains(&loads) {
            return Err(KernelError::Layout(format!(
                "{loads} loads in flight: the variants keep 1, 2, 4 or 8"
            )));
        }
        self.kernel = format!("{}_u{loads}", self.kernel);
        Ok(self)
    }

    /// Tokens per partition this run uses.
    pub fn partition_tokens(&self) -> usize {
        self.shape.partition_tokens as usize
    }

    /// Launches and waits.
    pub fn launch(&self, k: &Kernels<B>, kv: &DeviceKv<B>) -> Result<(), KernelError> {
        self.enqueue(k, kv)?;
        k.backend.synchronize()
    }

    /// The output of the last launch (`seqs × n_heads × head_dim`).
    pub fn output(&self, k: &Kernels<B>) -> Result<Vec<f32>, KernelError> {
        let out = self.out.as_ref().ok_or_else(|| {
            KernelError::Shape("this decode run wrote where its caller said".into())
        })?;
        Ok(bytes_f32(&k.backend.download(out)?))
    }
}

/// What [`bench_decode`] measures.
#[derive(Debug, Clone)]
pub struct BenchShape<'a> {
    /// Context lengths (tokens per sequence).
    pub ctxs: &'a [usize],
    /// Layout presets (`f16`, `kv8`, `k5v4`).
    pub formats: &'a [String],
    /// Query heads.
    pub heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Timed reps per row (the median is reported).
    pub reps: usize,
    /// Partition sizes in tokens (each ≤ [`MAX_PARTITION_TOKENS`]).
    pub partitions: &'a [usize],
    /// Sequences decoded together.
    pub batch: usize,
    /// Tokens per block (64 in the presets).
    pub block_tokens: usize,
    /// Loads in flight per lane to try (0: the kernel's default; others only
    /// where [`DecodeRun::with_loads_in_flight`] has a variant).
    pub loads: &'a [usize],
    /// Decode calls queued back to back per timed rep, so that the host's
    /// launch and wait latency (several µs, as long as a short call) is not
    /// counted as kernel time: [`LAUNCHES_PER_REP`] on a GPU, 1 in the
    /// emulator (where a call takes a while and only the code path matters).
    pub launches: usize,
}

/// One row of [`bench_decode`].
#[derive(Debug, Clone)]
pub struct DecodeBench {
    /// Layout preset.
    pub format: String,
    /// Tokens per sequence.
    pub ctx: usize,
    /// Sequences.
    pub batch: usize,
    /// Tokens per partition (as the kernels ran it: 0 asked becomes the default).
    pub partition_tokens: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Loads in flight per lane (0: the kernel's default).
    pub loads: usize,
    /// Median seconds per decode call (decode kernel and reduction).
    pub seconds: f64,
    /// Bytes of KV the call reads (every block of every sequence).
    pub kv_bytes: usize,
    /// Largest difference from the CPU kernel's output.
    pub max_diff: f32,
}

/// The largest `|got − want|` over two outputs; infinite where `got` is not
/// finite (a NaN would otherwise vanish in the max).
pub fn max_abs_diff(got: &[f32], want: &[f32]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(a, b)| {
            if a.is_finite() {
                (a - b).abs()
            } else {
                f32::INFINITY
            }
        })
        .fold(0f32, f32::max)
}

/// Decode calls per timed rep on a GPU ([`BenchShape::launches`]).
pub const LAUNCHES_PER_REP: usize = 20;

/// Times the decode kernel on `k` for every format, context and partition
/// size of `shape`, and checks each against the CPU kernel; `row` gets each
/// result as soon as it is measured. A store is filled once per format and
/// context (every partition size reuses it).
pub fn bench_decode<B: Backend>(
    k: &Kernels<B>,
    shape: &BenchShape<'_>,
    mut row: impl FnMut(&DecodeBench),
) -> Result<(), KernelError> {
    let (heads, head_dim, batch) = (shape.heads, shape.head_dim, shape.batch);
    for fmt in shape.formats {
        let mut layout = KvLayout::preset(fmt, shape.kv_heads, head_dim)?;
        layout.block_tokens = shape.block_tokens;
        for &ctx in shape.ctxs {
            let mut store = KvStore::new(
                layout,
                batch * ctx.div_ceil(layout.block_tokens),
                batch * KvStore::tail_blocks_per_seq(&layout),
            )?;
            let width = shape.kv_heads * head_dim;
            let mut seqs = vec![SeqKv::default(); batch];
            for (si, s) in seqs.iter_mut().enumerate() {
                let mut at = 0;
                while at < ctx {
                    let n = (ctx - at).min(4096);
                    let kv: Vec<f32> = (0..n * width)
                        .map(|i| {
                            (((i + at * width + si * 7) * 2_654_435_761) % 2001) as f32 / 1000.0
                                - 1.0
                        })
                        .collect();
                    store.append(s, &kv, &kv)?;
                    at += n;
                }
            }
            let q: Vec<f32> = (0..batch * heads * head_dim)
                .map(|i| ((i * 40_503) % 997) as f32 / 500.0 - 1.0)
                .collect();
            let scale = 1.0 / (head_dim as f32).sqrt();
            let dev = k.upload(&store)?;
            let refs: Vec<&SeqKv> = seqs.iter().collect();
            let queries: Vec<SeqQuery<'_>> = seqs
                .iter()
                .enumerate()
                .map(|(i, s)| SeqQuery {
                    kv: s,
                    q: &q[i * heads * head_dim..(i + 1) * heads * head_dim],
                    n_q: 1,
                })
                .collect();
            let mut want = vec![0f32; q.len()];
            paged_attention(
                &store,
                heads,
                scale,
                &queries,
                &mut want,
                &AttnParams::default(),
            )?;
            let kv_bytes: usize = seqs
                .iter()
                .map(|s| {
                    s.sealed.len() * layout.block_bytes() + s.tail.len() * layout.tail_block_bytes()
                })
                .sum();
            for (&partition_tokens, &loads) in shape
                .partitions
                .iter()
                .flat_map(|p| shape.loads.iter().map(move |l| (p, l)))
            {
                let run = k.prepare_decode(&dev, &refs, &q, heads, scale, partition_tokens)?;
                // Formats without the variant are left out of that row.
                let Ok(run) = run.with_loads_in_flight(loads) else {
                    continue;
                };
                run.launch(k, &dev)?;
                let max_diff = max_abs_diff(&run.output(k)?, &want);
                // Each rep queues `launches` calls back to back and waits once.
                let launches = shape.launches.max(1);
                let mut times = Vec::new();
                for _ in 0..shape.reps.max(1) {
                    let t0 = Instant::now();
                    for _ in 0..launches {
                        run.enqueue(k, &dev)?;
                    }
                    k.backend.synchronize()?;
                    times.push(t0.elapsed().as_secs_f64() / launches as f64);
                }
                times.sort_by(f64::total_cmp);
                row(&DecodeBench {
                    format: fmt.clone(),
                    ctx,
                    batch,
                    partition_tokens: run.partition_tokens(),
                    block_tokens: layout.block_tokens,
                    loads,
                    seconds: times[times.len() / 2],
                    kv_bytes,
                    max_diff,
                });
            }
            for s in seqs.iter_mut() {
                store.release(s);
            }
        }
    }
    Ok(())
}
