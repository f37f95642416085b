#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    bmx::fuzz::frame(bmx::wire::Codec::Json, data);
});
