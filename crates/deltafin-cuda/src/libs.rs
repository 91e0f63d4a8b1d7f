//! Finding NVRTC. cudarc loads `libnvrtc.so.13` by name; where the system has none on its library
//! path, NVIDIA's PyPI wheel (`nvidia-cuda-nvrtc`, what CI installs) holds one under Python's
//! site-packages. Loading that file by its path first makes the later load by name find it.

use crate::{GpuError, Result};

/// The wheel CI installs and the README names (its PTX loads on driver 580 and newer).
pub const NVRTC_WHEEL: &str = "nvidia-cuda-nvrtc==13.0.88";

/// Makes NVRTC loadable, or says how to install it.
pub fn load_nvrtc() -> Result<()> {
    // SAFETY: only probes whether the shared library can be loaded.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Ok(());
    }
    for path in wheel_candidates() {
        if !path.exists() {
            continue;
        }
        // NVRTC opens its builtins library by name when it compiles: load it first from beside it.
        let builtins = path.with_file_name("libnvrtc-builtins.so.13.0");
        if [builtins.as_path(), path.as_path()].into_iter().filter(|p| p.exists()).all(load_global) {
            // SAFETY: only probes whether the shared library can be loaded.
            if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return Ok(());
            }
        }
    }
    Err(GpuError::NoNvrtc(format!(
        "libnvrtc.so.13 is not on the library path and no `{NVRTC_WHEEL}` wheel was found (`python3 -m pip install {NVRTC_WHEEL}`, \
         or add CUDA's lib64 to LD_LIBRARY_PATH)"
    )))
}

/// Loads the library at `path` for good, its symbols global, so later loads by name find it.
fn load_global(path: &std::path::Path) -> bool {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading NVIDIA's NVRTC libraries runs their initialisers, which have no
    // preconditions; the handle is leaked, so they are never unloaded.
    match unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) } {
        Ok(lib) => {
            std::mem::forget(lib);
            true
        }
        Err(_) => false,
    }
}

/// Where the wheel puts the library, for each Python `site-packages` the interpreter reports.
fn wheel_candidates() -> Vec<std::path::PathBuf> {
    let out = std::process::Command::new("python3")
        .args(["-c", "import site, sys; print('\\n'.join(site.getsitepackages() + [site.getusersitepackages()]))"])
        .output();
    let Ok(out) = out else { return Vec::new() };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .flat_map(|d| ["cu13/lib/libnvrtc.so.13", "cuda_nvrtc/lib/libnvrtc.so.13"].map(|f| std::path::Path::new(d).join("nvidia").join(f)))
        .collect()
}
