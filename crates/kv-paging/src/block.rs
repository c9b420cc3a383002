//! Pure block data: ids and the chained content hash of a full block.

use siliceo_core::TokenId;

/// Index of a block in the pool. Whoever stores the block's bytes (llama.cpp's
/// cells, our own paged store) maps this index to memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

impl BlockId {
    /// No block: a table entry whose block a sliding window has released
    /// ([`crate::Window`]). Out of range of every pool.
    pub const NONE: BlockId = BlockId(u32::MAX);
}

/// Content address of a full block: a hash chained on the parent block's hash,
/// so equal hashes mean equal *prefixes*, not just equal blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// What besides the tokens decides whether cached KV can be reused: the model,
/// the KV format and an optional tenant salt. Two requests share cached blocks
/// only when all three match.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct CacheKeys {
    /// Identifies the model (e.g. a hash of its file or name).
    pub model: String,
    /// Identifies how KV is stored (e.g. `f16/f16`, `q8_0/q4_0`).
    pub kv_format: String,
    /// Tenants with different salts never share blocks.
    pub salt: Option<String>,
}

impl CacheKeys {
    /// Keys for a model and KV format, no salt.
    pub fn new(model: impl Into<String>, kv_format: impl Into<String>) -> Self {
        CacheKeys {
            model: model.into(),
            kv_format: kv_format.into(),
            salt: None,
        }
    }

    /// The same keys with a tenant salt.
    pub fn with_salt(mut self, salt: impl Into<String>) -> Self {
        self.salt = Some(salt.into());
        self
    }

    /// The hash the first block of a sequence chains on.
    pub fn root_hash(&self) -> BlockHash {
        let mut h = Hasher::new(0x5111_CE00_0000_0001);
        h.bytes(self.model.as_bytes());
        h.word(0xFF);
        h.bytes(self.kv_format.as_bytes());
        h.word(0xFE);
        match &self.salt {
            Some(s) => {
                h.word(1);
                h.bytes(s.as_bytes());
            }
            None => h.word(0),
        }
        BlockHash(h.finish())
    }
}

/// Hash of a full block given its parent's hash (or [`CacheKeys::root_hash`]
/// for the first block) and its tokens.
pub fn hash_block(parent: BlockHash, tokens: &[TokenId]) -> BlockHash {
    let mut h = Hasher::new(parent.0);
    h.word(tokens.len() as u64);
    for pair in tokens.chunks(2) {
        let w = u64::from(pair[0].0) | (pair.get(1).map_or(0, |t| u64::from(t.0)) << 32);
        h.word(w);
    }
    BlockHash(h.finish())
}

/// The key under which the *sealed* (quantized) form of the block with
/// content hash `h` is cached, apart from its open (full-precision) form:
/// both hold the same tokens, in different bytes.
pub fn sealed_form(h: BlockHash) -> BlockHash {
    let mut x = Hasher::new(h.0);
    x.word(0x5EA1_ED00_F0F0_0001);
    BlockHash(x.finish())
}

/// A small 64-bit hash (multiply-fold mixing). Not cryptographic: a cache hit
/// is always confirmed by comparing tokens, so a collision costs a miss, never
/// a wrong answer.
struct Hasher {
    state: u64,
}

const P0: u64 = 0xa076_1d64_78bd_642f;
const P1: u64 = 0xe703_7ed1_a0b4_28db;

fn fold(a: u64, b: u64) -> u64 {
    let r = u128::from(a).wrapping_mul(u128::from(b));
    (r as u64) ^ ((r >> 64) as u64)
}

impl Hasher {
    fn new(seed: u64) -> Self {
        Hasher { state: seed ^ P0 }
    }

    fn word(&mut self, w: u64) {
        self.state = fold(self.state ^ w ^ P1, P0);
    }

    fn bytes(&mut self, b: &[u8]) {
        self.word(b.len() as u64);
        for chunk in b.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.word(u64::from_le_bytes(w));
        }
    }

    fn finish(&self) -> u64 {
        fold(self.state, P1 ^ 0x2d35_8dcc_aa6c_78a5)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(v: &[u32]) -> Vec<TokenId> {
        v.iter().map(|&t| TokenId(t)).collect()
    }

    #[test]
    fn hash_depends_on_parent_tokens_and_keys() {
        let root = CacheKeys::new("m", "f16/f16").root_hash();
        let a = hash_block(root, &toks(&[1, 2, 3, 4]));
        assert_eq!(a, hash_block(root, &toks(&[1, 2, 3, 4])));
        assert_ne!(a, hash_block(root, &toks(&[1, 2, 4, 3])));
        assert_ne!(a, hash_block(BlockHash(root.0 ^ 1), &toks(&[1, 2, 3, 4])));
        assert_ne!(a, hash_block(root, &toks(&[1, 2, 3])));
        let salted = CacheKeys::new("m", "f16/f16")
            .with_salt("tenant-a")
            .root_hash();
        assert_ne!(root, salted);
        assert_ne!(
            salted,
            CacheKeys::new("m", "f16/f16")
                .with_salt("tenant-b")
                .root_hash()
        );
        assert_ne!(root, CacheKeys::new("m", "q8_0/q8_0").root_hash());
        // Field boundaries matter: ("ab","c") is not ("a","bc").
        assert_ne!(
            CacheKeys::new("ab", "c").root_hash(),
            CacheKeys::new("a", "bc").root_hash()
        );
    }
}
