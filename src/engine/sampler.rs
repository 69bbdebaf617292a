//! Choosing the next token from the logits: greedy, temperature, top-k, top-p and the
//! repetition penalty, in the order HF transformers applies them (penalty, then temperature,
//! top-k, top-p), with a seeded generator so that a run can be repeated exactly.
//!
//! Pure host code: the logits of a step are a few hundred KB per sequence, and the choice is
//! a sort over them, not worth a kernel at the batch sizes of a decode step.

use crate::error::{FdppError, Result};

/// How to choose tokens. The defaults choose greedily.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct SamplingParams {
    /// Softmax temperature; 0 = greedy.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 = no limit.
    pub top_k: usize,
    /// Keep the fewest most likely tokens whose probabilities add up to at least p; 1 = all.
    pub top_p: f32,
    /// CTRL's penalty on tokens already in the sequence (prompt included): a positive logit is
    /// divided by it, a negative one multiplied; 1 = none.
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(FdppError::InvalidArgument(m));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!(
                "--temperature {} must be 0 (greedy) or a positive number",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("--top-p {} must be in (0, 1]", self.top_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(format!(
                "--repetition-penalty {} must be a positive number (1 = none)",
                self.repetition_penalty
            ));
        }
        Ok(())
    }

    /// Temperature 0 and top-k 1 both leave only the most likely token.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// One sequence's sampler: its own random stream, so that a sequence draws the same tokens
/// whichever batch it runs in.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    state: u64,
}

impl Sampler {
    /// `stream` tells apart the sequences of one run (their index).
    pub fn new(params: SamplingParams, stream: u64) -> Self {
        Sampler {
            params,
            state: mix(params.seed ^ mix(stream.wrapping_add(0x5EED))),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next token given the logits of the last position and the sequence so far.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(FdppError::InvalidArgument("sampler: no logits".into()));
        }
        if let Some(i) = logits.iter().position(|v| v.is_nan()) {
            return Err(FdppError::InvalidArgument(format!(
                "sampler: logit of token {i} is NaN (the forward pass produced a non-number)"
            )));
        }
        let mut l = logits.to_vec();
        let p = self.params;
        if p.repetition_penalty != 1.0 {
            apply_repetition_penalty(&mut l, history, p.repetition_penalty);
        }
        if p.is_greedy() {
            return Ok(argmax(&l) as u32);
        }
        let cands = candidates(&l, p.temperature, p.top_k, p.top_p);
        let total: f64 = cands.iter().map(|c| c.1).sum();
        let u = self.next_unit() * total;
        let mut acc = 0.0;
        for &(id, w) in &cands {
            acc += w;
            if u < acc {
                return Ok(id);
            }
        }
        // Rounding can leave u just past the last sum: the last candidate.
        Ok(cands.last().map_or(0, |c| c.0))
    }

    /// Uniform in [0, 1) from a splitmix64 stream (53 bits).
    fn next_unit(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        (mix(self.state) >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Index of the largest value; the lowest index among equals.
pub fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

fn apply_repetition_penalty(l: &mut [f32], history: &[u32], penalty: f32) {
    let mut seen = vec![false; l.len()];
    for &t in history {
        let i = t as usize;
        if i < l.len() && !seen[i] {
            seen[i] = true;
            l[i] = if l[i] > 0.0 { l[i] / penalty } else { l[i] * penalty };
        }
    }
}

/// (token, unnormalised probability) of the tokens that survive top-k and top-p, most likely
/// first.
fn candidates(l: &[f32], temperature: f32, top_k: usize, top_p: f32) -> Vec<(u32, f64)> {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let t = temperature as f64;
    let weight = |v: f32| ((v as f64 - max as f64) / t).exp();
    let by_logit = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let mut c: Vec<(u32, f64)> = if top_k > 0 && top_k < l.len() {
        let mut all: Vec<(u32, f64)> = l.iter().enumerate().map(|(i, &v)| (i as u32, v as f64)).collect();
        all.select_nth_unstable_by(top_k - 1, by_logit);
        all.truncate(top_k);
        all.into_iter().map(|(i, v)| (i, weight(v as f32))).collect()
    } else if top_p < 1.0 {
        // Only tokens of probability ≥ (1 − p) / V can be needed: the others together hold
        // less than 1 − p. Sorting those alone keeps a 128k vocabulary cheap when the
        // distribution is peaked; the result is the same as a full sort.
        let w: Vec<f64> = l.iter().map(|&v| weight(v)).collect();
        let z: f64 = w.iter().sum();
        let floor = (1.0 - top_p as f64) / l.len() as f64 * z;
        w.iter()
            .enumerate()
            .filter(|(_, &x)| x >= floor)
            .map(|(i, &x)| (i as u32, x))
            .collect()
    } else {
        l.iter().enumerate().map(|(i, &v)| (i as u32, weight(v))).collect()
    };
    if top_p < 1.0 {
        c.sort_unstable_by(by_logit);
        let z: f64 = c.iter().map(|x| x.1).sum();
        let mut acc = 0.0;
        let mut keep = c.len();
        for (n, x) in c.iter().enumerate() {
            acc += x.1;
            if acc >= top_p as f64 * z {
                keep = n + 1;
                break;
            }
        }
        c.truncate(keep.max(1));
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            repetition_penalty: 1.0,
            seed: 42,
        }
    }

    /// Frequencies of each token over `n` draws.
    fn freqs(p: SamplingParams, logits: &[f32], n: usize) -> Vec<f64> {
        let mut s = Sampler::new(p, 0);
        let mut counts = vec![0usize; logits.len()];
        for _ in 0..n {
            counts[s.sample(logits, &[]).expect("sample") as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / n as f64).collect()
    }

    fn ln(ps: &[f64]) -> Vec<f32> {
        ps.iter().map(|p| p.ln() as f32).collect()
    }

    #[test]
    fn greedy_takes_the_largest_and_the_lowest_index_on_ties() {
        let mut s = Sampler::new(SamplingParams::default(), 0);
        assert_eq!(s.sample(&[0.1, 3.0, -2.0, 3.0], &[]).expect("greedy"), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, -1.0]), 1);
    }

    #[test]
    fn temperature_zero_and_top_k_one_are_greedy() {
        let logits = [0.5, 0.4, 0.45, 0.1];
        for p in [params(0.0, 0, 0.3), params(1.0, 1, 1.0), params(5.0, 1, 0.9)] {
            assert!(p.is_greedy());
            let f = freqs(p, &logits, 200);
            assert_eq!(f[0], 1.0, "{p:?}: {f:?}");
        }
    }

    #[test]
    fn temperature_one_draws_the_softmax_distribution() {
        let want = [0.5, 0.3, 0.2];
        let f = freqs(params(1.0, 0, 1.0), &ln(&want), 20_000);
        for (g, w) in f.iter().zip(want) {
            assert!((g - w).abs() < 0.015, "{f:?}");
        }
    }

    #[test]
    fn a_high_temperature_flattens_and_a_low_one_sharpens() {
        let logits = ln(&[0.5, 0.3, 0.2]);
        let flat = freqs(params(100.0, 0, 1.0), &logits, 20_000);
        assert!(flat.iter().all(|f| (f - 1.0 / 3.0).abs() < 0.02), "{flat:?}");
        // T = 0.5 squares the probabilities: 25:9:4 of 38.
        let sharp = freqs(params(0.5, 0, 1.0), &logits, 20_000);
        for (g, w) in sharp.iter().zip([25.0 / 38.0, 9.0 / 38.0, 4.0 / 38.0]) {
            assert!((g - w).abs() < 0.015, "{sharp:?}");
        }
    }

    #[test]
    fn top_k_keeps_the_k_most_likely_renormalised() {
        let f = freqs(params(1.0, 2, 1.0), &ln(&[0.2, 0.5, 0.3]), 20_000);
        assert_eq!(f[0], 0.0, "{f:?}");
        assert!((f[1] - 0.625).abs() < 0.015 && (f[2] - 0.375).abs() < 0.015, "{f:?}");
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        let logits = ln(&[0.5, 0.3, 0.15, 0.05]);
        // 0.5 < 0.6 ≤ 0.8: tokens 0 and 1, renormalised to 0.625 / 0.375.
        let f = freqs(params(1.0, 0, 0.6), &logits, 20_000);
        assert_eq!(f[2] + f[3], 0.0, "{f:?}");
        assert!((f[0] - 0.625).abs() < 0.015, "{f:?}");
        // 0.45 is reached by the first token alone.
        let f = freqs(params(1.0, 0, 0.45), &logits, 500);
        assert_eq!(f[0], 1.0, "{f:?}");
        // Top-p after top-k: k = 3 renormalises to 0.526/0.316/0.158, so p = 0.85 needs all
        // three (0.842 after two); the fourth was cut by top-k.
        let f = freqs(params(1.0, 3, 0.85), &logits, 20_000);
        assert_eq!(f[3], 0.0, "{f:?}");
        assert!(f[2] > 0.12, "{f:?}");
    }

    #[test]
    fn top_p_prefilter_matches_a_flat_distribution() {
        // Near-uniform over 1000 tokens: p = 0.5 keeps about half of them.
        let logits: Vec<f32> = (0..1000).map(|i| (i as f32) * 1e-4).collect();
        let f = freqs(params(1.0, 0, 0.5), &logits, 20_000);
        let used = f.iter().filter(|&&x| x > 0.0).count();
        assert!((400..=501).contains(&used), "{used}");
        assert!(
            f[..495].iter().all(|&x| x == 0.0),
            "the least likely half is never drawn"
        );
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(p, 0);
        // Token 0 (2.0) was seen: 1.0 < 1.9, so token 1 wins.
        assert_eq!(s.sample(&[2.0, 1.9, -1.0], &[0, 0]).expect("s"), 1);
        // Negative logits move away from zero: −0.5 seen becomes −1.0 < −0.8.
        assert_eq!(s.sample(&[-0.5, -0.8, -3.0], &[0]).expect("s"), 1);
        // Ids outside the vocabulary in the history are ignored.
        assert_eq!(s.sample(&[1.0, 0.0], &[7]).expect("s"), 0);
    }

    #[test]
    fn seeds_repeat_and_streams_differ() {
        let logits = vec![0.0f32; 50];
        let draw = |seed: u64, stream: u64| {
            let mut s = Sampler::new(
                SamplingParams {
                    seed,
                    ..params(1.0, 0, 1.0)
                },
                stream,
            );
            (0..20).map(|_| s.sample(&logits, &[]).expect("s")).collect::<Vec<_>>()
        };
        assert_eq!(draw(1, 0), draw(1, 0));
        assert_ne!(draw(1, 0), draw(2, 0));
        assert_ne!(draw(1, 0), draw(1, 1));
    }

    #[test]
    fn bad_params_and_nan_logits_are_refused() {
        assert!(params(-1.0, 0, 1.0).validate().is_err());
        assert!(params(1.0, 0, 0.0).validate().is_err());
        assert!(params(1.0, 0, 1.5).validate().is_err());
        let p = SamplingParams {
            repetition_penalty: 0.0,
            ..SamplingParams::default()
        };
        assert!(p.validate().is_err());
        params(0.7, 40, 0.9).validate().expect("valid");
        let e = Sampler::new(SamplingParams::default(), 0)
            .sample(&[0.0, f32::NAN], &[])
            .expect_err("NaN");
        assert!(e.to_string().contains("token 1 is NaN"), "{e}");
        assert!(Sampler::new(SamplingParams::default(), 0).sample(&[], &[]).is_err());
    }
}
