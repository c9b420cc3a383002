//! Just enough of the GGUF format to plan memory: metadata and the tensor table.
//!
//! Parses from bytes the caller read (this crate does no I/O). A header larger
//! than the bytes given yields [`GgufError::Truncated`] with a size to retry with.
//! Layout (version 2 and 3): magic `GGUF`, `u32` version, `u64` tensor count,
//! `u64` metadata count, metadata entries (`string key`, `u32` type, value),
//! tensor infos (`string name`, `u32` dims, `u64` × dims, `u32` ggml type,
//! `u64` offset); strings are a `u64` length and UTF-8 bytes; little-endian.

use std::collections::HashMap;

use siliceo_core::{LayerKv, ModelGeometry, layer_kv};

/// Why a GGUF header could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The bytes end inside the header; retry with at least `needed` bytes.
    #[error("GGUF header continues past the bytes read; need at least {needed} bytes")]
    Truncated {
        /// A size that gets further (not necessarily the whole header).
        needed: usize,
    },
    /// Not a GGUF file.
    #[error("not a GGUF file (bad magic)")]
    BadMagic,
    /// A version this parser does not read.
    #[error("unsupported GGUF version {0}")]
    Version(u32),
    /// A malformed field.
    #[error("malformed GGUF header: {0}")]
    Malformed(String),
    /// A metadata key needed for planning is missing.
    #[error("GGUF metadata lacks `{0}`")]
    Missing(String),
    /// A tensor of a ggml type whose size is not known here.
    #[error("tensor `{name}` has ggml type {ty}, whose size is unknown")]
    UnknownType {
        /// Tensor name.
        name: String,
        /// ggml type id.
        ty: u32,
    },
}

/// A metadata value (arrays keep their length and their integer, boolean
/// (as 0 and 1) or string elements; float and nested arrays only their
/// length).
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// Any integer type, widened.
    Int(i128),
    /// f32 or f64.
    Float(f64),
    /// bool.
    Bool(bool),
    /// string.
    Str(String),
    /// An array: its length, and its integer or string elements.
    Array {
        /// Element count.
        len: u64,
        /// Integer or boolean (0, 1) elements (empty for other element
        /// types).
        ints: Vec<i128>,
        /// String elements (empty for other element types): a vocabulary's
        /// tokens and merges.
        strs: Vec<String>,
    },
}

/// One tensor's name, shape and ggml type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Name.
    pub name: String,
    /// Dimensions.
    pub dims: Vec<u64>,
    /// ggml type id.
    pub ggml_type: u32,
}

impl TensorInfo {
    /// Bytes of its data, from ggml's type sizes (`None` for a type not
    /// known here).
    pub fn bytes(&self) -> Option<u64> {
        let (blk, size) = ggml_type_size(self.ggml_type)?;
        Some(self.dims.iter().product::<u64>().div_ceil(blk) * size)
    }
}

/// Metadata and tensor table of a GGUF file.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    /// Format version.
    pub version: u32,
    /// Metadata by key.
    pub meta: HashMap<String, MetaValue>,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo>,
}

/// (elements per block, bytes per block) of a ggml type, from ggml's type table.
pub fn ggml_type_size(ty: u32) -> Option<(u64, u64)> {
    Some(match ty {
        0 => (1, 4),      // F32
        1 => (1, 2),      // F16
        2 => (32, 18),    // Q4_0
        3 => (32, 20),    // Q4_1
        6 => (32, 22),    // Q5_0
        7 => (32, 24),    // Q5_1
        8 => (32, 34),    // Q8_0
        9 => (32, 36),    // Q8_1
        10 => (256, 84),  // Q2_K
        11 => (256, 110), // Q3_K
        12 => (256, 144), // Q4_K
        13 => (256, 176), // Q5_K
        14 => (256, 210), // Q6_K
        15 => (256, 292), // Q8_K
        16 => (256, 66),  // IQ2_XXS
        17 => (256, 74),  // IQ2_XS
        18 => (256, 98),  // IQ3_XXS
        19 => (256, 50),  // IQ1_S
        20 => (32, 18),   // IQ4_NL
        21 => (256, 110), // IQ3_S
        22 => (256, 82),  // IQ2_S
        23 => (256, 136), // IQ4_XS
        24 => (1, 1),     // I8
        25 => (1, 2),     // I16
        26 => (1, 4),     // I32
        27 => (1, 8),     // I64
        28 => (1, 8),     // F64
        29 => (256, 56),  // IQ1_M
        30 => (1, 2),     // BF16
        34 => (256, 54),  // TQ1_0
        35 => (256, 66),  // TQ2_0
        39 => (32, 17),   // MXFP4
        40 => (64, 36),   // NVFP4
        41 => (128, 18),  // Q1_0
        42 => (64, 18),   // Q2_0
        _ => return None,
    })
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], GgufError> {
        let end = self
            .at
            .checked_add(n)
            .ok_or_else(|| GgufError::Malformed("length overflow".into()))?;
        if end > self.b.len() {
            return Err(GgufError::Truncated {
                needed: end.max(self.b.len() * 2),
            });
        }
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn len(&mut self, what: &str) -> Result<usize, GgufError> {
        let n = self.u64()?;
        usize::try_from(n)
            .ok()
            .filter(|&n| n < (1 << 40))
            .ok_or_else(|| GgufError::Malformed(format!("{what} length {n}")))
    }
    fn string(&mut self) -> Result<String, GgufError> {
        let n = self.len("string")?;
        let s = self.take(n)?;
        String::from_utf8(s.to_vec())
            .map_err(|_| GgufError::Malformed("string is not UTF-8".into()))
    }
    fn scalar(&mut self, ty: u32) -> Result<MetaValue, GgufError> {
        let int = |v: i128| Ok(MetaValue::Int(v));
        match ty {
            0 => int(self.take(1)?[0].into()),
            1 => int((self.take(1)?[0] as i8).into()),
            2 => int(u16::from_le_bytes(self.take(2)?.try_into().expect("2")).into()),
            3 => int(i16::from_le_bytes(self.take(2)?.try_into().expect("2")).into()),
            4 => int(self.u32()?.into()),
            5 => int((self.u32()? as i32).into()),
            6 => Ok(MetaValue::Float(
                f32::from_le_bytes(self.take(4)?.try_into().expect("4")).into(),
            )),
            7 => Ok(MetaValue::Bool(self.take(1)?[0] != 0)),
            8 => Ok(MetaValue::Str(self.string()?)),
            10 => int(self.u64()?.into()),
            11 => int((self.u64()? as i64).into()),
            12 => Ok(MetaValue::Float(f64::from_le_bytes(
                self.take(8)?.try_into().expect("8"),
            ))),
            t => Err(GgufError::Malformed(format!("metadata type {t}"))),
        }
    }
    fn value(&mut self, ty: u32) -> Result<MetaValue, GgufError> {
        if ty != 9 {
            return self.scalar(ty);
        }
        let elem = self.u32()?;
        let len = self.u64()?;
        let mut ints = Vec::new();
        let mut strs = Vec::new();
        for _ in 0..len {
            match self.value(elem)? {
                MetaValue::Int(v) => ints.push(v),
                MetaValue::Bool(b) => ints.push(i128::from(b)),
                MetaValue::Str(s) => strs.push(s),
                _ => {}
            }
        }
        Ok(MetaValue::Array { len, ints, strs })
    }
}

impl<'a> Reader<'a> {
    /// Checks the magic and version; returns a reader at the first metadata
    /// entry, the version and the tensor and metadata counts.
    fn preamble(bytes: &'a [u8]) -> Result<(Reader<'a>, u32, usize, usize), GgufError> {
        let mut r = Reader { b: bytes, at: 0 };
        if r.take(4)? != b"GGUF" {
            return Err(GgufError::BadMagic);
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let n_tensors = r.len("tensor count")?;
        let n_meta = r.len("metadata count")?;
        Ok((r, version, n_tensors, n_meta))
    }

    /// Reads `n` metadata entries after the counts, handing each one's key,
    /// value and byte span (key, type and value) to `f`.
    fn entries(
        &mut self,
        n: usize,
        mut f: impl FnMut(String, MetaValue, std::ops::Range<usize>),
    ) -> Result<(), GgufError> {
        for _ in 0..n {
            let start = self.at;
            let key = self.string()?;
            let ty = self.u32()?;
            let v = self.value(ty)?;
            f(key, v, start..self.at);
        }
        Ok(())
    }
}

/// Each metadata entry's key and byte span in `bytes` (its key, type and
/// value, as [`GgufWriter::raw`] takes it): a way to copy entries (a
/// vocabulary, say) from one file into another unchanged.
pub fn metadata_spans(bytes: &[u8]) -> Result<Vec<(String, std::ops::Range<usize>)>, GgufError> {
    let (mut r, _, _, n_meta) = Reader::preamble(bytes)?;
    let mut spans = Vec::with_capacity(n_meta.min(1 << 12));
    r.entries(n_meta, |key, _, span| spans.push((key, span)))?;
    Ok(spans)
}

/// Tensor data in a GGUF file starts at, and each tensor is padded to, this
/// many bytes (`general.alignment`'s default).
pub const GGUF_ALIGNMENT: u64 = 32;

/// Builds a GGUF v3 file: metadata entries and a tensor table make the
/// header ([`GgufWriter::header`]); the caller then writes each tensor's
/// data in the order declared, each padded to [`GGUF_ALIGNMENT`]
/// ([`padding`]). Data is not held here, so a file of many gigabytes can be
/// streamed.
///
/// ```
/// use siliceo_kv_paging::gguf::{GgufHeader, GgufWriter};
/// let mut w = GgufWriter::default();
/// w.str("general.architecture", "llama");
/// w.u32("llama.block_count", 2);
/// let bytes = w.tensor("output_norm.weight", &[64], 0).unwrap(); // F32
/// assert_eq!(bytes, 256);
/// let h = GgufHeader::parse(&w.header()).unwrap();
/// assert_eq!(h.int("llama.block_count"), Some(2));
/// assert_eq!(h.tensors[0].dims, [64]);
/// ```
#[derive(Debug, Default, Clone)]
pub struct GgufWriter {
    kv: Vec<u8>,
    n_kv: u64,
    tensors: Vec<(TensorInfo, u64)>,
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

/// Zero bytes that follow `bytes` of tensor data (and the header) to reach
/// the next aligned offset.
pub fn padding(bytes: u64) -> u64 {
    bytes.next_multiple_of(GGUF_ALIGNMENT) - bytes
}

impl GgufWriter {
    fn key(&mut self, k: &str, ty: u32) {
        put_str(&mut self.kv, k);
        self.kv.extend(ty.to_le_bytes());
        self.n_kv += 1;
    }
    /// A `u32` entry.
    pub fn u32(&mut self, k: &str, v: u32) {
        self.key(k, 4);
        self.kv.extend(v.to_le_bytes());
    }
    /// An `f32` entry.
    pub fn f32(&mut self, k: &str, v: f32) {
        self.key(k, 6);
        self.kv.extend(v.to_le_bytes());
    }
    /// A `bool` entry.
    pub fn bool(&mut self, k: &str, v: bool) {
        self.key(k, 7);
        self.kv.push(u8::from(v));
    }
    /// A string entry.
    pub fn str(&mut self, k: &str, v: &str) {
        self.key(k, 8);
        put_str(&mut self.kv, v);
    }
    /// An array of strings.
    pub fn strs(&mut self, k: &str, v: &[String]) {
        self.key(k, 9);
        self.kv.extend(8u32.to_le_bytes());
        self.kv.extend((v.len() as u64).to_le_bytes());
        for s in v {
            put_str(&mut self.kv, s);
        }
    }
    /// An array of `i32`.
    pub fn i32s(&mut self, k: &str, v: &[i32]) {
        self.key(k, 9);
        self.kv.extend(5u32.to_le_bytes());
        self.kv.extend((v.len() as u64).to_le_bytes());
        for x in v {
            self.kv.extend(x.to_le_bytes());
        }
    }
    /// An array of `bool`.
    pub fn bools(&mut self, k: &str, v: &[bool]) {
        self.key(k, 9);
        self.kv.extend(7u32.to_le_bytes());
        self.kv.extend((v.len() as u64).to_le_bytes());
        self.kv.extend(v.iter().map(|&b| u8::from(b)));
    }
    /// An entry copied whole from another file (a span from
    /// [`metadata_spans`]).
    pub fn raw(&mut self, entry: &[u8]) {
        self.kv.extend(entry);
        self.n_kv += 1;
    }
    /// Declares the next tensor (`dims` innermost first, a ggml type id);
    /// returns the bytes of data the caller writes for it.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ggml_type: u32) -> Result<u64, GgufError> {
        let (blk, size) = ggml_type_size(ggml_type).ok_or_else(|| GgufError::UnknownType {
            name: name.into(),
            ty: ggml_type,
        })?;
        let elems: u64 = dims.iter().product();
        if dims.first().is_some_and(|d| d % blk != 0) {
            return Err(GgufError::Malformed(format!(
                "tensor `{name}`: a row of {} is not a whole number of {blk}-element blocks",
                dims[0]
            )));
        }
        let bytes = elems / blk * size;
        self.tensors.push((
            TensorInfo {
                name: name.into(),
                dims: dims.to_vec(),
                ggml_type,
            },
            bytes,
        ));
        Ok(bytes)
    }
    /// The header: magic, counts, metadata and the tensor table, padded so
    /// the first tensor's data may follow at once.
    pub fn header(&self) -> Vec<u8> {
        let mut h = Vec::with_capacity(self.kv.len() + 64 * self.tensors.len() + 64);
        h.extend(b"GGUF");
        h.extend(3u32.to_le_bytes());
        h.extend((self.tensors.len() as u64).to_le_bytes());
        h.extend(self.n_kv.to_le_bytes());
        h.extend(&self.kv);
        let mut offset = 0u64;
        for (t, bytes) in &self.tensors {
            put_str(&mut h, &t.name);
            h.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                h.extend(d.to_le_bytes());
            }
            h.extend(t.ggml_type.to_le_bytes());
            h.extend(offset.to_le_bytes());
            offset += bytes + padding(*bytes);
        }
        h.resize(h.len() + padding(h.len() as u64) as usize, 0);
        h
    }
}

impl GgufHeader {
    /// Parses the header from the first bytes of a GGUF file.
    pub fn parse(bytes: &[u8]) -> Result<GgufHeader, GgufError> {
        let (mut r, version, n_tensors, n_meta) = Reader::preamble(bytes)?;
        let mut meta = HashMap::new();
        r.entries(n_meta, |key, v, _| {
            meta.insert(key, v);
        })?;
        let mut tensors = Vec::with_capacity(n_tensors.min(1 << 16));
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims > 8 {
                return Err(GgufError::Malformed(format!(
                    "tensor `{name}` has {n_dims} dimensions"
                )));
            }
            let dims = (0..n_dims)
                .map(|_| r.u64())
                .collect::<Result<Vec<_>, _>>()?;
            let ggml_type = r.u32()?;
            let _offset = r.u64()?;
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
            });
        }
        Ok(GgufHeader {
            version,
            meta,
            tensors,
        })
    }

    /// An integer metadata value (the maximum, for per-layer arrays).
    pub fn int(&self, key: &str) -> Option<i128> {
        match self.meta.get(key)? {
            MetaValue::Int(v) => Some(*v),
            MetaValue::Array { ints, .. } => ints.iter().copied().max(),
            _ => None,
        }
    }

    /// A string metadata value.
    pub fn str(&self, key: &str) -> Option<&str> {
        match self.meta.get(key)? {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    /// A string array's elements (a vocabulary's `tokenizer.ggml.tokens`).
    pub fn strs(&self, key: &str) -> Option<&[String]> {
        match self.meta.get(key)? {
            MetaValue::Array { strs, len, .. } if strs.len() as u64 == *len => Some(strs),
            _ => None,
        }
    }

    /// An integer or boolean array's elements (`tokenizer.ggml.token_type`;
    /// booleans as 0 and 1).
    pub fn ints(&self, key: &str) -> Option<&[i128]> {
        match self.meta.get(key)? {
            MetaValue::Array { ints, len, .. } if ints.len() as u64 == *len => Some(ints),
            _ => None,
        }
    }

    /// A boolean metadata value.
    pub fn bool(&self, key: &str) -> Option<bool> {
        match self.meta.get(key)? {
            MetaValue::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// Bytes of all tensor data, from the tensor table and ggml's type sizes.
    pub fn weight_bytes(&self) -> Result<u64, GgufError> {
        let mut total = 0u64;
        for t in &self.tensors {
            total += t.bytes().ok_or_else(|| GgufError::UnknownType {
                name: t.name.clone(),
                ty: t.ggml_type,
            })?;
        }
        Ok(total)
    }

    /// The model's geometry from `<arch>.*` metadata.
    pub fn geometry(&self) -> Result<ModelGeometry, GgufError> {
        let arch = self
            .str("general.architecture")
            .ok_or_else(|| GgufError::Missing("general.architecture".into()))?;
        let get = |k: &str| {
            let key = format!("{arch}.{k}");
            self.int(&key)
                .and_then(|v| u32::try_from(v).ok())
                .ok_or(GgufError::Missing(key))
        };
        let n_layer = get("block_count")?;
        let n_head = get("attention.head_count")?;
        let n_head_kv = get("attention.head_count_kv").unwrap_or(n_head);
        let n_embd = get("embedding_length")?;
        let head_dim = n_embd.checked_div(n_head).unwrap_or(0);
        let n_vocab =
            get("vocab_size")
                .ok()
                .or_else(|| match self.meta.get("tokenizer.ggml.tokens") {
                    Some(MetaValue::Array { len, .. }) => u32::try_from(*len).ok(),
                    _ => None,
                });
        Ok(ModelGeometry {
            n_layer,
            n_head,
            n_head_kv,
            head_dim_k: get("attention.key_length").unwrap_or(head_dim),
            head_dim_v: get("attention.value_length").unwrap_or(head_dim),
            n_embd,
            n_vocab: n_vocab.unwrap_or(0),
            n_ctx_train: get("context_length").unwrap_or(0),
        })
    }
}

impl GgufHeader {
    /// Each layer's KV as llama.cpp keeps it ([`siliceo_core::layer_kv`]):
    /// heads of `attention.key_length_swa` in the layers
    /// `attention.sliding_window_pattern` lists as windowed, KV heads from
    /// `attention.head_count_kv` (one per layer or one for all), and the last
    /// `attention.shared_kv_layers` layers reading others' KV (Gemma 4's;
    /// Gemma 3n's all but the first 20, [`siliceo_core::shared_kv_layers`]).
    /// Which layers are windowed matters only where their heads differ or
    /// layers share KV: then the file must list them or give a period
    /// (Gemma 3n's is 5 when it does not).
    pub fn layer_kv(&self) -> Result<Vec<LayerKv>, GgufError> {
        let g = self.geometry()?;
        let arch = self.str("general.architecture").unwrap_or_default();
        let key = |k: &str| format!("{arch}.{k}");
        let size = |k: &str| self.int(&key(k)).and_then(|v| usize::try_from(v).ok());
        let n = g.n_layer as usize;
        let full = g.head_dim_k as usize;
        let swa = size("attention.key_length_swa").unwrap_or(full);
        let shared = siliceo_core::shared_kv_layers(arch, n, size("attention.shared_kv_layers"));
        let pattern = key("attention.sliding_window_pattern");
        // Listed per layer, or a period in the file, or Gemma 3n's default
        // period (llama.cpp's `load_swa_pattern(ml, 5)`).
        let period = match self.meta.get(&pattern) {
            Some(MetaValue::Int(p)) => usize::try_from(*p).ok(),
            _ => (arch == "gemma3n").then_some(5),
        };
        let windowed: Vec<bool> = match self.ints(&pattern).filter(|f| f.len() >= n) {
            Some(flags) => flags[..n].iter().map(|&f| f != 0).collect(),
            None if swa == full && shared == 0 => vec![false; n],
            None => match period {
                Some(p) => siliceo_core::windowed_by_period(n, p),
                None => return Err(GgufError::Missing(format!("{pattern} (a flag per layer)"))),
            },
        };
        let listed = self
            .ints(&key("attention.head_count_kv"))
            .filter(|h| h.len() >= n);
        let kv_heads = |il: usize| {
            listed
                .and_then(|h| usize::try_from(h[il]).ok())
                .unwrap_or(g.n_head_kv as usize)
        };
        Ok(layer_kv(&windowed, (full, swa), kv_heads, shared))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-built GGUF header.
    fn sample() -> Vec<u8> {
        let mut b = Vec::new();
        let s = |b: &mut Vec<u8>, v: &str| {
            b.extend((v.len() as u64).to_le_bytes());
            b.extend(v.as_bytes());
        };
        b.extend(b"GGUF");
        b.extend(3u32.to_le_bytes());
        b.extend(2u64.to_le_bytes()); // tensors
        b.extend(7u64.to_le_bytes()); // metadata
        s(&mut b, "general.architecture");
        b.extend(8u32.to_le_bytes());
        s(&mut b, "llama");
        for (k, v) in [
            ("llama.block_count", 2u32),
            ("llama.attention.head_count", 8),
            ("llama.embedding_length", 512),
            ("llama.context_length", 4096),
        ] {
            s(&mut b, k);
            b.extend(4u32.to_le_bytes());
            b.extend(v.to_le_bytes());
        }
        // Per-layer KV heads as an array of i32.
        s(&mut b, "llama.attention.head_count_kv");
        b.extend(9u32.to_le_bytes());
        b.extend(5u32.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        b.extend(2i32.to_le_bytes());
        b.extend(4i32.to_le_bytes());
        // A vocabulary: an array of strings.
        s(&mut b, "tokenizer.ggml.tokens");
        b.extend(9u32.to_le_bytes());
        b.extend(8u32.to_le_bytes());
        b.extend(2u64.to_le_bytes());
        s(&mut b, "<s>");
        s(&mut b, "Ġhello");
        // Tensors: F32 [512] and Q4_K [512, 256].
        for (name, dims, ty) in [
            ("norm.weight", vec![512u64], 0u32),
            ("blk.0.attn_q.weight", vec![512, 256], 12),
        ] {
            s(&mut b, name);
            b.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(0u64.to_le_bytes());
        }
        b
    }

    #[test]
    fn writes_what_it_reads_and_copies_entries_whole() {
        let src = sample();
        let spans = metadata_spans(&src).unwrap();
        assert_eq!(spans.len(), 7);
        let mut w = GgufWriter::default();
        for (key, span) in &spans {
            if key.starts_with("tokenizer.") || key.ends_with("head_count_kv") {
                w.raw(&src[span.clone()]);
            }
        }
        w.str("general.architecture", "qwen2");
        w.f32("qwen2.rope.freq_base", 1e6);
        w.bool("qwen2.flag", true);
        w.i32s("qwen2.ints", &[-1, 7]);
        w.strs("qwen2.names", &["a".into(), "bc".into()]);
        assert_eq!(w.tensor("t.0", &[256, 3], 12).unwrap(), 3 * 144); // Q4_K
        assert_eq!(w.tensor("t.1", &[5], 0).unwrap(), 20); // F32
        assert!(matches!(
            w.tensor("bad", &[100], 12),
            Err(GgufError::Malformed(_))
        ));
        assert!(matches!(
            w.tensor("bad", &[1], 999),
            Err(GgufError::UnknownType { .. })
        ));
        let head = w.header();
        assert_eq!(head.len() as u64 % GGUF_ALIGNMENT, 0);
        let h = GgufHeader::parse(&head).unwrap();
        assert_eq!(h.str("general.architecture"), Some("qwen2"));
        assert_eq!(
            h.strs("tokenizer.ggml.tokens").unwrap(),
            ["<s>".to_string(), "Ġhello".to_string()]
        );
        assert_eq!(h.ints("llama.attention.head_count_kv").unwrap(), [2, 4]);
        assert_eq!(h.ints("qwen2.ints").unwrap(), [-1, 7]);
        assert_eq!(h.bool("qwen2.flag"), Some(true));
        assert_eq!(h.meta["qwen2.rope.freq_base"], MetaValue::Float(1e6));
        let names: Vec<_> = h
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.ggml_type))
            .collect();
        assert_eq!(names, [("t.0", 12), ("t.1", 0)]);
        // Two entries copied whole, five written.
        let spans = metadata_spans(&head).unwrap();
        assert_eq!(spans.len(), 7);
        assert_eq!(h.weight_bytes().unwrap(), 3 * 144 + 20);
        assert_eq!(padding(3 * 144), 16);
    }

    #[test]
    fn keeps_string_and_integer_arrays() {
        let h = GgufHeader::parse(&sample()).unwrap();
        assert_eq!(
            h.strs("tokenizer.ggml.tokens").unwrap(),
            ["<s>".to_string(), "Ġhello".to_string()]
        );
        assert_eq!(h.ints("llama.attention.head_count_kv").unwrap(), [2, 4]);
        assert_eq!(h.strs("llama.attention.head_count_kv"), None);
        assert_eq!(h.bool("general.architecture"), None);
    }

    #[test]
    fn parses_geometry_and_weight_bytes() {
        let h = GgufHeader::parse(&sample()).unwrap();
        let g = h.geometry().unwrap();
        assert_eq!(
            (
                g.n_layer,
                g.n_head,
                g.n_head_kv,
                g.head_dim_k,
                g.n_ctx_train
            ),
            (2, 8, 4, 64, 4096)
        );
        // 512 × 4 + (512 × 256 / 256) × 144
        assert_eq!(h.weight_bytes().unwrap(), 2048 + 512 * 144);
    }

    /// Layers of two shapes, KV heads listed per layer and shared KV, read
    /// from a header: the sharing layers read the last own layer of their
    /// kind; the windowed layers must be listed where that decides a shape.
    #[test]
    fn reads_each_layers_kv() {
        let header = |pattern: bool, shared: u32| {
            let mut w = GgufWriter::default();
            w.str("general.architecture", "gemma4");
            for (k, v) in [
                ("block_count", 6u32),
                ("attention.head_count", 4),
                ("embedding_length", 256),
                ("attention.key_length", 128),
                ("attention.key_length_swa", 64),
                ("attention.shared_kv_layers", shared),
            ] {
                w.u32(&format!("gemma4.{k}"), v);
            }
            w.i32s("gemma4.attention.head_count_kv", &[2, 2, 2, 1, 2, 1]);
            if pattern {
                let flags = [true, true, true, false, true, false];
                w.bools("gemma4.attention.sliding_window_pattern", &flags);
            }
            GgufHeader::parse(&w.header()).unwrap()
        };
        let h = header(true, 2);
        assert_eq!(
            h.ints("gemma4.attention.sliding_window_pattern").unwrap(),
            [1, 1, 1, 0, 1, 0]
        );
        let layers = h.layer_kv().unwrap();
        let shapes: Vec<_> = layers
            .iter()
            .map(|l| (l.kv_heads, l.head_dim, l.source))
            .collect();
        let (w, g) = ((2, 64), (1, 128));
        assert_eq!(
            shapes,
            [
                (w.0, w.1, 0),
                (w.0, w.1, 1),
                (w.0, w.1, 2),
                (g.0, g.1, 3),
                (w.0, w.1, 2),
                (g.0, g.1, 3)
            ]
        );
        assert_eq!(siliceo_core::kv_elems_per_token(&layers), 3 * 128 + 128);
        assert!(h.geometry().unwrap().k_elems_per_token() > 6 * 128);
        assert_eq!(header(true, 0).layer_kv().unwrap()[4].source, 4);
        match header(false, 2).layer_kv() {
            Err(GgufError::Missing(k)) => assert!(k.contains("sliding_window_pattern"), "{k}"),
            other => panic!("{other:?}"),
        }
    }

    /// Gemma 3n's file says neither which layers share KV nor, here, which
    /// are windowed: llama.cpp's fixed 20 layers with KV and its default
    /// period of 5.
    #[test]
    fn reads_gemma3n_layers_as_llama_cpp_does() {
        let mut w = GgufWriter::default();
        w.str("general.architecture", "gemma3n");
        for (k, v) in [
            ("block_count", 25u32),
            ("attention.head_count", 8),
            ("attention.head_count_kv", 2),
            ("embedding_length", 2048),
            ("attention.key_length", 256),
        ] {
            w.u32(&format!("gemma3n.{k}"), v);
        }
        let layers = GgufHeader::parse(&w.header()).unwrap().layer_kv().unwrap();
        let sources: Vec<usize> = layers.iter().map(|l| l.source).collect();
        // Layers 20-23 windowed (they read layer 18), 24 global (layer 19).
        let want: Vec<usize> = (0..20).chain([18, 18, 18, 18, 19]).collect();
        assert_eq!(sources, want);
        assert!(layers.iter().all(|l| (l.kv_heads, l.head_dim) == (2, 256)));
    }

    #[test]
    fn short_input_asks_for_more() {
        let full = sample();
        for cut in [3, 10, 40, full.len() - 1] {
            match GgufHeader::parse(&full[..cut]) {
                Err(GgufError::Truncated { needed }) => assert!(needed > cut),
                other => panic!("cut {cut}: {other:?}"),
            }
        }
        assert!(matches!(
            GgufHeader::parse(b"GGML\x03\0\0\0"),
            Err(GgufError::BadMagic)
        ));
    }
}
