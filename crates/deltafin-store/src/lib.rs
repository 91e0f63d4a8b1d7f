//! Every byte of model data Deltafin touches on disk: checkpoint folders in the release layout,
//! expert stores spread over drives, the readers that fetch one expert per read, the RAM cache
//! that keeps the engine inside its budget, and integrity checks.
//!
//! What it is not: it does no math (that is `deltafin-core`) and decides nothing about *when*
//! experts are needed (that is `deltafin-sched`). The engine asks an [`ExpertSource`] for a
//! layer's experts and receives each one as soon as it is in RAM.
//!
//! Principal types:
//! - [`Checkpoint`]: a release-layout folder; lends spine tensors to the core from memory maps.
//! - [`setup()`] installs a checkpoint into a store described by a [`Manifest`].
//! - [`Store`]: an opened store; lends its spine and starts [`StreamingExperts`].
//! - [`ExpertSource`]: the engine-facing interface; [`MappedExperts`] serves a checkpoint from
//!   memory maps, [`StreamingExperts`] streams a store's experts under a RAM budget.
//! - [`doctor()`] checks a store against its manifest.

mod checkpoint;
mod checksum;
mod doctor;
mod draft;
mod embed_rows;
mod error;
mod hf_snapshot;
mod hub_cache;
mod identity;
mod lock;
mod manifest;
mod memory;
mod reader;
mod safetensors;
mod setup;
mod source;
mod spine_read;
mod store;
mod streaming;

pub use crate::{
    checkpoint::{read_header, Checkpoint, ExpertSpan, TensorEntry},
    doctor::{doctor, repair, DoctorReport},
    draft::DraftCheckpoint,
    embed_rows::RowReader,
    error::{Error, Result},
    hf_snapshot::{hf_hub_cache, resolve_model_dir, snapshot as hf_snapshot},
    hub_cache::{HubCache, HubCacheStats, HubFile, HubRecord, CACHE_DIR, HUB_DIR, HUB_RECORD, WHOLE_SHARD_FETCH},
    identity::source_id,
    lock::{DirLock, LOCK_FILE},
    manifest::{
        checksum, read_sealed, repair_advice, write_sealed, Copy, ExpertEntry, FileSum, Manifest, SealError, SetupRecord, SpineTensor,
        Stripe, ALIGN, FORMAT, LAYOUT_IN_PLACE, LAYOUT_PACKS, LAYOUT_STREAM,
    },
    memory::{peak_rss_bytes, AlignedBuf, Budget, BUF_ALIGN},
    reader::{aligned_window, open_for_read, read_aligned, CacheMode},
    setup::{
        checkpoint_store, deltafin_home, drop_cache, plan_layout, setup, setup_stream, DriveFacts, ExpertLayoutKind, LayoutPlan,
        LocalFiles, NoProgress, Placement, PlannedHome, Progress, SetupOptions, SpanSource, StreamOptions, PACKS_DIR,
    },
    source::{Delivery, ExpertSource, HomeStats, MappedExperts, Priority, SourceStats},
    store::{LayerSpine, Store},
    streaming::{CachePolicy, ReaderOptions, StreamingExperts, DEFAULT_SPLIT_MIN},
};
