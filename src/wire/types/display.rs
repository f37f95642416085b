//! `display.rfb` (a bmx extension, docs/protocol.md "Computer use"): the
//! harness asks the executor to dial out to its relay and carry the
//! session display's VNC (RFB) bytes, so no port is opened on the
//! executor's machine.

use super::AttachHost;

wire_struct! {
    /// `display.rfb {sessionId, host: {url, ticket}}`: dial `host.url`
    /// with `Authorization: Bearer <ticket>` and relay the session
    /// display's VNC server over that WebSocket as binary frames.
    pub struct DisplayRfbParams {
        pub session_id: String,
        pub host: AttachHost,
    }
}

wire_struct! {
    /// The answer of `display.rfb`, sent once the executor has dialed.
    pub struct DisplayRfbResult {
        pub accepted: bool,
        /// The session's X display (`:N`), started by this request if it
        /// was not running.
        pub display: String,
    }
}
