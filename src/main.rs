//! The `bmx` binary: see `bmx --help`. The CLI and the `bmx bench` drivers
//! live here, not in the library: they are users of it.

mod alloc;
mod bench;
mod cli;

#[global_allocator]
static ALLOC: alloc::Split = alloc::Split;

fn main() -> std::process::ExitCode {
    cli::main()
}
