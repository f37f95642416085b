//! The harness (control plane) as a library.
