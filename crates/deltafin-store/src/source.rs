//! The interface between the engine loop and expert bytes: ask for a layer's experts, receive
//! each one as soon as it is in RAM, in whatever order the drives deliver them.

use crossbeam_channel::Receiver;
use deltafin_core::{Bytes, ExpertLayout};

use crate::checkpoint::{Checkpoint, ExpertSpan};
use crate::error::Result;

/// How urgent a request is: demand reads always go before prefetch reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Priority {
    /// Needed by the step being computed now.
    Demand,
    /// A guess for a later layer; may be dropped.
    Prefetch,
}

/// One delivered expert: its id and its bytes (or why they could not be had).
pub type Delivery = (u32, Result<Bytes>);

/// Counters a source keeps; all monotonic.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SourceStats {
    /// Expert bytes read from disk (or fetched).
    pub bytes_read: u64,
    /// Expert requests served from RAM.
    pub hits: u64,
    /// Expert requests that needed a read.
    pub misses: u64,
    /// Seconds the engine waited for demand reads.
    pub read_wait_s: f64,
    /// Reads and bytes per home (drive), in home order.
    pub per_home: Vec<HomeStats>,
    /// Prefetched experts later demanded / prefetched experts.
    pub prefetch_used: u64,
    pub prefetch_issued: u64,
    /// Bytes of prefetch reads never used before eviction or cancellation.
    pub prefetch_wasted_bytes: u64,
    /// Most bytes of expert buffers (cached, being read, in use) held at once.
    pub cache_peak_bytes: u64,
    /// Bytes the engine was handed (spine included) that no published hash has covered yet: a
    /// stream store's large shards until they are checked against the hub's SHA-256.
    pub unverified_bytes: u64,
}

/// Per-drive counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HomeStats {
    pub path: String,
    pub reads: u64,
    pub bytes: u64,
    pub errors: u64,
    /// Measured throughput in bytes/s (exponential average), 0 before the first read.
    pub rate: f64,
    /// Seconds the drive had at least one read in flight (the union of its reads' intervals).
    pub busy_s: f64,
}

/// Anything that can hand out routed experts.
pub trait ExpertSource: Send + Sync {
    /// Record layout of layer `l`'s experts.
    fn layout(&self, layer: usize) -> ExpertLayout;
    /// Requests experts of one layer; each arrives on the returned channel once in RAM.
    fn request(&self, layer: usize, experts: &[u32], priority: Priority) -> Receiver<Delivery>;
    /// Hints that these experts will likely be needed soon (may be ignored).
    fn prefetch(&self, _layer: usize, _experts: &[u32]) {}
    /// A pass (engine step) begins and will request the MoE layers `layers`, in this order; the
    /// next pass walks them again. The source plans eviction from this, never from the order
    /// requests happen to arrive in.
    fn begin_pass(&self, _layers: &[usize]) {}
    /// Demand counts per (layer, expert) since the last call: which experts are hot, for the
    /// pinned tier. The source owns them; the engine only asks.
    fn take_heat(&self) -> std::collections::HashMap<(usize, u32), u64> {
        Default::default()
    }
    /// Counters so far.
    fn stats(&self) -> SourceStats;
    /// Bytes of one expert.
    fn expert_bytes(&self) -> u64;
}

/// Experts served from memory maps of a checkpoint's shards: no reader, no cache, no budget.
/// The simplest source, used when the whole model fits in RAM and by tests as the reference.
pub struct MappedExperts {
    ckpt: std::sync::Arc<Checkpoint>,
    layers: Vec<Option<(ExpertLayout, Vec<ExpertSpan>)>>,
    hits: std::sync::atomic::AtomicU64,
}

impl MappedExperts {
    /// Resolves every MoE layer's expert spans.
    pub fn new(ckpt: std::sync::Arc<Checkpoint>) -> Result<MappedExperts> {
        let cfg = ckpt.config().clone();
        let mut layers = vec![None; cfg.num_layers];
        for l in cfg.moe_layers() {
            layers[l] = Some(ckpt.expert_spans(l)?);
        }
        Ok(MappedExperts { ckpt, layers, hits: Default::default() })
    }
}

impl ExpertSource for MappedExperts {
    fn layout(&self, layer: usize) -> ExpertLayout {
        self.layers[layer].as_ref().expect("not an MoE layer").0
    }
    fn request(&self, layer: usize, experts: &[u32], _priority: Priority) -> Receiver<Delivery> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let spans = &self.layers[layer].as_ref().expect("not an MoE layer").1;
        for &e in experts {
            self.hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let _ = tx.send((e, self.ckpt.mapped_bytes(&spans[e as usize])));
        }
        rx
    }
    fn stats(&self) -> SourceStats {
        SourceStats { hits: self.hits.load(std::sync::atomic::Ordering::Relaxed), ..Default::default() }
    }
    fn expert_bytes(&self) -> u64 {
        self.ckpt.config().expert_shape().total_bytes() as u64
    }
}
