//! Spine layers that do not fit the RAM budget, read from the store each pass like experts:
//! checked against their checksums as they are read, the next streamed layer read ahead while
//! the current one computes, each dropped once its layer has run. At most two streamed layers
//! are in RAM at once (the one running and the one being read), which the budget reserves.
//!
//! Which layers stream is decided at open ([`choose_resident`]); the walk asks [`SpineStream`]
//! for a layer before running it and hands it back after.

use std::collections::{HashMap, HashSet};
use std::sync::{mpsc, Arc, Condvar, Mutex};

use deltafin_core::Model;
use deltafin_store::{LayerSpine, Store};

use crate::error::Result;

/// Chooses the layers kept resident within `room` bytes; `layer_bytes[l]` is layer `l`'s spine.
/// Every byte kept saves one byte of reads per pass whichever layer it belongs to, so layers are
/// kept in order until the next one does not fit. Returns `(resident, bytes kept)`.
pub(crate) fn choose_resident(layer_bytes: &[u64], room: u64) -> (Vec<bool>, u64) {
    let mut kept = 0u64;
    let mut full = false;
    let resident = layer_bytes
        .iter()
        .map(|&b| {
            full |= kept + b > room;
            if !full {
                kept += b;
            }
            !full
        })
        .collect();
    (resident, kept)
}

/// How the spine sits in a RAM budget: whole, or the layers that fit kept and the rest read each
/// pass (the embedding then read by row, unless tied to the output head). What the engine does
/// at open and what `deltafin plan` projects, from one place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SpineFit {
    /// Spine bytes in RAM: everything kept, plus two streamed layers' buffers when some stream.
    pub resident_bytes: u64,
    /// The least the spine can do with: output head, norms, the embedding's row checksums and
    /// the two largest layers' buffers.
    pub minimum: u64,
    /// Per layer: read each pass.
    pub streamed: Vec<bool>,
    pub embed_by_row: bool,
}

impl SpineFit {
    /// The fit of a spine of `spine` bytes (layers of `layer_bytes`, an embedding of
    /// `embed_bytes` over `vocab` rows) in `room` bytes.
    pub(crate) fn new(spine: u64, layer_bytes: &[u64], embed_bytes: u64, vocab: usize, tied: bool, room: u64) -> SpineFit {
        let embed = if tied { 0 } else { embed_bytes };
        let row_sums = if embed > 0 { 8 * vocab as u64 } else { 0 };
        let minimum = spine - layer_bytes.iter().sum::<u64>() - embed + row_sums + two_layers(layer_bytes);
        if room >= spine {
            return SpineFit { resident_bytes: spine, minimum, streamed: vec![false; layer_bytes.len()], embed_by_row: false };
        }
        let (resident, kept) = choose_resident(layer_bytes, room.saturating_sub(minimum));
        SpineFit { resident_bytes: minimum + kept, minimum, streamed: resident.iter().map(|r| !r).collect(), embed_by_row: embed > 0 }
    }

    /// Layers read each pass.
    pub(crate) fn streamed_layers(&self) -> usize {
        self.streamed.iter().filter(|s| **s).count()
    }

    /// Spine bytes read each pass.
    pub(crate) fn read_per_pass(&self, layer_bytes: &[u64]) -> u64 {
        layer_bytes.iter().zip(&self.streamed).filter(|(_, s)| **s).map(|(b, _)| b).sum()
    }
}

/// RAM for the streamed layers in memory at once: the one running and the one read ahead (two
/// different layers, so at most the two largest).
pub(crate) fn two_layers(layer_bytes: &[u64]) -> u64 {
    let mut v = layer_bytes.to_vec();
    v.sort_unstable_by(|a, b| b.cmp(a));
    v.iter().take(2).sum()
}

#[derive(Default)]
struct Shared {
    requested: HashSet<usize>,
    ready: HashMap<usize, std::result::Result<LayerSpine, deltafin_store::Error>>,
}

/// The streamed layers of one engine and the thread that reads them.
pub struct SpineStream {
    /// Held by a walk for its whole pass: two passes at once would unload each other's layers
    /// and hold more than the two streamed layers the budget reserves.
    walk: Mutex<()>,
    streamed: Vec<bool>,
    /// Spine bytes loaded from the store so far (streamed layers, each pass).
    bytes_read: std::sync::atomic::AtomicU64,
    shared: Arc<(Mutex<Shared>, Condvar)>,
    requests: Mutex<mpsc::Sender<usize>>,
}

impl SpineStream {
    /// Starts the reader of `store`'s layers marked in `streamed`.
    pub(crate) fn start(store: Arc<Store>, streamed: Vec<bool>) -> SpineStream {
        let shared: Arc<(Mutex<Shared>, Condvar)> = Arc::default();
        let (tx, rx) = mpsc::channel::<usize>();
        let s = shared.clone();
        // Ends when the stream (its sender) is dropped.
        std::thread::spawn(move || {
            for l in rx {
                let read = store.read_layer_spine(l);
                let (lock, cv) = &*s;
                lock.lock().expect("poisoned").ready.insert(l, read);
                cv.notify_all();
            }
        });
        SpineStream { walk: Mutex::new(()), streamed, bytes_read: Default::default(), shared, requests: Mutex::new(tx) }
    }

    /// Taken for a whole pass (see the field).
    pub(crate) fn pass(&self) -> std::sync::MutexGuard<'_, ()> {
        self.walk.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Spine bytes read so far.
    pub(crate) fn bytes_read(&self) -> u64 {
        self.bytes_read.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Starts reading streamed layer `l` if it is not on its way already.
    fn request(&self, l: usize) {
        let mut st = self.shared.0.lock().expect("poisoned");
        if st.requested.insert(l) {
            let _ = self.requests.lock().expect("poisoned").send(l);
        }
    }

    /// Makes layer `l` runnable: a streamed layer not loaded is read (or its read-ahead awaited)
    /// and loaded; then the next streamed layer (in pass order, wrapping to the next pass) is read
    /// ahead.
    pub(crate) fn ensure(&self, model: &Model, l: usize) -> Result<()> {
        if self.streamed[l] && !model.layer_loaded(l) {
            self.request(l);
            let (lock, cv) = &*self.shared;
            let mut st = lock.lock().expect("poisoned");
            let read = loop {
                if let Some(r) = st.ready.remove(&l) {
                    st.requested.remove(&l);
                    break r;
                }
                st = cv.wait(st).expect("poisoned");
            };
            drop(st);
            // The buffer goes once the layer's tensors are widened or lent into the model.
            let read = read?;
            self.bytes_read.fetch_add(read.len() as u64, std::sync::atomic::Ordering::Relaxed);
            model.load_layer(l, &read)?;
        }
        let n = self.streamed.len();
        if let Some(next) = (1..n).map(|d| (l + d) % n).find(|&k| self.streamed[k]) {
            if !model.layer_loaded(next) {
                self.request(next);
            }
        }
        Ok(())
    }

    /// Drops streamed layer `l` once it has run.
    pub(crate) fn release(&self, model: &Model, l: usize) {
        if self.streamed[l] {
            model.unload_layer(l);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_kept_in_order_while_they_fit() {
        assert_eq!(choose_resident(&[3, 3, 3], 100), (vec![true; 3], 9));
        assert_eq!(choose_resident(&[3, 3, 3], 7), (vec![true, true, false], 6));
        // Once one layer does not fit, the ones after stream too (no holes that shift reads).
        assert_eq!(choose_resident(&[3, 5, 1], 4), (vec![true, false, false], 3));
        assert_eq!(choose_resident(&[3, 3], 0), (vec![false, false], 0));
        assert_eq!(two_layers(&[5, 9, 2, 7]), 16);
        assert_eq!(two_layers(&[4]), 4);
    }

    #[test]
    fn the_spine_fits_whole_or_keeps_what_fits_above_its_minimum() {
        // 10 bytes of head and norms, a 20-byte embedding of 2 rows, layers of 30, 40, 30.
        let layers = [30, 40, 30];
        let whole = SpineFit::new(130, &layers, 20, 2, false, 130);
        assert_eq!((whole.resident_bytes, whole.streamed_layers(), whole.embed_by_row), (130, 0, false));
        // Minimum: 10 + 16 bytes of row checksums + the two largest layers (70).
        assert_eq!(whole.minimum, 96);
        let part = SpineFit::new(130, &layers, 20, 2, false, 126);
        assert_eq!((part.resident_bytes, &part.streamed, part.embed_by_row), (126, &vec![false, true, true], true));
        assert_eq!(part.read_per_pass(&layers), 70);
        // A tied embedding is the head: never read by row.
        assert!(!SpineFit::new(130, &layers, 20, 2, true, 100).embed_by_row);
    }
}
