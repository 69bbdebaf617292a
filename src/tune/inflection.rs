//! Inflection points M1 and M2 of one [K, N] shape, from a table of measured times.
//!
//! FlashDecoding++ §4 ("heuristic dataflow with hardware resource adaption") picks among three
//! GEMM implementations by the number of rows M: ImplA (GEMV) for small M, ImplB (flat GEMM)
//! from M1, ImplC (the vendor GEMM) from M2. The paper reads M1 and M2 off measured curves; this
//! module makes that reading a pure, testable rule.
//!
//! # The rule
//! * A challenger **beats** an incumbent at M only if it has a verified time there and
//!   `t_challenger < t_incumbent · (1 − margin)` (margin 2 % by default), or the incumbent has
//!   no verified time at that M. A tie, or a lead inside the margin, is not a win: switching
//!   implementations for a difference below timing noise would make the plan flap between runs.
//! * A crossing is **stable** at grid point M if the challenger beats the incumbent at M and the
//!   incumbent beats the challenger at no larger M of the grid (a lead inside the margin either
//!   way is noise and does not move the crossing). The inflection point is the smallest stable
//!   M; when the curves cross and clearly cross back, the later stable crossing wins. `None`
//!   means "never": the challenger beats the incumbent at no M past the incumbent's last win.
//!   Measured on the H100: requiring a win at *every* larger M let a 1 % flat_gemm lead at
//!   M = 9..13 on QKV push cuBLAS's region from M = 5 up to 14, costing 4 % at M = 5..8.
//! * M1 = stable crossing of B over A.
//! * M2 = stable crossing of C over the incumbent at each M, i.e. over what would run without C:
//!   B where M ≥ M1, A elsewhere. In the usual case (M1 ≤ M2) that is "C over B" as in the paper;
//!   when B never beats A it is "C over A"; when C already beats A below M1 it may give M2 < M1,
//!   and then B is never chosen.
//!
//! A candidate that was unsupported or rejected (wrong result) at some M has no time there and
//! so cannot win at that M. `select` applies the regions in the order C, B, A: C if M ≥ M2, else
//! B if M ≥ M1, else A.

use serde::{Deserialize, Serialize};

/// Default noise margin: a challenger must be at least 2 % faster to count as a win.
pub const DEFAULT_MARGIN: f64 = 0.02;

/// The rule in one line, written into every profile.
pub fn rule_text(margin: f64) -> String {
    format!(
        "X beats Y at M iff t_X < t_Y*(1-{margin}) or Y has no verified time at M; \
         inflection = smallest grid M at which the challenger beats the incumbent and the incumbent beats \
         the challenger at no larger grid M (null = never); M1: flat_gemm over gemv; M2: gemm over (flat_gemm if M >= M1 else gemv); \
         select: gemm if M >= M2, else flat_gemm if M >= M1, else gemv"
    )
}

/// Whether `challenger` beats `incumbent` at one M under the noise margin (see module docs).
pub fn beats(challenger: Option<f64>, incumbent: Option<f64>, margin: f64) -> bool {
    match (challenger, incumbent) {
        (None, _) => false,
        (Some(c), _) if !c.is_finite() => false,
        (Some(_), None) => true,
        (Some(c), Some(i)) if !i.is_finite() => c.is_finite(),
        (Some(c), Some(i)) => c < i * (1.0 - margin),
    }
}

/// The smallest M of `ms` at which `challenger` beats `incumbent` while `incumbent` beats
/// `challenger` at no larger grid M. `challenger[i]` and `incumbent[i]` are the best verified
/// times at `ms[i]` (None = no time); a missing entry counts as None.
pub fn stable_crossing(
    ms: &[usize],
    challenger: &[Option<f64>],
    incumbent: &[Option<f64>],
    margin: f64,
) -> Option<usize> {
    let at = |v: &[Option<f64>], i: usize| v.get(i).copied().flatten();
    let mut first: Option<usize> = None;
    // Walk from the largest M down to the incumbent's last clear win; the lowest challenger win
    // above it is the crossing.
    for i in (0..ms.len()).rev() {
        let (c, inc) = (at(challenger, i), at(incumbent, i));
        if beats(inc, c, margin) {
            break;
        }
        if beats(c, inc, margin) {
            first = Some(ms[i]);
        }
    }
    first
}

/// M1 and M2 of one shape (None = never).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Inflections {
    pub m1: Option<usize>,
    pub m2: Option<usize>,
}

/// M1 (B over A) and M2 (C over the incumbent, B from M1 and A below) from the best verified
/// times of the three implementations at each grid M.
pub fn inflection_points(
    ms: &[usize],
    a: &[Option<f64>],
    b: &[Option<f64>],
    c: &[Option<f64>],
    margin: f64,
) -> Inflections {
    let m1 = stable_crossing(ms, b, a, margin);
    let at = |v: &[Option<f64>], i: usize| v.get(i).copied().flatten();
    let incumbent: Vec<Option<f64>> = ms
        .iter()
        .enumerate()
        .map(|(i, &m)| match m1 {
            Some(m1) if m >= m1 => at(b, i),
            _ => at(a, i),
        })
        .collect();
    let m2 = stable_crossing(ms, c, &incumbent, margin);
    Inflections { m1, m2 }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: [usize; 8] = [1, 2, 4, 8, 16, 32, 64, 128];

    fn s(v: &[f64]) -> Vec<Option<f64>> {
        v.iter().map(|&x| Some(x)).collect()
    }

    #[test]
    fn beats_needs_the_margin() {
        assert!(beats(Some(97.0), Some(100.0), 0.02));
        assert!(!beats(Some(98.5), Some(100.0), 0.02), "inside the margin is noise");
        assert!(
            !beats(Some(98.0), Some(100.0), 0.02),
            "exactly at the margin is not a win"
        );
        assert!(!beats(Some(100.0), Some(100.0), 0.02), "a tie is not a win");
        assert!(
            !beats(Some(100.0), Some(100.0), 0.0),
            "a tie is not a win without margin either"
        );
        assert!(beats(Some(99.9), Some(100.0), 0.0));
        assert!(!beats(Some(120.0), Some(100.0), 0.02));
    }

    #[test]
    fn beats_with_missing_times() {
        assert!(beats(Some(5.0), None, 0.02), "an absent incumbent loses");
        assert!(!beats(None, Some(5.0), 0.02), "an absent challenger never wins");
        assert!(!beats(None, None, 0.02));
        assert!(!beats(Some(f64::NAN), Some(1.0), 0.02));
        assert!(!beats(Some(f64::INFINITY), None, 0.02));
        assert!(beats(Some(1.0), Some(f64::NAN), 0.02));
    }

    #[test]
    fn typical_three_regions() {
        // A flat in M (memory bound), B a little slower at M=1 and flat, C expensive at small M.
        let a = s(&[10.0, 10.5, 11.0, 14.0, 22.0, 40.0, 80.0, 160.0]);
        let b = s(&[12.0, 12.0, 12.0, 12.0, 13.0, 15.0, 30.0, 60.0]);
        let c = s(&[30.0, 30.0, 30.0, 30.0, 30.0, 30.0, 25.0, 40.0]);
        let r = inflection_points(&G, &a, &b, &c, DEFAULT_MARGIN);
        assert_eq!(
            r,
            Inflections {
                m1: Some(8),
                m2: Some(64)
            }
        );
    }

    #[test]
    fn crossing_that_flips_back_is_ignored() {
        // B wins at M=2 only, loses at 4 and 8, wins from 16 on: M1 = 16.
        let a = s(&[10.0, 10.0, 10.0, 10.0, 20.0, 40.0, 80.0, 160.0]);
        let b = s(&[11.0, 9.0, 11.0, 12.0, 15.0, 20.0, 30.0, 50.0]);
        assert_eq!(stable_crossing(&G, &b, &a, DEFAULT_MARGIN), Some(16));
    }

    #[test]
    fn loss_at_the_last_grid_point_means_never() {
        let a = s(&[10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0, 10.0]);
        let b = s(&[11.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 12.0]);
        assert_eq!(stable_crossing(&G, &b, &a, DEFAULT_MARGIN), None);
    }

    #[test]
    fn a_lead_inside_the_margin_after_the_crossing_does_not_move_it() {
        // The H100 QKV case: cuBLAS 2-3 % ahead of flat_gemm from M=4, flat_gemm ~1 % ahead at
        // 16 and 32 (noise), cuBLAS clearly ahead after: C takes over at 4, not at 64.
        let b = s(&[40.0, 40.0, 40.4, 40.8, 41.3, 45.5, 73.0, 119.0]);
        let c = s(&[41.0, 42.0, 39.3, 39.5, 41.8, 45.9, 41.1, 42.4]);
        assert_eq!(stable_crossing(&G, &c, &b, DEFAULT_MARGIN), Some(4));
        // A tie at the largest M is no loss either.
        let a = s(&[10.0; 8]);
        let t = s(&[11.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 10.0]);
        assert_eq!(stable_crossing(&G, &t, &a, DEFAULT_MARGIN), Some(2));
    }

    #[test]
    fn never_wins_gives_none_and_m2_is_c_over_a() {
        let a = s(&[10.0, 10.0, 10.0, 10.0, 20.0, 40.0, 80.0, 160.0]);
        let b = s(&[20.0, 20.0, 20.0, 20.0, 40.0, 80.0, 160.0, 320.0]);
        let c = s(&[50.0, 50.0, 50.0, 50.0, 50.0, 50.0, 50.0, 50.0]);
        let r = inflection_points(&G, &a, &b, &c, DEFAULT_MARGIN);
        assert_eq!(r.m1, None);
        // C beats A (not B) from M=64 on.
        assert_eq!(r.m2, Some(64));
    }

    #[test]
    fn wins_from_the_first_point() {
        let a = s(&[10.0; 8]);
        let b = s(&[5.0; 8]);
        assert_eq!(stable_crossing(&G, &b, &a, DEFAULT_MARGIN), Some(1));
    }

    #[test]
    fn ties_everywhere_mean_never() {
        let a = s(&[10.0; 8]);
        let b = s(&[10.0; 8]);
        let c = s(&[10.0; 8]);
        assert_eq!(
            inflection_points(&G, &a, &b, &c, DEFAULT_MARGIN),
            Inflections::default()
        );
    }

    #[test]
    fn challenger_missing_at_one_m_breaks_the_run() {
        // B is faster everywhere it ran, but was rejected at M=16: it cannot be stable below 32.
        let a = s(&[10.0; 8]);
        let mut b = s(&[5.0; 8]);
        b[4] = None;
        assert_eq!(stable_crossing(&G, &b, &a, DEFAULT_MARGIN), Some(32));
        // Missing at the largest M: never.
        let mut b2 = s(&[5.0; 8]);
        b2[7] = None;
        assert_eq!(stable_crossing(&G, &b2, &a, DEFAULT_MARGIN), None);
    }

    #[test]
    fn incumbent_missing_at_some_m_counts_as_a_win() {
        // A is unsupported from M=32 on (e.g. gemv limited to small M): B takes over there even
        // though it was slower where A ran.
        let mut a = s(&[1.0; 8]);
        a[5] = None;
        a[6] = None;
        a[7] = None;
        let b = s(&[5.0; 8]);
        assert_eq!(stable_crossing(&G, &b, &a, DEFAULT_MARGIN), Some(32));
    }

    #[test]
    fn a_missing_entirely() {
        let a = vec![None; 8];
        let b = s(&[5.0, 5.0, 5.0, 5.0, 6.0, 8.0, 16.0, 32.0]);
        let c = s(&[9.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0]);
        let r = inflection_points(&G, &a, &b, &c, DEFAULT_MARGIN);
        assert_eq!(r.m1, Some(1), "B runs wherever A cannot");
        // C (9) beats B from M=64 (16); at M=32 B (8) is still faster.
        assert_eq!(r.m2, Some(64));
    }

    #[test]
    fn only_c_exists() {
        let none = vec![None; 8];
        let c = s(&[9.0; 8]);
        let r = inflection_points(&G, &none, &none, &c, DEFAULT_MARGIN);
        assert_eq!(r, Inflections { m1: None, m2: Some(1) });
    }

    #[test]
    fn nothing_verified() {
        let none = vec![None; 8];
        assert_eq!(
            inflection_points(&G, &none, &none, &none, DEFAULT_MARGIN),
            Inflections::default()
        );
    }

    #[test]
    fn c_missing_entirely_gives_no_m2() {
        let a = s(&[10.0, 10.0, 10.0, 10.0, 20.0, 40.0, 80.0, 160.0]);
        let b = s(&[12.0, 12.0, 12.0, 9.0, 13.0, 15.0, 30.0, 60.0]);
        let r = inflection_points(&G, &a, &b, &[None; 8], DEFAULT_MARGIN);
        assert_eq!(r, Inflections { m1: Some(8), m2: None });
    }

    #[test]
    fn m2_below_m1_when_c_beats_a_early() {
        // C beats A from M=4; B beats A only from M=16 and loses to C there.
        let a = s(&[10.0, 10.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0]);
        let b = s(&[20.0, 20.0, 40.0, 45.0, 30.0, 30.0, 30.0, 30.0]);
        let c = s(&[25.0, 25.0, 20.0, 20.0, 20.0, 20.0, 20.0, 20.0]);
        let r = inflection_points(&G, &a, &b, &c, DEFAULT_MARGIN);
        assert_eq!(
            r,
            Inflections {
                m1: Some(16),
                m2: Some(4)
            }
        );
    }

    #[test]
    fn m2_is_measured_against_b_above_m1() {
        // C beats A from M=8 but B only from M=64: M2 = 64, not 8.
        let a = s(&[10.0, 10.0, 10.0, 40.0, 80.0, 160.0, 320.0, 640.0]);
        let b = s(&[20.0, 20.0, 20.0, 15.0, 16.0, 17.0, 30.0, 60.0]);
        let c = s(&[40.0, 40.0, 40.0, 20.0, 20.0, 20.0, 20.0, 20.0]);
        let r = inflection_points(&G, &a, &b, &c, DEFAULT_MARGIN);
        assert_eq!(
            r,
            Inflections {
                m1: Some(8),
                m2: Some(64)
            }
        );
    }

    #[test]
    fn margin_decides_a_near_tie() {
        let a = s(&[10.0; 8]);
        let b = s(&[9.9; 8]);
        assert_eq!(stable_crossing(&G, &b, &a, 0.02), None);
        assert_eq!(stable_crossing(&G, &b, &a, 0.0), Some(1));
    }

    #[test]
    fn empty_grid_and_short_columns() {
        assert_eq!(stable_crossing(&[], &[], &[], 0.02), None);
        // A column shorter than the grid counts as missing beyond its end.
        let a = s(&[10.0, 10.0]);
        let b = s(&[5.0; 8]);
        assert_eq!(stable_crossing(&G, &b, &a, 0.02), Some(1));
        assert_eq!(stable_crossing(&G, &a, &b, 0.02), None);
    }

    #[test]
    fn rule_text_names_the_margin() {
        assert!(rule_text(0.02).contains("0.02"));
    }
}
