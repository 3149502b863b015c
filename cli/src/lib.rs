//! prefixctl (in progress).
