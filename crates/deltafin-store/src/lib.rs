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
//! - [`ExpertSource`]: the engine-facing interface; [`MappedExperts`] serves a checkpoint from
//!   memory maps.

mod checkpoint;
mod error;
mod source;

pub use crate::{
    checkpoint::{read_header, Checkpoint, ExpertSpan, TensorEntry},
    error::{Error, Result},
    source::{Delivery, ExpertSource, HomeStats, MappedExperts, Priority, SourceStats},
};
