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

/// Initialises llama.cpp now (it is otherwise done on first use), so a
/// failure shows at start-up.
pub fn backend_init() -> Result<(), EngineError> {
    backend().map(|_| ())
}
