//! The rotary inverse frequencies, computed once on the host from rope_theta and rope_scaling
//! (the kernels receive the D/2 values; see [`crate::ops::layer::RopeParams`]).

use crate::model::config::RopeScaling;

/// inv_freq[i] = theta^(−2i/D), then stretched as `scaling` says. Computed in f64, as HF does in
/// fp32 from an int64 arange: the values of the two agree to fp32 rounding.
pub fn inv_freq(head_dim: usize, theta: f64, scaling: Option<&RopeScaling>) -> Vec<f32> {
    let half = head_dim / 2;
    let base: Vec<f64> = (0..half)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
        .collect();
    let scaled: Vec<f64> = match scaling {
        None => base,
        Some(RopeScaling::Linear { factor }) => base.iter().map(|f| f / factor).collect(),
        Some(&RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let old = original_max_position_embeddings as f64;
            // Wavelengths longer than old/low are stretched fully, shorter than old/high are
            // kept (they resolve positions inside the trained context), and the band between
            // is blended linearly in old/wavelength.
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    };
    scaled.into_iter().map(|f| f as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f64) -> bool {
        ((a as f64) - b).abs() <= 1e-6 * b.abs()
    }

    #[test]
    fn unscaled_frequencies_are_powers_of_theta() {
        // D = 8, theta = 10000: 10000^(-0/8, -2/8, -4/8, -6/8) = 1, 0.1, 0.01, 0.001.
        let f = inv_freq(8, 10000.0, None);
        for (got, want) in f.iter().zip([1.0, 0.1, 0.01, 0.001]) {
            assert!(close(*got, want), "{f:?}");
        }
    }

    #[test]
    fn linear_scaling_divides_every_frequency() {
        let f = inv_freq(8, 10000.0, Some(&RopeScaling::Linear { factor: 4.0 }));
        for (got, want) in f.iter().zip([0.25, 0.025, 0.0025, 0.00025]) {
            assert!(close(*got, want), "{f:?}");
        }
    }

    #[test]
    fn llama3_scaling_keeps_short_stretches_long_and_blends_between() {
        // old = 1000, low = 1, high = 4: wavelengths below 250 kept, above 1000 divided by 8.
        // Wavelengths 2π/f: 6.28 and 62.8 (kept), 628.3 (blended), 6283 (stretched).
        // Blend at f = 0.01: smooth = (1000 / (200π) − 1) / 3 = 0.1971831…;
        // (1 − smooth) · 0.01 / 8 + smooth · 0.01 = 0.002975353…
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 1000,
        };
        let f = inv_freq(8, 10000.0, Some(&s));
        for (got, want) in f.iter().zip([1.0, 0.1, 0.002_975_353, 0.000_125]) {
            assert!(close(*got, want), "{f:?}");
        }
    }
}
