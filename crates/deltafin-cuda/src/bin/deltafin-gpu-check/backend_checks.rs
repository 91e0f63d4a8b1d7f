//! The backend's own operations against the CPU's: SiTU (core's `exp`/`tanh` on the GPU) over
//! special and random values, and whole experts (`CudaBackend::expert_forward`: upload as stored,
//! permutation on the GPU, three products, SiTU) at K3's expert shape, 1 to 300 token rows.

use deltafin_core::{situ, Backend, Cpu, ExpertId, ExpertLayout, ExpertShape, K3Config, Mat};
use deltafin_cuda::{CudaBackend, Gpu};

use super::{same, Rng};

/// One row of the report: what, values compared, values that differ.
pub type Line = (String, usize, usize);

pub fn situ_check(gpu: &Gpu) -> Vec<Line> {
    let gate = deltafin_cuda::situ_inputs(2_000_000);
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
    let layout = ExpertLayout::packed(shape);
    let mut rng = Rng(seed | 1);
    let mut bytes: Vec<u8> = (0..layout.span_len()).map(|_| rng.bits() as u8).collect();
    for i in [1, 3, 5] {
        for b in &mut bytes[layout.offsets[i]..layout.offsets[i] + shape.scale_bytes()] {
            *b = 120 + *b % 6;
        }
    }
    (layout, bytes)
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
