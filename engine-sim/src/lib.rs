//! engine-sim (in progress).
