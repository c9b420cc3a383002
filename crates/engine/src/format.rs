//! siliceo's KV formats as the engine names them.

use siliceo_kernels_turing::{Codec, KvLayout};

use crate::EngineError;

/// One of siliceo's KV formats: K and V codecs, an F16 tail of recent tokens,
/// an optional Hadamard rotation of K. What grafted serving stores, and what
/// the quality harness measures through shadow attention.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvFormat {
    /// K codec spec (`f16`, `kv8`, `kv8/G`, `kv8/head`, `k5`, `v4/G`).
    pub k: String,
    /// V codec spec.
    pub v: String,
    /// Hadamard-rotate K per head.
    pub rotate_k: bool,
    /// Recent tokens kept in F16 beyond the current block.
    pub tail_tokens: usize,
}

impl KvFormat {
    /// Parses a preset (`f16`, `kv8`, `k5v4`) or
    /// `K:V` codecs (`k5:kv8`, `kv8/head:v4/16`), then modifiers `+rot` and
    /// `+tailN`, e.g. `k5v4+rot+tail128`.
    pub fn parse(s: &str) -> Result<KvFormat, EngineError> {
        let bad = |reason: String| EngineError::InvalidOption {
            field: "kv",
            reason,
        };
        let mut parts = s.trim().split('+');
        let codecs = parts.next().unwrap_or_default();
        let (k, v) = match codecs {
            "f16" => ("f16", "f16"),
            "kv8" => ("kv8", "kv8"),
            "k5v4" => ("k5", "v4"),
            other => other.split_once(':').ok_or_else(|| {
                bad(format!(
                    "unknown KV format `{other}` (f16, kv8, k5v4 or K:V with codecs \
                     f16, kv8[/G|/head], k5, v4[/G]; then +rot, +tailN)"
                ))
            })?,
        };
        // Validate the codec names now (the head dimension only matters for `/head`).
        for c in [k, v] {
            Codec::parse(c, 64).map_err(|e| bad(format!("{codecs}: {e}")))?;
        }
        let mut f = KvFormat {
            k: k.to_string(),
            v: v.to_string(),
            rotate_k: false,
            tail_tokens: 0,
        };
        for m in parts {
            if m == "rot" {
                f.rotate_k = true;
            } else if let Some(n) = m.strip_prefix("tail") {
                f.tail_tokens = n
                    .parse()
                    .map_err(|_| bad(format!("`+{m}`: expected +tailN with N tokens")))?;
            } else {
                return Err(bad(format!(
                    "unknown modifier `+{m}` in `{s}` (+rot, +tailN)"
                )));
            }
        }
        Ok(f)
    }

    /// The store layout for a model with `kv_heads` heads of `head_dim`.
    pub fn layout(&self, kv_heads: usize, head_dim: usize) -> Result<KvLayout, EngineError> {
        let err = |e: siliceo_kernels_turing::KernelError| EngineError::InvalidOption {
            field: "kv",
            reason: e.to_string(),
        };
        let mut l = KvLayout::new(
            kv_heads,
            head_dim,
            Codec::parse(&self.k, head_dim).map_err(err)?,
            Codec::parse(&self.v, head_dim).map_err(err)?,
        );
        l.rotate_k = self.rotate_k;
        l.tail_tokens = self.tail_tokens;
        l.check().map_err(err)?;
        Ok(l)
    }

    /// The store's layouts for a model's layers ([`crate::Model::layer_kv`])
    /// in blocks of `block_tokens`: each distinct shape once (one for most
    /// models), and each layer's index into them.
    pub fn layer_layouts(
        &self,
        layers: &[crate::LayerKv],
        block_tokens: usize,
    ) -> Result<(Vec<KvLayout>, Vec<usize>), EngineError> {
        let mut layouts: Vec<KvLayout> = Vec::new();
        let mut of = Vec::with_capacity(layers.len());
        for l in layers {
            let mut layout = self.layout(l.kv_heads, l.head_dim)?;
            layout.block_tokens = block_tokens;
            layout.check().map_err(|e| EngineError::InvalidOption {
                field: "block_size",
                reason: e.to_string(),
            })?;
            of.push(match layouts.iter().position(|x| *x == layout) {
                Some(i) => i,
                None => {
                    layouts.push(layout);
                    layouts.len() - 1
                }
            });
        }
        Ok((layouts, of))
    }

    /// The format's name, e.g. `k5:v4/32+rot+tail128` (what [`KvFormat::parse`] reads back).
    pub fn name(&self) -> String {
        let mut s = format!("{}:{}", self.k, self.v);
        if self.rotate_k {
            s.push_str("+rot");
        }
        if self.tail_tokens > 0 {
            s.push_str(&format!("+tail{}", self.tail_tokens));
        }
        s
    }
}

impl Default for KvFormat {
    /// KV8 for K and V, no tail: at 8.5 bits per element, half of f16's bytes,
    /// its KL divergence sits on the noise floor on both measured models
    /// (docs/KV_QUALITY.md: SmolLM2 0.0041 against a floor of 0.0038;
    /// Qwen2.5-Coder-1.5B 0.0065 against 0.0055), where K5/V4 costs about
    /// twice the floor and a tail of recent tokens in F16 buys little of it
    /// back.
    fn default() -> Self {
        KvFormat {
            k: "kv8".into(),
            v: "kv8".into(),
            rotate_k: false,
            tail_tokens: 0,
        }
    }
}

impl std::fmt::Display for KvFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_and_name_themselves() {
        let f = KvFormat::parse("k5v4+rot+tail128").unwrap();
        assert_eq!(
            (f.k.as_str(), f.v.as_str(), f.rotate_k, f.tail_tokens),
            ("k5", "v4", true, 128)
        );
        assert_eq!(f.name(), "k5:v4+rot+tail128");
        let f = KvFormat::parse("k5:kv8/16").unwrap();
        assert_eq!(f.layout(2, 64).unwrap().v, Codec::Kv8 { group: 16 });
        for bad in ["k4v4", "k5v4+tail", "k5v4+fast", "q4:v4"] {
            assert!(
                matches!(KvFormat::parse(bad), Err(EngineError::InvalidOption { .. })),
                "{bad}"
            );
        }
        // Rotation needs a power-of-two head dimension.
        let f = KvFormat::parse("kv8+rot").unwrap();
        assert!(f.layout(2, 96).is_err());
        assert_eq!(KvFormat::default().name(), "kv8:kv8");
        let f = KvFormat::parse(&KvFormat::parse("k5v4+tail64").unwrap().name()).unwrap();
        assert_eq!(f, KvFormat::parse("k5v4+tail64").unwrap());
    }
}
