#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    bmx::fuzz::terminal_frame(data);
});
