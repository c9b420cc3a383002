//! What the CUDA kernels take (head sizes, query heads per KV head,
//! codecs), known in every build: which layers a GPU serves is decided
//! where no kernel is compiled too (`siliceo plan`, the start-up checks).

use crate::KernelError;
use crate::codec::Codec;
use crate::store::KvLayout;

/// Query heads per KV head the kernels handle at most (the largest `GT`).
pub const MAX_GROUP: usize = 8;

/// What the attention kernels take: head dimensions 64, 128 and 256, up
/// to [`MAX_GROUP`] query heads per KV head, the layout's codecs in groups
/// of a multiple of 8 channels. Returns the codecs' kernel name and groups.
/// (Layers the kernels do not take stay on the host: Gemma 4's global
/// heads of 512.)
pub fn check_attention(
    l: &KvLayout,
    n_heads: usize,
) -> Result<(&'static str, i32, i32), KernelError> {
    let d = l.head_dim;
    if d != 64 && d != 128 && d != 256 {
        return Err(KernelError::Layout(format!(
            "the CUDA kernels are built for head dimensions 64, 128 and 256, not {d}"
        )));
    }
    if n_heads == 0 || !n_heads.is_multiple_of(l.kv_heads) || n_heads / l.kv_heads > MAX_GROUP {
        return Err(KernelError::Shape(format!(
            "{n_heads} query heads over {} KV heads (at most {MAX_GROUP} per KV head on CUDA)",
            l.kv_heads
        )));
    }
    let (name, kg, vg) = codec_names(l)?;
    if kg % 8 != 0 || vg % 8 != 0 {
        return Err(KernelError::Layout(format!(
            "the CUDA kernels read groups of a multiple of 8 channels, not {kg}/{vg}"
        )));
    }
    Ok((name, kg, vg))
}

/// The kernels' name for the layout's codecs, and their K and V groups.
pub(crate) fn codec_names(layout: &KvLayout) -> Result<(&'static str, i32, i32), KernelError> {
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
