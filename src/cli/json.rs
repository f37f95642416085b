//! Printing answers: one `--json` envelope line on stdout
//! (`bmx::runner::envelope`), or text for people. Either way the exit
//! status is 0 when the answer is a success and 1 when it is an error, so
//! a script gets the same verdict with and without `--json`.

use bmx::runner::envelope::{Response, ResponseError};
use serde::Serialize;
use std::process::ExitCode;

/// Exit status of every `ok: false` answer.
pub const EXIT_FAILED: u8 = 1;

/// Print `result` as one envelope line (`json`) or through `human`
/// (errors go to stderr as `bmx COMMAND: CODE: message`).
pub fn answer<T: Serialize>(
    json: bool,
    command: &str,
    target_id: Option<&str>,
    result: Result<T, ResponseError>,
    human: impl FnOnce(&T),
) -> ExitCode {
    match (json, result) {
        (true, r) => {
            let resp = match &r {
                Ok(data) => Response::success(data, target_id),
                Err(e) => Response::failure(e.clone(), target_id),
            };
            super::text::say_json(&resp.to_line());
            if resp.ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(EXIT_FAILED)
            }
        }
        (false, Ok(data)) => {
            human(&data);
            ExitCode::SUCCESS
        }
        (false, Err(e)) => {
            super::text::warn_line!("bmx {command}: {}: {}", e.code, e.message);
            ExitCode::from(EXIT_FAILED)
        }
    }
}
