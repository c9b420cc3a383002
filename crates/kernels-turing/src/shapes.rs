//! What the CUDA kernels take (head sizes, query heads per KV head,
//! codecs), known in every build: which layers a GPU serves is decided
//! where no kernel is compiled too (`siliceo plan`, the start-up checks).

use crate::KernelError;
use crate::codec::Codec;
use crate::store::KvLayout;

/// Query heads per KV head the kernels handle at most (the largest `GT`).
pub const MAX_GROUP: usize = 8;

/// Query heads per KV head the kernels handle at most with heads of
/// `head_dim`: [`MAX_GROUP`], but 4 for heads of 512 (the decode kernel's
/// shared memory: eight heads of 512 would need 80 KiB).
pub fn max_group(head_dim: usize) -> usize {
    if head_dim > 256 { 4 } else { MAX_GROUP }
}

/// What the attention kernels take: head dimensions 64, 128, 256 and 512
/// (Gemma 4's global layers), up to [`max_group`] query heads per KV head,
/// the layout's codecs in groups of a multiple of 8 channels. Returns the
/// codecs' kernel name and groups. (Layers the kernels do not take stay on
/// the host.)
pub fn check_attention(
    l: &KvLayout,
    n_heads: usize,
) -> Result<(&'static str, i32, i32), KernelError> {
    let d = l.head_dim;
    if d != 64 && d != 128 && d != 256 && d != 512 {
        return Err(KernelError::Layout(format!(
            "the CUDA kernels are built for head dimensions 64, 128, 256 and 512, not {d}"
        )));
    }
    let most = max_group(d);
    if n_heads == 0 || !n_heads.is_multiple_of(l.kv_heads) || n_heads / l.kv_heads > most {
        return Err(KernelError::Shape(format!(
            "{n_heads} query heads over {} KV heads (at most {most} per KV head on CUDA with heads of {d})",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_of_512_take_up_to_four_query_heads_per_kv_head() {
        let layout = |d| KvLayout::preset("kv8", 2, d).unwrap();
        assert!(check_attention(&layout(512), 8).is_ok());
        assert!(check_attention(&layout(512), 6).is_ok());
        let e = check_attention(&layout(512), 16).unwrap_err().to_string();
        assert!(e.contains("at most 4"), "{e}");
        assert!(check_attention(&layout(256), 16).is_ok());
        assert!(check_attention(&layout(128), 18).is_err());
        let e = check_attention(&layout(96), 4).unwrap_err().to_string();
        assert!(e.contains("64, 128, 256 and 512"), "{e}");
    }
}
