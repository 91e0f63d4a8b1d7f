//! The backend's own operations against the CPU's: SiTU (core's `exp`/`tanh` on the GPU) over
//! special and random values, and whole experts (`CudaBackend::expert_forward`: upload as stored,
//! permutation on the GPU, three products, SiTU) at K3's expert shape, 1 to 300 token rows.

use deltafin_core::{situ, Backend, Cpu, ExpertId, ExpertLayout, ExpertShape, K3Config, Mat};
use deltafin_cuda::{CudaBackend, Gpu};

use super::{same, Rng};

/// One row of the report: what, values compared, values that differ.
pub type Line = (String, usize, usize);

/// Values SiTU must agree on: the special ones, every sign and magnitude's boundaries, and
/// random values spread over the exponents.
fn situ_inputs(n: usize) -> Vec<f32> {
    let mut v =
        vec![0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, f32::MIN_POSITIVE, f32::MAX, f32::MIN, 1e-45, -1e-45, 0.75, -0.75];
    for e in -30..=30 {
        let x = 2f32.powi(e);
        v.extend([x, -x, f32::from_bits(x.to_bits() + 1), -f32::from_bits(x.to_bits() - 1)]);
    }
    // Around tanh's switch and exp's clamps.
    for c in [0.75f32, 88.72, 89.0, 103.97, 104.0] {
        for d in -64i32..=64 {
            let x = f32::from_bits((c.to_bits() as i32 + d) as u32);
            v.extend([x, -x]);
        }
    }
    let mut rng = Rng(77);
    while v.len() < n {
        // Sign, exponent in [2^-20, 2^9], full mantissa.
        let bits = ((rng.bits() as u32) & 0x807f_ffff) | (((107 + rng.bits() % 30) as u32) << 23);
        v.push(f32::from_bits(bits));
    }
    v
}

pub fn situ_check(gpu: &Gpu) -> Vec<Line> {
    let gate = situ_inputs(2_000_000);
    let up: Vec<f32> = gate.iter().rev().copied().collect();
    let mut lines = Vec::new();
    for (beta, lin) in [(4.0f32, 25.0f32), (2.5, 4.0), (1.0, 1.0)] {
        let stream = gpu.stream();
        let mut ud = stream.clone_htod(&up).expect("upload");
        let gd = stream.clone_htod(&gate).expect("upload");
        gpu.situ(&mut ud.as_view_mut(), &gd.as_view(), beta, lin).expect("situ");
        let got = stream.clone_dtoh(&ud).expect("download");
        let mut bad = 0;
        for i in 0..up.len() {
            let want = situ(up[i], gate[i], beta, lin);
            if !same(got[i], want) {
                if bad < 3 {
                    eprintln!("  situ({:e}, {:e}; {beta}, {lin}): GPU {:e}, CPU {want:e}", up[i], gate[i], got[i]);
                }
                bad += 1;
            }
        }
        lines.push((format!("SiTU, beta {beta}, linear beta {lin} (specials, boundaries, random)"), up.len(), bad));
    }
    lines
}

/// A random expert at K3's shape as stored (six records, contiguous), scales around 2^-4.
fn expert_bytes(shape: ExpertShape, seed: u64) -> (ExpertLayout, Vec<u8>) {
    let (pb, sb) = (shape.packed_bytes(), shape.scale_bytes());
    let mut offsets = [0; 6];
    let mut at = 0;
    for (i, o) in offsets.iter_mut().enumerate() {
        *o = at;
        at += if i % 2 == 0 { pb } else { sb };
    }
    let mut rng = Rng(seed | 1);
    let mut bytes: Vec<u8> = (0..at).map(|_| rng.bits() as u8).collect();
    for i in [1, 3, 5] {
        for b in &mut bytes[offsets[i]..offsets[i] + sb] {
            *b = 120 + *b % 6;
        }
    }
    (ExpertLayout { offsets, shape }, bytes)
}

pub fn expert_check(backend: &CudaBackend) -> Vec<Line> {
    let cfg =
        K3Config::from_json(include_str!("../../../../../tests/fixtures/tiny-k3-dev/checkpoint/config.json")).expect("fixture config");
    let shape = ExpertShape { inter: 3072, latent: 3584, group: 32 };
    let cpu = Cpu::best();
    let mut lines = Vec::new();
    for (i, tokens) in [1usize, 4, 9, 64, 300].into_iter().enumerate() {
        let (layout, bytes) = expert_bytes(shape, 500 + i as u64);
        let mut rng = Rng(900 + i as u64);
        let z = Mat::from_vec(tokens, shape.latent, (0..tokens * shape.latent).map(|_| rng.unit()).collect());
        let id = ExpertId { layer: 1, expert: i as u32 };
        let want = cpu.expert_forward(&cfg, id, &layout, &bytes, &z).expect("cpu expert");
        // Twice: uploaded, then kept on the GPU.
        for pass in ["uploaded", "kept"] {
            let got = backend.expert_forward(&cfg, id, &layout, &bytes, &z).expect("gpu expert");
            let bad = want.data.iter().zip(&got.data).filter(|(a, b)| !same(**a, **b)).count();
            lines.push((format!("expert at K3's shape, {tokens} token rows ({pass})"), want.data.len(), bad));
        }
    }
    let s = backend.stats();
    if s.cpu_fallbacks > 0 {
        lines.push(("experts the CPU computed instead (must be 0)".into(), 1, s.cpu_fallbacks as usize));
    }
    lines
}
