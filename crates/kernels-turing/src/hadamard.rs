//! The normalised Walsh–Hadamard transform, applied per head to K (when
//! stored) and to Q (at attention time). It is orthonormal and its own
//! inverse, so `q·k = (Hq)·(Hk)`, and it spreads an outlier channel's energy
//! over all channels before quantization.

/// Applies the normalised Walsh–Hadamard transform to `x` in place.
/// `x.len()` must be a power of two (checked by [`crate::KvLayout::check`]).
pub fn hadamard(x: &mut [f32]) {
    let n = x.len();
    assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (a, b) = block.split_at_mut(h);
            for (a, b) in a.iter_mut().zip(b.iter_mut()) {
                let (u, v) = (*a, *b);
                *a = u + v;
                *b = u - v;
            }
        }
        h *= 2;
    }
    let norm = 1.0 / (n as f32).sqrt();
    for v in x.iter_mut() {
        *v *= norm;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hadamard_is_orthonormal_and_self_inverse() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 17) as f32 - 8.0) / 3.0)
            .collect();
        let mut y = x.clone();
        hadamard(&mut y);
        let n2 = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((n2(&x) - n2(&y)).abs() < 1e-3 * n2(&x));
        assert_ne!(x, y);
        hadamard(&mut y);
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        // An outlier in one channel is spread evenly.
        let mut spike = vec![0f32; 128];
        spike[5] = 100.0;
        hadamard(&mut spike);
        assert!(
            spike
                .iter()
                .all(|v| (v.abs() - 100.0 / 128f32.sqrt()).abs() < 1e-3)
        );
    }
}
