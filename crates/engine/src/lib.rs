//! llama.cpp through llama-cpp-2: models, contexts, batched decode, sequence KV operations, sampling.
