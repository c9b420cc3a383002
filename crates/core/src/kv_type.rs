use std::fmt;
use std::str::FromStr;

use crate::Error;

/// An element format of llama.cpp's KV cache (a subset of `ggml_type`).
///
/// Quantized types store blocks of [`KvType::block_elems`] elements in
/// [`KvType::block_bytes`] bytes; a KV row must hold a whole number of blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvType {
    /// 32-bit float.
    F32,
    /// IEEE half precision (llama.cpp's default KV type).
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit, blocks of 32 with one f16 scale (8.5 bits per element).
    Q8_0,
    /// 5-bit, blocks of 32 with f16 scale and minimum (6 bits per element).
    Q5_1,
    /// 5-bit, blocks of 32 with one f16 scale (5.5 bits per element).
    Q5_0,
    /// 4-bit, blocks of 32 with f16 scale and minimum (5 bits per element).
    Q4_1,
    /// 4-bit, blocks of 32 with one f16 scale (4.5 bits per element).
    Q4_0,
    /// 4-bit non-linear codebook, blocks of 32 (4.5 bits per element).
    Iq4Nl,
}

impl KvType {
    /// Every type, in the order tables print them.
    pub const ALL: [KvType; 9] = [
        KvType::F32,
        KvType::F16,
        KvType::Bf16,
        KvType::Q8_0,
        KvType::Q5_1,
        KvType::Q5_0,
        KvType::Q4_1,
        KvType::Q4_0,
        KvType::Iq4Nl,
    ];

    /// The name used on the command line and in llama.cpp (`q8_0`, `f16`, …).
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Bf16 => "bf16",
            KvType::Q8_0 => "q8_0",
            KvType::Q5_1 => "q5_1",
            KvType::Q5_0 => "q5_0",
            KvType::Q4_1 => "q4_1",
            KvType::Q4_0 => "q4_0",
            KvType::Iq4Nl => "iq4_nl",
        }
    }

    /// Elements per quantization block.
    pub fn block_elems(self) -> u64 {
        match self {
            KvType::F32 | KvType::F16 | KvType::Bf16 => 1,
            _ => 32,
        }
    }

    /// Bytes per quantization block.
    pub fn block_bytes(self) -> u64 {
        match self {
            KvType::F32 => 4,
            KvType::F16 | KvType::Bf16 => 2,
            KvType::Q8_0 => 34,
            KvType::Q5_1 => 24,
            KvType::Q5_0 => 22,
            KvType::Q4_1 => 20,
            KvType::Q4_0 | KvType::Iq4Nl => 18,
        }
    }

    /// Average storage bits per element, scales included.
    pub fn bits_per_element(self) -> f64 {
        (self.block_bytes() * 8) as f64 / self.block_elems() as f64
    }

    /// Whether this is a block-quantized type.
    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes of a row of `n_elems` elements, or `None` when `n_elems` is not a
    /// whole number of blocks (llama.cpp refuses such a cache).
    pub fn row_bytes(self, n_elems: u64) -> Option<u64> {
        let blk = self.block_elems();
        n_elems
            .is_multiple_of(blk)
            .then(|| n_elems / blk * self.block_bytes())
    }
}

impl fmt::Display for KvType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        KvType::ALL
            .into_iter()
            .find(|t| t.name() == lower)
            .ok_or_else(|| Error::UnknownKvType(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for t in KvType::ALL {
            assert_eq!(t.name().parse::<KvType>().unwrap(), t);
        }
        assert_eq!("Q8_0".parse::<KvType>().unwrap(), KvType::Q8_0);
        assert!(matches!(
            "q3_k".parse::<KvType>(),
            Err(Error::UnknownKvType(_))
        ));
    }

    #[test]
    fn bits_per_element_match_ggml() {
        let check = |t: KvType, bits: f64| assert_eq!(t.bits_per_element(), bits, "{t}");
        check(KvType::F32, 32.0);
        check(KvType::F16, 16.0);
        check(KvType::Bf16, 16.0);
        check(KvType::Q8_0, 8.5);
        check(KvType::Q5_1, 6.0);
        check(KvType::Q5_0, 5.5);
        check(KvType::Q4_1, 5.0);
        check(KvType::Q4_0, 4.5);
        check(KvType::Iq4Nl, 4.5);
    }

    #[test]
    fn row_bytes_needs_whole_blocks() {
        assert_eq!(KvType::Q8_0.row_bytes(64), Some(68));
        assert_eq!(KvType::Q8_0.row_bytes(48), None);
        assert_eq!(KvType::F16.row_bytes(48), Some(96));
    }
}
