//! Terminals: the numbered scrollback and the host-stream frames (sans-IO).

pub mod frame;
pub mod scrollback;
