//! How much the CLI says besides its output (`-q`, `-v`): one setting for every command.

use std::sync::atomic::{AtomicU8, Ordering};

/// The levels, quietest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Quiet = 0,
    Normal = 1,
    Verbose = 2,
}

static LEVEL: AtomicU8 = AtomicU8::new(Level::Normal as u8);

/// Sets the level (once, first thing in `main`).
pub fn set(level: Level) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

/// `-q`: no progress bars or notes.
pub fn quiet() -> bool {
    LEVEL.load(Ordering::Relaxed) == Level::Quiet as u8
}

/// `-v`: stats and debug logs too.
pub fn verbose() -> bool {
    LEVEL.load(Ordering::Relaxed) == Level::Verbose as u8
}
