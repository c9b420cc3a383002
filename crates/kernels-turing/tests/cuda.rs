//! The CUDA kernels against the CPU kernel (feature `cuda`). On a machine with
//! no GPU the device tests say so and pass, unless `SILICEO_REQUIRE_GPU` is
//! set (`cargo xtask test-gpu` sets it), where they fail.
#![cfg(feature = "cuda")]

use std::path::Path;

use siliceo_kernels_turing::cuda::CudaKernels;
use siliceo_kernels_turing::{
    AttnParams, Codec, KernelError, KvLayout, KvStore, SeqKv, SeqQuery, paged_attention,
};

fn device() -> Option<CudaKernels> {
    match CudaKernels::new(0) {
        Ok(k) => Some(k),
        Err(e) if std::env::var_os("SILICEO_REQUIRE_GPU").is_some() => {
            panic!("a GPU is required here: {e}")
        }
        Err(e) => {
            eprintln!("no GPU here, device test skipped: {e}");
            None
        }
    }
}

fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((((i + seed * 7919) * 2_654_435_761) % 4001) as f32 / 2000.0 - 1.0)
                * if i % 29 == 3 { 8.0 } else { 1.0 }
        })
        .collect()
}

#[test]
fn no_driver_or_no_kernels_is_a_typed_error_not_a_panic() {
    let e = CudaKernels::with_dir(0, Path::new("/nonexistent/siliceo-kernels")).unwrap_err();
    assert!(matches!(e, KernelError::Cuda(_)), "{e}");
    eprintln!("{e}");
}

#[test]
fn gpu_decode_matches_the_cpu_kernel() {
    let Some(k) = device() else { return };
    eprintln!(
        "device: {} {:?}, kernels {}",
        k.device_name(),
        k.compute_capability(),
        k.image().display()
    );
    for fmt in ["f16", "kv8", "k5v4"] {
        for d in [64, 128] {
            for (rotate_k, tail_tokens, partition) in
                [(false, 0, 0), (true, 100, 256), (false, 0, 64)]
            {
                let mut layout = KvLayout::preset(fmt, 2, d).unwrap();
                layout.rotate_k = rotate_k;
                layout.tail_tokens = tail_tokens;
                let lens = [1usize, 100, 1000, 64];
                let sealed: usize = lens.iter().map(|l| l.div_ceil(64)).sum();
                let mut store =
                    KvStore::new(layout, sealed, 4 * KvStore::tail_blocks_per_seq(&layout))
                        .unwrap();
                let mut seqs = vec![SeqKv::default(); lens.len()];
                for (i, (s, &len)) in seqs.iter_mut().zip(&lens).enumerate() {
                    store
                        .append(s, &data(len * 2 * d, i), &data(len * 2 * d, i + 50))
                        .unwrap();
                }
                let heads = 8;
                let q = data(lens.len() * heads * d, 99);
                let scale = 1.0 / (d as f32).sqrt();
                let queries: Vec<SeqQuery<'_>> = seqs
                    .iter()
                    .enumerate()
                    .map(|(i, s)| SeqQuery {
                        kv: s,
                        q: &q[i * heads * d..(i + 1) * heads * d],
                        n_q: 1,
                    })
                    .collect();
                let mut want = vec![0f32; q.len()];
                paged_attention(
                    &store,
                    heads,
                    scale,
                    &queries,
                    &mut want,
                    &AttnParams::default(),
                )
                .unwrap();
                let dev = k.upload(&store).unwrap();
                let refs: Vec<&SeqKv> = seqs.iter().collect();
                let got = k.decode(&dev, &refs, &q, heads, scale, partition).unwrap();
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(
                    worst < 2e-3,
                    "{} d={d} partition={partition}: GPU and CPU differ by {worst}",
                    layout.name()
                );
            }
        }
    }
}

#[test]
fn gpu_append_and_seal_quantize_within_the_codec_bounds() {
    let Some(k) = device() else { return };
    for fmt in ["f16", "kv8", "k5v4"] {
        let (heads, d, t) = (2, 128, 64);
        let layout = KvLayout::preset(fmt, heads, d).unwrap();
        let mut dev = k.alloc(layout, 2, 2).unwrap();
        let kx = data(t * heads * d, 1);
        let vx = data(t * heads * d, 2);
        let rows: Vec<i32> = (0..t as i32).collect();
        k.append(&mut dev, &kx, &vx, &vec![1u32; t], &rows).unwrap();
        k.seal(&mut dev, 1, 1).unwrap();
        let (sealed, _) = k.download(&dev).unwrap();
        let block = &sealed[layout.block_bytes()..2 * layout.block_bytes()];
        let (ks, vs) = (layout.k_segment_bytes(), layout.v_segment_bytes());
        for h in 0..heads {
            for (codec, seg, x) in [
                (layout.k, &block[h * (ks + vs)..h * (ks + vs) + ks], &kx),
                (
                    layout.v,
                    &block[h * (ks + vs) + ks..(h + 1) * (ks + vs)],
                    &vx,
                ),
            ] {
                // What was stored in the tail: f16 of the inputs, head h.
                let src: Vec<f32> = (0..t)
                    .flat_map(|r| (0..d).map(move |c| (r, c)))
                    .map(|(r, c)| half::f16::from_f32(x[(r * heads + h) * d + c]).to_f32())
                    .collect();
                let mut got = vec![0f32; t * d];
                codec.decode(seg, t, d, &mut got);
                for r in 0..t {
                    for c in 0..d {
                        let grp: Vec<f32> = match codec {
                            Codec::F16 => vec![src[r * d + c]],
                            Codec::Kv8 { group } | Codec::V4 { group } => {
                                let g = group as usize;
                                src[r * d + c / g * g..r * d + (c / g + 1) * g].to_vec()
                            }
                            Codec::K5 => (0..t).map(|rr| src[rr * d + c]).collect(),
                        };
                        let err = (got[r * d + c] - src[r * d + c]).abs();
                        assert!(
                            err <= codec.error_bound(&grp),
                            "{fmt} {codec:?} head {h} [{r}][{c}]: error {err}"
                        );
                    }
                }
            }
        }
    }
}
