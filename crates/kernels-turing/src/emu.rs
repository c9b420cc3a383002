//! The CUDA kernels of `kernels/paged_attention.cu` run on the CPU (feature
//! `cuda-emu`): the `.cu` source itself, compiled as C++ against a small
//! emulation of the CUDA features it uses (`kernels/emu`). A CTA's threads are
//! fibers switched at `__syncthreads` and warp shuffles and resumed in an
//! order shuffled at every pass (a missing barrier changes results), shared
//! memory starts as garbage (NaN or 3.4e38), CTAs run one after another,
//! device buffers end at a guard page (a kernel that runs past a buffer's end
//! faults), and a launch whose arguments do not match the
//! kernel's parameters, that asks for more than sm_75's 64 KiB of dynamic
//! shared memory, or whose threads deadlock is an error.
//!
//! What this checks: the kernels' indexing, bit layouts, reductions and
//! partition merging, and the host code of [`crate::device`] (the same code
//! drives the GPU). [`Emulator::trace`] also counts what the kernels' K/V
//! loads would cost a GPU — warp-wide loads and the 32-byte sectors each
//! touches — so coalescing is checked too. What it cannot: speed, occupancy,
//! register pressure, or races the GPU's memory model would expose. It is
//! slow (a few microseconds per thread switch): for tests, not for serving.
//!
//! ```
//! use siliceo_kernels_turing::emu::EmuKernels;
//! use siliceo_kernels_turing::{KvLayout, KvStore, SeqKv};
//! let k = EmuKernels::emulated();
//! let layout = KvLayout::preset("k5v4", 2, 64).unwrap();
//! let mut store = KvStore::new(layout, 4, 2).unwrap();
//! let mut seq = SeqKv::default();
//! let kv: Vec<f32> = (0..80 * 2 * 64).map(|i| ((i % 13) as f32 - 6.0) / 6.0).collect();
//! store.append(&mut seq, &kv, &kv).unwrap();
//! let dev = k.upload(&store).unwrap();
//! let q = vec![0.1f32; 4 * 64];
//! let out = k.decode(&dev, &[&seq], &q, 4, 0.125, 0).unwrap();
//! assert_eq!(out.len(), q.len());
//! ```

use std::ffi::{CString, c_char, c_void};
use std::ptr::NonNull;

use crate::KernelError;
use crate::device::{Arg, Backend, Kernels, Launch};

unsafe extern "C" {
    fn siliceo_emu_alloc(bytes: usize) -> *mut c_void;
    fn siliceo_emu_free(p: *mut c_void, bytes: usize);
    fn siliceo_emu_trace(on: i32);
    fn siliceo_emu_trace_stats(out: *mut u64);
    fn siliceo_emu_launch(
        name: *const c_char,
        gx: u32,
        gy: u32,
        gz: u32,
        bx: u32,
        shared_bytes: usize,
        args: *mut *mut c_void,
        kinds: *const c_char,
        err: *mut c_char,
        err_len: usize,
    ) -> i32;
}

/// The kernels run by the CPU emulator.
pub type EmuKernels = Kernels<Emulator>;

impl Kernels<Emulator> {
    /// The kernels on the CPU emulator.
    pub fn emulated() -> EmuKernels {
        Kernels::from_backend(Emulator { _private: () })
    }
}

/// The CPU emulator: the [`Backend`] of [`EmuKernels`]. Launches run at once,
/// on the calling thread.
#[derive(Debug)]
pub struct Emulator {
    _private: (),
}

/// What the K/V loads of traced launches cost, counted the way a GPU issues
/// them: the lanes of a warp load together (a thread's k-th K/V load since
/// its last `__syncthreads` is one warp-wide load), and a warp-wide load
/// costs every 32-byte sector its lanes' bytes touch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadTrace {
    /// Warp-wide loads issued.
    pub warp_loads: u64,
    /// Distinct bytes they asked for, summed over the loads (bytes several
    /// lanes of one load share count once).
    pub bytes: u64,
    /// Sectors touched, summed over the loads.
    pub sectors: u64,
    /// Sectors touched at all (what DRAM must deliver at least once).
    pub distinct_sectors: u64,
}

impl LoadTrace {
    /// Bytes asked for per byte of the sectors touched, load by load: 1 when
    /// every load is fully coalesced; 1/8 when each lane's 4 bytes sit in a
    /// sector of their own.
    pub fn efficiency(&self) -> f64 {
        self.bytes as f64 / (self.sectors.max(1) * 32) as f64
    }

    /// Bytes a warp-wide load asks for, on average (512 for 32 lanes × 16 bytes).
    pub fn bytes_per_load(&self) -> f64 {
        self.bytes as f64 / self.warp_loads.max(1) as f64
    }
}

impl Emulator {
    /// Runs `f` with the K/V loads of its launches on this thread traced
    /// (launches run on the calling thread); returns what they cost.
    pub fn trace<R>(&self, f: impl FnOnce() -> R) -> (R, LoadTrace) {
        struct Off;
        impl Drop for Off {
            fn drop(&mut self) {
                // SAFETY: resets this thread's trace state; no pointers.
                unsafe { siliceo_emu_trace(0) }
            }
        }
        // SAFETY: as above.
        unsafe { siliceo_emu_trace(1) };
        let off = Off;
        let r = f();
        let mut s = [0u64; 4];
        // SAFETY: writes four u64 into `s`.
        unsafe { siliceo_emu_trace_stats(s.as_mut_ptr()) };
        drop(off);
        let [warp_loads, bytes, sectors, distinct_sectors] = s;
        (
            r,
            LoadTrace {
                warp_loads,
                bytes,
                sectors,
                distinct_sectors,
            },
        )
    }
}

/// A buffer of the emulator: host memory that ends at a guard page.
#[derive(Debug)]
pub struct EmuBuf {
    ptr: NonNull<u8>,
    len: usize,
}

impl Drop for EmuBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by siliceo_emu_alloc with this length, freed once.
        unsafe { siliceo_emu_free(self.ptr.as_ptr().cast(), self.len) }
    }
}

impl EmuBuf {
    fn new(len: usize) -> Result<EmuBuf, KernelError> {
        let len = len.max(1);
        // SAFETY: plain allocation; null is checked.
        let p = unsafe { siliceo_emu_alloc(len) };
        NonNull::new(p.cast::<u8>())
            .map(|ptr| EmuBuf { ptr, len })
            .ok_or_else(|| KernelError::Cuda(format!("emulator: cannot allocate {len} bytes")))
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes allocated (zero-filled by mmap) and owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and borrowed mutably through self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Backend for Emulator {
    type Buf = EmuBuf;

    fn upload(&self, bytes: &[u8]) -> Result<EmuBuf, KernelError> {
        let mut b = EmuBuf::new(bytes.len())?;
        b.bytes_mut()[..bytes.len()].copy_from_slice(bytes);
        Ok(b)
    }

    fn zeros(&self, bytes: usize) -> Result<EmuBuf, KernelError> {
        EmuBuf::new(bytes)
    }

    fn download(&self, buf: &EmuBuf) -> Result<Vec<u8>, KernelError> {
        Ok(buf.bytes().to_vec())
    }

    fn buf_len(buf: &EmuBuf) -> usize {
        buf.len
    }

    fn addr(&self, buf: &EmuBuf) -> u64 {
        buf.ptr.as_ptr() as u64
    }

    fn read_at(&self, buf: &EmuBuf, offset: usize, len: usize) -> Result<Vec<u8>, KernelError> {
        buf.bytes()
            .get(offset..offset + len)
            .map(<[u8]>::to_vec)
            .ok_or_else(|| KernelError::Shape("read past a buffer's end".into()))
    }

    fn write_at(&self, buf: &mut EmuBuf, offset: usize, bytes: &[u8]) -> Result<(), KernelError> {
        buf.bytes_mut()
            .get_mut(offset..offset + bytes.len())
            .ok_or_else(|| KernelError::Shape("write past a buffer's end".into()))?
            .copy_from_slice(bytes);
        Ok(())
    }

    unsafe fn launch(
        &self,
        kernel: &str,
        launch: Launch,
        args: &[Arg<'_, EmuBuf>],
    ) -> Result<(), KernelError> {
        // Values the argument pointers point at: a device pointer or a
        // 32-bit integer each, as cuLaunchKernel takes them.
        let mut values: Vec<u64> = args
            .iter()
            .map(|a| match a {
                Arg::Buf(b) => b.ptr.as_ptr() as u64,
                Arg::I32(x) => u64::from(*x as u32),
                Arg::U32(x) => u64::from(*x),
                Arg::F32(x) => u64::from(x.to_bits()),
                Arg::Ptr(p) => *p,
            })
            .collect();
        let mut ptrs: Vec<*mut c_void> =
            values.iter_mut().map(|v| (v as *mut u64).cast()).collect();
        let kinds: String = args.iter().map(Arg::kind).collect();
        let (name, kinds) = (
            CString::new(kernel).map_err(|_| KernelError::Cuda("kernel name with NUL".into()))?,
            CString::new(kinds).expect("kinds are ASCII letters"),
        );
        let mut err = vec![0u8; 512];
        // SAFETY: every pointer points into `values`, alive for the call; the
        // emulator checks the kinds against the kernel's parameters (a 32-bit
        // integer is read from the low half of its u64, this is a
        // little-endian host); the caller guarantees the kernel's addresses
        // stay inside the buffers.
        let rc = unsafe {
            siliceo_emu_launch(
                name.as_ptr(),
                launch.grid.0,
                launch.grid.1,
                launch.grid.2,
                launch.block,
                launch.shared_bytes as usize,
                ptrs.as_mut_ptr(),
                kinds.as_ptr(),
                err.as_mut_ptr().cast(),
                err.len(),
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let end = err.iter().position(|&b| b == 0).unwrap_or(err.len());
        Err(KernelError::Cuda(format!(
            "emulator: {}",
            String::from_utf8_lossy(&err[..end])
        )))
    }

    fn synchronize(&self) -> Result<(), KernelError> {
        Ok(())
    }
}
