//! The process-wide llama.cpp backend and log routing.

use std::sync::OnceLock;

use llama_cpp_2::llama_backend::LlamaBackend;

use crate::EngineError;

static BACKEND: OnceLock<Result<LlamaBackend, String>> = OnceLock::new();

/// The llama.cpp backend, initialised on first use. llama.cpp's own log is
/// routed to `tracing` (targets under `llama_cpp_2`) before anything else runs,
/// so nothing is written to raw stderr.
pub fn backend() -> Result<&'static LlamaBackend, EngineError> {
    BACKEND
        .get_or_init(|| {
            llama_cpp_2::send_logs_to_tracing(llama_cpp_2::LogOptions::default());
            LlamaBackend::init().map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| EngineError::Backend(e.clone()))
}

/// Whether llama.cpp was built with a GPU backend able to offload layers.
pub fn supports_gpu_offload() -> bool {
    backend().map(|b| b.supports_gpu_offload()).unwrap_or(false)
}

/// Free and total bytes of the first GPU llama.cpp can offload to (as its
/// backend reports them), or `None` where it has none (a CPU build, or no
/// device).
pub fn gpu_memory() -> Option<(u64, u64)> {
    backend().ok()?;
    // SAFETY: plain queries of ggml's device registry, after the backend is
    // initialised; the out-pointers are locals.
    unsafe {
        use llama_cpp_sys_2 as sys;
        for i in 0..sys::ggml_backend_dev_count() {
            let dev = sys::ggml_backend_dev_get(i);
            if sys::ggml_backend_dev_type(dev) == sys::GGML_BACKEND_DEVICE_TYPE_GPU {
                let (mut free, mut total) = (0usize, 0usize);
                sys::ggml_backend_dev_memory(dev, &mut free, &mut total);
                return Some((free as u64, total as u64));
            }
        }
    }
    None
}

/// Initialises llama.cpp now (it is otherwise done on first use), so a
/// failure shows at start-up.
pub fn backend_init() -> Result<(), EngineError> {
    backend().map(|_| ())
}
