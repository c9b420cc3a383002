//! The serving loop: owns the engine, drives scheduler, kv-paging and speculative decoding.
