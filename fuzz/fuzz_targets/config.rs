//! Any text given as a configuration file is either accepted or refused with
//! problems; parsing never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    let _ = dedupe_proxy::Config::from_yaml(text, None);
});
