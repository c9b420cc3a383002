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

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::KernelError;
use crate::device::{Arg, Backend, Launch};
pub use crate::device::{DecodeRun, DeviceKv, Kernels, MAX_GROUP};

fn cuda_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> KernelError + '_ {
    move |e| KernelError::Cuda(format!("{what}: {e:?}"))
}

/// Where `cargo xtask kernels` leaves the compiled kernels:
/// `SILICEO_KERNELS_DIR`, else the checkout cargo runs us from (it sets
/// `CARGO_MANIFEST_DIR` for tests and `cargo run` of a package under
/// `crates/`), else the one we were built in.
pub fn default_kernels_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SILICEO_KERNELS_DIR") {
        return PathBuf::from(dir);
    }
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(|m| Path::new(&m).join("../../kernels/build"))
        .filter(|d| d.is_dir())
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels/build"))
}

/// The kernels on a CUDA device.
pub type CudaKernels = Kernels<Cuda>;

/// A CUDA device with the kernels' module loaded: the [`Backend`] of [`CudaKernels`].
#[derive(Debug)]
pub struct Cuda {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    /// Functions looked up so far, with the dynamic shared memory they were
    /// allowed (above the default 48 KiB only on request).
    functions: Mutex<HashMap<String, (CudaFunction, u32)>>,
    name: String,
    compute_capability: (i32, i32),
    image: PathBuf,
}

/// Dynamic shared memory every kernel may use without opting in.
const DEFAULT_SHARED_BYTES: u32 = 48 * 1024;

impl Backend for Cuda {
    type Buf = CudaSlice<u8>;

    fn upload(&self, bytes: &[u8]) -> Result<CudaSlice<u8>, KernelError> {
        if bytes.is_empty() {
            return self.zeros(1);
        }
        self.stream.clone_htod(bytes).map_err(cuda_err("upload"))
    }

    fn zeros(&self, bytes: usize) -> Result<CudaSlice<u8>, KernelError> {
        self.stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(cuda_err("alloc"))
    }

    fn download(&self, buf: &CudaSlice<u8>) -> Result<Vec<u8>, KernelError> {
        self.stream.clone_dtoh(buf).map_err(cuda_err("download"))
    }

    fn buf_len(buf: &CudaSlice<u8>) -> usize {
        buf.len()
    }

    fn addr(&self, buf: &CudaSlice<u8>) -> u64 {
        let (ptr, _sync) = buf.device_ptr(&self.stream);
        ptr
    }

    fn read_at(
        &self,
        buf: &CudaSlice<u8>,
        offset: usize,
        len: usize,
    ) -> Result<Vec<u8>, KernelError> {
        if offset + len > buf.len() {
            return Err(KernelError::Shape("read past a buffer's end".into()));
        }
        self.stream
            .clone_dtoh(&buf.slice(offset..offset + len))
            .map_err(cuda_err("download"))
    }

    fn write_at(
        &self,
        buf: &mut CudaSlice<u8>,
        offset: usize,
        bytes: &[u8],
    ) -> Result<(), KernelError> {
        if offset + bytes.len() > buf.len() {
            return Err(KernelError::Shape("write past a buffer's end".into()));
        }
        let mut dst = buf.slice_mut(offset..offset + bytes.len());
        self.stream
            .memcpy_htod(bytes, &mut dst)
            .map_err(cuda_err("upload"))?;
        self.stream.synchronize().map_err(cuda_err("synchronize"))
    }

    unsafe fn launch(
        &self,
        kernel: &str,
        launch: Launch,
        args: &[Arg<'_, CudaSlice<u8>>],
    ) -> Result<(), KernelError> {
        let f = {
            let mut functions = self.functions.lock().unwrap_or_else(|p| p.into_inner());
            if !functions.contains_key(kernel) {
                let f = self
                    .module
                    .load_function(kernel)
                    .map_err(cuda_err("looking up a kernel"))?;
                functions.insert(kernel.to_string(), (f, DEFAULT_SHARED_BYTES));
            }
            let (f, allowed) = functions.get_mut(kernel).expect("inserted above");
            if launch.shared_bytes > *allowed {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    launch.shared_bytes as i32,
                )
                .map_err(cuda_err("shared memory"))?;
                *allowed = launch.shared_bytes;
            }
            f.clone()
        };
        let mut b = self.stream.launch_builder(&f);
        for a in args {
            match a {
                Arg::Buf(x) => b.arg(*x),
                Arg::I32(x) => b.arg(x),
                Arg::U32(x) => b.arg(x),
                Arg::F32(x) => b.arg(x),
                // A raw device address, passed as the pointer parameter's
                // 8 bytes.
                Arg::Ptr(p) => b.arg(p),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: launch.grid,
            block_dim: (launch.block, 1, 1),
            shared_mem_bytes: launch.shared_bytes,
        };
        // SAFETY: the caller guarantees the arguments match the kernel and
        // stay inside the buffers (this function's contract).
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(cuda_err(kernel))
    }

    fn synchronize(&self) -> Result<(), KernelError> {
        self.stream.synchronize().map_err(cuda_err("synchronize"))
    }
}

impl Kernels<Cuda> {
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
        std::panic::catch_unwind(|| Cuda::open(ordinal, dir))
            .unwrap_or_else(|_| {
                Err(KernelError::Cuda(
                    "the CUDA driver library is unusable (cudarc panicked)".into(),
                ))
            })
            .map(Kernels::from_backend)
    }

    /// The device's name, e.g. "NVIDIA GeForce RTX 2080".
    pub fn device_name(&self) -> &str {
        &self.backend().name
    }

    /// The device's compute capability.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.backend().compute_capability
    }

    /// The cubin or PTX file the kernels came from.
    pub fn image(&self) -> &Path {
        &self.backend().image
    }

    /// Peak memory bandwidth from the device's attributes (bytes/s): memory
    /// clock × bus width × 2 (double data rate).
    pub fn peak_bandwidth(&self) -> Result<f64, KernelError> {
        let ctx = &self.backend().ctx;
        let clock_khz = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
            .map_err(cuda_err("memory clock"))?;
        let bus_bits = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)
            .map_err(cuda_err("bus width"))?;
        Ok(2.0 * clock_khz as f64 * 1e3 * bus_bits as f64 / 8.0)
    }

    /// Measured device memory bandwidth (bytes/s): the median of 9 timed runs,
    /// each of 10 device-to-device copies of `bytes` (a copy reads and writes
    /// each byte, so 2 × `bytes` move per copy). A reference the attributes'
    /// peak cannot give: what this device reaches in practice.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64, KernelError> {
        let b = self.backend();
        let src = b.zeros(bytes)?;
        let mut dst = b.zeros(bytes)?;
        let mut rates = Vec::new();
        for rep in 0..10 {
            let t0 = std::time::Instant::now();
            for _ in 0..10 {
                b.stream
                    .memcpy_dtod(&src, &mut dst)
                    .map_err(cuda_err("copy"))?;
            }
            b.synchronize()?;
            // The first run warms up and is not counted.
            if rep > 0 {
                rates.push(20.0 * bytes as f64 / t0.elapsed().as_secs_f64());
            }
        }
        rates.sort_by(f64::total_cmp);
        Ok(rates[rates.len() / 2])
    }
}

impl Cuda {
    fn open(ordinal: usize, dir: &Path) -> Result<Cuda, KernelError> {
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
        Ok(Cuda {
            ctx,
            stream,
            module,
            functions: Mutex::new(HashMap::new()),
            name,
            compute_capability: cc,
            image,
        })
    }
}

/// The GPU side of the kernel benchmark (`cargo xtask bench kernels --gpu`).
pub mod bench {
    use super::*;
    use crate::device::{BenchShape, bench_decode};

    /// Times the CUDA decode kernel per format, context and partition size,
    /// checks it against the CPU kernel, and prints achieved bandwidth against
    /// the device's peak and a measured copy, a row as each is done.
    pub fn run(shape: &BenchShape<'_>) -> Result<(), KernelError> {
        let k = CudaKernels::new(0)?;
        let peak = k.peak_bandwidth()?;
        let copy = k.copy_bandwidth(256 << 20)?;
        println!(
            "device: {} (sm_{}{}), kernels from {}; peak memory bandwidth {:.0} GB/s (attributes), \
             device-to-device copy {:.0} GB/s (measured, 256 MiB)",
            k.device_name(),
            k.compute_capability().0,
            k.compute_capability().1,
            k.image().display(),
            peak / 1e9,
            copy / 1e9
        );
        if peak.is_nan() || peak <= 0.0 {
            println!("(the attributes give no peak: % of peak is left blank)");
        }
        println!(
            "| format | context | sequences | block | partition | loads | kernel ms | KV read GB/s | % of peak | % of copy | max |GPU − CPU| |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|---|");
        bench_decode(&k, shape, |r| {
            let rate = r.kv_bytes as f64 / r.seconds;
            let of_peak = if peak > 0.0 {
                format!("{:.0}%", 100.0 * rate / peak)
            } else {
                String::new()
            };
            println!(
                "| {} | {} | {} | {} | {} | {} | {:.3} | {:.0} | {of_peak} | {:.0}% | {:.2e} |",
                r.format,
                r.ctx,
                r.batch,
                r.block_tokens,
                r.partition_tokens,
                if r.loads == 0 {
                    "default".to_string()
                } else {
                    r.loads.to_string()
                },
                r.seconds * 1e3,
                rate / 1e9,
                100.0 * rate / copy,
                r.max_diff
            );
        })
    }

    /// Times a prefill chunk's attention on the decode kernel (a token at a
    /// time) and on the prefill kernel, per format and context, and prints
    /// both and their ratio, a row as each is done.
    pub fn run_prefill(shape: &BenchShape<'_>, chunk: usize) -> Result<(), KernelError> {
        let k = CudaKernels::new(0)?;
        println!(
            "device: {}; one layer's attention for a chunk of {chunk} tokens after the context, \
             {} query heads over {} KV heads of {}",
            k.device_name(),
            shape.heads,
            shape.kv_heads,
            shape.head_dim
        );
        println!(
            "| format | context | chunk | decode kernel ms | prefill kernel ms | prefill speed-up | prefill partition × count | max |prefill − decode| |"
        );
        println!("|---|---|---|---|---|---|---|---|");
        crate::graft::bench_prefill(&k, shape, chunk, |r| {
            println!(
                "| {} | {} | {} | {:.3} | {:.3} | {:.2}× | {} × {} | {:.2e} |",
                r.format,
                r.ctx,
                r.chunk,
                r.decode_seconds * 1e3,
                r.prefill_seconds * 1e3,
                r.decode_seconds / r.prefill_seconds,
                r.partition.0,
                r.partition.1,
                r.max_diff
            );
        })
    }
}
