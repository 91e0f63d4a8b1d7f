//! `exp` and `tanh` of our own, from IEEE adds, multiplies and divides only.
//!
//! The platform's libm differs between glibc, macOS and musl (and between versions), and its
//! calls are scalar: SiTU alone was ~11% of an in-RAM 512-token prefill in libm's `tanhf` and
//! `expm1f` (a hand `perf` run). These definitions use no fused multiply-add and no library call, so the same bits
//! come out of the scalar code on any CPU and of the loops the compiler vectorizes (each lane
//! does the scalar's operations in the scalar's order; Rust never contracts `a * b + c`).
//!
//! Accuracy, measured by the tests against F64: `exp` within 1 ulp over its normal range,
//! `tanh` within 1.1 ulp everywhere (glibc documents 2 ulp for `tanhf`). The polynomials are
//! weighted least-squares fits (iterated toward minimax) made for this file.

/// `1.5 * 2^23`: adding it rounds an F32 in `(-2^22, 2^22)` to an integer, ties to even, and
/// leaves that integer in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split so that `n * LN2_HI` is exact for every `|n| < 2^15`: `LN2_HI` is 355/512 (9
/// significant bits), written with the digits that round to it.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// `exp(r) = 1 + r + r^2 * P(r)` on `|r| <= ln(2) / 2`, coefficients of `P` from `r^0`.
const EXP_P: [f32; 5] = [0.499_999_94, 0.166_665_09, 0.041_668_53, 0.008_370_141, 0.001_381_164_9];
/// Below this `|x|`, `tanh x = x + x^3 * Q(x^2)`; above, `1 - 2 / (e^(2|x|) + 1)`.
const TANH_SMALL: f32 = 0.75;
const TANH_Q: [f32; 7] = [-0.333_333_3, 0.133_332_77, -0.053_959_582, 0.021_804_366, -0.008_596_675, 0.002_969_727_6, -0.000_632_814_95];

/// Every constant [`exp`] and [`tanh`] use, by name, for a backend that runs the same operations
/// elsewhere (the CUDA kernels are compiled with these bits, so both sides share one source).
pub const CONSTANTS: &[(&str, f32)] = &[
    ("ROUND", ROUND),
    ("LOG2E", LOG2E),
    ("LN2_HI", LN2_HI),
    ("LN2_LO", LN2_LO),
    ("EXP_P0", EXP_P[0]),
    ("EXP_P1", EXP_P[1]),
    ("EXP_P2", EXP_P[2]),
    ("EXP_P3", EXP_P[3]),
    ("EXP_P4", EXP_P[4]),
    ("TANH_SMALL", TANH_SMALL),
    ("TANH_Q0", TANH_Q[0]),
    ("TANH_Q1", TANH_Q[1]),
    ("TANH_Q2", TANH_Q[2]),
    ("TANH_Q3", TANH_Q[3]),
    ("TANH_Q4", TANH_Q[4]),
    ("TANH_Q5", TANH_Q[5]),
    ("TANH_Q6", TANH_Q[6]),
];

/// `e^x`, NaN for NaN, `+inf` above ~88.72, `0` below ~-103.97, subnormals rounded once.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // Past these, the result is already +inf or 0; clamping keeps `n` small (`clamp` passes NaN
    // through, which poisons `y`).
    let x = x.clamp(-104.0, 89.0);
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    // x - n ln2 with `n * LN2_HI` exact and the subtraction nearly so (Cody and Waite).
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = EXP_P[4];
    for c in EXP_P[..4].iter().rev() {
        p = p * r + c;
    }
    let y = (r * r) * p + r + 1.0;
    // 2^n in two halves, each a normal F32 for n in [-150, 129]: `y * 2^n1` is exact and the
    // second multiply rounds once, into the subnormals or to infinity where the result lies.
    let ni = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let n1 = ni >> 1;
    let n2 = ni.wrapping_sub(n1);
    let s1 = f32::from_bits((n1.wrapping_add(127) as u32) << 23);
    let s2 = f32::from_bits((n2.wrapping_add(127) as u32) << 23);
    y * s1 * s2
}

/// `tanh x`, odd, `±1` for large `|x|`, NaN for NaN.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let mut q = TANH_Q[6];
    for c in TANH_Q[..6].iter().rev() {
        q = q * z + c;
    }
    let small = (a * z) * q + a;
    // Both sides are computed so the choice is a select the compiler can vectorize.
    let big = 1.0 - 2.0 / (exp(a + a) + 1.0);
    // On |x| the sign comes last, so tanh(-0) is -0.
    (if a < TANH_SMALL { small } else { big }).copysign(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance from `got` to the F64 `want`, in units of the last place of `want` as an F32.
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        let ulp = (f32::from_bits(w.abs().to_bits() + 1) - w.abs()) as f64;
        (got as f64 - want).abs() / ulp
    }

    /// Every 61st F32 bit pattern in `[lo, hi]` (tens of millions of values, both signs).
    fn sweep(lo: f32, hi: f32, mut f: impl FnMut(f32)) {
        for sign in [0u32, 0x8000_0000] {
            let mut b = 0u32;
            while b < 0x7f80_0000 {
                let x = f32::from_bits(b | sign);
                if x >= lo && x <= hi {
                    f(x);
                }
                b += 61;
            }
        }
    }

    #[test]
    fn exp_within_one_ulp_over_its_normal_range() {
        let mut worst = (0f64, 0f32);
        sweep(-87.3, 88.7, |x| {
            let e = ulps(exp(x), (x as f64).exp());
            if e > worst.0 {
                worst = (e, x);
            }
        });
        assert!(worst.0 <= 1.0, "exp({}) is {} ulp off", worst.1, worst.0);
    }

    #[test]
    fn tanh_within_one_and_a_tenth_ulp() {
        let mut worst = (0f64, 0f32);
        sweep(-12.0, 12.0, |x| {
            let want = (x as f64).tanh();
            // Below 2^-126 the result is the subnormal input itself.
            let e = if want.abs() < 1e-37 { ulps(tanh(x), want).min(((tanh(x) - x) as f64).abs()) } else { ulps(tanh(x), want) };
            if e > worst.0 {
                worst = (e, x);
            }
        });
        assert!(worst.0 <= 1.1, "tanh({}) is {} ulp off", worst.1, worst.0);
    }

    #[test]
    fn edges_are_ieee() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(88.8), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-104.5), 0.0);
        assert_eq!(exp(-103.0), (-103f64).exp() as f32, "subnormal results round once");
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(tanh(0.0).to_bits(), 0);
        assert_eq!(tanh(-0.0).to_bits(), (-0f32).to_bits());
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(f32::NEG_INFINITY), -1.0);
        assert_eq!(tanh(-30.0), -1.0);
        assert_eq!(tanh(1e-30), 1e-30);
        assert!(tanh(f32::NAN).is_nan());
    }
}
