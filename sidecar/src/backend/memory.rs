//! In-process backend (being written).
