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

    /// Each layer's KV where the layers are alike: `n_head_kv` heads of
    /// `head_dim_k`, each layer its own ([`layer_kv`] reads a model whose
    /// layers differ).
    pub fn alike_layers(&self) -> Vec<LayerKv> {
        (0..self.n_layer as usize)
            .map(|il| LayerKv {
                head_dim: self.head_dim_k as usize,
                kv_heads: self.n_head_kv as usize,
                source: il,
            })
            .collect()
    }

    /// Query heads that share one KV head.
    pub fn gqa_group(&self) -> u32 {
        self.n_head / self.n_head_kv.max(1)
    }
}

/// One layer's KV as llama.cpp keeps it ([`layer_kv`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerKv {
    /// Its K and V heads' size.
    pub head_dim: usize,
    /// Its KV heads (a model may list them per layer).
    pub kv_heads: usize,
    /// The layer whose KV it attends over (itself, unless it keeps none).
    pub source: usize,
}

/// Each layer's KV as llama.cpp reads a model's metadata: `windowed` flags
/// each layer with a sliding window; its heads' size is `head_dim.1` if
/// windowed (Gemma 4's `attention.key_length_swa`), else `head_dim.0`; its
/// KV heads `kv_heads(layer)` (`attention.head_count_kv` may list them per
/// layer); and the last `shared` layers (`attention.shared_kv_layers`)
/// keep no KV but attend over the last windowed or global layer with KV of
/// its own: layer `n − shared − 2` if windowed, else `n − shared − 1`
/// (llama.cpp's `reuse` callback in `llama-model.cpp`), and take its shape.
pub fn layer_kv(
    windowed: &[bool],
    head_dim: (usize, usize),
    kv_heads: impl Fn(usize) -> usize,
    shared: usize,
) -> Vec<LayerKv> {
    let own = windowed.len() - shared.min(windowed.len());
    let mut layers: Vec<LayerKv> = windowed
        .iter()
        .enumerate()
        .map(|(il, &w)| LayerKv {
            head_dim: if w { head_dim.1 } else { head_dim.0 },
            kv_heads: kv_heads(il),
            source: if il < own {
                il
            } else {
                own.saturating_sub(if w { 2 } else { 1 })
            },
        })
        .collect();
    // A layer keeping no KV attends over its source's: its shape, whatever
    // the file lists for it.
    for il in own..layers.len() {
        let src = layers[layers[il].source];
        layers[il].head_dim = src.head_dim;
        layers[il].kv_heads = src.kv_heads;
    }
    layers
}

/// llama.cpp's `set_swa_pattern(period)`: every layer windowed but the last
/// of each period (a period of 0 windows them all).
pub fn windowed_by_period(layers: usize, period: usize) -> Vec<bool> {
    (0..layers)
        .map(|il| period == 0 || il % period < period - 1)
        .collect()
}

/// The last layers of a model of architecture `arch` that keep no KV but
/// read earlier layers' ([`layer_kv`]'s `shared`), as llama.cpp counts them:
/// Gemma 3n's file does not say (llama.cpp keeps KV in its first 20 layers,
/// `n_layer_kv_from_start`); Gemma 4's says, in
/// `attention.shared_kv_layers` (`listed`).
pub fn shared_kv_layers(arch: &str, n_layer: usize, listed: Option<usize>) -> usize {
    match arch {
        "gemma3n" => n_layer.saturating_sub(20),
        _ => listed.unwrap_or(0).min(n_layer),
    }
}

/// Whether `layers` ([`layer_kv`]) are alike: one shape, each with KV of its
/// own (what the device store and the planner's one-layer arithmetic take).
pub fn layers_alike(layers: &[LayerKv]) -> bool {
    layers.iter().enumerate().all(|(il, l)| {
        l.source == il && (l.kv_heads, l.head_dim) == (layers[0].kv_heads, layers[0].head_dim)
    })
}

/// Elements of K (or V: the heads are one size) per token over the layers
/// that keep KV of their own.
pub fn kv_elems_per_token(layers: &[LayerKv]) -> u64 {
    layers
        .iter()
        .enumerate()
        .filter(|&(il, l)| l.source == il)
        .map(|(_, l)| (l.kv_heads * l.head_dim) as u64)
        .sum()
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

    /// A layout of Gemma 4's kind (35 layers, a global layer every fifth,
    /// the last 20 reading others' KV; heads of 256 windowed, 512 global, one
    /// KV head): the sharing layers read layer 13 (windowed) or 14 (global).
    #[test]
    fn shared_layers_read_the_last_own_layer_of_their_kind() {
        let windowed: Vec<bool> = (0..35).map(|il| il % 5 != 4).collect();
        let layers = layer_kv(&windowed, (512, 256), |_| 1, 20);
        assert_eq!(layers.len(), 35);
        for (il, l) in layers.iter().enumerate() {
            let want = match il {
                0..15 => il,
                _ if windowed[il] => 13,
                _ => 14,
            };
            assert_eq!(l.source, want, "layer {il}");
            assert_eq!(l.head_dim, if windowed[il] { 256 } else { 512 });
        }
        assert!(!layers_alike(&layers));
        // 12 windowed layers of 256 and 3 global of 512 keep KV.
        assert_eq!(kv_elems_per_token(&layers), 12 * 256 + 3 * 512);
        let plain = layer_kv(&[false, true, false], (64, 64), |_| 2, 0);
        assert!(layers_alike(&plain));
        assert_eq!(kv_elems_per_token(&plain), 3 * 128);
        // KV heads listed per layer make layers unlike.
        assert!(!layers_alike(&layer_kv(
            &[false; 3],
            (64, 64),
            |il| il + 1,
            0
        )));
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
