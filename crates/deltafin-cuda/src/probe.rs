//! The check a GPU passes before it computes anything: a few small products of every kind the
//! backend runs (BF16 and MXFP4, few rows and many, subnormal scales) and SiTU over special and
//! boundary values, each compared bit for bit with the CPU's. A GPU, driver or compiler that does
//! not give the CPU's bits is refused when it opens, naming the first difference, instead of
//! giving wrong tokens later. It takes milliseconds.

use deltafin_core::{dot_bf16, dot_mxfp4, permute_for_mxfp4, situ, Isa};

use crate::{Gpu, GpuError, Result};

/// A small deterministic generator (xorshift) of full-mantissa values in [-1, 1), for checks.
pub struct Values(pub u64);
impl Values {
    /// The next 64 random bits.
    pub fn bits(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// A value in [-1, 1) with a full mantissa: every product and sum rounds.
    pub fn unit(&mut self) -> f32 {
        (self.bits() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

fn differ(a: f32, b: f32) -> bool {
    a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan())
}

fn mismatch(what: String) -> GpuError {
    GpuError::Mismatch(format!("{what}; this GPU, driver or NVRTC does not give the CPU's bits (use `--backend cpu`, and report it)"))
}

/// Values SiTU must agree on, at least `n` of them: the special ones, powers of two and their
/// neighbours, 64 values either side of tanh's switch and exp's clamps, then random values of
/// every sign and of exponents from 2^-20 to 2^9 (the probe takes 4,096, `deltafin-gpu-check`
/// two million).
pub fn situ_inputs(n: usize) -> Vec<f32> {
    let mut v = vec![0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MIN_POSITIVE, f32::MAX, f32::MIN, 1e-45, -1e-45];
    for e in -30..=30 {
        let x = 2f32.powi(e);
        v.extend([x, -x, f32::from_bits(x.to_bits() + 1), -f32::from_bits(x.to_bits() - 1)]);
    }
    for c in [0.75f32, 88.72, 89.0, 103.97, 104.0] {
        for d in -64i32..=64 {
            let x = f32::from_bits((c.to_bits() as i32 + d) as u32);
            v.extend([x, -x]);
        }
    }
    let mut rng = Values(77);
    while v.len() < n {
        // Sign, exponent in [2^-20, 2^9], full mantissa.
        let bits = ((rng.bits() as u32) & 0x807f_ffff) | (((107 + rng.bits() % 30) as u32) << 23);
        v.push(f32::from_bits(bits));
    }
    v
}

/// Runs the probe on `gpu`.
pub fn probe(gpu: &Gpu) -> Result<()> {
    let isa = Isa::best();
    let mut v = Values(0x5eed);
    // BF16: the few-row kernel (K a multiple of 128) and the lane GEMM.
    let (rows, cols) = (24, 256);
    let w: Vec<u8> = (0..rows * cols).flat_map(|_| ((v.unit().to_bits() >> 16) as u16).to_le_bytes()).collect();
    let gw = gpu.upload_bf16(rows, cols, &w)?;
    for tokens in [1, 3, 40] {
        let x: Vec<f32> = (0..tokens * cols).map(|_| v.unit()).collect();
        let got = gpu.matmul_host(&x, tokens, &gw)?;
        for t in 0..tokens {
            for r in 0..rows {
                let want = dot_bf16(isa, &x[t * cols..(t + 1) * cols], &w[r * cols * 2..(r + 1) * cols * 2]);
                if differ(got[t * rows + r], want) {
                    return Err(mismatch(format!(
                        "BF16 product ({tokens} rows), value ({t}, {r}): GPU {:e}, CPU {want:e}",
                        got[t * rows + r]
                    )));
                }
            }
        }
    }
    // MXFP4 as experts arrive (permuted on the GPU), scales down to the subnormal 2^-127.
    let (rows, cols) = (16, 512);
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| v.bits() as u8).collect();
    let scales: Vec<u8> = (0..rows * cols / 32).map(|i| if i % 5 == 0 { (i % 3) as u8 } else { 118 + (v.bits() % 12) as u8 }).collect();
    let gw = gpu.upload_mxfp4_raw(rows, cols, &packed, &scales)?;
    for tokens in [1, 5, 33] {
        let x: Vec<f32> = (0..tokens * cols).map(|_| v.unit()).collect();
        let got = gpu.matmul_host(&x, tokens, &gw)?;
        for t in 0..tokens {
            let xp = permute_for_mxfp4(&x[t * cols..(t + 1) * cols]);
            for r in 0..rows {
                let want = dot_mxfp4(isa, &xp, &packed[r * cols / 2..(r + 1) * cols / 2], &scales[r * cols / 32..(r + 1) * cols / 32]);
                if differ(got[t * rows + r], want) {
                    return Err(mismatch(format!(
                        "MXFP4 product ({tokens} rows), value ({t}, {r}): GPU {:e}, CPU {want:e}",
                        got[t * rows + r]
                    )));
                }
            }
        }
    }
    // SiTU: zeros, infinities, NaN, subnormals, powers of two, tanh's switch at 0.75, exp's
    // clamps, and random values.
    let gate = situ_inputs(4096);
    let up: Vec<f32> = gate.iter().rev().map(|g| g * 3.0).collect();
    let stream = gpu.stream();
    let mut ud = stream.clone_htod(&up)?;
    let gd = stream.clone_htod(&gate)?;
    for (beta, lin) in [(4.0f32, 25.0f32), (1.0, 1.0)] {
        stream.memcpy_htod(&up, &mut ud)?;
        gpu.situ(&mut ud.as_view_mut(), &gd.as_view(), beta, lin)?;
        let got = stream.clone_dtoh(&ud)?;
        for i in 0..up.len() {
            let want = situ(up[i], gate[i], beta, lin);
            if differ(got[i], want) {
                return Err(mismatch(format!("SiTU({:e}, {:e}): GPU {:e}, CPU {want:e}", up[i], gate[i], got[i])));
            }
        }
    }
    Ok(())
}
