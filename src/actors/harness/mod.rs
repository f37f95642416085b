//! Harness-side actors.
