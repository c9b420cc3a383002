//! Rejection sampling keeps the target distribution: a chi-square test over
//! many seeded draws cannot tell accepted tokens from sampling the target.

use siliceo_core::{TokenId, sampler::Rng};
use siliceo_speculative::{Distribution, verify_greedy, verify_sampled};

fn dist(ps: &[f32]) -> Vec<(TokenId, f32)> {
    let s: f32 = ps.iter().sum();
    ps.iter()
        .enumerate()
        .map(|(i, p)| (TokenId(i as u32), p / s))
        .collect()
}

fn draw(d: &Distribution, u: f64) -> TokenId {
    let mut acc = 0.0;
    for &(t, p) in d {
        acc += f64::from(p);
        if u < acc {
            return t;
        }
    }
    d.last().unwrap().0
}

/// Pearson's chi-square statistic of `counts` against probabilities `p`.
fn chi_square(counts: &[u64], p: &Distribution) -> f64 {
    let n: u64 = counts.iter().sum();
    counts
        .iter()
        .zip(p)
        .filter(|(_, (_, pi))| *pi > 0.0)
        .map(|(&c, (_, pi))| {
            let e = n as f64 * f64::from(*pi);
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

/// Critical value of chi-square with 7 degrees of freedom at α = 0.001.
const CHI2_7_999: f64 = 24.32;

/// First emitted token of one speculative step with a one-token draft from `q`.
fn first_token(q: &Distribution, p0: &Distribution, p1: &Distribution, rng: &mut Rng) -> TokenId {
    let x = draw(q, rng.next_f64());
    let v = verify_sampled(&[x], &[q], &[p0, p1], &mut || rng.next_f64());
    if v.accepted == 1 { x } else { v.next }
}

#[test]
fn rejection_sampling_follows_the_target_distribution() {
    let p = dist(&[30.0, 5.0, 20.0, 1.0, 14.0, 10.0, 8.0, 12.0]);
    // A draft that disagrees a lot: favours tokens 1 and 3, which p dislikes.
    let q = dist(&[5.0, 30.0, 10.0, 20.0, 5.0, 10.0, 10.0, 10.0]);
    let bonus = dist(&[1.0; 8]);
    let mut rng = Rng::new(7);
    let n = 200_000;
    let mut counts = [0u64; 8];
    let mut naive = [0u64; 8];
    for _ in 0..n {
        counts[first_token(&q, &p, &bonus, &mut rng).0 as usize] += 1;
        naive[draw(&q, rng.next_f64()).0 as usize] += 1;
    }
    let stat = chi_square(&counts, &p);
    assert!(
        stat < CHI2_7_999,
        "accepted tokens differ from the target: chi2 = {stat}"
    );
    // The test has power: keeping every drafted token is told apart at once.
    let naive_stat = chi_square(&naive, &p);
    assert!(
        naive_stat > 100.0 * CHI2_7_999,
        "chi2 of the draft itself = {naive_stat}"
    );
}

#[test]
fn rejection_sampling_over_several_positions_keeps_each_position_exact() {
    // Three drafted tokens; the second emitted token's distribution, given the
    // first was a particular token, must be the target's at that position.
    let p0 = dist(&[10.0, 40.0, 10.0, 10.0, 10.0, 10.0, 5.0, 5.0]);
    let p1 = dist(&[3.0, 3.0, 30.0, 20.0, 20.0, 10.0, 10.0, 4.0]);
    let p2 = dist(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    let p3 = dist(&[8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]);
    let q0 = dist(&[10.0, 20.0, 30.0, 10.0, 10.0, 10.0, 5.0, 5.0]);
    let q1 = dist(&[20.0, 10.0, 10.0, 10.0, 10.0, 10.0, 20.0, 10.0]);
    let q2 = dist(&[1.0; 8]);
    let mut rng = Rng::new(11);
    let mut second = [0u64; 8];
    let mut runs = 0;
    while runs < 100_000 {
        let d = [
            draw(&q0, rng.next_f64()),
            draw(&q1, rng.next_f64()),
            draw(&q2, rng.next_f64()),
        ];
        let v = verify_sampled(&d, &[&q0, &q1, &q2], &[&p0, &p1, &p2, &p3], &mut || {
            rng.next_f64()
        });
        let mut out: Vec<TokenId> = d[..v.accepted].to_vec();
        out.push(v.next);
        // Within a step, the token at position 1 exists when the drafted token
        // at position 0 was kept; given that, it must still follow p1 (the draft
        // at position 1 and its uniforms are independent of position 0).
        if out.len() >= 2 && out[0] == TokenId(1) {
            second[out[1].0 as usize] += 1;
            runs += 1;
        }
    }
    let stat = chi_square(&second, &p1);
    assert!(
        stat < CHI2_7_999,
        "second tokens differ from the target: chi2 = {stat}"
    );
}

#[test]
fn greedy_verification_keeps_the_agreeing_prefix() {
    let t = |v: &[u32]| v.iter().map(|&x| TokenId(x)).collect::<Vec<_>>();
    assert_eq!(verify_greedy(&t(&[1, 2, 3]), &t(&[1, 2, 3, 4])).accepted, 3);
    assert_eq!(
        verify_greedy(&t(&[1, 2, 3]), &t(&[1, 2, 3, 4])).next,
        TokenId(4)
    );
    let v = verify_greedy(&t(&[1, 9, 3]), &t(&[1, 2, 3, 4]));
    assert_eq!((v.accepted, v.next), (1, TokenId(2)));
    let v = verify_greedy(&t(&[]), &t(&[5]));
    assert_eq!((v.accepted, v.next), (0, TokenId(5)));
}
