//! The CUDA backend behind core's [`Backend`] seam: the matrix products of a forward pass (the
//! spine's BF16 products, the routed experts' MXFP4 products and their SiTU) on the GPU, the rest
//! (attention over the caches, KDA's recurrence, norms) on the CPU's kernels.
//!
//! Weights stay on the GPU once they have been used, up to a budget of device memory, so a model
//! that fits computes from VRAM after its first pass; the least recently used go first when it
//! does not. Spine matrices are known by their bytes' identity ([`deltafin_core::BytesId`], which
//! keeps the address from being reused while held), routed experts by layer and id, with a sample
//! of their bytes to catch a backend shared by two models. Activations cross the bus at every
//! product: this seam is per operation. Moving it up to whole layer phases, with activations and
//! sequence state living on the GPU, is the next step (see ARCHITECTURE.md).
//!
//! Every value is the CPU's: the products are the canonical-order kernels of `kernels.cu`, SiTU
//! uses core's own `exp`/`tanh` compiled with their exact constants. So when the GPU cannot do an
//! operation (a shape its kernels do not take, memory it cannot get, a driver error), the CPU does
//! it instead with the same bits; that is counted ([`CudaStats::cpu_fallbacks`]) and said once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaSlice;
use deltafin_core::{Backend, Bf16Matrix, BytesId, Cpu, ExpertId, ExpertLayout, K3Config, Mat, MlaHead};

use crate::{Gpu, GpuError, GpuWeights, Result, Workspace};

/// Device memory left outside the weights when no budget is given: inputs, outputs, the lane
/// copies of inputs and the partial lane products of the largest product.
pub const WORKING_RESERVE: usize = 3 << 30;
/// Most bytes of partial lane products (16 per output value) one pass of a product holds: a
/// product of more token rows runs in passes of fewer rows (the rows are independent, so the
/// bits do not change).
const PARTIAL_MAX: usize = 512 << 20;

/// What the backend has done, for stats and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CudaStats {
    /// Weight bytes copied to the GPU.
    pub uploaded_bytes: u64,
    /// Weight bytes on the GPU now.
    pub resident_bytes: u64,
    /// Weight bytes dropped from the GPU to make room.
    pub evicted_bytes: u64,
    /// Products computed on the GPU (an expert counts once).
    pub gpu_products: u64,
    /// Operations the CPU computed instead (same bits).
    pub cpu_fallbacks: u64,
    /// Seconds spent in the GPU's operations, uploads and copies of activations included (what
    /// the rest of a run's time is not).
    pub gpu_s: f64,
}

impl CudaStats {
    /// One line for people (`--stats`, `selftest`, the GPU bench).
    pub fn summary(&self) -> String {
        format!(
            "GPU: {:.3} s in its operations (copies included); {:.1} MB of weights uploaded, {:.1} MB kept, {:.1} MB evicted; \
             {} products, {} computed by the CPU instead",
            self.gpu_s,
            self.uploaded_bytes as f64 / 1e6,
            self.resident_bytes as f64 / 1e6,
            self.evicted_bytes as f64 / 1e6,
            self.gpu_products,
            self.cpu_fallbacks
        )
    }
}

struct SpineEntry {
    /// Held so the key's address cannot be taken by other bytes.
    id: BytesId,
    w: Arc<GpuWeights>,
    last: u64,
}

struct ExpertEntry {
    w: Arc<[GpuWeights; 3]>,
    fingerprint: Vec<u8>,
    last: u64,
}

/// What lives on the GPU, under one lock (one stream runs every product).
#[derive(Default)]
struct Resident {
    spine: HashMap<(usize, usize, usize), SpineEntry>,
    experts: HashMap<ExpertId, ExpertEntry>,
    used: usize,
    clock: u64,
    ws: Workspace,
    stats: CudaStats,
}

impl Resident {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Drops weights, least recently used first (spine whose bytes are gone before anything),
    /// until `need` more bytes fit under `budget`. False if they cannot.
    fn make_room(&mut self, need: usize, budget: usize) -> bool {
        let dead: Vec<_> = self.spine.iter().filter(|(_, e)| !e.id.alive()).map(|(k, _)| *k).collect();
        for k in dead {
            self.drop_spine(k);
        }
        while self.used + need > budget {
            let oldest_spine = self.spine.iter().min_by_key(|(_, e)| e.last).map(|(k, e)| (*k, e.last));
            let oldest_expert = self.experts.iter().min_by_key(|(_, e)| e.last).map(|(k, e)| (*k, e.last));
            match (oldest_spine, oldest_expert) {
                (Some((k, a)), Some((_, b))) if a <= b => self.drop_spine(k),
                (_, Some((k, _))) => self.drop_expert(k),
                (Some((k, _)), None) => self.drop_spine(k),
                (None, None) => return false,
            }
        }
        true
    }

    fn drop_spine(&mut self, k: (usize, usize, usize)) {
        if let Some(e) = self.spine.remove(&k) {
            self.used -= e.w.bytes();
            self.stats.evicted_bytes += e.w.bytes() as u64;
        }
    }

    fn drop_expert(&mut self, k: ExpertId) {
        if let Some(e) = self.experts.remove(&k) {
            let b: usize = e.w.iter().map(GpuWeights::bytes).sum();
            self.used -= b;
            self.stats.evicted_bytes += b as u64;
        }
    }
}

/// Core's compute seam on one NVIDIA GPU (see the module docs).
pub struct CudaBackend {
    gpu: Gpu,
    cpu: Cpu,
    budget: usize,
    resident: Mutex<Resident>,
    warned: AtomicBool,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBackend({}, {} weight bytes)", self.gpu.name(), self.budget)
    }
}

impl CudaBackend {
    /// Opens device `ordinal` with at most `weight_budget` bytes of weights kept on it (default:
    /// the free memory less [`WORKING_RESERVE`]). Fails, saying why, where there is no driver, no
    /// such device, no NVRTC, too little memory, a kernel that does not build or load, or a
    /// [`crate::probe`] value that differs from the CPU's.
    pub fn open(ordinal: usize, weight_budget: Option<u64>) -> Result<CudaBackend> {
        let gpu = Gpu::open(ordinal)?;
        // Before anything computes: this GPU gives the CPU's bits, or it is not used.
        crate::probe(&gpu)?;
        let (free, _total) = gpu.context().mem_get_info()?;
        let budget = match weight_budget {
            Some(b) if b as usize + WORKING_RESERVE.min(free / 4) > free => {
                return Err(GpuError::NoDevice(format!(
                    "--gpu-memory {} asked for, but {} has {:.1} GiB free, of which {:.1} GiB must stay free for activations",
                    b,
                    gpu.name(),
                    free as f64 / (1u64 << 30) as f64,
                    WORKING_RESERVE.min(free / 4) as f64 / (1u64 << 30) as f64
                )))
            }
            Some(b) => b as usize,
            None => free.saturating_sub(WORKING_RESERVE.min(free / 4)),
        };
        Ok(CudaBackend { gpu, cpu: Cpu::best(), budget, resident: Mutex::new(Resident::default()), warned: AtomicBool::new(false) })
    }

    /// The GPU, for people.
    pub fn device(&self) -> &str {
        self.gpu.name()
    }
    /// Bytes of weights this backend keeps on the GPU at most.
    pub fn weight_budget(&self) -> usize {
        self.budget
    }
    /// What it has done so far.
    pub fn stats(&self) -> CudaStats {
        let r = self.lock();
        CudaStats { resident_bytes: r.used as u64, ..r.stats }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Resident> {
        // A panic while holding the lock leaves only caches behind, which stay consistent.
        self.resident.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Notes that the CPU computes `what` instead (said once per backend, counted always).
    fn fell_back(&self, r: &mut Resident, what: &str, e: &GpuError) {
        r.stats.cpu_fallbacks += 1;
        if !self.warned.swap(true, Ordering::Relaxed) {
            eprintln!("warning: {what} could not run on {} ({e}); the CPU computes it instead (the same bits, slower)", self.gpu.name());
        }
    }

    /// `w` on the GPU: kept from an earlier product, else uploaded (and kept if it fits).
    fn spine_weights(&self, r: &mut Resident, w: &Bf16Matrix) -> Result<Arc<GpuWeights>> {
        let id = w.bytes().id();
        let key = id.key();
        let now = r.tick();
        if let Some(e) = r.spine.get_mut(&key) {
            e.last = now;
            return Ok(e.w.clone());
        }
        let size = w.rows * w.cols * 2;
        let keep = r.make_room(size, self.budget);
        let up = Arc::new(self.gpu.upload_bf16(w.rows, w.cols, w.bytes().as_slice())?);
        r.stats.uploaded_bytes += size as u64;
        if keep {
            r.used += size;
            r.spine.insert(key, SpineEntry { id, w: up.clone(), last: now });
        }
        Ok(up)
    }

    /// Expert `id`'s three matrices on the GPU (w1, w2, w3), uploaded from `bytes` unless kept.
    fn expert_weights(&self, r: &mut Resident, id: ExpertId, layout: &ExpertLayout, bytes: &[u8]) -> Result<Arc<[GpuWeights; 3]>> {
        let print = fingerprint(bytes);
        let now = r.tick();
        if let Some(e) = r.experts.get_mut(&id) {
            if e.fingerprint == print {
                e.last = now;
                return Ok(e.w.clone());
            }
            r.drop_expert(id);
        }
        let s = layout.shape;
        let (pb, sb) = (s.packed_bytes(), s.scale_bytes());
        let rec = |i: usize, len: usize| &bytes[layout.offsets[i]..layout.offsets[i] + len];
        let size = layout.span_len();
        let keep = r.make_room(size, self.budget);
        let w = Arc::new([
            self.gpu.upload_mxfp4_raw(s.inter, s.latent, rec(0, pb), rec(1, sb))?,
            self.gpu.upload_mxfp4_raw(s.latent, s.inter, rec(2, pb), rec(3, sb))?,
            self.gpu.upload_mxfp4_raw(s.inter, s.latent, rec(4, pb), rec(5, sb))?,
        ]);
        r.stats.uploaded_bytes += size as u64;
        if keep {
            r.used += size;
            r.experts.insert(id, ExpertEntry { w: w.clone(), fingerprint: print, last: now });
        }
        Ok(w)
    }

    /// `out = x @ w^T` on the GPU for `tokens` rows already there, in passes that keep the
    /// partial lane products under [`PARTIAL_MAX`].
    fn product(&self, ws: &mut Workspace, x: &CudaSlice<f32>, tokens: usize, w: &GpuWeights, out: &mut CudaSlice<f32>) -> Result<()> {
        let (rows, cols) = w.shape();
        let pass = (PARTIAL_MAX / (16 * 4 * rows.max(1))).max(1);
        let mut t0 = 0;
        while t0 < tokens {
            let n = pass.min(tokens - t0);
            let xv = x.slice(t0 * cols..(t0 + n) * cols);
            let mut ov = out.slice_mut(t0 * rows..(t0 + n) * rows);
            self.gpu.matmul(&xv, n, w, &mut ov, ws)?;
            t0 += n;
        }
        Ok(())
    }

    fn try_matmul_bf16(&self, r: &mut Resident, x: &Mat, w: &Bf16Matrix) -> Result<Mat> {
        let gw = self.spine_weights(r, w)?;
        let stream = self.gpu.stream();
        let xd = stream.clone_htod(&x.data)?;
        let mut out = stream.alloc_zeros::<f32>(x.rows * w.rows)?;
        self.product(&mut r.ws, &xd, x.rows, &gw, &mut out)?;
        let data = stream.clone_dtoh(&out)?;
        stream.synchronize()?;
        r.stats.gpu_products += 1;
        Ok(Mat::from_vec(x.rows, w.rows, data))
    }

    fn try_expert(&self, r: &mut Resident, cfg: &K3Config, id: ExpertId, layout: &ExpertLayout, bytes: &[u8], z: &Mat) -> Result<Mat> {
        let w = self.expert_weights(r, id, layout, bytes)?;
        let [w1, w2, w3] = &*w;
        let (inter, latent, t) = (layout.shape.inter, layout.shape.latent, z.rows);
        let stream = self.gpu.stream();
        let zd = stream.clone_htod(&z.data)?;
        let mut act = stream.alloc_zeros::<f32>(t * inter)?;
        let mut gate = stream.alloc_zeros::<f32>(t * inter)?;
        self.product(&mut r.ws, &zd, t, w3, &mut act)?;
        self.product(&mut r.ws, &zd, t, w1, &mut gate)?;
        self.gpu.situ(&mut act.as_view_mut(), &gate.as_view(), cfg.situ_beta, cfg.situ_linear_beta)?;
        let mut y = stream.alloc_zeros::<f32>(t * latent)?;
        self.product(&mut r.ws, &act, t, w2, &mut y)?;
        let data = stream.clone_dtoh(&y)?;
        stream.synchronize()?;
        r.stats.gpu_products += 1;
        Ok(Mat::from_vec(t, latent, data))
    }
}

/// The length and 64 spread 8-byte samples of an expert's bytes: enough to tell two models'
/// experts apart under one id (the store has verified the bytes themselves).
fn fingerprint(bytes: &[u8]) -> Vec<u8> {
    let n = bytes.len();
    let mut f = (n as u64).to_le_bytes().to_vec();
    if n >= 8 {
        for i in 0..64 {
            let at = (n - 8) * i / 63;
            f.extend_from_slice(&bytes[at..at + 8]);
        }
    }
    f
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda: {}", self.gpu.name())
    }

    fn matmul_bf16(&self, x: &Mat, w: &Bf16Matrix) -> Mat {
        if x.rows == 0 || w.rows == 0 {
            return Mat::zeros(x.rows, w.rows);
        }
        let mut r = self.lock();
        let t0 = std::time::Instant::now();
        let result = self.try_matmul_bf16(&mut r, x, w);
        r.stats.gpu_s += t0.elapsed().as_secs_f64();
        match result {
            Ok(m) => m,
            Err(e) => {
                self.fell_back(&mut r, "a BF16 product", &e);
                drop(r);
                self.cpu.matmul_bf16(x, w)
            }
        }
    }

    fn expert_forward(&self, cfg: &K3Config, id: ExpertId, layout: &ExpertLayout, bytes: &[u8], z: &Mat) -> deltafin_core::Result<Mat> {
        if bytes.len() < layout.span_len() {
            return Err(deltafin_core::Error::ExpertLayout(format!(
                "expert span is {} bytes, expected {}",
                bytes.len(),
                layout.span_len()
            )));
        }
        if z.rows == 0 {
            return Ok(Mat::zeros(0, layout.shape.latent));
        }
        let mut r = self.lock();
        let t0 = std::time::Instant::now();
        let result = self.try_expert(&mut r, cfg, id, layout, bytes, z);
        r.stats.gpu_s += t0.elapsed().as_secs_f64();
        match result {
            Ok(m) => Ok(m),
            Err(e) => {
                self.fell_back(&mut r, "an expert", &e);
                drop(r);
                self.cpu.expert_forward(cfg, id, layout, bytes, z)
            }
        }
    }

    fn dot_bf16(&self, x: &[f32], w: &[u8]) -> f32 {
        self.cpu.dot_bf16(x, w)
    }
    fn dot_f32(&self, a: &[f32], b: &[f32]) -> f32 {
        self.cpu.dot_f32(a, b)
    }
    fn mla_attend(&self, head: MlaHead<'_>, w_v: &Bf16Matrix, values: std::ops::Range<usize>) -> Vec<f32> {
        self.cpu.mla_attend(head, w_v, values)
    }
    fn kda_step(&self, s: &mut [f32], q: &[f32], k: &[f32], v: &[f32], decay: &[f32], beta: f32, o: &mut [f32]) {
        self.cpu.kda_step(s, q, k, v, decay, beta, o)
    }
    fn situ_in_place(&self, up: &mut [f32], gate: &[f32], beta: f32, lin: f32) {
        self.cpu.situ_in_place(up, gate, beta, lin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_tell_bytes_apart_and_cover_the_ends() {
        let a: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut b = a.clone();
        assert_eq!(fingerprint(&a), fingerprint(&b));
        b[a.len() - 1] ^= 1;
        assert_ne!(fingerprint(&a), fingerprint(&b));
        b = a.clone();
        b[0] ^= 1;
        assert_ne!(fingerprint(&a), fingerprint(&b));
        assert_ne!(fingerprint(&a[..9_999]), fingerprint(&a));
        assert_eq!(fingerprint(&[1, 2]).len(), 8);
    }
}
