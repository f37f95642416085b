//! The `bmx` binary: see `bmx --help`.

fn main() -> std::process::ExitCode {
    bmx::cli::main()
}
