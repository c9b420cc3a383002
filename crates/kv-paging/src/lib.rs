//! Paged KV-cache bookkeeping: fixed-size blocks, block tables, automatic
//! prefix caching with LRU eviction, and a memory planner. Pure logic, meant
//! to be reused on its own.
//!
//! The parts, after vLLM v1's separation:
//!
//! - [`block`]: block ids and the content hash of a full block, chained on its
//!   parent's hash plus [`CacheKeys`] (model, KV format, tenant salt).
//! - [`BlockPool`]: owns every block; reference counts; O(1) LRU free queues
//!   linked through indices with sentinel slots (no heap node per entry), one
//!   per block class (open and sealed blocks of a quantized store); the
//!   hash → block map of cached prefixes, confirmed by comparing tokens, and
//!   an index of partial blocks by parent.
//! - [`KvCacheManager`]: the per-sequence policy — block tables behind opaque
//!   [`SeqHandle`]s, longest cached prefix (partial last blocks included, with
//!   [`KvConfig::cache_partial`]), appends that register full blocks,
//!   copy-on-write of a shared partial block, sealing of blocks that leave
//!   the full-precision tail ([`Sealing`], [`BlockSeal`]), forks, speculative
//!   lookahead reservations that are never cached, truncation, freeing tail
//!   first; for layers with a sliding window ([`Window`]), the release of
//!   blocks the window has passed, which stay cached until evicted.
//! - [`planner`]: how many blocks, how much context and how many sequences fit
//!   a memory budget, from a model's geometry (read from a GGUF header by
//!   [`gguf`]) and the KV formats.
//!
//! Running out of blocks is not an error: operations return
//! [`NotEnoughBlocks`] and change nothing, and the caller waits, evicts or
//! preempts.
//!
//! ```
//! use siliceo_core::TokenId;
//! use siliceo_kv_paging::{CacheKeys, KvCacheManager, KvConfig};
//!
//! let mut kv = KvCacheManager::new(KvConfig { num_blocks: 8, block_size: 4, ..KvConfig::default() });
//! let keys = CacheKeys::new("smollm2-135m", "f16/f16");
//! let prompt: Vec<TokenId> = (1..=10).map(TokenId).collect();
//!
//! // First request: nothing cached; compute all 10 tokens, then append them.
//! let a = kv.new_sequence(&keys);
//! assert_eq!(kv.match_prefix(a, &prompt).0, 0);
//! kv.append(a, &prompt).unwrap();
//! assert_eq!(kv.block_table(a).len(), 3);
//! kv.free(a);
//!
//! // Second request with the same prompt: two full blocks (8 tokens) are reused.
//! let b = kv.new_sequence(&keys);
//! assert_eq!(kv.match_prefix(b, &prompt).0, 8);
//! kv.append(b, &prompt[8..]).unwrap();
//! assert_eq!(kv.stats().hit_tokens, 8);
//! kv.check().unwrap();
//! ```
//!
//! **Architecture invariant:** no I/O, no async, nothing of llama.cpp. A block
//! is an index; who stores its bytes (llama.cpp cells, a paged store of our
//! own) is the caller's business, told through [`BlockOp`]s when bytes must
//! move or be sealed.
#![deny(missing_docs)]

pub mod block;
pub mod gguf;
mod groups;
mod manager;
pub mod planner;
mod pool;

pub use block::{BlockHash, BlockId, CacheKeys};
pub use groups::KvGroups;
pub use manager::{
    BlockCopy, BlockCount, BlockOp, BlockSeal, CacheStats, KvCacheManager, KvConfig, KvEvent,
    NotEnoughBlocks, Sealing, SeqHandle, Window, WindowedGroup,
};
pub use pool::BlockPool;
