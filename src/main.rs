//! The `bmx` binary: see `bmx --help`. The CLI and the `bmx bench` drivers
//! live here, not in the library: they are users of it.

mod bench;
mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
