//! Why the executor's connection stops, typed. ractor carries a stop
//! reason as a string; this is the one place the executor encodes its
//! reasons into that string and reads them back, so no caller formats or
//! parses `shutdown:*` / `lost:*` itself.
//!
//! A [`FinalStop`] is a *final* exit for the supervisor (`shutdown:<why>`,
//! see [`crate::supervisor::Exit`]): the connection is never restarted and,
//! being significant, ends the executor with [`super::ExecutorExit`]. A
//! lost connection is an abnormal exit: the restart is the reconnect.

use crate::supervisor::SHUTDOWN;
use crate::wire::CloseCode;

/// The connection ended for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalStop {
    /// Asked to stop (signal, `ExecutorHandle::shutdown`).
    Requested,
    /// A newer connection of the same executor id (close 4004).
    Replaced,
    /// The credential was refused (close 4001).
    CredentialRejected,
    /// The registration was refused (close 4003).
    RegistrationRefused,
    /// The upgrade was refused with HTTP 401.
    Unauthorized,
    /// The harness URL cannot be dialled.
    BadUrl,
    /// A drain completed.
    Drained,
}

impl FinalStop {
    const ALL: [FinalStop; 7] = [
        FinalStop::Requested,
        FinalStop::Replaced,
        FinalStop::CredentialRejected,
        FinalStop::RegistrationRefused,
        FinalStop::Unauthorized,
        FinalStop::BadUrl,
        FinalStop::Drained,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FinalStop::Requested => "requested",
            FinalStop::Replaced => "replaced",
            FinalStop::CredentialRejected => "credential_rejected",
            FinalStop::RegistrationRefused => "registration_refused",
            FinalStop::Unauthorized => "unauthorized",
            FinalStop::BadUrl => "bad_url",
            FinalStop::Drained => "drained",
        }
    }

    /// The `why` of a `shutdown:<why>` exit, read back. An empty `why` (a
    /// plain `shutdown`) is [`FinalStop::Requested`].
    pub fn parse(why: &str) -> Option<FinalStop> {
        if why.is_empty() {
            return Some(FinalStop::Requested);
        }
        FinalStop::ALL.into_iter().find(|f| f.as_str() == why)
    }

    /// The ractor stop reason for this final exit.
    pub fn reason(self) -> String {
        format!("{SHUTDOWN}:{}", self.as_str())
    }

    /// The close codes that forbid reconnecting (PROTOCOL.md §3.4).
    pub fn from_close(code: Option<CloseCode>) -> Option<FinalStop> {
        match code? {
            CloseCode::Replaced => Some(FinalStop::Replaced),
            CloseCode::CredentialRejected => Some(FinalStop::CredentialRejected),
            CloseCode::RegistrationRefused => Some(FinalStop::RegistrationRefused),
            _ => None,
        }
    }
}

/// The ractor stop reason of a lost connection (abnormal: restarted).
pub fn lost(detail: impl std::fmt::Display) -> String {
    format!("lost: {detail}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::supervisor::Exit;

    #[test]
    fn final_stops_round_trip_through_the_supervisor_and_lost_is_not_final() {
        for f in FinalStop::ALL {
            match Exit::from_reason(Some(&f.reason())) {
                Exit::Shutdown(why) => assert_eq!(FinalStop::parse(&why), Some(f)),
                other => panic!("{f:?} is not final: {other:?}"),
            }
        }
        assert!(matches!(
            Exit::from_reason(Some(&lost("heartbeat timeout"))),
            Exit::Abnormal(_)
        ));
        assert_eq!(FinalStop::parse("something else"), None);
    }
}
