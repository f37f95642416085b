//! Terminals: the numbered scrollback (sans-IO).

pub mod scrollback;
