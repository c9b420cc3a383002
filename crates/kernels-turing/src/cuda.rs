//! The CUDA kernels of `kernels/paged_attention.cu`, loaded at run time
//! through cudarc (dynamic loading: the crate builds with no toolkit; a
//! machine with no driver, no device or no compiled kernels gets
//! [`KernelError::Cuda`], and the caller uses the CPU kernel).
//!
//! The kernels are compiled by `cargo xtask kernels` into `kernels/build/`
//! (or the directory `SILICEO_KERNELS_DIR` names): a cubin for the device's
//! architecture is used where there is one (sm_75, sm_80, sm_90), else the
//! compute_75 PTX, which the driver JIT-compiles for Ampere, Ada or Hopper.
//! The PTX is ISA 9.0 (CUDA 13.0): it needs a CUDA 13 driver (R580+).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use crate::KernelError;
use crate::codec::Codec;
use crate::hadamard::hadamard;
use crate::store::{KvLayout, KvStore, SeqKv};

/// Warps per CTA in the decode kernel (`WARPS` in the .cu file).
const WARPS: usize = 4;
/// Query heads per KV head the kernel handles at most (`G_MAX`).
pub const MAX_GROUP: usize = 8;

fn cuda_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> KernelError + '_ {
    move |e| KernelError::Cuda(format!("{what}: {e:?}"))
}

/// Where `cargo xtask kernels` leaves the compiled kernels.
pub fn default_kernels_dir() -> PathBuf {
    std::env::var_os("SILICEO_KERNELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels/build"))
}

/// A device with the kernels loaded.
#[derive(Debug)]
pub struct CudaKernels {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    name: String,
    compute_capability: (i32, i32),
    image: PathBuf,
}

/// A [`KvStore`]'s pools on the device.
#[derive(Debug)]
pub struct DeviceKv {
    layout: KvLayout,
    sealed: CudaSlice<u8>,
    tail: CudaSlice<u8>,
}

impl DeviceKv {
    /// Bytes of the sealed and tail pools.
    pub fn bytes(&self) -> usize {
        self.sealed.len() + self.tail.len()
    }
}

impl CudaKernels {
    /// Opens device `ordinal` and loads the kernels from [`default_kernels_dir`].
    pub fn new(ordinal: usize) -> Result<CudaKernels, KernelError> {
        CudaKernels::with_dir(ordinal, &default_kernels_dir())
    }

    /// Opens device `ordinal` and loads the kernels from `dir`.
    pub fn with_dir(ordinal: usize, dir: &Path) -> Result<CudaKernels, KernelError> {
        // SAFETY: only probes whether the driver library can be opened.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(KernelError::Cuda(
                "no CUDA driver library (libcuda.so) on this machine".into(),
            ));
        }
        // cudarc panics on a driver that lacks a symbol it binds: keep that
        // inside this call.
        std::panic::catch_unwind(|| CudaKernels::open(ordinal, dir)).unwrap_or_else(|_| {
            Err(KernelError::Cuda(
                "the CUDA driver library is unusable (cudarc panicked)".into(),
            ))
        })
    }

    fn open(ordinal: usize, dir: &Path) -> Result<CudaKernels, KernelError> {
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("no usable CUDA device"))?;
        let cc = ctx
            .compute_capability()
            .map_err(cuda_err("compute capability"))?;
        let name = ctx.name().map_err(cuda_err("device name"))?;
        let cubin = dir.join(format!("paged_attention.sm_{}{}.cubin", cc.0, cc.1));
        let ptx = dir.join("paged_attention.compute_75.ptx");
        let (image, module) = if cubin.exists() {
            let bytes = std::fs::read(&cubin)
                .map_err(|e| KernelError::Cuda(format!("{}: {e}", cubin.display())))?;
            (cubin.clone(), ctx.load_module(Ptx::from_binary(bytes)))
        } else if ptx.exists() {
            let src = std::fs::read_to_string(&ptx)
                .map_err(|e| KernelError::Cuda(format!("{}: {e}", ptx.display())))?;
            (ptx.clone(), ctx.load_module(Ptx::from_src(src)))
        } else {
            return Err(KernelError::Cuda(format!(
                "no compiled kernels in {} (run `cargo xtask kernels`)",
                dir.display()
            )));
        };
        let module = module.map_err(cuda_err("loading the kernels"))?;
        let stream = ctx.default_stream();
        Ok(CudaKernels {
            ctx,
            stream,
            module,
            name,
            compute_capability: cc,
            image,
        })
    }

    /// The device's name, e.g. "NVIDIA GeForce RTX 2080".
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// The device's compute capability.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// The cubin or PTX file the kernels came from.
    pub fn image(&self) -> &Path {
        &self.image
    }

    /// Peak memory bandwidth from the device's attributes (bytes/s): memory
    /// clock × bus width × 2 (double data rate).
    pub fn peak_bandwidth(&self) -> Result<f64, KernelError> {
        let clock_khz = self
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
            .map_err(cuda_err("memory clock"))?;
        let bus_bits = self
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)
            .map_err(cuda_err("bus width"))?;
        Ok(2.0 * clock_khz as f64 * 1e3 * bus_bits as f64 / 8.0)
    }

    /// Copies a store's pools to the device.
    pub fn upload(&self, store: &KvStore) -> Result<DeviceKv, KernelError> {
        let up = |b: &[u8]| -> Result<CudaSlice<u8>, KernelError> {
            if b.is_empty() {
                self.stream.alloc_zeros::<u8>(1).map_err(cuda_err("alloc"))
            } else {
                self.stream.clone_htod(b).map_err(cuda_err("upload"))
            }
        };
        Ok(DeviceKv {
            layout: *store.layout(),
            sealed: up(store.sealed_bytes())?,
            tail: up(store.tail_bytes())?,
        })
    }

    /// An empty device store (for append/seal on the device).
    pub fn alloc(
        &self,
        layout: KvLayout,
        sealed_blocks: usize,
        tail_blocks: usize,
    ) -> Result<DeviceKv, KernelError> {
        layout.check()?;
        let sealed = self
            .stream
            .alloc_zeros::<u8>((sealed_blocks * layout.block_bytes()).max(1))
            .map_err(cuda_err("alloc"))?;
        let tail = self
            .stream
            .alloc_zeros::<u8>((tail_blocks * layout.tail_block_bytes()).max(1))
            .map_err(cuda_err("alloc"))?;
        Ok(DeviceKv {
            layout,
            sealed,
            tail,
        })
    }

    /// Copies the device pools back (sealed, tail).
    pub fn download(&self, kv: &DeviceKv) -> Result<(Vec<u8>, Vec<u8>), KernelError> {
        let s = self
            .stream
            .clone_dtoh(&kv.sealed)
            .map_err(cuda_err("download"))?;
        let t = self
            .stream
            .clone_dtoh(&kv.tail)
            .map_err(cuda_err("download"))?;
        Ok((s, t))
    }

    fn codec_names(layout: &KvLayout) -> Result<(&'static str, i32, i32), KernelError> {
        let name = match (layout.k, layout.v) {
            (Codec::F16, Codec::F16) => "f16_f16",
            (Codec::Kv8 { .. }, Codec::Kv8 { .. }) => "kv8_kv8",
            (Codec::K5, Codec::V4 { .. }) => "k5_v4",
            (k, v) => {
                return Err(KernelError::Layout(format!(
                    "the CUDA kernels have no {k:?}/{v:?} variant"
                )));
            }
        };
        let group = |c: Codec| match c {
            Codec::Kv8 { group } | Codec::V4 { group } => group as i32,
            _ => 0,
        };
        Ok((name, group(layout.k), group(layout.v)))
    }

    /// Decode attention (one query token per sequence) on the device. `q` is
    /// `seqs.len() × n_heads × head_dim`; partitions of `partition_tokens`
    /// split long contexts (0 = one partition), reduced by a second kernel.
    /// Returns the output, same shape as `q`.
    pub fn decode(
        &self,
        kv: &DeviceKv,
        seqs: &[&SeqKv],
        q: &[f32],
        n_heads: usize,
        scale: f32,
        partition_tokens: usize,
    ) -> Result<Vec<f32>, KernelError> {
        let mut run = self.prepare_decode(kv, seqs, q, n_heads, scale, partition_tokens)?;
        run.launch(self, kv)?;
        self.stream
            .clone_dtoh(&run.out)
            .map_err(cuda_err("download"))
    }

    /// Uploads everything a decode call needs; [`DecodeRun::launch`] then only launches
    /// (what the benchmark times).
    pub fn prepare_decode(
        &self,
        kv: &DeviceKv,
        seqs: &[&SeqKv],
        q: &[f32],
        n_heads: usize,
        scale: f32,
        partition_tokens: usize,
    ) -> Result<DecodeRun, KernelError> {
        let l = kv.layout;
        let d = l.head_dim;
        if d != 64 && d != 128 {
            return Err(KernelError::Layout(format!(
                "the CUDA kernels are built for head dimensions 64 and 128, not {d}"
            )));
        }
        if !n_heads.is_multiple_of(l.kv_heads) || n_heads / l.kv_heads > MAX_GROUP {
            return Err(KernelError::Shape(format!(
                "{n_heads} query heads over {} KV heads (at most {MAX_GROUP} per KV head on CUDA)",
                l.kv_heads
            )));
        }
        if q.len() != seqs.len() * n_heads * d || seqs.is_empty() {
            return Err(KernelError::Shape(format!(
                "q has {} values for {} sequences",
                q.len(),
                seqs.len()
            )));
        }
        let (name, kg, vg) = Self::codec_names(&l)?;
        let max_len = seqs.iter().map(|s| s.len).max().unwrap_or(0);
        if seqs
            .iter()
            .any(|s| s.len == 0 || s.blocks() != s.len.div_ceil(l.block_tokens))
        {
            return Err(KernelError::Shape(
                "every sequence needs tokens and a matching block table".into(),
            ));
        }
        let part = if partition_tokens == 0 {
            max_len
        } else {
            partition_tokens.min(max_len)
        };
        if part > 1024 {
            return Err(KernelError::Shape(format!(
                "partitions of {part} tokens exceed the kernel's shared memory; split with partition_tokens ≤ 1024"
            )));
        }
        let p = max_len.div_ceil(part);
        // Q scaled (and rotated) on the host, as the CPU kernel does.
        let mut qh = q.to_vec();
        for row in qh.chunks_exact_mut(d) {
            for x in row.iter_mut() {
                *x *= scale;
            }
            if l.rotate_k {
                hadamard(row);
            }
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
        let st = &self.stream;
        let rows = seqs.len() * n_heads;
        let f = self
            .module
            .load_function(&format!("siliceo_attn_decode_{name}_d{d}"))
            .map_err(cuda_err("decode kernel"))?;
        let reduce = self
            .module
            .load_function("siliceo_attn_reduce")
            .map_err(cuda_err("reduce kernel"))?;
        Ok(DecodeRun {
            f,
            reduce,
            out: st.alloc_zeros::<f32>(rows * d).map_err(cuda_err("alloc"))?,
            part_m: st
                .alloc_zeros::<f32>((rows * p).max(1))
                .map_err(cuda_err("alloc"))?,
            part_l: st
                .alloc_zeros::<f32>((rows * p).max(1))
                .map_err(cuda_err("alloc"))?,
            part_acc: st
                .alloc_zeros::<f32>((rows * p * d).max(1))
                .map_err(cuda_err("alloc"))?,
            q: st.clone_htod(&qh).map_err(cuda_err("upload"))?,
            sealed_tab: st.clone_htod(&sealed_tab).map_err(cuda_err("upload"))?,
            tail_tab: st.clone_htod(&tail_tab).map_err(cuda_err("upload"))?,
            lens: st.clone_htod(&lens).map_err(cuda_err("upload"))?,
            n_sealed: st.clone_htod(&n_sealed).map_err(cuda_err("upload"))?,
            ints: [
                max_sealed as i32,
                max_tail as i32,
                n_heads as i32,
                l.kv_heads as i32,
                l.block_tokens as i32,
                kg,
                vg,
                part as i32,
                p as i32,
            ],
            seqs: seqs.len(),
            d,
        })
    }

    /// Writes `n` tokens' K and V (`n × kv_heads × head_dim` f32; K already
    /// rotated if the layout rotates) into tail block rows: token `i` goes to
    /// row `rows[i]` of tail block `blocks[i]`.
    pub fn append(
        &self,
        kv: &mut DeviceKv,
        k: &[f32],
        v: &[f32],
        blocks: &[u32],
        rows: &[i32],
    ) -> Result<(), KernelError> {
        let l = kv.layout;
        let n = blocks.len();
        if k.len() != n * l.kv_heads * l.head_dim || v.len() != k.len() || rows.len() != n {
            return Err(KernelError::Shape(
                "append: K, V, blocks and rows disagree".into(),
            ));
        }
        if blocks
            .iter()
            .any(|&b| (b as usize + 1) * l.tail_block_bytes() > kv.tail.len())
        {
            return Err(KernelError::Shape(
                "append: a tail block index is outside the pool".into(),
            ));
        }
        let st = &self.stream;
        let (dk, dv) = (
            st.clone_htod(k).map_err(cuda_err("upload"))?,
            st.clone_htod(v).map_err(cuda_err("upload"))?,
        );
        let (db, dr) = (
            st.clone_htod(blocks).map_err(cuda_err("upload"))?,
            st.clone_htod(rows).map_err(cuda_err("upload"))?,
        );
        let f = self
            .module
            .load_function("siliceo_kv_append")
            .map_err(cuda_err("append kernel"))?;
        let total = (n * l.kv_heads * l.head_dim) as u32;
        let (n, h, d, t) = (
            n as i32,
            l.kv_heads as i32,
            l.head_dim as i32,
            l.block_tokens as i32,
        );
        let mut b = st.launch_builder(&f);
        b.arg(&mut kv.tail)
            .arg(&dk)
            .arg(&dv)
            .arg(&db)
            .arg(&dr)
            .arg(&n)
            .arg(&h)
            .arg(&d)
            .arg(&t);
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel's arguments match its signature in paged_attention.cu,
        // and every index it computes is inside the buffers (n·kv_heads·head_dim
        // threads; block indices checked against the pool above).
        unsafe { b.launch(cfg) }.map_err(cuda_err("append"))?;
        st.synchronize().map_err(cuda_err("append"))
    }

    /// Quantizes tail block `src` into sealed block `dst` on the device.
    pub fn seal(&self, kv: &mut DeviceKv, src: u32, dst: u32) -> Result<(), KernelError> {
        let l = kv.layout;
        if (src as usize + 1) * l.tail_block_bytes() > kv.tail.len()
            || (dst as usize + 1) * l.block_bytes() > kv.sealed.len()
        {
            return Err(KernelError::Shape(
                "seal: block index outside the pool".into(),
            ));
        }
        let (name, kg, vg) = Self::codec_names(&l)?;
        let f = self
            .module
            .load_function(&format!("siliceo_kv_seal_{name}"))
            .map_err(cuda_err("seal kernel"))?;
        let (h, d, t) = (l.kv_heads as i32, l.head_dim as i32, l.block_tokens as i32);
        let mut b = self.stream.launch_builder(&f);
        b.arg(&mut kv.sealed)
            .arg(&kv.tail)
            .arg(&src)
            .arg(&dst)
            .arg(&h)
            .arg(&d)
            .arg(&t)
            .arg(&kg)
            .arg(&vg);
        let cfg = LaunchConfig {
            grid_dim: (l.kv_heads as u32, 2, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: (l.block_tokens * l.head_dim) as u32,
        };
        // SAFETY: arguments match the kernel's signature; blocks checked above.
        unsafe { b.launch(cfg) }.map_err(cuda_err("seal"))?;
        self.stream.synchronize().map_err(cuda_err("seal"))
    }
}

/// A decode call with its buffers on the device.
#[derive(Debug)]
pub struct DecodeRun {
    f: cudarc::driver::CudaFunction,
    reduce: cudarc::driver::CudaFunction,
    out: CudaSlice<f32>,
    part_m: CudaSlice<f32>,
    part_l: CudaSlice<f32>,
    part_acc: CudaSlice<f32>,
    q: CudaSlice<f32>,
    sealed_tab: CudaSlice<u32>,
    tail_tab: CudaSlice<u32>,
    lens: CudaSlice<i32>,
    n_sealed: CudaSlice<i32>,
    /// max_sealed, max_tail, H, KVH, T, kg, vg, part_tokens, P
    ints: [i32; 9],
    seqs: usize,
    d: usize,
}

impl DecodeRun {
    /// Launches the decode kernel (and the reduction) and waits for them.
    pub fn launch(&mut self, k: &CudaKernels, kv: &DeviceKv) -> Result<(), KernelError> {
        let [max_sealed, max_tail, h, kvh, t, kg, vg, part, p] = self.ints;
        let d = self.d;
        let smem = ((MAX_GROUP * d + MAX_GROUP * part as usize + WARPS * MAX_GROUP * d) * 4) as u32;
        let st = &k.stream;
        let mut b = st.launch_builder(&self.f);
        b.arg(&mut self.out)
            .arg(&mut self.part_m)
            .arg(&mut self.part_l)
            .arg(&mut self.part_acc)
            .arg(&self.q)
            .arg(&kv.sealed)
            .arg(&kv.tail)
            .arg(&self.sealed_tab)
            .arg(&self.tail_tab)
            .arg(&self.lens)
            .arg(&self.n_sealed);
        for x in [&max_sealed, &max_tail, &h, &kvh, &t, &kg, &vg, &part, &p] {
            b.arg(x);
        }
        if smem > 48 * 1024 {
            self.f
                .set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .map_err(cuda_err("shared memory"))?;
        }
        let cfg = LaunchConfig {
            grid_dim: (kvh as u32, self.seqs as u32, p as u32),
            block_dim: ((WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: the arguments match `siliceo_attn_decode_*` in
        // paged_attention.cu; tables, lengths and pools were built from the
        // same store and layout, so every block index is inside the pools.
        unsafe { b.launch(cfg) }.map_err(cuda_err("decode"))?;
        if p > 1 {
            let mut r = st.launch_builder(&self.reduce);
            let di = d as i32;
            r.arg(&mut self.out)
                .arg(&self.part_m)
                .arg(&self.part_l)
                .arg(&self.part_acc)
                .arg(&h)
                .arg(&di)
                .arg(&p);
            let cfg = LaunchConfig {
                grid_dim: (h as u32, self.seqs as u32, 1),
                block_dim: (d as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: arguments match `siliceo_attn_reduce`; buffers sized rows × P (× D).
            unsafe { r.launch(cfg) }.map_err(cuda_err("reduce"))?;
        }
        st.synchronize().map_err(cuda_err("decode"))
    }
}

/// The GPU side of the kernel benchmark (`cargo xtask bench kernels --gpu`).
pub mod bench {
    use std::time::Instant;

    use super::*;

    /// Times the CUDA decode kernel per format and context, checks it against the
    /// CPU kernel, and prints achieved bandwidth against the device's peak.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        ctxs: &[usize],
        formats: &[String],
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        reps: usize,
        partition_tokens: usize,
        batch: usize,
    ) -> Result<(), KernelError> {
        let k = CudaKernels::new(0)?;
        let peak = k.peak_bandwidth()?;
        println!(
            "device: {} (sm_{}{}), kernels from {}; peak memory bandwidth {:.0} GB/s (attributes)",
            k.device_name(),
            k.compute_capability.0,
            k.compute_capability.1,
            k.image().display(),
            peak / 1e9
        );
        println!(
            "| format | context | sequences | partition | kernel ms | KV read GB/s | % of peak | max |GPU − CPU| |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        for fmt in formats {
            let layout = KvLayout::preset(fmt, kv_heads, head_dim)?;
            for &ctx in ctxs {
                let mut store = KvStore::new(
                    layout,
                    batch * ctx.div_ceil(layout.block_tokens),
                    batch * KvStore::tail_blocks_per_seq(&layout),
                )?;
                let row = kv_heads * head_dim;
                let mut seqs = vec![SeqKv::default(); batch];
                for (si, s) in seqs.iter_mut().enumerate() {
                    let mut at = 0;
                    while at < ctx {
                        let n = (ctx - at).min(4096);
                        let kv: Vec<f32> = (0..n * row)
                            .map(|i| {
                                (((i + at * row + si * 7) * 2_654_435_761) % 2001) as f32 / 1000.0
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
                let mut run = k.prepare_decode(&dev, &refs, &q, heads, scale, partition_tokens)?;
                run.launch(&k, &dev)?;
                let got = k
                    .stream
                    .clone_dtoh(&run.out)
                    .map_err(cuda_err("download"))?;
                let queries: Vec<crate::SeqQuery<'_>> = seqs
                    .iter()
                    .enumerate()
                    .map(|(i, s)| crate::SeqQuery {
                        kv: s,
                        q: &q[i * heads * head_dim..(i + 1) * heads * head_dim],
                        n_q: 1,
                    })
                    .collect();
                let mut want = vec![0f32; q.len()];
                crate::paged_attention(
                    &store,
                    heads,
                    scale,
                    &queries,
                    &mut want,
                    &crate::AttnParams::default(),
                )?;
                let diff = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                let mut times = Vec::new();
                for _ in 0..reps.max(1) {
                    let t0 = Instant::now();
                    run.launch(&k, &dev)?;
                    times.push(t0.elapsed().as_secs_f64());
                }
                times.sort_by(f64::total_cmp);
                let dt = times[times.len() / 2];
                let bytes: usize = seqs
                    .iter()
                    .map(|s| {
                        s.sealed.len() * layout.block_bytes()
                            + s.tail.len() * layout.tail_block_bytes()
                    })
                    .sum();
                let rate = bytes as f64 / dt;
                println!(
                    "| {fmt} | {ctx} | {batch} | {partition_tokens} | {:.3} | {:.0} | {:.0}% | {diff:.2e} |",
                    dt * 1e3,
                    rate / 1e9,
                    100.0 * rate / peak
                );
                for s in seqs.iter_mut() {
                    store.release(s);
                }
            }
        }
        Ok(())
    }
}
