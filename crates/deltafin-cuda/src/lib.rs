//! Deltafin's exact CUDA kernels: the engine's matrix products (BF16 spine weights, MXFP4 expert
//! weights, F32 activations) on an NVIDIA GPU, each output value one dot product in the engine's
//! canonical order, so the GPU gives the CPU's bits (`deltafin_core::dot_bf16`, `dot_mxfp4`).
//!
//! The order is 16 interleaved chains (lane j: its columns in ascending order, fused
//! multiply-adds from 0) and one fixed tree. For many token rows each lane is a plain register-
//! tiled GEMM whose values each run their chain in order (`lane_gemm_*`), and a second pass adds
//! the 16 lane products in the tree (`lane_tree`); for a few rows (decode, verification) 16 threads
//! run a weight row's 16 chains side by side and add them through shuffles in the tree's pairs
//! (`gemv_*`). Weights are laid lane-major once, when they reach the GPU ([`GpuWeights`]), so each
//! chain reads contiguous bytes.
//!
//! Kernels are compiled when a [`Gpu`] opens, by NVRTC, for the device's own architecture, with
//! `--fmad=false` (no contracted multiply-add), `--ftz=false`, exact division and square root.
//! [`compile_ptx`] compiles them without a GPU (CI does, from NVIDIA's `nvidia-cuda-nvrtc` wheel):
//! a kernel that does not build fails CI, not a GPU run. The driver, NVRTC and cuBLAS are loaded
//! at run time; without them every entry point returns an error naming what is missing.
//!
//! This crate is the kernel layer of the CUDA backend: the backend seam that runs whole layer
//! phases on the GPU is not here yet.

mod backend;
mod layout;
mod libs;
mod probe;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

pub use backend::{CudaBackend, CudaStats};

pub use layout::{bf16_lanes, mxfp4_lanes};
pub use libs::{load_nvrtc, NVRTC_WHEEL};
pub use probe::{probe, situ_inputs, Values};

/// The kernels' CUDA C source, without the constants [`kernel_source`] puts before it.
pub const KERNELS: &str = include_str!("kernels.cu");

/// Every kernel the source defines.
pub const KERNEL_NAMES: &[&str] = &[
    "x_to_lanes",
    "lane_gemm_bf16",
    "lane_gemm_mxfp4",
    "lane_gemm4_bf16",
    "lane_gemm4_mxfp4",
    "lane_tree",
    "gemv_bf16",
    "gemv_mxfp4",
    "mxfp4_to_lanes",
    "situ_inplace",
];

/// The source NVRTC compiles: `exp`/`tanh`'s constants as core defines them (their exact bits, so
/// the two sides cannot drift apart), then [`KERNELS`].
pub fn kernel_source() -> String {
    let mut src = String::from("// Generated from deltafin_core::TRANSCENDENTAL_CONSTANTS.\n");
    for (name, v) in deltafin_core::TRANSCENDENTAL_CONSTANTS {
        src.push_str(&format!("#define DF_{name} __uint_as_float({:#010x}u) // {v:e}\n", v.to_bits()));
    }
    src + KERNELS
}

/// Which lane GEMM runs a many-row product: both give the same bits; the benchmark sets them side
/// by side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LaneGemm {
    /// 16-byte loads and float4 shared-memory reads (where K/16 is a multiple of 4).
    #[default]
    Vector,
    /// Element by element.
    Scalar,
}

/// Token rows at most that the few-row kernels (`gemv_*`) take; more go to the lane GEMM.
pub const GEMV_TOKENS: usize = 8;

/// What can go wrong on the GPU path; every message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no CUDA driver: libcuda could not be loaded (install NVIDIA's driver, or run with `--backend cpu`)")]
    NoDriver,
    #[error("no NVRTC: {0}")]
    NoNvrtc(String),
    #[error("no usable CUDA device: {0}")]
    NoDevice(String),
    #[error("compiling the CUDA kernels failed: {0}")]
    Compile(String),
    #[error("CUDA: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("cuBLAS: {0}")]
    Cublas(String),
    #[error("{0}")]
    Shape(String),
    #[error("the GPU's check against the CPU failed: {0}")]
    Mismatch(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, GpuError>;

/// Compiles every kernel to PTX for `arch` (`compute_90` for an H100, `compute_89` for an RTX
/// 4090, ...) with the exactness options. Needs NVRTC, not a GPU.
pub fn compile_ptx(arch: &'static str) -> Result<cudarc::nvrtc::Ptx> {
    load_nvrtc()?;
    let opts = cudarc::nvrtc::CompileOptions {
        fmad: Some(false),
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        use_fast_math: Some(false),
        arch: Some(arch),
        options: vec!["--std=c++17".into()],
        name: Some("deltafin_kernels.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(kernel_source(), opts).map_err(|e| GpuError::Compile(e.to_string()))
}

/// The NVRTC architecture name of compute capability `major.minor`.
fn arch_of(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (7, 5) => "compute_75",
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 7) => "compute_87",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        // Newer parts run PTX of an older architecture.
        (m, _) if m >= 10 => "compute_100",
        _ => "compute_75",
    }
}

/// An opened GPU with the kernels loaded.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    funcs: std::collections::HashMap<&'static str, CudaFunction>,
    name: String,
    /// The lane GEMM many-row products use.
    pub lane_gemm: LaneGemm,
}

/// Weights resident on the GPU, lane-major (see `kernels.cu`).
pub enum GpuWeights {
    Bf16 { rows: usize, cols: usize, w: CudaSlice<u16> },
    Mxfp4 { rows: usize, cols: usize, packed: CudaSlice<u8>, scales: CudaSlice<u8> },
}

impl GpuWeights {
    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            GpuWeights::Bf16 { rows, cols, .. } | GpuWeights::Mxfp4 { rows, cols, .. } => (*rows, *cols),
        }
    }
    /// Bytes the weights take on the GPU (what a one-row product must read).
    pub fn bytes(&self) -> usize {
        match self {
            GpuWeights::Bf16 { rows, cols, .. } => rows * cols * 2,
            GpuWeights::Mxfp4 { rows, cols, .. } => rows * cols / 2 + rows * cols / 32,
        }
    }
}

/// Device buffers a product needs besides its input and output, reused between products.
#[derive(Default)]
pub struct Workspace {
    lanes: Option<CudaSlice<f32>>,
    partial: Option<CudaSlice<f32>>,
}

fn ensure(stream: &Arc<CudaStream>, slot: &mut Option<CudaSlice<f32>>, n: usize) -> Result<()> {
    if slot.as_ref().is_none_or(|s| s.len() < n) {
        *slot = Some(stream.alloc_zeros::<f32>(n.max(1))?);
    }
    Ok(())
}

impl Gpu {
    /// Opens device `ordinal` and compiles the kernels for it.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        // SAFETY: only probes whether the shared library can be loaded.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        let count = CudaContext::device_count().map_err(|e| GpuError::NoDevice(e.to_string()))?;
        if ordinal as i32 >= count {
            return Err(GpuError::NoDevice(format!("device {ordinal} asked for, {count} present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| GpuError::NoDevice(e.to_string()))?;
        let (major, minor) = ctx.compute_capability()?;
        let name = format!("{} (compute {major}.{minor}, {:.1} GiB)", ctx.name()?, ctx.total_mem()? as f64 / (1u64 << 30) as f64);
        let ptx = compile_ptx(arch_of(major, minor))?;
        let module = ctx.load_module(ptx).map_err(|e| GpuError::Compile(format!("loading the kernels on {name}: {e}")))?;
        let mut funcs = std::collections::HashMap::new();
        for &k in KERNEL_NAMES {
            funcs.insert(k, module.load_function(k).map_err(|e| GpuError::Compile(format!("kernel {k}: {e}")))?);
        }
        let stream = ctx.default_stream();
        Ok(Gpu { ctx, stream, _module: module, funcs, name, lane_gemm: LaneGemm::default() })
    }

    /// The device, for people.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    /// The stream every operation of this GPU runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Uploads a BF16 matrix `[rows, cols]` (little-endian bytes as stored), lane-major.
    pub fn upload_bf16(&self, rows: usize, cols: usize, bytes: &[u8]) -> Result<GpuWeights> {
        let lanes = bf16_lanes(rows, cols, bytes).map_err(GpuError::Shape)?;
        Ok(GpuWeights::Bf16 { rows, cols, w: self.stream.clone_htod(&lanes)? })
    }

    /// Uploads an MXFP4 matrix `[rows, cols]` (packed codes and E8M0 scales as stored), lane-major.
    pub fn upload_mxfp4(&self, rows: usize, cols: usize, packed: &[u8], scales: &[u8]) -> Result<GpuWeights> {
        let lanes = mxfp4_lanes(rows, cols, packed, scales).map_err(GpuError::Shape)?;
        Ok(GpuWeights::Mxfp4 { rows, cols, packed: self.stream.clone_htod(&lanes)?, scales: self.stream.clone_htod(scales)? })
    }

    /// Uploads an MXFP4 matrix from its bytes as stored and lays it lane-major on the GPU (the
    /// bytes cross the bus once, unpermuted).
    pub fn upload_mxfp4_raw(&self, rows: usize, cols: usize, packed: &[u8], scales: &[u8]) -> Result<GpuWeights> {
        if !cols.is_multiple_of(32) || packed.len() != rows * cols / 2 || scales.len() != rows * cols / 32 {
            return Err(GpuError::Shape(format!("MXFP4 [{rows}, {cols}]: {} code and {} scale bytes", packed.len(), scales.len())));
        }
        let raw = self.stream.clone_htod(packed)?;
        let mut lanes = self.stream.alloc_zeros::<u8>(packed.len().max(1))?;
        let (r, g) = (rows as i32, (cols / 32) as i32);
        let mut b = self.stream.launch_builder(&self.funcs["mxfp4_to_lanes"]);
        b.arg(&raw).arg(&r).arg(&g).arg(&mut lanes);
        // SAFETY: both buffers hold rows * cols / 2 bytes (checked above).
        unsafe { b.launch(grid_1d(packed.len())) }?;
        Ok(GpuWeights::Mxfp4 { rows, cols, packed: lanes, scales: self.stream.clone_htod(scales)? })
    }

    /// `up[i] = situ(up[i], gate[i], beta, lin)` on the GPU, with core's `exp`/`tanh` (the CPU's
    /// bits). Asynchronous on [`Gpu::stream`].
    pub fn situ(&self, up: &mut CudaViewMut<'_, f32>, gate: &CudaView<'_, f32>, beta: f32, lin: f32) -> Result<()> {
        let n = up.len().min(gate.len());
        if n == 0 {
            return Ok(());
        }
        let len = n as i64;
        let mut b = self.stream.launch_builder(&self.funcs["situ_inplace"]);
        b.arg(&mut *up).arg(gate).arg(&len).arg(&beta).arg(&lin);
        // SAFETY: both views hold at least n values.
        unsafe { b.launch(grid_1d(n)) }?;
        Ok(())
    }

    /// `out[t][r] = dot(x[t], w[r])` for `tokens` rows of `x` (`[tokens, cols]` F32 on the GPU) into
    /// `out` (`[tokens, rows]`), every value in the canonical order. Asynchronous on [`Gpu::stream`].
    pub fn matmul(
        &self,
        x: &CudaView<'_, f32>,
        tokens: usize,
        w: &GpuWeights,
        out: &mut CudaViewMut<'_, f32>,
        ws: &mut Workspace,
    ) -> Result<()> {
        let (rows, cols) = w.shape();
        if x.len() < tokens * cols || out.len() < tokens * rows {
            return Err(GpuError::Shape(format!("matmul: {tokens} x {cols} input and {tokens} x {rows} output needed")));
        }
        if tokens == 0 || rows == 0 {
            return Ok(());
        }
        let mxfp4 = matches!(w, GpuWeights::Mxfp4 { .. });
        let (t, r, k, kl) = (tokens as i32, rows as i32, cols as i32, (cols / 16) as i32);
        ensure(&self.stream, &mut ws.lanes, tokens * cols)?;
        let lanes = ws.lanes.as_mut().expect("ensured");
        let flag = i32::from(mxfp4);
        let mut b = self.stream.launch_builder(&self.funcs["x_to_lanes"]);
        b.arg(x).arg(&t).arg(&k).arg(&flag).arg(&mut *lanes);
        // SAFETY: the buffers hold tokens * cols values (checked above and by `ensure`).
        unsafe { b.launch(grid_1d(tokens * cols)) }?;
        let lanes = ws.lanes.as_ref().expect("ensured");
        let gemv = tokens <= GEMV_TOKENS && if mxfp4 { cols.is_multiple_of(512) } else { cols.is_multiple_of(128) };
        if gemv {
            let cfg = LaunchConfig { grid_dim: ((rows * 16).div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            match w {
                GpuWeights::Bf16 { w, .. } => {
                    let mut b = self.stream.launch_builder(&self.funcs["gemv_bf16"]);
                    b.arg(lanes).arg(w).arg(&t).arg(&r).arg(&kl).arg(&mut *out);
                    // SAFETY: shapes checked above; the weights are lane-major [rows][16][cols/16].
                    unsafe { b.launch(cfg) }?;
                }
                GpuWeights::Mxfp4 { packed, scales, .. } => {
                    let mut b = self.stream.launch_builder(&self.funcs["gemv_mxfp4"]);
                    b.arg(lanes).arg(packed).arg(scales).arg(&t).arg(&r).arg(&kl).arg(&mut *out);
                    // SAFETY: as above, [rows][16][cols/32] codes and [rows][cols/32] scales.
                    unsafe { b.launch(cfg) }?;
                }
            }
            return Ok(());
        }
        ensure(&self.stream, &mut ws.partial, 16 * tokens * rows)?;
        let partial = ws.partial.as_mut().expect("ensured");
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(128) as u32, tokens.div_ceil(128) as u32, 16),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let vector = self.lane_gemm == LaneGemm::Vector && (cols / 16).is_multiple_of(4);
        let name = |kind: &str| match vector {
            true => format!("lane_gemm4_{kind}"),
            false => format!("lane_gemm_{kind}"),
        };
        match w {
            GpuWeights::Bf16 { w, .. } => {
                let mut b = self.stream.launch_builder(&self.funcs[name("bf16").as_str()]);
                b.arg(lanes).arg(w).arg(&t).arg(&r).arg(&kl).arg(&mut *partial);
                // SAFETY: the partial buffer holds 16 * tokens * rows values.
                unsafe { b.launch(cfg) }?;
            }
            GpuWeights::Mxfp4 { packed, scales, .. } => {
                let mut b = self.stream.launch_builder(&self.funcs[name("mxfp4").as_str()]);
                b.arg(lanes).arg(packed).arg(scales).arg(&t).arg(&r).arg(&kl).arg(&mut *partial);
                // SAFETY: as above.
                unsafe { b.launch(cfg) }?;
            }
        }
        let partial = ws.partial.as_ref().expect("ensured");
        let mut b = self.stream.launch_builder(&self.funcs["lane_tree"]);
        b.arg(partial).arg(&t).arg(&r).arg(&mut *out);
        // SAFETY: `out` holds tokens * rows values.
        unsafe { b.launch(grid_1d(tokens * rows)) }?;
        Ok(())
    }

    /// [`Gpu::matmul`] from and to host memory (waits for the result).
    pub fn matmul_host(&self, x: &[f32], tokens: usize, w: &GpuWeights) -> Result<Vec<f32>> {
        let (rows, _) = w.shape();
        let xd = self.stream.clone_htod(x)?;
        let mut out = self.stream.alloc_zeros::<f32>((tokens * rows).max(1))?;
        let mut ws = Workspace::default();
        self.matmul(&xd.as_view(), tokens, w, &mut out.as_view_mut(), &mut ws)?;
        let mut v = self.stream.clone_dtoh(&out)?;
        v.truncate(tokens * rows);
        Ok(v)
    }
}

fn grid_1d(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.div_ceil(256).clamp(1, 65535 * 4) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}
