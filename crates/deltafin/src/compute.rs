//! What computes: the CPU's kernels or a CUDA GPU. Both give the same bits (every value one dot
//! product in the canonical order), so the choice changes the speed and never a token.

use std::sync::Arc;

use deltafin_core::{Backend, Cpu};
use deltafin_cuda::CudaBackend;

use crate::{Error, Result};

/// What a GPU backend has done: weights uploaded and kept, products, CPU fallbacks.
pub use deltafin_cuda::CudaStats as GpuStats;

/// Which hardware computes (`--backend`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendChoice {
    /// The GPU when one is usable, else the CPU.
    Auto,
    /// The CPU's kernels (the fastest instruction set this CPU runs).
    #[default]
    Cpu,
    /// The first CUDA GPU; an error naming the cause if it cannot be used.
    Cuda,
}

impl std::str::FromStr for BackendChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(BackendChoice::Auto),
            "cpu" => Ok(BackendChoice::Cpu),
            "cuda" => Ok(BackendChoice::Cuda),
            other => Err(format!("unknown backend {other:?}: use cpu, cuda or auto")),
        }
    }
}

/// An opened backend, to hand to [`crate::EngineBuilder::backend`].
#[derive(Clone)]
pub struct Compute {
    backend: Arc<dyn Backend>,
    gpu: Option<Arc<CudaBackend>>,
    note: Option<String>,
}

impl std::fmt::Debug for Compute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Compute({})", self.backend.name())
    }
}

impl Compute {
    /// Opens what `choice` asks for. `gpu_memory` caps the weight bytes kept on the GPU (default:
    /// its free memory less room for activations). `Cuda` fails with the cause where no GPU can
    /// be used; `Auto` then runs on the CPU and says why, unless there is simply no driver.
    pub fn open(choice: BackendChoice, gpu_memory: Option<u64>) -> Result<Compute> {
        let cpu = || Arc::new(Cpu::best()) as Arc<dyn Backend>;
        match choice {
            BackendChoice::Cpu => Ok(Compute { backend: cpu(), gpu: None, note: None }),
            BackendChoice::Cuda | BackendChoice::Auto => match CudaBackend::open(0, gpu_memory) {
                Ok(g) => {
                    let g = Arc::new(g);
                    let note = format!(
                        "computing on {} ({:.1} GiB for weights; the same bits as the CPU)",
                        g.device(),
                        g.weight_budget() as f64 / (1u64 << 30) as f64
                    );
                    Ok(Compute { backend: g.clone(), gpu: Some(g), note: Some(note) })
                }
                Err(e) if choice == BackendChoice::Cuda => Err(Error::Backend(format!("--backend cuda: {e}"))),
                // A machine without NVIDIA's driver is the common case, not news.
                Err(deltafin_cuda::GpuError::NoDriver) => Ok(Compute { backend: cpu(), gpu: None, note: None }),
                Err(e) => {
                    Ok(Compute { backend: cpu(), gpu: None, note: Some(format!("computing on the CPU: the GPU cannot be used ({e})")) })
                }
            },
        }
    }

    /// The backend, for [`crate::EngineBuilder::backend`].
    pub fn backend(&self) -> Arc<dyn Backend> {
        self.backend.clone()
    }
    /// What computes, for people (`cpu-avx512`, `cuda: NVIDIA H100 ...`).
    pub fn name(&self) -> String {
        self.backend.name()
    }
    /// A line worth printing at start: the GPU in use, or why a GPU is not. `None` for a CPU run
    /// on a machine without a GPU driver.
    pub fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }
    /// What the GPU has done so far (`None` on the CPU).
    pub fn gpu_stats(&self) -> Option<GpuStats> {
        self.gpu.as_ref().map(|g| g.stats())
    }
}
