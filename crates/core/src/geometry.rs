use serde::{Deserialize, Serialize};

use crate::KvType;

/// The shape of a transformer as far as serving cares: what sizes the KV cache
/// and the logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelGeometry {
    /// Transformer layers (each holds K and V for every token).
    pub n_layer: u32,
    /// Attention (query) heads.
    pub n_head: u32,
    /// Key/value heads (fewer than `n_head` under grouped-query attention).
    pub n_head_kv: u32,
    /// Dimension of one key head.
    pub head_dim_k: u32,
    /// Dimension of one value head.
    pub head_dim_v: u32,
    /// Hidden size.
    pub n_embd: u32,
    /// Vocabulary size (length of a logits row).
    pub n_vocab: u32,
    /// Context length the model was trained with.
    pub n_ctx_train: u32,
}

impl ModelGeometry {
    /// Elements of K stored per token, summed over layers.
    pub fn k_elems_per_token(&self) -> u64 {
        u64::from(self.n_layer) * u64::from(self.n_head_kv) * u64::from(self.head_dim_k)
    }

    /// Elements of V stored per token, summed over layers.
    pub fn v_elems_per_token(&self) -> u64 {
        u64::from(self.n_layer) * u64::from(self.n_head_kv) * u64::from(self.head_dim_v)
    }

    /// Bytes of K per token in format `t`, or `None` if a layer's row is not
    /// a whole number of quantization blocks.
    pub fn k_bytes_per_token(&self, t: KvType) -> Option<u64> {
        let row = u64::from(self.n_head_kv) * u64::from(self.head_dim_k);
        t.row_bytes(row).map(|b| b * u64::from(self.n_layer))
    }

    /// Bytes of V per token in format `t` (see [`Self::k_bytes_per_token`]).
    pub fn v_bytes_per_token(&self, t: KvType) -> Option<u64> {
        let row = u64::from(self.n_head_kv) * u64::from(self.head_dim_v);
        t.row_bytes(row).map(|b| b * u64::from(self.n_layer))
    }

    /// Bytes of K plus V per token. Panics only if a format does not divide the
    /// row; use the per-half methods to handle that case.
    pub fn kv_bytes_per_token(&self, k: KvType, v: KvType) -> u64 {
        self.k_bytes_per_token(k)
            .expect("K row not a whole number of blocks")
            + self
                .v_bytes_per_token(v)
                .expect("V row not a whole number of blocks")
    }

    /// Query heads that share one KV head.
    pub fn gqa_group(&self) -> u32 {
        self.n_head / self.n_head_kv.max(1)
    }
}

/// The repeating layers llama.cpp puts on the GPU for `--gpu-layers`
/// `gpu_layers` out of `n_layer`: the count takes the output layer first (1
/// offloads only the output, `n_layer + 1` or more every layer), then the
/// last repeating layers (`llama_model::load_tensors`: layers from
/// `n_layer + 1 − gpu_layers` on).
pub fn offloaded_layers(n_layer: usize, gpu_layers: usize) -> std::ops::Range<usize> {
    (n_layer + 1).saturating_sub(gpu_layers).min(n_layer)..n_layer
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama3_8b() -> ModelGeometry {
        ModelGeometry {
            n_layer: 32,
            n_head: 32,
            n_head_kv: 8,
            head_dim_k: 128,
            head_dim_v: 128,
            n_embd: 4096,
            n_vocab: 128_256,
            n_ctx_train: 8192,
        }
    }

    #[test]
    fn llama3_8b_kv_bytes() {
        let g = llama3_8b();
        // 32 layers × 8 heads × 128 dims × 2 bytes × (K + V) = 131072 bytes.
        assert_eq!(g.kv_bytes_per_token(KvType::F16, KvType::F16), 131_072);
        // q8_0: 1024 elems per layer row → 32 blocks × 34 bytes = 1088.
        assert_eq!(g.k_bytes_per_token(KvType::Q8_0), Some(32 * 1088));
        assert_eq!(g.gqa_group(), 4);
    }
}
