//! The gRPC server of siliceo-infer; the only crate that knows the proto.
