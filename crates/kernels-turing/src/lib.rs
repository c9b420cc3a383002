//! Paged-attention kernels over siliceo KV formats: CPU reference and CUDA (Turing sm_75).
