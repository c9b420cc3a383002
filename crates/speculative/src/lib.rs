//! Speculative decoding: drafters, verification and acceptance rules.
