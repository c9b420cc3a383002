//! Paged KV-cache bookkeeping: 64-token blocks, block tables, prefix hash cache with LRU eviction, memory planner.
